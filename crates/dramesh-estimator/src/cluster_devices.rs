//! Device (DRA) state of one cluster, kept incrementally as the view changes.
//!
//! The engine's [`Inventory`] (slices, classes, taint rules)
//! and [`AllocatedState`] (devices used by allocated claims) are updated one object at a
//! time; claims are kept in compact form (their allocation only). Each node has a device
//! generation (its local slices or the allocations in its pools changed) and the cluster
//! has a shared generation (classes, taint rules, node-less slices or their allocations,
//! version), which the result caches key on.
//!
//! Each node also has a *shape*: a hash of its local slices and their allocations up to node
//! and pool names, which per-query fit caches share answers by (see [`crate::fit`]). A pool's allocations enter the shape as a multiset hash that is a sum of
//! per-device terms (computed once per claim), so a what-if that gives allocations back
//! (preemption) gets its shape by subtraction and shares cache entries with real states.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use dramesh_engine::{AllocatedState, Inventory, KubeVersion};
use dramesh_model::k8s::{
    AllocationResult, DeviceClass, DeviceTaintRule, ResourceClaim, ResourceSlice,
};

use crate::hash::{FastMap, FastSet};

/// How many recent node changes a cluster remembers (here and in the view's own log).
pub(crate) const CHANGE_LOG: usize = 4096;

/// What the view remembers of a slice.
#[derive(Debug, Clone)]
pub(crate) struct SliceMeta {
    pub node: Option<Arc<str>>,
    /// (driver, pool), in the form `pool_alloc` is keyed by, so lookups need no copies.
    pub pool_key: PoolKey,
    /// Hash of the slice content without its name, node name and pool name.
    pub shape: u64,
    /// counter name -> largest consumption any device of the slice declares (nano-units).
    pub max_counters: BTreeMap<String, i128>,
}

/// The local slices of one node.
#[derive(Debug, Clone, Default)]
pub(crate) struct NodeSlices {
    /// Sorted by slice name.
    pub slices: Vec<(String, Arc<SliceMeta>)>,
    /// `ClusterDevices::compute_shape` of the node, refreshed on every change of its slices
    /// or of the allocations in their pools, so the estimate's per-node path reads one value.
    pub shape: u64,
}

/// (driver, pool) with interned names: lookups clone two `Arc`s, never a string.
pub(crate) type PoolKey = (Arc<str>, Arc<str>);

/// The allocated devices of one pool, as a multiset of markers (see [`marker_of`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct PoolAlloc {
    pub markers: BTreeMap<String, u32>,
    /// Multiset hash of `markers`: the wrapping sum of `marker_hash` over every allocated
    /// marker, counted with multiplicity. Being a sum, it is kept current in O(1) per
    /// change, is the same however the multiset was reached, and a what-if that gives back
    /// some allocations (a subset of the multiset) gets its hash by subtraction.
    pub hash: u64,
}

/// The per-marker term of [`PoolAlloc::hash`].
fn marker_hash(marker: &str) -> u64 {
    hash_of(&marker)
}

/// One device result of an allocation, with driver and pool names interned.
#[derive(Debug, Clone)]
pub(crate) struct CompactResult {
    pub(crate) driver: Arc<str>,
    pub(crate) pool: Arc<str>,
    /// Device and request names repeat across claims (`gpu-0`, `gpu`), so they are interned.
    device: Arc<str>,
    request: Arc<str>,
    admin_access: Option<bool>,
    share_id: Option<Box<str>>,
    consumed: Option<BTreeMap<String, dramesh_model::k8s::K8sQuantity>>,
    /// `marker_hash` of this result's marker, computed once when the claim is stored so a
    /// what-if that releases the claim never formats a marker.
    pub(crate) marker: u64,
}

impl CompactResult {
    fn expand(&self) -> dramesh_model::k8s::DeviceRequestAllocationResult {
        dramesh_model::k8s::DeviceRequestAllocationResult {
            driver: self.driver.to_string(),
            pool: self.pool.to_string(),
            device: self.device.to_string(),
            request: self.request.to_string(),
            admin_access: self.admin_access,
            share_id: self.share_id.as_deref().map(str::to_string),
            consumed_capacity: self.consumed.clone(),
            ..Default::default()
        }
    }
}

pub(crate) fn expand(results: &[CompactResult]) -> AllocationResult {
    AllocationResult {
        devices: Some(dramesh_model::k8s::DeviceAllocationResult {
            results: Some(results.iter().map(CompactResult::expand).collect()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A claim's current allocation, shared between the claim's entry and every pod that names
/// the claim, so preemption reads a pod's devices without looking its claims up by name.
/// It is updated in place when the claim changes (or goes away, or arrives after its pods);
/// the lock is never contended, since the view changes only through `&mut`.
#[derive(Debug, Default)]
pub(crate) struct ClaimHandle(std::sync::RwLock<Option<Arc<[CompactResult]>>>);

impl ClaimHandle {
    pub(crate) fn get(&self) -> Option<Arc<[CompactResult]>> {
        match self.0.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set(&self, allocation: Option<Arc<[CompactResult]>>) {
        match self.0.write() {
            Ok(mut g) => *g = allocation,
            Err(poisoned) => *poisoned.into_inner() = allocation,
        }
    }
}

/// What the view remembers of a claim.
#[derive(Debug, Clone)]
pub(crate) struct ClaimMeta {
    /// The allocation's device results in compact form (node selector and config are not
    /// needed for device state).
    pub allocation: Option<Arc<[CompactResult]>>,
    /// Shared with the view's pods that name this claim, while any does.
    pub handle: Option<Arc<ClaimHandle>>,
    /// The allocation's node selector when it is not the usual single-node pin.
    pub node_selector: Option<dramesh_model::k8s::NodeSelector>,
    /// The node the allocation is pinned to (`matchFields metadata.name In [node]`).
    pub pinned_node: Option<Arc<str>>,
    /// The whole claim, kept only while it is unallocated (it may have to be allocated by
    /// the workload being estimated, when it is a shared claim).
    pub unallocated: Option<Arc<ResourceClaim>>,
}

/// Devices of one DeviceClass in one cluster (see [`ClusterDevices::class_usage`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassUsage {
    /// DeviceClass name.
    pub class: String,
    /// Devices the class selects.
    pub devices: u32,
    /// Of those, devices allocated claims hold.
    pub allocated: u32,
}

/// Device state of one cluster.
#[derive(Debug, Default)]
pub struct ClusterDevices {
    pub(crate) version: KubeVersion,
    pub(crate) version_error: Option<String>,
    pub(crate) inventory: Inventory,
    pub(crate) allocated: AllocatedState,
    pub(crate) slices: FastMap<String, Arc<SliceMeta>>,
    pub(crate) shared_slices: usize,
    pub(crate) classes: BTreeMap<String, Arc<DeviceClass>>,
    pub(crate) taint_rules: usize,
    /// namespace -> claim name -> claim, so lookups by borrowed names allocate nothing.
    claims: FastMap<String, FastMap<String, ClaimMeta>>,
    /// Handles of claims that pods name but the view does not have (yet).
    pending_handles: FastMap<(String, String), Arc<ClaimHandle>>,
    /// (driver, pool) -> node the pool's slices are local to.
    pub(crate) pool_node: FastMap<PoolKey, Arc<str>>,
    /// node -> local slices and the node's current shape.
    pub(crate) node_slices: FastMap<Arc<str>, NodeSlices>,
    /// (driver, pool) -> nodes with a local slice of that pool (once per slice), so a change
    /// of the pool's allocations refreshes the shape of exactly the nodes that depend on it.
    pool_nodes: FastMap<PoolKey, Vec<Arc<str>>>,
    /// Addresses of the interned (driver, pool) names -> the node the pool is local to, for
    /// pools local to exactly one node (see [`ClusterDevices::single_node_of_pool`]). Names
    /// are interned for the life of the cluster, so an address identifies one name; keying
    /// by address makes this a small table a what-if can probe per claim without reading
    /// any string.
    pool_home: FastMap<(usize, usize), Arc<str>>,
    /// (driver, pool) -> multiset of allocated devices (device name and consumed capacity),
    /// kept per pool so it does not depend on whether claims or slices arrived first.
    pub(crate) pool_alloc: FastMap<PoolKey, PoolAlloc>,
    pub(crate) node_gen: FastMap<Arc<str>, u64>,
    pub(crate) shared_gen: u64,
    counter: u64,
    /// Interned driver, pool, device and request names of allocation results.
    names: FastSet<Arc<str>>,
    /// Recent per-node device changes (generation, node), see `ClusterView::log`.
    pub(crate) log: VecDeque<(u64, Arc<str>)>,
    pub(crate) log_floor: u64,
}

fn hash_of<T: Hash>(t: &T) -> u64 {
    let mut h = DefaultHasher::new();
    t.hash(&mut h);
    h.finish()
}

impl ClusterDevices {
    fn tick(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    fn key_for(&self, node: &str) -> Arc<str> {
        self.node_gen
            .get_key_value(node)
            .map(|(k, _)| k.clone())
            .unwrap_or_else(|| Arc::from(node))
    }

    /// The node-name key every per-node index of this cluster uses, registered (with
    /// generation 0, which is what an unknown node reads as) when new. Sharing one `Arc` per
    /// node with the view lets hot-path lookups by the view's name compare pointers only.
    fn intern_node(&mut self, node: &str) -> Arc<str> {
        if let Some((k, _)) = self.node_gen.get_key_value(node) {
            return k.clone();
        }
        let key: Arc<str> = Arc::from(node);
        self.node_gen.insert(key.clone(), 0);
        key
    }

    /// The interned key of a node this cluster's device indexes know.
    pub(crate) fn node_key(&self, node: &str) -> Option<&Arc<str>> {
        self.node_gen.get_key_value(node).map(|(k, _)| k)
    }

    fn bump_node(&mut self, node: &str) {
        let g = self.tick();
        let key = self.key_for(node);
        self.log.push_back((g, key.clone()));
        if self.log.len() > CHANGE_LOG
            && let Some((old, _)) = self.log.pop_front()
        {
            self.log_floor = old;
        }
        self.node_gen.insert(key, g);
    }

    /// The current change counter (node and shared changes).
    pub fn counter(&self) -> u64 {
        self.counter
    }

    fn bump_shared(&mut self) {
        self.shared_gen = self.tick();
    }

    pub(crate) fn set_version(&mut self, v: Option<&str>) {
        match v.map(str::parse::<KubeVersion>) {
            None => {
                self.version = KubeVersion::default();
                self.version_error = None;
            }
            Some(Ok(k)) => {
                self.version = k;
                self.version_error = None;
            }
            Some(Err(e)) => {
                self.version = KubeVersion::default();
                self.version_error = Some(e.to_string());
            }
        }
        self.bump_shared();
    }

    /// The allocator semantics used for this cluster.
    pub fn kube_version(&self) -> KubeVersion {
        self.version
    }

    pub(crate) fn node_changed(&mut self, node: &Arc<str>) {
        if !self.node_gen.contains_key(&**node) {
            self.node_gen.insert(node.clone(), 0);
        }
        self.bump_node(node);
    }

    /// The device generation of one node (0 when it has never had devices).
    pub fn node_generation(&self, node: &str) -> u64 {
        self.node_gen.get(node).copied().unwrap_or(0)
    }

    /// The cluster's shared device generation (classes, taint rules, node-less slices and their allocations, version).
    pub fn shared_generation(&self) -> u64 {
        self.shared_gen
    }

    /// True when the cluster has any ResourceSlice.
    pub fn has_devices(&self) -> bool {
        !self.slices.is_empty()
    }

    /// Number of ResourceSlices.
    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// Number of ResourceClaims.
    pub fn claim_count(&self) -> usize {
        self.claims.values().map(|m| m.len()).sum()
    }

    /// A DeviceClass by name.
    pub fn class(&self, name: &str) -> Option<&Arc<DeviceClass>> {
        self.classes.get(name)
    }

    /// The engine's inventory of this cluster.
    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    /// The devices allocated claims hold.
    pub fn allocated_state(&self) -> &AllocatedState {
        &self.allocated
    }

    /// Per DeviceClass, sorted by name: the devices it selects
    /// ([`Inventory::class_devices`]) and how many of those allocated claims hold. A device
    /// several claims share counts once; an admin-access result does not hold a device (as
    /// in the allocator).
    pub fn class_usage(&self) -> Vec<ClassUsage> {
        let a = &self.allocated;
        self.inventory
            .class_names()
            .map(|class| {
                let (mut devices, mut allocated) = (0u32, 0u32);
                for (driver, pool, device) in self.inventory.class_devices(class) {
                    devices = devices.saturating_add(1);
                    if a.is_dedicated(driver, pool, device)
                        || a.share_count(driver, pool, device) > 0
                    {
                        allocated = allocated.saturating_add(1);
                    }
                }
                ClassUsage {
                    class: class.to_string(),
                    devices,
                    allocated,
                }
            })
            .collect()
    }

    /// The DeviceClass that maps an extended resource name (KEP-5004).
    pub fn class_for_extended_resource(&self, name: &str) -> Option<&Arc<DeviceClass>> {
        let class = self.inventory.extended_resource_class(name)?;
        self.classes.get(class)
    }

    /// Largest consumption of `counter` declared by any device of `driver` (nano-units).
    pub fn max_counter(&self, driver: &str, counter: &str) -> i128 {
        self.slices
            .values()
            .filter(|s| &*s.pool_key.0 == driver)
            .filter_map(|s| s.max_counters.get(counter))
            .copied()
            .max()
            .unwrap_or(0)
    }

    fn alloc_marker(r: &dramesh_model::k8s::DeviceRequestAllocationResult) -> String {
        marker_of(&r.device, &r.consumed_capacity)
    }

    fn account(&mut self, alloc: &AllocationResult, add: bool) {
        let results = alloc
            .devices
            .as_ref()
            .and_then(|d| d.results.clone())
            .unwrap_or_default();
        for r in &results {
            let pool = (self.name(&r.driver), self.name(&r.pool));
            let marker = Self::alloc_marker(r);
            let term = marker_hash(&marker);
            let entry = self.pool_alloc.entry(pool.clone()).or_default();
            let set = &mut entry.markers;
            if add {
                *set.entry(marker).or_default() += 1;
                entry.hash = entry.hash.wrapping_add(term);
            } else if let Some(n) = set.get_mut(&marker) {
                *n -= 1;
                if *n == 0 {
                    set.remove(&marker);
                }
                entry.hash = entry.hash.wrapping_sub(term);
            }
            if set.is_empty() {
                self.pool_alloc.remove(&pool);
            }
            let nodes = self.pool_nodes.get(&pool).cloned().unwrap_or_default();
            for n in &nodes {
                self.refresh_shape(n);
            }
            match self.pool_node.get(&pool).cloned() {
                Some(node) => self.bump_node(&node),
                None => self.bump_shared(),
            }
        }
        if add {
            self.allocated.commit(std::slice::from_ref(alloc));
        } else {
            self.allocated.release(std::slice::from_ref(alloc));
        }
    }

    pub(crate) fn upsert_slice(&mut self, name: &str, slice: &ResourceSlice) -> Result<(), String> {
        self.inventory
            .upsert_slice(slice)
            .map_err(|e| e.to_string())?;
        self.remove_meta(name);
        let spec = &slice.spec;
        let node = spec
            .node_name
            .as_deref()
            .filter(|n| !n.is_empty())
            .map(|n| self.intern_node(n));
        let mut shape_src = spec.clone();
        shape_src.node_name = None;
        shape_src.pool.name = String::new();
        let shape = hash_of(&serde_json::to_string(&shape_src).unwrap_or_default());
        let mut max_counters: BTreeMap<String, i128> = BTreeMap::new();
        for d in spec.devices.iter().flatten() {
            for cc in d.consumes_counters.iter().flatten() {
                for (k, v) in &cc.counters {
                    if let Ok(q) = dramesh_model::Quantity::parse(&v.value.0) {
                        let e = max_counters.entry(k.clone()).or_default();
                        *e = (*e).max(q.nanos());
                    }
                }
            }
        }
        let pool_key = (self.name(&spec.driver), self.name(&spec.pool.name));
        let meta = Arc::new(SliceMeta {
            node: node.clone(),
            pool_key,
            shape,
            max_counters,
        });
        match &node {
            Some(n) => self.register_local(name, n, &meta),
            None => {
                self.shared_slices += 1;
                self.bump_shared();
            }
        }
        self.slices.insert(name.to_string(), meta);
        Ok(())
    }

    /// Indexes node `n`'s local slice `name` (the inventory already holds it).
    fn register_local(&mut self, name: &str, n: &Arc<str>, meta: &Arc<SliceMeta>) {
        let names = &mut self.node_slices.entry(n.clone()).or_default().slices;
        match names.binary_search_by(|x| x.0.as_str().cmp(name)) {
            Ok(i) => names[i].1 = meta.clone(),
            Err(i) => names.insert(i, (name.to_string(), meta.clone())),
        }
        self.pool_nodes
            .entry(meta.pool_key.clone())
            .or_default()
            .push(n.clone());
        self.refresh_shape(n);
        self.pool_node.insert(meta.pool_key.clone(), n.clone());
        self.refresh_pool_home(&meta.pool_key);
        self.bump_node(n);
    }

    /// The device state a new, empty node shaped like `node` would have: `node`'s local
    /// slices (from [`Inventory::node_copy`], not re-parsed), every DeviceClass and
    /// DeviceTaintRule, this cluster's Kubernetes version, nothing allocated and no
    /// node-less slice (devices attached to the network are not counted for new nodes).
    pub(crate) fn for_new_node(&self, node: &str) -> ClusterDevices {
        let mut out = ClusterDevices {
            version: self.version,
            version_error: self.version_error.clone(),
            inventory: self.inventory.node_copy(node),
            classes: self.classes.clone(),
            taint_rules: self.taint_rules,
            ..ClusterDevices::default()
        };
        let Some(local) = self.node_slices.get(node) else {
            return out;
        };
        let n = out.intern_node(node);
        for (name, meta) in &local.slices {
            // The copies keep the interned pool names, so lookups by address still find them.
            out.names.insert(meta.pool_key.0.clone());
            out.names.insert(meta.pool_key.1.clone());
            let meta = Arc::new(SliceMeta {
                node: Some(n.clone()),
                ..(**meta).clone()
            });
            out.register_local(name, &n, &meta);
            out.slices.insert(name.clone(), meta);
        }
        out
    }

    fn remove_meta(&mut self, name: &str) {
        let Some(old) = self.slices.remove(name) else {
            return;
        };
        match &old.node {
            Some(n) => {
                if let Some(v) = self.node_slices.get_mut(n) {
                    v.slices.retain(|s| s.0 != name);
                    if v.slices.is_empty() {
                        self.node_slices.remove(n);
                    } else {
                        self.refresh_shape(n);
                    }
                }
                if let Some(v) = self.pool_nodes.get_mut(&old.pool_key) {
                    if let Some(i) = v.iter().position(|x| x == n) {
                        v.swap_remove(i);
                    }
                    // The pool stays local to a node that still has one of its slices.
                    match v.last().cloned() {
                        Some(rest) => {
                            if !v.contains(n) {
                                self.pool_node.insert(old.pool_key.clone(), rest);
                            }
                        }
                        None => {
                            self.pool_nodes.remove(&old.pool_key);
                            self.pool_node.remove(&old.pool_key);
                        }
                    }
                }
                let n = n.clone();
                self.refresh_pool_home(&old.pool_key);
                self.bump_node(&n);
            }
            None => {
                self.shared_slices = self.shared_slices.saturating_sub(1);
                self.bump_shared();
            }
        }
    }

    pub(crate) fn remove_slice(&mut self, name: &str) {
        self.inventory.remove_slice(name);
        self.remove_meta(name);
    }

    pub(crate) fn upsert_class(
        &mut self,
        name: &str,
        class: Arc<DeviceClass>,
    ) -> Result<(), String> {
        self.inventory
            .upsert_class(&class)
            .map_err(|e| e.to_string())?;
        self.classes.insert(name.to_string(), class);
        self.bump_shared();
        Ok(())
    }

    pub(crate) fn remove_class(&mut self, name: &str) {
        self.inventory.remove_class(name);
        if self.classes.remove(name).is_some() {
            self.bump_shared();
        }
    }

    pub(crate) fn upsert_taint_rule(&mut self, rule: &DeviceTaintRule) -> Result<(), String> {
        let name = rule.metadata.name.clone().unwrap_or_default();
        let existed = self.inventory.remove_taint_rule(&name);
        self.inventory
            .upsert_taint_rule(rule)
            .map_err(|e| e.to_string())?;
        if !existed {
            self.taint_rules += 1;
        }
        self.bump_shared();
        Ok(())
    }

    pub(crate) fn remove_taint_rule(&mut self, name: &str) {
        if self.inventory.remove_taint_rule(name) {
            self.taint_rules = self.taint_rules.saturating_sub(1);
            self.bump_shared();
        }
    }

    fn name(&mut self, n: &str) -> Arc<str> {
        if let Some(a) = self.names.get(n) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(n);
        self.names.insert(a.clone());
        a
    }

    pub(crate) fn upsert_claim(&mut self, namespace: &str, name: &str, claim: Arc<ResourceClaim>) {
        self.remove_claim(namespace, name);
        // Pods that name the claim keep their handle (it was parked by `remove_claim`).
        let handle = self
            .pending_handles
            .remove(&(namespace.to_string(), name.to_string()));
        let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
        let mut compact = None;
        let mut node_selector = None;
        let mut pinned_node = None;
        if let Some(a) = allocation {
            self.account(a, true);
            let mut v = Vec::new();
            for r in a.devices.iter().flat_map(|d| d.results.iter().flatten()) {
                v.push(CompactResult {
                    driver: self.name(&r.driver),
                    pool: self.name(&r.pool),
                    device: self.name(&r.device),
                    request: self.name(&r.request),
                    admin_access: r.admin_access,
                    share_id: r.share_id.as_deref().map(Into::into),
                    consumed: r.consumed_capacity.clone(),
                    marker: marker_hash(&Self::alloc_marker(r)),
                });
            }
            compact = Some(Arc::from(v));
            if let Some(sel) = &a.node_selector {
                match single_node(sel) {
                    Some(n) => pinned_node = Some(self.key_for(n)),
                    None => node_selector = Some(sel.clone()),
                }
            }
        } else {
            self.bump_shared();
        }
        let unallocated = compact.is_none().then_some(claim);
        if let Some(h) = &handle {
            h.set(compact.clone());
        }
        self.claims
            .entry(namespace.to_string())
            .or_default()
            .insert(
                name.to_string(),
                ClaimMeta {
                    allocation: compact,
                    handle,
                    node_selector,
                    pinned_node,
                    unallocated,
                },
            );
    }

    /// The handle of a claim a pod names (created when the first pod names it). Each call
    /// must be matched by [`Self::release_handle`] once the pod drops the handle.
    pub(crate) fn claim_handle(&mut self, namespace: &str, name: &str) -> Arc<ClaimHandle> {
        if let Some(meta) = self.claims.get_mut(namespace).and_then(|m| m.get_mut(name)) {
            let allocation = meta.allocation.clone();
            return meta
                .handle
                .get_or_insert_with(|| Arc::new(ClaimHandle(allocation.into())))
                .clone();
        }
        self.pending_handles
            .entry((namespace.to_string(), name.to_string()))
            .or_default()
            .clone()
    }

    /// Forgets a claim's handle when no pod holds it any more.
    pub(crate) fn release_handle(&mut self, namespace: &str, name: &str) {
        if let Some(meta) = self.claims.get_mut(namespace).and_then(|m| m.get_mut(name)) {
            if meta
                .handle
                .as_ref()
                .is_some_and(|h| Arc::strong_count(h) == 1)
            {
                meta.handle = None;
            }
            return;
        }
        let key = (namespace.to_string(), name.to_string());
        if self
            .pending_handles
            .get(&key)
            .is_some_and(|h| Arc::strong_count(h) == 1)
        {
            self.pending_handles.remove(&key);
        }
    }

    pub(crate) fn remove_claim(&mut self, namespace: &str, name: &str) {
        let Some(in_ns) = self.claims.get_mut(namespace) else {
            return;
        };
        let old = in_ns.remove(name);
        if in_ns.is_empty() {
            self.claims.remove(namespace);
        }
        let Some(old) = old else {
            return;
        };
        if let Some(h) = old.handle {
            // Pods still name it: they now see no allocation, and keep the handle.
            h.set(None);
            self.pending_handles
                .insert((namespace.to_string(), name.to_string()), h);
        }
        if let Some(a) = &old.allocation {
            self.account(&expand(a), false);
        }
    }

    /// True when the view has the claim `namespace/name`.
    pub fn has_claim(&self, namespace: &str, name: &str) -> bool {
        self.claim(namespace, name).is_some()
    }

    pub(crate) fn claim(&self, namespace: &str, name: &str) -> Option<&ClaimMeta> {
        self.claims.get(namespace)?.get(name)
    }

    /// Shape hash of one node's local devices and their allocations, optionally with some
    /// allocations (per pool) taken away.
    pub(crate) fn node_shape(&self, node: &Arc<str>, removed: Option<&PoolReleased>) -> u64 {
        match (removed, self.node_slices.get(node)) {
            (None, Some(n)) => n.shape,
            _ => self.compute_shape(node, removed),
        }
    }

    fn compute_shape(&self, node: &str, removed: Option<&PoolReleased>) -> u64 {
        self.shape_with(node, |pool| {
            removed.and_then(|r| r.get(pool)).copied().unwrap_or(0)
        })
    }

    /// The node's shape with the allocations of `released` (claims whose devices are all in
    /// pools of this node) given back.
    pub(crate) fn shape_released(&self, node: &str, released: &[&[CompactResult]]) -> u64 {
        self.shape_with(node, |(driver, pool)| {
            released
                .iter()
                .flat_map(|a| a.iter())
                .filter(|r| r.driver == *driver && r.pool == *pool)
                .fold(0u64, |s, r| s.wrapping_add(r.marker))
        })
    }

    /// Shape hash with `released(pool)` (a sum of marker terms of allocations that are part
    /// of the pool's multiset) subtracted from each pool's multiset hash. Taking away a
    /// sub-multiset this way gives exactly the hash the remaining multiset has when reached
    /// by changes, which is what lets what-if shapes share cache entries with real ones.
    fn shape_with(&self, node: &str, released: impl Fn(&PoolKey) -> u64) -> u64 {
        let mut h = DefaultHasher::new();
        for (_, m) in self.node_slices.get(node).iter().flat_map(|n| &n.slices) {
            m.shape.hash(&mut h);
            let pool = &m.pool_key;
            let held = self.pool_alloc.get(pool).map_or(0, |a| a.hash);
            held.wrapping_sub(released(pool)).hash(&mut h);
        }
        h.finish()
    }

    /// The node a pool's slices are local to, by plain names.
    pub(crate) fn pool_node_named(&self, driver: &str, pool: &str) -> Option<&Arc<str>> {
        // Pool keys are made of interned names, so an unknown name has no pool.
        let key = (
            self.names.get(driver)?.clone(),
            self.names.get(pool)?.clone(),
        );
        self.pool_node.get(&key)
    }

    /// The node a pool's slices are local to, when they are all local to that one node.
    pub(crate) fn single_node_of_pool(
        &self,
        driver: &Arc<str>,
        pool: &Arc<str>,
    ) -> Option<&Arc<str>> {
        let key = (driver.clone(), pool.clone());
        let node = self.pool_node.get(&key)?;
        let all = self.pool_nodes.get(&key)?;
        all.iter().all(|n| n == node).then_some(node)
    }

    /// Recomputes `pool_home` of a pool after its slices changed.
    fn refresh_pool_home(&mut self, pool: &PoolKey) {
        let key = name_addrs(&pool.0, &pool.1);
        match self.single_node_of_pool(&pool.0, &pool.1).cloned() {
            Some(n) => {
                self.pool_home.insert(key, n);
            }
            None => {
                self.pool_home.remove(&key);
            }
        }
    }

    /// [`ClusterDevices::single_node_of_pool`] for the names of an allocation result, by
    /// address (they are interned by this cluster).
    pub(crate) fn home_of(&self, r: &CompactResult) -> Option<&Arc<str>> {
        self.pool_home.get(&name_addrs(&r.driver, &r.pool))
    }

    fn refresh_shape(&mut self, node: &str) {
        if !self.node_slices.contains_key(node) {
            return;
        }
        let shape = self.compute_shape(node, None);
        if let Some(n) = self.node_slices.get_mut(node) {
            n.shape = shape;
        }
    }
}

/// Address of an interned name: identifies the name for as long as the interner keeps it.
pub(crate) fn name_addr(name: &Arc<str>) -> usize {
    Arc::as_ptr(name) as *const u8 as usize
}

fn name_addrs(driver: &Arc<str>, pool: &Arc<str>) -> (usize, usize) {
    (name_addr(driver), name_addr(pool))
}

/// Identity of one allocated device use within its pool: device name and consumed capacity.
fn marker_of(
    device: &str,
    consumed: &Option<BTreeMap<String, dramesh_model::k8s::K8sQuantity>>,
) -> String {
    match consumed {
        None => format!("{device}/null"),
        Some(c) => format!("{device}/{}", serde_json::to_string(c).unwrap_or_default()),
    }
}

/// The node of a `matchFields metadata.name In [node]` selector with one term.
fn single_node(sel: &dramesh_model::k8s::NodeSelector) -> Option<&str> {
    let [term] = sel.node_selector_terms.as_slice() else {
        return None;
    };
    if term
        .match_expressions
        .as_ref()
        .is_some_and(|e| !e.is_empty())
    {
        return None;
    }
    let [req] = term.match_fields.as_deref()? else {
        return None;
    };
    match (
        req.key.as_str(),
        req.operator.as_str(),
        req.values.as_deref(),
    ) {
        ("metadata.name", "In", Some([n])) => Some(n.as_str()),
        _ => None,
    }
}

/// Per pool, the sum of the marker terms of allocations a what-if gives back.
pub(crate) type PoolReleased = FastMap<PoolKey, u64>;

#[cfg(test)]
mod tests {
    use super::{ClaimHandle, ClusterDevices};
    use dramesh_sim::typed;
    use std::sync::Arc;

    fn check_cached(d: &ClusterDevices, node: &str) -> u64 {
        let key: Arc<str> = Arc::from(node);
        let cached = d.node_shape(&key, None);
        assert_eq!(cached, d.compute_shape(node, None), "stale shape of {node}");
        cached
    }

    #[test]
    fn cached_node_shapes_follow_slice_and_claim_changes() {
        let mut d = ClusterDevices::default();
        for n in ["n1", "n2"] {
            d.upsert_slice(&format!("{n}-s"), &typed::gpu_slice(n, 4, "A100"))
                .expect("slice");
        }
        assert_eq!(check_cached(&d, "n1"), check_cached(&d, "n2"));
        let claim = Arc::new(typed::allocated_claim("default", "c1", "n1", 2));
        d.upsert_claim("default", "c1", claim);
        assert_ne!(check_cached(&d, "n1"), check_cached(&d, "n2"));
        // A claim that arrives before its slice is counted once the slice appears.
        let early = Arc::new(typed::allocated_claim("default", "c3", "n3", 2));
        d.upsert_claim("default", "c3", early);
        d.upsert_slice("n3-s", &typed::gpu_slice("n3", 4, "A100"))
            .expect("slice");
        assert_eq!(check_cached(&d, "n3"), check_cached(&d, "n1"));
        d.remove_claim("default", "c1");
        assert_eq!(check_cached(&d, "n1"), check_cached(&d, "n2"));
        d.upsert_slice("n2-s", &typed::gpu_slice("n2", 4, "H100"))
            .expect("slice");
        assert_ne!(check_cached(&d, "n1"), check_cached(&d, "n2"));
        d.remove_slice("n2-s");
        assert_eq!(
            check_cached(&d, "n2"),
            d.compute_shape("no-such-node", None)
        );
    }

    #[test]
    fn pool_homes_follow_slice_changes() {
        let mut d = ClusterDevices::default();
        d.upsert_slice("n1-s", &typed::gpu_slice("n1", 2, "A100"))
            .expect("slice");
        d.upsert_claim(
            "default",
            "c1",
            Arc::new(typed::allocated_claim("default", "c1", "n1", 0)),
        );
        let home = |d: &ClusterDevices| {
            let results = d
                .claim("default", "c1")
                .and_then(|m| m.allocation.clone())
                .expect("allocated");
            d.home_of(&results[0]).map(|n| n.to_string())
        };
        assert_eq!(home(&d), Some("n1".to_string()));
        // A slice of the same pool on another node: the pool is no longer node-local.
        let mut other = typed::gpu_slice("n2", 2, "A100");
        other.spec.pool.name = "n1".into();
        d.upsert_slice("n2-s", &other).expect("slice");
        assert_eq!(home(&d), None);
        d.remove_slice("n2-s");
        assert_eq!(home(&d), Some("n1".to_string()));
        d.remove_slice("n1-s");
        assert_eq!(home(&d), None);
    }

    #[test]
    fn released_shape_equals_shape_after_removal() {
        let mut d = ClusterDevices::default();
        for n in ["n1", "n2"] {
            d.upsert_slice(&format!("{n}-s"), &typed::gpu_slice(n, 4, "A100"))
                .expect("slice");
        }
        for (name, node, dev) in [("a", "n1", 0), ("b", "n1", 1), ("c", "n2", 1)] {
            d.upsert_claim(
                "default",
                name,
                Arc::new(typed::allocated_claim("default", name, node, dev)),
            );
        }
        let released = d
            .claim("default", "a")
            .and_then(|m| m.allocation.clone())
            .expect("allocated");
        let what_if = d.shape_released("n1", &[&released[..]]);
        d.remove_claim("default", "a");
        assert_eq!(what_if, check_cached(&d, "n1"));
        // n1 now holds gpu-1 as n2 does: same shape.
        assert_eq!(what_if, check_cached(&d, "n2"));
    }

    #[test]
    fn claim_handles_follow_the_claim() {
        let mut d = ClusterDevices::default();
        d.upsert_slice("n1-s", &typed::gpu_slice("n1", 4, "A100"))
            .expect("slice");
        let device = |h: &ClaimHandle| h.get().map(|a| a[0].device.to_string());
        // A pod names the claim before it arrives.
        let h = d.claim_handle("default", "c");
        assert_eq!(device(&h), None);
        let claim = |dev| Arc::new(typed::allocated_claim("default", "c", "n1", dev));
        d.upsert_claim("default", "c", claim(1));
        assert_eq!(device(&h), Some("gpu-1".to_string()));
        d.upsert_claim("default", "c", claim(2));
        assert_eq!(device(&h), Some("gpu-2".to_string()));
        d.remove_claim("default", "c");
        assert_eq!(device(&h), None);
        d.upsert_claim("default", "c", claim(3));
        assert_eq!(device(&h), Some("gpu-3".to_string()));
        // A second pod shares the handle; the entry keeps it while any pod holds it.
        let h2 = d.claim_handle("default", "c");
        assert!(Arc::ptr_eq(&h, &h2));
        drop(h2);
        d.release_handle("default", "c");
        assert!(d.claim("default", "c").is_some_and(|m| m.handle.is_some()));
        drop(h);
        d.release_handle("default", "c");
        assert!(d.claim("default", "c").is_some_and(|m| m.handle.is_none()));
        // Handles of claims that never arrive are forgotten with their last pod.
        let orphan = d.claim_handle("default", "missing");
        drop(orphan);
        d.release_handle("default", "missing");
        assert!(d.pending_handles.is_empty());
    }
}
