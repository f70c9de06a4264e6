//! The replica's reservation API, composed over [`ReplicaState`] and its
//! [`crate::reservation_resolution::Reservations`]: making a reservation within its
//! creator's caps, releasing one, and the owner's housekeeping of its own (see
//! [`crate::reservation_table`] for the record and its lifecycle). Each writes through the
//! replica's reservation document ([`ReplicaState::wait_written`]).

use std::sync::Arc;

use dramesh_api::ApiError;
use dramesh_api::auth::{Caller, Refusal, RefusalKind};
use dramesh_api::native::{ReservationState, ReservationStatus, ReserveRequest};
use dramesh_model::ObjectChange;

use crate::requests::workload_from_manifests;
use crate::reservation_resolution::Own;
use crate::reservation_table as resv;
use crate::state::ReplicaState;

impl ReplicaState {
    /// Writes changes to this replica's reservation document and applies them here; returns
    /// once they are durable (written with whatever else was queued: see
    /// [`crate::group_commit`]).
    fn write_reservations(&self, changes: Vec<ObjectChange>) -> Result<(), ApiError> {
        self.reservations.check_writable()?;
        let ticket = self.reservations.submit(changes);
        self.wait_written(ticket)
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
    ) -> Result<(Vec<String>, crate::group_commit::Ticket), ApiError> {
        let indexes = self.indexes();
        self.reservations.queue_own(all, preemptor, &indexes.view)
    }

    /// Writes a reservation owned by this replica and created by `caller`, within its caps
    /// (see [`crate::reservation_table`]). A refused reservation is never written, so it
    /// never reaches the replicated document.
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
        let bytes: usize = req.workload.manifests.iter().map(String::len).sum();
        let id = self
            .reservations
            .admit(caller, (replicas, bytes, ttl_seconds), |caps| {
                self.write_own(&Own {
                    creator: &caller.identity.user,
                    cluster: &req.cluster,
                    workload: &w,
                    manifests: &req.workload.manifests,
                    replicas,
                    priority: req.priority.unwrap_or(w.priority),
                    ttl_seconds,
                    caps: Some(caps),
                    decision: None,
                })
            })?;
        self.reservation_status(&id)
            .ok_or_else(|| ApiError::Internal(format!("reservation {id} vanished after writing")))
    }

    /// Releases a reservation this replica owns, if `caller` created it or is an admin;
    /// releasing an ended one returns how it ended.
    pub fn release(&self, caller: &Caller, id: &str) -> Result<ReservationStatus, ApiError> {
        let (found, ended) = self.reservations.owner_and_creator(id);
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
        let Some(status) = self.reservations.ending(id, how) else {
            return Ok(());
        };
        self.end_own_as(status)
    }

    /// Ends this replica's reservations `ids` as released; one that cannot be is logged (it
    /// ends at its TTL).
    pub(crate) fn release_own<'a>(&self, ids: impl IntoIterator<Item = &'a String>) {
        for id in ids {
            if let Err(e) = self.end_own(id, ReservationState::Released) {
                tracing::warn!(id, error = %e, "releasing a reservation failed; it ends at its TTL");
            }
        }
    }

    /// Deletes an own reservation, remembering it as `status`.
    fn end_own_as(&self, status: ReservationStatus) -> Result<(), ApiError> {
        let (id, how) = (status.id.clone(), status.status);
        let id = id.as_str();
        if !self.reservations.end(status) {
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
        let ended = self.reservations.to_sweep(&res);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reservation_table::Record;
    use dramesh_api::auth::Caps;
    use dramesh_api::native::WorkloadRef;
    use dramesh_model::Manifest;
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::time::{Duration, Instant};

    fn node(cluster: &str, n: usize, gpus: u32) -> (String, ObjectChange) {
        node_with(cluster, n, gpus, "", false)
    }

    /// Node `n` of `cluster` with label `update: <label>` and, when `tainted`, a NoSchedule
    /// taint no workload here tolerates.
    fn node_with(
        cluster: &str,
        n: usize,
        gpus: u32,
        label: &str,
        tainted: bool,
    ) -> (String, ObjectChange) {
        let taints = if tainted {
            "spec: {taints: [{key: t, effect: NoSchedule}]}\n"
        } else {
            ""
        };
        let yaml = format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: n{n}, labels: {{update: '{label}'}}}}\n{taints}status: {{allocatable: {{cpu: '64', memory: 256Gi, pods: '110', nvidia.com/gpu: '{gpus}'}}}}\n"
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

    /// Writes one reservation of this replica (creator `t`, priority 0) and waits for it.
    fn write_own(
        st: &ReplicaState,
        cluster: &str,
        workload: &Arc<dramesh_estimator::Workload>,
        manifests: &[String],
        replicas: i64,
    ) -> Vec<String> {
        let own = Own {
            creator: "t",
            cluster,
            workload,
            manifests,
            replicas,
            priority: 0,
            ttl_seconds: 300,
            caps: None,
            decision: None,
        };
        let (ids, ticket) = st.queue_own_all(&[own], None).unwrap();
        st.wait_written(ticket).unwrap();
        ids
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

    /// Strict judging deducts every other live reservation whatever its rank: of two that
    /// fit only one at a time, the one resolution admits is refused too, and a reservation
    /// alone with room is confirmed; decisions place around the conflicted one as well.
    #[test]
    fn strict_judging_counts_every_live_reservation_whatever_its_rank() {
        let st = ReplicaState::in_memory("r1");
        // One node of 4 GPUs in cluster a; each reservation holds 3 (one replica of 3 GPUs).
        st.apply_changes(&[node("a", 0, 4)]);
        let (x, y) = (foreign("r2", 1, "a", 1, 0), foreign("r3", 2, "a", 1, 0));
        let with3 = |c: (String, ObjectChange)| {
            let ObjectChange::Upsert { key, json } = c.1 else {
                unreachable!()
            };
            let mut v: serde_json::Value = serde_json::from_slice(&json).unwrap();
            v["manifests"] =
                serde_json::json!(deployment(v["workload"]["name"].as_str().unwrap(), 3));
            (
                c.0,
                ObjectChange::Upsert {
                    key,
                    json: serde_json::to_vec(&v).unwrap().into(),
                },
            )
        };
        let (x, y) = (with3(x), with3(y));
        st.apply_changes(&[x]);
        let idx = |seq: u64, owner: &str| format!("{owner}-{seq:016}");
        let (ix, iy) = (idx(1, "r2"), idx(2, "r3"));
        assert_eq!(st.fits_against_all_live(&[(&ix, "a")]), Ok(()));
        st.apply_changes(&[y]);
        // Resolution admits x (it ranks first) and conflicts y; strict refuses both.
        let states: Vec<_> = outcomes(&st).into_iter().map(|o| o.1).collect();
        assert_eq!(
            states,
            [ReservationState::Live, ReservationState::Conflicted]
        );
        for id in [&ix, &iy] {
            let e = st.fits_against_all_live(&[(id, "a")]).unwrap_err();
            assert!(
                e.contains("where 0 fit with every other live reservation deducted"),
                "{e}"
            );
        }
        assert!(st.fits_against_all_live(&[("r9-1", "a")]).is_err());
        // What a strict decision deducts: both; what others deduct: the admitted one.
        assert_eq!(deductions(&st).len(), 1);
        let all = st.reservations.all_live(&st.resolution(), None, None, &[]);
        assert_eq!(all.iter().count(), 2);
    }

    /// Reservations written, released, arriving from other replicas (ranked before and
    /// after this replica's) and view changes (capacity, taints, labels), in random order:
    /// after every step the resolution reached from the previous one (extended, carried
    /// over a change that leaves every fit as it was, or resolved again) equals the
    /// resolution computed from nothing.
    #[test]
    fn the_resolution_kept_up_to_date_equals_one_from_scratch() {
        let st = ReplicaState::in_memory("r1");
        // Exact after every step: late reservations of other replicas do not wait here (see
        // `late_reservations_of_others_wait_at_most_the_deferral`).
        st.indexes().compute().resolution.deferral = Duration::ZERO;
        let nodes: Vec<_> = (0..3)
            .flat_map(|n| [node("a", n, 4), node("b", n, 2)])
            .collect();
        st.apply_changes(&nodes);
        // Nodes 0-2 of each cluster: GPUs and whether tainted.
        let mut shape: BTreeMap<(&str, usize), (u32, bool)> = (0..3)
            .flat_map(|n| [(("a", n), (4, false)), (("b", n), (2, false))])
            .collect();
        let shapes = [
            Arc::new(workload_from_manifests(&deployment("one", 1)).unwrap()),
            Arc::new(workload_from_manifests(&deployment("two", 2)).unwrap()),
        ];
        let mut rng = dramesh_testkit::Lcg(99);
        let mut next = |m: u64| rng.next(m);
        let mut own: Vec<String> = Vec::new();
        let (mut changed, mut conflicted) = (0, 0);
        for step in 0..160 {
            let before = st.reservations.inspect(|t| t.version);
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
                3 | 4 => {
                    let key = (if next(2) == 0 { "a" } else { "b" }, next(3) as usize);
                    let (gpus, tainted) = shape.get_mut(&key).unwrap();
                    // A label no workload selects on (every fit as it was), or, one time in
                    // four, a taint put on or taken off (fits change).
                    if next(4) == 0 {
                        *tainted = !*tainted;
                    }
                    st.apply_changes(&[node_with(
                        key.0,
                        key.1,
                        *gpus,
                        &step.to_string(),
                        *tainted,
                    )]);
                }
                _ => {
                    let w = &shapes[next(2) as usize];
                    let manifests = deployment(&w.name, if w.name == "one" { 1 } else { 2 });
                    let cluster = if next(3) == 0 { "b" } else { "a" };
                    let replicas = 1 + next(2) as i64;
                    let ids = write_own(&st, cluster, w, &manifests, replicas);
                    own.extend(ids);
                }
            }
            let kept = (outcomes(&st), deductions(&st));
            if st.reservations.inspect(|t| t.version) > before {
                changed += 1;
            }
            // From nothing; then the kept resolution is put back, so later steps go on from
            // it (a long chain of extensions is checked, not one at a time).
            let saved = {
                let indexes = st.indexes();
                indexes.compute().resolution.resolved.take()
            };
            let fresh = (outcomes(&st), deductions(&st));
            {
                let indexes = st.indexes();
                indexes.compute().resolution.resolved = saved;
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
            indexes.compute().resolution.extended
        };
        assert!(
            extended > 30,
            "most own writes should only extend ({extended})"
        );
        let carried = {
            let indexes = st.indexes();
            indexes.compute().resolution.carried
        };
        assert!(
            carried > 10,
            "relabelled nodes should leave most parts as they were ({carried})"
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

    /// Another replica's reservation that arrives ranked before ones resolved here, less than
    /// the deferral after the cluster was last resolved out of order, waits: estimates do not
    /// deduct it yet, strict scheduling does, and once the deferral has passed the kept
    /// resolution equals one from scratch. This replica's own reservations never wait.
    #[test]
    fn late_reservations_of_others_wait_at_most_the_deferral() {
        let st = ReplicaState::in_memory("r1");
        let deferral = Duration::from_millis(300);
        st.indexes().compute().resolution.deferral = deferral;
        st.apply_changes(&[node("a", 0, 8)]);
        let w = Arc::new(workload_from_manifests(&deployment("one", 1)).unwrap());
        let manifests = deployment("one", 1);
        let own = |replicas: i64| write_own(&st, "a", &w, &manifests, replicas);
        let fresh = |st: &ReplicaState| {
            let saved = st.indexes().compute().resolution.resolved.take();
            let fresh = (outcomes(st), deductions(st));
            st.indexes().compute().resolution.resolved = saved;
            fresh
        };
        let held = |st: &ReplicaState| -> i64 { st.reserved().iter().map(|a| a.replicas).sum() };
        // A first resolution (from nothing: out of order), then an own reservation extends it.
        own(2);
        assert_eq!(held(&st), 2);
        own(1);
        assert_eq!(held(&st), 3);
        // Another replica's, made before both (a lower sequence number), arrives now: it waits.
        st.apply_changes(&[foreign("a", 1, "a", 4, 0)]);
        assert_eq!(
            held(&st),
            3,
            "a waiting reservation is deducted by estimates"
        );
        let deferred = || st.indexes().compute().resolution.deferred;
        assert_eq!(deferred(), 1, "the late arrival was resolved at once");
        let live = st.reservations.all_live(&st.resolution(), None, None, &[]);
        assert_eq!(
            live.iter().map(|a| a.replicas).sum::<i64>(),
            7,
            "strict scheduling must deduct waiting reservations"
        );
        assert_ne!(
            (outcomes(&st), deductions(&st)),
            fresh(&st),
            "nothing waited"
        );
        std::thread::sleep(deferral);
        assert_eq!(
            (outcomes(&st), deductions(&st)),
            fresh(&st),
            "still waiting past the deferral"
        );
        assert_eq!(held(&st), 7);
        // This replica's own reservations never wait, even ranked before resolved ones (here
        // behind another replica's from a clock far ahead), within the deferral too.
        st.apply_changes(&[foreign("z", u64::MAX / 2, "a", 1, 0)]);
        assert_eq!(held(&st), 8);
        let mine = own(1);
        assert_eq!(deferred(), 1);
        assert_eq!(
            (outcomes(&st), deductions(&st)),
            fresh(&st),
            "an own reservation waited"
        );
        let state = |id: &str| {
            st.reservation_list(false)
                .into_iter()
                .find(|s| s.id == id)
                .map(|s| s.status)
        };
        assert_eq!(state(&mine[0]), Some(ReservationState::Live));
        assert_eq!(
            state(&format!("z-{:016}", u64::MAX / 2)),
            Some(ReservationState::Conflicted)
        );
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
        assert!(st.reservations.inspect(|t| t.get(&second).is_none()));
        let s = st.reservation_status(&second).unwrap();
        assert_eq!(s.status, ReservationState::Conflicted, "{s:?}");
        assert!(s.reason.as_deref().unwrap().contains("over_cap"), "{s:?}");
        assert_eq!(s.remaining, 0);

        // Another replica learning of the same three records in the other order voids the
        // same one.
        let other = ReplicaState::in_memory("r9");
        other.apply_changes(&[node("a", 0, 8)]);
        let theirs = |id: &str| {
            let e = st
                .reservations
                .inspect(|t| t.get(id).map(|e| e.record.clone()));
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
            other.reservations.inspect(|t| {
                t.refresh_over_cap(Instant::now());
                t.held_by("alice", Instant::now())
            }),
            (1, 1, deployment("one", 1)[0].len())
        );
    }
}
