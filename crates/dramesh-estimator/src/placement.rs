//! Placement from a Karmada PropagationPolicy: cluster affinity, spread constraints by
//! cluster, and the four replica assignment strategies (Duplicated, Divided with static
//! weights, Divided with dynamic weight by available replicas, Divided aggregated), from
//! scratch ([`assign`]) or keeping a binding's previous assignment ([`assign_keeping`]).
//!
//! Division uses the Webster (Sainte-Laguë) method as Karmada does: the next replica goes
//! to the cluster with the highest `weight / (2 * assigned + 1)`; ties go to the cluster
//! with fewer replicas, then by name in an order (ascending or descending) chosen by the
//! parity of the FNV-1a hash of the workload identity, so equal-weight clusters do not
//! always favour the same name. Static weights ignore capacity and spread constraints;
//! dynamic strategies fail as unschedulable when the selected clusters' available replicas
//! sum to less than the workload's replicas.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

use dramesh_model::ClusterInfo;

use crate::estimate::{EstimateOptions, Estimator};
use crate::policy::{Policy, SpreadConstraint, Strategy};
use crate::view::View;
use crate::workload::Workload;

/// Replicas assigned to one cluster (Karmada `TargetCluster`, as a binding's `spec.clusters`
/// holds it; `replicas` is omitted there when 0).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TargetCluster {
    /// Cluster name.
    pub name: String,
    /// Replicas assigned to it.
    #[serde(default)]
    pub replicas: i64,
}

/// The result of placing a workload.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlacementResult {
    /// Name of the PropagationPolicy applied.
    pub policy: String,
    /// The replica assignment strategy applied.
    pub strategy: String,
    /// Replicas placed in all.
    pub replicas: i64,
    /// Clusters with replicas, by name.
    pub clusters: Vec<TargetCluster>,
    /// Available replicas of each candidate cluster (from the estimate).
    pub available: BTreeMap<String, i64>,
    /// Clusters that the affinity excluded.
    pub filtered_out: Vec<String>,
    /// Candidate clusters left out because their data is stale ([`EstimateOptions::stale`]);
    /// placement never chooses them.
    pub stale: Vec<String>,
    /// Why the workload could not be placed, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unschedulable: Option<String>,
}

/// FNV-1a, 32 bit.
pub(crate) fn fnv32a(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

#[derive(Debug, Clone)]
struct Party {
    name: String,
    votes: i64,
    seats: i64,
    /// Names compare ascending when true.
    ascending: bool,
}

impl Party {
    fn cmp_priority(&self, other: &Party) -> Ordering {
        // votes/(2s+1) compared exactly by cross-multiplication.
        let l = i128::from(self.votes) * i128::from(2 * other.seats + 1);
        let r = i128::from(other.votes) * i128::from(2 * self.seats + 1);
        l.cmp(&r)
            .then_with(|| other.seats.cmp(&self.seats))
            .then_with(|| {
                if self.ascending {
                    other.name.cmp(&self.name)
                } else {
                    self.name.cmp(&other.name)
                }
            })
    }
}

impl PartialEq for Party {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Party {}
impl PartialOrd for Party {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Party {
    fn cmp(&self, other: &Self) -> Ordering {
        self.cmp_priority(other)
    }
}

/// Webster (Sainte-Laguë) apportionment of `seats` among `(name, votes, initial seats)`.
/// `ascending` picks the name order used for the last tie break. Returns seats per name in
/// the input order.
pub fn webster(seats: i64, parties: &[(String, i64, i64)], ascending: bool) -> Vec<(String, i64)> {
    let mut heap: BinaryHeap<Party> = parties
        .iter()
        .map(|(n, v, s)| Party {
            name: n.clone(),
            votes: *v,
            seats: *s,
            ascending,
        })
        .collect();
    if heap.is_empty() {
        return Vec::new();
    }
    for _ in 0..seats.max(0) {
        let Some(mut p) = heap.pop() else { break };
        p.seats += 1;
        heap.push(p);
    }
    let got: BTreeMap<String, i64> = heap.into_iter().map(|p| (p.name, p.seats)).collect();
    parties
        .iter()
        .map(|(n, _, _)| (n.clone(), got.get(n).copied().unwrap_or(0)))
        .collect()
}

/// The name order of ties for this workload (see the module docs): Karmada's dispenser
/// seeds it with the resource template's UID.
pub fn tie_ascending(w: &Workload) -> bool {
    let id = w
        .uid
        .clone()
        .unwrap_or_else(|| format!("{}/{}", w.namespace, w.name));
    fnv32a(id.as_bytes()).is_multiple_of(2)
}

/// Karmada's cluster-spread selection: keep the best `maxGroups` clusters, swapping in
/// clusters with more available replicas when the kept ones cannot hold `need` replicas.
/// `ranked` must be sorted best first. `need` is `None` for Duplicated placements.
pub fn select_by_cluster(
    ranked: &[(String, i64)],
    c: &SpreadConstraint,
    need: Option<i64>,
) -> Result<Vec<(String, i64)>, String> {
    if ranked.len() < c.min_groups {
        return Err(format!(
            "{} feasible clusters, fewer than minGroups {}",
            ranked.len(),
            c.min_groups
        ));
    }
    let want = if c.max_groups == 0 {
        ranked.len()
    } else {
        c.max_groups.min(ranked.len())
    };
    let mut chosen: Vec<(String, i64)> = ranked[..want].to_vec();
    let Some(need) = need else {
        return Ok(chosen);
    };
    let mut rest: Vec<(String, i64)> = ranked[want..].to_vec();
    let sum = |v: &[(String, i64)]| v.iter().map(|x| x.1).sum::<i64>();
    if sum(&chosen) >= need {
        return Ok(chosen);
    }
    rest.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut i = chosen.len();
    while i > 0 && sum(&chosen) < need {
        i -= 1;
        if let Some(best) = rest.first()
            && best.1 > chosen[i].1
        {
            let out = std::mem::replace(&mut chosen[i], rest.remove(0));
            rest.push(out);
            rest.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        }
    }
    if sum(&chosen) < need {
        return Err(format!(
            "no enough resource when selecting {want} clusters: {} available replicas for {need}",
            sum(&chosen)
        ));
    }
    Ok(chosen)
}

/// What a binding was assigned before, as Karmada's scheduler keeps it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Previous<'a> {
    /// The binding's current `spec.clusters`.
    pub clusters: &'a [TargetCluster],
    /// A reschedule was asked for since the last scheduling (`rescheduleTriggeredAt` after
    /// `lastScheduledTime`): divide afresh, counting the replicas already placed on a cluster
    /// as available there.
    pub fresh: bool,
}

/// Assigns `replicas` over selected clusters `(name, available)` (best first) by strategy,
/// from scratch. `infos` holds every candidate's ClusterInfo for static weight matching.
pub fn assign(
    strategy: &Strategy,
    replicas: i64,
    selected: &[(String, i64)],
    infos: &BTreeMap<String, ClusterInfo>,
    ascending: bool,
) -> Result<Vec<TargetCluster>, String> {
    assign_keeping(
        strategy,
        replicas,
        selected,
        infos,
        ascending,
        Previous::default(),
    )
}

/// [`assign`] for a binding scheduled before, keeping what it has as Karmada's scheduler does
/// for the dynamic strategies (DynamicWeight, Aggregated), which is its "steady" mode:
/// - the same replica count keeps the previous clusters (those still selected) unchanged;
/// - scaling up keeps them and divides only the new replicas, by available replicas
///   (Aggregated fills the clusters it already uses first);
/// - scaling down divides the new count over the clusters in use, weighted by what each has;
/// - a requested reschedule ([`Previous::fresh`]) divides everything again, with each
///   cluster's current replicas counted as available there.
///
/// Clusters no longer selected lose their replicas. Duplicated and static weights do not
/// depend on the previous assignment.
pub fn assign_keeping(
    strategy: &Strategy,
    replicas: i64,
    selected: &[(String, i64)],
    infos: &BTreeMap<String, ClusterInfo>,
    ascending: bool,
    previous: Previous<'_>,
) -> Result<Vec<TargetCluster>, String> {
    let nonzero = |v: Vec<(String, i64)>| -> Vec<TargetCluster> {
        v.into_iter()
            .filter(|(_, r)| *r > 0)
            .map(|(name, replicas)| TargetCluster { name, replicas })
            .collect()
    };
    match strategy {
        Strategy::Duplicated => Ok(selected
            .iter()
            .map(|(n, _)| TargetCluster {
                name: n.clone(),
                replicas,
            })
            .collect()),
        Strategy::StaticWeight(rules) => {
            let default_info = ClusterInfo::default();
            let mut weights: Vec<(String, i64, i64)> = selected
                .iter()
                .map(|(n, _)| {
                    let info = infos.get(n).unwrap_or(&default_info);
                    let w = rules
                        .iter()
                        .filter(|(a, _)| a.matches(n, info))
                        .map(|(_, w)| *w)
                        .max()
                        .unwrap_or(0);
                    (n.clone(), w, 0)
                })
                .collect();
            if weights.iter().all(|w| w.1 == 0) {
                for w in &mut weights {
                    w.1 = 1;
                }
            }
            weights.retain(|w| w.1 > 0);
            Ok(nonzero(webster(replicas, &weights, ascending)))
        }
        Strategy::DynamicWeight | Strategy::Aggregated => {
            let aggregated = *strategy == Strategy::Aggregated;
            // The previous assignment on clusters still selected, in its order.
            let scheduled: Vec<(String, i64)> = previous
                .clusters
                .iter()
                .filter(|t| selected.iter().any(|(n, _)| *n == t.name))
                .map(|t| (t.name.clone(), t.replicas.max(0)))
                .collect();
            let assigned: i64 = scheduled.iter().map(|(_, r)| r).sum();
            let used: Vec<String> = scheduled
                .iter()
                .filter(|(_, r)| *r > 0)
                .map(|(n, _)| n.clone())
                .collect();
            let (target, available, keep) = if previous.fresh {
                let with_own: Vec<(String, i64)> = selected
                    .iter()
                    .map(|(n, a)| {
                        let own = scheduled.iter().find(|(s, _)| s == n).map_or(0, |s| s.1);
                        (n.clone(), (*a).max(0).saturating_add(own))
                    })
                    .collect();
                (replicas, with_own, Vec::new())
            } else if assigned > replicas {
                (replicas, scheduled, Vec::new())
            } else if assigned < replicas {
                (replicas - assigned, selected.to_vec(), scheduled)
            } else {
                return Ok(nonzero(scheduled));
            };
            let prefer: &[String] = if aggregated && !keep.is_empty() {
                &used
            } else {
                &[]
            };
            divide(target, available, keep, prefer, aggregated, ascending).map(nonzero)
        }
    }
}

/// Karmada's dynamic division: `target` replicas over `available`, weighted by what is
/// available, merged into `keep`. Clusters are ranked most available first (then by name);
/// Aggregated takes only the leading ones that suffice, the `prefer`red ones (in use before a
/// scale-up) ahead of the others.
fn divide(
    target: i64,
    mut available: Vec<(String, i64)>,
    keep: Vec<(String, i64)>,
    prefer: &[String],
    aggregated: bool,
    ascending: bool,
) -> Result<Vec<(String, i64)>, String> {
    let total: i64 = available.iter().map(|(_, a)| (*a).max(0)).sum();
    if total < target {
        // Karmada's wording (`dynamicDivideReplicas`), which the scheduler role writes into
        // the binding's condition.
        return Err(format!(
            "Clusters available replicas {total} are not enough to schedule."
        ));
    }
    available.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    // Stable, so the ranking above holds within both groups.
    available.sort_by_key(|(n, _)| !prefer.contains(n));
    if aggregated {
        let mut acc = 0;
        let mut take = 0;
        for (_, a) in &available {
            take += 1;
            acc += a;
            if acc >= target {
                break;
            }
        }
        available.truncate(take);
    }
    let parties: Vec<(String, i64, i64)> = available
        .iter()
        .map(|(n, a)| (n.clone(), (*a).max(0), 0))
        .collect();
    let mut out = keep;
    for (name, r) in webster(target, &parties, ascending) {
        match out.iter_mut().find(|(n, _)| *n == name) {
            Some(e) => e.1 += r,
            None => out.push((name, r)),
        }
    }
    Ok(out)
}

/// Places `w` on the view's clusters according to `policy`, estimating capacity with
/// `estimator`.
pub fn place(
    view: &View,
    w: &Workload,
    policy: &Policy,
    estimator: &mut Estimator,
    opts: &EstimateOptions,
) -> PlacementResult {
    let mut infos = BTreeMap::new();
    let mut candidates = Vec::new();
    let mut filtered_out = Vec::new();
    let mut stale = Vec::new();
    for c in view.clusters() {
        if !opts.clusters.is_empty() && !opts.clusters.contains(&c.name) {
            continue;
        }
        infos.insert(c.name.clone(), c.info.clone());
        let ok = policy
            .affinity
            .as_ref()
            .is_none_or(|a| a.matches(&c.name, &c.info));
        if !ok {
            filtered_out.push(c.name.clone());
        } else if opts.stale.contains(&c.name) {
            stale.push(c.name.clone());
        } else {
            candidates.push(c.name.clone());
        }
    }
    let stale_note = if stale.is_empty() {
        String::new()
    } else {
        format!(" (not considered, data stale: {})", stale.join(", "))
    };
    let mut result = PlacementResult {
        policy: policy.name.clone(),
        strategy: policy.strategy.name().to_string(),
        replicas: w.replicas,
        clusters: Vec::new(),
        available: BTreeMap::new(),
        filtered_out,
        stale,
        unschedulable: None,
    };
    if candidates.is_empty() {
        result.unschedulable = Some(if result.stale.is_empty() {
            "no cluster matches the placement's cluster affinity".into()
        } else {
            format!(
                "every cluster matching the placement's cluster affinity has stale data: {}",
                result.stale.join(", ")
            )
        });
        return result;
    }
    let needs_estimate = !matches!(
        policy.strategy,
        Strategy::Duplicated | Strategy::StaticWeight(_)
    ) || !policy.spread.is_empty();
    let mut ranked: Vec<(String, i64)> = if needs_estimate {
        let mut o = opts.clone();
        o.clusters = candidates.clone();
        let est = estimator.estimate(view, w, &o);
        est.clusters
            .iter()
            .map(|c| (c.name.clone(), c.max_replicas))
            .collect()
    } else {
        candidates.iter().map(|n| (n.clone(), 0)).collect()
    };
    if needs_estimate {
        for (n, a) in &ranked {
            result.available.insert(n.clone(), *a);
        }
    }
    // Karmada ranks by score (all equal here), then available replicas, then name.
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let selected = if policy.spread.is_empty()
        || matches!(policy.strategy, Strategy::StaticWeight(_))
    {
        ranked
    } else {
        let by_cluster: Vec<&SpreadConstraint> = policy
            .spread
            .iter()
            .filter(|s| s.spread_by_field.as_deref() == Some("cluster"))
            .collect();
        if by_cluster.len() != policy.spread.len() {
            result.unschedulable = Some("only spread constraints by cluster are supported".into());
            return result;
        }
        let need = match policy.strategy {
            Strategy::Duplicated => None,
            _ => Some(w.replicas),
        };
        match select_by_cluster(&ranked, by_cluster[0], need) {
            Ok(s) => s,
            Err(e) => {
                result.unschedulable = Some(format!("{e}{stale_note}"));
                return result;
            }
        }
    };
    match assign(
        &policy.strategy,
        w.replicas,
        &selected,
        &infos,
        tie_ascending(w),
    ) {
        Ok(t) => result.clusters = t,
        Err(e) => result.unschedulable = Some(format!("{e}{stale_note}")),
    }
    result
}
