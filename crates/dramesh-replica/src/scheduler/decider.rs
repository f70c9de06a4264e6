//! The one thread that decides bindings and queues the reservations holding them.
//!
//! Decisions are made one at a time, so that each deducts the reservations of those before
//! it. They run on a thread of their own fed by a queue: one decision follows the other
//! without waiting for an async lock's hand-over, a runtime worker or the blocking pool in
//! between (a few hundred microseconds each on a busy 2-core machine, as much as a decision
//! itself). Guarantee: jobs run in the order they were queued, never two at once.

use std::sync::Arc;
use std::sync::mpsc;

use crate::state::ReplicaState;

type Job = Box<dyn FnOnce(&ReplicaState) + Send>;

/// The queue of the deciding thread; the thread ends when this is dropped.
pub(super) struct Decider {
    tx: mpsc::Sender<Job>,
}

impl Decider {
    /// Starts the thread.
    pub(super) fn start(state: Arc<ReplicaState>) -> std::io::Result<Decider> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("dramesh-decide".into())
            .spawn(move || {
                for job in rx {
                    // A panicking job answers nothing (its caller sees the decider's error)
                    // and does not stop the next.
                    let run = std::panic::AssertUnwindSafe(|| job(&state));
                    if std::panic::catch_unwind(run).is_err() {
                        tracing::error!("a scheduling decision panicked");
                    }
                }
            })?;
        Ok(Decider { tx })
    }

    /// Runs `f` on the deciding thread after every job queued before it.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&ReplicaState) -> T + Send + 'static,
    ) -> Result<T, String> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.tx
            .send(Box::new(move |st| {
                let _ = reply.send(f(st));
            }))
            .map_err(|_| "the deciding thread stopped".to_string())?;
        answer
            .await
            .map_err(|_| "the decision failed on the deciding thread".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn jobs_run_in_order_one_at_a_time_and_a_panic_does_not_stop_the_next() {
        let d = Arc::new(Decider::start(ReplicaState::in_memory("t")).unwrap());
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
}
