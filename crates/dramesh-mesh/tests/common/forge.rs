//! A forged sync message, as a compromised relaying replica could build it.

/// A sync message from `doc` as held (read through the test-util automerge view of `store`)
/// plus one change `key = value` authored by the writer's actor, as a relaying replica could
/// forge it (the actor is public), and the writer's signature `store` holds.
pub(crate) fn forge(
    store: &dramesh_store::Store,
    doc: &dramesh_store::DocId,
    key: &str,
    value: &str,
) -> (u64, Vec<u8>, dramesh_store::Attestation) {
    use automerge::sync::SyncDoc as _;
    use automerge::transaction::Transactable as _;
    let generation = store.entry(doc).unwrap().generation;
    let held = store.automerge_doc(doc).unwrap();
    let heads = held.get_heads();
    let mut forged = held
        .clone()
        .with_actor(dramesh_store::writer_actor(doc, generation));
    let mut tx = forged.transaction();
    tx.put(automerge::ROOT, key, value.as_bytes().to_vec())
        .unwrap();
    tx.commit();
    let new: Vec<Vec<u8>> = forged
        .get_changes(&heads)
        .iter()
        .map(|c| c.raw_bytes().to_vec())
        .collect();
    assert_eq!(new.len(), 1);
    let mut msg = forged
        .generate_sync_message(&mut automerge::sync::State::new())
        .unwrap();
    msg.changes = new.into();
    let stale = store.signed_heads(doc).unwrap().clone();
    (generation, msg.encode(), stale)
}
