//! The deadline of the call a blocking worker is computing.
//!
//! The servers run each backend call on Tokio's blocking pool under a timeout; when it fires
//! the caller is answered, but the worker would compute on. The server therefore sets the
//! call's deadline for the duration of the backend call ([`scoped`]), and a backend passes
//! [`current`] to its computation (the estimator's `EstimateOptions::deadline`), which stops
//! cooperatively once it has passed. Outside a server call there is no deadline.

use std::cell::Cell;
use std::time::Instant;

thread_local! {
    static CURRENT: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The deadline of the backend call running on this thread, if any.
pub fn current() -> Option<Instant> {
    CURRENT.with(Cell::get)
}

/// Runs `f` with `deadline` as [`current`], restoring the previous value afterwards (also
/// when `f` panics).
pub fn scoped<R>(deadline: Instant, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Instant>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(Some(deadline))));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn scoped_sets_and_restores() {
        assert_eq!(current(), None);
        let d = Instant::now() + Duration::from_secs(1);
        let inner = scoped(d, || {
            let e = d + Duration::from_secs(1);
            assert_eq!(scoped(e, current), Some(e));
            current()
        });
        assert_eq!(inner, Some(d));
        assert_eq!(current(), None);
        let r = std::panic::catch_unwind(|| scoped(d, || panic!("boom")));
        assert!(r.is_err());
        assert_eq!(current(), None);
    }
}
