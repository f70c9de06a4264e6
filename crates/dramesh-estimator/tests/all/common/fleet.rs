//! Loads a [`dramesh_sim::typed`] fleet into a [`View`] (clusters `c0`, `c1`, ...), and
//! draws random fleet shapes from a seeded generator for the agreement tests.
//!
//! One file shared by the integration tests, the benches (`#[path]` includes) and the unit
//! tests of the library (through `extern crate self as dramesh_estimator`), so the
//! generator-to-view glue exists once. The object builders themselves live in dramesh-sim.
#![allow(dead_code, unreachable_pub)]

use dramesh_estimator::{ApplyError, View};
use dramesh_sim::typed::{FleetSpec, cluster_objects};

/// Builds the whole fleet; `allocated(node index)` GPUs of each node are in use. Stops at
/// the first object the view rejects.
pub fn fleet(spec: &FleetSpec, allocated: &dyn Fn(usize) -> usize) -> Result<View, ApplyError> {
    let mut view = View::new();
    for c in 0..spec.clusters {
        let name = format!("c{c}");
        let mut first_error = None;
        cluster_objects(spec, c, allocated, |o| {
            if first_error.is_none()
                && let Err(e) = view.apply_object(&name, o)
            {
                first_error = Some(e);
            }
        });
        if let Some(e) = first_error {
            return Err(e);
        }
    }
    Ok(view)
}

/// Deterministic generator for the randomised tests: a seed always yields the same fleets.
pub use dramesh_testkit::Lcg;

/// A random three-cluster fleet shape: `nodes.0 + rng(nodes.1)` nodes per cluster, then
/// `gpus.0 + rng(gpus.1)` GPUs per node, then the owners per cluster (`None`: `1 + rng(4)`),
/// drawn in that order so that a seed keeps naming the same fleets.
pub fn random_spec(
    rng: &mut Lcg,
    nodes: (usize, u64),
    gpus: (usize, u64),
    owners: Option<usize>,
) -> FleetSpec {
    let nodes_per_cluster = nodes.0 + rng.next(nodes.1) as usize;
    let gpus_per_node = gpus.0 + rng.next(gpus.1) as usize;
    let owners_per_cluster = owners.unwrap_or_else(|| 1 + rng.next(4) as usize);
    FleetSpec {
        clusters: 3,
        nodes_per_cluster,
        gpus_per_node,
        owners_per_cluster,
        kubernetes_version: "1.36".into(),
    }
}
