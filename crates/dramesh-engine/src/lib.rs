//! The structured DRA allocator: which devices the kube-scheduler would allocate for a pod's
//! ResourceClaims on one node, with Kubernetes 1.34-1.36 semantics.
//!
//! Pure and deterministic: no I/O, no threads, no clock unless a deadline is asked for.
//!
//! # Use
//!
//! ```text
//! let inv = Inventory::from_objects(&slices, &classes, &taint_rules)?;   // once per cluster,
//!                                                                         // then upsert/remove
//! let mut state = AllocatedState::from_claims(&allocated_claims);        // devices in use
//! match allocate(&inv, &state, &NodeInfo::from_node(&node), &[&claim], &Options::default()) {
//!     Outcome::Allocated(results) => state.commit(&results),              // next replica sees it
//!     Outcome::Unsatisfiable { reason } => ...,                           // this node cannot
//!     Outcome::Error(e) => ...,                                           // fails the pod everywhere
//!     Outcome::BudgetExhausted { steps } => ...,                          // gave up: unknown
//! }
//! ```
//!
//! [`allocate_manifests`] is the `dramesh allocate` command's contract on top of this.
//!
//! # Semantics
//!
//! * Pools are gathered per node (slices with this `nodeName`, matching `nodeSelector`,
//!   `allNodes`, per-device node selection; counter slices always), keeping only the newest
//!   generation; incomplete pools (fewer slices than `resourceSliceCount` at that generation)
//!   and invalid pools (duplicate device names, bad counter references) are not allocated
//!   from. A request in mode `All` fails the pod when any gathered pool is incomplete/invalid.
//! * Search order: pools sorted by (driver, pool name), pools with binding-condition devices
//!   last, slices by name, devices in slice order. Kubernetes 1.36 sorts like this; in 1.34
//!   and 1.35 the pool order was Go map order (random) and slices kept informer order, so
//!   this crate uses the 1.36 order for every version (deterministic; results for those
//!   versions can differ from a real scheduler only in which equivalent device is picked).
//! * First fit: the first complete solution in that order is returned, with backtracking
//!   across devices, requests, `firstAvailable` subrequests and claims.
//! * Errors that fail the pod (not just this node): CEL compile/runtime errors, unknown
//!   DeviceClass, a disabled feature being used, mode `All` on an incomplete or invalid pool,
//!   more than 32 devices per claim, a constraint violated by a mode-`All` device.
//! * The search is bounded by [`Options::max_steps`] (Kubernetes' `allocateOne` invocations)
//!   and optionally a wall-clock [`Options::deadline`]; hitting either gives
//!   [`Outcome::BudgetExhausted`], which the scheduler would treat as "node unschedulable"
//!   (its 10 s Filter timeout).
//! * DeviceTaintRule taints are applied whenever device taints are enabled (the rules can
//!   only exist when the cluster serves them).
//! * `shareID` of multi-allocatable devices is a deterministic version-8 UUID (hash of claim,
//!   request, device and share ordinal) instead of Kubernetes' random UUID.
//!
//! # Versions ([`KubeVersion`])
//!
//! | | 1.34 | 1.35 | 1.36 |
//! |---|---|---|---|
//! | admin access, prioritized list | on | on | on |
//! | consumable capacity, partitionable devices, device taints, extended resources, binding conditions | off | off | on |
//! | counter sets | in device slices | own slices | own slices |
//! | ExactCount from incomplete pools | yes | no | no |
//!
//! Gates can be overridden with [`Options::features`]. List-type attributes (alpha) are not
//! supported.

mod capacity;
mod celx;
mod error;
mod inventory;
mod manifests;
mod search;
mod state;
#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use dramesh_model::k8s;

pub use dramesh_model::nodesel::NodeInfo;
pub use error::{AllocError, AllocErrorKind};
pub use inventory::{Inventory, InventoryError};
pub use manifests::{AllocateReport, ClaimReport, InputError, allocate_manifests};
pub use search::MAX_DEVICES_PER_CLAIM;
pub use state::AllocatedState;

/// Kubernetes minor version whose allocator semantics and default gates apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum KubeVersion {
    /// Kubernetes 1.34.
    V1_34,
    /// Kubernetes 1.35.
    V1_35,
    #[default]
    /// Kubernetes 1.36 (the default).
    V1_36,
}

impl KubeVersion {
    /// Every supported version, oldest first.
    pub const ALL: [KubeVersion; 3] = [KubeVersion::V1_34, KubeVersion::V1_35, KubeVersion::V1_36];

    /// `1.34`, `1.35` or `1.36`.
    pub fn as_str(self) -> &'static str {
        match self {
            KubeVersion::V1_34 => "1.34",
            KubeVersion::V1_35 => "1.35",
            KubeVersion::V1_36 => "1.36",
        }
    }
}

impl fmt::Display for KubeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The version string is not one of the supported minors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported Kubernetes version {0:?} (supported: 1.34, 1.35, 1.36)")]
pub struct UnknownVersion(pub String);

impl FromStr for KubeVersion {
    type Err = UnknownVersion;

    /// Accepts `1.36`, `v1.36` and patch versions such as `1.36.2`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let t = t.strip_prefix('v').unwrap_or(t);
        let mut parts = t.split('.');
        let major = parts.next();
        let minor = parts.next().map(|m| {
            // Tolerate suffixes such as `36+` or `36-gke`.
            m.trim_end_matches(|c: char| !c.is_ascii_digit())
        });
        match (major, minor) {
            (Some("1"), Some("34")) => Ok(KubeVersion::V1_34),
            (Some("1"), Some("35")) => Ok(KubeVersion::V1_35),
            (Some("1"), Some("36")) => Ok(KubeVersion::V1_36),
            _ => Err(UnknownVersion(s.to_string())),
        }
    }
}

/// Feature gates that change allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Features {
    /// DRAAdminAccess.
    pub admin_access: bool,
    /// DRAPrioritizedList (`firstAvailable`).
    pub prioritized_list: bool,
    /// DRAConsumableCapacity.
    pub consumable_capacity: bool,
    /// DRAPartitionableDevices.
    pub partitionable_devices: bool,
    /// DRADeviceTaints (device taints, DeviceTaintRules, tolerations).
    pub device_taints: bool,
    /// DRAExtendedResource (used by the estimator; no effect on claim allocation).
    pub extended_resource: bool,
    /// DRADeviceBindingConditions together with DRAResourceClaimDeviceStatus.
    pub device_binding_and_status: bool,
}

impl Features {
    /// The default gates of a Kubernetes version.
    pub fn defaults_for(version: KubeVersion) -> Features {
        let beta_1_36 = version >= KubeVersion::V1_36;
        Features {
            admin_access: true,
            prioritized_list: true,
            consumable_capacity: beta_1_36,
            partitionable_devices: beta_1_36,
            device_taints: beta_1_36,
            extended_resource: beta_1_36,
            device_binding_and_status: beta_1_36,
        }
    }

    /// Every gate on.
    pub fn all() -> Features {
        Features::defaults_for(KubeVersion::V1_36)
    }
}

impl Default for Features {
    fn default() -> Self {
        Features::defaults_for(KubeVersion::default())
    }
}

/// Default search budget in `allocateOne` steps: well below a second of search on one core,
/// far above what any realistic claim needs (tens to a few thousand steps).
pub const DEFAULT_MAX_STEPS: u64 = 1_000_000;

/// How to allocate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Kubernetes version whose semantics apply.
    pub version: KubeVersion,
    /// Gate overrides; `None` = the defaults of `version`.
    pub features: Option<Features>,
    /// Maximum number of search steps (Kubernetes' `allocateOne` invocations).
    pub max_steps: u64,
    /// Optional wall-clock limit per [`allocate`] call (non-deterministic; off by default).
    pub deadline: Option<Duration>,
    /// Cut search branches that provably hold no solution (on by default). Answers are the
    /// same either way; off, the step count equals Kubernetes' `NumAllocateOneInvocations`.
    pub prune: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options::for_version(KubeVersion::default())
    }
}

impl Options {
    /// Defaults for one Kubernetes version.
    pub fn for_version(version: KubeVersion) -> Options {
        Options {
            version,
            features: None,
            max_steps: DEFAULT_MAX_STEPS,
            deadline: None,
            prune: true,
        }
    }

    /// The gates in effect.
    pub fn effective_features(&self) -> Features {
        self.features
            .unwrap_or_else(|| Features::defaults_for(self.version))
    }
}

/// Result of one allocation attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// One result per claim, in the order given, exactly as `status.allocation` would be.
    Allocated(Vec<k8s::AllocationResult>),
    /// These claims do not fit on this node (the pod may fit elsewhere).
    Unsatisfiable {
        /// Kubernetes' wording of why.
        reason: String,
    },
    /// The pod cannot be scheduled anywhere as it is (Kubernetes' Filter `Error`).
    Error(AllocError),
    /// The search budget ran out before an answer was found: whether the claims fit is
    /// unknown (never to be reported as "does not fit").
    BudgetExhausted {
        /// Steps taken.
        steps: u64,
    },
}

impl Outcome {
    /// True for [`Outcome::Allocated`].
    pub fn is_allocated(&self) -> bool {
        matches!(self, Outcome::Allocated(_))
    }
}

/// Allocates the pod's unallocated `claims` (all together, in order) on `node`.
pub fn allocate(
    inv: &Inventory,
    state: &AllocatedState,
    node: &NodeInfo,
    claims: &[&k8s::ResourceClaim],
    opts: &Options,
) -> Outcome {
    search::run(inv, state, node, claims, opts).0
}

/// [`allocate`], also returning the number of search steps taken (equal to Kubernetes'
/// `NumAllocateOneInvocations` for the same input; 0 when preparation failed).
pub fn allocate_with_steps(
    inv: &Inventory,
    state: &AllocatedState,
    node: &NodeInfo,
    claims: &[&k8s::ResourceClaim],
    opts: &Options,
) -> (Outcome, u64) {
    search::run(inv, state, node, claims, opts)
}
