//! Assumed (in-flight) workloads: replicas already assigned to a cluster but not yet bound
//! to nodes, deducted first-fit before an estimate as Karmada deducts them, with their device
//! allocations when they carry claims, and the free capacity of a node after those deductions.

use std::sync::Arc;

use crate::filter::NodeClaim;
use crate::fit::{AssumedDevices, DeviceQuery};
use crate::hash::FastMap;
use crate::overlay::Overlay;
use crate::resources::{ResList, ResName};
use crate::view::{ClusterView, NodeEntry, ViewStamp};

/// Where one cluster's first-fit deductions end ([`crate::Estimator::deduction_reach`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reach {
    /// The last node (in name order) any replica was deducted from; `None`: none was.
    pub last: Option<Arc<str>>,
    /// Replicas that fit nowhere.
    pub unplaced: i64,
}

impl Reach {
    /// Whether a change of `node` leaves every first-fit of these deductions as it was
    /// whatever it changed: every replica was placed, all of them before `node`, so no
    /// first-fit reached it with replicas left.
    pub fn passes(&self, node: &str) -> bool {
        self.unplaced == 0 && self.last.as_deref().is_none_or(|l| node > l)
    }
}
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

    /// [`AssumedWorkload::from_workload`] of a shared workload, which its device claims
    /// then share instead of copying it.
    pub fn from_shared(cluster: &str, w: &Arc<Workload>, replicas: i64) -> AssumedWorkload {
        AssumedWorkload {
            cluster: cluster.to_string(),
            requests: w.requests.clone(),
            node_claim: w.node_claim.clone(),
            replicas,
            claims: w.needs_devices().then(|| w.clone()),
        }
    }
}

/// A cluster's assumed workloads in deduction order, each shared: extending a list copies
/// pointers, not workloads.
pub type AssumedList = Arc<[Arc<AssumedWorkload>]>;

/// Assumed workloads by cluster, each cluster's in deduction order. Cheap to clone (the map
/// is shared until changed, each cluster's list is shared), and an estimator that saw a list
/// before recognizes it by pointer without comparing its entries.
#[derive(Debug, Clone, Default)]
pub struct Assumed {
    by_cluster: Arc<std::collections::BTreeMap<Arc<str>, AssumedList>>,
}

impl Assumed {
    /// The assumed workloads of `cluster`, in deduction order (empty when none).
    pub fn cluster(&self, cluster: &str) -> &[Arc<AssumedWorkload>] {
        self.by_cluster.get(cluster).map_or(&[], |l| l)
    }

    /// The shared list of `cluster`, when it has one.
    pub(crate) fn shared(&self, cluster: &str) -> Option<&AssumedList> {
        self.by_cluster.get(cluster)
    }

    /// Replaces the list of `cluster` (removes it when `list` is empty). Every entry must
    /// name `cluster`.
    pub fn set(&mut self, cluster: &str, list: AssumedList) {
        debug_assert!(list.iter().all(|a| a.cluster == cluster));
        let by = Arc::make_mut(&mut self.by_cluster);
        if list.is_empty() {
            by.remove(cluster);
        } else if let Some(l) = by.get_mut(cluster) {
            *l = list;
        } else {
            by.insert(Arc::from(cluster), list);
        }
    }

    /// Appends `a` to its cluster's list.
    pub fn push(&mut self, a: AssumedWorkload) {
        let list = Arc::make_mut(&mut self.by_cluster)
            .entry(Arc::from(a.cluster.as_str()))
            .or_default();
        let mut v = list.to_vec();
        v.push(Arc::new(a));
        *list = v.into();
    }

    /// Every assumed workload, cluster by cluster in name order.
    pub fn iter(&self) -> impl Iterator<Item = &AssumedWorkload> {
        self.by_cluster
            .values()
            .flat_map(|l| l.iter().map(|a| &**a))
    }

    /// True when there is none.
    pub fn is_empty(&self) -> bool {
        self.by_cluster.is_empty()
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.by_cluster.values().map(|l| l.len()).sum()
    }
}

impl From<Vec<AssumedWorkload>> for Assumed {
    /// Groups by cluster, keeping the order within each cluster.
    fn from(list: Vec<AssumedWorkload>) -> Assumed {
        let mut by: std::collections::BTreeMap<Arc<str>, Vec<Arc<AssumedWorkload>>> =
            std::collections::BTreeMap::new();
        for a in list {
            by.entry(Arc::from(a.cluster.as_str()))
                .or_default()
                .push(Arc::new(a));
        }
        Assumed {
            by_cluster: Arc::new(by.into_iter().map(|(c, l)| (c, l.into())).collect()),
        }
    }
}

impl FromIterator<AssumedWorkload> for Assumed {
    fn from_iter<I: IntoIterator<Item = AssumedWorkload>>(iter: I) -> Assumed {
        Assumed::from(iter.into_iter().collect::<Vec<_>>())
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

/// What the assumed workloads of one cluster take, built one workload at a time
/// ([`Deductions::add`]) in their deduction order.
#[derive(Debug, Default)]
pub(crate) struct Deductions {
    /// node -> requests and pod slots held.
    pub res: FastMap<Arc<str>, (ResList, i64)>,
    /// The device state with the assumed replicas' allocations, once a workload with
    /// claims was placed.
    held: Option<AssumedDevices>,
    /// Replicas that fit nowhere (not deducted).
    pub unplaced: i64,
    /// What each [`Deductions::add`] did, in order, so the last ones can be undone.
    undo: Vec<Undo>,
}

/// What one [`Deductions::add`] did.
#[derive(Debug, Default)]
struct Undo {
    /// Nodes deducted from, with the replicas each took.
    takes: Vec<(Arc<str>, i64)>,
    /// Requests of one replica.
    requests: ResList,
    /// Replicas that fit nowhere.
    unplaced: i64,
    /// Device allocations the replicas hold.
    allocations: Vec<dramesh_model::k8s::AllocationResult>,
    /// Whether one of them allocated a shared claim (not undone: see
    /// [`crate::fit::DeviceQuery::take_placed`]).
    shared_claim: bool,
}

/// Where first-fit of one workload shape may start: every node before it is known to take
/// no replica of that shape. Deductions only grow, so what takes none now never takes one
/// later in the same [`Deductions`].
#[derive(Debug, Clone)]
pub(crate) enum FirstFit {
    /// No node before this one takes a replica.
    From(Arc<str>),
    /// No node takes a replica.
    Full,
}

impl Deductions {
    /// The device state holding the assumed replicas' allocations; `None` while no assumed
    /// replica holds a device.
    pub(crate) fn take_devices(&mut self) -> Option<AssumedDevices> {
        if self
            .held
            .as_ref()
            .is_some_and(AssumedDevices::holds_devices)
        {
            self.held.take()
        } else {
            None
        }
    }

    /// Where these deductions end; `None` once a replica holds a device not local to its
    /// node (then every node's answer depends on every deduction).
    pub(crate) fn reach(&self) -> Option<Reach> {
        if self.held.as_ref().is_some_and(AssumedDevices::holds_shared) {
            return None;
        }
        Some(Reach {
            last: self.res.keys().max().cloned(),
            unplaced: self.unplaced,
        })
    }

    /// Where each deduction added ends, in order, from the `start`th on; `None` once a
    /// replica holds a device not local to its node.
    pub(crate) fn reaches_from(&self, start: usize) -> Option<Vec<Reach>> {
        self.reach()?;
        Some(
            self.undo
                .iter()
                .skip(start)
                .map(|u| Reach {
                    last: u.takes.iter().map(|(n, _)| n).max().cloned(),
                    unplaced: u.unplaced,
                })
                .collect(),
        )
    }

    /// Gives back what [`Deductions::take_devices`] took.
    pub(crate) fn put_devices(&mut self, held: Option<AssumedDevices>) {
        if held.is_some() {
            self.held = held;
        }
    }

    /// Karmada's first-fit deduction of one assumed workload after those already added:
    /// node by node in name order (from `start`), each takes as many replicas as fit. A
    /// replica of a workload with device claims fits a node when its requests fit and the
    /// engine allocates its claims there against the state holding every replica placed
    /// before it (on any node), the same count [`DeviceQuery::fit`] makes for the workload
    /// estimated; its allocation then stays for later replicas and the estimate. Without
    /// claims, replicas are deducted by requests and pod slots only. A workload whose
    /// devices cannot be evaluated in the cluster (a shared claim is missing, the cluster's
    /// version is invalid, the engine rejects the claims) places nothing.
    ///
    /// `touched` is called with each node deducted from. Returns where first-fit of the same
    /// shape may start next time.
    pub(crate) fn add(
        &mut self,
        c: &ClusterView,
        a: &AssumedWorkload,
        overlay: Option<&Overlay>,
        max_steps: Option<u64>,
        start: Option<&FirstFit>,
        touched: &mut dyn FnMut(&Arc<str>),
    ) -> FirstFit {
        let mut undo = Undo {
            requests: a.requests.clone(),
            ..Undo::default()
        };
        let next = 'place: {
            let from = match start {
                Some(FirstFit::Full) => {
                    undo.unplaced = a.replicas.max(0);
                    break 'place FirstFit::Full;
                }
                Some(FirstFit::From(n)) => Some(n.clone()),
                None => None,
            };
            let mut remaining = a.replicas.max(0);
            let mut devq = None;
            if let Some(dw) = a.claims.as_deref() {
                self.held
                    .get_or_insert_with(|| AssumedDevices::start(c, overlay));
                match DeviceQuery::prepare(c, dw, overlay, None, &mut self.held, max_steps) {
                    Ok(q) => devq = q,
                    Err(_) => {
                        undo.unplaced = remaining;
                        break 'place start.cloned().unwrap_or(FirstFit::Full);
                    }
                }
            }
            let nodes: Box<dyn Iterator<Item = &NodeEntry>> = match &from {
                Some(n) => Box::new(
                    c.nodes
                        .range::<str, _>((
                            std::ops::Bound::Included(&**n),
                            std::ops::Bound::Unbounded,
                        ))
                        .map(|(_, v)| v),
                ),
                None => Box::new(c.nodes.values()),
            };
            // The first node not proven to take none of this shape.
            let mut next: Option<Arc<str>> = None;
            for node in nodes {
                if remaining <= 0 {
                    next.get_or_insert_with(|| node.name.clone());
                    break;
                }
                if a.node_claim.check(&node.facts()).is_err() {
                    continue;
                }
                let free = node_free(c, node, overlay, Some(&self.res));
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
                        // A give-up places what was found before it; the rest stays unplaced. A
                        // smaller state may not give up, so the node is not proven full.
                        Ok(fit) => {
                            if fit.gave_up {
                                next.get_or_insert_with(|| node.name.clone());
                            }
                            take = fit.replicas;
                        }
                        // The claims cannot be allocated anywhere: no further node either.
                        Err(_) => {
                            next.get_or_insert_with(|| node.name.clone());
                            break;
                        }
                    }
                    if take <= 0 {
                        continue;
                    }
                }
                next.get_or_insert_with(|| node.name.clone());
                let e = self.res.entry(node.name.clone()).or_default();
                e.0.add_all(&a.requests.scaled(take));
                e.1 += take;
                touched(&node.name);
                undo.takes.push((node.name.clone(), take));
                remaining -= take;
            }
            if let Some(mut q) = devq {
                (undo.allocations, undo.shared_claim) = q.take_placed();
                self.held = q.into_assumed();
            }
            undo.unplaced = remaining;
            next.map_or(FirstFit::Full, FirstFit::From)
        };
        self.unplaced = self.unplaced.saturating_add(undo.unplaced);
        self.undo.push(undo);
        next
    }

    /// Undoes the last [`Deductions::add`], calling `touched` with each node it deducted
    /// from; false (nothing undone) when there is none or it allocated a shared claim.
    pub(crate) fn undo_last(&mut self, touched: &mut dyn FnMut(&Arc<str>)) -> bool {
        if self.undo.last().is_none_or(|u| u.shared_claim) {
            return false;
        }
        let Some(u) = self.undo.pop() else {
            return false;
        };
        for (node, take) in &u.takes {
            if let Some(e) = self.res.get_mut(node) {
                e.0.sub_all(&u.requests.scaled(*take));
                e.1 -= take;
                if e.1 <= 0 {
                    self.res.remove(node);
                }
            }
            touched(node);
        }
        if !u.allocations.is_empty()
            && let Some(held) = self.held.as_mut()
        {
            held.release(&u.allocations);
            for (node, take) in &u.takes {
                held.unhold(node, *take);
            }
        }
        self.unplaced -= u.unplaced;
        true
    }
}

/// [`Deductions::add`] of each of `assumed` in `c`, in order.
pub(crate) fn assumed_deductions(
    c: &ClusterView,
    assumed: &Assumed,
    overlay: Option<&Overlay>,
    max_steps: Option<u64>,
) -> Deductions {
    let mut d = Deductions::default();
    for a in assumed.cluster(&c.name) {
        d.add(c, a, overlay, max_steps, None, &mut |_| {});
    }
    d
}

/// True when `a` and `b` deduct the same: same cluster, replicas, requests, node claim and
/// device claims (by workload fingerprint, which covers everything that affects fit).
fn same_deduction(a: &Arc<AssumedWorkload>, b: &Arc<AssumedWorkload>) -> bool {
    Arc::ptr_eq(a, b)
        || a.cluster == b.cluster
            && a.replicas == b.replicas
            && a.requests == b.requests
            && a.node_claim == b.node_claim
            && match (&a.claims, &b.claims) {
                (None, None) => true,
                (Some(x), Some(y)) => Arc::ptr_eq(x, y) || x.fingerprint == y.fingerprint,
                _ => false,
            }
}

/// The key of `a`'s shape for [`FirstFit`]: equal keys take the same per node. `None` for
/// workloads without device claims (their first-fit reads only requests, which is cheap).
fn shape_key(a: &AssumedWorkload) -> Option<u64> {
    let w = a.claims.as_deref()?;
    (a.node_claim == w.node_claim && a.requests == w.requests).then_some(w.fingerprint)
}

/// One cluster's deductions kept between estimates, extended when the assumed list grows at
/// its end, carried over a view change that moves no first-fit it made
/// ([`DeductionLog::carries_to`]), and built again when anything else changed (the view, an
/// earlier entry).
///
/// A build is numbered; each extension is an epoch, and every node it deducted from is
/// logged with it, so a memo made at (build, epoch) is brought up to date by revisiting
/// the nodes logged after its epoch.
#[derive(Debug)]
pub(crate) struct DeductionLog {
    stamp: ViewStamp,
    max_steps: Option<u64>,
    /// Unique per build among an estimator's logs; never 0 (a memo without deductions).
    pub(crate) build: u64,
    /// The current epoch.
    pub(crate) epoch: u64,
    placed: Vec<Arc<AssumedWorkload>>,
    /// The list `placed` was last extended to: the same list again needs no comparison.
    last: Option<AssumedList>,
    pub(crate) ded: Deductions,
    /// (epoch, node deducted from), in epoch order.
    touched: Vec<(u64, Arc<str>)>,
    /// Where first-fit of each device-claiming shape may start.
    cursors: FastMap<u64, FirstFit>,
}

impl DeductionLog {
    /// An empty log of `c` as it is now.
    pub(crate) fn new(c: &ClusterView, max_steps: Option<u64>, build: u64) -> DeductionLog {
        DeductionLog {
            stamp: c.stamp(),
            max_steps,
            build,
            epoch: 0,
            placed: Vec::new(),
            last: None,
            ded: Deductions::default(),
            touched: Vec::new(),
            cursors: FastMap::default(),
        }
    }

    /// Whether extending this log gives the deductions of `list` in `c`: built on the same
    /// budget, what it placed is a prefix of `list`, and built on the same view of `c`, or on
    /// one whose changes since leave every first-fit it made as it was, in which case the log
    /// now counts as built on `c` as it is. A changed node leaves them when it leaves the
    /// fit of everything placed as it was ([`NodeChange::leaves_fits`]), or when it comes
    /// after every node deducted from and every replica was placed (no first-fit reached it
    /// with replicas left). Then first-fit places the same replicas on the same nodes, so the
    /// deductions, the device allocations and the first-fit cursors (each at or before the
    /// last node deducted from, or the first node) are those a build on `c` would make.
    pub(crate) fn carries_to(
        &mut self,
        c: &ClusterView,
        list: &AssumedList,
        max_steps: Option<u64>,
    ) -> bool {
        if self.max_steps != max_steps {
            return false;
        }
        if !self.is_prefix_of(list) {
            // Another list with the same start (a resolution checking again from a changed
            // rank): the entries after the common part are undone, then `list`'s placed.
            let same = self
                .placed
                .iter()
                .zip(list.iter())
                .take_while(|(a, b)| same_deduction(a, b))
                .count();
            if same == 0 || !self.truncate(same) {
                return false;
            }
        }
        let now = c.stamp();
        if self.stamp == now {
            return true;
        }
        let Some(reach) = self.ded.reach() else {
            return false;
        };
        let Some(changes) = c.node_changes_since(&self.stamp) else {
            return false;
        };
        let Some(claims) = crate::view::judged_node_claims(self.placed.iter().map(|a| {
            let shared = a
                .claims
                .as_ref()
                .is_some_and(|w| !w.shared_claims.is_empty());
            (&a.node_claim, shared)
        })) else {
            return false;
        };
        if !changes
            .iter()
            .all(|ch| ch.leaves_fits(c, &claims) || reach.passes(&ch.node))
        {
            return false;
        }
        self.stamp = now;
        true
    }

    /// Undoes the placed entries after the first `keep`, in a new epoch that logs the
    /// nodes they deducted from (so memos count those nodes again); false when one of them
    /// cannot be undone (it allocated a shared claim), or a device not local to its node is
    /// held: the log must then be built again. Undone in reverse order, each undo gives back
    /// exactly what its first-fit took, so the deductions are those of the first `keep`
    /// entries placed alone; the first-fit cursors are dropped (nodes may take replicas
    /// again), which changes where first-fit starts looking, not what it places.
    fn truncate(&mut self, keep: usize) -> bool {
        if self.ded.reach().is_none()
            || self.ded.undo.len() != self.placed.len()
            || self.ded.undo[keep..].iter().any(|u| u.shared_claim)
        {
            return false;
        }
        self.epoch += 1;
        let epoch = self.epoch;
        let touched = &mut self.touched;
        while self.placed.len() > keep {
            if !self
                .ded
                .undo_last(&mut |n| touched.push((epoch, n.clone())))
            {
                return false;
            }
            self.placed.pop();
        }
        self.cursors.clear();
        self.last = None;
        true
    }

    /// Whether what this log placed is a prefix of `list`.
    fn is_prefix_of(&self, list: &AssumedList) -> bool {
        self.last.as_ref().is_some_and(|l| Arc::ptr_eq(l, list))
            || (self.placed.len() <= list.len()
                && self
                    .placed
                    .iter()
                    .zip(list.iter())
                    .all(|(a, b)| same_deduction(a, b)))
    }

    /// Records that what is placed is all of `list`.
    pub(crate) fn reached(&mut self, list: &AssumedList) {
        self.last = Some(list.clone());
    }

    /// How many entries of the list are deducted.
    pub(crate) fn placed(&self) -> usize {
        self.placed.len()
    }

    /// Starts a new epoch (call once before the [`DeductionLog::add`]s of one extension).
    pub(crate) fn next_epoch(&mut self) {
        self.epoch += 1;
    }

    /// Deducts `a` after everything placed so far, in the current epoch.
    pub(crate) fn add(&mut self, c: &ClusterView, a: &Arc<AssumedWorkload>) {
        let key = shape_key(a);
        let start = key.and_then(|k| self.cursors.get(&k));
        let epoch = self.epoch;
        let touched = &mut self.touched;
        let next = self.ded.add(c, a, None, self.max_steps, start, &mut |n| {
            touched.push((epoch, n.clone()))
        });
        if let Some(k) = key {
            self.cursors.insert(k, next);
        }
        self.placed.push(a.clone());
    }

    /// Nodes deducted from after `epoch` (with repeats).
    pub(crate) fn touched_since(&self, epoch: u64) -> impl Iterator<Item = &Arc<str>> {
        self.touched
            .iter()
            .rev()
            .take_while(move |(e, _)| *e > epoch)
            .map(|(_, n)| n)
    }
}
