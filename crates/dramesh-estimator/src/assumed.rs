//! Assumed (in-flight) workloads: replicas already assigned to a cluster but not yet bound
//! to nodes, deducted first-fit before an estimate as Karmada deducts them, with their device
//! allocations when they carry claims, and the free capacity of a node after those deductions.

use std::sync::Arc;

use crate::filter::NodeClaim;
use crate::fit::{AssumedDevices, DeviceQuery};
use crate::hash::FastMap;
use crate::overlay::Overlay;
use crate::resources::{ResList, ResName};
use crate::view::{ClusterView, NodeEntry};
use crate::workload::Workload;

/// An in-flight workload already assigned to a cluster but not yet bound to nodes.
#[derive(Debug, Clone)]
pub struct AssumedWorkload {
    /// Cluster the replicas are assigned to.
    pub cluster: String,
    /// Requests of one replica.
    pub requests: ResList,
    /// What one replica requires of a node.
    pub node_claim: NodeClaim,
    /// Replicas in flight.
    pub replicas: i64,
    /// The workload whose device claims every replica carries, when it has any
    /// (ResourceClaimTemplates: a fresh allocation per replica; `resourceClaimName` claims:
    /// allocated once, by the first replica, when not allocated already). `None`: the
    /// replicas hold no devices and are deducted by requests and pod slots only.
    pub claims: Option<Arc<Workload>>,
}

impl AssumedWorkload {
    /// `replicas` of `w` in flight to `cluster`, carrying `w`'s device claims.
    pub fn from_workload(cluster: &str, w: &Workload, replicas: i64) -> AssumedWorkload {
        AssumedWorkload {
            cluster: cluster.to_string(),
            requests: w.requests.clone(),
            node_claim: w.node_claim.clone(),
            replicas,
            claims: w.needs_devices().then(|| Arc::new(w.clone())),
        }
    }
}

/// Free capacity of one node after usage, overlay and assumed deductions.
pub(crate) struct NodeFree {
    pub res: ResList,
    pub pods: i64,
}

pub(crate) fn node_free(
    c: &ClusterView,
    node: &NodeEntry,
    overlay: Option<&Overlay>,
    assumed: Option<&FastMap<Arc<str>, (ResList, i64)>>,
) -> NodeFree {
    let mut res = node.allocatable.clone();
    let mut pods = node.allocatable.get(&ResName::Pods);
    res.remove(&ResName::Pods);
    if let Some(u) = c.usage.get(&node.name) {
        res.sub_all(&u.requested);
        pods -= i64::from(u.pods);
    }
    if let Some(o) = overlay
        && let Some((r, n)) = o.freed.get(&node.name)
    {
        res.add_all(r);
        pods += i64::from(*n);
    }
    if let Some(a) = assumed
        && let Some((r, n)) = a.get(&node.name)
    {
        res.sub_all(r);
        pods -= n;
    }
    NodeFree {
        res,
        pods: pods.max(0),
    }
}

/// What the assumed workloads of one cluster take.
pub(crate) struct Deductions {
    /// node -> requests and pod slots held.
    pub res: FastMap<Arc<str>, (ResList, i64)>,
    /// The device state with the assumed replicas' allocations; `None` when no assumed
    /// replica holds a device.
    pub devices: Option<AssumedDevices>,
    /// Replicas that fit nowhere (not deducted).
    pub unplaced: i64,
}

/// Karmada's first-fit deduction of assumed workloads: node by node in order, each takes
/// as many replicas as fit. A replica of a workload with device claims fits a node when its
/// requests fit and the engine allocates its claims there against the state holding every
/// replica placed before it (on any node), the same count [`DeviceQuery::fit`] makes for
/// the workload estimated; its allocation then stays for later replicas and the estimate.
/// Without claims, replicas are deducted by requests and pod slots only. A workload whose
/// devices cannot be evaluated in the cluster (a shared claim is missing, the cluster's
/// version is invalid, the engine rejects the claims) places nothing.
pub(crate) fn assumed_deductions(
    c: &ClusterView,
    assumed: &[AssumedWorkload],
    overlay: Option<&Overlay>,
    max_steps: Option<u64>,
) -> Deductions {
    let mut used: FastMap<Arc<str>, (ResList, i64)> = FastMap::default();
    let mut held: Option<AssumedDevices> = None;
    let mut unplaced = 0i64;
    for a in assumed.iter().filter(|a| a.cluster == c.name) {
        let mut remaining = a.replicas.max(0);
        let mut devq = None;
        if let Some(dw) = a.claims.as_deref() {
            held.get_or_insert_with(|| AssumedDevices::start(c, overlay));
            match DeviceQuery::prepare(c, dw, overlay, None, &mut held, max_steps) {
                Ok(q) => devq = q,
                Err(_) => {
                    unplaced = unplaced.saturating_add(remaining);
                    continue;
                }
            }
        }
        for node in c.nodes.values() {
            if remaining <= 0 {
                break;
            }
            if a.node_claim.check(&node.facts()).is_err() {
                continue;
            }
            let free = node_free(c, node, overlay, Some(&used));
            let fit = match &devq {
                None => free.res.max_divided(&a.requests).0,
                Some(q) => {
                    if !q.node_allowed(node) {
                        continue;
                    }
                    // Extended resources this node serves through devices are counted by
                    // the allocation, as for the estimated workload.
                    a.requests
                        .iter()
                        .filter(|(r, req)| {
                            *req > 0 && r.is_divisible() && !q.served_by_devices(node, r)
                        })
                        .map(|(r, req)| free.res.get(r).max(0) / req)
                        .min()
                        .unwrap_or(i64::MAX)
                }
            };
            let mut take = remaining.min(fit).min(free.pods);
            if take <= 0 {
                continue;
            }
            if let Some(q) = devq.as_mut() {
                match q.place(node, take) {
                    // A give-up places what was found before it; the rest stays unplaced.
                    Ok(fit) => take = fit.replicas,
                    // The claims cannot be allocated anywhere: no further node either.
                    Err(_) => break,
                }
                if take <= 0 {
                    continue;
                }
            }
            let e = used.entry(node.name.clone()).or_default();
            e.0.add_all(&a.requests.scaled(take));
            e.1 += take;
            remaining -= take;
        }
        if let Some(q) = devq {
            held = q.into_assumed();
        }
        unplaced = unplaced.saturating_add(remaining);
    }
    Deductions {
        res: used,
        devices: held.filter(AssumedDevices::holds_devices),
        unplaced,
    }
}
