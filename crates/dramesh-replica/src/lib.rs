//! dramesh-replica: a control-plane replica as a library.
//!
//! Start one with [`Replica::start`] from a [`ReplicaConfig`]; it opens the store, builds the
//! estimation view from it, starts the mesh node and serves the Karmada, native and HTTP APIs
//! from a [`ReplicaState`] (the handle everything answers from, see its lock order).
//!
//! - [`runner`]: the running replica (start/stop, the change feed, readiness, data age).
//! - [`state`]: [`ReplicaState`]: the view and its side indexes, estimates, status, freshness.
//! - `reserve`, `reservations`, `group_commit`: in-flight reservations (resolution, writing
//!   with group commit; the record and its table).
//! - `retire`: retiring member clusters through replicated tombstones.
//! - `requests`: API requests (manifests, Karmada requirements) as estimator workloads.
//! - `backend`: [`ReplicaBackend`], the API crate's `Backend` over the state.
//! - `pending`: unbound pods for `GetUnschedulableReplicas`; `devstatus`: device counts by
//!   class for the status report.
//! - [`karmada`]: the scheduler role's Karmada API client (watches, reads, merge patches,
//!   Events; kube I/O only).
//! - `scheduler`: the scheduler role's loop ([`SchedulerRole`]): Karmada bindings whose
//!   `spec.schedulerName` names this replica are decided on its view and written back.
//! - [`members`]: which replicas share the scheduler role's work (role records, liveness).
//! - `routes`, `status_page`, `observe`: the replica's own HTTP routes, the status page and the
//!   reservation metrics.

mod backend;
mod devstatus;
mod group_commit;
pub mod karmada;
pub mod members;
mod observe;
mod pending;
mod requests;
mod reservations;
mod reserve;
mod retire;
mod routes;
pub mod runner;
mod scheduler;
pub mod state;
mod status_page;
mod sync;

pub use backend::ReplicaBackend;
pub use members::Peers;
pub use runner::{DEFAULT_READY_TIMEOUT, Replica, ReplicaConfig};
pub use scheduler::{
    Confirm, DEFAULT_SCHEDULER_NAME, DEFAULT_SETTLE, SchedulerRole, serve, serve_shared,
};
pub use state::ReplicaState;
