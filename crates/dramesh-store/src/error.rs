//! Typed errors of the store. Every variant names the document (or file) concerned.

use crate::docid::DocId;
use std::path::PathBuf;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // Fields are named for what they hold; each message says the rest.
pub enum StoreError {
    /// An object key does not parse.
    #[error("invalid object key {key}: {reason}")]
    InvalidKey { key: String, reason: String },

    /// A write to a document this store does not write.
    #[error("document {doc} is not written by this store (open_writer was not called for it)")]
    NotWriter { doc: DocId },

    #[error(
        "document id {doc} is invalid: cluster and writer must be 1-253 chars of [a-z0-9.-], \
         starting and ending alphanumeric (cluster may be \"_reservations\" for a replica's \
         reservations)"
    )]
    /// A document id the mesh could not name ([`DocId::is_valid`]).
    InvalidDocId { doc: DocId },

    /// The document is not held.
    #[error("document {doc} is unknown to this store")]
    UnknownDoc { doc: DocId },

    /// The mesh's policy refused this peer as a source of the document.
    #[error("peer is not allowed to deliver document {doc} (generation {generation})")]
    PeerNotAllowed { doc: DocId, generation: u64 },

    /// A change in an incoming sync message was authored by an actor other than the document's
    /// writer. Nothing from the message was applied.
    #[error(
        "sync message for document {doc} generation {generation} carries a change by actor {actor}, \
         but only the writer's actor {expected} may author it; message refused"
    )]
    ForeignAuthor {
        doc: DocId,
        generation: u64,
        actor: String,
        expected: String,
    },

    /// A sync message that does not decode or carries unacceptable chunks.
    #[error("sync message for document {doc} is malformed: {reason}")]
    MalformedMessage { doc: DocId, reason: String },

    /// A sync message above [`StoreConfig::max_message_bytes`](crate::StoreConfig::max_message_bytes).
    #[error("sync message for document {doc} is {size} bytes, above the limit of {limit}")]
    MessageTooLarge {
        doc: DocId,
        size: usize,
        limit: usize,
    },

    /// Too many next-generation documents are being received at once.
    #[error("too many incomplete next-generation documents ({limit}); refusing to start {doc}")]
    TooManyPending { doc: DocId, limit: usize },

    /// automerge refused an operation.
    #[error("automerge failed on document {doc}: {source}")]
    Automerge {
        doc: DocId,
        #[source]
        source: Box<automerge::AutomergeError>,
    },

    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
