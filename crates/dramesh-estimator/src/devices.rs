//! Device (DRA) state of one cluster, and the only place the estimator talks to the
//! allocation engine (`dramesh-engine`).
//!
//! State is kept incrementally: the engine's [`Inventory`] (slices, classes, taint rules)
//! and [`AllocatedState`] (devices used by allocated claims) are updated one object at a
//! time; claims are kept in compact form (their allocation only). Each node has a device
//! generation (its local slices or the allocations in its pools changed) and the cluster
//! has a shared generation (classes, taint rules, node-less slices or their allocations,
//! version), which the result caches key on.
//!
//! Estimation semantics ([`DeviceQuery::fit`]): on a node, replica after replica gets its
//! own fresh allocation of the pod's template claims from the engine, against the state
//! that already includes the earlier replicas (on any node); the count stops at the first
//! replica that does not fit. Allocations that only use devices local to the node are rolled
//! back after the node is counted (they cannot affect another node); allocations that use
//! shared devices stay, so later nodes see them.
//!
//! Caching never changes results: a node's answer is reused only when its device generation
//! and the cluster's shared generation are unchanged and no replica of the current query
//! has consumed a shared device yet. Nodes whose local slices and local allocations are
//! identical up to node and pool names ("same shape") share one answer when the cluster has
//! no node-less slices and no taint rules, since then nothing else can influence a node's
//! allocation. A pool's allocations enter the shape as a multiset hash that is a sum of
//! per-device terms (computed once per claim), so a what-if that gives allocations back
//! (preemption) gets its shape by subtraction and shares cache entries with real states.
//!
//! Assumed (in-flight) replicas with claims are allocated by the same replica-by-replica
//! count (`DeviceQuery::place`) but keep their allocations, in an `AssumedDevices` state
//! the estimate's query then starts from. Node answers of nodes holding assumed allocations
//! bypass the caches; once an assumed replica holds a device that is not local to its node,
//! the whole query does.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use dramesh_engine::{AllocatedState, Inventory, KubeVersion, NodeInfo, Options, Outcome};
use dramesh_model::k8s::{
    AllocationResult, DeviceClaim, DeviceClass, DeviceRequest, DeviceTaintRule, ExactDeviceRequest,
    ObjectMeta, ResourceClaim, ResourceClaimSpec, ResourceSlice,
};

use crate::estimate::Overlay;
use crate::resources::{ResName, is_extended_resource};
use crate::view::{ClusterView, NodeEntry};
use crate::workload::Workload;

pub(crate) use crate::fasthash::{FastMap, FastSet};

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
    driver: Arc<str>,
    pool: Arc<str>,
    /// Device and request names repeat across claims (`gpu-0`, `gpu`), so they are interned.
    device: Arc<str>,
    request: Arc<str>,
    admin_access: Option<bool>,
    share_id: Option<Box<str>>,
    consumed: Option<BTreeMap<String, dramesh_model::k8s::K8sQuantity>>,
    /// `marker_hash` of this result's marker, computed once when the claim is stored so a
    /// what-if that releases the claim never formats a marker.
    marker: u64,
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

fn expand(results: &[CompactResult]) -> AllocationResult {
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
        if self.log.len() > crate::view::CHANGE_LOG
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

    pub fn shared_generation(&self) -> u64 {
        self.shared_gen
    }

    pub fn has_devices(&self) -> bool {
        !self.slices.is_empty()
    }

    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    pub fn claim_count(&self) -> usize {
        self.claims.values().map(|m| m.len()).sum()
    }

    pub fn class(&self, name: &str) -> Option<&Arc<DeviceClass>> {
        self.classes.get(name)
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    pub fn allocated_state(&self) -> &AllocatedState {
        &self.allocated
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
            Some(n) => {
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
            None => {
                self.shared_slices += 1;
                self.bump_shared();
            }
        }
        self.slices.insert(name.to_string(), meta);
        Ok(())
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

    pub fn has_claim(&self, namespace: &str, name: &str) -> bool {
        self.claim(namespace, name).is_some()
    }

    pub(crate) fn claim(&self, namespace: &str, name: &str) -> Option<&ClaimMeta> {
        self.claims.get(namespace)?.get(name)
    }

    /// Shape hash of one node's local devices and their allocations, optionally with some
    /// allocations (per pool) taken away.
    fn node_shape(&self, node: &Arc<str>, removed: Option<&PoolReleased>) -> u64 {
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
    fn shape_released(&self, node: &str, released: &[&[CompactResult]]) -> u64 {
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
    fn pool_node_named(&self, driver: &str, pool: &str) -> Option<&Arc<str>> {
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
type PoolReleased = FastMap<PoolKey, u64>;

/// Upper bound of entries per cache map before it is cleared.
const MAX_CACHE_ENTRIES: usize = 1 << 20;

/// A cached node answer: (node generation, shared generation, cap used, fit).
type NodeAnswer = (u64, u64, i64, i64);

/// Per-node device answers kept between estimates of one cluster.
#[derive(Debug, Default)]
pub struct DeviceCache {
    /// (query fingerprint, node) -> (node generation, shared generation, cap, fit).
    per_node: FastMap<(u64, Arc<str>), NodeAnswer>,
    /// (query fingerprint, shape, shared generation) -> (cap, fit).
    per_shape: FastMap<(u64, u64, u64), (i64, i64)>,
    /// A copy of the cluster's device state as of a device change counter, reused by
    /// queries so a cache miss does not copy the whole state. Local allocations made by a
    /// query are rolled back; `scratch_dirty` marks a copy a query changed for good.
    scratch: Option<(u64, AllocatedState)>,
    scratch_dirty: bool,
}

impl DeviceCache {
    pub fn len(&self) -> usize {
        self.per_node.len() + self.per_shape.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A reused answer computed with cap `cap_used` is exact for `cap` when it stopped short of
/// its cap, or when the new cap is not larger.
fn reuse(cap_used: i64, fit: i64, cap: i64) -> Option<i64> {
    if fit < cap_used || cap <= cap_used {
        Some(fit.min(cap))
    } else {
        None
    }
}

/// The device state of one cluster with the allocations of assumed (in-flight) replicas
/// committed, built by first-fit before the estimate (see `estimate::assumed_deductions`).
///
/// Queries prepared with it count against this state, and never read or write a cache
/// entry for a node whose local devices hold assumed allocations; once an assumed replica
/// holds a device not local to one node, no cache applies at all (as when a query itself
/// consumes a shared device).
#[derive(Debug, Clone)]
pub(crate) struct AssumedDevices {
    /// The view's allocations, minus those a what-if overlay gives back, plus those of the
    /// assumed replicas placed so far.
    state: AllocatedState,
    /// Nodes whose local pools hold devices of assumed replicas.
    nodes: FastSet<Arc<str>>,
    /// An assumed replica holds a device that is not local to its node.
    shared: bool,
    /// Shared claims (namespace, name) allocated by assumed replicas (once, by the first
    /// that needed them), with the allocation's node selector.
    claims: FastMap<(String, String), Option<dramesh_model::k8s::NodeSelector>>,
}

impl AssumedDevices {
    /// The cluster's device state under `overlay`, nothing assumed yet.
    pub(crate) fn start(c: &ClusterView, overlay: Option<&Overlay>) -> AssumedDevices {
        let devices = &c.devices;
        let mut state = devices.allocated.clone();
        if let Some(o) = overlay {
            for key in &o.removed_claims {
                if let Some(m) = devices.claim(&key.0, &key.1)
                    && let Some(a) = &m.allocation
                {
                    state.release(std::slice::from_ref(&expand(a)));
                }
            }
        }
        AssumedDevices {
            state,
            nodes: FastSet::default(),
            shared: false,
            claims: FastMap::default(),
        }
    }

    /// True once any assumed replica holds a device.
    pub(crate) fn holds_devices(&self) -> bool {
        self.shared || !self.nodes.is_empty() || !self.claims.is_empty()
    }

    fn hold(&mut self, node: &NodeEntry, local: bool) {
        if local {
            self.nodes.insert(node.name.clone());
        } else {
            self.shared = true;
        }
    }
}

/// A prepared device question for one workload on one cluster.
pub(crate) struct DeviceQuery<'a> {
    devices: &'a ClusterDevices,
    /// A private copy of the device state, used when no cache scratch copy can be (the
    /// overlay releases devices, or there is no cache).
    owned: Option<AllocatedState>,
    /// Work on the cache's scratch copy of the device state (kept between queries).
    use_scratch: bool,
    opts: Options,
    /// Template claims of one replica.
    template_claims: Vec<ResourceClaim>,
    /// Extended resources a DeviceClass maps: (resource, class, count).
    dra_extended: Vec<(ResName, String, i64)>,
    /// Allocated shared claims' node selectors.
    shared_selectors: Vec<dramesh_model::k8s::NodeSelector>,
    /// Shared claims still to be allocated by the first replica.
    pending_shared: Vec<Arc<ResourceClaim>>,
    fingerprint: u64,
    /// Set once a replica of this query consumed a shared device (caches stop applying).
    dirty: bool,
    overlay_nodes: FastSet<Arc<str>>,
    /// Markers of the allocations an overlay released, per pool.
    overlay_released: PoolReleased,
    /// Allocations the overlay releases, applied to `state` only when the engine is
    /// actually called (cache hits never need them).
    to_release: Vec<&'a [CompactResult]>,
    /// Per-node what-if mode (see [`DeviceQuery::release_per_node`]): `node_release` then
    /// replaces the overlay for the next node asked.
    per_node_release: bool,
    node_release: Vec<&'a [CompactResult]>,
    cache: Option<&'a mut DeviceCache>,
    shape_ok: bool,
    /// The workload's namespace (its shared claims live there).
    namespace: String,
    /// Assumed replicas' devices: `owned` then starts as their state.
    assumed: Option<AssumedDevices>,
}

fn claim_from(namespace: &str, name: &str, spec: ResourceClaimSpec) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            ..Default::default()
        },
        spec,
        status: None,
    }
}

impl<'a> DeviceQuery<'a> {
    /// `Ok(None)` when the workload needs no devices in this cluster; `Err` when it cannot
    /// be scheduled in this cluster at all (a shared claim is missing).
    ///
    /// With `assumed` (built under the same `overlay`), the query counts against the state
    /// of the assumed replicas and takes it (it is left in place when the query returns
    /// `Ok(None)` or `Err`); [`DeviceQuery::into_assumed`] gives it back.
    pub(crate) fn prepare(
        c: &'a ClusterView,
        w: &Workload,
        overlay: Option<&Overlay>,
        cache: Option<&'a mut DeviceCache>,
        assumed: &mut Option<AssumedDevices>,
    ) -> Result<Option<DeviceQuery<'a>>, String> {
        let devices = &c.devices;
        let mut dra_extended = Vec::new();
        let ext_enabled = Options::for_version(devices.version)
            .effective_features()
            .extended_resource;
        for (name, amount) in w.requests.iter() {
            if let ResName::Other(s) = name
                && ext_enabled
                && is_extended_resource(s)
                && let Some(class) = devices.inventory.extended_resource_class(s)
            {
                dra_extended.push((name.clone(), class.to_string(), amount));
            }
        }
        let mut shared_selectors = Vec::new();
        let mut pending_shared = Vec::new();
        for claim in &w.shared_claims {
            let key = (w.namespace.clone(), claim.clone());
            let removed = overlay.is_some_and(|o| o.removed_claims.contains(&key));
            if let Some(held) = assumed.as_ref().and_then(|a| a.claims.get(&key)) {
                // An assumed replica allocated it: allocated from now on.
                if devices.claim(&key.0, &key.1).is_some() {
                    shared_selectors.extend(held.iter().cloned());
                    continue;
                }
            }
            match devices.claim(&key.0, &key.1) {
                None => {
                    return Err(format!(
                        "ResourceClaim {}/{claim} not found in cluster {}",
                        w.namespace, c.name
                    ));
                }
                Some(m) => match (&m.allocation, &m.unallocated) {
                    (Some(_), _) if !removed => {
                        if let Some(sel) = &m.node_selector {
                            shared_selectors.push(sel.clone());
                        }
                        if let Some(n) = &m.pinned_node {
                            shared_selectors.push(dramesh_model::k8s::NodeSelector {
                                node_selector_terms: vec![dramesh_model::k8s::NodeSelectorTerm {
                                    match_fields: Some(vec![
                                        dramesh_model::k8s::NodeSelectorRequirement {
                                            key: "metadata.name".into(),
                                            operator: "In".into(),
                                            values: Some(vec![n.to_string()]),
                                        },
                                    ]),
                                    ..Default::default()
                                }],
                            });
                        }
                    }
                    (_, Some(full)) => pending_shared.push(full.clone()),
                    _ => {}
                },
            }
        }
        if w.templates.is_empty()
            && dra_extended.is_empty()
            && pending_shared.is_empty()
            && shared_selectors.is_empty()
        {
            return Ok(None);
        }
        if let Some(e) = &devices.version_error {
            return Err(format!("cluster {}: {e}", c.name));
        }
        let mut template_claims = Vec::new();
        for t in &w.templates {
            template_claims.push(claim_from(
                &w.namespace,
                &format!("{}-{}", w.name, t.pod_claim),
                t.template.spec.spec.clone(),
            ));
        }
        let mut to_release: Vec<&'a [CompactResult]> = Vec::new();
        let mut overlay_nodes = FastSet::default();
        let mut overlay_released: PoolReleased = FastMap::default();
        let mut shared_released = false;
        if let Some(o) = overlay {
            for key in &o.removed_claims {
                if let Some(m) = devices.claim(&key.0, &key.1)
                    && let Some(a) = &m.allocation
                {
                    to_release.push(&**a);
                    for r in a.iter() {
                        let pool = (r.driver.clone(), r.pool.clone());
                        match devices.pool_node.get(&pool) {
                            Some(n) => {
                                overlay_nodes.insert(n.clone());
                                let e = overlay_released.entry(pool).or_default();
                                *e = e.wrapping_add(r.marker);
                            }
                            None => shared_released = true,
                        }
                    }
                }
            }
        }
        let mut fp = DefaultHasher::new();
        w.fingerprint.hash(&mut fp);
        dra_extended.hash(&mut fp);
        let fingerprint = fp.finish();
        let shape_ok = devices.shared_slices == 0 && devices.taint_rules == 0;
        // Removing claims that used shared devices changes what every node sees, and so do
        // assumed replicas holding shared devices.
        let mut assumed = assumed.take();
        let dirty = shared_released || assumed.as_ref().is_some_and(|a| a.shared);
        let mut owned = None;
        if let Some(a) = &mut assumed {
            // The overlay is already given back in the assumed state.
            to_release.clear();
            owned = Some(std::mem::take(&mut a.state));
        }
        let use_scratch = cache.is_some() && to_release.is_empty() && assumed.is_none();
        let mut cache = cache;
        if use_scratch
            && let Some(c) = cache.as_deref_mut()
            && c.scratch_dirty
        {
            // A previous query left shared allocations in the copy: start from the view.
            c.scratch = None;
            c.scratch_dirty = false;
        }
        Ok(Some(DeviceQuery {
            devices,
            owned,
            use_scratch,
            opts: Options::for_version(devices.version),
            template_claims,
            dra_extended,
            shared_selectors,
            pending_shared,
            fingerprint,
            dirty,
            overlay_nodes,
            overlay_released,
            to_release,
            per_node_release: false,
            node_release: Vec::new(),
            cache,
            shape_ok,
            namespace: w.namespace.clone(),
            assumed,
        }))
    }

    /// True once a replica consumed a shared device or a shared claim is still pending:
    /// node answers of this query then depend on node order.
    pub(crate) fn order_dependent(&self) -> bool {
        self.dirty || !self.pending_shared.is_empty()
    }

    /// False when an allocated shared claim's node selector excludes this node.
    pub(crate) fn node_allowed(&self, node: &NodeEntry) -> bool {
        if self.shared_selectors.is_empty() {
            return true;
        }
        let info = NodeInfo {
            name: node.name.to_string(),
            labels: node.labels.clone(),
        };
        self.shared_selectors
            .iter()
            .all(|s| dramesh_engine::node_selector_matches(s, &info).unwrap_or(false))
    }

    /// The DRA-backed extended resources this node does not advertise itself.
    fn ext_on_node(&self, node: &NodeEntry) -> Vec<&(ResName, String, i64)> {
        self.dra_extended
            .iter()
            .filter(|(n, _, _)| node.allocatable.get(n) <= 0)
            .collect()
    }

    /// True when `r` is an extended resource this node does not advertise and a
    /// DeviceClass maps: on this node it is satisfied by devices, not node allocatable.
    pub(crate) fn served_by_devices(&self, node: &NodeEntry, r: &ResName) -> bool {
        self.dra_extended
            .iter()
            .any(|(n, _, _)| n == r && node.allocatable.get(n) <= 0)
    }

    /// The claim that asks devices for the DRA-backed extended resources of one replica on
    /// this node, if any.
    fn ext_claim(&self, node: &NodeEntry) -> Option<ResourceClaim> {
        let ext = self.ext_on_node(node);
        (!ext.is_empty()).then(|| {
            let requests = ext
                .iter()
                .enumerate()
                .map(|(i, (_, class, count))| DeviceRequest {
                    name: format!("extended-resource-{i}"),
                    exactly: Some(ExactDeviceRequest {
                        device_class_name: class.clone(),
                        count: Some(*count),
                        allocation_mode: Some("ExactCount".into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect();
            claim_from(
                "default",
                "extended-resources",
                ResourceClaimSpec {
                    devices: Some(DeviceClaim {
                        requests: Some(requests),
                        ..Default::default()
                    }),
                },
            )
        })
    }

    /// How many replicas (at most `cap`) each get their own devices on this node.
    pub(crate) fn fit(&mut self, node: &NodeEntry, cap: i64) -> Result<i64, String> {
        let ext_claim = self.ext_claim(node);
        // Nodes holding devices of assumed replicas differ from the view the caches describe.
        if self
            .assumed
            .as_ref()
            .is_some_and(|a| a.nodes.contains(&node.name))
        {
            return self.fit_uncached(node, cap, ext_claim.as_ref());
        }
        let variant = u64::from(ext_claim.is_some());
        let key_fp = self.fingerprint ^ variant.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let cacheable = !self.dirty && self.pending_shared.is_empty();
        let per_node = self.per_node_release;
        let in_overlay = if per_node {
            !self.node_release.is_empty()
        } else {
            self.overlay_nodes.contains(&node.name)
        };
        // `devices` is not changed by this query, so the generation can be read when needed
        // (a same-shape hit never needs it).
        let node_gen = || self.devices.node_gen.get(&node.name).copied().unwrap_or(0);
        let shared_gen = self.devices.shared_gen;
        let mut shape_key = None;
        if cacheable && let Some(cache) = self.cache.as_deref_mut() {
            if self.shape_ok {
                // Same-shape answers cover every node; the shape is cheap to hash, so it is
                // recomputed rather than looked up.
                let shape = match (per_node, in_overlay) {
                    (true, true) => self.devices.shape_released(&node.name, &self.node_release),
                    (false, true) => self
                        .devices
                        .node_shape(&node.name, Some(&self.overlay_released)),
                    (_, false) => self.devices.node_shape(&node.name, None),
                };
                let k = (key_fp, shape, shared_gen);
                if let Some(&(cap_used, fit)) = cache.per_shape.get(&k)
                    && let Some(v) = reuse(cap_used, fit, cap)
                {
                    return Ok(v);
                }
                shape_key = Some(k);
            } else if !in_overlay
                && let Some(&(g, s, cap_used, fit)) =
                    cache.per_node.get(&(key_fp, node.name.clone()))
                && g == node_gen()
                && s == shared_gen
                && let Some(v) = reuse(cap_used, fit, cap)
            {
                return Ok(v);
            }
        }
        let fit = if per_node && in_overlay {
            let released = std::mem::take(&mut self.node_release);
            let fit = self.fit_released(node, cap, ext_claim.as_ref(), &released);
            self.node_release = released;
            fit?
        } else {
            self.fit_uncached(node, cap, ext_claim.as_ref())?
        };
        // An answer that consumed shared devices cannot be replayed from a cache: the
        // consumption is a side effect later nodes must see.
        if cacheable
            && !self.dirty
            && let Some(cache) = self.cache.as_deref_mut()
        {
            // Stale generations are never read again; bound memory by starting over.
            if cache.per_node.len() >= MAX_CACHE_ENTRIES {
                cache.per_node.clear();
            }
            if cache.per_shape.len() >= MAX_CACHE_ENTRIES {
                cache.per_shape.clear();
            }
            if !in_overlay {
                cache.per_node.insert(
                    (key_fp, node.name.clone()),
                    (node_gen(), shared_gen, cap, fit),
                );
            }
            if let Some(k) = shape_key {
                cache.per_shape.insert(k, (cap, fit));
            }
        }
        Ok(fit)
    }

    /// Switches to per-node what-ifs: from now on each [`DeviceQuery::fit`] answers for its
    /// node as if the allocations in [`DeviceQuery::node_release_mut`] were given back
    /// (instead of the overlay the query was prepared with). The caller fills that list
    /// before each node and guarantees every listed allocation uses only pools local to the
    /// node, so the answer is the one a whole-cluster release would give on that node.
    pub(crate) fn release_per_node(&mut self) {
        self.per_node_release = true;
    }

    pub(crate) fn node_release_mut(&mut self) -> &mut Vec<&'a [CompactResult]> {
        &mut self.node_release
    }

    /// [`Self::fit_uncached`] with some allocations given back around the call: the device
    /// state is left as it was found, since release and commit are exact inverses.
    fn fit_released(
        &mut self,
        node: &NodeEntry,
        cap: i64,
        ext_claim: Option<&ResourceClaim>,
        released: &[&[CompactResult]],
    ) -> Result<i64, String> {
        let devices = self.devices;
        let use_scratch = self.use_scratch;
        let expanded: Vec<AllocationResult> = released.iter().map(|a| expand(a)).collect();
        state_mut(&mut self.cache, &mut self.owned, devices, use_scratch).release(&expanded);
        let out = self.fit_uncached(node, cap, ext_claim);
        state_mut(&mut self.cache, &mut self.owned, devices, use_scratch).commit(&expanded);
        out
    }

    /// The naive path: replica by replica through the engine.
    pub(crate) fn fit_uncached(
        &mut self,
        node: &NodeEntry,
        cap: i64,
        ext_claim: Option<&ResourceClaim>,
    ) -> Result<i64, String> {
        self.allocate_replicas(node, cap, ext_claim, false)
    }

    /// Places up to `cap` replicas of an assumed workload on this node: each gets its own
    /// allocation, exactly as [`DeviceQuery::fit`] counts them, and the allocations stay in
    /// the query's device state (see [`DeviceQuery::into_assumed`]). Needs a query prepared
    /// with an [`AssumedDevices`].
    pub(crate) fn place(&mut self, node: &NodeEntry, cap: i64) -> Result<i64, String> {
        if self.assumed.is_none() {
            return Err("internal: assumed replicas placed without assumed device state".into());
        }
        let ext_claim = self.ext_claim(node);
        self.allocate_replicas(node, cap, ext_claim.as_ref(), true)
    }

    /// The device state with this query's placed replicas, for the next query; `None`
    /// when the query was not prepared with one.
    pub(crate) fn into_assumed(self) -> Option<AssumedDevices> {
        let mut a = self.assumed?;
        a.state = self.owned.unwrap_or_else(|| self.devices.allocated.clone());
        Some(a)
    }

    /// Replica after replica through the engine, at most `cap`. Allocations local to the
    /// node are rolled back afterwards unless `keep` (assumed replicas hold them).
    fn allocate_replicas(
        &mut self,
        node: &NodeEntry,
        cap: i64,
        ext_claim: Option<&ResourceClaim>,
        keep: bool,
    ) -> Result<i64, String> {
        let devices = self.devices;
        if !self.to_release.is_empty() {
            let release = std::mem::take(&mut self.to_release);
            let st = state_mut(&mut self.cache, &mut self.owned, devices, false);
            for a in release {
                st.release(std::slice::from_ref(&expand(a)));
            }
        }
        let use_scratch = self.use_scratch;
        let info = NodeInfo {
            name: node.name.to_string(),
            labels: node.labels.clone(),
        };
        let mut local: Vec<Vec<AllocationResult>> = Vec::new();
        let mut n = 0;
        let mut failure = None;
        while n < cap {
            let pending: Vec<Arc<ResourceClaim>> = std::mem::take(&mut self.pending_shared);
            let mut claims: Vec<&ResourceClaim> = pending.iter().map(|c| &**c).collect();
            claims.extend(self.template_claims.iter());
            if let Some(e) = ext_claim {
                claims.push(e);
            }
            if claims.is_empty() {
                n = cap;
                break;
            }
            let st = state_mut(&mut self.cache, &mut self.owned, devices, use_scratch);
            match dramesh_engine::allocate(&devices.inventory, st, &info, &claims, &self.opts) {
                Outcome::Allocated(results) => {
                    let (shared_part, rest) = results.split_at(pending.len().min(results.len()));
                    let is_local = |a: &AllocationResult| {
                        a.devices
                            .iter()
                            .flat_map(|d| d.results.iter().flatten())
                            .all(|r| {
                                devices
                                    .pool_node_named(&r.driver, &r.pool)
                                    .is_some_and(|p| **p == *node.name)
                            })
                    };
                    for (a, claim) in shared_part.iter().zip(&pending) {
                        st.commit(std::slice::from_ref(a));
                        if let Some(sel) = &a.node_selector {
                            self.shared_selectors.push(sel.clone());
                        }
                        self.dirty = true;
                        if keep && let Some(held) = self.assumed.as_mut() {
                            held.hold(node, is_local(a));
                            held.claims.insert(
                                (
                                    self.namespace.clone(),
                                    claim.metadata.name.clone().unwrap_or_default(),
                                ),
                                a.node_selector.clone(),
                            );
                        }
                    }
                    let rest = rest.to_vec();
                    st.commit(&rest);
                    let local_only = rest.iter().all(is_local);
                    if keep {
                        if let Some(held) = self.assumed.as_mut() {
                            held.hold(node, local_only);
                        }
                        if !local_only {
                            self.dirty = true;
                        }
                    } else if local_only {
                        local.push(rest);
                    } else {
                        self.dirty = true;
                    }
                    n += 1;
                }
                Outcome::Unsatisfiable { .. } | Outcome::BudgetExhausted { .. } => {
                    self.pending_shared = pending;
                    break;
                }
                Outcome::Error(e) => {
                    self.pending_shared = pending;
                    failure = Some(format!("device allocation fails the workload: {e}"));
                    break;
                }
            }
        }
        let st = state_mut(&mut self.cache, &mut self.owned, devices, use_scratch);
        for a in local.iter().rev() {
            st.release(a);
        }
        if self.dirty
            && use_scratch
            && let Some(c) = self.cache.as_deref_mut()
        {
            c.scratch_dirty = true;
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }
}

/// The device state a query may change: the cache's scratch copy (refreshed when stale) or
/// a private copy.
fn state_mut<'s>(
    cache: &'s mut Option<&mut DeviceCache>,
    owned: &'s mut Option<AllocatedState>,
    devices: &ClusterDevices,
    use_scratch: bool,
) -> &'s mut AllocatedState {
    if use_scratch && let Some(c) = cache.as_deref_mut() {
        let fresh = matches!(&c.scratch, Some((g, _)) if *g == devices.counter);
        if !fresh {
            c.scratch = Some((devices.counter, devices.allocated.clone()));
        }
        if let Some((_, s)) = &mut c.scratch {
            return s;
        }
    }
    owned.get_or_insert_with(|| devices.allocated.clone())
}

#[cfg(test)]
mod tests {
    use super::{ClaimHandle, ClusterDevices, reuse};
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

    #[test]
    fn reuse_rules() {
        // Stopped short of its cap: exact for any cap.
        assert_eq!(reuse(10, 3, 100), Some(3));
        assert_eq!(reuse(10, 3, 2), Some(2));
        // Hit its cap: only valid for caps not above it.
        assert_eq!(reuse(10, 10, 5), Some(5));
        assert_eq!(reuse(10, 10, 11), None);
    }
}
