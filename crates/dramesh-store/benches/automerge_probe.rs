//! The probe that decided the automerge pin (ARCHITECTURE.md, "Why automerge 0.6.1").
//!
//! It measures, on bare automerge and with only API that 0.6 and later releases share, what the
//! store's replicas do per update: a loaded document of `PROBE_KEYS` values of ~600 bytes (one
//! cluster's objects in one root map) takes single-key changes from its writer.
//! - apply: each change is applied to the loaded copy (`load_incremental` of the writer's
//!   `save_after`); time per change and resident growth per change.
//! - sync: one full sync round (generate/receive until both sides are quiet) per change,
//!   after `PROBE_HISTORY` changes of history; time per round.
//! - the resident size of the loaded document.
//!
//! Run: `cargo bench -p dramesh-store --bench automerge_probe`. It uses whatever automerge the
//! workspace pins; ARCHITECTURE.md says how to run it against another release.

use automerge::sync::{State, SyncDoc};
use automerge::transaction::Transactable;
use automerge::{Automerge, ROOT};
use std::time::{Duration, Instant};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Resident set size in bytes (Linux; 0 elsewhere).
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn value(key: usize, round: usize) -> String {
    // ~600 bytes, different per round so every change really changes the value.
    format!("{key:06}-{round:08}-").repeat(600 / 16)
}

fn writer(keys: usize) -> Automerge {
    let mut doc = Automerge::new();
    let mut tx = doc.transaction();
    for k in 0..keys {
        tx.put(ROOT, format!("node/n{k}"), value(k, 0))
            .expect("put into a fresh document");
    }
    tx.commit();
    doc
}

fn change(doc: &mut Automerge, key: usize, round: usize) {
    let mut tx = doc.transaction();
    tx.put(ROOT, format!("node/n{key}"), value(key, round))
        .expect("put");
    tx.commit();
}

fn sync_round(a: &mut Automerge, sa: &mut State, b: &mut Automerge, sb: &mut State) {
    for _ in 0..16 {
        let m1 = a.generate_sync_message(sa);
        let sent = m1.is_some();
        if let Some(m) = m1 {
            b.receive_sync_message(sb, m).expect("receive at b");
        }
        let m2 = b.generate_sync_message(sb);
        let answered = m2.is_some();
        if let Some(m) = m2 {
            a.receive_sync_message(sa, m).expect("receive at a");
        }
        if !sent && !answered {
            return;
        }
    }
    panic!("sync did not settle in 16 rounds");
}

fn per(total: Duration, n: usize) -> f64 {
    total.as_secs_f64() * 1e3 / n.max(1) as f64
}

fn main() {
    let keys = env("PROBE_KEYS", 7_000);
    let updates = env("PROBE_UPDATES", 2_000);
    let history = env("PROBE_HISTORY", 2_500);
    let rounds = env("PROBE_ROUNDS", 500);
    println!("automerge probe: {keys} keys of ~600 B");

    // Apply: a loaded copy takes the writer's single-key changes.
    let mut w = writer(keys);
    let saved = w.save();
    let before_load = rss();
    let mut replica = Automerge::load(&saved).expect("load the writer's save");
    let loaded = rss().saturating_sub(before_load);
    let start_rss = rss();
    let mut spent = Duration::ZERO;
    for i in 0..updates {
        let heads = w.get_heads();
        change(&mut w, (i * 7919) % keys, i + 1);
        let bytes = w.save_after(&heads);
        let t = Instant::now();
        replica
            .load_incremental(&bytes)
            .expect("apply the writer's change");
        spent += t.elapsed();
    }
    assert_eq!(replica.get_heads(), w.get_heads());
    let growth = rss().saturating_sub(start_rss);
    println!(
        "apply: {:.3} ms per applied change, resident +{:.1} KB per change over {updates} changes",
        per(spent, updates),
        growth as f64 / 1024.0 / updates.max(1) as f64
    );
    println!(
        "loaded document: {:.1} MB resident",
        loaded as f64 / 1024.0 / 1024.0
    );
    drop(replica);

    // Sync: one full sync round per change, with `history` changes behind it.
    let mut w = writer(keys);
    for i in 0..history {
        change(&mut w, (i * 7919) % keys, i + 1);
    }
    let mut r = Automerge::load(&w.save()).expect("load");
    let (mut sw, mut sr) = (State::new(), State::new());
    sync_round(&mut w, &mut sw, &mut r, &mut sr);
    let t = Instant::now();
    for i in 0..rounds {
        change(&mut w, (i * 104_729) % keys, history + i + 1);
        sync_round(&mut w, &mut sw, &mut r, &mut sr);
    }
    let spent = t.elapsed();
    assert_eq!(r.get_heads(), w.get_heads());
    println!(
        "sync: {:.3} ms per full sync round per change ({history} changes of history, {rounds} rounds)",
        per(spent, rounds)
    );
}
