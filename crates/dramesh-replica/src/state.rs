//! What a replica answers from: [`ReplicaState`], the estimation view fed with the visible
//! object changes the store reports, the side indexes fed from the same stream (device status,
//! unbound pods), one [`Estimator`] whose caches survive between calls, a monotonic freshness
//! clock per cluster, the reservation table, and the replicated store (for digests and the
//! debug endpoint).
//!
//! Guarantees:
//! - Karmada questions are answered for exactly one cluster: a cluster not in the view is
//!   [`ReplicaAnswer::UnknownCluster`]; one whose writers have not been heard from for longer
//!   than `stale_after` (measured with [`Instant`], so wall-clock jumps cannot make data look
//!   fresh or stale) is [`ReplicaAnswer::Stale`].
//! - The view and the pending-pod index change together, under one lock, so a reader never
//!   sees one ahead of the other.
//! - In-flight reservations (see [`crate::reservations`]) are routed out of the store's change
//!   stream into their own table; every estimate (Karmada and native, placement and
//!   preemption included) deducts the reservations that overcommit resolution
//!   ([`dramesh_estimator::resolve`]) admits, recomputed per cluster whenever that cluster's
//!   reservation set, its set of unexpired reservations or its view changes.
//!
//! # Lock order
//!
//! Eight locks, always taken in this order, and each only inside a small method of this module
//! (plus `caps`, taken first and only by `reserve`, so that checking a creator's caps and
//! writing its reservation are one step; `resolving`, taken first and only by the
//! resolution, which takes 3, 4 and 5 inside it, so resolutions are made one at a time; and
//! the queue of [`crate::group_commit`], a leaf):
//!
//! 1. `feed`: serializes draining the store's queue with applying it (and writing this
//!    replica's reservation document), so batches reach the view in the order the store
//!    produced them. Taken only by [`ReplicaState::catch_up`],
//!    [`ReplicaState::rebuild_from_store`] and the reservation writer (the group commit's
//!    writing waiter), never with another lock held.
//! 2. `store`, 3. `reservations` (the table): leaves. Each is held only for the duration of one
//!    closure ([`ReplicaState::with_store`], `with_table`) that takes no other lock.
//! 4. `indexes` (RwLock: view, pending) then 5. `compute` (the estimator and the
//!    cached resolution): `compute` can only be taken by handing in the held indexes
//!    (`ReplicaState::compute(&Indexes)`), so it is never taken first.
//! 6. `fresh` (data age per cluster): a leaf, taken only inside `touch`, `data_age` and the
//!    change feed, possibly while the indexes are held.
//! 7. `retired` (the latest tombstone per retired cluster, see [`crate::retire`]): a leaf,
//!    held only for one closure (`with_retired`) that takes no other lock.
//! 8. `headroom` (the NodePool failure detection of scale-up headroom): a leaf, taken with
//!    the indexes held (the view it observes), released before `compute` is taken.
//! 9. `roles` (the scheduler role records of the replicas, see [`crate::members`]): a leaf,
//!    held only inside `apply_changes`, `role_records` and a rebuild, taking no other lock.
//!
//! The mesh holds `store` too (the same mutex) and takes no lock of this state.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::sync::lock;
use dramesh_api::native::{ClusterStatus, Freshness, ResourceAmount, StatusReport};
use dramesh_api::{ApiError, FreshnessMap, ReplicaAnswer};
use dramesh_estimator::{CacheBound, ResList};
use dramesh_estimator::{
    Estimate, EstimateOptions, Estimator, PlacementResult, PreemptionResult, View,
};
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_model::ObjectChange;

use crate::devstatus;
use crate::pending::PendingIndex;
use crate::requests::workload_from_manifests;
use crate::reservations::{self as resv, Table};
use crate::reserve::Resolved;
use crate::retire::{self, Retired};

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

/// The indexes fed from the store's change stream; always updated together.
#[derive(Default)]
pub(crate) struct Indexes {
    /// The estimation view.
    pub(crate) view: View,
    /// Unbound pods per cluster, for `GetUnschedulableReplicas`.
    pub(crate) pending: PendingIndex,
}

/// A live reservation holding a scheduler decision ([`ReplicaState::decision_reservations`]).
#[derive(Debug, Clone)]
pub(crate) struct DecisionEntry {
    pub(crate) id: Arc<str>,
    pub(crate) cluster: Arc<str>,
    pub(crate) owner: String,
    pub(crate) decision: dramesh_scheduler::void::DecisionRef,
    /// When this replica first saw it (its owner: made it).
    pub(crate) seen: Instant,
}

/// The estimator and the overcommit resolution last computed with it.
pub(crate) struct Compute {
    pub(crate) estimator: Estimator,
    /// The last resolution; each cluster's part records what it was computed from, so a
    /// change of one cluster's reservations resolves that cluster again, not all of them.
    pub(crate) resolved: Option<Arc<Resolved>>,
    /// Bound pods per workload, for the replicas a reservation still holds.
    pub(crate) bound: crate::reservations::BoundPods,
    /// Cluster resolutions computed so far (numbers them).
    pub(crate) epochs: u64,
    /// Of those, the ones that only resolved reservations added after all others.
    pub(crate) extended: u64,
}

impl Compute {
    /// Empty caches bounded as `bound` says.
    fn new(bound: CacheBound) -> Compute {
        Compute {
            estimator: Estimator::with_cache_bound(bound),
            resolved: None,
            bound: Default::default(),
            epochs: 0,
            extended: 0,
        }
    }
}

/// Everything a replica answers from. Shared by the API servers and the mesh feeder; see the
/// module docs for the lock order.
pub struct ReplicaState {
    /// This replica's id.
    pub replica: String,
    /// Karmada answers for a cluster older than this are [`ReplicaAnswer::Stale`].
    pub stale_after: Duration,
    store: Arc<Mutex<MeshStore>>,
    feed: Mutex<()>,
    /// Every known reservation (own and merged).
    reservations: Mutex<Table>,
    indexes: RwLock<Indexes>,
    compute: Mutex<Compute>,
    /// Bound of the estimator's caches.
    cache_bound: Mutex<CacheBound>,
    /// Counts changes that can free or take capacity (view changes, a cluster forgotten,
    /// reservation changes): the scheduler role retries unschedulable bindings when it moved.
    changes: AtomicU64,
    /// Last time each cluster's writers were heard from (a change or a heartbeat).
    fresh: Mutex<HashMap<String, Instant>>,
    /// The latest tombstone of each retired cluster.
    retired: Mutex<Retired>,
    /// The scheduler role records of the replicas (their reservation documents' `_role`).
    roles: Mutex<crate::members::Roles>,
    /// Whether this replica's reservation document could be opened for writing.
    pub(crate) reservations_writable: bool,
    /// Writes to this replica's reservation document, queued and made durable together.
    pub(crate) own_writes: crate::group_commit::GroupCommit,
    /// Held while computing the overcommit resolution (taken before every other lock): one
    /// resolution at a time, each starting from the last.
    pub(crate) resolving: Mutex<()>,
    /// Signalled after this replica wrote its reservation or retirement document (the mesh
    /// pushes both).
    pub(crate) own_docs_changed: Arc<tokio::sync::Notify>,
    /// Per-identity caps of reservations, and the lock that makes checking them and writing
    /// a reservation one step (taken before `feed`).
    pub(crate) caps: Mutex<dramesh_api::auth::Caps>,
    /// Scale-up headroom (`--estimate-autoscaler-headroom`), `None` when off: Karmada's
    /// NodePool failure detection, shown the view after every applied batch and at every
    /// query that counts headroom, on this replica's monotonic clock. A leaf lock, taken
    /// while the indexes are held.
    headroom: Mutex<Option<HeadroomState>>,
}

/// The failure detection of scale-up headroom and the start of its clock.
struct HeadroomState {
    health: dramesh_estimator::AutoscalerHealth,
    started: Instant,
}

#[cfg(test)]
impl ReplicaState {
    /// A state over an empty in-memory store, its view fed by the changes the store reports.
    pub(crate) fn in_memory(replica: &str) -> Arc<ReplicaState> {
        let store = dramesh_mesh::daemon::open_store(None, "test").expect("in-memory store");
        let store = Arc::new(Mutex::new(MeshStore::new(store, true)));
        ReplicaState::new(replica, Duration::from_secs(120), store)
    }
}

impl ReplicaState {
    /// A state whose view holds the store's current contents; every cluster in it counts as
    /// heard from now (the replica just started).
    pub fn new(
        replica: &str,
        stale_after: Duration,
        store: Arc<Mutex<MeshStore>>,
    ) -> Arc<ReplicaState> {
        let writable = match lock(&store).open_writer(&resv::doc_id(replica)) {
            Ok(_) => true,
            Err(e) => {
                tracing::error!(error = %e, "the reservation document cannot be written; reservations are read-only here");
                false
            }
        };
        if let Err(e) = lock(&store).open_writer(&retire::doc_id(replica)) {
            tracing::error!(error = %e, "the retirement document cannot be written; clusters cannot be retired here");
        }
        let state = Arc::new(ReplicaState {
            reservations: Mutex::new(Table::new(replica)),
            retired: Mutex::new(Retired::default()),
            roles: Mutex::new(Default::default()),
            reservations_writable: writable,
            own_writes: Default::default(),
            resolving: Mutex::new(()),
            own_docs_changed: Arc::new(tokio::sync::Notify::new()),
            caps: Mutex::new(dramesh_api::auth::Caps::default()),
            replica: replica.to_string(),
            stale_after,
            store,
            feed: Mutex::new(()),
            indexes: RwLock::new(Indexes::default()),
            compute: Mutex::new(Compute::new(CacheBound::View)),
            cache_bound: Mutex::new(CacheBound::View),
            changes: AtomicU64::new(0),
            fresh: Mutex::new(HashMap::new()),
            headroom: Mutex::new(None),
        });
        state.rebuild_from_store();
        state
    }

    /// Runs `f` on the replicated store. `f` must not call back into this state.
    pub fn with_store<R>(&self, f: impl FnOnce(&mut MeshStore) -> R) -> R {
        f(&mut lock(&self.store))
    }

    /// Runs `f` on the reservation table (a leaf lock: `f` takes no other).
    pub(crate) fn with_table<R>(&self, f: impl FnOnce(&mut Table) -> R) -> R {
        f(&mut lock(&self.reservations))
    }

    /// Runs `f` on the retired-cluster table (a leaf lock: `f` takes no other).
    pub(crate) fn with_retired<R>(&self, f: impl FnOnce(&mut Retired) -> R) -> R {
        f(&mut lock(&self.retired))
    }

    /// Read access to the view and its side indexes.
    pub(crate) fn indexes(&self) -> RwLockReadGuard<'_, Indexes> {
        read(&self.indexes)
    }

    /// The estimator and resolution cache; taking it requires holding the indexes, which
    /// fixes the order indexes → compute.
    /// Sets the per-identity caps of reservations created from now on.
    pub fn set_caps(&self, caps: dramesh_api::auth::Caps) {
        *lock(&self.caps) = caps;
    }

    /// Turns scale-up headroom from Karpenter NodePools on or off (off by default): when on,
    /// Karmada answers include it, native estimates report it beside `maxReplicas`, and
    /// placement and preemption count it when a request asks to.
    pub fn set_autoscaler_headroom(&self, on: bool) {
        let indexes = self.indexes();
        let mut h = lock(&self.headroom);
        *h = on.then(|| HeadroomState {
            health: dramesh_estimator::AutoscalerHealth::new(),
            started: Instant::now(),
        });
        if let Some(st) = h.as_mut() {
            st.health.observe(&indexes.view, Duration::ZERO);
        }
    }

    /// Whether scale-up headroom is on.
    pub fn autoscaler_headroom(&self) -> bool {
        lock(&self.headroom).is_some()
    }

    /// The headroom options of an estimate of `clusters` (every cluster when empty) over
    /// `view` (held by the caller): those clusters' pools observed now, the pools failed as of
    /// now; `None` when headroom is off. `count`: add it to `max_replicas`.
    pub(crate) fn headroom_options(
        &self,
        view: &View,
        clusters: &[String],
        count: bool,
    ) -> Option<dramesh_estimator::HeadroomOptions> {
        let mut h = lock(&self.headroom);
        let st = h.as_mut()?;
        let now = st.started.elapsed();
        let failed = if clusters.is_empty() {
            st.health.observe(view, now)
        } else {
            for c in clusters.iter().filter_map(|c| view.cluster(c)) {
                st.health.observe_cluster(c, now);
            }
            st.health.failed(now)
        };
        Some(dramesh_estimator::HeadroomOptions { failed, count })
    }

    /// [`ReplicaState::headroom_options`] for a request that asks to count headroom
    /// (`use_headroom`): an error when headroom is off, nothing when not asked.
    pub(crate) fn headroom_asked(
        &self,
        view: &View,
        clusters: &[String],
        asked: bool,
    ) -> Result<Option<dramesh_estimator::HeadroomOptions>, ApiError> {
        if !asked {
            return Ok(None);
        }
        self.headroom_options(view, clusters, true).map(Some).ok_or_else(|| {
            ApiError::InvalidRequest(
                "useHeadroom: this replica does not count scale-up headroom (start it with --estimate-autoscaler-headroom)".into(),
            )
        })
    }

    /// Bounds the estimator's caches as `bound` says (default [`CacheBound::View`]); the
    /// caches start over empty.
    pub fn set_estimate_cache_bound(&self, bound: CacheBound) {
        *lock(&self.cache_bound) = bound;
        let indexes = self.indexes();
        *self.compute(&indexes) = Compute::new(bound);
    }

    pub(crate) fn compute(&self, _held: &Indexes) -> MutexGuard<'_, Compute> {
        lock(&self.compute)
    }

    /// Runs `f` on the view (under the indexes' read lock).
    pub fn with_view<R>(&self, f: impl FnOnce(&View) -> R) -> R {
        f(&self.indexes().view)
    }

    /// How many batches of changes that can free or take capacity were applied so far.
    pub(crate) fn change_count(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }

    /// Runs `f` with the feed serialized (lock 1); used by the reservation writer.
    pub(crate) fn with_feed<R>(&self, f: impl FnOnce() -> R) -> R {
        let _feed = lock(&self.feed);
        f()
    }

    /// Moves the view changes queued by the store (received sync messages) into the view;
    /// returns how many were applied.
    pub fn catch_up(&self) -> usize {
        let _feed = lock(&self.feed);
        let (changes, overflowed) = {
            let mut store = lock(&self.store);
            (store.drain_changes(), store.take_overflowed())
        };
        if overflowed {
            tracing::warn!("view change queue overflowed; rebuilding the view from the store");
            self.rebuild_locked();
            return 0;
        }
        self.apply_changes(&changes);
        changes.len()
    }

    /// Replaces the view with the store's current contents.
    pub fn rebuild_from_store(&self) {
        let _feed = lock(&self.feed);
        self.rebuild_locked();
    }

    fn rebuild_locked(&self) {
        let snapshot = {
            let mut store = lock(&self.store);
            // The snapshot already holds whatever is queued.
            store.drain_changes();
            store.store().snapshot()
        };
        {
            let mut indexes = write(&self.indexes);
            *indexes = Indexes::default();
            let bound = *lock(&self.cache_bound);
            *self.compute(&indexes) = Compute::new(bound);
        }
        lock(&self.roles).clear();
        let keep: BTreeSet<String> = snapshot
            .iter()
            .filter(|(c, _)| resv::is_scope(c))
            .map(|(_, ch)| ch.key().name.clone())
            .collect();
        self.apply_changes(&snapshot);
        self.with_table(|t| t.retain(&keep));
    }

    /// Applies visible object changes: reservations to their table, member-cluster data to
    /// the view, then tombstones (so a retirement also removes what arrived before it in the
    /// same batch). A change that does not decode is logged and skipped (the object keeps
    /// its previous value).
    pub fn apply_changes(&self, changes: &[(String, ObjectChange)]) {
        if changes.is_empty() {
            return;
        }
        let now = Instant::now();
        let (ours, changes): (Vec<_>, Vec<_>) =
            changes.iter().partition(|(c, _)| resv::is_scope(c));
        let (roles, ours): (Vec<_>, Vec<_>) = ours
            .into_iter()
            .partition(|(_, ch)| crate::members::role_of(ch.key()).is_some());
        if !roles.is_empty() {
            self.apply_roles(&roles);
        }
        if !ours.is_empty() {
            // The reservations of one decision share their manifests: decoded once.
            type Decoded = Result<Arc<dramesh_estimator::Workload>, String>;
            let mut decoded: HashMap<Vec<String>, Decoded> = HashMap::new();
            let mut decode = |m: &[String]| {
                if let Some(w) = decoded.get(m) {
                    return w.clone();
                }
                let w = workload_from_manifests(m)
                    .map(Arc::new)
                    .map_err(|e| e.to_string());
                decoded.insert(m.to_vec(), w.clone());
                w
            };
            self.with_table(|table| {
                for (_, change) in ours {
                    table.apply(change, now, &mut decode);
                }
            });
        }
        let (tombstones, changes): (Vec<_>, Vec<_>) =
            changes.into_iter().partition(|(c, _)| retire::is_scope(c));
        self.apply_view_changes(&changes);
        if !tombstones.is_empty() {
            self.apply_tombstones(&tombstones);
        }
        // Counted after applying, so a reader that sees the new count sees the new view.
        self.changes.fetch_add(1, Ordering::Relaxed);
    }

    /// Applies changes of the replicas' scheduler role records.
    fn apply_roles(&self, changes: &[&(String, ObjectChange)]) {
        let mut roles = lock(&self.roles);
        for (_, change) in changes {
            crate::members::apply(&mut roles, change);
        }
    }

    /// The scheduler role records of the replicas, by replica id.
    pub(crate) fn role_records(&self) -> crate::members::Roles {
        lock(&self.roles).clone()
    }

    /// Writes this replica's scheduler role record (`Some(name)`: it shares the work of
    /// scheduler `name`), or deletes it (`None`), unless it already says so; returns once
    /// durable. Blocking.
    pub(crate) fn announce_role(&self, scheduler: Option<&str>) -> Result<(), ApiError> {
        let record = scheduler.map(|s| crate::members::RoleRecord {
            scheduler: s.to_string(),
        });
        if lock(&self.roles).get(&self.replica) == record.as_ref() {
            return Ok(());
        }
        if !self.reservations_writable {
            return Err(ApiError::Unavailable(
                "this replica's reservation document could not be opened for writing".into(),
            ));
        }
        let key = crate::members::role_key(&self.replica);
        let change = match &record {
            Some(r) => {
                let json = serde_json::to_vec(r)
                    .map_err(|e| ApiError::Internal(format!("encoding the role record: {e}")))?;
                ObjectChange::Upsert {
                    key,
                    json: Arc::from(json.as_slice()),
                }
            }
            None => ObjectChange::Delete { key },
        };
        let ticket = self.own_writes.submit(vec![change]);
        self.wait_written(ticket)
    }

    /// Replaces the scheduler decisions' reservations judged void (by id, with why; see
    /// [`crate::reservations::Record::decision`]); counts a change when the set changed, so
    /// unschedulable bindings are retried on the freed room.
    pub(crate) fn set_void_decisions(&self, void: std::collections::BTreeMap<Arc<str>, String>) {
        if self.with_table(|t| t.set_void_decisions(void)) {
            self.changes.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The live reservations holding scheduler decisions created by `creator` that this
    /// replica first saw long enough ago to be judged ([`DecisionRef::void_after`]).
    ///
    /// [`DecisionRef::void_after`]: dramesh_scheduler::void::DecisionRef::void_after
    pub(crate) fn decision_reservations(&self, creator: &str) -> Vec<DecisionEntry> {
        let now = Instant::now();
        self.with_table(|t| {
            t.entries()
                .filter(|(_, e)| e.record.creator == creator)
                .filter(|(_, e)| {
                    e.record
                        .decision
                        .as_ref()
                        .is_some_and(|d| now.saturating_duration_since(e.seen) >= d.void_after())
                })
                .filter_map(|(_, e)| {
                    Some(DecisionEntry {
                        id: e.id.clone(),
                        cluster: e.cluster.clone(),
                        owner: e.record.owner.clone(),
                        decision: e.record.decision.clone()?,
                        seen: e.seen,
                    })
                })
                .collect()
        })
    }

    /// Applies member-cluster changes to the view and its side indexes and marks their
    /// clusters fresh.
    pub(crate) fn apply_view_changes(&self, changes: &[&(String, ObjectChange)]) {
        if changes.is_empty() {
            return;
        }
        let now = Instant::now();
        {
            let mut indexes = write(&self.indexes);
            let Indexes { view, pending } = &mut *indexes;
            for (cluster, change) in changes {
                if let Err(e) = view.apply(cluster, change) {
                    tracing::warn!(cluster, key = %change.key(), error = %e, "change not applied to the view");
                }
                pending.apply(cluster, change);
            }
            if let Some(st) = lock(&self.headroom).as_mut() {
                let now = st.started.elapsed();
                let touched: BTreeSet<&str> = changes.iter().map(|(c, _)| c.as_str()).collect();
                for c in touched.into_iter().filter_map(|c| view.cluster(c)) {
                    st.health.observe_cluster(c, now);
                }
            }
        }
        let mut fresh = lock(&self.fresh);
        for (cluster, _) in changes {
            fresh.insert(cluster.clone(), now);
        }
    }

    /// Drops a retired cluster from the view and the freshness map (its unbound pods left
    /// the pending index with the deletes of its objects).
    pub(crate) fn forget_cluster(&self, cluster: &str) {
        write(&self.indexes).view.remove_cluster(cluster);
        lock(&self.fresh).remove(cluster);
        self.changes.fetch_add(1, Ordering::Relaxed);
    }

    /// Records that `cluster`'s writers were heard from at `at`. A retired cluster is not
    /// made fresh by heartbeats (its agent may still run), only by data of a newer generation.
    pub fn touch(&self, cluster: &str, at: Instant) {
        let retired = self.with_retired(|r| r.contains(cluster));
        let mut fresh = lock(&self.fresh);
        if retired && !fresh.contains_key(cluster) {
            return;
        }
        let e = fresh.entry(cluster.to_string()).or_insert(at);
        if *e < at {
            *e = at;
        }
    }

    /// Time since `cluster`'s writers were last heard from.
    pub fn data_age(&self, cluster: &str) -> Option<Duration> {
        lock(&self.fresh).get(cluster).map(|t| t.elapsed())
    }

    /// The one staleness rule: data older than `stale_after` is stale.
    fn freshness_of(&self, age: Option<Duration>) -> Freshness {
        Freshness {
            stale: age.is_some_and(|a| a > self.stale_after),
            data_age_seconds: age.map(|a| a.as_secs_f64()),
        }
    }

    /// How current `cluster`'s data is (see [`ReplicaState::freshness_of`]).
    pub fn freshness(&self, cluster: &str) -> Freshness {
        self.freshness_of(self.data_age(cluster))
    }

    /// The freshness of every cluster heard from, or of `only` those when it is not empty.
    pub fn freshness_map(&self, only: &[String]) -> FreshnessMap {
        let now = Instant::now();
        lock(&self.fresh)
            .iter()
            .filter(|(c, _)| only.is_empty() || only.contains(c))
            .map(|(c, t)| {
                let age = now.saturating_duration_since(*t);
                (c.clone(), self.freshness_of(Some(age)))
            })
            .collect()
    }

    /// Clusters whose data is stale now; placement and preemption never choose them.
    pub fn stale_clusters(&self) -> Vec<String> {
        self.freshness_map(&[])
            .into_iter()
            .filter(|(_, f)| f.stale)
            .map(|(c, _)| c)
            .collect()
    }

    /// Whether the view holds at least one cluster and every one of them is stale (the
    /// replica is then not ready).
    pub fn all_stale(&self) -> bool {
        let names: Vec<String> = self.with_view(|v| v.clusters().map(|c| c.name.clone()).collect());
        !names.is_empty() && names.iter().all(|c| self.freshness(c).stale)
    }

    /// Estimate of a workload given as manifests.
    pub fn estimate_manifests(
        &self,
        manifests: &[String],
        clusters: &[String],
    ) -> Result<Estimate, ApiError> {
        let w = workload_from_manifests(manifests)?;
        let assumed = self.reserved();
        let indexes = self.indexes();
        check_clusters(&indexes.view, clusters)?;
        let opts = EstimateOptions {
            assumed,
            clusters: clusters.to_vec(),
            headroom: self.headroom_options(&indexes.view, clusters, false),
            ..dramesh_api::deadline::estimate_options()
        };
        let est = self
            .compute(&indexes)
            .estimator
            .estimate(&indexes.view, &w, &opts);
        in_time(&opts, est)
    }

    /// Placement of a workload given as manifests (its PropagationPolicy among them).
    pub fn place_manifests(
        &self,
        manifests: &[String],
        clusters: &[String],
        replicas: Option<i64>,
        use_headroom: bool,
    ) -> Result<PlacementResult, ApiError> {
        let mut w = workload_from_manifests(manifests)?;
        if let Some(r) = replicas {
            w.replicas = r;
        }
        let policy = w.policy.clone().ok_or_else(|| {
            ApiError::InvalidRequest(
                "the workload has no PropagationPolicy or ClusterPropagationPolicy among its manifests"
                    .into(),
            )
        })?;
        let assumed = self.reserved();
        let indexes = self.indexes();
        check_clusters(&indexes.view, clusters)?;
        let opts = EstimateOptions {
            assumed,
            clusters: clusters.to_vec(),
            stale: self.stale_clusters(),
            headroom: self.headroom_asked(&indexes.view, clusters, use_headroom)?,
            ..dramesh_api::deadline::estimate_options()
        };
        let placed = dramesh_estimator::place(
            &indexes.view,
            &w,
            &policy,
            &mut self.compute(&indexes).estimator,
            &opts,
        );
        in_time(&opts, placed)
    }

    /// Preemption for a workload given as manifests; a PropagationPolicy among them restricts
    /// the candidate clusters to its cluster affinity.
    pub fn preempt_manifests(
        &self,
        manifests: &[String],
        clusters: &[String],
        replicas: Option<i64>,
        use_headroom: bool,
    ) -> Result<PreemptionResult, ApiError> {
        let mut w = workload_from_manifests(manifests)?;
        if let Some(r) = replicas {
            w.replicas = r;
        }
        let assumed = self.reserved();
        let indexes = self.indexes();
        let view = &indexes.view;
        check_clusters(view, clusters)?;
        let mut opts = EstimateOptions {
            assumed,
            clusters: clusters.to_vec(),
            stale: self.stale_clusters(),
            headroom: self.headroom_asked(view, clusters, use_headroom)?,
            ..dramesh_api::deadline::estimate_options()
        };
        if opts.clusters.is_empty()
            && let Some(a) = w.policy.as_ref().and_then(|p| p.affinity.as_ref())
        {
            opts.clusters = a.matching_clusters(view);
            if opts.clusters.is_empty() {
                return Err(ApiError::InvalidRequest(
                    "no cluster matches the policy's cluster affinity".into(),
                ));
            }
        }
        let p = dramesh_estimator::preempt(view, &w, &mut self.compute(&indexes).estimator, &opts);
        in_time(&opts, p)
    }

    /// The scheduler role's decision for binding `b` on the current view: admitted
    /// reservations deducted (of the preemption holds written for `b`, only what `b` has
    /// assigned on their cluster: the rest is `b`'s room), stale clusters never chosen, the
    /// estimator's work stopped at `deadline`; with `kept`, `b` without replicas its
    /// reservations lost, decided as
    /// [`dramesh_scheduler::decide_after_loss`] does. Blocking: call it off the async reactor.
    pub(crate) fn decide_binding(
        &self,
        b: &dramesh_scheduler::Binding,
        kept: Option<&dramesh_scheduler::Binding>,
        demand: &dramesh_scheduler::Demand,
        clusters: &std::collections::BTreeMap<String, dramesh_scheduler::Cluster>,
        deadline: Instant,
    ) -> dramesh_scheduler::Decision {
        let assumed = self.reserved_for(kept.unwrap_or(b));
        self.on_fleet(assumed, clusters, deadline, |fleet, est, opts| match kept {
            Some(k) => dramesh_scheduler::decide_after_loss(k, demand, fleet, est, opts),
            None => dramesh_scheduler::decide(b, demand, fleet, est, opts),
        })
    }

    /// Runs `f` on the Karmada fleet `clusters` over the current view, with the estimator and
    /// options deducting `assumed`, leaving out stale clusters and stopping at `deadline`;
    /// returns `f`'s answer.
    fn on_fleet<T>(
        &self,
        assumed: dramesh_estimator::Assumed,
        clusters: &std::collections::BTreeMap<String, dramesh_scheduler::Cluster>,
        deadline: Instant,
        f: impl FnOnce(
            dramesh_scheduler::Fleet<'_>,
            &mut dramesh_estimator::Estimator,
            &mut EstimateOptions,
        ) -> T,
    ) -> T {
        let stale = self.stale_clusters();
        let indexes = self.indexes();
        let mut opts = EstimateOptions {
            assumed,
            stale,
            deadline: Some(deadline),
            ..EstimateOptions::default()
        };
        let fleet = dramesh_scheduler::Fleet {
            clusters,
            view: &indexes.view,
        };
        let mut compute = self.compute(&indexes);
        f(fleet, &mut compute.estimator, &mut opts)
    }

    /// The scheduler role's preemption plan for binding `preemptor`, which fits nowhere,
    /// among `bindings` (every binding the role knows): [`dramesh_scheduler::plan_preemption`]
    /// on the current view with every admitted reservation deducted, stale clusters never
    /// chosen, the estimator's work stopped at `deadline` (then `Err`). Blocking: call it off
    /// the async reactor.
    pub(crate) fn preempt_binding<B: std::borrow::Borrow<dramesh_scheduler::Binding>>(
        &self,
        preemptor: &dramesh_scheduler::Binding,
        demand: &dramesh_scheduler::Demand,
        bindings: &[B],
        clusters: &std::collections::BTreeMap<String, dramesh_scheduler::Cluster>,
        deadline: Instant,
        now: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
    ) -> Result<dramesh_scheduler::PreemptionPlan, String> {
        self.on_fleet(self.reserved(), clusters, deadline, |fleet, est, opts| {
            let plan = dramesh_scheduler::plan_preemption(
                preemptor, demand, bindings, fleet, est, opts, now,
            );
            if opts.past_deadline() {
                return Err(dramesh_estimator::DEADLINE_EXCEEDED.into());
            }
            plan
        })
    }

    /// Known, fresh cluster, or the Karmada answer explaining why not.
    pub(crate) fn check_karmada(&self, view: &View, cluster: &str) -> Result<(), ReplicaAnswer> {
        if view.cluster(cluster).is_none() {
            return Err(ReplicaAnswer::UnknownCluster);
        }
        let age = self.data_age(cluster);
        if let (true, Some(age)) = (self.freshness_of(age).stale, age) {
            return Err(ReplicaAnswer::Stale { age });
        }
        Ok(())
    }

    /// The status report: per cluster data age, sizes, capacity and devices by class.
    pub fn status_report(&self) -> StatusReport {
        let reservations = self.reservation_list(false);
        let indexes = self.indexes();
        let mut clusters = Vec::new();
        for c in indexes.view.clusters() {
            let fresh = self.freshness(&c.name);
            let mut alloc = ResList::new();
            let mut used = ResList::new();
            for n in c.nodes() {
                alloc.add_all(&n.allocatable);
                if let Some(u) = c.usage(&n.name) {
                    used.add_all(&u.requested);
                }
            }
            let mut free = alloc.clone();
            free.sub_all(&used);
            let (alloc, used, free) = (alloc.to_map(), used.to_map(), free.to_map());
            let resources = alloc
                .iter()
                .map(|(name, a)| ResourceAmount {
                    name: name.clone(),
                    allocatable: a.clone(),
                    consumed: used.get(name).cloned().unwrap_or_else(|| "0".into()),
                    free: free.get(name).cloned().unwrap_or_else(|| a.clone()),
                })
                .collect();
            clusters.push(ClusterStatus {
                name: c.name.clone(),
                kubernetes_version: c.kubernetes_version().map(str::to_string),
                generation: c.generation(),
                data_age_seconds: fresh.data_age_seconds,
                stale: fresh.stale,
                nodes: u32::try_from(c.node_count()).unwrap_or(u32::MAX),
                pods: u32::try_from(c.pod_count()).unwrap_or(u32::MAX),
                resources,
                devices: devstatus::by_class(c.devices()),
            });
        }
        StatusReport {
            replica: self.replica.clone(),
            ready: false,
            clusters,
            reservations,
            retired: self.retired_clusters(),
        }
    }
}

/// `out`, unless the call's deadline passed while it was computed: then clusters were left
/// out of it and it must not be answered.
fn in_time<T>(opts: &EstimateOptions, out: T) -> Result<T, ApiError> {
    if opts.past_deadline() {
        Err(ApiError::Unavailable(
            dramesh_estimator::DEADLINE_EXCEEDED.into(),
        ))
    } else {
        Ok(out)
    }
}

/// `Ok` when every named cluster is in the view, else `NotFound` naming the missing ones.
pub(crate) fn check_clusters(view: &View, clusters: &[String]) -> Result<(), ApiError> {
    let unknown: Vec<&str> = clusters
        .iter()
        .filter(|c| view.cluster(c).is_none())
        .map(String::as_str)
        .collect();
    if unknown.is_empty() {
        Ok(())
    } else {
        Err(ApiError::NotFound(format!(
            "cluster(s) not in this replica's view: {}",
            unknown.join(", ")
        )))
    }
}
