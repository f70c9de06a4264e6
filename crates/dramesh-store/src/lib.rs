//! dramesh-store: the CRDT state store of dramesh.
//!
//! Each member cluster is described by a few automerge documents, one per writer (an agent).
//! A document is a flat map from object keys (`node/<name>`, `pod/<ns>/<name>`, ...; see
//! [`keys`]) to one trimmed Kubernetes object as compact JSON bytes (deflated when that is
//! smaller; the store's API always deals in plain JSON). Only the writer's derived
//! actor may author a document ([`writer_actor`]), and with [`Trust`] installed every incoming
//! change must be covered by the writer's verified signature ([`attest`]); replicas show a node
//! writer's records only for its own node ([`CLUSTER_PUBLISHER`] publishes whole clusters).
//! History is bounded by generation rollover, documents persist as CRC-framed append-only files,
//! and every mutation reports exactly the visible object changes it caused.
//!
//! The crate is sans-I/O with respect to the network: the mesh moves the bytes produced by
//! [`Store::generate_sync_message`] and feeds received ones to [`Store::receive_sync_message`].
//! The document model and its invariants are described in the repository's `ARCHITECTURE.md`.

pub mod attest;
mod auth;
mod digest;
mod docid;
mod error;
pub mod keys;
pub mod object;
mod packed;
mod persist;
mod store;
mod sync_state;
mod value;
mod view;

pub use attest::{Attestation, HeadsSigner, HeadsVerifier, SignedMessage, Trust};
pub use digest::{DIGEST_BUCKETS, Digest, DocEntry};
pub use docid::{
    CLUSTER_PUBLISHER, DocId, HeadsHash, REPLICA_SCOPES, RESERVATION_SCOPE, RETIRED_SCOPE,
    heads_hash, hex, is_replica_scope, valid_segment, writer_actor,
};
pub use error::StoreError;
pub use object::{ObjectChange, ObjectKey, ObjectKind};
pub use persist::{Durability, STORE_FORMAT, STORE_FORMAT_MINOR};
pub use store::{
    CorruptDoc, DocStats, MAX_FUTURE_GENERATION_MS, OpenReport, PendingSync, Proof, RolloverPolicy,
    Store, StoreConfig, TruncatedTail, WriteOutcome, stored_generation,
};
pub use sync_state::SyncState;
