//! Typed synthetic GPU fleets for estimator benchmarks and randomized tests: objects are
//! built directly as k8s-openapi structs (no YAML or JSON round trip), so a 100-cluster fleet
//! loads in seconds.
//!
//! Unlike the realistic shapes of the crate root, these clusters are deliberately uniform:
//! each node gets one ResourceSlice of `gpus_per_node` identical devices (driver
//! [`DRIVER`], pool = node name), and `allocated(node index)` of them are held by one pod and
//! one allocated ResourceClaim each. Pods belong to `owners_per_cluster` Deployments with
//! priorities 0, 100, 200, ... so preemption has candidates. Output is deterministic.

use std::collections::BTreeMap;
use std::sync::Arc;

use dramesh_model::ClusterObject;
use dramesh_model::k8s::*;
use k8s_openapi::api::core::v1::{
    Container, NodeSpec, NodeStatus, PodResourceClaim, PodResourceClaimStatus, PodStatus,
    ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

/// Driver of every synthetic device.
pub const DRIVER: &str = "gpu.example.com";
/// Name of the one DeviceClass every synthetic cluster has (selects [`DRIVER`]).
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

/// A node with 128 CPUs, 1Ti of memory and room for 110 pods.
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

/// The node selector an allocation of node-local devices carries: exactly the node `node`,
/// matched by name as the scheduler writes it.
pub fn pinned_to_node(node: &str) -> NodeSelector {
    NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".into(),
                operator: "In".into(),
                values: Some(vec![node.into()]),
            }]),
            ..Default::default()
        }],
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
                node_selector: Some(pinned_to_node(node)),
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
    /// Member clusters.
    pub clusters: usize,
    /// Nodes in each cluster.
    pub nodes_per_cluster: usize,
    /// GPUs on each node.
    pub gpus_per_node: usize,
    /// Deployments per cluster the pods are spread over (priorities 0, 100, ...).
    pub owners_per_cluster: usize,
    /// Kubernetes minor version of every cluster, e.g. `1.36`.
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

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::ObjectKind;

    #[test]
    fn cluster_objects_holds_allocated_devices_with_pods_and_claims() {
        let spec = FleetSpec {
            clusters: 1,
            nodes_per_cluster: 3,
            gpus_per_node: 4,
            owners_per_cluster: 2,
            kubernetes_version: "1.36".into(),
        };
        let mut objs = Vec::new();
        // Node 2 asks for more than it has: clamped to gpus_per_node.
        cluster_objects(&spec, 0, &|n| [1, 0, 9][n], |o| objs.push(o));
        let count = |k| objs.iter().filter(|o| o.kind() == k).count();
        assert_eq!(count(ObjectKind::Node), 3);
        assert_eq!(count(ObjectKind::ResourceSlice), 3);
        assert_eq!(count(ObjectKind::DeviceClass), 1);
        assert_eq!(count(ObjectKind::Pod), 1 + 4);
        assert_eq!(count(ObjectKind::ResourceClaim), 1 + 4);
        let prios: std::collections::BTreeSet<_> = objs
            .iter()
            .filter_map(|o| match o {
                ClusterObject::Pod(p) => p.spec.as_ref().and_then(|s| s.priority),
                _ => None,
            })
            .collect();
        assert_eq!(prios.into_iter().collect::<Vec<_>>(), vec![0, 100]);
        let held: Vec<_> = objs
            .iter()
            .filter_map(|o| match o {
                ClusterObject::ResourceClaim(c) => c.status.as_ref()?.allocation.as_ref(),
                _ => None,
            })
            .map(|a| {
                let r = &a.devices.as_ref().and_then(|d| d.results.clone()).unwrap()[0];
                (r.pool.clone(), r.device.clone())
            })
            .collect();
        assert_eq!(held[0], ("c0-n0".to_string(), "gpu-0".to_string()));
        assert_eq!(held[4], ("c0-n2".to_string(), "gpu-3".to_string()));
    }

    #[test]
    fn pinned_to_node_serializes_as_the_scheduler_writes_it() {
        assert_eq!(
            serde_json::to_value(pinned_to_node("n1")).unwrap(),
            serde_json::json!({"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]})
        );
    }
}
