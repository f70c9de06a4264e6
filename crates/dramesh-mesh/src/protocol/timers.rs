//! Timers: when each session next probes, heartbeats and exchanges peers ([`SessionTimers`],
//! queued in [`Timers`]), the tick that runs what is due, and [`Protocol::poll_timeout`].
//!
//! Guarantees: a tick visits only the sessions whose timer is due; a tick earlier than
//! [`Protocol::poll_timeout`] does nothing, and a tick at it leaves nothing due, so a driver
//! that ticks only then misses no timer (`tests/protocol.rs`,
//! `ticking_only_at_poll_timeout_misses_no_timer`).

use super::{ConnId, MAX_PEER_EXCHANGE, Output, Protocol, session::Session};
use crate::identity::PeerIdentity;
use crate::store::DocStore;
use crate::wire::{pb, pb::envelope::Body};
use dramesh_store::DocId;
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// The protocol's clock-driven work that is not per document: sessions by when their next
/// timer (probe, heartbeat, peer exchange) is due, the announcement of a newly learned
/// replica, and the jitter of probe periods. A relay holds a session per node of its cluster,
/// and visiting them all on every tick was most of its idle cost: only due sessions are
/// visited.
pub(super) struct Timers {
    /// Each session after its hello, at its earliest timer that is on (see
    /// [`Protocol::schedule`]).
    queue: BTreeSet<(Instant, ConnId)>,
    /// When a replica learned a replica it did not know: the next tick makes the peer exchange
    /// due on every session (see [`Protocol::learn_replica`]).
    announce: Option<Instant>,
    /// Jitter of the probe periods (seeded by [`ProtocolConfig::jitter_seed`](super::ProtocolConfig::jitter_seed)).
    rng: StdRng,
}

/// One session's timers: when its next probe, heartbeat and peer exchange are due, their
/// periods, and its entry in [`Timers`].
pub(super) struct SessionTimers {
    pub(super) next_anti_entropy: Instant,
    pub(super) next_heartbeat: Instant,
    pub(super) next_peer_exchange: Instant,
    /// Mean digest probe and heartbeat periods of the session (a node agent and its relay
    /// use the slower `node_*` ones).
    pub(super) anti_entropy_interval: Duration,
    pub(super) heartbeat_interval: Duration,
    /// The session's entry in [`Timers`], once its hello arrived.
    pub(super) queued: Option<Instant>,
}

impl Timers {
    pub(super) fn new(seed: u64) -> Self {
        Self {
            queue: BTreeSet::new(),
            announce: None,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// Notes, at `now`, that the next tick should tell every session the known replicas.
    pub(super) fn announce(&mut self, now: Instant) {
        self.announce.get_or_insert(now);
    }

    /// Takes a session's entry out of the queue.
    pub(super) fn unqueue(&mut self, at: Instant, conn: ConnId) {
        self.queue.remove(&(at, conn));
    }

    /// The earliest moment a session's timer or the announcement needs a tick.
    fn next(&self) -> Option<Instant> {
        let queued = self.queue.first().map(|(at, _)| *at);
        match (queued, self.announce) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl Protocol {
    pub(super) fn jittered(&mut self, base: Duration) -> Duration {
        let factor: f64 = self.timers.rng.random_range(0.75..1.25);
        base.mul_f64(factor)
    }

    /// The earliest moment the protocol needs [`Protocol::on_tick`]: a session's probe,
    /// heartbeat or peer exchange, a delayed relay or answer, the close of a session refused
    /// for its version, or the announcement of a newly learned replica (then a moment already
    /// past). `None` while nothing is scheduled. A tick before it does nothing, so a driver may
    /// sleep until then or until an event arrives; events may move it earlier, so it is asked
    /// again after each.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.timers.next(),
            self.pushes.next_due(),
            self.refusals.next_close(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Periodic work: due relays and answers, digest probes, heartbeats, peer exchange.
    pub fn on_tick<S: DocStore>(&mut self, store: &mut S, now: Instant) -> Vec<Output> {
        let mut out = Vec::new();
        for conn in self.refusals.due_closes(now) {
            out.push(Output::Close {
                conn,
                reason: "protocol version refused".into(),
            });
        }
        for (conn, doc) in self.pushes.due_at(now) {
            self.pushes.undelay(conn, &doc);
            self.push_doc(store, conn, &doc, false, &mut out);
        }
        if self.timers.announce.take().is_some()
            && self.local.is_replica()
            && self.config.peer_exchange
        {
            // Makes the exchange due on every session now (their timers run from here).
            self.make_due(|_| true, |s| s.timers.next_peer_exchange = now);
        }
        // What each heartbeat of an agent tells: the replicas it reaches (the same for every
        // session of this tick).
        let mut reached: Option<Vec<String>> = None;
        let mut conns = Vec::new();
        while let Some(&(at, conn)) = self.timers.queue.first()
            && at <= now
        {
            self.timers.queue.pop_first();
            if let Some(s) = self.sessions.get_mut(&conn) {
                s.timers.queued = None;
            }
            conns.push(conn);
        }
        for &conn in &conns {
            let (due_ae, due_hb, due_pex) = match self.sessions.get(&conn) {
                Some(s) if s.hello_received => (
                    now >= s.timers.next_anti_entropy,
                    now >= s.timers.next_heartbeat,
                    now >= s.timers.next_peer_exchange,
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
                        s.timers.anti_entropy_interval
                    });
                let next = now + self.jittered(interval);
                if let Some(s) = self.sessions.get_mut(&conn) {
                    s.timers.next_anti_entropy = next;
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
                        s.heartbeats.heartbeat_out += 1;
                        s.timers.next_heartbeat = now + s.timers.heartbeat_interval;
                        (
                            s.heartbeats.heartbeat_out,
                            s.heartbeats.frames_in - s.parked.frames,
                        )
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
                    s.timers.next_peer_exchange = now + self.config.peer_exchange_interval;
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
    pub(super) fn make_due(
        &mut self,
        which: impl Fn(&Session) -> bool,
        set: impl Fn(&mut Session),
    ) {
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
    pub(super) fn schedule(&mut self, conn: ConnId) {
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
        let mut at = s.timers.next_heartbeat;
        if anti_entropy {
            at = at.min(s.timers.next_anti_entropy);
        }
        if peer_exchange {
            at = at.min(s.timers.next_peer_exchange);
        }
        if let Some(old) = s.timers.queued.replace(at) {
            self.timers.queue.remove(&(old, conn));
        }
        self.timers.queue.insert((at, conn));
    }

    pub(super) fn peer_exchange(&self) -> pb::PeerExchange {
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
}
