//! Acceptance test of retiring a member cluster, with separate `dramesh` processes.
//!
//! Two replicas (r2 seeded with r1) and folder agents for clusters `keep` and `gone`. The
//! cluster `gone` is retired through r1 with `dramesh retire`, while its agent keeps running.
//! Both replicas must drop it (status, estimates) and list it as retired, its running agent
//! must not bring it back, r2 restarted from its disk must not list it either, and the agent
//! restarted with `--rejoin` must bring it back. Every wait is bounded; processes are killed
//! when the test ends, pass or fail.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{
    BIN, Procs, ReplicaListen, http, make_certs, spawn_folder_agent, spawn_folder_agent_with,
    spawn_replica, try_http_json, wait_for,
};

fn node(name: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Node
metadata: {{name: {name}}}
status:
  capacity: {{cpu: "16", memory: 64Gi, pods: "110"}}
  allocatable: {{cpu: "16", memory: 64Gi, pods: "110"}}
"#
    )
}

/// Cluster names in a replica's status, and the names it lists as retired.
fn status(addr: SocketAddr) -> Option<(Vec<String>, Vec<String>)> {
    let (code, v) = try_http_json(addr, "GET", "/v1/status", None)?;
    if code != 200 {
        return None;
    }
    let names = |field: &str| -> Vec<String> {
        v[field]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str().map(str::to_string))
            .collect()
    };
    Some((names("clusters"), names("retired")))
}

fn write_cluster(dir: &Path, node_name: &str) {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(dir.join("node.yaml"), node(node_name)).expect("node");
}

#[test]
fn a_retired_cluster_leaves_every_replica_and_comes_back_only_by_rejoining() {
    let tmp = tempfile::tempdir().expect("tmp");
    let fleet = tmp.path().join("fleet");
    write_cluster(&fleet.join("keep"), "k1");
    write_cluster(&fleet.join("gone"), "g1");
    let certs = tmp.path().join("certs");
    make_certs(
        &certs,
        &["r1", "r2"],
        &["keep/folder".to_string(), "gone/folder".to_string()],
    );
    let (l1, l2) = (ReplicaListen::free(), ReplicaListen::free());
    let mut procs = Procs::default();
    procs
        .0
        .push(spawn_replica(tmp.path(), &certs, "r1", &l1, &[]));
    procs
        .0
        .push(spawn_replica(tmp.path(), &certs, "r2", &l2, &[l1.mesh]));
    let meshes = [l1.mesh, l2.mesh];
    for c in ["keep", "gone"] {
        procs.0.push(spawn_folder_agent(
            c,
            &fleet.join(c),
            &tmp.path().join(format!("agent-{c}")),
            &certs,
            &meshes,
        ));
    }
    let gone_agent = procs.0.len() - 1;
    for l in [&l1, &l2] {
        wait_for(
            "both clusters on both replicas",
            Duration::from_secs(60),
            || status(l.http).filter(|(c, _)| c.len() == 2),
        );
    }

    // A name no replica knows is refused, naming it; nothing is retired.
    let (code, body) = http(l1.http, "DELETE", "/v1/clusters/nope", None);
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("nope"), "{body}");

    let out = Command::new(BIN)
        .args(["retire", "gone", "--api", &l1.http.to_string()])
        .output()
        .expect("run dramesh retire");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "dramesh retire failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("retired cluster gone"), "{stdout}");

    let only_keep =
        |l: &ReplicaListen| status(l.http).filter(|(c, r)| c == &["keep"] && r == &["gone"]);
    for l in [&l1, &l2] {
        wait_for(
            "gone retired on both replicas",
            Duration::from_secs(30),
            || only_keep(l),
        );
    }
    // Its agent still runs and keeps trying: the cluster stays out (heartbeats and the old
    // generation are refused), on both replicas.
    std::thread::sleep(Duration::from_secs(3));
    for l in [&l1, &l2] {
        assert!(only_keep(l).is_some(), "{:?}", status(l.http));
        let (code, body) = http(
            l.http,
            "POST",
            "/v1/estimate",
            Some(
                r#"{"workload":{"manifests":["apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - {name: c, image: x, resources: {requests: {cpu: '1'}}}\n"]},"clusters":["gone"]}"#,
            ),
        );
        assert_eq!(code, 404, "estimate on a retired cluster: {body}");
    }

    // r2 restarted from its disk: still gone.
    let r2 = 1;
    let _ = procs.0[r2].kill();
    let _ = procs.0[r2].wait();
    procs.0[r2] = spawn_replica(tmp.path(), &certs, "r2", &l2, &[l1.mesh]);
    wait_for("r2 back without gone", Duration::from_secs(60), || {
        only_keep(&l2)
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(only_keep(&l2).is_some(), "{:?}", status(l2.http));

    // The agent restarted with --rejoin publishes a newer generation: the cluster is back.
    let _ = procs.0[gone_agent].kill();
    let _ = procs.0[gone_agent].wait();
    procs.0[gone_agent] = spawn_folder_agent_with(
        "gone",
        &fleet.join("gone"),
        &tmp.path().join("agent-gone"),
        &certs,
        &meshes,
        &["--rejoin"],
    );
    for l in [&l1, &l2] {
        wait_for(
            "gone back on both replicas",
            Duration::from_secs(60),
            || status(l.http).filter(|(c, _)| c.len() == 2),
        );
    }
}
