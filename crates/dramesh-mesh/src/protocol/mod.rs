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
//! - **Signature checks** may run off the protocol's thread ([`Protocol::set_verify_jobs`]): a
//!   signed sync message then waits, with every later frame of its session, until its
//!   [`VerifyJob`] is reported done ([`Protocol::poll_verify`], [`Protocol::on_verified`]); a
//!   session's frames are handled in arrival order either way, and the store still checks
//!   every signature before it applies anything.
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
//!
//! Layout: [`Protocol`] composes sub-states that each own their fields, in their own files:
//! `session` (sessions, scopes, heartbeats, the index of sessions by document), `timers` (the
//! queue of due sessions, the tick, [`Protocol::poll_timeout`]), `push` (coalesced and delayed
//! pushes), `anti_entropy` (rounds and repairs), `sync` (per-document sync states, apply),
//! `verify` (signature checks handed out, messages parked behind them) and `refusal`. This file holds the configuration, the outputs, the counters and the frame
//! dispatch.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rand::Rng;
use tracing::warn;

use dramesh_store::DocId;

use crate::identity::PeerIdentity;
use crate::store::DocStore;
use crate::version;
use crate::wire::{self, WIRE_VERSION, pb, pb::envelope::Body};

mod anti_entropy;
mod push;
mod refusal;
mod session;
mod sync;
mod timers;
mod verify;

use push::Pushes;
use refusal::Refusals;
pub use refusal::{REFUSAL_INTERVAL, REFUSAL_LOG_INTERVAL, VERSION_REFUSAL_LINGER};
pub use session::{Scope, SessionStatus};
use session::{Session, SessionIndex};
use sync::SavedStates;
use timers::Timers;
use verify::Verifications;
pub use verify::{Ticket, VerifyJob};

/// Major protocol version carried in `Hello.protocol_version` (see [`crate::version`]).
pub const PROTOCOL_VERSION: u32 = version::PROTOCOL_MAJOR;
/// Most replicas accepted from one `PeerExchange`.
pub const MAX_PEER_EXCHANGE: usize = 1024;
/// Longest accepted advertised address.
pub const MAX_ADDR_LEN: usize = 256;

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
    /// Signature checks handed out to run off the protocol's thread
    /// ([`Protocol::poll_verify`]).
    pub checks_handed_out: u64,
}

/// The replication state machine of one node (see the module docs). It composes sub-states
/// that each own their fields: the sessions (each with its timers, anti-entropy rounds,
/// heartbeats, refusals and per-document sync states) and their index by document, the queue of
/// session timers, the pushes not generated yet, the refusal log and linger, and the sync states
/// of closed sessions (`SessionTimers`, `Rounds`, `Heartbeats`, `SessionRefusals`, `DocSync`,
/// `SessionIndex`, `Timers`, `Pushes`, `Refusals`, `SavedStates`; ARCHITECTURE.md, "Mesh
/// protocol").
pub struct Protocol {
    local: PeerIdentity,
    config: ProtocolConfig,
    sessions: BTreeMap<ConnId, Session>,
    known_replicas: BTreeMap<String, String>,
    /// Sync states of closed sessions, for reconnects.
    saved_states: SavedStates,
    counters: Counters,
    /// Pushes coalesced per batch and delayed relays and answers.
    pushes: Pushes,
    /// Refusal logging and sessions refused for their version.
    refusals: Refusals,
    /// See [`Protocol::set_relay`].
    relay: bool,
    /// The sessions by what they exchange.
    index: SessionIndex,
    /// When each session's timers are next due, and the announcement of a learned replica.
    timers: Timers,
    /// Signature checks handed out (see [`Protocol::set_verify_jobs`]).
    verify: Verifications,
}

impl Protocol {
    /// A node with identity `local` and no sessions.
    pub fn new(local: PeerIdentity, config: ProtocolConfig) -> Self {
        Self {
            timers: Timers::new(config.jitter_seed),
            local,
            config,
            sessions: BTreeMap::new(),
            known_replicas: BTreeMap::new(),
            saved_states: SavedStates::default(),
            counters: Counters::default(),
            pushes: Pushes::default(),
            refusals: Refusals::default(),
            relay: false,
            index: SessionIndex::default(),
            verify: Verifications::default(),
        }
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

    fn send(&mut self, out: &mut Vec<Output>, conn: ConnId, body: Body) {
        self.counters.frames_out += 1;
        if let Some(s) = self.sessions.get_mut(&conn) {
            s.heartbeats.frames_out += 1;
        }
        if matches!(body, Body::Sync(_)) {
            self.counters.sync_out += 1;
        }
        out.push(Output::Send {
            conn,
            envelope: wire::envelope(body),
        });
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
        session.heartbeats.last_heard = now;
        session.heartbeats.frames_in += 1;
        let hello_received = session.hello_received;
        let version_refused = session.refusals.version_refused;
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
            // A sync message parks itself (see `verify`) once its signer chain is resolved.
            Body::Sync(s) => self.on_sync(store, conn, &peer, s, now, &mut out),
            // Behind a message waiting for its signature check, the session's other frames
            // wait too: what the node answers on a session then reflects every earlier message.
            other => {
                if let Some(body) = self.park_frame(conn, other) {
                    self.dispatch(store, conn, &peer, body, now, &mut out);
                }
            }
        }
        out
    }

    /// Handles one frame's body other than `Sync`, in its session's order.
    fn dispatch<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        peer: &PeerIdentity,
        body: Body,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let hello_received = self.sessions.get(&conn).is_some_and(|s| s.hello_received);
        match body {
            Body::Hello(_) if hello_received => {
                self.protocol_error(out, conn, "duplicate Hello".into());
            }
            Body::Hello(h) => self.on_hello(store, conn, peer, h, now, out),
            Body::Digest(d) => self.on_digest(store, conn, d, now, out),
            Body::BucketRequest(r) => {
                let Some(buckets) = self.check_buckets(out, conn, &r.buckets) else {
                    return;
                };
                let mine = self.on_entries(store, conn, peer, &buckets, &r.entries, now, out);
                self.send_entries(store, out, conn, &buckets, &mine, false);
            }
            Body::BucketEntries(e) => {
                let Some(buckets) = self.check_buckets(out, conn, &e.buckets) else {
                    return;
                };
                self.on_entries(store, conn, peer, &buckets, &e.entries, now, out);
            }
            Body::Sync(s) => self.on_sync(store, conn, peer, s, now, out),
            Body::Refusal(r) => self.on_refusal(store, conn, peer, r, now, out),
            Body::Ephemeral(e) => self.on_ephemeral(store, conn, peer, e),
            Body::PeerExchange(p) => {
                if !peer.is_replica() {
                    self.counters.rejected_unauthorized += 1;
                    warn!(%peer, "refused PeerExchange from an agent");
                    return;
                }
                if !self.config.peer_exchange {
                    return;
                }
                for r in p.replicas.iter().take(MAX_PEER_EXCHANGE) {
                    self.learn_replica(&r.identity, &r.addr, now);
                }
            }
        }
    }
}
