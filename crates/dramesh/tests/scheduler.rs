//! Acceptance test of the scheduler role with separate `dramesh` processes: two replicas
//! started with `--karmada-kubeconfig` (a kubeconfig file pointing at the fake Karmada API
//! server of `dramesh-fakeapi`, which enforces Karmada's CRD schemas) and folder agents for
//! `big` (a node with 8 CPUs) and `small` (a node with 1 CPU). A ResourceBinding naming
//! `dramesh-scheduler` for a Deployment of 2 replicas of 3 CPUs is patched to `big` only,
//! with Karmada's status; Karmada's own scheduler name is left alone. Every wait is bounded;
//! processes are killed when the test ends, pass or fail.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, ReplicaListen, TwoReplicas, status_names, wait_exit, wait_for};
use dramesh_fakeapi::FakeApi;
use serde_json::{Value, json};

fn cluster(name: &str) -> Value {
    json!({"apiVersion": "cluster.karmada.io/v1alpha1", "kind": "Cluster",
        "metadata": {"name": name, "labels": {"name": name}},
        "spec": {"syncMode": "Push"},
        "status": {"conditions": [{"type": "Ready", "status": "True",
            "reason": "", "message": "", "lastTransitionTime": "2026-11-25T12:00:00Z"}]}})
}

fn binding(name: &str, scheduler: &str) -> Value {
    json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": name, "namespace": "default",
            "labels": {"propagationpolicy.karmada.io/permanent-id": "p-1"}},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "default",
                "name": "web", "uid": "uid-web"},
            "replicas": 2,
            "schedulerName": scheduler,
            "placement": {"clusterAffinity": {"clusterNames": ["big", "small"]},
                "replicaScheduling": {"replicaSchedulingType": "Divided",
                    "replicaDivisionPreference": "Weighted",
                    "weightPreference": {"dynamicWeight": "AvailableReplicas"}}}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_the_scheduler_role_schedule_bindings_that_name_them() {
    let fake = FakeApi::start().await;
    if !fake.validates_karmada_crds() {
        eprintln!("skipped: ../shared/fixtures/karmada/crds is absent, writes cannot be validated");
        return;
    }
    fake.apply(cluster("big"));
    fake.apply(cluster("small"));
    fake.apply(json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                "containers": [{"name": "main", "image": "x",
                    "resources": {"requests": {"cpu": "3", "memory": "1Gi"}}}]}}}}));
    fake.apply(binding("web-deployment", "dramesh-scheduler"));
    fake.apply(binding("theirs", "default-scheduler"));

    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let kubeconfig = tmp.join("karmada.yaml");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: karmada\nclusters:\n- name: karmada\n  cluster:\n    server: {}\ncontexts:\n- name: karmada\n  context:\n    cluster: karmada\n    user: sched\nusers:\n- name: sched\n  user:\n    token: t\n",
            fake.url
        ),
    )
    .expect("kubeconfig");
    let kubeconfig = kubeconfig.display().to_string();
    let mut args = common::OPEN_API.to_vec();
    args.extend(["--karmada-kubeconfig", &kubeconfig]);
    let mut f = TwoReplicas::start(tmp, &["big", "small"], &args);
    // `small` gets a node of 1 CPU instead of the default 8.
    std::fs::write(
        f.fleet.join("small").join("node.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata: {name: n1}\nstatus:\n  allocatable: {cpu: \"1\", memory: 32Gi, pods: \"110\"}\n",
    )
    .expect("small node");
    let meshes = [f.r1.mesh, f.r2.mesh];
    f.agent(tmp, "big", &meshes, &[]);
    f.agent(tmp, "small", &meshes, &[]);
    let h1 = f.r1.http;
    tokio::task::spawn_blocking(move || {
        wait_for("both clusters", Duration::from_secs(60), || {
            status_names(h1, "clusters").filter(|c| c.len() == 2)
        })
    })
    .await
    .expect("wait");

    let deadline = Instant::now() + Duration::from_secs(60);
    let b = loop {
        let b = fake
            .get("ResourceBinding", Some("default"), "web-deployment")
            .expect("binding");
        let done = b["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Scheduled" && c["reason"] == "Success");
        if done {
            break b;
        }
        assert!(Instant::now() < deadline, "not scheduled: {b:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        b["spec"]["clusters"],
        json!([{"name": "big", "replicas": 2}]),
        "{b:#}"
    );
    assert_eq!(
        b["status"]["schedulerObservedGeneration"],
        b["metadata"]["generation"]
    );
    // Two replicas scheduled it; the resource-version precondition let one write win.
    let theirs = fake
        .get("ResourceBinding", Some("default"), "theirs")
        .expect("binding");
    assert!(theirs["spec"]["clusters"].is_null(), "{theirs:#}");
    assert!(theirs["status"].get("conditions").is_none(), "{theirs:#}");
    let scrape = common::http(h1, "GET", "/metrics", None).1;
    assert!(
        scrape.contains("dramesh_scheduler_bindings_total"),
        "no scheduler metrics on /metrics"
    );
}

/// `dramesh replica` with the certificates under `tmp/certs`, its data in `tmp/data`, and
/// `extra` arguments.
fn replica_command(tmp: &std::path::Path, extra: &[&str]) -> Command {
    let certs = tmp.join("certs");
    let at = ReplicaListen::free();
    let file = |f: &str| certs.join(f).display().to_string();
    let mut cmd = Command::new(BIN);
    cmd.args(["replica", "--id", "r1", "--api-insecure"])
        .args(common::OPEN_API)
        .args(["--listen-mesh", &at.mesh.to_string()])
        .args(["--api", &at.http.to_string()])
        .args(["--grpc", &at.grpc.to_string()])
        .args(["--data-dir", &tmp.join("data").display().to_string()])
        .args(["--mesh-cert", &file("replica-r1.crt")])
        .args(["--mesh-key", &file("replica-r1.key")])
        .args(["--mesh-ca", &file("ca.crt")])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

#[test]
fn the_scheduler_flags_are_checked_before_a_replica_starts() {
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    common::make_certs(&tmp.join("certs"), &["r1"], &[]);

    // An unreadable kubeconfig: the replica does not start, and says which file.
    let missing = tmp.join("no-such-karmada.yaml").display().to_string();
    let (status, stderr) = run_to_exit(replica_command(tmp, &["--karmada-kubeconfig", &missing]));
    assert!(
        status.is_some_and(|s| !s.success()),
        "the replica ran with a missing kubeconfig: {stderr}"
    );
    assert!(stderr.contains("no-such-karmada.yaml"), "{stderr}");

    // A scheduler name without a kubeconfig is refused by the argument parser.
    let (status, stderr) = run_to_exit(replica_command(tmp, &["--scheduler-name", "mine"]));
    assert!(status.is_some_and(|s| !s.success()), "{stderr}");
    assert!(stderr.contains("--karmada-kubeconfig"), "{stderr}");
}

/// Runs `cmd` for at most 30 s (killed then): its exit status, `None` if it was still
/// running, and its stderr.
fn run_to_exit(mut cmd: Command) -> (Option<std::process::ExitStatus>, String) {
    let mut child = cmd.spawn().expect("spawn dramesh");
    let status = wait_exit(&mut child, Duration::from_secs(30));
    if status.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().expect("stderr");
    (status, String::from_utf8_lossy(&out.stderr).into_owned())
}
