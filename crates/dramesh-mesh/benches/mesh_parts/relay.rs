//! The relay topology of the DaemonSet mode (`MESH_AGENTS=node`, `MESH_TOPOLOGY=relay`, the
//! default): per cluster, the Lease holder (its first node, lease term 1) is a mesh node with
//! a QUIC endpoint, the cluster's relay, dialing every replica; every other node writer runs
//! the real protocol (`Protocol` over its own store, signing with its own certificate's key)
//! and reaches the relay through an in-process link ([`MeshHandle::attach_local`]): the
//! relay's side of each node session is exactly what a QUIC session runs (framing, decoding,
//! budgets, the protocol thread), only the UDP hop is left out, because 100,000 loopback QUIC
//! endpoints do not fit on the machine (the direct topology's per-connection costs are
//! measured by `nodes::direct_setup`). One farm thread per cluster drives that cluster's node
//! writers: their frames, their timers (checked every second) and the updates the workload
//! writes into them.

use std::sync::mpsc as std_mpsc;

use dramesh_mesh::node::LocalLink;
use dramesh_mesh::protocol::{ConnId, Output, Protocol, ProtocolConfig};
use dramesh_mesh::wire;
use dramesh_store::DocEntry;

use super::nodes::{NodePlan, identities, plan_fleet, write_plan, writer_store};
use super::*;

/// The one session of a farm writer (with its relay).
const RELAY_CONN: ConnId = ConnId(1);
/// How often a farm checks its writers' timers.
const FARM_TICK: Duration = Duration::from_secs(1);

enum FarmEvent {
    /// A frame from the relay to writer `.0`.
    Frame(usize, Vec<u8>),
    /// The workload writes writer `.0`'s Node with sequence annotation `.1`.
    Update(usize, u64),
    /// Every writer's document entry.
    Entries(std_mpsc::Sender<Vec<DocEntry>>),
    Stop,
}

struct FarmWriter {
    proto: Protocol,
    store: MeshStore,
    doc: DocId,
    link: LocalLink,
    node: NodeTemplate,
}

/// A writer's Node JSON with room for the sequence annotation, so an update costs no JSON
/// serialization on the bench's side.
struct NodeTemplate {
    key: ObjectKey,
    json: Vec<u8>,
    /// Where the sequence number's [`SEQ_DIGITS`] digits start.
    seq_at: usize,
}

/// Digits of the zero-padded sequence number in a [`NodeTemplate`].
const SEQ_DIGITS: usize = 20;

impl NodeTemplate {
    fn new(node: &Value) -> NodeTemplate {
        let mut node = node.clone();
        node["metadata"]["annotations"][SEQ_ANNOTATION] = Value::String("0".repeat(SEQ_DIGITS));
        let name = node["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let json = serde_json::to_vec(&node).expect("node JSON");
        let seq_at = json
            .windows(SEQ_NEEDLE.len())
            .position(|w| w == SEQ_NEEDLE)
            .expect("sequence annotation")
            + SEQ_NEEDLE.len();
        NodeTemplate {
            key: ObjectKey::new(ObjectKind::Node, None, &name),
            json,
            seq_at,
        }
    }

    fn with_seq(&self, seq: u64) -> Vec<u8> {
        let mut json = self.json.clone();
        json[self.seq_at..self.seq_at + SEQ_DIGITS]
            .copy_from_slice(format!("{seq:0width$}", width = SEQ_DIGITS).as_bytes());
        json
    }
}

/// One cluster's node writers on one thread.
struct Farm {
    tx: std_mpsc::Sender<FarmEvent>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Frame bytes the writers sent to the relay.
    sent: Arc<AtomicU64>,
    /// The thread's id (for its CPU time in `/proc/self/task`).
    tid: Arc<AtomicU64>,
}

/// What the farm writer `w` must send or close after handling something.
fn deliver(w: &mut FarmWriter, outputs: Vec<Output>, sent: &AtomicU64) {
    for o in outputs {
        match o {
            Output::Send { envelope, .. } => match wire::encode_frame(&envelope) {
                Ok(frame) => {
                    sent.fetch_add(frame.len() as u64, Ordering::Relaxed);
                    if !w.link.blocking_send(frame) {
                        eprintln!("{}: link to the relay closed", w.doc);
                    }
                }
                Err(e) => eprintln!("{}: cannot encode a frame: {e}", w.doc),
            },
            Output::Close { reason, .. } => {
                eprintln!("{}: closing the relay session: {reason}", w.doc);
                w.link.close();
            }
            Output::Applied { .. } => {}
        }
    }
}

fn farm_main(
    mut writers: Vec<FarmWriter>,
    rx: std_mpsc::Receiver<FarmEvent>,
    relay: PeerIdentity,
    sent: Arc<AtomicU64>,
    tid: Arc<AtomicU64>,
) {
    // SAFETY: gettid has no preconditions.
    tid.store(unsafe { libc::gettid() } as u64, Ordering::Relaxed);
    let now = Instant::now();
    for w in &mut writers {
        let out = w.proto.on_connected(RELAY_CONN, relay.clone(), now);
        deliver(w, out, &sent);
    }
    let mut next_tick = Instant::now() + FARM_TICK;
    let mut touched: Vec<usize> = Vec::new();
    loop {
        let wait = next_tick.saturating_duration_since(Instant::now());
        let mut batch = Vec::new();
        match rx.recv_timeout(wait) {
            Ok(e) => batch.push(e),
            Err(std_mpsc::RecvTimeoutError::Timeout) => {}
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
        }
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        let now = Instant::now();
        touched.clear();
        for e in batch {
            match e {
                FarmEvent::Frame(i, frame) => {
                    let Some(w) = writers.get_mut(i) else {
                        continue;
                    };
                    let env = match wire::decode_payload(&frame[wire::FRAME_HEADER_LEN..]) {
                        Ok(env) => env,
                        Err(err) => {
                            eprintln!("{}: bad frame from the relay: {err}", w.doc);
                            continue;
                        }
                    };
                    let out = w.proto.handle_frame(&mut w.store, RELAY_CONN, env, now);
                    deliver(w, out, &sent);
                    touched.push(i);
                }
                FarmEvent::Update(i, seq) => {
                    let Some(w) = writers.get_mut(i) else {
                        continue;
                    };
                    let change = ObjectChange::Upsert {
                        key: w.node.key.clone(),
                        json: w.node.with_seq(seq).into(),
                    };
                    if let Err(err) = w.store.apply(&w.doc, vec![change]) {
                        eprintln!("{}: {err}", w.doc);
                        continue;
                    }
                    let out = w.proto.on_local_change(&mut w.store, &w.doc);
                    deliver(w, out, &sent);
                    touched.push(i);
                }
                FarmEvent::Entries(reply) => {
                    let entries = writers
                        .iter()
                        .filter_map(|w| w.store.entry(&w.doc))
                        .collect();
                    let _ = reply.send(entries);
                }
                FarmEvent::Stop => return,
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for &i in &touched {
            let w = &mut writers[i];
            let out = w.proto.flush_pushes(&mut w.store);
            // In memory: nothing to make durable, but the contract is kept.
            if let Err(e) = w.store.flush() {
                eprintln!("{}: flush failed: {e}", w.doc);
                continue;
            }
            deliver(w, out, &sent);
        }
        if Instant::now() >= next_tick {
            next_tick = Instant::now() + FARM_TICK;
            let now = Instant::now();
            for w in &mut writers {
                let out = w.proto.on_tick(&mut w.store, now);
                deliver(w, out, &sent);
            }
        }
    }
}

/// A cluster's relay: its own document (the Lease holder's node and the cluster-scoped
/// records) and its QUIC mesh node.
struct RelayNode {
    doc: DocId,
    handle: MeshHandle,
    store: Arc<Mutex<MeshStore>>,
    node: Value,
}

/// Every writer of the fleet in the relay topology.
pub(crate) struct RelayFleet {
    relays: Vec<RelayNode>,
    farms: Vec<Farm>,
    /// Writer `i`: (cluster, farm slot; `None` for the cluster's relay) and its Node JSON's
    /// size with the sequence annotation.
    writers: Vec<(usize, Option<usize>, usize)>,
    /// When each update reached its cluster's relay (sequence number -> unix ns).
    relay_seen: Arc<Mutex<HashMap<u64, u64>>>,
}

impl RelayFleet {
    /// CPU seconds of the farm threads (the node writers).
    fn farm_cpu_secs(&self) -> f64 {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        self.farms
            .iter()
            .map(|f| {
                let tid = f.tid.load(Ordering::Relaxed);
                let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))
                    .unwrap_or_default();
                let rest = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
                let v: Vec<&str> = rest.split_whitespace().collect();
                let t = |i: usize| v.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
                (t(11) + t(12)) as f64 / hz
            })
            .sum()
    }
}

impl Writers for RelayFleet {
    fn count(&self) -> usize {
        self.writers.len()
    }

    fn random_writer(&self) -> bool {
        true
    }

    fn update(
        &self,
        rt: &tokio::runtime::Handle,
        i: usize,
        _pick: u64,
        seq: u64,
    ) -> Result<usize, String> {
        let (cluster, slot, payload) = &self.writers[i];
        match slot {
            None => {
                let r = &self.relays[*cluster];
                write_node(&r.store, &r.doc, &r.node, seq)?;
                rt.block_on(r.handle.notify_local_change(r.doc.clone()));
            }
            Some(slot) => self.farms[*cluster]
                .tx
                .send(FarmEvent::Update(*slot, seq))
                .map_err(|_| "farm stopped".to_string())?,
        }
        Ok(*payload)
    }

    fn root(&self) -> u64 {
        let mut entries: Vec<DocEntry> = self
            .relays
            .iter()
            .filter_map(|r| r.store.lock().ok()?.entry(&r.doc))
            .collect();
        for f in &self.farms {
            let (tx, rx) = std_mpsc::channel();
            if f.tx.send(FarmEvent::Entries(tx)).is_ok()
                && let Ok(e) = rx.recv_timeout(Duration::from_secs(60))
            {
                entries.extend(e);
            }
        }
        dramesh_store::Digest::from_entries(entries.iter()).root()
    }

    fn egress(&self, rt: &tokio::runtime::Runtime) -> Vec<(&'static str, u64)> {
        let nodes = self
            .farms
            .iter()
            .map(|f| f.sent.load(Ordering::Relaxed))
            .sum();
        let relays = rt.block_on(async {
            let mut total = 0;
            for r in &self.relays {
                total += r
                    .handle
                    .peers()
                    .await
                    .iter()
                    .filter(|p| p.identity.is_replica())
                    .map(|p| p.bytes_sent)
                    .sum::<u64>();
            }
            total
        });
        vec![
            ("node writers -> relays", nodes),
            ("relays -> replicas", relays),
        ]
    }

    fn reach_all(&self, replicas: usize) -> bool {
        self.relays.iter().all(|r| {
            r.handle
                .connected_identities()
                .iter()
                .filter(|p| p.is_replica())
                .count()
                >= replicas
        })
    }

    fn cpu_parts(&self) -> Vec<(&'static str, f64)> {
        vec![("node writers", self.farm_cpu_secs())]
    }

    fn relay_seen(&self) -> Option<HashMap<u64, u64>> {
        Some(self.relay_seen.lock().expect("relay seen").clone())
    }

    fn shutdown(self, rt: &tokio::runtime::Runtime) {
        for f in &self.farms {
            let _ = f.tx.send(FarmEvent::Stop);
        }
        for mut f in self.farms {
            if let Some(t) = f.thread.take() {
                let _ = t.join();
            }
        }
        rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for r in self.relays {
                set.spawn(r.handle.shutdown());
            }
            while set.join_next().await.is_some() {}
        });
    }
}

/// The relay topology (see the module docs).
pub(crate) fn relay_setup(
    rt: &tokio::runtime::Runtime,
    b: &Bench,
    reps: &mut [ReplicaProc; 3],
) -> (RelayFleet, Setup) {
    let t_build = Instant::now();
    let (plans, objects, json_bytes) = plan_fleet(b.clusters, b.nodes);
    let ids = identities(&b.ca, &plans);
    let n = plans.len();
    println!(
        "planned {n} node documents ({objects} objects, {:.1} MB JSON), issued their certificates in {:.1}s",
        json_bytes as f64 / 1e6,
        t_build.elapsed().as_secs_f64()
    );
    let heap0 = heap_bytes();
    // One verifier for every farm writer: they verify nothing (a writer takes no changes to
    // its own document), but the store's trust needs one.
    let verifier: Arc<dyn dramesh_store::HeadsVerifier> =
        Arc::new(dramesh_mesh::signing::MeshVerifier::new(&ids[0].ca_certs).expect("verifier"));
    // Plans by cluster: the first is the relay (term 1).
    let mut by_cluster: Vec<Vec<(NodePlan, certs::TlsIdentity)>> = Vec::new();
    for (plan, tls) in plans.into_iter().zip(ids) {
        if plan.term > 0 {
            by_cluster.push(Vec::new());
        }
        by_cluster
            .last_mut()
            .expect("a cluster starts with its Lease holder")
            .push((plan, tls));
    }
    let mut relays = Vec::new();
    let relay_seen: Arc<Mutex<HashMap<u64, u64>>> = Arc::default();
    let mut farms = Vec::new();
    let mut writers = Vec::new();
    let proto_config = ProtocolConfig::default();
    let mut built_writers = Vec::new();
    for (c, cluster) in by_cluster.into_iter().enumerate() {
        let mut it = cluster.into_iter();
        let (lead, lead_tls) = it.next().expect("a Lease holder");
        let relay_id = lead_tls.identity.clone();
        // Tracks changes so the bench sees when each update reaches the relay (the view
        // changes are computed either way; tracking only queues them).
        let store = Arc::new(Mutex::new(MeshStore::new(
            Store::in_memory(StoreConfig {
                durability: Durability::None,
                ..StoreConfig::default()
            }),
            true,
        )));
        write_plan(&store, &lead);
        let handle = rt.block_on(async {
            let mut cfg = NodeConfig::new(lead_tls, "127.0.0.1:0".parse().expect("addr"));
            cfg.seeds = vec![b.listen[0]];
            let h = MeshHandle::start(cfg, store.clone()).await.expect("relay");
            h.set_relay(true).await;
            h
        });
        let seen = relay_seen.clone();
        rt.spawn(on_applied_seqs(
            handle.subscribe(),
            store.clone(),
            move |seqs, now| {
                let mut seen = seen.lock().expect("relay seen");
                for s in seqs {
                    seen.entry(s).or_insert(now);
                }
            },
        ));
        writers.push((c, None, NodeTemplate::new(&lead.node).json.len()));
        let mut farm_writers = Vec::new();
        let (tx, rx) = std_mpsc::channel::<FarmEvent>();
        for (slot, (plan, tls)) in it.enumerate() {
            let ms = writer_store(&plan, &tls, &verifier);
            let sink_tx = tx.clone();
            let link = rt
                .block_on(handle.attach_local(
                    tls.identity.clone(),
                    Box::new(move |frame| {
                        let _ = sink_tx.send(FarmEvent::Frame(slot, frame));
                    }),
                ))
                .expect("local link");
            let mut proto = Protocol::new(tls.identity.clone(), proto_config.clone());
            proto.set_coalesce_pushes(true);
            let node = NodeTemplate::new(&plan.node);
            writers.push((c, Some(slot), node.json.len()));
            farm_writers.push(FarmWriter {
                proto,
                store: ms,
                doc: plan.doc.clone(),
                link,
                node,
            });
        }
        built_writers.push((farm_writers, rx, tx, relay_id));
        relays.push(RelayNode {
            doc: lead.doc,
            handle,
            store,
            node: lead.node,
        });
    }
    let heap_built = heap_bytes();
    let build_secs = t_build.elapsed().as_secs_f64();
    // Start every farm at once: the load phase begins.
    let mut load_time = None;
    let loaded = ReplicaLoad::measure(reps, |reps| {
        for (farm_writers, rx, tx, relay_id) in built_writers {
            let sent = Arc::new(AtomicU64::new(0));
            let tid = Arc::new(AtomicU64::new(0));
            let (s2, t2) = (sent.clone(), tid.clone());
            let thread = std::thread::Builder::new()
                .name("farm".into())
                .spawn(move || farm_main(farm_writers, rx, relay_id, s2, t2))
                .expect("farm thread");
            farms.push(Farm {
                tx,
                thread: Some(thread),
                sent,
                tid,
            });
        }
        let fleet = RelayFleet {
            relays: std::mem::take(&mut relays),
            farms: std::mem::take(&mut farms),
            writers: std::mem::take(&mut writers),
            relay_seen: relay_seen.clone(),
        };
        let root = fleet.root();
        let [r0, r1, r2] = reps;
        let load = wait_converged("load", &mut [r0, r1, r2], root, Duration::from_secs(3600));
        println!(
            "fleet load into 3 replicas: {:?}",
            load.map_or("did not converge".into(), |d| format!("{d:.1?}"))
        );
        load_time = load;
        relays = fleet.relays;
        farms = fleet.farms;
        writers = fleet.writers;
    });
    let load_secs = load_time.map(|d| d.as_secs_f64());
    let fleet = RelayFleet {
        relays,
        farms,
        writers,
        relay_seen,
    };
    let heap_loaded = heap_bytes();
    let census = reps[0].census();
    let rep_heap: Vec<u64> = reps.iter_mut().map(|r| u(&r.status(), "heap")).collect();

    // Idle: every session up, nothing written. The bench process's CPU is the relays' and the
    // node writers'; the farm threads' own time is the writers'.
    let clusters = fleet.relays.len().max(1);
    let parent_before = proc_cpu_secs(std::process::id());
    let farms_before = fleet.farm_cpu_secs();
    let idle = ReplicaLoad::measure(reps, |_| std::thread::sleep(Duration::from_secs(10)));
    let parent_idle = (proc_cpu_secs(std::process::id()) - parent_before) / idle.secs;
    let farms_idle = (fleet.farm_cpu_secs() - farms_before) / idle.secs;
    let relay_idle = (parent_idle - farms_idle).max(0.0);
    println!(
        "idle: replica CPU {} cores; bench process {parent_idle:.2} cores (node writers {farms_idle:.2}, relays and the rest {relay_idle:.2}); replica sessions {:?}, fds {:?}, threads {:?}",
        idle.cpu_text(),
        idle.peers,
        idle.fds,
        idle.threads
    );
    let per_doc_kib: Vec<f64> = rep_heap
        .iter()
        .map(|h| *h as f64 / n as f64 / 1024.0)
        .collect();
    // Relays' and writers' heap: what the bench process grew by beyond the plans.
    let writers_heap = heap_built.saturating_sub(heap0);
    let relays_heap = heap_loaded.saturating_sub(heap_built);
    let rows = vec![
        (
            format!("load {n} documents through {clusters} relays, replica CPU"),
            format!("{} cores", loaded.cpu_text()),
        ),
        (
            "replica heap in use per document after load r0/r1/r2 (all of the replica's heap / documents)".into(),
            format!("{per_doc_kib:.1?} KiB"),
        ),
        (
            "r0 store: files / bytes in data dir".into(),
            format!(
                "{} / {:.1} MB",
                u(&census, "files"),
                u(&census, "dir_bytes") as f64 / 1e6
            ),
        ),
        (
            "r0 anti-entropy scans: root digest / all 64 buckets' entries".into(),
            format!(
                "{:.3} ms / {:.1} ms",
                census["digest_ms"].as_f64().unwrap_or(f64::NAN),
                census["all_buckets_ms"].as_f64().unwrap_or(f64::NAN)
            ),
        ),
        (
            "idle replica CPU r0/r1/r2".into(),
            format!("{} cores", idle.cpu_text()),
        ),
        (
            "bench process CPU idle: node writers / relays and the rest".into(),
            format!("{farms_idle:.2} / {relay_idle:.2} cores ({:.1} ms/s per relay)", relay_idle * 1e3 / clusters as f64),
        ),
        (
            "heap: node writers (stores, protocols, links) / relays' copies after load".into(),
            format!(
                "{:.0} MiB ({:.1} KiB per writer) / {:.0} MiB ({:.1} MiB per relay)",
                writers_heap as f64 / 1048576.0,
                writers_heap as f64 / n as f64 / 1024.0,
                relays_heap as f64 / 1048576.0,
                relays_heap as f64 / clusters as f64 / 1048576.0
            ),
        ),
    ];
    let mut json = serde_json::Map::new();
    for (k, v) in [
        ("topology", json!("relay")),
        ("writers", json!(n)),
        ("relays", json!(clusters)),
        ("load_cpu_cores", json!(loaded.cpu_cores)),
        ("replica_heap_after_load", json!(rep_heap)),
        ("replica_heap_kib_per_document", json!(per_doc_kib)),
        ("idle_replica_cpu_cores", json!(idle.cpu_cores)),
        ("idle_farm_cores", json!(farms_idle)),
        ("idle_relay_cores", json!(relay_idle)),
        ("writers_heap", json!(writers_heap)),
        ("relays_heap", json!(relays_heap)),
        ("census", census),
    ] {
        json.insert(k.into(), v);
    }
    let setup = Setup {
        objects,
        json_bytes,
        build_secs,
        load_secs,
        rows,
        json,
    };
    (fleet, setup)
}
