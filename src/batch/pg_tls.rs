//! TLS to the batch store's PostgreSQL: rustls (the same client as
//! `rediss://` Redis and `https://` upstreams, [`crate::tls`]) under
//! `tokio-postgres`'s TLS traits.
//!
//! **When.** `sslmode=require` in the URL: always TLS, the server's
//! certificate checked against `[batch] ca_file` (a private CA) or the
//! platform's roots, and its name against the URL's host (kiln does not
//! offer libpq's unchecked `require`: an encrypted connection to anyone is
//! not worth having). `sslmode=prefer` (the URL's default): TLS where
//! `[batch] ca_file` or a client certificate is set and the server offers
//! it, else plain. `sslmode=disable`: plain.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_postgres::Socket;

/// Makes a TLS connection per server name.
#[derive(Clone)]
pub struct MakeRustls(Arc<rustls::ClientConfig>);

/// The TLS client for `config`'s `sslmode`, given the client `tls` built
/// from `[batch] ca_file`/`client_cert`/`client_key` (`None`: none set).
/// `Err`: why the URL cannot be served.
pub fn for_config(
    config: &tokio_postgres::Config,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> Result<Option<MakeRustls>, String> {
    match config.get_ssl_mode() {
        SslMode::Disable => Ok(None),
        SslMode::Require => match tls {
            Some(t) => Ok(Some(MakeRustls(t))),
            None => crate::tls::ClientTls::default()
                .client_config(&[])
                .map(|c| Some(MakeRustls(Arc::new(c))))
                .map_err(|e| e.to_string()),
        },
        // `prefer`, and any mode added later: TLS only where it was set up.
        _ => Ok(tls.map(MakeRustls)),
    }
}

impl MakeTlsConnect<Socket> for MakeRustls {
    type Stream = RustlsStream;
    type TlsConnect = RustlsConnect;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, Self::Error> {
        let name = rustls::pki_types::ServerName::try_from(domain.to_string())?;
        Ok(RustlsConnect {
            config: self.0.clone(),
            name,
        })
    }
}

/// One connection's handshake.
pub struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
    name: rustls::pki_types::ServerName<'static>,
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = RustlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let s = tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name, stream)
                .await?;
            Ok(RustlsStream(Box::new(s)))
        })
    }
}

/// An established TLS connection to the server.
pub struct RustlsStream(Box<tokio_rustls::client::TlsStream<Socket>>);

impl TlsStream for RustlsStream {
    /// No channel binding: SCRAM authenticates without it (the server's
    /// certificate is checked by rustls instead).
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for RustlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for RustlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}
