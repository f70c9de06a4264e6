//! Opening a store: loading every document file, recovering torn tails and corrupt files
//! (reported in [`OpenReport`]), and the store's clock.

use super::digest::Digests;
use super::maintain::Compaction;
use super::scope::Retirement;
use super::write::GroupCommit;
use super::*;

impl Store {
    /// The wall clock in milliseconds, with [`StoreConfig::clock_offset_ms`] applied.
    pub(super) fn now_millis(&self) -> u64 {
        wall_millis(self.config.clock_offset_ms)
    }

    /// Whether `generation` is believable by this store's clock: at most
    /// [`MAX_FUTURE_GENERATION_MS`] ahead of it. Replicas refuse messages for other
    /// generations ([`StoreError::FutureGeneration`]); a writer never continues one.
    pub fn plausible_generation(&self, generation: u64) -> bool {
        generation <= self.now_millis().saturating_add(MAX_FUTURE_GENERATION_MS)
    }

    /// Changes [`StoreConfig::clock_offset_ms`] (a clock corrected while running; tests).
    pub fn set_clock_offset_ms(&mut self, offset_ms: i64) {
        self.config.clock_offset_ms = offset_ms;
    }

    /// A store without persistence (tests, benchmarks, ephemeral replicas).
    pub fn in_memory(config: StoreConfig) -> Store {
        Store {
            dir: None,
            config,
            docs: BTreeMap::new(),
            pending: BTreeMap::new(),
            view: View::default(),
            digests: Digests {
                all: Digest::empty(),
                by_cluster: HashMap::new(),
            },
            undelivered: Vec::new(),
            commit: GroupCommit::default(),
            compaction: Compaction {
                due: BTreeSet::new(),
                rest_until: Instant::now(),
                done: 0,
            },
            retirement: Retirement::default(),
            rejoin_next: false,
            trust: None,
            out_of_scope: 0,
            packed: PackedChanges::new(DEFAULT_PACKED_BYTES),
            uncovered_dropped: 0,
            serves_view: true,
        }
    }

    /// Opens (creating if needed) a store directory and loads every document in it.
    ///
    /// Corrupt files are moved aside and listed in the report, never loaded; their documents
    /// are absent and come back through sync (or, for a writer, through [`Store::open_writer`],
    /// which starts a newer generation). Torn tails are truncated and listed. A file of a newer
    /// store format than this build reads refuses the whole directory
    /// ([`StoreError::NewerFormat`]), before anything in it is changed.
    pub fn open(
        dir: impl AsRef<Path>,
        config: StoreConfig,
    ) -> Result<(Store, OpenReport), StoreError> {
        let dir = dir.as_ref().to_path_buf();
        let io = |source| StoreError::Io {
            path: dir.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let mut store = Store::in_memory(config);
        store.dir = Some(dir.clone());
        let mut report = OpenReport::default();
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        paths.sort();
        // Nothing in the directory is changed (files removed, moved aside or truncated) until
        // every file was read: a file of a newer store format refuses the whole directory,
        // untouched.
        let mut tmp_files = Vec::new();
        let mut unfinished = Vec::new();
        let mut corrupt: Vec<(PathBuf, String, Option<FileHeader>)> = Vec::new();
        let mut torn: Vec<(PathBuf, u64)> = Vec::new();
        let mut newer: Vec<(PathBuf, String)> = Vec::new();
        for path in paths {
            if persist::is_tmp(&path) {
                tmp_files.push(path);
                continue;
            }
            if !persist::is_doc_file(&path) {
                continue;
            }
            let bytes = std::fs::read(&path).map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
            let file = match persist::parse_file(&bytes) {
                Ok(f) => f,
                Err(c) if c.unfinished => {
                    tracing::warn!(path = %path.display(), reason = %c.reason, "removing a new document file a crash cut short before it was durable; peers resend it");
                    unfinished.push(path);
                    continue;
                }
                Err(c) => {
                    match c.newer_format {
                        Some(found) => newer.push((path, found)),
                        None => corrupt.push((path, c.reason, c.header.map(|h| *h))),
                    }
                    continue;
                }
            };
            let expected_path = persist::doc_path(&dir, &file.header.doc);
            if expected_path != path {
                corrupt.push((
                    path,
                    "file name does not match the document id in its header".to_string(),
                    Some(file.header),
                ));
                continue;
            }
            if !file.header.doc.is_valid() {
                let reason = format!(
                    "document id {} in the header is not a valid (cluster, writer) name",
                    file.header.doc
                );
                corrupt.push((path, reason, Some(file.header)));
                continue;
            }
            let mut doc = match load_file_doc(&file.automerge_bytes, file.snapshot_len as usize) {
                Ok(d) => d,
                Err(reason) => {
                    corrupt.push((path, reason, Some(file.header)));
                    continue;
                }
            };
            if file.torn_tail > 0 {
                torn.push((path.clone(), file.valid_len));
                report.truncated.push(TruncatedTail {
                    doc: file.header.doc.clone(),
                    path: path.clone(),
                    bytes: file.torn_tail,
                });
            }
            let FileHeader {
                doc: id,
                generation,
                owned,
                fresh_bytes,
                ..
            } = file.header;
            if owned {
                doc.set_actor(writer_actor(&id, generation));
            }
            let heads = doc.get_heads();
            let hh = heads_hash(&heads);
            let part = fingerprint(&id, generation, &hh);
            // The file's CRC vouches for the record; a record that does not decode is the
            // proof of a different format, and the copy is then relayed unproven until the
            // writer's next signature arrives.
            let signed = match file.signed.as_deref().map(Attestation::decode) {
                Some(Ok(a)) if !owned => Some(a),
                Some(Err(reason)) => {
                    tracing::warn!(path = %path.display(), %reason, "ignoring unreadable signed-heads record");
                    None
                }
                _ => None,
            };
            let (changes, num_ops) = history(&doc);
            let entry = Held {
                generation,
                term: read_term(&doc),
                owned,
                saved_heads: heads,
                heads_hash: hh,
                bucket: id.bucket(),
                digest_part: part,
                stored_bytes: file.valid_len,
                base_bytes: framed_len(file.snapshot_record_len as usize),
                fresh_bytes: if fresh_bytes > 0 {
                    fresh_bytes
                } else {
                    framed_len(file.snapshot_record_len as usize)
                },
                commits_since_base: changes.saturating_sub(1),
                num_ops,
                live_bytes: if owned { live_value_bytes(&doc) } else { 0 },
                not_durable: false,
                keys_counted: (0, 0),
                signed,
                signed_ahead: None,
                signed_unsaved: false,
                doc,
            };
            store.xor_digest(&id, entry.bucket, part);
            store.view.set_term(&id.cluster, &id.writer, entry.term);
            store.docs.insert(id, entry);
            report.loaded += 1;
        }
        if let Some((path, found)) = newer.first() {
            for (path, found) in &newer {
                tracing::error!(path = %path.display(), format = %found, "document file of a newer store format");
            }
            return Err(StoreError::NewerFormat {
                path: path.clone(),
                found: found.clone(),
                supported: format!("{}.{}", persist::STORE_FORMAT, persist::STORE_FORMAT_MINOR),
                others: newer.len() - 1,
            });
        }
        report.removed_tmp_files = tmp_files.len();
        report.removed_unfinished_files = unfinished.len();
        for path in tmp_files.into_iter().chain(unfinished) {
            std::fs::remove_file(&path).map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
        }
        for (path, len) in torn {
            persist::truncate(&path, len, store.config.durability)?;
            tracing::warn!(path = %path.display(), valid_bytes = len, "truncated torn (unacknowledged) tail");
        }
        for (path, reason, header) in corrupt {
            let moved_to = persist::quarantine(&path)?;
            tracing::error!(path = %path.display(), %reason, "corrupt document file dropped; it will be resynced");
            report.corrupt.push(CorruptDoc {
                doc: header.as_ref().map(|h| h.doc.clone()),
                generation: header.as_ref().map(|h| h.generation),
                path,
                moved_to,
                reason,
            });
        }
        // Presence once every writer's term is known (the Lease holder's scope depends on it).
        let ids: Vec<DocId> = store.docs.keys().cloned().collect();
        for id in ids {
            let keys = store
                .docs
                .get(&id)
                .map(|e| object_keys(&e.doc, None))
                .unwrap_or_default();
            let present = store.presence(&id, &keys);
            for (key, v) in keys.iter().zip(present) {
                if v.is_some() {
                    store.view.set_present(&id.cluster, &id.writer, key, true);
                }
            }
        }
        Ok((store, report))
    }

    pub(super) fn path_of(&self, doc: &DocId) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| persist::doc_path(d, doc))
    }
}
