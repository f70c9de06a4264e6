//! Refusals: of a writer's messages by the store, and of a peer's protocol version
//! ([`Refusals`], [`SessionRefusals`]).
//!
//! Guarantees: a replica tells a writer why it refused at most once per [`REFUSAL_INTERVAL`]
//! per document and connection; a writer logs refusals at most once per
//! [`REFUSAL_LOG_INTERVAL`] per document, and version refusals at most once per peer; a session
//! refused for its version is closed by the first tick [`VERSION_REFUSAL_LINGER`] after the
//! refusal (included in [`Protocol::poll_timeout`]), or at once when the peer's refusal comes.

use super::{ConnId, Output, Protocol};
use crate::identity::PeerIdentity;
use crate::store::{DocStore, RejectReason};
use crate::wire::{self, pb, pb::envelope::Body};
use dramesh_store::DocId;
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// What refusals leave behind: when each was last logged, and the sessions refused for their
/// version that are waiting to be closed.
#[derive(Default)]
pub(super) struct Refusals {
    /// When a refusal of each own document was last logged (writers; see
    /// [`REFUSAL_LOG_INTERVAL`]).
    logged: HashMap<DocId, Instant>,
    /// When a version refusal was last logged, by peer (at most once per
    /// [`REFUSAL_LOG_INTERVAL`]).
    version_logged: HashMap<PeerIdentity, Instant>,
    /// Sessions refused for their version, by when they are closed
    /// ([`VERSION_REFUSAL_LINGER`]).
    closing: BTreeSet<(Instant, ConnId)>,
}

/// What refusals left on one session.
#[derive(Default)]
pub(super) struct SessionRefusals {
    /// See [`SessionStatus::refused`](super::SessionStatus::refused).
    pub(super) refused: Option<String>,
    /// When a [`pb::Refusal`] was last sent for each document on this session.
    pub(super) refusals_sent: HashMap<DocId, Instant>,
    /// This node refused the peer's version: every later frame but a refusal is ignored until
    /// the connection closes.
    pub(super) version_refused: bool,
}

impl Refusals {
    /// Takes the version-refused sessions whose linger is over at `now`, earliest first.
    pub(super) fn due_closes(&mut self, now: Instant) -> Vec<ConnId> {
        let mut due = Vec::new();
        while let Some(&(at, conn)) = self.closing.first()
            && at <= now
        {
            self.closing.pop_first();
            due.push(conn);
        }
        due
    }

    /// Forgets the pending close of a connection that is gone.
    pub(super) fn forget(&mut self, conn: ConnId) {
        self.closing.retain(|(_, c)| *c != conn);
    }

    /// When the next version-refused session is to be closed.
    pub(super) fn next_close(&self) -> Option<Instant> {
        self.closing.first().map(|(at, _)| *at)
    }
}

/// A replica tells a refused writer why at most this often per document and connection.
pub const REFUSAL_INTERVAL: Duration = Duration::from_secs(10);
/// A writer logs refusals of its document at most this often.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(60);
/// How long a session refused for its version stays open after the refusal was sent, so the
/// refusal reaches the peer before the connection closes (closing drops unsent frames).
pub const VERSION_REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// Most peers whose last version-refusal log time is remembered.
pub(super) const MAX_VERSION_LOGGED: usize = 10_000;
/// Longest refusal text sent or logged.
pub(super) const MAX_REFUSAL_REASON: usize = 1024;

pub(super) fn code_of(reason: &RejectReason) -> pb::RefusalCode {
    match reason {
        RejectReason::FutureGeneration(_) => pb::RefusalCode::FutureGeneration,
        RejectReason::Unauthorized(_) => pb::RefusalCode::Unauthorized,
        RejectReason::Malformed(_) => pb::RefusalCode::Malformed,
        RejectReason::BadSignature(_) => pb::RefusalCode::BadSignature,
        RejectReason::Retired(_) => pb::RefusalCode::Retired,
        RejectReason::StaleGeneration { .. } | RejectReason::Store(_) => pb::RefusalCode::Store,
    }
}

pub(super) fn bounded(text: &str) -> String {
    match text.char_indices().nth(MAX_REFUSAL_REASON) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

impl Protocol {
    /// Marks the writer on `conn` as refused and tells it why, at most once per
    /// [`REFUSAL_INTERVAL`] per document.
    pub(super) fn refuse_writer(
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
        session.refusals.refused = Some(text.clone());
        let due = session
            .refusals
            .refusals_sent
            .get(doc)
            .is_none_or(|t| now.saturating_duration_since(*t) >= REFUSAL_INTERVAL);
        if !due {
            return;
        }
        session.refusals.refusals_sent.insert(doc.clone(), now);
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

    /// Whether a version refusal involving `peer` is to be logged now (at most once per
    /// [`REFUSAL_LOG_INTERVAL`] per peer, whichever side refused).
    pub(super) fn version_log_due(&mut self, peer: &PeerIdentity, now: Instant) -> bool {
        let due = self
            .refusals
            .version_logged
            .get(peer)
            .is_none_or(|t| now.saturating_duration_since(*t) >= REFUSAL_LOG_INTERVAL);
        if due {
            if self.refusals.version_logged.len() >= MAX_VERSION_LOGGED {
                self.refusals
                    .version_logged
                    .retain(|_, t| now.saturating_duration_since(*t) < REFUSAL_LOG_INTERVAL);
            }
            self.refusals.version_logged.insert(peer.clone(), now);
        }
        due
    }

    /// Refuses a session whose peer announced a version this node does not speak: sends the
    /// `Refusal` (code `VERSION`, `reason` naming both versions), ignores the peer from now on
    /// and closes the connection [`VERSION_REFUSAL_LINGER`] later, so the refusal gets there.
    pub(super) fn refuse_version(
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
            s.refusals.version_refused = true;
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
        self.refusals
            .closing
            .insert((now + VERSION_REFUSAL_LINGER, conn));
    }

    /// A peer refused this node's version: logged, counted, and the connection closed.
    pub(super) fn on_version_refusal(
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

    /// A replica refused this writer's own document: log it (rate-limited), and when the
    /// generation was refused as lying in the future and the store's clock now agrees, start
    /// a new generation and offer it to every peer.
    pub(super) fn on_refusal<S: DocStore>(
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
            .refusals
            .logged
            .get(&doc)
            .is_none_or(|t| now.saturating_duration_since(*t) >= REFUSAL_LOG_INTERVAL);
        if due {
            self.refusals.logged.insert(doc.clone(), now);
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
}
