//! This replica's side of reservations: overcommit resolution over the reservation table and
//! the view (cached until its inputs change), reservation status, and writing, releasing and
//! sweeping this replica's own reservations (see [`crate::reservations`] for the record and
//! its lifecycle).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use dramesh_api::ApiError;
use dramesh_api::auth::{Caller, Caps, Refusal, RefusalKind};
use dramesh_api::native::{ReservationState, ReservationStatus, ReserveRequest, WorkloadRef};
use dramesh_estimator::{
    Admission, Assumed, AssumedList, AssumedWorkload, ClusterResolution, Reservation, Workload,
};
use dramesh_model::ObjectChange;

use crate::group_commit::Ticket;
use crate::requests::workload_from_manifests;
use crate::reservations::{self as resv, ClusterRead, Record};
use crate::state::{ReplicaState, check_clusters};
use crate::sync::lock;

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
    pub(crate) caps: Option<resv::RecordCaps>,
    /// The scheduler decision it holds (see [`resv::Record::decision`]).
    pub(crate) decision: Option<dramesh_scheduler::void::DecisionRef>,
}

/// A live preemption hold (see [`crate::reservations::Record::preemptor`]).
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

/// One cluster's part of a resolution, with what it was computed from.
#[derive(Debug, Clone)]
pub(crate) struct ClusterPart {
    /// The number (from [`crate::state::Compute::epochs`], so increasing and unique) of
    /// the last resolution of the cluster that changed the outcome or the replicas held of a
    /// reservation resolved before it, or left one out: until it moves, every reservation
    /// resolved before keeps its state (new ones only were added).
    outcome_epoch: u64,
    /// The table's version of the cluster's reservations.
    table_version: u64,
    /// The cluster's view generation.
    view_gen: u64,
    /// When the first of its live reservations expires: the part is computed again then.
    until: Option<Instant>,
    /// The live reservations it was computed from, in no particular order.
    entries: Vec<Arc<resv::Entry>>,
    /// The resolution of its live reservations whose workloads decode (their replicas
    /// still held are the ranked replicas).
    resolution: ClusterResolution,
    /// Live reservations whose workloads do not decode: conflicted, with their replicas.
    undecodable: BTreeMap<String, (Admission, i64)>,
    /// Reservations past their expiry, not yet deleted.
    expired: BTreeSet<String>,
    /// The admitted reservations as estimator deductions, shared with every estimate.
    assumed: AssumedList,
}

/// One overcommit resolution of the unexpired reservations.
#[derive(Debug, Default, Clone)]
pub(crate) struct Resolved {
    /// By cluster.
    parts: BTreeMap<Arc<str>, Arc<ClusterPart>>,
    assumed: Assumed,
    /// The reservations the cap ranking voided, with why ([`resv::Table::refresh_over_cap`]),
    /// and the void decisions' (`void`): left out of every part.
    over_cap: Arc<BTreeMap<Arc<str>, String>>,
    /// The decisions' reservations the scheduler role judged void, with why
    /// ([`resv::Table::set_void_decisions`]).
    void: Arc<BTreeMap<Arc<str>, String>>,
}

impl Resolved {
    /// The outcome of reservation `e` and the replicas it still holds (`None`: seen after
    /// this resolution).
    fn outcome(&self, e: &resv::Entry) -> Option<(&Admission, i64)> {
        let p = self.parts.get(&*e.cluster)?;
        match p.resolution.get(&e.id, e.record.priority) {
            Some(r) => Some((&r.admission, r.replicas)),
            None => p.undecodable.get(&*e.id).map(|(a, n)| (a, *n)),
        }
    }

    /// Whether reservation `e` had expired.
    fn expired(&self, e: &resv::Entry) -> bool {
        self.parts
            .get(&*e.cluster)
            .is_some_and(|p| p.expired.contains(&*e.id))
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

impl ReplicaState {
    /// The current overcommit resolution. Each cluster's part is computed again only when
    /// its reservations, its view generation or the first expiry among them changed: when
    /// reservations were only added, ranking after those resolved before (a decision's, as a
    /// rule), by resolving those alone ([`ClusterResolution::extend`]); otherwise from its
    /// previous part (see [`dramesh_estimator::resolve_cluster`]). Resolutions are made one
    /// at a time.
    fn resolution(&self) -> Arc<Resolved> {
        let _one_at_a_time = lock(&self.resolving);
        let now = Instant::now();
        // The table (lock 3) is not taken with the indexes (lock 4) held: versions first,
        // then what changed in the clusters that changed.
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
        // need reading (its part's, when that part can be extended).
        let stale: Vec<(Arc<str>, Option<u64>)> = {
            let indexes = self.indexes();
            let view = &indexes.view;
            let compute = self.compute(&indexes);
            let parts = compute.resolved.as_ref().map(|r| &r.parts);
            let stale: Vec<(Arc<str>, Option<u64>)> = versions
                .iter()
                .filter_map(|(c, version)| {
                    let Some(p) = parts.and_then(|p| p.get(c)).filter(|_| !voided.contains(c))
                    else {
                        return Some((c.clone(), None));
                    };
                    let view_gen = view.cluster(c).map_or(0, |v| v.generation());
                    let current = p.view_gen == view_gen && p.until.is_none_or(|u| now < u);
                    if current && p.table_version == *version {
                        return None;
                    }
                    Some((c.clone(), Some(p.table_version)))
                })
                .collect();
            if stale.is_empty()
                && parts.is_some_and(|p| p.len() == versions.len())
                && let Some(r) = compute.resolved.as_ref()
            {
                return r.clone();
            }
            stale
        };
        let reads: Vec<(Arc<str>, (u64, ClusterRead))> = self.with_table(|table| {
            stale
                .into_iter()
                .map(|(c, since)| {
                    let read = table.cluster_read(&c, since);
                    (c, read)
                })
                .collect()
        });
        let indexes = self.indexes();
        let view = &indexes.view;
        let mut compute = self.compute(&indexes);
        let compute = &mut *compute;
        // The last resolution, changed in place when no one else holds it.
        let mut resolved = match compute.resolved.take() {
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
                compute,
                view,
                &cluster,
                previous,
                read,
                (now, &resolved.over_cap),
            );
            resolved.assumed.set(&cluster, part.assumed.clone());
            resolved.parts.insert(cluster, part);
        }
        let known: BTreeSet<&str> = versions.iter().map(|(c, _)| &**c).collect();
        compute.bound.retain(|c| known.contains(c));
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
        compute.resolved = Some(resolved.clone());
        resolved
    }

    /// Per cluster with live or expired reservations: the epoch of its last resolution
    /// that changed the state of a reservation resolved before (see
    /// [`ClusterPart::outcome_epoch`]): while it stays, no reservation there that was
    /// judged before needs judging again. Blocking (it resolves): call it off the async
    /// reactor.
    pub(crate) fn outcome_epochs(&self) -> BTreeMap<Arc<str>, u64> {
        let res = self.resolution();
        res.parts
            .iter()
            .map(|(c, p)| (c.clone(), p.outcome_epoch))
            .collect()
    }

    /// Deductions of the admitted reservations, for estimates.
    pub(crate) fn reserved(&self) -> Assumed {
        self.resolution().assumed.clone()
    }

    /// [`ReplicaState::reserved`] for a decision of the binding `b`: of each preemption hold
    /// written for it, only the replicas `b` has assigned on the hold's cluster are deducted
    /// (the decision counts those as the binding's own again); the rest of the room the hold
    /// keeps is `b`'s to take. Every other admitted reservation is deducted, ranked as
    /// resolution ranked it.
    pub(crate) fn reserved_for(&self, b: &dramesh_scheduler::Binding) -> Assumed {
        let res = self.resolution();
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
                    own: e.record.owner == self.replica,
                })
                .collect()
        })
    }

    /// The states of reservations `ids` on this replica, from one resolution (those it does
    /// not know, or knows only as ended, are left out).
    pub(crate) fn reservation_states<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a String>,
    ) -> HashMap<&'a str, Judged> {
        let res = self.resolution();
        let now = Instant::now();
        self.with_table(|table| {
            ids.into_iter()
                .filter_map(|id| {
                    let e = table.get(id)?;
                    Some((id.as_str(), judged(table, e, &res, now)))
                })
                .collect()
        })
    }

    /// One reservation's state on this replica.
    pub fn reservation_status(&self, id: &str) -> Option<ReservationStatus> {
        let res = self.resolution();
        self.with_table(|table| status_in(table, id, &res, Instant::now()))
    }

    /// Every known reservation (ended ones included when `with_ended`), ordered by id.
    pub fn reservation_list(&self, with_ended: bool) -> Vec<ReservationStatus> {
        let res = self.resolution();
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
                if let Some(s) = status_in(table, &id, &res, now) {
                    out.insert(id, s);
                }
            }
        });
        out.into_values().collect()
    }

    /// Writes changes to this replica's reservation document and applies them here; returns
    /// once they are durable (written with whatever else was queued: see
    /// [`crate::group_commit`]).
    fn write_reservations(&self, changes: Vec<ObjectChange>) -> Result<(), ApiError> {
        self.check_writable()?;
        let ticket = self.own_writes.submit(changes);
        self.wait_written(ticket)
    }

    fn check_writable(&self) -> Result<(), ApiError> {
        if self.reservations_writable {
            Ok(())
        } else {
            Err(ApiError::Unavailable(
                "this replica's reservation document could not be opened for writing".into(),
            ))
        }
    }

    /// Blocks until the reservation changes of `ticket` are durable in this replica's
    /// document (and offered to the mesh). Those of a failed write were never visible
    /// outside this replica and are forgotten here too.
    pub(crate) fn wait_written(&self, ticket: Ticket) -> Result<(), ApiError> {
        self.own_writes
            .wait(ticket, &mut |batch| self.write_batch(batch))
            .map_err(|e| ApiError::Internal(format!("writing the reservation document: {e}")))
    }

    /// Writes one batch of queued changes to the reservation document (one commit, one
    /// fsync) and applies the result here.
    fn write_batch(&self, batch: Vec<ObjectChange>) -> Result<(), String> {
        let upserts: Vec<String> = batch
            .iter()
            .filter(|c| matches!(c, ObjectChange::Upsert { .. }))
            .map(|c| c.key().name.clone())
            .collect();
        let written = self.with_feed(|| {
            let outcome = self
                .with_store(|s| s.apply(&resv::doc_id(&self.replica), batch))
                .map_err(|e| e.to_string())?;
            self.apply_changes(&outcome.view);
            Ok(())
        });
        match written {
            Ok(()) => self.own_docs_changed.notify_one(),
            Err(_) => self.with_table(|t| upserts.iter().for_each(|id| t.forget_unwritten(id))),
        }
        written
    }

    /// Refuses a reservation of `bytes` manifest bytes for `replicas` replicas and `ttl_seconds`
    /// that would take `caller` over one of its caps; counts every live reservation it
    /// created through the API that the cap ranking does not void, on any replica, this
    /// replica's own queued writes included (they enter the table before they are written).
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

    /// Writes a reservation owned by this replica (no caps: the caller checked them, or is
    /// the replica's own scheduler role); returns its id once it is durable.
    pub(crate) fn write_own(&self, r: &Own<'_>) -> Result<String, ApiError> {
        let (mut ids, ticket) = self.queue_own_all(std::slice::from_ref(r), None)?;
        self.wait_written(ticket)?;
        ids.pop()
            .ok_or_else(|| ApiError::Internal("no reservation id was assigned".into()))
    }

    /// Writes the scheduler role's preemption hold for the binding `preemptor`
    /// (`Binding::id`): a reservation like [`ReplicaState::write_own`]'s that decisions of
    /// that binding leave out ([`ReplicaState::reserved_for`]); returns its id once durable.
    pub(crate) fn write_preemption_hold(
        &self,
        r: &Own<'_>,
        preemptor: &str,
    ) -> Result<String, ApiError> {
        let (mut ids, ticket) = self.queue_own_all(std::slice::from_ref(r), Some(preemptor))?;
        self.wait_written(ticket)?;
        ids.pop()
            .ok_or_else(|| ApiError::Internal("no reservation id was assigned".into()))
    }

    /// Adds reservations owned by this replica (preemption holds of `preemptor` when given)
    /// to the table at once, so every resolution from now on counts them, and queues them
    /// for the reservation document as one change; returns their ids in order and the
    /// ticket that [`ReplicaState::wait_written`] makes them durable with (nothing may act
    /// on them outside this replica before). Nothing is queued when one of them is refused.
    pub(crate) fn queue_own_all(
        &self,
        all: &[Own<'_>],
        preemptor: Option<&str>,
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
        let bound: Vec<i64> = {
            let indexes = self.indexes();
            let view = &indexes.view;
            let mut compute = self.compute(&indexes);
            let mut bound = Vec::with_capacity(all.len());
            for (r, w) in all.iter().zip(&workloads) {
                check_clusters(view, &[r.cluster.to_string()])?;
                let key = resv::owner_key(&w.namespace, &w.kind, &w.name);
                bound.push(
                    view.cluster(r.cluster)
                        .map_or(0, |c| compute.bound.get(c, &key)),
                );
            }
            bound
        };
        // The table (lock 3) is not taken with the indexes (lock 4) held.
        let ids: Vec<String> = self.with_table(|t| all.iter().map(|_| t.next_id()).collect());
        let mut changes = Vec::with_capacity(all.len());
        let mut records = Vec::with_capacity(all.len());
        for (((r, workload), bound_at_creation), id) in
            all.iter().zip(workloads).zip(bound).zip(&ids)
        {
            let record = Record {
                id: id.clone(),
                owner: self.replica.clone(),
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
        Ok((ids, self.own_writes.submit(changes)))
    }

    /// Writes a reservation owned by this replica and created by `caller`, within its caps
    /// (see [`crate::reservations`]). A refused reservation is never written, so it never
    /// reaches the replicated document.
    pub fn reserve(
        &self,
        caller: &Caller,
        req: &ReserveRequest,
    ) -> Result<ReservationStatus, ApiError> {
        if req.cluster.is_empty() {
            return Err(ApiError::InvalidRequest(
                "reservation: field cluster is required".into(),
            ));
        }
        let w = Arc::new(workload_from_manifests(&req.workload.manifests)?);
        let replicas = req.replicas.unwrap_or(w.replicas);
        if !(1..=resv::MAX_REPLICAS).contains(&replicas) {
            return Err(ApiError::InvalidRequest(format!(
                "reservation: field replicas {replicas} is not in 1..={}",
                resv::MAX_REPLICAS
            )));
        }
        let ttl_seconds = req.ttl_seconds.unwrap_or(resv::DEFAULT_TTL_SECONDS);
        if !(1..=resv::MAX_TTL_SECONDS).contains(&ttl_seconds) {
            return Err(ApiError::InvalidRequest(format!(
                "reservation: field ttlSeconds {ttl_seconds} is not in 1..={}",
                resv::MAX_TTL_SECONDS
            )));
        }
        let caps = lock(&self.caps);
        let bytes: usize = req.workload.manifests.iter().map(String::len).sum();
        self.check_caps(&caps, caller, replicas, bytes, ttl_seconds)?;
        let id = self.write_own(&Own {
            creator: &caller.identity.user,
            cluster: &req.cluster,
            workload: &w,
            manifests: &req.workload.manifests,
            replicas,
            priority: req.priority.unwrap_or(w.priority),
            ttl_seconds,
            caps: Some((&*caps).into()),
            decision: None,
        })?;
        drop(caps);
        self.reservation_status(&id)
            .ok_or_else(|| ApiError::Internal(format!("reservation {id} vanished after writing")))
    }

    /// Releases a reservation this replica owns, if `caller` created it or is an admin;
    /// releasing an ended one returns how it ended.
    pub fn release(&self, caller: &Caller, id: &str) -> Result<ReservationStatus, ApiError> {
        let (found, ended) = self.with_table(|table| match table.get(id) {
            Some(e) => (
                Some((e.record.owner.clone(), e.record.creator.clone())),
                None,
            ),
            None => (None, table.ended(id).cloned()),
        });
        let Some((owner, creator)) = found else {
            return ended.ok_or_else(|| ApiError::NotFound(format!("reservation {id}")));
        };
        let user = &caller.identity.user;
        if creator != *user && !caller.admin {
            let by = if creator.is_empty() {
                "an unrecorded identity".to_string()
            } else {
                creator
            };
            return Err(ApiError::Refused(Refusal {
                kind: RefusalKind::Forbidden,
                reason: "not_creator",
                identity: user.clone(),
                message: format!(
                    "{user} may not release reservation {id}: it was created by {by} (only its creator or an admin may)"
                ),
            }));
        }
        if owner != self.replica {
            return Err(ApiError::InvalidRequest(format!(
                "reservation {id} is owned by replica {owner}; release it there"
            )));
        }
        self.end_own(id, ReservationState::Released)?;
        self.reservation_status(id)
            .ok_or_else(|| ApiError::Internal(format!("reservation {id} vanished")))
    }

    /// Deletes an own reservation, remembering how it ended.
    pub(crate) fn end_own(&self, id: &str, how: ReservationState) -> Result<(), ApiError> {
        let Some(status) =
            self.with_table(|t| t.get(id).map(|e| resv::base_status(&e.record, how)))
        else {
            return Ok(());
        };
        self.end_own_as(status)
    }

    /// Deletes an own reservation, remembering it as `status`.
    fn end_own_as(&self, status: ReservationStatus) -> Result<(), ApiError> {
        let (id, how) = (status.id.clone(), status.status);
        let id = id.as_str();
        let known = self.with_table(|table| {
            if table.get(id).is_none() {
                return false;
            }
            table.end(status);
            true
        });
        if !known {
            return Ok(());
        }
        self.write_reservations(vec![ObjectChange::Delete {
            key: resv::record_key(id),
        }])?;
        tracing::info!(id, how = ?how, "reservation ended");
        Ok(())
    }

    /// The owner's housekeeping: deletes own reservations whose TTL passed, whose replicas
    /// are all bound, or that the cap ranking voids (they end conflicted, with the reason).
    /// Called periodically by the replica.
    pub fn sweep_reservations(&self) {
        let res = self.resolution();
        let now = Instant::now();
        let ended: Vec<ReservationStatus> = self.with_table(|table| {
            table
                .entries()
                .filter(|(_, e)| e.record.owner == self.replica)
                .filter_map(|(_, e)| {
                    if now >= table.expiry(e) {
                        Some(resv::base_status(&e.record, ReservationState::Expired))
                    } else if let Some(reason) = res.void.get(&*e.id) {
                        Some(resv::void_status(&e.record, Some(reason)))
                    } else if let Some(reason) = res.over_cap.get(&*e.id) {
                        Some(resv::over_cap_status(&e.record, reason))
                    } else if res.outcome(e).is_some_and(|(_, left)| left == 0) {
                        Some(resv::base_status(&e.record, ReservationState::Satisfied))
                    } else {
                        None
                    }
                })
                .collect()
        });
        for status in ended {
            match (&status.reason, status.status) {
                (Some(reason), ReservationState::Released) => {
                    tracing::info!(id = %status.id, reason, "released a reservation whose decision is void");
                }
                (Some(reason), _) => {
                    tracing::warn!(id = %status.id, reason, "released a reservation over its creator's cap");
                }
                _ => {}
            }
            let id = status.id.clone();
            if let Err(e) = self.end_own_as(status) {
                tracing::warn!(id, error = %e, "ending a reservation failed; retrying on the next sweep");
            }
        }
    }
}

/// Resolves cluster `cluster` again after its reservations changed (`read` from the table:
/// its version, and all of them or the ones added since `previous`), its view changed, or
/// one of them expired.
fn resolve_part(
    compute: &mut crate::state::Compute,
    view: &dramesh_estimator::View,
    cluster: &Arc<str>,
    previous: Option<Arc<ClusterPart>>,
    (version, read): (u64, ClusterRead),
    (now, over_cap): (Instant, &BTreeMap<Arc<str>, String>),
) -> Arc<ClusterPart> {
    let cv = view.cluster(cluster);
    let view_gen = cv.map_or(0, |v| v.generation());
    let (previous, all) = match (read, previous) {
        (ClusterRead::Added(mut added), Some(mut p)) => {
            // Void reservations hold nothing (their clusters are read whole when that changes).
            added.retain(|e| !over_cap.contains_key(&*e.id));
            if p.view_gen == view_gen && p.until.is_none_or(|u| now < u) {
                // New reservations that rank after every one resolved: resolved alone.
                let more: Result<Vec<Reservation>, _> = added
                    .iter()
                    .map(|e| reservation(compute, cv, cluster, e))
                    .collect();
                if let Ok(more) = more {
                    let part = Arc::make_mut(&mut p);
                    let admitted = part.resolution.assumed.len();
                    let extended =
                        part.resolution
                            .extend(view, &mut compute.estimator, cluster, &more);
                    if extended.is_ok() {
                        if part.resolution.assumed.len() != admitted {
                            part.assumed = part.resolution.assumed.clone().into();
                        }
                        for e in &added {
                            part.until = Some(part.until.map_or(e.expiry, |u| u.min(e.expiry)));
                        }
                        part.entries.extend(added);
                        part.table_version = version;
                        compute.extended += 1;
                        return p;
                    }
                }
            }
            let mut all = p.entries.clone();
            all.extend(added);
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
        match reservation(compute, cv, cluster, e) {
            Ok(r) => input.push(r),
            Err(u) => {
                undecodable.insert(e.record.id.clone(), u);
            }
        }
    }
    let reusable = previous.as_deref().filter(|p| p.view_gen == view_gen);
    let resolution = dramesh_estimator::resolve_cluster(
        view,
        &mut compute.estimator,
        cluster,
        &input,
        reusable.map(|p| &p.resolution),
    );
    let assumed = resolution.assumed.clone().into();
    compute.epochs += 1;
    let outcome_epoch = match previous.as_deref() {
        Some(p) if !outcomes_changed(p, &resolution, &undecodable) => p.outcome_epoch,
        _ => compute.epochs,
    };
    Arc::new(ClusterPart {
        outcome_epoch,
        table_version: version,
        view_gen,
        until,
        entries,
        resolution,
        undecodable,
        expired,
        assumed,
    })
}

/// The live reservation `e` of `cluster` as resolution takes it: with the replicas it still
/// holds (those the cluster reports bound since it was written are no longer held), or, when
/// its workload does not decode, its conflicted outcome and replicas.
fn reservation(
    compute: &mut crate::state::Compute,
    cv: Option<&dramesh_estimator::ClusterView>,
    cluster: &Arc<str>,
    e: &resv::Entry,
) -> Result<Reservation, (Admission, i64)> {
    let bound = cv.map_or(0, |c| compute.bound.get(c, &e.owner_key));
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
fn judged(table: &resv::Table, e: &resv::Entry, res: &Resolved, now: Instant) -> Judged {
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
fn status_in(
    table: &resv::Table,
    id: &str,
    res: &Resolved,
    now: Instant,
) -> Option<ReservationStatus> {
    let Some(e) = table.get(id) else {
        return table.ended(id).cloned();
    };
    let j = judged(table, e, res, now);
    let mut st = resv::base_status(&e.record, j.state);
    st.remaining = j.remaining;
    if j.state != ReservationState::Expired {
        st.expires_in_seconds = Some(table.expiry(e).saturating_duration_since(now).as_secs_f64());
    }
    st.winner = j.winner.map(|w| w.to_string());
    st.reason = j.reason;
    Some(st)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::Manifest;
    use std::path::Path;

    fn node(cluster: &str, n: usize, gpus: u32) -> (String, ObjectChange) {
        let yaml = format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: n{n}}}\nstatus: {{allocatable: {{cpu: '64', memory: 256Gi, pods: '110', nvidia.com/gpu: '{gpus}'}}}}\n"
        );
        let loaded = dramesh_model::load::load_str(Path::new("n.yaml"), &yaml).unwrap();
        let Manifest::Object(o) = &loaded[0].manifest else {
            panic!("not an object")
        };
        (cluster.to_string(), ObjectChange::upsert(o))
    }

    fn deployment(name: &str, gpus: u32) -> Vec<String> {
        vec![format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}, namespace: ml}}\nspec:\n  replicas: 1\n  selector: {{matchLabels: {{app: {name}}}}}\n  template:\n    metadata: {{labels: {{app: {name}}}}}\n    spec:\n      containers:\n      - name: c\n        resources: {{requests: {{cpu: '1', nvidia.com/gpu: '{gpus}'}}, limits: {{nvidia.com/gpu: '{gpus}'}}}}\n"
        )]
    }

    /// What the statuses say that resolution decides (not times).
    fn outcomes(st: &ReplicaState) -> Vec<(String, ReservationState, i64, Option<String>)> {
        st.reservation_list(false)
            .into_iter()
            .map(|s| (s.id, s.status, s.remaining, s.winner))
            .collect()
    }

    /// What estimates deduct: each admitted reservation's cluster, replicas and requests.
    fn deductions(st: &ReplicaState) -> Vec<(String, i64, String)> {
        st.reserved()
            .iter()
            .map(|a| (a.cluster.clone(), a.replicas, format!("{:?}", a.requests)))
            .collect()
    }

    /// A record of another replica's reservation, as its document delivers it.
    fn foreign(
        owner: &str,
        seq: u64,
        cluster: &str,
        replicas: i64,
        priority: i32,
    ) -> (String, ObjectChange) {
        let manifests = deployment(&format!("f{seq}"), 1);
        let record = Record {
            id: format!("{owner}-{seq:016}"),
            owner: owner.into(),
            creator: "scheduler:x".into(),
            cluster: cluster.into(),
            workload: WorkloadRef {
                namespace: "ml".into(),
                kind: "Deployment".into(),
                name: format!("f{seq}"),
            },
            manifests,
            replicas,
            priority,
            ttl_seconds: 300,
            bound_at_creation: 0,
            preemptor: None,
            caps: None,
            decision: None,
        };
        let json = serde_json::to_vec(&record).unwrap();
        (
            dramesh_store::RESERVATION_SCOPE.to_string(),
            ObjectChange::Upsert {
                key: resv::record_key(&record.id),
                json: Arc::from(json.as_slice()),
            },
        )
    }

    /// Reservations written, released, arriving from other replicas (ranked before and
    /// after this replica's) and a view change, in random order: after every step the
    /// resolution reached from the previous one (extended or resolved again) equals the
    /// resolution computed from nothing.
    #[test]
    fn the_resolution_kept_up_to_date_equals_one_from_scratch() {
        let st = ReplicaState::in_memory("r1");
        let nodes: Vec<_> = (0..3)
            .flat_map(|n| [node("a", n, 4), node("b", n, 2)])
            .collect();
        st.apply_changes(&nodes);
        let shapes = [
            Arc::new(workload_from_manifests(&deployment("one", 1)).unwrap()),
            Arc::new(workload_from_manifests(&deployment("two", 2)).unwrap()),
        ];
        let mut seed = 99u64;
        let mut next = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        let mut own: Vec<String> = Vec::new();
        let (mut changed, mut conflicted) = (0, 0);
        for step in 0..120 {
            let before = st.with_table(|t| t.version);
            match next(10) {
                0 if !own.is_empty() => {
                    let id = own.remove(next(own.len() as u64) as usize);
                    st.end_own(&id, ReservationState::Released).unwrap();
                }
                1 => {
                    // Another replica's, ranked before ("a-") or after ("z-") this one's.
                    let owner = if next(2) == 0 { "a" } else { "z" };
                    let cluster = if next(2) == 0 { "a" } else { "b" };
                    let r = foreign(owner, step, cluster, 1 + next(2) as i64, next(2) as i32);
                    st.apply_changes(&[r]);
                }
                2 => st.apply_changes(&[node("a", 3 + next(2) as usize, 1 + next(4) as u32)]),
                _ => {
                    let w = &shapes[next(2) as usize];
                    let manifests = deployment(&w.name, if w.name == "one" { 1 } else { 2 });
                    let cluster = if next(3) == 0 { "b" } else { "a" };
                    let (ids, ticket) = st
                        .queue_own_all(
                            &[Own {
                                creator: "t",
                                cluster,
                                workload: w,
                                manifests: &manifests,
                                replicas: 1 + next(2) as i64,
                                priority: 0,
                                ttl_seconds: 300,
                                caps: None,
                                decision: None,
                            }],
                            None,
                        )
                        .unwrap();
                    st.wait_written(ticket).unwrap();
                    own.extend(ids);
                }
            }
            let kept = (outcomes(&st), deductions(&st));
            if st.with_table(|t| t.version) > before {
                changed += 1;
            }
            // From nothing; then the kept resolution is put back, so later steps go on from
            // it (a long chain of extensions is checked, not one at a time).
            let saved = {
                let indexes = st.indexes();
                st.compute(&indexes).resolved.take()
            };
            let fresh = (outcomes(&st), deductions(&st));
            {
                let indexes = st.indexes();
                st.compute(&indexes).resolved = saved;
            }
            assert_eq!(kept, fresh, "step {step}");
            conflicted += fresh
                .0
                .iter()
                .filter(|o| o.1 == ReservationState::Conflicted)
                .count();
        }
        assert!(
            changed > 60,
            "most steps should change reservations ({changed})"
        );
        let extended = {
            let indexes = st.indexes();
            st.compute(&indexes).extended
        };
        assert!(
            extended > 30,
            "most own writes should only extend ({extended})"
        );
        assert!(conflicted > 0, "the fleet should run out of GPUs");
    }

    fn alice() -> Caller {
        Caller {
            identity: dramesh_api::auth::Identity {
                user: "alice".into(),
                groups: vec![],
            },
            admin: false,
        }
    }

    /// alice's record written by replica `owner` with sequence number `seq`, under a cap of
    /// `cap` live reservations.
    fn capped(owner: &str, seq: u64, cap: usize) -> (String, ObjectChange) {
        let (scope, change) = foreign(owner, seq, "a", 1, 0);
        let ObjectChange::Upsert { key, json } = change else {
            unreachable!()
        };
        let mut record = Record::decode(&json).unwrap();
        record.creator = "alice".into();
        record.caps = Some(resv::RecordCaps {
            reservations: cap,
            replicas: 1_000,
            manifest_bytes: 1 << 20,
        });
        let json = serde_json::to_vec(&record).unwrap();
        (
            scope,
            ObjectChange::Upsert {
                key,
                json: Arc::from(json.as_slice()),
            },
        )
    }

    /// Two replicas admit alice's last slot at once: the reservation created later (higher
    /// sequence number) is void on both, whatever order they learn of them in; it is not
    /// deducted, its status says why, its owner releases it, and it ends conflicted.
    #[test]
    fn the_cap_ranking_voids_the_later_of_two_reservations_admitted_at_once() {
        let caps = Caps {
            max_reservations: 2,
            ..Caps::default()
        };
        let mine = |st: &ReplicaState, name: &str| {
            let req = ReserveRequest {
                cluster: "a".into(),
                workload: dramesh_api::native::Workload {
                    manifests: deployment(name, 1),
                },
                replicas: Some(1),
                ..ReserveRequest::default()
            };
            st.reserve(&alice(), &req).unwrap().id
        };
        let st = ReplicaState::in_memory("r1");
        st.set_caps(caps);
        st.apply_changes(&[node("a", 0, 8)]);
        let first = mine(&st, "one");
        let second = mine(&st, "two");
        // A third is refused at once: this replica's own two count.
        let refused = st.reserve(
            &alice(),
            &ReserveRequest {
                cluster: "a".into(),
                workload: dramesh_api::native::Workload {
                    manifests: deployment("three", 1),
                },
                ..ReserveRequest::default()
            },
        );
        assert!(
            matches!(refused, Err(ApiError::Refused(ref r)) if r.reason == "cap_reservations"),
            "{refused:?}"
        );
        assert_eq!(deductions(&st).len(), 2);
        // Replica r0 admitted one of alice's before both (its sequence number is lower).
        st.apply_changes(&[capped("r0", 1, 2)]);
        let s = st.reservation_status(&second).unwrap();
        assert_eq!(s.status, ReservationState::Conflicted, "{s:?}");
        assert!(
            s.reason.as_deref().unwrap().starts_with("over_cap: alice"),
            "{s:?}"
        );
        assert_eq!(
            st.reservation_status(&first).unwrap().status,
            ReservationState::Live
        );
        assert_eq!(deductions(&st).len(), 2, "the void one is not deducted");
        // Its owner releases it; it ends conflicted, with the reason.
        st.sweep_reservations();
        assert!(st.with_table(|t| t.get(&second).is_none()));
        let s = st.reservation_status(&second).unwrap();
        assert_eq!(s.status, ReservationState::Conflicted, "{s:?}");
        assert!(s.reason.as_deref().unwrap().contains("over_cap"), "{s:?}");
        assert_eq!(s.remaining, 0);

        // Another replica learning of the same three records in the other order voids the
        // same one.
        let other = ReplicaState::in_memory("r9");
        other.apply_changes(&[node("a", 0, 8)]);
        let theirs = |id: &str| {
            let e = st.with_table(|t| t.get(id).map(|e| e.record.clone()));
            e.map(|r| {
                let json = serde_json::to_vec(&r).unwrap();
                (
                    dramesh_store::RESERVATION_SCOPE.to_string(),
                    ObjectChange::Upsert {
                        key: resv::record_key(&r.id),
                        json: Arc::from(json.as_slice()),
                    },
                )
            })
        };
        other.apply_changes(&[theirs(&first).unwrap()]);
        let mut late = capped("r1", 0, 2);
        // The record st released, as it was before (same id, higher sequence than r0's).
        if let ObjectChange::Upsert { key, json } = &mut late.1 {
            let mut r = Record::decode(json).unwrap();
            r.id = second.clone();
            r.owner = "r1".into();
            *key = resv::record_key(&r.id);
            *json = Arc::from(serde_json::to_vec(&r).unwrap().as_slice());
        }
        other.apply_changes(&[late]);
        assert_eq!(
            other.reservation_status(&second).unwrap().status,
            ReservationState::Live,
            "two of a cap of two"
        );
        other.apply_changes(&[capped("r0", 1, 2)]);
        let s = other.reservation_status(&second).unwrap();
        assert_eq!(s.status, ReservationState::Conflicted, "{s:?}");
        assert_eq!(deductions(&other).len(), 2);
        // The owner's release arrives: ended over cap here too.
        other.apply_changes(&[(
            dramesh_store::RESERVATION_SCOPE.to_string(),
            ObjectChange::Delete {
                key: resv::record_key(&second),
            },
        )]);
        let s = other.reservation_status(&second).unwrap();
        assert_eq!(s.status, ReservationState::Conflicted, "{s:?}");
        // A void reservation frees its place: once r0's ends, a new one of alice's fits.
        other.apply_changes(&[(
            dramesh_store::RESERVATION_SCOPE.to_string(),
            ObjectChange::Delete {
                key: resv::record_key("r0-0000000000000001"),
            },
        )]);
        assert_eq!(
            other.with_table(|t| {
                t.refresh_over_cap(Instant::now());
                t.held_by("alice", Instant::now())
            }),
            (1, 1, deployment("one", 1)[0].len())
        );
    }
}
