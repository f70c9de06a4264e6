//! The only place the engine talks to the CEL runtime (`dramesh-cel`).
//!
//! Errors are flattened to strings here because the allocator only ever reports them
//! (a compile or runtime error fails the pod, as in Kubernetes).

use dramesh_model::{AttrValue, QualifiedName, Quantity};

pub(crate) use dramesh_cel::{CelEnv, DeviceInput, Limits, Selector};

pub(crate) fn compile(env: &CelEnv, expr: &str) -> Result<Selector, String> {
    env.compile(expr).map_err(|e| e.to_string())
}

pub(crate) fn evaluate(env: &CelEnv, sel: &Selector, input: &DeviceInput) -> Result<bool, String> {
    env.evaluate(sel, input).map_err(|e| e.message)
}

pub(crate) fn device_input(
    driver: &str,
    attributes: Vec<(QualifiedName, AttrValue)>,
    capacity: Vec<(QualifiedName, Quantity)>,
    allow_multiple_allocations: bool,
) -> DeviceInput {
    DeviceInput::new(driver, attributes, capacity, allow_multiple_allocations)
}
