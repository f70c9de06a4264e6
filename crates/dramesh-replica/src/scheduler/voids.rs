//! Which decisions' reservations are void, followed incrementally.
//!
//! A verdict ([`dramesh_scheduler::void`]) depends on the reservation, on whether it is old
//! enough to be judged, and on its binding as the watch cache holds it (and on the members
//! sharing the work, for orphans). So a reservation is judged when it becomes old enough, and
//! again only when its binding changes or everything may have (a relist, a change of members):
//! the loop's look every tick costs what changed, not every live decision (it cloned,
//! decoded and judged all of them, a quarter of a replica's scheduler threads in a 6,000
//! binding burst). Reservations come and go through the table's decision change log
//! ([`crate::reservation_table::Table::decision_changes`]).
//!
//! Guarantee: after [`Voids::judge`], the verdicts held are those that judging every
//! reservation of the creator, old enough at that time, would give, provided every binding
//! change since the last call was signalled ([`Voids::binding_changed`]) and so was any
//! other change of what the judge looks at ([`Voids::all_changed`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use dramesh_scheduler::void::Void;

use super::Key;
use crate::karmada::{Kind, ObjectKey};
use crate::reservation_table::{DecisionChanges, Entry};

/// What the judge says of one reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Judgement {
    /// Void, and why.
    pub(super) void: Option<Void>,
    /// The decision of a departed member, written, on a binding this replica owns now.
    pub(super) orphan: bool,
}

struct Known {
    entry: Arc<Entry>,
    key: Key,
    due: Instant,
    settled: bool,
}

/// The creator's decisions' reservations and their verdicts (see the module docs).
#[derive(Default)]
pub(super) struct Voids {
    creator: String,
    /// The table version read up to (`None`: nothing read yet).
    version: Option<u64>,
    known: HashMap<Arc<str>, Known>,
    /// Not yet old enough to be judged, by when they will be.
    waiting: BTreeSet<(Instant, Arc<str>)>,
    by_binding: HashMap<Key, BTreeSet<Arc<str>>>,
    /// Old enough, to be judged (again) at the next [`Voids::judge`].
    dirty: BTreeSet<Arc<str>>,
    /// The verdicts that are not "holds room, nobody's orphan".
    verdicts: BTreeMap<Arc<str>, Judgement>,
}

/// The binding a decision names; `None` for a kind this release does not schedule.
fn binding_key(e: &Entry) -> Option<Key> {
    let d = e.record.decision.as_ref()?;
    let kind = match d.kind.as_str() {
        "ResourceBinding" => Kind::ResourceBinding,
        "ClusterResourceBinding" => Kind::ClusterResourceBinding,
        _ => return None,
    };
    let namespace = (!d.namespace.is_empty()).then(|| d.namespace.clone());
    Some((
        kind,
        ObjectKey {
            namespace,
            name: d.name.clone(),
        },
    ))
}

impl Voids {
    /// Follows the reservations created by `creator` (the scheduler role's).
    pub(super) fn new(creator: String) -> Voids {
        Voids {
            creator,
            version: None,
            known: HashMap::new(),
            waiting: BTreeSet::new(),
            by_binding: HashMap::new(),
            dirty: BTreeSet::new(),
            verdicts: BTreeMap::new(),
        }
    }

    /// The table version to read changes after.
    pub(super) fn version(&self) -> Option<u64> {
        self.version
    }

    /// Takes in the table's changes (read with [`Voids::version`]).
    pub(super) fn follow(&mut self, (changes, version): (DecisionChanges, u64)) {
        match changes {
            DecisionChanges::All(all) => {
                self.known.clear();
                self.waiting.clear();
                self.by_binding.clear();
                self.dirty.clear();
                self.verdicts.clear();
                for e in all {
                    self.add(e);
                }
            }
            DecisionChanges::Since(changes) => {
                for (e, present) in changes {
                    if present {
                        self.add(e);
                    } else {
                        self.remove(&e.id);
                    }
                }
            }
        }
        self.version = Some(version);
    }

    fn add(&mut self, e: Arc<Entry>) {
        if e.record.creator != self.creator {
            return;
        }
        let (Some(key), Some(d)) = (binding_key(&e), e.record.decision.as_ref()) else {
            return;
        };
        self.remove(&e.id);
        let due = e.seen + d.void_after();
        let id = e.id.clone();
        self.waiting.insert((due, id.clone()));
        self.by_binding
            .entry(key.clone())
            .or_default()
            .insert(id.clone());
        self.known.insert(
            id,
            Known {
                entry: e,
                key,
                due,
                settled: false,
            },
        );
    }

    fn remove(&mut self, id: &Arc<str>) {
        let Some(k) = self.known.remove(id) else {
            return;
        };
        self.waiting.remove(&(k.due, id.clone()));
        if let Some(ids) = self.by_binding.get_mut(&k.key) {
            ids.remove(id);
            if ids.is_empty() {
                self.by_binding.remove(&k.key);
            }
        }
        self.dirty.remove(id);
        self.verdicts.remove(id);
    }

    /// The binding `key` changed (or is gone): its reservations are judged again.
    pub(super) fn binding_changed(&mut self, key: &Key) {
        for id in self.by_binding.get(key).into_iter().flatten() {
            if self.known.get(id).is_some_and(|k| k.settled) {
                self.dirty.insert(id.clone());
            }
        }
    }

    /// Anything may have changed: every reservation old enough is judged again.
    pub(super) fn all_changed(&mut self) {
        self.dirty.extend(
            self.known
                .iter()
                .filter(|(_, k)| k.settled)
                .map(|(id, _)| id.clone()),
        );
    }

    /// Judges, with `judge`, the reservations that became old enough by `now` and those
    /// whose binding changed.
    pub(super) fn judge(&mut self, now: Instant, mut judge: impl FnMut(&Entry, &Key) -> Judgement) {
        while let Some(first) = self.waiting.first().filter(|(due, _)| *due <= now).cloned() {
            self.waiting.remove(&first);
            if let Some(k) = self.known.get_mut(&first.1) {
                k.settled = true;
                self.dirty.insert(first.1);
            }
        }
        for id in std::mem::take(&mut self.dirty) {
            let Some(k) = self.known.get(&id) else {
                continue;
            };
            let j = judge(&k.entry, &k.key);
            if j == Judgement::default() {
                self.verdicts.remove(&id);
            } else {
                self.verdicts.insert(id, j);
            }
        }
    }

    /// The reservations judged void: each with its binding and why.
    pub(super) fn void(&self) -> impl Iterator<Item = (&Arc<Entry>, &Key, Void)> {
        self.verdicts.iter().filter_map(|(id, j)| {
            let k = self.known.get(id)?;
            Some((&k.entry, &k.key, j.void?))
        })
    }

    /// The reservations judged orphans, with their bindings.
    pub(super) fn orphans(&self) -> Vec<(Key, Arc<Entry>)> {
        self.verdicts
            .iter()
            .filter(|(_, j)| j.orphan)
            .filter_map(|(id, _)| self.known.get(id))
            .map(|k| (k.key.clone(), k.entry.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use dramesh_api::native::WorkloadRef;
    use dramesh_model::ObjectChange;
    use dramesh_scheduler::void::DecisionRef;
    use dramesh_testkit::Lcg;

    use super::*;
    use crate::reservation_table::{self as resv, Record, Table};

    const CREATOR: &str = "scheduler/dramesh";

    fn record(id: &str, creator: &str, binding: &str) -> Record {
        Record {
            id: id.into(),
            owner: "r1".into(),
            creator: creator.into(),
            cluster: "c".into(),
            workload: WorkloadRef {
                namespace: "ml".into(),
                kind: "Deployment".into(),
                name: binding.into(),
            },
            manifests: vec![],
            replicas: 1,
            priority: 0,
            ttl_seconds: 300,
            bound_at_creation: 0,
            preemptor: None,
            caps: None,
            decision: Some(DecisionRef {
                kind: "ResourceBinding".into(),
                namespace: "ml".into(),
                name: binding.into(),
                uid: String::new(),
                generation: 1,
                target: 1,
                settle_ms: 500,
            }),
        }
    }

    fn put(t: &mut Table, r: &Record, at: Instant) {
        let change = ObjectChange::Upsert {
            key: resv::record_key(&r.id),
            json: Arc::from(serde_json::to_vec(r).unwrap().as_slice()),
        };
        t.apply(&change, at, &mut |_| Err("no manifests".into()));
    }

    fn delete(t: &mut Table, id: &str, at: Instant) {
        let change = ObjectChange::Delete {
            key: resv::record_key(id),
        };
        t.apply(&change, at, &mut |_| Err("no manifests".into()));
    }

    fn key(binding: &str) -> Key {
        (
            Kind::ResourceBinding,
            ObjectKey {
                namespace: Some("ml".into()),
                name: binding.into(),
            },
        )
    }

    fn ids(v: &Voids) -> Vec<String> {
        v.void().map(|(e, _, _)| e.id.to_string()).collect()
    }

    #[test]
    fn judged_once_old_enough_and_again_only_when_its_binding_changes() {
        let t0 = Instant::now();
        let mut t = Table::new("r1");
        let mut v = Voids::new(CREATOR.into());
        put(&mut t, &record("r1-1", CREATOR, "a"), t0);
        put(&mut t, &record("r1-2", "someone-else", "a"), t0);
        v.follow(t.decision_changes(v.version()));
        let mut judged: Vec<String> = Vec::new();
        let mut judge = |at: Instant, v: &mut Voids, void: bool| {
            v.judge(at, |e, _| {
                judged.push(e.id.to_string());
                Judgement {
                    void: void.then_some(Void::Deleted),
                    orphan: false,
                }
            });
        };
        let after = Duration::from_millis(500) + dramesh_scheduler::void::VOID_GRACE;
        judge(t0 + after - Duration::from_millis(1), &mut v, true);
        assert!(ids(&v).is_empty(), "judged before it was old enough");
        judge(t0 + after, &mut v, true);
        assert_eq!(
            ids(&v),
            ["r1-1"],
            "another creator's decision is not followed"
        );
        judge(t0 + after * 2, &mut v, false);
        assert_eq!(ids(&v), ["r1-1"], "judged again without a change");
        v.binding_changed(&key("b"));
        judge(t0 + after * 2, &mut v, false);
        assert_eq!(
            ids(&v),
            ["r1-1"],
            "another binding's change judged it again"
        );
        v.binding_changed(&key("a"));
        judge(t0 + after * 2, &mut v, false);
        assert!(ids(&v).is_empty(), "its binding's change was not judged");
        v.all_changed();
        judge(t0 + after * 2, &mut v, true);
        assert_eq!(ids(&v), ["r1-1"]);
        delete(&mut t, "r1-1", t0 + after * 2);
        v.follow(t.decision_changes(v.version()));
        assert!(
            ids(&v).is_empty(),
            "a removed reservation keeps its verdict"
        );
        assert_eq!(
            judged, ["r1-1"; 3],
            "judged when old enough, on its binding's change and on all"
        );
    }

    #[test]
    fn a_reader_too_far_behind_reads_everything_again() {
        let t0 = Instant::now();
        let mut t = Table::new("r1");
        let mut v = Voids::new(CREATOR.into());
        v.follow(t.decision_changes(v.version()));
        for i in 0..resv::MAX_DECISION_CHANGES + 10 {
            put(&mut t, &record(&format!("r1-{i}"), CREATOR, "a"), t0);
        }
        delete(&mut t, "r1-3", t0);
        let (changes, _) = t.decision_changes(v.version());
        let DecisionChanges::All(all) = &changes else {
            panic!("a reader behind the dropped changes was given only the rest");
        };
        assert_eq!(all.len(), resv::MAX_DECISION_CHANGES + 9);
        put(&mut t, &record("r1-new", CREATOR, "a"), t0);
        delete(&mut t, "r1-4", t0);
        let (changes, _) = t.decision_changes(Some(t.version - 2));
        let DecisionChanges::Since(since) = changes else {
            panic!("a reader up to date read everything");
        };
        let seen: Vec<(String, bool)> = since.iter().map(|(e, p)| (e.id.to_string(), *p)).collect();
        assert_eq!(
            seen,
            [("r1-new".to_string(), true), ("r1-4".to_string(), false)]
        );
    }

    /// Random reservations, binding changes and time: the followed verdicts always equal
    /// judging every old-enough reservation afresh.
    #[test]
    fn followed_verdicts_equal_judging_everything_afresh() {
        let t0 = Instant::now();
        let after = Duration::from_millis(500) + dramesh_scheduler::void::VOID_GRACE;
        for seed in 1..=20 {
            let mut rng = Lcg(seed);
            let mut t = Table::new("r1");
            let mut v = Voids::new(CREATOR.into());
            // Per binding, whether it voids its decisions now.
            let mut bindings: HashMap<String, bool> = HashMap::new();
            let mut now = t0;
            let mut next = 0;
            for _ in 0..400 {
                match rng.next(6) {
                    0 | 1 => {
                        let b = format!("b{}", rng.next(8));
                        let creator = if rng.next(4) == 0 { "other" } else { CREATOR };
                        put(&mut t, &record(&format!("r1-{next}"), creator, &b), now);
                        next += 1;
                    }
                    2 => {
                        let id = format!("r1-{}", rng.next(next.max(1)));
                        delete(&mut t, &id, now);
                    }
                    3 => {
                        let b = format!("b{}", rng.next(8));
                        let void = rng.next(2) == 0;
                        if bindings.insert(b.clone(), void) != Some(void) {
                            v.binding_changed(&key(&b));
                        }
                    }
                    _ => now += Duration::from_millis(rng.next(600)),
                }
                if rng.next(3) == 0 {
                    let judge = |_: &Entry, k: &Key| Judgement {
                        void: bindings
                            .get(&k.1.name)
                            .copied()
                            .unwrap_or(false)
                            .then_some(Void::MovedOn),
                        orphan: false,
                    };
                    v.follow(t.decision_changes(v.version()));
                    v.judge(now, judge);
                    let mut expected: Vec<String> = t
                        .entries()
                        .map(|(_, e)| e)
                        .filter(|e| e.record.creator == CREATOR)
                        .filter(|e| now.saturating_duration_since(e.seen) >= after)
                        .filter(|e| bindings.get(&e.record.workload.name) == Some(&true))
                        .map(|e| e.id.to_string())
                        .collect();
                    expected.sort();
                    let mut got = ids(&v);
                    got.sort();
                    assert_eq!(got, expected, "seed {seed}");
                }
            }
        }
    }
}
