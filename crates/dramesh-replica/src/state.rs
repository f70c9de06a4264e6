//! What a replica answers from: [`ReplicaState`], the estimation view fed with the visible
//! object changes the store reports, the side indexes fed from the same stream (device status,
//! unbound pods), one [`Estimator`] whose caches survive between calls, a monotonic freshness
//! clock per cluster, the reservations and retired clusters (components it composes), and the
//! replicated store (for digests and the debug endpoint).
//!
//! Guarantees:
//! - Karmada questions are answered for exactly one cluster: a cluster not in the view is
//!   [`ReplicaAnswer::UnknownCluster`]; one whose writers have not been heard from for longer
//!   than `stale_after` (measured with [`Instant`], so wall-clock jumps cannot make data look
//!   fresh or stale) is [`ReplicaAnswer::Stale`].
//! - The view and the pending-pod index change together, under one lock, so a reader never
//!   sees one ahead of the other.
//! - In-flight reservations (see [`crate::reservation_table`]) are routed out of the store's
//!   change stream into their component, [`Reservations`]; every estimate (Karmada and
//!   native, placement and preemption included) deducts the reservations that overcommit
//!   resolution ([`dramesh_estimator::resolve`]) admits, recomputed per cluster whenever that
//!   cluster's reservation set, its set of unexpired reservations or its view changes.
//! - Retired clusters (see [`crate::retire`]) are their own component, [`RetiredClusters`];
//!   this state composes both with the view and the store.
//!
//! # Lock order
//!
//! The order is kept by where each lock lives, not by a rule for call sites:
//!
//! 1. `caps` (private to [`Reservations`]): held only by [`Reservations::admit`] around the
//!    write of a reservation made through the API, so checking its creator's caps and
//!    writing it are one step; nothing else takes it but `set_caps`, alone.
//! 2. `feed`: serializes draining the store's queue with applying it (and writing this
//!    replica's reservation and retirement documents), so batches reach the view in the
//!    order the store produced them. Taken only by [`ReplicaState::catch_up`],
//!    [`ReplicaState::rebuild_from_store`] and `with_feed` (the group commit's writing
//!    waiter, a retirement), none of which is called with a lock of this state held.
//! 3. `store`: held only for one closure ([`ReplicaState::with_store`]) that takes no other
//!    lock. The mesh holds it too (the same mutex) and takes no lock of this state.
//! 4. `indexes` (RwLock: view, pending) and then its `compute` (the estimator and the
//!    reservation resolution cache): `compute` is a field of [`Indexes`], reachable only
//!    through a held guard ([`Indexes::compute`]), so it is never taken first. A resolution
//!    holds both throughout, which makes resolutions one at a time, each from the last.
//! 5. `own_ack`: held only by [`ReplicaState::publish_acks`] (called with no lock held) while
//!    it composes this replica's ack record from `acks` and queues it on the group commit,
//!    one leaf after the other, so records are queued in the order they were composed.
//! 6. Leaves, taken last and holding no other lock: the reservation table (private to
//!    [`Reservations`], whose module reaches no lock of this state, so it is taken with the
//!    indexes and compute held by a resolution), the retired clusters (private to
//!    [`RetiredClusters`], likewise), the group commit's queue (private to it), and, each
//!    inside one small method here, `fresh` (data age per cluster), `headroom` (NodePool
//!    failure detection, taken with the indexes held), `roles` (the replicas' scheduler role
//!    records), `acks` (their ack records) and `cache_bound`.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::sync::lock;
use dramesh_api::native::{ClusterStatus, Freshness, ResourceAmount, RetiredCluster, StatusReport};
use dramesh_api::{ApiError, FreshnessMap, ReplicaAnswer};
use dramesh_estimator::{CacheBound, ResList};
use dramesh_estimator::{
    Estimate, EstimateOptions, Estimator, PlacementResult, PreemptionResult, View,
};
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_model::ObjectChange;

use crate::devstatus;
use crate::group_commit::Ticket;
use crate::pending::PendingIndex;
use crate::requests::{check_clusters, workload_from_manifests};
use crate::reservation_resolution::{
    Judged, PreemptionHold, Reservations, ResolutionCache, Resolved,
};
use crate::reservation_table as resv;
use crate::retire::{self, RetiredClusters};

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

/// The indexes fed from the store's change stream; always updated together. The estimator
/// that answers over them is inside, behind its own lock, so only a holder of the indexes
/// can take it.
pub(crate) struct Indexes {
    /// The estimation view.
    pub(crate) view: View,
    /// Unbound pods per cluster, for `GetUnschedulableReplicas`.
    pub(crate) pending: PendingIndex,
    compute: Mutex<Compute>,
}

impl Indexes {
    /// Empty indexes, the estimator's caches bounded as `bound` says.
    fn new(bound: CacheBound) -> Indexes {
        Indexes {
            view: View::default(),
            pending: PendingIndex::default(),
            compute: Mutex::new(Compute::new(bound)),
        }
    }

    /// The estimator and the resolution cache; reachable only through held indexes, which
    /// fixes the order indexes → compute.
    pub(crate) fn compute(&self) -> MutexGuard<'_, Compute> {
        lock(&self.compute)
    }
}

/// The estimator and the overcommit resolution last computed with it.
pub(crate) struct Compute {
    pub(crate) estimator: Estimator,
    /// What the reservations' resolution keeps between calls (the last one included).
    pub(crate) resolution: ResolutionCache,
}

impl Compute {
    /// Empty caches bounded as `bound` says.
    fn new(bound: CacheBound) -> Compute {
        Compute {
            estimator: Estimator::with_cache_bound(bound),
            resolution: ResolutionCache::default(),
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
    /// Every known reservation (own and merged), its resolution, this replica's writes.
    pub(crate) reservations: Reservations,
    indexes: RwLock<Indexes>,
    /// Bound of the estimator's caches.
    cache_bound: Mutex<CacheBound>,
    /// Counts changes that can free or take capacity (view changes, a cluster forgotten,
    /// reservation changes): the scheduler role retries unschedulable bindings when it moved.
    changes: AtomicU64,
    /// Last time each cluster's writers were heard from (a change or a heartbeat).
    fresh: Mutex<HashMap<String, Instant>>,
    /// The latest tombstone of each retired cluster.
    retired: RetiredClusters,
    /// The scheduler role records of the replicas (their reservation documents' `_role`).
    roles: Mutex<crate::members::Roles>,
    /// The replicas' ack records for strict scheduling (their reservation documents' `_ack`).
    acks: Mutex<crate::quorum::Acks>,
    /// This replica's ack record as last queued for its reservation document, and whether it
    /// stands (queued and not failed; false before the first; see
    /// [`ReplicaState::publish_acks`]).
    own_ack: Mutex<(crate::quorum::AckRecord, bool)>,
    /// Signalled after this replica wrote its reservation or retirement document (the mesh
    /// pushes both).
    pub(crate) own_docs_changed: Arc<tokio::sync::Notify>,
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
            reservations: Reservations::new(replica, writable),
            retired: RetiredClusters::default(),
            roles: Mutex::new(Default::default()),
            acks: Mutex::new(Default::default()),
            own_ack: Mutex::new(Default::default()),
            own_docs_changed: Arc::new(tokio::sync::Notify::new()),
            replica: replica.to_string(),
            stale_after,
            store,
            feed: Mutex::new(()),
            indexes: RwLock::new(Indexes::new(CacheBound::View)),
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

    /// Read access to the view and its side indexes.
    pub(crate) fn indexes(&self) -> RwLockReadGuard<'_, Indexes> {
        read(&self.indexes)
    }

    /// Sets the per-identity caps of reservations created from now on.
    pub fn set_caps(&self, caps: dramesh_api::auth::Caps) {
        self.reservations.set_caps(caps);
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
        *indexes.compute() = Compute::new(bound);
    }

    /// Runs `f` on the view (under the indexes' read lock).
    pub fn with_view<R>(&self, f: impl FnOnce(&View) -> R) -> R {
        f(&self.indexes().view)
    }

    /// How many batches of changes that can free or take capacity were applied so far.
    pub(crate) fn change_count(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }

    /// Runs `f` with the feed serialized (lock 2); used by the reservation writer and a
    /// retirement.
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
            let bound = *lock(&self.cache_bound);
            *indexes = Indexes::new(bound);
        }
        lock(&self.roles).clear();
        lock(&self.acks).clear();
        let keep: BTreeSet<String> = snapshot
            .iter()
            .filter(|(c, _)| resv::is_scope(c))
            .map(|(_, ch)| ch.key().name.clone())
            .collect();
        self.apply_changes(&snapshot);
        self.reservations.retain(&keep);
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
        let (acks, ours): (Vec<_>, Vec<_>) = ours
            .into_iter()
            .partition(|(_, ch)| crate::quorum::ack_of(ch.key()).is_some());
        if !acks.is_empty() {
            let mut known = lock(&self.acks);
            for (_, change) in &acks {
                crate::quorum::apply(&mut known, change);
            }
            // Acknowledgements free and take no capacity: no retry of anything.
            if ours.is_empty() && changes.is_empty() && roles.is_empty() {
                return;
            }
        }
        if !ours.is_empty() {
            self.reservations.apply(&ours, now);
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
        self.reservations.check_writable()?;
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
        let ticket = self.reservations.submit(vec![change]);
        self.wait_written(ticket)
    }

    /// The ack records of strict scheduling known here, this replica's included.
    pub(crate) fn ack_records(&self) -> crate::quorum::Acks {
        lock(&self.acks).clone()
    }

    /// Writes this replica's ack record when it would change: its latest reservation is at
    /// least `seq` (the one it has published when `None`), with the `seq` of every other
    /// replica's ack record applied here; returns once durable. Blocking.
    pub(crate) fn publish_acks(&self, seq: Option<u64>) -> Result<(), ApiError> {
        let Some(ticket) = self.queue_acks(seq)? else {
            return Ok(());
        };
        let written = self.wait_written(ticket);
        if written.is_err() {
            // Written again by the next call, even if nothing changed.
            lock(&self.own_ack).1 = false;
        }
        written
    }

    /// Queues this replica's next ack record ([`crate::quorum::own_record`]) unless it is the
    /// one queued last. Concurrent callers (a strict decision publishing its reservation's
    /// `seq`, the periodic publisher) compose and queue under one lock, so records are
    /// written in the order they were composed, each covering the one before.
    fn queue_acks(&self, seq: Option<u64>) -> Result<Option<Ticket>, ApiError> {
        let mut own = lock(&self.own_ack);
        let record =
            crate::quorum::own_record(&self.replica, seq.unwrap_or(0), &lock(&self.acks), &own.0);
        if own.1 && record == own.0 {
            return Ok(None);
        }
        self.reservations.check_writable()?;
        let json = serde_json::to_vec(&record)
            .map_err(|e| ApiError::Internal(format!("encoding the ack record: {e}")))?;
        let ticket = self.reservations.submit(vec![ObjectChange::Upsert {
            key: crate::quorum::ack_key(&self.replica),
            json: Arc::from(json.as_slice()),
        }]);
        *own = (record, true);
        Ok(Some(ticket))
    }

    /// Strict scheduling's judgement of this replica's reservations `held` (id and cluster
    /// each): whether each still fits with every other live reservation this replica holds
    /// deducted, whatever their rank (see [`crate::quorum`]). `Err` names the first that does
    /// not. Blocking: call it off the async reactor.
    pub(crate) fn fits_against_all_live(&self, held: &[(&str, &str)]) -> Result<(), String> {
        let res = self.resolution();
        let indexes = self.indexes();
        let mut compute = indexes.compute();
        self.reservations
            .fits_against_all_live(&res, &indexes.view, &mut compute.estimator, held)
    }

    /// Replaces the scheduler decisions' reservations judged void (by id, with why; see
    /// [`crate::reservation_table::Record::decision`]); counts a change when the set changed, so
    /// unschedulable bindings are retried on the freed room.
    pub(crate) fn set_void_decisions(&self, void: std::collections::BTreeMap<Arc<str>, String>) {
        if self.reservations.set_void_decisions(void) {
            self.changes.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The changes of the reservations holding scheduler decisions since table version
    /// `since` (see [`Table::decision_changes`]; the scheduler loop is the one reader).
    ///
    /// [`Table::decision_changes`]: crate::reservation_table::Table::decision_changes
    pub(crate) fn decision_changes(
        &self,
        since: Option<u64>,
    ) -> (crate::reservation_table::DecisionChanges, u64) {
        self.reservations.decision_changes(since)
    }

    /// The current overcommit resolution of the reservations over the view (see
    /// [`Reservations::resolve`]); blocking: call it off the async reactor.
    /// Sets how long another replica's reservation that arrives ranked before ones resolved
    /// already may wait to be resolved ([`crate::reservation_resolution::LATE_DEFERRAL`]).
    pub fn set_late_deferral(&self, deferral: std::time::Duration) {
        self.indexes().compute().resolution.deferral = deferral;
    }

    pub(crate) fn resolution(&self) -> Arc<Resolved> {
        let indexes = self.indexes();
        let mut compute = indexes.compute();
        let Compute {
            estimator,
            resolution,
        } = &mut *compute;
        self.reservations
            .resolve(&indexes.view, estimator, resolution)
    }

    /// Per cluster with live or expired reservations, the epoch of its last resolution that
    /// changed the state of a reservation resolved before ([`Resolved::outcome_epochs`]).
    /// Blocking (it resolves): call it off the async reactor.
    pub(crate) fn outcome_epochs(&self) -> std::collections::BTreeMap<Arc<str>, u64> {
        self.resolution().outcome_epochs()
    }

    /// Deductions of the admitted reservations, for estimates.
    pub(crate) fn reserved(&self) -> dramesh_estimator::Assumed {
        self.resolution().assumed()
    }

    /// [`ReplicaState::reserved`] for a decision of the binding `b`: its preemption holds
    /// count only for what `b` has assigned ([`Reservations::assumed_for`]).
    pub(crate) fn reserved_for(
        &self,
        b: &dramesh_scheduler::Binding,
    ) -> dramesh_estimator::Assumed {
        let res = self.resolution();
        self.reservations.assumed_for(&res, b)
    }

    /// Deductions of every live reservation, admitted or not, except the preemption holds
    /// written for `b`: what a strict decision of `b` places around.
    pub(crate) fn reserved_all_live_for(
        &self,
        b: &dramesh_scheduler::Binding,
    ) -> dramesh_estimator::Assumed {
        let res = self.resolution();
        self.reservations.all_live(&res, None, Some(&b.id()), &[])
    }

    /// The unexpired preemption holds written for the binding `preemptor` (`Binding::id`),
    /// by any replica, ordered by id.
    pub(crate) fn preemption_holds(&self, preemptor: &str) -> Vec<PreemptionHold> {
        self.reservations.preemption_holds(preemptor)
    }

    /// The states of reservations `ids` on this replica, from one resolution (those it does
    /// not know, or knows only as ended, are left out).
    pub(crate) fn reservation_states<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a String>,
    ) -> HashMap<&'a str, Judged> {
        let res = self.resolution();
        self.reservations.states(&res, ids)
    }

    /// One reservation's state on this replica.
    pub fn reservation_status(&self, id: &str) -> Option<dramesh_api::native::ReservationStatus> {
        let res = self.resolution();
        self.reservations.status(&res, id)
    }

    /// Every known reservation (ended ones included when `with_ended`), ordered by id.
    pub fn reservation_list(
        &self,
        with_ended: bool,
    ) -> Vec<dramesh_api::native::ReservationStatus> {
        let res = self.resolution();
        self.reservations.list(&res, with_ended)
    }

    /// Blocks until the reservation changes of `ticket` are durable in this replica's
    /// document (and offered to the mesh). Those of a failed write were never visible
    /// outside this replica and are forgotten here too.
    pub(crate) fn wait_written(&self, ticket: Ticket) -> Result<(), ApiError> {
        self.reservations
            .wait(ticket, &mut |batch| self.write_batch(batch))
    }

    /// Writes one batch of queued changes to the reservation document (one commit, one
    /// fsync) and applies the result here.
    fn write_batch(&self, batch: Vec<ObjectChange>) -> Result<(), String> {
        let written = self.with_feed(|| {
            let outcome = self
                .with_store(|s| s.apply(&resv::doc_id(&self.replica), batch))
                .map_err(|e| e.to_string())?;
            self.apply_changes(&outcome.view);
            Ok(())
        });
        if written.is_ok() {
            self.own_docs_changed.notify_one();
        }
        written
    }

    /// Retires member cluster `name` on behalf of API identity `by`: writes the tombstone into
    /// this replica's retirement document and applies it here at once (the mesh carries it
    /// to every other replica). `NotFound` when neither the view nor the store knows the
    /// cluster, so a typo retires nothing.
    pub fn retire_cluster(&self, name: &str, by: &str) -> Result<RetiredCluster, ApiError> {
        let (t, change) = retire::tombstone(name, &self.replica, by)?;
        let known = self.with_view(|v| v.cluster(name).is_some())
            || self.with_store(|s| s.store().holds_cluster(name));
        if !known {
            return Err(ApiError::NotFound(format!(
                "retire: cluster {name} is not in this replica's view"
            )));
        }
        self.with_feed(|| {
            let outcome = self
                .with_store(|s| s.apply(&retire::doc_id(&self.replica), vec![change]))
                .map_err(|e| ApiError::Internal(format!("writing the retirement document: {e}")))?;
            self.apply_changes(&outcome.view);
            self.own_docs_changed.notify_one();
            Ok::<_, ApiError>(())
        })?;
        tracing::warn!(
            cluster = name,
            by,
            at_ms = t.retired_at_ms,
            "retired a member cluster from the fleet"
        );
        Ok(t.into())
    }

    /// Every retired cluster, by name.
    pub fn retired_clusters(&self) -> Vec<RetiredCluster> {
        self.retired.list()
    }

    /// Applies tombstones (changes of the retirement scope) in the feed: drops each cluster
    /// that one retires (the latest for it) from the store, then from the view and its
    /// indexes. Called with the feed held.
    fn apply_tombstones(&self, changes: &[&(String, ObjectChange)]) {
        for (_, change) in changes {
            let Some((cluster, at)) = self.retired.record(change) else {
                continue;
            };
            let dropped = match self.with_store(|s| s.retire_cluster(&cluster, at)) {
                Ok(d) => d,
                Err(e) => {
                    // What was dropped from memory stays dropped; the file is removed on the
                    // next start, when the tombstone is applied again.
                    tracing::error!(cluster = %cluster, error = %e, "retiring a cluster: removing its files failed");
                    Vec::new()
                }
            };
            let remaining = self.with_store(|s| s.store().holds_cluster(&cluster));
            self.apply_view_changes(&dropped.iter().collect::<Vec<_>>());
            if !remaining {
                self.forget_cluster(&cluster);
            }
            tracing::info!(cluster = %cluster, at_ms = at, kept_newer = remaining, "applied a cluster retirement");
        }
    }

    /// Applies member-cluster changes to the view and its side indexes and marks their
    /// clusters fresh.
    pub(crate) fn apply_view_changes(&self, changes: &[&(String, ObjectChange)]) {
        if changes.is_empty() {
            return;
        }
        let now = Instant::now();
        // Decoded once, before the lock: readers of the view wait only for the applying.
        let decoded: Vec<_> = changes
            .iter()
            .map(|(cluster, change)| {
                (
                    cluster,
                    change.key(),
                    dramesh_estimator::decode(cluster, change),
                )
            })
            .collect();
        {
            let mut indexes = write(&self.indexes);
            let Indexes { view, pending, .. } = &mut *indexes;
            for (cluster, key, change) in decoded {
                pending.apply(cluster, key, &change);
                if let Err(e) = change.and_then(|c| view.apply_decoded(cluster, c)) {
                    tracing::warn!(cluster, key = %key, error = %e, "change not applied to the view");
                }
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
        let retired = self.retired.contains(cluster);
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
        let est = indexes
            .compute()
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
            &mut indexes.compute().estimator,
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
        let p = dramesh_estimator::preempt(view, &w, &mut indexes.compute().estimator, &opts);
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
        strict: bool,
    ) -> dramesh_scheduler::Decision {
        let assumed = if strict {
            self.reserved_all_live_for(kept.unwrap_or(b))
        } else {
            self.reserved_for(kept.unwrap_or(b))
        };
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
        let mut compute = indexes.compute();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The strict task's record (its reservation's `seq`) and the periodic publisher's (a new
    /// acknowledgement) queued before either is written: the one written last still carries
    /// the `seq`. Built from the applied copy of the own record alone, it went back to 0, and
    /// the other replicas acknowledged the lower `seq` (measured: strict decisions waiting out
    /// their window for want of a majority on a healthy mesh).
    #[test]
    fn ack_records_queued_back_to_back_never_go_back() {
        let st = ReplicaState::in_memory("r1");
        let first = st.queue_acks(Some(10)).unwrap().expect("queued");
        let theirs = crate::quorum::AckRecord {
            seq: 3,
            acks: [("r1".to_string(), 0)].into(),
        };
        st.apply_changes(&[(
            dramesh_store::RESERVATION_SCOPE.to_string(),
            ObjectChange::Upsert {
                key: crate::quorum::ack_key("r2"),
                json: serde_json::to_vec(&theirs).unwrap().into(),
            },
        )]);
        let second = st.queue_acks(None).unwrap().expect("queued");
        st.wait_written(first).unwrap();
        st.wait_written(second).unwrap();
        let mine = &st.ack_records()["r1"];
        assert_eq!(mine.seq, 10, "{mine:?}");
        assert_eq!(mine.acks.get("r2"), Some(&3), "{mine:?}");
        // Nothing new: nothing written.
        assert!(st.queue_acks(Some(10)).unwrap().is_none());
    }
}
