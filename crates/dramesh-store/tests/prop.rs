//! Property tests: random interleavings of writes, lease-term changes, rollovers and partial
//! sync sessions between writers and three replicas always converge, and the view each replica
//! built only from returned changes equals the expected winning state; random writes, rollovers
//! and restarts from disk never lose an acknowledged write.

mod common;

use common::*;
use dramesh_store::{
    DocId, ObjectChange, ObjectKey, ObjectKind, RolloverPolicy, Store, StoreConfig,
};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Node writers: each may publish only its own node's records (`node/kX`, the pod bound to
/// `k0`); cluster records (the class) only while it holds its cluster's highest lease term.
const WRITERS: [(&str, &str); 3] = [("c1", "k0"), ("c1", "k1"), ("c2", "k0")];

fn key(i: usize) -> ObjectKey {
    match i {
        0 => node("k0"),
        1 => node("k1"),
        2 => class("shared"),
        _ => ObjectKey {
            kind: ObjectKind::Pod,
            namespace: Some("ns".to_string()),
            name: "p".to_string(),
        },
    }
}

#[derive(Clone, Debug)]
enum Op {
    Write { w: usize, k: usize, delete: bool },
    Term { w: usize, term: u64 },
    Rollover { w: usize },
    Sync { a: usize, b: usize, rounds: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..4usize, prop::bool::weighted(0.2)).prop_map(|(w, k, delete)| Op::Write { w, k, delete }),
        1 => (0..3usize, 0..3u64).prop_map(|(w, term)| Op::Term { w, term }),
        1 => (0..3usize).prop_map(|w| Op::Rollover { w }),
        4 => (0..6usize, 0..6usize, 1..4usize).prop_map(|(a, b, rounds)| Op::Sync { a, b, rounds }),
    ]
}

fn small_rollover_config() -> StoreConfig {
    StoreConfig {
        rollover: RolloverPolicy {
            min_stored_bytes: 0,
            max_changes: 4,
            ..RolloverPolicy::default()
        },
        ..test_config()
    }
}

fn pair(peers: &mut [Peer], a: usize, b: usize) -> Option<(&mut Peer, &mut Peer)> {
    if a == b {
        return None;
    }
    let (lo, hi) = (a.min(b), a.max(b));
    let (left, right) = peers.split_at_mut(hi);
    Some((&mut left[lo], &mut right[0]))
}

/// Whether writer `w` may publish key `k` (see [`WRITERS`]).
fn in_scope(w: usize, k: usize, terms: &[u64]) -> bool {
    let (cluster, writer) = WRITERS[w];
    match k {
        0 => writer == "k0",
        1 => writer == "k1",
        2 => {
            let max = WRITERS
                .iter()
                .zip(terms)
                .filter(|((c, _), _)| *c == cluster)
                .map(|(_, t)| *t)
                .max()
                .unwrap_or(0);
            terms[w] == max
        }
        _ => writer == "k0",
    }
}

/// Expected visible state: per key, the value of the in-scope holder with the highest
/// (term, writer).
fn expected(values: &[BTreeMap<usize, Arc<[u8]>>], terms: &[u64]) -> ViewModel {
    type Ranked<'a> = ((u64, &'a str), Arc<[u8]>);
    let mut best: BTreeMap<(String, ObjectKey), Ranked> = BTreeMap::new();
    for (w, (cluster, writer)) in WRITERS.iter().enumerate() {
        for (k, v) in values[w].iter().filter(|(k, _)| in_scope(w, **k, terms)) {
            let rank = (terms[w], *writer);
            let slot = (cluster.to_string(), key(*k));
            match best.get(&slot) {
                Some((r, _)) if *r >= rank => {}
                _ => {
                    best.insert(slot, (rank, v.clone()));
                }
            }
        }
    }
    best.into_iter().map(|(k, (_, v))| (k, v)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn replicas_converge_to_every_last_write(ops in prop::collection::vec(op(), 1..40)) {
        let docs: Vec<DocId> = WRITERS.iter().map(|(c, w)| DocId::new(*c, *w)).collect();
        let mut peers: Vec<Peer> = docs
            .iter()
            .map(|d| {
                let mut store = Store::in_memory(small_rollover_config());
                store.open_writer(d).unwrap();
                Peer { store, view: ViewModel::new(), agent_of: Some(d.clone()) }
            })
            .collect();
        for _ in 0..3 {
            peers.push(Peer::replica(Store::in_memory(test_config())));
        }
        let mut values: Vec<BTreeMap<usize, Arc<[u8]>>> = vec![BTreeMap::new(); 3];
        let mut terms = [0u64; 3];
        let mut counter = 0u64;
        for op in ops {
            match op {
                Op::Write { w, k, delete } => {
                    counter += 1;
                    let change = if delete {
                        values[w].remove(&k);
                        ObjectChange::Delete { key: key(k) }
                    } else {
                        let v: Arc<[u8]> = if k == 3 {
                            Arc::from(format!(r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"p","namespace":"ns","annotations":{{"n":"{w}-{counter}"}}}},"spec":{{"nodeName":"k0","containers":[]}}}}"#).as_bytes())
                        } else {
                            Arc::from(format!("{{\"w\":{w},\"n\":{counter}}}").as_bytes())
                        };
                        values[w].insert(k, v.clone());
                        ObjectChange::Upsert { key: key(k), json: v }
                    };
                    peers[w].store.apply(&docs[w], vec![change]).unwrap();
                }
                Op::Term { w, term } => {
                    terms[w] = term;
                    peers[w].store.set_lease_term(&docs[w], term).unwrap();
                }
                Op::Rollover { w } => {
                    peers[w].store.rollover(&docs[w]).unwrap();
                }
                Op::Sync { a, b, rounds } => {
                    if let Some((x, y)) = pair(&mut peers, a, b) {
                        sync_pair(x, y, rounds);
                    }
                }
            }
        }
        // Heal: everyone talks to everyone until nothing moves.
        for _ in 0..10 {
            let mut moved = 0;
            for a in 0..6 {
                for b in (a + 1)..6 {
                    if let Some((x, y)) = pair(&mut peers, a, b) {
                        moved += sync_pair(x, y, 50);
                    }
                }
            }
            if moved == 0 {
                break;
            }
        }
        let want = expected(&values, &terms);
        let digest = peers[3].store.digest().clone();
        for r in &peers[3..] {
            prop_assert_eq!(r.store.digest(), &digest);
            prop_assert_eq!(&r.view, &want);
            prop_assert_eq!(&snapshot_view(&r.store), &want);
        }
        for (w, d) in docs.iter().enumerate() {
            let s = peers[3].store.entry(d).unwrap();
            prop_assert_eq!(Some(s), peers[w].store.entry(d));
        }
    }

    #[test]
    fn restarts_keep_every_acknowledged_write(
        ops in prop::collection::vec((0..4usize, 0..8usize), 1..40)
    ) {
        let dir = tempfile::tempdir().unwrap();
        let d = DocId::new("c1", "agent-a");
        let open = || Store::open(dir.path(), small_rollover_config()).unwrap();
        let (mut s, _) = open();
        s.open_writer(&d).unwrap();
        let mut model: BTreeMap<usize, String> = BTreeMap::new();
        for (i, (action, k)) in ops.into_iter().enumerate() {
            match action {
                0 | 1 => {
                    let v = format!("v{i}");
                    s.apply(&d, vec![upsert(key(k % 4), &v)]).unwrap();
                    model.insert(k % 4, v);
                }
                2 => {
                    if k % 2 == 0 {
                        s.rollover(&d).unwrap();
                    } else {
                        s.apply(&d, vec![ObjectChange::Delete { key: key(k % 4) }]).unwrap();
                        model.remove(&(k % 4));
                    }
                }
                _ => {
                    let generation = s.entry(&d).unwrap().generation;
                    drop(s);
                    let (reopened, report) = open();
                    s = reopened;
                    prop_assert!(report.corrupt.is_empty() && report.truncated.is_empty());
                    prop_assert_eq!(s.open_writer(&d).unwrap(), generation);
                }
            }
            let want: ViewModel = model
                .iter()
                .map(|(k, v)| (("c1".to_string(), key(*k)), Arc::from(v.as_bytes())))
                .collect();
            prop_assert_eq!(snapshot_view(&s), want);
        }
    }
}
