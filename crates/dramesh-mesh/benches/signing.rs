//! Cost of signed heads: a writer signing one statement, and a replica verifying one whose
//! signer chain it verified before (the steady case: the chain's verdict is cached) or for the
//! first time (chain against the CA, identity, signature).
//!
//! Run: `cargo bench -p dramesh-mesh --bench signing`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use dramesh_mesh::PeerIdentity;
use dramesh_mesh::certs;
use dramesh_mesh::signing::{MeshSigner, MeshVerifier};
use dramesh_store::{DocId, HeadsSigner as _, HeadsVerifier as _, attest};

fn bench(c: &mut Criterion) {
    let ca = certs::generate_ca("bench CA", 1).expect("CA");
    let id = PeerIdentity::Agent {
        cluster: "c1".into(),
        node: "n1".into(),
    };
    let tls = certs::issue_identity(&ca, &id, 1).expect("identity");
    let doc = DocId::new("c1", "n1");
    let statement = attest::statement(&doc, 1_700_000_000_000, &[[7; 32]]);
    let signer = MeshSigner::new(&tls).expect("signer");
    let chain = signer.signer();
    let signature = signer.sign(&statement).expect("sign");
    let warm = MeshVerifier::new(&tls.ca_certs).expect("verifier");
    warm.verify(&doc, &statement, &signature, &chain)
        .expect("verifies");
    let mut g = c.benchmark_group("signed_heads");
    g.bench_function("sign", |b| {
        b.iter(|| signer.sign(black_box(&statement)).expect("sign"))
    });
    g.bench_function("verify (chain cached)", |b| {
        b.iter(|| {
            warm.verify(&doc, black_box(&statement), &signature, &chain)
                .expect("verifies")
        })
    });
    g.bench_function("verify (chain first seen)", |b| {
        b.iter_batched(
            || MeshVerifier::new(&tls.ca_certs).expect("verifier"),
            |cold| {
                cold.verify(&doc, black_box(&statement), &signature, &chain)
                    .expect("verifies")
            },
            criterion::BatchSize::SmallInput,
        )
    });
    g.finish();
    println!(
        "signer chain {} bytes, signature {} bytes",
        chain.len(),
        signature.len()
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
