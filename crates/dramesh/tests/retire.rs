//! Acceptance test of retiring a member cluster, with separate `dramesh` processes.
//!
//! Two replicas (r2 seeded with r1) and folder agents for clusters `keep` and `gone`. The
//! cluster `gone` is retired through r1 with `dramesh retire`, while its agent keeps running.
//! Both replicas must drop it (status, estimates) and list it as retired, its running agent
//! must not bring it back, r2 restarted from its disk must not list it either, and the agent
//! restarted with `--rejoin` must bring it back. Every wait is bounded; processes are killed
//! when the test ends, pass or fail.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{BIN, TwoReplicas, http, status_names, wait_for};

#[test]
fn a_retired_cluster_leaves_every_replica_and_comes_back_only_by_rejoining() {
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    // Anyone may read and reserve; only the token file's `admin` may retire.
    let tokens = tmp.join("tokens.csv");
    std::fs::write(&tokens, "s3cret-admin,admin,1\n").expect("token file");
    let admin_token = tmp.join("admin-token");
    std::fs::write(&admin_token, "s3cret-admin\n").expect("token");
    let tokens_arg = tokens.display().to_string();
    let mut args = common::OPEN_API.to_vec();
    args.extend(["--api-token-file", &tokens_arg, "--api-admins", "admin"]);
    let mut f = TwoReplicas::start(tmp, &["keep", "gone"], &args);
    let (h1, h2) = (f.r1.http, f.r2.http);
    let meshes = [f.r1.mesh, f.r2.mesh];
    f.agent(tmp, "keep", &meshes, &[]);
    let gone_agent = f.agent(tmp, "gone", &meshes, &[]);
    for h in [h1, h2] {
        wait_for(
            "both clusters on both replicas",
            Duration::from_secs(60),
            || status_names(h, "clusters").filter(|c| c.len() == 2),
        );
    }

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

    let only_keep = |h| {
        let listed = status_names(h, "clusters")?;
        let retired = status_names(h, "retired")?;
        (listed == ["keep"] && retired == ["gone"]).then_some(())
    };
    for h in [h1, h2] {
        wait_for(
            "gone retired on both replicas",
            Duration::from_secs(30),
            || only_keep(h),
        );
    }
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
    for h in [h1, h2] {
        wait_for(
            "gone back on both replicas",
            Duration::from_secs(60),
            || status_names(h, "clusters").filter(|c| c.len() == 2),
        );
    }
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
