//! A restarted replica is not ready until it has caught up, with separate `dramesh`
//! processes.
//!
//! Replicas r1 and r2 and a folder agent for cluster `keep` that reaches both. r2 is killed;
//! while it is down, cluster `late` joins through an agent that reaches r1 only. r2 restarts
//! from its disk with r1 as seed. From the moment it starts, `/readyz` is polled: the first
//! time it answers 200, r2's status must already list `late`, which only r1 could give it.
//! Every wait is bounded; processes are killed when the test ends, pass or fail.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    Procs, ReplicaListen, http, make_certs, spawn_folder_agent, spawn_replica, try_http_json,
    wait_for,
};

fn write_cluster(dir: &Path, node_name: &str) {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(
        dir.join("node.yaml"),
        format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: {node_name}}}\nstatus:\n  allocatable: {{cpu: \"8\", memory: 32Gi, pods: \"110\"}}\n"
        ),
    )
    .expect("node");
}

fn clusters(addr: SocketAddr) -> Option<Vec<String>> {
    let (code, v) = try_http_json(addr, "GET", "/v1/status", None)?;
    (code == 200).then(|| {
        v["clusters"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str().map(str::to_string))
            .collect()
    })
}

fn ready(addr: SocketAddr) -> bool {
    common::try_request(addr, "GET", "/readyz", "").is_ok_and(|(code, _)| code == 200)
}

#[test]
fn a_restarted_replica_is_ready_only_once_it_holds_what_its_peer_holds() {
    let tmp = tempfile::tempdir().expect("tmp");
    let fleet = tmp.path().join("fleet");
    write_cluster(&fleet.join("keep"), "k1");
    write_cluster(&fleet.join("late"), "l1");
    let certs = tmp.path().join("certs");
    make_certs(
        &certs,
        &["r1", "r2"],
        &["keep/folder".to_string(), "late/folder".to_string()],
    );
    let (l1, l2) = (ReplicaListen::free(), ReplicaListen::free());
    let mut procs = Procs::default();
    procs
        .0
        .push(spawn_replica(tmp.path(), &certs, "r1", &l1, &[]));
    procs
        .0
        .push(spawn_replica(tmp.path(), &certs, "r2", &l2, &[l1.mesh]));
    procs.0.push(spawn_folder_agent(
        "keep",
        &fleet.join("keep"),
        &tmp.path().join("agent-keep"),
        &certs,
        &[l1.mesh, l2.mesh],
    ));
    for l in [&l1, &l2] {
        wait_for("keep on both replicas", Duration::from_secs(60), || {
            clusters(l.http).filter(|c| c == &["keep"])
        });
    }
    wait_for("r2 ready", Duration::from_secs(60), || {
        ready(l2.http).then_some(())
    });

    let _ = procs.0[1].kill();
    let _ = procs.0[1].wait();
    procs.0.push(spawn_folder_agent(
        "late",
        &fleet.join("late"),
        &tmp.path().join("agent-late"),
        &certs,
        &[l1.mesh],
    ));
    wait_for("late on r1", Duration::from_secs(60), || {
        clusters(l1.http).filter(|c| c.len() == 2)
    });

    procs.0[1] = spawn_replica(tmp.path(), &certs, "r2", &l2, &[l1.mesh]);
    let started = Instant::now();
    let mut polls = 0u32;
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "r2 not ready within 60 s ({polls} polls)"
        );
        polls += 1;
        if ready(l2.http) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let listed = clusters(l2.http).expect("r2 status");
    assert!(
        listed.contains(&"late".to_string()),
        "r2 was ready {:?} after its start while missing `late` (it lists {listed:?})",
        started.elapsed()
    );
    let (code, _) = http(l2.http, "GET", "/readyz", None);
    assert_eq!(code, 200);
}
