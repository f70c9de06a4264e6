//! In-process tonic client against the gRPC server over the demo table backend.

mod common;

use common::*;
use dramesh_api::metrics::{API_KARMADA, Method, MethodCounts};
use dramesh_api::proto::karmada as kpb;
use dramesh_api::proto::karmada_service::estimator_client::EstimatorClient;
use dramesh_api::proto::native as npb;
use dramesh_api::proto::native::dramesh_client::DrameshClient;
use dramesh_api::query::{ComponentSetQuery, WireStyle};
use dramesh_api::{ApiConfig, query};
use tonic::Code;
use tonic::transport::Channel;

async fn channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}

#[tokio::test]
async fn every_wire_generation_gets_the_same_answer() {
    let srv = start_grpc(demo_state()).await;
    let mut c = EstimatorClient::new(channel(srv.addr).await);
    let q = member1_query();
    let mut answers = Vec::new();
    for style in [WireStyle::V117, WireStyle::V118, WireStyle::V119] {
        let r = c
            .max_available_replicas(q.to_proto(style))
            .await
            .expect("answer");
        answers.push(r.into_inner().max_replicas);
    }
    assert_eq!(answers, vec![32, 32, 32]);

    // Without the toleration the tainted cluster is rejected: the tolerations really travel.
    let mut untolerated = q.clone();
    untolerated.requirements.node_claim.tolerations.clear();
    for style in [WireStyle::V117, WireStyle::V119] {
        let r = c
            .max_available_replicas(untolerated.to_proto(style))
            .await
            .expect("answer");
        assert_eq!(r.into_inner().max_replicas, 0, "{style:?}");
    }
    // Affinity that does not match rejects the cluster in both generations.
    let mut other_gpu = q.clone();
    if let Some(a) = other_gpu.requirements.node_claim.node_affinity.as_mut() {
        a.node_selector_terms[0].match_expressions =
            Some(vec![k8s_openapi::api::core::v1::NodeSelectorRequirement {
                key: "gpu".into(),
                operator: "In".into(),
                values: Some(vec!["a100".into()]),
            }]);
    }
    for style in [WireStyle::V117, WireStyle::V119] {
        let r = c
            .max_available_replicas(other_gpu.to_proto(style))
            .await
            .expect("answer");
        assert_eq!(r.into_inner().max_replicas, 0, "{style:?}");
    }
    srv.stop().await;
}

#[tokio::test]
async fn unknown_and_stale_clusters_answer_zero_not_error() {
    let srv = start_grpc(demo_state()).await;
    let mut c = EstimatorClient::new(channel(srv.addr).await);
    let mut q = member1_query();
    q.cluster = "no-such-cluster".into();
    let r = c
        .max_available_replicas(q.to_proto(WireStyle::V119))
        .await
        .expect("no error");
    assert_eq!(r.into_inner().max_replicas, 0);
    q.cluster = "member-3".into();
    let r = c
        .max_available_replicas(q.to_proto(WireStyle::V119))
        .await
        .expect("no error");
    assert_eq!(r.into_inner().max_replicas, 0);
    let r = c
        .max_available_component_sets(kpb::MaxAvailableComponentSetsRequest {
            cluster: "no-such-cluster".into(),
            ..Default::default()
        })
        .await
        .expect("no error");
    assert_eq!(r.into_inner().max_sets, 0);
    let m = MethodCounts::of(
        &srv.state.metrics,
        API_KARMADA,
        Method::MaxAvailableReplicas,
    );
    assert_eq!(
        (
            m.requests,
            m.errors,
            m.zero_unknown_cluster,
            m.zero_stale_cluster
        ),
        (2, 0, 1, 1)
    );
    assert_eq!(
        MethodCounts::of(
            &srv.state.metrics,
            API_KARMADA,
            Method::MaxAvailableComponentSets
        )
        .zero_unknown_cluster,
        1
    );
    srv.stop().await;
}

#[tokio::test]
async fn any_cluster_of_the_view_is_answered() {
    let srv = start_grpc(demo_state()).await;
    let mut c = EstimatorClient::new(channel(srv.addr).await);
    let mut q = member1_query();
    q.cluster = "member-2".into();
    q.requirements.node_claim = Default::default();
    // member-2: 4 cpu / 500m = 8, 8Gi / 1Gi = 8.
    let r = c
        .max_available_replicas(q.to_proto(WireStyle::V118))
        .await
        .expect("answer");
    assert_eq!(r.into_inner().max_replicas, 8);
    let r = c
        .get_unschedulable_replicas(kpb::UnschedulableReplicasRequest {
            cluster: "member-1".into(),
            resource: Some(kpb::ObjectReference {
                api_version: "apps/v1".into(),
                kind: "Deployment".into(),
                namespace: "default".into(),
                name: "web".into(),
            }),
            unschedulable_threshold: 300_000_000_000,
        })
        .await
        .expect("answer");
    assert_eq!(r.into_inner().unschedulable_replicas, 2);
    srv.stop().await;
}

#[tokio::test]
async fn dra_extension_field_and_assumed_workloads_are_honoured() {
    let srv = start_grpc(demo_state()).await;
    let mut c = EstimatorClient::new(channel(srv.addr).await);
    let mut q = member1_query();
    q.requirements.dra = two_gpus();
    // 8 devices / 2 per replica = 4 (cpu alone would allow 32).
    let r = c
        .max_available_replicas(q.to_proto(WireStyle::V119))
        .await
        .expect("answer");
    assert_eq!(r.into_inner().max_replicas, 4);
    q.assumed_workloads = vec![query::AssumedWorkload {
        namespace: "default".into(),
        components: vec![query::Component {
            name: "in-flight".into(),
            replicas: 1,
            requirements: q.requirements.clone(),
        }],
    }];
    let r = c
        .max_available_replicas(q.to_proto(WireStyle::V118))
        .await
        .expect("answer");
    assert_eq!(r.into_inner().max_replicas, 3);

    // Component sets: 1 x (2 gpus) + 2 x plain 500m per set -> 4 sets by devices.
    let mut plain = member1_query().requirements;
    plain.namespace.clear();
    let mut gpu = plain.clone();
    gpu.dra = two_gpus();
    let sets = ComponentSetQuery {
        cluster: "member-1".into(),
        namespace: "default".into(),
        components: vec![
            query::Component {
                name: "leader".into(),
                replicas: 1,
                requirements: gpu,
            },
            query::Component {
                name: "worker".into(),
                replicas: 2,
                requirements: plain,
            },
        ],
        assumed_workloads: vec![],
    };
    for style in [WireStyle::V117, WireStyle::V119] {
        let r = c
            .max_available_component_sets(sets.to_proto(style))
            .await
            .expect("answer");
        assert_eq!(r.into_inner().max_sets, 4, "{style:?}");
    }
    srv.stop().await;
}

#[tokio::test]
async fn malformed_and_oversized_requests_are_refused_cleanly() {
    let state = demo_state().with_config(ApiConfig {
        max_request_bytes: 64 * 1024,
        ..ApiConfig::default()
    });
    let srv = start_grpc(state).await;
    let mut c = EstimatorClient::new(channel(srv.addr).await);

    let mut bad = member1_query().to_proto(WireStyle::V119);
    if let Some(r) = bad.replica_requirements.as_mut() {
        r.resource_request_bytes
            .insert("cpu".into(), vec![0xff, 0xff]);
    }
    let e = c.max_available_replicas(bad).await.expect_err("malformed");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("resourceRequestBytes[cpu]"),
        "{}",
        e.message()
    );

    let mut big = member1_query();
    big.requirements
        .node_claim
        .node_selector
        .insert("padding".into(), "x".repeat(100 * 1024));
    let e = c
        .max_available_replicas(big.to_proto(WireStyle::V119))
        .await
        .expect_err("too large");
    // tonic reports a message over the decoding limit as OutOfRange (grpc-go: ResourceExhausted).
    assert!(
        matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{e:?}"
    );
    assert!(e.message().contains("too large"), "{}", e.message());

    // The connection and server are still usable afterwards.
    let r = c
        .max_available_replicas(member1_query().to_proto(WireStyle::V119))
        .await
        .expect("answer");
    assert_eq!(r.into_inner().max_replicas, 32);
    assert_eq!(
        MethodCounts::of(
            &srv.state.metrics,
            API_KARMADA,
            Method::MaxAvailableReplicas
        )
        .errors,
        1
    );
    srv.stop().await;
}

#[tokio::test]
async fn native_service_estimates_all_clusters_and_reports_status() {
    let srv = start_grpc(demo_state()).await;
    let mut c = DrameshClient::new(channel(srv.addr).await);
    let pod = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "x", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}
    });
    let r = c
        .estimate_all(npb::EstimateRequest {
            workload: Some(npb::Workload {
                manifests: vec![pod.to_string()],
            }),
            clusters: vec![],
        })
        .await
        .expect("estimate")
        .into_inner();
    let by_name: std::collections::BTreeMap<_, _> = r
        .clusters
        .iter()
        .map(|c| (c.name.as_str(), c.max_replicas))
        .collect();
    // member-1 is tainted and the pod has no toleration; member-2: 4 cpu / 1; member-3 stale.
    assert_eq!(by_name.get("member-1"), Some(&0));
    assert_eq!(by_name.get("member-2"), Some(&4));
    assert_eq!(by_name.get("member-3"), Some(&0));
    assert_eq!(r.total, 4);

    let e = c
        .estimate_all(npb::EstimateRequest {
            workload: Some(npb::Workload {
                manifests: vec!["kind: [".into()],
            }),
            clusters: vec![],
        })
        .await
        .expect_err("bad manifest");
    assert_eq!(e.code(), Code::InvalidArgument);

    srv.state.set_ready(true);
    let s = c
        .status(npb::StatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert!(s.ready);
    assert_eq!(s.clusters.len(), 3);
    assert!(s.clusters.iter().any(|c| c.name == "member-3" && c.stale));
    srv.stop().await;
}
