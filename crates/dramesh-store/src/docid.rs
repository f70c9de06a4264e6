//! Document identity, writer actor derivation, and the hashes used by digests and file names.

use automerge::{ActorId, ChangeHash};
use sha2::{Digest as _, Sha256};
use std::fmt;

/// Identity of one document: the member cluster it describes and the single writer allowed to
/// author it (an agent identity such as `agent/<node>`).
///
/// The generation is carried alongside, not inside, because a writer's documents of all
/// generations describe the same data and replace each other.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct DocId {
    pub cluster: String,
    pub writer: String,
}

impl DocId {
    pub fn new(cluster: impl Into<String>, writer: impl Into<String>) -> Self {
        DocId {
            cluster: cluster.into(),
            writer: writer.into(),
        }
    }

    /// SHA-256 of the length-prefixed cluster and writer, stable across versions and processes.
    pub fn hash(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update((self.cluster.len() as u64).to_le_bytes());
        h.update(self.cluster.as_bytes());
        h.update((self.writer.len() as u64).to_le_bytes());
        h.update(self.writer.as_bytes());
        h.finalize().into()
    }

    /// Digest bucket of this document, in `0..buckets`.
    pub fn bucket(&self, buckets: usize) -> usize {
        let h = self.hash();
        let v = u64::from_le_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]]);
        (v % buckets.max(1) as u64) as usize
    }

    /// File stem used for this document in a store directory (hex of the first 16 hash bytes).
    pub(crate) fn file_stem(&self) -> String {
        hex(&self.hash()[..16])
    }
}

impl fmt::Display for DocId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.cluster, self.writer)
    }
}

/// The only automerge actor allowed to author changes to `doc` at `generation`.
///
/// Deriving it (rather than storing it) lets every replica check authorship without any
/// registry, and a fresh actor per generation means a writer that restarts from scratch never
/// reuses an (actor, seq) pair that replicas already hold with different content.
pub fn writer_actor(doc: &DocId, generation: u64) -> ActorId {
    let mut h = Sha256::new();
    h.update(b"dramesh-store/actor/v1");
    h.update(doc.hash());
    h.update(generation.to_le_bytes());
    let out: [u8; 32] = h.finalize().into();
    ActorId::from(&out[..16])
}

/// SHA-256 over the sorted heads: equal for two copies exactly when they hold the same changes.
pub fn heads_hash(heads: &[ChangeHash]) -> [u8; 32] {
    let mut sorted: Vec<&ChangeHash> = heads.iter().collect();
    sorted.sort();
    let mut h = Sha256::new();
    for c in sorted {
        h.update(c.0);
    }
    h.finalize().into()
}

/// Lowercase hex of `bytes` (file stems, digests in logs and APIs).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}
