//! The scheduler role's loop: the replica is the Karmada scheduler for the bindings whose
//! `spec.schedulerName` names it. Decisions are `dramesh_scheduler`'s, I/O is
//! [`crate::karmada`]'s; this module only connects them.
//!
//! - **Queue** ([`queue::WorkQueue`]). Binding keys, fed by binding changes (every binding
//!   after a complete list), by cluster changes that matter to scheduling
//!   (`affected_by_cluster`), by retries (a binding that failed waits for its [`Backoff`];
//!   one that was unschedulable also waits for the replica's view or reservations to change,
//!   [`ReplicaState::change_count`], at most 5 minutes; the loop sleeps until the earliest
//!   retry), and by lost reservations (below).
//! - **Many bindings at once.** Up to [`MAX_IN_FLIGHT`] bindings are worked on concurrently,
//!   each in its own task ([`task`]), a binding never twice at a time (a change arriving
//!   meanwhile queues it again when its task ends). Per binding: read from the watch cache;
//!   [`plan`](dramesh_scheduler::plan); when it must be scheduled, read the resource
//!   template and its ResourceClaimTemplates, [`demand`](dramesh_scheduler::demand), then decide on this replica's view and write the
//!   replicas the decision adds to dramesh-reported clusters as this replica's reservations
//!   (creator [`SchedulerRole::creator`]). Deciding and reserving happen one binding at a
//!   time, so every decision deducts the reservations of the decisions before it; the
//!   Karmada reads and writes of different bindings overlap. Then the writes, as
//!   karmada-scheduler makes them: the spec patch, the status patch, and the Events (in
//!   the background, on the binding and its resource template).
//! - **Conflicts.** Every write is conditional on the version read. A conflicting spec write
//!   re-reads the binding and plans again; a conflicting status write re-reads and recomputes
//!   the status patch against the fresh binding (Karmada's `RetryOnConflict`) while its
//!   generation is the one decided on, and plans again once it moved on. At most
//!   [`MAX_ATTEMPTS`] tries, then the binding backs off as an error. Nothing is overwritten.
//! - **No double-booking across replicas.** Another replica may have reserved the same room
//!   just before: its reservation reaches this replica within the settle window
//!   ([`SchedulerRole::settle`]). When the window has passed, every reservation written for
//!   a decision must be admitted by overcommit resolution. If one lost, the decision lost:
//!   its reservations are released and the replicas it added are placed again from what the
//!   binding had before it ([`dramesh_scheduler::decide_after_loss`]): they go where there is
//!   room, or are all taken off the binding when they no longer fit.
//!   With [`Confirm::BeforeWrite`] the reservations are confirmed before the decision is
//!   written instead, and a lost one makes the binding planned again before anything is
//!   written.
//!   Reservations end when the member cluster reports the pods, or at their TTL, or once
//!   void: a decision's reservation names its binding and generation, and once the decision
//!   had time to be written, a binding that does not show it voids it on every replica that
//!   sees the binding ([`dramesh_scheduler::void`]; the loop follows the verdicts as
//!   reservations and bindings change, [`voids`], and never starts writing a decision past
//!   its write deadline). Room freed that way retries every
//!   unschedulable binding at once, whatever its backoff.
//! - **Work shared across replicas** ([`SchedulerRole::shard`]): replicas with the same
//!   scheduler name split the bindings by rendezvous hashing of their uid over the members
//!   alive ([`crate::members`], [`dramesh_scheduler::share`]); each decides only the bindings
//!   it owns but watches all, and queues those it newly owns when the members change. A
//!   written decision of a member that died or left is watched by nobody: once its
//!   reservations are old enough to be judged void, the binding's new owner places its
//!   replicas again if one of them lost overcommit resolution ([`Loop::take_over_lost`]).
//!   See ARCHITECTURE.md, "The loop on the replica", for the protocol and its limits.

mod decider;
mod preempt;
mod queue;
mod task;
mod voids;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dramesh_model::k8s::PriorityClass;
use dramesh_scheduler::object::priority_class_from_value;
use dramesh_scheduler::{Backoff, BindingKind, Cluster, affected_by_cluster};
use dramesh_telemetry::registry::{CounterVec, Histogram};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use crate::karmada::{Cache, Change, KarmadaClient, Kind, ObjectKey, Watch};
use crate::members::Peers;
use crate::reservation_table::Entry;
use crate::state::ReplicaState;
use dramesh_api::native::ReservationState;
use dramesh_scheduler::void::Void;
use queue::WorkQueue;
use task::{Ctx, Done, Held, Job, MAX_EVENT_WRITES, Outcome, Verdict, blocking};
use voids::Voids;

#[cfg(test)]
mod tests;

/// Tries per binding (a conflicting write starts another).
pub(crate) const MAX_ATTEMPTS: u32 = 3;

/// Bindings worked on at once: enough to keep the Karmada API server's round trips of
/// different bindings overlapping while one decision is computed.
pub(crate) const MAX_IN_FLIGHT: usize = 64;

/// Default of [`SchedulerRole::settle`]: the replica applies received changes at least every
/// 250 ms, so two of those periods cover a reservation written elsewhere just before ours
/// (pushed at once over the mesh) on a healthy mesh.
pub const DEFAULT_SETTLE: Duration = Duration::from_millis(500);

/// Default scheduler name (`--scheduler-name`).
pub const DEFAULT_SCHEDULER_NAME: &str = "dramesh-scheduler";

/// How often what the replica's state does not signal is looked at: the members sharing the
/// work, the decisions' reservations to void, the watched decisions (and, at the latest,
/// whether the view moved for unschedulable bindings' retries).
const TICK: Duration = Duration::from_millis(250);

/// The scheduler role of a replica.
#[derive(Clone, Debug)]
pub struct SchedulerRole {
    /// Kubeconfig of the Karmada API server.
    pub kubeconfig: PathBuf,
    /// Bindings whose `spec.schedulerName` equals this are scheduled here.
    pub name: String,
    /// How long after a decision is written its reservations are checked against
    /// overcommit resolution, so that reservations other replicas wrote before it have
    /// arrived ([`DEFAULT_SETTLE`]).
    pub settle: Duration,
    /// Whether a decision is written before or after its reservations are confirmed.
    pub confirm: Confirm,
    /// Whether the replicas with this scheduler name split the bindings among themselves
    /// (`--scheduler-shard`, default on): each decides only the bindings it owns. Off, it
    /// decides every binding, as every other replica does (conflicting writes decide).
    pub shard: bool,
    /// How many replicas have this role ([`Confirm::Strict`] confirms with a majority of
    /// them; `--scheduler-members`). Unused by the other modes.
    pub members: usize,
    /// The nice value asked for the deciding thread (`--scheduler-decider-nice`,
    /// [`DEFAULT_DECIDER_NICE`]; 0: the process's).
    pub decider_nice: i32,
}

/// The deciding thread's nice value unless told otherwise: decisions are the role's serial
/// resource, and on a busy 2-core machine the thread at the process's priority waited for a
/// core long enough to put the binding p99 over 50 ms in 2 of 5 runs of the churn bench at
/// 500/s, and at -10 in none of the 5 runs interleaved with those (docs/performance.md).
/// -5 was not enough.
pub const DEFAULT_DECIDER_NICE: i32 = -10;

/// When a decision's reservations are confirmed by overcommit resolution, relative to
/// writing the decision to the binding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Confirm {
    /// Write at once, confirm when the settle window has passed: a binding is written within
    /// milliseconds. When two replicas reserved the same room, the loser's binding holds more
    /// than fits until its check (one settle window), then its replicas move or are taken
    /// off, so member clusters may briefly see pods that stay pending.
    #[default]
    AfterWrite,
    /// Wait out the settle window and confirm before writing: a binding holds more than fits
    /// only when a competing reservation arrives after the window (a partition, a slow link);
    /// every decision that reserves takes at least one settle window.
    BeforeWrite,
    /// Confirm before writing, with a majority of [`SchedulerRole::members`] holding the
    /// decision's reservations and every live reservation the confirming replica holds
    /// deducted, whatever their rank ([`crate::quorum`]): two decisions that conflict are
    /// never both written, partitions included. A replica that cannot reach a majority within
    /// the settle window writes no device decision: the binding's `Scheduled` condition says
    /// so, and it is retried with backoff.
    Strict,
}

impl std::str::FromStr for Confirm {
    type Err = String;

    fn from_str(s: &str) -> Result<Confirm, String> {
        match s {
            "after-write" => Ok(Confirm::AfterWrite),
            "before-write" => Ok(Confirm::BeforeWrite),
            "strict" => Ok(Confirm::Strict),
            other => Err(format!(
                "{other:?} is not a confirmation mode (after-write, before-write or strict)"
            )),
        }
    }
}

impl SchedulerRole {
    /// The role for `name` with the default settle window.
    pub fn new(kubeconfig: PathBuf, name: &str) -> SchedulerRole {
        SchedulerRole {
            kubeconfig,
            name: name.to_string(),
            settle: DEFAULT_SETTLE,
            confirm: Confirm::default(),
            shard: true,
            members: 1,
            decider_nice: DEFAULT_DECIDER_NICE,
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
    /// Time from queueing a binding (its watch event, retry or lost reservation) to its
    /// last write.
    latency: Arc<Histogram>,
    /// The deciding thread's queue wait and run time per decision.
    decider: decider::DeciderMetrics,
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
                    "Time from queueing a binding (its watch event, retry or lost reservation) to its last write.",
                    &[0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
                )?;
                let decider = decider::DeciderMetrics::register(r)?;
                Ok(SchedulerMetrics {
                    bindings,
                    latency,
                    decider,
                })
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

/// What a binding's watch event shows that can make it worth planning: its generation (every
/// spec change) and its labels (which decide whether it is Karmada-managed; a label change
/// keeps the generation). Status and annotation changes alone are not worth planning.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    generation: Option<i64>,
    labels: Option<BTreeMap<String, String>>,
}

impl Seen {
    fn of(o: &crate::karmada::Object) -> Seen {
        let m = o.meta();
        Seen {
            generation: m.generation,
            labels: m.labels.clone(),
        }
    }
}

/// A decision's reservations waiting for the settle window to pass.
struct Check {
    due: Instant,
    key: Key,
    held: Held,
}

/// A binding being worked on.
struct Running {
    queued_at: Instant,
    view: u64,
    lost: Option<BTreeMap<String, i64>>,
}

struct Loop {
    ctx: Arc<Ctx>,
    /// Bindings to work on, those running, and their retries.
    work: WorkQueue<Key>,
    bindings: Cache,
    cluster_bindings: Cache,
    class_cache: Cache,
    /// PriorityClasses by name, decoded when they change (not for every binding).
    classes: Arc<BTreeMap<String, PriorityClass>>,
    cluster_cache: Cache,
    clusters: Arc<BTreeMap<String, Cluster>>,
    /// Per binding, versions this loop wrote and then wrote over (see [`Loop::wrote`]).
    superseded: HashMap<Key, Vec<String>>,
    /// Per binding, every version its last task wrote: their watch events are this loop's
    /// own writes, never a reason to plan again.
    own: HashMap<Key, Vec<String>>,
    /// Per binding, what the last watch event showed of what makes it worth planning
    /// ([`Seen`]): an event that changes neither is ignored, as karmada-scheduler ignores
    /// binding updates that keep the generation.
    seen: HashMap<Key, Seen>,
    /// Watch events of bindings being worked on, looked at when their task ends (whether
    /// they are the task's own writes is known only then).
    deferred: HashMap<Key, Vec<Arc<crate::karmada::Object>>>,
    /// Bindings being worked on (running in `work`, with a task): when they were queued,
    /// the view's change count then, and the lost replicas handed to the task (kept for
    /// another try if it fails).
    running: HashMap<Key, Running>,
    tasks: JoinSet<(Key, Done)>,
    task_keys: HashMap<tokio::task::Id, Key>,
    /// Decisions' reservations, in the order they are due.
    checks: VecDeque<Check>,
    /// Decisions whose reservations were admitted at their check and still hold room: checked
    /// again whenever the reservations or the view change, since a reservation another
    /// replica wrote earlier may arrive after the settle window.
    watched: HashMap<Key, Held>,
    /// The change count of the last look at `watched`.
    watched_view: u64,
    /// The outcome epoch of each cluster at the last look at `watched`: only decisions
    /// holding room in a cluster where a reservation's state changed since are judged again.
    watched_epochs: BTreeMap<Arc<str>, u64>,
    /// Whether the Cluster and PriorityClass watches have listed everything once: nothing is
    /// decided before (as karmada-scheduler waits for its caches), or early bindings would
    /// be written `NoClusterFit` against an empty fleet.
    clusters_synced: bool,
    classes_synced: bool,
    /// Replicas to take back, by binding and cluster (lost reservations).
    lost: HashMap<Key, BTreeMap<String, i64>>,
    /// Whether the ResourceBinding and ClusterResourceBinding watches listed everything
    /// once: until then a binding missing from the cache is not known to be deleted.
    bindings_synced: [bool; 2],
    /// The other replicas as the mesh sees them (`None`: alone).
    peers: Option<watch::Receiver<Peers>>,
    /// The members sharing the work, sorted, this replica among them.
    members: Vec<String>,
    /// The decisions' reservations and their verdicts, followed as they change.
    voids: Voids,
    /// The decisions' reservations judged void at the last look, with why.
    void: BTreeMap<Arc<str>, String>,
    /// Reservations of departed members' written decisions whose replicas this replica took
    /// back ([`Loop::take_over_lost`]), so that each is taken back once.
    taken_over: BTreeSet<Arc<str>>,
    /// The change count and the orphans of the last look of [`Loop::take_over_lost`].
    orphans_looked: Option<(u64, Vec<String>)>,
}

/// Runs the scheduler role on `state` through `client` until `stop` turns true or a watch
/// ends: what a [`crate::Replica`] started with a [`SchedulerRole`] does, for programs that
/// build their own [`ReplicaState`] (the scheduler benchmark does).
pub async fn serve(
    state: Arc<ReplicaState>,
    client: Arc<KarmadaClient>,
    role: SchedulerRole,
    stop: watch::Receiver<bool>,
) {
    run(state, client, role, None, None, stop).await;
}

/// [`serve`] for a replica that shares the work with the replicas `peers` says are alive
/// (for programs that exchange the replicas' reservation documents themselves; a
/// [`crate::Replica`] learns them from its mesh), its `dramesh_scheduler_*` metrics
/// registered in `metrics` when given.
pub async fn serve_shared(
    state: Arc<ReplicaState>,
    client: Arc<KarmadaClient>,
    role: SchedulerRole,
    peers: watch::Receiver<Peers>,
    metrics: Option<&dramesh_telemetry::Metrics>,
    stop: watch::Receiver<bool>,
) {
    let metrics = metrics.and_then(SchedulerMetrics::register);
    run(state, client, role, metrics, Some(peers), stop).await;
}

/// How often a strict replica looks whether its ack record is behind what it has applied.
const ACK_EVERY: Duration = Duration::from_millis(20);

/// Strict scheduling: keeps this replica's ack record up to date (see [`crate::quorum`])
/// until `stop` turns true; a record is written only when it changes.
async fn publish_acks(state: Arc<ReplicaState>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(ACK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        match blocking(&state, |st| st.publish_acks(None)).await {
            Ok(Ok(())) => failing = false,
            Ok(Err(e)) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "the ack record was not written; strict decisions of other replicas wait");
            }
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "the ack record was not written");
            }
            _ => {}
        }
    }
}

/// Runs the scheduler loop until `stop` turns true (or a watch task dies).
pub(crate) async fn run(
    state: Arc<ReplicaState>,
    client: Arc<KarmadaClient>,
    role: SchedulerRole,
    metrics: Option<SchedulerMetrics>,
    peers: Option<watch::Receiver<Peers>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut rb = client.watch(Kind::ResourceBinding);
    let mut crb = client.watch(Kind::ClusterResourceBinding);
    let mut cl = client.watch(Kind::Cluster);
    let mut pc = client.watch(Kind::PriorityClass);
    let decider = match decider::Decider::start(
        state.clone(),
        metrics.as_ref().map(|m| m.decider.clone()),
        role.decider_nice,
    ) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(error = %e, "the scheduler role cannot start its deciding thread; it does not run");
            return;
        }
    };
    // The role record: the other replicas count this one as a member once it arrives.
    let announce = role.shard.then(|| role.name.clone());
    match blocking(&state, move |st| st.announce_role(announce.as_deref())).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "the scheduler role record was not written; the other replicas do not leave this one a share");
        }
        Err(e) => tracing::warn!(error = %e, "the scheduler role record was not written"),
    }
    // Another replica's late reservation may wait a fifth of the settle window to be
    // resolved, leaving the rest of the window to the mesh's delay.
    state.set_late_deferral(role.settle / 5);
    if role.confirm == Confirm::Strict {
        tokio::spawn(publish_acks(state.clone(), stop.clone()));
    }
    let me = state.replica.clone();
    let role_creator = role.creator();
    let mut l = Loop {
        ctx: Arc::new(Ctx {
            state,
            client,
            role,
            metrics,
            decider,
            events: Arc::new(Semaphore::new(MAX_EVENT_WRITES)),
            bindings: rb.cache(),
            cluster_bindings: crb.cache(),
            classes: pc.cache(),
            decoded: std::sync::Mutex::new(HashMap::new()),
            warned: std::sync::Mutex::new(HashMap::new()),
        }),
        work: WorkQueue::new(MAX_IN_FLIGHT, Backoff::default()),
        bindings: rb.cache(),
        cluster_bindings: crb.cache(),
        class_cache: pc.cache(),
        classes: Arc::new(BTreeMap::new()),
        cluster_cache: cl.cache(),
        clusters: Arc::new(BTreeMap::new()),
        superseded: HashMap::new(),
        own: HashMap::new(),
        seen: HashMap::new(),
        deferred: HashMap::new(),
        running: HashMap::new(),
        tasks: JoinSet::new(),
        task_keys: HashMap::new(),
        checks: VecDeque::new(),
        watched: HashMap::new(),
        watched_view: 0,
        watched_epochs: BTreeMap::new(),
        clusters_synced: false,
        classes_synced: false,
        lost: HashMap::new(),
        bindings_synced: [false; 2],
        peers,
        members: vec![me],
        voids: Voids::new(role_creator),
        void: BTreeMap::new(),
        taken_over: BTreeSet::new(),
        orphans_looked: None,
    };
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tracing::info!(scheduler = %l.ctx.role.name, "scheduler role started");
    loop {
        // Unschedulable bindings wait for this count to move.
        l.work.view_moved(l.ctx.state.change_count());
        let can_start =
            l.clusters_synced && l.classes_synced && l.may_decide() && l.work.can_start();
        let next_check = l.checks.front().map(|c| c.due);
        let next_retry = l.work.next_deadline();
        // Changes first; then finished work and due checks; with room, start one binding
        // when nothing else is waiting.
        let ended = tokio::select! {
            biased;
            // The guard `wait_for` returns is not Send: dropped inside.
            _ = async { drop(stop.wait_for(|v| *v).await) } => return,
            c = rb.next() => l.binding_change(Kind::ResourceBinding, c),
            c = crb.next() => l.binding_change(Kind::ClusterResourceBinding, c),
            c = cl.next() => l.cluster_change(c),
            c = pc.next() => l.class_change(c),
            // Before anything is started on the old members.
            _ = peers_changed(&mut l.peers) => { l.reshard(); false }
            Some(r) = l.tasks.join_next_with_id(), if !l.tasks.is_empty() => { l.finished(r); false }
            _ = sleep_until(next_check), if next_check.is_some() => { l.check().await; false }
            _ = sleep_until(next_retry), if next_retry.is_some() => { l.work.queue_due(); false }
            _ = tick.tick() => {
                l.reshard();
                let orphans = l.judge_void();
                l.take_over_lost(orphans).await;
                l.recheck().await;
                false
            }
            _ = std::future::ready(()), if can_start => { l.start_next(); false }
        };
        if ended {
            report_dead(&[&rb, &crb, &cl, &pc]);
            return;
        }
    }
}

/// Returns when the peers changed; never when there are none or their sender is gone.
async fn peers_changed(p: &mut Option<watch::Receiver<Peers>>) {
    if let Some(r) = p
        && r.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// `Time` now, as Karmada objects carry it.
pub(crate) fn now() -> Time {
    Time(jiff::Timestamp::now())
}

fn report_dead(watches: &[&Watch]) {
    let why: Vec<String> = watches.iter().filter_map(|w| w.failing()).collect();
    tracing::error!(errors = ?why, "a Karmada watch ended; the scheduler role stopped");
}

/// What a binding's owner is hashed from: its uid (a binding created again under the same
/// name is another binding), or its kind and name when it has none.
fn share_key(o: &crate::karmada::Object) -> std::borrow::Cow<'_, str> {
    let m = o.meta();
    match m.uid.as_deref() {
        Some(uid) if !uid.is_empty() => uid.into(),
        _ => format!(
            "{}/{}",
            m.namespace.as_deref().unwrap_or(""),
            m.name.as_deref().unwrap_or("")
        )
        .into(),
    }
}

fn binding_kind(kind: Kind) -> BindingKind {
    match kind {
        Kind::ClusterResourceBinding => BindingKind::ClusterResourceBinding,
        _ => BindingKind::ResourceBinding,
    }
}

impl Loop {
    fn cache(&self, kind: Kind) -> &Cache {
        match kind {
            Kind::ClusterResourceBinding => &self.cluster_bindings,
            _ => &self.bindings,
        }
    }

    /// Whether this replica may decide yet: sharing, only once it has caught up with a peer
    /// replica (before, it may not know the others' role records and would take every
    /// binding).
    fn may_decide(&self) -> bool {
        !self.ctx.role.shard || self.peers.as_ref().is_none_or(|p| p.borrow().caught_up)
    }

    /// Whether this replica owns binding `o` (always, when not sharing).
    fn owns(&self, o: &crate::karmada::Object) -> bool {
        !self.ctx.role.shard
            || dramesh_scheduler::share::owner(&share_key(o), &self.members)
                == Some(self.ctx.state.replica.as_str())
    }

    /// Computes the members again; when they changed, queues the bindings this replica owns
    /// now and did not before (a dead or leaving member's, or all of them at first).
    fn reshard(&mut self) {
        if !self.ctx.role.shard {
            return;
        }
        let peers = self
            .peers
            .as_ref()
            .map(|p| p.borrow().clone())
            .unwrap_or_default();
        let roles = self.ctx.state.role_records();
        let me = self.ctx.state.replica.clone();
        let members = crate::members::members(&me, &self.ctx.role.name, &roles, &peers);
        if members == self.members {
            return;
        }
        let before = std::mem::replace(&mut self.members, members);
        // Who departed, and who owns which binding, is part of every verdict.
        self.voids.all_changed();
        tracing::info!(members = ?self.members, before = ?before, "the replicas sharing the bindings changed");
        for kind in [Kind::ResourceBinding, Kind::ClusterResourceBinding] {
            for o in self.cache(kind).list() {
                let k = share_key(&o);
                let owner = dramesh_scheduler::share::owner;
                if owner(&k, &self.members) == Some(me.as_str())
                    && owner(&k, &before) != Some(me.as_str())
                {
                    self.enqueue((kind, o.key()));
                }
            }
        }
    }

    /// Judges the scheduler decisions' reservations old enough to be ([`dramesh_scheduler::void`])
    /// against the bindings as this replica's watches hold them (those that became old
    /// enough or whose binding changed since the last look, [`Voids`]), and hands the void ones to
    /// the state (which leaves them out of every estimate; their owner releases them). A
    /// decision this replica wrote itself is never judged unwritten (its watch may lag its
    /// own write); any other verdict holds for it too. Returns the reservations of decisions
    /// written by replicas no longer among the members, on bindings this replica owns now
    /// (with the binding's key), for [`Loop::take_over_lost`].
    fn judge_void(&mut self) -> Vec<(Key, Arc<Entry>)> {
        let since = self.voids.version();
        self.voids.follow(self.ctx.state.decision_changes(since));
        // Taken out while the judge borrows the loop.
        let mut voids = std::mem::take(&mut self.voids);
        voids.judge(Instant::now(), |e, key| self.judge_one(e, key));
        self.voids = voids;
        let mut judged = BTreeMap::new();
        for (e, key, v) in self.voids.void() {
            if v == Void::NotWritten && self.writing(key, &e.id) {
                continue;
            }
            if let Some(d) = &e.record.decision {
                judged.insert(e.id.clone(), v.reason(d, &e.cluster));
            }
        }
        let mut freed = false;
        for (id, why) in &judged {
            if !self.void.contains_key(id) {
                freed = true;
                tracing::info!(id = %id, reason = %why, "a decision's reservation is void: it holds nothing");
            }
        }
        if judged != self.void {
            self.void = judged.clone();
            self.ctx.state.set_void_decisions(judged);
        }
        // A binding refused just before held room its backoff away (up to 10 s): measured
        // 2 s past the settle window plus grace after a replica's SIGKILL.
        if freed {
            self.work.retry_unschedulable_now();
        }
        self.voids.orphans()
    }

    /// Judges one decision's reservation `e`, old enough to be, against its binding `key` as
    /// the watch cache holds it ([`voids`]).
    fn judge_one(&self, e: &Entry, key: &Key) -> voids::Judgement {
        use dramesh_scheduler::void::{Served, last_written, void};
        let Some(d) = &e.record.decision else {
            return voids::Judgement::default();
        };
        let (kind, okey) = key;
        let i = usize::from(*kind == Kind::ClusterResourceBinding);
        let obj = self.cache(*kind).get(okey.namespace.as_deref(), &okey.name);
        let b = obj.as_ref().and_then(|o| self.ctx.decode(key, o).ok());
        let served = match (self.bindings_synced[i], &obj, &b) {
            (false, _, _) => Served::Unknown,
            (true, None, _) => Served::Absent,
            (true, Some(_), None) => Served::Unknown,
            (true, Some(_), Some(b)) => Served::Present {
                uid: &b.metadata.uid,
                generation: b.metadata.generation,
                clusters: &b.clusters,
                decided_by: b
                    .metadata
                    .annotations
                    .get(dramesh_scheduler::void::DECIDED_BY)
                    .map(String::as_str),
            },
        };
        let owner = &e.record.owner;
        // Strict decisions are never moved once written (see `finished`).
        let departed = self.ctx.role.shard
            && self.ctx.role.confirm != Confirm::Strict
            && *owner != self.ctx.state.replica
            && !self.members.contains(owner);
        let orphan = obj.as_ref().is_some_and(|o| departed && self.owns(o))
            && last_written(owner, d, served);
        // Old enough (see `Voids`): the age only has to pass the threshold.
        let age = d.void_after();
        voids::Judgement {
            void: void(owner, d, &e.cluster, age, served),
            orphan,
        }
    }

    /// Whether this replica is still writing or watching its decision for `key` that holds
    /// reservation `id`: such a decision is never judged unwritten (its watch may lag its
    /// own write).
    fn writing(&self, key: &Key, id: &str) -> bool {
        let holds = |h: &Held| h.by_cluster.values().any(|(i, _)| i == id);
        self.watched.get(key).is_some_and(holds)
            || self.checks.iter().any(|c| c.key == *key && holds(&c.held))
    }

    /// A written decision whose reservation loses overcommit resolution is placed again by
    /// its decider, which watches it; a decider that died or left watches nothing. The
    /// binding's owner now takes such a decision's replicas back as the decider would have
    /// (`orphans`, from [`Loop::judge_void`]: decisions of departed members the bindings show;
    /// one of its reservations conflicted makes the decision lost as a whole). It cannot
    /// release the departed member's reservations, but a conflicted one holds nothing, and
    /// the others are void once the binding moves on without them.
    async fn take_over_lost(&mut self, orphans: Vec<(Key, Arc<Entry>)>) {
        let live: BTreeSet<Arc<str>> = orphans.iter().map(|(_, e)| e.id.clone()).collect();
        self.taken_over.retain(|id| live.contains(id));
        let orphans: Vec<(Key, Arc<Entry>)> = orphans
            .into_iter()
            .filter(|(k, e)| !self.taken_over.contains(&e.id) && !self.lost.contains_key(k))
            .collect();
        if orphans.is_empty() {
            return;
        }
        // A state changes only with the reservations or the view (a dead replica's admitted
        // decisions stay orphans until their pods are reported or their TTL): judged again
        // only when the change count moved or another orphan came.
        let ids: Vec<String> = orphans.iter().map(|(_, e)| e.id.to_string()).collect();
        let looked = (self.ctx.state.change_count(), ids.clone());
        if self.orphans_looked.as_ref() == Some(&looked) {
            return;
        }
        self.orphans_looked = Some(looked);
        // Resolution runs the estimator: off the reactor.
        let lost = blocking(&self.ctx.state, move |st| {
            st.reservation_states(&ids)
                .into_iter()
                .filter(|(_, j)| j.state == ReservationState::Conflicted)
                .map(|(id, _)| id.to_string())
                .collect::<BTreeSet<String>>()
        })
        .await;
        let lost = match lost {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "departed members' decisions not checked");
                return;
            }
        };
        let mut decisions: HashMap<(Key, String, i64), Vec<Arc<Entry>>> = HashMap::new();
        for (k, e) in orphans {
            let generation = e.record.decision.as_ref().map_or(0, |d| d.generation);
            decisions
                .entry((k, e.record.owner.clone(), generation))
                .or_default()
                .push(e);
        }
        for ((key, owner, generation), entries) in decisions {
            if !entries.iter().any(|e| lost.contains(&*e.id)) {
                continue;
            }
            tracing::info!(binding = ?key, decider = %owner, generation, "a departed member's written decision lost its reservations; its replicas are placed again");
            if let Some(m) = &self.ctx.metrics {
                m.count("reservation_lost");
            }
            let mut clusters = BTreeMap::new();
            for e in entries {
                *clusters.entry(e.cluster.to_string()).or_default() += e.record.replicas;
                self.taken_over.insert(e.id.clone());
            }
            self.note_lost(&key, clusters);
            self.enqueue(key);
        }
    }

    fn enqueue(&mut self, key: Key) {
        self.work.enqueue(key);
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
            Some(Change::Applied(o)) => {
                self.voids.binding_changed(&(kind, o.key()));
                self.observe((kind, o.key()), o);
            }
            Some(Change::Deleted(o)) => {
                let key = (kind, o.key());
                self.voids.binding_changed(&key);
                self.work.forget(&key);
                self.superseded.remove(&key);
                self.own.remove(&key);
                self.seen.remove(&key);
                self.deferred.remove(&key);
                self.ctx.forget(&key);
                self.lost.remove(&key);
                self.watched.remove(&key);
            }
            // A relist: only what changed while the watch was down is planned.
            Some(Change::Synced) => {
                self.bindings_synced[usize::from(kind == Kind::ClusterResourceBinding)] = true;
                self.voids.all_changed();
                for o in self.cache(kind).list() {
                    self.observe((kind, o.key()), o);
                }
            }
        }
        false
    }

    /// Looks at a binding's watch event (or relisted object): it is planned unless it is
    /// one of this loop's own writes or shows nothing new ([`Seen`]). While the binding is
    /// being worked on the event waits for its task to end.
    fn observe(&mut self, key: Key, o: Arc<crate::karmada::Object>) {
        if self.work.is_running(&key) {
            self.deferred.entry(key).or_default().push(o);
            return;
        }
        let now = Seen::of(&o);
        let before = self.seen.insert(key.clone(), now.clone());
        let own = o.meta().resource_version.as_ref().is_some_and(|rv| {
            self.own
                .get(&key)
                .is_some_and(|written| written.contains(rv))
        });
        if own || before.as_ref() == Some(&now) {
            return;
        }
        self.enqueue(key);
    }

    /// Decodes the PriorityClasses again after any change of them (they are few and rarely
    /// change); returns true when the watch ended.
    fn class_change(&mut self, c: Option<Change>) -> bool {
        match c {
            None => return true,
            Some(Change::Synced) => self.classes_synced = true,
            Some(_) => {}
        }
        self.classes = Arc::new(
            self.class_cache
                .list()
                .iter()
                .filter_map(|o| priority_class_from_value(o.value()).ok())
                .filter_map(|pc| pc.metadata.name.clone().map(|n| (n, pc)))
                .collect(),
        );
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
                if !self.clusters_synced {
                    self.clusters_synced = true;
                    self.clusters = Arc::new(all);
                    self.enqueue_all(Kind::ResourceBinding);
                    self.enqueue_all(Kind::ClusterResourceBinding);
                    return false;
                }
                // A relist: only the clusters that changed meanwhile requeue bindings.
                let old = std::mem::replace(&mut self.clusters, Arc::new(all));
                let new = self.clusters.clone();
                let names: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
                names
                    .into_iter()
                    .filter(|n| old.get(*n) != new.get(*n))
                    .flat_map(|n| old.get(n).into_iter().chain(new.get(n)).cloned())
                    .collect()
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
                let Ok(b) = self.ctx.decode(&key, &o) else {
                    continue;
                };
                if changed
                    .iter()
                    .any(|c| affected_by_cluster(&b, c, &self.ctx.role.name))
                {
                    self.enqueue(key);
                }
            }
        }
        false
    }

    /// Starts a task for the binding at the head of the queue, unless it needs none.
    fn start_next(&mut self) {
        let Some((key, queued_at)) = self.work.start() else {
            return;
        };
        let view = self.ctx.state.change_count();
        let (kind, k) = &key;
        let Some(obj) = self.cache(*kind).get(k.namespace.as_deref(), &k.name) else {
            self.settle(&key, Outcome::Dropped, queued_at, view);
            self.work.finish(&key);
            return;
        };
        // Another member's (its owner decides it), unless this replica has a lost decision
        // of it to take back.
        if !self.owns(&obj) && !self.lost.contains_key(&key) {
            self.work.forget(&key);
            self.work.finish(&key);
            return;
        }
        // A version this loop wrote and then wrote over: the newer one's event follows.
        let rv = obj.meta().resource_version.as_ref();
        if rv.is_some_and(|rv| self.superseded.get(&key).is_some_and(|s| s.contains(rv))) {
            self.settle(&key, Outcome::Unchanged, queued_at, view);
            self.work.finish(&key);
            return;
        }
        // An undecodable binding goes to a task too: it reports the error on the binding.
        let binding = self.ctx.decode(&key, &obj);
        let lost = self.lost.remove(&key);
        let job = Job {
            key: key.clone(),
            obj,
            binding,
            clusters: self.clusters.clone(),
            classes: self.classes.clone(),
            lost: lost.clone(),
        };
        let ctx = self.ctx.clone();
        let id = self
            .tasks
            .spawn(async move {
                let key = job.key.clone();
                (key, ctx.work(job).await)
            })
            .id();
        self.task_keys.insert(id, key.clone());
        self.running.insert(
            key,
            Running {
                queued_at,
                view,
                lost,
            },
        );
    }

    /// Takes in a finished task.
    fn finished(&mut self, r: Result<(tokio::task::Id, (Key, Done)), tokio::task::JoinError>) {
        let (key, done) = match r {
            Ok((id, (key, done))) => {
                self.task_keys.remove(&id);
                (key, done)
            }
            Err(e) => {
                let Some(key) = self.task_keys.remove(&e.id()) else {
                    return;
                };
                tracing::error!(error = %e, "a binding's task failed");
                (
                    key,
                    Done {
                        outcome: Outcome::Error,
                        versions: Vec::new(),
                        held: None,
                    },
                )
            }
        };
        let Some(run) = self.running.remove(&key) else {
            return;
        };
        // Queued again if a change came meanwhile.
        self.work.finish(&key);
        self.wrote(&key, done.versions);
        for o in self.deferred.remove(&key).unwrap_or_default() {
            self.observe(key.clone(), o);
        }
        // Replicas to take back stay noted until a try gets through.
        if let (Outcome::Error, Some(lost)) = (done.outcome, run.lost) {
            self.note_lost(&key, lost);
        }
        // A strict decision was judged against every live reservation before it was
        // written: it is never moved for ranking behind a later one.
        if let Some(held) = done
            .held
            .filter(|_| self.ctx.role.confirm != Confirm::Strict)
        {
            self.checks.push_back(Check {
                due: Instant::now() + self.ctx.role.settle,
                key: key.clone(),
                held,
            });
        }
        self.settle(&key, done.outcome, run.queued_at, run.view);
    }

    /// Counts an outcome and sets the binding's retry.
    fn settle(&mut self, key: &Key, outcome: Outcome, queued_at: Instant, view: u64) {
        if let Some(m) = &self.ctx.metrics {
            m.count(outcome.as_str());
            if outcome != Outcome::Dropped {
                m.latency.observe(queued_at.elapsed().as_secs_f64());
            }
        }
        match outcome {
            Outcome::Scheduled | Outcome::Unchanged | Outcome::Dropped => {
                self.work.succeeded(key);
            }
            Outcome::Unschedulable | Outcome::Error => {
                self.work
                    .failed(key, view, outcome == Outcome::Unschedulable);
            }
        }
    }

    /// Checks the reservations of the decisions whose settle window has passed.
    async fn check(&mut self) {
        let now = Instant::now();
        let mut due = Vec::new();
        while self.checks.front().is_some_and(|c| c.due <= now) {
            if let Some(c) = self.checks.pop_front() {
                due.push((c.key, c.held));
            }
        }
        self.judge(due).await;
    }

    /// Checks the watched decisions again when the reservations or the view changed.
    async fn recheck(&mut self) {
        let view = self.ctx.state.change_count();
        if self.watched.is_empty() || view == self.watched_view {
            return;
        }
        self.watched_view = view;
        // Resolution runs the estimator: off the reactor.
        let epochs = match blocking(&self.ctx.state, |st| st.outcome_epochs()).await {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(error = %e, "reservations not checked again");
                return;
            }
        };
        let old = std::mem::replace(&mut self.watched_epochs, epochs);
        let changed = |c: &String| old.get(c.as_str()) != self.watched_epochs.get(c.as_str());
        let due: Vec<Key> = self
            .watched
            .iter()
            .filter(|(_, h)| h.by_cluster.keys().any(changed))
            .map(|(k, _)| k.clone())
            .collect();
        let due: Vec<(Key, Held)> = due
            .into_iter()
            .filter_map(|k| self.watched.remove(&k).map(|h| (k, h)))
            .collect();
        self.judge(due).await;
    }

    /// Judges decisions' reservations: the bindings of lost ones are queued to place their
    /// replicas again, admitted ones that still hold room are watched.
    async fn judge(&mut self, decisions: Vec<(Key, Held)>) {
        if decisions.is_empty() {
            return;
        }
        // Resolution runs the estimator: off the reactor.
        let judged = blocking(&self.ctx.state, move |st| task::judge(st, decisions)).await;
        let judged = match judged {
            Ok(j) => j,
            Err(e) => {
                tracing::error!(error = %e, "reservations not checked; they end at their TTL");
                return;
            }
        };
        for (key, held, v) in judged {
            match v {
                Verdict::Lost(clusters) => {
                    if let Some(m) = &self.ctx.metrics {
                        m.count("reservation_lost");
                    }
                    self.note_lost(&key, clusters);
                    self.enqueue(key);
                }
                Verdict::Live => {
                    self.watched.insert(key, held);
                }
                Verdict::Ended => {}
            }
        }
    }

    fn note_lost(&mut self, key: &Key, clusters: BTreeMap<String, i64>) {
        let note = self.lost.entry(key.clone()).or_default();
        for (c, n) in clusters {
            *note.entry(c).or_default() += n;
        }
    }

    /// Remembers the versions this loop wrote on its way to the last one: their watch
    /// events are not worth planning (the last one's event follows).
    fn wrote(&mut self, key: &Key, mut versions: Vec<String>) {
        if versions.is_empty() {
            self.own.remove(key);
        } else {
            self.own.insert(key.clone(), versions.clone());
        }
        versions.pop();
        if versions.is_empty() {
            self.superseded.remove(key);
        } else {
            self.superseded.insert(key.clone(), versions);
        }
    }
}
