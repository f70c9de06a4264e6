//! The reservations component of a replica, [`Reservations`]: every reservation the replica
//! knows (the [`Table`], own and merged), the per-identity caps reservations are admitted
//! under, the queue of the replica's own reservation writes, and the overcommit resolution
//! of the table over the view ([`Reservations::resolve`], cached in a [`ResolutionCache`]
//! until its inputs change) with each reservation's state and status. See
//! [`crate::reservation_table`] for the record and its lifecycle.
//!
//! The component owns its locks and reaches no other: what it needs of the replica (the
//! view, the estimator, the resolution cache) is handed in by the caller, which holds them.
//! So its table lock is always the last one taken and is released before a method returns
//! (see the lock order in [`crate::state`]), and `caps`, held by [`Reservations::admit`]
//! around the caller's write, is taken before any lock of the replica.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::sync::lock;
use dramesh_api::ApiError;
use dramesh_api::auth::{Caller, Caps, Refusal, RefusalKind};
use dramesh_api::native::{ReservationState, ReservationStatus, WorkloadRef};
use dramesh_estimator::{
    Admission, Assumed, AssumedList, AssumedWorkload, ClusterResolution, ClusterView, Estimator,
    Reservation, View, Workload,
};
use dramesh_model::ObjectChange;

use crate::group_commit::{GroupCommit, Ticket};
use crate::requests::{check_clusters, workload_from_manifests};
use crate::reservation_table::{
    self as resv, ClusterRead, DecisionChanges, Entry, Record, RecordCaps, Table, base_status,
};

/// A reservation this replica writes for itself.
pub(crate) struct Own<'a> {
    /// Who asked for it (an API caller's identity, or the scheduler role's).
    pub(crate) creator: &'a str,
    /// The member cluster.
    pub(crate) cluster: &'a str,
    /// The workload decoded from `manifests`.
    pub(crate) workload: &'a Arc<Workload>,
    /// The manifests other replicas decode the workload from.
    pub(crate) manifests: &'a [String],
    /// Replicas held (1..=[`resv::MAX_REPLICAS`]).
    pub(crate) replicas: i64,
    /// Priority in overcommit resolution.
    pub(crate) priority: i32,
    /// Lifetime (1..=[`resv::MAX_TTL_SECONDS`]).
    pub(crate) ttl_seconds: u64,
    /// The caps it was admitted under, for a reservation made through the API (see
    /// [`resv::Record::caps`]); `None` for the scheduler role's.
    pub(crate) caps: Option<RecordCaps>,
    /// The scheduler decision it holds (see [`resv::Record::decision`]).
    pub(crate) decision: Option<dramesh_scheduler::void::DecisionRef>,
}

/// A live preemption hold (see [`crate::reservation_table::Record::preemptor`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreemptionHold {
    /// The reservation id.
    pub(crate) id: String,
    /// The cluster whose room it holds.
    pub(crate) cluster: String,
    /// Replicas held.
    pub(crate) replicas: i64,
    /// Whether this replica owns it (and may release it).
    pub(crate) own: bool,
}

/// How long another replica's reservation that ranks before ones already resolved may wait
/// to be resolved, when its cluster was resolved out of order less than this ago (the
/// default; the scheduler role sets a fifth of its settle window,
/// [`crate::ReplicaState::set_late_deferral`]).
///
/// Why: reservations rank by creation time, so one made elsewhere a moment ago arrives ranked
/// before what this replica resolved since, and all of that is checked again (one estimate
/// and one first-fit each). Arriving as often as the mesh delivers them, 3 sharing replicas
/// re-resolved a cluster's recent reservations after nearly every arrival. Waiting resolves
/// the late arrivals of one deferral together: at most one re-check of a cluster's recent
/// reservations per deferral.
///
/// What it costs: a late reservation is deducted up to this much later than it arrived, as if
/// the mesh were that much slower; the settle window must cover both. This replica's own
/// reservations never wait, and strict scheduling deducts waiting ones with every other live
/// reservation ([`Reservations::all_live`]).
pub(crate) const LATE_DEFERRAL: Duration = Duration::from_millis(100);

/// What the resolution keeps between calls; it lives beside the estimator it resolves with
/// (the caller's, held with the view), so it is used under the same lock.
#[derive(Debug)]
pub(crate) struct ResolutionCache {
    /// The last resolution; each cluster's part records what it was computed from, so a
    /// change of one cluster's reservations resolves that cluster again, not all of them.
    pub(crate) resolved: Option<Arc<Resolved>>,
    /// Cluster resolutions computed so far (numbers them).
    epochs: u64,
    /// Of those, the ones that only resolved reservations added after all others.
    pub(crate) extended: u64,
    /// Of those, the ones after a view change that checked nothing again (see
    /// [`ClusterResolution`]'s carrying over node changes).
    pub(crate) carried: u64,
    /// How long late reservations of other replicas may wait ([`LATE_DEFERRAL`]).
    pub(crate) deferral: Duration,
    /// Late reservations that waited so far.
    pub(crate) deferred: u64,
}

impl Default for ResolutionCache {
    fn default() -> ResolutionCache {
        ResolutionCache {
            resolved: None,
            epochs: 0,
            extended: 0,
            carried: 0,
            deferral: LATE_DEFERRAL,
            deferred: 0,
        }
    }
}

/// One cluster's part of a resolution, with what it was computed from.
#[derive(Debug, Clone)]
pub(crate) struct ClusterPart {
    /// The number (from [`ResolutionCache::epochs`], so increasing and unique) of
    /// the last resolution of the cluster that changed the outcome or the replicas held of a
    /// reservation resolved before it, or left one out: until it moves, every reservation
    /// resolved before keeps its state (new ones only were added).
    outcome_epoch: u64,
    /// The table's version of the cluster's reservations.
    table_version: u64,
    /// When the first of its live reservations expires: the part is computed again then.
    until: Option<Instant>,
    /// The live reservations it was computed from, in no particular order.
    entries: Vec<Arc<Entry>>,
    /// The resolution of its live reservations whose workloads decode (their replicas
    /// still held are the ranked replicas).
    resolution: ClusterResolution,
    /// Live reservations whose workloads do not decode: conflicted, with their replicas.
    undecodable: BTreeMap<String, (Admission, i64)>,
    /// Reservations past their expiry, not yet deleted.
    expired: BTreeSet<String>,
    /// The admitted reservations as estimator deductions, shared with every estimate.
    assumed: AssumedList,
    /// When the cluster was last resolved other than by extension.
    resolved_at: Instant,
    /// Other replicas' reservations that arrived ranked before ones resolved here, waiting
    /// (at most until `resolved_at` + the deferral, [`LATE_DEFERRAL`]) to be resolved together.
    waiting: Vec<(Arc<Entry>, Reservation)>,
}

impl ClusterPart {
    /// Whether the part holds for `view` of `cluster` at `now`: resolved on this view of
    /// the cluster, none of its reservations expired since, and none waits past the deferral.
    fn current(&self, view: &View, cluster: &str, now: Instant, deferral: Duration) -> bool {
        let stamp = view
            .cluster(cluster)
            .map(ClusterView::stamp)
            .unwrap_or_default();
        self.resolution.stamp() == stamp
            && self.until.is_none_or(|u| now < u)
            && (self.waiting.is_empty() || now < self.resolved_at + deferral)
    }
}

/// One overcommit resolution of the unexpired reservations.
#[derive(Debug, Default, Clone)]
pub(crate) struct Resolved {
    /// By cluster.
    parts: BTreeMap<Arc<str>, Arc<ClusterPart>>,
    assumed: Assumed,
    /// The reservations the cap ranking voided, with why ([`Table::refresh_over_cap`]),
    /// and the void decisions' (`void`): left out of every part.
    over_cap: Arc<BTreeMap<Arc<str>, String>>,
    /// The decisions' reservations the scheduler role judged void, with why
    /// ([`Table::set_void_decisions`]).
    void: Arc<BTreeMap<Arc<str>, String>>,
}

impl Resolved {
    /// The outcome of reservation `e` and the replicas it still holds (`None`: seen after
    /// this resolution).
    fn outcome(&self, e: &Entry) -> Option<(&Admission, i64)> {
        let p = self.parts.get(&*e.cluster)?;
        match p.resolution.get(&e.id, e.record.priority) {
            Some(r) => Some((&r.admission, r.replicas)),
            None => p.undecodable.get(&*e.id).map(|(a, n)| (a, *n)),
        }
    }

    /// Whether reservation `e` had expired.
    fn expired(&self, e: &Entry) -> bool {
        self.parts
            .get(&*e.cluster)
            .is_some_and(|p| p.expired.contains(&*e.id))
    }

    /// Deductions of the admitted reservations, for estimates.
    pub(crate) fn assumed(&self) -> Assumed {
        self.assumed.clone()
    }

    /// Per cluster with live or expired reservations: the epoch of its last resolution
    /// that changed the state of a reservation resolved before (see
    /// [`ClusterPart::outcome_epoch`]): while it stays, no reservation there that was
    /// judged before needs judging again.
    pub(crate) fn outcome_epochs(&self) -> BTreeMap<Arc<str>, u64> {
        self.parts
            .iter()
            .map(|(c, p)| (c.clone(), p.outcome_epoch))
            .collect()
    }
}

/// A reservation's state under one resolution: what the scheduler judges its decisions by,
/// and the core of a status report.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Judged {
    pub(crate) state: ReservationState,
    /// Replicas it still holds.
    pub(crate) remaining: i64,
    /// The reservation that holds the room, when conflicted.
    pub(crate) winner: Option<Arc<str>>,
    /// Why it could not be checked, when conflicted for that.
    pub(crate) reason: Option<String>,
}

/// The reservations a replica knows and writes (see the module docs).
pub(crate) struct Reservations {
    /// This replica's id: the owner of the reservations it writes.
    owner: String,
    /// Every known reservation (own and merged). A leaf lock.
    table: Mutex<Table>,
    /// Per-identity caps of reservations made through the API; held by
    /// [`Reservations::admit`] around checking them and writing the reservation, so that is
    /// one step. Taken before any lock of the replica.
    caps: Mutex<Caps>,
    /// Whether this replica's reservation document could be opened for writing.
    writable: bool,
    /// Writes to this replica's reservation document, queued and made durable together.
    writes: GroupCommit,
}

impl Reservations {
    /// The reservations of replica `owner`, none known yet; `writable`: whether its
    /// reservation document can be written.
    pub(crate) fn new(owner: &str, writable: bool) -> Reservations {
        Reservations {
            owner: owner.to_string(),
            table: Mutex::new(Table::new(owner)),
            caps: Mutex::new(Caps::default()),
            writable,
            writes: GroupCommit::default(),
        }
    }

    /// Runs `f` on the table; private, so `f` can take no lock of the replica.
    fn with_table<R>(&self, f: impl FnOnce(&mut Table) -> R) -> R {
        f(&mut lock(&self.table))
    }

    /// The table, for tests that look inside it.
    #[cfg(test)]
    pub(crate) fn inspect<R>(&self, f: impl FnOnce(&mut Table) -> R) -> R {
        self.with_table(f)
    }

    /// Sets the per-identity caps of reservations created from now on.
    pub(crate) fn set_caps(&self, caps: Caps) {
        *lock(&self.caps) = caps;
    }

    /// `Unavailable` when this replica's reservation document cannot be written.
    pub(crate) fn check_writable(&self) -> Result<(), ApiError> {
        if self.writable {
            Ok(())
        } else {
            Err(ApiError::Unavailable(
                "this replica's reservation document could not be opened for writing".into(),
            ))
        }
    }

    // --- The change feed.

    /// Applies changes of the reservation scope (records of any replica) to the table.
    pub(crate) fn apply(&self, changes: &[&(String, ObjectChange)], now: Instant) {
        // The reservations of one decision share their manifests: decoded once.
        type Decoded = Result<Arc<Workload>, String>;
        let mut decoded: HashMap<Vec<String>, Decoded> = HashMap::new();
        let mut decode = |m: &[String]| {
            if let Some(w) = decoded.get(m) {
                return w.clone();
            }
            let w = workload_from_manifests(m)
                .map(Arc::new)
                .map_err(|e| e.to_string());
            decoded.insert(m.to_vec(), w.clone());
            w
        };
        self.with_table(|table| {
            for (_, change) in changes {
                table.apply(change, now, &mut decode);
            }
        });
    }

    /// Forgets every reservation whose id is not in `keep` (after a rebuild from the store).
    pub(crate) fn retain(&self, keep: &BTreeSet<String>) {
        self.with_table(|t| t.retain(keep));
    }

    /// Replaces the scheduler decisions' reservations judged void (see
    /// [`Table::set_void_decisions`]); true when the set changed.
    pub(crate) fn set_void_decisions(&self, void: BTreeMap<Arc<str>, String>) -> bool {
        self.with_table(|t| t.set_void_decisions(void))
    }

    /// The changes of the reservations holding scheduler decisions since table version
    /// `since` ([`Table::decision_changes`]; one reader).
    pub(crate) fn decision_changes(&self, since: Option<u64>) -> (DecisionChanges, u64) {
        self.with_table(|t| t.decision_changes(since))
    }

    // --- Resolution.

    /// The current overcommit resolution over `view`, resolved with `estimator` from what
    /// `cache` kept (all three held by the caller). Each cluster's part is computed again
    /// only when its reservations, its view generation or the first expiry among them
    /// changed: when reservations were only added, ranking after those resolved before (a
    /// decision's, as a rule), by resolving those alone ([`ClusterResolution::extend`]);
    /// otherwise from its previous part (see [`dramesh_estimator::resolve_cluster`]). The
    /// caller holding `cache` makes resolutions one at a time, each from the last.
    pub(crate) fn resolve(
        &self,
        view: &View,
        estimator: &mut Estimator,
        cache: &mut ResolutionCache,
    ) -> Arc<Resolved> {
        let now = Instant::now();
        // The table is read twice, briefly: versions first, then what changed in the
        // clusters that changed.
        // The cap ranking first: a cluster with a reservation that entered or left it is
        // resolved again whole.
        let (versions, mut over_cap, void, voided): (Vec<(Arc<str>, u64)>, _, _, _) = self
            .with_table(|t| {
                t.refresh_over_cap(now);
                (
                    t.cluster_versions().map(|(c, v)| (c.clone(), v)).collect(),
                    t.over_cap().clone(),
                    t.void_decisions().clone(),
                    t.take_over_cap_changes(),
                )
            });
        // Void decisions are left out as reservations over cap are.
        over_cap.extend(void.iter().map(|(id, why)| (id.clone(), why.clone())));
        // Clusters to resolve again, each with the table version after which only additions
        // need reading (its part's, when that part can be extended); and clusters whose parts
        // are carried to the view as it is.
        let parts = cache.resolved.as_ref().map(|r| &r.parts);
        let stale: Vec<(Arc<str>, Option<u64>)> = versions
            .iter()
            .filter_map(|(c, version)| {
                let Some(p) = parts.and_then(|p| p.get(c)).filter(|_| !voided.contains(c)) else {
                    return Some((c.clone(), None));
                };
                if p.current(view, c, now, cache.deferral) && p.table_version == *version {
                    return None;
                }
                Some((c.clone(), Some(p.table_version)))
            })
            .collect();
        if stale.is_empty()
            && parts.is_some_and(|p| p.len() == versions.len())
            && let Some(r) = cache.resolved.as_ref()
        {
            return r.clone();
        }
        let reads: Vec<(Arc<str>, (u64, ClusterRead))> = self.with_table(|table| {
            stale
                .into_iter()
                .map(|(c, since)| {
                    let read = table.cluster_read(&c, since);
                    (c, read)
                })
                .collect()
        });
        // The last resolution, changed in place when no one else holds it.
        let mut resolved = match cache.resolved.take() {
            Some(r) => Arc::try_unwrap(r).unwrap_or_else(|r| (*r).clone()),
            None => Resolved::default(),
        };
        if *resolved.over_cap != over_cap {
            resolved.over_cap = Arc::new(over_cap);
        }
        if *resolved.void != void {
            resolved.void = Arc::new(void);
        }
        for (cluster, read) in reads {
            let previous = resolved.parts.remove(&cluster);
            let part = resolve_part(
                estimator,
                cache,
                view,
                (&cluster, &self.owner),
                previous,
                read,
                (now, &resolved.over_cap),
            );
            resolved.assumed.set(&cluster, part.assumed.clone());
            resolved.parts.insert(cluster, part);
        }
        let known: BTreeSet<&str> = versions.iter().map(|(c, _)| &**c).collect();
        let gone: Vec<Arc<str>> = resolved
            .parts
            .keys()
            .filter(|c| !known.contains(&***c))
            .cloned()
            .collect();
        for c in gone {
            resolved.parts.remove(&c);
            resolved.assumed.set(&c, Vec::new().into());
        }
        let resolved = Arc::new(resolved);
        cache.resolved = Some(resolved.clone());
        resolved
    }

    /// [`Resolved::assumed`] for a decision of the binding `b`: of each preemption hold
    /// written for it, only the replicas `b` has assigned on the hold's cluster are deducted
    /// (the decision counts those as the binding's own again); the rest of the room the hold
    /// keeps is `b`'s to take. Every other admitted reservation is deducted, ranked as
    /// resolution `res` ranked it.
    pub(crate) fn assumed_for(&self, res: &Resolved, b: &dramesh_scheduler::Binding) -> Assumed {
        let holds = self.preemption_holds(&b.id());
        let mut assumed = res.assumed.clone();
        let clusters: BTreeSet<&str> = holds.iter().map(|h| h.cluster.as_str()).collect();
        for cluster in clusters {
            let Some(part) = res.parts.get(cluster) else {
                continue;
            };
            let r = &part.resolution;
            let list: Vec<Arc<AssumedWorkload>> = r
                .assumed
                .iter()
                .zip(r.assumed_ids())
                .filter_map(|(a, id)| {
                    if !holds.iter().any(|h| *h.id == **id) {
                        return Some(a.clone());
                    }
                    let used = a.replicas.min(b.assigned(cluster));
                    (used > 0).then(|| {
                        Arc::new(AssumedWorkload {
                            replicas: used,
                            ..(**a).clone()
                        })
                    })
                })
                .collect();
            assumed.set(cluster, list.into());
        }
        assumed
    }

    /// Deductions of every live reservation of `res`, admitted or not (strict scheduling
    /// places around all of them; see [`crate::quorum`]), in rank order, of cluster `only`
    /// (all when `None`), leaving out the reservations `except` and the preemption holds
    /// written for the binding `holds_of`.
    pub(crate) fn all_live(
        &self,
        res: &Resolved,
        only: Option<&str>,
        holds_of: Option<&str>,
        except: &[&str],
    ) -> Assumed {
        let holds = holds_of
            .map(|b| self.preemption_holds(b))
            .unwrap_or_default();
        let mut assumed = Assumed::default();
        for (cluster, part) in &res.parts {
            if only.is_some_and(|o| o != &**cluster) {
                continue;
            }
            let workloads: HashMap<&str, &Arc<Workload>> = part
                .entries
                .iter()
                .filter_map(|e| e.workload.as_ref().ok().map(|w| (&*e.id, w)))
                .collect();
            let keep = |id: &str, replicas: i64| {
                replicas > 0 && !except.contains(&id) && !holds.iter().any(|h| h.id == id)
            };
            // Waiting reservations are live too.
            let list: Vec<Arc<AssumedWorkload>> = part
                .resolution
                .ranked
                .iter()
                .filter(|r| keep(&r.id, r.replicas))
                .filter_map(|r| {
                    workloads
                        .get(&*r.id)
                        .map(|w| Arc::new(AssumedWorkload::from_shared(cluster, w, r.replicas)))
                })
                .chain(
                    part.waiting
                        .iter()
                        .filter(|(_, r)| keep(&r.id, r.replicas))
                        .map(|(_, r)| {
                            Arc::new(AssumedWorkload::from_shared(
                                cluster,
                                &r.workload,
                                r.replicas,
                            ))
                        }),
                )
                .collect();
            assumed.set(cluster, list.into());
        }
        assumed
    }

    /// Whether each reservation of `held` (id, cluster) still fits in its cluster with every
    /// other live reservation of `res` deducted, whatever their rank (strict scheduling's
    /// judgement, see [`crate::quorum`]); `Err` names the first that does not, or is not live.
    pub(crate) fn fits_against_all_live(
        &self,
        res: &Resolved,
        view: &View,
        estimator: &mut Estimator,
        held: &[(&str, &str)],
    ) -> Result<(), String> {
        for (id, cluster) in held {
            let part = res
                .parts
                .get(*cluster)
                .ok_or_else(|| format!("reservation {id}: no live reservation in {cluster}"))?;
            let entry = part
                .entries
                .iter()
                .chain(part.waiting.iter().map(|(e, _)| e))
                .find(|e| &*e.id == *id)
                .ok_or_else(|| format!("reservation {id} is no longer live"))?;
            let w = entry
                .workload
                .as_ref()
                .map_err(|e| format!("reservation {id}: {e}"))?;
            let replicas = part
                .resolution
                .ranked
                .iter()
                .find(|r| &*r.id == *id)
                .map_or(entry.record.replicas, |r| r.replicas);
            if replicas <= 0 {
                continue;
            }
            let opts = dramesh_estimator::EstimateOptions {
                assumed: self.all_live(res, Some(cluster), None, &[id]),
                clusters: vec![cluster.to_string()],
                ..Default::default()
            };
            let est = estimator.estimate(view, w, &opts);
            let fit = est
                .cluster(cluster)
                .filter(|c| c.error.is_none())
                .map_or(0, |c| c.max_replicas);
            if fit < replicas {
                return Err(format!(
                    "reservation {id} holds {replicas} replica(s) in {cluster}, where {fit} fit with every other live reservation deducted"
                ));
            }
        }
        Ok(())
    }

    /// The unexpired preemption holds written for the binding `preemptor` (`Binding::id`),
    /// by any replica, ordered by id.
    pub(crate) fn preemption_holds(&self, preemptor: &str) -> Vec<PreemptionHold> {
        let now = Instant::now();
        self.with_table(|table| {
            table
                .holds_for(preemptor)
                .filter(|e| now < table.expiry(e))
                .map(|e| PreemptionHold {
                    id: e.record.id.clone(),
                    cluster: e.record.cluster.clone(),
                    replicas: e.record.replicas,
                    own: e.record.owner == self.owner,
                })
                .collect()
        })
    }

    /// The states of reservations `ids` under resolution `res` (those this replica does not
    /// know, or knows only as ended, are left out).
    pub(crate) fn states<'a>(
        &self,
        res: &Resolved,
        ids: impl IntoIterator<Item = &'a String>,
    ) -> HashMap<&'a str, Judged> {
        let now = Instant::now();
        self.with_table(|table| {
            ids.into_iter()
                .filter_map(|id| {
                    let e = table.get(id)?;
                    Some((id.as_str(), judged(table, e, res, now)))
                })
                .collect()
        })
    }

    /// One reservation's status under resolution `res`.
    pub(crate) fn status(&self, res: &Resolved, id: &str) -> Option<ReservationStatus> {
        self.with_table(|table| status_in(table, id, res, Instant::now()))
    }

    /// Every known reservation under resolution `res` (ended ones included when
    /// `with_ended`), ordered by id.
    pub(crate) fn list(&self, res: &Resolved, with_ended: bool) -> Vec<ReservationStatus> {
        let now = Instant::now();
        let (ids, ended): (Vec<String>, Vec<ReservationStatus>) = self.with_table(|table| {
            let ids = table.entries().map(|(id, _)| id.clone()).collect();
            let ended = if with_ended {
                table.ended_all().cloned().collect()
            } else {
                Vec::new()
            };
            (ids, ended)
        });
        let mut out: BTreeMap<String, ReservationStatus> =
            ended.into_iter().map(|s| (s.id.clone(), s)).collect();
        self.with_table(|table| {
            for id in ids {
                if let Some(s) = status_in(table, &id, res, now) {
                    out.insert(id, s);
                }
            }
        });
        out.into_values().collect()
    }

    /// The owner's housekeeping under resolution `res`: how each own reservation whose TTL
    /// passed, whose replicas are all bound, or that the cap ranking voids (it ends
    /// conflicted, with the reason) or whose decision is void ends; they are to be deleted.
    pub(crate) fn to_sweep(&self, res: &Resolved) -> Vec<ReservationStatus> {
        let now = Instant::now();
        self.with_table(|table| {
            table
                .entries()
                .filter(|(_, e)| e.record.owner == self.owner)
                .filter_map(|(_, e)| {
                    if now >= table.expiry(e) {
                        Some(base_status(&e.record, ReservationState::Expired))
                    } else if let Some(reason) = res.void.get(&*e.id) {
                        Some(resv::void_status(&e.record, Some(reason)))
                    } else if let Some(reason) = res.over_cap.get(&*e.id) {
                        Some(resv::over_cap_status(&e.record, reason))
                    } else if res.outcome(e).is_some_and(|(_, left)| left == 0) {
                        Some(base_status(&e.record, ReservationState::Satisfied))
                    } else {
                        None
                    }
                })
                .collect()
        })
    }

    // --- This replica's own reservations.

    /// Admits a reservation through the API for `caller` (`replicas` replicas, `bytes`
    /// manifest bytes, `ttl_seconds`) within the caps, and runs `write` with the caps it was
    /// admitted under; the caps stay locked until `write` returns, so no other admission
    /// checks them in between. Counts every live reservation `caller` created through the
    /// API that the cap ranking does not void, on any replica, this replica's own queued
    /// writes included (they enter the table before they are written).
    pub(crate) fn admit<R>(
        &self,
        caller: &Caller,
        (replicas, bytes, ttl_seconds): (i64, usize, u64),
        write: impl FnOnce(RecordCaps) -> Result<R, ApiError>,
    ) -> Result<R, ApiError> {
        let caps: MutexGuard<'_, Caps> = lock(&self.caps);
        self.check_caps(&caps, caller, replicas, bytes, ttl_seconds)?;
        write((&*caps).into())
    }

    /// Refuses a reservation that would take `caller` over one of `caps`.
    fn check_caps(
        &self,
        caps: &Caps,
        caller: &Caller,
        replicas: i64,
        bytes: usize,
        ttl_seconds: u64,
    ) -> Result<(), ApiError> {
        let user = &caller.identity.user;
        let now = Instant::now();
        let (count, held, held_bytes) = self.with_table(|table| {
            table.refresh_over_cap(now);
            table.held_by(user, now)
        });
        let over = |reason: &'static str, message: String| {
            Err(ApiError::Refused(Refusal {
                kind: RefusalKind::OverCap,
                reason,
                identity: user.clone(),
                message,
            }))
        };
        if ttl_seconds > caps.max_ttl.as_secs() {
            return over(
                "cap_ttl",
                format!(
                    "{user}: reservation ttlSeconds {ttl_seconds} is over the cap of {} s per reservation",
                    caps.max_ttl.as_secs()
                ),
            );
        }
        if count >= caps.max_reservations {
            return over(
                "cap_reservations",
                format!(
                    "{user} holds {count} live reservations, the cap of live reservations per identity is {}",
                    caps.max_reservations
                ),
            );
        }
        if held.saturating_add(replicas) > caps.max_reserved_replicas {
            return over(
                "cap_replicas",
                format!(
                    "{user} holds {held} reserved replicas; {replicas} more would exceed the cap of reserved replicas per identity, {}",
                    caps.max_reserved_replicas
                ),
            );
        }
        if held_bytes.saturating_add(bytes) > caps.max_manifest_bytes {
            return over(
                "cap_manifest_bytes",
                format!(
                    "{user} holds {held_bytes} bytes of reserved workload manifests; {bytes} more would exceed the cap of manifest bytes per identity, {}",
                    caps.max_manifest_bytes
                ),
            );
        }
        Ok(())
    }

    /// Adds reservations owned by this replica (preemption holds of `preemptor` when given)
    /// to the table at once, so every resolution from now on counts them, and queues them
    /// for the reservation document as one change; returns their ids in order and the
    /// ticket that [`Reservations::wait`] makes them durable with (nothing may act on them
    /// outside this replica before). `view` (held by the caller) gives the pods of each
    /// workload bound at creation. Nothing is queued when one of them is refused.
    pub(crate) fn queue_own(
        &self,
        all: &[Own<'_>],
        preemptor: Option<&str>,
        view: &View,
    ) -> Result<(Vec<String>, Ticket), ApiError> {
        self.check_writable()?;
        let workloads: Vec<WorkloadRef> = all
            .iter()
            .map(|r| WorkloadRef {
                namespace: r.workload.namespace.clone(),
                kind: r.workload.kind.clone(),
                name: r.workload.name.clone(),
            })
            .collect();
        let mut bound = Vec::with_capacity(all.len());
        for (r, w) in all.iter().zip(&workloads) {
            check_clusters(view, &[r.cluster.to_string()])?;
            let key = dramesh_estimator::owner_key(&w.namespace, &w.kind, &w.name);
            bound.push(view.cluster(r.cluster).map_or(0, |c| c.bound_pods(&key)));
        }
        let ids: Vec<String> = self.with_table(|t| all.iter().map(|_| t.next_id()).collect());
        let mut changes = Vec::with_capacity(all.len());
        let mut records = Vec::with_capacity(all.len());
        for (((r, workload), bound_at_creation), id) in
            all.iter().zip(workloads).zip(bound).zip(&ids)
        {
            let record = Record {
                id: id.clone(),
                owner: self.owner.clone(),
                creator: r.creator.to_string(),
                cluster: r.cluster.to_string(),
                workload,
                manifests: r.manifests.to_vec(),
                replicas: r.replicas,
                priority: r.priority,
                ttl_seconds: r.ttl_seconds,
                bound_at_creation,
                preemptor: preemptor.map(str::to_string),
                caps: r.caps,
                decision: r.decision.clone(),
            };
            let json = serde_json::to_vec(&record)
                .map_err(|e| ApiError::Internal(format!("encoding reservation {id}: {e}")))?;
            if json.len() > resv::MAX_RECORD_BYTES {
                return Err(ApiError::InvalidRequest(format!(
                    "reservation: the workload manifests make a record of {} bytes, more than {}",
                    json.len(),
                    resv::MAX_RECORD_BYTES
                )));
            }
            let json: Arc<[u8]> = Arc::from(json.as_slice());
            changes.push(ObjectChange::Upsert {
                key: resv::record_key(id),
                json: json.clone(),
            });
            records.push((record, json, r.workload.clone()));
        }
        let now = Instant::now();
        self.with_table(|t| {
            for (record, json, workload) in records {
                tracing::debug!(id = %record.id, cluster = %record.cluster, replicas = record.replicas, creator = %record.creator, "reservation written");
                t.insert_own(record, json, workload, now);
            }
        });
        Ok((ids, self.writes.submit(changes)))
    }

    /// Queues `changes` for this replica's reservation document (see
    /// [`crate::group_commit`]).
    pub(crate) fn submit(&self, changes: Vec<ObjectChange>) -> Ticket {
        self.writes.submit(changes)
    }

    /// Blocks until the changes of `ticket` are durable, writing queued batches with `write`
    /// while no other waiter does. The records of a failed batch were never visible outside
    /// this replica and are forgotten here too.
    pub(crate) fn wait(
        &self,
        ticket: Ticket,
        write: &mut dyn FnMut(Vec<ObjectChange>) -> Result<(), String>,
    ) -> Result<(), ApiError> {
        self.writes
            .wait(ticket, &mut |batch| {
                let upserts: Vec<String> = batch
                    .iter()
                    .filter(|c| matches!(c, ObjectChange::Upsert { .. }))
                    .map(|c| c.key().name.clone())
                    .collect();
                let written = write(batch);
                if written.is_err() {
                    self.with_table(|t| upserts.iter().for_each(|id| t.forget_unwritten(id)));
                }
                written
            })
            .map_err(|e| ApiError::Internal(format!("writing the reservation document: {e}")))
    }

    /// How the live reservation `id` ends when ended as `how`; `None` when it is not live.
    pub(crate) fn ending(&self, id: &str, how: ReservationState) -> Option<ReservationStatus> {
        self.with_table(|t| t.get(id).map(|e| base_status(&e.record, how)))
    }

    /// Ends the live reservation `status.id` here, remembering it as `status`; false when it
    /// is not live (nothing to delete).
    pub(crate) fn end(&self, status: ReservationStatus) -> bool {
        self.with_table(|table| {
            if table.get(&status.id).is_none() {
                return false;
            }
            table.end(status);
            true
        })
    }

    /// The owner and creator of the live reservation `id`, or else (`None`) how it ended, if
    /// known.
    pub(crate) fn owner_and_creator(
        &self,
        id: &str,
    ) -> (Option<(String, String)>, Option<ReservationStatus>) {
        self.with_table(|table| match table.get(id) {
            Some(e) => (
                Some((e.record.owner.clone(), e.record.creator.clone())),
                None,
            ),
            None => (None, table.ended(id).cloned()),
        })
    }
}

/// Resolves cluster `cluster` again after its reservations changed (`read` from the table:
/// its version, and all of them or the ones added since `previous`), its view changed, or
/// one of them expired.
fn resolve_part(
    estimator: &mut Estimator,
    cache: &mut ResolutionCache,
    view: &dramesh_estimator::View,
    (cluster, owner): (&Arc<str>, &str),
    previous: Option<Arc<ClusterPart>>,
    (version, read): (u64, ClusterRead),
    (now, over_cap): (Instant, &BTreeMap<Arc<str>, String>),
) -> Arc<ClusterPart> {
    let cv = view.cluster(cluster);
    let (previous, all) = match (read, previous) {
        (ClusterRead::Added(mut added), Some(mut p)) => {
            // Void reservations hold nothing (their clusters are read whole when that changes).
            added.retain(|e| !over_cap.contains_key(&*e.id));
            if p.current(view, cluster, now, cache.deferral) {
                let more: Result<Vec<Reservation>, _> =
                    added.iter().map(|e| reservation(cv, cluster, e)).collect();
                if let Ok(more) = more {
                    let part = Arc::make_mut(&mut p);
                    // Other replicas' reservations ranked before resolved ones wait while the
                    // cluster was resolved out of order less than the deferral ago.
                    let wait = now < part.resolved_at + cache.deferral;
                    let (late, mut on): (Vec<_>, Vec<_>) =
                        added.into_iter().zip(more).partition(|(e, r)| {
                            wait && e.record.owner != owner && !part.resolution.ranks_after_all(r)
                        });
                    // New reservations that rank after every one resolved: resolved alone.
                    on.sort_by(|a, b| dramesh_estimator::rank_cmp(&a.1, &b.1));
                    let (on, more): (Vec<Arc<Entry>>, Vec<Reservation>) = on.into_iter().unzip();
                    let admitted = part.resolution.assumed.len();
                    if part
                        .resolution
                        .extend(view, estimator, cluster, &more)
                        .is_ok()
                    {
                        if part.resolution.assumed.len() != admitted {
                            part.assumed = part.resolution.assumed.clone().into();
                        }
                        for e in &on {
                            part.until = Some(part.until.map_or(e.expiry, |u| u.min(e.expiry)));
                        }
                        part.entries.extend(on);
                        cache.deferred += late.len() as u64;
                        part.waiting.extend(late);
                        part.table_version = version;
                        cache.extended += 1;
                        return p;
                    }
                    added = on
                        .into_iter()
                        .chain(late.into_iter().map(|(e, _)| e))
                        .collect();
                }
            }
            let mut all = p.entries.clone();
            all.extend(added);
            all.extend(p.waiting.iter().map(|(e, _)| e.clone()));
            (Some(p), all)
        }
        (ClusterRead::Added(added), None) => (None, added),
        (ClusterRead::All(all), p) => (p, all),
    };
    let mut expired = previous
        .as_ref()
        .map(|p| p.expired.clone())
        .unwrap_or_default();
    let mut until: Option<Instant> = None;
    let mut entries = Vec::with_capacity(all.len());
    for e in all {
        if now >= e.expiry {
            expired.insert(e.record.id.clone());
        } else if over_cap.contains_key(&*e.id) {
            // Void by the cap ranking: holds nothing.
            continue;
        } else {
            until = Some(until.map_or(e.expiry, |u| u.min(e.expiry)));
            entries.push(e);
        }
    }
    let mut undecodable = BTreeMap::new();
    let mut input = Vec::with_capacity(entries.len());
    for e in &entries {
        match reservation(cv, cluster, e) {
            Ok(r) => input.push(r),
            Err(u) => {
                undecodable.insert(e.record.id.clone(), u);
            }
        }
    }
    // Resolved from the previous part, which `resolve_cluster` carries to the view as it
    // is as far as that is exact.
    let resolution = dramesh_estimator::resolve_cluster(
        view,
        estimator,
        cluster,
        &input,
        previous.as_deref().map(|p| &p.resolution),
    );
    if let Some(p) = previous.as_deref()
        && p.resolution.stamp() != resolution.stamp()
        && !p.resolution.ranked.is_empty()
        && resolution.reused() == p.resolution.ranked.len()
    {
        cache.carried += 1;
    }
    let assumed = resolution.assumed.clone().into();
    cache.epochs += 1;
    let outcome_epoch = match previous.as_deref() {
        Some(p) if !outcomes_changed(p, &resolution, &undecodable) => p.outcome_epoch,
        _ => cache.epochs,
    };
    Arc::new(ClusterPart {
        outcome_epoch,
        table_version: version,
        until,
        entries,
        resolution,
        undecodable,
        expired,
        assumed,
        resolved_at: now,
        waiting: Vec::new(),
    })
}

/// The live reservation `e` of `cluster` as resolution takes it: with the replicas it still
/// holds (those the cluster reports bound since it was written are no longer held), or, when
/// its workload does not decode, its conflicted outcome and replicas.
fn reservation(
    cv: Option<&dramesh_estimator::ClusterView>,
    cluster: &Arc<str>,
    e: &Entry,
) -> Result<Reservation, (Admission, i64)> {
    let bound = cv.map_or(0, |c| c.bound_pods(&e.owner_key));
    let left = (e.record.replicas - (bound - e.record.bound_at_creation).max(0)).max(0);
    match &e.workload {
        Ok(w) => Ok(Reservation {
            id: e.id.clone(),
            cluster: cluster.clone(),
            priority: e.record.priority,
            replicas: left,
            workload: w.clone(),
        }),
        Err(err) => Err((
            Admission::Conflicted {
                winner: None,
                available: 0,
                reason: Some(format!("workload manifests: {err}")),
            },
            left,
        )),
    }
}

/// Whether a reservation of `previous` is missing from the new resolution (`now`,
/// `undecodable`) or has another outcome or replica count there.
fn outcomes_changed(
    previous: &ClusterPart,
    now: &ClusterResolution,
    undecodable: &BTreeMap<String, (Admission, i64)>,
) -> bool {
    if previous.undecodable != *undecodable {
        return true;
    }
    // Resolution keeps the ranking's unchanged prefix as it was (the same shared ids).
    let old = &previous.resolution.ranked;
    let kept = old
        .iter()
        .zip(&now.ranked)
        .take_while(|(a, b)| Arc::ptr_eq(&a.id, &b.id) && a == b)
        .count();
    old[kept..]
        .iter()
        .any(|a| now.get(&a.id, a.priority) != Some(a))
}

/// The state of the live reservation `e` of `table` under the resolution `res`.
fn judged(table: &Table, e: &Entry, res: &Resolved, now: Instant) -> Judged {
    let outcome = res.outcome(e);
    let mut j = Judged {
        state: ReservationState::Live,
        remaining: outcome.map_or(e.record.replicas, |(_, left)| left),
        winner: None,
        reason: None,
    };
    if res.expired(e) || now >= table.expiry(e) {
        j.state = ReservationState::Expired;
        j.remaining = 0;
        return j;
    }
    if let Some(reason) = res.void.get(&*e.id) {
        j.state = ReservationState::Released;
        j.remaining = 0;
        j.reason = Some(reason.clone());
        return j;
    }
    if let Some(reason) = res.over_cap.get(&*e.id) {
        j.state = ReservationState::Conflicted;
        j.remaining = 0;
        j.reason = Some(reason.clone());
        return j;
    }
    match outcome.map(|(a, _)| a) {
        Some(Admission::Admitted) if j.remaining == 0 => j.state = ReservationState::Satisfied,
        Some(Admission::Admitted) => {}
        Some(Admission::Conflicted { winner, reason, .. }) => {
            j.state = ReservationState::Conflicted;
            j.winner = winner.clone();
            j.reason = reason.clone();
        }
        // Seen after the resolution was computed: not yet decided.
        None => {}
    }
    j
}

/// The status of reservation `id` in `table` under the resolution `res`.
fn status_in(table: &Table, id: &str, res: &Resolved, now: Instant) -> Option<ReservationStatus> {
    let Some(e) = table.get(id) else {
        return table.ended(id).cloned();
    };
    let j = judged(table, e, res, now);
    let mut st = base_status(&e.record, j.state);
    st.remaining = j.remaining;
    if j.state != ReservationState::Expired {
        st.expires_in_seconds = Some(table.expiry(e).saturating_duration_since(now).as_secs_f64());
    }
    st.winner = j.winner.map(|w| w.to_string());
    st.reason = j.reason;
    Some(st)
}
