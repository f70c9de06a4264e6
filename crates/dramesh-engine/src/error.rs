//! Why an allocation fails the pod everywhere (Kubernetes' Filter `Error`), as a kind callers
//! can branch on plus the message Kubernetes-style tooling prints.

/// What kind of problem fails the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocErrorKind {
    /// A CEL selector (class or claim) failed to compile or to evaluate on a device.
    Cel,
    /// A request names a DeviceClass that does not exist.
    UnknownClass,
    /// The claim uses a feature whose gate is off.
    FeatureDisabled,
    /// The claim is malformed or uses a form this allocator does not support.
    UnsupportedClaim,
    /// A request in mode `All` over a pool that is being updated or is invalid.
    PoolNotReady,
    /// More devices in one claim than Kubernetes allows (32).
    TooManyDevices,
    /// A device taken by a mode-`All` request violates a claim constraint.
    ConstraintViolated,
    /// Node selection of a slice or device, or the result's node selector, failed.
    NodeSelection,
}

/// An allocation error: its kind and the human message (worded as Kubernetes words it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct AllocError {
    kind: AllocErrorKind,
    message: String,
}

impl AllocError {
    pub(crate) fn new(kind: AllocErrorKind, message: impl Into<String>) -> AllocError {
        AllocError {
            kind,
            message: message.into(),
        }
    }

    /// The kind of problem.
    pub fn kind(&self) -> AllocErrorKind {
        self.kind
    }

    /// The human message (also the `Display` form).
    pub fn message(&self) -> &str {
        &self.message
    }
}
