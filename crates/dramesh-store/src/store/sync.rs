//! Sync and apply: automerge sync messages out (signed) and in (verified, reconciled,
//! promoted into the view).

use super::*;

impl Store {
    /// The automerge document currently held for `doc`, for tests and benches that forge or
    /// inspect automerge data (feature `test-util`; automerge is not part of the store's API).
    #[cfg(feature = "test-util")]
    pub fn automerge_doc(&self, doc: &DocId) -> Option<&Automerge> {
        self.docs.get(doc).map(|e| &e.doc)
    }

    /// Produces the next sync message for `doc` at `generation` toward one peer.
    ///
    /// The mesh keeps one [`SyncState`] per (doc, generation, peer) and should always sync the
    /// highest generation either side has. Asking for a generation newer than the one held (or
    /// for an unknown document) starts receiving it into a side document; asking for an older
    /// one returns `None`. For the store's own documents the state is forced read-only (the
    /// writer never accepts changes), and nothing is offered while a local write is not durable.
    pub fn generate_sync_message(
        &mut self,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .generate_signed_sync_message(doc, generation, state)?
            .map(|(m, _)| m))
    }

    /// [`Store::generate_sync_message`], with the writer's signature over the heads the message
    /// leads to when it carries changes: for an own document this store signs (once per heads,
    /// with [`Trust::signer`]), for a replica copy it is the signature it verified when it
    /// received them. `None` when the message carries no changes or no signature is held.
    pub fn generate_signed_sync_message(
        &mut self,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
    ) -> Result<Option<SignedMessage>, StoreError> {
        let signer = self.trust.as_ref().and_then(|t| t.signer.clone());
        if let Some(e) = self.docs.get_mut(doc) {
            if generation < e.generation {
                return Ok(None);
            }
            if generation == e.generation {
                if e.owned && e.not_durable {
                    return Ok(None);
                }
                let Some(msg) = e.doc.generate_sync_message(&mut state.0) else {
                    return Ok(None);
                };
                if msg.changes.is_empty() {
                    return Ok(Some((encode_message(msg, &mut self.packed), None)));
                }
                let heads = e.doc.get_heads();
                let fresh = e.signed.as_ref().is_some_and(|a| a.signs_heads(&heads));
                if e.owned
                    && !fresh
                    && let Some(signer) = signer
                {
                    let hs: Vec<[u8; 32]> = heads.iter().map(|h| h.0).collect();
                    let statement = attest::statement(doc, e.generation, &hs);
                    let signature =
                        signer
                            .sign(&statement)
                            .map_err(|reason| StoreError::BadSignature {
                                doc: doc.clone(),
                                generation,
                                reason: format!("cannot sign own heads: {reason}"),
                            })?;
                    e.signed = Some(Attestation::new(hs, signature, signer.signer()).map_err(
                        |reason| StoreError::BadSignature {
                            doc: doc.clone(),
                            generation,
                            reason,
                        },
                    )?);
                }
                return Ok(Some((
                    encode_message(msg, &mut self.packed),
                    e.signed.clone(),
                )));
            }
            if e.owned {
                // A peer holds a newer generation of our own document (we lost our disk and the
                // clock went back): supersede it.
                if self.plausible_generation(generation) {
                    self.rollover_to(doc, generation.saturating_add(1))?;
                }
                return Ok(None);
            }
        }
        if !self.plausible_generation(generation) {
            return Ok(None);
        }
        let Some(p) = self.pending_for(doc, generation)? else {
            return Ok(None);
        };
        let Some(msg) = p.doc.generate_sync_message(&mut state.0) else {
            return Ok(None);
        };
        let signed = (!msg.changes.is_empty())
            .then(|| p.signed.clone())
            .flatten();
        Ok(Some((encode_message(msg, &mut self.packed), signed)))
    }

    pub(super) fn pending_for(
        &mut self,
        doc: &DocId,
        generation: u64,
    ) -> Result<Option<&mut Pending>, StoreError> {
        check_doc_id(doc)?;
        match self.pending.get(doc).map(|p| p.generation) {
            Some(g) if g > generation => return Ok(None),
            Some(g) if g == generation => return Ok(self.pending.get_mut(doc)),
            Some(_) => {}
            None => {
                if self.pending.len() >= self.config.max_pending {
                    return Err(StoreError::TooManyPending {
                        doc: doc.clone(),
                        limit: self.config.max_pending,
                    });
                }
                if !self.docs.contains_key(doc) {
                    let held = self.cluster_docs(&doc.cluster);
                    let receiving = self
                        .pending
                        .range(DocId::new(doc.cluster.as_str(), "")..)
                        .take_while(|(d, _)| d.cluster == doc.cluster)
                        .filter(|(d, _)| !self.docs.contains_key(*d))
                        .count();
                    if held + receiving >= self.config.max_docs_per_cluster {
                        return Err(StoreError::TooManyDocs {
                            doc: doc.clone(),
                            limit: self.config.max_docs_per_cluster,
                        });
                    }
                }
            }
        }
        self.pending.insert(
            doc.clone(),
            Pending {
                generation,
                doc: Automerge::new(),
                signed: None,
            },
        );
        Ok(self.pending.get_mut(doc))
    }

    /// Applies one incoming sync message for `doc` at `generation` and returns the visible
    /// changes it caused, `(cluster, change)`.
    ///
    /// `may_deliver` is the mesh's policy for the sending peer (for example: replicas may relay
    /// any document, an agent only its own). Before anything is applied, every change carried
    /// by the message must be authored by the writer's actor for that generation; otherwise the
    /// message is refused with [`StoreError::ForeignAuthor`] and neither the document nor the
    /// sync state changes. Messages for an older generation than the one held are ignored.
    /// A newer generation is received on the side and replaces the held one, in one step, as
    /// soon as its history is complete.
    pub fn receive_sync_message(
        &mut self,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
        message: &[u8],
        may_deliver: &dyn Fn(&DocId) -> bool,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        self.receive_signed_sync_message(
            doc,
            generation,
            state,
            message,
            Proof::default(),
            may_deliver,
        )
    }

    /// [`Store::receive_sync_message`] with the sender's attestation of the changes carried.
    ///
    /// With [`Trust`] installed ([`Store::set_trust`]), a message carrying changes for a
    /// document this store does not write is applied only if `proof.signed` verifies (a credential
    /// the verifier trusts, allowed to write `doc`, signing `doc`, `generation` and the heads)
    /// and every carried change is one of those heads or their ancestor through the message;
    /// otherwise it is refused with [`StoreError::BadSignature`] and nothing changes. A
    /// signature equal to the one already held is not verified again. The newest verified
    /// signature whose heads the document reached is kept (and persisted) for relaying.
    ///
    /// A message whose changes are only partly proven (by the signed heads, or by being a
    /// missing dependency of changes the copy queued) has the proven ones applied and the
    /// others dropped ([`Store::uncovered_dropped`]); one proving none is refused.
    ///
    /// `proof.from_writer` says the message comes over the writer's own authenticated session. Its
    /// signature must still verify, but carried changes need not be reachable from the signed
    /// heads through the message: automerge's sync leaves out changes the receiver's Bloom
    /// filter claims (about 1 % false positives), and only the writer resends them when asked,
    /// which it can only do once its descendants were accepted. The session authenticates the
    /// writer's changes as it did before signatures; coverage is what makes a relay's changes
    /// authentic.
    pub fn receive_signed_sync_message(
        &mut self,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
        message: &[u8],
        proof: Proof<'_>,
        may_deliver: &dyn Fn(&DocId) -> bool,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        let Proof {
            signed,
            from_writer,
        } = proof;
        if message.len() > self.config.max_message_bytes {
            return Err(StoreError::MessageTooLarge {
                doc: doc.clone(),
                size: message.len(),
                limit: self.config.max_message_bytes,
            });
        }
        check_doc_id(doc)?;
        if !may_deliver(doc) {
            return Err(StoreError::PeerNotAllowed {
                doc: doc.clone(),
                generation,
            });
        }
        let current = self.docs.get(doc).map(|e| (e.generation, e.owned));
        if let Some((g, _)) = current
            && generation < g
        {
            return Ok(Vec::new());
        }
        if !self.plausible_generation(generation) {
            return Err(StoreError::FutureGeneration {
                doc: doc.clone(),
                generation,
            });
        }
        if let Some(&retired_at_ms) = self.retirement.retired.get(&doc.cluster)
            && (generation <= retired_at_ms
                || self
                    .retirement
                    .refused_generations
                    .get(doc)
                    .is_some_and(|g| generation <= *g))
        {
            return Err(StoreError::RetiredCluster {
                doc: doc.clone(),
                generation,
                retired_at_ms,
            });
        }
        let msg = Message::decode(message).map_err(|e| StoreError::MalformedMessage {
            doc: doc.clone(),
            reason: e.to_string(),
        })?;
        let carried = check_authors(doc, generation, &msg)?;
        let (signed, keep) = match current {
            Some((_, true)) => (None, None),
            _ => self.check_signed(doc, generation, &carried, signed, from_writer)?,
        };
        let mut msg = msg;
        if let Some(keep) = keep {
            let dropped = carried.len() - keep.len();
            self.uncovered_dropped += dropped as u64;
            tracing::debug!(%doc, generation, dropped, kept = keep.len(), "changes no signature proves dropped; the rest applied");
            msg.changes =
                keep_changes(&msg, &keep).map_err(|reason| StoreError::MalformedMessage {
                    doc: doc.clone(),
                    reason,
                })?;
        }
        for c in carried {
            if let Some(chunk) = c.packed {
                self.packed.insert(c.hash, chunk);
            }
        }
        let am = |source: automerge::AutomergeError| StoreError::Automerge {
            doc: doc.clone(),
            source: Box::new(source),
        };
        match current {
            Some((g, true)) => {
                if generation > g {
                    self.rollover_to(doc, generation.saturating_add(1))?;
                } else if let Some(e) = self.docs.get_mut(doc) {
                    // The writer never takes changes to its own document from peers: only its
                    // own history is authoritative (a peer can only echo it, or hold changes
                    // of a previous life whose sequence numbers this life reuses).
                    let mut msg = msg;
                    msg.changes = Vec::<Vec<u8>>::new().into();
                    e.doc.receive_sync_message(&mut state.0, msg).map_err(am)?;
                }
                Ok(std::mem::take(&mut self.undelivered))
            }
            Some((g, false)) if g == generation => self.receive_current(doc, state, msg, signed),
            _ => {
                // A first message carries only heads: nothing to receive yet, and the protocol
                // answers it on behalf of an empty document. Starting a side document for it
                // would let a peer offering many documents at once (a relay's cluster, a new
                // replica's fleet) fill `max_pending` with documents nothing was sent for.
                let receiving = self
                    .pending
                    .get(doc)
                    .is_some_and(|p| p.generation == generation);
                if msg.changes.is_empty() && !receiving {
                    return Ok(Vec::new());
                }
                let Some(p) = self.pending_for(doc, generation)? else {
                    return Ok(Vec::new());
                };
                p.doc.receive_sync_message(&mut state.0, msg).map_err(am)?;
                if let Some(a) = signed {
                    p.signed = Some(a);
                }
                let complete =
                    !p.doc.get_heads().is_empty() && p.doc.get_missing_deps(&[]).is_empty();
                if complete {
                    self.promote(doc)
                } else {
                    Ok(std::mem::take(&mut self.undelivered))
                }
            }
        }
    }

    /// Stops keeping the materialized view, for a store nobody reads objects from (an agent
    /// or a cluster's relay, which only write and carry documents): from now on no change
    /// computes visible values (no old values read, no presence or scope evaluated), every
    /// mutation returns no view changes, and [`Store::get`] and [`Store::snapshot`] see
    /// nothing. Documents, digests, sync, signatures and files are unaffected. One way: a
    /// store opened again builds its view from its files.
    pub fn stop_serving_view(&mut self) {
        self.serves_view = false;
        self.view = View::default();
    }

    /// Installs what this store signs its own documents with and verifies received changes
    /// against (see [`Store::receive_signed_sync_message`]). The mesh node installs it from its
    /// certificate when it starts.
    pub fn set_trust(&mut self, trust: Trust) {
        self.trust = Some(trust);
    }

    /// The signature this store holds over the current heads of `doc` (a replica copy's proof
    /// of authorship), if any.
    pub fn signed_heads(&self, doc: &DocId) -> Option<&Attestation> {
        self.docs
            .get(doc)
            .and_then(|e| e.signed.as_ref())
            .filter(|a| {
                self.docs
                    .get(doc)
                    .is_some_and(|e| a.signs_heads(&e.doc.get_heads()))
            })
    }

    /// Verifies that `signed` covers the carried changes (see
    /// [`Store::receive_signed_sync_message`]); returns the attestation to keep, if any, and,
    /// when only some of the changes are proven, the ones to apply.
    pub(super) fn check_signed(
        &self,
        doc: &DocId,
        generation: u64,
        carried: &[Carried],
        signed: Option<&Attestation>,
        from_writer: bool,
    ) -> Result<(Option<Attestation>, Option<HashSet<ChangeHash>>), StoreError> {
        let Some(trust) = &self.trust else {
            return Ok((None, None));
        };
        if carried.is_empty() {
            return Ok((None, None));
        }
        let bad = |reason: String| StoreError::BadSignature {
            doc: doc.clone(),
            generation,
            reason,
        };
        // Changes this copy already holds were proven when they arrived. Relays and anti-entropy
        // resend them often (a replica hears an update from the writer and from every other
        // replica), and such a message can add nothing, so it costs no signature check; its
        // attestation is not kept, since it was not verified.
        if self.holds_all(doc, generation, carried) {
            return Ok((None, None));
        }
        let Some(a) = signed else {
            return Err(bad(format!(
                "{} change(s) carry no signature of the writer",
                carried.len()
            )));
        };
        let known = self
            .docs
            .get(doc)
            .filter(|e| e.generation == generation)
            .map(|e| (e.signed.as_ref(), e.signed_ahead.as_ref()))
            .or_else(|| {
                self.pending
                    .get(doc)
                    .filter(|p| p.generation == generation)
                    .map(|p| (p.signed.as_ref(), None))
            });
        let seen = known.is_some_and(|(s, ahead)| s == Some(a) || ahead == Some(a));
        if !seen {
            let statement = attest::statement(doc, generation, &a.heads);
            trust
                .verifier
                .verify(doc, &statement, &a.signature, &a.signer)
                .map_err(|e| bad(format!("signature does not verify: {e}")))?;
        }
        let waiting = self.waiting_for(doc, generation);
        let roots = a.heads.iter().map(|h| ChangeHash(*h)).chain(waiting);
        let proven = attest::proven(carried, roots);
        if proven.len() == carried.len() || from_writer {
            // Everything proven, or the writer's own session vouches for them (see
            // `receive_signed_sync_message`).
            return Ok((Some(a.clone()), None));
        }
        let unproven = carried.iter().find(|c| !proven.contains(&c.hash));
        if proven.is_empty() || carried.iter().any(|c| c.whole_document) {
            return Err(bad(format!(
                "change {} is not covered by the writer's signed heads",
                unproven.map_or_else(String::new, |c| c.hash.to_string())
            )));
        }
        // Some changes are proven, others not: a relay's message that leaves out a change the
        // receiver's Bloom filter falsely claims (the rest of the chain is then unreachable
        // from the signed heads through the message). The proven ones are applied (automerge
        // queues them until the gap is filled) and the others dropped: the receiver then asks
        // for the missing change by hash, which its queued changes name, so the resend is
        // proven in turn. Refusing the whole message instead would repeat forever: the next
        // exchange carries the same Bloom filter.
        Ok((Some(a.clone()), Some(proven)))
    }

    /// Missing dependencies of the changes the copy of `doc` at `generation` (held or being
    /// assembled) has queued: hashes named by changes it proved, so a change with one of them
    /// is the writer's.
    pub(super) fn waiting_for(&self, doc: &DocId, generation: u64) -> Vec<ChangeHash> {
        match self.docs.get(doc) {
            Some(e) if e.generation == generation => e.doc.get_missing_deps(&[]),
            _ => self
                .pending
                .get(doc)
                .filter(|p| p.generation == generation)
                .map(|p| p.doc.get_missing_deps(&[]))
                .unwrap_or_default(),
        }
    }

    /// Changes carried by messages that no verified signature proved, dropped while the rest of
    /// the message was applied (see [`Store::receive_signed_sync_message`]).
    pub fn uncovered_dropped(&self) -> u64 {
        self.uncovered_dropped
    }

    /// Whether the copy of `doc` at `generation` (held or being assembled) already has every
    /// carried change.
    pub(super) fn holds_all(&self, doc: &DocId, generation: u64, carried: &[Carried]) -> bool {
        let copy = match self.docs.get(doc) {
            Some(e) if e.generation == generation => Some(&e.doc),
            _ => self
                .pending
                .get(doc)
                .filter(|p| p.generation == generation)
                .map(|p| &p.doc),
        };
        copy.is_some_and(|d| {
            carried
                .iter()
                .all(|c| d.get_change_by_hash(&c.hash).is_some())
        })
    }

    pub(super) fn receive_current(
        &mut self,
        doc: &DocId,
        state: &mut SyncState,
        msg: Message,
        signed: Option<Attestation>,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        let am = |source: automerge::AutomergeError| StoreError::Automerge {
            doc: doc.clone(),
            source: Box::new(source),
        };
        let Some(e) = self.docs.get_mut(doc) else {
            return Err(StoreError::UnknownDoc { doc: doc.clone() });
        };
        let before = e.doc.get_heads();
        e.doc.receive_sync_message(&mut state.0, msg).map_err(am)?;
        let after = e.doc.get_heads();
        if let Some(a) = signed {
            e.signed_ahead = Some(a);
        }
        if let Some(a) = e.signed_ahead.take_if(|a| a.signs_heads(&after))
            && e.signed.as_ref() != Some(&a)
        {
            e.signed = Some(a);
            e.signed_unsaved = true;
        }
        if after == before {
            return Ok(std::mem::take(&mut self.undelivered));
        }
        // Every change applied by this message, including ones queued by an earlier message
        // until their dependencies arrived: their operations name the changed keys (for the
        // view only).
        let changed = if !self.serves_view {
            BTreeSet::new()
        } else {
            match changed_root_keys(e.doc.get_changes(&before)) {
                Some(keys) => keys,
                None => {
                    tracing::debug!(doc = %doc, "changed keys not readable from the changes; diffing");
                    patched_keys(&e.doc.diff(
                        &before,
                        &after,
                        TextRepresentation::String(automerge::TextEncoding::default()),
                    ))
                }
            }
        };
        e.term = read_term(&e.doc);
        let keys: Vec<String> = changed
            .into_iter()
            .filter(|k| parse_doc_key(k).is_some())
            .collect();
        let persisted = self.persist_incremental(doc, self.commit.on);
        self.set_digest(doc);
        let view = self.reconcile(doc, keys, Old::At(before));
        self.undelivered.extend(view);
        persisted?;
        self.maintain(doc)?;
        Ok(std::mem::take(&mut self.undelivered))
    }

    /// Queues a new file on the background writer (starting it with the first); written here
    /// when no thread can be started.
    pub(super) fn background_write(&mut self, f: persist::NewFile) -> Result<(), StoreError> {
        let Some(dir) = self.dir.clone() else {
            return Ok(());
        };
        match self.writer() {
            Some(w) => w.submit(f),
            None => persist::write_new(&dir, &f, Durability::None).map(|_| ()),
        }
    }

    /// The background writer, started with the first use; `None` without a directory or when
    /// no thread can be started (then the caller writes inline).
    pub(super) fn writer(&mut self) -> Option<&mut persist::Writer> {
        let dir = self.dir.as_ref()?;
        if self.commit.writer.is_none() {
            match persist::Writer::start(dir.clone()) {
                Ok(w) => self.commit.writer = Some(w),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start the store's file writer thread; writing inline")
                }
            }
        }
        self.commit.writer.as_mut()
    }

    /// Replaces the held generation of `doc` with its completed pending one.
    pub(super) fn promote(
        &mut self,
        doc: &DocId,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        let Some(p) = self.pending.remove(doc) else {
            return Ok(std::mem::take(&mut self.undelivered));
        };
        // A generation of a retired cluster is adopted only when its writer asked to rejoin
        // after the retirement: a rollover alone (however it started) never brings it back.
        if let Some(&retired_at_ms) = self.retirement.retired.get(&doc.cluster)
            && read_rejoin(&p.doc) <= retired_at_ms
        {
            let refused = self
                .retirement
                .refused_generations
                .entry(doc.clone())
                .or_insert(0);
            *refused = (*refused).max(p.generation);
            tracing::info!(doc = %doc, generation = p.generation, retired_at_ms, "refused a new generation of a retired cluster: it does not rejoin");
            return Err(StoreError::RetiredCluster {
                doc: doc.clone(),
                generation: p.generation,
                retired_at_ms,
            });
        }
        if let Err(err) = self.settle(doc) {
            self.pending.insert(doc.clone(), p);
            return Err(err);
        }
        // A first copy of a document joins the group commit: a replica taking in a fleet of
        // per-node documents would otherwise pay a file and a directory fsync for each, and its
        // file is written on the background writer. Only when no file of the document exists
        // yet: a crash before `sync_pending` then loses nothing anyone was told of (the file is
        // torn or absent, see `Store::open`), while a file replacing an older generation is
        // written whole before it is renamed over it.
        let defer = self.commit.on
            && self.config.durability == Durability::Fsync
            && !self.docs.contains_key(doc);
        let f = snapshot_file(
            doc,
            p.generation,
            false,
            persist::pack_snapshot(&p.doc),
            None,
            p.signed.as_ref(),
        );
        let written = if defer && self.dir.is_some() {
            let sizes = (f.len(), framed_len(f.snapshot.len()));
            self.background_write(f).map(|()| sizes)
        } else {
            self.write_snapshot(&f)
        };
        let (stored, base) = match written {
            Ok(v) => v,
            Err(err) => {
                self.pending.insert(doc.clone(), p);
                return Err(err);
            }
        };
        if defer {
            self.commit.unsynced.insert(doc.clone());
            self.commit.new_files = true;
        }
        let heads = p.doc.get_heads();
        let entry = Held {
            generation: p.generation,
            term: read_term(&p.doc),
            owned: false,
            saved_heads: heads,
            heads_hash: [0; 32],
            bucket: doc.bucket(),
            digest_part: 0,
            stored_bytes: stored,
            base_bytes: base,
            fresh_bytes: base,
            commits_since_base: 0,
            num_ops: 0,
            live_bytes: 0,
            not_durable: false,
            keys_counted: (0, 0),
            signed: p.signed.filter(|a| a.signs_heads(&p.doc.get_heads())),
            signed_ahead: None,
            signed_unsaved: false,
            doc: p.doc,
        };
        let mut keys: BTreeSet<String> = if self.serves_view {
            object_keys(&entry.doc, None).into_iter().collect()
        } else {
            BTreeSet::new()
        };
        let old = match self.docs.insert(doc.clone(), entry) {
            Some(old) => {
                self.xor_digest(doc, old.bucket, old.digest_part);
                if self.serves_view {
                    keys.extend(object_keys(&old.doc, None));
                }
                Old::Doc(Box::new(old.doc))
            }
            None => Old::Absent,
        };
        self.set_digest(doc);
        // The new generation's file is a fresh snapshot: an older copy's queued compaction is moot.
        self.compaction.due.remove(doc);
        tracing::debug!(doc = %doc, generation = p.generation, "adopted generation");
        let view = self.reconcile(doc, keys.into_iter().collect(), old);
        let mut out = std::mem::take(&mut self.undelivered);
        out.extend(view);
        Ok(out)
    }

    /// Visible value of each key, resolving which document wins. `own` reads the changed
    /// document's value in the state being captured.
    pub(super) fn capture(
        &self,
        doc: &DocId,
        keys: &[String],
        own: &dyn Fn(&str) -> Option<Arc<[u8]>>,
    ) -> Vec<Option<Arc<[u8]>>> {
        keys.iter()
            .map(|k| match self.view.winner(&doc.cluster, k) {
                None => None,
                Some(w) if w == doc.writer => own(k),
                Some(w) => {
                    let other = DocId::new(doc.cluster.clone(), w);
                    self.docs
                        .get(&other)
                        .and_then(|e| read_value(&e.doc, k, None))
                }
            })
            .collect()
    }

    /// Updates the view after `doc` changed and returns the visible changes for `keys`
    /// (plus every key of the document when its lease term changed); nothing when the store
    /// serves no view ([`Store::stop_serving_view`]).
    pub(super) fn reconcile(
        &mut self,
        doc: &DocId,
        keys: Vec<String>,
        old: Old,
    ) -> Vec<(String, ObjectChange)> {
        if !self.serves_view {
            return Vec::new();
        }
        let old_term = self.view.term(&doc.cluster, &doc.writer);
        let new_term = self.docs.get(doc).map(|e| e.term);
        let mut keys = keys;
        if new_term.is_some_and(|t| t != old_term) {
            let mut all: BTreeSet<String> = keys.into_iter().collect();
            if let Some(e) = self.docs.get(doc) {
                all.extend(object_keys(&e.doc, None));
                if let Old::At(h) = &old {
                    all.extend(object_keys(&e.doc, Some(h)));
                }
            }
            if let Old::Doc(d) = &old {
                all.extend(object_keys(d, None));
            }
            keys = all.into_iter().collect();
        }
        let before = {
            let current = self.docs.get(doc);
            let own_old = |k: &str| match &old {
                Old::At(h) => current.and_then(|e| read_value(&e.doc, k, Some(h))),
                Old::Doc(d) => read_value(d, k, None),
                Old::Absent => None,
            };
            self.capture(doc, &keys, &own_old)
        };
        let old_max = self.view.max_term(&doc.cluster);
        if let Some(t) = new_term {
            self.view.set_term(&doc.cluster, &doc.writer, t);
        }
        let present = self.presence(doc, &keys);
        for (k, v) in keys.iter().zip(&present) {
            self.view
                .set_present(&doc.cluster, &doc.writer, k, v.is_some());
        }
        let after = {
            // The document wins a key only where it is present: its values were just read.
            let values: HashMap<&str, &Arc<[u8]>> = keys
                .iter()
                .zip(&present)
                .filter_map(|(k, v)| Some((k.as_str(), v.as_ref()?)))
                .collect();
            let own_new = |k: &str| values.get(k).map(|v| Arc::clone(v));
            self.capture(doc, &keys, &own_new)
        };
        let mut out = Vec::new();
        for ((k, b), a) in keys.iter().zip(before).zip(after) {
            if b == a {
                continue;
            }
            let Some(key) = parse_doc_key(k) else {
                continue;
            };
            let change = match a {
                Some(json) => ObjectChange::Upsert { key, json },
                None => ObjectChange::Delete { key },
            };
            out.push((doc.cluster.clone(), change));
        }
        if self.view.max_term(&doc.cluster) != old_max {
            // The Lease changed hands: every other writer's cluster-owned records change scope.
            let others: Vec<(DocId, Vec<String>, Vec<ChangeHash>)> = self
                .docs
                .iter()
                .filter(|(id, _)| id.cluster == doc.cluster && *id != doc)
                .map(|(id, e)| (id.clone(), object_keys(&e.doc, None), e.doc.get_heads()))
                .collect();
            for (other, keys, heads) in others {
                out.extend(self.reconcile(&other, keys, Old::At(heads)));
            }
        }
        out
    }
}
