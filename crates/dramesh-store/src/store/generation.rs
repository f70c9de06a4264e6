//! Generations: rollover to a new generation (bounded history), recovery of a generation
//! refused as lying in the future, and rejoin.

use super::*;

impl Store {
    /// Recovers the writer's own document from a clock fault: when its generation lies more
    /// than [`MAX_FUTURE_GENERATION_MS`] ahead of this store's clock (it was made while the
    /// clock ran ahead, and replicas refuse it), rolls over to a generation taken from the
    /// clock as it is now, keeping every current value (the base of a rollover). Returns the
    /// new generation, or `None` when the generation is plausible or the document is not
    /// written here. Replicas holding an older generation take the new one as usual.
    pub fn recover_generation(&mut self, doc: &DocId) -> Result<Option<u64>, StoreError> {
        let Some(e) = self.docs.get(doc).filter(|e| e.owned) else {
            return Ok(None);
        };
        if self.plausible_generation(e.generation) {
            return Ok(None);
        }
        let old = e.generation;
        let generation = self.rollover_to(doc, 0)?;
        tracing::warn!(doc = %doc, old, generation, "own generation lay more than 30 days ahead of the clock (a clock fault); started a new generation from the clock");
        Ok(Some(generation))
    }

    /// Rebuilds the writer's document from its current values into a new generation, replacing
    /// the file atomically; returns the new generation.
    pub fn rollover(&mut self, doc: &DocId) -> Result<u64, StoreError> {
        self.rollover_to(doc, 0)
    }

    /// Asks to rejoin the fleet after a retirement of the writer's cluster: rolls the writer's
    /// document over to a new generation whose base records that generation as the rejoin
    /// ([`REJOIN_KEY`]); returns it. Replicas holding a tombstone of the cluster accept the
    /// document only when its rejoin is later than the retirement, and every later rollover
    /// carries the same rejoin, so only this call (never an automatic rollover) brings a
    /// retired cluster back.
    pub fn rejoin(&mut self, doc: &DocId) -> Result<u64, StoreError> {
        self.rejoin_next = true;
        let rolled = self.rollover_to(doc, 0);
        self.rejoin_next = false;
        rolled
    }

    pub(super) fn rollover_to(
        &mut self,
        doc: &DocId,
        min_generation: u64,
    ) -> Result<u64, StoreError> {
        self.settle(doc)?;
        let Some(e) = self.docs.get(doc).filter(|e| e.owned) else {
            return Err(StoreError::NotWriter { doc: doc.clone() });
        };
        // A generation this clock finds implausible was made by a clock running far ahead
        // (replicas refuse it); the next one starts from the clock again, below it.
        let next = if self.plausible_generation(e.generation) {
            e.generation.saturating_add(1)
        } else {
            0
        };
        let generation = next.max(min_generation).max(self.now_millis()).max(1);
        let fresh = build_fresh(doc, &e.doc, generation, self.rejoin_next)?;
        let (stored, base) = self.write_fresh(doc, generation, &fresh)?;
        let heads = fresh.get_heads();
        let num_ops = history(&fresh).1;
        let live = live_value_bytes(&fresh);
        if let Some(e) = self.docs.get_mut(doc) {
            e.generation = generation;
            e.num_ops = num_ops;
            e.live_bytes = live;
            e.doc = fresh;
            e.saved_heads = heads;
            e.stored_bytes = stored;
            e.base_bytes = base;
            e.fresh_bytes = base;
            e.commits_since_base = 0;
            e.not_durable = false;
            e.keys_counted = (0, 0);
        }
        self.pending.remove(doc);
        self.set_digest(doc);
        tracing::info!(doc = %doc, generation, stored, "rolled over to a new generation");
        Ok(generation)
    }
}
