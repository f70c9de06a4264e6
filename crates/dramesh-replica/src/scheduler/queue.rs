//! The scheduler role's work queue: which bindings to work on next, and when to retry one.
//!
//! Guarantees:
//! - **Deduplicated**: a key is queued at most once; queueing it again while it waits keeps
//!   its place and the time it was first queued.
//! - **One task per key**: a key is never started while it runs; one queued again while it
//!   runs is queued again when it finishes ([`WorkQueue::finish`]), so the change that queued
//!   it is looked at after the running task.
//! - **Concurrency cap**: at most `cap` keys run at once ([`WorkQueue::start`] gives none
//!   beyond).
//! - **Backoff per key** ([`Backoff`], karmada-scheduler's): a failed key is retried after
//!   1 s, 2 s, 4 s, ... up to 10 s; one that was unschedulable waits, in addition, for the
//!   replica's view or reservations to change ([`WorkQueue::view_moved`]), at most 5 minutes.
//!   A success forgets the failures. Room freed by void decisions queues every unschedulable
//!   key at once ([`WorkQueue::retry_unschedulable_now`]).
//! - **Timed by the earliest deadline**: the retries wait in deadline order and the caller
//!   sleeps until the first ([`WorkQueue::next_deadline`], [`WorkQueue::queue_due`]); nothing
//!   is polled.
//!
//! Time is tokio's clock ([`now`]), so tests run it paused.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::time::Instant;

use dramesh_scheduler::{Backoff, RetryState};

/// Now on tokio's clock (the wall's monotonic clock, unless a test paused it).
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// A key's retry: its failures, and where its deadline is filed.
struct Retry {
    state: RetryState,
    /// Its entry in [`WorkQueue::deadlines`], if it is still to fire.
    deadline: Option<(Instant, u64)>,
}

/// The work queue (see the module docs).
pub(crate) struct WorkQueue<K> {
    cap: usize,
    backoff: Backoff,
    /// Keys to start, in the order queued.
    queue: VecDeque<K>,
    /// The queued keys and when each was queued.
    queued: HashMap<K, Instant>,
    /// Keys started and not finished.
    running: HashSet<K>,
    /// Running keys queued again meanwhile.
    again: HashSet<K>,
    /// Keys that failed, until they succeed or are forgotten.
    retry: HashMap<K, Retry>,
    /// The retries still to fire, earliest first (a sequence number keeps equal times apart).
    deadlines: BTreeMap<(Instant, u64), K>,
    seq: u64,
    /// Unschedulable keys whose deadline is the long wait: they failed on the view change
    /// count `view` still has, and are filed again when it moves.
    on_view: HashSet<K>,
    /// The view change count last seen ([`WorkQueue::view_moved`]).
    view: u64,
}

impl<K: Clone + Eq + Hash> WorkQueue<K> {
    /// An empty queue running at most `cap` keys at once, retrying as `backoff` says.
    pub(crate) fn new(cap: usize, backoff: Backoff) -> WorkQueue<K> {
        WorkQueue {
            cap,
            backoff,
            queue: VecDeque::new(),
            queued: HashMap::new(),
            running: HashSet::new(),
            again: HashSet::new(),
            retry: HashMap::new(),
            deadlines: BTreeMap::new(),
            seq: 0,
            on_view: HashSet::new(),
            view: 0,
        }
    }

    /// Queues `key`, unless it is queued already; one that runs is queued again when it
    /// finishes.
    pub(crate) fn enqueue(&mut self, key: K) {
        if self.running.contains(&key) {
            self.again.insert(key);
        } else if !self.queued.contains_key(&key) {
            self.queued.insert(key.clone(), now());
            self.queue.push_back(key);
        }
    }

    /// Whether `key` runs.
    pub(crate) fn is_running(&self, key: &K) -> bool {
        self.running.contains(key)
    }

    /// Whether a key could be started now (one is queued, and the cap leaves room).
    pub(crate) fn can_start(&self) -> bool {
        !self.queue.is_empty() && self.running.len() < self.cap
    }

    /// The next queued key, with when it was queued, marked running (the caller
    /// [`finish`](WorkQueue::finish)es it, whether it started a task for it or not); `None`
    /// when nothing is queued or the cap is reached.
    pub(crate) fn start(&mut self) -> Option<(K, Instant)> {
        if self.running.len() >= self.cap {
            return None;
        }
        let key = self.queue.pop_front()?;
        let queued_at = self.queued.remove(&key).unwrap_or_else(now);
        self.running.insert(key.clone());
        Some((key, queued_at))
    }

    /// Ends `key`'s run; if it was queued again meanwhile, it is queued now.
    pub(crate) fn finish(&mut self, key: &K) {
        self.running.remove(key);
        if self.again.remove(key) {
            self.enqueue(key.clone());
        }
    }

    /// `key` succeeded (or needs no more work): its failures are forgotten.
    pub(crate) fn succeeded(&mut self, key: &K) {
        self.forget(key);
    }

    /// Forgets `key`'s failures and pending retry (it is gone, or another replica's).
    pub(crate) fn forget(&mut self, key: &K) {
        if let Some(r) = self.retry.remove(key) {
            self.unfile(&r);
        }
        self.on_view.remove(key);
    }

    /// `key` failed (`unschedulable`: it fits nowhere; else an error) on a run that started
    /// when the view change count was `view`: it is retried after its backoff.
    pub(crate) fn failed(&mut self, key: &K, view: u64, unschedulable: bool) {
        let previous = self.retry.remove(key).map(|r| {
            self.unfile(&r);
            r.state
        });
        self.on_view.remove(key);
        let state = self
            .backoff
            .failed(previous.as_ref(), now(), view, unschedulable);
        self.file(key.clone(), state);
    }

    /// The view change count is `view` now: unschedulable keys that failed on an older count
    /// wait only for their backoff from now on.
    pub(crate) fn view_moved(&mut self, view: u64) {
        if view == self.view {
            return;
        }
        self.view = view;
        // Filed again in their old order, so equal deadlines keep it.
        let mut moved: Vec<(Option<(Instant, u64)>, K)> = std::mem::take(&mut self.on_view)
            .into_iter()
            .filter_map(|k| self.retry.get(&k).map(|r| (r.deadline, k)))
            .collect();
        moved.sort_by_key(|(slot, _)| *slot);
        for (_, key) in moved {
            if let Some(r) = self.retry.remove(&key) {
                self.unfile(&r);
                self.file(key, r.state);
            }
        }
    }

    /// Room that held nothing was freed (a decision's reservations were found void): every
    /// unschedulable key is queued now, whatever its backoff (one running is queued again
    /// when it finishes, as its run may have judged on the room still held). Their failures
    /// are kept. Unlike a view change, this frees room the refusals counted as taken by
    /// decisions that do not exist, and it happens only when a replica died or its writes
    /// failed, so it cannot keep the queue busy.
    pub(crate) fn retry_unschedulable_now(&mut self) {
        let keys: Vec<K> = self
            .retry
            .iter()
            .filter(|(_, r)| r.state.unschedulable)
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            self.on_view.remove(&key);
            if let Some(slot) = self.retry.get_mut(&key).and_then(|r| r.deadline.take()) {
                self.deadlines.remove(&slot);
            }
            self.enqueue(key);
        }
    }

    /// When the first retry is due.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.keys().next().map(|(at, _)| *at)
    }

    /// Queues the keys whose retry is due; a running key's retry is dropped (its run ends
    /// with a new verdict). Their failures are kept until they succeed.
    pub(crate) fn queue_due(&mut self) {
        let now = now();
        while let Some(entry) = self.deadlines.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let key = entry.remove();
            self.on_view.remove(&key);
            if let Some(r) = self.retry.get_mut(&key) {
                r.deadline = None;
            }
            if !self.running.contains(&key) {
                self.enqueue(key);
            }
        }
    }

    /// Files `key`'s retry at its next attempt on the view as last seen.
    fn file(&mut self, key: K, state: RetryState) {
        let at = self.backoff.next_attempt(&state, self.view);
        if state.unschedulable && state.view == self.view {
            self.on_view.insert(key.clone());
        }
        self.seq += 1;
        let slot = (at, self.seq);
        self.deadlines.insert(slot, key.clone());
        self.retry.insert(
            key,
            Retry {
                state,
                deadline: Some(slot),
            },
        );
    }

    fn unfile(&mut self, r: &Retry) {
        if let Some(slot) = r.deadline {
            self.deadlines.remove(&slot);
        }
    }

    /// The failures in a row of `key`, for tests.
    #[cfg(test)]
    fn attempts(&self, key: &K) -> u32 {
        self.retry.get(key).map_or(0, |r| r.state.attempts)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn queue(cap: usize) -> WorkQueue<&'static str> {
        WorkQueue::new(cap, Backoff::default())
    }

    /// Starts everything that can start now.
    fn start_all(q: &mut WorkQueue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| q.start().map(|(k, _)| k)).collect()
    }

    /// Sleeps until the first retry is due (paused time: at once) and queues what is due.
    async fn until_due(q: &mut WorkQueue<&'static str>) -> Instant {
        let at = q.next_deadline().expect("a retry is filed");
        tokio::time::sleep_until(at.into()).await;
        q.queue_due();
        now()
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_queued_twice_runs_once_and_keeps_its_first_time() {
        let mut q = queue(8);
        q.enqueue("a");
        let first = now();
        tokio::time::advance(Duration::from_secs(3)).await;
        q.enqueue("b");
        q.enqueue("a");
        let started: Vec<_> = std::iter::from_fn(|| q.start()).collect();
        assert_eq!(
            started,
            vec![("a", first), ("b", first + Duration::from_secs(3))]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_key_is_not_started_again_and_runs_again_after_if_queued_meanwhile() {
        let mut q = queue(8);
        q.enqueue("a");
        assert_eq!(start_all(&mut q), vec!["a"]);
        q.enqueue("a");
        assert!(q.is_running(&"a"));
        assert_eq!(start_all(&mut q), Vec::<&str>::new(), "never twice at once");
        q.finish(&"a");
        assert_eq!(start_all(&mut q), vec!["a"], "queued meanwhile: runs again");
        q.finish(&"a");
        assert_eq!(start_all(&mut q), Vec::<&str>::new(), "not queued: done");
    }

    #[tokio::test(start_paused = true)]
    async fn no_more_than_the_cap_run_at_once() {
        let mut q = queue(2);
        for k in ["a", "b", "c", "d"] {
            q.enqueue(k);
        }
        assert_eq!(start_all(&mut q), vec!["a", "b"]);
        assert!(!q.can_start());
        q.finish(&"b");
        assert!(q.can_start());
        assert_eq!(start_all(&mut q), vec!["c"]);
        q.finish(&"a");
        q.finish(&"c");
        assert_eq!(start_all(&mut q), vec!["d"]);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_exponentially_and_a_success_resets_them() {
        let mut q = queue(8);
        let mut waits = Vec::new();
        for _ in 0..6 {
            q.enqueue("a");
            assert_eq!(start_all(&mut q), vec!["a"]);
            q.failed(&"a", 0, false);
            q.finish(&"a");
            let failed_at = now();
            // Not a moment before its deadline.
            tokio::time::sleep_until(
                (q.next_deadline().unwrap() - Duration::from_millis(1)).into(),
            )
            .await;
            q.queue_due();
            assert!(!q.can_start(), "retried early");
            waits.push(until_due(&mut q).await - failed_at);
            assert!(q.can_start());
            start_all(&mut q);
            q.finish(&"a");
        }
        let secs = |s: &[u64]| {
            s.iter()
                .map(|s| Duration::from_secs(*s))
                .collect::<Vec<_>>()
        };
        assert_eq!(waits, secs(&[1, 2, 4, 8, 10, 10]));
        assert_eq!(q.attempts(&"a"), 6);
        q.succeeded(&"a");
        assert_eq!(q.attempts(&"a"), 0);
        assert_eq!(q.next_deadline(), None);
        q.failed(&"a", 0, false);
        assert_eq!(q.next_deadline(), Some(now() + Duration::from_secs(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn retries_fire_at_the_earliest_deadline_in_order() {
        let mut q = queue(8);
        let t0 = now();
        // "late" fails twice (2 s), "soon" once (1 s), "gone" once and is forgotten.
        q.failed(&"late", 0, false);
        q.failed(&"late", 0, false);
        q.failed(&"soon", 0, false);
        q.failed(&"gone", 0, false);
        q.forget(&"gone");
        assert_eq!(until_due(&mut q).await - t0, Duration::from_secs(1));
        assert_eq!(start_all(&mut q), vec!["soon"]);
        assert_eq!(until_due(&mut q).await - t0, Duration::from_secs(2));
        assert_eq!(start_all(&mut q), vec!["late"]);
        assert_eq!(q.next_deadline(), None, "nothing else is due, ever");
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_due_while_its_key_runs_is_dropped() {
        let mut q = queue(8);
        q.failed(&"a", 0, false);
        q.enqueue("a");
        assert_eq!(start_all(&mut q), vec!["a"]);
        until_due(&mut q).await;
        q.finish(&"a");
        assert_eq!(start_all(&mut q), Vec::<&str>::new());
        assert_eq!(
            q.attempts(&"a"),
            1,
            "its failures are kept until it succeeds"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn room_freed_by_void_decisions_retries_unschedulable_keys_at_once() {
        let mut q = queue(8);
        q.view_moved(1);
        // "u" refused for room three times (4 s of backoff left), "e" failed with an error,
        // "r" refused and running again.
        for _ in 0..3 {
            q.failed(&"u", 1, true);
        }
        q.failed(&"e", 1, false);
        q.failed(&"r", 1, true);
        q.enqueue("r");
        assert_eq!(start_all(&mut q), vec!["r"]);
        q.retry_unschedulable_now();
        assert_eq!(
            start_all(&mut q),
            vec!["u"],
            "at once, not after its backoff"
        );
        q.finish(&"r");
        assert_eq!(
            start_all(&mut q),
            vec!["r"],
            "its run may have judged before"
        );
        assert_eq!(q.attempts(&"u"), 3, "its failures are kept");
        assert_eq!(
            q.next_deadline(),
            Some(now() + Duration::from_secs(1)),
            "only the error's retry is left"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_unschedulable_key_waits_for_the_view_to_move_or_five_minutes() {
        let mut q = queue(8);
        q.view_moved(7);
        let t0 = now();
        q.failed(&"a", 7, true);
        q.failed(&"b", 7, true);
        // Failed on an older view: the view moved during its run.
        q.failed(&"c", 6, true);
        assert_eq!(until_due(&mut q).await - t0, Duration::from_secs(1));
        assert_eq!(start_all(&mut q), vec!["c"]);
        assert_eq!(
            q.next_deadline(),
            Some(t0 + Duration::from_secs(300)),
            "the view did not move"
        );
        tokio::time::advance(Duration::from_secs(30)).await;
        q.view_moved(8);
        // Due since t0 + 1 s.
        assert_eq!(q.next_deadline(), Some(t0 + Duration::from_secs(1)));
        q.queue_due();
        assert_eq!(start_all(&mut q), vec!["a", "b"]);
        // Without a move, five minutes.
        q.failed(&"d", 8, true);
        let failed = now();
        assert_eq!(until_due(&mut q).await - failed, Duration::from_secs(300));
    }
}
