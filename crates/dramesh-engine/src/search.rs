//! One allocation attempt: a pod's unallocated claims on one node.
//!
//! This reimplements Kubernetes' structured allocator (the "incubating" variant that runs
//! with 1.36 default gates): gather the pools visible from the node, validate every request
//! and subrequest, then a first-fit depth-first search with backtracking over devices in
//! pool -> slice -> device order. Devices of one request are tried as combinations (each
//! further device after the previous one), requests and claims restart at the first device.
//! The recursion mirrors Kubernetes' `allocateOne`, so the step counter equals its
//! `NumAllocateOneInvocations` statistic.
//!
//! Deliberate differences from the Go code, all in rarely reached backtracking paths: a
//! device whose taints or capacity reject it after its counters were tentatively charged
//! gets them back, and counters of multi-allocatable devices are released on backtrack
//! (the Go code leaks both within one attempt).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use dramesh_model::k8s;
use dramesh_model::{QualifiedName, Quantity};

use crate::capacity;
use crate::celx;
use crate::error::{AllocError, AllocErrorKind as Kind};
use crate::inventory::{Attr, Class, CounterSet, Device, Inventory, Slice, Taint};
use crate::state::{AllocatedState, DevUse};
use crate::{Features, KubeVersion, Options, Outcome};
use dramesh_model::nodesel::{NodeInfo, node_matches};
use dramesh_model::taint;

mod prune;

/// Kubernetes' `AllocationResultsMaxSize`.
pub const MAX_DEVICES_PER_CLAIM: usize = 32;

/// Why the search stopped early.
enum Stop {
    /// The 32-device limit would be exceeded (backtrack more aggressively).
    MaxSize,
    /// Fails the pod.
    Fatal(AllocError),
    Budget,
}

struct GPool<'a> {
    driver: &'a str,
    name: &'a str,
    incomplete: bool,
    invalid: Option<String>,
    /// Device slices visible from the node, sorted by name.
    device_slices: Vec<&'a Slice>,
    /// Device slices of the pool for other nodes (only for counter accounting).
    other_slices: Vec<&'a Slice>,
    counter_sets: Vec<&'a CounterSet>,
    has_binding_conditions: bool,
}

struct FlatDev<'a> {
    pool: usize,
    slice: &'a Slice,
    dev: &'a Device,
    /// Pool devices may be picked by ExactCount requests.
    pickable: bool,
    used: Option<&'a DevUse>,
    rule_taints: Vec<&'a Taint>,
}

struct Alt<'a> {
    /// Index into the memo table.
    gi: usize,
    base: &'a str,
    sub: Option<&'a str>,
    class: Arc<Class>,
    selectors: Vec<Result<celx::Selector, celx::CelError>>,
    all: bool,
    num_devices: usize,
    all_devices: Vec<usize>,
    admin: bool,
    tolerations: Option<&'a Vec<k8s::DeviceToleration>>,
    cap_requests: Vec<(String, Quantity)>,
}

impl Alt<'_> {
    /// Devices the alternative takes when it is allocated.
    fn takes(&self) -> usize {
        if self.all {
            self.all_devices.len()
        } else {
            self.num_devices
        }
    }

    fn full_name(&self) -> String {
        match self.sub {
            Some(s) => format!("{}/{s}", self.base),
            None => self.base.to_string(),
        }
    }
}

struct Req<'a> {
    alts: Vec<Alt<'a>>,
    has_sub: bool,
}

enum ConsKind<'a> {
    Match {
        reference: Option<&'a Attr>,
        n: usize,
        /// The device that set `reference`.
        ref_dev: usize,
    },
    Distinct {
        seen: Vec<&'a Attr>,
        /// The devices of `seen`, in the same order.
        seen_devs: Vec<usize>,
    },
}

struct Cons<'a> {
    requests: Vec<&'a str>,
    attr: &'a str,
    kind: ConsKind<'a>,
}

impl Cons<'_> {
    fn applies(&self, base: &str, sub: Option<&str>) -> bool {
        if self.requests.is_empty() {
            return true;
        }
        self.requests.iter().any(|r| {
            *r == base
                || sub.is_some_and(|s| {
                    r.len() == base.len() + 1 + s.len()
                        && r.starts_with(base)
                        && r.as_bytes()[base.len()] == b'/'
                        && r.ends_with(s)
                })
        })
    }
}

fn attr_equal_for_match(a: &Attr, b: &Attr) -> bool {
    use dramesh_model::AttrValue as V;
    match (&a.value, &b.value) {
        (Some(V::String(x)), Some(V::String(y))) => x == y,
        (Some(V::Int(x)), Some(V::Int(y))) => x == y,
        (Some(V::Bool(x)), Some(V::Bool(y))) => x == y,
        // Versions are in minimal semver form, so the published strings compare exactly.
        (Some(V::Version(_)), Some(V::Version(_))) => a.version_raw == b.version_raw,
        _ => false,
    }
}

struct Picked {
    dev: usize,
    c: usize,
    r: usize,
    s: usize,
    share_id: Option<String>,
    /// Consumption per device capacity (multi-allocatable devices only).
    consumed: Option<Vec<Quantity>>,
    counters_added: bool,
    multi: bool,
}

/// Counter amounts by (counter set, counter), in nano-units.
type Counters = HashMap<(Arc<str>, Arc<str>), i128>;

pub(crate) struct Run<'a> {
    inv: &'a Inventory,
    state: &'a AllocatedState,
    feats: Features,
    node: &'a NodeInfo,
    claims: &'a [&'a k8s::ResourceClaim],
    pools: Vec<GPool<'a>>,
    devs: Vec<FlatDev<'a>>,
    reqs: Vec<Vec<Req<'a>>>,
    cons: Vec<Vec<Cons<'a>>>,
    memo: Vec<Vec<u8>>,
    allocating: Vec<Vec<u32>>,
    alloc_cap: Vec<Option<(u32, HashMap<QualifiedName, i128>)>>,
    available: Vec<Option<Counters>>,
    consumed_counters: Vec<Counters>,
    results: Vec<Vec<Picked>>,
    selected: Vec<Vec<usize>>,
    steps: u64,
    max_steps: u64,
    deadline: Option<Instant>,
    prune: prune::Pruner,
}

fn claim_ref(c: &k8s::ResourceClaim) -> String {
    format!(
        "{}/{}",
        c.metadata.namespace.as_deref().unwrap_or_default(),
        c.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Runs one allocation; returns the outcome and the number of search steps.
pub(crate) fn run(
    inv: &Inventory,
    state: &AllocatedState,
    node: &NodeInfo,
    claims: &[&k8s::ResourceClaim],
    opts: &Options,
) -> (Outcome, u64) {
    let feats = opts.effective_features();
    let mut run = Run {
        inv,
        state,
        feats,
        node,
        claims,
        pools: Vec::new(),
        devs: Vec::new(),
        reqs: Vec::new(),
        cons: Vec::new(),
        memo: Vec::new(),
        allocating: Vec::new(),
        alloc_cap: Vec::new(),
        available: Vec::new(),
        consumed_counters: Vec::new(),
        results: (0..claims.len()).map(|_| Vec::new()).collect(),
        selected: Vec::new(),
        steps: 0,
        max_steps: opts.max_steps,
        deadline: opts.deadline.map(|d| Instant::now() + d),
        prune: prune::Pruner::new(opts.prune),
    };
    if let Err(e) = run.gather(opts.version) {
        return (Outcome::Error(e), 0);
    }
    if let Err(e) = run.prepare() {
        return (Outcome::Error(e), 0);
    }
    let res = run.one(0, 0, 0, 0, false, 0);
    let steps = run.steps;
    let outcome = match res {
        Ok(true) => match run.build_results() {
            Ok(r) => Outcome::Allocated(r),
            Err(e) => Outcome::Error(e),
        },
        Ok(false) => {
            if let Some(p) = run.pools.iter().find(|p| p.invalid.is_some()) {
                Outcome::Unsatisfiable {
                    reason: format!(
                        "invalid resource pools were encountered: pool {}/{}: {}",
                        p.driver,
                        p.name,
                        p.invalid.as_deref().unwrap_or_default()
                    ),
                }
            } else {
                Outcome::Unsatisfiable {
                    reason: format!(
                        "cannot allocate all claims on node {}: no suitable combination of devices",
                        node.name
                    ),
                }
            }
        }
        Err(Stop::Budget) => Outcome::BudgetExhausted { steps },
        Err(Stop::Fatal(e)) => Outcome::Error(e),
        Err(Stop::MaxSize) => Outcome::Error(AllocError::new(
            Kind::TooManyDevices,
            format!("allocation exceeds the limit of {MAX_DEVICES_PER_CLAIM} devices per claim"),
        )),
    };
    (outcome, steps)
}

impl<'a> Run<'a> {
    // ---------------------------------------------------------------- pool gathering

    fn gather(&mut self, version: KubeVersion) -> Result<(), AllocError> {
        let inv = self.inv;
        let separate_counters = version >= KubeVersion::V1_35;
        let mut pools: BTreeMap<(&'a str, &'a str), Vec<&'a Slice>> = BTreeMap::new();
        let on_node = inv.by_node.get(&self.node.name).into_iter().flatten();
        for name in on_node.chain(inv.nodeless.iter()) {
            let Some(slice) = inv.slices.get(name) else {
                continue;
            };
            let slice: &'a Slice = slice;
            if !self.feats.partitionable_devices
                && (slice.per_device_node_selection.is_some() || !slice.shared_counters.is_empty())
            {
                continue;
            }
            let relevant = if separate_counters && !slice.shared_counters.is_empty() {
                true
            } else if slice.node_name.is_some() || slice.all_nodes || slice.node_selector.is_some()
            {
                node_matches(
                    slice.node_name.as_deref(),
                    slice.all_nodes,
                    slice.node_selector.as_ref(),
                    self.node,
                )
                .map_err(|e| {
                    AllocError::new(Kind::NodeSelection, format!(
                        "gather pool information: failed to perform node selection for slice {}: {e}",
                        slice.name
                    ))
                })?
            } else if slice.per_device_node_selection == Some(true) {
                let mut any = false;
                for d in &slice.devices {
                    let m = node_matches(
                        d.node_name.as_deref(),
                        d.all_nodes,
                        d.node_selector.as_ref(),
                        self.node,
                    )
                    .map_err(|e| {
                        AllocError::new(Kind::NodeSelection, format!(
                            "gather pool information: failed to perform node selection for device {} in slice {}: {e}",
                            d.name, slice.name
                        ))
                    })?;
                    if m {
                        any = true;
                        break;
                    }
                }
                any
            } else {
                false
            };
            if !relevant {
                continue;
            }
            let list = pools.entry((&*slice.driver, &*slice.pool)).or_default();
            match list.first().map(|f| f.generation) {
                Some(g) if slice.generation < g => {}
                Some(g) if slice.generation > g => *list = vec![slice],
                _ => list.push(slice),
            }
        }

        let mut normal = Vec::new();
        let mut binding = Vec::new();
        for ((driver, name), mut slices) in pools {
            let generation = slices[0].generation;
            let count = slices[0].slice_count;
            let mut complete = slices.len() as i64 == count;
            let mut all_slices: Option<Vec<&'a Slice>> = None;
            if !complete {
                let mut obsolete = false;
                let mut same_gen = Vec::new();
                let names = inv
                    .pools
                    .get(&(Arc::from(driver), Arc::from(name)))
                    .into_iter()
                    .flatten();
                for sn in names {
                    let Some(s) = inv.slices.get(sn) else {
                        continue;
                    };
                    if s.generation > generation {
                        obsolete = true;
                        break;
                    }
                    if s.generation == generation {
                        same_gen.push(&**s);
                    }
                }
                if obsolete {
                    continue;
                }
                // Counting the pool's slices for other nodes came with 1.35 (PR #134466);
                // 1.34 judged completeness by the slices visible from this node only.
                if separate_counters {
                    complete = same_gen.len() as i64 == count;
                }
                all_slices = Some(same_gen);
            }
            slices.sort_by(|a, b| a.name.cmp(&b.name));
            let mut pool = GPool {
                driver,
                name,
                incomplete: !complete,
                invalid: None,
                device_slices: Vec::new(),
                other_slices: Vec::new(),
                counter_sets: Vec::new(),
                has_binding_conditions: false,
            };
            // Since 1.35 an incomplete pool is only remembered (so that mode All fails);
            // 1.34 still allocated ExactCount requests from it.
            if !complete && separate_counters {
                normal.push(pool);
                continue;
            }
            self.build_pool(&mut pool, &slices, all_slices.as_deref(), separate_counters);
            if pool.has_binding_conditions {
                binding.push(pool);
            } else {
                normal.push(pool);
            }
        }
        normal.extend(binding);
        self.pools = normal;

        // Flatten the iteration order once: pools, slices, devices.
        let rules: Vec<_> = if self.feats.device_taints {
            inv.taint_rules.values().collect()
        } else {
            Vec::new()
        };
        for (pi, pool) in self.pools.iter().enumerate() {
            if pool.invalid.is_some() {
                continue;
            }
            let pickable = !pool.incomplete;
            // One pool lookup, then one device lookup per device.
            let pool_uses = if self.state.is_empty() {
                None
            } else {
                self.state.pool_uses(pool.driver, pool.name)
            };
            for slice in &pool.device_slices {
                for dev in &slice.devices {
                    let used = pool_uses.and_then(|u| u.get(&*dev.name));
                    let rule_taints = rules
                        .iter()
                        .filter(|r| r.selects(pool.driver, pool.name, &dev.name))
                        .map(|r| &r.taint)
                        .collect();
                    self.devs.push(FlatDev {
                        pool: pi,
                        slice,
                        dev,
                        pickable: pickable || !separate_counters,
                        used,
                        rule_taints,
                    });
                }
            }
        }
        let n = self.devs.len();
        self.allocating = vec![Vec::new(); n];
        self.alloc_cap = vec![None; n];
        self.available = vec![None; self.pools.len()];
        self.consumed_counters = vec![Counters::new(); self.pools.len()];
        Ok(())
    }

    fn build_pool(
        &self,
        pool: &mut GPool<'a>,
        slices: &[&'a Slice],
        all_slices: Option<&[&'a Slice]>,
        separate_counters: bool,
    ) {
        let part = self.feats.partitionable_devices;
        let mut counter_slices = Vec::new();
        for s in slices {
            if part && separate_counters && !s.shared_counters.is_empty() {
                counter_slices.push(*s);
            } else {
                pool.device_slices.push(*s);
                if part && !s.shared_counters.is_empty() {
                    counter_slices.push(*s);
                }
            }
        }
        // The first device whose name an earlier device already has is reported. Pools are
        // usually small, where comparing with the earlier names beats hashing each name.
        const LINEAR_MAX: usize = 32;
        let mut seen: Vec<&str> = Vec::new();
        let mut names = std::collections::HashSet::new();
        for s in &pool.device_slices {
            for d in &s.devices {
                let name: &str = &d.name;
                let repeated = if names.is_empty() && seen.len() < LINEAR_MAX {
                    let r = seen.contains(&name);
                    seen.push(name);
                    r
                } else {
                    if names.is_empty() {
                        names.extend(seen.iter().copied());
                    }
                    !names.insert(name)
                };
                if repeated {
                    pool.invalid = Some(format!("duplicate device name {}", d.name));
                    return;
                }
            }
        }
        // Kubernetes moves such pools to the end whether or not the gate is on.
        pool.has_binding_conditions = pool
            .device_slices
            .iter()
            .any(|s| s.devices.iter().any(|d| d.binding_conditions.is_some()));
        if !part {
            return;
        }
        for s in &counter_slices {
            for cs in &s.shared_counters {
                if pool.counter_sets.iter().any(|x| x.name == cs.name) {
                    pool.invalid = Some(format!("duplicate counter set name {}", cs.name));
                    return;
                }
                pool.counter_sets.push(cs);
            }
        }
        if let Err(e) = validate_consumption(&pool.counter_sets, slices) {
            pool.invalid = Some(e);
            return;
        }
        if let Some(all) = all_slices
            && all.len() != slices.len()
        {
            let others: Vec<&'a Slice> = all
                .iter()
                .filter(|s| !slices.iter().any(|t| t.name == s.name))
                .copied()
                .collect();
            if let Err(e) = validate_consumption(&pool.counter_sets, &others) {
                pool.invalid = Some(e);
                return;
            }
            pool.other_slices = others;
        }
    }

    // ---------------------------------------------------------------- request preparation

    fn prepare(&mut self) -> Result<(), AllocError> {
        let claims: &'a [&'a k8s::ResourceClaim] = self.claims;
        for claim in claims {
            let claim: &'a k8s::ResourceClaim = claim;
            let cref = claim_ref(claim);
            let mut min_devices = 0usize;
            let mut reqs = Vec::new();
            for request in claim
                .spec
                .devices
                .iter()
                .flat_map(|d| d.requests.iter().flatten())
            {
                let subs = request.first_available.as_deref().unwrap_or_default();
                let has_sub = !subs.is_empty();
                if has_sub && !self.feats.prioritized_list {
                    return Err(AllocError::new(
                        Kind::FeatureDisabled,
                        format!(
                            "claim {cref}, request {}: has subrequests, but the DRAPrioritizedList feature is disabled",
                            request.name
                        ),
                    ));
                }
                if !self.feats.consumable_capacity {
                    if request
                        .exactly
                        .as_ref()
                        .is_some_and(|e| e.capacity.is_some())
                    {
                        return Err(AllocError::new(
                            Kind::FeatureDisabled,
                            format!(
                                "claim {cref}, request {}: has capacity requests, but the DRAConsumableCapacity feature is disabled",
                                request.name
                            ),
                        ));
                    }
                    if let Some(s) = subs.iter().find(|s| s.capacity.is_some()) {
                        return Err(AllocError::new(
                            Kind::FeatureDisabled,
                            format!(
                                "claim {cref}, subrequest {}: has capacity requests, but the DRAConsumableCapacity feature is disabled",
                                s.name
                            ),
                        ));
                    }
                }
                let mut alts = Vec::new();
                if has_sub {
                    let mut min = usize::MAX;
                    for sub in subs {
                        let alt = self.prepare_alt(
                            &cref,
                            AltSource {
                                base: &request.name,
                                sub: Some(&sub.name),
                                class: &sub.device_class_name,
                                selectors: sub.selectors.as_deref().unwrap_or_default(),
                                mode: sub.allocation_mode.as_deref(),
                                count: sub.count,
                                admin: None,
                                tolerations: sub.tolerations.as_ref(),
                                capacity: sub.capacity.as_ref(),
                            },
                        )?;
                        min = min.min(alt.num_devices);
                        alts.push(alt);
                    }
                    min_devices = min_devices.saturating_add(min);
                } else {
                    let Some(ex) = &request.exactly else {
                        return Err(AllocError::new(
                            Kind::UnsupportedClaim,
                            format!(
                                "claim {cref}, request {}: neither exactly nor firstAvailable is set (unsupported request type?)",
                                request.name
                            ),
                        ));
                    };
                    let alt = self.prepare_alt(
                        &cref,
                        AltSource {
                            base: &request.name,
                            sub: None,
                            class: &ex.device_class_name,
                            selectors: ex.selectors.as_deref().unwrap_or_default(),
                            mode: ex.allocation_mode.as_deref(),
                            count: ex.count,
                            admin: ex.admin_access,
                            tolerations: ex.tolerations.as_ref(),
                            capacity: ex.capacity.as_ref(),
                        },
                    )?;
                    min_devices = min_devices.saturating_add(alt.num_devices);
                    alts.push(alt);
                }
                reqs.push(Req { alts, has_sub });
            }
            if min_devices > MAX_DEVICES_PER_CLAIM {
                return Err(AllocError::new(
                    Kind::TooManyDevices,
                    format!(
                        "claim {cref}: number of requested devices {min_devices} exceeds the claim limit of {MAX_DEVICES_PER_CLAIM}"
                    ),
                ));
            }
            let mut cons = Vec::new();
            for (i, c) in claim
                .spec
                .devices
                .iter()
                .flat_map(|d| d.constraints.iter().flatten())
                .enumerate()
            {
                let requests = c.requests.iter().flatten().map(String::as_str).collect();
                let (attr, kind) = match (&c.match_attribute, &c.distinct_attribute) {
                    (Some(a), _) => (
                        a.as_str(),
                        ConsKind::Match {
                            reference: None,
                            n: 0,
                            ref_dev: 0,
                        },
                    ),
                    (None, Some(a)) => (
                        a.as_str(),
                        ConsKind::Distinct {
                            seen: Vec::new(),
                            seen_devs: Vec::new(),
                        },
                    ),
                    (None, None) => {
                        return Err(AllocError::new(
                            Kind::UnsupportedClaim,
                            format!(
                                "claim {cref}, constraint #{i}: empty constraint (unsupported constraint type?)"
                            ),
                        ));
                    }
                };
                cons.push(Cons {
                    requests,
                    attr,
                    kind,
                });
            }
            self.selected.push(vec![0; reqs.len()]);
            self.reqs.push(reqs);
            self.cons.push(cons);
        }
        Ok(())
    }

    fn prepare_alt(&mut self, cref: &str, src: AltSource<'a>) -> Result<Alt<'a>, AllocError> {
        let display = match src.sub {
            Some(s) => s.to_string(),
            None => src.base.to_string(),
        };
        let mut selectors = Vec::new();
        for (i, s) in src.selectors.iter().enumerate() {
            match &s.cel {
                Some(c) => selectors.push(self.inv.compile_cached(&c.expression)),
                None => {
                    return Err(AllocError::new(
                        Kind::UnsupportedClaim,
                        format!(
                            "claim {cref}, request {display}, selector #{i}: CEL expression empty (unsupported selector type?)"
                        ),
                    ));
                }
            }
        }
        if src.admin.is_some() && !self.feats.admin_access {
            return Err(AllocError::new(
                Kind::FeatureDisabled,
                format!(
                    "claim {cref}, request {display}: admin access is requested, but the feature is disabled"
                ),
            ));
        }
        if src.class.is_empty() {
            return Err(AllocError::new(
                Kind::UnsupportedClaim,
                format!(
                    "claim {cref}, request {display}: missing device class name (unsupported request type?)"
                ),
            ));
        }
        let Some(class) = self.inv.classes.get(src.class).cloned() else {
            return Err(AllocError::new(
                Kind::UnknownClass,
                format!(
                    "claim {cref}, request {display}: could not retrieve device class {}: deviceclass.resource.k8s.io \"{}\" not found",
                    src.class, src.class
                ),
            ));
        };
        let mut cap_requests = Vec::new();
        if let Some(c) = src.capacity {
            for (name, q) in c.requests.iter().flatten() {
                let parsed = Quantity::parse(&q.0).map_err(|e| {
                    AllocError::new(
                        Kind::UnsupportedClaim,
                        format!("claim {cref}, request {display}: capacity request {name}: {e}"),
                    )
                })?;
                cap_requests.push((name.clone(), parsed));
            }
        }
        let all = match src.mode.unwrap_or("") {
            "" | "ExactCount" => false,
            "All" => true,
            other => {
                return Err(AllocError::new(
                    Kind::UnsupportedClaim,
                    format!("claim {cref}, request {display}: unsupported count mode {other}"),
                ));
            }
        };
        let gi = self.memo.len();
        self.memo.push(vec![0; self.devs.len()]);
        let mut alt = Alt {
            gi,
            base: src.base,
            sub: src.sub,
            class,
            selectors,
            all,
            num_devices: 0,
            all_devices: Vec::new(),
            admin: src.admin == Some(true),
            tolerations: src.tolerations,
            cap_requests,
        };
        if !all {
            alt.num_devices = usize::try_from(src.count.unwrap_or(1).max(0)).unwrap_or(usize::MAX);
            return Ok(alt);
        }
        for p in &self.pools {
            if p.incomplete {
                return Err(AllocError::new(
                    Kind::PoolNotReady,
                    format!(
                        "claim {cref}, request {display}: asks for all devices, but resource pool {}/{} is currently being updated",
                        p.driver, p.name
                    ),
                ));
            }
            if p.invalid.is_some() {
                return Err(AllocError::new(
                    Kind::PoolNotReady,
                    format!(
                        "claim {cref}, request {display}: asks for all devices, but resource pool {}/{} is currently invalid",
                        p.driver, p.name
                    ),
                ));
            }
        }
        let mut all_devices = Vec::new();
        for d in 0..self.devs.len() {
            if !self.selectable(d, &alt, cref)? {
                continue;
            }
            if self.feats.consumable_capacity && self.capacity_fit(d, &alt).is_none() {
                continue;
            }
            all_devices.push(d);
        }
        alt.num_devices = all_devices.len();
        alt.all_devices = all_devices;
        Ok(alt)
    }

    // ---------------------------------------------------------------- device checks

    fn device_id(&self, d: usize) -> String {
        let f = &self.devs[d];
        let p = &self.pools[f.pool];
        format!("{}/{}/{}", p.driver, p.name, f.dev.name)
    }

    fn selectable(&mut self, d: usize, alt: &Alt<'a>, cref: &str) -> Result<bool, AllocError> {
        let f = &self.devs[d];
        if !self.feats.device_binding_and_status && f.dev.binding_conditions.is_some() {
            return Ok(false);
        }
        match self.memo[alt.gi][d] {
            1 => return Ok(false),
            2 => return Ok(true),
            _ => {}
        }
        let ok = self.selectable_uncached(d, alt, cref)?;
        self.memo[alt.gi][d] = if ok { 2 } else { 1 };
        Ok(ok)
    }

    fn selectable_uncached(&self, d: usize, alt: &Alt<'a>, cref: &str) -> Result<bool, AllocError> {
        let f = &self.devs[d];
        let cel = |m: String| AllocError::new(Kind::Cel, m);
        for (i, sel) in alt.class.selectors.iter().enumerate() {
            let sel = sel.as_ref().map_err(|e| {
                cel(format!(
                    "class {}: selector #{i}: CEL compile error: {e}",
                    alt.class.name
                ))
            })?;
            let ok = self.eval(sel, d).map_err(|e| {
                cel(format!(
                    "class {}: selector #{i} on device {}: CEL runtime error: {e}",
                    alt.class.name,
                    self.device_id(d)
                ))
            })?;
            if !ok {
                return Ok(false);
            }
        }
        for (i, sel) in alt.selectors.iter().enumerate() {
            let sel = sel.as_ref().map_err(|e| {
                cel(format!(
                    "claim {cref}: selector #{i}: CEL compile error: {e}"
                ))
            })?;
            let ok = self.eval(sel, d).map_err(|e| {
                cel(format!(
                    "claim {cref}: selector #{i} on device {}: CEL runtime error: {e}",
                    self.device_id(d)
                ))
            })?;
            if !ok {
                return Ok(false);
            }
        }
        if f.slice.per_device_node_selection == Some(true) {
            return node_matches(
                f.dev.node_name.as_deref(),
                f.dev.all_nodes,
                f.dev.node_selector.as_ref(),
                self.node,
            )
            .map_err(|e| {
                AllocError::new(
                    Kind::NodeSelection,
                    format!("device {}: node selection: {e}", self.device_id(d)),
                )
            });
        }
        Ok(true)
    }

    fn eval(&self, sel: &celx::Selector, d: usize) -> Result<bool, celx::CelError> {
        let f = &self.devs[d];
        match &f.dev.cel_input {
            Some(input) => celx::evaluate(self.inv.cel(), sel, input),
            None => Err(celx::CelError::NoInput(
                f.dev
                    .attr_error
                    .clone()
                    .unwrap_or_else(|| "unsupported attribute value".to_string()),
            )),
        }
    }

    fn capacity_fit(&self, d: usize, alt: &Alt<'a>) -> Option<Vec<Quantity>> {
        let f = &self.devs[d];
        let already = f.used.filter(|u| u.shares > 0).map(|u| &u.consumed);
        let allocating = self.alloc_cap[d].as_ref().map(|(_, m)| m);
        capacity::check(
            f.dev,
            self.pools[f.pool].driver,
            &alt.cap_requests,
            already,
            allocating,
        )
    }

    fn in_use(&self, d: usize) -> bool {
        let f = &self.devs[d];
        let state = f
            .used
            .is_some_and(|u| u.dedicated > 0 || (!self.feats.consumable_capacity && u.shares > 0));
        state || !self.allocating[d].is_empty()
    }

    fn allocating_for_claim(&self, d: usize, c: usize) -> bool {
        self.allocating[d].contains(&(c as u32))
    }

    fn capacity_in_use(&self, d: usize) -> bool {
        self.devs[d].used.is_some_and(|u| u.shares > 0) || self.alloc_cap[d].is_some()
    }

    fn taint_blocks(&self, d: usize, alt: &Alt<'a>) -> bool {
        let f = &self.devs[d];
        let tolerations = alt.tolerations.map(Vec::as_slice).unwrap_or_default();
        f.dev
            .taints
            .iter()
            .chain(f.rule_taints.iter().copied())
            .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
            .any(|t| !tolerations.iter().any(|tol| tolerates(tol, t)))
    }

    fn pool_available(&mut self, p: usize) -> &Counters {
        if self.available[p].is_none() {
            let pool = &self.pools[p];
            let mut avail = Counters::new();
            for cs in &pool.counter_sets {
                for (n, q) in &cs.counters {
                    avail.insert((cs.name.clone(), n.clone()), q.nanos());
                }
            }
            if !self.state.is_empty() {
                for s in pool.device_slices.iter().chain(pool.other_slices.iter()) {
                    for dev in &s.devices {
                        let allocated = self
                            .state
                            .lookup(pool.driver, pool.name, &dev.name)
                            .is_some_and(DevUse::allocated);
                        if !allocated {
                            continue;
                        }
                        for c in &dev.consumes {
                            for (n, q) in &c.counters {
                                if let Some(v) = avail.get_mut(&(c.set.clone(), n.clone())) {
                                    *v -= q.nanos();
                                }
                            }
                        }
                    }
                }
            }
            self.available[p] = Some(avail);
        }
        self.available[p].as_ref().unwrap_or_else(|| unreachable!())
    }

    fn add_counters(&mut self, d: usize, sign: i128) {
        let f = &self.devs[d];
        let consumed = &mut self.consumed_counters[f.pool];
        for c in &f.dev.consumes {
            for (n, q) in &c.counters {
                *consumed.entry((c.set.clone(), n.clone())).or_default() += sign * q.nanos();
            }
        }
    }

    fn check_counters(&mut self, d: usize) -> bool {
        let p = self.devs[d].pool;
        self.pool_available(p);
        self.add_counters(d, 1);
        let avail = self.available[p].as_ref();
        let consumed = &self.consumed_counters[p];
        let over = avail.is_some_and(|a| {
            a.iter()
                .any(|(k, v)| *v < consumed.get(k).copied().unwrap_or(0))
        });
        if over {
            self.add_counters(d, -1);
        }
        !over
    }

    // ---------------------------------------------------------------- search

    fn one(
        &mut self,
        c: usize,
        r: usize,
        s: usize,
        k: usize,
        in_sub: bool,
        start: usize,
    ) -> Result<bool, Stop> {
        self.steps += 1;
        if self.steps > self.max_steps {
            return Err(Stop::Budget);
        }
        if let Some(deadline) = self.deadline
            && self.steps.is_multiple_of(1024)
            && Instant::now() >= deadline
        {
            return Err(Stop::Budget);
        }
        if c >= self.claims.len() {
            return Ok(true);
        }
        if r >= self.reqs[c].len() {
            return match self.one(c + 1, 0, 0, 0, false, 0) {
                Err(Stop::MaxSize) => Ok(false),
                other => other,
            };
        }
        if !in_sub && self.reqs[c][r].has_sub {
            let mut all_exceeded = true;
            for si in 0..self.reqs[c][r].alts.len() {
                match self.one(c, r, si, 0, true, 0) {
                    Err(Stop::MaxSize) => continue,
                    Err(e) => return Err(e),
                    Ok(true) => {
                        self.selected[c][r] = si;
                        return Ok(true);
                    }
                    Ok(false) => all_exceeded = false,
                }
            }
            return if all_exceeded {
                Err(Stop::MaxSize)
            } else {
                Ok(false)
            };
        }
        let (all, num, empty_all, admin) = {
            let alt = &self.reqs[c][r].alts[s];
            (
                alt.all,
                alt.num_devices,
                alt.all_devices.is_empty(),
                alt.admin,
            )
        };
        if all && empty_all {
            return Ok(false);
        }
        if k >= num {
            return self.one(c, r + 1, 0, 0, false, 0);
        }
        if self.results[c].len() + num - k > MAX_DEVICES_PER_CLAIM {
            return Err(Stop::MaxSize);
        }
        if all {
            let d = self.reqs[c][r].alts[s].all_devices[k];
            if !self.allocate_device(c, r, s, d, true)? {
                return Ok(false);
            }
            let res = self.one(c, r, s, k + 1, in_sub, 0);
            if !matches!(res, Ok(true)) {
                self.undo(c);
            }
            return res;
        }
        if !self.may_fit(c, r, s, k, start) {
            return Ok(false);
        }
        let cref = claim_ref(self.claims[c]);
        // Interchangeability classes of the untouched devices whose subtree failed here.
        let mut failed: Vec<u32> = Vec::new();
        for d in start..self.devs.len() {
            if !self.devs[d].pickable {
                continue;
            }
            let class = self.sym_class(d);
            if class.is_some_and(|x| failed.contains(&x)) {
                continue;
            }
            if admin && self.allocating_for_claim(d, c) {
                continue;
            }
            if !admin && self.in_use(d) {
                continue;
            }
            // Borrow the alternative through a raw index so `self` stays usable.
            let selectable = {
                let reqs = std::mem::take(&mut self.reqs);
                let res = self.selectable(d, &reqs[c][r].alts[s], &cref);
                self.reqs = reqs;
                res.map_err(Stop::Fatal)?
            };
            if !selectable {
                continue;
            }
            if self.feats.consumable_capacity
                && self.capacity_fit(d, &self.reqs[c][r].alts[s]).is_none()
            {
                continue;
            }
            if !self.allocate_device(c, r, s, d, false)? {
                continue;
            }
            let res = self.one(c, r, s, k + 1, in_sub, d + 1);
            if let Ok(true) = res {
                return Ok(true);
            }
            self.undo(c);
            res?;
            // The tables may have been built inside the subtree; `d` was untouched before.
            if let Some(x) = class.or_else(|| self.sym_class(d)) {
                failed.push(x);
            }
        }
        Ok(false)
    }

    fn allocate_device(
        &mut self,
        c: usize,
        r: usize,
        s: usize,
        d: usize,
        must: bool,
    ) -> Result<bool, Stop> {
        let alt = &self.reqs[c][r].alts[s];
        let (admin, base, sub) = (alt.admin, alt.base, alt.sub);
        let f = &self.devs[d];
        let dev: &'a Device = f.dev;
        let multi = self.feats.consumable_capacity && dev.allow_multiple;
        if !multi && admin && self.allocating_for_claim(d, c) {
            return Ok(false);
        }
        if !admin && self.in_use(d) {
            return Ok(false);
        }
        if !self.feats.partitionable_devices && !dev.consumes.is_empty() {
            return Ok(false);
        }
        let mut counters_added = false;
        if !dev.consumes.is_empty() && (!multi || !self.capacity_in_use(d)) {
            if !self.check_counters(d) {
                return Ok(false);
            }
            counters_added = true;
        }
        if self.feats.device_taints && self.taint_blocks(d, &self.reqs[c][r].alts[s]) {
            if counters_added {
                self.add_counters(d, -1);
            }
            return Ok(false);
        }
        let driver = self.pools[self.devs[d].pool].driver;
        let mut added = 0;
        let mut failed = false;
        for cons in self.cons[c].iter_mut() {
            if !cons.applies(base, sub) {
                added += 1;
                continue;
            }
            let cand = dev.lookup_attr(cons.attr, driver);
            let ok = match (&mut cons.kind, cand) {
                (_, None) => false,
                (
                    ConsKind::Match {
                        reference,
                        n,
                        ref_dev,
                    },
                    Some(a),
                ) => {
                    if *n == 0 {
                        *reference = Some(a);
                        *ref_dev = d;
                        *n = 1;
                        true
                    } else if reference.is_some_and(|r| attr_equal_for_match(r, a)) {
                        *n += 1;
                        true
                    } else {
                        false
                    }
                }
                (ConsKind::Distinct { seen, seen_devs }, Some(a)) => {
                    if a.value.is_some() && !seen.iter().any(|x| x.value == a.value) {
                        seen.push(a);
                        seen_devs.push(d);
                        true
                    } else {
                        false
                    }
                }
            };
            if !ok {
                failed = true;
                break;
            }
            added += 1;
        }
        if failed {
            if must {
                let name = self.reqs[c][r].alts[s].full_name();
                let cref = claim_ref(self.claims[c]);
                let id = self.device_id(d);
                return Err(Stop::Fatal(AllocError::new(
                    Kind::ConstraintViolated,
                    format!(
                        "claim {cref}, request {name}: cannot add device {id} because a claim constraint would not be satisfied"
                    ),
                )));
            }
            self.remove_constraints(c, added, base, sub);
            if counters_added {
                self.add_counters(d, -1);
            }
            return Ok(false);
        }
        let mut consumed = None;
        if self.feats.consumable_capacity {
            match self.capacity_fit(d, &self.reqs[c][r].alts[s]) {
                Some(v) => {
                    if multi {
                        consumed = Some(v);
                    }
                }
                None => {
                    self.remove_constraints(c, self.cons[c].len(), base, sub);
                    if counters_added {
                        self.add_counters(d, -1);
                    }
                    return Ok(false);
                }
            }
        }
        let mut share_id = None;
        if multi {
            let entry = self.alloc_cap[d].get_or_insert_with(|| (0, HashMap::new()));
            entry.0 += 1;
            if let Some(v) = &consumed {
                for (cap, q) in dev.capacity.iter().zip(v) {
                    *entry.1.entry(cap.qn.clone()).or_default() += q.nanos();
                }
            }
            share_id = Some(self.share_id(c, r, s, d));
        } else {
            self.allocating[d].push(c as u32);
        }
        self.results[c].push(Picked {
            dev: d,
            c,
            r,
            s,
            share_id,
            consumed,
            counters_added,
            multi,
        });
        Ok(true)
    }

    /// Removes the device just added from the first `n` constraints of claim `c`.
    fn remove_constraints(&mut self, c: usize, n: usize, base: &str, sub: Option<&str>) {
        for cons in self.cons[c].iter_mut().take(n) {
            if !cons.applies(base, sub) {
                continue;
            }
            match &mut cons.kind {
                ConsKind::Match { n, .. } => *n = n.saturating_sub(1),
                ConsKind::Distinct { seen, seen_devs } => {
                    seen.pop();
                    seen_devs.pop();
                }
            }
        }
    }

    fn undo(&mut self, c: usize) {
        let Some(p) = self.results[c].pop() else {
            return;
        };
        let (base, sub) = {
            let alt = &self.reqs[p.c][p.r].alts[p.s];
            (alt.base, alt.sub)
        };
        self.remove_constraints(c, self.cons[c].len(), base, sub);
        if p.multi {
            let dev = self.devs[p.dev].dev;
            if let Some(entry) = &mut self.alloc_cap[p.dev] {
                entry.0 -= 1;
                if let Some(v) = &p.consumed {
                    for (cap, q) in dev.capacity.iter().zip(v) {
                        if let Some(x) = entry.1.get_mut(&cap.qn) {
                            *x -= q.nanos();
                        }
                    }
                }
                if entry.0 == 0 {
                    self.alloc_cap[p.dev] = None;
                }
            }
        } else if let Some(pos) = self.allocating[p.dev].iter().position(|x| *x == c as u32) {
            self.allocating[p.dev].swap_remove(pos);
        }
        if p.counters_added {
            self.add_counters(p.dev, -1);
        }
    }

    /// A deterministic stand-in for Kubernetes' random share UUID: a hash of the claim,
    /// request, device and the number of shares the device already has, formatted as a
    /// version-8 UUID. Unique per device as long as claims have distinct names.
    fn share_id(&self, c: usize, r: usize, s: usize, d: usize) -> String {
        let claim = self.claims[c];
        let f = &self.devs[d];
        let ordinal =
            f.used.map_or(0, |u| u.shares) + self.alloc_cap[d].as_ref().map_or(0, |e| e.0);
        let key = format!(
            "{}\0{}\0{}\0{}\0{}\0{}\0{}",
            claim.metadata.namespace.as_deref().unwrap_or_default(),
            claim.metadata.name.as_deref().unwrap_or_default(),
            claim.metadata.uid.as_deref().unwrap_or_default(),
            self.reqs[c][r].alts[s].full_name(),
            self.device_id(d),
            ordinal,
            self.results[c].len(),
        );
        let a = fnv1a(key.as_bytes(), 0xcbf2_9ce4_8422_2325);
        let b = fnv1a(key.as_bytes(), 0x6c62_272e_07bb_0142);
        let hi = (a & 0xffff_ffff_ffff_0fff) | 0x8000; // version 8
        let lo = (b & 0x3fff_ffff_ffff_ffff) | 0x8000_0000_0000_0000; // RFC 4122 variant
        format!(
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            hi >> 32,
            (hi >> 16) & 0xffff,
            hi & 0xffff,
            lo >> 48,
            lo & 0xffff_ffff_ffff
        )
    }

    // ---------------------------------------------------------------- results

    fn build_results(&self) -> Result<Vec<k8s::AllocationResult>, AllocError> {
        let mut out = Vec::with_capacity(self.claims.len());
        for (ci, claim) in self.claims.iter().enumerate() {
            let mut results = Vec::with_capacity(self.results[ci].len());
            for p in &self.results[ci] {
                let f = &self.devs[p.dev];
                let pool = &self.pools[f.pool];
                let alt = &self.reqs[p.c][p.r].alts[p.s];
                let consumed_capacity = p.consumed.as_ref().and_then(|v| {
                    let m: BTreeMap<String, k8s::K8sQuantity> = f
                        .dev
                        .capacity
                        .iter()
                        .zip(v)
                        .map(|(cap, q)| (cap.raw.clone(), k8s::K8sQuantity(q.to_string())))
                        .collect();
                    (!m.is_empty()).then_some(m)
                });
                let (bc, bfc) = if self.feats.device_binding_and_status {
                    (
                        f.dev.binding_conditions.clone(),
                        f.dev.binding_failure_conditions.clone(),
                    )
                } else {
                    (None, None)
                };
                results.push(k8s::DeviceRequestAllocationResult {
                    request: alt.full_name(),
                    driver: pool.driver.to_string(),
                    pool: pool.name.to_string(),
                    device: f.dev.name.to_string(),
                    admin_access: alt.admin.then_some(true),
                    tolerations: alt.tolerations.filter(|t| !t.is_empty()).cloned(),
                    binding_conditions: bc,
                    binding_failure_conditions: bfc,
                    share_id: p.share_id.clone(),
                    consumed_capacity,
                });
            }
            let config = self.build_config(ci, claim);
            out.push(k8s::AllocationResult {
                devices: Some(k8s::DeviceAllocationResult {
                    results: (!results.is_empty()).then_some(results),
                    config: (!config.is_empty()).then_some(config),
                }),
                node_selector: self.node_selector(ci).map_err(|e| {
                    AllocError::new(
                        Kind::NodeSelection,
                        format!(
                            "create NodeSelector for claim {}: {e}",
                            claim.metadata.name.as_deref().unwrap_or_default()
                        ),
                    )
                })?,
                allocation_timestamp: None,
            });
        }
        Ok(out)
    }

    /// Class configs (once per class, listing the chosen (sub)requests that use the class),
    /// then the claim configs that apply to allocated requests or chosen subrequests.
    fn build_config(
        &self,
        ci: usize,
        claim: &k8s::ResourceClaim,
    ) -> Vec<k8s::DeviceAllocationConfiguration> {
        let requests = claim
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.requests.as_deref())
            .unwrap_or_default();
        let mut config: Vec<k8s::DeviceAllocationConfiguration> = Vec::new();
        let mut class_ranges: HashMap<&str, (usize, usize)> = HashMap::new();
        for (ri, req) in self.reqs[ci].iter().enumerate() {
            let alt = &req.alts[if req.has_sub {
                self.selected[ci][ri]
            } else {
                0
            }];
            let name = alt.full_name();
            if let Some((a, b)) = class_ranges.get(alt.class.name.as_str()) {
                for cfg in &mut config[*a..*b] {
                    cfg.requests.get_or_insert_with(Vec::new).push(name.clone());
                }
                continue;
            }
            let start = config.len();
            for cc in &alt.class.config {
                config.push(k8s::DeviceAllocationConfiguration {
                    opaque: cc.opaque.clone(),
                    requests: Some(vec![name.clone()]),
                    source: "FromClass".to_string(),
                });
            }
            class_ranges.insert(alt.class.name.as_str(), (start, config.len()));
        }
        for cc in claim
            .spec
            .devices
            .iter()
            .flat_map(|d| d.config.iter().flatten())
        {
            let names = cc.requests.as_deref().unwrap_or_default();
            let entry = k8s::DeviceAllocationConfiguration {
                opaque: cc.opaque.clone(),
                requests: cc.requests.clone(),
                source: "FromClaim".to_string(),
            };
            if names.is_empty() {
                config.push(entry);
                continue;
            }
            for (ri, req) in requests.iter().enumerate() {
                if names.contains(&req.name) {
                    config.push(entry.clone());
                    continue;
                }
                let Some(r) = self.reqs[ci].get(ri) else {
                    continue;
                };
                if !r.has_sub {
                    continue;
                }
                let full = r.alts[self.selected[ci][ri]].full_name();
                if names.contains(&full) {
                    config.push(entry.clone());
                }
            }
        }
        config
    }

    fn node_selector(&self, ci: usize) -> Result<Option<k8s::NodeSelector>, String> {
        let mut fields: Vec<k8s::NodeSelectorRequirement> = Vec::new();
        let mut exprs: Vec<k8s::NodeSelectorRequirement> = Vec::new();
        for p in &self.results[ci] {
            let f = &self.devs[p.dev];
            let (node_name, selector) = if f.slice.per_device_node_selection == Some(true) {
                (f.dev.node_name.as_ref(), f.dev.node_selector.as_ref())
            } else {
                (f.slice.node_name.as_ref(), f.slice.node_selector.as_ref())
            };
            if node_name.is_some() || f.dev.binds_to_node {
                return Ok(Some(k8s::NodeSelector {
                    node_selector_terms: vec![k8s::NodeSelectorTerm {
                        match_expressions: None,
                        match_fields: Some(vec![k8s::NodeSelectorRequirement {
                            key: "metadata.name".to_string(),
                            operator: "In".to_string(),
                            values: Some(vec![self.node.name.clone()]),
                        }]),
                    }],
                }));
            }
            if let Some(sel) = selector {
                match sel.node_selector_terms.as_slice() {
                    [] => {}
                    [term] => {
                        add_requirements(term.match_fields.as_deref(), &mut fields);
                        add_requirements(term.match_expressions.as_deref(), &mut exprs);
                    }
                    terms => {
                        return Err(format!(
                            "unsupported ResourceSlice.NodeSelector with {} terms",
                            terms.len()
                        ));
                    }
                }
            }
        }
        if fields.is_empty() && exprs.is_empty() {
            return Ok(None);
        }
        Ok(Some(k8s::NodeSelector {
            node_selector_terms: vec![k8s::NodeSelectorTerm {
                match_expressions: (!exprs.is_empty()).then_some(exprs),
                match_fields: (!fields.is_empty()).then_some(fields),
            }],
        }))
    }
}

struct AltSource<'a> {
    base: &'a str,
    sub: Option<&'a str>,
    class: &'a str,
    selectors: &'a [k8s::DeviceSelector],
    mode: Option<&'a str>,
    count: Option<i64>,
    admin: Option<bool>,
    tolerations: Option<&'a Vec<k8s::DeviceToleration>>,
    capacity: Option<&'a k8s::CapacityRequirements>,
}

fn validate_consumption(sets: &[&CounterSet], slices: &[&Slice]) -> Result<(), String> {
    for s in slices {
        for d in &s.devices {
            for c in &d.consumes {
                let Some(set) = sets.iter().find(|x| x.name == c.set) else {
                    return Err(format!("counter set {} not found", c.set));
                };
                for (n, _) in &c.counters {
                    if !set.counters.iter().any(|(x, _)| x == n) {
                        return Err(format!("counter {n} not found in counter set {}", set.name));
                    }
                }
            }
        }
    }
    Ok(())
}

fn add_requirements(
    from: Option<&[k8s::NodeSelectorRequirement]>,
    to: &mut Vec<k8s::NodeSelectorRequirement>,
) {
    for r in from.unwrap_or_default() {
        let mut want: Vec<&String> = r.values.iter().flatten().collect();
        want.sort();
        want.dedup();
        let present = to.iter().any(|e| {
            let mut have: Vec<&String> = e.values.iter().flatten().collect();
            have.sort();
            have.dedup();
            e.key == r.key && e.operator == r.operator && have == want
        });
        if !present {
            to.push(r.clone());
        }
    }
}

/// `resourceclaim.ToleratesTaint`.
fn tolerates(t: &k8s::DeviceToleration, taint: &Taint) -> bool {
    let fields = taint::TolerationFields {
        key: t.key.as_deref(),
        operator: t.operator.as_deref(),
        value: t.value.as_deref(),
        effect: t.effect.as_deref(),
    };
    taint::fields_tolerate(fields, &taint.key, &taint.value, &taint.effect)
}

fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut h = seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
