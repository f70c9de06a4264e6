//! Signature checks off the protocol thread: with [`Protocol::set_verify_jobs`] (the node's
//! mode), a received sync message that carries a writer's signature is held back (parked) while
//! a [`VerifyJob`], handed out by [`Protocol::poll_verify`] (as quinn-proto hands out
//! transmits), runs elsewhere; the driver reports it done with [`Protocol::on_verified`] and
//! the message then goes to the store.
//!
//! Guarantees:
//! - Off by default: then every message goes to the store as it arrives (the simulated-time
//!   tests run that way).
//! - A session's frames are handled in the order they arrived, whatever order their checks
//!   finish in: behind a parked message every later frame of its session waits (signed or not,
//!   any document, digests and entries too, so what the node answers on a session reflects
//!   every earlier message of it). In particular one document's messages reach the store in
//!   arrival order. Other sessions do not wait, and every check of a burst is handed out at
//!   once (they run in parallel; only their release is in order).
//! - The store stays the only judge. A job's verdict lands in the verifier's memory of
//!   signatures that passed (`signing::MeshVerifier`), and the store checks every message as it
//!   did without jobs, which for a verified signature is a lookup. Nothing the store did not
//!   find verified reaches the view or the disk, and a forged message is refused by the store
//!   exactly as before (the job's failure is not remembered, so the store checks it in full).
//! - A session that closes drops its parked messages: nothing was applied or acknowledged for
//!   them, and anti-entropy repairs what they carried. Their jobs' completions are ignored.
//! - A parked frame counts as handled in the session's heartbeats only once the store had it,
//!   so the peer paces its repair rounds on what was applied.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher as _};
use std::time::Instant;

use dramesh_store::{Attestation, DocId, HeadsVerifier, attest};

use super::{ConnId, Output, Protocol};
use crate::store::DocStore;
use crate::wire::pb::{self, envelope::Body};

/// Names one [`VerifyJob`] when it is reported done ([`Protocol::on_verified`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// A signature check of one received sync message: pure data, run anywhere with the node's
/// verifier ([`VerifyJob::run`]).
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyJob {
    /// What to report when it is done.
    pub ticket: Ticket,
    /// The document the message is about.
    pub doc: DocId,
    /// The message's generation.
    pub generation: u64,
    /// The writer's signature the message carries, its signer chain resolved.
    pub signed: Attestation,
}

impl VerifyJob {
    /// Checks the signature exactly as the store will (statement, signer chain, signature);
    /// a verifier that remembers signatures that passed then answers the store from memory.
    pub fn run(&self, verifier: &dyn HeadsVerifier) -> Result<(), String> {
        let statement = attest::statement(&self.doc, self.generation, &self.signed.heads);
        verifier.verify(
            &self.doc,
            &statement,
            &self.signed.signature,
            &self.signed.signer,
        )
    }

    /// Which of `workers` runs the job: always the same one for a document, so one
    /// document's checks finish in the order they were handed out and no document's burst
    /// holds up the others' workers.
    pub fn shard(&self, workers: usize) -> usize {
        let mut h = DefaultHasher::new();
        Hash::hash(&self.doc, &mut h);
        (h.finish() % workers.max(1) as u64) as usize
    }
}

/// A received frame waiting for its own check or an earlier frame's.
pub(super) struct Parked {
    /// The check it waits for (`None`: it only keeps its place).
    ticket: Option<Ticket>,
    done: bool,
    what: ParkedFrame,
}

enum ParkedFrame {
    Sync {
        doc: DocId,
        sync: pb::Sync,
        signed: Option<Attestation>,
    },
    Other(Body),
}

/// The frames a session holds back, in arrival order.
#[derive(Default)]
pub(super) struct SessionParked {
    queue: VecDeque<Parked>,
    /// Frames parked (not yet handled, for the heartbeats' count).
    pub(super) frames: u64,
}

/// The protocol's side of the checks: whether it hands them out, those not taken yet, and
/// which are out.
#[derive(Default)]
pub(super) struct Verifications {
    pub(super) on: bool,
    next: u64,
    jobs: VecDeque<VerifyJob>,
    out: HashMap<Ticket, ConnId>,
}

impl Protocol {
    /// Hands out signature checks of received sync messages ([`Protocol::poll_verify`])
    /// instead of leaving them to the store on this thread (see the module docs of `verify`).
    /// The node turns it on when it has verifier threads.
    pub fn set_verify_jobs(&mut self, on: bool) {
        self.verify.on = on;
    }

    /// The next signature check to run off this thread, in the order they arose; report each
    /// done with [`Protocol::on_verified`]. Call it after every call that takes frames.
    pub fn poll_verify(&mut self) -> Option<VerifyJob> {
        self.verify.jobs.pop_front()
    }

    /// Checks handed out (or waiting to be) and not reported done yet (the driver bounds this).
    pub fn verifications_in_flight(&self) -> usize {
        self.verify.out.len()
    }

    /// Parks a frame other than `Sync` on `conn` if an earlier frame is parked; `None` when it
    /// was parked, else it is handed back to be handled now.
    pub(super) fn park_frame(&mut self, conn: ConnId, body: Body) -> Option<Body> {
        let session = self.sessions.get_mut(&conn)?;
        if session.parked.queue.is_empty() {
            return Some(body);
        }
        session.parked.frames += 1;
        session.parked.queue.push_back(Parked {
            ticket: None,
            done: false,
            what: ParkedFrame::Other(body),
        });
        None
    }

    /// Parks `sync` on `conn` if it needs a check or an earlier frame is parked; `None` when
    /// it was parked, else it is handed back to be applied now.
    pub(super) fn park_if_waiting(
        &mut self,
        conn: ConnId,
        doc: &DocId,
        sync: pb::Sync,
        signed: Option<Attestation>,
    ) -> Option<(pb::Sync, Option<Attestation>)> {
        if !self.verify.on {
            return Some((sync, signed));
        }
        // The store checks no signature on the node's own documents (their changes are dropped).
        let needs_check = signed.is_some() && !self.local.owns(doc);
        let session = self.sessions.get_mut(&conn)?;
        let queued = !session.parked.queue.is_empty();
        if !needs_check && !queued {
            return Some((sync, signed));
        }
        let ticket = match (needs_check, &signed) {
            (true, Some(a)) => {
                let ticket = Ticket(self.verify.next);
                self.verify.next += 1;
                self.counters.checks_handed_out += 1;
                self.verify.out.insert(ticket, conn);
                self.verify.jobs.push_back(VerifyJob {
                    ticket,
                    doc: doc.clone(),
                    generation: sync.generation,
                    signed: a.clone(),
                });
                Some(ticket)
            }
            _ => None,
        };
        session.parked.frames += 1;
        session.parked.queue.push_back(Parked {
            ticket,
            done: false,
            what: ParkedFrame::Sync {
                doc: doc.clone(),
                sync,
                signed,
            },
        });
        None
    }

    /// A check handed out by [`Protocol::poll_verify`] is done (whatever its verdict): the frames
    /// of its session that no longer wait are handled, in arrival order.
    pub fn on_verified<S: DocStore>(
        &mut self,
        store: &mut S,
        ticket: Ticket,
        now: Instant,
    ) -> Vec<Output> {
        let mut out = Vec::new();
        let Some(conn) = self.verify.out.remove(&ticket) else {
            return out;
        };
        let Some(session) = self.sessions.get_mut(&conn) else {
            return out;
        };
        let peer = session.identity.clone();
        let queue = &mut session.parked.queue;
        if let Some(p) = queue.iter_mut().find(|p| p.ticket == Some(ticket)) {
            p.done = true;
        }
        let mut ready = Vec::new();
        while queue.front().is_some_and(|p| p.done || p.ticket.is_none()) {
            ready.extend(queue.pop_front());
        }
        session.parked.frames -= ready.len() as u64;
        for p in ready {
            // An earlier frame's outputs may have closed the session.
            if !self.sessions.contains_key(&conn) {
                break;
            }
            match p.what {
                ParkedFrame::Sync { doc, sync, signed } => {
                    self.apply_sync(store, conn, &peer, doc, sync, signed, now, &mut out)
                }
                ParkedFrame::Other(body) => self.dispatch(store, conn, &peer, body, now, &mut out),
            }
        }
        out
    }
}
