//! Accepting client connections, bounded: at most `limits.max_connections`
//! open at once, each given `limits.header_read_timeout` to send a
//! request's headers (idle keep-alive connections included), and hyper's
//! own header buffer sized from the header limits.
//!
//! At the limit a new connection takes the place of the oldest idle one
//! (no request in flight: a slow or silent client, or a keep-alive left
//! open), so idle sockets cannot lock out a health check. With every
//! connection busy, the new one is answered `503` with an OpenAI error body
//! and closed.

use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, Notify, Semaphore};
use tower::ServiceExt;

/// How connections are bounded.
#[derive(Debug, Clone)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub max_headers: usize,
    /// hyper's read buffer: a request head larger than this is refused
    /// before it is parsed.
    pub max_buf_size: usize,
}

impl ConnLimits {
    pub fn from_config(l: &super::config::Limits) -> ConnLimits {
        let max = match open_file_limit() {
            // Leave room for the upstream connections, the log and the
            // runtime's own descriptors.
            Some(n) if n.saturating_sub(64) < l.max_connections as u64 => {
                let clamped = (n.saturating_sub(64) as usize).max(16);
                tracing::warn!(
                    "limits.max_connections = {} is above the open-file limit ({n}); using {clamped}",
                    l.max_connections
                );
                clamped
            }
            _ => l.max_connections,
        };
        ConnLimits {
            max_connections: max.max(1),
            header_read_timeout: l.header_timeout(),
            // Above the gateway's own limits, so that a request slightly
            // over them gets kiln's 431 with an error body; far over,
            // hyper refuses it itself.
            max_headers: (l.max_header_count * 2).max(100),
            max_buf_size: (l.max_header_bytes * 2).max(64 * 1024),
        }
    }
}

/// The soft limit on open files (Linux), if it can be read.
fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// One open connection.
#[derive(Default)]
struct Slot {
    /// Requests whose response has not ended.
    in_flight: AtomicUsize,
    /// Asks the connection to make room (close if idle).
    evict: Notify,
}

/// The open connections, oldest first.
struct Registry {
    max: usize,
    conns: Mutex<BTreeMap<u64, Arc<Slot>>>,
    next: AtomicU64,
}

impl Registry {
    /// A slot for a new connection, closing the oldest idle one at the
    /// limit; `None` when every connection is busy.
    fn admit(&self) -> Option<(u64, Arc<Slot>)> {
        let mut m = self.conns.lock().ok()?;
        if m.len() >= self.max {
            let idle = m
                .iter()
                .find(|(_, s)| s.in_flight.load(Ordering::SeqCst) == 0)
                .map(|(id, _)| *id)?;
            if let Some(s) = m.remove(&idle) {
                s.evict.notify_one();
            }
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::default());
        m.insert(id, slot.clone());
        Some((id, slot))
    }

    fn release(&self, id: u64) {
        if let Ok(mut m) = self.conns.lock() {
            m.remove(&id);
        }
    }

    fn open(&self) -> usize {
        self.conns.lock().map(|m| m.len()).unwrap_or(0)
    }
}

/// Counts a request in flight on its connection until its response body
/// ends or is dropped.
struct InFlight(Arc<Slot>);

impl InFlight {
    fn new(slot: Arc<Slot>) -> InFlight {
        slot.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(slot)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that holds its request's [`InFlight`].
struct Tracked {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Refusals being written at once; beyond this a refused connection is
/// closed without an answer.
const MAX_REFUSING: usize = 256;

/// The answer to a connection over the limit.
const REFUSAL: &str = concat!(
    "HTTP/1.1 503 Service Unavailable\r\n",
    "content-type: application/json\r\n",
    "retry-after: 1\r\n",
    "connection: close\r\n",
    "content-length: 162\r\n",
    "\r\n",
);
const REFUSAL_BODY: &str = r#"{"error":{"message":"too many open connections: every connection is busy; retry shortly","type":"service_unavailable","param":null,"code":"too_many_connections"}}"#;

/// Serves `router` on `listener` until `shutdown` fires, then lets open
/// connections finish their requests.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: oneshot::Receiver<()>,
) {
    let reg = Arc::new(Registry {
        max: limits.max_connections,
        conns: Mutex::new(BTreeMap::new()),
        next: AtomicU64::new(0),
    });
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    // Every connection task holds a sender: all have ended when the
    // receiver sees none left.
    let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors, most likely: wait for some to close.
                    tracing::warn!(error = %e, open = reg.open(), "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        match reg.admit() {
            Some((id, slot)) => {
                let conn = Conn {
                    router: router.clone(),
                    limits: limits.clone(),
                    reg: reg.clone(),
                    id,
                    slot,
                    stop: stop_rx.clone(),
                    _alive: alive_tx.clone(),
                };
                tokio::spawn(conn.run(stream));
            }
            None => {
                if let Ok(permit) = refusing.clone().try_acquire_owned() {
                    tokio::spawn(async move {
                        refuse(stream).await;
                        drop(permit);
                    });
                }
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(alive_tx);
    let _ = alive_rx.recv().await;
}

/// Writes the 503 and closes, within a second whatever the client does.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let mut buf = [0u8; 4096];
        // Read what the client sent first (a close with unread data would
        // reset the connection before it saw the answer).
        let _ = tokio::time::timeout(Duration::from_millis(100), stream.read(&mut buf)).await;
        let _ = stream.write_all(REFUSAL.as_bytes()).await;
        let _ = stream.write_all(REFUSAL_BODY.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

struct Conn {
    router: Router,
    limits: ConnLimits,
    reg: Arc<Registry>,
    id: u64,
    slot: Arc<Slot>,
    stop: watch::Receiver<bool>,
    _alive: mpsc::Sender<()>,
}

impl Conn {
    async fn run(mut self, stream: TcpStream) {
        let router = self.router.clone();
        let slot = self.slot.clone();
        let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let router = router.clone();
            let in_flight = InFlight::new(slot.clone());
            async move {
                let resp = match router.oneshot(req.map(Body::new)).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                Ok::<_, Infallible>(resp.map(|b| {
                    Body::new(Tracked {
                        inner: b,
                        _in_flight: in_flight,
                    })
                }))
            }
        });
        let mut b = hyper::server::conn::http1::Builder::new();
        b.timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_read_timeout)
            .max_headers(self.limits.max_headers)
            .max_buf_size(self.limits.max_buf_size.max(16 * 1024));
        let conn = b.serve_connection(TokioIo::new(stream), svc);
        let mut conn = std::pin::pin!(conn);
        let (mut evicted, mut stopping) = (false, false);
        loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "connection ended");
                    }
                    break;
                }
                _ = self.slot.evict.notified(), if !evicted => {
                    evicted = true;
                    if self.slot.in_flight.load(Ordering::SeqCst) == 0 {
                        break;
                    }
                    // A request began as it was chosen: let it finish.
                    conn.as_mut().graceful_shutdown();
                }
                _ = self.stop.changed(), if !stopping => {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
        self.reg.release(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_one_well_formed_openai_error() {
        assert!(REFUSAL.contains(&format!("content-length: {}\r\n", REFUSAL_BODY.len())));
        let v: serde_json::Value = serde_json::from_str(REFUSAL_BODY).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }

    #[test]
    fn at_the_limit_the_oldest_idle_connection_makes_room() {
        let reg = Registry {
            max: 2,
            conns: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
        };
        let (a, sa) = reg.admit().unwrap();
        let (_b, sb) = reg.admit().unwrap();
        let busy_a = InFlight::new(sa.clone());
        let busy_b = InFlight::new(sb.clone());
        assert!(reg.admit().is_none(), "both busy: refused");
        drop(busy_b);
        let (_c, _) = reg.admit().unwrap();
        assert_eq!(reg.open(), 2);
        // `a` is busy and stays; `b` was asked to close.
        assert!(reg.conns.lock().unwrap().contains_key(&a));
        drop(busy_a);
    }
}
