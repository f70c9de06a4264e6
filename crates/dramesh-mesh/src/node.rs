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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::certs::TlsIdentity;
use crate::identity::PeerIdentity;
use crate::protocol::{ConnId, Counters, Output, Protocol, ProtocolConfig};
use crate::store::DocStore;
use crate::sync::lock;
use crate::transport::{self, MESH_SERVER_NAME, TransportConfig, TransportError};
use crate::wire::{self, pb};
use dramesh_store::{DocId, HeadsVerifier};

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
    /// How often the protocol's timers are checked.
    pub tick_interval: Duration,
    /// How long an agent with a relay target ([`MeshHandle::set_relay_target`]) goes without
    /// a session with it before it dials the replicas directly too (see the module docs).
    pub relay_fallback: Duration,
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

#[derive(Default)]
struct ConnStats {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
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
    /// The store's verifier, for [`verify_ahead`]; replaced when the certificate rotates.
    verifier: Mutex<Arc<dyn HeadsVerifier>>,
}

/// A queued frame, its per-connection permits, and its share of the node-wide budget (given
/// back when the frame is written or dropped, even if the connection dies first).
type QueuedFrame = (Vec<u8>, u32, OwnedSemaphorePermit);

struct Outbound {
    tx: mpsc::UnboundedSender<QueuedFrame>,
    budget: Arc<Semaphore>,
    max_permits: u32,
}

enum Event {
    Connected {
        conn: ConnId,
        identity: PeerIdentity,
        dialed: bool,
        connection: Link,
        outbound: Outbound,
        stats: Arc<ConnStats>,
    },
    SetRelay(bool),
    Disconnected(ConnId),
    Frame(ConnId, pb::Envelope),
    LocalChange(DocId),
    Tick,
    Peers(oneshot::Sender<Vec<PeerStatus>>),
    Shutdown,
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
            verifier: Mutex::new(verifier),
        });
        let max_sessions = config.transport.max_sessions.max(1);
        let mut protocol = Protocol::new(identity.clone(), pconfig);
        protocol.set_coalesce_pushes(true);
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
        let tick_events = events_tx.clone();
        let tick_interval = config.tick_interval;
        tasks.spawn(async move {
            let mut interval = tokio::time::interval(tick_interval);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                interval.tick().await;
                // A full queue means the protocol thread is busy; it then ticks by itself
                // (see `drive`).
                if let Err(mpsc::error::TrySendError::Closed(_)) = tick_events.try_send(Event::Tick)
                {
                    break;
                }
            }
        });
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

/// The transport under one session.
#[derive(Clone)]
enum Link {
    Quic(quinn::Connection),
    /// An in-process peer ([`MeshHandle::attach_local`]).
    #[cfg(feature = "test-util")]
    Local(Arc<LocalClose>),
}

impl Link {
    fn close(&self, code: u32, reason: &[u8]) {
        match self {
            Link::Quic(c) => c.close(code.into(), reason),
            #[cfg(feature = "test-util")]
            Link::Local(l) => l.close(),
        }
    }

    fn remote_address(&self) -> SocketAddr {
        match self {
            Link::Quic(c) => c.remote_address(),
            #[cfg(feature = "test-util")]
            Link::Local(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
        }
    }

    fn rtt(&self) -> Duration {
        match self {
            Link::Quic(c) => c.rtt(),
            #[cfg(feature = "test-util")]
            Link::Local(_) => Duration::ZERO,
        }
    }
}

struct ConnEntry {
    identity: PeerIdentity,
    dialed: bool,
    connection: Link,
    outbound: Outbound,
    stats: Arc<ConnStats>,
}

/// Most events the protocol thread handles before it commits and releases their outputs.
const MAX_BATCH_EVENTS: usize = 256;

/// The protocol thread: owns the [`Protocol`], locks the store per event.
///
/// Group commit: the thread takes every event already queued (up to [`MAX_BATCH_EVENTS`]),
/// handles them, asks the store to make what they changed durable ([`DocStore::flush`], one
/// fsync per touched document instead of one per message), and only then sends the frames
/// and announces the applied changes they produced. No reply, relay, digest or heads that
/// reflects a received change leaves the node before that change is durable. If the flush
/// fails the batch's frames are dropped and the affected sessions' sync states reset, so
/// nothing undurable is acknowledged and anti-entropy retries later.
///
/// The protocol's timers run at least every `tick_interval` even when frames keep the queue
/// full (the timer task's ticks are then refused): a batch that finds a tick overdue ends with
/// one.
fn drive<S: DocStore>(
    mut protocol: Protocol,
    store: Arc<Mutex<S>>,
    mut events: mpsc::Receiver<Event>,
    applied: broadcast::Sender<AppliedChange>,
    shared: Arc<Shared>,
    max_sessions: usize,
    tick_interval: Duration,
) {
    let mut conns: HashMap<ConnId, ConnEntry> = HashMap::new();
    let local_uri = protocol.local().uri();
    let mut batch: Vec<Event> = Vec::with_capacity(MAX_BATCH_EVENTS);
    let mut held: Vec<Output> = Vec::new();
    let mut pushed: HashSet<DocId> = HashSet::new();
    let mut stop = false;
    // Whether the set of connections changed since the view last listed it (a relay holds a
    // session per node of its cluster: listing them after every batch cost a quarter of its
    // protocol thread).
    let mut conns_changed = true;
    let mut last_tick = Instant::now();
    while !stop {
        let Some(first) = events.blocking_recv() else {
            break;
        };
        batch.push(first);
        while batch.len() < MAX_BATCH_EVENTS {
            match events.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        // Under a full queue the timer task's ticks are refused; without this a healing
        // replica went seconds without heartbeats (which tell peers how far it got, and so
        // hold back their rounds) and without its delayed answers and relays.
        if last_tick.elapsed() >= tick_interval && !batch.iter().any(|e| matches!(e, Event::Tick)) {
            batch.push(Event::Tick);
        }
        pushed.clear();
        for event in batch.drain(..) {
            let now = Instant::now();
            let outputs = match event {
                Event::Shutdown => {
                    stop = true;
                    break;
                }
                Event::Connected {
                    conn,
                    identity,
                    dialed,
                    connection,
                    outbound,
                    stats,
                } => {
                    let mut outs = Vec::new();
                    let existing = conns
                        .iter()
                        .find(|(_, e)| e.identity == identity)
                        .map(|(c, e)| (*c, e.dialed));
                    let keep_new = match existing {
                        None => true,
                        Some((_, old_dialed)) if old_dialed == dialed => true,
                        Some(_) => {
                            // Keep the connection dialed by the smaller identity URI.
                            let we_are_smaller = local_uri < identity.uri();
                            dialed == we_are_smaller
                        }
                    };
                    if keep_new && existing.is_none() && conns.len() >= max_sessions {
                        shared
                            .transport
                            .sessions_refused
                            .fetch_add(1, Ordering::Relaxed);
                        warn!(%identity, max_sessions, "too many sessions; connection closed");
                        connection.close(6, b"too many sessions");
                    } else if keep_new {
                        if let Some((old, _)) = existing
                            && let Some(e) = conns.remove(&old)
                        {
                            shared
                                .transport
                                .duplicate_connections
                                .fetch_add(1, Ordering::Relaxed);
                            e.connection.close(2, b"duplicate connection");
                            protocol.on_disconnected(old);
                        }
                        conns_changed = true;
                        conns.insert(
                            conn,
                            ConnEntry {
                                identity: identity.clone(),
                                dialed,
                                connection,
                                outbound,
                                stats,
                            },
                        );
                        outs.extend(protocol.on_connected(conn, identity, now));
                    } else {
                        shared
                            .transport
                            .duplicate_connections
                            .fetch_add(1, Ordering::Relaxed);
                        connection.close(2, b"duplicate connection");
                    }
                    outs
                }
                Event::Disconnected(conn) => {
                    if conns.remove(&conn).is_some() {
                        conns_changed = true;
                        protocol.on_disconnected(conn);
                    }
                    vec![]
                }
                Event::SetRelay(on) => {
                    let closes = protocol.set_relay(on);
                    if !on {
                        let dropped = lock(&store).drop_copies();
                        if dropped > 0 {
                            info!(
                                dropped,
                                "no longer the cluster's relay: dropped the documents it carried"
                            );
                        }
                    }
                    closes
                }
                Event::Frame(conn, env) => {
                    if conns.contains_key(&conn) {
                        let mut s = lock(&store);
                        protocol.handle_frame(&mut *s, conn, env, now)
                    } else {
                        vec![]
                    }
                }
                Event::LocalChange(doc) => {
                    // The application wrote before it notified, so the first push of a batch
                    // already carries every write whose notification is queued behind it.
                    if pushed.insert(doc.clone()) {
                        let mut s = lock(&store);
                        protocol.on_local_change(&mut *s, &doc)
                    } else {
                        vec![]
                    }
                }
                Event::Tick => {
                    last_tick = now;
                    let mut s = lock(&store);
                    protocol.on_tick(&mut *s, now)
                }
                Event::Peers(reply) => {
                    let _ = reply.send(peer_statuses(&protocol, &conns));
                    vec![]
                }
            };
            for out in outputs {
                match out {
                    // Closing acknowledges nothing: do it at once so later frames of the batch
                    // from that connection are ignored.
                    Output::Close { conn, reason } => {
                        if let Some(e) = conns.remove(&conn) {
                            conns_changed = true;
                            e.connection.close(1, reason.as_bytes());
                            protocol.on_disconnected(conn);
                        }
                    }
                    other => held.push(other),
                }
            }
        }
        if protocol.has_deferred_pushes() {
            let mut s = lock(&store);
            held.extend(protocol.flush_pushes(&mut *s));
        }
        let flushed = lock(&store).flush();
        if let Err(e) = flushed {
            warn!(error = %e, frames = held.len(), "store flush failed; outputs of the batch dropped");
            for out in held.drain(..) {
                if let Output::Send { conn, envelope } = out {
                    protocol.on_dropped(conn, &envelope);
                }
            }
        }
        for out in held.drain(..) {
            match out {
                Output::Send { conn, envelope } => {
                    let Some(entry) = conns.get(&conn) else {
                        continue;
                    };
                    let frame = match wire::encode_frame(&envelope) {
                        Ok(f) => f,
                        Err(e) => {
                            warn!(peer = %entry.identity, error = %e, "cannot encode frame; dropped");
                            continue;
                        }
                    };
                    let len = u32::try_from(frame.len()).unwrap_or(u32::MAX);
                    let permits = len.min(entry.outbound.max_permits);
                    let total = shared
                        .outbound_total
                        .clone()
                        .try_acquire_many_owned(len.min(shared.outbound_total_max));
                    let own = entry.outbound.budget.try_acquire_many(permits);
                    match (own, total) {
                        (Ok(p), Ok(total)) => {
                            p.forget();
                            let _ = entry.outbound.tx.send((frame, permits, total));
                        }
                        _ => {
                            shared
                                .transport
                                .frames_dropped
                                .fetch_add(1, Ordering::Relaxed);
                            debug!(peer = %entry.identity, "outbound budget exhausted; frame dropped");
                            protocol.on_dropped(conn, &envelope);
                        }
                    }
                }
                Output::Close { conn, reason } => {
                    if let Some(e) = conns.remove(&conn) {
                        conns_changed = true;
                        e.connection.close(1, reason.as_bytes());
                        protocol.on_disconnected(conn);
                    }
                }
                Output::Applied {
                    doc,
                    generation,
                    from,
                } => {
                    let _ = applied.send(AppliedChange {
                        doc,
                        generation,
                        from,
                    });
                }
            }
        }
        lock(&store).maintain();
        let mut view = lock(&shared.view);
        if view.known_replicas != *protocol.known_replicas() {
            view.known_replicas = protocol.known_replicas().clone();
        }
        if std::mem::take(&mut conns_changed) {
            view.connected = conns.values().map(|e| e.identity.clone()).collect();
        }
        view.counters = protocol.counters().clone();
        view.relay_session = protocol.has_relay_session();
    }
    for (_, e) in conns {
        e.connection.close(0, b"shutdown");
    }
}

fn peer_statuses(protocol: &Protocol, conns: &HashMap<ConnId, ConnEntry>) -> Vec<PeerStatus> {
    protocol
        .sessions()
        .into_iter()
        .filter_map(|s| {
            let e = conns.get(&s.conn)?;
            Some(PeerStatus {
                identity: s.identity,
                remote_addr: e.connection.remote_address(),
                dialed: e.dialed,
                hello_received: s.hello_received,
                last_heard: s.last_heard,
                bytes_sent: e.stats.bytes_sent.load(Ordering::Relaxed),
                bytes_received: e.stats.bytes_received.load(Ordering::Relaxed),
                rtt: e.connection.rtt(),
                docs_behind: s.docs_behind,
                digest_matched: s.digest_matched,
                refused: s.refused,
                relay: s.relay,
            })
        })
        .collect()
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

/// Verifies a received sync message's signature on its connection's task, ahead of the
/// protocol thread: the verifier remembers signatures that passed, so the store's check there
/// is a lookup. Taking in a fleet of new documents, these ECDSA verifications (the writer's
/// chain and its signed heads) were a fifth of the protocol thread's work, and connection tasks
/// run on other threads. Only messages that carry their signer chain: a chain named by hash
/// (sent earlier on the session) is resolved by the protocol, which verifies those itself. Only
/// documents `from` may deliver at all ([`crate::store::may_deliver`]): an agent cannot make
/// the node verify signatures for other clusters, which the protocol refuses unverified. The
/// outcome is not used here; a bad signature is refused by the store as before.
fn verify_ahead(shared: &Shared, from: &PeerIdentity, env: &pb::Envelope) {
    let verifier = lock(&shared.verifier).clone();
    verify_sync_signature(verifier.as_ref(), from, env);
}

/// [`verify_ahead`] with a given verifier.
fn verify_sync_signature(verifier: &dyn HeadsVerifier, from: &PeerIdentity, env: &pb::Envelope) {
    let Some(pb::envelope::Body::Sync(s)) = &env.body else {
        return;
    };
    let Some(w) = s.signed.as_ref().filter(|w| !w.signer.is_empty()) else {
        return;
    };
    let (Some(doc), Ok(a)) = (
        wire::doc_from_wire(s.doc.as_ref()),
        wire::signed_from_wire(w),
    ) else {
        return;
    };
    if !crate::store::may_deliver(from, &doc) {
        return;
    }
    let statement = dramesh_store::attest::statement(&doc, s.generation, &a.heads);
    let _ = verifier.verify(&doc, &statement, &a.signature, &a.signer);
}

async fn accept_loop(ctx: Ctx) {
    let mut handshakes = JoinSet::new();
    while let Some(incoming) = ctx.endpoint.accept().await {
        // Reap finished connection tasks so the set stays small.
        while handshakes.try_join_next().is_some() {}
        // A flood of connection attempts costs at most this many handshakes at once; the
        // rest are refused before any cryptography (their peers retry with backoff).
        let Ok(permit) = ctx.handshakes.clone().try_acquire_owned() else {
            ctx.shared
                .transport
                .handshakes_refused
                .fetch_add(1, Ordering::Relaxed);
            debug!(remote = %incoming.remote_address(), "too many handshakes in progress; refused");
            incoming.refuse();
            continue;
        };
        let ctx = ctx.clone();
        handshakes.spawn(async move {
            let remote = incoming.remote_address();
            let connecting = match incoming.accept() {
                Ok(c) => c,
                Err(e) => {
                    ctx.shared
                        .transport
                        .handshake_failures
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(%remote, error = %e, "incoming connection refused");
                    return;
                }
            };
            let connection =
                match tokio::time::timeout(ctx.transport.connect_timeout, connecting).await {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        ctx.shared
                            .transport
                            .handshake_failures
                            .fetch_add(1, Ordering::Relaxed);
                        if matches!(
                            e,
                            quinn::ConnectionError::ApplicationClosed(_)
                                | quinn::ConnectionError::LocallyClosed
                        ) {
                            // The dialer gave up (e.g. shutting down): not a security event.
                            debug!(%remote, error = %e, "handshake abandoned");
                        } else {
                            warn!(%remote, error = %e, "TLS/QUIC handshake failed");
                        }
                        return;
                    }
                    Err(_) => {
                        ctx.shared
                            .transport
                            .handshake_failures
                            .fetch_add(1, Ordering::Relaxed);
                        warn!(%remote, "handshake timed out");
                        return;
                    }
                };
            let Some(identity) = check_identity(&ctx, &connection) else {
                return;
            };
            let stream =
                tokio::time::timeout(ctx.transport.connect_timeout, connection.accept_bi()).await;
            drop(permit);
            match stream {
                Ok(Ok((send, recv))) => {
                    run_connection(&ctx, connection, identity, false, send, recv, None).await;
                }
                _ => {
                    debug!(%remote, "peer opened no mesh stream");
                    connection.close(1u32.into(), b"no stream");
                }
            }
        });
    }
    handshakes.abort_all();
}

fn check_identity(ctx: &Ctx, connection: &quinn::Connection) -> Option<PeerIdentity> {
    match transport::peer_identity(connection) {
        Ok(id) if id == ctx.local => {
            debug!("connected to ourselves; closing");
            connection.close(3u32.into(), b"self");
            None
        }
        Ok(id) => Some(id),
        Err(e) => {
            ctx.shared
                .transport
                .identity_rejections
                .fetch_add(1, Ordering::Relaxed);
            warn!(remote = %connection.remote_address(), error = %e, "peer certificate has no valid identity");
            connection.close(4u32.into(), b"bad identity");
            None
        }
    }
}

/// The queue of frames to one peer, with its byte budget, and the connection's counters.
type OutQueue = (mpsc::UnboundedReceiver<QueuedFrame>, Arc<Semaphore>);

fn outbound_for(ctx: &Ctx) -> (Outbound, OutQueue, Arc<ConnStats>) {
    let budget_bytes = ctx
        .transport
        .outbound_budget_bytes
        .max(wire::MAX_FRAME_SIZE);
    let max_permits = u32::try_from(budget_bytes).unwrap_or(u32::MAX);
    let budget = Arc::new(Semaphore::new(max_permits as usize));
    let (tx, rx) = mpsc::unbounded_channel::<QueuedFrame>();
    let outbound = Outbound {
        tx,
        budget: budget.clone(),
        max_permits,
    };
    (outbound, (rx, budget), Arc::new(ConnStats::default()))
}

/// The peer's end of an in-process connection ([`MeshHandle::attach_local`]).
#[cfg(feature = "test-util")]
pub struct LocalLink {
    tx: mpsc::Sender<Vec<u8>>,
    closed: Arc<LocalClose>,
}

#[cfg(feature = "test-util")]
impl LocalLink {
    /// Sends one length-prefixed frame to the node; `false` once the link is closed.
    pub async fn send(&self, frame: Vec<u8>) -> bool {
        !self.closed.is_closed() && self.tx.send(frame).await.is_ok()
    }

    /// [`LocalLink::send`] from outside an async context.
    pub fn blocking_send(&self, frame: Vec<u8>) -> bool {
        !self.closed.is_closed() && self.tx.blocking_send(frame).is_ok()
    }

    /// Whether either side closed the link.
    pub fn is_closed(&self) -> bool {
        self.closed.is_closed()
    }

    /// Closes the link (the node sees the peer disconnect).
    pub fn close(&self) {
        self.closed.close();
    }
}

/// Closing an in-process link: a flag and a wake-up for its reader.
#[cfg(feature = "test-util")]
#[derive(Default)]
struct LocalClose {
    closed: AtomicBool,
    notify: tokio::sync::Notify,
}

#[cfg(feature = "test-util")]
impl LocalClose {
    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.notify.notify_waiters();
        self.notify.notify_one();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }
}

/// Runs an in-process connection until either side closes it: the peer's frames are decoded
/// and checked exactly as a QUIC stream's, the node's are handed to `sink`.
#[cfg(feature = "test-util")]
#[allow(clippy::too_many_arguments)]
async fn run_local(
    ctx: Ctx,
    conn: ConnId,
    identity: PeerIdentity,
    mut from_peer: mpsc::Receiver<Vec<u8>>,
    (mut to_peer, budget): OutQueue,
    sink: Box<dyn Fn(Vec<u8>) + Send + Sync>,
    closed: Arc<LocalClose>,
    stats: Arc<ConnStats>,
) {
    let writer = async {
        while let Some((frame, permits, total)) = to_peer.recv().await {
            budget.add_permits(permits as usize);
            drop(total);
            stats
                .bytes_sent
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            ctx.shared
                .transport
                .bytes_sent
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            sink(frame);
        }
    };
    let reader = async {
        while let Some(frame) = from_peer.recv().await {
            let env = frame
                .get(..wire::FRAME_HEADER_LEN)
                .and_then(|h| <[u8; wire::FRAME_HEADER_LEN]>::try_from(h).ok())
                .ok_or_else(|| "frame shorter than its header".to_string())
                .and_then(|h| wire::check_frame_len(h).map_err(|e| e.to_string()))
                .and_then(|len| {
                    if frame.len() != wire::FRAME_HEADER_LEN + len {
                        return Err("frame length does not match its header".to_string());
                    }
                    wire::decode_payload(&frame[wire::FRAME_HEADER_LEN..])
                        .map_err(|e| e.to_string())
                });
            let env = match env {
                Ok(env) => env,
                Err(error) => {
                    ctx.shared
                        .transport
                        .bad_frames
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(%identity, %error, "bad frame on an in-process link; closing it");
                    break;
                }
            };
            stats
                .bytes_received
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            ctx.shared
                .transport
                .bytes_received
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            verify_ahead(&ctx.shared, &identity, &env);
            if ctx.events.send(Event::Frame(conn, env)).await.is_err() {
                break;
            }
        }
    };
    let closed_wait = async {
        while !closed.is_closed() {
            closed.notify.notified().await;
        }
    };
    tokio::select! {
        () = writer => {}
        () = reader => {}
        () = closed_wait => {}
    }
    closed.close();
    let _ = ctx.events.send(Event::Disconnected(conn)).await;
}

/// Runs one established connection until it ends.
async fn run_connection(
    ctx: &Ctx,
    connection: quinn::Connection,
    identity: PeerIdentity,
    dialed: bool,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    wanted: Option<watch::Receiver<bool>>,
) {
    let conn = ConnId(ctx.next_conn.fetch_add(1, Ordering::Relaxed));
    let (outbound, (mut rx, budget), stats) = outbound_for(ctx);
    if ctx
        .events
        .send(Event::Connected {
            conn,
            identity: identity.clone(),
            dialed,
            connection: Link::Quic(connection.clone()),
            outbound,
            stats: stats.clone(),
        })
        .await
        .is_err()
    {
        return;
    }
    debug!(local = %ctx.local, %identity, conn = conn.0, dialed, "mesh connection up");
    let writer_stats = stats.clone();
    let writer_shared = ctx.shared.clone();
    let writer = async move {
        while let Some((frame, permits, total)) = rx.recv().await {
            let res = send.write_all(&frame).await;
            budget.add_permits(permits as usize);
            drop(total);
            if res.is_err() {
                break;
            }
            writer_stats
                .bytes_sent
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            writer_shared
                .transport
                .bytes_sent
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
        }
        let _ = send.finish();
    };
    let reader = async {
        loop {
            match wire::read_frame(&mut recv).await {
                Ok(Some((env, len))) => {
                    stats
                        .bytes_received
                        .fetch_add(len as u64, Ordering::Relaxed);
                    ctx.shared
                        .transport
                        .bytes_received
                        .fetch_add(len as u64, Ordering::Relaxed);
                    verify_ahead(&ctx.shared, &identity, &env);
                    if ctx.events.send(Event::Frame(conn, env)).await.is_err() {
                        break;
                    }
                }
                Ok(None) => break,
                Err(wire::FrameError::Io(_)) => break,
                Err(e) => {
                    ctx.shared
                        .transport
                        .bad_frames
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(%identity, error = %e, "bad frame; closing connection");
                    connection.close(5u32.into(), b"bad frame");
                    break;
                }
            }
        }
    };
    tokio::select! {
        _ = writer => {}
        _ = reader => {}
        _ = connection.closed() => {}
        () = unwanted(wanted) => {}
    }
    connection.close(0u32.into(), b"done");
    let _ = ctx.events.send(Event::Disconnected(conn)).await;
    debug!(local = %ctx.local, %identity, conn = conn.0, "mesh connection down");
}

/// Resolves once `wanted` says the connection is no longer wanted (never without one).
async fn unwanted(wanted: Option<watch::Receiver<bool>>) {
    let Some(mut wanted) = wanted else {
        return std::future::pending().await;
    };
    while *wanted.borrow_and_update() {
        if wanted.changed().await.is_err() {
            return;
        }
    }
}

/// Keeps one dial loop per address to dial, and ends the loops (and their connections) of
/// addresses no longer dialed.
///
/// Replicas, and agents without a relay target, dial the seeds and every replica learned
/// through peer exchange (replicas split the pairs). An agent with a relay target
/// ([`MeshHandle::set_relay_target`]) that is not itself the relay dials only the relay, and
/// the replicas too while it has had no session with the relay for
/// [`NodeConfig::relay_fallback`]: nothing it writes waits for a relay that is down. Once a
/// session with the relay is up again, the direct ones are closed.
async fn dial_manager(ctx: Ctx, seeds: Vec<SocketAddr>, own_addr: SocketAddr) {
    let mut dialing: HashMap<SocketAddr, watch::Sender<bool>> = HashMap::new();
    let mut loops = JoinSet::new();
    let mut check = tokio::time::interval(Duration::from_millis(250));
    let mut relay_down_since: Option<Instant> = None;
    loop {
        check.tick().await;
        if ctx.shared.closing.load(Ordering::Relaxed) {
            break;
        }
        let relay_target = *lock(&ctx.shared.relay_target);
        let (known, relay_up) = {
            let view = lock(&ctx.shared.view);
            (view.known_replicas.clone(), view.relay_session)
        };
        let via_relay = !ctx.local.is_replica()
            && !ctx.shared.relay.load(Ordering::Relaxed)
            && relay_target.is_some_and(|t| t != own_addr);
        let mut targets: Vec<(SocketAddr, Option<PeerIdentity>)> = Vec::new();
        let mut direct = true;
        if via_relay && let Some(relay) = relay_target {
            targets.push((relay, None));
            relay_down_since = if relay_up {
                None
            } else {
                relay_down_since.or(Some(Instant::now()))
            };
            direct = relay_down_since.is_some_and(|t| t.elapsed() >= ctx.relay_fallback);
        } else {
            relay_down_since = None;
        }
        if direct {
            targets.extend(seeds.iter().map(|a| (*a, None)));
            let local_uri = ctx.local.uri();
            for (uri, addr) in known {
                let Ok(addr) = addr.parse::<SocketAddr>() else {
                    continue;
                };
                let Ok(id) = PeerIdentity::parse_uri(&uri) else {
                    continue;
                };
                // Replicas split dialing between pairs; agents dial every replica.
                if ctx.local.is_replica() && local_uri > uri {
                    continue;
                }
                targets.push((addr, Some(id)));
            }
        }
        targets.retain(|(addr, _)| *addr != own_addr);
        let wanted: HashSet<SocketAddr> = targets.iter().map(|(a, _)| *a).collect();
        dialing.retain(|addr, w| {
            let keep = wanted.contains(addr);
            if !keep {
                let _ = w.send(false);
            }
            keep
        });
        for (addr, id) in targets {
            if dialing.contains_key(&addr) {
                continue;
            }
            let (tx, rx) = watch::channel(true);
            dialing.insert(addr, tx);
            loops.spawn(dial_loop(ctx.clone(), addr, id, rx));
        }
        while loops.try_join_next().is_some() {}
    }
    loops.abort_all();
}

/// How often a dial loop logs that a certificate was refused on its address, or that the
/// address could not be reached.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);

/// Whether a log line last written at `last` may be written again now (and if so, notes it).
fn log_due(last: &mut Option<Instant>) -> bool {
    if last.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_EVERY) {
        *last = Some(Instant::now());
        return true;
    }
    false
}

/// Keeps a connection to `addr` up: dial, run, and redial with backoff and jitter.
async fn dial_loop(
    ctx: Ctx,
    addr: SocketAddr,
    mut target: Option<PeerIdentity>,
    wanted: watch::Receiver<bool>,
) {
    let mut backoff = ctx.transport.backoff_min;
    let mut refusal_logged: Option<Instant> = None;
    let mut unreachable_logged: Option<Instant> = None;
    loop {
        if ctx.shared.closing.load(Ordering::Relaxed) || !*wanted.borrow() {
            return;
        }
        if let Some(id) = &target
            && lock(&ctx.shared.view).connected.contains(id)
        {
            // Someone (maybe the peer) already holds a connection to this identity.
            tokio::time::sleep(Duration::from_millis(250)).await;
            continue;
        }
        let started = Instant::now();
        // TLS 1.3 clients finish their handshake before the server checks their certificate,
        // so a refusal shows either as a failed dial or as the close of a fresh connection.
        let ended = match dial_once(&ctx, addr).await {
            Ok((connection, identity, send, recv)) => {
                target = Some(identity.clone());
                run_connection(
                    &ctx,
                    connection.clone(),
                    identity,
                    true,
                    send,
                    recv,
                    Some(wanted.clone()),
                )
                .await;
                if started.elapsed() > Duration::from_secs(5) {
                    backoff = ctx.transport.backoff_min;
                }
                connection.close_reason()
            }
            Err(e) => {
                ctx.shared
                    .transport
                    .dial_failures
                    .fetch_add(1, Ordering::Relaxed);
                debug!(%addr, error = %e, "dial failed");
                let refused =
                    matches!(&e, DialError::Connection(c) if certificate_refusal(c).is_some());
                if !refused && log_due(&mut unreachable_logged) {
                    let peer = target
                        .as_ref()
                        .map_or_else(|| "unknown identity".to_string(), ToString::to_string);
                    warn!(%addr, %peer, error = %e, "mesh peer unreachable; retrying (logged at most once a minute per peer)");
                }
                match e {
                    // The timeout spaced this attempt from the last; sleeping on top of it
                    // only delays finding the peer once it is reachable again (a healed
                    // partition).
                    DialError::TimedOut => continue,
                    DialError::Connection(c) => Some(c),
                    DialError::Other(_) => None,
                }
            }
        };
        if let Some(why) = ended.as_ref().and_then(certificate_refusal) {
            ctx.shared
                .transport
                .certificate_refusals
                .fetch_add(1, Ordering::Relaxed);
            if log_due(&mut refusal_logged) {
                let peer = target
                    .as_ref()
                    .map_or_else(|| "unknown identity".to_string(), ToString::to_string);
                warn!(%addr, %peer, reason = %why, "mesh certificate refused; retrying (logged at most once a minute per peer)");
            }
        }
        let jitter: f64 = rand::rng().random_range(0.5..1.5);
        tokio::time::sleep(backoff.mul_f64(jitter)).await;
        backoff = (backoff * 2).min(ctx.transport.backoff_max);
    }
}

/// Why a dial failed.
enum DialError {
    /// Nothing came back within the connect timeout (the peer is unreachable or down).
    TimedOut,
    /// The QUIC connection failed (handshake, TLS).
    Connection(quinn::ConnectionError),
    /// Anything else (no route, refused identity, ...).
    Other(String),
}

impl std::fmt::Display for DialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DialError::TimedOut => f.write_str("handshake timed out"),
            DialError::Connection(e) => write!(f, "{e}"),
            DialError::Other(e) => f.write_str(e),
        }
    }
}

/// The refusal a connection ended with, if it ended in a TLS alert (carried as a QUIC crypto
/// error, codes 0x100-0x1ff): who refused, the alert by its TLS name (`BadCertificate`,
/// `UnknownCA`, `DecryptError` when a chain's signature does not verify, ...), and the peer's
/// reason text. TLS 1.3 clients finish their handshake before the server checks their
/// certificate, so a refused client certificate shows as the peer closing with the alert.
pub(crate) fn certificate_refusal(e: &quinn::ConnectionError) -> Option<String> {
    let (code, by, detail) = match e {
        quinn::ConnectionError::ConnectionClosed(c) => (
            u64::from(c.error_code),
            "the peer refused this node's TLS handshake (its certificate, or the handshake itself)",
            String::from_utf8_lossy(&c.reason).into_owned(),
        ),
        quinn::ConnectionError::TransportError(t) => (
            u64::from(t.code),
            "this node refused the peer's TLS handshake",
            t.reason.clone(),
        ),
        _ => return None,
    };
    if !(0x100..0x200).contains(&code) {
        return None;
    }
    let alert = rustls::AlertDescription::from((code & 0xff) as u8);
    Some(if detail.is_empty() {
        format!("{by}: TLS alert {alert:?}")
    } else {
        format!("{by}: TLS alert {alert:?} ({detail})")
    })
}

type Dialed = (
    quinn::Connection,
    PeerIdentity,
    quinn::SendStream,
    quinn::RecvStream,
);

async fn dial_once(ctx: &Ctx, addr: SocketAddr) -> Result<Dialed, DialError> {
    let client = lock(&ctx.client).clone();
    let connecting = ctx
        .endpoint
        .connect_with(client, addr, MESH_SERVER_NAME)
        .map_err(|e| DialError::Other(e.to_string()))?;
    let connection = tokio::time::timeout(ctx.transport.connect_timeout, connecting)
        .await
        .map_err(|_| DialError::TimedOut)?
        .map_err(DialError::Connection)?;
    let identity = check_identity(ctx, &connection)
        .ok_or_else(|| DialError::Other("peer identity refused".to_string()))?;
    // The acceptor sees the stream once bytes arrive: the Hello queued by the protocol.
    let (send, recv) = connection.open_bi().await.map_err(DialError::Connection)?;
    Ok((connection, identity, send, recv))
}

#[cfg(test)]
mod tests {
    use super::certificate_refusal;

    /// Signatures are verified ahead only for sync messages carrying their chain, about a
    /// document the sender may deliver at all: an agent cannot make the node verify another
    /// cluster's signatures.
    #[test]
    fn signatures_are_verified_ahead_only_for_documents_the_sender_may_deliver() {
        use super::{HeadsVerifier, verify_sync_signature};
        use crate::PeerIdentity;
        use crate::wire::pb;
        use dramesh_store::DocId;
        use std::sync::atomic::{AtomicUsize, Ordering};

        #[derive(Default)]
        struct Counting(AtomicUsize);
        impl HeadsVerifier for Counting {
            fn verify(&self, _: &DocId, _: &[u8], _: &[u8], _: &[u8]) -> Result<(), String> {
                self.0.fetch_add(1, Ordering::Relaxed);
                Err("not checked in this test".into())
            }
        }
        let sync = |cluster: &str, signer: &[u8]| {
            crate::wire::envelope(pb::envelope::Body::Sync(pb::Sync {
                doc: Some((&DocId::new(cluster, "n1")).into()),
                generation: 1,
                payload: vec![],
                signed: Some(pb::SignedHeads {
                    heads: vec![vec![7; 32]],
                    signature: vec![1, 2, 3],
                    signer: signer.to_vec(),
                    signer_sha256: vec![],
                }),
            }))
        };
        let agent = PeerIdentity::Agent {
            cluster: "c1".into(),
            node: "n2".into(),
        };
        let replica = PeerIdentity::Replica { id: "r1".into() };
        let v = Counting::default();
        let count = || v.0.load(Ordering::Relaxed);
        verify_sync_signature(&v, &agent, &sync("c1", b"chain"));
        assert_eq!(count(), 1, "own cluster, chain carried");
        verify_sync_signature(&v, &agent, &sync("c2", b"chain"));
        assert_eq!(count(), 1, "another cluster's document from an agent");
        verify_sync_signature(&v, &replica, &sync("c2", b"chain"));
        assert_eq!(count(), 2, "replicas may relay any document");
        verify_sync_signature(&v, &replica, &sync("c2", b""));
        assert_eq!(count(), 2, "a chain named by hash is left to the protocol");
    }

    fn closed_by_peer(code: u64, reason: &str) -> quinn::ConnectionError {
        quinn::ConnectionError::ConnectionClosed(quinn::ConnectionClose {
            error_code: quinn::TransportErrorCode::crypto((code & 0xff) as u8),
            frame_type: None,
            reason: reason.as_bytes().to_vec().into(),
        })
    }

    #[test]
    fn tls_alerts_are_named_and_other_closes_are_not_refusals() {
        let why = certificate_refusal(&closed_by_peer(
            0x130,
            "invalid peer certificate: UnknownIssuer",
        ))
        .expect("UnknownCA is a refusal");
        assert!(
            why.contains("the peer refused this node's TLS handshake"),
            "{why}"
        );
        assert!(why.contains("TLS alert UnknownCA"), "{why}");
        assert!(why.contains("UnknownIssuer"), "{why}");
        let why = certificate_refusal(&closed_by_peer(0x12a, "")).expect("BadCertificate");
        assert!(why.ends_with("TLS alert BadCertificate"), "{why}");
        // A chain from another CA with the same name: its signature does not verify.
        let why = certificate_refusal(&closed_by_peer(0x133, "")).expect("DecryptError");
        assert!(why.ends_with("TLS alert DecryptError"), "{why}");
        // Any alert is named, not only certificate ones (handshake_failure, 40).
        let why = certificate_refusal(&closed_by_peer(0x128, "")).expect("HandshakeFailure");
        assert!(why.ends_with("TLS alert HandshakeFailure"), "{why}");
        assert_eq!(
            certificate_refusal(&quinn::ConnectionError::LocallyClosed),
            None
        );
        assert_eq!(certificate_refusal(&quinn::ConnectionError::TimedOut), None);
    }
}
