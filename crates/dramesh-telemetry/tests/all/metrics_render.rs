//! Renders the dramesh metric set after recording values and parses it back with an independent
//! parser: every metric present with the right TYPE, labels escaped, histograms consistent.

use crate::common;

use std::time::Duration;

use dramesh_telemetry::metrics::names;
use dramesh_telemetry::{Direction, Metrics, ReservationLabel};

const EXPECTED: &[(&str, &str, &[&str])] = &[
    (
        names::API_REQUESTS_TOTAL,
        "counter",
        &["api", "method", "code"],
    ),
    (
        names::API_REQUEST_DURATION_SECONDS,
        "histogram",
        &["api", "method"],
    ),
    (
        names::API_ZERO_ANSWERS_TOTAL,
        "counter",
        &["method", "reason"],
    ),
    (
        names::ALLOC_SEARCH_DURATION_SECONDS,
        "histogram",
        &["method"],
    ),
    (names::MESH_SYNC_LAG_SECONDS, "gauge", &["peer", "cluster"]),
    (names::MESH_PEER_DOCS_BEHIND, "gauge", &["peer"]),
    (names::MESH_PEERS, "gauge", &["kind"]),
    (names::MESH_BYTES_TOTAL, "counter", &["peer", "direction"]),
    (names::MESH_REJECTED_WRITES_TOTAL, "counter", &["reason"]),
    (names::STORE_BYTES, "gauge", &["cluster"]),
    (names::STORE_HISTORY_CHANGES, "gauge", &["cluster"]),
    (names::STORE_DOCUMENTS, "gauge", &[]),
    (names::RESERVATIONS, "gauge", &["state"]),
    (names::RESERVATION_EVENTS_TOTAL, "counter", &["event"]),
    (names::VIEW_DATA_AGE_SECONDS, "gauge", &["cluster"]),
    (names::AGENT_BATCHES_TOTAL, "counter", &["result"]),
    (names::HTTP_CONNECTIONS, "gauge", &["listener"]),
    (
        names::HTTP_CONNECTIONS_CLOSED_TOTAL,
        "counter",
        &["listener", "reason"],
    ),
    (names::GRPC_CONNECTIONS, "gauge", &[]),
    (names::GRPC_CONNECTIONS_REFUSED_TOTAL, "counter", &[]),
    (
        names::API_REFUSALS_TOTAL,
        "counter",
        &["identity", "reason"],
    ),
];

const NASTY_PEER: &str = "peer \"b\"\\west\nzone";

fn record(m: &Metrics) {
    m.http_connections.with(["api"]).inc();
    m.http_connection_closed("api", "evicted_idle");
    m.grpc_connections.inc();
    m.grpc_connections_refused_total.inc();
    m.api_refusals_total.with(["alice", "forbidden"]).inc();
    m.observe_api_request(
        "karmada-estimator",
        "MaxAvailableReplicas",
        "OK",
        Duration::from_micros(300),
    );
    m.observe_api_request(
        "karmada-estimator",
        "MaxAvailableReplicas",
        "OK",
        Duration::from_millis(30),
    );
    m.observe_api_request(
        "karmada-estimator",
        "MaxAvailableReplicas",
        "Unavailable",
        Duration::from_secs(20),
    );
    m.observe_api_request("http", "/v1/estimate", "200", Duration::from_millis(2));
    m.set_sync_lag("replica-b", "c1", Duration::from_millis(1500));
    m.set_sync_lag(NASTY_PEER, "c2", Duration::from_secs(3));
    m.add_mesh_bytes("replica-b", Direction::Sent, 1000);
    m.add_mesh_bytes("replica-b", Direction::Sent, 24);
    m.add_mesh_bytes("replica-b", Direction::Received, 77);
    m.mesh_peer_docs_behind.with([NASTY_PEER]).set(3.0);
    m.mesh_peers.with(["replica"]).set(2.0);
    m.reject_writes("unauthorized", 2);
    m.store_bytes.with(["c1"]).set(65536.0);
    m.store_bytes.with(["c2"]).set(1024.0);
    m.store_history_changes.with(["c1"]).set(12.0);
    m.store_documents.set(4.0);
    m.set_reservations(7, 2, 1);
    m.reservation_events(ReservationLabel::Conflicted, 3);
    m.reservation_events(ReservationLabel::Live, 5);
    m.zero_answer("MaxAvailableReplicas", "stale_cluster");
    for ms in [1, 3, 3, 40, 20_000] {
        m.observe_alloc_search("EstimateAll", Duration::from_millis(ms));
    }
    m.set_view_data_age("c1", Duration::from_millis(250));
    m.agent_batches_total.with(["ok"]).inc();
}

#[test]
fn every_metric_renders_with_type_labels_and_values() {
    let m = Metrics::new();
    record(&m);
    let text = m.render();
    let exp = common::parse(&text).unwrap_or_else(|e| panic!("{e}\n---\n{text}"));

    for (name, ty, labels) in EXPECTED {
        assert_eq!(
            exp.types.get(*name).map(String::as_str),
            Some(*ty),
            "TYPE of {name}"
        );
        assert!(
            exp.help.get(*name).is_some_and(|h| !h.is_empty()),
            "HELP of {name}"
        );
        let samples = exp.family_samples(name);
        assert!(!samples.is_empty(), "{name} has samples");
        for s in samples {
            let mut got: Vec<&str> = s
                .labels
                .keys()
                .map(String::as_str)
                .filter(|k| *k != "le")
                .collect();
            let mut want = labels.to_vec();
            got.sort();
            want.sort();
            assert_eq!(got, want, "label names of {}", s.name);
        }
    }

    let v = |n: &str, l: &[(&str, &str)]| exp.value(n, l).unwrap_or_else(|| panic!("{n}{l:?}"));
    let est = [
        ("api", "karmada-estimator"),
        ("method", "MaxAvailableReplicas"),
    ];
    assert_eq!(
        v(names::API_REQUESTS_TOTAL, &[est[0], est[1], ("code", "OK")]),
        2.0
    );
    assert_eq!(
        v(
            names::API_REQUESTS_TOTAL,
            &[est[0], est[1], ("code", "Unavailable")]
        ),
        1.0
    );
    let dur = names::API_REQUEST_DURATION_SECONDS;
    assert_eq!(v(&format!("{dur}_count"), &est), 3.0);
    let sum = v(&format!("{dur}_sum"), &est);
    assert!((sum - 20.0303).abs() < 1e-9, "sum {sum}");
    assert_eq!(
        v(
            &format!("{dur}_bucket"),
            &[est[0], est[1], ("le", "0.0005")]
        ),
        1.0
    );
    assert_eq!(
        v(&format!("{dur}_bucket"), &[est[0], est[1], ("le", "0.05")]),
        2.0
    );
    assert_eq!(
        v(&format!("{dur}_bucket"), &[est[0], est[1], ("le", "10")]),
        2.0,
        "20 s is above the last finite bucket"
    );
    assert_eq!(
        v(&format!("{dur}_bucket"), &[est[0], est[1], ("le", "+Inf")]),
        3.0
    );

    assert_eq!(
        v(
            names::MESH_SYNC_LAG_SECONDS,
            &[("peer", "replica-b"), ("cluster", "c1")]
        ),
        1.5
    );
    assert_eq!(
        v(
            names::MESH_BYTES_TOTAL,
            &[("peer", "replica-b"), ("direction", "sent")]
        ),
        1024.0
    );
    assert_eq!(
        v(
            names::MESH_BYTES_TOTAL,
            &[("peer", "replica-b"), ("direction", "received")]
        ),
        77.0
    );
    assert_eq!(
        v(names::MESH_PEER_DOCS_BEHIND, &[("peer", NASTY_PEER)]),
        3.0,
        "escaped label value parses back to the original"
    );
    assert_eq!(v(names::MESH_PEERS, &[("kind", "replica")]), 2.0);
    assert_eq!(v(names::MESH_PEERS, &[("kind", "agent")]), 0.0);
    assert_eq!(
        v(
            names::MESH_REJECTED_WRITES_TOTAL,
            &[("reason", "unauthorized")]
        ),
        2.0
    );
    assert_eq!(v(names::STORE_BYTES, &[("cluster", "c1")]), 65536.0);
    assert_eq!(v(names::STORE_HISTORY_CHANGES, &[("cluster", "c1")]), 12.0);
    assert_eq!(v(names::STORE_DOCUMENTS, &[]), 4.0);
    assert_eq!(v(names::RESERVATIONS, &[("state", "live")]), 7.0);
    assert_eq!(v(names::RESERVATIONS, &[("state", "expired")]), 2.0);
    assert_eq!(v(names::RESERVATIONS, &[("state", "conflicted")]), 1.0);
    assert_eq!(
        v(names::RESERVATION_EVENTS_TOTAL, &[("event", "conflicted")]),
        3.0
    );
    assert_eq!(
        v(names::RESERVATION_EVENTS_TOTAL, &[("event", "expired")]),
        0.0
    );
    assert!(
        exp.value(names::RESERVATION_EVENTS_TOTAL, &[("event", "live")])
            .is_none(),
        "live is a state, not an event"
    );
    assert_eq!(
        v(
            names::API_ZERO_ANSWERS_TOTAL,
            &[
                ("method", "MaxAvailableReplicas"),
                ("reason", "stale_cluster")
            ]
        ),
        1.0
    );
    assert_eq!(m.zero_answers("MaxAvailableReplicas", "stale_cluster"), 1);
    let search = names::ALLOC_SEARCH_DURATION_SECONDS;
    let ea = ("method", "EstimateAll");
    assert_eq!(v(&format!("{search}_count"), &[ea]), 5.0);
    assert!((v(&format!("{search}_sum"), &[ea]) - 20.047).abs() < 1e-9);
    assert_eq!(v(&format!("{search}_bucket"), &[ea, ("le", "0.001")]), 1.0);
    assert_eq!(v(&format!("{search}_bucket"), &[ea, ("le", "0.005")]), 3.0);
    assert_eq!(v(&format!("{search}_bucket"), &[ea, ("le", "10")]), 4.0);
    assert_eq!(v(&format!("{search}_bucket"), &[ea, ("le", "+Inf")]), 5.0);
    assert_eq!(v(names::VIEW_DATA_AGE_SECONDS, &[("cluster", "c1")]), 0.25);
    assert_eq!(v(names::AGENT_BATCHES_TOTAL, &[("result", "ok")]), 1.0);
    assert_eq!(
        m.api_requests("karmada-estimator", "MaxAvailableReplicas", |c| c == "OK"),
        2
    );
    assert_eq!(
        m.api_requests("karmada-estimator", "MaxAvailableReplicas", |_| true),
        3
    );

    common::check_histograms(&exp).unwrap_or_else(|e| panic!("{e}\n---\n{text}"));

    // The raw text carries the escaped spelling, never a raw line break inside a value.
    assert!(
        text.contains(r#"peer="peer \"b\"\\west\nzone""#),
        "escaped label in:\n{text}"
    );
}

#[test]
fn fresh_set_renders_valid_exposition() {
    let m = Metrics::new();
    let text = m.render();
    let exp = common::parse(&text).unwrap_or_else(|e| panic!("{e}\n---\n{text}"));
    for (name, ty, _) in EXPECTED {
        assert_eq!(
            exp.types.get(*name).map(String::as_str),
            Some(*ty),
            "{name}"
        );
    }
    assert_eq!(exp.value(names::STORE_DOCUMENTS, &[]), Some(0.0));
    assert_eq!(
        exp.value(names::RESERVATIONS, &[("state", "conflicted")]),
        Some(0.0)
    );
    assert_eq!(
        exp.value(names::MESH_PEERS, &[("kind", "agent")]),
        Some(0.0)
    );
    common::check_histograms(&exp).unwrap();
}

#[test]
fn forget_peer_removes_only_that_peers_series() {
    let m = Metrics::new();
    record(&m);
    m.forget_peer("replica-b");
    let exp = common::parse(&m.render()).unwrap();
    let peers: Vec<&str> = [
        names::MESH_SYNC_LAG_SECONDS,
        names::MESH_BYTES_TOTAL,
        names::MESH_PEER_DOCS_BEHIND,
    ]
    .iter()
    .flat_map(|n| exp.family_samples(n))
    .map(|s| s.labels["peer"].as_str())
    .collect();
    assert!(!peers.contains(&"replica-b"), "{peers:?}");
    assert!(peers.contains(&NASTY_PEER), "{peers:?}");
}

#[test]
fn concurrent_observations_keep_histograms_consistent() {
    let m = std::sync::Arc::new(Metrics::new());
    let writers: Vec<_> = (0..2)
        .map(|t| {
            let m = m.clone();
            std::thread::spawn(move || {
                for i in 0..2000u64 {
                    m.observe_api_request("a", "m", "OK", Duration::from_micros(i * (t + 1)));
                    m.observe_alloc_search("Place", Duration::from_micros(i));
                }
            })
        })
        .collect();
    // Scrape while writers run: every intermediate exposition must be self-consistent.
    for _ in 0..50 {
        let exp = common::parse(&m.render()).unwrap();
        common::check_histograms(&exp).unwrap();
    }
    for w in writers {
        w.join().unwrap();
    }
    let exp = common::parse(&m.render()).unwrap();
    assert_eq!(
        exp.value(
            &format!("{}_count", names::ALLOC_SEARCH_DURATION_SECONDS),
            &[("method", "Place")]
        ),
        Some(4000.0)
    );
    assert_eq!(
        exp.value(
            names::API_REQUESTS_TOTAL,
            &[("api", "a"), ("method", "m"), ("code", "OK")]
        ),
        Some(4000.0)
    );
}

#[test]
fn timer_records_on_finish() {
    let m = Metrics::new();
    let t = m.start_api_request("dramesh.v1", "Place");
    let elapsed = t.finish("OK");
    let exp = common::parse(&m.render()).unwrap();
    let l = [("api", "dramesh.v1"), ("method", "Place")];
    assert_eq!(
        exp.value(
            &format!("{}_count", names::API_REQUEST_DURATION_SECONDS),
            &l
        ),
        Some(1.0)
    );
    let sum = exp
        .value(&format!("{}_sum", names::API_REQUEST_DURATION_SECONDS), &l)
        .unwrap();
    assert!((sum - elapsed.as_secs_f64()).abs() < 1e-12);
}
