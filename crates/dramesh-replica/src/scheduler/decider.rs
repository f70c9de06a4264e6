//! The one thread that decides bindings and queues the reservations holding them.
//!
//! Decisions are made one at a time, so that each deducts the reservations of those before
//! it. They run on a thread of their own fed by a queue: one decision follows the other
//! without waiting for an async lock's hand-over, a runtime worker or the blocking pool in
//! between (a few hundred microseconds each on a busy 2-core machine, as much as a decision
//! itself). Guarantee: jobs run in the order they were queued, never two at once.
//!
//! Being one thread, it is the role's serial resource: when decisions arrive faster than it
//! runs them (on a machine short of CPU, the thread's turn comes late too), they queue. The
//! metrics say so: the wait for the thread and the time it runs, per decision.
//!
//! On a busy machine the thread's turn is what decides the tail: it is runnable beside the
//! replica's other threads, so it is given a higher priority (a lower nice value,
//! [`crate::DEFAULT_DECIDER_NICE`]) where the process may raise one (`CAP_SYS_NICE`, or
//! `RLIMIT_NICE`). Where it may not, the thread keeps the process's priority, which is logged
//! once and shown by `dramesh_scheduler_decider_nice`.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use dramesh_telemetry::registry::{Gauge, Histogram, MetricsError, Registry};

use crate::state::ReplicaState;

type Job = Box<dyn FnOnce(&ReplicaState) + Send>;

/// `dramesh_scheduler_decider_*`: per decision, the wait for the deciding thread and the time
/// it ran (the rate of the latter's sum is the share of time the thread is busy).
#[derive(Clone)]
pub(crate) struct DeciderMetrics {
    wait: Arc<Histogram>,
    run: Arc<Histogram>,
    /// The nice value the thread runs at.
    nice: Arc<Gauge>,
}

impl DeciderMetrics {
    pub(crate) fn register(r: &Registry) -> Result<DeciderMetrics, MetricsError> {
        const BUCKETS: &[f64] = &[
            0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0,
        ];
        Ok(DeciderMetrics {
            wait: r.histogram(
                "dramesh_scheduler_decider_wait_seconds",
                "Time a decision waited for the deciding thread (decisions are made one at a time).",
                BUCKETS,
            )?,
            run: r.histogram(
                "dramesh_scheduler_decider_run_seconds",
                "Time the deciding thread spent on one decision, wall clock (the rate of the sum is how busy the thread is).",
                BUCKETS,
            )?,
            nice: r.gauge(
                "dramesh_scheduler_decider_nice",
                "Nice value of the deciding thread (lower runs first; --scheduler-decider-nice asks for it, and it stays the process's without CAP_SYS_NICE).",
            )?,
        })
    }
}

/// The queue of the deciding thread; the thread ends when this is dropped.
pub(super) struct Decider {
    tx: mpsc::Sender<Job>,
    metrics: Option<DeciderMetrics>,
}

impl Decider {
    /// Starts the thread and asks for nice value `nice` for it (0: the process's); returns
    /// once it runs at the one it got (`dramesh_scheduler_decider_nice`).
    pub(super) fn start(
        state: Arc<ReplicaState>,
        metrics: Option<DeciderMetrics>,
        nice: i32,
    ) -> std::io::Result<Decider> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (told, got) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("dramesh-decide".into())
            .spawn(move || {
                let _ = told.send(prioritize(nice));
                for job in rx {
                    // A panicking job answers nothing (its caller sees the decider's error)
                    // and does not stop the next.
                    let run = std::panic::AssertUnwindSafe(|| job(&state));
                    if std::panic::catch_unwind(run).is_err() {
                        tracing::error!("a scheduling decision panicked");
                    }
                }
            })?;
        let nice = got
            .recv()
            .map_err(|_| std::io::Error::other("the deciding thread ended at its start"))?;
        if let Some(m) = &metrics {
            m.nice.set(f64::from(nice));
        }
        Ok(Decider { tx, metrics })
    }

    /// Runs `f` on the deciding thread after every job queued before it.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&ReplicaState) -> T + Send + 'static,
    ) -> Result<T, String> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let metrics = self.metrics.clone();
        let queued = Instant::now();
        self.tx
            .send(Box::new(move |st| {
                let started = Instant::now();
                let out = f(st);
                if let Some(m) = metrics {
                    m.wait.observe((started - queued).as_secs_f64());
                    m.run.observe(started.elapsed().as_secs_f64());
                }
                let _ = reply.send(out);
            }))
            .map_err(|_| "the deciding thread stopped".to_string())?;
        answer
            .await
            .map_err(|_| "the decision failed on the deciding thread".to_string())
    }
}

/// Sets the calling thread's nice value to `nice` unless that is 0 (a lower value needs
/// `CAP_SYS_NICE` or `RLIMIT_NICE`); returns the value it runs at, logging when that is not
/// the one asked for.
fn prioritize(nice: i32) -> i32 {
    let current = thread_nice().unwrap_or(0);
    if nice == 0 || nice == current {
        return current;
    }
    match set_thread_nice(nice) {
        Ok(()) => {
            tracing::debug!(nice, "the deciding thread runs at a nice value of its own");
            thread_nice().unwrap_or(nice)
        }
        Err(e) => {
            tracing::warn!(
                error = %e, asked = nice, runs_at = current,
                "the deciding thread keeps the process's priority: a lower nice value needs \
                 CAP_SYS_NICE (or RLIMIT_NICE). On a busy machine decisions then wait behind \
                 the replica's other threads (dramesh_scheduler_decider_wait_seconds); \
                 --scheduler-decider-nice 0 asks for nothing"
            );
            current
        }
    }
}

/// The calling thread's nice value (Linux keeps one per thread).
#[cfg(target_os = "linux")]
fn thread_nice() -> std::io::Result<i32> {
    let tid = rustix::thread::gettid();
    Ok(rustix::process::getpriority_process(Some(tid))?)
}

#[cfg(target_os = "linux")]
fn set_thread_nice(nice: i32) -> std::io::Result<()> {
    let tid = rustix::thread::gettid();
    Ok(rustix::process::setpriority_process(Some(tid), nice)?)
}

#[cfg(not(target_os = "linux"))]
fn thread_nice() -> std::io::Result<i32> {
    Err(std::io::ErrorKind::Unsupported.into())
}

#[cfg(not(target_os = "linux"))]
fn set_thread_nice(_: i32) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "a thread's own nice value is Linux only",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn jobs_run_in_order_one_at_a_time_and_a_panic_does_not_stop_the_next() {
        let d = Arc::new(Decider::start(ReplicaState::in_memory("t"), None, 0).unwrap());
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut answers = Vec::new();
        for i in 0..50 {
            let log = log.clone();
            answers.push(d.run(move |_| {
                log.lock().unwrap().push(i);
                i
            }));
        }
        let got = futures::future::join_all(answers).await;
        assert_eq!(got, (0..50).map(Ok).collect::<Vec<_>>());
        assert_eq!(*log.lock().unwrap(), (0..50).collect::<Vec<_>>());
        let failed = d.run(|_| -> u32 { panic!("boom") }).await;
        assert!(failed.is_err());
        assert_eq!(d.run(|_| 7).await, Ok(7));
    }

    #[tokio::test]
    async fn the_metrics_count_each_decision_its_wait_and_its_run() {
        let m = DeciderMetrics::register(&Registry::new()).unwrap();
        let d = Decider::start(ReplicaState::in_memory("t"), Some(m.clone()), 0).unwrap();
        let pause = std::time::Duration::from_millis(60);
        // The second job waits for the first, which runs for `pause`.
        let (a, b) = tokio::join!(d.run(move |_| std::thread::sleep(pause)), d.run(|_| ()));
        assert_eq!((a, b), (Ok(()), Ok(())));
        let (wait, run) = (m.wait.snapshot(), m.run.snapshot());
        assert_eq!((wait.count, run.count), (2, 2));
        assert!(run.sum >= pause.as_secs_f64(), "run time {}", run.sum);
        assert!(wait.sum >= pause.as_secs_f64() * 0.9, "wait {}", wait.sum);
    }

    /// The thread runs at the nice value it reports, and at the one asked for when the
    /// process may set it: a higher value always, a lower one with the privilege.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_thread_runs_at_the_nice_value_it_reports() {
        let base = thread_nice().unwrap();
        for asked in [base + 3, base - 2] {
            let m = DeciderMetrics::register(&Registry::new()).unwrap();
            let d = Decider::start(ReplicaState::in_memory("t"), Some(m.clone()), asked).unwrap();
            let seen = d.run(|_| thread_nice().unwrap()).await.unwrap();
            assert_eq!(m.nice.get(), f64::from(seen), "asked {asked}");
            // Raising a nice value needs no privilege; lowering it does, and is then refused.
            let lowering_allowed =
                set_thread_nice(base).is_ok() && set_thread_nice(base - 1).is_ok();
            let _ = set_thread_nice(base);
            if asked > base || lowering_allowed {
                assert_eq!(seen, asked);
            } else {
                assert_eq!(seen, base);
            }
        }
        // This thread is as it was.
        assert_eq!(thread_nice().unwrap(), base);
    }
}
