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

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dramesh_api::proto::karmada_service::estimator_client::EstimatorClient;
use dramesh_api::query::{
    ClaimTemplate, DraRequirements, ReplicaQuery, ReplicaRequirements, WireStyle,
};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_dramesh");

const WORKLOAD: &str = r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: demo}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {deviceClassName: gpu.nvidia.com}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: gpu-inference, namespace: demo}
spec:
  replicas: 3
  selector: {matchLabels: {app: gpu-inference}}
  template:
    metadata: {labels: {app: gpu-inference}}
    spec:
      containers:
      - name: server
        image: vllm
        resources:
          requests: {cpu: "4", memory: 16Gi}
          claims: [{name: gpu}]
      resourceClaims:
      - {name: gpu, resourceClaimTemplateName: one-gpu}
"#;

/// Kills every spawned process when dropped.
struct Procs(Vec<(String, Child)>);

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free tcp port")
}

fn udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("free udp port")
}

fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    try_http(addr, method, path, body).unwrap_or_else(|| panic!("{method} {path} on {addr} failed"))
}

/// A tiny HTTP/1.1 client (one request per connection); `None` when the server is not up.
fn try_http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, mut body) = text.split_once("\r\n\r\n")?;
    let status: u16 = head.split_whitespace().nth(1)?.parse().ok()?;
    let decoded;
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((len, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&after[..n]);
            rest = &after[n + 2..];
        }
        decoded = out;
        body = &decoded;
    }
    let v = serde_json::from_str(body).unwrap_or(Value::String(body.to_string()));
    Some((status, v))
}

struct ReplicaAddrs {
    mesh: SocketAddr,
    http: SocketAddr,
    grpc: SocketAddr,
}

fn run_ok(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().expect("run dramesh");
    assert!(
        out.status.success(),
        "dramesh {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

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
    let (status, v) = http(
        addr,
        "POST",
        "/v1/estimate",
        Some(&json!({"workload": {"manifests": [WORKLOAD]}})),
    );
    assert_eq!(status, 200, "{v}");
    per_cluster(&v)
}

fn karmada_query(cluster: &str) -> ReplicaQuery {
    let spec = serde_json::from_value(json!({
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}
    }))
    .expect("template spec");
    ReplicaQuery {
        cluster: cluster.into(),
        requirements: ReplicaRequirements {
            resource_request: [
                (
                    "cpu".to_string(),
                    k8s_openapi::apimachinery::pkg::api::resource::Quantity("4".into()),
                ),
                (
                    "memory".to_string(),
                    k8s_openapi::apimachinery::pkg::api::resource::Quantity("16Gi".into()),
                ),
            ]
            .into_iter()
            .collect(),
            namespace: "demo".into(),
            dra: DraRequirements {
                claim_templates: vec![ClaimTemplate {
                    pod_claim_name: "gpu".into(),
                    spec,
                }],
                shared_claims: vec![],
            },
            ..ReplicaRequirements::default()
        },
        assumed_workloads: vec![],
    }
}

async fn karmada_estimate(addr: SocketAddr, clusters: &[String]) -> BTreeMap<String, i64> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("grpc connect");
    let mut c = EstimatorClient::new(channel);
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
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("grpc connect");
    let mut c = EstimatorClient::new(channel);
    c.get_unschedulable_replicas(dramesh_api::proto::karmada::UnschedulableReplicasRequest {
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
    let (code, v) = try_http(addr, "GET", "/v1/status", None)?;
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
    let mut args = vec![
        "certs".to_string(),
        "--out".into(),
        certs.display().to_string(),
    ];
    for r in ["r1", "r2", "r3"] {
        args.extend(["--replica".to_string(), r.to_string()]);
    }
    for c in &clusters {
        args.extend(["--agent".to_string(), format!("{c}/folder")]);
    }
    run_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let cert = |stem: &str, ext: &str| certs.join(format!("{stem}.{ext}")).display().to_string();

    let mut procs = Procs(Vec::new());
    let mut replicas = Vec::new();
    for id in ["r1", "r2", "r3"] {
        let a = ReplicaAddrs {
            mesh: format!("127.0.0.1:{}", udp_port()).parse().expect("addr"),
            http: format!("127.0.0.1:{}", tcp_port()).parse().expect("addr"),
            grpc: format!("127.0.0.1:{}", tcp_port()).parse().expect("addr"),
        };
        let stem = format!("replica-{id}");
        let mut cmd = Command::new(BIN);
        cmd.args(["replica", "--id", id])
            .args(["--listen-mesh", &a.mesh.to_string()])
            .args(["--api", &a.http.to_string()])
            .args(["--grpc", &a.grpc.to_string()])
            .args(["--data-dir", &tmp.path().join(id).display().to_string()])
            .args(["--mesh-cert", &cert(&stem, "crt")])
            .args(["--mesh-key", &cert(&stem, "key")])
            .args(["--mesh-ca", &cert("ca", "crt")]);
        if let Some(first) = replicas.first() {
            let first: &ReplicaAddrs = first;
            cmd.args(["--seed", &first.mesh.to_string()]);
        }
        let child = cmd
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn replica");
        procs.0.push((id.to_string(), child));
        replicas.push(a);
    }
    for c in &clusters {
        let stem = format!("agent-{c}-folder");
        let mut cmd = Command::new(BIN);
        cmd.args(["agent", "--cluster", c, "--agent-name", "folder"])
            .args([
                "--source",
                "dir",
                "--dir",
                &fleet.join(c).display().to_string(),
            ])
            .args(["--listen", "127.0.0.1:0"])
            .args([
                "--data-dir",
                &tmp.path().join(format!("agent-{c}")).display().to_string(),
            ])
            .args(["--mesh-cert", &cert(&stem, "crt")])
            .args(["--mesh-key", &cert(&stem, "key")])
            .args(["--mesh-ca", &cert("ca", "crt")]);
        for r in &replicas {
            cmd.args(["--replica", &r.mesh.to_string()]);
        }
        let child = cmd
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn agent");
        procs.0.push((format!("agent {c}"), child));
    }

    // Convergence: equal digests, every cluster with every object on every replica.
    let start = Instant::now();
    let deadline = start + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "replicas did not converge within 60 s"
        );
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
                        let (code, v) = http(
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
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let converged = start.elapsed();
    eprintln!("e2e: converged in {:.2} s", converged.as_secs_f64());
    let per_obj: Vec<Value> = replicas
        .iter()
        .map(|r| {
            http(
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
    let wait_for = |want: &BTreeMap<String, i64>, since: Instant, limit: Duration| {
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
    let first = wait_for(&want, Instant::now(), Duration::from_secs(10));
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
    let times: Vec<Duration> = wait_for(&new_want, changed_at, Duration::from_secs(10))
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
    let (_, r1) = &mut procs.0[0];
    let pid = r1.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill")
            .success()
    );
    let t0 = Instant::now();
    let code = loop {
        if let Some(s) = r1.try_wait().expect("wait") {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "replica did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
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
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("demo did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
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
