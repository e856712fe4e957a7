//! An upstream replica's settings, as written in `kiln.toml`.

use super::engine::Engine;
use crate::tls::ClientTls;
use crate::units::duration;
use std::path::PathBuf;
use std::time::Duration;

/// One `http` backend replica, as written in the server's TOML config.
///
/// Durations are strings with units (`"30s"`, `"500ms"`, `"1m30s"`) or
/// plain numbers of seconds (`30`, `0.5`). Unknown keys are rejected when
/// it is deserialized on its own or as a tagged enum's payload; once
/// `#[serde(flatten)]`ed into a larger struct, serde ignores them instead.
#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL, e.g. `http://127.0.0.1:8000`; the `/v1/...` path is
    /// appended to it (a path prefix in the base URL is kept).
    pub url: String,
    /// Sent as `Authorization: Bearer <api_key>` to the upstream.
    #[serde(default)]
    pub api_key: Option<String>,
    /// The model name the upstream expects; replaces the request's `model`.
    #[serde(default)]
    pub served_model: Option<String>,
    /// The replica's batch slots (the scheduler enforces it; it sizes the
    /// connection pool here).
    #[serde(default = "default_concurrency")]
    pub concurrency: u32,
    /// Whole-request deadline for a non-streaming call; for a streaming
    /// call, the longest wait for the response headers and the longest gap
    /// between two chunks.
    #[serde(
        default = "default_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub timeout: Duration,
    /// The longest a TCP connect may take.
    #[serde(
        default = "default_connect_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub connect_timeout: Duration,
    /// Path of the active health check (`GET`); empty disables it.
    #[serde(default = "default_health_path")]
    pub health_path: String,
    /// Period of the active health check.
    #[serde(
        default = "default_health_interval",
        deserialize_with = "duration::deserialize"
    )]
    pub health_interval: Duration,
    /// Consecutive failures that open the circuit breaker.
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: u32,
    /// How long the circuit stays open before a trial request is let through.
    #[serde(
        default = "default_open_for",
        deserialize_with = "duration::deserialize"
    )]
    pub open_for: Duration,
    /// The longest an upstream's `Retry-After` (on a 429) keeps its
    /// breaker open; a longer one is cut to this.
    #[serde(
        default = "default_max_retry_after",
        deserialize_with = "duration::deserialize"
    )]
    pub max_retry_after: Duration,
    /// For an `https://` upstream: a PEM file of the CA certificates to
    /// trust instead of the platform's roots (a private PKI).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// For an `https://` upstream that asks for a client certificate
    /// (mutual TLS): the certificate (PEM, leaf first) and its private key.
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    #[serde(default)]
    pub client_key: Option<PathBuf>,
    /// The model server, for the load its `/metrics` publish (see
    /// [`super::engine`]); `openai` (the default) scrapes nothing.
    #[serde(default)]
    pub engine: Engine,
    /// Where the engine publishes Prometheus metrics.
    #[serde(default = "default_metrics_path")]
    pub metrics_path: String,
    #[serde(
        default = "default_scrape_interval",
        deserialize_with = "duration::deserialize"
    )]
    pub scrape_interval: Duration,
    #[serde(
        default = "default_scrape_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub scrape_timeout: Duration,
    /// The engine is saturated past this many requests waiting in its own
    /// queue, or at this KV-cache usage (0–1): kiln sends nothing new.
    #[serde(default = "default_max_engine_waiting")]
    pub max_engine_waiting: u32,
    #[serde(default = "default_max_kv_cache")]
    pub max_kv_cache: f64,
    /// The time to first token (from the request's start on the replica)
    /// the adaptive limit steers by; without one the limit stays at
    /// `concurrency`.
    #[serde(default, deserialize_with = "optional_duration")]
    pub target_ttft: Option<Duration>,
}

fn optional_duration<'de, D>(deserializer: D) -> Result<Option<Duration>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    duration::deserialize(deserializer).map(Some)
}

pub(super) fn default_metrics_path() -> String {
    "/metrics".to_string()
}
pub(super) fn default_scrape_interval() -> Duration {
    Duration::from_secs(1)
}
pub(super) fn default_scrape_timeout() -> Duration {
    Duration::from_millis(500)
}
pub(super) fn default_max_engine_waiting() -> u32 {
    5
}
pub(super) fn default_max_kv_cache() -> f64 {
    0.8
}

pub(super) fn default_concurrency() -> u32 {
    8
}
pub(super) fn default_timeout() -> Duration {
    Duration::from_secs(120)
}
pub(super) fn default_connect_timeout() -> Duration {
    Duration::from_secs(2)
}
pub(super) fn default_health_path() -> String {
    "/health".to_string()
}
pub(super) fn default_health_interval() -> Duration {
    Duration::from_secs(5)
}
pub(super) fn default_failure_threshold() -> u32 {
    5
}
pub(super) fn default_open_for() -> Duration {
    Duration::from_secs(10)
}
pub(super) fn default_max_retry_after() -> Duration {
    Duration::from_secs(60)
}

impl UpstreamConfig {
    /// A configuration for `url` with every other field at its default.
    pub fn new(url: impl Into<String>) -> UpstreamConfig {
        UpstreamConfig {
            url: url.into(),
            api_key: None,
            served_model: None,
            concurrency: default_concurrency(),
            timeout: default_timeout(),
            connect_timeout: default_connect_timeout(),
            health_path: default_health_path(),
            health_interval: default_health_interval(),
            failure_threshold: default_failure_threshold(),
            open_for: default_open_for(),
            max_retry_after: default_max_retry_after(),
            ca_file: None,
            client_cert: None,
            client_key: None,
            engine: Engine::OpenAi,
            metrics_path: default_metrics_path(),
            scrape_interval: default_scrape_interval(),
            scrape_timeout: default_scrape_timeout(),
            max_engine_waiting: default_max_engine_waiting(),
            max_kv_cache: default_max_kv_cache(),
            target_ttft: None,
        }
    }

    /// Its TLS settings.
    pub fn tls(&self) -> ClientTls {
        ClientTls {
            ca_file: self.ca_file.clone(),
            client_cert: self.client_cert.clone(),
            client_key: self.client_key.clone(),
        }
    }
}

/// Like the derived `Debug`, with the API key redacted.
impl std::fmt::Debug for UpstreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamConfig")
            .field("url", &self.url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("served_model", &self.served_model)
            .field("concurrency", &self.concurrency)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("health_path", &self.health_path)
            .field("health_interval", &self.health_interval)
            .field("failure_threshold", &self.failure_threshold)
            .field("open_for", &self.open_for)
            .field("max_retry_after", &self.max_retry_after)
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .field("engine", &self.engine)
            .field("metrics_path", &self.metrics_path)
            .field("scrape_interval", &self.scrape_interval)
            .field("scrape_timeout", &self.scrape_timeout)
            .field("max_engine_waiting", &self.max_engine_waiting)
            .field("max_kv_cache", &self.max_kv_cache)
            .field("target_ttft", &self.target_ttft)
            .finish()
    }
}
