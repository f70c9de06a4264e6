//! Loopback QUIC tests of the mesh over the real persistent store (`dramesh-store` through
//! [`MeshStore`]), with realistic DRA objects from `dramesh-sim`.
//!
//! Covered: convergence of 3 replicas and 10 agents of 3 clusters to identical digests and
//! materialized views; a network partition (UDP relays that drop traffic on command) during
//! which both sides keep accepting and serving updates, then heal; an agent of cluster A that
//! cannot alter cluster B; a replica restarted from its fsynced directory that catches up with
//! a small fraction of the bytes of a full resync. Each test is bounded by a timeout.

mod common;
#[path = "common/forge.rs"]
mod forge;
#[path = "common/wrapped.rs"]
mod wrapped;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{LOCAL, Relay, agent_id, init_tracing, replica_id};
use dramesh_mesh::certs::{self, CaBundle, TlsIdentity};
use dramesh_mesh::node::{MeshHandle, NodeConfig};
use dramesh_mesh::protocol::PROTOCOL_VERSION;
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_mesh::transport::{self, MESH_SERVER_NAME};
use dramesh_mesh::wire::{self, pb, pb::envelope::Body};
use dramesh_mesh::{DocStore, PeerIdentity};
use dramesh_sim::{ClusterSpec, generate, uniform_fleet};
use dramesh_store::DocEntry;
use dramesh_store::{
    DocId, Durability, ObjectChange, ObjectKey, ObjectKind, Store, StoreConfig, SyncState,
};
use wrapped::Wrapped;

/// Materialized state: (cluster, object key) -> compact JSON.
type View = BTreeMap<(String, ObjectKey), Vec<u8>>;

fn fast_config(identity: TlsIdentity, seeds: Vec<SocketAddr>) -> NodeConfig {
    common::fast_config(identity, seeds, Duration::from_millis(2000))
}

async fn wait_until(what: &str, limit: Duration, cond: impl FnMut() -> bool) -> Duration {
    common::wait_until(what, limit, Duration::from_millis(25), cond).await
}

fn mem_store() -> Store {
    Store::in_memory(StoreConfig {
        durability: Durability::None,
        ..StoreConfig::default()
    })
}

/// A replica store on disk with fsync, as the daemon runs it.
fn disk_store(dir: &Path) -> (Store, usize) {
    let (store, report) = Store::open(
        dir,
        StoreConfig {
            durability: Durability::Fsync,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    assert!(report.corrupt.is_empty(), "{report:?}");
    (store, report.loaded)
}

struct TestNode {
    handle: MeshHandle,
    store: Arc<Mutex<MeshStore>>,
}

impl TestNode {
    async fn start(config: NodeConfig, store: Store, track_changes: bool) -> TestNode {
        let store = Arc::new(Mutex::new(MeshStore::new(store, track_changes)));
        let handle = MeshHandle::start(config, store.clone()).await.unwrap();
        TestNode { handle, store }
    }

    fn digest(&self) -> dramesh_store::Digest {
        self.store.lock().unwrap().digest()
    }

    fn entries(&self) -> Vec<DocEntry> {
        let mut v: Vec<DocEntry> = self.store.lock().unwrap().store().entries();
        v.sort_by(|a, b| a.doc.cmp(&b.doc));
        v
    }

    fn view(&self) -> View {
        to_view(self.store.lock().unwrap().store().snapshot())
    }

    fn get(&self, cluster: &str, key: &ObjectKey) -> Option<Vec<u8>> {
        self.store
            .lock()
            .unwrap()
            .store()
            .get(cluster, key)
            .map(|j| j.to_vec())
    }

    async fn bytes_received(&self) -> u64 {
        self.handle
            .peers()
            .await
            .iter()
            .map(|p| p.bytes_received)
            .sum()
    }
}

/// An agent: its identity's own document, written through the real store.
struct Agent {
    node: TestNode,
    doc: DocId,
    /// What this agent published last, per key.
    written: View,
}

impl Agent {
    async fn start(ca: &CaBundle, cluster: &str, writer: &str, seeds: Vec<SocketAddr>) -> Agent {
        let id = certs::issue_identity(ca, &agent_id(cluster, writer), 1).unwrap();
        let node = TestNode::start(fast_config(id, seeds), mem_store(), false).await;
        let doc = DocId::new(cluster, writer);
        node.store.lock().unwrap().open_writer(&doc).unwrap();
        Agent {
            node,
            doc,
            written: View::new(),
        }
    }

    async fn write(&mut self, changes: Vec<ObjectChange>) {
        for c in &changes {
            let k = (self.doc.cluster.clone(), c.key().clone());
            match c {
                ObjectChange::Upsert { json, .. } => {
                    self.written.insert(k, json.to_vec());
                }
                ObjectChange::Delete { .. } => {
                    self.written.remove(&k);
                }
            }
        }
        self.node
            .store
            .lock()
            .unwrap()
            .apply(&self.doc, changes)
            .unwrap();
        let doc = self.doc.clone();
        self.node.handle.notify_local_change(doc).await;
    }

    fn entry(&self) -> DocEntry {
        self.node
            .store
            .lock()
            .unwrap()
            .entry(&DocId::new(
                self.doc.cluster.clone(),
                self.doc.writer.clone(),
            ))
            .unwrap()
    }
}

fn to_view(changes: Vec<(String, ObjectChange)>) -> View {
    let mut v = View::new();
    apply_changes(&mut v, changes);
    v
}

fn apply_changes(v: &mut View, changes: Vec<(String, ObjectChange)>) {
    for (cluster, c) in changes {
        match c {
            ObjectChange::Upsert { key, json } => {
                v.insert((cluster, key), json.to_vec());
            }
            ObjectChange::Delete { key } => {
                v.remove(&(cluster, key));
            }
        }
    }
}

/// Splits a generated cluster into per-node object sets: each node with its slices, pods and
/// claims; the cluster-scoped objects (ClusterInfo, DeviceClasses) go with the first node.
fn per_node_objects(spec: &ClusterSpec) -> Vec<(String, Vec<ObjectChange>)> {
    let cluster = generate(spec);
    let mut shared = Vec::new();
    let mut out: Vec<(String, Vec<ObjectChange>)> = Vec::new();
    for o in &cluster.objects {
        let change = ObjectChange::upsert(o);
        match o.kind() {
            ObjectKind::ClusterInfo | ObjectKind::DeviceClass => shared.push(change),
            ObjectKind::Node => out.push((o.key().name, vec![change])),
            _ => out
                .last_mut()
                .expect("the generator emits a node before its objects")
                .1
                .push(change),
        }
    }
    out[0].1.extend(shared);
    out
}

/// A changed copy of a Node object: one label set to `value`.
fn relabel(change: &ObjectChange, value: &str) -> ObjectChange {
    let ObjectChange::Upsert { key, json } = change else {
        panic!("not an upsert");
    };
    let mut v: serde_json::Value = serde_json::from_slice(json).unwrap();
    v["metadata"]["labels"]["dramesh.io/test-rev"] = serde_json::Value::String(value.into());
    ObjectChange::Upsert {
        key: key.clone(),
        json: serde_json::to_vec(&v).unwrap().into(),
    }
}

fn union_of(agents: &[Agent]) -> View {
    let mut all = View::new();
    for a in agents {
        for (k, v) in &a.written {
            assert!(
                all.insert(k.clone(), v.clone()).is_none(),
                "two agents wrote {k:?}"
            );
        }
    }
    all
}

fn agent_entries(agents: &[Agent]) -> Vec<DocEntry> {
    let mut v: Vec<DocEntry> = agents.iter().map(Agent::entry).collect();
    v.sort_by(|a, b| a.doc.cmp(&b.doc));
    v
}

fn converged(replicas: &[&TestNode], agents: &[Agent]) -> bool {
    let want = agent_entries(agents);
    replicas.iter().all(|r| r.entries() == want)
}

async fn start_replicas(ca: &CaBundle, n: usize) -> Vec<TestNode> {
    let mut replicas: Vec<TestNode> = Vec::new();
    for i in 0..n {
        let id = certs::issue_identity(ca, &replica_id(&format!("r{i}")), 1).unwrap();
        let seeds = replicas.first().map(|r| vec![r.handle.local_addr()]);
        let cfg = fast_config(id, seeds.unwrap_or_default());
        replicas.push(TestNode::start(cfg, mem_store(), true).await);
    }
    replicas
}

async fn shutdown(nodes: impl IntoIterator<Item = TestNode>) {
    for n in nodes {
        n.handle.shutdown().await;
    }
}

/// The node's verifier threads check the signatures of what a replica receives, in order: a
/// writer's updates in quick succession reach a replica with verifier threads (checked there
/// off the protocol thread) and, relayed by it, one without (checked in its store on the
/// protocol thread), and both end at the writer's last value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signatures_checked_on_verifier_threads_and_without_them_converge() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(60), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let mut replicas = Vec::new();
        for (i, threads) in [2, 0].into_iter().enumerate() {
            let id = certs::issue_identity(&ca, &replica_id(&format!("r{i}")), 1).unwrap();
            let seeds = replicas
                .first()
                .map(|r: &TestNode| vec![r.handle.local_addr()]);
            let mut cfg = fast_config(id, seeds.unwrap_or_default());
            cfg.verify_threads = threads;
            replicas.push(TestNode::start(cfg, mem_store(), true).await);
        }
        let seed = replicas[0].handle.local_addr();
        let specs = uniform_fleet(1, 1, 0.5);
        let (name, objects) = per_node_objects(&specs[0]).remove(0);
        let mut agent = Agent::start(&ca, &specs[0].name, &name, vec![seed]).await;
        let node = objects
            .iter()
            .find(|c| c.key().kind == ObjectKind::Node)
            .unwrap()
            .clone();
        agent.write(objects).await;
        for rev in 0..20 {
            agent.write(vec![relabel(&node, &rev.to_string())]).await;
        }
        let reps: Vec<&TestNode> = replicas.iter().collect();
        wait_until("convergence", Duration::from_secs(30), || {
            converged(&reps, std::slice::from_ref(&agent))
        })
        .await;
        let want = union_of(std::slice::from_ref(&agent));
        for (i, r) in replicas.iter().enumerate() {
            assert!(
                r.view() == want,
                "replica r{i} view differs from the writer's"
            );
            let c = r.handle.counters();
            assert_eq!(c.rejected_bad_signature, 0, "r{i}");
            if i == 0 {
                assert!(c.checks_handed_out > 0, "r0 handed out no check");
            } else {
                assert_eq!(c.checks_handed_out, 0, "r1 has no verifier threads");
            }
        }
        shutdown(replicas).await;
        agent.node.handle.shutdown().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_and_ten_agents_of_three_clusters_converge() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(120), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let replicas = start_replicas(&ca, 3).await;
        let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.handle.local_addr()).collect();
        // 10 agents: 4 + 3 + 3 nodes, each agent publishing one node's objects.
        let mut specs = uniform_fleet(3, 4, 0.5);
        specs[1].groups[0].count = 3;
        specs[2].groups[0].count = 3;
        let mut agents = Vec::new();
        for spec in &specs {
            for (node, objects) in per_node_objects(spec) {
                let seed = addrs[agents.len() % addrs.len()];
                let mut a = Agent::start(&ca, &spec.name, &node, vec![seed]).await;
                a.write(objects).await;
                agents.push(a);
            }
        }
        assert_eq!(agents.len(), 10);
        let reps: Vec<&TestNode> = replicas.iter().collect();
        let took = wait_until("convergence", Duration::from_secs(60), || {
            converged(&reps, &agents)
        })
        .await;
        println!("3 replicas, 10 agents converged in {took:?}");
        let digest = replicas[0].digest();
        assert_eq!(
            digest,
            dramesh_store::Digest::from_entries(agent_entries(&agents).iter())
        );
        let union = union_of(&agents);
        assert!(union.len() >= 10 * 5, "fleet too small: {}", union.len());
        for (i, r) in replicas.iter().enumerate() {
            assert_eq!(r.digest(), digest, "replica r{i} digest");
            assert!(
                r.view() == union,
                "replica r{i} view differs from the union"
            );
            // The change stream handed to the estimation view rebuilds the same state.
            let mut streamed = View::new();
            let mut store = r.store.lock().unwrap();
            assert!(!store.take_overflowed());
            apply_changes(&mut streamed, store.drain_changes());
            assert!(streamed == union, "replica r{i} change stream differs");
        }

        // A second round of updates (one node object per agent) is pushed everywhere.
        for a in &mut agents {
            let node = a
                .written
                .iter()
                .find(|((_, k), _)| k.kind == ObjectKind::Node)
                .map(|((_, k), json)| ObjectChange::Upsert {
                    key: k.clone(),
                    json: json.clone().into(),
                })
                .unwrap();
            a.write(vec![relabel(&node, "2")]).await;
        }
        let union = union_of(&agents);
        let took = wait_until("second round", Duration::from_secs(30), || {
            converged(&reps, &agents)
        })
        .await;
        println!("second round converged in {took:?}");
        for (i, r) in replicas.iter().enumerate() {
            assert!(r.view() == union, "replica r{i} view after updates");
            let mut store = r.store.lock().unwrap();
            let changes = store.drain_changes();
            assert_eq!(changes.len(), 10, "replica r{i}: one view change per agent");
            for (cluster, c) in changes {
                let ObjectChange::Upsert { key, json } = c else {
                    panic!("unexpected delete");
                };
                assert_eq!(key.kind, ObjectKind::Node);
                assert_eq!(union.get(&(cluster, key)), Some(&json.to_vec()));
            }
        }
        let counters = replicas[0].handle.counters();
        assert_eq!(counters.rejected_unauthorized, 0);
        assert_eq!(counters.rejected_by_store, 0);
        shutdown(agents.into_iter().map(|a| a.node)).await;
        shutdown(replicas).await;
    })
    .await
    .expect("test timed out");
}

/// A free loopback UDP address below the kernel's ephemeral range, so no socket bound to
/// port 0 elsewhere on the machine (other tests run in parallel) can take it while a node
/// that owns it is restarting.
fn free_udp_addr() -> SocketAddr {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let span = u32::from(low.saturating_sub(10_000).max(1));
    // Successive calls must not return the same (still unbound) port.
    let start =
        std::process::id() * 97 + 11 * CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    for i in 0..span {
        let port = 10_000 + ((start + i) % span) as u16;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        if std::net::UdpSocket::bind(addr).is_ok() {
            return addr;
        }
    }
    panic!("no free UDP port between 10000 and {low}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_keeps_both_sides_serving_and_heals_to_every_last_write() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(120), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        // Every replica sits behind a relay and advertises the relay, so all replica-bound
        // traffic can be cut.
        let mut replicas: Vec<TestNode> = Vec::new();
        let mut relays: Vec<Relay> = Vec::new();
        for i in 0..3 {
            let id = certs::issue_identity(&ca, &replica_id(&format!("r{i}")), 1).unwrap();
            let mut cfg = fast_config(id, relays.first().map(|r| vec![r.addr]).unwrap_or_default());
            cfg.listen = free_udp_addr();
            let relay = Relay::start(cfg.listen).await;
            cfg.advertise = Some(relay.addr);
            replicas.push(TestNode::start(cfg, mem_store(), true).await);
            relays.push(relay);
        }
        // Two clusters of two nodes; agents 0-1 (cluster "member-000") start at r0, agents
        // 2-3 ("member-001") at r2.
        let specs = uniform_fleet(2, 2, 0.5);
        let mut agents = Vec::new();
        for (c, spec) in specs.iter().enumerate() {
            for (node, objects) in per_node_objects(spec) {
                let seed = relays[if c == 0 { 0 } else { 2 }].addr;
                let mut a = Agent::start(&ca, &spec.name, &node, vec![seed]).await;
                a.write(objects).await;
                agents.push(a);
            }
        }
        let reps: Vec<&TestNode> = replicas.iter().collect();
        wait_until("initial convergence", Duration::from_secs(60), || {
            converged(&reps, &agents)
        })
        .await;
        // Agents reach every replica before the cut (so the cut really separates them).
        for a in &agents {
            wait_until(
                "agent connected to 3 replicas",
                Duration::from_secs(20),
                || a.node.handle.connected_identities().len() == 3,
            )
            .await;
        }

        // Partition {r2, agents 2-3} from {r0, r1, agents 0-1}.
        let addr_of = |n: &TestNode| n.handle.local_addr();
        let left: Vec<SocketAddr> = [&replicas[0], &replicas[1], &agents[0].node, &agents[1].node]
            .into_iter()
            .map(addr_of)
            .collect();
        let right: Vec<SocketAddr> = [&replicas[2], &agents[2].node, &agents[3].node]
            .into_iter()
            .map(addr_of)
            .collect();
        relays[2]
            .blocked
            .lock()
            .unwrap()
            .extend(left.iter().copied());
        for r in &relays[..2] {
            r.blocked.lock().unwrap().extend(right.iter().copied());
        }
        let cut = Instant::now();
        wait_until("partition detected", Duration::from_secs(15), || {
            !replicas[2]
                .handle
                .connected_identities()
                .iter()
                .any(PeerIdentity::is_replica)
                && agents[2].node.handle.connected_identities().len() == 1
                && agents[0].node.handle.connected_identities().len() == 2
        })
        .await;
        println!("partition detected after {:?}", cut.elapsed());

        // Both sides keep accepting updates (three revisions per agent) and serving them.
        let node_change = |a: &Agent| {
            a.written
                .iter()
                .find(|((_, k), _)| k.kind == ObjectKind::Node)
                .map(|((_, k), json)| ObjectChange::Upsert {
                    key: k.clone(),
                    json: json.clone().into(),
                })
                .unwrap()
        };
        let before_cut: Vec<View> = agents.iter().map(|a| a.written.clone()).collect();
        for rev in 1..=3 {
            for a in &mut agents {
                let c = relabel(&node_change(a), &format!("partitioned-{rev}"));
                a.write(vec![c]).await;
            }
        }
        let sides: [(&[usize], &[usize]); 2] = [(&[0, 1], &[0, 1]), (&[2], &[2, 3])];
        for (reps_on_side, agents_on_side) in sides {
            for &ri in reps_on_side {
                for &ai in agents_on_side {
                    let (cluster, key, want) = {
                        let ((c, k), v) = agents[ai]
                            .written
                            .iter()
                            .find(|((_, k), _)| k.kind == ObjectKind::Node)
                            .unwrap();
                        (c.clone(), k.clone(), v.clone())
                    };
                    wait_until("update on its side", Duration::from_secs(10), || {
                        replicas[ri].get(&cluster, &key).as_ref() == Some(&want)
                    })
                    .await;
                }
            }
        }
        // Nothing crossed: each side still serves the other side's pre-partition values.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let crossed = |ri: usize, ai: usize| {
            let ((c, k), v) = before_cut[ai]
                .iter()
                .find(|((_, k), _)| k.kind == ObjectKind::Node)
                .unwrap();
            replicas[ri].get(c, k).as_ref() != Some(v)
        };
        assert!(
            !crossed(2, 0) && !crossed(2, 1),
            "left updates leaked to r2"
        );
        assert!(
            !crossed(0, 2) && !crossed(1, 3),
            "right updates leaked to the left"
        );

        let healed = Instant::now();
        for r in &relays {
            r.blocked.lock().unwrap().clear();
        }
        let union = union_of(&agents);
        wait_until("convergence after heal", Duration::from_secs(30), || {
            converged(&reps, &agents)
        })
        .await;
        println!("converged {:?} after heal", healed.elapsed());
        for (i, r) in replicas.iter().enumerate() {
            assert!(r.view() == union, "replica r{i} lacks a last write");
        }
        shutdown(agents.into_iter().map(|a| a.node)).await;
        shutdown(replicas).await;
    })
    .await
    .expect("test timed out");
}

/// A complete automerge exchange of `forger`'s document toward an empty peer: the message that
/// carries the changes (the first one only carries heads).
fn forged_changes_message(forger: &mut Store, doc: &DocId, generation: u64) -> Vec<u8> {
    let mut empty = mem_store();
    let (mut sf, mut se) = (SyncState::new(), SyncState::new());
    let first = forger
        .generate_sync_message(doc, generation, &mut sf)
        .unwrap()
        .unwrap();
    empty
        .receive_sync_message(doc, generation, &mut se, &first, &|_| true)
        .unwrap();
    let ask = empty
        .generate_sync_message(doc, generation, &mut se)
        .unwrap()
        .unwrap();
    forger
        .receive_sync_message(doc, generation, &mut sf, &ask, &|_| true)
        .unwrap();
    forger
        .generate_sync_message(doc, generation, &mut sf)
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_relaying_a_forged_change_over_quic_is_refused_and_counted() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(60), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let mut replicas = start_replicas(&ca, 2).await;
        let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.handle.local_addr()).collect();
        let mut agent = Agent::start(&ca, "c1", "n1", addrs.clone()).await;
        let spec = &uniform_fleet(1, 1, 0.5)[0];
        let objects: Vec<ObjectChange> = generate(spec)
            .objects
            .iter()
            .map(ObjectChange::upsert)
            .collect();
        let node_key = objects
            .iter()
            .map(|c| c.key().clone())
            .find(|k| k.kind == ObjectKind::Node)
            .unwrap();
        agent.write(objects).await;
        let want = agent.entry();
        wait_until(
            "replicas hold the agent's document",
            Duration::from_secs(20),
            || {
                replicas
                    .iter()
                    .all(|r| r.store.lock().unwrap().entry(&agent.doc) == Some(want.clone()))
            },
        )
        .await;
        let before: Vec<_> = replicas.iter().map(|r| (r.digest(), r.view())).collect();
        // The rogue holds a genuine replica certificate (replicas relay every document) and
        // a copy of the document with the writer's signature, and forges the next change.
        let rogue = replica_id("rogue");
        let rogue_tls = certs::issue_identity(&ca, &rogue, 1).unwrap();
        let forged_json = r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"forged"}}"#;
        let (generation, payload, stale) = {
            let s = replicas[0].store.lock().unwrap();
            forge::forge(
                s.store(),
                &agent.doc,
                &dramesh_store::keys::doc_key(&node_key).unwrap(),
                forged_json,
            )
        };
        let own = {
            use dramesh_store::HeadsSigner as _;
            let signer = dramesh_mesh::signing::MeshSigner::new(&rogue_tls).unwrap();
            let statement = dramesh_store::attest::statement(&agent.doc, generation, &stale.heads);
            dramesh_store::Attestation::new(
                stale.heads.clone(),
                signer.sign(&statement).unwrap(),
                signer.signer(),
            )
            .unwrap()
        };
        let cfg = fast_config(rogue_tls.clone(), vec![]);
        let endpoint =
            transport::make_endpoint(LOCAL.parse().unwrap(), &rogue_tls, &cfg.transport).unwrap();
        let conn = endpoint
            .connect(addrs[0], MESH_SERVER_NAME)
            .unwrap()
            .await
            .unwrap();
        let (mut send, _recv) = conn.open_bi().await.unwrap();
        let frame = |body: Body| wire::encode_frame(&wire::envelope(body)).unwrap();
        send.write_all(&frame(Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            role: pb::Role::Replica as i32,
            identity: rogue.uri(),
            advertise_addr: String::new(),
            relay: false,
            ..Default::default()
        })))
        .await
        .unwrap();
        for signed in [None, Some(&stale), Some(&own)] {
            send.write_all(&frame(Body::Sync(pb::Sync {
                doc: Some((&agent.doc).into()),
                generation,
                payload: payload.clone(),
                signed: signed.map(Into::into),
            })))
            .await
            .unwrap();
        }
        wait_until("bad signatures counted", Duration::from_secs(10), || {
            replicas[0].handle.counters().rejected_bad_signature >= 3
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for (i, r) in replicas.iter().enumerate() {
            assert_eq!(r.digest(), before[i].0, "r{i} digest");
            assert!(r.view() == before[i].1, "r{i} view");
        }
        // The refusals reach /metrics under reason="bad_signature".
        let r0 = replicas.remove(0);
        let handle = Arc::new(r0.handle);
        let observer = dramesh_mesh::observe::Observer::new(
            Arc::new(dramesh_telemetry::Metrics::new()),
            handle.clone(),
            r0.store.clone(),
        );
        observer.refresh(Vec::new()).await;
        let text = observer.metrics.render();
        assert!(
            text.contains("dramesh_mesh_rejected_writes_total{reason=\"bad_signature\"} 3"),
            "{text}"
        );
        drop(observer);
        conn.close(0u32.into(), b"bye");
        agent.node.handle.shutdown().await;
        if let Ok(h) = Arc::try_unwrap(handle) {
            h.shutdown().await;
        }
        shutdown(replicas).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_of_cluster_a_cannot_alter_cluster_b() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(90), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let replicas = start_replicas(&ca, 3).await;
        let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.handle.local_addr()).collect();
        let specs = uniform_fleet(2, 1, 0.5);
        let (a_name, b_name) = (specs[0].name.clone(), specs[1].name.clone());
        let mut agents = Vec::new();
        for spec in &specs {
            for (node, objects) in per_node_objects(spec) {
                let mut a = Agent::start(&ca, &spec.name, &node, vec![addrs[0]]).await;
                a.write(objects).await;
                agents.push(a);
            }
        }
        let reps: Vec<&TestNode> = replicas.iter().collect();
        wait_until("convergence", Duration::from_secs(60), || {
            converged(&reps, &agents)
        })
        .await;
        let b_doc = agents[1].doc.clone();
        let b_ref = b_doc.clone();
        let b_view = |r: &TestNode| -> View {
            r.view()
                .into_iter()
                .filter(|((c, _), _)| *c == b_name)
                .collect()
        };
        let b_before: Vec<(View, Option<DocEntry>)> = replicas
            .iter()
            .map(|r| (b_view(r), r.store.lock().unwrap().entry(&b_ref)))
            .collect();
        assert!(!b_before[0].0.is_empty());

        // The forger derives cluster B's writer actor (it is public) and writes a newer
        // generation of B's document in which a B node carries a fake label.
        let mut forger = mem_store();
        let forged_gen = forger.open_writer(&b_doc).unwrap();
        let b_node = ObjectChange::Upsert {
            key: ObjectKey::new(ObjectKind::Node, None, &b_doc.writer),
            json: agents[1]
                .written
                .iter()
                .find(|((_, k), _)| k.kind == ObjectKind::Node)
                .map(|(_, v)| v.clone())
                .unwrap()
                .into(),
        };
        forger
            .apply(&b_doc, vec![relabel(&b_node, "forged")])
            .unwrap();
        assert!(forged_gen > b_before[0].1.as_ref().unwrap().generation);
        let forged = forged_changes_message(&mut forger, &b_doc, forged_gen);

        // A rogue client holding a genuine certificate for an agent of cluster A speaks the
        // wire protocol directly, bypassing its own node's checks.
        let rogue = agent_id(&a_name, "rogue");
        let rogue_tls = certs::issue_identity(&ca, &rogue, 1).unwrap();
        let cfg = fast_config(rogue_tls.clone(), vec![]);
        let endpoint =
            transport::make_endpoint(LOCAL.parse().unwrap(), &rogue_tls, &cfg.transport).unwrap();
        let conn = endpoint
            .connect(addrs[0], MESH_SERVER_NAME)
            .unwrap()
            .await
            .unwrap();
        let (mut send, _recv) = conn.open_bi().await.unwrap();
        let frame = |body: Body| wire::encode_frame(&wire::envelope(body)).unwrap();
        send.write_all(&frame(Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            role: pb::Role::Agent as i32,
            identity: rogue.uri(),
            advertise_addr: String::new(),
            relay: false,
            ..Default::default()
        })))
        .await
        .unwrap();
        // 1. B's document, named as such: refused by the mesh's authorization.
        send.write_all(&frame(Body::Sync(pb::Sync {
            doc: Some((&b_ref).into()),
            generation: forged_gen,
            payload: forged.clone(),
            signed: None,
        })))
        .await
        .unwrap();
        // 2. The same changes smuggled under the rogue's own document id: refused by the
        //    store, whose author check binds every change to the named document's writer.
        let own = DocId::new(a_name.clone(), "rogue");
        send.write_all(&frame(Body::Sync(pb::Sync {
            doc: Some((&own).into()),
            generation: forged_gen,
            payload: forged,
            signed: None,
        })))
        .await
        .unwrap();
        // 3. A bucket entry claiming B's document: refused and counted as well.
        send.write_all(&frame(Body::BucketEntries(pb::BucketEntries {
            buckets: vec![b_ref.bucket()],
            entries: vec![pb::DocEntry::from(&DocEntry {
                doc: b_ref.clone(),
                generation: forged_gen,
                heads_hash: [7; 32],
            })],
        })))
        .await
        .unwrap();
        wait_until("rejections counted", Duration::from_secs(10), || {
            let c = replicas[0].handle.counters();
            c.rejected_unauthorized >= 2 && c.rejected_by_store >= 1
        })
        .await;
        // Give any leak time to spread, then check every replica.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for (i, r) in replicas.iter().enumerate() {
            let (view, entry) = &b_before[i];
            assert!(b_view(r) == *view, "r{i}: cluster B state changed");
            assert_eq!(
                &r.store.lock().unwrap().entry(&b_ref),
                entry,
                "r{i}: B entry"
            );
            assert_eq!(
                r.store.lock().unwrap().entry(&own),
                None,
                "r{i}: smuggled document advertised"
            );
        }
        let c = replicas[0].handle.counters();
        println!("r0 counters after the attack: {c:?}");
        assert_eq!(c.rejected_by_store, 1, "{c:?}");
        // B's honest agent keeps publishing normally afterwards.
        let honest = relabel(&b_node, "honest");
        agents[1].write(vec![honest]).await;
        wait_until("honest update", Duration::from_secs(20), || {
            converged(&reps, &agents)
        })
        .await;
        let union = union_of(&agents);
        for r in &replicas {
            assert!(r.view() == union);
        }
        conn.close(0u32.into(), b"bye");
        shutdown(agents.into_iter().map(|a| a.node)).await;
        shutdown(replicas).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_replica_catches_up_with_only_the_missing_changes() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(180), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let tls = |p: &PeerIdentity| certs::issue_identity(&ca, p, 1).unwrap();
        let r0 = TestNode::start(fast_config(tls(&replica_id("r0")), vec![]), mem_store(), true)
            .await;
        let seeds = vec![r0.handle.local_addr()];
        let r1 =
            TestNode::start(fast_config(tls(&replica_id("r1")), seeds.clone()), mem_store(), true)
                .await;
        let dir2 = tempfile::tempdir().unwrap();
        let mut cfg2 = fast_config(tls(&replica_id("r2")), seeds.clone());
        cfg2.listen = free_udp_addr();
        let (store2, loaded) = disk_store(dir2.path());
        assert_eq!(loaded, 0);
        let r2 = TestNode::start(cfg2.clone(), store2, true).await;
        // Three directory-mode agents (one document per cluster) of 40 nodes each.
        let mut agents = Vec::new();
        for spec in uniform_fleet(3, 40, 0.5) {
            let mut a = Agent::start(&ca, &spec.name, dramesh_store::CLUSTER_PUBLISHER, seeds.clone()).await;
            let objects = generate(&spec).objects.iter().map(ObjectChange::upsert).collect();
            a.write(objects).await;
            agents.push(a);
        }
        wait_until("convergence", Duration::from_secs(90), || {
            converged(&[&r0, &r1, &r2], &agents)
        })
        .await;
        let full_state_bytes: usize = {
            let s = r0.store.lock().unwrap();
            agents
                .iter()
                .map(|a| s.store().fresh_size(&a.doc).unwrap().unwrap())
                .sum()
        };

        // Stop r2, then make a few changes it misses.
        r2.handle.shutdown().await;
        drop(r2.store);
        let mut changed_payload = 0;
        for a in &mut agents {
            let node = a
                .written
                .iter()
                .find(|((_, k), _)| k.kind == ObjectKind::Node)
                .map(|((_, k), json)| ObjectChange::Upsert {
                    key: k.clone(),
                    json: json.clone().into(),
                })
                .unwrap();
            let c = relabel(&node, "while-r2-was-down");
            if let ObjectChange::Upsert { json, .. } = &c {
                changed_payload += json.len();
            }
            a.write(vec![c]).await;
        }
        wait_until("r0, r1 updated", Duration::from_secs(20), || {
            converged(&[&r0, &r1], &agents)
        })
        .await;
        let stale = agents[0].entry();

        // Restart r2 from its directory on the same address.
        let (store2, loaded) = disk_store(dir2.path());
        assert_eq!(loaded, 3, "r2 reloads its three documents");
        let store = Arc::new(Mutex::new(MeshStore::new(store2, true)));
        // shutdown() returned only after the old socket closed, so the address is free.
        let handle = MeshHandle::start(cfg2.clone(), store.clone())
            .await
            .expect("restart on the same address");
        let r2 = TestNode { handle, store };
        assert_ne!(
            r2.store.lock().unwrap().entry(&stale.doc).unwrap().heads_hash,
            stale.heads_hash,
            "r2 came back with the old heads"
        );
        let restarted = Instant::now();
        wait_until("restarted r2 catches up", Duration::from_secs(30), || {
            converged(&[&r2], &agents)
        })
        .await;
        let catch_up = r2.bytes_received().await;
        println!(
            "restart catch-up: {:?}, {catch_up} bytes received (changed payload {changed_payload} bytes)",
            restarted.elapsed()
        );
        assert!(r2.view() == union_of(&agents));

        // For comparison, a new replica with an empty directory loads the same state.
        let dir3 = tempfile::tempdir().unwrap();
        let (store3, _) = disk_store(dir3.path());
        let r3 = TestNode::start(fast_config(tls(&replica_id("r3")), seeds.clone()), store3, true)
            .await;
        let joined = Instant::now();
        wait_until("new r3 loads everything", Duration::from_secs(60), || {
            converged(&[&r3], &agents)
        })
        .await;
        let full = r3.bytes_received().await;
        println!(
            "full resync: {:?}, {full} bytes received; documents saved: {full_state_bytes} bytes",
            joined.elapsed()
        );
        assert!(r3.view() == union_of(&agents));
        let baseline = full.min(full_state_bytes as u64);
        assert!(
            catch_up * 4 < baseline,
            "catch-up {catch_up} bytes is not below 25% of a full resync ({full} bytes received, {full_state_bytes} bytes of documents)"
        );
        shutdown(agents.into_iter().map(|a| a.node)).await;
        shutdown([r0, r1, r2, r3]).await;
    })
    .await
    .expect("test timed out");
}

/// Issue 14 item 8 over real QUIC: an agent whose clock runs 300 days ahead writes a
/// generation the replica refuses. The replica marks the agent's session refused (so its
/// heartbeats no longer keep the cluster fresh) and tells the agent why; the agent counts the
/// refusal. Restarted with the right clock on the same data directory, the agent starts a new
/// generation by itself and its data arrives, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_with_a_clock_far_ahead_is_refused_told_and_recovers() {
    const DAY_MS: i64 = 24 * 3600 * 1000;
    init_tracing();
    tokio::time::timeout(Duration::from_secs(120), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let replica = TestNode::start(
            fast_config(
                certs::issue_identity(&ca, &replica_id("r0"), 1).unwrap(),
                vec![],
            ),
            mem_store(),
            true,
        )
        .await;
        let seeds = vec![replica.handle.local_addr()];
        let dir = tempfile::tempdir().unwrap();
        let doc = DocId::new("east", "n1");
        let n1 = ObjectKey::new(ObjectKind::Node, None, "n1");
        let start_agent = |offset_ms: i64| {
            let (store, _) = Store::open(
                dir.path(),
                StoreConfig {
                    durability: Durability::Fsync,
                    clock_offset_ms: offset_ms,
                    ..StoreConfig::default()
                },
            )
            .unwrap();
            let id = certs::issue_identity(&ca, &agent_id("east", "n1"), 1).unwrap();
            TestNode::start(fast_config(id, seeds.clone()), store, false)
        };
        let agent = start_agent(300 * DAY_MS).await;
        let bad = agent.store.lock().unwrap().open_writer(&doc).unwrap();
        let node_json = br#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1"}}"#;
        agent
            .store
            .lock()
            .unwrap()
            .apply(
                &doc,
                vec![ObjectChange::Upsert {
                    key: n1.clone(),
                    json: Arc::from(&node_json[..]),
                }],
            )
            .unwrap();
        agent.handle.notify_local_change(doc.clone()).await;

        // The replica refuses and says so on the agent's session; the agent hears why.
        let mut why = None;
        for _ in 0..200 {
            why = replica
                .handle
                .peers()
                .await
                .into_iter()
                .find(|p| p.identity == agent_id("east", "n1"))
                .and_then(|p| p.refused);
            if why.is_some() && agent.handle.counters().refusals_received > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let why = why.expect("the replica marks the refused writer's session");
        assert!(why.contains("more than 30 days in the future"), "{why}");
        assert!(agent.handle.counters().refusals_received > 0);
        assert!(replica.handle.counters().refusals_sent > 0);
        assert_eq!(replica.get("east", &n1), None);
        agent.handle.shutdown().await;

        // The clock is fixed; the agent restarts on the same directory.
        let agent = start_agent(0).await;
        let good = agent.store.lock().unwrap().open_writer(&doc).unwrap();
        assert!(
            good < bad,
            "a new generation from the corrected clock: {good} vs {bad}"
        );
        agent.handle.notify_local_change(doc.clone()).await;
        wait_until(
            "the recovered generation arrives",
            Duration::from_secs(30),
            || replica.get("east", &n1).is_some(),
        )
        .await;
        assert_eq!(
            replica
                .store
                .lock()
                .unwrap()
                .entry(&doc)
                .map(|e| e.generation),
            Some(good)
        );
        let refused_now = replica
            .handle
            .peers()
            .await
            .into_iter()
            .find(|p| p.identity == agent_id("east", "n1"))
            .and_then(|p| p.refused);
        assert_eq!(refused_now, None);
        agent.handle.shutdown().await;
        replica.handle.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// A batch whose commit fails sends nothing that reflects it (the replica announces no applied
/// change and relays nothing), and the next commit that succeeds makes those changes durable:
/// a restarted replica holds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_releases_nothing_and_the_next_commit_covers_it() {
    init_tracing();
    tokio::time::timeout(Duration::from_secs(120), async {
        let ca = certs::generate_ca("test CA", 1).unwrap();
        let tls = |p: &PeerIdentity| certs::issue_identity(&ca, p, 1).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (disk, _) = disk_store(dir.path());
        let replica = Wrapped::new(MeshStore::new(disk, true));
        let fail = replica.fail_commits.clone();
        let replica = Arc::new(Mutex::new(replica));
        let handle =
            MeshHandle::start(fast_config(tls(&replica_id("r0")), vec![]), replica.clone())
                .await
                .unwrap();
        let mut agent = Agent::start(
            &ca,
            "c1",
            dramesh_store::CLUSTER_PUBLISHER,
            vec![handle.local_addr()],
        )
        .await;
        let node = |label: &str| ObjectChange::Upsert {
            key: ObjectKey::new(ObjectKind::Node, None, "n1"),
            json: serde_json::to_vec(&serde_json::json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "n1", "labels": {"l": label}}}))
            .unwrap()
            .into(),
        };
        let holds =
            |agent: &Agent| replica.lock().unwrap().entry(&agent.doc) == Some(agent.entry());
        agent.write(vec![node("a")]).await;
        wait_until(
            "the replica holds the first write",
            Duration::from_secs(30),
            || holds(&agent),
        )
        .await;

        // Commits fail: the replica applies the change but announces nothing.
        let mut applied = handle.subscribe();
        while applied.try_recv().is_ok() {}
        fail.store(true, std::sync::atomic::Ordering::SeqCst);
        agent.write(vec![node("b")]).await;
        wait_until(
            "the replica's store applied the second write",
            Duration::from_secs(30),
            || holds(&agent),
        )
        .await;
        // The commit runs in the same batch as the apply; give the driver ample time to have
        // (wrongly) released it.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut announced = Vec::new();
        while let Ok(a) = applied.try_recv() {
            announced.push(a.doc);
        }
        assert!(
            !announced.contains(&agent.doc),
            "a change whose commit failed was announced"
        );

        // Commits succeed again: the next change's commit covers the failed one's file too.
        fail.store(false, std::sync::atomic::Ordering::SeqCst);
        agent.write(vec![node("c")]).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match tokio::time::timeout_at(deadline.into(), applied.recv()).await {
                Ok(Ok(a)) if a.doc == agent.doc => break,
                Ok(_) => continue,
                Err(_) => panic!("no applied change announced after commits succeed again"),
            }
        }
        let expected = agent.entry();
        handle.shutdown().await;
        drop(replica);
        let (reopened, _) = disk_store(dir.path());
        assert_eq!(
            reopened.entry(&agent.doc),
            Some(expected),
            "durable after the next commit"
        );
    })
    .await
    .expect("timed out");
}
