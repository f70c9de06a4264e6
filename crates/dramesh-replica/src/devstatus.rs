//! Devices by DeviceClass for the status report: how many devices each class selects in a
//! cluster, and how many of those allocated ResourceClaims hold.
//!
//! Read from the estimation view's per-cluster device state
//! ([`dramesh_estimator::ClusterDevices::class_usage`]), so slices are decoded once and a
//! class selects exactly the devices the allocator could pick for it.

use dramesh_api::native::DeviceClassStatus;
use dramesh_estimator::ClusterDevices;

/// Devices, allocated and free per DeviceClass of one cluster, sorted by class name.
pub(crate) fn by_class(devices: &ClusterDevices) -> Vec<DeviceClassStatus> {
    devices
        .class_usage()
        .into_iter()
        .map(|u| DeviceClassStatus {
            class: u.class,
            devices: u.devices,
            allocated: u.allocated,
            free: u.devices.saturating_sub(u.allocated),
            capacity: Vec::new(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_estimator::View;
    use dramesh_model::{ObjectChange, ObjectKind};
    use std::collections::BTreeMap;

    fn counts(view: &View, cluster: &str) -> BTreeMap<String, (u32, u32, u32)> {
        let devices = view.cluster(cluster).expect("cluster").devices();
        by_class(devices)
            .into_iter()
            .map(|d| (d.class, (d.devices, d.allocated, d.free)))
            .collect()
    }

    #[test]
    fn counts_devices_of_the_demo_fleet_by_class() {
        let spec = &dramesh_sim::demo_fleet()[0];
        let cluster = dramesh_sim::generate(spec);
        let mut view = View::new();
        for o in &cluster.objects {
            view.apply(&cluster.name, &ObjectChange::upsert(o))
                .expect("demo object applies");
        }
        let by = counts(&view, &cluster.name);
        // 4 A100 nodes: 8 GPUs and 4 EFA NICs each, half of the GPUs held by pods.
        assert_eq!(by["gpu.nvidia.com"], (32, 16, 16));
        assert_eq!(by["efa.networking.k8s.aws"], (16, 0, 16));
        assert_eq!(by["mig.nvidia.com"], (0, 0, 0));
        let names: Vec<String> = by_class(view.cluster(&cluster.name).expect("cluster").devices())
            .into_iter()
            .map(|d| d.class)
            .collect();
        assert!(names.windows(2).all(|w| w[0] < w[1]), "sorted: {names:?}");
        // Deleting a claim frees its devices.
        let claim = cluster
            .objects
            .iter()
            .find(|o| o.kind() == ObjectKind::ResourceClaim)
            .expect("the demo fleet has claims");
        view.apply(&cluster.name, &ObjectChange::Delete { key: claim.key() })
            .expect("delete applies");
        assert_eq!(counts(&view, &cluster.name)["gpu.nvidia.com"], (32, 14, 18));
    }
}
