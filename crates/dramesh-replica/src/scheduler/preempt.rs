//! Binding preemption on the replica: what follows a decision of the scheduler loop when the
//! binding fits nowhere and may preempt (`dramesh_scheduler::plan_preemption` decides; this
//! module holds the room, evicts and reports).
//!
//! - **When.** A decision that is `Unschedulable` for capacity (not `NoClusterFit`, not an
//!   error) of a binding with a `spec.schedulePriority` whose demand may preempt (not
//!   `preemptionPolicy: Never`), and for which no preemption hold is live yet.
//! - **Hold, then evict.** The room is held first: a replicated reservation for every replica
//!   of the preemptor on the chosen cluster, with its priority, created by the role and marked
//!   with the preemptor ([`ReplicaState::write_preemption_hold`]). While the victims' pods are
//!   still there it does not fit and holds nothing; once they are gone it is admitted (its
//!   priority ranks it above the victims and anything else of lower priority) and every other
//!   estimate, on every replica, deducts it. Decisions of the preemptor leave it out
//!   ([`ReplicaState::reserved_for`]), so the preemptor lands in the room it holds, and that
//!   decision writes no second reservation for the replicas the hold covers ([`covered`]).
//!   The hold ends like any reservation: when the preemptor's pods are reported bound, or at
//!   its TTL. Then each victim gets its eviction patch (conditional on the version read; a
//!   conflict re-reads it and recomputes the patch, never overwrites), a `Preempted` Event,
//!   and the preemptor a `PreemptionInitiated` Event and a status saying what it waits for.
//! - **Never evicts** when the plan is refused (no cluster makes room even with every
//!   lower-priority binding gone, victims that are not evictable bindings, policy `Never`),
//!   when the hold cannot be written, or while a hold for the binding is live (it waits).
//! - **Cleanup.** Own holds on clusters a later decision does not use, or that no longer pass
//!   the filters, are released.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use dramesh_api::native::ReservationState;
use dramesh_scheduler::preempt::eviction_patch;
use dramesh_scheduler::{Binding, BindingKind, Cluster, Decision, Demand, Retry};
use serde_json::Value;

use super::{MAX_ATTEMPTS, now};
use crate::karmada::{BindingRef, EventNote, KarmadaClient, KarmadaError, Kind, Object};
use crate::requests::workload_from_manifests;
use crate::reservation_resolution::{Own, PreemptionHold};
use crate::reservation_table as resv;
use crate::state::ReplicaState;

/// What following up one decision takes from the task that made it: plain values, nothing
/// of the task's own.
pub(crate) struct Inputs<'a> {
    /// The binding decided (as read).
    pub(crate) binding: &'a Arc<Binding>,
    pub(crate) demand: &'a Demand,
    /// The manifests its reservations carry (template and ResourceClaimTemplates).
    pub(crate) manifests: &'a [String],
    /// The Karmada clusters by name.
    pub(crate) clusters: &'a Arc<BTreeMap<String, Cluster>>,
    /// Every binding the role knows, decoded: needed only when [`wants_bindings`] (else
    /// empty).
    pub(crate) bindings: &'a [Arc<Binding>],
    /// The creator a preemption hold records (the role's).
    pub(crate) creator: String,
    /// When the preemption plan's estimates stop.
    pub(crate) deadline: Instant,
}

/// Whether the binding may preempt: a `spec.schedulePriority` and a demand that allows it.
fn may_preempt(b: &Binding, demand: &Demand) -> bool {
    b.schedule_priority.is_some()
        && matches!(demand, Demand::Replicas(w) if w.preempt_lower_priority)
}

/// Whether `decision` may start a preemption, so [`follow_up`] needs every known binding.
pub(crate) fn wants_bindings(b: &Binding, demand: &Demand, decision: &Decision) -> bool {
    capacity_failure(decision) && may_preempt(b, demand)
}

/// `Unschedulable` for want of room (a `NoClusterFit` writes an empty result instead).
fn capacity_failure(decision: &Decision) -> bool {
    decision.retry == Retry::Unschedulable && decision.clusters.is_none()
}

/// Replicas of `b` that its admitted preemption holds already keep room for, by cluster: a
/// decision landing there writes no second reservation for its first that many replicas
/// there (assigned ones included: they are the same replicas).
pub(crate) fn covered(state: &ReplicaState, b: &Binding) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for h in state.preemption_holds(&b.id()) {
        let admitted = state.reservation_status(&h.id).is_some_and(|s| {
            matches!(
                s.status,
                ReservationState::Live | ReservationState::Satisfied
            )
        });
        if admitted {
            let e = out.entry(h.cluster).or_insert(0);
            *e = (*e).max(h.replicas);
        }
    }
    out
}

/// Follows up `decision` for `cx.binding` (see the module docs) on the replica's `state`
/// (its view, reservations and holds), evicting through `client`. Returns the decision to
/// write: unchanged, or with the preemption's status message and Event.
pub(crate) async fn follow_up(
    state: &Arc<ReplicaState>,
    client: &KarmadaClient,
    cx: Inputs<'_>,
    mut decision: Decision,
) -> Decision {
    let b = cx.binding;
    let bindings = cx.bindings;
    let holds = state.preemption_holds(&b.id());
    if decision.retry == Retry::No {
        // Landed: own holds elsewhere keep room for nothing.
        let used: BTreeSet<&str> = decision
            .clusters
            .iter()
            .flatten()
            .filter(|t| t.replicas > 0)
            .map(|t| t.name.as_str())
            .collect();
        let unused = holds
            .iter()
            .filter(|h| h.own && !used.contains(h.cluster.as_str()));
        release(state, unused).await;
        return decision;
    }
    if decision.retry != Retry::Unschedulable {
        return decision;
    }
    if let Some(h) = holds.first() {
        if capacity_failure(&decision) {
            annotate(&mut decision, &waiting(&h.cluster, &h.id));
        } else {
            // No cluster passes the filters any more, the held one included.
            release(state, holds.iter().filter(|h| h.own)).await;
        }
        return decision;
    }
    if !wants_bindings(b, cx.demand, &decision) {
        return decision;
    }
    let at = now();
    let plan = {
        let (state, b, demand) = (state.clone(), b.clone(), cx.demand.clone());
        let (clusters, bindings, at) = (cx.clusters.clone(), bindings.to_vec(), at.clone());
        let deadline = cx.deadline;
        tokio::task::spawn_blocking(move || {
            state.preempt_binding(&b, &demand, &bindings, &clusters, deadline, &at)
        })
        .await
        .unwrap_or_else(|e| Err(format!("the preemption plan failed: {e}")))
    };
    let plan = match plan {
        Ok(p) => p,
        Err(why) => {
            tracing::debug!(binding = %b.id(), why = %why, "no preemption");
            annotate(&mut decision, &format!("No binding preempted: {why}."));
            return decision;
        }
    };
    let hold = match write_hold(state, &cx, &plan.cluster).await {
        Ok(id) => id,
        Err(e) => {
            tracing::warn!(binding = %b.id(), error = %e, "preemption not carried out: its room cannot be held");
            annotate(
                &mut decision,
                &format!(
                    "No binding preempted: the room on cluster {} cannot be held: {e}.",
                    plan.cluster
                ),
            );
            return decision;
        }
    };
    let mut evicted = 0;
    let mut failed = Vec::new();
    for e in &plan.evictions {
        let Some(victim) = bindings.get(e.victim) else {
            continue;
        };
        match evict(
            client,
            victim,
            &plan.cluster,
            &e.event.message,
            &e.patch.body,
            b.priority(),
        )
        .await
        {
            Ok(Evicted::Now(written)) => {
                evicted += 1;
                let note = EventNote {
                    warning: e.event.type_ == "Warning",
                    reason: e.event.reason.to_string(),
                    action: "Preempting".into(),
                    message: e.event.message.clone(),
                };
                let regarding = kind_of(victim.kind).reference(&written);
                if let Err(err) = client.event(&regarding, &note).await {
                    tracing::debug!(binding = %victim.id(), error = %err, "event not recorded");
                }
                tracing::info!(victim = %victim.id(), preemptor = %b.id(), cluster = %plan.cluster, "binding preempted");
            }
            // Gone from the cluster already (another replica preempted it too): room freed.
            Ok(Evicted::Already) => evicted += 1,
            Ok(Evicted::NotAVictim(why)) | Err(why) => {
                failed.push(format!("{}: {why}", victim.key()));
            }
        }
    }
    if !failed.is_empty() {
        tracing::warn!(binding = %b.id(), failed = ?failed, "victims not evicted");
    }
    if evicted == 0 {
        release(
            state,
            std::iter::once(&PreemptionHold {
                id: hold,
                cluster: plan.cluster.clone(),
                replicas: 0,
                own: true,
            }),
        )
        .await;
        annotate(
            &mut decision,
            &format!(
                "No binding preempted: no victim could be evicted ({}).",
                failed.join("; ")
            ),
        );
        return decision;
    }
    annotate(&mut decision, &waiting(&plan.cluster, &hold));
    decision.events.push(plan.event.clone());
    decision
}

/// The status note of a preemptor waiting for its victims: the same on every retry, so an
/// unchanged wait writes no new status.
fn waiting(cluster: &str, hold: &str) -> String {
    format!(
        "Preempting bindings of lower priority on cluster {cluster}: waiting for them to leave it (the room is held by reservation {hold})."
    )
}

/// Appends `note` to the decision's condition message and to its failure Event.
fn annotate(decision: &mut Decision, note: &str) {
    let old = decision.condition.message.clone();
    let new = format!("{old} {note}");
    for e in decision.events.iter_mut().filter(|e| e.message == old) {
        e.message = new.clone();
    }
    decision.condition.message = new;
}

/// Writes the preemptor's hold on `cluster`; returns its id.
async fn write_hold(
    state: &Arc<ReplicaState>,
    cx: &Inputs<'_>,
    cluster: &str,
) -> Result<String, String> {
    let Demand::Replicas(w) = cx.demand else {
        return Err("only workloads with one pod template preempt".into());
    };
    let (replicas, priority) = (w.replicas.clamp(1, resv::MAX_REPLICAS), w.priority);
    let state = state.clone();
    let creator = cx.creator.clone();
    let manifests = cx.manifests.to_vec();
    let cluster = cluster.to_string();
    let preemptor = cx.binding.id();
    tokio::task::spawn_blocking(move || {
        let workload = workload_from_manifests(&manifests)
            .map(Arc::new)
            .map_err(|e| format!("the workload cannot be carried in a reservation: {e}"))?;
        let own = Own {
            creator: &creator,
            cluster: &cluster,
            workload: &workload,
            manifests: &manifests,
            replicas,
            priority,
            ttl_seconds: resv::DEFAULT_TTL_SECONDS,
            caps: None,
            decision: None,
        };
        state
            .write_preemption_hold(&own, &preemptor)
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| Err(format!("a blocking task failed: {e}")))
}

/// Releases the given holds (own ones only are passed).
async fn release<'h>(state: &Arc<ReplicaState>, holds: impl Iterator<Item = &'h PreemptionHold>) {
    let ids: Vec<String> = holds.map(|h| h.id.clone()).collect();
    if ids.is_empty() {
        return;
    }
    let state = state.clone();
    if let Err(e) = tokio::task::spawn_blocking(move || state.release_own(&ids)).await {
        tracing::warn!(error = %e, "releasing preemption holds failed; they end at their TTL");
    }
}

fn kind_of(k: BindingKind) -> Kind {
    match k {
        BindingKind::ResourceBinding => Kind::ResourceBinding,
        BindingKind::ClusterResourceBinding => Kind::ClusterResourceBinding,
    }
}

/// How one eviction ended.
#[derive(Debug)]
enum Evicted {
    /// Patched: the binding as written.
    Now(Box<Object>),
    /// The cluster was already gone from its result.
    Already,
    /// Re-read after a conflict, it is no victim any more (deleted, or not of lower
    /// priority).
    NotAVictim(String),
}

/// Evicts `victim` from `cluster` with `body` (the plan's patch), conditional on the version
/// the victim was read at; a conflict re-reads it and recomputes the patch.
async fn evict(
    client: &KarmadaClient,
    victim: &Binding,
    cluster: &str,
    message: &str,
    body: &str,
    preemptor_priority: i32,
) -> Result<Evicted, String> {
    let kind = kind_of(victim.kind);
    let namespace =
        (!victim.metadata.namespace.is_empty()).then(|| victim.metadata.namespace.clone());
    let mut at = BindingRef {
        kind,
        namespace: namespace.clone(),
        name: victim.metadata.name.clone(),
        resource_version: victim.metadata.resource_version.clone(),
    };
    let mut body: Value =
        serde_json::from_str(body).map_err(|e| format!("eviction patch body: {e}"))?;
    for _ in 0..MAX_ATTEMPTS {
        match client.patch(&at, &body).await {
            Ok(o) => return Ok(Evicted::Now(Box::new(o))),
            Err(KarmadaError::Conflict { .. }) => {}
            Err(e) => return Err(e.to_string()),
        }
        let Some(fresh) = client
            .get(kind, namespace.as_deref(), &at.name)
            .await
            .map_err(|e| e.to_string())?
        else {
            return Ok(Evicted::NotAVictim("deleted".into()));
        };
        let b = Binding::from_value(victim.kind, fresh.value()).map_err(|e| e.to_string())?;
        if b.priority() >= preemptor_priority {
            return Ok(Evicted::NotAVictim(format!(
                "its priority is now {}",
                b.priority()
            )));
        }
        let Some(p) = eviction_patch(&b, cluster, message, &now()) else {
            return Ok(Evicted::Already);
        };
        body = serde_json::from_str(&p.body).map_err(|e| format!("eviction patch body: {e}"))?;
        at = BindingRef::of(kind, &fresh)
            .ok_or_else(|| "the victim has no resourceVersion".to_string())?;
    }
    Err(format!(
        "not written within {MAX_ATTEMPTS} tries (conflicts)"
    ))
}
