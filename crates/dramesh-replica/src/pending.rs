//! Unscheduled pods per cluster, for Karmada's `GetUnschedulableReplicas`.
//!
//! Fed from the same visible object changes as the estimation view (the view itself only
//! accounts for bound pods). Agents publish an unbound pod once the scheduler has marked it
//! `PodScheduled=False`, with that condition and its owner references kept.
//!
//! Matching, compared with karmada-scheduler-estimator (`pkg/estimator/server/replica`):
//! - Only `Deployment` workloads are answered; other kinds fail with the same kind of error
//!   Karmada returns ("kind(X) of workload(ns/name) is not supported").
//! - Karmada finds the Deployment's newest ReplicaSet and lists the pods that ReplicaSet
//!   controls. Deployments and ReplicaSets are not replicated here, so a pod counts for the
//!   Deployment `d` when its controller owner reference is a `ReplicaSet` named
//!   `d-<pod-template-hash>` (the pod's own `pod-template-hash` label), which is how the
//!   Deployment controller names ReplicaSets. Difference: during a rollout, pending pods of
//!   an older ReplicaSet of the same Deployment count too (Karmada counts the newest only).
//! - A pod counts when its `PodScheduled` condition is `False` with reason `Unschedulable`
//!   and `lastTransitionTime + threshold` is strictly before now.
//!
//! Clock: `lastTransitionTime` is written by the member cluster's control plane (wall clock,
//! one-second resolution) and compared with this replica's wall clock, as Karmada's
//! estimator does with its own. Skew between the two shifts the threshold by the skew; a
//! member clock running ahead makes pods count later, one running behind makes them count
//! earlier.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use dramesh_api::query::ObjectRef;
use dramesh_estimator::{ApplyError, Decoded};
use dramesh_model::{ClusterObject, ObjectKey, ObjectKind, k8s};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

/// Namespace of objects that do not name one.
const DEFAULT_NAMESPACE: &str = "default";

/// What is kept of one unbound pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PendingPod {
    pub(crate) namespace: String,
    /// The Deployment the pod belongs to (via its ReplicaSet), if any.
    pub(crate) deployment: Option<String>,
    /// When the pod became unschedulable: set only while `PodScheduled` is `False` with
    /// reason `Unschedulable` and the condition carries a transition time.
    pub(crate) unschedulable_since: Option<Timestamp>,
}

/// Unbound pods of every cluster, keyed by cluster, then (namespace, name).
#[derive(Debug, Default)]
pub(crate) struct PendingIndex {
    clusters: HashMap<String, BTreeMap<(String, String), PendingPod>>,
}

/// The Deployment a pod was created for: its controller is a ReplicaSet whose name is the
/// Deployment's name plus `-<pod-template-hash>`.
pub(crate) fn deployment_of(pod: &k8s::Pod) -> Option<String> {
    let owner = pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))?;
    if owner.kind != "ReplicaSet" {
        return None;
    }
    let hash = pod.metadata.labels.as_ref()?.get("pod-template-hash")?;
    let base = owner.name.strip_suffix(hash.as_str())?.strip_suffix('-')?;
    (!base.is_empty()).then(|| base.to_string())
}

/// When the pod's `PodScheduled` condition turned `False` for reason `Unschedulable`.
pub(crate) fn unschedulable_since(pod: &k8s::Pod) -> Option<Timestamp> {
    let c = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled")?;
    if c.status != "False" || c.reason.as_deref() != Some("Unschedulable") {
        return None;
    }
    c.last_transition_time.as_ref().map(|t| t.0)
}

fn is_pending(pod: &k8s::Pod) -> bool {
    let bound = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty());
    let finished = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    !bound && !finished
}

impl PendingIndex {
    /// Applies one visible change of `cluster` to the object `key`, as [`dramesh_estimator::decode`]
    /// decoded it. Anything but a pod is ignored, and a pod that is bound, finished, deleted or
    /// does not decode leaves the index.
    pub(crate) fn apply(
        &mut self,
        cluster: &str,
        key: &ObjectKey,
        change: &Result<Decoded, ApplyError>,
    ) {
        if key.kind != ObjectKind::Pod {
            return;
        }
        let namespace = key
            .namespace
            .clone()
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
        let id = (namespace.clone(), key.name.clone());
        let pod = match change {
            Ok(Decoded::Upsert(ClusterObject::Pod(p))) if is_pending(p) => Some(p),
            _ => None,
        };
        match pod {
            Some(p) => {
                self.clusters
                    .entry(cluster.to_string())
                    .or_default()
                    .insert(
                        id,
                        PendingPod {
                            namespace,
                            deployment: deployment_of(p),
                            unschedulable_since: unschedulable_since(p),
                        },
                    );
            }
            None => {
                if let Some(c) = self.clusters.get_mut(cluster) {
                    c.remove(&id);
                    if c.is_empty() {
                        self.clusters.remove(cluster);
                    }
                }
            }
        }
    }

    /// Number of unbound pods held for `cluster`.
    #[cfg(test)]
    pub(crate) fn len(&self, cluster: &str) -> usize {
        self.clusters.get(cluster).map_or(0, BTreeMap::len)
    }

    /// Pods of `workload` in `cluster` unschedulable for longer than `threshold` at `now`.
    /// Errors for workload kinds other than `Deployment`.
    pub(crate) fn unschedulable(
        &self,
        cluster: &str,
        workload: &ObjectRef,
        threshold: Duration,
        now: Timestamp,
    ) -> Result<usize, String> {
        let namespace = if workload.namespace.is_empty() {
            DEFAULT_NAMESPACE
        } else {
            workload.namespace.as_str()
        };
        if workload.kind != "Deployment" {
            return Err(format!(
                "kind({}) of workload({namespace}/{}) is not supported",
                workload.kind, workload.name
            ));
        }
        // A threshold beyond jiff's range can never have elapsed.
        let Ok(threshold) = SignedDuration::try_from(threshold) else {
            return Ok(0);
        };
        let Some(pods) = self.clusters.get(cluster) else {
            return Ok(0);
        };
        let n = pods
            .values()
            .filter(|p| p.namespace == namespace)
            .filter(|p| p.deployment.as_deref() == Some(workload.name.as_str()))
            .filter(|p| {
                p.unschedulable_since
                    .and_then(|t| t.checked_add(threshold).ok())
                    .is_some_and(|due| due < now)
            })
            .count();
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use dramesh_model::ObjectChange;
    use dramesh_model::load::decode_value;
    use serde_json::{Value, json};

    fn pod(name: &str, rs: &str, hash: &str, node: Option<&str>, cond: Value) -> k8s::Pod {
        let mut spec = json!({"containers": [{"name": "c"}]});
        if let Some(n) = node {
            spec["nodeName"] = json!(n);
        }
        decode_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml",
                "labels": {"app": "trainer", "pod-template-hash": hash},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs,
                    "uid": "u", "controller": true}]},
            "spec": spec,
            "status": {"phase": "Pending", "conditions": [cond]}
        }))
        .unwrap()
    }

    fn unsched(at: &str) -> Value {
        json!({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": at})
    }

    fn feed(idx: &mut PendingIndex, cluster: &str, change: &ObjectChange) {
        idx.apply(
            cluster,
            change.key(),
            &dramesh_estimator::decode(cluster, change),
        );
    }

    fn up(p: k8s::Pod) -> ObjectChange {
        ObjectChange::upsert(&ClusterObject::Pod(Arc::new(p)))
    }

    fn deployment(ns: &str, name: &str) -> ObjectRef {
        ObjectRef {
            api_version: "apps/v1".into(),
            kind: "Deployment".into(),
            namespace: ns.into(),
            name: name.into(),
        }
    }

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    const NOW: &str = "2025-06-01T12:00:00Z";

    #[test]
    fn deployment_is_found_through_the_replicaset_name_and_hash() {
        let p = pod("a", "trainer-7f9c", "7f9c", None, unsched(NOW));
        assert_eq!(deployment_of(&p).as_deref(), Some("trainer"));
        let p = pod("a", "my-app-v2-7f9c", "7f9c", None, unsched(NOW));
        assert_eq!(deployment_of(&p).as_deref(), Some("my-app-v2"));
        // A ReplicaSet not named after the hash is not a Deployment's.
        let p = pod("a", "standalone", "7f9c", None, unsched(NOW));
        assert_eq!(deployment_of(&p), None);
        let p = pod("a", "x7f9c", "7f9c", None, unsched(NOW));
        assert_eq!(deployment_of(&p), None);
        let mut p = pod("a", "trainer-7f9c", "7f9c", None, unsched(NOW));
        if let Some(o) = p.metadata.owner_references.as_mut() {
            o[0].controller = None;
        }
        assert_eq!(deployment_of(&p), None, "only the controller counts");
    }

    #[test]
    fn only_unschedulable_pods_older_than_the_threshold_count() {
        let mut idx = PendingIndex::default();
        let c = "c1";
        feed(
            &mut idx,
            c,
            &up(pod(
                "old",
                "trainer-h1",
                "h1",
                None,
                unsched("2025-06-01T11:50:00Z"),
            )),
        );
        feed(
            &mut idx,
            c,
            &up(pod(
                "fresh",
                "trainer-h1",
                "h1",
                None,
                unsched("2025-06-01T11:59:30Z"),
            )),
        );
        let gated = json!({"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
            "lastTransitionTime": "2025-06-01T11:00:00Z"});
        feed(
            &mut idx,
            c,
            &up(pod("gated", "trainer-h1", "h1", None, gated)),
        );
        feed(
            &mut idx,
            c,
            &up(pod(
                "other",
                "web-h2",
                "h2",
                None,
                unsched("2025-06-01T11:00:00Z"),
            )),
        );
        feed(
            &mut idx,
            c,
            &up(pod(
                "bound",
                "trainer-h1",
                "h1",
                Some("n1"),
                unsched("2025-06-01T11:00:00Z"),
            )),
        );
        assert_eq!(idx.len(c), 4, "the bound pod is not held");
        let d = deployment("ml", "trainer");
        let n = |idx: &PendingIndex, secs: u64| {
            idx.unschedulable(c, &d, Duration::from_secs(secs), ts(NOW))
                .unwrap()
        };
        assert_eq!(n(&idx, 60), 1);
        assert_eq!(n(&idx, 0), 2);
        assert_eq!(
            n(&idx, 600),
            0,
            "exactly at the threshold is not yet over it"
        );
        assert_eq!(n(&idx, 599), 1);
        assert_eq!(
            idx.unschedulable(
                c,
                &deployment("other-ns", "trainer"),
                Duration::ZERO,
                ts(NOW)
            ),
            Ok(0)
        );
        assert_eq!(
            idx.unschedulable(c, &deployment("ml", "web"), Duration::ZERO, ts(NOW)),
            Ok(1)
        );
        assert_eq!(idx.unschedulable("c2", &d, Duration::ZERO, ts(NOW)), Ok(0));
        assert_eq!(
            idx.unschedulable(c, &d, Duration::MAX, ts(NOW)),
            Ok(0),
            "a threshold out of range never elapses"
        );
    }

    #[test]
    fn binding_finishing_and_deleting_remove_pods() {
        let mut idx = PendingIndex::default();
        let d = deployment("ml", "trainer");
        let count =
            |idx: &PendingIndex| idx.unschedulable("c", &d, Duration::ZERO, ts(NOW)).unwrap();
        let p = pod("a", "trainer-h", "h", None, unsched("2025-06-01T11:00:00Z"));
        feed(&mut idx, "c", &up(p.clone()));
        feed(
            &mut idx,
            "c",
            &up(pod(
                "b",
                "trainer-h",
                "h",
                None,
                unsched("2025-06-01T11:00:00Z"),
            )),
        );
        assert_eq!(count(&idx), 2);
        feed(
            &mut idx,
            "c",
            &up(pod(
                "a",
                "trainer-h",
                "h",
                Some("n1"),
                unsched("2025-06-01T11:00:00Z"),
            )),
        );
        assert_eq!(count(&idx), 1);
        let mut done = pod("b", "trainer-h", "h", None, unsched("2025-06-01T11:00:00Z"));
        if let Some(s) = done.status.as_mut() {
            s.phase = Some("Failed".into());
        }
        feed(&mut idx, "c", &up(done));
        assert_eq!(count(&idx), 0);
        feed(&mut idx, "c", &up(p.clone()));
        assert_eq!(count(&idx), 1);
        let key = dramesh_model::ObjectKey::new(ObjectKind::Pod, Some("ml"), "a");
        // A pod whose new version does not decode leaves the index.
        let garbled = ObjectChange::Upsert {
            key: key.clone(),
            json: r#"{"metadata": {"name": 7}}"#.as_bytes().into(),
        };
        feed(&mut idx, "c", &garbled);
        assert_eq!(count(&idx), 0);
        feed(&mut idx, "c", &up(p));
        assert_eq!(count(&idx), 1);
        feed(&mut idx, "c", &ObjectChange::Delete { key });
        assert_eq!(count(&idx), 0);
        assert_eq!(idx.len("c"), 0);
        // A pod that turned schedulable again (condition True) no longer counts.
        let ok = json!({"type": "PodScheduled", "status": "True", "lastTransitionTime": NOW});
        feed(&mut idx, "c", &up(pod("c", "trainer-h", "h", None, ok)));
        assert_eq!(count(&idx), 0);
        assert_eq!(idx.len("c"), 1);
    }

    #[test]
    fn other_kinds_are_not_supported() {
        let idx = PendingIndex::default();
        let mut w = deployment("ml", "db");
        w.kind = "StatefulSet".into();
        let e = idx
            .unschedulable("c", &w, Duration::ZERO, ts(NOW))
            .unwrap_err();
        assert!(e.contains("StatefulSet") && e.contains("ml/db"), "{e}");
    }
}
