//! The dramesh member-cluster agent, as a library the `dramesh agent` command runs: its
//! sources, and its publishing side ([`publish`]: the running agent writing its own document
//! and handing it to the mesh).
//!
//! Two sources feed a [`coalesce`] stage that turns bursts of changes into scoped
//! [`Batch`]es for the CRDT store:
//! - [`kube_source`]: kube-rs watchers on a live cluster (DaemonSet mode, one agent per node,
//!   plus a Lease-elected agent for cluster-scoped records);
//! - [`dir_source`]: a polled folder of manifests standing in for one cluster.
//!
//! The decisions (trimming, ownership, diffing, coalescing, lease arbitration) are plain
//! functions with unit tests; the async parts only move data between them and the network.

pub mod batch;
pub mod coalesce;
pub mod dir_source;
pub mod kube_source;
pub mod lease;
pub mod mirror;
pub mod publish;
pub mod signer;
pub mod trim;

pub use batch::{Batch, Scope, SourceEvent};
pub use coalesce::{CoalesceConfig, Coalescer, run_coalescer, spawn_coalescer};
pub use dir_source::{DirConfig, run_dir_source};
pub use kube_source::{AgentError, KubeSourceConfig, run_kube_source};
pub use lease::{Leadership, LeaseConfig, RelayView};
pub use publish::{Agent, AgentConfig, AgentSource, CredentialFiles};
