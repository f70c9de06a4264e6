//! The API crate's [`Backend`] over a [`ReplicaState`]: Karmada questions answered for one
//! known, fresh cluster with in-flight reservations and Karmada's assumed workloads deducted;
//! native answers are the estimator's results converted by the API crate's `From` impls;
//! `GetUnschedulableReplicas` is answered from the pending-pod index (see [`crate::pending`]
//! for how pods are matched to the Deployment and the wall-clock caveat).

use std::sync::Arc;

use dramesh_api::auth::Caller;
use dramesh_api::native::{
    EstimateRequest, EstimateResponse, PlaceRequest, PlaceResponse, PreemptRequest,
    PreemptResponse, ReservationStatus, ReserveRequest, RetiredCluster, StatusReport,
};
use dramesh_api::query::{ComponentSetQuery, ReplicaQuery, UnschedulableQuery};
use dramesh_api::{ApiError, Backend, ReplicaAnswer};
use dramesh_estimator::{Component, EstimateOptions};

use crate::requests::{assumed_of, workload_of};
use crate::state::ReplicaState;

/// [`Backend`] over a [`ReplicaState`].
pub struct ReplicaBackend {
    /// The state answers come from.
    pub state: Arc<ReplicaState>,
}

impl Backend for ReplicaBackend {
    fn max_available_replicas(&self, q: &ReplicaQuery) -> ReplicaAnswer {
        let s = &self.state;
        let reserved = s.reserved();
        let indexes = s.indexes();
        let view = &indexes.view;
        if let Err(a) = s.check_karmada(view, &q.cluster) {
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
        // Only this cluster is estimated: its reservations after Karmada's assumed ones.
        assumed.extend(reserved.cluster(&q.cluster).iter().map(|a| (**a).clone()));
        // With --estimate-autoscaler-headroom the answer includes what new nodes of the
        // cluster's NodePools could hold, as Karmada's estimator does with
        // --node-capacity-providers=karpenter.
        let opts = EstimateOptions {
            assumed: assumed.into(),
            clusters: vec![q.cluster.clone()],
            headroom: s.headroom_options(view, std::slice::from_ref(&q.cluster), true),
            ..dramesh_api::deadline::estimate_options()
        };
        let est = indexes.compute().estimator.estimate(view, &w, &opts);
        match est.cluster(&q.cluster) {
            Some(c) => match &c.error {
                Some(e) => ReplicaAnswer::Failed(e.clone()),
                None if c.is_lower_bound() => ReplicaAnswer::Unknown {
                    at_least: c.max_replicas,
                    nodes: c.unknown_nodes,
                },
                None => ReplicaAnswer::Count(c.max_replicas),
            },
            None => ReplicaAnswer::UnknownCluster,
        }
    }

    fn max_available_component_sets(&self, q: &ComponentSetQuery) -> ReplicaAnswer {
        let s = &self.state;
        let reserved = s.reserved();
        let indexes = s.indexes();
        let view = &indexes.view;
        if let Err(a) = s.check_karmada(view, &q.cluster) {
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
        // Only this cluster is estimated: its reservations after Karmada's assumed ones.
        assumed.extend(reserved.cluster(&q.cluster).iter().map(|a| (**a).clone()));
        let opts = EstimateOptions {
            assumed: assumed.into(),
            clusters: vec![q.cluster.clone()],
            ..dramesh_api::deadline::estimate_options()
        };
        let est = dramesh_estimator::estimate_component_sets(view, &comps, &opts);
        match est.cluster(&q.cluster) {
            Some(c) => match &c.error {
                Some(e) => ReplicaAnswer::Failed(e.clone()),
                None => ReplicaAnswer::Count(c.max_replicas),
            },
            None => ReplicaAnswer::UnknownCluster,
        }
    }

    fn unschedulable_replicas(&self, q: &UnschedulableQuery) -> ReplicaAnswer {
        let s = &self.state;
        let indexes = s.indexes();
        if let Err(a) = s.check_karmada(&indexes.view, &q.cluster) {
            return a;
        }
        let now = jiff::Timestamp::now();
        match indexes
            .pending
            .unschedulable(&q.cluster, &q.workload, q.threshold, now)
        {
            Ok(n) => ReplicaAnswer::Count(i64::try_from(n).unwrap_or(i64::MAX)),
            Err(e) => ReplicaAnswer::Failed(e),
        }
    }

    fn estimate_all(&self, req: &EstimateRequest) -> Result<EstimateResponse, ApiError> {
        let est = self
            .state
            .estimate_manifests(&req.workload.manifests, &req.clusters)?;
        let fresh = self.state.freshness_map(&req.clusters);
        Ok(EstimateResponse::from_estimate(&est, &fresh))
    }

    fn place(&self, req: &PlaceRequest) -> Result<PlaceResponse, ApiError> {
        let p = self.state.place_manifests(
            &req.workload.manifests,
            &req.clusters,
            req.replicas,
            req.use_headroom,
        )?;
        let fresh = self.state.freshness_map(&req.clusters);
        Ok(PlaceResponse::from_placement(&p, &fresh))
    }

    fn preempt(&self, req: &PreemptRequest) -> Result<PreemptResponse, ApiError> {
        let p = self.state.preempt_manifests(
            &req.workload.manifests,
            &req.clusters,
            req.replicas,
            req.use_headroom,
        )?;
        let fresh = self.state.freshness_map(&req.clusters);
        Ok(PreemptResponse::from_preemption(&p, &fresh))
    }

    fn status(&self) -> StatusReport {
        self.state.status_report()
    }

    fn reserve(
        &self,
        caller: &Caller,
        req: &ReserveRequest,
    ) -> Result<ReservationStatus, ApiError> {
        self.state.reserve(caller, req)
    }

    fn release(&self, caller: &Caller, id: &str) -> Result<ReservationStatus, ApiError> {
        self.state.release(caller, id)
    }

    fn reservation(&self, id: &str) -> Result<ReservationStatus, ApiError> {
        self.state
            .reservation_status(id)
            .ok_or_else(|| ApiError::NotFound(format!("reservation {id}")))
    }

    fn reservations(&self) -> Result<Vec<ReservationStatus>, ApiError> {
        Ok(self.state.reservation_list(true))
    }

    fn retire_cluster(&self, name: &str, by: &str) -> Result<RetiredCluster, ApiError> {
        self.state.retire_cluster(name, by)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::sync::Mutex;
    use std::time::Duration;

    use dramesh_api::query::{
        self, ClaimTemplate, DraRequirements, NodeClaim, ReplicaRequirements,
    };
    use dramesh_mesh::store_adapter::MeshStore;
    use dramesh_model::{Manifest, ObjectChange, k8s};
    use dramesh_store::{Durability, Store, StoreConfig};

    use crate::requests::workload_from_manifests;

    const TRAINER: &str = include_str!("../../../tests/estimator/workload/trainer.yaml");

    fn state_with_fleet() -> Arc<ReplicaState> {
        let store = Store::in_memory(StoreConfig {
            durability: Durability::None,
            ..StoreConfig::default()
        });
        let store = Arc::new(Mutex::new(MeshStore::new(store, true)));
        let state = ReplicaState::new("t", Duration::from_secs(120), store);
        state.apply_changes(&fleet_changes());
        state
    }

    fn fleet_changes() -> Vec<(String, ObjectChange)> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/estimator/fleet");
        let mut changes = Vec::new();
        for cluster in ["gpu-east", "gpu-west", "cpu-only"] {
            for l in dramesh_model::load::load_path(&dir.join(cluster)).unwrap() {
                if let Manifest::Object(o) = l.manifest {
                    changes.push((cluster.to_string(), ObjectChange::upsert(&o)));
                }
            }
        }
        changes
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
                claim_refs: vec![],
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

    /// Karmada's `resourceClaimRefs` with and without field 100 (proto/karmada/README.md):
    /// a cluster that publishes ResourceClaimTemplates uses its own; field 100's specs are
    /// used where a cluster publishes none; without them such a cluster answers 0 naming the
    /// template.
    #[test]
    fn karmada_claim_refs_resolve_per_cluster_with_field_100_as_the_fallback() {
        let state = state_with_fleet();
        let backend = ReplicaBackend {
            state: state.clone(),
        };
        let w = workload_from_manifests(&[TRAINER.to_string()]).unwrap();
        let one_gpu = w.templates[0].template.clone();
        // gpu-east publishes its own gpu-80g: two GPUs per replica.
        let mut two = (*one_gpu).clone();
        if let Some(r) = two
            .spec
            .spec
            .devices
            .as_mut()
            .and_then(|d| d.requests.as_mut())
        {
            r[0].exactly.as_mut().unwrap().count = Some(2);
        }
        let obj = dramesh_model::ClusterObject::ResourceClaimTemplate(Arc::new(two));
        state.apply_changes(&[("gpu-east".to_string(), ObjectChange::upsert(&obj))]);
        let requirements = |refs: bool, field_100: bool| ReplicaRequirements {
            node_claim: NodeClaim {
                tolerations: w.node_claim.tolerations.clone(),
                ..NodeClaim::default()
            },
            resource_request: [("cpu".to_string(), k8s::K8sQuantity("8".into()))]
                .into_iter()
                .collect(),
            namespace: "ml".into(),
            priority_class_name: String::new(),
            dra: DraRequirements {
                claim_templates: field_100
                    .then(|| ClaimTemplate {
                        pod_claim_name: "gpu".into(),
                        spec: one_gpu.spec.clone(),
                    })
                    .into_iter()
                    .collect(),
                shared_claims: vec![],
            },
            claim_refs: if refs {
                vec![dramesh_estimator::ClaimRef::Template {
                    pod_claim: "ref-0".into(),
                    name: "gpu-80g".into(),
                }]
            } else {
                vec![]
            },
        };
        let ask = |cluster: &str, refs: bool, field_100: bool| {
            backend.max_available_replicas(&ReplicaQuery {
                cluster: cluster.into(),
                requirements: requirements(refs, field_100),
                assumed_workloads: vec![],
            })
        };
        // east-gpu-1 has 2 free GPUs, east-gpu-2 4: 1 + 2 replicas of two GPUs, 6 of one.
        assert_eq!(ask("gpu-east", true, true), ReplicaAnswer::Count(3));
        assert_eq!(ask("gpu-east", true, false), ReplicaAnswer::Count(3));
        assert_eq!(ask("gpu-east", false, true), ReplicaAnswer::Count(6));
        // gpu-west publishes no templates: field 100 when sent, else 0 naming the template.
        assert_eq!(ask("gpu-west", true, true), ReplicaAnswer::Count(2));
        match ask("gpu-west", true, false) {
            ReplicaAnswer::Failed(e) => assert_eq!(
                e,
                "ResourceClaimTemplate ml/gpu-80g not found in cluster gpu-west"
            ),
            other => panic!("gpu-west: {other:?}"),
        }
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
            let t = jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_mins(mins);
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
                use_headroom: false,
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

    /// The native answers are the estimator's results on the wire, byte for byte (what the
    /// JSON round trip they replace guaranteed), victims included, plus each cluster's
    /// freshness, which only the replica knows.
    #[test]
    fn native_answers_serialize_like_the_estimator_results() {
        let state = state_with_fleet();
        let backend = ReplicaBackend {
            state: state.clone(),
        };
        let m = [TRAINER.to_string()];
        let fresh = state.freshness_map(&[]);
        assert_eq!(fresh.len(), 3, "{fresh:?}");
        let est = state.estimate_manifests(&m, &[]).unwrap();
        let native = EstimateResponse::from_estimate(&est, &fresh);
        assert!(
            native
                .clusters
                .iter()
                .all(|c| c.data_age_seconds.is_some() && !c.stale)
        );
        assert_eq!(without_freshness(&native), json(&est));
        let p = state.place_manifests(&m, &[], None, false).unwrap();
        assert_eq!(
            without_freshness(&PlaceResponse::from_placement(&p, &fresh)),
            json(&p)
        );
        let pre = state.preempt_manifests(&m, &[], Some(8), false).unwrap();
        assert!(
            pre.clusters.iter().any(|c| !c.victims.is_empty()),
            "the fleet should offer victims: {pre:?}"
        );
        assert_eq!(
            without_freshness(&PreemptResponse::from_preemption(&pre, &fresh)),
            json(&pre)
        );
        // Through the backend (what HTTP and gRPC serve) the fields are filled in.
        let w = dramesh_api::native::Workload {
            manifests: m.to_vec(),
        };
        let r = backend
            .estimate_all(&EstimateRequest {
                workload: w,
                clusters: vec!["gpu-east".into()],
            })
            .unwrap();
        assert_eq!(r.clusters.len(), 1);
        assert!(r.clusters[0].data_age_seconds.is_some());
    }

    /// Every native answer flags stale clusters with their data age; placement and
    /// preemption never choose them (gpu-west holds the cheapest victim and would be chosen).
    #[test]
    fn a_call_past_its_deadline_is_refused_and_leaves_later_answers_alone() {
        let state = state_with_fleet();
        let manifests = vec![TRAINER.to_string()];
        let before = state.estimate_manifests(&manifests, &[]).unwrap();
        let past = dramesh_api::deadline::scoped(std::time::Instant::now(), || {
            state.estimate_manifests(&manifests, &[])
        });
        // Refused before the manifests are even decoded.
        assert!(
            matches!(&past, Err(ApiError::Unavailable(m)) if m.contains(dramesh_estimator::DEADLINE_EXCEEDED)),
            "{past:?}"
        );
        let placed = dramesh_api::deadline::scoped(std::time::Instant::now(), || {
            state.preempt_manifests(&manifests, &[], Some(100), false)
        });
        assert!(placed.is_err());
        assert_eq!(state.estimate_manifests(&manifests, &[]).unwrap(), before);
    }

    #[test]
    fn native_answers_flag_stale_clusters_and_never_choose_them() {
        let store = Store::in_memory(StoreConfig {
            durability: Durability::None,
            ..StoreConfig::default()
        });
        let store = Arc::new(Mutex::new(MeshStore::new(store, true)));
        let state = ReplicaState::new("t", Duration::from_millis(100), store);
        state.apply_changes(&fleet_changes());
        std::thread::sleep(Duration::from_millis(150));
        state.touch("gpu-east", std::time::Instant::now());
        let backend = ReplicaBackend {
            state: state.clone(),
        };
        let workload = dramesh_api::native::Workload {
            manifests: vec![TRAINER.to_string()],
        };
        let est = backend
            .estimate_all(&EstimateRequest {
                workload: workload.clone(),
                clusters: vec![],
            })
            .unwrap();
        let get = |n: &str| est.clusters.iter().find(|c| c.name == n).unwrap();
        assert!(!get("gpu-east").stale);
        assert!(get("gpu-west").stale);
        assert!(get("gpu-west").data_age_seconds.unwrap() >= 0.1);
        // The estimate itself is still reported (flagged), as the issue asks.
        assert_eq!(get("gpu-west").max_replicas, 2);

        let p = backend
            .place(&PlaceRequest {
                workload: workload.clone(),
                clusters: vec![],
                replicas: Some(6),
                use_headroom: false,
            })
            .unwrap();
        assert_eq!(p.unschedulable, None);
        assert_eq!(p.stale, ["gpu-west"]);
        assert!(p.clusters.iter().all(|c| c.name == "gpu-east"), "{p:?}");
        assert!(p.data_age_seconds["gpu-west"] >= 0.1);
        assert!(p.data_age_seconds["gpu-east"] < 0.1);
        let p = backend
            .place(&PlaceRequest {
                workload: workload.clone(),
                clusters: vec![],
                replicas: Some(8),
                use_headroom: false,
            })
            .unwrap();
        assert!(p.clusters.is_empty());
        let why = p.unschedulable.unwrap();
        assert!(why.contains("data stale: gpu-west"), "{why}");

        let pre = backend
            .preempt(&PreemptRequest {
                workload,
                clusters: vec![],
                replicas: Some(8),
                use_headroom: false,
            })
            .unwrap();
        assert_eq!(pre.chosen.as_deref(), Some("gpu-east"));
        let west = pre.clusters.iter().find(|c| c.name == "gpu-west").unwrap();
        assert!(west.stale && west.victims.is_empty());
        assert!(west.data_age_seconds.unwrap() >= 0.1);

        // Readiness rule 3: one fresh cluster keeps the replica ready; all stale does not.
        assert!(!state.all_stale());
        std::thread::sleep(Duration::from_millis(150));
        assert!(state.all_stale());
        state.touch("cpu-only", std::time::Instant::now());
        assert!(!state.all_stale());
    }

    /// The JSON of a native answer without the fields only the replica adds.
    fn without_freshness<T: serde::Serialize>(v: &T) -> String {
        fn strip(v: &mut serde_json::Value) {
            match v {
                serde_json::Value::Object(m) => {
                    m.remove("dataAgeSeconds");
                    if m.get("stale").is_some_and(serde_json::Value::is_boolean) {
                        m.remove("stale");
                    }
                    m.values_mut().for_each(strip);
                }
                serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
                _ => {}
            }
        }
        let mut v = serde_json::to_value(v).unwrap();
        strip(&mut v);
        v.to_string()
    }

    fn json<T: serde::Serialize>(v: &T) -> String {
        serde_json::to_value(v).unwrap().to_string()
    }
}
