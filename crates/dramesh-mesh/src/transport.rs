//! QUIC transport configuration: quinn 0.11 endpoints with rustls 0.23 (ring) mutual TLS.
//!
//! Both directions require a certificate chaining to the project CA (TLS 1.3 only, ALPN
//! [`ALPN`]); a peer with a certificate from another CA fails the handshake. After the
//! handshake the peer's identity is read from its certificate URI SAN ([`peer_identity`]);
//! connections without a valid identity must be closed by the caller. The server name used
//! by clients is the fixed [`MESH_SERVER_NAME`], so addresses can change freely.
//!
//! Idle timeout and keep-alive are explicit (defaults 5 s and 1 s), so a silent partition is
//! detected within about the idle timeout.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use rustls::pki_types::CertificateDer;

pub use crate::certs::MESH_SERVER_NAME;
use crate::certs::TlsIdentity;
use crate::identity::{IdentityError, PeerIdentity};

/// ALPN protocol id of the mesh.
pub const ALPN: &[u8] = b"dramesh-mesh/1";

/// Transport timers and limits.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// Connection closes after this long without hearing from the peer.
    pub idle_timeout: Duration,
    /// Keep-alive period; must be below the idle timeout.
    pub keep_alive: Duration,
    /// Limit on handshake plus stream setup when dialing. A dial that heard nothing back in
    /// this time is followed by the next one at once: the timeout already spaced the
    /// attempts, and an unreachable peer costs only a few Initial packets per attempt.
    pub connect_timeout: Duration,
    /// RTT assumed before the first sample. It paces the retransmission of a dial's first
    /// packet (about 3 × this, doubling): with QUIC's 333 ms default a dial sends it at 0 and
    /// 1 s and then nothing until its 3 s timeout, so after a partition heals a peer could wait
    /// 2 s for the next packet; at 100 ms it goes out at 0, 0.3, 0.9 and 2.1 s.
    pub initial_rtt: Duration,
    /// First reconnect delay after a refused dial or a lost connection; doubles per failure up
    /// to `backoff_max`, with jitter (×0.5–1.5).
    pub backoff_min: Duration,
    /// Longest reconnect delay after a refused dial or a lost connection.
    pub backoff_max: Duration,
    /// Bytes of encoded frames that may wait for one peer; beyond it frames are dropped
    /// (and the protocol told) instead of buffered.
    pub outbound_budget_bytes: usize,
    /// Bytes of encoded frames that may wait for all peers together. The per-peer budget
    /// alone would let a node with many slow peers (a replica serving a hundred agents)
    /// buffer a hundred times it; beyond this total, frames are dropped the same way.
    pub outbound_total_bytes: usize,
    /// Frames received from all peers that may wait for the protocol thread.
    pub inbound_queue_frames: usize,
    /// Most sessions a node holds at once; a new peer beyond it is closed at once (a relay
    /// serves its cluster's nodes, up to 5,000 in Kubernetes; a replica its relays and the
    /// node agents that fell back to it).
    pub max_sessions: usize,
    /// Most incoming handshakes in progress at once; further connection attempts are refused
    /// before any cryptography, and their peers retry with backoff.
    pub max_handshakes: usize,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(5),
            keep_alive: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(3),
            initial_rtt: Duration::from_millis(100),
            backoff_min: Duration::from_millis(200),
            backoff_max: Duration::from_secs(2),
            outbound_budget_bytes: 32 * 1024 * 1024,
            outbound_total_bytes: 256 * 1024 * 1024,
            inbound_queue_frames: 1024,
            max_sessions: 10_000,
            max_handshakes: 256,
        }
    }
}

/// Why an endpoint could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// rustls refused the certificates or keys.
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    /// The client certificate verifier could not be built.
    #[error("client certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// quinn refused the TLS configuration (its message).
    #[error("QUIC crypto configuration: {0}")]
    QuicCrypto(String),
    /// A transport setting is out of range.
    #[error("transport configuration {field}: {detail}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// The UDP socket could not be bound.
    #[error("cannot bind UDP endpoint on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    // An explicit provider avoids depending on (or racing for) the process default.
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(ca: &[CertificateDer<'static>]) -> Result<Arc<rustls::RootCertStore>, TransportError> {
    let mut store = rustls::RootCertStore::empty();
    for c in ca {
        store.add(c.clone())?;
    }
    Ok(Arc::new(store))
}

fn transport(cfg: &TransportConfig) -> Result<Arc<quinn::TransportConfig>, TransportError> {
    if cfg.keep_alive >= cfg.idle_timeout {
        return Err(TransportError::Config {
            field: "keep_alive",
            detail: format!(
                "{:?} must be below idle_timeout {:?}",
                cfg.keep_alive, cfg.idle_timeout
            ),
        });
    }
    let mut t = quinn::TransportConfig::default();
    let idle =
        quinn::IdleTimeout::try_from(cfg.idle_timeout).map_err(|e| TransportError::Config {
            field: "idle_timeout",
            detail: e.to_string(),
        })?;
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some(cfg.keep_alive));
    t.initial_rtt(cfg.initial_rtt);
    // One long-lived control stream per connection; a few spare for future use.
    t.max_concurrent_bidi_streams(4u32.into());
    t.max_concurrent_uni_streams(0u32.into());
    Ok(Arc::new(t))
}

/// Server side: requires and verifies client certificates against the CA.
pub fn server_config(
    id: &TlsIdentity,
    cfg: &TransportConfig,
) -> Result<quinn::ServerConfig, TransportError> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots(&id.ca_certs)?,
        provider(),
    )
    .build()?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(id.cert_chain.clone(), id.key.clone_key())?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| TransportError::QuicCrypto(e.to_string()))?;
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    sc.transport_config(transport(cfg)?);
    Ok(sc)
}

/// Client side: presents our certificate and verifies the server against the CA.
pub fn client_config(
    id: &TlsIdentity,
    cfg: &TransportConfig,
) -> Result<quinn::ClientConfig, TransportError> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(&id.ca_certs)?)
        .with_client_auth_cert(id.cert_chain.clone(), id.key.clone_key())?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .map_err(|e| TransportError::QuicCrypto(e.to_string()))?;
    let mut cc = quinn::ClientConfig::new(Arc::new(crypto));
    cc.transport_config(transport(cfg)?);
    Ok(cc)
}

/// One UDP endpoint that both accepts and dials (must run inside a tokio runtime).
pub fn make_endpoint(
    listen: SocketAddr,
    id: &TlsIdentity,
    cfg: &TransportConfig,
) -> Result<quinn::Endpoint, TransportError> {
    make_watched_endpoint(listen, id, cfg).map(|(endpoint, _)| endpoint)
}

/// Tells when an endpoint's UDP socket is closed.
///
/// quinn keeps the socket open while any connection it carried is still draining (about
/// three probe timeouts after close, longer on a loaded machine), even after every
/// `Endpoint` handle is gone. A node that restarts on the same port must wait for that.
pub struct SocketWatch(Weak<dyn quinn::AsyncUdpSocket>);

impl SocketWatch {
    /// True once nothing holds the socket any more.
    pub fn is_released(&self) -> bool {
        self.0.strong_count() == 0
    }
}

/// [`make_endpoint`], plus a watch on its socket.
pub fn make_watched_endpoint(
    listen: SocketAddr,
    id: &TlsIdentity,
    cfg: &TransportConfig,
) -> Result<(quinn::Endpoint, SocketWatch), TransportError> {
    let bind_error = |source| TransportError::Bind {
        addr: listen,
        source,
    };
    let runtime = quinn::default_runtime()
        .ok_or_else(|| bind_error(std::io::Error::other("no async runtime found")))?;
    let socket = std::net::UdpSocket::bind(listen).map_err(bind_error)?;
    let socket = runtime.wrap_udp_socket(socket).map_err(bind_error)?;
    let watch = SocketWatch(Arc::downgrade(&socket));
    let mut endpoint = quinn::Endpoint::new_with_abstract_socket(
        quinn::EndpointConfig::default(),
        Some(server_config(id, cfg)?),
        socket,
        runtime,
    )
    .map_err(bind_error)?;
    endpoint.set_default_client_config(client_config(id, cfg)?);
    Ok((endpoint, watch))
}

/// The verified identity of the peer of an established connection.
pub fn peer_identity(conn: &quinn::Connection) -> Result<PeerIdentity, IdentityError> {
    let any = conn.peer_identity().ok_or(IdentityError::Missing)?;
    let chain = any
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| IdentityError::Certificate("unexpected peer identity type".into()))?;
    let leaf = chain.first().ok_or(IdentityError::Missing)?;
    PeerIdentity::from_certificate_der(leaf)
}
