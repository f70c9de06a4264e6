//! Who shares the scheduler role's work: the replicas that *have the role* (a durable record
//! each writes once into its own reservation document) and that *are alive* (this replica has
//! a mesh session with them and heard from them lately: volatile, so it never enters
//! automerge history).
//!
//! - **Role record**: key `meta/_role.<replica id>` of `("_reservations", <replica id>)`,
//!   JSON [`RoleRecord`] `{"scheduler": <name>}`, written when a sharing scheduler role
//!   starts and deleted when it starts with sharing off. The key names the replica because
//!   the store shows one value per key of the scope (the documents of all replicas are one
//!   scope), and the change feed does not say which document a change came from. `_` starts
//!   no replica id, so the key is never a reservation id (`<owner>-<seq>`); the state routes
//!   it here, never to the reservation table. Replicas trust each other's documents (any
//!   replica can write any reservation), so the key is not checked against its writer.
//! - **Alive**: a replica peer whose hello arrived and that was heard from (any frame; the
//!   mesh heartbeats every second) within [`LIVE_WINDOW`]. A replica killed without a word
//!   leaves the set [`LIVE_WINDOW`] after its last frame, at the latest when its QUIC session
//!   times out (5 s idle).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use dramesh_model::{ObjectKey, ObjectKind};
use serde::{Deserialize, Serialize};

/// The prefix of the role record's key name (followed by the replica id).
pub(crate) const ROLE_PREFIX: &str = "_role.";

/// How long after its last frame a peer replica still counts as alive: three mesh
/// heartbeat periods (1 s each), so one or two late heartbeats on a busy machine do not move
/// the work, and a dead replica's bindings move within this plus one scheduler tick.
pub const LIVE_WINDOW: Duration = Duration::from_secs(3);

/// What a replica with the scheduler role announces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RoleRecord {
    /// Its `--scheduler-name`: replicas with the same one share the bindings.
    pub(crate) scheduler: String,
}

/// The store key of replica `replica`'s metadata record of kind `prefix` (`_role.`,
/// `_ack.`): one key per replica, since the store shows one value per key of the scope.
pub(crate) fn meta_key(prefix: &str, replica: &str) -> ObjectKey {
    ObjectKey::new(ObjectKind::ClusterInfo, None, &format!("{prefix}{replica}"))
}

/// The replica whose metadata record of kind `prefix` `key` (of the reservation scope) is,
/// if it is one.
pub(crate) fn meta_of<'a>(prefix: &str, key: &'a ObjectKey) -> Option<&'a str> {
    if key.kind != ObjectKind::ClusterInfo {
        return None;
    }
    key.name.strip_prefix(prefix).filter(|r| !r.is_empty())
}

/// Applies one change of a metadata record of kind `prefix` to `records`, by replica; a
/// record that does not decode is logged (naming `what`) and ignored.
pub(crate) fn apply_meta<T: serde::de::DeserializeOwned>(
    records: &mut BTreeMap<String, T>,
    prefix: &str,
    what: &str,
    change: &dramesh_model::ObjectChange,
) {
    use dramesh_model::ObjectChange;
    let Some(replica) = meta_of(prefix, change.key()) else {
        return;
    };
    match change {
        ObjectChange::Upsert { json, .. } => match serde_json::from_slice::<T>(json) {
            Ok(r) => {
                records.insert(replica.to_string(), r);
            }
            Err(e) => tracing::warn!(replica, error = %e, "{what} ignored"),
        },
        ObjectChange::Delete { .. } => {
            records.remove(replica);
        }
    }
}

/// The store key of replica `replica`'s role record.
pub(crate) fn role_key(replica: &str) -> ObjectKey {
    meta_key(ROLE_PREFIX, replica)
}

/// The replica whose role record `key` (of the reservation scope) is, if it is one.
pub(crate) fn role_of(key: &ObjectKey) -> Option<&str> {
    meta_of(ROLE_PREFIX, key)
}

/// Applies one change of a role record to `roles`; a record that does not decode is
/// logged and ignored.
pub(crate) fn apply(roles: &mut Roles, change: &dramesh_model::ObjectChange) {
    apply_meta(roles, ROLE_PREFIX, "scheduler role record", change);
}

/// The role records known, by replica id.
pub(crate) type Roles = BTreeMap<String, RoleRecord>;

/// What the scheduler loop learns from the mesh about the other replicas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peers {
    /// Replica ids alive now (see the module docs), this one not included.
    pub alive: BTreeSet<String>,
    /// Whether this replica has caught up with a peer replica once (the readiness rule's
    /// first point): until then it may not know the others' role records, and a sharing
    /// scheduler role decides nothing (it would take every binding for itself).
    pub caught_up: bool,
}

impl Peers {
    /// Every replica given as alive and caught up: for a replica alone, or programs that
    /// exchange reservation documents themselves.
    pub fn fixed(alive: impl IntoIterator<Item = String>) -> Peers {
        Peers {
            alive: alive.into_iter().collect(),
            caught_up: true,
        }
    }
}

/// The members sharing scheduler `name`'s work as seen by replica `me`: itself and every
/// alive replica whose role record names `name`, sorted.
pub(crate) fn members(me: &str, name: &str, roles: &Roles, peers: &Peers) -> Vec<String> {
    let mut out: Vec<String> = peers
        .alive
        .iter()
        .filter(|r| *r != me && roles.get(*r).is_some_and(|x| x.scheduler == name))
        .cloned()
        .collect();
    out.push(me.to_string());
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_have_the_role_under_the_same_name_and_are_alive() {
        let role = |n: &str| RoleRecord {
            scheduler: n.into(),
        };
        let roles: Roles = [
            ("a".to_string(), role("s")),
            ("b".to_string(), role("s")),
            ("c".to_string(), role("other")),
            ("d".to_string(), role("s")),
        ]
        .into();
        // d has the role but is not alive; c is alive with another name; e has no role.
        let peers = Peers::fixed(["b", "c", "e"].map(String::from));
        assert_eq!(members("a", "s", &roles, &peers), ["a", "b"]);
        // Itself always, role record or not (it may not have arrived back yet).
        assert_eq!(members("z", "s", &Roles::new(), &peers), ["z"]);
        assert_eq!(role_of(&role_key("r1")), Some("r1"));
        assert_eq!(
            role_of(&ObjectKey::new(ObjectKind::ClusterInfo, None, "r1-1")),
            None,
            "a reservation's key (`reservation_table::record_key`)"
        );
        // Written, read back, deleted.
        let mut roles = Roles::new();
        let json = serde_json::to_vec(&role("s")).unwrap();
        apply(
            &mut roles,
            &dramesh_model::ObjectChange::Upsert {
                key: role_key("r1"),
                json: std::sync::Arc::from(json.as_slice()),
            },
        );
        assert_eq!(roles.get("r1"), Some(&role("s")));
        apply(
            &mut roles,
            &dramesh_model::ObjectChange::Delete {
                key: role_key("r1"),
            },
        );
        assert!(roles.is_empty());
    }
}
