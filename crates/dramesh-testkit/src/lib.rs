//! Test support for every crate of the workspace (a dev-dependency, never published; no
//! dependencies of its own):
//!
//! * [`fixtures`]: where `shared/fixtures` is, and the one rule for tests that need it: run when
//!   present, skip with a message when absent, and fail when absent while `CI` is set.
//! * [`layering`]: the module graph of a crate's `src/`, and the check that it has no cycle.
//! * [`Lcg`]: a deterministic generator for randomised tests and benches.

pub mod fixtures;
pub mod layering;
pub mod lcg;

pub use fixtures::{KARMADA_CRDS, REAL, fixtures, fixtures_dir};
pub use lcg::Lcg;
