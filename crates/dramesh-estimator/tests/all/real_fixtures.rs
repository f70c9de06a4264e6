//! Estimates on real-world DRA manifests from ../shared/fixtures/real (skipped with a
//! message when that folder is absent, failing when `CI` is set). Expected numbers are derived
//! by hand in comments.

use crate::common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use common::*;
use dramesh_estimator::{EstimateOptions, View, Workload, estimate};
use dramesh_model::{ClusterObject, Manifest};
use serde_json::json;

#[test]
fn karmada_dra_proposal_worked_example_gives_one_replica() {
    let Some(root) = real() else { return };
    let dir = root.join("karmada");
    let mut view = View::new();
    // The proposal's node: worker-node-1 (not part of the example; generous CPU/memory so
    // only devices limit).
    view.apply_object(
        "member",
        node("worker-node-1", "64", "256Gi", 110, json!({})),
    )
    .unwrap();
    let ms = manifests(&[
        dir.join("step1-resourceslice-worker-node-1.yaml"),
        dir.join("step2-deviceclass-and-resourceclaimtemplate.yaml"),
        dir.join("step3-deployment-ml-training.yaml"),
        dir.join("step4-resourceclaim-allocated-gpu-0.yaml"),
    ]);
    let rest = feed(&mut view, "member", ms);
    let w = Workload::from_manifests(&rest).unwrap();
    assert_eq!(w.replicas, 4);
    // Two A100 80Gi GPUs, both pass the >= 40Gi selector; gpu-0 is held by an existing
    // claim, so exactly one replica can get a fresh GPU: the proposal's answer.
    let est = estimate(&view, &w, &EstimateOptions::default());
    assert_eq!(est.total, 1, "{est:?}");
    assert_eq!(est.clusters[0].limited_by, "devices");
}

fn aws_view(
    root: &Path,
) -> (
    View,
    HashMap<(String, String), Arc<dramesh_model::k8s::ResourceClaimTemplate>>,
) {
    let dir = root.join("dranet/examples/aws_eks_examples/gpu-efa");
    let mut view = View::new();
    // p4d.24xlarge: 96 vCPU, 1152 GiB; the slices are for this node name.
    view.apply_object(
        "aws",
        node(
            "ip-192-168-153-160.ec2.internal",
            "95",
            "1100Gi",
            110,
            json!({}),
        ),
    )
    .unwrap();
    let ms = manifests(&[
        dir.join("resourceslice-gpu.yaml"),
        dir.join("resourceslice-dranet.yaml"),
        dir.join("device-class.yaml"),
        root.join("nvidia-dra-driver-gpu/helm/deviceclasses.rendered.yaml"),
        dir.join("resource-claim-template.yaml"),
    ]);
    let mut rest = feed(&mut view, "aws", ms);
    rest.extend(feed(&mut view, "aws", aws_allocated_claim(&dir)));
    let mut templates = HashMap::new();
    for m in rest {
        if let Manifest::Object(ClusterObject::ResourceClaimTemplate(t)) = m {
            templates.insert(("default".to_string(), t.metadata.name.clone().unwrap()), t);
        }
    }
    (view, templates)
}

fn gpu_workload(
    templates: &HashMap<(String, String), Arc<dramesh_model::k8s::ResourceClaimTemplate>>,
    template: &str,
) -> Workload {
    let spec = json!({
        "containers": [{"name": "nccl", "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "claims": [{"name": "gpu-efa"}]}}],
        "resourceClaims": [{"name": "gpu-efa", "resourceClaimTemplateName": template}]
    });
    Workload::from_pod_spec(
        "Job",
        "default",
        "nccl",
        8,
        serde_json::from_value(spec).unwrap(),
        templates,
    )
    .unwrap()
}

#[test]
fn dranet_aws_a100_efa_unaligned() {
    let Some(root) = real() else { return };
    let (view, templates) = aws_view(&root);
    // 8 A100 GPUs and 4 EFA NICs (the other 4 dra.net devices are ENA, which the EFA class
    // excludes). One claim already holds gpu-6 and the EFA on pcie root a0. A replica needs
    // one GPU and one EFA: GPUs left 7, EFAs left 3 -> 3 replicas; CPU (95/4 = 23) and
    // memory (1100/32 = 34) do not limit.
    let est = estimate(
        &view,
        &gpu_workload(&templates, "gpu-efa-unaligned"),
        &EstimateOptions::default(),
    );
    assert_eq!(est.total, 3, "{est:?}");
    assert_eq!(est.clusters[0].limited_by, "devices");
}

#[test]
fn dranet_aws_a100_efa_aligned() {
    let Some(root) = real() else { return };
    let (view, templates) = aws_view(&root);
    // Aligned: GPU and EFA must share a pcieRoot. Each of the 4 roots has 2 GPUs and 1 EFA,
    // so a root serves one replica; root a0 is taken by the allocated claim -> 3.
    let est = estimate(
        &view,
        &gpu_workload(&templates, "gpu-efa-aligned"),
        &EstimateOptions::default(),
    );
    assert_eq!(est.total, 3, "{est:?}");
}

#[test]
fn dranet_aws_extended_resource_backed_by_dra() {
    let Some(root) = real() else { return };
    let (view, _) = aws_view(&root);
    // The node does not advertise nvidia.com/gpu; the gpu.nvidia.com class maps that name
    // (extendedResourceName), so 2 GPUs per replica come from DRA: 7 free GPUs -> 3 replicas,
    // not 0 (node allocatable) and not counted twice.
    let w = workload(
        "1",
        "1Gi",
        4,
        json!({"containers": [{"name": "c", "resources": {"requests": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}}]}),
    );
    let est = estimate(&view, &w, &EstimateOptions::default());
    assert_eq!(est.total, 3, "{est:?}");
}
