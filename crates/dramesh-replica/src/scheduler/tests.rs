//! The loop against the fake Karmada API server (real kube client, CRD schemas enforced)
//! with a replica state holding a small device fleet: c0 and c1, 2 nodes × 4 GPUs each.

use dramesh_fakeapi::FakeApi;
use dramesh_model::{ClusterObject, ObjectChange};
use dramesh_sim::typed::{FleetSpec, cluster_objects};
use serde_json::json;

use super::*;
use crate::karmada::KarmadaOptions;
use crate::reservation_table as resv;
use dramesh_scheduler::Binding;
use serde_json::Value;
use std::collections::HashSet;

mod preempt;
mod share;
mod slow;

const ME: &str = "dramesh-scheduler";
const NS: &str = "default";

fn state(id: &str) -> Arc<ReplicaState> {
    ReplicaState::in_memory(id)
}

/// Cluster `i` (named `c<i>`): 2 nodes of 4 GPUs, `used` GPUs of each in use.
fn objects(i: usize, used: usize) -> Vec<ClusterObject> {
    let spec = FleetSpec {
        clusters: 2,
        nodes_per_cluster: 2,
        gpus_per_node: 4,
        owners_per_cluster: 2,
        kubernetes_version: "1.35".into(),
    };
    let mut out = Vec::new();
    cluster_objects(&spec, i, &|_| used, |o| out.push(o));
    out
}

/// Publishes cluster `i` with `used` GPUs in use per node, deleting what an earlier
/// publication with `before` in use had and this one has not.
fn publish(state: &ReplicaState, i: usize, used: usize, before: Option<usize>) {
    let name = format!("c{i}");
    let now = objects(i, used);
    let keys: HashSet<_> = now.iter().map(ClusterObject::key).collect();
    let mut changes: Vec<(String, ObjectChange)> = now
        .iter()
        .map(|o| (name.clone(), ObjectChange::upsert(o)))
        .collect();
    for o in before.map(|b| objects(i, b)).unwrap_or_default() {
        if !keys.contains(&o.key()) {
            changes.push((name.clone(), ObjectChange::Delete { key: o.key() }));
        }
    }
    state.apply_changes(&changes);
}

use dramesh_sim::karmada_cluster as cluster;

fn deployment(name: &str) -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {
                "containers": [{"name": "main", "image": "x",
                    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}}}})
}

fn claim_template() -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": NS},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}}})
}

/// A binding for Deployment `name`, divided by available replicas over c0 and c1.
fn binding(name: &str, replicas: i64) -> Value {
    binding_for(name, replicas, ME)
}

/// [`binding`] for the scheduler named `scheduler`.
fn binding_for(name: &str, replicas: i64, scheduler: &str) -> Value {
    json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": format!("{name}-deployment"), "namespace": NS,
            "labels": {"propagationpolicy.karmada.io/permanent-id": "p-1"}},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": NS,
                "name": name, "uid": format!("uid-{name}")},
            "replicas": replicas,
            "schedulerName": scheduler,
            "placement": {"clusterAffinity": {"clusterNames": ["c0", "c1"]},
                "replicaScheduling": {"replicaSchedulingType": "Divided",
                    "replicaDivisionPreference": "Weighted",
                    "weightPreference": {"dynamicWeight": "AvailableReplicas"}}}}})
}

struct Running {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    metrics: SchedulerMetrics,
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(true);
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("the loop stops within 5 s")
            .expect("the loop did not panic");
    }

    fn count(&self, result: &str) -> u64 {
        self.metrics.bindings.get([result]).map_or(0, |c| c.get())
    }
}

fn start(fake: &FakeApi, state: Arc<ReplicaState>, settle: Duration) -> Running {
    start_as(fake, state, settle, ME, Confirm::default())
}

fn start_as(
    fake: &FakeApi,
    state: Arc<ReplicaState>,
    settle: Duration,
    name: &str,
    confirm: Confirm,
) -> Running {
    start_with(fake, state, settle, name, confirm, None)
}

/// [`start_as`] with the peers the loop shares the work with (`None`: alone).
fn start_with(
    fake: &FakeApi,
    state: Arc<ReplicaState>,
    settle: Duration,
    name: &str,
    confirm: Confirm,
    peers: Option<watch::Receiver<Peers>>,
) -> Running {
    let id = state.replica.clone();
    let client = Arc::new(KarmadaClient::new(
        fake.client(),
        KarmadaOptions::new(name, &id),
    ));
    let role = SchedulerRole {
        kubeconfig: PathBuf::new(),
        name: name.into(),
        settle,
        confirm,
        shard: true,
        members: 1,
        decider_nice: 0,
    };
    let metrics = SchedulerMetrics::register(&dramesh_telemetry::Metrics::new())
        .expect("metric names are free");
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(run(state, client, role, Some(metrics.clone()), peers, rx));
    Running {
        stop,
        task,
        metrics,
    }
}

/// The fake Karmada API server, or `None`, with the skip message, when
/// `../shared/fixtures/karmada/crds` is absent and writes cannot be validated.
async fn validating_fake() -> Option<FakeApi> {
    let fake = FakeApi::start().await;
    if !fake.validates_karmada_crds() {
        eprintln!("skipped: ../shared/fixtures/karmada/crds is absent, writes cannot be validated");
        return None;
    }
    Some(fake)
}

fn get_binding(fake: &FakeApi, name: &str) -> Value {
    fake.get("ResourceBinding", Some(NS), &format!("{name}-deployment"))
        .expect("binding exists")
}

/// Waits until the binding satisfies `ok`; panics with the last value after 20 s.
async fn wait_binding(
    fake: &FakeApi,
    name: &str,
    what: &str,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let b = get_binding(fake, name);
        if ok(&b) {
            return b;
        }
        assert!(Instant::now() < deadline, "{what}: binding is {b:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (at most 20 s) until `ok` holds: for what the loop does after its last binding
/// write (Events in the background, counting the outcome).
async fn wait_until(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// `spec.clusters` as (name, replicas), sorted.
fn targets(b: &Value) -> Vec<(String, i64)> {
    let mut v: Vec<(String, i64)> = b["spec"]["clusters"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| {
                    (
                        t["name"].as_str().unwrap_or("").to_string(),
                        t["replicas"].as_i64().unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn scheduled(b: &Value) -> Option<&Value> {
    b["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Scheduled")
}

fn is_success_at_generation(b: &Value) -> bool {
    scheduled(b).is_some_and(|c| c["status"] == "True" && c["reason"] == "Success")
        && b["status"]["schedulerObservedGeneration"] == b["metadata"]["generation"]
}

fn setup(fake: &FakeApi) {
    fake.apply(cluster("c0", true));
    fake.apply(cluster("c1", true));
    fake.apply(claim_template());
}

#[tokio::test]
async fn bindings_land_where_devices_fit_keep_clusters_and_survive_conflicts() {
    let fake = FakeApi::start().await;
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    let st = state("r1");
    publish(&st, 0, 0, None); // c0: 8 free GPUs
    publish(&st, 1, 4, None); // c1: none free
    setup(&fake);
    fake.apply(deployment("llm"));
    fake.apply(binding("llm", 2));
    let running = start(&fake, st.clone(), Duration::from_millis(20));

    // Only c0 has GPUs: both replicas land there, with Karmada's status.
    let b = wait_binding(&fake, "llm", "first schedule", is_success_at_generation).await;
    assert_eq!(targets(&b), [("c0".to_string(), 2)]);
    assert!(
        b["metadata"]["annotations"]["policy.karmada.io/applied-placement"].is_string(),
        "{b:#}"
    );
    assert!(b["status"]["lastScheduledTime"].is_string(), "{b:#}");
    // The new replicas are held as this replica's reservation, created by the role.
    let held = st.reservation_list(false);
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!((held[0].cluster.as_str(), held[0].replicas), ("c0", 2));

    // Scale up with the next write conflicting: re-read, planned again, written; the
    // previous cluster keeps its replicas.
    fake.conflict_next_writes("ResourceBinding", Some(NS), "llm-deployment", 1);
    let mut scaled = get_binding(&fake, "llm");
    scaled["spec"]["replicas"] = json!(3);
    fake.apply(scaled);
    let b = wait_binding(&fake, "llm", "scale up", |b| {
        is_success_at_generation(b) && b["spec"]["replicas"] == 3
    })
    .await;
    assert_eq!(targets(&b), [("c0".to_string(), 3)]);
    let writes = fake.writes();
    let conflicts = writes
        .iter()
        .filter(|w| w.kind == "ResourceBinding" && w.code == 409)
        .count();
    // Only the forced one: the watch events of the loop's own intermediate writes are not
    // planned (they would write the observed generation over the status write after them).
    assert_eq!(conflicts, 1, "one conflicting write was answered");
    // Every binding write the fake accepted passed the CRD schema: none was refused.
    assert!(
        writes
            .iter()
            .filter(|w| w.kind == "ResourceBinding")
            .all(|w| w.code == 200 || w.code == 409),
        "{:?}",
        writes
            .iter()
            .filter(|w| w.code != 200)
            .map(|w| (&w.body, w.code))
            .collect::<Vec<_>>()
    );
    // Events on the binding and on the Deployment (written in the background).
    let succeeded = |kind: &str| {
        fake.list_objects("events.k8s.io/v1", "Event")
            .iter()
            .any(|e| e["regarding"]["kind"] == kind && e["reason"] == "ScheduleBindingSucceed")
    };
    wait_until("success Events on the binding and the Deployment", || {
        succeeded("ResourceBinding") && succeeded("Deployment")
    })
    .await;
    wait_until("two scheduled outcomes counted", || {
        running.count("scheduled") >= 2
    })
    .await;
    assert!(running.count("conflict") >= 1);

    // 3 of c0's 8 GPUs are held; 6 more fit nowhere: Unschedulable, the spec left alone.
    fake.apply(deployment("big"));
    fake.apply(binding("big", 6));
    let b = wait_binding(&fake, "big", "unschedulable", |b| {
        scheduled(b).is_some_and(|c| c["status"] == "False")
    })
    .await;
    let c = scheduled(&b).cloned().unwrap_or_default();
    assert_eq!(c["reason"], "Unschedulable", "{b:#}");
    assert!(targets(&b).is_empty(), "{b:#}");

    // c1's GPUs are freed: the view changed, so the binding is retried and lands.
    publish(&st, 1, 0, Some(4));
    let b = wait_binding(
        &fake,
        "big",
        "retried after the view changed",
        is_success_at_generation,
    )
    .await;
    let t = targets(&b);
    assert_eq!(t.iter().map(|(_, r)| r).sum::<i64>(), 6, "{t:?}");
    // c0 has 5 GPUs left after llm's 3, c1 8: neither exceeded.
    for (c, r) in &t {
        assert!(*r <= if c == "c0" { 5 } else { 8 }, "{t:?}");
    }
    running.stop().await;
}

#[tokio::test]
async fn a_cluster_turning_not_ready_moves_the_replicas() {
    let fake = FakeApi::start().await;
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    let st = state("r1");
    publish(&st, 0, 0, None);
    publish(&st, 1, 0, None);
    setup(&fake);
    fake.apply(deployment("llm"));
    // Aggregated: all replicas on one cluster (c0 and c1 tie; the name decides).
    let mut b = binding("llm", 4);
    b["spec"]["placement"]["replicaScheduling"] =
        json!({"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Aggregated"});
    fake.apply(b);
    let running = start(&fake, st.clone(), Duration::from_millis(20));
    let b = wait_binding(&fake, "llm", "first schedule", is_success_at_generation).await;
    let first = targets(&b);
    assert_eq!(first.len(), 1, "{first:?}");
    let (from, _) = first[0].clone();
    let to = if from == "c0" { "c1" } else { "c0" };

    fake.apply(cluster(&from, false));
    let b = wait_binding(&fake, "llm", "moved off the NotReady cluster", |b| {
        targets(b).iter().all(|(c, _)| c == to) && !targets(b).is_empty()
    })
    .await;
    assert_eq!(targets(&b), [(to.to_string(), 4)]);
    running.stop().await;
}

#[tokio::test]
async fn a_binding_that_fits_nowhere_is_no_cluster_fit() {
    let fake = FakeApi::start().await;
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    let st = state("r1");
    publish(&st, 0, 0, None);
    setup(&fake);
    fake.apply(deployment("llm"));
    // Only c9 is allowed, and Karmada does not know it.
    let mut b = binding("llm", 1);
    b["spec"]["placement"]["clusterAffinity"] = json!({"clusterNames": ["c9"]});
    fake.apply(b);
    let running = start(&fake, st, Duration::from_millis(20));
    let b = wait_binding(&fake, "llm", "no cluster fit", |b| scheduled(b).is_some()).await;
    let c = scheduled(&b).cloned().unwrap_or_default();
    assert_eq!(c["status"], "False", "{b:#}");
    assert_eq!(c["reason"], "NoClusterFit", "{b:#}");
    assert!(
        c["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("0/2 clusters are available")),
        "{c:#}"
    );
    wait_until("the unschedulable outcome counted", || {
        running.count("unschedulable") >= 1
    })
    .await;
    running.stop().await;
}

/// Delivers each state's own reservation document to the other state's reservation table
/// every `delay`, as the mesh would (without QUIC: the loop under test is the same).
fn bridge(
    a: Arc<ReplicaState>,
    b: Arc<ReplicaState>,
    delay: Duration,
) -> tokio::task::JoinHandle<()> {
    bridge_all(vec![a, b], delay)
}

/// [`bridge`] between every two of `states`.
fn bridge_all(states: Vec<Arc<ReplicaState>>, delay: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let pairs: Vec<(usize, usize)> = (0..states.len())
            .flat_map(|i| {
                (0..states.len())
                    .filter(move |j| *j != i)
                    .map(move |j| (i, j))
            })
            .collect();
        let mut seen: Vec<HashMap<String, Arc<[u8]>>> = vec![HashMap::new(); pairs.len()];
        loop {
            tokio::time::sleep(delay).await;
            for (i, (from, to)) in pairs
                .iter()
                .map(|(f, t)| (&states[*f], &states[*t]))
                .enumerate()
            {
                // The sender's store holds its own document only (what it receives goes to
                // its table).
                let now: HashMap<String, Arc<[u8]>> = from
                    .with_store(|s| s.store().snapshot())
                    .into_iter()
                    .filter(|(c, _)| resv::is_scope(c))
                    .filter_map(|(_, ch)| match ch {
                        ObjectChange::Upsert { key, json } => Some((key.name.clone(), json)),
                        ObjectChange::Delete { .. } => None,
                    })
                    .collect();
                let mut changes = Vec::new();
                for (id, json) in &now {
                    if seen[i].get(id) != Some(json) {
                        changes.push((
                            resv::doc_id(&from.replica).cluster.clone(),
                            ObjectChange::Upsert {
                                key: resv::record_key(id),
                                json: json.clone(),
                            },
                        ));
                    }
                }
                for id in seen[i].keys().filter(|id| !now.contains_key(*id)) {
                    changes.push((
                        resv::doc_id(&from.replica).cluster.clone(),
                        ObjectChange::Delete {
                            key: resv::record_key(id),
                        },
                    ));
                }
                to.apply_changes(&changes);
                seen[i] = now;
            }
        }
    })
}

#[tokio::test]
async fn nothing_is_decided_before_the_clusters_are_listed() {
    let fake = FakeApi::start().await;
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    let st = state("r1");
    publish(&st, 0, 0, None);
    publish(&st, 1, 0, None);
    setup(&fake);
    fake.apply(deployment("early"));
    fake.apply(binding("early", 1));
    // The bindings are listed long before the clusters.
    fake.delay_lists("Cluster", Duration::from_millis(800));
    let running = start(&fake, st, Duration::from_millis(20));
    wait_binding(&fake, "early", "scheduled", is_success_at_generation).await;
    let verdicts: Vec<Value> = fake
        .writes()
        .into_iter()
        .filter(|w| w.name == "early-deployment" && w.subresource.as_deref() == Some("status"))
        .map(|w| w.body["status"]["conditions"][0]["reason"].clone())
        .collect();
    assert_eq!(verdicts, [json!("Success")], "{verdicts:?}");
    running.stop().await;
}

#[tokio::test]
async fn two_replicas_confirming_before_writing_never_bind_more_than_fit() {
    compete(Confirm::BeforeWrite).await;
}

#[tokio::test]
async fn two_replicas_writing_first_take_back_what_does_not_fit_within_the_settle_window() {
    compete(Confirm::AfterWrite).await;
}

/// Two replicas compete for c0's 8 GPUs. Before-write: never more bound than fits.
/// After-write: more may be bound, for at most about one settle window; either way it
/// settles to what fits and stays there.
async fn compete(confirm: Confirm) {
    let fake = FakeApi::start().await;
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    let (a, b) = (state("ra"), state("rb"));
    for st in [&a, &b] {
        publish(st, 0, 0, None); // c0: 8 free GPUs
        publish(st, 1, 4, None); // c1: none
    }
    setup(&fake);
    // Four bindings of 5 GPU replicas: only one fits c0's 8 GPUs. Each replica schedules
    // two of them (by scheduler name), so the two decide different bindings at the same
    // time on views that both show 8 free GPUs: the race the reservations must resolve.
    let names: Vec<String> = (0..4).map(|i| format!("job{i}")).collect();
    const OTHER: &str = "dramesh-scheduler-b";
    for (i, n) in names.iter().enumerate() {
        fake.apply(deployment(n));
        let mut b = binding_for(n, 5, if i % 2 == 0 { ME } else { OTHER });
        b["spec"]["placement"]["replicaScheduling"] = json!({"replicaSchedulingType": "Divided",
            "replicaDivisionPreference": "Aggregated"});
        fake.apply(b);
    }
    // Reservations travel in 200 ms, longer than the two loops' start and first decisions
    // take (so they race); a decision's reservations are checked 400 ms after it.
    let mesh = bridge(a.clone(), b.clone(), Duration::from_millis(200));
    let settle = Duration::from_millis(400);
    let (ra, rb) = (
        start_as(&fake, a.clone(), settle, ME, confirm),
        start_as(&fake, b.clone(), settle, OTHER, confirm),
    );
    let bound = |fake: &FakeApi| -> (i64, usize) {
        let mut on_c0 = 0;
        let mut decided = 0;
        for n in &names {
            let b = get_binding(fake, n);
            on_c0 += targets(&b)
                .iter()
                .filter(|(c, _)| c == "c0")
                .map(|(_, r)| r)
                .sum::<i64>();
            assert!(targets(&b).iter().all(|(c, _)| c == "c0"), "{b:#}");
            decided += usize::from(scheduled(&b).is_some());
        }
        (on_c0, decided)
    };
    // Sampled throughout: never more replicas bound on c0 than it has GPUs, or (writing
    // first) not for longer than the settle window plus the time to write the move.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut over_since: Option<Instant> = None;
    loop {
        let (on_c0, decided) = bound(&fake);
        if on_c0 > 8 {
            assert_eq!(
                confirm,
                Confirm::AfterWrite,
                "{on_c0} replicas bound on c0, which has 8 GPUs"
            );
            let since = *over_since.get_or_insert_with(Instant::now);
            assert!(
                since.elapsed() < settle + Duration::from_millis(1500),
                "{on_c0} replicas bound on c0, which has 8 GPUs, for {:?}",
                since.elapsed()
            );
        } else {
            over_since = None;
        }
        if decided == names.len() && on_c0 == 5 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not settled: {on_c0} bound, {decided} decided"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // Quiet for a while: still one binding of five.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(bound(&fake).0, 5);
    let success = names
        .iter()
        .filter(|n| is_success_at_generation(&get_binding(&fake, n)))
        .count();
    assert_eq!(success, 1);
    // The race happened and was resolved by the reservations, not avoided by timing.
    let lost = ra.count("reservation_lost") + rb.count("reservation_lost");
    assert!(
        lost >= 1,
        "no reservation was lost: the replicas did not race"
    );
    mesh.abort();
    ra.stop().await;
    rb.stop().await;
}

#[tokio::test]
async fn a_cluster_resource_binding_of_a_non_workload_goes_to_every_matching_cluster() {
    let fake = FakeApi::start().await;
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    let st = state("r1");
    publish(&st, 0, 4, None);
    publish(&st, 1, 4, None);
    setup(&fake);
    fake.apply(cluster("c2", true));
    fake.apply(
        json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ClusterResourceBinding",
        "metadata": {"name": "ml-namespace",
            "labels": {"clusterpropagationpolicy.karmada.io/permanent-id": "cp-1"}},
        "spec": {
            "resource": {"apiVersion": "v1", "kind": "Namespace", "name": "ml", "uid": "uid-ml"},
            "schedulerName": ME,
            "placement": {"clusterAffinity": {"clusterNames": ["c0", "c1"]}}}}),
    );
    let running = start(&fake, st.clone(), Duration::from_millis(20));
    let deadline = Instant::now() + Duration::from_secs(20);
    let b = loop {
        let b = fake
            .get("ClusterResourceBinding", None, "ml-namespace")
            .expect("binding exists");
        if is_success_at_generation(&b) {
            break b;
        }
        assert!(Instant::now() < deadline, "not scheduled: {b:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Full GPUs do not matter to a Namespace; c2 is not in the affinity.
    let names: Vec<String> = targets(&b).into_iter().map(|(c, _)| c).collect();
    assert_eq!(names, ["c0", "c1"], "{b:#}");
    // Nothing to hold: no reservation was written.
    assert!(st.reservation_list(true).is_empty());
    running.stop().await;
}

#[tokio::test]
async fn a_stale_verdict_is_not_written_over_a_newer_decision() {
    let fake = FakeApi::start().await;
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    // No free GPU on this replica's view: its verdict is Unschedulable (a status write only).
    let st = state("r1");
    publish(&st, 0, 4, None);
    publish(&st, 1, 4, None);
    setup(&fake);
    fake.apply(deployment("llm"));
    let b = binding("llm", 2);
    fake.apply(b.clone());
    // Another replica, which saw c1 free, writes its decision just before ours arrives.
    let placement = Binding::from_value(BindingKind::ResourceBinding, &b)
        .expect("binding decodes")
        .placement
        .to_go_json();
    let mut theirs = b;
    theirs["metadata"]["annotations"][dramesh_scheduler::object::APPLIED_PLACEMENT] =
        json!(placement);
    theirs["spec"]["clusters"] = json!([{"name": "c1", "replicas": 2}]);
    theirs["status"] = json!({"schedulerObservedGeneration": 2, "lastScheduledTime": "2026-11-25T12:00:00Z",
        "conditions": [{"type": "Scheduled", "status": "True", "reason": "Success",
            "message": "Binding has been scheduled successfully.", "lastTransitionTime": "2026-11-25T12:00:00Z"}]});
    fake.apply_before_next_write(theirs);
    let running = start(&fake, st, Duration::from_millis(20));

    // Our status write meets the newer version (409); the binding moved on, so the loop
    // plans again on it (nothing to do) instead of recomputing its stale verdict on top.
    wait_binding(&fake, "llm", "our write answered 409", |_| {
        fake.writes()
            .iter()
            .any(|w| w.kind == "ResourceBinding" && w.code == 409)
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while running.count("unchanged") + running.count("unschedulable") == 0 {
        assert!(
            Instant::now() < deadline,
            "the loop did not finish the binding"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b = get_binding(&fake, "llm");
    assert!(is_success_at_generation(&b), "{b:#}");
    assert_eq!(targets(&b), [("c1".to_string(), 2)]);
    assert_eq!(running.count("unschedulable"), 0);
    running.stop().await;
}

/// The pod's claims are resolved in each member cluster: c0's agent publishes its own
/// `one-gpu` (two GPUs per replica), c1's publishes no templates, so Karmada's (one GPU) is
/// used there. The reservations held carry the same rule, so they deduct two GPUs per
/// replica on c0 as well.
#[tokio::test]
async fn claim_templates_come_from_the_member_cluster_and_karmada_where_it_has_none() {
    let Some(fake) = validating_fake().await else {
        return;
    };
    let st = state("r1");
    publish(&st, 0, 0, None); // c0: 8 free GPUs
    publish(&st, 1, 0, None); // c1: 8 free GPUs
    let mut own = claim_template();
    own["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = json!(2);
    let own = ClusterObject::ResourceClaimTemplate(Arc::new(
        serde_json::from_value(own).expect("template"),
    ));
    st.apply_changes(&[("c0".to_string(), ObjectChange::upsert(&own))]);
    setup(&fake);
    fake.apply(deployment("llm"));
    // Karmada's template everywhere would make 8 + 8 available (6 and 6); c0's own: 4 + 8.
    fake.apply(binding("llm", 12));
    let running = start(&fake, st.clone(), Duration::from_millis(20));
    let b = wait_binding(&fake, "llm", "scheduled", is_success_at_generation).await;
    assert_eq!(
        targets(&b),
        [("c0".to_string(), 4), ("c1".to_string(), 8)],
        "{b:#}"
    );
    // Every GPU is held now, two per replica on c0: one more replica fits nowhere.
    fake.apply(deployment("more"));
    fake.apply(binding("more", 1));
    let b = wait_binding(&fake, "more", "unschedulable", |b| {
        scheduled(b).is_some_and(|c| c["status"] == "False")
    })
    .await;
    assert_eq!(
        scheduled(&b).cloned().unwrap_or_default()["reason"],
        "Unschedulable",
        "{b:#}"
    );
    running.stop().await;
}
