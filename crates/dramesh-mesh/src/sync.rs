//! The mesh's one rule for its mutexes.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, continuing with the data if a panicking thread poisoned it: every mutex of the
/// mesh (the shared store, the verifier's caches, the node's view) guards plain data that stays
/// consistent between calls, so a panic elsewhere must not take replication down with it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
