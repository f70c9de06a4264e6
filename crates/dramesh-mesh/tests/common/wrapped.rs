//! A [`DocStore`] over the real [`MeshStore`] with test hooks: it records every sync message
//! given to it, and while `fail_commits` is set the fsync half of each batch commit fails (as
//! a failing disk would: the store is told, so the covered files are pending again).
// Each test crate that includes this uses some of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use dramesh_mesh::store::RejectReason;
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_mesh::{DocStore, PeerIdentity};
use dramesh_store::{
    Attestation, Digest, DocEntry, DocId, PendingSync, SignedMessage, StoreError, SyncState, Trust,
};

/// See the module docs.
pub(crate) struct Wrapped {
    pub(crate) inner: MeshStore,
    /// Every sync message given to the store (document, payload), in order.
    pub(crate) received: Vec<(DocId, Vec<u8>)>,
    /// While set, batch commits fail.
    pub(crate) fail_commits: Arc<AtomicBool>,
}

impl Wrapped {
    pub(crate) fn new(inner: MeshStore) -> Wrapped {
        Wrapped {
            inner,
            received: Vec::new(),
            fail_commits: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl DocStore for Wrapped {
    fn digest(&self) -> Digest {
        self.inner.digest()
    }
    fn bucket_entries(&self, b: &[u32], keep: &dyn Fn(&DocId) -> bool) -> Vec<(u32, DocEntry)> {
        self.inner.bucket_entries(b, keep)
    }
    fn entry(&self, doc: &DocId) -> Option<DocEntry> {
        self.inner.entry(doc)
    }
    fn heads(&self, doc: &DocId) -> Vec<[u8; 32]> {
        self.inner.heads(doc)
    }
    fn holds_changes(&self, doc: &DocId, generation: u64, heads: &[[u8; 32]]) -> bool {
        self.inner.holds_changes(doc, generation, heads)
    }
    fn generate_sync_message(&mut self, doc: &DocId, s: &mut SyncState) -> Option<SignedMessage> {
        self.inner.generate_sync_message(doc, s)
    }
    fn receive_sync_message(
        &mut self,
        from: &PeerIdentity,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
        msg: &[u8],
        signed: Option<&Attestation>,
    ) -> Result<(), RejectReason> {
        self.received.push((doc.clone(), msg.to_vec()));
        self.inner
            .receive_sync_message(from, doc, generation, state, msg, signed)
    }
    fn set_trust(&mut self, trust: Trust) {
        self.inner.set_trust(trust);
    }
    fn flush(&mut self) -> Result<(), RejectReason> {
        self.inner.flush()
    }
    fn begin_flush(&mut self) -> Result<Option<PendingSync>, RejectReason> {
        self.inner.begin_flush()
    }
    fn complete_flush(
        &mut self,
        sync: PendingSync,
        result: Result<(), StoreError>,
    ) -> Result<(), RejectReason> {
        let result = if self.fail_commits.load(Ordering::SeqCst) {
            Err(StoreError::Io {
                path: Default::default(),
                source: std::io::Error::other("injected fsync failure"),
            })
        } else {
            result
        };
        self.inner.complete_flush(sync, result)
    }
    fn maintain(&mut self) {
        self.inner.maintain();
    }
}
