//! Per-cluster quotas on logical resources, in the style of Kueue's `deviceClassMappings`,
//! applied as an extra cap on an estimate.
//!
//! A logical resource is either a plain resource name (`cpu`, `memory`, `nvidia.com/gpu`),
//! charged by the workload's per-replica request, or the name of a device class mapping,
//! charged per replica by the devices its claims request from the mapped classes: by
//! device count (default), by a consumable-capacity dimension the request asks for, or by
//! a shared counter (charged at the largest consumption any matching device of the driver
//! declares, an upper bound since the device chosen is not known before allocation).
//! The cap is `min over charged resources of floor((nominal - used) / per-replica charge)`.

use std::collections::BTreeMap;

use dramesh_model::Quantity;
use dramesh_model::k8s::ExactDeviceRequest;

use crate::resources::ResName;
use crate::view::ClusterView;
use crate::workload::Workload;

/// How a device class mapping charges quota.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum MappingSource {
    /// One unit per device (Kueue's default).
    Count,
    /// The amount a request asks for of this capacity name (`capacity.requests`).
    Capacity {
        /// Capacity name.
        name: String,
    },
    /// The consumption of this shared counter by a device of `driver`.
    Counter {
        /// Counter name.
        name: String,
        /// Driver whose devices declare the counter.
        driver: String,
    },
}

/// One Kueue-style device class mapping.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceClassMapping {
    /// Name of the mapped resource quotas charge.
    pub name: String,
    /// DeviceClasses this mapping covers.
    pub device_class_names: Vec<String>,
    /// How a device charges the resource (see [`MappingSource`]), as written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<serde_json::Value>,
}

impl DeviceClassMapping {
    fn source(&self) -> MappingSource {
        for s in &self.sources {
            if let Some(c) = s.get("capacity")
                && let Some(name) = c.get("name").and_then(|v| v.as_str())
            {
                return MappingSource::Capacity {
                    name: name.to_string(),
                };
            }
            if let Some(c) = s.get("counter")
                && let (Some(name), Some(driver)) = (
                    c.get("name").and_then(|v| v.as_str()),
                    c.get("driver").and_then(|v| v.as_str()),
                )
            {
                return MappingSource::Counter {
                    name: name.to_string(),
                    driver: driver.to_string(),
                };
            }
        }
        MappingSource::Count
    }
}

/// Quota of one cluster: nominal amounts and what is already used, as quantity strings.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterQuota {
    /// Quota per resource name, as Kubernetes quantities.
    pub nominal: BTreeMap<String, String>,
    /// Usage per resource name, as Kubernetes quantities.
    #[serde(default)]
    pub used: BTreeMap<String, String>,
}

/// Quotas of several clusters plus the mappings that define logical device resources.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QuotaSet {
    /// How devices of each DeviceClass are charged.
    #[serde(default)]
    pub device_class_mappings: Vec<DeviceClassMapping>,
    /// Quota per cluster name.
    #[serde(default)]
    pub clusters: BTreeMap<String, ClusterQuota>,
}

/// A quota file that cannot be read: the field and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("quota {field}: {message}")]
pub struct QuotaError {
    /// Path of the field at fault.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

fn amount(name: &str, q: &str, field: &str) -> Result<i128, QuotaError> {
    let parsed = Quantity::parse(q).map_err(|e| QuotaError {
        field: field.to_string(),
        message: e.to_string(),
    })?;
    Ok(match ResName::parse(name) {
        ResName::Cpu => parsed.milli_ceil(),
        _ => parsed.nanos(),
    })
}

impl QuotaSet {
    /// Reads the YAML/JSON value of a quota file; quantities are validated here.
    pub fn from_value(v: serde_json::Value) -> Result<QuotaSet, QuotaError> {
        let q: QuotaSet = serde_json::from_value(v).map_err(|e| QuotaError {
            field: String::new(),
            message: e.to_string(),
        })?;
        for (c, cq) in &q.clusters {
            for (k, v) in cq.nominal.iter().chain(cq.used.iter()) {
                amount(k, v, &format!("clusters.{c}.{k}"))?;
            }
        }
        Ok(q)
    }

    /// Per-replica charge of `w` on a logical resource, in the same unit as [`amount`]
    /// (CPU millis, otherwise nano-units).
    fn charge(&self, resource: &str, w: &Workload, c: &ClusterView) -> i128 {
        let Some(m) = self
            .device_class_mappings
            .iter()
            .find(|m| m.name == resource)
        else {
            let name = ResName::parse(resource);
            let v = i128::from(w.requests.get(&name));
            return match name {
                ResName::Cpu => v,
                _ => v.saturating_mul(1_000_000_000),
            };
        };
        let source = m.source();
        let mut total: i128 = 0;
        let mut charge_exact = |e: &ExactDeviceRequest| {
            if !m.device_class_names.contains(&e.device_class_name) {
                return;
            }
            let count = i128::from(e.count.unwrap_or(1));
            let per_device: i128 = match &source {
                MappingSource::Count => 1_000_000_000,
                MappingSource::Capacity { name } => e
                    .capacity
                    .as_ref()
                    .and_then(|cap| cap.requests.as_ref())
                    .and_then(|r| {
                        r.get(name)
                            .or_else(|| r.get(name.rsplit('/').next().unwrap_or(name)))
                    })
                    .and_then(|q| Quantity::parse(&q.0).ok())
                    .map(|q| q.nanos())
                    .unwrap_or(0),
                MappingSource::Counter { name, driver } => max_counter(c, driver, name),
            };
            total = total.saturating_add(count.saturating_mul(per_device));
        };
        for t in &w.templates {
            for r in t
                .template
                .spec
                .spec
                .devices
                .as_ref()
                .and_then(|d| d.requests.clone())
                .unwrap_or_default()
                .iter()
            {
                if let Some(e) = &r.exactly {
                    charge_exact(e);
                } else if let Some(first) = r.first_available.as_ref().and_then(|f| f.first()) {
                    let e = ExactDeviceRequest {
                        device_class_name: first.device_class_name.clone(),
                        count: first.count,
                        capacity: first.capacity.clone(),
                        ..Default::default()
                    };
                    charge_exact(&e);
                }
            }
        }
        // Extended resources backed by a mapped class are devices too.
        for (name, amount) in w.requests.iter() {
            if let ResName::Other(s) = name
                && let Some(class) = c.devices.class_for_extended_resource(s)
                && m.device_class_names
                    .iter()
                    .any(|n| Some(n.as_str()) == class.metadata.name.as_deref())
                && source == MappingSource::Count
            {
                total = total.saturating_add(i128::from(amount).saturating_mul(1_000_000_000));
            }
        }
        total
    }

    /// The cap this quota puts on `w` in cluster `cluster`, with the resource that caps it.
    pub fn limit(&self, cluster: &str, w: &Workload, c: &ClusterView) -> Option<(i64, String)> {
        let q = self.clusters.get(cluster)?;
        let mut best: Option<(i64, String)> = None;
        for (res, nominal) in &q.nominal {
            let Ok(nominal) = amount(res, nominal, res) else {
                continue;
            };
            let used = q
                .used
                .get(res)
                .and_then(|u| amount(res, u, res).ok())
                .unwrap_or(0);
            let per = self.charge(res, w, c);
            if per <= 0 {
                continue;
            }
            let left = (nominal - used).max(0);
            let fit = i64::try_from(left / per).unwrap_or(i64::MAX);
            if best.as_ref().is_none_or(|(b, _)| fit < *b) {
                best = Some((fit, res.clone()));
            }
        }
        best
    }
}

fn max_counter(c: &ClusterView, driver: &str, counter: &str) -> i128 {
    c.devices().max_counter(driver, counter)
}
