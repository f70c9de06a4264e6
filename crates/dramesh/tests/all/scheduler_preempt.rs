//! Acceptance test of binding preemption with separate `dramesh` processes: two replicas
//! with the scheduler role (the same scheduler name, both deciding every binding) against the
//! fake Karmada API server of `dramesh-fakeapi` (Karmada's CRD schemas enforced), and a folder
//! agent for `gpu`, one node of 4 DRA GPUs. The priority-0 binding `train` is scheduled there
//! and its 4 pods, each holding one GPU, appear. Then `llm` arrives, 4 GPU replicas at
//! priority 1000 with a PriorityClass that may preempt: `train` is evicted from `gpu` the way
//! Karmada's failover evicts, with Events on both, the room is held by a reservation, and once
//! `train`'s pods are gone from the folder `llm` lands on `gpu`. Every wait is bounded;
//! processes are killed when the test ends, pass or fail.

use crate::common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{TwoReplicas, status_names, try_http_json, wait_for};
use dramesh_fakeapi::FakeApi;
use dramesh_sim::typed::{CLASS, allocated_claim, gpu_class, gpu_pod, gpu_slice, node};
use serde_json::{Value, json};

const NS: &str = "default";

fn cluster(name: &str) -> Value {
    dramesh_sim::karmada_cluster(name, true)
}

/// Deployment `name` of GPU replicas, its pods of PriorityClass `class` when given.
fn deployment(name: &str, class: Option<&str>) -> Value {
    let mut d = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": 4, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {
                "containers": [{"name": "main", "image": "x",
                    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}}}});
    if let Some(c) = class {
        d["spec"]["template"]["spec"]["priorityClassName"] = json!(c);
    }
    d
}

/// The binding of Deployment `name`: 4 replicas, all on `gpu`.
fn binding(name: &str, priority: Option<i32>) -> Value {
    let mut b = json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": format!("{name}-deployment"), "namespace": NS,
            "labels": {"propagationpolicy.karmada.io/permanent-id": "p-1"}},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": NS,
                "name": name, "uid": format!("uid-{name}")},
            "replicas": 4,
            "schedulerName": "dramesh-scheduler",
            "placement": {"clusterAffinity": {"clusterNames": ["gpu"]},
                "replicaScheduling": {"replicaSchedulingType": "Divided",
                    "replicaDivisionPreference": "Aggregated"}}}});
    if let Some(p) = priority {
        b["spec"]["schedulePriority"] = json!({"priority": p});
    }
    b
}

fn get(fake: &FakeApi, name: &str) -> Value {
    fake.get("ResourceBinding", Some(NS), &format!("{name}-deployment"))
        .expect("binding exists")
}

/// Waits (60 s at most) until the binding of `name` satisfies `ok`.
async fn wait_binding(
    fake: &FakeApi,
    name: &str,
    what: &str,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let b = get(fake, name);
        if ok(&b) {
            return b;
        }
        assert!(Instant::now() < deadline, "{what}: binding is {b:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn condition(b: &Value) -> Value {
    b["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Scheduled")
        .cloned()
        .unwrap_or(Value::Null)
}

/// `train`'s 4 running pods on node `n0`, one allocated GPU claim each: (file, object).
fn train_pods() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for d in 0..4 {
        let claim = format!("train-gpu-{d}");
        let pod = gpu_pod(NS, &format!("train-p{d}"), "n0", "train", 0, &claim);
        let c = allocated_claim(NS, &claim, "n0", d);
        out.push((
            format!("pod-{d}.json"),
            serde_json::to_value(pod).expect("pod"),
        ));
        out.push((
            format!("claim-{d}.json"),
            serde_json::to_value(c).expect("claim"),
        ));
    }
    out
}

fn write_json(dir: &Path, file: &str, v: &Value) {
    std::fs::write(dir.join(file), v.to_string()).expect("write manifest");
}

/// `gpu`'s pod count on a replica's `/v1/status`.
fn pods_on_gpu(addr: SocketAddr) -> Option<u64> {
    let (code, v) = try_http_json(addr, "GET", "/v1/status", None)?;
    (code == 200).then_some(())?;
    v["clusters"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == "gpu")?["pods"]
        .as_u64()
}

fn events(fake: &FakeApi, binding: &str, reason: &str) -> usize {
    fake.list_objects("events.k8s.io/v1", "Event")
        .iter()
        .filter(|e| {
            e["regarding"]["kind"] == "ResourceBinding"
                && e["regarding"]["name"] == format!("{binding}-deployment")
                && e["reason"] == reason
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_priority_gpu_binding_evicts_a_lower_one_and_lands() {
    let fake = FakeApi::start().await;
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    fake.apply(cluster("gpu"));
    fake.apply(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": NS},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}}}}),
    );
    fake.apply(
        json!({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": "high"}, "value": 1000, "preemptionPolicy": "PreemptLowerPriority"}),
    );
    fake.apply(deployment("train", None));
    fake.apply(deployment("llm", Some("high")));
    fake.apply(binding("train", None));

    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let kubeconfig = common::write_karmada_kubeconfig(tmp, &fake.url);
    let mut args = common::OPEN_API.to_vec();
    args.extend(["--karmada-kubeconfig", &kubeconfig]);
    let mut f = TwoReplicas::start(tmp, &["gpu"], &args);
    let dir = f.fleet.join("gpu");
    // One node of 4 GPUs (instead of the default CPU node).
    let n0 = serde_json::to_value(node("n0", Default::default())).expect("node");
    write_json(&dir, "node.yaml", &n0);
    write_json(
        &dir,
        "class.json",
        &serde_json::to_value(gpu_class()).expect("class"),
    );
    let slice = serde_json::to_value(gpu_slice("n0", 4, "A100")).expect("slice");
    write_json(&dir, "slice.json", &slice);
    let meshes = [f.r1.mesh, f.r2.mesh];
    f.agent(tmp, "gpu", &meshes, &[]);
    let (h1, h2) = (f.r1.http, f.r2.http);
    tokio::task::spawn_blocking(move || {
        for h in [h1, h2] {
            wait_for("gpu on both replicas", Duration::from_secs(60), || {
                status_names(h, "clusters").filter(|c| c == &["gpu"])
            });
        }
    })
    .await
    .expect("wait");

    // train takes the 4 GPUs; its pods start.
    let b = wait_binding(&fake, "train", "train scheduled", |b| {
        condition(b)["reason"] == "Success"
    })
    .await;
    assert_eq!(
        b["spec"]["clusters"],
        json!([{"name": "gpu", "replicas": 4}]),
        "{b:#}"
    );
    let pods = train_pods();
    for (file, v) in &pods {
        write_json(&dir, file, v);
    }
    tokio::task::spawn_blocking(move || {
        for h in [h1, h2] {
            wait_for(
                "train's pods on both replicas",
                Duration::from_secs(60),
                || pods_on_gpu(h).filter(|n| *n == 4),
            );
        }
    })
    .await
    .expect("wait");

    // llm fits nowhere: train is evicted, the room held, llm waits.
    fake.apply(binding("llm", Some(1000)));
    let b = wait_binding(&fake, "llm", "preemption initiated", |b| {
        condition(b)["message"]
            .as_str()
            .is_some_and(|m| m.contains("waiting for them to leave it"))
    })
    .await;
    assert_eq!(condition(&b)["reason"], "Unschedulable", "{b:#}");
    assert!(
        b["spec"]["clusters"].as_array().is_none_or(Vec::is_empty),
        "{b:#}"
    );
    let t = wait_binding(&fake, "train", "train evicted", |t| {
        t["spec"]["gracefulEvictionTasks"].is_array()
    })
    .await;
    let tasks = t["spec"]["gracefulEvictionTasks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(tasks.len(), 1, "two replicas preempting evict once: {t:#}");
    assert_eq!(tasks[0]["fromCluster"], "gpu");
    assert_eq!(tasks[0]["reason"], "BindingPreempted");
    assert_eq!(tasks[0]["producer"], "Scheduler");
    assert!(
        t["spec"]["clusters"].as_array().is_none_or(Vec::is_empty),
        "{t:#}"
    );
    assert!(events(&fake, "train", "Preempted") >= 1);
    assert!(events(&fake, "llm", "PreemptionInitiated") >= 1);
    // The hold, as every replica lists it: all 4 replicas of llm at its priority.
    for h in [h1, h2] {
        let (code, v) = try_http_json(h, "GET", "/v1/reservations", None).expect("reservations");
        assert_eq!(code, 200, "{v}");
        let holds = v["reservations"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["workload"]["name"] == "llm" && r["priority"] == 1000)
            .filter(|r| r["cluster"] == "gpu" && r["replicas"] == 4)
            .count();
        assert!(holds >= 1, "no hold for llm on {h}: {v:#}");
    }

    // train's pods leave the member cluster: llm lands on gpu.
    for (file, _) in &pods {
        std::fs::remove_file(dir.join(file)).expect("remove manifest");
    }
    let b = wait_binding(&fake, "llm", "llm landed", |b| {
        condition(b)["reason"] == "Success"
    })
    .await;
    assert_eq!(
        b["spec"]["clusters"],
        json!([{"name": "gpu", "replicas": 4}]),
        "{b:#}"
    );
    assert_eq!(
        b["status"]["schedulerObservedGeneration"],
        b["metadata"]["generation"]
    );
    // Never more than gpu's 4 GPUs bound: train is not placed back.
    let t = get(&fake, "train");
    assert!(
        t["spec"]["clusters"].as_array().is_none_or(Vec::is_empty),
        "{t:#}"
    );
    // Every binding write the fake accepted passed the CRD schema.
    let refused: Vec<_> = fake
        .writes()
        .into_iter()
        .filter(|w| w.kind == "ResourceBinding" && w.code != 200 && w.code != 409)
        .map(|w| (w.name, w.code, w.body))
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
}
