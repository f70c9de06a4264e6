//! `__load <clusters> <nodes>`: what loading a fleet of per-node documents, and healing after a
//! partition, cost a replica's receiving path, without sockets. A source replica store (on
//! disk, fsync) first takes every node writer's signed document; then a new replica store,
//! empty, loads them all from it through a pair of [`Protocol`]s driven in one thread as the
//! mesh node drives them (frames encoded and decoded, the receiving store flushed after each
//! batch, anti-entropy rounds back to back). Then every writer changes its Node once, only the
//! source takes the changes, and the two protocols reconnect (keeping the closed session's sync
//! states, as after a partition) and heal the difference.
//! Prints the time each side's protocol spent, so a profile (`perf record` on this process)
//! sees the receiving path alone, and the per-document figures the issue's 100,000-document
//! targets need.
//!
//! `MESH_VERIFY_THREADS` (default 0) gives the receiving replica that many verifier threads
//! ([`VerifyPool`]), its protocol handing out signature checks as the node's does; 0 checks
//! every signature on the receiving protocol's thread. The receiving side's figures are then
//! its protocol thread's wall time (`dst_ms_per_doc`, with its fsyncs and, with checks, its
//! waits for them when nothing else is left), that thread's CPU time (`dst_cpu_ms_per_doc`)
//! and the CPU time of the other threads, its verifier threads and its store's file writer
//! (`verify_cpu_ms_per_doc`).

use std::collections::VecDeque;

use dramesh_mesh::node::{SharedVerifier, VerifyPool};
use dramesh_mesh::protocol::{ConnId, Output, Protocol, ProtocolConfig, Ticket};
use dramesh_mesh::wire;
use dramesh_store::SyncState;
use tokio::sync::mpsc as tokio_mpsc;

/// The receiving replica's verifier threads and where they report done checks.
pub(crate) struct Checks {
    pool: VerifyPool,
    done: tokio_mpsc::UnboundedReceiver<Ticket>,
}

impl Checks {
    /// Hands every check `protocol` has ready to the verifier threads.
    pub(crate) fn submit(&mut self, protocol: &mut Protocol) {
        while let Some(job) = protocol.poll_verify() {
            self.pool.submit(job);
        }
    }

    /// The checks done so far; with `block`, first waits for one, then up to `linger` for the
    /// rest of the `in_flight` (as the node's driver does).
    pub(crate) fn finished(
        &mut self,
        block: bool,
        in_flight: usize,
        linger: Duration,
    ) -> Vec<Ticket> {
        let mut tickets = Vec::new();
        if block {
            tickets.extend(self.done.blocking_recv());
            let until = Instant::now() + linger;
            while tickets.len() < in_flight && Instant::now() < until {
                match self.done.try_recv() {
                    Ok(t) => tickets.push(t),
                    Err(_) => std::thread::sleep(Duration::from_micros(50)),
                }
            }
        }
        while let Ok(t) = self.done.try_recv() {
            tickets.push(t);
        }
        tickets
    }
}

use super::nodes::{identities, plan_fleet, writer_store};
use super::replay::{Event, TICK_SKEW};
use super::*;

/// A source replica store holding every node writer's signed document, and the writers, with
/// the identities of the source (`r0`) and of a receiving replica (`r3`).
pub(crate) struct Fleet {
    /// Holds the stores' directories (the source's at `r0`).
    pub(crate) tmp: tempfile::TempDir,
    pub(crate) src: MeshStore,
    pub(crate) src_tls: certs::TlsIdentity,
    pub(crate) ca: certs::CaBundle,
    /// The receiving replica's certificate and key, PEM.
    pub(crate) dst_leaf: certs::LeafBundle,
    pub(crate) dst_tls: certs::TlsIdentity,
    writers: Vec<Writer>,
    pub(crate) docs: usize,
}

impl Fleet {
    /// Plans `clusters` x `nodes` node writers and syncs every writer's document into the source.
    pub(crate) fn build(clusters: usize, nodes: usize) -> Fleet {
        let t = Instant::now();
        let (plans, _, _) = plan_fleet(clusters, nodes);
        let ca = certs::generate_ca("load CA", 1).expect("CA");
        let ids = identities(&ca, &plans);
        let verifier: Arc<dyn dramesh_store::HeadsVerifier> =
            Arc::new(dramesh_mesh::signing::MeshVerifier::new(&ids[0].ca_certs).expect("verifier"));
        let leaf = |id: &str| {
            certs::issue_leaf(&ca, &PeerIdentity::Replica { id: id.into() }, 1)
                .expect("replica identity")
        };
        let tls = |leaf: &certs::LeafBundle| {
            certs::identity_from_pem(&leaf.cert_pem, &leaf.key_pem, &ca.cert_pem, "replica")
                .expect("replica identity")
        };
        let dst_leaf = leaf("r3");
        let (src_tls, dst_tls) = (tls(&leaf("r0")), tls(&dst_leaf));
        let tmp = tempfile::tempdir().expect("temp dir");
        let (mut src, _) = open_replica(&tmp.path().join("r0"), &src_tls);
        let mut writers: Vec<Writer> = Vec::with_capacity(plans.len());
        for (plan, tls) in plans.iter().zip(ids) {
            let mut w = Writer {
                store: writer_store(plan, &tls, &verifier),
                doc: plan.doc.clone(),
                node: plan.node.clone(),
                identity: tls.identity.clone(),
                mine: SyncState::default(),
                theirs: SyncState::default(),
            };
            w.sync_into(&mut src, &src_tls.identity);
            writers.push(w);
        }
        src.flush().expect("flush source");
        let docs = src.store().doc_count();
        assert_eq!(
            docs,
            plans.len(),
            "the source holds every writer's document"
        );
        println!(
            "source replica holds {docs} documents ({:.1}s to build)",
            t.elapsed().as_secs_f64()
        );
        Fleet {
            tmp,
            src,
            src_tls,
            ca,
            dst_leaf,
            dst_tls,
            writers,
            docs,
        }
    }

    /// Each member cluster's relay: its first node agent.
    pub(crate) fn relay_ids(&self) -> Vec<PeerIdentity> {
        let mut seen = std::collections::HashSet::new();
        self.writers
            .iter()
            .filter(|w| seen.insert(w.doc.cluster.clone()))
            .map(|w| w.identity.clone())
            .collect()
    }

    /// The first `count` writers change their Node once; only the source takes the changes.
    pub(crate) fn change(&mut self, count: usize) {
        let t = Instant::now();
        for (i, w) in self.writers.iter_mut().take(count).enumerate() {
            let mut node = w.node.clone();
            node["metadata"]["annotations"][SEQ_ANNOTATION] = Value::String(i.to_string());
            let json = serde_json::to_vec(&node).expect("node JSON");
            let name = node["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            w.store
                .apply(
                    &w.doc,
                    vec![ObjectChange::Upsert {
                        key: ObjectKey::new(ObjectKind::Node, None, &name),
                        json: json.into(),
                    }],
                )
                .expect("update");
            w.sync_into(&mut self.src, &self.src_tls.identity);
        }
        self.src.flush().expect("flush source");
        println!(
            "{} updates taken by the source ({:.1}s)",
            count.min(self.writers.len()),
            t.elapsed().as_secs_f64()
        );
    }
}

/// Opens (or creates) a replica's fsynced store at `dir` with `tls`'s trust; returns it and
/// its verifier, for a [`VerifyPool`].
pub(crate) fn open_replica(dir: &Path, tls: &certs::TlsIdentity) -> (MeshStore, SharedVerifier) {
    let (store, _) = Store::open(
        dir,
        StoreConfig {
            durability: Durability::Fsync,
            ..StoreConfig::default()
        },
    )
    .expect("open store");
    let mut s = MeshStore::new(store, true);
    let trust = dramesh_mesh::signing::trust(tls).expect("trust");
    let verifier = Arc::new(Mutex::new(trust.verifier.clone()));
    s.set_trust(trust);
    (s, verifier)
}

/// `threads` verifier threads (none for 0) named after `name`, checking with `verifier`.
pub(crate) fn verifier_threads(
    threads: usize,
    name: &str,
    verifier: SharedVerifier,
) -> Option<Checks> {
    (threads > 0).then(|| {
        let (tx, done) = tokio_mpsc::unbounded_channel();
        Checks {
            pool: VerifyPool::new(threads, name, verifier, tx),
            done,
        }
    })
}

pub(crate) fn load_main(args: &[String]) {
    // `cargo bench -p dramesh-mesh --bench mesh -- __load 10 1000` appends `--bench`.
    let [clusters, nodes, ..] = args else {
        panic!("load role needs 2 arguments: <clusters> <nodes>");
    };
    let clusters: usize = clusters.parse().expect("cluster count");
    let nodes: usize = nodes.parse().expect("node count");
    let mut fleet = Fleet::build(clusters, nodes);
    let docs = fleet.docs;
    let (mut dst, dst_verifier) = open_replica(&fleet.tmp.path().join("r3"), &fleet.dst_tls);
    let threads = std::env::var("MESH_VERIFY_THREADS").ok().map_or(0, |v| {
        v.parse().expect("MESH_VERIFY_THREADS: a thread count")
    });
    let mut checks = verifier_threads(threads, "load", dst_verifier);
    println!("receiving replica: {threads} verifier threads");
    let (src_tls, dst_tls) = (fleet.src_tls.clone(), fleet.dst_tls.clone());
    let src = &mut fleet.src;
    let mut sources = [Source::replica(ConnId(1), src_tls.identity.clone())];
    let mut pd = Protocol::new(dst_tls.identity.clone(), probe_config());
    pd.set_verify_jobs(checks.is_some());
    let load = converge(
        src,
        &mut dst,
        &mut sources,
        &mut pd,
        &dst_tls.identity,
        docs,
        checks.as_mut(),
        None,
    );
    load.print(&format!("new replica loaded {docs} documents"), docs);

    // What anti-entropy pays to list the entries of differing buckets on this replica: every
    // bucket one call at a time (how the protocol listed them before), in one pass, and in one
    // pass keeping none (every document left to carriers).
    let all: Vec<u32> = (0..dramesh_store::DIGEST_BUCKETS).collect();
    let t = Instant::now();
    let per_bucket: usize = all
        .iter()
        .map(|b| dst.store().bucket_entries(&[*b], |_| true).len())
        .sum();
    let per_bucket_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let one_pass = dst.store().bucket_entries(&all, |_| true).len();
    let one_pass_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let none = dst.store().bucket_entries(&all, |_| false).len();
    let none_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!((per_bucket, one_pass, none), (docs, docs, 0));
    println!(
        "listing the entries of all {} buckets: bucket by bucket {per_bucket_ms:.1} ms, one pass {one_pass_ms:.1} ms, one pass keeping none {none_ms:.1} ms",
        all.len()
    );

    // Every writer changes its Node once while the new replica is away.
    fleet.change(docs);
    let src = &mut fleet.src;
    // The same two protocols reconnect, as replicas and relays do after a partition: each
    // remembers the sync states of the closed session.
    sources[0].protocol.on_disconnected(ConnId(1));
    pd.on_disconnected(ConnId(1));
    sources[0].conn = ConnId(2);
    let heal = converge(
        src,
        &mut dst,
        &mut sources,
        &mut pd,
        &dst_tls.identity,
        docs,
        checks.as_mut(),
        None,
    );
    heal.print(&format!("healed {docs} changed documents"), docs);
    println!(
        "LOAD {}",
        json!({"docs": docs, "verify_threads": threads,
               "listing_ms": {"per_bucket": per_bucket_ms, "one_pass": one_pass_ms, "none_kept": none_ms},
               "load": {"secs": load.secs, "dst_ms_per_doc": load.dst_secs * 1e3 / docs as f64,
                        "dst_cpu_ms_per_doc": load.dst_cpu_secs * 1e3 / docs as f64,
                        "verify_cpu_ms_per_doc": load.verify_cpu_secs * 1e3 / docs as f64,
                        "docs_per_sec": docs as f64 / load.secs,
                        "src_ms_per_doc": load.src_secs * 1e3 / docs as f64, "rounds": load.rounds,
                        "bytes": load.bytes, "syncs": load.syncs},
               "heal": {"secs": heal.secs, "dst_ms_per_doc": heal.dst_secs * 1e3 / docs as f64,
                        "dst_cpu_ms_per_doc": heal.dst_cpu_secs * 1e3 / docs as f64,
                        "verify_cpu_ms_per_doc": heal.verify_cpu_secs * 1e3 / docs as f64,
                        "docs_per_sec": docs as f64 / heal.secs,
                        "src_ms_per_doc": heal.src_secs * 1e3 / docs as f64, "rounds": heal.rounds,
                        "bytes": heal.bytes, "syncs": heal.syncs}})
    );
}

/// A node writer of the probe and its sync states with the source replica.
struct Writer {
    store: MeshStore,
    doc: DocId,
    node: Value,
    identity: PeerIdentity,
    mine: SyncState,
    theirs: SyncState,
}

impl Writer {
    /// Syncs the writer's document into `src` until neither side has anything to send.
    fn sync_into(&mut self, src: &mut MeshStore, src_id: &PeerIdentity) {
        let generation = self.store.entry(&self.doc).expect("written").generation;
        for _ in 0..16 {
            let m1 = self.store.generate_sync_message(&self.doc, &mut self.mine);
            if let Some((bytes, signed)) = &m1 {
                src.receive_sync_message(
                    &self.identity,
                    &self.doc,
                    generation,
                    &mut self.theirs,
                    bytes,
                    signed.as_ref(),
                )
                .expect("source takes the writer's document");
            }
            // What the protocol answers for a document not held yet: an empty document's reply.
            let m2 = match src.entry(&self.doc) {
                Some(_) => src.generate_sync_message(&self.doc, &mut self.theirs),
                None => self.theirs.empty_doc_message().map(|m| (m, None)),
            };
            if let Some((bytes, signed)) = &m2 {
                self.store
                    .receive_sync_message(
                        src_id,
                        &self.doc,
                        generation,
                        &mut self.mine,
                        bytes,
                        signed.as_ref(),
                    )
                    .expect("writer takes the answer");
            }
            if m1.is_none() && m2.is_none() {
                break;
            }
        }
    }
}

/// What one [`converge`] took.
pub(crate) struct Converged {
    secs: f64,
    /// Protocol and store time of each side.
    dst_secs: f64,
    src_secs: f64,
    /// CPU time of the receiving protocol's thread.
    dst_cpu_secs: f64,
    /// CPU time of the process's other threads: the receiving side's verifier threads and its
    /// store's file writer (the process's, less the main thread's).
    verify_cpu_secs: f64,
    rounds: u32,
    /// Frame bytes to `dst`.
    bytes: u64,
    /// Sync messages `dst` received.
    syncs: u64,
}

impl Converged {
    pub(crate) fn print(&self, what: &str, docs: usize) {
        let per_doc = |secs: f64| secs * 1e3 / docs as f64;
        println!(
            "{what} in {:.2}s ({:.3} ms per document; receiving replica {:.3} ms on its protocol thread ({:.3} ms CPU), {:.3} ms CPU on other threads (verifiers, the store's writer), source {:.3} ms per document), {} anti-entropy rounds, {:.1} MB and {:.2} sync messages per document received",
            self.secs,
            per_doc(self.secs),
            per_doc(self.dst_secs),
            per_doc(self.dst_cpu_secs),
            per_doc(self.verify_cpu_secs),
            per_doc(self.src_secs),
            self.rounds,
            self.bytes as f64 / 1e6,
            self.syncs as f64 / docs as f64
        );
    }
}

/// CPU time so far of this process (`libc::CLOCK_PROCESS_CPUTIME_ID`) or thread
/// (`libc::CLOCK_THREAD_CPUTIME_ID`).
pub(crate) fn cpu_secs(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to write.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Hands the receiving protocol the checks that are done; when `wait`, first waits for every
/// check out (the node's driver lingers for them the same way, see `node::driver`).
fn take_checks(
    checks: &mut Checks,
    pd: &mut Protocol,
    dst: &mut MeshStore,
    now: Instant,
    wait: bool,
) -> Vec<Output> {
    let mut out = Vec::new();
    let mut tickets = Vec::new();
    let mut out_now = pd.verifications_in_flight();
    while wait && out_now > 0 {
        match checks.done.blocking_recv() {
            Some(t) => tickets.push(t),
            None => break,
        }
        out_now -= 1;
    }
    while let Ok(t) = checks.done.try_recv() {
        tickets.push(t);
    }
    for t in tickets {
        out.extend(pd.on_verified(dst, t, now));
    }
    out
}

/// The far end of one session in [`converge`]: a protocol on the source store, as a replica
/// (`r0`) or as one member cluster's relay.
pub(crate) struct Source {
    /// The session's connection id, the same on both ends.
    pub(crate) conn: ConnId,
    pub(crate) id: PeerIdentity,
    pub(crate) protocol: Protocol,
}

impl Source {
    /// The replica `r0` on session `conn`: its scope is every document.
    pub(crate) fn replica(conn: ConnId, id: PeerIdentity) -> Source {
        let protocol = Protocol::new(id.clone(), probe_config());
        Source { conn, id, protocol }
    }

    /// One relay per member cluster (the cluster's first node agent, relaying), sessions from
    /// `first_conn` on: each session's scope is its cluster's documents, as the replica's
    /// sessions with the relays of a fleet.
    pub(crate) fn relays(ids: &[PeerIdentity], first_conn: u64) -> Vec<Source> {
        ids.iter()
            .enumerate()
            .map(|(i, id)| {
                let mut protocol = Protocol::new(id.clone(), probe_config());
                let _ = protocol.set_relay(true);
                Source {
                    conn: ConnId(first_conn + i as u64),
                    id: id.clone(),
                    protocol,
                }
            })
            .collect()
    }
}

/// The probes' protocol configuration (fixed jitter, so runs compare).
pub(crate) fn probe_config() -> ProtocolConfig {
    ProtocolConfig {
        jitter_seed: 7,
        ..ProtocolConfig::default()
    }
}

/// Runs new sessions between `src` (one per source protocol in `sources`) and `dst` (replica
/// `dst_id`, protocol `pd`) until `dst`'s digest equals `src`'s; with `record`, appends what
/// `dst` receives to it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn converge(
    src: &mut MeshStore,
    dst: &mut MeshStore,
    sources: &mut [Source],
    pd: &mut Protocol,
    dst_id: &PeerIdentity,
    docs: usize,
    mut checks: Option<&mut Checks>,
    mut record: Option<&mut Vec<Event>>,
) -> Converged {
    let started = Instant::now();
    let cpu_started = cpu_secs(libc::CLOCK_PROCESS_CPUTIME_ID);
    let main_started = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID);
    let mut dst_cpu = 0.0f64;
    let syncs_before = pd.counters().sync_in;
    // The protocols' clock: real time, moved ahead by an anti-entropy interval whenever both
    // sides are quiet, so rounds follow each other without idle waits.
    let mut skew = Duration::ZERO;
    let now = |skew: Duration| Instant::now() + skew;
    // Frames in flight: (session, to `dst`?, encoded frame).
    let mut wire_q: VecDeque<(ConnId, bool, Vec<u8>)> = VecDeque::new();
    let (mut src_secs, mut dst_secs) = (0.0f64, 0.0f64);
    let mut rounds = 0u32;
    let mut bytes = 0u64;
    let send = |q: &mut VecDeque<(ConnId, bool, Vec<u8>)>, to_dst: bool, outs: Vec<Output>| {
        for o in outs {
            if let Output::Send { conn, envelope } = o {
                q.push_back((conn, to_dst, wire::encode_frame(&envelope).expect("encode")));
            }
        }
    };
    let slot: HashMap<ConnId, usize> = sources
        .iter()
        .enumerate()
        .map(|(i, s)| (s.conn, i))
        .collect();
    for s in sources.iter_mut() {
        let o = s.protocol.on_connected(s.conn, dst_id.clone(), now(skew));
        send(&mut wire_q, true, o);
        let o = pd.on_connected(s.conn, s.id.clone(), now(skew));
        send(&mut wire_q, false, o);
    }
    let target = src.digest().root();
    let mut last_report = Instant::now();
    loop {
        // Checks done go to the receiving protocol first, as the node's driver hands them back
        // before a batch's new frames; with nothing else to do, it waits for them.
        if let Some(c) = checks.as_deref_mut()
            && pd.verifications_in_flight() > 0
        {
            let t0 = Instant::now();
            let c0 = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID);
            let mut held = take_checks(c, pd, dst, now(skew), wire_q.is_empty());
            c.submit(pd);
            if pd.has_deferred_pushes() {
                held.extend(pd.flush_pushes(dst));
            }
            dst.flush().expect("flush");
            dst_secs += t0.elapsed().as_secs_f64();
            dst_cpu += cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID) - c0;
            send(&mut wire_q, false, held);
        }
        // One batch per side, as the node handles a burst of frames before flushing.
        let batch: Vec<(ConnId, bool, Vec<u8>)> = wire_q.drain(..).collect();
        if batch.is_empty() {
            if pd.verifications_in_flight() > 0 {
                continue;
            }
            if dst.digest().root() == target {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(3600),
                "the replicas did not converge within an hour"
            );
            rounds += 1;
            skew += TICK_SKEW;
            if let Some(r) = record.as_deref_mut() {
                r.push(Event::Tick);
            }
            let t0 = Instant::now();
            let c0 = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID);
            let o = pd.on_tick(dst, now(skew));
            dst_secs += t0.elapsed().as_secs_f64();
            dst_cpu += cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID) - c0;
            send(&mut wire_q, false, o);
            let t0 = Instant::now();
            for s in sources.iter_mut() {
                let o = s.protocol.on_tick(src, now(skew));
                send(&mut wire_q, true, o);
            }
            src_secs += t0.elapsed().as_secs_f64();
            continue;
        }
        if let Some(r) = record.as_deref_mut() {
            let frames: Vec<(ConnId, Vec<u8>)> = batch
                .iter()
                .filter(|(_, d, _)| *d)
                .map(|(c, _, f)| (*c, f.clone()))
                .collect();
            if !frames.is_empty() {
                r.push(Event::Batch(frames));
            }
        }
        // The receiving replica's batch.
        let t0 = Instant::now();
        let c0 = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID);
        let mut held = Vec::new();
        for (conn, _, frame) in batch.iter().filter(|(_, d, _)| *d) {
            bytes += frame.len() as u64;
            let env = wire::decode_payload(&frame[wire::FRAME_HEADER_LEN..]).expect("decode");
            held.extend(pd.handle_frame(dst, *conn, env, now(skew)));
        }
        if pd.has_deferred_pushes() {
            held.extend(pd.flush_pushes(dst));
        }
        if let Some(c) = checks.as_deref_mut() {
            c.submit(pd);
        }
        dst.flush().expect("flush");
        dst.maintain();
        dst_secs += t0.elapsed().as_secs_f64();
        dst_cpu += cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID) - c0;
        send(&mut wire_q, false, held);
        // The sources' batch, each session on its own protocol.
        let t0 = Instant::now();
        let mut held = Vec::new();
        for (conn, _, frame) in batch.iter().filter(|(_, d, _)| !*d) {
            let s = &mut sources[slot[conn]];
            let env = wire::decode_payload(&frame[wire::FRAME_HEADER_LEN..]).expect("decode");
            held.extend(s.protocol.handle_frame(src, *conn, env, now(skew)));
        }
        for s in sources.iter_mut() {
            if s.protocol.has_deferred_pushes() {
                held.extend(s.protocol.flush_pushes(src));
            }
        }
        src.flush().expect("flush");
        src.maintain();
        src_secs += t0.elapsed().as_secs_f64();
        send(&mut wire_q, true, held);
        if last_report.elapsed() > Duration::from_secs(10) {
            last_report = Instant::now();
            eprintln!(
                "  {:.0}s: the receiving replica holds {} documents, {} sync messages received ({docs} documents to take)",
                started.elapsed().as_secs_f64(),
                dst.store().doc_count(),
                pd.counters().sync_in - syncs_before
            );
        }
    }
    let cpu = cpu_secs(libc::CLOCK_PROCESS_CPUTIME_ID) - cpu_started;
    let main = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID) - main_started;
    Converged {
        secs: started.elapsed().as_secs_f64(),
        dst_secs,
        src_secs,
        dst_cpu_secs: dst_cpu,
        verify_cpu_secs: cpu - main,
        rounds,
        bytes,
        syncs: pd.counters().sync_in - syncs_before,
    }
}
