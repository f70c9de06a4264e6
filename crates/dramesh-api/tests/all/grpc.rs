//! In-process tonic client against the gRPC server over the demo table backend.

use crate::common;

use common::*;
use std::sync::Arc;

use dramesh_api::metrics::{API_KARMADA, API_NATIVE_GRPC, Method, MethodCounts};
use dramesh_api::native::{ReservationList, ReservationState, ReservationStatus, StatusReport};
use dramesh_api::proto::karmada as kpb;
use dramesh_api::proto::karmada_service::estimator_client::EstimatorClient;
use dramesh_api::proto::native as npb;
use dramesh_api::proto::native::dramesh_client::DrameshClient;
use dramesh_api::query::{ComponentSetQuery, WireStyle};
use dramesh_api::{ApiConfig, ApiState, Backend, query};
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

/// The Karmada answer to `q` (v1.19 wire style), which must not be an error.
async fn replicas(c: &mut EstimatorClient<Channel>, q: &query::ReplicaQuery) -> i32 {
    c.max_available_replicas(q.to_proto(WireStyle::V119))
        .await
        .expect("no error")
        .into_inner()
        .max_replicas
}

#[tokio::test]
async fn unknown_and_stale_clusters_answer_zero_not_error() {
    let srv = start_grpc(demo_state()).await;
    let mut c = EstimatorClient::new(channel(srv.addr).await);
    let mut q = member1_query();
    q.cluster = "no-such-cluster".into();
    assert_eq!(replicas(&mut c, &q).await, 0);
    q.cluster = "member-3".into();
    assert_eq!(replicas(&mut c, &q).await, 0);
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

/// The demo table, except that `MaxAvailableReplicas` is answered by its closure.
struct Answering(
    dramesh_api::table::TableBackend,
    Box<dyn Fn(&query::ReplicaQuery) -> dramesh_api::ReplicaAnswer + Send + Sync>,
);

impl Backend for Answering {
    fn max_available_replicas(&self, q: &query::ReplicaQuery) -> dramesh_api::ReplicaAnswer {
        (self.1)(q)
    }
    fn max_available_component_sets(&self, q: &ComponentSetQuery) -> dramesh_api::ReplicaAnswer {
        self.0.max_available_component_sets(q)
    }
    fn unschedulable_replicas(&self, q: &query::UnschedulableQuery) -> dramesh_api::ReplicaAnswer {
        self.0.unschedulable_replicas(q)
    }
    fn estimate_all(
        &self,
        req: &dramesh_api::native::EstimateRequest,
    ) -> Result<dramesh_api::native::EstimateResponse, dramesh_api::ApiError> {
        self.0.estimate_all(req)
    }
    fn place(
        &self,
        req: &dramesh_api::native::PlaceRequest,
    ) -> Result<dramesh_api::native::PlaceResponse, dramesh_api::ApiError> {
        self.0.place(req)
    }
    fn preempt(
        &self,
        req: &dramesh_api::native::PreemptRequest,
    ) -> Result<dramesh_api::native::PreemptResponse, dramesh_api::ApiError> {
        self.0.preempt(req)
    }
    fn status(&self) -> StatusReport {
        self.0.status()
    }
}

#[tokio::test]
async fn a_zero_from_a_give_up_is_counted_apart_from_other_zeros() {
    // The device allocation search "gives up" on every question: nothing found on
    // member-1, 3 found on member-2.
    let giving_up = Answering(
        dramesh_api::table::demo_table(),
        Box::new(|q| dramesh_api::ReplicaAnswer::Unknown {
            at_least: if q.cluster == "member-1" { 0 } else { 3 },
            nodes: 2,
        }),
    );
    let srv = start_grpc(common::open(ApiState::new(Arc::new(giving_up)))).await;
    let mut c = EstimatorClient::new(channel(srv.addr).await);
    let mut q = member1_query();
    assert_eq!(replicas(&mut c, &q).await, 0);
    // A lower bound above 0 is answered as it is and is no zero answer.
    q.cluster = "member-2".into();
    assert_eq!(replicas(&mut c, &q).await, 3);
    let m = MethodCounts::of(
        &srv.state.metrics,
        API_KARMADA,
        Method::MaxAvailableReplicas,
    );
    assert_eq!(
        (
            m.requests,
            m.errors,
            m.zero_budget_exhausted,
            m.zero_backend_failure,
            m.zero_unknown_cluster,
        ),
        (2, 0, 1, 0, 0)
    );
    let text = srv.state.metrics.render();
    assert!(
        text.contains(
            "dramesh_api_zero_answers_total{method=\"MaxAvailableReplicas\",reason=\"budget_exhausted\"} 1\n"
        ),
        "{text}"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_max_workers_computations_run_at_once_whatever_the_callers_send() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Each question takes 20 ms; the most seen computing at once is recorded.
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (r, m) = (running.clone(), most.clone());
    let slow = Answering(
        dramesh_api::table::demo_table(),
        Box::new(move |_| {
            let now = r.fetch_add(1, Ordering::SeqCst) + 1;
            m.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(20));
            r.fetch_sub(1, Ordering::SeqCst);
            dramesh_api::ReplicaAnswer::Count(7)
        }),
    );
    let config = ApiConfig {
        max_workers: 2,
        ..ApiConfig::default()
    };
    let state = common::open(ApiState::new(Arc::new(slow))).with_config(config);
    let srv = start_grpc(state).await;
    let c = EstimatorClient::new(channel(srv.addr).await);
    // 24 calls in flight on one connection (HTTP/2 streams): 12 rounds of 2 places, ~240 ms,
    // well inside the 2.5 s Karmada time limit.
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..24 {
        let mut c = c.clone();
        calls.spawn(async move { replicas(&mut c, &member1_query()).await });
    }
    let mut answers = Vec::new();
    while let Some(a) = calls.join_next().await {
        answers.push(a.expect("call"));
    }
    assert_eq!(answers, vec![7; 24], "every call answered, none timed out");
    assert_eq!(most.load(Ordering::SeqCst), 2, "computations at once");
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
    assert_eq!(replicas(&mut c, &q).await, 4);
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

fn reserve_request(cluster: &str, priority: Option<i32>) -> npb::ReserveRequest {
    npb::ReserveRequest {
        workload: Some(npb::Workload {
            manifests: vec!["kind: Deployment\nmetadata: {name: train}\n".into()],
        }),
        cluster: cluster.into(),
        replicas: Some(4),
        priority,
        ttl_seconds: Some(90),
    }
}

fn native(r: npb::Reservation) -> ReservationStatus {
    ReservationStatus::try_from(r).expect("known reservation state")
}

#[tokio::test]
async fn reservations_round_trip_over_the_native_service() {
    let backend = Arc::new(ReservingBackend::new());
    let srv = start_grpc(common::open(ApiState::new(backend.clone()))).await;
    let mut c = DrameshClient::new(channel(srv.addr).await);

    let first = c
        .reserve(reserve_request("member-1", Some(-7)))
        .await
        .expect("reserve")
        .into_inner();
    // The request reached the backend intact (optional fields set and unset).
    let seen = backend.last_reserve.lock().expect("lock").clone();
    let seen = seen.expect("backend saw the request");
    assert_eq!(seen.cluster, "member-1");
    assert_eq!(
        (seen.replicas, seen.priority, seen.ttl_seconds),
        (Some(4), Some(-7), Some(90))
    );
    assert_eq!(
        seen.workload.manifests,
        vec!["kind: Deployment\nmetadata: {name: train}\n".to_string()]
    );
    let first = native(first);
    assert_eq!(first.id, "fake-estimator-1");
    assert_eq!(first.owner, "fake-estimator");
    assert_eq!(
        (
            first.workload.namespace.as_str(),
            first.workload.kind.as_str(),
            first.workload.name.as_str()
        ),
        ("ml", "Deployment", "train")
    );
    assert_eq!(
        (
            first.replicas,
            first.remaining,
            first.priority,
            first.ttl_seconds
        ),
        (4, 3, -7, 90)
    );
    assert_eq!(first.status, ReservationState::Live);
    assert_eq!(first.expires_in_seconds, Some(89.75));
    assert_eq!(
        (first.winner.as_deref(), first.reason.as_deref()),
        (None, None)
    );

    let mut unset = reserve_request("member-1", None);
    unset.ttl_seconds = None;
    let second = native(c.reserve(unset).await.expect("reserve").into_inner());
    let seen = backend.last_reserve.lock().expect("lock").clone();
    assert_eq!(
        seen.map(|r| (r.priority, r.ttl_seconds)),
        Some((None, None))
    );
    assert_eq!(second.status, ReservationState::Conflicted);
    assert_eq!(second.winner.as_deref(), Some("fake-estimator-1"));
    assert_eq!(second.ttl_seconds, 300);

    let third = native(
        c.reserve(reserve_request("nowhere", Some(1)))
            .await
            .expect("reserve")
            .into_inner(),
    );
    assert_eq!(third.status, ReservationState::Conflicted);
    assert_eq!(
        third.reason.as_deref(),
        Some("cluster nowhere is not in the view")
    );
    assert_eq!(third.winner, None);

    // Get and List answer exactly what the backend holds, field for field.
    let got = c
        .get_reservation(npb::GetReservationRequest {
            id: second.id.clone(),
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(native(got), second);
    let list = c
        .list_reservations(npb::ListReservationsRequest {})
        .await
        .expect("list")
        .into_inner();
    let list = ReservationList::try_from(list).expect("known states");
    assert_eq!(
        list.reservations,
        vec![first.clone(), second.clone(), third.clone()]
    );
    assert_eq!(
        list.reservations,
        backend.reservations().expect("backend list")
    );

    // The status carries the same reservations.
    let status = c
        .status(npb::StatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert_eq!(status.reservations.len(), 3);
    let status = StatusReport::try_from(status).expect("known states");
    assert_eq!(status.reservations, list.reservations);
    assert_eq!(status.clusters.len(), 3);

    let released = native(
        c.release(npb::ReleaseRequest {
            id: first.id.clone(),
        })
        .await
        .expect("release")
        .into_inner(),
    );
    assert_eq!(released.status, ReservationState::Released);
    assert_eq!(released.expires_in_seconds, None);
    assert_eq!(released.replicas, first.replicas);
    let got = c
        .get_reservation(npb::GetReservationRequest { id: first.id })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(got.status, npb::ReservationState::Released as i32);

    // Errors map to the codes of the other native RPCs; an empty id never reaches the backend.
    let e = c
        .release(npb::ReleaseRequest { id: "nope".into() })
        .await
        .expect_err("unknown id");
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("reservation nope"), "{}", e.message());
    let e = c
        .get_reservation(npb::GetReservationRequest { id: String::new() })
        .await
        .expect_err("empty id");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("field id"), "{}", e.message());
    let mut no_workload = reserve_request("member-1", None);
    no_workload.workload = None;
    let e = c.reserve(no_workload).await.expect_err("no manifests");
    assert_eq!(e.code(), Code::InvalidArgument);

    let counts = |m| MethodCounts::of(&srv.state.metrics, API_NATIVE_GRPC, m);
    let r = counts(Method::Reserve);
    assert_eq!((r.requests, r.errors), (4, 1));
    let r = counts(Method::Release);
    assert_eq!((r.requests, r.errors), (2, 1));
    let r = counts(Method::GetReservation);
    assert_eq!((r.requests, r.errors), (3, 1));
    let r = counts(Method::ListReservations);
    assert_eq!((r.requests, r.errors), (1, 0));
    srv.stop().await;
}

#[tokio::test]
async fn a_backend_without_reservations_answers_unavailable() {
    let srv = start_grpc(demo_state()).await;
    let mut c = DrameshClient::new(channel(srv.addr).await);
    let e = c
        .reserve(reserve_request("member-1", None))
        .await
        .expect_err("no reservations");
    assert_eq!(e.code(), Code::Unavailable);
    let e = c
        .list_reservations(npb::ListReservationsRequest {})
        .await
        .expect_err("no reservations");
    assert_eq!(e.code(), Code::Unavailable);
    // The status still answers, with no reservations.
    let s = c
        .status(npb::StatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert!(s.reservations.is_empty());
    assert_eq!(
        MethodCounts::of(&srv.state.metrics, API_NATIVE_GRPC, Method::Reserve).errors,
        1
    );
    srv.stop().await;
}

/// Sends raw bytes as a message body, to reach the server's decoder with garbage.
#[derive(Debug, Default, Clone)]
struct RawCodec;

#[derive(Debug)]
struct RawBytes;

impl tonic::codec::Encoder for RawBytes {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        prost::bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawBytes {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use prost::bytes::Buf;
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n).to_vec()))
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawBytes;
    type Decoder = RawBytes;
    fn encoder(&mut self) -> RawBytes {
        RawBytes
    }
    fn decoder(&mut self) -> RawBytes {
        RawBytes
    }
}

#[tokio::test]
async fn undecodable_bodies_are_invalid_argument() {
    let srv = start_grpc(demo_state()).await;
    let mut g = tonic::client::Grpc::new(channel(srv.addr).await);
    for path in [
        "/github.com.karmada_io.karmada.pkg.estimator.service.Estimator/MaxAvailableReplicas",
        "/dramesh.v1.Dramesh/Place",
    ] {
        g.ready().await.expect("ready");
        // Field 1, wire type 2 (length-delimited), length 100, but only 2 bytes follow.
        let e = g
            .unary(
                tonic::Request::new(vec![0x0a, 100, 1, 2]),
                tonic::codegen::http::uri::PathAndQuery::from_static(path),
                RawCodec,
            )
            .await
            .expect_err("garbage");
        assert_eq!(e.code(), Code::InvalidArgument, "{path}: {e:?}");
        assert!(e.message().contains("cannot be decoded"), "{path}: {e:?}");
    }
    srv.stop().await;
}

/// Reads until the server closes the connection; `true` if it did within `limit`.
async fn server_closes(s: &mut tokio::net::TcpStream, limit: std::time::Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let until = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(until, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test]
async fn at_the_grpc_cap_the_longest_idle_connection_makes_room() {
    use std::time::Duration;
    let state = demo_state().with_config(ApiConfig {
        grpc: dramesh_api::GrpcLimits {
            max_connections: 2,
            ..Default::default()
        },
        ..ApiConfig::default()
    });
    let srv = start_grpc(state).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(tokio::net::TcpStream::connect(srv.addr).await.unwrap());
    }
    // Before the cap: the two idle connections are open.
    let m = &srv.state.metrics;
    let until = tokio::time::Instant::now() + Duration::from_secs(2);
    while m.grpc_connections.get() < 2.0 {
        assert!(
            tokio::time::Instant::now() < until,
            "two connections never counted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A real client over the cap gets its answer; the oldest idle connection is closed.
    let mut c = EstimatorClient::new(channel(srv.addr).await);
    let r = c
        .max_available_replicas(member1_query().to_proto(WireStyle::V119))
        .await
        .expect("answer at the cap");
    assert_eq!(r.into_inner().max_replicas, 32);
    assert!(
        server_closes(&mut held[0], Duration::from_secs(2)).await,
        "the oldest idle connection stayed open"
    );
    let closed = |reason| {
        m.http_connections_closed_total
            .with([dramesh_api::GRPC_LISTENER, reason])
            .get()
    };
    assert_eq!(closed("evicted_idle"), 1);
    assert_eq!(m.grpc_connections_refused_total.get(), 0);
    assert!(m.grpc_connections.get() <= 2.0);
    drop((held, c));
    srv.stop().await;
}

#[tokio::test]
async fn a_grpc_connection_without_a_preface_is_closed_after_the_preface_timeout() {
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;
    let state = demo_state().with_config(ApiConfig {
        grpc: dramesh_api::GrpcLimits {
            preface_timeout: Duration::from_millis(300),
            ..Default::default()
        },
        ..ApiConfig::default()
    });
    let srv = start_grpc(state).await;
    let mut silent = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    let mut partial = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    partial.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    assert!(server_closes(&mut silent, Duration::from_secs(3)).await);
    assert!(server_closes(&mut partial, Duration::from_secs(3)).await);
    // The gauge drops when the server's connection tasks end, just after the close is seen.
    wait_until("no connection counted", Duration::from_secs(5), || {
        srv.state.metrics.grpc_connections.get() == 0.0
    })
    .await;
    srv.stop().await;
}
