//! State shared by the replicas of one gateway fleet, kept in Redis
//! (`[state] redis = "redis://…"` in `kiln.toml`): tenants' quotas and
//! concurrency leases, fair-share counters, slots of shared upstream
//! pools, the active policy version (with a pub/sub bell), the replicas'
//! registry, and leases and records for governance.
//!
//! Every step that reads and writes is one Lua script ([`scripts`]), so
//! replicas never race on a read-modify-write, and scripts take the time
//! from Redis, so replicas' clocks need not agree. This module only talks
//! to Redis; what to do when it cannot (the operator's `on_unavailable`)
//! is the gateway's decision, which [`Store::is_up`] informs. A replica
//! that loses Redis notices on its next call: [`Store`] marks it down and
//! marks it up again on the first call that succeeds (the connection
//! manager reconnects by itself); the gateway logs the change.

pub mod budget;
pub mod keys;
pub mod scripts;

use redis::aio::ConnectionManager;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How long one call may take before it counts as Redis being down: well
/// above a loopback or same-zone round trip (0.1 to 1 ms), well below the
/// time a client would notice.
pub const CALL_TIMEOUT: Duration = Duration::from_millis(300);

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum StoreError {
    #[error("`[state] redis` is not a Redis URL kiln can use: {message}")]
    #[diagnostic(
        code(kiln::state::url),
        help(
            "write it as redis://HOST:PORT/DB (rediss:// for TLS), e.g. redis://127.0.0.1:6379/0"
        )
    )]
    Url { message: String },
    #[error("`[state]` TLS settings cannot be used: {message}")]
    #[diagnostic(
        code(kiln::state::tls),
        help("`ca_file`, `client_cert` and `client_key` in `[state]` are PEM files read at startup, and need a rediss:// URL")
    )]
    Tls { message: String },
    #[error("the shared state store (Redis) did not answer: {message}")]
    #[diagnostic(
        code(kiln::state::unreachable),
        help("check that Redis is running and reachable from this replica; `[state] on_unavailable` says what the gateway does meanwhile")
    )]
    Unreachable { message: String },
    #[error("the shared state store answered something kiln did not expect: {message}")]
    #[diagnostic(
        code(kiln::state::protocol),
        help("another program may be writing kiln's keys: give this fleet its own `[state] namespace`")
    )]
    Protocol { message: String },
}

/// How to reach the store and who this replica is.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub url: String,
    pub namespace: String,
    pub replica: String,
    pub lease: Duration,
    /// For `rediss://`: a custom CA, a client certificate (see
    /// [`crate::tls`]); the platform's roots when empty.
    pub tls: crate::tls::ClientTls,
}

/// A quota's limits as the shared quota enforces them (per second rates;
/// zero means no such limit).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Limits {
    pub requests_per_s: f64,
    pub tokens_per_s: f64,
    pub concurrent: u64,
    pub gpu_seconds_per_day: Option<f64>,
    /// The seconds of Redis's clock a bucket holds: a minute of policy
    /// time (60 s; less under `[sim] speed`). 0 reads as 60.
    pub bucket_s: f64,
}

/// The seconds a bucket holds (see [`Limits::bucket_s`]).
pub fn bucket_len(bucket_s: f64) -> f64 {
    if bucket_s.is_finite() && bucket_s > 0.0 {
        bucket_s
    } else {
        60.0
    }
}

impl Limits {
    pub fn any(&self) -> bool {
        self.requests_per_s > 0.0
            || self.tokens_per_s > 0.0
            || self.concurrent > 0
            || self.gpu_seconds_per_day.is_some()
    }
}

/// Whose quota: a tenant's, a tier's or a model's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuotaKind {
    Tenant,
    Tier,
    Model,
}

impl QuotaKind {
    pub fn name(self) -> &'static str {
        match self {
            QuotaKind::Tenant => "tenant",
            QuotaKind::Tier => "tier",
            QuotaKind::Model => "model",
        }
    }
}

/// One quota of the fleet: the tenant, tier or model it belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QuotaKey {
    pub kind: QuotaKind,
    pub name: String,
}

impl QuotaKey {
    pub fn new(kind: QuotaKind, name: &str) -> QuotaKey {
        QuotaKey {
            kind,
            name: name.to_string(),
        }
    }

    /// Its buckets' hash and its concurrency leases' set (a tenant's keep
    /// the names they always had).
    fn parts(&self) -> ([&str; 2], [&str; 2]) {
        match self.kind {
            QuotaKind::Tenant => (["quota", &self.name], ["leases", &self.name]),
            QuotaKind::Tier => (["tier-quota", &self.name], ["tier-leases", &self.name]),
            QuotaKind::Model => (["model-quota", &self.name], ["model-leases", &self.name]),
        }
    }
}

/// The share of each of a quota's buckets left (`None`: no such bucket);
/// below zero where reported spending ran it into debt.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Level {
    pub requests: Option<f64>,
    pub tokens: Option<f64>,
}

/// One quota in a claim: its limits (per second, as Redis's clock runs)
/// and, where Redis holds no bucket for it, the share to start it at
/// ([`budget::Budget::seed`]; `None`: full).
#[derive(Debug, Clone)]
pub struct QuotaClaim {
    pub key: QuotaKey,
    pub limits: Limits,
    pub seed: Level,
}

/// One quota in a sync ([`Store::sync_quotas`]): what this replica spent
/// of it by itself since the last sync.
#[derive(Debug, Clone)]
pub struct QuotaSync {
    pub key: QuotaKey,
    pub requests_per_s: f64,
    pub tokens_per_s: f64,
    pub spent_requests: f64,
    pub spent_tokens: f64,
    /// GPU-seconds used (0 for a quota without a GPU-seconds limit).
    pub spent_gpu_seconds: f64,
    pub seed: Level,
    /// See [`Limits::bucket_s`].
    pub bucket_s: f64,
}

/// The answer to a quota claim.
#[derive(Debug, Clone, PartialEq)]
pub enum Claimed {
    /// Every quota's level after the claim, in the claim's order.
    Granted(Vec<Level>),
    /// Which quota and which of its limits refused (`requests`, `tokens`,
    /// `concurrency`, `gpu-seconds`), and when a retry could pass.
    Refused {
        quota: Option<QuotaKey>,
        limit: String,
        retry_ms: u64,
    },
}

fn seed_arg(x: Option<f64>) -> f64 {
    match x {
        Some(f) if f.is_finite() => f.clamp(0.0, 1.0),
        _ => -1.0,
    }
}

fn fraction(v: Option<&redis::Value>) -> Option<f64> {
    let s = match v {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        Some(redis::Value::Int(i)) => return Some(*i as f64),
        _ => return None,
    };
    s.parse::<f64>().ok().filter(|f| f.is_finite())
}

/// One replica as the registry knows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReplicaInfo {
    pub id: String,
    /// The policy version it decides with.
    pub version: String,
    /// The policy epoch it has applied (see [`SharedPolicy::epoch`]).
    pub epoch: u64,
    pub started_unix_ms: u64,
    pub seen_unix_ms: u64,
    pub in_flight: u64,
}

/// The fleet's policy: every activation bumps `epoch`.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPolicy {
    pub epoch: u64,
    pub version: String,
    pub files: BTreeMap<String, String>,
}

/// A hash-chained record as [`Store::chain_read`] found it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChainRead {
    /// The state written with the chain's last extension, if any.
    pub state: Option<Vec<u8>>,
    /// The chain's head hash (`None` before its first line).
    pub head: Option<String>,
    /// How many lines the chain holds.
    pub len: u64,
    /// The side record (short-lived, see [`ChainCommit::side`]), if any.
    pub side: Option<Vec<u8>>,
    /// The lines from the one asked for to the end (from the oldest kept
    /// where that one was trimmed: see `checkpoint`).
    pub lines: Vec<String>,
    /// Where the lines kept start, when the oldest were trimmed.
    pub checkpoint: Option<Checkpoint>,
}

/// The lines trimmed from a chain's start ([`ChainCommit::keep`]): how
/// many, the hash of the last (the first kept line chains to it), and
/// what the writer kept of them ([`ChainCommit::checkpoint_extra`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Checkpoint {
    pub entries: u64,
    pub head: String,
    pub extra: Vec<u8>,
}

/// One extension of a hash-chained record (see [`Store::chain_commit`]).
#[derive(Debug, Clone, Default)]
pub struct ChainCommit {
    /// The chain's length and head as the writer read them.
    pub expected_len: u64,
    pub expected_head: Option<String>,
    /// The lines to append and the head they end on.
    pub lines: Vec<String>,
    pub new_head: String,
    /// The state to store with them, if it changed.
    pub state: Option<Vec<u8>>,
    /// The side record: `Some(None)` deletes it, `Some(Some(bytes))`
    /// writes it for `side_ms` (it vanishes when its writer stops
    /// renewing it).
    pub side: Option<Option<Vec<u8>>>,
    pub side_ms: u64,
    /// The most lines the store keeps (0: all): over it, the oldest are
    /// trimmed to three quarters of it and a [`Checkpoint`] stands for
    /// them.
    pub keep: u64,
    /// Stored with the checkpoint when this commit trims (what a reader
    /// starting from it needs of the lines it cannot read).
    pub checkpoint_extra: Vec<u8>,
}

/// How [`Store::chain_commit`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    Written,
    /// This replica no longer holds the lease.
    NotHeld,
    /// The chain moved since the writer read it.
    Moved,
}

/// How long a replica holds an extra slot of a shared upstream when its
/// share of the slots is not whole ([`scripts`]: `SLOTS`): long against a
/// request's time on the upstream (a slot given back is free only when the
/// request on it ends), short against the windows shares are judged over.
pub const SLOT_EPOCH_MS: u64 = 1000;

/// How long a granted claim's marker outlives a replica that neither
/// released nor took it back (it died): long against an outage a replica
/// rides out, short against the keys it would pile up.
pub const CLAIM_MARKER_MS: u64 = 3_600_000;

/// How long Redis remembers the last spending report it charged for a
/// replica (a report is resent until its answer arrives).
pub const REPORT_MS: u64 = 86_400_000;
/// The Redis client for `cfg.url`: over TLS for `rediss://`, with the
/// platform's roots or `cfg.tls`'s CA and client certificate.
fn client(cfg: &StoreConfig) -> Result<redis::Client, StoreError> {
    let url = cfg.url.trim();
    let tls_url = url.starts_with("rediss://");
    if !cfg.tls.is_set() {
        if tls_url {
            crate::tls::install_default_provider();
        }
        return redis::Client::open(url).map_err(|e| StoreError::Url {
            message: e.to_string(),
        });
    }
    if !tls_url {
        return Err(StoreError::Tls {
            message: "`ca_file`, `client_cert` or `client_key` is set, but `redis` is not a rediss:// URL".into(),
        });
    }
    let pem = cfg.tls.read_pem().map_err(|e| StoreError::Tls {
        message: e.to_string(),
    })?;
    crate::tls::install_default_provider();
    redis::Client::build_with_tls(
        url,
        redis::TlsCertificates {
            client_tls: pem
                .identity
                .map(|(client_cert, client_key)| redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                }),
            root_cert: pem.ca,
        },
    )
    .map_err(|e| StoreError::Tls {
        message: e.to_string(),
    })
}

/// A Redis error's text; a TLS failure's with what it usually means.
fn redis_error_text(e: &redis::RedisError) -> String {
    crate::tls::tls_cause(e).unwrap_or_else(|| e.to_string())
}

/// A connection to the shared store.
pub struct Store {
    client: redis::Client,
    conn: ConnectionManager,
    ns: String,
    replica: String,
    lease_ms: u64,
    up: AtomicBool,
    failures: AtomicU64,
    scripts: scripts::Scripts,
}

impl Store {
    /// Opens the store without waiting for Redis: the first call connects,
    /// so a gateway starts (and declares its `on_unavailable` behaviour)
    /// even while Redis is down.
    pub fn open(cfg: &StoreConfig) -> Result<Store, StoreError> {
        let client = client(cfg)?;
        let mc = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CALL_TIMEOUT))
            .set_response_timeout(Some(CALL_TIMEOUT))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), mc).map_err(|e| {
            StoreError::Url {
                message: e.to_string(),
            }
        })?;
        Ok(Store {
            client,
            conn,
            ns: cfg.namespace.clone(),
            replica: cfg.replica.clone(),
            lease_ms: cfg.lease.as_millis().clamp(1, u128::from(u32::MAX)) as u64,
            up: AtomicBool::new(true),
            failures: AtomicU64::new(0),
            scripts: scripts::Scripts::new(),
        })
    }

    pub fn replica(&self) -> &str {
        &self.replica
    }

    pub fn lease_ms(&self) -> u64 {
        self.lease_ms
    }

    /// Whether the last call reached Redis.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Calls that failed since the start.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// `namespace:part:part…`
    pub fn key(&self, parts: &[&str]) -> String {
        let mut k = self.ns.clone();
        for p in parts {
            k.push(':');
            k.push_str(p);
        }
        k
    }

    /// The channel on which activations are announced.
    pub fn policy_channel(&self) -> String {
        self.key(&["policy", "events"])
    }

    /// Runs one call with the timeout, noting whether Redis answered.
    async fn call<T>(
        &self,
        f: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        let out = match tokio::time::timeout(CALL_TIMEOUT, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e))
                if e.kind() == redis::ErrorKind::Parse
                    || e.kind() == redis::ErrorKind::UnexpectedReturnType =>
            {
                Err(StoreError::Protocol {
                    message: e.to_string(),
                })
            }
            Ok(Err(e)) => Err(StoreError::Unreachable {
                message: redis_error_text(&e),
            }),
            Err(_) => Err(StoreError::Unreachable {
                message: format!("no answer within {} ms", CALL_TIMEOUT.as_millis()),
            }),
        };
        // The gateway's heartbeat reports a change (log line and metric),
        // saying what its `on_unavailable` does meanwhile.
        match &out {
            Err(StoreError::Unreachable { message }) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                if self.up.swap(false, Ordering::Relaxed) {
                    tracing::debug!(replica = %self.replica, error = %message, "a call to the shared state store failed");
                }
            }
            _ => self.up.store(true, Ordering::Relaxed),
        }
        out
    }

    /// A round trip, for health checks.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut c = self.conn.clone();
        self.call(async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
            .map(|_| ())
    }

    fn quota_keys(&self, q: &QuotaKey) -> (String, String) {
        let (h, l) = q.parts();
        (self.key(&h), self.key(&l))
    }

    /// Claims one request (and `need_tokens`) of every quota in `quotas`
    /// (a tenant's, its tier's, its model's), with a concurrency lease
    /// named `member` in each that limits concurrency, atomically across
    /// the fleet: all of them or none.
    pub async fn claim(
        &self,
        quotas: &[QuotaClaim],
        member: &str,
        need_tokens: f64,
    ) -> Result<Claimed, StoreError> {
        if quotas.is_empty() {
            return Ok(Claimed::Granted(Vec::new()));
        }
        let mut inv = self.scripts.claim.prepare_invoke();
        for q in quotas {
            let (h, l) = self.quota_keys(&q.key);
            inv.key(h).key(l);
        }
        inv.key(self.claim_marker(member));
        inv.arg(need_tokens.max(0.0)).arg(member).arg(self.lease_ms);
        for q in quotas {
            inv.arg(q.limits.requests_per_s.max(0.0))
                .arg(q.limits.tokens_per_s.max(0.0))
                .arg(q.limits.concurrent)
                .arg(q.limits.gpu_seconds_per_day.unwrap_or(-1.0))
                .arg(seed_arg(q.seed.requests))
                .arg(seed_arg(q.seed.tokens))
                .arg(bucket_len(q.limits.bucket_s));
        }
        inv.arg(CLAIM_MARKER_MS);
        let mut c = self.conn.clone();
        let v: Vec<redis::Value> = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        let int = |v: Option<&redis::Value>| match v {
            Some(redis::Value::Int(i)) => Some(*i),
            _ => None,
        };
        match int(v.first()) {
            Some(1) => Ok(Claimed::Granted(
                (0..quotas.len())
                    .map(|i| Level {
                        requests: fraction(v.get(1 + 2 * i)),
                        tokens: fraction(v.get(2 + 2 * i)),
                    })
                    .collect(),
            )),
            Some(0) => {
                let limit = match v.get(1) {
                    Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                    Some(redis::Value::SimpleString(s)) => s.clone(),
                    _ => "quota".into(),
                };
                let retry_ms = int(v.get(2)).unwrap_or(1000).max(1) as u64;
                let quota = int(v.get(3))
                    .and_then(|i| usize::try_from(i - 1).ok())
                    .and_then(|i| quotas.get(i))
                    .map(|q| q.key.clone());
                Ok(Claimed::Refused {
                    quota,
                    limit,
                    retry_ms,
                })
            }
            _ => Err(StoreError::Protocol {
                message: format!("the quota script answered {v:?}"),
            }),
        }
    }

    /// A claimed request ended: for each quota it claimed (with its
    /// tokens/s and whether it limits GPU-seconds), refund `refund` tokens,
    /// drop the lease `member` and charge `gpu_seconds`.
    pub async fn release(
        &self,
        quotas: &[(QuotaKey, f64, bool, f64)],
        member: &str,
        refund: f64,
        gpu_seconds: f64,
    ) -> Result<(), StoreError> {
        if quotas.is_empty() {
            return Ok(());
        }
        let mut inv = self.scripts.release.prepare_invoke();
        for (q, _, _, _) in quotas {
            let (h, l) = self.quota_keys(q);
            inv.key(h).key(l);
        }
        inv.key(self.claim_marker(member));
        inv.arg(refund.max(0.0))
            .arg(member)
            .arg(if gpu_seconds.is_finite() {
                gpu_seconds.max(0.0)
            } else {
                0.0
            });
        for (_, tokens_per_s, gpu, bucket_s) in quotas {
            inv.arg(tokens_per_s.max(0.0))
                .arg(if *gpu { "1" } else { "0" })
                .arg(bucket_len(*bucket_s));
        }
        let mut c = self.conn.clone();
        self.call(async move { inv.invoke_async::<i64>(&mut c).await })
            .await
            .map(|_| ())
    }

    /// Takes back the claim `member` made of `quotas` (`need` tokens) if
    /// it was granted and is still held ([`scripts`]: `UNCLAIM`): for a
    /// claim whose answer never came back, so that the request, decided
    /// by this replica alone and reported with its spending, is charged
    /// once. True when something was given back.
    pub async fn unclaim(
        &self,
        quotas: &[(QuotaKey, Limits)],
        member: &str,
        need: f64,
    ) -> Result<bool, StoreError> {
        let mut inv = self.scripts.unclaim.prepare_invoke();
        for (q, _) in quotas {
            let (h, l) = self.quota_keys(q);
            inv.key(h).key(l);
        }
        inv.key(self.claim_marker(member));
        inv.arg(if need.is_finite() { need.max(0.0) } else { 0.0 })
            .arg(member);
        for (_, l) in quotas {
            inv.arg(l.requests_per_s.max(0.0))
                .arg(l.tokens_per_s.max(0.0))
                .arg(bucket_len(l.bucket_s));
        }
        let mut c = self.conn.clone();
        let n: i64 = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        Ok(n == 1)
    }

    /// The marker a granted claim leaves until it is released.
    fn claim_marker(&self, member: &str) -> String {
        self.key(&["claim", member])
    }

    /// Charges what this replica spent of each quota by itself (the report
    /// `report`, charged once however often it is sent; "" for none) and
    /// reads the fleet's levels back, in `items`' order ([`scripts`]:
    /// `SYNC`).
    pub async fn sync_quotas(
        &self,
        report: &str,
        items: &[QuotaSync],
    ) -> Result<Vec<Level>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = self.scripts.sync.prepare_invoke();
        for q in items {
            inv.key(self.quota_keys(&q.key).0);
        }
        inv.key(self.key(&["reported", &self.replica]));
        inv.arg(report).arg(REPORT_MS);
        let finite = |x: f64| if x.is_finite() { x } else { 0.0 };
        for q in items {
            inv.arg(q.requests_per_s.max(0.0))
                .arg(q.tokens_per_s.max(0.0))
                .arg(finite(q.spent_requests))
                .arg(finite(q.spent_tokens))
                .arg(seed_arg(q.seed.requests))
                .arg(seed_arg(q.seed.tokens))
                .arg(bucket_len(q.bucket_s))
                .arg(finite(q.spent_gpu_seconds).max(0.0));
        }
        let mut c = self.conn.clone();
        let v: Vec<redis::Value> = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        if v.len() != 2 * items.len() {
            return Err(StoreError::Protocol {
                message: format!(
                    "the quota sync answered {} values for {}",
                    v.len(),
                    items.len()
                ),
            });
        }
        Ok((0..items.len())
            .map(|i| Level {
                requests: fraction(v.get(2 * i)),
                tokens: fraction(v.get(2 * i + 1)),
            })
            .collect())
    }

    /// Renews this replica's concurrency leases, quota by quota.
    pub async fn renew(&self, leases: &BTreeMap<QuotaKey, Vec<String>>) -> Result<(), StoreError> {
        if leases.is_empty() {
            return Ok(());
        }
        // One script call per quota: a handful have concurrency limits,
        // and a call renews all of a quota's leases.
        for (q, members) in leases {
            if members.is_empty() {
                continue;
            }
            let (_, l) = self.quota_keys(q);
            let mut inv = self.scripts.renew.prepare_invoke();
            inv.key(l).arg(self.lease_ms);
            for m in members {
                inv.arg(m);
            }
            let mut c = self.conn.clone();
            self.call(async move { inv.invoke_async::<i64>(&mut c).await })
                .await?;
        }
        Ok(())
    }

    /// Folds `deltas` (tenant → service since the last call) into one
    /// queue's fleet-wide fair-share counters and returns all of them.
    pub async fn share(
        &self,
        queue: &str,
        decay_ms: u64,
        deltas: &[(String, f64)],
    ) -> Result<Vec<(String, f64)>, StoreError> {
        let mut inv = self.scripts.share.prepare_invoke();
        inv.key(self.key(&["share", queue])).arg(decay_ms);
        for (t, d) in deltas {
            inv.arg(t).arg(if d.is_finite() { *d } else { 0.0 });
        }
        let mut c = self.conn.clone();
        let flat: Vec<String> = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        Ok(flat
            .chunks(2)
            .filter_map(|p| match p {
                [t, v] => v
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite())
                    .map(|v| (t.clone(), v)),
                _ => None,
            })
            .collect())
    }

    /// Slots of a shared upstream (`upstream`: a stable key for it):
    /// asks for `want` of `capacity` over the fleet, holding at least
    /// `busy`, with `tenants` (name, fair-share weight) backlogged here;
    /// returns what this replica holds now ([`scripts`] says how they are
    /// split).
    pub async fn slots(
        &self,
        upstream: &str,
        want: u64,
        busy: u64,
        capacity: u64,
        tenants: &[(String, f64)],
        in_force: u64,
    ) -> Result<u64, StoreError> {
        let list = tenants
            .iter()
            .filter(|(_, w)| w.is_finite() && *w > 0.0)
            .map(|(t, w)| format!("{t}={w}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut inv = self.scripts.slots.prepare_invoke();
        inv.key(self.key(&["slots", upstream, "held"]))
            .key(self.key(&["slots", upstream, "expiry"]))
            .key(self.key(&["slots", upstream, "demand"]))
            .key(self.key(&["slots", upstream, "turns"]))
            .arg(&self.replica)
            .arg(want.min(capacity))
            .arg(busy)
            .arg(capacity)
            .arg(self.lease_ms)
            .arg(list)
            .arg(in_force.min(capacity))
            .arg(SLOT_EPOCH_MS);
        let mut c = self.conn.clone();
        let n: i64 = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        Ok(n.max(0) as u64)
    }

    /// A money budget's period (`parts` name it): writes what this replica
    /// spent of it (`spent`, its total for the period) and answers (what
    /// the fleet keeps as this replica's total, what the others spent).
    pub async fn budget(&self, parts: &[&str], spent: f64) -> Result<(f64, f64), StoreError> {
        // A month's period and then some: a period is read while it runs.
        const KEEP_S: u64 = 40 * 86_400;
        let mut inv = self.scripts.budget.prepare_invoke();
        let mut key = vec!["budget"];
        key.extend_from_slice(parts);
        inv.key(self.key(&key))
            .arg(&self.replica)
            .arg(if spent.is_finite() {
                spent.max(0.0)
            } else {
                0.0
            })
            .arg(KEEP_S);
        let mut c = self.conn.clone();
        let (own, others): (String, String) = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        let num = |s: &str| {
            s.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite())
                .unwrap_or(0.0)
        };
        Ok((num(&own), num(&others).max(0.0)))
    }

    /// Says this replica is alive (for a lease's time) and what it runs.
    pub async fn heartbeat(&self, info: &ReplicaInfo) -> Result<(), StoreError> {
        let json = serde_json::to_string(info).map_err(|e| StoreError::Protocol {
            message: e.to_string(),
        })?;
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(self.key(&["replica", &info.id]))
            .arg(json)
            .arg("PX")
            .arg(self.lease_ms)
            .ignore()
            .cmd("SADD")
            .arg(self.key(&["replicas"]))
            .arg(&info.id)
            .ignore();
        let mut c = self.conn.clone();
        self.call(async move { pipe.query_async::<()>(&mut c).await })
            .await
    }

    /// The replicas alive now (a lease's time since their last heartbeat),
    /// by id. Those whose lease ran out are dropped from the registry.
    pub async fn replicas(&self) -> Result<Vec<ReplicaInfo>, StoreError> {
        let set = self.key(&["replicas"]);
        let mut c = self.conn.clone();
        let s2 = set.clone();
        let ids: Vec<String> = self
            .call(async move { redis::cmd("SMEMBERS").arg(s2).query_async(&mut c).await })
            .await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = ids.iter().map(|i| self.key(&["replica", i])).collect();
        let mut c = self.conn.clone();
        let vals: Vec<Option<String>> = self
            .call(async move { redis::cmd("MGET").arg(keys).query_async(&mut c).await })
            .await?;
        let mut out = Vec::new();
        let mut gone = Vec::new();
        for (id, v) in ids.iter().zip(vals) {
            match v.and_then(|v| serde_json::from_str::<ReplicaInfo>(&v).ok()) {
                Some(r) => out.push(r),
                None => gone.push(id.clone()),
            }
        }
        if !gone.is_empty() {
            let mut c = self.conn.clone();
            let _ = self
                .call(async move {
                    redis::cmd("SREM")
                        .arg(set)
                        .arg(gone)
                        .query_async::<i64>(&mut c)
                        .await
                })
                .await;
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// Makes `files` the fleet's policy and rings the bell; the new epoch.
    pub async fn publish_policy(
        &self,
        version: &str,
        files: &BTreeMap<String, String>,
    ) -> Result<u64, StoreError> {
        let json = serde_json::to_string(files).map_err(|e| StoreError::Protocol {
            message: e.to_string(),
        })?;
        let mut inv = self.scripts.policy.prepare_invoke();
        inv.key(self.key(&["policy"]))
            .arg(version)
            .arg(json)
            .arg(self.policy_channel());
        let mut c = self.conn.clone();
        let e: i64 = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        Ok(e.max(0) as u64)
    }

    /// The fleet's policy epoch (0: none published yet).
    pub async fn policy_epoch(&self) -> Result<u64, StoreError> {
        let mut c = self.conn.clone();
        let k = self.key(&["policy"]);
        let e: Option<u64> = self
            .call(async move {
                redis::cmd("HGET")
                    .arg(k)
                    .arg("epoch")
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(e.unwrap_or(0))
    }

    /// The fleet's policy, if one was published.
    pub async fn policy(&self) -> Result<Option<SharedPolicy>, StoreError> {
        let mut c = self.conn.clone();
        let k = self.key(&["policy"]);
        let (epoch, version, files): (Option<u64>, Option<String>, Option<String>) = self
            .call(async move {
                redis::cmd("HMGET")
                    .arg(k)
                    .arg("epoch")
                    .arg("version")
                    .arg("files")
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let (Some(epoch), Some(version), Some(files)) = (epoch, version, files) else {
            return Ok(None);
        };
        let files: BTreeMap<String, String> =
            serde_json::from_str(&files).map_err(|e| StoreError::Protocol {
                message: format!("the shared policy's files: {e}"),
            })?;
        Ok(Some(SharedPolicy {
            epoch,
            version,
            files,
        }))
    }

    /// A subscription to activation announcements (each message is an
    /// epoch). Its own connection: a subscribed connection can do nothing
    /// else.
    pub async fn subscribe_policy(&self) -> Result<redis::aio::PubSub, StoreError> {
        let client = self.client.clone();
        let ch = self.policy_channel();
        self.call(async move {
            let mut ps = client.get_async_pubsub().await?;
            ps.subscribe(ch).await?;
            Ok(ps)
        })
        .await
    }

    /// Takes or renews the lease `name` for `ms` (as this replica); true
    /// when this replica holds it now.
    pub async fn lease(&self, name: &str, ms: u64) -> Result<bool, StoreError> {
        let mut inv = self.scripts.lease.prepare_invoke();
        inv.key(self.key(&["lease", name]))
            .arg(&self.replica)
            .arg(ms.max(1));
        let mut c = self.conn.clone();
        let n: i64 = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        Ok(n == 1)
    }

    /// Gives the lease `name` back if this replica holds it.
    pub async fn unlease(&self, name: &str) -> Result<(), StoreError> {
        let mut inv = self.scripts.unlease.prepare_invoke();
        inv.key(self.key(&["lease", name])).arg(&self.replica);
        let mut c = self.conn.clone();
        self.call(async move { inv.invoke_async::<i64>(&mut c).await })
            .await
            .map(|_| ())
    }

    fn chain_keys(&self, prefix: &str) -> [String; 5] {
        [
            self.key(&[prefix, "state"]),
            self.key(&[prefix, "audit"]),
            self.key(&[prefix, "audit", "head"]),
            self.key(&[prefix, "rollout"]),
            self.key(&[prefix, "audit", "checkpoint"]),
        ]
    }

    /// The hash-chained record under `prefix` (its state, chain head and
    /// length, side record, and its lines from `start`), read atomically.
    pub async fn chain_read(&self, prefix: &str, start: u64) -> Result<ChainRead, StoreError> {
        let [state, list, head, side, cp] = self.chain_keys(prefix);
        let mut inv = self.scripts.chain_read.prepare_invoke();
        inv.key(state)
            .key(list)
            .key(head)
            .key(side)
            .key(cp)
            .arg(start);
        let mut c = self.conn.clone();
        let v: Vec<redis::Value> = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        let bytes = |v: Option<&redis::Value>| -> Result<Option<Vec<u8>>, StoreError> {
            match v {
                Some(redis::Value::BulkString(b)) if b.is_empty() => Ok(None),
                Some(redis::Value::BulkString(b)) => Ok(Some(b.clone())),
                Some(redis::Value::SimpleString(s)) if s.is_empty() => Ok(None),
                Some(redis::Value::SimpleString(s)) => Ok(Some(s.clone().into_bytes())),
                Some(redis::Value::Nil) => Ok(None),
                other => Err(StoreError::Protocol {
                    message: format!("the chain read answered {other:?}"),
                }),
            }
        };
        let text = |b: Vec<u8>| {
            String::from_utf8(b).map_err(|e| StoreError::Protocol {
                message: format!("a chain line is not UTF-8: {e}"),
            })
        };
        let count = |i: usize, what: &str| match v.get(i) {
            Some(redis::Value::Int(n)) => Ok((*n).max(0) as u64),
            other => Err(StoreError::Protocol {
                message: format!("the chain read's {what} is {other:?}"),
            }),
        };
        let len = count(2, "length")?;
        let trimmed = count(4, "checkpoint")?;
        let mut lines = Vec::new();
        for l in v.iter().skip(7) {
            if let Some(b) = bytes(Some(l))? {
                lines.push(text(b)?);
            }
        }
        let checkpoint = if trimmed > 0 {
            Some(Checkpoint {
                entries: trimmed,
                head: bytes(v.get(5))?.map(text).transpose()?.unwrap_or_default(),
                extra: bytes(v.get(6))?.unwrap_or_default(),
            })
        } else {
            None
        };
        Ok(ChainRead {
            state: bytes(v.first())?,
            head: bytes(v.get(1))?.map(text).transpose()?,
            len,
            side: bytes(v.get(3))?,
            lines,
            checkpoint,
        })
    }

    /// Extends the hash-chained record under `prefix` as `commit` says,
    /// atomically, if this replica holds the lease `lease` and the chain
    /// still has the length and head the commit expects.
    pub async fn chain_commit(
        &self,
        prefix: &str,
        lease: &str,
        commit: &ChainCommit,
    ) -> Result<Committed, StoreError> {
        let [state, list, head, side, cp] = self.chain_keys(prefix);
        let mut inv = self.scripts.chain_commit.prepare_invoke();
        inv.key(self.key(&["lease", lease]))
            .key(list)
            .key(head)
            .key(state)
            .key(side)
            .key(cp)
            .arg(&self.replica)
            .arg(commit.expected_len)
            .arg(commit.expected_head.as_deref().unwrap_or(""))
            .arg(&commit.new_head)
            .arg(if commit.state.is_some() { "1" } else { "0" })
            .arg(commit.state.as_deref().unwrap_or(b""))
            .arg(if commit.side.is_some() { "1" } else { "0" })
            .arg(commit.side.clone().flatten().unwrap_or_default())
            .arg(commit.side_ms.max(1))
            .arg(commit.keep)
            .arg(commit.checkpoint_extra.as_slice());
        for l in &commit.lines {
            inv.arg(l);
        }
        let mut c = self.conn.clone();
        let n: i64 = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        Ok(match n {
            1 => Committed::Written,
            0 => Committed::NotHeld,
            _ => Committed::Moved,
        })
    }

    /// The bytes at `key` (under the namespace), if any.
    pub async fn get(&self, key: &[&str]) -> Result<Option<Vec<u8>>, StoreError> {
        let mut c = self.conn.clone();
        let k = self.key(key);
        self.call(async move { redis::cmd("GET").arg(k).query_async(&mut c).await })
            .await
    }

    /// Stores `value` at `key` (under the namespace).
    pub async fn set(&self, key: &[&str], value: &[u8]) -> Result<(), StoreError> {
        let mut c = self.conn.clone();
        let k = self.key(key);
        let v = value.to_vec();
        self.call(async move {
            redis::cmd("SET")
                .arg(k)
                .arg(v)
                .query_async::<()>(&mut c)
                .await
        })
        .await
    }

    /// Appends `lines` to the list at `key`; its new length.
    pub async fn append(&self, key: &[&str], lines: &[String]) -> Result<u64, StoreError> {
        if lines.is_empty() {
            return self.len(key).await;
        }
        let mut c = self.conn.clone();
        let k = self.key(key);
        let l = lines.to_vec();
        self.call(async move { redis::cmd("RPUSH").arg(k).arg(l).query_async(&mut c).await })
            .await
    }

    /// The list at `key`, from `start` (0-based) to its end.
    pub async fn lines(&self, key: &[&str], start: u64) -> Result<Vec<String>, StoreError> {
        let mut c = self.conn.clone();
        let k = self.key(key);
        self.call(async move {
            redis::cmd("LRANGE")
                .arg(k)
                .arg(start)
                .arg(-1)
                .query_async(&mut c)
                .await
        })
        .await
    }

    /// The length of the list at `key`.
    pub async fn len(&self, key: &[&str]) -> Result<u64, StoreError> {
        let mut c = self.conn.clone();
        let k = self.key(key);
        self.call(async move { redis::cmd("LLEN").arg(k).query_async(&mut c).await })
            .await
    }
}

/// This replica's default name: `$HOSTNAME` (a pod's name on Kubernetes)
/// and the process id, so two processes on one host differ; a second
/// gateway in the same process (tests) adds a count, so that the registry
/// counts each.
pub fn default_replica_name() -> String {
    static OPENED: AtomicU64 = AtomicU64::new(0);
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty() && h.len() <= 100 && h.bytes().all(|b| b.is_ascii_graphic()))
        .unwrap_or_else(|| "kiln".into());
    match OPENED.fetch_add(1, Ordering::Relaxed) {
        0 => format!("{host}-{}", std::process::id()),
        n => format!("{host}-{}-{}", std::process::id(), n + 1),
    }
}
