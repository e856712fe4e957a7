//! The HTTP client of an upstream: hyper-util's pooled client over rustls
//! (HTTP/1.1, `TCP_NODELAY`, idle connections closed after
//! [`super::POOL_IDLE`], no proxy, no redirects).
//!
//! It was reqwest's. reqwest wraps the same pooled client in layers kiln
//! does not use (redirects, retries, a timeout, a URL per request): its
//! redirect layer alone parsed the URL again on every call, even with
//! redirects off, about 4% of the gateway's instructions per request. Every
//! bound kiln needs is its own (the call's timeout, the breaker, the body
//! caps), so the layers bought nothing.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::time::Duration;

/// A request to an upstream (its body in one piece).
pub(super) type Request = hyper::Request<Full<Bytes>>;
/// An upstream's answer, its body still to read.
pub(super) type Response = hyper::Response<Incoming>;
/// A failed send: no answer (connect, TLS, a connection closed before the
/// answer). Its causes say which ([`super::Upstream::send_error`]).
pub(super) type SendError = hyper_util::client::legacy::Error;

/// A pooled client; cheap to clone (the pool is shared).
#[derive(Clone)]
pub(super) struct Client {
    inner: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<HttpConnector>,
        Full<Bytes>,
    >,
}

impl Client {
    /// `tls`: the client configuration for an `https://` upstream; `None`
    /// for plain http (its URLs never reach the TLS side).
    pub(super) fn new(
        tls: Option<rustls::ClientConfig>,
        connect_timeout: Duration,
        idle_per_host: usize,
        idle_for: Duration,
    ) -> Result<Client, rustls::Error> {
        let mut http = HttpConnector::new();
        // The scheme is the TLS layer's to check.
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout));
        let config = match tls {
            Some(c) => c,
            None => plain()?,
        };
        // Built from its parts: the builder would refuse (panic on) a
        // configuration that names its ALPN protocol, and kiln's names
        // HTTP/1.1. Plain http passes through; https is TLS.
        let connector = hyper_rustls::HttpsConnector::from((http, config));
        let inner = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            // Without a timer, idle connections are never closed.
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(idle_for)
            .pool_max_idle_per_host(idle_per_host)
            .build(connector);
        Ok(Client { inner })
    }

    /// Sends `request`; resolves when the answer's headers arrive.
    pub(super) async fn send(&self, request: Request) -> Result<Response, SendError> {
        self.inner.request(request).await
    }
}

/// The TLS side of a plain-http upstream's connector: never used (its
/// URLs are `http://`), so it trusts nothing.
fn plain() -> Result<rustls::ClientConfig, rustls::Error> {
    Ok(
        rustls::ClientConfig::builder_with_provider(crate::tls::provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
    )
}
