//! The store: a set of single-writer automerge documents, their persistence, the sync entry
//! points the mesh drives, and the materialized view fed to the estimator.
//!
//! Guarantees:
//! - Only the writer's actor ([`writer_actor`]) ever authors a document; incoming sync messages
//!   are checked change by change before anything is applied ([`StoreError::ForeignAuthor`]).
//! - A write or a received sync message is acknowledged (returns `Ok`) only once it is on disk
//!   (fsynced under [`Durability::Fsync`]). Changes that are not durable yet are never offered
//!   to peers, so a writer that crashes cannot have published changes it does not remember.
//!   With group commit ([`Store::set_group_commit`]) received changes are appended at once but
//!   fsynced together by [`Store::sync_pending`]; the caller acknowledges nothing derived from
//!   them before that returns `Ok`.
//! - History is bounded: a writer rebuilds its document from current values into a new
//!   generation when the stored history outgrows [`RolloverPolicy`]; replicas adopt a newer
//!   generation once its first (base) change is complete and replace the older one entirely.
//! - Every call that changes documents returns exactly the object keys whose visible value
//!   changed, decoded only for those keys.

use crate::attest::{self, Attestation, Carried, SignedMessage, Trust};
use crate::auth::{check_authors, keep_changes};
use crate::digest::{Digest, DocEntry, fingerprint};
use crate::docid::{DocId, heads_hash, writer_actor};
use crate::error::StoreError;
use crate::keys::{REJOIN_KEY, TERM_KEY, doc_key, parse_doc_key};
use crate::object::{ObjectChange, ObjectKey};
use crate::packed::{DEFAULT_PACKED_BYTES, PackedChanges, encode_message};
use crate::persist::{self, Durability, FileHeader};
use crate::sync_state::SyncState;
use crate::view::View;
use automerge::sync::{Message, SyncDoc};
use automerge::transaction::Transactable;
use automerge::{
    Automerge, ChangeHash, LoadOptions, OnPartialLoad, PatchAction, Prop, ROOT, ReadDoc,
    ScalarValue, Value, VerificationMode, patches::TextRepresentation,
};
use dramesh_model::ObjectKind;
use dramesh_model::owner::{Owner, owner_of_json};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// When a document's file is compacted and when its writer starts a new generation.
///
/// Let `fresh` be the snapshot size the generation started with. When the file exceeds
/// `max_stored_ratio x fresh` (and `min_stored_bytes`), it is compacted: rewritten as one
/// snapshot of the same generation, history included (automerge's columnar format stores
/// history compactly; see `persist` for the packing). Replica copies are compacted within the
/// compaction budget ([`Store::maintain_deferred`]). If that snapshot is still above `max_compacted_ratio x fresh`, or the
/// in-memory history holds more than `max_ops_ratio` operations per live key, or
/// `max_changes` commits were made, the writer rolls over to a new generation instead. So the
/// stored size stays within `max_stored_ratio x fresh` plus one commit, and the resident history
/// within about `max_ops_ratio` times the live state.
#[derive(Clone, Debug)]
pub struct RolloverPolicy {
    /// Compact when the file exceeds this multiple of the generation's fresh snapshot.
    pub max_stored_ratio: f64,
    /// Roll over when a compacted snapshot still exceeds this multiple of the fresh one.
    pub max_compacted_ratio: f64,
    /// Roll over when the history holds more operations than this per live key.
    pub max_ops_ratio: f64,
    /// Files below this size are left alone.
    pub min_stored_bytes: u64,
    /// Roll over after this many commits in one generation.
    pub max_changes: u64,
    /// Largest share of time replica compactions may take; beyond it they wait for
    /// [`Store::maintain_deferred`].
    pub compaction_duty: f64,
}

impl Default for RolloverPolicy {
    fn default() -> Self {
        RolloverPolicy {
            max_stored_ratio: 2.0,
            max_compacted_ratio: 1.25,
            max_ops_ratio: 2.0,
            min_stored_bytes: 64 * 1024,
            max_changes: 100_000,
            compaction_duty: 0.25,
        }
    }
}

/// How a store persists and what it accepts.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Whether writes are fsynced before they are acknowledged.
    pub durability: Durability,
    /// Compaction and rollover thresholds; replicas use the compaction part for their copies
    /// (their history only shrinks when the writer rolls over).
    pub rollover: RolloverPolicy,
    /// Largest sync message accepted.
    pub max_message_bytes: usize,
    /// Largest number of next-generation documents being received at once.
    pub max_pending: usize,
    /// Most documents of one member cluster held or being received (a node agent per node, so
    /// well above Kubernetes' 5,000 nodes per cluster): a message that would start one more is
    /// refused with [`StoreError::TooManyDocs`].
    pub max_docs_per_cluster: usize,
    /// Milliseconds added to the wall clock wherever the store reads it (new generation
    /// numbers, the plausibility limit). 0 in production; tests set it to simulate a machine
    /// whose clock is wrong.
    pub clock_offset_ms: i64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            durability: Durability::Fsync,
            rollover: RolloverPolicy::default(),
            max_message_bytes: 64 * 1024 * 1024,
            max_pending: 10_000,
            max_docs_per_cluster: 10_000,
            clock_offset_ms: 0,
        }
    }
}

/// Result of a local write.
#[derive(Clone, Debug)]
pub struct WriteOutcome {
    /// Generation the write landed in (after any rollover it triggered).
    pub generation: u64,
    /// Whether the write triggered a rollover to a new generation.
    pub rolled_over: bool,
    /// Visible changes of the materialized view, `(cluster, change)`.
    pub view: Vec<(String, ObjectChange)>,
}

/// Size and history figures of one document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocStats {
    /// Generation held.
    pub generation: u64,
    /// Whether this store is the document's writer.
    pub owned: bool,
    /// Bytes of the document's file (or what it would be, for an in-memory store).
    pub stored_bytes: u64,
    /// Bytes of the snapshot the current file started from.
    pub base_bytes: u64,
    /// Bytes of the snapshot the generation started from (the rollover reference).
    pub fresh_bytes: u64,
    /// Commits since the generation started.
    pub commits_since_base: u64,
    /// Changes in the held history.
    pub num_changes: u64,
    /// Operations in the held history.
    pub num_ops: u64,
    /// Live keys (objects) in the document.
    pub keys: usize,
}

/// A document file that could not be used; the document is dropped and must be resynced.
#[derive(Clone, Debug)]
pub struct CorruptDoc {
    /// The file as found.
    pub path: PathBuf,
    /// Where the file was moved so that it is never loaded again.
    pub moved_to: PathBuf,
    /// The document, when the header was readable.
    pub doc: Option<DocId>,
    /// The generation, when the header was readable.
    pub generation: Option<u64>,
    /// Why the file was refused.
    pub reason: String,
}

/// A torn final record (an unacknowledged write cut by a crash) that was truncated away.
#[derive(Clone, Debug)]
pub struct TruncatedTail {
    /// The document of the file.
    pub doc: DocId,
    /// The truncated file.
    pub path: PathBuf,
    /// Bytes cut off.
    pub bytes: u64,
}

/// What [`Store::open`] found.
#[derive(Clone, Debug, Default)]
pub struct OpenReport {
    /// Documents loaded.
    pub loaded: usize,
    /// Files moved aside.
    pub corrupt: Vec<CorruptDoc>,
    /// Files whose torn tail was cut off.
    pub truncated: Vec<TruncatedTail>,
    /// Leftover temporary files of interrupted snapshot writes, deleted.
    pub removed_tmp_files: usize,
    /// Replica copies' new files that a crash cut short before their first snapshot was
    /// durable (never acknowledged: see [`Store::sync_pending`]), deleted; peers resend them.
    pub removed_unfinished_files: usize,
}

struct Held {
    generation: u64,
    doc: Automerge,
    owned: bool,
    term: u64,
    saved_heads: Vec<ChangeHash>,
    heads_hash: [u8; 32],
    /// [`DocId::bucket`], computed once (it hashes the id).
    bucket: u32,
    digest_part: u64,
    stored_bytes: u64,
    /// Snapshot size of the current file (after the last compaction or rollover).
    base_bytes: u64,
    /// Snapshot size when the generation started (or was first loaded here).
    fresh_bytes: u64,
    /// Stored bytes of the current values (deflated where smaller), kept for the writer's own
    /// documents (0 for replica copies): what a compaction would keep, the reference of the
    /// writer's compaction rule.
    live_bytes: u64,
    commits_since_base: u64,
    /// Operations in the history, kept for the writer's own documents (automerge 0.6 keeps no
    /// running count; walking the history on every commit would cost O(changes) per write).
    /// Not maintained for replica copies (0 or their count when loaded): taking one over rolls
    /// it over, which recounts.
    num_ops: u64,
    /// Set when the last append failed: in-memory changes are not durable and must not be
    /// offered to peers until a later append succeeds.
    not_durable: bool,
    /// Live key count at the last count and the op count then. Counting keys walks the whole
    /// root map, so the rollover check counts again only when the lower bound this gives
    /// (each op deletes at most one key) no longer rules a rollover out.
    keys_counted: (u64, u64),
    /// The writer's signature over these heads: verified for a replica copy (what it proves
    /// its relays with), the signature cache for an own document.
    signed: Option<Attestation>,
    /// A verified signature over heads not reached yet (changes queued for a missing
    /// dependency); it becomes `signed` when they are.
    signed_ahead: Option<Attestation>,
    /// `signed` changed since the file last recorded it.
    signed_unsaved: bool,
}

struct Pending {
    generation: u64,
    doc: Automerge,
    /// The newest verified signature of this generation (see [`Held::signed`]).
    signed: Option<Attestation>,
}

/// State of the changed document before the mutation being reconciled.
enum Old {
    /// The same document, read at these heads.
    At(Vec<ChangeHash>),
    /// A document that was replaced.
    Doc(Box<Automerge>),
    /// The document did not exist.
    Absent,
}

/// What vouches for the changes of a received sync message
/// ([`Store::receive_signed_sync_message`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Proof<'a> {
    /// The sender's attestation of the writer's heads.
    pub signed: Option<&'a Attestation>,
    /// The message comes over the writer's own authenticated session.
    pub from_writer: bool,
}

/// The document store. Not thread-safe by itself: wrap it in a mutex, and run it off the async
/// reactor (`spawn_blocking`) because loads and large sync messages take milliseconds to seconds.
pub struct Store {
    dir: Option<PathBuf>,
    config: StoreConfig,
    docs: BTreeMap<DocId, Held>,
    pending: BTreeMap<DocId, Pending>,
    view: View,
    digest: Digest,
    /// The digest of each member cluster's documents (see [`Store::cluster_digest`]).
    cluster_digests: HashMap<String, Digest>,
    undelivered: Vec<(String, ObjectChange)>,
    /// Group commit: received changes are appended without fsync and made durable together by
    /// [`Store::sync_pending`] (see [`Store::set_group_commit`]).
    group_commit: bool,
    /// Documents with appended records not fsynced yet (group commit only).
    unsynced: BTreeSet<DocId>,
    /// Whether a new file was created since the last [`Store::sync_pending`] without fsyncing
    /// it or the directory (a first replica copy under group commit).
    unsynced_new_files: bool,
    /// Writes those new files on a thread of its own (started with the first).
    writer: Option<persist::Writer>,
    /// Replica copies whose compaction waits for the budget (see [`Store::maintain_deferred`]).
    compaction_due: BTreeSet<DocId>,
    /// Until when replica compactions rest.
    compaction_rest_until: Instant,
    /// Compactions done (writers' and replicas').
    compactions: u64,
    /// Retired member clusters: documents whose rejoin ([`REJOIN_KEY`]) is not later than
    /// this time (ms) are refused, and so are generations begun at or before it.
    retired: BTreeMap<String, u64>,
    /// Per document of a retired cluster: the latest generation received whole and refused
    /// because it does not rejoin; it and earlier ones are refused at once from then on.
    refused_generations: BTreeMap<DocId, u64>,
    /// Set by [`Store::rejoin`] for the rollover it makes.
    rejoin_next: bool,
    /// Signs own documents and verifies received changes (see [`Store::set_trust`]).
    trust: Option<Trust>,
    /// Records held outside their writer's scope and therefore not visible (see
    /// [`Store::out_of_scope_records`]).
    out_of_scope: u64,
    /// Compressed forms of large changes, so each is deflated at most once.
    packed: PackedChanges,
    /// See [`Store::uncovered_dropped`].
    uncovered_dropped: u64,
}

fn wall_millis(offset_ms: i64) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    now.saturating_add_signed(offset_ms)
}

/// Generations are wall-clock milliseconds; one further ahead than this is not believed (it
/// would let a peer push a writer's generation counter to its end).
pub const MAX_FUTURE_GENERATION_MS: u64 = 30 * 24 * 3600 * 1000;

/// Whether the record `key` = `value` of replica copy `doc` lies within its writer's scope: a
/// node's writer publishes only records [`dramesh_model::ClusterObject::owner`] assigns to
/// that node; records owned by the cluster (or by nobody) only a writer holding the cluster's
/// highest lease term (`max_term`), i.e. the current Lease holder; [`crate::CLUSTER_PUBLISHER`]
/// everything. The owner is read from the value's owner fields ([`owner_of_json`], the same
/// rules without decoding whole objects); a value whose owner fields do not read is outside
/// every scope.
fn in_writer_scope(doc: &DocId, term: u64, max_term: u64, key: &str, value: &[u8]) -> bool {
    if doc.is_replica_scope() || doc.is_cluster_publisher() {
        return true;
    }
    let Some(k) = parse_doc_key(key) else {
        return true;
    };
    let owner = match k.kind {
        ObjectKind::Node => Some(Owner::Node(k.name.clone())),
        ObjectKind::DeviceClass | ObjectKind::DeviceTaintRule | ObjectKind::ClusterInfo => {
            Some(Owner::Cluster)
        }
        _ => match owner_of_json(k.kind, value) {
            Ok(owner) => owner,
            Err(_) => return false,
        },
    };
    match owner {
        Some(Owner::Node(n)) => n == doc.writer,
        Some(Owner::Cluster) | None => term >= max_term,
    }
}

/// Refuses a document id the mesh could not name on the wire (see [`DocId::is_valid`]).
fn check_doc_id(doc: &DocId) -> Result<(), StoreError> {
    if doc.is_valid() {
        Ok(())
    } else {
        Err(StoreError::InvalidDocId { doc: doc.clone() })
    }
}

/// The JSON a document value holds (see [`crate::value`]).
fn value_bytes(v: &Value<'_>) -> Option<Arc<[u8]>> {
    value_slice(v).and_then(crate::value::decode)
}

/// The stored bytes of a scalar value (deflated or not), borrowed.
fn value_slice<'a>(v: &'a Value<'_>) -> Option<&'a [u8]> {
    match v {
        Value::Scalar(s) => match s.as_ref() {
            ScalarValue::Bytes(b) => Some(b.as_slice()),
            ScalarValue::Str(s) => Some(s.as_bytes()),
            _ => None,
        },
        Value::Object(_) => None,
    }
}

/// Bytes of the document's current root values (see [`Held::live_bytes`]).
fn live_value_bytes(doc: &Automerge) -> u64 {
    doc.map_range(ROOT, ..)
        .map(|item| value_slice(&item.value).map_or(0, |b| b.len() as u64))
        .sum()
}

fn read_value(doc: &Automerge, key: &str, at: Option<&[ChangeHash]>) -> Option<Arc<[u8]>> {
    let got = match at {
        Some(h) => doc.get_at(ROOT, key, h),
        None => doc.get(ROOT, key),
    };
    got.ok().flatten().and_then(|(v, _)| value_bytes(&v))
}

fn read_term<D: ReadDoc>(doc: &D) -> u64 {
    read_u64(doc, TERM_KEY)
}

/// The generation at which the writer last asked to rejoin ([`REJOIN_KEY`]; 0: never).
fn read_rejoin<D: ReadDoc>(doc: &D) -> u64 {
    read_u64(doc, REJOIN_KEY)
}

fn read_u64<D: ReadDoc>(doc: &D, key: &str) -> u64 {
    match doc.get(ROOT, key) {
        Ok(Some((Value::Scalar(s), _))) => match s.as_ref() {
            ScalarValue::Uint(u) => *u,
            ScalarValue::Int(i) => u64::try_from(*i).unwrap_or(0),
            _ => 0,
        },
        _ => 0,
    }
}

/// Object keys (not reserved keys) of a document, optionally as at `heads`.
fn object_keys(doc: &Automerge, at: Option<&[ChangeHash]>) -> Vec<String> {
    let keys = match at {
        Some(h) => doc.keys_at(ROOT, h),
        None => doc.keys(ROOT),
    };
    keys.filter(|k| parse_doc_key(k).is_some()).collect()
}

/// Root keys touched by a list of patches.
fn patched_keys(patches: &[automerge::Patch]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for p in patches {
        let key = if p.obj == ROOT {
            match &p.action {
                PatchAction::PutMap { key, .. } | PatchAction::DeleteMap { key } => {
                    Some(key.clone())
                }
                PatchAction::Increment {
                    prop: Prop::Map(key),
                    ..
                }
                | PatchAction::Conflict {
                    prop: Prop::Map(key),
                } => Some(key.clone()),
                _ => None,
            }
        } else {
            match p.path.first() {
                Some((_, Prop::Map(key))) => Some(key.clone()),
                _ => None,
            }
        };
        if let Some(k) = key {
            out.insert(k);
        }
    }
    out
}

fn load_options() -> LoadOptions<'static> {
    LoadOptions::new()
        .on_partial_load(OnPartialLoad::Error)
        .verification_mode(VerificationMode::Check)
}

/// A fresh single-change document holding the current values of `old`.
/// The base of generation `generation` of `doc_id`: one change holding every current value of
/// `old` (reserved keys included). With `rejoin`, [`REJOIN_KEY`] is set to the generation in
/// that same change, so no copy of the generation exists without it.
fn build_fresh(
    doc_id: &DocId,
    old: &Automerge,
    generation: u64,
    rejoin: bool,
) -> Result<Automerge, StoreError> {
    let am = |source: automerge::AutomergeError| StoreError::Automerge {
        doc: doc_id.clone(),
        source: Box::new(source),
    };
    let mut fresh = Automerge::new().with_actor(writer_actor(doc_id, generation));
    let mut tx = fresh.transaction();
    for key in old.keys(ROOT) {
        if let Some((Value::Scalar(s), _)) = old.get(ROOT, key.as_str()).map_err(am)? {
            tx.put(ROOT, key.as_str(), s.into_owned()).map_err(am)?;
        }
    }
    // The base change must exist even for an empty document: replicas adopt a generation once
    // they hold a complete, non-empty history of it.
    if tx.get(ROOT, TERM_KEY).map_err(am)?.is_none() {
        tx.put(ROOT, TERM_KEY, ScalarValue::Uint(0)).map_err(am)?;
    }
    if rejoin {
        tx.put(ROOT, REJOIN_KEY, ScalarValue::Uint(generation))
            .map_err(am)?;
    }
    tx.commit();
    Ok(fresh)
}

/// Loads a document file's snapshot followed by its change records; every record must be a
/// readable change, and none may depend on a change missing from the file.
fn load_file_doc(bytes: &[u8], snapshot_len: usize) -> Result<Automerge, String> {
    let (snapshot, tail) = bytes.split_at(snapshot_len.min(bytes.len()));
    let mut doc = Automerge::load_with_options(snapshot, load_options())
        .map_err(|e| format!("automerge snapshot does not load: {e}"))?;
    if !tail.is_empty() {
        let mut changes = Vec::new();
        for (_, chunk) in
            crate::auth::split_chunks(tail).map_err(|e| format!("change records: {e}"))?
        {
            changes.push(
                automerge::Change::try_from(chunk)
                    .map_err(|e| format!("unreadable change record: {e}"))?,
            );
        }
        doc.apply_changes(changes)
            .map_err(|e| format!("change records do not apply: {e}"))?;
    }
    let missing = doc.get_missing_deps(&[]);
    if !missing.is_empty() {
        return Err(format!(
            "{} change(s) depend on changes missing from the file",
            missing.len()
        ));
    }
    Ok(doc)
}

/// Root-map keys written or deleted by `changes`, read from their operations.
///
/// Documents are flat root maps with one scalar per key, so this is exactly the set of keys
/// whose value may have changed. Returns `None` when an operation touches anything else (a
/// nested object or a sequence), which the writer never produces; the caller then diffs.
/// automerge 0.6 keeps the decoded operation's object and key types private, so those two
/// fields are read through their serde form (the value is not serialized).
fn changed_root_keys<'a>(
    changes: impl IntoIterator<Item = &'a automerge::Change>,
) -> Option<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    for change in changes {
        for op in change.decode().operations {
            let on_root = serde_json::to_value(&op.obj).ok()?.as_str() == Some("_root");
            if !on_root || !op.key.is_map_key() {
                return None;
            }
            let serde_json::Value::String(key) = serde_json::to_value(&op.key).ok()? else {
                return None;
            };
            out.insert(key);
        }
    }
    Some(out)
}

/// Changes and operations in a document's history (automerge 0.6 keeps no running count).
fn history(doc: &Automerge) -> (u64, u64) {
    doc.get_changes(&[])
        .iter()
        .fold((0, 0), |(c, o), ch| (c + 1, o + ch.len() as u64))
}

fn framed_len(payload: usize) -> u64 {
    payload as u64 + 13
}

/// The file of a snapshot of `id` (see [`persist::NewFile`]); its header's fresh size is the
/// snapshot's unless given.
fn snapshot_file(
    id: &DocId,
    generation: u64,
    owned: bool,
    snapshot: Vec<u8>,
    fresh_bytes: Option<u64>,
    signed: Option<&Attestation>,
) -> persist::NewFile {
    persist::NewFile {
        header: FileHeader {
            format: 1,
            doc: id.clone(),
            generation,
            owned,
            fresh_bytes: fresh_bytes.unwrap_or(framed_len(snapshot.len())),
        },
        signed: signed.map(Attestation::encode),
        snapshot,
    }
}

impl Store {
    /// The wall clock in milliseconds, with [`StoreConfig::clock_offset_ms`] applied.
    fn now_millis(&self) -> u64 {
        wall_millis(self.config.clock_offset_ms)
    }

    /// Whether `generation` is believable by this store's clock: at most
    /// [`MAX_FUTURE_GENERATION_MS`] ahead of it. Replicas refuse messages for other
    /// generations ([`StoreError::FutureGeneration`]); a writer never continues one.
    pub fn plausible_generation(&self, generation: u64) -> bool {
        generation <= self.now_millis().saturating_add(MAX_FUTURE_GENERATION_MS)
    }

    /// Changes [`StoreConfig::clock_offset_ms`] (a clock corrected while running; tests).
    pub fn set_clock_offset_ms(&mut self, offset_ms: i64) {
        self.config.clock_offset_ms = offset_ms;
    }

    /// A store without persistence (tests, benchmarks, ephemeral replicas).
    pub fn in_memory(config: StoreConfig) -> Store {
        Store {
            dir: None,
            config,
            docs: BTreeMap::new(),
            pending: BTreeMap::new(),
            view: View::default(),
            digest: Digest::empty(),
            cluster_digests: HashMap::new(),
            undelivered: Vec::new(),
            group_commit: false,
            unsynced: BTreeSet::new(),
            unsynced_new_files: false,
            writer: None,
            compaction_due: BTreeSet::new(),
            compaction_rest_until: Instant::now(),
            compactions: 0,
            retired: BTreeMap::new(),
            refused_generations: BTreeMap::new(),
            rejoin_next: false,
            trust: None,
            out_of_scope: 0,
            packed: PackedChanges::new(DEFAULT_PACKED_BYTES),
            uncovered_dropped: 0,
        }
    }

    /// Opens (creating if needed) a store directory and loads every document in it.
    ///
    /// Corrupt files are moved aside and listed in the report, never loaded; their documents
    /// are absent and come back through sync (or, for a writer, through [`Store::open_writer`],
    /// which starts a newer generation). Torn tails are truncated and listed.
    pub fn open(
        dir: impl AsRef<Path>,
        config: StoreConfig,
    ) -> Result<(Store, OpenReport), StoreError> {
        let dir = dir.as_ref().to_path_buf();
        let io = |source| StoreError::Io {
            path: dir.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let mut store = Store::in_memory(config);
        store.dir = Some(dir.clone());
        let mut report = OpenReport::default();
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        paths.sort();
        for path in paths {
            if persist::is_tmp(&path) {
                std::fs::remove_file(&path).map_err(|source| StoreError::Io {
                    path: path.clone(),
                    source,
                })?;
                report.removed_tmp_files += 1;
                continue;
            }
            if !persist::is_doc_file(&path) {
                continue;
            }
            let bytes = std::fs::read(&path).map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
            let corrupt = |reason: String,
                           header: Option<&FileHeader>|
             -> Result<CorruptDoc, StoreError> {
                let moved_to = persist::quarantine(&path)?;
                tracing::error!(path = %path.display(), %reason, "corrupt document file dropped; it will be resynced");
                Ok(CorruptDoc {
                    path: path.clone(),
                    moved_to,
                    doc: header.map(|h| h.doc.clone()),
                    generation: header.map(|h| h.generation),
                    reason,
                })
            };
            let file = match persist::parse_file(&bytes) {
                Ok(f) => f,
                Err(c) if c.unfinished => {
                    tracing::warn!(path = %path.display(), reason = %c.reason, "removed a new document file a crash cut short before it was durable; peers resend it");
                    std::fs::remove_file(&path).map_err(|source| StoreError::Io {
                        path: path.clone(),
                        source,
                    })?;
                    report.removed_unfinished_files += 1;
                    continue;
                }
                Err(c) => {
                    report.corrupt.push(corrupt(c.reason, c.header.as_ref())?);
                    continue;
                }
            };
            let expected_path = persist::doc_path(&dir, &file.header.doc);
            if expected_path != path {
                report.corrupt.push(corrupt(
                    "file name does not match the document id in its header".to_string(),
                    Some(&file.header),
                )?);
                continue;
            }
            if !file.header.doc.is_valid() {
                report.corrupt.push(corrupt(
                    format!(
                        "document id {} in the header is not a valid (cluster, writer) name",
                        file.header.doc
                    ),
                    Some(&file.header),
                )?);
                continue;
            }
            let mut doc = match load_file_doc(&file.automerge_bytes, file.snapshot_len as usize) {
                Ok(d) => d,
                Err(reason) => {
                    report.corrupt.push(corrupt(reason, Some(&file.header))?);
                    continue;
                }
            };
            if file.torn_tail > 0 {
                persist::truncate(&path, file.valid_len, store.config.durability)?;
                tracing::warn!(path = %path.display(), bytes = file.torn_tail, "truncated torn (unacknowledged) tail");
                report.truncated.push(TruncatedTail {
                    doc: file.header.doc.clone(),
                    path: path.clone(),
                    bytes: file.torn_tail,
                });
            }
            let FileHeader {
                doc: id,
                generation,
                owned,
                fresh_bytes,
                ..
            } = file.header;
            if owned {
                doc.set_actor(writer_actor(&id, generation));
            }
            let heads = doc.get_heads();
            let hh = heads_hash(&heads);
            let part = fingerprint(&id, generation, &hh);
            // The file's CRC vouches for the record; a record that does not decode is the
            // proof of a different format, and the copy is then relayed unproven until the
            // writer's next signature arrives.
            let signed = match file.signed.as_deref().map(Attestation::decode) {
                Some(Ok(a)) if !owned => Some(a),
                Some(Err(reason)) => {
                    tracing::warn!(path = %path.display(), %reason, "ignoring unreadable signed-heads record");
                    None
                }
                _ => None,
            };
            let (changes, num_ops) = history(&doc);
            let entry = Held {
                generation,
                term: read_term(&doc),
                owned,
                saved_heads: heads,
                heads_hash: hh,
                bucket: id.bucket(),
                digest_part: part,
                stored_bytes: file.valid_len,
                base_bytes: framed_len(file.snapshot_record_len as usize),
                fresh_bytes: if fresh_bytes > 0 {
                    fresh_bytes
                } else {
                    framed_len(file.snapshot_record_len as usize)
                },
                commits_since_base: changes.saturating_sub(1),
                num_ops,
                live_bytes: if owned { live_value_bytes(&doc) } else { 0 },
                not_durable: false,
                keys_counted: (0, 0),
                signed,
                signed_ahead: None,
                signed_unsaved: false,
                doc,
            };
            store.xor_digest(&id, entry.bucket, part);
            store.view.set_term(&id.cluster, &id.writer, entry.term);
            store.docs.insert(id, entry);
            report.loaded += 1;
        }
        // Presence once every writer's term is known (the Lease holder's scope depends on it).
        let ids: Vec<DocId> = store.docs.keys().cloned().collect();
        for id in ids {
            let keys = store
                .docs
                .get(&id)
                .map(|e| object_keys(&e.doc, None))
                .unwrap_or_default();
            let present = store.presence(&id, &keys);
            for (key, v) in keys.iter().zip(present) {
                if v.is_some() {
                    store.view.set_present(&id.cluster, &id.writer, key, true);
                }
            }
        }
        Ok((store, report))
    }

    fn path_of(&self, doc: &DocId) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| persist::doc_path(d, doc))
    }

    /// Waits for the background writer when `doc`'s new file is not written yet, so no other
    /// operation on that file comes first.
    fn settle(&mut self, doc: &DocId) -> Result<(), StoreError> {
        match &mut self.writer {
            Some(w) if w.unwritten(doc) => w.finish(),
            _ => Ok(()),
        }
    }

    fn set_digest(&mut self, doc: &DocId) {
        let Some(e) = self.docs.get_mut(doc) else {
            return;
        };
        let hh = heads_hash(&e.doc.get_heads());
        let part = fingerprint(doc, e.generation, &hh);
        let (bucket, change) = (e.bucket, e.digest_part ^ part);
        e.heads_hash = hh;
        e.digest_part = part;
        self.xor_digest(doc, bucket, change);
    }

    /// XORs `part` into `bucket` of the digest and of `doc`'s cluster digest: the one place
    /// both change.
    fn xor_digest(&mut self, doc: &DocId, bucket: u32, part: u64) {
        self.digest.xor(bucket, part);
        match self.cluster_digests.get_mut(&doc.cluster) {
            Some(d) => d.xor(bucket, part),
            None => {
                let mut d = Digest::empty();
                d.xor(bucket, part);
                self.cluster_digests.insert(doc.cluster.clone(), d);
            }
        }
    }

    /// Writes a snapshot as the document's new file (new generation or compaction); returns
    /// (file bytes, snapshot record bytes).
    fn write_snapshot(&self, f: &persist::NewFile) -> Result<(u64, u64), StoreError> {
        let base = framed_len(f.snapshot.len());
        let total = match &self.dir {
            Some(dir) => persist::write_new(dir, f, self.config.durability)?,
            None => f.len(),
        };
        Ok((total, base))
    }

    /// Appends the changes made since the last durable point of `doc`. With `defer` (group
    /// commit of received changes) the record is written but not fsynced; the document is
    /// remembered for [`Store::sync_pending`].
    fn persist_incremental(&mut self, doc: &DocId, defer: bool) -> Result<(), StoreError> {
        self.settle(doc)?;
        let path = self.path_of(doc);
        let defer = defer && self.config.durability == Durability::Fsync && path.is_some();
        let durability = if defer {
            Durability::None
        } else {
            self.config.durability
        };
        let Some(e) = self.docs.get_mut(doc) else {
            return Ok(());
        };
        let heads = e.doc.get_heads();
        if heads == e.saved_heads {
            e.not_durable = false;
            return Ok(());
        }
        // Each change as its own chunk, uncompressed: compressing every ~600-byte object update
        // costs more CPU than the disk it saves (compaction snapshots are compressed).
        let mut bytes = Vec::new();
        for c in e.doc.get_changes(&e.saved_heads) {
            bytes.extend_from_slice(c.raw_bytes());
        }
        let signed = (e.signed_unsaved && !e.owned)
            .then(|| e.signed.as_ref().map(Attestation::encode))
            .flatten();
        let appended = match path {
            Some(p) => match persist::append_changes(&p, &bytes, signed.as_deref(), durability) {
                Ok(n) => n,
                Err(err) => {
                    e.not_durable = true;
                    return Err(err);
                }
            },
            None => framed_len(bytes.len()) + signed.as_ref().map_or(0, |s| framed_len(s.len())),
        };
        e.signed_unsaved = false;
        e.stored_bytes += appended;
        e.saved_heads = heads;
        e.not_durable = false;
        if defer {
            self.unsynced.insert(doc.clone());
        }
        Ok(())
    }

    /// Turns group commit of received changes on or off.
    ///
    /// When on, [`Store::receive_sync_message`] appends the changes it applies without fsyncing
    /// them, and they become durable at the next [`Store::sync_pending`], which fsyncs every
    /// touched file once. The caller must not acknowledge or forward anything derived from
    /// those messages (replies, relays, digests, heads) before `sync_pending` returned `Ok`:
    /// the mesh node holds all outputs of a batch of frames until then. Local writes
    /// ([`Store::apply`]) and new files (generations, compactions) stay synchronous. Turning it
    /// off first syncs what is pending.
    pub fn set_group_commit(&mut self, on: bool) -> Result<(), StoreError> {
        if !on {
            self.sync_pending()?;
        }
        self.group_commit = on;
        Ok(())
    }

    /// Whether received changes are group-committed (see [`Store::set_group_commit`]).
    pub fn group_commit(&self) -> bool {
        self.group_commit
    }

    /// Whether appended records are waiting for [`Store::sync_pending`].
    pub fn has_unsynced(&self) -> bool {
        !self.unsynced.is_empty()
    }

    /// Makes every document file appended to since the last call durable (group commit, one
    /// `syncfs` for many files on Linux, see `persist::sync_many`); returns how many files were
    /// pending. On error they all stay pending, so a later call retries them; nothing derived
    /// from them may be acknowledged until then.
    pub fn sync_pending(&mut self) -> Result<usize, StoreError> {
        let synced = self.unsynced.len();
        if synced == 0 {
            return Ok(0);
        }
        if let Some(w) = &mut self.writer {
            w.finish()?;
        }
        if let Some(dir) = &self.dir {
            let files: Vec<PathBuf> = self
                .unsynced
                .iter()
                .map(|d| persist::doc_path(dir, d))
                .collect();
            persist::sync_many(dir, &files, self.unsynced_new_files)?;
        }
        self.unsynced.clear();
        self.unsynced_new_files = false;
        Ok(synced)
    }

    /// Creates the document this store writes, or resumes it from disk; returns its generation.
    ///
    /// A fresh document starts at a generation taken from the wall clock (milliseconds), so a
    /// writer that lost its disk still supersedes what replicas hold. A document held here only
    /// as a replica copy is taken over by rolling it into a new generation.
    pub fn open_writer(&mut self, doc: &DocId) -> Result<u64, StoreError> {
        check_doc_id(doc)?;
        self.settle(doc)?;
        if let Some(e) = self.docs.get(doc) {
            if e.owned {
                let generation = e.generation;
                return Ok(self.recover_generation(doc)?.unwrap_or(generation));
            }
            let min = e.generation.saturating_add(1);
            if let Some(e) = self.docs.get_mut(doc) {
                e.owned = true;
            }
            let rolled = self.rollover_to(doc, min);
            if rolled.is_err()
                && let Some(e) = self.docs.get_mut(doc)
            {
                // Still a replica copy: its actor is not ours, so it must not be written.
                e.owned = false;
            }
            return rolled;
        }
        let min_gen = self
            .pending
            .get(doc)
            .map_or(0, |p| p.generation.saturating_add(1));
        let generation = self.now_millis().max(min_gen).max(1);
        let fresh = build_fresh(doc, &Automerge::new(), generation, false)?;
        let (stored, base) = self.write_snapshot(&snapshot_file(
            doc,
            generation,
            true,
            persist::pack_snapshot(&fresh),
            None,
            None,
        ))?;
        self.pending.remove(doc);
        let heads = fresh.get_heads();
        let entry = Held {
            generation,
            term: 0,
            owned: true,
            saved_heads: heads,
            heads_hash: [0; 32],
            bucket: doc.bucket(),
            digest_part: 0,
            stored_bytes: stored,
            base_bytes: base,
            fresh_bytes: base,
            commits_since_base: 0,
            num_ops: history(&fresh).1,
            live_bytes: live_value_bytes(&fresh),
            not_durable: false,
            keys_counted: (0, 0),
            signed: None,
            signed_ahead: None,
            signed_unsaved: false,
            doc: fresh,
        };
        self.docs.insert(doc.clone(), entry);
        self.set_digest(doc);
        self.view.set_term(&doc.cluster, &doc.writer, 0);
        Ok(generation)
    }

    /// Applies a burst of object changes to the writer's document in one automerge commit and
    /// returns once it is durable. Upserts equal to the stored value and deletes of absent keys
    /// are skipped (they would only grow history); within the burst the last change of a key wins.
    pub fn apply(
        &mut self,
        doc: &DocId,
        changes: Vec<ObjectChange>,
    ) -> Result<WriteOutcome, StoreError> {
        let mut ops: BTreeMap<String, Option<Arc<[u8]>>> = BTreeMap::new();
        for c in changes {
            match c {
                ObjectChange::Upsert { key, json } => ops.insert(doc_key(&key)?, Some(json)),
                ObjectChange::Delete { key } => ops.insert(doc_key(&key)?, None),
            };
        }
        self.write_ops(doc, ops, None)
    }

    /// Records the lease term under which this writer publishes cluster-scoped objects; among
    /// documents of one cluster holding the same key, the highest term (then writer name) wins.
    pub fn set_lease_term(&mut self, doc: &DocId, term: u64) -> Result<WriteOutcome, StoreError> {
        self.write_ops(doc, BTreeMap::new(), Some(term))
    }

    fn write_ops(
        &mut self,
        doc: &DocId,
        ops: BTreeMap<String, Option<Arc<[u8]>>>,
        term: Option<u64>,
    ) -> Result<WriteOutcome, StoreError> {
        let am = |source: automerge::AutomergeError| StoreError::Automerge {
            doc: doc.clone(),
            source: Box::new(source),
        };
        let Some(e) = self.docs.get_mut(doc).filter(|e| e.owned) else {
            return Err(StoreError::NotWriter { doc: doc.clone() });
        };
        let before = e.doc.get_heads();
        let mut changed = Vec::new();
        let mut live = e.live_bytes;
        let mut tx = e.doc.transaction();
        for (k, v) in &ops {
            let current = tx.get(ROOT, k.as_str()).map_err(am)?;
            let current = current.as_ref().map(|(v, _)| value_slice(v));
            // Encoding is deterministic, so equal stored bytes mean an equal value.
            let stored = v.as_ref().map(|json| crate::value::encode(json));
            // (present, its stored length, equal to the new value)
            let (present, old_len, same) = match (&current, &stored) {
                (None, _) => (false, 0, false),
                (Some(c), stored) => (
                    true,
                    c.map_or(0, |c| c.len() as u64),
                    stored.as_ref().is_some_and(|s| *c == Some(&s[..])),
                ),
            };
            match stored {
                Some(stored) => {
                    if !same {
                        let new_len = stored.len() as u64;
                        tx.put(ROOT, k.as_str(), ScalarValue::Bytes(stored))
                            .map_err(am)?;
                        changed.push(k.clone());
                        live = live.saturating_sub(old_len).saturating_add(new_len);
                    }
                }
                None => {
                    if present {
                        tx.delete(ROOT, k.as_str()).map_err(am)?;
                        changed.push(k.clone());
                        live = live.saturating_sub(old_len);
                    }
                }
            }
        }
        let mut term_changed = false;
        if let Some(t) = term
            && read_term(&tx) != t
        {
            tx.put(ROOT, TERM_KEY, ScalarValue::Uint(t)).map_err(am)?;
            term_changed = true;
        }
        if changed.is_empty() && !term_changed {
            tx.rollback();
            // Retry a failed append even when this burst is a no-op.
            self.persist_incremental(doc, false)?;
            let mut view = std::mem::take(&mut self.undelivered);
            view.shrink_to_fit();
            return Ok(WriteOutcome {
                generation: self.docs.get(doc).map_or(0, |e| e.generation),
                rolled_over: false,
                view,
            });
        }
        tx.commit();
        e.live_bytes = live;
        e.commits_since_base += 1;
        e.num_ops += e.doc.get_last_local_change().map_or(0, |c| c.len() as u64);
        e.term = read_term(&e.doc);
        let persisted = self.persist_incremental(doc, false);
        self.set_digest(doc);
        let view = self.reconcile(doc, changed, Old::At(before));
        if let Err(err) = persisted {
            self.undelivered.extend(view);
            return Err(err);
        }
        let rolled_over = self.maintain(doc)?;
        let mut out = std::mem::take(&mut self.undelivered);
        out.extend(view);
        let e = self
            .docs
            .get(doc)
            .ok_or_else(|| StoreError::UnknownDoc { doc: doc.clone() })?;
        Ok(WriteOutcome {
            generation: e.generation,
            rolled_over,
            view: out,
        })
    }

    /// Applies [`RolloverPolicy`] to `doc` after it grew: compacts its file, or (writer only)
    /// rolls it over. Returns whether a rollover happened.
    fn maintain(&mut self, doc: &DocId) -> Result<bool, StoreError> {
        let p = self.config.rollover.clone();
        let Some(e) = self.docs.get(doc) else {
            return Ok(false);
        };
        if e.owned {
            let num_ops = e.num_ops;
            debug_assert_eq!(num_ops, history(&e.doc).1, "running op count drifted");
            let ops = num_ops as f64;
            let (counted, at_ops) = e.keys_counted;
            let min_keys = counted.saturating_sub(num_ops.saturating_sub(at_ops));
            let mut too_many_ops = false;
            if ops > 1024.0 && ops > p.max_ops_ratio * min_keys.max(1) as f64 {
                let keys = e.doc.length(ROOT) as u64;
                too_many_ops = ops > p.max_ops_ratio * keys.max(1) as f64;
                if let Some(e) = self.docs.get_mut(doc) {
                    e.keys_counted = (keys, num_ops);
                }
            }
            let commits = self.docs.get(doc).map_or(0, |e| e.commits_since_base);
            if too_many_ops || commits >= p.max_changes {
                self.rollover_to(doc, 0)?;
                return Ok(true);
            }
        }
        let Some(e) = self.docs.get(doc) else {
            return Ok(false);
        };
        // A writer measures against what a compaction would keep: its current values
        // (compaction results above `max_compacted_ratio` of the fresh size roll over instead).
        // Its file then holds at most as much history again as values, and a document that
        // only grows (reservations that are never released) is never compacted for nothing:
        // measured against its fresh size, it was compacted after every few percent of growth,
        // each time rewriting all of it. A replica cannot roll over, so it measures against its
        // last snapshot too, which keeps it from compacting on every message.
        let reference = if e.owned {
            e.fresh_bytes.max(e.live_bytes)
        } else {
            e.fresh_bytes.max(e.base_bytes)
        } as f64;
        let limit = ((p.max_stored_ratio * reference) as u64).max(p.min_stored_bytes);
        if e.stored_bytes <= limit {
            return Ok(false);
        }
        if !e.owned {
            let hard = (((p.max_stored_ratio + 1.0) * reference) as u64).max(p.min_stored_bytes);
            if e.stored_bytes <= hard && Instant::now() < self.compaction_rest_until {
                self.compaction_due.insert(doc.clone());
                return Ok(false);
            }
        }
        self.compact(doc)
    }

    /// Rewrites `doc`'s file as one snapshot (a writer whose snapshot is still too large rolls
    /// over instead); returns whether a rollover happened. Replica copies then rest the
    /// compaction budget (see [`Store::maintain_deferred`]).
    fn compact(&mut self, doc: &DocId) -> Result<bool, StoreError> {
        self.settle(doc)?;
        let started = Instant::now();
        self.compaction_due.remove(doc);
        let max_compacted_ratio = self.config.rollover.max_compacted_ratio;
        let Some(e) = self.docs.get(doc) else {
            return Ok(false);
        };
        let snapshot = persist::pack_snapshot(&e.doc);
        if e.owned && framed_len(snapshot.len()) as f64 > max_compacted_ratio * e.fresh_bytes as f64
        {
            self.rollover_to(doc, 0)?;
            return Ok(true);
        }
        let (generation, owned, fresh) = (e.generation, e.owned, e.fresh_bytes);
        let signed = if owned { None } else { e.signed.as_ref() };
        let (stored, base) = self.write_snapshot(&snapshot_file(
            doc,
            generation,
            owned,
            snapshot,
            Some(fresh),
            signed,
        ))?;
        if let Some(e) = self.docs.get_mut(doc) {
            e.stored_bytes = stored;
            e.base_bytes = base;
            e.signed_unsaved = false;
        }
        self.compactions += 1;
        if !owned {
            let spent = started.elapsed();
            let duty = self.config.rollover.compaction_duty.clamp(1e-6, 1.0);
            self.compaction_rest_until = Instant::now() + spent.mul_f64((1.0 - duty) / duty);
        }
        Ok(false)
    }

    /// Compacts one replica copy whose compaction was deferred, if the compaction budget has
    /// rested; returns the document compacted.
    ///
    /// A compaction rewrites the whole document (tens of milliseconds for a cluster of a
    /// thousand nodes) while a change costs tens of microseconds, and replica copies of a
    /// fleet grow together: after a partition heals or a fleet loads, every copy crosses its
    /// threshold in the same second. So a replica copy over `max_stored_ratio` is compacted at
    /// once only while compactions have used at most [`RolloverPolicy::compaction_duty`] of the time since the
    /// last one, and is otherwise queued here; callers run this when they are idle between
    /// batches (the mesh node does after sending each batch's frames). A copy that reaches
    /// `max_stored_ratio + 1` is compacted at once regardless.
    pub fn maintain_deferred(&mut self) -> Result<Option<DocId>, StoreError> {
        if Instant::now() < self.compaction_rest_until {
            return Ok(None);
        }
        let Some(doc) = self.compaction_due.pop_first() else {
            return Ok(None);
        };
        // Removed since, or taken over by this store's writer (which compacts inline).
        if self.docs.get(&doc).is_none_or(|e| e.owned) {
            return Ok(None);
        }
        self.compact(&doc)?;
        Ok(Some(doc))
    }

    /// Whether replica copies wait for [`Store::maintain_deferred`].
    pub fn has_deferred_compactions(&self) -> bool {
        !self.compaction_due.is_empty()
    }

    /// Compactions done since the store was opened, and replica copies waiting for one.
    pub fn compaction_counts(&self) -> (u64, usize) {
        (self.compactions, self.compaction_due.len())
    }

    /// Recovers the writer's own document from a clock fault: when its generation lies more
    /// than [`MAX_FUTURE_GENERATION_MS`] ahead of this store's clock (it was made while the
    /// clock ran ahead, and replicas refuse it), rolls over to a generation taken from the
    /// clock as it is now, keeping every current value (the base of a rollover). Returns the
    /// new generation, or `None` when the generation is plausible or the document is not
    /// written here. Replicas holding an older generation take the new one as usual.
    pub fn recover_generation(&mut self, doc: &DocId) -> Result<Option<u64>, StoreError> {
        let Some(e) = self.docs.get(doc).filter(|e| e.owned) else {
            return Ok(None);
        };
        if self.plausible_generation(e.generation) {
            return Ok(None);
        }
        let old = e.generation;
        let generation = self.rollover_to(doc, 0)?;
        tracing::warn!(doc = %doc, old, generation, "own generation lay more than 30 days ahead of the clock (a clock fault); started a new generation from the clock");
        Ok(Some(generation))
    }

    /// Rebuilds the writer's document from its current values into a new generation, replacing
    /// the file atomically; returns the new generation.
    pub fn rollover(&mut self, doc: &DocId) -> Result<u64, StoreError> {
        self.rollover_to(doc, 0)
    }

    /// Asks to rejoin the fleet after a retirement of the writer's cluster: rolls the writer's
    /// document over to a new generation whose base records that generation as the rejoin
    /// ([`REJOIN_KEY`]); returns it. Replicas holding a tombstone of the cluster accept the
    /// document only when its rejoin is later than the retirement, and every later rollover
    /// carries the same rejoin, so only this call (never an automatic rollover) brings a
    /// retired cluster back.
    pub fn rejoin(&mut self, doc: &DocId) -> Result<u64, StoreError> {
        self.rejoin_next = true;
        let rolled = self.rollover_to(doc, 0);
        self.rejoin_next = false;
        rolled
    }

    fn rollover_to(&mut self, doc: &DocId, min_generation: u64) -> Result<u64, StoreError> {
        self.settle(doc)?;
        let Some(e) = self.docs.get(doc).filter(|e| e.owned) else {
            return Err(StoreError::NotWriter { doc: doc.clone() });
        };
        // A generation this clock finds implausible was made by a clock running far ahead
        // (replicas refuse it); the next one starts from the clock again, below it.
        let next = if self.plausible_generation(e.generation) {
            e.generation.saturating_add(1)
        } else {
            0
        };
        let generation = next.max(min_generation).max(self.now_millis()).max(1);
        let fresh = build_fresh(doc, &e.doc, generation, self.rejoin_next)?;
        let (stored, base) = self.write_snapshot(&snapshot_file(
            doc,
            generation,
            true,
            persist::pack_snapshot(&fresh),
            None,
            None,
        ))?;
        let heads = fresh.get_heads();
        let num_ops = history(&fresh).1;
        let live = live_value_bytes(&fresh);
        if let Some(e) = self.docs.get_mut(doc) {
            e.generation = generation;
            e.num_ops = num_ops;
            e.live_bytes = live;
            e.doc = fresh;
            e.saved_heads = heads;
            e.stored_bytes = stored;
            e.base_bytes = base;
            e.fresh_bytes = base;
            e.commits_since_base = 0;
            e.not_durable = false;
            e.keys_counted = (0, 0);
        }
        self.pending.remove(doc);
        self.set_digest(doc);
        tracing::info!(doc = %doc, generation, stored, "rolled over to a new generation");
        Ok(generation)
    }

    /// The entry of every document, sorted by document.
    pub fn entries(&self) -> Vec<DocEntry> {
        self.docs
            .iter()
            .map(|(id, e)| Self::entry_of(id, e))
            .collect()
    }

    /// How many documents are held (what `entries().len()` says, without listing them).
    pub fn doc_count(&self) -> usize {
        self.docs.len()
    }

    /// The entry of one document.
    pub fn entry(&self, doc: &DocId) -> Option<DocEntry> {
        self.docs.get(doc).map(|e| Self::entry_of(doc, e))
    }

    /// The automerge heads of the held generation of `doc` (what its entry's `heads_hash`
    /// hashes), as 32-byte change hashes.
    pub fn heads(&self, doc: &DocId) -> Option<Vec<[u8; 32]>> {
        self.docs
            .get(doc)
            .map(|e| e.doc.get_heads().into_iter().map(|h| h.0).collect())
    }

    /// Whether the held generation `generation` of `doc` contains every change in `heads`
    /// (so a peer whose heads they are holds nothing this copy lacks).
    pub fn holds_changes(&self, doc: &DocId, generation: u64, heads: &[[u8; 32]]) -> bool {
        self.docs.get(doc).is_some_and(|e| {
            e.generation == generation
                && heads
                    .iter()
                    .all(|h| e.doc.get_change_by_hash(&ChangeHash(*h)).is_some())
        })
    }

    fn entry_of(doc: &DocId, e: &Held) -> DocEntry {
        DocEntry {
            doc: doc.clone(),
            generation: e.generation,
            heads_hash: e.heads_hash,
        }
    }

    /// The digest of all entries, maintained on every mutation.
    pub fn digest(&self) -> &Digest {
        &self.digest
    }

    /// The entries of the documents in the digest buckets `buckets` ([`DocId::bucket`]) that
    /// `keep` accepts, each with its bucket, ordered by bucket. One pass over the documents
    /// whatever the number of buckets, and only kept documents' ids are copied: listed bucket
    /// by bucket, a hundred thousand documents' entries were ~40 % of a replica's CPU early in
    /// a heal.
    pub fn bucket_entries(
        &self,
        buckets: &[u32],
        keep: impl Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        Self::entries_in(self.docs.iter(), buckets, keep)
    }

    fn entries_in<'a>(
        docs: impl Iterator<Item = (&'a DocId, &'a Held)>,
        buckets: &[u32],
        keep: impl Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        let mask = crate::digest::bucket_mask(buckets);
        let mut out: Vec<(u32, DocEntry)> = docs
            .filter(|(id, e)| mask & (1u64 << e.bucket) != 0 && keep(id))
            .map(|(id, e)| (e.bucket, Self::entry_of(id, e)))
            .collect();
        out.sort_by_key(|(b, _)| *b);
        out
    }

    /// The digest over the documents of member cluster `cluster` (empty when none is held),
    /// maintained like [`Store::digest`]: what a replica and a cluster's relay compare.
    pub fn cluster_digest(&self, cluster: &str) -> Digest {
        self.cluster_digests
            .get(cluster)
            .cloned()
            .unwrap_or_else(Digest::empty)
    }

    /// [`Store::bucket_entries`] of member cluster `cluster`'s documents only (a range of the
    /// document map, not a scan of it).
    pub fn cluster_bucket_entries(
        &self,
        cluster: &str,
        buckets: &[u32],
        keep: impl Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        let docs = self
            .docs
            .range(DocId::new(cluster, "")..)
            .take_while(|(d, _)| d.cluster == cluster);
        Self::entries_in(docs, buckets, keep)
    }

    /// Size and history figures of one document.
    pub fn doc_stats(&self, doc: &DocId) -> Option<DocStats> {
        self.docs.get(doc).map(|e| {
            let (num_changes, num_ops) = history(&e.doc);
            DocStats {
                generation: e.generation,
                owned: e.owned,
                stored_bytes: e.stored_bytes,
                base_bytes: e.base_bytes,
                fresh_bytes: e.fresh_bytes,
                commits_since_base: e.commits_since_base,
                num_changes,
                num_ops,
                keys: e.doc.length(ROOT),
            }
        })
    }

    /// Size in bytes of a freshly rebuilt copy of `doc` (its current values only); used to
    /// check the bounded-history figure.
    pub fn fresh_size(&self, doc: &DocId) -> Result<Option<usize>, StoreError> {
        match self.docs.get(doc) {
            None => Ok(None),
            Some(e) => Ok(Some(
                persist::pack_snapshot(&build_fresh(doc, &e.doc, e.generation, false)?).len(),
            )),
        }
    }

    /// The automerge document currently held for `doc`, for tests and benches that forge or
    /// inspect automerge data (feature `test-util`; automerge is not part of the store's API).
    #[cfg(feature = "test-util")]
    pub fn automerge_doc(&self, doc: &DocId) -> Option<&Automerge> {
        self.docs.get(doc).map(|e| &e.doc)
    }

    /// Produces the next sync message for `doc` at `generation` toward one peer.
    ///
    /// The mesh keeps one [`SyncState`] per (doc, generation, peer) and should always sync the
    /// highest generation either side has. Asking for a generation newer than the one held (or
    /// for an unknown document) starts receiving it into a side document; asking for an older
    /// one returns `None`. For the store's own documents the state is forced read-only (the
    /// writer never accepts changes), and nothing is offered while a local write is not durable.
    pub fn generate_sync_message(
        &mut self,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .generate_signed_sync_message(doc, generation, state)?
            .map(|(m, _)| m))
    }

    /// [`Store::generate_sync_message`], with the writer's signature over the heads the message
    /// leads to when it carries changes: for an own document this store signs (once per heads,
    /// with [`Trust::signer`]), for a replica copy it is the signature it verified when it
    /// received them. `None` when the message carries no changes or no signature is held.
    pub fn generate_signed_sync_message(
        &mut self,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
    ) -> Result<Option<SignedMessage>, StoreError> {
        let signer = self.trust.as_ref().and_then(|t| t.signer.clone());
        if let Some(e) = self.docs.get_mut(doc) {
            if generation < e.generation {
                return Ok(None);
            }
            if generation == e.generation {
                if e.owned && e.not_durable {
                    return Ok(None);
                }
                let Some(msg) = e.doc.generate_sync_message(&mut state.0) else {
                    return Ok(None);
                };
                if msg.changes.is_empty() {
                    return Ok(Some((encode_message(msg, &mut self.packed), None)));
                }
                let heads = e.doc.get_heads();
                let fresh = e.signed.as_ref().is_some_and(|a| a.signs_heads(&heads));
                if e.owned
                    && !fresh
                    && let Some(signer) = signer
                {
                    let hs: Vec<[u8; 32]> = heads.iter().map(|h| h.0).collect();
                    let statement = attest::statement(doc, e.generation, &hs);
                    let signature =
                        signer
                            .sign(&statement)
                            .map_err(|reason| StoreError::BadSignature {
                                doc: doc.clone(),
                                generation,
                                reason: format!("cannot sign own heads: {reason}"),
                            })?;
                    e.signed = Some(Attestation::new(hs, signature, signer.signer()).map_err(
                        |reason| StoreError::BadSignature {
                            doc: doc.clone(),
                            generation,
                            reason,
                        },
                    )?);
                }
                return Ok(Some((
                    encode_message(msg, &mut self.packed),
                    e.signed.clone(),
                )));
            }
            if e.owned {
                // A peer holds a newer generation of our own document (we lost our disk and the
                // clock went back): supersede it.
                if self.plausible_generation(generation) {
                    self.rollover_to(doc, generation.saturating_add(1))?;
                }
                return Ok(None);
            }
        }
        if !self.plausible_generation(generation) {
            return Ok(None);
        }
        let Some(p) = self.pending_for(doc, generation)? else {
            return Ok(None);
        };
        let Some(msg) = p.doc.generate_sync_message(&mut state.0) else {
            return Ok(None);
        };
        let signed = (!msg.changes.is_empty())
            .then(|| p.signed.clone())
            .flatten();
        Ok(Some((encode_message(msg, &mut self.packed), signed)))
    }

    fn pending_for(
        &mut self,
        doc: &DocId,
        generation: u64,
    ) -> Result<Option<&mut Pending>, StoreError> {
        check_doc_id(doc)?;
        match self.pending.get(doc).map(|p| p.generation) {
            Some(g) if g > generation => return Ok(None),
            Some(g) if g == generation => return Ok(self.pending.get_mut(doc)),
            Some(_) => {}
            None => {
                if self.pending.len() >= self.config.max_pending {
                    return Err(StoreError::TooManyPending {
                        doc: doc.clone(),
                        limit: self.config.max_pending,
                    });
                }
                if !self.docs.contains_key(doc) {
                    let held = self.cluster_docs(&doc.cluster);
                    let receiving = self
                        .pending
                        .range(DocId::new(doc.cluster.as_str(), "")..)
                        .take_while(|(d, _)| d.cluster == doc.cluster)
                        .filter(|(d, _)| !self.docs.contains_key(*d))
                        .count();
                    if held + receiving >= self.config.max_docs_per_cluster {
                        return Err(StoreError::TooManyDocs {
                            doc: doc.clone(),
                            limit: self.config.max_docs_per_cluster,
                        });
                    }
                }
            }
        }
        self.pending.insert(
            doc.clone(),
            Pending {
                generation,
                doc: Automerge::new(),
                signed: None,
            },
        );
        Ok(self.pending.get_mut(doc))
    }

    /// Applies one incoming sync message for `doc` at `generation` and returns the visible
    /// changes it caused, `(cluster, change)`.
    ///
    /// `may_deliver` is the mesh's policy for the sending peer (for example: replicas may relay
    /// any document, an agent only its own). Before anything is applied, every change carried
    /// by the message must be authored by the writer's actor for that generation; otherwise the
    /// message is refused with [`StoreError::ForeignAuthor`] and neither the document nor the
    /// sync state changes. Messages for an older generation than the one held are ignored.
    /// A newer generation is received on the side and replaces the held one, in one step, as
    /// soon as its history is complete.
    pub fn receive_sync_message(
        &mut self,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
        message: &[u8],
        may_deliver: &dyn Fn(&DocId) -> bool,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        self.receive_signed_sync_message(
            doc,
            generation,
            state,
            message,
            Proof::default(),
            may_deliver,
        )
    }

    /// [`Store::receive_sync_message`] with the sender's attestation of the changes carried.
    ///
    /// With [`Trust`] installed ([`Store::set_trust`]), a message carrying changes for a
    /// document this store does not write is applied only if `proof.signed` verifies (a credential
    /// the verifier trusts, allowed to write `doc`, signing `doc`, `generation` and the heads)
    /// and every carried change is one of those heads or their ancestor through the message;
    /// otherwise it is refused with [`StoreError::BadSignature`] and nothing changes. A
    /// signature equal to the one already held is not verified again. The newest verified
    /// signature whose heads the document reached is kept (and persisted) for relaying.
    ///
    /// A message whose changes are only partly proven (by the signed heads, or by being a
    /// missing dependency of changes the copy queued) has the proven ones applied and the
    /// others dropped ([`Store::uncovered_dropped`]); one proving none is refused.
    ///
    /// `proof.from_writer` says the message comes over the writer's own authenticated session. Its
    /// signature must still verify, but carried changes need not be reachable from the signed
    /// heads through the message: automerge's sync leaves out changes the receiver's Bloom
    /// filter claims (about 1 % false positives), and only the writer resends them when asked,
    /// which it can only do once its descendants were accepted. The session authenticates the
    /// writer's changes as it did before signatures; coverage is what makes a relay's changes
    /// authentic.
    pub fn receive_signed_sync_message(
        &mut self,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
        message: &[u8],
        proof: Proof<'_>,
        may_deliver: &dyn Fn(&DocId) -> bool,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        let Proof {
            signed,
            from_writer,
        } = proof;
        if message.len() > self.config.max_message_bytes {
            return Err(StoreError::MessageTooLarge {
                doc: doc.clone(),
                size: message.len(),
                limit: self.config.max_message_bytes,
            });
        }
        check_doc_id(doc)?;
        if !may_deliver(doc) {
            return Err(StoreError::PeerNotAllowed {
                doc: doc.clone(),
                generation,
            });
        }
        let current = self.docs.get(doc).map(|e| (e.generation, e.owned));
        if let Some((g, _)) = current
            && generation < g
        {
            return Ok(Vec::new());
        }
        if !self.plausible_generation(generation) {
            return Err(StoreError::FutureGeneration {
                doc: doc.clone(),
                generation,
            });
        }
        if let Some(&retired_at_ms) = self.retired.get(&doc.cluster)
            && (generation <= retired_at_ms
                || self
                    .refused_generations
                    .get(doc)
                    .is_some_and(|g| generation <= *g))
        {
            return Err(StoreError::RetiredCluster {
                doc: doc.clone(),
                generation,
                retired_at_ms,
            });
        }
        let msg = Message::decode(message).map_err(|e| StoreError::MalformedMessage {
            doc: doc.clone(),
            reason: e.to_string(),
        })?;
        let carried = check_authors(doc, generation, &msg)?;
        let (signed, keep) = match current {
            Some((_, true)) => (None, None),
            _ => self.check_signed(doc, generation, &carried, signed, from_writer)?,
        };
        let mut msg = msg;
        if let Some(keep) = keep {
            let dropped = carried.len() - keep.len();
            self.uncovered_dropped += dropped as u64;
            tracing::debug!(%doc, generation, dropped, kept = keep.len(), "changes no signature proves dropped; the rest applied");
            msg.changes =
                keep_changes(&msg, &keep).map_err(|reason| StoreError::MalformedMessage {
                    doc: doc.clone(),
                    reason,
                })?;
        }
        for c in carried {
            if let Some(chunk) = c.packed {
                self.packed.insert(c.hash, chunk);
            }
        }
        let am = |source: automerge::AutomergeError| StoreError::Automerge {
            doc: doc.clone(),
            source: Box::new(source),
        };
        match current {
            Some((g, true)) => {
                if generation > g {
                    self.rollover_to(doc, generation.saturating_add(1))?;
                } else if let Some(e) = self.docs.get_mut(doc) {
                    // The writer never takes changes to its own document from peers: only its
                    // own history is authoritative (a peer can only echo it, or hold changes
                    // of a previous life whose sequence numbers this life reuses).
                    let mut msg = msg;
                    msg.changes = Vec::<Vec<u8>>::new().into();
                    e.doc.receive_sync_message(&mut state.0, msg).map_err(am)?;
                }
                Ok(std::mem::take(&mut self.undelivered))
            }
            Some((g, false)) if g == generation => self.receive_current(doc, state, msg, signed),
            _ => {
                // A first message carries only heads: nothing to receive yet, and the protocol
                // answers it on behalf of an empty document. Starting a side document for it
                // would let a peer offering many documents at once (a relay's cluster, a new
                // replica's fleet) fill `max_pending` with documents nothing was sent for.
                let receiving = self
                    .pending
                    .get(doc)
                    .is_some_and(|p| p.generation == generation);
                if msg.changes.is_empty() && !receiving {
                    return Ok(Vec::new());
                }
                let Some(p) = self.pending_for(doc, generation)? else {
                    return Ok(Vec::new());
                };
                p.doc.receive_sync_message(&mut state.0, msg).map_err(am)?;
                if let Some(a) = signed {
                    p.signed = Some(a);
                }
                let complete =
                    !p.doc.get_heads().is_empty() && p.doc.get_missing_deps(&[]).is_empty();
                if complete {
                    self.promote(doc)
                } else {
                    Ok(std::mem::take(&mut self.undelivered))
                }
            }
        }
    }

    /// Installs what this store signs its own documents with and verifies received changes
    /// against (see [`Store::receive_signed_sync_message`]). The mesh node installs it from its
    /// certificate when it starts.
    pub fn set_trust(&mut self, trust: Trust) {
        self.trust = Some(trust);
    }

    /// The signature this store holds over the current heads of `doc` (a replica copy's proof
    /// of authorship), if any.
    pub fn signed_heads(&self, doc: &DocId) -> Option<&Attestation> {
        self.docs
            .get(doc)
            .and_then(|e| e.signed.as_ref())
            .filter(|a| {
                self.docs
                    .get(doc)
                    .is_some_and(|e| a.signs_heads(&e.doc.get_heads()))
            })
    }

    /// Verifies that `signed` covers the carried changes (see
    /// [`Store::receive_signed_sync_message`]); returns the attestation to keep, if any, and,
    /// when only some of the changes are proven, the ones to apply.
    fn check_signed(
        &self,
        doc: &DocId,
        generation: u64,
        carried: &[Carried],
        signed: Option<&Attestation>,
        from_writer: bool,
    ) -> Result<(Option<Attestation>, Option<HashSet<ChangeHash>>), StoreError> {
        let Some(trust) = &self.trust else {
            return Ok((None, None));
        };
        if carried.is_empty() {
            return Ok((None, None));
        }
        let bad = |reason: String| StoreError::BadSignature {
            doc: doc.clone(),
            generation,
            reason,
        };
        // Changes this copy already holds were proven when they arrived. Relays and anti-entropy
        // resend them often (a replica hears an update from the writer and from every other
        // replica), and such a message can add nothing, so it costs no signature check; its
        // attestation is not kept, since it was not verified.
        if self.holds_all(doc, generation, carried) {
            return Ok((None, None));
        }
        let Some(a) = signed else {
            return Err(bad(format!(
                "{} change(s) carry no signature of the writer",
                carried.len()
            )));
        };
        let known = self
            .docs
            .get(doc)
            .filter(|e| e.generation == generation)
            .map(|e| (e.signed.as_ref(), e.signed_ahead.as_ref()))
            .or_else(|| {
                self.pending
                    .get(doc)
                    .filter(|p| p.generation == generation)
                    .map(|p| (p.signed.as_ref(), None))
            });
        let seen = known.is_some_and(|(s, ahead)| s == Some(a) || ahead == Some(a));
        if !seen {
            let statement = attest::statement(doc, generation, &a.heads);
            trust
                .verifier
                .verify(doc, &statement, &a.signature, &a.signer)
                .map_err(|e| bad(format!("signature does not verify: {e}")))?;
        }
        let waiting = self.waiting_for(doc, generation);
        let roots = a.heads.iter().map(|h| ChangeHash(*h)).chain(waiting);
        let proven = attest::proven(carried, roots);
        if proven.len() == carried.len() || from_writer {
            // Everything proven, or the writer's own session vouches for them (see
            // `receive_signed_sync_message`).
            return Ok((Some(a.clone()), None));
        }
        let unproven = carried.iter().find(|c| !proven.contains(&c.hash));
        if proven.is_empty() || carried.iter().any(|c| c.whole_document) {
            return Err(bad(format!(
                "change {} is not covered by the writer's signed heads",
                unproven.map_or_else(String::new, |c| c.hash.to_string())
            )));
        }
        // Some changes are proven, others not: a relay's message that leaves out a change the
        // receiver's Bloom filter falsely claims (the rest of the chain is then unreachable
        // from the signed heads through the message). The proven ones are applied (automerge
        // queues them until the gap is filled) and the others dropped: the receiver then asks
        // for the missing change by hash, which its queued changes name, so the resend is
        // proven in turn. Refusing the whole message instead would repeat forever: the next
        // exchange carries the same Bloom filter.
        Ok((Some(a.clone()), Some(proven)))
    }

    /// Missing dependencies of the changes the copy of `doc` at `generation` (held or being
    /// assembled) has queued: hashes named by changes it proved, so a change with one of them
    /// is the writer's.
    fn waiting_for(&self, doc: &DocId, generation: u64) -> Vec<ChangeHash> {
        match self.docs.get(doc) {
            Some(e) if e.generation == generation => e.doc.get_missing_deps(&[]),
            _ => self
                .pending
                .get(doc)
                .filter(|p| p.generation == generation)
                .map(|p| p.doc.get_missing_deps(&[]))
                .unwrap_or_default(),
        }
    }

    /// Changes carried by messages that no verified signature proved, dropped while the rest of
    /// the message was applied (see [`Store::receive_signed_sync_message`]).
    pub fn uncovered_dropped(&self) -> u64 {
        self.uncovered_dropped
    }

    /// Whether the copy of `doc` at `generation` (held or being assembled) already has every
    /// carried change.
    fn holds_all(&self, doc: &DocId, generation: u64, carried: &[Carried]) -> bool {
        let copy = match self.docs.get(doc) {
            Some(e) if e.generation == generation => Some(&e.doc),
            _ => self
                .pending
                .get(doc)
                .filter(|p| p.generation == generation)
                .map(|p| &p.doc),
        };
        copy.is_some_and(|d| {
            carried
                .iter()
                .all(|c| d.get_change_by_hash(&c.hash).is_some())
        })
    }

    fn receive_current(
        &mut self,
        doc: &DocId,
        state: &mut SyncState,
        msg: Message,
        signed: Option<Attestation>,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        let am = |source: automerge::AutomergeError| StoreError::Automerge {
            doc: doc.clone(),
            source: Box::new(source),
        };
        let Some(e) = self.docs.get_mut(doc) else {
            return Err(StoreError::UnknownDoc { doc: doc.clone() });
        };
        let before = e.doc.get_heads();
        e.doc.receive_sync_message(&mut state.0, msg).map_err(am)?;
        let after = e.doc.get_heads();
        if let Some(a) = signed {
            e.signed_ahead = Some(a);
        }
        if let Some(a) = e.signed_ahead.take_if(|a| a.signs_heads(&after))
            && e.signed.as_ref() != Some(&a)
        {
            e.signed = Some(a);
            e.signed_unsaved = true;
        }
        if after == before {
            return Ok(std::mem::take(&mut self.undelivered));
        }
        // Every change applied by this message, including ones queued by an earlier message
        // until their dependencies arrived: their operations name the changed keys.
        let changed = match changed_root_keys(e.doc.get_changes(&before)) {
            Some(keys) => keys,
            None => {
                tracing::debug!(doc = %doc, "changed keys not readable from the changes; diffing");
                patched_keys(&e.doc.diff(
                    &before,
                    &after,
                    TextRepresentation::String(automerge::TextEncoding::default()),
                ))
            }
        };
        e.term = read_term(&e.doc);
        let keys: Vec<String> = changed
            .into_iter()
            .filter(|k| parse_doc_key(k).is_some())
            .collect();
        let persisted = self.persist_incremental(doc, self.group_commit);
        self.set_digest(doc);
        let view = self.reconcile(doc, keys, Old::At(before));
        self.undelivered.extend(view);
        persisted?;
        self.maintain(doc)?;
        Ok(std::mem::take(&mut self.undelivered))
    }

    /// Queues a new file on the background writer (starting it with the first); written here
    /// when no thread can be started.
    fn background_write(&mut self, f: persist::NewFile) -> Result<(), StoreError> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        if self.writer.is_none() {
            match persist::Writer::start(dir.clone()) {
                Ok(w) => self.writer = Some(w),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start the store's file writer thread; writing new files inline")
                }
            }
        }
        match &mut self.writer {
            Some(w) => w.submit(f),
            None => persist::write_new(dir, &f, Durability::None).map(|_| ()),
        }
    }

    /// Replaces the held generation of `doc` with its completed pending one.
    fn promote(&mut self, doc: &DocId) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        let Some(p) = self.pending.remove(doc) else {
            return Ok(std::mem::take(&mut self.undelivered));
        };
        // A generation of a retired cluster is adopted only when its writer asked to rejoin
        // after the retirement: a rollover alone (however it started) never brings it back.
        if let Some(&retired_at_ms) = self.retired.get(&doc.cluster)
            && read_rejoin(&p.doc) <= retired_at_ms
        {
            let refused = self.refused_generations.entry(doc.clone()).or_insert(0);
            *refused = (*refused).max(p.generation);
            tracing::info!(doc = %doc, generation = p.generation, retired_at_ms, "refused a new generation of a retired cluster: it does not rejoin");
            return Err(StoreError::RetiredCluster {
                doc: doc.clone(),
                generation: p.generation,
                retired_at_ms,
            });
        }
        if let Err(err) = self.settle(doc) {
            self.pending.insert(doc.clone(), p);
            return Err(err);
        }
        // A first copy of a document joins the group commit: a replica taking in a fleet of
        // per-node documents would otherwise pay a file and a directory fsync for each, and its
        // file is written on the background writer. Only when no file of the document exists
        // yet: a crash before `sync_pending` then loses nothing anyone was told of (the file is
        // torn or absent, see `Store::open`), while a file replacing an older generation is
        // written whole before it is renamed over it.
        let defer = self.group_commit
            && self.config.durability == Durability::Fsync
            && !self.docs.contains_key(doc);
        let f = snapshot_file(
            doc,
            p.generation,
            false,
            persist::pack_snapshot(&p.doc),
            None,
            p.signed.as_ref(),
        );
        let written = if defer && self.dir.is_some() {
            let sizes = (f.len(), framed_len(f.snapshot.len()));
            self.background_write(f).map(|()| sizes)
        } else {
            self.write_snapshot(&f)
        };
        let (stored, base) = match written {
            Ok(v) => v,
            Err(err) => {
                self.pending.insert(doc.clone(), p);
                return Err(err);
            }
        };
        if defer {
            self.unsynced.insert(doc.clone());
            self.unsynced_new_files = true;
        }
        let heads = p.doc.get_heads();
        let entry = Held {
            generation: p.generation,
            term: read_term(&p.doc),
            owned: false,
            saved_heads: heads,
            heads_hash: [0; 32],
            bucket: doc.bucket(),
            digest_part: 0,
            stored_bytes: stored,
            base_bytes: base,
            fresh_bytes: base,
            commits_since_base: 0,
            num_ops: 0,
            live_bytes: 0,
            not_durable: false,
            keys_counted: (0, 0),
            signed: p.signed.filter(|a| a.signs_heads(&p.doc.get_heads())),
            signed_ahead: None,
            signed_unsaved: false,
            doc: p.doc,
        };
        let mut keys: BTreeSet<String> = object_keys(&entry.doc, None).into_iter().collect();
        let old = match self.docs.insert(doc.clone(), entry) {
            Some(old) => {
                self.xor_digest(doc, old.bucket, old.digest_part);
                keys.extend(object_keys(&old.doc, None));
                Old::Doc(Box::new(old.doc))
            }
            None => Old::Absent,
        };
        self.set_digest(doc);
        // The new generation's file is a fresh snapshot: an older copy's queued compaction is moot.
        self.compaction_due.remove(doc);
        tracing::debug!(doc = %doc, generation = p.generation, "adopted generation");
        let view = self.reconcile(doc, keys.into_iter().collect(), old);
        let mut out = std::mem::take(&mut self.undelivered);
        out.extend(view);
        Ok(out)
    }

    /// Visible value of each key, resolving which document wins. `own` reads the changed
    /// document's value in the state being captured.
    fn capture(
        &self,
        doc: &DocId,
        keys: &[String],
        own: &dyn Fn(&str) -> Option<Arc<[u8]>>,
    ) -> Vec<Option<Arc<[u8]>>> {
        keys.iter()
            .map(|k| match self.view.winner(&doc.cluster, k) {
                None => None,
                Some(w) if w == doc.writer => own(k),
                Some(w) => {
                    let other = DocId::new(doc.cluster.clone(), w);
                    self.docs
                        .get(&other)
                        .and_then(|e| read_value(&e.doc, k, None))
                }
            })
            .collect()
    }

    /// Updates the view after `doc` changed and returns the visible changes for `keys`
    /// (plus every key of the document when its lease term changed).
    fn reconcile(
        &mut self,
        doc: &DocId,
        keys: Vec<String>,
        old: Old,
    ) -> Vec<(String, ObjectChange)> {
        let old_term = self.view.term(&doc.cluster, &doc.writer);
        let new_term = self.docs.get(doc).map(|e| e.term);
        let mut keys = keys;
        if new_term.is_some_and(|t| t != old_term) {
            let mut all: BTreeSet<String> = keys.into_iter().collect();
            if let Some(e) = self.docs.get(doc) {
                all.extend(object_keys(&e.doc, None));
                if let Old::At(h) = &old {
                    all.extend(object_keys(&e.doc, Some(h)));
                }
            }
            if let Old::Doc(d) = &old {
                all.extend(object_keys(d, None));
            }
            keys = all.into_iter().collect();
        }
        let before = {
            let current = self.docs.get(doc);
            let own_old = |k: &str| match &old {
                Old::At(h) => current.and_then(|e| read_value(&e.doc, k, Some(h))),
                Old::Doc(d) => read_value(d, k, None),
                Old::Absent => None,
            };
            self.capture(doc, &keys, &own_old)
        };
        let old_max = self.view.max_term(&doc.cluster);
        if let Some(t) = new_term {
            self.view.set_term(&doc.cluster, &doc.writer, t);
        }
        let present = self.presence(doc, &keys);
        for (k, v) in keys.iter().zip(&present) {
            self.view
                .set_present(&doc.cluster, &doc.writer, k, v.is_some());
        }
        let after = {
            // The document wins a key only where it is present: its values were just read.
            let values: HashMap<&str, &Arc<[u8]>> = keys
                .iter()
                .zip(&present)
                .filter_map(|(k, v)| Some((k.as_str(), v.as_ref()?)))
                .collect();
            let own_new = |k: &str| values.get(k).map(|v| Arc::clone(v));
            self.capture(doc, &keys, &own_new)
        };
        let mut out = Vec::new();
        for ((k, b), a) in keys.iter().zip(before).zip(after) {
            if b == a {
                continue;
            }
            let Some(key) = parse_doc_key(k) else {
                continue;
            };
            let change = match a {
                Some(json) => ObjectChange::Upsert { key, json },
                None => ObjectChange::Delete { key },
            };
            out.push((doc.cluster.clone(), change));
        }
        if self.view.max_term(&doc.cluster) != old_max {
            // The Lease changed hands: every other writer's cluster-owned records change scope.
            let others: Vec<(DocId, Vec<String>, Vec<ChangeHash>)> = self
                .docs
                .iter()
                .filter(|(id, _)| id.cluster == doc.cluster && *id != doc)
                .map(|(id, e)| (id.clone(), object_keys(&e.doc, None), e.doc.get_heads()))
                .collect();
            for (other, keys, heads) in others {
                out.extend(self.reconcile(&other, keys, Old::At(heads)));
            }
        }
        out
    }

    /// Retires member cluster `cluster` as of `at_ms` (wall clock, ms since the epoch): every
    /// replica copy of its documents that does not rejoin later ([`REJOIN_KEY`] at most
    /// `at_ms`, as every document written before the retirement, and every later generation
    /// its writer rolled over to by itself) is dropped from memory, the digest and disk (the
    /// directory is fsynced). From now on messages for generations begun at or before then
    /// are refused with [`StoreError::RetiredCluster`], and so is any later generation once
    /// received whole without such a rejoin. A writer comes back only by asking to
    /// ([`Store::rejoin`], `dramesh agent --rejoin`). Returns the visible changes (deletes).
    /// Idempotent; a later retirement of the same cluster moves the bound forward, an earlier
    /// one changes nothing. The store's own documents are never dropped.
    pub fn retire_cluster(
        &mut self,
        cluster: &str,
        at_ms: u64,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        let bound = self.retired.entry(cluster.to_string()).or_insert(0);
        *bound = (*bound).max(at_ms);
        let bound = *bound;
        self.pending
            .retain(|d, p| d.cluster != cluster || p.generation > bound);
        let doomed: Vec<DocId> = self
            .docs
            .range(DocId::new(cluster, "")..)
            .take_while(|(d, _)| d.cluster == cluster)
            .filter(|(_, e)| !e.owned && read_rejoin(&e.doc) <= bound)
            .map(|(d, _)| d.clone())
            .collect();
        let mut out = std::mem::take(&mut self.undelivered);
        for doc in doomed {
            if let Some(generation) = self.drop_copy(&doc, &mut out)? {
                tracing::info!(doc = %doc, generation, "dropped the document of a retired cluster");
            }
        }
        Ok(out)
    }

    /// Drops the replica copy `doc` from memory, the digests and disk (the directory is
    /// fsynced), appending its visible changes to `out`; returns the generation dropped.
    fn drop_copy(
        &mut self,
        doc: &DocId,
        out: &mut Vec<(String, ObjectChange)>,
    ) -> Result<Option<u64>, StoreError> {
        if self.docs.get(doc).is_none_or(|e| e.owned) {
            return Ok(None);
        }
        self.settle(doc)?;
        if let Some(dir) = &self.dir {
            persist::remove(dir, doc, self.config.durability)?;
        }
        let Some(old) = self.docs.remove(doc) else {
            return Ok(None);
        };
        self.xor_digest(doc, old.bucket, old.digest_part);
        self.unsynced.remove(doc);
        self.compaction_due.remove(doc);
        let keys = object_keys(&old.doc, None);
        out.extend(self.reconcile(doc, keys, Old::Doc(Box::new(old.doc))));
        Ok(Some(old.generation))
    }

    /// Drops every document this store does not write (replica copies, and those being
    /// received) from memory, the digests and disk: an agent that stops being its cluster's
    /// relay keeps only its own document. Returns the visible changes and how many copies
    /// were dropped.
    pub fn drop_copies(&mut self) -> Result<(Vec<(String, ObjectChange)>, usize), StoreError> {
        self.pending.clear();
        let copies: Vec<DocId> = self
            .docs
            .iter()
            .filter(|(_, e)| !e.owned)
            .map(|(d, _)| d.clone())
            .collect();
        let mut out = std::mem::take(&mut self.undelivered);
        let mut dropped = 0;
        for doc in copies {
            if self.drop_copy(&doc, &mut out)?.is_some() {
                dropped += 1;
            }
        }
        Ok((out, dropped))
    }

    /// How many documents of member cluster `cluster` are held (a range of the document map).
    pub fn cluster_docs(&self, cluster: &str) -> usize {
        self.docs
            .range(DocId::new(cluster, "")..)
            .take_while(|(d, _)| d.cluster == cluster)
            .count()
    }

    /// Whether any document of member cluster `cluster` is held (a range lookup, not a scan).
    pub fn holds_cluster(&self, cluster: &str) -> bool {
        self.docs
            .range(DocId::new(cluster, "")..)
            .next()
            .is_some_and(|(d, _)| d.cluster == cluster)
    }

    /// Retired clusters and the time each was retired at ([`Store::retire_cluster`]).
    pub fn retired_clusters(&self) -> &BTreeMap<String, u64> {
        &self.retired
    }

    /// The value of each of `keys` of `doc` that counts as present in the view (`None` for the
    /// others, in the order of `keys`): held, and for a replica copy within its writer's scope
    /// ([`in_writer_scope`]). Records outside it are counted ([`Store::out_of_scope_records`])
    /// and logged; the view keeps the previous holder's value.
    fn presence(&mut self, doc: &DocId, keys: &[String]) -> Vec<Option<Arc<[u8]>>> {
        let max = self.view.max_term(&doc.cluster);
        let Some(e) = self.docs.get(doc) else {
            return vec![None; keys.len()];
        };
        let mut refused: Vec<&str> = Vec::new();
        let out = keys
            .iter()
            .map(|k| {
                let v = read_value(&e.doc, k, None)?;
                if e.owned || in_writer_scope(doc, e.term, max, k, &v) {
                    Some(v)
                } else {
                    refused.push(k);
                    None
                }
            })
            .collect();
        if let Some(first) = refused.first() {
            tracing::warn!(doc = %doc, records = refused.len(), first = %first, term = e.term, lease_term = max, "records outside their writer's scope refused: a node's writer publishes only that node's records, cluster records only the Lease holder");
        }
        self.out_of_scope += refused.len() as u64;
        out
    }

    /// Records refused so far for lying outside their writer's scope (a node agent publishing
    /// another node's records, or cluster records without holding the Lease). Each evaluation
    /// of such a record counts once.
    pub fn out_of_scope_records(&self) -> u64 {
        self.out_of_scope
    }

    /// Every visible object, as upserts (the initial load of an estimation view).
    pub fn snapshot(&self) -> Vec<(String, ObjectChange)> {
        let mut out = Vec::new();
        for (id, e) in &self.docs {
            for k in object_keys(&e.doc, None) {
                if self.view.winner(&id.cluster, &k) != Some(id.writer.as_str()) {
                    continue;
                }
                if let (Some(key), Some(json)) = (parse_doc_key(&k), read_value(&e.doc, &k, None)) {
                    out.push((id.cluster.clone(), ObjectChange::Upsert { key, json }));
                }
            }
        }
        out
    }

    /// The visible JSON of one object.
    pub fn get(&self, cluster: &str, key: &ObjectKey) -> Option<Arc<[u8]>> {
        let k = doc_key(key).ok()?;
        let w = self.view.winner(cluster, &k)?;
        let e = self.docs.get(&DocId::new(cluster, w))?;
        read_value(&e.doc, &k, None)
    }

    /// View changes that were computed but could not be returned because the call that
    /// caused them failed to persist; they are also prepended to the next successful result.
    pub fn take_undelivered(&mut self) -> Vec<(String, ObjectChange)> {
        std::mem::take(&mut self.undelivered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attest::{HeadsSigner, HeadsVerifier};
    use automerge::sync;

    #[test]
    fn changed_keys_are_read_from_root_operations() {
        let mut doc = Automerge::new();
        let mut tx = doc.transaction();
        tx.put(ROOT, "node/a", "x").unwrap();
        tx.put(ROOT, "node/b", "y").unwrap();
        tx.commit();
        let base = doc.get_heads();
        let mut tx = doc.transaction();
        tx.delete(ROOT, "node/a").unwrap();
        tx.put(ROOT, "node/c", "z").unwrap();
        tx.commit();
        let keys = changed_root_keys(doc.get_changes(&base)).expect("root map ops only");
        assert_eq!(keys.into_iter().collect::<Vec<_>>(), ["node/a", "node/c"]);
        // Anything but a scalar in the root map falls back to diffing.
        let mut tx = doc.transaction();
        let list = tx.put_object(ROOT, "l", automerge::ObjType::List).unwrap();
        tx.insert(&list, 0, "v").unwrap();
        tx.commit();
        assert_eq!(
            changed_root_keys(doc.get_changes(&[]).into_iter().last()),
            None
        );
    }

    /// A signer whose signature is the statement itself, and a verifier that accepts exactly
    /// that and counts its calls: the store's rules without cryptography.
    struct PlainTrust(Arc<std::sync::atomic::AtomicUsize>);

    impl HeadsSigner for PlainTrust {
        fn signer(&self) -> Arc<[u8]> {
            Arc::from(&b"writer"[..])
        }
        fn sign(&self, statement: &[u8]) -> Result<Vec<u8>, String> {
            Ok(statement.to_vec())
        }
    }

    impl HeadsVerifier for PlainTrust {
        fn verify(&self, _: &DocId, statement: &[u8], sig: &[u8], _: &[u8]) -> Result<(), String> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if sig == statement {
                Ok(())
            } else {
                Err("signature does not match".into())
            }
        }
    }

    fn trusted_store() -> (Store, Arc<std::sync::atomic::AtomicUsize>) {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let trust = Arc::new(PlainTrust(calls.clone()));
        let mut store = Store::in_memory(StoreConfig {
            durability: Durability::None,
            ..StoreConfig::default()
        });
        store.set_trust(Trust {
            signer: Some(trust.clone()),
            verifier: trust,
        });
        (store, calls)
    }

    fn node_upsert(name: &str, cpu: u32) -> ObjectChange {
        let json = format!(r#"{{"kind":"Node","metadata":{{"name":"{name}"}},"cpu":{cpu}}}"#);
        ObjectChange::Upsert {
            key: ObjectKey::new(ObjectKind::Node, None, name),
            json: Arc::from(json.into_bytes().into_boxed_slice()),
        }
    }

    fn raw_message(changes: &[&automerge::Change], heads: Vec<ChangeHash>) -> Vec<u8> {
        Message {
            heads,
            need: vec![],
            have: vec![],
            changes: changes
                .iter()
                .map(|c| c.raw_bytes().to_vec())
                .collect::<Vec<_>>()
                .into(),
            supported_capabilities: None,
            version: sync::MessageVersion::V1,
        }
        .encode()
    }

    fn attest(doc: &DocId, generation: u64, head: ChangeHash, sig: Option<Vec<u8>>) -> Attestation {
        let statement = attest::statement(doc, generation, &[head.0]);
        Attestation::new(
            vec![head.0],
            sig.unwrap_or(statement),
            Arc::from(&b"writer"[..]),
        )
        .unwrap()
    }

    /// The full-scale mesh bench never healed before this: automerge's sync leaves out a change
    /// the receiver's Bloom filter falsely claims to hold, so the writer's message carried
    /// c1 and c3 but not c2, and "c1 is not covered by the signed heads [c3]" refused it
    /// forever. The writer's own session vouches for its changes. A relay's such message (the
    /// relay topology's only path) has its proven part applied and the rest dropped; the
    /// request for the missing change is answered with changes its queued descendants name.
    #[test]
    fn a_message_missing_an_intermediate_change_is_taken_from_the_writer_only() {
        let doc = DocId::new("c1", "_cluster");
        let (mut writer, _) = trusted_store();
        let generation = writer.open_writer(&doc).unwrap();
        let base = writer.automerge_doc(&doc).unwrap().get_heads();
        for cpu in 1..=3 {
            writer
                .apply(&doc, vec![node_upsert(&format!("n{cpu}"), cpu)])
                .unwrap();
        }
        let am = writer.automerge_doc(&doc).unwrap();
        let all = am.get_changes(&[]);
        let later = am.get_changes(&base);
        assert_eq!(later.len(), 3);
        let (c1, c2, c3) = (later[0], later[1], later[2]);
        let head = c3.hash();

        let (mut replica, calls) = trusted_store();
        let mut state = SyncState::new();
        let first: Vec<&automerge::Change> = all.iter().take(all.len() - 3).copied().collect();
        let base_head = first.last().unwrap().hash();
        // The document up to c1's parent, from its writer, into `r`.
        let load_first = |r: &mut Store, state: &mut SyncState| {
            r.receive_signed_sync_message(
                &doc,
                generation,
                state,
                &raw_message(&first, vec![base_head]),
                Proof {
                    signed: Some(&attest(&doc, generation, base_head, None)),
                    from_writer: true,
                },
                &|_| true,
            )
            .unwrap();
        };
        load_first(&mut replica, &mut state);

        let gap = raw_message(&[c1, c3], vec![head]);
        let a = attest(&doc, generation, head, None);
        // From a relay (another copy of this replica, so the writer's path below starts
        // clean): c1 is proven by nothing and dropped, c3 (the signed head) is taken and waits
        // for c2; nothing unproven is ever applied.
        let mut relay_copy = trusted_store().0;
        load_first(&mut relay_copy, &mut SyncState::new());
        let relayed = relay_copy.receive_signed_sync_message(
            &doc,
            generation,
            &mut SyncState::new(),
            &gap,
            Proof {
                signed: Some(&a),
                from_writer: false,
            },
            &|_| true,
        );
        assert!(relayed.is_ok(), "{relayed:?}");
        assert_eq!(relay_copy.uncovered_dropped(), 1);
        let n = |r: &Store, name: &str| r.get("c1", &ObjectKey::new(ObjectKind::Node, None, name));
        assert!(n(&relay_copy, "n1").is_none() && n(&relay_copy, "n3").is_none());
        // The relay's answer to the request for c2 (it also resends c1, which c2 depends on):
        // c2 is named by the queued c3, so both are proven and the chain completes.
        relay_copy
            .receive_signed_sync_message(
                &doc,
                generation,
                &mut SyncState::new(),
                &raw_message(&[c1, c2], vec![head]),
                Proof {
                    signed: Some(&a),
                    from_writer: false,
                },
                &|_| true,
            )
            .unwrap();
        for name in ["n1", "n2", "n3"] {
            assert!(n(&relay_copy, name).is_some(), "{name}");
        }
        assert_eq!(relay_copy.uncovered_dropped(), 1);

        replica
            .receive_signed_sync_message(
                &doc,
                generation,
                &mut state,
                &gap,
                Proof {
                    signed: Some(&a),
                    from_writer: true,
                },
                &|_| true,
            )
            .unwrap();
        let n = |r: &Store, name: &str| r.get("c1", &ObjectKey::new(ObjectKind::Node, None, name));
        assert!(n(&replica, "n1").is_some(), "c1 applied");
        assert!(n(&replica, "n3").is_none(), "c3 waits for c2");
        replica
            .receive_signed_sync_message(
                &doc,
                generation,
                &mut state,
                &raw_message(&[c2], vec![head]),
                Proof {
                    signed: Some(&a),
                    from_writer: true,
                },
                &|_| true,
            )
            .unwrap();
        assert!(n(&replica, "n2").is_some() && n(&replica, "n3").is_some());
        assert_eq!(replica.automerge_doc(&doc).unwrap().get_heads(), vec![head]);
        assert_eq!(replica.signed_heads(&doc), Some(&a));

        // Everything resent (as relays and anti-entropy do) is already held: no signature
        // check, and an unverified attestation is not adopted in place of the verified one.
        let before = calls.load(std::sync::atomic::Ordering::Relaxed);
        let bogus = attest(&doc, generation, head, Some(b"not a signature".to_vec()));
        let again = replica
            .receive_signed_sync_message(
                &doc,
                generation,
                &mut SyncState::new(),
                &raw_message(&[c1, c2, c3], vec![head]),
                Proof {
                    signed: Some(&bogus),
                    from_writer: false,
                },
                &|_| true,
            )
            .unwrap();
        assert!(again.is_empty());
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), before);
        assert_eq!(replica.signed_heads(&doc), Some(&a));
        // A new change under that bogus signature is checked and refused.
        writer.apply(&doc, vec![node_upsert("n4", 4)]).unwrap();
        let am = writer.automerge_doc(&doc).unwrap();
        let c4 = am.get_changes(&[head])[0];
        let forged = attest(
            &doc,
            generation,
            c4.hash(),
            Some(b"not a signature".to_vec()),
        );
        let refused = replica.receive_signed_sync_message(
            &doc,
            generation,
            &mut SyncState::new(),
            &raw_message(&[c4], vec![c4.hash()]),
            Proof {
                signed: Some(&forged),
                from_writer: true,
            },
            &|_| true,
        );
        assert!(
            matches!(refused, Err(StoreError::BadSignature { .. })),
            "{refused:?}"
        );
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), before + 1);
        // A message of unproven changes only is refused, whoever sends it.
        let c4 = c4.hash();
        writer.apply(&doc, vec![node_upsert("n9", 9)]).unwrap();
        let am9 = writer.automerge_doc(&doc).unwrap();
        let c9 = am9.get_changes(&[c4])[0].clone();
        writer.apply(&doc, vec![node_upsert("n10", 10)]).unwrap();
        let c10 = writer.automerge_doc(&doc).unwrap().get_heads()[0];
        let orphan = relay_copy.receive_signed_sync_message(
            &doc,
            generation,
            &mut SyncState::new(),
            &raw_message(&[&c9], vec![c10]),
            Proof {
                signed: Some(&attest(&doc, generation, c10, None)),
                from_writer: false,
            },
            &|_| true,
        );
        match orphan {
            Err(StoreError::BadSignature { reason, .. }) => {
                assert!(reason.contains("not covered"), "{reason}")
            }
            other => panic!("unproven changes must be refused, got {other:?}"),
        }
        assert!(n(&relay_copy, "n9").is_none());
    }

    /// A peer offering many documents at once (a relay's cluster, a new replica's fleet) first
    /// sends heads only: those start no side document, so `max_pending` bounds only documents
    /// whose changes are being received.
    #[test]
    fn heads_only_first_messages_start_no_side_documents() {
        let mut replica = Store::in_memory(StoreConfig {
            durability: Durability::None,
            max_pending: 2,
            ..StoreConfig::default()
        });
        let mut writer = Store::in_memory(StoreConfig {
            durability: Durability::None,
            ..StoreConfig::default()
        });
        for i in 0..5 {
            let doc = DocId::new("c1", format!("n{i}"));
            let generation = writer.open_writer(&doc).unwrap();
            writer.apply(&doc, vec![node_upsert("n", i)]).unwrap();
            let first = writer
                .generate_sync_message(&doc, generation, &mut SyncState::new())
                .unwrap()
                .unwrap();
            assert!(Message::decode(&first).unwrap().changes.is_empty());
            let got = replica.receive_sync_message(
                &doc,
                generation,
                &mut SyncState::new(),
                &first,
                &|_| true,
            );
            assert!(got.is_ok(), "document {i}: {got:?}");
        }
        assert!(replica.pending.is_empty());
        assert!(replica.entries().is_empty());
    }

    /// A large change that arrived compressed is sent on in the form it arrived in: relaying a
    /// generation's base change to every peer costs no deflating.
    #[test]
    fn a_change_that_arrived_compressed_is_relayed_as_it_arrived() {
        let doc = DocId::new("c1", "_cluster");
        let (mut writer, _) = trusted_store();
        let generation = writer.open_writer(&doc).unwrap();
        let base = writer.automerge_doc(&doc).unwrap().get_heads();
        let big: Vec<ObjectChange> = (0..400).map(|i| node_upsert(&format!("n{i}"), i)).collect();
        writer.apply(&doc, big).unwrap();
        let am = writer.automerge_doc(&doc).unwrap();
        let all: Vec<automerge::Change> = am.get_changes(&[]).into_iter().cloned().collect();
        let mut large = am.get_changes(&base)[0].clone();
        assert!(large.raw_bytes().len() >= crate::packed::COMPRESS_MESSAGE_BYTES);
        let compressed = large.bytes().to_vec();
        assert!(compressed.len() < large.raw_bytes().len());
        let head = large.hash();
        let mut chunks: Vec<Vec<u8>> = all[..all.len() - 1]
            .iter()
            .map(|c| c.raw_bytes().to_vec())
            .collect();
        chunks.push(compressed.clone());
        let msg = Message {
            heads: vec![head],
            need: vec![],
            have: vec![],
            changes: chunks.into(),
            supported_capabilities: None,
            version: sync::MessageVersion::V1,
        };
        let (mut replica, _) = trusted_store();
        replica
            .receive_signed_sync_message(
                &doc,
                generation,
                &mut SyncState::new(),
                &msg.encode(),
                Proof {
                    signed: Some(&attest(&doc, generation, head, None)),
                    from_writer: true,
                },
                &|_| true,
            )
            .unwrap();
        assert_eq!(replica.automerge_doc(&doc).unwrap().get_heads(), vec![head]);
        assert_eq!(replica.packed.len(), 1);
        // Sending it on: the raw change goes out as the chunk that arrived.
        let out = Message {
            heads: vec![head],
            need: vec![],
            have: vec![],
            changes: vec![large.raw_bytes().to_vec()].into(),
            supported_capabilities: None,
            version: sync::MessageVersion::V1,
        };
        let sent = Message::decode(&encode_message(out, &mut replica.packed)).unwrap();
        assert_eq!(
            sent.changes.iter().next().map(<[u8]>::to_vec),
            Some(compressed)
        );
    }
}
