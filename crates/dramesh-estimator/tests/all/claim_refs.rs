//! Claim references resolved per member cluster (Karmada's `resourceClaimRefs`): each
//! cluster's own ResourceClaimTemplates, a template missing in one cluster, shared claims
//! present or absent, and the given templates as the fallback for clusters that publish none.
//! Built from the real dra-example-driver manifests in ../shared/fixtures/real (skipped with a
//! message when that folder is absent, failed when `CI` is set).

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use common::node;
use dramesh_estimator::{ClaimRef, EstimateOptions, Estimator, View, Workload, estimate};
use dramesh_model::{ClusterObject, Manifest, load};
use serde_json::json;

const NODE: &str = "dra-example-driver-cluster-worker";
const NS: &str = "basic-resourceclaimtemplate";

/// `shared/fixtures/real/dra-example-driver` (see `dramesh_testkit::fixtures`).
fn real() -> Option<PathBuf> {
    dramesh_testkit::fixtures("real/dra-example-driver")
}

fn load(path: PathBuf) -> Vec<Manifest> {
    load::load_path(&path)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .map(|l| l.manifest)
        .collect()
}

/// The cluster objects of the real files, in order.
fn objects(root: &std::path::Path, files: &[&str]) -> Vec<ClusterObject> {
    files
        .iter()
        .flat_map(|f| load(root.join(f)))
        .filter_map(|m| match m {
            Manifest::Object(o) => Some(o),
            _ => None,
        })
        .collect()
}

fn template(objs: &[ClusterObject], name: &str) -> Arc<dramesh_model::k8s::ResourceClaimTemplate> {
    objs.iter()
        .find_map(|o| match o {
            ClusterObject::ResourceClaimTemplate(t) if t.metadata.name.as_deref() == Some(name) => {
                Some(t.clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no template {name}"))
}

/// A kind worker with the driver's real 8-GPU slice and DeviceClass (10 pod slots).
fn gpu_cluster(view: &mut View, root: &std::path::Path, cluster: &str) {
    view.apply_object(cluster, node(NODE, "32", "128Gi", 10, json!({})))
        .unwrap();
    for o in objects(
        root,
        &[
            "resourceslice-kind-worker-gpu-profile.yaml",
            "helm/deviceclass-gpu.rendered.yaml",
        ],
    ) {
        view.apply_object(cluster, o).unwrap();
    }
}

/// The real `pod0` of the basic-resourceclaimtemplate example, without its template: its
/// claim is a reference resolved in each cluster.
fn pod0(root: &std::path::Path) -> Workload {
    let pods: Vec<Manifest> = load(root.join(
        "demo-examples/basic-resourceclaimtemplate/basic-resourceclaimtemplate.yaml",
    ))
    .into_iter()
    .filter(|m| {
        matches!(m, Manifest::Object(ClusterObject::Pod(p)) if p.metadata.name.as_deref() == Some("pod0"))
    })
    .collect();
    Workload::from_manifests(&pods).expect("workload")
}

fn answers(view: &View, w: &Workload) -> Vec<(String, i64, String)> {
    let mut cached = Estimator::new();
    let est = cached.estimate(view, w, &EstimateOptions::default());
    // The cached and the uncached path agree.
    let plain = estimate(
        view,
        w,
        &EstimateOptions {
            disable_cache: true,
            ..Default::default()
        },
    );
    assert_eq!(est, plain);
    est.clusters
        .iter()
        .map(|c| (c.name.clone(), c.max_replicas, c.limited_by.clone()))
        .collect()
}

#[test]
fn templates_are_resolved_in_each_cluster() {
    let Some(root) = real() else { return };
    let single = objects(
        &root,
        &["demo-examples/basic-resourceclaimtemplate/basic-resourceclaimtemplate.yaml"],
    );
    let multiple = objects(
        &root,
        &["demo-examples/basic-multiple-requests/basic-multiple-requests.yaml"],
    );
    let single_gpu = template(&single, "single-gpu");
    let two_gpus = template(&multiple, "multiple-gpus");
    let mut view = View::new();
    // a: the real single-gpu template (one GPU per replica).
    gpu_cluster(&mut view, &root, "a");
    view.apply_object(
        "a",
        ClusterObject::ResourceClaimTemplate(single_gpu.clone()),
    )
    .unwrap();
    // b: a template of the same name holding the real multiple-gpus spec (two GPUs).
    gpu_cluster(&mut view, &root, "b");
    let mut b_tpl = (*two_gpus).clone();
    b_tpl.metadata.namespace = Some(NS.into());
    b_tpl.metadata.name = Some("single-gpu".into());
    view.apply_object("b", ClusterObject::ResourceClaimTemplate(Arc::new(b_tpl)))
        .unwrap();
    // c: publishes templates, but not this one.
    gpu_cluster(&mut view, &root, "c");
    view.apply_object("c", ClusterObject::ResourceClaimTemplate(two_gpus.clone()))
        .unwrap();

    let w = pod0(&root);
    assert!(w.templates.is_empty(), "no template was given");
    assert_eq!(
        w.claim_refs,
        [ClaimRef::Template {
            pod_claim: "gpu".into(),
            name: "single-gpu".into()
        }]
    );
    let missing = format!("ResourceClaimTemplate {NS}/single-gpu not found in cluster c");
    assert_eq!(
        answers(&view, &w),
        [
            ("a".to_string(), 8, "devices".to_string()),
            ("b".to_string(), 4, "devices".to_string()),
            ("c".to_string(), 0, missing.clone()),
        ]
    );
    let est = estimate(&view, &w, &EstimateOptions::default());
    assert_eq!(
        est.cluster("c").and_then(|c| c.error.clone()),
        Some(missing)
    );

    // The template arriving in c later is used there (no stale memo of the error), and one
    // changing content in a is estimated with its new content.
    let mut cached = Estimator::new();
    assert_eq!(
        cached
            .estimate(&view, &w, &EstimateOptions::default())
            .total,
        12
    );
    view.apply_object(
        "c",
        ClusterObject::ResourceClaimTemplate(single_gpu.clone()),
    )
    .unwrap();
    let mut a_two = (**view
        .cluster("b")
        .unwrap()
        .claim_template(NS, "single-gpu")
        .unwrap())
    .clone();
    a_two.metadata.resource_version = Some("9".into());
    view.apply_object("a", ClusterObject::ResourceClaimTemplate(Arc::new(a_two)))
        .unwrap();
    let after = cached.estimate(&view, &w, &EstimateOptions::default());
    let got: Vec<i64> = after.clusters.iter().map(|c| c.max_replicas).collect();
    assert_eq!(got, [4, 4, 8], "{after:?}");

    // Deleting it again: 0 in c.
    view.apply(
        "c",
        &dramesh_model::ObjectChange::Delete {
            key: dramesh_model::ObjectKey::new(
                dramesh_model::ObjectKind::ResourceClaimTemplate,
                Some(NS),
                "single-gpu",
            ),
        },
    )
    .unwrap();
    let again = cached.estimate(&view, &w, &EstimateOptions::default());
    assert_eq!(again.cluster("c").map(|c| c.max_replicas), Some(0));
}

#[test]
fn given_templates_are_the_fallback_only_where_a_cluster_publishes_none() {
    let Some(root) = real() else { return };
    let multiple = objects(
        &root,
        &["demo-examples/basic-multiple-requests/basic-multiple-requests.yaml"],
    );
    let mut b_tpl = (*template(&multiple, "multiple-gpus")).clone();
    b_tpl.metadata.namespace = Some(NS.into());
    b_tpl.metadata.name = Some("single-gpu".into());
    let mut view = View::new();
    // a publishes no templates at all (an agent that does not watch them).
    gpu_cluster(&mut view, &root, "a");
    // b publishes its own single-gpu (two GPUs).
    gpu_cluster(&mut view, &root, "b");
    view.apply_object("b", ClusterObject::ResourceClaimTemplate(Arc::new(b_tpl)))
        .unwrap();
    // The real file: template and pods; pod0 is the workload (pod1 is a second workload).
    let all: Vec<Manifest> = load(
        root.join("demo-examples/basic-resourceclaimtemplate/basic-resourceclaimtemplate.yaml"),
    )
    .into_iter()
    .filter(|m| {
        !matches!(m, Manifest::Object(ClusterObject::Pod(p)) if p.metadata.name.as_deref() == Some("pod1"))
    })
    .collect();
    let w = Workload::from_manifests(&all).expect("workload");
    assert_eq!(w.templates.len(), 1, "the given template");
    assert_eq!(w.claim_refs.len(), 1);
    assert_eq!(
        answers(&view, &w),
        [
            ("a".to_string(), 8, "devices".to_string()),
            ("b".to_string(), 4, "devices".to_string()),
        ]
    );
    // Without the fallback, a is 0 naming the template.
    let bare = pod0(&root);
    let a = &answers(&view, &bare)[0];
    assert_eq!(a.1, 0);
    assert_eq!(
        a.2,
        format!("ResourceClaimTemplate {NS}/single-gpu not found in cluster a")
    );
}

#[test]
fn a_shared_claim_must_exist_but_does_not_limit_the_count() {
    let Some(root) = real() else { return };
    let dir = "demo-examples/basic-shared-claim-across-pods/basic-shared-claim-across-pods.yaml";
    let objs = objects(&root, &[dir]);
    let claim = objs
        .iter()
        .find(|o| matches!(o, ClusterObject::ResourceClaim(_)))
        .cloned()
        .expect("the shared claim");
    let mut view = View::new();
    gpu_cluster(&mut view, &root, "with");
    view.apply_object("with", claim).unwrap();
    gpu_cluster(&mut view, &root, "without");
    let pods: Vec<Manifest> = objs
        .into_iter()
        .filter(
            |o| matches!(o, ClusterObject::Pod(p) if p.metadata.name.as_deref() == Some("pod0")),
        )
        .map(Manifest::Object)
        .collect();
    let w = Workload::from_manifests(&pods).expect("workload");
    assert_eq!(w.claim_refs, [ClaimRef::Claim("single-gpu".into())]);
    let got = answers(&view, &w);
    // Every replica shares the one claim (allocated once, by the first): the 10 pod slots
    // limit, not the 8 GPUs.
    assert_eq!(got[0], ("with".to_string(), 10, "pods".to_string()));
    assert_eq!(
        got[1],
        (
            "without".to_string(),
            0,
            "ResourceClaim basic-shared-claim-across-pods/single-gpu not found in cluster without"
                .to_string()
        )
    );
}
