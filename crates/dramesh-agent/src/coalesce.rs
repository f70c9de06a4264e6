//! Merging bursts of changes into bounded batches.
//!
//! Watch streams deliver changes one at a time and often in bursts (a re-list, a driver
//! republishing its slices, a Deployment scaling). Each batch becomes one CRDT commit, so the
//! coalescer keeps only the last change per key and flushes at most `max_delay` after the
//! first change became pending, or at once when more than `max_pending` keys are pending.
//! [`Coalescer`] is the pure buffer; [`run_coalescer`] drives it from a channel.

use std::collections::BTreeMap;
use std::time::Duration;

use dramesh_model::{ObjectChange, ObjectKey};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::batch::{Batch, Scope, SourceEvent};

/// Flush policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalesceConfig {
    /// Longest time a change waits before it is flushed.
    pub max_delay: Duration,
    /// Flush as soon as more than this many keys are pending (over all scopes).
    pub max_pending: usize,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        CoalesceConfig {
            max_delay: Duration::from_millis(200),
            max_pending: 1000,
        }
    }
}

#[derive(Debug, Default)]
struct Pending {
    snapshot: bool,
    changes: BTreeMap<ObjectKey, ObjectChange>,
}

/// Pending changes, one per key per scope.
#[derive(Debug)]
pub struct Coalescer {
    cfg: CoalesceConfig,
    pending: BTreeMap<Scope, Pending>,
    len: usize,
    first_pending: Option<Instant>,
}

impl Coalescer {
    /// An empty coalescer.
    pub fn new(cfg: CoalesceConfig) -> Coalescer {
        Coalescer {
            cfg,
            pending: BTreeMap::new(),
            len: 0,
            first_pending: None,
        }
    }

    /// Adds one source event received at `now`.
    pub fn push(&mut self, ev: SourceEvent, now: Instant) {
        let (scope, changes, snapshot) = match ev {
            SourceEvent::Changes { scope, changes } => (scope, changes, false),
            SourceEvent::Snapshot { scope, changes } => (scope, changes, true),
        };
        let p = self.pending.entry(scope).or_default();
        if snapshot {
            // A snapshot is the whole scope: earlier pending changes are superseded by it.
            self.len -= p.changes.len();
            p.changes.clear();
            p.snapshot = true;
        }
        for c in changes {
            let key = c.key().clone();
            if p.snapshot && matches!(c, ObjectChange::Delete { .. }) {
                // In a snapshot an absent key already means "deleted".
                if p.changes.remove(&key).is_some() {
                    self.len -= 1;
                }
                continue;
            }
            if p.changes.insert(key, c).is_none() {
                self.len += 1;
            }
        }
        // An empty snapshot is still news (the scope is now empty); empty changes are not.
        if self.first_pending.is_none() && (self.len > 0 || p.snapshot) {
            self.first_pending = Some(now);
        }
        if !p.snapshot && p.changes.is_empty() {
            self.pending
                .retain(|_, p| p.snapshot || !p.changes.is_empty());
        }
    }

    /// Number of pending keys over all scopes.
    /// Pending changes (keys) over all scopes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// When the pending changes must be flushed, if any are pending.
    pub fn deadline(&self) -> Option<Instant> {
        if self.len > self.cfg.max_pending {
            return self.first_pending.map(|_| Instant::now());
        }
        self.first_pending.map(|t| t + self.cfg.max_delay)
    }

    /// Whether a flush is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.len > self.cfg.max_pending || self.deadline().is_some_and(|d| d <= now)
    }

    /// Takes every pending change, one batch per scope, in scope order.
    pub fn take(&mut self) -> Vec<Batch> {
        self.len = 0;
        self.first_pending = None;
        std::mem::take(&mut self.pending)
            .into_iter()
            .map(|(scope, p)| Batch {
                scope,
                snapshot: p.snapshot,
                changes: p.changes.into_values().collect(),
            })
            .collect()
    }
}

/// Drives a [`Coalescer`]: reads source events from `rx`, writes batches to `tx`. Returns when
/// every sender of `rx` is gone (after flushing what is pending) or when `tx`'s receiver is
/// dropped.
pub async fn run_coalescer(
    cfg: CoalesceConfig,
    mut rx: mpsc::Receiver<SourceEvent>,
    tx: mpsc::Sender<Batch>,
) {
    let mut c = Coalescer::new(cfg);
    loop {
        let deadline = c.deadline();
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => {
                    c.push(ev, Instant::now());
                    // Drain what is already queued so one burst becomes one batch.
                    while let Ok(ev) = rx.try_recv() {
                        c.push(ev, Instant::now());
                    }
                    if c.len() > cfg.max_pending && !flush(&mut c, &tx).await {
                        return;
                    }
                }
                None => {
                    flush(&mut c, &tx).await;
                    return;
                }
            },
            () = sleep => {
                if !flush(&mut c, &tx).await {
                    return;
                }
            }
            () = tx.closed() => return,
        }
    }
}

async fn flush(c: &mut Coalescer, tx: &mpsc::Sender<Batch>) -> bool {
    for b in c.take() {
        if tx.send(b).await.is_err() {
            return false;
        }
    }
    true
}

/// Starts a coalescer task: sources send into the returned sender, batches come out of the
/// returned receiver.
pub fn spawn_coalescer(cfg: CoalesceConfig) -> (mpsc::Sender<SourceEvent>, mpsc::Receiver<Batch>) {
    let (in_tx, in_rx) = mpsc::channel(1024);
    let (out_tx, out_rx) = mpsc::channel(64);
    tokio::spawn(run_coalescer(cfg, in_rx, out_tx));
    (in_tx, out_rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::ObjectKind;

    fn key(n: &str) -> ObjectKey {
        ObjectKey::new(ObjectKind::Node, None, n)
    }
    fn up(n: &str, v: &str) -> ObjectChange {
        ObjectChange::Upsert {
            key: key(n),
            json: v.as_bytes().into(),
        }
    }
    fn del(n: &str) -> ObjectChange {
        ObjectChange::Delete { key: key(n) }
    }
    fn node() -> Scope {
        Scope::Node("n1".into())
    }
    fn json_of(c: &ObjectChange) -> Option<&[u8]> {
        match c {
            ObjectChange::Upsert { json, .. } => Some(json),
            ObjectChange::Delete { .. } => None,
        }
    }

    #[test]
    fn last_change_per_key_wins() {
        let mut c = Coalescer::new(CoalesceConfig::default());
        let t = Instant::now();
        c.push(
            SourceEvent::Changes {
                scope: node(),
                changes: vec![up("a", "1"), up("b", "1"), up("a", "2")],
            },
            t,
        );
        c.push(
            SourceEvent::Changes {
                scope: node(),
                changes: vec![del("b")],
            },
            t,
        );
        assert_eq!(c.len(), 2);
        let out = c.take();
        assert_eq!(out.len(), 1);
        assert!(!out[0].snapshot);
        assert_eq!(json_of(&out[0].changes[0]), Some(&b"2"[..]));
        assert!(matches!(&out[0].changes[1], ObjectChange::Delete { key: k } if k.name == "b"));
        assert!(c.is_empty());
        assert_eq!(c.deadline(), None);
    }

    #[test]
    fn deadline_is_bounded_from_first_change() {
        let cfg = CoalesceConfig {
            max_delay: Duration::from_millis(200),
            max_pending: 10,
        };
        let mut c = Coalescer::new(cfg);
        let t = Instant::now();
        c.push(
            SourceEvent::Changes {
                scope: node(),
                changes: vec![up("a", "1")],
            },
            t,
        );
        c.push(
            SourceEvent::Changes {
                scope: node(),
                changes: vec![up("b", "1")],
            },
            t + Duration::from_millis(150),
        );
        assert_eq!(c.deadline(), Some(t + Duration::from_millis(200)));
        assert!(!c.due(t + Duration::from_millis(199)));
        assert!(c.due(t + Duration::from_millis(200)));
    }

    #[test]
    fn over_max_pending_is_due_now() {
        let mut c = Coalescer::new(CoalesceConfig {
            max_delay: Duration::from_secs(60),
            max_pending: 2,
        });
        let t = Instant::now();
        let changes = (0..3).map(|i| up(&i.to_string(), "x")).collect();
        c.push(
            SourceEvent::Changes {
                scope: node(),
                changes,
            },
            t,
        );
        assert!(c.due(t));
    }

    #[test]
    fn snapshot_supersedes_and_absorbs_deletes() {
        let mut c = Coalescer::new(CoalesceConfig::default());
        let t = Instant::now();
        c.push(
            SourceEvent::Changes {
                scope: node(),
                changes: vec![up("old", "1"), del("gone")],
            },
            t,
        );
        c.push(
            SourceEvent::Snapshot {
                scope: node(),
                changes: vec![up("a", "1"), up("b", "1")],
            },
            t,
        );
        c.push(
            SourceEvent::Changes {
                scope: node(),
                changes: vec![del("b"), up("c", "1")],
            },
            t,
        );
        let out = c.take();
        assert_eq!(out.len(), 1);
        assert!(out[0].snapshot);
        let names: Vec<_> = out[0]
            .changes
            .iter()
            .map(|c| c.key().name.as_str())
            .collect();
        assert_eq!(names, ["a", "c"]);
        assert!(out[0].changes.iter().all(|c| json_of(c).is_some()));
    }

    #[test]
    fn empty_snapshot_is_flushed_and_scopes_are_separate() {
        let mut c = Coalescer::new(CoalesceConfig::default());
        let t = Instant::now();
        c.push(
            SourceEvent::Snapshot {
                scope: Scope::Cluster { term: 3 },
                changes: vec![],
            },
            t,
        );
        assert!(c.deadline().is_some());
        c.push(
            SourceEvent::Changes {
                scope: node(),
                changes: vec![up("a", "1")],
            },
            t,
        );
        let out = c.take();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].scope, node());
        assert_eq!(out[1].scope, Scope::Cluster { term: 3 });
        assert!(out[1].snapshot && out[1].changes.is_empty());
    }

    #[tokio::test]
    async fn task_merges_a_burst_into_one_batch() {
        let (tx, mut rx) = spawn_coalescer(CoalesceConfig {
            max_delay: Duration::from_millis(50),
            max_pending: 1000,
        });
        for i in 0..100 {
            tx.send(SourceEvent::Changes {
                scope: node(),
                changes: vec![up("a", &i.to_string())],
            })
            .await
            .unwrap();
        }
        let b = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(b.changes.len(), 1);
        assert_eq!(json_of(&b.changes[0]), Some(&b"99"[..]));
        drop(tx);
        assert!(
            tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .unwrap()
                .is_none()
        );
    }
}
