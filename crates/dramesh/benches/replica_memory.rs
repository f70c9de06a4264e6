//! Resident memory of real `dramesh replica` processes (the release binary, mimalloc), by
//! default the setup: `MEMORY_REPLICAS` (default 3) replicas meshed with each other
//! (QUIC, mTLS), their APIs on TLS with client certificates (`MEMORY_TLS=0`: plaintext), each
//! holding one member cluster of `MEMORY_NODES` nodes (default 5,000 A100 nodes from
//! `dramesh-sim`, each with 8 GPUs and 4 NICs as ResourceSlices and half of its GPUs taken by
//! running pods, fed by a folder agent that dials every replica; `MEMORY_DEVICES=0`: the same
//! Nodes with CPU and memory only). A Karmada gRPC client with a client certificate, as
//! karmada-scheduler dials the estimator with mTLS, sends `MEMORY_REQUESTS` (default 3,000)
//! distinct `MaxAvailableReplicas` calls as a stock karmada-scheduler sends them (CPU and
//! memory, no DRA devices; each call a different CPU request, every other one with a node
//! selector, so the estimator's caches hold one entry per call), one channel per replica:
//! `MEMORY_SPREAD=all` (default) sends every call to every replica (the replicas concurrently,
//! each its calls in order), `round-robin` call i to replica i mod n, `one` every call to the
//! first; `MEMORY_CONCURRENCY=N` keeps N calls in flight per replica (default 1, as one
//! karmada-scheduler asking about one cluster) and
//! `MEMORY_CONNECT=each` opens a new connection (TLS handshake included) for every call.
//! Memory is read from `/proc/<pid>/status` of each replica (VmRSS, VmHWM, RssAnon), so
//! it is what the kernel charges the process, allocator included. Then, replica by replica,
//! `MEMORY_REPEATS` (default 1,000) calls of one request it already answered: p50 and p99 of
//! the repeated (cached) call, on its channel over loopback.
//!
//! `cargo bench -p dramesh --bench replica_memory`; `MEMORY_CACHE_BYTES=N` passes
//! `--estimate-cache-bytes N` (unset: the replica's default; 0 caches nothing, which shows
//! what grows outside the caches); `MEMORY_IDLE_SECS=N` waits N seconds after the load, and
//! again after the calls, and reads memory each time (growth from time and mesh traffic
//! alone; what the calls left behind once idle).

#[path = "../tests/all/common/mod.rs"]
mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{
    ReplicaListen, Replicas, karmada_client, karmada_tls_client, make_certs_with, tls_client,
    try_http_json, try_request_via, wait_for,
};
use dramesh_api::proto::karmada_service::estimator_client::EstimatorClient;
use dramesh_api::query::{NodeClaim, ReplicaQuery, ReplicaRequirements, WireStyle};
use dramesh_model::object::ClusterObject;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tonic::transport::Channel;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What `/proc/<pid>/status` says of a process's memory, in KiB, and its thread count.
#[derive(Clone, Copy, Default)]
struct Mem {
    rss: u64,
    hwm: u64,
    anon: u64,
    threads: u64,
}

fn memory(pid: u32) -> Mem {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> u64 {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Mem {
        rss: field("VmRSS:"),
        hwm: field("VmHWM:"),
        anon: field("RssAnon:"),
        threads: field("Threads:"),
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Request `i` (as karmada-scheduler sends one: no DRA devices): CPU `100m + i m`, 1 GiB, every other one restricted to nodes of zone
/// `us-east-1a` (a third of the nodes).
fn query(cluster: &str, i: usize) -> ReplicaQuery {
    let q = |s: String| Quantity(s);
    let mut node_claim = NodeClaim::default();
    if i % 2 == 1 {
        node_claim
            .node_selector
            .insert("topology.kubernetes.io/zone".into(), "us-east-1a".into());
    }
    ReplicaQuery {
        cluster: cluster.into(),
        requirements: ReplicaRequirements {
            node_claim,
            resource_request: [
                ("cpu".to_string(), q(format!("{}m", 100 + i))),
                ("memory".to_string(), q("1Gi".into())),
            ]
            .into_iter()
            .collect(),
            namespace: "ml".into(),
            ..ReplicaRequirements::default()
        },
        assumed_workloads: vec![],
    }
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// Writes the cluster's folder; with `devices` false only its Nodes (CPU and memory).
fn write_cluster(dir: &Path, nodes: usize, devices: bool) {
    let spec = dramesh_sim::uniform_fleet(1, nodes, 0.5)
        .into_iter()
        .next()
        .expect("one cluster");
    let mut cluster = dramesh_sim::generate(&spec);
    if !devices {
        cluster
            .objects
            .retain(|o| matches!(o, ClusterObject::ClusterInfo(_) | ClusterObject::Node(_)));
    }
    dramesh_sim::write_snapshot(dir, &cluster).expect("write the cluster folder");
    // The agent loads a file of at most 2,000,000 YAML nodes: split every kind's file into
    // files of 1,000 documents, as a large cluster's folder would be written.
    let cdir = dir.join(&cluster.name);
    for entry in std::fs::read_dir(&cdir).expect("cluster folder") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).expect("read");
        let docs: Vec<&str> = text
            .split("---\n")
            .filter(|d| !d.trim().is_empty())
            .collect();
        if docs.len() <= 1000 {
            continue;
        }
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("stem")
            .to_string();
        for (i, part) in docs.chunks(1000).enumerate() {
            let body: String = part.iter().map(|d| format!("---\n{d}")).collect();
            std::fs::write(cdir.join(format!("{stem}-{i:03}.yaml")), body).expect("write part");
        }
        std::fs::remove_file(&path).expect("remove the whole file");
    }
}

/// Which replicas get which calls.
#[derive(Clone, Copy, PartialEq)]
enum Spread {
    All,
    RoundRobin,
    One,
}

impl Spread {
    fn from_env() -> Spread {
        match std::env::var("MEMORY_SPREAD").as_deref() {
            Ok("round-robin") => Spread::RoundRobin,
            Ok("one") => Spread::One,
            Ok("all") | Err(_) => Spread::All,
            Ok(other) => panic!("MEMORY_SPREAD={other}: expected all, round-robin or one"),
        }
    }

    /// The indices of the calls replica `r` of `n` gets, in order.
    fn calls(self, r: usize, n: usize, requests: usize) -> Vec<usize> {
        match self {
            Spread::All => (0..requests).collect(),
            Spread::RoundRobin => (r..requests).step_by(n).collect(),
            Spread::One if r == 0 => (0..requests).collect(),
            Spread::One => Vec::new(),
        }
    }
}

/// How the bench reaches the replicas' APIs: plaintext, or TLS with the client certificate of
/// `dramesh certs --api-client karmada`.
#[derive(Clone)]
struct Api {
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl Api {
    /// `GET /v1/status` of the replica whose HTTP API is at `http`.
    fn status(&self, http: std::net::SocketAddr) -> Option<(u16, serde_json::Value)> {
        match &self.tls {
            None => try_http_json(http, "GET", "/v1/status", None),
            Some(tls) => {
                let (code, body) =
                    try_request_via(http, Some(tls), None, "GET", "/v1/status", "").ok()?;
                Some((code, serde_json::from_str(&body).ok()?))
            }
        }
    }

    /// A Karmada estimator client of the replica whose gRPC API is at `grpc`.
    async fn karmada(&self, grpc: std::net::SocketAddr) -> EstimatorClient<Channel> {
        match &self.tls {
            None => karmada_client(grpc).await,
            Some(tls) => karmada_tls_client(grpc, tls)
                .await
                .unwrap_or_else(|e| panic!("gRPC TLS connect {grpc}: {e}")),
        }
    }
}

/// One replica's figures.
#[derive(Default)]
struct Figures {
    calls: usize,
    empty: Mem,
    loaded: Mem,
    after: Mem,
    /// After `MEMORY_IDLE_SECS` without calls.
    settled: Option<Mem>,
    seconds: f64,
    /// Repeated call p50 and p99 in ms.
    repeated: Option<(f64, f64)>,
}

fn main() {
    let nodes = env_or("MEMORY_NODES", 5000);
    let requests = env_or("MEMORY_REQUESTS", 3000);
    let repeats = env_or("MEMORY_REPEATS", 1000).max(1);
    let n = env_or("MEMORY_REPLICAS", 3).max(1);
    let tls_on = env_or("MEMORY_TLS", 1) != 0;
    let idle_secs = env_or("MEMORY_IDLE_SECS", 0);
    let spread = Spread::from_env();
    let concurrency = env_or("MEMORY_CONCURRENCY", 1).max(1);
    let new_connections = std::env::var("MEMORY_CONNECT").as_deref() == Ok("each");
    let cache = std::env::var("MEMORY_CACHE_BYTES").ok();
    let devices = env_or("MEMORY_DEVICES", 1) != 0;
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = "member-000";
    let start = Instant::now();
    write_cluster(&tmp.path().join("fleet"), nodes, devices);
    println!(
        "replica_memory: {nodes} nodes ({}) written in {:.1} s",
        if devices {
            "8 GPUs and 4 NICs each, half the GPUs in use"
        } else {
            "CPU and memory only"
        },
        start.elapsed().as_secs_f64()
    );
    let certs = tmp.path().join("certs");
    let ids: Vec<String> = (1..=n).map(|i| format!("r{i}")).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    make_certs_with(
        &certs,
        &ids,
        &[format!("{cluster}/_cluster")],
        &["--api-server", "127.0.0.1", "--api-client", "karmada"],
    );
    let file = |f: &str| certs.join(f).display().to_string();
    let mut extra: Vec<String> = if tls_on {
        vec![
            "--api-cert".into(),
            file("api-server.crt"),
            "--api-key".into(),
            file("api-server.key"),
            "--api-client-ca".into(),
            file("ca.crt"),
        ]
    } else {
        common::OPEN_API.iter().map(|s| s.to_string()).collect()
    };
    if let Some(c) = &cache {
        extra.extend(["--estimate-cache-bytes".to_string(), c.clone()]);
    }
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let api = Api {
        tls: tls_on.then(|| Arc::new(tls_client(&certs, "karmada"))),
    };
    let mut replicas = Replicas::start_with_certs(tmp.path(), &certs, &ids, &extra);
    let pids: Vec<u32> = replicas.procs.0.iter().map(|c| c.id()).collect();
    let at: Vec<ReplicaListen> = replicas.at.clone();
    let mut figures: Vec<Figures> = (0..n).map(|_| Figures::default()).collect();
    std::thread::sleep(Duration::from_millis(500));
    for (f, pid) in figures.iter_mut().zip(&pids) {
        f.empty = memory(*pid);
    }
    replicas.agent(tmp.path(), cluster);
    let load = Instant::now();
    for a in &at {
        wait_for(
            "the cluster's nodes in every replica's view",
            Duration::from_secs(900),
            || {
                let (code, v) = api.status(a.http)?;
                let c = &v["clusters"].as_array()?.first()?;
                let gpus = c["devices"]
                    .as_array()?
                    .iter()
                    .find(|d| d["class"] == "gpu.nvidia.com")
                    .map_or(Some(0), |d| d["devices"].as_u64())?;
                let got = c["nodes"].as_u64()?;
                let want = if devices { 8 * nodes } else { 0 };
                (code == 200 && got as usize == nodes && gpus as usize == want).then_some(())
            },
        );
    }
    // Let the replicas finish what the load started (decoding, compaction) before measuring.
    std::thread::sleep(Duration::from_secs(3));
    println!(
        "replica_memory: {n} replica(s), API {}, calls {} ({concurrency} in flight per replica, {}), cache bound {}; view loaded on every replica in {:.1} s",
        if tls_on {
            "TLS with a client certificate"
        } else {
            "plaintext"
        },
        match spread {
            Spread::All => "to every replica",
            Spread::RoundRobin => "round-robin",
            Spread::One => "to the first replica",
        },
        if new_connections {
            "each on a new connection"
        } else {
            "one connection per replica"
        },
        cache.as_deref().unwrap_or("default"),
        load.elapsed().as_secs_f64(),
    );
    for ((f, pid), id) in figures.iter_mut().zip(&pids).zip(&ids) {
        f.loaded = memory(*pid);
        println!(
            "replica_memory: {id}: VmRSS empty {:.0} MiB, loaded {:.0} MiB (view ~{:.0} MiB), peak {:.0} MiB",
            mib(f.empty.rss),
            mib(f.loaded.rss),
            mib(f.loaded.rss.saturating_sub(f.empty.rss)),
            mib(f.loaded.hwm),
        );
    }
    if idle_secs > 0 {
        std::thread::sleep(Duration::from_secs(idle_secs as u64));
        for ((f, pid), id) in figures.iter().zip(&pids).zip(&ids) {
            let m = memory(*pid);
            println!(
                "replica_memory: {id}: after {idle_secs} s idle, VmRSS {:.0} MiB ({:+.0})",
                mib(m.rss),
                mib(m.rss) - mib(f.loaded.rss),
            );
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut clients = Vec::new();
        for a in &at {
            clients.push(api.karmada(a.grpc).await);
        }
        // Every replica's calls at once, on one thread: per replica `concurrency` callers
        // taking its calls in order.
        let mut tasks = tokio::task::JoinSet::new();
        for (r, c) in clients.into_iter().enumerate() {
            let calls: Arc<[usize]> = spread.calls(r, n, requests).into();
            let (pid, id, grpc, api) = (pids[r], ids[r].to_string(), at[r].grpc, api.clone());
            tasks.spawn(async move {
                let start = Instant::now();
                let next = Arc::new(AtomicUsize::new(0));
                let mut callers = tokio::task::JoinSet::new();
                for _ in 0..concurrency {
                    let (calls, next, id, api, mut c) =
                        (calls.clone(), next.clone(), id.clone(), api.clone(), c.clone());
                    callers.spawn(async move {
                        loop {
                            let k = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&i) = calls.get(k) else { break };
                            if new_connections {
                                c = api.karmada(grpc).await;
                            }
                            let answer = c
                                .max_available_replicas(
                                    query(cluster, i).to_proto(WireStyle::V119),
                                )
                                .await
                                .unwrap_or_else(|e| panic!("{id}: request {i}: {e}"));
                            assert!(
                                answer.into_inner().max_replicas > 0,
                                "{id}: request {i} fits somewhere"
                            );
                            if (k + 1) % 500 == 0 || k + 1 == calls.len() {
                                println!(
                                    "replica_memory: {id}: {:>5} distinct requests, VmRSS {:.0} MiB",
                                    k + 1,
                                    mib(memory(pid).rss)
                                );
                            }
                        }
                    });
                }
                while let Some(joined) = callers.join_next().await {
                    joined.expect("a caller");
                }
                (r, c, calls, start.elapsed().as_secs_f64())
            });
        }
        let mut done = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            done.push(joined.expect("a replica's calls"));
        }
        done.sort_by_key(|d| d.0);
        for (r, _, calls, seconds) in &done {
            let f = &mut figures[*r];
            f.calls = calls.len();
            f.seconds = *seconds;
            f.after = memory(pids[*r]);
        }
        if idle_secs > 0 {
            tokio::time::sleep(Duration::from_secs(idle_secs as u64)).await;
            for (f, pid) in figures.iter_mut().zip(&pids) {
                f.settled = Some(memory(*pid));
            }
        }
        // The repeated call, one replica at a time so they do not share the CPUs.
        for (r, mut c, calls, _) in done {
            let Some(&i) = calls.get(calls.len() / 2) else {
                continue;
            };
            let same = query(cluster, i).to_proto(WireStyle::V119);
            let mut lat = Vec::with_capacity(repeats);
            for _ in 0..repeats {
                let t = Instant::now();
                c.max_available_replicas(same.clone())
                    .await
                    .expect("repeated request");
                lat.push(t.elapsed());
            }
            lat.sort();
            figures[r].repeated = Some((percentile(&lat, 0.5), percentile(&lat, 0.99)));
        }
    });
    println!(
        "\n| replica | distinct calls | VmRSS empty | loaded | after the calls | peak (VmHWM) | RssAnon after | threads | after MEMORY_IDLE_SECS={idle_secs} idle (threads) | repeated p50 / p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (f, id) in figures.iter().zip(&ids) {
        println!(
            "| {id} | {} in {:.1} s | {:.0} MiB | {:.0} MiB | {:.0} MiB ({:+.0}) | {:.0} MiB | {:.0} MiB | {} | {} | {} |",
            f.calls,
            f.seconds,
            mib(f.empty.rss),
            mib(f.loaded.rss),
            mib(f.after.rss),
            mib(f.after.rss) - mib(f.loaded.rss),
            mib(f.after.hwm),
            mib(f.after.anon),
            f.after.threads,
            f.settled.map_or("-".to_string(), |m| format!(
                "{:.0} MiB ({})",
                mib(m.rss),
                m.threads
            )),
            f.repeated.map_or("-".to_string(), |(p50, p99)| format!(
                "{p50:.3} / {p99:.3} ms"
            )),
        );
    }
    drop(replicas);
}
