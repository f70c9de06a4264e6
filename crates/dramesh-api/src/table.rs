//! [`TableBackend`]: a [`Backend`] that answers from a fixed table of clusters, for interop
//! tests, demos and client development without a mesh (see `examples/fake_estimator.rs`).
//!
//! Each cluster is one big node: free resources, free pod slots, labels, NoSchedule taints
//! and devices by DeviceClass. A replica fits `min(floor(free_r / request_r), pods,
//! floor(devices_c / count_c))` times after assumed workloads are deducted, and 0 times when
//! the node claim (nodeSelector, required node affinity, tolerations) rejects the cluster.
//! It reads every part of a converted request, so two requests that convert differently get
//! different answers. It holds no running workloads, so preemption never finds victims.

use std::collections::BTreeMap;
use std::time::Duration;

use dramesh_model::k8s::Taint;
use dramesh_model::{nodesel, taint};
use k8s_openapi::api::core::v1::PodSpec;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::backend::{ApiError, Backend, ReplicaAnswer};
use crate::native::{
    ClusterEstimate, ClusterPreemption, ClusterStatus, DeviceClassStatus, EstimateRequest,
    EstimateResponse, PlaceRequest, PlaceResponse, PreemptRequest, PreemptResponse, ResourceAmount,
    StatusReport, TargetCluster, Workload,
};
use crate::query::{
    ComponentSetQuery, NodeClaim, ReplicaQuery, ReplicaRequirements, UnschedulableQuery,
};

/// One cluster of the table.
#[derive(Debug, Clone, Default)]
pub struct TableCluster {
    /// Cluster name.
    pub name: String,
    /// Cluster labels (for policies).
    pub labels: BTreeMap<String, String>,
    /// Keys of NoSchedule taints; a replica needs a toleration for each.
    pub taints: Vec<String>,
    /// Free amount per resource name (`cpu`, `memory`, extended resources).
    pub free: BTreeMap<String, Quantity>,
    /// Free pod slots.
    pub pods: i64,
    /// Free devices per DeviceClass name.
    pub devices: BTreeMap<String, i64>,
    /// Set to make the cluster stale (answers 0).
    pub stale_for: Option<Duration>,
    /// Answer of `GetUnschedulableReplicas` for any workload.
    pub unschedulable: i64,
}

/// A backend answering from fixed clusters.
#[derive(Debug, Clone, Default)]
pub struct TableBackend {
    /// The replica id the status report names.
    pub replica: String,
    /// The clusters answered for.
    pub clusters: Vec<TableCluster>,
}

/// Parses a Kubernetes quantity into thousandths (millis), e.g. `"500m"` -> 500,
/// `"1Gi"` -> 1073741824000. Returns `None` for malformed or out-of-range values.
pub fn parse_milli(q: &str) -> Option<i128> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    let mult: i128 = match suffix {
        "" => 1000,
        "m" => 1,
        "k" => 1000 * 1000,
        "M" => 1000 * 1000 * 1000,
        "G" => 1000 * 1000 * 1000 * 1000,
        "T" => 1000 * 1000 * 1000 * 1000 * 1000,
        "Ki" => 1000 << 10,
        "Mi" => 1000 << 20,
        "Gi" => 1000 << 30,
        "Ti" => 1000 << 40,
        _ => return None,
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if frac.len() > 9 || (int.is_empty() && frac.is_empty()) {
        return None;
    }
    let int: i128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let scale = 10i128.pow(frac.len() as u32);
    let frac: i128 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    let whole = int.checked_mul(mult)?;
    let part = frac.checked_mul(mult)? / scale;
    Some(if int < 0 || num.starts_with('-') {
        whole - part
    } else {
        whole + part
    })
}

fn claim_admits(c: &NodeClaim, cl: &TableCluster) -> bool {
    if !nodesel::map_matches(&c.node_selector, &cl.labels) {
        return false;
    }
    // The cluster is one node named after it; a malformed term never matches.
    let node = nodesel::NodeRef {
        name: &cl.name,
        labels: &cl.labels,
    };
    if let Some(a) = &c.node_affinity
        && nodesel::matches_lazy(a, node) != Ok(true)
    {
        return false;
    }
    cl.taints.iter().all(|key| {
        let t = Taint {
            key: key.clone(),
            effect: "NoSchedule".into(),
            ..Taint::default()
        };
        taint::tolerated(&c.tolerations, &t)
    })
}

/// Devices each replica claims, by DeviceClass (`exactly` requests; count defaults to 1).
fn device_counts(r: &ReplicaRequirements) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for t in &r.dra.claim_templates {
        for req in t
            .spec
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.requests.as_ref())
            .into_iter()
            .flatten()
        {
            if let Some(e) = &req.exactly {
                *out.entry(e.device_class_name.clone()).or_insert(0) += e.count.unwrap_or(1);
            }
        }
    }
    out
}

/// Free amounts of a cluster in millis, after deducting `assumed` (requirements, replicas).
struct Free {
    res: BTreeMap<String, i128>,
    pods: i64,
    devices: BTreeMap<String, i64>,
}

impl Free {
    fn of(cl: &TableCluster) -> Free {
        Free {
            res: cl
                .free
                .iter()
                .map(|(k, q)| (k.clone(), parse_milli(&q.0).unwrap_or(0)))
                .collect(),
            pods: cl.pods,
            devices: cl.devices.clone(),
        }
    }

    fn deduct(&mut self, r: &ReplicaRequirements, replicas: i64) {
        for (k, q) in &r.resource_request {
            if let Some(v) = self.res.get_mut(k) {
                *v -= parse_milli(&q.0).unwrap_or(0) * i128::from(replicas);
            }
        }
        for (class, n) in device_counts(r) {
            if let Some(v) = self.devices.get_mut(&class) {
                *v -= n * replicas;
            }
        }
        self.pods -= replicas;
    }

    fn fit(&self, r: &ReplicaRequirements) -> i64 {
        let mut n = self.pods.max(0);
        for (k, q) in &r.resource_request {
            let want = parse_milli(&q.0).unwrap_or(0);
            if want <= 0 {
                continue;
            }
            let have = self.res.get(k).copied().unwrap_or(0).max(0);
            n = n.min(i64::try_from(have / want).unwrap_or(i64::MAX));
        }
        for (class, want) in device_counts(r) {
            if want > 0 {
                n = n.min(self.devices.get(&class).copied().unwrap_or(0).max(0) / want);
            }
        }
        n
    }
}

impl TableBackend {
    fn lookup(&self, name: &str) -> Result<&TableCluster, ReplicaAnswer> {
        let cl = self
            .clusters
            .iter()
            .find(|c| c.name == name)
            .ok_or(ReplicaAnswer::UnknownCluster)?;
        match cl.stale_for {
            Some(age) => Err(ReplicaAnswer::Stale { age }),
            None => Ok(cl),
        }
    }

    fn free_after(cl: &TableCluster, assumed: &[crate::query::AssumedWorkload]) -> Free {
        let mut f = Free::of(cl);
        for w in assumed {
            for c in &w.components {
                f.deduct(&c.requirements, i64::from(c.replicas));
            }
        }
        f
    }

    /// Per-replica requirements of a JSON workload manifest (Deployment, StatefulSet, Job or Pod).
    fn workload_requirements(w: &Workload) -> Result<(ReplicaRequirements, i64), ApiError> {
        for (i, text) in w.manifests.iter().enumerate() {
            let v: serde_json::Value = serde_json::from_str(text).map_err(|e| {
                ApiError::InvalidRequest(format!(
                    "workload.manifests[{i}]: the table backend reads JSON manifests only: {e}"
                ))
            })?;
            let kind = v.get("kind").and_then(|k| k.as_str()).unwrap_or_default();
            let (spec, replicas) = match kind {
                "Pod" => (v.get("spec"), 1),
                "Deployment" | "StatefulSet" | "Job" => (
                    v.pointer("/spec/template/spec"),
                    v.pointer("/spec/replicas")
                        .or_else(|| v.pointer("/spec/parallelism"))
                        .and_then(|r| r.as_i64())
                        .unwrap_or(1),
                ),
                _ => continue,
            };
            let spec: PodSpec =
                serde_json::from_value(spec.cloned().unwrap_or_default()).map_err(|e| {
                    ApiError::InvalidRequest(format!(
                        "workload.manifests[{i}] ({kind}): pod spec: {e}"
                    ))
                })?;
            let mut sum: BTreeMap<String, i128> = BTreeMap::new();
            for c in &spec.containers {
                for (k, q) in c
                    .resources
                    .as_ref()
                    .and_then(|r| r.requests.as_ref())
                    .into_iter()
                    .flatten()
                {
                    *sum.entry(k.clone()).or_insert(0) += parse_milli(&q.0).unwrap_or(0);
                }
            }
            let req = ReplicaRequirements {
                resource_request: sum
                    .into_iter()
                    .map(|(k, m)| (k, Quantity(format!("{m}m"))))
                    .collect(),
                node_claim: NodeClaim {
                    node_selector: spec.node_selector.clone().unwrap_or_default(),
                    node_affinity: None,
                    tolerations: spec.tolerations.clone().unwrap_or_default(),
                },
                ..Default::default()
            };
            return Ok((req, replicas));
        }
        Err(ApiError::InvalidRequest(
            "workload.manifests: no Deployment, StatefulSet, Job or Pod".into(),
        ))
    }

    fn estimate_clusters(
        &self,
        req: &ReplicaRequirements,
        only: &[String],
    ) -> Vec<ClusterEstimate> {
        self.clusters
            .iter()
            .filter(|c| only.is_empty() || only.contains(&c.name))
            .map(|cl| {
                let (n, limited_by) = if cl.stale_for.is_some() {
                    (0, "stale".to_string())
                } else if !claim_admits(&req.node_claim, cl) {
                    (0, "node claim".to_string())
                } else {
                    (Free::of(cl).fit(req), "table".to_string())
                };
                ClusterEstimate {
                    name: cl.name.clone(),
                    max_replicas: n,
                    limited_by,
                    nodes_considered: 1,
                    ..Default::default()
                }
            })
            .collect()
    }
}

impl Backend for TableBackend {
    fn max_available_replicas(&self, q: &ReplicaQuery) -> ReplicaAnswer {
        let cl = match self.lookup(&q.cluster) {
            Ok(c) => c,
            Err(a) => return a,
        };
        if !claim_admits(&q.requirements.node_claim, cl) {
            return ReplicaAnswer::Count(0);
        }
        ReplicaAnswer::Count(Self::free_after(cl, &q.assumed_workloads).fit(&q.requirements))
    }

    fn max_available_component_sets(&self, q: &ComponentSetQuery) -> ReplicaAnswer {
        let cl = match self.lookup(&q.cluster) {
            Ok(c) => c,
            Err(a) => return a,
        };
        if q.components.is_empty()
            || q.components
                .iter()
                .any(|c| !claim_admits(&c.requirements.node_claim, cl))
        {
            return ReplicaAnswer::Count(0);
        }
        let mut free = Self::free_after(cl, &q.assumed_workloads);
        let mut sets = 0;
        // One set at a time until a component no longer fits; bounded by free pod slots.
        while sets < i64::from(i32::MAX) {
            if q.components
                .iter()
                .any(|c| free.fit(&c.requirements) < i64::from(c.replicas))
            {
                break;
            }
            for c in &q.components {
                free.deduct(&c.requirements, i64::from(c.replicas));
            }
            sets += 1;
            if q.components.iter().all(|c| c.replicas == 0) {
                break;
            }
        }
        ReplicaAnswer::Count(sets)
    }

    fn unschedulable_replicas(&self, q: &UnschedulableQuery) -> ReplicaAnswer {
        match self.lookup(&q.cluster) {
            Ok(c) => ReplicaAnswer::Count(c.unschedulable),
            Err(a) => a,
        }
    }

    fn estimate_all(&self, req: &EstimateRequest) -> Result<EstimateResponse, ApiError> {
        let (r, _) = Self::workload_requirements(&req.workload)?;
        let clusters = self.estimate_clusters(&r, &req.clusters);
        let total = clusters.iter().map(|c| c.max_replicas).sum();
        Ok(EstimateResponse { clusters, total })
    }

    fn place(&self, req: &PlaceRequest) -> Result<PlaceResponse, ApiError> {
        let (r, replicas) = Self::workload_requirements(&req.workload)?;
        let replicas = req.replicas.unwrap_or(replicas);
        let mut avail: Vec<(String, i64)> = self
            .estimate_clusters(&r, &req.clusters)
            .into_iter()
            .map(|c| (c.name, c.max_replicas))
            .collect();
        let available = avail.iter().cloned().collect();
        // Most available first; fill each cluster before the next (Aggregated).
        avail.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let mut left = replicas;
        let mut clusters = Vec::new();
        for (name, n) in avail {
            let take = left.min(n);
            if take > 0 {
                clusters.push(TargetCluster {
                    name,
                    replicas: take,
                });
                left -= take;
            }
        }
        Ok(PlaceResponse {
            policy: String::new(),
            strategy: "Aggregated".into(),
            replicas,
            clusters,
            available,
            filtered_out: Vec::new(),
            unschedulable: (left > 0).then(|| format!("{left} of {replicas} replicas do not fit")),
            stale: Vec::new(),
            data_age_seconds: BTreeMap::new(),
        })
    }

    fn preempt(&self, req: &PreemptRequest) -> Result<PreemptResponse, ApiError> {
        let (r, replicas) = Self::workload_requirements(&req.workload)?;
        let replicas = req.replicas.unwrap_or(replicas);
        let est = self.estimate_clusters(&r, &req.clusters);
        let fits = est
            .iter()
            .find(|c| c.max_replicas >= replicas)
            .map(|c| c.name.clone());
        let clusters = est
            .iter()
            .map(|c| ClusterPreemption {
                name: c.name.clone(),
                feasible: c.max_replicas >= replicas,
                replicas_before: c.max_replicas,
                replicas_after: c.max_replicas,
                reason: (c.max_replicas < replicas)
                    .then(|| "no running workloads to evict".to_string()),
                ..Default::default()
            })
            .collect();
        Ok(PreemptResponse {
            preemptor: "workload".into(),
            priority: 0,
            replicas,
            reason: fits
                .is_none()
                .then(|| "no cluster fits and there is nothing to evict".to_string()),
            fits_without_preemption: fits,
            chosen: None,
            clusters,
        })
    }

    fn status(&self) -> StatusReport {
        StatusReport {
            replica: self.replica.clone(),
            ready: false,
            clusters: self
                .clusters
                .iter()
                .map(|c| ClusterStatus {
                    name: c.name.clone(),
                    kubernetes_version: None,
                    generation: 1,
                    data_age_seconds: c.stale_for.map(|d| d.as_secs_f64()),
                    stale: c.stale_for.is_some(),
                    nodes: 1,
                    pods: 0,
                    resources: c
                        .free
                        .iter()
                        .map(|(k, q)| ResourceAmount {
                            name: k.clone(),
                            allocatable: q.0.clone(),
                            consumed: "0".into(),
                            free: q.0.clone(),
                        })
                        .collect(),
                    devices: c
                        .devices
                        .iter()
                        .map(|(class, n)| DeviceClassStatus {
                            class: class.clone(),
                            devices: u32::try_from(*n).unwrap_or(0),
                            allocated: 0,
                            free: u32::try_from(*n).unwrap_or(0),
                            capacity: Vec::new(),
                        })
                        .collect(),
                })
                .collect(),
            reservations: Vec::new(),
            retired: Vec::new(),
        }
    }
}

/// The table `examples/fake_estimator.rs` serves and the Python interop test expects:
/// `member-1` (16 cpu, 64Gi, 110 pods, labels zone=a and gpu=h100, taint `nvidia.com/gpu`,
/// 8 `gpu.example.com` devices), `member-2` (4 cpu, 8Gi, no labels), `member-3` (stale).
pub fn demo_table() -> TableBackend {
    let q = |s: &str| Quantity(s.to_string());
    TableBackend {
        replica: "fake-estimator".into(),
        clusters: vec![
            TableCluster {
                name: "member-1".into(),
                labels: BTreeMap::from([
                    ("zone".into(), "a".into()),
                    ("gpu".into(), "h100".into()),
                ]),
                taints: vec!["nvidia.com/gpu".into()],
                free: BTreeMap::from([("cpu".into(), q("16")), ("memory".into(), q("64Gi"))]),
                pods: 110,
                devices: BTreeMap::from([("gpu.example.com".into(), 8)]),
                stale_for: None,
                unschedulable: 2,
            },
            TableCluster {
                name: "member-2".into(),
                free: BTreeMap::from([("cpu".into(), q("4")), ("memory".into(), q("8Gi"))]),
                pods: 110,
                ..Default::default()
            },
            TableCluster {
                name: "member-3".into(),
                free: BTreeMap::from([("cpu".into(), q("64"))]),
                pods: 110,
                stale_for: Some(Duration::from_secs(600)),
                ..Default::default()
            },
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_to_millis() {
        assert_eq!(parse_milli("500m"), Some(500));
        assert_eq!(parse_milli("2"), Some(2000));
        assert_eq!(parse_milli("1.5"), Some(1500));
        assert_eq!(parse_milli("1Gi"), Some(1000 << 30));
        assert_eq!(parse_milli("1k"), Some(1_000_000));
        assert_eq!(parse_milli("abc"), None);
        assert_eq!(parse_milli("1Qi"), None);
    }

    #[test]
    fn the_node_claim_gates_the_cluster() {
        let t = demo_table();
        let mut q = ReplicaQuery {
            cluster: "member-1".into(),
            requirements: ReplicaRequirements {
                resource_request: BTreeMap::from([("cpu".to_string(), Quantity("500m".into()))]),
                ..Default::default()
            },
            ..Default::default()
        };
        // The taint is not tolerated.
        assert_eq!(t.max_available_replicas(&q), ReplicaAnswer::Count(0));
        q.requirements.node_claim.tolerations = vec![k8s_openapi::api::core::v1::Toleration {
            key: Some("nvidia.com/gpu".into()),
            operator: Some("Exists".into()),
            ..Default::default()
        }];
        assert_eq!(t.max_available_replicas(&q), ReplicaAnswer::Count(32));
        // Kubernetes' rule (`dramesh_model::taint`): an empty effect matches every effect, an
        // empty key with Exists matches every key, and Equal compares values (the taint has
        // none). The table used to refuse the first two and accept the third.
        let tol = |key: &str, op: &str, value: Option<&str>, effect: &str| {
            vec![k8s_openapi::api::core::v1::Toleration {
                key: Some(key.into()),
                operator: Some(op.into()),
                value: value.map(str::to_string),
                effect: Some(effect.into()),
                ..Default::default()
            }]
        };
        for (tolerations, fits) in [
            (tol("nvidia.com/gpu", "Exists", None, ""), 32),
            (tol("", "Exists", None, "NoSchedule"), 32),
            (tol("nvidia.com/gpu", "Equal", Some("x"), "NoSchedule"), 0),
            (tol("nvidia.com/gpu", "Equal", None, "NoExecute"), 0),
        ] {
            let mut q = q.clone();
            q.requirements.node_claim.tolerations = tolerations;
            assert_eq!(
                t.max_available_replicas(&q),
                ReplicaAnswer::Count(fits),
                "{:?}",
                q.requirements.node_claim.tolerations
            );
        }
        q.assumed_workloads = vec![crate::query::AssumedWorkload {
            namespace: "x".into(),
            components: vec![crate::query::Component {
                name: "c".into(),
                replicas: 4,
                requirements: q.requirements.clone(),
            }],
        }];
        assert_eq!(t.max_available_replicas(&q), ReplicaAnswer::Count(28));
        q.cluster = "member-3".into();
        assert!(matches!(
            t.max_available_replicas(&q),
            ReplicaAnswer::Stale { .. }
        ));
        q.cluster = "nope".into();
        assert_eq!(t.max_available_replicas(&q), ReplicaAnswer::UnknownCluster);
    }
}
