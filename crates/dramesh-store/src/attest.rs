//! Signed heads: proof of authorship that travels with a document, whoever relays it.
//!
//! Authorship by actor id ([`crate::writer_actor`]) is public data, so anyone able to send a sync
//! message could author changes as any writer. A writer therefore signs statements
//! "document D, generation G, heads H" ([`statement`]) with the key of its mesh certificate, and
//! a receiver applies a message's changes only when all of them are ancestors-or-equal of the
//! heads of a statement whose signature it verified ([`proven`]). automerge change hashes
//! chain through their dependencies, so a signature over the heads authenticates every change
//! reachable from them; a writer's history is linear (one actor per generation), and automerge
//! sends a peer every descendant of any change it sends, so a message's changes are always
//! reachable from the sender's heads through the message itself.
//!
//! A replica keeps the newest verified [`Attestation`] of each document it holds (on disk too,
//! see `persist`), so when it relays the document, or after a restart, it proves the changes it
//! sends with the writer's own signature. The store does no cryptography: the mesh provides the
//! [`HeadsSigner`] (its certificate's key) and [`HeadsVerifier`] (chain to the mesh CA, identity
//! owns the document, signature) through [`Trust`].

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use automerge::ChangeHash;

use crate::docid::DocId;

/// Domain tag of signed statements, so a signature can never be replayed as anything else.
const STATEMENT_TAG: &[u8] = b"dramesh signed heads v1\0";
/// Most heads one attestation may name (a writer's history is linear: one in practice).
pub const MAX_SIGNED_HEADS: usize = 64;
/// Largest signature or signer credential accepted (a certificate chain, DER).
pub const MAX_PROOF_BYTES: usize = 16 * 1024;

/// A writer's signature over the heads of one generation of its document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attestation {
    /// The signed heads, sorted.
    pub heads: Vec<[u8; 32]>,
    /// The signature over [`statement`], in the signer's encoding (opaque to the store).
    pub signature: Vec<u8>,
    /// Who signed: the writer's credential (its certificate chain), opaque to the store.
    pub signer: Arc<[u8]>,
}

impl Attestation {
    /// Whether these are exactly `heads` (in any order).
    pub(crate) fn signs_heads(&self, heads: &[ChangeHash]) -> bool {
        let mut mine: Vec<[u8; 32]> = heads.iter().map(|h| h.0).collect();
        mine.sort_unstable();
        mine == self.heads
    }

    /// Encoding of a store record: `n:u16le heads[n] sig_len:u32le sig signer`.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            2 + 32 * self.heads.len() + 4 + self.signature.len() + self.signer.len(),
        );
        out.extend_from_slice(&(self.heads.len() as u16).to_le_bytes());
        for h in &self.heads {
            out.extend_from_slice(h);
        }
        out.extend_from_slice(&(self.signature.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.signature);
        out.extend_from_slice(&self.signer);
        out
    }

    /// Inverse of [`Attestation::encode`].
    pub(crate) fn decode(bytes: &[u8]) -> Result<Attestation, String> {
        let short = || "signed-heads record is cut short".to_string();
        let n = u16::from_le_bytes(
            bytes
                .get(..2)
                .ok_or_else(short)?
                .try_into()
                .map_err(|_| short())?,
        ) as usize;
        if n > MAX_SIGNED_HEADS {
            return Err(format!(
                "signed-heads record names {n} heads (at most {MAX_SIGNED_HEADS})"
            ));
        }
        let mut pos = 2;
        let mut heads = Vec::with_capacity(n);
        for _ in 0..n {
            let h: [u8; 32] = bytes
                .get(pos..pos + 32)
                .ok_or_else(short)?
                .try_into()
                .map_err(|_| short())?;
            heads.push(h);
            pos += 32;
        }
        let len = u32::from_le_bytes(
            bytes
                .get(pos..pos + 4)
                .ok_or_else(short)?
                .try_into()
                .map_err(|_| short())?,
        ) as usize;
        pos += 4;
        let signature = bytes
            .get(pos..pos.saturating_add(len))
            .ok_or_else(short)?
            .to_vec();
        let signer: Arc<[u8]> = Arc::from(&bytes[pos + len..]);
        Attestation::new(heads, signature, signer)
    }

    /// An attestation with its heads sorted, refusing sizes beyond the bounds above.
    pub fn new(
        mut heads: Vec<[u8; 32]>,
        signature: Vec<u8>,
        signer: Arc<[u8]>,
    ) -> Result<Attestation, String> {
        if heads.len() > MAX_SIGNED_HEADS {
            return Err(format!(
                "attestation names {} heads (at most {MAX_SIGNED_HEADS})",
                heads.len()
            ));
        }
        if signature.len() > MAX_PROOF_BYTES || signer.len() > MAX_PROOF_BYTES {
            return Err(format!(
                "attestation signature ({} bytes) or signer ({} bytes) exceeds {MAX_PROOF_BYTES} bytes",
                signature.len(),
                signer.len()
            ));
        }
        heads.sort_unstable();
        heads.dedup();
        Ok(Attestation {
            heads,
            signature,
            signer,
        })
    }
}

/// The bytes a writer signs for `doc` at `generation` with `heads` (sorted by the caller or
/// not: they are sorted here).
pub fn statement(doc: &DocId, generation: u64, heads: &[[u8; 32]]) -> Vec<u8> {
    let mut sorted = heads.to_vec();
    sorted.sort_unstable();
    let mut out = Vec::with_capacity(
        STATEMENT_TAG.len() + doc.cluster.len() + doc.writer.len() + 2 + 8 + 4 + 32 * heads.len(),
    );
    out.extend_from_slice(STATEMENT_TAG);
    out.extend_from_slice(doc.cluster.as_bytes());
    out.push(0);
    out.extend_from_slice(doc.writer.as_bytes());
    out.push(0);
    out.extend_from_slice(&generation.to_be_bytes());
    out.extend_from_slice(&(sorted.len() as u32).to_be_bytes());
    for h in &sorted {
        out.extend_from_slice(h);
    }
    out
}

/// An encoded sync message and the signature over the heads it leads to (when it carries
/// changes and one is held).
pub type SignedMessage = (Vec<u8>, Option<Attestation>);

/// Signs statements with the key of this node's mesh identity.
pub trait HeadsSigner: Send + Sync {
    /// The signer credential to ship with signatures (the certificate chain).
    fn signer(&self) -> Arc<[u8]>;
    /// Signs `statement`.
    fn sign(&self, statement: &[u8]) -> Result<Vec<u8>, String>;
}

/// Checks that `signer` is a credential the mesh trusts, that its identity may write `doc`, and
/// that `signature` over `statement` was made with its key.
pub trait HeadsVerifier: Send + Sync {
    /// `Ok` only when all three hold; otherwise why not.
    fn verify(
        &self,
        doc: &DocId,
        statement: &[u8],
        signature: &[u8],
        signer: &[u8],
    ) -> Result<(), String>;
}

/// What a store signs its own documents with and verifies received changes against. A store
/// without trust (tests and benches of the store alone) checks change authors only.
#[derive(Clone)]
pub struct Trust {
    /// Signs this store's own documents; `None` for a node that writes none.
    pub signer: Option<Arc<dyn HeadsSigner>>,
    /// Verifies every received change before it is applied.
    pub verifier: Arc<dyn HeadsVerifier>,
}

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trust")
            .field("signs", &self.signer.is_some())
            .finish()
    }
}

/// A change carried by a message: its hash and dependencies.
#[derive(Debug)]
pub(crate) struct Carried {
    pub hash: ChangeHash,
    pub deps: Vec<ChangeHash>,
    /// The chunk as it arrived, when it arrived compressed (kept for sending it on).
    pub packed: Option<Arc<[u8]>>,
    /// It came inside a whole saved document (which cannot be applied in part).
    pub whole_document: bool,
}

/// The carried changes that are one of `roots` or an ancestor of one through carried changes.
/// With the heads of a verified signature as roots these are proven (hashes chain through
/// dependencies); so are the missing dependencies of changes a copy queued after proving them,
/// whose hashes those changes name.
pub(crate) fn proven(
    carried: &[Carried],
    roots: impl IntoIterator<Item = ChangeHash>,
) -> HashSet<ChangeHash> {
    let by_hash: HashMap<ChangeHash, &Carried> = carried.iter().map(|c| (c.hash, c)).collect();
    let mut reached: HashSet<ChangeHash> = HashSet::with_capacity(carried.len());
    let mut stack: Vec<ChangeHash> = roots.into_iter().collect();
    while let Some(h) = stack.pop() {
        let Some(c) = by_hash.get(&h) else {
            continue;
        };
        if reached.insert(h) {
            stack.extend(c.deps.iter().copied());
        }
    }
    reached
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(b: u8) -> ChangeHash {
        ChangeHash([b; 32])
    }

    fn chain(n: u8) -> Vec<Carried> {
        (1..=n)
            .map(|i| Carried {
                hash: h(i),
                deps: if i == 1 { vec![] } else { vec![h(i - 1)] },
                packed: None,
                whole_document: false,
            })
            .collect()
    }

    /// The first carried change not proven from `roots`, if any.
    fn unproven(carried: &[Carried], roots: &[u8]) -> Option<ChangeHash> {
        let p = proven(carried, roots.iter().map(|b| h(*b)));
        carried.iter().map(|c| c.hash).find(|c| !p.contains(c))
    }

    #[test]
    fn a_chain_is_covered_by_its_top_only() {
        let c = chain(4);
        assert_eq!(unproven(&c, &[4]), None);
        assert_eq!(unproven(&c, &[3]), Some(h(4)));
        assert_eq!(unproven(&c, &[9]), Some(h(1)));
        assert_eq!(unproven(&[], &[]), None);
        // A change hanging off the chain that the heads do not reach is refused.
        let mut forged = chain(3);
        forged.push(Carried {
            hash: h(7),
            deps: vec![h(2)],
            packed: None,
            whole_document: false,
        });
        assert_eq!(unproven(&forged, &[3]), Some(h(7)));
        // A gap: 4 and 2 carried, 3 not. From the head only 4 is proven.
        let gap: Vec<Carried> = chain(4).into_iter().filter(|c| c.hash != h(3)).collect();
        let p = proven(&gap, [h(4)]);
        assert!(p.contains(&h(4)) && !p.contains(&h(2)));
        // The resend of 3 and 2, after 4 was queued: 3 is named as 4's missing dependency,
        // which proves it and what it leads to.
        let resend: Vec<Carried> = chain(3).into_iter().filter(|c| c.hash != h(1)).collect();
        assert_eq!(unproven(&resend, &[4]), Some(h(2)));
        let p = proven(&resend, [h(4), h(3)]);
        assert!(p.contains(&h(3)) && p.contains(&h(2)), "{p:?}");
    }

    #[test]
    fn statement_binds_document_generation_and_heads() {
        let d = DocId::new("c", "w");
        let s = statement(&d, 5, &[[2; 32], [1; 32]]);
        assert_eq!(s, statement(&d, 5, &[[1; 32], [2; 32]]));
        assert_ne!(s, statement(&d, 6, &[[1; 32], [2; 32]]));
        assert_ne!(s, statement(&DocId::new("c", "x"), 5, &[[1; 32], [2; 32]]));
        assert_ne!(s, statement(&d, 5, &[[1; 32]]));
    }

    #[test]
    fn record_round_trips_and_bounds_hold() {
        let a =
            Attestation::new(vec![[3; 32], [1; 32]], vec![9; 70], Arc::from(&b"cert"[..])).unwrap();
        assert_eq!(a.heads, vec![[1; 32], [3; 32]]);
        assert_eq!(Attestation::decode(&a.encode()).unwrap(), a);
        assert!(Attestation::decode(&a.encode()[..40]).is_err());
        assert!(Attestation::new(vec![[0; 32]; 65], vec![], Arc::from(&b""[..])).is_err());
        assert!(
            Attestation::new(vec![], vec![0; MAX_PROOF_BYTES + 1], Arc::from(&b""[..])).is_err()
        );
    }
}
