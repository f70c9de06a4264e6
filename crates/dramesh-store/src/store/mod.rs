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
//!
//! Layout: one `impl Store` per job, each in its own file: `open` (loading, recovery, the
//! clock), `write` (the local writer, persistence, group commit), `maintain` (compaction),
//! `generation` (rollover, recovery, rejoin), `digest` (entries and digests), `sync` (sync
//! messages out and in, verification, reconcile, promotion into the view) and `scope` (cluster
//! scopes, retirement, dropped copies). Group commit, compaction, digests and retirement own
//! their state (`GroupCommit`, `Compaction`, `Digests`, `Retirement`); the documents, pending
//! changes, view and trust are still `Store` fields several jobs share.

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

mod digest;
mod generation;
mod maintain;
mod open;
mod scope;
mod sync;
mod write;

pub use write::PendingSync;

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
    digests: digest::Digests,
    undelivered: Vec<(String, ObjectChange)>,
    commit: write::GroupCommit,
    compaction: maintain::Compaction,
    retirement: scope::Retirement,
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
    /// Whether the store keeps the materialized view (see [`Store::stop_serving_view`]).
    serves_view: bool,
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
        ObjectKind::DeviceClass
        | ObjectKind::DeviceTaintRule
        | ObjectKind::ClusterInfo
        | ObjectKind::ResourceClaimTemplate => Some(Owner::Cluster),
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

/// The generation of `doc` that the store directory `dir` holds, read from the header of its
/// file (`None` when there is none, or it does not read): how a tool or test watches a
/// running writer's rollovers from outside the process.
pub fn stored_generation(dir: &Path, doc: &DocId) -> Option<u64> {
    let bytes = std::fs::read(persist::doc_path(dir, doc)).ok()?;
    persist::parse_file(&bytes)
        .ok()
        .map(|f| f.header.generation)
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
        header: FileHeader::current(
            id.clone(),
            generation,
            owned,
            fresh_bytes.unwrap_or(framed_len(snapshot.len())),
        ),
        signed: signed.map(Attestation::encode),
        snapshot,
    }
}

impl Store {
    /// Waits for the background writer when `doc`'s new file is not written yet, so no other
    /// operation on that file comes first.
    fn settle(&mut self, doc: &DocId) -> Result<(), StoreError> {
        match &mut self.commit.writer {
            Some(w) if w.unwritten(doc) => w.finish(),
            _ => Ok(()),
        }
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

    /// ResourceClaimTemplates are the cluster's (the Lease holder's), whatever their value:
    /// a node agent's copy shows only while its term is the highest, as a DeviceClass's.
    #[test]
    fn claim_templates_are_in_the_lease_holders_scope_only() {
        let node = DocId::new("c", "n1");
        let key = "claimtemplate/ml/gpu";
        let value = br#"{"metadata":{"name":"gpu","namespace":"ml"},"spec":{"spec":{}}}"#;
        assert!(in_writer_scope(&node, 3, 3, key, value));
        assert!(!in_writer_scope(&node, 2, 3, key, value));
        assert!(in_writer_scope(&node, 2, 3, "node/n1", b"{}"));
        assert!(in_writer_scope(
            &DocId::new("c", crate::CLUSTER_PUBLISHER),
            0,
            3,
            key,
            value
        ));
    }

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
