//! What the agent's sources produce: scoped batches of object changes.
//!
//! A member cluster's records are split by who publishes them. Node-local records (a node's
//! Node object, its ResourceSlices, its pods and the claims allocated on it) are published by
//! that node's agent under [`Scope::Node`]; cluster-scoped records (DeviceClasses,
//! DeviceTaintRules, network-attached slices, claims allocated from them, ClusterInfo) are
//! published by the one agent holding the cluster's Lease under [`Scope::Cluster`] with the
//! Lease term. Every record belongs to exactly one scope at a time, so the union of all scopes
//! has no duplicates.

use dramesh_model::ObjectChange;

/// Who publishes a batch.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// Node-local records, published by the agent running on this node.
    Node(String),
    /// Cluster-scoped records, published by the elected agent. `term` is the Lease's
    /// `leaseTransitions` when this agent acquired it: it grows with every change of holder,
    /// so a store that sees two terms should keep the newer one's records.
    Cluster {
        /// The Lease term.
        term: u64,
    },
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Node(n) => write!(f, "node {n}"),
            Scope::Cluster { term } => write!(f, "cluster (term {term})"),
        }
    }
}

/// One flush of the coalescer for one scope.
///
/// Holds at most one change per key. When `snapshot` is set the batch is the complete state
/// of its scope: every record of the scope is an `Upsert` in it, and a receiver should drop
/// any record of that scope the batch does not name (this is how records deleted while no
/// agent was watching, or published by a previous leader, get removed). Sources send a
/// snapshot first for every scope they publish (for [`Scope::Cluster`], once per term), and
/// incremental batches after it.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The scope the changes belong to.
    pub scope: Scope,
    /// At most one change per key.
    pub changes: Vec<ObjectChange>,
    /// Whether the batch is the complete state of its scope.
    pub snapshot: bool,
}

/// What a source sends to the coalescer.
#[derive(Debug, Clone)]
pub enum SourceEvent {
    /// Incremental changes to a scope.
    Changes {
        /// The scope changed.
        scope: Scope,
        /// The changes, in order.
        changes: Vec<ObjectChange>,
    },
    /// The complete state of a scope (only `Upsert`s); replaces anything pending for it.
    Snapshot {
        /// The scope replaced.
        scope: Scope,
        /// Every record of the scope.
        changes: Vec<ObjectChange>,
    },
}
