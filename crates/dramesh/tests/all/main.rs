//! The process tests of the `dramesh` binary, as one test binary: each file is a module (one
//! binary links once, where seventeen took 70 % more CPU to relink and six times the disk),
//! and `common` holds what they share. nextest still runs every test in its own process.

mod common;

mod api_auth;
mod bounds;
mod claim_refs;
mod cli;
mod deploy_args;
mod e2e;
mod headroom;
mod readiness;
mod reservation_caps;
mod reservations;
mod retire;
mod scheduler;
mod scheduler_preempt;
mod scheduler_share;
mod shutdown;
mod status_page;
mod telemetry;
