//! Typed errors of the store. Every variant names the document (or file) concerned.

use crate::docid::DocId;
use std::path::PathBuf;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An object key does not parse.
    #[error("invalid object key {key}: {reason}")]
    InvalidKey {
        /// The key as given.
        key: String,
        /// Why it does not parse.
        reason: String,
    },

    /// A write to a document this store does not write.
    #[error("document {doc} is not written by this store (open_writer was not called for it)")]
    NotWriter {
        /// The document.
        doc: DocId,
    },

    /// A document id the mesh could not name ([`DocId::is_valid`]).
    #[error(
        "document id {doc} is invalid: cluster and writer must be 1-253 chars of [a-z0-9.-], \
         starting and ending alphanumeric (cluster may be \"_reservations\" or \"_retired\" for a \
         replica's own documents)"
    )]
    InvalidDocId {
        /// The refused id.
        doc: DocId,
    },

    /// The document is not held.
    #[error("document {doc} is unknown to this store")]
    UnknownDoc {
        /// The document.
        doc: DocId,
    },

    /// The mesh's policy refused this peer as a source of the document.
    #[error("peer is not allowed to deliver document {doc} (generation {generation})")]
    PeerNotAllowed {
        /// The document.
        doc: DocId,
        /// The generation the peer offered.
        generation: u64,
    },

    /// An incoming sync message carries changes that no verified signature of the writer
    /// covers: unsigned, signed by a key or certificate the mesh does not trust for this
    /// document, or not reachable from the signed heads. Nothing from the message was applied.
    #[error("sync message for document {doc} generation {generation} refused: {reason}")]
    BadSignature {
        /// The document.
        doc: DocId,
        /// The generation of the message.
        generation: u64,
        /// What failed.
        reason: String,
    },

    /// A change in an incoming sync message was authored by an actor other than the document's
    /// writer. Nothing from the message was applied.
    #[error(
        "sync message for document {doc} generation {generation} carries a change by actor {actor}, \
         but only the writer's actor {expected} may author it; message refused"
    )]
    ForeignAuthor {
        /// The document.
        doc: DocId,
        /// The generation the message is for.
        generation: u64,
        /// The actor that authored the refused change (hex).
        actor: String,
        /// The writer's actor (hex).
        expected: String,
    },

    /// A sync message that does not decode or carries unacceptable chunks.
    #[error("sync message for document {doc} is malformed: {reason}")]
    MalformedMessage {
        /// The document.
        doc: DocId,
        /// What is wrong with the message.
        reason: String,
    },

    /// A sync message for a generation more than 30 days ahead of this store's clock
    /// ([`MAX_FUTURE_GENERATION_MS`](crate::MAX_FUTURE_GENERATION_MS)): generations are
    /// the writer's wall clock, so its clock runs ahead. Nothing was applied.
    #[error(
        "sync message for document {doc}: generation {generation} lies more than 30 days in the \
         future by this clock (the writer's clock is probably ahead); message refused"
    )]
    FutureGeneration {
        /// The document.
        doc: DocId,
        /// The refused generation (the writer's wall clock in milliseconds when it began).
        generation: u64,
    },

    /// A sync message for a generation of a member cluster that was retired from the fleet
    /// ([`Store::retire_cluster`](crate::Store::retire_cluster)) that does not rejoin it: it
    /// began before the retirement, or its writer did not ask to rejoin after it
    /// ([`Store::rejoin`](crate::Store::rejoin)). Nothing was applied.
    #[error(
        "document {doc} generation {generation}: cluster {cluster} was retired from the fleet at \
         {retired_at_ms} ms since the epoch, and this generation does not rejoin it (a rollover \
         is not a rejoin); restart its agent with --rejoin to publish again",
        cluster = doc.cluster
    )]
    RetiredCluster {
        /// The document.
        doc: DocId,
        /// The refused generation.
        generation: u64,
        /// When the cluster was retired (wall clock, milliseconds since the epoch).
        retired_at_ms: u64,
    },

    /// A sync message above [`StoreConfig::max_message_bytes`](crate::StoreConfig::max_message_bytes).
    #[error("sync message for document {doc} is {size} bytes, above the limit of {limit}")]
    MessageTooLarge {
        /// The document.
        doc: DocId,
        /// The message's size in bytes.
        size: usize,
        /// The configured limit in bytes.
        limit: usize,
    },

    /// Too many next-generation documents are being received at once.
    #[error("too many incomplete next-generation documents ({limit}); refusing to start {doc}")]
    TooManyPending {
        /// The document whose next generation was refused.
        doc: DocId,
        /// How many may be incomplete at once.
        limit: usize,
    },

    /// A member cluster already has as many documents as one may hold.
    #[error("member cluster {} already has {limit} documents; refusing to start {doc}", doc.cluster)]
    TooManyDocs {
        /// The document refused.
        doc: DocId,
        /// How many documents one cluster may have.
        limit: usize,
    },

    /// automerge refused an operation.
    #[error("automerge failed on document {doc}: {source}")]
    Automerge {
        /// The document.
        doc: DocId,
        /// automerge's error.
        #[source]
        source: Box<automerge::AutomergeError>,
    },

    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}
