//! [`SyncState`]: what one peer's automerge sync session knows about one document, kept opaque
//! so that automerge's types stay inside this crate (the pinned release changes here only).

use automerge::Automerge;
use automerge::sync::{self, SyncDoc};

/// The sync state of one (document generation, peer) pair. The store reads and updates it in
/// [`Store::generate_sync_message`](crate::Store::generate_sync_message) and
/// [`Store::receive_sync_message`](crate::Store::receive_sync_message); the mesh keeps one per
/// session and document and only resets it or asks it to resend.
#[derive(Debug, Clone)]
pub struct SyncState(pub(crate) sync::State);

impl Default for SyncState {
    fn default() -> Self {
        Self::new()
    }
}

impl SyncState {
    /// A state that knows nothing of the peer: the first message carries our heads only.
    pub fn new() -> Self {
        SyncState(sync::State::new())
    }

    /// Keeps only the heads both sides are known to share, forgetting messages in flight and
    /// what the peer claimed to have, so the next generate always produces a message. This is
    /// what survives a reconnection.
    pub fn reset(&mut self) {
        self.0 = sync::State::decode(&self.0.encode()).unwrap_or_else(|_| sync::State::new());
    }

    /// Forgets having sent the changes the peer's last message asked for, so the next generate
    /// sends them again.
    ///
    /// automerge never sends a change twice on one sync state, even when the peer then asks
    /// for it by hash because the message carrying it was lost or refused; both ends would
    /// then exchange messages forever.
    pub fn resend_requested(&mut self) {
        if let Some(need) = &self.0.their_need {
            for hash in need {
                self.0.sent_hashes.remove(hash);
            }
        }
    }

    /// The reply of an empty document: for a document not held yet, it tells the sender to
    /// send every change. `None` when this state already sent it.
    pub fn empty_doc_message(&mut self) -> Option<Vec<u8>> {
        Automerge::new()
            .generate_sync_message(&mut self.0)
            .map(|m| m.encode())
    }

    /// The automerge state itself, for in-memory test stores outside this crate only.
    #[cfg(feature = "test-util")]
    pub fn automerge_mut(&mut self) -> &mut sync::State {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use automerge::ROOT;
    use automerge::transaction::Transactable;

    fn doc_with(key: &str) -> Automerge {
        let mut d = Automerge::new();
        let mut tx = d.transaction();
        tx.put(ROOT, key, "v").unwrap();
        tx.commit();
        d
    }

    /// Runs sync messages between `a` and `b` until neither has anything to send.
    fn sync_all(a: &mut Automerge, sa: &mut SyncState, b: &mut Automerge, sb: &mut SyncState) {
        for _ in 0..10 {
            let m1 = a.generate_sync_message(&mut sa.0);
            if let Some(m) = &m1 {
                b.receive_sync_message(&mut sb.0, m.clone()).unwrap();
            }
            let m2 = b.generate_sync_message(&mut sb.0);
            if let Some(m) = &m2 {
                a.receive_sync_message(&mut sa.0, m.clone()).unwrap();
            }
            if m1.is_none() && m2.is_none() {
                return;
            }
        }
        panic!("did not settle");
    }

    #[test]
    fn reset_keeps_shared_heads_and_generates_again() {
        let mut a = doc_with("k");
        let mut b = Automerge::new();
        let (mut sa, mut sb) = (SyncState::new(), SyncState::new());
        sync_all(&mut a, &mut sa, &mut b, &mut sb);
        assert_eq!(b.get_heads(), a.get_heads());
        assert!(a.generate_sync_message(&mut sa.0).is_none());
        sa.reset();
        assert_eq!(sa.0.shared_heads, a.get_heads());
        assert!(a.generate_sync_message(&mut sa.0).is_some());
    }

    #[test]
    fn resend_requested_forgets_only_what_the_peer_needs() {
        let mut a = doc_with("k");
        let asked = a.get_heads()[0];
        let mut tx = a.transaction();
        tx.put(ROOT, "k2", "v").unwrap();
        tx.commit();
        let other = a.get_heads()[0];
        let mut s = SyncState::new();
        s.0.sent_hashes.extend([asked, other]);
        s.0.their_need = Some(vec![asked]);
        s.resend_requested();
        assert!(!s.0.sent_hashes.contains(&asked));
        assert!(s.0.sent_hashes.contains(&other));
        // Nothing asked for: nothing forgotten.
        s.0.their_need = None;
        s.resend_requested();
        assert!(s.0.sent_hashes.contains(&other));
    }

    #[test]
    fn empty_doc_message_once() {
        let mut s = SyncState::new();
        let first = s.empty_doc_message().unwrap();
        assert!(sync::Message::decode(&first).is_ok());
        assert!(s.empty_doc_message().is_none());
    }
}
