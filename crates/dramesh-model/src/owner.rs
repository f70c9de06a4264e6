//! Who may publish each record of a member cluster: one node's agent or the cluster's elected
//! publisher (the Lease holder). The agent uses it to route records into its node or cluster
//! scope; replicas use the same rule to refuse records a node agent may not publish.
//!
//! Ownership is exclusive: every object belongs to one node's agent or to the cluster leader.

use serde::Deserialize;

use crate::k8s;
use crate::object::{ClusterObject, ObjectKind};

/// Which publisher owns a record.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    /// The agent of this node.
    Node(String),
    /// The elected cluster agent.
    Cluster,
}

/// Whether a pod has finished (its containers hold nothing any more).
pub fn pod_is_terminal(pod: &k8s::Pod) -> bool {
    phase_is_terminal(pod.status.as_ref().and_then(|s| s.phase.as_deref()))
}

fn phase_is_terminal(phase: Option<&str>) -> bool {
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// The pod condition the scheduler writes (`PodScheduled`).
pub const POD_SCHEDULED: &str = "PodScheduled";

/// Whether the scheduler has tried to place this unbound pod and failed (its `PodScheduled`
/// condition is `False`, whatever the reason).
pub fn pod_scheduling_failed(pod: &k8s::Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    scheduling_failed(
        conditions
            .into_iter()
            .flatten()
            .map(|c| (c.type_.as_str(), c.status.as_str())),
    )
}

fn scheduling_failed<'a>(mut conditions: impl Iterator<Item = (&'a str, &'a str)>) -> bool {
    conditions.any(|(type_, status)| type_ == POD_SCHEDULED && status == "False")
}

/// The node a claim's allocation is pinned to, if the allocation's node selector admits
/// exactly one node by name (`matchFields metadata.name In [node]` in every term, all naming
/// the same node), which is how the scheduler records devices from node-local slices.
pub fn claim_allocated_node(claim: &k8s::ResourceClaim) -> Option<&str> {
    pinned_node(
        claim
            .status
            .as_ref()?
            .allocation
            .as_ref()?
            .node_selector
            .as_ref()?,
    )
}

fn pinned_node(sel: &k8s::NodeSelector) -> Option<&str> {
    let mut node: Option<&str> = None;
    if sel.node_selector_terms.is_empty() {
        return None;
    }
    for term in &sel.node_selector_terms {
        let mut pinned: Option<&str> = None;
        for f in term.match_fields.iter().flatten() {
            if f.key == "metadata.name" && f.operator == "In" {
                match f.values.as_deref() {
                    Some([one]) => {
                        if pinned.is_some_and(|p| p != one) {
                            return None; // contradictory term: selects nothing
                        }
                        pinned = Some(one);
                    }
                    _ => return None,
                }
            }
        }
        // Label expressions further narrow a pinned term; they cannot widen it.
        let pinned = pinned?;
        if node.is_some_and(|n| n != pinned) {
            return None;
        }
        node = Some(pinned);
    }
    node
}

/// Who publishes a claim: the node it is pinned to, the cluster leader for allocations from
/// network-attached or all-node devices, nobody while it is unallocated (an unallocated claim
/// consumes nothing).
pub fn claim_owner(claim: &k8s::ResourceClaim) -> Option<Owner> {
    let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
    allocation.map(|a| allocation_owner(a.node_selector.as_ref()))
}

fn allocation_owner(node_selector: Option<&k8s::NodeSelector>) -> Owner {
    match node_selector.and_then(pinned_node) {
        Some(n) => Owner::Node(n.to_string()),
        None => Owner::Cluster,
    }
}

/// Who publishes a pod: the agent of the node it is bound to; for an unbound pod, the
/// cluster leader once the scheduler has marked it `PodScheduled=False` (pods still waiting
/// for their first scheduling attempt are skipped: most are bound within milliseconds, and
/// publishing them would add two cluster-scope commits per created pod); nobody for a
/// finished pod.
pub fn pod_owner(pod: &k8s::Pod) -> Option<Owner> {
    let bound_to = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    pod_owner_of(pod_is_terminal(pod), bound_to, || {
        pod_scheduling_failed(pod)
    })
}

fn pod_owner_of(
    terminal: bool,
    bound_to: Option<&str>,
    scheduling_failed: impl FnOnce() -> bool,
) -> Option<Owner> {
    if terminal {
        return None;
    }
    match bound_to {
        Some(n) if !n.is_empty() => Some(Owner::Node(n.to_string())),
        _ if scheduling_failed() => Some(Owner::Cluster),
        _ => None,
    }
}

/// Who publishes a ResourceSlice: node-local slices that node's agent, others the cluster leader.
pub fn slice_owner(s: &k8s::ResourceSlice) -> Owner {
    node_or_cluster(s.spec.node_name.as_deref())
}

fn node_or_cluster(node_name: Option<&str>) -> Owner {
    match node_name {
        Some(n) if !n.is_empty() => Owner::Node(n.to_string()),
        _ => Owner::Cluster,
    }
}

/// Who publishes the object of kind `kind` whose JSON is `json`, by the same rules as
/// [`ClusterObject::owner`], reading only the fields they look at. A replica checks every
/// received record's writer this way; decoding whole objects (a node's slices list every
/// device) cost it most of its time taking in a fleet of per-node documents. A value that is
/// not a JSON object, or whose owner fields have the wrong shape, is an error.
pub fn owner_of_json(kind: ObjectKind, json: &[u8]) -> Result<Option<Owner>, serde_json::Error> {
    Ok(match kind {
        ObjectKind::Node => serde_json::from_slice::<NodeFields>(json)?
            .metadata
            .and_then(|m| m.name)
            .map(Owner::Node),
        ObjectKind::Pod => {
            let pod: PodFields = serde_json::from_slice(json)?;
            let status = pod.status.unwrap_or_default();
            let conditions = status.conditions.iter().flatten();
            pod_owner_of(
                phase_is_terminal(status.phase.as_deref()),
                pod.spec.and_then(|s| s.node_name).as_deref(),
                || {
                    scheduling_failed(conditions.map(|c| {
                        (
                            c.type_.as_deref().unwrap_or_default(),
                            c.status.as_deref().unwrap_or_default(),
                        )
                    }))
                },
            )
        }
        ObjectKind::ResourceSlice => {
            let slice: SliceFields = serde_json::from_slice(json)?;
            Some(node_or_cluster(
                slice.spec.and_then(|s| s.node_name).as_deref(),
            ))
        }
        ObjectKind::ResourceClaim => serde_json::from_slice::<ClaimFields>(json)?
            .status
            .and_then(|s| s.allocation)
            .map(|a| allocation_owner(a.node_selector.as_ref())),
        ObjectKind::DeviceClass
        | ObjectKind::DeviceTaintRule
        | ObjectKind::ClusterInfo
        | ObjectKind::ResourceClaimTemplate => {
            serde_json::from_slice::<serde::de::IgnoredAny>(json)?;
            Some(Owner::Cluster)
        }
        // Karpenter's objects are cluster-scoped: the Lease holder publishes them.
        ObjectKind::NodePool | ObjectKind::NodeClaim => {
            serde_json::from_slice::<serde::de::IgnoredAny>(json)?;
            Some(Owner::Cluster)
        }
    })
}

// The fields of each kind's JSON that `owner_of_json` reads, optional where the typed decode
// defaults them (k8s-openapi defaults missing required fields); serde skips the rest without
// building it.

#[derive(Deserialize)]
struct NodeFields {
    metadata: Option<NameField>,
}

#[derive(Deserialize)]
struct NameField {
    name: Option<String>,
}

#[derive(Deserialize)]
struct PodFields {
    spec: Option<NodeNameField>,
    status: Option<PodStatusFields>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NodeNameField {
    node_name: Option<String>,
}

#[derive(Deserialize, Default)]
struct PodStatusFields {
    phase: Option<String>,
    conditions: Option<Vec<ConditionFields>>,
}

#[derive(Deserialize)]
struct ConditionFields {
    #[serde(rename = "type")]
    type_: Option<String>,
    status: Option<String>,
}

#[derive(Deserialize)]
struct SliceFields {
    spec: Option<NodeNameField>,
}

#[derive(Deserialize)]
struct ClaimFields {
    status: Option<ClaimStatusFields>,
}

#[derive(Deserialize)]
struct ClaimStatusFields {
    allocation: Option<AllocationFields>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AllocationFields {
    node_selector: Option<k8s::NodeSelector>,
}

impl ClusterObject {
    /// Who publishes this object (see the module docs); `None` when nobody does (a finished
    /// pod, a pod not tried by the scheduler yet, an unallocated claim).
    pub fn owner(&self) -> Option<Owner> {
        match self {
            ClusterObject::Node(n) => n.metadata.name.clone().map(Owner::Node),
            ClusterObject::Pod(p) => pod_owner(p),
            ClusterObject::ResourceSlice(s) => Some(slice_owner(s)),
            ClusterObject::ResourceClaim(c) => claim_owner(c),
            _ => Some(Owner::Cluster),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `owner_of_json` and `ClusterObject::owner` over the same JSON.
    fn both(kind: ObjectKind, json: &str) -> (Option<Owner>, Option<Owner>) {
        let typed = ClusterObject::from_json(kind, json.as_bytes())
            .unwrap_or_else(|e| panic!("{json}: {e:?}"))
            .owner();
        let read = owner_of_json(kind, json.as_bytes()).unwrap_or_else(|e| panic!("{json}: {e}"));
        (read, typed)
    }

    #[test]
    fn reading_the_owner_fields_agrees_with_decoding_the_object() {
        let pinned = r#"{"nodeSelectorTerms":[{"matchFields":[{"key":"metadata.name","operator":"In","values":["n1"]}]}]}"#;
        let two = r#"{"nodeSelectorTerms":[{"matchFields":[{"key":"metadata.name","operator":"In","values":["n1","n2"]}]}]}"#;
        let cases: Vec<(ObjectKind, String, Option<Owner>)> = vec![
            (
                ObjectKind::Pod,
                r#"{"metadata":{"name":"p","namespace":"d"},"spec":{"nodeName":"n1","containers":[]}}"#.into(),
                Some(Owner::Node("n1".into())),
            ),
            (
                ObjectKind::Pod,
                r#"{"metadata":{"name":"p"},"spec":{"nodeName":"n1","containers":[]},"status":{"phase":"Succeeded"}}"#.into(),
                None,
            ),
            (
                ObjectKind::Pod,
                r#"{"metadata":{"name":"p"},"spec":{"containers":[]},"status":{"conditions":[{"type":"PodScheduled","status":"False","reason":"Unschedulable"}]}}"#.into(),
                Some(Owner::Cluster),
            ),
            (
                ObjectKind::Pod,
                r#"{"metadata":{"name":"p"},"spec":{"nodeName":"","containers":[]},"status":{"conditions":[{"type":"Ready","status":"False"}]}}"#.into(),
                None,
            ),
            (
                ObjectKind::ResourceSlice,
                r#"{"metadata":{"name":"s"},"spec":{"driver":"d","pool":{"name":"p","generation":1,"resourceSliceCount":1},"nodeName":"n2","devices":[{"name":"g0"}]}}"#.into(),
                Some(Owner::Node("n2".into())),
            ),
            (
                ObjectKind::ResourceSlice,
                r#"{"metadata":{"name":"s"},"spec":{"driver":"d","pool":{"name":"p","generation":1,"resourceSliceCount":1},"allNodes":true}}"#.into(),
                Some(Owner::Cluster),
            ),
            (
                ObjectKind::ResourceClaim,
                r#"{"metadata":{"name":"c"},"spec":{}}"#.into(),
                None,
            ),
            (
                ObjectKind::ResourceClaim,
                format!(r#"{{"metadata":{{"name":"c"}},"spec":{{}},"status":{{"allocation":{{"nodeSelector":{pinned}}}}}}}"#),
                Some(Owner::Node("n1".into())),
            ),
            (
                ObjectKind::ResourceClaim,
                format!(r#"{{"metadata":{{"name":"c"}},"spec":{{}},"status":{{"allocation":{{"nodeSelector":{two}}}}}}}"#),
                Some(Owner::Cluster),
            ),
            (
                ObjectKind::ResourceClaim,
                r#"{"metadata":{"name":"c"},"spec":{},"status":{"allocation":{}}}"#.into(),
                Some(Owner::Cluster),
            ),
            (
                ObjectKind::ResourceSlice,
                r#"{"metadata":{"name":"s"}}"#.into(),
                Some(Owner::Cluster),
            ),
            (
                ObjectKind::Node,
                r#"{"metadata":{"name":"n7"}}"#.into(),
                Some(Owner::Node("n7".into())),
            ),
            (
                ObjectKind::DeviceClass,
                r#"{"metadata":{"name":"gpu"},"spec":{}}"#.into(),
                Some(Owner::Cluster),
            ),
            (
                ObjectKind::ResourceClaimTemplate,
                r#"{"metadata":{"name":"gpu","namespace":"ml"},"spec":{"spec":{}}}"#.into(),
                Some(Owner::Cluster),
            ),
        ];
        for (kind, json, want) in cases {
            let (read, typed) = both(kind, &json);
            assert_eq!(read, typed, "{json}");
            assert_eq!(read, want, "{json}");
        }
    }

    #[test]
    fn owner_fields_of_the_wrong_shape_are_errors() {
        for (kind, json) in [
            (ObjectKind::ResourceSlice, r#"{"spec":{"nodeName":5}}"#),
            (ObjectKind::Pod, r#"{"spec":{"nodeName":["n1"]}}"#),
            (
                ObjectKind::Pod,
                r#"{"status":{"conditions":[{"type":5,"status":"False"}]}}"#,
            ),
            (ObjectKind::ResourceClaim, r#"{"status":{"allocation":7}}"#),
            (ObjectKind::Node, r#"[]"#),
            (ObjectKind::DeviceClass, r#"{"metadata":"#),
            (ObjectKind::ResourceClaimTemplate, r#"{"spec":"#),
        ] {
            assert!(owner_of_json(kind, json.as_bytes()).is_err(), "{json}");
            assert!(
                ClusterObject::from_json(kind, json.as_bytes()).is_err(),
                "{json}"
            );
        }
    }
}
