//! `__replay <clusters> <nodes> [changed]`: the receiving replica's share of a heal, on a
//! process of its own.
//!
//! Record (once): the `__load` probe's fleet (`clusters` x `nodes` signed per-node documents,
//! held by a source store) is loaded into a receiving replica `r3` through one relay per member
//! cluster (a protocol on the source store with the cluster's first node agent's identity,
//! relaying: each session's scope is its cluster, as in the fleet), and r3's store directory
//! is saved as it is; `changed` writers (default all) change their Node once, only the source
//! takes the changes, the relays' sessions close (they keep their sync states, as after a
//! partition) and a fresh `r3` protocol on the saved store (a replica that comes back) heals
//! from the relays, which dial again. Everything `r3` receives in that heal is saved in order:
//! each batch of frames the relays sent, with its session, and each anti-entropy tick between
//! them.
//!
//! Replay: for each verifier thread count in `MESH_REPLAY_THREADS` (default `1,2,4`), a child
//! process (this binary, role `__replay_child`) copies the saved store, opens it with `r3`'s
//! certificate, and feeds the recorded traffic to a fresh `r3` protocol as the node's driver
//! would: frames in batches of up to 256 while fewer than 1,024 checks are out on the verifier
//! threads, checks done handed back first, a commit (fsync) after each batch; every check of a
//! recorded batch done before the next one starts (the recorded source answered a state in
//! which they were). Its answers are dropped. The child must end at the recorded source's
//! digest, or the replay fails. Before the replay the child verifies the signatures of the
//! documents it holds, so that their signers' chains are cached, as on a replica that stayed up
//! through the partition; `MESH_REPLAY_COLD=1` skips that (a restarted replica: each
//! document's first signature then also checks its signer's chain, a second ECDSA check). Frames are decoded before the
//! replay starts (the node's connection tasks decode them, not its protocol thread), their CPU
//! reported apart. Reports documents applied per second and CPU per document: the whole
//! process, its protocol (main) thread, the verifier threads and the store's file writer
//! (`/proc/self/task`).
//!
//! `MESH_REPLAY_DIR` keeps the recording in that directory and reuses it when it is there.

use std::io::{BufWriter, Read};

use dramesh_mesh::node::SharedVerifier;
use dramesh_mesh::protocol::{ConnId, Protocol};
use dramesh_mesh::wire;
use dramesh_store::{PendingSync, StoreError};

use super::load::{
    Fleet, Source, converge, cpu_secs, open_replica, probe_config, verifier_threads,
};
use super::*;

/// One step of the recorded traffic to the receiving replica.
pub(crate) enum Event {
    /// Frames (header included) the sources sent in one batch, each with its session.
    Batch(Vec<(ConnId, Vec<u8>)>),
    /// An anti-entropy round: both sides were quiet and the clock moved by [`TICK_SKEW`].
    Tick,
}

/// How far the probes move their protocols' clock at each anti-entropy round.
pub(crate) const TICK_SKEW: Duration = Duration::from_secs(3);

/// The node's driver's bounds (`node/driver.rs`): events per batch, checks out before it
/// takes no more events, and how long it waits for the rest of the checks out once one is done.
const MAX_BATCH_EVENTS: usize = 256;
const MAX_CHECKS_IN_FLIGHT: usize = 4 * MAX_BATCH_EVENTS;
const CHECK_LINGER: Duration = Duration::from_millis(3);

/// A batch's sync running on a thread of its own, as on the node's sync thread.
type Syncing = Option<std::thread::JoinHandle<(PendingSync, Result<(), StoreError>)>>;

/// Waits for the running sync, if any, and books it; returns how long the wait took.
fn finish_commit(dst: &mut MeshStore, syncing: &mut Syncing) -> f64 {
    let Some(h) = syncing.take() else {
        return 0.0;
    };
    let t0 = Instant::now();
    let (sync, r) = h.join().expect("sync thread");
    dst.complete_flush(sync, r).expect("commit");
    t0.elapsed().as_secs_f64()
}

/// [`Event`] with its frames decoded.
enum Decoded {
    Batch(Vec<(ConnId, wire::pb::Envelope)>),
    Tick,
}

/// A recorded session's far end, as `meta.json` names it.
fn source_json(conn: ConnId, id: &PeerIdentity) -> Value {
    match id {
        PeerIdentity::Agent { cluster, node } => {
            json!({"conn": conn.0, "cluster": cluster, "node": node})
        }
        PeerIdentity::Replica { id } => json!({"conn": conn.0, "replica": id}),
    }
}

fn source_from_json(v: &Value) -> (ConnId, PeerIdentity) {
    let conn = ConnId(v["conn"].as_u64().expect("conn of a source"));
    let text = |k: &str| v[k].as_str().map(str::to_string);
    let id = match (text("replica"), text("cluster"), text("node")) {
        (Some(id), _, _) => PeerIdentity::Replica { id },
        (None, Some(cluster), Some(node)) => PeerIdentity::Agent { cluster, node },
        _ => panic!("a source in meta.json names neither a replica nor an agent: {v}"),
    };
    (conn, id)
}

pub(crate) fn replay_main(args: &[String]) {
    // `cargo bench ... -- __replay 10 1000` appends `--bench`.
    let [clusters, nodes, rest @ ..] = args else {
        panic!("replay role needs 2 arguments: <clusters> <nodes> [changed]");
    };
    let changed = rest.first().and_then(|c| c.parse::<usize>().ok());
    let kept = std::env::var_os("MESH_REPLAY_DIR").map(PathBuf::from);
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = kept.unwrap_or_else(|| tmp.path().join("recording"));
    if dir.join("meta.json").exists() {
        println!("reusing the recording in {}", dir.display());
    } else {
        record(
            clusters.parse().expect("cluster count"),
            nodes.parse().expect("node count"),
            changed,
            &dir,
        );
    }
    let threads: Vec<usize> = std::env::var("MESH_REPLAY_THREADS")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .map(|t| {
            t.trim()
                .parse()
                .expect("MESH_REPLAY_THREADS: thread counts")
        })
        .collect();
    let exe = std::env::current_exe().expect("current exe");
    let mut results = Vec::new();
    for t in threads {
        let out = Command::new(&exe)
            .arg("__replay_child")
            .arg(&dir)
            .arg(t.to_string())
            .stderr(Stdio::inherit())
            .output()
            .expect("spawn the replaying replica");
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        assert!(out.status.success(), "the replaying replica failed");
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("REPLAY "))
            .expect("the replaying replica's REPLAY line");
        results.push(serde_json::from_str::<Value>(line).expect("REPLAY JSON"));
    }
    println!(
        "| verifier threads | documents/s | process CPU ms/doc | protocol thread | verifiers | store writer | protocol thread waiting for checks, s | commits, s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in &results {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {} | {:.0} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} ({}) |",
            r["verify_threads"],
            f("docs_per_sec"),
            f("process_cpu_ms_per_doc"),
            f("protocol_cpu_ms_per_doc"),
            f("verifier_cpu_ms_per_doc"),
            f("writer_cpu_ms_per_doc"),
            f("protocol_wait_secs"),
            f("commit_secs"),
            r["commits"]
        );
    }
    println!("REPLAY_JSON {}", Value::Array(results));
}

/// Builds the fleet, loads `r3`, saves its store and the heal's traffic into `dir`.
fn record(clusters: usize, nodes: usize, changed: Option<usize>, dir: &Path) {
    let mut fleet = Fleet::build(clusters, nodes);
    let docs = fleet.docs;
    let changed = changed.unwrap_or(docs).min(docs);
    let r3 = fleet.tmp.path().join("r3");
    let dst_id = fleet.dst_tls.identity.clone();
    // One session per member cluster's relay, as a replica heals in the fleet (a cluster's
    // documents reach the replicas through its relay).
    let relays = fleet.relay_ids();
    let mut sources = Source::relays(&relays, 1);
    {
        let (mut dst, _) = open_replica(&r3, &fleet.dst_tls);
        let mut pd = Protocol::new(dst_id.clone(), probe_config());
        let load = converge(
            &mut fleet.src,
            &mut dst,
            &mut sources,
            &mut pd,
            &dst_id,
            docs,
            None,
            None,
        );
        load.print(&format!("r3 loaded {docs} documents"), docs);
        dst.flush().expect("flush r3");
    }
    std::fs::create_dir_all(dir).expect("recording dir");
    copy_dir(&r3, &dir.join("base"));
    fleet.change(changed);
    // r3 comes back: its store as saved, a protocol with no session state. The relays keep
    // the closed sessions' sync states, as after a partition, and dial again.
    let first_conn = sources.len() as u64 + 1;
    for (i, s) in sources.iter_mut().enumerate() {
        s.protocol.on_disconnected(s.conn);
        s.conn = ConnId(first_conn + i as u64);
    }
    let (mut dst, _) = open_replica(&r3, &fleet.dst_tls);
    let mut pd = Protocol::new(dst_id.clone(), probe_config());
    let mut events = Vec::new();
    let heal = converge(
        &mut fleet.src,
        &mut dst,
        &mut sources,
        &mut pd,
        &dst_id,
        changed,
        None,
        Some(&mut events),
    );
    heal.print(
        &format!(
            "r3 healed {changed} changed documents from {} relays",
            sources.len()
        ),
        changed,
    );
    let (batches, frames, bytes) = write_events(&dir.join("frames.bin"), &events);
    let ca = certs::write_ca(dir, &fleet.ca).expect("write CA");
    let leaf = certs::write_leaf(dir, &fleet.dst_leaf).expect("write r3's certificate");
    let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
    let meta = json!({
        "docs": docs, "changed": changed, "target": fleet.src.digest().root().to_string(),
        "sources": sources.iter().map(|s| source_json(s.conn, &s.id)).collect::<Vec<_>>(),
        "ca": name(&ca.cert), "cert": name(&leaf.cert), "key": name(&leaf.key),
        "batches": batches, "frames": frames, "bytes": bytes,
        "ticks": events.iter().filter(|e| matches!(e, Event::Tick)).count(),
    });
    std::fs::write(dir.join("meta.json"), meta.to_string()).expect("write meta.json");
    // The sessions are listed in meta.json; here only how many.
    let mut shown = meta.clone();
    shown["sources"] = json!(sources.len());
    println!("recorded into {}: {shown}", dir.display());
}

/// `cp -a from to`: the saved store keeps its files as they are.
fn copy_dir(from: &Path, to: &Path) {
    let status = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("run cp");
    assert!(
        status.success(),
        "cp -a {} {}",
        from.display(),
        to.display()
    );
}

/// Writes `events` as tagged, length-prefixed records; returns (batches, frames, bytes).
fn write_events(path: &Path, events: &[Event]) -> (usize, usize, u64) {
    let mut w = BufWriter::new(std::fs::File::create(path).expect("create frames file"));
    let (mut batches, mut frames, mut bytes) = (0, 0, 0u64);
    let len = |n: usize| u32::try_from(n).expect("fits u32").to_le_bytes();
    for e in events {
        match e {
            Event::Tick => w.write_all(&[1]).expect("write"),
            Event::Batch(fs) => {
                batches += 1;
                w.write_all(&[0]).expect("write");
                w.write_all(&len(fs.len())).expect("write");
                for (conn, f) in fs {
                    frames += 1;
                    bytes += f.len() as u64;
                    w.write_all(&conn.0.to_le_bytes()).expect("write");
                    w.write_all(&len(f.len())).expect("write");
                    w.write_all(f).expect("write");
                }
            }
        }
    }
    w.flush().expect("flush frames file");
    (batches, frames, bytes)
}

fn read_events(path: &Path) -> Vec<Event> {
    let mut data = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut data))
        .expect("read frames file");
    fn take<'a>(rest: &mut &'a [u8], n: usize) -> &'a [u8] {
        assert!(rest.len() >= n, "frames file truncated");
        let (head, tail) = rest.split_at(n);
        *rest = tail;
        head
    }
    fn len(rest: &mut &[u8]) -> usize {
        u32::from_le_bytes(take(rest, 4).try_into().expect("4 bytes")) as usize
    }
    let mut rest = &data[..];
    let mut events = Vec::new();
    while !rest.is_empty() {
        if take(&mut rest, 1)[0] == 1 {
            events.push(Event::Tick);
            continue;
        }
        let count = len(&mut rest);
        let mut frames = Vec::with_capacity(count);
        for _ in 0..count {
            let conn = ConnId(u64::from_le_bytes(
                take(&mut rest, 8).try_into().expect("8 bytes"),
            ));
            let n = len(&mut rest);
            frames.push((conn, take(&mut rest, n).to_vec()));
        }
        events.push(Event::Batch(frames));
    }
    events
}

/// CPU seconds so far of this process's threads, by role: verifier threads, the store's file
/// writer, and the rest but the main thread (`/proc/self/task/*/schedstat`: time on a CPU, ns).
fn threads_cpu() -> HashMap<&'static str, f64> {
    let main = std::process::id().to_string();
    let mut by_role = HashMap::new();
    for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let Ok(task) = task else { continue };
        if task.file_name().to_string_lossy() == main {
            continue;
        }
        let read = |f: &str| std::fs::read_to_string(task.path().join(f)).unwrap_or_default();
        let (comm, schedstat) = (read("comm"), read("schedstat"));
        let Some(ns) = schedstat
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<f64>().ok())
        else {
            continue;
        };
        let role = if comm.contains("verify") {
            "verifiers"
        } else if comm.contains("store") {
            "writer"
        } else {
            "other"
        };
        *by_role.entry(role).or_insert(0.0) += ns / 1e9;
    }
    by_role
}

/// Verifies the signed heads of every document `dst` holds, so that its verifier has their
/// signers' chains cached; returns how many it checked.
fn warm_chains(dst: &MeshStore, verifier: &SharedVerifier) -> usize {
    let v = verifier.lock().expect("verifier").clone();
    let all: Vec<u32> = (0..dramesh_store::DIGEST_BUCKETS).collect();
    let mut n = 0;
    for (_, e) in dst.store().bucket_entries(&all, |_| true) {
        if let Some(a) = dst.store().signed_heads(&e.doc) {
            let statement = dramesh_store::attest::statement(&e.doc, e.generation, &a.heads);
            v.verify(&e.doc, &statement, &a.signature, &a.signer)
                .expect("a held document's signature verifies");
            n += 1;
        }
    }
    n
}

pub(crate) fn replay_child_main(args: &[String]) {
    let [dir, threads, ..] = args else {
        panic!("replay child needs 2 arguments: <recording dir> <verifier threads>");
    };
    let dir = Path::new(dir);
    let threads: usize = threads.parse().expect("verifier thread count");
    let meta: Value = serde_json::from_slice(&std::fs::read(dir.join("meta.json")).expect("meta"))
        .expect("meta.json");
    let file = |k: &str| dir.join(meta[k].as_str().expect("file name in meta.json"));
    let tls = certs::load_identity(&file("cert"), &file("key"), &file("ca")).expect("identity");
    let target: u64 = meta["target"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("target");
    let changed = meta["changed"].as_u64().expect("changed") as usize;
    let events = read_events(&dir.join("frames.bin"));
    // The node's connection tasks decode frames before the protocol thread sees them: decoded
    // here ahead, and their CPU reported on its own.
    let decode0 = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID);
    let events: Vec<Decoded> = events
        .into_iter()
        .map(|e| match e {
            Event::Tick => Decoded::Tick,
            Event::Batch(frames) => Decoded::Batch(
                frames
                    .into_iter()
                    .map(|(conn, f)| {
                        let env =
                            wire::decode_payload(&f[wire::FRAME_HEADER_LEN..]).expect("decode");
                        (conn, env)
                    })
                    .collect(),
            ),
        })
        .collect();
    let decode_secs = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID) - decode0;
    let work = tempfile::tempdir().expect("temp dir");
    let r3 = work.path().join("r3");
    copy_dir(&dir.join("base"), &r3);
    let (mut dst, verifier) = open_replica(&r3, &tls);
    let cold = std::env::var_os("MESH_REPLAY_COLD").is_some();
    if !cold {
        let t = Instant::now();
        let n = warm_chains(&dst, &verifier);
        println!(
            "signer chains of {n} held documents checked ahead ({:.1}s), as a replica that stayed up has them cached",
            t.elapsed().as_secs_f64()
        );
    }
    let mut checks = verifier_threads(threads, "replay", verifier);
    let mut pd = Protocol::new(tls.identity.clone(), probe_config());
    pd.set_verify_jobs(checks.is_some());
    let sources: Vec<(ConnId, PeerIdentity)> = meta["sources"]
        .as_array()
        .expect("sources in meta.json")
        .iter()
        .map(source_from_json)
        .collect();
    let load_avg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();

    let started = Instant::now();
    let process0 = cpu_secs(libc::CLOCK_PROCESS_CPUTIME_ID);
    let main0 = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID);
    let threads0 = threads_cpu();
    let mut skew = Duration::ZERO;
    let now = |skew: Duration| Instant::now() + skew;
    let mut waiting = 0.0f64;
    // Wall time the protocol thread waited for commits (the store's fsync) and how many.
    let (mut commit_secs, mut commits) = (0.0f64, 0u64);
    let mut syncing = None;
    for (conn, id) in sources.iter() {
        let _ = pd.on_connected(*conn, id.clone(), now(skew));
    }
    for event in events {
        match event {
            Decoded::Tick => {
                skew += TICK_SKEW;
                let _ = pd.on_tick(&mut dst, now(skew));
            }
            Decoded::Batch(frames) => {
                // As the node's driver: up to MAX_BATCH_EVENTS frames at a time while fewer
                // than MAX_CHECKS_IN_FLIGHT checks are out, checks done handed back first, a
                // commit after each round.
                let mut frames = frames.into_iter().peekable();
                loop {
                    let in_flight = pd.verifications_in_flight();
                    let take_frames = in_flight < MAX_CHECKS_IN_FLIGHT;
                    if frames.peek().is_none() && in_flight == 0 {
                        break;
                    }
                    if let Some(c) = checks.as_mut() {
                        let block = in_flight > 0 && (!take_frames || frames.peek().is_none());
                        let (t0, c0) = (Instant::now(), cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID));
                        let done = c.finished(block, in_flight, CHECK_LINGER);
                        if block {
                            waiting += t0.elapsed().as_secs_f64()
                                - (cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID) - c0);
                        }
                        for t in done {
                            let _ = pd.on_verified(&mut dst, t, now(skew));
                        }
                    }
                    if take_frames {
                        for (conn, env) in frames.by_ref().take(MAX_BATCH_EVENTS) {
                            let _ = pd.handle_frame(&mut dst, conn, env, now(skew));
                        }
                    }
                    if pd.has_deferred_pushes() {
                        let _ = pd.flush_pushes(&mut dst);
                    }
                    if let Some(c) = checks.as_mut() {
                        c.submit(&mut pd);
                    }
                    // As the driver commits: the previous batch's sync ran alongside this
                    // batch; this batch's runs alongside the next one when its frames are
                    // already here, else it is waited for at once.
                    commit_secs += finish_commit(&mut dst, &mut syncing);
                    if let Some(sync) = dst.begin_flush().expect("begin flush") {
                        commits += 1;
                        syncing = Some(std::thread::spawn(move || {
                            let r = sync.run();
                            (sync, r)
                        }));
                    }
                    let next_ready = frames.peek().is_some()
                        && pd.verifications_in_flight() < MAX_CHECKS_IN_FLIGHT;
                    if !next_ready {
                        commit_secs += finish_commit(&mut dst, &mut syncing);
                    }
                    dst.maintain();
                }
            }
        }
    }
    commit_secs += finish_commit(&mut dst, &mut syncing);
    dst.flush().expect("flush");
    let secs = started.elapsed().as_secs_f64();
    let process = cpu_secs(libc::CLOCK_PROCESS_CPUTIME_ID) - process0;
    let main = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID) - main0;
    let threads1 = threads_cpu();
    let role =
        |r: &str| threads1.get(r).copied().unwrap_or(0.0) - threads0.get(r).copied().unwrap_or(0.0);
    assert_eq!(
        dst.digest().root(),
        target,
        "the replayed replica did not reach the recorded source's digest"
    );
    let per_doc = |s: f64| s * 1e3 / changed as f64;
    println!(
        "replayed the heal of {changed} documents with {threads} verifier threads in {secs:.2}s ({:.0} documents/s): process CPU {:.3} ms per document, protocol thread {:.3}, verifiers {:.3}, store writer {:.3}, frame decoding (the node's connection tasks) {:.3}; protocol thread waiting for checks {waiting:.2}s, for {commits} commits {commit_secs:.2}s (their fsync runs alongside the next batch when it is there); load average {}",
        changed as f64 / secs,
        per_doc(process),
        per_doc(main),
        per_doc(role("verifiers")),
        per_doc(role("writer")),
        per_doc(decode_secs),
        load_avg.trim()
    );
    println!(
        "REPLAY {}",
        json!({"verify_threads": threads, "changed": changed, "secs": secs,
               "docs_per_sec": changed as f64 / secs,
               "process_cpu_ms_per_doc": per_doc(process), "protocol_cpu_ms_per_doc": per_doc(main),
               "verifier_cpu_ms_per_doc": per_doc(role("verifiers")),
               "writer_cpu_ms_per_doc": per_doc(role("writer")),
               "other_cpu_ms_per_doc": per_doc(role("other")),
               "decode_cpu_ms_per_doc": per_doc(decode_secs), "sessions": sources.len(),
               "protocol_wait_secs": waiting, "commits": commits, "commit_secs": commit_secs,
               "chains_cached": !cold, "load_avg": load_avg.trim()})
    );
}
