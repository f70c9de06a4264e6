//! What-if overlays: pods (and the devices of their claims) taken away from a cluster, as
//! preemption simulates evictions. An overlay only records what is removed; the view itself
//! is never changed.

use std::sync::Arc;

use crate::hash::{FastMap, FastSet};
use crate::resources::ResList;
use crate::view::ClusterView;

/// Pods removed from a cluster for a what-if (preemption).
#[derive(Debug, Clone, Default)]
pub(crate) struct Overlay {
    pub removed_pods: FastSet<(String, String)>,
    /// node -> requests and pod slots given back.
    pub freed: FastMap<Arc<str>, (ResList, u32)>,
    /// Claims whose devices are given back.
    pub removed_claims: FastSet<(String, String)>,
}

impl Overlay {
    /// Puts pods removed earlier back.
    pub(crate) fn restore_pods<'k>(
        &mut self,
        c: &ClusterView,
        keys: impl IntoIterator<Item = &'k (String, String)>,
    ) {
        for k in keys {
            if !self.removed_pods.remove(k) {
                continue;
            }
            if let Some(p) = c.pods.get(k) {
                if p.active
                    && let Some(n) = &p.node
                    && let Some(e) = self.freed.get_mut(n)
                {
                    e.0.sub_all(&p.requests);
                    e.1 = e.1.saturating_sub(1);
                    if e.1 == 0 {
                        self.freed.remove(n);
                    }
                }
                for claim in &p.claims {
                    self.removed_claims.remove(&(k.0.clone(), claim.clone()));
                }
            }
        }
    }

    pub(crate) fn remove_pods<'k>(
        &mut self,
        c: &ClusterView,
        keys: impl IntoIterator<Item = &'k (String, String)>,
    ) {
        for k in keys {
            if !self.removed_pods.insert(k.clone()) {
                continue;
            }
            if let Some(p) = c.pods.get(k) {
                if p.active
                    && let Some(n) = &p.node
                {
                    let e = self.freed.entry(n.clone()).or_default();
                    e.0.add_all(&p.requests);
                    e.1 += 1;
                }
                for claim in &p.claims {
                    self.removed_claims.insert((k.0.clone(), claim.clone()));
                }
            }
        }
    }
}
