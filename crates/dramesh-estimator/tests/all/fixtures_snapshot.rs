//! End-to-end on the project's own snapshot in tests/estimator (see its README for the
//! derivation of every expected number).

use std::path::PathBuf;

use dramesh_estimator::{
    EstimateOptions, Estimator, QuotaSet, Strategy, estimate, load_snapshot, load_workload, place,
    preempt,
};
use serde_json::json;

fn dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/estimator"
    ))
}

#[test]
fn snapshot_estimate_per_cluster() {
    let view = load_snapshot(&dir().join("fleet")).unwrap();
    assert_eq!(view.cluster_names(), ["cpu-only", "gpu-east", "gpu-west"]);
    assert_eq!(
        view.cluster("gpu-west").unwrap().kubernetes_version(),
        Some("1.35")
    );
    let w = load_workload(&[dir().join("workload")]).unwrap();
    assert_eq!(w.priority, 1000);
    assert_eq!(w.replicas, 6);
    let est = estimate(&view, &w, &EstimateOptions::default());
    let get = |n: &str| est.cluster(n).unwrap();
    assert_eq!(get("gpu-east").max_replicas, 6);
    assert_eq!(get("gpu-east").limited_by, "devices");
    assert_eq!(get("gpu-west").max_replicas, 2);
    // No DeviceClass and no devices in cpu-only: the claim cannot be allocated there.
    assert_eq!(get("cpu-only").max_replicas, 0);
    assert_eq!(est.total, 8);
    // JSON shape the CLI prints.
    let v = serde_json::to_value(&est).unwrap();
    assert_eq!(v["clusters"][1]["maxReplicas"], json!(6));
    assert_eq!(v["total"], json!(8));
}

#[test]
fn snapshot_taint_excludes_node_without_toleration() {
    let view = load_snapshot(&dir().join("fleet")).unwrap();
    let mut w = load_workload(&[dir().join("workload")]).unwrap();
    w.node_claim.tolerations.clear();
    w.refresh_fingerprint();
    let est = estimate(&view, &w, &EstimateOptions::default());
    let east = est.cluster("gpu-east").unwrap();
    assert_eq!(east.max_replicas, 2);
    assert_eq!(east.excluded_nodes.get("taints"), Some(&1));
}

#[test]
fn snapshot_placement_dynamic_weight() {
    let view = load_snapshot(&dir().join("fleet")).unwrap();
    let w = load_workload(&[dir().join("workload")]).unwrap();
    let policy = w.policy.clone().unwrap();
    assert_eq!(policy.strategy, Strategy::DynamicWeight);
    let mut est = Estimator::new();
    let p = place(&view, &w, &policy, &mut est, &EstimateOptions::default());
    assert_eq!(p.unschedulable, None);
    assert_eq!(p.filtered_out, ["cpu-only"]);
    // Webster over available 6:2 for 6 replicas.
    let got: Vec<(String, i64)> = p
        .clusters
        .iter()
        .map(|t| (t.name.clone(), t.replicas))
        .collect();
    assert_eq!(
        got,
        [("gpu-east".to_string(), 4), ("gpu-west".to_string(), 2)]
    );
    // 9 replicas exceed the 8 available: unschedulable.
    let mut big = w.clone();
    big.replicas = 9;
    let p = place(&view, &big, &policy, &mut est, &EstimateOptions::default());
    assert!(p.unschedulable.is_some());
    assert!(p.clusters.is_empty());
}

#[test]
fn snapshot_preemption_picks_lowest_victim_priority() {
    let view = load_snapshot(&dir().join("fleet")).unwrap();
    let mut w = load_workload(&[dir().join("workload")]).unwrap();
    w.replicas = 8;
    let mut est = Estimator::new();
    let r = preempt(&view, &w, &mut est, &EstimateOptions::default());
    assert_eq!(r.fits_without_preemption, None);
    // Both GPU clusters fit 8 after evicting their batch workload; gpu-west's victim has
    // priority 50 against gpu-east's 100.
    assert_eq!(r.chosen.as_deref(), Some("gpu-west"));
    let west = r.clusters.iter().find(|c| c.name == "gpu-west").unwrap();
    assert_eq!(west.victims.len(), 1);
    assert_eq!(west.victims[0].name, "batch-west");
    assert_eq!(west.victims[0].kind, "Deployment");
    assert_eq!(west.victims[0].pods, 6);
    assert_eq!(west.replicas_after, 8);
    assert_eq!(west.freed.get("cpu").map(String::as_str), Some("24"));
    let east = r.clusters.iter().find(|c| c.name == "gpu-east").unwrap();
    assert!(east.feasible);
    assert_eq!(east.highest_victim_priority, Some(100));
    let cpu = r.clusters.iter().find(|c| c.name == "cpu-only").unwrap();
    assert!(!cpu.feasible);
    // A workload that fits needs no preemption.
    w.replicas = 5;
    let r = preempt(&view, &w, &mut est, &EstimateOptions::default());
    assert_eq!(r.fits_without_preemption.as_deref(), Some("gpu-east"));
}

#[test]
fn snapshot_quota_caps_estimate() {
    let view = load_snapshot(&dir().join("fleet")).unwrap();
    let w = load_workload(&[dir().join("workload")]).unwrap();
    let quotas = QuotaSet::from_value(json!({
        "deviceClassMappings": [{"name": "example.com/gpu", "deviceClassNames": ["gpu.nvidia.com"]}],
        "clusters": {
            "gpu-east": {"nominal": {"example.com/gpu": "8"}, "used": {"example.com/gpu": "5"}},
            "gpu-west": {"nominal": {"cpu": "20"}}
        }
    }))
    .unwrap();
    let est = estimate(
        &view,
        &w,
        &EstimateOptions {
            quotas: Some(quotas),
            ..Default::default()
        },
    );
    let east = est.cluster("gpu-east").unwrap();
    // 8 - 5 = 3 GPUs of quota left, one per replica.
    assert_eq!(east.max_replicas, 3);
    assert_eq!(east.limited_by, "quota:example.com/gpu");
    // 20 CPUs of quota, 8 per replica -> 2, equal to the device limit (not lowered).
    assert_eq!(est.cluster("gpu-west").unwrap().max_replicas, 2);
    assert!(
        QuotaSet::from_value(json!({"clusters": {"x": {"nominal": {"cpu": "lots"}}}})).is_err()
    );
}

#[test]
fn missing_template_is_an_error_naming_it() {
    let tmp = std::env::temp_dir().join(format!("dramesh-est-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let f = tmp.join("w.yaml");
    std::fs::write(
        &f,
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x, namespace: ml}\nspec:\n  selector: {matchLabels: {a: b}}\n  template:\n    spec:\n      containers: [{name: c, image: i}]\n      resourceClaims: [{name: g, resourceClaimTemplateName: nope}]\n",
    )
    .unwrap();
    // A template the files do not give is looked up in each member cluster, and one that a
    // cluster lacks answers 0 there, naming it.
    let w = load_workload(&[&f]).unwrap();
    std::fs::remove_dir_all(&tmp).unwrap();
    let view = load_snapshot(&dir().join("fleet")).unwrap();
    let est = estimate(&view, &w, &EstimateOptions::default());
    for c in &est.clusters {
        assert_eq!(c.max_replicas, 0, "{c:?}");
        assert_eq!(
            c.error.as_deref(),
            Some(
                format!(
                    "ResourceClaimTemplate ml/nope not found in cluster {}",
                    c.name
                )
                .as_str()
            )
        );
    }
}

/// A cluster folder that is a symbolic link is read like any other; a broken link fails naming
/// it instead of leaving the cluster out.
#[cfg(unix)]
#[test]
fn symlinked_cluster_folders_are_followed_and_broken_links_fail() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = tmp.path().join("snap");
    let elsewhere = tmp.path().join("elsewhere");
    for d in [snap.join("a"), elsewhere.clone()] {
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("node.yaml"),
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: n1\n",
        )
        .unwrap();
    }
    std::os::unix::fs::symlink(&elsewhere, snap.join("b")).unwrap();
    let view = dramesh_estimator::load_snapshot(&snap).unwrap();
    assert_eq!(view.cluster_names(), vec!["a".to_string(), "b".to_string()]);

    std::os::unix::fs::symlink(tmp.path().join("missing"), snap.join("c")).unwrap();
    let e = dramesh_estimator::load_snapshot(&snap)
        .unwrap_err()
        .to_string();
    assert!(e.contains("snap/c"), "{e}");
}

/// Clusters the caller marks stale are never chosen: placement leaves them out and says so,
/// preemption neither answers "fits without preemption" nor chooses them.
#[test]
fn stale_clusters_are_never_chosen() {
    let view = load_snapshot(&dir().join("fleet")).unwrap();
    let w = load_workload(&[dir().join("workload")]).unwrap();
    let policy = w.policy.clone().unwrap();
    let mut est = Estimator::new();
    let west_stale = EstimateOptions {
        stale: vec!["gpu-west".into()],
        ..EstimateOptions::default()
    };
    // 6 replicas fit on gpu-east alone.
    let p = place(&view, &w, &policy, &mut est, &west_stale);
    assert_eq!(p.unschedulable, None);
    assert_eq!(p.stale, ["gpu-west"]);
    assert_eq!(p.clusters.len(), 1);
    assert_eq!(p.clusters[0].name, "gpu-east");
    assert!(!p.available.contains_key("gpu-west"), "{p:?}");
    // 7 do not, and the reason names the stale cluster that was not considered.
    let mut seven = w.clone();
    seven.replicas = 7;
    let p = place(&view, &seven, &policy, &mut est, &west_stale);
    let why = p.unschedulable.unwrap();
    assert!(why.contains("data stale: gpu-west"), "{why}");
    // Every matching cluster stale: nothing is placed, and the reason says why.
    let all_stale = EstimateOptions {
        stale: vec!["gpu-east".into(), "gpu-west".into()],
        ..EstimateOptions::default()
    };
    let p = place(&view, &w, &policy, &mut est, &all_stale);
    assert!(p.clusters.is_empty());
    let why = p.unschedulable.unwrap();
    assert!(why.contains("stale data: gpu-east, gpu-west"), "{why}");

    // Preemption: gpu-west (the lowest victim priority) is stale, so gpu-east is chosen.
    let mut eight = w.clone();
    eight.replicas = 8;
    let r = preempt(&view, &eight, &mut est, &west_stale);
    assert_eq!(r.chosen.as_deref(), Some("gpu-east"));
    let west = r.clusters.iter().find(|c| c.name == "gpu-west").unwrap();
    assert!(!west.feasible && west.victims.is_empty());
    assert!(
        west.reason.as_deref().unwrap().contains("stale"),
        "{west:?}"
    );
    // A workload that fits only on a stale cluster does not "fit without preemption" there.
    let mut five = w.clone();
    five.replicas = 5;
    let east_stale = EstimateOptions {
        stale: vec!["gpu-east".into()],
        ..EstimateOptions::default()
    };
    let r = preempt(&view, &five, &mut est, &east_stale);
    assert_eq!(r.fits_without_preemption, None);
    assert_ne!(r.chosen.as_deref(), Some("gpu-east"));
}
