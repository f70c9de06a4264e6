//! Signature checks handed out as jobs (`Protocol::set_verify_jobs`, the node's mode), sans-I/O:
//! a writer and a replica (real store, real signer and verifier of CA-issued identities)
//! exchange frames in memory, and the test decides when, and in which order, the replica's
//! checks finish.
//!
//! Covered: one document's messages reach the store in arrival order whatever order their
//! checks finish in, and its changes apply in causal order; a forged message among valid ones is
//! refused and nothing after it is applied before it; a session's later frames (a digest probe)
//! wait behind its parked messages, so the answer reflects them; other sessions do not wait; a
//! session that closes drops its parked messages.

#[path = "common/fixtures.rs"]
mod fixtures;
#[path = "common/wrapped.rs"]
mod wrapped;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dramesh_mesh::certs::{self, CaBundle};
use dramesh_mesh::protocol::{ConnId, Output, Protocol, VerifyJob};
use dramesh_mesh::signing;
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_mesh::wire::{pb, pb::envelope::Body};
use dramesh_mesh::{DocStore, PeerIdentity};
use dramesh_store::{DocId, HeadsVerifier, ObjectKey, ObjectKind};
use fixtures::{config, mem_store, node_change};
use wrapped::Wrapped;

struct Writer {
    proto: Protocol,
    store: MeshStore,
    doc: DocId,
    /// Its connection id at the replica.
    at_replica: ConnId,
}

/// One replica (checks handed out as jobs) and writers, each on its own session with it
/// (`ConnId(1)` at the writer).
struct Sim {
    replica: Protocol,
    store: Wrapped,
    verifier: Arc<dyn HeadsVerifier>,
    writers: Vec<Writer>,
    /// Frames to the replica: (writer, frame).
    to_replica: VecDeque<(usize, pb::Envelope)>,
    to_writer: VecDeque<(usize, pb::Envelope)>,
    /// Checks the replica handed out, not run yet.
    jobs: Vec<VerifyJob>,
    /// Run every check as soon as it is handed out (in order).
    auto: bool,
    applied: Vec<DocId>,
    now: Instant,
}

const AT_WRITER: ConnId = ConnId(1);

impl Sim {
    fn new(ca: &CaBundle) -> Sim {
        let id = certs::issue_identity(ca, &PeerIdentity::Replica { id: "r0".into() }, 1).unwrap();
        let trust = signing::trust(&id).unwrap();
        let verifier = trust.verifier.clone();
        let mut inner = MeshStore::new(mem_store(), true);
        inner.set_trust(trust);
        let mut replica = Protocol::new(id.identity.clone(), config());
        replica.set_verify_jobs(true);
        Sim {
            replica,
            store: Wrapped::new(inner),
            verifier,
            writers: Vec::new(),
            to_replica: VecDeque::new(),
            to_writer: VecDeque::new(),
            jobs: Vec::new(),
            auto: true,
            applied: Vec::new(),
            now: Instant::now(),
        }
    }

    /// Adds writer `node` of cluster c1, connects it and runs to quiescence.
    fn add_writer(&mut self, ca: &CaBundle, node: &str) -> usize {
        let id = certs::issue_identity(
            ca,
            &PeerIdentity::Agent {
                cluster: "c1".into(),
                node: node.into(),
            },
            1,
        )
        .unwrap();
        let mut store = MeshStore::new(mem_store(), false);
        store.set_trust(signing::trust(&id).unwrap());
        let doc = DocId::new("c1", node);
        store.open_writer(&doc).unwrap();
        let w = self.writers.len();
        let at_replica = ConnId(100 + w as u64);
        let mut proto = Protocol::new(id.identity.clone(), config());
        let out = proto.on_connected(AT_WRITER, self.replica.local().clone(), self.now);
        self.writers.push(Writer {
            proto,
            store,
            doc,
            at_replica,
        });
        self.route_writer(w, out);
        let out = self
            .replica
            .on_connected(at_replica, id.identity.clone(), self.now);
        self.route_replica(out);
        self.run();
        w
    }

    fn route_writer(&mut self, w: usize, outs: Vec<Output>) {
        for o in outs {
            if let Output::Send { envelope, .. } = o {
                self.to_replica.push_back((w, envelope));
            }
        }
    }

    fn route_replica(&mut self, outs: Vec<Output>) {
        while let Some(job) = self.replica.poll_verify() {
            self.jobs.push(job);
        }
        for o in outs {
            match o {
                Output::Send { conn, envelope } => {
                    if let Some(w) = self.writers.iter().position(|w| w.at_replica == conn) {
                        self.to_writer.push_back((w, envelope));
                    }
                }
                Output::Applied { doc, .. } => self.applied.push(doc),
                Output::Close { reason, .. } => panic!("replica closed a session: {reason}"),
            }
        }
    }

    /// Delivers every frame both ways (running checks at once when `auto`) until none is left.
    fn run(&mut self) {
        for _ in 0..10_000 {
            if self.auto && !self.jobs.is_empty() {
                let jobs: Vec<VerifyJob> = std::mem::take(&mut self.jobs);
                for job in jobs {
                    let _ = self.finish(&job);
                }
                continue;
            }
            if let Some((w, env)) = self.to_replica.pop_front() {
                self.deliver(w, env);
                continue;
            }
            if let Some((w, env)) = self.to_writer.pop_front() {
                let wr = &mut self.writers[w];
                let out = wr
                    .proto
                    .handle_frame(&mut wr.store, AT_WRITER, env, self.now);
                self.route_writer(w, out);
                continue;
            }
            return;
        }
        panic!("the protocols did not quiesce");
    }

    /// Hands one frame to the replica.
    fn deliver(&mut self, w: usize, env: pb::Envelope) {
        let conn = self.writers[w].at_replica;
        let out = self
            .replica
            .handle_frame(&mut self.store, conn, env, self.now);
        self.store.flush().unwrap();
        self.route_replica(out);
    }

    /// Runs `job` with the replica's verifier and reports it done.
    fn finish(&mut self, job: &VerifyJob) -> Result<(), String> {
        let verdict = job.run(self.verifier.as_ref());
        let out = self
            .replica
            .on_verified(&mut self.store, job.ticket, self.now);
        self.store.flush().unwrap();
        self.route_replica(out);
        verdict
    }

    /// Writer `w` writes its Node with `cpu` and pushes it; its frames to the replica are
    /// queued, not delivered.
    fn write(&mut self, w: usize, cpu: &str) {
        let wr = &mut self.writers[w];
        let name = wr.doc.writer.clone();
        wr.store
            .apply(&wr.doc, vec![node_change(&name, cpu)])
            .unwrap();
        let out = wr.proto.on_local_change(&mut wr.store, &wr.doc.clone());
        self.route_writer(w, out);
    }

    fn tick(&mut self, dt: Duration) {
        self.now += dt;
        let out = self.replica.on_tick(&mut self.store, self.now);
        self.route_replica(out);
        for w in 0..self.writers.len() {
            let wr = &mut self.writers[w];
            let out = wr.proto.on_tick(&mut wr.store, self.now);
            self.route_writer(w, out);
        }
        self.run();
    }

    /// The replica's view of writer `w`'s Node.
    fn cpu(&self, w: usize) -> Option<String> {
        let doc = &self.writers[w].doc;
        let json = self
            .store
            .inner
            .store()
            .get("c1", &ObjectKey::new(ObjectKind::Node, None, &doc.writer))?;
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        v["status"]["allocatable"]["cpu"].as_str().map(String::from)
    }

    /// The sync messages queued to the replica, taken off the queue (other frames stay).
    fn take_syncs(&mut self) -> Vec<(usize, pb::Envelope)> {
        let (syncs, rest): (Vec<_>, Vec<_>) = self
            .to_replica
            .drain(..)
            .partition(|(_, e)| matches!(e.body, Some(Body::Sync(_))));
        self.to_replica = rest.into();
        syncs
    }
}

fn payload(env: &pb::Envelope) -> Vec<u8> {
    match &env.body {
        Some(Body::Sync(s)) => s.payload.clone(),
        _ => panic!("not a sync message"),
    }
}

/// Writer, replica, the writer's first value applied through a check run at once.
fn start(values: &[&str]) -> (Sim, Vec<(usize, pb::Envelope)>) {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let mut sim = Sim::new(&ca);
    let w = sim.add_writer(&ca, "n1");
    sim.write(w, "1");
    sim.run();
    assert_eq!(sim.cpu(w).as_deref(), Some("1"), "first value replicated");
    sim.auto = false;
    let mut syncs = Vec::new();
    for v in values {
        sim.write(w, v);
        let s = sim.take_syncs();
        assert_eq!(s.len(), 1, "one sync message per write");
        assert!(
            matches!(
                &s[0].1.body,
                Some(Body::Sync(pb::Sync {
                    signed: Some(_),
                    ..
                }))
            ),
            "the writer signs what it sends"
        );
        syncs.extend(s);
    }
    (sim, syncs)
}

/// Messages of one document whose checks finish in reverse order reach the store in the order
/// they arrived, none before the first one's check is done, and the changes apply in causal
/// order.
#[test]
fn one_documents_messages_reach_the_store_in_arrival_order_whatever_order_checks_finish() {
    let (mut sim, syncs) = start(&["2", "3", "4"]);
    let payloads: Vec<Vec<u8>> = syncs.iter().map(|(_, e)| payload(e)).collect();
    let received_before = sim.store.received.len();
    for (w, env) in syncs {
        sim.deliver(w, env);
    }
    assert_eq!(sim.jobs.len(), 3, "one check per signed message");
    assert_eq!(
        sim.store.received.len(),
        received_before,
        "nothing reached the store before its check"
    );
    assert_eq!(sim.replica.verifications_in_flight(), 3);
    let jobs = std::mem::take(&mut sim.jobs);
    sim.applied.clear();
    // The later messages' checks finish first: they keep waiting for the first one's.
    for job in jobs[1..].iter().rev() {
        sim.finish(job).unwrap();
        assert_eq!(
            sim.store.received.len(),
            received_before,
            "a later message reached the store before an earlier one"
        );
        assert_eq!(sim.cpu(0).as_deref(), Some("1"));
    }
    sim.finish(&jobs[0]).unwrap();
    let got: Vec<&Vec<u8>> = sim.store.received[received_before..]
        .iter()
        .map(|(_, p)| p)
        .collect();
    assert_eq!(got, payloads.iter().collect::<Vec<_>>(), "arrival order");
    assert_eq!(sim.applied.len(), 3, "each message changed the document");
    assert_eq!(sim.cpu(0).as_deref(), Some("4"));
    assert_eq!(sim.replica.verifications_in_flight(), 0);
    assert_eq!(sim.replica.counters().rejected_bad_signature, 0);
}

/// A message with a forged signature among valid ones: refused by the store, and the valid
/// message after it (whose check finished first) reaches the store only after it, where its
/// change waits for the refused one's; the writer's resend then completes the history.
#[test]
fn a_forged_message_among_valid_ones_is_refused_and_nothing_after_it_applies_early() {
    let (mut sim, mut syncs) = start(&["2", "3"]);
    let forged = payload(&syncs[0].1);
    if let Some(Body::Sync(pb::Sync {
        signed: Some(sh), ..
    })) = &mut syncs[0].1.body
    {
        let last = sh.signature.len() - 1;
        sh.signature[last] ^= 1;
    }
    let received_before = sim.store.received.len();
    for (w, env) in syncs {
        sim.deliver(w, env);
    }
    let jobs = std::mem::take(&mut sim.jobs);
    assert_eq!(jobs.len(), 2);
    sim.applied.clear();
    assert!(sim.finish(&jobs[1]).is_ok(), "the valid message verifies");
    assert_eq!(
        sim.store.received.len(),
        received_before,
        "the valid message went ahead of the forged one"
    );
    assert!(sim.finish(&jobs[0]).is_err(), "the forged message fails");
    let order: Vec<&Vec<u8>> = sim.store.received[received_before..]
        .iter()
        .map(|(_, p)| p)
        .collect();
    assert_eq!(order.len(), 2);
    assert_eq!(
        order[0], &forged,
        "the forged message reached the store first"
    );
    assert_eq!(sim.replica.counters().rejected_bad_signature, 1);
    assert!(sim.applied.is_empty(), "nothing applied: {:?}", sim.applied);
    assert_eq!(
        sim.cpu(0).as_deref(),
        Some("1"),
        "the change after the forged one was applied before it"
    );
    // The exchange goes on with checks run as they come: the writer resends what is missing.
    sim.auto = true;
    sim.run();
    for _ in 0..5 {
        if sim.cpu(0).as_deref() == Some("3") {
            break;
        }
        sim.tick(Duration::from_secs(3));
    }
    assert_eq!(sim.cpu(0).as_deref(), Some("3"));
    assert_eq!(sim.replica.counters().rejected_bad_signature, 1);
    assert_eq!(sim.store.inner.digest(), sim.writers[0].store.digest());
}

/// A document whose check is still out holds up no other document.
#[test]
fn other_documents_do_not_wait_for_a_documents_check() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let mut sim = Sim::new(&ca);
    let a = sim.add_writer(&ca, "n1");
    let b = sim.add_writer(&ca, "n2");
    for w in [a, b] {
        sim.write(w, "1");
    }
    sim.run();
    sim.auto = false;
    sim.write(a, "2");
    sim.write(b, "2");
    for (w, env) in sim.take_syncs() {
        sim.deliver(w, env);
    }
    let jobs = std::mem::take(&mut sim.jobs);
    assert_eq!(jobs.len(), 2);
    let job_b = jobs.iter().find(|j| j.doc.writer == "n2").unwrap();
    sim.finish(job_b).unwrap();
    assert_eq!(sim.cpu(b).as_deref(), Some("2"), "n2 applied");
    assert_eq!(
        sim.cpu(a).as_deref(),
        Some("1"),
        "n1 still waits for its check"
    );
    let job_a = jobs.iter().find(|j| j.doc.writer == "n1").unwrap();
    sim.finish(job_a).unwrap();
    assert_eq!(sim.cpu(a).as_deref(), Some("2"));
}

/// A session that closes drops the messages it parked; their checks' completions change
/// nothing.
#[test]
fn a_closed_session_drops_its_parked_messages() {
    let (mut sim, syncs) = start(&["2"]);
    for (w, env) in syncs {
        sim.deliver(w, env);
    }
    let jobs = std::mem::take(&mut sim.jobs);
    let received = sim.store.received.len();
    sim.replica.on_disconnected(sim.writers[0].at_replica);
    sim.finish(&jobs[0]).unwrap();
    assert_eq!(sim.store.received.len(), received);
    assert_eq!(sim.cpu(0).as_deref(), Some("1"));
    assert_eq!(sim.replica.verifications_in_flight(), 0);
}

/// A digest probe that arrives behind a parked message waits for it: compared after the
/// message applied, it matches (compared before, it would have found a difference and
/// answered with the replica's buckets).
#[test]
fn a_sessions_later_frames_wait_behind_its_parked_messages() {
    let (mut sim, syncs) = start(&["2"]);
    for (w, env) in syncs {
        sim.deliver(w, env);
    }
    let root = sim.writers[0].store.digest().root();
    let probe = dramesh_mesh::wire::envelope(Body::Digest(pb::Digest {
        root,
        buckets: vec![],
    }));
    let mismatches = sim.replica.counters().digest_mismatches;
    let sent = sim.to_writer.len();
    sim.deliver(0, probe);
    assert_eq!(sim.to_writer.len(), sent, "the probe was answered early");
    let jobs = std::mem::take(&mut sim.jobs);
    assert_eq!(jobs.len(), 1);
    sim.finish(&jobs[0]).unwrap();
    assert_eq!(sim.cpu(0).as_deref(), Some("2"));
    assert_eq!(
        sim.replica.counters().digest_mismatches,
        mismatches,
        "the probe was compared before the message it followed applied"
    );
    let status = sim
        .replica
        .sessions()
        .into_iter()
        .find(|s| s.conn == sim.writers[0].at_replica)
        .unwrap();
    assert!(status.digest_matched);
}
