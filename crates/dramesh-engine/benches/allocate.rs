//! Allocation latency for typical and worst-case pods (criterion).
//!
//! - `one_gpu_of_8`: one GPU for a pod on a node with 8 GPUs.
//! - `4gpu_4nic_pcie_match`: 4 GPUs + 4 NICs with `matchAttribute: pcieRoot`; the first root
//!   has one GPU in use, so the search backtracks to the second root.
//! - `partitionable_64`: one partition of >= 20Gi on a node with 64 partitionable devices
//!   (8 physical GPUs x 8 partitions, shared counters), half of the GPUs partly in use.
//! - `worst_case/no_solution_numa_21_of_40`: 21 GPUs with `matchAttribute` on NUMA over 40 GPUs
//!   in two NUMA groups of 20; pruning proves "does not fit".
//! - `worst_case/unpruned_budget_1M_steps`: the same without pruning, stopped by the default
//!   step budget (the exponential proof Kubernetes' allocator also faces).

use criterion::{Criterion, criterion_group, criterion_main};
use dramesh_engine::{AllocatedState, Inventory, NodeInfo, Options, Outcome, allocate};
use dramesh_model::k8s;
use serde_json::json;

fn from<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("bench object")
}

fn class(name: &str, driver: &str) -> k8s::DeviceClass {
    from(json!({"metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{driver}\"")}}]}}))
}

fn claim(name: &str, devices: serde_json::Value) -> k8s::ResourceClaim {
    from(json!({"metadata": {"name": name, "namespace": "default"}, "spec": {"devices": devices}}))
}

fn slice(name: &str, driver: &str, devices: Vec<serde_json::Value>) -> k8s::ResourceSlice {
    from(
        json!({"metadata": {"name": name}, "spec": {"driver": driver, "nodeName": "node-1",
        "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1}, "devices": devices}}),
    )
}

fn gpu(i: usize, root: usize) -> serde_json::Value {
    json!({"name": format!("gpu-{i}"), "attributes": {
            "model": {"string": "H100"}, "index": {"int": i},
            "resource.kubernetes.io/pcieRoot": {"string": format!("pci000{root}")}},
        "capacity": {"memory": {"value": "80Gi"}}})
}

fn nic(i: usize, root: usize) -> serde_json::Value {
    json!({"name": format!("nic-{i}"), "attributes": {
        "resource.kubernetes.io/pcieRoot": {"string": format!("pci000{root}")}}})
}

fn result(driver: &str, device: &str) -> k8s::AllocationResult {
    from(json!({"devices": {"results": [
        {"request": "r", "driver": driver, "pool": "node-1", "device": device}]}}))
}

fn run(
    c: &mut Criterion,
    name: &str,
    inv: &Inventory,
    state: &AllocatedState,
    claims: &[k8s::ResourceClaim],
    opts: &Options,
    want_allocated: bool,
) {
    let node = NodeInfo::named("node-1");
    let refs: Vec<&k8s::ResourceClaim> = claims.iter().collect();
    let first = allocate(inv, state, &node, &refs, opts);
    assert_eq!(first.is_allocated(), want_allocated, "{name}: {first:?}");
    c.bench_function(name, |b| {
        b.iter(|| allocate(inv, state, &node, &refs, opts))
    });
}

fn benches(c: &mut Criterion) {
    let opts = Options::default();

    let gpus = slice(
        "gpus",
        "gpu.example.com",
        (0..8).map(|i| gpu(i, i / 4)).collect(),
    );
    let nics = slice(
        "nics",
        "nic.example.com",
        (0..8).map(|i| nic(i, i / 4)).collect(),
    );
    let classes = [
        class("gpu", "gpu.example.com"),
        class("nic", "nic.example.com"),
    ];
    let inv = Inventory::from_objects([&gpus, &nics], &classes, []).expect("inventory");

    let one = claim(
        "one",
        json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}),
    );
    run(
        c,
        "one_gpu_of_8",
        &inv,
        &AllocatedState::new(),
        &[one],
        &opts,
        true,
    );

    let mut busy = AllocatedState::new();
    busy.commit(&[result("gpu.example.com", "gpu-0")]);
    let pair = claim(
        "pair",
        json!({
        "requests": [
            {"name": "gpus", "exactly": {"deviceClassName": "gpu", "count": 4}},
            {"name": "nics", "exactly": {"deviceClassName": "nic", "count": 4}}],
        "constraints": [{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]}),
    );
    run(c, "4gpu_4nic_pcie_match", &inv, &busy, &[pair], &opts, true);

    // 8 physical GPUs with 80Gi memory counters each, 8 partitions per GPU:
    // 1 x 80Gi, 1 x 40Gi, 2 x 20Gi, 4 x 10Gi (listed largest first).
    let mut counter_sets = Vec::new();
    let mut parts = Vec::new();
    for g in 0..8 {
        counter_sets
            .push(json!({"name": format!("gpu-{g}"), "counters": {"memory": {"value": "80Gi"}}}));
        for (p, size) in [
            "80Gi", "40Gi", "20Gi", "20Gi", "10Gi", "10Gi", "10Gi", "10Gi",
        ]
        .iter()
        .enumerate()
        {
            parts.push(json!({"name": format!("gpu-{g}-part-{p}"),
                "capacity": {"memory": {"value": size}},
                "consumesCounters": [{"counterSet": format!("gpu-{g}"), "counters": {"memory": {"value": size}}}]}));
        }
    }
    let counters: k8s::ResourceSlice = from(json!({"metadata": {"name": "counters"}, "spec": {
        "driver": "gpu.example.com", "nodeName": "node-1",
        "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 2},
        "sharedCounters": counter_sets}}));
    let partitions: k8s::ResourceSlice = from(json!({"metadata": {"name": "partitions"}, "spec": {
        "driver": "gpu.example.com", "nodeName": "node-1",
        "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 2},
        "devices": parts}}));
    let pinv = Inventory::from_objects([&counters, &partitions], &classes, []).expect("inventory");
    let mut pbusy = AllocatedState::new();
    for g in 0..4 {
        pbusy.commit(&[result("gpu.example.com", &format!("gpu-{g}-part-2"))]);
    }
    let part = claim(
        "part",
        json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu",
        "selectors": [{"cel": {"expression":
            "device.capacity[\"gpu.example.com\"].memory.compareTo(quantity(\"20Gi\")) >= 0 && device.capacity[\"gpu.example.com\"].memory.compareTo(quantity(\"40Gi\")) <= 0"}}]}}]}),
    );
    run(c, "partitionable_64", &pinv, &pbusy, &[part], &opts, true);

    // 40 GPUs on two NUMA nodes (20 each); 21 with the same NUMA node do not exist, and
    // proving it takes about 2 x 2^20 steps, more than the default budget.
    let many = slice(
        "many",
        "gpu.example.com",
        (0..40)
            .map(|i| {
                json!({"name": format!("gpu-{i}"),
        "attributes": {"numa": {"int": i % 2}}})
            })
            .collect(),
    );
    let minv = Inventory::from_objects([&many], &classes, []).expect("inventory");
    let hopeless = claim(
        "hopeless",
        json!({
        "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu", "count": 21}}],
        "constraints": [{"matchAttribute": "gpu.example.com/numa"}]}),
    );
    let node = NodeInfo::named("node-1");
    let o = allocate(&minv, &AllocatedState::new(), &node, &[&hopeless], &opts);
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
    let unpruned = Options {
        prune: false,
        ..Options::default()
    };
    let o = allocate(
        &minv,
        &AllocatedState::new(),
        &node,
        &[&hopeless],
        &unpruned,
    );
    assert!(matches!(o, Outcome::BudgetExhausted { .. }), "{o:?}");
    let mut g = c.benchmark_group("worst_case");
    g.bench_function("no_solution_numa_21_of_40", |b| {
        b.iter(|| allocate(&minv, &AllocatedState::new(), &node, &[&hopeless], &opts))
    });
    g.sample_size(10);
    g.bench_function("unpruned_budget_1M_steps", |b| {
        b.iter(|| {
            allocate(
                &minv,
                &AllocatedState::new(),
                &node,
                &[&hopeless],
                &unpruned,
            )
        })
    });
    g.finish();
}

criterion_group!(allocate_benches, benches);
criterion_main!(allocate_benches);
