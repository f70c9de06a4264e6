//! The document-store interface the mesh replicates.
//!
//! The mesh never interprets document contents. It needs, per document, an entry
//! `(doc, generation, heads hash)` and the [`Digest`] over all entries to find what differs, and
//! the sync message generate/receive pair to repair it; the types are `dramesh-store`'s.
//! Stores implement [`DocStore`]; the protocol holds `&mut` access only for the duration of one
//! call, so a store can be shared with the application behind a mutex.

use dramesh_store::{
    Attestation, Digest, DocEntry, DocId, PendingSync, SignedMessage, StoreError, SyncState, Trust,
};

use crate::identity::PeerIdentity;

/// Why a store refused an incoming sync message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    /// The changes are not authored by an actor the sender may write as.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// The message is for an older generation than the one held.
    #[error("stale generation {got} (holding {have})")]
    StaleGeneration {
        /// Generation held.
        have: u64,
        /// Generation of the message.
        got: u64,
    },
    /// The generation lies more than 30 days ahead of this store's clock (the writer's clock
    /// runs ahead).
    #[error("{0}")]
    FutureGeneration(String),
    /// The changes carry no valid signature of the document's writer (unsigned, untrusted or
    /// wrong signer, bad signature, or changes the signed heads do not cover).
    #[error("bad signature: {0}")]
    BadSignature(String),
    /// The document's member cluster was retired from the fleet after this generation began.
    #[error("{0}")]
    Retired(String),
    /// The payload is not a valid automerge sync message or cannot be applied.
    #[error("malformed sync message: {0}")]
    Malformed(String),
    /// Any other store failure (persistence, limits).
    #[error("store error: {0}")]
    Store(String),
}

/// A store of automerge documents, one current generation per [`DocId`].
///
/// Contract the protocol relies on:
/// - [`digest`](DocStore::digest), [`bucket_entries`](DocStore::bucket_entries) and
///   [`entry`](DocStore::entry) describe the same set of entries, bucketed with [`DocId::bucket`].
/// - [`generate_sync_message`](DocStore::generate_sync_message) works on the *current*
///   generation (the one [`entry`](DocStore::entry) reports) and returns an encoded sync
///   message, or `None` when there is nothing to send or the document is unknown.
/// - [`receive_sync_message`](DocStore::receive_sync_message) applies a message for
///   `generation`: a newer generation than held starts (or replaces with) a fresh document
///   of that generation, an older one is refused with [`RejectReason::StaleGeneration`].
///   The store checks change authors against `from` (replicas relay documents they do
///   not author) and must leave the document untouched when it refuses. A message that
///   brings no changes for an unknown document need not create it: the protocol answers
///   such messages itself on behalf of an empty document.
/// - [`flush`](DocStore::flush) makes received changes durable; until it returns `Ok` the
///   protocol's outputs derived from them are held back by the node.
pub trait DocStore {
    /// Digest over every held document.
    fn digest(&self) -> Digest;
    /// Entries of the held documents whose [`DocId::bucket`] is in `buckets` and that `keep`
    /// accepts, each with its bucket, ordered by bucket.
    fn bucket_entries(
        &self,
        buckets: &[u32],
        keep: &dyn Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)>;
    /// The entry of one held document.
    fn entry(&self, doc: &DocId) -> Option<DocEntry>;
    /// The automerge heads of a held document (what its entry's `heads_hash` hashes).
    fn heads(&self, doc: &DocId) -> Vec<[u8; 32]>;
    /// Whether the held generation `generation` of `doc` contains every change in `heads`.
    fn holds_changes(&self, doc: &DocId, generation: u64, heads: &[[u8; 32]]) -> bool;
    /// Digest over the held documents of member cluster `cluster` (what a replica and that
    /// cluster's relay compare). The default computes it from the cluster's entries; stores
    /// that hold many documents keep it up to date instead.
    fn cluster_digest(&self, cluster: &str) -> Digest {
        let all: Vec<u32> = (0..dramesh_store::DIGEST_BUCKETS).collect();
        let entries = self.cluster_bucket_entries(cluster, &all, &|_| true);
        Digest::from_entries(entries.iter().map(|(_, e)| e))
    }
    /// [`DocStore::bucket_entries`] of member cluster `cluster`'s documents only.
    fn cluster_bucket_entries(
        &self,
        cluster: &str,
        buckets: &[u32],
        keep: &dyn Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        self.bucket_entries(buckets, &|d| d.cluster == cluster && keep(d))
    }
    /// Next sync message for `doc` towards the peer whose sync state is `state`, with the
    /// writer's signature over the heads it leads to when it carries changes.
    fn generate_sync_message(
        &mut self,
        doc: &DocId,
        state: &mut SyncState,
    ) -> Option<SignedMessage>;
    /// Applies a sync message received from `from`, whose changes `signed` must cover (see
    /// [`dramesh_store::Store::receive_signed_sync_message`]). The protocol calls it only for
    /// documents the session with `from` exchanges ([`crate::protocol::Scope`]); a store
    /// checks again, with [`may_deliver`], that `from` may deliver `doc` at all.
    fn receive_sync_message(
        &mut self,
        from: &PeerIdentity,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
        msg: &[u8],
        signed: Option<&Attestation>,
    ) -> Result<(), RejectReason>;
    /// Installs the node's signer and the mesh's verifier (the node calls it once at start).
    /// Stores that keep no signatures (the in-memory test store) keep the default.
    fn set_trust(&mut self, trust: Trust) {
        let _ = trust;
    }
    /// Makes every change received since the last call durable. The node calls it after each
    /// batch of events and sends nothing the batch produced (replies, relays, digests) before
    /// it returned `Ok`, so a store may defer fsyncs of received changes until here (group
    /// commit). Stores that persist synchronously, or not at all, keep the default.
    fn flush(&mut self) -> Result<(), RejectReason> {
        Ok(())
    }
    /// [`DocStore::flush`] in two halves, so the node can fsync on another thread while it
    /// handles the next batch: the I/O that makes every change received so far durable, to run
    /// anywhere and hand to [`DocStore::complete_flush`] with its result. Changes received
    /// after it are not covered. `None` when nothing is left to run elsewhere (what is pending
    /// is durable once this returned `Ok`). The default flushes here.
    fn begin_flush(&mut self) -> Result<Option<PendingSync>, RejectReason> {
        self.flush().map(|()| None)
    }
    /// Books the result of a [`DocStore::begin_flush`]'s sync: `Ok` once what it covers is
    /// durable; on error it is pending again for the next flush.
    fn complete_flush(
        &mut self,
        sync: PendingSync,
        result: Result<(), StoreError>,
    ) -> Result<(), RejectReason> {
        let _ = sync;
        result.map_err(|e| RejectReason::Store(e.to_string()))
    }
    /// Background upkeep (deferred compactions) the node runs after each batch's frames are
    /// sent, so it never delays them. Errors are the store's to log.
    fn maintain(&mut self) {}
    /// Called on the writer when a replica refused its own document `doc` as lying in the
    /// future: if the store's clock now agrees, it starts a new generation from the clock
    /// and returns it (the protocol then offers it to every peer). Stores without
    /// generations from clocks keep the default.
    fn recover_generation(&mut self, doc: &DocId) -> Option<u64> {
        let _ = doc;
        None
    }
    /// Drops every document the store does not write (an agent that stopped being its
    /// cluster's relay keeps only its own); returns how many. Stores that hold only their own
    /// keep the default.
    fn drop_copies(&mut self) -> usize {
        0
    }
}

/// Whether `from` may deliver changes of `doc` at all: a replica any document (what it relays
/// is believed only as far as the writer's signature goes), an agent the documents of its own
/// cluster (its own, or its cluster's as the relay; the session's scope narrows this further,
/// and changes not from the writer must be covered by the writer's signature).
pub fn may_deliver(from: &PeerIdentity, doc: &DocId) -> bool {
    match from {
        PeerIdentity::Replica { .. } => true,
        PeerIdentity::Agent { cluster, .. } => doc.cluster == *cluster,
    }
}
