//! In-flight reservations as replicated CRDT state.
//!
//! Each replica writes its own reservations into its own automerge document,
//! `DocId { cluster: "_reservations", writer: <replica id> }` ([`doc_id`]). The store's
//! single-author rule therefore holds unchanged (only `writer_actor` of that document may
//! author it), the mesh replicates it like any other document, and every replica's merged view
//! of reservations is the union of all replicas' documents. The reserved scope `_reservations`
//! is not a valid cluster or agent name, so no member cluster and no agent can collide with it
//! (see `dramesh_mesh::identity`).
//!
//! A reservation is one root-map entry whose value is a [`Record`] as JSON, under the store's
//! generic cluster-scoped key form (`meta/<id>`, [`record_key`]): the store replicates,
//! persists and materializes it without knowing what it holds, and the replica routes every
//! change of the `_reservations` scope to this [`Table`] instead of the estimation view.
//!
//! Lifecycle and guarantees:
//! - **Ids** are `<owner>-<seq>` (seq zero-padded, at least the wall clock in ms when it is
//!   made, so a replica restarted without its disk does not reuse ids and ids of different
//!   replicas rank roughly by creation time, and above the other replicas' it holds up to
//!   [`FOLLOW_AHEAD`] ahead of its clock, so a new one ranks after every one known); they are
//!   unique, and they are the tiebreak of overcommit resolution.
//! - **Caps across replicas**: reservations made through the API carry the per-identity caps
//!   they were admitted under ([`Record::caps`]); every replica ranks each creator's
//!   unexpired ones by (seq, id) and voids those beyond the caps ([`Table::refresh_over_cap`]),
//!   so replicas holding the same reservations void the same ones, and the owner releases
//!   them (they end `conflicted`, with an `over_cap:` reason).
//! - **Expiry never compares wall clocks.** Each replica records when it first saw a
//!   reservation on its own monotonic clock. The owner deletes its reservation once `ttl`
//!   has passed since it wrote it; every other replica treats it as expired `ttl + grace`
//!   after it first saw it, which is never earlier than the owner (it saw it later), so a
//!   live owner's deletion normally arrives first and a dead owner cannot pin capacity.
//! - **Satisfied**: the record carries how many of the workload's pods were bound in the
//!   cluster when it was written; the reservation holds `replicas − (bound now − bound then)`
//!   (at least 0), and the owner deletes it once that reaches 0.
//! - **Ended** reservations (released, expired, satisfied) are remembered for a while
//!   (at most [`MAX_ENDED`]) so an owner can still be told what became of them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dramesh_api::native::{ReservationState, ReservationStatus, WorkloadRef};
use dramesh_estimator::Workload;
use dramesh_model::{ObjectChange, ObjectKey, ObjectKind};
use dramesh_store::{DocId, RESERVATION_SCOPE};
use serde::{Deserialize, Serialize};

/// Time to live when the request names none.
pub(crate) const DEFAULT_TTL_SECONDS: u64 = 300;
/// Longest accepted time to live.
pub(crate) const MAX_TTL_SECONDS: u64 = 86_400;
/// Extra time non-owners wait past the TTL before treating a reservation as expired.
pub(crate) const EXPIRY_GRACE: Duration = Duration::from_secs(10);
/// Largest accepted record (its workload manifests included).
pub(crate) const MAX_RECORD_BYTES: usize = 256 * 1024;
/// Largest accepted replica count of one reservation.
pub(crate) const MAX_REPLICAS: i64 = 1_000_000;
/// How far ahead of this replica's clock another replica's sequence numbers are followed by
/// its own ([`Table::next_id`]).
pub(crate) const FOLLOW_AHEAD: Duration = Duration::from_secs(10);
/// How many ended reservations are remembered.
pub(crate) const MAX_ENDED: usize = 4096;
/// How many changes of decisions' reservations [`Table::decision_changes`] keeps for a reader
/// that has not read them yet; one that fell further behind reads them all again.
pub(crate) const MAX_DECISION_CHANGES: usize = 1 << 14;

/// The reservation document written by `replica`.
pub(crate) fn doc_id(replica: &str) -> DocId {
    DocId::new(RESERVATION_SCOPE, replica)
}

/// Whether `cluster` (as the store reports changes) is the reservation scope.
pub(crate) fn is_scope(cluster: &str) -> bool {
    cluster == RESERVATION_SCOPE
}

/// The store key of reservation `id`.
pub(crate) fn record_key(id: &str) -> ObjectKey {
    ObjectKey::new(ObjectKind::ClusterInfo, None, id)
}

/// One reservation as replicated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Record {
    pub(crate) id: String,
    pub(crate) owner: String,
    /// The identity that created it (the API caller's user name); only it or an admin may
    /// release it. Empty in records of replicas that predate it: then only an admin may.
    #[serde(default)]
    pub(crate) creator: String,
    pub(crate) cluster: String,
    pub(crate) workload: WorkloadRef,
    /// The per-replica requirements: the workload manifests of the request.
    pub(crate) manifests: Vec<String>,
    pub(crate) replicas: i64,
    pub(crate) priority: i32,
    pub(crate) ttl_seconds: u64,
    /// Pods of the workload bound in the cluster when the reservation was written.
    pub(crate) bound_at_creation: i64,
    /// Set on a preemption hold: the binding (`Kind ns/name`, `Binding::id`) whose
    /// preemption frees the room it holds. Decisions of that binding leave it out (the room
    /// is theirs); every other estimate deducts it like any reservation. Absent in records of
    /// replicas that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) preemptor: Option<String>,
    /// Set on a reservation made through the API: the per-identity caps of the replica that
    /// admitted it, which every replica judges it by in the cap ranking
    /// ([`Table::refresh_over_cap`]). Absent on the scheduler role's reservations (not
    /// capped) and in records of replicas that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) caps: Option<RecordCaps>,
    /// Set on the scheduler role's reservations of a decision: the binding, the generation
    /// decided on and the replicas the cluster gets. Once the decision had time to be
    /// written, every replica that sees the binding voids the reservation when the binding
    /// does not show it ([`dramesh_scheduler::void`]; [`Table::set_void_decisions`]). Absent
    /// on preemption holds, API reservations and records of replicas that predate it (they
    /// end at their TTL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) decision: Option<dramesh_scheduler::void::DecisionRef>,
}

/// The per-identity caps a reservation was admitted under (see [`Record::caps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RecordCaps {
    /// Live reservations of the identity at most.
    pub(crate) reservations: usize,
    /// Replicas summed over them at most.
    pub(crate) replicas: i64,
    /// Bytes of workload manifests summed over them at most.
    pub(crate) manifest_bytes: usize,
}

impl From<&dramesh_api::auth::Caps> for RecordCaps {
    fn from(c: &dramesh_api::auth::Caps) -> Self {
        RecordCaps {
            reservations: c.max_reservations,
            replicas: c.max_reserved_replicas,
            manifest_bytes: c.max_manifest_bytes,
        }
    }
}

impl Record {
    /// The sequence number of its id (`<owner>-<seq>`; `u64::MAX` when it is not a number):
    /// with the id, its place in the cap ranking ([`Table::refresh_over_cap`]).
    fn seq(&self) -> u64 {
        self.id
            .strip_prefix(self.owner.as_str())
            .and_then(|s| s.strip_prefix('-'))
            .and_then(|s| s.parse().ok())
            .unwrap_or(u64::MAX)
    }

    /// Bytes of its workload manifests (what the manifest-bytes cap counts).
    pub(crate) fn manifest_bytes(&self) -> usize {
        self.manifests.iter().map(String::len).sum()
    }
}

impl Record {
    /// Checks a record read from a document (another replica may run other code).
    pub(crate) fn decode(json: &[u8]) -> Result<Record, String> {
        if json.len() > MAX_RECORD_BYTES {
            return Err(format!(
                "reservation record of {} bytes exceeds {MAX_RECORD_BYTES}",
                json.len()
            ));
        }
        let r: Record =
            serde_json::from_slice(json).map_err(|e| format!("reservation record: {e}"))?;
        if !r.id.starts_with(&format!("{}-", r.owner)) {
            return Err(format!(
                "reservation {:?}: id does not start with its owner {:?}",
                r.id, r.owner
            ));
        }
        if !(1..=MAX_REPLICAS).contains(&r.replicas) {
            return Err(format!(
                "reservation {:?}: field replicas {} is not in 1..={MAX_REPLICAS}",
                r.id, r.replicas
            ));
        }
        if !(1..=MAX_TTL_SECONDS).contains(&r.ttl_seconds) {
            return Err(format!(
                "reservation {:?}: field ttlSeconds {} is not in 1..={MAX_TTL_SECONDS}",
                r.id, r.ttl_seconds
            ));
        }
        Ok(r)
    }
}

/// A known reservation.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) record: Record,
    /// The record as stored: the same bytes again are the same record, known without
    /// decoding them (every own write comes back from the store once).
    json: Arc<[u8]>,
    /// `record.id`, shared with resolutions.
    pub(crate) id: Arc<str>,
    /// `record.cluster`, shared with resolutions.
    pub(crate) cluster: Arc<str>,
    /// The [`dramesh_estimator::owner_key`] of `record.workload`.
    pub(crate) owner_key: Arc<str>,
    /// When this replica considers it expired (see the module docs).
    pub(crate) expiry: Instant,
    /// The decoded requirements, or why they do not decode.
    pub(crate) workload: Result<Arc<Workload>, String>,
    /// When this replica first saw it (the owner: when it wrote it).
    pub(crate) seen: Instant,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Decodes a record's workload manifests.
pub(crate) type Decode<'a> = dyn FnMut(&[String]) -> Result<Arc<Workload>, String> + 'a;

/// One cluster's reservations in the [`Table`].
#[derive(Debug, Default)]
struct ClusterIndex {
    /// The table version at their last change.
    version: u64,
    /// The table version of the last removal (a replaced entry is removed and added).
    last_removal: u64,
    /// By id.
    entries: BTreeMap<Arc<str>, Arc<Entry>>,
    /// The entries added since the last removal, in the order added, with the table version
    /// each was added at: what changed since any version after that removal.
    added: Vec<(u64, Arc<Entry>)>,
}

/// What [`Table::cluster_read`] found.
pub(crate) enum ClusterRead {
    /// Every entry of the cluster, in id order.
    All(Vec<Arc<Entry>>),
    /// Only entries were added since the version asked about: these, in the order added.
    Added(Vec<Arc<Entry>>),
}

/// What changed among the reservations holding scheduler decisions ([`Table::decision_changes`]).
pub(crate) enum DecisionChanges {
    /// Every one known now: the reader's version was too old (or none).
    All(Vec<Arc<Entry>>),
    /// Entries added (`true`) or removed (`false`) since the reader's version, in order (a
    /// replaced entry is removed, then added).
    Since(Vec<(Arc<Entry>, bool)>),
}

/// Every reservation this replica knows, and the recently ended ones.
pub(crate) struct Table {
    owner: String,
    entries: BTreeMap<String, Arc<Entry>>,
    ended: BTreeMap<String, ReservationStatus>,
    ended_order: VecDeque<String>,
    next_seq: u64,
    /// The highest sequence number of another replica's reservation seen, among those at most
    /// [`FOLLOW_AHEAD`] ahead of the wall clock when seen.
    newest_other: u64,
    /// Bumped on every change of `entries`.
    pub(crate) version: u64,
    /// Per cluster: its entries.
    clusters: BTreeMap<Arc<str>, ClusterIndex>,
    /// Per preemptor: the ids of the preemption holds written for it.
    holds: BTreeMap<String, BTreeSet<String>>,
    /// Per creator: its capped reservations (made through the API) in cap-ranking order.
    capped: BTreeMap<String, BTreeSet<(u64, Arc<str>)>>,
    /// The capped reservations the cap ranking voids, with why, as of the last
    /// [`Table::refresh_over_cap`].
    over_cap: BTreeMap<Arc<str>, String>,
    /// Clusters with a reservation that entered or left `over_cap` (or `void_decisions`)
    /// since the last [`Table::take_over_cap_changes`]: their resolution must be computed
    /// again.
    over_cap_changed: BTreeSet<Arc<str>>,
    /// Decisions' reservations the scheduler role judged void, with why (see
    /// [`Record::decision`]): they hold nothing.
    void_decisions: BTreeMap<Arc<str>, String>,
    /// The last changes of entries holding a decision (at most [`MAX_DECISION_CHANGES`]),
    /// with the table version of each.
    decision_log: VecDeque<(u64, Arc<Entry>, bool)>,
    /// The version of the last change dropped from `decision_log` (0: none).
    decision_log_dropped: u64,
    /// Whether `decision_log` has a reader (set by its first read).
    decision_log_on: bool,
}

impl Table {
    pub(crate) fn new(owner: &str) -> Table {
        let ms = now_ms();
        Table {
            owner: owner.to_string(),
            entries: BTreeMap::new(),
            ended: BTreeMap::new(),
            ended_order: VecDeque::new(),
            next_seq: ms.max(1),
            newest_other: 0,
            version: 0,
            clusters: BTreeMap::new(),
            holds: BTreeMap::new(),
            capped: BTreeMap::new(),
            over_cap: BTreeMap::new(),
            over_cap_changed: BTreeSet::new(),
            void_decisions: BTreeMap::new(),
            decision_log: VecDeque::new(),
            decision_log_dropped: 0,
            decision_log_on: false,
        }
    }

    /// A fresh id for a reservation of this replica: its sequence number is at least the
    /// wall clock in ms, so ids of different replicas rank roughly by creation time in the
    /// cap ranking (up to the replicas' clock skew), and above every other replica's this
    /// replica holds (those at most [`FOLLOW_AHEAD`] ahead of its clock): a new reservation
    /// ranks after every one known here, so resolution only extends (see [`Table::upsert`]).
    pub(crate) fn next_id(&mut self) -> String {
        self.next_seq = self
            .next_seq
            .max(now_ms())
            .max(self.newest_other.saturating_add(1));
        loop {
            let id = format!("{}-{:016}", self.owner, self.next_seq);
            self.next_seq += 1;
            if !self.entries.contains_key(&id) && !self.ended.contains_key(&id) {
                return id;
            }
        }
    }

    pub(crate) fn entries(&self) -> impl Iterator<Item = (&String, &Entry)> {
        self.entries.values().map(|e| (&e.record.id, &**e))
    }

    pub(crate) fn get(&self, id: &str) -> Option<&Entry> {
        self.entries.get(id).map(|e| &**e)
    }

    /// Each cluster that has entries, with the table version at their last change.
    pub(crate) fn cluster_versions(&self) -> impl Iterator<Item = (&Arc<str>, u64)> {
        self.clusters.iter().map(|(c, i)| (c, i.version))
    }

    /// The entries of `cluster`, with the version at their last change: when `since` is given
    /// and none was removed or replaced after that version, only those added after it;
    /// otherwise all of them.
    pub(crate) fn cluster_read(&self, cluster: &str, since: Option<u64>) -> (u64, ClusterRead) {
        let Some(c) = self.clusters.get(cluster) else {
            return (self.version, ClusterRead::All(Vec::new()));
        };
        match since {
            Some(v) if v >= c.last_removal => {
                let first = c.added.partition_point(|(at, _)| *at <= v);
                let added = c.added[first..].iter().map(|(_, e)| e.clone()).collect();
                (c.version, ClusterRead::Added(added))
            }
            _ => (
                c.version,
                ClusterRead::All(c.entries.values().cloned().collect()),
            ),
        }
    }

    /// The preemption holds written for `preemptor`.
    pub(crate) fn holds_for(&self, preemptor: &str) -> impl Iterator<Item = &Entry> {
        self.holds
            .get(preemptor)
            .into_iter()
            .flatten()
            .filter_map(|id| self.entries.get(id).map(|e| &**e))
    }

    /// Indexes `e`, just added (`present`) or removed, by cluster and preemptor.
    fn index(&mut self, e: &Arc<Entry>, present: bool) {
        self.version += 1;
        let version = self.version;
        let cluster = &e.cluster;
        // A cluster whose entries were all removed and that gets one again is new: a reader
        // of an earlier version must read it whole.
        let c = self
            .clusters
            .entry(cluster.clone())
            .or_insert_with(|| ClusterIndex {
                last_removal: version,
                ..ClusterIndex::default()
            });
        c.version = version;
        if self.decision_log_on && e.record.decision.is_some() {
            self.decision_log.push_back((version, e.clone(), present));
            if self.decision_log.len() > MAX_DECISION_CHANGES
                && let Some((v, _, _)) = self.decision_log.pop_front()
            {
                self.decision_log_dropped = v;
            }
        }
        if present {
            c.entries.insert(e.id.clone(), e.clone());
            c.added.push((version, e.clone()));
        } else {
            c.entries.remove(&e.id);
            c.last_removal = version;
            c.added.clear();
            if c.entries.is_empty() {
                self.clusters.remove(cluster);
            }
        }
        if e.record.caps.is_some() {
            let key = (e.record.seq(), e.id.clone());
            let ranked = self.capped.entry(e.record.creator.clone()).or_default();
            if present {
                ranked.insert(key);
            } else {
                ranked.remove(&key);
                if ranked.is_empty() {
                    self.capped.remove(&e.record.creator);
                }
            }
        }
        if let Some(p) = &e.record.preemptor {
            let ids = self.holds.entry(p.clone()).or_default();
            if present {
                ids.insert(e.record.id.clone());
            } else {
                ids.remove(&e.record.id);
                if ids.is_empty() {
                    self.holds.remove(p);
                }
            }
        }
    }

    /// The changes of the entries holding a scheduler decision since table version `since`
    /// (all of them when `None`, or when changes after `since` were dropped), and the version
    /// they bring the reader to. Lets the scheduler follow them without listing every
    /// reservation at each look. One reader: what it read is forgotten, and nothing is kept
    /// before the first read (the log holds removed entries alive until then).
    pub(crate) fn decision_changes(&mut self, since: Option<u64>) -> (DecisionChanges, u64) {
        self.decision_log_on = true;
        let changes = match since {
            Some(v) if v >= self.decision_log_dropped => {
                let read = self.decision_log.partition_point(|(at, _, _)| *at <= v);
                self.decision_log.drain(..read);
                DecisionChanges::Since(
                    self.decision_log
                        .drain(..)
                        .map(|(_, e, present)| (e, present))
                        .collect(),
                )
            }
            _ => {
                self.decision_log.clear();
                DecisionChanges::All(
                    self.entries
                        .values()
                        .filter(|e| e.record.decision.is_some())
                        .cloned()
                        .collect(),
                )
            }
        };
        self.decision_log_dropped = 0;
        (changes, self.version)
    }

    /// Computes the cap ranking again as of `now`. Per creator, its capped reservations
    /// unexpired here are ranked by (sequence number, id), i.e. by creation time, then
    /// replica; one is *over cap* (void) when, added to the reservations ranked before it
    /// that are not, it would pass one of the caps it was admitted under. A void
    /// reservation holds nothing and counts towards no cap. The ranking is a function of
    /// the reservations held and expiry alone, so replicas holding the same reservations
    /// void the same ones.
    pub(crate) fn refresh_over_cap(&mut self, now: Instant) {
        let mut over: BTreeMap<Arc<str>, String> = BTreeMap::new();
        for (creator, ranked) in &self.capped {
            let (mut count, mut replicas, mut bytes) = (0usize, 0i64, 0usize);
            for (_, id) in ranked {
                let Some(e) = self.entries.get(&**id) else {
                    continue;
                };
                let Some(caps) = e.record.caps.filter(|_| now < e.expiry) else {
                    continue;
                };
                let (r, b) = (e.record.replicas, e.record.manifest_bytes());
                let reason = if count >= caps.reservations {
                    Some(format!(
                        "over_cap: {creator} already holds {count} live reservations created before this one, the cap of live reservations per identity is {}",
                        caps.reservations
                    ))
                } else if replicas.saturating_add(r) > caps.replicas {
                    Some(format!(
                        "over_cap: {creator} already holds {replicas} reserved replicas in reservations created before this one; {r} more would exceed the cap of reserved replicas per identity, {}",
                        caps.replicas
                    ))
                } else if bytes.saturating_add(b) > caps.manifest_bytes {
                    Some(format!(
                        "over_cap: {creator} already holds {bytes} bytes of workload manifests in reservations created before this one; {b} more would exceed the cap of manifest bytes per identity, {}",
                        caps.manifest_bytes
                    ))
                } else {
                    None
                };
                match reason {
                    Some(reason) => {
                        over.insert(id.clone(), reason);
                    }
                    None => {
                        count += 1;
                        replicas = replicas.saturating_add(r);
                        bytes = bytes.saturating_add(b);
                    }
                }
            }
        }
        let changed: Vec<Arc<str>> = over
            .keys()
            .filter(|id| !self.over_cap.contains_key(*id))
            .chain(self.over_cap.keys().filter(|id| !over.contains_key(*id)))
            .filter_map(|id| self.entries.get(&**id).map(|e| e.cluster.clone()))
            .collect();
        self.over_cap_changed.extend(changed);
        self.over_cap = over;
    }

    /// The clusters whose reservations entered or left the over-cap set since the last call.
    pub(crate) fn take_over_cap_changes(&mut self) -> BTreeSet<Arc<str>> {
        std::mem::take(&mut self.over_cap_changed)
    }

    /// Replaces the decisions' reservations judged void (ids of unknown reservations are
    /// left out); returns whether the set changed.
    pub(crate) fn set_void_decisions(&mut self, void: BTreeMap<Arc<str>, String>) -> bool {
        let void: BTreeMap<Arc<str>, String> = void
            .into_iter()
            .filter(|(id, _)| self.entries.contains_key(&**id))
            .collect();
        if void == self.void_decisions {
            return false;
        }
        let changed: Vec<Arc<str>> = void
            .keys()
            .filter(|id| !self.void_decisions.contains_key(*id))
            .chain(
                self.void_decisions
                    .keys()
                    .filter(|id| !void.contains_key(*id)),
            )
            .filter_map(|id| self.entries.get(&**id).map(|e| e.cluster.clone()))
            .collect();
        self.over_cap_changed.extend(changed);
        self.void_decisions = void;
        true
    }

    /// The decisions' reservations judged void, with why.
    pub(crate) fn void_decisions(&self) -> &BTreeMap<Arc<str>, String> {
        &self.void_decisions
    }

    /// The void reservations of the last [`Table::refresh_over_cap`], with why.
    pub(crate) fn over_cap(&self) -> &BTreeMap<Arc<str>, String> {
        &self.over_cap
    }

    /// What the capped reservations of `creator` unexpired at `now` and not void hold:
    /// (reservations, replicas, manifest bytes). Call [`Table::refresh_over_cap`] first.
    pub(crate) fn held_by(&self, creator: &str, now: Instant) -> (usize, i64, usize) {
        self.capped
            .get(creator)
            .into_iter()
            .flatten()
            .filter(|(_, id)| !self.over_cap.contains_key(id))
            .filter_map(|(_, id)| self.entries.get(&**id))
            .filter(|e| now < e.expiry)
            .fold((0, 0, 0), |(n, r, b), e| {
                (
                    n + 1,
                    r.saturating_add(e.record.replicas),
                    b.saturating_add(e.record.manifest_bytes()),
                )
            })
    }

    pub(crate) fn ended(&self, id: &str) -> Option<&ReservationStatus> {
        self.ended.get(id)
    }

    pub(crate) fn ended_all(&self) -> impl Iterator<Item = &ReservationStatus> {
        self.ended.values()
    }

    /// When this replica considers `e` expired (see the module docs).
    pub(crate) fn expiry(&self, e: &Entry) -> Instant {
        e.expiry
    }

    /// Remembers how a reservation ended (bounded, oldest forgotten first).
    pub(crate) fn end(&mut self, status: ReservationStatus) {
        if !self.ended.contains_key(&status.id) {
            self.ended_order.push_back(status.id.clone());
        }
        self.ended.insert(status.id.clone(), status);
        while self.ended_order.len() > MAX_ENDED {
            if let Some(old) = self.ended_order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }

    /// Applies one change of the reservation scope, decoding the workload with `decode`.
    /// A record that does not decode is logged and ignored.
    pub(crate) fn apply(&mut self, change: &ObjectChange, now: Instant, decode: &mut Decode<'_>) {
        match change {
            ObjectChange::Upsert { key, json } => {
                if self.entries.get(&key.name).is_some_and(|e| e.json == *json) {
                    return;
                }
                // Replica metadata (`_role.`, `_ack.`, and whatever a later release adds) is
                // read by its own module; reservation ids never start with `_`.
                if key.name.starts_with('_') {
                    tracing::debug!(key = %key.name, "replica metadata of another release ignored");
                    return;
                }
                let record = match Record::decode(json) {
                    Ok(r) if r.id == key.name => r,
                    Ok(r) => {
                        tracing::warn!(key = %key.name, id = %r.id, "reservation stored under another id; ignored");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(key = %key.name, error = %e, "reservation record ignored");
                        return;
                    }
                };
                self.upsert(record, json.clone(), now, decode);
            }
            ObjectChange::Delete { key } => {
                // Whether a capped reservation was void is judged with everything known now
                // (records that voided it may have arrived in the same batch).
                if self
                    .entries
                    .get(&key.name)
                    .is_some_and(|e| e.record.caps.is_some() && !self.over_cap.contains_key(&*e.id))
                {
                    self.refresh_over_cap(now);
                }
                if let Some(e) = self.entries.remove(&key.name) {
                    self.index(&e, false);
                    let void = self.void_decisions.remove(&*e.id);
                    if !self.ended.contains_key(&key.name) {
                        // A void reservation's owner releases it: it ended over cap, or
                        // void.
                        let status = match self.over_cap.get(&*e.id) {
                            Some(reason) => over_cap_status(&e.record, reason),
                            None if void.is_some() => void_status(&e.record, void.as_deref()),
                            None if now >= self.expiry(&e) => {
                                base_status(&e.record, ReservationState::Expired)
                            }
                            None => base_status(&e.record, ReservationState::Released),
                        };
                        self.end(status);
                    }
                }
            }
        }
    }

    /// Adds or replaces the reservation `record`; `decode` is asked for its workload unless
    /// it is already known unchanged.
    fn upsert(&mut self, record: Record, json: Arc<[u8]>, now: Instant, decode: &mut Decode<'_>) {
        // `u64::MAX`: the id ends in no number.
        let seq = record.seq();
        if record.owner == self.owner {
            if seq != u64::MAX {
                self.next_seq = self.next_seq.max(seq.saturating_add(1));
            }
        } else if seq > self.newest_other
            && seq <= now_ms().saturating_add(FOLLOW_AHEAD.as_millis() as u64)
        {
            // Another replica's sequence numbers run ahead of the wall clock while it makes
            // more than one reservation per ms, or its clock is ahead: this replica's next
            // ones follow (else each ranks before reservations resolved already, and every one
            // of those is checked again; measured: most of 3 sharing replicas'
            // re-resolutions), but not a clock more than `FOLLOW_AHEAD` ahead.
            self.newest_other = seq;
        }
        let seen = self.entries.get(&record.id).map_or(now, |e| e.seen);
        if self
            .entries
            .get(&record.id)
            .is_some_and(|e| e.record == record)
        {
            return;
        }
        let workload = decode(&record.manifests);
        let w = &record.workload;
        let ttl = Duration::from_secs(record.ttl_seconds);
        let expiry = if record.owner == self.owner {
            seen + ttl
        } else {
            seen + ttl + EXPIRY_GRACE
        };
        let entry = Entry {
            json,
            expiry,
            id: Arc::from(record.id.as_str()),
            cluster: Arc::from(record.cluster.as_str()),
            owner_key: Arc::from(dramesh_estimator::owner_key(&w.namespace, &w.kind, &w.name)),
            record,
            workload,
            seen,
        };
        let entry = Arc::new(entry);
        if let Some(old) = self.entries.insert(entry.record.id.clone(), entry.clone()) {
            self.index(&old, false);
        }
        self.index(&entry, true);
    }

    /// Adds a reservation this replica is writing, whose workload it decoded already,
    /// before the write reaches the store (whose change then finds it here unchanged).
    pub(crate) fn insert_own(
        &mut self,
        record: Record,
        json: Arc<[u8]>,
        workload: Arc<Workload>,
        now: Instant,
    ) {
        self.upsert(record, json, now, &mut |_| Ok(workload.clone()));
    }

    /// Removes reservations added by [`Table::insert_own`] whose write failed: they never
    /// existed for anyone else, so they are not remembered as ended.
    pub(crate) fn forget_unwritten(&mut self, id: &str) {
        if let Some(e) = self.entries.remove(id) {
            self.index(&e, false);
        }
    }

    /// Drops every entry whose id is not in `keep` (after a rebuild from the store).
    pub(crate) fn retain(&mut self, keep: &BTreeSet<String>) {
        let gone: Vec<String> = self
            .entries
            .keys()
            .filter(|id| !keep.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            if let Some(e) = self.entries.remove(&id) {
                self.index(&e, false);
            }
        }
    }
}

/// The status of `r`, ended because the cap ranking voided it (`reason`): conflicted, holding
/// nothing.
pub(crate) fn over_cap_status(r: &Record, reason: &str) -> ReservationStatus {
    let mut st = base_status(r, ReservationState::Conflicted);
    st.remaining = 0;
    st.reason = Some(reason.to_string());
    st
}

/// The status of `r`, ended or holding nothing because its decision is void (`reason`):
/// released, with the reason.
pub(crate) fn void_status(r: &Record, reason: Option<&str>) -> ReservationStatus {
    let mut st = base_status(r, ReservationState::Released);
    st.reason = reason.map(str::to_string);
    st
}

/// The status of `r` without resolution details.
pub(crate) fn base_status(r: &Record, status: ReservationState) -> ReservationStatus {
    ReservationStatus {
        id: r.id.clone(),
        owner: r.owner.clone(),
        cluster: r.cluster.clone(),
        workload: r.workload.clone(),
        replicas: r.replicas,
        remaining: if matches!(
            status,
            ReservationState::Live | ReservationState::Conflicted
        ) {
            r.replicas
        } else {
            0
        },
        priority: r.priority,
        ttl_seconds: r.ttl_seconds,
        status,
        winner: None,
        reason: None,
        expires_in_seconds: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(owner: &str, id: &str, ttl: u64) -> Record {
        Record {
            id: id.into(),
            owner: owner.into(),
            creator: "alice".into(),
            cluster: "c".into(),
            workload: WorkloadRef {
                namespace: "ml".into(),
                kind: "Deployment".into(),
                name: "w".into(),
            },
            manifests: vec![],
            replicas: 2,
            priority: 0,
            ttl_seconds: ttl,
            bound_at_creation: 0,
            preemptor: None,
            caps: None,
            decision: None,
        }
    }

    fn upsert(r: &Record) -> ObjectChange {
        ObjectChange::Upsert {
            key: record_key(&r.id),
            json: Arc::from(serde_json::to_vec(r).unwrap().as_slice()),
        }
    }

    fn no_workload(_: &[String]) -> Result<Arc<Workload>, String> {
        Err("no manifests".into())
    }

    #[test]
    fn expiry_is_local_and_later_for_non_owners() {
        let mut t = Table::new("r1");
        let t0 = Instant::now();
        t.apply(&upsert(&record("r1", "r1-1", 60)), t0, &mut no_workload);
        t.apply(&upsert(&record("r2", "r2-1", 60)), t0, &mut no_workload);
        let own = t.get("r1-1").unwrap();
        assert_eq!(t.expiry(own), t0 + Duration::from_secs(60));
        let other = t.get("r2-1").unwrap();
        assert_eq!(t.expiry(other), t0 + Duration::from_secs(60) + EXPIRY_GRACE);
        // Seeing the same record again later keeps the first-seen time.
        let later = t0 + Duration::from_secs(30);
        t.apply(&upsert(&record("r2", "r2-1", 60)), later, &mut no_workload);
        assert_eq!(t.get("r2-1").unwrap().seen, t0);
        // A deletion after the local expiry is reported as expired, before it as released.
        t.apply(
            &ObjectChange::Delete {
                key: record_key("r2-1"),
            },
            t0 + Duration::from_secs(100),
            &mut no_workload,
        );
        assert_eq!(t.ended("r2-1").unwrap().status, ReservationState::Expired);
        t.apply(
            &ObjectChange::Delete {
                key: record_key("r1-1"),
            },
            t0 + Duration::from_secs(1),
            &mut no_workload,
        );
        assert_eq!(t.ended("r1-1").unwrap().status, ReservationState::Released);
        assert!(t.get("r1-1").is_none());
    }

    #[test]
    fn the_preemptor_mark_is_optional_on_the_wire() {
        // A record of a replica that predates the mark decodes, unmarked.
        let plain = serde_json::to_vec(&record("r1", "r1-1", 60)).unwrap();
        assert!(!String::from_utf8_lossy(&plain).contains("preemptor"));
        assert_eq!(Record::decode(&plain).unwrap().preemptor, None);
        let mut hold = record("r1", "r1-2", 60);
        hold.preemptor = Some("ResourceBinding ml/llm".into());
        let json = serde_json::to_vec(&hold).unwrap();
        assert_eq!(Record::decode(&json).unwrap(), hold);
    }

    /// Reservation and retirement records as every release wrote them (the store's golden data
    /// directories, `dramesh-store/tests/golden`) decode here, and fields a newer release adds
    /// are ignored: replicas of adjacent versions read each other's documents.
    #[test]
    fn records_of_every_release_decode_and_unknown_fields_are_ignored() {
        let mut reservations = 0;
        for (manifest, key, json) in crate::golden_objects("_reservations") {
            let r = Record::decode(&json).unwrap_or_else(|e| panic!("{manifest}: {e}"));
            assert_eq!(key, format!("meta/{}", r.id));
            reservations += 1;
        }
        assert!(reservations >= 2, "{reservations}");

        let mut newer = serde_json::to_value(record("r1", "r1-1", 60)).unwrap();
        newer["addedByANewerRelease"] = serde_json::json!({"any": [1, 2]});
        let r = Record::decode(&serde_json::to_vec(&newer).unwrap()).unwrap();
        assert_eq!(r, record("r1", "r1-1", 60));
    }

    #[test]
    fn bad_records_are_refused() {
        let mut bad = record("r2", "r1-1", 60);
        assert!(Record::decode(&serde_json::to_vec(&bad).unwrap()).is_err());
        bad.id = "r2-1".into();
        bad.replicas = 0;
        assert!(Record::decode(&serde_json::to_vec(&bad).unwrap()).is_err());
        bad.replicas = 1;
        bad.ttl_seconds = MAX_TTL_SECONDS + 1;
        assert!(Record::decode(&serde_json::to_vec(&bad).unwrap()).is_err());
        assert!(Record::decode(&vec![b' '; MAX_RECORD_BYTES + 1]).is_err());
        let mut t = Table::new("r1");
        t.apply(&upsert(&bad), Instant::now(), &mut no_workload);
        assert_eq!(t.entries().count(), 0);
    }

    #[test]
    fn ids_are_unique_and_ordered_and_skip_past_own_records() {
        let mut t = Table::new("r1");
        let a = t.next_id();
        let b = t.next_id();
        assert!(a < b, "{a} {b}");
        let far = format!("r1-{:016}", 9_000_000_000_000_000u64);
        t.apply(
            &upsert(&record("r1", &far, 60)),
            Instant::now(),
            &mut no_workload,
        );
        assert!(t.next_id() > far);
    }

    #[test]
    fn ids_follow_other_replicas_ahead_of_the_clock_but_not_far_ahead() {
        let mut t = Table::new("r1");
        let seq = |id: &str| id.rsplit_once('-').unwrap().1.parse::<u64>().unwrap();
        // Another replica 2 s ahead: the next own id ranks after its reservation.
        let ahead = now_ms() + 2_000;
        let other = format!("r2-{ahead:016}");
        t.apply(
            &upsert(&record("r2", &other, 60)),
            Instant::now(),
            &mut no_workload,
        );
        let next = t.next_id();
        assert!(seq(&next) > ahead, "{next} ranks before {other}");
        // One an hour ahead is not followed (a clock that far off would drag every replica).
        let far = now_ms() + 3_600_000;
        t.apply(
            &upsert(&record("r3", &format!("r3-{far:016}"), 60)),
            Instant::now(),
            &mut no_workload,
        );
        let next = t.next_id();
        assert!(seq(&next) < far, "{next} followed a clock an hour ahead");
    }
}
