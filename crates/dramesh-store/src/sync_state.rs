//! [`SyncState`]: what one peer's automerge sync session knows about one document, kept opaque
//! so that automerge's types stay inside this crate (the pinned release changes here only).

use automerge::Automerge;
use automerge::ChangeHash;
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

    /// Takes the peer to hold exactly `heads` and their history (it listed them, and we hold
    /// them too), so the next generate carries every change after them without waiting for the
    /// peer's first message. A peer that holds less asks for the rest by hash as usual; one that
    /// holds more receives changes it has and ignores them.
    pub fn assume_peer_holds(&mut self, heads: &[[u8; 32]]) {
        let heads: Vec<ChangeHash> = heads.iter().map(|h| ChangeHash(*h)).collect();
        self.0.shared_heads.clone_from(&heads);
        self.0.their_have = Some(vec![sync::Have {
            last_sync: heads.clone(),
            bloom: sync::BloomFilter::default(),
        }]);
        self.0.their_heads = Some(heads);
        self.0.their_need = Some(Vec::new());
        // Every peer runs the same automerge release; its first message would say as much.
        self.0.their_capabilities = Some(vec![
            sync::Capability::MessageV1,
            sync::Capability::MessageV2,
        ]);
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
    fn assuming_the_peer_holds_its_heads_sends_the_changes_after_them_at_once() {
        let mut ahead = doc_with("k");
        let mut behind = ahead.fork();
        let listed: Vec<[u8; 32]> = behind.get_heads().iter().map(|h| h.0).collect();
        for key in ["k2", "k3"] {
            let mut tx = ahead.transaction();
            tx.put(ROOT, key, "v").unwrap();
            tx.commit();
        }
        let mut s_ahead = SyncState::new();
        s_ahead.assume_peer_holds(&listed);
        let first = ahead.generate_sync_message(&mut s_ahead.0).unwrap();
        // The changes after the listed heads, without a message from the peer first.
        assert!(!first.changes.is_empty());
        let mut s_behind = SyncState::new();
        behind.receive_sync_message(&mut s_behind.0, first).unwrap();
        assert_eq!(behind.get_heads(), ahead.get_heads());
        // The acknowledgement settles it: nothing more either way.
        let ack = behind.generate_sync_message(&mut s_behind.0).unwrap();
        assert!(ack.changes.is_empty());
        ahead.receive_sync_message(&mut s_ahead.0, ack).unwrap();
        assert!(ahead.generate_sync_message(&mut s_ahead.0).is_none());
    }

    #[test]
    fn a_peer_holding_less_than_it_listed_asks_for_the_rest() {
        let mut ahead = doc_with("k");
        let mut behind = Automerge::new();
        let listed: Vec<[u8; 32]> = ahead.get_heads().iter().map(|h| h.0).collect();
        let mut tx = ahead.transaction();
        tx.put(ROOT, "k2", "v").unwrap();
        tx.commit();
        let (mut sa, mut sb) = (SyncState::new(), SyncState::new());
        sa.assume_peer_holds(&listed);
        sync_all(&mut ahead, &mut sa, &mut behind, &mut sb);
        assert_eq!(behind.get_heads(), ahead.get_heads());
    }

    #[test]
    fn empty_doc_message_once() {
        let mut s = SyncState::new();
        let first = s.empty_doc_message().unwrap();
        assert!(sync::Message::decode(&first).is_ok());
        assert!(s.empty_doc_message().is_none());
    }
}
