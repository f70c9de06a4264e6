//! Placement from a Karmada PropagationPolicy: cluster affinity, spread constraints
//! (Karmada's selection by region and by cluster, [`select_spread`]), and the four replica
//! assignment strategies (Duplicated, Divided with static weights, Divided with dynamic
//! weight by available replicas, Divided aggregated), from scratch ([`assign`]) or keeping
//! a binding's previous assignment ([`assign_keeping`]).
//!
//! Division uses the Webster (Sainte-Laguë) method as Karmada does: the next replica goes
//! to the cluster with the highest `weight / (2 * assigned + 1)`; ties go to the cluster
//! with fewer replicas, then (static weights) to the one that had more in the binding's
//! last assignment, then by name in an order (ascending or descending) chosen by the
//! parity of the FNV-1a hash of the workload identity, so equal-weight clusters do not
//! always favour the same name. Static weights ignore capacity and spread constraints;
//! dynamic strategies fail as unschedulable when the selected clusters' available replicas
//! sum to less than the workload's replicas.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

use dramesh_model::ClusterInfo;

use crate::estimate::{EstimateOptions, Estimator};
use crate::policy::{ClusterAffinity, Policy, SpreadConstraint, Strategy};
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
    /// Replicas the cluster had in the binding's last assignment (static weights).
    last: i64,
    /// Names compare ascending when true.
    ascending: bool,
}

impl Party {
    fn cmp_priority(&self, other: &Party) -> Ordering {
        // votes/(2s+1) compared exactly by cross-multiplication.
        let l = i128::from(self.votes) * (2 * i128::from(other.seats) + 1);
        let r = i128::from(other.votes) * (2 * i128::from(self.seats) + 1);
        l.cmp(&r)
            .then_with(|| other.seats.cmp(&self.seats))
            .then_with(|| self.last.cmp(&other.last))
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
    let parties: Vec<Party> = parties
        .iter()
        .map(|(n, v, s)| Party {
            name: n.clone(),
            votes: *v,
            seats: *s,
            last: 0,
            ascending,
        })
        .collect();
    apportion(seats, parties)
}

/// [`webster`] over prepared parties (seats per name, in the input order).
fn apportion(seats: i64, parties: Vec<Party>) -> Vec<(String, i64)> {
    let order: Vec<String> = parties.iter().map(|p| p.name.clone()).collect();
    let mut heap: BinaryHeap<Party> = parties.into_iter().collect();
    if heap.is_empty() {
        return Vec::new();
    }
    for _ in 0..seats.max(0) {
        let Some(mut p) = heap.pop() else { break };
        p.seats += 1;
        heap.push(p);
    }
    let got: BTreeMap<String, i64> = heap.into_iter().map(|p| (p.name, p.seats)).collect();
    order
        .into_iter()
        .map(|n| {
            let s = got.get(&n).copied().unwrap_or(0);
            (n, s)
        })
        .collect()
}

/// The candidate clusters' [`ClusterInfo`] by name, borrowed from the view or the fleet.
pub type ClusterInfos<'a> = BTreeMap<&'a str, &'a ClusterInfo>;

/// Karmada's static-weight division (`assignByStaticWeightStrategy` with the Webster
/// dispenser): each selected cluster weighs the highest weight of the rules that match it;
/// clusters no rule matches get nothing. With no rules at all every cluster weighs 1 (the
/// default preference); when rules exist but match no cluster every cluster weighs 1 too,
/// without the last assignment (Karmada's fallback list carries none). Ties of equal Webster
/// priority go to the cluster with fewer replicas so far, then to the one that had more in
/// `last` (the binding's `spec.clusters`, so that a remainder stays where it was), then by
/// the workload's name order ([`tie_ascending`]).
pub fn divide_static_weights(
    rules: &[(ClusterAffinity, i64)],
    replicas: i64,
    selected: &[(String, i64)],
    infos: &ClusterInfos<'_>,
    last: &[TargetCluster],
    ascending: bool,
) -> Vec<TargetCluster> {
    let default_info = ClusterInfo::default();
    let last_of = |n: &str| {
        last.iter()
            .find(|t| t.name == n)
            .map_or(0, |t| t.replicas.max(0))
    };
    let party = |name: &str, votes: i64, last: i64| Party {
        name: name.to_string(),
        votes,
        seats: 0,
        last,
        ascending,
    };
    let mut parties: Vec<Party> = if rules.is_empty() {
        selected
            .iter()
            .map(|(n, _)| party(n, 1, last_of(n)))
            .collect()
    } else {
        selected
            .iter()
            .filter_map(|(n, _)| {
                let info = infos.get(n.as_str()).copied().unwrap_or(&default_info);
                let w = rules
                    .iter()
                    .filter(|(a, _)| a.matches(n, info))
                    .map(|(_, w)| *w)
                    .max()
                    .unwrap_or(0);
                (w > 0).then(|| party(n, w, last_of(n)))
            })
            .collect()
    };
    if parties.is_empty() {
        parties = selected.iter().map(|(n, _)| party(n, 1, 0)).collect();
    }
    apportion(replicas, parties)
        .into_iter()
        .filter(|(_, r)| *r > 0)
        .map(|(name, replicas)| TargetCluster { name, replicas })
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

/// A cluster that passed the filters, as Karmada's spread selection sees it
/// (`spreadconstraint.ClusterDetailInfo`).
#[derive(Debug, Clone, Copy)]
pub struct SpreadCandidate<'a> {
    /// Cluster name.
    pub name: &'a str,
    /// Its region, zone and provider.
    pub info: &'a ClusterInfo,
    /// The sum of the score plugins (karmada-scheduler's defaults leave only
    /// ClusterLocality: 100 for a cluster the binding already uses, else 0).
    pub score: i64,
    /// Available replicas: the estimate plus what the binding already has there.
    pub available: i64,
}

/// What spread selection needs to know of the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpreadDemand {
    /// `spec.replicas` (groups are scored against it).
    pub replicas: i64,
    /// The placement is Duplicated (or has no `replicaScheduling`): groups are scored by the
    /// clusters that can each run every replica.
    pub duplicated: bool,
    /// Replicas the selected clusters must hold together when selecting by cluster; `None`
    /// ignores capacity (Karmada's `InvalidReplicas`, for Duplicated placements).
    pub need: Option<i64>,
}

/// DFS steps and feasible combinations the region search may take before it gives up with
/// an error (Karmada's search is exponential in the number of regions; real fleets have a
/// few, a hostile `minGroups`/`maxGroups` over many must not hang a scheduler).
const GROUP_SEARCH_STEPS: usize = 1 << 22;
const GROUP_SEARCH_PATHS: usize = 1 << 16;

/// Karmada's `weightUnit`: available replicas weigh more than the average cluster score.
const GROUP_WEIGHT_UNIT: i64 = 1000;

/// Karmada's spread selection (`spreadconstraint.SelectBestClusters`) for placements whose
/// spread constraints are not ignored (static weights ignore them; the caller skips those).
/// Returns the selected cluster names in Karmada's order.
///
/// - The constraints are checked as Karmada's admission does (`ValidateSpreadConstraint`):
///   one constraint per field, a `cluster` constraint whenever a field is used, known field
///   values; `minGroups` 0 reads as Karmada's default 1. Errors name the field.
/// - With a `region` constraint, regions are scored ([`group score`](group_score)), the best
///   combination of `minGroups..=maxGroups` regions holding at least the cluster
///   constraint's `minGroups` clusters is chosen (Karmada's DFS, `selectGroups`), then the
///   best cluster of each chosen region, then the best of the rest up to the cluster
///   `maxGroups`. Capacity is not checked here (the assignment step fails if it falls short).
/// - Otherwise the `cluster` constraint: the first `maxGroups` clusters by score, available
///   replicas and name, with clusters holding more swapped in from the rest (last first)
///   until they hold `need` replicas.
/// - `zone` and `provider` constraints are accepted but, as in karmada-scheduler, do not
///   restrict the selection (Karmada groups clusters by them but selects only by region and
///   cluster). `spreadByLabel` without a `cluster` constraint is Karmada's
///   `just support cluster and region spread constraint`.
///
/// `maxGroups` is taken as written, as Karmada takes it: 0 selects no cluster.
pub fn select_spread<'a>(
    candidates: &[SpreadCandidate<'a>],
    spread: &[SpreadConstraint],
    demand: SpreadDemand,
) -> Result<Vec<&'a str>, String> {
    let checked = check_spread(spread)?;
    let mut ranked: Vec<SpreadCandidate<'a>> = candidates.to_vec();
    ranked.sort_by(rank_order);
    match (checked.region, checked.cluster) {
        (Some(region), Some(cluster)) => select_by_region(&ranked, region, cluster, demand),
        (None, Some(cluster)) => select_by_cluster(&ranked, cluster, demand.need),
        _ => Err("just support cluster and region spread constraint".into()),
    }
}

/// Karmada's cluster order: score, then available replicas (both descending), then name.
fn rank_order(a: &SpreadCandidate<'_>, b: &SpreadCandidate<'_>) -> Ordering {
    b.score
        .cmp(&a.score)
        .then_with(|| b.available.cmp(&a.available))
        .then_with(|| a.name.cmp(b.name))
}

/// One spread constraint after admission's checks and defaults.
#[derive(Debug, Clone, Copy)]
struct Groups {
    min: usize,
    max: usize,
}

#[derive(Debug, Default)]
struct CheckedSpread {
    region: Option<Groups>,
    cluster: Option<Groups>,
}

fn check_spread(spread: &[SpreadConstraint]) -> Result<CheckedSpread, String> {
    let mut out = CheckedSpread::default();
    let mut seen: Vec<&str> = Vec::new();
    let mut by_field = false;
    for (i, c) in spread.iter().enumerate() {
        let f = format!("spec.placement.spreadConstraints[{i}]");
        let groups = Groups {
            min: c.min_groups.max(1),
            max: c.max_groups,
        };
        if c.max_groups > 0 && c.max_groups < c.min_groups {
            return Err(format!(
                "{f}: maxGroups({}) lower than minGroups({}) is not allowed",
                c.max_groups, c.min_groups
            ));
        }
        let Some(field) = c.spread_by_field.as_deref() else {
            continue;
        };
        // Karmada's defaulting makes an empty field `cluster`.
        let field = if field.is_empty() { "cluster" } else { field };
        if !matches!(field, "cluster" | "region" | "zone" | "provider") {
            return Err(format!(
                "{f}.spreadByField: unsupported value {field:?} (cluster, region, zone or provider)"
            ));
        }
        if seen.contains(&field) {
            return Err(format!(
                "{f}: multiple {field} spread constraints are not allowed"
            ));
        }
        seen.push(field);
        by_field = true;
        match field {
            "cluster" => out.cluster = Some(groups),
            "region" => out.region = Some(groups),
            _ => {}
        }
    }
    if by_field && out.cluster.is_none() {
        return Err(
            "spec.placement.spreadConstraints: the cluster spread constraint must be \
                    enabled in one of the constraints in case of SpreadByField is enabled"
                .into(),
        );
    }
    Ok(out)
}

/// Karmada `selectBestClustersByCluster`.
fn select_by_cluster<'a>(
    ranked: &[SpreadCandidate<'a>],
    c: Groups,
    need: Option<i64>,
) -> Result<Vec<&'a str>, String> {
    if ranked.len() < c.min {
        return Err(
            "the number of feasible clusters is less than spreadConstraint.MinGroups".into(),
        );
    }
    let count = c.max.min(ranked.len());
    let mut chosen: Vec<SpreadCandidate<'a>> = ranked[..count].to_vec();
    if let Some(need) = need {
        let mut rest: Vec<SpreadCandidate<'a>> = ranked[count..].to_vec();
        let enough = |v: &[SpreadCandidate<'_>]| {
            v.iter()
                .map(|c| c.available)
                .fold(0i64, i64::saturating_add)
                >= need
        };
        // From the last chosen to the first, swap in the cluster of the rest with the most
        // available replicas when it has more (the first such in the rest's order).
        let mut i = chosen.len();
        while !enough(&chosen) && i > 0 {
            i -= 1;
            let mut best: Option<usize> = None;
            let mut most = chosen[i].available;
            for (j, r) in rest.iter().enumerate() {
                if r.available > most {
                    most = r.available;
                    best = Some(j);
                }
            }
            if let Some(j) = best {
                std::mem::swap(&mut chosen[i], &mut rest[j]);
            }
        }
        if !enough(&chosen) {
            return Err(format!(
                "no enough resource when selecting {count} clusters"
            ));
        }
    }
    Ok(chosen.iter().map(|c| c.name).collect())
}

/// Karmada `calcGroupScore` for the clusters of one group (in rank order). Divided: how many
/// of the replicas a group would get (`replicas / minGroups`, rounded up) its best clusters
/// hold, in units of 1000, plus their average score; the clusters counted stop once there are
/// enough of them (the larger of the group's and the cluster constraint's `minGroups`) and
/// they hold that share. Duplicated: how many clusters can each run every replica, in units
/// of 1000, plus their average score (0 when none can; Karmada divides by zero there).
fn group_score(
    clusters: &[SpreadCandidate<'_>],
    demand: SpreadDemand,
    group_min: usize,
    cluster_min: usize,
) -> i64 {
    let to_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    if demand.duplicated {
        let valid: Vec<&SpreadCandidate<'_>> = clusters
            .iter()
            .filter(|c| c.available >= demand.replicas)
            .collect();
        if valid.is_empty() {
            return 0;
        }
        let n = to_i64(valid.len());
        let sum = valid
            .iter()
            .map(|c| c.score)
            .fold(0i64, i64::saturating_add);
        return n.saturating_mul(GROUP_WEIGHT_UNIT).saturating_add(sum / n);
    }
    let group_min = group_min.max(1);
    let (replicas, groups) = (demand.replicas.max(0), to_i64(group_min));
    let target = replicas / groups + i64::from(replicas % groups != 0);
    let need_clusters = cluster_min.max(group_min);
    let (mut available, mut score, mut counted) = (0i64, 0i64, 0usize);
    for c in clusters {
        available = available.saturating_add(c.available);
        score = score.saturating_add(c.score);
        counted += 1;
        if counted >= need_clusters && available >= target {
            break;
        }
    }
    if clusters.is_empty() {
        return 0;
    }
    if available < target {
        available
            .saturating_mul(GROUP_WEIGHT_UNIT)
            .saturating_add(score / to_i64(clusters.len()))
    } else {
        target
            .saturating_mul(GROUP_WEIGHT_UNIT)
            .saturating_add(score / to_i64(counted))
    }
}

/// A region and its clusters (in rank order), with its group score.
struct Region<'a> {
    name: &'a str,
    weight: i64,
    clusters: Vec<SpreadCandidate<'a>>,
}

/// Karmada `selectBestClustersByRegion`: the regions of the ranked clusters (clusters
/// without a region belong to none), scored, then [`pick_from_regions`].
fn select_by_region<'a>(
    ranked: &[SpreadCandidate<'a>],
    region: Groups,
    cluster: Groups,
    demand: SpreadDemand,
) -> Result<Vec<&'a str>, String> {
    let mut by_name: BTreeMap<&'a str, Vec<SpreadCandidate<'a>>> = BTreeMap::new();
    for c in ranked {
        if let Some(r) = c.info.region.as_deref().filter(|r| !r.is_empty()) {
            by_name.entry(r).or_default().push(*c);
        }
    }
    let regions: Vec<Region<'a>> = by_name
        .into_iter()
        .map(|(name, clusters)| Region {
            name,
            weight: group_score(&clusters, demand, region.min, cluster.min),
            clusters,
        })
        .collect();
    pick_from_regions(&regions, region, cluster)
}

/// The regions chosen by [`select_groups`] (at least the cluster constraint's `minGroups`
/// clusters in `minGroups..=maxGroups` regions), the best cluster of each, then the best of
/// their other clusters up to the cluster constraint's `maxGroups`.
fn pick_from_regions<'a>(
    regions: &[Region<'a>],
    region: Groups,
    cluster: Groups,
) -> Result<Vec<&'a str>, String> {
    if regions.len() < region.min {
        return Err("the number of feasible region is less than spreadConstraint.MinGroups".into());
    }
    let groups: Vec<GroupInfo<'a>> = regions
        .iter()
        .map(|r| GroupInfo {
            name: r.name,
            value: i64::try_from(r.clusters.len()).unwrap_or(i64::MAX),
            weight: r.weight,
        })
        .collect();
    let target = i64::try_from(cluster.min).unwrap_or(i64::MAX);
    let chosen = select_groups(groups, region.min, region.max, target)?;
    if chosen.is_empty() {
        return Err(
            "the number of clusters is less than the cluster spreadConstraint.MinGroups".into(),
        );
    }
    let mut out: Vec<&'a str> = Vec::new();
    let mut rest: Vec<SpreadCandidate<'a>> = Vec::new();
    for name in &chosen {
        if let Some(r) = regions.iter().find(|r| r.name == *name)
            && let Some((first, others)) = r.clusters.split_first()
        {
            out.push(first.name);
            rest.extend_from_slice(others);
        }
    }
    let want = (out.len() + rest.len()).min(cluster.max);
    if want > out.len() {
        rest.sort_by(rank_order);
        out.extend(rest.iter().take(want - out.len()).map(|c| c.name));
    }
    Ok(out)
}

/// A group in Karmada's group search: its name, how many clusters it has (`value`) and its
/// score (`weight`).
#[derive(Debug, Clone, Copy)]
struct GroupInfo<'a> {
    name: &'a str,
    value: i64,
    weight: i64,
}

/// A feasible combination found by the search.
struct GroupPath<'a> {
    id: usize,
    /// By weight (descending), then name.
    groups: Vec<GroupInfo<'a>>,
    weight: i64,
    value: i64,
}

/// Karmada `selectGroups`: every combination of `min..=max` groups whose values sum to at
/// least `target`, found depth first over the groups ordered by value (ascending), weight
/// (descending) and name, a combination not being extended once it qualifies. The best has
/// the highest total weight, then value, then was found first; a qualifying combination that
/// is a prefix of the best (groups ordered by weight, then name) replaces it. Empty when none
/// qualifies.
fn select_groups<'a>(
    mut groups: Vec<GroupInfo<'a>>,
    min: usize,
    max: usize,
    target: i64,
) -> Result<Vec<&'a str>, String> {
    if groups.is_empty() {
        return Ok(Vec::new());
    }
    // No combination qualifies when even the `max` largest groups fall short (the search
    // would find none, after trying them all).
    let mut values: Vec<i64> = groups.iter().map(|g| g.value).collect();
    values.sort_unstable_by(|a, b| b.cmp(a));
    let most = values
        .iter()
        .take(max)
        .fold(0i64, |a, v| a.saturating_add(*v));
    if groups.len() < min || most < target {
        return Ok(Vec::new());
    }
    groups.sort_by(|a, b| {
        a.value
            .cmp(&b.value)
            .then_with(|| b.weight.cmp(&a.weight))
            .then_with(|| a.name.cmp(b.name))
    });
    struct Search<'g, 'a> {
        groups: &'g [GroupInfo<'a>],
        min: usize,
        max: usize,
        target: i64,
        path: Vec<usize>,
        found: Vec<GroupPath<'a>>,
        steps: usize,
    }
    impl<'a> Search<'_, 'a> {
        fn dfs(&mut self, sum: i64, begin: usize) -> Result<(), ()> {
            self.steps += 1;
            if self.steps > GROUP_SEARCH_STEPS || self.found.len() > GROUP_SEARCH_PATHS {
                return Err(());
            }
            let len = self.path.len();
            if sum >= self.target && len >= self.min && len <= self.max {
                let mut groups: Vec<GroupInfo<'a>> =
                    self.path.iter().map(|&i| self.groups[i]).collect();
                groups.sort_by(|a, b| b.weight.cmp(&a.weight).then_with(|| a.name.cmp(b.name)));
                self.found.push(GroupPath {
                    id: self.found.len(),
                    weight: groups.iter().map(|g| g.weight).fold(0, i64::saturating_add),
                    value: groups.iter().map(|g| g.value).fold(0, i64::saturating_add),
                    groups,
                });
                return Ok(());
            }
            if len >= self.max {
                return Ok(());
            }
            for i in begin..self.groups.len() {
                self.path.push(i);
                let r = self.dfs(sum.saturating_add(self.groups[i].value), i + 1);
                self.path.pop();
                r?;
            }
            Ok(())
        }
    }
    let mut search = Search {
        groups: &groups,
        min,
        max,
        target,
        path: Vec::new(),
        found: Vec::new(),
        steps: 0,
    };
    if search.dfs(0, 0).is_err() {
        return Err(format!(
            "spec.placement.spreadConstraints: too many combinations of {} regions to search \
             (minGroups {min}, maxGroups {max})",
            groups.len()
        ));
    }
    let mut found = search.found;
    found.sort_by(|a, b| {
        b.weight
            .cmp(&a.weight)
            .then_with(|| b.value.cmp(&a.value))
            .then_with(|| a.id.cmp(&b.id))
    });
    let mut best: Option<&GroupPath<'a>> = None;
    for p in &found {
        best = match best {
            None => Some(p),
            Some(b)
                if p.groups.len() < b.groups.len()
                    && p.groups
                        .iter()
                        .zip(&b.groups)
                        .all(|(x, y)| x.name == y.name) =>
            {
                Some(p)
            }
            keep => keep,
        };
    }
    Ok(best
        .map(|p| p.groups.iter().map(|g| g.name).collect())
        .unwrap_or_default())
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
    infos: &ClusterInfos<'_>,
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
/// Clusters no longer selected lose their replicas. Duplicated does not depend on the
/// previous assignment; static weights are divided afresh, the previous assignment only
/// breaking ties ([`divide_static_weights`]).
pub fn assign_keeping(
    strategy: &Strategy,
    replicas: i64,
    selected: &[(String, i64)],
    infos: &ClusterInfos<'_>,
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
        Strategy::StaticWeight(rules) => Ok(divide_static_weights(
            rules,
            replicas,
            selected,
            infos,
            previous.clusters,
            ascending,
        )),
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
    let mut infos = ClusterInfos::new();
    let mut candidates = Vec::new();
    let mut filtered_out = Vec::new();
    let mut stale = Vec::new();
    for c in view.clusters() {
        if !opts.clusters.is_empty() && !opts.clusters.contains(&c.name) {
            continue;
        }
        infos.insert(c.name.as_str(), &c.info);
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
    let selected =
        if policy.spread.is_empty() || matches!(policy.strategy, Strategy::StaticWeight(_)) {
            ranked
        } else {
            let default_info = ClusterInfo::default();
            let candidates: Vec<SpreadCandidate<'_>> = ranked
                .iter()
                .map(|(n, a)| SpreadCandidate {
                    name: n,
                    info: infos.get(n.as_str()).copied().unwrap_or(&default_info),
                    score: 0,
                    available: *a,
                })
                .collect();
            let duplicated = policy.strategy == Strategy::Duplicated;
            let demand = SpreadDemand {
                replicas: w.replicas,
                duplicated,
                need: (!duplicated).then_some(w.replicas),
            };
            match select_spread(&candidates, &policy.spread, demand) {
                Ok(names) => names
                    .into_iter()
                    .filter_map(|n| ranked.iter().find(|(m, _)| m == n).cloned())
                    .collect(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Karmada's `Test_selectBestClustersByRegion` cases (scores given, as there).
    fn region<'a>(
        name: &'a str,
        weight: i64,
        clusters: &[(&'a str, i64, i64)],
        info: &'a ClusterInfo,
    ) -> Region<'a> {
        Region {
            name,
            weight,
            clusters: clusters
                .iter()
                .map(|(n, score, available)| SpreadCandidate {
                    name: n,
                    info,
                    score: *score,
                    available: *available,
                })
                .collect(),
        }
    }

    fn g(min: usize, max: usize) -> Groups {
        Groups { min, max }
    }

    #[test]
    fn regions_are_picked_as_karmada_picks_them() {
        let info = ClusterInfo::default();
        let two = || {
            vec![
                region(
                    "R1",
                    100,
                    &[("member1", 100, 40), ("member2", 80, 40)],
                    &info,
                ),
                region(
                    "R2",
                    80,
                    &[
                        ("member3", 80, 40),
                        ("member4", 80, 40),
                        ("member5", 60, 40),
                    ],
                    &info,
                ),
            ]
        };
        // The region with the higher score.
        assert_eq!(
            pick_from_regions(&two(), g(1, 1), g(2, 2)),
            Ok(vec!["member1", "member2"])
        );
        // The region with enough clusters.
        assert_eq!(
            pick_from_regions(&two(), g(1, 1), g(3, 3)),
            Ok(vec!["member3", "member4", "member5"])
        );
        // Not enough regions, not enough clusters.
        assert_eq!(
            pick_from_regions(&two(), g(3, 3), g(3, 3)),
            Err("the number of feasible region is less than spreadConstraint.MinGroups".into())
        );
        assert_eq!(
            pick_from_regions(&two(), g(1, 1), g(4, 4)),
            Err(
                "the number of clusters is less than the cluster spreadConstraint.MinGroups".into()
            )
        );
        // Two regions with enough clusters and the highest score.
        let four = vec![
            region("R1", 90, &[("member1", 90, 40)], &info),
            region(
                "R2",
                70,
                &[
                    ("member2", 70, 40),
                    ("member3", 60, 40),
                    ("member4", 30, 40),
                ],
                &info,
            ),
            region("R3", 80, &[("member5", 80, 40), ("member6", 50, 60)], &info),
            region(
                "R4",
                50,
                &[
                    ("member7", 50, 50),
                    ("member8", 40, 50),
                    ("member9", 10, 50),
                    ("member10", 0, 50),
                ],
                &info,
            ),
        ];
        assert_eq!(
            pick_from_regions(&four, g(2, 2), g(4, 5)),
            Ok(vec!["member1", "member2", "member3", "member4"])
        );
        // More regions than minGroups when that is what holds enough clusters.
        let five = vec![
            region("R1", 70, &[("member1", 70, 40)], &info),
            region(
                "R2",
                40,
                &[
                    ("member2", 40, 40),
                    ("member3", 40, 40),
                    ("member4", 40, 40),
                ],
                &info,
            ),
            region("R3", 60, &[("member5", 60, 40), ("member6", 50, 60)], &info),
            region("R4", 70, &[("member7", 70, 100)], &info),
            region("R5", 50, &[("member8", 50, 50)], &info),
        ];
        assert_eq!(
            pick_from_regions(&five, g(1, 3), g(6, 8)),
            Ok(vec![
                "member1", "member5", "member2", "member6", "member3", "member4"
            ])
        );
    }

    #[test]
    fn group_search_prefers_weight_then_value_then_subpaths() {
        let gi = |name, value, weight| GroupInfo {
            name,
            value,
            weight,
        };
        // Karmada's example: values 2, 3, 6, 7, target 7, two groups exactly.
        let groups = vec![
            gi("a", 2, 10),
            gi("b", 3, 10),
            gi("c", 6, 10),
            gi("d", 7, 10),
        ];
        // Feasible pairs: ab? no (5); ac, ad, bc, bd, cd. Highest weight 20 for all; highest
        // value cd (13).
        assert_eq!(select_groups(groups.clone(), 2, 2, 7), Ok(vec!["c", "d"]));
        // Up to three groups: the three-group paths outweigh pairs (30 against 20); of abc
        // and abd, abd holds more (12 against 11); no qualifying path is a prefix of it.
        assert_eq!(select_groups(groups, 1, 3, 7), Ok(vec!["a", "b", "d"]));
        // The heaviest qualifying path gives way to a qualifying prefix of it.
        let groups = vec![gi("x", 5, 100), gi("y", 1, 1), gi("z", 1, 50)];
        // Searched z, y, x (value, then weight): [z, y] holds 2 < 5; [z, x] (weight 150),
        // [y, x] (101) and [x] (100) qualify; the heaviest, [x, z], gives way to its prefix
        // [x].
        assert_eq!(select_groups(groups, 1, 2, 5), Ok(vec!["x"]));
        // Nothing qualifies.
        assert_eq!(select_groups(vec![gi("a", 1, 1)], 1, 1, 2), Ok(vec![]));
    }

    #[test]
    fn group_search_is_bounded() {
        let names: Vec<String> = (0..40).map(|i| format!("r{i:02}")).collect();
        let groups: Vec<GroupInfo<'_>> = names
            .iter()
            .map(|n| GroupInfo {
                name: n,
                value: 1,
                weight: 1,
            })
            .collect();
        // 40 regions of one cluster, any 20 of them: C(40, 20) qualifying combinations.
        let err = select_groups(groups.clone(), 20, 20, 20).expect_err("bounded");
        assert!(err.contains("too many combinations of 40 regions"), "{err}");
        // When even the largest regions cannot hold enough clusters, no search is needed.
        assert_eq!(select_groups(groups, 20, 20, 1000), Ok(vec![]));
    }
}
