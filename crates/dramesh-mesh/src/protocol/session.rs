//! Sessions: one per connection, from the hello to the close; who the peer is, what the
//! session exchanges ([`Scope`]), its [`Heartbeats`], and the [`SessionIndex`] that finds the
//! sessions of a document.
//!
//! Guarantees: nothing but `Hello` is handled before the peer's hello; the scope is fixed at
//! the hello by [`Scope::of_session`], and a peer it refuses is closed; a closed session's sync
//! states are kept (reset) for a reconnect; stale or replayed heartbeats are ignored, and a
//! peer cannot claim to have handled more frames than were sent to it.

use super::verify::SessionParked;
use super::{
    ConnId, MAX_ADDR_LEN, MAX_PEER_EXCHANGE, Output, Protocol, anti_entropy::Rounds,
    refusal::SessionRefusals, sync::DocSync, timers::SessionTimers,
};
use crate::identity::PeerIdentity;
use crate::store::DocStore;
use crate::version;
use crate::version::PeerVersion;
use crate::wire::{self, pb, pb::envelope::Body};
use dramesh_store::DocId;
use std::collections::{BTreeSet, HashMap};
use std::time::Instant;
use tracing::{debug, warn};

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

/// One connection's session: who the peer is and what it exchanges, its timers, its
/// anti-entropy rounds, and its per-document sync states (`docs`, each a [`DocSync`] of its
/// own: nothing in it is shared between documents).
pub(super) struct Session {
    pub(super) identity: PeerIdentity,
    pub(super) hello_received: bool,
    /// The sync state of each document exchanged on this session.
    pub(super) docs: HashMap<DocId, DocSync>,
    pub(super) timers: SessionTimers,
    pub(super) rounds: Rounds,
    pub(super) heartbeats: Heartbeats,
    pub(super) refusals: SessionRefusals,
    pub(super) advertise_addr: Option<String>,
    /// Whether the peer declared itself its cluster's relay in its hello.
    pub(super) relay: bool,
    /// What the session exchanges; `None` until the peer's hello.
    pub(super) scope: Option<Scope>,
    /// See [`SessionStatus::peer_version`](super::SessionStatus::peer_version).
    pub(super) peer_version: Option<PeerVersion>,
    /// See [`SessionStatus::features`](super::SessionStatus::features).
    pub(super) features: BTreeSet<String>,
    /// Received sync messages waiting for signature checks (see `verify`).
    pub(super) parked: SessionParked,
}

/// What a session's heartbeats carry each way: sequence numbers, when the peer was last heard
/// from, what it reported (documents behind, replicas reached), and how many frames each side
/// has handled (which paces anti-entropy rounds, see [`Session::repairs_pending`]).
pub(super) struct Heartbeats {
    pub(super) heartbeat_out: u64,
    pub(super) heartbeat_in: u64,
    pub(super) last_heard: Instant,
    pub(super) docs_behind: usize,
    /// Replicas the peer (an agent) reported a live session with in its last heartbeat.
    pub(super) reached: BTreeSet<PeerIdentity>,
    /// Frames handled from the peer on this session (told to it in heartbeats).
    pub(super) frames_in: u64,
    /// Frames queued to the peer on this session, less those the driver dropped.
    pub(super) frames_out: u64,
    /// How many of our frames the peer last reported having handled (`None` until a heartbeat
    /// says so; older peers never do).
    pub(super) peer_processed: Option<u64>,
}

/// The sessions after their hello, indexed by what they exchange: those exchanging more than
/// one document, and those exchanging one, by document. A relay or a replica may hold
/// thousands of one-document sessions, and every change would otherwise scan them all (see
/// [`Protocol::covering`]).
#[derive(Default)]
pub(super) struct SessionIndex {
    pub(super) wide: BTreeSet<ConnId>,
    pub(super) by_doc: HashMap<DocId, Vec<ConnId>>,
    /// Sessions with a relay.
    pub(super) relay_sessions: usize,
}

impl Session {
    /// Whether the peer has yet to handle the repairs of our last anti-entropy round: a new
    /// round would find the same documents differing and only repeat the work.
    pub(super) fn repairs_pending(&self) -> bool {
        self.heartbeats
            .peer_processed
            .is_some_and(|n| n < self.rounds.repairs_sent)
    }
}

impl Session {
    /// Whether the session exchanges `doc` (never before the peer's hello).
    pub(super) fn covers(&self, doc: &DocId) -> bool {
        self.scope.as_ref().is_some_and(|s| s.contains(doc))
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

pub(super) fn role_of(id: &PeerIdentity) -> pb::Role {
    if id.is_replica() {
        pb::Role::Replica
    } else {
        pb::Role::Agent
    }
}

impl Protocol {
    /// The sessions whose scope covers `doc`, in connection order.
    pub(super) fn covering(&self, doc: &DocId) -> Vec<ConnId> {
        let mut out: Vec<ConnId> = self
            .index
            .wide
            .iter()
            .copied()
            .filter(|c| self.sessions.get(c).is_some_and(|s| s.covers(doc)))
            .collect();
        if let Some(conns) = self.index.by_doc.get(doc) {
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
    pub(super) fn carries(&self, doc: &DocId) -> bool {
        match &self.local {
            PeerIdentity::Replica { .. } => true,
            PeerIdentity::Agent { cluster, .. } => self.relay && doc.cluster == *cluster,
        }
    }

    /// Whether a session with a relay whose hello arrived is up.
    pub fn has_relay_session(&self) -> bool {
        self.index.relay_sessions > 0
    }

    /// Every session, by connection.
    pub fn sessions(&self) -> Vec<SessionStatus> {
        self.sessions
            .iter()
            .map(|(conn, s)| SessionStatus {
                conn: *conn,
                identity: s.identity.clone(),
                hello_received: s.hello_received,
                last_heard: s.heartbeats.last_heard,
                heartbeat_seq: s.heartbeats.heartbeat_in,
                docs_behind: s.heartbeats.docs_behind,
                digest_matched: s.rounds.digest_matched,
                refused: s.refusals.refused.clone(),
                advertise_addr: s.advertise_addr.clone(),
                relay: s.relay,
                scope: s.scope.clone(),
                peer_version: s.peer_version.clone(),
                features: s.features.clone(),
            })
            .collect()
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
                timers: SessionTimers {
                    next_anti_entropy: now + first_ae,
                    next_heartbeat: now + hb,
                    next_peer_exchange: now + self.config.peer_exchange_interval,
                    anti_entropy_interval: ae,
                    heartbeat_interval: hb,
                    queued: None,
                },
                rounds: Rounds {
                    digest_matched: false,
                    repairs_sent: 0,
                    carrier_grace_until: (self.local.is_replica() && peer_is_replica)
                        .then(|| now + self.config.carrier_grace),
                    left_to_peer: HashMap::new(),
                },
                heartbeats: Heartbeats {
                    heartbeat_out: 0,
                    heartbeat_in: 0,
                    last_heard: now,
                    docs_behind: 0,
                    reached: BTreeSet::new(),
                    frames_in: 0,
                    frames_out: 0,
                    peer_processed: None,
                },
                refusals: SessionRefusals::default(),
                advertise_addr: None,
                relay: false,
                scope: None,
                peer_version: None,
                features: BTreeSet::new(),
                parked: SessionParked::default(),
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
        self.pushes.forget(conn);
        let Some(session) = self.sessions.remove(&conn) else {
            return;
        };
        if session.refusals.version_refused {
            self.refusals.forget(conn);
        }
        if session.hello_received && session.relay {
            self.index.relay_sessions -= 1;
        }
        if let Some(at) = session.timers.queued {
            self.timers.unqueue(at, conn);
        }
        match &session.scope {
            Some(Scope::Doc(d)) => {
                if let Some(conns) = self.index.by_doc.get_mut(d) {
                    conns.retain(|c| *c != conn);
                    if conns.is_empty() {
                        self.index.by_doc.remove(d);
                    }
                }
            }
            Some(_) => {
                self.index.wide.remove(&conn);
            }
            None => {}
        }
        self.saved_states.save(&session.identity, session.docs);
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
            s.heartbeats.frames_out = s.heartbeats.frames_out.saturating_sub(1);
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

    pub(super) fn learn_replica(&mut self, identity: &str, addr: &str, now: Instant) {
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
                    self.timers.announce(now);
                }
            }
            Ok(_) => {}
            Err(e) => {
                self.counters.protocol_errors += 1;
                debug!(error = %e, "ignoring malformed replica identity in PeerExchange");
            }
        }
    }

    pub(super) fn on_hello<S: DocStore>(
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
            Scope::Doc(d) => self.index.by_doc.entry(d.clone()).or_default().push(conn),
            Scope::All | Scope::Cluster(_) => {
                self.index.wide.insert(conn);
            }
        }
        if let Some(s) = self.sessions.get_mut(&conn) {
            if h.relay && !(s.hello_received && s.relay) {
                self.index.relay_sessions += 1;
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
            self.make_due(
                |s| s.identity.is_replica(),
                |s| s.timers.next_heartbeat = now,
            );
        }
        if peer.is_replica()
            && let Some(addr) = &advertise
        {
            self.learn_replica(&peer.uri(), addr, now);
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

    pub(super) fn on_ephemeral<S: DocStore>(
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
            if e.sequence <= s.heartbeats.heartbeat_in {
                // Stale or replayed heartbeat.
                return;
            }
            s.heartbeats.heartbeat_in = e.sequence;
            s.heartbeats.docs_behind = behind;
            s.heartbeats.reached = reached;
            if e.frames_processed > 0 {
                // Never more than we sent: a peer cannot claim frames it never got.
                s.heartbeats.peer_processed = Some(e.frames_processed.min(s.heartbeats.frames_out));
            }
        }
    }
}
