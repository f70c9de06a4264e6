//! Exact pruning for the search: cheap necessary conditions for "the pod's claims can still be
//! completed from this node of the search", checked at every device-loop entry.
//!
//! A branch is cut only when one of these conditions fails, i.e. when it provably holds no
//! solution. Every device the search could still pick passes the per-device filter below
//! (the same checks the search applies, evaluated at the current state), and every filter
//! only gets stricter deeper in a branch (devices get used, counters and capacity consumed,
//! match references fixed, distinct values seen). So first-fit answers, and the devices they
//! choose, are the ones the unpruned search returns; only the step count differs.
//!
//! Conditions, per claim still to fill (current claim from the current request on, later
//! claims from their start, every request with each `firstAvailable` alternative):
//! * each request has enough candidate devices (after selectors, taints, devices in use,
//!   counters and capacity left, and the claim's constraint state);
//! * the requests of one claim, and the non-admin requests of all remaining claims, have at
//!   least as many distinct candidates together as they ask for (a `firstAvailable` request
//!   counts its smallest usable alternative, over all its alternatives' candidates); and so
//!   does every set of single-alternative requests whose candidates nest inside one of
//!   theirs (Hall's condition where device classes make it cheap: NIC requests cannot spill
//!   onto GPUs);
//! * `matchAttribute` without a reference yet: some single value has enough candidates for
//!   every request it constrains, alone and together; constraints of one claim on the same
//!   requests must agree on one tuple of values, so some tuple has enough candidates;
//! * a `matchAttribute` and a `distinctAttribute` on the same attribute leave room for at
//!   most one device under both;
//! * `distinctAttribute`: enough distinct unused values, per request and together (again
//!   with each `firstAvailable` request's smallest usable alternative);
//! * shared counters: the cheapest choice of each request's devices fits what is left.
//!
//! Exactness also needs the search's other exits to be unaffected. Some requests may fail the
//! pod when the search enters them: a selector error on one of their devices, a constraint on
//! a mode-`All` request, and in the current claim the 32-device limit (reported from where
//! it is hit). The conditions are checked only on the requests before the first of those: if
//! they cannot be filled, it is never entered. A request is not such a hazard when the
//! failure provably cannot happen from this node: its failing selectors are only on devices
//! in use by then (already, or taken by an earlier request that needs all its candidates),
//! or its mode-`All` walk stops quietly at a device in use before any device that could
//! break the constraint. Negative amounts turn pruning off (filters would not be monotone).
//!
//! Besides cutting branches, the search skips a device interchangeable with one that already
//! failed at the same position ([`Run::sym_class`]).

use std::sync::Arc;

use super::{Alt, ConsKind, MAX_DEVICES_PER_CLAIM, Run, attr_equal_for_match, claim_ref};

/// Steps taken before pruning starts: searches that find their answer right away (nearly
/// all) never pay for the tables.
const ENGAGE_AFTER: u64 = 32;

/// No value: the device lacks the attribute (not a candidate for the constraint).
const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Mode {
    /// Never prune (asked for, or a condition for exactness does not hold).
    #[default]
    Off,
    /// Prune once [`ENGAGE_AFTER`] steps are taken.
    Pending,
    /// Tables built; pruning.
    On,
}

/// One (sub)request still to be filled at the node being checked.
struct ItemAlt {
    /// Index of the request among the node's items (alternatives share it).
    item: usize,
    claim: usize,
    gi: usize,
    need: usize,
    admin: bool,
    /// Candidate range in `Pruner::buf`.
    lo: usize,
    hi: usize,
    /// Only alternative of its request.
    fixed: bool,
    /// Most devices any alternative of its request takes.
    most: usize,
    /// Entering the request may fail the pod, so the search past it cannot be predicted.
    hazard: bool,
}

impl ItemAlt {
    fn count(&self) -> usize {
        self.hi - self.lo
    }
}

/// Several `matchAttribute` constraints of claim `claim` that constrain exactly the same
/// alternatives: their devices must agree on every one, so on the tuple of values.
struct Joint {
    claim: usize,
    /// The constraints (indices into the claim's constraints; two or more).
    members: Vec<usize>,
    /// Interned value tuple per device (`NONE` = lacks one of the attributes).
    vals: Vec<u32>,
    nvals: usize,
}

#[derive(Default)]
pub(super) struct Pruner {
    pub(super) mode: Mode,
    /// Per alternative (`Alt::gi`): devices passing the checks that do not change during the
    /// search, ascending.
    cands: Vec<Vec<u32>>,
    /// Per alternative: indices of its claim's constraints that apply to it.
    applies: Vec<Vec<usize>>,
    /// Per claim, per constraint: interned attribute value per device (`NONE` = missing).
    vals: Vec<Vec<Vec<u32>>>,
    /// Per claim, per constraint: number of interned values.
    nvals: Vec<Vec<usize>>,
    /// `matchAttribute` constraints of one claim that apply to the same alternatives,
    /// checked together while none has a reference yet.
    joint: Vec<Joint>,
    /// Per alternative: devices whose selectors fail with an error (ascending).
    errs: Vec<Vec<u32>>,
    /// Per alternative: a mode-`All` request with a constraint (entering it may fail the
    /// pod on a violation).
    walks: Vec<bool>,
    /// Per walked alternative: its safe prefix length ([`Run::safe_walk`]).
    safe_walk: Vec<u32>,
    /// Per device: multi-allocatable (may serve several requests).
    multi: Vec<bool>,
    /// Counter keys (pool, counter set, counter); empty when no device consumes counters.
    keys: Vec<(usize, Arc<str>, Arc<str>)>,
    /// Per pool: its keys.
    pool_keys: Vec<Vec<usize>>,
    /// Per device: (key, amount in nano-units) it consumes.
    dev_use: Vec<Vec<(usize, i128)>>,
    /// Per device: its interchangeability class ([`NONE`]: interchangeable with no other).
    class: Vec<u32>,
    // Scratch, reused across nodes.
    rem: Vec<i128>,
    pool_over: Vec<bool>,
    items: Vec<ItemAlt>,
    buf: Vec<u32>,
    mark: Vec<u32>,
    epoch: u32,
    /// Devices every completion of the search from the node being checked puts in use
    /// before the request being pushed: those whose `forced` is this epoch ([`force`]).
    forced_epoch: u32,
    forced: Vec<u32>,
    hist: Vec<u32>,
    lb: Vec<i128>,
    lb_alt: Vec<i128>,
    hits: Vec<usize>,
    amounts: Vec<i128>,
}

impl Pruner {
    pub(super) fn new(on: bool) -> Pruner {
        Pruner {
            mode: if on { Mode::Pending } else { Mode::Off },
            ..Pruner::default()
        }
    }

    fn next_epoch(&mut self) -> u32 {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.mark.iter_mut().for_each(|m| *m = 0);
            self.forced.iter_mut().for_each(|m| *m = 0);
            self.epoch = 1;
        }
        self.epoch
    }

    fn amount(&self, d: usize, key: usize) -> i128 {
        if self.multi[d] {
            // Charged once however many requests share it: no lower bound per request.
            return 0;
        }
        self.dev_use[d]
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |(_, a)| *a)
    }
}

impl<'a> Run<'a> {
    /// False when the search from this node (claim `c`, request `r`, alternative `s`, `k`
    /// devices of it chosen, next device index `start`) provably finds no solution.
    pub(super) fn may_fit(&mut self, c: usize, r: usize, s: usize, k: usize, start: usize) -> bool {
        match self.prune.mode {
            Mode::Off => return true,
            Mode::Pending => {
                if self.steps < ENGAGE_AFTER {
                    return true;
                }
                self.engage();
                if self.prune.mode != Mode::On {
                    return true;
                }
            }
            Mode::On => {}
        }
        let mut p = std::mem::take(&mut self.prune);
        let fit = self.check(&mut p, c, r, s, k, start);
        self.prune = p;
        fit
    }

    fn engage(&mut self) {
        let mut p = std::mem::take(&mut self.prune);
        p.mode = if self.build_tables(&mut p) {
            Mode::On
        } else {
            Mode::Off
        };
        self.prune = p;
    }

    /// The static tables; false when pruning would not be exact for this run.
    fn build_tables(&mut self, p: &mut Pruner) -> bool {
        let n = self.devs.len();
        let cc = self.feats.consumable_capacity;
        p.multi = self
            .devs
            .iter()
            .map(|f| cc && f.dev.allow_multiple)
            .collect();
        if self.devs.iter().any(|f| {
            f.dev
                .consumes
                .iter()
                .any(|c| c.counters.iter().any(|(_, q)| q.nanos() < 0))
        }) {
            return false;
        }
        // Interned constraint values.
        p.vals.clear();
        p.nvals.clear();
        for cons in &self.cons {
            let mut per_claim = Vec::with_capacity(cons.len());
            let mut counts = Vec::with_capacity(cons.len());
            for con in cons {
                let distinct = matches!(con.kind, ConsKind::Distinct { .. });
                let mut reps: Vec<&crate::inventory::Attr> = Vec::new();
                let mut ids = Vec::with_capacity(n);
                let mut unique = 0usize;
                for f in &self.devs {
                    let driver = self.pools[f.pool].driver;
                    let Some(a) = f.dev.lookup_attr(con.attr, driver) else {
                        ids.push(NONE);
                        continue;
                    };
                    let id = if distinct {
                        if a.value.is_none() {
                            NONE
                        } else if let Some(i) = reps.iter().position(|x| x.value == a.value) {
                            i as u32
                        } else {
                            reps.push(a);
                            (reps.len() - 1) as u32
                        }
                    } else if a.value.is_none() {
                        // Equal to nothing, not even itself: a value of its own. Numbered
                        // from the top so it never collides with shared values.
                        unique += 1;
                        (n + unique) as u32
                    } else if let Some(i) = reps.iter().position(|x| attr_equal_for_match(x, a)) {
                        i as u32
                    } else {
                        reps.push(a);
                        (reps.len() - 1) as u32
                    };
                    ids.push(id);
                }
                // Compact the ids of valueless attributes to follow the shared ones.
                let shared = reps.len();
                if unique > 0 {
                    for id in ids.iter_mut() {
                        if *id != NONE && *id as usize > n {
                            *id = (shared + (*id as usize - n - 1)) as u32;
                        }
                    }
                }
                per_claim.push(ids);
                counts.push(shared + unique);
            }
            p.vals.push(per_claim);
            p.nvals.push(counts);
        }
        // Negative capacity requests.
        if self
            .reqs
            .iter()
            .flatten()
            .flat_map(|r| &r.alts)
            .any(|alt| alt.cap_requests.iter().any(|(_, q)| q.nanos() < 0))
        {
            return false;
        }
        // Static candidates per alternative.
        p.cands = vec![Vec::new(); self.memo.len()];
        p.errs = vec![Vec::new(); self.memo.len()];
        p.applies = vec![Vec::new(); self.memo.len()];
        p.walks = vec![false; self.memo.len()];
        p.safe_walk = vec![0; self.memo.len()];
        let reqs = std::mem::take(&mut self.reqs);
        self.static_candidates(p, &reqs);
        self.reqs = reqs;
        self.joint_constraints(p);
        // Counters.
        p.keys.clear();
        p.pool_keys = vec![Vec::new(); self.pools.len()];
        p.dev_use = vec![Vec::new(); n];
        if self.devs.iter().any(|f| !f.dev.consumes.is_empty()) {
            for pi in 0..self.pools.len() {
                if self.pools[pi].counter_sets.is_empty() {
                    continue;
                }
                self.pool_available(pi);
                for cs in &self.pools[pi].counter_sets {
                    for (name, _) in &cs.counters {
                        p.pool_keys[pi].push(p.keys.len());
                        p.keys.push((pi, cs.name.clone(), name.clone()));
                    }
                }
            }
            for (d, f) in self.devs.iter().enumerate() {
                for c in &f.dev.consumes {
                    for (name, q) in &c.counters {
                        let key = p.pool_keys[f.pool]
                            .iter()
                            .copied()
                            .find(|&k| p.keys[k].1 == c.set && p.keys[k].2 == *name);
                        if let Some(k) = key {
                            match p.dev_use[d].iter_mut().find(|(x, _)| *x == k) {
                                Some((_, a)) => *a += q.nanos(),
                                None => p.dev_use[d].push((k, q.nanos())),
                            }
                        }
                    }
                }
            }
        }
        p.rem = vec![0; p.keys.len()];
        p.pool_over = vec![false; self.pools.len()];
        p.mark = vec![0; n];
        p.forced = vec![0; n];
        self.classes(p);
        true
    }

    /// Interchangeable devices: those no part of the search can tell apart. They share a
    /// pool and its counters, the same use before this pod, every alternative's verdict on
    /// them (selectors, taints, capacity) and every constraint's value. Swapping two such
    /// devices, both untouched so far, maps solutions onto solutions; so once one failed at
    /// a position of the search, the other fails there too. Multi-allocatable devices carry
    /// their consumed capacity and are never interchangeable, nor are the devices of a
    /// constrained mode-`All` request (below).
    fn classes(&self, p: &mut Pruner) {
        let n = self.devs.len();
        let mut member: Vec<Vec<u32>> = vec![Vec::new(); n];
        // Candidate of alternative `gi`: 2 gi; selector error there: 2 gi + 1.
        for (gi, (cands, errs)) in p.cands.iter().zip(&p.errs).enumerate() {
            for &d in cands {
                member[d as usize].push(2 * gi as u32);
            }
            for &d in errs {
                member[d as usize].push(2 * gi as u32 + 1);
            }
        }
        member.iter_mut().for_each(|m| m.sort_unstable());
        let mut seen: std::collections::HashMap<Vec<i128>, u32> = Default::default();
        p.class = Vec::with_capacity(n);
        // A mode-All request with a constraint walks its devices in order and fails the pod
        // at the first that violates the constraint, but fails quietly at one already in
        // use: which of two interchangeable devices it walks in use changes the outcome.
        let mut walked = vec![false; n];
        for (ci, reqs) in self.reqs.iter().enumerate() {
            for alt in reqs.iter().flat_map(|r| &r.alts) {
                if alt.all && self.cons[ci].iter().any(|k| k.applies(alt.base, alt.sub)) {
                    alt.all_devices.iter().for_each(|&d| walked[d] = true);
                }
            }
        }
        for (d, f) in self.devs.iter().enumerate() {
            let mapped: usize = f.dev.consumes.iter().map(|c| c.counters.len()).sum();
            if p.multi[d] || !f.pickable || walked[d] || mapped != p.dev_use[d].len() {
                p.class.push(NONE);
                continue;
            }
            let (dedicated, shares) = f.used.map_or((0, 0), |u| (u.dedicated, u.shares));
            let mut key: Vec<i128> = vec![
                f.pool as i128,
                i128::from(dedicated > 0),
                i128::from(shares > 0),
                member[d].len() as i128,
            ];
            key.extend(member[d].iter().map(|&g| i128::from(g)));
            for claim in &p.vals {
                key.extend(claim.iter().map(|v| i128::from(v[d])));
            }
            let mut uses = p.dev_use[d].clone();
            uses.sort_unstable();
            for (k, a) in uses {
                key.push(k as i128);
                key.push(a);
            }
            let next = seen.len() as u32;
            p.class.push(*seen.entry(key).or_insert(next));
        }
    }

    /// The interchangeability class of device `d` while it is untouched by this pod's
    /// search; `None` before the tables exist or when `d` has no interchangeable peer.
    pub(super) fn sym_class(&self, d: usize) -> Option<u32> {
        if self.prune.mode != Mode::On || !self.allocating[d].is_empty() {
            return None;
        }
        let class = self.prune.class[d];
        (class != NONE && self.alloc_cap[d].is_none()).then_some(class)
    }

    /// Groups each claim's `matchAttribute` constraints by the alternatives they constrain.
    fn joint_constraints(&self, p: &mut Pruner) {
        p.joint.clear();
        for (ci, cons) in self.cons.iter().enumerate() {
            let scope = |ki: usize| -> Vec<usize> {
                self.reqs[ci]
                    .iter()
                    .flat_map(|r| &r.alts)
                    .filter(|a| p.applies[a.gi].contains(&ki))
                    .map(|a| a.gi)
                    .collect()
            };
            let matches: Vec<usize> = (0..cons.len())
                .filter(|&ki| matches!(cons[ki].kind, ConsKind::Match { .. }))
                .collect();
            let mut grouped = vec![false; cons.len()];
            for (i, &ki) in matches.iter().enumerate() {
                if grouped[ki] {
                    continue;
                }
                let own = scope(ki);
                let members: Vec<usize> = matches[i..]
                    .iter()
                    .copied()
                    .filter(|&kj| !grouped[kj] && scope(kj) == own)
                    .collect();
                members.iter().for_each(|&kj| grouped[kj] = true);
                if members.len() < 2 || own.is_empty() {
                    continue;
                }
                let mut seen: std::collections::HashMap<Vec<u32>, u32> = Default::default();
                let vals = (0..self.devs.len())
                    .map(|d| {
                        let key: Vec<u32> = members.iter().map(|&kj| p.vals[ci][kj][d]).collect();
                        if key.contains(&NONE) {
                            return NONE;
                        }
                        let next = seen.len() as u32;
                        *seen.entry(key).or_insert(next)
                    })
                    .collect();
                p.joint.push(Joint {
                    claim: ci,
                    members,
                    vals,
                    nvals: seen.len(),
                });
            }
        }
    }

    fn static_candidates(&mut self, p: &mut Pruner, reqs: &[Vec<super::Req<'a>>]) {
        let cc = self.feats.consumable_capacity;
        for (ci, claim_reqs) in reqs.iter().enumerate() {
            let cref = claim_ref(self.claims[ci]);
            for (ri, req) in claim_reqs.iter().enumerate() {
                for alt in &req.alts {
                    let applies: Vec<usize> = self.cons[ci]
                        .iter()
                        .enumerate()
                        .filter(|(_, k)| k.applies(alt.base, alt.sub))
                        .map(|(i, _)| i)
                        .collect();
                    // A violated constraint on a mode-All request fails the pod.
                    p.walks[alt.gi] = alt.all && !applies.is_empty();
                    let mut cands = Vec::new();
                    let list: Vec<usize> = if alt.all {
                        alt.all_devices.clone()
                    } else {
                        (0..self.devs.len()).collect()
                    };
                    for d in list {
                        let f = &self.devs[d];
                        if !f.pickable {
                            continue;
                        }
                        // Devices of allocated claims are never looked at by a non-admin
                        // request, so their selectors are not evaluated here either.
                        let taken = f
                            .used
                            .is_some_and(|u| u.dedicated > 0 || (!cc && u.shares > 0));
                        if taken && !alt.admin {
                            continue;
                        }
                        match self.selectable(d, alt, &cref) {
                            Err(_) => {
                                p.errs[alt.gi].push(d as u32);
                                continue;
                            }
                            Ok(false) => continue,
                            Ok(true) => {}
                        }
                        let f = &self.devs[d];
                        if !self.feats.partitionable_devices && !f.dev.consumes.is_empty() {
                            continue;
                        }
                        if self.feats.device_taints && self.taint_blocks(d, alt) {
                            continue;
                        }
                        if cc && !p.multi[d] && self.capacity_fit(d, alt).is_none() {
                            continue;
                        }
                        if applies.iter().any(|&ki| p.vals[ci][ki][d] == NONE) {
                            continue;
                        }
                        cands.push(d as u32);
                    }
                    p.cands[alt.gi] = cands;
                    p.applies[alt.gi] = applies;
                    if p.walks[alt.gi] {
                        p.safe_walk[alt.gi] = self.safe_walk(p, ci, &claim_reqs[..ri], alt) as u32;
                    }
                }
            }
        }
    }

    /// How many leading devices of mode-`All` alternative `alt` of claim `ci` (entered after
    /// the claim's requests `earlier`) the walk can take without violating a constraint,
    /// whatever the search did before: each has the attribute, `matchAttribute` values agree,
    /// `distinctAttribute` values differ, and no earlier request of the claim can have fixed
    /// a reference or seen a value.
    fn safe_walk(&self, p: &Pruner, ci: usize, earlier: &[super::Req<'a>], alt: &Alt<'a>) -> usize {
        let applies = &p.applies[alt.gi];
        let fixed = applies.iter().any(|&ki| {
            let con = &self.cons[ci][ki];
            earlier
                .iter()
                .flat_map(|r| &r.alts)
                .any(|a| con.applies(a.base, a.sub))
        });
        if fixed {
            return 0;
        }
        let devs = &alt.all_devices;
        (0..devs.len())
            .find(|&i| {
                let d = devs[i];
                applies.iter().any(|&ki| {
                    let vals = &p.vals[ci][ki];
                    vals[d] == NONE
                        || match self.cons[ci][ki].kind {
                            ConsKind::Match { .. } => vals[d] != vals[devs[0]],
                            ConsKind::Distinct { .. } => {
                                devs[..i].iter().any(|&x| vals[x] == vals[d])
                            }
                        }
                })
            })
            .unwrap_or(devs.len())
    }

    /// Walking mode-`All` alternative `alt` of claim `ci` from here cannot fail the pod: no
    /// device of it can violate a constraint, or a device
    /// it refuses before looking at constraints (in use, a taint not tolerated) comes no
    /// later than the end of its safe prefix, so the walk stops there quietly ([`Self::safe_walk`]). In use only grows deeper
    /// in the branch, so this holds below this node too.
    fn walk_quiet(&self, p: &Pruner, ci: usize, alt: &Alt<'a>) -> bool {
        let safe = p.safe_walk[alt.gi] as usize;
        if safe >= alt.all_devices.len() {
            // No device of the walk can violate a constraint.
            return true;
        }
        alt.all_devices.iter().take(safe + 1).any(|&d| {
            let f = &self.devs[d];
            let refused = if alt.admin {
                !p.multi[d] && self.allocating_for_claim(d, ci)
            } else {
                self.in_use(d) || p.forced[d] == p.forced_epoch
            };
            refused
                || (!self.feats.partitionable_devices && !f.dev.consumes.is_empty())
                || (self.feats.device_taints && self.taint_blocks(d, alt))
        })
    }

    /// Can device `d` still be chosen for `alt` of claim `ci` in this branch?
    fn usable(&self, p: &Pruner, d: usize, ci: usize, alt: &Alt<'a>) -> bool {
        if alt.admin {
            if self.allocating_for_claim(d, ci) {
                return false;
            }
        } else if self.in_use(d) {
            return false;
        }
        let f = &self.devs[d];
        if !f.dev.consumes.is_empty()
            && (!p.multi[d] || !self.capacity_in_use(d))
            && (p.pool_over[f.pool] || p.dev_use[d].iter().any(|(k, a)| p.rem[*k] < *a))
        {
            return false;
        }
        if p.multi[d] && self.capacity_fit(d, alt).is_none() {
            return false;
        }
        for &ki in &p.applies[alt.gi] {
            let vals = &p.vals[ci][ki];
            match &self.cons[ci][ki].kind {
                ConsKind::Match { n, ref_dev, .. } => {
                    if *n > 0 && vals[d] != vals[*ref_dev] {
                        return false;
                    }
                }
                ConsKind::Distinct { seen_devs, .. } => {
                    if seen_devs.iter().any(|&x| vals[x] == vals[d]) {
                        return false;
                    }
                }
            }
        }
        true
    }

    fn push_alt(
        &self,
        p: &mut Pruner,
        item: usize,
        (ci, ri, si): (usize, usize, usize),
        need: Option<usize>,
        start: usize,
    ) {
        let req = &self.reqs[ci][ri];
        let alt = &req.alts[si];
        // A device whose selectors fail is evaluated only if the loop reaches it unused; a
        // device in use here (or forced into use before this request) stays in use below.
        let hazard = (p.walks[alt.gi] && !self.walk_quiet(p, ci, alt))
            || p.errs[alt.gi].iter().any(|&e| {
                let e = e as usize;
                e >= start
                    && if alt.admin {
                        !self.allocating_for_claim(e, ci)
                    } else {
                        !self.in_use(e) && p.forced[e] != p.forced_epoch
                    }
            });
        let most = req.alts.iter().map(Alt::takes).max().unwrap_or(0);
        let lo = p.buf.len();
        let cands = std::mem::take(&mut p.cands[alt.gi]);
        for &d in &cands {
            if (d as usize) >= start && self.usable(p, d as usize, ci, alt) {
                p.buf.push(d);
            }
        }
        p.cands[alt.gi] = cands;
        let need = need.unwrap_or(if alt.all {
            // Mode All takes every matching device and fails when there are none.
            alt.all_devices.len().max(1)
        } else {
            alt.num_devices
        });
        p.items.push(ItemAlt {
            item,
            claim: ci,
            gi: alt.gi,
            need,
            admin: alt.admin,
            lo,
            hi: p.buf.len(),
            fixed: false,
            most,
            hazard,
        });
    }

    fn check(&self, p: &mut Pruner, c: usize, r: usize, s: usize, k: usize, start: usize) -> bool {
        // Counters left per key, at this node.
        if !p.keys.is_empty() {
            p.pool_over.iter_mut().for_each(|o| *o = false);
            for (i, (pi, set, name)) in p.keys.iter().enumerate() {
                let key = (set.clone(), name.clone());
                let avail = self.available[*pi]
                    .as_ref()
                    .and_then(|a| a.get(&key))
                    .copied()
                    .unwrap_or(0);
                let used = self.consumed_counters[*pi].get(&key).copied().unwrap_or(0);
                p.rem[i] = avail - used;
                if p.rem[i] < 0 {
                    p.pool_over[*pi] = true;
                }
            }
        }
        p.items.clear();
        p.buf.clear();
        p.forced_epoch = p.next_epoch();
        let num = self.reqs[c][r].alts[s].num_devices;
        self.push_alt(p, 0, (c, r, s), Some(num - k), start);
        if p.items[0].hazard {
            return true;
        }
        force(p, 0);
        // The requests are checked up to the first one whose entry may fail the pod: if
        // those before it cannot all be filled, it is never entered. In this claim, that
        // includes a request the 32-device limit may stop at (reported from where it is hit);
        // in later claims the limit only fails that claim.
        let mut item = 1;
        let mut most = self.results[c].len() + num - k;
        'items: for ci in c..self.claims.len() {
            let r0 = if ci == c { r + 1 } else { 0 };
            for ri in r0..self.reqs[ci].len() {
                let req = &self.reqs[ci][ri];
                let alts = if req.has_sub { req.alts.len() } else { 1 };
                let first = p.items.len();
                for si in 0..alts {
                    self.push_alt(p, item, (ci, ri, si), None, 0);
                }
                if ci == c {
                    most += p.items[first].most;
                }
                if p.items[first..].iter().any(|it| it.hazard)
                    || (ci == c && most > MAX_DEVICES_PER_CLAIM)
                {
                    p.items.truncate(first);
                    break 'items;
                }
                if alts == 1 {
                    force(p, first);
                }
                item += 1;
            }
        }
        let mut i = 0;
        while i < p.items.len() {
            let mut j = i;
            while j < p.items.len() && p.items[j].item == p.items[i].item {
                j += 1;
            }
            let single = j - i == 1;
            let mut any = false;
            for it in &mut p.items[i..j] {
                it.fixed = single;
                any |= it.count() >= it.need;
            }
            if !any {
                return false;
            }
            i = j;
        }
        // Distinct devices: per claim, and the non-admin requests of all claims together.
        for ci in c..self.claims.len() {
            if !self.union_covers(p, |it| it.claim == ci) || !hall_covers(p, |it| it.claim == ci) {
                return false;
            }
        }
        if self.claims.len() > c + 1
            && (!self.union_covers(p, |it| !it.admin) || !hall_covers(p, |it| !it.admin))
        {
            return false;
        }
        for ci in c..self.claims.len() {
            for ki in 0..self.cons[ci].len() {
                let ok = match &self.cons[ci][ki].kind {
                    ConsKind::Match { n, .. } => *n > 0 || self.some_value_fits(p, ci, ki),
                    ConsKind::Distinct { .. } => self.enough_distinct(p, ci, ki),
                };
                if !ok {
                    return false;
                }
            }
        }
        for ci in c..self.claims.len() {
            if !self.match_and_distinct_compatible(p, ci) {
                return false;
            }
        }
        for g in 0..p.joint.len() {
            let joint = &p.joint[g];
            let open = joint.claim >= c
                && joint.members.iter().all(|&ki| {
                    matches!(
                        self.cons[joint.claim][ki].kind,
                        ConsKind::Match { n: 0, .. }
                    )
                });
            if open && !self.some_tuple_fits(p, g) {
                return false;
            }
        }
        p.keys.is_empty() || counters_cover(p)
    }

    /// The requests selected by `pick` have enough distinct candidates together: each needs
    /// at least its smallest usable alternative's count, from its alternatives' candidates.
    fn union_covers(&self, p: &mut Pruner, pick: impl Fn(&ItemAlt) -> bool) -> bool {
        let epoch = p.next_epoch();
        let (mut single, mut shared, mut need, mut members) = (0usize, 0usize, 0usize, 0usize);
        let mut i = 0;
        while i < p.items.len() {
            let item = p.items[i].item;
            let mut least = usize::MAX;
            while i < p.items.len() && p.items[i].item == item {
                let (lo, hi, it_need) = (p.items[i].lo, p.items[i].hi, p.items[i].need);
                if pick(&p.items[i]) && hi - lo >= it_need {
                    least = least.min(it_need);
                    for x in lo..hi {
                        let d = p.buf[x] as usize;
                        if p.mark[d] != epoch {
                            p.mark[d] = epoch;
                            if p.multi[d] {
                                shared += 1;
                            } else {
                                single += 1;
                            }
                        }
                    }
                }
                i += 1;
            }
            if least != usize::MAX {
                need += least;
                members += 1;
            }
        }
        single + shared.saturating_mul(members) >= need
    }

    /// `matchAttribute` `ki` of claim `ci`, no reference yet: some value has enough
    /// candidates for each request it constrains, and for its fixed requests together.
    fn some_value_fits(&self, p: &mut Pruner, ci: usize, ki: usize) -> bool {
        let vals = std::mem::take(&mut p.vals[ci][ki]);
        let nv = p.nvals[ci][ki];
        let fits = self.value_fits(p, ci, ki, &vals, nv);
        p.vals[ci][ki] = vals;
        fits
    }

    /// Devices under both a `matchAttribute` and a `distinctAttribute` on one attribute
    /// must be equal and different there: at most one device of claim `ci`'s remaining
    /// requests (each at its smallest alternative) can be under both.
    fn match_and_distinct_compatible(&self, p: &Pruner, ci: usize) -> bool {
        let cons = &self.cons[ci];
        for (ki, m) in cons.iter().enumerate() {
            if !matches!(m.kind, ConsKind::Match { .. }) {
                continue;
            }
            for (kj, d) in cons.iter().enumerate() {
                if !matches!(d.kind, ConsKind::Distinct { .. }) || d.attr != m.attr {
                    continue;
                }
                let mut both = 0usize;
                let mut i = 0;
                while i < p.items.len() {
                    let item = p.items[i].item;
                    let mut least = usize::MAX;
                    while i < p.items.len() && p.items[i].item == item {
                        let it = &p.items[i];
                        let under = it.claim == ci
                            && p.applies[it.gi].contains(&ki)
                            && p.applies[it.gi].contains(&kj);
                        least = least.min(if under { it.need } else { 0 });
                        i += 1;
                    }
                    both += least;
                }
                if both >= 2 {
                    return false;
                }
            }
        }
        true
    }

    /// Joint group `g`, none of its constraints with a reference yet: some tuple of values
    /// has enough candidates, as [`Self::some_value_fits`] asks of one value.
    fn some_tuple_fits(&self, p: &mut Pruner, g: usize) -> bool {
        let vals = std::mem::take(&mut p.joint[g].vals);
        let (ci, ki, nv) = (p.joint[g].claim, p.joint[g].members[0], p.joint[g].nvals);
        let fits = self.value_fits(p, ci, ki, &vals, nv);
        p.joint[g].vals = vals;
        fits
    }

    /// Some value of `vals` (`nv` of them) serves every alternative that constraint `ki` of
    /// claim `ci` applies to.
    fn value_fits(&self, p: &mut Pruner, ci: usize, ki: usize, vals: &[u32], nv: usize) -> bool {
        // With no value at all, only requests that need no device can be served.
        let nv = nv.max(1);
        let constrained: Vec<usize> = (0..p.items.len())
            .filter(|&i| p.items[i].claim == ci && p.applies[p.items[i].gi].contains(&ki))
            .collect();
        if constrained.is_empty() {
            return true;
        }
        // hist[j * nv + v]: candidates of constrained alternative j with value v; the last
        // row counts the fixed ones' union.
        let rows = constrained.len() + 1;
        p.hist.clear();
        p.hist.resize(rows * nv, 0);
        let fixed_n = constrained.iter().filter(|&&i| p.items[i].fixed).count();
        let mut union_need = 0usize;
        let epoch = p.next_epoch();
        for (j, &i) in constrained.iter().enumerate() {
            let it = &p.items[i];
            if it.fixed {
                union_need += it.need;
            }
            for &d in &p.buf[it.lo..it.hi] {
                let v = vals[d as usize] as usize;
                p.hist[j * nv + v] += 1;
                if it.fixed && p.mark[d as usize] != epoch {
                    p.mark[d as usize] = epoch;
                    let w = if p.multi[d as usize] { fixed_n } else { 1 };
                    p.hist[(rows - 1) * nv + v] += w as u32;
                }
            }
        }
        'value: for v in 0..nv {
            if (p.hist[(rows - 1) * nv + v] as usize) < union_need {
                continue;
            }
            // Every request of the claim with a constrained alternative can be served by one
            // of its alternatives under this value.
            let mut i = 0;
            while i < p.items.len() {
                let item = p.items[i].item;
                let mut j = i;
                let mut touched = false;
                let mut served = false;
                while j < p.items.len() && p.items[j].item == item {
                    let it = &p.items[j];
                    if it.claim == ci {
                        match constrained.iter().position(|&x| x == j) {
                            Some(row) => {
                                touched = true;
                                served |= p.hist[row * nv + v] as usize >= it.need;
                            }
                            None => served |= it.count() >= it.need,
                        }
                    }
                    j += 1;
                }
                if touched && !served {
                    continue 'value;
                }
                i = j;
            }
            return true;
        }
        false
    }

    /// `distinctAttribute` `ki` of claim `ci`: enough distinct unused values for each request
    /// it constrains, and for its fixed requests together.
    fn enough_distinct(&self, p: &mut Pruner, ci: usize, ki: usize) -> bool {
        let vals = std::mem::take(&mut p.vals[ci][ki]);
        let enough = self.distinct_values(p, ci, ki, &vals);
        p.vals[ci][ki] = vals;
        enough
    }

    fn distinct_values(&self, p: &mut Pruner, ci: usize, ki: usize, vals: &[u32]) -> bool {
        let nv = p.nvals[ci][ki];
        p.hist.clear();
        p.hist.resize(nv, 0);
        let mut stamp = 0u32;
        let distinct = |p: &mut Pruner, ranges: &[(usize, usize)], stamp: u32| -> usize {
            let mut n = 0;
            for &(lo, hi) in ranges {
                for x in lo..hi {
                    let v = vals[p.buf[x] as usize] as usize;
                    if p.hist[v] != stamp {
                        p.hist[v] = stamp;
                        n += 1;
                    }
                }
            }
            n
        };
        // Together: each request constrained by it needs at least its smallest usable
        // alternative's count (0 for an alternative it does not constrain) of distinct values,
        // from its constrained alternatives' candidates.
        let mut ranges = Vec::new();
        let (mut joint_need, mut joint_items) = (0usize, 0usize);
        let mut i = 0;
        while i < p.items.len() {
            let item = p.items[i].item;
            let mut j = i;
            let mut touched = false;
            let mut served = false;
            let mut least = usize::MAX;
            while j < p.items.len() && p.items[j].item == item {
                let (claim, gi, lo, hi, need) = {
                    let it = &p.items[j];
                    (it.claim, it.gi, it.lo, it.hi, it.need)
                };
                if claim == ci {
                    if p.applies[gi].contains(&ki) {
                        touched = true;
                        stamp += 1;
                        let ok = distinct(p, &[(lo, hi)], stamp) >= need;
                        served |= ok;
                        ranges.push((lo, hi));
                        if ok {
                            least = least.min(need);
                        }
                    } else if hi - lo >= need {
                        served = true;
                        least = 0;
                    }
                }
                j += 1;
            }
            if touched && !served {
                return false;
            }
            if touched {
                joint_need += least;
                joint_items += 1;
            }
            i = j;
        }
        stamp += 1;
        joint_items < 2 || distinct(p, &ranges, stamp) >= joint_need
    }
}

/// Hall's condition on nested candidate sets: for each fixed request selected by `pick`,
/// the requests whose candidates all lie within its candidates fit there together (devices
/// of different classes make such nests: NIC requests cannot spill onto GPUs).
/// Request `i` (of one alternative) has exactly as many candidates as it needs: past it,
/// every one of them is in use, so a later request never evaluates its selectors there.
fn force(p: &mut Pruner, i: usize) {
    let it = &p.items[i];
    let (lo, hi) = (it.lo, it.hi);
    if it.need == 0 || it.count() != it.need || p.buf[lo..hi].iter().any(|&d| p.multi[d as usize]) {
        return;
    }
    for j in lo..hi {
        let d = p.buf[j] as usize;
        p.forced[d] = p.forced_epoch;
    }
}

fn hall_covers(p: &Pruner, pick: impl Fn(&ItemAlt) -> bool) -> bool {
    let fixed = || p.items.iter().filter(|it| it.fixed && pick(it));
    if fixed().nth(2).is_none() {
        // One request is the per-request count; two are the union.
        return true;
    }
    for outer in fixed() {
        let within = &p.buf[outer.lo..outer.hi];
        let (mut need, mut members) = (0usize, 0usize);
        for inner in fixed() {
            if sorted_subset(&p.buf[inner.lo..inner.hi], within) {
                need += inner.need;
                members += 1;
            }
        }
        if members < 2 {
            continue;
        }
        let shared = within.iter().filter(|&&d| p.multi[d as usize]).count();
        if within.len() - shared + shared.saturating_mul(members) < need {
            return false;
        }
    }
    true
}

/// Every element of ascending `a` is in ascending `b`.
fn sorted_subset(a: &[u32], b: &[u32]) -> bool {
    if a.len() > b.len() {
        return false;
    }
    let mut rest = b.iter();
    a.iter().all(|x| rest.by_ref().any(|y| y == x))
}

/// Each request's cheapest devices, summed over the requests, fit the counters left.
fn counters_cover(p: &mut Pruner) -> bool {
    let nk = p.keys.len();
    p.lb.clear();
    p.lb.resize(nk, 0);
    let mut i = 0;
    while i < p.items.len() {
        let item = p.items[i].item;
        let mut j = i;
        // Minimum over the request's alternatives of each alternative's lower bound.
        p.lb_alt.clear();
        p.lb_alt.resize(nk, i128::MAX);
        while j < p.items.len() && p.items[j].item == item {
            let (lo, hi, need) = (p.items[j].lo, p.items[j].hi, p.items[j].need);
            j += 1;
            if hi - lo < need {
                continue;
            }
            // Candidates drawing on each key; the others cost nothing there.
            p.hits.clear();
            p.hits.resize(nk, 0);
            for x in lo..hi {
                let d = p.buf[x] as usize;
                if !p.multi[d] {
                    for (k, a) in &p.dev_use[d] {
                        if *a > 0 {
                            p.hits[*k] += 1;
                        }
                    }
                }
            }
            for key in 0..nk {
                let free = (hi - lo) - p.hits[key];
                let bound = if free >= need {
                    0
                } else {
                    p.amounts.clear();
                    for x in lo..hi {
                        let a = p.amount(p.buf[x] as usize, key);
                        if a > 0 {
                            p.amounts.push(a);
                        }
                    }
                    p.amounts.sort_unstable();
                    p.amounts.iter().take(need - free).sum()
                };
                p.lb_alt[key] = p.lb_alt[key].min(bound);
            }
        }
        for key in 0..nk {
            if p.lb_alt[key] != i128::MAX {
                p.lb[key] += p.lb_alt[key];
            }
        }
        i = j;
    }
    // A key already overspent (by allocations outside this pod) blocks every device drawing
    // on it, which `usable` accounts for; requests that need none of it still fit.
    (0..nk).all(|key| p.lb[key] == 0 || p.lb[key] <= p.rem[key])
}
