//! The replica's computation: the estimator over the replicated view, behind the API crate's
//! [`Backend`] trait.
//!
//! [`ReplicaState`] holds the estimation view (fed with the visible object changes the store
//! reports), one [`Estimator`] whose caches survive between calls, a monotonic freshness
//! clock per cluster, and the replicated store (for digests and the debug endpoint).
//!
//! Guarantees:
//! - Karmada questions are answered for exactly one cluster: a cluster not in the view is
//!   [`ReplicaAnswer::UnknownCluster`]; one whose writers have not been heard from for longer
//!   than `stale_after` (measured with [`Instant`], so wall-clock jumps cannot make data look
//!   fresh or stale) is [`ReplicaAnswer::Stale`].
//! - A Karmada `ReplicaRequirements` is turned into the same kind of pod spec a Deployment
//!   would have (one container with the requests, node selector, required node affinity,
//!   tolerations, and resource claims for the DRA templates and shared claims), so the Karmada
//!   path and the native manifest path estimate identical workloads identically.
//! - Native answers are the estimator's own results converted field for field through serde.
//! - `GetUnschedulableReplicas` is answered from a side index of unbound pods
//!   ([`PendingIndex`], fed with the same changes as the view); see [`crate::pending`] for
//!   how pods are matched to the Deployment and the wall-clock caveat.
//! - In-flight reservations (see [`crate::reservations`]) are routed out of the store's change
//!   stream into their own table; every estimate (Karmada and native, placement and
//!   preemption included) deducts the reservations that overcommit resolution
//!   ([`dramesh_estimator::resolve`]) admits, recomputed whenever the reservation set, the
//!   set of unexpired reservations or a reserved cluster's view changes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use dramesh_api::native::{
    ClusterStatus, EstimateRequest, EstimateResponse, PlaceRequest, PlaceResponse, PreemptRequest,
    PreemptResponse, ReservationState, ReservationStatus, ReserveRequest, ResourceAmount,
    StatusReport, WorkloadRef,
};
use dramesh_api::query::{
    self, ComponentSetQuery, ReplicaQuery, ReplicaRequirements, UnschedulableQuery,
};
use dramesh_api::{ApiError, Backend, ReplicaAnswer};
use dramesh_estimator::ResList;
use dramesh_estimator::{
    Admission, AssumedWorkload, Component, Estimate, EstimateOptions, Estimator, PlacementResult,
    PreemptionResult, Reservation, View, Workload,
};
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_model::k8s;
use dramesh_model::{Manifest, ObjectChange};

use crate::devstatus::DeviceIndex;
use crate::pending::PendingIndex;
use crate::reservations::{self as resv, Record, Table};

/// Locks a mutex, continuing with the data if a panicking thread poisoned it (every
/// structure here stays consistent between calls).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

/// Everything a replica answers from. Shared by the API servers and the mesh feeder.
pub struct ReplicaState {
    pub replica: String,
    pub stale_after: Duration,
    pub store: Arc<Mutex<MeshStore>>,
    view: RwLock<View>,
    devices: Mutex<DeviceIndex>,
    /// Unbound pods per cluster, for `GetUnschedulableReplicas`.
    pending: Mutex<PendingIndex>,
    estimator: Mutex<Estimator>,
    /// Last time each cluster's writers were heard from (a change or a heartbeat).
    fresh: Mutex<HashMap<String, Instant>>,
    /// Serializes draining the store's queue with applying it, so batches reach the view in
    /// the order the store produced them.
    feed: Mutex<()>,
    /// Every known reservation (own and merged).
    reservations: Mutex<Table>,
    /// The last overcommit resolution and what it was computed from.
    resolved: Mutex<Option<Arc<Resolved>>>,
    /// Whether this replica's reservation document could be opened for writing.
    reservations_writable: bool,
    /// Signalled after this replica wrote its reservation document (the mesh pushes it).
    pub reservations_changed: Arc<tokio::sync::Notify>,
}

/// Inputs a resolution depends on; equal keys give equal resolutions.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ResolveKey {
    version: u64,
    live: Vec<String>,
    clusters: Vec<(String, u64)>,
}

/// One overcommit resolution of the unexpired reservations.
#[derive(Debug)]
struct Resolved {
    key: ResolveKey,
    admissions: BTreeMap<String, Admission>,
    remaining: BTreeMap<String, i64>,
    expired: BTreeSet<String>,
    assumed: Vec<AssumedWorkload>,
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
        let state = Arc::new(ReplicaState {
            reservations: Mutex::new(Table::new(replica)),
            resolved: Mutex::new(None),
            reservations_writable: writable,
            reservations_changed: Arc::new(tokio::sync::Notify::new()),
            replica: replica.to_string(),
            stale_after,
            store,
            view: RwLock::new(View::new()),
            devices: Mutex::new(DeviceIndex::default()),
            pending: Mutex::new(PendingIndex::default()),
            estimator: Mutex::new(Estimator::new()),
            fresh: Mutex::new(HashMap::new()),
            feed: Mutex::new(()),
        });
        state.rebuild_from_store();
        state
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
        *write(&self.view) = View::new();
        *lock(&self.devices) = DeviceIndex::default();
        *lock(&self.pending) = PendingIndex::default();
        *lock(&self.estimator) = Estimator::new();
        *lock(&self.resolved) = None;
        let keep: BTreeSet<String> = snapshot
            .iter()
            .filter(|(c, _)| resv::is_scope(c))
            .map(|(_, ch)| ch.key().name.clone())
            .collect();
        self.apply_changes(&snapshot);
        lock(&self.reservations).retain(&keep);
    }

    /// Applies visible object changes to the view; a change that does not decode is logged
    /// and skipped (the object keeps its previous value).
    pub fn apply_changes(&self, changes: &[(String, ObjectChange)]) {
        if changes.is_empty() {
            return;
        }
        let now = Instant::now();
        let (ours, changes): (Vec<_>, Vec<_>) =
            changes.iter().partition(|(c, _)| resv::is_scope(c));
        if !ours.is_empty() {
            let decode = |m: &[String]| workload_from_manifests(m).map_err(|e| e.to_string());
            let mut table = lock(&self.reservations);
            for (_, change) in ours {
                table.apply(change, now, &decode);
            }
        }
        if changes.is_empty() {
            return;
        }
        {
            let mut view = write(&self.view);
            for (cluster, change) in &changes {
                if let Err(e) = view.apply(cluster, change) {
                    tracing::warn!(cluster, key = %change.key(), error = %e, "change not applied to the view");
                }
            }
        }
        let mut devices = lock(&self.devices);
        let mut pending = lock(&self.pending);
        let mut fresh = lock(&self.fresh);
        for (cluster, change) in &changes {
            devices.apply(cluster, change);
            pending.apply(cluster, change);
            fresh.insert(cluster.clone(), now);
        }
    }

    /// Records that `cluster`'s writers were heard from at `at`.
    pub fn touch(&self, cluster: &str, at: Instant) {
        let mut fresh = lock(&self.fresh);
        let e = fresh.entry(cluster.to_string()).or_insert(at);
        if *e < at {
            *e = at;
        }
    }

    /// Time since `cluster`'s writers were last heard from.
    pub fn data_age(&self, cluster: &str) -> Option<Duration> {
        lock(&self.fresh).get(cluster).map(|t| t.elapsed())
    }

    fn stale(&self, cluster: &str) -> Option<Duration> {
        match self.data_age(cluster) {
            Some(age) if age > self.stale_after => Some(age),
            _ => None,
        }
    }

    /// Read access to the view.
    pub fn view(&self) -> RwLockReadGuard<'_, View> {
        read(&self.view)
    }

    /// Estimate of a workload given as manifests.
    pub fn estimate_manifests(
        &self,
        manifests: &[String],
        clusters: &[String],
    ) -> Result<Estimate, ApiError> {
        let w = workload_from_manifests(manifests)?;
        let assumed = self.reserved();
        let view = read(&self.view);
        check_clusters(&view, clusters)?;
        let opts = EstimateOptions {
            assumed,
            clusters: clusters.to_vec(),
            ..EstimateOptions::default()
        };
        Ok(lock(&self.estimator).estimate(&view, &w, &opts))
    }

    /// Placement of a workload given as manifests (its PropagationPolicy among them).
    pub fn place_manifests(
        &self,
        manifests: &[String],
        clusters: &[String],
        replicas: Option<i64>,
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
        let view = read(&self.view);
        check_clusters(&view, clusters)?;
        let opts = EstimateOptions {
            assumed,
            clusters: clusters.to_vec(),
            ..EstimateOptions::default()
        };
        Ok(dramesh_estimator::place(
            &view,
            &w,
            &policy,
            &mut lock(&self.estimator),
            &opts,
        ))
    }

    /// Preemption for a workload given as manifests; a PropagationPolicy among them restricts
    /// the candidate clusters to its cluster affinity.
    pub fn preempt_manifests(
        &self,
        manifests: &[String],
        clusters: &[String],
        replicas: Option<i64>,
    ) -> Result<PreemptionResult, ApiError> {
        let mut w = workload_from_manifests(manifests)?;
        if let Some(r) = replicas {
            w.replicas = r;
        }
        let assumed = self.reserved();
        let view = read(&self.view);
        check_clusters(&view, clusters)?;
        let mut opts = EstimateOptions {
            assumed,
            clusters: clusters.to_vec(),
            ..EstimateOptions::default()
        };
        if opts.clusters.is_empty()
            && let Some(a) = w.policy.as_ref().and_then(|p| p.affinity.as_ref())
        {
            opts.clusters = view
                .clusters()
                .filter(|c| a.matches(&c.name, &c.info))
                .map(|c| c.name.clone())
                .collect();
            if opts.clusters.is_empty() {
                return Err(ApiError::InvalidRequest(
                    "no cluster matches the policy's cluster affinity".into(),
                ));
            }
        }
        Ok(dramesh_estimator::preempt(
            &view,
            &w,
            &mut lock(&self.estimator),
            &opts,
        ))
    }

    /// Known, fresh cluster, or the Karmada answer explaining why not.
    fn check_karmada(&self, view: &View, cluster: &str) -> Result<(), ReplicaAnswer> {
        if view.cluster(cluster).is_none() {
            return Err(ReplicaAnswer::UnknownCluster);
        }
        if let Some(age) = self.stale(cluster) {
            return Err(ReplicaAnswer::Stale { age });
        }
        Ok(())
    }

    /// The status report: per cluster data age, sizes, capacity and devices by class.
    pub fn status_report(&self) -> StatusReport {
        let reservations = self.reservation_list(false);
        let view = read(&self.view);
        let devices = lock(&self.devices);
        let mut clusters = Vec::new();
        for c in view.clusters() {
            let age = self.data_age(&c.name);
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
                data_age_seconds: age.map(|a| a.as_secs_f64()),
                stale: age.is_some_and(|a| a > self.stale_after),
                nodes: u32::try_from(c.node_count()).unwrap_or(u32::MAX),
                pods: u32::try_from(c.pod_count()).unwrap_or(u32::MAX),
                resources,
                devices: devices.by_class(&c.name),
            });
        }
        StatusReport {
            replica: self.replica.clone(),
            ready: false,
            clusters,
            reservations,
        }
    }

    /// The current overcommit resolution (recomputed only when its inputs changed).
    fn resolution(&self) -> Arc<Resolved> {
        let now = Instant::now();
        struct Live {
            id: String,
            cluster: String,
            priority: i32,
            replicas: i64,
            bound_at_creation: i64,
            workload: WorkloadRef,
            decoded: Result<Arc<Workload>, String>,
        }
        let (version, live, expired) = {
            let table = lock(&self.reservations);
            let mut live = Vec::new();
            let mut expired = BTreeSet::new();
            for (id, e) in table.entries() {
                if now >= table.expiry(e) {
                    expired.insert(id.clone());
                    continue;
                }
                live.push(Live {
                    id: id.clone(),
                    cluster: e.record.cluster.clone(),
                    priority: e.record.priority,
                    replicas: e.record.replicas,
                    bound_at_creation: e.record.bound_at_creation,
                    workload: e.record.workload.clone(),
                    decoded: e.workload.clone(),
                });
            }
            (table.version, live, expired)
        };
        let view = read(&self.view);
        let clusters: BTreeSet<&str> = live.iter().map(|l| l.cluster.as_str()).collect();
        let key = ResolveKey {
            version,
            live: live.iter().map(|l| l.id.clone()).collect(),
            clusters: clusters
                .iter()
                .map(|c| {
                    let g = view.cluster(c).map_or(0, |v| v.generation());
                    (c.to_string(), g)
                })
                .collect(),
        };
        if let Some(r) = lock(&self.resolved).as_ref()
            && r.key == key
        {
            return r.clone();
        }
        let mut remaining = BTreeMap::new();
        let mut admissions = BTreeMap::new();
        let mut input = Vec::new();
        for l in &live {
            let bound = view
                .cluster(&l.cluster)
                .map_or(0, |c| resv::bound_pods(c, &l.workload));
            let left = (l.replicas - (bound - l.bound_at_creation).max(0)).max(0);
            remaining.insert(l.id.clone(), left);
            match &l.decoded {
                Ok(w) => input.push(Reservation {
                    id: l.id.clone(),
                    cluster: l.cluster.clone(),
                    priority: l.priority,
                    replicas: left,
                    workload: w.clone(),
                }),
                Err(e) => {
                    admissions.insert(
                        l.id.clone(),
                        Admission::Conflicted {
                            winner: None,
                            available: 0,
                            reason: Some(format!("workload manifests: {e}")),
                        },
                    );
                }
            }
        }
        let r = dramesh_estimator::resolve(&view, &mut lock(&self.estimator), &input);
        admissions.extend(r.admissions);
        let resolved = Arc::new(Resolved {
            key,
            admissions,
            remaining,
            expired,
            assumed: r.assumed,
        });
        *lock(&self.resolved) = Some(resolved.clone());
        resolved
    }

    /// Deductions of the admitted reservations, for estimates.
    fn reserved(&self) -> Vec<AssumedWorkload> {
        self.resolution().assumed.clone()
    }

    fn status_of(&self, id: &str, res: &Resolved, now: Instant) -> Option<ReservationStatus> {
        let table = lock(&self.reservations);
        let Some(e) = table.get(id) else {
            return table.ended(id).cloned();
        };
        let expiry = table.expiry(e);
        let remaining = res.remaining.get(id).copied().unwrap_or(e.record.replicas);
        let mut st = resv::base_status(&e.record, ReservationState::Live);
        st.remaining = remaining;
        if res.expired.contains(id) || now >= expiry {
            st.status = ReservationState::Expired;
            st.remaining = 0;
            return Some(st);
        }
        st.expires_in_seconds = Some(expiry.saturating_duration_since(now).as_secs_f64());
        match res.admissions.get(id) {
            Some(Admission::Admitted) if remaining == 0 => {
                st.status = ReservationState::Satisfied;
            }
            Some(Admission::Admitted) => {}
            Some(Admission::Conflicted { winner, reason, .. }) => {
                st.status = ReservationState::Conflicted;
                st.winner = winner.clone();
                st.reason = reason.clone();
            }
            // Seen after the resolution was computed: not yet decided.
            None => {}
        }
        Some(st)
    }

    /// One reservation's state on this replica.
    pub fn reservation_status(&self, id: &str) -> Option<ReservationStatus> {
        let res = self.resolution();
        self.status_of(id, &res, Instant::now())
    }

    /// Every known reservation (ended ones included when `with_ended`), ordered by id.
    pub fn reservation_list(&self, with_ended: bool) -> Vec<ReservationStatus> {
        let res = self.resolution();
        let now = Instant::now();
        let (ids, ended): (Vec<String>, Vec<ReservationStatus>) = {
            let table = lock(&self.reservations);
            let ids = table.entries().map(|(id, _)| id.clone()).collect();
            let ended = if with_ended {
                table.ended_all().cloned().collect()
            } else {
                Vec::new()
            };
            (ids, ended)
        };
        let mut out: BTreeMap<String, ReservationStatus> =
            ended.into_iter().map(|s| (s.id.clone(), s)).collect();
        for id in ids {
            if let Some(s) = self.status_of(&id, &res, now) {
                out.insert(id, s);
            }
        }
        out.into_values().collect()
    }

    /// Writes changes to this replica's reservation document and applies them here.
    fn write_reservations(&self, changes: Vec<ObjectChange>) -> Result<(), ApiError> {
        if !self.reservations_writable {
            return Err(ApiError::Unavailable(
                "this replica's reservation document could not be opened for writing".into(),
            ));
        }
        let _feed = lock(&self.feed);
        let outcome = lock(&self.store)
            .apply(&resv::doc_id(&self.replica), changes)
            .map_err(|e| ApiError::Internal(format!("writing the reservation document: {e}")))?;
        self.apply_changes(&outcome.view);
        self.reservations_changed.notify_one();
        Ok(())
    }

    /// Writes a reservation owned by this replica (see [`crate::reservations`]).
    pub fn reserve(&self, req: &ReserveRequest) -> Result<ReservationStatus, ApiError> {
        if req.cluster.is_empty() {
            return Err(ApiError::InvalidRequest(
                "reservation: field cluster is required".into(),
            ));
        }
        let w = workload_from_manifests(&req.workload.manifests)?;
        let replicas = req.replicas.unwrap_or(w.replicas);
        if !(1..=resv::MAX_REPLICAS).contains(&replicas) {
            return Err(ApiError::InvalidRequest(format!(
                "reservation: field replicas {replicas} is not in 1..={}",
                resv::MAX_REPLICAS
            )));
        }
        let ttl_seconds = req.ttl_seconds.unwrap_or(resv::DEFAULT_TTL_SECONDS);
        if !(1..=resv::MAX_TTL_SECONDS).contains(&ttl_seconds) {
            return Err(ApiError::InvalidRequest(format!(
                "reservation: field ttlSeconds {ttl_seconds} is not in 1..={}",
                resv::MAX_TTL_SECONDS
            )));
        }
        let workload = WorkloadRef {
            namespace: w.namespace.clone(),
            kind: w.kind.clone(),
            name: w.name.clone(),
        };
        let bound_at_creation = {
            let view = read(&self.view);
            check_clusters(&view, std::slice::from_ref(&req.cluster))?;
            view.cluster(&req.cluster)
                .map_or(0, |c| resv::bound_pods(c, &workload))
        };
        let id = lock(&self.reservations).next_id();
        let record = Record {
            id: id.clone(),
            owner: self.replica.clone(),
            cluster: req.cluster.clone(),
            workload,
            manifests: req.workload.manifests.clone(),
            replicas,
            priority: req.priority.unwrap_or(w.priority),
            ttl_seconds,
            bound_at_creation,
        };
        let json = serde_json::to_vec(&record)
            .map_err(|e| ApiError::Internal(format!("encoding reservation {id}: {e}")))?;
        if json.len() > resv::MAX_RECORD_BYTES {
            return Err(ApiError::InvalidRequest(format!(
                "reservation: the workload manifests make a record of {} bytes, more than {}",
                json.len(),
                resv::MAX_RECORD_BYTES
            )));
        }
        self.write_reservations(vec![ObjectChange::Upsert {
            key: resv::record_key(&id),
            json: Arc::from(json.as_slice()),
        }])?;
        tracing::info!(id = %id, cluster = %record.cluster, replicas, "reservation written");
        self.reservation_status(&id)
            .ok_or_else(|| ApiError::Internal(format!("reservation {id} vanished after writing")))
    }

    /// Releases a reservation this replica owns; releasing an ended one returns how it ended.
    pub fn release(&self, id: &str) -> Result<ReservationStatus, ApiError> {
        let owner = {
            let table = lock(&self.reservations);
            match table.get(id) {
                Some(e) => e.record.owner.clone(),
                None => {
                    return table
                        .ended(id)
                        .cloned()
                        .ok_or_else(|| ApiError::NotFound(format!("reservation {id}")));
                }
            }
        };
        if owner != self.replica {
            return Err(ApiError::InvalidRequest(format!(
                "reservation {id} is owned by replica {owner}; release it there"
            )));
        }
        self.end_own(id, ReservationState::Released)?;
        self.reservation_status(id)
            .ok_or_else(|| ApiError::Internal(format!("reservation {id} vanished")))
    }

    /// Deletes an own reservation, remembering how it ended.
    fn end_own(&self, id: &str, how: ReservationState) -> Result<(), ApiError> {
        {
            let mut table = lock(&self.reservations);
            let Some(e) = table.get(id) else {
                return Ok(());
            };
            let status = resv::base_status(&e.record, how);
            table.end(status);
        }
        self.write_reservations(vec![ObjectChange::Delete {
            key: resv::record_key(id),
        }])?;
        tracing::info!(id, how = ?how, "reservation ended");
        Ok(())
    }

    /// The owner's housekeeping: deletes own reservations whose TTL passed or whose replicas
    /// are all bound. Called periodically by the replica.
    pub fn sweep_reservations(&self) {
        let res = self.resolution();
        let now = Instant::now();
        let ended: Vec<(String, ReservationState)> = {
            let table = lock(&self.reservations);
            table
                .entries()
                .filter(|(_, e)| e.record.owner == self.replica)
                .filter_map(|(id, e)| {
                    if now >= table.expiry(e) {
                        Some((id.clone(), ReservationState::Expired))
                    } else if res.remaining.get(id) == Some(&0) {
                        Some((id.clone(), ReservationState::Satisfied))
                    } else {
                        None
                    }
                })
                .collect()
        };
        for (id, how) in ended {
            if let Err(e) = self.end_own(&id, how) {
                tracing::warn!(id, error = %e, "ending a reservation failed; retrying on the next sweep");
            }
        }
    }
}

fn check_clusters(view: &View, clusters: &[String]) -> Result<(), ApiError> {
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

/// Decodes the native request's manifests (YAML or JSON text) into one workload.
pub fn workload_from_manifests(manifests: &[String]) -> Result<Workload, ApiError> {
    let mut all: Vec<Manifest> = Vec::new();
    for (i, text) in manifests.iter().enumerate() {
        let name = format!("workload.manifests[{i}]");
        let loaded = dramesh_model::load::load_str(Path::new(&name), text)
            .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
        all.extend(loaded.into_iter().map(|l| l.manifest));
    }
    Workload::from_manifests(&all).map_err(|e| ApiError::InvalidRequest(e.to_string()))
}

/// Name of the synthetic ResourceClaimTemplate standing for pod claim `pod_claim`.
fn template_name(pod_claim: &str) -> String {
    format!("karmada-{pod_claim}")
}

/// The pod spec a Karmada `ReplicaRequirements` describes (see the module docs).
pub fn pod_spec_of(
    r: &ReplicaRequirements,
    with_dra: bool,
) -> (
    k8s::PodSpec,
    HashMap<(String, String), Arc<k8s::ResourceClaimTemplate>>,
) {
    use k8s_openapi::api::core::v1::{
        Affinity, Container, NodeAffinity, PodResourceClaim, ResourceClaim as ContainerClaim,
        ResourceRequirements,
    };
    let namespace = if r.namespace.is_empty() {
        "default".to_string()
    } else {
        r.namespace.clone()
    };
    let mut pod_claims = Vec::new();
    let mut container_claims = Vec::new();
    let mut templates = HashMap::new();
    if with_dra {
        for t in &r.dra.claim_templates {
            let name = template_name(&t.pod_claim_name);
            pod_claims.push(PodResourceClaim {
                name: t.pod_claim_name.clone(),
                resource_claim_template_name: Some(name.clone()),
                resource_claim_name: None,
            });
            container_claims.push(ContainerClaim {
                name: t.pod_claim_name.clone(),
                request: None,
            });
            let tpl = k8s::ResourceClaimTemplate {
                metadata: k8s::ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(namespace.clone()),
                    ..Default::default()
                },
                spec: t.spec.clone(),
            };
            templates.insert((namespace.clone(), name), Arc::new(tpl));
        }
        for c in &r.dra.shared_claims {
            pod_claims.push(PodResourceClaim {
                name: c.clone(),
                resource_claim_name: Some(c.clone()),
                resource_claim_template_name: None,
            });
            container_claims.push(ContainerClaim {
                name: c.clone(),
                request: None,
            });
        }
    }
    let requests: BTreeMap<String, k8s::K8sQuantity> = r
        .resource_request
        .iter()
        .map(|(k, q)| (k.clone(), q.clone()))
        .collect();
    let container = Container {
        name: "replica".into(),
        resources: Some(ResourceRequirements {
            requests: (!requests.is_empty()).then_some(requests),
            claims: (!container_claims.is_empty()).then_some(container_claims),
            ..Default::default()
        }),
        ..Default::default()
    };
    let nc = &r.node_claim;
    let spec = k8s::PodSpec {
        containers: vec![container],
        node_selector: (!nc.node_selector.is_empty()).then(|| nc.node_selector.clone()),
        affinity: nc.node_affinity.clone().map(|a| Affinity {
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(a),
                ..Default::default()
            }),
            ..Default::default()
        }),
        tolerations: (!nc.tolerations.is_empty()).then(|| nc.tolerations.clone()),
        resource_claims: (!pod_claims.is_empty()).then_some(pod_claims),
        priority_class_name: (!r.priority_class_name.is_empty())
            .then(|| r.priority_class_name.clone()),
        ..Default::default()
    };
    (spec, templates)
}

/// The estimator workload of one Karmada replica (`replicas` of them).
pub fn workload_of(
    name: &str,
    r: &ReplicaRequirements,
    replicas: i64,
    with_dra: bool,
) -> Result<Workload, String> {
    let (spec, templates) = pod_spec_of(r, with_dra);
    let namespace = if r.namespace.is_empty() {
        "default"
    } else {
        r.namespace.as_str()
    };
    Workload::from_pod_spec("Deployment", namespace, name, replicas, spec, &templates)
        .map_err(|e| e.to_string())
}

/// Karmada assumed workloads as the estimator's deductions for `cluster`, with the DRA
/// claims of their requirements: each in-flight replica holds its own device allocation
/// (shared claims once), placed first-fit like its requests.
///
/// They are implied reservations of the one query that carries them and are not written to
/// the reservation document: karmada-scheduler resends its whole assumed set with every
/// query and drops entries once bound, so writing them would double-count them on the next
/// query and leave no release signal. Written reservations are deducted in addition.
fn assumed_of(
    cluster: &str,
    assumed: &[query::AssumedWorkload],
) -> Result<Vec<AssumedWorkload>, String> {
    let mut out = Vec::new();
    for (i, a) in assumed.iter().enumerate() {
        for c in &a.components {
            let mut req = c.requirements.clone();
            if req.namespace.is_empty() {
                req.namespace = a.namespace.clone();
            }
            let w = workload_of(&c.name, &req, i64::from(c.replicas), true)
                .map_err(|e| format!("assumedWorkloads[{i}] component {:?}: {e}", c.name))?;
            out.push(AssumedWorkload::from_workload(
                cluster,
                &w,
                i64::from(c.replicas),
            ));
        }
    }
    Ok(out)
}

fn to_native<T: serde::Serialize, U: serde::de::DeserializeOwned>(v: &T) -> Result<U, ApiError> {
    serde_json::to_value(v)
        .and_then(serde_json::from_value)
        .map_err(|e| ApiError::Internal(format!("result conversion failed: {e}")))
}

/// [`Backend`] over a [`ReplicaState`].
pub struct ReplicaBackend {
    pub state: Arc<ReplicaState>,
}

impl Backend for ReplicaBackend {
    fn max_available_replicas(&self, q: &ReplicaQuery) -> ReplicaAnswer {
        let s = &self.state;
        let reserved = s.reserved();
        let view = read(&s.view);
        if let Err(a) = s.check_karmada(&view, &q.cluster) {
            return a;
        }
        let w = match workload_of("karmada-replica", &q.requirements, 1, true) {
            Ok(w) => w,
            Err(e) => return ReplicaAnswer::Failed(format!("replicaRequirements: {e}")),
        };
        let mut assumed = match assumed_of(&q.cluster, &q.assumed_workloads) {
            Ok(a) => a,
            Err(e) => return ReplicaAnswer::Failed(e),
        };
        assumed.extend(reserved);
        let opts = EstimateOptions {
            assumed,
            clusters: vec![q.cluster.clone()],
            ..EstimateOptions::default()
        };
        let est = lock(&s.estimator).estimate(&view, &w, &opts);
        match est.cluster(&q.cluster) {
            Some(c) => match &c.error {
                Some(e) => ReplicaAnswer::Failed(e.clone()),
                None => ReplicaAnswer::Count(c.max_replicas),
            },
            None => ReplicaAnswer::UnknownCluster,
        }
    }

    fn max_available_component_sets(&self, q: &ComponentSetQuery) -> ReplicaAnswer {
        let s = &self.state;
        let reserved = s.reserved();
        let view = read(&s.view);
        if let Err(a) = s.check_karmada(&view, &q.cluster) {
            return a;
        }
        let mut comps = Vec::new();
        for c in &q.components {
            let mut req = c.requirements.clone();
            if req.namespace.is_empty() {
                req.namespace = q.namespace.clone();
            }
            match workload_of(&c.name, &req, i64::from(c.replicas), false) {
                Ok(w) => comps.push(Component {
                    name: c.name.clone(),
                    replicas: i64::from(c.replicas),
                    requests: w.requests.clone(),
                    node_claim: w.node_claim.clone(),
                }),
                Err(e) => return ReplicaAnswer::Failed(format!("component {:?}: {e}", c.name)),
            }
        }
        let mut assumed = match assumed_of(&q.cluster, &q.assumed_workloads) {
            Ok(a) => a,
            Err(e) => return ReplicaAnswer::Failed(e),
        };
        assumed.extend(reserved);
        let opts = EstimateOptions {
            assumed,
            clusters: vec![q.cluster.clone()],
            ..EstimateOptions::default()
        };
        let est = dramesh_estimator::estimate_component_sets(&view, &comps, &opts);
        match est.cluster(&q.cluster) {
            Some(c) => ReplicaAnswer::Count(c.max_replicas),
            None => ReplicaAnswer::UnknownCluster,
        }
    }

    fn unschedulable_replicas(&self, q: &UnschedulableQuery) -> ReplicaAnswer {
        let s = &self.state;
        let view = read(&s.view);
        if let Err(a) = s.check_karmada(&view, &q.cluster) {
            return a;
        }
        drop(view);
        let now = k8s_openapi::jiff::Timestamp::now();
        match lock(&s.pending).unschedulable(&q.cluster, &q.workload, q.threshold, now) {
            Ok(n) => ReplicaAnswer::Count(i64::try_from(n).unwrap_or(i64::MAX)),
            Err(e) => ReplicaAnswer::Failed(e),
        }
    }

    fn estimate_all(&self, req: &EstimateRequest) -> Result<EstimateResponse, ApiError> {
        let est = self
            .state
            .estimate_manifests(&req.workload.manifests, &req.clusters)?;
        to_native(&est)
    }

    fn place(&self, req: &PlaceRequest) -> Result<PlaceResponse, ApiError> {
        let p = self
            .state
            .place_manifests(&req.workload.manifests, &req.clusters, req.replicas)?;
        to_native(&p)
    }

    fn preempt(&self, req: &PreemptRequest) -> Result<PreemptResponse, ApiError> {
        let p =
            self.state
                .preempt_manifests(&req.workload.manifests, &req.clusters, req.replicas)?;
        to_native(&p)
    }

    fn status(&self) -> StatusReport {
        self.state.status_report()
    }

    fn reserve(&self, req: &ReserveRequest) -> Result<ReservationStatus, ApiError> {
        self.state.reserve(req)
    }

    fn release(&self, id: &str) -> Result<ReservationStatus, ApiError> {
        self.state.release(id)
    }

    fn reservation(&self, id: &str) -> Result<ReservationStatus, ApiError> {
        self.state
            .reservation_status(id)
            .ok_or_else(|| ApiError::NotFound(format!("reservation {id}")))
    }

    fn reservations(&self) -> Result<Vec<ReservationStatus>, ApiError> {
        Ok(self.state.reservation_list(true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_api::query::{ClaimTemplate, DraRequirements, NodeClaim};
    use dramesh_store::{Durability, Store, StoreConfig};

    const TRAINER: &str = include_str!("../../../tests/estimator/workload/trainer.yaml");

    fn state_with_fleet() -> Arc<ReplicaState> {
        let store = Store::in_memory(StoreConfig {
            durability: Durability::None,
            ..StoreConfig::default()
        });
        let store = Arc::new(Mutex::new(MeshStore::new(store, true)));
        let state = ReplicaState::new("t", Duration::from_secs(120), store);
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/estimator/fleet");
        let mut changes = Vec::new();
        for cluster in ["gpu-east", "gpu-west", "cpu-only"] {
            for l in dramesh_model::load::load_path(&dir.join(cluster)).unwrap() {
                if let Manifest::Object(o) = l.manifest {
                    changes.push((cluster.to_string(), ObjectChange::upsert(&o)));
                }
            }
        }
        state.apply_changes(&changes);
        state
    }

    #[test]
    fn karmada_query_matches_manifest_estimate() {
        let state = state_with_fleet();
        let backend = ReplicaBackend {
            state: state.clone(),
        };
        let est = state
            .estimate_manifests(&[TRAINER.to_string()], &[])
            .unwrap();
        assert_eq!(est.cluster("gpu-east").unwrap().max_replicas, 6);
        assert_eq!(est.cluster("gpu-west").unwrap().max_replicas, 2);

        let w = workload_from_manifests(&[TRAINER.to_string()]).unwrap();
        let spec = w.templates[0].template.spec.clone();
        let mut q = ReplicaQuery {
            cluster: "gpu-east".into(),
            requirements: ReplicaRequirements {
                node_claim: NodeClaim {
                    tolerations: w.node_claim.tolerations.clone(),
                    ..NodeClaim::default()
                },
                resource_request: [
                    ("cpu".to_string(), k8s::K8sQuantity("8".into())),
                    ("memory".to_string(), k8s::K8sQuantity("64Gi".into())),
                ]
                .into_iter()
                .collect(),
                namespace: "ml".into(),
                priority_class_name: String::new(),
                dra: DraRequirements {
                    claim_templates: vec![ClaimTemplate {
                        pod_claim_name: "gpu".into(),
                        spec,
                    }],
                    shared_claims: vec![],
                },
            },
            assumed_workloads: vec![],
        };
        for (cluster, want) in [("gpu-east", 6), ("gpu-west", 2)] {
            q.cluster = cluster.into();
            assert_eq!(
                backend.max_available_replicas(&q),
                ReplicaAnswer::Count(want),
                "{cluster}"
            );
        }
        // A cluster without the DeviceClass is an estimator error there (0 on the wire).
        q.cluster = "cpu-only".into();
        match backend.max_available_replicas(&q) {
            ReplicaAnswer::Failed(e) => assert!(e.contains("gpu.nvidia.com"), "{e}"),
            other => panic!("cpu-only: {other:?}"),
        }
        // Without the DRA requirement only cpu/memory limit the answer.
        let mut plain = q.clone();
        plain.cluster = "gpu-west".into();
        plain.requirements.dra = DraRequirements::default();
        let ReplicaAnswer::Count(n) = backend.max_available_replicas(&plain) else {
            panic!("no count");
        };
        assert!(n > 2, "{n}");
        // An assumed workload of the same shape takes its share first.
        let mut assumed = q.clone();
        assumed.cluster = "gpu-west".into();
        assumed.requirements.dra = DraRequirements::default();
        assumed.assumed_workloads = vec![query::AssumedWorkload {
            namespace: "ml".into(),
            components: vec![query::Component {
                name: "inflight".into(),
                replicas: 1,
                requirements: assumed.requirements.clone(),
            }],
        }];
        assert_eq!(
            backend.max_available_replicas(&assumed),
            ReplicaAnswer::Count(n - 1)
        );
        // An assumed workload with the DRA requirement also holds its devices: one in-flight
        // replica leaves gpu-west devices for one more.
        let mut dra_assumed = q.clone();
        dra_assumed.cluster = "gpu-west".into();
        dra_assumed.assumed_workloads = vec![query::AssumedWorkload {
            namespace: "ml".into(),
            components: vec![query::Component {
                name: "inflight".into(),
                replicas: 1,
                requirements: q.requirements.clone(),
            }],
        }];
        assert_eq!(
            backend.max_available_replicas(&dra_assumed),
            ReplicaAnswer::Count(1)
        );
        q.cluster = "nowhere".into();
        assert_eq!(
            backend.max_available_replicas(&q),
            ReplicaAnswer::UnknownCluster
        );
    }

    #[test]
    fn stale_clusters_answer_stale() {
        let store = Store::in_memory(StoreConfig {
            durability: Durability::None,
            ..StoreConfig::default()
        });
        let store = Arc::new(Mutex::new(MeshStore::new(store, true)));
        let state = ReplicaState::new("t", Duration::from_millis(0), store);
        let node = dramesh_model::load::load_str(
            Path::new("n"),
            "apiVersion: v1\nkind: Node\nmetadata: {name: n1}\nstatus: {allocatable: {cpu: '4', pods: '10'}}\n",
        )
        .unwrap();
        let Manifest::Object(o) = &node[0].manifest else {
            panic!("not an object");
        };
        state.apply_changes(&[("c".to_string(), ObjectChange::upsert(o))]);
        std::thread::sleep(Duration::from_millis(5));
        let backend = ReplicaBackend { state };
        let q = ReplicaQuery {
            cluster: "c".into(),
            ..ReplicaQuery::default()
        };
        assert!(matches!(
            backend.max_available_replicas(&q),
            ReplicaAnswer::Stale { .. }
        ));
        let status = backend.status();
        assert!(status.clusters[0].stale);
        assert_eq!(status.clusters[0].nodes, 1);
    }

    #[test]
    fn unschedulable_replicas_count_pending_deployment_pods() {
        let state = state_with_fleet();
        let ago = |mins: i64| {
            let t = k8s_openapi::jiff::Timestamp::now()
                - k8s_openapi::jiff::SignedDuration::from_mins(mins);
            t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
        };
        let pod = |name: &str, since: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: ml\n  labels: {{pod-template-hash: 6b7d}}\n  ownerReferences: [{{apiVersion: apps/v1, kind: ReplicaSet, name: trainer-6b7d, uid: u1, controller: true}}]\nspec:\n  containers: [{{name: c}}]\nstatus:\n  phase: Pending\n  conditions: [{{type: PodScheduled, status: 'False', reason: Unschedulable, lastTransitionTime: '{since}'}}]\n"
            )
        };
        let mut changes = Vec::new();
        for (name, since) in [("old", ago(10)), ("new", ago(0))] {
            for l in dramesh_model::load::load_str(Path::new("p"), &pod(name, &since)).unwrap() {
                if let Manifest::Object(o) = l.manifest {
                    changes.push(("gpu-east".to_string(), ObjectChange::upsert(&o)));
                }
            }
        }
        assert_eq!(changes.len(), 2);
        state.apply_changes(&changes);
        let backend = ReplicaBackend { state };
        let q = |cluster: &str, kind: &str, name: &str| UnschedulableQuery {
            cluster: cluster.into(),
            workload: query::ObjectRef {
                api_version: "apps/v1".into(),
                kind: kind.into(),
                namespace: "ml".into(),
                name: name.into(),
            },
            threshold: Duration::from_secs(60),
        };
        assert_eq!(
            backend.unschedulable_replicas(&q("gpu-east", "Deployment", "trainer")),
            ReplicaAnswer::Count(1)
        );
        assert_eq!(
            backend.unschedulable_replicas(&q("gpu-east", "Deployment", "web")),
            ReplicaAnswer::Count(0)
        );
        assert_eq!(
            backend.unschedulable_replicas(&q("gpu-west", "Deployment", "trainer")),
            ReplicaAnswer::Count(0)
        );
        assert_eq!(
            backend.unschedulable_replicas(&q("nowhere", "Deployment", "trainer")),
            ReplicaAnswer::UnknownCluster
        );
        assert!(matches!(
            backend.unschedulable_replicas(&q("gpu-east", "StatefulSet", "trainer")),
            ReplicaAnswer::Failed(_)
        ));
    }

    #[test]
    fn native_place_and_preempt_convert() {
        let state = state_with_fleet();
        let backend = ReplicaBackend { state };
        let workload = dramesh_api::native::Workload {
            manifests: vec![TRAINER.to_string()],
        };
        let p = backend
            .place(&PlaceRequest {
                workload: workload.clone(),
                clusters: vec![],
                replicas: None,
            })
            .unwrap();
        let placed: BTreeMap<String, i64> = p
            .clusters
            .iter()
            .map(|c| (c.name.clone(), c.replicas))
            .collect();
        assert_eq!(placed.get("gpu-east"), Some(&4));
        assert_eq!(placed.get("gpu-west"), Some(&2));
        let e = backend
            .estimate_all(&EstimateRequest {
                workload,
                clusters: vec!["missing".into()],
            })
            .unwrap_err();
        assert!(matches!(e, ApiError::NotFound(_)), "{e}");
        let bad = backend
            .estimate_all(&EstimateRequest {
                workload: dramesh_api::native::Workload {
                    manifests: vec!["kind: [".into()],
                },
                clusters: vec![],
            })
            .unwrap_err();
        assert!(matches!(bad, ApiError::InvalidRequest(_)), "{bad}");
    }
}
