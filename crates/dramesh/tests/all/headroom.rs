//! Scale-up headroom with separate `dramesh` processes: a folder agent publishes a member
//! cluster with the Karpenter NodePool, NodeClaims and p4d.24xlarge Node of tests/karpenter
//! (8 DRA GPUs on the node); replica r1 runs with `--estimate-autoscaler-headroom`, r2 without.
//! r1's native estimate reports the headroom beside what fits now, its Karmada answer adds
//! it, and placement counts it when asked; r2 answers what fits now and refuses
//! `useHeadroom`. Every wait is bounded; processes are killed when the test ends.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{
    OPEN_API, Procs, ReplicaListen, http_json, karmada_client, make_certs, spawn_folder_agent,
    spawn_replica_with, try_http_json, wait_for,
};
use dramesh_api::query::{ReplicaQuery, WireStyle};
use serde_json::{Value, json};

fn karpenter_fixture(file: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/karpenter"
    ))
    .join(file)
}

/// 8 GPUs on the p4d node of tests/karpenter/node-p4d.yaml, and their DeviceClass.
const DEVICES: &str = r#"apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.nvidia.com}
spec:
  selectors:
  - cel: {expression: device.driver == "gpu.nvidia.com"}
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: ip-192-168-153-160.ec2.internal-gpu}
spec:
  driver: gpu.nvidia.com
  nodeName: ip-192-168-153-160.ec2.internal
  pool: {name: ip-192-168-153-160.ec2.internal, generation: 1, resourceSliceCount: 1}
  devices:
  - {name: gpu-0, attributes: {productName: {string: NVIDIA A100-SXM4-40GB}}}
  - {name: gpu-1, attributes: {productName: {string: NVIDIA A100-SXM4-40GB}}}
  - {name: gpu-2, attributes: {productName: {string: NVIDIA A100-SXM4-40GB}}}
  - {name: gpu-3, attributes: {productName: {string: NVIDIA A100-SXM4-40GB}}}
  - {name: gpu-4, attributes: {productName: {string: NVIDIA A100-SXM4-40GB}}}
  - {name: gpu-5, attributes: {productName: {string: NVIDIA A100-SXM4-40GB}}}
  - {name: gpu-6, attributes: {productName: {string: NVIDIA A100-SXM4-40GB}}}
  - {name: gpu-7, attributes: {productName: {string: NVIDIA A100-SXM4-40GB}}}
"#;

/// A Deployment of one-GPU replicas tolerating the GPU pool's taint, with a policy.
const WORKLOAD: &str = r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: ml}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {deviceClassName: gpu.nvidia.com}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: infer, namespace: ml}
spec:
  replicas: 12
  selector: {matchLabels: {app: infer}}
  template:
    metadata: {labels: {app: infer}}
    spec:
      tolerations:
      - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
      containers:
      - name: server
        image: vllm
        resources:
          requests: {cpu: "4", memory: 32Gi}
          claims: [{name: gpu}]
      resourceClaims:
      - {name: gpu, resourceClaimTemplateName: one-gpu}
---
apiVersion: policy.karmada.io/v1alpha1
kind: PropagationPolicy
metadata: {name: infer, namespace: ml}
spec:
  resourceSelectors:
  - {apiVersion: apps/v1, kind: Deployment, name: infer}
  placement:
    replicaScheduling:
      replicaSchedulingType: Divided
      replicaDivisionPreference: Weighted
      weightPreference: {dynamicWeight: AvailableReplicas}
"#;

fn write_cluster(dir: &Path) {
    std::fs::create_dir_all(dir).expect("mkdir");
    for f in ["nodepool-gpu.yaml", "nodeclaims-gpu.yaml", "node-p4d.yaml"] {
        std::fs::copy(karpenter_fixture(f), dir.join(f)).expect("copy fixture");
    }
    std::fs::write(dir.join("devices.yaml"), DEVICES).expect("devices");
}

fn karmada_query() -> ReplicaQuery {
    let toleration = serde_json::from_value(
        json!({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}),
    )
    .expect("toleration");
    common::karmada_dra_query(
        "gpu",
        "ml",
        "gpu.nvidia.com",
        ("4", "32Gi"),
        vec![toleration],
    )
}

async fn karmada_answer(addr: std::net::SocketAddr) -> i32 {
    karmada_client(addr)
        .await
        .max_available_replicas(karmada_query().to_proto(WireStyle::V119))
        .await
        .expect("karmada answer")
        .into_inner()
        .max_replicas
}

fn estimate(addr: std::net::SocketAddr) -> Option<Value> {
    // Not up yet, or no cluster yet (400 naming none): ask again.
    let (code, v) = try_http_json(
        addr,
        "POST",
        "/v1/estimate",
        Some(&json!({"workload": {"manifests": [WORKLOAD]}})),
    )?;
    if code != 200 {
        return None;
    }
    let c = v["clusters"].as_array()?.first()?.clone();
    // Until the agent's NodePool has arrived there is nothing to count.
    (c["maxReplicas"] == 8).then_some(c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_headroom_counts_what_new_karpenter_nodes_could_hold() {
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let certs = tmp.join("certs");
    make_certs(&certs, &["r1", "r2"], &["gpu/_cluster".to_string()]);
    let (mut a1, mut a2) = (ReplicaListen::any(), ReplicaListen::any());
    let mut with_flag = OPEN_API.to_vec();
    with_flag.push("--estimate-autoscaler-headroom");
    let mut procs = Procs::default();
    procs.0.push(spawn_replica_with(
        tmp,
        &certs,
        "r1",
        &mut a1,
        &[],
        &with_flag,
    ));
    procs.0.push(spawn_replica_with(
        tmp,
        &certs,
        "r2",
        &mut a2,
        &[a1.mesh],
        OPEN_API,
    ));
    let folder = tmp.join("gpu");
    write_cluster(&folder);
    procs.0.push(spawn_folder_agent(
        "gpu",
        &folder,
        &tmp.join("agent"),
        &certs,
        &[a1.mesh, a2.mesh],
    ));

    // Now: the node's 8 GPUs. Headroom: nvidia.com/gpu limit 24, the p4d and the launching
    // p5 claims hold 8 each (capacity), so one more p4d (8 GPUs by its claim), 8 replicas.
    let c = wait_for("r1 estimates the cluster", Duration::from_secs(60), || {
        estimate(a1.http)
    });
    assert_eq!(c["headroomReplicas"], 8, "{c}");
    assert_eq!(
        c["limitedBy"], "devices; headroom: 8 (nodepool gpu-pool, p4d.24xlarge)",
        "{c}"
    );
    let c = wait_for("r2 estimates the cluster", Duration::from_secs(60), || {
        estimate(a2.http)
    });
    assert!(c.get("headroomReplicas").is_none(), "off by default: {c}");
    assert_eq!(c["limitedBy"], "devices", "{c}");

    // Karmada's MaxAvailableReplicas includes the headroom only with the flag.
    assert_eq!(karmada_answer(a1.grpc).await, 16);
    assert_eq!(karmada_answer(a2.grpc).await, 8);

    // Placement counts it only when asked, and only where the replica counts headroom.
    let place = |addr, use_headroom: bool| {
        http_json(
            addr,
            "POST",
            "/v1/place",
            Some(&json!({"workload": {"manifests": [WORKLOAD]}, "useHeadroom": use_headroom})),
        )
    };
    let (code, v) = place(a1.http, false);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["available"]["gpu"], 8, "{v}");
    assert!(v["unschedulable"].is_string(), "12 do not fit on 8: {v}");
    let (code, v) = place(a1.http, true);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["available"]["gpu"], 16, "{v}");
    assert_eq!(v["clusters"][0]["replicas"], 12, "{v}");
    let (code, v) = place(a2.http, true);
    assert_eq!(code, 400, "{v}");
    assert!(
        v.to_string().contains("--estimate-autoscaler-headroom"),
        "{v}"
    );
}
