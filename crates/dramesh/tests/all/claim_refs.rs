//! Karmada's `resourceClaimRefs` with separate `dramesh` processes: one replica and two
//! folder agents publishing the real dra-example-driver objects (the kind worker's 8-GPU
//! ResourceSlice, its DeviceClass) and real ResourceClaimTemplates. `east` publishes the
//! `single-gpu` template the request names, `west` only another one (`multiple-gpus`). A
//! Karmada `MaxAvailableReplicas` request carrying the reference gets 8 for east and 0 for
//! west; the native HTTP estimate of the real pod without its template says why west is 0.
//! The fixtures come from `shared/fixtures/real` in the nearest ancestor (skipped with a
//! message when absent, failed when `CI` is set). Every wait is bounded; processes are
//! killed when the test ends, pass or fail.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    OPEN_API, Replicas, http_json, karmada_client, try_http_json, wait_for, write_node_cluster,
};
use dramesh_api::query::{ReplicaQuery, ReplicaRequirements, WireStyle};
use dramesh_estimator::ClaimRef;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};

const NODE: &str = "dra-example-driver-cluster-worker";
const NS: &str = "basic-resourceclaimtemplate";

/// A member cluster folder: the kind worker Node, its real slice and DeviceClass, and the
/// real manifest file `templates` (ResourceClaimTemplate, Namespace and Pods, as the example
/// ships them).
fn cluster_folder(dir: &Path, real: &Path, templates: &str) {
    write_node_cluster(dir, NODE);
    for (from, to) in [
        ("resourceslice-kind-worker-gpu-profile.yaml", "slices.yaml"),
        ("helm/deviceclass-gpu.rendered.yaml", "classes.yaml"),
        (templates, "templates.yaml"),
    ] {
        std::fs::copy(real.join(from), dir.join(to)).expect("copy fixture");
    }
}

fn query(cluster: &str) -> ReplicaQuery {
    ReplicaQuery {
        cluster: cluster.into(),
        requirements: ReplicaRequirements {
            resource_request: [("cpu".to_string(), Quantity("500m".into()))]
                .into_iter()
                .collect(),
            namespace: NS.into(),
            claim_refs: vec![ClaimRef::Template {
                pod_claim: "ref-0".into(),
                name: "single-gpu".into(),
            }],
            ..ReplicaRequirements::default()
        },
        assumed_workloads: vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refs_resolve_against_each_clusters_published_templates() {
    let Some(real) = dramesh_testkit::fixtures("real/dra-example-driver") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let mut r = Replicas::start(tmp, &["r1"], &["east", "west"], OPEN_API);
    cluster_folder(
        &r.fleet.join("east"),
        &real,
        "demo-examples/basic-resourceclaimtemplate/basic-resourceclaimtemplate.yaml",
    );
    cluster_folder(
        &r.fleet.join("west"),
        &real,
        "demo-examples/basic-multiple-requests/basic-multiple-requests.yaml",
    );
    r.agent(tmp, "east");
    r.agent(tmp, "west");
    let grpc = r.at[0].grpc;
    let http = r.at[0].http;

    // Both clusters in the replica's view, then east's answer in (west's template was
    // published with its first batch).
    wait_for("both clusters", Duration::from_secs(60), || {
        let (code, v) = try_http_json(http, "GET", "/v1/status", None)?;
        (code == 200 && v["clusters"].as_array().map_or(0, Vec::len) == 2).then_some(())
    });
    let mut client = karmada_client(grpc).await;
    let until = Instant::now() + Duration::from_secs(60);
    let (east, west) = loop {
        let mut answer = async |cluster: &str| {
            client
                .max_available_replicas(query(cluster).to_proto(WireStyle::V119))
                .await
                .map(|r| r.into_inner().max_replicas)
                .ok()
        };
        let east = answer("east").await;
        if east == Some(8) {
            break (east, answer("west").await);
        }
        assert!(
            Instant::now() < until,
            "east never answered 8 (last {east:?})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(east, Some(8), "8 GPUs, one per replica (the cpu allows 16)");
    assert_eq!(
        west,
        Some(0),
        "west publishes templates, but not single-gpu"
    );

    // The native estimate of the real pod without its template: resolved per cluster, and
    // west's answer names what is missing.
    let pod = std::fs::read_to_string(
        real.join("demo-examples/basic-resourceclaimtemplate/basic-resourceclaimtemplate.yaml"),
    )
    .expect("fixture");
    let pod0 = pod
        .split("\n---\n")
        .find(|d| d.contains("kind: Pod") && d.contains("name: pod0"))
        .expect("pod0");
    let (code, v) = http_json(
        http,
        "POST",
        "/v1/estimate",
        Some(&json!({"workload": {"manifests": [pod0]}})),
    );
    assert_eq!(code, 200, "{v}");
    let by_name = |n: &str| -> Value {
        v["clusters"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == n))
            .cloned()
            .unwrap_or_else(|| panic!("no {n} in {v}"))
    };
    assert_eq!(by_name("east")["maxReplicas"], 8, "{v}");
    assert_eq!(by_name("west")["maxReplicas"], 0, "{v}");
    assert_eq!(
        by_name("west")["error"],
        format!("ResourceClaimTemplate {NS}/single-gpu not found in cluster west"),
        "{v}"
    );
}
