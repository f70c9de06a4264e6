//! On-disk format of one document: an append-only file of framed records.
//!
//! ```text
//! file   := MAGIC ("DRMSTOR1") record*
//! record := len:u32le !len:u32le crc32:u32le kind:u8 payload[len]
//!           (crc32 covers kind || payload; the complemented length makes a damaged length
//!           field detectable instead of looking like a torn tail)
//! kinds  := 1 header (JSON: format, format_minor, doc id, generation, owned, fresh_bytes,
//!                     written_by) | 2 snapshot (automerge save())
//!         | 3 changes (raw automerge changes since the previous record)
//!         | 4 packed snapshot (raw DEFLATE, fastest level, of automerge save_nocompress())
//! ```
//!
//! A valid file is `MAGIC header (snapshot | packed snapshot) changes*`; new files are written
//! with packed snapshots (kind 2 is still read). Why packed: automerge's own `save()` deflates
//! each column at the default level, which for a 7,000-object cluster document costs ~75 ms of
//! the ~95 ms a compaction takes; one fast DEFLATE pass over the uncompressed save costs ~8 ms
//! for a file ~1.8x larger. Guarantees and rules:
//! - A write is acknowledged only after its record is appended and (with
//!   [`Durability::Fsync`]) fsynced, so an acknowledged write is never lost by a crash. Under
//!   group commit several appends (of several files) are fsynced together before any of them
//!   is acknowledged.
//! - A record cut short by the end of the file, or a tail of zero bytes (a file extended by the
//!   filesystem but never written), is a torn write that was never acknowledged: it is truncated
//!   away and reported.
//! - A CRC mismatch anywhere else, a bad magic, a missing header or snapshot, or a record of an
//!   unknown kind is corruption: the document is reported and never used.
//! - **Versions.** The header's `format` is the major store format ([`STORE_FORMAT`]) and
//!   `format_minor` the minor one ([`STORE_FORMAT_MINOR`]; absent in files written before it
//!   existed: 1.0). What never changes, so every version can tell a file's format: the magic's
//!   prefix `DRMSTOR`, the record framing, and the header as record 0 with a numeric `format`.
//!   A minor version only adds header fields an older reader may ignore (any minor of this
//!   major is read; unknown header fields are ignored); anything an older reader would misread
//!   (a new record kind, another encoding) is a new major. A file of a newer major (or magic
//!   `DRMSTOR<n>` with n > 1) is *not* corruption: the store refuses to open
//!   ([`crate::StoreError::NewerFormat`]) rather than quarantine data a newer dramesh wrote.
//!   Older files are migrated as they are rewritten: every snapshot (compaction, rollover, new
//!   copy) is written in this build's format.
//! - New generations and compactions are written to `<stem>.tmp`, fsynced, renamed over
//!   `<stem>.amdoc` and the directory fsynced, so a crash leaves either the old or the new file.
//!   The exception is a replica's first copy of a document under group commit: written and
//!   renamed without fsync, it becomes durable with its group, before anything reflecting it
//!   is sent. A crash before that may leave it cut short before its first snapshot (or
//!   zero-filled): such a file is unfinished, not damaged, and is deleted when the store opens
//!   (its peers still hold the document). A file of the store's own document is never
//!   unfinished; cut short, it is corruption.

use crate::docid::DocId;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

pub(crate) const MAGIC: &[u8; 8] = b"DRMSTOR1";
/// The part of [`MAGIC`] every store format keeps.
const MAGIC_PREFIX: &[u8; 7] = b"DRMSTOR";
/// Major store format this build writes and reads (the header's `format`); files of a higher
/// one are refused, never read.
pub const STORE_FORMAT: u32 = 1;
/// Minor store format this build writes (the header's `format_minor`): 1 adds `format_minor`
/// and `written_by` to the header.
pub const STORE_FORMAT_MINOR: u32 = 1;
/// What a header's `written_by` says for files this build writes.
const WRITTEN_BY: &str = concat!("dramesh ", env!("CARGO_PKG_VERSION"));
pub(crate) const EXT: &str = "amdoc";
const TMP_EXT: &str = "tmp";
const RECORD_HEADER: usize = 13;

pub(crate) const KIND_HEADER: u8 = 1;
pub(crate) const KIND_SNAPSHOT: u8 = 2;
pub(crate) const KIND_CHANGES: u8 = 3;
pub(crate) const KIND_PACKED_SNAPSHOT: u8 = 4;
/// The writer's signature over the heads up to this point (`attest::Attestation::encode`); the
/// last one in a file is the document's proof of authorship.
pub(crate) const KIND_SIGNED: u8 = 5;

/// Largest document a packed snapshot may inflate to; a longer one is reported as corruption
/// instead of exhausting memory.
pub(crate) const MAX_SNAPSHOT_BYTES: u64 = 4 << 30;

/// A snapshot record's payload for `doc` (kind [`KIND_PACKED_SNAPSHOT`]).
pub(crate) fn pack_snapshot(doc: &automerge::Automerge) -> Vec<u8> {
    let raw = doc.save_nocompress();
    let mut enc = flate2::write::DeflateEncoder::new(
        Vec::with_capacity(raw.len() / 8),
        flate2::Compression::fast(),
    );
    // Writing into a Vec cannot fail.
    let packed = enc.write_all(&raw).and_then(|()| enc.finish());
    packed.unwrap_or_else(|_| unreachable!("DEFLATE into memory failed"))
}

fn unpack_snapshot(payload: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
    use std::io::Read;
    let start = out.len();
    flate2::read::DeflateDecoder::new(payload)
        .take(MAX_SNAPSHOT_BYTES + 1)
        .read_to_end(out)
        .map_err(|e| format!("packed snapshot does not inflate: {e}"))?;
    if (out.len() - start) as u64 > MAX_SNAPSHOT_BYTES {
        return Err(format!(
            "packed snapshot inflates beyond {MAX_SNAPSHOT_BYTES} bytes"
        ));
    }
    Ok(())
}

/// Whether acknowledged writes are fsynced. `None` is for tests and benchmarks only: a crash
/// may then lose acknowledged writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Every acknowledged write is on stable storage.
    Fsync,
    /// Nothing is fsynced (tests and benchmarks).
    None,
}

/// A file's header record. Unknown fields are ignored (a newer minor format may add some).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct FileHeader {
    /// Major store format ([`STORE_FORMAT`]).
    pub format: u32,
    /// Minor store format; absent (0) in files written before it existed.
    #[serde(default)]
    pub format_minor: u32,
    pub doc: DocId,
    pub generation: u64,
    pub owned: bool,
    /// Snapshot size when the generation was freshly built (the reference of the rollover
    /// policy); absent in files written before compaction existed.
    #[serde(default)]
    pub fresh_bytes: u64,
    /// The release that wrote the file (informational; absent before format 1.1).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub written_by: String,
}

impl FileHeader {
    /// A header in this build's format.
    pub(crate) fn current(doc: DocId, generation: u64, owned: bool, fresh_bytes: u64) -> Self {
        FileHeader {
            format: STORE_FORMAT,
            format_minor: STORE_FORMAT_MINOR,
            doc,
            generation,
            owned,
            fresh_bytes,
            written_by: WRITTEN_BY.to_string(),
        }
    }
}

/// Only the header's format, read before the rest so that a newer format whose other fields
/// differ is still recognized as newer.
#[derive(serde::Deserialize)]
struct FormatOnly {
    format: u32,
}

/// Bytes a file spends on its magic and header record (used to size in-memory stores alike).
pub(crate) fn header_overhead(header: &FileHeader) -> u64 {
    let json = serde_json::to_vec(header).map(|v| v.len()).unwrap_or(0);
    (MAGIC.len() + RECORD_HEADER + json) as u64
}

pub(crate) struct LoadedFile {
    pub header: FileHeader,
    /// Snapshot (unpacked) followed by every change record.
    pub automerge_bytes: Vec<u8>,
    /// Length of the snapshot at the start of `automerge_bytes`.
    pub snapshot_len: u64,
    /// Payload length of the snapshot record on disk.
    pub snapshot_record_len: u64,
    pub valid_len: u64,
    /// Bytes of a torn tail that must be truncated (0 when the file ended cleanly).
    pub torn_tail: u64,
    /// Payload of the last signed-heads record, if any.
    pub signed: Option<Vec<u8>>,
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

/// Atomically (re)writes the document file `f` in `dir`; returns its length.
pub(crate) fn write_new(
    dir: &Path,
    f: &NewFile,
    durability: Durability,
) -> Result<u64, crate::StoreError> {
    let NewFile {
        header,
        snapshot,
        signed,
    } = f;
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
    encode_record(&mut buf, KIND_PACKED_SNAPSHOT, snapshot).map_err(io_err(&path))?;
    if let Some(signed) = signed {
        encode_record(&mut buf, KIND_SIGNED, signed).map_err(io_err(&path))?;
    }
    {
        let mut file = File::create(&tmp).map_err(io_err(&tmp))?;
        file.write_all(&buf).map_err(io_err(&tmp))?;
        if durability == Durability::Fsync {
            file.sync_all().map_err(io_err(&tmp))?;
        }
    }
    fs::rename(&tmp, &path).map_err(io_err(&path))?;
    sync_dir(dir, durability)?;
    Ok(buf.len() as u64)
}

/// A document file as [`write_new`] writes it: header, snapshot (a [`pack_snapshot`] payload)
/// and the signature over its heads.
pub(crate) struct NewFile {
    pub header: FileHeader,
    pub snapshot: Vec<u8>,
    pub signed: Option<Vec<u8>>,
}

impl NewFile {
    /// The length [`write_new`] gives the file.
    pub(crate) fn len(&self) -> u64 {
        header_overhead(&self.header)
            + (RECORD_HEADER + self.snapshot.len()) as u64
            + self
                .signed
                .as_ref()
                .map_or(0, |s| (RECORD_HEADER + s.len()) as u64)
    }
}

/// Records appended to an existing document file (see [`append_records`]).
pub(crate) struct Append {
    pub doc: DocId,
    pub path: PathBuf,
    /// Encoded records ([`change_records`]).
    pub records: Vec<u8>,
}

/// What the writer thread does.
enum Job {
    New(NewFile),
    Append(Append),
}

impl Job {
    fn doc(&self) -> &DocId {
        match self {
            Job::New(f) => &f.header.doc,
            Job::Append(a) => &a.doc,
        }
    }

    fn run(&self, dir: &Path) -> Result<u64, crate::StoreError> {
        match self {
            Job::New(f) => write_new(dir, f, Durability::None),
            Job::Append(a) => append_records(&a.path, &a.records, Durability::None),
        }
    }
}

type Done = (Job, Result<u64, crate::StoreError>);

/// Writes new document files, and appends received changes to existing ones, without fsync on
/// a thread of its own, in submission order. A replica taking in a fleet of new documents spent
/// about a third of its time creating their files (inode allocation, write, rename), and a
/// healing one a file open and write per changed document; on this thread that overlaps with
/// decoding, applying and verifying the next ones. [`Writer::finish`] waits for every job; the
/// store calls it before the group commit's `syncfs` and before any other operation on a file
/// with a job still queued (appends need not wait: they run after the jobs before them).
pub(crate) struct Writer {
    /// The store's directory.
    dir: PathBuf,
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    done: std::sync::mpsc::Receiver<Done>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Jobs submitted and not yet reported.
    in_flight: usize,
    /// Documents with jobs submitted or failed and not yet done, and how many.
    unwritten: std::collections::HashMap<DocId, usize>,
    /// New files that failed, submitted again by the next [`Writer::finish`].
    failed: Vec<NewFile>,
    /// Documents an append failed for (it may have written part of its records, so it is not
    /// repeated): the store rewrites their files whole ([`Writer::take_failed_appends`]).
    failed_appends: std::collections::BTreeSet<DocId>,
}

impl Writer {
    /// Starts the thread writing into `dir`.
    pub(crate) fn start(dir: PathBuf) -> io::Result<Writer> {
        let (jobs, rx) = std::sync::mpsc::channel::<Job>();
        let (tx, done) = std::sync::mpsc::channel::<Done>();
        let thread_dir = dir.clone();
        let thread = std::thread::Builder::new()
            .name("dramesh-store-writer".into())
            .spawn(move || {
                for job in rx {
                    let r = job.run(&thread_dir);
                    if tx.send((job, r)).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Writer {
            dir,
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            in_flight: 0,
            unwritten: std::collections::HashMap::new(),
            failed: Vec::new(),
            failed_appends: std::collections::BTreeSet::new(),
        })
    }

    /// Queues a new file; written here when the thread is gone.
    pub(crate) fn submit(&mut self, f: NewFile) -> Result<(), crate::StoreError> {
        self.queue(Job::New(f))
    }

    /// Queues an append; written here when the thread is gone.
    pub(crate) fn append(&mut self, a: Append) -> Result<(), crate::StoreError> {
        self.queue(Job::Append(a))
    }

    fn queue(&mut self, job: Job) -> Result<(), crate::StoreError> {
        *self.unwritten.entry(job.doc().clone()).or_insert(0) += 1;
        let Some(jobs) = &self.jobs else {
            let r = job.run(&self.dir);
            return self.done_with(job, r);
        };
        match jobs.send(job) {
            Ok(()) => {
                self.in_flight += 1;
                Ok(())
            }
            Err(std::sync::mpsc::SendError(job)) => {
                let r = job.run(&self.dir);
                self.done_with(job, r)
            }
        }
    }

    /// Books a job's outcome.
    fn done_with(
        &mut self,
        job: Job,
        r: Result<u64, crate::StoreError>,
    ) -> Result<(), crate::StoreError> {
        let doc = job.doc().clone();
        let err = match (job, r) {
            (_, Ok(_)) => None,
            (Job::New(f), Err(e)) => {
                self.failed.push(f);
                // Still unwritten: resubmitted by the next `finish`.
                return Err(e);
            }
            (Job::Append(a), Err(e)) => {
                self.failed_appends.insert(a.doc);
                Some(e)
            }
        };
        if let Some(n) = self.unwritten.get_mut(&doc) {
            *n -= 1;
            if *n == 0 {
                self.unwritten.remove(&doc);
            }
        }
        err.map_or(Ok(()), Err)
    }

    /// Whether `doc`'s file has a job still to run.
    pub(crate) fn unwritten(&self, doc: &DocId) -> bool {
        self.unwritten.contains_key(doc)
    }

    /// Documents whose appends failed since the last call: their files miss records the store
    /// holds, and must be rewritten whole.
    pub(crate) fn take_failed_appends(&mut self) -> std::collections::BTreeSet<DocId> {
        std::mem::take(&mut self.failed_appends)
    }

    /// Waits until every submitted job ran, submitting failed new files again first; returns
    /// the first error (a failed new file stays to be written by the next call, a failed
    /// append is reported by [`Writer::take_failed_appends`]).
    pub(crate) fn finish(&mut self) -> Result<(), crate::StoreError> {
        let mut first_err = None;
        for f in std::mem::take(&mut self.failed) {
            // Counted again by `queue`.
            if let Some(n) = self.unwritten.get_mut(&f.header.doc) {
                *n -= 1;
                if *n == 0 {
                    self.unwritten.remove(&f.header.doc);
                }
            }
            if let Err(e) = self.submit(f) {
                first_err.get_or_insert(e);
            }
        }
        while self.in_flight > 0 {
            let Ok((job, r)) = self.done.recv() else {
                // The thread ended (it only does when it panicked) with jobs not run: every
                // later operation on their files fails, and later jobs run inline.
                self.in_flight = 0;
                self.jobs = None;
                first_err.get_or_insert(crate::StoreError::Io {
                    path: PathBuf::new(),
                    source: io::Error::other("the store's file writer thread ended"),
                });
                break;
            };
            self.in_flight -= 1;
            if let Err(e) = self.done_with(job, r) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it wrote what was queued.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Appends one change record, then the signed heads that cover it if given; returns the number
/// of bytes appended.
pub(crate) fn append_changes(
    path: &Path,
    changes: &[u8],
    signed: Option<&[u8]>,
    durability: Durability,
) -> Result<u64, crate::StoreError> {
    let buf = change_records(changes, signed).map_err(io_err(path))?;
    append_records(path, &buf, durability)
}

/// One change record, then the signed heads that cover it if given, encoded.
pub(crate) fn change_records(changes: &[u8], signed: Option<&[u8]>) -> io::Result<Vec<u8>> {
    let mut buf =
        Vec::with_capacity(2 * RECORD_HEADER + changes.len() + signed.map_or(0, <[u8]>::len));
    encode_record(&mut buf, KIND_CHANGES, changes)?;
    if let Some(signed) = signed {
        encode_record(&mut buf, KIND_SIGNED, signed)?;
    }
    Ok(buf)
}

/// Appends encoded records to the file at `path`; returns how many bytes.
pub(crate) fn append_records(
    path: &Path,
    records: &[u8],
    durability: Durability,
) -> Result<u64, crate::StoreError> {
    let mut f = OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(io_err(path))?;
    f.write_all(records).map_err(io_err(path))?;
    if durability == Durability::Fsync {
        f.sync_data().map_err(io_err(path))?;
    }
    Ok(records.len() as u64)
}

/// Fsyncs the data of a file appended to without fsync (group commit).
pub(crate) fn sync_file(path: &Path) -> Result<(), crate::StoreError> {
    OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|f| f.sync_data())
        .map_err(io_err(path))
}

/// Files appended to without fsync from which [`sync_many`] makes the whole filesystem durable
/// with one call instead of one fsync per file.
const SYNCFS_MIN_FILES: usize = 4;

/// Makes every file in `dir` appended to since its last fsync durable (group commit of many
/// documents).
///
/// On Linux this is one `syncfs(2)`: every fsync ends in a cache flush of the device, so
/// fsyncing the hundred files a busy replica's batch touched costs a hundred flushes in a row
/// (tens to hundreds of milliseconds on a virtual disk, during which the batch's replies wait),
/// while `syncfs` writes back the same dirty pages and flushes once. It also writes back other
/// dirty files of that filesystem, which costs I/O but loses nothing; since Linux 5.8 it reports
/// writeback errors of any file on it. Elsewhere, one fsync per file.
///
/// `new_files`: some of `files` were created (renamed into `dir`) without fsync, so the
/// directory is fsynced too unless `syncfs` covered it.
pub(crate) fn sync_many(
    dir: &Path,
    files: &[PathBuf],
    new_files: bool,
) -> Result<(), crate::StoreError> {
    #[cfg(target_os = "linux")]
    if files.len() >= SYNCFS_MIN_FILES {
        let d = File::open(dir).map_err(io_err(dir))?;
        return rustix::fs::syncfs(&d).map_err(|e| crate::StoreError::Io {
            path: dir.to_path_buf(),
            source: e.into(),
        });
    }
    let _ = dir;
    for f in files {
        match sync_file(f) {
            Ok(()) => {}
            // Replaced or removed since the append: the replacement was fsynced whole.
            Err(crate::StoreError::Io { source, .. })
                if source.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if new_files {
        sync_dir(dir, crate::Durability::Fsync)?;
    }
    Ok(())
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
/// Deletes a document's file, durably (the directory is fsynced). A file already gone is fine.
pub(crate) fn remove(
    dir: &Path,
    doc: &DocId,
    durability: Durability,
) -> Result<(), crate::StoreError> {
    let path = doc_path(dir, doc);
    match fs::remove_file(&path) {
        Ok(()) => sync_dir(dir, durability),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&path)(e)),
    }
}

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
    pub header: Option<Box<FileHeader>>,
    /// The file is intact as far as this build can tell but of a newer store format (the
    /// format as found, e.g. "2.0"): not corruption, the store must not open.
    pub newer_format: Option<String>,
    /// The file ends (cut short, or in zero bytes) before its first snapshot is complete: a new
    /// file whose write a crash interrupted before it was made durable (see
    /// [`crate::Store::sync_pending`]), not damage.
    pub unfinished: bool,
}

/// Parses a document file.
pub(crate) fn parse_file(bytes: &[u8]) -> Result<LoadedFile, Corruption> {
    let mut header: Option<FileHeader> = None;
    let unfinished = |bytes: &[u8]| {
        bytes.iter().all(|b| *b == 0) || (bytes.len() < MAGIC.len() && MAGIC.starts_with(bytes))
    };
    if unfinished(bytes) {
        return Err(Corruption {
            reason: "file ends before its magic bytes".to_string(),
            header: None,
            newer_format: None,
            unfinished: true,
        });
    }
    if let Some(found) = newer_format(bytes) {
        return Err(Corruption {
            reason: format!(
                "written in store format {found}, newer than this build's {STORE_FORMAT}.{STORE_FORMAT_MINOR}"
            ),
            header: None,
            newer_format: Some(found),
            unfinished: false,
        });
    }
    parse_records(bytes, &mut header).map_err(|(reason, ends_early)| Corruption {
        reason,
        // A file this store writes is never cut short unless it was a replica copy's (files of
        // its own documents are fsynced before they are renamed into place).
        unfinished: ends_early && header.as_ref().is_none_or(|h| !h.owned),
        newer_format: None,
        header: header.map(Box::new),
    })
}

/// The format of a file a newer build wrote, when it is one: magic `DRMSTOR<n>` with another
/// `n`, or an intact first record (CRC matching) whose JSON `format` is above
/// [`STORE_FORMAT`] (see the module docs for what every format keeps).
fn newer_format(bytes: &[u8]) -> Option<String> {
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC_PREFIX.len()] != MAGIC_PREFIX {
        return None;
    }
    if bytes[..MAGIC.len()] != MAGIC[..] {
        let n = bytes[MAGIC.len() - 1];
        return (n.is_ascii_digit() && n > MAGIC[MAGIC.len() - 1])
            .then(|| format!("with magic DRMSTOR{}", n as char));
    }
    let rest = &bytes[MAGIC.len()..];
    if rest.len() < RECORD_HEADER {
        return None;
    }
    let word = |i: usize| u32::from_le_bytes([rest[i], rest[i + 1], rest[i + 2], rest[i + 3]]);
    let (len, len_check, crc, kind) = (word(0) as usize, word(4), word(8), rest[12]);
    if len_check != !(len as u32) || kind != KIND_HEADER || rest.len() - RECORD_HEADER < len {
        return None;
    }
    let payload = &rest[RECORD_HEADER..RECORD_HEADER + len];
    let mut h = crc32fast::Hasher::new();
    h.update(&[kind]);
    h.update(payload);
    if h.finalize() != crc {
        return None;
    }
    let f: FormatOnly = serde_json::from_slice(payload).ok()?;
    if f.format <= STORE_FORMAT {
        return None;
    }
    let minor = serde_json::from_slice::<serde_json::Value>(payload)
        .ok()
        .and_then(|v| v.get("format_minor").and_then(serde_json::Value::as_u64))
        .unwrap_or(0);
    Some(format!("{}.{minor}", f.format))
}

/// Errors carry whether the file merely ends before its first snapshot is complete.
fn parse_records(
    bytes: &[u8],
    header_out: &mut Option<FileHeader>,
) -> Result<LoadedFile, (String, bool)> {
    let damaged = |reason: String| (reason, false);
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(damaged("missing or wrong magic bytes".to_string()));
    }
    let mut pos = MAGIC.len();
    let mut automerge_bytes = Vec::new();
    let mut snapshot_len = 0u64;
    let mut snapshot_record_len = 0u64;
    let mut index = 0usize;
    let mut torn_tail = 0u64;
    let mut signed = None;
    while pos < bytes.len() {
        let rest = &bytes[pos..];
        if rest.len() < RECORD_HEADER || rest.iter().all(|b| *b == 0) {
            torn_tail = rest.len() as u64;
            break;
        }
        let word = |i: usize| u32::from_le_bytes([rest[i], rest[i + 1], rest[i + 2], rest[i + 3]]);
        let (len32, len_check, crc, kind) = (word(0), word(4), word(8), rest[12]);
        if len_check != !len32 {
            return Err(damaged(format!(
                "damaged length field in record {index} at offset {pos}"
            )));
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
            return Err(damaged(format!(
                "CRC mismatch in record {index} at offset {pos}"
            )));
        }
        match (index, kind) {
            (0, KIND_HEADER) => {
                let parsed: FileHeader = serde_json::from_slice(payload)
                    .map_err(|e| damaged(format!("unreadable header record: {e}")))?;
                // Newer formats were recognized before; 0 never existed.
                if parsed.format != STORE_FORMAT {
                    return Err(damaged(format!(
                        "unsupported store format {}",
                        parsed.format
                    )));
                }
                *header_out = Some(parsed);
            }
            (1, KIND_SNAPSHOT) => {
                automerge_bytes.extend_from_slice(payload);
                snapshot_len = automerge_bytes.len() as u64;
                snapshot_record_len = len as u64;
            }
            (1, KIND_PACKED_SNAPSHOT) => {
                unpack_snapshot(payload, &mut automerge_bytes).map_err(damaged)?;
                snapshot_len = automerge_bytes.len() as u64;
                snapshot_record_len = len as u64;
            }
            (i, KIND_CHANGES) if i >= 2 => automerge_bytes.extend_from_slice(payload),
            (i, KIND_SIGNED) if i >= 2 => signed = Some(payload.to_vec()),
            (i, k) => {
                return Err(damaged(format!(
                    "unexpected record kind {k} at position {i} (offset {pos})"
                )));
            }
        }
        pos += RECORD_HEADER + len;
        index += 1;
    }
    let header = header_out
        .clone()
        .ok_or_else(|| ("file ends before its header record".to_string(), true))?;
    if index < 2 {
        return Err(("file ends before its snapshot record".to_string(), true));
    }
    Ok(LoadedFile {
        header,
        automerge_bytes,
        snapshot_len,
        snapshot_record_len,
        valid_len: pos as u64,
        torn_tail,
        signed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (FileHeader, Vec<u8>) {
        let header = FileHeader::current(DocId::new("c", "agent-a"), 7, true, 10);
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
    fn packed_snapshot_unpacks_to_the_saved_document() {
        use automerge::{ROOT, transaction::Transactable};
        let mut doc = automerge::Automerge::new();
        let mut tx = doc.transaction();
        for i in 0..200 {
            tx.put(ROOT, format!("k{i}"), format!("value {i} ").repeat(20))
                .unwrap();
        }
        tx.commit();
        let (header, _) = sample();
        let packed = pack_snapshot(&doc);
        assert!(packed.len() < doc.save_nocompress().len() / 4, "not packed");
        let mut buf = MAGIC.to_vec();
        encode_record(&mut buf, KIND_HEADER, &serde_json::to_vec(&header).unwrap()).unwrap();
        encode_record(&mut buf, KIND_PACKED_SNAPSHOT, &packed).unwrap();
        encode_record(&mut buf, KIND_CHANGES, b"tail").unwrap();
        let f = parse_file(&buf).unwrap();
        assert_eq!(f.snapshot_record_len, packed.len() as u64);
        let (snapshot, tail) = f.automerge_bytes.split_at(f.snapshot_len as usize);
        assert_eq!(tail, b"tail");
        let loaded = automerge::Automerge::load(snapshot).unwrap();
        assert_eq!(loaded.get_heads(), doc.get_heads());
    }

    #[test]
    fn packed_snapshot_that_does_not_inflate_is_corruption() {
        let (header, _) = sample();
        let mut buf = MAGIC.to_vec();
        encode_record(&mut buf, KIND_HEADER, &serde_json::to_vec(&header).unwrap()).unwrap();
        // A valid CRC over bytes that are not a DEFLATE stream.
        encode_record(&mut buf, KIND_PACKED_SNAPSHOT, &[0xff; 64]).unwrap();
        let err = parse_file(&buf).err().expect("accepted").reason;
        assert!(err.contains("does not inflate"), "{err}");
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
