//! Typed errors of the store. Every variant names the document (or file) concerned.

use crate::docid::DocId;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid object key {key}: {reason}")]
    InvalidKey { key: String, reason: String },

    #[error("document {doc} is not written by this store (open_writer was not called for it)")]
    NotWriter { doc: DocId },

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

    #[error("sync message for document {doc} is malformed: {reason}")]
    MalformedMessage { doc: DocId, reason: String },

    #[error("sync message for document {doc} is {size} bytes, above the limit of {limit}")]
    MessageTooLarge {
        doc: DocId,
        size: usize,
        limit: usize,
    },

    #[error("too many incomplete next-generation documents ({limit}); refusing to start {doc}")]
    TooManyPending { doc: DocId, limit: usize },

    #[error("automerge failed on document {doc}: {source}")]
    Automerge {
        doc: DocId,
        #[source]
        source: Box<automerge::AutomergeError>,
    },

    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
