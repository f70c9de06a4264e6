//! Sync message encoding with large changes compressed, and the compressed forms kept so a
//! change is deflated at most once per node.
//!
//! automerge 0.6 puts changes into sync messages as raw bytes; the compressed chunk form
//! (DEFLATE) is equally valid for the receiver. A ~600-byte object update shrinks only ~1.6x
//! for ~25 µs of CPU at the sender and again at the receiver, which a catch-up of thousands of
//! such changes (after a partition) pays three times over, once per peer that sends them. A
//! generation's base change holds every object (a cluster of 7,000 objects: ~9 MB raw, ~0.3 MB
//! compressed), so large changes in bulk messages are compressed and small ones go out raw.
//!
//! Deflating a 9 MB base change takes a few hundred milliseconds on the node's one protocol
//! thread. Without [`PackedChanges`] a replica deflated it again for every peer it relayed it
//! to, and a writer for every replica: after a fleet load the replicas were busy for seconds,
//! and the first updates of the steady state waited behind that work (profiled in the mesh
//! bench: 44 % of a replica's protocol thread in `compress_changes`). Now a change is kept in
//! the form it arrived in when that was compressed, or compressed once, keyed by its hash (the
//! SHA-256 automerge names it by, checked when the chunk was parsed).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use automerge::ChangeHash;
use automerge::sync::Message;

/// Change bytes in one sync message from which its large changes are sent compressed.
pub(crate) const COMPRESS_MESSAGE_BYTES: usize = 16 * 1024;
/// Smallest change chunk sent compressed (within a message of [`COMPRESS_MESSAGE_BYTES`]).
pub(crate) const COMPRESS_CHANGE_BYTES: usize = 4 * 1024;
/// Bytes of compressed changes kept by default: a 100-cluster fleet's base changes are about
/// 30 MB compressed.
pub(crate) const DEFAULT_PACKED_BYTES: usize = 64 * 1024 * 1024;

/// Compressed chunks of large changes by change hash, oldest evicted first past a byte bound.
#[derive(Debug)]
pub(crate) struct PackedChanges {
    chunks: HashMap<ChangeHash, Arc<[u8]>>,
    order: VecDeque<ChangeHash>,
    bytes: usize,
    limit: usize,
}

impl PackedChanges {
    pub(crate) fn new(limit: usize) -> PackedChanges {
        PackedChanges {
            chunks: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            limit,
        }
    }

    /// Keeps `chunk`, the compressed chunk of the change `hash`. A chunk over a quarter of the
    /// bound is not kept (it would evict most of the others).
    pub(crate) fn insert(&mut self, hash: ChangeHash, chunk: Arc<[u8]>) {
        if chunk.len() > self.limit / 4 || self.chunks.contains_key(&hash) {
            return;
        }
        while self.bytes + chunk.len() > self.limit {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(c) = self.chunks.remove(&old) {
                self.bytes -= c.len();
            }
        }
        self.bytes += chunk.len();
        self.order.push_back(hash);
        self.chunks.insert(hash, chunk);
    }

    fn get(&self, hash: &ChangeHash) -> Option<&Arc<[u8]>> {
        self.chunks.get(hash)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.chunks.len()
    }
}

/// Encodes a sync message, its large changes compressed when it carries many (see the module
/// docs).
pub(crate) fn encode_message(mut msg: Message, packed: &mut PackedChanges) -> Vec<u8> {
    let total: usize = msg.changes.iter().map(<[u8]>::len).sum();
    if total >= COMPRESS_MESSAGE_BYTES {
        // Version 2 messages carry every change concatenated in one entry, version 1 one entry
        // per change: compress each change chunk either way.
        let entries: Vec<Vec<u8>> = msg
            .changes
            .iter()
            .map(|e| compress_changes(e, packed))
            .collect();
        msg.changes = entries.into();
    }
    msg.encode()
}

/// The change chunks in `bytes`, the large ones in automerge's compressed chunk form; anything
/// that does not parse as changes is left as it is.
fn compress_changes(bytes: &[u8], packed: &mut PackedChanges) -> Vec<u8> {
    let Ok(chunks) = crate::auth::split_chunks(bytes) else {
        return bytes.to_vec();
    };
    let mut out = Vec::with_capacity(bytes.len() / 4);
    for (_, chunk) in chunks {
        if chunk.len() < COMPRESS_CHANGE_BYTES {
            out.extend_from_slice(chunk);
            continue;
        }
        match automerge::Change::from_bytes(chunk.to_vec()) {
            Ok(mut change) => {
                let hash = change.hash();
                if let Some(c) = packed.get(&hash) {
                    out.extend_from_slice(c);
                } else {
                    let c: Arc<[u8]> = Arc::from(&*change.bytes());
                    out.extend_from_slice(&c);
                    packed.insert(hash, c);
                }
            }
            Err(_) => out.extend_from_slice(chunk),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use automerge::sync::{self, SyncDoc};
    use automerge::transaction::Transactable;
    use automerge::{Automerge, ROOT};

    fn message_with(values: usize, value_len: usize) -> (Message, Vec<u8>) {
        let mut doc = Automerge::new();
        for i in 0..values {
            let mut tx = doc.transaction();
            tx.put(ROOT, format!("node/n{i}"), "x".repeat(value_len))
                .unwrap();
            tx.commit();
        }
        let raw: Vec<Vec<u8>> = doc
            .get_changes(&[])
            .iter()
            .map(|c| c.raw_bytes().to_vec())
            .collect();
        let total = raw.iter().map(Vec::len).sum::<usize>();
        let msg = Message {
            heads: doc.get_heads(),
            need: vec![],
            have: vec![],
            changes: raw.into(),
            supported_capabilities: None,
            version: sync::MessageVersion::V1,
        };
        (msg, vec![0; total])
    }

    #[test]
    fn bulk_messages_are_compressed_once_and_still_apply() {
        let (msg, raw) = message_with(40, 8_000);
        assert!(raw.len() >= COMPRESS_MESSAGE_BYTES);
        let heads = msg.heads.clone();
        let mut packed = PackedChanges::new(DEFAULT_PACKED_BYTES);
        let bytes = encode_message(msg.clone(), &mut packed);
        assert!(
            bytes.len() < raw.len() / 4,
            "{} of {}",
            bytes.len(),
            raw.len()
        );
        assert_eq!(packed.len(), 40, "every large change kept compressed");
        // Sent again (to the next peer): the same bytes, from the kept forms.
        assert_eq!(encode_message(msg, &mut packed), bytes);
        let mut replica = Automerge::new();
        let mut state = sync::State::new();
        replica
            .receive_sync_message(&mut state, Message::decode(&bytes).unwrap())
            .unwrap();
        assert_eq!(replica.get_heads(), heads);
    }

    #[test]
    fn kept_forms_are_bounded_by_bytes_oldest_first() {
        let mut packed = PackedChanges::new(1000);
        for i in 0..10u8 {
            packed.insert(ChangeHash([i; 32]), Arc::from(vec![i; 200]));
        }
        assert_eq!(packed.len(), 5);
        assert!(packed.get(&ChangeHash([0; 32])).is_none());
        assert!(packed.get(&ChangeHash([9; 32])).is_some());
        packed.insert(ChangeHash([42; 32]), Arc::from(vec![0; 251]));
        assert!(
            packed.get(&ChangeHash([42; 32])).is_none(),
            "over a quarter"
        );
    }

    #[test]
    fn bulk_changes_in_the_messages_automerge_generates_are_compressed() {
        // automerge 0.6 negotiates version 2 messages, which carry all changes in one entry.
        let mut writer = Automerge::new();
        let mut tx = writer.transaction();
        for i in 0..40 {
            tx.put(ROOT, format!("node/n{i}"), format!("{i} ").repeat(500))
                .unwrap();
        }
        tx.commit();
        // Small changes after the large base change stay raw.
        for i in 0..20 {
            let mut tx = writer.transaction();
            tx.put(ROOT, format!("node/n{i}"), "small").unwrap();
            tx.commit();
        }
        let mut replica = Automerge::new();
        let (mut ws, mut rs) = (sync::State::new(), sync::State::new());
        let mut largest = (0, 0);
        let mut packed = PackedChanges::new(DEFAULT_PACKED_BYTES);
        for _ in 0..4 {
            if let Some(m) = writer.generate_sync_message(&mut ws) {
                let raw = m.clone().encode().len();
                let bytes = encode_message(m, &mut packed);
                if raw > largest.0 {
                    largest = (raw, bytes.len());
                }
                replica
                    .receive_sync_message(&mut rs, Message::decode(&bytes).unwrap())
                    .unwrap();
            }
            if let Some(m) = replica.generate_sync_message(&mut rs) {
                writer.receive_sync_message(&mut ws, m).unwrap();
            }
        }
        assert_eq!(replica.get_heads(), writer.get_heads());
        let (raw, sent) = largest;
        assert!(raw >= COMPRESS_MESSAGE_BYTES, "{raw}");
        assert!(sent < raw / 4, "sent {sent} of {raw} bytes");
    }

    #[test]
    fn small_messages_go_out_as_they_are() {
        let (msg, raw) = message_with(2, 600);
        assert!(raw.len() < COMPRESS_MESSAGE_BYTES);
        let plain = msg.clone().encode();
        let mut packed = PackedChanges::new(DEFAULT_PACKED_BYTES);
        assert_eq!(encode_message(msg, &mut packed), plain);
        assert_eq!(packed.len(), 0);
    }
}
