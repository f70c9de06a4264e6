//! dramesh replication mesh.
//!
//! Documents, their digest and their sync state are `dramesh-store`'s types ([`dramesh_store::DocId`],
//! [`dramesh_store::Digest`], [`dramesh_store::SyncState`]); this crate moves them between peers.
//!
//! - [`identity`]: peer identities from certificate URI SANs and document ownership.
//! - [`store`]: the [`DocStore`] trait the mesh replicates.
//! - [`wire`]: protobuf envelope and length-prefixed framing with a hard size limit.
//! - [`protocol`]: sans-I/O replication state machine (push, relay, anti-entropy, authorization).
//! - [`version`]: protocol versions and features announced in `Hello`, and the rule admitting a
//!   peer.
//! - [`certs`]: development PKI generation and loading (rcgen, PEM).
//! - [`transport`]: quinn/rustls mutual-TLS endpoint configuration.
//! - [`node`]: the async node the daemons run ([`node::MeshHandle`]).
//! - [`store_adapter`]: the persistent `dramesh-store` as a [`DocStore`].
//! - [`daemon`]: what the agent and replica daemons share around a node (store opening, stop
//!   signal, shutdown order).
//! - [`observe`]: copies a node's and its store's state into the daemon's metric set.
//! - `mem_store` (feature `test-util`): an in-memory store for tests and benches.

pub mod certs;
pub mod daemon;
pub mod identity;
#[cfg(feature = "test-util")]
pub mod mem_store;
pub mod node;
pub mod observe;
pub mod protocol;
pub mod signing;
pub mod store;
pub mod store_adapter;
mod sync;
pub mod transport;
pub mod version;
pub mod wire;

pub use identity::PeerIdentity;
pub use store::{DocStore, RejectReason};
