//! The group commit's fsync thread: runs a batch's [`PendingSync`] while the protocol thread
//! handles the next batch (see `driver`), so the thread that applies changes does not sit in
//! `syncfs`.
//!
//! Guarantees: syncs run one at a time, in the order submitted, and their results come back in
//! that order. The thread drops its handle on a sync before it reports, so the driver holds the
//! only one again once the result is in (or once the thread is gone: a panic drops it too) and
//! can hand it back to the store, which makes its files pending again on failure.

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use dramesh_store::{PendingSync, StoreError};

/// See the module docs.
pub(super) struct Syncer {
    jobs: Option<mpsc::Sender<Arc<PendingSync>>>,
    done: mpsc::Receiver<Result<(), StoreError>>,
    thread: Option<JoinHandle<()>>,
}

impl Syncer {
    pub(super) fn start() -> std::io::Result<Syncer> {
        let (jobs, rx) = mpsc::channel::<Arc<PendingSync>>();
        let (tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("dramesh-mesh-sync".into())
            .spawn(move || {
                for job in rx {
                    let r = job.run();
                    drop(job);
                    if tx.send(r).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Syncer {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    /// Queues `sync`; `false` when the thread is gone (the caller runs it itself).
    pub(super) fn submit(&mut self, sync: &Arc<PendingSync>) -> bool {
        self.jobs
            .as_ref()
            .is_some_and(|j| j.send(Arc::clone(sync)).is_ok())
    }

    /// [`Syncer::wait`] without waiting: `None` while the oldest sync runs, `Some(None)` when
    /// the thread is gone.
    pub(super) fn try_wait(&mut self) -> Option<Option<Result<(), StoreError>>> {
        match self.done.try_recv() {
            Ok(r) => Some(Some(r)),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => {
                self.jobs = None;
                Some(None)
            }
        }
    }

    /// The result of the oldest sync not reported yet; `None` when the thread is gone.
    pub(super) fn wait(&mut self) -> Option<Result<(), StoreError>> {
        let r = self.done.recv().ok();
        if r.is_none() {
            self.jobs = None;
        }
        r
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the syncs queued.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
