//! Work shared across scheduler replicas: which live replica owns a binding.
//!
//! Replicas with the same scheduler name split the bindings among themselves by rendezvous
//! (highest-random-weight) hashing: a binding's key (its `metadata.uid`) is hashed with each
//! member's id and the member with the highest weight owns it. Guarantees:
//! - **Deterministic**: the owner is a function of the key and the member *set* alone (not
//!   its order, not the process, not the Rust version): replicas that see the same members
//!   agree on every owner.
//! - **Minimal movement**: when a member leaves, only its keys move (each to the member with
//!   its next-highest weight); when one joins, only the keys it now wins move, to it.
//! - **Balance**: each of `n` members owns about `1/n` of the keys (a 64-bit hash with a full
//!   avalanche finalizer, so similar ids and keys do not correlate).

/// The member of `members` that owns `key`, `None` when there is none. Equal weights (a
/// 64-bit collision) go to the lower id, so even then the answer does not depend on order.
pub fn owner<'a, S: AsRef<str>>(key: &str, members: &'a [S]) -> Option<&'a str> {
    members
        .iter()
        .map(AsRef::as_ref)
        .max_by(|a, b| weight(a, key).cmp(&weight(b, key)).then_with(|| b.cmp(a)))
}

/// The rendezvous weight of `member` for `key`: FNV-1a 64 over the member id, a separator
/// byte no id contains, and the key, then MurmurHash3's 64-bit finalizer (FNV alone mixes
/// its last bytes poorly, which skews the maximum over members).
pub fn weight(member: &str, key: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    for b in member.bytes().chain([0xff]).chain(key.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(PRIME);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn keys(n: usize) -> Vec<String> {
        // Shaped like Kubernetes uids.
        (0..n)
            .map(|i| format!("5f0c{i:04x}-9a1e-4c2b-8d3f-{:012x}", i * 7919))
            .collect()
    }

    fn shares(members: &[&str], keys: &[String]) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for k in keys {
            *out.entry(owner(k, members).unwrap().to_string())
                .or_default() += 1;
        }
        out
    }

    #[test]
    fn three_members_get_a_third_each_within_a_few_percent() {
        let keys = keys(30_000);
        let s = shares(&["replica-a", "replica-b", "replica-c"], &keys);
        assert_eq!(s.len(), 3, "{s:?}");
        for (m, n) in &s {
            let share = *n as f64 / keys.len() as f64;
            assert!((share - 1.0 / 3.0).abs() < 0.02, "{m}: {share:.4} ({s:?})");
        }
    }

    #[test]
    fn only_the_leavers_keys_move_and_a_joiner_takes_only_what_it_wins() {
        let keys = keys(10_000);
        let three = ["r1", "r2", "r3"];
        let two = ["r1", "r3"];
        let mut moved = 0;
        for k in &keys {
            let before = owner(k, &three).unwrap();
            let after = owner(k, &two).unwrap();
            if before == "r2" {
                moved += 1;
                assert_ne!(after, "r2");
            } else {
                assert_eq!(before, after, "{k} moved though its owner stayed");
            }
        }
        assert!(moved > 2_500 && moved < 4_200, "r2 owned {moved}");
        // r2 joining back takes exactly what it had.
        for k in &keys {
            let with = owner(k, &three).unwrap();
            if with != "r2" {
                assert_eq!(with, owner(k, &two).unwrap());
            }
        }
    }

    #[test]
    fn the_owner_does_not_depend_on_member_order_and_none_has_no_owner() {
        for k in keys(500) {
            let a = owner(&k, &["x", "y", "z"]);
            assert_eq!(a, owner(&k, &["z", "x", "y"]));
            assert_eq!(a, owner(&k, &["y", "z", "x"]));
        }
        assert_eq!(owner::<&str>("k", &[]), None);
        assert_eq!(owner("k", &["only"]), Some("only"));
    }

    #[test]
    fn weights_are_stable_across_builds() {
        // Replicas of different versions must agree: the weight is a fixed function.
        assert_eq!(weight("r1", "uid-1"), weight("r1", "uid-1"));
        assert_ne!(weight("r1", "uid-1"), weight("r2", "uid-1"));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(weight("ab", "c"), weight("a", "bc"));
        // Golden values: changing the function would split the work differently on
        // replicas of different versions.
        assert_eq!(weight("r1", "uid-1"), 0x499284bf49e9a7f5);
        assert_eq!(weight("replica-a", "5f0c"), 0x3a5b6b932b7f1154);
    }
}
