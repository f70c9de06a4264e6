//! When to schedule a binding: karmada-scheduler's `doScheduleBinding` (placement changed
//! since the applied-placement annotation, replicas changed, reschedule requested,
//! Duplicated and non-workload bindings always, a target cluster being deleted), extended
//! with the cluster events the scheduler role reacts to itself: a target cluster that left,
//! is not ready, or carries a NoExecute taint the placement does not tolerate. And when to
//! retry a binding that could not be scheduled ([`Backoff`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dramesh_estimator::Strategy;

use crate::object::{APPLIED_PLACEMENT, Binding, Cluster, Readiness};
use crate::patch::{self, Patch};

/// Why a binding is scheduled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// `spec.placement` differs from the applied-placement annotation (or there is none yet).
    PlacementChanged,
    /// `spec.replicas` differs from what `spec.clusters` holds.
    ReplicasChanged,
    /// `spec.rescheduleTriggeredAt` is after `status.lastScheduledTime`: divide afresh.
    RescheduleRequested,
    /// Duplicated and non-workload bindings are scheduled whenever they are looked at.
    Duplicated,
    /// A cluster in `spec.clusters` is being deleted.
    ClusterDeleting(String),
    /// A cluster in `spec.clusters` no longer exists.
    ClusterGone(String),
    /// A cluster in `spec.clusters` is not ready (a not-ready or unreachable taint the
    /// placement does not tolerate).
    ClusterNotReady(String),
    /// A cluster in `spec.clusters` has a NoExecute taint the placement does not tolerate.
    ClusterTainted(String),
    /// The generation moved past `schedulerObservedGeneration` while the `Scheduled`
    /// condition is not `True`: the last decision's status write did not land after its
    /// spec write (a timeout, too many conflicts), or the spec changed after a failure.
    /// Karmada would write the observed generation alone, leaving the binding with a result
    /// and no condition confirming it; deciding again writes the condition (the result is
    /// kept where it still fits).
    StatusBehind,
}

impl Trigger {
    /// Karmada's metric label for it: `ScaleSchedule` for replica changes, else
    /// `ReconcileSchedule`.
    pub fn schedule_type(&self) -> &'static str {
        match self {
            Trigger::ReplicasChanged => "ScaleSchedule",
            _ => "ReconcileSchedule",
        }
    }
}

/// What to do with a binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Not this scheduler's, suspended, not created by Karmada's detector, or being deleted.
    Ignore(&'static str),
    /// Schedule it.
    Schedule(Trigger),
    /// Nothing to schedule; the status patch recording the generation when it moved on.
    Nothing(Option<Patch>),
}

/// Karmada `util.RescheduleRequired`: a reschedule requested after the last success (never
/// before a first success).
pub fn reschedule_required(b: &Binding) -> bool {
    match (&b.reschedule_triggered_at, &b.status.last_scheduled_time) {
        (Some(t), Some(last)) => t.0 > last.0,
        _ => false,
    }
}

/// Karmada `util.IsBindingReplicasChanged` (single-template form).
fn replicas_changed(b: &Binding) -> bool {
    if b.placement.replica_scheduling.is_none() {
        return false;
    }
    let want = i64::from(b.replicas);
    match b.policy.strategy {
        Strategy::Duplicated => b.clusters.iter().any(|c| c.replicas != want),
        _ => b.clusters.iter().map(|c| c.replicas).sum::<i64>() != want,
    }
}

/// The first cluster of `spec.clusters` that the binding should leave, and why.
fn leaving(b: &Binding, clusters: &BTreeMap<String, Cluster>) -> Option<Trigger> {
    for t in &b.clusters {
        let Some(c) = clusters.get(&t.name) else {
            return Some(Trigger::ClusterGone(t.name.clone()));
        };
        if c.deleting {
            return Some(Trigger::ClusterDeleting(t.name.clone()));
        }
        if let Some(taint) = c.untolerated(&b.policy.tolerations, false) {
            let readiness_taint = taint.key == crate::object::TAINT_NOT_READY
                || taint.key == crate::object::TAINT_UNREACHABLE;
            return Some(if readiness_taint && c.readiness != Readiness::Ready {
                Trigger::ClusterNotReady(t.name.clone())
            } else {
                Trigger::ClusterTainted(t.name.clone())
            });
        }
    }
    None
}

/// Decides whether `b` is to be scheduled by the scheduler named `scheduler`, given the
/// Karmada clusters by name. The checks run in karmada-scheduler's order; the cluster checks
/// come last, as `HasTerminatingTargetClusters` does.
pub fn plan(b: &Binding, clusters: &BTreeMap<String, Cluster>, scheduler: &str) -> Action {
    if !b.handled_by(scheduler) {
        return Action::Ignore("another scheduler's, suspended, or not managed by Karmada");
    }
    if b.metadata.deletion_timestamp.is_some() {
        return Action::Ignore("being deleted");
    }
    let applied = b
        .metadata
        .annotations
        .get(APPLIED_PLACEMENT)
        .map(String::as_str);
    if b.placement
        .changed_since(applied, &b.status.scheduler_observed_affinity_name)
    {
        return Action::Schedule(Trigger::PlacementChanged);
    }
    if replicas_changed(b) {
        return Action::Schedule(Trigger::ReplicasChanged);
    }
    if reschedule_required(b) {
        return Action::Schedule(Trigger::RescheduleRequested);
    }
    if !b.is_workload() || b.policy.strategy == Strategy::Duplicated {
        return Action::Schedule(Trigger::Duplicated);
    }
    if let Some(t) = leaving(b, clusters) {
        return Action::Schedule(t);
    }
    if b.metadata.generation != b.status.scheduler_observed_generation {
        let confirmed = b
            .status
            .conditions
            .iter()
            .any(|c| c.type_ == "Scheduled" && c.status == "True");
        if !confirmed {
            return Action::Schedule(Trigger::StatusBehind);
        }
        return Action::Nothing(patch::observed_generation(b));
    }
    Action::Nothing(None)
}

/// Karmada `enqueueAffectedBindings`: whether a change of `cluster` (joined, labels or spec
/// changed, being deleted) should requeue `b` for [`plan`]: the binding is this scheduler's
/// and its cluster affinity in use (the observed `clusterAffinities` term, or any while the
/// binding has not been scheduled at its generation) is absent or matches the cluster. The
/// clusters `b` already uses are requeued too, so that leaving ones are noticed.
pub fn affected_by_cluster(b: &Binding, cluster: &Cluster, scheduler: &str) -> bool {
    if !b.handled_by(scheduler) {
        return false;
    }
    if b.clusters.iter().any(|t| t.name == cluster.name) {
        return true;
    }
    let terms = &b.policy.affinities;
    let affinity = if terms.is_empty() {
        b.policy.affinity.as_ref()
    } else {
        if b.status.scheduler_observed_generation != b.metadata.generation {
            return true;
        }
        let observed = &b.status.scheduler_observed_affinity_name;
        let i = terms.iter().position(|t| t.name == *observed).unwrap_or(0);
        Some(&terms[i].affinity)
    };
    affinity.is_none_or(|a| a.matches(&cluster.name, &cluster.info))
}

/// When to retry a binding that was not scheduled, with karmada-scheduler's queue values
/// (`pkg/scheduler/internal/queue`): a backoff of 1 s doubling per attempt up to 10 s, and
/// an unschedulable binding left alone for at most 5 minutes.
///
/// A binding that failed with an error (`SchedulerError`) is retried when its backoff ends.
/// One that is unschedulable (`NoClusterFit`, `Unschedulable`) waits for the view to change,
/// as Karmada parks it until a cluster event; once the view has changed it is retried when
/// its backoff ends (so a view changing every few milliseconds does not retry it as often),
/// and after 5 minutes in any case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// First backoff (`DefaultBindingInitialBackoffDuration`, 1 s).
    pub initial: Duration,
    /// Largest backoff (`DefaultBindingMaxBackoffDuration`, 10 s).
    pub max: Duration,
    /// Longest wait of an unschedulable binding
    /// (`DefaultBindingMaxInUnschedulableBindingsDuration`, 5 min).
    pub unschedulable_max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(10),
            unschedulable_max: Duration::from_secs(300),
        }
    }
}

/// The retry state of one binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryState {
    /// Failed attempts in a row.
    pub attempts: u32,
    /// When the last attempt failed.
    pub at: Instant,
    /// The view's change counter then.
    pub view: u64,
    /// True when it failed as unschedulable rather than with an error.
    pub unschedulable: bool,
}

impl Backoff {
    /// The backoff after `attempts` failures: 0, 1 s, 2 s, 4 s, 8 s, 10 s, ...
    pub fn delay(&self, attempts: u32) -> Duration {
        if attempts == 0 {
            return Duration::ZERO;
        }
        let mut d = self.initial;
        for _ in 1..attempts {
            if d > self.max.saturating_sub(d) {
                return self.max;
            }
            d += d;
        }
        d.min(self.max)
    }

    /// The retry state after a failed attempt at `now` on view `view`.
    pub fn failed(
        &self,
        previous: Option<&RetryState>,
        now: Instant,
        view: u64,
        unschedulable: bool,
    ) -> RetryState {
        RetryState {
            attempts: previous.map_or(0, |r| r.attempts).saturating_add(1),
            at: now,
            view,
            unschedulable,
        }
    }

    /// When the binding may be tried again, given the view's change counter now.
    pub fn next_attempt(&self, r: &RetryState, view_now: u64) -> Instant {
        let backoff = r.at + self.delay(r.attempts);
        if r.unschedulable && view_now == r.view {
            r.at + self.unschedulable_max
        } else {
            backoff
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::object::BindingKind;
    use crate::object::tests_support::server_binding;
    use serde_json::{Value, json};

    fn cluster(name: &str, ready: &str, taints: Value) -> Cluster {
        Cluster::from_value(&json!({
            "metadata": {"name": name},
            "spec": {"syncMode": "Push", "taints": taints},
            "status": {"conditions": [{"type": "Ready", "status": ready, "reason": "", "message": "", "lastTransitionTime": "2026-11-25T09:00:00Z"}]}
        }))
        .expect("cluster")
    }

    fn fleet() -> BTreeMap<String, Cluster> {
        ["m1", "m2", "m3"]
            .into_iter()
            .map(|n| (n.to_string(), cluster(n, "True", json!([]))))
            .collect()
    }

    /// A binding scheduled as it is now: the annotation records its placement, the status
    /// its generation.
    fn settled(edit: impl FnOnce(&mut Value)) -> Binding {
        let mut v = server_binding();
        edit(&mut v);
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
        v["metadata"]["annotations"][APPLIED_PLACEMENT] = json!(b.placement.to_go_json());
        v["status"]["schedulerObservedGeneration"] = v["metadata"]["generation"].clone();
        Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding")
    }

    #[test]
    fn a_settled_binding_needs_nothing() {
        let b = settled(|_| {});
        assert_eq!(
            plan(&b, &fleet(), "dramesh-scheduler"),
            Action::Nothing(None)
        );
    }

    #[test]
    fn other_schedulers_and_deleting_bindings_are_ignored() {
        let b = settled(|_| {});
        assert!(matches!(
            plan(&b, &fleet(), "default-scheduler"),
            Action::Ignore(_)
        ));
        let b = settled(|v| v["metadata"]["deletionTimestamp"] = json!("2026-11-25T11:00:00Z"));
        assert!(matches!(
            plan(&b, &fleet(), "dramesh-scheduler"),
            Action::Ignore(_)
        ));
    }

    #[test]
    fn placement_changes_trigger() {
        let mut v = server_binding();
        v["metadata"]["annotations"][APPLIED_PLACEMENT] =
            json!(r#"{"clusterAffinity":{"clusterNames":["m1"]}}"#);
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
        assert_eq!(
            plan(&b, &fleet(), "dramesh-scheduler"),
            Action::Schedule(Trigger::PlacementChanged)
        );
        let mut v = server_binding();
        v["metadata"]["annotations"] = json!({});
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
        assert_eq!(
            plan(&b, &fleet(), "dramesh-scheduler"),
            Action::Schedule(Trigger::PlacementChanged)
        );
    }

    #[test]
    fn replica_changes_trigger_a_scale() {
        let b = settled(|v| v["spec"]["replicas"] = json!(6));
        let a = plan(&b, &fleet(), "dramesh-scheduler");
        assert_eq!(a, Action::Schedule(Trigger::ReplicasChanged));
        if let Action::Schedule(t) = a {
            assert_eq!(t.schedule_type(), "ScaleSchedule");
        }
    }

    #[test]
    fn a_newer_reschedule_request_triggers_and_an_older_one_does_not() {
        let b = settled(|v| v["spec"]["rescheduleTriggeredAt"] = json!("2026-11-25T11:00:00Z"));
        assert_eq!(
            plan(&b, &fleet(), "dramesh-scheduler"),
            Action::Schedule(Trigger::RescheduleRequested)
        );
        assert!(reschedule_required(&b));
        let b = settled(|v| v["spec"]["rescheduleTriggeredAt"] = json!("2026-11-25T09:00:00Z"));
        assert_eq!(
            plan(&b, &fleet(), "dramesh-scheduler"),
            Action::Nothing(None)
        );
        // Never before a first success.
        let b = settled(|v| {
            v["spec"]["rescheduleTriggeredAt"] = json!("2026-11-25T11:00:00Z");
            v["status"]["lastScheduledTime"] = json!(null);
        });
        assert!(!reschedule_required(&b));
    }

    #[test]
    fn duplicated_and_non_workloads_always_schedule() {
        let b = settled(|v| {
            v["spec"]["placement"]["replicaScheduling"] =
                json!({"replicaSchedulingType": "Duplicated"});
            v["spec"]["clusters"] =
                json!([{"name": "m1", "replicas": 4}, {"name": "m2", "replicas": 4}]);
        });
        assert_eq!(
            plan(&b, &fleet(), "dramesh-scheduler"),
            Action::Schedule(Trigger::Duplicated)
        );
        // A Duplicated cluster with other replicas is a replica change first.
        let b = settled(|v| {
            v["spec"]["placement"]["replicaScheduling"] =
                json!({"replicaSchedulingType": "Duplicated"});
            v["spec"]["clusters"] =
                json!([{"name": "m1", "replicas": 4}, {"name": "m2", "replicas": 3}]);
        });
        assert_eq!(
            plan(&b, &fleet(), "dramesh-scheduler"),
            Action::Schedule(Trigger::ReplicasChanged)
        );
        let b = settled(|v| {
            v["spec"]["replicas"] = json!(0);
            v["spec"]["replicaRequirements"] = json!(null);
            v["spec"]["clusters"] = json!([]);
        });
        assert_eq!(
            plan(&b, &fleet(), "dramesh-scheduler"),
            Action::Schedule(Trigger::Duplicated)
        );
    }

    #[test]
    fn target_clusters_leaving_trigger() {
        let b = settled(|_| {});
        let mut f = fleet();
        f.remove("m2");
        assert_eq!(
            plan(&b, &f, "dramesh-scheduler"),
            Action::Schedule(Trigger::ClusterGone("m2".into()))
        );

        let mut f = fleet();
        f.insert("m1".into(), cluster("m1", "False", json!([])));
        assert_eq!(
            plan(&b, &f, "dramesh-scheduler"),
            Action::Schedule(Trigger::ClusterNotReady("m1".into()))
        );

        let mut f = fleet();
        f.insert(
            "m2".into(),
            cluster(
                "m2",
                "True",
                json!([{"key": "maintenance", "effect": "NoExecute"}]),
            ),
        );
        assert_eq!(
            plan(&b, &f, "dramesh-scheduler"),
            Action::Schedule(Trigger::ClusterTainted("m2".into()))
        );
        // NoSchedule only keeps new work away: no reschedule.
        let mut f = fleet();
        f.insert(
            "m2".into(),
            cluster(
                "m2",
                "True",
                json!([{"key": "maintenance", "effect": "NoSchedule"}]),
            ),
        );
        assert_eq!(plan(&b, &f, "dramesh-scheduler"), Action::Nothing(None));

        let mut f = fleet();
        let mut deleting = cluster("m1", "True", json!([]));
        deleting.deleting = true;
        f.insert("m1".into(), deleting);
        assert_eq!(
            plan(&b, &f, "dramesh-scheduler"),
            Action::Schedule(Trigger::ClusterDeleting("m1".into()))
        );
        // A cluster the binding does not use changes nothing.
        let mut f = fleet();
        f.insert("m3".into(), cluster("m3", "False", json!([])));
        assert_eq!(plan(&b, &f, "dramesh-scheduler"), Action::Nothing(None));
    }

    #[test]
    fn tolerated_taints_and_not_ready_do_not_trigger() {
        let b = settled(|v| {
            v["spec"]["placement"]["clusterTolerations"] = json!([
                {"key": "cluster.karmada.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
                {"key": "maintenance", "operator": "Exists"}
            ]);
        });
        let mut f = fleet();
        f.insert("m1".into(), cluster("m1", "False", json!([])));
        f.insert(
            "m2".into(),
            cluster(
                "m2",
                "True",
                json!([{"key": "maintenance", "effect": "NoExecute"}]),
            ),
        );
        assert_eq!(plan(&b, &f, "dramesh-scheduler"), Action::Nothing(None));
    }

    #[test]
    fn a_generation_ahead_of_the_status_is_recorded() {
        let mut v = server_binding();
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
        v["metadata"]["annotations"][APPLIED_PLACEMENT] = json!(b.placement.to_go_json());
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
        let Action::Nothing(Some(p)) = plan(&b, &fleet(), "dramesh-scheduler") else {
            panic!("expected the generation patch")
        };
        assert_eq!(p.body, r#"{"status":{"schedulerObservedGeneration":3}}"#);

        // The spec written, its status write lost (no Scheduled condition, or a failure
        // from before): decided again, so that the condition is written, not the
        // generation alone.
        for conditions in [
            json!([]),
            json!([{"type": "Scheduled", "status": "False", "reason": "Unschedulable", "message": "",
                    "lastTransitionTime": "2026-11-25T09:00:00Z"}]),
        ] {
            v["status"]["conditions"] = conditions;
            let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
            assert_eq!(
                plan(&b, &fleet(), "dramesh-scheduler"),
                Action::Schedule(Trigger::StatusBehind)
            );
        }
    }

    #[test]
    fn cluster_changes_requeue_the_bindings_whose_affinity_matches() {
        let b = settled(|v| {
            v["spec"]["placement"]["clusterAffinity"] =
                json!({"labelSelector": {"matchLabels": {"tier": "gpu"}}})
        });
        let gpu =
            Cluster::from_value(&json!({"metadata": {"name": "new", "labels": {"tier": "gpu"}}}))
                .expect("cluster");
        let cpu = Cluster::from_value(&json!({"metadata": {"name": "other"}})).expect("cluster");
        assert!(affected_by_cluster(&b, &gpu, "dramesh-scheduler"));
        assert!(!affected_by_cluster(&b, &cpu, "dramesh-scheduler"));
        assert!(!affected_by_cluster(&b, &gpu, "default-scheduler"));
        // A cluster in use is always looked at.
        let used = Cluster::from_value(&json!({"metadata": {"name": "m1"}})).expect("cluster");
        assert!(affected_by_cluster(&b, &used, "dramesh-scheduler"));
        // clusterAffinities: the observed term decides.
        let b = settled(|v| {
            v["spec"]["placement"]["clusterAffinity"] = json!(null);
            v["spec"]["placement"]["clusterAffinities"] = json!([
                {"affinityName": "a", "clusterNames": ["other"]},
                {"affinityName": "b", "clusterNames": ["new"]}]);
            v["status"]["schedulerObservingAffinityName"] = json!("b");
        });
        assert!(affected_by_cluster(&b, &gpu, "dramesh-scheduler"));
        assert!(!affected_by_cluster(&b, &cpu, "dramesh-scheduler"));
    }

    #[test]
    fn backoff_doubles_to_its_cap() {
        let b = Backoff::default();
        let secs: Vec<u64> = (0..7).map(|n| b.delay(n).as_secs()).collect();
        assert_eq!(secs, vec![0, 1, 2, 4, 8, 10, 10]);
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(10));
    }

    #[test]
    fn unschedulable_bindings_wait_for_the_view_to_change() {
        let b = Backoff::default();
        let t0 = Instant::now();
        let r = b.failed(None, t0, 7, true);
        assert_eq!(b.next_attempt(&r, 7), t0 + Duration::from_secs(300));
        assert_eq!(b.next_attempt(&r, 8), t0 + Duration::from_secs(1));
        let r = b.failed(Some(&r), t0 + Duration::from_secs(1), 8, true);
        assert_eq!(r.attempts, 2);
        assert_eq!(b.next_attempt(&r, 9), t0 + Duration::from_secs(3));
        // An error backs off whatever the view does.
        let e = b.failed(None, t0, 7, false);
        assert_eq!(b.next_attempt(&e, 7), t0 + Duration::from_secs(1));
    }
}
