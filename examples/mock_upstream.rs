//! A fast mock OpenAI-compatible model server: the baseline for measuring
//! the latency the gateway adds, and a stand-in replica for tests.
//!
//! ```text
//! cargo run --release --example mock_upstream -- --listen 127.0.0.1:0 \
//!     [--tokens N] [--delay-ms D] [--token-delay-ms T] [--workers W] [--model NAME]
//! ```
//!
//! Prints `listening on http://ADDR` as its first line on stdout, then
//! serves `POST /v1/chat/completions`, `POST /v1/completions` (JSON, or SSE
//! with `"stream": true`: one chunk per token, a usage chunk when
//! `stream_options.include_usage`, then `data: [DONE]`), `GET /v1/models`
//! and `GET /health`. Every answer is `N` tokens (`"tok "` each, fewer if
//! `max_tokens` asks), after `D` ms and then `T` ms per token. Response
//! bodies are serialized once at start; a request costs a scan of its JSON
//! for three fields. Exits on SIGTERM or Ctrl-C.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use clap::Parser;
use futures_util::StreamExt;
use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(about = "A fast mock OpenAI-compatible model server")]
struct Args {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// Tokens per answer (a request's max_tokens may ask for fewer).
    #[arg(long, default_value_t = 16)]
    tokens: u32,
    /// Delay before the first token, in milliseconds.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// Delay between tokens, in milliseconds.
    #[arg(long, default_value_t = 0)]
    token_delay_ms: u64,
    /// Runtime worker threads; 1 runs everything on the main thread.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// The model name the server reports.
    #[arg(long, default_value = "mock")]
    model: String,
}

/// Which endpoint: the two differ in object names and choice shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

/// Pre-serialized pieces of the answers of one endpoint.
struct Canned {
    kind: Kind,
    /// Non-streaming answer for the default token count, up to the
    /// `prompt_tokens` value.
    full_head: Bytes,
    /// Streaming chunks: first token (with the role, for chat), middle
    /// token, last token (with the finish reason), a lone token (first and
    /// last at once).
    first: Bytes,
    middle: Bytes,
    last: Bytes,
    only: Bytes,
    /// A usage chunk up to the `prompt_tokens` value.
    usage_head: Bytes,
    /// The whole streaming body for the default token count, without the
    /// usage chunk and `[DONE]`.
    all_tokens: Bytes,
}

/// What the server answers with, shared by all requests.
struct Mock {
    tokens: u32,
    delay: Duration,
    token_delay: Duration,
    model: String,
    created: u64,
    chat: Canned,
    text: Canned,
    models: Bytes,
}

const TOKEN: &str = "tok ";
const DONE: &[u8] = b"data: [DONE]\n\n";

impl Mock {
    fn new(args: &Args) -> Mock {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut mock = Mock {
            tokens: args.tokens,
            delay: Duration::from_millis(args.delay_ms),
            token_delay: Duration::from_millis(args.token_delay_ms),
            model: args.model.clone(),
            created,
            chat: Canned::empty(Kind::Chat),
            text: Canned::empty(Kind::Text),
            models: Bytes::new(),
        };
        mock.chat = mock.canned(Kind::Chat);
        mock.text = mock.canned(Kind::Text);
        mock.models = Bytes::from(
            serde_json::json!({
                "object": "list",
                "data": [{
                    "id": args.model, "object": "model", "created": created,
                    "owned_by": "kiln-mock", "max_model_len": 131072
                }]
            })
            .to_string(),
        );
        mock
    }

    fn canned(&self, kind: Kind) -> Canned {
        let chunk = |first: bool, last: bool| -> Bytes {
            let mut out = b"data: ".to_vec();
            out.extend_from_slice(&self.chunk_json(kind, first, last));
            out.extend_from_slice(b"\n\n");
            Bytes::from(out)
        };
        let (first, middle, last, only) = (
            chunk(true, false),
            chunk(false, false),
            chunk(false, true),
            chunk(true, true),
        );
        let mut canned = Canned {
            kind,
            full_head: Bytes::from(self.full_head(kind, self.tokens)),
            first,
            middle,
            last,
            only,
            usage_head: Bytes::from(self.usage_head(kind)),
            all_tokens: Bytes::new(),
        };
        canned.all_tokens = Bytes::from(canned.tokens(self.tokens));
        canned
    }

    /// `{"id":..,"object":..,"created":..,"model":..,` shared by all answers.
    fn preamble(&self, kind: Kind, chunk: bool) -> String {
        let (id, object) = match (kind, chunk) {
            (Kind::Chat, false) => ("chatcmpl-mock", "chat.completion"),
            (Kind::Chat, true) => ("chatcmpl-mock", "chat.completion.chunk"),
            (Kind::Text, _) => ("cmpl-mock", "text_completion"),
        };
        let model = serde_json::Value::String(self.model.clone());
        format!(
            "{{\"id\":\"{id}\",\"object\":\"{object}\",\"created\":{},\"model\":{model},",
            self.created
        )
    }

    /// A non-streaming answer of `n` tokens, cut just before the value of
    /// `prompt_tokens`.
    fn full_head(&self, kind: Kind, n: u32) -> Vec<u8> {
        let text = TOKEN.repeat(usize::try_from(n).unwrap_or(0));
        let text = serde_json::Value::String(text);
        let choice = match kind {
            Kind::Chat => format!(
                "{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":{text}}},\"logprobs\":null,\"finish_reason\":\"length\"}}"
            ),
            Kind::Text => format!(
                "{{\"index\":0,\"text\":{text},\"logprobs\":null,\"finish_reason\":\"length\"}}"
            ),
        };
        format!(
            "{}\"choices\":[{choice}],\"usage\":{{\"prompt_tokens\":",
            self.preamble(kind, false)
        )
        .into_bytes()
    }

    fn chunk_json(&self, kind: Kind, first: bool, last: bool) -> Vec<u8> {
        let finish = if last { "\"length\"" } else { "null" };
        let choice = match (kind, first) {
            (Kind::Chat, true) => format!(
                "{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"{TOKEN}\"}},\"logprobs\":null,\"finish_reason\":{finish}}}"
            ),
            (Kind::Chat, false) => format!(
                "{{\"index\":0,\"delta\":{{\"content\":\"{TOKEN}\"}},\"logprobs\":null,\"finish_reason\":{finish}}}"
            ),
            (Kind::Text, _) => format!(
                "{{\"index\":0,\"text\":\"{TOKEN}\",\"logprobs\":null,\"finish_reason\":{finish}}}"
            ),
        };
        format!("{}\"choices\":[{choice}]}}", self.preamble(kind, true)).into_bytes()
    }

    fn usage_head(&self, kind: Kind) -> Vec<u8> {
        format!(
            "data: {}\"choices\":[],\"usage\":{{\"prompt_tokens\":",
            self.preamble(kind, true)
        )
        .into_bytes()
    }

    fn canned_for(&self, kind: Kind) -> &Canned {
        match kind {
            Kind::Chat => &self.chat,
            Kind::Text => &self.text,
        }
    }
}

impl Canned {
    fn empty(kind: Kind) -> Canned {
        Canned {
            kind,
            full_head: Bytes::new(),
            first: Bytes::new(),
            middle: Bytes::new(),
            last: Bytes::new(),
            only: Bytes::new(),
            usage_head: Bytes::new(),
            all_tokens: Bytes::new(),
        }
    }

    /// The SSE chunk for token `i` of `n`.
    fn token(&self, i: u32, n: u32) -> &Bytes {
        match (i == 0, i + 1 == n) {
            (true, true) => &self.only,
            (true, false) => &self.first,
            (false, true) => &self.last,
            (false, false) => &self.middle,
        }
    }

    /// The SSE chunks of `n` tokens, concatenated.
    fn tokens(&self, n: u32) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.middle.len() * usize::try_from(n).unwrap_or(0));
        for i in 0..n {
            out.extend_from_slice(self.token(i, n));
        }
        out
    }
}

/// `,"completion_tokens":C,"total_tokens":T}` after the prompt token count.
fn usage_tail(out: &mut Vec<u8>, prompt: u64, completion: u32) {
    let _ = write!(
        out,
        "{prompt},\"completion_tokens\":{completion},\"total_tokens\":{}}}",
        prompt + u64::from(completion)
    );
}

/// The few request fields the mock looks at; the rest is skipped.
#[derive(serde::Deserialize)]
struct Request {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
}

#[derive(serde::Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

fn respond(status: StatusCode, content_type: &'static str, body: Body) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

fn bad_request(message: String) -> Response {
    let body = serde_json::json!({
        "error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}
    });
    respond(
        StatusCode::BAD_REQUEST,
        "application/json",
        Body::from(body.to_string()),
    )
}

async fn completion(mock: Arc<Mock>, kind: Kind, body: Bytes) -> Response {
    let request: Request = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("invalid JSON body: {e}")),
    };
    let limit = request.max_completion_tokens.or(request.max_tokens);
    let n = match limit {
        Some(limit) => mock.tokens.min(u32::try_from(limit).unwrap_or(u32::MAX)),
        None => mock.tokens,
    };
    // A rough prompt size: about four bytes a token.
    let prompt = (body.len() as u64 / 4).max(1);
    let canned = mock.canned_for(kind);
    if request.stream.unwrap_or(false) {
        let usage = request
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        stream_answer(&mock, canned, n, prompt, usage)
    } else {
        let generation = mock.token_delay.checked_mul(n).unwrap_or(Duration::MAX);
        let wait = mock.delay.saturating_add(generation);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let mut out;
        if n == mock.tokens {
            out = Vec::with_capacity(canned.full_head.len() + 64);
            out.extend_from_slice(&canned.full_head);
        } else {
            out = mock.full_head(canned.kind, n);
        }
        usage_tail(&mut out, prompt, n);
        out.push(b'}');
        respond(StatusCode::OK, "application/json", Body::from(out))
    }
}

fn stream_answer(mock: &Mock, canned: &Canned, n: u32, prompt: u64, usage: bool) -> Response {
    let mut trailer = Vec::with_capacity(canned.usage_head.len() + 80 + DONE.len());
    if usage {
        trailer.extend_from_slice(&canned.usage_head);
        usage_tail(&mut trailer, prompt, n);
        trailer.extend_from_slice(b"}\n\n");
    }
    trailer.extend_from_slice(DONE);
    let body = if mock.delay.is_zero() && mock.token_delay.is_zero() {
        // Everything at once: one write.
        let mut out;
        if n == mock.tokens {
            out = Vec::with_capacity(canned.all_tokens.len() + trailer.len());
            out.extend_from_slice(&canned.all_tokens);
        } else {
            out = canned.tokens(n);
        }
        out.extend_from_slice(&trailer);
        Body::from(out)
    } else {
        // Headers at once (as vLLM does), then token by token.
        // Chunk 0 waits `delay`, each next token `token_delay`; the usage
        // chunk and `[DONE]` follow the last token at once.
        let chunks: Vec<(Duration, Bytes)> = (0..n)
            .map(|i| canned.token(i, n).clone())
            .chain(std::iter::once(Bytes::from(trailer)))
            .enumerate()
            .map(|(i, chunk)| {
                let wait = match i {
                    0 => mock.delay,
                    i if u32::try_from(i).is_ok_and(|i| i < n) => mock.token_delay,
                    _ => Duration::ZERO,
                };
                (wait, chunk)
            })
            .collect();
        let stream = futures_util::stream::iter(chunks).then(|(wait, chunk)| async move {
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            Ok::<_, std::convert::Infallible>(chunk)
        });
        Body::from_stream(stream)
    };
    let mut resp = respond(StatusCode::OK, "text/event-stream", body);
    resp.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

fn app(mock: Arc<Mock>) -> Router {
    Router::new()
        .route(
            "/v1/chat/completions",
            post(|State(m): State<Arc<Mock>>, body: Bytes| completion(m, Kind::Chat, body)),
        )
        .route(
            "/v1/completions",
            post(|State(m): State<Arc<Mock>>, body: Bytes| completion(m, Kind::Text, body)),
        )
        .route(
            "/v1/models",
            get(|State(m): State<Arc<Mock>>| async move {
                respond(
                    StatusCode::OK,
                    "application/json",
                    Body::from(m.models.clone()),
                )
            }),
        )
        .route("/health", get(|| async { StatusCode::OK }))
        .layer(DefaultBodyLimit::max(64 << 20))
        .with_state(mock)
}

/// Resolves on SIGTERM or Ctrl-C; never, if neither can be listened for.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

async fn run(args: Args) -> ExitCode {
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on {}: {e}", args.listen);
            return ExitCode::from(2);
        }
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: cannot read the listening address: {e}");
            return ExitCode::from(2);
        }
    };
    {
        let mut out = std::io::stdout().lock();
        if writeln!(out, "listening on http://{addr}")
            .and_then(|()| out.flush())
            .is_err()
        {
            return ExitCode::from(2);
        }
    }
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server =
        axum::serve(listener, app(Arc::new(Mock::new(&args)))).with_graceful_shutdown(async move {
            shutdown_signal().await;
            let _ = stop_tx.send(true);
        });
    // In-flight answers get two seconds to finish after the signal.
    let deadline = async move {
        if stop_rx.wait_for(|stop| *stop).await.is_err() {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    tokio::select! {
        result = server => match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        () = deadline => ExitCode::SUCCESS,
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = if args.workers <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.workers)
            .enable_all()
            .build()
    };
    match runtime {
        Ok(runtime) => runtime.block_on(run(args)),
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn mock(tokens: u32) -> Mock {
        Mock::new(&Args::parse_from([
            "mock_upstream",
            "--tokens",
            &tokens.to_string(),
            "--model",
            "m\"x",
        ]))
    }

    async fn body_of(resp: Response) -> String {
        let mut stream = resp.into_body().into_data_stream();
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            out.extend_from_slice(&chunk.unwrap());
        }
        String::from_utf8(out).unwrap()
    }

    fn sse_events(text: &str) -> Vec<String> {
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").unwrap().to_string())
            .collect()
    }

    #[tokio::test]
    async fn answers_are_valid_openai_objects() {
        for (kind, object) in [
            (Kind::Chat, "chat.completion"),
            (Kind::Text, "text_completion"),
        ] {
            for tokens in [0, 1, 3] {
                let m = Arc::new(mock(3));
                let body = format!("{{\"max_tokens\":{tokens},\"messages\":[]}}");
                let text = body_of(completion(m, kind, Bytes::from(body)).await).await;
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["object"], object);
                assert_eq!(v["model"], "m\"x");
                assert_eq!(v["usage"]["completion_tokens"], tokens);
                let content = match kind {
                    Kind::Chat => &v["choices"][0]["message"]["content"],
                    Kind::Text => &v["choices"][0]["text"],
                };
                assert_eq!(content.as_str().unwrap(), TOKEN.repeat(tokens as usize));
            }
        }
    }

    #[tokio::test]
    async fn streams_are_valid_sse() {
        for kind in [Kind::Chat, Kind::Text] {
            for (tokens, usage) in [(3, true), (1, false), (0, true)] {
                let m = Arc::new(mock(3));
                let body = format!(
                    "{{\"stream\":true,\"max_tokens\":{tokens},\"stream_options\":{{\"include_usage\":{usage}}}}}"
                );
                let text = body_of(completion(m, kind, Bytes::from(body)).await).await;
                let events = sse_events(&text);
                assert_eq!(events.last().unwrap(), "[DONE]");
                let chunks: Vec<Value> = events[..events.len() - 1]
                    .iter()
                    .map(|e| serde_json::from_str(e).unwrap())
                    .collect();
                assert_eq!(chunks.len(), tokens + usize::from(usage));
                if usage {
                    let last = chunks.last().unwrap();
                    assert_eq!(last["choices"], serde_json::json!([]));
                    assert_eq!(last["usage"]["completion_tokens"], tokens);
                }
                if tokens > 0 {
                    assert_eq!(chunks[tokens - 1]["choices"][0]["finish_reason"], "length");
                }
            }
        }
    }

    #[tokio::test]
    async fn bad_json_is_a_400() {
        let resp = completion(Arc::new(mock(3)), Kind::Chat, Bytes::from("{")).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    }
}
