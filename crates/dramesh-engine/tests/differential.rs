//! Pruned against unpruned search on seeded random inventories and pods: wherever the
//! unpruned search finishes within its budget, both give the identical outcome (the same
//! devices, shares, configs and node selectors, the same reason or error), and the pruned
//! search never takes more steps.
//!
//! `DRAMESH_DIFF_SEEDS=N` runs N instances instead of the default. The ignored test
//! `budget_exhaustion_share` measures how many random instances (up to 64 devices and 8
//! requests) exhaust the default 1,000,000-step budget with and without pruning:
//! `cargo test --release -p dramesh-engine --test differential -- --ignored --nocapture`.

use dramesh_engine::{AllocatedState, Inventory, NodeInfo, Options, Outcome, allocate_with_steps};
use dramesh_model::k8s;
use serde_json::{Value, json};

/// splitmix64: small, seedable, good enough to spread cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability `pct` percent.
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

fn from<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).expect("generated object decodes")
}

const GPU: &str = "gpu.example.com";
const NIC: &str = "nic.example.com";

/// One random pod on node-1: slices, devices already allocated, claims.
struct Instance {
    slices: Vec<k8s::ResourceSlice>,
    state: AllocatedState,
    claims: Vec<k8s::ResourceClaim>,
}

/// The inventory every instance is loaded into: the classes stay, so their selectors are
/// compiled once.
fn inventory() -> Inventory {
    Inventory::from_objects([], &classes(), []).expect("classes")
}

/// Replaces the previous instance's slices with `inst`'s.
fn load(inv: &mut Inventory, inst: &Instance) {
    for name in ["gpus", "gpu-counters", "nics"] {
        inv.remove_slice(name);
    }
    for s in &inst.slices {
        inv.upsert_slice(s).expect("generated slice");
    }
}

fn classes() -> Vec<k8s::DeviceClass> {
    let class = |name: &str, expr: Option<&str>| -> k8s::DeviceClass {
        let selectors: Vec<Value> = expr
            .map(|e| json!({"cel": {"expression": e}}))
            .into_iter()
            .collect();
        from(json!({"metadata": {"name": name}, "spec": {"selectors": selectors}}))
    };
    vec![
        class("gpu", Some(&format!("device.driver == \"{GPU}\""))),
        class("nic", Some(&format!("device.driver == \"{NIC}\""))),
        class("any", None),
        // Errors at run time on devices without a memory capacity (NICs).
        class(
            "big",
            Some(&format!(
                "device.capacity[\"{GPU}\"].memory.compareTo(quantity(\"40Gi\")) >= 0"
            )),
        ),
    ]
}

fn instance(seed: u64, max_devices: u64, max_requests: u64) -> Instance {
    let mut rng = Rng(seed);
    let numa_values = 1 + rng.below(4);
    let roots = 1 + rng.below(4);
    let counters = rng.chance(25);
    let multi = rng.chance(20);
    let gpus = 1 + rng.below(max_devices.max(2) - 1);
    let nics = rng.below(max_devices - gpus + 1);
    let sets = 1 + rng.below(4);
    let mut devices = Vec::new();
    let mut names = Vec::new();
    for i in 0..gpus {
        let mut attrs = serde_json::Map::new();
        if !rng.chance(5) {
            attrs.insert("numa".into(), json!({"int": rng.below(numa_values)}));
        }
        if !rng.chance(5) {
            attrs.insert(
                "resource.kubernetes.io/pcieRoot".into(),
                json!({"string": format!("pci{}", rng.below(roots))}),
            );
        }
        let model = ["a100", "h100"][rng.below(2) as usize];
        attrs.insert("model".into(), json!({ "string": model }));
        let mem = [10, 20, 40, 80][rng.below(4) as usize];
        let mut dev = json!({"name": format!("gpu-{i}"), "attributes": attrs,
            "capacity": {"memory": {"value": format!("{mem}Gi")}}});
        if counters {
            dev["consumesCounters"] = json!([{"counterSet": format!("set-{}", i % sets),
                "counters": {"memory": {"value": format!("{mem}Gi")}}}]);
        }
        if rng.chance(8) {
            let effect = ["NoSchedule", "NoExecute", "None"][rng.below(3) as usize].to_string();
            dev["taints"] = json!([{"key": "broken", "value": "yes", "effect": effect}]);
        }
        if multi && rng.chance(50) {
            dev["allowMultipleAllocations"] = json!(true);
            dev["capacity"]["bw"] = json!({"value": "100",
                "requestPolicy": {"default": "10", "validRange": {"min": "10", "step": "10"}}});
        }
        devices.push(dev);
        names.push((GPU, format!("gpu-{i}")));
    }
    let mut nic_devices = Vec::new();
    for i in 0..nics {
        let mut attrs = serde_json::Map::new();
        attrs.insert(
            "resource.kubernetes.io/pcieRoot".into(),
            json!({"string": format!("pci{}", rng.below(roots))}),
        );
        if rng.chance(70) {
            attrs.insert("numa".into(), json!({"int": rng.below(numa_values)}));
        }
        nic_devices.push(json!({"name": format!("nic-{i}"), "attributes": attrs}));
        names.push((NIC, format!("nic-{i}")));
    }
    let mut slices: Vec<k8s::ResourceSlice> = Vec::new();
    let count = if counters { 2 } else { 1 };
    slices.push(from(
        json!({"metadata": {"name": "gpus"}, "spec": {"driver": GPU,
        "nodeName": "node-1", "pool": {"name": "node-1", "generation": 1,
        "resourceSliceCount": count}, "devices": devices}}),
    ));
    if counters {
        let sets: Vec<Value> = (0..sets)
            .map(|s| {
                let cap = [40, 80, 160][rng.below(3) as usize];
                json!({"name": format!("set-{s}"), "counters": {"memory": {"value": format!("{cap}Gi")}}})
            })
            .collect();
        slices.push(from(json!({"metadata": {"name": "gpu-counters"}, "spec": {
            "driver": GPU, "nodeName": "node-1", "pool": {"name": "node-1", "generation": 1,
            "resourceSliceCount": 2}, "sharedCounters": sets}})));
    }
    if nics > 0 {
        slices.push(from(
            json!({"metadata": {"name": "nics"}, "spec": {"driver": NIC,
            "nodeName": "node-1", "pool": {"name": "node-1", "generation": 1,
            "resourceSliceCount": 1}, "devices": nic_devices}}),
        ));
    }

    // Some devices are already in use.
    let mut state = AllocatedState::new();
    let busy = rng.below(40);
    for (driver, name) in &names {
        if rng.below(100) < busy {
            state.commit(&[from(json!({"devices": {"results": [{"request": "r",
                "driver": driver, "pool": "node-1", "device": name}]}}))]);
        }
    }

    let n_claims = 1 + rng.below(3);
    let mut budget = 1 + rng.below(max_requests);
    let mut claims = Vec::new();
    for ci in 0..n_claims {
        if budget == 0 {
            break;
        }
        let left = n_claims - ci;
        let n_req = if left == 1 {
            budget
        } else {
            1 + rng.below(budget.min(4))
        };
        budget -= n_req;
        claims.push(claim(&mut rng, ci, n_req, multi));
    }
    Instance {
        slices,
        state,
        claims,
    }
}

fn selector(rng: &mut Rng) -> Value {
    let exprs = [
        format!("device.attributes[\"{GPU}\"].model == \"h100\""),
        format!("device.capacity[\"{GPU}\"].memory.compareTo(quantity(\"20Gi\")) >= 0"),
        "device.driver == \"nic.example.com\" || device.driver == \"gpu.example.com\"".to_string(),
        // A runtime error on devices without the attribute.
        format!("device.attributes[\"{GPU}\"].numa == 0"),
    ];
    let pick = if rng.chance(85) { rng.below(3) } else { 3 };
    json!([{"cel": {"expression": exprs[pick as usize]}}])
}

fn exactly(rng: &mut Rng, multi: bool, sub: bool) -> Value {
    let class = match rng.below(20) {
        0..=10 => "gpu",
        11..=15 => "nic",
        16..=18 => "any",
        _ => "big",
    };
    let mut e = json!({"deviceClassName": class, "count": 1 + rng.below(5)});
    if rng.chance(4) {
        e["allocationMode"] = json!("All");
        e.as_object_mut().map(|o| o.remove("count"));
    }
    if rng.chance(20) {
        e["selectors"] = selector(rng);
    }
    if !sub && rng.chance(6) {
        e["adminAccess"] = json!(true);
    }
    if rng.chance(15) {
        e["tolerations"] = json!([{"key": "broken", "operator": "Exists"}]);
    }
    if multi && rng.chance(40) {
        e["capacity"] = json!({"requests": {"bw": format!("{}", 10 + 10 * rng.below(6))}});
    }
    e
}

fn claim(rng: &mut Rng, ci: u64, n_req: u64, multi: bool) -> k8s::ResourceClaim {
    let mut requests = Vec::new();
    for ri in 0..n_req {
        let name = format!("r{ri}");
        if rng.chance(20) {
            let subs: Vec<Value> = (0..1 + rng.below(3))
                .map(|si| {
                    let mut e = exactly(rng, multi, true);
                    e["name"] = json!(format!("s{si}"));
                    e
                })
                .collect();
            requests.push(json!({"name": name, "firstAvailable": subs}));
        } else {
            requests.push(json!({"name": name, "exactly": exactly(rng, multi, false)}));
        }
    }
    let mut constraints = Vec::new();
    for _ in 0..rng.below(3) {
        let attr = [
            format!("{GPU}/numa"),
            "resource.kubernetes.io/pcieRoot".to_string(),
            format!("{GPU}/model"),
        ][rng.below(3) as usize]
            .clone();
        let mut c = if rng.chance(70) {
            json!({"matchAttribute": attr})
        } else {
            json!({"distinctAttribute": attr})
        };
        if n_req > 1 && rng.chance(50) {
            let a = rng.below(n_req);
            let b = rng.below(n_req);
            let mut reqs = vec![format!("r{a}")];
            if b != a {
                reqs.push(format!("r{b}"));
            }
            c["requests"] = json!(reqs);
        }
        constraints.push(c);
    }
    from(
        json!({"metadata": {"name": format!("claim-{ci}"), "namespace": "default",
        "uid": format!("uid-{ci}")},
        "spec": {"devices": {"requests": requests, "constraints": constraints}}}),
    )
}

fn run(inv: &Inventory, inst: &Instance, prune: bool, max_steps: u64) -> (Outcome, u64) {
    let refs: Vec<&k8s::ResourceClaim> = inst.claims.iter().collect();
    let opts = Options {
        prune,
        max_steps,
        ..Options::default()
    };
    allocate_with_steps(inv, &inst.state, &NodeInfo::named("node-1"), &refs, &opts)
}

#[test]
fn pruned_and_unpruned_agree() {
    let seeds: u64 = std::env::var("DRAMESH_DIFF_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000);
    const BUDGET: u64 = 5_000;
    let (mut compared, mut fewer_steps, mut pruned_away) = (0u64, 0u64, 0u64);
    let mut kinds = [0u64; 4];
    let mut inv = inventory();
    // Instances outside the default range that once found a difference: (seed, devices,
    // requests).
    const REGRESSIONS: [(u64, u64, u64); 2] = [(6241, 16, 6), (609 + (1 << 32), 64, 8)];
    let regressions = REGRESSIONS.into_iter().filter(|&(s, ..)| s >= seeds);
    // Mostly small instances, whose unpruned search finishes; a quarter as many large ones.
    let small = (0..seeds).map(|s| (s, 16, 6));
    let large = (0..seeds / 4).map(|s| (s.wrapping_add(1 << 40), 64, 8));
    let total = seeds + seeds / 4;
    for (seed, devices, requests) in small.chain(large).chain(regressions) {
        let inst = instance(seed, devices, requests);
        load(&mut inv, &inst);
        let (plain, plain_steps) = run(&inv, &inst, false, BUDGET);
        if matches!(plain, Outcome::BudgetExhausted { .. }) {
            continue;
        }
        let (pruned, pruned_steps) = run(&inv, &inst, true, BUDGET);
        assert_eq!(
            pruned, plain,
            "seed {seed}: pruned search differs ({pruned_steps} vs {plain_steps} steps)"
        );
        assert!(
            pruned_steps <= plain_steps,
            "seed {seed}: pruning took more steps ({pruned_steps} > {plain_steps})"
        );
        compared += 1;
        if pruned_steps < plain_steps {
            fewer_steps += 1;
            if !plain.is_allocated() {
                pruned_away += 1;
            }
        }
        kinds[match plain {
            Outcome::Allocated(_) => 0,
            Outcome::Unsatisfiable { .. } => 1,
            Outcome::Error { .. } => 2,
            Outcome::BudgetExhausted { .. } => 3,
        }] += 1;
    }
    eprintln!(
        "{compared} of {total} compared (allocated {}, unsatisfiable {}, error {}); \
         pruning saved steps in {fewer_steps} ({pruned_away} without a fit)",
        kinds[0], kinds[1], kinds[2]
    );
    // The generator must exercise every outcome and pruning must actually cut.
    assert!(
        compared * 10 >= total * 8,
        "too few finished: {compared} of {total}"
    );
    assert!(kinds[0] > 0 && kinds[1] > 0 && kinds[2] > 0, "{kinds:?}");
    assert!(
        fewer_steps * 20 >= compared,
        "pruning rarely cut: {fewer_steps}"
    );
}

/// The share of random instances (up to 64 devices, 8 requests) that exhaust the default
/// budget, unpruned and pruned. Slow in debug builds; run with `--release`.
#[test]
#[ignore]
fn budget_exhaustion_share() {
    let seeds: u64 = std::env::var("DRAMESH_DIFF_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000);
    let budget = Options::default().max_steps;
    let (mut plain_out, mut pruned_out, mut differ) = (0u64, 0u64, 0u64);
    let mut inv = inventory();
    for seed in 0..seeds {
        let inst = instance(seed.wrapping_add(1 << 32), 64, 8);
        load(&mut inv, &inst);
        let (plain, _) = run(&inv, &inst, false, budget);
        let (pruned, _) = run(&inv, &inst, true, budget);
        let plain_gave_up = matches!(plain, Outcome::BudgetExhausted { .. });
        plain_out += u64::from(plain_gave_up);
        pruned_out += u64::from(matches!(pruned, Outcome::BudgetExhausted { .. }));
        if !plain_gave_up && pruned != plain {
            eprintln!("seed {seed}: pruned {pruned:?}, unpruned {plain:?}");
            differ += 1;
        }
    }
    println!(
        "{seeds} random instances (<= 64 devices, <= 8 requests), budget {budget} steps: \
         unpruned exhausted {plain_out} ({:.2} %), pruned exhausted {pruned_out} ({:.2} %)",
        100.0 * plain_out as f64 / seeds as f64,
        100.0 * pruned_out as f64 / seeds as f64
    );
    assert_eq!(
        differ, 0,
        "pruned answers differ from finished unpruned ones"
    );
}
