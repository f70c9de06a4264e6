//! `__load <clusters> <nodes>`: what loading a fleet of per-node documents costs a new replica,
//! without sockets. A source replica store (on disk, fsync) first takes every node writer's
//! signed document; then a new replica store, empty, loads them all from it through a pair of
//! [`Protocol`]s driven in one thread as the mesh node drives them (frames encoded and decoded,
//! the receiving store flushed after each batch, anti-entropy rounds back to back). Prints the
//! time each side's protocol spent, so a profile (`perf record` on this process) sees the
//! receiving path alone, and the per-document figure the issue's 100,000-document target needs.

use std::collections::VecDeque;

use dramesh_mesh::protocol::{ConnId, Output, Protocol, ProtocolConfig};
use dramesh_mesh::wire;
use dramesh_store::{SyncState, Trust};

use super::nodes::{identities, plan_fleet, write_plan};
use super::*;

const CONN: ConnId = ConnId(1);

pub(crate) fn load_main(args: &[String]) {
    let [clusters, nodes] = args else {
        panic!("load role needs 2 arguments: <clusters> <nodes>");
    };
    let clusters: usize = clusters.parse().expect("cluster count");
    let nodes: usize = nodes.parse().expect("node count");
    let t = Instant::now();
    let (plans, _, _) = plan_fleet(clusters, nodes);
    let ca = certs::generate_ca("load CA", 1).expect("CA");
    let ids = identities(&ca, &plans);
    let verifier: Arc<dyn dramesh_store::HeadsVerifier> =
        Arc::new(dramesh_mesh::signing::MeshVerifier::new(&ids[0].ca_certs).expect("verifier"));
    let replica = |id: &str| {
        certs::issue_identity(&ca, &PeerIdentity::Replica { id: id.into() }, 1)
            .expect("replica identity")
    };
    let (src_tls, dst_tls) = (replica("r0"), replica("r3"));
    let tmp = tempfile::tempdir().expect("temp dir");
    let open = |name: &str, tls: &certs::TlsIdentity| {
        let (store, _) = Store::open(
            tmp.path().join(name),
            StoreConfig {
                durability: Durability::Fsync,
                ..StoreConfig::default()
            },
        )
        .expect("open store");
        let mut s = MeshStore::new(store, true);
        s.set_trust(dramesh_mesh::signing::trust(tls).expect("trust"));
        s
    };
    let mut src = open("r0", &src_tls);
    for (plan, tls) in plans.iter().zip(&ids) {
        let mut w = MeshStore::new(
            Store::in_memory(StoreConfig {
                durability: Durability::None,
                ..StoreConfig::default()
            }),
            false,
        );
        w.set_trust(Trust {
            signer: Some(Arc::new(
                dramesh_mesh::signing::MeshSigner::new(tls).expect("signer"),
            )),
            verifier: verifier.clone(),
        });
        let w = Mutex::new(w);
        write_plan(&w, plan);
        let mut w = w.into_inner().expect("writer store");
        let generation = w.entry(&plan.doc).expect("written").generation;
        let (mut sw, mut ss) = (SyncState::default(), SyncState::default());
        for _ in 0..16 {
            let m1 = w.generate_sync_message(&plan.doc, &mut sw);
            if let Some((bytes, signed)) = &m1 {
                src.receive_sync_message(
                    &tls.identity,
                    &plan.doc,
                    generation,
                    &mut ss,
                    bytes,
                    signed.as_ref(),
                )
                .expect("source takes the writer's document");
            }
            // What the protocol answers for a document not held yet: an empty document's reply.
            let m2 = match src.entry(&plan.doc) {
                Some(_) => src.generate_sync_message(&plan.doc, &mut ss),
                None => ss.empty_doc_message().map(|m| (m, None)),
            };
            if let Some((bytes, signed)) = &m2 {
                w.receive_sync_message(
                    &src_tls.identity,
                    &plan.doc,
                    generation,
                    &mut sw,
                    bytes,
                    signed.as_ref(),
                )
                .expect("writer takes the answer");
            }
            if m1.is_none() && m2.is_none() {
                break;
            }
        }
    }
    src.flush().expect("flush source");
    let docs = src.store().entries().len();
    assert_eq!(
        docs,
        plans.len(),
        "the source holds every writer's document"
    );
    drop(plans);
    println!(
        "source replica holds {docs} documents ({:.1}s to build)",
        t.elapsed().as_secs_f64()
    );

    let mut dst = open("r3", &dst_tls);
    let cfg = ProtocolConfig {
        jitter_seed: 7,
        ..ProtocolConfig::default()
    };
    let mut ps = Protocol::new(src_tls.identity.clone(), cfg.clone());
    let mut pd = Protocol::new(dst_tls.identity.clone(), cfg);
    let started = Instant::now();
    // The protocols' clock: real time, moved ahead by an anti-entropy interval whenever both
    // sides are quiet, so rounds follow each other without idle waits.
    let mut skew = Duration::ZERO;
    let now = |skew: Duration| Instant::now() + skew;
    // Frames in flight: (to the new replica?, encoded frame).
    let mut wire_q: VecDeque<(bool, Vec<u8>)> = VecDeque::new();
    let (mut src_secs, mut dst_secs) = (0.0f64, 0.0f64);
    let mut rounds = 0u32;
    let mut bytes_to_dst = 0u64;
    let send = |q: &mut VecDeque<(bool, Vec<u8>)>, to_dst: bool, outs: Vec<Output>| {
        for o in outs {
            if let Output::Send { envelope, .. } = o {
                q.push_back((to_dst, wire::encode_frame(&envelope).expect("encode")));
            }
        }
    };
    let o = ps.on_connected(CONN, dst_tls.identity.clone(), now(skew));
    send(&mut wire_q, true, o);
    let o = pd.on_connected(CONN, src_tls.identity.clone(), now(skew));
    send(&mut wire_q, false, o);
    let target = src.digest().root();
    let mut last_report = Instant::now();
    loop {
        // One batch per side, as the node handles a burst of frames before flushing.
        let batch: Vec<(bool, Vec<u8>)> = wire_q.drain(..).collect();
        if batch.is_empty() {
            if dst.digest().root() == target {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(3600),
                "the new replica did not converge within an hour"
            );
            rounds += 1;
            skew += Duration::from_secs(3);
            let t0 = Instant::now();
            let o = pd.on_tick(&mut dst, now(skew));
            dst_secs += t0.elapsed().as_secs_f64();
            send(&mut wire_q, false, o);
            let t0 = Instant::now();
            let o = ps.on_tick(&mut src, now(skew));
            src_secs += t0.elapsed().as_secs_f64();
            send(&mut wire_q, true, o);
            continue;
        }
        for to_dst in [true, false] {
            let t0 = Instant::now();
            let (p, s) = if to_dst {
                (&mut pd, &mut dst)
            } else {
                (&mut ps, &mut src)
            };
            let mut held = Vec::new();
            for (_, frame) in batch.iter().filter(|(d, _)| *d == to_dst) {
                if to_dst {
                    bytes_to_dst += frame.len() as u64;
                }
                let env = wire::decode_payload(&frame[wire::FRAME_HEADER_LEN..]).expect("decode");
                held.extend(p.handle_frame(s, CONN, env, now(skew)));
            }
            if p.has_deferred_pushes() {
                held.extend(p.flush_pushes(s));
            }
            s.flush().expect("flush");
            s.maintain();
            let secs = t0.elapsed().as_secs_f64();
            if to_dst {
                dst_secs += secs;
            } else {
                src_secs += secs;
            }
            send(&mut wire_q, !to_dst, held);
        }
        if last_report.elapsed() > Duration::from_secs(10) {
            last_report = Instant::now();
            eprintln!(
                "  {:.0}s: {} of {docs} documents",
                started.elapsed().as_secs_f64(),
                dst.store().entries().len()
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "new replica loaded {docs} documents in {secs:.2}s ({:.3} ms per document; new replica {:.3} ms, source {:.3} ms per document), {rounds} anti-entropy rounds, {:.1} MB received",
        secs * 1e3 / docs as f64,
        dst_secs * 1e3 / docs as f64,
        src_secs * 1e3 / docs as f64,
        bytes_to_dst as f64 / 1e6
    );
    println!(
        "LOAD {}",
        json!({"docs": docs, "secs": secs, "dst_ms_per_doc": dst_secs * 1e3 / docs as f64,
               "src_ms_per_doc": src_secs * 1e3 / docs as f64, "rounds": rounds,
               "bytes": bytes_to_dst})
    );
}
