//! On-disk format of one document: an append-only file of framed records.
//!
//! ```text
//! file   := MAGIC ("DRMSTOR1") record*
//! record := len:u32le !len:u32le crc32:u32le kind:u8 payload[len]
//!           (crc32 covers kind || payload; the complemented length makes a damaged length
//!           field detectable instead of looking like a torn tail)
//! kinds  := 1 header (JSON: doc id, generation, owned) | 2 snapshot (automerge save())
//!         | 3 changes (automerge save_after(): raw changes since the previous record)
//! ```
//!
//! A valid file is `MAGIC header snapshot changes*`. Guarantees and rules:
//! - A write is acknowledged only after its record is appended and (with
//!   [`Durability::Fsync`]) fsynced, so an acknowledged write is never lost by a crash. Under
//!   group commit several appends (of several files) are fsynced together before any of them
//!   is acknowledged.
//! - A record cut short by the end of the file, or a tail of zero bytes (a file extended by the
//!   filesystem but never written), is a torn write that was never acknowledged: it is truncated
//!   away and reported.
//! - A CRC mismatch anywhere else, a bad magic, a missing header or snapshot, or a record of an
//!   unknown kind is corruption: the document is reported and never used.
//! - New generations and compactions are written to `<stem>.tmp`, fsynced, renamed over
//!   `<stem>.amdoc` and the directory fsynced, so a crash leaves either the old or the new file.

use crate::docid::DocId;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

pub(crate) const MAGIC: &[u8; 8] = b"DRMSTOR1";
pub(crate) const EXT: &str = "amdoc";
const TMP_EXT: &str = "tmp";
const RECORD_HEADER: usize = 13;

pub(crate) const KIND_HEADER: u8 = 1;
pub(crate) const KIND_SNAPSHOT: u8 = 2;
pub(crate) const KIND_CHANGES: u8 = 3;

/// Whether acknowledged writes are fsynced. `None` is for tests and benchmarks only: a crash
/// may then lose acknowledged writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    Fsync,
    None,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct FileHeader {
    pub format: u32,
    pub doc: DocId,
    pub generation: u64,
    pub owned: bool,
    /// Snapshot size when the generation was freshly built (the reference of the rollover
    /// policy); absent in files written before compaction existed.
    #[serde(default)]
    pub fresh_bytes: u64,
}

/// Bytes a file spends on its magic and header record (used to size in-memory stores alike).
pub(crate) fn header_overhead(header: &FileHeader) -> u64 {
    let json = serde_json::to_vec(header).map(|v| v.len()).unwrap_or(0);
    (MAGIC.len() + RECORD_HEADER + json) as u64
}

pub(crate) struct LoadedFile {
    pub header: FileHeader,
    /// Snapshot followed by every change record, ready for `Automerge::load`.
    pub automerge_bytes: Vec<u8>,
    pub snapshot_len: u64,
    pub valid_len: u64,
    /// Bytes of a torn tail that must be truncated (0 when the file ended cleanly).
    pub torn_tail: u64,
}

pub(crate) fn doc_path(dir: &Path, doc: &DocId) -> PathBuf {
    dir.join(format!("{}.{EXT}", doc.file_stem()))
}

fn encode_record(out: &mut Vec<u8>, kind: u8, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| {
        io::Error::other(format!("record of {} bytes exceeds 4 GiB", payload.len()))
    })?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[kind]);
    crc.update(payload);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&(!len).to_le_bytes());
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.push(kind);
    out.extend_from_slice(payload);
    Ok(())
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> crate::StoreError + '_ {
    move |source| crate::StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn sync_dir(dir: &Path, durability: Durability) -> Result<(), crate::StoreError> {
    if durability == Durability::Fsync {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(dir))?;
    }
    Ok(())
}

/// Atomically (re)writes a document file holding `header` and `snapshot`; returns its length.
pub(crate) fn write_new(
    dir: &Path,
    header: &FileHeader,
    snapshot: &[u8],
    durability: Durability,
) -> Result<u64, crate::StoreError> {
    let path = doc_path(dir, &header.doc);
    let tmp = path.with_extension(TMP_EXT);
    let header_json = serde_json::to_vec(header).map_err(|e| crate::StoreError::Io {
        path: path.clone(),
        source: io::Error::other(e),
    })?;
    let mut buf =
        Vec::with_capacity(MAGIC.len() + 2 * RECORD_HEADER + header_json.len() + snapshot.len());
    buf.extend_from_slice(MAGIC);
    encode_record(&mut buf, KIND_HEADER, &header_json).map_err(io_err(&path))?;
    encode_record(&mut buf, KIND_SNAPSHOT, snapshot).map_err(io_err(&path))?;
    {
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&buf).map_err(io_err(&tmp))?;
        if durability == Durability::Fsync {
            f.sync_all().map_err(io_err(&tmp))?;
        }
    }
    fs::rename(&tmp, &path).map_err(io_err(&path))?;
    sync_dir(dir, durability)?;
    Ok(buf.len() as u64)
}

/// Appends one change record; returns the number of bytes appended.
pub(crate) fn append_changes(
    path: &Path,
    changes: &[u8],
    durability: Durability,
) -> Result<u64, crate::StoreError> {
    let mut buf = Vec::with_capacity(RECORD_HEADER + changes.len());
    encode_record(&mut buf, KIND_CHANGES, changes).map_err(io_err(path))?;
    let mut f = OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(io_err(path))?;
    f.write_all(&buf).map_err(io_err(path))?;
    if durability == Durability::Fsync {
        f.sync_data().map_err(io_err(path))?;
    }
    Ok(buf.len() as u64)
}

/// Fsyncs the data of a file appended to without fsync (group commit).
pub(crate) fn sync_file(path: &Path) -> Result<(), crate::StoreError> {
    OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|f| f.sync_data())
        .map_err(io_err(path))
}

pub(crate) fn truncate(
    path: &Path,
    len: u64,
    durability: Durability,
) -> Result<(), crate::StoreError> {
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err(path))?;
    f.set_len(len).map_err(io_err(path))?;
    if durability == Durability::Fsync {
        f.sync_all().map_err(io_err(path))?;
    }
    Ok(())
}

/// Moves a corrupt file aside (kept for inspection, never loaded again); returns the new path.
pub(crate) fn quarantine(path: &Path) -> Result<PathBuf, crate::StoreError> {
    let mut n = 0u32;
    loop {
        let target = path.with_extension(format!("corrupt{n}"));
        if !target.exists() {
            fs::rename(path, &target).map_err(io_err(path))?;
            return Ok(target);
        }
        n += 1;
    }
}

pub(crate) fn is_tmp(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == TMP_EXT)
}

pub(crate) fn is_doc_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == EXT)
}

/// Why a file is unusable, with its header when that record was still readable.
#[derive(Debug)]
pub(crate) struct Corruption {
    pub reason: String,
    pub header: Option<FileHeader>,
}

/// Parses a document file.
pub(crate) fn parse_file(bytes: &[u8]) -> Result<LoadedFile, Corruption> {
    let mut header: Option<FileHeader> = None;
    parse_records(bytes, &mut header).map_err(|reason| Corruption { reason, header })
}

fn parse_records(bytes: &[u8], header_out: &mut Option<FileHeader>) -> Result<LoadedFile, String> {
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err("missing or wrong magic bytes".to_string());
    }
    let mut pos = MAGIC.len();
    let mut automerge_bytes = Vec::new();
    let mut snapshot_len = 0u64;
    let mut index = 0usize;
    let mut torn_tail = 0u64;
    while pos < bytes.len() {
        let rest = &bytes[pos..];
        if rest.len() < RECORD_HEADER || rest.iter().all(|b| *b == 0) {
            torn_tail = rest.len() as u64;
            break;
        }
        let word = |i: usize| u32::from_le_bytes([rest[i], rest[i + 1], rest[i + 2], rest[i + 3]]);
        let (len32, len_check, crc, kind) = (word(0), word(4), word(8), rest[12]);
        if len_check != !len32 {
            return Err(format!(
                "damaged length field in record {index} at offset {pos}"
            ));
        }
        let len = len32 as usize;
        if rest.len() - RECORD_HEADER < len {
            torn_tail = rest.len() as u64;
            break;
        }
        let payload = &rest[RECORD_HEADER..RECORD_HEADER + len];
        let mut h = crc32fast::Hasher::new();
        h.update(&[kind]);
        h.update(payload);
        if h.finalize() != crc {
            return Err(format!("CRC mismatch in record {index} at offset {pos}"));
        }
        match (index, kind) {
            (0, KIND_HEADER) => {
                let parsed: FileHeader = serde_json::from_slice(payload)
                    .map_err(|e| format!("unreadable header record: {e}"))?;
                if parsed.format != 1 {
                    return Err(format!("unsupported file format {}", parsed.format));
                }
                *header_out = Some(parsed);
            }
            (1, KIND_SNAPSHOT) => {
                snapshot_len = len as u64;
                automerge_bytes.extend_from_slice(payload);
            }
            (i, KIND_CHANGES) if i >= 2 => automerge_bytes.extend_from_slice(payload),
            (i, k) => {
                return Err(format!(
                    "unexpected record kind {k} at position {i} (offset {pos})"
                ));
            }
        }
        pos += RECORD_HEADER + len;
        index += 1;
    }
    let header = header_out
        .clone()
        .ok_or_else(|| "file ends before its header record".to_string())?;
    if index < 2 {
        return Err("file ends before its snapshot record".to_string());
    }
    Ok(LoadedFile {
        header,
        automerge_bytes,
        snapshot_len,
        valid_len: pos as u64,
        torn_tail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (FileHeader, Vec<u8>) {
        let header = FileHeader {
            format: 1,
            doc: DocId::new("c", "agent/a"),
            generation: 7,
            owned: true,
            fresh_bytes: 10,
        };
        let mut buf = MAGIC.to_vec();
        encode_record(&mut buf, KIND_HEADER, &serde_json::to_vec(&header).unwrap()).unwrap();
        encode_record(&mut buf, KIND_SNAPSHOT, b"snap").unwrap();
        encode_record(&mut buf, KIND_CHANGES, b"one").unwrap();
        encode_record(&mut buf, KIND_CHANGES, b"two").unwrap();
        (header, buf)
    }

    #[test]
    fn parses_clean_file() {
        let (header, buf) = sample();
        let f = parse_file(&buf).unwrap();
        assert_eq!(f.header, header);
        assert_eq!(f.automerge_bytes, b"snaponetwo");
        assert_eq!(f.torn_tail, 0);
        assert_eq!(f.valid_len, buf.len() as u64);
    }

    #[test]
    fn torn_tail_is_cut_not_fatal() {
        let (_, buf) = sample();
        for cut in 1..=16 {
            let f = parse_file(&buf[..buf.len() - cut]).unwrap();
            assert_eq!(f.automerge_bytes, b"snaponetwo"[..7].to_vec(), "cut {cut}");
            assert_eq!(f.valid_len + f.torn_tail, (buf.len() - cut) as u64);
        }
        let mut zeros = buf.clone();
        zeros.extend_from_slice(&[0; 40]);
        let f = parse_file(&zeros).unwrap();
        assert_eq!(f.torn_tail, 40);
        assert_eq!(f.automerge_bytes, b"snaponetwo");
    }

    #[test]
    fn flipped_byte_anywhere_is_corruption() {
        let (_, buf) = sample();
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x40;
            assert!(
                parse_file(&bad).is_err(),
                "flip at offset {i} went unnoticed"
            );
        }
    }

    #[test]
    fn missing_snapshot_is_corruption() {
        let (_, buf) = sample();
        let header_end = MAGIC.len() + RECORD_HEADER + {
            let l = &buf[MAGIC.len()..MAGIC.len() + 4];
            u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize
        };
        assert!(parse_file(&buf[..header_end + 3]).is_err());
        assert!(parse_file(&buf[..5]).is_err());
    }
}
