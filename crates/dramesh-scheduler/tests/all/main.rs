//! The integration tests of dramesh-scheduler, as one test binary (each file a module; nextest still runs every test in its own process).

mod decide;
mod filters;
mod preempt;
mod regions_models;
