//! Version negotiation at the hello, with simulated peers of other versions: a peer's `Hello`
//! is rewritten in transit to announce another version (or none, as builds before versioning
//! send it), and both sides' protocols run unchanged.

use std::time::Duration;

use dramesh_mesh::protocol::{ConnId, Output, Protocol, ProtocolConfig, VERSION_REFUSAL_LINGER};
use dramesh_mesh::version::{self, BASELINE_FEATURES, FEATURES, PROTOCOL_MAJOR, PROTOCOL_MINOR};
use dramesh_mesh::wire::{self, pb, pb::envelope::Body};
use dramesh_store::DocId;
use prost::Message as _;

use super::{Sim, agent, replica};

/// Rewrites the `Hello` queued for node `to` with `edit`.
fn edit_hello(sim: &mut Sim, to: usize, edit: impl FnOnce(&mut pb::Envelope)) {
    let (_, _, env) = sim
        .queue
        .iter_mut()
        .find(|(t, _, e)| *t == to && matches!(e.body, Some(Body::Hello(_))))
        .expect("a hello queued");
    edit(env);
}

fn hello_of(env: &mut pb::Envelope) -> &mut pb::Hello {
    match &mut env.body {
        Some(Body::Hello(h)) => h,
        _ => unreachable!(),
    }
}

/// What a build before versioning sends: `protocol_version` 1 and nothing of fields 6-8.
fn as_before_versioning(env: &mut pb::Envelope) {
    let h = hello_of(env);
    h.protocol_minor = 0;
    h.features.clear();
    h.software.clear();
}

/// The refusals node `from` sent (their reasons).
fn refusals(sim: &Sim, from: usize) -> Vec<String> {
    sim.recorded
        .iter()
        .flatten()
        .filter(|(f, _, _)| *f == from)
        .filter_map(|(_, _, e)| match &e.body {
            Some(Body::Refusal(r)) if r.code == pb::RefusalCode::Version as i32 => {
                assert!(r.doc.is_none(), "a version refusal names no document");
                Some(r.reason.clone())
            }
            _ => None,
        })
        .collect()
}

fn sim_with_recording(ids: Vec<dramesh_mesh::PeerIdentity>) -> Sim {
    let mut sim = Sim::new(ids);
    sim.recorded = Some(Vec::new());
    sim
}

#[test]
fn a_peer_too_new_is_refused_and_both_sides_see_it() {
    let mut sim = sim_with_recording(vec![replica("r0"), agent("c1", "n1")]);
    sim.connect(0, 1);
    // The agent announces a minor two ahead of the replica's.
    edit_hello(&mut sim, 0, |e| {
        let h = hello_of(e);
        h.protocol_minor = PROTOCOL_MINOR + 2;
        h.software = "dramesh 9.9.9".into();
    });
    sim.run();
    let sent = refusals(&sim, 0);
    assert_eq!(sent.len(), 1, "{sent:?}");
    let reason = &sent[0];
    assert!(reason.contains("peer too new"), "{reason}");
    assert!(
        reason.contains(&format!(
            "protocol {PROTOCOL_MAJOR}.{} (dramesh 9.9.9)",
            PROTOCOL_MINOR + 2
        )),
        "{reason}"
    );
    assert!(
        reason.contains(&format!(
            "this node protocol {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
        )),
        "{reason}"
    );
    assert_eq!(sim.nodes[0].proto.counters().version_refusals_sent, 1);
    // The agent (which, at its own version, accepted the replica) heard why and closed.
    assert_eq!(sim.nodes[1].proto.counters().version_refusals_received, 1);
    assert!(!sim.links[0].up, "the refused session stayed up");
    assert!(sim.nodes[1].proto.sessions().is_empty());
    // Nothing of the agent's was taken in.
    assert_eq!(sim.nodes[0].proto.counters().sync_in, 0);
    assert_eq!(sim.nodes[0].proto.counters().protocol_errors, 0);
}

#[test]
fn a_refusing_side_ignores_the_peer_and_closes_after_the_linger() {
    let mut p = Protocol::new(replica("r0"), ProtocolConfig::default());
    let mut store = dramesh_mesh::mem_store::MemStore::new();
    let now = std::time::Instant::now();
    let conn = ConnId(1);
    p.on_connected(conn, agent("c1", "n1"), now);
    let mut h = pb::Hello {
        role: pb::Role::Agent as i32,
        identity: agent("c1", "n1").uri(),
        ..Default::default()
    };
    version::announce(&mut h);
    h.protocol_minor = PROTOCOL_MINOR + 2;
    let out = p.handle_frame(
        &mut store,
        conn,
        wire::envelope(Body::Hello(h.clone())),
        now,
    );
    assert!(
        matches!(out.as_slice(), [Output::Send { envelope, .. }]
            if matches!(&envelope.body, Some(Body::Refusal(r)) if r.code == pb::RefusalCode::Version as i32)),
        "{out:?}"
    );
    assert!(!p.sessions()[0].hello_received);
    // Later frames are ignored, not answered and not protocol errors.
    let probe = wire::envelope(Body::Digest(pb::Digest {
        root: 1,
        buckets: vec![],
    }));
    assert!(p.handle_frame(&mut store, conn, probe, now).is_empty());
    assert_eq!(p.counters().protocol_errors, 0);
    let half = now + VERSION_REFUSAL_LINGER / 2;
    assert!(
        !p.on_tick(&mut store, half)
            .iter()
            .any(|o| matches!(o, Output::Close { .. }))
    );
    let out = p.on_tick(&mut store, now + VERSION_REFUSAL_LINGER);
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Close { conn: c, .. } if *c == conn)),
        "{out:?}"
    );
    // A reconnect within the minute is refused (and counted) again.
    p.on_disconnected(conn);
    p.on_connected(ConnId(2), agent("c1", "n1"), now);
    p.handle_frame(&mut store, ConnId(2), wire::envelope(Body::Hello(h)), now);
    assert_eq!(p.counters().version_refusals_sent, 2);
}

#[test]
fn another_major_in_the_hello_or_the_envelope_is_a_version_refusal() {
    for (major, envelope_version) in [(PROTOCOL_MAJOR + 1, 1), (0, 1), (PROTOCOL_MAJOR, 2)] {
        let mut sim = sim_with_recording(vec![replica("r0"), replica("r1")]);
        sim.connect(0, 1);
        edit_hello(&mut sim, 0, |e| {
            e.version = envelope_version;
            hello_of(e).protocol_version = major;
        });
        sim.run();
        let sent = refusals(&sim, 0);
        assert_eq!(sent.len(), 1, "major {major} envelope {envelope_version}");
        assert!(
            sent[0].contains("major versions differ") || sent[0].contains("envelope version 2"),
            "{}",
            sent[0]
        );
        assert_eq!(sim.nodes[1].proto.counters().version_refusals_received, 1);
        assert_eq!(sim.nodes[0].proto.counters().protocol_errors, 0);
        assert!(!sim.links[0].up);
    }
}

#[test]
fn a_peer_from_before_versioning_is_minor_zero_with_the_baseline_and_replicates() {
    let mut sim = sim_with_recording(vec![replica("r0"), agent("c1", "n1")]);
    sim.connect(0, 1);
    edit_hello(&mut sim, 0, as_before_versioning);
    sim.run();
    let s = &sim.nodes[0].proto.sessions()[0];
    assert!(s.hello_received);
    let v = s.peer_version.as_ref().unwrap();
    assert_eq!((v.major, v.minor), (PROTOCOL_MAJOR, 0));
    let baseline: std::collections::BTreeSet<String> =
        BASELINE_FEATURES.iter().map(|f| f.to_string()).collect();
    assert_eq!(s.features, baseline);
    // The agent sees the replica at this build's version, with every feature.
    let s = &sim.nodes[1].proto.sessions()[0];
    assert_eq!(s.peer_version.as_ref().unwrap().minor, PROTOCOL_MINOR);
    assert_eq!(s.features.len(), FEATURES.len());
    let doc = DocId::new("c1", "n1");
    sim.settle_writer(1, &doc, Duration::from_secs(1));
    assert_eq!(sim.nodes[0].store.get(&doc, "gpu").as_deref(), Some("0"));
    assert!(refusals(&sim, 0).is_empty() && refusals(&sim, 1).is_empty());
}

#[test]
fn an_adjacent_newer_peer_is_accepted_with_the_common_features() {
    let mut sim = sim_with_recording(vec![replica("r0"), replica("r1")]);
    sim.connect(0, 1);
    edit_hello(&mut sim, 0, |e| {
        let h = hello_of(e);
        h.protocol_minor = PROTOCOL_MINOR + 1;
        h.features = vec![
            version::FEATURE_SIGNED_HEADS.into(),
            version::FEATURE_ENTRY_HEADS.into(),
            "some-future-feature".into(),
        ];
    });
    sim.run();
    let s = &sim.nodes[0].proto.sessions()[0];
    assert!(s.hello_received);
    assert_eq!(
        s.features.iter().map(String::as_str).collect::<Vec<_>>(),
        [version::FEATURE_ENTRY_HEADS, version::FEATURE_SIGNED_HEADS]
    );
    assert_eq!(sim.nodes[0].proto.counters().version_refusals_sent, 0);
    let doc = DocId::new("_reservations", "r1");
    sim.write(1, &doc, "meta/r1-1", "{}");
    sim.tick(Duration::from_secs(1));
    assert_eq!(
        sim.nodes[0].store.get(&doc, "meta/r1-1").as_deref(),
        Some("{}")
    );
}

/// `Hello` as builds before versioning declare it (fields 1-5).
#[derive(Clone, PartialEq, prost::Message)]
struct HelloBeforeVersioning {
    #[prost(uint32, tag = "1")]
    protocol_version: u32,
    #[prost(int32, tag = "2")]
    role: i32,
    #[prost(string, tag = "3")]
    identity: String,
    #[prost(string, tag = "4")]
    advertise_addr: String,
    #[prost(bool, tag = "5")]
    relay: bool,
}

/// `Envelope` as builds before versioning declare it, with only the hello in its body.
#[derive(Clone, PartialEq, prost::Message)]
struct EnvelopeBeforeVersioning {
    #[prost(uint32, tag = "1")]
    version: u32,
    #[prost(message, optional, tag = "2")]
    hello: Option<HelloBeforeVersioning>,
}

#[test]
fn the_announcement_reads_as_an_acceptable_hello_in_builds_before_versioning() {
    let mut p = Protocol::new(replica("r0"), ProtocolConfig::default());
    let out = p.on_connected(ConnId(1), replica("r1"), std::time::Instant::now());
    let Some(Output::Send { envelope, .. }) = out.first() else {
        panic!("no hello: {out:?}");
    };
    let bytes = envelope.encode_to_vec();
    let old = EnvelopeBeforeVersioning::decode(bytes.as_slice()).unwrap();
    // What those builds check: the envelope version and the hello's protocol version (1).
    assert_eq!(old.version, 1);
    let h = old.hello.unwrap();
    assert_eq!(h.protocol_version, 1);
    assert_eq!(h.identity, replica("r0").uri());
    assert_eq!(h.role, pb::Role::Replica as i32);
    // And the hello they send decodes here as minor 0.
    let theirs = EnvelopeBeforeVersioning {
        version: 1,
        hello: Some(h),
    }
    .encode_to_vec();
    let env = wire::decode_payload(&theirs).unwrap();
    let Some(Body::Hello(h)) = env.body else {
        panic!("not a hello")
    };
    let v = version::read(&h).unwrap();
    assert_eq!(v.minor, 0);
    assert!(version::admit(&v).is_ok());
}
