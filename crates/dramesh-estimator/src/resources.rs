//! Compact resource lists and the Kubernetes rules for what a pod requests.
//!
//! Quantities are held as `i64` in the unit Karmada's estimator divides by: CPU in
//! millicores, every other resource in whole units rounded up (`Quantity.Value()`).
//! [`pod_requests`] follows the kube-scheduler rules: the sum of app containers, the
//! running maximum over init containers with restartable (sidecar) init containers
//! staying resident, pod-level requests when set, plus `spec.overhead`; requests
//! default to limits when only limits are given.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use dramesh_model::Quantity;
use dramesh_model::k8s::{K8sQuantity, PodSpec};
use k8s_openapi::api::core::v1::Container;

/// Well-known resources get their own variant so the hot path compares integers.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResName {
    /// `cpu`.
    Cpu,
    /// `memory`.
    Memory,
    /// `ephemeral-storage`.
    EphemeralStorage,
    /// `pods` (slots).
    Pods,
    /// Any other (extended, hugepages, ...) resource.
    Other(Arc<str>),
}

impl ResName {
    /// Reads a resource name (`cpu`, `memory`, `ephemeral-storage`, `pods`, or any other).
    pub fn parse(name: &str) -> ResName {
        match name {
            "cpu" => ResName::Cpu,
            "memory" => ResName::Memory,
            "ephemeral-storage" => ResName::EphemeralStorage,
            "pods" => ResName::Pods,
            other => ResName::Other(Arc::from(other)),
        }
    }

    /// The resource name as Kubernetes spells it.
    pub fn as_str(&self) -> &str {
        match self {
            ResName::Cpu => "cpu",
            ResName::Memory => "memory",
            ResName::EphemeralStorage => "ephemeral-storage",
            ResName::Pods => "pods",
            ResName::Other(s) => s,
        }
    }

    /// Karmada divides by CPU millis and by whole units for everything else.
    pub fn amount(&self, q: &Quantity) -> i64 {
        let v = match self {
            ResName::Cpu => q.milli_ceil(),
            _ => q.units_ceil(),
        };
        i64::try_from(v).unwrap_or(if v < 0 { i64::MIN } else { i64::MAX })
    }

    /// Resources Karmada's `MaxDivided` considers: cpu, memory, ephemeral storage and
    /// scalar resources (extended resources, hugepages, attachable volumes).
    pub fn is_divisible(&self) -> bool {
        match self {
            ResName::Cpu | ResName::Memory | ResName::EphemeralStorage => true,
            ResName::Pods => false,
            ResName::Other(s) => is_scalar_resource(s),
        }
    }
}

impl fmt::Display for ResName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Extended resources (domain-qualified, not `kubernetes.io/`), hugepages and attachable
/// volume limits: the "scalar" resources of the kube-scheduler.
pub(crate) fn is_scalar_resource(name: &str) -> bool {
    if name.starts_with("hugepages-") || name.starts_with("attachable-volumes-") {
        return true;
    }
    is_extended_resource(name)
}

/// A domain-qualified name outside `kubernetes.io/` and `requests.` prefixes.
pub(crate) fn is_extended_resource(name: &str) -> bool {
    match name.split_once('/') {
        Some((domain, _)) => {
            !(domain == "kubernetes.io"
                || domain.ends_with(".kubernetes.io")
                || name.starts_with("requests."))
        }
        None => false,
    }
}

/// A small sorted list of (resource, amount).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ResList(Vec<(ResName, i64)>);

impl ResList {
    /// An empty list.
    pub fn new() -> ResList {
        ResList(Vec::new())
    }

    /// The amount of `name` (0 when absent).
    pub fn get(&self, name: &ResName) -> i64 {
        match self.0.binary_search_by(|(n, _)| n.cmp(name)) {
            Ok(i) => self.0[i].1,
            Err(_) => 0,
        }
    }

    /// True when `name` is listed.
    pub fn contains(&self, name: &ResName) -> bool {
        self.0.binary_search_by(|(n, _)| n.cmp(name)).is_ok()
    }

    /// Sets the amount of `name`.
    pub fn set(&mut self, name: ResName, v: i64) {
        match self.0.binary_search_by(|(n, _)| n.cmp(&name)) {
            Ok(i) => self.0[i].1 = v,
            Err(i) => self.0.insert(i, (name, v)),
        }
    }

    /// Adds `v` to the amount of `name`.
    pub fn add(&mut self, name: &ResName, v: i64) {
        match self.0.binary_search_by(|(n, _)| n.cmp(name)) {
            Ok(i) => self.0[i].1 = self.0[i].1.saturating_add(v),
            Err(i) => self.0.insert(i, (name.clone(), v)),
        }
    }

    /// Adds every amount of `other`.
    pub fn add_all(&mut self, other: &ResList) {
        for (n, v) in &other.0 {
            self.add(n, *v);
        }
    }

    /// Subtracts every amount of `other`.
    pub fn sub_all(&mut self, other: &ResList) {
        for (n, v) in &other.0 {
            self.add(n, v.saturating_neg());
        }
    }

    /// Element-wise maximum.
    pub fn max_with(&mut self, other: &ResList) {
        for (n, v) in &other.0 {
            if *v > self.get(n) {
                self.set(n.clone(), *v);
            }
        }
    }

    /// Every amount multiplied by `k`.
    pub fn scaled(&self, k: i64) -> ResList {
        ResList(
            self.0
                .iter()
                .map(|(n, v)| (n.clone(), v.saturating_mul(k)))
                .collect(),
        )
    }

    /// (name, amount) pairs in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&ResName, i64)> {
        self.0.iter().map(|(n, v)| (n, *v))
    }

    /// True when nothing is listed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Removes `name`.
    pub fn remove(&mut self, name: &ResName) {
        if let Ok(i) = self.0.binary_search_by(|(n, _)| n.cmp(name)) {
            self.0.remove(i);
        }
    }

    /// Parses a Kubernetes resource map; bad quantities are reported with their name.
    pub fn from_k8s(map: &BTreeMap<String, K8sQuantity>) -> Result<ResList, String> {
        let mut out = ResList::new();
        for (k, q) in map {
            let parsed = Quantity::parse(&q.0).map_err(|e| format!("{k}: {e}"))?;
            let name = ResName::parse(k);
            let amount = name.amount(&parsed);
            out.set(name, amount);
        }
        Ok(out)
    }

    /// As a plain map with canonical Kubernetes quantity strings (`32`, `500m`, `256Gi`).
    pub fn to_map(&self) -> BTreeMap<String, String> {
        use dramesh_model::quantity::{Format, Quantity};
        self.0
            .iter()
            .map(|(n, v)| {
                let q = match n {
                    ResName::Cpu => Quantity::from_milli(*v),
                    ResName::Memory | ResName::EphemeralStorage => {
                        Quantity::from_units(*v).with_format(Format::BinarySi)
                    }
                    _ => Quantity::from_units(*v),
                };
                (n.as_str().to_string(), q.to_string())
            })
            .collect()
    }

    /// How many times `per` fits into `self` over the divisible resources `per` asks for
    /// with a positive amount (Karmada `MaxDivided` without the pod cap).
    pub fn max_divided(&self, per: &ResList) -> (i64, Option<ResName>) {
        let mut best = i64::MAX;
        let mut limiting = None;
        for (n, req) in per.iter() {
            if req <= 0 || !n.is_divisible() {
                continue;
            }
            let free = self.get(n);
            let fit = if free <= 0 { 0 } else { free / req };
            if fit < best {
                best = fit;
                limiting = Some(n.clone());
            }
        }
        (best, limiting)
    }
}

fn container_requests(c: &Container) -> Result<ResList, String> {
    let Some(res) = &c.resources else {
        return Ok(ResList::new());
    };
    let mut out = match &res.limits {
        Some(l) => ResList::from_k8s(l)?,
        None => ResList::new(),
    };
    if let Some(r) = &res.requests {
        for (n, v) in ResList::from_k8s(r)?.iter() {
            out.set(n.clone(), v);
        }
    }
    // Karmada and the apiserver default requests from limits only; other limit-only
    // names behave as requests of the same amount, which `out` already holds.
    Ok(out)
}

/// The resources one pod with this spec requests, as the kube-scheduler counts them.
pub(crate) fn pod_requests(spec: &PodSpec) -> Result<ResList, String> {
    let mut containers = ResList::new();
    for c in &spec.containers {
        let r = container_requests(c).map_err(|e| format!("container {}: {e}", c.name))?;
        containers.add_all(&r);
    }
    let mut sidecars = ResList::new();
    let mut init_max = ResList::new();
    for c in spec.init_containers.iter().flatten() {
        let r = container_requests(c).map_err(|e| format!("initContainer {}: {e}", c.name))?;
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars.add_all(&r);
            init_max.max_with(&sidecars);
        } else {
            let mut during = r.clone();
            during.add_all(&sidecars);
            init_max.max_with(&during);
        }
    }
    containers.add_all(&sidecars);
    containers.max_with(&init_max);
    if let Some(pod_level) = spec.resources.as_ref().and_then(|r| r.requests.as_ref()) {
        // Pod-level resources replace the container aggregate for the names they set.
        for (n, v) in ResList::from_k8s(pod_level)
            .map_err(|e| format!("resources: {e}"))?
            .iter()
        {
            if matches!(n, ResName::Cpu | ResName::Memory) {
                containers.set(n.clone(), v);
            }
        }
    }
    if let Some(o) = &spec.overhead {
        containers.add_all(&ResList::from_k8s(o).map_err(|e| format!("overhead: {e}"))?);
    }
    Ok(containers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> PodSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn init_and_sidecar_rules() {
        // app 1 cpu; sidecar 500m stays; plain init 2 cpu runs with the sidecar before it.
        let s = spec(serde_json::json!({
            "containers": [{"name": "a", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
            "initContainers": [
                {"name": "side", "restartPolicy": "Always", "resources": {"requests": {"cpu": "500m"}}},
                {"name": "init", "resources": {"requests": {"cpu": "2"}}}
            ],
            "overhead": {"cpu": "100m"}
        }));
        let r = pod_requests(&s).unwrap();
        // max(1 + 0.5, 2 + 0.5) + 0.1 = 2.6 cpu
        assert_eq!(r.get(&ResName::Cpu), 2600);
        assert_eq!(r.get(&ResName::Memory), 1 << 30);
    }

    #[test]
    fn limits_default_requests() {
        let s = spec(serde_json::json!({
            "containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "3"}}}]
        }));
        let r = pod_requests(&s).unwrap();
        assert_eq!(r.get(&ResName::parse("nvidia.com/gpu")), 2);
        assert_eq!(r.get(&ResName::Cpu), 3000);
    }

    #[test]
    fn scalar_names() {
        assert!(is_scalar_resource("nvidia.com/gpu"));
        assert!(is_scalar_resource("hugepages-2Mi"));
        assert!(!is_scalar_resource("kubernetes.io/foo"));
        assert!(!is_scalar_resource("pods"));
    }
}
