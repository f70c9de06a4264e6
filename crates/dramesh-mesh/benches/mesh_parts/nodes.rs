//! DaemonSet mode of the mesh bench (`MESH_AGENTS=node`): one writer per node, each owning the
//! document `(cluster, node)` with its node-scoped records (its Node, its ResourceSlices, its
//! pods), and the cluster-scoped records (DeviceClasses, ClusterInfo, network-attached
//! slices) in the document of the cluster's Lease holder (its first node, lease term 1), as
//! `dramesh agent --source=kube` publishes them.
//!
//! `direct_setup` is the topology deploy/ shipped before relays: every node writer is a mesh
//! node with its own QUIC endpoint and dials every replica. Besides the common figures it
//! measures what each connection and each document costs a replica: CPU and memory of the
//! handshakes, CPU of idle sessions, resident memory and files per document, and how long the
//! anti-entropy scans of the whole store take.

use super::*;

/// One node writer's document before it is written.
pub(crate) struct NodePlan {
    pub(crate) doc: DocId,
    pub(crate) changes: Vec<ObjectChange>,
    /// The node's base Node JSON (what the update workload changes).
    pub(crate) node: Value,
    /// Lease term: 1 for the cluster's Lease holder, 0 for every other node.
    pub(crate) term: u64,
}

/// The fleet split by owner into one plan per node (2 threads); returns the plans, the objects
/// and their JSON bytes.
pub(crate) fn plan_fleet(clusters: usize, nodes: usize) -> (Vec<NodePlan>, usize, usize) {
    let specs = dramesh_sim::uniform_fleet(clusters, nodes, 0.5);
    let next = AtomicU64::new(0);
    // (cluster index, its plans, objects, JSON bytes)
    type Planned = (usize, Vec<NodePlan>, usize, usize);
    let planned: Mutex<Vec<Planned>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some(spec) = specs.get(i) else { break };
                    let cluster = dramesh_sim::generate(spec);
                    let mut plans: Vec<NodePlan> = Vec::new();
                    let mut index: HashMap<String, usize> = HashMap::new();
                    for o in &cluster.objects {
                        if let dramesh_model::ClusterObject::Node(_) = o {
                            let name = o.key().name;
                            let c = ObjectChange::upsert(o);
                            let json = match &c {
                                ObjectChange::Upsert { json, .. } => {
                                    serde_json::from_slice(json).expect("node JSON")
                                }
                                ObjectChange::Delete { .. } => Value::Null,
                            };
                            index.insert(name.clone(), plans.len());
                            plans.push(NodePlan {
                                doc: DocId::new(spec.name.clone(), name),
                                changes: vec![],
                                node: json,
                                term: u64::from(plans.is_empty()),
                            });
                        }
                    }
                    let (mut objects, mut bytes) = (0, 0);
                    for o in &cluster.objects {
                        let c = ObjectChange::upsert(o);
                        if let ObjectChange::Upsert { json, .. } = &c {
                            bytes += json.len();
                        }
                        objects += 1;
                        let at = match o.owner() {
                            Some(dramesh_model::owner::Owner::Node(n)) => index.get(&n).copied(),
                            _ => None,
                        };
                        plans[at.unwrap_or(0)].changes.push(c);
                    }
                    planned
                        .lock()
                        .expect("plans")
                        .push((i, plans, objects, bytes));
                }
            });
        }
    });
    let mut planned = planned.into_inner().expect("plans");
    planned.sort_by_key(|p| p.0);
    let objects = planned.iter().map(|p| p.2).sum();
    let bytes = planned.iter().map(|p| p.3).sum();
    (
        planned.into_iter().flat_map(|p| p.1).collect(),
        objects,
        bytes,
    )
}

/// Mesh identities for every plan (2 threads).
pub(crate) fn identities(ca: &certs::CaBundle, plans: &[NodePlan]) -> Vec<certs::TlsIdentity> {
    let next = AtomicU64::new(0);
    let out: Mutex<Vec<Option<certs::TlsIdentity>>> = Mutex::new(vec![None; plans.len()]);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some(p) = plans.get(i) else { break };
                    let id = PeerIdentity::Agent {
                        cluster: p.doc.cluster.clone(),
                        node: p.doc.writer.clone(),
                    };
                    let tls = certs::issue_identity(ca, &id, 1).expect("node identity");
                    out.lock().expect("identities")[i] = Some(tls);
                }
            });
        }
    });
    out.into_inner()
        .expect("identities")
        .into_iter()
        .map(|t| t.expect("every identity issued"))
        .collect()
}

/// A node writer's in-memory store, signing as `tls` (checking with `verifier`, though a
/// writer takes no changes to check), holding `plan`'s records.
pub(crate) fn writer_store(
    plan: &NodePlan,
    tls: &certs::TlsIdentity,
    verifier: &Arc<dyn dramesh_store::HeadsVerifier>,
) -> MeshStore {
    let mut store = MeshStore::new(
        Store::in_memory(StoreConfig {
            durability: Durability::None,
            ..StoreConfig::default()
        }),
        false,
    );
    store.set_trust(dramesh_store::Trust {
        signer: Some(Arc::new(
            dramesh_mesh::signing::MeshSigner::new(tls).expect("signer"),
        )),
        verifier: verifier.clone(),
    });
    let store = Mutex::new(store);
    write_plan(&store, plan);
    store.into_inner().expect("writer store")
}

/// Writes a plan's records into its writer's store (the Lease holder's term first).
pub(crate) fn write_plan(store: &Mutex<MeshStore>, plan: &NodePlan) {
    let mut s = store.lock().expect("writer store");
    s.open_writer(&plan.doc).expect("open writer");
    if plan.term > 0 {
        s.set_lease_term(&plan.doc, plan.term).expect("lease term");
    }
    s.apply(&plan.doc, plan.changes.clone())
        .expect("initial apply");
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// Waits until every replica has at least `sessions` sessions.
fn wait_sessions(reps: &mut [ReplicaProc; 3], sessions: u64, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    let mut last_print = Instant::now();
    while t.elapsed() < limit {
        let peers: Vec<u64> = reps.iter_mut().map(|r| u(&r.status(), "peers")).collect();
        if peers.iter().all(|p| *p >= sessions) {
            return Some(t.elapsed());
        }
        if last_print.elapsed() > Duration::from_secs(2) {
            last_print = Instant::now();
            eprintln!(
                "connect {:5.1}s: sessions per replica {peers:?} of {sessions}",
                t.elapsed().as_secs_f64()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    None
}

/// The direct topology: every node writer dials every replica (see the module docs).
pub(crate) fn direct_setup(
    rt: &tokio::runtime::Runtime,
    b: &Bench,
    reps: &mut [ReplicaProc; 3],
) -> (QuicWriters, Setup) {
    let t_build = Instant::now();
    let (plans, objects, json_bytes) = plan_fleet(b.clusters, b.nodes);
    let ids = identities(&b.ca, &plans);
    let build_secs = t_build.elapsed().as_secs_f64();
    let n = plans.len();
    println!(
        "planned {n} node documents ({objects} objects, {:.1} MB JSON) and issued their certificates in {build_secs:.1}s",
        json_bytes as f64 / 1e6
    );
    let mut rows = Vec::new();
    let mut extra = serde_json::Map::new();
    let rss = |reps: &mut [ReplicaProc; 3]| -> Vec<u64> {
        reps.iter_mut().map(|r| u(&r.status(), "rss")).collect()
    };

    // Connect: every writer's mesh node starts with an empty store, so the replicas see only
    // handshakes, hellos and empty digests.
    let rss_idle = rss(reps);
    let mut agents = Vec::with_capacity(n);
    let mut connect_time = None;
    let connect = ReplicaLoad::measure(reps, |reps| {
        rt.block_on(async {
            for (plan, tls) in plans.iter().zip(ids) {
                let mut cfg = NodeConfig::new(tls, "127.0.0.1:0".parse().expect("addr"));
                cfg.seeds = vec![b.listen[0]];
                // Timers are checked every 250 ms instead of 100 ms: heartbeats are 1 s apart,
                // and ten thousand nodes ticking 10 times a second would load the bench
                // process, which shares the machine with the replicas.
                cfg.tick_interval = Duration::from_millis(250);
                let store = Arc::new(Mutex::new(MeshStore::new(
                    Store::in_memory(StoreConfig {
                        durability: Durability::None,
                        ..StoreConfig::default()
                    }),
                    false,
                )));
                let handle = MeshHandle::start(cfg, store.clone()).await.expect("writer");
                agents.push(AgentNode {
                    doc: plan.doc.clone(),
                    handle,
                    store,
                    nodes: vec![plan.node.clone()],
                });
            }
        });
        connect_time = wait_sessions(reps, n as u64 + 2, Duration::from_secs(900));
    });
    let rss_connected = rss(reps);
    let connect_secs = connect_time.map_or(f64::NAN, |d| d.as_secs_f64());
    let per_conn_mem: Vec<f64> = rss_connected
        .iter()
        .zip(&rss_idle)
        .map(|(a, b)| a.saturating_sub(*b) as f64 / n as f64 / 1024.0)
        .collect();

    // Idle: sessions up, nothing written.
    let idle = ReplicaLoad::measure(reps, |_| std::thread::sleep(Duration::from_secs(10)));
    let per_conn_idle_us: Vec<f64> = idle.cpu_cores.iter().map(|c| c / n as f64 * 1e6).collect();
    // CPU per connection: what the connect window used beyond what idle sessions would have
    // used in it (handshake, hello, first digest exchange).
    let per_conn_cpu_ms: Vec<f64> = connect
        .cpu_secs
        .iter()
        .zip(&idle.cpu_cores)
        .map(|(c, i)| (c - i * connect.secs / 2.0).max(0.0) / n as f64 * 1e3)
        .collect();
    println!(
        "connect: {n} writers x 3 replicas in {connect_secs:.1} s; replica CPU {} cores; per connection {per_conn_cpu_ms:.2?} ms CPU, {per_conn_mem:.1?} KiB",
        connect.cpu_text()
    );
    println!(
        "idle: replica CPU {} cores with {n} idle writer sessions: {per_conn_idle_us:.1?} µs of CPU per session per second; fds {:?}, threads {:?}",
        idle.cpu_text(),
        idle.fds,
        idle.threads
    );

    // Load: every writer writes its records and pushes them.
    let writers = QuicWriters {
        agents,
        random: true,
    };
    let mut load = None;
    let loaded = ReplicaLoad::measure(reps, |reps| {
        let t = Instant::now();
        rt.block_on(async {
            for (a, plan) in writers.agents.iter().zip(&plans) {
                write_plan(&a.store, plan);
                a.handle.notify_local_change(a.doc.clone()).await;
            }
        });
        let root = writers.root();
        let [r0, r1, r2] = reps;
        load = wait_converged("load", &mut [r0, r1, r2], root, Duration::from_secs(1800))
            .map(|_| t.elapsed());
    });
    let load_secs = load.map(|d| d.as_secs_f64());
    let rss_loaded = rss(reps);
    let per_doc_kib: Vec<f64> = rss_loaded
        .iter()
        .zip(&rss_connected)
        .map(|(a, b)| a.saturating_sub(*b) as f64 / n as f64 / 1024.0)
        .collect();
    let census = reps[0].census();
    println!(
        "load: {n} documents in {load_secs:?} s, replica CPU {} cores; resident per document {per_doc_kib:.1?} KiB; r0 census {census}",
        loaded.cpu_text()
    );

    rows.push((
        format!("connect {n} writers to 3 replicas (empty documents)"),
        format!(
            "{connect_secs:.1} s, replica CPU {} cores",
            connect.cpu_text()
        ),
    ));
    rows.push((
        "replica CPU per connection (handshake, hello, first digest; idle share of the window taken out) r0/r1/r2".into(),
        format!("{per_conn_cpu_ms:.2?} ms"),
    ));
    rows.push((
        "replica memory per connection r0/r1/r2".into(),
        format!("{per_conn_mem:.1?} KiB"),
    ));
    rows.push((
        "replica CPU per idle session r0/r1/r2".into(),
        format!(
            "{per_conn_idle_us:.1?} µs/s ({} cores in all)",
            idle.cpu_text()
        ),
    ));
    rows.push((
        "replica sessions / fds / threads, idle".into(),
        format!("{:?} / {:?} / {:?}", idle.peers, idle.fds, idle.threads),
    ));
    rows.push((
        format!("load {n} documents, replica CPU"),
        format!("{} cores", loaded.cpu_text()),
    ));
    rows.push((
        "replica resident memory per document r0/r1/r2".into(),
        format!("{per_doc_kib:.1?} KiB"),
    ));
    rows.push((
        "r0 store: files / bytes in data dir".into(),
        format!(
            "{} / {:.1} MB",
            u(&census, "files"),
            u(&census, "dir_bytes") as f64 / 1e6
        ),
    ));
    rows.push((
        "r0 anti-entropy scans: root digest / all 64 buckets' entries".into(),
        format!(
            "{:.3} ms / {:.1} ms",
            census["digest_ms"].as_f64().unwrap_or(f64::NAN),
            census["all_buckets_ms"].as_f64().unwrap_or(f64::NAN)
        ),
    ));
    rows.push((
        "replica RSS idle / connected / loaded r0".into(),
        format!(
            "{:.0} / {:.0} / {:.0} MiB",
            mib(rss_idle[0]),
            mib(rss_connected[0]),
            mib(rss_loaded[0])
        ),
    ));
    for (k, v) in [
        ("topology", json!("direct")),
        ("writers", json!(n)),
        ("connect_secs", json!(connect_secs)),
        ("connect_cpu_secs", json!(connect.cpu_secs)),
        ("cpu_ms_per_connection", json!(per_conn_cpu_ms)),
        ("kib_per_connection", json!(per_conn_mem)),
        ("idle_cpu_us_per_session", json!(per_conn_idle_us)),
        ("idle_fds", json!(idle.fds)),
        ("idle_threads", json!(idle.threads)),
        ("load_cpu_cores", json!(loaded.cpu_cores)),
        ("kib_per_document", json!(per_doc_kib)),
        ("census", census),
    ] {
        extra.insert(k.into(), v);
    }
    let setup = Setup {
        objects,
        json_bytes,
        build_secs,
        load_secs,
        rows,
        json: extra,
    };
    (writers, setup)
}
