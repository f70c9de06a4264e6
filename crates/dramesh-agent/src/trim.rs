//! Trimming watched objects to what the mesh needs, and deciding which scope owns each one.
//!
//! Objects from the API server carry bookkeeping (managedFields, resourceVersion, heartbeat
//! timestamps, container images) that changes often and means nothing to an estimator.
//! Publishing it would turn every kubelet heartbeat into a CRDT commit. Trimming keeps the
//! fields the cluster view reads; because trimmed objects only change when something an
//! estimator cares about changes, unchanged trimmed JSON is never republished.
//!
//! Ownership ([`Owner`]) is exclusive: every object belongs to one node's agent or to the
//! cluster leader, never both, so scopes never hold the same key twice. The exception is a
//! moment of handover: a pod being bound leaves the leader's unbound-pod watch and enters its
//! node agent's watch, and the two scopes' batches travel independently (the store shows one
//! holder's value per key, see `dramesh-store`'s view, until the other catches up).

use std::sync::Arc;

use dramesh_model::k8s::{self, ObjectMeta};
use dramesh_model::{ClusterObject, ObjectKey, ObjectKind};
use k8s_openapi::api::core::v1::{
    Container, NodeCondition, NodeSpec, NodeStatus, PodCondition, PodSpec, PodStatus,
};
use k8s_openapi::api::resource::v1::ResourceClaimStatus;

/// Annotations kept on published objects (everything else is dropped).
pub const KEPT_ANNOTATION_PREFIX: &str = "dramesh.io/";

pub use dramesh_model::owner::{
    Owner, POD_SCHEDULED, claim_allocated_node, claim_owner, pod_is_terminal, pod_owner,
    pod_scheduling_failed, slice_owner,
};

/// Drops bookkeeping metadata. Keeps name, namespace, uid, labels, owner references,
/// creation and deletion timestamps, and `dramesh.io/` annotations.
pub fn trim_meta(m: &mut ObjectMeta) {
    m.managed_fields = None;
    m.resource_version = None;
    m.generation = None;
    m.self_link = None;
    m.finalizers = None;
    m.generate_name = None;
    if let Some(a) = &mut m.annotations {
        a.retain(|k, _| k.starts_with(KEPT_ANNOTATION_PREFIX));
        if a.is_empty() {
            m.annotations = None;
        }
    }
}

fn trim_container(c: &Container) -> Container {
    Container {
        name: c.name.clone(),
        resources: c.resources.clone(),
        // Init containers with restartPolicy Always are sidecars: their requests add up.
        restart_policy: c.restart_policy.clone(),
        ..Default::default()
    }
}

/// The pod's `PodScheduled` condition reduced to type, status, reason and transition time.
/// Its message (which lists per-node failure counts and changes on every retry) and probe
/// times are dropped, so a pod stuck in the scheduling queue is not republished per retry.
fn scheduled_condition(s: &PodStatus) -> Option<Vec<PodCondition>> {
    let c = s
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == POD_SCHEDULED)?;
    Some(vec![PodCondition {
        type_: c.type_.clone(),
        status: c.status.clone(),
        reason: c.reason.clone(),
        last_transition_time: c.last_transition_time.clone(),
        ..Default::default()
    }])
}

/// A pod reduced to what placement, preemption and the unschedulable-replica count read:
/// requests, claims, priority, owner, node, phase and the `PodScheduled` condition.
pub fn trim_pod(pod: &k8s::Pod) -> k8s::Pod {
    let mut metadata = pod.metadata.clone();
    trim_meta(&mut metadata);
    let spec = pod.spec.as_ref().map(|s| PodSpec {
        containers: s.containers.iter().map(trim_container).collect(),
        init_containers: s
            .init_containers
            .as_ref()
            .map(|v| v.iter().map(trim_container).collect()),
        overhead: s.overhead.clone(),
        resources: s.resources.clone(),
        node_name: s.node_name.clone(),
        priority: s.priority,
        priority_class_name: s.priority_class_name.clone(),
        preemption_policy: s.preemption_policy.clone(),
        resource_claims: s.resource_claims.clone(),
        ..Default::default()
    });
    let status = pod.status.as_ref().map(|s| PodStatus {
        phase: s.phase.clone(),
        nominated_node_name: s.nominated_node_name.clone(),
        resource_claim_statuses: s.resource_claim_statuses.clone(),
        extended_resource_claim_status: s.extended_resource_claim_status.clone(),
        conditions: scheduled_condition(s),
        ..Default::default()
    });
    k8s::Pod {
        metadata,
        spec,
        status,
    }
}

/// A node reduced to labels, taints, schedulability, capacity and condition states
/// (without heartbeat times, images, addresses or system info).
pub fn trim_node(node: &k8s::Node) -> k8s::Node {
    let mut metadata = node.metadata.clone();
    trim_meta(&mut metadata);
    let spec = node.spec.as_ref().map(|s| NodeSpec {
        taints: s.taints.clone().map(|ts| {
            ts.into_iter()
                .map(|mut t| {
                    t.time_added = None;
                    t
                })
                .collect()
        }),
        unschedulable: s.unschedulable,
        ..Default::default()
    });
    let status = node.status.as_ref().map(|s| NodeStatus {
        allocatable: s.allocatable.clone(),
        capacity: s.capacity.clone(),
        conditions: s.conditions.as_ref().map(|cs| {
            cs.iter()
                .map(|c| NodeCondition {
                    type_: c.type_.clone(),
                    status: c.status.clone(),
                    ..Default::default()
                })
                .collect()
        }),
        ..Default::default()
    });
    k8s::Node {
        metadata,
        spec,
        status,
    }
}

/// A ResourceSlice with trimmed metadata.
pub fn trim_slice(s: &k8s::ResourceSlice) -> k8s::ResourceSlice {
    let mut s = s.clone();
    trim_meta(&mut s.metadata);
    s
}

/// A DeviceClass with trimmed metadata.
pub fn trim_class(c: &k8s::DeviceClass) -> k8s::DeviceClass {
    let mut c = c.clone();
    trim_meta(&mut c.metadata);
    c
}

/// A claim without per-device driver status (conditions, network data): allocation and
/// reservations are what consumption is computed from.
pub fn trim_claim(c: &k8s::ResourceClaim) -> k8s::ResourceClaim {
    let mut c = c.clone();
    trim_meta(&mut c.metadata);
    c.status = c.status.map(|s| ResourceClaimStatus {
        allocation: s.allocation,
        reserved_for: s.reserved_for,
        devices: None,
    });
    c
}

/// A ResourceClaimTemplate as allocation reads it: its name, namespace and the claim spec
/// (`spec.spec`); the claims' own metadata (`spec.metadata`) and everything else are dropped,
/// so a label or annotation edit publishes nothing.
pub fn trim_claim_template(t: &k8s::ResourceClaimTemplate) -> k8s::ResourceClaimTemplate {
    k8s::ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: t.metadata.name.clone(),
            namespace: t.metadata.namespace.clone(),
            ..ObjectMeta::default()
        },
        spec: k8s::ResourceClaimTemplateSpec {
            metadata: None,
            spec: t.spec.spec.clone(),
        },
    }
}

/// A DeviceTaintRule with trimmed metadata and no status.
pub fn trim_taint_rule(r: &k8s::DeviceTaintRule) -> k8s::DeviceTaintRule {
    let mut r = r.clone();
    trim_meta(&mut r.metadata);
    r.status = None;
    r
}

/// A watched object ready to publish: trimmed, keyed, encoded, and its owner (`None` when
/// nobody publishes it, e.g. a finished pod; a previously published copy is then deleted).
#[derive(Debug, Clone)]
pub struct Record {
    /// The object's key in the document.
    pub key: ObjectKey,
    /// Who publishes it.
    pub owner: Option<Owner>,
    /// The trimmed object as JSON.
    pub json: Arc<[u8]>,
}

impl Record {
    fn new(obj: ClusterObject, owner: Option<Owner>) -> Record {
        Record {
            key: obj.key(),
            json: obj.to_json().into(),
            owner,
        }
    }
}

/// A pod as a record, owned per [`pod_owner`].
pub fn pod_record(pod: &k8s::Pod) -> Record {
    let owner = pod_owner(pod);
    Record::new(ClusterObject::Pod(Arc::new(trim_pod(pod))), owner)
}

/// A node as a record, owned by its own agent.
pub fn node_record(node: &k8s::Node) -> Record {
    let owner = node.metadata.name.clone().map(Owner::Node);
    Record::new(ClusterObject::Node(Arc::new(trim_node(node))), owner)
}

/// A ResourceSlice as a record: node-local slices owned by that node's agent, others by the
/// cluster leader.
pub fn slice_record(s: &k8s::ResourceSlice) -> Record {
    let owner = slice_owner(s);
    Record::new(
        ClusterObject::ResourceSlice(Arc::new(trim_slice(s))),
        Some(owner),
    )
}

/// A DeviceClass as a record, owned by the cluster leader.
pub fn class_record(c: &k8s::DeviceClass) -> Record {
    Record::new(
        ClusterObject::DeviceClass(Arc::new(trim_class(c))),
        Some(Owner::Cluster),
    )
}

/// A ResourceClaim as a record, owned per [`claim_owner`].
pub fn claim_record(c: &k8s::ResourceClaim) -> Record {
    Record::new(
        ClusterObject::ResourceClaim(Arc::new(trim_claim(c))),
        claim_owner(c),
    )
}

/// A DeviceTaintRule as a record, owned by the cluster leader.
pub fn taint_rule_record(r: &k8s::DeviceTaintRule) -> Record {
    Record::new(
        ClusterObject::DeviceTaintRule(Arc::new(trim_taint_rule(r))),
        Some(Owner::Cluster),
    )
}

/// A ResourceClaimTemplate as a record, owned by the cluster leader.
pub fn claim_template_record(t: &k8s::ResourceClaimTemplate) -> Record {
    Record::new(
        ClusterObject::ResourceClaimTemplate(Arc::new(trim_claim_template(t))),
        Some(Owner::Cluster),
    )
}

/// A Karpenter object from a dynamic watch, decoded into its trimmed type and owned by the
/// cluster leader. One that does not decode (a limit that is not a quantity, a list past its
/// bound) is logged and given no owner, so it is not published and a copy published before
/// is withdrawn: headroom is never computed from a pool read wrongly.
fn karpenter_record<T>(
    o: &kube::api::DynamicObject,
    kind: ObjectKind,
    wrap: fn(Arc<T>) -> ClusterObject,
) -> Record
where
    T: serde::de::DeserializeOwned + dramesh_model::karpenter::Bounded,
{
    let name = o.metadata.name.clone().unwrap_or_default();
    let decoded = serde_json::to_value(o)
        .map_err(|e| e.to_string())
        .and_then(|v| dramesh_model::load::decode_karpenter::<T>(v).map_err(|e| e.to_string()));
    match decoded {
        Ok(t) => Record::new(wrap(Arc::new(t)), Some(Owner::Cluster)),
        Err(e) => {
            tracing::warn!(%kind, name, error = %e, "Karpenter object not published");
            Record {
                key: ObjectKey::new(kind, None, &name),
                owner: None,
                json: Arc::from(&b"{}"[..]),
            }
        }
    }
}

/// A Karpenter NodePool as a record, owned by the cluster leader (see `karpenter_record`).
pub fn nodepool_record(o: &kube::api::DynamicObject) -> Record {
    karpenter_record(o, ObjectKind::NodePool, ClusterObject::NodePool)
}

/// A Karpenter NodeClaim as a record, owned by the cluster leader (see `karpenter_record`).
pub fn nodeclaim_record(o: &kube::api::DynamicObject) -> Record {
    karpenter_record(o, ObjectKind::NodeClaim, ClusterObject::NodeClaim)
}

/// `major.minor` from the API server's version info, tolerating provider suffixes such as
/// GKE's `"27+"`; `None` when either part has no leading digits.
pub fn major_minor(major: &str, minor: &str) -> Option<String> {
    let digits = |s: &str| -> Option<u32> {
        let d: String = s.chars().take_while(char::is_ascii_digit).collect();
        d.parse().ok()
    };
    Some(format!("{}.{}", digits(major)?, digits(minor)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::load::decode_value;
    use serde_json::json;

    fn claim(node_selector: serde_json::Value) -> k8s::ResourceClaim {
        decode_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ns", "managedFields": [{"manager": "kube-scheduler"}],
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "dramesh.io/note": "x"}},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
            "status": {"allocation": {"devices": {"results": []}, "nodeSelector": node_selector},
                "devices": [{"driver": "d", "pool": "p", "device": "x", "conditions": []}]}
        }))
        .unwrap()
    }

    fn pinned(nodes: &[&str]) -> serde_json::Value {
        json!({"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": nodes}]}]})
    }

    #[test]
    fn claims_pinned_to_one_node_are_node_owned() {
        let c = claim(pinned(&["n1"]));
        assert_eq!(claim_allocated_node(&c), Some("n1"));
        assert_eq!(claim_owner(&c), Some(Owner::Node("n1".into())));
    }

    #[test]
    fn claims_on_several_or_labelled_nodes_are_cluster_owned() {
        assert_eq!(
            claim_owner(&claim(pinned(&["n1", "n2"]))),
            Some(Owner::Cluster)
        );
        let by_label = json!({"nodeSelectorTerms": [{"matchExpressions": [{"key": "rack", "operator": "In", "values": ["r1"]}]}]});
        assert_eq!(claim_owner(&claim(by_label)), Some(Owner::Cluster));
        let two_terms = json!({"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}]});
        assert_eq!(claim_owner(&claim(two_terms)), Some(Owner::Cluster));
        let mut all_nodes = claim(pinned(&["n1"]));
        if let Some(a) = all_nodes
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
        {
            a.node_selector = None;
        }
        assert_eq!(claim_owner(&all_nodes), Some(Owner::Cluster));
    }

    #[test]
    fn unallocated_claims_are_not_published() {
        let mut c = claim(pinned(&["n1"]));
        c.status = None;
        assert_eq!(claim_owner(&c), None);
        assert!(claim_record(&c).owner.is_none());
    }

    #[test]
    fn claim_trimming_keeps_allocation_drops_bookkeeping() {
        let t = trim_claim(&claim(pinned(&["n1"])));
        assert!(t.metadata.managed_fields.is_none());
        let ann = t.metadata.annotations.unwrap();
        assert_eq!(ann.len(), 1);
        assert!(ann.contains_key("dramesh.io/note"));
        let st = t.status.unwrap();
        assert!(st.devices.is_none());
        assert!(st.allocation.is_some());
    }

    fn pod(phase: &str) -> k8s::Pod {
        decode_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ml", "uid": "u1", "resourceVersion": "77",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "r"}]},
            "spec": {"nodeName": "n1", "priority": 1000,
                "containers": [{"name": "c", "image": "busybox", "command": ["sleep"],
                    "env": [{"name": "A", "value": "1"}],
                    "resources": {"requests": {"cpu": "2"}, "claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "claim"}],
                "volumes": [{"name": "v", "emptyDir": {}}]},
            "status": {"phase": phase, "podIP": "10.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap()
    }

    #[test]
    fn pods_keep_requests_priority_owner_and_claims() {
        let r = pod_record(&pod("Running"));
        assert_eq!(r.owner, Some(Owner::Node("n1".into())));
        let v: serde_json::Value = serde_json::from_slice(&r.json).unwrap();
        assert_eq!(
            v["spec"]["containers"][0]["resources"]["requests"]["cpu"],
            "2"
        );
        assert_eq!(v["spec"]["priority"], 1000);
        assert_eq!(v["spec"]["nodeName"], "n1");
        assert_eq!(v["spec"]["resourceClaims"][0]["resourceClaimName"], "claim");
        assert_eq!(v["metadata"]["ownerReferences"][0]["name"], "rs");
        assert!(v["spec"]["containers"][0].get("image").is_none());
        assert!(v["spec"]["containers"][0].get("env").is_none());
        assert!(v["spec"].get("volumes").is_none());
        assert!(
            v["status"].get("conditions").is_none(),
            "only PodScheduled is kept"
        );
        assert!(v["status"].get("podIP").is_none());
        assert!(v["metadata"].get("resourceVersion").is_none());
    }

    #[test]
    fn finished_pods_are_not_published() {
        assert!(pod_record(&pod("Succeeded")).owner.is_none());
        assert!(pod_record(&pod("Failed")).owner.is_none());
        assert!(pod_record(&pod("Pending")).owner.is_some());
    }

    fn pending_pod(scheduled: Option<(&str, &str, &str)>) -> k8s::Pod {
        let mut p = pod("Pending");
        if let Some(s) = p.spec.as_mut() {
            s.node_name = None;
        }
        let conds = match scheduled {
            Some((status, reason, at)) => json!([
                {"type": "Ready", "status": "False"},
                {"type": "PodScheduled", "status": status, "reason": reason,
                 "lastTransitionTime": at, "lastProbeTime": null,
                 "message": "0/3 nodes are available: 3 Insufficient cpu."}]),
            None => json!([]),
        };
        p.status = Some(decode_value(json!({"phase": "Pending", "conditions": conds})).unwrap());
        p
    }

    #[test]
    fn unschedulable_pods_are_cluster_owned_with_their_condition() {
        let p = pending_pod(Some(("False", "Unschedulable", "2025-01-01T00:00:00Z")));
        let r = pod_record(&p);
        assert_eq!(r.owner, Some(Owner::Cluster));
        let v: serde_json::Value = serde_json::from_slice(&r.json).unwrap();
        let conds = v["status"]["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 1, "only PodScheduled is kept: {conds:?}");
        assert_eq!(conds[0]["type"], "PodScheduled");
        assert_eq!(conds[0]["status"], "False");
        assert_eq!(conds[0]["reason"], "Unschedulable");
        assert_eq!(conds[0]["lastTransitionTime"], "2025-01-01T00:00:00Z");
        assert!(conds[0].get("message").is_none());
        assert_eq!(v["metadata"]["ownerReferences"][0]["kind"], "ReplicaSet");
        assert!(v["spec"].get("nodeName").is_none());
        // A new failure message on retry does not change the record.
        let mut again = p.clone();
        if let Some(c) = again
            .status
            .as_mut()
            .and_then(|s| s.conditions.as_mut())
            .and_then(|c| c.get_mut(1))
        {
            c.message = Some("0/4 nodes are available".into());
        }
        assert_eq!(pod_record(&again).json, r.json);
    }

    #[test]
    fn unbound_pods_not_yet_tried_or_finished_are_not_published() {
        assert_eq!(pod_owner(&pending_pod(None)), None);
        assert_eq!(
            pod_owner(&pending_pod(Some(("True", "", "2025-01-01T00:00:00Z")))),
            None
        );
        let mut failed = pending_pod(Some(("False", "Unschedulable", "2025-01-01T00:00:00Z")));
        if let Some(s) = failed.status.as_mut() {
            s.phase = Some("Failed".into());
        }
        assert_eq!(pod_owner(&failed), None);
        let mut bound = pending_pod(Some(("False", "Unschedulable", "2025-01-01T00:00:00Z")));
        if let Some(s) = bound.spec.as_mut() {
            s.node_name = Some("n2".into());
        }
        assert_eq!(pod_owner(&bound), Some(Owner::Node("n2".into())));
    }

    #[test]
    fn node_heartbeats_do_not_change_the_record() {
        let mk = |beat: &str| -> k8s::Node {
            decode_value(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "n1", "labels": {"a": "b"}, "resourceVersion": beat},
                "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]},
                "status": {"allocatable": {"cpu": "8"}, "capacity": {"cpu": "8"},
                    "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": beat, "reason": "KubeletReady"}],
                    "images": [{"names": ["big:1"], "sizeBytes": 1}],
                    "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}
            }))
            .unwrap()
        };
        let a = node_record(&mk("2025-01-01T00:00:00Z"));
        let b = node_record(&mk("2025-01-01T00:00:10Z"));
        assert_eq!(a.json, b.json);
        let v: serde_json::Value = serde_json::from_slice(&a.json).unwrap();
        assert_eq!(v["status"]["conditions"][0]["status"], "True");
        assert!(v["status"].get("images").is_none());
        assert_eq!(v["spec"]["taints"][0]["key"], "k");
        assert_eq!(a.owner, Some(Owner::Node("n1".into())));
    }

    #[test]
    fn slices_without_node_name_are_cluster_owned() {
        let s = |node: Option<&str>| -> k8s::ResourceSlice {
            let mut spec = json!({"driver": "d", "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1}});
            match node {
                Some(n) => spec["nodeName"] = json!(n),
                None => spec["allNodes"] = json!(true),
            }
            decode_value(
                json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": "s"}, "spec": spec}),
            )
            .unwrap()
        };
        assert_eq!(
            slice_record(&s(Some("n1"))).owner,
            Some(Owner::Node("n1".into()))
        );
        assert_eq!(slice_record(&s(None)).owner, Some(Owner::Cluster));
    }

    #[test]
    fn version_parsing() {
        assert_eq!(major_minor("1", "36").as_deref(), Some("1.36"));
        assert_eq!(major_minor("1", "27+").as_deref(), Some("1.27"));
        assert_eq!(major_minor("", "27"), None);
    }
}
