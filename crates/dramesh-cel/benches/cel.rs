//! Selector compile and evaluation costs: a typical DeviceClass selector plus a request
//! selector with a quantity comparison, evaluated uncached and through the result cache.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use dramesh_cel::{CelEnv, DeviceInput, Limits};
use dramesh_model::{AttrValue, QualifiedName, Quantity};

const CLASS: &str =
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'";
const REQUEST: &str = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0 && device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')";

fn device(index: i64) -> DeviceInput {
    let d = "gpu.nvidia.com";
    let mut attrs: Vec<(QualifiedName, AttrValue)> = vec![
        (
            QualifiedName::parse("type", d),
            AttrValue::String("gpu".into()),
        ),
        (QualifiedName::parse("index", d), AttrValue::Int(index)),
        (
            QualifiedName::parse("productName", d),
            AttrValue::String("NVIDIA A100-SXM4-40GB".into()),
        ),
        (
            QualifiedName::parse("resource.kubernetes.io/pcieRoot", d),
            AttrValue::String("pci0000:00".into()),
        ),
    ];
    for i in 0..8 {
        attrs.push((
            QualifiedName::parse(&format!("extra{i}"), d),
            AttrValue::Int(i),
        ));
    }
    let memory = Quantity::parse("40Gi").unwrap_or_default();
    DeviceInput::new(
        d,
        attrs,
        [(QualifiedName::parse("memory", d), memory)],
        false,
    )
}

fn bench(c: &mut Criterion) {
    let env = CelEnv::new(Limits::default());
    let mut n = 0u64;
    c.bench_function("compile class selector (cache miss)", |b| {
        b.iter_batched(
            || {
                n += 1;
                format!("{CLASS} && {n} > 0")
            },
            |expr| black_box(env.compile(&expr).is_ok()),
            BatchSize::SmallInput,
        )
    });
    let class = env.compile(CLASS).unwrap_or_else(|e| panic!("{e}"));
    let request = env.compile(REQUEST).unwrap_or_else(|e| panic!("{e}"));
    c.bench_function("compile class selector (cache hit)", |b| {
        b.iter(|| black_box(env.compile(CLASS).is_ok()))
    });
    let dev = device(0);
    let _ = env.evaluate_uncached(&class, &dev);
    c.bench_function("evaluate class selector uncached", |b| {
        b.iter(|| black_box(env.evaluate_uncached(&class, &dev)))
    });
    c.bench_function("evaluate request selector uncached", |b| {
        b.iter(|| black_box(env.evaluate_uncached(&request, &dev)))
    });
    c.bench_function("evaluate class selector cached", |b| {
        b.iter(|| black_box(env.evaluate(&class, &dev)))
    });
    c.bench_function("new device + first evaluation", |b| {
        b.iter_batched(
            || 0,
            |_| {
                let d = device(1);
                black_box(env.evaluate_uncached(&class, &d))
            },
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
