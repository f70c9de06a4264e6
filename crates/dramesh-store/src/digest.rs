//! The bucketed digest replicas compare to find documents that differ.
//!
//! Every document maps to one of [`DIGEST_BUCKETS`] buckets ([`DocId::bucket`]); a bucket's
//! value is the XOR of its entries' [`DocEntry::fingerprint`]s (order-independent, so the store
//! maintains it incrementally on every mutation), and the root is a hash of all bucket values.
//! Two stores hold the same entries exactly when (up to 64-bit hash collisions) their roots
//! agree. Bucket indices, fingerprints and roots are part of the mesh wire protocol.

use sha2::{Digest as _, Sha256};

use crate::docid::{DocId, HeadsHash, first_u64};

/// Number of digest buckets. Fixed by the mesh wire protocol version.
pub const DIGEST_BUCKETS: u32 = 64;

// Bucket sets are 64-bit masks ([`bucket_mask`]).
const _: () = assert!(DIGEST_BUCKETS <= 64);

/// The buckets of `buckets` as a bit mask (indices out of range are left out).
pub(crate) fn bucket_mask(buckets: &[u32]) -> u64 {
    buckets
        .iter()
        .filter(|b| **b < DIGEST_BUCKETS)
        .fold(0, |mask, b| mask | (1u64 << b))
}

/// What a store holds of one document: the unit peers compare.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DocEntry {
    /// The document.
    pub doc: DocId,
    /// Generation of the held document; a newer generation replaces older ones.
    pub generation: u64,
    /// [`heads_hash`](crate::heads_hash) of the held generation.
    pub heads_hash: HeadsHash,
}

impl DocEntry {
    /// 64-bit hash of the whole entry, the unit the digest XORs together.
    pub fn fingerprint(&self) -> u64 {
        fingerprint(&self.doc, self.generation, &self.heads_hash)
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

/// [`DocEntry::fingerprint`] without building the entry.
pub(crate) fn fingerprint(doc: &DocId, generation: u64, heads_hash: &HeadsHash) -> u64 {
    let mut h = Sha256::new();
    h.update(doc.cluster.as_bytes());
    h.update([0]);
    h.update(doc.writer.as_bytes());
    h.update([0]);
    h.update(generation.to_be_bytes());
    h.update(heads_hash);
    first_u64(&h.finalize())
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
    /// The digest of no entries.
    pub fn empty() -> Self {
        Self {
            buckets: vec![0; DIGEST_BUCKETS as usize],
        }
    }

    /// The digest of `entries`.
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
        self.xor(entry.doc.bucket(), entry.fingerprint());
    }

    /// XORs every bucket of `other` into this one: adds a disjoint set of entries, or removes
    /// a subset this digest holds (a cluster's, for instance).
    pub fn xor_with(&mut self, other: &Digest) {
        for (b, o) in self.buckets.iter_mut().zip(&other.buckets) {
            *b ^= o;
        }
    }

    /// XORs `part` into `bucket` (`bucket < DIGEST_BUCKETS`, as [`DocId::bucket`] returns).
    pub(crate) fn xor(&mut self, bucket: u32, part: u64) {
        self.buckets[bucket as usize] ^= part;
    }

    /// Builds a digest from received bucket values; `None` unless exactly [`DIGEST_BUCKETS`].
    pub fn from_buckets(buckets: Vec<u64>) -> Option<Self> {
        (buckets.len() == DIGEST_BUCKETS as usize).then_some(Self { buckets })
    }

    /// The bucket values, [`DIGEST_BUCKETS`] of them.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(w: &str, generation: u64, h: u8) -> DocEntry {
        DocEntry {
            doc: DocId::new("c", w),
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
            vec![DocId::new("c", "b").bucket()]
        );
        let mut inc = d1.clone();
        inc.toggle(&a[1]);
        inc.toggle(&changed[1]);
        assert_eq!(inc, d3);
    }

    #[test]
    fn fingerprint_is_pinned() {
        // Wire-visible: peers XOR these into the digest they send.
        assert_eq!(entry("a", 1, 1).fingerprint(), 0xef6c_92b1_49a1_ade9);
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
