//! TLS for the tests: a certificate authority made in the test (rcgen),
//! server and client certificates it signs, written as PEM files to a
//! directory of their own; and an HTTPS server on loopback (tokio-rustls
//! and hyper serving an axum router), optionally requiring a client
//! certificate, stopped when dropped.

use axum::Router;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A CA and the PEM files of what it signed.
pub struct Pki {
    pub dir: PathBuf,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

/// One certificate and its key, as PEM files.
#[derive(Clone)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

static DIRS: AtomicU64 = AtomicU64::new(0);

impl Pki {
    /// A new CA named `name`, its files under a fresh temporary directory.
    pub fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!(
            "kiln-tls-{}-{}-{name}",
            std::process::id(),
            DIRS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("kiln test CA {name}"));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = params.self_signed(&ca_key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca, ca_key }
    }

    /// The CA certificate's PEM file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A server certificate for `localhost` and 127.0.0.1.
    pub fn server(&self) -> Issued {
        self.issue(
            "server",
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate (mutual TLS).
    pub fn client(&self) -> Issued {
        self.issue(
            "client",
            vec!["kiln-gateway".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    fn issue(&self, role: &str, names: Vec<String>, usage: ExtendedKeyUsagePurpose) -> Issued {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("kiln test {role}"));
        params.extended_key_usages = vec![usage];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let out = Issued {
            cert: self.dir.join(format!("{role}.pem")),
            key: self.dir.join(format!("{role}-key.pem")),
        };
        std::fs::write(&out.cert, cert.pem()).unwrap();
        std::fs::write(&out.key, key.serialize_pem()).unwrap();
        out
    }

    /// A rustls server configuration presenting `server`; with
    /// `client_ca`, a client certificate signed by that CA is required.
    pub fn server_config(server: &Issued, client_ca: Option<&Path>) -> rustls::ServerConfig {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&server.cert)
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(&server.key).unwrap();
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_file_iter(ca).unwrap() {
                    roots.add(c.unwrap()).unwrap();
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .unwrap();
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key).unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        config
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An HTTPS server on an ephemeral loopback port, stopped when dropped.
pub struct HttpsServer {
    pub addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl HttpsServer {
    /// `https://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }

    /// `https://localhost:PORT`
    pub fn url_by_name(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }
}

impl Drop for HttpsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `router` over TLS with `config` (HTTP/1.1, keep-alive).
/// Handshakes that fail are dropped (the client sees the alert).
pub async fn serve_https(router: Router, config: rustls::ServerConfig) -> HttpsServer {
    use tower::ServiceExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let router = router.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |req| router.clone().oneshot(req));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    HttpsServer { addr, task }
}
