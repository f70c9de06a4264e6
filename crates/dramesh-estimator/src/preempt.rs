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

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::devices::DeviceCache;
use crate::estimate::{EstimateOptions, Estimator, Overlay, estimate_cluster};
use crate::resources::{ResList, ResName};
use crate::view::{ClusterView, Owner, View};
use crate::workload::Workload;

/// One evicted workload.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Victim {
    pub namespace: String,
    pub kind: String,
    pub name: String,
    pub priority: i32,
    pub pods: u32,
    /// Requests given back by its pods.
    pub freed: BTreeMap<String, String>,
}

/// Preemption outcome on one cluster.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPreemption {
    pub name: String,
    pub feasible: bool,
    /// Replicas of the preemptor that fit before eviction.
    pub replicas_before: i64,
    /// Replicas of the preemptor that fit after evicting the victims.
    pub replicas_after: i64,
    pub victims: Vec<Victim>,
    /// Requests freed by all victims.
    pub freed: BTreeMap<String, String>,
    pub evicted_pods: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub highest_victim_priority: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The preemption decision.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PreemptionResult {
    pub preemptor: String,
    pub priority: i32,
    pub replicas: i64,
    /// Set when some cluster already fits the workload: no preemption is needed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fits_without_preemption: Option<String>,
    /// The cluster chosen for preemption.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chosen: Option<String>,
    pub clusters: Vec<ClusterPreemption>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

struct Candidate {
    owner: Arc<Owner>,
    priority: i32,
    pods: Vec<(String, String)>,
    requests: ResList,
}

fn candidates(c: &ClusterView, below: i32) -> Vec<Candidate> {
    let mut by_owner: HashMap<Arc<Owner>, Candidate> = HashMap::new();
    for (key, p) in c.pods() {
        if !p.active || p.priority >= below {
            continue;
        }
        let e = by_owner
            .entry(p.owner.clone())
            .or_insert_with(|| Candidate {
                owner: p.owner.clone(),
                priority: p.priority,
                pods: Vec::new(),
                requests: ResList::new(),
            });
        e.priority = e.priority.max(p.priority);
        e.pods.push(key.clone());
        e.requests.add_all(&p.requests);
    }
    let mut v: Vec<Candidate> = by_owner.into_values().collect();
    for cand in &mut v {
        cand.pods.sort();
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

fn overlay_of(c: &ClusterView, evicted: &[&Candidate]) -> Overlay {
    let mut o = Overlay::default();
    for cand in evicted {
        o.remove_pods(c, &cand.pods);
    }
    o
}

/// Victim selection on one cluster (without a persistent cache).
pub fn preempt_cluster(c: &ClusterView, w: &Workload, opts: &EstimateOptions) -> ClusterPreemption {
    let before = estimate_cluster(c, w, opts, None, None).max_replicas;
    preempt_cluster_with(c, w, opts, before, None)
}

fn preempt_cluster_with(
    c: &ClusterView,
    w: &Workload,
    opts: &EstimateOptions,
    before: i64,
    mut cache: Option<&mut DeviceCache>,
) -> ClusterPreemption {
    let mut out = ClusterPreemption {
        name: c.name.clone(),
        feasible: false,
        replicas_before: before,
        replicas_after: before,
        victims: Vec::new(),
        freed: BTreeMap::new(),
        evicted_pods: 0,
        highest_victim_priority: None,
        reason: None,
    };
    if before >= w.replicas {
        out.feasible = true;
        return out;
    }
    let cands = candidates(c, w.priority);
    if cands.is_empty() {
        out.reason = Some("no lower-priority workload runs here".into());
        return out;
    }
    let all: Vec<&Candidate> = cands.iter().collect();
    let mut overlay = overlay_of(c, &all);
    let first = estimate_cluster(c, w, opts, Some(&overlay), cache.as_deref_mut());
    if first.max_replicas < w.replicas {
        out.replicas_after = first.max_replicas;
        out.reason = Some(format!(
            "even evicting every lower-priority workload leaves room for {} of {} replicas ({})",
            first.max_replicas, w.replicas, first.limited_by
        ));
        return out;
    }
    let mut after = first.max_replicas;
    let mut evicted: Vec<&Candidate> = Vec::new();
    for cand in &cands {
        // Try giving this workload its pods back.
        overlay.restore_pods(c, &cand.pods);
        let est = estimate_cluster(c, w, opts, Some(&overlay), cache.as_deref_mut());
        if est.max_replicas >= w.replicas {
            after = est.max_replicas;
        } else {
            overlay.remove_pods(c, &cand.pods);
            evicted.push(cand);
        }
    }
    let mut freed = ResList::new();
    for v in &evicted {
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
    out.highest_victim_priority = evicted.iter().map(|v| v.priority).max();
    out.freed = freed.to_map();
    out.feasible = true;
    out.replicas_after = after;
    out
}

fn cpu_of(freed: &BTreeMap<String, String>) -> i64 {
    freed
        .get(ResName::Cpu.as_str())
        .and_then(|s| dramesh_model::Quantity::parse(s).ok())
        .map_or(0, |q| i64::try_from(q.milli_ceil()).unwrap_or(i64::MAX))
}

/// Chooses victims and the cluster to preempt on for `w`.
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
        .filter(|c| c.max_replicas >= w.replicas)
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
    for c in view.clusters() {
        if !opts.clusters.is_empty() && !opts.clusters.contains(&c.name) {
            continue;
        }
        let before = est.cluster(&c.name).map(|e| e.max_replicas).unwrap_or(0);
        let cache = if opts.disable_cache {
            None
        } else {
            Some(estimator.device_cache.entry(c.name.clone()).or_default())
        };
        result
            .clusters
            .push(preempt_cluster_with(c, w, opts, before, cache));
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
        None => {
            result.reason = Some("no cluster can fit the workload even after preemption".into())
        }
    }
    result
}
