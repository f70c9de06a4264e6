//! Digests: each document's entry (generation, heads) XORed into its bucket, per store and
//! per cluster, maintained incrementally.

use super::*;

/// The store's digest and each member cluster's (see [`Store::cluster_digest`]), kept up to
/// date as entries change.
pub(super) struct Digests {
    pub(super) all: Digest,
    pub(super) by_cluster: HashMap<String, Digest>,
}

impl Store {
    pub(super) fn set_digest(&mut self, doc: &DocId) {
        let Some(e) = self.docs.get_mut(doc) else {
            return;
        };
        let hh = heads_hash(&e.doc.get_heads());
        let part = fingerprint(doc, e.generation, &hh);
        let (bucket, change) = (e.bucket, e.digest_part ^ part);
        e.heads_hash = hh;
        e.digest_part = part;
        self.xor_digest(doc, bucket, change);
    }

    /// XORs `part` into `bucket` of the digest and of `doc`'s cluster digest: the one place
    /// both change.
    pub(super) fn xor_digest(&mut self, doc: &DocId, bucket: u32, part: u64) {
        self.digests.all.xor(bucket, part);
        match self.digests.by_cluster.get_mut(&doc.cluster) {
            Some(d) => d.xor(bucket, part),
            None => {
                let mut d = Digest::empty();
                d.xor(bucket, part);
                self.digests.by_cluster.insert(doc.cluster.clone(), d);
            }
        }
    }

    /// The entry of every document, sorted by document.
    pub fn entries(&self) -> Vec<DocEntry> {
        self.docs
            .iter()
            .map(|(id, e)| Self::entry_of(id, e))
            .collect()
    }

    /// How many documents are held (what `entries().len()` says, without listing them).
    pub fn doc_count(&self) -> usize {
        self.docs.len()
    }

    /// The entry of one document.
    pub fn entry(&self, doc: &DocId) -> Option<DocEntry> {
        self.docs.get(doc).map(|e| Self::entry_of(doc, e))
    }

    /// The automerge heads of the held generation of `doc` (what its entry's `heads_hash`
    /// hashes), as 32-byte change hashes.
    pub fn heads(&self, doc: &DocId) -> Option<Vec<[u8; 32]>> {
        self.docs
            .get(doc)
            .map(|e| e.doc.get_heads().into_iter().map(|h| h.0).collect())
    }

    /// Whether the held generation `generation` of `doc` contains every change in `heads`
    /// (so a peer whose heads they are holds nothing this copy lacks).
    pub fn holds_changes(&self, doc: &DocId, generation: u64, heads: &[[u8; 32]]) -> bool {
        self.docs.get(doc).is_some_and(|e| {
            e.generation == generation
                && heads
                    .iter()
                    .all(|h| e.doc.get_change_by_hash(&ChangeHash(*h)).is_some())
        })
    }

    pub(super) fn entry_of(doc: &DocId, e: &Held) -> DocEntry {
        DocEntry {
            doc: doc.clone(),
            generation: e.generation,
            heads_hash: e.heads_hash,
        }
    }

    /// The digest of all entries, maintained on every mutation.
    pub fn digest(&self) -> &Digest {
        &self.digests.all
    }

    /// The entries of the documents in the digest buckets `buckets` ([`DocId::bucket`]) that
    /// `keep` accepts, each with its bucket, ordered by bucket. One pass over the documents
    /// whatever the number of buckets, and only kept documents' ids are copied: listed bucket
    /// by bucket, a hundred thousand documents' entries were ~40 % of a replica's CPU early in
    /// a heal.
    pub fn bucket_entries(
        &self,
        buckets: &[u32],
        keep: impl Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        Self::entries_in(self.docs.iter(), buckets, keep)
    }

    pub(super) fn entries_in<'a>(
        docs: impl Iterator<Item = (&'a DocId, &'a Held)>,
        buckets: &[u32],
        keep: impl Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        let mask = crate::digest::bucket_mask(buckets);
        let mut out: Vec<(u32, DocEntry)> = docs
            .filter(|(id, e)| mask & (1u64 << e.bucket) != 0 && keep(id))
            .map(|(id, e)| (e.bucket, Self::entry_of(id, e)))
            .collect();
        out.sort_by_key(|(b, _)| *b);
        out
    }

    /// The digest over the documents of member cluster `cluster` (empty when none is held),
    /// maintained like [`Store::digest`]: what a replica and a cluster's relay compare.
    pub fn cluster_digest(&self, cluster: &str) -> Digest {
        self.digests
            .by_cluster
            .get(cluster)
            .cloned()
            .unwrap_or_else(Digest::empty)
    }

    /// [`Store::bucket_entries`] of member cluster `cluster`'s documents only (a range of the
    /// document map, not a scan of it).
    pub fn cluster_bucket_entries(
        &self,
        cluster: &str,
        buckets: &[u32],
        keep: impl Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        let docs = self
            .docs
            .range(DocId::new(cluster, "")..)
            .take_while(|(d, _)| d.cluster == cluster);
        Self::entries_in(docs, buckets, keep)
    }

    /// Size and history figures of one document.
    pub fn doc_stats(&self, doc: &DocId) -> Option<DocStats> {
        self.docs.get(doc).map(|e| {
            let (num_changes, num_ops) = history(&e.doc);
            DocStats {
                generation: e.generation,
                owned: e.owned,
                stored_bytes: e.stored_bytes,
                base_bytes: e.base_bytes,
                fresh_bytes: e.fresh_bytes,
                commits_since_base: e.commits_since_base,
                num_changes,
                num_ops,
                keys: e.doc.length(ROOT),
            }
        })
    }

    /// Size in bytes of a freshly rebuilt copy of `doc` (its current values only); used to
    /// check the bounded-history figure.
    pub fn fresh_size(&self, doc: &DocId) -> Result<Option<usize>, StoreError> {
        match self.docs.get(doc) {
            None => Ok(None),
            Some(e) => Ok(Some(
                persist::pack_snapshot(&build_fresh(doc, &e.doc, e.generation, false)?).len(),
            )),
        }
    }
}
