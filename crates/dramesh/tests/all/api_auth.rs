//! Who may reserve, with separate `dramesh replica` processes (issue 13's holes, each failing
//! on a build without API authentication):
//! - an anonymous reservation is refused (401), and so is an anonymous read;
//! - a reservation released by an identity other than its creator is refused (403), an admin
//!   may release it;
//! - over a per-identity cap is 429 naming the cap and the identity, and a refused reservation
//!   never enters the replicated document: the other replica's reservation store does not
//!   grow under a flood of refused 200 KB reservations;
//! - every refusal is counted in `/metrics` by identity and reason.
//!
//! Tokens travel over plaintext here (`--api-insecure`): TLS itself is tested in
//! `dramesh-api`'s tests/auth.rs and by the Python interop over TLS.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{
    Procs, ReplicaListen, make_certs, spawn_folder_agent, spawn_replica_with, try_request_as,
    wait_for,
};
use serde_json::{Value, json};

const NODE: &str = r#"apiVersion: v1
kind: Node
metadata: {name: node-1, labels: {kubernetes.io/hostname: node-1}}
status:
  capacity: {cpu: "64", memory: 256Gi, pods: "110"}
  allocatable: {cpu: "64", memory: 256Gi, pods: "110"}
"#;

fn workload(name: &str, padding: usize) -> String {
    format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}, namespace: ml, annotations: {{pad: \"{}\"}}}}\nspec:\n  replicas: 1\n  selector: {{matchLabels: {{app: {name}}}}}\n  template:\n    metadata: {{labels: {{app: {name}}}}}\n    spec:\n      containers:\n      - {{name: c, image: x, resources: {{requests: {{cpu: \"1\"}}}}}}\n",
        "x".repeat(padding)
    )
}

fn call(
    addr: SocketAddr,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let payload = body.map(Value::to_string).unwrap_or_default();
    let (code, text) = try_request_as(addr, token, method, path, &payload)
        .unwrap_or_else(|e| panic!("{method} {path} on {addr}: {e}"));
    (
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn reserve_body(name: &str, replicas: i64, ttl: u64, padding: usize) -> Value {
    json!({
        "workload": {"manifests": [workload(name, padding)]},
        "cluster": "east",
        "replicas": replicas,
        "ttlSeconds": ttl,
    })
}

fn ids(addr: SocketAddr) -> Option<Vec<String>> {
    let (code, v) = {
        let (c, t) =
            try_request_as(addr, Some("reader-token"), "GET", "/v1/reservations", "").ok()?;
        (c, serde_json::from_str::<Value>(&t).ok()?)
    };
    (code == 200).then(|| {
        v["reservations"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["status"] == "live")
            .filter_map(|r| r["id"].as_str().map(String::from))
            .collect()
    })
}

/// `dramesh_store_bytes{cluster="_reservations"}` of a replica.
fn reservation_store_bytes(addr: SocketAddr) -> f64 {
    let (_, m) = call(addr, None, "GET", "/metrics", None);
    let m = m.as_str().unwrap_or_default().to_string();
    m.lines()
        .find(|l| l.starts_with(r#"dramesh_store_bytes{cluster="_reservations"}"#))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn reservations_need_a_writer_its_creator_to_release_and_stay_under_caps() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cluster_dir = tmp.path().join("fleet").join("east");
    std::fs::create_dir_all(&cluster_dir).expect("mkdir");
    std::fs::write(cluster_dir.join("nodes.yaml"), NODE).expect("node");
    let certs = tmp.path().join("certs");
    make_certs(&certs, &["r1", "r2"], &["east/_cluster".to_string()]);
    let tokens = tmp.path().join("tokens.csv");
    std::fs::write(
        &tokens,
        "alice-token,alice,1,\"ml\"\nbob-token,bob,2,\"ml\"\nroot-token,root,3,\"ops\"\nreader-token,reader,4\n",
    )
    .expect("tokens");
    let tokens = tokens.display().to_string();
    let flags = [
        "--api-token-file",
        &tokens,
        "--api-writers",
        "group:ml",
        "--api-admins",
        "group:ops",
        "--api-max-reservations",
        "2",
        "--api-max-ttl",
        "600",
    ];
    let mut at = [ReplicaListen::any(), ReplicaListen::any()];
    let mut procs = Procs::default();
    procs.0.push(spawn_replica_with(
        tmp.path(),
        &certs,
        "r1",
        &mut at[0],
        &[],
        &flags,
    ));
    let seed = at[0].mesh;
    procs.0.push(spawn_replica_with(
        tmp.path(),
        &certs,
        "r2",
        &mut at[1],
        &[seed],
        &flags,
    ));
    procs.0.push(spawn_folder_agent(
        "east",
        &cluster_dir,
        &tmp.path().join("agent"),
        &certs,
        &[at[0].mesh, at[1].mesh],
    ));
    let (r1, r2) = (at[0].http, at[1].http);
    wait_for("east in both views", Duration::from_secs(60), || {
        [r1, r2]
            .iter()
            .all(|a| {
                try_request_as(*a, Some("reader-token"), "GET", "/v1/status", "")
                    .is_ok_and(|(c, t)| c == 200 && t.contains("\"east\""))
            })
            .then_some(())
    });

    // Anonymous: refused for writes and reads; health and metrics stay open.
    let (code, v) = call(
        r1,
        None,
        "POST",
        "/v1/reservations",
        Some(&reserve_body("a", 1, 60, 0)),
    );
    assert_eq!(code, 401, "{v}");
    assert_eq!(call(r1, None, "GET", "/v1/status", None).0, 401);
    assert_eq!(call(r1, None, "GET", "/healthz", None).0, 200);
    // A reader may not reserve.
    let (code, v) = call(
        r1,
        Some("reader-token"),
        "POST",
        "/v1/reservations",
        Some(&reserve_body("a", 1, 60, 0)),
    );
    assert_eq!(code, 403, "{v}");

    // alice reserves; bob may not release it; the admin may.
    let (code, a1) = call(
        r1,
        Some("alice-token"),
        "POST",
        "/v1/reservations",
        Some(&reserve_body("a1", 2, 300, 0)),
    );
    assert_eq!(code, 201, "{a1}");
    let a1 = a1["id"].as_str().expect("id").to_string();
    let (code, v) = call(
        r1,
        Some("bob-token"),
        "DELETE",
        &format!("/v1/reservations/{a1}"),
        None,
    );
    assert_eq!(code, 403, "{v}");
    let msg = v["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("bob") && msg.contains("created by alice"),
        "{msg}"
    );
    assert!(
        ids(r1).unwrap_or_default().contains(&a1),
        "bob's refused release ended it"
    );

    // Caps: a TTL over 600 s, then a third live reservation.
    let (code, v) = call(
        r1,
        Some("alice-token"),
        "POST",
        "/v1/reservations",
        Some(&reserve_body("a2", 1, 3600, 0)),
    );
    assert_eq!(code, 429, "{v}");
    let msg = v["error"].as_str().unwrap_or_default();
    assert!(msg.contains("alice") && msg.contains("600"), "{msg}");
    let (code, a2) = call(
        r1,
        Some("alice-token"),
        "POST",
        "/v1/reservations",
        Some(&reserve_body("a2", 1, 300, 0)),
    );
    assert_eq!(code, 201, "{a2}");
    let a2 = a2["id"].as_str().expect("id").to_string();
    let mut want = vec![a1.clone(), a2.clone()];
    want.sort();
    wait_for("both reservations on r2", Duration::from_secs(30), || {
        (ids(r2)? == want).then_some(())
    });
    let before = reservation_store_bytes(r2);
    assert!(before > 0.0, "r2 holds no reservation document");
    // A flood of refused 200 KB reservations: each 429 naming the cap; nothing replicated.
    for i in 0..20 {
        let (code, v) = call(
            r1,
            Some("alice-token"),
            "POST",
            "/v1/reservations",
            Some(&reserve_body(&format!("flood{i}"), 1, 300, 200 * 1024)),
        );
        assert_eq!(code, 429, "{v}");
        let msg = v["error"].as_str().unwrap_or_default();
        assert!(
            msg.contains("alice") && msg.contains("live reservations"),
            "{msg}"
        );
    }
    // bob has his own caps.
    let (code, b1) = call(
        r1,
        Some("bob-token"),
        "POST",
        "/v1/reservations",
        Some(&reserve_body("b1", 1, 300, 0)),
    );
    assert_eq!(code, 201, "{b1}");
    let b1 = b1["id"].as_str().expect("id").to_string();
    want.push(b1);
    want.sort();
    wait_for("bob's reservation on r2", Duration::from_secs(30), || {
        (ids(r2)? == want).then_some(())
    });
    assert_eq!(
        ids(r1).expect("r1 list"),
        want,
        "a refused reservation was written"
    );
    // The store grew by bob's small reservation only, not by 20 × 200 KB.
    let after = reservation_store_bytes(r2);
    assert!(
        after - before < 64.0 * 1024.0,
        "r2's reservation store grew from {before} to {after} bytes"
    );

    let (code, v) = call(
        r1,
        Some("root-token"),
        "DELETE",
        &format!("/v1/reservations/{a1}"),
        None,
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["status"], "released", "{v}");

    let (_, m) = call(r1, None, "GET", "/metrics", None);
    let m = m.as_str().unwrap_or_default().to_string();
    for line in [
        r#"dramesh_api_refusals_total{identity="bob",reason="not_creator"} 1"#,
        r#"dramesh_api_refusals_total{identity="alice",reason="cap_ttl"} 1"#,
        r#"dramesh_api_refusals_total{identity="alice",reason="cap_reservations"} 20"#,
        r#"dramesh_api_refusals_total{identity="reader",reason="forbidden_write"} 1"#,
        r#"dramesh_api_refusals_total{identity="system:anonymous",reason="no_credentials"} 2"#,
    ] {
        assert!(m.contains(line), "{line} missing from /metrics");
    }
}
