//! The verifier threads: they run the protocol's signature checks ([`VerifyJob`]) so the
//! protocol thread does not (an ECDSA verification is ~50 µs; a healing replica takes in tens of
//! thousands of signed messages).
//!
//! Guarantees: every job submitted is reported done, exactly once, on the channel given to
//! [`VerifyPool::start`] (also when its thread is gone: then at once, unchecked, and the store
//! checks it on the protocol thread as without the pool). Jobs of one document run on one
//! thread ([`VerifyJob::shard`]), in submission order. The pool owns no protocol or store state:
//! only the verifier, taken anew for each job, so a rotated certificate's verifier is used from
//! the next job on.

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::mpsc;
use tracing::warn;

use crate::protocol::{Ticket, VerifyJob};
use crate::sync::lock;
use dramesh_store::HeadsVerifier;

/// The verifier the node's store holds, shared with the pool (replaced on rotation).
pub type SharedVerifier = Arc<Mutex<Arc<dyn HeadsVerifier>>>;

/// Default number of verifier threads: the cores this process may use (the standard library
/// reads the cgroup CPU quota on Linux).
pub fn default_verify_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Threads running [`VerifyJob`]s (see the module docs). A thread starts with the first job
/// of its shard: a node agent, which checks no signatures, starts none.
pub struct VerifyPool {
    name: String,
    verifier: SharedVerifier,
    queues: Vec<Option<std_mpsc::Sender<VerifyJob>>>,
    threads: Vec<JoinHandle<()>>,
    done: mpsc::UnboundedSender<Ticket>,
}

impl VerifyPool {
    /// A pool of `workers` threads (at least one) that run jobs with `verifier` and report each
    /// one's ticket on `done`; `name` names the threads.
    pub fn new(
        workers: usize,
        name: &str,
        verifier: SharedVerifier,
        done: mpsc::UnboundedSender<Ticket>,
    ) -> VerifyPool {
        VerifyPool {
            name: name.to_string(),
            verifier,
            queues: (0..workers.max(1)).map(|_| None).collect(),
            threads: Vec::new(),
            done,
        }
    }

    /// Number of threads (started or not).
    pub fn workers(&self) -> usize {
        self.queues.len()
    }

    /// Queues `job` on its document's thread.
    pub fn submit(&mut self, job: VerifyJob) {
        let ticket = job.ticket;
        let shard = job.shard(self.queues.len());
        if self.queues[shard].is_none() {
            match self.spawn(shard) {
                Ok(tx) => self.queues[shard] = Some(tx),
                Err(e) => {
                    warn!(error = %e, "cannot start a verifier thread; its checks are left to the protocol thread")
                }
            }
        }
        let sent = match &self.queues[shard] {
            Some(q) => q.send(job).is_ok(),
            None => false,
        };
        if !sent {
            let _ = self.done.send(ticket);
        }
    }

    fn spawn(&mut self, shard: usize) -> std::io::Result<std_mpsc::Sender<VerifyJob>> {
        let (tx, rx) = std_mpsc::channel::<VerifyJob>();
        let (verifier, done) = (self.verifier.clone(), self.done.clone());
        let thread = std::thread::Builder::new()
            .name(format!("{} verify {shard}", self.name))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let v = lock(&verifier).clone();
                    // The verdict is the verifier's to remember; the store judges.
                    let _ = job.run(v.as_ref());
                    if done.send(job.ticket).is_err() {
                        break;
                    }
                }
            })?;
        self.threads.push(thread);
        Ok(tx)
    }
}

impl Drop for VerifyPool {
    fn drop(&mut self) {
        self.queues.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_store::{Attestation, DocId};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Records the order in which documents' checks ran.
    #[derive(Default)]
    struct Recording(Mutex<Vec<(DocId, u8)>>, AtomicUsize);
    impl HeadsVerifier for Recording {
        fn verify(&self, doc: &DocId, _: &[u8], sig: &[u8], _: &[u8]) -> Result<(), String> {
            self.1.fetch_add(1, Ordering::Relaxed);
            lock(&self.0).push((doc.clone(), sig[0]));
            Ok(())
        }
    }

    /// Every job is reported once, and one document's jobs run in submission order.
    #[test]
    fn every_job_is_reported_and_one_documents_jobs_run_in_order() {
        let rec = Arc::new(Recording::default());
        let verifier: Arc<dyn HeadsVerifier> = rec.clone();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut pool = VerifyPool::new(3, "test", Arc::new(Mutex::new(verifier)), tx);
        assert_eq!(pool.workers(), 3);
        let docs: Vec<DocId> = (0..8).map(|i| DocId::new("c", format!("n{i}"))).collect();
        let mut ticket = 0;
        for seq in 0..50u8 {
            for doc in &docs {
                pool.submit(VerifyJob {
                    ticket: Ticket(ticket),
                    doc: doc.clone(),
                    generation: 1,
                    signed: Attestation::new(vec![[1; 32]], vec![seq], Arc::from(&b"c"[..]))
                        .unwrap(),
                });
                ticket += 1;
            }
        }
        let mut seen = std::collections::HashSet::new();
        for _ in 0..ticket {
            let t = rx.blocking_recv().unwrap();
            assert!(seen.insert(t), "{t:?} reported twice");
        }
        drop(pool);
        assert_eq!(rec.1.load(Ordering::Relaxed), 400);
        assert!(rx.try_recv().is_err(), "a job was reported twice");
        for doc in &docs {
            let order: Vec<u8> = lock(&rec.0)
                .iter()
                .filter(|(d, _)| d == doc)
                .map(|(_, s)| *s)
                .collect();
            assert_eq!(order, (0..50).collect::<Vec<u8>>(), "{doc}");
        }
    }
}
