//! [`MeshStore`]: the persistent [`dramesh_store::Store`] as a [`DocStore`] the mesh replicates.
//!
//! Entries and the digest are the store's own, maintained by it on every mutation; the adapter
//! adds the mesh's rules (stale generations, who may deliver what) and queues view changes.
//!
//! Guarantees:
//! - Every visible object change caused by a received sync message is queued, in order, and
//!   handed out by [`MeshStore::drain_changes`] (the replica feeds them to its estimation
//!   view). Local writes return their changes directly ([`MeshStore::apply`]).
//! - A message for an older generation than held is refused with
//!   [`RejectReason::StaleGeneration`], so the protocol offers the newer one back.
//! - The store holds only documents that can be named on the wire ([`DocId::is_valid`]).
//! - Received changes are group-committed: durable once [`DocStore::flush`] returns `Ok`,
//!   which the node calls before releasing any output that reflects them.
//! - The changes queue is bounded ([`MAX_QUEUED_CHANGES`]); on overflow it is cleared and
//!   [`MeshStore::take_overflowed`] reports it, so the consumer rebuilds from
//!   [`Store::snapshot`] instead of silently missing updates.

use dramesh_store::{
    Attestation, Digest, DocEntry, DocId, ObjectChange, PendingSync, SignedMessage, Store,
    StoreError, SyncState, Trust, WriteOutcome,
};

use crate::identity::PeerIdentity;
use crate::store::{DocStore, RejectReason};

/// Largest number of queued view changes before the queue is dropped (see the module docs).
pub const MAX_QUEUED_CHANGES: usize = 4_000_000;

/// See the module docs.
pub struct MeshStore {
    store: Store,
    queue: Vec<(String, ObjectChange)>,
    track_changes: bool,
    overflowed: bool,
}

fn reject(e: StoreError) -> RejectReason {
    match e {
        StoreError::ForeignAuthor { .. } | StoreError::PeerNotAllowed { .. } => {
            RejectReason::Unauthorized(e.to_string())
        }
        StoreError::MalformedMessage { .. }
        | StoreError::MessageTooLarge { .. }
        | StoreError::Automerge { .. } => RejectReason::Malformed(e.to_string()),
        StoreError::FutureGeneration { .. } => RejectReason::FutureGeneration(e.to_string()),
        StoreError::BadSignature { .. } => RejectReason::BadSignature(e.to_string()),
        StoreError::RetiredCluster { .. } => RejectReason::Retired(e.to_string()),
        other => RejectReason::Store(other.to_string()),
    }
}

impl MeshStore {
    /// Wraps `store`. With `track_changes` the view changes of received sync messages are
    /// queued for [`MeshStore::drain_changes`] (replicas); without, they are dropped (agents,
    /// which hold only their own document).
    ///
    /// Received changes are group-committed ([`Store::set_group_commit`]): they become durable
    /// at [`DocStore::flush`], which the mesh node calls before it sends anything that reflects
    /// them. Code that drives a [`Protocol`](crate::protocol::Protocol) itself must call
    /// `flush` before sending the protocol's outputs.
    pub fn new(mut store: Store, track_changes: bool) -> MeshStore {
        // Turning group commit on cannot fail (only turning it off syncs).
        let _ = store.set_group_commit(true);
        MeshStore {
            store,
            queue: Vec::new(),
            track_changes,
            overflowed: false,
        }
    }

    /// See [`Store::set_clock_offset_ms`].
    pub fn set_clock_offset_ms(&mut self, offset_ms: i64) {
        self.store.set_clock_offset_ms(offset_ms);
    }

    /// Stops keeping the materialized view (see [`Store::stop_serving_view`]): for agents and
    /// cluster relays, which never read objects back.
    pub fn stop_serving_view(&mut self) {
        self.store.stop_serving_view();
    }

    /// Read access to the wrapped store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Creates or resumes the writer's own document (see [`Store::open_writer`]).
    pub fn open_writer(&mut self, doc: &DocId) -> Result<u64, StoreError> {
        self.store.open_writer(doc)
    }

    /// Starts a new generation of the writer's document (see [`Store::rollover`]).
    pub fn rollover(&mut self, doc: &DocId) -> Result<u64, StoreError> {
        self.store.rollover(doc)
    }

    /// Starts a new generation of the writer's document that asks to rejoin the fleet (see
    /// [`Store::rejoin`]).
    pub fn rejoin(&mut self, doc: &DocId) -> Result<u64, StoreError> {
        self.store.rejoin(doc)
    }

    /// Applies a burst of local changes to the writer's document in one commit.
    pub fn apply(
        &mut self,
        doc: &DocId,
        changes: Vec<ObjectChange>,
    ) -> Result<WriteOutcome, StoreError> {
        self.store.apply(doc, changes)
    }

    /// Records the writer's lease term (see [`Store::set_lease_term`]).
    pub fn set_lease_term(&mut self, doc: &DocId, term: u64) -> Result<WriteOutcome, StoreError> {
        self.store.set_lease_term(doc, term)
    }

    /// Retires a member cluster (see [`Store::retire_cluster`]); returns the visible changes
    /// to apply now, in order: the cluster's changes still queued (they came before the
    /// retirement), then what the retirement dropped. The cluster has nothing left in the
    /// queue, so a later drain cannot bring a dropped document's objects back into the view.
    pub fn retire_cluster(
        &mut self,
        cluster: &str,
        at_ms: u64,
    ) -> Result<Vec<(String, ObjectChange)>, StoreError> {
        let dropped = self.store.retire_cluster(cluster, at_ms)?;
        let (mut out, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.queue)
            .into_iter()
            .partition(|(c, _)| c == cluster);
        self.queue = rest;
        out.extend(dropped);
        Ok(out)
    }

    /// The queued view changes of received sync messages, oldest first.
    pub fn drain_changes(&mut self) -> Vec<(String, ObjectChange)> {
        std::mem::take(&mut self.queue)
    }

    /// Whether the change queue overflowed (and was cleared) since the last call.
    pub fn take_overflowed(&mut self) -> bool {
        std::mem::take(&mut self.overflowed)
    }

    /// XOR of the fingerprints of one cluster's documents (0 when it has none).
    pub fn cluster_fingerprint(&self, cluster: &str) -> u64 {
        self.store
            .entries()
            .iter()
            .filter(|e| e.doc.cluster == cluster)
            .fold(0, |acc, e| acc ^ e.fingerprint())
    }

    fn queue(&mut self, changes: Vec<(String, ObjectChange)>) {
        if !self.track_changes || changes.is_empty() {
            return;
        }
        if self.queue.len() + changes.len() > MAX_QUEUED_CHANGES {
            self.queue.clear();
            self.overflowed = true;
            return;
        }
        self.queue.extend(changes);
    }
}

impl DocStore for MeshStore {
    fn digest(&self) -> Digest {
        self.store.digest().clone()
    }

    fn bucket_entries(
        &self,
        buckets: &[u32],
        keep: &dyn Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        self.store.bucket_entries(buckets, keep)
    }

    fn entry(&self, doc: &DocId) -> Option<DocEntry> {
        self.store.entry(doc)
    }

    fn heads(&self, doc: &DocId) -> Vec<[u8; 32]> {
        self.store.heads(doc).unwrap_or_default()
    }

    fn holds_changes(&self, doc: &DocId, generation: u64, heads: &[[u8; 32]]) -> bool {
        self.store.holds_changes(doc, generation, heads)
    }

    fn cluster_digest(&self, cluster: &str) -> Digest {
        self.store.cluster_digest(cluster)
    }

    fn cluster_bucket_entries(
        &self,
        cluster: &str,
        buckets: &[u32],
        keep: &dyn Fn(&DocId) -> bool,
    ) -> Vec<(u32, DocEntry)> {
        self.store.cluster_bucket_entries(cluster, buckets, keep)
    }

    fn generate_sync_message(
        &mut self,
        doc: &DocId,
        state: &mut SyncState,
    ) -> Option<SignedMessage> {
        let generation = self.store.entry(doc)?.generation;
        let out = match self
            .store
            .generate_signed_sync_message(doc, generation, state)
        {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(%doc, generation, error = %e, "cannot generate sync message");
                None
            }
        };
        let undelivered = self.store.take_undelivered();
        self.queue(undelivered);
        out
    }

    fn receive_sync_message(
        &mut self,
        from: &PeerIdentity,
        doc: &DocId,
        generation: u64,
        state: &mut SyncState,
        msg: &[u8],
        signed: Option<&Attestation>,
    ) -> Result<(), RejectReason> {
        if let Some(e) = self.store.entry(doc)
            && e.generation > generation
        {
            return Err(RejectReason::StaleGeneration {
                have: e.generation,
                got: generation,
            });
        }
        let may_deliver = |d: &DocId| crate::store::may_deliver(from, d);
        match self.store.receive_signed_sync_message(
            doc,
            generation,
            state,
            msg,
            dramesh_store::Proof {
                signed,
                from_writer: from.owns(doc),
            },
            &may_deliver,
        ) {
            Ok(changes) => {
                self.queue(changes);
                Ok(())
            }
            Err(e) => {
                // Changes computed before a persistence failure are still real.
                let undelivered = self.store.take_undelivered();
                self.queue(undelivered);
                Err(reject(e))
            }
        }
    }

    fn set_trust(&mut self, trust: Trust) {
        self.store.set_trust(trust);
    }

    fn flush(&mut self) -> Result<(), RejectReason> {
        self.store.sync_pending().map(|_| ()).map_err(reject)
    }

    fn begin_flush(&mut self) -> Result<Option<PendingSync>, RejectReason> {
        self.store.begin_sync().map_err(reject)
    }

    fn complete_flush(
        &mut self,
        sync: PendingSync,
        result: Result<(), StoreError>,
    ) -> Result<(), RejectReason> {
        self.store
            .complete_sync(sync, result)
            .map(|_| ())
            .map_err(reject)
    }

    fn maintain(&mut self) {
        if let Err(e) = self.store.maintain_deferred() {
            // The copy stays as it is (valid, just larger); its next change queues it again.
            tracing::warn!(error = %e, "deferred compaction failed");
        }
    }

    fn drop_copies(&mut self) -> usize {
        match self.store.drop_copies() {
            Ok((changes, dropped)) => {
                self.queue(changes);
                dropped
            }
            Err(e) => {
                tracing::error!(error = %e, "could not drop the documents this agent relayed");
                0
            }
        }
    }

    fn recover_generation(&mut self, doc: &DocId) -> Option<u64> {
        match self.store.recover_generation(doc) {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(%doc, error = %e, "could not start a new generation after a clock fault");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{ConnId, Output, Protocol, ProtocolConfig};
    use dramesh_store::{Durability, ObjectKey, ObjectKind, StoreConfig};
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn mem() -> Store {
        Store::in_memory(StoreConfig {
            durability: Durability::None,
            ..StoreConfig::default()
        })
    }

    fn node(name: &str, label: &str) -> ObjectChange {
        let json = format!(
            r#"{{"apiVersion":"v1","kind":"Node","metadata":{{"name":"{name}","labels":{{"x":"{label}"}}}}}}"#
        );
        ObjectChange::Upsert {
            key: ObjectKey::new(ObjectKind::Node, None, name),
            json: Arc::from(json.into_bytes().into_boxed_slice()),
        }
    }

    struct Peer {
        proto: Protocol,
        store: MeshStore,
        conn: ConnId,
    }

    /// An agent with `agent_store` (connection 1) and a replica with an empty store
    /// (connection 2), both running `cfg()`.
    fn agent_and_replica(
        agent: &PeerIdentity,
        replica: &PeerIdentity,
        agent_store: MeshStore,
        cfg: impl Fn() -> ProtocolConfig,
    ) -> [Peer; 2] {
        [
            Peer {
                proto: Protocol::new(agent.clone(), cfg()),
                store: agent_store,
                conn: ConnId(1),
            },
            Peer {
                proto: Protocol::new(replica.clone(), cfg()),
                store: MeshStore::new(mem(), true),
                conn: ConnId(2),
            },
        ]
    }

    /// Connects the agent (`peers[0]`, `agent`) and the replica (`peers[1]`, `replica`):
    /// the frames both sides send first.
    fn connect(
        peers: &mut [Peer; 2],
        agent: &PeerIdentity,
        replica: &PeerIdentity,
        now: Instant,
    ) -> VecDeque<(usize, Output)> {
        let (a, b) = peers.split_at_mut(1);
        let first = a[0].proto.on_connected(ConnId(1), replica.clone(), now);
        let second = b[0].proto.on_connected(ConnId(2), agent.clone(), now);
        first
            .into_iter()
            .map(|o| (0, o))
            .chain(second.into_iter().map(|o| (1, o)))
            .collect()
    }

    /// Delivers frames between the peers until nothing is in flight; returns the Applied
    /// outputs seen per peer.
    fn run(peers: &mut [Peer; 2], mut outs: VecDeque<(usize, Output)>, now: Instant) -> [usize; 2] {
        let mut applied = [0, 0];
        let mut steps = 0;
        while let Some((from, out)) = outs.pop_front() {
            steps += 1;
            assert!(steps < 10_000, "protocol did not settle");
            match out {
                Output::Send { envelope, .. } => {
                    let to = 1 - from;
                    let p = &mut peers[to];
                    let conn = p.conn;
                    for o in p.proto.handle_frame(&mut p.store, conn, envelope, now) {
                        outs.push_back((to, o));
                    }
                }
                Output::Applied { .. } => applied[from] += 1,
                Output::Close { reason, .. } => panic!("connection closed: {reason}"),
            }
        }
        applied
    }

    #[test]
    fn agent_and_replica_converge_and_queue_changes() {
        let agent_id = PeerIdentity::Agent {
            cluster: "east".into(),
            node: dramesh_store::CLUSTER_PUBLISHER.into(),
        };
        let replica_id = PeerIdentity::Replica { id: "r1".into() };
        let cfg = || ProtocolConfig {
            jitter_seed: 3,
            anti_entropy_interval: Duration::from_secs(60),
            ..ProtocolConfig::default()
        };
        let doc = DocId::new("east", dramesh_store::CLUSTER_PUBLISHER);
        let mut agent_store = MeshStore::new(mem(), false);
        agent_store.open_writer(&doc).unwrap();
        agent_store
            .apply(&doc, vec![node("n1", "a"), node("n2", "a")])
            .unwrap();
        let mut peers = agent_and_replica(&agent_id, &replica_id, agent_store, cfg);
        assert_ne!(peers[0].store.digest(), peers[1].store.digest());
        let now = Instant::now();
        let outs = connect(&mut peers, &agent_id, &replica_id, now);
        let applied = run(&mut peers, outs, now);
        assert!(applied[1] >= 1, "replica applied nothing");
        assert_eq!(peers[0].store.digest(), peers[1].store.digest());
        assert_eq!(
            peers[0].store.cluster_fingerprint("east"),
            peers[1].store.cluster_fingerprint("east")
        );
        let mut got: Vec<String> = peers[1]
            .store
            .drain_changes()
            .into_iter()
            .map(|(c, ch)| format!("{c}:{}", ch.key().name))
            .collect();
        got.sort();
        assert_eq!(got, ["east:n1", "east:n2"]);
        assert!(peers[1].store.drain_changes().is_empty());

        // An update and a delete are pushed and queued as exactly those changes.
        let outcome = peers[0]
            .store
            .apply(
                &doc,
                vec![
                    node("n1", "b"),
                    ObjectChange::Delete {
                        key: ObjectKey::new(ObjectKind::Node, None, "n2"),
                    },
                ],
            )
            .unwrap();
        assert_eq!(outcome.view.len(), 2);
        let (a, _) = peers.split_at_mut(1);
        let docref = DocId::new("east", dramesh_store::CLUSTER_PUBLISHER);
        let outs: VecDeque<(usize, Output)> = a[0]
            .proto
            .on_local_change(&mut a[0].store, &docref)
            .into_iter()
            .map(|o| (0, o))
            .collect();
        run(&mut peers, outs, now);
        assert_eq!(peers[0].store.digest(), peers[1].store.digest());
        let changes = peers[1].store.drain_changes();
        assert_eq!(changes.len(), 2, "{changes:?}");
        for (cluster, ch) in &changes {
            assert_eq!(cluster, "east");
            match ch {
                ObjectChange::Upsert { key, json } => {
                    assert_eq!(key.name, "n1");
                    assert!(std::str::from_utf8(json).unwrap().contains(r#""x":"b""#));
                }
                ObjectChange::Delete { key } => assert_eq!(key.name, "n2"),
            }
        }
        let e = peers[1].store.entry(&docref).unwrap();
        assert_eq!(Some(e), peers[0].store.entry(&docref));
    }

    /// Changes of a cluster received but not yet drained when the cluster is retired come
    /// back from the retirement ahead of its deletes, and leave the queue: a drain after the
    /// retirement (the replica's feed, racing an API retirement) cannot list the cluster again.
    #[test]
    fn retiring_a_cluster_hands_back_its_queued_changes_before_its_deletes() {
        let agent_id = PeerIdentity::Agent {
            cluster: "east".into(),
            node: dramesh_store::CLUSTER_PUBLISHER.into(),
        };
        let replica_id = PeerIdentity::Replica { id: "r1".into() };
        let cfg = || ProtocolConfig {
            jitter_seed: 5,
            anti_entropy_interval: Duration::from_secs(60),
            ..ProtocolConfig::default()
        };
        let doc = DocId::new("east", dramesh_store::CLUSTER_PUBLISHER);
        let mut agent_store = MeshStore::new(mem(), false);
        agent_store.open_writer(&doc).unwrap();
        agent_store.apply(&doc, vec![node("n1", "a")]).unwrap();
        let mut peers = agent_and_replica(&agent_id, &replica_id, agent_store, cfg);
        let now = Instant::now();
        let outs = connect(&mut peers, &agent_id, &replica_id, now);
        run(&mut peers, outs, now);
        // Queued, not drained, when the retirement (later than any generation) comes.
        let got: Vec<String> = peers[1]
            .store
            .retire_cluster("east", u64::MAX / 2)
            .unwrap()
            .into_iter()
            .map(|(c, ch)| {
                let op = match ch {
                    ObjectChange::Upsert { .. } => "upsert",
                    ObjectChange::Delete { .. } => "delete",
                };
                format!("{c}:{op}:{}", ch.key().name)
            })
            .collect();
        assert_eq!(got, ["east:upsert:n1", "east:delete:n1"]);
        assert!(peers[1].store.drain_changes().is_empty());
    }

    #[test]
    fn chaos_switches_silence_push_and_probes() {
        let agent_id = PeerIdentity::Agent {
            cluster: "east".into(),
            node: "a".into(),
        };
        let replica_id = PeerIdentity::Replica { id: "r1".into() };
        let doc = DocId::new("east", "a");
        let mut store = MeshStore::new(mem(), false);
        store.open_writer(&doc).unwrap();
        store.apply(&doc, vec![node("n1", "a")]).unwrap();
        let now = Instant::now();
        for (push, anti_entropy) in [(false, true), (true, false)] {
            let mut p = Protocol::new(
                agent_id.clone(),
                ProtocolConfig {
                    push,
                    anti_entropy,
                    jitter_seed: 1,
                    ..ProtocolConfig::default()
                },
            );
            p.on_connected(ConnId(1), replica_id.clone(), now);
            let hello = crate::wire::envelope(crate::wire::pb::envelope::Body::Hello(
                crate::wire::pb::Hello {
                    protocol_version: crate::protocol::PROTOCOL_VERSION,
                    role: crate::wire::pb::Role::Replica as i32,
                    identity: replica_id.uri(),
                    advertise_addr: String::new(),
                    relay: false,
                    ..Default::default()
                },
            ));
            let on_hello = p.handle_frame(&mut store, ConnId(1), hello, now);
            let probes = on_hello
                .iter()
                .filter(|o| matches!(o, Output::Send { envelope, .. } if matches!(envelope.body, Some(crate::wire::pb::envelope::Body::Digest(_)))))
                .count();
            assert_eq!(probes, usize::from(anti_entropy), "push={push}");
            let pushed = p.on_local_change(&mut store, &DocId::new("east", "a"));
            assert_eq!(!pushed.is_empty(), push, "push={push}");
            let later = p.on_tick(&mut store, now + Duration::from_secs(60));
            let probes = later
                .iter()
                .filter(|o| matches!(o, Output::Send { envelope, .. } if matches!(envelope.body, Some(crate::wire::pb::envelope::Body::Digest(_)))))
                .count();
            assert_eq!(probes, usize::from(anti_entropy), "tick, push={push}");
        }
    }

    #[test]
    fn coalesced_pushes_send_one_message_per_peer_and_document() {
        let agent_id = PeerIdentity::Agent {
            cluster: "east".into(),
            node: "a".into(),
        };
        let replica_id = PeerIdentity::Replica { id: "r1".into() };
        let doc = DocId::new("east", "a");
        let docref = DocId::new("east", "a");
        let mut store = MeshStore::new(mem(), false);
        store.open_writer(&doc).unwrap();
        let now = Instant::now();
        let mut p = Protocol::new(
            agent_id,
            ProtocolConfig {
                jitter_seed: 1,
                anti_entropy: false,
                ..ProtocolConfig::default()
            },
        );
        p.set_coalesce_pushes(true);
        p.on_connected(ConnId(1), replica_id.clone(), now);
        let hello = crate::wire::envelope(crate::wire::pb::envelope::Body::Hello(
            crate::wire::pb::Hello {
                protocol_version: crate::protocol::PROTOCOL_VERSION,
                role: crate::wire::pb::Role::Replica as i32,
                identity: replica_id.uri(),
                advertise_addr: String::new(),
                relay: false,
                ..Default::default()
            },
        ));
        p.handle_frame(&mut store, ConnId(1), hello, now);
        for i in 0..3 {
            store
                .apply(&doc, vec![node(&format!("n{i}"), "a")])
                .unwrap();
            assert!(p.on_local_change(&mut store, &docref).is_empty());
        }
        assert!(p.has_deferred_pushes());
        let sends = p.flush_pushes(&mut store);
        assert_eq!(sends.len(), 1, "{sends:?}");
        assert!(matches!(
            &sends[0],
            Output::Send {
                conn: ConnId(1),
                ..
            }
        ));
        assert!(!p.has_deferred_pushes());
        assert!(p.flush_pushes(&mut store).is_empty());
    }

    /// Issue 14 item 8, sans I/O: a writer whose clock runs 300 days ahead is refused; the
    /// replica marks the session refused and tells the writer why (a typed Refusal); the
    /// writer keeps its generation while its clock still believes it, and once its clock is
    /// right the next refusal makes it start a new generation, which the replica takes.
    #[test]
    fn refused_writer_is_told_why_and_recovers_once_its_clock_is_right() {
        const DAY_MS: i64 = 24 * 3600 * 1000;
        let agent_id = PeerIdentity::Agent {
            cluster: "east".into(),
            node: "n1".into(),
        };
        let replica_id = PeerIdentity::Replica { id: "r1".into() };
        let cfg = || ProtocolConfig {
            jitter_seed: 3,
            anti_entropy_interval: Duration::from_secs(2),
            ack_delay: Duration::ZERO,
            ..ProtocolConfig::default()
        };
        let doc = DocId::new("east", "n1");
        let mut ahead = Store::in_memory(StoreConfig {
            durability: Durability::None,
            clock_offset_ms: 300 * DAY_MS,
            ..StoreConfig::default()
        });
        let bad = ahead.open_writer(&doc).unwrap();
        let mut agent_store = MeshStore::new(ahead, false);
        agent_store.apply(&doc, vec![node("n1", "a")]).unwrap();
        let mut peers = agent_and_replica(&agent_id, &replica_id, agent_store, cfg);
        let now = Instant::now();
        let outs = connect(&mut peers, &agent_id, &replica_id, now);
        let applied = run(&mut peers, outs, now);
        assert_eq!(applied[1], 0);
        assert_eq!(peers[1].store.entry(&doc), None);
        let session = &peers[1].proto.sessions()[0];
        let why = session
            .refused
            .clone()
            .expect("the writer's session is marked refused");
        assert!(why.contains("more than 30 days in the future"), "{why}");
        assert_eq!(peers[1].proto.counters().refusals_sent, 1);
        let c = peers[0].proto.counters();
        assert_eq!(c.refusals_received, 1);
        assert_eq!(
            c.generation_recoveries, 0,
            "its own clock still believes it"
        );
        assert_eq!(peers[0].store.entry(&doc).unwrap().generation, bad);

        // The clock is corrected. At the next anti-entropy round the replica refuses again,
        // and this time the writer recovers.
        peers[0].store.set_clock_offset_ms(0);
        let later = now + Duration::from_secs(11);
        let outs: VecDeque<(usize, Output)> = {
            let p = &mut peers[0];
            p.proto
                .on_tick(&mut p.store, later)
                .into_iter()
                .map(|o| (0, o))
                .collect()
        };
        let applied = run(&mut peers, outs, later);
        assert!(applied[1] >= 1, "the replica took the new generation");
        let c = peers[0].proto.counters();
        assert_eq!(c.refusals_received, 2);
        assert_eq!(c.generation_recoveries, 1);
        let good = peers[0].store.entry(&doc).unwrap();
        assert!(good.generation < bad);
        assert_eq!(peers[1].store.entry(&doc), Some(good));
        assert_eq!(peers[1].proto.sessions()[0].refused, None);
        let got: Vec<String> = peers[1]
            .store
            .drain_changes()
            .into_iter()
            .map(|(c, ch)| format!("{c}:{}", ch.key().name))
            .collect();
        assert_eq!(got, ["east:n1"], "the data written while ahead arrives");
    }

    #[test]
    fn older_generation_is_refused_as_stale() {
        let doc = DocId::new("east", "w");
        let mut s = MeshStore::new(mem(), true);
        let generation = s.open_writer(&doc).unwrap();
        let from = PeerIdentity::Replica { id: "r".into() };
        let mut state = SyncState::new();
        let err = s
            .receive_sync_message(
                &from,
                &DocId::new("east", "w"),
                generation - 1,
                &mut state,
                &[],
                None,
            )
            .unwrap_err();
        assert!(matches!(err, RejectReason::StaleGeneration { .. }), "{err}");
    }
}
