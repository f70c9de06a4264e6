//! Anti-entropy: digest probes, bucket hashes and entries, and the repairs they start; each
//! session's [`Rounds`].
//!
//! Guarantees (see the protocol's module docs for why): a round compares the session's whole
//! scope by its root; only a mismatch costs bucket hashes, entries and sync messages; a
//! document's sync state is reset only when a mismatch persists across two probes without
//! progress; at most [`ProtocolConfig::max_repairs_per_round`](super::ProtocolConfig::max_repairs_per_round) repairs per round; between two
//! replicas, documents whose carriers reach both are left to them.

use super::{
    ConnId, Output, Protocol,
    session::{Scope, Session},
    sync::Suspect,
};
use crate::identity::PeerIdentity;
use crate::store::DocStore;
use crate::wire::{self, pb, pb::envelope::Body};
use dramesh_store::{DIGEST_BUCKETS, Digest, DocEntry, DocId, REPLICA_SCOPES};
use std::collections::{HashMap, HashSet};
use std::time::Instant;
use tracing::warn;

/// One session's anti-entropy rounds.
pub(super) struct Rounds {
    /// See [`SessionStatus::digest_matched`](super::SessionStatus::digest_matched).
    pub(super) digest_matched: bool,
    /// [`Heartbeats::frames_out`](super::session::Heartbeats::frames_out) after the last round in which we started repairs.
    pub(super) repairs_sent: u64,
    /// Until when a session between two replicas leaves every member cluster's documents to
    /// their carriers ([`ProtocolConfig::carrier_grace`](super::ProtocolConfig::carrier_grace)).
    pub(super) carrier_grace_until: Option<Instant>,
    /// Documents with no sync state on this session that a round left to the peer, holding
    /// changes we lack, and when (see [`Protocol::push_differences`]).
    pub(super) left_to_peer: HashMap<DocId, Instant>,
}

/// Documents two replicas leave out of their anti-entropy (see
/// [`Protocol::carriers_reaching`]).
#[derive(Default)]
pub(super) struct LeftToCarriers {
    /// Every member cluster (the session's [`ProtocolConfig::carrier_grace`](super::ProtocolConfig::carrier_grace)).
    pub(super) all_clusters: bool,
    /// Clusters whose relay reaches both.
    pub(super) clusters: HashSet<String>,
    /// Documents whose writer reaches both (of clusters not in `clusters`).
    pub(super) docs: HashSet<DocId>,
}

impl LeftToCarriers {
    pub(super) fn contains(&self, doc: &DocId) -> bool {
        (self.all_clusters && !doc.is_replica_scope())
            || self.clusters.contains(&doc.cluster)
            || self.docs.contains(doc)
    }
}

impl Protocol {
    /// The digest of what `conn`'s session exchanges (empty before its hello).
    pub(super) fn scoped_digest<S: DocStore>(&self, store: &S, conn: ConnId) -> Digest {
        match self.sessions.get(&conn).and_then(|s| s.scope.as_ref()) {
            Some(Scope::All) => store.digest(),
            Some(Scope::Cluster(c)) => store.cluster_digest(c),
            Some(Scope::Doc(doc)) => Digest::from_entries(store.entry(doc).iter()),
            None => Digest::empty(),
        }
    }

    /// The entries in `buckets` of what `conn`'s session repairs, with their bucket, ordered
    /// by bucket: its scope without the documents `left` to carriers (counted in
    /// [`Counters::repairs_left_to_writers`](super::Counters::repairs_left_to_writers)), which are never copied.
    pub(super) fn repair_entries<S: DocStore>(
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

    pub(super) fn on_digest<S: DocStore>(
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
            s.rounds.digest_matched = true;
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
    pub(super) fn send_entries<S: DocStore>(
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

    pub(super) fn check_buckets(
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
    pub(super) fn on_entries<S: DocStore>(
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
    pub(super) fn scoped_wire_entries<'a>(
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
    /// [`ProtocolConfig::max_repairs_per_round`](super::ProtocolConfig::max_repairs_per_round).
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
    pub(super) fn push_differences<S: DocStore>(
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
                    let min_age = session.timers.anti_entropy_interval.mul_f64(0.75);
                    let since = *session
                        .rounds
                        .left_to_peer
                        .entry(entry.doc.clone())
                        .or_insert(now);
                    if now.saturating_duration_since(since) < min_age {
                        if since == now {
                            self.counters.repairs_left_to_peer += 1;
                        }
                        continue;
                    }
                    session.rounds.left_to_peer.remove(&entry.doc);
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
            s.rounds.repairs_sent = s.heartbeats.frames_out;
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
    /// [`ProtocolConfig::carrier_grace`](super::ProtocolConfig::carrier_grace) every member cluster is left to its carriers.
    pub(super) fn carriers_reaching(&self, conn: ConnId, now: Instant) -> LeftToCarriers {
        let mut left = LeftToCarriers::default();
        let Some(session) = self.sessions.get(&conn) else {
            return left;
        };
        let peer = &session.identity;
        if !self.local.is_replica() || !peer.is_replica() {
            return left;
        }
        if session
            .rounds
            .carrier_grace_until
            .is_some_and(|until| now < until)
        {
            left.all_clusters = true;
            return left;
        }
        for s in self.sessions.values() {
            if !s.hello_received || !s.heartbeats.reached.contains(peer) {
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
    pub(super) fn repair_digest<S: DocStore>(
        &self,
        store: &S,
        conn: ConnId,
        left: &LeftToCarriers,
    ) -> Digest {
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
    pub(super) fn repair_doc<S: DocStore>(
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
        let min_age = session.timers.anti_entropy_interval.mul_f64(0.75);
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
}
