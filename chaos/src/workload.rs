//! The workload driver: keeps changing the member clusters' snapshot folders (nodes added and
//! removed, claims allocated and released) while faults are active, and records every change.
//!
//! Guarantees: the sequence of changes is a pure function of the seed and the initial fleet;
//! every change is written to disk before it is recorded (atomically per file; only the files
//! of the kinds it touched, through `dramesh_sim::write_snapshot_file`, so hundreds of changes
//! per second stay cheap); [`Workload::expected`] reads the final files back through the same
//! loader the agents use, so the checker compares replicas with what was really on disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use dramesh_model::load::{decode_value, load_path};
use dramesh_model::{ClusterObject, Manifest};
use dramesh_sim::{Cluster, ClusterSpec, NodeShape};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::checker::ClusterState;

/// One recorded change.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    /// 1-based change number.
    pub seq: u64,
    /// When, in ms since the scenario started.
    pub at_ms: u64,
    /// The cluster changed.
    pub cluster: String,
    /// What was done (for the log).
    pub op: String,
    /// Keys written (`+`) or removed (`-`).
    pub keys: Vec<String>,
}

/// Which changes the driver makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Mix {
    /// Nodes added and removed, claims allocated and released: the fleet's shape changes.
    Mixed,
    /// A node's label rewritten, claims allocated and released: every change rewrites one
    /// small file and the clusters keep their size, so it can run at hundreds of changes per
    /// second for minutes.
    Churn,
}

/// The driver's state: the clusters as last written.
pub struct Workload {
    root: PathBuf,
    clusters: Vec<Cluster>,
    rng: StdRng,
    next_id: u64,
    /// Every change written, in order.
    pub changes: Vec<Change>,
    /// Clusters retired from the fleet ([`Workload::retire`]).
    retired: Vec<String>,
    /// Which changes [`Workload::step`] makes.
    pub mix: Mix,
    /// Whether retired clusters keep changing (their agents keep publishing new data, and
    /// rolling their documents over, which the replicas must refuse).
    pub write_retired: bool,
    /// Per cluster index: its whole GPUs, while no node was added or removed since they were
    /// listed (reading them decodes every slice: too slow for every change at hundreds a
    /// second).
    gpus: BTreeMap<usize, Vec<(String, String)>>,
}

/// `Kind/ns/name` or `Kind/name`, as `/v1/debug/objects` reports keys.
pub fn key_string(o: &ClusterObject) -> String {
    let k = o.key();
    match &k.namespace {
        Some(ns) => format!("{}/{ns}/{}", k.kind, k.name),
        None => format!("{}/{}", k.kind, k.name),
    }
}

/// sha256 hex of the object's canonical JSON (`ClusterObject::to_json`).
pub fn object_hash(o: &ClusterObject) -> String {
    Sha256::digest(o.to_json())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn as_json(o: &ClusterObject) -> Value {
    serde_json::from_slice(&o.to_json()).unwrap_or(Value::Null)
}

fn node_object(name: &str, shape: NodeShape, zone: &str) -> Result<ClusterObject> {
    let (cpu, mem, instance) = match shape {
        NodeShape::A100Efa => ("96", "1152Gi", "p4d.24xlarge"),
        NodeShape::H100Mig => ("192", "2048Gi", "p5.48xlarge"),
        NodeShape::L4Shared => ("48", "192Gi", "g6.12xlarge"),
        NodeShape::T4 => ("48", "192Gi", "g4dn.12xlarge"),
    };
    let alloc = json!({"cpu": cpu, "memory": mem, "pods": "110", "ephemeral-storage": "400Gi"});
    let node = decode_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name,
            "node.kubernetes.io/instance-type": instance,
            "topology.kubernetes.io/zone": zone,
            "nvidia.com/gpu.present": "true"
        }},
        "status": {"allocatable": alloc.clone(), "capacity": alloc}
    }))
    .map_err(|e| anyhow!("building node {name}: {e:?}"))?;
    Ok(ClusterObject::Node(Arc::new(node)))
}

fn claim_object(cluster: &str, name: &str, node: &str, device: &str) -> Result<ClusterObject> {
    let claim = decode_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "chaos", "uid": format!("{cluster}-{name}")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 1}}]}},
        "status": {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": device}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}
        }}
    }))
    .map_err(|e| anyhow!("building claim {name}: {e:?}"))?;
    Ok(ClusterObject::ResourceClaim(Arc::new(claim)))
}

/// Files `write_snapshot` may write; the ones whose kind has no object left are removed.
const KIND_FILES: [(&str, &str); 6] = [
    ("Node", "nodes.yaml"),
    ("Pod", "pods.yaml"),
    ("ResourceSlice", "resourceslices.yaml"),
    ("DeviceClass", "deviceclasses.yaml"),
    ("ResourceClaim", "resourceclaims.yaml"),
    ("DeviceTaintRule", "devicetaintrules.yaml"),
];

impl Workload {
    /// Generates the fleet and writes the initial snapshot folders under `root`.
    pub fn new(root: &Path, specs: &[ClusterSpec], seed: u64) -> Result<Workload> {
        let w = Workload {
            root: root.to_path_buf(),
            clusters: specs.iter().map(dramesh_sim::generate).collect(),
            rng: StdRng::seed_from_u64(seed),
            next_id: 0,
            changes: Vec::new(),
            retired: Vec::new(),
            mix: Mix::Mixed,
            write_retired: false,
            gpus: BTreeMap::new(),
        };
        for c in &w.clusters {
            w.write(c)?;
        }
        Ok(w)
    }

    /// The cluster names, in fleet order.
    pub fn cluster_names(&self) -> Vec<String> {
        self.clusters.iter().map(|c| c.name.clone()).collect()
    }

    /// The folder an agent of cluster `name` reads.
    pub fn cluster_dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    fn write(&self, c: &Cluster) -> Result<()> {
        dramesh_sim::write_snapshot(&self.root, c)
            .with_context(|| format!("writing snapshot of {}", c.name))?;
        for (kind, file) in KIND_FILES {
            if !c.objects.iter().any(|o| o.kind().as_str() == kind) {
                let p = self.root.join(&c.name).join(file);
                if p.exists() {
                    std::fs::remove_file(&p).with_context(|| format!("removing {p:?}"))?;
                }
            }
        }
        Ok(())
    }

    /// Makes one random change to one cluster, writes it, records it and returns it.
    pub fn step(&mut self, at_ms: u64) -> Result<Change> {
        let candidates: Vec<usize> = (0..self.clusters.len())
            .filter(|i| self.write_retired || !self.retired.contains(&self.clusters[*i].name))
            .collect();
        if candidates.is_empty() {
            bail!("the workload has no cluster to change");
        }
        let ci = candidates[self.rng.random_range(0..candidates.len())];
        let roll = self.rng.random_range(0..100u32);
        self.next_id += 1;
        let id = self.next_id;
        let (op, keys) = {
            let c = &self.clusters[ci];
            let nodes: Vec<String> = c
                .objects
                .iter()
                .filter(|o| matches!(o, ClusterObject::Node(_)))
                .map(|o| o.key().name)
                .collect();
            let claims: Vec<usize> = c
                .objects
                .iter()
                .enumerate()
                .filter(|(_, o)| matches!(o, ClusterObject::ResourceClaim(_)))
                .map(|(i, _)| i)
                .collect();
            let gpus = self.gpus.entry(ci).or_insert_with(|| whole_gpus(c)).clone();
            let free = free_devices(c, &gpus);
            if self.mix == Mix::Churn && roll < 50 && !nodes.is_empty() {
                let node = nodes[self.rng.random_range(0..nodes.len())].clone();
                self.relabel_node(ci, &node, id)?
            } else if self.mix == Mix::Churn {
                self.churn_claim(ci, id, roll < 75, &free, &claims)?
            } else if roll < 25 || nodes.len() <= 1 && roll < 40 {
                self.add_node(ci, id)?
            } else if roll < 40 {
                let victim = nodes[self.rng.random_range(0..nodes.len())].clone();
                self.remove_node(ci, &victim)
            } else if roll < 75 && !free.is_empty() || claims.is_empty() {
                if free.is_empty() {
                    self.add_node(ci, id)?
                } else {
                    self.churn_claim(ci, id, true, &free, &claims)?
                }
            } else {
                self.churn_claim(ci, id, false, &free, &claims)?
            }
        };
        if keys
            .iter()
            .any(|k| k.get(1..).is_some_and(|k| k.starts_with("Node/")))
            && !op.starts_with("relabel")
        {
            self.gpus.remove(&ci);
        }
        self.write_touched(ci, &keys)?;
        let change = Change {
            seq: self.changes.len() as u64 + 1,
            at_ms,
            cluster: self.clusters[ci].name.clone(),
            op,
            keys,
        };
        self.changes.push(change.clone());
        Ok(change)
    }

    /// Writes the files of cluster `ci` holding the kinds of `keys` (`+Kind/...`, `-Kind/...`);
    /// everything when a node was removed (its pods, slices and claims go with it).
    fn write_touched(&self, ci: usize, keys: &[String]) -> Result<()> {
        let c = &self.clusters[ci];
        let kinds: std::collections::BTreeSet<&str> = keys
            .iter()
            .filter_map(|k| k.get(1..)?.split('/').next())
            .collect();
        if kinds.contains("Node") && keys.iter().any(|k| k.starts_with("-Node/")) {
            return self.write(c);
        }
        for (kind, file) in KIND_FILES {
            if kinds.contains(kind) {
                dramesh_sim::write_snapshot_file(&self.root, c, file)
                    .with_context(|| format!("writing {file} of {}", c.name))?;
            }
        }
        Ok(())
    }

    /// Allocates a free device to a new claim (`allocate`, when one is free), or releases
    /// one of `claims`.
    fn churn_claim(
        &mut self,
        ci: usize,
        id: u64,
        allocate: bool,
        free: &[(String, String)],
        claims: &[usize],
    ) -> Result<(String, Vec<String>)> {
        if allocate && !free.is_empty() || claims.is_empty() {
            let Some((node, dev)) = free
                .get(self.rng.random_range(0..free.len().max(1)))
                .cloned()
            else {
                bail!(
                    "cluster {} has no device to allocate and no claim to release",
                    self.clusters[ci].name
                );
            };
            let name = format!("chaos-claim-{id}");
            let cname = self.clusters[ci].name.clone();
            let claim = claim_object(&cname, &name, &node, &dev)?;
            let key = key_string(&claim);
            self.clusters[ci].objects.push(claim);
            Ok((
                format!("allocate {name} on {node}/{dev}"),
                vec![format!("+{key}")],
            ))
        } else {
            let idx = claims[self.rng.random_range(0..claims.len())];
            let o = self.clusters[ci].objects.remove(idx);
            Ok((
                format!("release {}", o.key().name),
                vec![format!("-{}", key_string(&o))],
            ))
        }
    }

    /// Rewrites label `chaos.dramesh.io/step` of node `node` to `id`.
    fn relabel_node(&mut self, ci: usize, node: &str, id: u64) -> Result<(String, Vec<String>)> {
        let c = &mut self.clusters[ci];
        let Some(o) = c
            .objects
            .iter_mut()
            .find(|o| matches!(o, ClusterObject::Node(_)) && o.key().name == node)
        else {
            bail!("relabel: cluster {} has no node {node}", c.name);
        };
        let mut v = as_json(o);
        v["metadata"]["labels"]["chaos.dramesh.io/step"] = json!(id.to_string());
        let relabeled = decode_value(v).map_err(|e| anyhow!("relabeling node {node}: {e:?}"))?;
        *o = ClusterObject::Node(Arc::new(relabeled));
        let key = key_string(o);
        Ok((format!("relabel {node} step={id}"), vec![format!("+{key}")]))
    }

    fn add_node(&mut self, ci: usize, id: u64) -> Result<(String, Vec<String>)> {
        let shape = if self.rng.random_bool(0.5) {
            NodeShape::A100Efa
        } else {
            NodeShape::T4
        };
        let c = &mut self.clusters[ci];
        let name = format!("{}-chaos-{id:05}", c.name);
        let zone = ["a", "b", "c"][(id % 3) as usize];
        let mut added = vec![node_object(&name, shape, &format!("chaos-1{zone}"))?];
        added.extend(dramesh_sim::node_slices(&c.name, &name, shape));
        let keys = added
            .iter()
            .map(|o| format!("+{}", key_string(o)))
            .collect();
        c.objects.extend(added);
        Ok((format!("add node {name} ({shape:?})"), keys))
    }

    fn remove_node(&mut self, ci: usize, node: &str) -> (String, Vec<String>) {
        let c = &mut self.clusters[ci];
        let mut removed = Vec::new();
        c.objects.retain(|o| {
            let on_node = match o {
                ClusterObject::Node(_) => o.key().name == node,
                ClusterObject::ResourceSlice(_) | ClusterObject::Pod(_) => {
                    let v = as_json(o);
                    v["spec"]["nodeName"].as_str() == Some(node)
                }
                ClusterObject::ResourceClaim(_) => allocated_on(o).iter().any(|(n, _)| n == node),
                _ => false,
            };
            if on_node {
                removed.push(format!("-{}", key_string(o)));
            }
            !on_node
        });
        (format!("remove node {node}"), removed)
    }

    /// Retires cluster `name`: it leaves [`Workload::expected`], and the driver stops changing
    /// it unless [`Workload::write_retired`] (its folder stays, so its agent keeps publishing
    /// what the replicas must refuse).
    pub fn retire(&mut self, name: &str) -> Result<()> {
        if !self.clusters.iter().any(|c| c.name == name) {
            bail!("retire: the workload has no cluster {name}");
        }
        if !self.retired.iter().any(|r| r == name) {
            self.retired.push(name.to_string());
        }
        Ok(())
    }

    /// The clusters retired so far, in order.
    pub fn retired(&self) -> &[String] {
        &self.retired
    }

    /// The objects of the final files, read back from disk through the agents' loader.
    pub fn expected(&self) -> Result<ClusterState> {
        let mut out = ClusterState::new();
        for c in self
            .clusters
            .iter()
            .filter(|c| !self.retired.contains(&c.name))
        {
            let dir = self.root.join(&c.name);
            let loaded = load_path(&dir).map_err(|e| anyhow!("loading {dir:?}: {e}"))?;
            let objs = out.entry(c.name.clone()).or_default();
            for l in loaded {
                if let Manifest::Object(o) = l.manifest {
                    objs.insert(key_string(&o), object_hash(&o));
                }
            }
        }
        Ok(out)
    }

    /// (cluster, key) to the number of the last change that wrote or removed it.
    pub fn last_writes(&self) -> BTreeMap<(String, String), u64> {
        let mut m = BTreeMap::new();
        for ch in &self.changes {
            for k in &ch.keys {
                m.insert((ch.cluster.clone(), k[1..].to_string()), ch.seq);
            }
        }
        m
    }
}

/// (pool/node, device) pairs a claim holds.
fn allocated_on(o: &ClusterObject) -> Vec<(String, String)> {
    let v = as_json(o);
    v["status"]["allocation"]["devices"]["results"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .filter_map(|r| {
                    Some((
                        r["pool"].as_str()?.to_string(),
                        r["device"].as_str()?.to_string(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Of `gpus` ([`whole_gpus`] of `c`), those no claim holds.
fn free_devices(c: &Cluster, gpus: &[(String, String)]) -> Vec<(String, String)> {
    let used: Vec<(String, String)> = c
        .objects
        .iter()
        .filter(|o| matches!(o, ClusterObject::ResourceClaim(_)))
        .flat_map(allocated_on)
        .collect();
    gpus.iter().filter(|g| !used.contains(g)).cloned().collect()
}

/// Whole GPUs (of nodes whose GPUs are not shared), as (node, device).
fn whole_gpus(c: &Cluster) -> Vec<(String, String)> {
    let mut gpus = Vec::new();
    for o in &c.objects {
        if !matches!(o, ClusterObject::ResourceSlice(_)) {
            continue;
        }
        let v = as_json(o);
        if v["spec"]["driver"].as_str() != Some("gpu.nvidia.com") {
            continue;
        }
        let Some(node) = v["spec"]["nodeName"].as_str() else {
            continue;
        };
        for d in v["spec"]["devices"].as_array().into_iter().flatten() {
            let Some(name) = d["name"].as_str() else {
                continue;
            };
            if !name.contains("mig") && d.get("allowMultipleAllocations").is_none() {
                gpus.push((node.to_string(), name.to_string()));
            }
        }
    }
    gpus
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(seed: u64, steps: usize) -> (Vec<String>, ClusterState, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Workload::new(dir.path(), &dramesh_sim::demo_fleet(), seed).unwrap();
        let ops = (0..steps)
            .map(|i| w.step(i as u64).unwrap().op)
            .collect::<Vec<_>>();
        let exp = w.expected().unwrap();
        (ops, exp, dir)
    }

    #[test]
    fn same_seed_same_changes_and_final_files() {
        let (a, ea, _d1) = run(7, 40);
        let (b, eb, _d2) = run(7, 40);
        let (c, _, _d3) = run(8, 40);
        assert_eq!(a, b);
        assert_eq!(ea, eb);
        assert_ne!(a, c, "a different seed gives a different history");
    }

    #[test]
    fn every_recorded_change_is_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Workload::new(dir.path(), &dramesh_sim::demo_fleet(), 3).unwrap();
        let mut kinds = std::collections::BTreeSet::new();
        for i in 0..60 {
            let ch = w.step(i).unwrap();
            kinds.insert(ch.op.split_whitespace().next().unwrap().to_string());
            let exp = w.expected().unwrap();
            let objs = &exp[&ch.cluster];
            for k in &ch.keys {
                let present = objs.contains_key(&k[1..]);
                assert_eq!(present, k.starts_with('+'), "change {} {k}", ch.seq);
            }
        }
        for op in ["add", "remove", "allocate", "release"] {
            assert!(kinds.contains(op), "op {op} never drawn: {kinds:?}");
        }
        let lw = w.last_writes();
        assert!(lw.values().any(|&s| s == 60));
    }

    #[test]
    fn keys_follow_the_debug_endpoint_format() {
        let c = dramesh_sim::generate(&dramesh_sim::demo_fleet()[0]);
        let keys: Vec<String> = c.objects.iter().map(key_string).collect();
        assert!(keys.contains(&"ClusterInfo/cluster".to_string()));
        assert!(keys.iter().any(|k| k.starts_with("ResourceClaim/ml/")));
        assert!(keys.iter().any(|k| k.starts_with("Node/us-east-train-")));
        assert_eq!(object_hash(&c.objects[0]).len(), 64);
    }
}
