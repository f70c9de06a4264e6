//! The deadline of the call a blocking worker is computing, and whether its caller still waits.
//!
//! The servers run each backend call on Tokio's blocking pool under a timeout; when it fires
//! the caller is answered, but the worker would compute on. The server therefore sets the
//! call's deadline for the duration of the backend call ([`scoped_until`]), together with a
//! stop flag that is raised when the request is dropped ([`Stop`]: the client went away, the
//! connection closed, or the answer was sent), and a backend passes both to its computation
//! ([`estimate_options`], the estimator's `EstimateOptions::{deadline, stop}`; [`passed`]
//! between its own steps), which stops cooperatively once either is reached. Outside a server
//! call there is neither.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

#[derive(Clone)]
struct Scope {
    deadline: Instant,
    stop: Arc<AtomicBool>,
}

thread_local! {
    static CURRENT: RefCell<Option<Scope>> = const { RefCell::new(None) };
}

/// The flag a worker reads; raised when the [`StopOnDrop`] made with it is dropped.
#[derive(Debug, Clone, Default)]
pub struct Stop(Arc<AtomicBool>);

/// Raises its [`Stop`] flag when dropped (held by the request's future).
#[derive(Debug)]
pub struct StopOnDrop(Arc<AtomicBool>);

impl Stop {
    /// A flag and the guard that raises it.
    pub fn new() -> (Stop, StopOnDrop) {
        let f = Arc::new(AtomicBool::new(false));
        (Stop(f.clone()), StopOnDrop(f))
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// The deadline of the backend call running on this thread, if any.
pub fn current() -> Option<Instant> {
    CURRENT.with(|c| c.borrow().as_ref().map(|s| s.deadline))
}

/// The stop flag of the backend call running on this thread, if any.
pub fn stop_flag() -> Option<Arc<AtomicBool>> {
    CURRENT.with(|c| c.borrow().as_ref().map(|s| s.stop.clone()))
}

/// Whether the backend call running on this thread should stop: its deadline passed or its
/// caller stopped waiting. Always `false` outside a server call.
pub fn passed() -> bool {
    CURRENT.with(|c| {
        c.borrow()
            .as_ref()
            .is_some_and(|s| s.stop.load(Ordering::Acquire) || Instant::now() >= s.deadline)
    })
}

/// Estimator options carrying this call's deadline and stop flag (the rest default).
pub fn estimate_options() -> dramesh_estimator::EstimateOptions {
    dramesh_estimator::EstimateOptions {
        deadline: current(),
        stop: stop_flag(),
        ..Default::default()
    }
}

/// Runs `f` with `deadline` as [`current`] and a flag nobody raises, restoring the previous
/// scope afterwards (also when `f` panics).
pub fn scoped<R>(deadline: Instant, f: impl FnOnce() -> R) -> R {
    scoped_until(deadline, Stop::default(), f)
}

/// Runs `f` with `deadline` and `stop` as this thread's call scope, restoring the previous
/// scope afterwards (also when `f` panics).
pub fn scoped_until<R>(deadline: Instant, stop: Stop, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Scope>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            CURRENT.with(|c| *c.borrow_mut() = prev);
        }
    }
    let scope = Scope {
        deadline,
        stop: stop.0,
    };
    let _restore = Restore(CURRENT.with(|c| c.borrow_mut().replace(scope)));
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

    #[test]
    fn a_dropped_request_stops_its_worker() {
        assert!(!passed());
        let far = Instant::now() + Duration::from_secs(3600);
        let (stop, guard) = Stop::new();
        let worker = std::thread::spawn(move || {
            scoped_until(far, stop, || {
                let until = Instant::now() + Duration::from_secs(10);
                while !passed() {
                    assert!(Instant::now() < until, "never told to stop");
                    std::thread::sleep(Duration::from_millis(1));
                }
                estimate_options().past_deadline()
            })
        });
        drop(guard);
        assert!(worker.join().unwrap(), "the estimator sees the stop too");
        assert!(scoped(Instant::now(), passed), "a passed deadline");
    }
}
