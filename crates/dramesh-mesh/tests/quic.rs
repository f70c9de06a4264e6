//! Loopback QUIC tests: real endpoints, certificates from the generator, in-memory stores.

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{LOCAL, Relay, agent_id, init_tracing, replica_id};
use dramesh_mesh::certs::{self, CaBundle, TlsIdentity};
use dramesh_mesh::mem_store::MemStore;
use dramesh_mesh::node::{MeshHandle, NodeConfig};
use dramesh_mesh::protocol::PROTOCOL_VERSION;
use dramesh_mesh::transport::{self, MESH_SERVER_NAME};
use dramesh_mesh::wire::{self, pb, pb::envelope::Body};
use dramesh_mesh::{DocStore, PeerIdentity};
use dramesh_store::DocId;

fn own_doc(id: &PeerIdentity) -> DocId {
    match id {
        PeerIdentity::Agent { cluster, node } => DocId::new(cluster.clone(), node.clone()),
        PeerIdentity::Replica { .. } => panic!("replicas own no document"),
    }
}

fn fast_config(identity: TlsIdentity, seeds: Vec<SocketAddr>) -> NodeConfig {
    common::fast_config(identity, seeds, Duration::from_millis(1000))
}

async fn wait_until(what: &str, limit: Duration, cond: impl FnMut() -> bool) -> Duration {
    common::wait_until(what, limit, Duration::from_millis(20), cond).await
}

struct TestNode {
    handle: MeshHandle,
    store: Arc<Mutex<MemStore>>,
}

impl TestNode {
    fn entries(&self) -> Vec<dramesh_store::DocEntry> {
        self.store.lock().unwrap().entries()
    }

    async fn write(&self, key: &str, value: &str) {
        let doc = own_doc(self.handle.identity());
        self.store.lock().unwrap().put(&doc, key, value).unwrap();
        self.handle.notify_local_change(doc).await;
    }

    fn get(&self, doc: &DocId, key: &str) -> Option<String> {
        self.store.lock().unwrap().get(doc, key)
    }
}

async fn start(config: NodeConfig) -> TestNode {
    let store = Arc::new(Mutex::new(MemStore::new()));
    let handle = MeshHandle::start(config, store.clone()).await.unwrap();
    TestNode { handle, store }
}

/// A hand-rolled client of `identity` connected to `to`, its hello sent: it speaks the wire
/// protocol directly, without a node's own checks and pacing.
async fn raw_session(
    identity: &TlsIdentity,
    to: SocketAddr,
) -> (
    quinn::Endpoint,
    quinn::Connection,
    quinn::SendStream,
    quinn::RecvStream,
) {
    let cfg = fast_config(identity.clone(), vec![]);
    let endpoint =
        transport::make_endpoint(LOCAL.parse().unwrap(), identity, &cfg.transport).unwrap();
    let conn = endpoint
        .connect(to, MESH_SERVER_NAME)
        .unwrap()
        .await
        .unwrap();
    let (mut send, recv) = conn.open_bi().await.unwrap();
    let role = if identity.identity.is_replica() {
        pb::Role::Replica
    } else {
        pb::Role::Agent
    };
    let hello = wire::envelope(Body::Hello(pb::Hello {
        protocol_version: PROTOCOL_VERSION,
        role: role as i32,
        identity: identity.identity.uri(),
        advertise_addr: String::new(),
        relay: false,
        ..Default::default()
    }));
    send.write_all(&wire::encode_frame(&hello).unwrap())
        .await
        .unwrap();
    (endpoint, conn, send, recv)
}

fn converged(replicas: &[&TestNode], agents: &[&TestNode]) -> bool {
    let want: Vec<_> = {
        let mut all: Vec<_> = agents.iter().flat_map(|a| a.entries()).collect();
        all.sort_by(|a, b| a.doc.cmp(&b.doc));
        all
    };
    replicas.iter().all(|r| r.entries() == want)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_and_agents_converge_and_discover_each_other() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(60), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let id = |p: &PeerIdentity| certs::issue_identity(&ca, p, 1).unwrap();
        let r0 = start(fast_config(id(&replica_id("r0")), vec![])).await;
        let seed = vec![r0.handle.local_addr()];
        let r1 = start(fast_config(id(&replica_id("r1")), seed.clone())).await;
        let r2 = start(fast_config(id(&replica_id("r2")), seed.clone())).await;
        let mut agents = Vec::new();
        for (i, seed) in [
            r0.handle.local_addr(),
            r1.handle.local_addr(),
            r2.handle.local_addr(),
            r0.handle.local_addr(),
        ]
        .into_iter()
        .enumerate()
        {
            let cluster = if i % 2 == 0 { "east" } else { "west" };
            let a = start(fast_config(
                id(&agent_id(cluster, &format!("n{i}"))),
                vec![seed],
            ))
            .await;
            agents.push(a);
        }
        for (i, a) in agents.iter().enumerate() {
            a.write("gpus", &format!("{}", i * 2)).await;
        }
        let reps = [&r0, &r1, &r2];
        let ags: Vec<&TestNode> = agents.iter().collect();
        let took = wait_until("initial convergence", Duration::from_secs(20), || {
            converged(&reps, &ags) && r0.entries().len() == 4
        })
        .await;
        println!("initial convergence (3 replicas, 4 agents) in {took:?}");
        // Replicas found each other though r1 and r2 only had r0 as seed.
        wait_until("replica discovery", Duration::from_secs(10), || {
            r1.handle
                .known_replicas()
                .contains_key("dramesh://replica/r2")
                && r2
                    .handle
                    .known_replicas()
                    .contains_key("dramesh://replica/r1")
        })
        .await;
        // Every agent ends up connected to every replica.
        let started = Instant::now();
        loop {
            let mut all = true;
            for a in &agents {
                let peers = a.handle.peers().await;
                let ids: HashSet<_> = peers.iter().map(|p| p.identity.clone()).collect();
                all &= ids.len() == 3 && ids.iter().all(PeerIdentity::is_replica);
            }
            if all {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "agents did not reach all replicas"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Push latency: a fresh write reaches every replica quickly.
        let t0 = Instant::now();
        agents[1].write("gpus", "42").await;
        let doc = own_doc(agents[1].handle.identity());
        wait_until("push", Duration::from_secs(5), || {
            reps.iter()
                .all(|r| r.get(&doc, "gpus").as_deref() == Some("42"))
        })
        .await;
        println!("push to all replicas in {:?}", t0.elapsed());
        let peers = r1.handle.peers().await;
        assert!(
            peers
                .iter()
                .all(|p| p.hello_received && p.bytes_received > 0 && p.bytes_sent > 0)
        );
        // r1 and r2 (seeded only with r0) connect to each other once discovered.
        wait_until("replica mesh", Duration::from_secs(10), || {
            r1.handle.connected_identities().contains(&replica_id("r2"))
                && r2.handle.connected_identities().contains(&replica_id("r1"))
        })
        .await;
        // Each replica pair keeps exactly one connection.
        let peers = r1.handle.peers().await;
        let replica_peers = peers.iter().filter(|p| p.identity.is_replica()).count();
        assert_eq!(replica_peers, 2, "{peers:?}");
        for n in agents.into_iter().chain([r0, r1, r2]) {
            n.handle.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_of_cluster_a_cannot_sync_a_cluster_b_document() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(30), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let r0 = start(fast_config(certs::issue_identity(&ca, &replica_id("r0"), 1).unwrap(), vec![])).await;
        let rogue_id = certs::issue_identity(&ca, &agent_id("a", "n1"), 1).unwrap();
        // A hand-rolled client speaking the wire protocol directly, bypassing its own checks.
        let (_endpoint, conn, mut send, mut recv) =
            raw_session(&rogue_id, r0.handle.local_addr()).await;
        // Build a genuine automerge exchange for cluster b's document.
        let victim = DocId::new("b", "n1");
        let mut forged = MemStore::new();
        forged.put(&victim, "gpus", "999").unwrap();
        let mut state = dramesh_store::SyncState::new();
        let (msg, _) = forged.generate_sync_message(&victim, &mut state).unwrap();
        let sync = wire::envelope(Body::Sync(pb::Sync {
            doc: Some((&victim).into()),
            generation: 1,
            payload: msg,
            signed: None,
        }));
        send.write_all(&wire::encode_frame(&sync).unwrap()).await.unwrap();
        wait_until("rejection counted", Duration::from_secs(5), || {
            r0.handle.counters().rejected_unauthorized >= 1
        })
        .await;
        assert!(r0.store.lock().unwrap().entry(&victim).is_none());
        // The replica answered nothing about the victim document.
        let mut replies = Vec::new();
        let _ = tokio::time::timeout(Duration::from_millis(300), async {
            while let Ok(Some((env, _))) = wire::read_frame(&mut recv).await {
                replies.push(env);
            }
        })
        .await;
        assert!(replies.iter().any(|e| matches!(e.body, Some(Body::Hello(_)))));
        assert!(!replies.iter().any(|e| matches!(&e.body, Some(Body::Sync(s)) if s.doc.as_ref().map(|d| d.cluster.as_str()) == Some("b"))));
        // A well-behaved agent node refuses to even send it.
        let honest = start(fast_config(certs::issue_identity(&ca, &agent_id("a", "n2"), 1).unwrap(), vec![r0.handle.local_addr()])).await;
        honest.store.lock().unwrap().put(&victim, "gpus", "1").unwrap();
        honest.handle.notify_local_change(victim.clone()).await;
        honest.write("gpus", "4").await;
        wait_until("honest doc", Duration::from_secs(5), || {
            r0.get(&DocId::new("a", "n2"), "gpus").as_deref() == Some("4")
        })
        .await;
        assert!(r0.store.lock().unwrap().entry(&victim).is_none());
        conn.close(0u32.into(), b"bye");
        honest.handle.shutdown().await;
        r0.handle.shutdown().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_from_another_ca_is_refused_at_tls() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(30), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let other: CaBundle = certs::generate_ca("other CA", 1).unwrap();
        let r0 = start(fast_config(
            certs::issue_identity(&ca, &replica_id("r0"), 1).unwrap(),
            vec![],
        ))
        .await;
        // The intruder trusts our CA (so it would accept r0) but its own cert is from another CA.
        let leaf = certs::issue_leaf(&other, &agent_id("east", "n9"), 1).unwrap();
        let intruder_id =
            certs::identity_from_pem(&leaf.cert_pem, &leaf.key_pem, &ca.cert_pem, "intruder")
                .unwrap();
        let intruder = start(fast_config(intruder_id, vec![r0.handle.local_addr()])).await;
        intruder.write("gpus", "1").await;
        // Two refused handshakes: the intruder dialed again after the first refusal, and was
        // refused again (an accepted one would leave a peer below).
        wait_until("handshake refused twice", Duration::from_secs(10), || {
            r0.handle.transport_counters().handshake_failures >= 2
        })
        .await;
        assert!(r0.handle.peers().await.is_empty());
        assert!(intruder.handle.peers().await.is_empty());
        assert!(r0.entries().is_empty());
        // TLS 1.3 clients finish before the server checks their certificate, so the refusal
        // shows on the intruder as connections that never carry a frame.
        assert_eq!(intruder.handle.counters().frames_in, 0);
        // Whether the intruder also sees the alert is timing-dependent: on a loaded machine
        // its connection often ends locally before the server's close arrives. The alert
        // classification itself is tested in `node::tests`.
        intruder.handle.shutdown().await;
        r0.handle.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// With the shipped dial timers (no test overrides), an unreachable replica keeps receiving a
/// dial's packet at least every ~1.2 s: a dial that heard nothing back is followed by the next
/// at once, and its first packet is retransmitted at 0.3, 0.9 and 2.1 s. So once the path
/// heals the agent connects within about that gap and a handshake. With QUIC's default 333 ms
/// initial RTT and a backoff after each silent dial, the gap was 2 s and more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_peer_is_dialed_without_gaps_and_found_soon_after_the_heal() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(60), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let id = |p: &PeerIdentity| certs::issue_identity(&ca, p, 1).unwrap();
        let r0 = start(NodeConfig::new(
            id(&replica_id("r0")),
            LOCAL.parse().unwrap(),
        ))
        .await;
        let relay = Relay::start(r0.handle.local_addr()).await;
        // Bind the agent to a known port, so it is blocked from its first packet on.
        let probe = std::net::UdpSocket::bind(LOCAL).unwrap();
        let agent_addr = probe.local_addr().unwrap();
        drop(probe);
        relay.blocked.lock().unwrap().insert(agent_addr);
        let mut cfg = NodeConfig::new(id(&agent_id("east", "n0")), agent_addr);
        cfg.seeds = vec![relay.addr];
        let a0 = start(cfg).await;

        let blocked_for = Duration::from_secs(8);
        tokio::time::sleep(blocked_for).await;
        let times = relay.dropped_at.lock().unwrap().clone();
        assert!(
            times.len() >= 4,
            "only {} datagrams in {blocked_for:?}",
            times.len()
        );
        let largest_gap = times
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default();
        println!(
            "{} dial datagrams in {blocked_for:?}, largest gap {largest_gap:?}",
            times.len()
        );
        assert!(
            largest_gap <= Duration::from_millis(1600),
            "an unreachable peer went {largest_gap:?} without a dial packet"
        );

        let healed = Instant::now();
        relay.blocked.lock().unwrap().clear();
        let found = common::wait_until(
            "the agent to reach the replica after the heal",
            Duration::from_secs(3),
            Duration::from_millis(20),
            || !r0.handle.connected_identities().is_empty(),
        )
        .await;
        println!(
            "connected {found:?} after the heal ({:?} since)",
            healed.elapsed()
        );
        a0.handle.shutdown().await;
        r0.handle.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// A node whose inbound queue stays full (a replica healing from a partition) still runs its
/// timers: its heartbeats, which tell peers how far it got and so pace their anti-entropy
/// rounds, keep their period: the protocol thread ends every batch that finds its timers due
/// ([`dramesh_mesh::protocol::Protocol::poll_timeout`]) with a tick, however full its queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_full_inbound_queue_keeps_its_heartbeats() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(60), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let mut cfg = fast_config(
            certs::issue_identity(&ca, &replica_id("r0"), 1).unwrap(),
            vec![],
        );
        cfg.transport.inbound_queue_frames = 16;
        let r0 = start(cfg).await;
        // Enough documents that answering a full digest takes the protocol thread a while.
        {
            let mut store = r0.store.lock().unwrap();
            for i in 0..2000 {
                store
                    .put(&DocId::new("c1", format!("n{i}")), "gpu", "1")
                    .unwrap();
            }
        }
        let flooder = certs::issue_identity(&ca, &replica_id("r9"), 1).unwrap();
        let (_endpoint, conn, mut send, mut recv) =
            raw_session(&flooder, r0.handle.local_addr()).await;
        // Read everything r0 sends, noting when its heartbeats arrive.
        let heartbeats = Arc::new(Mutex::new(Vec::<Instant>::new()));
        let seen = heartbeats.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some((env, _))) = wire::read_frame(&mut recv).await {
                if matches!(env.body, Some(Body::Ephemeral(_))) {
                    seen.lock().unwrap().push(Instant::now());
                }
            }
        });
        // A digest whose buckets all differ: r0 lists its 2,000 entries for each one.
        let probe = wire::encode_frame(&wire::envelope(Body::Digest(pb::Digest {
            root: 1,
            buckets: vec![0; dramesh_store::DIGEST_BUCKETS as usize],
        })))
        .unwrap();
        let flood = Duration::from_secs(4);
        let started = Instant::now();
        let handled_before = r0.handle.counters().frames_in;
        while started.elapsed() < flood {
            send.write_all(&probe).await.unwrap();
        }
        let handled = r0.handle.counters().frames_in - handled_before;
        let during: usize = heartbeats
            .lock()
            .unwrap()
            .iter()
            .filter(|t| **t >= started && **t < started + flood)
            .count();
        println!("{handled} frames handled during the {flood:?} flood; {during} heartbeats");
        assert!(handled > 100, "the flood did not reach the protocol thread");
        // The heartbeat period is 250 ms: 16 in the flood's 4 s.
        assert!(during >= 8, "only {during} heartbeats in {flood:?}");
        conn.close(0u32.into(), b"bye");
        reader.abort();
        r0.handle.shutdown().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_replica_catches_up_after_heal() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(90), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let id = |p: &PeerIdentity| certs::issue_identity(&ca, p, 1).unwrap();
        // Every replica sits behind its own relay and advertises the relay's address,
        // so all replica-bound traffic crosses a relay.
        let mut replicas = Vec::new();
        let mut relays = Vec::new();
        for i in 0..3 {
            let mut cfg = fast_config(id(&replica_id(&format!("r{i}"))), vec![]);
            // Bind first to know the port, then put a relay in front of it.
            let probe = std::net::UdpSocket::bind(LOCAL).unwrap();
            let listen = probe.local_addr().unwrap();
            drop(probe);
            cfg.listen = listen;
            let relay = Relay::start(listen).await;
            cfg.advertise = Some(relay.addr);
            if i > 0 {
                cfg.seeds = vec![relays.first().map(|r: &Relay| r.addr).unwrap()];
            }
            replicas.push(start(cfg).await);
            relays.push(relay);
        }
        // a0 and a1 start at r0; a2 lives next to r2.
        let mut agents = Vec::new();
        for (i, seed) in [relays[0].addr, relays[1].addr, relays[2].addr]
            .into_iter()
            .enumerate()
        {
            agents.push(
                start(fast_config(
                    id(&agent_id("east", &format!("n{i}"))),
                    vec![seed],
                ))
                .await,
            );
        }
        for a in &agents {
            a.write("v", "0").await;
        }
        let reps: Vec<&TestNode> = replicas.iter().collect();
        let ags: Vec<&TestNode> = agents.iter().collect();
        wait_until("initial convergence", Duration::from_secs(20), || {
            converged(&reps, &ags) && replicas[0].entries().len() == 3
        })
        .await;

        // Partition {r2, a2} from everybody else.
        let r2_addr = replicas[2].handle.local_addr();
        let a2_addr = agents[2].handle.local_addr();
        let left: Vec<SocketAddr> = [&replicas[0], &replicas[1], &agents[0], &agents[1]]
            .iter()
            .map(|n| n.handle.local_addr())
            .collect();
        relays[2].blocked.lock().unwrap().extend(left);
        for r in &relays[..2] {
            let mut b = r.blocked.lock().unwrap();
            b.insert(r2_addr);
            b.insert(a2_addr);
        }
        // Wait until the idle timeout has torn the cross-partition connections down.
        let cut_at = Instant::now();
        wait_until("partition detected", Duration::from_secs(10), || {
            !replicas[2]
                .handle
                .connected_identities()
                .iter()
                .any(PeerIdentity::is_replica)
        })
        .await;
        println!("partition detected by r2 after {:?}", cut_at.elapsed());
        // Both sides keep accepting local updates.
        agents[0].write("v", "left").await;
        agents[2].write("v", "right").await;
        let d0 = own_doc(agents[0].handle.identity());
        let d2 = own_doc(agents[2].handle.identity());
        wait_until("left side update", Duration::from_secs(5), || {
            replicas[1].get(&d0, "v").as_deref() == Some("left")
        })
        .await;
        wait_until("right side update", Duration::from_secs(5), || {
            replicas[2].get(&d2, "v").as_deref() == Some("right")
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            replicas[2].get(&d0, "v").as_deref(),
            Some("0"),
            "partition leaked"
        );
        assert_eq!(
            replicas[0].get(&d2, "v").as_deref(),
            Some("0"),
            "partition leaked"
        );

        // Heal and time convergence.
        let healed = Instant::now();
        for r in &relays {
            r.blocked.lock().unwrap().clear();
        }
        wait_until("convergence after heal", Duration::from_secs(15), || {
            converged(&reps, &ags)
                && reps.iter().all(|r| {
                    r.get(&d0, "v").as_deref() == Some("left")
                        && r.get(&d2, "v").as_deref() == Some("right")
                })
        })
        .await;
        println!("convergence after heal: {:?}", healed.elapsed());
        for n in agents.into_iter().chain(replicas) {
            n.handle.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_after_the_socket_is_closed() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(60), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let id = |p: &PeerIdentity| certs::issue_identity(&ca, p, 1).unwrap();
        let r0 = start(fast_config(id(&replica_id("r0")), vec![])).await;
        let addr = r0.handle.local_addr();
        let agent = start(fast_config(id(&agent_id("east", "n0")), vec![addr])).await;
        agent.write("gpus", "8").await;
        let doc = own_doc(agent.handle.identity());
        wait_until("replica has the write", Duration::from_secs(20), || {
            r0.get(&doc, "gpus").as_deref() == Some("8")
        })
        .await;
        // Live connections drain after close and hold the socket meanwhile; shutdown must
        // wait for them, or a node restarted in this process cannot bind the address.
        r0.handle.shutdown().await;
        let rebound = std::net::UdpSocket::bind(addr);
        assert!(
            rebound.is_ok(),
            "{addr} still bound after shutdown: {rebound:?}"
        );
        agent.handle.shutdown().await;
    })
    .await
    .expect("test timed out");
}
