//! Store behaviour across peers: sync, authorship, generations, persistence and the digest.

mod common;
mod golden;

use automerge::sync::SyncDoc;
use automerge::transaction::Transactable;
use automerge::{ActorId, ROOT};
use common::*;
use dramesh_store::{
    CLUSTER_PUBLISHER, DocId, Durability, ObjectChange, RolloverPolicy, Store, StoreConfig,
    StoreError, SyncState, heads_hash,
};

fn agent(doc: &DocId, config: StoreConfig) -> Peer {
    let mut store = Store::in_memory(config);
    store.open_writer(doc).unwrap();
    Peer {
        store,
        view: ViewModel::new(),
        agent_of: Some(doc.clone()),
    }
}

fn full_sync(a: &mut Peer, b: &mut Peer) {
    for _ in 0..10 {
        if sync_pair(a, b, 50) == 0 {
            return;
        }
    }
}

#[test]
fn writer_to_replica_materializes_only_changed_keys() {
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let mut a = agent(&d, test_config());
    let mut r = Peer::replica(Store::in_memory(test_config()));
    let w = a
        .store
        .apply(
            &d,
            vec![
                upsert(node("n1"), r#"{"v":1}"#),
                upsert(node("n2"), r#"{"v":1}"#),
            ],
        )
        .unwrap();
    assert_eq!(w.view.len(), 2);
    full_sync(&mut a, &mut r);
    assert_eq!(r.view.len(), 2);
    assert_eq!(r.store.digest(), a.store.digest());

    // One changed key, one identical upsert (skipped), one delete.
    let w = a
        .store
        .apply(
            &d,
            vec![
                upsert(node("n1"), r#"{"v":2}"#),
                upsert(node("n2"), r#"{"v":1}"#),
            ],
        )
        .unwrap();
    assert_eq!(w.view.len(), 1);
    let mut changes = Vec::new();
    let mut sa = SyncState::new();
    let mut sr = SyncState::new();
    let g = a.store.entry(&d).unwrap().generation;
    for _ in 0..10 {
        if let Some(m) = a.store.generate_sync_message(&d, g, &mut sa).unwrap() {
            changes.extend(
                r.store
                    .receive_sync_message(&d, g, &mut sr, &m, &|_| true)
                    .unwrap(),
            );
        }
        if let Some(m) = r.store.generate_sync_message(&d, g, &mut sr).unwrap() {
            a.store
                .receive_sync_message(&d, g, &mut sa, &m, &|_| true)
                .unwrap();
        }
    }
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert_eq!(changes[0].0, "c1");
    match &changes[0].1 {
        ObjectChange::Upsert { key, json } => {
            assert_eq!(key, &node("n1"));
            assert_eq!(&json[..], &br#"{"v":2}"#[..]);
        }
        other => panic!("expected an upsert, got {other:?}"),
    }
    assert_eq!(
        r.store.get("c1", &node("n1")).as_deref(),
        Some(&br#"{"v":2}"#[..])
    );
    assert_eq!(r.store.digest(), a.store.digest());
    apply_view(&mut r.view, changes);

    a.store
        .apply(&d, vec![ObjectChange::Delete { key: node("n2") }])
        .unwrap();
    full_sync(&mut a, &mut r);
    assert_eq!(r.store.get("c1", &node("n2")), None);
    assert_eq!(r.view, snapshot_view(&r.store));
    assert_eq!(r.view.len(), 1);
}

#[test]
fn newer_generation_replaces_older_and_older_is_ignored() {
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let mut a = agent(&d, test_config());
    let mut r = Peer::replica(Store::in_memory(test_config()));
    a.store
        .apply(&d, vec![upsert(node("n1"), "1"), upsert(node("gone"), "x")])
        .unwrap();
    full_sync(&mut a, &mut r);
    let old_gen = r.store.entry(&d).unwrap().generation;

    // Write, roll over, write again: the replica must end with every last write and no
    // leftover key, whatever it held from the older generation.
    a.store
        .apply(&d, vec![ObjectChange::Delete { key: node("gone") }])
        .unwrap();
    let new_gen = a.store.rollover(&d).unwrap();
    assert!(new_gen > old_gen);
    a.store
        .apply(&d, vec![upsert(node("n1"), "2"), upsert(node("n3"), "3")])
        .unwrap();
    full_sync(&mut a, &mut r);
    assert_eq!(r.store.entry(&d).unwrap().generation, new_gen);
    assert_eq!(r.store.digest(), a.store.digest());
    assert_eq!(r.view, snapshot_view(&a.store));
    assert_eq!(r.store.get("c1", &node("gone")), None);
    assert_eq!(r.store.get("c1", &node("n1")).as_deref(), Some(&b"2"[..]));

    // A message for the old generation is ignored and asking for it yields nothing.
    let mut st = SyncState::new();
    assert_eq!(
        r.store.generate_sync_message(&d, old_gen, &mut st).unwrap(),
        None
    );
    let stale = automerge::Automerge::new()
        .generate_sync_message(&mut automerge::sync::State::new())
        .unwrap()
        .encode();
    let out = r
        .store
        .receive_sync_message(&d, old_gen, &mut st, &stale, &|_| true)
        .unwrap();
    assert!(out.is_empty());
    assert_eq!(r.store.entry(&d).unwrap().generation, new_gen);
}

#[test]
fn automatic_rollover_bounds_history() {
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let config = StoreConfig {
        rollover: RolloverPolicy {
            min_stored_bytes: 0,
            max_changes: 1_000_000,
            ..RolloverPolicy::default()
        },
        ..test_config()
    };
    let mut a = agent(&d, config);
    let mut rolled = 0;
    for i in 0..400 {
        let w = a
            .store
            .apply(
                &d,
                vec![upsert(
                    node(&format!("n{}", i % 20)),
                    &format!("{{\"gen\":{i}}}"),
                )],
            )
            .unwrap();
        rolled += usize::from(w.rolled_over);
        let s = a.store.doc_stats(&d).unwrap();
        // Within 2x the fresh size plus the one commit that crossed the limit.
        assert!(
            s.stored_bytes <= 2 * s.fresh_bytes + 512,
            "stored {} fresh {} base {}",
            s.stored_bytes,
            s.fresh_bytes,
            s.base_bytes
        );
        assert!(s.base_bytes as f64 <= 1.25 * s.fresh_bytes as f64, "{s:?}");
    }
    assert!(rolled > 2, "expected several rollovers, got {rolled}");
    let mut r = Peer::replica(Store::in_memory(test_config()));
    full_sync(&mut a, &mut r);
    assert_eq!(r.view, snapshot_view(&a.store));
    assert_eq!(r.view.len(), 20);
}

/// Writes `node` on the writer `a` and syncs the replica `r` until `r` defers a compaction
/// (at most 600 writes); returns the replica's stored bytes after the last write.
fn write_until_compaction_deferred(a: &mut Peer, r: &mut Peer, d: &DocId, node_name: &str) -> u64 {
    let mut stored = r.store.doc_stats(d).map_or(0, |s| s.stored_bytes);
    for i in 0..600 {
        if r.store.has_deferred_compactions() {
            break;
        }
        a.store
            .apply(
                d,
                vec![upsert(
                    node(node_name),
                    &format!("{{\"v\":\"{node_name}-{i}\"}}"),
                )],
            )
            .unwrap();
        full_sync(a, r);
        stored = r.store.doc_stats(d).map_or(0, |s| s.stored_bytes);
    }
    stored
}

#[test]
fn replica_compactions_beyond_the_budget_wait_and_stay_bounded() {
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let dir = tempfile::tempdir().unwrap();
    let mut a = agent(
        &d,
        StoreConfig {
            rollover: RolloverPolicy {
                max_stored_ratio: f64::MAX,
                max_changes: u64::MAX,
                max_ops_ratio: f64::MAX,
                ..RolloverPolicy::default()
            },
            ..test_config()
        },
    );
    // A budget so small that after one compaction the next waits far longer than the writes.
    let config = StoreConfig {
        durability: Durability::Fsync,
        rollover: RolloverPolicy {
            min_stored_bytes: 0,
            compaction_duty: 0.001,
            ..RolloverPolicy::default()
        },
        ..StoreConfig::default()
    };
    let (rs, _) = Store::open(dir.path(), config.clone()).unwrap();
    let mut r = Peer::replica(rs);
    let (mut compactions, mut deferred_seen, mut max_ratio) = (0, false, 0.0f64);
    let mut last_stored = 0;
    for i in 0..600 {
        a.store
            .apply(
                &d,
                vec![upsert(
                    node(&format!("n{}", i % 20)),
                    &format!("{{\"v\":{i}}}"),
                )],
            )
            .unwrap();
        full_sync(&mut a, &mut r);
        let s = r.store.doc_stats(&d).unwrap();
        if s.stored_bytes < last_stored {
            compactions += 1;
        }
        last_stored = s.stored_bytes;
        deferred_seen |= r.store.has_deferred_compactions();
        let reference = s.fresh_bytes.max(s.base_bytes) as f64;
        max_ratio = max_ratio.max(s.stored_bytes as f64 / reference);
    }
    assert!(deferred_seen, "no compaction was ever deferred");
    assert!(compactions >= 2, "expected compactions, saw {compactions}");
    // Deferred copies grow past `max_stored_ratio` (2) but are compacted at once at 3, give or
    // take the one change that crossed it.
    assert!(
        max_ratio > 2.0,
        "deferral never let a copy pass the soft limit: {max_ratio}"
    );
    assert!(max_ratio < 3.2, "copy grew to {max_ratio} x its reference");
    assert_eq!(r.view, snapshot_view(&a.store));

    // A deferred compaction runs once the budget has rested.
    let last_stored = write_until_compaction_deferred(&mut a, &mut r, &d, "n0");
    assert!(r.store.has_deferred_compactions());
    let t = std::time::Instant::now();
    let compacted = loop {
        if let Some(doc) = r.store.maintain_deferred().unwrap() {
            break doc;
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(60),
            "never rested"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert_eq!(compacted, d);
    assert!(!r.store.has_deferred_compactions());
    let s = r.store.doc_stats(&d).unwrap();
    assert!(s.stored_bytes < last_stored, "{s:?} vs {last_stored}");
    // The compacted file reopens to the same state.
    drop(r);
    let (reopened, report) = Store::open(dir.path(), config.clone()).unwrap();
    assert!(report.corrupt.is_empty(), "{:?}", report.corrupt);
    assert_eq!(snapshot_view(&reopened), snapshot_view(&a.store));

    // A copy queued for compaction and then taken over by this store's writer is left to the
    // writer (whose compactions decide rollovers inline).
    let mut r = Peer::replica(reopened);
    write_until_compaction_deferred(&mut a, &mut r, &d, "n1");
    assert!(r.store.has_deferred_compactions());
    let generation = r.store.open_writer(&d).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let t = std::time::Instant::now();
    while r.store.has_deferred_compactions() && t.elapsed() < std::time::Duration::from_secs(60) {
        assert_eq!(r.store.maintain_deferred().unwrap(), None);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(!r.store.has_deferred_compactions(), "never rested");
    assert_eq!(r.store.doc_stats(&d).unwrap().generation, generation);
}

#[test]
fn foreign_author_is_refused_and_state_unchanged() {
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let mut a = agent(&d, test_config());
    let mut r = Peer::replica(Store::in_memory(test_config()));
    a.store.apply(&d, vec![upsert(node("n1"), "good")]).unwrap();
    full_sync(&mut a, &mut r);
    let g = r.store.entry(&d).unwrap().generation;
    let digest_before = r.store.digest().clone();

    // An intruder holding a copy of the document adds a change under its own actor.
    let mut intruder = a.store.automerge_doc(&d).unwrap().fork();
    intruder.set_actor(ActorId::from(b"compromised-peer"));
    let mut tx = intruder.transaction();
    tx.put(
        ROOT,
        "node/n1",
        automerge::ScalarValue::Bytes(b"evil".to_vec()),
    )
    .unwrap();
    tx.commit();

    let mut si = automerge::sync::State::new();
    let mut sr = SyncState::new();
    let mut refused = None;
    for _ in 0..10 {
        if let Some(m) = intruder.generate_sync_message(&mut si) {
            let sr_before = sr.automerge_mut().encode();
            match r
                .store
                .receive_sync_message(&d, g, &mut sr, &m.encode(), &|_| true)
            {
                Ok(out) => assert!(out.is_empty()),
                Err(e) => {
                    assert_eq!(
                        sr.automerge_mut().encode(),
                        sr_before,
                        "sync state was touched"
                    );
                    refused = Some(e);
                    break;
                }
            }
        }
        if let Some(m) = r.store.generate_sync_message(&d, g, &mut sr).unwrap() {
            intruder
                .receive_sync_message(&mut si, automerge::sync::Message::decode(&m).unwrap())
                .unwrap();
        }
    }
    let err = refused.expect("the forged change was never offered");
    assert!(matches!(err, StoreError::ForeignAuthor { .. }), "{err}");
    assert_eq!(r.store.digest(), &digest_before);
    assert_eq!(
        r.store.get("c1", &node("n1")).as_deref(),
        Some(&b"good"[..])
    );

    // The peer policy is consulted before anything else.
    let m = a
        .store
        .generate_sync_message(&d, g, &mut SyncState::new())
        .unwrap()
        .unwrap();
    let err = r
        .store
        .receive_sync_message(&d, g, &mut SyncState::new(), &m, &|_| false)
        .unwrap_err();
    assert!(matches!(err, StoreError::PeerNotAllowed { .. }));

    // The writer never accepts changes to its own document, even well-authored ones.
    let mut other_writer_copy = r.store.automerge_doc(&d).unwrap().fork();
    other_writer_copy.set_actor(dramesh_store::writer_actor(&d, g));
    let mut tx = other_writer_copy.transaction();
    tx.put(
        ROOT,
        "node/n9",
        automerge::ScalarValue::Bytes(b"x".to_vec()),
    )
    .unwrap();
    tx.commit();
    let mut s1 = automerge::sync::State::new();
    let mut s2 = SyncState::new();
    for _ in 0..10 {
        if let Some(m) = other_writer_copy.generate_sync_message(&mut s1) {
            let out = a
                .store
                .receive_sync_message(&d, g, &mut s2, &m.encode(), &|_| true)
                .unwrap();
            assert!(out.is_empty());
        }
        if let Some(m) = a.store.generate_sync_message(&d, g, &mut s2).unwrap() {
            other_writer_copy
                .receive_sync_message(&mut s1, automerge::sync::Message::decode(&m).unwrap())
                .unwrap();
        }
    }
    assert_eq!(a.store.get("c1", &node("n9")), None);
}

#[test]
fn cluster_scoped_keys_prefer_higher_term_then_writer() {
    let d1 = DocId::new("c1", "agent-a");
    let d2 = DocId::new("c1", "agent-b");
    let mut a1 = agent(&d1, test_config());
    let mut a2 = agent(&d2, test_config());
    let mut r = Peer::replica(Store::in_memory(test_config()));
    a1.store.set_lease_term(&d1, 7).unwrap();
    a1.store
        .apply(&d1, vec![upsert(class("gpu"), "from-a")])
        .unwrap();
    a2.store
        .apply(&d2, vec![upsert(class("gpu"), "from-b")])
        .unwrap();
    full_sync(&mut a2, &mut r);
    assert_eq!(
        r.store.get("c1", &class("gpu")).as_deref(),
        Some(&b"from-b"[..])
    );
    full_sync(&mut a1, &mut r);
    assert_eq!(
        r.store.get("c1", &class("gpu")).as_deref(),
        Some(&b"from-a"[..])
    );
    assert_eq!(r.view, snapshot_view(&r.store));

    // The new leaseholder takes over with a higher term; the old one then withdraws.
    a2.store.set_lease_term(&d2, 8).unwrap();
    full_sync(&mut a2, &mut r);
    assert_eq!(
        r.store.get("c1", &class("gpu")).as_deref(),
        Some(&b"from-b"[..])
    );
    a1.store
        .apply(&d1, vec![ObjectChange::Delete { key: class("gpu") }])
        .unwrap();
    full_sync(&mut a1, &mut r);
    assert_eq!(
        r.store.get("c1", &class("gpu")).as_deref(),
        Some(&b"from-b"[..])
    );
    assert_eq!(r.view, snapshot_view(&r.store));
    assert_eq!(r.view.len(), 1);
}

#[test]
fn restart_from_disk_keeps_acknowledged_writes() {
    let dir = tempfile::tempdir().unwrap();
    let rdir = tempfile::tempdir().unwrap();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let config = StoreConfig {
        durability: Durability::Fsync,
        ..StoreConfig::default()
    };
    let generation;
    {
        let (mut s, report) = Store::open(dir.path(), config.clone()).unwrap();
        assert_eq!(report.loaded, 0);
        generation = s.open_writer(&d).unwrap();
        for i in 0..20 {
            s.apply(
                &d,
                vec![upsert(node(&format!("n{}", i % 7)), &i.to_string())],
            )
            .unwrap();
        }
        let mut a = Peer {
            store: s,
            view: ViewModel::new(),
            agent_of: Some(d.clone()),
        };
        let (rs, _) = Store::open(rdir.path(), config.clone()).unwrap();
        let mut r = Peer::replica(rs);
        full_sync(&mut a, &mut r);
        a.store
            .apply(&d, vec![upsert(node("late"), "only-on-writer")])
            .unwrap();
    }
    let (mut s, report) = Store::open(dir.path(), config.clone()).unwrap();
    assert_eq!(report.loaded, 1);
    assert!(report.corrupt.is_empty() && report.truncated.is_empty());
    assert_eq!(s.open_writer(&d).unwrap(), generation);
    for i in 13..20 {
        assert_eq!(
            s.get("c1", &node(&format!("n{}", i % 7))).as_deref(),
            Some(i.to_string().as_bytes())
        );
    }
    assert_eq!(
        s.get("c1", &node("late")).as_deref(),
        Some(&b"only-on-writer"[..])
    );
    // The resumed writer keeps writing in the same generation and a restarted replica catches
    // up incrementally from its own disk copy.
    s.apply(&d, vec![upsert(node("after"), "restart")]).unwrap();
    let (rs, rreport) = Store::open(rdir.path(), config).unwrap();
    assert_eq!(rreport.loaded, 1);
    let mut r = Peer::replica(rs);
    r.view = snapshot_view(&r.store);
    assert_eq!(r.view.len(), 7);
    let mut a = Peer {
        store: s,
        view: ViewModel::new(),
        agent_of: Some(d.clone()),
    };
    full_sync(&mut a, &mut r);
    assert_eq!(r.store.digest(), a.store.digest());
    assert_eq!(r.view, snapshot_view(&a.store));
}

#[test]
fn group_commit_defers_fsync_until_sync_pending_and_keeps_changes() {
    let rdir = tempfile::tempdir().unwrap();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let config = fsync_config();
    let mut a = agent(&d, test_config());
    let (rs, _) = Store::open(rdir.path(), config.clone()).unwrap();
    let mut r = Peer::replica(rs);
    full_sync(&mut a, &mut r);
    assert!(!r.store.group_commit());
    assert!(
        !r.store.has_unsynced(),
        "synchronous mode leaves nothing pending"
    );

    r.store.set_group_commit(true).unwrap();
    assert!(r.store.group_commit());
    let len_before = std::fs::metadata(doc_file(rdir.path())).unwrap().len();
    for i in 0..5 {
        a.store
            .apply(&d, vec![upsert(node(&format!("g{i}")), &i.to_string())])
            .unwrap();
        full_sync(&mut a, &mut r);
    }
    // The records are appended on the store's writer thread; the group commit waits for it,
    // then makes them durable.
    assert!(r.store.has_unsynced());
    assert_eq!(
        r.store.sync_pending().unwrap(),
        1,
        "one fsync for one touched file"
    );
    assert!(std::fs::metadata(doc_file(rdir.path())).unwrap().len() > len_before);
    assert!(!r.store.has_unsynced());
    assert_eq!(r.store.sync_pending().unwrap(), 0);

    // Turning group commit off syncs what is pending.
    a.store.apply(&d, vec![upsert(node("last"), "x")]).unwrap();
    full_sync(&mut a, &mut r);
    assert!(r.store.has_unsynced());
    r.store.set_group_commit(false).unwrap();
    assert!(!r.store.has_unsynced());
    let digest = r.store.digest().clone();
    drop(r);

    let (reopened, report) = Store::open(rdir.path(), config).unwrap();
    assert!(report.corrupt.is_empty() && report.truncated.is_empty());
    assert_eq!(reopened.digest(), &digest);
    assert_eq!(reopened.get("c1", &node("g4")).as_deref(), Some(&b"4"[..]));
    assert_eq!(
        reopened.get("c1", &node("last")).as_deref(),
        Some(&b"x"[..])
    );
}

/// A sync handed out by `begin_sync` (the mesh node runs it on another thread) covers what was
/// received before it, not what arrives while it runs; a failed one makes its files pending
/// again, so the next sync covers them.
#[test]
fn a_begun_sync_covers_what_came_before_it_and_a_failed_one_stays_pending() {
    let rdir = tempfile::tempdir().unwrap();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let mut a = agent(&d, test_config());
    let (rs, _) = Store::open(rdir.path(), fsync_config()).unwrap();
    let mut r = Peer::replica(rs);
    full_sync(&mut a, &mut r);
    r.store.set_group_commit(true).unwrap();
    a.store.apply(&d, vec![upsert(node("g0"), "0")]).unwrap();
    full_sync(&mut a, &mut r);
    let first = r.store.begin_sync().unwrap().expect("g0 is pending");
    assert_eq!(first.files(), 1);
    assert!(!r.store.has_unsynced(), "handed out with the sync");
    // Received while the sync runs: not covered by it.
    a.store.apply(&d, vec![upsert(node("g1"), "1")]).unwrap();
    full_sync(&mut a, &mut r);
    let ran = first.run();
    assert_eq!(r.store.complete_sync(first, ran).unwrap(), 1);
    assert!(r.store.has_unsynced(), "g1 waits for the next sync");
    // A failed sync: pending again, and the next one covers it.
    let second = r.store.begin_sync().unwrap().expect("g1 is pending");
    assert!(!r.store.has_unsynced());
    let failed = Err(StoreError::Io {
        path: rdir.path().to_path_buf(),
        source: std::io::Error::other("disk gone"),
    });
    assert!(r.store.complete_sync(second, failed).is_err());
    assert!(
        r.store.has_unsynced(),
        "a failed sync leaves its files pending"
    );
    assert_eq!(r.store.sync_pending().unwrap(), 1);
    assert!(!r.store.has_unsynced());
    assert!(r.store.begin_sync().unwrap().is_none(), "nothing left");
}

/// A store that stopped serving the view (a relay's, an agent's) carries documents exactly as
/// one that serves it (same digest, same files) but computes no visible values: receiving and
/// writing report no view changes and reads see nothing. Opened again, it builds the view from
/// its files.
#[test]
fn a_store_that_serves_no_view_still_carries_and_persists_documents() {
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let mut a = agent(&d, test_config());
    a.store.apply(&d, vec![upsert(node("n1"), "1")]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (carrier, _) = Store::open(dir.path(), fsync_config()).unwrap();
    let mut carrier = Peer::replica(carrier);
    carrier.store.stop_serving_view();
    let mut replica = Peer::replica(Store::in_memory(test_config()));
    full_sync(&mut a, &mut carrier);
    full_sync(&mut a, &mut replica);
    a.store.apply(&d, vec![upsert(node("n2"), "2")]).unwrap();
    full_sync(&mut a, &mut carrier);
    full_sync(&mut a, &mut replica);
    assert_eq!(carrier.store.digest(), replica.store.digest());
    assert_eq!(
        replica.view.len(),
        2,
        "the serving replica reported both objects"
    );
    assert!(
        carrier.view.is_empty(),
        "view changes reported: {:?}",
        carrier.view
    );
    assert_eq!(carrier.store.get("c1", &node("n2")), None);
    assert!(carrier.store.snapshot().is_empty());
    // Own writes too.
    let own = DocId::new("c1", "w");
    carrier.store.open_writer(&own).unwrap();
    let out = carrier
        .store
        .apply(&own, vec![upsert(node("own"), "x")])
        .unwrap();
    assert!(out.view.is_empty());
    let digest = carrier.store.digest().clone();
    drop(carrier);
    let (reopened, report) = Store::open(dir.path(), fsync_config()).unwrap();
    assert!(report.corrupt.is_empty(), "{report:?}");
    assert_eq!(reopened.digest(), &digest);
    assert_eq!(reopened.get("c1", &node("n2")).as_deref(), Some(&b"2"[..]));
    assert_eq!(reopened.get("c1", &node("own")).as_deref(), Some(&b"x"[..]));
}

/// Received changes are appended on the store's writer thread. An append that fails (here the
/// file was removed behind the store's back) fails the group commit, so nothing that reflects
/// it may be acknowledged; the next group commit rewrites the file whole from the document, and
/// a reopened store holds every change.
#[test]
fn a_failed_background_append_fails_the_commit_and_the_file_is_rewritten_whole() {
    let rdir = tempfile::tempdir().unwrap();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let config = fsync_config();
    let mut a = agent(&d, test_config());
    a.store.apply(&d, vec![upsert(node("g0"), "0")]).unwrap();
    let (rs, _) = Store::open(rdir.path(), config.clone()).unwrap();
    let mut r = Peer::replica(rs);
    full_sync(&mut a, &mut r);
    r.store.set_group_commit(true).unwrap();
    let file = doc_file(rdir.path());
    std::fs::remove_file(&file).unwrap();
    a.store.apply(&d, vec![upsert(node("g1"), "1")]).unwrap();
    full_sync(&mut a, &mut r);
    assert!(
        r.store.sync_pending().is_err(),
        "a failed append must fail the group commit"
    );
    assert!(!file.exists());
    r.store.sync_pending().unwrap();
    assert!(file.exists(), "the file was rewritten");
    a.store.apply(&d, vec![upsert(node("g2"), "2")]).unwrap();
    full_sync(&mut a, &mut r);
    r.store.sync_pending().unwrap();
    let digest = r.store.digest().clone();
    drop(r);
    let (reopened, report) = Store::open(rdir.path(), config).unwrap();
    assert!(
        report.corrupt.is_empty() && report.truncated.is_empty(),
        "{report:?}"
    );
    assert_eq!(reopened.digest(), &digest);
    for (k, v) in [("g0", "0"), ("g1", "1"), ("g2", "2")] {
        assert_eq!(
            reopened.get("c1", &node(k)).as_deref(),
            Some(v.as_bytes()),
            "{k}"
        );
    }
}

/// A first copy of a document joins the group commit; a crash before its sync can leave its
/// file cut short or zero-filled, which the next open deletes (never acknowledged, peers resend
/// it) instead of reporting it as corruption. A writer's own file cut short stays corruption.
#[test]
fn a_first_copy_joins_the_group_commit_and_an_unfinished_file_is_deleted_on_open() {
    let rdir = tempfile::tempdir().unwrap();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let config = fsync_config();
    let mut a = agent(&d, test_config());
    a.store
        .apply(&d, vec![upsert(node("n1"), "first")])
        .unwrap();
    let (mut rs, _) = Store::open(rdir.path(), config.clone()).unwrap();
    rs.set_group_commit(true).unwrap();
    let mut r = Peer::replica(rs);
    full_sync(&mut a, &mut r);
    assert_eq!(r.store.entries().len(), 1);
    assert!(
        r.store.has_unsynced(),
        "the first copy's file waits for the group commit"
    );
    assert_eq!(r.store.sync_pending().unwrap(), 1);
    let file = doc_file(rdir.path());
    let whole = std::fs::read(&file).unwrap();
    let digest = r.store.digest().clone();
    drop(r);

    // What a crash may leave of a file written but not yet fsynced: a prefix, or zeros.
    let cuts: Vec<Vec<u8>> = vec![
        Vec::new(),
        whole[..5].to_vec(),
        whole[..20].to_vec(),
        whole[..whole.len() / 2].to_vec(),
        whole[..whole.len() - 1].to_vec(),
        vec![0; whole.len()],
    ];
    for cut in cuts {
        std::fs::write(&file, &cut).unwrap();
        let (s, report) = Store::open(rdir.path(), config.clone()).unwrap();
        assert!(report.corrupt.is_empty(), "{} bytes: {report:?}", cut.len());
        assert_eq!(report.removed_unfinished_files, 1, "{} bytes", cut.len());
        assert!(
            !file.exists(),
            "{} bytes: the unfinished file is gone",
            cut.len()
        );
        assert!(s.entries().is_empty());
    }
    std::fs::write(&file, &whole).unwrap();
    let (s, report) = Store::open(rdir.path(), config.clone()).unwrap();
    assert_eq!(report.removed_unfinished_files, 0);
    assert_eq!(s.digest(), &digest);

    // More changes before the group commit: their append waits for the file still being
    // written in the background.
    let r2dir = tempfile::tempdir().unwrap();
    let (mut r2s, _) = Store::open(r2dir.path(), config.clone()).unwrap();
    r2s.set_group_commit(true).unwrap();
    let mut r2 = Peer::replica(r2s);
    full_sync(&mut a, &mut r2);
    a.store
        .apply(&d, vec![upsert(node("n2"), "second")])
        .unwrap();
    full_sync(&mut a, &mut r2);
    assert_eq!(r2.store.sync_pending().unwrap(), 1);
    let (reopened, report) = Store::open(r2dir.path(), config.clone()).unwrap();
    assert!(report.corrupt.is_empty() && report.truncated.is_empty());
    assert_eq!(reopened.digest(), r2.store.digest());
    assert_eq!(
        reopened.get("c1", &node("n2")).as_deref(),
        Some(&b"second"[..])
    );

    // A file of the store's own document is fsynced before it is renamed into place: cut
    // short, it is damage, moved aside and reported.
    let wdir = tempfile::tempdir().unwrap();
    let (mut w, _) = Store::open(wdir.path(), config.clone()).unwrap();
    w.open_writer(&d).unwrap();
    drop(w);
    let own = doc_file(wdir.path());
    let bytes = std::fs::read(&own).unwrap();
    std::fs::write(&own, &bytes[..bytes.len() - 1]).unwrap();
    let (_, report) = Store::open(wdir.path(), config).unwrap();
    assert_eq!(report.removed_unfinished_files, 0);
    assert_eq!(report.corrupt.len(), 1, "{report:?}");
}

fn fsync_config() -> StoreConfig {
    StoreConfig {
        durability: Durability::Fsync,
        ..StoreConfig::default()
    }
}

fn doc_file(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "amdoc"))
        .unwrap()
}

fn writer_with_history(dir: &std::path::Path, d: &DocId) -> (Store, Vec<u64>) {
    let (mut s, _) = Store::open(dir, test_config()).unwrap();
    s.open_writer(d).unwrap();
    let mut record_ends = vec![std::fs::metadata(doc_file(dir)).unwrap().len()];
    for i in 0..5 {
        s.apply(d, vec![upsert(node(&format!("n{i}")), "v")])
            .unwrap();
        record_ends.push(std::fs::metadata(doc_file(dir)).unwrap().len());
    }
    (s, record_ends)
}

#[test]
fn truncated_tail_is_cut_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let (s, ends) = writer_with_history(dir.path(), &d);
    drop(s);
    let path = doc_file(dir.path());
    // Cut the last record in half: a write torn by a crash before it was acknowledged.
    let cut = (ends[4] + ends[5]) / 2;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    let (s, report) = Store::open(dir.path(), test_config()).unwrap();
    assert_eq!(report.truncated.len(), 1);
    assert_eq!(report.truncated[0].doc, d);
    assert_eq!(report.truncated[0].bytes, cut - ends[4]);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), ends[4]);
    assert!(s.get("c1", &node("n3")).is_some());
    assert!(s.get("c1", &node("n4")).is_none());

    // Cutting into the snapshot leaves nothing usable: the document is reported and dropped.
    drop(s);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(ends[0] - 5)
        .unwrap();
    let (s, report) = Store::open(dir.path(), test_config()).unwrap();
    assert_eq!(report.corrupt.len(), 1, "{report:?}");
    assert!(s.entries().is_empty());
    assert!(!path.exists());
}

#[test]
fn flipped_byte_is_reported_dropped_and_resynced() {
    let dir = tempfile::tempdir().unwrap();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let (s, ends) = writer_with_history(dir.path(), &d);
    // Keep an intact replica copy to resync from.
    let mut a = Peer {
        store: s,
        view: ViewModel::new(),
        agent_of: Some(d.clone()),
    };
    let rdir = tempfile::tempdir().unwrap();
    let mut r = Peer::replica(Store::open(rdir.path(), test_config()).unwrap().0);
    full_sync(&mut a, &mut r);
    drop(r);
    let mut r2 = Peer::replica(Store::in_memory(test_config()));
    full_sync(&mut a, &mut r2);

    let rpath = doc_file(rdir.path());
    let mut bytes = std::fs::read(&rpath).unwrap();
    let middle = (ends[1] + ends[2]) as usize / 2;
    let middle = middle.min(bytes.len() - 1);
    bytes[middle] ^= 0x01;
    std::fs::write(&rpath, &bytes).unwrap();

    let (rs, report) = Store::open(rdir.path(), test_config()).unwrap();
    assert_eq!(report.corrupt.len(), 1, "{report:?}");
    assert_eq!(report.corrupt[0].doc.as_ref(), Some(&d));
    assert!(report.corrupt[0].moved_to.exists());
    assert!(rs.entries().is_empty(), "corrupt document must not be used");
    let mut r = Peer::replica(rs);
    full_sync(&mut r2, &mut r);
    assert_eq!(r.store.digest(), a.store.digest());
    assert_eq!(r.view, snapshot_view(&a.store));
}

#[test]
fn digest_buckets_locate_differences() {
    let mut a = Peer::replica(Store::in_memory(test_config()));
    let mut b = Peer::replica(Store::in_memory(test_config()));
    let mut agents: Vec<(DocId, Peer)> = (0..12)
        .map(|i| {
            let d = DocId::new("c1", format!("agent-n{i}"));
            let p = agent(&d, test_config());
            (d, p)
        })
        .collect();
    for (d, p) in &mut agents {
        p.store
            .apply(d, vec![upsert(node(&d.writer.replace('/', "-")), "1")])
            .unwrap();
        full_sync(p, &mut a);
        full_sync(p, &mut b);
    }
    assert_eq!(a.store.digest(), b.store.digest());
    assert_eq!(
        a.store.digest().buckets().len(),
        dramesh_store::DIGEST_BUCKETS as usize
    );
    let (d, p) = &mut agents[5];
    p.store.apply(d, vec![upsert(node("x"), "2")]).unwrap();
    full_sync(p, &mut a);
    let diff = a.store.digest().differing_buckets(b.store.digest());
    assert_eq!(diff, vec![d.bucket()]);
    let listed: Vec<DocId> = a
        .store
        .bucket_entries(&diff, |_| true)
        .into_iter()
        .map(|(bucket, s)| {
            assert_eq!(bucket, diff[0]);
            s.doc
        })
        .collect();
    assert!(listed.contains(d));
    full_sync(&mut a, &mut b);
    assert_eq!(a.store.digest(), b.store.digest());
    // The digest is exactly the one its entries give, as a peer would rebuild it.
    assert_eq!(
        &dramesh_store::Digest::from_entries(&a.store.entries()),
        a.store.digest()
    );
}

#[test]
fn bucket_entries_list_several_buckets_in_one_pass_with_a_filter() {
    let mut r = Peer::replica(Store::in_memory(test_config()));
    let docs: Vec<DocId> = ["c1", "c2"]
        .iter()
        .flat_map(|c| (0..40).map(move |i| DocId::new(*c, format!("agent-n{i}"))))
        .collect();
    for d in &docs {
        let mut p = agent(d, test_config());
        p.store
            .apply(d, vec![upsert(node(&d.writer.replace('/', "-")), "1")])
            .unwrap();
        full_sync(&mut p, &mut r);
    }
    assert_eq!(r.store.doc_count(), docs.len());
    assert_eq!(r.store.entries().len(), docs.len());
    let buckets: Vec<u32> = vec![3, 17, 40, 63];
    let keep = |d: &DocId| !d.writer.ends_with('7');
    let listed = r.store.bucket_entries(&buckets, keep);
    let expected: Vec<&DocId> = docs
        .iter()
        .filter(|d| buckets.contains(&d.bucket()) && keep(d))
        .collect();
    assert!(!expected.is_empty());
    assert_eq!(listed.len(), expected.len());
    for (b, e) in &listed {
        assert_eq!(*b, e.doc.bucket());
        assert!(expected.contains(&&e.doc));
        assert_eq!(r.store.entry(&e.doc).as_ref(), Some(e));
    }
    assert!(
        listed.windows(2).all(|w| w[0].0 <= w[1].0),
        "ordered by bucket"
    );
    // The same within one cluster.
    let c2 = r.store.cluster_bucket_entries("c2", &buckets, keep);
    let expected_c2 = expected.iter().filter(|d| d.cluster == "c2").count();
    assert!(expected_c2 > 0);
    assert_eq!(c2.len(), expected_c2);
    assert!(c2.iter().all(|(_, e)| e.doc.cluster == "c2"));
    // Out-of-range bucket indices select nothing.
    assert!(r.store.bucket_entries(&[64, 1000], |_| true).is_empty());
}

#[test]
fn a_copy_holds_the_changes_of_heads_it_has_passed_and_not_of_later_ones() {
    let d = DocId::new("c1", "agent-n1");
    let mut a = agent(&d, test_config());
    let mut r = Peer::replica(Store::in_memory(test_config()));
    a.store.apply(&d, vec![upsert(node("n1"), "1")]).unwrap();
    full_sync(&mut a, &mut r);
    let old = r.store.heads(&d).unwrap();
    assert_eq!(old, a.store.heads(&d).unwrap());
    assert_eq!(old.len(), 1);
    assert_eq!(heads_hash(&old), r.store.entry(&d).unwrap().heads_hash);
    let generation = r.store.entry(&d).unwrap().generation;
    a.store.apply(&d, vec![upsert(node("n1"), "2")]).unwrap();
    let new = a.store.heads(&d).unwrap();
    assert_ne!(new, old);
    // The writer holds the copy's heads; the copy does not hold the writer's new ones.
    assert!(a.store.holds_changes(&d, generation, &old));
    assert!(!r.store.holds_changes(&d, generation, &new));
    assert!(r.store.holds_changes(&d, generation, &old));
    // Another generation, or a document not held, holds nothing.
    assert!(!a.store.holds_changes(&d, generation + 1, &old));
    let other = DocId::new("c1", "agent-n2");
    assert!(!r.store.holds_changes(&other, generation, &[]));
    assert!(r.store.heads(&other).is_none());
    full_sync(&mut a, &mut r);
    assert!(r.store.holds_changes(&d, generation, &new));
}

#[test]
fn large_batches_on_large_documents_report_exactly_the_changed_keys() {
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let mut a = agent(&d, test_config());
    let mut r = Peer::replica(Store::in_memory(test_config()));
    let fill: Vec<ObjectChange> = (0..2100)
        .map(|i| upsert(node(&format!("n{i}")), &format!("{{\"i\":{i}}}")))
        .collect();
    a.store.apply(&d, fill).unwrap();
    full_sync(&mut a, &mut r);
    assert_eq!(r.view.len(), 2100);
    // Five upserts and a delete reach the replica in one message; the changed keys come from
    // the changes' operations.
    for i in 0..5 {
        a.store
            .apply(&d, vec![upsert(node(&format!("n{i}")), "changed")])
            .unwrap();
    }
    a.store
        .apply(&d, vec![ObjectChange::Delete { key: node("n7") }])
        .unwrap();
    let g = a.store.entry(&d).unwrap().generation;
    let mut sa = SyncState::new();
    let mut sr = SyncState::new();
    let mut changes = Vec::new();
    for _ in 0..10 {
        if let Some(m) = a.store.generate_sync_message(&d, g, &mut sa).unwrap() {
            changes.extend(
                r.store
                    .receive_sync_message(&d, g, &mut sr, &m, &|_| true)
                    .unwrap(),
            );
        }
        if let Some(m) = r.store.generate_sync_message(&d, g, &mut sr).unwrap() {
            a.store
                .receive_sync_message(&d, g, &mut sa, &m, &|_| true)
                .unwrap();
        }
    }
    let mut keys: Vec<String> = changes
        .iter()
        .map(|(_, c)| match c {
            ObjectChange::Upsert { key, .. } => format!("up {}", key.name),
            ObjectChange::Delete { key } => format!("del {}", key.name),
        })
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        ["del n7", "up n0", "up n1", "up n2", "up n3", "up n4"]
    );
    assert_eq!(r.store.digest(), a.store.digest());
    assert!(sa.automerge_mut().shared_heads == a.store.automerge_doc(&d).unwrap().get_heads());
    apply_view(&mut r.view, changes);
    assert_eq!(r.view, snapshot_view(&a.store));
}

#[test]
fn implausible_future_generation_is_refused() {
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let mut a = agent(&d, test_config());
    let g = a.store.entry(&d).unwrap().generation;
    let mut st = SyncState::new();
    let m = automerge::Automerge::new()
        .generate_sync_message(&mut automerge::sync::State::new())
        .unwrap()
        .encode();
    let err = a
        .store
        .receive_sync_message(&d, u64::MAX, &mut st, &m, &|_| true)
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::FutureGeneration {
                generation: u64::MAX,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("more than 30 days in the future"),
        "{err}"
    );
    assert_eq!(
        a.store
            .generate_sync_message(&d, u64::MAX, &mut st)
            .unwrap(),
        None
    );
    assert_eq!(a.store.entry(&d).unwrap().generation, g);
}

/// Issue 14 item 8: a writer whose clock ran 300 days ahead wrote a generation replicas
/// refuse. Reopened with the right clock and the same directory, it starts a new generation
/// from the clock, keeps every value, and a replica holding the generation from before the
/// clock fault takes it.
#[test]
fn writer_recovers_from_a_clock_that_ran_ahead() {
    const DAY_MS: i64 = 24 * 3600 * 1000;
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let dir = tempfile::tempdir().unwrap();
    let mut replica = Peer::replica(Store::in_memory(test_config()));
    // Before the fault: generation g0 reaches the replica.
    let g0 = {
        let (mut w, _) = Store::open(dir.path(), test_config()).unwrap();
        let g0 = w.open_writer(&d).unwrap();
        w.apply(&d, vec![upsert(node("n1"), "1")]).unwrap();
        let mut a = Peer {
            store: w,
            view: ViewModel::new(),
            agent_of: Some(d.clone()),
        };
        sync_pair(&mut a, &mut replica, 10);
        assert_eq!(replica.store.entry(&d).unwrap().generation, g0);
        g0
    };
    // The clock jumps 300 days ahead; a rollover (compaction policy, restart after a lost
    // file, ...) makes a generation from it, and the next write lands there.
    let ahead = StoreConfig {
        clock_offset_ms: 300 * DAY_MS,
        ..test_config()
    };
    let g_bad = {
        let (mut w, _) = Store::open(dir.path(), ahead.clone()).unwrap();
        assert_eq!(
            w.open_writer(&d).unwrap(),
            g0,
            "plausible by its own (wrong) clock"
        );
        let g_bad = w.rollover(&d).unwrap();
        assert!(g_bad > g0 + 299 * DAY_MS as u64);
        w.apply(&d, vec![upsert(node("n2"), "2")]).unwrap();
        let mut st = SyncState::new();
        let m = w
            .generate_sync_message(&d, g_bad, &mut st)
            .unwrap()
            .unwrap();
        let err = replica
            .store
            .receive_sync_message(&d, g_bad, &mut SyncState::new(), &m, &|_| true)
            .unwrap_err();
        assert!(
            matches!(err, StoreError::FutureGeneration { generation, .. } if generation == g_bad),
            "{err}"
        );
        // Nothing of it reached the replica.
        assert_eq!(replica.store.entry(&d).unwrap().generation, g0);
        g_bad
    };
    // The clock is fixed; the writer restarts on the same directory.
    let (mut w, _) = Store::open(dir.path(), test_config()).unwrap();
    let g1 = w.open_writer(&d).unwrap();
    assert!(g1 < g_bad && g1 > g0, "{g0} < {g1} < {g_bad}");
    assert!(w.plausible_generation(g1));
    assert!(
        w.get("c1", &node("n2")).is_some(),
        "values written while ahead are kept"
    );
    assert!(w.get("c1", &node("n1")).is_some());
    // Idempotent: a plausible generation is left alone.
    assert_eq!(w.recover_generation(&d).unwrap(), None);
    let mut a = Peer {
        store: w,
        view: ViewModel::new(),
        agent_of: Some(d.clone()),
    };
    sync_pair(&mut a, &mut replica, 10);
    assert_eq!(replica.store.entry(&d).unwrap().generation, g1);
    assert!(replica.store.get("c1", &node("n2")).is_some());
    assert_eq!(replica.store.digest(), a.store.digest());
}

#[test]
fn store_can_move_to_a_blocking_thread() {
    fn assert_send<T: Send + 'static>() {}
    assert_send::<Store>();
    assert_send::<StoreError>();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let handle = std::thread::spawn(move || {
        let mut s = Store::in_memory(test_config());
        s.open_writer(&d).unwrap();
        s.apply(&d, vec![upsert(node("n1"), "1")])
            .unwrap()
            .view
            .len()
    });
    assert_eq!(handle.join().unwrap(), 1);
}

/// A change whose dependency arrives only in a later message waits in automerge's queue and is
/// applied together with the later message: its keys are not in that message, so the store
/// must find them another way (it diffs) and still report every changed key.
#[test]
fn changes_queued_for_a_missing_dependency_are_reported_when_applied() {
    use automerge::sync::{Message, MessageVersion};
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let mut a = agent(&d, test_config());
    let mut r = Peer::replica(Store::in_memory(test_config()));
    a.store
        .apply(&d, vec![upsert(node("base"), "{\"v\":0}")])
        .unwrap();
    full_sync(&mut a, &mut r);
    assert_eq!(r.view.len(), 1);
    let g = a.store.entry(&d).unwrap().generation;
    // Two further commits by the writer's actor, the second depending on the first.
    let mut fork = a.store.automerge_doc(&d).unwrap().clone();
    let start = fork.get_heads();
    for (name, json) in [("first", "{\"v\":1}"), ("second", "{\"v\":2}")] {
        let k = dramesh_store::keys::doc_key(&node(name)).unwrap();
        let mut tx = fork.transaction();
        tx.put(ROOT, k.as_str(), json).unwrap();
        tx.commit();
    }
    let changes = fork.get_changes(&start);
    assert_eq!(changes.len(), 2);
    let message = |change: &automerge::Change| {
        Message {
            heads: fork.get_heads(),
            need: vec![],
            have: vec![],
            changes: vec![change.raw_bytes().to_vec()].into(),
            supported_capabilities: None,
            version: MessageVersion::V1,
        }
        .encode()
    };
    let (first, second) = if changes[0].deps().contains(&changes[1].hash()) {
        (&changes[1], &changes[0])
    } else {
        (&changes[0], &changes[1])
    };
    let mut state = SyncState::new();
    let out = r
        .store
        .receive_sync_message(&d, g, &mut state, &message(second), &|_| true)
        .unwrap();
    assert!(
        out.is_empty(),
        "nothing applies before its dependency: {out:?}"
    );
    let out = r
        .store
        .receive_sync_message(&d, g, &mut state, &message(first), &|_| true)
        .unwrap();
    let mut names: Vec<String> = out
        .iter()
        .map(|(_, c)| match c {
            ObjectChange::Upsert { key, .. } => key.name.clone(),
            ObjectChange::Delete { key } => format!("deleted {}", key.name),
        })
        .collect();
    names.sort();
    assert_eq!(names, vec!["first".to_string(), "second".to_string()]);
    apply_view(&mut r.view, out);
    assert_eq!(r.view, snapshot_view(&r.store));
}

#[test]
fn document_ids_the_mesh_cannot_name_are_refused() {
    let mut s = Store::in_memory(test_config());
    for bad in [
        DocId::new("c1", "agent/n1"),
        DocId::new("C1", "n1"),
        DocId::new("_other", "r1"),
    ] {
        let err = s.open_writer(&bad).unwrap_err();
        assert!(matches!(err, StoreError::InvalidDocId { .. }), "{err}");
        assert!(err.to_string().contains(&bad.to_string()), "{err}");
        let err = s
            .receive_sync_message(&bad, 1, &mut SyncState::new(), &[], &|_| true)
            .unwrap_err();
        assert!(matches!(err, StoreError::InvalidDocId { .. }), "{err}");
    }
    assert!(s.entries().is_empty());
    s.open_writer(&DocId::reservations("r1")).unwrap();
    assert_eq!(s.entries().len(), 1);
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[test]
fn a_retired_cluster_is_dropped_from_memory_digest_and_disk_until_its_writer_rejoins() {
    let rdir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        durability: Durability::Fsync,
        ..StoreConfig::default()
    };
    // Writers named after their nodes: a node's writer may publish only its own Node.
    let gone = DocId::new("c1", "n1");
    let stays = DocId::new("c2", "m1");
    let mut a = agent(&gone, test_config());
    let mut b = agent(&stays, test_config());
    a.store.apply(&gone, vec![upsert(node("n1"), "1")]).unwrap();
    b.store
        .apply(&stays, vec![upsert(node("m1"), "2")])
        .unwrap();
    let (rs, _) = Store::open(rdir.path(), config.clone()).unwrap();
    let mut r = Peer::replica(rs);
    full_sync(&mut a, &mut r);
    full_sync(&mut b, &mut r);
    assert_eq!(std::fs::read_dir(rdir.path()).unwrap().count(), 2);
    let old_gen = r.store.entry(&gone).unwrap().generation;

    let at = now_ms();
    let out = r.store.retire_cluster("c1", at).unwrap();
    apply_view(&mut r.view, out);
    assert_eq!(r.view, snapshot_view(&b.store), "only c2 stays visible");
    assert_eq!(r.store.entry(&gone), None);
    assert_eq!(r.store.digest(), b.store.digest());
    assert_eq!(std::fs::read_dir(rdir.path()).unwrap().count(), 1);
    assert_eq!(r.store.retired_clusters().get("c1"), Some(&at));
    // Retiring again is a no-op.
    assert!(r.store.retire_cluster("c1", at - 1).unwrap().is_empty());
    assert_eq!(r.store.retired_clusters().get("c1"), Some(&at));

    // The old generation cannot come back, whoever offers it.
    a.store.apply(&gone, vec![upsert(node("n1"), "3")]).unwrap();
    let mut sa = SyncState::new();
    let msg = a
        .store
        .generate_sync_message(&gone, old_gen, &mut sa)
        .unwrap()
        .unwrap();
    let err = r
        .store
        .receive_sync_message(&gone, old_gen, &mut SyncState::new(), &msg, &|_| true)
        .unwrap_err();
    assert!(
        matches!(err, StoreError::RetiredCluster { retired_at_ms, .. } if retired_at_ms == at),
        "{err}"
    );
    assert!(err.to_string().contains("--rejoin"), "{err}");
    assert_eq!(r.store.entry(&gone), None);
    assert_eq!(r.store.digest(), b.store.digest());

    // On disk nothing of c1 is left: a restart holds only c2.
    drop(r);
    let (rs, report) = Store::open(rdir.path(), config).unwrap();
    assert_eq!(report.loaded, 1);
    let mut r = Peer::replica(rs);
    r.view = snapshot_view(&r.store);
    assert_eq!(r.view, snapshot_view(&b.store));

    // A writer that rolls over by itself (as bounded history does, however often) does not
    // come back: its new generation is received whole, found without a rejoin and refused,
    // and its later messages are refused at once.
    r.store.retire_cluster("c1", at).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(3));
    for _ in 0..3 {
        let rolled = a.store.rollover(&gone).unwrap();
        assert!(rolled > at);
        let err = offer(&mut a, &mut r, &gone, rolled).expect("a rollover is refused");
        assert!(
            matches!(err, StoreError::RetiredCluster { generation, .. } if generation == rolled),
            "{err}"
        );
        assert!(
            err.to_string().contains("a rollover is not a rejoin"),
            "{err}"
        );
        assert_eq!(r.store.entry(&gone), None);
        assert_eq!(r.store.digest(), b.store.digest());
        let again = offer(&mut a, &mut r, &gone, rolled).expect("refused at once");
        assert!(
            matches!(again, StoreError::RetiredCluster { .. }),
            "{again}"
        );
    }

    // The writer asks to rejoin: that generation, and every rollover after it, is accepted.
    let new_gen = a.store.rejoin(&gone).unwrap();
    full_sync(&mut a, &mut r);
    assert_eq!(r.store.entry(&gone).unwrap().generation, new_gen);
    assert_eq!(r.store.get("c1", &node("n1")).as_deref(), Some(&b"3"[..]));
    let later = a.store.rollover(&gone).unwrap();
    full_sync(&mut a, &mut r);
    assert_eq!(r.store.entry(&gone).unwrap().generation, later);
    // A later retirement ends it again, rejoined or not.
    std::thread::sleep(std::time::Duration::from_millis(3));
    let at2 = now_ms();
    r.store.retire_cluster("c1", at2).unwrap();
    assert_eq!(r.store.entry(&gone), None);
    let rolled = a.store.rollover(&gone).unwrap();
    assert!(offer(&mut a, &mut r, &gone, rolled).is_some());
    assert_eq!(r.store.entry(&gone), None);
}

/// Offers generation `generation` of `doc` from `a` to `r` until nothing more is sent, or `r`
/// refuses a message: that refusal.
fn offer(a: &mut Peer, r: &mut Peer, doc: &DocId, generation: u64) -> Option<StoreError> {
    let (mut sa, mut sr) = (SyncState::new(), SyncState::new());
    for _ in 0..50 {
        let mut progressed = false;
        if let Some(m) = a
            .store
            .generate_sync_message(doc, generation, &mut sa)
            .unwrap()
        {
            match r
                .store
                .receive_sync_message(doc, generation, &mut sr, &m, &|_| true)
            {
                Ok(out) => apply_view(&mut r.view, out),
                Err(e) => return Some(e),
            }
            progressed = true;
        }
        if let Some(m) = r
            .store
            .generate_sync_message(doc, generation, &mut sr)
            .unwrap()
        {
            let out = a
                .store
                .receive_sync_message(doc, generation, &mut sa, &m, &|_| true)
                .unwrap();
            apply_view(&mut a.view, out);
            progressed = true;
        }
        if !progressed {
            return None;
        }
    }
    None
}

#[test]
fn a_replica_that_took_a_rollover_before_the_retirement_drops_it_when_the_tombstone_arrives() {
    // r was partitioned when the cluster was retired; meanwhile the writer rolled over and r
    // took the new generation. The tombstone, arriving after, drops it all the same (it does
    // not rejoin), and a replica restarted from disk applies it at start the same way.
    let rdir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        durability: Durability::Fsync,
        ..StoreConfig::default()
    };
    let gone = DocId::new("c1", "n1");
    let mut a = agent(&gone, test_config());
    a.store.apply(&gone, vec![upsert(node("n1"), "1")]).unwrap();
    let at = now_ms();
    std::thread::sleep(std::time::Duration::from_millis(3));
    let rolled = a.store.rollover(&gone).unwrap();
    assert!(rolled > at);
    let (rs, _) = Store::open(rdir.path(), config.clone()).unwrap();
    let mut r = Peer::replica(rs);
    full_sync(&mut a, &mut r);
    assert_eq!(r.store.entry(&gone).unwrap().generation, rolled);
    drop(r);
    let (rs, report) = Store::open(rdir.path(), config).unwrap();
    assert_eq!(report.loaded, 1);
    let mut r = Peer::replica(rs);
    r.view = snapshot_view(&r.store);
    let out = r.store.retire_cluster("c1", at).unwrap();
    assert_eq!(out.len(), 1, "the node leaves the view: {out:?}");
    assert_eq!(r.store.entry(&gone), None);
    assert_eq!(r.store.digest(), &dramesh_store::Digest::empty());
    assert!(offer(&mut a, &mut r, &gone, rolled).is_some());
}
