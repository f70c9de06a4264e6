//! The scheduler role under faults: a Karmada API server for the replicas (`dramesh-fakeapi`,
//! served by the harness on the lab bridge, so every replica reaches it whatever the fault cuts
//! between hosts), the bindings the scenario creates, and the sampler that records how many
//! replicas every binding holds in each member cluster over time.
//!
//! Guarantees: the server lives as long as [`Karmada`] (its runtime is dropped with it);
//! samples are read from the server's own state, so they are what a member cluster would be
//! told to run, not what a replica believes.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use dramesh_fakeapi::FakeApi;
use serde_json::{Value, json};

use crate::checker::BindSample;

/// The scheduler name the replicas answer to and the bindings ask for.
pub const SCHEDULER_NAME: &str = "dramesh-scheduler";
/// Namespace of the scenario's workloads.
const NAMESPACE: &str = "default";
const BINDINGS: (&str, &str) = ("work.karmada.io/v1alpha2", "ResourceBinding");

/// The Karmada API server of a scheduler scenario.
pub struct Karmada {
    api: FakeApi,
    kubeconfig: PathBuf,
    confirm: String,
    members: usize,
    // Serves `api`; declared last so the server stops after everything that uses it.
    _rt: tokio::runtime::Runtime,
}

impl Karmada {
    /// Starts the server on the harness's bridge address with one Karmada `Cluster` per member
    /// cluster (every API enabled, so no cluster is filtered for a missing API) and the one-GPU
    /// `ResourceClaimTemplate` `gpu` the workloads name. The `members` replicas will confirm
    /// decisions `confirm` (`after-write`, `before-write`, `strict`).
    pub fn start(
        gateway: Ipv4Addr,
        dir: &Path,
        clusters: &[String],
        confirm: &str,
        members: usize,
    ) -> Result<Karmada> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("starting the Karmada API server's runtime")?;
        let api = rt
            .block_on(FakeApi::start_on(SocketAddr::from((gateway, 0))))
            .with_context(|| format!("starting the Karmada API server on {gateway}"))?;
        for c in clusters {
            api.apply(dramesh_sim::karmada_cluster(c, true));
        }
        api.apply(
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "gpu", "namespace": NAMESPACE},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.nvidia.com"}}]}}}}),
        );
        let kubeconfig = dir.join("karmada.kubeconfig");
        std::fs::write(&kubeconfig, api.kubeconfig())
            .with_context(|| format!("writing {}", kubeconfig.display()))?;
        Ok(Karmada {
            api,
            kubeconfig,
            confirm: confirm.to_string(),
            members,
            _rt: rt,
        })
    }

    /// Whether writes to bindings are checked against Karmada's CRDs (the shared fixtures are
    /// present).
    pub fn validates(&self) -> bool {
        self.api.validates_karmada_crds()
    }

    /// The arguments that give a replica the scheduler role against this server.
    pub fn replica_args(&self) -> Vec<String> {
        vec![
            "--karmada-kubeconfig".into(),
            self.kubeconfig.display().to_string(),
            "--scheduler-name".into(),
            SCHEDULER_NAME.into(),
            "--scheduler-confirm".into(),
            self.confirm.clone(),
            "--scheduler-members".into(),
            self.members.to_string(),
        ]
    }

    /// Creates workload `i`: a Deployment of one pod asking one CPU and one GPU (the chaos
    /// probe's shape), and its binding of one replica, divided by available replicas over
    /// `clusters`.
    pub fn create_binding(&self, i: usize, clusters: &[String]) -> Result<()> {
        let name = format!("gpu-{i:04}");
        self.api
            .apply(json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                "template": {"metadata": {"labels": {"app": name}}, "spec": {
                    "containers": [{"name": "main", "image": "busybox",
                        "resources": {"requests": {"cpu": "1"}, "claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]}}}}));
        self.api
            .try_apply(json!({"apiVersion": BINDINGS.0, "kind": BINDINGS.1,
                "metadata": {"name": name, "namespace": NAMESPACE,
                    "labels": {"propagationpolicy.karmada.io/permanent-id": "chaos-gpu"}},
                "spec": {
                    "resource": {"apiVersion": "apps/v1", "kind": "Deployment",
                        "namespace": NAMESPACE, "name": name, "uid": format!("uid-{name}")},
                    "replicas": 1,
                    "schedulerName": SCHEDULER_NAME,
                    "placement": {"clusterAffinity": {"clusterNames": clusters},
                        "replicaScheduling": {"replicaSchedulingType": "Divided",
                            "replicaDivisionPreference": "Weighted",
                            "weightPreference": {"dynamicWeight": "AvailableReplicas"}}}}}))
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("creating binding {name}: {e}"))
    }

    /// The bindings' state now.
    pub fn sample(&self, at_ms: u64) -> BindSample {
        sample_of(at_ms, &self.api.list_objects(BINDINGS.0, BINDINGS.1))
    }

    /// Samples every `every` on a thread until `stop` is raised; the thread returns the samples.
    pub fn sampler(
        &self,
        t0: Instant,
        every: Duration,
        stop: Arc<AtomicBool>,
    ) -> std::thread::JoinHandle<Vec<BindSample>> {
        let api = self.api.clone();
        std::thread::spawn(move || {
            let mut out = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let at_ms = t0.elapsed().as_millis() as u64;
                out.push(sample_of(at_ms, &api.list_objects(BINDINGS.0, BINDINGS.1)));
                std::thread::sleep(every);
            }
            out
        })
    }
}

/// Replicas bound per cluster, bindings with and without a `Scheduled` condition.
fn sample_of(at_ms: u64, bindings: &[Value]) -> BindSample {
    let mut bound: BTreeMap<String, i64> = BTreeMap::new();
    let mut without_condition = Vec::new();
    for b in bindings {
        for t in b["spec"]["clusters"].as_array().into_iter().flatten() {
            if let Some(c) = t["name"].as_str() {
                *bound.entry(c.to_string()).or_default() += t["replicas"].as_i64().unwrap_or(0);
            }
        }
        let scheduled = b["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Scheduled");
        if !scheduled {
            without_condition.push(b["metadata"]["name"].as_str().unwrap_or("?").to_string());
        }
    }
    BindSample {
        at_ms,
        bindings: bindings.len(),
        bound,
        without_condition,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_sums_replicas_per_cluster_and_names_bindings_without_a_condition() {
        let b = |name: &str, clusters: Value, cond: bool| {
            let conditions = if cond {
                json!([{"type": "Scheduled", "status": "True"}])
            } else {
                json!([])
            };
            json!({"metadata": {"name": name}, "spec": {"clusters": clusters},
                "status": {"conditions": conditions}})
        };
        let s = sample_of(
            7,
            &[
                b("a", json!([{"name": "c1", "replicas": 2}]), true),
                b(
                    "b",
                    json!([{"name": "c1", "replicas": 1}, {"name": "c2", "replicas": 3}]),
                    true,
                ),
                b("c", json!(null), false),
            ],
        );
        assert_eq!(s.at_ms, 7);
        assert_eq!(s.bindings, 3);
        assert_eq!(
            s.bound,
            BTreeMap::from([("c1".into(), 3), ("c2".into(), 3)])
        );
        assert_eq!(s.without_condition, vec!["c".to_string()]);
    }
}
