//! Max-available-replicas estimation (Karmada `MaxAvailableReplicas` semantics, extended
//! with DRA devices), component sets (`MaxAvailableComponentSets`), assumed in-flight
//! workloads and per-cluster explanations.
//!
//! Per cluster: every node that passes the replica's node claim contributes
//! `min(min over requested resources of floor(free / request), free pod slots,
//! device-fit)` replicas, where free = allocatable - requests of active pods bound to the
//! node - assumed workloads (first-fit, as Karmada deducts them). Device-fit is the number
//! of replicas that each get a fresh allocation, one after another, from the engine (see
//! [`crate::fit`]). The cluster answer is the sum, further capped by an optional quota.
//!
//! Assumed workloads that carry device claims are placed first-fit replica by replica with
//! the same device count (requests and an engine allocation must both fit on the node); the
//! allocations they get are part of the device state the estimate counts against. Assumed
//! workloads without claims are deducted by requests and pod slots only. Results computed
//! with assumed workloads are never memoized, and per-node device answers are neither read
//! nor stored for nodes whose devices assumed replicas hold.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::assumed::{
    Assumed, AssumedList, DeductionLog, NodeFree, Reach, assumed_deductions, node_free,
};
use crate::filter::NodeClaim;
use crate::fit::{AssumedDevices, DeviceCache, DeviceQuery};
use crate::hash::{FastMap, FastSet};
use crate::headroom::{
    ClusterHeadroom, HeadroomOptions, NodeCount, PoolPlan, cluster_headroom, plan,
};
use crate::overlay::Overlay;
use crate::quota::QuotaSet;
use crate::resources::{ResList, ResName};
use crate::view::{ClusterView, NodeEntry, View};
use crate::workload::Workload;

/// Options of one estimate.
#[derive(Debug, Clone, Default)]
pub struct EstimateOptions {
    /// In-flight workloads deducted first (Karmada's assumed workloads).
    pub assumed: Assumed,
    /// Quota caps, when any.
    pub quotas: Option<QuotaSet>,
    /// Restrict to these clusters (all when empty).
    pub clusters: Vec<String>,
    /// Compute every node replica by replica, ignoring result caches (the reference path
    /// the caches are tested against).
    pub disable_cache: bool,
    /// Search budget of each engine allocation in steps; `None` is the engine's default
    /// ([`dramesh_engine::DEFAULT_MAX_STEPS`]). Tests and benchmarks lower it to make the
    /// engine give up.
    pub max_allocation_steps: Option<u64>,
    /// Clusters whose data the caller considers stale (a replica's data-age rule): placement
    /// and preemption never choose them. Estimates ignore it (they report every cluster).
    pub stale: Vec<String>,
    /// When the caller stops waiting. Past it, every cluster and node not computed yet is
    /// answered as an error ([`DEADLINE_EXCEEDED`]) without computing, so a worker whose
    /// caller gave up is freed within one node's work. Checked between nodes, never inside
    /// an allocation search, so what the caches keep is always complete.
    pub deadline: Option<Instant>,
    /// Raised when the caller stops waiting before the deadline (its client went away):
    /// treated as a passed deadline.
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Scale-up headroom from Karpenter NodePools (see `crate::headroom`): `None` does not
    /// compute it (the default); with it every cluster with NodePools reports
    /// [`ClusterEstimate::headroom`], added to `max_replicas` when
    /// [`HeadroomOptions::count`] says so.
    pub headroom: Option<HeadroomOptions>,
}

/// The error of clusters left out because [`EstimateOptions::deadline`] passed.
pub const DEADLINE_EXCEEDED: &str = "deadline exceeded: the caller stopped waiting";

/// Nodes between two deadline checks inside one cluster: a node costs about a microsecond,
/// a clock read tens of nanoseconds.
const NODES_PER_DEADLINE_CHECK: usize = 64;

impl EstimateOptions {
    /// Whether the deadline has passed or the caller stopped waiting.
    pub fn past_deadline(&self) -> bool {
        self.stop
            .as_ref()
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::Acquire))
            || self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// [`EstimateOptions::past_deadline`], read only at every
    /// [`NODES_PER_DEADLINE_CHECK`]-th node `i` of a loop.
    fn past_deadline_at(&self, i: usize) -> bool {
        i.is_multiple_of(NODES_PER_DEADLINE_CHECK) && self.past_deadline()
    }
}

/// The estimate of one cluster.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterEstimate {
    /// Cluster name.
    pub name: String,
    /// Replicas of the workload that fit.
    pub max_replicas: i64,
    /// What limited the answer: a resource name, `pods`, `devices`, `quota:<name>`,
    /// `no nodes`, `no node passes filters`, an error text, or, when the device search gave
    /// up on some node, `unknown: allocation budget exhausted on N node(s)` (then
    /// `max_replicas` is a lower bound; see [`ClusterEstimate::is_lower_bound`]).
    pub limited_by: String,
    /// Excluded node counts by reason (`nodeSelector`, `nodeAffinity`, `taints`, `unschedulable`).
    pub excluded_nodes: BTreeMap<String, u32>,
    /// Nodes that passed the filters, and how many of them limit on each factor.
    pub nodes_considered: u32,
    /// How many considered nodes limit on each factor.
    pub limits: BTreeMap<String, u32>,
    /// The cluster's Kubernetes version, when it reported one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubernetes_version: Option<String>,
    /// Why the cluster could not be estimated, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Replicas of assumed workloads that fit on no node (by requests, pod slots or
    /// devices) and so were not deducted, as Karmada drops them.
    #[serde(skip_serializing_if = "is_zero")]
    pub assumed_unplaced: i64,
    /// Considered nodes whose device search ran out of budget: for each, whether one more
    /// replica fits is unknown (not "no"), and its share of `max_replicas` is a lower bound.
    #[serde(skip_serializing_if = "is_zero_u32")]
    pub unknown_nodes: u32,
    /// Replicas new nodes of the cluster's Karpenter NodePools could hold, when headroom was
    /// asked for ([`EstimateOptions::headroom`]) and the cluster has NodePools. Part of
    /// `max_replicas` only when [`HeadroomOptions::count`] was set; `limited_by` then ends
    /// with its summary either way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headroom: Option<ClusterHeadroom>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// `limited_by` of an answer that is a lower bound because the device search gave up on
/// `nodes` nodes.
pub(crate) fn unknown_limited_by(nodes: u32) -> String {
    format!("{LIMIT_UNKNOWN}: allocation budget exhausted on {nodes} node(s)")
}

impl ClusterEstimate {
    /// True when `max_replicas` is only a lower bound: the device search gave up on some
    /// node and nothing exact (a quota) caps the answer below what was found. Such an answer
    /// is "unknown", never a proof that no more replicas fit.
    pub fn is_lower_bound(&self) -> bool {
        self.error.is_none() && self.unknown_nodes > 0 && self.limited_by.starts_with(LIMIT_UNKNOWN)
    }
}

/// The estimate over the selected clusters.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Estimate {
    /// Per-cluster answers, in cluster name order.
    pub clusters: Vec<ClusterEstimate>,
    /// Sum of `max_replicas`.
    pub total: i64,
}

impl Estimate {
    /// The answer of one cluster.
    pub fn cluster(&self, name: &str) -> Option<&ClusterEstimate> {
        self.clusters.iter().find(|c| c.name == name)
    }
}

/// Estimates with result caches that survive between calls (per-node device results keyed
/// by workload fingerprint and node generation). Use one per view; it is cheap to create.
///
/// The caches are bounded by bytes ([`Estimator::with_cache_bytes`], default
/// [`DEFAULT_CACHE_BYTES`]): each memo's and device cache's heap size is estimated from its
/// tables' capacity, and past the bound the least recently used memos are dropped, then, if
/// the device answers alone are over, the largest clusters' device answers. Evicting only
/// costs recomputation: answers never depend on what is cached.
#[derive(Debug)]
pub struct Estimator {
    pub(crate) device_cache: FastMap<String, DeviceCache>,
    /// (cluster, workload fingerprint) -> per-node answers and their sums.
    memos: FastMap<MemoKey, Memo>,
    /// Last use -> memo key, oldest first.
    lru: BTreeMap<u64, MemoKey>,
    /// Use counter behind `lru`.
    tick: u64,
    /// Sum of the memos' `bytes`.
    memo_bytes: usize,
    max_bytes: usize,
    /// Set from the view at each estimate ([`CacheBound::View`]), or fixed.
    bound: CacheBound,
    /// Per cluster: the deductions of its assumed workloads, kept for the next estimate
    /// with the same assumed list or one that extends it.
    deductions: FastMap<String, DeductionLog>,
    /// Deduction builds made (numbers them).
    pub(crate) builds: u64,
    /// Headroom's per-node counts of hypothetical nodes (see [`ShapeKey`]).
    shape_counts: FastMap<ShapeKey, (ShapeGens, NodeCount)>,
    /// Headroom's NodePool plans per cluster, with the cluster generation they were made at
    /// (one entry per cluster with NodePools).
    pool_plans: FastMap<String, (u64, Arc<[PoolPlan]>)>,
}

/// (cluster, shape node, workload key) of a hypothetical node's count.
type ShapeKey = (String, Arc<str>, u64);
/// What a hypothetical node's count was computed from: the shape node's view generation and
/// device generation, and the cluster's shared device generation.
type ShapeGens = (u64, u64, u64);

/// Entries of [`Estimator::shape_counts`] before it is cleared (a few per NodePool and
/// instance type per workload; each well under a kilobyte).
const MAX_SHAPE_COUNTS: usize = 4096;

/// Default bound of an estimator's caches: 512 MiB, which with the view of a 100-cluster ×
/// 1,000-node fleet (1.4 GiB) and the store keeps a replica within its 4 GiB. It is also the
/// ceiling of a view-sized bound ([`CacheBound::View`]).
pub const DEFAULT_CACHE_BYTES: usize = 512 << 20;

/// Floor of a view-sized bound: room for about a hundred memos of a 5,000-node cluster.
pub const MIN_CACHE_BYTES: usize = 32 << 20;

/// How an estimator's caches are bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheBound {
    /// A fixed number of bytes (replica `--estimate-cache-bytes`).
    Bytes(usize),
    /// Sized from the view at each estimate: [`view_cache_bytes`].
    View,
}

/// The cache bound [`CacheBound::View`] gives `view`: a quarter of the view's estimated heap
/// ([`View::estimated_bytes`]), at least [`MIN_CACHE_BYTES`] and at most
/// [`DEFAULT_CACHE_BYTES`]. So the caches grow with what they are computed against (a memo
/// holds one answer per node), not with the number of distinct requests: after any traffic a
/// replica holds about 1.25× its loaded size (or the view plus 32 MiB for a small view).
pub fn view_cache_bytes(view: &View) -> usize {
    (view.estimated_bytes() / 4).clamp(MIN_CACHE_BYTES, DEFAULT_CACHE_BYTES)
}

/// (cluster, workload key, with deductions): answers with nothing deducted are kept apart
/// from answers against a deduction log, so estimates of both kinds (a decision's and a
/// resolution's count with nothing deducted) do not recount the cluster in turn.
type MemoKey = (String, u64, bool);

#[derive(Debug)]
struct Memo {
    memo: ClusterMemo,
    /// Estimated heap size when stored.
    bytes: usize,
    /// Key of this memo in `Estimator::lru`.
    used: u64,
}

impl Default for Estimator {
    fn default() -> Self {
        Estimator::with_cache_bytes(DEFAULT_CACHE_BYTES)
    }
}

/// Why a node limits, as stored per node.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Factor {
    Res(ResName),
    Pods,
    Devices,
    /// The device search gave up at its budget: the node's count is a lower bound.
    Unknown,
}

/// The `limits` key of nodes whose device search gave up at its budget, and the first word
/// of `limited_by` when that makes the cluster's answer a lower bound.
pub const LIMIT_UNKNOWN: &str = "unknown";

impl Factor {
    fn label(&self) -> String {
        match self {
            Factor::Res(r) => r.to_string(),
            Factor::Pods => "pods".into(),
            Factor::Devices => "devices".into(),
            Factor::Unknown => LIMIT_UNKNOWN.into(),
        }
    }
}

/// A cluster's per-node answers for one workload, with their sums, valid as of the
/// recorded generations.
#[derive(Debug, Default, Clone)]
struct ClusterMemo {
    /// The deduction build and epoch the answers count against (0: no deductions).
    build: u64,
    epoch: u64,
    view_gen: u64,
    dev_counter: u64,
    shared_gen: u64,
    /// Per node in name order (the view's order): a sorted vector is ~40 % smaller than a
    /// hash table at its load factor, and a full count appends in order.
    per_node: Vec<(Arc<str>, NodeOutcome)>,
    total: i64,
    considered: u32,
    excluded: BTreeMap<String, u32>,
    limits: BTreeMap<String, u32>,
}

impl ClusterMemo {
    /// Estimated heap size: table slots at capacity, map nodes and their key strings.
    fn heap_bytes(&self, key: &MemoKey) -> usize {
        let per_node = self.per_node.capacity() * size_of::<(Arc<str>, NodeOutcome)>();
        let labels: usize = self
            .excluded
            .keys()
            .chain(self.limits.keys())
            .map(|k| k.capacity() + size_of::<(String, u32)>() + 16)
            .sum();
        size_of::<Memo>() + size_of::<MemoKey>() * 2 + key.0.capacity() + per_node + labels
    }

    fn add(&mut self, o: &NodeOutcome, sign: i64) {
        let bump = |m: &mut BTreeMap<String, u32>, k: String| {
            let e = m.entry(k.clone()).or_default();
            if sign > 0 {
                *e += 1;
            } else {
                *e = e.saturating_sub(1);
                if *e == 0 {
                    m.remove(&k);
                }
            }
        };
        match o {
            NodeOutcome::Excluded(r) => bump(&mut self.excluded, r.to_string()),
            NodeOutcome::Fit { replicas, factor } => {
                self.total = self.total.saturating_add(sign.saturating_mul(*replicas));
                if sign > 0 {
                    self.considered += 1;
                } else {
                    self.considered = self.considered.saturating_sub(1);
                }
                if let Some(f) = factor {
                    bump(&mut self.limits, f.label());
                }
            }
        }
    }

    fn to_estimate(
        &self,
        c: &ClusterView,
        w: &Workload,
        opts: &EstimateOptions,
    ) -> ClusterEstimate {
        let mut out = ClusterEstimate {
            max_replicas: self.total,
            excluded_nodes: self.excluded.clone(),
            nodes_considered: self.considered,
            limits: self.limits.clone(),
            ..blank_estimate(c)
        };
        finish(&mut out, c, w, opts);
        out
    }
}

/// Nodes changed since the given generations, or `None` when the logs do not reach back.
fn changed_nodes(c: &ClusterView, view_gen: u64, dev_counter: u64) -> Option<Vec<Arc<str>>> {
    if view_gen < c.log_floor || dev_counter < c.devices.log_floor {
        return None;
    }
    let mut seen: FastSet<Arc<str>> = FastSet::default();
    for (g, n) in c.log.iter().rev() {
        if *g <= view_gen {
            break;
        }
        seen.insert(n.clone());
    }
    for (g, n) in c.devices.log.iter().rev() {
        if *g <= dev_counter {
            break;
        }
        seen.insert(n.clone());
    }
    let mut v: Vec<Arc<str>> = seen.into_iter().collect();
    v.sort();
    Some(v)
}

impl Estimator {
    /// An estimator with empty caches bounded by [`DEFAULT_CACHE_BYTES`].
    pub fn new() -> Estimator {
        Estimator::default()
    }

    /// An estimator whose caches stay within about `max_bytes` of heap.
    pub fn with_cache_bytes(max_bytes: usize) -> Estimator {
        Estimator::with_cache_bound(CacheBound::Bytes(max_bytes))
    }

    /// An estimator whose caches are bounded as `bound` says.
    pub fn with_cache_bound(bound: CacheBound) -> Estimator {
        let max_bytes = match bound {
            CacheBound::Bytes(b) => b,
            CacheBound::View => MIN_CACHE_BYTES,
        };
        Estimator {
            device_cache: FastMap::default(),
            memos: FastMap::default(),
            lru: BTreeMap::new(),
            tick: 0,
            memo_bytes: 0,
            deductions: FastMap::default(),
            builds: 0,
            shape_counts: FastMap::default(),
            pool_plans: FastMap::default(),
            max_bytes,
            bound,
        }
    }

    /// The bound the caches are held to now (for [`CacheBound::View`], as of the last
    /// estimate).
    pub fn cache_bound_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Estimated heap bytes the caches hold now (memos and device answers).
    pub fn cache_bytes(&self) -> usize {
        self.memo_bytes + self.device_bytes()
    }

    fn device_bytes(&self) -> usize {
        self.device_cache
            .values()
            .map(DeviceCache::answer_bytes)
            .sum()
    }

    fn take_memo(&mut self, key: &MemoKey) -> Option<ClusterMemo> {
        let m = self.memos.remove(key)?;
        self.lru.remove(&m.used);
        self.memo_bytes -= m.bytes;
        Some(m.memo)
    }

    /// Stores a memo as the most recently used one, then evicts down to the bound.
    fn put_memo(&mut self, key: MemoKey, memo: ClusterMemo) {
        let bytes = memo.heap_bytes(&key);
        if bytes > self.max_bytes / 2 {
            return; // would evict everything else, and itself next
        }
        self.tick += 1;
        self.lru.insert(self.tick, key.clone());
        self.memo_bytes += bytes;
        let used = self.tick;
        if let Some(old) = self.memos.insert(key, Memo { memo, bytes, used }) {
            self.lru.remove(&old.used);
            self.memo_bytes -= old.bytes;
        }
        self.trim();
    }

    /// Evicts least recently used memos, then the largest device answer sets, until the
    /// accounted size is within the bound.
    fn trim(&mut self) {
        let mut device = self.device_bytes();
        while self.memo_bytes + device > self.max_bytes
            && let Some((_, key)) = self.lru.pop_first()
        {
            if let Some(m) = self.memos.remove(&key) {
                self.memo_bytes -= m.bytes;
            }
        }
        while self.memo_bytes + device > self.max_bytes {
            let Some(largest) = self
                .device_cache
                .values_mut()
                .max_by_key(|c| c.answer_bytes())
                .filter(|c| c.answer_bytes() > 0)
            else {
                break;
            };
            device -= largest.answer_bytes();
            largest.clear_answers();
        }
    }

    /// Max available replicas of `w` per cluster.
    pub fn estimate(&mut self, view: &View, w: &Workload, opts: &EstimateOptions) -> Estimate {
        if self.bound == CacheBound::View {
            self.max_bytes = view_cache_bytes(view);
        }
        let mut clusters = Vec::new();
        for c in view.clusters() {
            if !opts.clusters.is_empty() && !opts.clusters.contains(&c.name) {
                continue;
            }
            // Claim references are resolved per cluster; the resolved workload's fingerprint
            // names the templates it found, so memos and caches are per template content.
            let w = match c.workload(w) {
                Ok(w) => w,
                Err(e) => {
                    clusters.push(error_estimate(c, e));
                    continue;
                }
            };
            let mut out = if opts.past_deadline() {
                error_estimate(c, DEADLINE_EXCEEDED.into())
            } else if opts.disable_cache {
                estimate_cluster(c, &w, opts, None, None)
            } else {
                let list = opts.assumed.shared(&c.name);
                self.estimate_memoized(c, &w, opts, list)
            };
            if let Some(h) = &opts.headroom
                && out.error.is_none()
            {
                if opts.past_deadline() {
                    out = error_estimate(c, DEADLINE_EXCEEDED.into());
                } else {
                    self.add_headroom(c, &w, opts, h, &mut out);
                }
            }
            clusters.push(out);
        }
        let total = clusters
            .iter()
            .map(|c| c.max_replicas)
            .fold(0i64, i64::saturating_add);
        self.trim();
        Estimate { clusters, total }
    }

    /// Adds cluster `c`'s scale-up headroom to `out` (see `crate::headroom`).
    fn add_headroom(
        &mut self,
        c: &ClusterView,
        w: &Workload,
        opts: &EstimateOptions,
        h: &HeadroomOptions,
        out: &mut ClusterEstimate,
    ) {
        if self.shape_counts.len() > MAX_SHAPE_COUNTS {
            self.shape_counts = FastMap::default();
        }
        if self.pool_plans.len() > MAX_SHAPE_COUNTS {
            self.pool_plans = FastMap::default();
        }
        let wkey = workload_key(w, opts);
        let plain = EstimateOptions {
            max_allocation_steps: opts.max_allocation_steps,
            deadline: opts.deadline,
            ..EstimateOptions::default()
        };
        if c.autoscaling().pools.is_empty() {
            self.pool_plans.remove(&c.name);
            return;
        }
        let plans = match self.pool_plans.get(&c.name) {
            Some((g, p)) if *g == c.generation => p.clone(),
            _ => {
                let p: Arc<[PoolPlan]> = plan(c).into();
                self.pool_plans
                    .insert(c.name.clone(), (c.generation, p.clone()));
                p
            }
        };
        let counts = &mut self.shape_counts;
        let headroom = cluster_headroom(c, &plans, h, !w.shared_claims.is_empty(), |c, node| {
            let gens = (
                c.node_gen.get(&node.name).copied().unwrap_or(0),
                c.devices.node_generation(&node.name),
                c.devices.shared_generation(),
            );
            let key = (c.name.clone(), node.name.clone(), wkey);
            if let Some((g, n)) = counts.get(&key)
                && *g == gens
            {
                return n.clone();
            }
            let n = count_new_node(c, node, w, &plain);
            counts.insert(key, (gens, n.clone()));
            n
        });
        let Some(headroom) = headroom else {
            return;
        };
        out.limited_by = format!("{}; {}", out.limited_by, headroom.summary());
        if h.count {
            out.max_replicas = out.max_replicas.saturating_add(headroom.replicas);
            if let Some(q) = &opts.quotas
                && let Some((cap, res)) = q.limit(&c.name, w, c)
                && cap < out.max_replicas
            {
                out.max_replicas = cap;
                out.limited_by = format!("quota:{res}");
            }
        }
        out.headroom = Some(headroom);
    }

    /// Where the first-fit deduction of each of `list` (assumed workloads of `cluster`, in
    /// deduction order) from the `start`th on ends in `view` (see [`Reach`]; those before
    /// `start` end where they ended when `list` was shorter: a deduction's end depends only
    /// on those before it); `None` when the cluster is not in the view or a replica holds a
    /// device not local to its node.
    pub fn deduction_reaches(
        &mut self,
        view: &View,
        cluster: &str,
        list: &AssumedList,
        start: usize,
    ) -> Option<Vec<Reach>> {
        let c = view.cluster(cluster)?;
        let log = self.take_deductions(c, list, &EstimateOptions::default())?;
        let reaches = log.ded.reaches_from(start);
        self.deductions.insert(c.name.clone(), log);
        reaches
    }

    /// The cluster's deductions of `list` (its assumed workloads, in order), taken out of
    /// the kept logs: the kept log extended when `list` extends what it placed, else a new
    /// build. `None` once the deadline passed (the kept log stays, a consistent prefix).
    fn take_deductions(
        &mut self,
        c: &ClusterView,
        list: &AssumedList,
        opts: &EstimateOptions,
    ) -> Option<DeductionLog> {
        let steps = opts.max_allocation_steps;
        let kept = self
            .deductions
            .remove(&c.name)
            .and_then(|mut l| l.carries_to(c, list, steps).then_some(l));
        let mut log = match kept {
            Some(l) => l,
            None => {
                self.builds += 1;
                DeductionLog::new(c, steps, self.builds)
            }
        };
        if log.placed() < list.len() {
            log.next_epoch();
            for a in &list[log.placed()..] {
                if opts.past_deadline() {
                    self.deductions.insert(c.name.clone(), log);
                    return None;
                }
                log.add(c, a);
            }
        }
        log.reached(list);
        Some(log)
    }
}

/// The memo key of a workload: its fingerprint, mixed with the search budget (answers under
/// another budget are other answers).
fn workload_key(w: &Workload, opts: &EstimateOptions) -> u64 {
    opts.max_allocation_steps.map_or(w.fingerprint, |s| {
        w.fingerprint ^ s.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    })
}

/// Replicas of `w` on a new, empty node shaped like `node` of `c` (the per-node fit of every
/// estimate, on [`ClusterView::new_node_like`]).
fn count_new_node(
    c: &ClusterView,
    node: &NodeEntry,
    w: &Workload,
    opts: &EstimateOptions,
) -> NodeCount {
    let Some(shape) = c.new_node_like(&node.name) else {
        return NodeCount {
            replicas: 0,
            limited_by: String::new(),
            error: Some(format!("node {} is gone", node.name)),
            lower_bound: false,
        };
    };
    let e = estimate_cluster(&shape, w, opts, None, None);
    let limited_by = if e.error.is_none() && e.nodes_considered == 0 {
        let why: Vec<&str> = e.excluded_nodes.keys().map(String::as_str).collect();
        format!("excluded by {}", why.join(", "))
    } else {
        e.limited_by.clone()
    };
    NodeCount {
        replicas: e.max_replicas,
        lower_bound: e.is_lower_bound(),
        limited_by,
        error: e.error,
    }
}

impl Estimator {
    /// Brings the cluster's memo for `w` up to date by revisiting only the nodes changed
    /// since it was made (in the view, or in the deductions of the assumed workloads
    /// `list`), all nodes the first time, then sums.
    fn estimate_memoized(
        &mut self,
        c: &ClusterView,
        w: &Workload,
        opts: &EstimateOptions,
        list: Option<&AssumedList>,
    ) -> ClusterEstimate {
        let key = (c.name.clone(), workload_key(w, opts), list.is_some());
        // A first answer against deductions starts from the answers with nothing deducted
        // (nodes never deducted from answer the same).
        let memo = self.take_memo(&key).or_else(|| {
            let base = (key.0.clone(), key.1, false);
            (key.2)
                .then(|| self.memos.get(&base).map(|m| m.memo.clone()))
                .flatten()
        });
        let mut log = match list {
            None => None,
            Some(list) => match self.take_deductions(c, list, opts) {
                Some(l) => Some(l),
                None => return error_estimate(c, DEADLINE_EXCEEDED.into()),
            },
        };
        let (build, epoch, unplaced) = log
            .as_ref()
            .map_or((0, 0, 0), |l| (l.build, l.epoch, l.ded.unplaced));
        let mut held = log.as_mut().and_then(|l| l.ded.take_devices());
        if held.as_ref().is_some_and(AssumedDevices::holds_shared) {
            // A held shared device makes every node's answer depend on every deduction:
            // counted in full on a copy of the held state, never memoized.
            let mut copy = held.clone();
            let mut m = ClusterMemo::default();
            let cache = self.device_cache.entry(c.name.clone()).or_default();
            let counted = count_nodes(
                c,
                w,
                opts,
                log.as_ref().map(|l| &l.ded.res),
                &mut copy,
                cache,
                &mut m,
                None,
            );
            if let Some(mut l) = log {
                l.ded.put_devices(held);
                self.deductions.insert(c.name.clone(), l);
            }
            return match counted {
                Ok(_) => {
                    let mut out = m.to_estimate(c, w, opts);
                    out.assumed_unplaced = unplaced;
                    out
                }
                Err(e) => error_estimate(c, e),
            };
        }
        // With no node to count again (`changed` below, empty) and no change of the cluster
        // since the memo's count (one that touches no node is seen only by preparing the
        // device query, which is what counting no nodes would still do), the memo's answer
        // stands as it is: under churn most clusters of a decision are such, and preparing a
        // query costs as much as counting a node or two.
        let same_cluster = memo
            .as_ref()
            .is_some_and(|m| m.view_gen == c.generation && m.dev_counter == c.devices.counter());
        let changed = memo.as_ref().and_then(|m| {
            if m.shared_gen != c.devices.shared_gen {
                return None;
            }
            let mut changed = changed_nodes(c, m.view_gen, m.dev_counter)?;
            match &log {
                None if m.build == 0 => {}
                Some(l) if m.build == l.build => changed.extend(l.touched_since(m.epoch).cloned()),
                // Nodes never deducted from answer as without deductions.
                Some(l) if m.build == 0 => changed.extend(l.touched_since(0).cloned()),
                _ => return None,
            }
            changed.sort();
            changed.dedup();
            (changed.len() * 4 <= c.nodes.len() + 16).then_some(changed)
        });
        let (mut m, changed) = match (memo, changed) {
            (Some(m), Some(changed)) => (m, Some(changed)),
            _ => (ClusterMemo::default(), None),
        };
        m.view_gen = c.generation;
        m.dev_counter = c.devices.counter();
        m.shared_gen = c.devices.shared_gen;
        m.build = build;
        m.epoch = epoch;
        let counted = if same_cluster && changed.as_ref().is_some_and(Vec::is_empty) {
            Ok(Counted::Complete)
        } else {
            let cache = self.device_cache.entry(c.name.clone()).or_default();
            count_nodes(
                c,
                w,
                opts,
                log.as_ref().map(|l| &l.ded.res),
                &mut held,
                cache,
                &mut m,
                changed.as_deref(),
            )
        };
        match counted {
            Ok(Counted::Complete) => {
                if let Some(mut l) = log {
                    l.ded.put_devices(held);
                    self.deductions.insert(c.name.clone(), l);
                }
                let mut out = m.to_estimate(c, w, opts);
                out.assumed_unplaced = unplaced;
                self.put_memo(key, m);
                out
            }
            // The query consumed a shared device (or allocates a shared claim): its answers
            // depend on node order, and any held state it used now holds its allocations.
            Ok(Counted::OrderDependent) if changed.is_none() => {
                let mut out = m.to_estimate(c, w, opts);
                out.assumed_unplaced = unplaced;
                out
            }
            Ok(Counted::OrderDependent) => {
                let cache = self.device_cache.entry(c.name.clone()).or_default();
                estimate_cluster(c, w, opts, None, Some(cache))
            }
            Err(e) => error_estimate(c, e),
        }
    }
}

fn error_estimate(c: &ClusterView, e: String) -> ClusterEstimate {
    ClusterEstimate {
        limited_by: e.clone(),
        error: Some(e),
        ..blank_estimate(c)
    }
}

/// How [`count_nodes`] ended.
enum Counted {
    /// Every node asked for was counted, each independently of the others.
    Complete,
    /// The query's answers depend on node order: a partial count stopped early, a full
    /// count is complete but must not be memoized.
    OrderDependent,
}

/// Counts the nodes `only` of `c` (all nodes, into an empty memo, when `None`) into `m`,
/// replacing their previous answers, with `res` and `held` (the assumed deductions and
/// their device state, given back in `held`) deducted.
#[allow(clippy::too_many_arguments)]
fn count_nodes(
    c: &ClusterView,
    w: &Workload,
    opts: &EstimateOptions,
    res: Option<&FastMap<Arc<str>, (ResList, i64)>>,
    held: &mut Option<AssumedDevices>,
    cache: &mut DeviceCache,
    m: &mut ClusterMemo,
    only: Option<&[Arc<str>]>,
) -> Result<Counted, String> {
    let mut devq = DeviceQuery::prepare(c, w, None, Some(cache), held, opts.max_allocation_steps)?;
    let mut order_dependent = false;
    let nodes: Box<dyn Iterator<Item = (&Arc<str>, Option<&NodeEntry>)>> = match only {
        Some(names) => Box::new(names.iter().map(|n| (n, c.nodes.get(n)))),
        None => Box::new(c.nodes.iter().map(|(n, e)| (n, Some(e)))),
    };
    if only.is_none() {
        m.per_node.clear();
        m.per_node.reserve_exact(c.nodes.len());
    }
    let mut result = Ok(());
    for (i, (name, node)) in nodes.enumerate() {
        if opts.past_deadline_at(i) {
            result = Err(DEADLINE_EXCEEDED.to_string());
            break;
        }
        // `only` is sorted and `c.nodes` iterates in name order, so a full count appends.
        let at = match m.per_node.last() {
            Some((last, _)) if **last < **name => Err(m.per_node.len()),
            None => Err(0),
            _ => m.per_node.binary_search_by(|(n, _)| (**n).cmp(&**name)),
        };
        let Some(node) = node else {
            if let Ok(i) = at {
                let (_, old) = m.per_node.remove(i);
                m.add(&old, -1);
            }
            continue;
        };
        match node_fit(c, w, node, None, res, devq.as_mut()) {
            Ok(o) => {
                m.add(&o, 1);
                match at {
                    Ok(i) => {
                        let old = std::mem::replace(&mut m.per_node[i].1, o);
                        m.add(&old, -1);
                    }
                    Err(i) => m.per_node.insert(i, (node.name.clone(), o)),
                }
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
        if devq.as_ref().is_some_and(|q| q.order_dependent()) {
            order_dependent = true;
            if only.is_some() {
                break;
            }
        }
    }
    if let Some(q) = devq {
        *held = q.into_assumed();
    }
    result?;
    Ok(if order_dependent {
        Counted::OrderDependent
    } else {
        Counted::Complete
    })
}

/// Sets `limited_by` and `unknown_nodes` from the sums and applies the quota cap. A quota
/// below a lower bound is exact, so it replaces an "unknown".
pub(crate) fn finish(
    out: &mut ClusterEstimate,
    c: &ClusterView,
    w: &Workload,
    opts: &EstimateOptions,
) {
    out.unknown_nodes = out.limits.get(LIMIT_UNKNOWN).copied().unwrap_or(0);
    out.limited_by = if c.nodes.is_empty() {
        "no nodes".into()
    } else if out.nodes_considered == 0 {
        "no node passes filters".into()
    } else if out.unknown_nodes > 0 {
        unknown_limited_by(out.unknown_nodes)
    } else {
        out.limits
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
            .map(|(k, _)| k.clone())
            .unwrap_or_else(|| "none".into())
    };
    if let Some(q) = &opts.quotas
        && let Some((cap, res)) = q.limit(&c.name, w, c)
        && cap < out.max_replicas
    {
        out.max_replicas = cap;
        out.limited_by = format!("quota:{res}");
    }
}

/// One-off estimate without a persistent cache.
pub fn estimate(view: &View, w: &Workload, opts: &EstimateOptions) -> Estimate {
    Estimator::new().estimate(view, w, opts)
}

/// What one node contributes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum NodeOutcome {
    Excluded(&'static str),
    Fit {
        replicas: i64,
        factor: Option<Factor>,
    },
}

/// Replicas of `w` that fit on one node; `freed` is what a what-if gives back on it
/// (requests and pod slots of removed pods).
pub(crate) fn node_fit(
    c: &ClusterView,
    w: &Workload,
    node: &NodeEntry,
    freed: Option<&(ResList, u32)>,
    assumed: Option<&FastMap<Arc<str>, (ResList, i64)>>,
    devq: Option<&mut DeviceQuery<'_>>,
) -> Result<NodeOutcome, String> {
    if let Err(ex) = w.node_claim.check(&node.facts()) {
        return Ok(NodeOutcome::Excluded(ex.as_str()));
    }
    if let Some(q) = &devq
        && !q.node_allowed(node)
    {
        return Ok(NodeOutcome::Excluded("resourceClaimAllocation"));
    }
    let usage = c.usage.get(&node.name);
    let taken = assumed.and_then(|a| a.get(&node.name));
    let free_of = |r: &ResName| -> i64 {
        let mut f = node.allocatable.get(r);
        if let Some(u) = usage {
            f -= u.requested.get(r);
        }
        if let Some((fr, _)) = freed {
            f += fr.get(r);
        }
        if let Some((t, _)) = taken {
            f -= t.get(r);
        }
        f
    };
    let mut n = i64::MAX;
    let mut factor = None;
    for (r, req) in w.requests.iter() {
        if req <= 0 || !r.is_divisible() {
            continue;
        }
        if let Some(q) = &devq
            && q.served_by_devices(node, r)
        {
            continue;
        }
        let free = free_of(r);
        let fit = if free <= 0 { 0 } else { free / req };
        if fit < n {
            n = fit;
            factor = Some(Factor::Res(r.clone()));
        }
    }
    let mut pods = node.allocatable.get(&ResName::Pods);
    if let Some(u) = usage {
        pods -= i64::from(u.pods);
    }
    if let Some((_, k)) = freed {
        pods += i64::from(*k);
    }
    if let Some((_, k)) = taken {
        pods -= k;
    }
    let pods = pods.max(0);
    if pods < n {
        n = pods;
        factor = Some(Factor::Pods);
    }
    if let Some(q) = devq
        && n > 0
    {
        let d = q.fit(node, n)?;
        if d.replicas < n {
            n = d.replicas;
            factor = Some(if d.gave_up {
                Factor::Unknown
            } else {
                Factor::Devices
            });
        }
    }
    Ok(NodeOutcome::Fit {
        replicas: n,
        factor,
    })
}

pub(crate) fn estimate_cluster(
    c: &ClusterView,
    w: &Workload,
    opts: &EstimateOptions,
    overlay: Option<&Overlay>,
    cache: Option<&mut DeviceCache>,
) -> ClusterEstimate {
    let w = match c.workload(w) {
        Ok(w) => w,
        Err(e) => return error_estimate(c, e),
    };
    let w = &*w;
    let mut out = blank_estimate(c);
    if c.nodes.is_empty() {
        out.limited_by = "no nodes".into();
        return out;
    }
    let (assumed, mut held) = if !opts.assumed.cluster(&c.name).is_empty() {
        let mut d = assumed_deductions(c, &opts.assumed, overlay, opts.max_allocation_steps);
        out.assumed_unplaced = d.unplaced;
        (Some(std::mem::take(&mut d.res)), d.take_devices())
    } else {
        (None, None)
    };
    let mut devq =
        match DeviceQuery::prepare(c, w, overlay, cache, &mut held, opts.max_allocation_steps) {
            Ok(q) => q,
            Err(e) => {
                out.limited_by = e.clone();
                out.error = Some(e);
                return out;
            }
        };
    for (i, node) in c.nodes.values().enumerate() {
        if opts.past_deadline_at(i) {
            return error_estimate(c, DEADLINE_EXCEEDED.into());
        }
        let freed = overlay.and_then(|o| o.freed.get(&node.name));
        let o = node_fit(c, w, node, freed, assumed.as_ref(), devq.as_mut());
        if !tally(&mut out, &o) {
            return out;
        }
    }
    finish(&mut out, c, w, opts);
    out
}

/// An estimate of `c` with nothing counted yet.
pub(crate) fn blank_estimate(c: &ClusterView) -> ClusterEstimate {
    ClusterEstimate {
        name: c.name.clone(),
        max_replicas: 0,
        limited_by: String::new(),
        excluded_nodes: BTreeMap::new(),
        nodes_considered: 0,
        limits: BTreeMap::new(),
        kubernetes_version: c.info.kubernetes_version.clone(),
        error: None,
        assumed_unplaced: 0,
        unknown_nodes: 0,
        headroom: None,
    }
}

/// Counts one node's outcome (nodes in name order) into `out`; on an error the estimate
/// becomes that error with no replicas, and false says to stop. [`finish`] completes it.
pub(crate) fn tally(out: &mut ClusterEstimate, o: &Result<NodeOutcome, String>) -> bool {
    match o {
        Ok(NodeOutcome::Excluded(reason)) => {
            *out.excluded_nodes.entry(reason.to_string()).or_default() += 1;
        }
        Ok(NodeOutcome::Fit { replicas, factor }) => {
            out.nodes_considered += 1;
            if let Some(f) = factor {
                *out.limits.entry(f.label()).or_default() += 1;
            }
            out.max_replicas = out.max_replicas.saturating_add(*replicas);
        }
        Err(e) => {
            out.error = Some(e.clone());
            out.limited_by = e.clone();
            out.max_replicas = 0;
            return false;
        }
    }
    true
}

/// One component of a multi-template workload (Karmada `Component`).
#[derive(Debug, Clone)]
pub struct Component {
    /// Component name.
    pub name: String,
    /// Replicas of the component in one set.
    pub replicas: i64,
    /// Requests of one replica.
    pub requests: ResList,
    /// What one replica requires of a node.
    pub node_claim: NodeClaim,
}

/// Karmada `MaxAvailableComponentSets`: how many complete sets of all components fit, by
/// first-fit over nodes in name order, one set at a time. Devices are not modelled for
/// components (as in Karmada), so this counts cpu, memory, extended resources and pods.
pub fn estimate_component_sets(
    view: &View,
    components: &[Component],
    opts: &EstimateOptions,
) -> Estimate {
    let mut clusters = Vec::new();
    for c in view.clusters() {
        if !opts.clusters.is_empty() && !opts.clusters.contains(&c.name) {
            continue;
        }
        if opts.past_deadline() {
            clusters.push(error_estimate(c, DEADLINE_EXCEEDED.into()));
            continue;
        }
        let deductions = assumed_deductions(c, &opts.assumed, None, opts.max_allocation_steps);
        let assumed = deductions.res;
        let mut free: Vec<(&NodeEntry, NodeFree)> = c
            .nodes
            .values()
            .map(|n| (n, node_free(c, n, None, Some(&assumed))))
            .collect();
        let mut sets = 0i64;
        let bound = i64::from(i32::MAX);
        'outer: while sets < bound && !components.is_empty() {
            let mut trial: Vec<(ResList, i64)> =
                free.iter().map(|(_, f)| (f.res.clone(), f.pods)).collect();
            for comp in components {
                let mut remaining = comp.replicas;
                for (i, (node, _)) in free.iter().enumerate() {
                    if remaining <= 0 {
                        break;
                    }
                    if comp.node_claim.check(&node.facts()).is_err() {
                        continue;
                    }
                    let (fit, _) = trial[i].0.max_divided(&comp.requests);
                    let take = remaining.min(fit).min(trial[i].1);
                    if take > 0 {
                        trial[i].0.sub_all(&comp.requests.scaled(take));
                        trial[i].1 -= take;
                        remaining -= take;
                    }
                }
                if remaining > 0 {
                    break 'outer;
                }
            }
            for (i, (res, pods)) in trial.into_iter().enumerate() {
                free[i].1.res = res;
                free[i].1.pods = pods;
            }
            sets += 1;
        }
        clusters.push(ClusterEstimate {
            max_replicas: sets,
            limited_by: if c.nodes.is_empty() {
                "no nodes".into()
            } else {
                "first-fit".into()
            },
            nodes_considered: c.nodes.len() as u32,
            assumed_unplaced: deductions.unplaced,
            ..blank_estimate(c)
        });
    }
    let total = clusters.iter().map(|c| c.max_replicas).sum();
    Estimate { clusters, total }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memo(nodes: usize) -> ClusterMemo {
        let mut m = ClusterMemo::default();
        for i in 0..nodes {
            let o = NodeOutcome::Fit {
                replicas: 1,
                factor: Some(Factor::Pods),
            };
            m.add(&o, 1);
            m.per_node.push((Arc::from(format!("n{i:06}")), o));
        }
        m
    }

    fn key(i: u64) -> MemoKey {
        ("c".to_string(), i, false)
    }

    #[test]
    fn memos_past_the_byte_bound_evict_least_recently_used() {
        let size = memo(100).heap_bytes(&key(0));
        // Room for three memos, not four.
        let mut est = Estimator::with_cache_bytes(size * 7 / 2);
        for i in 0..3 {
            est.put_memo(key(i), memo(100));
        }
        assert_eq!(est.cache_bytes(), 3 * size);
        // Using memo 0 makes memo 1 the least recently used one.
        let m0 = est.take_memo(&key(0)).unwrap();
        est.put_memo(key(0), m0);
        est.put_memo(key(3), memo(100));
        let mut kept: Vec<u64> = est.memos.keys().map(|k| k.1).collect();
        kept.sort();
        assert_eq!(kept, [0, 2, 3]);
        assert_eq!(est.cache_bytes(), 3 * size);
        assert!(est.cache_bytes() <= est.max_bytes);
        assert_eq!(est.lru.len(), 3);
        // The memo taken back is the one stored, with its sums.
        assert_eq!(est.take_memo(&key(2)).unwrap().total, 100);
        assert_eq!(est.cache_bytes(), 2 * size);
        // A memo larger than half the bound is not kept at all.
        est.put_memo(key(9), memo(1000));
        assert!(!est.memos.contains_key(&key(9)));
        assert!(est.cache_bytes() <= est.max_bytes);
    }

    #[test]
    fn view_sized_bound_is_a_quarter_of_the_view_within_the_floor() {
        let spec = |nodes| dramesh_sim::typed::FleetSpec {
            clusters: 1,
            nodes_per_cluster: nodes,
            gpus_per_node: 8,
            owners_per_cluster: 4,
            kubernetes_version: "1.36".into(),
        };
        let small = crate::test_fleet::fleet(&spec(2), &|_| 8).unwrap();
        assert_eq!(view_cache_bytes(&small), MIN_CACHE_BYTES);
        let large = crate::test_fleet::fleet(&spec(1000), &|_| 8).unwrap();
        let [node, pod, slice, claim] = crate::view::VIEW_BYTES_PER;
        let c = large.clusters().next().unwrap();
        let counted = 1000 * node
            + c.pod_count() * pod
            + c.devices().slice_count() * slice
            + c.devices().claim_count() * claim;
        assert_eq!(c.pod_count(), 8000);
        assert_eq!(large.estimated_bytes(), counted);
        assert!(counted / 4 > MIN_CACHE_BYTES, "{counted}");
        assert_eq!(view_cache_bytes(&large), counted / 4);
        // An estimator sized by the view takes its bound from the view it estimates against.
        let spec = serde_json::json!({"containers": [{"name": "c",
            "resources": {"requests": {"cpu": "1"}}}]});
        let w = Workload::from_pod_spec(
            "Deployment",
            "ml",
            "w",
            1,
            serde_json::from_value(spec).unwrap(),
            &Default::default(),
        )
        .unwrap();
        let mut est = Estimator::with_cache_bound(CacheBound::View);
        assert_eq!(est.cache_bound_bytes(), MIN_CACHE_BYTES);
        est.estimate(&large, &w, &EstimateOptions::default());
        assert_eq!(est.cache_bound_bytes(), counted / 4);
        assert!(est.cache_bytes() > 0 && est.cache_bytes() <= counted / 4);
        let mut fixed = Estimator::with_cache_bound(CacheBound::Bytes(1 << 20));
        fixed.estimate(&large, &w, &EstimateOptions::default());
        assert_eq!(
            fixed.cache_bound_bytes(),
            1 << 20,
            "an explicit bound is kept"
        );
    }

    #[test]
    fn memo_size_grows_with_its_nodes() {
        let small = memo(10).heap_bytes(&key(0));
        let large = memo(10_000).heap_bytes(&key(0));
        // At least the entries themselves.
        assert!(large >= 10_000 * size_of::<(Arc<str>, NodeOutcome)>());
        assert!(large > 100 * small / 2);
    }
}
