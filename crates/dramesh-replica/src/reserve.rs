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
use crate::reservations::{self as resv, Record};
use crate::state::{ReplicaState, check_clusters};
use dramesh_mesh::lock;

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
#[derive(Debug)]
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

/// Each cluster's part of the last resolution.
pub(crate) type ClusterResolutions = std::collections::HashMap<Arc<str>, Arc<ClusterPart>>;

/// One overcommit resolution of the unexpired reservations.
#[derive(Debug, Default, Clone)]
pub(crate) struct Resolved {
    parts: BTreeMap<Arc<str>, Arc<ClusterPart>>,
    assumed: Assumed,
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
    /// its reservations, its view generation or the first expiry among them changed, and
    /// then from its previous part (see [`dramesh_estimator::resolve_cluster`]).
    fn resolution(&self) -> Arc<Resolved> {
        let now = Instant::now();
        // The table (lock 3) is not taken with the indexes (lock 4) held: versions first,
        // then the entries of the clusters that changed.
        let versions: Vec<(Arc<str>, u64)> =
            self.with_table(|t| t.cluster_versions().map(|(c, v)| (c.clone(), v)).collect());
        let stale: Vec<Arc<str>> = {
            let indexes = self.indexes();
            let view = &indexes.view;
            let compute = self.compute(&indexes);
            let fresh = |c: &Arc<str>, v: u64| {
                compute
                    .per_cluster
                    .get(c)
                    .is_some_and(|p| fresh(p, v, view, c, now))
            };
            let stale: Vec<Arc<str>> = versions
                .iter()
                .filter(|(c, v)| !fresh(c, *v))
                .map(|(c, _)| c.clone())
                .collect();
            if stale.is_empty()
                && compute.per_cluster.len() == versions.len()
                && let Some(r) = compute.resolved.as_ref()
            {
                return r.clone();
            }
            stale
        };
        let read: Vec<(Arc<str>, Read)> = self.with_table(|table| {
            stale
                .into_iter()
                .map(|c| {
                    let (version, entries) = table.cluster_entries(&c);
                    let mut read = Read {
                        version,
                        live: Vec::with_capacity(entries.len()),
                        expired: BTreeSet::new(),
                        until: None,
                    };
                    for e in entries {
                        if now >= e.expiry {
                            read.expired.insert(e.record.id.clone());
                        } else {
                            read.until = Some(read.until.map_or(e.expiry, |u| u.min(e.expiry)));
                            read.live.push(e);
                        }
                    }
                    (c, read)
                })
                .collect()
        });
        let indexes = self.indexes();
        let view = &indexes.view;
        let mut compute = self.compute(&indexes);
        let compute = &mut *compute;
        // The last resolution with the clusters resolved again replaced.
        let mut resolved = compute.resolved.as_deref().cloned().unwrap_or_default();
        for (cluster, read) in read {
            let previous = compute.per_cluster.remove(&cluster);
            let part = Arc::new(resolve_part(
                compute,
                view,
                &cluster,
                previous.as_deref(),
                read,
            ));
            resolved.assumed.set(&cluster, part.assumed.clone());
            resolved.parts.insert(cluster.clone(), part.clone());
            compute.per_cluster.insert(cluster, part);
        }
        let known: BTreeSet<&str> = versions.iter().map(|(c, _)| &**c).collect();
        compute.per_cluster.retain(|c, _| known.contains(&**c));
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
    /// created, on any replica.
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
            table
                .entries()
                .filter(|(_, e)| e.record.creator == *user && now < table.expiry(e))
                .fold((0usize, 0i64, 0usize), |(n, r, b), (_, e)| {
                    let m: usize = e.record.manifests.iter().map(String::len).sum();
                    (
                        n + 1,
                        r.saturating_add(e.record.replicas),
                        b.saturating_add(m),
                    )
                })
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
            changes.push(ObjectChange::Upsert {
                key: resv::record_key(id),
                json: Arc::from(json.as_slice()),
            });
            records.push((record, r.workload.clone()));
        }
        let now = Instant::now();
        self.with_table(|t| {
            for (record, workload) in records {
                tracing::debug!(id = %record.id, cluster = %record.cluster, replicas = record.replicas, creator = %record.creator, "reservation written");
                t.insert_own(record, workload, now);
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
        let known = self.with_table(|table| {
            let Some(e) = table.get(id) else {
                return false;
            };
            let status = resv::base_status(&e.record, how);
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

    /// The owner's housekeeping: deletes own reservations whose TTL passed or whose replicas
    /// are all bound. Called periodically by the replica.
    pub fn sweep_reservations(&self) {
        let res = self.resolution();
        let now = Instant::now();
        let ended: Vec<(String, ReservationState)> = self.with_table(|table| {
            table
                .entries()
                .filter(|(_, e)| e.record.owner == self.replica)
                .filter_map(|(id, e)| {
                    if now >= table.expiry(e) {
                        Some((id.clone(), ReservationState::Expired))
                    } else if res.outcome(e).is_some_and(|(_, left)| left == 0) {
                        Some((id.clone(), ReservationState::Satisfied))
                    } else {
                        None
                    }
                })
                .collect()
        });
        for (id, how) in ended {
            if let Err(e) = self.end_own(&id, how) {
                tracing::warn!(id, error = %e, "ending a reservation failed; retrying on the next sweep");
            }
        }
    }
}

/// Whether `part` still describes cluster `c`: same reservations (table version), same
/// view generation, and none of its live reservations expired since.
fn fresh(
    part: &ClusterPart,
    version: u64,
    view: &dramesh_estimator::View,
    c: &str,
    now: Instant,
) -> bool {
    part.table_version == version
        && part.view_gen == view.cluster(c).map_or(0, |v| v.generation())
        && part.until.is_none_or(|u| now < u)
}

/// One cluster's reservations as resolution reads them from the table.
struct Read {
    /// The table's version of the cluster's reservations.
    version: u64,
    /// The unexpired ones, in id order.
    live: Vec<Arc<resv::Entry>>,
    /// The ids of those past their expiry.
    expired: BTreeSet<String>,
    /// The first expiry among the live.
    until: Option<Instant>,
}

/// Resolves one cluster's reservations as `read` from the table, from `previous` when that
/// was computed on the same view generation.
fn resolve_part(
    compute: &mut crate::state::Compute,
    view: &dramesh_estimator::View,
    cluster: &Arc<str>,
    previous: Option<&ClusterPart>,
    read: Read,
) -> ClusterPart {
    let cv = view.cluster(cluster);
    let view_gen = cv.map_or(0, |v| v.generation());
    let mut undecodable = BTreeMap::new();
    let mut input = Vec::with_capacity(read.live.len());
    for e in &read.live {
        let bound = cv.map_or(0, |c| compute.bound.get(c, &e.owner_key));
        let left = (e.record.replicas - (bound - e.record.bound_at_creation).max(0)).max(0);
        match &e.workload {
            Ok(w) => input.push(Reservation {
                id: e.id.clone(),
                cluster: cluster.clone(),
                priority: e.record.priority,
                replicas: left,
                workload: w.clone(),
            }),
            Err(err) => {
                let conflicted = Admission::Conflicted {
                    winner: None,
                    available: 0,
                    reason: Some(format!("workload manifests: {err}")),
                };
                undecodable.insert(e.record.id.clone(), (conflicted, left));
            }
        }
    }
    let reusable = previous.filter(|p| p.view_gen == view_gen);
    let resolution = dramesh_estimator::resolve_cluster(
        view,
        &mut compute.estimator,
        cluster,
        &input,
        reusable.map(|p| &p.resolution),
    );
    let assumed = resolution.assumed.clone().into();
    compute.epochs += 1;
    let outcome_epoch = match previous {
        Some(p) if !outcomes_changed(p, &resolution, &undecodable) => p.outcome_epoch,
        _ => compute.epochs,
    };
    ClusterPart {
        outcome_epoch,
        table_version: read.version,
        view_gen,
        until: read.until,
        resolution,
        undecodable,
        expired: read.expired,
        assumed,
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
