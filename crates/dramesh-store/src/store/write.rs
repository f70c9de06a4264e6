//! Writes: opening the local writer's document, applying its changes within its scope, and
//! persisting them (incremental appends, snapshots, group commit).

use super::*;

/// Group commit: received changes are appended without fsync and made durable together by
/// [`Store::sync_pending`] (see [`Store::set_group_commit`]).
#[derive(Default)]
pub(super) struct GroupCommit {
    /// Whether group commit is on.
    pub(super) on: bool,
    /// Documents with appended records not fsynced yet.
    pub(super) unsynced: BTreeSet<DocId>,
    /// Whether a new file was created since the last [`Store::sync_pending`] without fsyncing
    /// it or the directory (a first replica copy).
    pub(super) new_files: bool,
    /// Writes those new files, and appends received changes, on a thread of its own (started
    /// with the first).
    pub(super) writer: Option<persist::Writer>,
    /// Documents whose file missed an append the writer thread failed: rewritten whole by the
    /// next [`Store::sync_pending`] (until one succeeds).
    pub(super) rewrite: BTreeSet<DocId>,
}

/// The fsync half of a group commit, handed out by [`Store::begin_sync`]: plain I/O on the
/// files it names, run on any thread, its result booked by [`Store::complete_sync`].
#[derive(Debug)]
#[must_use = "the covered changes are not durable until it ran and was completed"]
pub struct PendingSync {
    dir: Option<PathBuf>,
    new_files: bool,
    docs: BTreeSet<DocId>,
}

impl PendingSync {
    /// Makes the covered files durable (one `syncfs` for many, see `persist::sync_many`).
    pub fn run(&self) -> Result<(), StoreError> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        let files: Vec<PathBuf> = self
            .docs
            .iter()
            .map(|d| persist::doc_path(dir, d))
            .collect();
        persist::sync_many(dir, &files, self.new_files)
    }

    /// How many documents' files it covers.
    pub fn files(&self) -> usize {
        self.docs.len()
    }
}

impl Store {
    /// Writes a snapshot as the document's new file (new generation or compaction); returns
    /// (file bytes, snapshot record bytes).
    pub(super) fn write_snapshot(&self, f: &persist::NewFile) -> Result<(u64, u64), StoreError> {
        let base = framed_len(f.snapshot.len());
        let total = match &self.dir {
            Some(dir) => persist::write_new(dir, f, self.config.durability)?,
            None => f.len(),
        };
        Ok((total, base))
    }

    /// Writes `fresh`, the first snapshot of generation `generation` of this store's own
    /// document `doc`, as its new file; returns (file bytes, snapshot record bytes).
    pub(super) fn write_fresh(
        &self,
        doc: &DocId,
        generation: u64,
        fresh: &Automerge,
    ) -> Result<(u64, u64), StoreError> {
        self.write_snapshot(&snapshot_file(
            doc,
            generation,
            true,
            persist::pack_snapshot(fresh),
            None,
            None,
        ))
    }

    /// Appends the changes made since the last durable point of `doc`. With `defer` (group
    /// commit of received changes) the record is written but not fsynced; the document is
    /// remembered for [`Store::sync_pending`].
    pub(super) fn persist_incremental(
        &mut self,
        doc: &DocId,
        defer: bool,
    ) -> Result<(), StoreError> {
        let path = self.path_of(doc);
        let defer = defer && self.config.durability == Durability::Fsync && path.is_some();
        // A deferred append runs on the writer thread after every job queued before it on the
        // file; an inline one waits for them.
        if !defer {
            self.settle(doc)?;
        }
        let Some(e) = self.docs.get_mut(doc) else {
            return Ok(());
        };
        let heads = e.doc.get_heads();
        if heads == e.saved_heads {
            e.not_durable = false;
            return Ok(());
        }
        // Each change as its own chunk, uncompressed: compressing every ~600-byte object update
        // costs more CPU than the disk it saves (compaction snapshots are compressed).
        let mut bytes = Vec::new();
        for c in e.doc.get_changes(&e.saved_heads) {
            bytes.extend_from_slice(c.raw_bytes());
        }
        let signed = (e.signed_unsaved && !e.owned)
            .then(|| e.signed.as_ref().map(Attestation::encode))
            .flatten();
        let appended = match path {
            Some(p) if defer => self.background_append(doc, p, &bytes, signed.as_deref()),
            Some(p) => {
                persist::append_changes(&p, &bytes, signed.as_deref(), self.config.durability)
            }
            None => {
                Ok(framed_len(bytes.len()) + signed.as_ref().map_or(0, |s| framed_len(s.len())))
            }
        };
        let Some(e) = self.docs.get_mut(doc) else {
            return Ok(());
        };
        let appended = match appended {
            Ok(n) => n,
            Err(err) => {
                e.not_durable = true;
                return Err(err);
            }
        };
        e.signed_unsaved = false;
        e.stored_bytes += appended;
        e.saved_heads = heads;
        e.not_durable = false;
        if defer {
            self.commit.unsynced.insert(doc.clone());
        }
        Ok(())
    }

    /// Queues an append of received changes on the background writer (starting it with the
    /// first); appended here when no thread can be started. Returns the bytes appended.
    fn background_append(
        &mut self,
        doc: &DocId,
        path: PathBuf,
        changes: &[u8],
        signed: Option<&[u8]>,
    ) -> Result<u64, StoreError> {
        let records =
            persist::change_records(changes, signed).map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
        let len = records.len() as u64;
        match self.writer() {
            Some(w) => w.append(persist::Append {
                doc: doc.clone(),
                path,
                records,
            })?,
            None => {
                persist::append_records(&path, &records, Durability::None)?;
            }
        }
        Ok(len)
    }

    /// Turns group commit of received changes on or off.
    ///
    /// When on, [`Store::receive_sync_message`] appends the changes it applies without fsyncing
    /// them, and they become durable at the next [`Store::sync_pending`], which fsyncs every
    /// touched file once. The caller must not acknowledge or forward anything derived from
    /// those messages (replies, relays, digests, heads) before `sync_pending` returned `Ok`:
    /// the mesh node holds all outputs of a batch of frames until then. Local writes
    /// ([`Store::apply`]) and new files (generations, compactions) stay synchronous. Turning it
    /// off first syncs what is pending.
    pub fn set_group_commit(&mut self, on: bool) -> Result<(), StoreError> {
        if !on {
            self.sync_pending()?;
        }
        self.commit.on = on;
        Ok(())
    }

    /// Whether received changes are group-committed (see [`Store::set_group_commit`]).
    pub fn group_commit(&self) -> bool {
        self.commit.on
    }

    /// Whether appended records are waiting for [`Store::sync_pending`].
    pub fn has_unsynced(&self) -> bool {
        !self.commit.unsynced.is_empty()
    }

    /// Makes every document file appended to since the last call durable (group commit, one
    /// `syncfs` for many files on Linux, see `persist::sync_many`); returns how many files were
    /// pending. On error they all stay pending, so a later call retries them; nothing derived
    /// from them may be acknowledged until then. [`Store::begin_sync`], [`PendingSync::run`] and
    /// [`Store::complete_sync`] in one call.
    pub fn sync_pending(&mut self) -> Result<usize, StoreError> {
        match self.begin_sync()? {
            None => Ok(0),
            Some(p) => {
                let r = p.run();
                self.complete_sync(p, r)
            }
        }
    }

    /// The first half of [`Store::sync_pending`], on the caller's thread: waits for the
    /// appends queued on the store's writer, rewrites files that missed one, and hands out
    /// the fsync of every file appended to so far as a [`PendingSync`] to run on another
    /// thread, so the caller can go on with new changes meanwhile (they are not covered: their
    /// files stay pending for the next sync). `None` when nothing is pending. Nothing derived
    /// from the covered changes may be acknowledged before [`Store::complete_sync`] returned
    /// `Ok` for it.
    pub fn begin_sync(&mut self) -> Result<Option<PendingSync>, StoreError> {
        if self.commit.unsynced.is_empty() {
            return Ok(None);
        }
        if let Some(w) = &mut self.commit.writer {
            let finished = w.finish();
            self.commit.rewrite.extend(w.take_failed_appends());
            finished?;
        }
        // A file that missed an append is rewritten whole from the document (fsynced and
        // renamed into place, like a compaction); until that succeeded nothing is durable.
        for doc in std::mem::take(&mut self.commit.rewrite) {
            if let Err(e) = self.compact(&doc) {
                self.commit.rewrite.insert(doc);
                return Err(e);
            }
        }
        Ok(Some(PendingSync {
            dir: self.dir.clone(),
            new_files: std::mem::take(&mut self.commit.new_files),
            docs: std::mem::take(&mut self.commit.unsynced),
        }))
    }

    /// The second half of [`Store::sync_pending`]: books the outcome of `sync`'s
    /// [`PendingSync::run`]; returns how many files it made durable. On error its files are
    /// pending again (the next sync retries them) and the error is returned.
    pub fn complete_sync(
        &mut self,
        sync: PendingSync,
        result: Result<(), StoreError>,
    ) -> Result<usize, StoreError> {
        match result {
            Ok(()) => Ok(sync.docs.len()),
            Err(e) => {
                // Documents dropped since (`scope`) are not pending any more.
                let held = |d: &DocId| self.docs.contains_key(d) || self.pending.contains_key(d);
                let back: Vec<DocId> = sync.docs.into_iter().filter(|d| held(d)).collect();
                self.commit.unsynced.extend(back);
                self.commit.new_files |= sync.new_files;
                Err(e)
            }
        }
    }

    /// Creates the document this store writes, or resumes it from disk; returns its generation.
    ///
    /// A fresh document starts at a generation taken from the wall clock (milliseconds), so a
    /// writer that lost its disk still supersedes what replicas hold. A document held here only
    /// as a replica copy is taken over by rolling it into a new generation.
    pub fn open_writer(&mut self, doc: &DocId) -> Result<u64, StoreError> {
        check_doc_id(doc)?;
        self.settle(doc)?;
        if let Some(e) = self.docs.get(doc) {
            if e.owned {
                let generation = e.generation;
                return Ok(self.recover_generation(doc)?.unwrap_or(generation));
            }
            let min = e.generation.saturating_add(1);
            if let Some(e) = self.docs.get_mut(doc) {
                e.owned = true;
            }
            let rolled = self.rollover_to(doc, min);
            if rolled.is_err()
                && let Some(e) = self.docs.get_mut(doc)
            {
                // Still a replica copy: its actor is not ours, so it must not be written.
                e.owned = false;
            }
            return rolled;
        }
        let min_gen = self
            .pending
            .get(doc)
            .map_or(0, |p| p.generation.saturating_add(1));
        let generation = self.now_millis().max(min_gen).max(1);
        let fresh = build_fresh(doc, &Automerge::new(), generation, false)?;
        let (stored, base) = self.write_fresh(doc, generation, &fresh)?;
        self.pending.remove(doc);
        let heads = fresh.get_heads();
        let entry = Held {
            generation,
            term: 0,
            owned: true,
            saved_heads: heads,
            heads_hash: [0; 32],
            bucket: doc.bucket(),
            digest_part: 0,
            stored_bytes: stored,
            base_bytes: base,
            fresh_bytes: base,
            commits_since_base: 0,
            num_ops: history(&fresh).1,
            live_bytes: live_value_bytes(&fresh),
            not_durable: false,
            keys_counted: (0, 0),
            signed: None,
            signed_ahead: None,
            signed_unsaved: false,
            doc: fresh,
        };
        self.docs.insert(doc.clone(), entry);
        self.set_digest(doc);
        self.view.set_term(&doc.cluster, &doc.writer, 0);
        Ok(generation)
    }

    /// Applies a burst of object changes to the writer's document in one automerge commit and
    /// returns once it is durable. Upserts equal to the stored value and deletes of absent keys
    /// are skipped (they would only grow history); within the burst the last change of a key wins.
    pub fn apply(
        &mut self,
        doc: &DocId,
        changes: Vec<ObjectChange>,
    ) -> Result<WriteOutcome, StoreError> {
        let mut ops: BTreeMap<String, Option<Arc<[u8]>>> = BTreeMap::new();
        for c in changes {
            match c {
                ObjectChange::Upsert { key, json } => ops.insert(doc_key(&key)?, Some(json)),
                ObjectChange::Delete { key } => ops.insert(doc_key(&key)?, None),
            };
        }
        self.write_ops(doc, ops, None)
    }

    /// Records the lease term under which this writer publishes cluster-scoped objects; among
    /// documents of one cluster holding the same key, the highest term (then writer name) wins.
    pub fn set_lease_term(&mut self, doc: &DocId, term: u64) -> Result<WriteOutcome, StoreError> {
        self.write_ops(doc, BTreeMap::new(), Some(term))
    }

    pub(super) fn write_ops(
        &mut self,
        doc: &DocId,
        ops: BTreeMap<String, Option<Arc<[u8]>>>,
        term: Option<u64>,
    ) -> Result<WriteOutcome, StoreError> {
        let am = |source: automerge::AutomergeError| StoreError::Automerge {
            doc: doc.clone(),
            source: Box::new(source),
        };
        let Some(e) = self.docs.get_mut(doc).filter(|e| e.owned) else {
            return Err(StoreError::NotWriter { doc: doc.clone() });
        };
        let before = e.doc.get_heads();
        let mut changed = Vec::new();
        let mut live = e.live_bytes;
        let mut tx = e.doc.transaction();
        for (k, v) in &ops {
            let current = tx.get(ROOT, k.as_str()).map_err(am)?;
            let current = current.as_ref().map(|(v, _)| value_slice(v));
            // Encoding is deterministic, so equal stored bytes mean an equal value.
            let stored = v.as_ref().map(|json| crate::value::encode(json));
            // (present, its stored length, equal to the new value)
            let (present, old_len, same) = match (&current, &stored) {
                (None, _) => (false, 0, false),
                (Some(c), stored) => (
                    true,
                    c.map_or(0, |c| c.len() as u64),
                    stored.as_ref().is_some_and(|s| *c == Some(&s[..])),
                ),
            };
            match stored {
                Some(stored) => {
                    if !same {
                        let new_len = stored.len() as u64;
                        tx.put(ROOT, k.as_str(), ScalarValue::Bytes(stored))
                            .map_err(am)?;
                        changed.push(k.clone());
                        live = live.saturating_sub(old_len).saturating_add(new_len);
                    }
                }
                None => {
                    if present {
                        tx.delete(ROOT, k.as_str()).map_err(am)?;
                        changed.push(k.clone());
                        live = live.saturating_sub(old_len);
                    }
                }
            }
        }
        let mut term_changed = false;
        if let Some(t) = term
            && read_term(&tx) != t
        {
            tx.put(ROOT, TERM_KEY, ScalarValue::Uint(t)).map_err(am)?;
            term_changed = true;
        }
        if changed.is_empty() && !term_changed {
            tx.rollback();
            // Retry a failed append even when this burst is a no-op.
            self.persist_incremental(doc, false)?;
            let mut view = std::mem::take(&mut self.undelivered);
            view.shrink_to_fit();
            return Ok(WriteOutcome {
                generation: self.docs.get(doc).map_or(0, |e| e.generation),
                rolled_over: false,
                view,
            });
        }
        tx.commit();
        e.live_bytes = live;
        e.commits_since_base += 1;
        e.num_ops += e.doc.get_last_local_change().map_or(0, |c| c.len() as u64);
        e.term = read_term(&e.doc);
        let persisted = self.persist_incremental(doc, false);
        self.set_digest(doc);
        let view = self.reconcile(doc, changed, Old::At(before));
        if let Err(err) = persisted {
            self.undelivered.extend(view);
            return Err(err);
        }
        let rolled_over = self.maintain(doc)?;
        let mut out = std::mem::take(&mut self.undelivered);
        out.extend(view);
        let e = self
            .docs
            .get(doc)
            .ok_or_else(|| StoreError::UnknownDoc { doc: doc.clone() })?;
        Ok(WriteOutcome {
            generation: e.generation,
            rolled_over,
            view: out,
        })
    }
}
