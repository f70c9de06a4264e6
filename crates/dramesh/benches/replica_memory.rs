//! Resident memory of a real `dramesh replica` process (the release binary, mimalloc) that holds
//! one member cluster of `MEMORY_NODES` nodes (default 5,000 A100 nodes from `dramesh-sim`, each
//! with 8 GPUs and 4 NICs as ResourceSlices and half of its GPUs taken by running pods, fed by a
//! folder agent over the mesh; `MEMORY_DEVICES=0`: the same Nodes with CPU and memory only) and answers `MEMORY_REQUESTS` (default 3,000) distinct Karmada
//! `MaxAvailableReplicas` calls as a stock karmada-scheduler sends them (CPU and memory, no DRA
//! devices; each call a different CPU request, every other one with a node selector, so the
//! estimator's caches hold one entry per call). Memory is read from `/proc/<pid>/status` of the
//! replica (VmRSS, VmHWM), so it is what the kernel charges the process, allocator included.
//! Then `MEMORY_REPEATS` (default 1,000) calls of one request already answered: p50 and p99 of
//! the repeated (cached) call, on one gRPC channel over loopback.
//!
//! `cargo bench -p dramesh --bench replica_memory`; `MEMORY_CACHE_BYTES=N` passes
//! `--estimate-cache-bytes N` (unset: the replica's default).

#[path = "../tests/all/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    Procs, ReplicaListen, karmada_client, make_certs, spawn_folder_agent, spawn_replica_with,
    try_http_json, wait_for,
};
use dramesh_api::query::{NodeClaim, ReplicaQuery, ReplicaRequirements, WireStyle};
use dramesh_model::object::ClusterObject;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `VmRSS` and `VmHWM` of `pid` in KiB.
fn memory_kib(pid: u32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> u64 {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
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

fn main() {
    let nodes = env_or("MEMORY_NODES", 5000);
    let requests = env_or("MEMORY_REQUESTS", 3000);
    let repeats = env_or("MEMORY_REPEATS", 1000).max(1);
    let cache = std::env::var("MEMORY_CACHE_BYTES").ok();
    let devices = env_or("MEMORY_DEVICES", 1) != 0;
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = "member-000";
    let folder = tmp.path().join("clusters");
    let start = Instant::now();
    write_cluster(&folder, nodes, devices);
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
    make_certs(&certs, &["r1"], &[format!("{cluster}/_cluster")]);
    let mut extra: Vec<String> = common::OPEN_API.iter().map(|s| s.to_string()).collect();
    if let Some(c) = &cache {
        extra.extend(["--estimate-cache-bytes".to_string(), c.clone()]);
    }
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut at = ReplicaListen::any();
    let data = tmp.path().join("data");
    let replica = spawn_replica_with(&data, &certs, "r1", &mut at, &[], &extra);
    let pid = replica.id();
    let mut procs = Procs(vec![replica]);
    std::thread::sleep(Duration::from_millis(500));
    let (empty, _) = memory_kib(pid);
    procs.0.push(spawn_folder_agent(
        cluster,
        &folder.join(cluster),
        &tmp.path().join("agent"),
        &certs,
        &[at.mesh],
    ));
    let load = Instant::now();
    wait_for(
        "the cluster's nodes in the view",
        Duration::from_secs(900),
        || {
            let (code, v) = try_http_json(at.http, "GET", "/v1/status", None)?;
            let c = &v["clusters"].as_array()?.first()?;
            let gpus = c["devices"]
                .as_array()?
                .iter()
                .find(|d| d["class"] == "gpu.nvidia.com")
                .map_or(Some(0), |d| d["devices"].as_u64())?;
            let n = c["nodes"].as_u64()?;
            let want = if devices { 8 * nodes } else { 0 };
            (code == 200 && n as usize == nodes && gpus as usize == want).then_some(())
        },
    );
    // Let the replica finish what the load started (decoding, compaction) before measuring.
    std::thread::sleep(Duration::from_secs(3));
    let (loaded, loaded_peak) = memory_kib(pid);
    println!(
        "replica_memory: view loaded in {:.1} s; VmRSS empty {:.0} MiB, loaded {:.0} MiB (view ~{:.0} MiB), peak {:.0} MiB; cache bound {}",
        load.elapsed().as_secs_f64(),
        mib(empty),
        mib(loaded),
        mib(loaded.saturating_sub(empty)),
        mib(loaded_peak),
        cache.as_deref().unwrap_or("default"),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut c = karmada_client(at.grpc).await;
        let start = Instant::now();
        let mut answered = 0u64;
        for i in 0..requests {
            let r = c
                .max_available_replicas(query(cluster, i).to_proto(WireStyle::V119))
                .await
                .unwrap_or_else(|e| panic!("request {i}: {e}"));
            answered += u64::from(r.into_inner().max_replicas > 0);
            if (i + 1) % 500 == 0 || i + 1 == requests {
                let (rss, _) = memory_kib(pid);
                println!(
                    "replica_memory: {:>5} distinct requests, VmRSS {:.0} MiB",
                    i + 1,
                    mib(rss)
                );
            }
        }
        assert_eq!(answered as usize, requests, "every request fits somewhere");
        let (after, peak) = memory_kib(pid);
        println!(
            "replica_memory: {requests} distinct requests in {:.1} s; VmRSS before {:.0} MiB, after {:.0} MiB (+{:.0}), peak {:.0} MiB",
            start.elapsed().as_secs_f64(),
            mib(loaded),
            mib(after),
            mib(after.saturating_sub(loaded)),
            mib(peak),
        );
        let same = query(cluster, requests / 2).to_proto(WireStyle::V119);
        let mut lat = Vec::with_capacity(repeats);
        for _ in 0..repeats {
            let t = Instant::now();
            c.max_available_replicas(same.clone())
                .await
                .expect("repeated request");
            lat.push(t.elapsed());
        }
        lat.sort();
        println!(
            "replica_memory: repeated request x{repeats}: p50 {:.3} ms, p99 {:.3} ms",
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
        );
    });
    drop(procs);
}
