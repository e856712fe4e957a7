//! OpenTelemetry spans over OTLP (`[otlp]` in kiln.toml, built with the
//! `otlp` feature): one span per request, written where its end is
//! recorded ([`super::request::recorder`]), in the request's W3C trace.
//! The span id is the one kiln passes upstream as the parent in
//! `traceparent`, so an engine's own spans hang under kiln's; a client's
//! `traceparent` makes kiln's span its child. Attributes follow the
//! OpenTelemetry GenAI semantic conventions (`gen_ai.operation.name`,
//! `gen_ai.request.model`, `gen_ai.usage.input_tokens`, …) plus kiln's
//! decision (`kiln.tier`, `kiln.tenant`, `kiln.route`, `kiln.outcome`,
//! `kiln.reason`). The SDK batches spans and posts them from a thread of
//! its own (kiln's reqwest, blocking), so a slow or absent collector never
//! holds a request; spans it cannot take are dropped and counted by the
//! SDK, never queued without bound.

use serde::Deserialize;
use std::collections::BTreeMap;

/// `[otlp]`: where request spans go.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpSection {
    /// The collector's base URL (`http://otel-collector:4318`); spans are
    /// posted to its `/v1/traces`.
    pub endpoint: String,
    /// `http/protobuf` (the default) or `http/json`.
    #[serde(default = "default_otlp_protocol")]
    pub protocol: String,
    /// Sent with every export (a vendor's API key header).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// The `service.name` resource attribute.
    #[serde(default = "default_service_name")]
    pub service_name: String,
    /// How long one export may take.
    #[serde(
        default = "default_otlp_timeout",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub timeout: std::time::Duration,
    /// How often batched spans are sent.
    #[serde(
        default = "default_otlp_every",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub every: std::time::Duration,
    /// Spans held for export at most; past it new ones are dropped.
    #[serde(default = "default_otlp_queue")]
    pub max_queue: usize,
}

fn default_otlp_protocol() -> String {
    "http/protobuf".into()
}

fn default_service_name() -> String {
    "kiln".into()
}

fn default_otlp_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(10)
}

fn default_otlp_every() -> std::time::Duration {
    std::time::Duration::from_secs(1)
}

fn default_otlp_queue() -> usize {
    4096
}

impl OtlpSection {
    /// What is wrong with it, as a message and a help line (`None`: fine).
    pub fn check(&self) -> Option<(String, String)> {
        if !(self.endpoint.starts_with("http://") || self.endpoint.starts_with("https://")) {
            return Some((
                format!(
                    "`[otlp] endpoint` `{}` is not an http(s) URL",
                    self.endpoint
                ),
                "the collector's OTLP/HTTP base URL, e.g. http://otel-collector:4318".into(),
            ));
        }
        if self.protocol != "http/protobuf" && self.protocol != "http/json" {
            return Some((
                format!(
                    "`[otlp] protocol` `{}` is not one kiln speaks",
                    self.protocol
                ),
                "\"http/protobuf\" (the default) or \"http/json\"; gRPC is not built in".into(),
            ));
        }
        if self.max_queue == 0 || self.max_queue > 1_000_000 {
            return Some((
                "`[otlp] max_queue` is outside 1..1000000".into(),
                "the default, 4096, holds a few seconds of spans at 1,000 requests a second".into(),
            ));
        }
        None
    }
}

/// One request's span, as the recorder knows it at its end.
#[derive(Debug, Clone)]
pub struct RequestSpan {
    pub trace_id: u128,
    /// kiln's span id (the parent its upstream calls name).
    pub span_id: u64,
    /// The client's span, where its `traceparent` named one.
    pub parent_id: Option<u64>,
    /// Whether the client's trace is sampled (its flags; kiln's own are).
    pub sampled: bool,
    pub start_unix_ns: u128,
    pub end_unix_ns: u128,
    /// `chat`, `text_completion`, `embeddings`.
    pub operation: &'static str,
    pub request_model: String,
    pub response_model: Option<String>,
    pub request_id: String,
    pub input_tokens: u64,
    pub output_tokens: Option<u64>,
    pub max_tokens: Option<u64>,
    pub status: Option<u16>,
    pub tier: String,
    pub tenant: String,
    pub route: Option<String>,
    /// `served`, `refused`, `left`, `cache_hit`, or a run's outcome.
    pub outcome: String,
    /// Why it was refused or failed (its reason code).
    pub reason: Option<String>,
    pub ttft_s: Option<f64>,
    pub gpu_seconds: Option<f64>,
    pub policy_version: Option<String>,
}

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum OtelError {
    #[error("`[otlp]` is set but this kiln was built without OpenTelemetry")]
    #[diagnostic(
        code(kiln::serve::otlp_not_built),
        help("build kiln with `--features otlp` (cargo build --release --features otlp), or remove `[otlp]` from kiln.toml")
    )]
    NotBuilt,
    #[error("cannot set up the OTLP exporter for {endpoint}: {message}")]
    #[diagnostic(
        code(kiln::serve::otlp),
        help("`[otlp] endpoint` is the collector's base URL (http://collector:4318; kiln posts to /v1/traces), `protocol` is \"http/protobuf\" or \"http/json\"")
    )]
    Setup { endpoint: String, message: String },
}

#[cfg(feature = "otlp")]
pub use on::Exporter;

#[cfg(not(feature = "otlp"))]
pub use off::Exporter;

#[cfg(not(feature = "otlp"))]
mod off {
    use super::{OtelError, OtlpSection, RequestSpan};

    /// Without the `otlp` feature there is nothing to export to.
    #[derive(Debug)]
    pub enum Exporter {}

    impl Exporter {
        pub fn start(_: &OtlpSection) -> Result<Exporter, OtelError> {
            Err(OtelError::NotBuilt)
        }

        pub fn emit(&self, _: RequestSpan) {
            match *self {}
        }

        pub fn shutdown(&self) {
            match *self {}
        }
    }
}

#[cfg(feature = "otlp")]
mod on {
    use super::{OtelError, OtlpSection, RequestSpan};
    use opentelemetry::trace::{
        Span, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
        TraceState, Tracer, TracerProvider,
    };
    use opentelemetry::{Context, KeyValue};
    use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
    use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    type Reply = std::sync::mpsc::SyncSender<Result<http::Response<bytes::Bytes>, String>>;

    /// Posts the SDK's batches with kiln's own reqwest (blocking: the
    /// batch processor calls it on its own thread, outside any runtime).
    /// The blocking client lives on a thread of its own and is dropped
    /// there when the exporter goes (a blocking client dropped on an async
    /// thread panics).
    #[derive(Debug)]
    struct Client {
        tx: std::sync::Mutex<std::sync::mpsc::Sender<(http::Request<bytes::Bytes>, Reply)>>,
        timeout: Duration,
    }

    impl Client {
        fn start(timeout: Duration) -> Result<Client, String> {
            let (tx, rx) = std::sync::mpsc::channel::<(http::Request<bytes::Bytes>, Reply)>();
            let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Result<(), String>>(1);
            std::thread::Builder::new()
                .name("kiln-otlp".into())
                .spawn(move || {
                    let client = match reqwest::blocking::Client::builder()
                        .timeout(timeout)
                        .build()
                    {
                        Ok(c) => {
                            let _ = ready_tx.send(Ok(()));
                            c
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    for (request, reply) in rx {
                        let _ = reply.send(post(&client, request).map_err(|e| e.to_string()));
                    }
                })
                .map_err(|e| e.to_string())?;
            ready_rx.recv().map_err(|e| e.to_string()).and_then(|r| r)?;
            Ok(Client {
                tx: std::sync::Mutex::new(tx),
                timeout,
            })
        }
    }

    fn post(
        client: &reqwest::blocking::Client,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let mut r = client
            .request(parts.method, parts.uri.to_string())
            .body(body.to_vec());
        for (k, v) in &parts.headers {
            r = r.header(k, v);
        }
        let resp = r.send()?;
        let mut out = http::Response::builder().status(resp.status().as_u16());
        for (k, v) in resp.headers() {
            out = out.header(k.as_str(), v.as_bytes());
        }
        let body = resp.bytes()?;
        Ok(out.body(body)?)
    }

    #[async_trait::async_trait]
    impl opentelemetry_http::HttpClient for Client {
        async fn send_bytes(
            &self,
            request: http::Request<bytes::Bytes>,
        ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
            let (reply, answer) = std::sync::mpsc::sync_channel(1);
            self.tx
                .lock()
                .map_err(|_| "the OTLP sender's lock was poisoned".to_string())?
                .send((request, reply))
                .map_err(|_| "the OTLP sender stopped".to_string())?;
            let got = answer
                .recv_timeout(self.timeout + Duration::from_secs(1))
                .map_err(|e| format!("no answer from the OTLP sender: {e}"))?;
            Ok(got?)
        }
    }

    std::thread_local! {
        /// The ids the next span built on this thread takes: kiln's own
        /// (the trace and span id in the `traceparent` it stamped), not
        /// fresh random ones. Set only around one `build_with_context`.
        static NEXT: std::cell::Cell<Option<(u128, u64)>> = const { std::cell::Cell::new(None) };
    }

    /// Gives the SDK the ids the request already has ([`NEXT`]); random
    /// ones otherwise.
    #[derive(Debug, Default)]
    struct KilnIds(opentelemetry_sdk::trace::RandomIdGenerator);

    impl opentelemetry_sdk::trace::IdGenerator for KilnIds {
        fn new_trace_id(&self) -> TraceId {
            match NEXT.with(|n| n.get()) {
                Some((t, _)) if t != 0 => TraceId::from(t),
                _ => self.0.new_trace_id(),
            }
        }

        fn new_span_id(&self) -> SpanId {
            match NEXT.with(|n| n.get()) {
                Some((_, sp)) if sp != 0 => SpanId::from(sp),
                _ => self.0.new_span_id(),
            }
        }
    }

    pub struct Exporter {
        provider: SdkTracerProvider,
        tracer: opentelemetry_sdk::trace::SdkTracer,
    }

    impl std::fmt::Debug for Exporter {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("otel::Exporter")
        }
    }

    fn time(ns: u128) -> SystemTime {
        UNIX_EPOCH + Duration::from_nanos(ns.min(u128::from(u64::MAX)) as u64)
    }

    impl Exporter {
        pub fn start(c: &OtlpSection) -> Result<Exporter, OtelError> {
            let setup = |message: String| OtelError::Setup {
                endpoint: c.endpoint.clone(),
                message,
            };
            let base = c.endpoint.trim_end_matches('/');
            let url = if base.ends_with("/v1/traces") {
                base.to_string()
            } else {
                format!("{base}/v1/traces")
            };
            let client = Client::start(c.timeout).map_err(setup)?;
            let protocol = if c.protocol == "http/json" {
                Protocol::HttpJson
            } else {
                Protocol::HttpBinary
            };
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(client)
                .with_endpoint(url)
                .with_protocol(protocol)
                .with_timeout(c.timeout)
                .with_headers(c.headers.clone().into_iter().collect())
                .build()
                .map_err(|e| setup(e.to_string()))?;
            let batch = BatchSpanProcessor::builder(exporter)
                .with_batch_config(
                    BatchConfigBuilder::default()
                        .with_max_queue_size(c.max_queue)
                        .with_scheduled_delay(c.every)
                        .build(),
                )
                .build();
            let resource = opentelemetry_sdk::Resource::builder()
                .with_service_name(c.service_name.clone())
                .build();
            let provider = SdkTracerProvider::builder()
                .with_id_generator(KilnIds::default())
                .with_span_processor(batch)
                .with_resource(resource)
                .build();
            let tracer = provider.tracer("kiln");
            Ok(Exporter { provider, tracer })
        }

        /// Hands one request's span to the batch processor (never waits).
        pub fn emit(&self, r: RequestSpan) {
            let flags = if r.sampled {
                TraceFlags::SAMPLED
            } else {
                TraceFlags::default()
            };
            let parent = match r.parent_id {
                Some(p) => Context::new().with_remote_span_context(SpanContext::new(
                    TraceId::from(r.trace_id),
                    SpanId::from(p),
                    flags,
                    true,
                    TraceState::default(),
                )),
                None => Context::new(),
            };
            let mut attrs = vec![
                KeyValue::new("gen_ai.operation.name", r.operation),
                KeyValue::new("gen_ai.provider.name", "kiln"),
                KeyValue::new("gen_ai.request.model", r.request_model.clone()),
                KeyValue::new("gen_ai.response.id", r.request_id.clone()),
                KeyValue::new("gen_ai.usage.input_tokens", r.input_tokens as i64),
                KeyValue::new("kiln.tier", r.tier.clone()),
                KeyValue::new("kiln.tenant", r.tenant.clone()),
                KeyValue::new("kiln.outcome", r.outcome.clone()),
            ];
            let mut push = |k: &'static str, v: Option<opentelemetry::Value>| {
                if let Some(v) = v {
                    attrs.push(KeyValue::new(k, v));
                }
            };
            push(
                "gen_ai.response.model",
                r.response_model.clone().map(Into::into),
            );
            push(
                "gen_ai.usage.output_tokens",
                r.output_tokens.map(|t| (t as i64).into()),
            );
            push(
                "gen_ai.request.max_tokens",
                r.max_tokens.map(|t| (t as i64).into()),
            );
            push(
                "http.response.status_code",
                r.status.map(|s| i64::from(s).into()),
            );
            push("kiln.route", r.route.clone().map(Into::into));
            push("kiln.reason", r.reason.clone().map(Into::into));
            push(
                "error.type",
                r.reason
                    .clone()
                    .filter(|_| r.status.is_some_and(|s| s >= 500))
                    .map(Into::into),
            );
            push(
                "kiln.ttft_s",
                r.ttft_s.filter(|x| x.is_finite()).map(Into::into),
            );
            push(
                "kiln.gpu_seconds",
                r.gpu_seconds.filter(|x| x.is_finite()).map(Into::into),
            );
            push(
                "kiln.policy_version",
                r.policy_version.clone().map(Into::into),
            );
            let builder = self
                .tracer
                .span_builder(format!("{} {}", r.operation, r.request_model))
                .with_kind(SpanKind::Server)
                .with_start_time(time(r.start_unix_ns))
                .with_attributes(attrs);
            // A client's unsampled trace is not recorded (the default
            // sampler follows its parent); kiln's own traces are sampled.
            NEXT.with(|n| n.set(Some((r.trace_id, r.span_id))));
            let mut span = self.tracer.build_with_context(builder, &parent);
            NEXT.with(|n| n.set(None));
            if r.status.is_some_and(|s| s >= 500) {
                span.set_status(Status::error(r.reason.unwrap_or_else(|| "error".into())));
            }
            span.end_with_timestamp(time(r.end_unix_ns));
        }

        /// Sends what is batched (at the gateway's stop).
        pub fn shutdown(&self) {
            if let Err(e) = self.provider.force_flush() {
                tracing::debug!(error = %e, "otlp: spans not flushed at shutdown");
            }
        }
    }
}
