//! dramesh-replica: a control-plane replica as a library.
//!
//! Start one with [`Replica::start`] from a [`ReplicaConfig`]; it opens the store, builds the
//! estimation view from it, starts the mesh node and serves the Karmada, native and HTTP APIs
//! from a [`ReplicaState`] (the handle everything answers from, see its lock order).
//!
//! - [`runner`]: the running replica (start/stop, the change feed, readiness, data age).
//! - [`state`]: [`ReplicaState`]: the view and its side indexes, estimates, status, freshness.
//! - `reservation_table` (the replicated record and the merged table),
//!   `reservation_resolution` (`Reservations`, the component the state composes: the locked
//!   table, caps, overcommit resolution, own writes), `reservation_api` (reserve, release,
//!   sweep), `group_commit` (writing with group commit): in-flight reservations.
//! - `retire`: retiring member clusters through replicated tombstones (`RetiredClusters`,
//!   the component the state composes).
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
mod quorum;
mod requests;
mod reservation_api;
mod reservation_resolution;
mod reservation_table;
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
    Confirm, DEFAULT_DECIDER_NICE, DEFAULT_SCHEDULER_NAME, DEFAULT_SETTLE, SchedulerRole, serve,
    serve_shared,
};
pub use state::ReplicaState;

/// Objects of `scope` in every release's golden data directory (`dramesh-store/tests/golden`,
/// its `store.json` manifests): (manifest path, key, JSON), for the tests that prove each
/// release's records still decode.
#[cfg(test)]
pub(crate) fn golden_objects(scope: &str) -> Vec<(String, String, Vec<u8>)> {
    let golden =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../dramesh-store/tests/golden");
    let mut out = Vec::new();
    for release in std::fs::read_dir(&golden).unwrap() {
        let manifest = release.unwrap().path().join("store.json");
        let Ok(bytes) = std::fs::read(&manifest) else {
            continue;
        };
        let m: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        for o in m["objects"].as_array().unwrap() {
            if o["cluster"].as_str() == Some(scope) {
                out.push((
                    manifest.display().to_string(),
                    o["key"].as_str().unwrap_or_default().to_string(),
                    o["json"].as_str().unwrap_or_default().as_bytes().to_vec(),
                ));
            }
        }
    }
    out
}
