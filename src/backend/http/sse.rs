//! Server-sent events: the stream of a streaming answer, parsed into
//! JSON chunks with bounded lines and events.

use super::breaker::{record, Breaker, Outcome};
use super::error::{error_chain, snippet};
use super::{UpstreamError, MAX_ERROR_BODY};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http_body_util::BodyExt;
use serde_json::Value;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// The longest SSE line or event (a single chunk of a streaming answer).
pub(super) const MAX_EVENT: usize = 16 << 20;
/// How long the rest of a finished stream may take to drain in the
/// background so that its connection goes back to the pool.
const DRAIN_FOR: Duration = Duration::from_secs(1);

pub(super) type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, hyper::Error>> + Send>>;

/// The stream [`Upstream::stream`] returns.
pub(super) struct SseStream {
    /// `None` once the stream has ended; dropping it closes the connection
    /// unless the body was read to its end.
    body: Option<ByteStream>,
    parser: SseParser,
    eof: bool,
    gap: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
    breaker: Arc<Mutex<Breaker>>,
    name: Arc<str>,
}

impl SseStream {
    /// Reads `resp`'s events, each within `gap` of the last.
    pub(super) fn new(
        resp: super::client::Response,
        gap: Duration,
        breaker: Arc<Mutex<Breaker>>,
        name: Arc<str>,
    ) -> SseStream {
        SseStream {
            body: Some(Box::pin(resp.into_body().into_data_stream())),
            parser: SseParser::default(),
            eof: false,
            gap,
            deadline: Box::pin(tokio::time::sleep(gap)),
            breaker,
            name,
        }
    }

    fn fail(&mut self, error: UpstreamError) -> Poll<Option<Result<Value, UpstreamError>>> {
        if error.is_upstream_failure() {
            record(&self.breaker, &self.name, Outcome::Failure);
        }
        self.body = None;
        Poll::Ready(Some(Err(error)))
    }

    /// `data: [DONE]`: the stream is over. The body's end (the terminating
    /// chunk) normally follows at once; read it so the connection returns
    /// to the pool, in the background if it is not there yet.
    fn done(&mut self, cx: &mut Context<'_>) {
        let Some(mut body) = self.body.take() else {
            return;
        };
        if self.eof {
            return;
        }
        if let Poll::Ready(None) = body.as_mut().poll_next(cx) {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let drain = async {
                    let mut left = MAX_ERROR_BODY;
                    while let Some(Ok(chunk)) = body.next().await {
                        left = match left.checked_sub(chunk.len()) {
                            Some(left) => left,
                            None => break,
                        };
                    }
                };
                let _ = tokio::time::timeout(DRAIN_FOR, drain).await;
            });
        }
    }
}

impl Stream for SseStream {
    type Item = Result<Value, UpstreamError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.body.is_none() {
                return Poll::Ready(None);
            }
            match this.parser.next_event() {
                Ok(Some(SseEvent::Done)) => {
                    this.done(cx);
                    return Poll::Ready(None);
                }
                Ok(Some(SseEvent::Data(text))) => {
                    return match serde_json::from_str(&text) {
                        Ok(value) => Poll::Ready(Some(Ok(value))),
                        Err(e) => {
                            let reason =
                                format!("a stream event is not JSON ({e}): {}", snippet(&text));
                            this.fail(UpstreamError::Protocol {
                                upstream: this.name.to_string(),
                                reason,
                            })
                        }
                    };
                }
                Ok(None) => {}
                Err(reason) => {
                    return this.fail(UpstreamError::Protocol {
                        upstream: this.name.to_string(),
                        reason,
                    })
                }
            }
            if this.eof {
                return this.fail(UpstreamError::Protocol {
                    upstream: this.name.to_string(),
                    reason: "the stream ended before `data: [DONE]`".into(),
                });
            }
            let Some(body) = this.body.as_mut() else {
                return Poll::Ready(None);
            };
            match body.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(bytes))) => {
                    this.parser.push(&bytes);
                    if let Some(next) = tokio::time::Instant::now().checked_add(this.gap) {
                        this.deadline.as_mut().reset(next);
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let error = UpstreamError::Transport {
                        upstream: this.name.to_string(),
                        reason: error_chain(&e),
                    };
                    return this.fail(error);
                }
                Poll::Ready(None) => {
                    this.eof = true;
                    this.parser.finish();
                }
                Poll::Pending => {
                    if this.deadline.as_mut().poll(cx).is_ready() {
                        let error = UpstreamError::Timeout {
                            upstream: this.name.to_string(),
                            waiting_for: "next stream chunk",
                            after: this.gap,
                        };
                        return this.fail(error);
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

/// One dispatched server-sent event.
#[derive(Debug, PartialEq)]
pub(super) enum SseEvent {
    /// The `data` of an event (its `data:` lines joined by `\n`).
    Data(String),
    /// `data: [DONE]`.
    Done,
}

/// An incremental parser of `text/event-stream` (the WHATWG rules): lines
/// end in `\n`, `\r\n` or `\r` and may be split anywhere across network
/// chunks; a blank line dispatches the event; `:` starts a comment; fields
/// other than `data` are ignored.
#[derive(Debug, Default)]
pub(super) struct SseParser {
    buf: Vec<u8>,
    /// Start of the unparsed part of `buf`.
    pos: usize,
    data: String,
    has_data: bool,
    started: bool,
    eof: bool,
}

impl SseParser {
    pub(super) fn push(&mut self, bytes: &[u8]) {
        if self.pos > 0 && self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        } else if self.pos > 4096 && self.pos * 2 > self.buf.len() {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// No more input: a last line without its end, and an event without
    /// its blank line, still count.
    pub(super) fn finish(&mut self) {
        self.eof = true;
    }

    /// The next complete event, if the input so far has one.
    pub(super) fn next_event(&mut self) -> Result<Option<SseEvent>, String> {
        if !self.started {
            if self.buf.len() - self.pos < 3
                && !self.eof
                && b"\xEF\xBB\xBF".starts_with(&self.buf[self.pos..])
            {
                return Ok(None);
            }
            self.started = true;
            if self.buf[self.pos..].starts_with(b"\xEF\xBB\xBF") {
                self.pos += 3;
            }
        }
        loop {
            let rest = &self.buf[self.pos..];
            let line_end = rest.iter().position(|&b| b == b'\n' || b == b'\r');
            let (line_len, term_len) = match line_end {
                Some(i) if rest[i] == b'\r' => match rest.get(i + 1) {
                    Some(b'\n') => (i, 2),
                    Some(_) => (i, 1),
                    // A `\r` at the end: its `\n` may be in the next chunk.
                    None if self.eof => (i, 1),
                    None => return Ok(None),
                },
                Some(i) => (i, 1),
                None if self.eof && !rest.is_empty() => (rest.len(), 0),
                None if self.eof => {
                    // End of input: dispatch a pending event as if a blank
                    // line followed.
                    return Ok(self.dispatch());
                }
                None => {
                    if rest.len() > MAX_EVENT {
                        return Err(format!(
                            "a stream line is longer than {} MiB",
                            MAX_EVENT >> 20
                        ));
                    }
                    return Ok(None);
                }
            };
            let start = self.pos;
            self.pos += line_len + term_len;
            let line = &self.buf[start..start + line_len];
            if line.is_empty() {
                if let Some(event) = self.dispatch() {
                    return Ok(Some(event));
                }
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let (field, value) = match line.iter().position(|&b| b == b':') {
                Some(i) => {
                    let value = &line[i + 1..];
                    (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
                }
                None => (line, &[][..]),
            };
            if field != b"data" {
                continue;
            }
            let value = std::str::from_utf8(value)
                .map_err(|_| "a stream event is not valid UTF-8".to_string())?;
            if self.has_data {
                self.data.push('\n');
            }
            self.data.push_str(value);
            self.has_data = true;
            if self.data.len() > MAX_EVENT {
                return Err(format!(
                    "a stream event is longer than {} MiB",
                    MAX_EVENT >> 20
                ));
            }
        }
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        if !self.has_data {
            return None;
        }
        self.has_data = false;
        let data = std::mem::take(&mut self.data);
        if data.trim() == "[DONE]" {
            Some(SseEvent::Done)
        } else {
            Some(SseEvent::Data(data))
        }
    }
}
