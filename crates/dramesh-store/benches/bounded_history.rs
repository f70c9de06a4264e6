//! Bounded-history figure: N updates (default 1,000,000) to one writer document holding a
//! 5,000-node cluster, with automatic generation rollover. Reports, sampled along the run, the
//! stored file size and the live heap of the store against a freshly built document (and a
//! fresh store) of the same state.
//!
//! Run: `cargo bench -p dramesh-store --bench bounded_history`
//! Knobs (env): UPDATES, NODES, BATCH (updates per commit), SAMPLE_EVERY, FSYNC=1,
//! MIN_STORED (bytes), RATIO_X10 (stored/fresh compaction ratio x 10).

use dramesh_store::{DocId, Durability, ObjectChange, ObjectKey, ObjectKind, Store, StoreConfig};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new, Ordering::Relaxed);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A trimmed node record of about 600 bytes; `rev` and the allocatable memory vary per update.
fn node_json(i: u64, rev: u64) -> Arc<[u8]> {
    let s = format!(
        concat!(
            r#"{{"metadata":{{"name":"node-{i:05}","labels":{{"kubernetes.io/hostname":"node-{i:05}","#,
            r#""topology.kubernetes.io/zone":"zone-{z}","node.kubernetes.io/instance-type":"gpu-8x-large","#,
            r#""nvidia.com/gpu.product":"H100-SXM5-80GB","pool":"training-{p}"}},"resourceVersion":"{rev}"}},"#,
            r#""spec":{{"taints":[{{"key":"nvidia.com/gpu","effect":"NoSchedule"}}],"providerID":"cloud://region-1/i-{i:012}"}},"#,
            r#""status":{{"allocatable":{{"cpu":"190","memory":"{mem}Ki","ephemeral-storage":"3500Gi","pods":"110","#,
            r#""nvidia.com/gpu":"8"}},"capacity":{{"cpu":"192","memory":"2063937Mi","pods":"110"}},"#,
            r#""conditions":[{{"type":"Ready","status":"True"}}],"nodeInfo":{{"kubeletVersion":"v1.36.0","#,
            r#""containerRuntimeVersion":"containerd://2.1.0","architecture":"amd64"}}}}}}"#
        ),
        i = i,
        z = i % 3,
        p = i % 17,
        rev = rev,
        mem = 2_000_000_000u64 + (rev * 7919) % 1_000_000,
    );
    Arc::from(s.as_bytes())
}

fn key(i: u64) -> ObjectKey {
    ObjectKey {
        kind: ObjectKind::Node,
        namespace: None,
        name: format!("node-{i:05}"),
    }
}

/// xorshift: deterministic, no dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn fresh_store_heap(values: &[(u64, u64)], cluster: &str) -> (usize, u64) {
    let before = LIVE.load(Ordering::Relaxed);
    let mut s = Store::in_memory(StoreConfig {
        durability: Durability::None,
        ..StoreConfig::default()
    });
    let d = DocId::new(cluster, "agent-fresh");
    s.open_writer(&d).expect("open fresh writer");
    let changes = values
        .iter()
        .map(|(i, rev)| ObjectChange::Upsert {
            key: key(*i),
            json: node_json(*i, *rev),
        })
        .collect();
    s.apply(&d, changes).expect("fill fresh store");
    let heap = LIVE.load(Ordering::Relaxed).saturating_sub(before);
    let stored = s.doc_stats(&d).map_or(0, |st| st.stored_bytes);
    drop(s);
    (heap, stored)
}

/// One sync session between two stores for `doc`, returning the time spent in the replica.
fn sync_once(writer: &mut Store, replica: &mut Store, doc: &DocId) -> std::time::Duration {
    let generation = writer.entry(doc).map_or(0, |s| s.generation);
    let mut sw = dramesh_store::SyncState::new();
    let mut sr = dramesh_store::SyncState::new();
    let mut in_replica = std::time::Duration::ZERO;
    for _ in 0..20 {
        let mut moved = false;
        if let Some(m) = writer
            .generate_sync_message(doc, generation, &mut sw)
            .expect("gen w")
        {
            let t = Instant::now();
            replica
                .receive_sync_message(doc, generation, &mut sr, &m, &|_| true)
                .expect("recv r");
            in_replica += t.elapsed();
            moved = true;
        }
        let t = Instant::now();
        let reply = replica
            .generate_sync_message(doc, generation, &mut sr)
            .expect("gen r");
        in_replica += t.elapsed();
        if let Some(m) = reply {
            writer
                .receive_sync_message(doc, generation, &mut sw, &m, &|_| true)
                .expect("recv w");
            moved = true;
        }
        if !moved {
            break;
        }
    }
    in_replica
}

/// Replica-side cost: a replica follows the writer, syncing after every 10 commits.
fn replica_phase(store: &mut Store, d: &DocId, revs: &mut [(u64, u64)], batch: u64, rng: &mut Rng) {
    let nodes = revs.len() as u64;
    let mut replica = Store::in_memory(StoreConfig {
        durability: Durability::None,
        ..StoreConfig::default()
    });
    let t = Instant::now();
    sync_once(store, &mut replica, d);
    println!(
        "replica initial sync (whole document): {:.0} ms",
        t.elapsed().as_secs_f64() * 1000.0
    );
    let mut spent = std::time::Duration::ZERO;
    let mut commits = 0u64;
    for round in 0..20u64 {
        for _ in 0..10 {
            let changes = (0..batch)
                .map(|_| {
                    let i = rng.next() % nodes;
                    revs[i as usize].1 += 1;
                    ObjectChange::Upsert {
                        key: key(i),
                        json: node_json(i, revs[i as usize].1 + round),
                    }
                })
                .collect();
            store.apply(d, changes).expect("apply");
            commits += 1;
        }
        spent += sync_once(store, &mut replica, d);
    }
    println!(
        "replica following the writer: {commits} commits received in 20 sessions, {:.1} ms per commit in the replica",
        spent.as_secs_f64() * 1000.0 / commits as f64
    );
    assert_eq!(replica.digest(), store.digest(), "replica converged");
}

fn main() {
    // `cargo bench` passes `--bench`; any other harness flag is ignored too.
    let updates = env("UPDATES", 1_000_000);
    let nodes = env("NODES", 5_000);
    let batch = env("BATCH", 1).max(1);
    let sample_every = env("SAMPLE_EVERY", 50_000);
    let durability = if env("FSYNC", 0) == 1 {
        Durability::Fsync
    } else {
        Durability::None
    };
    let dir = std::env::temp_dir().join(format!("dramesh-bounded-history-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut config = StoreConfig {
        durability,
        ..StoreConfig::default()
    };
    config.rollover.min_stored_bytes = env("MIN_STORED", config.rollover.min_stored_bytes);
    config.rollover.max_stored_ratio = env("RATIO_X10", 20) as f64 / 10.0;
    let heap0 = LIVE.load(Ordering::Relaxed);
    let (mut store, _) = Store::open(&dir, config).expect("open store");
    let d = DocId::new("bench", "agent-source-dir");
    store.open_writer(&d).expect("open writer");
    let mut revs: Vec<(u64, u64)> = (0..nodes).map(|i| (i, 0)).collect();
    let initial: Vec<ObjectChange> = (0..nodes)
        .map(|i| ObjectChange::Upsert {
            key: key(i),
            json: node_json(i, 0),
        })
        .collect();
    store.apply(&d, initial).expect("initial fill");
    let (fresh_heap, fresh_store_bytes) = fresh_store_heap(&revs, "bench");
    println!(
        "config: updates={updates} nodes={nodes} batch={batch} durability={durability:?} value_bytes~{}",
        node_json(0, 0).len()
    );
    println!(
        "fresh store: heap {} B, stored {} B",
        fresh_heap, fresh_store_bytes
    );
    println!(
        "{:>9} {:>6} {:>12} {:>12} {:>12} {:>7} {:>7} {:>9}",
        "updates", "gens", "stored_B", "fresh_B", "heap_B", "st/fr", "hp/fh", "upd/s"
    );
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let start = Instant::now();
    let mut rollovers = 0u64;
    let mut max_stored_ratio = 0f64;
    let mut max_heap_ratio = 0f64;
    let mut done = 0u64;
    while done < updates {
        let n = batch.min(updates - done);
        let mut changes = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let i = rng.next() % nodes;
            revs[i as usize].1 += 1;
            changes.push(ObjectChange::Upsert {
                key: key(i),
                json: node_json(i, revs[i as usize].1 + done),
            });
        }
        let out = store.apply(&d, changes).expect("apply");
        rollovers += u64::from(out.rolled_over);
        done += n;
        // Stored size also checked cheaply on every commit against the last fresh size.
        if done % sample_every < batch || done == updates {
            let st = store.doc_stats(&d).expect("stats");
            let file = std::fs::read_dir(&dir)
                .expect("read dir")
                .filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum::<u64>();
            let fresh = store.fresh_size(&d).expect("fresh").unwrap_or(1) as u64;
            let heap = LIVE.load(Ordering::Relaxed).saturating_sub(heap0);
            let sr = file as f64 / fresh as f64;
            let hr = heap as f64 / fresh_heap as f64;
            max_stored_ratio = max_stored_ratio.max(sr);
            max_heap_ratio = max_heap_ratio.max(hr);
            println!(
                "{:>9} {:>6} {:>12} {:>12} {:>12} {:>7.2} {:>7.2} {:>9.0}",
                done,
                rollovers,
                file,
                fresh,
                heap,
                sr,
                hr,
                done as f64 / start.elapsed().as_secs_f64()
            );
            assert_eq!(
                st.keys,
                nodes as usize + 1,
                "every node key plus the term key"
            );
        }
    }
    let elapsed = start.elapsed();
    let (updates_per_sec, commits) = (
        updates as f64 / elapsed.as_secs_f64(),
        updates.div_ceil(batch),
    );
    println!(
        "done: {updates} updates in {:.1} s ({updates_per_sec:.0} updates/s, {commits} commits), {rollovers} rollovers",
        elapsed.as_secs_f64()
    );
    replica_phase(&mut store, &d, &mut revs, batch, &mut rng);
    // Worst case over every commit is at the moment just before a rollover: stored is bounded by
    // ratio x fresh + one commit, which the samples above approach but may miss.
    println!(
        "max sampled stored/fresh-doc = {max_stored_ratio:.2}, max sampled heap/fresh-store-heap = {max_heap_ratio:.2}"
    );
    if let Some(doc) = store.automerge_doc(&d) {
        let t = Instant::now();
        let saved = doc.save();
        let save_ms = t.elapsed().as_secs_f64() * 1000.0;
        let t = Instant::now();
        let loaded = automerge::Automerge::load(&saved).expect("load");
        let load_ms = t.elapsed().as_secs_f64() * 1000.0;
        drop(loaded);
        let changes = doc.get_changes(&[]);
        let t = Instant::now();
        let mut replay = automerge::Automerge::new();
        replay
            .apply_changes(changes.iter().map(|c| (*c).clone()))
            .expect("replay");
        let replay_ms = t.elapsed().as_secs_f64() * 1000.0;
        if changes.len() > 20 {
            let cut = changes.len() - 20;
            let at = [changes[cut - 1].hash()];
            let base = doc.fork_at(&at).expect("fork_at").save();
            let mut tail = Vec::new();
            for c in &changes[cut..] {
                tail.extend_from_slice(c.raw_bytes());
            }
            let t = Instant::now();
            let mut b = automerge::Automerge::load(&base).expect("load base");
            let l1 = t.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            b.load_incremental(&tail).expect("incremental");
            let l2 = t.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            let mut c2 = automerge::Automerge::load(&base).expect("load base");
            for c in &changes[cut..] {
                c2.apply_changes(std::iter::once((*c).clone()))
                    .expect("apply one");
            }
            let l3 = t.elapsed().as_secs_f64() * 1000.0 - l1;
            let mut all = base.clone();
            all.extend_from_slice(&tail);
            let t = Instant::now();
            let _ = automerge::Automerge::load(&all).expect("load all");
            let l4 = t.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            let mut rebuilt = automerge::Automerge::new();
            rebuilt
                .apply_changes(changes.iter().map(|c| (*c).clone()))
                .expect("rebuild");
            let l5 = t.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            let patches = rebuilt.diff(
                &at,
                &rebuilt.get_heads(),
                automerge::patches::TextRepresentation::String(automerge::TextEncoding::default()),
            );
            let l6 = t.elapsed().as_secs_f64() * 1000.0;
            println!(
                "replay all {} changes into an empty doc {l5:.0} ms; diff over the last 20: {} patches in {l6:.1} ms",
                changes.len(),
                patches.len()
            );
            println!(
                "load base {l1:.0} ms; +20 changes: load_incremental {l2:.0} ms, one by one {l3:.0} ms; load(base+tail) {l4:.0} ms"
            );
        }
        println!(
            "current generation: {} changes, save() {} B in {save_ms:.0} ms, load {load_ms:.0} ms, replay of all changes {replay_ms:.0} ms",
            changes.len(),
            saved.len()
        );
    }
    let reopen = Instant::now();
    drop(store);
    let (store, report) = Store::open(&dir, StoreConfig::default()).expect("reopen");
    println!(
        "reopen from disk: {:.0} ms, {} docs, corrupt {}, truncated {}",
        reopen.elapsed().as_secs_f64() * 1000.0,
        report.loaded,
        report.corrupt.len(),
        report.truncated.len()
    );
    let t = Instant::now();
    let snap = store.snapshot();
    println!(
        "snapshot of the view: {} objects in {:.0} ms",
        snap.len(),
        t.elapsed().as_secs_f64() * 1000.0
    );
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}
