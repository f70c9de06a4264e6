//! Group commit of this replica's reservation document.
//!
//! Writers queue changes and get a [`Ticket`]; waiting for it makes them durable. The first
//! waiter finding nothing being written writes everything queued so far as one batch (one
//! automerge change, one fsync) while later waiters block until a batch covers them, so the
//! scheduler's decisions, made one at a time, do not each wait for the disk: a decision only
//! queues its reservations, and waits for them after the next decision has begun.
//!
//! Guarantees: batches are written in queue order, one at a time, so a later change of a key
//! (a release) never lands before an earlier one (its upsert); a ticket is answered only once
//! a batch holding its changes was written, and with that batch's error if it failed.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

use dramesh_model::ObjectChange;

/// A queued write; see [`GroupCommit::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Ticket(u64);

/// How many failed batches are remembered for the waiters of their tickets. A waiter is
/// woken as soon as its batch is written, so only a waiter descheduled while more than this
/// many later batches failed could miss its error.
const FAILURES_KEPT: usize = 1024;

#[derive(Default)]
struct State {
    queue: Vec<ObjectChange>,
    /// The last ticket issued.
    issued: u64,
    /// Every ticket up to this one is written (or failed).
    written: u64,
    /// A batch is being written.
    writing: bool,
    /// Failed batches, oldest first: (first ticket, last ticket, error).
    failed: VecDeque<(u64, u64, String)>,
}

/// The queue of one document's writes (see the module docs).
#[derive(Default)]
pub(crate) struct GroupCommit {
    state: Mutex<State>,
    written: Condvar,
}

impl GroupCommit {
    /// Queues `changes`; they are written by the wait of this or a later ticket.
    pub(crate) fn submit(&self, changes: Vec<ObjectChange>) -> Ticket {
        let mut st = crate::sync::lock(&self.state);
        st.queue.extend(changes);
        st.issued += 1;
        Ticket(st.issued)
    }

    /// Blocks until `ticket` is written, writing queued batches with `write` while no other
    /// waiter does (never with the queue's lock held). Returns the error of the batch that
    /// held the ticket's changes, if it failed.
    pub(crate) fn wait(
        &self,
        ticket: Ticket,
        write: &mut dyn FnMut(Vec<ObjectChange>) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut st = crate::sync::lock(&self.state);
        loop {
            if st.written >= ticket.0 {
                return match st
                    .failed
                    .iter()
                    .find(|(from, to, _)| (*from..=*to).contains(&ticket.0))
                {
                    Some((_, _, e)) => Err(e.clone()),
                    None => Ok(()),
                };
            }
            if st.writing {
                st = self
                    .written
                    .wait(st)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                continue;
            }
            st.writing = true;
            let batch = std::mem::take(&mut st.queue);
            let (from, to) = (st.written + 1, st.issued);
            drop(st);
            let result = if batch.is_empty() {
                Ok(())
            } else {
                write(batch)
            };
            st = crate::sync::lock(&self.state);
            st.writing = false;
            st.written = to;
            if let Err(e) = result {
                st.failed.push_back((from, to, e));
                while st.failed.len() > FAILURES_KEPT {
                    st.failed.pop_front();
                }
            }
            self.written.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::{ObjectKey, ObjectKind};
    use std::sync::Arc;

    fn change(n: u32) -> ObjectChange {
        ObjectChange::Delete {
            key: ObjectKey::new(ObjectKind::ClusterInfo, None, &format!("k{n}")),
        }
    }

    fn names(changes: &[ObjectChange]) -> Vec<String> {
        changes.iter().map(|c| c.key().name.clone()).collect()
    }

    #[test]
    fn one_wait_writes_everything_queued_in_order() {
        let g = GroupCommit::default();
        let a = g.submit(vec![change(1), change(2)]);
        let b = g.submit(vec![change(3)]);
        let mut batches: Vec<Vec<String>> = Vec::new();
        g.wait(b, &mut |batch| {
            batches.push(names(&batch));
            Ok(())
        })
        .unwrap();
        assert_eq!(batches, vec![vec!["k1", "k2", "k3"]]);
        // `a` was in that batch: nothing more is written for it.
        g.wait(a, &mut |_| panic!("written twice")).unwrap();
    }

    #[test]
    fn a_failed_batch_fails_its_tickets_only() {
        let g = GroupCommit::default();
        let a = g.submit(vec![change(1)]);
        assert_eq!(
            g.wait(a, &mut |_| Err("disk full".into())),
            Err("disk full".to_string())
        );
        let b = g.submit(vec![change(2)]);
        assert_eq!(g.wait(b, &mut |_| Ok(())), Ok(()));
        // Asked again later, `a` still reports its batch's error.
        assert_eq!(
            g.wait(a, &mut |_| panic!("nothing is queued")),
            Err("disk full".to_string())
        );
    }

    #[test]
    fn concurrent_waiters_share_batches_and_every_change_is_written_once_in_order() {
        let g = Arc::new(GroupCommit::default());
        let written: Arc<Mutex<Vec<String>>> = Arc::default();
        let batches = Arc::new(Mutex::new(0usize));
        let threads: Vec<_> = (0..8u32)
            .map(|t| {
                let (g, written, batches) = (g.clone(), written.clone(), batches.clone());
                std::thread::spawn(move || {
                    for i in 0..50u32 {
                        let ticket = g.submit(vec![change(t * 1000 + i)]);
                        g.wait(ticket, &mut |batch| {
                            std::thread::sleep(std::time::Duration::from_micros(200));
                            *batches.lock().unwrap() += 1;
                            written.lock().unwrap().extend(names(&batch));
                            Ok(())
                        })
                        .unwrap();
                        // Durable when the wait returns.
                        let name = format!("k{}", t * 1000 + i);
                        assert!(written.lock().unwrap().contains(&name));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let written = written.lock().unwrap();
        assert_eq!(written.len(), 400, "each change exactly once");
        // Each thread's changes land in its submission order.
        for t in 0..8u32 {
            let pos: Vec<usize> = (0..50u32)
                .map(|i| {
                    written
                        .iter()
                        .position(|c| *c == format!("k{}", t * 1000 + i))
                        .unwrap()
                })
                .collect();
            assert!(
                pos.windows(2).all(|w| w[0] < w[1]),
                "thread {t} out of order"
            );
        }
        assert!(
            *batches.lock().unwrap() < 400,
            "waiters should have shared batches"
        );
    }
}
