//! Sync and apply: automerge sync messages in and out, per (session, document) ([`DocSync`]),
//! and the [`SavedStates`] of closed sessions.
//!
//! Guarantees: the store applies only what a verified signature of the writer covers
//! ([`DocStore::receive_sync_message`]); a message of an older generation than held is not
//! applied; a document's state on one session is its own [`DocSync`], so per-document work
//! depends on no other document's.

use super::{ConnId, Output, Protocol, session::Session};
use crate::identity::PeerIdentity;
use crate::store::{DocStore, RejectReason};
use crate::wire::{self, pb, pb::envelope::Body};
use dramesh_store::{Attestation, DocEntry, DocId, SyncState};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tracing::{debug, warn};

/// Most remembered per-(peer, document) sync states of closed sessions.
const MAX_SAVED_STATES: usize = 250_000;

/// The sync state of one document on one session: all a message about the document needs
/// from the session, so per-document work can move off the protocol thread with it.
pub(super) struct DocSync {
    pub(super) generation: u64,
    pub(super) state: SyncState,
    /// SHA-256 of the signer chain last sent for this document on this session: later
    /// signatures by the same signer go without it (a chain is ~0.5 KB per message otherwise).
    pub(super) signer_sent: Option<[u8; 32]>,
    /// The signer chain last received for this document on this session.
    pub(super) signer_seen: Option<Arc<[u8]>>,
    /// Sync messages sent or received for the document on this session.
    pub(super) progress: u64,
    /// The last anti-entropy mismatch not yet resolved (see [`Protocol::repair_doc`]).
    pub(super) suspect: Option<Suspect>,
}

/// An anti-entropy mismatch of one document on one session, as first seen.
pub(super) struct Suspect {
    /// [`DocSync::progress`] after the mismatch was handled.
    pub(super) progress: u64,
    /// Our entry when the mismatch was seen; a change means our heads moved.
    pub(super) entry: Option<DocEntry>,
    pub(super) since: Instant,
}

/// The sync states of closed sessions, per (peer, document), reset, so that a reconnect
/// resumes each exchange where it stood (at most [`MAX_SAVED_STATES`]).
#[derive(Default)]
pub(super) struct SavedStates(HashMap<(PeerIdentity, DocId), (u64, SyncState)>);

impl SavedStates {
    /// Remembers the sync states of a session that closed.
    pub(super) fn save(&mut self, peer: &PeerIdentity, docs: HashMap<DocId, DocSync>) {
        if self.0.len() + docs.len() > MAX_SAVED_STATES {
            self.0.clear();
        }
        for (doc, mut ds) in docs {
            ds.state.reset();
            self.0
                .insert((peer.clone(), doc), (ds.generation, ds.state));
        }
    }

    /// The saved state of `doc` with `peer` if it is of `generation`, else a new one.
    fn take(&mut self, peer: &PeerIdentity, doc: &DocId, generation: u64) -> SyncState {
        match self.0.remove(&(peer.clone(), doc.clone())) {
            Some((g, state)) if g == generation => state,
            _ => SyncState::new(),
        }
    }
}

impl Protocol {
    pub(super) fn doc_state<'a>(
        saved: &mut SavedStates,
        session: &'a mut Session,
        doc: &DocId,
        generation: u64,
    ) -> &'a mut SyncState {
        let ds = session.docs.entry(doc.clone()).or_insert_with(|| {
            session.rounds.left_to_peer.remove(doc);
            let state = saved.take(&session.identity, doc, generation);
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

    /// The attestation of a received `Sync`, its signer chain taken from this session when the
    /// sender named it by hash (see [`DocSync::signer_sent`]).
    pub(super) fn signed_from_session(
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

    pub(super) fn on_sync<S: DocStore>(
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
        let Some((s, signed)) = self.park_if_waiting(conn, &doc, s, signed) else {
            return;
        };
        self.apply_sync(store, conn, peer, doc, s, signed, now, out);
    }

    /// Gives a received sync message to the store (which verifies its signature) and
    /// continues the exchange: the answer to the sender, and the relay of what it changed.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_sync<S: DocStore>(
        &mut self,
        store: &mut S,
        conn: ConnId,
        peer: &PeerIdentity,
        doc: DocId,
        s: pb::Sync,
        signed: Option<Attestation>,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let before = store.entry(&doc);
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
                        session.refusals.refused = None;
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
                .map(|s| &s.heartbeats.reached);
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

    /// Answers a sync message for a document we do not hold yet (its first message carries
    /// only heads): an empty document's reply tells the sender to send every change.
    pub(super) fn reply_without_doc(
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
}
