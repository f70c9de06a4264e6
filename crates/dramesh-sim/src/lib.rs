//! Synthetic member clusters whose DRA inventories follow what real drivers publish.
//!
//! Node shapes are modelled on public driver output: an AWS p4d-style node (8 A100 GPUs from
//! `gpu.nvidia.com` and 4 EFA NICs from `dra.net`, paired on `resource.kubernetes.io/pcieRoot`),
//! an H100 node whose GPUs are partitionable into MIG slices through shared counters
//! (KEP-4815), an L4 node whose GPUs are shared by consumable memory (KEP-5075), and a plain
//! T4 node. Generation is deterministic: the same [`ClusterSpec`] always yields the same
//! objects, so benchmarks, the demo and the chaos suite agree on what a fleet is.
//!
//! [`typed`] builds a second, deliberately uniform kind of fleet (one anonymous GPU model,
//! typed structs, no JSON decode) for estimator benchmarks and randomized tests, where load
//! speed and exact control over which device each claim holds matter more than realism.

pub mod typed;

use std::path::Path;
use std::sync::Arc;

use dramesh_model::load::decode_value;
use dramesh_model::object::{ClusterInfo, ClusterObject};
use serde_json::{Value, json};

/// The kinds of node the generator builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeShape {
    /// 8 x A100-SXM4-40GB and 4 EFA NICs, two GPUs and one NIC per PCIe root.
    A100Efa,
    /// 8 x H100-80GB, each offered whole or as MIG slices drawing on per-GPU counters.
    H100Mig,
    /// 4 x L4 (24Gi) shared by memory: `allowMultipleAllocations` with a request policy.
    L4Shared,
    /// 4 x T4, one device each.
    T4,
}

impl NodeShape {
    /// GPUs per node of this shape.
    pub fn gpus(self) -> usize {
        match self {
            NodeShape::A100Efa | NodeShape::H100Mig => 8,
            NodeShape::L4Shared | NodeShape::T4 => 4,
        }
    }

    fn instance(self) -> &'static str {
        match self {
            NodeShape::A100Efa => "p4d.24xlarge",
            NodeShape::H100Mig => "p5.48xlarge",
            NodeShape::L4Shared => "g6.12xlarge",
            NodeShape::T4 => "g4dn.12xlarge",
        }
    }

    fn cpu_memory(self) -> (&'static str, &'static str) {
        match self {
            NodeShape::A100Efa => ("96", "1152Gi"),
            NodeShape::H100Mig => ("192", "2048Gi"),
            NodeShape::L4Shared => ("48", "192Gi"),
            NodeShape::T4 => ("48", "192Gi"),
        }
    }
}

/// One group of identical nodes.
#[derive(Debug, Clone)]
pub struct NodeGroup {
    /// The node type.
    pub shape: NodeShape,
    /// Number of nodes.
    pub count: usize,
    /// Fraction (0..=1) of each node's GPUs already taken by running pods.
    pub used_fraction: f64,
}

/// One member cluster to generate.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Member cluster name.
    pub name: String,
    /// Kubernetes minor version, e.g. `1.36`.
    pub kubernetes_version: String,
    /// Region label value of its nodes.
    pub region: String,
    /// Its nodes.
    pub groups: Vec<NodeGroup>,
}

/// A generated cluster.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// Member cluster name.
    pub name: String,
    /// Every object the cluster's agent would publish.
    pub objects: Vec<ClusterObject>,
}

fn decode<T: serde::de::DeserializeOwned + serde::Serialize>(v: Value) -> Arc<T> {
    // The generator builds these values itself; a failure is a bug in this file.
    match decode_value(v) {
        Ok(t) => Arc::new(t),
        Err(e) => panic!("dramesh-sim produced an invalid object: {e}"),
    }
}

/// DeviceClasses shared by every generated cluster (the NVIDIA driver's classes, an EFA
/// class as AWS documents it, and a class for shared L4 memory).
pub fn device_classes() -> Vec<ClusterObject> {
    let class = |name: &str, expr: &str, ext: Option<&str>| {
        let mut spec = json!({"selectors": [{"cel": {"expression": expr}}]});
        if let Some(e) = ext {
            spec["extendedResourceName"] = json!(e);
        }
        ClusterObject::DeviceClass(decode(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": name}, "spec": spec
        })))
    };
    vec![
        class(
            "gpu.nvidia.com",
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
            Some("nvidia.com/gpu"),
        ),
        class(
            "mig.nvidia.com",
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
            None,
        ),
        class(
            "efa.networking.k8s.aws",
            "device.driver == \"dra.net\" && device.attributes[\"dra.net\"].pciDevice == 'Elastic Fabric Adapter (EFA)'",
            None,
        ),
        class(
            "shared-gpu.nvidia.com",
            "device.driver == 'gpu.nvidia.com' && device.allowMultipleAllocations",
            None,
        ),
    ]
}

fn node(name: &str, shape: NodeShape, zone: &str) -> ClusterObject {
    let (cpu, mem) = shape.cpu_memory();
    let alloc = json!({"cpu": cpu, "memory": mem, "pods": "110", "ephemeral-storage": "400Gi"});
    ClusterObject::Node(decode(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name,
            "node.kubernetes.io/instance-type": shape.instance(),
            "topology.kubernetes.io/zone": zone,
            "nvidia.com/gpu.present": "true"
        }},
        "status": {"allocatable": alloc.clone(), "capacity": alloc}
    })))
}

fn gpu_attrs(product: &str, arch: &str, root: usize, index: usize, uuid: &str) -> Value {
    json!({
        "type": {"string": "gpu"},
        "productName": {"string": product},
        "architecture": {"string": arch},
        "brand": {"string": "Nvidia"},
        "cudaComputeCapability": {"version": if arch == "Hopper" { "9.0.0" } else if arch == "Ada Lovelace" { "8.9.0" } else if arch == "Turing" { "7.5.0" } else { "8.0.0" }},
        "driverVersion": {"version": "580.126.9"},
        "index": {"int": index},
        "uuid": {"string": uuid},
        "resource.kubernetes.io/pcieRoot": {"string": format!("pci0000:{:02x}", 0x10 * (root + 1))},
        "resource.kubernetes.io/pciBusID": {"string": format!("0000:{:02x}:1{}.0", 0x10 * (root + 1), index % 2 + 0xc)}
    })
}

/// A node-local slice; `pool_slices` is the pool's `resourceSliceCount`. `content` is
/// `("devices", [...])` or `("sharedCounters", [...])`: v1 allows one of them per slice.
fn slice(
    name: String,
    driver: &str,
    node: &str,
    pool_slices: u32,
    content: (&str, Value),
) -> ClusterObject {
    let mut spec = json!({
        "driver": driver, "nodeName": node,
        "pool": {"name": node, "generation": 1, "resourceSliceCount": pool_slices},
    });
    spec[content.0] = content.1;
    ClusterObject::ResourceSlice(decode(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name}, "spec": spec
    })))
}

fn uuid(cluster: &str, node: &str, i: usize) -> String {
    // Stable, unique per (cluster, node, index): FNV-1a is enough for test identifiers.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in cluster
        .bytes()
        .chain(node.bytes())
        .chain((i as u64).to_le_bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        h >> 32,
        (h >> 16) & 0xffff,
        h & 0xffff,
        i,
        h & 0xffff_ffff_ffff
    )
}

/// The ResourceSlices a node of `shape` publishes.
pub fn node_slices(cluster: &str, node: &str, shape: NodeShape) -> Vec<ClusterObject> {
    let gpus = shape.gpus();
    match shape {
        NodeShape::A100Efa | NodeShape::T4 => {
            let (product, arch, mem) = if shape == NodeShape::A100Efa {
                ("NVIDIA A100-SXM4-40GB", "Ampere", "40Gi")
            } else {
                ("Tesla T4", "Turing", "16Gi")
            };
            let devices: Vec<Value> = (0..gpus)
                .map(|i| {
                    json!({
                        "name": format!("gpu-{i}"),
                        "attributes": gpu_attrs(product, arch, i / 2, i, &uuid(cluster, node, i)),
                        "capacity": {"memory": {"value": mem}}
                    })
                })
                .collect();
            let mut out = vec![slice(
                format!("{node}-gpu.nvidia.com"),
                "gpu.nvidia.com",
                node,
                1,
                ("devices", json!(devices)),
            )];
            if shape == NodeShape::A100Efa {
                let nics: Vec<Value> = (0..4)
                    .map(|r| json!({
                        "name": format!("pci-0000-{:02x}-1b-0", 0x10 * (r + 1)),
                        "attributes": {
                            "dra.net/pciDevice": {"string": "Elastic Fabric Adapter (EFA)"},
                            "dra.net/pciVendor": {"string": "Amazon.com, Inc."},
                            "dra.net/rdma": {"bool": true},
                            "dra.net/numaNode": {"int": r / 2},
                            "resource.kubernetes.io/pcieRoot": {"string": format!("pci0000:{:02x}", 0x10 * (r + 1))}
                        }
                    }))
                    .collect();
                out.push(slice(
                    format!("{node}-dra.net"),
                    "dra.net",
                    node,
                    1,
                    ("devices", json!(nics)),
                ));
            }
            out
        }
        NodeShape::H100Mig => {
            // One counter set per physical GPU: 7 compute slices and 8 memory slices (10Gi each).
            let counters: Vec<Value> = (0..gpus)
                .map(|g| json!({"name": format!("gpu-{g}-counters"), "counters": {
                    "compute": {"value": "7"}, "memory-slices": {"value": "8"}, "memory": {"value": "80Gi"}
                }}))
                .collect();
            let mut devices = Vec::new();
            for g in 0..gpus {
                let cs = format!("gpu-{g}-counters");
                let mut whole = gpu_attrs(
                    "NVIDIA H100 80GB HBM3",
                    "Hopper",
                    g / 2,
                    g,
                    &uuid(cluster, node, g),
                );
                whole["parentUUID"] = json!({"string": uuid(cluster, node, g)});
                devices.push(json!({
                    "name": format!("gpu-{g}"), "attributes": whole,
                    "capacity": {"memory": {"value": "80Gi"}},
                    "consumesCounters": [{"counterSet": cs, "counters": {"compute": {"value": "7"}, "memory-slices": {"value": "8"}, "memory": {"value": "80Gi"}}}]
                }));
                for (profile, count, compute, slices, mem) in [
                    ("3g.40gb", 2, "3", "4", "40Gi"),
                    ("1g.10gb", 7, "1", "1", "10Gi"),
                ] {
                    for k in 0..count {
                        let mut attrs = gpu_attrs(
                            "NVIDIA H100 80GB HBM3",
                            "Hopper",
                            g / 2,
                            g,
                            &uuid(cluster, node, g),
                        );
                        attrs["type"] = json!({"string": "mig"});
                        attrs["profile"] = json!({"string": profile});
                        attrs["parentUUID"] = json!({"string": uuid(cluster, node, g)});
                        devices.push(json!({
                            "name": format!("gpu-{g}-mig-{profile}-{k}").replace('.', "-"),
                            "attributes": attrs,
                            "capacity": {"memory": {"value": mem}},
                            "consumesCounters": [{"counterSet": cs, "counters": {"compute": {"value": compute}, "memory-slices": {"value": slices}, "memory": {"value": mem}}}]
                        }));
                    }
                }
            }
            // Counters and devices live in separate slices of one pool, as 1.35+ requires.
            vec![
                slice(
                    format!("{node}-gpu.nvidia.com-counters"),
                    "gpu.nvidia.com",
                    node,
                    2,
                    ("sharedCounters", json!(counters)),
                ),
                slice(
                    format!("{node}-gpu.nvidia.com"),
                    "gpu.nvidia.com",
                    node,
                    2,
                    ("devices", json!(devices)),
                ),
            ]
        }
        NodeShape::L4Shared => {
            let devices: Vec<Value> = (0..gpus)
                .map(|i| json!({
                    "name": format!("gpu-{i}"),
                    "allowMultipleAllocations": true,
                    "attributes": gpu_attrs("NVIDIA L4", "Ada Lovelace", i / 2, i, &uuid(cluster, node, i)),
                    "capacity": {"memory": {"value": "24Gi", "requestPolicy": {
                        "default": "4Gi", "validRange": {"min": "1Gi", "step": "1Gi"}
                    }}}
                }))
                .collect();
            vec![slice(
                format!("{node}-gpu.nvidia.com"),
                "gpu.nvidia.com",
                node,
                1,
                ("devices", json!(devices)),
            )]
        }
    }
}

/// A running pod that holds `gpus` whole GPUs of `node` through an allocated claim.
fn gpu_pod(
    cluster: &str,
    node: &str,
    owner: &str,
    priority: i32,
    index: usize,
    devices: &[String],
) -> Vec<ClusterObject> {
    let pod_name = format!("{owner}-{index}");
    let claim_name = format!("{pod_name}-gpu");
    let results: Vec<Value> = devices
        .iter()
        .map(|d| json!({"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": d}))
        .collect();
    let claim = ClusterObject::ResourceClaim(decode(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": claim_name, "namespace": "ml", "uid": format!("{cluster}-{claim_name}")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": devices.len()}}]}},
        "status": {
            "allocation": {
                "devices": {"results": results},
                "nodeSelector": typed::pinned_to_node(node)
            },
            "reservedFor": [{"resource": "pods", "name": pod_name, "uid": format!("{cluster}-{pod_name}")}]
        }
    })));
    let pod = ClusterObject::Pod(decode(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name, "namespace": "ml", "uid": format!("{cluster}-{pod_name}"),
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner, "uid": format!("{cluster}-{owner}"), "controller": true}]},
        "spec": {
            "nodeName": node, "priority": priority, "priorityClassName": if priority >= 1000 { "high" } else { "batch-low" },
            "containers": [{"name": "train", "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": format!("{owner}-gpu")}]
        },
        "status": {"phase": "Running", "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim_name}]}
    })));
    vec![pod, claim]
}

/// Builds one cluster.
pub fn generate(spec: &ClusterSpec) -> Cluster {
    let mut objects = vec![ClusterObject::ClusterInfo(Arc::new(ClusterInfo {
        kubernetes_version: Some(spec.kubernetes_version.clone()),
        labels: [
            ("region".to_string(), spec.region.clone()),
            ("dramesh.io/gpu".to_string(), "true".to_string()),
        ]
        .into_iter()
        .collect(),
        provider: Some("aws".into()),
        region: Some(spec.region.clone()),
        zone: None,
    }))];
    objects.extend(device_classes());
    let mut pod_index = 0;
    for (gi, g) in spec.groups.iter().enumerate() {
        for n in 0..g.count {
            let name = format!(
                "{}-{}-{gi}-{n:05}",
                spec.name,
                g.shape.instance().replace('.', "-")
            );
            let zone = format!("{}{}", spec.region, ["a", "b", "c"][n % 3]);
            objects.push(node(&name, g.shape, &zone));
            objects.extend(node_slices(&spec.name, &name, g.shape));
            let used = ((g.shape.gpus() as f64) * g.used_fraction.clamp(0.0, 1.0)).round() as usize;
            if used > 0 && g.shape != NodeShape::L4Shared && g.shape != NodeShape::H100Mig {
                // Whole-GPU training pods, two GPUs each, of two owners with different priorities.
                for p in 0..used.div_ceil(2) {
                    let devs: Vec<String> = (p * 2..(p * 2 + 2).min(used))
                        .map(|i| format!("gpu-{i}"))
                        .collect();
                    let (owner, prio) = if pod_index % 2 == 0 {
                        ("train-batch", 100)
                    } else {
                        ("serve-llm", 1000)
                    };
                    objects.extend(gpu_pod(&spec.name, &name, owner, prio, pod_index, &devs));
                    pod_index += 1;
                }
            }
        }
    }
    Cluster {
        name: spec.name.clone(),
        objects,
    }
}

/// The demo's default fleet: three member clusters of different shapes and versions.
pub fn demo_fleet() -> Vec<ClusterSpec> {
    vec![
        ClusterSpec {
            name: "us-east-train".into(),
            kubernetes_version: "1.36".into(),
            region: "us-east-1".into(),
            groups: vec![NodeGroup {
                shape: NodeShape::A100Efa,
                count: 4,
                used_fraction: 0.5,
            }],
        },
        ClusterSpec {
            name: "us-west-mig".into(),
            kubernetes_version: "1.36".into(),
            region: "us-west-2".into(),
            groups: vec![
                NodeGroup {
                    shape: NodeShape::H100Mig,
                    count: 2,
                    used_fraction: 0.0,
                },
                NodeGroup {
                    shape: NodeShape::L4Shared,
                    count: 3,
                    used_fraction: 0.0,
                },
            ],
        },
        ClusterSpec {
            name: "eu-central-infer".into(),
            kubernetes_version: "1.34".into(),
            region: "eu-central-1".into(),
            groups: vec![NodeGroup {
                shape: NodeShape::T4,
                count: 6,
                used_fraction: 0.75,
            }],
        },
    ]
}

/// A large uniform fleet for benchmarks: `clusters` x `nodes` A100 nodes, every GPU in use
/// by one pod with one allocated claim when `full` is set.
pub fn uniform_fleet(clusters: usize, nodes: usize, used_fraction: f64) -> Vec<ClusterSpec> {
    (0..clusters)
        .map(|c| ClusterSpec {
            name: format!("member-{c:03}"),
            kubernetes_version: "1.36".into(),
            region: ["us-east-1", "us-west-2", "eu-central-1"][c % 3].into(),
            groups: vec![NodeGroup {
                shape: NodeShape::A100Efa,
                count: nodes,
                used_fraction,
            }],
        })
        .collect()
}

/// The file of a snapshot folder an object goes to.
fn snapshot_file(o: &ClusterObject) -> &'static str {
    match o {
        ClusterObject::ClusterInfo(_) => "cluster.yaml",
        ClusterObject::Node(_) => "nodes.yaml",
        ClusterObject::Pod(_) => "pods.yaml",
        ClusterObject::ResourceSlice(_) => "resourceslices.yaml",
        ClusterObject::DeviceClass(_) => "deviceclasses.yaml",
        ClusterObject::ResourceClaim(_) => "resourceclaims.yaml",
        ClusterObject::DeviceTaintRule(_) => "devicetaintrules.yaml",
        ClusterObject::ResourceClaimTemplate(_) => "resourceclaimtemplates.yaml",
        ClusterObject::NodePool(_) => "nodepools.yaml",
        ClusterObject::NodeClaim(_) => "nodeclaims.yaml",
    }
}

/// Writes a cluster as a snapshot folder: `dir/<cluster>/{cluster.yaml, <kind>s.yaml}`.
pub fn write_snapshot(dir: &Path, cluster: &Cluster) -> std::io::Result<()> {
    write_snapshot_files(dir, cluster, |_| true)
}

/// Writes only the file `file` (`nodes.yaml`, `resourceclaims.yaml`, ...) of the snapshot
/// folder [`write_snapshot`] writes, as it would write it, or removes it when no object of
/// `cluster` belongs there: the cheap path when a change touched one kind (the chaos driver
/// at hundreds of changes per second).
pub fn write_snapshot_file(dir: &Path, cluster: &Cluster, file: &str) -> std::io::Result<()> {
    write_snapshot_files(dir, cluster, |f| f == file)?;
    let path = dir.join(&cluster.name).join(file);
    if !cluster.objects.iter().any(|o| snapshot_file(o) == file) && path.exists() {
        std::fs::remove_file(path)?;
    }
    Ok(())
}

/// Writes the files of the snapshot folder that `write` accepts (each atomically: a
/// temporary file renamed over it).
fn write_snapshot_files(
    dir: &Path,
    cluster: &Cluster,
    write: impl Fn(&str) -> bool,
) -> std::io::Result<()> {
    let cdir = dir.join(&cluster.name);
    std::fs::create_dir_all(&cdir)?;
    let mut by_file: std::collections::BTreeMap<&str, Vec<Value>> = Default::default();
    for o in cluster.objects.iter().filter(|o| write(snapshot_file(o))) {
        let mut v: Value = serde_json::from_slice(&o.to_json()).map_err(std::io::Error::other)?;
        if let ClusterObject::ClusterInfo(_) = o {
            v = json!({"apiVersion": "dramesh.io/v1", "kind": "ClusterInfo", "spec": v});
        }
        by_file.entry(snapshot_file(o)).or_default().push(v);
    }
    for (file, docs) in by_file {
        let mut text = String::new();
        for d in docs {
            text.push_str("---\n");
            text.push_str(&serde_norway::to_string(&d).map_err(std::io::Error::other)?);
        }
        let tmp = cdir.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, cdir.join(file))?;
    }
    Ok(())
}

/// A Karmada `Cluster` named `name` (label `name: <name>`, push mode) as its status controller
/// reports it: `Ready` (or not, per `ready`) and serving every API of
/// [`karmada_api_enablements`], so no scheduler filter refuses it for a missing API.
pub fn karmada_cluster(name: &str, ready: bool) -> Value {
    json!({"apiVersion": "cluster.karmada.io/v1alpha1", "kind": "Cluster",
        "metadata": {"name": name, "labels": {"name": name}},
        "spec": {"syncMode": "Push"},
        "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
            "reason": "", "message": "", "lastTransitionTime": "2026-11-25T12:00:00Z"}],
            "apiEnablements": karmada_api_enablements()}})
}

/// `status.apiEnablements` of a member cluster that serves the built-in workload kinds and
/// the common training CRDs (RayJob, RayCluster, TrainJob, PyTorchJob), as Karmada's
/// cluster status controller writes it: Karmada's scheduler places a resource only on
/// clusters listing its group/version and kind.
pub fn karmada_api_enablements() -> Value {
    let apis: [(&str, &[(&str, &str)]); 6] = [
        (
            "v1",
            &[
                ("pods", "Pod"),
                ("configmaps", "ConfigMap"),
                ("namespaces", "Namespace"),
            ],
        ),
        (
            "apps/v1",
            &[
                ("deployments", "Deployment"),
                ("statefulsets", "StatefulSet"),
                ("replicasets", "ReplicaSet"),
                ("daemonsets", "DaemonSet"),
            ],
        ),
        ("batch/v1", &[("jobs", "Job"), ("cronjobs", "CronJob")]),
        (
            "ray.io/v1",
            &[("rayjobs", "RayJob"), ("rayclusters", "RayCluster")],
        ),
        (
            "trainer.kubeflow.org/v1alpha1",
            &[("trainjobs", "TrainJob")],
        ),
        ("kubeflow.org/v1", &[("pytorchjobs", "PyTorchJob")]),
    ];
    Value::Array(
        apis.iter()
            .map(|(gv, resources)| {
                let r: Vec<Value> = resources
                    .iter()
                    .map(|(name, kind)| json!({"name": name, "kind": kind}))
                    .collect();
                json!({"groupVersion": gv, "resources": r})
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::load::load_path;
    use dramesh_model::{Manifest, ObjectKind};

    #[test]
    fn demo_fleet_round_trips_through_the_loader() {
        let dir = tempfile::tempdir().unwrap();
        for spec in demo_fleet() {
            let c = generate(&spec);
            write_snapshot(dir.path(), &c).unwrap();
            let loaded = load_path(&dir.path().join(&c.name)).unwrap();
            assert_eq!(loaded.len(), c.objects.len(), "{}", c.name);
            let mut keys: Vec<_> = loaded
                .iter()
                .map(|l| match &l.manifest {
                    Manifest::Object(o) => o.key(),
                    other => panic!("unexpected {}", other.kind()),
                })
                .collect();
            let mut want: Vec<_> = c.objects.iter().map(ClusterObject::key).collect();
            keys.sort();
            want.sort();
            assert_eq!(keys, want);
        }
    }

    #[test]
    fn one_file_is_written_as_the_whole_snapshot_writes_it_and_removed_when_empty() {
        let (whole, one) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mut c = generate(&demo_fleet()[0]);
        write_snapshot(whole.path(), &c).unwrap();
        write_snapshot_file(one.path(), &c, "nodes.yaml").unwrap();
        let read = |d: &tempfile::TempDir, f: &str| std::fs::read(d.path().join(&c.name).join(f));
        assert_eq!(
            read(&one, "nodes.yaml").unwrap(),
            read(&whole, "nodes.yaml").unwrap()
        );
        assert!(
            read(&one, "resourceslices.yaml").is_err(),
            "only the file asked for"
        );
        c.objects.retain(|o| !matches!(o, ClusterObject::Node(_)));
        write_snapshot_file(one.path(), &c, "nodes.yaml").unwrap();
        assert!(
            read(&one, "nodes.yaml").is_err(),
            "no node left: the file is removed"
        );
    }

    #[test]
    fn shapes_have_expected_devices() {
        let count = |shape| -> usize {
            node_slices("c", "n", shape)
                .iter()
                .map(|o| match o {
                    ClusterObject::ResourceSlice(s) => s.spec.devices.as_ref().map_or(0, Vec::len),
                    _ => 0,
                })
                .sum()
        };
        assert_eq!(count(NodeShape::A100Efa), 12, "8 GPUs + 4 EFA");
        assert_eq!(
            count(NodeShape::H100Mig),
            8 * (1 + 2 + 7),
            "whole + 2x3g + 7x1g per GPU"
        );
        assert_eq!(count(NodeShape::L4Shared), 4);
        let mig = node_slices("c", "n", NodeShape::H100Mig);
        let ClusterObject::ResourceSlice(counters) = &mig[0] else {
            panic!()
        };
        assert_eq!(
            counters.spec.shared_counters.as_ref().map(Vec::len),
            Some(8)
        );
        assert_eq!(counters.spec.pool.resource_slice_count, 2);
    }

    #[test]
    fn used_gpus_have_pods_and_claims() {
        let c = generate(&uniform_fleet(1, 3, 1.0)[0]);
        let pods = c
            .objects
            .iter()
            .filter(|o| o.kind() == ObjectKind::Pod)
            .count();
        let claims = c
            .objects
            .iter()
            .filter(|o| o.kind() == ObjectKind::ResourceClaim)
            .count();
        assert_eq!((pods, claims), (12, 12), "4 two-GPU pods per node");
    }

    #[test]
    fn generation_is_deterministic() {
        let a = generate(&demo_fleet()[0]);
        let b = generate(&demo_fleet()[0]);
        let ja: Vec<_> = a.objects.iter().map(ClusterObject::to_json).collect();
        let jb: Vec<_> = b.objects.iter().map(ClusterObject::to_json).collect();
        assert_eq!(ja, jb);
    }
}
