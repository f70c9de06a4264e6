//! In-memory [`DocStore`] over real automerge documents, for tests and benches (feature
//! `test-util`).
//!
//! Each document is written by exactly one automerge actor, the store's
//! [`writer_actor`] of its id and generation. Incoming sync messages are applied to a scratch
//! copy first; the copy replaces the held document only when every new change is
//! authored by that actor, so an unauthorized message leaves nothing behind. Nothing is
//! persisted.
//! Signatures are neither produced nor checked: protocol tests that need them use the real
//! store ([`crate::store_adapter::MeshStore`]).

use std::collections::BTreeMap;

use automerge::sync::{self, SyncDoc};
use automerge::transaction::Transactable;
use automerge::{Automerge, ChangeHash, ROOT, ReadDoc};
use dramesh_store::{
    Attestation, Digest, DocEntry, DocId, SignedMessage, SyncState, heads_hash, writer_actor,
};

use crate::identity::PeerIdentity;
use crate::store::{DocStore, RejectReason};

struct Held {
    generation: u64,
    doc: Automerge,
}

/// See the module docs.
#[derive(Default)]
pub struct MemStore {
    docs: BTreeMap<DocId, Held>,
    digest: Digest,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn entry_of(doc: &DocId, held: &Held) -> DocEntry {
        DocEntry {
            doc: doc.clone(),
            generation: held.generation,
            heads_hash: heads_hash(&held.doc.get_heads()),
        }
    }

    fn replace(&mut self, doc: &DocId, held: Held) {
        if let Some(old) = self.docs.get(doc) {
            self.digest.toggle(&Self::entry_of(doc, old));
        }
        self.digest.toggle(&Self::entry_of(doc, &held));
        self.docs.insert(doc.clone(), held);
    }

    /// Writes `key = value` into `doc` as its writer (creating generation 1 if absent).
    pub fn put(&mut self, doc: &DocId, key: &str, value: &str) -> Result<(), RejectReason> {
        let mut held = match self.docs.remove(doc) {
            Some(h) => {
                self.digest.toggle(&Self::entry_of(doc, &h));
                h
            }
            None => Held {
                generation: 1,
                doc: Automerge::new().with_actor(writer_actor(doc, 1)),
            },
        };
        held.doc.set_actor(writer_actor(doc, held.generation));
        let mut tx = held.doc.transaction();
        let res = tx.put(ROOT, key, value);
        tx.commit();
        self.digest.toggle(&Self::entry_of(doc, &held));
        self.docs.insert(doc.clone(), held);
        res.map_err(|e| RejectReason::Store(format!("put {doc} {key}: {e}")))
    }

    /// Starts the next generation of `doc` holding a copy of the current values only.
    pub fn roll_generation(&mut self, doc: &DocId) -> Result<u64, RejectReason> {
        let Some(old) = self.docs.get(doc) else {
            return Err(RejectReason::Store(format!("no document {doc}")));
        };
        let values: Vec<(String, String)> = old
            .doc
            .map_range(ROOT, ..)
            .filter_map(|item| {
                let s = item.value.to_str()?.to_owned();
                Some((item.key.to_string(), s))
            })
            .collect();
        let generation = old.generation + 1;
        let mut fresh = Automerge::new().with_actor(writer_actor(doc, generation));
        let mut tx = fresh.transaction();
        for (k, v) in &values {
            tx.put(ROOT, k.as_str(), v.as_str())
                .map_err(|e| RejectReason::Store(format!("roll {doc}: {e}")))?;
        }
        tx.commit();
        self.replace(
            doc,
            Held {
                generation,
                doc: fresh,
            },
        );
        Ok(generation)
    }

    /// Reads a string value of `doc`.
    pub fn get(&self, doc: &DocId, key: &str) -> Option<String> {
        let held = self.docs.get(doc)?;
        let (value, _) = held.doc.get(ROOT, key).ok()??;
        value.to_str().map(str::to_owned)
    }

    /// Every held entry, sorted by document.
    pub fn entries(&self) -> Vec<DocEntry> {
        self.docs
            .iter()
            .map(|(d, h)| Self::entry_of(d, h))
            .collect()
    }

    /// Number of held documents.
    pub fn len(&self) -> usize {
        self.docs.len()
    }

    /// Whether no document is held.
    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }
}

impl DocStore for MemStore {
    fn digest(&self) -> Digest {
        self.digest.clone()
    }

    fn bucket_entries(
        &self,
        buckets: &[u32],
        keep: &dyn Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        let mut out: Vec<(u32, DocEntry)> = self
            .docs
            .iter()
            .map(|(d, h)| (d.bucket(), d, h))
            .filter(|(b, d, _)| buckets.contains(b) && keep(d))
            .map(|(b, d, h)| (b, Self::entry_of(d, h)))
            .collect();
        out.sort_by_key(|(b, _)| *b);
        out
    }

    fn entry(&self, doc: &DocId) -> Option<DocEntry> {
        self.docs.get(doc).map(|h| Self::entry_of(doc, h))
    }

    fn heads(&self, doc: &DocId) -> Vec<[u8; 32]> {
        self.docs
            .get(doc)
            .map(|h| h.doc.get_heads().into_iter().map(|c| c.0).collect())
            .unwrap_or_default()
    }

    fn holds_changes(&self, doc: &DocId, generation: u64, heads: &[[u8; 32]]) -> bool {
        self.docs.get(doc).is_some_and(|h| {
            h.generation == generation
                && heads
                    .iter()
                    .all(|c| h.doc.get_change_by_hash(&ChangeHash(*c)).is_some())
        })
    }

    fn generate_sync_message(
        &mut self,
        doc: &DocId,
        state: &mut SyncState,
    ) -> Option<SignedMessage> {
        let held = self.docs.get(doc)?;
        held.doc
            .generate_sync_message(state.automerge_mut())
            .map(|m| (m.encode(), None))
    }

    fn receive_sync_message(
        &mut self,
        from: &PeerIdentity,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
        msg: &[u8],
        _signed: Option<&Attestation>,
    ) -> Result<(), RejectReason> {
        let message = sync::Message::decode(msg)
            .map_err(|e| RejectReason::Malformed(format!("{doc} from {from}: {e}")))?;
        let mut scratch = match self.docs.get(doc) {
            Some(h) if h.generation > generation => {
                return Err(RejectReason::StaleGeneration {
                    have: h.generation,
                    got: generation,
                });
            }
            Some(h) if h.generation == generation => h.doc.clone(),
            _ => Automerge::new(),
        };
        let before = scratch.get_heads();
        scratch
            .receive_sync_message(state.automerge_mut(), message)
            .map_err(|e| RejectReason::Malformed(format!("{doc} from {from}: {e}")))?;
        let allowed = writer_actor(doc, generation);
        let new_changes = scratch.get_changes(&before);
        if let Some(bad) = new_changes.iter().find(|c| c.actor_id() != &allowed) {
            return Err(RejectReason::Unauthorized(format!(
                "{doc} from {from}: change by actor {} is not the document's writer",
                bad.actor_id()
            )));
        }
        // A message without new changes creates nothing (not even an empty newer generation).
        if scratch.get_heads() != before {
            self.replace(
                doc,
                Held {
                    generation,
                    doc: scratch,
                },
            );
        }
        Ok(())
    }
}
