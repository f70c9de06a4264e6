//! Binding preemption: a binding with a higher `schedulePriority` that fits nowhere evicts
//! lower-priority bindings from one cluster, chosen by the estimator's device-aware
//! [`dramesh_estimator::preempt`] (remove every lower-priority workload, reprieve from the
//! highest priority down while the preemptor still fits; the cluster with the least harm).
//!
//! Victims leave the chosen cluster the way Karmada's failover evicts
//! (`GracefulEvictCluster`): the cluster is removed from their `spec.clusters` and a
//! `spec.gracefulEvictionTasks` entry records it, with Karmada's binding-preemption proposal
//! (PR 7327) values: reason `BindingPreempted`, producer `Scheduler`, purge mode
//! `Gracefully`, a 30 s grace period, and a message naming the preemptor.
//!
//! Guarantees: nothing is evicted unless evicting the victims lets every replica of the
//! preemptor fit on that cluster (a plan the estimator proves; a lower-bound answer never
//! counts); a preemptor whose policy is `Never` evicts nothing; every victim is a binding of
//! strictly lower priority that has replicas on the cluster and is not already being evicted
//! from it. A cluster whose victims would include pods no such binding owns (pods Karmada
//! did not place, or of bindings of equal or higher priority) is not chosen.

use std::borrow::Borrow;

use dramesh_estimator::{EstimateOptions, Estimator, preempt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Map, Value, json};

use crate::decide::{Attempt, Event, Fleet, filter, with_clusters};
use crate::demand::Demand;
use crate::object::{Binding, GracefulEvictionTask};
use crate::patch::{Patch, clusters_value, go_json, merge_diff};

/// `GracefulEvictionTask.reason` of a preemption (PR 7327 `EvictionReasonBindingPreempted`).
pub const EVICTION_REASON: &str = "BindingPreempted";
/// `GracefulEvictionTask.producer` of a preemption (PR 7327 `EvictionProducerScheduler`).
pub const EVICTION_PRODUCER: &str = "Scheduler";
/// The grace period PR 7327 gives victims.
pub const GRACE_PERIOD_SECONDS: i32 = 30;

/// One victim's eviction from the chosen cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Eviction {
    /// Index of the victim in the `bindings` given to [`plan_preemption`].
    pub victim: usize,
    /// Replicas it had there.
    pub replicas: i64,
    /// The merge patch (spec): the cluster removed, the eviction task added.
    pub patch: Patch,
    /// The `Preempted` event on the victim.
    pub event: Event,
}

/// The preemption to carry out.
#[derive(Debug, Clone, PartialEq)]
pub struct PreemptionPlan {
    /// The cluster the preemptor will go to once the victims are gone.
    pub cluster: String,
    /// The evictions.
    pub evictions: Vec<Eviction>,
    /// The `PreemptionInitiated` event on the preemptor.
    pub event: Event,
}

/// The victim's patch: Karmada `GracefulEvictCluster` of `cluster` (removed from the result;
/// a task added unless one for that cluster exists), as a merge patch of its spec.
pub fn eviction_patch(victim: &Binding, cluster: &str, message: &str, now: &Time) -> Option<Patch> {
    let i = victim.clusters.iter().position(|c| c.name == cluster)?;
    let mut clusters = victim.clusters.clone();
    let evicted = clusters.remove(i);
    let mut tasks = victim.graceful_eviction_tasks.clone();
    if !tasks.iter().any(|t| t.from_cluster == cluster) {
        tasks.push(GracefulEvictionTask {
            from_cluster: cluster.to_string(),
            purge_mode: "Gracefully".into(),
            replicas: (evicted.replicas > 0)
                .then(|| i32::try_from(evicted.replicas).unwrap_or(i32::MAX)),
            reason: EVICTION_REASON.into(),
            message: crate::patch::truncate(message.to_string(), crate::patch::MAX_MESSAGE),
            producer: EVICTION_PRODUCER.into(),
            grace_period_seconds: Some(GRACE_PERIOD_SECONDS),
            creation_timestamp: Some(now.clone()),
            ..GracefulEvictionTask::default()
        });
    }
    let spec = |clusters: &[dramesh_estimator::TargetCluster], tasks: &[GracefulEvictionTask]| {
        let mut m = Map::new();
        if !clusters.is_empty() {
            m.insert("clusters".into(), clusters_value(clusters));
        }
        if !tasks.is_empty() {
            m.insert(
                "gracefulEvictionTasks".into(),
                serde_json::to_value(tasks).unwrap_or(Value::Null),
            );
        }
        json!({ "spec": m })
    };
    let old = spec(&victim.clusters, &victim.graceful_eviction_tasks);
    let new = spec(&clusters, &tasks);
    merge_diff(&old, &new).map(|d| Patch {
        status: false,
        body: go_json(&d.to_string()),
    })
}

/// Plans the preemption for `preemptor`, which fits nowhere, among `bindings` (every binding
/// the replica knows; the preemptor itself is skipped). `Err` says why nothing is evicted.
/// `opts` is used as [`crate::decide()`] uses it.
pub fn plan_preemption<B: Borrow<Binding>>(
    preemptor: &Binding,
    demand: &Demand,
    bindings: &[B],
    fleet: Fleet<'_>,
    estimator: &mut Estimator,
    opts: &mut EstimateOptions,
    now: &Time,
) -> Result<PreemptionPlan, String> {
    let Demand::Replicas(w) = demand else {
        return Err("only workloads with one pod template preempt".into());
    };
    if !w.preempt_lower_priority {
        return Err("the binding's preemptionPolicy is Never".into());
    }
    if !preemptor.policy.affinities.is_empty() {
        return Err(
            "binding preemption supports clusterAffinity only, not clusterAffinities".into(),
        );
    }
    let mut attempt = Attempt::default();
    let (feasible, _) = filter(
        preemptor,
        preemptor.policy.affinity.as_ref(),
        fleet,
        opts,
        &mut attempt,
    );
    let mut candidates: Vec<String> = feasible
        .iter()
        .filter(|c| {
            fleet.view.cluster(&c.name).is_some()
                && (opts.clusters.is_empty() || opts.clusters.contains(&c.name))
        })
        .map(|c| c.name.clone())
        .collect();
    let priority = preemptor.priority();
    let mut refused: Vec<String> = Vec::new();
    while !candidates.is_empty() {
        let r = with_clusters(opts, candidates.clone(), |o| {
            preempt(fleet.view, w, estimator, o)
        });
        if let Some(c) = r.fits_without_preemption {
            return Err(format!("the binding fits on {c} without preemption"));
        }
        let Some(chosen) = r.chosen else {
            let mut why = r
                .reason
                .unwrap_or_else(|| "no cluster can make room".into());
            if !refused.is_empty() {
                why.push_str(&format!(
                    "; not chosen, victims not evictable bindings of lower priority: {}",
                    refused.join(", ")
                ));
            }
            return Err(why);
        };
        let victims = r
            .clusters
            .iter()
            .find(|c| c.name == chosen)
            .map(|c| c.victims.clone())
            .unwrap_or_default();
        let mut found = Vec::with_capacity(victims.len());
        for v in &victims {
            let b = bindings.iter().map(Borrow::borrow).position(|b: &Binding| {
                !(b.kind == preemptor.kind
                    && b.metadata.namespace == preemptor.metadata.namespace
                    && b.metadata.name == preemptor.metadata.name)
                    && b.resource.kind == v.kind
                    && b.resource.namespace == v.namespace
                    && b.resource.name == v.name
                    && b.priority() < priority
                    && b.assigned(&chosen) > 0
                    && !b
                        .graceful_eviction_tasks
                        .iter()
                        .any(|t| t.from_cluster == chosen)
            });
            match b {
                Some(i) => found.push(i),
                None => break,
            }
        }
        if victims.is_empty() || found.len() != victims.len() {
            refused.push(chosen.clone());
            candidates.retain(|c| *c != chosen);
            continue;
        }
        let message = format!(
            "preempted by {} (priority {priority}) to place it on cluster {chosen}",
            preemptor.id()
        );
        let mut evictions = Vec::with_capacity(found.len());
        for i in found {
            let b: &Binding = bindings[i].borrow();
            let Some(patch) = eviction_patch(b, &chosen, &message, now) else {
                continue;
            };
            evictions.push(Eviction {
                victim: i,
                replicas: b.assigned(&chosen),
                patch,
                event: Event {
                    type_: "Warning",
                    reason: "Preempted",
                    message: message.clone(),
                },
            });
        }
        let names: Vec<String> = evictions
            .iter()
            .map(|e| bindings[e.victim].borrow().key())
            .collect();
        return Ok(PreemptionPlan {
            event: Event {
                type_: "Normal",
                reason: "PreemptionInitiated",
                message: format!(
                    "preempting {} binding(s) on cluster {chosen}: {}",
                    names.len(),
                    names.join(", ")
                ),
            },
            cluster: chosen,
            evictions,
        });
    }
    Err(if refused.is_empty() {
        "no cluster dramesh agents report passes the binding's filters".into()
    } else {
        format!(
            "no cluster can make room by evicting bindings of lower priority (victims on {} are not evictable bindings of lower priority)",
            refused.join(", ")
        )
    })
}
