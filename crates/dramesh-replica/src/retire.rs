//! Retiring member clusters from the fleet, as replicated state.
//!
//! Replica `<id>` records the clusters it retires in its own document
//! `DocId { cluster: "_retired", writer: <id> }` (one tombstone per cluster, under the store's
//! generic key `meta/<cluster>`, value [`Tombstone`] as JSON). The mesh replicates it like the
//! reservation documents, so a retirement written on one side of a partition reaches every
//! replica after the heal, and it is on disk, so it survives restarts.
//!
//! Every replica applies every tombstone it holds, whoever wrote it, whenever one arrives and
//! when it starts: [`dramesh_store::Store::retire_cluster`] drops the cluster's documents from
//! memory, the digest and disk and refuses their generations from then on, so a peer that
//! still holds them (it was partitioned away) cannot bring them back, and neither can the
//! cluster's agents while they run. Then the cluster leaves the view, the unbound-pod index
//! and the freshness map. Only an agent started later with `--rejoin` comes back: it writes
//! a generation that records the rejoin ([`dramesh_store::Store::rejoin`]), which replicas
//! accept; a generation its agent rolls over to by itself (bounded history), or one a fresh
//! data directory starts, carries no later rejoin and is refused however new it is. A
//! replica that took such a generation before the tombstone reached it (partitioned, or
//! restarted) drops it when the tombstone is applied.
//! Concurrent retirements of one cluster by several replicas agree: the latest time wins.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use dramesh_api::ApiError;
use dramesh_api::native::RetiredCluster;
use dramesh_model::{ObjectChange, ObjectKey, ObjectKind};
use dramesh_store::{DocId, RETIRED_SCOPE, valid_segment};
use serde::{Deserialize, Serialize};

use crate::sync::lock;

/// The retirement document written by `replica`.
pub(crate) fn doc_id(replica: &str) -> DocId {
    DocId::new(RETIRED_SCOPE, replica)
}

/// Whether `cluster` (as the store reports changes) is the retirement scope.
pub(crate) fn is_scope(cluster: &str) -> bool {
    cluster == RETIRED_SCOPE
}

/// One retirement as replicated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Tombstone {
    pub(crate) cluster: String,
    pub(crate) retired_at_ms: u64,
    pub(crate) replica: String,
    pub(crate) by: String,
}

impl From<Tombstone> for RetiredCluster {
    fn from(t: Tombstone) -> Self {
        RetiredCluster {
            name: t.cluster,
            retired_at_ms: t.retired_at_ms,
            replica: t.replica,
            by: t.by,
        }
    }
}

/// The retired clusters component of a replica: the latest tombstone of each retired
/// cluster. It owns its lock, a leaf: no method takes another or calls out while holding it.
#[derive(Debug, Default)]
pub(crate) struct RetiredClusters {
    latest: Mutex<BTreeMap<String, Tombstone>>,
}

impl RetiredClusters {
    /// Records the tombstone a change of the retirement scope carries; returns its cluster
    /// and time when it is the latest for that cluster (it moved the bound: the caller
    /// retires the cluster), `None` when it is older than what is known, or does not decode.
    pub(crate) fn record(&self, change: &ObjectChange) -> Option<(String, u64)> {
        let ObjectChange::Upsert { key, json } = change else {
            // Tombstones are never deleted; a delete means nothing here.
            return None;
        };
        let t = match serde_json::from_slice::<Tombstone>(json) {
            Ok(t) if t.cluster == key.name && valid_segment(&t.cluster) => t,
            Ok(t) => {
                tracing::warn!(key = %key, cluster = %t.cluster, "tombstone names another cluster than its key; ignored");
                return None;
            }
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "tombstone does not decode; ignored");
                return None;
            }
        };
        let mut latest = lock(&self.latest);
        match latest.get(&t.cluster) {
            Some(have) if have.retired_at_ms >= t.retired_at_ms => None,
            _ => {
                let out = (t.cluster.clone(), t.retired_at_ms);
                latest.insert(t.cluster.clone(), t);
                Some(out)
            }
        }
    }

    /// Whether `cluster` is retired.
    pub(crate) fn contains(&self, cluster: &str) -> bool {
        lock(&self.latest).contains_key(cluster)
    }

    /// Every retired cluster, by name.
    pub(crate) fn list(&self) -> Vec<RetiredCluster> {
        lock(&self.latest)
            .values()
            .cloned()
            .map(Into::into)
            .collect()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The tombstone of member cluster `name` retired now by this replica (`replica`) on behalf
/// of API identity `by`, and the change that writes it into this replica's retirement
/// document; `InvalidRequest` when `name` is not a valid cluster name.
pub(crate) fn tombstone(
    name: &str,
    replica: &str,
    by: &str,
) -> Result<(Tombstone, ObjectChange), ApiError> {
    if !valid_segment(name) {
        return Err(ApiError::InvalidRequest(format!(
            "retire: cluster name {name:?} is not a valid cluster name"
        )));
    }
    let t = Tombstone {
        cluster: name.to_string(),
        retired_at_ms: now_ms(),
        replica: replica.to_string(),
        by: by.to_string(),
    };
    let json = serde_json::to_vec(&t)
        .map_err(|e| ApiError::Internal(format!("encoding the tombstone: {e}")))?;
    let change = ObjectChange::Upsert {
        key: ObjectKey::new(ObjectKind::ClusterInfo, None, name),
        json: Arc::from(json),
    };
    Ok((t, change))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tombstones of every release's golden data directory (`dramesh-store/tests/golden`)
    /// decode here, and fields a newer release adds are ignored.
    #[test]
    fn tombstones_of_every_release_decode_and_unknown_fields_are_ignored() {
        let mut tombstones = 0;
        for (manifest, key, json) in crate::golden_objects("_retired") {
            let t: Tombstone =
                serde_json::from_slice(&json).unwrap_or_else(|e| panic!("{manifest}: {e}"));
            assert_eq!(key, format!("meta/{}", t.cluster));
            tombstones += 1;
        }
        assert!(tombstones >= 1, "{tombstones}");
        let t: Tombstone = serde_json::from_str(
            r#"{"cluster":"c","retiredAtMs":1,"replica":"r1","by":"admin","reason":"new field"}"#,
        )
        .unwrap();
        assert_eq!(t.cluster, "c");
    }
}
