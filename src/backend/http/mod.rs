//! The `http` backend: one OpenAI-compatible upstream replica (vLLM, SGLang,
//! TGI, the llama.cpp server) reached over HTTP, or HTTPS with rustls
//! ([`crate::tls`]: the platform's roots or a `ca_file`, an optional
//! client certificate).
//!
//! An [`Upstream`] forwards one request at a time as the executor asks:
//! [`Upstream::complete`] for a whole JSON answer, [`Upstream::stream`] for
//! the server-sent events of a streaming answer, parsed into JSON chunks.
//! Dropping the future or the stream closes the connection to the replica,
//! so the model server stops generating for a client that went away.
//!
//! Each upstream has a circuit breaker ([`Breaker`], a pure state machine
//! fed explicit instants): consecutive failures (connect errors, timeouts,
//! 5xx) open it for a while, then a single trial request probes the replica.
//! An optional periodic health check ([`Upstream::spawn_health_checks`])
//! feeds the same breaker.

mod answer;
mod breaker;
mod client;
mod config;
mod engine;
mod error;
mod meter;
mod payload;
mod retry;
mod sse;
pub mod trace;

pub use answer::Answer;
use breaker::{lock, record, Outcome};
pub use breaker::{Admission, Breaker, BreakerState};
pub use config::UpstreamConfig;
pub use engine::{parse_metrics, Engine, EngineLoad, EngineStatus};
pub use error::UpstreamError;
use error::{error_chain, parse_retry_after};
pub use meter::{Hold, Meter};
pub use payload::StreamOptions;
pub use retry::{retry_backoff, RETRY_BASE, RETRY_MAX};
use sse::SseStream;

use crate::units::duration;
use bytes::Bytes;
use futures_util::Stream;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use hyper::{HeaderMap, Method, Uri};
use serde_json::Value;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The most a successful non-streaming answer may weigh.
pub(super) const MAX_BODY: usize = 64 << 20;
/// How much of an error answer is kept (the rest is not read).
pub(super) const MAX_ERROR_BODY: usize = 64 << 10;
/// Idle pooled connections are closed after this long: below the 5 s
/// keep-alive of uvicorn (vLLM, SGLang) and cpp-httplib (llama.cpp), so a
/// reused connection is never one the replica is closing at that moment.
const POOL_IDLE: Duration = Duration::from_secs(4);
/// The longest duration a configuration may give (longer ones could
/// overflow a clock).
pub(super) const MAX_DURATION: Duration = Duration::from_secs(365 * 86400);

/// One OpenAI-compatible replica: a pooled HTTP client and its circuit
/// breaker. Share it through an `Arc`.
pub struct Upstream {
    name: Arc<str>,
    cfg: UpstreamConfig,
    /// `cfg.url` without its trailing `/`.
    base: String,
    /// The two generation endpoints' URIs, parsed once: parsing a URL for
    /// every call showed in the gateway's profile. `None` where they do
    /// not parse (the call then fails as a bad URI).
    chat_uri: Option<Uri>,
    completions_uri: Option<Uri>,
    client: client::Client,
    auth: Option<HeaderValue>,
    breaker: Arc<Mutex<Breaker>>,
    /// The GPU time its requests are charged ([`meter`]).
    meter: Arc<Meter>,
    /// The engine's last scrape and the adaptive limit ([`engine`]).
    engine_state: Arc<Mutex<engine::EngineState>>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("name", &self.name)
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// Validates the configuration and builds the pooled client (idle
    /// connections kept per host ≈ `concurrency`, `TCP_NODELAY`, no proxy,
    /// no redirects).
    pub fn new(name: String, cfg: UpstreamConfig) -> Result<Upstream, UpstreamError> {
        let invalid = |reason: String| UpstreamError::Config {
            upstream: name.clone(),
            reason,
        };
        let url = reqwest::Url::parse(cfg.url.trim()).map_err(|e| {
            invalid(format!(
                "`{}` is not a URL ({e}); write e.g. \"http://127.0.0.1:8000\"",
                cfg.url
            ))
        })?;
        let tls = cfg.tls();
        let https = match url.scheme() {
            "http" => false,
            "https" => true,
            other => {
                return Err(invalid(format!(
                    "`{}`: scheme `{other}` is neither http nor https",
                    cfg.url
                )))
            }
        };
        if !https && tls.is_set() {
            return Err(invalid(format!(
                "`{}` is plain http, but `ca_file`, `client_cert` or `client_key` is set; write https:// to use TLS, or remove them",
                cfg.url
            )));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid(format!("`{}` has no host", cfg.url)));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(invalid(format!(
                "`{}`: the base URL cannot have a query or a fragment",
                cfg.url
            )));
        }
        if cfg.concurrency == 0 {
            return Err(invalid("`concurrency` must be at least 1".into()));
        }
        if cfg.failure_threshold == 0 {
            return Err(invalid(
                "`failure_threshold` must be at least 1 (a large number all but disables the breaker)"
                    .into(),
            ));
        }
        for (field, value) in [
            ("timeout", cfg.timeout),
            ("connect_timeout", cfg.connect_timeout),
            ("health_interval", cfg.health_interval),
            ("open_for", cfg.open_for),
            ("max_retry_after", cfg.max_retry_after),
        ] {
            if value > MAX_DURATION {
                return Err(invalid(format!(
                    "`{field}` of {} is longer than the longest allowed, one year",
                    duration::format(value)
                )));
            }
        }
        if cfg.timeout.is_zero() || cfg.connect_timeout.is_zero() {
            return Err(invalid(
                "`timeout` and `connect_timeout` must be longer than zero".into(),
            ));
        }
        if !cfg.health_path.is_empty() && !cfg.health_path.starts_with('/') {
            return Err(invalid(format!(
                "`health_path` `{}` must start with `/` (or be empty to disable health checks)",
                cfg.health_path
            )));
        }
        if !cfg.health_path.is_empty() && cfg.health_interval.is_zero() {
            return Err(invalid("`health_interval` must be longer than zero".into()));
        }
        if cfg.engine.scraped() {
            if !cfg.metrics_path.starts_with('/') {
                return Err(invalid(format!(
                    "`metrics_path` `{}` must start with `/`",
                    cfg.metrics_path
                )));
            }
            if cfg.scrape_interval.is_zero()
                || cfg.scrape_timeout.is_zero()
                || cfg.scrape_interval > MAX_DURATION
                || cfg.scrape_timeout > cfg.scrape_interval
            {
                return Err(invalid(
                    "`scrape_interval` and `scrape_timeout` must be longer than zero, at most a year, and the timeout no longer than the interval".into(),
                ));
            }
            if !(cfg.max_kv_cache > 0.0 && cfg.max_kv_cache <= 1.0) {
                return Err(invalid(format!(
                    "`max_kv_cache` is a share of the KV cache, above 0 and at most 1 (e.g. 0.8), not {}",
                    cfg.max_kv_cache
                )));
            }
            if cfg
                .target_ttft
                .is_some_and(|t| t.is_zero() || t > MAX_DURATION)
            {
                return Err(invalid("`target_ttft` must be longer than zero".into()));
            }
        }
        let auth = match &cfg.api_key {
            None => None,
            Some(key) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                    invalid("`api_key` has characters not allowed in an HTTP header".into())
                })?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        // TLS: rustls with the platform's roots or `ca_file`'s, the client
        // certificate if set; HTTP/1.1 only, as over plain http (one
        // pooled connection per slot, each stream on its own).
        let config = if https {
            Some(
                tls.client_config(&[b"http/1.1"])
                    .map_err(|e| invalid(tls_config_error(&e)))?,
            )
        } else {
            None
        };
        let client = client::Client::new(
            config,
            cfg.connect_timeout,
            usize::try_from(cfg.concurrency)
                .unwrap_or(usize::MAX)
                .saturating_add(1),
            POOL_IDLE,
        )
        .map_err(|e| invalid(format!("cannot build the HTTP client: {e}")))?;
        let base = cfg.url.trim().trim_end_matches('/').to_string();
        let chat_uri = parse_uri(&format!("{base}/v1/chat/completions")).ok();
        let completions_uri = parse_uri(&format!("{base}/v1/completions")).ok();
        let breaker = Breaker::new(
            cfg.failure_threshold,
            cfg.open_for,
            cfg.timeout.saturating_add(cfg.connect_timeout),
        );
        Ok(Upstream {
            name: name.into(),
            base,
            chat_uri,
            completions_uri,
            client,
            auth,
            breaker: Arc::new(Mutex::new(breaker)),
            meter: Meter::new(1),
            engine_state: Arc::new(Mutex::new(engine::EngineState::new(
                cfg.concurrency,
                cfg.target_ttft,
            ))),
            cfg,
        })
    }

    /// The replica's GPUs, which its requests' GPU time is charged by (1
    /// unless set).
    pub fn with_gpus(mut self, gpus: u32) -> Upstream {
        self.meter = Meter::new(gpus.max(1));
        self
    }

    /// The replica's GPUs.
    pub fn gpus(&self) -> u32 {
        self.meter.gpus()
    }

    /// A request takes one of the replica's slots: its GPU-seconds run
    /// until the hold is dropped (the rule is in [`meter`]'s docs: the
    /// replica's GPUs × the wall time held, split evenly among requests
    /// holding slots at the same time).
    pub fn hold(&self) -> Hold {
        let hold = self.meter.hold();
        if !self.cfg.engine.scraped() {
            return hold;
        }
        // Its time to first token steers the engine's adaptive limit.
        let state = Arc::clone(&self.engine_state);
        hold.on_first_token(Arc::new(move |ttft| {
            engine::observe_ttft(&state, ttft);
        }))
    }

    /// The backend's name in the configuration.
    /// Its base URL (what replicas of a fleet share an upstream by).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &UpstreamConfig {
        &self.cfg
    }

    /// The model name the upstream expects, if the configuration sets one.
    pub fn served_model(&self) -> Option<&str> {
        self.cfg.served_model.as_deref()
    }

    /// Whether a request may be sent now: the circuit is closed, or it is
    /// half-open and this caller takes the single trial (reserved for the
    /// next [`Upstream::complete`] or [`Upstream::stream`] call; unused, it
    /// expires after `open_for`). For display and readiness, where nothing
    /// is sent, use [`Upstream::ready`].
    ///
    /// The calls themselves enforce the breaker too: while open, or while
    /// the half-open trial is in flight, they fail at once with
    /// [`UpstreamError::Unavailable`].
    pub fn available(&self) -> bool {
        lock(&self.breaker).try_acquire(Instant::now())
    }

    /// Whether a request would be admitted now, taking nothing: closed, or
    /// half-open with the trial free. For `/admin` and `/readyz`.
    pub fn ready(&self) -> bool {
        lock(&self.breaker).ready(Instant::now())
    }

    /// The circuit breaker's state now.
    pub fn state(&self) -> BreakerState {
        lock(&self.breaker).state(Instant::now())
    }

    /// Consecutive failures counted by the breaker.
    pub fn consecutive_failures(&self) -> u32 {
        lock(&self.breaker).consecutive_failures()
    }

    /// Non-streaming call: `POST {url}{path}` with `body` (its `model`
    /// replaced by `served_model` if set, `stream` set to false if present,
    /// `stream_options` removed). Returns the upstream's JSON answer.
    ///
    /// The whole exchange is bounded by `timeout`. Dropping the future
    /// closes the connection.
    pub async fn complete(&self, path: &str, body: Value) -> Result<Value, UpstreamError> {
        let answer = self.complete_as(path, body, CallClass::Online).await?;
        Ok(answer.to_value())
    }

    /// [`Upstream::complete`] for a class of caller. A batch item's 5xx
    /// answer tells the breaker nothing: the upstream answered, and a
    /// batch's failing items (the same few, tried again) must not open a
    /// breaker that online traffic needs. Timeouts and broken connections
    /// still count, and a batch item's success still closes a half-open
    /// breaker (a batch-only upstream is not left half-open).
    pub async fn complete_as(
        &self,
        path: &str,
        body: Value,
        class: CallClass,
    ) -> Result<Answer, UpstreamError> {
        self.complete_traced(path, body, class, None).await
    }

    /// [`Upstream::complete_as`] with a W3C `traceparent` header (see
    /// [`trace`]) sent to the upstream.
    pub async fn complete_traced(
        &self,
        path: &str,
        body: Value,
        class: CallClass,
        traceparent: Option<String>,
    ) -> Result<Answer, UpstreamError> {
        let payload = self.payload(&body, false, StreamOptions::Merge)?;
        self.complete_payload(path, payload, class, traceparent)
            .await
    }

    /// [`Upstream::complete_traced`] with the body already written
    /// ([`Upstream::payload`]).
    pub async fn complete_payload(
        &self,
        path: &str,
        payload: Vec<u8>,
        class: CallClass,
        traceparent: Option<String>,
    ) -> Result<Answer, UpstreamError> {
        let mut call = self.begin()?;
        let request = self.post(path, payload, "application/json", traceparent);
        let exchange = async {
            let resp = self
                .client
                .send(request?)
                .await
                .map_err(|e| self.send_error(&e))?;
            let status = resp.status().as_u16();
            let retry_after = retry_after_of(resp.headers());
            let cap = if status < 300 {
                MAX_BODY
            } else {
                MAX_ERROR_BODY
            };
            let (bytes, truncated) = read_body(resp, cap)
                .await
                .map_err(|e| self.body_error(&e))?;
            Ok::<_, UpstreamError>((status, retry_after, bytes, truncated))
        };
        let outcome = match tokio::time::timeout(self.cfg.timeout, exchange).await {
            Ok(outcome) => outcome,
            Err(_) => Err(self.timeout("complete response", self.cfg.timeout)),
        };
        let answer = outcome.and_then(|(status, retry_after, bytes, truncated)| {
            if !(200..300).contains(&status) {
                return Err(UpstreamError::Status {
                    status,
                    body: String::from_utf8_lossy(&bytes).into_owned(),
                    retry_after,
                });
            }
            if truncated {
                return Err(
                    self.protocol(format!("the answer is larger than {} MiB", MAX_BODY >> 20))
                );
            }
            Answer::parse(&bytes).map_err(|e| self.protocol(format!("the answer is not JSON: {e}")))
        });
        match answer.as_ref().err() {
            Some(UpstreamError::Status { status, .. })
                if class == CallClass::Batch && *status >= 500 =>
            {
                call.neutral()
            }
            e => call.finish(self.outcome(e)),
        }
        answer
    }

    /// Streaming call: `POST {url}{path}` with `body` (`model` rewritten as
    /// for [`Upstream::complete`], `"stream": true`,
    /// `"stream_options": {"include_usage": true}` added to any other
    /// stream options). Resolves once the upstream's headers arrive (within
    /// `timeout`); the stream then yields each `data:` event parsed as JSON
    /// and ends at `data: [DONE]`. A gap longer than `timeout` between two
    /// network chunks, a broken connection, bad JSON or an end before
    /// `[DONE]` yield one error and end the stream.
    ///
    /// Dropping the stream before its end closes the connection.
    pub async fn stream(
        &self,
        path: &str,
        body: Value,
    ) -> Result<impl Stream<Item = Result<Value, UpstreamError>> + Send + 'static, UpstreamError>
    {
        self.stream_traced(path, body, None).await
    }

    /// [`Upstream::stream`] with a W3C `traceparent` header (see
    /// [`trace`]) sent to the upstream.
    pub async fn stream_traced(
        &self,
        path: &str,
        body: Value,
        traceparent: Option<String>,
    ) -> Result<impl Stream<Item = Result<Value, UpstreamError>> + Send + 'static, UpstreamError>
    {
        let payload = self.payload(&body, true, StreamOptions::Merge)?;
        self.stream_payload(path, payload, traceparent).await
    }

    /// [`Upstream::stream_traced`] with the body already written
    /// ([`Upstream::payload`]).
    pub async fn stream_payload(
        &self,
        path: &str,
        payload: Vec<u8>,
        traceparent: Option<String>,
    ) -> Result<impl Stream<Item = Result<Value, UpstreamError>> + Send + 'static, UpstreamError>
    {
        let mut call = self.begin()?;
        let request = match self.post(path, payload, "text/event-stream", traceparent) {
            Ok(r) => r,
            Err(e) => {
                call.finish(self.outcome(Some(&e)));
                return Err(e);
            }
        };
        let resp = match tokio::time::timeout(self.cfg.timeout, self.client.send(request)).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => {
                let e = self.send_error(&e);
                call.finish(self.outcome(Some(&e)));
                return Err(e);
            }
            Err(_) => {
                let e = self.timeout("response headers", self.cfg.timeout);
                call.finish(self.outcome(Some(&e)));
                return Err(e);
            }
        };
        let status = resp.status().as_u16();
        if !(200..300).contains(&status) {
            let retry_after = retry_after_of(resp.headers());
            let body = match tokio::time::timeout(self.cfg.timeout, read_body(resp, MAX_ERROR_BODY))
                .await
            {
                Ok(Ok((bytes, _))) => String::from_utf8_lossy(&bytes).into_owned(),
                _ => String::new(),
            };
            let e = UpstreamError::Status {
                status,
                body,
                retry_after,
            };
            call.finish(self.outcome(Some(&e)));
            return Err(e);
        }
        let json = resp
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("application/json"));
        if json {
            let e = self.protocol(
                "it answered a streaming request with plain JSON; does this endpoint support \"stream\": true?".into(),
            );
            call.finish(self.outcome(Some(&e)));
            return Err(e);
        }
        call.finish(Outcome::Success);
        Ok(SseStream::new(
            resp,
            self.cfg.timeout,
            Arc::clone(&self.breaker),
            Arc::clone(&self.name),
        ))
    }

    /// One health check now: `GET {url}{health_path}`, healthy on 2xx. The
    /// outcome feeds the breaker (a success closes it). `Ok` without a
    /// request when health checks are disabled.
    pub async fn check_health(&self) -> Result<(), UpstreamError> {
        if self.cfg.health_path.is_empty() {
            return Ok(());
        }
        let limit = self
            .cfg
            .health_interval
            .max(self.cfg.connect_timeout)
            .min(self.cfg.timeout);
        let request = self.get(&self.cfg.health_path);
        let probe = async {
            let resp = self
                .client
                .send(request?)
                .await
                .map_err(|e| self.send_error(&e))?;
            let status = resp.status().as_u16();
            // Read the (small) body so the connection can be reused.
            let retry_after = retry_after_of(resp.headers());
            let (bytes, _) = read_body(resp, MAX_ERROR_BODY)
                .await
                .map_err(|e| self.body_error(&e))?;
            if (200..300).contains(&status) {
                Ok(())
            } else {
                Err(UpstreamError::Status {
                    status,
                    body: String::from_utf8_lossy(&bytes).into_owned(),
                    retry_after,
                })
            }
        };
        let outcome = match tokio::time::timeout(limit, probe).await {
            Ok(outcome) => outcome,
            Err(_) => Err(self.timeout("health check answer", limit)),
        };
        if let Err(e) = &outcome {
            tracing::debug!(upstream = &*self.name, error = %e, "health check failed");
        }
        let health = if outcome.is_ok() {
            Outcome::HealthOk
        } else {
            Outcome::HealthFailed
        };
        record(&self.breaker, &self.name, health);
        outcome
    }

    /// Spawns the periodic health check (the first one at once); a failed
    /// check counts as a failure for the breaker, a passed one closes it.
    /// For an engine whose metrics are scraped, starts the scrapes too
    /// ([`Upstream::spawn_scrapes`]).
    /// The task holds only a weak reference: it stops when the last `Arc`
    /// of the upstream is dropped, or when the handle is aborted. `None`
    /// when `health_path` is empty or there is no Tokio runtime.
    pub fn spawn_health_checks(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        // An engine's metrics are scraped alongside (a task of its own,
        // stopped the same way).
        let _ = self.spawn_scrapes();
        if self.cfg.health_path.is_empty() {
            return None;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                upstream = &*self.name,
                "no Tokio runtime: health checks not started"
            );
            return None;
        };
        let weak = Arc::downgrade(self);
        let period = self.cfg.health_interval;
        Some(runtime.spawn(async move {
            let mut ticker = tokio::time::interval(period);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let Some(upstream) = weak.upgrade() else {
                    break;
                };
                let _ = upstream.check_health().await;
            }
        }))
    }

    // -- helpers ------------------------------------------------------------

    /// Admits a call through the breaker.
    fn begin(&self) -> Result<Call<'_>, UpstreamError> {
        let mut breaker = lock(&self.breaker);
        let trial = match breaker.admit(Instant::now()) {
            Admission::Admitted => false,
            Admission::Trial => true,
            Admission::Refused => {
                let now = Instant::now();
                let retry_after = match breaker.state(now) {
                    BreakerState::Open { until } => Some(until.saturating_duration_since(now)),
                    _ => None,
                };
                return Err(UpstreamError::Unavailable {
                    upstream: self.name.to_string(),
                    reason: refusal(&breaker),
                    retry_after,
                });
            }
        };
        Ok(Call {
            upstream: self,
            trial,
            settled: false,
        })
    }
}

/// A TLS settings error, with its help, as one line for
/// [`UpstreamError::Config`].
fn tls_config_error(e: &crate::tls::TlsError) -> String {
    use miette::Diagnostic;
    match e.help() {
        Some(help) => format!("{e} ({help})"),
        None => e.to_string(),
    }
}

/// Why the breaker refused a call, in words.
fn refusal(breaker: &Breaker) -> String {
    match breaker.state(Instant::now()) {
        BreakerState::Open { until } => format!(
            "circuit breaker open after {} consecutive failures; next trial in {}",
            breaker.consecutive_failures(),
            duration::format(until.saturating_duration_since(Instant::now()))
        ),
        _ => "circuit breaker half-open and its single trial request is taken".to_string(),
    }
}

impl Upstream {
    /// The body to send: the client's JSON object `body` with `model`
    /// (this upstream's served model, if set), `stream` and
    /// `stream_options` set ([`payload::write`]), written without copying
    /// the body.
    pub fn payload(
        &self,
        body: &Value,
        stream: bool,
        options: StreamOptions,
    ) -> Result<Vec<u8>, UpstreamError> {
        payload::write(body, self.served_model(), stream, options)
            .map_err(|reason| UpstreamError::BadRequest { reason })
    }

    fn endpoint(&self, path: &str) -> String {
        if path.starts_with('/') {
            format!("{}{path}", self.base)
        } else {
            format!("{}/{path}", self.base)
        }
    }

    /// The URI of `path` on this upstream.
    fn uri(&self, path: &str) -> Result<Uri, UpstreamError> {
        let parsed = match path {
            "/v1/chat/completions" => self.chat_uri.clone(),
            "/v1/completions" => self.completions_uri.clone(),
            _ => None,
        };
        if let Some(uri) = parsed {
            return Ok(uri);
        }
        let endpoint = self.endpoint(path);
        parse_uri(&endpoint).map_err(|e| UpstreamError::Transport {
            upstream: self.name.to_string(),
            reason: format!("`{endpoint}` is not a URL kiln can send to: {e}"),
        })
    }

    fn post(
        &self,
        path: &str,
        payload: Vec<u8>,
        accept: &'static str,
        traceparent: Option<String>,
    ) -> Result<client::Request, UpstreamError> {
        let mut request = self.request(Method::POST, path, Bytes::from(payload))?;
        let headers = request.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(ACCEPT, HeaderValue::from_static(accept));
        if let Some(t) = traceparent.and_then(|t| HeaderValue::try_from(t).ok()) {
            headers.insert(trace::TRACEPARENT, t);
        }
        Ok(request)
    }

    /// `GET {url}{path}` with the upstream's key (health checks, engine
    /// scrapes).
    pub(super) fn get(&self, path: &str) -> Result<client::Request, UpstreamError> {
        self.request(Method::GET, path, Bytes::new())
    }

    /// A request with the upstream's key, where it has one.
    fn request(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> Result<client::Request, UpstreamError> {
        let mut request = client::Request::new(Full::new(body));
        *request.method_mut() = method;
        *request.uri_mut() = self.uri(path)?;
        if let Some(auth) = &self.auth {
            request.headers_mut().insert(AUTHORIZATION, auth.clone());
        }
        Ok(request)
    }

    /// Classifies an error of sending the request and waiting for headers.
    fn send_error(&self, e: &client::SendError) -> UpstreamError {
        if let Some(reason) = crate::tls::tls_cause(e) {
            UpstreamError::Tls {
                upstream: self.name.to_string(),
                url: self.base.clone(),
                reason,
            }
        } else if e.is_connect() {
            UpstreamError::Unavailable {
                upstream: self.name.to_string(),
                reason: format!("cannot connect to {}: {}", self.base, error_chain(e)),
                retry_after: None,
            }
        } else if closed_before_answer(e) {
            UpstreamError::Closed {
                upstream: self.name.to_string(),
                reason: error_chain(e),
            }
        } else {
            UpstreamError::Transport {
                upstream: self.name.to_string(),
                reason: error_chain(e),
            }
        }
    }

    /// Classifies an error while reading the body.
    fn body_error(&self, e: &hyper::Error) -> UpstreamError {
        if let Some(reason) = crate::tls::tls_cause(e) {
            return UpstreamError::Tls {
                upstream: self.name.to_string(),
                url: self.base.clone(),
                reason,
            };
        }
        UpstreamError::Transport {
            upstream: self.name.to_string(),
            reason: error_chain(e),
        }
    }

    fn timeout(&self, waiting_for: &'static str, after: Duration) -> UpstreamError {
        UpstreamError::Timeout {
            upstream: self.name.to_string(),
            waiting_for,
            after,
        }
    }

    /// What a call's result tells the breaker: a 429 with `Retry-After`
    /// opens it for that long (at most `max_retry_after`), other upstream
    /// failures count, anything else (an answer, a 4xx) is a success.
    fn outcome(&self, error: Option<&UpstreamError>) -> Outcome {
        match error {
            None => Outcome::Success,
            Some(UpstreamError::Status {
                status: 429,
                retry_after: Some(wait),
                ..
            }) => Outcome::RetryAfter((*wait).min(self.cfg.max_retry_after)),
            Some(e) if e.is_upstream_failure() => Outcome::Failure,
            Some(_) => Outcome::Success,
        }
    }

    fn protocol(&self, reason: String) -> UpstreamError {
        UpstreamError::Protocol {
            upstream: self.name.to_string(),
            reason,
        }
    }
}

/// One admitted call. Its outcome goes to the breaker; the half-open
/// trial, dropped without an outcome (the caller cancelled it), releases
/// the trial.
struct Call<'a> {
    upstream: &'a Upstream,
    trial: bool,
    settled: bool,
}

impl Call<'_> {
    fn finish(&mut self, outcome: Outcome) {
        self.settled = true;
        record(&self.upstream.breaker, &self.upstream.name, outcome);
    }

    /// An outcome that says nothing about the upstream: no count, and a
    /// trial it held is free for the next call.
    fn neutral(&mut self) {
        self.settled = true;
        if self.trial {
            lock(&self.upstream.breaker).release_trial();
        }
    }
}

/// Who a call is for: what its failures tell the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallClass {
    /// A client's request: every upstream failure counts.
    Online,
    /// A batch item: an answered 5xx does not count (see
    /// [`Upstream::complete_as`]).
    Batch,
}

/// A URL as a request URI: parsed as a URL first (an international host
/// in punycode, characters a URI cannot hold percent-encoded), as the
/// configuration's URL was checked.
fn parse_uri(text: &str) -> Result<Uri, String> {
    let url = reqwest::Url::parse(text).map_err(|e| e.to_string())?;
    url.as_str().parse::<Uri>().map_err(|e| e.to_string())
}

/// A response's `Retry-After`, where it has a usable one.
fn retry_after_of(headers: &HeaderMap) -> Option<Duration> {
    parse_retry_after(headers.get(RETRY_AFTER).and_then(|v| v.to_str().ok()))
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        if self.trial && !self.settled {
            lock(&self.upstream.breaker).release_trial();
        }
    }
}

/// Whether a send failed because the connection closed before any of
/// the answer came (hyper's "connection closed before message completed").
fn closed_before_answer(e: &client::SendError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message();
        }
        source = s.source();
    }
    false
}

/// Reads a body up to `cap` bytes; the flag says whether it was cut.
async fn read_body(resp: client::Response, cap: usize) -> Result<(Vec<u8>, bool), hyper::Error> {
    let hint = resp
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0)
        .min(cap);
    let mut body = resp.into_body();
    let mut buf = Vec::with_capacity(hint);
    while let Some(frame) = body.frame().await {
        // Trailers carry no answer.
        let Ok(chunk) = frame?.into_data() else {
            continue;
        };
        if buf.len() + chunk.len() > cap {
            let room = cap - buf.len();
            buf.extend_from_slice(&chunk[..room]);
            return Ok((buf, true));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok((buf, false))
}

#[cfg(test)]
mod tests {
    use super::sse::{SseEvent, SseParser, MAX_EVENT};
    use super::*;
    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::{get, post};
    use axum::{Json, Router};
    use bytes::Bytes;
    use futures_util::StreamExt;
    use serde_json::json;
    use std::convert::Infallible;
    use std::future::Future;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    // -- in-test mock servers ------------------------------------------------

    /// A mock server on an ephemeral loopback port, stopped when dropped.
    struct Mock {
        url: String,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Mock {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    async fn mock(router: Router) -> Mock {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = router.into_make_service_with_connect_info::<SocketAddr>();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, service).await;
        });
        Mock {
            url: format!("http://{addr}"),
            task,
        }
    }

    /// A loopback address nothing listens on.
    async fn dead_url() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        format!("http://{addr}")
    }

    fn upstream(url: &str, tweak: impl FnOnce(&mut UpstreamConfig)) -> Upstream {
        let mut cfg = UpstreamConfig::new(url);
        cfg.health_path = String::new();
        tweak(&mut cfg);
        Upstream::new("test".into(), cfg).unwrap()
    }

    #[test]
    fn the_parsed_endpoints_are_the_joined_urls() {
        // Every base shape a config may give (trailing slash, a path
        // prefix, a port or none): the URL parsed once is the one the
        // call would have parsed from the joined string.
        for host in ["127.0.0.1:9", "localhost", "gpu-7.internal:8000"] {
            for prefix in ["", "/", "/proxy", "/proxy/", "/a/b/v0/"] {
                let base = format!("http://{host}{prefix}");
                let u = upstream(&base, |_| {});
                for (path, parsed) in [
                    ("/v1/chat/completions", &u.chat_uri),
                    ("/v1/completions", &u.completions_uri),
                ] {
                    let joined = parse_uri(&u.endpoint(path)).ok();
                    assert!(parsed.is_some(), "{base}{path}");
                    assert_eq!(parsed, &joined, "{base}{path}");
                    // Any other path is joined the same way.
                    assert_eq!(u.uri(path).ok().as_ref(), joined.as_ref(), "{base}{path}");
                }
                // What a URI cannot hold is percent-encoded, as the URL
                // parser writes it (a health path with a space).
                let odd = u.uri("/health check").unwrap();
                assert!(odd.path().ends_with("/health%20check"), "{odd}");
            }
        }
    }

    /// Every test is bounded: a hang fails it instead of the suite.
    async fn bounded<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(20), f)
            .await
            .expect("test did not finish in time")
    }

    async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "timed out waiting until {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Sets its flag when dropped: the mock's response body was dropped,
    /// i.e. the client went away.
    struct DropFlag(Arc<AtomicBool>);

    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// An endless body: `first`, then a chunk every 20 ms; sets `flag` when
    /// the server drops it.
    fn endless_body(first: &'static str, chunk: &'static str, flag: Arc<AtomicBool>) -> Body {
        let first =
            futures_util::stream::iter([Ok::<_, Infallible>(Bytes::from_static(first.as_bytes()))]);
        let rest = futures_util::stream::unfold(DropFlag(flag), move |flag| async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Some((Ok(Bytes::from_static(chunk.as_bytes())), flag))
        });
        Body::from_stream(first.chain(rest))
    }

    fn sse_response(body: Body) -> axum::response::Response {
        let mut resp = axum::response::Response::new(body);
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        resp
    }

    // -- non-streaming -------------------------------------------------------

    #[tokio::test]
    async fn complete_rewrites_model_and_sends_auth() {
        bounded(async {
            let app = Router::new().route(
                "/prefix/v1/chat/completions",
                post(
                    |ConnectInfo(peer): ConnectInfo<SocketAddr>,
                     headers: HeaderMap,
                     Json(body): Json<Value>| async move {
                        Json(json!({
                            "got": body,
                            "auth": headers.get("authorization").and_then(|v| v.to_str().ok()),
                            "accept": headers.get("accept").and_then(|v| v.to_str().ok()),
                            "peer": peer.to_string(),
                        }))
                    },
                ),
            );
            let m = mock(app).await;
            let up = upstream(&format!("{}/prefix/", m.url), |c| {
                c.api_key = Some("sk-test".into());
                c.served_model = Some("meta-llama/Llama-3.1-8B".into());
            });
            let body = json!({
                "model": "small", "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "hi"}]
            });
            let a = up
                .complete("/v1/chat/completions", body.clone())
                .await
                .unwrap();
            assert_eq!(a["got"]["model"], "meta-llama/Llama-3.1-8B");
            assert_eq!(a["got"]["stream"], false);
            assert!(a["got"].get("stream_options").is_none());
            assert_eq!(a["got"]["messages"], body["messages"]);
            assert_eq!(a["auth"], "Bearer sk-test");
            assert_eq!(a["accept"], "application/json");
            // No "stream" key is added where there was none; the path may
            // come without its leading slash.
            let b = up
                .complete("v1/chat/completions", json!({"model": "x"}))
                .await
                .unwrap();
            assert!(b["got"].get("stream").is_none());
            // The connection was pooled and reused.
            assert_eq!(a["peer"], b["peer"]);
            assert_eq!(up.state(), BreakerState::Closed);
        })
        .await;
    }

    #[tokio::test]
    async fn complete_rejects_a_body_that_is_not_an_object() {
        let up = upstream("http://127.0.0.1:9", |_| {});
        let e = up
            .complete("/v1/completions", json!([1, 2]))
            .await
            .unwrap_err();
        assert!(matches!(e, UpstreamError::BadRequest { .. }), "{e:?}");
        assert_eq!(e.http_status(), 400);
    }

    #[tokio::test]
    async fn non_json_answer_is_a_protocol_error() {
        bounded(async {
            let app = Router::new().route("/v1/completions", post(|| async { "not json" }));
            let m = mock(app).await;
            let up = upstream(&m.url, |_| {});
            let e = up.complete("/v1/completions", json!({})).await.unwrap_err();
            assert!(matches!(e, UpstreamError::Protocol { .. }), "{e:?}");
            assert_eq!(e.http_status(), 502);
            // An answer that is not JSON is a failure of the upstream.
            assert_eq!(up.consecutive_failures(), 1);
        })
        .await;
    }

    // -- streaming -----------------------------------------------------------

    /// Awkward SSE: a BOM, comments, `\r\n`, bare `\r`, other fields, an
    /// event whose data spans two `data:` lines, and no blank line after
    /// `[DONE]`.
    const AWKWARD_SSE: &str = "\u{FEFF}: keep-alive\r\n\
        event: message\r\nid: 1\r\n\
        data: {\"n\":1,\"text\":\"é ü\"}\r\n\r\n\
        data:{\"n\":2}\n\n\
        retry: 100\r\
        data: {\"n\":\r\
        data: 3}\r\r\
        : another comment\n\
        \n\n\
        data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\n\
        data: [DONE]";

    fn expected_events() -> Vec<SseEvent> {
        vec![
            SseEvent::Data("{\"n\":1,\"text\":\"é ü\"}".into()),
            SseEvent::Data("{\"n\":2}".into()),
            SseEvent::Data("{\"n\":\n3}".into()),
            SseEvent::Data("{\"choices\":[],\"usage\":{\"completion_tokens\":3}}".into()),
            SseEvent::Done,
        ]
    }

    fn parse_in_pieces(pieces: &[&[u8]]) -> Vec<SseEvent> {
        let mut parser = SseParser::default();
        let mut events = Vec::new();
        for piece in pieces {
            parser.push(piece);
            while let Some(e) = parser.next_event().unwrap() {
                events.push(e);
            }
        }
        parser.finish();
        while let Some(e) = parser.next_event().unwrap() {
            events.push(e);
        }
        events
    }

    #[test]
    fn sse_parser_handles_every_split_point() {
        let bytes = AWKWARD_SSE.as_bytes();
        assert_eq!(parse_in_pieces(&[bytes]), expected_events());
        for i in 0..=bytes.len() {
            let (a, b) = bytes.split_at(i);
            assert_eq!(parse_in_pieces(&[a, b]), expected_events(), "split at {i}");
        }
        let singles: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(parse_in_pieces(&singles), expected_events());
    }

    #[test]
    fn sse_parser_limits_and_errors() {
        let mut p = SseParser::default();
        p.push(&vec![b'a'; MAX_EVENT + 1]);
        assert!(p.next_event().is_err());
        let mut p = SseParser::default();
        p.push(b"data: \xff\xfe\n\n");
        assert!(p.next_event().is_err());
        // An event cut by the end of input still counts.
        assert_eq!(
            parse_in_pieces(&[b"data: {}\r"]),
            vec![SseEvent::Data("{}".into())]
        );
        assert_eq!(parse_in_pieces(&[b": only a comment\n\n"]), vec![]);
    }

    #[tokio::test]
    async fn stream_parses_chunks_split_at_awkward_boundaries() {
        bounded(async {
            let seen = Arc::new(Mutex::new(None::<Value>));
            let seen_in = Arc::clone(&seen);
            let app = Router::new().route(
                "/v1/chat/completions",
                post(move |headers: HeaderMap, Json(body): Json<Value>| {
                    let seen = Arc::clone(&seen_in);
                    async move {
                        *seen.lock().unwrap() = Some(json!({
                            "body": body,
                            "accept": headers.get("accept").and_then(|v| v.to_str().ok()),
                        }));
                        // Chunks of 1 to 7 bytes, sent 1 ms apart.
                        let bytes = AWKWARD_SSE.as_bytes();
                        let mut pieces = Vec::new();
                        let (mut at, mut size) = (0, 1);
                        while at < bytes.len() {
                            let end = (at + size).min(bytes.len());
                            pieces.push(Bytes::copy_from_slice(&bytes[at..end]));
                            at = end;
                            size = size % 7 + 1;
                        }
                        let body = futures_util::stream::iter(pieces).then(|p| async move {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            Ok::<_, Infallible>(p)
                        });
                        sse_response(Body::from_stream(body))
                    }
                }),
            );
            let m = mock(app).await;
            let up = upstream(&m.url, |c| c.served_model = Some("served".into()));
            let body = json!({
                "model": "alias", "messages": [],
                "stream_options": {"continuous_usage_stats": false}
            });
            let stream = up.stream("/v1/chat/completions", body).await.unwrap();
            let items: Vec<_> = stream.collect().await;
            let values: Vec<Value> = items.into_iter().map(Result::unwrap).collect();
            assert_eq!(
                values,
                vec![
                    json!({"n": 1, "text": "é ü"}),
                    json!({"n": 2}),
                    json!({"n": 3}),
                    json!({"choices": [], "usage": {"completion_tokens": 3}}),
                ]
            );
            let seen = seen.lock().unwrap().clone().unwrap();
            assert_eq!(seen["accept"], "text/event-stream");
            assert_eq!(seen["body"]["model"], "served");
            assert_eq!(seen["body"]["stream"], true);
            assert_eq!(
                seen["body"]["stream_options"],
                json!({"continuous_usage_stats": false, "include_usage": true})
            );
        })
        .await;
    }

    #[tokio::test]
    async fn stream_reuses_the_connection_after_done() {
        bounded(async {
            let app = Router::new().route(
                "/v1/completions",
                post(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
                    sse_response(Body::from(format!(
                        "data: {{\"peer\":\"{peer}\"}}\n\ndata: [DONE]\n\n"
                    )))
                }),
            );
            let m = mock(app).await;
            let up = upstream(&m.url, |_| {});
            let mut peers = Vec::new();
            for _ in 0..3 {
                let stream = up.stream("/v1/completions", json!({})).await.unwrap();
                let items: Vec<_> = stream.collect().await;
                assert_eq!(items.len(), 1);
                peers.push(items[0].as_ref().unwrap()["peer"].clone());
                // Leave time for a background drain, if one was needed.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert_eq!(peers[0], peers[1]);
            assert_eq!(peers[1], peers[2]);
        })
        .await;
    }

    #[tokio::test]
    async fn stream_errors_on_cut_stream_and_json_answer() {
        bounded(async {
            let app = Router::new()
                .route(
                    "/cut",
                    post(|| async { sse_response(Body::from("data: {\"n\":1}\n\ndata: {\"n\"")) }),
                )
                .route("/json", post(|| async { Json(json!({"choices": []})) }));
            let m = mock(app).await;
            let up = upstream(&m.url, |_| {});
            let items: Vec<_> = up.stream("/cut", json!({})).await.unwrap().collect().await;
            assert_eq!(items.len(), 2);
            assert_eq!(items[0].as_ref().unwrap(), &json!({"n": 1}));
            let e = items[1].as_ref().unwrap_err();
            assert!(matches!(e, UpstreamError::Protocol { .. }), "{e:?}");
            match up.stream("/json", json!({})).await {
                Err(UpstreamError::Protocol { .. }) => {}
                Err(e) => panic!("unexpected error {e:?}"),
                Ok(_) => panic!("a JSON answer to a streaming request must fail"),
            }
            // Both count against the breaker: the cut and the JSON answer.
            assert_eq!(up.consecutive_failures(), 2);
        })
        .await;
    }

    // -- errors and the breaker ----------------------------------------------

    /// A replica that reads each request and closes the connection without
    /// a byte of answer (what a kept-alive connection closing as a request
    /// goes out looks like): the error says so and may be sent again,
    /// streaming or not; a run of them opens the breaker (a replica that
    /// dies as requests arrive).
    #[tokio::test]
    async fn a_connection_closed_before_any_answer_may_be_sent_again() {
        bounded(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", listener.local_addr().unwrap());
            let task = tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                while let Ok((mut sock, _)) = listener.accept().await {
                    let mut buf = [0u8; 4096];
                    let _ = sock.read(&mut buf).await;
                    drop(sock);
                }
            });
            let up = upstream(&url, |c| c.failure_threshold = 6);
            for _ in 0..3 {
                let e = up
                    .complete("/v1/chat/completions", json!({}))
                    .await
                    .unwrap_err();
                assert!(matches!(e, UpstreamError::Closed { .. }), "{e:?}");
                assert!(e.may_resend() && !e.is_unsent(), "{e:?}");
                assert!(e.is_upstream_failure());
                assert_eq!(e.http_status(), 502);
                match up.stream("/v1/chat/completions", json!({})).await {
                    Err(UpstreamError::Closed { .. }) => {}
                    Err(e) => panic!("unexpected error {e:?}"),
                    Ok(_) => panic!("nothing was answered"),
                }
            }
            assert_eq!(up.consecutive_failures(), 6);
            assert!(!up.available(), "six in a row open it");
            task.abort();
        })
        .await;
    }

    #[tokio::test]
    async fn server_errors_open_the_breaker() {
        bounded(async {
            let hits = Arc::new(AtomicUsize::new(0));
            let hits_in = Arc::clone(&hits);
            let app = Router::new().route(
                "/v1/completions",
                post(move || {
                    hits_in.fetch_add(1, Ordering::SeqCst);
                    async { (StatusCode::INTERNAL_SERVER_ERROR, "CUDA out of memory") }
                }),
            );
            let m = mock(app).await;
            let up = upstream(&m.url, |c| c.failure_threshold = 3);
            for i in 0..3 {
                assert!(up.available(), "still closed before failure {i}");
                let e = up.complete("/v1/completions", json!({})).await.unwrap_err();
                match &e {
                    UpstreamError::Status { status, body, .. } => {
                        assert_eq!(*status, 500);
                        assert_eq!(body, "CUDA out of memory");
                    }
                    other => panic!("unexpected {other:?}"),
                }
                assert_eq!(e.http_status(), 502);
            }
            assert!(!up.available());
            assert!(matches!(up.state(), BreakerState::Open { .. }));
            let e = up.complete("/v1/completions", json!({})).await.unwrap_err();
            assert!(matches!(e, UpstreamError::Unavailable { .. }), "{e:?}");
            assert_eq!(e.http_status(), 503);
            assert!(e.is_unsent());
            let e = up.stream("/v1/completions", json!({})).await.err().unwrap();
            assert_eq!(e.http_status(), 503);
            assert_eq!(hits.load(Ordering::SeqCst), 3, "no request while open");
        })
        .await;
    }

    #[tokio::test]
    async fn client_errors_pass_through_and_do_not_count() {
        bounded(async {
            let app = Router::new().route(
                "/v1/chat/completions",
                post(|| async {
                    (
                        StatusCode::NOT_FOUND,
                        Json(json!({"error": {"message": "The model `x` does not exist."}})),
                    )
                }),
            );
            let m = mock(app).await;
            let up = upstream(&m.url, |c| c.failure_threshold = 2);
            for _ in 0..3 {
                let e = up
                    .complete("/v1/chat/completions", json!({"model": "x"}))
                    .await
                    .unwrap_err();
                assert_eq!(e.http_status(), 404);
                let UpstreamError::Status {
                    status: 404, body, ..
                } = &e
                else {
                    panic!("unexpected {e:?}");
                };
                let body: Value = serde_json::from_str(body).unwrap();
                assert_eq!(body["error"]["message"], "The model `x` does not exist.");
                let e = up
                    .stream("/v1/chat/completions", json!({}))
                    .await
                    .err()
                    .unwrap();
                assert_eq!(e.http_status(), 404);
            }
            assert!(up.available());
            assert_eq!(up.consecutive_failures(), 0);
        })
        .await;
    }

    #[tokio::test]
    async fn timeouts_answer_504() {
        bounded(async {
            let app = Router::new()
                .route(
                    "/never",
                    post(|| async {
                        std::future::pending::<()>().await;
                        ""
                    }),
                )
                .route(
                    "/stalls",
                    post(|| async {
                        let first = futures_util::stream::iter([Ok::<_, Infallible>(
                            Bytes::from_static(b"data: {\"n\":1}\n\n"),
                        )]);
                        sse_response(Body::from_stream(
                            first.chain(futures_util::stream::pending()),
                        ))
                    }),
                );
            let m = mock(app).await;
            let up = upstream(&m.url, |c| c.timeout = Duration::from_millis(200));

            let start = Instant::now();
            let e = up.complete("/never", json!({})).await.unwrap_err();
            assert!(matches!(e, UpstreamError::Timeout { .. }), "{e:?}");
            assert_eq!(e.http_status(), 504);
            assert!(start.elapsed() < Duration::from_secs(2));
            assert!(e.to_string().contains("200ms"), "{e}");

            let e = up.stream("/never", json!({})).await.err().unwrap();
            assert_eq!(e.http_status(), 504);

            let mut stream = Box::pin(up.stream("/stalls", json!({})).await.unwrap());
            assert_eq!(stream.next().await.unwrap().unwrap(), json!({"n": 1}));
            let e = stream.next().await.unwrap().unwrap_err();
            assert!(matches!(e, UpstreamError::Timeout { .. }), "{e:?}");
            assert!(stream.next().await.is_none());
            // Two timeouts, then the stall's headers (a success) reset the
            // count before its gap timeout.
            assert_eq!(up.consecutive_failures(), 1);
        })
        .await;
    }

    #[tokio::test]
    async fn connection_refused_is_unavailable() {
        bounded(async {
            let up = upstream(&dead_url().await, |_| {});
            let e = up.complete("/v1/completions", json!({})).await.unwrap_err();
            assert!(matches!(e, UpstreamError::Unavailable { .. }), "{e:?}");
            assert_eq!(e.http_status(), 503);
            assert!(e.is_unsent());
            assert_eq!(up.consecutive_failures(), 1);
        })
        .await;
    }

    #[tokio::test]
    async fn half_open_lets_one_trial_through_then_closes() {
        bounded(async {
            let failing = Arc::new(AtomicBool::new(true));
            let failing_in = Arc::clone(&failing);
            let app = Router::new()
                .route(
                    "/v1/completions",
                    post(move || {
                        let fail = failing_in.load(Ordering::SeqCst);
                        async move {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            if fail {
                                (StatusCode::BAD_GATEWAY, Json(json!({})))
                            } else {
                                (StatusCode::OK, Json(json!({"ok": true})))
                            }
                        }
                    }),
                )
                .route(
                    "/slow",
                    post(|| async {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        ""
                    }),
                );
            let m = mock(app).await;
            let up = upstream(&m.url, |c| {
                c.failure_threshold = 1;
                c.open_for = Duration::from_millis(100);
            });
            assert!(up.complete("/v1/completions", json!({})).await.is_err());
            assert!(!up.ready());
            tokio::time::sleep(Duration::from_millis(150)).await;
            assert_eq!(up.state(), BreakerState::HalfOpen);
            // A trial cancelled before its answer frees the trial.
            assert!(up.ready());
            let cancelled = up.complete("/slow", json!({}));
            assert!(tokio::time::timeout(Duration::from_millis(50), cancelled)
                .await
                .is_err());
            assert!(up.ready());
            // Two calls at once: one trial, one refused without being sent.
            failing.store(false, Ordering::SeqCst);
            assert!(up.available());
            let (a, b) = tokio::join!(
                up.complete("/v1/completions", json!({})),
                up.complete("/v1/completions", json!({}))
            );
            let (ok, refused) = if a.is_ok() { (a, b) } else { (b, a) };
            assert_eq!(ok.unwrap(), json!({"ok": true}));
            let refused = refused.unwrap_err();
            assert!(refused.is_unsent(), "{refused:?}");
            assert_eq!(up.state(), BreakerState::Closed);
        })
        .await;
    }

    #[tokio::test]
    async fn a_429_opens_the_breaker_for_its_bounded_retry_after() {
        bounded(async {
            let app = Router::new()
                .route(
                    "/busy",
                    post(|| async {
                        (
                            StatusCode::TOO_MANY_REQUESTS,
                            [("retry-after", "2")],
                            Json(json!({"error": {"message": "queue full"}})),
                        )
                    }),
                )
                .route(
                    "/very-busy",
                    post(|| async {
                        (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "3600")], "")
                    }),
                )
                .route(
                    "/busy-no-hint",
                    post(|| async { (StatusCode::TOO_MANY_REQUESTS, "") }),
                );
            let m = mock(app).await;
            let up = upstream(&m.url, |c| c.failure_threshold = 5);
            let e = up.complete("/busy", json!({})).await.unwrap_err();
            assert_eq!(e.http_status(), 429);
            assert_eq!(e.retry_after(), Some(Duration::from_secs(2)));
            // Open at once, for the upstream's two seconds.
            let BreakerState::Open { until } = up.state() else {
                panic!(
                    "a 429 with Retry-After must open the breaker: {:?}",
                    up.state()
                );
            };
            let left = until.saturating_duration_since(Instant::now());
            assert!(
                left > Duration::from_millis(1500) && left <= Duration::from_secs(2),
                "{left:?}"
            );
            let refused = up.complete("/busy", json!({})).await.unwrap_err();
            assert!(refused.is_unsent());
            assert!(refused
                .retry_after()
                .is_some_and(|d| d <= Duration::from_secs(2)));
            // A Retry-After longer than `max_retry_after` is cut to it.
            let up = upstream(&m.url, |c| c.max_retry_after = Duration::from_secs(3));
            let e = up.stream("/very-busy", json!({})).await.err().unwrap();
            assert_eq!(e.retry_after(), Some(Duration::from_secs(3600)));
            let BreakerState::Open { until } = up.state() else {
                panic!("{:?}", up.state());
            };
            assert!(until.saturating_duration_since(Instant::now()) <= Duration::from_secs(3));
            // Without a hint, a 429 counts toward the threshold.
            let up = upstream(&m.url, |c| c.failure_threshold = 2);
            up.complete("/busy-no-hint", json!({})).await.unwrap_err();
            assert_eq!(up.state(), BreakerState::Closed);
            assert_eq!(up.consecutive_failures(), 1);
            up.complete("/busy-no-hint", json!({})).await.unwrap_err();
            assert!(matches!(up.state(), BreakerState::Open { .. }));
        })
        .await;
    }

    #[test]
    fn retry_after_values() {
        use super::error::parse_retry_after;
        assert_eq!(parse_retry_after(Some("3")), Some(Duration::from_secs(3)));
        assert_eq!(
            parse_retry_after(Some(" 0.5 ")),
            Some(Duration::from_millis(500))
        );
        assert_eq!(parse_retry_after(Some("0")), None);
        assert_eq!(parse_retry_after(Some("-1")), None);
        assert_eq!(
            parse_retry_after(Some("Wed, 21 Oct 2015 07:28:00 GMT")),
            None
        );
        assert_eq!(parse_retry_after(None), None);
    }

    // -- cancellation --------------------------------------------------------

    #[tokio::test]
    async fn dropping_the_stream_closes_the_upstream_connection() {
        bounded(async {
            let gone = Arc::new(AtomicBool::new(false));
            let gone_in = Arc::clone(&gone);
            let app = Router::new().route(
                "/v1/chat/completions",
                post(move || {
                    let flag = Arc::clone(&gone_in);
                    async move {
                        sse_response(endless_body(
                            "data: {\"n\":0}\n\n",
                            "data: {\"n\":1}\n\n",
                            flag,
                        ))
                    }
                }),
            );
            let m = mock(app).await;
            let up = upstream(&m.url, |_| {});
            let mut stream = Box::pin(up.stream("/v1/chat/completions", json!({})).await.unwrap());
            assert_eq!(stream.next().await.unwrap().unwrap(), json!({"n": 0}));
            assert_eq!(stream.next().await.unwrap().unwrap(), json!({"n": 1}));
            assert!(!gone.load(Ordering::SeqCst));
            drop(stream);
            wait_until("the mock sees the client go", || {
                gone.load(Ordering::SeqCst)
            })
            .await;
            assert_eq!(up.consecutive_failures(), 0);
        })
        .await;
    }

    #[tokio::test]
    async fn dropping_the_complete_future_closes_the_upstream_connection() {
        bounded(async {
            let gone = Arc::new(AtomicBool::new(false));
            let gone_in = Arc::clone(&gone);
            let app = Router::new().route(
                "/v1/completions",
                post(move || {
                    let flag = Arc::clone(&gone_in);
                    async move { endless_body("{\"choices\": [", " ", flag) }
                }),
            );
            let m = mock(app).await;
            let up = upstream(&m.url, |_| {});
            let call = up.complete("/v1/completions", json!({}));
            assert!(tokio::time::timeout(Duration::from_millis(200), call)
                .await
                .is_err());
            wait_until("the mock sees the client go", || {
                gone.load(Ordering::SeqCst)
            })
            .await;
            assert_eq!(up.consecutive_failures(), 0);
        })
        .await;
    }

    // -- health checks -------------------------------------------------------

    #[tokio::test]
    async fn health_checks_mark_a_dead_upstream_unavailable() {
        bounded(async {
            let up = Arc::new(upstream(&dead_url().await, |c| {
                c.health_path = "/health".into();
                c.health_interval = Duration::from_millis(20);
                c.failure_threshold = 2;
            }));
            let task = up.spawn_health_checks().unwrap();
            wait_until("the breaker opens", || {
                matches!(up.state(), BreakerState::Open { .. })
            })
            .await;
            assert!(!up.available());
            // The task holds only a weak reference and stops with the upstream.
            drop(up);
            tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .unwrap()
                .unwrap();
        })
        .await;
    }

    #[tokio::test]
    async fn health_checks_open_and_close_the_breaker() {
        bounded(async {
            let healthy = Arc::new(AtomicBool::new(true));
            let healthy_in = Arc::clone(&healthy);
            let app = Router::new().route(
                "/health",
                get(move || {
                    let ok = healthy_in.load(Ordering::SeqCst);
                    async move {
                        if ok {
                            StatusCode::OK
                        } else {
                            StatusCode::SERVICE_UNAVAILABLE
                        }
                    }
                }),
            );
            let m = mock(app).await;
            let up = Arc::new(upstream(&m.url, |c| {
                c.health_path = "/health".into();
                c.health_interval = Duration::from_millis(20);
                c.failure_threshold = 2;
            }));
            up.check_health().await.unwrap();
            let task = up.spawn_health_checks().unwrap();
            healthy.store(false, Ordering::SeqCst);
            wait_until("the breaker opens", || {
                matches!(up.state(), BreakerState::Open { .. })
            })
            .await;
            healthy.store(true, Ordering::SeqCst);
            wait_until("the breaker closes", || up.state() == BreakerState::Closed).await;
            task.abort();
        })
        .await;
    }

    #[tokio::test]
    async fn health_checks_keep_a_dead_upstream_out_after_its_first_open_period() {
        bounded(async {
            let up = Arc::new(upstream(&dead_url().await, |c| {
                c.health_path = "/health".into();
                c.health_interval = Duration::from_millis(20);
                c.open_for = Duration::from_millis(100);
                c.failure_threshold = 2;
            }));
            let task = up.spawn_health_checks().unwrap();
            wait_until("the breaker opens", || {
                matches!(up.state(), BreakerState::Open { .. })
            })
            .await;
            // Several open periods later, the checks still fail: never ready.
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(40)).await;
                assert!(!up.ready(), "{:?}", up.state());
            }
            task.abort();
        })
        .await;
    }

    #[tokio::test]
    async fn a_passing_health_check_does_not_close_a_breaker_requests_opened() {
        bounded(async {
            let app = Router::new()
                .route("/health", get(|| async { "ok" }))
                .route("/v1/completions", post(|| async { "not json" }));
            let m = mock(app).await;
            let up = upstream(&m.url, |c| {
                c.health_path = "/health".into();
                c.failure_threshold = 1;
                c.open_for = Duration::from_millis(100);
            });
            up.complete("/v1/completions", json!({})).await.unwrap_err();
            assert!(matches!(up.state(), BreakerState::Open { .. }));
            up.check_health().await.unwrap();
            assert!(matches!(up.state(), BreakerState::Open { .. }));
        })
        .await;
    }

    #[tokio::test]
    async fn no_health_task_without_a_path() {
        let up = Arc::new(upstream("http://127.0.0.1:9", |c| {
            c.health_path = String::new()
        }));
        assert!(up.spawn_health_checks().is_none());
        up.check_health().await.unwrap();
    }

    // -- the breaker as a pure state machine -----------------------------------

    #[test]
    fn breaker_opens_after_consecutive_failures() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = Breaker::new(3, 10 * s, 60 * s);
        assert!(b.try_acquire(t0));
        assert_eq!(b.admit(t0), Admission::Admitted);
        assert!(!b.on_failure(t0));
        assert!(!b.on_failure(t0));
        // A success resets the count.
        assert!(!b.on_success());
        assert_eq!(b.consecutive_failures(), 0);
        assert!(!b.on_failure(t0));
        assert!(!b.on_failure(t0));
        assert!(b.on_failure(t0 + s));
        assert_eq!(b.state(t0 + s), BreakerState::Open { until: t0 + 11 * s });
        assert!(!b.ready(t0 + 5 * s));
        assert!(!b.try_acquire(t0 + 5 * s));
        assert_eq!(b.admit(t0 + 5 * s), Admission::Refused);
        // A late failure of a request sent before does not extend it.
        assert!(!b.on_failure(t0 + 5 * s));
        assert_eq!(
            b.state(t0 + 5 * s),
            BreakerState::Open { until: t0 + 11 * s }
        );
        assert_eq!(b.state(t0 + 11 * s), BreakerState::HalfOpen);
        assert!(b.ready(t0 + 11 * s));
    }

    #[test]
    fn half_open_admits_one_trial() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = Breaker::new(1, 10 * s, 60 * s);
        assert!(b.on_failure(t0));
        let t1 = t0 + 10 * s;
        // Asking without taking changes nothing.
        assert!(b.ready(t1) && b.ready(t1));
        assert!(b.try_acquire(t1), "the first caller reserves the trial");
        assert!(!b.ready(t1));
        assert!(!b.try_acquire(t1), "only one trial");
        // The next call sent is the trial; any other is refused.
        assert_eq!(b.admit(t1), Admission::Trial);
        assert_eq!(b.admit(t1), Admission::Refused);
        assert!(!b.try_acquire(t1 + 30 * s));
        // Trial fails: open again for a full period.
        assert!(b.on_failure(t1 + s));
        assert_eq!(b.state(t1 + s), BreakerState::Open { until: t1 + 11 * s });
        assert_eq!(b.admit(t1 + 5 * s), Admission::Refused);
        // A call sent directly after the period takes the trial itself.
        let t2 = t1 + 11 * s;
        assert_eq!(b.admit(t2), Admission::Trial);
        assert_eq!(b.admit(t2), Admission::Refused);
        assert!(!b.try_acquire(t2));
        // It succeeds: closed, everyone admitted.
        assert!(b.on_success());
        assert_eq!(b.state(t2), BreakerState::Closed);
        assert!(b.try_acquire(t2) && b.try_acquire(t2));
        assert_eq!(b.admit(t2), Admission::Admitted);
    }

    #[test]
    fn abandoned_trials_are_released() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = Breaker::new(1, 10 * s, 60 * s);
        b.on_failure(t0);
        let t1 = t0 + 10 * s;
        // A reservation no call uses expires after `open_for`.
        assert!(b.try_acquire(t1));
        assert!(!b.try_acquire(t1 + 9 * s));
        assert!(b.try_acquire(t1 + 10 * s));
        // A trial cancelled before its answer frees the trial at once.
        let t2 = t1 + 10 * s;
        assert_eq!(b.admit(t2), Admission::Trial);
        b.release_trial();
        assert!(b.ready(t2));
        assert_eq!(b.admit(t2), Admission::Trial);
        // A trial that never reports expires after the lease.
        assert_eq!(b.admit(t2 + 59 * s), Admission::Refused);
        assert!(!b.ready(t2 + 59 * s));
        assert_eq!(b.admit(t2 + 60 * s), Admission::Trial);
        // Releasing does nothing unless a trial is in flight.
        b.on_success();
        b.release_trial();
        assert_eq!(b.state(t2), BreakerState::Closed);
        b.on_failure(t2);
        b.release_trial();
        assert!(matches!(b.state(t2), BreakerState::Open { .. }));
    }

    #[test]
    fn health_checks_count_in_every_phase() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = Breaker::new(2, 10 * s, 60 * s);
        // Closed: toward the threshold.
        assert!(!b.on_health_failed(t0));
        assert!(b.on_health_failed(t0));
        assert_eq!(b.state(t0), BreakerState::Open { until: t0 + 10 * s });
        // Open: each failed check keeps it open for a period from now.
        assert!(!b.on_health_failed(t0 + 5 * s));
        assert_eq!(
            b.state(t0 + 12 * s),
            BreakerState::Open { until: t0 + 15 * s }
        );
        // Its period over (shown half-open, ready), a failed check reopens.
        assert!(b.ready(t0 + 15 * s));
        assert!(b.on_health_failed(t0 + 16 * s));
        assert!(!b.ready(t0 + 16 * s));
        // Half-open with the trial reserved or in flight: reopens.
        assert!(b.try_acquire(t0 + 26 * s));
        assert!(b.on_health_failed(t0 + 26 * s));
        assert!(!b.ready(t0 + 27 * s));
        assert_eq!(b.admit(t0 + 36 * s), Admission::Trial);
        assert!(b.on_health_failed(t0 + 36 * s));
        assert!(!b.ready(t0 + 36 * s));
        // Only health checks failed: a passing one closes.
        assert!(b.on_health_ok(t0 + 37 * s));
        assert_eq!(b.state(t0 + 37 * s), BreakerState::Closed);
        // A request failed: a passing check leaves the decision to the trial.
        let mut b = Breaker::new(1, 10 * s, 60 * s);
        assert!(b.on_failure(t0));
        assert!(!b.on_health_ok(t0 + s));
        assert!(matches!(b.state(t0 + s), BreakerState::Open { .. }));
        assert_eq!(b.admit(t0 + 10 * s), Admission::Trial);
        assert!(b.on_success());
        assert_eq!(b.state(t0 + 10 * s), BreakerState::Closed);
    }

    #[test]
    fn retry_after_opens_at_once_and_is_not_shortened() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = Breaker::new(5, 10 * s, 60 * s);
        assert!(b.on_retry_after(t0, 3 * s));
        assert_eq!(b.state(t0), BreakerState::Open { until: t0 + 3 * s });
        // A shorter hint while open does not shorten it; a longer extends.
        assert!(!b.on_retry_after(t0 + s, s));
        assert_eq!(b.state(t0 + s), BreakerState::Open { until: t0 + 3 * s });
        assert!(!b.on_retry_after(t0 + s, 4 * s));
        assert_eq!(b.state(t0 + s), BreakerState::Open { until: t0 + 5 * s });
        // A passing health check does not end what the upstream asked for.
        assert!(!b.on_health_ok(t0 + 2 * s));
        assert!(!b.ready(t0 + 2 * s));
        assert!(b.ready(t0 + 5 * s));
    }

    #[test]
    fn breaker_state_serializes_for_admin() {
        assert_eq!(
            serde_json::to_value(BreakerState::Closed).unwrap(),
            json!({"state": "closed"})
        );
        assert_eq!(
            serde_json::to_value(BreakerState::HalfOpen).unwrap(),
            json!({"state": "half_open"})
        );
        let open = BreakerState::Open {
            until: Instant::now() + Duration::from_secs(5),
        };
        let v = serde_json::to_value(open).unwrap();
        assert_eq!(v["state"], "open");
        let ms = v["retry_in_ms"].as_u64().unwrap();
        assert!(ms > 4000 && ms <= 5000, "{ms}");
    }

    // -- configuration ---------------------------------------------------------

    #[test]
    fn config_from_toml_with_defaults() {
        let cfg: UpstreamConfig = toml::from_str(
            r#"
            url = "http://10.0.0.5:8000"
            api_key = "sk-secret"
            timeout = "30s"
            connect_timeout = 0.5
            open_for = 15
            health_interval = "1m"
            "#,
        )
        .unwrap();
        assert_eq!(cfg.timeout, Duration::from_secs(30));
        assert_eq!(cfg.connect_timeout, Duration::from_millis(500));
        assert_eq!(cfg.open_for, Duration::from_secs(15));
        assert_eq!(cfg.health_interval, Duration::from_secs(60));
        assert_eq!(cfg.concurrency, 8);
        assert_eq!(cfg.failure_threshold, 5);
        assert_eq!(cfg.health_path, "/health");
        assert!(cfg.served_model.is_none());
        assert!(!format!("{cfg:?}").contains("sk-secret"));

        let err =
            toml::from_str::<UpstreamConfig>("url = \"http://x:1\"\ntimout = \"5s\"").unwrap_err();
        assert!(err.to_string().contains("timout"), "{err}");
        let err = toml::from_str::<UpstreamConfig>("url = \"http://x:1\"\ntimeout = \"5 parsecs\"")
            .unwrap_err();
        assert!(err.to_string().contains("unknown unit"), "{err}");

        // Works as the payload of an internally tagged backend enum.
        #[derive(Debug, serde::Deserialize)]
        #[serde(tag = "kind", rename_all = "snake_case")]
        #[allow(dead_code, clippy::large_enum_variant)]
        enum Backend {
            Http(UpstreamConfig),
            Sim { pool: String },
        }
        let b: Backend =
            toml::from_str("kind = \"http\"\nurl = \"http://x:1\"\ntimeout = \"1s\"").unwrap();
        let Backend::Http(cfg) = b else { panic!() };
        assert_eq!(cfg.timeout, Duration::from_secs(1));

        // And flattened into a larger entry.
        #[derive(Debug, serde::Deserialize)]
        struct Entry {
            model: String,
            #[serde(flatten)]
            upstream: UpstreamConfig,
        }
        let e: Entry =
            toml::from_str("model = \"m\"\nurl = \"http://x:1\"\nopen_for = \"3s\"").unwrap();
        assert_eq!(e.model, "m");
        assert_eq!(e.upstream.open_for, Duration::from_secs(3));
    }

    #[test]
    fn invalid_configurations_are_refused() {
        let try_new = |tweak: &dyn Fn(&mut UpstreamConfig)| {
            let mut cfg = UpstreamConfig::new("http://127.0.0.1:8000");
            tweak(&mut cfg);
            Upstream::new("u".into(), cfg)
        };
        assert!(try_new(&|_| {}).is_ok());
        assert!(try_new(&|c| c.url = "https://10.0.0.1".into()).is_ok());
        // TLS settings on plain http, half an identity, a missing CA file.
        assert!(try_new(&|c| c.ca_file = Some("ca.pem".into())).is_err());
        let e = try_new(&|c| {
            c.url = "https://10.0.0.1".into();
            c.client_cert = Some("c.pem".into());
        })
        .unwrap_err();
        assert!(e.to_string().contains("client_key"), "{e}");
        let e = try_new(&|c| {
            c.url = "https://10.0.0.1".into();
            c.ca_file = Some("/nonexistent/kiln-ca.pem".into());
        })
        .unwrap_err();
        assert!(e.to_string().contains("kiln-ca.pem"), "{e}");
        for bad in [
            "ftp://10.0.0.1",
            "127.0.0.1:8000",
            "not a url",
            "http://10.0.0.1/?a=b",
        ] {
            let e = try_new(&|c| c.url = bad.into()).unwrap_err();
            assert!(matches!(e, UpstreamError::Config { .. }), "{bad}: {e:?}");
        }
        assert!(try_new(&|c| c.concurrency = 0).is_err());
        assert!(try_new(&|c| c.failure_threshold = 0).is_err());
        assert!(try_new(&|c| c.timeout = Duration::ZERO).is_err());
        assert!(try_new(&|c| c.open_for = Duration::from_secs(u64::MAX)).is_err());
        assert!(try_new(&|c| c.health_path = "health".into()).is_err());
        assert!(try_new(&|c| c.api_key = Some("bad\nkey".into())).is_err());
        let up = try_new(&|c| c.url = "http://10.0.0.1:8000/".into()).unwrap();
        assert_eq!(up.endpoint("/v1/models"), "http://10.0.0.1:8000/v1/models");
        assert_eq!(up.name(), "u");
    }

    #[test]
    fn error_statuses() {
        let status = |status| UpstreamError::Status {
            status,
            body: String::new(),
            retry_after: None,
        };
        assert_eq!(status(400).http_status(), 400);
        assert_eq!(status(429).http_status(), 429);
        assert_eq!(status(500).http_status(), 502);
        assert_eq!(status(503).http_status(), 502);
        assert_eq!(status(302).http_status(), 502);
        assert!(status(500).is_upstream_failure());
        assert!(status(429).is_upstream_failure());
        assert!(!status(404).is_upstream_failure());
        let long = UpstreamError::Status {
            status: 500,
            body: "é".repeat(1000),
            retry_after: None,
        };
        assert!(long.to_string().len() < 400);
    }
}
