//! One replica of a fleet that shares state through Redis
//! (`[state] redis = "redis://…"`): the gateway's side of [`crate::shared`].
//!
//! - **Quotas**: before a request reaches the scheduler, the tenant it
//!   names claims one request, its tokens (prompt plus `max_tokens`,
//!   refunded at the end to what it used), a concurrency lease and its
//!   GPU-seconds budget in one atomic script ([`Fleet::claim`]). The
//!   scheduler then counts it in flight without charging its own buckets.
//!   Leases are renewed by the heartbeat and expire a lease's time after a
//!   replica stops (a `kill -9`).
//! - **Policy version**: an activation here is published with a new epoch
//!   and announced on a channel; every replica applies the newest epoch
//!   (on the announcement, or at the latest on its next poll), and a
//!   request that arrives while an announced epoch is being applied waits
//!   for it, so no replica decides with a version the fleet has left.
//! - **Registry**: each replica's heartbeat says which version it runs
//!   (`kiln status`, `GET /admin/replicas`).
//! - **Redis unreachable**: the operator's `on_unavailable`. `local`:
//!   requests are not claimed, the scheduler enforces 1/`replicas` of
//!   each limit (set at start, [`crate::sched::Config::quota_scale`]);
//!   `refuse`: 503 `shared-state-unavailable`. Either way a metric
//!   (`kiln_shared_state_up`) and one log line at each change, and the
//!   next successful call resumes sharing.

use super::config::{OnUnavailable, StateSection};
use super::App;
use crate::graph::{DecisionGraph, Request};
use crate::shared::{Claimed, Limits, ReplicaInfo, Store, StoreConfig};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often a replica looks for a policy epoch it missed (a lost
/// announcement, or a reconnect after Redis was down).
const POLICY_POLL: Duration = Duration::from_millis(500);

/// How long a request waits for an announced version to be applied here
/// before it is decided by the version in place.
const VERSION_WAIT: Duration = Duration::from_secs(2);

pub struct Fleet {
    /// Shared with governance, which keeps its records in the same store.
    pub store: Arc<Store>,
    pub on_unavailable: OnUnavailable,
    pub replicas: u32,
    /// Policy time per wall time (`[sim] speed`): Redis refills buckets by
    /// its wall clock, so rates are sped up alike.
    speed: f64,
    /// The newest epoch announced, and the one this replica applied.
    seen: AtomicU64,
    applied: tokio::sync::watch::Sender<u64>,
    /// Concurrency leases this replica holds: tenant → request ids.
    leases: Mutex<BTreeMap<String, BTreeSet<String>>>,
    started_ms: u64,
    /// Whether the last heartbeat reached Redis (for the log and gauge).
    was_up: AtomicBool,
    /// A version activated here while Redis was unreachable: announced
    /// as soon as it answers.
    unannounced: AtomicBool,
}

/// What the shared quota said about one request.
pub enum Gate {
    /// Claimed: released when the request ends.
    Claimed(Arc<Claim>),
    /// Nothing to claim (no tenant, or one without limits).
    Free,
    /// Refused by a limit, with when a retry could pass.
    Refused { limit: String, retry_ms: u64 },
    /// Redis did not answer: the gateway applies `on_unavailable`.
    Unavailable,
}

/// One request's claim on its tenant's shared quota. Released once: when
/// the scheduler reports how it ended ([`Claim::finish`]), or else when the
/// last holder drops it (charged in full, since what it used is unknown).
pub struct Claim {
    fleet: Arc<Fleet>,
    tenant: String,
    member: String,
    tokens_per_s: f64,
    need: f64,
    prompt: f64,
    done: AtomicBool,
}

impl Claim {
    /// Whether it was released already (a request served once and sent
    /// again is not claimed twice, nor released twice).
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// The request ended having produced `output` tokens and used
    /// `gpu_seconds`: refunds the tokens it reserved but did not use.
    pub fn finish(&self, output: u32, gpu_seconds: f64) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        let used = self.prompt + f64::from(output);
        self.release((self.need - used).max(0.0), gpu_seconds);
    }

    /// The request was refused before it ran: everything is given back.
    pub fn refund(&self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.release(self.need, 0.0);
        }
    }

    fn release(&self, refund: f64, gpu_seconds: f64) {
        self.fleet.forget_lease(&self.tenant, &self.member);
        let fleet = self.fleet.clone();
        let (tenant, member, rate) = (self.tenant.clone(), self.member.clone(), self.tokens_per_s);
        // Not awaited by the request: a slow Redis must not hold a response
        // open. An unreachable one lets the lease expire instead.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = fleet
                    .store
                    .release(&tenant, &member, rate, refund, gpu_seconds)
                    .await;
            });
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.release(0.0, 0.0);
        }
    }
}

impl Fleet {
    pub fn open(cfg: &StateSection, speed: f64) -> Result<Arc<Fleet>, crate::shared::StoreError> {
        let store = Arc::new(Store::open(&StoreConfig {
            url: cfg.redis.clone(),
            namespace: cfg.namespace.clone(),
            replica: cfg
                .replica
                .clone()
                .unwrap_or_else(crate::shared::default_replica_name),
            lease: cfg.lease,
            tls: crate::tls::ClientTls {
                ca_file: cfg.ca_file.clone(),
                client_cert: cfg.client_cert.clone(),
                client_key: cfg.client_key.clone(),
            },
        })?);
        let (applied, _) = tokio::sync::watch::channel(0);
        Ok(Arc::new(Fleet {
            store,
            on_unavailable: cfg.on_unavailable,
            replicas: cfg.replicas.max(1),
            speed: if speed.is_finite() && speed > 0.0 {
                speed
            } else {
                1.0
            },
            seen: AtomicU64::new(0),
            applied,
            leases: Mutex::new(BTreeMap::new()),
            started_ms: crate::clock::unix_ms() as u64,
            was_up: AtomicBool::new(true),
            unannounced: AtomicBool::new(false),
        }))
    }

    /// The share of each limit one replica enforces alone.
    pub fn local_scale(&self) -> f64 {
        1.0 / f64::from(self.replicas.max(1))
    }

    pub fn applied_epoch(&self) -> u64 {
        *self.applied.borrow()
    }

    fn set_applied(&self, epoch: u64) {
        self.applied.send_if_modified(|e| {
            if epoch > *e {
                *e = epoch;
                true
            } else {
                false
            }
        });
        self.seen.fetch_max(epoch, Ordering::AcqRel);
    }

    /// Waits (bounded) while an announced policy epoch is being applied
    /// here, so the request is decided by the fleet's version.
    pub async fn wait_for_version(&self) {
        let seen = self.seen.load(Ordering::Acquire);
        if self.applied_epoch() >= seen {
            return;
        }
        let mut rx = self.applied.subscribe();
        let _ = tokio::time::timeout(VERSION_WAIT, rx.wait_for(|e| *e >= seen)).await;
    }

    /// Claims `req`'s tenant's quotas for one request needing `need`
    /// tokens, `prompt` of them its prompt.
    pub async fn claim(
        self: &Arc<Self>,
        graph: &DecisionGraph,
        req: &Request,
        member: &str,
        need: f64,
        prompt: f64,
    ) -> Gate {
        let Some(t) = req
            .tenant
            .as_deref()
            .and_then(|n| graph.tenant_id(n))
            .and_then(|i| graph.tenants.get(i as usize))
        else {
            return Gate::Free;
        };
        let q = &t.quota;
        let limits = Limits {
            requests_per_s: q.requests.unwrap_or(0.0) * self.speed,
            tokens_per_s: q.tokens.unwrap_or(0.0) * self.speed,
            concurrent: q.concurrent.unwrap_or(0),
            // A day of wall time holds `speed` days of policy time.
            gpu_seconds_per_day: q.gpu_seconds.map(|s| s * 86_400.0 * self.speed),
        };
        if !limits.any() {
            return Gate::Free;
        }
        // Known down: no request waits on a dead store; the heartbeat's
        // next call finds out when it is back.
        if !self.store.is_up() {
            return Gate::Unavailable;
        }
        // Registered before the claim so the heartbeat renews it even if
        // the claim's answer is slow.
        if limits.concurrent > 0 {
            if let Ok(mut l) = self.leases.lock() {
                l.entry(t.name.clone())
                    .or_default()
                    .insert(member.to_string());
            }
        }
        match self.store.claim(&t.name, member, &limits, need).await {
            Ok(Claimed::Granted) => Gate::Claimed(Arc::new(Claim {
                fleet: self.clone(),
                tenant: t.name.clone(),
                member: member.to_string(),
                tokens_per_s: limits.tokens_per_s,
                need,
                prompt,
                done: AtomicBool::new(false),
            })),
            Ok(Claimed::Refused { limit, retry_ms }) => {
                self.forget_lease(&t.name, member);
                Gate::Refused { limit, retry_ms }
            }
            Err(_) => {
                self.forget_lease(&t.name, member);
                Gate::Unavailable
            }
        }
    }

    /// Stops renewing `member`'s concurrency lease.
    fn forget_lease(&self, tenant: &str, member: &str) {
        if let Ok(mut l) = self.leases.lock() {
            if let Some(set) = l.get_mut(tenant) {
                set.remove(member);
                if set.is_empty() {
                    l.remove(tenant);
                }
            }
        }
    }

    fn lease_snapshot(&self) -> BTreeMap<String, Vec<String>> {
        self.leases
            .lock()
            .map(|l| {
                l.iter()
                    .map(|(t, s)| (t.clone(), s.iter().cloned().collect()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Starts the replica's background work: heartbeat (registry, lease
/// renewal, health), and the policy version's sync.
pub fn spawn(app: Arc<App>, fleet: Arc<Fleet>) -> Vec<tokio::task::JoinHandle<()>> {
    let beat = {
        let (app, fleet) = (app.clone(), fleet.clone());
        tokio::spawn(async move { heartbeat(app, fleet).await })
    };
    let share = {
        let (app, fleet) = (app.clone(), fleet.clone());
        tokio::spawn(async move { share_sync(app, fleet).await })
    };
    let policy = tokio::spawn(async move { policy_sync(app, fleet).await });
    vec![beat, share, policy]
}

/// How often fair-share counters and upstream slots are exchanged: the
/// staleness of a replica's view of the others' service, and the longest a
/// request queued for a shared upstream waits for a slot this replica
/// does not hold yet.
const SHARE_EVERY: Duration = Duration::from_millis(25);

/// Fair share and upstream slots across the fleet: each replica adds the
/// service it charged to the fleet's counters (same decay as its own) and
/// takes back everyone's, so a tenant spreading its requests over replicas
/// is ordered by all it received; and each HTTP upstream's slots are split
/// by who has work for it ([`crate::shared::scripts`]), so the replicas
/// together never send more than its `concurrency`.
async fn share_sync(app: Arc<App>, fleet: Arc<Fleet>) {
    let mut tick = tokio::time::interval(SHARE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Service charged here that Redis has not taken yet (it was down).
    let mut unsent: BTreeMap<(String, u64), Vec<(String, f64)>> = BTreeMap::new();
    loop {
        tick.tick().await;
        let Some(view) = app.exec.fleet_view().await else {
            return;
        };
        let g = &view.graph;
        let tenant_name =
            |t: Option<crate::graph::TenantId>| match t.and_then(|t| g.tenants.get(t as usize)) {
                Some(tn) => tn.name.clone(),
                None => "-".to_string(),
            };
        let queue_name = |key: (u16, u16), tier: crate::graph::TierId| {
            format!(
                "{}.{}",
                g.variant_name(key.0, key.1),
                g.tiers.get(tier as usize).map_or("?", |t| t.name.as_str())
            )
        };
        // Deltas by queue; queues with work waiting are read even without.
        let mut by_queue: BTreeMap<(String, u64), Vec<(String, f64)>> = std::mem::take(&mut unsent);
        let mut ids: BTreeMap<String, ((u16, u16), crate::graph::TierId)> = BTreeMap::new();
        for c in &view.service {
            let q = queue_name(c.key, c.tier);
            ids.insert(q.clone(), (c.key, c.tier));
            let decay = view
                .decays
                .get(c.tier as usize)
                .copied()
                .flatten()
                .unwrap_or(0);
            let e = by_queue.entry((q, decay)).or_default();
            let name = tenant_name(c.tenant);
            match e.iter_mut().find(|(t, _)| *t == name) {
                Some((_, d)) => *d += c.service,
                None => e.push((name, c.service)),
            }
        }
        for (key, tier) in &view.active {
            let q = queue_name(*key, *tier);
            ids.insert(q.clone(), (*key, *tier));
            let decay = view
                .decays
                .get(*tier as usize)
                .copied()
                .flatten()
                .unwrap_or(0);
            by_queue.entry((q, decay)).or_default();
        }
        let mut totals = Vec::new();
        let mut down = !fleet.store.is_up();
        for ((q, decay_us), deltas) in by_queue {
            if down {
                if !deltas.is_empty() {
                    unsent.insert((q, decay_us), deltas);
                }
                continue;
            }
            match fleet.store.share(&q, decay_us / 1000, &deltas).await {
                Ok(all) => {
                    let Some((key, tier)) = ids.get(&q).copied() else {
                        continue;
                    };
                    for (t, service) in all {
                        let tenant = if t == "-" {
                            None
                        } else {
                            match g.tenant_id(&t) {
                                Some(id) => Some(id),
                                None => continue,
                            }
                        };
                        totals.push(crate::sched::queue::ServiceCount {
                            key,
                            tier,
                            tenant,
                            service,
                        });
                    }
                }
                Err(_) => {
                    down = true;
                    if !deltas.is_empty() {
                        unsent.insert((q, decay_us), deltas);
                    }
                }
            }
        }
        let mut slots = Vec::new();
        for u in &view.upstreams {
            let want = u64::from(u.busy) + u.queued as u64;
            let held = if down {
                None
            } else {
                fleet
                    .store
                    .slots(
                        &u.key,
                        want,
                        u64::from(u.busy),
                        u64::from(u.capacity),
                        &u.tenants,
                        u64::from(u.in_force),
                    )
                    .await
                    .ok()
            };
            let cap = match held {
                Some(n) => n.min(u64::from(u.capacity)) as u32,
                // Redis unreachable: a fixed share, so the fleet together
                // still stays within the upstream's concurrency.
                None => {
                    down = true;
                    u.capacity.div_ceil(fleet.replicas.max(1)).max(1)
                }
            };
            slots.push((u.replica, cap));
        }
        app.exec.send(super::executor::Command::FleetApply {
            graph: view.graph.clone(),
            service: totals,
            slots,
        });
    }
}

async fn heartbeat(app: Arc<App>, fleet: Arc<Fleet>) {
    let every = Duration::from_millis((fleet.store.lease_ms() / 3).max(100));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let in_flight = app.exec.snapshot().await.map_or(0, |s| s.in_flight as u64);
        let info = ReplicaInfo {
            id: fleet.store.replica().to_string(),
            version: app.policy.load().version.to_string(),
            epoch: fleet.applied_epoch(),
            started_unix_ms: fleet.started_ms,
            seen_unix_ms: crate::clock::unix_ms() as u64,
            in_flight,
        };
        let ok = fleet.store.heartbeat(&info).await.is_ok()
            && fleet.store.renew(&fleet.lease_snapshot()).await.is_ok();
        app.metrics.shared_state(ok, fleet.store.failures());
        let was = fleet.was_up.swap(ok, Ordering::Relaxed);
        if was != ok {
            match (ok, fleet.on_unavailable) {
                (false, OnUnavailable::Local) => tracing::error!(
                    replica = %fleet.store.replica(),
                    "shared state unreachable: serving with local limits (1/{} of each tenant's quota per replica) until Redis answers",
                    fleet.replicas
                ),
                (false, OnUnavailable::Refuse) => tracing::error!(
                    replica = %fleet.store.replica(),
                    "shared state unreachable: refusing requests (503 shared-state-unavailable) until Redis answers"
                ),
                (true, _) => tracing::warn!(
                    replica = %fleet.store.replica(),
                    "shared state reachable again: shared quotas and policy sync resumed"
                ),
            }
        }
    }
}

/// Keeps this replica on the fleet's newest policy epoch: a subscription
/// for announcements, and a poll for what it missed.
async fn policy_sync(app: Arc<App>, fleet: Arc<Fleet>) {
    let (bell_tx, mut bell) = tokio::sync::mpsc::unbounded_channel::<u64>();
    {
        let fleet = fleet.clone();
        tokio::spawn(async move {
            use futures_util::StreamExt;
            loop {
                match fleet.store.subscribe_policy().await {
                    Ok(ps) => {
                        let mut msgs = ps.into_on_message();
                        while let Some(m) = msgs.next().await {
                            let epoch = m.get_payload::<u64>().unwrap_or(0);
                            fleet.seen.fetch_max(epoch, Ordering::AcqRel);
                            if bell_tx.send(epoch).is_err() {
                                return;
                            }
                        }
                    }
                    Err(_) => tokio::time::sleep(POLICY_POLL).await,
                }
            }
        });
    }
    let mut poll = tokio::time::interval(POLICY_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = poll.tick() => {}
            m = bell.recv() => if m.is_none() { return },
        }
        follow(&app, &fleet).await;
    }
}

/// Applies the fleet's policy if it is newer than this replica's, or
/// publishes this replica's when the store has none (a fresh or restarted
/// Redis).
pub async fn follow(app: &Arc<App>, fleet: &Arc<Fleet>) {
    let Ok(epoch) = fleet.store.policy_epoch().await else {
        return;
    };
    fleet.seen.fetch_max(epoch, Ordering::AcqRel);
    if epoch == 0 || fleet.unannounced.swap(false, Ordering::AcqRel) {
        let p = app.policy.load_full();
        match fleet.store.publish_policy(&p.version, &p.files()).await {
            Ok(e) => fleet.set_applied(e),
            Err(_) => fleet.unannounced.store(true, Ordering::Release),
        }
        return;
    }
    if epoch <= fleet.applied_epoch() {
        return;
    }
    let Ok(Some(shared)) = fleet.store.policy().await else {
        return;
    };
    if shared.version.as_str() == app.policy.load().version.as_ref() {
        fleet.set_applied(shared.epoch);
        return;
    }
    match super::admin::activate_here(app, shared.files).await {
        Ok(a) => {
            tracing::info!(version = %a.version, epoch = shared.epoch, "policy applied from the fleet");
            fleet.set_applied(shared.epoch);
        }
        Err(e) => {
            // A version this replica cannot run (its backends differ, say):
            // it keeps its own and says so; `kiln status` shows the split.
            tracing::error!(version = %shared.version, epoch = shared.epoch, error = %e, "cannot apply the fleet's policy here; keeping the active one");
            fleet.set_applied(shared.epoch);
        }
    }
}

/// Announces a policy this replica just activated.
pub async fn announce(fleet: &Fleet, policy: &super::Policy) {
    match fleet
        .store
        .publish_policy(&policy.version, &policy.files())
        .await
    {
        Ok(e) => fleet.set_applied(e),
        Err(e) => {
            fleet.unannounced.store(true, Ordering::Release);
            tracing::error!(version = %policy.version, error = %e, "activated here but not yet announced to the fleet: Redis is unreachable; it is announced when Redis answers");
        }
    }
}
