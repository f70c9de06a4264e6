//! The Jepsen-style checker: pure functions over what the workload driver wrote and what the
//! replicas reported.
//!
//! Two checks:
//! - [`check_state`]: every replica holds exactly the objects of the driver's final files
//!   (same keys, same content hashes) and all replicas report the same whole-state digest. A
//!   missing or stale object is reported with the driver's last write that touched it, so a
//!   lost write names its change number in `changes.jsonl`.
//! - [`check_queries`]: during the fault window every replica that was up answered every
//!   estimate query, within the latency bound, reporting a data age; a replica that could
//!   hear from nobody must not claim fresher data than the time it has been cut off.
//!
//! Guarantees: no I/O; the result lists every violation found (not only the first), in a
//! stable order.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

/// Object key (`Kind/ns/name` or `Kind/name`) to sha256 hex of its canonical JSON.
pub type ObjectHashes = BTreeMap<String, String>;
/// Cluster name to its objects.
pub type ClusterState = BTreeMap<String, ObjectHashes>;

/// What one replica reported at the end of a run.
#[derive(Debug, Clone)]
pub struct ReplicaObservation {
    /// The replica's name.
    pub replica: String,
    /// The replica's objects per cluster, or why they could not be read.
    pub state: Result<ClusterState, String>,
    /// The replica's document digest, when it could be read.
    pub digest: Option<String>,
    /// The clusters its `/v1/status` lists.
    pub listed: Vec<String>,
}

/// One estimate query sent during a run.
#[derive(Debug, Clone, Serialize)]
pub struct QueryRecord {
    /// The replica asked.
    pub replica: String,
    /// Milliseconds since the scenario started.
    pub at_ms: u64,
    /// Round-trip time of the query.
    pub latency_ms: f64,
    /// How it ended.
    pub outcome: QueryOutcome,
}

/// How a query ended.
#[derive(Debug, Clone, Serialize)]
pub enum QueryOutcome {
    /// The replica answered.
    Answered {
        /// Clusters in the answer.
        clusters: usize,
        /// Smallest and largest data age over the clusters the replica reported, if any.
        min_age_s: Option<f64>,
        /// Largest data age over those clusters, if any.
        max_age_s: Option<f64>,
    },
    /// The query failed (the error).
    Failed(String),
}

/// A time window in milliseconds since the scenario started (end exclusive).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Window {
    /// Start, inclusive.
    pub start_ms: u64,
    /// End, exclusive.
    pub end_ms: u64,
}

impl Window {
    /// Whether `t` (ms) lies in the window.
    pub fn contains(&self, t: u64) -> bool {
        t >= self.start_ms && t < self.end_ms
    }
}

/// A replica cut off from every peer and agent from `from_ms` until the fault ends.
#[derive(Debug, Clone, Serialize)]
pub struct Isolation {
    /// The isolated replica.
    pub replica: String,
    /// When the isolation began (ms since the scenario started).
    pub from_ms: u64,
    /// Allowed understatement of the data age (seconds), covering heartbeat periods.
    pub slack_s: f64,
}

/// What the query check demands.
#[derive(Debug, Clone)]
pub struct QueryPolicy {
    /// A query answered later than this failed the check.
    pub latency_bound_ms: f64,
    /// The fault window, in which queries are checked.
    pub fault: Window,
    /// Windows in which a replica was deliberately down (killed until ready again).
    pub down: BTreeMap<String, Vec<Window>>,
    /// Isolated replicas, whose data age must grow while cut off.
    pub isolations: Vec<Isolation>,
}

/// One thing that went wrong.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Violation {
    /// The replica's state could not be read.
    Unreachable {
        /// The replica.
        replica: String,
        /// Why.
        error: String,
    },
    /// The replica still lists a cluster that was retired from the fleet.
    RetiredClusterListed {
        /// The replica.
        replica: String,
        /// The retired cluster.
        cluster: String,
    },
    /// The replica listed a retired cluster again after it had dropped it (while the
    /// tombstone was held).
    RetiredClusterBack {
        /// The replica.
        replica: String,
        /// The retired cluster.
        cluster: String,
        /// When it was listed again (ms since the scenario started).
        at_ms: u64,
    },
    /// The hold of a tombstone proved nothing: the retired cluster's agent never rolled over
    /// while it was held.
    HoldUnproven {
        /// What was seen.
        detail: String,
    },
    /// The replica lacks a cluster the final files have.
    MissingCluster {
        /// The replica.
        replica: String,
        /// The missing cluster.
        cluster: String,
    },
    /// An object of the final files is absent on the replica.
    LostWrite {
        /// The replica.
        replica: String,
        /// The cluster.
        cluster: String,
        /// The object key.
        key: String,
        /// Change number of the last write of the key, if known.
        last_write: Option<u64>,
    },
    /// The replica holds another version of the object than the final files.
    StaleObject {
        /// The replica.
        replica: String,
        /// The cluster.
        cluster: String,
        /// The object key.
        key: String,
        /// Hash of the final file's version.
        expected: String,
        /// Hash of the replica's version.
        got: String,
        /// Change number of the last write of the key, if known.
        last_write: Option<u64>,
    },
    /// The replica holds an object the final files no longer have (a lost delete).
    LostDelete {
        /// The replica.
        replica: String,
        /// The cluster.
        cluster: String,
        /// The object key.
        key: String,
        /// Change number of the last write of the key, if known.
        last_write: Option<u64>,
    },
    /// The replica reported no digest.
    DigestMissing {
        /// The replica.
        replica: String,
    },
    /// Replicas converged to different digests.
    DigestsDiffer {
        /// Digest per replica.
        digests: BTreeMap<String, String>,
    },
    /// A query failed where it had to be answered.
    QueryFailed {
        /// The replica.
        replica: String,
        /// When (ms since the scenario started).
        at_ms: u64,
        /// The error.
        error: String,
    },
    /// A query was answered later than the bound.
    QueryTooSlow {
        /// The replica.
        replica: String,
        /// When (ms since the scenario started).
        at_ms: u64,
        /// How long it took.
        latency_ms: f64,
        /// The bound.
        bound_ms: f64,
    },
    /// The replica answered no query in the fault window.
    NoQueriesAnswered {
        /// The replica.
        replica: String,
    },
    /// An answer carried no data age.
    DataAgeMissing {
        /// The replica.
        replica: String,
        /// When (ms since the scenario started).
        at_ms: u64,
    },
    /// Strict scheduling: bindings held more replicas in a cluster than fit.
    Overcommit {
        /// When it was first seen (ms since the scenario started).
        at_ms: u64,
        /// Replicas bound beyond what fits, summed over clusters.
        over: i64,
    },
    /// Bindings still held more than fits later than the repair bound after the heal.
    NotRepaired {
        /// When it was seen (ms since the scenario started).
        at_ms: u64,
        /// Replicas bound beyond what fits, summed over clusters.
        over: i64,
        /// The bound, from the heal.
        repair_ms: u64,
    },
    /// At the end, fewer replicas were bound than fit (and were asked for).
    SlotsUnused {
        /// Replicas bound.
        bound: i64,
        /// Replicas that should have been bound: what fits, or every binding if fewer.
        wanted: i64,
    },
    /// The scheduler check proved nothing (no sample past the repair bound).
    ScheduleUnproven {
        /// What was seen.
        detail: String,
    },
    /// At the end, bindings carried no `Scheduled` condition.
    NoCondition {
        /// How many.
        count: usize,
        /// The first few names.
        first: Vec<String>,
    },
    /// An isolated replica reported data fresher than the time it had been cut off.
    DataAgeUnderstated {
        /// The replica.
        replica: String,
        /// When (ms since the scenario started).
        at_ms: u64,
        /// The largest data age it reported.
        reported_s: f64,
        /// The age it must at least have had.
        at_least_s: f64,
    },
}

impl Violation {
    /// Whether this is a state (convergence) violation rather than a query one.
    pub fn is_state(&self) -> bool {
        matches!(
            self,
            Violation::Unreachable { .. }
                | Violation::MissingCluster { .. }
                | Violation::RetiredClusterListed { .. }
                | Violation::RetiredClusterBack { .. }
                | Violation::HoldUnproven { .. }
                | Violation::LostWrite { .. }
                | Violation::StaleObject { .. }
                | Violation::LostDelete { .. }
                | Violation::DigestMissing { .. }
                | Violation::DigestsDiffer { .. }
                | Violation::Overcommit { .. }
                | Violation::NotRepaired { .. }
                | Violation::SlotsUnused { .. }
                | Violation::NoCondition { .. }
                | Violation::ScheduleUnproven { .. }
        )
    }
}

fn write_ref(w: &Option<u64>) -> String {
    w.map_or_else(|| "initial state".to_string(), |n| format!("write #{n}"))
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Unreachable { replica, error } => {
                write!(f, "{replica}: state unreadable: {error}")
            }
            Violation::MissingCluster { replica, cluster } => {
                write!(f, "{replica}: cluster {cluster} absent")
            }
            Violation::RetiredClusterBack {
                replica,
                cluster,
                at_ms,
            } => write!(
                f,
                "{replica}: retired cluster {cluster} listed again at {at_ms} ms after it was dropped"
            ),
            Violation::HoldUnproven { detail } => write!(f, "tombstone hold unproven: {detail}"),
            Violation::RetiredClusterListed { replica, cluster } => {
                write!(f, "{replica}: retired cluster {cluster} still listed")
            }
            Violation::LostWrite {
                replica,
                cluster,
                key,
                last_write,
            } => write!(
                f,
                "{replica}: lost write: {cluster} {key} missing ({})",
                write_ref(last_write)
            ),
            Violation::StaleObject {
                replica,
                cluster,
                key,
                expected,
                got,
                last_write,
            } => write!(
                f,
                "{replica}: stale object: {cluster} {key} has {} want {} ({})",
                short(got),
                short(expected),
                write_ref(last_write)
            ),
            Violation::LostDelete {
                replica,
                cluster,
                key,
                last_write,
            } => write!(
                f,
                "{replica}: lost delete: {cluster} {key} still present ({})",
                write_ref(last_write)
            ),
            Violation::DigestMissing { replica } => write!(f, "{replica}: no digest reported"),
            Violation::DigestsDiffer { digests } => {
                write!(f, "digests differ:")?;
                for (r, d) in digests {
                    write!(f, " {r}={}", short(d))?;
                }
                Ok(())
            }
            Violation::QueryFailed {
                replica,
                at_ms,
                error,
            } => write!(f, "{replica}: query at {at_ms} ms failed: {error}"),
            Violation::QueryTooSlow {
                replica,
                at_ms,
                latency_ms,
                bound_ms,
            } => write!(
                f,
                "{replica}: query at {at_ms} ms took {latency_ms:.1} ms > bound {bound_ms} ms"
            ),
            Violation::NoQueriesAnswered { replica } => {
                write!(f, "{replica}: answered no query during the fault")
            }
            Violation::DataAgeMissing { replica, at_ms } => {
                write!(f, "{replica}: answer at {at_ms} ms reports no data age")
            }
            Violation::Overcommit { at_ms, over } => write!(
                f,
                "strict scheduling overcommitted: {over} replica(s) bound beyond what fits at {at_ms} ms"
            ),
            Violation::NotRepaired {
                at_ms,
                over,
                repair_ms,
            } => write!(
                f,
                "{over} replica(s) still bound beyond what fits at {at_ms} ms, more than {repair_ms} ms after the heal"
            ),
            Violation::SlotsUnused { bound, wanted } => write!(
                f,
                "at the end {bound} replica(s) were bound where {wanted} fit and were asked for"
            ),
            Violation::ScheduleUnproven { detail } => {
                write!(f, "scheduling check unproven: {detail}")
            }
            Violation::NoCondition { count, first } => write!(
                f,
                "at the end {count} binding(s) had no Scheduled condition (first: {})",
                first.join(", ")
            ),
            Violation::DataAgeUnderstated {
                replica,
                at_ms,
                reported_s,
                at_least_s,
            } => write!(
                f,
                "{replica}: isolated, yet at {at_ms} ms reported data age {reported_s:.1}s < {at_least_s:.1}s"
            ),
        }
    }
}

fn short(h: &str) -> &str {
    &h[..h.len().min(12)]
}

/// Compares every replica's state with the expected final state and the digests with each
/// other, and checks that no replica lists a `retired` cluster. `last_write` maps
/// (cluster, key) to the number of the last change that touched it.
pub fn check_state(
    expected: &ClusterState,
    retired: &[String],
    last_write: &BTreeMap<(String, String), u64>,
    observed: &[ReplicaObservation],
) -> Vec<Violation> {
    let mut out = Vec::new();
    let lw = |c: &str, k: &str| last_write.get(&(c.to_string(), k.to_string())).copied();
    for obs in observed {
        let replica = obs.replica.clone();
        for cluster in retired.iter().filter(|c| obs.listed.contains(c)) {
            out.push(Violation::RetiredClusterListed {
                replica: replica.clone(),
                cluster: cluster.clone(),
            });
        }
        let state = match &obs.state {
            Ok(s) => s,
            Err(e) => {
                out.push(Violation::Unreachable {
                    replica,
                    error: e.clone(),
                });
                continue;
            }
        };
        for (cluster, want) in expected {
            let Some(got) = state.get(cluster) else {
                out.push(Violation::MissingCluster {
                    replica: replica.clone(),
                    cluster: cluster.clone(),
                });
                continue;
            };
            for (key, hash) in want {
                match got.get(key) {
                    None => out.push(Violation::LostWrite {
                        replica: replica.clone(),
                        cluster: cluster.clone(),
                        key: key.clone(),
                        last_write: lw(cluster, key),
                    }),
                    Some(h) if h != hash => out.push(Violation::StaleObject {
                        replica: replica.clone(),
                        cluster: cluster.clone(),
                        key: key.clone(),
                        expected: hash.clone(),
                        got: h.clone(),
                        last_write: lw(cluster, key),
                    }),
                    Some(_) => {}
                }
            }
            for key in got.keys().filter(|k| !want.contains_key(*k)) {
                out.push(Violation::LostDelete {
                    replica: replica.clone(),
                    cluster: cluster.clone(),
                    key: key.clone(),
                    last_write: lw(cluster, key),
                });
            }
        }
    }
    let mut digests = BTreeMap::new();
    for obs in observed {
        match &obs.digest {
            Some(d) => {
                digests.insert(obs.replica.clone(), d.clone());
            }
            None => out.push(Violation::DigestMissing {
                replica: obs.replica.clone(),
            }),
        }
    }
    let mut distinct: Vec<&String> = digests.values().collect();
    distinct.sort();
    distinct.dedup();
    if distinct.len() > 1 {
        out.push(Violation::DigestsDiffer { digests });
    }
    out
}

/// Checks the queries sent during the fault window against `policy`.
pub fn check_queries(
    replicas: &[String],
    queries: &[QueryRecord],
    policy: &QueryPolicy,
) -> Vec<Violation> {
    let mut out = Vec::new();
    let is_down = |r: &str, t: u64| {
        policy
            .down
            .get(r)
            .is_some_and(|ws| ws.iter().any(|w| w.contains(t)))
    };
    for r in replicas {
        let mut answered = 0usize;
        for q in queries.iter().filter(|q| &q.replica == r) {
            if !policy.fault.contains(q.at_ms) || is_down(r, q.at_ms) {
                continue;
            }
            match &q.outcome {
                QueryOutcome::Failed(e) => out.push(Violation::QueryFailed {
                    replica: r.clone(),
                    at_ms: q.at_ms,
                    error: e.clone(),
                }),
                QueryOutcome::Answered { min_age_s, .. } => {
                    answered += 1;
                    if q.latency_ms > policy.latency_bound_ms {
                        out.push(Violation::QueryTooSlow {
                            replica: r.clone(),
                            at_ms: q.at_ms,
                            latency_ms: q.latency_ms,
                            bound_ms: policy.latency_bound_ms,
                        });
                    }
                    let Some(age) = min_age_s else {
                        out.push(Violation::DataAgeMissing {
                            replica: r.clone(),
                            at_ms: q.at_ms,
                        });
                        continue;
                    };
                    for iso in policy.isolations.iter().filter(|i| &i.replica == r) {
                        if q.at_ms < iso.from_ms {
                            continue;
                        }
                        let cut_off_s = (q.at_ms - iso.from_ms) as f64 / 1000.0;
                        let at_least = cut_off_s - iso.slack_s;
                        if at_least > 0.0 && *age < at_least {
                            out.push(Violation::DataAgeUnderstated {
                                replica: r.clone(),
                                at_ms: q.at_ms,
                                reported_s: *age,
                                at_least_s: at_least,
                            });
                        }
                    }
                }
            }
        }
        if answered == 0 {
            out.push(Violation::NoQueriesAnswered { replica: r.clone() });
        }
    }
    out
}

/// The bindings of a scheduler scenario at one instant, as the Karmada API server holds them.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BindSample {
    /// When (ms since the scenario started).
    pub at_ms: u64,
    /// Bindings that exist.
    pub bindings: usize,
    /// Replicas bound per member cluster (`spec.clusters`).
    pub bound: BTreeMap<String, i64>,
    /// Bindings without a `Scheduled` condition.
    pub without_condition: Vec<String>,
}

impl BindSample {
    /// Replicas bound beyond what fits, summed over clusters (a cluster absent from `fit` fits
    /// none).
    pub fn over(&self, fit: &BTreeMap<String, i64>) -> i64 {
        self.bound
            .iter()
            .map(|(c, b)| (b - fit.get(c).copied().unwrap_or(0)).max(0))
            .sum()
    }

    /// Replicas bound in all clusters.
    pub fn total(&self) -> i64 {
        self.bound.values().sum()
    }
}

/// The rules a scheduler scenario is held to.
#[derive(Debug, Clone)]
pub struct SchedulePolicy {
    /// Replicas of the workload that fit, per cluster (measured before the fault).
    pub fit: BTreeMap<String, i64>,
    /// Bindings created (one replica each).
    pub bindings: usize,
    /// When the fault ended (ms since the scenario started).
    pub heal_ms: u64,
    /// Bindings must hold no more than fits this long after the heal.
    pub repair_ms: u64,
    /// No sample may ever hold more than fits (strict mode).
    pub strict: bool,
}

/// Figures of a scheduler scenario.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ScheduleSummary {
    /// Largest overcommit seen (replicas beyond what fits) and when.
    pub worst_over: i64,
    /// When the worst overcommit was first seen.
    pub worst_at_ms: Option<u64>,
    /// Total time any overcommit lasted (sum of the sample intervals that began over).
    pub over_ms: u64,
    /// From the heal to the first sample after which nothing was over again; `None` when
    /// nothing was over after the heal.
    pub repaired_after_heal_ms: Option<u64>,
    /// Replicas bound at the last sample.
    pub final_bound: i64,
}

/// Checks a scheduler scenario's samples (in time order) against `p`.
pub fn check_schedule(
    samples: &[BindSample],
    p: &SchedulePolicy,
) -> (ScheduleSummary, Vec<Violation>) {
    let mut sum = ScheduleSummary::default();
    let mut out = Vec::new();
    let mut last_over_after_heal = None;
    for (i, s) in samples.iter().enumerate() {
        let over = s.over(&p.fit);
        if over > sum.worst_over {
            sum.worst_over = over;
            sum.worst_at_ms = Some(s.at_ms);
        }
        if over > 0 {
            if let Some(next) = samples.get(i + 1) {
                sum.over_ms += next.at_ms.saturating_sub(s.at_ms);
            }
            if p.strict
                && !out
                    .iter()
                    .any(|v| matches!(v, Violation::Overcommit { .. }))
            {
                out.push(Violation::Overcommit {
                    at_ms: s.at_ms,
                    over,
                });
            }
            if s.at_ms >= p.heal_ms {
                last_over_after_heal = Some(i);
            }
            if s.at_ms > p.heal_ms + p.repair_ms
                && !out
                    .iter()
                    .any(|v| matches!(v, Violation::NotRepaired { .. }))
            {
                out.push(Violation::NotRepaired {
                    at_ms: s.at_ms,
                    over,
                    repair_ms: p.repair_ms,
                });
            }
        }
    }
    sum.repaired_after_heal_ms = last_over_after_heal.map(|i| {
        samples
            .get(i + 1)
            .map_or(u64::MAX, |n| n.at_ms.saturating_sub(p.heal_ms))
    });
    match samples.last() {
        None => out.push(Violation::ScheduleUnproven {
            detail: "no sample of the bindings was taken".into(),
        }),
        Some(last) => {
            if last.at_ms <= p.heal_ms + p.repair_ms {
                out.push(Violation::ScheduleUnproven {
                    detail: format!(
                        "the last sample ({} ms) is not past the repair bound ({} ms after the heal at {} ms)",
                        last.at_ms, p.repair_ms, p.heal_ms
                    ),
                });
            }
            sum.final_bound = last.total();
            let fit: i64 = p.fit.values().sum();
            let wanted = fit.min(p.bindings as i64);
            if sum.final_bound < wanted {
                out.push(Violation::SlotsUnused {
                    bound: sum.final_bound,
                    wanted,
                });
            }
            if !last.without_condition.is_empty() {
                out.push(Violation::NoCondition {
                    count: last.without_condition.len(),
                    first: last.without_condition.iter().take(5).cloned().collect(),
                });
            }
        }
    }
    (sum, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(objs: &[(&str, &str, &str)]) -> ClusterState {
        let mut s = ClusterState::new();
        for (c, k, h) in objs {
            s.entry(c.to_string())
                .or_default()
                .insert(k.to_string(), h.to_string());
        }
        s
    }

    fn obs(r: &str, s: ClusterState, d: &str) -> ReplicaObservation {
        ReplicaObservation {
            replica: r.into(),
            listed: s.keys().cloned().collect(),
            state: Ok(s),
            digest: Some(d.into()),
        }
    }

    #[test]
    fn identical_states_and_equal_digests_pass() {
        let want = state(&[("a", "Node/n1", "h1"), ("b", "Node/n2", "h2")]);
        let o = vec![obs("r1", want.clone(), "d"), obs("r2", want.clone(), "d")];
        assert_eq!(check_state(&want, &[], &BTreeMap::new(), &o), vec![]);
    }

    #[test]
    fn a_missing_last_write_is_reported_with_its_change_number() {
        let want = state(&[("a", "Node/n1", "h1"), ("a", "Node/n9", "h9")]);
        let lagging = state(&[("a", "Node/n1", "h1")]);
        let lw: BTreeMap<_, _> = [(("a".to_string(), "Node/n9".to_string()), 17u64)].into();
        let v = check_state(
            &want,
            &[],
            &lw,
            &[obs("r1", want.clone(), "d"), obs("r2", lagging, "d")],
        );
        assert_eq!(
            v,
            vec![Violation::LostWrite {
                replica: "r2".into(),
                cluster: "a".into(),
                key: "Node/n9".into(),
                last_write: Some(17)
            }]
        );
        assert!(v[0].to_string().contains("write #17"));
    }

    #[test]
    fn stale_versions_lost_deletes_and_digest_splits_are_reported() {
        let want = state(&[("a", "ResourceClaim/ml/c1", "new")]);
        let old = state(&[("a", "ResourceClaim/ml/c1", "old"), ("a", "Node/gone", "x")]);
        let v = check_state(
            &want,
            &[],
            &BTreeMap::new(),
            &[obs("r1", want.clone(), "d1"), obs("r2", old, "d2")],
        );
        assert!(matches!(&v[0], Violation::StaleObject { replica, .. } if replica == "r2"));
        assert!(matches!(&v[1], Violation::LostDelete { key, .. } if key == "Node/gone"));
        assert!(matches!(&v[2], Violation::DigestsDiffer { digests } if digests.len() == 2));
        assert_eq!(v.len(), 3);
    }

    #[test]
    fn a_retired_cluster_still_listed_fails_and_one_gone_everywhere_passes() {
        let want = state(&[("a", "Node/n1", "h1")]);
        let mut lagging = obs("r2", want.clone(), "d");
        lagging.listed.push("b".into());
        let v = check_state(
            &want,
            &["b".to_string()],
            &BTreeMap::new(),
            &[obs("r1", want.clone(), "d"), lagging],
        );
        assert_eq!(
            v,
            vec![Violation::RetiredClusterListed {
                replica: "r2".into(),
                cluster: "b".into()
            }]
        );
        assert!(v[0].is_state());
        let o = vec![obs("r1", want.clone(), "d"), obs("r2", want.clone(), "d")];
        assert_eq!(
            check_state(&want, &["b".to_string()], &BTreeMap::new(), &o),
            vec![]
        );
    }

    #[test]
    fn unreachable_replicas_and_missing_clusters_fail() {
        let want = state(&[("a", "Node/n1", "h1"), ("b", "Node/n2", "h2")]);
        let only_a = state(&[("a", "Node/n1", "h1")]);
        let v = check_state(
            &want,
            &[],
            &BTreeMap::new(),
            &[
                obs("r1", only_a, "d"),
                ReplicaObservation {
                    replica: "r2".into(),
                    state: Err("connection refused".into()),
                    digest: None,
                    listed: vec![],
                },
            ],
        );
        assert!(v.contains(&Violation::MissingCluster {
            replica: "r1".into(),
            cluster: "b".into()
        }));
        assert!(v.iter().any(|x| matches!(x, Violation::Unreachable { .. })));
        assert!(
            v.iter()
                .any(|x| matches!(x, Violation::DigestMissing { .. }))
        );
        assert!(v.iter().all(Violation::is_state));
    }

    fn q(r: &str, at: u64, lat: f64, age: Option<f64>) -> QueryRecord {
        QueryRecord {
            replica: r.into(),
            at_ms: at,
            latency_ms: lat,
            outcome: QueryOutcome::Answered {
                clusters: 3,
                min_age_s: age,
                max_age_s: age,
            },
        }
    }

    fn policy() -> QueryPolicy {
        QueryPolicy {
            latency_bound_ms: 500.0,
            fault: Window {
                start_ms: 1000,
                end_ms: 11000,
            },
            down: BTreeMap::new(),
            isolations: vec![],
        }
    }

    #[test]
    fn queries_within_bounds_pass_and_outside_the_window_are_ignored() {
        let r = vec!["r1".to_string()];
        let qs = vec![
            q("r1", 500, 9000.0, None), // before the fault: not judged
            q("r1", 2000, 12.0, Some(1.0)),
            q("r1", 5000, 499.0, Some(2.0)),
        ];
        assert_eq!(check_queries(&r, &qs, &policy()), vec![]);
    }

    #[test]
    fn slow_failed_ageless_and_silent_replicas_are_reported() {
        let r = vec!["r1".to_string(), "r2".to_string()];
        let mut qs = vec![q("r1", 2000, 800.0, Some(1.0)), q("r1", 3000, 5.0, None)];
        qs.push(QueryRecord {
            replica: "r1".into(),
            at_ms: 4000,
            latency_ms: 2000.0,
            outcome: QueryOutcome::Failed("timed out".into()),
        });
        let v = check_queries(&r, &qs, &policy());
        assert!(matches!(&v[0], Violation::QueryTooSlow { at_ms: 2000, .. }));
        assert!(matches!(
            &v[1],
            Violation::DataAgeMissing { at_ms: 3000, .. }
        ));
        assert!(matches!(&v[2], Violation::QueryFailed { at_ms: 4000, .. }));
        assert_eq!(
            v[3],
            Violation::NoQueriesAnswered {
                replica: "r2".into()
            }
        );
        assert_eq!(v.len(), 4);
    }

    #[test]
    fn down_windows_excuse_failures_and_isolated_replicas_must_age() {
        let r = vec!["r1".to_string()];
        let mut p = policy();
        p.down.insert(
            "r1".into(),
            vec![Window {
                start_ms: 2000,
                end_ms: 4000,
            }],
        );
        p.isolations.push(Isolation {
            replica: "r1".into(),
            from_ms: 1000,
            slack_s: 2.0,
        });
        let qs = vec![
            QueryRecord {
                replica: "r1".into(),
                at_ms: 3000,
                latency_ms: 1.0,
                outcome: QueryOutcome::Failed("refused".into()),
            },
            q("r1", 2500, 1.0, Some(0.0)),  // down window: ignored
            q("r1", 9000, 1.0, Some(7.5)),  // cut off 8 s, slack 2: >= 6 ok
            q("r1", 10000, 1.0, Some(1.0)), // claims fresh data while cut off 9 s
        ];
        let v = check_queries(&r, &qs, &p);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(matches!(
            &v[0],
            Violation::DataAgeUnderstated { at_ms: 10000, .. }
        ));
    }

    fn bind(at_ms: u64, c1: i64, c2: i64) -> BindSample {
        BindSample {
            at_ms,
            bindings: 30,
            bound: BTreeMap::from([("c1".into(), c1), ("c2".into(), c2)]),
            without_condition: vec![],
        }
    }

    fn sched_policy(strict: bool) -> SchedulePolicy {
        SchedulePolicy {
            fit: BTreeMap::from([("c1".into(), 5), ("c2".into(), 4)]),
            bindings: 30,
            heal_ms: 10_000,
            repair_ms: 2_000,
            strict,
        }
    }

    #[test]
    fn overcommit_during_the_cut_repaired_in_time_passes_the_available_mode() {
        let s = [
            bind(5_000, 5, 4),
            bind(8_000, 10, 4),
            bind(10_000, 10, 8),
            bind(11_000, 5, 4),
            bind(13_000, 5, 4),
        ];
        let (sum, v) = check_schedule(&s, &sched_policy(false));
        assert!(v.is_empty(), "{v:?}");
        assert_eq!(sum.worst_over, 9);
        assert_eq!(sum.worst_at_ms, Some(10_000));
        assert_eq!(sum.over_ms, 3_000);
        assert_eq!(sum.repaired_after_heal_ms, Some(1_000));
        assert_eq!(sum.final_bound, 9);
        let (_, v) = check_schedule(&s, &sched_policy(true));
        assert!(
            matches!(
                v.as_slice(),
                [Violation::Overcommit {
                    at_ms: 8_000,
                    over: 5
                }]
            ),
            "{v:?}"
        );
    }

    #[test]
    fn overcommit_past_the_repair_bound_unused_slots_and_missing_conditions_fail() {
        let mut last = bind(14_000, 3, 4);
        last.without_condition = vec!["b1".into()];
        let s = [bind(9_000, 6, 4), bind(12_500, 6, 4), last];
        let (sum, v) = check_schedule(&s, &sched_policy(false));
        assert_eq!(sum.repaired_after_heal_ms, Some(4_000));
        assert!(
            matches!(
                v[0],
                Violation::NotRepaired {
                    at_ms: 12_500,
                    over: 1,
                    repair_ms: 2_000
                }
            ),
            "{v:?}"
        );
        assert!(
            matches!(
                v[1],
                Violation::SlotsUnused {
                    bound: 7,
                    wanted: 9
                }
            ),
            "{v:?}"
        );
        assert!(
            matches!(&v[2], Violation::NoCondition { count: 1, .. }),
            "{v:?}"
        );
        assert_eq!(v.len(), 3);
    }

    #[test]
    fn samples_that_end_before_the_repair_bound_prove_nothing() {
        let (_, v) = check_schedule(&[bind(11_000, 5, 4)], &sched_policy(false));
        assert!(
            matches!(v.as_slice(), [Violation::ScheduleUnproven { .. }]),
            "{v:?}"
        );
        let (_, v) = check_schedule(&[], &sched_policy(false));
        assert!(
            matches!(v.as_slice(), [Violation::ScheduleUnproven { .. }]),
            "{v:?}"
        );
    }
}
