//! When the room a scheduler decision reserved is given back before its TTL: the decision
//! is not in the binding's `spec.clusters`.
//!
//! A scheduler replica holds the replicas a decision adds to a cluster as a reservation
//! *before* it writes the decision to the binding (see the replica's scheduler loop). If the
//! replica dies, or its write fails for good, between the two, the reservation would hold
//! the room until its TTL (minutes). The reservation therefore names its decision
//! ([`DecisionRef`]: the binding, the generation decided on, the replicas the cluster gets),
//! and once the decision had time to be written ([`DecisionRef::void_after`]: the deciding
//! replica's settle window plus [`VOID_GRACE`]) every replica that sees the binding judges
//! it with [`void`]: a decision the binding does not show holds nothing.
//!
//! A decision's spec write also sets the binding's [`DECIDED_BY`] annotation (`<replica>/<generation>`),
//! so when two replicas decided the same generation (a takeover of a dead replica's binding,
//! members seen differently for a moment) the one whose write landed is known, and the other's
//! reservation is void even though the binding holds the same cluster.
//!
//! Why any replica may judge another's reservation: the verdict is a function of the
//! replicated record and the binding as the Karmada API server serves it, so every replica
//! that sees the same binding version reaches the same one; and the deciding replica never
//! starts a write of the decision later than [`DecisionRef::write_deadline`] after it made the
//! reservation, which is [`VOID_GRACE`] − [`WRITE_WINDOW`] before any replica (which first
//! saw the reservation no earlier than its owner made it) may void it. A write cannot land
//! on room already given away unless the API server applies it that much later than it
//! was sent.

use std::time::Duration;

use dramesh_estimator::TargetCluster;
use serde::{Deserialize, Serialize};

/// How long after the settle window a decision's reservation waits for the decision to
/// show in the binding before it is void: the deciding replica stops starting writes
/// [`WRITE_WINDOW`] after the window, and the rest covers a write in flight and the binding's
/// watch event reaching the judging replica (both well under a second on a healthy control
/// plane), so a decision that was written is never judged unwritten.
pub const VOID_GRACE: Duration = Duration::from_secs(5);

/// How long after the settle window the deciding replica may still start writing a
/// decision (a before-write confirmation, the resource template read, a conflict's re-read
/// happen in it). Past it the decision is dropped, its reservations released, and the
/// binding decided again.
pub const WRITE_WINDOW: Duration = Duration::from_secs(2);

/// The annotation a decision's spec write sets on the binding, `<replica>/<generation>`: which
/// replica's decision for which generation the spec holds. Without it, a replica taking over
/// a dead replica's binding and writing the same cluster would make the dead replica's
/// unwritten reservation look written.
pub const DECIDED_BY: &str = "scheduler.dramesh.io/decision";

/// The value of [`DECIDED_BY`] for `replica`'s decision for `generation`.
pub fn decided_by(replica: &str, generation: i64) -> String {
    format!("{replica}/{generation}")
}

/// The decision a scheduler reservation holds: optional in the reservation record (records
/// without it, and those of replicas that predate it, end at their TTL as before).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DecisionRef {
    /// `ResourceBinding` or `ClusterResourceBinding`.
    pub kind: String,
    /// The binding's namespace (empty for a ClusterResourceBinding).
    #[serde(default)]
    pub namespace: String,
    /// The binding's name.
    pub name: String,
    /// The binding's `metadata.uid`: a binding deleted and created again under the same name
    /// is another binding.
    #[serde(default)]
    pub uid: String,
    /// The `metadata.generation` the decision was made for.
    pub generation: i64,
    /// The replicas the decision gives the reservation's cluster (the binding's previous
    /// replicas there included).
    pub target: i64,
    /// The deciding replica's settle window, in ms: every replica judges by the decider's.
    pub settle_ms: u64,
}

impl DecisionRef {
    /// How long after a replica first saw the reservation it may be void.
    pub fn void_after(&self) -> Duration {
        Duration::from_millis(self.settle_ms).saturating_add(VOID_GRACE)
    }

    /// How long after the deciding replica made the reservation it may still start a write
    /// of the decision.
    pub fn write_deadline(&self) -> Duration {
        Duration::from_millis(self.settle_ms).saturating_add(WRITE_WINDOW)
    }
}

/// The binding a reservation names, as the judging replica's watch cache holds it.
#[derive(Debug, Clone, Copy)]
pub enum Served<'a> {
    /// The watch has not listed every binding yet (or the binding does not decode): nothing
    /// can be said.
    Unknown,
    /// Listed, and not there: deleted.
    Absent,
    /// The binding now.
    Present {
        /// `metadata.uid`.
        uid: &'a str,
        /// `metadata.generation`.
        generation: i64,
        /// `spec.clusters`.
        clusters: &'a [TargetCluster],
        /// Its [`DECIDED_BY`] annotation, if any.
        decided_by: Option<&'a str>,
    },
}

/// Why a decision's reservation is void.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Void {
    /// The binding is gone (or was created again: another uid).
    Deleted,
    /// The binding is still at the generation decided on (or older) and does not give the
    /// cluster the decided replicas: the decision was never written.
    NotWritten,
    /// The binding moved on to a newer generation without the cluster.
    MovedOn,
    /// Another replica's decision for the same generation is the one written.
    Superseded,
}

impl Void {
    /// The reason a reservation status reports.
    pub fn reason(self, d: &DecisionRef, cluster: &str) -> String {
        let b = if d.namespace.is_empty() {
            format!("{} {}", d.kind, d.name)
        } else {
            format!("{} {}/{}", d.kind, d.namespace, d.name)
        };
        match self {
            Void::Deleted => format!("void: {b} was deleted"),
            Void::NotWritten => format!(
                "void: the decision for generation {} ({} replicas on {cluster}) was never written to {b}",
                d.generation, d.target
            ),
            Void::MovedOn => format!(
                "void: {b} moved on past generation {} without {cluster}",
                d.generation
            ),
            Void::Superseded => format!(
                "void: another replica's decision for generation {} was written to {b}",
                d.generation
            ),
        }
    }
}

/// Whether the reservation of replica `owner` on `cluster` holding decision `d`, first seen
/// `age` ago on the judging replica, is void given the binding as `served`. Before
/// [`DecisionRef::void_after`] it never is (the decision may still be on its way).
pub fn void(
    owner: &str,
    d: &DecisionRef,
    cluster: &str,
    age: Duration,
    served: Served<'_>,
) -> Option<Void> {
    if age < d.void_after() {
        return None;
    }
    let (uid, generation, clusters, by) = match served {
        Served::Unknown => return None,
        Served::Absent => return Some(Void::Deleted),
        Served::Present {
            uid,
            generation,
            clusters,
            decided_by,
        } => (uid, generation, clusters, decided_by),
    };
    if !d.uid.is_empty() && !uid.is_empty() && uid != d.uid {
        return Some(Void::Deleted);
    }
    let assigned = clusters
        .iter()
        .find(|t| t.name == cluster)
        .map_or(0, |t| t.replicas);
    if generation < d.generation {
        // This replica's watch is behind what the decider read: it cannot judge.
        return None;
    }
    if generation > d.generation {
        // A newer spec: a decision's write or a later change. The last decision written
        // names itself: another replica's for this generation means this one never landed.
        let last = by.and_then(|v| v.rsplit_once('/'));
        if let Some((who, g)) = last
            && g.parse::<i64>().ok() == Some(d.generation)
            && who != owner
        {
            return Some(Void::Superseded);
        }
        // This decision, or a later one: with the cluster still in it the room may be in
        // use; without it, it is not.
        return (assigned == 0).then_some(Void::MovedOn);
    }
    // The spec decided on: a written decision changes the spec, so the generation moves;
    // one that only re-adds what the binding holds leaves it, with the replicas there.
    (assigned < d.target).then_some(Void::NotWritten)
}

/// Whether the binding as `served` holds `owner`'s decision `d` as the last one written: its
/// [`DECIDED_BY`] annotation names that decision, for the same binding. Its reservations then
/// guard room the binding uses; if one loses overcommit resolution, the decision must be
/// placed again, which its decider does, or, once the decider is gone, the binding's new
/// owner.
pub fn last_written(owner: &str, d: &DecisionRef, served: Served<'_>) -> bool {
    let Served::Present {
        uid,
        decided_by: by,
        ..
    } = served
    else {
        return false;
    };
    (d.uid.is_empty() || uid.is_empty() || uid == d.uid)
        && by == Some(decided_by(owner, d.generation).as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision() -> DecisionRef {
        DecisionRef {
            kind: "ResourceBinding".into(),
            namespace: "ml".into(),
            name: "llm".into(),
            uid: "u1".into(),
            generation: 3,
            target: 4,
            settle_ms: 500,
        }
    }

    fn at(clusters: &[(&str, i64)]) -> Vec<TargetCluster> {
        clusters
            .iter()
            .map(|(n, r)| TargetCluster {
                name: n.to_string(),
                replicas: *r,
            })
            .collect()
    }

    /// Binding states × reservation ages: the verdict for the reservation on `c0`.
    #[test]
    fn the_void_rule_table() {
        let d = decision();
        let young = Duration::from_millis(5_499);
        let old = Duration::from_millis(5_500);
        let none = at(&[]);
        let written = at(&[("c0", 4), ("c1", 2)]);
        let partly = at(&[("c0", 2)]);
        let elsewhere = at(&[("c1", 4)]);
        let present = |uid, generation, clusters| Served::Present {
            uid,
            generation,
            clusters,
            decided_by: None,
        };
        let by = |who: &'static str, generation, clusters| Served::Present {
            uid: "u1",
            generation,
            clusters,
            decided_by: Some(who),
        };
        let cases: Vec<(&str, Served<'_>, Option<Void>)> = vec![
            ("watch not listed", Served::Unknown, None),
            ("deleted", Served::Absent, Some(Void::Deleted)),
            (
                "created again",
                present("u2", 1, &written),
                Some(Void::Deleted),
            ),
            (
                "never written",
                present("u1", 3, &none),
                Some(Void::NotWritten),
            ),
            (
                "scale-up never written",
                present("u1", 3, &partly),
                Some(Void::NotWritten),
            ),
            ("written", present("u1", 4, &written), None),
            ("re-added, spec unchanged", present("u1", 3, &written), None),
            ("moved on with the cluster", present("u1", 6, &partly), None),
            (
                "moved on without the cluster",
                present("u1", 6, &elsewhere),
                Some(Void::MovedOn),
            ),
            ("a watch behind the decider", present("u1", 2, &none), None),
            ("served without a uid", present("", 4, &written), None),
            ("written by its owner", by("r1/3", 4, &written), None),
            (
                "another replica's decision written instead",
                by("r2/3", 4, &written),
                Some(Void::Superseded),
            ),
            (
                "another replica's later decision, the cluster kept",
                by("r2/5", 6, &written),
                None,
            ),
            (
                "its own decision, then moved on without the cluster",
                by("r1/3", 6, &elsewhere),
                Some(Void::MovedOn),
            ),
            ("an unreadable annotation", by("r2", 4, &written), None),
        ];
        for (what, served, want) in cases {
            assert_eq!(void("r1", &d, "c0", young, served), None, "{what}, young");
            assert_eq!(void("r1", &d, "c0", old, served), want, "{what}, old");
        }
    }

    #[test]
    fn the_last_decision_written_is_the_one_its_annotation_names() {
        let d = decision();
        let written = at(&[("c0", 4)]);
        let by = |uid, who| Served::Present {
            uid,
            generation: 4,
            clusters: &written,
            decided_by: who,
        };
        assert!(last_written("r1", &d, by("u1", Some("r1/3"))));
        assert!(
            last_written("r1", &d, by("", Some("r1/3"))),
            "served without a uid"
        );
        assert!(!last_written("r2", &d, by("u1", Some("r1/3"))), "another's");
        assert!(
            !last_written("r1", &d, by("u1", Some("r1/5"))),
            "a later one"
        );
        assert!(!last_written("r1", &d, by("u1", None)), "none written");
        assert!(
            !last_written("r1", &d, by("u2", Some("r1/3"))),
            "created again"
        );
        assert!(!last_written("r1", &d, Served::Absent));
        assert!(!last_written("r1", &d, Served::Unknown));
    }

    #[test]
    fn every_replica_judges_by_the_deciders_window() {
        let mut d = decision();
        d.settle_ms = 2_000;
        assert_eq!(d.void_after(), Duration::from_secs(7));
        assert_eq!(d.write_deadline(), Duration::from_secs(4));
        // The owner stops writing well before anyone may void.
        assert!(d.void_after() - d.write_deadline() >= Duration::from_secs(3));
        let served = Served::Absent;
        assert_eq!(
            void("r1", &d, "c0", Duration::from_millis(6_999), served),
            None
        );
        assert_eq!(
            void("r1", &d, "c0", Duration::from_secs(7), served),
            Some(Void::Deleted)
        );
    }

    #[test]
    fn reasons_name_the_binding_and_the_cluster() {
        let d = decision();
        assert_eq!(
            Void::NotWritten.reason(&d, "c0"),
            "void: the decision for generation 3 (4 replicas on c0) was never written to ResourceBinding ml/llm"
        );
        let mut crb = d.clone();
        crb.kind = "ClusterResourceBinding".into();
        crb.namespace = String::new();
        assert_eq!(
            Void::MovedOn.reason(&crb, "c0"),
            "void: ClusterResourceBinding llm moved on past generation 3 without c0"
        );
        // The wire form: camelCase, all but namespace and uid required.
        let json = serde_json::to_value(&d).unwrap();
        assert_eq!(json["settleMs"], 500);
        let back: DecisionRef = serde_json::from_value(json).unwrap();
        assert_eq!(back, d);
    }
}
