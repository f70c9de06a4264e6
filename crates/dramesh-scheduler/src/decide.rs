//! The decision for one binding, as karmada-scheduler's `Schedule` makes it, with devices:
//!
//! 1. **Filter** the Karmada clusters with Karmada's default filter plugins in its
//!    registry's order ([`refusal`]: APIEnablement, TaintToleration, ClusterAffinity,
//!    SpreadConstraint, ClusterEviction), skipping clusters being deleted, then dramesh's
//!    own: data that is not stale.
//! 2. **Estimate** each cluster left: a cluster a dramesh agent reports with the estimator on
//!    the view (devices included); one Karmada knows but no agent reports as Karmada's
//!    general estimator does ([`crate::general`]: its `status.resourceSummary`, or its
//!    resource models when it reports node counts per grade), and never for a workload with
//!    device claims (0, with the reason).
//! 3. **Select**: clusters ranked by locality (already used first), available replicas
//!    (the estimate plus what the binding has there) and name; spread constraints applied
//!    with the estimator's `select_spread` (Karmada's selection by region and by cluster).
//! 4. **Assign** with the estimator's `assign_keeping` (previous assignments kept on scale up
//!    and down; divided afresh after a requested reschedule; static weights divided afresh
//!    with the previous assignment breaking ties).
//!
//! `clusterAffinities` terms are tried in order from the one last scheduled with, as
//! `scheduleResourceBindingWithClusterAffinities` does. Failures get Karmada's reasons and
//! messages (`NoClusterFit` with the filter histogram, `Unschedulable`, `SchedulerError`).

use std::collections::BTreeMap;

use dramesh_estimator::{
    ClusterAffinity, DEADLINE_EXCEEDED, EstimateOptions, Estimator, Previous, SpreadCandidate,
    SpreadDemand, Strategy, TargetCluster, View, assign_keeping, estimate_component_sets,
    select_spread, tie_ascending,
};
use dramesh_model::k8s::Taint;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::demand::Demand;
use crate::general::{general_replicas, general_sets};
use crate::object::{Binding, BindingKind, Cluster};
use crate::patch::{self, Patch, Reason, ScheduledCondition};
use crate::trigger::reschedule_required;

/// Karmada's success message (`successfulSchedulingMessage`).
pub const SUCCESS_MESSAGE: &str = "Binding has been scheduled successfully.";

/// The filter reason of a cluster whose dramesh data is stale.
pub const STALE_REASON: &str = "cluster(s) had stale dramesh data";

/// An Event karmada-scheduler records, on the binding and on its resource template
/// (`spec.resource`) alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// `Normal` or `Warning`.
    pub type_: &'static str,
    /// `ScheduleBindingSucceed` or `ScheduleBindingFailed`.
    pub reason: &'static str,
    /// The message.
    pub message: String,
}

impl Event {
    fn failed(message: String) -> Event {
        Event {
            type_: "Warning",
            reason: "ScheduleBindingFailed",
            message,
        }
    }
}

/// How a binding that was not scheduled is retried (timed by [`crate::Backoff`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Scheduled: nothing to retry.
    No,
    /// No cluster fits or the fitting ones are too small: retry when the view changes.
    Unschedulable,
    /// An error: retry after the backoff.
    Error,
}

/// The decision for one binding.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The `spec.clusters` to write with the applied-placement annotation; `None` leaves the
    /// spec alone (Karmada writes the result on success and clears it when no cluster fits).
    pub clusters: Option<Vec<TargetCluster>>,
    /// The `clusterAffinities` term scheduled with, to record in the status.
    pub affinity_name: Option<String>,
    /// The `Scheduled` condition.
    pub condition: ScheduledCondition,
    /// Events to record.
    pub events: Vec<Event>,
    /// Whether and how to retry.
    pub retry: Retry,
    /// Available replicas of each cluster that passed the filters (of the last term tried).
    pub available: BTreeMap<String, i64>,
    /// Why each other cluster got nothing.
    pub excluded: BTreeMap<String, String>,
}

impl Decision {
    /// A `SchedulerError` for a binding that could not be decided (its resource template
    /// could not be read or decoded, ...): Karmada's failure condition and Event, retried
    /// after the backoff, the spec left alone.
    pub fn error(message: String) -> Decision {
        failure(
            &Failure::Error(patch::truncate(message, patch::MAX_MESSAGE)),
            Vec::new(),
            Attempt {
                available: BTreeMap::new(),
                excluded: BTreeMap::new(),
                stale: Vec::new(),
            },
            true,
        )
    }

    /// The writes, in karmada-scheduler's order: the schedule result, the affinity term name,
    /// then the condition (with, on success, the observed generation and, when the result
    /// changed, `lastScheduledTime` = `now`: see [`patch::scheduled_condition`]). Empty
    /// patches are left out.
    pub fn patches(&self, b: &Binding, now: &Time) -> Vec<Patch> {
        let mut out = Vec::new();
        if let Some(c) = &self.clusters {
            out.extend(patch::schedule_result(b, c));
        }
        out.extend(self.status_patches(b, now, self.refreshes(b)));
        out
    }

    /// Whether a success moves `lastScheduledTime` on `b`: the decision changes
    /// `spec.clusters`, or a reschedule was requested. Judged on the binding the decision
    /// was made on, before its spec is written.
    pub fn refreshes(&self, b: &Binding) -> bool {
        reschedule_required(b)
            || self
                .clusters
                .as_ref()
                .is_some_and(|c| patch::schedule_result(b, c).is_some())
    }

    /// The status patches alone (the affinity term name, then the condition), for `b` as it
    /// is after the spec write; `refresh` is [`Decision::refreshes`] of the binding decided.
    pub fn status_patches(&self, b: &Binding, now: &Time, refresh: bool) -> Vec<Patch> {
        let mut out = Vec::new();
        if let Some(n) = &self.affinity_name {
            out.extend(patch::affinity_name(b, n));
        }
        out.extend(patch::scheduled_condition(b, &self.condition, now, refresh));
        out
    }
}

/// What the decision reads besides the binding.
#[derive(Debug, Clone, Copy)]
pub struct Fleet<'a> {
    /// The Karmada clusters by name.
    pub clusters: &'a BTreeMap<String, Cluster>,
    /// dramesh's view: the clusters agents report.
    pub view: &'a View,
}

enum Failure {
    /// No cluster passed the filters: reasons with their cluster counts.
    Fit {
        total: usize,
        reasons: BTreeMap<String, usize>,
    },
    Unschedulable(String),
    Error(String),
}

impl Failure {
    fn message(&self) -> String {
        match self {
            Failure::Fit { total, reasons } => {
                let mut parts: Vec<String> =
                    reasons.iter().map(|(r, n)| format!("{n} {r}")).collect();
                parts.sort();
                format!("0/{total} clusters are available: {}.", parts.join(", "))
            }
            Failure::Unschedulable(m) | Failure::Error(m) => m.clone(),
        }
    }
}

/// corev1 `Taint.ToString`.
fn taint_string(t: &Taint) -> String {
    match t.value.as_deref().filter(|v| !v.is_empty()) {
        Some(v) => format!("{}={}:{}", t.key, v, t.effect),
        None => format!("{}:{}", t.key, t.effect),
    }
}

struct Candidate<'a> {
    name: String,
    cluster: &'a Cluster,
    /// The estimate (Karmada's `AllocatableReplicas`).
    allocatable: i64,
    /// Plus what the binding has there (`AvailableReplicas`).
    available: i64,
    /// ClusterLocality's score: 100 for a cluster already in `spec.clusters`.
    score: i64,
}

#[derive(Default)]
pub(crate) struct Attempt {
    pub(crate) available: BTreeMap<String, i64>,
    pub(crate) excluded: BTreeMap<String, String>,
    pub(crate) stale: Vec<String>,
}

/// APIEnablement's reason.
pub const API_REASON: &str = "cluster(s) did not have the API resource";
/// ClusterAffinity's reason.
pub const AFFINITY_REASON: &str =
    "cluster(s) did not match the placement cluster affinity constraint";
/// ClusterEviction's reason.
pub const EVICTION_REASON: &str = "cluster(s) is in the process of eviction";

/// Why Karmada's filter plugins (and dramesh's staleness) refuse cluster `c` for `b`, or
/// `None` when it passes. The plugins run in the order of Karmada's plugin registry
/// (`pkg/scheduler/framework/plugins/registry.go`), the first refusal being the reason:
///
/// 1. **APIEnablement**: a cluster not in `spec.clusters` must list the resource's
///    group/version and kind in `status.apiEnablements` (since Karmada PR 6462 a cluster in
///    `spec.clusters` always passes, and the `CompleteAPIEnablements` condition is not read).
/// 2. **TaintToleration**: a cluster not in `spec.clusters` must have no NoSchedule or
///    NoExecute taint the `clusterTolerations` do not tolerate. dramesh also holds a cluster
///    in use to its NoExecute taints, which Karmada leaves to its taint manager (dramesh
///    evicts by rescheduling, see [`crate::trigger`]); a cluster that is not ready carries
///    Karmada's not-ready or unreachable taints.
/// 3. **ClusterAffinity**: `affinity` (the placement's, or the `clusterAffinities` term being
///    tried) matches.
/// 4. **SpreadConstraint**: for each spread constraint by `provider`, `region` or `zone`, in
///    order, the cluster has that property (`spec.provider`, `spec.region`, `spec.zones`).
/// 5. **ClusterEviction**: the cluster is not in the binding's graceful eviction tasks.
/// 6. dramesh's own: a cluster an agent reports has data that is not stale.
///
/// Karmada builds its plugin list by ranging over a Go map, so its order (and which reason
/// a cluster failing two plugins is counted under) changes between scheduler restarts;
/// dramesh keeps the registry's source order.
pub fn refusal(
    b: &Binding,
    affinity: Option<&ClusterAffinity>,
    c: &Cluster,
    used: bool,
) -> Option<String> {
    if !used && !c.api_enabled(&b.resource.api_version, &b.resource.kind) {
        return Some(API_REASON.into());
    }
    if let Some(t) = c.untolerated(&b.policy.tolerations, !used) {
        return Some(format!(
            "cluster(s) had untolerated taint {{{}}}",
            taint_string(t)
        ));
    }
    if !affinity.is_none_or(|a| a.matches(&c.name, &c.info)) {
        return Some(AFFINITY_REASON.into());
    }
    for s in &b.placement.spread_constraints {
        let missing = match s.spread_by_field.as_str() {
            "provider" if c.info.provider.is_none() => "provider",
            "region" if c.info.region.is_none() => "region",
            "zone" if !c.has_zones => "zones",
            _ => continue,
        };
        return Some(format!("cluster(s) did not have {missing} property"));
    }
    if b.graceful_eviction_tasks
        .iter()
        .any(|t| t.from_cluster == c.name)
    {
        return Some(EVICTION_REASON.into());
    }
    None
}

/// The clusters that pass [`refusal`] and dramesh's staleness, and the count of clusters
/// per reason for those that do not. A cluster being deleted is skipped without a reason,
/// as Karmada's `findClustersThatFit` skips it.
pub(crate) fn filter<'a>(
    b: &Binding,
    affinity: Option<&ClusterAffinity>,
    fleet: Fleet<'a>,
    opts: &EstimateOptions,
    attempt: &mut Attempt,
) -> (Vec<&'a Cluster>, BTreeMap<String, usize>) {
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut feasible: Vec<&Cluster> = Vec::new();
    for c in fleet.clusters.values() {
        if c.deleting {
            attempt
                .excluded
                .insert(c.name.clone(), "being deleted".into());
            continue;
        }
        let used = b.clusters.iter().any(|t| t.name == c.name);
        let reason = refusal(b, affinity, c, used).or_else(|| {
            (fleet.view.cluster(&c.name).is_some() && opts.stale.contains(&c.name)).then(|| {
                attempt.stale.push(c.name.clone());
                STALE_REASON.to_string()
            })
        });
        match reason {
            Some(r) => {
                attempt.excluded.insert(c.name.clone(), r.clone());
                *reasons.entry(r).or_default() += 1;
            }
            None => feasible.push(c),
        }
    }
    (feasible, reasons)
}

/// Runs `f` with `opts.clusters` set to `clusters`, restoring it after: the caller's options
/// (with their in-flight workloads) are used as they are, not copied per decision.
pub(crate) fn with_clusters<R>(
    opts: &mut EstimateOptions,
    clusters: Vec<String>,
    f: impl FnOnce(&EstimateOptions) -> R,
) -> R {
    let saved = std::mem::replace(&mut opts.clusters, clusters);
    let r = f(opts);
    opts.clusters = saved;
    r
}

/// One `Schedule` run with `affinity` as the cluster affinity.
fn schedule_once(
    b: &Binding,
    demand: &Demand,
    affinity: Option<&ClusterAffinity>,
    fleet: Fleet<'_>,
    estimator: &mut Estimator,
    opts: &mut EstimateOptions,
    attempt: &mut Attempt,
) -> Result<Vec<TargetCluster>, Failure> {
    attempt.available.clear();
    attempt.excluded.clear();
    attempt.stale.clear();
    if opts.past_deadline() {
        return Err(Failure::Error(DEADLINE_EXCEEDED.into()));
    }
    // 1. Filter.
    let (feasible, reasons) = filter(b, affinity, fleet, opts, attempt);
    if feasible.is_empty() {
        return Err(Failure::Fit {
            total: fleet.clusters.len(),
            reasons,
        });
    }

    // 2. Estimate.
    let (in_view, summary_only): (Vec<&Cluster>, Vec<&Cluster>) = feasible
        .iter()
        .partition(|c| fleet.view.cluster(&c.name).is_some());
    let mut est: BTreeMap<&str, i64> = BTreeMap::new();
    let (in_view, left_out): (Vec<&Cluster>, Vec<&Cluster>) = in_view
        .into_iter()
        .partition(|c| opts.clusters.is_empty() || opts.clusters.contains(&c.name));
    for c in left_out {
        attempt
            .excluded
            .insert(c.name.clone(), "not among the clusters asked for".into());
        est.insert(&c.name, 0);
    }
    if !in_view.is_empty() {
        let names = in_view.iter().map(|c| c.name.clone()).collect();
        let e = with_clusters(opts, names, |o| match demand {
            Demand::Replicas(w) => Some(estimator.estimate(fleet.view, w, o)),
            Demand::Components(cs) => Some(estimate_component_sets(fleet.view, cs, o)),
            Demand::Nothing => None,
        });
        for ce in e.iter().flat_map(|e| &e.clusters) {
            if ce.error.as_deref() == Some(DEADLINE_EXCEEDED) {
                return Err(Failure::Error(DEADLINE_EXCEEDED.into()));
            }
            if let Some(err) = &ce.error {
                attempt.excluded.insert(ce.name.clone(), err.clone());
            }
            // `in_view` is in name order (the clusters map's).
            if let Ok(i) = in_view.binary_search_by(|c| c.name.as_str().cmp(&ce.name)) {
                let c = in_view[i];
                est.insert(
                    &c.name,
                    if ce.error.is_some() {
                        0
                    } else {
                        ce.max_replicas
                    },
                );
            }
        }
    }
    for c in &summary_only {
        let n = match demand {
            Demand::Nothing => 0,
            Demand::Replicas(w) if w.needs_devices() => {
                attempt.excluded.insert(
                    c.name.clone(),
                    "no dramesh agent reports this cluster, and a workload with device claims \
                     is never estimated from its resourceSummary"
                        .into(),
                );
                0
            }
            Demand::Replicas(w) => general_replicas(c, &w.requests),
            Demand::Components(cs) => general_sets(c, cs),
        };
        est.insert(&c.name, n);
    }
    let replicas = i64::from(b.replicas);
    let mut ranked: Vec<Candidate> = feasible
        .iter()
        .map(|c| {
            // Karmada caps at MaxInt32 and reads "unlimited" (a non-workload) as the spec's
            // replicas.
            let a = match demand {
                Demand::Nothing => replicas,
                _ => est
                    .get(c.name.as_str())
                    .copied()
                    .unwrap_or(0)
                    .min(i64::from(i32::MAX)),
            };
            Candidate {
                name: c.name.clone(),
                cluster: c,
                allocatable: a,
                available: a + b.assigned(&c.name),
                score: if b.clusters.iter().any(|t| t.name == c.name) {
                    100
                } else {
                    0
                },
            }
        })
        .collect();
    for c in &ranked {
        attempt.available.insert(c.name.clone(), c.allocatable);
    }
    ranked.sort_by(|a, b| {
        b.score
            .cmp(&a.score)
            .then_with(|| b.available.cmp(&a.available))
            .then_with(|| a.name.cmp(&b.name))
    });

    // 3. Select.
    let spread = &b.policy.spread;
    let selected: Vec<&Candidate> =
        if spread.is_empty() || matches!(b.policy.strategy, Strategy::StaticWeight(_)) {
            ranked.iter().collect()
        } else {
            let duplicated = b.policy.strategy == Strategy::Duplicated;
            let need = match demand {
                _ if duplicated => None,
                // A multi-component workload is one set.
                Demand::Components(_) => Some(1),
                _ => Some(replicas),
            };
            let candidates: Vec<SpreadCandidate<'_>> = ranked
                .iter()
                .map(|c| SpreadCandidate {
                    name: &c.name,
                    info: &c.cluster.info,
                    score: c.score,
                    available: c.available,
                })
                .collect();
            let wanted = SpreadDemand {
                replicas,
                duplicated,
                need,
            };
            let chosen = select_spread(&candidates, spread, wanted)
                .map_err(|e| Failure::Error(format!("failed to select clusters: {e}")))?;
            chosen
                .iter()
                .filter_map(|n| ranked.iter().find(|c| c.name == *n))
                .collect()
        };
    if selected.is_empty() {
        return Err(Failure::Error(
            "failed to assign replicas: no clusters available to schedule".into(),
        ));
    }

    // 4. Assign.
    let w = match demand {
        Demand::Replicas(w) => w,
        // Multi-component workloads and non-workloads go to every selected cluster.
        Demand::Components(_) | Demand::Nothing => {
            return Ok(selected
                .iter()
                .map(|c| TargetCluster {
                    name: c.name.clone(),
                    replicas: 0,
                })
                .collect());
        }
    };
    let pairs: Vec<(String, i64)> = selected
        .iter()
        .map(|c| (c.name.clone(), c.allocatable))
        .collect();
    let infos: dramesh_estimator::ClusterInfos<'_> = selected
        .iter()
        .filter_map(|c| fleet.clusters.get(&c.name))
        .map(|c| (c.name.as_str(), &c.info))
        .collect();
    let fresh = reschedule_required(b);
    let previous = Previous {
        clusters: &b.clusters,
        fresh,
    };
    match assign_keeping(
        &b.policy.strategy,
        replicas,
        &pairs,
        &infos,
        tie_ascending(w),
        previous,
    ) {
        Ok(result) => Ok(result.into_iter().filter(|t| t.replicas > 0).collect()),
        Err(m) => {
            let assigned: i64 = b
                .clusters
                .iter()
                .filter(|t| selected.iter().any(|c| c.name == t.name))
                .map(|t| t.replicas)
                .sum();
            let mode = if fresh {
                "failed to do fresh scale"
            } else if assigned > replicas {
                "failed to scale down"
            } else {
                "failed to scale up"
            };
            Err(Failure::Unschedulable(format!(
                "failed to assign replicas: {mode}: {m}"
            )))
        }
    }
}

fn stale_note(stale: &[String]) -> String {
    if stale.is_empty() {
        String::new()
    } else {
        format!(" Not considered, dramesh data stale: {}.", stale.join(", "))
    }
}

fn success(
    b: &Binding,
    clusters: Vec<TargetCluster>,
    affinity_name: Option<String>,
    mut events: Vec<Event>,
    attempt: Attempt,
) -> Decision {
    let listed: Vec<String> = clusters
        .iter()
        .map(|c| format!("{}:{}", c.name, c.replicas))
        .collect();
    let sep = match b.kind {
        BindingKind::ResourceBinding => "Result:",
        BindingKind::ClusterResourceBinding => "Result",
    };
    events.push(Event {
        type_: "Normal",
        reason: "ScheduleBindingSucceed",
        message: format!("{SUCCESS_MESSAGE} {sep} {{{}}}", listed.join(", ")),
    });
    Decision {
        clusters: Some(clusters),
        affinity_name,
        condition: ScheduledCondition {
            status: true,
            reason: Reason::Success,
            message: format!("{SUCCESS_MESSAGE}{}", stale_note(&attempt.stale)),
        },
        events,
        retry: Retry::No,
        available: attempt.available,
        excluded: attempt.excluded,
    }
}

fn failure(f: &Failure, mut events: Vec<Event>, attempt: Attempt, record: bool) -> Decision {
    let (reason, retry, clusters) = match f {
        // Karmada writes the empty result (removing the binding from every cluster) and
        // waits for a cluster event.
        Failure::Fit { .. } => (Reason::NoClusterFit, Retry::Unschedulable, Some(Vec::new())),
        Failure::Unschedulable(_) => (Reason::Unschedulable, Retry::Unschedulable, None),
        Failure::Error(_) => (Reason::SchedulerError, Retry::Error, None),
    };
    let mut message = f.message();
    if !matches!(f, Failure::Fit { .. }) {
        message.push_str(&stale_note(&attempt.stale));
    }
    if record {
        events.push(Event::failed(message.clone()));
    }
    Decision {
        clusters,
        affinity_name: None,
        condition: ScheduledCondition {
            status: false,
            reason,
            message,
        },
        events,
        retry,
        available: attempt.available,
        excluded: attempt.excluded,
    }
}

/// Decides where `b` goes. `demand` is what it asks for ([`crate::demand`]); `opts` carries
/// the stale clusters, the deadline and the in-flight workloads (reservations) to deduct;
/// a non-empty `opts.clusters` further restricts the clusters dramesh estimates (it is
/// borrowed mutably only to narrow that list during the call, and left as it was).
pub fn decide(
    b: &Binding,
    demand: &Demand,
    fleet: Fleet<'_>,
    estimator: &mut Estimator,
    opts: &mut EstimateOptions,
) -> Decision {
    let mut attempt = Attempt {
        available: BTreeMap::new(),
        excluded: BTreeMap::new(),
        stale: Vec::new(),
    };
    let terms = &b.policy.affinities;
    if terms.is_empty() {
        return match schedule_once(
            b,
            demand,
            b.policy.affinity.as_ref(),
            fleet,
            estimator,
            opts,
            &mut attempt,
        ) {
            Ok(c) => success(b, c, None, Vec::new(), attempt),
            Err(f) => failure(&f, Vec::new(), attempt, true),
        };
    }
    let observed = &b.status.scheduler_observed_affinity_name;
    let mut i = if reschedule_required(b) {
        0
    } else {
        terms.iter().position(|t| t.name == *observed).unwrap_or(0)
    };
    let mut events = Vec::new();
    let mut first: Option<Failure> = None;
    while i < terms.len() {
        match schedule_once(
            b,
            demand,
            Some(&terms[i].affinity),
            fleet,
            estimator,
            opts,
            &mut attempt,
        ) {
            Ok(c) => return success(b, c, Some(terms[i].name.clone()), events, attempt),
            Err(f) => {
                events.push(Event::failed(format!(
                    "failed to schedule {}({}) with clusterAffiliates index({i}): {}",
                    b.kind.as_str(),
                    b.key(),
                    f.message()
                )));
                first.get_or_insert(f);
                i += 1;
            }
        }
    }
    let Some(f) = first else {
        // `terms` is not empty, so some term was tried unless the observed one was the last
        // and succeeded; unreachable, answered as an error rather than a panic.
        return failure(
            &Failure::Error("no cluster affinity term to schedule with".into()),
            events,
            attempt,
            true,
        );
    };
    // Karmada records the final failure only when it is a fit error (it then writes the
    // empty result); any other first error is returned as it is.
    let record = matches!(f, Failure::Fit { .. });
    failure(&f, events, attempt, record)
}

/// Decides a binding again after overcommit resolution gave the room of replicas this
/// scheduler had added to it to other schedulers' reservations: `kept` is the binding
/// without them. The missing replicas are placed as on a scale up (what `kept` has stays
/// where it is). When they do not fit, the result goes back to `kept`: they are taken off,
/// never left on a cluster whose room another scheduler holds.
pub fn decide_after_loss(
    kept: &Binding,
    demand: &Demand,
    fleet: Fleet<'_>,
    estimator: &mut Estimator,
    opts: &mut EstimateOptions,
) -> Decision {
    let mut d = decide(kept, demand, fleet, estimator, opts);
    if d.retry != Retry::No || d.clusters.is_none() {
        d.clusters = Some(kept.clusters.clone());
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taints_print_as_kubernetes_does() {
        let t = |value: Option<&str>| Taint {
            key: "k".into(),
            value: value.map(str::to_string),
            effect: "NoSchedule".into(),
            time_added: None,
        };
        assert_eq!(taint_string(&t(None)), "k:NoSchedule");
        assert_eq!(taint_string(&t(Some("v"))), "k=v:NoSchedule");
    }
}
