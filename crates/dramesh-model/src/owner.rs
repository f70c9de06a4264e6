//! Who may publish each record of a member cluster: one node's agent or the cluster's elected
//! publisher (the Lease holder). The agent uses it to route records into its node or cluster
//! scope; replicas use the same rule to refuse records a node agent may not publish.
//!
//! Ownership is exclusive: every object belongs to one node's agent or to the cluster leader.

use crate::k8s;
use crate::object::ClusterObject;

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
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// The pod condition the scheduler writes (`PodScheduled`).
pub const POD_SCHEDULED: &str = "PodScheduled";

/// Whether the scheduler has tried to place this unbound pod and failed (its `PodScheduled`
/// condition is `False`, whatever the reason).
pub fn pod_scheduling_failed(pod: &k8s::Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == POD_SCHEDULED && c.status == "False")
        })
}

/// The node a claim's allocation is pinned to, if the allocation's node selector admits
/// exactly one node by name (`matchFields metadata.name In [node]` in every term, all naming
/// the same node), which is how the scheduler records devices from node-local slices.
pub fn claim_allocated_node(claim: &k8s::ResourceClaim) -> Option<&str> {
    let sel = claim
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .node_selector
        .as_ref()?;
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
    let allocated = claim
        .status
        .as_ref()
        .is_some_and(|s| s.allocation.is_some());
    if !allocated {
        return None;
    }
    Some(match claim_allocated_node(claim) {
        Some(n) => Owner::Node(n.to_string()),
        None => Owner::Cluster,
    })
}

/// Who publishes a pod: the agent of the node it is bound to; for an unbound pod, the
/// cluster leader once the scheduler has marked it `PodScheduled=False` (pods still waiting
/// for their first scheduling attempt are skipped: most are bound within milliseconds, and
/// publishing them would add two cluster-scope commits per created pod); nobody for a
/// finished pod.
pub fn pod_owner(pod: &k8s::Pod) -> Option<Owner> {
    if pod_is_terminal(pod) {
        return None;
    }
    match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
        Some(n) if !n.is_empty() => Some(Owner::Node(n.to_string())),
        _ if pod_scheduling_failed(pod) => Some(Owner::Cluster),
        _ => None,
    }
}

/// Who publishes a ResourceSlice: node-local slices that node's agent, others the cluster leader.
pub fn slice_owner(s: &k8s::ResourceSlice) -> Owner {
    match s.spec.node_name.as_deref() {
        Some(n) if !n.is_empty() => Owner::Node(n.to_string()),
        _ => Owner::Cluster,
    }
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
