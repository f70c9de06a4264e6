//! Cost of the nesting pre-scan against the parse it guards: the largest real fixture (a
//! Karmada ResourceBinding CRD, 117 KB, 26 levels) scanned and fully loaded, and a
//! 100,000-level hostile file refused. Without ../shared the real-fixture case is skipped.

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, criterion_group, criterion_main};
use dramesh_model::depth::{MAX_DEPTH, check_depth};
use dramesh_model::load::load_str;

fn bench(c: &mut Criterion) {
    let real = dramesh_testkit::fixtures_dir(dramesh_testkit::KARMADA_CRDS)
        .unwrap_or_default()
        .join("work.karmada.io_resourcebindings.yaml");
    match std::fs::read_to_string(&real) {
        Ok(text) => {
            c.bench_function("depth_scan_real_117KB", |b| {
                b.iter(|| check_depth(black_box(&text), MAX_DEPTH))
            });
            c.bench_function("load_str_real_117KB", |b| {
                b.iter(|| load_str(&real, black_box(&text)).is_ok())
            });
        }
        Err(_) => eprintln!("skipping the real fixture: {} is absent", real.display()),
    }
    let hostile = format!("a: {}", "[".repeat(100_000));
    c.bench_function("load_str_refuses_100k_levels", |b| {
        b.iter(|| load_str(Path::new("deep.yaml"), black_box(&hostile)).is_err())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
