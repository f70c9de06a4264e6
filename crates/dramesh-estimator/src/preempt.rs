//! Preemption: for a workload that does not fit anywhere, the smallest-harm set of lower
//! priority workloads to evict, per cluster, and the cluster to preempt on.
//!
//! Per cluster the candidates are whole workloads (active pods grouped by owner) whose
//! priority is strictly lower than the preemptor's. The simulation removes all of them
//! (their pod requests and the devices of their claims are given back), checks the
//! preemptor then fits, and reprieves candidates from the highest priority down, keeping
//! each reprieve that still leaves room for all the preemptor's replicas. The cluster is
//! chosen in the order of Karmada's binding-preemption proposal: the lowest highest-victim
//! priority, then the fewest victims, then the least evicted capacity (pods, then CPU),
//! then name.
//!
//! Two implementations of that simulation give the same answers. The reference one
//! ([`simulate`]) re-estimates the whole cluster under an overlay at every step; it is used
//! without caches (`disable_cache`) and whenever the fast one does not apply. The fast one
//! ([`simulate_incremental`]) evaluates every node once with all candidates evicted and then
//! re-evaluates, per reprieve, only the nodes where that workload's pods run or its claims'
//! devices are, restoring the saved node answers when the reprieve fails. It applies when
//! node answers are independent of each other (no shared device consumed or given back, no
//! assumed workloads in the cluster, none of the preemptor's shared claims among the
//! candidates'), which is what makes per-node updates exact; it reads each pod's claim
//! allocations from the view (kept current there) and each pool's node from a table kept by
//! the device state, so it does no lookups by name. Randomized tests check both agree.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::cluster_devices::{CompactResult, name_addr};
use crate::estimate::{
    ClusterEstimate, EstimateOptions, Estimator, Factor, NodeOutcome, blank_estimate,
    estimate_cluster, finish, node_fit, tally, unknown_limited_by,
};
use crate::fit::{DeviceCache, DeviceQuery};
use crate::hash::FastMap;
use crate::overlay::Overlay;
use crate::resources::{ResList, ResName};
use crate::view::{ClusterView, NodeEntry, Owner, PodEntry, View};
use crate::workload::Workload;

/// One evicted workload.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Victim {
    /// Namespace of the workload.
    pub namespace: String,
    /// Kind of the workload (`Deployment`, `Pod`, ...).
    pub kind: String,
    /// Name of the workload.
    pub name: String,
    /// Priority of its pods.
    pub priority: i32,
    /// Pods evicted.
    pub pods: u32,
    /// Requests given back by its pods.
    pub freed: BTreeMap<String, String>,
}

/// Preemption outcome on one cluster.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPreemption {
    /// Cluster name.
    pub name: String,
    /// True when evicting the victims lets every replica of the preemptor fit.
    pub feasible: bool,
    /// Replicas of the preemptor that fit before eviction.
    pub replicas_before: i64,
    /// Replicas of the preemptor that fit after evicting the victims.
    pub replicas_after: i64,
    /// Workloads to evict, highest priority first.
    pub victims: Vec<Victim>,
    /// Requests freed by all victims.
    pub freed: BTreeMap<String, String>,
    /// Pods evicted in all.
    pub evicted_pods: u32,
    /// Priority of the highest-priority victim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub highest_victim_priority: Option<i32>,
    /// Why preemption cannot help on this cluster, when it cannot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl ClusterPreemption {
    /// No victims and no change: `before` replicas fit before and after.
    fn unchanged(name: &str, before: i64) -> ClusterPreemption {
        ClusterPreemption {
            name: name.to_string(),
            feasible: false,
            replicas_before: before,
            replicas_after: before,
            victims: Vec::new(),
            freed: BTreeMap::new(),
            evicted_pods: 0,
            highest_victim_priority: None,
            reason: None,
        }
    }
}

/// The preemption decision.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PreemptionResult {
    /// `Kind namespace/name` of the preemptor.
    pub preemptor: String,
    /// Priority of the preemptor.
    pub priority: i32,
    /// Replicas the preemptor needs.
    pub replicas: i64,
    /// Set when some cluster already fits the workload: no preemption is needed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fits_without_preemption: Option<String>,
    /// The cluster chosen for preemption.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chosen: Option<String>,
    /// Per-cluster outcomes, in cluster name order.
    pub clusters: Vec<ClusterPreemption>,
    /// Why no cluster was chosen, when none was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

struct Candidate<'v> {
    owner: Arc<Owner>,
    priority: i32,
    /// The workload's pods, by key (in no particular order: nothing depends on it).
    pods: Vec<(&'v (String, String), &'v PodEntry)>,
    requests: ResList,
}

fn candidates(c: &ClusterView, below: i32) -> Vec<Candidate<'_>> {
    // The view interns owners, so pods of one workload share one `Arc`: group by pointer
    // (no string hashing), then merge groups whose owners are equal anyway.
    let mut by_ptr: FastMap<*const Owner, usize> = FastMap::default();
    let mut groups: Vec<Candidate<'_>> = Vec::new();
    for (key, p) in c.pods() {
        if !p.active || p.priority >= below {
            continue;
        }
        let i = *by_ptr.entry(Arc::as_ptr(&p.owner)).or_insert_with(|| {
            groups.push(Candidate {
                owner: p.owner.clone(),
                priority: p.priority,
                pods: Vec::new(),
                requests: ResList::new(),
            });
            groups.len() - 1
        });
        let e = &mut groups[i];
        e.priority = e.priority.max(p.priority);
        e.pods.push((key, p));
        e.requests.add_all(&p.requests);
    }
    groups.sort_by(|a, b| a.owner.cmp(&b.owner));
    let mut v: Vec<Candidate<'_>> = Vec::with_capacity(groups.len());
    for g in groups {
        match v.last_mut() {
            Some(last) if last.owner == g.owner => {
                last.priority = last.priority.max(g.priority);
                last.pods.extend(g.pods);
                last.requests.add_all(&g.requests);
            }
            _ => v.push(g),
        }
    }
    // Reprieve order: highest priority first, then most pods (costliest to evict), then name.
    v.sort_by(|a, b| {
        b.priority
            .cmp(&a.priority)
            .then_with(|| b.pods.len().cmp(&a.pods.len()))
            .then_with(|| a.owner.cmp(&b.owner))
    });
    v
}

fn pod_keys<'k>(cand: &Candidate<'k>) -> impl Iterator<Item = &'k (String, String)> {
    cand.pods.iter().map(|(k, _)| *k)
}

/// What the eviction simulation found on one cluster.
#[derive(Debug, PartialEq)]
enum Found {
    /// Even with every candidate evicted only `replicas` fit (`limited_by` says why).
    Short { replicas: i64, limited_by: String },
    /// An answer the decision needed is a lower bound below the replicas needed (the device
    /// search gave up): whether the preemptor fits, or whether a candidate must go, is
    /// unknown, so nothing is evicted on its strength.
    Unknown { replicas: i64, limited_by: String },
    /// The preemptor fits with `after` replicas once the candidates at `evicted` (indexes
    /// into the reprieve order) are evicted.
    Fits { after: i64, evicted: Vec<usize> },
}

/// Victim selection on one cluster (without a persistent cache).
#[cfg(test)]
pub(crate) fn preempt_cluster(
    c: &ClusterView,
    w: &Workload,
    opts: &EstimateOptions,
) -> ClusterPreemption {
    let before = estimate_cluster(c, w, opts, None, None).max_replicas;
    preempt_cluster_with(c, w, opts, before, None).0
}

/// Victim selection on one cluster; the flag is true when the outcome is unknown (see
/// [`Found::Unknown`]).
fn preempt_cluster_with(
    c: &ClusterView,
    w: &Workload,
    opts: &EstimateOptions,
    before: i64,
    cache: Option<&mut DeviceCache>,
) -> (ClusterPreemption, bool) {
    let mut out = ClusterPreemption::unchanged(&c.name, before);
    if before >= w.replicas {
        out.feasible = true;
        return (out, false);
    }
    let cands = candidates(c, w.priority);
    if cands.is_empty() {
        out.reason = Some("no lower-priority workload runs here".into());
        return (out, false);
    }
    let sim = match cache {
        Some(cache) => match simulate_incremental(c, w, opts, &cands, &mut *cache) {
            Some(sim) => sim,
            None => simulate(c, w, opts, &cands, Some(cache)),
        },
        None => simulate(c, w, opts, &cands, None),
    };
    let (after, evicted) = match sim {
        Found::Short {
            replicas,
            limited_by,
        } => {
            out.replicas_after = replicas;
            out.reason = Some(format!(
                "even evicting every lower-priority workload leaves room for {replicas} of {} replicas ({limited_by})",
                w.replicas
            ));
            return (out, false);
        }
        Found::Unknown {
            replicas,
            limited_by,
        } => {
            out.replicas_after = replicas;
            out.reason = Some(format!(
                "unknown whether preemption lets {} replicas fit: the device allocation search gave up ({limited_by}; at least {replicas} fit); nothing is evicted on an unknown answer",
                w.replicas
            ));
            return (out, true);
        }
        Found::Fits { after, evicted } => (after, evicted),
    };
    let mut freed = ResList::new();
    for v in evicted.iter().map(|&i| &cands[i]) {
        freed.add_all(&v.requests);
        out.evicted_pods += v.pods.len() as u32;
        out.victims.push(Victim {
            namespace: v.owner.namespace.clone(),
            kind: v.owner.kind.clone(),
            name: v.owner.name.clone(),
            priority: v.priority,
            pods: v.pods.len() as u32,
            freed: v.requests.to_map(),
        });
    }
    out.highest_victim_priority = evicted.iter().map(|&i| cands[i].priority).max();
    out.freed = freed.to_map();
    out.feasible = true;
    out.replicas_after = after;
    (out, false)
}

/// The reference simulation: a whole-cluster estimate under an overlay per step.
fn simulate(
    c: &ClusterView,
    w: &Workload,
    opts: &EstimateOptions,
    cands: &[Candidate<'_>],
    mut cache: Option<&mut DeviceCache>,
) -> Found {
    let mut overlay = Overlay::default();
    for cand in cands {
        overlay.remove_pods(c, pod_keys(cand));
    }
    let first = estimate_cluster(c, w, opts, Some(&overlay), cache.as_deref_mut());
    if first.max_replicas < w.replicas {
        return short(first);
    }
    let mut after = first.max_replicas;
    let mut evicted = Vec::new();
    for (i, cand) in cands.iter().enumerate() {
        // Try giving this workload its pods back.
        overlay.restore_pods(c, pod_keys(cand));
        let est = estimate_cluster(c, w, opts, Some(&overlay), cache.as_deref_mut());
        if est.max_replicas >= w.replicas {
            after = est.max_replicas;
        } else if est.is_lower_bound() {
            return short(est);
        } else {
            overlay.remove_pods(c, pod_keys(cand));
            evicted.push(i);
        }
    }
    Found::Fits { after, evicted }
}

/// An answer below the replicas needed: a proof ([`Found::Short`]) or, when it is a lower
/// bound, unknown ([`Found::Unknown`]).
fn short(e: ClusterEstimate) -> Found {
    if e.is_lower_bound() {
        Found::Unknown {
            replicas: e.max_replicas,
            limited_by: e.limited_by,
        }
    } else {
        Found::Short {
            replicas: e.max_replicas,
            limited_by: e.limited_by,
        }
    }
}

/// A claim used by candidate pods, in the incremental simulation.
struct ClaimSlot {
    /// Whether the what-if gives its devices back; follows the same set operations as
    /// `Overlay::removed_claims` (restoring any pod that uses the claim clears it, evicting
    /// any such pod sets it).
    removed: bool,
    /// Range in `Incremental::claim_nodes`: the nodes whose local pools hold its devices.
    nodes: (u32, u32),
}

/// One candidate's footprint in node and claim indexes.
struct Footprint<'v> {
    /// (node index, requests) of each pod bound to a node of the view.
    pods: Vec<(u32, &'v ResList)>,
    /// Claims of its pods (deduplicated).
    claims: Vec<u32>,
}

/// Per-node state of the incremental simulation.
struct Incremental<'v> {
    c: &'v ClusterView,
    w: &'v Workload,
    nodes: Vec<&'v NodeEntry>,
    /// Requests and pod slots given back per node (an entry with no pods counts as none).
    freed: Vec<(ResList, u32)>,
    slots: Vec<ClaimSlot>,
    /// The allocation of each claim slot.
    allocations: &'v [Arc<[CompactResult]>],
    claim_nodes: Vec<u32>,
    /// node -> claims with devices in its pools: `node_claims[node_start[i]..node_start[i+1]]`.
    node_start: Vec<u32>,
    node_claims: Vec<u32>,
    devq: Option<DeviceQuery<'v>>,
    outcomes: Vec<Result<NodeOutcome, String>>,
    /// Sum of the replicas of all node outcomes, how many are errors, and how many gave up
    /// (their count is a lower bound).
    sum: i128,
    errors: usize,
    unknown: u32,
    cap: Option<i64>,
}

impl<'v> Incremental<'v> {
    fn nodes_of(&self, k: u32) -> &[u32] {
        let (start, len) = self.slots[k as usize].nodes;
        &self.claim_nodes[start as usize..(start + len) as usize]
    }

    /// The node's outcome under the current what-if, or `None` once answers start to depend
    /// on node order (the incremental simulation then does not apply).
    fn eval(&mut self, i: usize) -> Option<Result<NodeOutcome, String>> {
        let node = self.nodes[i];
        let freed = &self.freed[i];
        let freed = (freed.1 > 0).then_some(freed);
        if let Some(q) = self.devq.as_mut() {
            let released = q.node_release_mut();
            released.clear();
            let claims =
                &self.node_claims[self.node_start[i] as usize..self.node_start[i + 1] as usize];
            for &k in claims {
                if self.slots[k as usize].removed {
                    released.push(&self.allocations[k as usize]);
                }
            }
        }
        let o = node_fit(self.c, self.w, node, freed, None, self.devq.as_mut());
        if self.devq.as_ref().is_some_and(|q| q.order_dependent()) {
            return None;
        }
        Some(o)
    }

    fn count(&mut self, o: &Result<NodeOutcome, String>, sign: i128) {
        match o {
            Ok(NodeOutcome::Fit { replicas, factor }) => {
                self.sum += sign * i128::from(*replicas);
                if *factor == Some(Factor::Unknown) {
                    if sign > 0 {
                        self.unknown += 1;
                    } else {
                        self.unknown = self.unknown.saturating_sub(1);
                    }
                }
            }
            Ok(NodeOutcome::Excluded(_)) => {}
            Err(_) => {
                if sign > 0 {
                    self.errors += 1;
                } else {
                    self.errors = self.errors.saturating_sub(1);
                }
            }
        }
    }

    /// Replaces node `i`'s outcome, returning the old one.
    fn set(&mut self, i: usize, o: Result<NodeOutcome, String>) -> Result<NodeOutcome, String> {
        self.count(&o, 1);
        let old = std::mem::replace(&mut self.outcomes[i], o);
        self.count(&old, -1);
        old
    }

    /// Re-evaluates node `i` (excluded nodes stay excluded: exclusion does not depend on
    /// what is evicted). Returns the old outcome, or `None` as for [`Self::eval`].
    fn refresh(&mut self, i: usize) -> Option<Result<NodeOutcome, String>> {
        if matches!(self.outcomes[i], Ok(NodeOutcome::Excluded(_))) {
            return Some(self.outcomes[i].clone());
        }
        let o = self.eval(i)?;
        Some(self.set(i, o))
    }

    /// The cluster answer of the current what-if, as `estimate_cluster` would give it, and
    /// whether it is a lower bound ([`ClusterEstimate::is_lower_bound`]).
    fn max_replicas(&self) -> (i64, bool) {
        if self.errors > 0 {
            return (0, false);
        }
        let total = i64::try_from(self.sum).unwrap_or(i64::MAX);
        match self.cap {
            Some(cap) if cap < total => (cap, false),
            _ => (total, self.unknown > 0),
        }
    }

    fn set_claims(&mut self, claims: &[u32], removed: bool, touched: &mut Touched) {
        for &k in claims {
            if self.slots[k as usize].removed != removed {
                self.slots[k as usize].removed = removed;
                for &n in self.nodes_of(k) {
                    touched.add(n);
                }
            }
        }
    }

    fn give_back(&mut self, fp: &Footprint<'_>, touched: &mut Touched) {
        for &(n, req) in &fp.pods {
            let e = &mut self.freed[n as usize];
            e.0.add_all(req);
            e.1 += 1;
            touched.add(n);
        }
    }

    fn take_back(&mut self, fp: &Footprint<'_>, touched: &mut Touched) {
        for &(n, req) in &fp.pods {
            let e = &mut self.freed[n as usize];
            e.0.sub_all(req);
            e.1 = e.1.saturating_sub(1);
            touched.add(n);
        }
    }
}

/// Node indexes touched by one step, each once.
struct Touched {
    stamp: Vec<u32>,
    epoch: u32,
    list: Vec<u32>,
}

impl Touched {
    fn new(nodes: usize) -> Touched {
        Touched {
            stamp: vec![0; nodes],
            epoch: 1,
            list: Vec::new(),
        }
    }

    fn add(&mut self, n: u32) {
        let s = &mut self.stamp[n as usize];
        if *s != self.epoch {
            *s = self.epoch;
            self.list.push(n);
        }
    }

    fn take(&mut self) -> Vec<u32> {
        self.epoch += 1;
        std::mem::take(&mut self.list)
    }
}

/// The same simulation as [`simulate`], computed incrementally: every node is evaluated
/// once with all candidates evicted, then each reprieve re-evaluates only the nodes where
/// the reprieved workload's pods run or its claims' devices are, and a failed reprieve puts
/// the saved answers back. This is exact because, when no answer depends on node order (no
/// shared device is consumed or given back, no assumed workloads, the preemptor's shared
/// claims untouched), a node's answer depends only on its own pods and local devices; the
/// node's device question carries exactly the releases of claims with devices in its pools.
/// `None` when those conditions do not hold: the caller then runs [`simulate`].
fn simulate_incremental(
    c: &ClusterView,
    w: &Workload,
    opts: &EstimateOptions,
    cands: &[Candidate<'_>],
    cache: &mut DeviceCache,
) -> Option<Found> {
    if c.nodes.is_empty() || !opts.assumed.cluster(&c.name).is_empty() {
        return None;
    }
    let devices = c.devices();
    let nodes: Vec<&NodeEntry> = c.nodes.values().collect();
    // Node names are interned (a pod's node and the node entry share one `Arc`), so nodes
    // are found by address; by name only for a name that is not shared.
    let by_addr: FastMap<usize, u32> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (name_addr(&n.name), i as u32))
        .collect();
    let mut by_name: Option<FastMap<&str, u32>> = None;
    let mut index_of = |name: &Arc<str>| -> Option<u32> {
        if let Some(&i) = by_addr.get(&name_addr(name)) {
            return Some(i);
        }
        by_name
            .get_or_insert_with(|| {
                nodes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| (&*n.name, i as u32))
                    .collect()
            })
            .get(&**name)
            .copied()
    };
    // Claims by address: only allocated claims the view holds matter (the others give
    // nothing back), and their entries are unique.
    let mut slot_of: FastMap<*const CompactResult, u32> = FastMap::default();
    let mut slots: Vec<ClaimSlot> = Vec::new();
    let mut allocations: Vec<Arc<[CompactResult]>> = Vec::new();
    let mut claim_nodes: Vec<u32> = Vec::new();
    // Scratch: the nodes of one claim's devices.
    let mut homes: Vec<u32> = Vec::new();
    let mut freed: Vec<(ResList, u32)> = vec![(ResList::new(), 0); nodes.len()];
    let mut footprints = Vec::with_capacity(cands.len());
    for cand in cands {
        let mut fp = Footprint {
            pods: Vec::with_capacity(cand.pods.len()),
            claims: Vec::new(),
        };
        for (_, p) in &cand.pods {
            // Pods bound to a node the view does not have give back nothing anyone reads.
            let pod_node = p.node.as_ref().and_then(&mut index_of);
            if let Some(n) = pod_node {
                fp.pods.push((n, &*p.requests));
                let e = &mut freed[n as usize];
                e.0.add_all(&p.requests);
                e.1 += 1;
            }
            // The view keeps each pod's claim allocations current: no lookups by name.
            for handle in p.claim_handles.iter() {
                let Some(allocation) = handle.get().filter(|a| !a.is_empty()) else {
                    continue;
                };
                if let Some(&k) = slot_of.get(&allocation.as_ptr()) {
                    fp.claims.push(k);
                    continue;
                }
                let k = slots.len() as u32;
                homes.clear();
                for r in allocation.iter() {
                    // Devices of a shared pool (or of a pool spread over nodes) change what
                    // several nodes see: not for the incremental simulation.
                    let home = devices.home_of(r)?;
                    if let Some(n) = index_of(home) {
                        homes.push(n);
                    }
                }
                homes.sort_unstable();
                homes.dedup();
                slots.push(ClaimSlot {
                    removed: true,
                    nodes: (claim_nodes.len() as u32, homes.len() as u32),
                });
                claim_nodes.extend_from_slice(&homes);
                slot_of.insert(allocation.as_ptr(), k);
                allocations.push(allocation);
                fp.claims.push(k);
            }
        }
        fp.claims.sort_unstable();
        fp.claims.dedup();
        footprints.push(fp);
    }
    // Giving back one of the preemptor's own shared claims changes its node selectors.
    if !w.shared_claims.is_empty()
        && cands.iter().flat_map(|c| &c.pods).any(|(key, p)| {
            key.0 == w.namespace && p.claims.iter().any(|n| w.shared_claims.contains(n))
        })
    {
        return None;
    }
    // node -> claims, as one flat list with offsets.
    let mut node_start = vec![0u32; nodes.len() + 1];
    for &n in &claim_nodes {
        node_start[n as usize + 1] += 1;
    }
    for i in 0..nodes.len() {
        node_start[i + 1] += node_start[i];
    }
    let mut fill = node_start.clone();
    let mut node_claims = vec![0u32; claim_nodes.len()];
    for (k, slot) in slots.iter().enumerate() {
        let (start, len) = slot.nodes;
        for &n in &claim_nodes[start as usize..(start + len) as usize] {
            node_claims[fill[n as usize] as usize] = k as u32;
            fill[n as usize] += 1;
        }
    }
    let mut devq = DeviceQuery::prepare(
        c,
        w,
        None,
        Some(cache),
        &mut None,
        opts.max_allocation_steps,
    )
    .ok()?;
    if let Some(q) = devq.as_mut() {
        if q.order_dependent() {
            return None;
        }
        q.release_per_node();
    }
    let cap = opts
        .quotas
        .as_ref()
        .and_then(|q| q.limit(&c.name, w, c))
        .map(|(cap, _)| cap);
    let mut sim = Incremental {
        c,
        w,
        freed,
        slots,
        allocations: &allocations,
        claim_nodes,
        node_start,
        node_claims,
        devq,
        outcomes: Vec::with_capacity(nodes.len()),
        nodes,
        sum: 0,
        errors: 0,
        unknown: 0,
        cap,
    };
    // Everything evicted: the whole-cluster estimate, node by node in name order.
    let mut first = blank_estimate(c);
    for i in 0..sim.nodes.len() {
        let o = sim.eval(i)?;
        if !tally(&mut first, &o) {
            return Some(Found::Short {
                replicas: first.max_replicas,
                limited_by: first.limited_by,
            });
        }
        sim.count(&o, 1);
        sim.outcomes.push(o);
    }
    finish(&mut first, c, w, opts);
    if first.max_replicas < w.replicas {
        return Some(short(first));
    }
    let mut after = first.max_replicas;
    let mut evicted = Vec::new();
    let mut touched = Touched::new(sim.nodes.len());
    for (ci, fp) in footprints.iter().enumerate() {
        let was: Vec<bool> = fp
            .claims
            .iter()
            .map(|&k| sim.slots[k as usize].removed)
            .collect();
        sim.take_back(fp, &mut touched);
        sim.set_claims(&fp.claims, false, &mut touched);
        let changed = touched.take();
        let mut saved = Vec::with_capacity(changed.len());
        for &n in &changed {
            saved.push(sim.refresh(n as usize)?);
        }
        let (max, lower_bound) = sim.max_replicas();
        if max >= w.replicas {
            after = max;
            continue;
        }
        if lower_bound {
            return Some(Found::Unknown {
                replicas: max,
                limited_by: unknown_limited_by(sim.unknown),
            });
        }
        evicted.push(ci);
        sim.give_back(fp, &mut touched);
        sim.set_claims(&fp.claims, true, &mut touched);
        touched.take();
        for (&n, old) in changed.iter().zip(saved) {
            // The answer it replaces is the one just computed for the reprieve.
            let _ = sim.set(n as usize, old);
        }
        // A claim this workload shares with a workload reprieved earlier was not given back
        // before this step but is now (the overlay's set semantics): its nodes changed.
        for (&k, &before) in fp.claims.iter().zip(&was) {
            if !before {
                for &n in sim.nodes_of(k) {
                    touched.add(n);
                }
            }
        }
        for n in touched.take() {
            let _ = sim.refresh(n as usize)?;
        }
    }
    Some(Found::Fits { after, evicted })
}

fn cpu_of(freed: &BTreeMap<String, String>) -> i64 {
    freed
        .get(ResName::Cpu.as_str())
        .and_then(|s| dramesh_model::Quantity::parse(s).ok())
        .map_or(0, |q| i64::try_from(q.milli_ceil()).unwrap_or(i64::MAX))
}

/// A stale cluster's [`ClusterPreemption::reason`].
const STALE_REASON: &str = "the cluster's data is stale: preemption never chooses it";

/// Chooses victims and the cluster to preempt on for `w`. Clusters in
/// [`EstimateOptions::stale`] are neither `fits_without_preemption` nor `chosen`.
pub fn preempt(
    view: &View,
    w: &Workload,
    estimator: &mut Estimator,
    opts: &EstimateOptions,
) -> PreemptionResult {
    let mut result = PreemptionResult {
        preemptor: w.id(),
        priority: w.priority,
        replicas: w.replicas,
        fits_without_preemption: None,
        chosen: None,
        clusters: Vec::new(),
        reason: None,
    };
    let est = estimator.estimate(view, w, opts);
    if let Some(fit) = est
        .clusters
        .iter()
        .filter(|c| c.max_replicas >= w.replicas && !opts.stale.contains(&c.name))
        .max_by(|a, b| {
            a.max_replicas
                .cmp(&b.max_replicas)
                .then_with(|| b.name.cmp(&a.name))
        })
    {
        result.fits_without_preemption = Some(fit.name.clone());
        return result;
    }
    if !w.preempt_lower_priority {
        result.reason = Some("the workload's preemptionPolicy is Never".into());
        return result;
    }
    let mut unknown = Vec::new();
    for c in view.clusters() {
        if !opts.clusters.is_empty() && !opts.clusters.contains(&c.name) {
            continue;
        }
        let before = est.cluster(&c.name).map(|e| e.max_replicas).unwrap_or(0);
        if opts.past_deadline() {
            result.clusters.push(ClusterPreemption {
                reason: Some(crate::estimate::DEADLINE_EXCEEDED.into()),
                ..ClusterPreemption::unchanged(&c.name, before)
            });
            continue;
        }
        if opts.stale.contains(&c.name) {
            // Victims chosen from stale data could be gone or could not be enough.
            result.clusters.push(ClusterPreemption {
                reason: Some(STALE_REASON.into()),
                ..ClusterPreemption::unchanged(&c.name, before)
            });
            continue;
        }
        let w = match c.workload(w) {
            Ok(w) => w,
            Err(e) => {
                result.clusters.push(ClusterPreemption {
                    reason: Some(e),
                    ..ClusterPreemption::unchanged(&c.name, before)
                });
                continue;
            }
        };
        let cache = if opts.disable_cache {
            None
        } else {
            Some(estimator.device_cache.entry(c.name.clone()).or_default())
        };
        let (p, gave_up) = preempt_cluster_with(c, &w, opts, before, cache);
        if gave_up {
            unknown.push(c.name.clone());
        }
        result.clusters.push(p);
    }
    let best = result
        .clusters
        .iter()
        .filter(|c| c.feasible && !c.victims.is_empty())
        .min_by(|a, b| {
            a.highest_victim_priority
                .cmp(&b.highest_victim_priority)
                .then_with(|| a.victims.len().cmp(&b.victims.len()))
                .then_with(|| a.evicted_pods.cmp(&b.evicted_pods))
                .then_with(|| cpu_of(&a.freed).cmp(&cpu_of(&b.freed)))
                .then_with(|| a.name.cmp(&b.name))
        });
    match best {
        Some(b) => result.chosen = Some(b.name.clone()),
        None if unknown.is_empty() => {
            result.reason = Some("no cluster can fit the workload even after preemption".into())
        }
        None => {
            result.reason = Some(format!(
                "no cluster is known to fit the workload even after preemption; on {} the device allocation search gave up, so whether it fits there is unknown",
                unknown.join(", ")
            ))
        }
    }
    result
}

#[cfg(test)]
mod tests {
    //! The incremental simulation against the reference one (whole-cluster estimates with
    //! no cache) on random small fleets, including claims shared between workloads,
    //! finished pods, pods without devices, excluded nodes, quotas and shared devices.

    use std::collections::{BTreeMap, HashMap};
    use std::sync::Arc;

    use dramesh_model::ClusterObject;
    use dramesh_model::k8s::{Pod, ResourceClaimTemplate};
    use serde_json::json;

    use super::*;
    use crate::quota::{ClusterQuota, QuotaSet};
    use crate::test_fleet::{Lcg, fleet, random_spec};
    use dramesh_sim::typed::{self, FleetSpec};

    fn workload(gpus: i64, cpu: &str, selector: bool, priority: i32) -> Workload {
        let tpl: ResourceClaimTemplate = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "gpu", "namespace": "default"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": typed::CLASS, "count": gpus}}]}}}
        }))
        .expect("template");
        let mut templates = HashMap::new();
        templates.insert(("default".to_string(), "gpu".to_string()), Arc::new(tpl));
        let mut spec = json!({
            "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": "8Gi"}}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
        });
        if selector {
            spec["nodeSelector"] = json!({"gpu": "a100"});
        }
        let mut w = Workload::from_pod_spec(
            "Job",
            "default",
            "preemptor",
            1,
            serde_json::from_value(spec).expect("spec"),
            &templates,
        )
        .expect("workload");
        w.priority = priority;
        w
    }

    fn pod(
        name: &str,
        node: &str,
        owner: &str,
        priority: i32,
        claims: &[&str],
        phase: &str,
    ) -> Pod {
        let statuses: Vec<serde_json::Value> = claims
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"name": format!("c{i}"), "resourceClaimName": c}))
            .collect();
        let refs: Vec<serde_json::Value> = (0..claims.len())
            .map(|i| json!({"name": format!("c{i}"), "resourceClaimName": claims[i]}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet",
                                     "name": owner, "uid": "u", "controller": true}]},
            "spec": {"nodeName": node, "priority": priority,
                     "containers": [{"name": "c", "resources": {"requests": {"cpu": "30"}}}],
                     "resourceClaims": refs},
            "status": {"phase": phase, "resourceClaimStatuses": statuses}
        }))
        .expect("pod")
    }

    fn shared_pool_claim(name: &str, device: usize) -> ClusterObject {
        ClusterObject::ResourceClaim(Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "gpu",
                    "exactly": {"deviceClassName": typed::CLASS}}]}},
                "status": {"allocation": {"devices": {"results": [{
                    "request": "gpu", "driver": typed::DRIVER, "pool": "shared",
                    "device": format!("net-gpu-{device}")}]}}}
            }))
            .expect("claim"),
        ))
    }

    fn shared_slice(devices: usize) -> ClusterObject {
        let devs: Vec<serde_json::Value> = (0..devices)
            .map(|i| json!({"name": format!("net-gpu-{i}")}))
            .collect();
        ClusterObject::ResourceSlice(Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": "shared-gpus"},
                "spec": {"driver": typed::DRIVER, "allNodes": true,
                         "pool": {"name": "shared", "generation": 1, "resourceSliceCount": 1},
                         "devices": devs}
            }))
            .expect("slice"),
        ))
    }

    /// Runs both simulations on every cluster; returns how many took the incremental path.
    fn compare(view: &View, w: &Workload, opts: &EstimateOptions, label: &str) -> usize {
        let mut incremental = 0;
        for c in view.clusters() {
            // Device caches are per cluster (as in `Estimator`).
            let mut cache = DeviceCache::default();
            let cands = candidates(c, w.priority);
            if cands.is_empty() {
                continue;
            }
            let reference = simulate(c, w, opts, &cands, None);
            // Twice with one cache: cold, then with the answers the first run cached.
            for round in 0..2 {
                if let Some(fast) = simulate_incremental(c, w, opts, &cands, &mut cache) {
                    assert_eq!(fast, reference, "{label}: cluster {} round {round}", c.name);
                    incremental += 1;
                }
            }
        }
        incremental
    }

    #[test]
    fn incremental_simulation_equals_reference_on_random_fleets() {
        let mut rng = Lcg(11);
        let mut incremental = 0;
        let mut fits = 0;
        for round in 0..12 {
            let spec = random_spec(&mut rng, (3, 10), (1, 6), None);
            let nodes = spec.nodes_per_cluster;
            let salt = rng.next(100) as usize;
            let gpus = spec.gpus_per_node;
            let mut view = fleet(&spec, &move |n| (n * 3 + salt) % (gpus + 1)).expect("fleet");
            for ci in 0..3 {
                let c = format!("c{ci}");
                // A claim shared by pods of two workloads, a finished pod, a pod with no
                // devices, and a node without devices that a node selector excludes.
                let n0 = format!("{c}-n0");
                let n1 = format!("{c}-n{}", 1 % nodes);
                let claim = format!("{n0}-gpu-0");
                if view
                    .cluster(&c)
                    .is_some_and(|v| v.devices().has_claim("default", &claim))
                {
                    let p = pod(
                        "sharer",
                        &n0,
                        "sharer",
                        50 + rng.next(300) as i32,
                        &[&claim],
                        "Running",
                    );
                    view.apply_object(&c, ClusterObject::Pod(Arc::new(p)))
                        .expect("pod");
                }
                // Claims changing after their pods: one moves to another device, one is
                // deleted, one arrives after the pod that uses it.
                let last = format!("{c}-n{}", nodes - 1);
                let moved = format!("{last}-gpu-0");
                if view
                    .cluster(&c)
                    .is_some_and(|v| v.devices().has_claim("default", &moved))
                {
                    let again = typed::allocated_claim("default", &moved, &last, gpus - 1);
                    view.apply_object(&c, ClusterObject::ResourceClaim(Arc::new(again)))
                        .expect("claim");
                }
                view.apply(
                    &c,
                    &dramesh_model::ObjectChange::Delete {
                        key: dramesh_model::ObjectKey::new(
                            dramesh_model::ObjectKind::ResourceClaim,
                            Some("default"),
                            &format!("{n1}-gpu-1"),
                        ),
                    },
                )
                .expect("delete");
                let late = pod(
                    "late",
                    &n1,
                    "late",
                    rng.next(300) as i32,
                    &["late-claim"],
                    "Running",
                );
                view.apply_object(&c, ClusterObject::Pod(Arc::new(late)))
                    .expect("pod");
                let claim = typed::allocated_claim("default", "late-claim", &n1, gpus - 1);
                view.apply_object(&c, ClusterObject::ResourceClaim(Arc::new(claim)))
                    .expect("claim");
                let done = pod("done", &n1, "done", 0, &[], "Succeeded");
                view.apply_object(&c, ClusterObject::Pod(Arc::new(done)))
                    .expect("pod");
                let hog = pod("hog", &n1, "hog", rng.next(400) as i32, &[], "Running");
                view.apply_object(&c, ClusterObject::Pod(Arc::new(hog)))
                    .expect("pod");
                let plain = typed::node(
                    &format!("{c}-plain"),
                    [("gpu".to_string(), "none".to_string())]
                        .into_iter()
                        .collect(),
                );
                view.apply_object(&c, ClusterObject::Node(Arc::new(plain)))
                    .expect("node");
            }
            // c2 has network-attached devices, one of them held by a low-priority pod.
            view.apply_object("c2", shared_slice(2)).expect("slice");
            view.apply_object("c2", shared_pool_claim("net-0", 0))
                .expect("claim");
            let p = pod("net-user", "c2-n0", "net-user", 10, &["net-0"], "Running");
            view.apply_object("c2", ClusterObject::Pod(Arc::new(p)))
                .expect("pod");

            for probe in 0..4 {
                let w = workload(
                    1 + rng.next(2) as i64,
                    ["1", "20", "60"][rng.next(3) as usize],
                    rng.next(2) == 0,
                    100 + rng.next(400) as i32,
                );
                let mut opts = EstimateOptions::default();
                if probe == 3 {
                    let mut clusters = BTreeMap::new();
                    clusters.insert(
                        "c1".to_string(),
                        ClusterQuota {
                            nominal: [("cpu".to_string(), "200".to_string())].into(),
                            used: BTreeMap::new(),
                        },
                    );
                    opts.quotas = Some(QuotaSet {
                        clusters,
                        ..Default::default()
                    });
                }
                let before = Estimator::new().estimate(&view, &w, &opts);
                for c in &before.clusters {
                    let mut w = w.clone();
                    // Just more than fits, or far more: both outcomes get exercised.
                    w.replicas = c.max_replicas + 1 + rng.next(3 * nodes as u64) as i64;
                    let label = format!("round {round} probe {probe} replicas {}", w.replicas);
                    incremental += compare(&view, &w, &opts, &label);
                    if let Some(cv) = view.cluster(&c.name) {
                        let r = preempt_cluster(cv, &w, &opts);
                        if r.feasible {
                            fits += 1;
                        }
                    }
                }
            }
        }
        assert!(
            incremental > 100,
            "incremental path taken {incremental} times"
        );
        assert!(fits > 10, "preemption succeeded {fits} times");
    }

    #[test]
    fn shared_devices_fall_back_to_the_reference() {
        let spec = FleetSpec {
            clusters: 1,
            nodes_per_cluster: 3,
            gpus_per_node: 2,
            owners_per_cluster: 1,
            kubernetes_version: "1.36".into(),
        };
        let mut view = fleet(&spec, &|_| 2).expect("fleet");
        view.apply_object("c0", shared_slice(1)).expect("slice");
        view.apply_object("c0", shared_pool_claim("net-0", 0))
            .expect("claim");
        let p = pod("net-user", "c0-n0", "net-user", 10, &["net-0"], "Running");
        view.apply_object("c0", ClusterObject::Pod(Arc::new(p)))
            .expect("pod");
        let mut w = workload(1, "1", false, 1000);
        w.replicas = 4;
        let c = view.cluster("c0").expect("cluster");
        let cands = candidates(c, w.priority);
        let opts = EstimateOptions::default();
        let mut cache = DeviceCache::default();
        assert_eq!(
            simulate_incremental(c, &w, &opts, &cands, &mut cache),
            None,
            "giving back a shared device affects every node"
        );
        // Without the shared claim among the candidates the incremental path applies.
        w.priority = 5;
        let p = pod("local", "c0-n1", "local", 1, &["c0-n1-gpu-0"], "Running");
        view.apply_object("c0", ClusterObject::Pod(Arc::new(p)))
            .expect("pod");
        let c = view.cluster("c0").expect("cluster");
        let cands = candidates(c, w.priority);
        assert!(cands.iter().all(|c| c.owner.name != "net-user"));
        let fast = simulate_incremental(c, &w, &opts, &cands, &mut cache);
        assert!(fast.is_some());
        assert_eq!(fast, Some(simulate(c, &w, &opts, &cands, None)));
    }
}
