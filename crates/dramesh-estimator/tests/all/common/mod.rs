//! Builders shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::sync::Arc;

use dramesh_estimator::{View, Workload};
use dramesh_model::ClusterObject;
use serde_json::{Value, json};

pub fn node(name: &str, cpu: &str, mem: &str, pods: i64, extra: Value) -> ClusterObject {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {}},
        "spec": {},
        "status": {"allocatable": {"cpu": cpu, "memory": mem, "pods": pods.to_string(), "ephemeral-storage": "100Gi"}}
    });
    merge(&mut v, extra);
    ClusterObject::Node(Arc::new(serde_json::from_value(v).unwrap()))
}

pub fn pod(ns: &str, name: &str, node: &str, cpu: &str, mem: &str, extra: Value) -> ClusterObject {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": mem}}}]},
        "status": {"phase": "Running"}
    });
    merge(&mut v, extra);
    ClusterObject::Pod(Arc::new(serde_json::from_value(v).unwrap()))
}

pub fn merge(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

pub fn workload(cpu: &str, mem: &str, replicas: i64, extra_spec: Value) -> Workload {
    let mut spec = json!({"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": mem}}}]});
    merge(&mut spec, extra_spec);
    Workload::from_pod_spec(
        "Deployment",
        "default",
        "w",
        replicas,
        serde_json::from_value(spec).unwrap(),
        &HashMap::new(),
    )
    .unwrap()
}

pub fn view_of(cluster: &str, objs: Vec<ClusterObject>) -> View {
    let mut v = View::new();
    for o in objs {
        v.apply_object(cluster, o).unwrap();
    }
    v
}

/// `shared/fixtures/real` in the nearest ancestor that has one, or `None` (with a message);
/// with `CI` set a missing folder fails the test (`dramesh_testkit::fixtures`).
pub fn real() -> Option<std::path::PathBuf> {
    dramesh_testkit::fixtures(dramesh_testkit::REAL)
}

/// Every manifest of `files`, in order.
pub fn manifests(files: &[std::path::PathBuf]) -> Vec<dramesh_model::Manifest> {
    dramesh_model::load::load_paths(files)
        .unwrap()
        .into_iter()
        .map(|l| l.manifest)
        .collect()
}

/// Applies every cluster object to `cluster`, returns the rest (ResourceClaimTemplates are
/// returned: these tests give them with the workload).
pub fn feed(
    view: &mut View,
    cluster: &str,
    ms: Vec<dramesh_model::Manifest>,
) -> Vec<dramesh_model::Manifest> {
    use dramesh_model::{ClusterObject, Manifest};
    let mut rest = Vec::new();
    for m in ms {
        match m {
            Manifest::Object(ClusterObject::ResourceClaimTemplate(_)) => rest.push(m),
            Manifest::Object(o) => view.apply_object(cluster, o).unwrap(),
            other => rest.push(other),
        }
    }
    rest
}

/// The allocated claim captured with the dranet AWS p4d example (`dir` is
/// `dranet/examples/aws_eks_examples/gpu-efa`: gpu-6 and the EFA on PCIe root a0). Its
/// `status.devices` conditions lack `lastTransitionTime`, which the typed decoder requires;
/// only `status.allocation` matters to estimates, so the device status is cut.
pub fn aws_allocated_claim(dir: &std::path::Path) -> Vec<dramesh_model::Manifest> {
    let claim_file = dir.join("resource-claim.yaml");
    let text = std::fs::read_to_string(&claim_file).unwrap();
    let cut = text
        .find("\n  devices:\n  - conditions")
        .unwrap_or(text.len());
    let claim = dramesh_model::load::load_str(&claim_file, &text[..cut]).unwrap();
    assert_eq!(claim.len(), 1);
    claim.into_iter().map(|l| l.manifest).collect()
}
