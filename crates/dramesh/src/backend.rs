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

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use dramesh_api::native::{
    ClusterStatus, EstimateRequest, EstimateResponse, PlaceRequest, PlaceResponse, PreemptRequest,
    PreemptResponse, ResourceAmount, StatusReport,
};
use dramesh_api::query::{
    self, ComponentSetQuery, ReplicaQuery, ReplicaRequirements, UnschedulableQuery,
};
use dramesh_api::{ApiError, Backend, ReplicaAnswer};
use dramesh_estimator::resources::ResList;
use dramesh_estimator::{
    AssumedWorkload, Component, Estimate, EstimateOptions, Estimator, PlacementResult,
    PreemptionResult, View, Workload,
};
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_model::k8s;
use dramesh_model::{Manifest, ObjectChange};

use crate::devstatus::DeviceIndex;
use crate::pending::PendingIndex;

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
}

impl ReplicaState {
    /// A state whose view holds the store's current contents; every cluster in it counts as
    /// heard from now (the replica just started).
    pub fn new(
        replica: &str,
        stale_after: Duration,
        store: Arc<Mutex<MeshStore>>,
    ) -> Arc<ReplicaState> {
        let state = Arc::new(ReplicaState {
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
        self.apply_changes(&snapshot);
    }

    /// Applies visible object changes to the view; a change that does not decode is logged
    /// and skipped (the object keeps its previous value).
    pub fn apply_changes(&self, changes: &[(String, ObjectChange)]) {
        if changes.is_empty() {
            return;
        }
        let now = Instant::now();
        {
            let mut view = write(&self.view);
            for (cluster, change) in changes {
                if let Err(e) = view.apply(cluster, change) {
                    tracing::warn!(cluster, key = %change.key(), error = %e, "change not applied to the view");
                }
            }
        }
        let mut devices = lock(&self.devices);
        let mut pending = lock(&self.pending);
        let mut fresh = lock(&self.fresh);
        for (cluster, change) in changes {
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
        let view = read(&self.view);
        check_clusters(&view, clusters)?;
        let opts = EstimateOptions {
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
        let view = read(&self.view);
        check_clusters(&view, clusters)?;
        let opts = EstimateOptions {
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
        let view = read(&self.view);
        check_clusters(&view, clusters)?;
        let mut opts = EstimateOptions {
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

/// Karmada assumed workloads as the estimator's deductions for `cluster`. Devices of
/// in-flight workloads are not deducted (the estimator models them by resources only).
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
            let w = workload_of(&c.name, &req, i64::from(c.replicas), false)
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
        let view = read(&s.view);
        if let Err(a) = s.check_karmada(&view, &q.cluster) {
            return a;
        }
        let w = match workload_of("karmada-replica", &q.requirements, 1, true) {
            Ok(w) => w,
            Err(e) => return ReplicaAnswer::Failed(format!("replicaRequirements: {e}")),
        };
        let assumed = match assumed_of(&q.cluster, &q.assumed_workloads) {
            Ok(a) => a,
            Err(e) => return ReplicaAnswer::Failed(e),
        };
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
        let assumed = match assumed_of(&q.cluster, &q.assumed_workloads) {
            Ok(a) => a,
            Err(e) => return ReplicaAnswer::Failed(e),
        };
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
