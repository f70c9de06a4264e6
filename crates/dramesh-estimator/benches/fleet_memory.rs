//! Resident memory of the view of 100 clusters x 1,000 nodes x 8 GPUs with one pod and one
//! allocated claim per GPU (800,000 of each), read from /proc/self/status (Linux).
//! Run: `cargo bench -p dramesh-estimator --bench fleet_memory`.

#[path = "../tests/all/common/fleet.rs"]
mod fleet;

use dramesh_sim::typed::FleetSpec;
use fleet::fleet;

fn rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn main() {
    // `cargo bench` passes `--bench`; any other run of this harness=false binary does the same work.
    let clusters: usize = std::env::var("FLEET_CLUSTERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let before = rss_kib().unwrap_or(0);
    let start = std::time::Instant::now();
    let spec = FleetSpec {
        clusters,
        nodes_per_cluster: 1000,
        gpus_per_node: 8,
        owners_per_cluster: 8,
        kubernetes_version: "1.36".into(),
    };
    let per_node: usize = std::env::var("FLEET_ALLOCATED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let view = match fleet(&spec, &|_| per_node) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("fleet generation failed: {e}");
            std::process::exit(1);
        }
    };
    let built = start.elapsed();
    let after = rss_kib().unwrap_or(0);
    let pods: usize = view.clusters().map(|c| c.pod_count()).sum();
    let claims: usize = view.clusters().map(|c| c.devices().claim_count()).sum();
    let nodes: usize = view.clusters().map(|c| c.node_count()).sum();
    println!(
        "fleet_memory: {clusters} clusters, {nodes} nodes, {pods} pods, {claims} claims; built in {:.1} s; VmRSS {} MiB (before {} MiB, view ~{} MiB)",
        built.as_secs_f64(),
        after / 1024,
        before / 1024,
        after.saturating_sub(before) / 1024
    );
    if after > 2 * 1024 * 1024 {
        eprintln!("fleet_memory: over the 2 GiB budget");
        std::process::exit(1);
    }
}
