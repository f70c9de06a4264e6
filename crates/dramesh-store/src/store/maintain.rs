//! Upkeep: compaction of document files, deferred to [`Store::maintain_deferred`] when asked.

use super::*;

/// Compaction of replica copies: which wait for the budget (see [`Store::maintain_deferred`]),
/// until when they rest, and how many were done (writers' and replicas').
pub(super) struct Compaction {
    pub(super) due: BTreeSet<DocId>,
    pub(super) rest_until: Instant,
    pub(super) done: u64,
}

impl Store {
    /// Applies [`RolloverPolicy`] to `doc` after it grew: compacts its file, or (writer only)
    /// rolls it over. Returns whether a rollover happened.
    pub(super) fn maintain(&mut self, doc: &DocId) -> Result<bool, StoreError> {
        let p = self.config.rollover.clone();
        let Some(e) = self.docs.get(doc) else {
            return Ok(false);
        };
        if e.owned {
            let num_ops = e.num_ops;
            debug_assert_eq!(num_ops, history(&e.doc).1, "running op count drifted");
            let ops = num_ops as f64;
            let (counted, at_ops) = e.keys_counted;
            let min_keys = counted.saturating_sub(num_ops.saturating_sub(at_ops));
            let mut too_many_ops = false;
            if ops > 1024.0 && ops > p.max_ops_ratio * min_keys.max(1) as f64 {
                let keys = e.doc.length(ROOT) as u64;
                too_many_ops = ops > p.max_ops_ratio * keys.max(1) as f64;
                if let Some(e) = self.docs.get_mut(doc) {
                    e.keys_counted = (keys, num_ops);
                }
            }
            let commits = self.docs.get(doc).map_or(0, |e| e.commits_since_base);
            if too_many_ops || commits >= p.max_changes {
                self.rollover_to(doc, 0)?;
                return Ok(true);
            }
        }
        let Some(e) = self.docs.get(doc) else {
            return Ok(false);
        };
        // A writer measures against what a compaction would keep: its current values
        // (compaction results above `max_compacted_ratio` of the fresh size roll over instead).
        // Its file then holds at most as much history again as values, and a document that
        // only grows (reservations that are never released) is never compacted for nothing:
        // measured against its fresh size, it was compacted after every few percent of growth,
        // each time rewriting all of it. A replica cannot roll over, so it measures against its
        // last snapshot too, which keeps it from compacting on every message.
        let reference = if e.owned {
            e.fresh_bytes.max(e.live_bytes)
        } else {
            e.fresh_bytes.max(e.base_bytes)
        } as f64;
        let limit = ((p.max_stored_ratio * reference) as u64).max(p.min_stored_bytes);
        if e.stored_bytes <= limit {
            return Ok(false);
        }
        if !e.owned {
            let hard = (((p.max_stored_ratio + 1.0) * reference) as u64).max(p.min_stored_bytes);
            if e.stored_bytes <= hard && Instant::now() < self.compaction.rest_until {
                self.compaction.due.insert(doc.clone());
                return Ok(false);
            }
        }
        self.compact(doc)
    }

    /// Rewrites `doc`'s file as one snapshot (a writer whose snapshot is still too large rolls
    /// over instead); returns whether a rollover happened. Replica copies then rest the
    /// compaction budget (see [`Store::maintain_deferred`]).
    pub(super) fn compact(&mut self, doc: &DocId) -> Result<bool, StoreError> {
        self.settle(doc)?;
        let started = Instant::now();
        self.compaction.due.remove(doc);
        let max_compacted_ratio = self.config.rollover.max_compacted_ratio;
        let Some(e) = self.docs.get(doc) else {
            return Ok(false);
        };
        let snapshot = persist::pack_snapshot(&e.doc);
        if e.owned && framed_len(snapshot.len()) as f64 > max_compacted_ratio * e.fresh_bytes as f64
        {
            self.rollover_to(doc, 0)?;
            return Ok(true);
        }
        let (generation, owned, fresh) = (e.generation, e.owned, e.fresh_bytes);
        let signed = if owned { None } else { e.signed.as_ref() };
        let (stored, base) = self.write_snapshot(&snapshot_file(
            doc,
            generation,
            owned,
            snapshot,
            Some(fresh),
            signed,
        ))?;
        if let Some(e) = self.docs.get_mut(doc) {
            e.stored_bytes = stored;
            e.base_bytes = base;
            e.signed_unsaved = false;
        }
        self.compaction.done += 1;
        if !owned {
            let spent = started.elapsed();
            let duty = self.config.rollover.compaction_duty.clamp(1e-6, 1.0);
            self.compaction.rest_until = Instant::now() + spent.mul_f64((1.0 - duty) / duty);
        }
        Ok(false)
    }

    /// Compacts one replica copy whose compaction was deferred, if the compaction budget has
    /// rested; returns the document compacted.
    ///
    /// A compaction rewrites the whole document (tens of milliseconds for a cluster of a
    /// thousand nodes) while a change costs tens of microseconds, and replica copies of a
    /// fleet grow together: after a partition heals or a fleet loads, every copy crosses its
    /// threshold in the same second. So a replica copy over `max_stored_ratio` is compacted at
    /// once only while compactions have used at most [`RolloverPolicy::compaction_duty`] of the time since the
    /// last one, and is otherwise queued here; callers run this when they are idle between
    /// batches (the mesh node does after sending each batch's frames). A copy that reaches
    /// `max_stored_ratio + 1` is compacted at once regardless.
    pub fn maintain_deferred(&mut self) -> Result<Option<DocId>, StoreError> {
        if Instant::now() < self.compaction.rest_until {
            return Ok(None);
        }
        let Some(doc) = self.compaction.due.pop_first() else {
            return Ok(None);
        };
        // Removed since, or taken over by this store's writer (which compacts inline).
        if self.docs.get(&doc).is_none_or(|e| e.owned) {
            return Ok(None);
        }
        self.compact(&doc)?;
        Ok(Some(doc))
    }

    /// Whether replica copies wait for [`Store::maintain_deferred`].
    pub fn has_deferred_compactions(&self) -> bool {
        !self.compaction.due.is_empty()
    }

    /// Compactions done since the store was opened, and replica copies waiting for one.
    pub fn compaction_counts(&self) -> (u64, usize) {
        (self.compaction.done, self.compaction.due.len())
    }
}
