//! Devices by DeviceClass for the status report: how many devices each class selects in a
//! cluster, and how many of those are allocated by an allocated ResourceClaim.
//!
//! Kept beside the estimation view (fed the same object changes) because the view does not
//! expose its device inventory per class. Class selectors are compiled once per class with
//! the DRA CEL environment and evaluated per device with its result cache, so a status call
//! costs one cached lookup per (class, device). A device whose attributes cannot be read or
//! whose selector evaluation fails is not counted in that class (as the allocator would not
//! pick it). A device shared by several claims (`allowMultipleAllocations`) counts as
//! allocated once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use dramesh_api::native::DeviceClassStatus;
use dramesh_cel::{CelEnv, DeviceInput, Limits, Selector};
use dramesh_model::{AttrValue, ClusterObject, ObjectChange, ObjectKind, QualifiedName, Quantity};

struct Class {
    /// `None` when a selector does not compile: the class selects nothing.
    selectors: Option<Vec<Selector>>,
}

struct SliceDevices {
    driver: String,
    pool: String,
    devices: Vec<(String, Option<Arc<DeviceInput>>)>,
}

/// (driver, pool, device) of one allocated device.
type DeviceRef = (String, String, String);

#[derive(Default)]
struct ClusterIndex {
    classes: BTreeMap<String, Class>,
    slices: HashMap<String, SliceDevices>,
    /// claim (namespace, name) -> allocated (driver, pool, device).
    claims: HashMap<(String, String), Vec<DeviceRef>>,
}

/// See the module docs.
pub(crate) struct DeviceIndex {
    env: CelEnv,
    clusters: HashMap<String, ClusterIndex>,
}

impl Default for DeviceIndex {
    fn default() -> Self {
        DeviceIndex {
            env: CelEnv::new(Limits::default()),
            clusters: HashMap::new(),
        }
    }
}

fn device_input(driver: &str, d: &dramesh_model::k8s::Device) -> Option<Arc<DeviceInput>> {
    let mut attrs = Vec::new();
    for (name, a) in d.attributes.iter().flatten() {
        attrs.push((
            QualifiedName::parse(name, driver),
            AttrValue::from_k8s(a).ok()?,
        ));
    }
    let mut caps = Vec::new();
    for (name, c) in d.capacity.iter().flatten() {
        caps.push((
            QualifiedName::parse(name, driver),
            Quantity::parse(&c.value.0).ok()?,
        ));
    }
    Some(Arc::new(DeviceInput::new(
        driver,
        attrs,
        caps,
        d.allow_multiple_allocations.unwrap_or(false),
    )))
}

impl DeviceIndex {
    /// Applies one visible object change (only classes, slices and claims matter here).
    pub(crate) fn apply(&mut self, cluster: &str, change: &ObjectChange) {
        let key = change.key();
        if !matches!(
            key.kind,
            ObjectKind::DeviceClass | ObjectKind::ResourceSlice | ObjectKind::ResourceClaim
        ) {
            return;
        }
        let c = self.clusters.entry(cluster.to_string()).or_default();
        let ns = key.namespace.clone().unwrap_or_default();
        let obj = match change {
            ObjectChange::Delete { .. } => None,
            ObjectChange::Upsert { json, .. } => ClusterObject::from_json(key.kind, json).ok(),
        };
        match (key.kind, obj) {
            (ObjectKind::DeviceClass, Some(ClusterObject::DeviceClass(dc))) => {
                let selectors = dc
                    .spec
                    .selectors
                    .iter()
                    .flatten()
                    .filter_map(|s| s.cel.as_ref())
                    .map(|cel| self.env.compile(&cel.expression).ok())
                    .collect::<Option<Vec<_>>>();
                c.classes.insert(key.name.clone(), Class { selectors });
            }
            (ObjectKind::DeviceClass, _) => {
                c.classes.remove(&key.name);
            }
            (ObjectKind::ResourceSlice, Some(ClusterObject::ResourceSlice(s))) => {
                let driver = s.spec.driver.clone();
                let devices = s
                    .spec
                    .devices
                    .iter()
                    .flatten()
                    .map(|d| (d.name.clone(), device_input(&driver, d)))
                    .collect();
                c.slices.insert(
                    key.name.clone(),
                    SliceDevices {
                        driver,
                        pool: s.spec.pool.name.clone(),
                        devices,
                    },
                );
            }
            (ObjectKind::ResourceSlice, _) => {
                c.slices.remove(&key.name);
            }
            (ObjectKind::ResourceClaim, Some(ClusterObject::ResourceClaim(rc))) => {
                let results: Vec<DeviceRef> = rc
                    .status
                    .as_ref()
                    .and_then(|s| s.allocation.as_ref())
                    .and_then(|a| a.devices.as_ref())
                    .map(|d| {
                        d.results
                            .iter()
                            .flatten()
                            .map(|r| (r.driver.clone(), r.pool.clone(), r.device.clone()))
                            .collect()
                    })
                    .unwrap_or_default();
                if results.is_empty() {
                    c.claims.remove(&(ns, key.name.clone()));
                } else {
                    c.claims.insert((ns, key.name.clone()), results);
                }
            }
            (ObjectKind::ResourceClaim, _) => {
                c.claims.remove(&(ns, key.name.clone()));
            }
            _ => {}
        }
    }

    /// Devices, allocated and free per DeviceClass of `cluster`.
    pub(crate) fn by_class(&self, cluster: &str) -> Vec<DeviceClassStatus> {
        let Some(c) = self.clusters.get(cluster) else {
            return Vec::new();
        };
        let allocated: BTreeSet<(&str, &str, &str)> = c
            .claims
            .values()
            .flatten()
            .map(|(d, p, n)| (d.as_str(), p.as_str(), n.as_str()))
            .collect();
        let mut out = Vec::new();
        for (name, class) in &c.classes {
            let mut devices = 0u32;
            let mut used = 0u32;
            if let Some(selectors) = &class.selectors {
                for s in c.slices.values() {
                    for (dev, input) in &s.devices {
                        let Some(input) = input else { continue };
                        let selected = selectors
                            .iter()
                            .all(|sel| self.env.evaluate(sel, input).unwrap_or(false));
                        if !selected {
                            continue;
                        }
                        devices += 1;
                        if allocated.contains(&(s.driver.as_str(), s.pool.as_str(), dev.as_str())) {
                            used += 1;
                        }
                    }
                }
            }
            out.push(DeviceClassStatus {
                class: name.clone(),
                devices,
                allocated: used,
                free: devices - used,
                capacity: Vec::new(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_devices_of_the_demo_fleet_by_class() {
        let spec = &dramesh_sim::demo_fleet()[0];
        let cluster = dramesh_sim::generate(spec);
        let mut idx = DeviceIndex::default();
        for o in &cluster.objects {
            idx.apply(&cluster.name, &ObjectChange::upsert(o));
        }
        let by: BTreeMap<String, (u32, u32)> = idx
            .by_class(&cluster.name)
            .into_iter()
            .map(|d| (d.class, (d.devices, d.allocated)))
            .collect();
        // 4 A100 nodes: 8 GPUs and 4 EFA NICs each, half of the GPUs held by pods.
        assert_eq!(by["gpu.nvidia.com"], (32, 16));
        assert_eq!(by["efa.networking.k8s.aws"], (16, 0));
        assert_eq!(by["mig.nvidia.com"], (0, 0));
        // Deleting a claim frees its devices.
        let claim = cluster
            .objects
            .iter()
            .find(|o| o.kind() == ObjectKind::ResourceClaim)
            .unwrap();
        idx.apply(&cluster.name, &ObjectChange::Delete { key: claim.key() });
        let gpu = idx
            .by_class(&cluster.name)
            .into_iter()
            .find(|d| d.class == "gpu.nvidia.com")
            .unwrap();
        assert_eq!(gpu.allocated, 14);
        assert_eq!(gpu.free, 18);
    }
}
