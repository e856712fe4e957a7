//! Outbound TLS: the client side of `https://` upstreams and `rediss://`
//! Redis, with rustls on ring (no OpenSSL).
//!
//! Whom to trust: the platform's root store (read once, by
//! rustls-native-certs); where the platform has none, Mozilla's roots
//! compiled in (webpki-roots). A `ca_file` replaces both with the CAs it
//! holds (a private PKI: only certificates it issued are accepted). A
//! `client_cert` and `client_key` (PEM, both or neither) are presented to
//! servers that ask for one (mutual TLS).
//!
//! Files are read when the connection's configuration is built, at
//! startup, so a missing or malformed file stops `kiln serve` with a
//! diagnostic instead of failing every request later.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// Client-side TLS settings of one outbound connection (an upstream, the
/// shared-state Redis). All empty: the default roots, no client
/// certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// PEM file of the CA certificates to trust instead of the default
    /// roots.
    pub ca_file: Option<PathBuf>,
    /// PEM file of the client certificate (its chain, leaf first).
    pub client_cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key (PKCS#8, PKCS#1
    /// or SEC1).
    pub client_key: Option<PathBuf>,
}

/// Why a TLS configuration cannot be built.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum TlsError {
    #[error("cannot read {what} `{}`: {source}", path.display())]
    #[diagnostic(
        code(kiln::tls::read),
        help("the path is read at startup, relative to where kiln runs; check that it exists and kiln's user may read it")
    )]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} `{}` holds no usable PEM {expect}: {reason}", path.display())]
    #[diagnostic(
        code(kiln::tls::pem),
        help("give a PEM file (`-----BEGIN CERTIFICATE-----` blocks for certificates, one `-----BEGIN PRIVATE KEY-----` or `RSA`/`EC PRIVATE KEY` block for a key)")
    )]
    Pem {
        what: &'static str,
        path: PathBuf,
        expect: &'static str,
        reason: String,
    },
    #[error("`client_cert` and `client_key` go together: only `{given}` is set")]
    #[diagnostic(
        code(kiln::tls::identity),
        help("set both (the certificate presented to the server and its private key), or neither")
    )]
    HalfIdentity { given: &'static str },
    #[error("the client certificate `{}` and key cannot be used together: {reason}", cert.display())]
    #[diagnostic(
        code(kiln::tls::identity),
        help("`client_key` must be the private key of the first certificate in `client_cert`")
    )]
    Identity { cert: PathBuf, reason: String },
    #[error("cannot build the TLS client: {reason}")]
    #[diagnostic(code(kiln::tls::config))]
    Config { reason: String },
}

impl ClientTls {
    /// Whether any setting is given.
    pub fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.client_cert.is_some() || self.client_key.is_some()
    }

    /// Checks what can be checked without reading files: a certificate
    /// and its key come together.
    pub fn validate(&self) -> Result<(), TlsError> {
        match (&self.client_cert, &self.client_key) {
            (Some(_), None) => Err(TlsError::HalfIdentity {
                given: "client_cert",
            }),
            (None, Some(_)) => Err(TlsError::HalfIdentity {
                given: "client_key",
            }),
            _ => Ok(()),
        }
    }

    /// The contents of the files, checked: the CA file's PEM (at least one
    /// certificate in it) and the client certificate's and key's PEM.
    pub fn read_pem(&self) -> Result<PemFiles, TlsError> {
        self.validate()?;
        let ca = match &self.ca_file {
            Some(path) => {
                let bytes = read("`ca_file`", path)?;
                certificates("`ca_file`", path, &bytes)?;
                Some(bytes)
            }
            None => None,
        };
        let identity = match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                let cert_pem = read("`client_cert`", cert)?;
                certificates("`client_cert`", cert, &cert_pem)?;
                let key_pem = read("`client_key`", key)?;
                private_key(key, &key_pem)?;
                Some((cert_pem, key_pem))
            }
            _ => None,
        };
        Ok(PemFiles { ca, identity })
    }

    /// The rustls client configuration: roots (the CA file's, or the
    /// default ones), the client certificate if one is set, and ALPN
    /// `alpn` (empty: none offered).
    pub fn client_config(&self, alpn: &[&[u8]]) -> Result<rustls::ClientConfig, TlsError> {
        let pem = self.read_pem()?;
        let roots = match (&pem.ca, &self.ca_file) {
            (Some(bytes), Some(path)) => {
                let mut store = RootCertStore::empty();
                for cert in certificates("`ca_file`", path, bytes)? {
                    store.add(cert).map_err(|e| TlsError::Pem {
                        what: "`ca_file`",
                        path: path.clone(),
                        expect: "CA certificate",
                        reason: e.to_string(),
                    })?;
                }
                Arc::new(store)
            }
            _ => default_roots(),
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config {
                reason: e.to_string(),
            })?
            .with_root_certificates(roots);
        let mut config = match (&pem.identity, &self.client_cert, &self.client_key) {
            (Some((cert_pem, key_pem)), Some(cert), Some(key)) => {
                let chain = certificates("`client_cert`", cert, cert_pem)?;
                let key = private_key(key, key_pem)?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| TlsError::Identity {
                        cert: cert.clone(),
                        reason: e.to_string(),
                    })?
            }
            _ => builder.with_no_client_auth(),
        };
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }
}

/// A [`ClientTls`]'s files as read (PEM text), for clients that take PEM
/// (the Redis client).
#[derive(Default)]
pub struct PemFiles {
    pub ca: Option<Vec<u8>>,
    /// Certificate chain and private key.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// rustls's crypto on ring.
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring the process's default rustls provider, for libraries that
/// build their own rustls configuration (the Redis client). Harmless when
/// one is already installed.
pub fn install_default_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// The platform's roots, read once; Mozilla's where the platform has none
/// (a container without `ca-certificates`).
pub fn default_roots() -> Arc<RootCertStore> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            let mut store = RootCertStore::empty();
            let (added, _ignored) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                tracing::info!(
                    errors = found.errors.len(),
                    "no platform CA certificates found; trusting Mozilla's roots (webpki-roots) for TLS"
                );
                store
                    .roots
                    .extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            }
            Arc::new(store)
        })
        .clone()
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn certificates(
    what: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |reason: String| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        expect: "certificate",
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no `-----BEGIN CERTIFICATE-----` block".into()));
    }
    Ok(certs)
}

fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| TlsError::Pem {
        what: "`client_key`",
        path: path.to_path_buf(),
        expect: "private key",
        reason: e.to_string(),
    })
}

/// Whether an error (or one of its causes) is a TLS failure: a
/// certificate the client does not trust, a handshake the server refused
/// (its alert), a client certificate the server wanted. The text of the
/// first such cause, if any.
pub fn tls_cause(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(t) = err.downcast_ref::<rustls::Error>() {
            return Some(explain(t));
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(t) = io
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            {
                return Some(explain(t));
            }
        }
        next = err.source();
    }
    // Some layers keep only the message: recognise rustls's.
    let text = e.to_string();
    let mut source = e.source();
    let mut all = text;
    while let Some(s) = source {
        let part = s.to_string();
        if !all.contains(&part) {
            all.push_str(": ");
            all.push_str(&part);
        }
        source = s.source();
    }
    explain_text(&all)
}

/// The hint for a rustls failure known only by its message.
fn explain_text(text: &str) -> Option<String> {
    const MARKS: [&str; 4] = [
        "invalid peer certificate",
        "received fatal alert",
        "peer sent no certificates",
        "peer is incompatible",
    ];
    let at = MARKS.iter().filter_map(|m| text.find(m)).min()?;
    let cause = &text[at..];
    let hint = if cause.contains("UnknownIssuer") || cause.contains("BadSignature") {
        HINT_ISSUER
    } else if cause.contains("NotValidForName") {
        HINT_NAME
    } else if cause.contains("Expired") {
        HINT_EXPIRED
    } else if cause.starts_with("received fatal alert") {
        HINT_REFUSED
    } else {
        ""
    };
    Some(format!("TLS: {cause}{hint}"))
}

const HINT_ISSUER: &str = " (the server's certificate is not signed by a CA kiln trusts: set `ca_file` to the CA that issued it)";
const HINT_NAME: &str =
    " (the certificate does not name the host in the URL: use a host name the certificate lists)";
const HINT_EXPIRED: &str = " (the server's certificate has expired)";
const HINT_REFUSED: &str = " (the server refused the handshake: it may require a client certificate (`client_cert`, `client_key`) or not trust the one given)";

/// rustls's error with what it usually means.
fn explain(e: &rustls::Error) -> String {
    use rustls::{AlertDescription, CertificateError, Error};
    let hint = match e {
        Error::InvalidCertificate(CertificateError::UnknownIssuer)
        | Error::InvalidCertificate(CertificateError::BadSignature) => HINT_ISSUER,
        Error::InvalidCertificate(CertificateError::NotValidForName)
        | Error::InvalidCertificate(CertificateError::NotValidForNameContext { .. }) => HINT_NAME,
        Error::InvalidCertificate(CertificateError::Expired)
        | Error::InvalidCertificate(CertificateError::ExpiredContext { .. }) => HINT_EXPIRED,
        Error::AlertReceived(AlertDescription::CertificateRequired)
        | Error::AlertReceived(AlertDescription::HandshakeFailure)
        | Error::AlertReceived(AlertDescription::BadCertificate)
        | Error::AlertReceived(AlertDescription::UnknownCA) => HINT_REFUSED,
        _ => "",
    };
    format!("TLS: {e}{hint}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_needs_its_key() {
        let half = ClientTls {
            client_cert: Some("c.pem".into()),
            ..ClientTls::default()
        };
        assert!(matches!(
            half.validate(),
            Err(TlsError::HalfIdentity {
                given: "client_cert"
            })
        ));
        assert!(ClientTls::default().validate().is_ok());
        assert!(!ClientTls::default().is_set());
    }

    #[test]
    fn missing_and_malformed_files_are_named() {
        let dir = std::env::temp_dir().join(format!("kiln-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let missing = ClientTls {
            ca_file: Some(dir.join("absent.pem")),
            ..ClientTls::default()
        };
        let e = missing.client_config(&[]).unwrap_err();
        assert!(e.to_string().contains("absent.pem"), "{e}");
        let bad = ClientTls {
            ca_file: Some(junk.clone()),
            ..ClientTls::default()
        };
        let e = bad.client_config(&[]).unwrap_err();
        assert!(
            matches!(e, TlsError::Pem { .. }) && e.to_string().contains("junk.pem"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_default_configuration_builds() {
        let c = ClientTls::default().client_config(&[b"http/1.1"]).unwrap();
        assert_eq!(c.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }
}
