//! Replica-side cost of applying incoming sync batches: "apply a 10-change sync batch to a
//! 5,000-key document". A writer store holds one cluster document of 5,000 node records
//! (~600 bytes each) that a replica store already has; each measured iteration is the
//! replica's `receive_sync_message` for one message carrying 10 new single-key commits (and,
//! for the per-message fixed cost, one carrying a single commit). The
//! writes, the message generation and the replica's acknowledgement round trip run outside
//! the measurement.
//!
//! The history is kept as long as the default [`RolloverPolicy`] lets it grow on a 5,000-key
//! document (a writer rolls over once operations exceed twice the keys, i.e. after ~5,000
//! single-key updates): the pair is rebuilt, outside the measurement, once it holds
//! [`HISTORY_MAX`] updates, so iterations sample histories from 1 to 5,000 changes. Receiving
//! a sync message costs more the longer the history (automerge walks the change graph).
//!
//! The "without a view" variants apply the same messages to a store that stopped serving the
//! view ([`Store::stop_serving_view`], as agents and cluster relays run): the difference is what
//! computing the visible changes costs per message.
//!
//! Run: `cargo bench -p dramesh-store --bench sync_apply`

use criterion::{Criterion, criterion_group, criterion_main};
use dramesh_store::{
    CLUSTER_PUBLISHER, DocId, Durability, ObjectChange, ObjectKey, ObjectKind, RolloverPolicy,
    Store, StoreConfig, SyncState,
};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEYS: u64 = 5_000;
/// Updates after which a writer under the default rollover policy starts a new generation.
const HISTORY_MAX: u64 = KEYS;

fn node_json(i: u64, rev: u64) -> Arc<[u8]> {
    let s = format!(
        concat!(
            r#"{{"metadata":{{"name":"node-{i:05}","labels":{{"kubernetes.io/hostname":"node-{i:05}","#,
            r#""topology.kubernetes.io/zone":"zone-{z}","nvidia.com/gpu.product":"H100-SXM5-80GB"}},"#,
            r#""resourceVersion":"{rev}"}},"spec":{{"providerID":"cloud://region-1/i-{i:012}"}},"#,
            r#""status":{{"allocatable":{{"cpu":"190","memory":"{mem}Ki","pods":"110","nvidia.com/gpu":"8"}},"#,
            r#""capacity":{{"cpu":"192","memory":"2063937Mi","pods":"110"}},"#,
            r#""conditions":[{{"type":"Ready","status":"True"}}],"nodeInfo":{{"kubeletVersion":"v1.36.0","#,
            r#""containerRuntimeVersion":"containerd://2.1.0","architecture":"amd64"}}}}}}"#
        ),
        i = i,
        z = i % 3,
        rev = rev,
        mem = 2_000_000_000u64 + (rev * 7919) % 1_000_000,
    );
    Arc::from(s.as_bytes())
}

fn key(i: u64) -> ObjectKey {
    ObjectKey {
        kind: ObjectKind::Node,
        namespace: None,
        name: format!("node-{i:05}"),
    }
}

fn config() -> StoreConfig {
    StoreConfig {
        durability: Durability::None,
        // No rollover or compaction during the run: every iteration applies onto the same
        // generation and measures only the apply.
        rollover: RolloverPolicy {
            max_stored_ratio: f64::MAX,
            max_compacted_ratio: f64::MAX,
            max_ops_ratio: f64::MAX,
            min_stored_bytes: u64::MAX,
            max_changes: u64::MAX,
            ..RolloverPolicy::default()
        },
        ..StoreConfig::default()
    }
}

struct Pair {
    writer: Store,
    replica: Store,
    doc: DocId,
    generation: u64,
    w_state: SyncState,
    r_state: SyncState,
    rev: u64,
}

impl Pair {
    /// A pair whose replica serves the view (`view`) or not.
    fn with_view(view: bool) -> Pair {
        let mut p = Pair::new();
        if !view {
            p.replica.stop_serving_view();
        }
        p
    }

    fn new() -> Pair {
        // The cluster's publisher may write every record (a node's writer only its node's:
        // under writer scopes a node writer's 5,000 Nodes would not be visible at all).
        let doc = DocId::new("cluster-0", CLUSTER_PUBLISHER);
        let mut writer = Store::in_memory(config());
        let generation = writer.open_writer(&doc).expect("open writer");
        let all: Vec<ObjectChange> = (0..KEYS)
            .map(|i| ObjectChange::Upsert {
                key: key(i),
                json: node_json(i, 0),
            })
            .collect();
        writer.apply(&doc, all).expect("initial write");
        let mut p = Pair {
            writer,
            replica: Store::in_memory(config()),
            doc,
            generation,
            w_state: SyncState::new(),
            r_state: SyncState::new(),
            rev: 1,
        };
        p.settle();
        p
    }

    /// Exchanges messages until neither side has anything to send.
    fn settle(&mut self) {
        for _ in 0..16 {
            let mut progressed = false;
            if let Some(m) = self
                .writer
                .generate_sync_message(&self.doc, self.generation, &mut self.w_state)
                .expect("writer message")
            {
                self.replica
                    .receive_sync_message(
                        &self.doc,
                        self.generation,
                        &mut self.r_state,
                        &m,
                        &|_| true,
                    )
                    .expect("replica receive");
                progressed = true;
            }
            if let Some(m) = self
                .replica
                .generate_sync_message(&self.doc, self.generation, &mut self.r_state)
                .expect("replica message")
            {
                self.writer
                    .receive_sync_message(
                        &self.doc,
                        self.generation,
                        &mut self.w_state,
                        &m,
                        &|_| true,
                    )
                    .expect("writer receive");
                progressed = true;
            }
            if !progressed {
                return;
            }
        }
    }

    /// Writes `batch` single-key commits and returns the writer's sync message carrying them.
    fn next_batch(&mut self, batch: u64) -> Vec<u8> {
        for _ in 0..batch {
            let i = (self.rev * 7_919) % KEYS;
            let change = ObjectChange::Upsert {
                key: key(i),
                json: node_json(i, self.rev),
            };
            self.writer.apply(&self.doc, vec![change]).expect("write");
            self.rev += 1;
        }
        self.writer
            .generate_sync_message(&self.doc, self.generation, &mut self.w_state)
            .expect("writer message")
            .expect("writer has new changes to send")
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("replica_receive");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(10));
    for (batch, view, name) in [
        (
            10,
            true,
            "apply a 10-change sync batch to a 5,000-key document",
        ),
        (
            1,
            true,
            "apply a 1-change sync batch to a 5,000-key document",
        ),
        (
            1,
            false,
            "apply a 1-change sync batch to a 5,000-key document without a view",
        ),
    ] {
        let mut pair = Pair::with_view(view);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if pair.rev > HISTORY_MAX {
                        pair = Pair::with_view(view);
                    }
                    let msg = pair.next_batch(batch);
                    let start = Instant::now();
                    let changes = pair
                        .replica
                        .receive_sync_message(
                            &pair.doc,
                            pair.generation,
                            &mut pair.r_state,
                            &msg,
                            &|_| true,
                        )
                        .expect("replica receive");
                    total += start.elapsed();
                    let want = if view { batch } else { 0 };
                    assert_eq!(changes.len() as u64, want, "visible changes");
                    black_box(changes);
                    pair.settle();
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
