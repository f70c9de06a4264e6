//! The scheduler role's loop: the replica is the Karmada scheduler for the bindings whose
//! `spec.schedulerName` names it. Decisions are `dramesh_scheduler`'s, I/O is
//! [`crate::karmada`]'s; this module only connects them.
//!
//! - **Queue.** Binding keys, fed by binding changes (every binding after a complete list),
//!   by cluster changes that matter to scheduling (`affected_by_cluster`), and by retries:
//!   a binding that failed waits for its [`Backoff`]; one that was unschedulable also waits
//!   for the replica's view or reservations to change ([`ReplicaState::change_count`]), at
//!   most 5 minutes. One binding is worked on at a time.
//! - **Per binding.** Re-read from the watch cache; [`plan`]; when it must be scheduled, read
//!   the resource template and its ResourceClaimTemplates, [`demand`], decide on this
//!   replica's view off the async reactor ([`ReplicaState::decide_binding`]), hold the new
//!   replicas as reservations (below), then write as karmada-scheduler does: the spec patch,
//!   the status patch, the Events (on the binding and its resource template).
//! - **Conflicts.** Every write is conditional on the version read. A conflicting spec write
//!   re-reads the binding and plans again; a conflicting status write re-reads and recomputes
//!   the status patch against the fresh binding (Karmada's `RetryOnConflict`) while its
//!   generation is the one decided on, and plans again once it moved on. At most
//!   [`MAX_ATTEMPTS`] tries, then the binding backs off as an error. Nothing is overwritten.
//! - **No double-booking across replicas.** Before writing a decision, the replicas it adds
//!   to each dramesh-reported cluster are written as this replica's reservations (creator
//!   [`SchedulerRole::creator`], the template and ResourceClaimTemplates as manifests, the
//!   binding's priority). After [`SchedulerRole::settle`] (reservations other replicas wrote
//!   before ours have then reached this replica's resolution) each must be admitted by
//!   overcommit resolution; if one is not, all are released and the binding is planned
//!   again (the winners are then deducted). Reservations end when the member cluster reports
//!   the pods, or at their TTL. See ARCHITECTURE.md, "The loop on the replica", for the
//!   protocol's limits.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dramesh_api::native::ReservationState;
use dramesh_estimator::TargetCluster;
use dramesh_model::k8s::PriorityClass;
use dramesh_scheduler::object::priority_class_from_value;
use dramesh_scheduler::{
    Action, Backoff, Binding, BindingKind, Cluster, Decision, Demand, Retry, RetryState,
    affected_by_cluster, claim_template_names, demand, plan,
};
use dramesh_telemetry::registry::{CounterVec, Histogram};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::Value;
use tokio::sync::watch;

use crate::karmada::{
    BindingRef, Cache, Change, EventNote, KarmadaClient, KarmadaError, Kind, Object, ObjectKey,
    TemplateRef, Watch,
};
use crate::requests::workload_from_manifests;
use crate::reservations as resv;
use crate::reserve::Own;
use crate::state::ReplicaState;

#[cfg(test)]
mod tests;

/// Tries per binding (a conflicting write or a lost reservation starts another).
pub(crate) const MAX_ATTEMPTS: u32 = 3;

/// Default of [`SchedulerRole::settle`]: the replica applies received changes at least every
/// 250 ms, so two of those periods cover a reservation written elsewhere just before ours
/// (pushed at once over the mesh) on a healthy mesh.
pub const DEFAULT_SETTLE: Duration = Duration::from_millis(500);

/// Default scheduler name (`--scheduler-name`).
pub const DEFAULT_SCHEDULER_NAME: &str = "dramesh-scheduler";

/// Longest estimator work for one decision.
const DECIDE_DEADLINE: Duration = Duration::from_secs(5);

/// How often retries are looked at.
const TICK: Duration = Duration::from_millis(250);

/// The scheduler role of a replica.
#[derive(Clone, Debug)]
pub struct SchedulerRole {
    /// Kubeconfig of the Karmada API server.
    pub kubeconfig: PathBuf,
    /// Bindings whose `spec.schedulerName` equals this are scheduled here.
    pub name: String,
    /// How long a written reservation waits for earlier reservations of other replicas
    /// before its admission is checked ([`DEFAULT_SETTLE`]).
    pub settle: Duration,
}

impl SchedulerRole {
    /// The role for `name` with the default settle window.
    pub fn new(kubeconfig: PathBuf, name: &str) -> SchedulerRole {
        SchedulerRole {
            kubeconfig,
            name: name.to_string(),
            settle: DEFAULT_SETTLE,
        }
    }

    /// The creator recorded on its reservations.
    pub fn creator(&self) -> String {
        format!("scheduler:{}", self.name)
    }
}

/// `dramesh_scheduler_*` metrics.
#[derive(Clone)]
pub(crate) struct SchedulerMetrics {
    /// `{result}`: bindings worked on, by outcome.
    bindings: Arc<CounterVec<1>>,
    /// Time from taking a binding off the queue to its last write.
    latency: Arc<Histogram>,
}

impl SchedulerMetrics {
    /// Registers the metrics in `m`'s registry; `None` (logged) if the names are taken.
    pub(crate) fn register(m: &dramesh_telemetry::Metrics) -> Option<SchedulerMetrics> {
        let r = m.registry();
        let made = r
            .counter_vec(
                "dramesh_scheduler_bindings_total",
                "Bindings the scheduler role worked on, by result (scheduled, unschedulable, error, unchanged, dropped), and re-plans (conflict, reservation_lost).",
                ["result"],
            )
            .and_then(|bindings| {
                let latency = r.histogram(
                    "dramesh_scheduler_decision_seconds",
                    "Time from taking a binding off the queue to its last write.",
                    &[0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
                )?;
                Ok(SchedulerMetrics { bindings, latency })
            });
        match made {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::error!(error = %e, "scheduler metrics not registered");
                None
            }
        }
    }

    fn count(&self, result: &str) {
        self.bindings.with([result]).inc();
    }
}

/// A binding in the queue.
type Key = (Kind, ObjectKey);

/// How working on one binding ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
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

/// Why a decision is not held.
enum Hold {
    /// Overcommit resolution admitted another replica's reservation instead: plan again.
    Lost(String),
    /// The reservation could not be written.
    Failed(String),
}

/// Why a write sequence stopped.
enum WriteError {
    /// The spec write conflicted: plan again on the fresh binding.
    Conflict(Arc<Object>),
    /// Anything else.
    Failed(String),
}

struct Loop {
    state: Arc<ReplicaState>,
    client: Arc<KarmadaClient>,
    role: SchedulerRole,
    backoff: Backoff,
    metrics: Option<SchedulerMetrics>,
    bindings: Cache,
    cluster_bindings: Cache,
    class_cache: Cache,
    /// PriorityClasses by name, decoded when they change (not for every binding).
    classes: BTreeMap<String, PriorityClass>,
    cluster_cache: Cache,
    clusters: Arc<BTreeMap<String, Cluster>>,
    queue: VecDeque<Key>,
    queued: HashSet<Key>,
    retry: HashMap<Key, RetryState>,
    /// Per binding, versions this loop wrote and then wrote over (see [`Loop::wrote`]).
    superseded: HashMap<Key, Vec<String>>,
    /// Bindings decoded, by key, with the `resourceVersion` decoded: a cluster change looks
    /// at every binding, and Clusters change with every status report.
    decoded: HashMap<Key, (String, Arc<Binding>)>,
}

/// Runs the scheduler loop until `stop` turns true (or a watch task dies).
pub(crate) async fn run(
    state: Arc<ReplicaState>,
    client: Arc<KarmadaClient>,
    role: SchedulerRole,
    metrics: Option<SchedulerMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let mut rb = client.watch(Kind::ResourceBinding);
    let mut crb = client.watch(Kind::ClusterResourceBinding);
    let mut cl = client.watch(Kind::Cluster);
    let mut pc = client.watch(Kind::PriorityClass);
    let mut l = Loop {
        state,
        client,
        role,
        backoff: Backoff::default(),
        metrics,
        bindings: rb.cache(),
        cluster_bindings: crb.cache(),
        class_cache: pc.cache(),
        classes: BTreeMap::new(),
        cluster_cache: cl.cache(),
        clusters: Arc::new(BTreeMap::new()),
        queue: VecDeque::new(),
        queued: HashSet::new(),
        retry: HashMap::new(),
        superseded: HashMap::new(),
        decoded: HashMap::new(),
    };
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tracing::info!(scheduler = %l.role.name, "scheduler role started");
    loop {
        let busy = !l.queue.is_empty();
        // Changes first; with work queued, take one binding when no change is waiting.
        let ended = tokio::select! {
            biased;
            // The guard `wait_for` returns is not Send: dropped inside.
            _ = async { drop(stop.wait_for(|v| *v).await) } => return,
            c = rb.next() => l.binding_change(Kind::ResourceBinding, c),
            c = crb.next() => l.binding_change(Kind::ClusterResourceBinding, c),
            c = cl.next() => l.cluster_change(c),
            c = pc.next() => l.class_change(c),
            _ = tick.tick() => { l.due(); false }
            _ = std::future::ready(()), if busy => { l.work_one().await; false }
        };
        if ended {
            report_dead(&[&rb, &crb, &cl, &pc]);
            return;
        }
    }
}

fn report_dead(watches: &[&Watch]) {
    let why: Vec<String> = watches.iter().filter_map(|w| w.failing()).collect();
    tracing::error!(errors = ?why, "a Karmada watch ended; the scheduler role stopped");
}

fn binding_kind(kind: Kind) -> BindingKind {
    match kind {
        Kind::ClusterResourceBinding => BindingKind::ClusterResourceBinding,
        _ => BindingKind::ResourceBinding,
    }
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

/// Ends this replica's reservations `ids` as released.
fn release_all(st: &ReplicaState, ids: &[String]) {
    for id in ids {
        if let Err(e) = st.end_own(id, ReservationState::Released) {
            tracing::warn!(id, error = %e, "releasing a reservation failed; it ends at its TTL");
        }
    }
}

/// `Time` now.
fn now() -> Time {
    Time(jiff::Timestamp::now())
}

impl Loop {
    fn cache(&self, kind: Kind) -> &Cache {
        match kind {
            Kind::ClusterResourceBinding => &self.cluster_bindings,
            _ => &self.bindings,
        }
    }

    /// `o`, the binding `key`, decoded (once per `resourceVersion`).
    fn decode(
        &mut self,
        key: &Key,
        o: &Object,
    ) -> Result<Arc<Binding>, dramesh_scheduler::InputError> {
        let rv = o.meta().resource_version.clone().unwrap_or_default();
        if let Some((v, b)) = self.decoded.get(key)
            && *v == rv
        {
            return Ok(b.clone());
        }
        let b = Arc::new(Binding::from_value(binding_kind(key.0), o.value())?);
        self.decoded.insert(key.clone(), (rv, b.clone()));
        Ok(b)
    }

    fn enqueue(&mut self, key: Key) {
        if self.queued.insert(key.clone()) {
            self.queue.push_back(key);
        }
    }

    fn enqueue_all(&mut self, kind: Kind) {
        for o in self.cache(kind).list() {
            let k = (kind, o.key());
            self.enqueue(k);
        }
    }

    /// Returns true when the watch ended.
    fn binding_change(&mut self, kind: Kind, c: Option<Change>) -> bool {
        match c {
            None => return true,
            Some(Change::Applied(o)) => self.enqueue((kind, o.key())),
            Some(Change::Deleted(o)) => {
                self.retry.remove(&(kind, o.key()));
                self.superseded.remove(&(kind, o.key()));
                self.decoded.remove(&(kind, o.key()));
            }
            Some(Change::Synced) => self.enqueue_all(kind),
        }
        false
    }

    /// Decodes the PriorityClasses again after any change of them (they are few and rarely
    /// change); returns true when the watch ended.
    fn class_change(&mut self, c: Option<Change>) -> bool {
        if c.is_none() {
            return true;
        }
        self.classes = self
            .class_cache
            .list()
            .iter()
            .filter_map(|o| priority_class_from_value(o.value()).ok())
            .filter_map(|pc| pc.metadata.name.clone().map(|n| (n, pc)))
            .collect();
        false
    }

    /// Returns true when the watch ended.
    fn cluster_change(&mut self, c: Option<Change>) -> bool {
        let changed: Vec<Cluster> = match c {
            None => return true,
            Some(Change::Synced) => {
                let all: BTreeMap<String, Cluster> = self
                    .cluster_cache
                    .list()
                    .iter()
                    .filter_map(|o| match Cluster::from_value(o.value()) {
                        Ok(c) => Some((c.name.clone(), c)),
                        Err(e) => {
                            tracing::warn!(error = %e, "Karmada cluster ignored");
                            None
                        }
                    })
                    .collect();
                self.clusters = Arc::new(all);
                self.enqueue_all(Kind::ResourceBinding);
                self.enqueue_all(Kind::ClusterResourceBinding);
                return false;
            }
            Some(Change::Applied(o)) => match Cluster::from_value(o.value()) {
                Ok(new) => {
                    let old = self.clusters.get(&new.name).cloned();
                    if old.as_ref() == Some(&new) {
                        return false;
                    }
                    Arc::make_mut(&mut self.clusters).insert(new.name.clone(), new.clone());
                    old.into_iter().chain([new]).collect()
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Karmada cluster ignored");
                    return false;
                }
            },
            Some(Change::Deleted(o)) => {
                let name = o.meta().name.clone().unwrap_or_default();
                match Arc::make_mut(&mut self.clusters).remove(&name) {
                    Some(c) => vec![c],
                    None => return false,
                }
            }
        };
        for kind in [Kind::ResourceBinding, Kind::ClusterResourceBinding] {
            for o in self.cache(kind).list() {
                let key = (kind, o.key());
                let Ok(b) = self.decode(&key, &o) else {
                    continue;
                };
                if changed
                    .iter()
                    .any(|c| affected_by_cluster(&b, c, &self.role.name))
                {
                    self.enqueue(key);
                }
            }
        }
        false
    }

    /// Queues the bindings whose retry is due.
    fn due(&mut self) {
        let now = Instant::now();
        let view = self.state.change_count();
        let due: Vec<Key> = self
            .retry
            .iter()
            .filter(|(_, r)| self.backoff.next_attempt(r, view) <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for k in due {
            self.enqueue(k);
        }
    }

    async fn work_one(&mut self) {
        let Some(key) = self.queue.pop_front() else {
            return;
        };
        self.queued.remove(&key);
        let started = Instant::now();
        let view = self.state.change_count();
        let outcome = self.attempt(&key).await;
        let result = match &outcome {
            Outcome::Scheduled => "scheduled",
            Outcome::Unchanged => "unchanged",
            Outcome::Dropped => "dropped",
            Outcome::Unschedulable => "unschedulable",
            Outcome::Error => "error",
        };
        if let Some(m) = &self.metrics {
            m.count(result);
            if outcome != Outcome::Dropped {
                m.latency.observe(started.elapsed().as_secs_f64());
            }
        }
        match outcome {
            Outcome::Scheduled | Outcome::Unchanged | Outcome::Dropped => {
                self.retry.remove(&key);
            }
            Outcome::Unschedulable | Outcome::Error => {
                let unschedulable = outcome == Outcome::Unschedulable;
                let r =
                    self.backoff
                        .failed(self.retry.get(&key), Instant::now(), view, unschedulable);
                self.retry.insert(key, r);
            }
        }
    }

    /// Plans, decides, reserves and writes one binding, re-planning after a conflict or a
    /// lost reservation.
    async fn attempt(&mut self, key: &Key) -> Outcome {
        let (kind, k) = key;
        let Some(mut obj) = self.cache(*kind).get(k.namespace.as_deref(), &k.name) else {
            return Outcome::Dropped;
        };
        // A version this loop wrote and then wrote over: the newer one's event follows.
        let rv = obj.meta().resource_version.as_ref();
        if rv.is_some_and(|rv| self.superseded.get(key).is_some_and(|s| s.contains(rv))) {
            return Outcome::Unchanged;
        }
        for _ in 0..MAX_ATTEMPTS {
            let b = match self.decode(key, &obj) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %e, "binding not scheduled");
                    return Outcome::Dropped;
                }
            };
            let trigger = match plan(&b, &self.clusters, &self.role.name) {
                Action::Ignore(_) => return Outcome::Dropped,
                Action::Nothing(None) => return Outcome::Unchanged,
                Action::Nothing(Some(_)) => {
                    // Recomputed against a re-read binding after a conflict.
                    let patch = |fresh: &Binding| match plan(fresh, &self.clusters, &self.role.name)
                    {
                        Action::Nothing(Some(p)) => vec![p],
                        _ => Vec::new(),
                    };
                    return match self.write_status(*kind, &obj, patch).await {
                        Ok((_, versions)) => {
                            self.wrote(key, versions);
                            Outcome::Unchanged
                        }
                        Err(e) => {
                            tracing::warn!(binding = %b.id(), error = %e, "observed generation not written");
                            Outcome::Error
                        }
                    };
                }
                Action::Schedule(t) => t,
            };
            tracing::debug!(binding = %b.id(), trigger = ?trigger, "scheduling");
            let (demand, manifests) = match self.demand(&b).await {
                Ok(d) => d,
                Err(message) => {
                    let d = Decision::error(message);
                    return match self.write(*kind, &obj, &b, &d).await {
                        Ok((written, versions)) => {
                            self.wrote(key, versions);
                            self.events(*kind, &written, &b, &d).await;
                            Outcome::Error
                        }
                        // Changed meanwhile: its change event queues it again.
                        Err(WriteError::Conflict(_)) => Outcome::Error,
                        Err(WriteError::Failed(e)) => {
                            tracing::warn!(binding = %b.id(), error = %e, "scheduler error not written");
                            Outcome::Error
                        }
                    };
                }
            };
            let decision = {
                let state = self.state.clone();
                let clusters = self.clusters.clone();
                let b = b.clone();
                let demand = demand.clone();
                let deadline = Instant::now() + DECIDE_DEADLINE;
                match tokio::task::spawn_blocking(move || {
                    state.decide_binding(&b, &demand, &clusters, deadline)
                })
                .await
                {
                    Ok(d) => d,
                    Err(e) => Decision::error(format!("the decision failed: {e}")),
                }
            };
            let held = match self.hold(&b, &demand, &manifests, &decision).await {
                Ok(ids) => ids,
                Err(Hold::Lost(lost)) => {
                    tracing::info!(binding = %b.id(), lost = %lost, "reservation lost; planning again");
                    if let Some(m) = &self.metrics {
                        m.count("reservation_lost");
                    }
                    continue;
                }
                Err(Hold::Failed(e)) => {
                    // Never written unheld: another replica could take the same devices.
                    tracing::warn!(binding = %b.id(), error = %e, "the decision could not be held; not written");
                    return Outcome::Error;
                }
            };
            match self.write(*kind, &obj, &b, &decision).await {
                Ok((written, versions)) => {
                    self.wrote(key, versions);
                    self.events(*kind, &written, &b, &decision).await;
                    return match decision.retry {
                        Retry::No => Outcome::Scheduled,
                        Retry::Unschedulable => Outcome::Unschedulable,
                        Retry::Error => Outcome::Error,
                    };
                }
                Err(WriteError::Conflict(fresh)) => {
                    self.release(&held).await;
                    if let Some(m) = &self.metrics {
                        m.count("conflict");
                    }
                    obj = fresh;
                }
                Err(WriteError::Failed(e)) => {
                    self.release(&held).await;
                    tracing::warn!(binding = %b.id(), error = %e, "schedule result not written");
                    return Outcome::Error;
                }
            }
        }
        Outcome::Error
    }

    /// The binding's demand and, for a workload, the manifests a reservation carries (its
    /// template and ResourceClaimTemplates).
    async fn demand(&self, b: &Binding) -> Result<(Demand, Vec<String>), String> {
        let classes = &self.classes;
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
                // `demand` names the missing template.
                Ok(None) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        let d = demand(b, Some(template.value()), &claims, classes).map_err(|e| e.to_string())?;
        let manifests = std::iter::once(template.value())
            .chain(claims.iter())
            .map(manifest_of)
            .collect();
        Ok((d, manifests))
    }

    /// Holds the replicas `decision` adds to dramesh-reported clusters as reservations and
    /// checks, after the settle window, that overcommit resolution admits every one. On a
    /// lost one, releases them all and says which.
    async fn hold(
        &self,
        b: &Binding,
        demand: &Demand,
        manifests: &[String],
        decision: &Decision,
    ) -> Result<Vec<String>, Hold> {
        let (Some(clusters), Demand::Replicas(w)) = (&decision.clusters, demand) else {
            return Ok(Vec::new());
        };
        let added: Vec<&TargetCluster> = clusters
            .iter()
            .filter(|t| t.replicas > b.assigned(&t.name))
            .filter(|t| self.state.with_view(|v| v.cluster(&t.name).is_some()))
            .collect();
        if added.is_empty() {
            return Ok(Vec::new());
        }
        let adds: Vec<(String, i64)> = added
            .iter()
            .map(|t| (t.name.clone(), t.replicas - b.assigned(&t.name)))
            .collect();
        let creator = self.role.creator();
        let manifests = manifests.to_vec();
        let priority = w.priority;
        // Writing goes to the store (fsync with a data directory): off the reactor.
        let ids = self
            .blocking(move |st| {
                // The record's workload is what other replicas decode from the manifests.
                let workload = workload_from_manifests(&manifests)
                    .map_err(|e| format!("the workload cannot be carried in a reservation: {e}"))?;
                let mut ids = Vec::new();
                for (cluster, replicas) in &adds {
                    let own = Own {
                        creator: &creator,
                        cluster,
                        workload: &workload,
                        manifests: &manifests,
                        replicas: (*replicas).min(resv::MAX_REPLICAS),
                        priority,
                        ttl_seconds: resv::DEFAULT_TTL_SECONDS,
                    };
                    match st.write_own(&own) {
                        Ok(id) => ids.push(id),
                        Err(e) => {
                            release_all(st, &ids);
                            return Err(format!("writing a reservation on {cluster}: {e}"));
                        }
                    }
                }
                Ok(ids)
            })
            .await
            .and_then(|r| r)
            .map_err(Hold::Failed)?;
        tokio::time::sleep(self.role.settle).await;
        // Resolution runs the estimator: off the reactor too.
        let checked = ids.clone();
        let lost = self
            .blocking(move |st| {
                let lost = checked.iter().find_map(|id| {
                    let s = st.reservation_status(id)?;
                    (s.status == ReservationState::Conflicted).then(|| {
                        format!(
                            "reservation {id} on {} lost to {}",
                            s.cluster,
                            s.winner.as_deref().unwrap_or("an unreadable reservation")
                        )
                    })
                });
                if lost.is_some() {
                    release_all(st, &checked);
                }
                lost
            })
            .await
            .map_err(Hold::Failed)?;
        match lost {
            Some(why) => Err(Hold::Lost(why)),
            None => Ok(ids),
        }
    }

    /// Runs `f` on the replica state on a blocking thread.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&ReplicaState) -> T + Send + 'static,
    ) -> Result<T, String> {
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || f(&state))
            .await
            .map_err(|e| format!("a blocking task failed: {e}"))
    }

    async fn release(&self, ids: &[String]) {
        if ids.is_empty() {
            return;
        }
        let ids = ids.to_vec();
        if let Err(e) = self.blocking(move |st| release_all(st, &ids)).await {
            tracing::warn!(error = %e, "releasing reservations failed; they end at their TTL");
        }
    }

    /// Writes `decision` on `obj` (read as `b`): the spec patch, then the status patch.
    /// Returns the binding as last written and the resourceVersions of every write.
    async fn write(
        &self,
        kind: Kind,
        obj: &Arc<Object>,
        b: &Binding,
        decision: &Decision,
    ) -> Result<(Arc<Object>, Vec<String>), WriteError> {
        let at = now();
        let mut current = obj.clone();
        let mut written = Vec::new();
        for p in decision.patches(b, &at).into_iter().filter(|p| !p.status) {
            let body: Value = serde_json::from_str(&p.body)
                .map_err(|e| WriteError::Failed(format!("spec patch body: {e}")))?;
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
        let decision = decision.clone();
        let (o, mut more) = self
            .write_status(kind, &current, move |fresh| {
                if basis.is_some_and(|g| g != fresh.metadata.generation) {
                    return Vec::new();
                }
                decision
                    .patches(fresh, &at)
                    .into_iter()
                    .filter(|p| p.status)
                    .collect()
            })
            .await
            .map_err(WriteError::Failed)?;
        if basis.is_some() && o.meta().generation != basis {
            return Err(WriteError::Conflict(o));
        }
        written.append(&mut more);
        Ok((o, written))
    }

    /// Remembers the versions this loop wrote on its way to the last one: their watch
    /// events are not worth planning (the last one's event follows).
    fn wrote(&mut self, key: &Key, mut versions: Vec<String>) {
        versions.pop();
        if versions.is_empty() {
            self.superseded.remove(key);
        } else {
            self.superseded.insert(key.clone(), versions);
        }
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
                        Ok(o) => o,
                        Err(WriteError::Failed(e)) => return Err(e),
                        Err(WriteError::Conflict(o)) => o,
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
    /// karmada-scheduler does. Failures are logged: an Event is not worth a retry.
    async fn events(&self, kind: Kind, written: &Object, b: &Binding, decision: &Decision) {
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
                if let Err(err) = self.client.event(regarding, &note).await {
                    tracing::debug!(binding = %b.id(), error = %err, "event not recorded");
                }
            }
        }
    }
}
