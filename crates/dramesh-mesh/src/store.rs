//! The document-store interface the mesh replicates, and the bucketed digest it compares.
//!
//! The mesh never interprets document contents. It needs, per document, an entry
//! `(doc, generation, heads hash)` to find what differs, and the automerge sync
//! message generate/receive pair to repair it. Stores implement [`DocStore`]; the
//! protocol holds `&mut` access only for the duration of one call, so a store can be
//! shared with the application behind a mutex.
//!
//! Digest: every entry maps to one of [`DIGEST_BUCKETS`] buckets by a hash of its
//! document id ([`bucket_of`]); a bucket's value is the XOR of its entries'
//! [`DocEntry::fingerprint`]s (order-independent, so a store can maintain it
//! incrementally), and the root is a hash of all bucket values. Two stores hold the
//! same entries exactly when (up to 64-bit hash collisions) their roots agree.

use automerge::sync;
use sha2::{Digest as _, Sha256};

use crate::identity::{DocRef, PeerIdentity};

/// Number of digest buckets. Fixed by the wire protocol version.
pub const DIGEST_BUCKETS: u32 = 64;

/// SHA-256 over a document generation's sorted automerge heads.
pub type HeadsHash = [u8; 32];

/// What a store says about one document it holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DocEntry {
    pub doc: DocRef,
    /// Generation of the held document; a newer generation replaces older ones.
    pub generation: u64,
    /// [`heads_hash`] of the held generation.
    pub heads_hash: HeadsHash,
}

impl DocEntry {
    /// 64-bit hash of the whole entry, the unit the digest XORs together.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Sha256::new();
        h.update(self.doc.cluster.as_bytes());
        h.update([0]);
        h.update(self.doc.writer.as_bytes());
        h.update([0]);
        h.update(self.generation.to_be_bytes());
        h.update(self.heads_hash);
        first_u64(&h.finalize())
    }

    /// Whether the holder of `self` should push the document to a peer holding `theirs`:
    /// the peer lacks it, holds an older generation, or holds other heads of the same one.
    pub fn should_push_to(&self, theirs: Option<&DocEntry>) -> bool {
        match theirs {
            None => true,
            Some(t) => {
                self.generation > t.generation
                    || (self.generation == t.generation && self.heads_hash != t.heads_hash)
            }
        }
    }
}

fn first_u64(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(b)
}

/// The digest bucket of a document. Stores computing their own [`Digest`] must use this.
pub fn bucket_of(doc: &DocRef) -> u32 {
    let mut h = Sha256::new();
    h.update(doc.cluster.as_bytes());
    h.update([0]);
    h.update(doc.writer.as_bytes());
    (first_u64(&h.finalize()) % u64::from(DIGEST_BUCKETS)) as u32
}

/// Canonical heads hash: SHA-256 over the sorted change hashes.
pub fn heads_hash(heads: &[automerge::ChangeHash]) -> HeadsHash {
    let mut sorted: Vec<&automerge::ChangeHash> = heads.iter().collect();
    sorted.sort();
    let mut h = Sha256::new();
    for head in sorted {
        h.update(head.0);
    }
    h.finalize().into()
}

/// Bucketed summary of a set of entries (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digest {
    buckets: Vec<u64>,
}

impl Default for Digest {
    fn default() -> Self {
        Self::empty()
    }
}

impl Digest {
    pub fn empty() -> Self {
        Self {
            buckets: vec![0; DIGEST_BUCKETS as usize],
        }
    }

    pub fn from_entries<'a>(entries: impl IntoIterator<Item = &'a DocEntry>) -> Self {
        let mut d = Self::empty();
        for e in entries {
            d.toggle(e);
        }
        d
    }

    /// Adds an entry that is not in the digest, or removes one that is (XOR).
    /// Replacing an entry is `toggle(old)` then `toggle(new)`.
    pub fn toggle(&mut self, entry: &DocEntry) {
        self.buckets[bucket_of(&entry.doc) as usize] ^= entry.fingerprint();
    }

    /// Builds a digest from received bucket values; `None` unless exactly [`DIGEST_BUCKETS`].
    pub fn from_buckets(buckets: Vec<u64>) -> Option<Self> {
        (buckets.len() == DIGEST_BUCKETS as usize).then_some(Self { buckets })
    }

    pub fn buckets(&self) -> &[u64] {
        &self.buckets
    }

    /// Hash of all buckets; equal roots mean equal digests.
    pub fn root(&self) -> u64 {
        let mut h = Sha256::new();
        for b in &self.buckets {
            h.update(b.to_be_bytes());
        }
        first_u64(&h.finalize())
    }

    /// Indices of buckets whose values differ.
    pub fn differing_buckets(&self, other: &Digest) -> Vec<u32> {
        self.buckets
            .iter()
            .zip(&other.buckets)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, _)| i as u32)
            .collect()
    }
}

/// Why a store refused an incoming sync message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    /// The changes are not authored by an actor the sender may write as.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// The message is for an older generation than the one held.
    #[error("stale generation {got} (holding {have})")]
    StaleGeneration { have: u64, got: u64 },
    /// The payload is not a valid automerge sync message or cannot be applied.
    #[error("malformed sync message: {0}")]
    Malformed(String),
    /// Any other store failure (persistence, limits).
    #[error("store error: {0}")]
    Store(String),
}

/// A store of automerge documents, one current generation per [`DocRef`].
///
/// Contract the protocol relies on:
/// - [`digest`](DocStore::digest), [`bucket_entries`](DocStore::bucket_entries) and
///   [`entry`](DocStore::entry) describe the same set of entries, bucketed with [`bucket_of`].
/// - [`generate_sync_message`](DocStore::generate_sync_message) works on the *current*
///   generation (the one [`entry`](DocStore::entry) reports) and returns encoded
///   `automerge::sync::Message` bytes, or `None` when there is nothing to send or the
///   document is unknown.
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
    /// Entries of every held document whose [`bucket_of`] is `bucket`, in any order.
    fn bucket_entries(&self, bucket: u32) -> Vec<DocEntry>;
    /// The entry of one held document.
    fn entry(&self, doc: &DocRef) -> Option<DocEntry>;
    /// Next automerge sync message for `doc` towards the peer whose sync state is `state`.
    fn generate_sync_message(&mut self, doc: &DocRef, state: &mut sync::State) -> Option<Vec<u8>>;
    /// Applies an automerge sync message received from `from`.
    fn receive_sync_message(
        &mut self,
        from: &PeerIdentity,
        doc: &DocRef,
        generation: u64,
        state: &mut sync::State,
        msg: &[u8],
    ) -> Result<(), RejectReason>;
    /// Makes every change received since the last call durable. The node calls it after each
    /// batch of events and sends nothing the batch produced (replies, relays, digests) before
    /// it returned `Ok`, so a store may defer fsyncs of received changes until here (group
    /// commit). Stores that persist synchronously, or not at all, keep the default.
    fn flush(&mut self) -> Result<(), RejectReason> {
        Ok(())
    }
    /// Background upkeep (deferred compactions) the node runs after each batch's frames are
    /// sent, so it never delays them. Errors are the store's to log.
    fn maintain(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(w: &str, generation: u64, h: u8) -> DocEntry {
        DocEntry {
            doc: DocRef::new("c", w),
            generation,
            heads_hash: [h; 32],
        }
    }

    #[test]
    fn digest_is_order_independent_and_detects_changes() {
        let a = [entry("a", 1, 1), entry("b", 1, 2), entry("c", 2, 3)];
        let d1 = Digest::from_entries(&a);
        let d2 = Digest::from_entries(a.iter().rev());
        assert_eq!(d1, d2);
        assert_eq!(d1.root(), d2.root());
        let mut changed = a.clone();
        changed[1].heads_hash = [9; 32];
        let d3 = Digest::from_entries(&changed);
        assert_ne!(d1.root(), d3.root());
        assert_eq!(
            d1.differing_buckets(&d3),
            vec![bucket_of(&DocRef::new("c", "b"))]
        );
        let mut inc = d1.clone();
        inc.toggle(&a[1]);
        inc.toggle(&changed[1]);
        assert_eq!(inc, d3);
    }

    #[test]
    fn push_rule() {
        let mine = entry("a", 2, 1);
        assert!(mine.should_push_to(None));
        assert!(mine.should_push_to(Some(&entry("a", 1, 1))));
        assert!(mine.should_push_to(Some(&entry("a", 2, 7))));
        assert!(!mine.should_push_to(Some(&entry("a", 2, 1))));
        assert!(!mine.should_push_to(Some(&entry("a", 3, 0))));
    }

    #[test]
    fn from_buckets_checks_length() {
        assert!(Digest::from_buckets(vec![0; 63]).is_none());
        assert!(Digest::from_buckets(vec![0; 64]).is_some());
    }
}
