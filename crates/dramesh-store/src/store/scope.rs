//! Cluster scopes: which documents a store holds for whom, retired clusters, dropped copies.

use super::*;

/// Retired member clusters.
#[derive(Default)]
pub(super) struct Retirement {
    /// Documents whose rejoin ([`REJOIN_KEY`]) is not later than this time (ms) are refused,
    /// and so are generations begun at or before it.
    pub(super) retired: BTreeMap<String, u64>,
    /// Per document of a retired cluster: the latest generation received whole and refused
    /// because it does not rejoin; it and earlier ones are refused at once from then on.
    pub(super) refused_generations: BTreeMap<DocId, u64>,
}

impl Store {
    /// Retires member cluster `cluster` as of `at_ms` (wall clock, ms since the epoch): every
    /// replica copy of its documents that does not rejoin later ([`REJOIN_KEY`] at most
    /// `at_ms`, as every document written before the retirement, and every later generation
    /// its writer rolled over to by itself) is dropped from memory, the digest and disk (the
    /// directory is fsynced). From now on messages for generations begun at or before then
    /// are refused with [`StoreError::RetiredCluster`], and so is any later generation once
    /// received whole without such a rejoin. A writer comes back only by asking to
    /// ([`Store::rejoin`], `dramesh agent --rejoin`). Returns the visible changes (deletes).
    /// Idempotent; a later retirement of the same cluster moves the bound forward, an earlier
    /// one changes nothing. The store's own documents are never dropped.
    pub fn retire_cluster(
        &mut self,
        cluster: &str,
        at_ms: u64,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        let bound = self
            .retirement
            .retired
            .entry(cluster.to_string())
            .or_insert(0);
        *bound = (*bound).max(at_ms);
        let bound = *bound;
        self.pending
            .retain(|d, p| d.cluster != cluster || p.generation > bound);
        let doomed: Vec<DocId> = self
            .docs
            .range(DocId::new(cluster, "")..)
            .take_while(|(d, _)| d.cluster == cluster)
            .filter(|(_, e)| !e.owned && read_rejoin(&e.doc) <= bound)
            .map(|(d, _)| d.clone())
            .collect();
        let mut out = std::mem::take(&mut self.undelivered);
        for doc in doomed {
            if let Some(generation) = self.drop_copy(&doc, &mut out)? {
                tracing::info!(doc = %doc, generation, "dropped the document of a retired cluster");
            }
        }
        Ok(out)
    }

    /// Drops the replica copy `doc` from memory, the digests and disk (the directory is
    /// fsynced), appending its visible changes to `out`; returns the generation dropped.
    pub(super) fn drop_copy(
        &mut self,
        doc: &DocId,
        out: &mut Vec<(String, ObjectChange)>,
    ) -> Result<Option<u64>, StoreError> {
        if self.docs.get(doc).is_none_or(|e| e.owned) {
            return Ok(None);
        }
        self.settle(doc)?;
        if let Some(dir) = &self.dir {
            persist::remove(dir, doc, self.config.durability)?;
        }
        let Some(old) = self.docs.remove(doc) else {
            return Ok(None);
        };
        self.xor_digest(doc, old.bucket, old.digest_part);
        self.commit.unsynced.remove(doc);
        self.compaction.due.remove(doc);
        let keys = object_keys(&old.doc, None);
        out.extend(self.reconcile(doc, keys, Old::Doc(Box::new(old.doc))));
        Ok(Some(old.generation))
    }

    /// Drops every document this store does not write (replica copies, and those being
    /// received) from memory, the digests and disk: an agent that stops being its cluster's
    /// relay keeps only its own document. Returns the visible changes and how many copies
    /// were dropped.
    pub fn drop_copies(&mut self) -> Result<(Vec<(String, ObjectChange)>, usize), StoreError> {
        self.pending.clear();
        let copies: Vec<DocId> = self
            .docs
            .iter()
            .filter(|(_, e)| !e.owned)
            .map(|(d, _)| d.clone())
            .collect();
        let mut out = std::mem::take(&mut self.undelivered);
        let mut dropped = 0;
        for doc in copies {
            if self.drop_copy(&doc, &mut out)?.is_some() {
                dropped += 1;
            }
        }
        Ok((out, dropped))
    }

    /// How many documents of member cluster `cluster` are held (a range of the document map).
    pub fn cluster_docs(&self, cluster: &str) -> usize {
        self.docs
            .range(DocId::new(cluster, "")..)
            .take_while(|(d, _)| d.cluster == cluster)
            .count()
    }

    /// Whether any document of member cluster `cluster` is held (a range lookup, not a scan).
    pub fn holds_cluster(&self, cluster: &str) -> bool {
        self.docs
            .range(DocId::new(cluster, "")..)
            .next()
            .is_some_and(|(d, _)| d.cluster == cluster)
    }

    /// Retired clusters and the time each was retired at ([`Store::retire_cluster`]).
    pub fn retired_clusters(&self) -> &BTreeMap<String, u64> {
        &self.retirement.retired
    }

    /// The value of each of `keys` of `doc` that counts as present in the view (`None` for the
    /// others, in the order of `keys`): held, and for a replica copy within its writer's scope
    /// ([`in_writer_scope`]). Records outside it are counted ([`Store::out_of_scope_records`])
    /// and logged; the view keeps the previous holder's value.
    pub(super) fn presence(&mut self, doc: &DocId, keys: &[String]) -> Vec<Option<Arc<[u8]>>> {
        let max = self.view.max_term(&doc.cluster);
        let Some(e) = self.docs.get(doc) else {
            return vec![None; keys.len()];
        };
        let mut refused: Vec<&str> = Vec::new();
        let out = keys
            .iter()
            .map(|k| {
                let v = read_value(&e.doc, k, None)?;
                if e.owned || in_writer_scope(doc, e.term, max, k, &v) {
                    Some(v)
                } else {
                    refused.push(k);
                    None
                }
            })
            .collect();
        if let Some(first) = refused.first() {
            tracing::warn!(doc = %doc, records = refused.len(), first = %first, term = e.term, lease_term = max, "records outside their writer's scope refused: a node's writer publishes only that node's records, cluster records only the Lease holder");
        }
        self.out_of_scope += refused.len() as u64;
        out
    }

    /// Records refused so far for lying outside their writer's scope (a node agent publishing
    /// another node's records, or cluster records without holding the Lease). Each evaluation
    /// of such a record counts once.
    pub fn out_of_scope_records(&self) -> u64 {
        self.out_of_scope
    }
}
