//! dramesh-estimator: the multi-cluster view, device-aware replica estimation, Karmada
//! placement, preemption and quota caps. Pure: no async runtime, no network, and no file
//! access except [`load_snapshot`] and [`load_workload`].
//!
//! Modules are private and layered; a module only uses modules of lower layers (checked by
//! the `layering` test, drawn in ARCHITECTURE.md):
//!
//! 1. `hash`, `resources`, `filter`, `policy`: vocabulary with no estimator dependencies.
//! 2. `workload`: what one replica needs. `cluster_devices`: incremental device state.
//! 3. `view`: the clusters, fed one object at a time. `snapshot` loads one from files.
//! 4. `overlay`: what-if removals. `quota`: caps.
//! 5. `fit`: per-query device fit and its caches.
//! 6. `assumed`: in-flight workloads deducted before an estimate.
//! 7. `estimate`: per-cluster max replicas.
//! 8. `placement`, `preempt`, `reservations`: built on estimates.
//!
//! `headroom` (scale-up headroom from Karpenter NodePools) sits between `view` and
//! `estimate`: it plans hypothetical nodes from the view, and `estimate` counts them with its
//! per-node fit through a closure.

mod assumed;
mod cluster_devices;
mod estimate;
mod filter;
mod fit;
mod hash;
mod headroom;
mod overlay;
mod placement;
mod policy;
mod preempt;
mod quota;
mod reservations;
mod resources;
mod snapshot;
mod view;
mod workload;

#[cfg(test)]
mod layering;

// Lets the fleet helper shared with tests/ and benches/ name this crate the same way there
// and in unit tests.
#[cfg(test)]
extern crate self as dramesh_estimator;
#[cfg(test)]
#[path = "../tests/all/common/fleet.rs"]
mod test_fleet;

pub use assumed::{Assumed, AssumedList, AssumedWorkload, Reach};
pub use cluster_devices::{ClassUsage, ClusterDevices};
pub use estimate::{
    CacheBound, ClusterEstimate, Component, DEADLINE_EXCEEDED, DEFAULT_CACHE_BYTES, Estimate,
    EstimateOptions, Estimator, LIMIT_UNKNOWN, MIN_CACHE_BYTES, estimate, estimate_component_sets,
    view_cache_bytes,
};
pub use filter::{Exclusion, NodeClaim, NodeFacts};
pub use headroom::{
    AutoscalerHealth, ClusterHeadroom, FAILURE_THRESHOLD, HeadroomOptions, PoolHeadroom,
    RECOVERY_INTERVAL,
};
pub use placement::{
    ClusterInfos, PlacementResult, Previous, SpreadCandidate, SpreadDemand, TargetCluster, assign,
    assign_keeping, divide_static_weights, place, select_spread, tie_ascending, webster,
};
pub use policy::{
    AffinityTerm, ClusterAffinity, LabelRequirement, Policy, PolicyError, SpreadConstraint,
    Strategy,
};
pub use preempt::{ClusterPreemption, PreemptionResult, Victim, preempt};
pub use quota::{ClusterQuota, DeviceClassMapping, MappingSource, QuotaError, QuotaSet};
pub use reservations::{
    Admission, ClusterResolution, Ranked, Reservation, Resolution, rank_cmp, resolve,
    resolve_cluster,
};
pub use resources::{ResList, ResName};
pub use snapshot::{SnapshotError, load_snapshot};
pub use view::{
    ApplyError, Autoscaling, ClusterView, Decoded, NodeChange, NodeEntry, NodeUsage, Owner,
    PodEntry, VIEW_BYTES_PER, View, ViewStamp, decode, owner_key,
};
pub use workload::{
    ClaimRef, MAX_CLAIM_REFS, TemplateRef, TemplateSource, Workload, WorkloadError, load_workload,
};
