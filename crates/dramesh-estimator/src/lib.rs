//! dramesh-estimator: the multi-cluster view, device-aware replica estimation, Karmada
//! placement, preemption and quota caps. Pure: no async runtime, no network, and no file
//! access except [`load_snapshot`] and [`load_workload`].

pub mod devices;
pub mod estimate;
pub mod fasthash;
pub mod filter;
pub mod placement;
pub mod preempt;
pub mod quota;
pub mod reservations;
pub mod resources;
pub mod snapshot;
pub mod view;
pub mod workload;

// Lets the fleet helper shared with tests/ and benches/ name this crate the same way there
// and in unit tests.
#[cfg(test)]
extern crate self as dramesh_estimator;
#[cfg(test)]
#[path = "../tests/common/fleet.rs"]
mod test_fleet;

pub use estimate::{
    AssumedWorkload, ClusterEstimate, Component, Estimate, EstimateOptions, Estimator, estimate,
    estimate_component_sets,
};
pub use placement::{PlacementResult, Policy, PolicyError, Strategy, TargetCluster, place};
pub use preempt::{ClusterPreemption, PreemptionResult, Victim, preempt};
pub use quota::{ClusterQuota, DeviceClassMapping, QuotaSet};
pub use reservations::{Admission, Reservation, Resolution, resolve};
pub use snapshot::{SnapshotError, load_snapshot};
pub use view::{ApplyError, ClusterView, View};
pub use workload::{Workload, WorkloadError, load_workload};
