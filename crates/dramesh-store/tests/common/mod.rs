//! Test helpers: a minimal in-process stand-in for the mesh that drives sync messages between
//! stores directly, and a model of the materialized view fed by the returned changes.
#![allow(dead_code)]

use dramesh_store::{DocId, ObjectChange, ObjectKey, ObjectKind, Store, StoreConfig, SyncState};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub(crate) type ViewModel = BTreeMap<(String, ObjectKey), Arc<[u8]>>;

pub(crate) fn apply_view(view: &mut ViewModel, changes: Vec<(String, ObjectChange)>) {
    for (cluster, c) in changes {
        match c {
            ObjectChange::Upsert { key, json } => {
                view.insert((cluster, key), json);
            }
            ObjectChange::Delete { key } => {
                view.remove(&(cluster, key));
            }
        }
    }
}

pub(crate) fn snapshot_view(store: &Store) -> ViewModel {
    let mut v = ViewModel::new();
    apply_view(&mut v, store.snapshot());
    v
}

pub(crate) fn node(name: &str) -> ObjectKey {
    ObjectKey {
        kind: ObjectKind::Node,
        namespace: None,
        name: name.to_string(),
    }
}

pub(crate) fn class(name: &str) -> ObjectKey {
    ObjectKey {
        kind: ObjectKind::DeviceClass,
        namespace: None,
        name: name.to_string(),
    }
}

pub(crate) fn upsert(key: ObjectKey, json: &str) -> ObjectChange {
    ObjectChange::Upsert {
        key,
        json: Arc::from(json.as_bytes()),
    }
}

pub(crate) fn test_config() -> StoreConfig {
    StoreConfig {
        durability: dramesh_store::Durability::None,
        ..StoreConfig::default()
    }
}

/// A store plus the view model built only from the changes its calls returned.
pub(crate) struct Peer {
    pub store: Store,
    pub view: ViewModel,
    /// Writers (agents) only publish their own documents.
    pub agent_of: Option<DocId>,
}

impl Peer {
    pub(crate) fn replica(store: Store) -> Peer {
        Peer {
            store,
            view: ViewModel::new(),
            agent_of: None,
        }
    }
}

/// Runs one sync session for every document either side should exchange, with at most
/// `max_rounds` message pairs per document (fewer than needed leaves sessions unfinished, like
/// a dropped connection). Returns the number of messages exchanged.
pub(crate) fn sync_pair(a: &mut Peer, b: &mut Peer, max_rounds: usize) -> usize {
    let mut docs: BTreeMap<DocId, u64> = BTreeMap::new();
    for p in [&*a, &*b] {
        for s in p.store.entries() {
            let g = docs.entry(s.doc.clone()).or_insert(0);
            *g = (*g).max(s.generation);
        }
    }
    let allowed: BTreeSet<DocId> = docs
        .keys()
        .filter(|d| {
            [&*a, &*b]
                .iter()
                .all(|p| p.agent_of.as_ref().is_none_or(|own| own == *d))
        })
        .cloned()
        .collect();
    let mut sent = 0;
    for (doc, generation) in docs {
        if !allowed.contains(&doc) {
            continue;
        }
        let mut sa = SyncState::new();
        let mut sb = SyncState::new();
        for _ in 0..max_rounds {
            let mut progressed = false;
            if let Some(m) = a
                .store
                .generate_sync_message(&doc, generation, &mut sa)
                .unwrap()
            {
                let out = b
                    .store
                    .receive_sync_message(&doc, generation, &mut sb, &m, &|_| true)
                    .unwrap();
                apply_view(&mut b.view, out);
                progressed = true;
                sent += 1;
            }
            if let Some(m) = b
                .store
                .generate_sync_message(&doc, generation, &mut sb)
                .unwrap()
            {
                let out = a
                    .store
                    .receive_sync_message(&doc, generation, &mut sa, &m, &|_| true)
                    .unwrap();
                apply_view(&mut a.view, out);
                progressed = true;
                sent += 1;
            }
            if !progressed {
                break;
            }
        }
    }
    sent
}
