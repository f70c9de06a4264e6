//! The cached estimate (per-node and same-shape caches) must equal the naive replica-by-
//! replica allocation on random fleets, before and after incremental changes.

use crate::fleet;

use std::collections::HashMap;
use std::sync::Arc;

use dramesh_estimator::{AssumedWorkload, EstimateOptions, Estimator, View, Workload};
use dramesh_model::{ClusterObject, ObjectChange, ObjectKey, ObjectKind};
use dramesh_sim::typed::{self, FleetSpec};
use fleet::{Lcg, fleet, random_spec};
use serde_json::json;

fn gpu_workload(count: i64, cpu: &str) -> Workload {
    let tpl: dramesh_model::k8s::ResourceClaimTemplate = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpu", "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": typed::CLASS, "count": count,
            "selectors": [{"cel": {"expression": "device.capacity[\"gpu.example.com\"].memory.compareTo(quantity(\"40Gi\")) >= 0"}}]
        }}]}}}
    }))
    .unwrap();
    let mut templates = HashMap::new();
    templates.insert(("default".to_string(), "gpu".to_string()), Arc::new(tpl));
    let spec = json!({
        "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": "8Gi"}}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
    });
    Workload::from_pod_spec(
        "Job",
        "default",
        "probe",
        1,
        serde_json::from_value(spec).unwrap(),
        &templates,
    )
    .unwrap()
}

fn shared_slice(devices: usize) -> ClusterObject {
    let devs: Vec<serde_json::Value> = (0..devices)
        .map(|i| json!({"name": format!("net-gpu-{i}"), "capacity": {"memory": {"value": "80Gi"}}}))
        .collect();
    ClusterObject::ResourceSlice(Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "shared-gpus"},
            "spec": {"driver": typed::DRIVER, "allNodes": true,
                     "pool": {"name": "shared", "generation": 1, "resourceSliceCount": 1},
                     "devices": devs}
        }))
        .unwrap(),
    ))
}

fn compare(view: &View, est: &mut Estimator, w: &Workload, label: &str) {
    let naive = est.estimate(
        view,
        w,
        &EstimateOptions {
            disable_cache: true,
            ..Default::default()
        },
    );
    let cached = est.estimate(view, w, &EstimateOptions::default());
    let again = est.estimate(view, w, &EstimateOptions::default());
    assert_eq!(cached, naive, "{label}: cached differs from naive");
    assert_eq!(
        again, naive,
        "{label}: second cached run differs from naive"
    );
}

/// In-flight workloads with GPU claims on every cluster of `view` (c0, c1, ...).
fn random_assumed(rng: &mut Lcg, clusters: usize, nodes: usize) -> Vec<AssumedWorkload> {
    let mut out = Vec::new();
    for c in 0..clusters {
        for _ in 0..=rng.next(2) {
            let w = gpu_workload(1 + rng.next(2) as i64, ["1", "30"][rng.next(2) as usize]);
            let replicas = 1 + rng.next(2 * nodes as u64) as i64;
            out.push(AssumedWorkload::from_workload(
                &format!("c{c}"),
                &w,
                replicas,
            ));
        }
    }
    out
}

/// `compare` with assumed workloads; the caches must not keep anything computed with them
/// (a plain estimate afterwards equals a naive one). Returns by how many replicas the
/// assumed workloads lowered the total.
fn compare_assumed(
    view: &View,
    est: &mut Estimator,
    w: &Workload,
    assumed: &[AssumedWorkload],
    label: &str,
) -> i64 {
    let with = EstimateOptions {
        assumed: assumed.to_vec().into(),
        ..Default::default()
    };
    let naive = est.estimate(
        view,
        w,
        &EstimateOptions {
            disable_cache: true,
            ..with.clone()
        },
    );
    let cached = est.estimate(view, w, &with);
    let again = est.estimate(view, w, &with);
    assert_eq!(
        cached, naive,
        "{label}: cached differs from naive (assumed)"
    );
    assert_eq!(again, naive, "{label}: second cached run differs (assumed)");
    let plain = est.estimate(view, w, &EstimateOptions::default());
    compare(view, est, w, &format!("{label} after assumed"));
    plain.total - naive.total
}

#[test]
fn cached_equals_naive_with_assumed_device_workloads() {
    let mut rng = Lcg(31);
    let mut deducted = 0;
    for round in 0..8 {
        let spec = random_spec(&mut rng, (3, 10), (1, 6), Some(2));
        let nodes = spec.nodes_per_cluster;
        let salt = rng.next(1000) as usize;
        let alloc = move |n: usize| (n * 3 + salt) % 4;
        let mut view = fleet(&spec, &alloc).unwrap();
        // c2 also has network-attached GPUs, which assumed replicas may hold.
        view.apply_object("c2", shared_slice(1 + rng.next(4) as usize))
            .unwrap();
        let mut est = Estimator::new();
        for probe in 0..3 {
            let w = gpu_workload(1 + rng.next(2) as i64, ["1", "64"][rng.next(2) as usize]);
            // Warm the caches without assumed workloads first.
            compare(&view, &mut est, &w, &format!("round {round} probe {probe}"));
            let assumed = random_assumed(&mut rng, 3, nodes);
            deducted += compare_assumed(
                &view,
                &mut est,
                &w,
                &assumed,
                &format!("round {round} probe {probe}"),
            );
        }
    }
    assert!(deducted > 0, "assumed devices should lower some estimates");
}

/// An assumed list that grows one workload at a time (as admitted reservations do), with
/// now and then an entry dropped from the middle or the list cut back (the kept deductions
/// are undone to the common start), a view change, and the list emptied: one long-lived
/// estimator, whose kept deductions are extended, undone, carried or built again, answers
/// every step as the naive path does.
#[test]
fn growing_assumed_lists_agree_with_naive() {
    let mut rng = Lcg(47);
    let mut deducted = 0;
    for round in 0..4 {
        let spec = random_spec(&mut rng, (4, 12), (2, 6), Some(3));
        let nodes = spec.nodes_per_cluster;
        let salt = rng.next(1000) as usize;
        let alloc = move |n: usize| (n * 3 + salt) % 3;
        let mut view = fleet(&spec, &alloc).unwrap();
        if round % 2 == 1 {
            view.apply_object("c2", shared_slice(1 + rng.next(3) as usize))
                .unwrap();
        }
        let shapes = [
            gpu_workload(1, "1"),
            gpu_workload(2, "30"),
            gpu_workload(1, "64"),
        ];
        let mut est = Estimator::new();
        let mut assumed: Vec<AssumedWorkload> = Vec::new();
        for step in 0..40 {
            let label = format!("round {round} step {step}");
            match rng.next(10) {
                0 if !assumed.is_empty() => {
                    let i = rng.next(assumed.len() as u64) as usize;
                    assumed.remove(i);
                }
                9 => {
                    let keep = rng.next(assumed.len() as u64 + 1) as usize;
                    assumed.truncate(keep);
                }
                1 => {
                    let c = format!("c{}", rng.next(3));
                    let node = format!("{c}-n{}", rng.next(nodes as u64));
                    let pod: dramesh_model::k8s::Pod = serde_json::from_value(json!({
                        "apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": format!("p{step}"), "namespace": "default"},
                        "spec": {"nodeName": node, "containers": [{"name": "c",
                            "resources": {"requests": {"cpu": "40"}}}]}
                    }))
                    .unwrap();
                    view.apply(
                        &c,
                        &ObjectChange::upsert(&ClusterObject::Pod(Arc::new(pod))),
                    )
                    .unwrap();
                }
                2 => {
                    // A workload without claims: requests and pod slots only.
                    let mut a = AssumedWorkload::from_workload(
                        &format!("c{}", rng.next(3)),
                        &shapes[0],
                        1 + rng.next(3) as i64,
                    );
                    a.claims = None;
                    assumed.push(a);
                }
                _ => {
                    let w = &shapes[rng.next(3) as usize];
                    let c = format!("c{}", rng.next(3));
                    assumed.push(AssumedWorkload::from_workload(
                        &c,
                        w,
                        1 + rng.next(nodes as u64) as i64,
                    ));
                }
            }
            for probe in [&shapes[0], &shapes[1]] {
                let with = EstimateOptions {
                    assumed: assumed.clone().into(),
                    ..Default::default()
                };
                let naive = Estimator::new().estimate(
                    &view,
                    probe,
                    &EstimateOptions {
                        disable_cache: true,
                        ..with.clone()
                    },
                );
                let cached = est.estimate(&view, probe, &with);
                assert_eq!(cached, naive, "{label}: cached differs from naive");
                let plain = est.estimate(&view, probe, &EstimateOptions::default());
                deducted += plain.total - naive.total;
            }
            if step % 8 == 7 {
                compare(
                    &view,
                    &mut est,
                    &shapes[2],
                    &format!("{label} without assumed"),
                );
            }
        }
    }
    assert!(deducted > 0, "assumed devices should lower some estimates");
}

#[test]
fn cached_equals_naive_on_random_fleets() {
    let mut rng = Lcg(7);
    let mut nonzero = 0;
    for round in 0..8 {
        let spec = random_spec(&mut rng, (4, 20), (1, 8), Some(3));
        let nodes = spec.nodes_per_cluster;
        let salt = rng.next(1000) as usize;
        let alloc = move |n: usize| (n * 7 + salt) % 5;
        let mut view = fleet(&spec, &alloc).unwrap();
        // Cluster c2 also has a network-attached pool visible from every node.
        view.apply_object("c2", shared_slice(1 + rng.next(6) as usize))
            .unwrap();
        let mut est = Estimator::new();
        for count in 1..=3 {
            let cpu = ["1", "30", "64"][rng.next(3) as usize];
            let w = gpu_workload(count, cpu);
            compare(&view, &mut est, &w, &format!("round {round} count {count}"));
            nonzero += est.estimate(&view, &w, &EstimateOptions::default()).total;
        }
        // Incremental changes: free a GPU, take another, drop a node, then compare again.
        let c = format!("c{}", rng.next(3));
        let n = rng.next(nodes as u64) as usize;
        let node = format!("{c}-n{n}");
        view.apply(
            &c,
            &ObjectChange::Delete {
                key: ObjectKey::new(
                    ObjectKind::ResourceClaim,
                    Some("default"),
                    &format!("{node}-gpu-0"),
                ),
            },
        )
        .unwrap();
        let extra = typed::allocated_claim("default", "extra", &node, spec.gpus_per_node - 1);
        view.apply(
            &c,
            &ObjectChange::upsert(&ClusterObject::ResourceClaim(Arc::new(extra))),
        )
        .unwrap();
        // A CPU-heavy pod lands on another node.
        let busy = format!("{c}-n{}", (n + 2) % nodes);
        let pod: dramesh_model::k8s::Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hog", "namespace": "default"},
            "spec": {"nodeName": busy, "containers": [{"name": "c", "resources": {"requests": {"cpu": "120"}}}]}
        }))
        .unwrap();
        view.apply(
            &c,
            &ObjectChange::upsert(&ClusterObject::Pod(Arc::new(pod))),
        )
        .unwrap();
        let gone = format!("{c}-n{}", (n + 1) % nodes);
        view.apply(
            &c,
            &ObjectChange::Delete {
                key: ObjectKey::new(ObjectKind::Node, None, &gone),
            },
        )
        .unwrap();
        for count in 1..=2 {
            let w = gpu_workload(count, "2");
            compare(
                &view,
                &mut est,
                &w,
                &format!("round {round} after changes count {count}"),
            );
        }
    }
    assert!(nonzero > 0, "the random fleets should admit some replicas");
}

#[test]
fn arrival_order_does_not_change_results() {
    // Claims before slices (as a replication stream may deliver them) must give the same
    // answers as slices before claims, cached or not.
    let spec = FleetSpec {
        clusters: 1,
        nodes_per_cluster: 12,
        gpus_per_node: 4,
        owners_per_cluster: 2,
        kubernetes_version: "1.36".into(),
    };
    let alloc = |n: usize| n % 3;
    let forward = fleet(&spec, &alloc).unwrap();
    let mut objs = Vec::new();
    typed::cluster_objects(&spec, 0, &alloc, |o| objs.push(o));
    objs.reverse();
    let mut backward = View::new();
    for o in objs {
        backward.apply_object("c0", o).unwrap();
    }
    let w = gpu_workload(1, "1");
    let mut est = Estimator::new();
    let a = est.estimate(&forward, &w, &EstimateOptions::default());
    let mut est2 = Estimator::new();
    let b = est2.estimate(&backward, &w, &EstimateOptions::default());
    // 12 nodes x 4 GPUs minus (0+1+2)*4 allocated = 36.
    assert_eq!(a.total, 36);
    assert_eq!(a, b);
    compare(&backward, &mut est2, &w, "reversed arrival");
}

#[test]
fn preemption_with_caches_equals_naive() {
    let spec = FleetSpec {
        clusters: 3,
        nodes_per_cluster: 10,
        gpus_per_node: 4,
        owners_per_cluster: 3,
        kubernetes_version: "1.36".into(),
    };
    let view = fleet(&spec, &|n| 2 + n % 3).unwrap();
    let mut w = gpu_workload(1, "1");
    w.priority = 1000;
    // More than any cluster has free (each has 10*4 - (2+3+4+...) allocated).
    w.replicas = 25;
    let mut est = Estimator::new();
    let cached = dramesh_estimator::preempt(&view, &w, &mut est, &EstimateOptions::default());
    let again = dramesh_estimator::preempt(&view, &w, &mut est, &EstimateOptions::default());
    let naive = dramesh_estimator::preempt(
        &view,
        &w,
        &mut Estimator::new(),
        &EstimateOptions {
            disable_cache: true,
            ..Default::default()
        },
    );
    assert_eq!(cached, naive);
    assert_eq!(again, naive);
    assert!(naive.chosen.is_some(), "{naive:?}");
    let c = naive
        .clusters
        .iter()
        .find(|c| Some(&c.name) == naive.chosen.as_ref())
        .unwrap();
    assert!(c.replicas_after >= 25);
    // Victims are whole workloads of lower priority.
    assert!(
        c.victims
            .iter()
            .all(|v| v.priority < 1000 && v.kind == "Deployment")
    );
}

fn low_priority_pod(
    name: &str,
    node: &str,
    owner: &str,
    priority: i32,
    claim: &str,
) -> ClusterObject {
    let pod: dramesh_model::k8s::Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet",
                                 "name": owner, "uid": "u", "controller": true}]},
        "spec": {"nodeName": node, "priority": priority,
                 "containers": [{"name": "c", "resources": {"requests": {"cpu": "16"}}}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]},
        "status": {"phase": "Running",
                   "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim}]}
    }))
    .unwrap();
    ClusterObject::Pod(Arc::new(pod))
}

#[test]
fn preemption_with_caches_equals_naive_on_random_fleets() {
    // The cached path simulates evictions incrementally (node by node); the naive path
    // re-estimates whole clusters without caches. Both must choose the same victims.
    let mut rng = Lcg(23);
    let mut chosen = 0;
    for round in 0..8 {
        let spec = random_spec(&mut rng, (4, 12), (2, 6), None);
        let nodes = spec.nodes_per_cluster;
        let salt = rng.next(1000) as usize;
        let gpus = spec.gpus_per_node;
        let alloc = move |n: usize| (n * 5 + salt) % (gpus + 1);
        let mut view = fleet(&spec, &alloc).unwrap();
        // A second workload shares one claim with a synthetic one, on some clusters.
        for c in 0..3 {
            let node = format!("c{c}-n{}", rng.next(nodes as u64));
            let claim = format!("{node}-gpu-0");
            if alloc(node.rsplit('n').next().unwrap().parse().unwrap()) > 0 {
                let pod = low_priority_pod("sharer", &node, "sharer", rng.next(400) as i32, &claim);
                view.apply_object(&format!("c{c}"), pod).unwrap();
            }
        }
        if round % 3 == 0 {
            view.apply_object("c2", shared_slice(2)).unwrap();
        }
        let mut est = Estimator::new();
        for probe in 0..3 {
            let mut w = gpu_workload(1 + rng.next(2) as i64, ["1", "30"][rng.next(2) as usize]);
            w.priority = 50 + rng.next(400) as i32;
            let fit = est.estimate(&view, &w, &EstimateOptions::default());
            let most = fit.clusters.iter().map(|c| c.max_replicas).max().unwrap();
            w.replicas = most + 1 + rng.next(2 * nodes as u64) as i64;
            // Every other probe also has workloads in flight (the reference path).
            let with = EstimateOptions {
                assumed: if probe % 2 == 1 {
                    random_assumed(&mut rng, 3, nodes).into()
                } else {
                    Vec::new().into()
                },
                ..Default::default()
            };
            let cached = dramesh_estimator::preempt(&view, &w, &mut est, &with);
            let again = dramesh_estimator::preempt(&view, &w, &mut est, &with);
            let naive = dramesh_estimator::preempt(
                &view,
                &w,
                &mut Estimator::new(),
                &EstimateOptions {
                    disable_cache: true,
                    ..with.clone()
                },
            );
            assert_eq!(cached, naive, "round {round} probe {probe}");
            assert_eq!(again, naive, "round {round} probe {probe} (warm caches)");
            if naive.chosen.is_some() {
                chosen += 1;
            }
        }
    }
    assert!(
        chosen > 3,
        "preemption should succeed in some rounds ({chosen})"
    );
}

/// Caches bounded by bytes stay within the bound while distinct workloads keep arriving, and
/// every answer equals the uncached one (issue 14 item 3).
#[test]
fn byte_bounded_caches_stay_within_bound_and_answer_the_same() {
    let spec = FleetSpec {
        clusters: 3,
        nodes_per_cluster: 60,
        gpus_per_node: 4,
        owners_per_cluster: 2,
        kubernetes_version: "1.36".into(),
    };
    let view = fleet(&spec, &|i| i % 3).unwrap();
    let workloads: Vec<Workload> = (1..=12)
        .map(|i| gpu_workload(1 + (i % 2), &format!("{}m", 100 * i)))
        .collect();
    // What one workload's caches take, unbounded.
    let mut one = Estimator::new();
    one.estimate(&view, &workloads[0], &EstimateOptions::default());
    let per_workload = one.cache_bytes();
    assert!(per_workload > 0);
    let bound = per_workload * 7 / 2;
    let mut est = Estimator::with_cache_bytes(bound);
    let mut unbounded = Estimator::new();
    for round in 0..2 {
        for (i, w) in workloads.iter().enumerate() {
            let naive = est.estimate(
                &view,
                w,
                &EstimateOptions {
                    disable_cache: true,
                    ..Default::default()
                },
            );
            let got = est.estimate(&view, w, &EstimateOptions::default());
            assert_eq!(got, naive, "round {round}, workload {i}");
            assert!(
                est.cache_bytes() <= bound,
                "round {round}, workload {i}: {} > {bound}",
                est.cache_bytes()
            );
            unbounded.estimate(&view, w, &EstimateOptions::default());
        }
    }
    // Without the bound the same requests take more than the bound.
    assert!(
        unbounded.cache_bytes() > bound,
        "{}",
        unbounded.cache_bytes()
    );
}

#[test]
fn a_passed_deadline_computes_nothing_and_leaves_no_partial_cache() {
    let spec = FleetSpec {
        clusters: 3,
        nodes_per_cluster: 12,
        gpus_per_node: 4,
        owners_per_cluster: 2,
        kubernetes_version: "1.36".into(),
    };
    let view = fleet(&spec, &|n: usize| n % 3).unwrap();
    let w = gpu_workload(1, "1");
    let mut est = Estimator::new();
    let past = EstimateOptions {
        deadline: Some(std::time::Instant::now()),
        ..Default::default()
    };
    assert!(past.past_deadline());
    let cut = est.estimate(&view, &w, &past);
    assert_eq!(cut.clusters.len(), 3);
    for c in &cut.clusters {
        assert_eq!(
            c.error.as_deref(),
            Some(dramesh_estimator::DEADLINE_EXCEEDED),
            "{c:?}"
        );
        assert_eq!(c.max_replicas, 0);
    }
    assert_eq!(est.cache_bytes(), 0, "nothing cut short is cached");
    let sets = dramesh_estimator::estimate_component_sets(&view, &[], &past);
    assert_eq!(sets.clusters.len(), 3);
    assert!(
        sets.clusters
            .iter()
            .all(|c| c.error.as_deref() == Some(dramesh_estimator::DEADLINE_EXCEEDED))
    );
    let pre = dramesh_estimator::preempt(&view, &w, &mut est, &past);
    assert!(pre.chosen.is_none());
    assert_eq!(pre.clusters.len(), 3, "{pre:?}");
    assert!(
        pre.clusters
            .iter()
            .all(|c| c.reason.as_deref() == Some(dramesh_estimator::DEADLINE_EXCEEDED)),
        "{pre:?}"
    );
    // A later call with time left answers as if the cut-short ones never happened.
    compare(&view, &mut est, &w, "after a deadline");
    let far = EstimateOptions {
        deadline: Some(std::time::Instant::now() + std::time::Duration::from_secs(600)),
        ..Default::default()
    };
    assert_eq!(
        est.estimate(&view, &w, &far),
        est.estimate(&view, &w, &EstimateOptions::default())
    );
}
