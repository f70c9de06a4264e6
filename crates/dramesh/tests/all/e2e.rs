//! End-to-end: separate `dramesh` processes on loopback.
//!
//! `dramesh certs`, three replicas and one folder agent per cluster of the simulated demo
//! fleet; waits for the replicas to converge (equal digests in `/v1/status`, every object in
//! `/v1/debug/objects`); checks that the Karmada gRPC answers and the native HTTP answers of
//! every replica equal `dramesh estimate --snapshot` on the same folder; then changes one
//! cluster's folder and measures how long until every replica answers the new value (must be
//! under 2 s); then writes pending pods of a Deployment into a cluster folder and checks
//! Karmada's `GetUnschedulableReplicas` on every replica. Also runs `dramesh demo` and checks
//! its three sections. Every wait is bounded;
//! processes are killed when the test ends, pass or fail.

use crate::common;

use std::collections::BTreeMap;
use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    BIN, Procs, ReplicaListen, WORKLOAD, http_json, karmada_client, make_certs, run_ok,
    spawn_folder_agent, spawn_replica, try_http_json, wait_exit, wait_for,
};
use dramesh_api::query::{ReplicaQuery, WireStyle};
use serde_json::{Value, json};

/// `dramesh estimate --snapshot` per cluster.
fn cli_estimate(snapshot: &Path, workload: &Path) -> BTreeMap<String, i64> {
    let out = run_ok(&[
        "estimate",
        "--snapshot",
        snapshot.to_str().expect("utf8"),
        "-w",
        workload.to_str().expect("utf8"),
        "-o",
        "json",
    ]);
    let v: Value = serde_json::from_str(&out).expect("json estimate");
    per_cluster(&v)
}

fn per_cluster(v: &Value) -> BTreeMap<String, i64> {
    v["clusters"]
        .as_array()
        .expect("clusters")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().expect("name").to_string(),
                c["maxReplicas"].as_i64().expect("maxReplicas"),
            )
        })
        .collect()
}

fn http_estimate(addr: SocketAddr) -> BTreeMap<String, i64> {
    let (status, v) = http_json(
        addr,
        "POST",
        "/v1/estimate",
        Some(&json!({"workload": {"manifests": [WORKLOAD]}})),
    );
    assert_eq!(status, 200, "{v}");
    per_cluster(&v)
}

fn karmada_query(cluster: &str) -> ReplicaQuery {
    common::karmada_dra_query(cluster, "demo", "gpu.nvidia.com", ("4", "16Gi"), vec![])
}

async fn karmada_estimate(addr: SocketAddr, clusters: &[String]) -> BTreeMap<String, i64> {
    let mut c = karmada_client(addr).await;
    let mut out = BTreeMap::new();
    for cluster in clusters {
        let r = c
            .max_available_replicas(karmada_query(cluster).to_proto(WireStyle::V119))
            .await
            .expect("karmada answer");
        out.insert(cluster.clone(), i64::from(r.into_inner().max_replicas));
    }
    out
}

/// `GetUnschedulableReplicas` for Deployment `demo/<name>` with a 60 s threshold.
async fn karmada_unschedulable(addr: SocketAddr, cluster: &str, name: &str) -> i32 {
    karmada_client(addr)
        .await
        .get_unschedulable_replicas(dramesh_api::proto::karmada::UnschedulableReplicasRequest {
            cluster: cluster.into(),
            resource: Some(dramesh_api::proto::karmada::ObjectReference {
                api_version: "apps/v1".into(),
                kind: "Deployment".into(),
                namespace: "demo".into(),
                name: name.into(),
            }),
            unschedulable_threshold: 60_000_000_000,
        })
        .await
        .expect("karmada answer")
        .into_inner()
        .unschedulable_replicas
}

fn status(addr: SocketAddr) -> Option<Value> {
    let (code, v) = try_http_json(addr, "GET", "/v1/status", None)?;
    (code == 200).then_some(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_converge_and_answer_like_the_cli() {
    let tmp = tempfile::tempdir().expect("tmp");
    let fleet = tmp.path().join("fleet");
    let mut expected_objects = BTreeMap::new();
    for spec in dramesh_sim::demo_fleet() {
        let c = dramesh_sim::generate(&spec);
        dramesh_sim::write_snapshot(&fleet, &c).expect("write fleet");
        expected_objects.insert(c.name.clone(), c.objects.len());
    }
    let clusters: Vec<String> = expected_objects.keys().cloned().collect();
    let workload = tmp.path().join("workload.yaml");
    std::fs::write(&workload, WORKLOAD).expect("workload");
    let certs = tmp.path().join("certs");
    let agents: Vec<String> = clusters.iter().map(|c| format!("{c}/_cluster")).collect();
    make_certs(&certs, &["r1", "r2", "r3"], &agents);

    let mut procs = Procs::default();
    let mut replicas: Vec<ReplicaListen> = Vec::new();
    for id in ["r1", "r2", "r3"] {
        let mut a = ReplicaListen::any();
        let seeds: Vec<SocketAddr> = replicas.first().map(|r| r.mesh).into_iter().collect();
        procs
            .0
            .push(spawn_replica(tmp.path(), &certs, id, &mut a, &seeds));
        replicas.push(a);
    }
    let meshes: Vec<SocketAddr> = replicas.iter().map(|r| r.mesh).collect();
    for c in &clusters {
        procs.0.push(spawn_folder_agent(
            c,
            &fleet.join(c),
            &tmp.path().join(format!("agent-{c}")),
            &certs,
            &meshes,
        ));
    }

    // Convergence: equal digests, every cluster with every object on every replica.
    let start = Instant::now();
    wait_for("replicas converge", Duration::from_secs(60), || {
        let statuses: Vec<Option<Value>> = replicas.iter().map(|r| status(r.http)).collect();
        let done = statuses.iter().all(Option::is_some) && {
            let s: Vec<&Value> = statuses.iter().flatten().collect();
            let same_digest = s.windows(2).all(|w| w[0]["digest"] == w[1]["digest"]);
            let all_clusters = s
                .iter()
                .all(|v| v["clusters"].as_array().map_or(0, Vec::len) == clusters.len());
            let complete = same_digest
                && all_clusters
                && replicas.iter().all(|r| {
                    expected_objects.iter().all(|(c, n)| {
                        let (code, v) = http_json(
                            r.http,
                            "GET",
                            &format!("/v1/debug/objects?cluster={c}"),
                            None,
                        );
                        code == 200 && v["objects"].as_object().map_or(0, |o| o.len()) == *n
                    })
                });
            complete && s.iter().all(|v| v["ready"] == true)
        };
        done.then_some(())
    });
    let converged = start.elapsed();
    eprintln!("e2e: converged in {:.2} s", converged.as_secs_f64());
    let per_obj: Vec<Value> = replicas
        .iter()
        .map(|r| {
            http_json(
                r.http,
                "GET",
                "/v1/debug/objects?cluster=us-east-train",
                None,
            )
            .1
        })
        .collect();
    assert!(
        per_obj.windows(2).all(|w| w[0] == w[1]),
        "object hashes differ"
    );
    let s = status(replicas[0].http).expect("status");
    let east = s["clusters"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["name"] == "us-east-train"))
        .expect("east status");
    assert_eq!(east["nodes"], 4);
    assert!(east["dataAgeSeconds"].as_f64().expect("age") < 60.0);
    let gpus = east["devices"]
        .as_array()
        .and_then(|d| d.iter().find(|c| c["class"] == "gpu.nvidia.com"))
        .expect("gpu class");
    assert_eq!(
        (gpus["devices"].as_u64(), gpus["allocated"].as_u64()),
        (Some(32), Some(16))
    );

    // Answers agree with the CLI on the same folder, over both APIs, on every replica.
    let want = cli_estimate(&fleet, &workload);
    assert_eq!(want.len(), 3);
    assert!(want["us-east-train"] > 0);
    // Per replica, the time from `since` until its HTTP answer equals `want`.
    let answer_times = |want: &BTreeMap<String, i64>, since: Instant, limit: Duration| {
        let mut done = vec![None; replicas.len()];
        while done.iter().any(Option::is_none) && since.elapsed() < limit {
            for (i, r) in replicas.iter().enumerate() {
                if done[i].is_none() && http_estimate(r.http) == *want {
                    done[i] = Some(since.elapsed());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        done
    };
    let first = answer_times(&want, Instant::now(), Duration::from_secs(10));
    assert!(
        first.iter().all(Option::is_some),
        "HTTP answers differ from the CLI: want {want:?}"
    );
    for r in &replicas {
        assert_eq!(
            karmada_estimate(r.grpc, &clusters).await,
            want,
            "Karmada gRPC"
        );
    }

    // A folder change reaches every replica's answer within 2 s: the pods of us-east-train
    // and their allocated claims go away, freeing their GPUs. The expected answer comes from
    // the CLI on a modified copy, computed before the live folder changes.
    let changed = tmp.path().join("fleet-changed");
    for spec in dramesh_sim::demo_fleet() {
        dramesh_sim::write_snapshot(&changed, &dramesh_sim::generate(&spec)).expect("copy");
    }
    for f in ["pods.yaml", "resourceclaims.yaml"] {
        std::fs::remove_file(changed.join("us-east-train").join(f)).expect("rm in copy");
    }
    let new_want = cli_estimate(&changed, &workload);
    assert_ne!(new_want, want, "the change must change the answer");
    let east_dir = fleet.join("us-east-train");
    let changed_at = Instant::now();
    std::fs::remove_file(east_dir.join("pods.yaml")).expect("rm pods");
    std::fs::remove_file(east_dir.join("resourceclaims.yaml")).expect("rm claims");
    let times: Vec<Duration> = answer_times(&new_want, changed_at, Duration::from_secs(10))
        .into_iter()
        .map(|t| t.expect("a replica never followed the folder change"))
        .collect();
    let worst = times.iter().copied().max().unwrap_or_default();
    eprintln!(
        "e2e: folder change visible on every replica after {worst:?} (per replica {times:?})"
    );
    assert!(
        worst < Duration::from_secs(2),
        "slowest replica took {worst:?}"
    );
    for r in &replicas {
        assert_eq!(karmada_estimate(r.grpc, &clusters).await, new_want);
    }

    // Pending pods written into a cluster folder reach GetUnschedulableReplicas: one of the
    // Deployment's pods has been unschedulable for 10 minutes, one for a moment; with a
    // 60 s threshold only the first counts, and an unrelated Deployment has none.
    let ago = |mins: i64| {
        (k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_mins(mins))
            .strftime("%Y-%m-%dT%H:%M:%SZ")
            .to_string()
    };
    let pending_pod = |name: &str, since: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: demo\n  labels: {{app: gpu-inference, pod-template-hash: 7c9d5f}}\n  ownerReferences:\n  - {{apiVersion: apps/v1, kind: ReplicaSet, name: gpu-inference-7c9d5f, uid: rs-1, controller: true}}\nspec:\n  containers:\n  - {{name: server, image: vllm, resources: {{requests: {{cpu: '4'}}}}}}\nstatus:\n  phase: Pending\n  conditions:\n  - {{type: PodScheduled, status: 'False', reason: Unschedulable, lastTransitionTime: '{since}'}}\n"
        )
    };
    std::fs::write(
        east_dir.join("pending.yaml"),
        format!(
            "{}---\n{}",
            pending_pod("gpu-inference-7c9d5f-old", &ago(10)),
            pending_pod("gpu-inference-7c9d5f-new", &ago(0))
        ),
    )
    .expect("write pending pods");
    for r in &replicas {
        let mut got = (-1, -1);
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            got = (
                karmada_unschedulable(r.grpc, "us-east-train", "gpu-inference").await,
                karmada_unschedulable(r.grpc, "us-east-train", "unrelated").await,
            );
            if got == (1, 0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            got,
            (1, 0),
            "GetUnschedulableReplicas (workload, unrelated)"
        );
    }

    // Graceful shutdown on SIGTERM.
    let r1 = &mut procs.0[0];
    let pid = r1.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill")
            .success()
    );
    let code = wait_exit(r1, Duration::from_secs(15)).expect("replica did not stop on SIGTERM");
    assert!(code.success(), "replica exit status {code}");
}

#[test]
fn demo_runs_and_prints_its_sections() {
    let mut child = Command::new(BIN)
        .arg("demo")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn demo");
    let t0 = Instant::now();
    let Some(status) = wait_exit(&mut child, Duration::from_secs(120)) else {
        let _ = child.kill();
        panic!("demo did not finish within 120 s");
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut s) = child.stdout.take() {
        s.read_to_string(&mut out).expect("stdout");
    }
    if let Some(mut s) = child.stderr.take() {
        s.read_to_string(&mut err).expect("stderr");
    }
    assert!(status.success(), "demo failed: {err}\n{out}");
    for section in [
        "== Estimates",
        "== Placement",
        "== Preemption",
        "gave identical answers",
        "converged after",
    ] {
        assert!(out.contains(section), "missing {section:?} in:\n{out}");
    }
    eprintln!(
        "demo (debug build) ran in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}
