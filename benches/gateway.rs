//! Gateway overhead: the latency `kiln serve` adds in front of an
//! OpenAI-compatible upstream, its throughput, and the same figures for the
//! LiteLLM proxy against the same upstream.
//!
//! ```text
//! cargo build --release --example mock_upstream && cargo build --release
//! cargo bench --bench gateway
//! ```
//!
//! The bench builds nothing itself: it runs `target/release/kiln` and
//! `target/release/examples/mock_upstream` (or `KILN_BIN` / `MOCK_BIN`) as
//! child processes on 127.0.0.1, port 0, and stops with a message if either
//! is missing. Children are killed when the bench ends, on error or panic
//! too. The load generator is in this process: a single-threaded tokio
//! runtime and one keep-alive reqwest client per target, on loopback only.
//! Every request is the same small non-streaming chat completion
//! (`max_tokens` 16, the mock answers 16 tokens), byte for byte the same to
//! every target; a request counts as failed unless it gets a 200 with a
//! `choices` array, and failures are counted and printed (the bench exits
//! non-zero if any). Latency is from the send to the last byte of the body.
//!
//! Phases:
//! The floor is a bare axum + reqwest passthrough (this binary run again
//! with `--passthrough-serve UPSTREAM`, a process of its own as kiln is):
//! the same mock behind it, the same client and load generator in front.
//! kiln's cost is judged against what the passthrough adds, from the same
//! run; the load average is printed with each phase's figures.
//!
//! 1. Latency, open loop at a fixed rate (default 1,000 req/s per target):
//!    send slots alternate direct to the mock / via the passthrough / via
//!    kiln / direct again (an A/A baseline: its difference from the first
//!    is the noise floor), 20,000 requests each after a 2,000-each
//!    warm-up. The added latency is via-X minus direct at each percentile.
//! 2. Throughput: 64 concurrent closed-loop workers, 50,000 requests,
//!    direct (the ceiling: the mock and the client share the machine), via
//!    the passthrough and via kiln.
//! 3. LiteLLM, when `LITELLM_BIN` names its `litellm` executable or
//!    `/tmp/litellm-venv/bin/litellm` exists (skipped with a note otherwise):
//!    one worker, telemetry and spend logs off, no database, a random
//!    master key for the run (current releases refuse to start without
//!    one), readiness read from `/health/liveliness`.
//!    Latency open loop at a rate it sustains (default 20 req/s per
//!    target), slots alternating direct / kiln / LiteLLM, 500 each; then its
//!    throughput at 64 workers (2,000 requests).
//!
//! 4. Shared state (`[state] redis`), when `redis-server` is installed
//!    (skipped with a note otherwise): one started on a free loopback
//!    port, and four more kiln processes on `gateway-quota.kiln` (the
//!    tenant has a quota far above the load, so every request claims it):
//!    one alone (the quota in memory) and a fleet of three replicas on
//!    that Redis (the quota claimed in Redis, the upstream's slots split
//!    through it, the fleet's size from its registry), which take the
//!    fleet's requests in turn as a round-robin balancer would hand them.
//!    Latency open loop at the phase-1 rate, slots alternating direct /
//!    alone / fleet. The fleet's cost is fleet minus alone (target: p50
//!    ≤ 500 µs, p99 ≤ 3 ms).
//!
//! Knobs (environment): `GATEWAY_BENCH_SCALE` multiplies every request
//! count (0.1 for a quick look), `GATEWAY_BENCH_RATE` the phase-1 rate,
//! `GATEWAY_BENCH_LITELLM_RATE` the phase-3 rate, `GATEWAY_BENCH_LOG=1`
//! turns kiln's decision log on (a temporary file),
//! `GATEWAY_BENCH_PROMPT_BYTES=N` makes the user message about N bytes,
//! `GATEWAY_BENCH_SKIP_LITELLM=1` skips phase 3.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The request every phase sends, to every target: a small chat completion,
/// or with `GATEWAY_BENCH_PROMPT_BYTES=N` one whose user message is about N
/// bytes of English-like text (about N/4 tokens).
fn request_body(prompt_bytes: usize) -> bytes::Bytes {
    const WORDS: [&str; 12] = [
        "the", "kiln", "gateway", "decides", "every", "request", "under", "a", "policy,", "then",
        "forwards", "it.",
    ];
    let mut user = String::from("Write one short sentence about kilns.");
    let mut i = 0usize;
    while user.len() < prompt_bytes {
        user.push(' ');
        user.push_str(WORDS[(i * 5 + i / 12) % WORDS.len()]);
        i += 1;
    }
    let body = serde_json::json!({
        "model": "mock-8b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": user},
        ],
        "max_tokens": 16,
    });
    bytes::Bytes::from(body.to_string())
}
/// The tenant's key in `benches/gateway/gateway.kiln` (the mock and LiteLLM
/// ignore it; it is sent to all three so the requests are identical).
const KEY: &str = "Bearer key-bench";

/// Replicas of the fleet in phase 4, one `redis-server` between them.
const FLEET_REPLICAS: usize = 3;

type Error = String;
type Res<T> = Result<T, Error>;

// ---------------------------------------------------------------------------
// Child processes

/// A child process, killed when dropped. Children stay in the bench's
/// process group, so a Ctrl-C in the terminal stops them too.
struct Proc {
    name: &'static str,
    child: Child,
    /// The last lines of its stdout and stderr, for error messages.
    tail: Arc<Mutex<VecDeque<String>>>,
    /// Lines as they arrive, until the reader threads see EOF.
    lines: mpsc::Receiver<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // LiteLLM may start helper processes: kill the child's own
            // children (by parent id), then the child.
            let _ = Command::new("pkill")
                .args(["-KILL", "-P", &self.child.id().to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Proc {
    fn spawn(name: &'static str, cmd: &mut Command) -> Res<Proc> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {name} ({cmd:?}): {e}"))?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, lines) = mpsc::channel();
        let out = child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>);
        let err = child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>);
        for stream in [out, err].into_iter().flatten() {
            let (tail, tx) = (tail.clone(), tx.clone());
            // Drains the pipe until EOF (when the child dies), so a chatty
            // child never blocks on a full pipe.
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if let Ok(mut t) = tail.lock() {
                        if t.len() == 40 {
                            t.pop_front();
                        }
                        t.push_back(line.clone());
                    }
                    let _ = tx.send(line);
                }
            });
        }
        Ok(Proc {
            name,
            child,
            tail,
            lines,
        })
    }

    fn tail(&self) -> String {
        match self.tail.lock() {
            Ok(t) => t.iter().cloned().collect::<Vec<_>>().join("\n"),
            Err(_) => String::new(),
        }
    }

    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(st)) => Some(format!(
                "{} exited ({st}); its last lines:\n{}",
                self.name,
                self.tail()
            )),
            _ => None,
        }
    }

    /// Waits (at most `limit`) until `GET url` answers 200, while the
    /// process runs: readiness that does not depend on what it logs.
    fn wait_ready(&mut self, addr: SocketAddr, path: &str, limit: Duration) -> Res<()> {
        let deadline = Instant::now() + limit;
        loop {
            // Keep the output drained (and kept for the error message).
            while self.lines.try_recv().is_ok() {}
            if let Some(e) = self.exited() {
                return Err(e);
            }
            if http_ok(addr, path) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} did not answer {path} on {addr} within {limit:?}; its last lines:\n{}",
                    self.name,
                    self.tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits (at most `limit`) for an output line containing `marker`, and
    /// returns the `http://ADDR` it names.
    fn wait_addr(&mut self, marker: &str, limit: Duration) -> Res<String> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "{} did not print {marker:?} within {limit:?}; its last lines:\n{}",
                    self.name,
                    self.tail()
                ));
            }
            match self
                .lines
                .recv_timeout(left.min(Duration::from_millis(200)))
            {
                Ok(line) => {
                    if line.contains(marker) {
                        if let Some(i) = line.find("http://") {
                            let url: String = line[i..]
                                .chars()
                                .take_while(|c| !c.is_whitespace())
                                .collect();
                            return Ok(url);
                        }
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            if let Some(e) = self.exited() {
                return Err(e);
            }
        }
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => {
            let d = PathBuf::from(d);
            if d.is_absolute() {
                d
            } else {
                repo().join(d)
            }
        }
        None => repo().join("target"),
    }
}

/// A prebuilt binary: `var` if set, else `target/release/REL`.
fn binary(var: &str, rel: &str, build: &str) -> Res<PathBuf> {
    let p = match std::env::var_os(var) {
        Some(p) => PathBuf::from(p),
        None => target_dir().join("release").join(rel),
    };
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!(
            "{} not found: build it first with `{build}` (or set {var})",
            p.display()
        ))
    }
}

/// Whether `GET path` on `addr` answers 200 (HTTP/1.0, two-second limits).
fn http_ok(addr: SocketAddr, path: &str) -> bool {
    use std::io::Write;
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    if s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.") && &head[9..12] == b"200"
}

fn free_port() -> Res<u16> {
    let l = TcpListener::bind("127.0.0.1:0")
        .map_err(|e| format!("cannot bind a loopback port: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("cannot read the bound port: {e}"))
}

fn scratch_dir() -> Res<PathBuf> {
    let d = std::env::temp_dir().join(format!("kiln-gateway-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    Ok(d)
}

/// Removes the scratch directory when the bench ends.
struct Scratch(PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `benches/gateway/NAME` with the upstream's address in its placeholder.
fn filled(name: &str, upstream: &str) -> Res<String> {
    let src = repo().join("benches/gateway").join(name);
    let text =
        std::fs::read_to_string(&src).map_err(|e| format!("cannot read {}: {e}", src.display()))?;
    Ok(text.replace("@UPSTREAM@", upstream))
}

fn write(path: PathBuf, text: &str) -> Res<PathBuf> {
    std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

fn template(name: &str, upstream: &str, out: &Path) -> Res<PathBuf> {
    write(out.join(name), &filled(name, upstream)?)
}

/// The gateway config for one `kiln serve` named `label`: the template,
/// a Files and Batches store of its own in the scratch directory (`kiln
/// serve` locks its store, so two gateways on the default one would
/// refuse to start), then `extra`.
fn gateway_config(upstream: &str, out: &Path, label: &str, extra: &str) -> Res<PathBuf> {
    let store = toml::Value::String(out.join(format!("{label}.db")).display().to_string());
    let text = format!(
        "{}\n[batch]\nstore = {store}\n{extra}",
        filled("kiln.toml", upstream)?
    );
    write(out.join(format!("kiln-{label}.toml")), &text)
}

fn start_mock(mock: &Path) -> Res<(Proc, String)> {
    let mut p = Proc::spawn(
        "mock_upstream",
        Command::new(mock).args([
            "--listen",
            "127.0.0.1:0",
            "--tokens",
            "16",
            "--workers",
            "1",
        ]),
    )?;
    let url = p.wait_addr("listening on", Duration::from_secs(20))?;
    Ok((p, url))
}

fn start_kiln(kiln: &Path, config: &Path, log: Option<&Path>) -> Res<(Proc, String)> {
    start_kiln_with(kiln, "gateway.kiln", config, log)
}

fn start_kiln_with(
    kiln: &Path,
    policy: &str,
    config: &Path,
    log: Option<&Path>,
) -> Res<(Proc, String)> {
    let mut cmd = Command::new(kiln);
    cmd.arg("serve")
        .arg("--policy")
        .arg(repo().join("benches/gateway").join(policy))
        .arg("--config")
        .arg(config)
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "warn")
        .current_dir(repo());
    if let Some(l) = log {
        cmd.arg("--log").arg(l);
    }
    let mut p = Proc::spawn("kiln serve", &mut cmd)?;
    let url = p.wait_addr("kiln gateway listening on", Duration::from_secs(30))?;
    Ok((p, url))
}

/// A `redis-server` on a free loopback port, or `None` where it is not
/// installed.
fn start_redis() -> Option<(Proc, u16)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let p = Proc::spawn(
        "redis-server",
        Command::new("redis-server").args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]),
    )
    .ok()?;
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some((p, port));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn litellm_bin() -> Option<PathBuf> {
    if std::env::var_os("GATEWAY_BENCH_SKIP_LITELLM").is_some() {
        return None;
    }
    match std::env::var_os("LITELLM_BIN") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            let p = PathBuf::from("/tmp/litellm-venv/bin/litellm");
            p.is_file().then_some(p)
        }
    }
}

/// A master key for LiteLLM: current releases refuse to start without one
/// (or with a weak one), and with one it authenticates every request, as
/// kiln does.
fn litellm_master_key() -> String {
    let mut bytes = [0u8; 32];
    // The key only guards a loopback proxy for the run's length; a clock
    // mix is enough if the OS generator is unavailable.
    if getrandom::fill(&mut bytes).is_err() {
        let t = Instant::now().elapsed().as_nanos() ^ u128::from(std::process::id());
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (t >> ((i % 16) * 8)) as u8 ^ (i as u8).wrapping_mul(151);
        }
    }
    format!("sk-{}", hex::encode(bytes))
}

fn start_litellm(bin: &Path, config: &Path, dir: &Path, master_key: &str) -> Res<(Proc, String)> {
    let port = free_port()?;
    let mut cmd = Command::new(bin);
    cmd.arg("--config")
        .arg(config)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--num_workers",
            "1",
            "--telemetry",
            "False",
        ])
        .current_dir(dir)
        // No telemetry, no database, no proxies, nothing but loopback.
        .env("LITELLM_TELEMETRY", "False")
        .env("LITELLM_LOG", "ERROR")
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .env("LITELLM_MASTER_KEY", master_key)
        .env("DISABLE_ADMIN_UI", "True")
        .env("NO_DOCS", "True")
        .env("NO_PROXY", "*")
        .env_remove("DATABASE_URL")
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("http_proxy")
        .env_remove("https_proxy");
    let mut p = Proc::spawn("litellm", &mut cmd)?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    // LITELLM_LOG=ERROR hides uvicorn's "running on" line: ask its
    // liveness endpoint instead.
    p.wait_ready(addr, "/health/liveliness", Duration::from_secs(180))?;
    Ok((p, format!("http://{addr}")))
}

// ---------------------------------------------------------------------------
// The floor: a bare axum + reqwest passthrough

/// The argument that makes this binary the passthrough instead of the bench.
const PASSTHROUGH_ARG: &str = "--passthrough-serve";

/// `gateway --passthrough-serve UPSTREAM`: the least a gateway written
/// with kiln's own stack can do. axum on a multi-threaded tokio runtime
/// (default worker count, as `kiln serve`), `POST /v1/chat/completions`
/// read whole and sent on to `UPSTREAM` by one reqwest client built as
/// kiln builds its upstream client (no proxy, `TCP_NODELAY`, a pool of
/// idle connections per host, no redirects), the upstream's status,
/// content type and whole body sent back. No authentication, no parsing,
/// no policy: what is left of kiln's added latency above this is kiln's.
/// Prints `passthrough listening on http://ADDR`; runs until killed.
fn passthrough_main(upstream: &str) -> Res<()> {
    use axum::http::{header::CONTENT_TYPE, HeaderMap, StatusCode};
    use axum::response::{IntoResponse, Response};

    #[derive(Clone)]
    struct Up {
        client: reqwest::Client,
        url: Arc<str>,
    }

    async fn forward(
        axum::extract::State(up): axum::extract::State<Up>,
        headers: HeaderMap,
        body: bytes::Bytes,
    ) -> Response {
        let mut req = up.client.post(&*up.url).body(body);
        if let Some(ct) = headers.get(CONTENT_TYPE) {
            req = req.header(CONTENT_TYPE, ct.clone());
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
        };
        let status = resp.status();
        let ct = resp.headers().get(CONTENT_TYPE).cloned();
        match resp.bytes().await {
            Ok(b) => {
                let mut r = (status, b).into_response();
                if let Some(ct) = ct {
                    r.headers_mut().insert(CONTENT_TYPE, ct);
                }
                r
            }
            Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
        }
    }

    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .pool_max_idle_per_host(257)
        .pool_idle_timeout(Duration::from_secs(90))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let up = Up {
        client,
        url: format!("{}/v1/chat/completions", upstream.trim_end_matches('/')).into(),
    };
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(forward))
        .with_state(up);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("cannot bind: {e}"))?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("cannot read the bound address: {e}"))?;
        {
            use std::io::Write;
            let mut out = std::io::stdout();
            let _ = writeln!(out, "passthrough listening on http://{addr}");
            let _ = out.flush();
        }
        axum::serve(
            axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            }),
            app,
        )
        .await
        .map_err(|e| format!("passthrough: {e}"))
    })
}

/// Starts this binary again as the passthrough in front of `upstream`.
fn start_passthrough(upstream: &str) -> Res<(Proc, String)> {
    let me = std::env::current_exe().map_err(|e| format!("cannot find the bench binary: {e}"))?;
    let mut p = Proc::spawn(
        "passthrough",
        Command::new(me).args([PASSTHROUGH_ARG, upstream]),
    )?;
    let url = p.wait_addr("passthrough listening on", Duration::from_secs(20))?;
    Ok((p, url))
}

// ---------------------------------------------------------------------------
// Load generator

#[derive(Default)]
struct Run {
    /// Per-request latency in nanoseconds, successful requests only.
    lat: Vec<u64>,
    failures: usize,
    /// The first few failures, for the report.
    errors: Vec<String>,
    wall: Duration,
    sent: usize,
}

impl Run {
    fn absorb(&mut self, other: Run) {
        self.lat.extend(other.lat);
        self.failures += other.failures;
        self.sent += other.sent;
        for e in other.errors {
            if self.errors.len() < 5 {
                self.errors.push(e);
            }
        }
        self.wall += other.wall;
    }

    fn record(&mut self, r: Result<Duration, String>) {
        self.sent += 1;
        match r {
            Ok(d) => self
                .lat
                .push(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
            Err(e) => {
                self.failures += 1;
                if self.errors.len() < 5 {
                    self.errors.push(e);
                }
            }
        }
    }

    fn rps(&self) -> f64 {
        self.sent as f64 / self.wall.as_secs_f64()
    }

    /// Nearest-rank percentile in microseconds.
    fn pct(&self, sorted: &[u64], p: f64) -> f64 {
        if sorted.is_empty() {
            return f64::NAN;
        }
        let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
        sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1000.0
    }

    /// Mean in microseconds.
    fn mean(&self) -> f64 {
        if self.lat.is_empty() {
            return f64::NAN;
        }
        self.lat.iter().map(|&x| x as f64).sum::<f64>() / self.lat.len() as f64 / 1000.0
    }

    fn percentiles(&self) -> [f64; 3] {
        let mut s = self.lat.clone();
        s.sort_unstable();
        [self.pct(&s, 50.0), self.pct(&s, 90.0), self.pct(&s, 99.0)]
    }
}

struct Target {
    name: &'static str,
    /// Where its requests go, in turn (several for a fleet of replicas
    /// behind a round-robin balancer).
    urls: Vec<String>,
    next: std::sync::atomic::AtomicUsize,
    client: reqwest::Client,
    body: bytes::Bytes,
    /// The `authorization` header it is sent.
    auth: String,
}

impl Target {
    fn new(name: &'static str, base: &str, body: &bytes::Bytes) -> Res<Target> {
        Target::spread(name, &[base.to_string()], body)
    }

    /// One target over several gateways, each request to the next.
    fn spread(name: &'static str, bases: &[String], body: &bytes::Bytes) -> Res<Target> {
        let client = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(1024)
            .pool_idle_timeout(Duration::from_secs(600))
            .timeout(Duration::from_secs(30))
            .http1_only()
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Target {
            name,
            urls: bases
                .iter()
                .map(|b| format!("{b}/v1/chat/completions"))
                .collect(),
            next: std::sync::atomic::AtomicUsize::new(0),
            client,
            body: body.clone(),
            auth: KEY.to_string(),
        })
    }

    /// The same target, authenticating with `key` instead.
    fn with_key(mut self, key: &str) -> Target {
        self.auth = format!("Bearer {key}");
        self
    }
}

/// One request; `Ok(latency)` on a 200 whose body has choices.
async fn one(t: &Target) -> Result<Duration, String> {
    let i = t.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % t.urls.len().max(1);
    let url = t
        .urls
        .get(i)
        .ok_or_else(|| format!("{}: no address", t.name))?;
    let start = Instant::now();
    let resp = t
        .client
        .post(url)
        .header("authorization", &t.auth)
        .header("content-type", "application/json")
        .body(t.body.clone())
        .send()
        .await
        .map_err(|e| format!("{}: send: {e}", t.name))?;
    let status = resp.status();
    let body = resp
        .bytes()
        .await
        .map_err(|e| format!("{}: body: {e}", t.name))?;
    let took = start.elapsed();
    if status != reqwest::StatusCode::OK || !body.windows(10).any(|w| w == b"\"choices\":") {
        let snippet = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        return Err(format!("{}: HTTP {status}: {snippet}", t.name));
    }
    Ok(took)
}

/// `n` requests from `workers` concurrent workers, back to back (closed
/// loop): the throughput phases.
async fn load(t: Arc<Target>, n: usize, workers: usize) -> Run {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..workers {
        let (t, next) = (t.clone(), next.clone());
        set.spawn(async move {
            let mut run = Run::default();
            while next.fetch_add(1, Ordering::Relaxed) < n {
                run.record(one(&t).await);
            }
            run
        });
    }
    let mut total = Run::default();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(r) => total.absorb(r),
            Err(e) => total.record(Err(format!("{}: worker panicked: {e}", t.name))),
        }
    }
    total.wall = start.elapsed();
    total
}

/// Open loop at a fixed rate: `n_each` requests to each target, sent at
/// `rate_each` per second per target, slot by slot in turn (slot `j` goes
/// to target `j % targets.len()`), so whatever else runs on the machine
/// hits every target alike. A pacer thread (`std::thread::sleep`, finer
/// than tokio's millisecond timer) hands out the slots; each request runs
/// in its own task, so a slow answer does not delay the next send.
async fn paced(targets: &[Arc<Target>], n_each: usize, rate_each: f64) -> Vec<Run> {
    let k = targets.len();
    let total = n_each * k;
    let slot_rate = rate_each * k as f64;
    let (tx, mut slots) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let pacer = std::thread::spawn(move || {
        let t0 = Instant::now() + Duration::from_millis(5);
        for j in 0..total {
            let at = t0 + Duration::from_secs_f64(j as f64 / slot_rate);
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            if tx.send(j).is_err() {
                break;
            }
        }
    });
    let start = Instant::now();
    let mut runs: Vec<Run> = targets.iter().map(|_| Run::default()).collect();
    let mut set = tokio::task::JoinSet::new();
    let reap = |r: Result<(usize, Result<Duration, String>), tokio::task::JoinError>,
                runs: &mut [Run]| match r {
        Ok((i, res)) => runs[i].record(res),
        Err(e) => runs[0].record(Err(format!("request task panicked: {e}"))),
    };
    while let Some(j) = slots.recv().await {
        let i = j % k;
        let t = targets[i].clone();
        set.spawn(async move { (i, one(&t).await) });
        while let Some(r) = set.try_join_next() {
            reap(r, &mut runs);
        }
    }
    while let Some(r) = set.join_next().await {
        reap(r, &mut runs);
    }
    let _ = pacer.join();
    let wall = start.elapsed();
    for r in &mut runs {
        r.wall = wall;
    }
    runs
}

// ---------------------------------------------------------------------------
// Report

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v > 0.0)
        .unwrap_or(default)
}

fn scaled(n: usize, scale: f64) -> usize {
    ((n as f64 * scale).round() as usize).max(1)
}

struct Report {
    rows: Vec<String>,
    failures: usize,
    errors: Vec<String>,
}

impl Report {
    fn check(&mut self, what: &str, run: &Run) {
        self.failures += run.failures;
        for e in &run.errors {
            if self.errors.len() < 10 {
                self.errors.push(format!("{what}: {e}"));
            }
        }
        println!(
            "  {what}: {} requests, {} failed, {:.0} req/s, p50/p90/p99 {}, mean {:.3} ms",
            run.sent,
            run.failures,
            run.rps(),
            fmt3(run.percentiles()),
            run.mean() / 1000.0
        );
    }
}

fn fmt3(p: [f64; 3]) -> String {
    format!(
        "{:.3} / {:.3} / {:.3} ms",
        p[0] / 1000.0,
        p[1] / 1000.0,
        p[2] / 1000.0
    )
}

fn us(x: f64) -> String {
    if x.abs() >= 1000.0 {
        format!("{:.2} ms", x / 1000.0)
    } else {
        format!("{x:.0} µs")
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == PASSTHROUGH_ARG) {
        let Some(upstream) = args.get(i + 1) else {
            eprintln!("{PASSTHROUGH_ARG} needs the upstream's base URL");
            std::process::exit(2);
        };
        if let Err(e) = passthrough_main(upstream) {
            eprintln!("passthrough: {e}");
            std::process::exit(1);
        }
        return;
    }
    // `cargo test --benches` runs bench binaries without `--bench`: nothing
    // to check there that the run itself would not.
    if !std::env::args().any(|a| a == "--bench") {
        println!("gateway: run with `cargo bench --bench gateway`");
        return;
    }
    match bench() {
        Ok(0) => {}
        Ok(failures) => {
            eprintln!("gateway bench: {failures} requests failed");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("gateway bench: {e}");
            std::process::exit(1);
        }
    }
}

fn bench() -> Res<usize> {
    let kiln = binary("KILN_BIN", "kiln", "cargo build --release")?;
    let mock = binary(
        "MOCK_BIN",
        "examples/mock_upstream",
        "cargo build --release --example mock_upstream",
    )?;
    let scale = env_f64("GATEWAY_BENCH_SCALE", 1.0);
    let rate = env_f64("GATEWAY_BENCH_RATE", 1000.0);
    let ll_rate = env_f64("GATEWAY_BENCH_LITELLM_RATE", 20.0);
    let with_log = std::env::var_os("GATEWAY_BENCH_LOG").is_some_and(|v| v != "0");
    let prompt_bytes = std::env::var("GATEWAY_BENCH_PROMPT_BYTES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    let body = request_body(prompt_bytes);
    let scratch = Scratch(scratch_dir()?);

    let (_mock_proc, mock_url) = start_mock(&mock)?;
    let config = gateway_config(&mock_url, &scratch.0, "main", "")?;
    let log = with_log.then(|| scratch.0.join("decisions.jsonl"));
    let (mut kiln_proc, kiln_url) = start_kiln(&kiln, &config, log.as_deref())?;
    let (mut bare_proc, bare_url) = start_passthrough(&mock_url)?;
    println!(
        "mock upstream: {mock_url} (1 worker, 16 tokens); kiln: {kiln_url} (decision log {}); \
         bare axum + reqwest passthrough: {bare_url}; request body {} bytes; load: {}",
        if with_log { "on" } else { "off" },
        body.len(),
        load_average()
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the client runtime: {e}"))?;
    let direct = Arc::new(Target::new("direct", &mock_url, &body)?);
    let via = Arc::new(Target::new("kiln", &kiln_url, &body)?);
    let bare = Arc::new(Target::new("passthrough", &bare_url, &body)?);
    // The same mock through a second client: an A/A baseline whose
    // difference from `direct` is the noise floor of the added latency.
    let again = Arc::new(Target::new("direct (A/A)", &mock_url, &body)?);
    let mut report = Report {
        rows: Vec::new(),
        failures: 0,
        errors: Vec::new(),
    };

    // 1. Latency at a fixed rate.
    let n = scaled(20_000, scale);
    println!("\n1. latency, open loop at {rate:.0} req/s per target, slots alternating direct / passthrough / kiln / direct again, {n} each");
    let four = [direct.clone(), bare.clone(), via.clone(), again.clone()];
    let warm = rt.block_on(paced(&four, scaled(2_000, scale), rate));
    report.check("warm-up direct", &warm[0]);
    report.check("warm-up passthrough", &warm[1]);
    report.check("warm-up kiln", &warm[2]);
    let lat = rt.block_on(paced(&four, n, rate));
    report.check("direct", &lat[0]);
    report.check("via passthrough", &lat[1]);
    report.check("via kiln", &lat[2]);
    report.check("direct again", &lat[3]);
    if let Some(e) = kiln_proc.exited().or_else(|| bare_proc.exited()) {
        return Err(e);
    }
    let load_lat = load_average();
    println!("   load after phase 1: {load_lat}");
    let (pd, pb, pk, pa) = (
        lat[0].percentiles(),
        lat[1].percentiles(),
        lat[2].percentiles(),
        lat[3].percentiles(),
    );
    let added = diff(pk, pd);
    let added_bare = diff(pb, pd);
    let noise = diff(pa, pd);
    let added_mean = lat[2].mean() - lat[0].mean();
    let added_bare_mean = lat[1].mean() - lat[0].mean();

    // 2. Throughput, closed loop.
    let conc = 64;
    let n_tp = scaled(50_000, scale);
    println!("\n2. throughput: {conc} workers, {n_tp} requests each");
    report.check(
        "warm-up kiln",
        &rt.block_on(load(via.clone(), scaled(5_000, scale), conc)),
    );
    report.check(
        "warm-up passthrough",
        &rt.block_on(load(bare.clone(), scaled(5_000, scale), conc)),
    );
    let tp_direct = rt.block_on(load(direct.clone(), n_tp, conc));
    report.check("direct", &tp_direct);
    let tp_bare = rt.block_on(load(bare.clone(), n_tp, conc));
    report.check("via passthrough", &tp_bare);
    let tp_kiln = rt.block_on(load(via.clone(), n_tp, conc));
    report.check("via kiln", &tp_kiln);
    if let Some(e) = kiln_proc.exited().or_else(|| bare_proc.exited()) {
        return Err(e);
    }
    let load_tp = load_average();
    println!("   load after phase 2: {load_tp}");

    let load1 = format!("{rate:.0} req/s");
    report.rows.push(row(
        "direct to mock",
        &load1,
        pd,
        None,
        Some(tp_direct.rps()),
    ));
    report.rows.push(row(
        "direct again (A/A: noise)",
        &load1,
        pa,
        Some(noise),
        None,
    ));
    report.rows.push(row(
        "bare axum + reqwest passthrough (floor)",
        &load1,
        pb,
        Some(added_bare),
        Some(tp_bare.rps()),
    ));
    report.rows.push(row(
        "**via kiln**",
        &load1,
        pk,
        Some(added),
        Some(tp_kiln.rps()),
    ));
    let mut verdict = vec![format!(
        "kiln added at {rate:.0} req/s: p50 {} (target ≤ 200 µs: {}), p99 {} (target ≤ 1 ms: {}), mean {}; \
         A/A noise p50 {}, p99 {}; throughput {:.0} req/s at {conc} workers (target ≥ 5,000: {}), {:.0}% of direct",
        us(added[0]),
        met(added[0] <= 200.0),
        us(added[2]),
        met(added[2] <= 1000.0),
        us(added_mean),
        us(noise[0]),
        us(noise[2]),
        tp_kiln.rps(),
        met(tp_kiln.rps() >= 5000.0),
        100.0 * tp_kiln.rps() / tp_direct.rps()
    )];
    // Against the floor, from the same run: kiln's added latency over the
    // passthrough's (≤ 1.25×), its throughput over direct's (≥ 35%) and
    // over 10.2k req/s, issue 27's starting point (≥ 1.5×).
    let over = |k: f64, b: f64| {
        if b > 0.0 {
            format!("{:.2}×", k / b)
        } else {
            "— (the passthrough's added ≤ 0: within noise)".into()
        }
    };
    let floor_ok = |k: f64, b: f64| b > 0.0 && k <= 1.25 * b;
    verdict.push(format!(
        "against the floor at {rate:.0} req/s (load {load_lat}): kiln added / passthrough added: p50 {} / {} = {} ({}), \
         p99 {} / {} = {} ({}), mean {} / {} = {}; target ≤ 1.25×",
        us(added[0]),
        us(added_bare[0]),
        over(added[0], added_bare[0]),
        met(floor_ok(added[0], added_bare[0])),
        us(added[2]),
        us(added_bare[2]),
        over(added[2], added_bare[2]),
        met(floor_ok(added[2], added_bare[2])),
        us(added_mean),
        us(added_bare_mean),
        over(added_mean, added_bare_mean),
    ));
    verdict.push(format!(
        "throughput at {conc} workers (load {load_tp}): kiln {:.0}, passthrough {:.0}, direct {:.0} req/s; \
         kiln / direct {:.1}% (target ≥ 35%: {}), kiln / passthrough {:.1}%, kiln / 10.2k {:.2}× (target ≥ 1.5×: {})",
        tp_kiln.rps(),
        tp_bare.rps(),
        tp_direct.rps(),
        100.0 * tp_kiln.rps() / tp_direct.rps(),
        met(tp_kiln.rps() >= 0.35 * tp_direct.rps()),
        100.0 * tp_kiln.rps() / tp_bare.rps(),
        tp_kiln.rps() / 10_200.0,
        met(tp_kiln.rps() >= 1.5 * 10_200.0),
    ));

    // 3. LiteLLM.
    match litellm_bin() {
        None => {
            let note = "LiteLLM: skipped (set LITELLM_BIN to its `litellm` executable, or install it into /tmp/litellm-venv)";
            println!("\n3. {note}");
            verdict.push(note.to_string());
        }
        Some(bin) => {
            let ll_config = template("litellm.yaml", &mock_url, &scratch.0)?;
            println!("\n3. LiteLLM ({}): starting", bin.display());
            let master_key = litellm_master_key();
            let (mut ll_proc, ll_url) = start_litellm(&bin, &ll_config, &scratch.0, &master_key)?;
            let ll = Arc::new(Target::new("litellm", &ll_url, &body)?.with_key(&master_key));
            let n_low = scaled(500, scale);
            println!(
                "   {ll_url}; latency, open loop at {ll_rate:.0} req/s per target, slots alternating direct / kiln / LiteLLM, {n_low} each"
            );
            report.check(
                "warm-up litellm",
                &rt.block_on(load(ll.clone(), scaled(200, scale), 4)),
            );
            let three = [direct.clone(), via.clone(), ll.clone()];
            let low = rt.block_on(paced(&three, n_low, ll_rate));
            report.check("direct", &low[0]);
            report.check("via kiln", &low[1]);
            report.check("via litellm", &low[2]);
            let tp_ll = rt.block_on(load(ll.clone(), scaled(2_000, scale), conc));
            report.check("throughput via litellm (64 workers)", &tp_ll);
            if let Some(e) = ll_proc.exited() {
                return Err(e);
            }
            let (d, k, l) = (
                low[0].percentiles(),
                low[1].percentiles(),
                low[2].percentiles(),
            );
            let (ka, la) = (diff(k, d), diff(l, d));
            let load3 = format!("{ll_rate:.0} req/s");
            report
                .rows
                .push(row("direct to mock", &load3, d, None, None));
            report.rows.push(row("via kiln", &load3, k, Some(ka), None));
            report.rows.push(row(
                "**via LiteLLM**",
                &load3,
                l,
                Some(la),
                Some(tp_ll.rps()),
            ));
            // kiln's added latency can be at or below zero within noise:
            // the ratio is then unbounded, and said so.
            let ratio = |a: f64, b: f64| {
                if b > 0.0 {
                    format!("{:.0}×", a / b)
                } else {
                    "∞ (kiln's added ≤ 0: within noise)".into()
                }
            };
            let ok = |a: f64, b: f64| a > 0.0 && (b <= 0.0 || a / b >= 50.0);
            let (km, lm) = (low[1].mean() - low[0].mean(), low[2].mean() - low[0].mean());
            verdict.push(format!(
                "added latency at {ll_rate:.0} req/s, LiteLLM / kiln: p50 {} / {} = {}, p99 {} / {} = {}, \
                 mean {} / {} = {} (target ≥ 50×: {})",
                us(la[0]),
                us(ka[0]),
                ratio(la[0], ka[0]),
                us(la[2]),
                us(ka[2]),
                ratio(la[2], ka[2]),
                us(lm),
                us(km),
                ratio(lm, km),
                met(ok(la[0], ka[0]) && ok(lm, km)),
            ));
            verdict.push(format!(
                "LiteLLM's added p50 at {ll_rate:.0} req/s over kiln's at {rate:.0} req/s: {} / {} = {}; \
                 throughput kiln / LiteLLM at {conc} workers: {:.0} / {:.0} = {}",
                us(la[0]),
                us(added[0]),
                ratio(la[0], added[0]),
                tp_kiln.rps(),
                tp_ll.rps(),
                ratio(tp_kiln.rps(), tp_ll.rps()),
            ));
        }
    }
    if let Some(e) = kiln_proc.exited() {
        return Err(e);
    }

    // 4. The shared-state path.
    match start_redis() {
        None => {
            let note = "shared state: skipped (redis-server is not installed)";
            println!("\n4. {note}");
            verdict.push(note.to_string());
        }
        Some((_redis, port)) => {
            // The fleet's replicas each get their own store (as PostgreSQL
            // would be shared, SQLite is per replica); the fleet's size is
            // what the registry counts, so no `replicas` is set.
            let state = format!(
                "\n[state]\nredis = \"redis://127.0.0.1:{port}/0\"\non_unavailable = \"local\"\n"
            );
            let alone_cfg = gateway_config(&mock_url, &scratch.0, "alone", "")?;
            let (mut alone_proc, alone_url) =
                start_kiln_with(&kiln, "gateway-quota.kiln", &alone_cfg, None)?;
            let mut fleet_procs = Vec::new();
            let mut fleet_urls = Vec::new();
            for r in 0..FLEET_REPLICAS {
                let cfg = gateway_config(&mock_url, &scratch.0, &format!("replica{r}"), &state)?;
                let (p, u) = start_kiln_with(&kiln, "gateway-quota.kiln", &cfg, None)?;
                fleet_procs.push(p);
                fleet_urls.push(u);
            }
            let alone = Arc::new(Target::new("kiln alone", &alone_url, &body)?);
            let shared = Arc::new(Target::spread("kiln fleet", &fleet_urls, &body)?);
            println!(
                "\n4. shared state: redis-server on port {port}, {FLEET_REPLICAS} replicas ({}) taking requests in turn; latency, open loop at {rate:.0} req/s per target, slots alternating direct / alone / fleet, {n} each",
                fleet_urls.join(", ")
            );
            let three = [direct.clone(), alone.clone(), shared.clone()];
            let warm = rt.block_on(paced(&three, scaled(2_000, scale), rate));
            report.check("warm-up alone", &warm[1]);
            report.check("warm-up fleet", &warm[2]);
            let lat = rt.block_on(paced(&three, n, rate));
            report.check("direct", &lat[0]);
            report.check("kiln alone (quota)", &lat[1]);
            report.check("kiln fleet (quota in Redis)", &lat[2]);
            if let Some(e) = alone_proc
                .exited()
                .or_else(|| fleet_procs.iter_mut().find_map(|p| p.exited()))
            {
                return Err(e);
            }
            let (d, a, s) = (
                lat[0].percentiles(),
                lat[1].percentiles(),
                lat[2].percentiles(),
            );
            let load4 = format!("{rate:.0} req/s");
            report
                .rows
                .push(row("direct to mock", &load4, d, None, None));
            report.rows.push(row(
                "kiln alone, tenant quota",
                &load4,
                a,
                Some(diff(a, d)),
                None,
            ));
            report.rows.push(row(
                &format!("**kiln, fleet of {FLEET_REPLICAS} replicas (quota in Redis)**"),
                &load4,
                s,
                Some(diff(s, d)),
                None,
            ));
            let over = diff(s, a);
            verdict.push(format!(
                "a fleet of {FLEET_REPLICAS} replicas on one Redis over the single-process gateway at {rate:.0} req/s: p50 {} (target ≤ 500 µs: {}), p90 {}, p99 {} (target ≤ 3 ms: {}), mean {}",
                us(over[0]),
                met(over[0] <= 500.0),
                us(over[1]),
                us(over[2]),
                met(over[2] <= 3000.0),
                us(lat[2].mean() - lat[1].mean()),
            ));
        }
    }

    println!("\n| target | rate per target | p50 | p90 | p99 | added p50 / p90 / p99 | throughput, {conc} workers |");
    println!("|---|---|---|---|---|---|---|");
    for r in &report.rows {
        println!("{r}");
    }
    println!();
    for v in &verdict {
        println!("{v}");
    }
    println!("failed requests: {}", report.failures);
    for e in &report.errors {
        println!("  {e}");
    }
    Ok(report.failures)
}

/// The 1-, 5- and 15-minute load averages (`/proc/loadavg`), for the
/// record: on a shared machine a figure means little without them.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

fn diff(a: [f64; 3], b: [f64; 3]) -> [f64; 3] {
    [a[0] - b[0], a[1] - b[1], a[2] - b[2]]
}

fn row(name: &str, load: &str, p: [f64; 3], added: Option<[f64; 3]>, rps: Option<f64>) -> String {
    let added = match added {
        Some(a) => format!("{} / {} / {}", us(a[0]), us(a[1]), us(a[2])),
        None => "—".into(),
    };
    let rps = rps.map(|r| format!("{r:.0} req/s")).unwrap_or_default();
    format!(
        "| {name} | {load} | {} | {} | {} | {added} | {rps} |",
        us(p[0]),
        us(p[1]),
        us(p[2])
    )
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}
