//! Which devices are already in use: the allocator's view of allocated ResourceClaims.
//!
//! Mirrors Kubernetes' `AllocatedState`: results of allocated claims without `shareID` and
//! without `adminAccess` make a device exclusively used; results with a `shareID`
//! (consumable capacity) add their `consumedCapacity` to the device's aggregated usage.
//! `adminAccess` results are ignored. Counter consumption of partitionable devices is not
//! stored: it is derived from the set of allocated devices when a pool's counters are needed,
//! exactly as Kubernetes does, so it stays right when slices change.
//!
//! [`AllocatedState::commit`] and [`AllocatedState::release`] are exact inverses, so an
//! estimator can place replica after replica and roll back without cloning. `Clone` costs
//! reference-count increments only: each driver's pool map and each pool's device map are
//! shared copy-on-write, so a copy that then changes a few pools duplicates only those.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use dramesh_model::k8s;
use dramesh_model::{QualifiedName, Quantity};

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct DevUse {
    /// Exclusive allocations, counted so that `release` after a double `commit` is exact.
    pub dedicated: u32,
    /// Number of live shares (results with a shareID).
    pub shares: u32,
    /// Summed consumed capacity of the shares in nano-units, by qualified capacity name.
    pub consumed: HashMap<QualifiedName, i128>,
}

impl DevUse {
    pub(crate) fn allocated(&self) -> bool {
        self.dedicated > 0 || self.shares > 0
    }
}

pub(crate) type DevUses = HashMap<String, DevUse>;
type PoolUses = HashMap<Arc<str>, Arc<DevUses>>;

/// Devices in use by already-allocated claims.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllocatedState {
    /// driver -> pool -> device, so lookups by borrowed names allocate nothing.
    uses: HashMap<Arc<str>, Arc<PoolUses>>,
    share_ids: HashSet<String>,
}

impl AllocatedState {
    /// No device in use.
    pub fn new() -> AllocatedState {
        AllocatedState::default()
    }

    /// State from all allocated claims (claims without `status.allocation` are skipped).
    pub fn from_claims<'a>(claims: impl IntoIterator<Item = &'a k8s::ResourceClaim>) -> Self {
        let mut s = AllocatedState::new();
        for c in claims {
            if let Some(a) = c.status.as_ref().and_then(|st| st.allocation.as_ref()) {
                s.commit(std::slice::from_ref(a));
            }
        }
        s
    }

    /// The use record of a result's device, created when absent (so always `Some`; the
    /// keys are only allocated when the driver or pool is new).
    fn entry(&mut self, r: &k8s::DeviceRequestAllocationResult) -> Option<&mut DevUse> {
        if !self.uses.contains_key(r.driver.as_str()) {
            self.uses.insert(r.driver.as_str().into(), Arc::default());
        }
        let pools = Arc::make_mut(self.uses.get_mut(r.driver.as_str())?);
        if !pools.contains_key(r.pool.as_str()) {
            pools.insert(r.pool.as_str().into(), Arc::default());
        }
        let devs = Arc::make_mut(pools.get_mut(r.pool.as_str())?);
        Some(devs.entry(r.device.clone()).or_default())
    }

    /// Marks the devices of these allocations as used.
    pub fn commit(&mut self, allocations: &[k8s::AllocationResult]) {
        for r in results(allocations) {
            let Some(e) = self.entry(r) else {
                continue;
            };
            match &r.share_id {
                Some(id) => {
                    e.shares += 1;
                    for (name, q) in r.consumed_capacity.iter().flatten() {
                        let qn = QualifiedName::parse(name, &r.driver);
                        *e.consumed.entry(qn).or_default() += Quantity::from(q).nanos();
                    }
                    self.share_ids.insert(id.clone());
                }
                None => e.dedicated += 1,
            }
        }
    }

    /// Undoes [`Self::commit`] of the same allocations.
    pub fn release(&mut self, allocations: &[k8s::AllocationResult]) {
        for r in results(allocations) {
            // Look first, so releasing what is not there copies no shared map.
            if self.lookup(&r.driver, &r.pool, &r.device).is_none() {
                continue;
            }
            let Some(pools) = self.uses.get_mut(r.driver.as_str()).map(Arc::make_mut) else {
                continue;
            };
            let Some(devs) = pools.get_mut(r.pool.as_str()).map(Arc::make_mut) else {
                continue;
            };
            let Some(e) = devs.get_mut(&r.device) else {
                continue;
            };
            match &r.share_id {
                Some(id) => {
                    e.shares = e.shares.saturating_sub(1);
                    for (name, q) in r.consumed_capacity.iter().flatten() {
                        let qn = QualifiedName::parse(name, &r.driver);
                        if let Some(v) = e.consumed.get_mut(&qn) {
                            *v -= Quantity::from(q).nanos();
                        }
                    }
                    if e.shares == 0 {
                        e.consumed.clear();
                    }
                    self.share_ids.remove(id);
                }
                None => e.dedicated = e.dedicated.saturating_sub(1),
            }
            if !e.allocated() {
                devs.remove(&r.device);
                if devs.is_empty() {
                    pools.remove(r.pool.as_str());
                    if pools.is_empty() {
                        self.uses.remove(r.driver.as_str());
                    }
                }
            }
        }
    }

    /// The uses of one pool's devices, for callers that look up many devices of one pool.
    pub(crate) fn pool_uses(&self, driver: &str, pool: &str) -> Option<&DevUses> {
        self.uses.get(driver)?.get(pool).map(|d| &**d)
    }

    pub(crate) fn lookup(&self, driver: &str, pool: &str, device: &str) -> Option<&DevUse> {
        self.uses.get(driver)?.get(pool)?.get(device)
    }

    /// True when the device is exclusively allocated.
    pub fn is_dedicated(&self, driver: &str, pool: &str, device: &str) -> bool {
        self.lookup(driver, pool, device)
            .is_some_and(|u| u.dedicated > 0)
    }

    /// Number of live shares of a multi-allocatable device.
    pub fn share_count(&self, driver: &str, pool: &str, device: &str) -> u32 {
        self.lookup(driver, pool, device).map_or(0, |u| u.shares)
    }

    /// True when no device is in use.
    pub fn is_empty(&self) -> bool {
        self.uses.is_empty()
    }

    /// True when this shareID is already used by an allocated claim.
    pub fn has_share_id(&self, id: &str) -> bool {
        self.share_ids.contains(id)
    }
}

fn results(
    allocations: &[k8s::AllocationResult],
) -> impl Iterator<Item = &k8s::DeviceRequestAllocationResult> {
    allocations
        .iter()
        .filter_map(|a| a.devices.as_ref())
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.admin_access != Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(dev: &str, share: Option<&str>, admin: bool) -> k8s::DeviceRequestAllocationResult {
        k8s::DeviceRequestAllocationResult {
            request: "req".into(),
            driver: "d".into(),
            pool: "p".into(),
            device: dev.into(),
            admin_access: admin.then_some(true),
            share_id: share.map(str::to_string),
            consumed_capacity: share.map(|_| {
                [("bw".to_string(), k8s::K8sQuantity("2".into()))]
                    .into_iter()
                    .collect()
            }),
            ..Default::default()
        }
    }

    fn alloc(rs: Vec<k8s::DeviceRequestAllocationResult>) -> k8s::AllocationResult {
        k8s::AllocationResult {
            devices: Some(k8s::DeviceAllocationResult {
                results: Some(rs),
                config: None,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn commit_release_round_trip() {
        let a = alloc(vec![
            result("a", None, false),
            result("b", Some("s1"), false),
            result("c", None, true),
        ]);
        let mut s = AllocatedState::new();
        s.commit(std::slice::from_ref(&a));
        assert!(s.is_dedicated("d", "p", "a"));
        assert!(!s.is_dedicated("d", "p", "c"), "admin access is not a use");
        assert_eq!(s.share_count("d", "p", "b"), 1);
        let qn = QualifiedName::parse("bw", "d");
        assert_eq!(
            s.lookup("d", "p", "b").unwrap().consumed[&qn],
            2_000_000_000
        );
        assert!(s.has_share_id("s1"));
        s.release(std::slice::from_ref(&a));
        assert_eq!(s, AllocatedState::new());
    }
}
