//! Document identity and naming rules, writer actor derivation, and the hashes used by digests
//! and file names. The mesh names documents on the wire with these same types.

use automerge::ActorId;
use sha2::{Digest as _, Sha256};
use std::fmt;

/// The reserved cluster segment of replica-written reservation documents: replica `<id>` writes
/// `DocId { cluster: "_reservations", writer: <id> }`. The leading `_` is not a valid name
/// segment ([`valid_segment`]), so no member cluster and no agent can ever be named by it.
pub const RESERVATION_SCOPE: &str = "_reservations";

/// The reserved cluster segment of replica-written retirement documents: replica `<id>` writes
/// `DocId { cluster: "_retired", writer: <id> }`, one tombstone per member cluster it retired.
/// Not a valid name segment either.
pub const RETIRED_SCOPE: &str = "_retired";

/// The replicas' own scopes: cluster segments of documents only replicas write.
pub const REPLICA_SCOPES: [&str; 2] = [RESERVATION_SCOPE, RETIRED_SCOPE];

/// Whether `cluster` is one of the replicas' own scopes ([`REPLICA_SCOPES`]) rather than a
/// member cluster.
pub fn is_replica_scope(cluster: &str) -> bool {
    REPLICA_SCOPES.contains(&cluster)
}

/// Writer name of a cluster's whole-cluster publisher (`--source dir` agents: one writer
/// publishes every node's records). `_` is not a valid node name, so no per-node identity can
/// name it; every other writer of a member cluster publishes only its own node's records
/// (see `Store`'s writer scopes).
pub const CLUSTER_PUBLISHER: &str = "_cluster";

/// Longest accepted name segment, matching a DNS subdomain name.
const MAX_SEGMENT_LEN: usize = 253;

/// Whether `s` is a valid name segment (cluster, agent node or replica id): 1-253 bytes of
/// `[a-z0-9.-]`, starting and ending with a lowercase letter or digit. One spelling per name,
/// so two spellings can never denote the same document or identity.
pub fn valid_segment(s: &str) -> bool {
    let bytes = s.as_bytes();
    let (Some(&first), Some(&last)) = (bytes.first(), bytes.last()) else {
        return false;
    };
    if bytes.len() > MAX_SEGMENT_LEN {
        return false;
    }
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    alnum(first) && alnum(last) && bytes.iter().all(|&b| alnum(b) || b == b'-' || b == b'.')
}

/// Identity of one document: the member cluster it describes and the single writer allowed to
/// author it (an agent node, or for [`RESERVATION_SCOPE`] a replica id).
///
/// The generation is carried alongside, not inside, because a writer's documents of all
/// generations describe the same data and replace each other. The store holds only documents
/// whose id [`is_valid`](DocId::is_valid).
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct DocId {
    /// Member cluster name, or [`RESERVATION_SCOPE`].
    pub cluster: String,
    /// Writer name: the agent node, or the replica id of a reservation document.
    pub writer: String,
}

impl DocId {
    /// The document `writer` writes about `cluster`.
    pub fn new(cluster: impl Into<String>, writer: impl Into<String>) -> Self {
        DocId {
            cluster: cluster.into(),
            writer: writer.into(),
        }
    }

    /// The reservation document written by replica `id`.
    pub fn reservations(id: impl Into<String>) -> Self {
        Self::new(RESERVATION_SCOPE, id)
    }

    /// The retirement document written by replica `id`.
    pub fn retired(id: impl Into<String>) -> Self {
        Self::new(RETIRED_SCOPE, id)
    }

    /// Whether this is a replica's reservation document (not a member cluster's).
    pub fn is_reservations(&self) -> bool {
        self.cluster == RESERVATION_SCOPE
    }

    /// Whether this document is written by a replica ([`is_replica_scope`]) rather than
    /// describing a member cluster.
    pub fn is_replica_scope(&self) -> bool {
        is_replica_scope(&self.cluster)
    }

    /// Both parts are valid name segments ([`valid_segment`]) or the writer is
    /// [`CLUSTER_PUBLISHER`], or the cluster is a replica scope ([`DocId::is_replica_scope`])
    /// and the writer a valid replica id.
    pub fn is_valid(&self) -> bool {
        if self.is_replica_scope() {
            return valid_segment(&self.writer);
        }
        valid_segment(&self.cluster)
            && (valid_segment(&self.writer) || self.writer == CLUSTER_PUBLISHER)
    }

    /// Whether this is a member cluster's whole-cluster publisher document
    /// ([`CLUSTER_PUBLISHER`]).
    pub fn is_cluster_publisher(&self) -> bool {
        self.writer == CLUSTER_PUBLISHER && !self.is_replica_scope()
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

    /// The [`Digest`](crate::Digest) bucket of this document, in `0..DIGEST_BUCKETS`. Part of
    /// the mesh wire protocol: peers compare buckets by index.
    pub fn bucket(&self) -> u32 {
        let mut h = Sha256::new();
        h.update(self.cluster.as_bytes());
        h.update([0]);
        h.update(self.writer.as_bytes());
        (first_u64(&h.finalize()) % u64::from(crate::DIGEST_BUCKETS)) as u32
    }

    /// File stem used for this document in a store directory (hex of the first 16 hash bytes).
    pub(crate) fn file_stem(&self) -> String {
        hex(&self.hash()[..16])
    }
}

impl fmt::Display for DocId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.cluster, self.writer)
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

/// SHA-256 over a document generation's sorted automerge heads.
pub type HeadsHash = [u8; 32];

/// SHA-256 over the sorted heads: equal for two copies exactly when they hold the same changes.
/// Takes automerge's `ChangeHash`es or their 32 bytes (as carried on the wire) alike.
pub fn heads_hash<H: AsRef<[u8]> + Ord>(heads: &[H]) -> HeadsHash {
    let mut sorted: Vec<&H> = heads.iter().collect();
    sorted.sort();
    let mut h = Sha256::new();
    for c in sorted {
        h.update(c.as_ref());
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

/// The first 8 bytes of a hash as a big-endian number (bucket indexes, digest entry hashes).
pub(crate) fn first_u64(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naming_rules() {
        assert!(DocId::new("east-1", "node-7.x").is_valid());
        assert!(DocId::reservations("r1").is_valid());
        assert!(!DocId::reservations("R1").is_valid());
        assert!(!DocId::new("_other", "r1").is_valid());
        for bad in ["", "-a", "a-", "A", "a_b", "a/b", &"a".repeat(254)] {
            assert!(!DocId::new("c", bad).is_valid(), "{bad:?} accepted");
            assert!(!DocId::new(bad, "w").is_valid(), "{bad:?} accepted");
        }
        assert!(DocId::new("c", "a".repeat(253)).is_valid());
    }

    #[test]
    fn bucket_is_pinned() {
        // Wire-visible: these values must not change without a protocol version bump.
        let buckets: Vec<u32> = ["a", "b", "c", "d"]
            .iter()
            .map(|w| DocId::new("east", *w).bucket())
            .collect();
        assert_eq!(buckets, [51, 27, 4, 50]);
    }
}
