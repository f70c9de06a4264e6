//! Acknowledgements for strict scheduling (`--scheduler-confirm strict`): which replica has
//! applied which of the others' reservations, and the rule that confirms a reservation only
//! once a majority of the scheduler's replicas hold it.
//!
//! Every replica with the role writes one ack record, `meta/_ack.<id>`, into its own
//! reservation document: `seq`, the sequence number of its latest reservation (written after
//! that reservation, so a replica that has applied the record has applied every reservation of
//! the writer up to `seq`, releases included: a document's changes apply in causal order), and
//! `acks`, for every other replica, the `seq` of that replica's ack record as the writer has
//! applied it. A replica's records never go back: each is composed from the one queued
//! before it ([`own_record`]) and queued in the order composed.
//!
//! [`confirmed`] holds for reservation `(me, s)` when `me` and enough other replicas to make a
//! majority of the `members` have each published `acks[me] >= s`, and `me` has applied every
//! reservation those records acknowledge (for every replica `p` they list, `me` holds `p`'s ack
//! record with a `seq` at least as high). The guarantee this gives, with strict judging (a
//! confirmed reservation is written only if it fits with every other live reservation the
//! confirmer holds deducted): of two reservations that conflict, at most one is confirmed.
//! Their majorities share a replica `m`; `m`'s ack records are totally ordered, and the later of
//! the two that the confirmers used acknowledges both reservations, so its user had applied the
//! other reservation before judging its own, and refused it. Clocks play no part; the
//! settle window only bounds how long a decision waits for its majority.

use std::collections::BTreeMap;

use dramesh_model::ObjectKey;
use serde::{Deserialize, Serialize};

/// The prefix of the ack record's key name (followed by the replica id).
pub(crate) const ACK_PREFIX: &str = "_ack.";

/// One replica's acknowledgements (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct AckRecord {
    /// The sequence number of the writer's latest reservation (0: none).
    pub(crate) seq: u64,
    /// For every other replica: the `seq` of its ack record as the writer has applied it.
    #[serde(default)]
    pub(crate) acks: BTreeMap<String, u64>,
}

/// The ack records known, by replica id.
pub(crate) type Acks = BTreeMap<String, AckRecord>;

/// The store key of replica `replica`'s ack record.
pub(crate) fn ack_key(replica: &str) -> ObjectKey {
    crate::members::meta_key(ACK_PREFIX, replica)
}

/// The replica whose ack record `key` (of the reservation scope) is, if it is one.
pub(crate) fn ack_of(key: &ObjectKey) -> Option<&str> {
    crate::members::meta_of(ACK_PREFIX, key)
}

/// Applies one change of an ack record to `acks`; a record that does not decode is logged
/// and ignored.
pub(crate) fn apply(acks: &mut Acks, change: &dramesh_model::ObjectChange) {
    crate::members::apply_meta(acks, ACK_PREFIX, "ack record", change);
}

/// The ack record replica `me` publishes after `last`, the one it queued last, when its
/// latest reservation is at least `seq` and it holds the records `acks`: never behind `last`
/// in any field. The copy of its own record in `acks` lags behind what was queued until the
/// write is applied, so a record built from it alone could go back, and a later record that
/// acknowledges less than an earlier one breaks the order [`confirmed`]'s guarantee rests on
/// (and stalls confirmations of reservations it no longer covers).
pub(crate) fn own_record(me: &str, seq: u64, acks: &Acks, last: &AckRecord) -> AckRecord {
    let mut record = last.clone();
    record.seq = record.seq.max(seq).max(acks.get(me).map_or(0, |a| a.seq));
    for (r, a) in acks.iter().filter(|(r, _)| *r != me) {
        let s = record.acks.entry(r.clone()).or_default();
        *s = (*s).max(a.seq);
    }
    record
}

/// A majority of `members` replicas: more than half.
pub(crate) fn majority(members: usize) -> usize {
    members / 2 + 1
}

/// Whether replica `me`'s reservation with sequence number `seq` is confirmed: `me` plus the
/// replicas whose ack records in `acks` acknowledge it and whose acknowledgements `me` has
/// applied (see the module docs) make a majority of `members`. `Err` carries how many hold it
/// (`me` included).
pub(crate) fn confirmed(me: &str, seq: u64, acks: &Acks, members: usize) -> Result<(), usize> {
    let applied = |p: &str, s: u64| acks.get(p).is_some_and(|a| a.seq >= s);
    let holders = 1 + acks
        .iter()
        .filter(|(r, a)| {
            *r != me
                && a.acks.get(me).is_some_and(|s| *s >= seq)
                && a.acks.iter().all(|(p, s)| p == me || applied(p, *s))
        })
        .count();
    if holders >= majority(members) {
        Ok(())
    } else {
        Err(holders)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, acks: &[(&str, u64)]) -> AckRecord {
        AckRecord {
            seq,
            acks: acks.iter().map(|(r, s)| (r.to_string(), *s)).collect(),
        }
    }

    #[test]
    fn a_majority_confirms_only_with_what_its_acknowledgements_covered() {
        let mut acks = Acks::new();
        acks.insert("a".into(), rec(10, &[]));
        // b holds a's reservation 10 and c's 7; a has not applied c's 7 yet.
        acks.insert("b".into(), rec(3, &[("a", 10), ("c", 7)]));
        acks.insert("c".into(), rec(5, &[("a", 9)]));
        assert_eq!(confirmed("a", 10, &acks, 3), Err(1));
        // a applies c's record up to 7: b's acknowledgement now counts.
        acks.get_mut("c").unwrap().seq = 7;
        assert_eq!(confirmed("a", 10, &acks, 3), Ok(()));
        // c's acknowledgement of 9 does not cover 10; alone a is no majority of 5.
        assert_eq!(confirmed("a", 10, &acks, 5), Err(2));
        acks.get_mut("c").unwrap().acks.insert("a".into(), 10);
        assert_eq!(confirmed("a", 10, &acks, 5), Ok(()));
        // A replica's own record never counts for it.
        let mut alone = Acks::new();
        alone.insert("a".into(), rec(10, &[("a", 10)]));
        assert_eq!(confirmed("a", 10, &alone, 1), Ok(()));
        assert_eq!(confirmed("a", 10, &alone, 3), Err(1));
        assert_eq!(confirmed("a", 10, &alone, 2), Err(1));
    }

    /// The safety argument, exhaustively on small histories: two replicas each confirm a
    /// reservation from one snapshot of a third's ack records; if both confirmed, the later
    /// snapshot acknowledges both, and its user had applied the other's reservation.
    #[test]
    fn two_confirmers_sharing_an_acknowledger_cannot_both_miss_each_other() {
        // m's successive records: it applies a's and b's reservations (seq 1 each) in either
        // order.
        for a_first in [true, false] {
            let steps: Vec<AckRecord> = if a_first {
                vec![rec(0, &[("a", 1)]), rec(0, &[("a", 1), ("b", 1)])]
            } else {
                vec![rec(0, &[("b", 1)]), rec(0, &[("a", 1), ("b", 1)])]
            };
            for va in &steps {
                for vb in &steps {
                    // What a and b have applied of each other (0 or 1).
                    for a_has_b in [0, 1] {
                        for b_has_a in [0, 1] {
                            let view = |me: &str, other: &str, has: u64, v: &AckRecord| {
                                let mut acks = Acks::new();
                                acks.insert(me.into(), rec(1, &[]));
                                acks.insert(other.into(), rec(has, &[]));
                                acks.insert("m".into(), v.clone());
                                acks
                            };
                            let a_ok = confirmed("a", 1, &view("a", "b", a_has_b, va), 3).is_ok();
                            let b_ok = confirmed("b", 1, &view("b", "a", b_has_a, vb), 3).is_ok();
                            if a_ok && b_ok {
                                assert!(
                                    a_has_b == 1 || b_has_a == 1,
                                    "both confirmed without either seeing the other: {va:?} {vb:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A record composed while a higher one is queued but not yet applied here (the strict
    /// task publishing its reservation's seq, the 20 ms publisher publishing new acks) keeps
    /// what the queued one said.
    #[test]
    fn own_record_never_goes_back_behind_the_one_queued_last() {
        let mut acks = Acks::new();
        acks.insert("a".into(), rec(4, &[("b", 1)]));
        acks.insert("b".into(), rec(9, &[]));
        acks.insert("c".into(), rec(2, &[]));
        let queued = own_record("a", 12, &acks, &AckRecord::default());
        assert_eq!(queued, rec(12, &[("b", 9), ("c", 2)]));
        // c's record moves on; a's own copy still says 4.
        acks.insert("c".into(), rec(3, &[]));
        assert_eq!(
            own_record("a", 0, &acks, &queued),
            rec(12, &[("b", 9), ("c", 3)])
        );
        // An acknowledgement once published is never lowered.
        acks.insert("b".into(), rec(5, &[]));
        assert_eq!(own_record("a", 0, &acks, &queued).acks["b"], 9);
    }

    #[test]
    fn own_record_lists_the_others_seqs_and_keys_round_trip() {
        let mut acks = Acks::new();
        acks.insert("a".into(), rec(4, &[("b", 1)]));
        acks.insert("b".into(), rec(9, &[]));
        assert_eq!(
            own_record("a", 12, &acks, &AckRecord::default()),
            rec(12, &[("b", 9)])
        );
        assert_eq!(ack_of(&ack_key("r2")), Some("r2"));
        assert_eq!(majority(3), 2);
        assert_eq!(majority(4), 3);
        let change = dramesh_model::ObjectChange::Upsert {
            key: ack_key("r2"),
            json: serde_json::to_vec(&rec(3, &[("r1", 2)])).unwrap().into(),
        };
        apply(&mut acks, &change);
        assert_eq!(acks["r2"], rec(3, &[("r1", 2)]));
    }
}
