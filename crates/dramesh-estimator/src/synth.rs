//! Synthetic GPU fleets for benchmarks and randomized tests: typed objects built directly
//! (no YAML), so a 100-cluster fleet loads in seconds.
//!
//! Each node gets one ResourceSlice of `gpus_per_node` devices (driver `gpu.example.com`,
//! pool = node name); `allocated(cluster, node)` of them are held by one pod and one
//! allocated ResourceClaim each. Pods belong to `owners_per_cluster` Deployments with
//! priorities 0, 100, 200, ... so preemption has candidates.

use std::collections::BTreeMap;
use std::sync::Arc;

use dramesh_model::ClusterObject;
use dramesh_model::k8s::*;
use k8s_openapi::api::core::v1::{
    Container, NodeSpec, NodeStatus, PodResourceClaim, PodResourceClaimStatus, PodStatus,
    ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::view::View;

pub const DRIVER: &str = "gpu.example.com";
pub const CLASS: &str = "gpu.example.com";

fn q(s: &str) -> K8sQuantity {
    K8sQuantity(s.to_string())
}

/// The DeviceClass every synthetic cluster has.
pub fn gpu_class() -> DeviceClass {
    DeviceClass {
        metadata: ObjectMeta {
            name: Some(CLASS.into()),
            ..Default::default()
        },
        spec: DeviceClassSpec {
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: format!("device.driver == \"{DRIVER}\""),
                }),
            }]),
            ..Default::default()
        },
    }
}

pub fn node(name: &str, labels: BTreeMap<String, String>) -> Node {
    let alloc: BTreeMap<String, K8sQuantity> = [
        ("cpu", "128"),
        ("memory", "1024Gi"),
        ("pods", "110"),
        ("ephemeral-storage", "1Ti"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), q(v)))
    .collect();
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            allocatable: Some(alloc),
            ..Default::default()
        }),
    }
}

/// A node-local slice of `gpus` devices; `model` varies an attribute between shapes.
pub fn gpu_slice(node: &str, gpus: usize, model: &str) -> ResourceSlice {
    let devices = (0..gpus)
        .map(|i| Device {
            name: format!("gpu-{i}"),
            attributes: Some(
                [(
                    "model".to_string(),
                    DeviceAttribute {
                        string: Some(model.to_string()),
                        ..Default::default()
                    },
                )]
                .into_iter()
                .collect(),
            ),
            capacity: Some(
                [(
                    "memory".to_string(),
                    DeviceCapacity {
                        value: q("80Gi"),
                        ..Default::default()
                    },
                )]
                .into_iter()
                .collect(),
            ),
            ..Default::default()
        })
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(format!("{node}-{DRIVER}")),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

/// A claim holding `gpu-<device>` of `node`'s pool.
pub fn allocated_claim(ns: &str, name: &str, node: &str, device: usize) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            ..Default::default()
        },
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(vec![DeviceRequest {
                    name: "gpu".into(),
                    exactly: Some(ExactDeviceRequest {
                        device_class_name: CLASS.into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        },
        status: Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(vec![DeviceRequestAllocationResult {
                        driver: DRIVER.into(),
                        pool: node.into(),
                        device: format!("gpu-{device}"),
                        request: "gpu".into(),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
                node_selector: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_fields: Some(vec![NodeSelectorRequirement {
                            key: "metadata.name".into(),
                            operator: "In".into(),
                            values: Some(vec![node.into()]),
                        }]),
                        ..Default::default()
                    }],
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

/// A running pod on `node` owned by Deployment `owner` using claim `claim`.
pub fn gpu_pod(ns: &str, name: &str, node: &str, owner: &str, priority: i32, claim: &str) -> Pod {
    let requests: BTreeMap<String, K8sQuantity> = [
        ("cpu".to_string(), q("4")),
        ("memory".to_string(), q("32Gi")),
    ]
    .into_iter()
    .collect();
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some(
                [("pod-template-hash".to_string(), "abc12".to_string())]
                    .into_iter()
                    .collect(),
            ),
            owner_references: Some(vec![OwnerReference {
                api_version: "apps/v1".into(),
                kind: "ReplicaSet".into(),
                name: format!("{owner}-abc12"),
                uid: String::new(),
                controller: Some(true),
                ..Default::default()
            }]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            priority: Some(priority),
            containers: vec![Container {
                name: "main".into(),
                resources: Some(ResourceRequirements {
                    requests: Some(requests),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            resource_claims: Some(vec![PodResourceClaim {
                name: "gpu".into(),
                resource_claim_template_name: Some("gpu".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            resource_claim_statuses: Some(vec![PodResourceClaimStatus {
                name: "gpu".into(),
                resource_claim_name: Some(claim.into()),
            }]),
            ..Default::default()
        }),
    }
}

/// Shape of a generated fleet.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    pub clusters: usize,
    pub nodes_per_cluster: usize,
    pub gpus_per_node: usize,
    /// Deployments per cluster the pods are spread over (priorities 0, 100, ...).
    pub owners_per_cluster: usize,
    pub kubernetes_version: String,
}

/// Generates one cluster's objects; `allocated(node index)` GPUs of each node are in use.
pub fn cluster_objects(
    spec: &FleetSpec,
    cluster: usize,
    allocated: &dyn Fn(usize) -> usize,
    mut sink: impl FnMut(ClusterObject),
) {
    sink(ClusterObject::ClusterInfo(Arc::new(
        dramesh_model::ClusterInfo {
            kubernetes_version: Some(spec.kubernetes_version.clone()),
            labels: [("fleet".to_string(), "synthetic".to_string())]
                .into_iter()
                .collect(),
            region: Some(format!("region-{}", cluster % 4)),
            ..Default::default()
        },
    )));
    sink(ClusterObject::DeviceClass(Arc::new(gpu_class())));
    let owners = spec.owners_per_cluster.max(1);
    for n in 0..spec.nodes_per_cluster {
        let name = format!("c{cluster}-n{n}");
        sink(ClusterObject::Node(Arc::new(node(
            &name,
            [("gpu".to_string(), "a100".to_string())]
                .into_iter()
                .collect(),
        ))));
        sink(ClusterObject::ResourceSlice(Arc::new(gpu_slice(
            &name,
            spec.gpus_per_node,
            "A100",
        ))));
        for d in 0..allocated(n).min(spec.gpus_per_node) {
            let owner_idx = (n + d) % owners;
            let owner = format!("train-{owner_idx}");
            let claim = format!("{name}-gpu-{d}");
            sink(ClusterObject::ResourceClaim(Arc::new(allocated_claim(
                "default", &claim, &name, d,
            ))));
            sink(ClusterObject::Pod(Arc::new(gpu_pod(
                "default",
                &format!("{name}-p{d}"),
                &name,
                &owner,
                (owner_idx as i32) * 100,
                &claim,
            ))));
        }
    }
}

/// Builds a whole fleet view (`c0`, `c1`, ...).
pub fn fleet(
    spec: &FleetSpec,
    allocated: &dyn Fn(usize) -> usize,
) -> Result<View, crate::view::ApplyError> {
    let mut view = View::new();
    for c in 0..spec.clusters {
        let name = format!("c{c}");
        let mut first_error = None;
        cluster_objects(spec, c, allocated, |o| {
            if first_error.is_none()
                && let Err(e) = view.apply_object(&name, o)
            {
                first_error = Some(e);
            }
        });
        if let Some(e) = first_error {
            return Err(e);
        }
    }
    Ok(view)
}
