//! Recorded mesh frames of every release (`tests/golden/v<version>/frames.json`): a session
//! between an agent and a replica as this release's protocol runs it (hellos, digests,
//! bucket entries, sync messages, heartbeats), a replica-to-replica hello and peer exchange,
//! and a version refusal. Later builds must decode every frame and, fed the recorded frames of
//! one side, take in what that side wrote.
//!
//! Regenerate the current release's frames (for a new release):
//! `cargo test -p dramesh-mesh --test protocol golden::regenerate -- --ignored`. Frames of
//! earlier releases are never regenerated.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dramesh_mesh::PeerIdentity;
use dramesh_mesh::mem_store::MemStore;
use dramesh_mesh::protocol::{ConnId, Output, Protocol, ProtocolConfig};
use dramesh_mesh::version::{self, PROTOCOL_MAJOR, PROTOCOL_MINOR};
use dramesh_mesh::wire::{self, pb, pb::envelope::Body};
use dramesh_store::{DocId, hex};
use serde::{Deserialize, Serialize};

use super::{Sim, agent, kind, replica};

#[derive(Debug, Serialize, Deserialize)]
struct Recording {
    written_by: String,
    protocol: String,
    /// The agent's document and what it holds after the session.
    cluster: String,
    writer: String,
    values: Vec<(String, String)>,
    /// Frames in the order they were sent between "agent", "replica" (r0), "replica-r1" and
    /// "replica-r9" (a peer two minor versions ahead, refused).
    frames: Vec<Frame>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Frame {
    from: String,
    to: String,
    kind: String,
    /// The whole frame: length prefix and encoded envelope, hex.
    hex: String,
}

const VALUES: [(&str, &str); 3] = [
    ("node/n1", r#"{"kind":"Node","metadata":{"name":"n1"}}"#),
    (
        "slice/n1-gpu",
        r#"{"kind":"ResourceSlice","metadata":{"name":"n1-gpu"}}"#,
    ),
    ("meta/cluster", r#"{"kind":"ClusterInfo","name":"c1"}"#),
];

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn golden_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn record() -> Recording {
    let mut sim = Sim::new(vec![replica("r0"), agent("c1", "n1"), replica("r1")]);
    sim.recorded = Some(Vec::new());
    sim.connect(0, 1);
    sim.connect(0, 2);
    sim.run();
    let doc = DocId::new("c1", "n1");
    for (k, v) in &VALUES[..2] {
        sim.write(1, &doc, k, v);
    }
    sim.tick(Duration::from_secs(1));
    // The push of the last write is lost: anti-entropy (digests, bucket entries) repairs it.
    sim.drop_next_sync_from = Some(1);
    sim.write(1, &doc, VALUES[2].0, VALUES[2].1);
    for _ in 0..6 {
        sim.tick(Duration::from_secs(1));
    }
    assert_eq!(
        sim.nodes[0].store.get(&doc, VALUES[2].0).as_deref(),
        Some(VALUES[2].1),
        "not repaired"
    );
    // A peer two minors ahead, refused by r0.
    let mut p = Protocol::new(replica("r9"), ProtocolConfig::default());
    let mut hello = p.on_connected(ConnId(1), replica("r0"), sim.now);
    let Some(Output::Send { envelope, .. }) = hello.pop() else {
        unreachable!()
    };
    let mut envelope = envelope;
    if let Some(Body::Hello(h)) = &mut envelope.body {
        h.protocol_minor = PROTOCOL_MINOR + 2;
    }
    let r0 = &mut sim.nodes[0];
    r0.proto.on_connected(ConnId(999), replica("r9"), sim.now);
    let refusal = r0
        .proto
        .handle_frame(&mut r0.store, ConnId(999), envelope, sim.now);
    let mut frames: Vec<(usize, usize, pb::Envelope)> = sim.recorded.take().unwrap_or_default();
    for o in refusal {
        if let Output::Send { envelope, .. } = o {
            frames.push((0, 9, envelope));
        }
    }
    let name = |node: usize| match node {
        0 => "replica",
        1 => "agent",
        2 => "replica-r1",
        _ => "replica-r9",
    };
    Recording {
        written_by: version::SOFTWARE.to_string(),
        protocol: format!("{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"),
        cluster: doc.cluster.clone(),
        writer: doc.writer.clone(),
        values: VALUES
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        frames: frames
            .iter()
            .map(|(from, to, e)| Frame {
                from: name(*from).to_string(),
                to: name(*to).to_string(),
                kind: kind(e).to_string(),
                hex: hex(&wire::encode_frame(e).unwrap()),
            })
            .collect(),
    }
}

#[test]
#[ignore = "writes tests/golden/v<version>/frames.json: run by hand, see the module docs"]
fn regenerate() {
    let out = golden_root().join(concat!("v", env!("CARGO_PKG_VERSION")));
    std::fs::create_dir_all(&out).unwrap();
    let json = serde_json::to_string_pretty(&record()).unwrap();
    std::fs::write(out.join("frames.json"), json + "\n").unwrap();
}

fn decode(f: &Frame) -> pb::Envelope {
    let bytes = unhex(&f.hex);
    let len = wire::check_frame_len(bytes[..4].try_into().unwrap()).unwrap();
    assert_eq!(len, bytes.len() - 4, "{} frame length", f.kind);
    wire::decode_payload(&bytes[4..]).unwrap()
}

/// Feeds `frames` to a fresh `local` protocol as coming from `peer`; returns it, its store and
/// every output.
fn replay<'a>(
    local: PeerIdentity,
    peer: PeerIdentity,
    frames: impl Iterator<Item = &'a Frame>,
) -> (Protocol, MemStore, Vec<Output>) {
    let mut p = Protocol::new(local, ProtocolConfig::default());
    let mut store = MemStore::new();
    let mut now = Instant::now();
    let mut outs = p.on_connected(ConnId(1), peer, now);
    for f in frames {
        now += Duration::from_millis(10);
        outs.extend(p.handle_frame(&mut store, ConnId(1), decode(f), now));
    }
    (p, store, outs)
}

#[test]
fn recorded_frames_of_every_release_decode_and_replay() {
    let mut releases: Vec<PathBuf> = std::fs::read_dir(golden_root())
        .unwrap()
        .map(|e| e.unwrap().path().join("frames.json"))
        .filter(|p| p.is_file())
        .collect();
    releases.sort();
    assert!(
        releases.iter().any(|p| p
            .parent()
            .unwrap()
            .ends_with(concat!("v", env!("CARGO_PKG_VERSION")))),
        "no recorded frames of this release: regenerate them (module docs)"
    );
    for path in releases {
        let name = path.display().to_string();
        let rec: Recording = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let mut kinds = std::collections::BTreeSet::new();
        for f in &rec.frames {
            let env = decode(f);
            assert_eq!(kind(&env), f.kind, "{name}");
            kinds.insert(f.kind.clone());
        }
        for k in [
            "hello",
            "digest",
            "bucket_request",
            "bucket_entries",
            "sync",
            "ephemeral",
            "peer_exchange",
            "refusal",
        ] {
            assert!(kinds.contains(k), "{name}: no {k} frame recorded");
        }
        let doc = DocId::new(rec.cluster.clone(), rec.writer.clone());
        let agent_id = agent(&rec.cluster, &rec.writer);

        // A replica fed the agent's frames accepts the session and takes in its document.
        let (p, store, outs) = replay(
            replica("r0"),
            agent_id.clone(),
            rec.frames
                .iter()
                .filter(|f| f.from == "agent" && f.to == "replica"),
        );
        assert!(
            !outs.iter().any(|o| matches!(o, Output::Close { .. })),
            "{name}: {outs:?}"
        );
        assert_eq!(p.counters().protocol_errors, 0, "{name}");
        assert_eq!(p.counters().rejected_unauthorized, 0, "{name}");
        let s = &p.sessions()[0];
        assert!(s.hello_received, "{name}");
        assert_eq!(s.peer_version.as_ref().unwrap().major, PROTOCOL_MAJOR);
        for (k, v) in &rec.values {
            assert_eq!(
                store.get(&doc, k).as_deref(),
                Some(v.as_str()),
                "{name}: {k}"
            );
        }

        // An agent fed the replica's frames of its session keeps it without errors.
        let (p, _, outs) = replay(
            agent_id,
            replica("r0"),
            rec.frames
                .iter()
                .filter(|f| f.from == "replica" && f.to == "agent"),
        );
        assert!(
            !outs.iter().any(|o| matches!(o, Output::Close { .. })),
            "{name}: {outs:?}"
        );
        assert_eq!(p.counters().protocol_errors, 0, "{name}");
        assert!(p.sessions()[0].hello_received);

        // The version refusal closes the session it reaches, counted.
        let refusal = rec
            .frames
            .iter()
            .find(|f| f.kind == "refusal")
            .expect("recorded");
        let hello = rec
            .frames
            .iter()
            .find(|f| f.from == "replica" && f.to == "replica-r1" && f.kind == "hello")
            .expect("recorded");
        let (p, _, outs) = replay(replica("r9"), replica("r0"), [hello, refusal].into_iter());
        assert_eq!(p.counters().version_refusals_received, 1, "{name}");
        assert!(
            outs.iter().any(|o| matches!(o, Output::Close { .. })),
            "{name}"
        );
    }
}
