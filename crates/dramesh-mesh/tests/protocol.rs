//! Sans-I/O protocol tests: several `Protocol` instances exchange frames in memory.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use dramesh_mesh::mem_store::MemStore;
use dramesh_mesh::protocol::{ConnId, Output, Protocol, ProtocolConfig};
use dramesh_mesh::wire::{self, pb, pb::envelope::Body};
use dramesh_mesh::{DocStore, PeerIdentity};
use dramesh_store::DocId;

mod golden;
mod versions;

struct SimNode {
    proto: Protocol,
    store: MemStore,
    applied: Vec<DocId>,
}

struct Link {
    a: usize,
    b: usize,
    conn_a: ConnId,
    conn_b: ConnId,
    up: bool,
}

struct Sim {
    nodes: Vec<SimNode>,
    links: Vec<Link>,
    queue: VecDeque<(usize, ConnId, pb::Envelope)>,
    now: Instant,
    next_conn: u64,
    /// Encoded bytes of every delivered frame, by body kind.
    bytes: std::collections::BTreeMap<&'static str, usize>,
    frames: std::collections::BTreeMap<&'static str, usize>,
    /// Sync frames delivered, by (from node, to node).
    syncs: std::collections::BTreeMap<(usize, usize), usize>,
    /// (sender, buckets, entries) of every delivered `BucketRequest`.
    bucket_requests: Vec<(usize, Vec<u32>, Vec<pb::DocEntry>)>,
    /// When set, the next Sync frame sent by this node is dropped.
    drop_next_sync_from: Option<usize>,
    /// When set, Sync frames sent by this node are held back until [`Sim::release_held`].
    hold_sync_from: Option<usize>,
    /// When set, every frame sent by this node is held back (in order) until
    /// [`Sim::release_held`]: a slow direction of a connection.
    hold_all_from: Option<usize>,
    held: Vec<(usize, ConnId, pb::Envelope)>,
    /// When set, every frame routed to a peer, with its sender and receiver (golden fixtures).
    recorded: Option<Vec<(usize, usize, pb::Envelope)>>,
}

fn replica(id: &str) -> PeerIdentity {
    PeerIdentity::Replica { id: id.into() }
}

fn agent(cluster: &str, node: &str) -> PeerIdentity {
    PeerIdentity::Agent {
        cluster: cluster.into(),
        node: node.into(),
    }
}

fn kind(env: &pb::Envelope) -> &'static str {
    match env.body {
        Some(Body::Hello(_)) => "hello",
        Some(Body::Digest(_)) => "digest",
        Some(Body::BucketRequest(_)) => "bucket_request",
        Some(Body::BucketEntries(_)) => "bucket_entries",
        Some(Body::Sync(_)) => "sync",
        Some(Body::Ephemeral(_)) => "ephemeral",
        Some(Body::PeerExchange(_)) => "peer_exchange",
        Some(Body::Refusal(_)) => "refusal",
        None => "none",
    }
}

impl Sim {
    fn new(ids: Vec<PeerIdentity>) -> Self {
        Self::with_delays(ids, Duration::ZERO, Duration::ZERO)
    }

    fn with_relay_delay(ids: Vec<PeerIdentity>, relay_delay: Duration) -> Self {
        Self::with_delays(ids, relay_delay, Duration::ZERO)
    }

    fn with_delays(ids: Vec<PeerIdentity>, relay_delay: Duration, ack_delay: Duration) -> Self {
        Self::with_config(ids, |c| {
            c.relay_delay = relay_delay;
            c.ack_delay = ack_delay;
        })
    }

    fn with_config(ids: Vec<PeerIdentity>, set: impl FnOnce(&mut ProtocolConfig)) -> Self {
        let mut config = ProtocolConfig {
            anti_entropy_interval: Duration::from_secs(2),
            heartbeat_interval: Duration::from_secs(1),
            node_anti_entropy_interval: Duration::from_secs(2),
            node_heartbeat_interval: Duration::from_secs(1),
            peer_exchange_interval: Duration::from_secs(10),
            advertise_addr: None,
            max_entries_per_frame: 10_000,
            jitter_seed: 7,
            anti_entropy: true,
            push: true,
            relay_delay: Duration::ZERO,
            ack_delay: Duration::ZERO,
            max_repairs_per_round: 4096,
            carrier_grace: Duration::from_secs(3),
            peer_exchange: true,
        };
        set(&mut config);
        Sim {
            nodes: ids
                .into_iter()
                .map(|id| SimNode {
                    proto: Protocol::new(id, config.clone()),
                    store: MemStore::new(),
                    applied: vec![],
                })
                .collect(),
            links: vec![],
            queue: VecDeque::new(),
            now: Instant::now(),
            next_conn: 1,
            bytes: Default::default(),
            frames: Default::default(),
            syncs: Default::default(),
            bucket_requests: Vec::new(),
            drop_next_sync_from: None,
            hold_sync_from: None,
            hold_all_from: None,
            held: Vec::new(),
            recorded: None,
        }
    }

    fn connect(&mut self, a: usize, b: usize) -> usize {
        let conn_a = ConnId(self.next_conn);
        let conn_b = ConnId(self.next_conn + 1);
        self.next_conn += 2;
        self.links.push(Link {
            a,
            b,
            conn_a,
            conn_b,
            up: true,
        });
        let id_a = self.nodes[a].proto.local().clone();
        let id_b = self.nodes[b].proto.local().clone();
        let out = self.nodes[a].proto.on_connected(conn_a, id_b, self.now);
        self.route(a, out);
        let out = self.nodes[b].proto.on_connected(conn_b, id_a, self.now);
        self.route(b, out);
        self.links.len() - 1
    }

    fn disconnect(&mut self, link: usize) {
        let l = &mut self.links[link];
        if l.up {
            l.up = false;
            let (a, b, ca, cb) = (l.a, l.b, l.conn_a, l.conn_b);
            self.nodes[a].proto.on_disconnected(ca);
            self.nodes[b].proto.on_disconnected(cb);
        }
    }

    fn peer_of(&self, node: usize, conn: ConnId) -> Option<(usize, ConnId, usize)> {
        self.links.iter().enumerate().find_map(|(i, l)| {
            if !l.up {
                None
            } else if l.a == node && l.conn_a == conn {
                Some((l.b, l.conn_b, i))
            } else if l.b == node && l.conn_b == conn {
                Some((l.a, l.conn_a, i))
            } else {
                None
            }
        })
    }

    fn route(&mut self, from: usize, outputs: Vec<Output>) {
        for o in outputs {
            match o {
                Output::Send { conn, envelope } => {
                    if matches!(envelope.body, Some(Body::Sync(_)))
                        && self.drop_next_sync_from == Some(from)
                    {
                        self.drop_next_sync_from = None;
                        continue;
                    }
                    if let Some((to, to_conn, _)) = self.peer_of(from, conn) {
                        let len = wire::encode_frame(&envelope).unwrap().len();
                        *self.bytes.entry(kind(&envelope)).or_default() += len;
                        *self.frames.entry(kind(&envelope)).or_default() += 1;
                        if matches!(envelope.body, Some(Body::Sync(_))) {
                            *self.syncs.entry((from, to)).or_default() += 1;
                        }
                        if let Some(r) = &mut self.recorded {
                            r.push((from, to, envelope.clone()));
                        }
                        if let Some(Body::BucketRequest(r)) = &envelope.body {
                            self.bucket_requests
                                .push((from, r.buckets.clone(), r.entries.clone()));
                        }
                        if self.hold_all_from == Some(from)
                            || (matches!(envelope.body, Some(Body::Sync(_)))
                                && self.hold_sync_from == Some(from))
                        {
                            self.held.push((to, to_conn, envelope));
                        } else {
                            self.queue.push_back((to, to_conn, envelope));
                        }
                    }
                }
                Output::Close { conn, .. } => {
                    if let Some((_, _, link)) = self.peer_of(from, conn) {
                        self.disconnect(link);
                    }
                }
                Output::Applied { doc, .. } => self.nodes[from].applied.push(doc),
            }
        }
    }

    fn run(&mut self) {
        let mut steps = 0;
        while let Some((to, conn, env)) = self.queue.pop_front() {
            steps += 1;
            assert!(steps < 100_000, "protocol did not quiesce");
            let node = &mut self.nodes[to];
            let out = node
                .proto
                .handle_frame(&mut node.store, conn, env, self.now);
            self.route(to, out);
        }
    }

    /// Delivers the held Sync frames (late, but in order).
    fn release_held(&mut self) {
        self.queue.extend(self.held.drain(..));
        self.run();
    }

    fn tick(&mut self, dt: Duration) {
        self.now += dt;
        for i in 0..self.nodes.len() {
            let node = &mut self.nodes[i];
            let out = node.proto.on_tick(&mut node.store, self.now);
            self.route(i, out);
        }
        self.run();
    }

    fn write(&mut self, node: usize, doc: &DocId, key: &str, value: &str) {
        let n = &mut self.nodes[node];
        n.store.put(doc, key, value).unwrap();
        let out = n.proto.on_local_change(&mut n.store, doc);
        self.route(node, out);
        self.run();
    }

    /// One heartbeat round (replicas learn whom the agent reaches), then a first write by the
    /// agent at `node` that sets up its document's exchanges, settled for `delay`.
    fn settle_writer(&mut self, node: usize, doc: &DocId, delay: Duration) {
        self.tick(Duration::from_secs(1));
        self.write(node, doc, "gpu", "0");
        self.tick(delay);
    }

    fn entries(&self, node: usize) -> Vec<dramesh_store::DocEntry> {
        self.nodes[node].store.entries()
    }
}

/// Replicas r0, r1, r2 (nodes 0-2) and the agent of document c1/n1 (node 3), unconnected.
fn three_replicas_and_agent(relay_delay: Duration) -> Sim {
    Sim::with_relay_delay(
        vec![
            replica("r0"),
            replica("r1"),
            replica("r2"),
            agent("c1", "n1"),
        ],
        relay_delay,
    )
}

#[test]
fn push_and_relay_reach_every_replica() {
    // r0 - r1 - r2 in a chain; agent a0 only reaches r0.
    let mut sim = three_replicas_and_agent(Duration::ZERO);
    sim.connect(0, 1);
    sim.connect(1, 2);
    sim.connect(3, 0);
    sim.run();
    let doc = DocId::new("c1", "n1");
    sim.write(3, &doc, "gpu", "8");
    for r in 0..3 {
        assert_eq!(
            sim.nodes[r].store.get(&doc, "gpu").as_deref(),
            Some("8"),
            "replica {r}"
        );
    }
    assert!(sim.nodes[2].applied.contains(&doc));
    // No anti-entropy round was needed: push + relay did it.
    assert_eq!(sim.nodes[0].proto.counters().digest_mismatches, 0);
    sim.write(3, &doc, "gpu", "6");
    assert_eq!(sim.nodes[2].store.get(&doc, "gpu").as_deref(), Some("6"));
    assert_eq!(sim.entries(0), sim.entries(2));
    assert_eq!(sim.entries(3), sim.entries(1));
}

#[test]
fn relays_of_writer_changes_wait_and_carry_the_whole_window() {
    // r0 - r1; agent a0 reaches only r0. With a relay delay, r1 hears nothing of the writer's
    // changes until the delay has passed, then gets all of them in one exchange.
    let delay = Duration::from_millis(500);
    let mut sim =
        Sim::with_relay_delay(vec![replica("r0"), replica("r1"), agent("c1", "n1")], delay);
    sim.connect(0, 1);
    sim.connect(2, 0);
    sim.run();
    let doc = DocId::new("c1", "n1");
    let r1_sync_in = sim.nodes[1].proto.counters().sync_in;
    for v in 0..5 {
        sim.write(2, &doc, "gpu", &v.to_string());
    }
    assert_eq!(sim.nodes[0].store.get(&doc, "gpu").as_deref(), Some("4"));
    assert_eq!(
        sim.nodes[1].store.get(&doc, "gpu"),
        None,
        "relayed before the delay"
    );
    assert_eq!(sim.nodes[1].proto.counters().sync_in, r1_sync_in);
    sim.tick(delay / 2);
    assert_eq!(
        sim.nodes[1].store.get(&doc, "gpu"),
        None,
        "relayed before the delay"
    );
    sim.tick(delay / 2);
    assert_eq!(sim.nodes[1].store.get(&doc, "gpu").as_deref(), Some("4"));
    let exchanged = sim.nodes[1].proto.counters().sync_in - r1_sync_in;
    assert!(
        exchanged <= 3,
        "{exchanged} sync messages for one relay window"
    );
    assert_eq!(sim.entries(0), sim.entries(1));
    // A change relayed by a replica is passed on at once: r2 behind r1 gets it in the same
    // exchange that brings it to r1.
    let mut sim = three_replicas_and_agent(delay);
    sim.connect(0, 1);
    sim.connect(1, 2);
    sim.connect(3, 0);
    sim.run();
    sim.write(3, &doc, "gpu", "8");
    sim.tick(delay);
    assert_eq!(sim.nodes[2].store.get(&doc, "gpu").as_deref(), Some("8"));
}

/// r1 - r0 - r2, and the agent reaching r0 and r1 but not r2, connected.
fn agent_reaching_r0_and_r1(relay_delay: Duration) -> Sim {
    let mut sim = three_replicas_and_agent(relay_delay);
    sim.connect(0, 1);
    sim.connect(0, 2);
    sim.connect(3, 0);
    sim.connect(3, 1);
    sim.run();
    sim
}

#[test]
fn replicas_a_writer_reaches_itself_get_no_relay() {
    let delay = Duration::from_millis(500);
    let mut sim = agent_reaching_r0_and_r1(delay);
    let doc = DocId::new("c1", "n1");
    sim.settle_writer(3, &doc, delay);
    let r1_in = sim.nodes[1].proto.counters().sync_in;
    sim.write(3, &doc, "gpu", "8");
    sim.tick(delay);
    assert_eq!(sim.nodes[1].store.get(&doc, "gpu").as_deref(), Some("8"));
    assert_eq!(sim.nodes[2].store.get(&doc, "gpu").as_deref(), Some("8"));
    // r1 heard only from the agent (its change, and nothing relayed by r0): one message.
    assert_eq!(
        sim.nodes[1].proto.counters().sync_in - r1_in,
        1,
        "r1 got relays although the writer reaches it"
    );
    // Once the agent loses r1, the next heartbeat makes r0 relay to it again.
    let agent_r1 = sim.links.iter().position(|l| l.a == 3 && l.b == 1).unwrap();
    sim.disconnect(agent_r1);
    sim.tick(Duration::from_secs(1));
    sim.write(3, &doc, "gpu", "6");
    sim.tick(delay);
    assert_eq!(sim.nodes[1].store.get(&doc, "gpu").as_deref(), Some("6"));
}

#[test]
fn replicas_hear_whom_a_new_writer_reaches_at_its_first_tick() {
    // The agent writes a millisecond after connecting: its heartbeat interval (1 s) has not
    // passed, but r0 already knows not to relay to r1.
    let delay = Duration::from_millis(500);
    let mut sim = agent_reaching_r0_and_r1(delay);
    sim.tick(Duration::from_millis(1));
    let doc = DocId::new("c1", "n1");
    let relayed_to_r1 = |sim: &Sim| sim.syncs.get(&(0, 1)).copied().unwrap_or(0);
    let before = relayed_to_r1(&sim);
    sim.write(3, &doc, "gpu", "8");
    sim.tick(delay);
    assert_eq!(sim.nodes[1].store.get(&doc, "gpu").as_deref(), Some("8"));
    assert_eq!(sim.nodes[2].store.get(&doc, "gpu").as_deref(), Some("8"));
    assert_eq!(
        relayed_to_r1(&sim),
        before,
        "r0 relayed to r1 the agent reaches"
    );
}

#[test]
fn replicas_leave_a_document_to_its_writer_when_it_reaches_both() {
    let delay = Duration::from_millis(500);
    let mut sim =
        Sim::with_relay_delay(vec![replica("r0"), replica("r1"), agent("c1", "n1")], delay);
    sim.connect(0, 1);
    sim.connect(2, 0);
    sim.connect(2, 1);
    sim.run();
    let doc = DocId::new("c1", "n1");
    sim.settle_writer(2, &doc, delay);
    // The writer's change reaches only one replica.
    sim.drop_next_sync_from = Some(2);
    sim.write(2, &doc, "gpu", "1");
    let have: Vec<bool> = (0..2)
        .map(|r| sim.nodes[r].store.get(&doc, "gpu").as_deref() == Some("1"))
        .collect();
    assert_eq!(have.iter().filter(|h| **h).count(), 1, "{have:?}");
    // Anti-entropy rounds: the replicas leave the document to the writer (they compare their
    // digests without it), whose own round with the replica that missed the change repairs it.
    // (automerge alone would not resend the lost change even when asked for it by hash: the
    // two would exchange messages forever.)
    let between =
        |sim: &Sim| sim.syncs.get(&(0, 1)).unwrap_or(&0) + sim.syncs.get(&(1, 0)).unwrap_or(&0);
    let before = between(&sim);
    for _ in 0..4 {
        sim.tick(Duration::from_secs(1));
    }
    for r in 0..2 {
        assert_eq!(sim.nodes[r].store.get(&doc, "gpu").as_deref(), Some("1"));
    }
    assert_eq!(
        between(&sim),
        before,
        "replicas repaired the writer's document themselves"
    );
    assert!(
        sim.nodes[0].proto.counters().digest_mismatches
            + sim.nodes[1].proto.counters().digest_mismatches
            > 0,
        "the replicas' digests never differed"
    );
    assert_eq!(sim.entries(0), sim.entries(1));
}

#[test]
fn answers_to_a_writer_wait_and_cover_the_window() {
    let delay = Duration::from_millis(500);
    let mut sim = Sim::with_delays(
        vec![replica("r0"), agent("c1", "n1")],
        Duration::ZERO,
        delay,
    );
    sim.connect(1, 0);
    sim.run();
    let doc = DocId::new("c1", "n1");
    // The first exchange (the replica does not hold the document yet) is answered at once.
    sim.write(1, &doc, "gpu", "first");
    assert_eq!(
        sim.nodes[0].store.get(&doc, "gpu").as_deref(),
        Some("first")
    );
    sim.tick(delay);
    let agent_in = sim.nodes[1].proto.counters().sync_in;
    for v in 0..5 {
        sim.write(1, &doc, "gpu", &v.to_string());
    }
    assert_eq!(sim.nodes[0].store.get(&doc, "gpu").as_deref(), Some("4"));
    assert_eq!(
        sim.nodes[1].proto.counters().sync_in,
        agent_in,
        "answered before the delay"
    );
    sim.tick(delay);
    let answers = sim.nodes[1].proto.counters().sync_in - agent_in;
    assert_eq!(answers, 1, "one answer per window");
    // The answer leaves both in sync: nothing more is exchanged.
    let before = sim.nodes[0].proto.counters().sync_in;
    sim.tick(delay);
    assert_eq!(sim.nodes[0].proto.counters().sync_in, before);
    assert_eq!(sim.entries(0), sim.entries(1));
}

#[test]
fn anti_entropy_heals_a_partition_and_idle_rounds_are_small() {
    let mut ids = vec![replica("r0"), replica("r1")];
    for i in 0..4 {
        ids.push(agent("c1", &format!("n{i}")));
    }
    let mut sim = Sim::new(ids);
    let r01 = sim.connect(0, 1);
    sim.connect(2, 0);
    sim.connect(3, 0);
    sim.connect(4, 1);
    sim.connect(5, 1);
    sim.run();
    // Many documents so the digest size is visibly independent of the count.
    for i in 0..500 {
        let doc = DocId::new("bulk", format!("w{i}"));
        sim.nodes[0].store.put(&doc, "k", "v").unwrap();
    }
    sim.disconnect(r01);
    // Both sides keep accepting updates during the partition.
    sim.write(2, &DocId::new("c1", "n0"), "x", "left");
    sim.write(4, &DocId::new("c1", "n2"), "x", "right");
    assert!(
        sim.nodes[1]
            .store
            .get(&DocId::new("c1", "n0"), "x")
            .is_none()
    );
    // Heal: new connection, anti-entropy on hello.
    sim.connect(0, 1);
    sim.run();
    for _ in 0..3 {
        sim.tick(Duration::from_secs(1));
    }
    assert_eq!(sim.entries(0), sim.entries(1));
    assert_eq!(sim.entries(0).len(), 502);
    assert_eq!(
        sim.nodes[1]
            .store
            .get(&DocId::new("c1", "n0"), "x")
            .as_deref(),
        Some("left")
    );
    assert_eq!(
        sim.nodes[0]
            .store
            .get(&DocId::new("c1", "n2"), "x")
            .as_deref(),
        Some("right")
    );
    // Idle round: only probes (and heartbeats) flow; each probe is tiny.
    sim.bytes.clear();
    sim.frames.clear();
    let total_probes = |sim: &Sim| -> u64 {
        sim.nodes
            .iter()
            .map(|n| n.proto.counters().digest_probes_sent)
            .sum()
    };
    let before = total_probes(&sim);
    sim.tick(Duration::from_secs(3));
    let probes = total_probes(&sim) - before;
    assert!(probes >= 2, "probes {probes}");
    let digest_bytes = sim.bytes.get("digest").copied().unwrap_or(0);
    println!("frames: {:?}", sim.frames);
    assert!(!sim.bytes.contains_key("sync"), "{:?}", sim.bytes);
    assert!(!sim.bytes.contains_key("bucket_request"), "{:?}", sim.bytes);
    assert!(
        digest_bytes <= probes as usize * 20,
        "digest bytes {digest_bytes} for {probes} probes"
    );
    println!(
        "idle round bytes by kind: {:?} ({probes} probes)",
        sim.bytes
    );
}

#[test]
fn lost_sync_message_is_repaired_by_anti_entropy() {
    let mut sim = Sim::new(vec![replica("r0"), agent("c1", "n1")]);
    sim.connect(1, 0);
    sim.run();
    let doc = DocId::new("c1", "n1");
    sim.drop_next_sync_from = Some(1);
    sim.write(1, &doc, "k", "v1");
    assert!(sim.nodes[0].store.get(&doc, "k").is_none());
    // A later local change is stuck behind the in-flight state until anti-entropy resets it:
    // the mismatch must persist across two rounds, and a round waits until the replica's
    // heartbeat reports having handled the frames of the one before.
    for _ in 0..6 {
        sim.tick(Duration::from_secs(1));
    }
    assert_eq!(sim.nodes[0].store.get(&doc, "k").as_deref(), Some("v1"));
    assert!(sim.nodes[1].proto.counters().sync_resets >= 1);
}

#[test]
fn mismatch_while_sync_progresses_does_not_reset() {
    let mut sim = Sim::new(vec![replica("r0"), agent("c1", "n1")]);
    sim.connect(1, 0);
    sim.run();
    let doc = DocId::new("c1", "n1");
    // The agent keeps writing; each of its sync messages arrives late, after the probes of
    // that second have already seen the replica behind.
    sim.hold_sync_from = Some(1);
    for i in 0..12 {
        sim.write(1, &doc, "k", &format!("v{i}"));
        sim.tick(Duration::from_secs(1));
        sim.release_held();
    }
    let mismatches: u64 = (0..2)
        .map(|n| sim.nodes[n].proto.counters().digest_mismatches)
        .sum();
    assert!(
        mismatches >= 2,
        "probes must have seen the lag: {mismatches}"
    );
    for n in 0..2 {
        assert_eq!(
            sim.nodes[n].proto.counters().sync_resets,
            0,
            "node {n} reset a progressing sync"
        );
    }
    assert_eq!(sim.nodes[0].store.get(&doc, "k").as_deref(), Some("v11"));
    assert_eq!(sim.entries(0), sim.entries(1));
}

#[test]
fn mismatch_without_progress_resets_after_a_second_probe_and_converges() {
    let mut sim = Sim::new(vec![replica("r0"), agent("c1", "n1")]);
    sim.connect(1, 0);
    sim.run();
    let doc = DocId::new("c1", "n1");
    sim.drop_next_sync_from = Some(1);
    sim.write(1, &doc, "k", "v1");
    assert!(sim.nodes[0].store.get(&doc, "k").is_none());
    let resets = |sim: &Sim| -> u64 {
        (0..2)
            .map(|n| sim.nodes[n].proto.counters().sync_resets)
            .sum()
    };
    let mismatches = |sim: &Sim| -> u64 {
        (0..2)
            .map(|n| sim.nodes[n].proto.counters().digest_mismatches)
            .sum()
    };
    let mut first_mismatch = None;
    let mut first_reset = None;
    let mut t = Duration::ZERO;
    for _ in 0..40 {
        sim.tick(Duration::from_millis(250));
        t += Duration::from_millis(250);
        if first_mismatch.is_none() && mismatches(&sim) > 0 {
            first_mismatch = Some(t);
            // The first mismatch only continues the stuck exchange.
            assert_eq!(resets(&sim), 0, "reset on the first mismatch");
        }
        if first_reset.is_none() && resets(&sim) > 0 {
            first_reset = Some(t);
        }
    }
    let (Some(m), Some(r)) = (first_mismatch, first_reset) else {
        panic!("mismatch at {first_mismatch:?}, reset at {first_reset:?}");
    };
    // A reset needs the mismatch to persist for 3/4 of the 2 s probe interval.
    assert!(
        r >= m + Duration::from_millis(1500),
        "mismatch {m:?}, reset {r:?}"
    );
    assert_eq!(sim.nodes[0].store.get(&doc, "k").as_deref(), Some("v1"));
    assert_eq!(sim.entries(0), sim.entries(1));
}

#[test]
fn agent_may_only_sync_its_own_document() {
    let mut sim = Sim::new(vec![replica("r0"), agent("a", "n1")]);
    let link = sim.connect(1, 0);
    sim.run();
    // Forge a sync for cluster b's document from agent (a, n1).
    let victim = DocId::new("b", "n1");
    let mut forged_store = MemStore::new();
    forged_store.put(&victim, "gpu", "999").unwrap();
    let mut state = dramesh_store::SyncState::new();
    let (payload, _) = forged_store
        .generate_sync_message(&victim, &mut state)
        .unwrap();
    let env = wire::envelope(Body::Sync(pb::Sync {
        doc: Some((&victim).into()),
        generation: 1,
        payload,
        signed: None,
    }));
    let conn = sim.links[link].conn_b;
    let node = &mut sim.nodes[0];
    let out = node.proto.handle_frame(&mut node.store, conn, env, sim.now);
    assert!(out.is_empty());
    assert_eq!(node.proto.counters().rejected_unauthorized, 1);
    assert!(node.store.entry(&victim).is_none());
    // Same agent, other writer in its own cluster: also refused.
    let env = wire::envelope(Body::BucketEntries(pb::BucketEntries {
        buckets: vec![DocId::new("a", "n2").bucket()],
        entries: vec![pb::DocEntry {
            doc: Some((&DocId::new("a", "n2")).into()),
            generation: 1,
            heads_hash: vec![0; 32],
            heads: vec![],
        }],
    }));
    let out = node.proto.handle_frame(&mut node.store, conn, env, sim.now);
    assert!(out.is_empty());
    assert_eq!(node.proto.counters().rejected_unauthorized, 2);
}

#[test]
fn store_rejects_changes_by_a_foreign_actor_even_via_a_replica() {
    // Replica r1 (compromised) relays a doc (c1, n1) whose change was authored by another actor.
    let mut sim = Sim::new(vec![replica("r0"), replica("r1")]);
    sim.connect(0, 1);
    sim.run();
    let doc = DocId::new("c1", "n1");
    let mut forged =
        automerge::Automerge::new().with_actor(automerge::ActorId::from(&[9u8; 16][..]));
    {
        use automerge::transaction::Transactable;
        let mut tx = forged.transaction();
        tx.put(automerge::ROOT, "gpu", "999").unwrap();
        tx.commit();
    }
    use automerge::sync::SyncDoc;
    let mut st = automerge::sync::State::new();
    let conn = sim.links[0].conn_a;
    let node = &mut sim.nodes[0];
    // Run the automerge exchange between the forged document and r0 until the changes flow.
    for _ in 0..6 {
        let Some(msg) = forged.generate_sync_message(&mut st) else {
            break;
        };
        let env = wire::envelope(Body::Sync(pb::Sync {
            doc: Some((&doc).into()),
            generation: 1,
            payload: msg.encode(),
            signed: None,
        }));
        for o in node.proto.handle_frame(&mut node.store, conn, env, sim.now) {
            if let Output::Send { envelope, .. } = o
                && let Some(Body::Sync(reply)) = envelope.body
            {
                let m = automerge::sync::Message::decode(&reply.payload).unwrap();
                forged.receive_sync_message(&mut st, m).unwrap();
            }
        }
        if node.proto.counters().rejected_by_store > 0 {
            break;
        }
    }
    assert_eq!(node.proto.counters().rejected_by_store, 1);
    assert!(node.store.entry(&doc).is_none());
}

#[test]
fn protocol_violations_close_the_connection() {
    let mut sim = Sim::new(vec![replica("r0"), replica("r1")]);
    // Connect only r0's side so r1's hello is not delivered automatically.
    let conn = ConnId(99);
    let out = sim.nodes[0]
        .proto
        .on_connected(conn, replica("r1"), sim.now);
    assert!(
        matches!(&out[0], Output::Send { envelope, .. } if matches!(envelope.body, Some(Body::Hello(_))))
    );
    let node = &mut sim.nodes[0];
    let probe = wire::envelope(Body::Digest(pb::Digest {
        root: 1,
        buckets: vec![],
    }));
    let out = node
        .proto
        .handle_frame(&mut node.store, conn, probe, sim.now);
    assert!(matches!(out.as_slice(), [Output::Close { .. }]));
    // A Hello whose identity disagrees with the certificate.
    let conn2 = ConnId(100);
    node.proto.on_connected(conn2, replica("r1"), sim.now);
    let lie = wire::envelope(Body::Hello(pb::Hello {
        protocol_version: dramesh_mesh::protocol::PROTOCOL_VERSION,
        role: pb::Role::Replica as i32,
        identity: "dramesh://replica/r9".into(),
        advertise_addr: String::new(),
        relay: false,
        ..Default::default()
    }));
    let out = node
        .proto
        .handle_frame(&mut node.store, conn2, lie, sim.now);
    assert!(matches!(out.as_slice(), [Output::Close { .. }]));
    assert_eq!(node.proto.counters().protocol_errors, 2);
    // Agents never talk to agents of another cluster (closed at once), nor to agents of their
    // own unless one of the two is the cluster's relay (closed at the hello, which says).
    let mut a = Protocol::new(agent("c", "n1"), ProtocolConfig::default());
    let out = a.on_connected(ConnId(1), agent("d", "n2"), sim.now);
    assert!(matches!(out.as_slice(), [Output::Close { .. }]));
    let mut sim = Sim::new(vec![agent("c", "n1"), agent("c", "n2")]);
    sim.connect(0, 1);
    sim.run();
    assert!(!sim.links[0].up, "two node agents kept a session");
    assert!(sim.nodes[0].proto.sessions().is_empty());
    let refused: u64 = (0..2)
        .map(|i| sim.nodes[i].proto.counters().rejected_unauthorized)
        .sum();
    assert!(refused >= 1, "the session was not refused as unauthorized");
}

#[test]
fn new_generation_replaces_the_old_one_everywhere() {
    let mut sim = Sim::new(vec![replica("r0"), replica("r1"), agent("c1", "n1")]);
    sim.connect(0, 1);
    sim.connect(2, 0);
    sim.run();
    let doc = DocId::new("c1", "n1");
    sim.write(2, &doc, "k", "gen1");
    let generation = sim.nodes[2].store.roll_generation(&doc).unwrap();
    assert_eq!(generation, 2);
    sim.write(2, &doc, "k", "gen2");
    for n in 0..3 {
        let e = sim.nodes[n].store.entry(&doc).unwrap();
        assert_eq!(e.generation, 2, "node {n}");
        assert_eq!(sim.nodes[n].store.get(&doc, "k").as_deref(), Some("gen2"));
    }
}

#[test]
fn replicas_learn_each_other_through_peer_exchange() {
    let mut sim = Sim::new(vec![replica("r0"), replica("r1"), replica("r2")]);
    let config = |addr: &str| ProtocolConfig {
        advertise_addr: Some(addr.into()),
        jitter_seed: 1,
        ..ProtocolConfig::default()
    };
    sim.nodes[0].proto = Protocol::new(replica("r0"), config("10.0.0.0:1"));
    sim.nodes[1].proto = Protocol::new(replica("r1"), config("10.0.0.1:1"));
    sim.nodes[2].proto = Protocol::new(replica("r2"), config("10.0.0.2:1"));
    // r2 only knows r1 (its seed); r0 knows r1.
    sim.connect(0, 1);
    sim.run();
    sim.connect(2, 1);
    sim.run();
    sim.tick(Duration::from_secs(11));
    let known = sim.nodes[2].proto.known_replicas();
    assert_eq!(
        known.get("dramesh://replica/r0").map(String::as_str),
        Some("10.0.0.0:1")
    );
    assert!(
        !known.contains_key("dramesh://replica/r2"),
        "learned itself"
    );
    assert_eq!(
        sim.nodes[0]
            .proto
            .known_replicas()
            .get("dramesh://replica/r2")
            .map(String::as_str),
        Some("10.0.0.2:1")
    );
}

/// A replica that learns a new replica tells its sessions at the next tick, not at the next
/// periodic exchange: relays then dial the new replica at once.
#[test]
fn a_new_replica_is_announced_at_the_next_tick() {
    let mut sim = Sim::new(vec![replica("r0"), agent("east", "a"), replica("r3")]);
    let config = |addr: &str| ProtocolConfig {
        advertise_addr: Some(addr.into()),
        jitter_seed: 1,
        ..ProtocolConfig::default()
    };
    sim.nodes[0].proto = Protocol::new(replica("r0"), config("10.0.0.0:1"));
    sim.nodes[2].proto = Protocol::new(replica("r3"), config("10.0.0.3:1"));
    sim.connect(1, 0);
    sim.run();
    // Past the first exchanges of the agent's session.
    sim.tick(Duration::from_secs(11));
    assert!(
        !sim.nodes[1]
            .proto
            .known_replicas()
            .contains_key("dramesh://replica/r3")
    );
    sim.connect(2, 0);
    sim.run();
    // One tick (the node ticks every 100 ms), far before the next periodic exchange.
    sim.tick(Duration::from_millis(100));
    assert_eq!(
        sim.nodes[1]
            .proto
            .known_replicas()
            .get("dramesh://replica/r3")
            .map(String::as_str),
        Some("10.0.0.3:1"),
        "the agent did not hear of the new replica at once"
    );
    // Nothing new: no further announcement.
    let sent = sim.frames.get("peer_exchange").copied().unwrap_or(0);
    sim.tick(Duration::from_millis(100));
    assert_eq!(sim.frames.get("peer_exchange").copied().unwrap_or(0), sent);
}

#[test]
fn without_peer_exchange_an_agent_learns_only_the_replica_it_dialed() {
    for peer_exchange in [true, false] {
        let mut sim = Sim::new(vec![replica("r0"), replica("r1"), agent("east", "a")]);
        let config = |addr: &str| ProtocolConfig {
            advertise_addr: Some(addr.into()),
            jitter_seed: 1,
            peer_exchange,
            ..ProtocolConfig::default()
        };
        sim.nodes[0].proto = Protocol::new(replica("r0"), config("10.0.0.0:1"));
        sim.nodes[1].proto = Protocol::new(replica("r1"), config("10.0.0.1:1"));
        sim.connect(0, 1);
        sim.connect(2, 0);
        sim.run();
        sim.tick(Duration::from_secs(11));
        sim.tick(Duration::from_secs(11));
        let known: Vec<&str> = sim.nodes[2]
            .proto
            .known_replicas()
            .keys()
            .map(String::as_str)
            .collect();
        if peer_exchange {
            assert!(sim.frames.get("peer_exchange").is_some_and(|n| *n > 0));
            assert_eq!(known, ["dramesh://replica/r0", "dramesh://replica/r1"]);
        } else {
            assert_eq!(
                sim.frames.get("peer_exchange"),
                None,
                "a replica sent PeerExchange although it is turned off"
            );
            assert_eq!(
                known,
                ["dramesh://replica/r0"],
                "the agent learned {known:?}"
            );
        }
        // Hello still carries the dialed replica's address, so replicas seeded with each
        // other know each other either way.
        assert!(
            sim.nodes[1]
                .proto
                .known_replicas()
                .contains_key("dramesh://replica/r0")
        );
    }
}

/// Replicas r0, r1 (nodes 0, 1); the relay of cluster c1, agent c1/lead (node 2); node agents
/// c1/n1 and c1/n2 (nodes 3, 4) that reach only the relay. The relay reaches both replicas.
fn relay_fleet(relay_delay: Duration) -> Sim {
    let mut sim = Sim::with_delays(
        vec![
            replica("r0"),
            replica("r1"),
            agent("c1", "lead"),
            agent("c1", "n1"),
            agent("c1", "n2"),
        ],
        relay_delay,
        Duration::ZERO,
    );
    assert!(sim.nodes[2].proto.set_relay(true).is_empty());
    sim.connect(0, 1);
    sim.connect(2, 0);
    sim.connect(2, 1);
    sim.connect(3, 2);
    sim.connect(4, 2);
    sim.run();
    // A heartbeat round: replicas learn which replicas the relay reaches.
    sim.tick(Duration::from_secs(1));
    sim
}

#[test]
fn a_relay_carries_its_nodes_documents_to_every_replica_at_once() {
    let delay = Duration::from_millis(500);
    let mut sim = relay_fleet(delay);
    let (n1, n2, lead) = (
        DocId::new("c1", "n1"),
        DocId::new("c1", "n2"),
        DocId::new("c1", "lead"),
    );
    sim.write(3, &n1, "gpu", "8");
    sim.write(4, &n2, "gpu", "4");
    sim.write(2, &lead, "class", "gpu");
    // No tick: the relay forwards at once, whatever the replicas' relay delay.
    for r in 0..2 {
        assert_eq!(
            sim.nodes[r].store.get(&n1, "gpu").as_deref(),
            Some("8"),
            "r{r}"
        );
        assert_eq!(
            sim.nodes[r].store.get(&n2, "gpu").as_deref(),
            Some("4"),
            "r{r}"
        );
        assert_eq!(
            sim.nodes[r].store.get(&lead, "class").as_deref(),
            Some("gpu"),
            "r{r}"
        );
    }
    assert_eq!(sim.nodes[2].store.get(&n1, "gpu").as_deref(), Some("8"));
    // Each node agent holds only its own document; each session exchanged only its scope.
    assert_eq!(sim.nodes[3].store.len(), 1);
    assert_eq!(sim.nodes[4].store.len(), 1);
    for s in sim.nodes[2].proto.sessions() {
        let want = match &s.identity {
            PeerIdentity::Replica { .. } => dramesh_mesh::protocol::Scope::Cluster("c1".into()),
            PeerIdentity::Agent { cluster, node } => {
                dramesh_mesh::protocol::Scope::Doc(DocId::new(cluster.clone(), node.clone()))
            }
        };
        assert_eq!(s.scope.as_ref(), Some(&want), "{}", s.identity);
    }
    // The relay reaches both replicas, so they pass nothing of its cluster to each other.
    let r1_in = sim.nodes[1].proto.counters().sync_in;
    sim.write(3, &n1, "gpu", "6");
    sim.tick(delay);
    sim.tick(delay);
    assert_eq!(sim.nodes[1].store.get(&n1, "gpu").as_deref(), Some("6"));
    assert_eq!(
        sim.nodes[1].proto.counters().sync_in - r1_in,
        1,
        "r1 got the change from r0 too although the relay reaches it"
    );
    // Anti-entropy agrees everywhere and leaves the cluster to the relay between replicas.
    for _ in 0..3 {
        sim.tick(Duration::from_secs(1));
    }
    assert_eq!(sim.entries(0), sim.entries(1));
    assert_eq!(sim.entries(0), sim.entries(2));
    for n in 0..5 {
        assert_eq!(
            sim.nodes[n].proto.counters().rejected_unauthorized,
            0,
            "node {n}"
        );
    }
}

#[test]
fn a_new_relay_pulls_its_cluster_and_nothing_else_from_the_replicas() {
    let mut sim = Sim::new(vec![
        replica("r0"),
        agent("c1", "n1"),
        agent("c2", "n1"),
        agent("c1", "lead"),
    ]);
    sim.connect(1, 0);
    sim.connect(2, 0);
    sim.run();
    let (c1, c2) = (DocId::new("c1", "n1"), DocId::new("c2", "n1"));
    sim.write(1, &c1, "gpu", "1");
    sim.write(2, &c2, "gpu", "2");
    assert!(sim.nodes[3].proto.set_relay(true).is_empty());
    sim.connect(3, 0);
    sim.run();
    sim.tick(Duration::from_secs(3));
    assert_eq!(sim.nodes[3].store.get(&c1, "gpu").as_deref(), Some("1"));
    assert_eq!(
        sim.nodes[3].store.entry(&c2),
        None,
        "another cluster's document"
    );
    assert_eq!(sim.nodes[0].proto.counters().rejected_unauthorized, 0);
}

#[test]
fn a_node_cannot_write_another_nodes_document_through_the_relay() {
    let mut sim = relay_fleet(Duration::ZERO);
    let (n1, n2) = (DocId::new("c1", "n1"), DocId::new("c1", "n2"));
    sim.write(4, &n2, "gpu", "4");
    // n1 builds a genuine automerge message for n2's document (the in-memory store does not
    // sign: the scope alone must stop it) and sends it on its session with the relay.
    let mut forged = MemStore::new();
    forged.put(&n2, "gpu", "999").unwrap();
    let mut state = dramesh_store::SyncState::new();
    let (payload, _) = forged.generate_sync_message(&n2, &mut state).unwrap();
    let n1_conn = sim
        .links
        .iter()
        .find(|l| l.a == 3 && l.b == 2)
        .map(|l| l.conn_b)
        .unwrap();
    let before = sim.nodes[2].proto.counters().rejected_unauthorized;
    let env = wire::envelope(Body::Sync(pb::Sync {
        doc: Some((&n2).into()),
        generation: forged.entry(&n2).unwrap().generation,
        payload,
        signed: None,
    }));
    sim.queue.push_back((2, n1_conn, env));
    sim.run();
    assert_eq!(
        sim.nodes[2].proto.counters().rejected_unauthorized,
        before + 1
    );
    for n in [0, 1, 2] {
        assert_eq!(
            sim.nodes[n].store.get(&n2, "gpu").as_deref(),
            Some("4"),
            "node {n}"
        );
    }
    // Its own document still goes through.
    sim.write(3, &n1, "gpu", "1");
    assert_eq!(sim.nodes[0].store.get(&n1, "gpu").as_deref(), Some("1"));
}

#[test]
fn a_relay_cannot_push_a_document_of_another_cluster() {
    let mut sim = relay_fleet(Duration::ZERO);
    let other = DocId::new("c2", "n1");
    let mut forged = MemStore::new();
    forged.put(&other, "gpu", "999").unwrap();
    let mut state = dramesh_store::SyncState::new();
    let (payload, _) = forged.generate_sync_message(&other, &mut state).unwrap();
    let relay_at_r0 = sim
        .links
        .iter()
        .find(|l| l.a == 2 && l.b == 0)
        .map(|l| l.conn_b)
        .unwrap();
    let env = wire::envelope(Body::Sync(pb::Sync {
        doc: Some((&other).into()),
        generation: forged.entry(&other).unwrap().generation,
        payload,
        signed: None,
    }));
    sim.queue.push_back((0, relay_at_r0, env));
    sim.run();
    assert_eq!(sim.nodes[0].proto.counters().rejected_unauthorized, 1);
    assert_eq!(sim.nodes[0].store.entry(&other), None);
    // Bucket entries naming it are ignored the same way.
    let env = wire::envelope(Body::BucketEntries(pb::BucketEntries {
        buckets: vec![other.bucket()],
        entries: vec![pb::DocEntry::from(&forged.entry(&other).unwrap())],
    }));
    sim.queue.push_back((0, relay_at_r0, env));
    sim.run();
    assert_eq!(sim.nodes[0].proto.counters().rejected_unauthorized, 2);
}

#[test]
fn relay_sessions_need_exactly_one_relay_of_the_same_cluster() {
    // Two relays of one cluster (a Lease handover) do not talk; a replica claiming to relay
    // is a protocol error; an agent of another cluster is refused by a relay.
    for (a, a_relay, b, b_relay) in [
        (agent("c1", "a"), true, agent("c1", "b"), true),
        (agent("c2", "a"), false, agent("c1", "b"), true),
        (replica("r0"), false, agent("c1", "b"), false),
    ] {
        let mut sim = Sim::new(vec![a.clone(), b.clone()]);
        sim.nodes[0].proto.set_relay(a_relay);
        sim.nodes[1].proto.set_relay(b_relay);
        sim.connect(0, 1);
        sim.run();
        if a.is_replica() {
            // A replica cannot be a relay: set_relay is ignored, and the session holds.
            assert!(!sim.nodes[0].proto.is_relay());
            assert!(sim.links[0].up);
            continue;
        }
        assert!(!sim.links[0].up, "{a} and {b} kept a session");
    }
    // A replica that claims to relay in its hello is refused.
    let mut p = Protocol::new(agent("c1", "n1"), ProtocolConfig::default());
    let now = Instant::now();
    p.on_connected(ConnId(1), replica("r0"), now);
    let out = p.handle_frame(
        &mut MemStore::new(),
        ConnId(1),
        wire::envelope(Body::Hello(pb::Hello {
            protocol_version: dramesh_mesh::protocol::PROTOCOL_VERSION,
            role: pb::Role::Replica as i32,
            identity: replica("r0").uri(),
            advertise_addr: String::new(),
            relay: true,
            ..Default::default()
        })),
        now,
    );
    assert!(matches!(out.as_slice(), [Output::Close { .. }]), "{out:?}");
}

#[test]
fn stepping_down_closes_every_session_and_the_next_ones_are_direct() {
    let mut sim = relay_fleet(Duration::ZERO);
    let closes = sim.nodes[2].proto.set_relay(false);
    assert_eq!(closes.len(), 4, "{closes:?}");
    assert!(closes.iter().all(|o| matches!(o, Output::Close { .. })));
    assert!(sim.nodes[2].proto.sessions().is_empty());
    // Redialed as a plain node agent, it exchanges only its own document with a replica, and a
    // node agent may no longer talk to it.
    let (r0, n1) = (sim.connect(2, 0), sim.connect(3, 2));
    sim.run();
    assert!(sim.links[r0].up);
    assert!(!sim.links[n1].up);
    let s = sim.nodes[2]
        .proto
        .sessions()
        .into_iter()
        .find(|s| s.identity.is_replica())
        .unwrap();
    assert_eq!(
        s.scope,
        Some(dramesh_mesh::protocol::Scope::Doc(DocId::new("c1", "lead")))
    );
}

#[test]
fn anti_entropy_repairs_a_bounded_number_of_documents_per_round() {
    // r0 holds 20 documents (written while alone, push off), r1 none; with at most 5 repairs
    // per round, the first round brings at most 5 and later rounds the rest.
    let mut sim = Sim::with_config(vec![replica("r0"), replica("r1")], |c| {
        c.max_repairs_per_round = 5;
        c.push = false;
    });
    let docs: Vec<DocId> = (0..20).map(|i| DocId::new("c1", format!("n{i}"))).collect();
    for d in &docs {
        sim.nodes[0].store.put(d, "gpu", "1").unwrap();
    }
    sim.connect(0, 1);
    sim.run();
    let held = |sim: &Sim| sim.nodes[1].store.len();
    assert!(
        held(&sim) <= 10,
        "{} documents after the hello round",
        held(&sim)
    );
    for _ in 0..20 {
        sim.tick(Duration::from_secs(2));
    }
    assert_eq!(held(&sim), 20);
    assert_eq!(sim.entries(0), sim.entries(1));
}

#[test]
fn bucket_requests_carry_whole_buckets_within_the_frame_limit() {
    // r0 holds 200 documents, r1 none: r0 lists every differing bucket's entries in frames of
    // at most 16 entries, each frame whole buckets, every document listed once.
    let mut sim = Sim::with_config(vec![replica("r0"), replica("r1")], |c| {
        c.max_entries_per_frame = 16;
        c.push = false;
        c.carrier_grace = Duration::ZERO;
    });
    let docs: Vec<DocId> = (0..200)
        .map(|i| DocId::new(format!("c{}", i % 3), format!("n{i}")))
        .collect();
    for d in &docs {
        sim.nodes[0].store.put(d, "gpu", "1").unwrap();
    }
    sim.connect(0, 1);
    sim.run();
    let from_r0: Vec<&(usize, Vec<u32>, Vec<pb::DocEntry>)> = sim
        .bucket_requests
        .iter()
        .filter(|(f, _, _)| *f == 0)
        .collect();
    assert!(from_r0.len() >= 200 / 16, "{} frames", from_r0.len());
    let mut listed: Vec<String> = Vec::new();
    let mut buckets_seen: Vec<u32> = Vec::new();
    for (_, buckets, entries) in &from_r0 {
        assert!(
            entries.len() <= 16,
            "{} entries in one frame",
            entries.len()
        );
        for e in entries {
            let doc = e.doc.as_ref().expect("doc id");
            let id = DocId::new(doc.cluster.clone(), doc.writer.clone());
            assert!(
                buckets.contains(&id.bucket()),
                "entry outside the frame's buckets"
            );
            listed.push(id.to_string());
        }
        // Whole buckets: every document of a listed bucket is in this frame.
        for b in buckets {
            let in_bucket = docs.iter().filter(|d| d.bucket() == *b).count();
            let in_frame = entries
                .iter()
                .filter(|e| {
                    let d = e.doc.as_ref().expect("doc id");
                    DocId::new(d.cluster.clone(), d.writer.clone()).bucket() == *b
                })
                .count();
            assert_eq!(in_frame, in_bucket, "bucket {b} split across frames");
        }
        buckets_seen.extend(buckets);
    }
    let total = listed.len();
    listed.sort();
    listed.dedup();
    assert_eq!(listed.len(), 200, "every document listed");
    assert_eq!(total, 200, "no document listed twice");
    let n = buckets_seen.len();
    buckets_seen.sort_unstable();
    buckets_seen.dedup();
    assert_eq!(buckets_seen.len(), n, "no bucket in two frames");
    for _ in 0..5 {
        sim.tick(Duration::from_secs(2));
    }
    assert_eq!(sim.entries(0), sim.entries(1));
}

/// Two replicas that share 60 documents; while apart, r0 changes documents 0–39 and r1
/// documents 40–59 (push off: only anti-entropy repairs; no carriers, so no grace for them).
/// Returns the sim, reconnected but not yet run.
fn replicas_apart_then_reconnected() -> (Sim, Vec<DocId>) {
    let mut sim = Sim::with_config(vec![replica("r0"), replica("r1")], |c| {
        c.push = false;
        c.carrier_grace = Duration::ZERO;
    });
    let docs: Vec<DocId> = (0..60).map(|i| DocId::new("c1", format!("n{i}"))).collect();
    for d in &docs {
        sim.nodes[0].store.put(d, "gpu", "0").unwrap();
    }
    let link = sim.connect(0, 1);
    sim.run();
    for _ in 0..5 {
        sim.tick(Duration::from_secs(2));
    }
    assert_eq!(sim.entries(0), sim.entries(1));
    sim.disconnect(link);
    for d in &docs[..40] {
        sim.nodes[0].store.put(d, "gpu", "1").unwrap();
    }
    for (i, d) in docs[40..].iter().enumerate() {
        // Each document has one writer: r1 continues r0's history of these.
        let theirs = sim.nodes[0].store.get(d, "gpu");
        assert_eq!(theirs.as_deref(), Some("0"));
        sim.nodes[1]
            .store
            .put(d, "gpu", &format!("r1-{i}"))
            .unwrap();
    }
    sim.syncs.clear();
    sim.connect(0, 1);
    (sim, docs)
}

/// Runs `rounds` anti-entropy rounds of [`replicas_apart_then_reconnected`]'s replicas and
/// checks they hold the same, newest, documents.
fn converge_apart_replicas(sim: &mut Sim, docs: &[DocId], rounds: usize) {
    for _ in 0..rounds {
        sim.tick(Duration::from_secs(2));
    }
    assert_eq!(sim.entries(0), sim.entries(1));
    for d in &docs[..40] {
        assert_eq!(sim.nodes[1].store.get(d, "gpu").as_deref(), Some("1"));
    }
    for (i, d) in docs[40..].iter().enumerate() {
        let theirs = format!("r1-{i}");
        assert_eq!(sim.nodes[0].store.get(d, "gpu"), Some(theirs));
    }
}

#[test]
fn after_a_partition_the_side_ahead_starts_each_repair_with_the_changes() {
    // Each side holds every head the other listed for the documents it changed, so its first
    // message carries the changes after them, and the side behind leaves those documents to
    // it: per document the changes and the answer, 120 sync frames (180 when the side behind
    // opened each repair).
    let (mut sim, docs) = replicas_apart_then_reconnected();
    sim.run();
    converge_apart_replicas(&mut sim, &docs, 3);
    let syncs: usize = sim.syncs.values().sum();
    println!("sync frames after the heal: {:?}", sim.syncs);
    let (c0, c1) = (sim.nodes[0].proto.counters(), sim.nodes[1].proto.counters());
    assert_eq!(c0.repairs_from_listed_heads, 40);
    assert_eq!(c1.repairs_from_listed_heads, 20);
    assert_eq!(c0.repairs_left_to_peer, 20);
    assert_eq!(c1.repairs_left_to_peer, 40);
    assert!(
        syncs <= 2 * docs[..].len(),
        "{syncs} sync frames for 60 documents"
    );
    assert_eq!(c0.sync_resets, 0);
    assert_eq!(c1.sync_resets, 0);
}

#[test]
fn a_lost_first_message_of_the_side_ahead_is_repaired_by_later_rounds() {
    // The side behind leaves the repair to the side ahead for 0.75 anti-entropy intervals;
    // when the changes the side ahead sent first are lost, the next rounds find the document
    // still differing and start its sync again.
    let (mut sim, docs) = replicas_apart_then_reconnected();
    let dropped_doc = pb::DocId::from(&docs[40]);
    let mut dropped = 0;
    let mut steps = 0;
    while let Some((to, conn, env)) = sim.queue.pop_front() {
        steps += 1;
        assert!(steps < 100_000, "protocol did not quiesce");
        if to == 0
            && dropped == 0
            && matches!(&env.body, Some(Body::Sync(s)) if s.doc.as_ref() == Some(&dropped_doc))
        {
            dropped += 1;
            continue;
        }
        let node = &mut sim.nodes[to];
        let out = node.proto.handle_frame(&mut node.store, conn, env, sim.now);
        sim.route(to, out);
    }
    let lost = docs[40..]
        .iter()
        .enumerate()
        .filter(|(i, d)| sim.nodes[0].store.get(d, "gpu") != Some(format!("r1-{i}")))
        .count();
    assert_eq!(lost, 1, "one document's changes were dropped");
    converge_apart_replicas(&mut sim, &docs, 6);
    let resets =
        sim.nodes[0].proto.counters().sync_resets + sim.nodes[1].proto.counters().sync_resets;
    assert!(resets >= 1);
}

#[test]
fn entries_without_heads_are_repaired_from_both_sides_as_before() {
    // An older peer lists no heads: nothing is left to it, and the partition still heals.
    let (mut sim, docs) = replicas_apart_then_reconnected();
    let mut steps = 0;
    while let Some((to, conn, mut env)) = sim.queue.pop_front() {
        steps += 1;
        assert!(steps < 100_000, "protocol did not quiesce");
        if to == 0
            && let Some(Body::BucketRequest(r)) = &mut env.body
        {
            r.entries.iter_mut().for_each(|e| e.heads.clear());
        }
        if to == 0
            && let Some(Body::BucketEntries(r)) = &mut env.body
        {
            r.entries.iter_mut().for_each(|e| e.heads.clear());
        }
        let node = &mut sim.nodes[to];
        let out = node.proto.handle_frame(&mut node.store, conn, env, sim.now);
        sim.route(to, out);
    }
    assert_eq!(sim.nodes[0].proto.counters().repairs_left_to_peer, 0);
    converge_apart_replicas(&mut sim, &docs, 3);
}

#[test]
fn deferred_answers_go_before_the_bucket_frames_that_follow_them() {
    // r0 coalesces its answers (as nodes do). r1, ahead on a document, sends r0 its changes;
    // r0's acknowledgement is deferred to the end of the batch, but a bucket frame r0 sends r1
    // in the same batch must not overtake it: r1 would find the document still differing with
    // no answer yet and restart its sync.
    let (mut sim, docs) = replicas_apart_then_reconnected();
    sim.nodes[0].proto.set_coalesce_pushes(true);
    // Deliver frames until r1's changes to a document it is ahead on reach r0.
    let mut steps = 0;
    loop {
        steps += 1;
        assert!(steps < 10_000, "r1 never sent r0 its changes");
        let (to, conn, env) = sim.queue.pop_front().expect("frames in flight");
        let asks = to == 0
            && matches!(&env.body, Some(Body::Sync(s))
                if docs[40..].iter().any(|d| Some(&pb::DocId::from(d)) == s.doc.as_ref()));
        let node = &mut sim.nodes[to];
        let out = node.proto.handle_frame(&mut node.store, conn, env, sim.now);
        sim.route(to, out);
        if asks {
            break;
        }
    }
    let r0 = &mut sim.nodes[0];
    assert!(r0.proto.has_deferred_pushes(), "the answer is deferred");
    // r1's digest, full: r0 finds buckets differing and sends a bucket request.
    let conn = sim.links.last().expect("the reconnection").conn_a;
    let theirs = sim.nodes[1].store.digest();
    let env = wire::envelope(Body::Digest(pb::Digest {
        root: theirs.root(),
        buckets: theirs.buckets().to_vec(),
    }));
    let r0 = &mut sim.nodes[0];
    let out = r0.proto.handle_frame(&mut r0.store, conn, env, sim.now);
    let kinds: Vec<&str> = out
        .iter()
        .filter_map(|o| match o {
            Output::Send { envelope, .. } => Some(kind(envelope)),
            _ => None,
        })
        .collect();
    let first_sync = kinds.iter().position(|k| *k == "sync");
    let request = kinds.iter().position(|k| *k == "bucket_request");
    assert!(
        matches!((first_sync, request), (Some(s), Some(r)) if s < r),
        "frames sent: {kinds:?}"
    );
}

#[test]
fn no_new_round_while_the_peer_has_not_handled_the_last_ones_repairs() {
    // r1 sends r0 the changes of 20 documents (and acknowledges r0's 40); its frames then
    // wait in transit (as behind a long queue) while r0's heartbeats and probes reach it. r1
    // keeps hearing that the documents differ, but neither starts rounds, nor answers r0's
    // probes, nor restarts (and so resends) its repairs until r0 reports having handled them;
    // then the rounds resume and converge.
    let (mut sim, docs) = replicas_apart_then_reconnected();
    sim.hold_sync_from = Some(1);
    sim.run();
    sim.hold_sync_from = None;
    let syncs_held = sim.held.len();
    sim.hold_all_from = Some(1);
    let probes = sim.nodes[1].proto.counters().digest_probes_sent;
    for _ in 0..6 {
        sim.tick(Duration::from_secs(1));
    }
    let c1 = sim.nodes[1].proto.counters();
    assert!(c1.digest_mismatches > 0);
    assert_eq!(c1.digest_probes_sent, probes, "no round started");
    assert_eq!(c1.sync_resets, 0, "no repair restarted");
    assert_eq!(
        sim.nodes[0].store.get(&docs[40], "gpu").as_deref(),
        Some("0"),
        "r1's changes are still in transit"
    );
    assert!(
        c1.rounds_deferred >= 2,
        "{} rounds deferred",
        c1.rounds_deferred
    );
    let frames_held = sim.held.len();
    assert!(
        sim.held
            .iter()
            .skip(syncs_held)
            .all(|(_, _, env)| !matches!(
                env.body,
                Some(Body::Digest(_)) | Some(Body::BucketRequest(_))
            )),
        "r1 sent anti-entropy frames while its repairs waited ({frames_held} frames held)"
    );
    sim.hold_all_from = None;
    sim.release_held();
    converge_apart_replicas(&mut sim, &docs, 4);
    assert!(
        sim.nodes[1].proto.counters().digest_probes_sent > probes,
        "rounds resumed"
    );
    assert_eq!(sim.nodes[1].proto.counters().sync_resets, 0);
}

/// Replicas r0, r1 and writers c1/n0, c1/n1 (push off: only anti-entropy repairs), all
/// connected and converged; then r1 is cut off from everybody while the writers change their
/// documents at r0 (heartbeats included, so r0 learns r1 is no longer reached). Returns the
/// sim with r1 reconnected to r0, and to the writers if `writers_back`, not yet run.
fn writers_changed_while_a_replica_was_away(
    grace: Duration,
    writers_back: bool,
) -> (Sim, [DocId; 2]) {
    let ids = vec![
        replica("r0"),
        replica("r1"),
        agent("c1", "n0"),
        agent("c1", "n1"),
    ];
    let mut sim = Sim::with_config(ids, |c| {
        c.carrier_grace = grace;
        c.push = false;
    });
    let docs = [DocId::new("c1", "n0"), DocId::new("c1", "n1")];
    let mut cut = vec![sim.connect(0, 1)];
    for a in 2..4 {
        sim.connect(a, 0);
        cut.push(sim.connect(a, 1));
    }
    sim.run();
    for (i, d) in docs.iter().enumerate() {
        sim.write(2 + i, d, "gpu", "0");
    }
    for _ in 0..6 {
        sim.tick(Duration::from_secs(1));
    }
    assert_eq!(sim.entries(0), sim.entries(1));
    for link in cut {
        sim.disconnect(link);
    }
    for v in 1..=5 {
        for (i, d) in docs.iter().enumerate() {
            sim.write(2 + i, d, "gpu", &v.to_string());
        }
        sim.tick(Duration::from_secs(1));
    }
    for _ in 0..3 {
        sim.tick(Duration::from_secs(1));
    }
    for d in &docs {
        assert_eq!(sim.nodes[0].store.get(d, "gpu").as_deref(), Some("5"));
        assert_eq!(sim.nodes[1].store.get(d, "gpu").as_deref(), Some("0"));
    }
    sim.syncs.clear();
    sim.connect(0, 1);
    if writers_back {
        for a in 2..4 {
            sim.connect(a, 1);
        }
    }
    (sim, docs)
}

#[test]
fn reconnected_replicas_leave_member_documents_to_their_carriers_for_the_grace() {
    // When a replica comes back, the writers (or their cluster's relay) reconnect to it too
    // and repair their own documents; pulling the same documents from the other replica at
    // the same time doubled the work of the replica behind. During the grace the replicas
    // repair only their own documents between them; after it, the writers have reported
    // reaching both, which leaves their documents to them.
    let between =
        |sim: &Sim| sim.syncs.get(&(0, 1)).unwrap_or(&0) + sim.syncs.get(&(1, 0)).unwrap_or(&0);
    let healed = |grace: Duration| {
        let (mut sim, docs) = writers_changed_while_a_replica_was_away(grace, true);
        sim.run();
        for _ in 0..6 {
            sim.tick(Duration::from_secs(1));
        }
        for d in &docs {
            assert_eq!(sim.nodes[1].store.get(d, "gpu").as_deref(), Some("5"));
        }
        assert_eq!(sim.entries(0), sim.entries(1));
        (
            between(&sim),
            sim.nodes[1].proto.counters().digest_mismatches,
        )
    };
    let (with_grace, mismatches) = healed(Duration::from_secs(3));
    assert_eq!(with_grace, 0, "replicas exchanged the writers' documents");
    assert!(mismatches > 0, "the replicas' digests never differed");
    let (without, _) = healed(Duration::ZERO);
    assert!(
        without > 0,
        "without the grace the replicas repair the writers' documents between them too"
    );
}

#[test]
fn without_carriers_replicas_repair_member_documents_once_the_grace_is_over() {
    // The writers stay away: only the other replica can repair the documents, after the grace.
    let (mut sim, docs) = writers_changed_while_a_replica_was_away(Duration::from_secs(3), false);
    sim.run();
    sim.tick(Duration::from_secs(2));
    assert_eq!(
        sim.nodes[1].store.get(&docs[0], "gpu").as_deref(),
        Some("0"),
        "repaired between replicas during the grace"
    );
    for _ in 0..4 {
        sim.tick(Duration::from_secs(1));
    }
    for d in &docs {
        assert_eq!(sim.nodes[1].store.get(d, "gpu").as_deref(), Some("5"));
    }
}

/// `poll_timeout` says when a tick has work: a tick before it changes nothing, a tick at it
/// leaves nothing due, and a delayed relay moves it earlier. Driving the nodes only at those
/// moments (as the node's driver does) converges like fixed ticks.
#[test]
fn ticking_only_at_poll_timeout_misses_no_timer() {
    let delay = Duration::from_millis(500);
    let mut sim = three_replicas_and_agent(delay);
    sim.connect(0, 1);
    sim.connect(1, 2);
    sim.connect(3, 0);
    sim.run();
    for n in &sim.nodes {
        assert!(n.proto.poll_timeout().is_some(), "sessions have timers");
    }
    // The agent's first heartbeat tells r0 whom it reaches; its write is then relayed by r0
    // only after `relay_delay`.
    let mut first_write = true;
    let doc = DocId::new("c1", "n1");
    let start = sim.now;
    let mut ticks = 0;
    while sim.now < start + Duration::from_secs(30) {
        let next = sim
            .nodes
            .iter()
            .filter_map(|n| n.proto.poll_timeout())
            .min()
            .expect("timers stay scheduled");
        assert!(next >= sim.now, "a timer due in the past was not run");
        let before = next.checked_sub(Duration::from_millis(1)).unwrap();
        if before > sim.now {
            for n in &mut sim.nodes {
                let due = n.proto.poll_timeout();
                let out = n.proto.on_tick(&mut n.store, before);
                assert!(out.is_empty(), "a tick before poll_timeout sent {out:?}");
                assert_eq!(n.proto.poll_timeout(), due, "a tick before it changed it");
            }
        }
        sim.tick(next - sim.now);
        ticks += 1;
        for n in &sim.nodes {
            assert!(
                n.proto.poll_timeout().is_some_and(|t| t > sim.now),
                "a tick at poll_timeout left work due"
            );
        }
        if first_write && sim.now >= start + Duration::from_secs(2) {
            first_write = false;
            sim.write(3, &doc, "gpu", "8");
            let relay_by = sim.now + delay;
            assert!(
                sim.nodes[0]
                    .proto
                    .poll_timeout()
                    .is_some_and(|t| t <= relay_by),
                "the delayed relay is not in poll_timeout"
            );
        }
    }
    assert!(!first_write);
    // Heartbeats every second on 3 sessions (both ends), probes every ~2 s: some dozens of
    // wake-ups in 30 s, not the 300 of a fixed 100 ms tick.
    println!("{ticks} wake-ups in 30 simulated seconds");
    assert!((30..300).contains(&ticks), "{ticks} wake-ups");
    let held = sim.nodes[3]
        .store
        .entry(&doc)
        .expect("agent holds its document");
    for r in 0..3 {
        assert_eq!(
            sim.nodes[r].store.entry(&doc).as_ref(),
            Some(&held),
            "replica {r} converged"
        );
    }
}
