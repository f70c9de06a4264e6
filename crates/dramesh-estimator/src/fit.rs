//! The per-query device fit: how many replicas of a workload each get their own devices on
//! a node, the only place the estimator calls the allocation engine (`dramesh-engine`), and
//! the caches that make repeated questions cheap.
//!
//! Estimation semantics ([`DeviceQuery::fit`]): on a node, replica after replica gets its
//! own fresh allocation of the pod's template claims from the engine, against the state
//! that already includes the earlier replicas (on any node); the count stops at the first
//! replica that does not fit. Allocations that only use devices local to the node are rolled
//! back after the node is counted (they cannot affect another node); allocations that use
//! shared devices stay, so later nodes see them.
//!
//! A count can stop because the engine's search budget ran out on the next replica
//! ([`Outcome::BudgetExhausted`]): that [`Fit`] is marked `gave_up`, its count is a lower
//! bound, and it is never turned into a "does not fit". Caches keep the mark with the count,
//! so a cached give-up stays a give-up (the engine is deterministic: asking again with the
//! same budget gives up again).
//!
//! Caching never changes results: a node's answer is reused only when its device generation
//! and the cluster's shared generation are unchanged and no replica of the current query
//! has consumed a shared device yet. Nodes whose local slices and local allocations are
//! identical up to node and pool names ("same shape", see [`crate::cluster_devices`]) share
//! one answer when the cluster has no node-less slices and no taint rules, since then
//! nothing else can influence a node's allocation.
//!
//! Assumed (in-flight) replicas with claims are allocated by the same replica-by-replica
//! count (`DeviceQuery::place`) but keep their allocations, in an `AssumedDevices` state
//! the estimate's query then starts from. Node answers of nodes holding assumed allocations
//! bypass the caches; once an assumed replica holds a device that is not local to its node,
//! the whole query does.

use std::borrow::Cow;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use dramesh_engine::{AllocatedState, NodeInfo, Options, Outcome};
use dramesh_model::k8s::{
    AllocationResult, DeviceClaim, DeviceRequest, ExactDeviceRequest, ObjectMeta, ResourceClaim,
    ResourceClaimSpec,
};
use dramesh_model::nodesel;

use crate::cluster_devices::{ClusterDevices, CompactResult, PoolReleased, expand};
use crate::hash::{FastMap, FastSet};
use crate::overlay::Overlay;
use crate::resources::{ResName, is_extended_resource};
use crate::view::{ClusterView, NodeEntry};
use crate::workload::Workload;

/// Upper bound of entries per cache map before it is cleared.
const MAX_CACHE_ENTRIES: usize = 1 << 20;

/// A cached node answer: (node generation, shared generation, cap used, fit).
type NodeAnswer = (u64, u64, i64, Fit);

/// How many replicas got devices on a node, and whether the count is only a lower bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fit {
    /// Replicas that each got their own allocation.
    pub(crate) replicas: i64,
    /// The next replica's allocation search ran out of budget: whether it fits is unknown,
    /// so `replicas` is a lower bound (never a proof that no more fit).
    pub(crate) gave_up: bool,
}

impl Fit {
    fn exact(replicas: i64) -> Fit {
        Fit {
            replicas,
            gave_up: false,
        }
    }
}

/// Per-node device answers kept between estimates of one cluster. Its answers are bounded
/// by bytes together with the estimator's memos ([`DeviceCache::answer_bytes`],
/// [`DeviceCache::clear_answers`]).
#[derive(Debug, Default)]
pub(crate) struct DeviceCache {
    /// (query fingerprint, node) -> (node generation, shared generation, cap, fit).
    per_node: FastMap<(u64, Arc<str>), NodeAnswer>,
    /// (query fingerprint, shape, shared generation) -> (cap, fit).
    per_shape: FastMap<(u64, u64, u64), (i64, Fit)>,
    /// A copy of the cluster's device state as of a device change counter, reused by
    /// queries so a cache miss does not copy the whole state. Local allocations made by a
    /// query are rolled back; `scratch_dirty` marks a copy a query changed for good.
    scratch: Option<(u64, AllocatedState)>,
    scratch_dirty: bool,
}

impl DeviceCache {
    /// Heap bytes of the cached answers: table slots (entry plus control byte) at capacity.
    /// Node names are shared `Arc`s owned by the view.
    pub(crate) fn answer_bytes(&self) -> usize {
        self.per_node.capacity() * (size_of::<((u64, Arc<str>), NodeAnswer)>() + 1)
            + self.per_shape.capacity() * (size_of::<((u64, u64, u64), (i64, Fit))>() + 1)
    }

    /// Drops the cached answers (not the scratch copy of the device state) and their memory.
    pub(crate) fn clear_answers(&mut self) {
        self.per_node = FastMap::default();
        self.per_shape = FastMap::default();
    }
}

/// A reused answer computed with cap `cap_used` holds for `cap` when it stopped short of
/// its cap, or when the new cap is not larger. A give-up stays a give-up unless the new cap
/// stops before the replica whose search gave up.
fn reuse(cap_used: i64, fit: Fit, cap: i64) -> Option<Fit> {
    if fit.replicas < cap_used || cap <= cap_used {
        Some(if cap <= fit.replicas {
            Fit::exact(cap)
        } else {
            fit
        })
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
    /// Nodes whose local pools hold devices of assumed replicas, with how many replicas.
    nodes: FastMap<Arc<str>, i64>,
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
            nodes: FastMap::default(),
            shared: false,
            claims: FastMap::default(),
        }
    }

    /// True once any assumed replica holds a device.
    pub(crate) fn holds_devices(&self) -> bool {
        self.shared || !self.nodes.is_empty() || !self.claims.is_empty()
    }

    /// True once an assumed replica holds a device not local to its node.
    pub(crate) fn holds_shared(&self) -> bool {
        self.shared
    }

    /// Gives back allocations of assumed replicas (undoing a deduction whose devices are all
    /// local to their nodes); [`AssumedDevices::unhold`] then says how many left each node.
    pub(crate) fn release(&mut self, allocations: &[AllocationResult]) {
        self.state.release(allocations);
    }

    /// `replicas` assumed replicas on `node` hold its devices no longer: once none does, the
    /// caches answer for the node again.
    pub(crate) fn unhold(&mut self, node: &str, replicas: i64) {
        if let Some(n) = self.nodes.get_mut(node) {
            *n -= replicas;
            if *n <= 0 {
                self.nodes.remove(node);
            }
        }
    }

    fn hold(&mut self, node: &NodeEntry, local: bool) {
        if local {
            *self.nodes.entry(node.name.clone()).or_default() += 1;
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
    /// The allocations [`DeviceQuery::place`] committed for good, and whether one of them
    /// allocated a shared claim ([`DeviceQuery::take_placed`]).
    placed: (Vec<AllocationResult>, bool),
}

impl ClusterView {
    /// `w` as it is estimated in this cluster: its [`Workload::claim_refs`] resolved against
    /// the cluster's ResourceClaimTemplates by the rule of [`Workload::in_cluster`]. An error
    /// names the template the cluster lacks. (Here rather than in `view`, which the
    /// workload's layer is below.)
    pub fn workload<'w>(&self, w: &'w Workload) -> Result<Cow<'w, Workload>, String> {
        let resolved = w.in_cluster(&self.name, !self.claim_templates.is_empty(), |ns, name| {
            self.claim_templates
                .get(&(ns.to_string(), name.to_string()))
                .cloned()
        })?;
        Ok(match resolved {
            Some(r) => Cow::Owned(r),
            None => Cow::Borrowed(w),
        })
    }
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
    ///
    /// `max_steps` overrides the engine's search budget per allocation (see
    /// `EstimateOptions::max_allocation_steps`); it is part of the cache key.
    pub(crate) fn prepare(
        c: &'a ClusterView,
        w: &Workload,
        overlay: Option<&Overlay>,
        cache: Option<&'a mut DeviceCache>,
        assumed: &mut Option<AssumedDevices>,
        max_steps: Option<u64>,
    ) -> Result<Option<DeviceQuery<'a>>, String> {
        // A no-op for a workload already resolved in `c` (every caller but assumed
        // workloads' deductions resolves first).
        let w = c.workload(w)?;
        let w = &*w;
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
        max_steps.hash(&mut fp);
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
        let mut opts = Options::for_version(devices.version);
        if let Some(steps) = max_steps {
            opts.max_steps = steps;
        }
        Ok(Some(DeviceQuery {
            devices,
            owned,
            use_scratch,
            opts,
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
            placed: (Vec::new(), false),
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
        let node = nodesel::NodeRef {
            name: &node.name,
            labels: &node.labels,
        };
        // The scheduler fails a pod whose allocated claim has a malformed selector.
        self.shared_selectors
            .iter()
            .all(|s| nodesel::matches(s, node).unwrap_or(false))
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
    pub(crate) fn fit(&mut self, node: &NodeEntry, cap: i64) -> Result<Fit, String> {
        let ext_claim = self.ext_claim(node);
        // Nodes holding devices of assumed replicas differ from the view the caches describe.
        if self
            .assumed
            .as_ref()
            .is_some_and(|a| a.nodes.contains_key(&node.name))
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
    ) -> Result<Fit, String> {
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
    ) -> Result<Fit, String> {
        self.allocate_replicas(node, cap, ext_claim, false)
    }

    /// Places up to `cap` replicas of an assumed workload on this node: each gets its own
    /// allocation, exactly as [`DeviceQuery::fit`] counts them, and the allocations stay in
    /// the query's device state (see [`DeviceQuery::into_assumed`]). Needs a query prepared
    /// with an [`AssumedDevices`].
    pub(crate) fn place(&mut self, node: &NodeEntry, cap: i64) -> Result<Fit, String> {
        if self.assumed.is_none() {
            return Err("internal: assumed replicas placed without assumed device state".into());
        }
        let ext_claim = self.ext_claim(node);
        self.allocate_replicas(node, cap, ext_claim.as_ref(), true)
    }

    /// The allocations placed replicas hold since the last call, and whether one of them
    /// allocated a shared claim (which releasing them would not give back: the assumed
    /// state remembers the claim as allocated).
    pub(crate) fn take_placed(&mut self) -> (Vec<AllocationResult>, bool) {
        std::mem::take(&mut self.placed)
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
    ) -> Result<Fit, String> {
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
        let mut gave_up = false;
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
                    if keep {
                        self.placed.0.extend(results.iter().cloned());
                        self.placed.1 |= !shared_part.is_empty();
                    }
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
                Outcome::Unsatisfiable { .. } => {
                    self.pending_shared = pending;
                    break;
                }
                Outcome::BudgetExhausted { .. } => {
                    self.pending_shared = pending;
                    gave_up = true;
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
            None => Ok(Fit {
                replicas: n,
                gave_up,
            }),
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
        let fresh = matches!(&c.scratch, Some((g, _)) if *g == devices.counter());
        if !fresh {
            c.scratch = Some((devices.counter(), devices.allocated.clone()));
        }
        if let Some((_, s)) = &mut c.scratch {
            return s;
        }
    }
    owned.get_or_insert_with(|| devices.allocated.clone())
}

#[cfg(test)]
mod tests {
    use super::{Fit, reuse};

    #[test]
    fn reuse_rules() {
        let exact = Fit::exact;
        // Stopped short of its cap: exact for any cap.
        assert_eq!(reuse(10, exact(3), 100), Some(exact(3)));
        assert_eq!(reuse(10, exact(3), 2), Some(exact(2)));
        // Hit its cap: only valid for caps not above it.
        assert_eq!(reuse(10, exact(10), 5), Some(exact(5)));
        assert_eq!(reuse(10, exact(10), 11), None);
        // Gave up at the 4th replica: still a give-up for any cap that reaches it, exact
        // for a cap that stops before it.
        let gave_up = Fit {
            replicas: 3,
            gave_up: true,
        };
        assert_eq!(reuse(10, gave_up, 100), Some(gave_up));
        assert_eq!(reuse(10, gave_up, 4), Some(gave_up));
        assert_eq!(reuse(10, gave_up, 3), Some(exact(3)));
    }
}
