//! Loads a [`dramesh_sim::typed`] fleet into a [`View`] (clusters `c0`, `c1`, ...).
//!
//! One file shared by the integration tests, the benches (`#[path]` includes) and the unit
//! tests of the library (through `extern crate self as dramesh_estimator`), so the
//! generator-to-view glue exists once. The object builders themselves live in dramesh-sim.
#![allow(dead_code)]

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
