//! dramesh-chaos: the chaos partition suite. It builds a fleet of real `dramesh` processes,
//! each in its own network namespace on one bridge, injects faults (partitions, one-way
//! cuts, isolation, delay and loss, SIGKILL and restart, a truncated disk, a shifted clock)
//! while a seeded workload keeps changing the member clusters, and then checks that every
//! replica converged to the last writes and kept answering queries during the fault.
//!
//! Modules: [`net`] (namespaces and firewall faults), [`nfqueue`] (the delay/loss helper),
//! [`http`] (client), [`fleet`] (processes), [`workload`] (driver), [`checker`] (pure
//! verification), [`scenario`] (profiles and the runner), [`sched`] (the Karmada API server and bindings of
//! the scheduler scenarios), [`report`] (figures).

pub mod checker;
pub mod fleet;
pub mod http;
pub mod net;
pub mod nfqueue;
pub mod report;
pub mod scenario;
pub mod sched;
pub mod sys;
pub mod workload;
