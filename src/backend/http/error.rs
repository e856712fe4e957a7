//! Everything that can go wrong calling an upstream.

use crate::units::duration;
use std::time::Duration;

/// Everything that can go wrong calling an upstream.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum UpstreamError {
    /// The configuration cannot work (bad URL, zero concurrency, ...).
    #[error("upstream `{upstream}`: {reason}")]
    #[diagnostic(
        code(kiln::upstream::config),
        help("fix this backend's entry in the server configuration")
    )]
    Config { upstream: String, reason: String },

    /// The request was not sent: the circuit breaker is open, or the
    /// replica refused or did not accept the connection.
    #[error("upstream `{upstream}` is unavailable: {reason}")]
    #[diagnostic(
        code(kiln::upstream::unavailable),
        help("the replica is down or failing; the request never reached it and may go to another replica")
    )]
    Unavailable {
        upstream: String,
        reason: String,
        /// When the breaker lets the next request through, if it is open.
        retry_after: Option<Duration>,
    },

    /// No answer (or no next chunk) in time.
    #[error("upstream `{upstream}` timed out: no {waiting_for} within {}", duration::format(*.after))]
    #[diagnostic(
        code(kiln::upstream::timeout),
        help("the replica is overloaded or stuck; raise `timeout` for long generations")
    )]
    Timeout {
        upstream: String,
        waiting_for: &'static str,
        after: Duration,
    },

    /// The upstream answered with an HTTP error status; `body` is the start
    /// of its answer (an OpenAI error object, usually), `retry_after` its
    /// `Retry-After` header in seconds, where it sent one.
    #[error("upstream answered HTTP {status}: {}", snippet(.body))]
    #[diagnostic(
        code(kiln::upstream::status),
        help("429: the replica is overloaded, retry after the time it gives; other 4xx: the request was refused as it is; 5xx: the replica failed")
    )]
    Status {
        status: u16,
        body: String,
        retry_after: Option<Duration>,
    },

    /// The upstream's answer is not what the OpenAI protocol says (bad
    /// JSON, a stream cut before `data: [DONE]`).
    #[error("upstream `{upstream}` broke the protocol: {reason}")]
    #[diagnostic(
        code(kiln::upstream::protocol),
        help("check that `url` points at an OpenAI-compatible server and the endpoint supports this request")
    )]
    Protocol { upstream: String, reason: String },

    /// The replica closed the connection as the request went out, before
    /// any answer: a kept-alive connection it was closing at that moment
    /// (cpp-httplib's and uvicorn's keep-alive timeouts and request limits
    /// do this), or it crashed. It counts against the breaker (a sporadic
    /// close among answers opens nothing; a dying replica's run of them
    /// does) and is sent again on a new connection.
    #[error("upstream `{upstream}` closed the connection before answering: {reason}")]
    #[diagnostic(
        code(kiln::upstream::closed),
        help("kiln sends such a request again on a new connection; if it recurs, the replica is restarting or closes kept-alive connections early (raise its keep-alive timeout above 4 s)")
    )]
    Closed { upstream: String, reason: String },

    /// The connection failed after the request was sent (reset, closed
    /// mid-answer).
    #[error("upstream `{upstream}`: connection failed: {reason}")]
    #[diagnostic(
        code(kiln::upstream::transport),
        help("the replica closed or reset the connection; it may have crashed or restarted")
    )]
    Transport { upstream: String, reason: String },

    /// The TLS handshake with an `https://` upstream failed: a
    /// certificate kiln does not trust, a host name the certificate does
    /// not list, a client certificate the server wanted or refused.
    #[error("upstream `{upstream}` ({url}): {reason}")]
    #[diagnostic(
        code(kiln::upstream::tls),
        help("an https upstream's certificate must chain to a CA kiln trusts (the platform's, or the upstream's `ca_file`) and name the URL's host; a replica that requires client certificates needs `client_cert` and `client_key`")
    )]
    Tls {
        upstream: String,
        url: String,
        reason: String,
    },

    /// The request body cannot be forwarded (not a JSON object).
    #[error("cannot forward the request: {reason}")]
    #[diagnostic(
        code(kiln::upstream::bad_request),
        help("the request body must be a JSON object")
    )]
    BadRequest { reason: String },
}

impl UpstreamError {
    /// The HTTP status to answer the gateway's client with: timeout 504,
    /// unavailable 503, upstream 4xx as is, upstream 5xx and protocol or
    /// connection failures 502, a body that cannot be forwarded 400.
    pub fn http_status(&self) -> u16 {
        match self {
            UpstreamError::Timeout { .. } => 504,
            UpstreamError::Unavailable { .. } => 503,
            UpstreamError::Status { status, .. } if (400..500).contains(status) => *status,
            UpstreamError::Status { .. } => 502,
            UpstreamError::Protocol { .. }
            | UpstreamError::Closed { .. }
            | UpstreamError::Transport { .. }
            | UpstreamError::Tls { .. } => 502,
            UpstreamError::BadRequest { .. } => 400,
            UpstreamError::Config { .. } => 500,
        }
    }

    /// True when the request certainly never reached the upstream (circuit
    /// open, connection refused, TLS handshake refused), so it may be retried on another replica.
    pub fn is_unsent(&self) -> bool {
        matches!(
            self,
            UpstreamError::Unavailable { .. }
                | UpstreamError::BadRequest { .. }
                | UpstreamError::Tls { .. }
        )
    }

    /// Whether the request may be sent again on the same replica: it
    /// certainly never reached it ([`Self::is_unsent`]), or the replica
    /// closed the connection before any answer (a kept-alive connection
    /// closing as it went out; nothing of an answer was produced for it).
    pub fn may_resend(&self) -> bool {
        self.is_unsent() || matches!(self, UpstreamError::Closed { .. })
    }

    /// Whether this error counts against the upstream's circuit breaker:
    /// connect errors, timeouts, broken connections, protocol errors (bad
    /// JSON, a JSON answer to a streaming request, a stream cut before its
    /// end), a connection closed before any answer, 429 and 5xx do; other
    /// 4xx (the client's fault) do not.
    pub fn is_upstream_failure(&self) -> bool {
        match self {
            UpstreamError::Unavailable { .. }
            | UpstreamError::Timeout { .. }
            | UpstreamError::Transport { .. }
            | UpstreamError::Closed { .. }
            | UpstreamError::Tls { .. }
            | UpstreamError::Protocol { .. } => true,
            UpstreamError::Status { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }

    /// How long the upstream (its `Retry-After`) or its open breaker asks
    /// to wait before trying again, where known.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            UpstreamError::Status { retry_after, .. }
            | UpstreamError::Unavailable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// A `Retry-After` header's delay: whole or decimal seconds (an HTTP date
/// is not read; few model servers send one). `None` when absent, zero or
/// not a number.
pub(super) fn parse_retry_after(value: Option<&str>) -> Option<Duration> {
    let secs: f64 = value?.trim().parse().ok()?;
    (secs.is_finite() && secs > 0.0).then(|| Duration::from_secs_f64(secs.min(1e9)))
}

/// The start of a long error body, for messages.
pub(super) fn snippet(body: &str) -> &str {
    const MAX: usize = 300;
    if body.len() <= MAX {
        return body;
    }
    let mut end = MAX;
    while !body.is_char_boundary(end) {
        end -= 1;
    }
    &body[..end]
}

/// An error and its causes on one line (the client's own message says
/// little, e.g. "client error (Connect)"; the cause is in the source chain).
pub(super) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}
