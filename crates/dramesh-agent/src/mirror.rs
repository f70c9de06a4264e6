//! What one watch has published, and the changes each watch event implies.
//!
//! A watch stream restarts with `Init`, a run of `InitApply`, then `InitDone` whenever the
//! watcher re-lists (first start, `410 Gone`, a failed resume). Objects deleted while the
//! watch was broken never get a `Delete` event; they are simply missing from the re-list.
//! [`Mirror`] buffers the re-list and, at `InitDone`, diffs it against what was published, so
//! such objects are deleted downstream. Between re-lists it turns `Apply`/`Delete` into
//! upserts and deletes, suppressing ones that do not change the published JSON.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use dramesh_model::{ObjectChange, ObjectKey};

use crate::trim::{Owner, Record};

/// One watch event, with the object already trimmed into a [`Record`].
#[derive(Debug, Clone)]
pub enum MirrorEvent {
    /// A (re)list started.
    Init,
    /// One object of the list.
    InitApply(Record),
    /// The list is complete.
    InitDone,
    /// An object was added or changed.
    Apply(Record),
    /// An object was deleted.
    Delete(ObjectKey),
}

type Entry = (ObjectKey, (Owner, Arc<[u8]>));
type Published = HashMap<ObjectKey, (Owner, Arc<[u8]>)>;

/// The published state of one watch.
#[derive(Debug, Default)]
pub struct Mirror {
    /// When set, records owned by other nodes are ignored (a node agent watching all claims).
    own_node: Option<String>,
    published: Published,
    relist: Option<Published>,
    synced: bool,
}

impl Mirror {
    /// A mirror that keeps node-owned records only for `own_node` (and all cluster-owned
    /// ones); `None` keeps every record.
    pub fn new(own_node: Option<String>) -> Mirror {
        Mirror {
            own_node,
            ..Default::default()
        }
    }

    /// Whether the watch has completed a list since it started.
    pub fn synced(&self) -> bool {
        self.synced
    }

    fn kept(&self, r: Record) -> Option<Entry> {
        let owner = r.owner?;
        if let (Owner::Node(n), Some(own)) = (&owner, &self.own_node)
            && n != own
        {
            return None;
        }
        Some((r.key, (owner, r.json)))
    }

    /// Applies one event; returns the changes to publish, each with its owner.
    pub fn apply(&mut self, ev: MirrorEvent) -> Vec<(Owner, ObjectChange)> {
        match ev {
            MirrorEvent::Init => {
                self.relist = Some(Published::new());
                Vec::new()
            }
            MirrorEvent::InitApply(r) => {
                let key = r.key.clone();
                let kept = self.kept(r);
                let buf = self.relist.get_or_insert_with(Published::new);
                match kept {
                    Some((k, v)) => {
                        buf.insert(k, v);
                    }
                    None => {
                        buf.remove(&key);
                    }
                }
                Vec::new()
            }
            MirrorEvent::InitDone => {
                let new = self.relist.take().unwrap_or_default();
                let out = diff_owned(&self.published, &new);
                self.published = new;
                self.synced = true;
                out
            }
            MirrorEvent::Apply(r) => {
                let key = r.key.clone();
                match self.kept(r) {
                    Some((k, v)) => self.set(k, v),
                    None => self.remove(&key),
                }
            }
            MirrorEvent::Delete(key) => self.remove(&key),
        }
    }

    fn set(&mut self, key: ObjectKey, v: (Owner, Arc<[u8]>)) -> Vec<(Owner, ObjectChange)> {
        let mut out = Vec::new();
        match self.published.get(&key) {
            Some((o, j)) if *o == v.0 && *j == v.1 => return out,
            Some((o, _)) if *o != v.0 => {
                out.push((o.clone(), ObjectChange::Delete { key: key.clone() }))
            }
            _ => {}
        }
        out.push((
            v.0.clone(),
            ObjectChange::Upsert {
                key: key.clone(),
                json: v.1.clone(),
            },
        ));
        self.published.insert(key, v);
        out
    }

    fn remove(&mut self, key: &ObjectKey) -> Vec<(Owner, ObjectChange)> {
        match self.published.remove(key) {
            Some((o, _)) => vec![(o, ObjectChange::Delete { key: key.clone() })],
            None => Vec::new(),
        }
    }

    /// Every published record of `owner`, as upserts (for snapshots).
    pub fn upserts_of(&self, owner: &Owner) -> Vec<ObjectChange> {
        self.published
            .iter()
            .filter(|(_, (o, _))| o == owner)
            .map(|(k, (_, j))| ObjectChange::Upsert {
                key: k.clone(),
                json: j.clone(),
            })
            .collect()
    }
}

/// Changes that turn `old` into `new`, each with the owner it is published under.
pub fn diff_owned(old: &Published, new: &Published) -> Vec<(Owner, ObjectChange)> {
    let mut out = Vec::new();
    for (k, (o, _)) in old {
        match new.get(k) {
            Some((no, _)) if no == o => {}
            _ => out.push((o.clone(), ObjectChange::Delete { key: k.clone() })),
        }
    }
    for (k, (o, j)) in new {
        if old.get(k).is_some_and(|(oo, oj)| oo == o && oj == j) {
            continue;
        }
        out.push((
            o.clone(),
            ObjectChange::Upsert {
                key: k.clone(),
                json: j.clone(),
            },
        ));
    }
    out
}

/// Changes that turn `old` into `new` (one owner): upserts for new or changed JSON, deletes
/// for keys gone. Output is in key order.
pub fn diff_states(
    old: &BTreeMap<ObjectKey, Arc<[u8]>>,
    new: &BTreeMap<ObjectKey, Arc<[u8]>>,
) -> Vec<ObjectChange> {
    let mut out = Vec::new();
    for k in old.keys() {
        if !new.contains_key(k) {
            out.push(ObjectChange::Delete { key: k.clone() });
        }
    }
    for (k, j) in new {
        if old.get(k) != Some(j) {
            out.push(ObjectChange::Upsert {
                key: k.clone(),
                json: j.clone(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::ObjectKind;

    fn rec(name: &str, owner: Option<Owner>, json: &str) -> Record {
        Record {
            key: ObjectKey::new(ObjectKind::ResourceClaim, Some("ns"), name),
            owner,
            json: json.as_bytes().into(),
        }
    }
    fn n(x: &str) -> Option<Owner> {
        Some(Owner::Node(x.into()))
    }
    fn summary(v: &[(Owner, ObjectChange)]) -> Vec<String> {
        let mut s: Vec<String> = v
            .iter()
            .map(|(o, c)| match c {
                ObjectChange::Upsert { key, json } => {
                    format!("{o:?} up {} {}", key.name, String::from_utf8_lossy(json))
                }
                ObjectChange::Delete { key } => format!("{o:?} del {}", key.name),
            })
            .collect();
        s.sort();
        s
    }

    #[test]
    fn relist_deletes_objects_missing_from_it() {
        let mut m = Mirror::new(None);
        m.apply(MirrorEvent::Init);
        m.apply(MirrorEvent::InitApply(rec("a", n("n1"), "1")));
        m.apply(MirrorEvent::InitApply(rec("b", n("n1"), "1")));
        assert!(!m.synced());
        let first = m.apply(MirrorEvent::InitDone);
        assert!(m.synced());
        assert_eq!(
            summary(&first),
            ["Node(\"n1\") up a 1", "Node(\"n1\") up b 1"]
        );
        // Watch broke; b was deleted and a modified meanwhile; the re-list shows it.
        m.apply(MirrorEvent::Init);
        m.apply(MirrorEvent::InitApply(rec("a", n("n1"), "2")));
        let out = m.apply(MirrorEvent::InitDone);
        assert_eq!(summary(&out), ["Node(\"n1\") del b", "Node(\"n1\") up a 2"]);
    }

    #[test]
    fn unchanged_applies_are_suppressed() {
        let mut m = Mirror::new(None);
        assert_eq!(m.apply(MirrorEvent::Apply(rec("a", n("n1"), "1"))).len(), 1);
        assert!(
            m.apply(MirrorEvent::Apply(rec("a", n("n1"), "1")))
                .is_empty()
        );
        assert_eq!(m.apply(MirrorEvent::Apply(rec("a", n("n1"), "2"))).len(), 1);
    }

    #[test]
    fn owner_change_deletes_from_old_scope() {
        let mut m = Mirror::new(None);
        m.apply(MirrorEvent::Apply(rec("a", n("n1"), "1")));
        let out = m.apply(MirrorEvent::Apply(rec("a", Some(Owner::Cluster), "2")));
        assert_eq!(summary(&out), ["Cluster up a 2", "Node(\"n1\") del a"]);
        // Losing the owner (e.g. deallocated) deletes it.
        let out = m.apply(MirrorEvent::Apply(rec("a", None, "3")));
        assert_eq!(summary(&out), ["Cluster del a"]);
        assert!(
            m.apply(MirrorEvent::Delete(rec("a", None, "").key))
                .is_empty()
        );
    }

    #[test]
    fn other_nodes_records_are_ignored() {
        let mut m = Mirror::new(Some("n1".into()));
        assert!(
            m.apply(MirrorEvent::Apply(rec("x", n("n2"), "1")))
                .is_empty()
        );
        assert_eq!(m.apply(MirrorEvent::Apply(rec("y", n("n1"), "1"))).len(), 1);
        assert_eq!(
            m.apply(MirrorEvent::Apply(rec("z", Some(Owner::Cluster), "1")))
                .len(),
            1
        );
        // A claim re-allocated to another node leaves this node's scope.
        let out = m.apply(MirrorEvent::Apply(rec("y", n("n2"), "2")));
        assert_eq!(summary(&out), ["Node(\"n1\") del y"]);
        assert_eq!(m.upserts_of(&Owner::Cluster).len(), 1);
        assert!(m.upserts_of(&Owner::Node("n1".into())).is_empty());
    }

    #[test]
    fn interrupted_relist_starts_over() {
        let mut m = Mirror::new(None);
        m.apply(MirrorEvent::Init);
        m.apply(MirrorEvent::InitApply(rec("a", n("n1"), "1")));
        m.apply(MirrorEvent::Init);
        m.apply(MirrorEvent::InitApply(rec("b", n("n1"), "1")));
        let out = m.apply(MirrorEvent::InitDone);
        assert_eq!(summary(&out), ["Node(\"n1\") up b 1"]);
    }

    #[test]
    fn diff_states_reports_changes_in_key_order() {
        let k = |n: &str| ObjectKey::new(ObjectKind::Node, None, n);
        let old: BTreeMap<_, Arc<[u8]>> =
            [(k("a"), b"1"[..].into()), (k("b"), b"1"[..].into())].into();
        let new: BTreeMap<_, Arc<[u8]>> =
            [(k("b"), b"2"[..].into()), (k("c"), b"1"[..].into())].into();
        let out = diff_states(&old, &new);
        let s: Vec<_> = out
            .iter()
            .map(|c| match c {
                ObjectChange::Upsert { key, .. } => format!("up {}", key.name),
                ObjectChange::Delete { key } => format!("del {}", key.name),
            })
            .collect();
        assert_eq!(s, ["del a", "up b", "up c"]);
        assert!(diff_states(&new, &new).is_empty());
    }
}
