//! Loopback QUIC tests of the relay topology over the real persistent store: node agents of a
//! cluster sync their own documents with the cluster's relay (the Lease holder), which carries
//! them to the replicas over one session per replica; replicas verify every writer's signature.
//!
//! Covered: node -> relay -> replica delivery (node agents hold no replica session, replicas
//! no node session); relay failover (the relay steps down, the node agents first fall back to
//! the replicas, then follow the new relay, and nothing written meanwhile is lost); a replica
//! partitioned away keeps its copies and catches up after the heal; a flood of node sessions
//! beyond the relay's cap is refused at once and the refused agents publish through the
//! replicas instead. Each test is bounded by a timeout.

mod common;
#[path = "common/fixtures.rs"]
mod fixtures;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{LOCAL, Relay, agent_id, init_tracing, replica_id};
use dramesh_mesh::certs::{self, CaBundle};
use dramesh_mesh::node::{MeshHandle, NodeConfig};
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_mesh::{DocStore, PeerIdentity};
use dramesh_store::{DocId, Durability, ObjectKey, ObjectKind, Store, StoreConfig};
use fixtures::node_change;

struct Node {
    handle: MeshHandle,
    store: Arc<Mutex<MeshStore>>,
    _dir: tempfile::TempDir,
}

impl Node {
    async fn start(ca: &CaBundle, id: &PeerIdentity, config: impl FnOnce(&mut NodeConfig)) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let tls = certs::issue_identity(ca, id, 1).unwrap();
        let mut cfg = common::fast_config(tls, vec![], Duration::from_millis(1000));
        cfg.relay_fallback = Duration::from_millis(1500);
        config(&mut cfg);
        let store = disk_store(dir.path());
        let mut store = MeshStore::new(store, false);
        if let PeerIdentity::Agent { cluster, node } = id {
            store
                .open_writer(&DocId::new(cluster.clone(), node.clone()))
                .unwrap();
        }
        let store = Arc::new(Mutex::new(store));
        let handle = MeshHandle::start(cfg, store.clone()).await.unwrap();
        Node {
            handle,
            store,
            _dir: dir,
        }
    }

    fn doc(&self) -> DocId {
        match self.handle.identity() {
            PeerIdentity::Agent { cluster, node } => DocId::new(cluster.clone(), node.clone()),
            PeerIdentity::Replica { .. } => panic!("replicas write no document"),
        }
    }

    async fn write(&self, value: &str) {
        let doc = self.doc();
        self.store
            .lock()
            .unwrap()
            .apply(&doc, vec![node_change(&doc.writer, value)])
            .unwrap();
        self.handle.notify_local_change(doc).await;
    }

    /// The Node record of `writer` in cluster `cluster` as this node's store shows it.
    fn shows(&self, cluster: &str, writer: &str, value: &str) -> bool {
        let key = ObjectKey::new(ObjectKind::Node, None, writer);
        self.store
            .lock()
            .unwrap()
            .store()
            .get(cluster, &key)
            .is_some_and(|j| String::from_utf8_lossy(&j).contains(&format!("\"{value}\"")))
    }

    fn peers(&self) -> Vec<PeerIdentity> {
        self.handle.connected_identities()
    }

    fn digest(&self) -> dramesh_store::Digest {
        self.store.lock().unwrap().digest()
    }
}

fn disk_store(dir: &Path) -> Store {
    Store::open(
        dir,
        StoreConfig {
            durability: Durability::Fsync,
            ..StoreConfig::default()
        },
    )
    .unwrap()
    .0
}

async fn wait_until(what: &str, limit: Duration, cond: impl FnMut() -> bool) -> Duration {
    common::wait_until(what, limit, Duration::from_millis(25), cond).await
}

/// Two replicas (r1 seeded with r0), replica listen addresses.
async fn replicas(ca: &CaBundle) -> (Vec<Node>, Vec<SocketAddr>) {
    let r0 = Node::start(ca, &replica_id("r0"), |_| {}).await;
    let a0 = r0.handle.local_addr();
    let r1 = Node::start(ca, &replica_id("r1"), |c| c.seeds = vec![a0]).await;
    let a1 = r1.handle.local_addr();
    (vec![r0, r1], vec![a0, a1])
}

/// A relay of cluster `c1` named `name`, dialing the replicas.
async fn relay(ca: &CaBundle, name: &str, seeds: &[SocketAddr]) -> Node {
    let r = Node::start(ca, &agent_id("c1", name), |c| c.seeds = seeds.to_vec()).await;
    r.handle.set_relay(true).await;
    r
}

/// Node agents `c1/n<i>` with the replicas as seeds (their fallback) and `target` as relay.
async fn node_agents(
    ca: &CaBundle,
    n: usize,
    seeds: &[SocketAddr],
    target: Option<SocketAddr>,
) -> Vec<Node> {
    let mut out = Vec::new();
    for i in 0..n {
        let a = Node::start(ca, &agent_id("c1", &format!("n{i}")), |c| {
            c.seeds = seeds.to_vec()
        })
        .await;
        a.handle.set_relay_target(target);
        out.push(a);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_changes_reach_every_replica_through_the_relay_only() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(60), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let (reps, addrs) = replicas(&ca).await;
        let lead = relay(&ca, "lead", &addrs).await;
        let nodes = node_agents(&ca, 3, &addrs, Some(lead.handle.local_addr())).await;
        for (i, a) in nodes.iter().enumerate() {
            a.write(&format!("{i}")).await;
        }
        lead.write("lead").await;
        wait_until(
            "every node's record on both replicas",
            Duration::from_secs(20),
            || {
                reps.iter().all(|r| {
                    (0..3).all(|i| r.shows("c1", &format!("n{i}"), &i.to_string()))
                        && r.shows("c1", "lead", "lead")
                })
            },
        )
        .await;
        // Node agents hold a session with the relay only; replicas with the relay and each
        // other only.
        let lead_id = lead.handle.identity().clone();
        for a in &nodes {
            assert_eq!(a.peers(), vec![lead_id.clone()], "{}", a.handle.identity());
            assert!(a.handle.relay_connected());
        }
        for r in &reps {
            let peers = r.peers();
            assert!(peers.contains(&lead_id), "{peers:?}");
            assert_eq!(peers.len(), 2, "{peers:?}");
        }
        // Every replica verified the nodes' own signatures.
        for r in &reps {
            assert_eq!(r.handle.counters().rejected_bad_signature, 0);
            for a in &nodes {
                assert!(
                    r.store
                        .lock()
                        .unwrap()
                        .store()
                        .signed_heads(&a.doc())
                        .is_some()
                );
            }
        }
        // Updates keep flowing the same way.
        nodes[1].write("11").await;
        wait_until("an update", Duration::from_secs(10), || {
            reps.iter().all(|r| r.shows("c1", "n1", "11"))
        })
        .await;
        wait_until("equal digests", Duration::from_secs(10), || {
            reps[0].digest() == reps[1].digest()
        })
        .await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_failover_loses_nothing() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(90), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let (reps, addrs) = replicas(&ca).await;
        let old = relay(&ca, "old", &addrs).await;
        let nodes = node_agents(&ca, 2, &addrs, Some(old.handle.local_addr())).await;
        nodes[0].write("1").await;
        wait_until("first write", Duration::from_secs(20), || {
            reps.iter().all(|r| r.shows("c1", "n0", "1"))
        })
        .await;
        // The Lease holder goes away: its process stops. Until a new holder publishes its
        // address, the node agents still point at the old one, and fall back to the replicas.
        old.handle.shutdown().await;
        nodes[0].write("2").await;
        nodes[1].write("2").await;
        let fallback = wait_until(
            "writes during the relay's absence",
            Duration::from_secs(20),
            || {
                reps.iter()
                    .all(|r| r.shows("c1", "n0", "2") && r.shows("c1", "n1", "2"))
            },
        )
        .await;
        assert!(
            nodes
                .iter()
                .all(|a| a.peers().iter().all(PeerIdentity::is_replica)),
            "node agents fell back to the replicas"
        );
        assert!(
            fallback >= Duration::from_millis(1000),
            "fell back too early: {fallback:?}"
        );
        // A new holder takes over and publishes its address: node agents follow it and close
        // their direct sessions.
        let new = relay(&ca, "new", &addrs).await;
        for a in &nodes {
            a.handle.set_relay_target(Some(new.handle.local_addr()));
        }
        let new_id = new.handle.identity().clone();
        wait_until(
            "node agents on the new relay only",
            Duration::from_secs(20),
            || nodes.iter().all(|a| a.peers() == vec![new_id.clone()]),
        )
        .await;
        nodes[0].write("3").await;
        wait_until(
            "a write through the new relay",
            Duration::from_secs(20),
            || {
                reps.iter()
                    .all(|r| r.shows("c1", "n0", "3") && r.shows("c1", "n1", "2"))
            },
        )
        .await;
        // The new relay pulled its cluster: it holds both node documents.
        wait_until(
            "the new relay holds the cluster",
            Duration::from_secs(20),
            || new.shows("c1", "n1", "2") && new.shows("c1", "n0", "3"),
        )
        .await;
        // Stepping down, it drops what it carried and keeps its own document.
        new.handle.set_relay(false).await;
        wait_until("copies dropped", Duration::from_secs(10), || {
            new.store.lock().unwrap().store().entries().len() == 1
        })
        .await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_replica_keeps_its_copies_and_converges_after_the_heal() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(90), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        // r1 sits behind a UDP relay that can drop everything, and advertises it; it dials
        // nobody (r0 dials it, through the relay), so every packet to or from it crosses it.
        let probe = std::net::UdpSocket::bind(LOCAL).unwrap();
        let listen1 = probe.local_addr().unwrap();
        drop(probe);
        let gate = Relay::start(listen1).await;
        let r0 = Node::start(&ca, &replica_id("r0"), |c| c.seeds = vec![gate.addr]).await;
        let a0 = r0.handle.local_addr();
        let r1 = Node::start(&ca, &replica_id("r1"), |c| {
            c.listen = listen1;
            c.advertise = Some(gate.addr);
        })
        .await;
        let addrs = [a0, gate.addr];
        let lead = relay(&ca, "lead", &addrs).await;
        let nodes = node_agents(&ca, 3, &addrs, Some(lead.handle.local_addr())).await;
        for a in &nodes {
            a.write("0").await;
        }
        wait_until("initial load", Duration::from_secs(20), || {
            (0..3).all(|i| r1.shows("c1", &format!("n{i}"), "0"))
        })
        .await;
        // Cut r1 off from everybody (every client address the gate saw).
        let cut = |on: bool| {
            let mut b = gate.blocked.lock().unwrap();
            if on {
                for p in [a0, lead.handle.local_addr()]
                    .into_iter()
                    .chain(nodes.iter().map(|a| a.handle.local_addr()))
                {
                    b.insert(p);
                }
            } else {
                b.clear();
            }
        };
        cut(true);
        for round in 1..=5 {
            for a in &nodes {
                a.write(&round.to_string()).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        wait_until(
            "r0 has the partition's writes",
            Duration::from_secs(20),
            || (0..3).all(|i| r0.shows("c1", &format!("n{i}"), "5")),
        )
        .await;
        // r1 still answers from what it had: every document, at its pre-partition value.
        for i in 0..3 {
            assert!(r1.shows("c1", &format!("n{i}"), "0"), "r1 lost n{i}");
        }
        cut(false);
        let heal = wait_until("heal", Duration::from_secs(30), || {
            r1.digest() == r0.digest() && (0..3).all(|i| r1.shows("c1", &format!("n{i}"), "5"))
        })
        .await;
        tracing::info!(?heal, "healed");
        assert_eq!(r1.handle.counters().rejected_bad_signature, 0);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_node_sessions_beyond_the_relays_cap_is_refused_and_nothing_is_lost() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(90), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let (reps, addrs) = replicas(&ca).await;
        // Room for the two replicas and three node agents.
        let lead = Node::start(&ca, &agent_id("c1", "lead"), |c| {
            c.seeds = addrs.clone();
            c.transport.max_sessions = 5;
        })
        .await;
        lead.handle.set_relay(true).await;
        let nodes = node_agents(&ca, 8, &addrs, Some(lead.handle.local_addr())).await;
        for (i, a) in nodes.iter().enumerate() {
            a.write(&format!("{i}")).await;
        }
        wait_until(
            "every node's record on both replicas",
            Duration::from_secs(30),
            || {
                reps.iter()
                    .all(|r| (0..8).all(|i| r.shows("c1", &format!("n{i}"), &i.to_string())))
            },
        )
        .await;
        let t = lead.handle.transport_counters();
        assert!(t.sessions_refused > 0, "{t:?}");
        assert!(lead.peers().len() <= 5, "{:?}", lead.peers());
        let direct = nodes.iter().filter(|a| !a.handle.relay_connected()).count();
        assert!(direct >= 3, "{direct} node agents went direct");
    })
    .await
    .expect("test timed out");
}
