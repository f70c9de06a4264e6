//! TLS of the API listeners: the server certificate, the optional client CA, and the identity a
//! verified client certificate carries.
//!
//! Guarantees: the gRPC listener offers ALPN `h2` (gRPC clients such as grpc-go, which
//! karmada-scheduler uses, refuse a TLS server without it) and the HTTP listener `http/1.1`;
//! with a client CA, a client certificate is optional (bearer tokens remain possible) but one
//! that is presented must chain to that CA, or the handshake fails; a certificate names its
//! caller as Kubernetes does (CommonName = user, Organizations = groups; a certificate without
//! a CommonName is named by its first URI SAN). Only TLS 1.2 and 1.3 with rustls' ring suites.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

use crate::auth::Identity;

/// Files of the API listeners' TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Server certificate chain (PEM, leaf first).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// CA bundle client certificates must chain to (PEM); `None` asks for no client
    /// certificate.
    pub client_ca: Option<PathBuf>,
}

/// TLS configuration that cannot be used; names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no usable PEM block.
    #[error("{what}: {detail}")]
    Pem {
        /// The file (or input) and what it should hold.
        what: String,
        /// What is wrong.
        detail: String,
    },
    /// rustls refused the certificate, key or CA.
    #[error("{what}: {source}")]
    Rustls {
        /// What was being configured.
        what: String,
        /// rustls' error.
        #[source]
        source: rustls::Error,
    },
}

/// The server side of both API listeners. Cheap to clone.
#[derive(Clone)]
pub struct ApiTls {
    http: Arc<rustls::ServerConfig>,
    grpc: Arc<rustls::ServerConfig>,
    client_auth: bool,
}

impl std::fmt::Debug for ApiTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiTls")
            .field("client_auth", &self.client_auth)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn certs(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Pem {
            what: what.to_owned(),
            detail: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            what: what.to_owned(),
            detail: "no CERTIFICATE block".into(),
        });
    }
    Ok(certs)
}

impl ApiTls {
    /// Loads `files`.
    pub fn load(files: &TlsFiles) -> Result<ApiTls, TlsError> {
        let ca = match &files.client_ca {
            Some(p) => Some((read(p)?, p.display().to_string())),
            None => None,
        };
        Self::from_pem(
            &read(&files.cert)?,
            &files.cert.display().to_string(),
            &read(&files.key)?,
            &files.key.display().to_string(),
            ca.as_ref().map(|(pem, what)| (pem.as_str(), what.as_str())),
        )
    }

    /// Builds from PEM text; the `&str` after each names it in errors.
    pub fn from_pem(
        cert_pem: &str,
        cert_what: &str,
        key_pem: &str,
        key_what: &str,
        client_ca: Option<(&str, &str)>,
    ) -> Result<ApiTls, TlsError> {
        let chain = certs(cert_pem, &format!("server certificate {cert_what}"))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| TlsError::Pem {
            what: format!("server key {key_what}"),
            detail: e.to_string(),
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = match client_ca {
            Some((pem, what)) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in certs(pem, &format!("client CA {what}"))? {
                    roots.add(c).map_err(|source| TlsError::Rustls {
                        what: format!("client CA {what}"),
                        source,
                    })?;
                }
                Some(
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .allow_unauthenticated()
                        .build()
                        .map_err(|e| TlsError::Pem {
                            what: format!("client CA {what}"),
                            detail: e.to_string(),
                        })?,
                )
            }
            None => None,
        };
        let build = |alpn: &[u8]| -> Result<Arc<rustls::ServerConfig>, TlsError> {
            let b = rustls::ServerConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|source| TlsError::Rustls {
                    what: "TLS protocol versions".into(),
                    source,
                })?;
            let b = match &verifier {
                Some(v) => b.with_client_cert_verifier(v.clone()),
                None => b.with_no_client_auth(),
            };
            let mut c = b
                .with_single_cert(chain.clone(), key.clone_key())
                .map_err(|source| TlsError::Rustls {
                    what: format!("server certificate {cert_what} with key {key_what}"),
                    source,
                })?;
            c.alpn_protocols = vec![alpn.to_vec()];
            Ok(Arc::new(c))
        };
        Ok(ApiTls {
            http: build(b"http/1.1")?,
            grpc: build(b"h2")?,
            client_auth: verifier.is_some(),
        })
    }

    /// Whether client certificates are verified (a client CA is configured).
    pub fn client_auth(&self) -> bool {
        self.client_auth
    }

    pub(crate) fn grpc_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.grpc.clone())
    }

    /// The HTTP listener's handshake, for [`dramesh_telemetry::serve_bounded_with`].
    pub fn http_handshake(&self) -> HttpTls {
        HttpTls(tokio_rustls::TlsAcceptor::from(self.http.clone()))
    }
}

/// The identity of a verified client certificate, as requests of its connection carry it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerCert(pub Option<Identity>);

impl PeerCert {
    /// From a finished server handshake.
    pub(crate) fn of(conn: &rustls::ServerConnection) -> PeerCert {
        PeerCert(
            conn.peer_certificates()
                .and_then(|c| c.first())
                .and_then(|leaf| certificate_identity(leaf)),
        )
    }
}

/// The caller a client certificate names: CommonName (else first URI SAN) as the user,
/// Organizations as groups. `None` when it names no one.
pub fn certificate_identity(der: &[u8]) -> Option<Identity> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = cert.subject();
    let cn = subject
        .iter_common_name()
        .find_map(|a| a.as_str().ok())
        .map(str::to_owned)
        .filter(|s| !s.is_empty());
    let user = cn.or_else(|| {
        cert.subject_alternative_name()
            .ok()
            .flatten()
            .and_then(|san| {
                san.value.general_names.iter().find_map(|n| match n {
                    x509_parser::extensions::GeneralName::URI(u) => Some((*u).to_owned()),
                    _ => None,
                })
            })
    })?;
    let groups = subject
        .iter_organization()
        .filter_map(|a| a.as_str().ok())
        .map(str::to_owned)
        .collect();
    Some(Identity::authenticated(user, groups))
}

/// The TLS handshake of the HTTP listener.
#[derive(Clone)]
pub struct HttpTls(tokio_rustls::TlsAcceptor);

impl dramesh_telemetry::Handshake for HttpTls {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Peer = PeerCert;

    async fn handshake(
        &self,
        stream: tokio::net::TcpStream,
    ) -> std::io::Result<(Self::Io, PeerCert)> {
        let s = self.0.accept(stream).await?;
        let peer = PeerCert::of(s.get_ref().1);
        Ok((s, peer))
    }

    fn failure_reason(&self, e: &std::io::Error) -> &'static str {
        handshake_failure_reason(e)
    }

    fn trusted(peer: &PeerCert) -> bool {
        peer.0.is_some()
    }
}

/// The `reason` label of a failed server handshake (`dramesh_tls_handshake_failures_total`):
/// a fixed set, so a hostile client cannot create label values.
pub fn handshake_failure_reason(e: &std::io::Error) -> &'static str {
    use rustls::{CertificateError, Error};
    if let Some(r) = e.get_ref().and_then(|i| i.downcast_ref::<Error>()) {
        return match r {
            Error::InvalidCertificate(c) => match c {
                CertificateError::UnknownIssuer => "unknown_ca",
                CertificateError::BadSignature => "bad_signature",
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    "certificate_expired"
                }
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    "certificate_not_yet_valid"
                }
                CertificateError::Revoked => "certificate_revoked",
                _ => "bad_certificate",
            },
            Error::NoCertificatesPresented => "no_certificate",
            Error::AlertReceived(_) => "alert_from_client",
            Error::PeerIncompatible(_) | Error::NoApplicationProtocol => "incompatible",
            Error::InvalidMessage(_)
            | Error::InappropriateMessage { .. }
            | Error::InappropriateHandshakeMessage { .. } => "not_tls",
            Error::PeerMisbehaved(_) => "misbehaved",
            _ => "tls_error",
        };
    }
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::BrokenPipe => "closed",
        std::io::ErrorKind::InvalidData => "not_tls",
        _ => "io_error",
    }
}
