//! Authorship check of incoming sync messages, run before anything is applied.
//!
//! automerge itself authorizes nothing: any peer able to send a sync message can add changes by
//! any actor. Each document has exactly one legitimate author, the actor derived from its writer
//! and generation ([`crate::writer_actor`]). This module walks every chunk carried by a message
//! (single changes, compressed changes, concatenated changes, or a whole saved document as sent
//! by V2 messages) and refuses the whole message if any change has another author.

use crate::attest::Carried;
use crate::docid::{DocId, hex, writer_actor};
use crate::error::StoreError;
use automerge::sync::Message;
use automerge::{ActorId, Automerge, Change, LoadOptions, OnPartialLoad, VerificationMode};
use std::sync::Arc;

const MAGIC: [u8; 4] = [0x85, 0x6f, 0x4a, 0x83];
const CHUNK_DOCUMENT: u8 = 0;
const CHUNK_CHANGE: u8 = 1;
const CHUNK_COMPRESSED: u8 = 2;

/// Splits a byte string into automerge storage chunks: `(chunk type, whole chunk bytes)`.
pub(crate) fn split_chunks(mut data: &[u8]) -> Result<Vec<(u8, &[u8])>, String> {
    let mut out = Vec::new();
    while !data.is_empty() {
        if data.len() < 9 || data[..4] != MAGIC {
            return Err("chunk does not start with automerge magic bytes".to_string());
        }
        let kind = data[8];
        let mut len: u64 = 0;
        let mut shift = 0u32;
        let mut pos = 9usize;
        loop {
            let b = *data.get(pos).ok_or("chunk length is cut short")?;
            pos += 1;
            if shift >= 64 {
                return Err("chunk length does not fit in 64 bits".to_string());
            }
            len |= u64::from(b & 0x7f) << shift;
            shift += 7;
            if b & 0x80 == 0 {
                break;
            }
        }
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| pos.checked_add(l))
            .filter(|end| *end <= data.len())
            .ok_or("chunk length runs past the end of the message")?;
        out.push((kind, &data[..end]));
        data = &data[end..];
    }
    Ok(out)
}

/// Verifies that every change in `msg` was authored by the writer of `doc` at `generation`.
/// Returns the changes carried (hash and dependencies), for the signature check.
pub(crate) fn check_authors(
    doc: &DocId,
    generation: u64,
    msg: &Message,
) -> Result<Vec<Carried>, StoreError> {
    let expected = writer_actor(doc, generation);
    let malformed = |reason: String| StoreError::MalformedMessage {
        doc: doc.clone(),
        reason,
    };
    let foreign = |actor: &ActorId| StoreError::ForeignAuthor {
        doc: doc.clone(),
        generation,
        actor: hex(actor.to_bytes()),
        expected: hex(expected.to_bytes()),
    };
    let mut checked = Vec::new();
    for blob in msg.changes.iter() {
        for (kind, chunk) in split_chunks(blob).map_err(malformed)? {
            match kind {
                CHUNK_CHANGE | CHUNK_COMPRESSED => {
                    let change = Change::try_from(chunk)
                        .map_err(|e| malformed(format!("unreadable change: {e}")))?;
                    if change.actor_id() != &expected {
                        return Err(foreign(change.actor_id()));
                    }
                    checked.push(Carried {
                        hash: change.hash(),
                        deps: change.deps().to_vec(),
                        packed: (kind == CHUNK_COMPRESSED).then(|| Arc::from(chunk)),
                        whole_document: false,
                    });
                }
                CHUNK_DOCUMENT => {
                    // A whole document (V2 shortcut): load it on the side and check every change.
                    let scratch = Automerge::load_with_options(
                        chunk,
                        LoadOptions::new()
                            .on_partial_load(OnPartialLoad::Error)
                            .verification_mode(VerificationMode::Check),
                    )
                    .map_err(|e| malformed(format!("unreadable document chunk: {e}")))?;
                    for change in scratch.get_changes(&[]) {
                        if change.actor_id() != &expected {
                            return Err(foreign(change.actor_id()));
                        }
                        checked.push(Carried {
                            hash: change.hash(),
                            deps: change.deps().to_vec(),
                            packed: None,
                            whole_document: true,
                        });
                    }
                }
                other => {
                    return Err(malformed(format!(
                        "chunk type {other} is not accepted in sync messages"
                    )));
                }
            }
        }
    }
    Ok(checked)
}

/// The changes of `msg` whose hashes are in `keep`, one chunk each (whole-document chunks are
/// never split: the caller refuses such a message instead).
pub(crate) fn keep_changes(
    msg: &Message,
    keep: &std::collections::HashSet<automerge::ChangeHash>,
) -> Result<automerge::sync::ChunkList, String> {
    let mut out = Vec::new();
    for blob in msg.changes.iter() {
        for (kind, chunk) in split_chunks(blob)? {
            if kind != CHUNK_CHANGE && kind != CHUNK_COMPRESSED {
                return Err(format!("chunk type {kind} cannot be kept in part"));
            }
            let change = Change::try_from(chunk).map_err(|e| format!("unreadable change: {e}"))?;
            if keep.contains(&change.hash()) {
                out.push(chunk.to_vec());
            }
        }
    }
    Ok(out.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use automerge::transaction::Transactable;

    fn doc_by(actor: ActorId, n: usize) -> Automerge {
        let mut d = Automerge::new().with_actor(actor);
        for i in 0..n {
            let mut tx = d.transaction();
            tx.put(automerge::ROOT, format!("k{i}"), i as u64).unwrap();
            tx.commit();
        }
        d
    }

    fn msg_with(chunks: Vec<Vec<u8>>) -> Message {
        let mut m = Message::decode(&Automerge::new().generate_sync_message_bytes()).unwrap();
        m.changes = chunks.into();
        m
    }

    trait Gen {
        fn generate_sync_message_bytes(&self) -> Vec<u8>;
    }
    impl Gen for Automerge {
        fn generate_sync_message_bytes(&self) -> Vec<u8> {
            use automerge::sync::SyncDoc;
            self.generate_sync_message(&mut automerge::sync::State::new())
                .unwrap()
                .encode()
        }
    }

    #[test]
    fn accepts_writer_changes_in_every_chunk_form() {
        let id = DocId::new("c", "agent-a");
        let d = doc_by(writer_actor(&id, 3), 3);
        let concatenated = d.save_after(&[]);
        let whole = d.save();
        let single: Vec<Vec<u8>> = d
            .get_changes(&[])
            .iter()
            .map(|c| c.raw_bytes().to_vec())
            .collect();
        assert_eq!(
            check_authors(&id, 3, &msg_with(vec![concatenated]))
                .unwrap()
                .len(),
            3
        );
        assert_eq!(
            check_authors(&id, 3, &msg_with(vec![whole])).unwrap().len(),
            3
        );
        assert_eq!(check_authors(&id, 3, &msg_with(single)).unwrap().len(), 3);
    }

    #[test]
    fn refuses_foreign_or_wrong_generation_author() {
        let id = DocId::new("c", "agent-a");
        let mut d = doc_by(writer_actor(&id, 3), 2);
        let mut intruder = d.fork().with_actor(ActorId::from(b"intruder-actor-1"));
        let mut tx = intruder.transaction();
        tx.put(automerge::ROOT, "node/x", "evil").unwrap();
        tx.commit();
        d.merge(&mut intruder).unwrap();
        for blob in [d.save_after(&[]), d.save()] {
            let err = check_authors(&id, 3, &msg_with(vec![blob])).unwrap_err();
            assert!(matches!(err, StoreError::ForeignAuthor { .. }), "{err}");
        }
        let honest = doc_by(writer_actor(&id, 3), 1).save();
        assert!(matches!(
            check_authors(&id, 4, &msg_with(vec![honest])),
            Err(StoreError::ForeignAuthor { .. })
        ));
        assert!(matches!(
            check_authors(&id, 3, &msg_with(vec![b"garbage".to_vec()])),
            Err(StoreError::MalformedMessage { .. })
        ));
    }
}
