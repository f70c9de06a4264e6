//! Wire envelope (prost types generated from `proto/dramesh/mesh/v1/mesh.proto`) and framing.
//!
//! A frame is a 4-byte big-endian payload length followed by one encoded [`pb::Envelope`].
//! Lengths above [`MAX_FRAME_SIZE`] are refused before any buffer is allocated, so a
//! peer cannot make a node allocate more than that per frame.

use prost::Message as _;

use dramesh_store::{Attestation, DocEntry, DocId, heads_hash};

/// Generated protobuf types.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/dramesh.mesh.v1.rs"));
}

/// Envelope format version this build speaks.
pub const WIRE_VERSION: u32 = 1;
/// Largest accepted frame payload (16 MiB).
pub const MAX_FRAME_SIZE: usize = 16 * 1024 * 1024;
/// Bytes of the length prefix.
pub const FRAME_HEADER_LEN: usize = 4;
/// Most heads a bucket entry carries (`DocEntry.heads`); a document with more (concurrent
/// writers) is listed by its heads hash alone. A document has one writer, so one head is the
/// rule; the bound keeps a frame of `max_entries_per_frame` entries well below
/// [`MAX_FRAME_SIZE`].
pub const MAX_ENTRY_HEADS: usize = 4;

/// Why a frame was refused.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length prefix is above [`MAX_FRAME_SIZE`].
    #[error("frame length {len} exceeds the maximum {MAX_FRAME_SIZE}")]
    TooLarge {
        /// The announced length in bytes.
        len: usize,
    },
    /// The payload is not an `Envelope`.
    #[error("frame does not decode as dramesh.mesh.v1.Envelope: {0}")]
    Decode(#[from] prost::DecodeError),
    /// Reading or writing the stream failed.
    #[error("I/O error on mesh stream: {0}")]
    Io(#[from] std::io::Error),
}

/// Encodes an envelope as a length-prefixed frame.
pub fn encode_frame(env: &pb::Envelope) -> Result<Vec<u8>, FrameError> {
    let len = env.encoded_len();
    if len > MAX_FRAME_SIZE {
        return Err(FrameError::TooLarge { len });
    }
    let mut buf = Vec::with_capacity(FRAME_HEADER_LEN + len);
    buf.extend_from_slice(&(len as u32).to_be_bytes());
    env.encode(&mut buf)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(buf)
}

/// Validates a received length prefix before allocating the payload buffer.
pub fn check_frame_len(header: [u8; FRAME_HEADER_LEN]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME_SIZE {
        return Err(FrameError::TooLarge { len });
    }
    Ok(len)
}

/// Decodes one frame payload (without its length prefix).
pub fn decode_payload(payload: &[u8]) -> Result<pb::Envelope, FrameError> {
    Ok(pb::Envelope::decode(payload)?)
}

/// Reads one frame from an async stream; `Ok(None)` on a clean end of stream.
pub async fn read_frame<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<(pb::Envelope, usize)>, FrameError> {
    use tokio::io::AsyncReadExt;
    let mut header = [0u8; FRAME_HEADER_LEN];
    match r.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = check_frame_len(header)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    Ok(Some((decode_payload(&payload)?, FRAME_HEADER_LEN + len)))
}

/// Wraps a body in an envelope of the current version.
pub fn envelope(body: pb::envelope::Body) -> pb::Envelope {
    pb::Envelope {
        version: WIRE_VERSION,
        body: Some(body),
    }
}

impl From<&DocId> for pb::DocId {
    fn from(d: &DocId) -> Self {
        pb::DocId {
            cluster: d.cluster.clone(),
            writer: d.writer.clone(),
        }
    }
}

impl From<&Attestation> for pb::SignedHeads {
    fn from(a: &Attestation) -> Self {
        pb::SignedHeads {
            heads: a.heads.iter().map(|h| h.to_vec()).collect(),
            signature: a.signature.clone(),
            signer: a.signer.to_vec(),
            signer_sha256: Vec::new(),
        }
    }
}

/// Converts received signed heads, refusing heads that are not 32 bytes and sizes beyond
/// [`dramesh_store::attest`]'s bounds.
pub fn signed_from_wire(s: &pb::SignedHeads) -> Result<Attestation, String> {
    if s.heads.len() > dramesh_store::attest::MAX_SIGNED_HEADS {
        return Err(format!("{} signed heads", s.heads.len()));
    }
    let heads = s
        .heads
        .iter()
        .map(|h| {
            <[u8; 32]>::try_from(h.as_slice())
                .map_err(|_| format!("signed head of {} bytes (32 expected)", h.len()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Attestation::new(heads, s.signature.clone(), s.signer.as_slice().into())
}

/// Converts a received document id, refusing missing or invalid names.
pub fn doc_from_wire(d: Option<&pb::DocId>) -> Option<DocId> {
    let d = d?;
    let doc = DocId::new(d.cluster.clone(), d.writer.clone());
    doc.is_valid().then_some(doc)
}

impl From<&DocEntry> for pb::DocEntry {
    fn from(e: &DocEntry) -> Self {
        pb::DocEntry {
            doc: Some((&e.doc).into()),
            generation: e.generation,
            heads_hash: e.heads_hash.to_vec(),
            heads: Vec::new(),
        }
    }
}

/// Converts a received entry, refusing invalid ids and heads hashes that are not 32 bytes.
pub fn entry_from_wire(e: &pb::DocEntry) -> Option<DocEntry> {
    let doc = doc_from_wire(e.doc.as_ref())?;
    let heads_hash: [u8; 32] = e.heads_hash.as_slice().try_into().ok()?;
    Some(DocEntry {
        doc,
        generation: e.generation,
        heads_hash,
    })
}

/// The heads a received entry carries, when they are well formed (at most
/// [`MAX_ENTRY_HEADS`], 32 bytes each) and hash to the entry's `heads_hash`; otherwise none
/// (the sender did not list them, or they cannot be the heads it compares by).
pub fn heads_from_wire(e: &pb::DocEntry, entry: &DocEntry) -> Vec<[u8; 32]> {
    if e.heads.is_empty() || e.heads.len() > MAX_ENTRY_HEADS {
        return Vec::new();
    }
    let heads: Option<Vec<[u8; 32]>> = e
        .heads
        .iter()
        .map(|h| <[u8; 32]>::try_from(h.as_slice()).ok())
        .collect();
    match heads {
        Some(heads) if heads_hash(&heads) == entry.heads_hash => heads,
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip_and_limits() {
        let env = envelope(pb::envelope::Body::Digest(pb::Digest {
            root: 7,
            buckets: vec![],
        }));
        let frame = encode_frame(&env).unwrap();
        let mut header = [0u8; 4];
        header.copy_from_slice(&frame[..4]);
        let len = check_frame_len(header).unwrap();
        assert_eq!(len, frame.len() - 4);
        assert_eq!(decode_payload(&frame[4..]).unwrap(), env);
        let too_big = ((MAX_FRAME_SIZE + 1) as u32).to_be_bytes();
        assert!(matches!(
            check_frame_len(too_big),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[tokio::test]
    async fn read_frame_rejects_oversized_header_without_reading_payload() {
        let mut data: &[u8] = &[0xff, 0xff, 0xff, 0xff, 1, 2, 3];
        assert!(matches!(
            read_frame(&mut data).await,
            Err(FrameError::TooLarge { .. })
        ));
        let mut empty: &[u8] = &[];
        assert!(read_frame(&mut empty).await.unwrap().is_none());
    }

    #[test]
    fn entry_conversion_validates() {
        let bad = pb::DocEntry {
            doc: Some(pb::DocId {
                cluster: "A".into(),
                writer: "n".into(),
            }),
            generation: 1,
            heads_hash: vec![0; 32],
            heads: vec![],
        };
        assert!(entry_from_wire(&bad).is_none());
        let short = pb::DocEntry {
            doc: Some(pb::DocId {
                cluster: "a".into(),
                writer: "n".into(),
            }),
            generation: 1,
            heads_hash: vec![0; 31],
            heads: vec![],
        };
        assert!(entry_from_wire(&short).is_none());
    }

    #[test]
    fn entry_heads_are_used_only_when_they_hash_to_the_heads_hash() {
        let heads = vec![[1; 32], [2; 32]];
        let doc = DocId::new("a", "n");
        let entry = DocEntry {
            doc: doc.clone(),
            generation: 1,
            heads_hash: heads_hash(&heads),
        };
        let wire = |heads: Vec<Vec<u8>>| pb::DocEntry {
            doc: Some((&doc).into()),
            generation: 1,
            heads_hash: entry.heads_hash.to_vec(),
            heads,
        };
        // In either order (the hash sorts them).
        let listed = wire(vec![vec![2; 32], vec![1; 32]]);
        let mut got = heads_from_wire(&listed, &entry);
        got.sort();
        assert_eq!(got, heads);
        // Not the heads the entry hashes: ignored.
        assert!(heads_from_wire(&wire(vec![vec![1; 32]]), &entry).is_empty());
        assert!(heads_from_wire(&wire(vec![vec![1; 32], vec![3; 32]]), &entry).is_empty());
        // Malformed: a short hash, or more than the bound.
        assert!(heads_from_wire(&wire(vec![vec![2; 32], vec![1; 31]]), &entry).is_empty());
        let many = vec![vec![1; 32]; MAX_ENTRY_HEADS + 1];
        assert!(heads_from_wire(&wire(many), &entry).is_empty());
        // Not listed at all (an older peer).
        assert!(heads_from_wire(&wire(vec![]), &entry).is_empty());
    }
}
