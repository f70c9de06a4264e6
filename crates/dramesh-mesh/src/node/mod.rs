//! The async mesh node the daemons run: quinn endpoint, dialing, connection tasks, and a
//! dedicated protocol thread.
//!
//! Layout:
//! - One UDP endpoint both accepts and dials. Every connection carries one bidirectional
//!   stream (opened by the dialer) of length-prefixed frames; one stream keeps each
//!   document's automerge exchange in order.
//! - The [`Protocol`] and the store run on a dedicated OS thread, so automerge work (which can
//!   take long for big documents) never blocks the tokio reactor. Connection readers hand
//!   frames to it through a bounded queue: when the thread falls behind, readers stop reading
//!   and QUIC flow control pushes back on the senders.
//! - Group commit: the thread handles every queued event (up to a cap) as one batch, then
//!   generates the batch's coalesced pushes once per (connection, document), fsyncs what the
//!   batch received ([`DocStore::flush`]), and only then sends the batch's frames (deferred
//!   store upkeep, [`DocStore::maintain`], runs after they are sent). A busy node
//!   thus pays one fsync per touched document and one sync message per peer and document per
//!   batch, instead of one each per received message, and still acknowledges nothing before
//!   it is durable.
//! - Each connection has an outbound byte budget, and all connections together a node-wide
//!   one ([`TransportConfig::outbound_total_bytes`]), so a replica with many slow agents
//!   cannot buffer many times the per-peer budget. The protocol thread never waits on a slow
//!   peer: a frame that does not fit is dropped and the protocol is told
//!   ([`Protocol::on_dropped`]); anti-entropy repairs the gap later.
//! - Dialing: seeds always, plus replicas learned via peer exchange (agents dial every known
//!   replica; replicas dial learned replicas whose identity URI sorts after their own, the
//!   other side dials the rest). Refused dials and lost connections are redialed with
//!   exponential backoff and jitter; a dial that heard nothing back within the connect timeout
//!   is followed by the next at once. When two connections to the same identity exist, both
//!   ends keep the one dialed by the smaller identity URI (or the newer one if both were dialed
//!   by the same side).
//!
//! Files: `endpoint` (accepting), `conn` (connection tasks and budgets), `dial` (what is dialed
//! and the dial loops), `driver` (the protocol thread); this file holds the handle, the
//! configuration and the state they share.

mod commit;
mod conn;
mod dial;
mod driver;
mod endpoint;
mod verify;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, broadcast, mpsc, oneshot};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::certs::TlsIdentity;
use crate::identity::PeerIdentity;
#[cfg(feature = "test-util")]
use crate::protocol::ConnId;
use crate::protocol::{Counters, Protocol, ProtocolConfig};
use crate::store::DocStore;
use crate::sync::lock;
use crate::transport::{self, TransportConfig, TransportError};
use crate::wire;
use dramesh_store::DocId;

#[cfg(feature = "test-util")]
pub use conn::LocalLink;
#[cfg(feature = "test-util")]
use conn::{Link, LocalClose, outbound_for, run_local};
use dial::dial_manager;
use driver::{Event, drive};
use endpoint::accept_loop;
pub use verify::{SharedVerifier, VerifyPool, default_verify_threads};

/// Everything needed to start a node.
#[derive(Clone)]
pub struct NodeConfig {
    /// This node's certificate, key and trust anchors.
    pub identity: TlsIdentity,
    /// UDP address to bind (port 0 picks one).
    pub listen: SocketAddr,
    /// Address other nodes should dial to reach this one (replicas); defaults to the bound
    /// address.
    pub advertise: Option<SocketAddr>,
    /// Replica addresses to dial at start.
    pub seeds: Vec<SocketAddr>,
    /// Replication protocol settings.
    pub protocol: ProtocolConfig,
    /// QUIC and buffering settings.
    pub transport: TransportConfig,
    /// Least time between two runs of the protocol's timers. The protocol thread sleeps until
    /// [`Protocol::poll_timeout`] or the next event, but timers falling due within this of the
    /// last run wait for the next one, so a node with many sessions runs them in batches
    /// rather than once per session.
    pub tick_interval: Duration,
    /// How long an agent with a relay target ([`MeshHandle::set_relay_target`]) goes without
    /// a session with it before it dials the replicas directly too (see the module docs).
    pub relay_fallback: Duration,
    /// Threads that check the writers' signatures on received sync messages ahead of the
    /// store (see [`VerifyPool`]); 0 leaves every check to the protocol thread. Default: the
    /// cores the process may use ([`default_verify_threads`]). Started with their first check.
    pub verify_threads: usize,
}

impl NodeConfig {
    /// Defaults for `identity` listening on `listen`, with no seeds.
    pub fn new(identity: TlsIdentity, listen: SocketAddr) -> Self {
        Self {
            identity,
            listen,
            advertise: None,
            seeds: vec![],
            protocol: ProtocolConfig::default(),
            transport: TransportConfig::default(),
            tick_interval: Duration::from_millis(100),
            relay_fallback: Duration::from_secs(10),
            verify_threads: default_verify_threads(),
        }
    }
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The endpoint could not be configured or bound.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The bound address could not be read.
    #[error("cannot read the bound address of the endpoint: {0}")]
    LocalAddr(std::io::Error),
    /// The protocol thread could not be spawned.
    #[error("cannot start the protocol thread: {0}")]
    Thread(std::io::Error),
    /// The certificate's key cannot sign, or the CA cannot verify, signed heads.
    #[error(transparent)]
    Signing(#[from] crate::signing::SigningError),
    /// A rotated credential names another identity than the running node's.
    #[error("rotated certificate is for {to}, but this node is {from}")]
    IdentityChanged {
        /// The node's identity.
        from: PeerIdentity,
        /// The identity the new certificate names.
        to: PeerIdentity,
    },
}

/// A remote change the node applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedChange {
    /// The changed document.
    pub doc: DocId,
    /// Its generation after the change.
    pub generation: u64,
    /// The peer the change came from.
    pub from: PeerIdentity,
}

/// Status of one live connection.
#[derive(Debug, Clone)]
pub struct PeerStatus {
    /// The peer's certificate identity.
    pub identity: PeerIdentity,
    /// The peer's address.
    pub remote_addr: SocketAddr,
    /// Whether this node dialed the connection.
    pub dialed: bool,
    /// Whether the peer's hello arrived.
    pub hello_received: bool,
    /// When the peer was last heard from.
    pub last_heard: Instant,
    /// Frame bytes written to the mesh stream.
    pub bytes_sent: u64,
    /// Frame bytes read from the mesh stream.
    pub bytes_received: u64,
    /// QUIC's round-trip time estimate.
    pub rtt: Duration,
    /// Documents the peer's last heartbeat reported that differ from ours.
    pub docs_behind: usize,
    /// Whether the peer's anti-entropy digest has equalled ours at least once on this
    /// session (see [`crate::protocol::SessionStatus::digest_matched`]).
    pub digest_matched: bool,
    /// Why the store refused the peer's own document (a writer) last, until a message of it
    /// is accepted again (see [`crate::protocol::SessionStatus::refused`]).
    pub refused: Option<String>,
    /// Whether the peer is its cluster's relay.
    pub relay: bool,
}

/// Transport-level counters (the protocol's are in [`Counters`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransportCounters {
    /// Incoming handshakes that failed (e.g. certificate from another CA).
    pub handshake_failures: u64,
    /// Dial attempts that failed.
    pub dial_failures: u64,
    /// Dialed connections that ended in a TLS alert: a peer refused our certificate or
    /// handshake, or we refused theirs (logged once per peer address per minute, naming the
    /// alert, e.g. `BadCertificate`, `UnknownCA`, `DecryptError` for a chain whose signature does
    /// not verify).
    pub certificate_refusals: u64,
    /// Connections closed because the certificate carried no valid identity.
    pub identity_rejections: u64,
    /// Frames dropped because a peer's outbound budget was exhausted.
    pub frames_dropped: u64,
    /// Connections closed as duplicates of another one to the same identity.
    pub duplicate_connections: u64,
    /// Streams closed because of an invalid or oversized frame.
    pub bad_frames: u64,
    /// Frame bytes written to every mesh stream, closed connections included.
    pub bytes_sent: u64,
    /// Frame bytes read from every mesh stream, closed connections included.
    pub bytes_received: u64,
    /// Sessions closed at once because the node had [`TransportConfig::max_sessions`].
    pub sessions_refused: u64,
    /// Incoming connections refused before their handshake because
    /// [`TransportConfig::max_handshakes`] were in progress.
    pub handshakes_refused: u64,
}

#[derive(Default)]
struct AtomicTransportCounters {
    handshake_failures: AtomicU64,
    dial_failures: AtomicU64,
    certificate_refusals: AtomicU64,
    identity_rejections: AtomicU64,
    frames_dropped: AtomicU64,
    duplicate_connections: AtomicU64,
    bad_frames: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    sessions_refused: AtomicU64,
    handshakes_refused: AtomicU64,
}

impl AtomicTransportCounters {
    fn snapshot(&self) -> TransportCounters {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TransportCounters {
            handshake_failures: l(&self.handshake_failures),
            dial_failures: l(&self.dial_failures),
            certificate_refusals: l(&self.certificate_refusals),
            identity_rejections: l(&self.identity_rejections),
            frames_dropped: l(&self.frames_dropped),
            duplicate_connections: l(&self.duplicate_connections),
            bad_frames: l(&self.bad_frames),
            bytes_sent: l(&self.bytes_sent),
            bytes_received: l(&self.bytes_received),
            sessions_refused: l(&self.sessions_refused),
            handshakes_refused: l(&self.handshakes_refused),
        }
    }
}

/// What the protocol thread publishes for the async side.
#[derive(Default)]
struct View {
    known_replicas: BTreeMap<String, String>,
    connected: HashSet<PeerIdentity>,
    counters: Counters,
    /// Whether a session with a relay is up (see [`Protocol::has_relay_session`]).
    relay_session: bool,
}

struct Shared {
    view: Mutex<View>,
    transport: AtomicTransportCounters,
    closing: AtomicBool,
    /// Whether this node is its cluster's relay ([`MeshHandle::set_relay`]).
    relay: AtomicBool,
    /// The relay an agent dials instead of the replicas ([`MeshHandle::set_relay_target`]).
    relay_target: Mutex<Option<SocketAddr>>,
    /// Node-wide outbound byte budget ([`TransportConfig::outbound_total_bytes`]).
    outbound_total: Arc<Semaphore>,
    outbound_total_max: u32,
    /// The store's verifier, for the verifier threads; replaced when the certificate rotates.
    verifier: SharedVerifier,
}

/// Handle to a running node.
pub struct MeshHandle {
    identity: PeerIdentity,
    transport_config: TransportConfig,
    client: Arc<Mutex<quinn::ClientConfig>>,
    local_addr: SocketAddr,
    endpoint: quinn::Endpoint,
    socket: Option<transport::SocketWatch>,
    events: mpsc::Sender<Event>,
    applied: broadcast::Sender<AppliedChange>,
    shared: Arc<Shared>,
    tasks: JoinSet<()>,
    driver: Option<std::thread::JoinHandle<()>>,
    /// What connection tasks need (in-process links are started from the handle).
    #[cfg_attr(not(feature = "test-util"), allow(dead_code))]
    ctx: Ctx,
}

impl MeshHandle {
    /// Binds the endpoint, starts the protocol thread, the accept loop and dialing.
    /// Must be called inside a tokio runtime. The store is shared with the application,
    /// which calls [`MeshHandle::notify_local_change`] after writing to it.
    pub async fn start<S: DocStore + Send + 'static>(
        config: NodeConfig,
        store: Arc<Mutex<S>>,
    ) -> Result<MeshHandle, NodeError> {
        let identity = config.identity.identity.clone();
        // Every change this node writes is signed with its certificate's key, and every change
        // it receives is verified against the CA before the store applies it.
        let trust = crate::signing::trust(&config.identity)?;
        let verifier = trust.verifier.clone();
        lock(&store).set_trust(trust);
        let (endpoint, socket) =
            transport::make_watched_endpoint(config.listen, &config.identity, &config.transport)?;
        let local_addr = endpoint.local_addr().map_err(NodeError::LocalAddr)?;
        let advertise = config.advertise.unwrap_or(local_addr);
        let mut pconfig = config.protocol.clone();
        if identity.is_replica() && pconfig.advertise_addr.is_none() {
            pconfig.advertise_addr = Some(advertise.to_string());
        }
        let (events_tx, events_rx) = mpsc::channel(config.transport.inbound_queue_frames.max(16));
        let (applied_tx, _) = broadcast::channel(4096);
        let total_max = u32::try_from(
            config
                .transport
                .outbound_total_bytes
                .max(wire::MAX_FRAME_SIZE),
        )
        .unwrap_or(u32::MAX);
        let shared = Arc::new(Shared {
            view: Mutex::new(View::default()),
            transport: AtomicTransportCounters::default(),
            closing: AtomicBool::new(false),
            relay: AtomicBool::new(false),
            relay_target: Mutex::new(None),
            outbound_total: Arc::new(Semaphore::new(total_max as usize)),
            outbound_total_max: total_max,
            verifier: Arc::new(Mutex::new(verifier)),
        });
        let max_sessions = config.transport.max_sessions.max(1);
        let mut protocol = Protocol::new(identity.clone(), pconfig);
        protocol.set_coalesce_pushes(true);
        let verifiers = (config.verify_threads > 0).then(|| {
            let (tx, done) = mpsc::unbounded_channel();
            let name = format!("dramesh-mesh {identity}");
            let pool = VerifyPool::new(config.verify_threads, &name, shared.verifier.clone(), tx);
            driver::Verifiers { pool, done }
        });
        protocol.set_verify_jobs(verifiers.is_some());
        let driver = {
            let tick_interval = config.tick_interval;
            let shared = shared.clone();
            let applied = applied_tx.clone();
            std::thread::Builder::new()
                .name(format!("dramesh-mesh {identity}"))
                .spawn(move || {
                    drive(
                        protocol,
                        store,
                        events_rx,
                        applied,
                        shared,
                        max_sessions,
                        tick_interval,
                        verifiers,
                    )
                })
                .map_err(NodeError::Thread)?
        };
        let mut tasks = JoinSet::new();
        let client = Arc::new(Mutex::new(transport::client_config(
            &config.identity,
            &config.transport,
        )?));
        let ctx = Ctx {
            endpoint: endpoint.clone(),
            client: client.clone(),
            events: events_tx.clone(),
            shared: shared.clone(),
            transport: config.transport.clone(),
            local: identity.clone(),
            next_conn: Arc::new(AtomicU64::new(1)),
            handshakes: Arc::new(Semaphore::new(config.transport.max_handshakes.max(1))),
            relay_fallback: config.relay_fallback,
        };
        tasks.spawn(accept_loop(ctx.clone()));
        tasks.spawn(dial_manager(ctx.clone(), config.seeds.clone(), advertise));
        info!(%identity, %local_addr, "mesh node started");
        Ok(MeshHandle {
            identity,
            transport_config: config.transport.clone(),
            client,
            local_addr,
            endpoint,
            socket: Some(socket),
            events: events_tx,
            applied: applied_tx,
            shared,
            tasks,
            driver: Some(driver),
            ctx,
        })
    }

    /// Switches to a renewed certificate and key of the same identity (a rotated credential
    /// file): connections accepted or dialed from now on present it, established ones keep the
    /// one they were made with until they close, and changes written from now on are signed
    /// with the new key. Refused, changing nothing, if it names another identity.
    pub fn rotate_identity<S: DocStore>(
        &self,
        id: &TlsIdentity,
        store: &Mutex<S>,
    ) -> Result<(), NodeError> {
        if id.identity != self.identity {
            return Err(NodeError::IdentityChanged {
                from: self.identity.clone(),
                to: id.identity.clone(),
            });
        }
        let server = transport::server_config(id, &self.transport_config)?;
        let client = transport::client_config(id, &self.transport_config)?;
        let trust = crate::signing::trust(id)?;
        *lock(&self.shared.verifier) = trust.verifier.clone();
        lock(store).set_trust(trust);
        self.endpoint.set_server_config(Some(server));
        *lock(&self.client) = client;
        info!(identity = %self.identity, "mesh certificate rotated");
        Ok(())
    }

    /// This node's identity.
    pub fn identity(&self) -> &PeerIdentity {
        &self.identity
    }

    /// Makes this agent its cluster's relay (the Lease holder), or stops it being one (see
    /// [`Protocol::set_relay`]): every session is closed and redialed with the new role, and
    /// an agent that stops relaying drops the documents it carried. Replicas ignore it.
    pub async fn set_relay(&self, on: bool) {
        if self.identity.is_replica() || self.shared.relay.swap(on, Ordering::Relaxed) == on {
            return;
        }
        if self.events.send(Event::SetRelay(on)).await.is_err() {
            debug!("set_relay after shutdown");
        }
    }

    /// Whether this node is its cluster's relay.
    pub fn is_relay(&self) -> bool {
        self.shared.relay.load(Ordering::Relaxed)
    }

    /// The mesh address of this agent's cluster's relay, or `None` when there is none known:
    /// an agent with a relay dials it instead of the replicas (and the replicas too while the
    /// relay is unreachable, see [`NodeConfig::relay_fallback`]). Ignored while this node is
    /// the relay itself, and by replicas.
    pub fn set_relay_target(&self, target: Option<SocketAddr>) {
        let mut t = lock(&self.shared.relay_target);
        if *t != target {
            info!(relay = ?target, "relay target");
            *t = target;
        }
    }

    /// Whether a session with a relay is up, as of the last processed event.
    pub fn relay_connected(&self) -> bool {
        lock(&self.shared.view).relay_session
    }

    /// Connects an in-process peer that authenticated as `identity` (no certificate is
    /// checked: only for benches and tests that run many peers without a QUIC endpoint each).
    /// Frames are the wire's, length-prefixed: the node's are handed to `sink`, the peer's
    /// are sent through the returned link. Returns `None` after shutdown.
    #[cfg(feature = "test-util")]
    pub async fn attach_local(
        &self,
        identity: PeerIdentity,
        sink: Box<dyn Fn(Vec<u8>) + Send + Sync>,
    ) -> Option<LocalLink> {
        let (tx, rx) = mpsc::channel::<Vec<u8>>(1024);
        let closed = Arc::new(LocalClose::default());
        let ctx = self.ctx.clone();
        let c2 = closed.clone();
        let conn = ConnId(ctx.next_conn.fetch_add(1, Ordering::Relaxed));
        let (outbound, out_rx, stats) = outbound_for(&ctx);
        ctx.events
            .send(Event::Connected {
                conn,
                identity: identity.clone(),
                dialed: false,
                connection: Link::Local(closed.clone()),
                outbound,
                stats: stats.clone(),
            })
            .await
            .ok()?;
        tokio::spawn(run_local(ctx, conn, identity, rx, out_rx, sink, c2, stats));
        Some(LocalLink { tx, closed })
    }

    /// The bound UDP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Tells the mesh that the application changed `doc` in the store: it is pushed to all
    /// connected peers that may hold it.
    pub async fn notify_local_change(&self, doc: DocId) {
        if self.events.send(Event::LocalChange(doc)).await.is_err() {
            debug!("notify_local_change after shutdown");
        }
    }

    /// Receives every remote change applied from now on (lagging receivers skip entries).
    pub fn subscribe(&self) -> broadcast::Receiver<AppliedChange> {
        self.applied.subscribe()
    }

    /// Live connections with traffic figures.
    pub async fn peers(&self) -> Vec<PeerStatus> {
        let (tx, rx) = oneshot::channel();
        if self.events.send(Event::Peers(tx)).await.is_err() {
            return vec![];
        }
        rx.await.unwrap_or_default()
    }

    /// Protocol counters as of the last processed event.
    pub fn counters(&self) -> Counters {
        lock(&self.shared.view).counters.clone()
    }

    /// The transport counters now.
    pub fn transport_counters(&self) -> TransportCounters {
        self.shared.transport.snapshot()
    }

    /// Identities with a live connection, as of the last processed event.
    pub fn connected_identities(&self) -> Vec<PeerIdentity> {
        let mut ids: Vec<PeerIdentity> =
            lock(&self.shared.view).connected.iter().cloned().collect();
        ids.sort();
        ids
    }

    /// Replicas known from hello and peer exchange: identity URI -> address.
    pub fn known_replicas(&self) -> BTreeMap<String, String> {
        lock(&self.shared.view).known_replicas.clone()
    }

    /// Closes every connection and stops all tasks and the protocol thread.
    ///
    /// Returns once the UDP socket is closed, so a node restarted in the same process can
    /// bind the same address, unless that takes longer than [`SOCKET_RELEASE_LIMIT`]
    /// (logged as a warning).
    pub async fn shutdown(mut self) {
        self.shared.closing.store(true, Ordering::Relaxed);
        self.endpoint.close(0u32.into(), b"shutdown");
        let _ = self.events.send(Event::Shutdown).await;
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        if let Some(driver) = self.driver.take() {
            let _ = tokio::task::spawn_blocking(move || driver.join()).await;
        }
        let deadline = tokio::time::Instant::now() + SOCKET_RELEASE_LIMIT;
        let _ = tokio::time::timeout_at(deadline, self.endpoint.wait_idle()).await;
        // Connections draining on the runtime hold the socket, not this handle.
        let socket = self.socket.take();
        let local_addr = self.local_addr;
        drop(self);
        while socket.as_ref().is_some_and(|s| !s.is_released()) {
            if tokio::time::Instant::now() >= deadline {
                warn!(%local_addr, "UDP socket still open {SOCKET_RELEASE_LIMIT:?} after shutdown");
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Longest [`MeshHandle::shutdown`] waits for draining connections to release the socket.
pub const SOCKET_RELEASE_LIMIT: Duration = Duration::from_secs(10);

impl Drop for MeshHandle {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Relaxed);
        self.endpoint.close(0u32.into(), b"dropped");
        self.tasks.abort_all();
        let _ = self.events.try_send(Event::Shutdown);
    }
}

#[derive(Clone)]
struct Ctx {
    endpoint: quinn::Endpoint,
    /// What dials present; replaced when the certificate rotates.
    client: Arc<Mutex<quinn::ClientConfig>>,
    events: mpsc::Sender<Event>,
    shared: Arc<Shared>,
    transport: TransportConfig,
    local: PeerIdentity,
    next_conn: Arc<AtomicU64>,
    /// Incoming handshakes in progress ([`TransportConfig::max_handshakes`]).
    handshakes: Arc<Semaphore>,
    relay_fallback: Duration,
}
