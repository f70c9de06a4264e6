//! Bindings scheduled per second by one replica's scheduler role, from the binding's watch
//! event to its written status, on the fleet: 100 clusters, each reported with
//! 1,000 nodes x 8 GPUs (0-4 in use per node), all Ready in Karmada.
//!
//! Everything runs in this process: the replica's state (reservations written to a store
//! in a temporary data directory, fsync included), its scheduler loop with the real kube
//! client, and the fake Karmada API server over loopback HTTP, which validates every
//! binding write against Karmada's CRD schemas when `../shared/fixtures/karmada/crds` is
//! present. Each binding is a Deployment of 4 replicas, each claiming one GPU through a
//! ResourceClaimTemplate, divided by available replicas; the loop reads the template and the
//! claim template, decides, reserves, then writes the spec and the status patch.
//!
//! Phases, each on fresh bindings:
//! - `warm`: 200 bindings (estimator caches built; not reported).
//! - `steady`: bindings created at `SCHED_RATE`/s (default 500) for `SCHED_SECS` (default
//!   10): achieved rate and per-binding latency (creation to the status write).
//! - `burst`: `SCHED_BURST` bindings (default 5,000) created at once: the drain rate.
//!
//! Each phase also reports CPU per binding by thread, and the deciding threads' figures from
//! their metrics (`dramesh_scheduler_decider_*`): how busy each was, and how long decisions
//! waited for it.
//!
//! `cargo bench -p dramesh-replica --bench scheduler`. `SCHED_FLEET=clusters,nodes` changes
//! the fleet (default `100,1000`). `SCHED_VIEW_RATE=n` (default 0) also applies `n` node
//! updates a second, round robin over the clusters, during the steady phase, as agents
//! publishing their nodes' status would (to every replica's view). `SCHED_VIEW_CHANGE` says
//! which: `labels` (default) relabels the first node of the cluster (a change estimates
//! count, which leaves every fit here as it was); `pods` starts or ends a one-GPU pod with
//! its allocated ResourceClaim on a node drawn at random (two objects, one update: room
//! taken or given back).
//!
//! `SCHED_REPLICAS=n` (default 1) runs `n` replicas sharing the work (`--scheduler-shard`):
//! `n` replica states, each with its own store in its own data directory and the whole
//! fleet in its view, and `n` scheduler loops, each with its own Karmada client and watches.
//! Their reservation documents (role records included) are copied between them every 5 ms
//! (`SCHED_COPY_MS`) by a thread of the bench (`bench-copy`): when a document's heads moved, the
//! keys changed since the heads copied last are read again (automerge's diff) and applied to
//! the other replicas' tables, as the store's change feed delivers them; the mesh pushes a
//! replica's writes at once, so arrivals come about as often. Its CPU time is reported apart.
//! All of it shares one process.
//!
//! `SCHED_CONFIRM=after-write|before-write|strict` (default after-write) sets every replica's
//! `--scheduler-confirm`; with `strict`, `--scheduler-members` is `SCHED_REPLICAS`, and the
//! replicas' ack records travel with their reservation documents through the same
//! copying (a confirmation's round trip is then two copies and an ack write).
//!
//! `SCHED_DECIDER_NICE` (default `dramesh_replica::DEFAULT_DECIDER_NICE`) is every replica's
//! `--scheduler-decider-nice`; each phase prints the nice value the deciding threads got (it
//! stays 0 without the privilege to lower it). The fake API server and the bench's driver
//! share the two cores with them, as the replica's own other threads would.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dramesh_fakeapi::FakeApi;
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_model::ObjectChange;
use dramesh_replica::Peers;
use dramesh_replica::karmada::{KarmadaClient, KarmadaOptions};
use dramesh_replica::{ReplicaState, SchedulerRole};
use dramesh_sim::typed::{FleetSpec, cluster_objects};
use dramesh_store::{DocId, RESERVATION_SCOPE};
use serde_json::{Value, json};

const NS: &str = "ml";
const SCHEDULER: &str = "dramesh-scheduler";

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn fleet() -> (usize, usize) {
    std::env::var("SCHED_FLEET")
        .ok()
        .and_then(|s| {
            let (c, n) = s.split_once(',')?;
            Some((c.trim().parse().ok()?, n.trim().parse().ok()?))
        })
        .unwrap_or((100, 1000))
}

fn cluster(name: &str, region: usize) -> Value {
    json!({"apiVersion": "cluster.karmada.io/v1alpha1", "kind": "Cluster",
        "metadata": {"name": name, "labels": {"fleet": "gpu"}},
        "spec": {"syncMode": "Push", "region": format!("region-{region}")},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "ClusterReady",
            "message": "cluster is healthy and ready to accept workloads",
            "lastTransitionTime": "2026-11-25T09:00:00Z"}],
            "apiEnablements": dramesh_sim::karmada_api_enablements()}})
}

fn deployment(name: &str) -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}")},
        "spec": {"replicas": 4, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {
                "containers": [{"name": "main", "image": "trainer",
                    "resources": {"requests": {"cpu": "1", "memory": "4Gi"}}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}}}})
}

fn binding(name: &str) -> Value {
    json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": format!("{name}-deployment"), "namespace": NS, "generation": 1,
            "labels": {"propagationpolicy.karmada.io/permanent-id": "bench"}},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": NS,
                "name": name, "uid": format!("uid-{name}")},
            "replicas": 4,
            "schedulerName": SCHEDULER,
            "placement": {"clusterAffinity": {"labelSelector": {"matchLabels": {"fleet": "gpu"}}},
                "replicaScheduling": {"replicaSchedulingType": "Divided",
                    "replicaDivisionPreference": "Weighted",
                    "weightPreference": {"dynamicWeight": "AvailableReplicas"}}}}})
}

/// The status writes of bindings, by binding name: when their `Scheduled` condition was
/// first written, and with which reason. Reads only the writes made since the last call.
#[derive(Default)]
struct Scheduled {
    seen: usize,
    at: HashMap<String, (Instant, String)>,
}

impl Scheduled {
    fn update(&mut self, fake: &FakeApi) -> &HashMap<String, (Instant, String)> {
        let new = fake.writes_from(self.seen);
        self.seen += new.len();
        for w in new {
            if w.kind != "ResourceBinding"
                || w.subresource.as_deref() != Some("status")
                || w.code >= 300
            {
                continue;
            }
            let Some(conds) = w
                .body
                .pointer("/status/conditions")
                .and_then(Value::as_array)
            else {
                continue;
            };
            let Some(reason) = conds
                .iter()
                .find(|c| c["type"] == "Scheduled")
                .and_then(|c| c["reason"].as_str())
            else {
                continue;
            };
            self.at
                .entry(w.name.clone())
                .or_insert((w.at, reason.to_string()));
        }
        &self.at
    }
}

struct Phase {
    created: HashMap<String, Instant>,
    started: Instant,
}

impl Phase {
    fn new() -> Phase {
        Phase {
            created: HashMap::new(),
            started: Instant::now(),
        }
    }

    fn create(&mut self, fake: &FakeApi, name: &str) {
        fake.apply(deployment(name));
        fake.apply(binding(name));
        self.created
            .insert(format!("{name}-deployment"), Instant::now());
    }

    /// Waits until every binding of the phase has a status (at most `limit`); returns the
    /// latencies, sorted, the time the last one took from the phase's start, and the
    /// reasons other than `Success`.
    async fn wait(
        &self,
        fake: &FakeApi,
        scheduled: &mut Scheduled,
        limit: Duration,
    ) -> (Vec<Duration>, Duration, Vec<String>) {
        let deadline = Instant::now() + limit;
        loop {
            let done = scheduled.update(fake);
            let ours: Vec<(&String, &(Instant, String))> = done
                .iter()
                .filter(|(n, _)| self.created.contains_key(*n))
                .collect();
            if ours.len() == self.created.len() {
                let mut lat: Vec<Duration> = ours
                    .iter()
                    .map(|(n, (at, _))| at.saturating_duration_since(self.created[*n]))
                    .collect();
                lat.sort();
                let last = ours
                    .iter()
                    .map(|(_, (at, _))| at.saturating_duration_since(self.started))
                    .max()
                    .unwrap_or_default();
                let failed = ours
                    .iter()
                    .filter(|(_, (_, r))| r != "Success")
                    .map(|(n, (_, r))| format!("{n}: {r}"))
                    .collect();
                return (lat, last, failed);
            }
            assert!(
                Instant::now() < deadline,
                "{} of {} bindings have a status after {limit:?}",
                ours.len(),
                self.created.len()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// The heads of a replica's own reservation document as last copied (its store holds no
/// other: what it receives goes to its table).
type Copied = Vec<[u8; 32]>;

/// Copies what changed in `from`'s reservation document since `last` into every state of
/// `to` (upserts and deletes, as the store's change feed delivers them): the keys changed
/// between the two heads (automerge's diff), each read again. Costs what changed, as the
/// mesh's incremental sync does, so the copying can run often.
fn copy_changes(from: &ReplicaState, to: &[&Arc<ReplicaState>], last: &mut Copied) {
    use automerge::{ChangeHash, Prop, patches::TextRepresentation};
    let doc = DocId::reservations(from.replica.clone());
    let key = |name: &str| {
        dramesh_model::ObjectKey::new(dramesh_model::ObjectKind::ClusterInfo, None, name)
    };
    let (heads, changes) = from.with_store(|s| {
        let store = s.store();
        let Some(am) = store.automerge_doc(&doc) else {
            return (Vec::new(), Vec::new());
        };
        let heads: Vec<[u8; 32]> = am.get_heads().iter().map(|h| h.0).collect();
        if heads == *last {
            return (heads, Vec::new());
        }
        let before: Vec<ChangeHash> = last.iter().map(|h| ChangeHash(*h)).collect();
        let after: Vec<ChangeHash> = heads.iter().map(|h| ChangeHash(*h)).collect();
        let mut names = std::collections::BTreeSet::new();
        for p in am.diff(&before, &after, TextRepresentation::Array) {
            let root = match (p.path.first(), &p.action) {
                (Some((_, Prop::Map(k))), _) => Some(k.clone()),
                (None, automerge::PatchAction::PutMap { key, .. })
                | (None, automerge::PatchAction::DeleteMap { key }) => Some(key.clone()),
                _ => None,
            };
            if let Some(name) = root.as_deref().and_then(|k| k.strip_prefix("meta/")) {
                names.insert(name.to_string());
            }
        }
        let changes: Vec<(String, ObjectChange)> = names
            .into_iter()
            .map(|name| {
                let k = key(&name);
                let change = match store.get(RESERVATION_SCOPE, &k) {
                    Some(json) => ObjectChange::Upsert { key: k, json },
                    None => ObjectChange::Delete { key: k },
                };
                (RESERVATION_SCOPE.to_string(), change)
            })
            .collect();
        (heads, changes)
    });
    if !changes.is_empty() {
        for st in to {
            st.apply_changes(&changes);
        }
    }
    *last = heads;
}

fn pct(lat: &[Duration], p: f64) -> f64 {
    let i = ((lat.len() as f64 * p).ceil() as usize).clamp(1, lat.len()) - 1;
    lat[i].as_secs_f64() * 1e3
}

/// CPU seconds (user + system) used so far, from /proc: the whole process and each thread name
/// (`comm`) summed. The replicas run on a runtime of their own (`replica-rt`), the fake API
/// server on another (`fakeapi`), the bench's document copying on `bench-copy`, so the
/// replicas' own cost is told apart from the simulated API server's and the bench's: a figure
/// that holds on a machine busy with other work, where rates and latencies do not.
fn cpu_seconds() -> (f64, HashMap<String, f64>) {
    fn ticks(stat: &str) -> Option<f64> {
        // Fields after the command name (which may hold spaces): utime is the 14th field.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let (u, s): (f64, f64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
        Some((u + s) / 100.0)
    }
    let process = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| ticks(&s))
        .unwrap_or(0.0);
    let mut by_name: HashMap<String, f64> = HashMap::new();
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for t in tasks.flatten() {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            let used = std::fs::read_to_string(t.path().join("stat"))
                .ok()
                .and_then(|s| ticks(&s))
                .unwrap_or(0.0);
            *by_name.entry(comm.trim().to_string()).or_default() += used;
        }
    }
    (process, by_name)
}

/// Threads that belong to the replicas: their runtime, the scheduler's deciding threads and
/// their stores' file writers.
fn is_replica_thread(name: &str) -> bool {
    name == "replica-rt" || name == "dramesh-decide" || name.starts_with("dramesh-store")
}

/// Prints the CPU time spent per binding since `since`: the whole process, the replicas (all of
/// them, and per replica: what one replica on a machine of its own would spend per binding of
/// the stream), the deciding threads, the fake API server, the bench's copying and the rest
/// (the bench's driver). Threads that ended since are not counted by name.
fn report_cpu(label: &str, n: usize, replicas: usize, since: &(f64, HashMap<String, f64>)) {
    let (p, names) = cpu_seconds();
    let delta = |pick: &dyn Fn(&str) -> bool| -> f64 {
        names
            .iter()
            .filter(|(k, _)| pick(k))
            .map(|(k, v)| v - since.1.get(k).copied().unwrap_or(0.0))
            .sum()
    };
    let per = |secs: f64| secs * 1e3 / n as f64;
    let replica = delta(&|k| is_replica_thread(k));
    let decide = delta(&|k| k == "dramesh-decide");
    let api = delta(&|k| k == "fakeapi");
    let copy = delta(&|k| k == "bench-copy");
    let all = p - since.0;
    println!(
        "{label}: CPU per binding {:.2} ms in all; replicas {:.2} ms ({:.2} ms per replica; {:.2} with the copying, which also applies the records to the other replicas' tables), of which deciding threads {:.2} ms; fake API server {:.2} ms; bench copying {:.2} ms; the rest (bench driver) {:.2} ms",
        per(all),
        per(replica),
        per(replica) / replicas as f64,
        per(replica + copy) / replicas as f64,
        per(decide),
        per(api),
        per(copy),
        per(all - replica - api - copy)
    );
}

/// The deciding threads' totals, summed over the replicas: decisions, seconds waited for the
/// thread, seconds it ran, and decisions that waited longer than 10 ms
/// (`dramesh_scheduler_decider_*`).
#[derive(Default, Clone, Copy)]
struct DeciderTotals {
    decisions: f64,
    waited: f64,
    ran: f64,
    over_10ms: f64,
    /// The deciding threads' nice value (the last replica's).
    nice: f64,
}

fn decider_totals(metrics: &[Arc<dramesh_telemetry::Metrics>]) -> DeciderTotals {
    let mut t = DeciderTotals::default();
    for m in metrics {
        let text = m.registry().render();
        let value = |prefix: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(prefix))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0.0)
        };
        const WAIT: &str = "dramesh_scheduler_decider_wait_seconds";
        let count = value(&format!("{WAIT}_count "));
        t.decisions += count;
        t.waited += value(&format!("{WAIT}_sum "));
        t.ran += value("dramesh_scheduler_decider_run_seconds_sum ");
        t.over_10ms += count - value(&format!("{WAIT}_bucket{{le=\"0.01\"}} "));
        t.nice = value("dramesh_scheduler_decider_nice ");
    }
    t
}

/// Prints how the deciding threads fared since `since`, over a phase of `secs`: how busy each
/// was (wall clock, so time waiting for a core counts), and how long decisions waited for it.
fn report_decider(
    label: &str,
    metrics: &[Arc<dramesh_telemetry::Metrics>],
    since: DeciderTotals,
    secs: f64,
) {
    let now = decider_totals(metrics);
    let n = now.decisions - since.decisions;
    if n <= 0.0 {
        return;
    }
    println!(
        "{label}: deciding thread (nice {}) busy {:.0} % of the phase (per replica); decisions waited for it {:.2} ms on average, {:.1} % of them over 10 ms; {:.2} ms per decision on it",
        now.nice,
        100.0 * (now.ran - since.ran) / secs / metrics.len() as f64,
        1e3 * (now.waited - since.waited) / n,
        100.0 * (now.over_10ms - since.over_10ms) / n,
        1e3 * (now.ran - since.ran) / n,
    );
}

/// Prints how many bindings got more than one accepted spec write (decided by two replicas).
fn spec_writes_per_binding(fake: &FakeApi) {
    let mut per: HashMap<String, usize> = HashMap::new();
    for w in fake.writes() {
        if w.kind == "ResourceBinding" && w.subresource.is_none() && w.code < 300 {
            *per.entry(w.name).or_default() += 1;
        }
    }
    let twice = per.values().filter(|n| **n > 1).count();
    let conflicts = fake
        .writes()
        .iter()
        .filter(|w| w.kind == "ResourceBinding" && w.code == 409)
        .count();
    println!(
        "spec writes: {} bindings written, {twice} more than once; {conflicts} conflicting binding writes",
        per.len()
    );
}

fn report(label: &str, n: usize, last: Duration, lat: &[Duration], failed: &[String]) {
    if lat.is_empty() {
        println!("{label}: no binding scheduled");
        return;
    }
    println!(
        "{label}: {n} bindings in {:.2} s = {:.0} bindings/s; latency p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        last.as_secs_f64(),
        n as f64 / last.as_secs_f64(),
        pct(lat, 0.50),
        pct(lat, 0.90),
        pct(lat, 0.99),
        pct(lat, 1.0),
    );
    if !failed.is_empty() {
        println!(
            "  {} not scheduled, e.g. {}",
            failed.len(),
            failed
                .iter()
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (clusters, nodes) = fleet();
    let rate: u64 = env("SCHED_RATE", 500);
    let secs: u64 = env("SCHED_SECS", 10);
    let burst: usize = env("SCHED_BURST", 5000);
    let _log = dramesh_telemetry::init(&dramesh_telemetry::TelemetryConfig {
        default_filter: "warn".into(),
        ..dramesh_telemetry::TelemetryConfig::new("scheduler-bench")
    })
    .expect("log");

    let replicas: usize = env("SCHED_REPLICAS", 1).max(1);
    let confirm: dramesh_replica::Confirm = std::env::var("SCHED_CONFIRM")
        .ok()
        .map(|c| c.parse().unwrap_or_else(|e| panic!("SCHED_CONFIRM: {e}")))
        .unwrap_or_default();
    let dirs: Vec<tempfile::TempDir> = (0..replicas)
        .map(|_| tempfile::tempdir().expect("temporary data directory"))
        .collect();
    let states: Vec<Arc<ReplicaState>> = dirs
        .iter()
        .enumerate()
        .map(|(i, dir)| {
            let id = if replicas == 1 {
                "bench".to_string()
            } else {
                format!("bench{i}")
            };
            let store = dramesh_mesh::daemon::open_store(Some(dir.path()), &id).expect("store");
            let store = Arc::new(Mutex::new(MeshStore::new(store, true)));
            ReplicaState::new(&id, Duration::from_secs(3600), store)
        })
        .collect();

    let t = Instant::now();
    let spec = FleetSpec {
        clusters,
        nodes_per_cluster: nodes,
        gpus_per_node: 8,
        owners_per_cluster: 4,
        kubernetes_version: "1.36".into(),
    };
    for c in 0..clusters {
        let name = format!("c{c}");
        let mut changes = Vec::new();
        cluster_objects(&spec, c, &|n| n % 5, |o| {
            changes.push((name.clone(), ObjectChange::upsert(&o)));
        });
        for state in &states {
            state.apply_changes(&changes);
        }
    }
    eprintln!(
        "fleet: {clusters} clusters x {nodes} nodes x 8 GPUs loaded into {replicas} replica(s) (confirm {confirm:?}) in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    // The fake API server and the replicas on runtimes of their own, so their CPU is told apart
    // (see `cpu_seconds`); the bench's driver stays on the main runtime.
    let runtime = |name: &str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(name)
            .enable_all()
            .build()
            .expect("runtime")
    };
    let (api_rt, replica_rt) = (runtime("fakeapi"), runtime("replica-rt"));
    let fake = api_rt
        .spawn(FakeApi::start())
        .await
        .expect("fake API server");
    if !fake.validates_karmada_crds() {
        eprintln!("note: ../shared/fixtures/karmada/crds is absent; writes are not schema-checked");
    }
    for c in 0..clusters {
        fake.apply(cluster(&format!("c{c}"), c % 4));
    }
    fake.apply(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": NS},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}}}),
    );

    let (stop, rx) = tokio::sync::watch::channel(false);
    let mut peers = Vec::new();
    let mut tasks = Vec::new();
    let mut metrics = Vec::new();
    for state in &states {
        let client = Arc::new(KarmadaClient::new(
            fake.client(),
            KarmadaOptions::new(SCHEDULER, &state.replica),
        ));
        let role = SchedulerRole {
            confirm,
            members: replicas,
            decider_nice: env("SCHED_DECIDER_NICE", dramesh_replica::DEFAULT_DECIDER_NICE),
            ..SchedulerRole::new(std::path::PathBuf::new(), SCHEDULER)
        };
        let others = states
            .iter()
            .filter(|s| s.replica != state.replica)
            .map(|s| s.replica.clone());
        let (tx, peers_rx) = tokio::sync::watch::channel(Peers {
            alive: others.collect(),
            caught_up: replicas == 1,
        });
        peers.push(tx);
        let m = Arc::new(dramesh_telemetry::Metrics::new());
        metrics.push(m.clone());
        let (state, rx) = (state.clone(), rx.clone());
        tasks.push(replica_rt.spawn(async move {
            dramesh_replica::serve_shared(state, client, role, peers_rx, Some(&m), rx).await
        }));
    }
    // The mesh between the replicas: their reservation documents, every `SCHED_COPY_MS`.
    let syncing = Arc::new(std::sync::atomic::AtomicBool::new(replicas > 1));
    let syncer = (replicas > 1).then(|| {
        let (states, syncing) = (states.clone(), syncing.clone());
        std::thread::Builder::new()
            .name("bench-copy".into())
            .spawn(move || {
                let mut last: Vec<Copied> = vec![Default::default(); states.len()];
                while syncing.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(env("SCHED_COPY_MS", 5)));
                    for (i, from) in states.iter().enumerate() {
                        let to: Vec<&Arc<ReplicaState>> = states
                            .iter()
                            .filter(|s| s.replica != from.replica)
                            .collect();
                        copy_changes(from, &to, &mut last[i]);
                    }
                }
            })
            .expect("copying thread")
    });
    if replicas > 1 {
        // Caught up: every replica holds the others' role records (synced within a copy period).
        tokio::time::sleep(Duration::from_secs(1)).await;
        for p in &peers {
            p.send_modify(|p| p.caught_up = true);
        }
    }

    let mut next = 0usize;
    let mut name = || {
        next += 1;
        format!("w{next}")
    };

    let mut scheduled = Scheduled::default();
    let cpu = cpu_seconds();
    let (decided, phase_start) = (decider_totals(&metrics), Instant::now());
    let mut warm = Phase::new();
    for _ in 0..200 {
        warm.create(&fake, &name());
    }
    let (lat, last, failed) = warm
        .wait(&fake, &mut scheduled, Duration::from_secs(300))
        .await;
    report("warm", 200, last, &lat, &failed);
    report_cpu("warm", 200, replicas, &cpu);
    report_decider(
        "warm",
        &metrics,
        decided,
        phase_start.elapsed().as_secs_f64(),
    );

    let cpu = cpu_seconds();
    let (decided, phase_start) = (decider_totals(&metrics), Instant::now());
    let view_rate: u64 = env("SCHED_VIEW_RATE", 0);
    let pod_churn = match std::env::var("SCHED_VIEW_CHANGE").as_deref() {
        Ok("pods") => true,
        Ok("labels") | Err(_) => false,
        Ok(other) => panic!("SCHED_VIEW_CHANGE={other}: expected labels or pods"),
    };
    let updating = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(view_rate > 0));
    let updater = (view_rate > 0).then(|| {
        let (states, updating) = (states.clone(), updating.clone());
        let nodes_per_cluster = spec.nodes_per_cluster;
        // The first node of each cluster, relabelled on every update (generated alone: a
        // whole cluster's objects would cost the phase seconds of CPU).
        let one_node = FleetSpec {
            nodes_per_cluster: 1,
            ..spec.clone()
        };
        let mut firsts = Vec::new();
        for c in 0..clusters {
            let mut first = None;
            cluster_objects(&one_node, c, &|n| n % 5, |o| {
                if first.is_none()
                    && let dramesh_model::ClusterObject::Node(n) = &o
                {
                    first = Some((**n).clone());
                }
            });
            firsts.extend(first.map(|n| (format!("c{c}"), n)));
        }
        tokio::task::spawn_blocking(move || {
            let period = Duration::from_secs_f64(1.0 / view_rate as f64);
            let started = Instant::now();
            let mut applied = 0u64;
            // Pods started by `pods` churn, by (cluster, node): started when absent, ended
            // when present.
            let mut running: std::collections::HashSet<(usize, usize)> = Default::default();
            let mut rng = dramesh_testkit::Lcg(0x9e37_79b9_7f4a_7c15);
            while updating.load(std::sync::atomic::Ordering::Relaxed) {
                let i = applied as usize % firsts.len();
                let changes = if pod_churn {
                    let n = rng.next(nodes_per_cluster as u64) as usize;
                    let cluster = firsts[i].0.clone();
                    let node = format!("c{i}-n{n}");
                    let (claim, pod) = (format!("{node}-churn"), format!("{node}-churn-pod"));
                    let objects = [
                        dramesh_model::ClusterObject::ResourceClaim(Arc::new(
                            dramesh_sim::typed::allocated_claim("default", &claim, &node, 7),
                        )),
                        dramesh_model::ClusterObject::Pod(Arc::new(dramesh_sim::typed::gpu_pod(
                            "default", &pod, &node, "churn", 0, &claim,
                        ))),
                    ];
                    let start = running.insert((i, n));
                    if !start {
                        running.remove(&(i, n));
                    }
                    objects
                        .iter()
                        .map(|o| {
                            let change = if start {
                                ObjectChange::upsert(o)
                            } else {
                                ObjectChange::Delete { key: o.key() }
                            };
                            (cluster.clone(), change)
                        })
                        .collect::<Vec<_>>()
                } else {
                    let (cluster, node) = &mut firsts[i];
                    node.metadata
                        .labels
                        .get_or_insert_default()
                        .insert("bench.dramesh.io/update".into(), applied.to_string());
                    let o = dramesh_model::ClusterObject::Node(Arc::new(node.clone()));
                    vec![(cluster.clone(), ObjectChange::upsert(&o))]
                };
                for state in &states {
                    state.apply_changes(&changes);
                }
                applied += 1;
                let due = started + period.mul_f64(applied as f64);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
            }
            applied as f64 / started.elapsed().as_secs_f64()
        })
    });
    let mut steady = Phase::new();
    let n = (rate * secs) as usize;
    let period = Duration::from_secs_f64(1.0 / rate as f64);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for _ in 0..n {
        tick.tick().await;
        steady.create(&fake, &name());
    }
    let offered = steady.started.elapsed();
    let (lat, last, failed) = steady
        .wait(&fake, &mut scheduled, Duration::from_secs(600))
        .await;
    println!(
        "steady: offered {n} bindings over {:.2} s ({:.0}/s)",
        offered.as_secs_f64(),
        n as f64 / offered.as_secs_f64()
    );
    report("steady", n, last, &lat, &failed);
    report_cpu("steady", n, replicas, &cpu);
    report_decider(
        "steady",
        &metrics,
        decided,
        phase_start.elapsed().as_secs_f64(),
    );
    updating.store(false, std::sync::atomic::Ordering::Relaxed);
    if let Some(u) = updater {
        println!(
            "steady: node updates applied at {:.0}/s",
            u.await.unwrap_or(0.0)
        );
    }

    let cpu = cpu_seconds();
    let (decided, phase_start) = (decider_totals(&metrics), Instant::now());
    let mut b = Phase::new();
    for _ in 0..burst {
        b.create(&fake, &name());
    }
    let (lat, last, failed) = b
        .wait(&fake, &mut scheduled, Duration::from_secs(600))
        .await;
    report("burst", burst, last, &lat, &failed);
    report_cpu("burst", burst, replicas, &cpu);
    report_decider(
        "burst",
        &metrics,
        decided,
        phase_start.elapsed().as_secs_f64(),
    );
    for state in &states {
        let own = state
            .reservation_list(false)
            .into_iter()
            .filter(|r| r.owner == state.replica)
            .count();
        let all = state.reservation_list(false).len();
        println!(
            "{}: {own} own reservations live at the end, {all} known",
            state.replica
        );
    }
    spec_writes_per_binding(&fake);

    let _ = stop.send(true);
    for t in tasks {
        let _ = t.await;
    }
    syncing.store(false, std::sync::atomic::Ordering::Relaxed);
    if let Some(s) = syncer {
        let _ = s.join();
    }
    // A runtime may not be dropped inside another's context.
    replica_rt.shutdown_background();
    api_rt.shutdown_background();
}
