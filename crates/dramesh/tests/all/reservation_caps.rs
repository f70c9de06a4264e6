//! The per-identity cap of live reservations holds cluster-wide once settled (issue 32 item 3),
//! with three separate `dramesh replica` processes.
//!
//! The cap is 50 live reservations per identity (the default). alice sends 200 reservations
//! round-robin to the three replicas, one after another; bob sends 240 at once from 24
//! threads, round-robin too. Each replica admits against its own view of the replicated
//! table, so more than 50 may be admitted at first (on a build without the cap ranking they
//! all stayed live: 51 and 54 were measured). Once settled, every replica lists the same
//! live reservations of each identity, at most 50; every other one that was admitted is void:
//! its owner reports it `conflicted` with an `over_cap` reason, and no replica lists it live.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use common::{OPEN_API, Replicas, try_request_as, wait_for, write_node_cluster};
use serde_json::{Value, json};

const CAP: usize = 50;

fn reserve_body(name: &str) -> String {
    let manifest = format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}, namespace: ml}}\nspec:\n  replicas: 1\n  selector: {{matchLabels: {{app: {name}}}}}\n  template:\n    metadata: {{labels: {{app: {name}}}}}\n    spec:\n      containers:\n      - {{name: c, image: x, resources: {{requests: {{cpu: 1m}}}}}}\n"
    );
    json!({
        "workload": {"manifests": [manifest]},
        "cluster": "east",
        "replicas": 1,
        "ttlSeconds": 600,
    })
    .to_string()
}

/// Reserves `name` on `addr` as `token`: the id when admitted (201), `None` when refused
/// over the cap (429); anything else fails the test.
fn reserve(addr: SocketAddr, token: &str, name: &str) -> Option<String> {
    let (code, text) = try_request_as(
        addr,
        Some(token),
        "POST",
        "/v1/reservations",
        &reserve_body(name),
    )
    .unwrap_or_else(|e| panic!("reserve {name} on {addr}: {e}"));
    match code {
        201 => {
            let v: Value = serde_json::from_str(&text).expect("status json");
            Some(v["id"].as_str().expect("id").to_string())
        }
        429 => {
            assert!(text.contains("live reservations"), "{text}");
            None
        }
        _ => panic!("reserve {name} on {addr}: {code} {text}"),
    }
}

/// The reservations `addr` lists whose workload name starts with `prefix`: id → (status,
/// reason, whether it is still held in the table: ended ones have no `expiresInSeconds`).
fn listed(addr: SocketAddr, prefix: &str) -> Option<BTreeMap<String, (String, String, bool)>> {
    let (code, text) =
        try_request_as(addr, Some("alice-token"), "GET", "/v1/reservations", "").ok()?;
    if code != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&text).ok()?;
    Some(
        v["reservations"]
            .as_array()?
            .iter()
            .filter(|r| {
                r["workload"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with(prefix))
            })
            .map(|r| {
                (
                    r["id"].as_str().unwrap_or_default().to_string(),
                    (
                        r["status"].as_str().unwrap_or_default().to_string(),
                        r["reason"].as_str().unwrap_or_default().to_string(),
                        !r["expiresInSeconds"].is_null(),
                    ),
                )
            })
            .collect(),
    )
}

/// Waits until every replica lists the same live reservations of `prefix`, and every other one
/// it lists (or still holds) as ended over the cap: void and released by its owner. Returns
/// the live set.
fn settled(replicas: &[SocketAddr], prefix: &str) -> BTreeSet<String> {
    let until = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let lists: Option<Vec<_>> = replicas.iter().map(|a| listed(*a, prefix)).collect();
        if let Some(lists) = &lists {
            let live = |l: &BTreeMap<String, (String, String, bool)>| -> BTreeSet<String> {
                l.iter()
                    .filter(|(_, (s, _, _))| s == "live")
                    .map(|(id, _)| id.clone())
                    .collect()
            };
            let first = live(&lists[0]);
            // A replica other than the owner may not have judged a reservation void before its
            // release arrived (it lacked the records ranked before it): it lists it as ended
            // all the same. The owner's word is checked by the caller.
            let same = lists.iter().all(|l| {
                live(l) == first
                    && l.values().all(|(s, reason, held)| {
                        s == "live"
                            || (!held && (s != "conflicted" || reason.starts_with("over_cap")))
                    })
            });
            if same {
                return first;
            }
        }
        assert!(
            std::time::Instant::now() < until,
            "the {prefix} reservations did not settle on every replica in 60 s; last lists: {lists:#?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Checks the settled state of one identity's burst: `admitted` (id → replica asked).
fn check(replicas: &[SocketAddr], prefix: &str, admitted: &BTreeMap<String, SocketAddr>) {
    let live = settled(replicas, prefix);
    assert!(
        live.len() <= CAP,
        "{prefix}: {} reservations live once settled, over the cap of {CAP} ({} were admitted)",
        live.len(),
        admitted.len()
    );
    assert!(
        live.iter().all(|id| admitted.contains_key(id)),
        "{prefix}: a live reservation nobody was told of"
    );
    // Every admitted reservation that is not live was voided by the cap ranking: its owner
    // (the replica that admitted it) tells its caller so.
    for (id, addr) in admitted.iter().filter(|(id, _)| !live.contains(*id)) {
        let (code, text) = try_request_as(
            *addr,
            Some("alice-token"),
            "GET",
            &format!("/v1/reservations/{id}"),
            "",
        )
        .expect("GET reservation");
        assert_eq!(code, 200, "{id}: {text}");
        let v: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["status"], "conflicted", "{id}: {v}");
        assert!(
            v["reason"].as_str().is_some_and(|r| r.contains("over_cap")),
            "{id}: {v}"
        );
        assert_eq!(v["remaining"], 0, "{id}: {v}");
        assert!(v["expiresInSeconds"].is_null(), "{id} is still held: {v}");
    }
    eprintln!(
        "{prefix}: {} admitted, {} live once settled, {} voided over the cap",
        admitted.len(),
        live.len(),
        admitted.len() - live.len()
    );
}

#[test]
fn a_reservation_burst_over_three_replicas_never_exceeds_the_cap_once_settled() {
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let tokens = tmp.join("tokens.csv");
    std::fs::write(
        &tokens,
        "alice-token,alice,1,\"ml\"\nbob-token,bob,2,\"ml\"\n",
    )
    .expect("tokens");
    let tokens = tokens.display().to_string();
    let mut args = OPEN_API.to_vec();
    args.extend(["--api-token-file", &tokens, "--api-writers", "group:ml"]);
    let mut f = Replicas::start(tmp, &["r1", "r2", "r3"], &["east"], &args);
    write_node_cluster(&f.fleet.join("east"), "n0");
    f.agent(tmp, "east");
    let replicas: Vec<SocketAddr> = f.at.iter().map(|a| a.http).collect();
    for a in &replicas {
        wait_for("east on every replica", Duration::from_secs(60), || {
            common::status_names(*a, "clusters").filter(|c| c == &["east"])
        });
    }

    // alice: 200 round-robin, one after another.
    let mut alice = BTreeMap::new();
    for i in 0..200 {
        let at = replicas[i % replicas.len()];
        if let Some(id) = reserve(at, "alice-token", &format!("a{i}")) {
            alice.insert(id, at);
        }
    }
    // bob: 240 at once, from 24 threads.
    let bob: BTreeMap<String, SocketAddr> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..24)
            .map(|t| {
                let replicas = &replicas;
                s.spawn(move || {
                    (0..10)
                        .filter_map(|k| {
                            let i = t * 10 + k;
                            let at = replicas[i % replicas.len()];
                            reserve(at, "bob-token", &format!("b{i}")).map(|id| (id, at))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("thread"))
            .collect()
    });
    assert!(alice.len() >= CAP, "alice: only {} admitted", alice.len());
    assert!(bob.len() >= CAP, "bob: only {} admitted", bob.len());
    check(&replicas, "a", &alice);
    check(&replicas, "b", &bob);
}
