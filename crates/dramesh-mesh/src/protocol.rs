//! Sans-I/O replication protocol: what to send, given what arrived and what changed.
//!
//! [`Protocol`] owns no sockets, tasks or clocks. The driver feeds it connection events,
//! decoded frames, local changes and ticks (with the current [`Instant`]) and carries out
//! the returned [`Output`]s. This keeps the logic deterministic and testable by passing
//! frames between several instances in memory.
//!
//! Guarantees:
//! - **Push**: a local change is offered to every connected peer that may hold the document
//!   at once ([`Protocol::on_local_change`]); a replica that applies a remote change re-offers
//!   it to its other peers (relay), so reaching one replica reaches all. A change that came
//!   straight from its writer is not relayed to replicas the writer reported reaching in its
//!   last heartbeat, and to other replicas only after [`ProtocolConfig::relay_delay`]; the
//!   replica's answer to the writer waits [`ProtocolConfig::ack_delay`]. Both are sent by
//!   [`Protocol::on_tick`]. With
//!   [`Protocol::set_coalesce_pushes`] (the node's mode) these offers, relays and sync replies
//!   are generated once per (connection, document) when the driver calls
//!   [`Protocol::flush_pushes`], however many changes asked for them in between.
//! - **Anti-entropy**: every `anti_entropy_interval` (jittered) each session sends a root-only
//!   digest probe (a few dozen bytes whatever the number of documents); only on mismatch are
//!   the bucket hashes, then the entries of differing buckets, then automerge sync messages of
//!   differing documents exchanged. A mismatch while that document's sync is progressing (a
//!   sync message sent or received for it on the session, or its heads moved, since the last
//!   mismatch) lets the exchange continue: resetting restarts automerge sync from scratch, which
//!   under a steady update stream costs far more than waiting. Only a mismatch that persists
//!   across two probes (at least 3/4 of `anti_entropy_interval` apart) without such progress
//!   resets the in-flight sync state, so a dropped message delays convergence by at most about
//!   two rounds. A session starts no round, and answers no probe, while the peer has not yet
//!   handled the repairs of its previous round (it says how far it got in its heartbeats).
//!   Entries carry their heads, and the first repair of a document on a session is started by
//!   the side ahead, with the changes after the heads the other side listed
//!   (`Protocol::push_differences`). Between two replicas, a
//!   document whose writer has a session with this replica and reports reaching the other one
//!   is left to that writer (its own anti-entropy with each replica repairs it): under a steady
//!   update stream replicas' digests always differ by the changes in flight, and repairing them
//!   replica-to-replica resent them all every round. For [`ProtocolConfig::carrier_grace`]
//!   after two replicas connect, every member cluster's documents are left to their carriers,
//!   which reconnect and report whom they reach meanwhile.
//! - **Authorization**: an agent may only exchange its own (cluster, writer) document; frames
//!   about other documents are refused, counted in [`Counters::rejected_unauthorized`] and
//!   logged. Agents never talk to agents. Replicas may relay any document; the store
//!   applies only changes covered by the writer's verified signature, which travels with
//!   them (`Sync.signed`), whoever relays them ([`DocStore::receive_sync_message`]); refusals
//!   count in [`Counters::rejected_bad_signature`].
//! - Nothing but `Hello` is accepted before the peer's `Hello`; protocol violations close the
//!   connection.
//! - **Versions**: a peer whose `Hello` announces a protocol version this node does not speak
//!   ([`crate::version::admit`]) gets a `Refusal` with code `VERSION` naming both versions
//!   instead of a session; the connection is closed [`VERSION_REFUSAL_LINGER`] later (so the
//!   refusal reaches it), or at once when the peer's own refusal arrives. Both sides count
//!   ([`Counters::version_refusals_sent`], [`Counters::version_refusals_received`]) and log it,
//!   at most once per peer per [`REFUSAL_LOG_INTERVAL`]. A session records the features both
//!   sides announced ([`SessionStatus::features`]).
//! - **Refusals reach the writer**: when the store refuses a writer's message for its own
//!   document, the replica marks the session refused ([`SessionStatus::refused`], cleared by
//!   the next accepted message) and sends a typed `Refusal` at most once per
//!   [`REFUSAL_INTERVAL`] per document. The writer logs it at most once per
//!   [`REFUSAL_LOG_INTERVAL`]; for a generation refused as lying in the future it asks the
//!   store to recover ([`DocStore::recover_generation`]) and offers the new generation.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use tracing::{debug, info, warn};

use std::sync::Arc;

use dramesh_store::{
    Attestation, DIGEST_BUCKETS, Digest, DocEntry, DocId, REPLICA_SCOPES, SyncState,
};
use sha2::{Digest as _, Sha256};

use crate::identity::PeerIdentity;
use crate::store::{DocStore, RejectReason};
use crate::version::{self, PeerVersion};
use crate::wire::{self, WIRE_VERSION, pb, pb::envelope::Body};

/// Major protocol version carried in `Hello.protocol_version` (see [`crate::version`]).
pub const PROTOCOL_VERSION: u32 = version::PROTOCOL_MAJOR;
/// Most replicas accepted from one `PeerExchange`.
pub const MAX_PEER_EXCHANGE: usize = 1024;
/// Longest accepted advertised address.
pub const MAX_ADDR_LEN: usize = 256;
/// Most remembered per-(peer, document) sync states of closed sessions.
const MAX_SAVED_STATES: usize = 250_000;

/// Driver-assigned id of one live connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Timers and limits of the protocol.
#[derive(Debug, Clone)]
pub struct ProtocolConfig {
    /// Mean period of the digest probe per session (jittered by ±25 %).
    pub anti_entropy_interval: Duration,
    /// Period of the `Ephemeral` heartbeat per session.
    pub heartbeat_interval: Duration,
    /// Mean digest probe period on a session between a node agent and its cluster's relay.
    /// Slower than `anti_entropy_interval`: pushes on a session are reliable (one ordered
    /// stream), replicas' freshness does not depend on it, and a relay holds a session per node
    /// of its cluster (thousands), so its idle cost is per node.
    pub node_anti_entropy_interval: Duration,
    /// Heartbeat period on a session between a node agent and its cluster's relay (see
    /// `node_anti_entropy_interval`; the transport's keep-alive still notices a dead peer
    /// within its idle timeout).
    pub node_heartbeat_interval: Duration,
    /// Period of `PeerExchange` from replicas.
    pub peer_exchange_interval: Duration,
    /// Address this node accepts connections on, told to peers (replicas).
    pub advertise_addr: Option<String>,
    /// Most entries put in one `BucketRequest`/`BucketEntries` frame.
    pub max_entries_per_frame: usize,
    /// Seed of the jitter generator (fixed in tests for determinism).
    pub jitter_seed: u64,
    /// Digest probes (periodic and on hello). Turned off only by chaos tests, to show that
    /// push alone does not repair a dropped message.
    pub anti_entropy: bool,
    /// Offering local changes to peers at once, and relaying applied ones. Turned off only by
    /// chaos tests, to show that anti-entropy alone converges.
    pub push: bool,
    /// How long a replica waits before relaying to other replicas a change it received
    /// straight from the document's writer (zero: at once). The writer has usually reached
    /// them directly; waiting lets one exchange carry the window's changes instead of one per
    /// change. Changes relayed by another replica are passed on at once.
    pub relay_delay: Duration,
    /// How long a replica waits before answering a sync message that brought its writer's
    /// changes (zero: at once). The answer only tells the writer what the replica now holds;
    /// at a steady update rate one answer per window replaces one per change. Answers that
    /// carry anything else (a request for missing changes, a first exchange) are not delayed.
    pub ack_delay: Duration,
    /// Most documents one anti-entropy round repairs on one session; the rest differ still and
    /// are repaired by the next rounds. A replica that finds a new peer empty (or far behind)
    /// would otherwise start a sync of every document at once, far beyond the peer's outbound
    /// budget, and every dropped frame costs that document's exchange a restart.
    pub max_repairs_per_round: usize,
    /// How long after two replicas connect they leave every member cluster's documents to
    /// those documents' carriers (writers and cluster relays), repairing only the replicas' own
    /// documents between them. Carriers that can reach both replicas again (a healed
    /// partition) redial within about a second and report the replicas they reach in their
    /// next heartbeat; until then the rule that leaves their documents to them
    /// (`Protocol::carriers_reaching`) cannot know them, and the side behind pulled the same
    /// documents from the other replica and from their carriers at once.
    pub carrier_grace: Duration,
    /// Sending `PeerExchange` (replicas) and learning replicas from received ones. Turned off
    /// only by chaos tests, so that an agent knows no replica but its seeds and the break of
    /// replica-to-replica replication cannot be bypassed by agents reaching every replica.
    pub peer_exchange: bool,
}

impl Default for ProtocolConfig {
    fn default() -> Self {
        Self {
            anti_entropy_interval: Duration::from_secs(2),
            heartbeat_interval: Duration::from_secs(1),
            node_anti_entropy_interval: Duration::from_secs(60),
            node_heartbeat_interval: Duration::from_secs(30),
            peer_exchange_interval: Duration::from_secs(10),
            advertise_addr: None,
            max_entries_per_frame: 50_000,
            jitter_seed: rand::rng().random(),
            anti_entropy: true,
            push: true,
            relay_delay: Duration::from_millis(500),
            ack_delay: Duration::from_millis(500),
            max_repairs_per_round: 4096,
            carrier_grace: Duration::from_secs(3),
            peer_exchange: true,
        }
    }
}

/// Something the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Send the envelope on the connection.
    Send {
        /// The connection.
        conn: ConnId,
        /// What to send.
        envelope: pb::Envelope,
    },
    /// Close the connection (protocol violation or version mismatch).
    Close {
        /// The connection.
        conn: ConnId,
        /// Why, for the peer and the log.
        reason: String,
    },
    /// A remote sync message changed a document.
    Applied {
        /// The document.
        doc: DocId,
        /// Its generation.
        generation: u64,
        /// The peer whose message changed it.
        from: PeerIdentity,
    },
}

/// Monotonic protocol counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Frames handled.
    pub frames_in: u64,
    /// Frames produced.
    pub frames_out: u64,
    /// Sync messages received.
    pub sync_in: u64,
    /// Sync messages sent.
    pub sync_out: u64,
    /// Remote sync messages that changed a document.
    pub applied: u64,
    /// Frames about documents the sending identity may not exchange.
    pub rejected_unauthorized: u64,
    /// Sync messages the store refused (authors, malformed, store errors).
    pub rejected_by_store: u64,
    /// Sync messages whose changes no verified signature of the writer covers.
    pub rejected_bad_signature: u64,
    /// Sync messages for an older generation than held.
    pub stale_generation: u64,
    /// Malformed or out-of-order frames (each closes or ignores per the module docs).
    pub protocol_errors: u64,
    /// Root-only digest probes sent.
    pub digest_probes_sent: u64,
    /// Probes whose root differed from ours.
    pub digest_mismatches: u64,
    /// Bucket entries requested after a mismatch.
    pub buckets_requested: u64,
    /// Sync states reset because anti-entropy found a difference.
    pub sync_resets: u64,
    /// Document entries a replica-to-replica anti-entropy round left out of its comparison
    /// because their writer, or their cluster's relay, reaches both replicas itself.
    pub repairs_left_to_writers: u64,
    /// Anti-entropy rounds not started, or not answered, because the peer had yet to handle
    /// the repairs of the session's previous round (see [`Protocol::on_tick`]).
    pub rounds_deferred: u64,
    /// Differing documents an anti-entropy round left to the peer to repair (for 0.75
    /// anti-entropy intervals): it listed heads this node lacks, so it holds changes this node
    /// does not and sends them.
    pub repairs_left_to_peer: u64,
    /// Repairs whose first message carried the changes after the heads the peer listed,
    /// without waiting for the peer to ask (see `Protocol::push_differences`).
    pub repairs_from_listed_heads: u64,
    /// Frames the driver dropped (the peer's outbound queue was full, or what they acknowledged
    /// could not be made durable); see [`Protocol::on_dropped`].
    pub backpressure_events: u64,
    /// Refusals sent to writers whose own document's messages the store refused.
    pub refusals_sent: u64,
    /// Refusals received from replicas about this node's own document.
    pub refusals_received: u64,
    /// New generations started after a refusal showed the own generation lying in the future.
    pub generation_recoveries: u64,
    /// Sessions refused because the peer's `Hello` announced a protocol version this node does
    /// not speak.
    pub version_refusals_sent: u64,
    /// Version refusals received from peers that do not speak this node's protocol version.
    pub version_refusals_received: u64,
}

/// Protocol-level view of one session.
#[derive(Debug, Clone)]
pub struct SessionStatus {
    /// The connection.
    pub conn: ConnId,
    /// The peer's certificate identity.
    pub identity: PeerIdentity,
    /// Whether the peer's hello arrived.
    pub hello_received: bool,
    /// When the peer was last heard from.
    pub last_heard: Instant,
    /// Last heartbeat sequence received.
    pub heartbeat_seq: u64,
    /// Documents the peer reported in its last heartbeat that differ from ours.
    pub docs_behind: usize,
    /// Whether an anti-entropy digest of the peer has equalled ours at least once on this
    /// session (every document both may exchange was the same on both ends at that moment).
    pub digest_matched: bool,
    /// Why the store refused the last sync message of the peer's own document (a writer),
    /// until one is accepted again. A refused writer's heartbeats say nothing about the
    /// freshness of its data.
    pub refused: Option<String>,
    /// The address the peer (a replica) advertised in its hello.
    pub advertise_addr: Option<String>,
    /// Whether the peer declared itself its cluster's relay.
    pub relay: bool,
    /// What the session exchanges (`None` before the peer's hello).
    pub scope: Option<Scope>,
    /// The version the peer announced in its hello (`None` before it).
    pub peer_version: Option<PeerVersion>,
    /// The features both sides announced (empty before the peer's hello).
    pub features: BTreeSet<String>,
}

struct DocSync {
    generation: u64,
    state: SyncState,
    /// SHA-256 of the signer chain last sent for this document on this session: later
    /// signatures by the same signer go without it (a chain is ~0.5 KB per message otherwise).
    signer_sent: Option<[u8; 32]>,
    /// The signer chain last received for this document on this session.
    signer_seen: Option<Arc<[u8]>>,
    /// Sync messages sent or received for the document on this session.
    progress: u64,
    /// The last anti-entropy mismatch not yet resolved (see [`Protocol::repair_doc`]).
    suspect: Option<Suspect>,
}

/// An anti-entropy mismatch of one document on one session, as first seen.
struct Suspect {
    /// [`DocSync::progress`] after the mismatch was handled.
    progress: u64,
    /// Our entry when the mismatch was seen; a change means our heads moved.
    entry: Option<DocEntry>,
    since: Instant,
}

struct Session {
    identity: PeerIdentity,
    hello_received: bool,
    docs: HashMap<DocId, DocSync>,
    next_anti_entropy: Instant,
    next_heartbeat: Instant,
    next_peer_exchange: Instant,
    heartbeat_out: u64,
    heartbeat_in: u64,
    last_heard: Instant,
    docs_behind: usize,
    /// See [`SessionStatus::digest_matched`].
    digest_matched: bool,
    /// See [`SessionStatus::refused`].
    refused: Option<String>,
    /// When a [`pb::Refusal`] was last sent for each document on this session.
    refusals_sent: HashMap<DocId, Instant>,
    advertise_addr: Option<String>,
    /// Replicas the peer (an agent) reported a live session with in its last heartbeat.
    reached: BTreeSet<PeerIdentity>,
    /// Whether the peer declared itself its cluster's relay in its hello.
    relay: bool,
    /// What the session exchanges; `None` until the peer's hello.
    scope: Option<Scope>,
    /// See [`SessionStatus::peer_version`].
    peer_version: Option<PeerVersion>,
    /// See [`SessionStatus::features`].
    features: BTreeSet<String>,
    /// This node refused the peer's version: every later frame but a refusal is ignored until
    /// the connection closes.
    version_refused: bool,
    /// Mean digest probe and heartbeat periods of the session (a node agent and its relay
    /// use the slower `node_*` ones).
    anti_entropy_interval: Duration,
    heartbeat_interval: Duration,
    /// The session's entry in [`Protocol::timers`], once its hello arrived.
    timer: Option<Instant>,
    /// Frames handled from the peer on this session (told to it in heartbeats).
    frames_in: u64,
    /// Frames queued to the peer on this session, less those the driver dropped.
    frames_out: u64,
    /// How many of our frames the peer last reported having handled (`None` until a heartbeat
    /// says so; older peers never do).
    peer_processed: Option<u64>,
    /// [`Session::frames_out`] after the last anti-entropy round in which we started repairs.
    repairs_sent: u64,
    /// Until when a session between two replicas leaves every member cluster's documents to
    /// their carriers ([`ProtocolConfig::carrier_grace`]).
    carrier_grace_until: Option<Instant>,
    /// Documents with no sync state on this session that an anti-entropy round left to the
    /// peer, holding changes we lack, and when (see [`Protocol::push_differences`]).
    left_to_peer: HashMap<DocId, Instant>,
}

impl Session {
    /// Whether the peer has yet to handle the repairs of our last anti-entropy round: a new
    /// round would find the same documents differing and only repeat the work.
    fn repairs_pending(&self) -> bool {
        self.peer_processed.is_some_and(|n| n < self.repairs_sent)
    }
}

/// Documents two replicas leave out of their anti-entropy (see
/// [`Protocol::carriers_reaching`]).
#[derive(Default)]
struct LeftToCarriers {
    /// Every member cluster (the session's [`ProtocolConfig::carrier_grace`]).
    all_clusters: bool,
    /// Clusters whose relay reaches both.
    clusters: HashSet<String>,
    /// Documents whose writer reaches both (of clusters not in `clusters`).
    docs: HashSet<DocId>,
}

impl LeftToCarriers {
    fn contains(&self, doc: &DocId) -> bool {
        (self.all_clusters && !doc.is_replica_scope())
            || self.clusters.contains(&doc.cluster)
            || self.docs.contains(doc)
    }
}

impl Session {
    /// Whether the session exchanges `doc` (never before the peer's hello).
    fn covers(&self, doc: &DocId) -> bool {
        self.scope.as_ref().is_some_and(|s| s.contains(doc))
    }
}

/// The replication state machine of one node (see the module docs).
pub struct Protocol {
    local: PeerIdentity,
    config: ProtocolConfig,
    sessions: BTreeMap<ConnId, Session>,
    known_replicas: BTreeMap<String, String>,
    saved_states: HashMap<(PeerIdentity, DocId), (u64, SyncState)>,
    counters: Counters,
    rng: StdRng,
    /// See [`Protocol::set_coalesce_pushes`].
    coalesce: bool,
    /// Pushes waiting for [`Protocol::flush_pushes`], one per (connection, document).
    deferred: BTreeSet<(ConnId, DocId)>,
    /// Relays to replicas and answers to writers waiting for their time (see
    /// [`ProtocolConfig::relay_delay`] and [`ProtocolConfig::ack_delay`]).
    delayed: BTreeMap<(ConnId, DocId), Instant>,
    /// When a refusal of each own document was last logged (writers; see
    /// [`REFUSAL_LOG_INTERVAL`]).
    refusal_logged: HashMap<DocId, Instant>,
    /// See [`Protocol::set_relay`].
    relay: bool,
    /// Sessions (after their hello) exchanging more than one document, and those exchanging
    /// one, by document: a relay or a replica may hold thousands of one-document sessions, and
    /// every change would otherwise scan them all (see [`Protocol::covering`]).
    wide: BTreeSet<ConnId>,
    by_doc: HashMap<DocId, Vec<ConnId>>,
    /// Sessions by when their next timer (probe, heartbeat, peer exchange) is due: a relay
    /// holds a session per node of its cluster, and visiting them all on every tick was most
    /// of its idle cost.
    timers: BTreeSet<(Instant, ConnId)>,
    /// Sessions with a relay whose hello arrived.
    relay_sessions: usize,
    /// A replica learned a replica it did not know: the next tick tells every session (see
    /// [`Protocol::learn_replica`]).
    announce: bool,
    /// Sessions refused for their version, by when they are closed
    /// ([`VERSION_REFUSAL_LINGER`]).
    closing: BTreeSet<(Instant, ConnId)>,
    /// When a version refusal was last logged, by peer (at most once per
    /// [`REFUSAL_LOG_INTERVAL`]).
    version_logged: HashMap<PeerIdentity, Instant>,
}

/// A replica tells a refused writer why at most this often per document and connection.
pub const REFUSAL_INTERVAL: Duration = Duration::from_secs(10);
/// A writer logs refusals of its document at most this often.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(60);
/// How long a session refused for its version stays open after the refusal was sent, so the
/// refusal reaches the peer before the connection closes (closing drops unsent frames).
pub const VERSION_REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// Most peers whose last version-refusal log time is remembered.
const MAX_VERSION_LOGGED: usize = 10_000;
/// Longest refusal text sent or logged.
const MAX_REFUSAL_REASON: usize = 1024;

fn code_of(reason: &RejectReason) -> pb::RefusalCode {
    match reason {
        RejectReason::FutureGeneration(_) => pb::RefusalCode::FutureGeneration,
        RejectReason::Unauthorized(_) => pb::RefusalCode::Unauthorized,
        RejectReason::Malformed(_) => pb::RefusalCode::Malformed,
        RejectReason::BadSignature(_) => pb::RefusalCode::BadSignature,
        RejectReason::Retired(_) => pb::RefusalCode::Retired,
        RejectReason::StaleGeneration { .. } | RejectReason::Store(_) => pb::RefusalCode::Store,
    }
}

fn bounded(text: &str) -> String {
    match text.char_indices().nth(MAX_REFUSAL_REASON) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

/// The documents one session exchanges: everything it may sync, digest and deliver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every document: two replicas.
    All,
    /// Every document of one member cluster: a replica and that cluster's relay.
    Cluster(String),
    /// One document, a node agent's own: the agent and a replica, or the agent and its
    /// cluster's relay.
    Doc(DocId),
}

impl Scope {
    /// Whether `doc` is in the scope.
    pub fn contains(&self, doc: &DocId) -> bool {
        match self {
            Scope::All => true,
            Scope::Cluster(c) => doc.cluster == *c,
            Scope::Doc(d) => d == doc,
        }
    }

    /// The scope of a session between `local` and `peer`, given whether each declared itself
    /// its cluster's relay (see [`Protocol::set_relay`]); `Err` names why the two may not
    /// exchange anything. The one rule for who exchanges what:
    /// - replicas exchange everything with each other;
    /// - a replica and an agent exchange the agent's own document, or, when the agent is its
    ///   cluster's relay, every document of that cluster;
    /// - two agents talk only when both are of the same cluster and exactly one is its relay,
    ///   and then exchange the other's own document.
    pub fn of_session(
        local: &PeerIdentity,
        local_relay: bool,
        peer: &PeerIdentity,
        peer_relay: bool,
    ) -> Result<Scope, String> {
        let own = |id: &PeerIdentity| match id {
            PeerIdentity::Agent { cluster, node } => DocId::new(cluster.clone(), node.clone()),
            PeerIdentity::Replica { .. } => DocId::new(String::new(), String::new()),
        };
        let cluster_of = |id: &PeerIdentity| match id {
            PeerIdentity::Agent { cluster, .. } => Some(cluster.clone()),
            PeerIdentity::Replica { .. } => None,
        };
        match (local.is_replica(), peer.is_replica()) {
            (true, true) if peer_relay => Err(format!("replica {peer} claims to be a relay")),
            (true, true) => Ok(Scope::All),
            (true, false) | (false, true) => {
                let (agent, relay) = if local.is_replica() {
                    (peer, peer_relay)
                } else {
                    (local, local_relay)
                };
                if peer.is_replica() && peer_relay {
                    return Err(format!("replica {peer} claims to be a relay"));
                }
                match (relay, cluster_of(agent)) {
                    (true, Some(c)) => Ok(Scope::Cluster(c)),
                    _ => Ok(Scope::Doc(own(agent))),
                }
            }
            (false, false) => {
                if cluster_of(local) != cluster_of(peer) {
                    return Err(format!(
                        "agent {peer} is of another cluster than {local}: agents talk only to their own cluster's relay"
                    ));
                }
                match (local_relay, peer_relay) {
                    (true, false) => Ok(Scope::Doc(own(peer))),
                    (false, true) => Ok(Scope::Doc(own(local))),
                    (true, true) => Err(format!(
                        "{local} and {peer} are both relays of their cluster (a Lease handover); only a node agent talks to a relay"
                    )),
                    (false, false) => Err(format!(
                        "neither {local} nor {peer} is its cluster's relay: agents talk only to replicas and to their relay"
                    )),
                }
            }
        }
    }
}

fn role_of(id: &PeerIdentity) -> pb::Role {
    if id.is_replica() {
        pb::Role::Replica
    } else {
        pb::Role::Agent
    }
}

impl Protocol {
    /// A node with identity `local` and no sessions.
    pub fn new(local: PeerIdentity, config: ProtocolConfig) -> Self {
        let rng = StdRng::seed_from_u64(config.jitter_seed);
        Self {
            local,
            config,
            sessions: BTreeMap::new(),
            known_replicas: BTreeMap::new(),
            saved_states: HashMap::new(),
            counters: Counters::default(),
            rng,
            coalesce: false,
            deferred: BTreeSet::new(),
            delayed: BTreeMap::new(),
            refusal_logged: HashMap::new(),
            relay: false,
            wide: BTreeSet::new(),
            by_doc: HashMap::new(),
            timers: BTreeSet::new(),
            relay_sessions: 0,
            announce: false,
            closing: BTreeSet::new(),
            version_logged: HashMap::new(),
        }
    }

    /// The sessions whose scope covers `doc`, in connection order.
    fn covering(&self, doc: &DocId) -> Vec<ConnId> {
        let mut out: Vec<ConnId> = self
            .wide
            .iter()
            .copied()
            .filter(|c| self.sessions.get(c).is_some_and(|s| s.covers(doc)))
            .collect();
        if let Some(conns) = self.by_doc.get(doc) {
            out.extend(conns);
            out.sort_unstable();
        }
        out
    }

    /// Makes this node (an agent) its cluster's relay, or stops it being one: a relay carries
    /// every document of its cluster between the cluster's node agents and the replicas (see
    /// [`Scope::of_session`]). A session's scope is fixed at its hello, so every session is
    /// closed (the node redials); returns the closes. Replicas are never relays.
    pub fn set_relay(&mut self, on: bool) -> Vec<Output> {
        let on = on && !self.local.is_replica();
        if on == self.relay {
            return Vec::new();
        }
        self.relay = on;
        let conns: Vec<ConnId> = self.sessions.keys().copied().collect();
        conns
            .into_iter()
            .map(|conn| {
                self.on_disconnected(conn);
                Output::Close {
                    conn,
                    reason: if on {
                        "this agent became its cluster's relay".into()
                    } else {
                        "this agent stopped being its cluster's relay".into()
                    },
                }
            })
            .collect()
    }

    /// Whether this node is its cluster's relay (see [`Protocol::set_relay`]).
    pub fn is_relay(&self) -> bool {
        self.relay
    }

    /// Whether this node carries `doc` for others: a replica any document, a relay those of
    /// its cluster.
    fn carries(&self, doc: &DocId) -> bool {
        match &self.local {
            PeerIdentity::Replica { .. } => true,
            PeerIdentity::Agent { cluster, .. } => self.relay && doc.cluster == *cluster,
        }
    }

    /// Whether a session with a relay whose hello arrived is up.
    pub fn has_relay_session(&self) -> bool {
        self.relay_sessions > 0
    }

    /// Coalesces pushes: offers of local changes, relays and sync replies are not generated at
    /// once but remembered per (connection, document) and generated by
    /// [`Protocol::flush_pushes`], once each however many changes or messages asked for them.
    ///
    /// Every automerge sync message costs time in the number of changes the peer has not
    /// acknowledged yet; generating one per change while a backlog builds makes that backlog
    /// grow (the cost per message rises with it). The node turns this on and flushes after
    /// each batch of queued events, so an idle node still answers at once while a busy one
    /// sends one message per document per batch. Anti-entropy repairs are never deferred.
    pub fn set_coalesce_pushes(&mut self, on: bool) {
        self.coalesce = on;
    }

    /// Generates the pushes deferred since the last call (see
    /// [`Protocol::set_coalesce_pushes`]).
    pub fn flush_pushes<S: DocStore>(&mut self, store: &mut S) -> Vec<Output> {
        let mut out = Vec::new();
        for (conn, doc) in std::mem::take(&mut self.deferred) {
            self.push_doc_now(store, conn, &doc, false, &mut out);
        }
        out
    }

    /// Generates the pushes deferred for `conn` only.
    fn flush_conn<S: DocStore>(&mut self, store: &mut S, conn: ConnId, out: &mut Vec<Output>) {
        // The set is ordered by connection, then document; the empty id sorts first.
        let docs: Vec<DocId> = self
            .deferred
            .range((conn, DocId::new(String::new(), String::new()))..)
            .take_while(|(c, _)| *c == conn)
            .map(|(_, d)| d.clone())
            .collect();
        for doc in docs {
            self.deferred.remove(&(conn, doc.clone()));
            self.push_doc_now(store, conn, &doc, false, out);
        }
    }

    /// Whether pushes are waiting for [`Protocol::flush_pushes`].
    pub fn has_deferred_pushes(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// This node's identity.
    pub fn local(&self) -> &PeerIdentity {
        &self.local
    }

    /// The protocol counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Replicas learned from `Hello` and `PeerExchange`: identity URI -> address.
    pub fn known_replicas(&self) -> &BTreeMap<String, String> {
        &self.known_replicas
    }

    /// Every session, by connection.
    pub fn sessions(&self) -> Vec<SessionStatus> {
        self.sessions
            .iter()
            .map(|(conn, s)| SessionStatus {
                conn: *conn,
                identity: s.identity.clone(),
                hello_received: s.hello_received,
                last_heard: s.last_heard,
                heartbeat_seq: s.heartbeat_in,
                docs_behind: s.docs_behind,
                digest_matched: s.digest_matched,
                refused: s.refused.clone(),
                advertise_addr: s.advertise_addr.clone(),
                relay: s.relay,
                scope: s.scope.clone(),
                peer_version: s.peer_version.clone(),
                features: s.features.clone(),
            })
            .collect()
    }

    fn jittered(&mut self, base: Duration) -> Duration {
        let factor: f64 = self.rng.random_range(0.75..1.25);
        base.mul_f64(factor)
    }

    fn send(&mut self, out: &mut Vec<Output>, conn: ConnId, body: Body) {
        self.counters.frames_out += 1;
        if let Some(s) = self.sessions.get_mut(&conn) {
            s.frames_out += 1;
        }
        if matches!(body, Body::Sync(_)) {
            self.counters.sync_out += 1;
        }
        out.push(Output::Send {
            conn,
            envelope: wire::envelope(body),
        });
    }

    /// A connection authenticated as `peer` is up: greet it.
    pub fn on_connected(&mut self, conn: ConnId, peer: PeerIdentity, now: Instant) -> Vec<Output> {
        let mut out = Vec::new();
        // Agents talk to agents only within their cluster, to or as its relay (decided at the
        // hello, which says who is the relay); another cluster's agent is refused at once.
        if let (
            PeerIdentity::Agent { cluster: mine, .. },
            PeerIdentity::Agent {
                cluster: theirs, ..
            },
        ) = (&self.local, &peer)
            && mine != theirs
        {
            warn!(%peer, "refusing an agent of another cluster");
            self.counters.rejected_unauthorized += 1;
            out.push(Output::Close {
                conn,
                reason: "agents only talk to replicas and to their own cluster's relay".into(),
            });
            return out;
        }
        // Two agents talk only as a node agent and its relay (decided at the hello).
        let (ae, hb) = if !self.local.is_replica() && !peer.is_replica() {
            (
                self.config.node_anti_entropy_interval,
                self.config.node_heartbeat_interval,
            )
        } else {
            (
                self.config.anti_entropy_interval,
                self.config.heartbeat_interval,
            )
        };
        let first_ae = self.jittered(ae);
        let peer_is_replica = peer.is_replica();
        self.sessions.insert(
            conn,
            Session {
                identity: peer,
                hello_received: false,
                docs: HashMap::new(),
                next_anti_entropy: now + first_ae,
                next_heartbeat: now + hb,
                next_peer_exchange: now + self.config.peer_exchange_interval,
                heartbeat_out: 0,
                heartbeat_in: 0,
                frames_in: 0,
                frames_out: 0,
                peer_processed: None,
                repairs_sent: 0,
                left_to_peer: HashMap::new(),
                last_heard: now,
                docs_behind: 0,
                digest_matched: false,
                refused: None,
                refusals_sent: HashMap::new(),
                advertise_addr: None,
                reached: BTreeSet::new(),
                relay: false,
                scope: None,
                peer_version: None,
                features: BTreeSet::new(),
                version_refused: false,
                anti_entropy_interval: ae,
                heartbeat_interval: hb,
                timer: None,
                carrier_grace_until: (self.local.is_replica() && peer_is_replica)
                    .then(|| now + self.config.carrier_grace),
            },
        );
        let mut hello = pb::Hello {
            role: role_of(&self.local) as i32,
            identity: self.local.uri(),
            advertise_addr: self.config.advertise_addr.clone().unwrap_or_default(),
            relay: self.relay,
            ..Default::default()
        };
        version::announce(&mut hello);
        self.send(&mut out, conn, Body::Hello(hello));
        out
    }

    /// The connection is gone; its sync states are remembered for a reconnect.
    pub fn on_disconnected(&mut self, conn: ConnId) {
        self.delayed.retain(|(c, _), _| *c != conn);
        let Some(session) = self.sessions.remove(&conn) else {
            return;
        };
        if session.version_refused {
            self.closing.retain(|(_, c)| *c != conn);
        }
        if session.hello_received && session.relay {
            self.relay_sessions -= 1;
        }
        if let Some(at) = session.timer {
            self.timers.remove(&(at, conn));
        }
        match &session.scope {
            Some(Scope::Doc(d)) => {
                if let Some(conns) = self.by_doc.get_mut(d) {
                    conns.retain(|c| *c != conn);
                    if conns.is_empty() {
                        self.by_doc.remove(d);
                    }
                }
            }
            Some(_) => {
                self.wide.remove(&conn);
            }
            None => {}
        }
        if self.saved_states.len() + session.docs.len() > MAX_SAVED_STATES {
            self.saved_states.clear();
        }
        for (doc, mut ds) in session.docs {
            ds.state.reset();
            self.saved_states
                .insert((session.identity.clone(), doc), (ds.generation, ds.state));
        }
    }

    /// The driver dropped `envelope`, one of this protocol's outputs for `conn` (its queue was
    /// full, or what it acknowledged could not be made durable): when it was a sync message,
    /// that document's exchange forgets what was in flight, so the next message or anti-entropy
    /// round re-sends what the peer missed. Only that document: resetting every document of a
    /// session on each dropped frame made a replica sending a hundred thousand documents to a
    /// new peer start them all over, again and again. Other frames (digests, entries) are
    /// repeated by the next anti-entropy round anyway.
    pub fn on_dropped(&mut self, conn: ConnId, envelope: &pb::Envelope) {
        self.counters.backpressure_events += 1;
        if let Some(s) = self.sessions.get_mut(&conn) {
            // It never reaches the peer, so the peer's count of handled frames never will.
            s.frames_out = s.frames_out.saturating_sub(1);
        }
        let Some(Body::Sync(sync)) = &envelope.body else {
            return;
        };
        let Some(doc) = wire::doc_from_wire(sync.doc.as_ref()) else {
            return;
        };
        if let Some(ds) = self
            .sessions
            .get_mut(&conn)
            .and_then(|s| s.docs.get_mut(&doc))
        {
            ds.state.reset();
            // The dropped frame may have carried a signer chain the peer now lacks.
            ds.signer_sent = None;
        }
    }

    /// The digest of what `conn`'s session exchanges (empty before its hello).
    fn scoped_digest<S: DocStore>(&self, store: &S, conn: ConnId) -> Digest {
        match self.sessions.get(&conn).and_then(|s| s.scope.as_ref()) {
            Some(Scope::All) => store.digest(),
            Some(Scope::Cluster(c)) => store.cluster_digest(c),
            Some(Scope::Doc(doc)) => Digest::from_entries(store.entry(doc).iter()),
            None => Digest::empty(),
        }
    }

    /// The entries in `buckets` of what `conn`'s session repairs, with their bucket, ordered
    /// by bucket: its scope without the documents `left` to carriers (counted in
    /// [`Counters::repairs_left_to_writers`]), which are never copied.
    fn repair_entries<S: DocStore>(
        &mut self,
        store: &S,
        conn: ConnId,
        buckets: &[u32],
        left: &LeftToCarriers,
    ) -> Vec<(u32, DocEntry)> {
        let skipped = std::cell::Cell::new(0u64);
        let keep = |d: &DocId| {
            let left_out = left.contains(d);
            skipped.set(skipped.get() + u64::from(left_out));
            !left_out
        };
        let entries = match self.sessions.get(&conn).and_then(|s| s.scope.as_ref()) {
            Some(Scope::All) => store.bucket_entries(buckets, &keep),
            Some(Scope::Cluster(c)) => store.cluster_bucket_entries(c, buckets, &keep),
            Some(Scope::Doc(doc)) => store
                .entry(doc)
                .map(|e| (e.doc.bucket(), e))
                .filter(|(b, e)| buckets.contains(b) && keep(&e.doc))
                .into_iter()
                .collect(),
            None => Vec::new(),
        };
        self.counters.repairs_left_to_writers += skipped.get();
        entries
    }

    fn doc_state<'a>(
        saved: &mut HashMap<(PeerIdentity, DocId), (u64, SyncState)>,
        session: &'a mut Session,
        doc: &DocId,
        generation: u64,
    ) -> &'a mut SyncState {
        let ds = session.docs.entry(doc.clone()).or_insert_with(|| {
            session.left_to_peer.remove(doc);
            let state = match saved.remove(&(session.identity.clone(), doc.clone())) {
                Some((g, state)) if g == generation => state,
                _ => SyncState::new(),
            };
            DocSync {
                generation,
                state,
                signer_sent: None,
                signer_seen: None,
                progress: 0,
                suspect: None,
            }
        });
        if ds.generation != generation {
            ds.generation = generation;
            ds.state = SyncState::new();
            ds.suspect = None;
        }
        &mut ds.state
    }

    /// Generates and queues the next sync message for `doc` on `conn`, if any (deferred to
    /// [`Protocol::flush_pushes`] when coalescing, unless it is a reset).
    fn push_doc<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        doc: &DocId,
        reset: bool,
        out: &mut Vec<Output>,
    ) {
        if self.coalesce && !reset {
            if self.sessions.contains_key(&conn) {
                self.deferred.insert((conn, doc.clone()));
            }
            return;
        }
        self.push_doc_now(store, conn, doc, reset, out);
    }

    fn push_doc_now<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        doc: &DocId,
        reset: bool,
        out: &mut Vec<Output>,
    ) {
        let Some(entry) = store.entry(doc) else {
            return;
        };
        let Some(session) = self.sessions.get_mut(&conn) else {
            return;
        };
        if !session.hello_received || !session.covers(doc) {
            return;
        }
        let state = Self::doc_state(&mut self.saved_states, session, doc, entry.generation);
        if reset {
            state.reset();
            self.counters.sync_resets += 1;
        }
        if let Some((payload, signed)) = store.generate_sync_message(doc, state) {
            let mut signed: Option<pb::SignedHeads> = signed.as_ref().map(Into::into);
            if let Some(ds) = session.docs.get_mut(doc) {
                ds.progress += 1;
                if let Some(s) = signed.as_mut() {
                    let hash: [u8; 32] = Sha256::digest(&s.signer).into();
                    if ds.signer_sent == Some(hash) {
                        s.signer = Vec::new();
                        s.signer_sha256 = hash.to_vec();
                    } else {
                        ds.signer_sent = Some(hash);
                    }
                }
            }
            self.send(
                out,
                conn,
                Body::Sync(pb::Sync {
                    doc: Some(doc.into()),
                    generation: entry.generation,
                    payload,
                    signed,
                }),
            );
        }
    }

    /// A local writer changed `doc`: offer it to every connected peer that may hold it.
    pub fn on_local_change<S: DocStore>(&mut self, store: &mut S, doc: &DocId) -> Vec<Output> {
        let mut out = Vec::new();
        if !self.config.push {
            return out;
        }
        for conn in self.covering(doc) {
            self.push_doc(store, conn, doc, false, &mut out);
        }
        out
    }

    /// Periodic work: due relays and answers, digest probes, heartbeats, peer exchange.
    pub fn on_tick<S: DocStore>(&mut self, store: &mut S, now: Instant) -> Vec<Output> {
        let mut out = Vec::new();
        while let Some(&(at, conn)) = self.closing.first()
            && at <= now
        {
            self.closing.pop_first();
            out.push(Output::Close {
                conn,
                reason: "protocol version refused".into(),
            });
        }
        let due: Vec<(ConnId, DocId)> = self
            .delayed
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for (conn, doc) in due {
            self.delayed.remove(&(conn, doc.clone()));
            self.push_doc(store, conn, &doc, false, &mut out);
        }
        if std::mem::take(&mut self.announce)
            && self.local.is_replica()
            && self.config.peer_exchange
        {
            // Makes the exchange due on every session now (their timers run from here).
            self.make_due(|_| true, |s| s.next_peer_exchange = now);
        }
        // What each heartbeat of an agent tells: the replicas it reaches (the same for every
        // session of this tick).
        let mut reached: Option<Vec<String>> = None;
        let mut conns = Vec::new();
        while let Some(&(at, conn)) = self.timers.first()
            && at <= now
        {
            self.timers.pop_first();
            if let Some(s) = self.sessions.get_mut(&conn) {
                s.timer = None;
            }
            conns.push(conn);
        }
        for &conn in &conns {
            let (due_ae, due_hb, due_pex) = match self.sessions.get(&conn) {
                Some(s) if s.hello_received => (
                    now >= s.next_anti_entropy,
                    now >= s.next_heartbeat,
                    now >= s.next_peer_exchange,
                ),
                _ => continue,
            };
            let pending = self
                .sessions
                .get(&conn)
                .is_some_and(Session::repairs_pending);
            if due_ae && self.config.anti_entropy && pending {
                // Our last round's messages are still queued at the peer (or on their way): a
                // round now would list and repair the same documents again. A healing
                // replica's relays repeated rounds every 2 s for ~14 s, each generating a sync
                // message per differing document. Rounds resume once the peer's heartbeat says
                // it has handled them.
                self.counters.rounds_deferred += 1;
            } else if due_ae && self.config.anti_entropy {
                let root = self.scoped_digest(store, conn).root();
                self.counters.digest_probes_sent += 1;
                self.send(
                    &mut out,
                    conn,
                    Body::Digest(pb::Digest {
                        root,
                        buckets: vec![],
                    }),
                );
                let interval = self
                    .sessions
                    .get(&conn)
                    .map_or(self.config.anti_entropy_interval, |s| {
                        s.anti_entropy_interval
                    });
                let next = now + self.jittered(interval);
                if let Some(s) = self.sessions.get_mut(&conn) {
                    s.next_anti_entropy = next;
                }
            }
            if due_hb {
                let own_docs = match &self.local {
                    PeerIdentity::Agent { cluster, node } => store
                        .entry(&DocId::new(cluster.clone(), node.clone()))
                        .iter()
                        .map(pb::DocEntry::from)
                        .collect(),
                    PeerIdentity::Replica { .. } => vec![],
                };
                let (sequence, frames_processed) = match self.sessions.get_mut(&conn) {
                    Some(s) => {
                        s.heartbeat_out += 1;
                        s.next_heartbeat = now + s.heartbeat_interval;
                        (s.heartbeat_out, s.frames_in)
                    }
                    None => continue,
                };
                let reached_replicas = if self.local.is_replica() {
                    vec![]
                } else {
                    reached
                        .get_or_insert_with(|| {
                            self.sessions
                                .values()
                                .filter(|s| s.hello_received && s.identity.is_replica())
                                .map(|s| s.identity.uri())
                                .take(MAX_PEER_EXCHANGE)
                                .collect()
                        })
                        .clone()
                };
                let body = Body::Ephemeral(pb::Ephemeral {
                    sender: self.local.uri(),
                    sequence,
                    own_docs,
                    reached_replicas,
                    frames_processed,
                });
                self.send(&mut out, conn, body);
            }
            if due_pex && self.local.is_replica() && self.config.peer_exchange {
                if let Some(s) = self.sessions.get_mut(&conn) {
                    s.next_peer_exchange = now + self.config.peer_exchange_interval;
                }
                let body = Body::PeerExchange(self.peer_exchange());
                self.send(&mut out, conn, body);
            }
        }
        for conn in conns {
            self.schedule(conn);
        }
        out
    }

    /// Moves a timer (`set`) of every session past its hello that `which` selects, and requeues
    /// those sessions.
    fn make_due(&mut self, which: impl Fn(&Session) -> bool, set: impl Fn(&mut Session)) {
        let conns: Vec<ConnId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.hello_received && which(s))
            .map(|(c, _)| *c)
            .collect();
        for conn in conns {
            if let Some(s) = self.sessions.get_mut(&conn) {
                set(s);
            }
            self.schedule(conn);
        }
    }

    /// (Re)queues session `conn` in [`Protocol::timers`] at its earliest timer that is on.
    fn schedule(&mut self, conn: ConnId) {
        let (anti_entropy, peer_exchange) = (
            self.config.anti_entropy,
            self.local.is_replica() && self.config.peer_exchange,
        );
        let Some(s) = self.sessions.get_mut(&conn) else {
            return;
        };
        if !s.hello_received {
            return;
        }
        let mut at = s.next_heartbeat;
        if anti_entropy {
            at = at.min(s.next_anti_entropy);
        }
        if peer_exchange {
            at = at.min(s.next_peer_exchange);
        }
        if let Some(old) = s.timer.replace(at) {
            self.timers.remove(&(old, conn));
        }
        self.timers.insert((at, conn));
    }

    fn peer_exchange(&self) -> pb::PeerExchange {
        let mut replicas: Vec<pb::KnownReplica> = self
            .known_replicas
            .iter()
            .map(|(identity, addr)| pb::KnownReplica {
                identity: identity.clone(),
                addr: addr.clone(),
            })
            .collect();
        if let Some(addr) = &self.config.advertise_addr {
            replicas.push(pb::KnownReplica {
                identity: self.local.uri(),
                addr: addr.clone(),
            });
        }
        replicas.truncate(MAX_PEER_EXCHANGE);
        pb::PeerExchange { replicas }
    }

    fn protocol_error(&mut self, out: &mut Vec<Output>, conn: ConnId, reason: String) {
        self.counters.protocol_errors += 1;
        warn!(conn = conn.0, %reason, "mesh protocol violation, closing");
        out.push(Output::Close { conn, reason });
    }

    fn unauthorized(&mut self, peer: &PeerIdentity, what: &str, doc: &DocId) {
        self.counters.rejected_unauthorized += 1;
        warn!(%peer, %doc, what, "refused: peer may not exchange this document");
    }

    /// Handles one decoded frame from `conn`.
    pub fn handle_frame<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        envelope: pb::Envelope,
        now: Instant,
    ) -> Vec<Output> {
        let mut out = Vec::new();
        let Some(session) = self.sessions.get_mut(&conn) else {
            return out;
        };
        session.last_heard = now;
        session.frames_in += 1;
        let hello_received = session.hello_received;
        let version_refused = session.version_refused;
        let peer = session.identity.clone();
        self.counters.frames_in += 1;
        if version_refused {
            // Only the peer's own refusal means anything now (it closes the connection).
            if let Some(Body::Refusal(r)) = envelope.body
                && r.code == pb::RefusalCode::Version as i32
            {
                self.on_version_refusal(conn, &peer, &r, now, &mut out);
            }
            return out;
        }
        if envelope.version != WIRE_VERSION {
            // The envelope version moves with the major protocol version: a peer of another
            // major is refused like one announcing it in its hello.
            if matches!(envelope.body, Some(Body::Hello(_))) && !hello_received {
                let reason = format!(
                    "peer sends envelope version {} ({}), this node speaks envelope version {WIRE_VERSION} ({})",
                    envelope.version,
                    match &envelope.body {
                        Some(Body::Hello(h)) =>
                            version::read(h).map_or_else(|e| e, |v| v.to_string()),
                        _ => String::new(),
                    },
                    version::SOFTWARE,
                );
                self.refuse_version(conn, &peer, reason, now, &mut out);
            } else {
                self.protocol_error(
                    &mut out,
                    conn,
                    format!("envelope version {} not supported", envelope.version),
                );
            }
            return out;
        }
        let Some(body) = envelope.body else {
            self.protocol_error(&mut out, conn, "envelope without body".into());
            return out;
        };
        if !hello_received && !matches!(body, Body::Hello(_)) {
            self.protocol_error(&mut out, conn, "frame before Hello".into());
            return out;
        }
        match body {
            Body::Hello(_) if hello_received => {
                self.protocol_error(&mut out, conn, "duplicate Hello".into());
            }
            Body::Hello(h) => self.on_hello(store, conn, &peer, h, now, &mut out),
            Body::Digest(d) => self.on_digest(store, conn, d, now, &mut out),
            Body::BucketRequest(r) => {
                let Some(buckets) = self.check_buckets(&mut out, conn, &r.buckets) else {
                    return out;
                };
                let mine = self.on_entries(store, conn, &peer, &buckets, &r.entries, now, &mut out);
                self.send_entries(store, &mut out, conn, &buckets, &mine, false);
            }
            Body::BucketEntries(e) => {
                let Some(buckets) = self.check_buckets(&mut out, conn, &e.buckets) else {
                    return out;
                };
                self.on_entries(store, conn, &peer, &buckets, &e.entries, now, &mut out);
            }
            Body::Sync(s) => self.on_sync(store, conn, &peer, s, now, &mut out),
            Body::Refusal(r) => self.on_refusal(store, conn, &peer, r, now, &mut out),
            Body::Ephemeral(e) => self.on_ephemeral(store, conn, &peer, e),
            Body::PeerExchange(p) => {
                if !peer.is_replica() {
                    self.counters.rejected_unauthorized += 1;
                    warn!(%peer, "refused PeerExchange from an agent");
                    return out;
                }
                if !self.config.peer_exchange {
                    return out;
                }
                for r in p.replicas.iter().take(MAX_PEER_EXCHANGE) {
                    self.learn_replica(&r.identity, &r.addr);
                }
            }
        }
        out
    }

    fn learn_replica(&mut self, identity: &str, addr: &str) {
        if addr.is_empty() || addr.len() > MAX_ADDR_LEN {
            return;
        }
        match PeerIdentity::parse_uri(identity) {
            Ok(id) if id.is_replica() && id != self.local => {
                if self.known_replicas.get(identity).map(String::as_str) != Some(addr) {
                    debug!(%identity, %addr, "learned replica");
                    self.known_replicas
                        .insert(identity.to_owned(), addr.to_owned());
                    // A new replica starts empty, and the relays carry most of the fleet's
                    // documents: waiting for the periodic exchange (10 s) before they dial it
                    // was most of a new replica's first 15 s.
                    self.announce = true;
                }
            }
            Ok(_) => {}
            Err(e) => {
                self.counters.protocol_errors += 1;
                debug!(error = %e, "ignoring malformed replica identity in PeerExchange");
            }
        }
    }

    fn on_hello<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        peer: &PeerIdentity,
        h: pb::Hello,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let announced = match version::read(&h) {
            Ok(v) => v,
            Err(reason) => {
                self.protocol_error(out, conn, reason);
                return;
            }
        };
        let features = match version::admit(&announced) {
            Ok(features) => features,
            Err(mismatch) => {
                self.refuse_version(conn, peer, mismatch.to_string(), now, out);
                return;
            }
        };
        if h.role != role_of(peer) as i32 || h.identity != peer.uri() {
            self.protocol_error(
                out,
                conn,
                format!(
                    "Hello claims {} (role {}) but the certificate says {peer}",
                    h.identity, h.role
                ),
            );
            return;
        }
        let scope = match Scope::of_session(&self.local, self.relay, peer, h.relay) {
            Ok(scope) => scope,
            Err(reason) => {
                self.counters.rejected_unauthorized += 1;
                warn!(%peer, %reason, "refusing session");
                out.push(Output::Close { conn, reason });
                return;
            }
        };
        let advertise = (!h.advertise_addr.is_empty()).then_some(h.advertise_addr);
        match &scope {
            Scope::Doc(d) => self.by_doc.entry(d.clone()).or_default().push(conn),
            Scope::All | Scope::Cluster(_) => {
                self.wide.insert(conn);
            }
        }
        if let Some(s) = self.sessions.get_mut(&conn) {
            if h.relay && !(s.hello_received && s.relay) {
                self.relay_sessions += 1;
            }
            s.hello_received = true;
            s.advertise_addr = advertise.clone();
            s.relay = h.relay;
            s.scope = Some(scope);
            if announced.minor != version::PROTOCOL_MINOR {
                // Debug: during a rolling upgrade every session is one (thousands on a relay).
                debug!(%peer, peer_version = %announced, "session with a peer of an adjacent protocol version");
            }
            s.peer_version = Some(announced);
            s.features = features;
        }
        self.schedule(conn);
        if !self.local.is_replica() && peer.is_replica() {
            // Every replica this agent reaches hears so at the next tick, not a heartbeat
            // interval later: until then a replica relays the agent's changes to the others
            // (after a healed partition, the thousands the agent repairs first).
            self.make_due(|s| s.identity.is_replica(), |s| s.next_heartbeat = now);
        }
        if peer.is_replica()
            && let Some(addr) = &advertise
        {
            self.learn_replica(&peer.uri(), addr);
        }
        // Catch up at once instead of waiting for the first timer.
        if self.config.anti_entropy {
            let root = self.scoped_digest(store, conn).root();
            self.counters.digest_probes_sent += 1;
            self.send(
                out,
                conn,
                Body::Digest(pb::Digest {
                    root,
                    buckets: vec![],
                }),
            );
        }
        if self.local.is_replica() && self.config.peer_exchange {
            let body = Body::PeerExchange(self.peer_exchange());
            self.send(out, conn, body);
        }
    }

    fn on_digest<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        d: pb::Digest,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        // The root compares the whole scope (what `digest_matched` means); the buckets of the
        // answer and the repair compare it without the documents left to carriers.
        let root = self.scoped_digest(store, conn).root();
        if d.root == root
            && let Some(s) = self.sessions.get_mut(&conn)
        {
            s.digest_matched = true;
        }
        if d.buckets.is_empty() {
            if d.root != root {
                self.counters.digest_mismatches += 1;
                if self
                    .sessions
                    .get(&conn)
                    .is_some_and(Session::repairs_pending)
                {
                    // The peer's round would repeat ours, still queued at the peer: answer
                    // its next probe instead (see `on_tick`).
                    self.counters.rounds_deferred += 1;
                    return;
                }
                let left = self.carriers_reaching(conn, now);
                let mine = self.repair_digest(store, conn, &left);
                self.send(
                    out,
                    conn,
                    Body::Digest(pb::Digest {
                        root,
                        buckets: mine.buckets().to_vec(),
                    }),
                );
            }
            return;
        }
        let left = self.carriers_reaching(conn, now);
        let mine = self.repair_digest(store, conn, &left);
        let Some(theirs) = Digest::from_buckets(d.buckets) else {
            self.protocol_error(
                out,
                conn,
                format!("digest must have {DIGEST_BUCKETS} buckets"),
            );
            return;
        };
        let differing = mine.differing_buckets(&theirs);
        if differing.is_empty() {
            return;
        }
        self.counters.buckets_requested += differing.len() as u64;
        // Frames of whole buckets, each at most `max_entries_per_frame` entries unless one
        // bucket alone has more.
        let entries = self.repair_entries(store, conn, &differing, &left);
        let mut chunk_buckets: Vec<u32> = Vec::new();
        let mut chunk_entries: Vec<DocEntry> = Vec::new();
        let mut rest = entries.as_slice();
        for b in differing {
            let n = rest.iter().take_while(|(eb, _)| *eb == b).count();
            let (bucket, tail) = rest.split_at(n);
            rest = tail;
            if !chunk_buckets.is_empty()
                && chunk_entries.len() + n > self.config.max_entries_per_frame
            {
                self.send_entries(store, out, conn, &chunk_buckets, &chunk_entries, true);
                chunk_buckets.clear();
                chunk_entries.clear();
            }
            chunk_buckets.push(b);
            chunk_entries.extend(bucket.iter().map(|(_, e)| e.clone()));
        }
        self.send_entries(store, out, conn, &chunk_buckets, &chunk_entries, true);
    }

    /// Sends `entries` of `buckets` as a `BucketRequest` (or, answering one, `BucketEntries`),
    /// each with its heads when it has at most [`wire::MAX_ENTRY_HEADS`] of them.
    ///
    /// Sync messages deferred for `conn` go first. The peer decides from these frames which
    /// documents still differ and restarts the sync of those whose exchange made no progress;
    /// an answer we generated before, but queued behind them, would reach it only after that
    /// decision, and the restart would send us the same message again.
    fn send_entries<S: DocStore>(
        &mut self,
        store: &mut S,
        out: &mut Vec<Output>,
        conn: ConnId,
        buckets: &[u32],
        entries: &[DocEntry],
        request: bool,
    ) {
        self.flush_conn(store, conn, out);
        let limit = self.config.max_entries_per_frame;
        if entries.len() > limit {
            warn!(
                entries = entries.len(),
                limit,
                "bucket entries exceed the per-frame limit; the excess waits for a later round"
            );
        }
        let mut entries: Vec<pb::DocEntry> = entries
            .iter()
            .take(limit)
            .map(|e| {
                let mut w = pb::DocEntry::from(e);
                let heads = store.heads(&e.doc);
                if heads.len() <= wire::MAX_ENTRY_HEADS {
                    w.heads = heads.iter().map(|h| h.to_vec()).collect();
                }
                w
            })
            .collect();
        // Heads are a hint: a frame they would take past the limit goes without them.
        let size: usize = entries.iter().map(prost::Message::encoded_len).sum();
        if size + buckets.len() * 8 + 1024 > wire::MAX_FRAME_SIZE {
            for e in &mut entries {
                e.heads.clear();
            }
        }
        let buckets = buckets.to_vec();
        let body = if request {
            Body::BucketRequest(pb::BucketRequest { buckets, entries })
        } else {
            Body::BucketEntries(pb::BucketEntries { buckets, entries })
        };
        self.send(out, conn, body);
    }

    fn check_buckets(
        &mut self,
        out: &mut Vec<Output>,
        conn: ConnId,
        buckets: &[u32],
    ) -> Option<Vec<u32>> {
        if buckets.len() > DIGEST_BUCKETS as usize || buckets.iter().any(|b| *b >= DIGEST_BUCKETS) {
            self.protocol_error(out, conn, "bucket index out of range".into());
            return None;
        }
        Some(buckets.to_vec())
    }

    /// The peer's entries of `buckets` arrived (a `BucketRequest` or `BucketEntries`): starts
    /// the repairs of the documents that differ and returns ours, what a request is answered
    /// with.
    #[allow(clippy::too_many_arguments)]
    fn on_entries<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        peer: &PeerIdentity,
        buckets: &[u32],
        entries: &[pb::DocEntry],
        now: Instant,
        out: &mut Vec<Output>,
    ) -> Vec<DocEntry> {
        let left = self.carriers_reaching(conn, now);
        let mut theirs = self.scoped_wire_entries(conn, peer, entries, buckets);
        theirs.retain(|(e, _)| !left.contains(&e.doc));
        let mine: Vec<DocEntry> = self
            .repair_entries(store, conn, buckets, &left)
            .into_iter()
            .map(|(_, e)| e)
            .collect();
        self.push_differences(store, conn, &mine, &theirs, now, out);
        mine
    }

    /// Received entries that are valid, in one of `buckets`, and within the session's scope,
    /// each with the wire entry it came from (whose heads are checked only where they matter,
    /// in [`Protocol::push_differences`]).
    fn scoped_wire_entries<'a>(
        &mut self,
        conn: ConnId,
        peer: &PeerIdentity,
        entries: &'a [pb::DocEntry],
        buckets: &[u32],
    ) -> Vec<(DocEntry, &'a pb::DocEntry)> {
        let mut kept = Vec::with_capacity(entries.len());
        for e in entries {
            let Some(entry) = wire::entry_from_wire(e) else {
                self.counters.protocol_errors += 1;
                continue;
            };
            if !self
                .sessions
                .get(&conn)
                .is_some_and(|s| s.covers(&entry.doc))
            {
                self.unauthorized(peer, "bucket entry", &entry.doc);
                continue;
            }
            if buckets.contains(&entry.doc.bucket()) {
                kept.push((entry, e));
            }
        }
        kept
    }

    /// Starts the sync of each of `mine` that differs from the peer's entry in `theirs`, up to
    /// [`ProtocolConfig::max_repairs_per_round`].
    ///
    /// Where the session has exchanged nothing about the document yet (the first round after a
    /// connect, as when a partition heals) and the peer listed its heads, only the side ahead
    /// starts: if we hold those heads, our first message carries every change after them
    /// (the peer's opening message, which would only have told us so, is skipped); if the peer
    /// holds changes we lack, we leave the document to it for 0.75 anti-entropy intervals
    /// (`Session::left_to_peer`). Per document that is the changes and their acknowledgement,
    /// where opening from the side behind took three messages and opening from both ends
    /// crossed two first messages. Later in a session our state may hold the message the peer
    /// awaits, so there both ends start it as before.
    fn push_differences<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        mine: &[DocEntry],
        theirs: &[(DocEntry, &pb::DocEntry)],
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let theirs: HashMap<&DocId, (&DocEntry, &pb::DocEntry)> =
            theirs.iter().map(|(e, raw)| (&e.doc, (e, *raw))).collect();
        let mut repairs = 0;
        for entry in mine {
            let their = theirs.get(&entry.doc).copied();
            if !entry.should_push_to(their.map(|(e, _)| e)) {
                continue;
            }
            let mut ahead = None;
            if let Some((e, raw)) = their
                && let Some(session) = self.sessions.get_mut(&conn)
                && !session.docs.contains_key(&entry.doc)
                && let heads = wire::heads_from_wire(raw, e)
                && !heads.is_empty()
            {
                if store.holds_changes(&entry.doc, e.generation, &heads) {
                    ahead = Some(heads);
                } else if e.generation == entry.generation {
                    // The peer holds changes we lack: one writer per document makes it the
                    // side ahead, and it sends them. Should it not within 3/4 of an
                    // anti-entropy interval (both lack changes, or its message was lost), a
                    // later round starts the sync here.
                    let min_age = session.anti_entropy_interval.mul_f64(0.75);
                    let since = *session.left_to_peer.entry(entry.doc.clone()).or_insert(now);
                    if now.saturating_duration_since(since) < min_age {
                        if since == now {
                            self.counters.repairs_left_to_peer += 1;
                        }
                        continue;
                    }
                    session.left_to_peer.remove(&entry.doc);
                }
            }
            if repairs == self.config.max_repairs_per_round {
                // The next rounds find the rest still differing.
                break;
            }
            repairs += 1;
            if let Some(heads) = ahead
                && let Some(session) = self.sessions.get_mut(&conn)
            {
                Self::doc_state(
                    &mut self.saved_states,
                    session,
                    &entry.doc,
                    entry.generation,
                )
                .assume_peer_holds(&heads);
                self.counters.repairs_from_listed_heads += 1;
            }
            self.repair_doc(store, conn, &entry.doc, now, out);
        }
        if repairs > 0
            && let Some(s) = self.sessions.get_mut(&conn)
        {
            s.repairs_sent = s.frames_out;
        }
    }

    /// The documents of the agents (writers, or relays carrying their cluster) that have a
    /// session with us and reported reaching the replica on `conn` too (nothing unless both
    /// ends are replicas). Between two replicas such a document differs mostly because the
    /// agent's latest changes are still on their way to one of them, and the agent's own sync
    /// and anti-entropy with each replica repair anything lost; comparing and repairing it
    /// replica-to-replica as well would, under a steady update stream, exchange the entries of
    /// every changing document and resend its changes on each anti-entropy round (with a
    /// hundred thousand per-node documents, megabytes per round). During the session's
    /// [`ProtocolConfig::carrier_grace`] every member cluster is left to its carriers.
    fn carriers_reaching(&self, conn: ConnId, now: Instant) -> LeftToCarriers {
        let mut left = LeftToCarriers::default();
        let Some(session) = self.sessions.get(&conn) else {
            return left;
        };
        let peer = &session.identity;
        if !self.local.is_replica() || !peer.is_replica() {
            return left;
        }
        if session.carrier_grace_until.is_some_and(|until| now < until) {
            left.all_clusters = true;
            return left;
        }
        for s in self.sessions.values() {
            if !s.hello_received || !s.reached.contains(peer) {
                continue;
            }
            match &s.scope {
                Some(Scope::Cluster(c)) => {
                    left.clusters.insert(c.clone());
                }
                Some(Scope::Doc(d)) => {
                    left.docs.insert(d.clone());
                }
                Some(Scope::All) | None => {}
            }
        }
        left.docs.retain(|d| !left.clusters.contains(&d.cluster));
        left
    }

    /// What a repair on `conn` compares bucket by bucket: the session's scope without the
    /// documents `left` to carriers (see [`Protocol::carriers_reaching`]).
    fn repair_digest<S: DocStore>(&self, store: &S, conn: ConnId, left: &LeftToCarriers) -> Digest {
        if left.all_clusters {
            // Only two replicas leave every cluster, and their scope is everything.
            let mut d = Digest::empty();
            for scope in REPLICA_SCOPES {
                d.xor_with(&store.cluster_digest(scope));
            }
            return d;
        }
        let mut d = self.scoped_digest(store, conn);
        for c in &left.clusters {
            d.xor_with(&store.cluster_digest(c));
        }
        for doc in &left.docs {
            if let Some(e) = store.entry(doc) {
                d.toggle(&e);
            }
        }
        d
    }

    /// Anti-entropy found `doc` differing on `conn`: continue its sync at once, and reset the
    /// sync state only when the difference persisted since an earlier mismatch at least 3/4 of
    /// an anti-entropy interval ago with no sync progress and no change of our heads since.
    ///
    /// Under a steady stream of updates digests differ while sync is merely in flight; a reset
    /// then makes automerge renegotiate from the shared heads (bloom filters, resent changes),
    /// which costs more bytes and time than the message it replaces.
    fn repair_doc<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        doc: &DocId,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let current = store.entry(doc);
        let Some(session) = self.sessions.get_mut(&conn) else {
            return;
        };
        let min_age = session.anti_entropy_interval.mul_f64(0.75);
        // (reset, the mismatch continues an earlier one)
        let (reset, continuing) = match session.docs.get(doc) {
            // Nothing exchanged yet on this session: the state is fresh anyway.
            None => (false, false),
            Some(ds) => match &ds.suspect {
                Some(s) if s.progress == ds.progress && s.entry == current => {
                    (now.saturating_duration_since(s.since) >= min_age, true)
                }
                _ => (false, false),
            },
        };
        self.push_doc_now(store, conn, doc, reset, out);
        let Some(ds) = self
            .sessions
            .get_mut(&conn)
            .and_then(|s| s.docs.get_mut(doc))
        else {
            return;
        };
        if reset {
            ds.suspect = None;
            return;
        }
        // Our own repair message is not progress: only an answer to it is.
        let since = match (&ds.suspect, continuing) {
            (Some(s), true) => s.since,
            _ => now,
        };
        ds.suspect = Some(Suspect {
            progress: ds.progress,
            entry: current,
            since,
        });
    }

    /// Marks the writer on `conn` as refused and tells it why, at most once per
    /// [`REFUSAL_INTERVAL`] per document.
    fn refuse_writer(
        &mut self,
        conn: ConnId,
        doc: &DocId,
        generation: u64,
        reason: &RejectReason,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let Some(session) = self.sessions.get_mut(&conn) else {
            return;
        };
        let text = bounded(&reason.to_string());
        session.refused = Some(text.clone());
        let due = session
            .refusals_sent
            .get(doc)
            .is_none_or(|t| now.saturating_duration_since(*t) >= REFUSAL_INTERVAL);
        if !due {
            return;
        }
        session.refusals_sent.insert(doc.clone(), now);
        self.counters.refusals_sent += 1;
        self.send(
            out,
            conn,
            Body::Refusal(pb::Refusal {
                doc: Some(doc.into()),
                generation,
                code: code_of(reason) as i32,
                reason: text,
            }),
        );
    }

    /// A replica refused this writer's own document: log it (rate-limited), and when the
    /// generation was refused as lying in the future and the store's clock now agrees, start
    /// a new generation and offer it to every peer.
    /// Whether a version refusal involving `peer` is to be logged now (at most once per
    /// [`REFUSAL_LOG_INTERVAL`] per peer, whichever side refused).
    fn version_log_due(&mut self, peer: &PeerIdentity, now: Instant) -> bool {
        let due = self
            .version_logged
            .get(peer)
            .is_none_or(|t| now.saturating_duration_since(*t) >= REFUSAL_LOG_INTERVAL);
        if due {
            if self.version_logged.len() >= MAX_VERSION_LOGGED {
                self.version_logged
                    .retain(|_, t| now.saturating_duration_since(*t) < REFUSAL_LOG_INTERVAL);
            }
            self.version_logged.insert(peer.clone(), now);
        }
        due
    }

    /// Refuses a session whose peer announced a version this node does not speak: sends the
    /// `Refusal` (code `VERSION`, `reason` naming both versions), ignores the peer from now on
    /// and closes the connection [`VERSION_REFUSAL_LINGER`] later, so the refusal gets there.
    fn refuse_version(
        &mut self,
        conn: ConnId,
        peer: &PeerIdentity,
        reason: String,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        self.counters.version_refusals_sent += 1;
        if self.version_log_due(peer, now) {
            warn!(%peer, %reason, "refusing a peer of an incompatible protocol version (logged at most once a minute per peer)");
        }
        let reason = bounded(&reason);
        if let Some(s) = self.sessions.get_mut(&conn) {
            s.version_refused = true;
        }
        self.send(
            out,
            conn,
            Body::Refusal(pb::Refusal {
                doc: None,
                generation: 0,
                code: pb::RefusalCode::Version as i32,
                reason,
            }),
        );
        self.closing.insert((now + VERSION_REFUSAL_LINGER, conn));
    }

    /// A peer refused this node's version: logged, counted, and the connection closed.
    fn on_version_refusal(
        &mut self,
        conn: ConnId,
        peer: &PeerIdentity,
        r: &pb::Refusal,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        self.counters.version_refusals_received += 1;
        let reason = bounded(&r.reason);
        if self.version_log_due(peer, now) {
            warn!(%peer, %reason, "a peer refuses this node's protocol version (logged at most once a minute per peer)");
        }
        out.push(Output::Close {
            conn,
            reason: format!("refused for its protocol version: {reason}"),
        });
    }

    fn on_refusal<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        peer: &PeerIdentity,
        r: pb::Refusal,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        if r.code == pb::RefusalCode::Version as i32 {
            self.on_version_refusal(conn, peer, &r, now, out);
            return;
        }
        let Some(doc) = wire::doc_from_wire(r.doc.as_ref()) else {
            self.counters.protocol_errors += 1;
            debug!(%peer, "ignoring a refusal with an invalid document id");
            return;
        };
        // Replicas and the cluster's relay store what a writer sends, so they may refuse it.
        let carrier = peer.is_replica() || self.sessions.get(&conn).is_some_and(|s| s.relay);
        if !carrier || !self.local.owns(&doc) {
            self.unauthorized(peer, "refusal", &doc);
            return;
        }
        self.counters.refusals_received += 1;
        let code = pb::RefusalCode::try_from(r.code).unwrap_or(pb::RefusalCode::Unspecified);
        let due = self
            .refusal_logged
            .get(&doc)
            .is_none_or(|t| now.saturating_duration_since(*t) >= REFUSAL_LOG_INTERVAL);
        if due {
            self.refusal_logged.insert(doc.clone(), now);
            warn!(
                %peer,
                %doc,
                generation = r.generation,
                code = code.as_str_name(),
                reason = %bounded(&r.reason),
                "a replica refuses this writer's changes (logged at most once a minute)"
            );
        }
        if code != pb::RefusalCode::FutureGeneration {
            return;
        }
        let Some(generation) = store.recover_generation(&doc) else {
            return;
        };
        self.counters.generation_recoveries += 1;
        info!(%doc, refused = r.generation, generation, "the clock agrees the refused generation lies in the future: started a new generation");
        let conns: Vec<ConnId> = self.sessions.keys().copied().collect();
        for conn in conns {
            self.push_doc(store, conn, &doc, false, out);
        }
    }

    /// The attestation of a received `Sync`, its signer chain taken from this session when the
    /// sender named it by hash (see [`DocSync::signer_sent`]).
    fn signed_from_session(
        w: &pb::SignedHeads,
        ds: Option<&mut DocSync>,
    ) -> Result<Attestation, String> {
        let mut a = wire::signed_from_wire(w)?;
        match ds {
            Some(ds) if w.signer.is_empty() && !w.signer_sha256.is_empty() => {
                let seen = ds
                    .signer_seen
                    .clone()
                    .filter(|c| Sha256::digest(c).as_slice() == w.signer_sha256.as_slice())
                    .ok_or("signer named by hash was not sent on this session")?;
                a.signer = seen;
            }
            Some(ds) => ds.signer_seen = Some(a.signer.clone()),
            None => {}
        }
        Ok(a)
    }

    fn on_sync<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        peer: &PeerIdentity,
        s: pb::Sync,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        self.counters.sync_in += 1;
        let Some(doc) = wire::doc_from_wire(s.doc.as_ref()) else {
            self.protocol_error(out, conn, "sync message with an invalid document id".into());
            return;
        };
        if !self.sessions.get(&conn).is_some_and(|s| s.covers(&doc)) {
            self.unauthorized(peer, "sync", &doc);
            return;
        }
        let before = store.entry(&doc);
        let Some(session) = self.sessions.get_mut(&conn) else {
            return;
        };
        // The document's session state holds the signer chain this session sent before.
        Self::doc_state(&mut self.saved_states, session, &doc, s.generation);
        let signed = match s.signed.as_ref().map(|w| {
            let ds = session.docs.get_mut(&doc);
            Self::signed_from_session(w, ds)
        }) {
            None => None,
            Some(Ok(a)) => Some(a),
            Some(Err(reason)) => {
                self.counters.rejected_bad_signature += 1;
                warn!(%peer, %doc, %reason, "unusable signed heads; sync message refused");
                return;
            }
        };
        let Some(session) = self.sessions.get_mut(&conn) else {
            return;
        };
        let state = Self::doc_state(&mut self.saved_states, session, &doc, s.generation);
        let received = store.receive_sync_message(
            peer,
            &doc,
            s.generation,
            state,
            &s.payload,
            signed.as_ref(),
        );
        if let Some(ds) = session.docs.get_mut(&doc) {
            ds.progress += 1;
        }
        match received {
            Ok(()) => {
                // What the peer asks for is resent, even if sent before (and lost or refused).
                if let Some(session) = self.sessions.get_mut(&conn) {
                    if peer.owns(&doc) {
                        session.refused = None;
                    }
                    if let Some(ds) = session.docs.get_mut(&doc) {
                        ds.state.resend_requested();
                    }
                }
            }
            Err(RejectReason::StaleGeneration { have, got }) => {
                self.counters.stale_generation += 1;
                debug!(%peer, %doc, have, got, "stale generation; offering ours");
                self.push_doc(store, conn, &doc, true, out);
                return;
            }
            Err(reason) => {
                if matches!(reason, RejectReason::BadSignature(_)) {
                    self.counters.rejected_bad_signature += 1;
                } else {
                    self.counters.rejected_by_store += 1;
                }
                if matches!(reason, RejectReason::Retired(_)) {
                    // Expected until every peer has applied the retirement: not worth a warning
                    // per message (the writer itself is told, rate-limited, below).
                    debug!(%peer, %doc, %reason, "store refused sync message");
                } else {
                    warn!(%peer, %doc, %reason, "store refused sync message");
                }
                if self.carries(&doc) && peer.owns(&doc) {
                    self.refuse_writer(conn, &doc, s.generation, &reason, now, out);
                }
                // The refused message may have left the sync state expecting an answer.
                if let Some(ds) = self
                    .sessions
                    .get_mut(&conn)
                    .and_then(|s| s.docs.get_mut(&doc))
                {
                    ds.state.reset();
                }
                return;
            }
        }
        let after = store.entry(&doc);
        let changed = after.is_some() && after != before;
        if let (true, Some(entry)) = (changed, &after) {
            self.counters.applied += 1;
            out.push(Output::Applied {
                doc: doc.clone(),
                generation: entry.generation,
                from: peer.clone(),
            });
        }
        // An agent delivers its own document or, as its cluster's relay, that cluster's: either
        // way it reports in its heartbeats which replicas it reaches itself.
        let from_agent = !peer.is_replica();
        // Continue the automerge sync exchange with the sender.
        if after.as_ref().is_some_and(|e| e.generation == s.generation) {
            if changed && from_agent && self.carries(&doc) && !self.config.ack_delay.is_zero() {
                self.delay_push(conn, &doc, now + self.config.ack_delay);
            } else {
                self.push_doc(store, conn, &doc, false, out);
            }
        } else {
            self.reply_without_doc(conn, &doc, s.generation, out);
        }
        // Replicas pass every applied change on; a relay passes on what its node agents send
        // (to the replicas: no other session of a relay covers a node's document).
        let passes_on = self.local.is_replica() || (self.relay && from_agent);
        if changed && passes_on && self.config.push {
            // Agents dial every replica they know and report in their heartbeats which ones
            // they reach: an agent's change is not relayed to those (anti-entropy repairs a
            // lost message), and by a replica to the others only after `relay_delay`, so one
            // exchange carries every change of that window. A change relayed to a replica by
            // another replica is passed on at once (its writer may reach only that one), and
            // so is what a relay forwards (its node agents reach no replica).
            let reached = self
                .sessions
                .get(&conn)
                .filter(|_| from_agent)
                .map(|s| &s.reached);
            // Only peers that may hold the document: with one session per agent, offering
            // every change to every session cost a deferred push per agent per change (a
            // fifth of a replica's protocol thread at 100 agents and 1,000 changes/s).
            let others: Vec<(ConnId, bool, bool)> = self
                .covering(&doc)
                .into_iter()
                .filter(|c| *c != conn)
                .filter_map(|c| {
                    let o = self.sessions.get(&c)?;
                    let agent_reaches = reached.is_some_and(|r| r.contains(&o.identity));
                    Some((c, o.identity.is_replica(), agent_reaches))
                })
                .collect();
            let delay = self.local.is_replica() && !self.config.relay_delay.is_zero();
            for (other, to_replica, agent_reaches) in others {
                if from_agent && to_replica && agent_reaches {
                    continue;
                }
                if from_agent && to_replica && delay {
                    self.delay_push(other, &doc, now + self.config.relay_delay);
                } else {
                    self.push_doc(store, other, &doc, false, out);
                }
            }
        }
    }

    /// Schedules a push of `doc` on `conn` for `at` (or keeps an earlier one), sent by
    /// [`Protocol::on_tick`].
    fn delay_push(&mut self, conn: ConnId, doc: &DocId, at: Instant) {
        self.delayed.entry((conn, doc.clone())).or_insert(at);
    }

    /// Answers a sync message for a document we do not hold yet (its first message carries
    /// only heads): an empty document's reply tells the sender to send every change.
    fn reply_without_doc(
        &mut self,
        conn: ConnId,
        doc: &DocId,
        generation: u64,
        out: &mut Vec<Output>,
    ) {
        let Some(session) = self.sessions.get_mut(&conn) else {
            return;
        };
        let state = Self::doc_state(&mut self.saved_states, session, doc, generation);
        if let Some(payload) = state.empty_doc_message() {
            self.send(
                out,
                conn,
                Body::Sync(pb::Sync {
                    doc: Some(doc.into()),
                    generation,
                    payload,
                    signed: None,
                }),
            );
        }
    }

    fn on_ephemeral<S: DocStore>(
        &mut self,
        store: &S,
        conn: ConnId,
        peer: &PeerIdentity,
        e: pb::Ephemeral,
    ) {
        if e.sender != peer.uri() {
            self.counters.protocol_errors += 1;
            return;
        }
        let mut behind = 0;
        for raw in &e.own_docs {
            let Some(entry) = wire::entry_from_wire(raw) else {
                self.counters.protocol_errors += 1;
                continue;
            };
            if !peer.owns(&entry.doc) {
                self.unauthorized(peer, "heartbeat doc", &entry.doc);
                continue;
            }
            if store.entry(&entry.doc).as_ref() != Some(&entry) {
                behind += 1;
            }
        }
        let mut reached = BTreeSet::new();
        if !peer.is_replica() {
            for uri in e.reached_replicas.iter().take(MAX_PEER_EXCHANGE) {
                match PeerIdentity::parse_uri(uri) {
                    Ok(id) if id.is_replica() => {
                        reached.insert(id);
                    }
                    _ => self.counters.protocol_errors += 1,
                }
            }
        }
        if let Some(s) = self.sessions.get_mut(&conn) {
            if e.sequence <= s.heartbeat_in {
                // Stale or replayed heartbeat.
                return;
            }
            s.heartbeat_in = e.sequence;
            s.docs_behind = behind;
            s.reached = reached;
            if e.frames_processed > 0 {
                // Never more than we sent: a peer cannot claim frames it never got.
                s.peer_processed = Some(e.frames_processed.min(s.frames_out));
            }
        }
    }
}
