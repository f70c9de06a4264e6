//! The integration tests of dramesh-estimator, as one test binary (each file a module; nextest still runs every test in its own process).
mod common;
#[path = "common/fleet.rs"]
mod fleet;

mod assumed_devices;
mod budget_unknown;
mod cache_agreement;
mod claim_refs;
mod fixtures_snapshot;
mod headroom;
mod karmada_cases;
mod real_fixtures;
