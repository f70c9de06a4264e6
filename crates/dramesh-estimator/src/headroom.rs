//! Scale-up headroom from Karpenter node autoscaling: the replicas that new nodes could hold
//! within each NodePool's limits, counted on hypothetical nodes by the same per-node fit the
//! estimate uses (so DRA devices are packed by the allocation engine), and Karmada's failure
//! detection for pools that do not provision.
//!
//! Per cluster and NodePool (name order), what the pool adds:
//! - **Shapes.** For each instance type the pool's template admits, the first node (name
//!   order) labelled with the pool (`karpenter.sh/nodepool`) and the type
//!   (`node.kubernetes.io/instance-type`) is the shape of a new node: its labels (without
//!   `kubernetes.io/hostname`), taints (without the `node.kubernetes.io/` condition taints and
//!   `karpenter.sh/disrupted`), allocatable, and its node-local ResourceSlices, with nothing
//!   allocated and no pod on it. Types the template lists (or the pool's NodeClaims name)
//!   without such a node have no known shape: they add nothing, and the answer names them.
//! - **Nodes the limits allow.** What a node of a type costs against `spec.limits` is, per
//!   resource, the largest of the shape node's allocatable and the capacity and allocatable
//!   of a NodeClaim of the pool for that node (else for that type). The pool's NodeClaims
//!   already use, per resource, the larger of their `status.capacity` and
//!   `status.allocatable` (Karpenter counts capacity; a claim launched but without a status
//!   yet costs what its type's shape costs, when known). New nodes of a type: the minimum,
//!   over limited resources the node has, of `floor((limit - used) / cost)`. A pool whose
//!   limits bound none of its node's resources adds nothing (the count would be unbounded).
//! - **Replicas.** One hypothetical node is counted by the caller's per-node fit (node
//!   filters, requests, pod slots, devices); all new nodes of a type are alike, so the type
//!   adds `nodes × per node`. The pool adds the best of its types (ties: name order); mixes
//!   of types within one pool's limits are not counted, so this is a lower bound of what the
//!   limits allow.
//!
//! Compared with Karmada's `NodeAutoscalerEstimator` (Karpenter provider), which adds per pool
//! `min over requested resources with a limit of floor((limit - Σ claim allocatable) /
//! request)`: for a workload requesting at least one limited resource, the count here is
//! never larger (per node, `per node × request ≤ allocatable ≤ cost`, and what claims use is
//! at least their allocatable), and is smaller only where whole nodes pack fewer replicas.
//! It differs on purpose where Karmada's formula cannot see nodes: a pool whose limits name
//! no resource the workload requests counts here by the nodes the limits allow (Karmada: 0),
//! and node filters and devices apply.
//!
//! Failure detection ([`AutoscalerHealth`]) is Karmada's: a pool with pending pods and no
//! NodeClaims for longer than [`FAILURE_THRESHOLD`] is skipped for [`RECOVERY_INTERVAL`],
//! then tried again; a pool with NodeClaims is healthy. "Pending" here is the cluster holding
//! a pod the scheduler could not place (agents publish unbound pods once `PodScheduled` is
//! `False`), which is what a pool that should have scaled up leaves behind. Time is the
//! caller's monotonic clock; this module never reads one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use dramesh_model::karpenter::{INSTANCE_TYPE_LABEL, NODEPOOL_LABEL, NodeClaim, NodePool};

use crate::resources::{ResList, ResName};
use crate::view::{ClusterView, NodeEntry, View};

/// How long a pool may have pending pods and no NodeClaims before it counts as failed
/// (Karmada's `defaultFailureThreshold`).
pub const FAILURE_THRESHOLD: Duration = Duration::from_secs(180);
/// How long a failed pool is skipped (Karmada's `defaultRecoveryInterval`).
pub const RECOVERY_INTERVAL: Duration = Duration::from_secs(600);

/// Headroom settings of one estimate.
#[derive(Debug, Clone, Default)]
pub struct HeadroomOptions {
    /// Pools skipped as failed, as (cluster, pool) ([`AutoscalerHealth::observe`]).
    pub failed: Arc<BTreeSet<(String, String)>>,
    /// Whether `max_replicas` includes the headroom (Karmada's answer, and placement or
    /// preemption when asked to count it); otherwise it is only reported beside it.
    pub count: bool,
}

/// What one NodePool adds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolHeadroom {
    /// The NodePool.
    pub pool: String,
    /// Replicas its new nodes could hold.
    pub replicas: i64,
    /// The instance type counted, when one was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance_type: Option<String>,
    /// New nodes of that type the limits allow.
    pub nodes: i64,
    /// Replicas one new node holds.
    pub per_node: i64,
    /// What limited the pool, or why it adds nothing.
    pub reason: String,
    /// Instance types the pool may launch whose shape no node of the pool shows.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unknown_shapes: Vec<String>,
    /// The per-node count of the counted type is a lower bound (the device search gave up).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub lower_bound: bool,
}

/// Scale-up headroom of one cluster.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterHeadroom {
    /// Sum of the pools' replicas.
    pub replicas: i64,
    /// Per NodePool, in name order.
    pub pools: Vec<PoolHeadroom>,
}

impl ClusterHeadroom {
    /// The `limitedBy` suffix: `headroom: 10 (nodepool gpu-pool, p5.48xlarge)`, pools that add
    /// replicas first, then (when none does) why each adds nothing.
    pub fn summary(&self) -> String {
        let adding: Vec<String> = self
            .pools
            .iter()
            .filter(|p| p.replicas > 0)
            .map(|p| match &p.instance_type {
                Some(t) if self.pools.iter().filter(|q| q.replicas > 0).count() > 1 => {
                    format!("nodepool {}, {t}: {}", p.pool, p.replicas)
                }
                Some(t) => format!("nodepool {}, {t}", p.pool),
                None => format!("nodepool {}", p.pool),
            })
            .collect();
        let detail = if adding.is_empty() {
            self.pools
                .iter()
                .map(|p| format!("nodepool {}: {}", p.pool, p.reason))
                .collect::<Vec<_>>()
                .join("; ")
        } else {
            adding.join("; ")
        };
        if detail.is_empty() {
            format!("headroom: {} (no NodePools)", self.replicas)
        } else {
            format!("headroom: {} ({detail})", self.replicas)
        }
    }
}

/// What the per-node fit said about one hypothetical node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeCount {
    /// Replicas that fit on it.
    pub replicas: i64,
    /// What limited them (or why none fit).
    pub limited_by: String,
    /// Why it could not be counted.
    pub error: Option<String>,
    /// `replicas` is a lower bound.
    pub lower_bound: bool,
}

/// Per-resource amounts of the resources a pool limits.
type Amounts = BTreeMap<ResName, i64>;

fn amounts(m: &BTreeMap<String, dramesh_model::Quantity>) -> Amounts {
    m.iter()
        .map(|(k, q)| {
            let r = ResName::parse(k);
            let v = r.amount(q);
            (r, v)
        })
        .collect()
}

/// Elementwise maximum into `into`.
fn max_into(into: &mut Amounts, other: &Amounts) {
    for (r, v) in other {
        let e = into.entry(r.clone()).or_insert(*v);
        *e = (*e).max(*v);
    }
}

/// What a claim counts against the limits: the larger of its capacity and allocatable.
fn claim_cost(c: &NodeClaim) -> Option<Amounts> {
    let s = c.status.as_ref()?;
    if s.capacity.is_empty() && s.allocatable.is_empty() {
        return None;
    }
    let mut a = amounts(&s.capacity);
    max_into(&mut a, &amounts(&s.allocatable));
    Some(a)
}

fn res_amounts(l: &ResList) -> Amounts {
    l.iter().map(|(r, v)| (r.clone(), v)).collect()
}

/// A node shape a pool can launch: the instance type, the node it is learned from, and what
/// one such node costs against the limits.
#[derive(Debug, Clone)]
struct Shape {
    instance_type: String,
    node: Arc<str>,
    cost: Amounts,
}

/// What the view says about one NodePool, whatever the workload: its shapes, the types it may
/// launch without a known shape, what its limits leave, and the resources it limits.
#[derive(Debug, Clone)]
pub(crate) struct PoolPlan {
    name: String,
    shapes: Vec<Shape>,
    unknown: Vec<String>,
    remaining: Amounts,
    limited: Vec<String>,
}

/// The plans of cluster `c`'s NodePools, in name order (one pass over its nodes and claims
/// per pool). They depend only on the view, so callers keep them per cluster generation.
pub(crate) fn plan(c: &ClusterView) -> Vec<PoolPlan> {
    let a = c.autoscaling();
    let mut out = Vec::with_capacity(a.pools.len());
    for (name, pool) in &a.pools {
        let claims: Vec<&NodeClaim> = a.claims_of(name).collect();
        let (shapes, unknown) = shapes(c, name, pool, &claims);
        let limits = amounts(&pool.spec.limits);
        let mut remaining = limits.clone();
        for cl in &claims {
            let cost = claim_cost(cl).or_else(|| {
                let t = cl.instance_type()?;
                shapes
                    .iter()
                    .find(|s| s.instance_type == t)
                    .map(|s| s.cost.clone())
            });
            for (r, v) in cost.iter().flatten() {
                if let Some(left) = remaining.get_mut(r) {
                    *left = left.saturating_sub(*v);
                }
            }
        }
        out.push(PoolPlan {
            name: name.clone(),
            shapes,
            unknown,
            remaining,
            limited: limits.keys().map(|r| r.as_str().to_string()).collect(),
        });
    }
    out
}

/// The shapes of `pool`'s instance types (one per type, from the first node in name order)
/// and the types it may launch without a known shape.
fn shapes(
    c: &ClusterView,
    name: &str,
    pool: &NodePool,
    claims: &[&NodeClaim],
) -> (Vec<Shape>, Vec<String>) {
    let mut found: BTreeMap<String, &NodeEntry> = BTreeMap::new();
    for n in c.nodes() {
        if n.labels.get(NODEPOOL_LABEL).map(String::as_str) != Some(name) {
            continue;
        }
        let Some(t) = n.labels.get(INSTANCE_TYPE_LABEL) else {
            continue;
        };
        if pool.allows_instance_type(t) {
            found.entry(t.clone()).or_insert(n);
        }
    }
    let mut wanted: BTreeSet<String> = pool.listed_instance_types().into_iter().collect();
    wanted.extend(
        claims
            .iter()
            .filter_map(|c| c.instance_type())
            .filter(|t| pool.allows_instance_type(t))
            .map(str::to_string),
    );
    let unknown = wanted
        .into_iter()
        .filter(|t| !found.contains_key(t))
        .collect();
    let shapes = found
        .into_iter()
        .map(|(t, node)| {
            let mut cost = res_amounts(&node.allocatable);
            cost.remove(&ResName::Pods);
            let of_node = claims.iter().find(|cl| {
                cl.status.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&*node.name)
            });
            let of_type = || claims.iter().find(|cl| cl.instance_type() == Some(&t));
            if let Some(cc) = of_node.or_else(of_type).and_then(|cl| claim_cost(cl)) {
                max_into(&mut cost, &cc);
            }
            Shape {
                instance_type: t,
                node: node.name.clone(),
                cost,
            }
        })
        .collect();
    (shapes, unknown)
}

/// New nodes of cost `cost` that fit in `remaining` (limited resources only), with the
/// resource that bounds them; `None` when no limited resource has a positive cost.
fn nodes_allowed(remaining: &Amounts, cost: &Amounts) -> Option<(i64, ResName)> {
    let mut best: Option<(i64, ResName)> = None;
    for (r, left) in remaining {
        let per = cost.get(r).copied().unwrap_or(0);
        if per <= 0 {
            continue;
        }
        let n = if *left <= 0 { 0 } else { left / per };
        if best.as_ref().is_none_or(|(b, _)| n < *b) {
            best = Some((n, r.clone()));
        }
    }
    best
}

/// The headroom of cluster `c` from its pools' `plans` ([`plan`] of the same view) for a
/// workload whose hypothetical nodes `count` counts (the caller's per-node fit on
/// [`ClusterView::new_node_like`]); `None` when the cluster has no NodePools.
/// `shared_claims`: the workload names shared ResourceClaims, which new nodes are not
/// counted for.
pub(crate) fn cluster_headroom(
    c: &ClusterView,
    plans: &[PoolPlan],
    opts: &HeadroomOptions,
    shared_claims: bool,
    mut count: impl FnMut(&ClusterView, &NodeEntry) -> NodeCount,
) -> Option<ClusterHeadroom> {
    if plans.is_empty() {
        return None;
    }
    let mut out = ClusterHeadroom {
        replicas: 0,
        pools: Vec::new(),
    };
    for pp in plans {
        let mut ph = PoolHeadroom {
            pool: pp.name.clone(),
            replicas: 0,
            instance_type: None,
            nodes: 0,
            per_node: 0,
            reason: String::new(),
            unknown_shapes: pp.unknown.clone(),
            lower_bound: false,
        };
        if opts.failed.contains(&(c.name.clone(), pp.name.clone())) {
            ph.reason = format!(
                "failed: pending pods and no NodeClaims for over {}s, skipped for {}s",
                FAILURE_THRESHOLD.as_secs(),
                RECOVERY_INTERVAL.as_secs()
            );
            out.pools.push(ph);
            continue;
        }
        if shared_claims {
            ph.reason = "the workload names shared ResourceClaims: not counted on new nodes".into();
            out.pools.push(ph);
            continue;
        }
        let mut reasons: Vec<String> = Vec::new();
        // (replicas, nodes, per-node count, instance type, explanation) of the best type.
        let mut best: Option<(i64, i64, NodeCount, String, String)> = None;
        for s in &pp.shapes {
            let Some((nodes, bound_by)) = nodes_allowed(&pp.remaining, &s.cost) else {
                reasons.push(format!(
                    "{}: no limit bounds its nodes (limits: {})",
                    s.instance_type,
                    if pp.limited.is_empty() {
                        "none".to_string()
                    } else {
                        pp.limited.join(", ")
                    }
                ));
                continue;
            };
            if nodes == 0 {
                reasons.push(format!("{}: limit {bound_by} reached", s.instance_type));
                continue;
            }
            let n = match c.node(&s.node) {
                Some(node) => count(c, node),
                None => NodeCount {
                    replicas: 0,
                    limited_by: String::new(),
                    error: Some(format!("node {} is gone", s.node)),
                    lower_bound: false,
                },
            };
            if let Some(e) = &n.error {
                reasons.push(format!("{}: {e}", s.instance_type));
                continue;
            }
            let replicas = nodes.saturating_mul(n.replicas);
            let why = format!(
                "{}: {nodes} node(s) by limit {bound_by}, {} per node ({})",
                s.instance_type, n.replicas, n.limited_by
            );
            if replicas > 0 && best.as_ref().is_none_or(|b| replicas > b.0) {
                if let Some(old) = best.replace((replicas, nodes, n, s.instance_type.clone(), why))
                {
                    reasons.push(old.4);
                }
            } else {
                reasons.push(why);
            }
        }
        match best {
            Some((replicas, nodes, n, t, why)) => {
                ph.replicas = replicas;
                ph.nodes = nodes;
                ph.per_node = n.replicas;
                ph.lower_bound = n.lower_bound;
                ph.instance_type = Some(t);
                ph.reason = why;
            }
            None => {
                if pp.shapes.is_empty() {
                    reasons.push("no node of the pool shows an instance type's shape".into());
                }
                if !ph.unknown_shapes.is_empty() {
                    reasons.push(format!(
                        "no known shape for {}",
                        ph.unknown_shapes.join(", ")
                    ));
                }
                ph.reason = reasons.join("; ");
            }
        }
        out.replicas = out.replicas.saturating_add(ph.replicas);
        out.pools.push(ph);
    }
    Some(out)
}

/// Karmada's failure detection for NodePools, per (cluster, pool), advanced by the caller's
/// monotonic clock (see the module docs).
#[derive(Debug, Default, Clone)]
pub struct AutoscalerHealth {
    pools: BTreeMap<(String, String), PoolState>,
}

#[derive(Debug, Default, Clone, Copy)]
struct PoolState {
    /// First observation of pending pods while the pool had no NodeClaims.
    zero_claims_since: Option<Duration>,
    /// When the pool was marked failed.
    failed_at: Option<Duration>,
}

impl AutoscalerHealth {
    /// An empty tracker.
    pub fn new() -> AutoscalerHealth {
        AutoscalerHealth::default()
    }

    /// Observes every cluster's pools at `now` (a monotonic clock's reading, never earlier
    /// than a previous call's) and returns the pools skipped as failed. Pools of clusters
    /// that left the view are forgotten.
    pub fn observe(&mut self, view: &View, now: Duration) -> Arc<BTreeSet<(String, String)>> {
        for c in view.clusters() {
            self.observe_cluster(c, now);
        }
        self.pools.retain(|(c, _), _| view.cluster(c).is_some());
        self.failed(now)
    }

    /// Observes one cluster's pools at `now` (costs one pass over its NodeClaims); its pools
    /// that are gone are forgotten.
    pub fn observe_cluster(&mut self, c: &ClusterView, now: Duration) {
        let a = c.autoscaling();
        let mut claims: BTreeMap<&str, usize> = BTreeMap::new();
        for cl in a.claims.values() {
            if let Some(p) = cl.pool() {
                *claims.entry(p).or_default() += 1;
            }
        }
        let pending = c.unbound_pods() > 0;
        for name in a.pools.keys() {
            let n = claims.get(name.as_str()).copied().unwrap_or(0);
            let st = self
                .pools
                .entry((c.name.clone(), name.clone()))
                .or_default();
            step(st, n, pending, now);
        }
        self.pools
            .retain(|(cl, p), _| cl != &c.name || a.pools.contains_key(p));
    }

    /// The pools skipped as failed at `now`: marked failed less than [`RECOVERY_INTERVAL`]
    /// before it.
    pub fn failed(&self, now: Duration) -> Arc<BTreeSet<(String, String)>> {
        Arc::new(
            self.pools
                .iter()
                .filter(|(_, st)| {
                    st.failed_at
                        .is_some_and(|at| now.saturating_sub(at) < RECOVERY_INTERVAL)
                })
                .map(|(k, _)| k.clone())
                .collect(),
        )
    }
}

/// One observation of one pool (Karmada's `isPoolSkipped`); true when the pool is skipped.
fn step(st: &mut PoolState, claims: usize, pending: bool, now: Duration) -> bool {
    if claims > 0 {
        *st = PoolState::default();
        return false;
    }
    if let Some(at) = st.failed_at {
        if now.saturating_sub(at) < RECOVERY_INTERVAL {
            return true;
        }
        *st = PoolState::default();
    }
    if pending {
        match st.zero_claims_since {
            Some(since) if now.saturating_sub(since) > FAILURE_THRESHOLD => {
                st.failed_at = Some(now);
                return true;
            }
            Some(_) => {}
            None => st.zero_claims_since = Some(now),
        }
    } else {
        st.zero_claims_since = None;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_with_pending_pods_and_no_claims_fails_after_the_threshold_and_recovers() {
        let mut st = PoolState::default();
        let s = Duration::from_secs;
        assert!(!step(&mut st, 0, true, s(0)));
        assert!(
            !step(&mut st, 0, true, s(180)),
            "not past the threshold yet"
        );
        assert!(step(&mut st, 0, true, s(181)), "failed past 3 minutes");
        assert!(step(&mut st, 0, false, s(500)), "skipped while recovering");
        assert!(step(&mut st, 0, true, s(780)));
        // Recovery elapsed: tried again, and a fresh threshold starts.
        assert!(!step(&mut st, 0, true, s(781)));
        assert!(!step(&mut st, 0, true, s(900)));
        assert!(step(&mut st, 0, true, s(962)));
        // NodeClaims make it healthy at once.
        assert!(!step(&mut st, 1, true, s(963)));
        assert!(st.failed_at.is_none() && st.zero_claims_since.is_none());
    }

    #[test]
    fn no_pending_pods_resets_the_wait() {
        let mut st = PoolState::default();
        let s = Duration::from_secs;
        assert!(!step(&mut st, 0, true, s(0)));
        assert!(
            !step(&mut st, 0, false, s(100)),
            "idle clusters are not failures"
        );
        assert!(!step(&mut st, 0, true, s(200)));
        assert!(!step(&mut st, 0, true, s(380)));
        assert!(step(&mut st, 0, true, s(381)));
    }

    #[test]
    fn nodes_allowed_is_bounded_by_the_tightest_limit() {
        let am = |v: &[(&str, i64)]| -> Amounts {
            v.iter().map(|(k, n)| (ResName::parse(k), *n)).collect()
        };
        let rem = am(&[("cpu", 10_000), ("memory", 100), ("nvidia.com/gpu", 16)]);
        assert_eq!(
            nodes_allowed(
                &rem,
                &am(&[("cpu", 2_000), ("memory", 10), ("nvidia.com/gpu", 8)])
            ),
            Some((2, ResName::parse("nvidia.com/gpu")))
        );
        // Resources the node does not have do not bound it.
        assert_eq!(
            nodes_allowed(&rem, &am(&[("cpu", 3_000)])),
            Some((3, ResName::Cpu))
        );
        assert_eq!(nodes_allowed(&rem, &am(&[("ephemeral-storage", 1)])), None);
        assert_eq!(
            nodes_allowed(&am(&[("cpu", -5)]), &am(&[("cpu", 1)])),
            Some((0, ResName::Cpu))
        );
    }
}
