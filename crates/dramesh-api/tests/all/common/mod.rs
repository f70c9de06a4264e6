//! Shared helpers of the integration tests: servers on ephemeral ports and a sample query.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use dramesh_api::native::{
    EstimateRequest, EstimateResponse, PlaceRequest, PlaceResponse, PreemptRequest,
    PreemptResponse, ReservationState, ReservationStatus, ReserveRequest, StatusReport,
    WorkloadRef,
};
use dramesh_api::query::{
    ClaimTemplate, ComponentSetQuery, DraRequirements, NodeClaim, ReplicaQuery,
    ReplicaRequirements, UnschedulableQuery,
};
use dramesh_api::table::TableBackend;
use dramesh_api::{ApiError, ApiState, Backend, ReplicaAnswer};
use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tokio::sync::oneshot;

/// Polls `cond` every 10 ms until it holds; panics naming `what` after `limit`.
pub(crate) async fn wait_until(
    what: &str,
    limit: std::time::Duration,
    mut cond: impl FnMut() -> bool,
) {
    let deadline = tokio::time::Instant::now() + limit;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {limit:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

pub(crate) struct Running {
    pub(crate) addr: SocketAddr,
    pub(crate) state: ApiState,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), dramesh_api::ServeError>>>,
}

impl Running {
    pub(crate) async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let r = t.await.expect("server task");
            assert!(r.is_ok(), "server ended with {r:?}");
        }
    }
}

pub(crate) fn demo_state() -> ApiState {
    open(ApiState::new(Arc::new(dramesh_api::table::demo_table())))
}

/// `state` letting every caller, anonymous included, read and write: for the tests of what
/// the API answers; the tests of who may ask set their own policy.
pub(crate) fn open(state: ApiState) -> ApiState {
    use dramesh_api::auth::{AUTHENTICATED, Auth, Policy, Subject, UNAUTHENTICATED};
    state.with_auth(Auth::new(Policy {
        readers: Vec::new(),
        writers: vec![
            Subject::Group(UNAUTHENTICATED.into()),
            Subject::Group(AUTHENTICATED.into()),
        ],
        admins: Vec::new(),
    }))
}

pub(crate) async fn start_grpc(state: ApiState) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(dramesh_api::serve_grpc_on(
        listener,
        state.clone(),
        async move {
            let _ = rx.await;
        },
    ));
    Running {
        addr,
        state,
        stop: Some(tx),
        task: Some(task),
    }
}

pub(crate) async fn start_http(state: ApiState) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(dramesh_api::serve_http_on(
        listener,
        state.clone(),
        async move {
            let _ = rx.await;
        },
    ));
    Running {
        addr,
        state,
        stop: Some(tx),
        task: Some(task),
    }
}

/// 500m cpu, 1Gi memory, nodeSelector zone=a, affinity gpu In [h100], tolerates the
/// `nvidia.com/gpu` taint: 32 replicas on the demo table's member-1 (16 cpu / 500m).
pub(crate) fn member1_query() -> ReplicaQuery {
    ReplicaQuery {
        cluster: "member-1".into(),
        requirements: ReplicaRequirements {
            node_claim: NodeClaim {
                node_selector: BTreeMap::from([("zone".to_string(), "a".to_string())]),
                node_affinity: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: "gpu".into(),
                            operator: "In".into(),
                            values: Some(vec!["h100".into()]),
                        }]),
                        match_fields: None,
                    }],
                }),
                tolerations: vec![Toleration {
                    key: Some("nvidia.com/gpu".into()),
                    operator: Some("Exists".into()),
                    effect: Some("NoSchedule".into()),
                    ..Default::default()
                }],
            },
            resource_request: BTreeMap::from([
                ("cpu".to_string(), Quantity("500m".into())),
                ("memory".to_string(), Quantity("1Gi".into())),
            ]),
            namespace: "default".into(),
            ..Default::default()
        },
        assumed_workloads: vec![],
    }
}

/// Two `gpu.example.com` devices per replica.
pub(crate) fn two_gpus() -> DraRequirements {
    DraRequirements {
        claim_templates: vec![ClaimTemplate {
            pod_claim_name: "gpus".into(),
            spec: serde_json::from_value(serde_json::json!({
                "spec": {"devices": {"requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com", "count": 2}}
                ]}}
            }))
            .expect("template spec"),
        }],
        shared_claims: vec![],
    }
}

/// The demo table plus an in-memory reservation table owned by replica `fake-estimator`,
/// filling every field of [`ReservationStatus`] so conversions can be checked end to end.
/// A reservation on a cluster outside the table is conflicted with a reason; a second one
/// on a cluster that already has a live reservation is conflicted with that one as winner.
pub(crate) struct ReservingBackend {
    pub(crate) table: TableBackend,
    pub(crate) reservations: Mutex<BTreeMap<String, ReservationStatus>>,
    /// The last request `reserve` received, as the backend saw it.
    pub(crate) last_reserve: Mutex<Option<ReserveRequest>>,
}

impl ReservingBackend {
    pub(crate) fn new() -> ReservingBackend {
        ReservingBackend {
            table: dramesh_api::table::demo_table(),
            reservations: Mutex::new(BTreeMap::new()),
            last_reserve: Mutex::new(None),
        }
    }

    fn all(&self) -> Vec<ReservationStatus> {
        self.reservations
            .lock()
            .expect("lock")
            .values()
            .cloned()
            .collect()
    }
}

impl Backend for ReservingBackend {
    fn max_available_replicas(&self, q: &ReplicaQuery) -> ReplicaAnswer {
        self.table.max_available_replicas(q)
    }
    fn max_available_component_sets(&self, q: &ComponentSetQuery) -> ReplicaAnswer {
        self.table.max_available_component_sets(q)
    }
    fn unschedulable_replicas(&self, q: &UnschedulableQuery) -> ReplicaAnswer {
        self.table.unschedulable_replicas(q)
    }
    fn estimate_all(&self, req: &EstimateRequest) -> Result<EstimateResponse, ApiError> {
        self.table.estimate_all(req)
    }
    fn place(&self, req: &PlaceRequest) -> Result<PlaceResponse, ApiError> {
        self.table.place(req)
    }
    fn preempt(&self, req: &PreemptRequest) -> Result<PreemptResponse, ApiError> {
        self.table.preempt(req)
    }
    fn status(&self) -> StatusReport {
        StatusReport {
            reservations: self.all(),
            ..self.table.status()
        }
    }

    fn reserve(
        &self,
        _caller: &dramesh_api::auth::Caller,
        req: &ReserveRequest,
    ) -> Result<ReservationStatus, ApiError> {
        *self.last_reserve.lock().expect("lock") = Some(req.clone());
        if req.workload.manifests.is_empty() {
            return Err(ApiError::InvalidRequest(
                "reservation: field workload.manifests is empty".into(),
            ));
        }
        let mut table = self.reservations.lock().expect("lock");
        let id = format!("{}-{}", self.table.replica, table.len() + 1);
        let known = self.table.clusters.iter().any(|c| c.name == req.cluster);
        let winner = table
            .values()
            .find(|r| r.cluster == req.cluster && r.status == ReservationState::Live)
            .map(|r| r.id.clone());
        let replicas = req.replicas.unwrap_or(1);
        let ttl_seconds = req.ttl_seconds.unwrap_or(300);
        let status = ReservationStatus {
            id: id.clone(),
            owner: self.table.replica.clone(),
            cluster: req.cluster.clone(),
            workload: WorkloadRef {
                namespace: "ml".into(),
                kind: "Deployment".into(),
                name: "train".into(),
            },
            replicas,
            remaining: replicas - 1,
            priority: req.priority.unwrap_or(0),
            ttl_seconds,
            status: if known && winner.is_none() {
                ReservationState::Live
            } else {
                ReservationState::Conflicted
            },
            reason: (!known).then(|| format!("cluster {} is not in the view", req.cluster)),
            winner: if known { winner } else { None },
            expires_in_seconds: Some(ttl_seconds as f64 - 0.25),
        };
        table.insert(id, status.clone());
        Ok(status)
    }

    fn release(
        &self,
        _caller: &dramesh_api::auth::Caller,
        id: &str,
    ) -> Result<ReservationStatus, ApiError> {
        let mut table = self.reservations.lock().expect("lock");
        let r = table
            .get_mut(id)
            .ok_or_else(|| ApiError::NotFound(format!("reservation {id}")))?;
        r.status = ReservationState::Released;
        r.expires_in_seconds = None;
        Ok(r.clone())
    }

    fn reservation(&self, id: &str) -> Result<ReservationStatus, ApiError> {
        self.reservations
            .lock()
            .expect("lock")
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::NotFound(format!("reservation {id}")))
    }

    fn reservations(&self) -> Result<Vec<ReservationStatus>, ApiError> {
        Ok(self.all())
    }
}
