//! One binding's work, run as its own task so that many bindings are in flight at once: the
//! Karmada reads and writes of one binding overlap with the decisions of the others, and
//! only the decision and the reservations that hold it are made one at a time (under
//! [`Ctx::decide`]), so that every decision deducts the ones made before it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dramesh_api::native::ReservationState;
use dramesh_estimator::TargetCluster;
use dramesh_model::k8s::PriorityClass;
use dramesh_scheduler::patch::{MAX_MESSAGE, error_condition, truncate};
use dramesh_scheduler::{
    Action, Binding, Cluster, Decision, Demand, Retry, claim_template_names, demand, plan,
    priority_class_name,
};
use k8s_openapi::api::core::v1::ObjectReference;
use serde_json::Value;
use tokio::sync::Semaphore;

use super::{
    Confirm, Key, MAX_ATTEMPTS, SchedulerMetrics, SchedulerRole, binding_kind, now, preempt,
};
use crate::karmada::{
    BindingRef, Cache, EventNote, KarmadaClient, KarmadaError, Kind, Object, TemplateRef,
};
use crate::requests::workload_from_manifests;
use crate::reservation_resolution::Own;
use crate::reservation_table as resv;
use crate::state::ReplicaState;
use crate::sync::lock;

/// Longest estimator work for one decision.
pub(super) const DECIDE_DEADLINE: Duration = Duration::from_secs(5);

/// Event writes in flight at most; beyond it an Event is dropped (logged), as client-go's
/// event broadcaster drops when its queue is full: an Event is never worth slowing
/// scheduling down.
pub(super) const MAX_EVENT_WRITES: usize = 256;

/// What every binding task shares.
pub(super) struct Ctx {
    pub(super) state: Arc<ReplicaState>,
    pub(super) client: Arc<KarmadaClient>,
    pub(super) role: SchedulerRole,
    pub(super) metrics: Option<SchedulerMetrics>,
    /// Decides and queues the reservations that hold each decision, one at a time.
    pub(super) decider: super::decider::Decider,
    /// Permits for Event writes.
    pub(super) events: Arc<Semaphore>,
    /// The watch caches of both binding kinds (a preemption looks at every binding).
    pub(super) bindings: Cache,
    pub(super) cluster_bindings: Cache,
    /// The PriorityClass watch cache (a reservation carries the class its pods name).
    pub(super) classes: Cache,
    /// Bindings decoded, by key, with the `resourceVersion` decoded: a cluster change and a
    /// preemption look at every binding, and Clusters change with every status report.
    pub(super) decoded: std::sync::Mutex<HashMap<Key, (String, Arc<Binding>)>>,
    /// Per binding, the generation and kind of problem last logged at WARN
    /// ([`Ctx::warn_once`]).
    pub(super) warned: std::sync::Mutex<HashMap<Key, (Option<i64>, &'static str)>>,
}

/// A binding handed to a task, with the loop's view of the fleet when it was handed out.
pub(super) struct Job {
    pub(super) key: Key,
    pub(super) obj: Arc<Object>,
    /// The binding decoded, or why it does not decode (reported on its status).
    pub(super) binding: Result<Arc<Binding>, dramesh_scheduler::InputError>,
    pub(super) clusters: Arc<BTreeMap<String, Cluster>>,
    pub(super) classes: Arc<BTreeMap<String, PriorityClass>>,
    /// Replicas this replica added, by cluster, whose reservations overcommit resolution
    /// then gave to others: they are taken back and placed again.
    pub(super) lost: Option<BTreeMap<String, i64>>,
}

/// How working on one binding ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Scheduled and written.
    Scheduled,
    /// Nothing to schedule (maybe the observed generation written).
    Unchanged,
    /// Gone, not ours any more, or undecodable: nothing until it changes.
    Dropped,
    /// Written as unschedulable: retry when the view changes.
    Unschedulable,
    /// Failed: retry after the backoff.
    Error,
}

impl Outcome {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Outcome::Scheduled => "scheduled",
            Outcome::Unchanged => "unchanged",
            Outcome::Dropped => "dropped",
            Outcome::Unschedulable => "unschedulable",
            Outcome::Error => "error",
        }
    }
}

/// Reservations written for a decision that was then written to the binding: checked
/// against overcommit resolution once the settle window has passed.
#[derive(Debug, Clone)]
pub(super) struct Held {
    /// Reservation id and the replicas it added, by cluster.
    pub(super) by_cluster: BTreeMap<String, (String, i64)>,
    /// The last moment a write of the decision may start: its reservations name it
    /// ([`dramesh_scheduler::void::DecisionRef`]), and any replica may void them once the
    /// decision had time to be written; a write started later could land on room given
    /// away.
    pub(super) write_by: Instant,
}

/// Why strict scheduling did not confirm a decision.
enum Refused {
    /// Its reservations do not fit with every other live one: placed again.
    Lost(String),
    /// No majority of the members acknowledged it in time: not written, retried.
    NoMajority(String),
}

/// How often a strict decision looks for its majority.
const STRICT_POLL: Duration = Duration::from_millis(10);

/// What a task reports back to the loop.
pub(super) struct Done {
    pub(super) outcome: Outcome,
    /// The resourceVersions written, in order.
    pub(super) versions: Vec<String>,
    pub(super) held: Option<Held>,
}

impl Done {
    fn of(outcome: Outcome) -> Done {
        Done {
            outcome,
            versions: Vec::new(),
            held: None,
        }
    }
}

/// Why a write sequence stopped.
enum WriteError {
    /// The spec write conflicted: plan again on the fresh binding.
    Conflict(Arc<Object>),
    /// The spec was written (its versions) but the status was not: the decision stands and
    /// its reservations stay held; the binding is retried, and planned again as
    /// [`dramesh_scheduler::Trigger::StatusBehind`] so that its condition is written.
    StatusFailed(Vec<String>, String),
    /// Anything else.
    Failed(String),
}

/// `v` as a reservation manifest: what other replicas need to decode the workload, without
/// the server's bookkeeping (`status`, `managedFields`, the last-applied annotation), which
/// would only spend the record's size bound.
fn manifest_of(v: &Value) -> String {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("status");
        if let Some(meta) = m.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("managedFields");
            if let Some(a) = meta.get_mut("annotations").and_then(Value::as_object_mut) {
                a.remove("kubectl.kubernetes.io/last-applied-configuration");
            }
        }
    }
    v.to_string()
}

/// Runs `f` on the replica state on a blocking thread.
pub(super) async fn blocking<T: Send + 'static>(
    state: &Arc<ReplicaState>,
    f: impl FnOnce(&ReplicaState) -> T + Send + 'static,
) -> Result<T, String> {
    let state = state.clone();
    tokio::task::spawn_blocking(move || f(&state))
        .await
        .map_err(|e| format!("a blocking task failed: {e}"))
}

impl Ctx {
    /// Plans, decides, reserves and writes one binding, re-planning after a conflict.
    pub(super) async fn work(self: Arc<Self>, job: Job) -> Done {
        let Job {
            key,
            mut obj,
            binding,
            clusters,
            classes,
            lost,
        } = job;
        let kind = key.0;
        let mut b = match binding {
            Ok(b) => b,
            Err(e) => return self.report_invalid(&key, &obj, &e).await,
        };
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 {
                b = match Binding::from_value(binding_kind(kind), obj.value()) {
                    Ok(b) => Arc::new(b),
                    Err(e) => return self.report_invalid(&key, &obj, &e).await,
                };
            }
            // A binding whose added replicas were lost is placed again even though it was
            // scheduled for its generation; `kept` is it without them.
            let kept = lost.as_ref().and_then(|l| without(&b, l));
            let trigger = match plan(&b, &clusters, &self.role.name) {
                Action::Ignore(_) => return Done::of(Outcome::Dropped),
                Action::Nothing(_) if kept.is_some() => None,
                Action::Nothing(None) => return Done::of(Outcome::Unchanged),
                Action::Nothing(Some(_)) => {
                    // Recomputed against a re-read binding after a conflict.
                    let name = self.role.name.clone();
                    let patch = |fresh: &Binding| match plan(fresh, &clusters, &name) {
                        Action::Nothing(Some(p)) => vec![p],
                        _ => Vec::new(),
                    };
                    return match self.write_status(kind, &obj, patch).await {
                        Ok((_, versions)) => Done {
                            outcome: Outcome::Unchanged,
                            versions,
                            held: None,
                        },
                        Err(e) => {
                            tracing::warn!(binding = %b.id(), error = %e, "observed generation not written");
                            Done::of(Outcome::Error)
                        }
                    };
                }
                Action::Schedule(t) => Some(t),
            };
            tracing::debug!(binding = %b.id(), trigger = ?trigger, lost = ?lost, "scheduling");
            let (demand, manifests) = match self.demand(&b, &classes).await {
                Ok(d) => d,
                Err(message) => {
                    self.warn_once(&key, &b, "binding not scheduled", &message);
                    return self.write_error(kind, &obj, &b, message).await;
                }
            };
            let (decision, held) = match self
                .decide_and_hold(&b, kept.clone(), &demand, manifests.clone(), &clusters)
                .await
            {
                Ok(d) => d,
                Err(e) => {
                    // Never written unheld: another replica could take the same devices.
                    // The binding says why instead.
                    self.warn_once(&key, &b, "the decision could not be held; not written", &e);
                    return self.write_error(kind, &obj, &b, e).await;
                }
            };
            let bindings = if preempt::wants_bindings(&b, &demand, &decision) {
                self.all_bindings()
            } else {
                Vec::new()
            };
            let inputs = preempt::Inputs {
                binding: &b,
                demand: &demand,
                manifests: &manifests,
                clusters: &clusters,
                bindings: &bindings,
                creator: self.role.creator(),
                deadline: Instant::now() + DECIDE_DEADLINE,
            };
            let decision = preempt::follow_up(&self.state, &self.client, inputs, decision).await;
            if let (Confirm::Strict, Some(h)) = (self.role.confirm, &held) {
                match self.confirm_strict(h).await {
                    Ok(()) => {}
                    Err(Refused::Lost(why)) => {
                        tracing::info!(binding = %b.id(), reason = %why, "strict: reservation refused; its decision is placed again");
                        self.release(held).await;
                        if let Some(m) = &self.metrics {
                            m.count("reservation_lost");
                        }
                        continue;
                    }
                    Err(Refused::NoMajority(why)) => {
                        self.release(held).await;
                        self.warn_once(&key, &b, "binding not scheduled", &why);
                        return self.write_error(kind, &obj, &b, why).await;
                    }
                }
            }
            if let (Confirm::BeforeWrite, Some(h)) = (self.role.confirm, &held) {
                tokio::time::sleep(self.role.settle).await;
                let h = h.clone();
                let judged = blocking(&self.state, move |st| judge(st, vec![((), h)])).await;
                match judged.map(|mut j| j.pop().map(|(_, _, v)| v)) {
                    Ok(Some(Verdict::Lost(_))) => {
                        // `judge` released them all.
                        if let Some(m) = &self.metrics {
                            m.count("reservation_lost");
                        }
                        continue;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        self.release(held).await;
                        tracing::warn!(binding = %b.id(), error = %e, "reservations not confirmed; not written");
                        return Done::of(Outcome::Error);
                    }
                }
            }
            let write_by = held.as_ref().map(|h| h.write_by);
            match self.write(kind, &obj, &b, &decision, write_by).await {
                Ok((written, versions)) => {
                    // Events only when the decision changed something.
                    if !versions.is_empty() {
                        self.events(kind, &written, &b, &decision);
                    }
                    let outcome = match decision.retry {
                        Retry::No => Outcome::Scheduled,
                        Retry::Unschedulable => Outcome::Unschedulable,
                        Retry::Error => Outcome::Error,
                    };
                    return Done {
                        outcome,
                        versions,
                        held,
                    };
                }
                Err(WriteError::Conflict(fresh)) => {
                    self.release(held).await;
                    if let Some(m) = &self.metrics {
                        m.count("conflict");
                    }
                    obj = fresh;
                }
                Err(WriteError::StatusFailed(versions, e)) => {
                    tracing::warn!(binding = %b.id(), error = %e, "schedule result written, its status not; retried");
                    return Done {
                        outcome: Outcome::Error,
                        versions,
                        held,
                    };
                }
                Err(WriteError::Failed(e)) => {
                    self.release(held).await;
                    tracing::warn!(binding = %b.id(), error = %e, "schedule result not written");
                    return Done::of(Outcome::Error);
                }
            }
        }
        Done::of(Outcome::Error)
    }

    /// Strict scheduling's confirmation of `h` (see [`crate::quorum`]): publishes this
    /// replica's ack record up to `h`'s reservations, waits at most one settle window for a
    /// majority of the role's members to acknowledge them, then judges them against every
    /// live reservation this replica holds.
    async fn confirm_strict(&self, h: &Held) -> Result<(), Refused> {
        let me = self.state.replica.clone();
        let seq = h
            .by_cluster
            .values()
            .filter_map(|(id, _)| {
                id.strip_prefix(me.as_str())?
                    .strip_prefix('-')?
                    .parse()
                    .ok()
            })
            .max()
            .unwrap_or(0u64);
        let published = blocking(&self.state, move |st| st.publish_acks(Some(seq))).await;
        if let Err(e) = published
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
        {
            return Err(Refused::NoMajority(format!(
                "strict scheduling: this replica's acknowledgements could not be written ({e})"
            )));
        }
        let members = self.role.members;
        let deadline = Instant::now() + self.role.settle;
        loop {
            match crate::quorum::confirmed(&me, seq, &self.state.ack_records(), members) {
                Ok(()) => break,
                Err(n) if Instant::now() >= deadline => {
                    return Err(Refused::NoMajority(format!(
                        "strict scheduling: {n} of the {members} scheduler replicas hold this decision's reservations after {} ms, {} needed; retried",
                        self.role.settle.as_millis(),
                        crate::quorum::majority(members)
                    )));
                }
                Err(_) => tokio::time::sleep(STRICT_POLL).await,
            }
        }
        let held: Vec<(String, String)> = h
            .by_cluster
            .iter()
            .map(|(c, (id, _))| (id.clone(), c.clone()))
            .collect();
        let judged = blocking(&self.state, move |st| {
            let held: Vec<(&str, &str)> =
                held.iter().map(|(i, c)| (i.as_str(), c.as_str())).collect();
            st.fits_against_all_live(&held)
        })
        .await;
        match judged {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(Refused::Lost(why)),
            Err(e) => Err(Refused::Lost(e.to_string())),
        }
    }

    /// Writes a `SchedulerError` decision (`message`) on `b`, with its Event when the
    /// status changed; retried after the backoff.
    async fn write_error(
        &self,
        kind: Kind,
        obj: &Arc<Object>,
        b: &Binding,
        message: String,
    ) -> Done {
        let d = Decision::error(message);
        match self.write(kind, obj, b, &d, None).await {
            Ok((written, versions)) => {
                if !versions.is_empty() {
                    self.events(kind, &written, b, &d);
                }
                Done {
                    outcome: Outcome::Error,
                    versions,
                    held: None,
                }
            }
            // Changed meanwhile: its change event queues it again.
            Err(WriteError::Conflict(_)) => Done::of(Outcome::Error),
            Err(WriteError::StatusFailed(_, e) | WriteError::Failed(e)) => {
                tracing::warn!(binding = %b.id(), error = %e, "scheduler error not written");
                Done::of(Outcome::Error)
            }
        }
    }

    /// A binding of this scheduler that does not decode (a malformed placement, say): its
    /// status gets `Scheduled=False`, reason `SchedulerError`, naming the field, once (the
    /// same error again writes nothing). It is not retried: its next change is planned.
    async fn report_invalid(
        &self,
        key: &Key,
        obj: &Arc<Object>,
        e: &dramesh_scheduler::InputError,
    ) -> Done {
        if !dramesh_scheduler::object::handled_by_value(obj.value(), &self.role.name) {
            return Done::of(Outcome::Dropped);
        }
        let message = truncate(e.to_string(), MAX_MESSAGE);
        let generation = obj.meta().generation;
        self.warn_at(
            key,
            generation,
            &e.object,
            "binding not scheduled",
            &message,
        );
        let at = now();
        let mut current = obj.clone();
        let mut versions = Vec::new();
        for _ in 0..MAX_ATTEMPTS {
            let Some(p) = error_condition(current.value(), &message, &at) else {
                break;
            };
            let Ok(body) = serde_json::from_str::<Value>(&p.body) else {
                break;
            };
            let Some(r) = BindingRef::of(key.0, &current) else {
                break;
            };
            match self.client.patch_status(&r, &body).await {
                Ok(o) => {
                    versions.extend(o.meta().resource_version.clone());
                    break;
                }
                Err(KarmadaError::Conflict { .. }) => match self.reread(key.0, &r).await {
                    Ok(o) | Err(WriteError::Conflict(o)) => current = o,
                    Err(_) => break,
                },
                Err(err) => {
                    tracing::warn!(binding = %e.object, error = %err, "scheduler error not written");
                    return Done::of(Outcome::Error);
                }
            }
        }
        Done {
            outcome: Outcome::Dropped,
            versions,
            held: None,
        }
    }

    /// Logs a binding's problem at WARN once per generation and kind of problem (later
    /// repeats at DEBUG), the error cut to [`MAX_MESSAGE`] bytes: a template quoted in an
    /// error is not logged in full at every retry and relist.
    fn warn_once(&self, key: &Key, b: &Binding, what: &'static str, error: &str) {
        self.warn_at(key, Some(b.metadata.generation), &b.id(), what, error);
    }

    fn warn_at(
        &self,
        key: &Key,
        generation: Option<i64>,
        id: &str,
        what: &'static str,
        error: &str,
    ) {
        let error = truncate(error.to_string(), MAX_MESSAGE);
        let first =
            lock(&self.warned).insert(key.clone(), (generation, what)) != Some((generation, what));
        if first {
            tracing::warn!(binding = %id, error = %error, "{what}");
        } else {
            tracing::debug!(binding = %id, error = %error, "{what}");
        }
    }

    /// Every cached binding of both kinds, decoded (undecodable ones left out).
    fn all_bindings(&self) -> Vec<Arc<Binding>> {
        [
            (Kind::ResourceBinding, &self.bindings),
            (Kind::ClusterResourceBinding, &self.cluster_bindings),
        ]
        .into_iter()
        .flat_map(|(kind, cache)| {
            cache
                .list()
                .into_iter()
                .filter_map(move |o| self.decode(&(kind, o.key()), &o).ok())
        })
        .collect()
    }

    /// `o`, the binding `key`, decoded (once per `resourceVersion`).
    pub(super) fn decode(
        &self,
        key: &Key,
        o: &Object,
    ) -> Result<Arc<Binding>, dramesh_scheduler::InputError> {
        let rv = o.meta().resource_version.clone().unwrap_or_default();
        if let Some((v, b)) = lock(&self.decoded).get(key)
            && *v == rv
        {
            return Ok(b.clone());
        }
        let b = Arc::new(Binding::from_value(binding_kind(key.0), o.value())?);
        lock(&self.decoded).insert(key.clone(), (rv, b.clone()));
        Ok(b)
    }

    /// Forgets the decoded binding `key` (deleted).
    pub(super) fn forget(&self, key: &Key) {
        lock(&self.decoded).remove(key);
        lock(&self.warned).remove(key);
    }

    /// The binding's demand and, for a workload, the manifests a reservation carries (its
    /// template and ResourceClaimTemplates).
    async fn demand(
        &self,
        b: &Binding,
        classes: &BTreeMap<String, PriorityClass>,
    ) -> Result<(Demand, Vec<String>), String> {
        if !b.is_workload() || b.components.len() > 1 {
            return demand(b, None, &[], classes)
                .map(|d| (d, Vec::new()))
                .map_err(|e| e.to_string());
        }
        let r = &b.resource;
        let t = TemplateRef {
            api_version: r.api_version.clone(),
            kind: r.kind.clone(),
            namespace: (!r.namespace.is_empty()).then(|| r.namespace.clone()),
            name: r.name.clone(),
        };
        let template = match self.client.template(&t).await {
            Ok(Some(t)) => t,
            Ok(None) => {
                return Err(format!(
                    "the resource template {} {}/{} does not exist",
                    r.kind, r.namespace, r.name
                ));
            }
            Err(e) => return Err(e.to_string()),
        };
        let mut claims = Vec::new();
        for name in claim_template_names(&r.kind, template.value()) {
            match self
                .client
                .resource_claim_template(&r.namespace, &name)
                .await
            {
                Ok(Some(c)) => claims.push(c.value().clone()),
                // Resolved in the member clusters only: no fallback where one publishes none.
                Ok(None) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        let d = demand(b, Some(template.value()), &claims, classes).map_err(|e| e.to_string())?;
        // The PriorityClass the pods name: a reservation's workload does not decode without it.
        let class =
            priority_class_name(&r.kind, template.value()).and_then(|n| self.classes.get(None, &n));
        let manifests = std::iter::once(template.value())
            .chain(claims.iter())
            .chain(class.as_ref().map(|c| c.value()))
            .map(manifest_of)
            .collect();
        Ok((d, manifests))
    }

    /// Decides `b` (placing the replicas `kept` lacks when it is given: see
    /// [`dramesh_scheduler::decide_after_loss`]) on this replica's view, and holds the
    /// replicas the decision adds to dramesh-reported clusters as this replica's
    /// reservations, one decision at a time; returns once those are durable. Off the async
    /// reactor: the estimator computes and the store fsyncs. Only deciding and adding the
    /// reservations to the table is one at a time: their durable write is shared with the
    /// decisions made meanwhile (see [`crate::group_commit`]).
    async fn decide_and_hold(
        &self,
        b: &Arc<Binding>,
        kept: Option<Binding>,
        demand: &Demand,
        manifests: Vec<String>,
        clusters: &Arc<BTreeMap<String, Cluster>>,
    ) -> Result<(Decision, Option<Held>), String> {
        // The record's workload is what other replicas decode from the manifests.
        let carried = if manifests.is_empty() {
            None
        } else {
            let m = manifests.clone();
            Some(
                blocking(&self.state, move |_| {
                    workload_from_manifests(&m).map(Arc::new).map_err(|e| {
                        format!("the workload cannot be carried in a reservation: {e}")
                    })
                })
                .await?,
            )
        };
        let (decision, held) = {
            let b = b.clone();
            let demand = demand.clone();
            let clusters = clusters.clone();
            let creator = self.role.creator();
            let settle = self.role.settle;
            let strict = self.role.confirm == Confirm::Strict;
            self.decider
                .run(move |st| {
                    let deadline = Instant::now() + DECIDE_DEADLINE;
                    let decision =
                        st.decide_binding(&b, kept.as_ref(), &demand, &clusters, deadline, strict);
                    // Replicas are held relative to what the binding keeps: a lost cluster's
                    // replicas placed on it again are held again.
                    let base = kept.as_ref().unwrap_or(&b);
                    let held = hold(
                        st, base, &demand, &manifests, carried, &decision, &creator, settle,
                    )?;
                    Ok::<_, String>((decision, held))
                })
                .await??
        };
        let Some((held, ticket)) = held else {
            return Ok((decision, None));
        };
        blocking(&self.state, move |st| st.wait_written(ticket))
            .await?
            .map_err(|e| format!("writing the reservations: {e}"))?;
        Ok((decision, Some(held)))
    }

    async fn release(&self, held: Option<Held>) {
        let Some(h) = held else {
            return;
        };
        let r = blocking(&self.state, move |st| {
            st.release_own(h.by_cluster.values().map(|(id, _)| id))
        });
        if let Err(e) = r.await {
            tracing::warn!(error = %e, "releasing reservations failed; they end at their TTL");
        }
    }

    /// Writes `decision` on `obj` (read as `b`): the spec patch, then the status patch.
    /// Returns the binding as last written and the resourceVersions of every write. A spec
    /// write is not started after `write_by` (the decision's reservations may be void by the
    /// time it lands).
    async fn write(
        &self,
        kind: Kind,
        obj: &Arc<Object>,
        b: &Binding,
        decision: &Decision,
        write_by: Option<Instant>,
    ) -> Result<(Arc<Object>, Vec<String>), WriteError> {
        let at = now();
        let mut current = obj.clone();
        let mut written = Vec::new();
        for p in decision.patches(b, &at).into_iter().filter(|p| !p.status) {
            if write_by.is_some_and(|by| Instant::now() > by) {
                return Err(WriteError::Failed(
                    "the decision was not written within its write window; its reservations are released and the binding is decided again".into(),
                ));
            }
            let mut body: Value = serde_json::from_str(&p.body)
                .map_err(|e| WriteError::Failed(format!("spec patch body: {e}")))?;
            if write_by.is_some() {
                // The decision names itself, so a replica judging another replica's
                // reservation of the same generation can tell whose landed.
                body["metadata"]["annotations"][dramesh_scheduler::void::DECIDED_BY] = Value::from(
                    dramesh_scheduler::void::decided_by(&self.state.replica, b.metadata.generation),
                );
            }
            let r = BindingRef::of(kind, &current)
                .ok_or_else(|| WriteError::Failed("the binding has no resourceVersion".into()))?;
            match self.client.patch(&r, &body).await {
                Ok(o) => {
                    written.extend(o.meta().resource_version.clone());
                    current = Arc::new(o);
                }
                Err(KarmadaError::Conflict { .. }) => {
                    return Err(WriteError::Conflict(self.reread(kind, &r).await?));
                }
                Err(e) => return Err(WriteError::Failed(e.to_string())),
            }
        }
        // The status describes a decision for this generation. Recomputed on a binding whose
        // spec moved on meanwhile (another replica's decision, a scale), it would put a stale
        // verdict over a newer one: plan again instead.
        let basis = current.meta().generation;
        let refresh = decision.refreshes(b);
        let decision = decision.clone();
        let (o, mut more) = match self
            .write_status(kind, &current, move |fresh| {
                if basis.is_some_and(|g| g != fresh.metadata.generation) {
                    return Vec::new();
                }
                decision.status_patches(fresh, &at, refresh)
            })
            .await
        {
            Ok(w) => w,
            Err(e) if !written.is_empty() => return Err(WriteError::StatusFailed(written, e)),
            Err(e) => return Err(WriteError::Failed(e)),
        };
        if basis.is_some() && o.meta().generation != basis {
            return Err(WriteError::Conflict(o));
        }
        written.append(&mut more);
        Ok((o, written))
    }

    /// Writes the status patches `patches` computes for the binding, one at a time, each
    /// computed against the binding as last written or re-read (so a conflict re-reads and
    /// recomputes, never overwrites). Returns the binding as last written.
    async fn write_status(
        &self,
        kind: Kind,
        obj: &Arc<Object>,
        patches: impl Fn(&Binding) -> Vec<dramesh_scheduler::Patch>,
    ) -> Result<(Arc<Object>, Vec<String>), String> {
        let mut current = obj.clone();
        let mut written = Vec::new();
        let mut conflicts = 0;
        // Each round writes one patch or re-reads after a conflict. Written patches are not
        // computed again, so the rounds are bounded by the patches plus the conflicts; the
        // bound also stops a server that would not keep what was written.
        for _ in 0..2 * MAX_ATTEMPTS + 2 {
            let b = Binding::from_value(binding_kind(kind), current.value())
                .map_err(|e| e.to_string())?;
            let Some(p) = patches(&b).into_iter().next() else {
                return Ok((current, written));
            };
            let body: Value =
                serde_json::from_str(&p.body).map_err(|e| format!("status patch body: {e}"))?;
            let r = BindingRef::of(kind, &current)
                .ok_or_else(|| "the binding has no resourceVersion".to_string())?;
            match self.client.patch_status(&r, &body).await {
                Ok(o) => {
                    written.extend(o.meta().resource_version.clone());
                    current = Arc::new(o);
                }
                Err(KarmadaError::Conflict { .. }) if conflicts + 1 < MAX_ATTEMPTS => {
                    conflicts += 1;
                    current = match self.reread(kind, &r).await {
                        Ok(o) | Err(WriteError::Conflict(o)) => o,
                        Err(WriteError::Failed(e) | WriteError::StatusFailed(_, e)) => {
                            return Err(e);
                        }
                    };
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!(
            "the status was not written within {} tries ({conflicts} conflicts)",
            2 * MAX_ATTEMPTS + 2
        ))
    }

    async fn reread(&self, kind: Kind, r: &BindingRef) -> Result<Arc<Object>, WriteError> {
        match self.client.get(kind, r.namespace.as_deref(), &r.name).await {
            Ok(Some(o)) => Ok(Arc::new(o)),
            Ok(None) => Err(WriteError::Failed("the binding was deleted".into())),
            Err(e) => Err(WriteError::Failed(e.to_string())),
        }
    }

    /// Records the decision's Events on the binding and on its resource template, as
    /// karmada-scheduler does, in the background. Failures are logged: an Event is not worth
    /// a retry, nor a delay of the next binding.
    fn events(&self, kind: Kind, written: &Object, b: &Binding, decision: &Decision) {
        let on_binding = kind.reference(written);
        let r = &b.resource;
        let on_template = ObjectReference {
            api_version: Some(r.api_version.clone()),
            kind: Some(r.kind.clone()),
            namespace: (!r.namespace.is_empty()).then(|| r.namespace.clone()),
            name: Some(r.name.clone()),
            uid: (!r.uid.is_empty()).then(|| r.uid.clone()),
            resource_version: None,
            field_path: None,
        };
        for e in &decision.events {
            let note = EventNote {
                warning: e.type_ == "Warning",
                reason: e.reason.to_string(),
                action: "Scheduling".into(),
                message: e.message.clone(),
            };
            for regarding in [&on_binding, &on_template] {
                let Ok(permit) = self.events.clone().try_acquire_owned() else {
                    tracing::debug!(binding = %b.id(), reason = %note.reason, "event dropped: too many event writes in flight");
                    continue;
                };
                let client = self.client.clone();
                let (regarding, note, id) = (regarding.clone(), note.clone(), b.id());
                tokio::spawn(async move {
                    if let Err(err) = client.event(&regarding, &note).await {
                        tracing::debug!(binding = %id, error = %err, "event not recorded");
                    }
                    drop(permit);
                });
            }
        }
    }
}

/// `b` without the replicas in `lost` (by cluster), or `None` when it has none of them left
/// (the binding changed meanwhile and nothing is to be taken back).
fn without(b: &Binding, lost: &BTreeMap<String, i64>) -> Option<Binding> {
    let mut changed = false;
    let clusters: Vec<TargetCluster> = b
        .clusters
        .iter()
        .filter_map(|t| {
            let take = lost.get(&t.name).copied().unwrap_or(0).clamp(0, t.replicas);
            changed |= take > 0;
            let left = t.replicas - take;
            (left > 0).then(|| TargetCluster {
                name: t.name.clone(),
                replicas: left,
            })
        })
        .collect();
    changed.then(|| Binding {
        clusters,
        ..b.clone()
    })
}

/// Where a written decision's reservations stand.
pub(super) enum Verdict {
    /// One was given to others by overcommit resolution: the decision lost as a whole. All
    /// its reservations are released, and all the replicas it added, by cluster, are to be
    /// placed again from what the binding had before it (so a decision that no longer fits
    /// leaves nothing half placed).
    Lost(BTreeMap<String, i64>),
    /// Admitted, and some still hold room: watched while they do.
    Live,
    /// All ended (the pods are reported, or released, or expired).
    Ended,
}

/// The [`Verdict`] of each decision in `decisions`, all judged on one resolution; the
/// reservations of lost ones are released.
pub(super) fn judge<K>(st: &ReplicaState, decisions: Vec<(K, Held)>) -> Vec<(K, Held, Verdict)> {
    let statuses = st.reservation_states(
        decisions
            .iter()
            .flat_map(|(_, h)| h.by_cluster.values().map(|(id, _)| id)),
    );
    let state = |id: &String| statuses.get(id.as_str()).map(|s| s.state);
    let verdicts: Vec<Verdict> = decisions
        .iter()
        .map(|(_, held)| {
            let lost = held
                .by_cluster
                .iter()
                .find(|(_, (id, _))| state(id) == Some(ReservationState::Conflicted));
            if let Some((cluster, (id, _))) = lost {
                let winner = statuses.get(id.as_str()).and_then(|s| s.winner.as_deref());
                tracing::info!(
                    id = %id,
                    cluster = %cluster,
                    winner = winner.unwrap_or("an unreadable reservation"),
                    "reservation lost; its decision is placed again"
                );
                st.release_own(held.by_cluster.values().map(|(id, _)| id));
                Verdict::Lost(
                    held.by_cluster
                        .iter()
                        .map(|(c, (_, n))| (c.clone(), *n))
                        .collect(),
                )
            } else if held
                .by_cluster
                .values()
                .any(|(id, _)| state(id) == Some(ReservationState::Live))
            {
                Verdict::Live
            } else {
                Verdict::Ended
            }
        })
        .collect();
    drop(statuses);
    decisions
        .into_iter()
        .zip(verdicts)
        .map(|((key, held), v)| (key, held, v))
        .collect()
}

/// Holds the replicas `decision` adds to `b` on dramesh-reported clusters as reservations of
/// this replica, queued together (all or none; durable once the ticket is waited for).
/// `carried` is the workload decoded from `manifests`, the binding's when it has one.
#[allow(clippy::too_many_arguments)]
fn hold(
    st: &ReplicaState,
    b: &Binding,
    demand: &Demand,
    manifests: &[String],
    carried: Option<Result<Arc<dramesh_estimator::Workload>, String>>,
    decision: &Decision,
    creator: &str,
    settle: Duration,
) -> Result<Option<(Held, crate::group_commit::Ticket)>, String> {
    let (Some(clusters), Demand::Replicas(w)) = (&decision.clusters, demand) else {
        return Ok(None);
    };
    // The first replicas on a cluster where a preemption hold of the binding keeps room for
    // it are held already.
    let covered = preempt::covered(st, b);
    let new = |t: &TargetCluster| {
        let held = covered.get(&t.name).copied().unwrap_or(0);
        t.replicas - b.assigned(&t.name).max(held)
    };
    let adds: Vec<(&str, i64, i64)> = clusters
        .iter()
        .filter(|t| new(t) > 0)
        .filter(|t| st.with_view(|v| v.cluster(&t.name).is_some()))
        .map(|t| (t.name.as_str(), new(t), t.replicas))
        .collect();
    if adds.is_empty() {
        return Ok(None);
    }
    let workload = match carried {
        Some(w) => w?,
        None => return Err("the workload cannot be carried in a reservation: no manifests".into()),
    };
    // Each reservation names the decision it holds (what the binding shows once written).
    let settle_ms = u64::try_from(settle.as_millis()).unwrap_or(u64::MAX);
    let decided = |target: i64| dramesh_scheduler::void::DecisionRef {
        kind: b.kind.as_str().to_string(),
        namespace: b.metadata.namespace.clone(),
        name: b.metadata.name.clone(),
        uid: b.metadata.uid.clone(),
        generation: b.metadata.generation,
        target,
        settle_ms,
    };
    let made = Instant::now();
    let write_by = made + decided(0).write_deadline();
    let own: Vec<Own<'_>> = adds
        .iter()
        .map(|(cluster, replicas, target)| Own {
            creator,
            cluster,
            workload: &workload,
            manifests,
            replicas: (*replicas).min(resv::MAX_REPLICAS),
            priority: w.priority,
            ttl_seconds: resv::DEFAULT_TTL_SECONDS,
            caps: None,
            decision: Some(decided(*target)),
        })
        .collect();
    let (ids, ticket) = st
        .queue_own_all(&own, None)
        .map_err(|e| format!("writing the reservations: {e}"))?;
    let by_cluster = adds
        .iter()
        .zip(ids)
        .map(|((cluster, replicas, _), id)| (cluster.to_string(), (id, *replicas)))
        .collect();
    Ok(Some((
        Held {
            by_cluster,
            write_by,
        },
        ticket,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn binding(clusters: &[(&str, i64)]) -> Binding {
        let clusters: Vec<Value> = clusters
            .iter()
            .map(|(n, r)| json!({"name": n, "replicas": r}))
            .collect();
        Binding::from_value(
            dramesh_scheduler::BindingKind::ResourceBinding,
            &json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
                "metadata": {"name": "b", "namespace": "ns", "generation": 1},
                "spec": {"placement": {}, "resource": {"apiVersion": "apps/v1", "kind": "Deployment",
                    "namespace": "ns", "name": "w"}, "replicas": 5, "clusters": clusters}}),
        )
        .expect("binding")
    }

    #[test]
    fn lost_replicas_are_taken_back_from_the_binding() {
        let b = binding(&[("a", 3), ("b", 2)]);
        let lost = BTreeMap::from([("a".to_string(), 2), ("b".to_string(), 5)]);
        let kept = without(&b, &lost).expect("changed");
        let left: Vec<(String, i64)> = kept
            .clusters
            .iter()
            .map(|t| (t.name.clone(), t.replicas))
            .collect();
        assert_eq!(left, vec![("a".to_string(), 1)]);
        // Nothing of the loss left on the binding: nothing to take back.
        let moved = binding(&[("c", 5)]);
        assert!(without(&moved, &lost).is_none());
    }
}
