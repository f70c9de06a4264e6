//! Signed changes, sans-I/O: `Protocol` instances over the real store ([`MeshStore`]) with the
//! real signer and verifier of their CA-issued identities exchange frames in memory.
//!
//! Covered: honest changes reach replicas that only hear of them through relays (the proof
//! travels with them, also after the relaying replica restarted from disk); a writer signing
//! with a key that is not its certificate's, or with another identity's certificate, is
//! refused by every replica; a replica relaying a forged change (unsigned, under the writer's
//! stale signature, or signed with its own key) is refused. Refusals leave digests and views
//! unchanged and count as `bad_signature`. Through a cluster's relay: replicas keep the node's
//! own signature; a relay pushing forged, unsigned or self-signed changes is refused; a node
//! sending another node's document, or a relay another cluster's, is refused by scope even
//! when the message is genuine and signed.

#[path = "common/fixtures.rs"]
mod fixtures;
#[path = "common/forge.rs"]
mod forge;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use automerge::transaction::Transactable as _;
use dramesh_mesh::certs::{self, CaBundle, TlsIdentity};
use dramesh_mesh::protocol::{ConnId, Output, Protocol};
use dramesh_mesh::signing;
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_mesh::wire::{self, pb, pb::envelope::Body};
use dramesh_mesh::{DocStore, PeerIdentity};
use dramesh_store::{
    Attestation, DocId, Durability, ObjectChange, ObjectKey, ObjectKind, Store, StoreConfig,
    writer_actor,
};
use fixtures::{config, mem_store, node_change};

struct Node {
    proto: Protocol,
    store: MeshStore,
}

struct Sim {
    nodes: Vec<Node>,
    /// (node a, conn at a, node b, conn at b)
    links: Vec<(usize, ConnId, usize, ConnId)>,
    queue: VecDeque<(usize, ConnId, pb::Envelope)>,
    now: Instant,
    next_conn: u64,
    /// Signed Sync frames sent with the signer chain, and with its hash only.
    chains_sent: usize,
    refs_sent: usize,
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

fn node_key(name: &str) -> ObjectKey {
    ObjectKey::new(ObjectKind::Node, None, name)
}

impl Sim {
    fn new() -> Sim {
        Sim {
            nodes: Vec::new(),
            links: Vec::new(),
            queue: VecDeque::new(),
            now: Instant::now(),
            next_conn: 1,
            chains_sent: 0,
            refs_sent: 0,
        }
    }

    /// Adds a node signing with `signer` (its own identity unless a test forges one).
    fn add(&mut self, signer: &TlsIdentity, store: Store) -> usize {
        let mut store = MeshStore::new(store, true);
        store.set_trust(signing::trust(signer).unwrap());
        self.nodes.push(Node {
            proto: Protocol::new(signer.identity.clone(), config()),
            store,
        });
        self.nodes.len() - 1
    }

    fn connect(&mut self, a: usize, b: usize) -> (ConnId, ConnId) {
        let (ca, cb) = (ConnId(self.next_conn), ConnId(self.next_conn + 1));
        self.next_conn += 2;
        self.links.push((a, ca, b, cb));
        let (ida, idb) = (
            self.nodes[a].proto.local().clone(),
            self.nodes[b].proto.local().clone(),
        );
        let out = self.nodes[a].proto.on_connected(ca, idb, self.now);
        self.route(a, out);
        let out = self.nodes[b].proto.on_connected(cb, ida, self.now);
        self.route(b, out);
        self.run();
        (ca, cb)
    }

    fn route(&mut self, from: usize, outputs: Vec<Output>) {
        for o in outputs {
            let Output::Send { conn, envelope } = o else {
                continue;
            };
            if let Some(Body::Sync(pb::Sync {
                signed: Some(sh), ..
            })) = &envelope.body
            {
                if sh.signer.is_empty() {
                    self.refs_sent += 1;
                } else {
                    self.chains_sent += 1;
                }
            }
            let to = self.links.iter().find_map(|&(a, ca, b, cb)| {
                if a == from && ca == conn {
                    Some((b, cb))
                } else if b == from && cb == conn {
                    Some((a, ca))
                } else {
                    None
                }
            });
            if let Some((to, to_conn)) = to {
                self.queue.push_back((to, to_conn, envelope));
            }
        }
    }

    fn run(&mut self) {
        let mut steps = 0;
        while let Some((to, conn, env)) = self.queue.pop_front() {
            steps += 1;
            assert!(steps < 100_000, "protocol did not quiesce");
            let n = &mut self.nodes[to];
            let out = n.proto.handle_frame(&mut n.store, conn, env, self.now);
            n.store.flush().unwrap();
            self.route(to, out);
        }
    }

    fn tick(&mut self, dt: Duration) {
        self.now += dt;
        for i in 0..self.nodes.len() {
            let n = &mut self.nodes[i];
            let out = n.proto.on_tick(&mut n.store, self.now);
            self.route(i, out);
        }
        self.run();
    }

    fn write(&mut self, node: usize, doc: &DocId, change: ObjectChange) {
        let n = &mut self.nodes[node];
        n.store.apply(doc, vec![change]).unwrap();
        let out = n.proto.on_local_change(&mut n.store, doc);
        self.route(node, out);
        self.run();
        self.tick(Duration::from_millis(600));
    }

    fn get(&self, node: usize, cluster: &str, key: &ObjectKey) -> Option<String> {
        self.nodes[node]
            .store
            .store()
            .get(cluster, key)
            .map(|j| String::from_utf8_lossy(&j).into_owned())
    }

    fn bad_signatures(&self, node: usize) -> u64 {
        self.nodes[node].proto.counters().rejected_bad_signature
    }

    /// Sends `sync` to node `to` as if from its peer on `conn` and returns nothing it answered.
    fn inject(&mut self, to: usize, conn: ConnId, sync: pb::Sync) {
        let n = &mut self.nodes[to];
        let out = n.proto.handle_frame(
            &mut n.store,
            conn,
            wire::envelope(Body::Sync(sync)),
            self.now,
        );
        n.store.flush().unwrap();
        self.route(to, out);
        self.run();
    }
}

fn ids(ca: &CaBundle) -> (TlsIdentity, TlsIdentity, TlsIdentity, TlsIdentity) {
    (
        certs::issue_identity(ca, &replica("r0"), 1).unwrap(),
        certs::issue_identity(ca, &replica("r1"), 1).unwrap(),
        certs::issue_identity(ca, &replica("r2"), 1).unwrap(),
        certs::issue_identity(ca, &agent("c1", "n1"), 1).unwrap(),
    )
}

/// Replicas r0 - r1 - r2 in a line (r2 hears of everything only through relays) and the
/// writer c1/n1 connected to `writer_reaches`.
fn line(ca: &CaBundle, writer: &TlsIdentity, writer_reaches: &[usize]) -> Sim {
    let (r0, r1, r2, _) = ids(ca);
    let mut sim = Sim::new();
    for id in [&r0, &r1, &r2] {
        sim.add(id, mem_store());
    }
    let w = sim.add(writer, mem_store());
    sim.nodes[w]
        .store
        .open_writer(&DocId::new("c1", "n1"))
        .unwrap();
    sim.connect(0, 1);
    sim.connect(1, 2);
    for r in writer_reaches {
        sim.connect(w, *r);
    }
    sim
}

#[test]
fn signed_changes_reach_replicas_that_only_hear_of_them_through_relays() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let writer = ids(&ca).3;
    let mut sim = line(&ca, &writer, &[0]);
    let doc = DocId::new("c1", "n1");
    sim.write(3, &doc, node_change("n1", "4"));
    // The signer chain crossed each of the three sessions on the path once.
    assert_eq!(sim.chains_sent, 3, "{} chains", sim.chains_sent);
    sim.write(3, &doc, node_change("n1", "8"));
    assert_eq!(sim.chains_sent, 3, "the chain is sent once per session");
    assert!(sim.refs_sent >= 3, "{} references", sim.refs_sent);
    for r in 0..3 {
        let got = sim.get(r, "c1", &node_key("n1")).unwrap_or_default();
        assert!(got.contains("\"8\""), "r{r}: {got}");
        assert_eq!(sim.bad_signatures(r), 0, "r{r}");
        // Each replica holds the writer's signature over exactly the heads it holds.
        assert!(
            sim.nodes[r].store.store().signed_heads(&doc).is_some(),
            "r{r}"
        );
    }
    assert_eq!(sim.nodes[0].store.digest(), sim.nodes[2].store.digest());
}

/// The writer's certificate with another identity's private key: a modified writer.
fn wrong_key(cert_of: &TlsIdentity, key_of: &TlsIdentity) -> TlsIdentity {
    TlsIdentity {
        cert_chain: cert_of.cert_chain.clone(),
        key: key_of.key.clone_key(),
        ca_certs: cert_of.ca_certs.clone(),
        identity: cert_of.identity.clone(),
    }
}

#[test]
fn a_writer_signing_with_the_wrong_key_is_refused_on_every_replica() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let honest = ids(&ca).3;
    let other = certs::issue_identity(&ca, &agent("c1", "n2"), 1).unwrap();
    let foreign_ca = certs::generate_ca("foreign CA", 1).unwrap();
    let foreign = certs::issue_identity(&foreign_ca, &agent("c1", "n1"), 1).unwrap();
    let doc = DocId::new("c1", "n1");
    // First the honest writer publishes, so there is a previous value and real digests.
    let mut sim = line(&ca, &honest, &[0, 1, 2]);
    sim.write(3, &doc, node_change("n1", "4"));
    let before: Vec<_> = (0..3).map(|r| sim.nodes[r].store.digest()).collect();
    let view_before: Vec<_> = (0..3).map(|r| sim.get(r, "c1", &node_key("n1"))).collect();
    assert!(
        view_before
            .iter()
            .all(|v| v.as_deref().unwrap_or("").contains("\"4\""))
    );
    // Modified writers of the same document, running the real writer path (new generation,
    // the writer's actor, pushed to every replica): its certificate with another node's key;
    // another node's certificate and key; a certificate for the right identity from a CA the
    // mesh does not trust.
    let forgers = [
        wrong_key(&honest, &other),
        TlsIdentity {
            identity: honest.identity.clone(),
            ..other.clone()
        },
        TlsIdentity {
            ca_certs: honest.ca_certs.clone(),
            ..foreign.clone()
        },
    ];
    for (i, forger) in forgers.iter().enumerate() {
        let f = sim.add(forger, mem_store());
        sim.nodes[f].store.open_writer(&doc).unwrap();
        for r in 0..3 {
            sim.connect(f, r);
        }
        sim.write(f, &doc, node_change("n1", "9999"));
        sim.tick(Duration::from_secs(3));
        for r in 0..3 {
            assert!(
                sim.bad_signatures(r) > 0,
                "forger {i}: r{r} counted no bad signature"
            );
            assert_eq!(
                sim.nodes[r].store.digest(),
                before[r],
                "forger {i}: r{r} digest"
            );
            assert_eq!(
                sim.get(r, "c1", &node_key("n1")),
                view_before[r],
                "forger {i}: r{r} view"
            );
        }
        // Drop the forger's sessions before the next one.
        sim.links.retain(|l| l.0 != f && l.2 != f);
    }
}

/// Node `forger`, whose certificate `forger_id` is valid but not `doc`'s writer's, pushes the
/// writer's Node (written with cpu "4") changed to a forged value to `targets`, on second
/// sessions: unsigned, under the writer's stale signature, and signed by itself (`own`). Each
/// is refused and counted, and no target's digest or view changes.
fn forgeries_are_refused(
    sim: &mut Sim,
    doc: &DocId,
    forger: usize,
    forger_id: &TlsIdentity,
    targets: [usize; 2],
    own: &str,
) {
    let before: Vec<_> = targets.map(|r| sim.nodes[r].store.digest()).to_vec();
    let view_before = sim.get(targets[0], "c1", &node_key("n1"));
    assert!(view_before.as_deref().unwrap_or("").contains("\"4\""));
    let forged_json = String::from_utf8(match node_change("n1", "9999") {
        ObjectChange::Upsert { json, .. } => json.to_vec(),
        ObjectChange::Delete { .. } => unreachable!(),
    })
    .unwrap();
    let (generation, payload, stale) = forge::forge(
        sim.nodes[forger].store.store(),
        doc,
        "node/n1",
        &forged_json,
    );
    let signed_by_forger = {
        use dramesh_store::HeadsSigner as _;
        let signer = signing::MeshSigner::new(forger_id).unwrap();
        let held = sim.nodes[forger].store.store().automerge_doc(doc).unwrap();
        let mut forged = held.clone().with_actor(writer_actor(doc, generation));
        let mut tx = forged.transaction();
        tx.put(automerge::ROOT, "node/n1", forged_json.as_bytes().to_vec())
            .unwrap();
        tx.commit();
        let heads: Vec<[u8; 32]> = forged.get_heads().iter().map(|h| h.0).collect();
        let statement = dramesh_store::attest::statement(doc, generation, &heads);
        Attestation::new(heads, signer.sign(&statement).unwrap(), signer.signer()).unwrap()
    };
    let attempts: [(&str, Option<&Attestation>); 3] = [
        ("unsigned", None),
        ("under the writer's stale signature", Some(&stale)),
        (own, Some(&signed_by_forger)),
    ];
    // Second sessions carry the forgeries (their receiving ends); the first ones stay as the
    // forger's honest protocol left them.
    let conns = targets.map(|r| (r, sim.connect(forger, r).1));
    for (n, (what, signed)) in attempts.iter().enumerate() {
        for (r, conn) in conns {
            sim.inject(
                r,
                conn,
                pb::Sync {
                    doc: Some(doc.into()),
                    generation,
                    payload: payload.clone(),
                    signed: signed.map(Into::into),
                },
            );
            assert_eq!(sim.bad_signatures(r), n as u64 + 1, "{what}: r{r}");
        }
    }
    sim.tick(Duration::from_secs(3));
    for (r, digest) in targets.iter().zip(&before) {
        assert_eq!(&sim.nodes[*r].store.digest(), digest, "r{r} digest");
        assert_eq!(sim.get(*r, "c1", &node_key("n1")), view_before, "r{r} view");
    }
}

#[test]
fn a_replica_relaying_a_forged_change_is_refused() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let (_, r1, _, writer) = ids(&ca);
    let doc = DocId::new("c1", "n1");
    let mut sim = line(&ca, &writer, &[1]);
    sim.write(3, &doc, node_change("n1", "4"));
    // r1 (compromised) has a valid replica certificate; it can sign, but only as itself.
    forgeries_are_refused(
        &mut sim,
        &doc,
        1,
        &r1,
        [0, 2],
        "signed by the relaying replica",
    );
    // The honest writer's next change still reaches everyone, through r1's honest relay.
    sim.write(3, &doc, node_change("n1", "8"));
    for r in 0..3 {
        let got = sim.get(r, "c1", &node_key("n1")).unwrap_or_default();
        assert!(got.contains("\"8\""), "r{r}: {got}");
    }
}

#[test]
fn a_replica_restarted_from_disk_proves_what_it_relays() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let (r0, r1, _, writer) = ids(&ca);
    let doc = DocId::new("c1", "n1");
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        Store::open(
            dir.path(),
            StoreConfig {
                durability: Durability::Fsync,
                ..StoreConfig::default()
            },
        )
        .unwrap()
        .0
    };
    let mut sim = Sim::new();
    sim.add(&r0, open());
    let w = sim.add(&writer, mem_store());
    sim.nodes[w].store.open_writer(&doc).unwrap();
    sim.connect(w, 0);
    sim.write(w, &doc, node_change("n1", "4"));
    sim.write(w, &doc, node_change("n1", "6"));
    assert!(sim.nodes[0].store.store().signed_heads(&doc).is_some());
    // Restart r0 from its directory, without the writer; a fresh replica r1 learns the
    // document only from it.
    let mut sim = Sim::new();
    sim.add(&r0, open());
    assert!(
        sim.nodes[0].store.store().signed_heads(&doc).is_some(),
        "proof not reloaded"
    );
    sim.add(&r1, mem_store());
    sim.connect(0, 1);
    sim.tick(Duration::from_secs(3));
    let got = sim.get(1, "c1", &node_key("n1")).unwrap_or_default();
    assert!(got.contains("\"6\""), "{got}");
    assert_eq!(sim.bad_signatures(1), 0);
    assert_eq!(sim.nodes[0].store.digest(), sim.nodes[1].store.digest());
}

fn pod_change(name: &str, node: &str) -> ObjectChange {
    let json = format!(
        r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"{name}","namespace":"ns"}},"spec":{{"nodeName":"{node}","containers":[]}}}}"#
    );
    ObjectChange::Upsert {
        key: ObjectKey::new(ObjectKind::Pod, Some("ns"), name),
        json: Arc::from(json.into_bytes().into_boxed_slice()),
    }
}

fn class_change(name: &str, by: &str) -> ObjectChange {
    let json = format!(
        r#"{{"apiVersion":"resource.k8s.io/v1","kind":"DeviceClass","metadata":{{"name":"{name}","labels":{{"by":"{by}"}}}}}}"#
    );
    ObjectChange::Upsert {
        key: ObjectKey::new(ObjectKind::DeviceClass, None, name),
        json: Arc::from(json.into_bytes().into_boxed_slice()),
    }
}

#[test]
fn a_node_agent_publishes_only_its_own_node_and_cluster_records_only_with_the_lease() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let (r0, r1, r2, n1) = ids(&ca);
    let zz = certs::issue_identity(&ca, &agent("c1", "zz"), 1).unwrap();
    let mut sim = Sim::new();
    for id in [&r0, &r1, &r2] {
        sim.add(id, mem_store());
    }
    let a = sim.add(&n1, mem_store());
    let z = sim.add(&zz, mem_store());
    let (doc_a, doc_z) = (DocId::new("c1", "n1"), DocId::new("c1", "zz"));
    sim.nodes[a].store.open_writer(&doc_a).unwrap();
    sim.nodes[z].store.open_writer(&doc_z).unwrap();
    sim.connect(0, 1);
    sim.connect(1, 2);
    sim.connect(a, 0);
    sim.connect(z, 2);
    // Both at term 0, as in the issue: zz ("zz" sorts above "n1", so on equal terms its copy
    // would win) publishes n1's Node after n1 did.
    sim.write(a, &doc_a, node_change("n1", "4"));
    sim.write(z, &doc_z, node_change("n1", "9999"));
    for r in 0..3 {
        let node = sim.get(r, "c1", &node_key("n1")).unwrap_or_default();
        assert!(node.contains("\"4\""), "r{r}: n1's Node is {node}");
    }
    // n1 takes the Lease (term 5) and publishes its pod and a class; zz a pod bound to n1, the
    // same class and a class of its own, all signed; and its own node, which is its to publish.
    sim.nodes[a].store.set_lease_term(&doc_a, 5).unwrap();
    sim.write(a, &doc_a, pod_change("p1", "n1"));
    sim.write(a, &doc_a, class_change("gpu", "n1"));
    let pod_key = ObjectKey::new(ObjectKind::Pod, Some("ns"), "p1");
    let class_key = ObjectKey::new(ObjectKind::DeviceClass, None, "gpu");
    sim.write(z, &doc_z, pod_change("p1", "n1"));
    sim.write(z, &doc_z, class_change("gpu", "zz"));
    sim.write(z, &doc_z, class_change("rogue", "zz"));
    sim.write(z, &doc_z, node_change("zz", "2"));
    sim.tick(Duration::from_secs(3));
    for r in 0..3 {
        let node = sim.get(r, "c1", &node_key("n1")).unwrap_or_default();
        assert!(node.contains("\"4\""), "r{r}: n1's Node is {node}");
        let pod = sim.get(r, "c1", &pod_key).unwrap_or_default();
        assert!(!pod.is_empty(), "r{r}: n1's pod gone");
        let class = sim.get(r, "c1", &class_key).unwrap_or_default();
        assert!(class.contains("\"n1\""), "r{r}: class is {class}");
        assert_eq!(
            sim.get(
                r,
                "c1",
                &ObjectKey::new(ObjectKind::DeviceClass, None, "rogue")
            ),
            None,
            "r{r}: a class from a writer without the Lease"
        );
        assert!(
            sim.get(r, "c1", &node_key("zz")).is_some(),
            "r{r}: zz's own node"
        );
        assert!(
            sim.nodes[r].store.store().out_of_scope_records() >= 4,
            "r{r}: {}",
            sim.nodes[r].store.store().out_of_scope_records()
        );
        // Both documents are replicated as they are (digests agree); only the view refuses.
        assert_eq!(sim.nodes[r].store.digest(), sim.nodes[0].store.digest());
    }
    // n1 removes its Node: zz's copy does not take its place.
    sim.nodes[a]
        .store
        .apply(
            &doc_a,
            vec![ObjectChange::Delete {
                key: node_key("n1"),
            }],
        )
        .unwrap();
    let n = &mut sim.nodes[a];
    let out = n.proto.on_local_change(&mut n.store, &doc_a);
    sim.route(a, out);
    sim.run();
    sim.tick(Duration::from_secs(3));
    for r in 0..3 {
        assert_eq!(sim.get(r, "c1", &node_key("n1")), None, "r{r}");
    }
    // The Lease moves to zz (a higher term): its class becomes visible, n1's class records
    // lose their scope, and everyone agrees.
    sim.nodes[z].store.set_lease_term(&doc_z, 6).unwrap();
    sim.write(z, &doc_z, node_change("zz", "3"));
    sim.tick(Duration::from_secs(3));
    for r in 0..3 {
        let class = sim.get(r, "c1", &class_key).unwrap_or_default();
        assert!(class.contains("\"zz\""), "r{r}: class is {class}");
        assert!(
            sim.get(
                r,
                "c1",
                &ObjectKey::new(ObjectKind::DeviceClass, None, "rogue")
            )
            .is_some(),
            "r{r}"
        );
    }
}

/// Replicas r0 and r1 (nodes 0, 1), the relay of cluster c1 (agent c1/lead, node 2, reaching
/// both), and node agents c1/n1 and c1/n2 (nodes 3, 4) that reach only the relay. Returns the
/// sim and the relay's and node agents' identities.
fn relayed(ca: &CaBundle) -> (Sim, [TlsIdentity; 3]) {
    let (r0, r1, _, n1) = ids(ca);
    let lead = certs::issue_identity(ca, &agent("c1", "lead"), 1).unwrap();
    let n2 = certs::issue_identity(ca, &agent("c1", "n2"), 1).unwrap();
    let mut sim = Sim::new();
    sim.add(&r0, mem_store());
    sim.add(&r1, mem_store());
    for (id, name) in [(&lead, "lead"), (&n1, "n1"), (&n2, "n2")] {
        let n = sim.add(id, mem_store());
        sim.nodes[n]
            .store
            .open_writer(&DocId::new("c1", name))
            .unwrap();
    }
    assert!(sim.nodes[2].proto.set_relay(true).is_empty());
    sim.connect(0, 1);
    sim.connect(2, 0);
    sim.connect(2, 1);
    sim.connect(3, 2);
    sim.connect(4, 2);
    sim.tick(Duration::from_secs(1));
    (sim, [lead, n1, n2])
}

#[test]
fn a_relay_carries_signed_changes_and_replicas_verify_the_writers_signature() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let (mut sim, [_, n1_id, _]) = relayed(&ca);
    let (n1, lead) = (DocId::new("c1", "n1"), DocId::new("c1", "lead"));
    sim.write(3, &n1, node_change("n1", "4"));
    sim.nodes[2].store.set_lease_term(&lead, 1).unwrap();
    sim.write(2, &lead, class_change("gpu", "lead"));
    sim.write(3, &n1, node_change("n1", "8"));
    for r in 0..2 {
        let got = sim.get(r, "c1", &node_key("n1")).unwrap_or_default();
        assert!(got.contains("\"8\""), "r{r}: {got}");
        let class = sim.get(
            r,
            "c1",
            &ObjectKey::new(ObjectKind::DeviceClass, None, "gpu"),
        );
        assert!(class.is_some(), "r{r}: the relay's own records");
        assert_eq!(sim.bad_signatures(r), 0, "r{r}");
        // The replica holds the node's own signature, which the relay passed on unchanged.
        let proof = sim.nodes[r].store.store().signed_heads(&n1).unwrap();
        assert_eq!(
            &*proof.signer,
            signing::encode_chain(&n1_id.cert_chain).as_slice(),
            "r{r}: the proof is not the node's own"
        );
    }
    assert_eq!(sim.bad_signatures(2), 0);
    assert!(sim.nodes[2].store.store().signed_heads(&n1).is_some());
}

#[test]
fn a_relay_pushing_a_forged_or_unsigned_change_is_refused() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let (mut sim, [lead, _, _]) = relayed(&ca);
    let doc = DocId::new("c1", "n1");
    sim.write(3, &doc, node_change("n1", "4"));
    // The relay signs with its own node key: a valid certificate of the same cluster, but not
    // the document's writer.
    forgeries_are_refused(&mut sim, &doc, 2, &lead, [0, 1], "signed by the relay");
    // The node's next honest change still reaches both replicas through the relay.
    sim.write(3, &doc, node_change("n1", "8"));
    for r in 0..2 {
        let got = sim.get(r, "c1", &node_key("n1")).unwrap_or_default();
        assert!(got.contains("\"8\""), "r{r}: {got}");
    }
}

#[test]
fn a_node_cannot_send_another_nodes_document_through_the_relay_even_genuinely_signed() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let (mut sim, _) = relayed(&ca);
    let n2 = DocId::new("c1", "n2");
    sim.write(4, &n2, node_change("n2", "4"));
    // n2 writes again without telling its mesh node; n1 obtained n2's genuine signed message
    // for it and sends it on its own session with the relay.
    sim.nodes[4]
        .store
        .apply(&n2, vec![node_change("n2", "5")])
        .unwrap();
    let (payload, signed) = sim.nodes[4]
        .store
        .generate_sync_message(&n2, &mut dramesh_store::SyncState::new())
        .unwrap();
    let generation = sim.nodes[4].store.entry(&n2).unwrap().generation;
    let n1_at_relay = sim
        .links
        .iter()
        .find(|l| l.0 == 3 && l.2 == 2)
        .map(|l| l.3)
        .unwrap();
    let refused = sim.nodes[2].proto.counters().rejected_unauthorized;
    sim.inject(
        2,
        n1_at_relay,
        pb::Sync {
            doc: Some((&n2).into()),
            generation,
            payload,
            signed: signed.as_ref().map(Into::into),
        },
    );
    assert_eq!(
        sim.nodes[2].proto.counters().rejected_unauthorized,
        refused + 1
    );
    for n in 0..3 {
        let got = sim.get(n, "c1", &node_key("n2")).unwrap_or_default();
        assert!(got.contains("\"4\""), "node {n}: {got}");
    }
    // From n2 itself the same change goes through.
    let out = {
        let n = &mut sim.nodes[4];
        n.proto.on_local_change(&mut n.store, &n2)
    };
    sim.route(4, out);
    sim.run();
    for r in 0..2 {
        let got = sim.get(r, "c1", &node_key("n2")).unwrap_or_default();
        assert!(got.contains("\"5\""), "r{r}: {got}");
    }
}

#[test]
fn a_relay_cannot_deliver_a_document_of_another_cluster_even_genuinely_signed() {
    let ca = certs::generate_ca("test CA", 1).unwrap();
    let (mut sim, _) = relayed(&ca);
    let foreign_id = certs::issue_identity(&ca, &agent("c2", "n1"), 1).unwrap();
    let doc = DocId::new("c2", "n1");
    let mut foreign = MeshStore::new(mem_store(), false);
    foreign.set_trust(signing::trust(&foreign_id).unwrap());
    foreign.open_writer(&doc).unwrap();
    foreign
        .apply(&doc, vec![node_change("n1", "9999")])
        .unwrap();
    let (payload, signed) = foreign
        .generate_sync_message(&doc, &mut dramesh_store::SyncState::new())
        .unwrap();
    let relay_at_r0 = sim
        .links
        .iter()
        .find(|l| l.0 == 2 && l.2 == 0)
        .map(|l| l.3)
        .unwrap();
    let refused = sim.nodes[0].proto.counters().rejected_unauthorized;
    sim.inject(
        0,
        relay_at_r0,
        pb::Sync {
            doc: Some((&doc).into()),
            generation: foreign.entry(&doc).unwrap().generation,
            payload,
            signed: signed.as_ref().map(Into::into),
        },
    );
    assert_eq!(
        sim.nodes[0].proto.counters().rejected_unauthorized,
        refused + 1
    );
    assert_eq!(sim.nodes[0].store.entry(&doc), None);
    assert_eq!(sim.get(0, "c2", &node_key("n1")), None);
}
