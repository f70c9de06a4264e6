//! How the replica takes its mutexes.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m` and goes on with the data if a panic poisoned it. The replica's mutexes (see the
/// lock order in `state`) guard data that is consistent between calls; an API request that
/// panicked must not stop every later one.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
