//! A real `redis-server` for the multi-replica tests: its own process on a
//! free loopback port, no persistence, killed when dropped. Where it is not
//! installed, [`Redis::start`] says so and the test returns (skipped).

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub struct Redis {
    child: Child,
    pub port: u16,
}

impl Redis {
    /// `None` (after saying so) where `redis-server` is not installed.
    pub fn start() -> Option<Redis> {
        Redis::start_on(free_port())
    }

    /// On `port` (a restart on the port a stopped one had).
    pub fn start_on(port: u16) -> Option<Redis> {
        Redis::start_with(port, None)
    }

    /// On `port`, persistent: an append-only file in `dir`, synced at every
    /// write (as `deploy/kubernetes` runs it), so a restart on the same
    /// `dir` comes back with everything written before a `kill -9`.
    pub fn start_persistent(port: u16, dir: &std::path::Path) -> Option<Redis> {
        Redis::start_with(port, Some(dir))
    }

    fn start_with(port: u16, aof: Option<&std::path::Path>) -> Option<Redis> {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", ""]);
        match aof {
            Some(dir) => {
                cmd.arg("--dir")
                    .arg(dir)
                    .args(["--appendonly", "yes", "--appendfsync", "always"]);
            }
            None => {
                cmd.args(["--appendonly", "no"]);
            }
        }
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn();
        let child = match child {
            Ok(c) => c,
            Err(e) => {
                eprintln!("SKIPPED: redis-server is not installed ({e}); `.ci/run` installs it (apt-get install redis-server)");
                return None;
            }
        };
        let r = Redis { child, port };
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if r.ping() {
                return Some(r);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server did not answer PING on port {port} within 10s");
    }

    /// A `redis-server` that speaks only TLS, on a free port: its
    /// certificate `server` (signed by `ca`), client certificates signed
    /// by `ca` required when `auth_clients`. `None` (after saying so)
    /// where `redis-server` is not installed or was built without TLS.
    pub fn start_tls(
        server: &super::tls::Issued,
        ca: &std::path::Path,
        auth_clients: bool,
    ) -> Option<Redis> {
        let port = free_port();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--tls-cert-file")
            .arg(&server.cert)
            .arg("--tls-key-file")
            .arg(&server.key)
            .arg("--tls-ca-cert-file")
            .arg(ca)
            .args([
                "--tls-auth-clients",
                if auth_clients { "yes" } else { "no" },
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("SKIPPED: redis-server is not installed ({e}); `.ci/run` installs it (apt-get install redis-server)");
                return None;
            }
        };
        // Listening on the port is ready enough: nothing to load.
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if let Ok(Some(status)) = child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut err);
                }
                eprintln!("SKIPPED: redis-server with TLS options exited ({status}): {err}; it may be built without TLS");
                return None;
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(Redis { child, port });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server (TLS) did not listen on port {port} within 10s");
    }

    /// `rediss://127.0.0.1:PORT/0`
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}/0", self.port)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn ping(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    pub fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The list at `key` (the shared audit chain, say), as Redis holds it.
    pub async fn list(&self, key: &str) -> Vec<String> {
        let client = redis::Client::open(self.url()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        redis::cmd("LRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .query_async(&mut c)
            .await
            .unwrap()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

static NS: AtomicU64 = AtomicU64::new(0);

/// A key namespace of its own per fleet, so cases never share keys.
pub fn namespace(prefix: &str) -> String {
    format!(
        "{prefix}{}-{}",
        std::process::id(),
        NS.fetch_add(1, Ordering::Relaxed)
    )
}

/// A loopback TCP relay in front of a Redis that can hold back Redis's
/// answers (`set_delay`): a command reaches Redis and runs at once, and
/// its answer arrives that much later, as when a loaded host or network
/// makes a call outlive its timeout after the server did the work. Stops
/// when dropped.
pub struct DelayProxy {
    pub port: u16,
    delay_ms: std::sync::Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl DelayProxy {
    pub async fn start(redis_port: u16) -> DelayProxy {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let delay_ms = std::sync::Arc::new(AtomicU64::new(0));
        let d = delay_ms.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", redis_port)).await
                else {
                    continue;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                conns.spawn(async move {
                    let _ = tokio::io::copy(&mut cr, &mut sw).await;
                });
                // A delay line: each piece of an answer leaves the delay
                // after it arrived (not after the piece before it left).
                let d = d.clone();
                let (tx, mut rx) =
                    tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
                conns.spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let at = tokio::time::Instant::now()
                            + Duration::from_millis(d.load(Ordering::Relaxed));
                        if tx.send((at, buf[..n].to_vec())).is_err() {
                            return;
                        }
                    }
                });
                conns.spawn(async move {
                    while let Some((at, bytes)) = rx.recv().await {
                        tokio::time::sleep_until(at).await;
                        if cw.write_all(&bytes).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        DelayProxy {
            port,
            delay_ms,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Holds every answer read from now on back by `d`.
    pub fn set_delay(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A hash's fields (a quota's buckets, say), as Redis holds them.
pub async fn hash(url: &str, key: &str) -> std::collections::HashMap<String, String> {
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("HGETALL")
        .arg(key)
        .query_async(&mut c)
        .await
        .unwrap()
}

/// Redis's clock, in ms.
pub async fn now_ms(url: &str) -> f64 {
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut c).await.unwrap();
    s as f64 * 1000.0 + us as f64 / 1000.0
}
