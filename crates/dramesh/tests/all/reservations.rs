//! Acceptance test of replicated in-flight reservations, with separate `dramesh` processes.
//!
//! One member cluster `gpu` with exactly 8 free GPUs, published by a folder agent as DRA
//! devices: one node and a ResourceSlice of 8 devices of DeviceClass `gpu.nvidia.com`; every
//! workload asks one GPU per replica through a ResourceClaimTemplate, so reservations hold
//! devices, not an extended resource. Replicas r1 and r2 start without seeds, so they cannot see each other:
//! both reserve the last GPUs at the same moment (r1: 8 replicas × 1 GPU at priority 100;
//! r2: 6 replicas × 1 GPU at priority 200), and each accepts its own reservation as live —
//! a real overcommit. Then r3 starts with both as seeds and the mesh merges the documents.
//! Every replica must then report r2's reservation live and r1's conflicted with r2's as the
//! winner, and every replica's estimate of a 1-GPU workload must be 8 − 6 = 2 (the loser is
//! not deducted; deducting it too would give 0). Finally the owner r2 releases the winner and
//! every replica re-admits r1's reservation (estimate 0); r1 cannot release r2's reservation.
//! Every wait is bounded; processes are killed when the test ends, pass or fail.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{
    Procs, ReplicaListen, http_json, make_certs, spawn_folder_agent, spawn_replica, try_http_json,
    wait_for,
};
use serde_json::json;

const NODE: &str = r#"apiVersion: v1
kind: Node
metadata: {name: gpu-node-1, labels: {kubernetes.io/hostname: gpu-node-1}}
status:
  capacity: {cpu: "64", memory: 512Gi, pods: "110"}
  allocatable: {cpu: "64", memory: 512Gi, pods: "110"}
"#;

/// The DeviceClass and the node's 8 GPUs.
fn devices() -> String {
    let gpus: String = (0..8)
        .map(|i| format!("  - {{name: gpu-{i}, attributes: {{model: {{string: h100}}}}}}\n"))
        .collect();
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {{name: gpu.nvidia.com}}
spec:
  selectors:
  - cel: {{expression: "device.driver == 'gpu.nvidia.com'"}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {{name: gpu-node-1-gpus}}
spec:
  driver: gpu.nvidia.com
  nodeName: gpu-node-1
  pool: {{name: gpu-node-1, generation: 1, resourceSliceCount: 1}}
  devices:
{gpus}"#
    )
}

/// A Deployment whose replicas each claim one GPU through a ResourceClaimTemplate.
fn workload(name: &str) -> String {
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: one-gpu, namespace: ml}}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {{deviceClassName: gpu.nvidia.com}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: ml}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec:
      containers:
      - name: c
        image: trainer
        resources:
          requests: {{cpu: "1"}}
          claims: [{{name: gpu}}]
      resourceClaims:
      - {{name: gpu, resourceClaimTemplateName: one-gpu}}
"#
    )
}

fn gpu_estimate(addr: SocketAddr) -> Option<i64> {
    let (code, v) = try_http_json(
        addr,
        "POST",
        "/v1/estimate",
        Some(&json!({"workload": {"manifests": [workload("probe")]}, "clusters": ["gpu"]})),
    )?;
    (code == 200).then(|| v["clusters"][0]["maxReplicas"].as_i64())?
}

/// `(status, winner)` of every reservation a replica lists, by id.
fn listed(addr: SocketAddr) -> Option<Vec<(String, String, Option<String>)>> {
    let (code, v) = try_http_json(addr, "GET", "/v1/reservations", None)?;
    if code != 200 {
        return None;
    }
    Some(
        v["reservations"]
            .as_array()?
            .iter()
            .map(|r| {
                (
                    r["id"].as_str().unwrap_or_default().to_string(),
                    r["status"].as_str().unwrap_or_default().to_string(),
                    r["winner"].as_str().map(str::to_string),
                )
            })
            .collect(),
    )
}

#[test]
fn concurrent_reservations_resolve_identically_on_every_replica() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cluster_dir = tmp.path().join("fleet").join("gpu");
    std::fs::create_dir_all(&cluster_dir).expect("mkdir");
    std::fs::write(cluster_dir.join("nodes.yaml"), NODE).expect("node");
    std::fs::write(cluster_dir.join("devices.yaml"), devices()).expect("devices");
    let certs = tmp.path().join("certs");
    make_certs(&certs, &["r1", "r2", "r3"], &["gpu/_cluster".to_string()]);

    let ids = ["r1", "r2", "r3"];
    let mut replicas: Vec<ReplicaListen> = ids.iter().map(|_| ReplicaListen::any()).collect();
    let mut procs = Procs::default();
    // r1 and r2 cannot reach each other until r3 joins.
    for i in 0..2 {
        procs.0.push(spawn_replica(
            tmp.path(),
            &certs,
            ids[i],
            &mut replicas[i],
            &[],
        ));
    }
    let first_two: Vec<SocketAddr> = replicas[..2].iter().map(|r| r.mesh).collect();
    procs.0.push(spawn_folder_agent(
        "gpu",
        &cluster_dir,
        &tmp.path().join("agent"),
        &certs,
        &first_two,
    ));
    for r in &replicas[..2] {
        let n = wait_for("8 free GPUs on r1 and r2", Duration::from_secs(60), || {
            gpu_estimate(r.http).filter(|n| *n == 8)
        });
        assert_eq!(n, 8);
    }

    // Both reserve at the same moment, each unaware of the other.
    let reserve = |addr: SocketAddr, name: &'static str, replicas: i64, priority: i32| {
        std::thread::spawn(move || {
            http_json(
                addr,
                "POST",
                "/v1/reservations",
                Some(&json!({
                    "workload": {"manifests": [workload(name)]},
                    "cluster": "gpu",
                    "replicas": replicas,
                    "priority": priority,
                    "ttlSeconds": 600,
                })),
            )
        })
    };
    let a = reserve(replicas[0].http, "train-a", 8, 100);
    let b = reserve(replicas[1].http, "train-b", 6, 200);
    let (code_a, ra) = a.join().expect("r1 reserve");
    let (code_b, rb) = b.join().expect("r2 reserve");
    assert_eq!((code_a, code_b), (201, 201), "{ra} {rb}");
    let (id_a, id_b) = (
        ra["id"].as_str().expect("id").to_string(),
        rb["id"].as_str().expect("id").to_string(),
    );
    assert_eq!(ra["owner"], "r1");
    assert_eq!(rb["owner"], "r2");
    // Partitioned: both were admitted locally, so the capacity is overcommitted.
    assert_eq!(ra["status"], "live", "{ra}");
    assert_eq!(rb["status"], "live", "{rb}");
    assert_eq!(gpu_estimate(replicas[0].http), Some(0));
    assert_eq!(gpu_estimate(replicas[1].http), Some(2));

    // r3 joins with both as seeds; the mesh merges the reservation documents.
    let seeds = [replicas[0].mesh, replicas[1].mesh];
    procs.0.push(spawn_replica(
        tmp.path(),
        &certs,
        "r3",
        &mut replicas[2],
        &seeds,
    ));
    let t0 = Instant::now();
    let want = vec![
        (id_a.clone(), "conflicted".to_string(), Some(id_b.clone())),
        (id_b.clone(), "live".to_string(), None),
    ];
    for (i, r) in replicas.iter().enumerate() {
        wait_for(
            &format!("{} reports {id_b} winning over {id_a}", ids[i]),
            Duration::from_secs(60),
            || (listed(r.http)? == want).then_some(()),
        );
    }
    eprintln!(
        "reservations: all three replicas agree {:.2} s after r3 started",
        t0.elapsed().as_secs_f64()
    );
    for r in &replicas {
        let n = wait_for(
            "estimate deducts only the winner",
            Duration::from_secs(30),
            || gpu_estimate(r.http).filter(|n| *n == 2),
        );
        assert_eq!(n, 2);
        // The status report carries the same reservations.
        let (code, s) = http_json(r.http, "GET", "/v1/status", None);
        assert_eq!(code, 200);
        let statuses: Vec<(&str, &str)> = s["reservations"]
            .as_array()
            .expect("status reservations")
            .iter()
            .map(|x| {
                (
                    x["id"].as_str().unwrap_or(""),
                    x["status"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert_eq!(
            statuses,
            vec![(id_a.as_str(), "conflicted"), (id_b.as_str(), "live")]
        );
    }
    // The loser's owner is told through the API.
    let (code, mine) = http_json(
        replicas[0].http,
        "GET",
        &format!("/v1/reservations/{id_a}"),
        None,
    );
    assert_eq!(code, 200);
    assert_eq!(
        (
            mine["status"].as_str(),
            mine["winner"].as_str(),
            mine["remaining"].as_i64()
        ),
        (Some("conflicted"), Some(id_b.as_str()), Some(8))
    );

    // Only the owner releases; after r2 releases the winner, r1's reservation fits again.
    let (code, _) = http_json(
        replicas[0].http,
        "DELETE",
        &format!("/v1/reservations/{id_b}"),
        None,
    );
    assert_eq!(code, 400, "a non-owner must not release");
    let (code, released) = http_json(
        replicas[1].http,
        "DELETE",
        &format!("/v1/reservations/{id_b}"),
        None,
    );
    assert_eq!(
        (code, released["status"].as_str()),
        (200, Some("released")),
        "{released}"
    );
    for (i, r) in replicas.iter().enumerate() {
        wait_for(
            &format!("{} re-admits {id_a} after the release", ids[i]),
            Duration::from_secs(30),
            || {
                let l = listed(r.http)?;
                let a = l.iter().find(|(id, _, _)| *id == id_a)?;
                (a.1 == "live" && gpu_estimate(r.http)? == 0).then_some(())
            },
        );
    }
}
