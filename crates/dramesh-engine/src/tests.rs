//! Engine-level tests of behaviour the conformance suite does not pin: search step counts
//! (Kubernetes' `NumAllocateOneInvocations`), the budget, replica-after-replica allocation
//! with commit/release, incremental inventory updates, taint rules, share IDs, versions.

use dramesh_model::k8s;

use crate::*;

fn yaml<T: serde::de::DeserializeOwned>(s: &str) -> T {
    serde_norway::from_str(s).expect("test YAML")
}

fn class(name: &str, driver: &str) -> k8s::DeviceClass {
    yaml(&format!(
        "metadata: {{name: {name}}}\nspec:\n  selectors:\n  - cel: {{expression: 'device.driver == \"{driver}\"'}}\n"
    ))
}

/// A node-local slice with devices `device-1..=n`, attribute `type` from `types` (cycled).
fn slice(name: &str, node: &str, pool: &str, n: usize, types: &[&str]) -> k8s::ResourceSlice {
    let mut devs = String::new();
    for i in 1..=n {
        let t = types
            .get((i - 1) % types.len().max(1))
            .copied()
            .unwrap_or("x");
        devs.push_str(&format!(
            "  - name: device-{i}\n    attributes:\n      type: {{string: {t}}}\n      numa: {{int: {}}}\n",
            i % 2
        ));
    }
    yaml(&format!(
        "metadata: {{name: {name}}}\nspec:\n  driver: driver-a\n  nodeName: {node}\n  pool: {{name: {pool}, generation: 1, resourceSliceCount: 1}}\n  devices:\n{devs}"
    ))
}

fn claim(name: &str, body: &str) -> k8s::ResourceClaim {
    yaml(&format!(
        "metadata: {{name: {name}, namespace: default}}\nspec:\n  devices:\n{body}"
    ))
}

fn count_claim(name: &str, count: usize) -> k8s::ResourceClaim {
    claim(
        name,
        &format!(
            "    requests:\n    - name: req-0\n      exactly: {{deviceClassName: class-a, count: {count}}}\n"
        ),
    )
}

fn inventory(slices: &[k8s::ResourceSlice]) -> Inventory {
    let classes = [class("class-a", "driver-a")];
    Inventory::from_objects(slices, &classes, []).expect("inventory")
}

fn devices(o: &Outcome) -> Vec<Vec<String>> {
    match o {
        Outcome::Allocated(r) => r
            .iter()
            .map(|a| {
                a.devices
                    .iter()
                    .flat_map(|d| d.results.iter().flatten())
                    .map(|x| format!("{}={}", x.request, x.device))
                    .collect()
            })
            .collect(),
        other => panic!("not allocated: {other:?}"),
    }
}

/// The search exactly as Kubernetes runs it, so step counts are comparable.
fn unpruned() -> Options {
    Options {
        prune: false,
        ..Options::default()
    }
}

#[test]
fn combinations_not_permutations() {
    // Kubernetes: "check-combinations-within-single-request" takes 16 allocateOne calls.
    let inv = inventory(&[slice("s1", "node-1", "pool-1", 4, &["x"])]);
    let c = count_claim("c", 5);
    let (o, steps) = allocate_with_steps(
        &inv,
        &AllocatedState::new(),
        &NodeInfo::named("node-1"),
        &[&c],
        &unpruned(),
    );
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
    assert_eq!(steps, 16);
}

#[test]
fn backtracking_step_count_matches_kubernetes() {
    // "check-combinations-with-backtracking": req-1 takes 2 of anything, req-2 needs type X;
    // devices X, Y, Y. Kubernetes needs 12 allocateOne invocations.
    let inv = inventory(&[slice("s1", "node-1", "pool-1", 3, &["X", "Y", "Y"])]);
    let c = claim(
        "c",
        "    requests:\n    - name: req-1\n      exactly: {deviceClassName: class-a, count: 2}\n    - name: req-2\n      exactly:\n        deviceClassName: class-a\n        selectors:\n        - cel: {expression: 'device.attributes[\"driver-a\"].type == \"X\"'}\n",
    );
    let (o, steps) = allocate_with_steps(
        &inv,
        &AllocatedState::new(),
        &NodeInfo::named("node-1"),
        &[&c],
        &unpruned(),
    );
    assert_eq!(
        devices(&o),
        vec![vec!["req-1=device-2", "req-1=device-3", "req-2=device-1"]]
    );
    assert_eq!(steps, 12);
}

#[test]
fn budget_bounds_a_hopeless_search() {
    // 30 devices, half with numa 0 and half with numa 1; 16 devices with the same numa
    // value do not exist, and proving that enumerates every subset of each half.
    let inv = inventory(&[slice("s1", "node-1", "pool-1", 30, &["x"])]);
    let c = claim(
        "c",
        "    requests:\n    - name: req-0\n      exactly: {deviceClassName: class-a, count: 16}\n    constraints:\n    - matchAttribute: driver-a/numa\n",
    );
    let opts = Options {
        max_steps: 5_000,
        ..unpruned()
    };
    let o = allocate(
        &inv,
        &AllocatedState::new(),
        &NodeInfo::named("node-1"),
        &[&c],
        &opts,
    );
    assert_eq!(o, Outcome::BudgetExhausted { steps: 5_001 });
    // Pruning proves it quickly: no numa value has 16 candidates.
    let pruned = Options {
        max_steps: 5_000,
        ..Options::default()
    };
    let (o, steps) = allocate_with_steps(
        &inv,
        &AllocatedState::new(),
        &NodeInfo::named("node-1"),
        &[&c],
        &pruned,
    );
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
    assert!(steps < 200, "{steps} steps");
    let unbounded = Options {
        max_steps: u64::MAX,
        ..Options::default()
    };
    let small = inventory(&[slice("s1", "node-1", "pool-1", 8, &["x"])]);
    let c5 = claim(
        "c",
        "    requests:\n    - name: req-0\n      exactly: {deviceClassName: class-a, count: 5}\n    constraints:\n    - matchAttribute: driver-a/numa\n",
    );
    let o = allocate(
        &small,
        &AllocatedState::new(),
        &NodeInfo::named("node-1"),
        &[&c5],
        &unbounded,
    );
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
}

/// A claim needing `count` devices of one NUMA node.
fn numa_claim(name: &str, count: usize) -> k8s::ResourceClaim {
    claim(
        name,
        &format!(
            "    requests:\n    - name: req-0\n      exactly: {{deviceClassName: class-a, count: {count}}}\n    constraints:\n    - matchAttribute: driver-a/numa\n"
        ),
    )
}

#[test]
fn interchangeable_devices_are_tried_once_per_position() {
    // Three claims each want 6 devices of one NUMA node; there are two nodes of 10. Every
    // claim fits alone and 18 of 20 devices are enough, so no count proves "no fit"; the
    // pigeonhole does. Devices of one NUMA node are interchangeable, so after one of them
    // failed at a position the others are not tried there.
    let node = NodeInfo::named("node-1");
    let none = AllocatedState::new();
    let run = |devices: usize, count: usize, opts: &Options| {
        let inv = inventory(&[slice("s1", "node-1", "pool-1", devices, &["x"])]);
        let claims: Vec<_> = (0..3)
            .map(|i| numa_claim(&format!("c{i}"), count))
            .collect();
        let refs: Vec<_> = claims.iter().collect();
        allocate_with_steps(&inv, &none, &node, &refs, opts)
    };
    // (The unpruned search also gives up at the default budget of 1,000,000 steps.)
    let bounded = Options {
        max_steps: 100_000,
        ..unpruned()
    };
    let (plain, _) = run(20, 6, &bounded);
    assert!(
        matches!(plain, Outcome::BudgetExhausted { .. }),
        "{plain:?}"
    );
    let (pruned, steps) = run(20, 6, &Options::default());
    assert!(
        matches!(pruned, Outcome::Unsatisfiable { .. }),
        "{pruned:?}"
    );
    assert!(steps < 1_000, "{steps} steps");
    // Smaller, so the unpruned search finishes: the same answer in fewer steps.
    let (plain, plain_steps) = run(12, 4, &unpruned());
    let (pruned, pruned_steps) = run(12, 4, &Options::default());
    assert!(matches!(plain, Outcome::Unsatisfiable { .. }), "{plain:?}");
    assert_eq!(pruned, plain);
    assert!(
        pruned_steps * 10 < plain_steps,
        "{pruned_steps} pruned vs {plain_steps} unpruned steps"
    );
    // With room for all three, the devices chosen are the unpruned search's.
    let (plain, _) = run(20, 5, &unpruned());
    assert!(plain.is_allocated(), "{plain:?}");
    assert_eq!(run(20, 5, &Options::default()).0, plain);
}

#[test]
fn selector_errors_past_an_impossible_claim_do_not_stop_pruning() {
    // 16 devices of one NUMA node out of 15 + 15: hopeless, and exponential to prove
    // without pruning. A later claim's selector fails on every device, but the search never
    // gets there, so the answer is "no fit"; with the failing claim first, it is the error.
    let inv = inventory(&[slice("s1", "node-1", "pool-1", 30, &["x"])]);
    let hopeless = numa_claim("hopeless", 16);
    let failing = claim(
        "failing",
        "    requests:\n    - name: req-0\n      exactly:\n        deviceClassName: class-a\n        selectors:\n        - cel: {expression: 'device.attributes[\"driver-a\"].missing == 1'}\n",
    );
    let node = NodeInfo::named("node-1");
    let none = AllocatedState::new();
    let budget = Options {
        max_steps: 100_000,
        ..Options::default()
    };
    let (o, steps) = allocate_with_steps(&inv, &none, &node, &[&hopeless, &failing], &budget);
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
    assert!(steps < 200, "{steps} steps");
    let o = allocate(&inv, &none, &node, &[&failing, &hopeless], &budget);
    assert!(
        matches!(&o, Outcome::Error(e) if e.kind() == AllocErrorKind::Cel),
        "{o:?}"
    );
}

#[test]
fn replicas_consume_devices_until_none_left() {
    let inv = inventory(&[slice("s1", "node-1", "pool-1", 8, &["x"])]);
    let node = NodeInfo::named("node-1");
    let mut state = AllocatedState::new();
    let mut placed = Vec::new();
    for i in 0..8 {
        let c = count_claim(&format!("c{i}"), 1);
        match allocate(&inv, &state, &node, &[&c], &Options::default()) {
            Outcome::Allocated(r) => {
                state.commit(&r);
                placed.push(r);
            }
            other => panic!("replica {i}: {other:?}"),
        }
    }
    let first = devices(&Outcome::Allocated(placed[0].clone()));
    assert_eq!(first, vec![vec!["req-0=device-1"]], "first fit");
    let c = count_claim("c8", 1);
    let o = allocate(&inv, &state, &node, &[&c], &Options::default());
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
    state.release(&placed[3]);
    let o = allocate(&inv, &state, &node, &[&c], &Options::default());
    assert_eq!(devices(&o), vec![vec!["req-0=device-4"]]);
}

#[test]
fn inventory_updates_incrementally() {
    let mut inv = inventory(&[slice("s1", "node-1", "pool-1", 1, &["x"])]);
    let node = NodeInfo::named("node-1");
    let c = count_claim("c", 2);
    let run = |inv: &Inventory| {
        allocate(
            inv,
            &AllocatedState::new(),
            &node,
            &[&c],
            &Options::default(),
        )
    };
    assert!(matches!(run(&inv), Outcome::Unsatisfiable { .. }));
    inv.upsert_slice(&slice("s2", "node-1", "pool-2", 1, &["x"]))
        .expect("slice");
    assert_eq!(
        devices(&run(&inv)),
        vec![vec!["req-0=device-1", "req-0=device-1"]]
    );
    // Replacing a slice with a bigger one, then removing the other.
    inv.upsert_slice(&slice("s1", "node-1", "pool-1", 2, &["x"]))
        .expect("slice");
    assert!(inv.remove_slice("s2"));
    assert_eq!(inv.slice_count(), 1);
    assert_eq!(
        devices(&run(&inv)),
        vec![vec!["req-0=device-1", "req-0=device-2"]]
    );
    assert!(inv.remove_class("class-a"));
    assert!(
        matches!(run(&inv), Outcome::Error(e) if e.kind() == AllocErrorKind::UnknownClass
            && e.message().contains("could not retrieve device class"))
    );
}

#[test]
fn taint_rules_and_tolerations() {
    let mut inv = inventory(&[slice("s1", "node-1", "pool-1", 1, &["x"])]);
    let rule: k8s::DeviceTaintRule = yaml(
        "metadata: {name: maint}\nspec:\n  deviceSelector: {driver: driver-a, pool: pool-1, device: device-1}\n  taint: {key: maintenance, value: 'true', effect: NoSchedule}\n",
    );
    inv.upsert_taint_rule(&rule).expect("rule");
    let node = NodeInfo::named("node-1");
    let plain = count_claim("c", 1);
    let o = allocate(
        &inv,
        &AllocatedState::new(),
        &node,
        &[&plain],
        &Options::default(),
    );
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
    // 1.35 has device taints off: the rule does not apply.
    let o = allocate(
        &inv,
        &AllocatedState::new(),
        &node,
        &[&plain],
        &Options::for_version(KubeVersion::V1_35),
    );
    assert!(o.is_allocated(), "{o:?}");
    let tolerating = claim(
        "c",
        "    requests:\n    - name: req-0\n      exactly:\n        deviceClassName: class-a\n        tolerations:\n        - {key: maintenance, operator: Exists, effect: NoSchedule}\n",
    );
    let o = allocate(
        &inv,
        &AllocatedState::new(),
        &node,
        &[&tolerating],
        &Options::default(),
    );
    let Outcome::Allocated(r) = o else {
        panic!("tolerated taint must allocate: {o:?}");
    };
    let res = &r[0].devices.as_ref().unwrap().results.as_ref().unwrap()[0];
    assert_eq!(res.tolerations.as_ref().map(Vec::len), Some(1));
    assert!(inv.remove_taint_rule("maint"));
    let o = allocate(
        &inv,
        &AllocatedState::new(),
        &node,
        &[&plain],
        &Options::default(),
    );
    assert!(o.is_allocated());
}

#[test]
fn shared_devices_get_distinct_deterministic_share_ids() {
    let s: k8s::ResourceSlice = yaml(
        "metadata: {name: s1}\nspec:\n  driver: driver-a\n  nodeName: node-1\n  pool: {name: pool-1, generation: 1, resourceSliceCount: 1}\n  devices:\n  - name: nic\n    allowMultipleAllocations: true\n    capacity:\n      bandwidth: {value: 10G}\n",
    );
    let inv = inventory(&[s]);
    let c = claim(
        "c",
        "    requests:\n    - name: a\n      exactly: {deviceClassName: class-a, capacity: {requests: {bandwidth: 4G}}}\n    - name: b\n      exactly: {deviceClassName: class-a, capacity: {requests: {bandwidth: 4G}}}\n",
    );
    let node = NodeInfo::named("node-1");
    let run = || {
        allocate(
            &inv,
            &AllocatedState::new(),
            &node,
            &[&c],
            &Options::default(),
        )
    };
    let Outcome::Allocated(r) = run() else {
        panic!("two shares fit in 10G");
    };
    let results = r[0].devices.as_ref().unwrap().results.as_ref().unwrap();
    let ids: Vec<_> = results
        .iter()
        .map(|x| x.share_id.clone().unwrap())
        .collect();
    assert_ne!(ids[0], ids[1]);
    assert_eq!(ids[0].len(), 36);
    assert_eq!(&ids[0][14..15], "8", "version-8 UUID");
    assert_eq!(run(), Outcome::Allocated(r.clone()), "deterministic");
    assert_eq!(
        results[0].consumed_capacity.as_ref().unwrap()["bandwidth"].0,
        "4G"
    );
    // A third share of 4G does not fit next to the two committed ones.
    let mut state = AllocatedState::new();
    state.commit(&r);
    let third = count_claim("d", 1);
    let o = allocate(&inv, &state, &node, &[&third], &Options::default());
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
}

#[test]
fn versions_and_features() {
    assert_eq!("1.34".parse::<KubeVersion>(), Ok(KubeVersion::V1_34));
    assert_eq!("v1.35.2".parse::<KubeVersion>(), Ok(KubeVersion::V1_35));
    assert_eq!("1.36+".parse::<KubeVersion>(), Ok(KubeVersion::V1_36));
    assert!("1.33".parse::<KubeVersion>().is_err());
    assert_eq!(KubeVersion::default(), KubeVersion::V1_36);
    let f34 = Features::defaults_for(KubeVersion::V1_34);
    assert!(f34.prioritized_list && !f34.partitionable_devices && !f34.consumable_capacity);
    assert!(Features::defaults_for(KubeVersion::V1_36).device_taints);
    let o = Options {
        features: Some(Features::all()),
        ..Options::for_version(KubeVersion::V1_34)
    };
    assert!(o.effective_features().consumable_capacity);
}

#[test]
fn extended_resource_class_lookup() {
    let mut explicit = class("gpu-class", "driver-a");
    explicit.spec.extended_resource_name = Some("example.com/gpu".into());
    let inv = Inventory::from_objects([], [&explicit, &class("class-a", "driver-a")], [])
        .expect("inventory");
    assert_eq!(
        inv.extended_resource_class("example.com/gpu"),
        Some("gpu-class")
    );
    assert_eq!(
        inv.extended_resource_class("deviceclass.resource.kubernetes.io/class-a"),
        Some("class-a")
    );
    assert_eq!(inv.extended_resource_class("example.com/fpga"), None);
}

#[test]
fn cel_runtime_error_fails_the_pod() {
    let inv = inventory(&[slice("s1", "node-1", "pool-1", 1, &["x"])]);
    let c = claim(
        "c",
        "    requests:\n    - name: req-0\n      exactly:\n        deviceClassName: class-a\n        selectors:\n        - cel: {expression: 'device.attributes[\"driver-a\"].nosuch == \"x\"'}\n",
    );
    let o = allocate(
        &inv,
        &AllocatedState::new(),
        &NodeInfo::named("node-1"),
        &[&c],
        &Options::default(),
    );
    match o {
        Outcome::Error(e) => {
            assert_eq!(e.kind(), AllocErrorKind::Cel);
            let message = e.to_string();
            assert!(message.contains("CEL runtime error"), "{message}");
            assert!(message.contains("driver-a/pool-1/device-1"), "{message}");
        }
        other => panic!("expected a pod error, got {other:?}"),
    }
}

#[test]
fn identical_devices_share_one_parsed_core() {
    // device-1 and device-3 have equal content except the name (type a, numa 1); device-2
    // differs (type b, numa 0). Equal content across slices and nodes shares too.
    let inv = inventory(&[
        slice("s1", "n1", "p1", 3, &["a", "b"]),
        slice("s2", "n2", "p2", 3, &["a", "b"]),
    ]);
    let d1 = &inv.slices["s1"].devices;
    let d2 = &inv.slices["s2"].devices;
    assert!(std::sync::Arc::ptr_eq(&d1[0].core, &d1[2].core));
    assert!(!std::sync::Arc::ptr_eq(&d1[0].core, &d1[1].core));
    assert!(std::sync::Arc::ptr_eq(&d1[1].core, &d2[1].core));
    assert_eq!(&*d1[2].name, "device-3", "names stay per device");
    // Sharing a core does not merge allocation: both equal devices are still allocatable.
    let st = AllocatedState::new();
    let node = NodeInfo {
        name: "n1".into(),
        labels: Default::default(),
    };
    let mut inv = inv;
    inv.upsert_class(&class("c", "driver-a")).expect("class");
    let c = claim(
        "two-a",
        "    requests:\n    - name: r\n      exactly:\n        deviceClassName: c\n        count: 2\n        selectors:\n        - cel: {expression: 'device.attributes[\"driver-a\"].type == \"a\"'}\n",
    );
    match allocate(&inv, &st, &node, &[&c], &Options::default()) {
        Outcome::Allocated(r) => {
            let names: Vec<String> = r[0]
                .devices
                .iter()
                .flat_map(|d| d.results.iter().flatten())
                .map(|x| x.device.clone())
                .collect();
            assert_eq!(names, vec!["device-1".to_string(), "device-3".to_string()]);
        }
        other => panic!("expected an allocation, got {other:?}"),
    }
}

#[test]
fn allocated_state_clone_is_copy_on_write() {
    let a: k8s::AllocationResult = yaml(
        "devices:\n  results:\n  - {request: r, driver: d, pool: p, device: x}\n  - {request: r, driver: d, pool: q, device: y}\n",
    );
    let b: k8s::AllocationResult =
        yaml("devices:\n  results:\n  - {request: r, driver: d, pool: p, device: z}\n");
    let mut base = AllocatedState::new();
    base.commit(std::slice::from_ref(&a));
    let before = base.clone();
    let mut copy = base.clone();
    copy.commit(std::slice::from_ref(&b));
    copy.release(std::slice::from_ref(&a));
    assert!(copy.is_dedicated("d", "p", "z"));
    assert!(!copy.is_dedicated("d", "p", "x"));
    assert!(!copy.is_dedicated("d", "q", "y"));
    assert_eq!(base, before, "changes to a copy never reach the original");
    assert!(base.is_dedicated("d", "p", "x") && base.is_dedicated("d", "q", "y"));
    assert!(!base.is_dedicated("d", "p", "z"));
    copy.release(std::slice::from_ref(&b));
    assert!(copy.is_empty());
}

#[test]
fn duplicate_device_names_are_reported_in_small_and_large_pools() {
    for (n, dup) in [(3usize, 2usize), (40, 35)] {
        let mut s = slice("s1", "n1", "p1", n, &["a"]);
        let mut extra = s.spec.devices.as_ref().expect("devices")[dup - 1].clone();
        extra.attributes = None;
        s.spec.devices.as_mut().expect("devices").push(extra);
        let mut inv = inventory(&[s]);
        inv.upsert_class(&class("class-a", "driver-a"))
            .expect("class");
        let node = NodeInfo {
            name: "n1".into(),
            labels: Default::default(),
        };
        let c = count_claim("one", 1);
        let out = allocate(
            &inv,
            &AllocatedState::new(),
            &node,
            &[&c],
            &Options::default(),
        );
        let text = format!("{out:?}");
        assert!(
            text.contains(&format!("duplicate device name device-{dup}")),
            "pool of {n}: {text}"
        );
    }
}

/// `Inventory::class_devices` selects as the allocator does: every class selector true; a
/// selector that fails on a device, or does not compile, selects nothing; an unknown class
/// selects nothing; a class without selectors selects every device.
#[test]
fn class_devices_follow_the_allocators_selection() {
    let mut inv = inventory(&[
        slice("s1", "node-1", "pool-1", 3, &["x", "y"]),
        slice("s2", "node-2", "pool-2", 1, &["x"]),
    ]);
    let sorted = |inv: &Inventory, c: &str| {
        let mut v: Vec<String> = inv
            .class_devices(c)
            .map(|(d, p, n)| format!("{d}/{p}/{n}"))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        sorted(&inv, "class-a"),
        [
            "driver-a/pool-1/device-1",
            "driver-a/pool-1/device-2",
            "driver-a/pool-1/device-3",
            "driver-a/pool-2/device-1"
        ]
    );
    let typed: k8s::DeviceClass = yaml(
        "metadata: {name: type-x}\nspec:\n  selectors:\n  - cel: {expression: 'device.attributes[\"driver-a\"].type == \"x\"'}\n",
    );
    let failing: k8s::DeviceClass = yaml(
        "metadata: {name: failing}\nspec:\n  selectors:\n  - cel: {expression: 'device.attributes[\"driver-a\"].nosuch == \"x\"'}\n",
    );
    let broken: k8s::DeviceClass =
        yaml("metadata: {name: broken}\nspec:\n  selectors:\n  - cel: {expression: 'device.'}\n");
    let open: k8s::DeviceClass = yaml("metadata: {name: open}\nspec: {}\n");
    for c in [&typed, &failing, &broken, &open] {
        inv.upsert_class(c).expect("class");
    }
    assert_eq!(
        sorted(&inv, "type-x"),
        [
            "driver-a/pool-1/device-1",
            "driver-a/pool-1/device-3",
            "driver-a/pool-2/device-1"
        ]
    );
    assert!(sorted(&inv, "failing").is_empty());
    assert!(sorted(&inv, "broken").is_empty());
    assert!(sorted(&inv, "nosuch").is_empty());
    assert_eq!(sorted(&inv, "open").len(), 4);
    assert_eq!(
        inv.class_names().collect::<Vec<_>>(),
        ["broken", "class-a", "failing", "open", "type-x"]
    );
}

#[test]
fn a_node_copy_holds_that_nodes_slices_every_class_and_allocates_alike() {
    let mut inv = inventory(&[
        slice("s1", "node-1", "pool-1", 3, &["x", "y"]),
        slice("s2", "node-2", "pool-2", 1, &["x"]),
    ]);
    let typed: k8s::DeviceClass = yaml(
        "metadata: {name: type-x}\nspec:\n  selectors:\n  - cel: {expression: 'device.attributes[\"driver-a\"].type == \"x\"'}\n",
    );
    inv.upsert_class(&typed).expect("class");
    let copy = inv.node_copy("node-1");
    assert_eq!(copy.slice_count(), 1, "only node-1's slice");
    assert_eq!(copy.class_count(), 2);
    let mut devs: Vec<String> = copy
        .class_devices("type-x")
        .map(|(d, p, n)| format!("{d}/{p}/{n}"))
        .collect();
    devs.sort();
    assert_eq!(
        devs,
        ["driver-a/pool-1/device-1", "driver-a/pool-1/device-3"]
    );
    // The same claim gets the same answer from the copy (the compiled selectors are shared).
    let node = NodeInfo::named("node-1");
    let c = count_claim("c", 3);
    let run = |inv: &Inventory| {
        devices(&allocate(
            inv,
            &AllocatedState::new(),
            &node,
            &[&c],
            &Options::default(),
        ))
    };
    assert_eq!(run(&copy), run(&inv));
    assert!(
        copy.node_copy("node-2").slice_count() == 0,
        "a copy holds node-1 only"
    );
}

/// Devices `<driver>-0..n` in pool `<driver>` on node-1: `type` cycles x, x, y, y, `numa`
/// cycles 0, 1, and `id` is the index, so no two devices are interchangeable for a claim
/// constraining `id`.
fn tagged_slice(driver: &str, n: usize) -> k8s::ResourceSlice {
    let devices: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            let t = ["x", "x", "y", "y"][i % 4];
            serde_json::json!({"name": format!("{driver}-{i}"), "attributes": {
                "type": {"string": t},
                "numa": {"int": i % 2},
                "id": {"int": i}}})
        })
        .collect();
    serde_json::from_value(serde_json::json!({"metadata": {"name": driver}, "spec": {
        "driver": driver, "nodeName": "node-1",
        "pool": {"name": driver, "generation": 1, "resourceSliceCount": 1},
        "devices": devices}}))
    .expect("test slice")
}

/// 20 `driver-a` and 2 `driver-b` devices; classes `class-a`, `class-b` and `any`.
fn tagged_inventory() -> Inventory {
    let any: k8s::DeviceClass = yaml("metadata: {name: any}\nspec: {}\n");
    let classes = [
        class("class-a", "driver-a"),
        class("class-b", "driver-b"),
        any,
    ];
    let slices = [tagged_slice("driver-a", 20), tagged_slice("driver-b", 2)];
    Inventory::from_objects(&slices, &classes, []).expect("inventory")
}

/// A claim with thousands of solutions and no interchangeable devices: `count` `class-a`
/// devices of distinct `id`s.
fn filler(count: usize) -> k8s::ResourceClaim {
    claim(
        "filler",
        &format!(
            "    requests:\n    - name: r0\n      exactly: {{deviceClassName: class-a, count: {count}}}\n    constraints:\n    - distinctAttribute: driver-a/id\n"
        ),
    )
}

/// Runs `claims` unpruned within 100,000 steps (which must give up) and pruned (which
/// must answer within 1,000 steps); returns the pruned outcome.
fn pruned_answer_where_unpruned_gives_up(
    inv: &Inventory,
    state: &AllocatedState,
    claims: &[&k8s::ResourceClaim],
) -> Outcome {
    let node = NodeInfo::named("node-1");
    let bounded = Options {
        max_steps: 100_000,
        ..unpruned()
    };
    let (plain, _) = allocate_with_steps(inv, state, &node, claims, &bounded);
    assert!(
        matches!(plain, Outcome::BudgetExhausted { .. }),
        "{plain:?}"
    );
    let (pruned, steps) = allocate_with_steps(inv, state, &node, claims, &Options::default());
    assert!(steps < 1_000, "{steps} steps: {pruned:?}");
    pruned
}

#[test]
fn match_constraints_on_the_same_requests_are_checked_together() {
    // Ten devices have type x and ten have numa 0, but only five have both: six devices
    // agreeing on both attributes do not exist, which neither constraint alone shows.
    let inv = tagged_inventory();
    let pair = |count: usize| {
        claim(
            "pair",
            &format!(
                "    requests:\n    - name: r0\n      exactly: {{deviceClassName: class-a, count: {count}}}\n    constraints:\n    - matchAttribute: driver-a/type\n    - matchAttribute: driver-a/numa\n"
            ),
        )
    };
    let none = AllocatedState::new();
    let (filler, six) = (filler(4), pair(6));
    let o = pruned_answer_where_unpruned_gives_up(&inv, &none, &[&filler, &six]);
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
    // Five fit: the same devices as the unpruned search.
    let five = pair(5);
    let node = NodeInfo::named("node-1");
    let plain = allocate(&inv, &none, &node, &[&filler, &five], &unpruned());
    assert!(plain.is_allocated(), "{plain:?}");
    assert_eq!(
        allocate(&inv, &none, &node, &[&filler, &five], &Options::default()),
        plain
    );
}

#[test]
fn a_constrained_all_request_that_stops_at_a_device_in_use_is_not_a_hazard() {
    // `walk` asks for every class-b device with one `id`: the walk would fail the pod at
    // the second device, but the first is in use, so it fails quietly. The claim after it
    // cannot fit, and pruning may say so without walking.
    let inv = tagged_inventory();
    let mut busy = AllocatedState::new();
    let taken: k8s::AllocationResult = yaml(
        "devices:\n  results:\n  - {request: r, driver: driver-b, pool: driver-b, device: driver-b-0}\n",
    );
    busy.commit(&[taken]);
    let walk = claim(
        "walk",
        "    requests:\n    - name: r0\n      exactly: {deviceClassName: class-b, allocationMode: All}\n    constraints:\n    - matchAttribute: driver-b/id\n",
    );
    let hopeless = count_claim("hopeless", 15);
    let filler = filler(6);
    let o = pruned_answer_where_unpruned_gives_up(&inv, &busy, &[&filler, &walk, &hopeless]);
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
    // With both devices free the walk fails the pod, pruned or not.
    let node = NodeInfo::named("node-1");
    let none = AllocatedState::new();
    for opts in [unpruned(), Options::default()] {
        let o = allocate(&inv, &none, &node, &[&filler, &walk, &hopeless], &opts);
        assert!(
            matches!(&o, Outcome::Error(e) if e.kind() == AllocErrorKind::ConstraintViolated),
            "{o:?}"
        );
    }
}

#[test]
fn selector_errors_on_devices_an_earlier_request_must_take_are_not_a_hazard() {
    // `grab` must take both class-b devices; `probe`'s selector fails on them (no `id` of
    // driver-a), but by the time it runs they are in use, so it never evaluates there. The
    // request after it cannot fit.
    let inv = tagged_inventory();
    let grab = claim(
        "grab",
        "    requests:\n    - name: r0\n      exactly: {deviceClassName: class-a, count: 4}\n    - name: r1\n      exactly: {deviceClassName: class-b, count: 2}\n    constraints:\n    - distinctAttribute: driver-a/id\n      requests: [r0]\n",
    );
    let probe = claim(
        "probe",
        "    requests:\n    - name: r0\n      exactly:\n        deviceClassName: any\n        selectors:\n        - cel: {expression: 'device.attributes[\"driver-a\"].id >= 0'}\n    - name: r1\n      exactly: {deviceClassName: class-a, count: 17}\n",
    );
    let none = AllocatedState::new();
    let o = pruned_answer_where_unpruned_gives_up(&inv, &none, &[&grab, &probe]);
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
}

#[test]
fn match_and_distinct_on_one_attribute_leave_room_for_one_device() {
    // Two devices of one `type` that are also of different `type`s do not exist.
    let inv = tagged_inventory();
    let both = |count: usize| {
        claim(
            "both",
            &format!(
                "    requests:\n    - name: r0\n      exactly: {{deviceClassName: class-a, count: {count}}}\n    constraints:\n    - matchAttribute: driver-a/type\n    - distinctAttribute: driver-a/type\n"
            ),
        )
    };
    let none = AllocatedState::new();
    let (filler, two) = (filler(6), both(2));
    let o = pruned_answer_where_unpruned_gives_up(&inv, &none, &[&filler, &two]);
    assert!(matches!(o, Outcome::Unsatisfiable { .. }), "{o:?}");
    // One device is under both without conflict.
    let one = both(1);
    let node = NodeInfo::named("node-1");
    let plain = allocate(&inv, &none, &node, &[&filler, &one], &unpruned());
    assert!(plain.is_allocated(), "{plain:?}");
    assert_eq!(
        allocate(&inv, &none, &node, &[&filler, &one], &Options::default()),
        plain
    );
}
