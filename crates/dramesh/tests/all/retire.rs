//! Acceptance test of retiring a member cluster, with separate `dramesh` processes.
//!
//! Two replicas (r2 seeded with r1) and folder agents for clusters `keep` and `gone`. The
//! cluster `gone` is retired through r1 with `dramesh retire`, while its agent keeps running.
//! Both replicas must drop it (status, estimates) and list it as retired, its running agent
//! must not bring it back, r2 restarted from its disk must not list it either, and the agent
//! restarted with `--rejoin` must bring it back. Every wait is bounded; processes are killed
//! when the test ends, pass or fail.
//!
//! A second test keeps the retired cluster's agent writing, so that its store rolls over to
//! new generations again and again (bounded history), and checks that neither replica lists
//! the cluster again through 20 s of that (and a restart of r2), until the agent rejoins.

use crate::common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{BIN, TwoReplicas, http, status_names, wait_for};

#[test]
fn a_retired_cluster_leaves_every_replica_and_comes_back_only_by_rejoining() {
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let mut f = start(tmp);
    let admin_token = tmp.join("admin-token");
    std::fs::write(&admin_token, "s3cret-admin\n").expect("token");
    let (h1, h2) = (f.r1.http, f.r2.http);
    let meshes = [f.r1.mesh, f.r2.mesh];
    f.agent(tmp, "keep", &meshes, &[]);
    let gone_agent = f.agent(tmp, "gone", &meshes, &[]);
    wait_both_listed(&[h1, h2]);

    // A name no replica knows is refused, naming it; nothing is retired.
    let (code, body) =
        common::try_request_as(h1, Some("s3cret-admin"), "DELETE", "/v1/clusters/nope", "")
            .expect("DELETE");
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("nope"), "{body}");

    // Retiring is an admin's call: anonymous callers are refused and nothing is retired.
    let (code, body) = http(h1, "DELETE", "/v1/clusters/gone", None);
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("needs the admin permission"), "{body}");
    assert_eq!(status_names(h1, "retired"), Some(vec![]));

    let out = Command::new(BIN)
        .args(["retire", "gone", "--api", &h1.to_string()])
        .args(["--token-file", &admin_token.display().to_string()])
        .output()
        .expect("run dramesh retire");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "dramesh retire failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("retired cluster gone"), "{stdout}");
    let (_, status) = common::http_json(h1, "GET", "/v1/status", None);
    assert_eq!(status["retired"][0]["by"], "admin", "{status}");

    wait_retired(&[h1, h2]);
    // Its agent still runs and keeps trying: the cluster stays out (heartbeats and the old
    // generation are refused), on both replicas.
    std::thread::sleep(Duration::from_secs(3));
    for h in [h1, h2] {
        assert!(only_keep(h).is_some(), "{:?}", status_names(h, "clusters"));
        let (code, body) = http(
            h,
            "POST",
            "/v1/estimate",
            Some(
                r#"{"workload":{"manifests":["apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - {name: c, image: x, resources: {requests: {cpu: '1'}}}\n"]},"clusters":["gone"]}"#,
            ),
        );
        assert_eq!(code, 404, "estimate on a retired cluster: {body}");
    }

    // r2 restarted from its disk: still gone.
    f.restart_r2(tmp);
    wait_for("r2 back without gone", Duration::from_secs(60), || {
        only_keep(h2)
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        only_keep(h2).is_some(),
        "{:?}",
        status_names(h2, "clusters")
    );

    // The agent restarted with --rejoin publishes a newer generation: the cluster is back.
    f.kill(gone_agent);
    f.agent(tmp, "gone", &meshes, &["--rejoin"]);
    wait_both_listed(&[h1, h2]);
}

#[test]
fn dramesh_retire_speaks_tls_with_a_client_certificate() {
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let certs = tmp.join("certs");
    common::run_ok(&[
        "certs",
        "--out",
        &certs.display().to_string(),
        "--replica",
        "r1",
        "--api-server",
        "127.0.0.1",
        "--api-client",
        "admin",
    ]);
    let file = |name: &str| certs.join(name).display().to_string();
    let mut at = common::ReplicaListen::any();
    let mut procs = common::Procs::default();
    procs.0.push(common::spawn_replica_with(
        tmp,
        &certs,
        "r1",
        &mut at,
        &[],
        &[
            "--api-cert",
            &file("api-server.crt"),
            "--api-key",
            &file("api-server.key"),
            "--api-client-ca",
            &file("ca.crt"),
            "--api-admins",
            "admin",
        ],
    ));
    let url = format!("https://{}", at.http);
    let retire = |extra: &[&str]| {
        let out = Command::new(BIN)
            .args(["retire", "nope", "--api", &url, "--timeout", "5"])
            .args(extra)
            .output()
            .expect("run dramesh retire");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let ca = file("ca.crt");
    let (cert, key) = (file("api-client-admin.crt"), file("api-client-admin.key"));
    // The admin's certificate gets through TLS and authorization to the replica's answer:
    // no such cluster.
    let (code, err) = wait_for("the TLS API answers", Duration::from_secs(60), || {
        let (code, err) = retire(&["--ca-file", &ca, "--cert-file", &cert, "--key-file", &key]);
        err.contains("HTTP").then_some((code, err))
    });
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("HTTP 404") && err.contains("nope"), "{err}");
    // Without a client certificate the caller is anonymous.
    let (code, err) = retire(&["--ca-file", &ca]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("HTTP 401"), "{err}");
    // https without the CA that signed the replica's certificate is a usage error.
    let (code, err) = retire(&["--cert-file", &cert, "--key-file", &key]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("needs --ca-file"), "{err}");
    // A CA that did not sign it fails the handshake, before any HTTP exchange.
    let other = tmp.join("other");
    common::run_ok(&[
        "certs",
        "--out",
        &other.display().to_string(),
        "--replica",
        "x",
    ]);
    let other_ca = other.join("ca.crt").display().to_string();
    let (code, err) = retire(&[
        "--ca-file",
        &other_ca,
        "--cert-file",
        &cert,
        "--key-file",
        &key,
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(!err.contains("HTTP 4"), "{err}");
    // A key without its certificate is a usage error.
    let (code, _) = retire(&["--key-file", &key]);
    assert_eq!(code, Some(2));
}

/// Replicas r1 and r2 for folder clusters `keep` and `gone`: anyone may read and reserve; only
/// the token file's `admin` (token `s3cret-admin`) may retire.
fn start(tmp: &Path) -> TwoReplicas {
    let tokens = tmp.join("tokens.csv");
    std::fs::write(&tokens, "s3cret-admin,admin,1\n").expect("token file");
    let tokens_arg = tokens.display().to_string();
    let mut args = common::OPEN_API.to_vec();
    args.extend(["--api-token-file", &tokens_arg, "--api-admins", "admin"]);
    TwoReplicas::start(tmp, &["keep", "gone"], &args)
}

/// Waits until every replica of `hs` lists both clusters.
fn wait_both_listed(hs: &[SocketAddr]) {
    for h in hs {
        wait_for(
            "both clusters on every replica",
            Duration::from_secs(60),
            || status_names(*h, "clusters").filter(|c| c.len() == 2),
        );
    }
}

/// `Some` when replica `h` lists only `keep`, and `gone` as retired.
fn only_keep(h: SocketAddr) -> Option<()> {
    let listed = status_names(h, "clusters")?;
    let retired = status_names(h, "retired")?;
    (listed == ["keep"] && retired == ["gone"]).then_some(())
}

/// Waits until every replica of `hs` lists only `keep`, and `gone` as retired.
fn wait_retired(hs: &[SocketAddr]) {
    for h in hs {
        let until = Instant::now() + Duration::from_secs(30);
        while only_keep(*h).is_none() {
            assert!(
                Instant::now() < until,
                "after 30 s the replica at {h} lists {:?} and has retired {:?} (want [\"keep\"] and [\"gone\"])",
                status_names(*h, "clusters"),
                status_names(*h, "retired")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The generation of `gone`'s document in its agent's data directory `data`, if readable now.
fn agent_generation(data: &Path) -> Option<u64> {
    dramesh_store::stored_generation(data, &dramesh_store::DocId::new("gone", "_cluster"))
}

/// A Node of cluster `gone` whose annotation holds `n` and ~24 KB that differ with `n`, so each
/// change grows the agent's history enough to roll its document over every few changes.
fn busy_node(n: u64) -> String {
    let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let pad: String = (0..3_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            format!("{:08x}", x as u32)
        })
        .collect();
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: n1, labels: {{step: \"{n}\"}}, annotations: {{pad: \"{pad}\"}}}}\nstatus:\n  allocatable: {{cpu: \"8\", memory: 32Gi, pods: \"110\"}}\n"
    )
}

#[test]
fn a_retired_cluster_stays_retired_while_its_agent_keeps_writing_and_rolling_over() {
    const HOLD: Duration = Duration::from_secs(20);
    const MIN_ROLLOVERS: usize = 3;
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let mut f = start(tmp);
    let (h1, h2) = (f.r1.http, f.r2.http);
    let meshes = [f.r1.mesh, f.r2.mesh];
    let node_file = f.fleet.join("gone").join("node.yaml");
    std::fs::write(&node_file, busy_node(0)).expect("node");
    f.agent(tmp, "keep", &meshes, &[]);
    let gone_agent = f.agent(tmp, "gone", &meshes, &[]);
    let gone_data = tmp.join("agent-gone");
    wait_both_listed(&[h1, h2]);
    // The folder changes every 100 ms from now on, until the test ends.
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut n = 1;
            while !stop.load(Ordering::Relaxed) {
                let tmp_file = node_file.with_extension("tmp");
                std::fs::write(&tmp_file, busy_node(n)).expect("node");
                std::fs::rename(&tmp_file, &node_file).expect("rename");
                n += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            n
        });
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // The agent rolls over by itself under these writes (checked before retiring, so
            // that a build whose agent never rolls over cannot pass the hold below vacuously).
            let g0 = wait_for("the agent's generation", Duration::from_secs(10), || {
                agent_generation(&gone_data)
            });
            wait_for("a rollover of the agent", Duration::from_secs(30), || {
                agent_generation(&gone_data).filter(|g| *g > g0)
            });

            let (code, body) =
                common::try_request_as(h1, Some("s3cret-admin"), "DELETE", "/v1/clusters/gone", "")
                    .expect("DELETE");
            assert_eq!(code, 200, "{body}");
            let retired_at: u64 = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["retiredAtMs"].as_u64())
                .unwrap_or_else(|| panic!("retiredAtMs in {body}"));
            wait_retired(&[h1, h2]);
            // Hold: sampled every 250 ms on both replicas while the agent keeps writing and
            // rolling over; r2 is restarted from its disk half way.
            let start = Instant::now();
            let mut generations = std::collections::BTreeSet::new();
            let mut restarted = false;
            while start.elapsed() < HOLD {
                if let Some(g) = agent_generation(&gone_data).filter(|g| *g > retired_at) {
                    generations.insert(g);
                }
                if !restarted && start.elapsed() > HOLD / 2 {
                    f.restart_r2(tmp);
                    wait_for("r2 back", Duration::from_secs(60), || {
                        status_names(h2, "retired")
                    });
                    restarted = true;
                }
                for h in [h1, h2] {
                    assert!(
                        only_keep(h).is_some(),
                        "{h} lists {:?} (retired {:?}) {:.1} s after the retirement, the agent at generations {generations:?}",
                        status_names(h, "clusters"),
                        status_names(h, "retired"),
                        start.elapsed().as_secs_f64()
                    );
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            assert!(
                generations.len() >= MIN_ROLLOVERS,
                "the agent rolled over only {} times after the retirement ({generations:?}): the hold proves nothing",
                generations.len()
            );
            eprintln!(
                "gone stayed retired for {HOLD:?} while its agent rolled over {} times",
                generations.len()
            );

            // The agent restarted with --rejoin comes back.
            f.kill(gone_agent);
            f.agent(tmp, "gone", &meshes, &["--rejoin"]);
            wait_both_listed(&[h1, h2]);
        }));
        stop.store(true, Ordering::Relaxed);
        let _ = writer.join();
        if let Err(p) = result {
            std::panic::resume_unwind(p);
        }
    });
}
