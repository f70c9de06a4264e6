//! Shared helpers of the integration tests: servers on ephemeral ports and a sample query.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use dramesh_api::ApiState;
use dramesh_api::query::{
    ClaimTemplate, DraRequirements, NodeClaim, ReplicaQuery, ReplicaRequirements,
};
use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tokio::sync::oneshot;

pub struct Running {
    pub addr: SocketAddr,
    pub state: ApiState,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), dramesh_api::ServeError>>>,
}

impl Running {
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let r = t.await.expect("server task");
            assert!(r.is_ok(), "server ended with {r:?}");
        }
    }
}

pub fn demo_state() -> ApiState {
    ApiState::new(Arc::new(dramesh_api::table::demo_table()))
}

pub async fn start_grpc(state: ApiState) -> Running {
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

pub async fn start_http(state: ApiState) -> Running {
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
pub fn member1_query() -> ReplicaQuery {
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
pub fn two_gpus() -> DraRequirements {
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
