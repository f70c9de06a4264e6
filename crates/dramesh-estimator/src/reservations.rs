//! Overcommit resolution of in-flight reservations.
//!
//! Several scheduler replicas may reserve the same free capacity at the same moment; once
//! their reservations have been merged every replica must decide, on its own and identically,
//! which of them hold capacity. [`resolve`] is that decision, a pure function of the view and
//! the set of live reservations:
//!
//! 1. Reservations are grouped by cluster and ranked by [`rank`]: higher priority first, then
//!    the smaller reservation id (ids are unique, so the order is total).
//! 2. Walking that order, a reservation is **admitted** when the cluster's estimate of its
//!    workload, with every reservation admitted before it deducted (as Karmada assumed
//!    workloads: first-fit over nodes in name order), still fits all of its replicas. An
//!    admitted reservation is deducted from every later check and from estimates.
//! 3. Every other reservation is **conflicted**: it holds nothing, and names the
//!    highest-ranked admitted reservation of its cluster as the winner.
//!
//! Guarantees: the result does not depend on the order of the input slice, and two replicas
//! whose views and reservation sets are equal compute equal results (the estimator is
//! deterministic). A reservation is all or nothing: one that fits only partly is conflicted.
//! Deductions are by resource requests and pod slots (cpu, memory, extended resources such
//! as `nvidia.com/gpu`, pods), the same model as Karmada assumed workloads, and by DRA
//! devices: each reserved replica of a workload with claims holds its own allocation of the
//! workload's ResourceClaimTemplates (and its shared claims once), placed first-fit as the
//! estimator counts device fit (see [`crate::estimate::AssumedWorkload`]).

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::assumed::AssumedWorkload;
use crate::estimate::{EstimateOptions, Estimator};
use crate::view::View;
use crate::workload::Workload;

/// One live reservation, as resolution needs it.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// Unique id; the tiebreak between equal priorities.
    pub id: String,
    /// Member cluster the capacity is reserved in.
    pub cluster: String,
    /// Priority of the reserved workload.
    pub priority: i32,
    /// Replicas still to be held: the reserved replicas minus those the member cluster
    /// already reports bound. Zero holds nothing and is always admitted.
    pub replicas: i64,
    /// The per-replica requirements.
    pub workload: Arc<Workload>,
}

/// The outcome for one reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Holds its replicas: deducted from estimates.
    Admitted,
    /// Holds nothing: it did not fit after the higher-ranked admitted reservations.
    Conflicted {
        /// The highest-ranked admitted reservation of the same cluster, if any.
        winner: Option<String>,
        /// Replicas that were still available to it.
        available: i64,
        /// Why it could not be checked at all (unknown cluster, estimator error).
        reason: Option<String>,
    },
}

/// The result of [`resolve`].
#[derive(Debug, Clone, Default)]
pub struct Resolution {
    /// The outcome of every live reservation, by id.
    pub admissions: BTreeMap<String, Admission>,
    /// The admitted reservations as estimator deductions, in rank order per cluster.
    pub assumed: Vec<AssumedWorkload>,
    /// The id of each entry of `assumed` (same order), so a caller can leave one out.
    pub assumed_ids: Vec<String>,
    /// What was resolved, per cluster in rank order: (id, priority, replicas).
    pub ranked: Vec<(String, i32, i64)>,
}

impl Resolution {
    /// The outcome of one reservation.
    pub fn admission(&self, id: &str) -> Option<&Admission> {
        self.admissions.get(id)
    }
}

/// The resolution order: priority descending, then id ascending.
pub(crate) fn rank(a: &Reservation, b: &Reservation) -> Ordering {
    b.priority.cmp(&a.priority).then_with(|| a.id.cmp(&b.id))
}

/// Decides which reservations hold capacity (see the module docs).
pub fn resolve(view: &View, estimator: &mut Estimator, reservations: &[Reservation]) -> Resolution {
    let mut by_cluster: BTreeMap<&str, Vec<Reservation>> = BTreeMap::new();
    for r in reservations {
        by_cluster
            .entry(r.cluster.as_str())
            .or_default()
            .push(r.clone());
    }
    let mut out = Resolution::default();
    for (cluster, list) in by_cluster {
        let part = resolve_cluster(view, estimator, cluster, &list, None);
        out.admissions.extend(part.admissions);
        out.assumed.extend(part.assumed);
        out.assumed_ids.extend(part.assumed_ids);
        out.ranked.extend(part.ranked);
    }
    out
}

/// [`resolve`] of the reservations of one cluster, reusing `previous`, an earlier result
/// of this function for the same cluster on the same view of it: the reservations ranked
/// before the first difference between the two rankings keep their outcomes (an outcome
/// depends only on the reservations ranked before it), and only the rest are checked.
pub fn resolve_cluster(
    view: &View,
    estimator: &mut Estimator,
    cluster: &str,
    reservations: &[Reservation],
    previous: Option<&Resolution>,
) -> Resolution {
    let mut list: Vec<&Reservation> = reservations
        .iter()
        .filter(|r| r.cluster == cluster)
        .collect();
    list.sort_by(|a, b| rank(a, b));
    let ranked: Vec<(String, i32, i64)> = list
        .iter()
        .map(|r| (r.id.clone(), r.priority, r.replicas))
        .collect();
    let mut out = Resolution::default();
    let mut first_winner: Option<String> = None;
    let mut kept = 0;
    if let Some(p) = previous {
        kept = p
            .ranked
            .iter()
            .zip(&ranked)
            .take_while(|(a, b)| a == b)
            .count();
        for (id, _, _) in &p.ranked[..kept] {
            if let Some(a) = p.admissions.get(id) {
                out.admissions.insert(id.clone(), a.clone());
            }
        }
        // `assumed` is in rank order: the admitted ones among the kept come first.
        for (a, id) in p.assumed.iter().zip(&p.assumed_ids) {
            if !matches!(out.admissions.get(id), Some(Admission::Admitted)) {
                break;
            }
            out.assumed.push(a.clone());
            out.assumed_ids.push(id.clone());
        }
        first_winner = out.assumed_ids.first().cloned();
    }
    for r in &list[kept..] {
        if r.replicas <= 0 {
            out.admissions.insert(r.id.clone(), Admission::Admitted);
            continue;
        }
        let opts = EstimateOptions {
            assumed: out.assumed.clone().into(),
            clusters: vec![cluster.to_string()],
            ..EstimateOptions::default()
        };
        let est = estimator.estimate(view, &r.workload, &opts);
        let (available, reason) = match est.cluster(cluster) {
            None => (0, Some(format!("cluster {cluster} is not in the view"))),
            Some(c) => match &c.error {
                Some(e) => (0, Some(e.clone())),
                None => (c.max_replicas, None),
            },
        };
        if reason.is_none() && available >= r.replicas {
            out.assumed.push(AssumedWorkload::from_workload(
                cluster,
                &r.workload,
                r.replicas,
            ));
            out.assumed_ids.push(r.id.clone());
            first_winner.get_or_insert_with(|| r.id.clone());
            out.admissions.insert(r.id.clone(), Admission::Admitted);
        } else {
            out.admissions.insert(
                r.id.clone(),
                Admission::Conflicted {
                    winner: first_winner.clone(),
                    available,
                    reason,
                },
            );
        }
    }
    out.ranked = ranked;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::load::load_str;
    use dramesh_model::{Manifest, ObjectChange};
    use std::path::Path;

    /// One cluster `c` with two nodes of 4 GPUs (extended resource) each.
    fn view() -> View {
        let mut v = View::new();
        for n in ["n1", "n2"] {
            let yaml = format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: {n}}}\nstatus: {{allocatable: {{cpu: '64', memory: 256Gi, pods: '110', nvidia.com/gpu: '4'}}}}\n"
            );
            for l in load_str(Path::new("node.yaml"), &yaml).unwrap() {
                let Manifest::Object(o) = l.manifest else {
                    panic!("not an object")
                };
                v.apply("c", &ObjectChange::upsert(&o)).unwrap();
            }
        }
        v
    }

    fn workload(name: &str, gpus: u32) -> Arc<Workload> {
        let yaml = format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}, namespace: ml}}\nspec:\n  replicas: 1\n  selector: {{matchLabels: {{app: {name}}}}}\n  template:\n    metadata: {{labels: {{app: {name}}}}}\n    spec:\n      containers:\n      - name: c\n        resources: {{requests: {{cpu: '1', nvidia.com/gpu: '{gpus}'}}, limits: {{nvidia.com/gpu: '{gpus}'}}}}\n"
        );
        let ms: Vec<Manifest> = load_str(Path::new("w.yaml"), &yaml)
            .unwrap()
            .into_iter()
            .map(|l| l.manifest)
            .collect();
        Arc::new(Workload::from_manifests(&ms).unwrap())
    }

    fn res(id: &str, priority: i32, replicas: i64, w: &Arc<Workload>) -> Reservation {
        Reservation {
            id: id.into(),
            cluster: "c".into(),
            priority,
            replicas,
            workload: w.clone(),
        }
    }

    fn gpus_left(v: &View, r: &Resolution) -> i64 {
        let one = workload("probe", 1);
        let opts = EstimateOptions {
            assumed: r.assumed.clone().into(),
            ..EstimateOptions::default()
        };
        Estimator::new().estimate(v, &one, &opts).total
    }

    /// One cluster `c` with two nodes of 4 DRA GPUs each (no `nvidia.com/gpu`).
    fn dra_view() -> View {
        let spec = dramesh_sim::typed::FleetSpec {
            clusters: 1,
            nodes_per_cluster: 2,
            gpus_per_node: 4,
            owners_per_cluster: 1,
            kubernetes_version: "1.36".into(),
        };
        let mut v = View::new();
        dramesh_sim::typed::cluster_objects(&spec, 0, &|_| 0, |o| {
            v.apply_object("c", o).unwrap();
        });
        v
    }

    /// A workload whose replicas each claim `gpus` DRA GPUs through a ResourceClaimTemplate.
    fn dra_workload(name: &str, gpus: i64) -> Arc<Workload> {
        let tpl: dramesh_model::k8s::ResourceClaimTemplate =
            serde_json::from_value(serde_json::json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "gpu", "namespace": "ml"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": dramesh_sim::typed::CLASS, "count": gpus}}]}}}
            }))
            .unwrap();
        let templates = std::collections::HashMap::from([(
            ("ml".to_string(), "gpu".to_string()),
            Arc::new(tpl),
        )]);
        let spec = serde_json::json!({
            "containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
        });
        Arc::new(
            Workload::from_pod_spec(
                "Deployment",
                "ml",
                name,
                1,
                serde_json::from_value(spec).unwrap(),
                &templates,
            )
            .unwrap(),
        )
    }

    fn dra_gpus_left(v: &View, r: &Resolution) -> i64 {
        let opts = EstimateOptions {
            assumed: r.assumed.clone().into(),
            ..EstimateOptions::default()
        };
        Estimator::new()
            .estimate(v, &dra_workload("probe", 1), &opts)
            .total
    }

    /// Resolving a cluster again from its previous resolution, as reservations arrive,
    /// change and end anywhere in the ranking, gives what resolving from nothing gives.
    #[test]
    fn resolving_from_the_previous_resolution_equals_resolving_afresh() {
        let spec = dramesh_sim::typed::FleetSpec {
            clusters: 1,
            nodes_per_cluster: 6,
            gpus_per_node: 4,
            owners_per_cluster: 1,
            kubernetes_version: "1.36".into(),
        };
        let mut v = View::new();
        dramesh_sim::typed::cluster_objects(&spec, 0, &|n| n % 3, |o| {
            v.apply_object("c", o).unwrap();
        });
        let shapes = [dra_workload("one", 1), dra_workload("two", 2)];
        let mut seed = 12345u64;
        let mut next = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        let mut live: Vec<Reservation> = Vec::new();
        let mut est = Estimator::new();
        let mut previous: Option<Resolution> = None;
        let (mut conflicted, mut reused) = (0, 0);
        for step in 0..60 {
            match next(6) {
                0 if !live.is_empty() => {
                    let i = next(live.len() as u64) as usize;
                    live.remove(i);
                }
                1 if !live.is_empty() => {
                    let i = next(live.len() as u64) as usize;
                    live[i].replicas = next(3) as i64;
                }
                _ => {
                    let mut r = res(
                        &format!("r{:04}", next(10_000)),
                        next(3) as i32,
                        1 + next(4) as i64,
                        &shapes[next(2) as usize],
                    );
                    r.cluster = "c".into();
                    live.push(r);
                }
            }
            let fresh = resolve_cluster(&v, &mut Estimator::new(), "c", &live, None);
            let again = resolve_cluster(&v, &mut est, "c", &live, previous.as_ref());
            assert_eq!(again.admissions, fresh.admissions, "step {step}");
            assert_eq!(again.assumed_ids, fresh.assumed_ids, "step {step}");
            assert_eq!(again.ranked, fresh.ranked, "step {step}");
            assert_eq!(dra_gpus_left(&v, &again), dra_gpus_left(&v, &fresh));
            let whole = resolve(&v, &mut Estimator::new(), &live);
            assert_eq!(whole.admissions, fresh.admissions, "step {step}");
            if let Some(p) = &previous {
                reused += p
                    .ranked
                    .iter()
                    .zip(&fresh.ranked)
                    .take_while(|(a, b)| a == b)
                    .count();
            }
            conflicted += fresh
                .admissions
                .values()
                .filter(|a| matches!(a, Admission::Conflicted { .. }))
                .count();
            previous = Some(again);
        }
        assert!(conflicted > 0, "the fleet should run out of GPUs");
        assert!(reused > 100, "most steps should reuse a prefix ({reused})");
    }

    #[test]
    fn dra_reservations_hold_devices_and_priority_decides() {
        let v = dra_view();
        let w = dra_workload("w", 1);
        // Both want the last 8 GPUs; the higher priority one wins whatever the ids.
        let input = [res("a", 100, 8, &w), res("b", 200, 8, &w)];
        for order in [input.to_vec(), input.iter().rev().cloned().collect()] {
            let r = resolve(&v, &mut Estimator::new(), &order);
            assert_eq!(r.admission("b"), Some(&Admission::Admitted));
            assert_eq!(
                r.admission("a"),
                Some(&Admission::Conflicted {
                    winner: Some("b".into()),
                    available: 0,
                    reason: None
                })
            );
            assert!(r.assumed.iter().all(|a| a.claims.is_some()));
            assert_eq!(dra_gpus_left(&v, &r), 0);
        }
        // 8 against 6: the 6 win by priority, the 8 see the 2 left.
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[res("big", 100, 8, &w), res("small", 200, 6, &w)],
        );
        assert_eq!(r.admission("small"), Some(&Admission::Admitted));
        assert_eq!(
            r.admission("big"),
            Some(&Admission::Conflicted {
                winner: Some("small".into()),
                available: 2,
                reason: None
            })
        );
        assert_eq!(dra_gpus_left(&v, &r), 2);
        // Devices per replica count: 3 x 2 GPUs leave 2, so 2 x 1 GPU still fit.
        let two = dra_workload("two", 2);
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[res("x", 0, 3, &two), res("y", 0, 3, &w), res("z", 0, 2, &w)],
        );
        assert_eq!(r.admission("x"), Some(&Admission::Admitted));
        assert!(matches!(
            r.admission("y"),
            Some(Admission::Conflicted { winner: Some(win), available: 2, .. }) if win == "x"
        ));
        assert_eq!(r.admission("z"), Some(&Admission::Admitted));
        assert_eq!(dra_gpus_left(&v, &r), 0);
    }

    #[test]
    fn equal_priority_is_decided_by_id_whatever_the_input_order() {
        let v = view();
        let w = workload("w", 1);
        let a = res("r1-1", 0, 8, &w);
        let b = res("r2-1", 0, 8, &w);
        for input in [vec![a.clone(), b.clone()], vec![b.clone(), a.clone()]] {
            let r = resolve(&v, &mut Estimator::new(), &input);
            assert_eq!(r.admission("r1-1"), Some(&Admission::Admitted));
            assert_eq!(
                r.admission("r2-1"),
                Some(&Admission::Conflicted {
                    winner: Some("r1-1".into()),
                    available: 0,
                    reason: None
                })
            );
            assert_eq!(gpus_left(&v, &r), 0);
        }
    }

    #[test]
    fn priority_beats_id_and_the_loser_is_not_deducted() {
        let v = view();
        let w = workload("w", 1);
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[res("a", 100, 8, &w), res("b", 200, 6, &w)],
        );
        assert_eq!(r.admission("b"), Some(&Admission::Admitted));
        assert_eq!(
            r.admission("a"),
            Some(&Admission::Conflicted {
                winner: Some("b".into()),
                available: 2,
                reason: None
            })
        );
        assert_eq!(gpus_left(&v, &r), 2);
        // Only the admitted one is deducted, and it is named.
        assert_eq!(r.assumed_ids, ["b"]);
        assert_eq!(r.assumed.len(), 1);
    }

    #[test]
    fn partial_fit_is_a_conflict_but_later_smaller_ones_still_fit() {
        let v = view();
        let two = workload("two", 2);
        let one = workload("one", 1);
        // 8 GPUs: "a" takes 3 × 2 = 6; "b" wants 2 × 2 = 4 (only 2 left): conflicted;
        // "c" wants 2 × 1 = 2: admitted.
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[
                res("a", 0, 3, &two),
                res("b", 0, 2, &two),
                res("c", 0, 2, &one),
            ],
        );
        assert_eq!(r.admission("a"), Some(&Admission::Admitted));
        assert!(matches!(
            r.admission("b"),
            Some(Admission::Conflicted { winner: Some(w), available: 1, .. }) if w == "a"
        ));
        assert_eq!(r.admission("c"), Some(&Admission::Admitted));
        assert_eq!(gpus_left(&v, &r), 0);
    }

    #[test]
    fn satisfied_reservations_hold_nothing_and_unknown_clusters_conflict() {
        let v = view();
        let w = workload("w", 1);
        let mut gone = res("x", 0, 0, &w);
        gone.replicas = 0;
        let mut elsewhere = res("y", 0, 1, &w);
        elsewhere.cluster = "nowhere".into();
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[gone, elsewhere, res("z", 0, 3, &w)],
        );
        assert_eq!(r.admission("x"), Some(&Admission::Admitted));
        assert_eq!(r.admission("z"), Some(&Admission::Admitted));
        assert!(matches!(
            r.admission("y"),
            Some(Admission::Conflicted {
                reason: Some(_),
                ..
            })
        ));
        assert_eq!(gpus_left(&v, &r), 5);
    }
}
