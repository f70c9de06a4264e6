//! Acceptance tests of the scheduler role with separate `dramesh` processes, against the fake
//! Karmada API server of `dramesh-fakeapi` (which enforces Karmada's CRD schemas on every
//! binding write), with replicas started with `--karmada-kubeconfig` and folder agents:
//!
//! - two replicas, CPU-only clusters `big` (8 CPUs) and `small` (1 CPU): a binding naming
//!   `dramesh-scheduler` is patched to `big` only, with Karmada's status; Karmada's own
//!   scheduler name is left alone;
//! - three replicas and clusters whose devices differ (`dramesh-sim` A100 nodes with 8 and 8
//!   free GPUs, a T4 node whose GPUs the workload's CEL selector refuses, a node without
//!   devices): a DRA workload lands only where its devices fit, keeps its clusters on scale
//!   up, and leaves a cluster that turns NotReady; and 100 bindings competing for the last
//!   GPUs never get more replicas than the fleet has free GPUs.
//!
//! Every wait is bounded and names what it waited for; processes are killed when a test ends,
//! pass or fail.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, ReplicaListen, Replicas, TwoReplicas, status_names, wait_exit, wait_for};
use dramesh_fakeapi::FakeApi;
use dramesh_sim::{ClusterSpec, NodeGroup, NodeShape};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

fn cluster(name: &str) -> Value {
    dramesh_sim::karmada_cluster(name, true)
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
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
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
    let kubeconfig = write_kubeconfig(tmp, &fake);
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

/// A kubeconfig for `fake` written to `tmp/karmada.yaml`; returns its path.
fn write_kubeconfig(tmp: &Path, fake: &FakeApi) -> String {
    let kubeconfig = tmp.join("karmada.yaml");
    std::fs::write(&kubeconfig, fake.kubeconfig()).expect("kubeconfig");
    kubeconfig.display().to_string()
}

/// `dramesh replica` with the certificates under `tmp/certs`, its data in `tmp/data`, and
/// `extra` arguments.
fn replica_command(tmp: &std::path::Path, extra: &[&str]) -> Command {
    let certs = tmp.join("certs");
    let at = ReplicaListen::any();
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

// ---- Three replicas, clusters whose devices differ -------------------------------------

/// One A100 node, every GPU free.
const EAST: &str = "a100-east";
/// Two A100 nodes, half of each node's GPUs held by running pods.
const WEST: &str = "a100-west";
/// One T4 node: GPUs of the same class, refused by the workload's selector.
const T4: &str = "t4";
/// One node without devices.
const CPU_ONLY: &str = "cpu-only";
const FLEET: [&str; 4] = [EAST, WEST, T4, CPU_ONLY];

/// Free GPUs the workload's claim can use, per cluster (one GPU per replica): 8 on `EAST`,
/// 2 × 4 on `WEST`.
fn free_gpus(cluster: &str) -> i64 {
    match cluster {
        EAST | WEST => 8,
        _ => 0,
    }
}

/// The workload's claim: one `gpu.nvidia.com` device that is an A100.
const A100_SELECTOR: &str =
    "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-SXM4-40GB'";

/// Writes the member clusters' folders: `dramesh-sim` nodes with the NVIDIA driver's slices
/// and DeviceClasses (and, on `WEST`, running pods holding allocated claims), a plain node
/// for `CPU_ONLY`.
fn write_fleet(fleet: &Path) {
    let sim = |name: &str, shape: NodeShape, count: usize, used_fraction: f64| {
        let spec = ClusterSpec {
            name: name.into(),
            kubernetes_version: "1.36".into(),
            region: "us-east-1".into(),
            groups: vec![NodeGroup {
                shape,
                count,
                used_fraction,
            }],
        };
        dramesh_sim::write_snapshot(fleet, &dramesh_sim::generate(&spec)).expect("fleet");
    };
    sim(EAST, NodeShape::A100Efa, 1, 0.0);
    sim(WEST, NodeShape::A100Efa, 2, 0.5);
    sim(T4, NodeShape::T4, 1, 0.0);
    common::write_node_cluster(&fleet.join(CPU_ONLY), "plain");
}

/// The Karmada objects every scenario shares: the Clusters and the ResourceClaimTemplate.
fn apply_karmada_fleet(fake: &FakeApi) {
    for c in FLEET {
        fake.apply(cluster(c));
    }
    fake.apply(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "a100", "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.nvidia.com",
            "selectors": [{"cel": {"expression": A100_SELECTOR}}]}}]}}}}),
    );
}

/// A Deployment `name` of `replicas` pods with one A100 claim each, and its ResourceBinding
/// (`<name>`, scheduled by dramesh, Divided by available replicas over `clusters`).
fn apply_gpu_workload(fake: &FakeApi, name: &str, replicas: i64, clusters: &[&str]) {
    fake.apply(gpu_deployment(name, replicas));
    fake.apply(
        json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": name, "namespace": "default",
            "labels": {"propagationpolicy.karmada.io/permanent-id": "p-gpu"}},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "default",
                "name": name, "uid": format!("uid-{name}")},
            "replicas": replicas,
            "schedulerName": "dramesh-scheduler",
            "placement": {"clusterAffinity": {"clusterNames": clusters},
                "replicaScheduling": {"replicaSchedulingType": "Divided",
                    "replicaDivisionPreference": "Weighted",
                    "weightPreference": {"dynamicWeight": "AvailableReplicas"}}}}}),
    );
}

fn gpu_deployment(name: &str, replicas: i64) -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {
                "containers": [{"name": "main", "image": "x",
                    "resources": {"requests": {"cpu": "4", "memory": "16Gi"},
                        "claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "a100"}]}}}})
}

/// A merge patch of ResourceBinding `default/name` through the API server (which bumps
/// `metadata.generation` for a spec change), as a user or Karmada's detector would send it.
async fn patch_binding(fake: &FakeApi, name: &str, body: Value) {
    let gvk = GroupVersionKind::gvk("work.karmada.io", "v1alpha2", "ResourceBinding");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "resourcebindings");
    let api: Api<DynamicObject> = Api::namespaced_with(fake.client(), "default", &ar);
    api.patch(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap_or_else(|e| panic!("patch binding {name}: {e}"));
}

/// Sets the Ready condition of Cluster `name` (as karmada-controller-manager's cluster status
/// controller would).
fn set_ready(fake: &FakeApi, name: &str, ready: bool) {
    let mut c = fake.get("Cluster", None, name).expect("cluster");
    c["status"]["conditions"] = json!([{"type": "Ready",
        "status": if ready { "True" } else { "False" },
        "reason": if ready { "ClusterReady" } else { "ClusterNotReady" },
        "message": if ready { "cluster is healthy and ready to accept workloads" } else { "cluster is not reachable" },
        "lastTransitionTime": "2026-11-25T13:00:00Z"}]);
    fake.apply(c);
}

/// Three replicas with the scheduler role and an agent per cluster of the fleet; `None` (with
/// a message) when the CRD fixtures are absent.
struct Mesh {
    fake: FakeApi,
    /// Its processes are killed when the test ends.
    replicas: Replicas,
    _tmp: tempfile::TempDir,
}

impl Mesh {
    async fn start() -> Option<Mesh> {
        let fake = FakeApi::start().await;
        dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS)?;
        apply_karmada_fleet(&fake);
        let tmp = tempfile::tempdir().expect("tmp");
        let kubeconfig = write_kubeconfig(tmp.path(), &fake);
        let mut args = common::OPEN_API.to_vec();
        args.extend(["--karmada-kubeconfig", &kubeconfig]);
        let mut replicas = Replicas::start(tmp.path(), &["r1", "r2", "r3"], &FLEET, &args);
        write_fleet(&replicas.fleet);
        for c in FLEET {
            replicas.agent(tmp.path(), c);
        }
        // Every replica must see every cluster before a binding exists (a replica that had not
        // heard of a cluster yet would schedule around it), and be ready: caught up with a
        // peer replica, so the mesh carries reservations between them.
        for at in &replicas.at {
            common::wait_clusters_and_ready(at.http, FLEET.len()).await;
        }
        Some(Mesh {
            fake,
            replicas,
            _tmp: tmp,
        })
    }

    fn binding(&self, name: &str) -> Value {
        self.fake
            .get("ResourceBinding", Some("default"), name)
            .unwrap_or_else(|| panic!("binding {name} is gone"))
    }
}

/// How long no binding may change before it counts as settled: longer than the loop's settle
/// window (500 ms) plus a re-plan and its writes.
const QUIET: Duration = Duration::from_secs(4);

/// The binding's `Scheduled` condition.
fn scheduled(b: &Value) -> Option<&Value> {
    b["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Scheduled")
}

/// Whether the binding carries a decision for its current generation: success recorded for
/// this generation, or a failure with one of Karmada's "does not fit" reasons.
fn decided(b: &Value) -> bool {
    match scheduled(b) {
        Some(c) if c["status"] == "True" => {
            b["status"]["schedulerObservedGeneration"] == b["metadata"]["generation"]
        }
        Some(c) => c["reason"] == "Unschedulable" || c["reason"] == "NoClusterFit",
        None => false,
    }
}

/// Asserts the binding's `Scheduled` condition is a success.
fn assert_success(b: &Value) {
    assert_eq!(
        scheduled(b).map(|c| &c["reason"]),
        Some(&json!("Success")),
        "{b:#}"
    );
}

/// Asserts every cluster of `assigned` holds replicas (one A100 each), no more than its free
/// A100s (so none where the claim fits no device).
fn assert_within_free(what: &str, assigned: &BTreeMap<String, i64>) {
    for (c, n) in assigned {
        assert!(
            *n > 0 && *n <= free_gpus(c),
            "{what}: {n} replicas on {c}, whose free A100s are {}: {assigned:?}",
            free_gpus(c)
        );
    }
}

/// `spec.clusters` as cluster → replicas.
fn assigned(b: &Value) -> BTreeMap<String, i64> {
    b["spec"]["clusters"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            (
                t["name"].as_str().unwrap_or_default().to_string(),
                t["replicas"].as_i64().unwrap_or(0),
            )
        })
        .collect()
}

/// Waits (at most `limit`) until every binding of `names` is [`decided`], `done` holds for
/// them, and none changed for [`QUIET`]; returns them by name. Panics naming `what` and the
/// bindings not decided.
async fn settle(
    fake: &FakeApi,
    names: &[String],
    what: &str,
    limit: Duration,
    done: impl Fn(&BTreeMap<String, Value>) -> bool,
) -> BTreeMap<String, Value> {
    let deadline = Instant::now() + limit;
    let mut last: Option<(Vec<Value>, Instant)> = None;
    loop {
        let now: BTreeMap<String, Value> = names
            .iter()
            .map(|n| {
                let b = fake
                    .get("ResourceBinding", Some("default"), n)
                    .unwrap_or_else(|| panic!("binding {n} is gone"));
                (n.clone(), b)
            })
            .collect();
        let versions: Vec<Value> = now
            .values()
            .map(|b| b["metadata"]["resourceVersion"].clone())
            .collect();
        if now.values().all(decided) && done(&now) {
            match &last {
                Some((v, since)) if *v == versions => {
                    if since.elapsed() >= QUIET {
                        return now;
                    }
                }
                _ => last = Some((versions, Instant::now())),
            }
        } else {
            last = None;
        }
        if Instant::now() >= deadline {
            let open: Vec<String> = now
                .iter()
                .filter(|(_, b)| !decided(b))
                .take(5)
                .map(|(n, b)| format!("{n}: clusters {:?}, status {}", assigned(b), b["status"]))
                .collect();
            panic!(
                "timed out after {limit:?}: {what} (condition met: {}); {} of {} bindings undecided, e.g. {open:#?}; all: {:#?}",
                done(&now),
                now.values().filter(|b| !decided(b)).count(),
                names.len(),
                now.iter()
                    .map(|(n, b)| (n, assigned(b)))
                    .collect::<BTreeMap<_, _>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dra_workload_lands_where_its_devices_fit_keeps_its_clusters_and_leaves_a_not_ready_one()
{
    let Some(m) = Mesh::start().await else { return };
    // `train` may go anywhere; `misfit` only to clusters whose devices do not fit.
    apply_gpu_workload(&m.fake, "train", 3, &FLEET);
    apply_gpu_workload(&m.fake, "misfit", 1, &[T4, CPU_ONLY]);
    let names = ["train".to_string(), "misfit".to_string()];
    let limit = Duration::from_secs(60);
    let got = settle(&m.fake, &names, "train and misfit decided", limit, |_| true).await;

    let train = &got["train"];
    assert_success(train);
    let first = assigned(train);
    assert_eq!(first.values().sum::<i64>(), 3, "{train:#}");
    assert_within_free("train", &first);
    let misfit = &got["misfit"];
    let cond = scheduled(misfit).expect("condition");
    assert_eq!(cond["status"], "False", "{misfit:#}");
    assert!(assigned(misfit).is_empty(), "{misfit:#}");

    // Scale up as Karmada's detector does: the template and the binding's replicas; the API
    // server bumps the binding's generation.
    let before = m.binding("train")["metadata"]["generation"].as_i64();
    m.fake.apply(gpu_deployment("train", 6));
    patch_binding(&m.fake, "train", json!({"spec": {"replicas": 6}})).await;
    let generation = m.binding("train")["metadata"]["generation"].clone();
    assert!(
        generation.as_i64() > before,
        "the spec change bumps the generation: {before:?} -> {generation}"
    );
    let names = ["train".to_string()];
    let got = settle(&m.fake, &names, "train scaled to 6", limit, |b| {
        b["train"]["metadata"]["generation"].as_i64() >= generation.as_i64()
            && assigned(&b["train"]).values().sum::<i64>() == 6
    })
    .await;
    let train = &got["train"];
    assert_success(train);
    let scaled = assigned(train);
    for (c, n) in &first {
        assert!(
            scaled.get(c).is_some_and(|s| s >= n),
            "scale up moved replicas away from {c}: {first:?} became {scaled:?}"
        );
    }
    assert_within_free("train scaled", &scaled);

    // The cluster holding most of `train` turns NotReady: its replicas move to the other
    // fitting cluster, which has room for all six.
    let (gone, _) = scaled
        .iter()
        .max_by_key(|(c, n)| (**n, c.as_str() == EAST))
        .expect("assigned somewhere");
    let gone = gone.clone();
    let other = if gone == EAST { WEST } else { EAST };
    set_ready(&m.fake, &gone, false);
    let got = settle(
        &m.fake,
        &names,
        &format!("train off NotReady {gone}"),
        limit,
        |b| !assigned(&b["train"]).contains_key(&gone),
    )
    .await;
    let train = &got["train"];
    assert_success(train);
    assert_eq!(
        assigned(train),
        BTreeMap::from([(other.to_string(), 6)]),
        "after {gone} turned NotReady: {train:#}"
    );
}

/// Three replicas write their decisions first and confirm them after the settle window: a
/// reservation that reaches another replica late loses there, and its binding's replicas are
/// placed again or taken off, so once settled no cluster holds more than it has GPUs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_scheduling_100_bindings_for_the_last_gpus_never_exceed_capacity() {
    let Some(m) = Mesh::start().await else { return };
    // 100 bindings of 1 or 2 replicas (150 GPUs) at once for the 16 free A100s.
    let names: Vec<String> = (0..100).map(|i| format!("job-{i:03}")).collect();
    for (i, n) in names.iter().enumerate() {
        apply_gpu_workload(&m.fake, n, 1 + (i as i64 % 2), &FLEET);
    }
    let got = settle(
        &m.fake,
        &names,
        "100 competing bindings decided",
        Duration::from_secs(120),
        |_| true,
    )
    .await;

    let mut per_cluster: BTreeMap<String, i64> = BTreeMap::new();
    let mut failed = 0;
    for (n, b) in &got {
        let cond = scheduled(b).expect("decided");
        let a = assigned(b);
        if cond["status"] == "True" {
            let want = b["spec"]["replicas"].as_i64().unwrap_or(0);
            assert_eq!(a.values().sum::<i64>(), want, "{n}: {b:#}");
        } else {
            failed += 1;
            assert!(a.is_empty(), "{n} failed but holds {a:?}: {b:#}");
            assert!(
                cond["message"].as_str().is_some_and(|m| !m.is_empty()),
                "{n} says not why: {cond:#}"
            );
        }
        for (c, r) in a {
            *per_cluster.entry(c).or_default() += r;
        }
    }
    for (c, r) in &per_cluster {
        if *r <= free_gpus(c) {
            continue;
        }
        // What each replica held, and who holds the cluster, to tell a lost race from a
        // miscount.
        let there: Vec<(&String, i64, &Value)> = got
            .iter()
            .filter_map(|(n, b)| Some((n, *assigned(b).get(c)?, &b["metadata"]["generation"])))
            .collect();
        let held: Vec<String> = m
            .replicas
            .at
            .iter()
            .map(|a| common::http(a.http, "GET", "/v1/reservations", None).1)
            .collect();
        panic!(
            "{r} replicas of one A100 each bound to {c}, which has {} free: {per_cluster:?}; \
             bindings there (name, replicas, generation): {there:?}; reservations per replica: {held:#?}",
            free_gpus(c)
        );
    }
    let total: i64 = per_cluster.values().sum();
    let free: i64 = FLEET.iter().map(|c| free_gpus(c)).sum();
    assert!(
        total * 4 >= free * 3,
        "only {total} of {free} free A100s assigned: {per_cluster:?}"
    );
    assert!(failed >= 100 - free as usize, "{failed} bindings failed");
}
