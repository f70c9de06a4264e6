//! The in-memory, indexed view of member clusters that estimation, placement and
//! preemption read.
//!
//! The view is fed one object at a time ([`View::apply`] / [`View::apply_object`]) so a
//! replication stream can keep it current: a node, pod, slice or claim change touches only
//! the indexes of that object (the node's usage, the node's device shape) and bumps the
//! generation of what it touched, which is what result caches key on. Pods are kept in a
//! compact form (requests, priority, owner, claim names, and handles through which the
//! current allocations of those claims are read); terminal pods and pods not bound to a node
//! do not count against capacity, as in Karmada's estimator.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use dramesh_model::k8s::{Node, Pod, ResourceClaimTemplate, Taint};
use dramesh_model::karpenter::{NodeClaim, NodePool};
use dramesh_model::{ClusterInfo, ClusterObject, ObjectChange, ObjectKey, ObjectKind};

use crate::cluster_devices::{CHANGE_LOG, ClaimHandle, ClusterDevices};
use crate::filter::{NodeClaim as PodNodeClaim, NodeFacts};
use crate::hash::FastMap;
use crate::resources::{ResList, ResName, pod_requests};

/// A replicated change with its object decoded: what [`View::apply_decoded`] takes. Decoding
/// needs no view, so a caller can decode before taking the lock its view is behind.
#[derive(Debug, Clone)]
pub enum Decoded {
    /// The object, created or replaced.
    Upsert(ClusterObject),
    /// The key of the object deleted.
    Delete(ObjectKey),
}

/// Decodes the object of a replicated change of `cluster`, checking that it is the object its
/// key names.
pub fn decode(cluster: &str, change: &ObjectChange) -> Result<Decoded, ApplyError> {
    match change {
        ObjectChange::Upsert { key, json } => {
            let obj = ClusterObject::from_json(key.kind, json).map_err(|e| ApplyError::Decode {
                cluster: cluster.to_string(),
                key: key.clone(),
                message: e.to_string(),
            })?;
            let got = obj.key();
            if &got != key && key.kind != ObjectKind::ClusterInfo {
                return Err(ApplyError::Invalid {
                    cluster: cluster.to_string(),
                    key: key.clone(),
                    message: format!("object inside the change is {got}"),
                });
            }
            Ok(Decoded::Upsert(obj))
        }
        ObjectChange::Delete { key } => Ok(Decoded::Delete(key.clone())),
    }
}

/// Why a change could not be applied. The view is unchanged when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The change's JSON is not a valid object of its kind.
    #[error("cluster {cluster}: cannot decode {key}: {message}")]
    Decode {
        /// Cluster of the change.
        cluster: String,
        /// Key of the change.
        key: ObjectKey,
        /// What is wrong.
        message: String,
    },
    /// The object decodes but cannot be used (wrong key, bad quantity, ...).
    #[error("cluster {cluster}: {key}: {message}")]
    Invalid {
        /// Cluster of the change.
        cluster: String,
        /// Key of the change.
        key: ObjectKey,
        /// What is wrong.
        message: String,
    },
}

/// The workload a pod belongs to: its controller, with ReplicaSets of Deployments folded
/// into the Deployment (by the `pod-template-hash` suffix), or the pod itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct Owner {
    /// Namespace of the workload.
    pub namespace: String,
    /// Controller kind (`Deployment`, `StatefulSet`, ..., or `Pod`).
    pub kind: String,
    /// Controller name.
    pub name: String,
}

/// A pod as the view keeps it.
#[derive(Debug, Clone)]
pub struct PodEntry {
    /// The node the pod is bound to, if any.
    pub node: Option<Arc<str>>,
    /// Shared between pods with equal requests (most pods of a workload).
    pub requests: Arc<ResList>,
    /// `spec.priority`.
    pub priority: i32,
    /// The workload the pod belongs to.
    pub owner: Arc<Owner>,
    /// Names of the ResourceClaims the pod uses (named claims and generated ones from status).
    pub claims: Vec<String>,
    /// Handles of `claims`, index for index, through which preemption reads a pod's
    /// current claim allocations without looking the claims up by name.
    pub(crate) claim_handles: ClaimHandles,
    /// Counted against its node: bound and not Succeeded/Failed.
    pub active: bool,
}

/// One handle per claim of a pod. The first is kept inline: most pods use one claim, and
/// preemption reads this for every candidate pod.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClaimHandles {
    first: Option<Arc<ClaimHandle>>,
    rest: Vec<Arc<ClaimHandle>>,
}

impl ClaimHandles {
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arc<ClaimHandle>> {
        self.first.iter().chain(&self.rest)
    }
}

impl FromIterator<Arc<ClaimHandle>> for ClaimHandles {
    fn from_iter<I: IntoIterator<Item = Arc<ClaimHandle>>>(iter: I) -> Self {
        let mut it = iter.into_iter();
        ClaimHandles {
            first: it.next(),
            rest: it.collect(),
        }
    }
}

/// A node's static facts.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeEntry {
    /// Node name.
    pub name: Arc<str>,
    /// Node labels.
    pub labels: BTreeMap<String, String>,
    /// Node taints.
    pub taints: Vec<Taint>,
    /// `spec.unschedulable`.
    pub unschedulable: bool,
    /// `status.allocatable` (or capacity).
    pub allocatable: ResList,
}

impl NodeEntry {
    /// The facts node filtering reads.
    pub fn facts(&self) -> NodeFacts<'_> {
        NodeFacts {
            name: &self.name,
            labels: &self.labels,
            taints: &self.taints,
            unschedulable: self.unschedulable,
        }
    }
}

/// Requests of the active pods bound to one node name (kept even before the node exists).
#[derive(Debug, Clone, Default)]
pub struct NodeUsage {
    /// Sum of the requests of the active pods on the node.
    pub requested: ResList,
    /// Number of active pods on the node.
    pub pods: u32,
}

/// Bytes per node, pod, ResourceSlice and ResourceClaim in [`View::estimated_bytes`]: what a
/// replica's resident set grew by per object when it loaded a 5,000-node cluster (the
/// `replica_memory` bench: 68 MiB for the Nodes alone; 498 MiB with 10,000 slices of 8 GPUs
/// or 4 NICs, 10,000 pods and 10,000 allocated claims), view and store together.
pub const VIEW_BYTES_PER: [usize; 4] = [14 << 10, 12 << 10, 20 << 10, 12 << 10];

/// Facts-only node changes whose previous facts a cluster keeps ([`NodeChange`]).
const FACTS_LOG: usize = 128;

/// What a cluster's view was at one moment, as far as estimates of its nodes are concerned
/// ([`ClusterView::stamp`]): equal stamps, equal answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ViewStamp {
    generation: u64,
    dev_counter: u64,
    shared_gen: u64,
    templates: u64,
}

/// A node changed since some [`ViewStamp`] ([`ClusterView::node_changes_since`]).
#[derive(Debug, Clone)]
pub struct NodeChange {
    /// The node's name.
    pub node: Arc<str>,
    /// Its facts at the stamp, when only its labels, taints or `unschedulable` changed since
    /// (its capacity, pods and devices did not).
    before: Option<Arc<NodeEntry>>,
}

impl NodeChange {
    /// Whether the change leaves the node's fit of every workload whose node claim is one of
    /// `claims` as it was, whatever is deducted from it: only its facts changed, and each
    /// claim passes or fails it as before. (For workloads without shared claims, whose
    /// allocations' node selectors are not judged here.)
    pub fn leaves_fits(&self, c: &ClusterView, claims: &[&PodNodeClaim]) -> bool {
        let (Some(old), Some(now)) = (&self.before, c.nodes.get(&self.node)) else {
            return false;
        };
        claims
            .iter()
            .all(|k| k.check(&old.facts()).is_ok() == k.check(&now.facts()).is_ok())
    }
}

/// The distinct node claims of workloads given as (node claim, whether it holds shared
/// claims), for [`NodeChange::leaves_fits`]; `None` when one holds shared claims (their
/// allocations' node selectors may select nodes by label, which is not judged there).
pub(crate) fn judged_node_claims<'a>(
    workloads: impl IntoIterator<Item = (&'a PodNodeClaim, bool)>,
) -> Option<Vec<&'a PodNodeClaim>> {
    let mut claims: Vec<&PodNodeClaim> = Vec::new();
    for (claim, shared) in workloads {
        if shared {
            return None;
        }
        if !claims.contains(&claim) {
            claims.push(claim);
        }
    }
    Some(claims)
}

/// One member cluster.
#[derive(Debug, Default)]
pub struct ClusterView {
    /// Cluster name.
    pub name: String,
    /// What the cluster reported about itself.
    pub info: ClusterInfo,
    pub(crate) nodes: BTreeMap<Arc<str>, NodeEntry>,
    pub(crate) usage: FastMap<Arc<str>, NodeUsage>,
    /// Bumped whenever a node or its usage changes.
    pub(crate) node_gen: FastMap<Arc<str>, u64>,
    pub(crate) pods: FastMap<(String, String), PodEntry>,
    pub(crate) devices: ClusterDevices,
    pub(crate) generation: u64,
    /// Recent node changes (generation, node), so a cached cluster result can be brought up
    /// to date by revisiting only those nodes.
    pub(crate) log: VecDeque<(u64, Arc<str>)>,
    /// Changes at or before this generation may be missing from `log`.
    pub(crate) log_floor: u64,
    /// The last [`FACTS_LOG`] node changes that changed only labels, taints or
    /// `unschedulable`: (generation of the change, the node as it was before), oldest first.
    facts_log: VecDeque<(u64, Arc<NodeEntry>)>,
    /// Bumped when a ResourceClaimTemplate's spec changes (claim references resolve to it).
    templates_gen: u64,
    /// Bumped when a pod's counted facts change.
    pods_gen: u64,
    /// Active pods bound to a node, per owner ([`owner_key`]).
    bound: FastMap<Box<str>, i64>,
    /// Karpenter NodePools and NodeClaims (scale-up headroom reads them; no estimate of the
    /// nodes there now does).
    pub(crate) autoscaling: Autoscaling,
    /// Pods not bound to a node (agents publish those the scheduler could not place).
    pub(crate) unbound_pods: usize,
    /// Interned owners and request lists, so a million pods of a few workloads share them.
    owners: HashSet<Arc<Owner>>,
    request_lists: HashSet<Arc<ResList>>,
    /// ResourceClaimTemplates by (namespace, name), each with a hash of its spec (what a
    /// workload resolving it is cached under).
    pub(crate) claim_templates: BTreeMap<(String, String), (Arc<ResourceClaimTemplate>, u64)>,
}

impl ClusterView {
    fn new(name: &str) -> ClusterView {
        ClusterView {
            name: name.to_string(),
            ..Default::default()
        }
    }

    /// Nodes in name order.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeEntry> {
        self.nodes.values()
    }

    /// A node by name.
    pub fn node(&self, name: &str) -> Option<&NodeEntry> {
        self.nodes.get(name)
    }

    /// Requests bound to a node name.
    pub fn usage(&self, node: &str) -> Option<&NodeUsage> {
        self.usage.get(node)
    }

    /// Every pod, keyed by (namespace, name).
    pub fn pods(&self) -> impl Iterator<Item = (&(String, String), &PodEntry)> {
        self.pods.iter()
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Number of pods.
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// The cluster's device state.
    pub fn devices(&self) -> &ClusterDevices {
        &self.devices
    }

    /// Monotonic change counter of this cluster.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Monotonic counter of changes to the cluster's pods (bound, active, requests, owner,
    /// claims).
    pub fn pods_generation(&self) -> u64 {
        self.pods_gen
    }

    /// Active pods bound to a node whose owner ([`Owner`]) has the key `owner`
    /// ([`owner_key`]).
    pub fn bound_pods(&self, owner: &str) -> i64 {
        self.bound.get(owner).copied().unwrap_or(0)
    }

    /// What the view of this cluster is now, for [`ClusterView::node_changes_since`].
    pub fn stamp(&self) -> ViewStamp {
        ViewStamp {
            generation: self.generation,
            dev_counter: self.devices.counter(),
            shared_gen: self.devices.shared_gen,
            templates: self.templates_gen,
        }
    }

    /// The nodes changed since `since`, each with its facts as they were then when only its
    /// labels, taints or `unschedulable` changed since (see [`NodeChange`]); `None` when
    /// something else changed that estimates read (device classes, node-less slices, claim
    /// templates, the version, a node-less allocation), when the cluster has node-less
    /// ResourceSlices (a label change could bring their devices to a node or take them away),
    /// or when the recorded history does not reach back to `since`. Nothing else a fit of a
    /// node reads can change: a node's answer for a workload without shared claims depends
    /// on that node alone.
    pub fn node_changes_since(&self, since: &ViewStamp) -> Option<Vec<NodeChange>> {
        let now = self.stamp();
        if since.shared_gen != now.shared_gen
            || since.templates != now.templates
            || since.generation > now.generation
            || since.generation < self.log_floor
            || since.dev_counter < self.devices.log_floor
            || self.devices.shared_slices > 0
        {
            return None;
        }
        if *since == now {
            return Some(Vec::new());
        }
        // Per node: its view changes, device changes and recorded facts changes since, and
        // its earliest recorded facts.
        #[derive(Default)]
        struct Seen<'a> {
            views: u32,
            devices: u32,
            facts: u32,
            before: Option<&'a Arc<NodeEntry>>,
        }
        let mut per: FastMap<&Arc<str>, Seen> = FastMap::default();
        for (g, n) in self.log.iter().rev() {
            if *g <= since.generation {
                break;
            }
            per.entry(n).or_default().views += 1;
        }
        for (g, n) in self.devices.log.iter().rev() {
            if *g <= since.dev_counter {
                break;
            }
            per.entry(n).or_default().devices += 1;
        }
        for (g, old) in self.facts_log.iter().rev() {
            if *g <= since.generation {
                break;
            }
            if let Some(p) = per.get_mut(&old.name) {
                p.facts += 1;
                p.before = Some(old);
            }
        }
        let mut out: Vec<NodeChange> = per
            .into_iter()
            .map(|(node, seen)| {
                // Facts-only: every view change of the node is a recorded facts change, and
                // its device changes are only the one each node update makes.
                let facts_only =
                    seen.views > 0 && seen.devices == seen.views && seen.facts == seen.views;
                NodeChange {
                    node: node.clone(),
                    before: seen.before.filter(|_| facts_only).cloned(),
                }
            })
            .collect();
        out.sort_by(|a, b| a.node.cmp(&b.node));
        Some(out)
    }

    /// The cluster's Karpenter NodePools and NodeClaims.
    pub fn autoscaling(&self) -> &Autoscaling {
        &self.autoscaling
    }

    /// Pods the view holds that are not bound to a node (the scheduler could not place them).
    pub fn unbound_pods(&self) -> usize {
        self.unbound_pods
    }

    /// The Kubernetes version the cluster reported.
    pub fn kubernetes_version(&self) -> Option<&str> {
        self.info.kubernetes_version.as_deref()
    }

    /// A ResourceClaimTemplate the cluster publishes.
    pub fn claim_template(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<&Arc<ResourceClaimTemplate>> {
        self.claim_templates
            .get(&(namespace.to_string(), name.to_string()))
            .map(|(t, _)| t)
    }

    /// Number of ResourceClaimTemplates the cluster publishes.
    pub fn claim_template_count(&self) -> usize {
        self.claim_templates.len()
    }

    /// A cluster holding one new, empty node shaped like `node` (see `crate::headroom`): its
    /// labels without `kubernetes.io/hostname`, its taints without the controller-managed
    /// `node.kubernetes.io/` ones and `karpenter.sh/disrupted`, schedulable, its allocatable,
    /// and its node-local devices with nothing allocated. The copy keeps the node's name (its
    /// slices name it), so a workload pinned by `matchFields metadata.name` to that node would
    /// match the copy too. `None` when the node is unknown.
    pub(crate) fn new_node_like(&self, node: &str) -> Option<ClusterView> {
        let src = self.nodes.get(node)?;
        let devices = self.devices.for_new_node(node);
        let name = devices
            .node_key(node)
            .cloned()
            .unwrap_or_else(|| src.name.clone());
        let mut labels = src.labels.clone();
        labels.remove("kubernetes.io/hostname");
        let taints = src
            .taints
            .iter()
            .filter(|t| {
                !t.key.starts_with("node.kubernetes.io/") && t.key != "karpenter.sh/disrupted"
            })
            .cloned()
            .collect();
        let entry = NodeEntry {
            name: name.clone(),
            labels,
            taints,
            unschedulable: false,
            allocatable: src.allocatable.clone(),
        };
        let mut out = ClusterView {
            name: self.name.clone(),
            info: self.info.clone(),
            devices,
            ..ClusterView::default()
        };
        out.nodes.insert(name, entry);
        Some(out)
    }

    fn bump(&mut self, node: &Arc<str>) {
        self.generation += 1;
        let g = self.generation;
        self.log.push_back((g, node.clone()));
        if self.log.len() > CHANGE_LOG
            && let Some((old, _)) = self.log.pop_front()
        {
            self.log_floor = old;
        }
        self.node_gen.insert(node.clone(), g);
    }

    fn interned(&self, name: &str) -> Arc<str> {
        match self.nodes.get_key_value(name) {
            Some((k, _)) => k.clone(),
            None => match self.usage.get_key_value(name) {
                Some((k, _)) => k.clone(),
                None => match self.devices.node_key(name) {
                    Some(k) => k.clone(),
                    None => Arc::from(name),
                },
            },
        }
    }

    fn intern(&mut self, mut entry: PodEntry) -> PodEntry {
        match self.owners.get(&entry.owner) {
            Some(o) => entry.owner = o.clone(),
            None => {
                self.owners.insert(entry.owner.clone());
            }
        }
        match self.request_lists.get(&entry.requests) {
            Some(r) => entry.requests = r.clone(),
            None => {
                self.request_lists.insert(entry.requests.clone());
            }
        }
        entry
    }

    fn remove_pod(&mut self, key: &(String, String)) {
        let Some(mut old) = self.pods.remove(key) else {
            return;
        };
        self.pods_gen += 1;
        if old.node.is_none() {
            self.unbound_pods = self.unbound_pods.saturating_sub(1);
        }
        // Drop the pod's handles before asking whether anyone else holds them.
        drop(std::mem::take(&mut old.claim_handles));
        for claim in &old.claims {
            self.devices.release_handle(&key.0, claim);
        }
        if old.active
            && let Some(node) = &old.node
        {
            let key = owner_key(&old.owner.namespace, &old.owner.kind, &old.owner.name);
            if let Some(n) = self.bound.get_mut(key.as_str()) {
                *n -= 1;
                if *n <= 0 {
                    self.bound.remove(key.as_str());
                }
            }
            if let Some(u) = self.usage.get_mut(node) {
                u.requested.sub_all(&old.requests);
                u.pods = u.pods.saturating_sub(1);
            }
            let node = node.clone();
            self.bump(&node);
        }
    }

    fn upsert_pod(&mut self, key: (String, String), entry: PodEntry) {
        // A pod whose counted facts did not change (a status update) changes no estimate:
        // nothing is bumped, so nothing computed on this cluster is done again.
        if self.pods.get(&key).is_some_and(|old| {
            old.node == entry.node
                && old.requests == entry.requests
                && old.priority == entry.priority
                && old.owner == entry.owner
                && old.claims == entry.claims
                && old.active == entry.active
        }) {
            return;
        }
        self.remove_pod(&key);
        self.pods_gen += 1;
        let mut entry = self.intern(entry);
        entry.claim_handles = entry
            .claims
            .iter()
            .map(|claim| self.devices.claim_handle(&key.0, claim))
            .collect();
        if entry.active
            && let Some(node) = &entry.node
        {
            let key = owner_key(&entry.owner.namespace, &entry.owner.kind, &entry.owner.name);
            *self.bound.entry(key.into_boxed_str()).or_default() += 1;
            let u = self.usage.entry(node.clone()).or_default();
            u.requested.add_all(&entry.requests);
            u.pods += 1;
            let node = node.clone();
            self.bump(&node);
        }
        if entry.node.is_none() {
            self.unbound_pods += 1;
        }
        self.pods.insert(key, entry);
    }
}

/// A cluster's Karpenter objects, by name. Only scale-up headroom reads them; a change bumps
/// the cluster's generation but no node's, so no per-node answer is computed again for it.
#[derive(Debug, Default, Clone)]
pub struct Autoscaling {
    /// NodePools by name.
    pub pools: BTreeMap<String, Arc<NodePool>>,
    /// NodeClaims by name.
    pub claims: BTreeMap<String, Arc<NodeClaim>>,
}

impl Autoscaling {
    /// The NodeClaims launched by `pool`, in name order.
    pub fn claims_of<'a>(&'a self, pool: &'a str) -> impl Iterator<Item = &'a NodeClaim> + 'a {
        self.claims
            .values()
            .map(|c| &**c)
            .filter(move |c| c.pool() == Some(pool))
    }
}

/// The view of all member clusters.
#[derive(Debug, Default)]
pub struct View {
    clusters: BTreeMap<String, ClusterView>,
}

impl View {
    /// An empty view.
    pub fn new() -> View {
        View::default()
    }

    /// An estimate of the heap this view (and the replica's store holding the same objects)
    /// takes, from its object counts: [`VIEW_BYTES_PER`] per node, pod, ResourceSlice and
    /// ResourceClaim. The sizes were measured with the `replica_memory` bench (`dramesh`
    /// crate); the estimate sizes the estimator's cache bound ([`crate::CacheBound::View`]),
    /// so it need only be right within a small factor.
    pub fn estimated_bytes(&self) -> usize {
        let [node, pod, slice, claim] = VIEW_BYTES_PER;
        self.clusters()
            .map(|c| {
                c.node_count() * node
                    + c.pod_count() * pod
                    + c.devices.slice_count() * slice
                    + c.devices.claim_count() * claim
            })
            .sum()
    }

    /// A cluster by name.
    pub fn cluster(&self, name: &str) -> Option<&ClusterView> {
        self.clusters.get(name)
    }

    /// Clusters in name order.
    pub fn clusters(&self) -> impl Iterator<Item = &ClusterView> {
        self.clusters.values()
    }

    /// Cluster names in order.
    pub fn cluster_names(&self) -> Vec<String> {
        self.clusters.keys().cloned().collect()
    }

    /// Adds an empty cluster (a cluster with no nodes yet still takes part in placement).
    pub fn ensure_cluster(&mut self, cluster: &str) -> &mut ClusterView {
        self.clusters
            .entry(cluster.to_string())
            .or_insert_with(|| ClusterView::new(cluster))
    }

    /// Forgets a cluster; true when it was known.
    pub fn remove_cluster(&mut self, cluster: &str) -> bool {
        self.clusters.remove(cluster).is_some()
    }

    /// Applies one replicated change: [`decode`] and [`View::apply_decoded`].
    pub fn apply(&mut self, cluster: &str, change: &ObjectChange) -> Result<(), ApplyError> {
        self.apply_decoded(cluster, decode(cluster, change)?)
    }

    /// Applies one change decoded by [`decode`].
    pub fn apply_decoded(&mut self, cluster: &str, change: Decoded) -> Result<(), ApplyError> {
        match change {
            Decoded::Upsert(obj) => self.apply_object(cluster, obj),
            Decoded::Delete(key) => {
                self.delete(cluster, &key);
                Ok(())
            }
        }
    }

    /// Inserts or replaces one object.
    pub fn apply_object(&mut self, cluster: &str, obj: ClusterObject) -> Result<(), ApplyError> {
        let key = obj.key();
        let invalid = |message: String| ApplyError::Invalid {
            cluster: cluster.to_string(),
            key: key.clone(),
            message,
        };
        let c = self.ensure_cluster(cluster);
        match obj {
            ClusterObject::Node(n) => {
                let entry = node_entry(&n).map_err(invalid)?;
                let name = c.interned(&entry.name);
                let entry = NodeEntry {
                    name: name.clone(),
                    ..entry
                };
                // Estimates read only these facts: an update of anything else (status
                // conditions, heartbeats, annotations) changes nothing computed here.
                if c.nodes.get(&name) == Some(&entry) {
                    return Ok(());
                }
                let before = c.nodes.insert(name.clone(), entry);
                c.devices.node_changed(&name);
                c.bump(&name);
                if let Some(old) = before
                    && c.nodes
                        .get(&name)
                        .is_some_and(|n| n.allocatable == old.allocatable)
                {
                    c.facts_log.push_back((c.generation, Arc::new(old)));
                    if c.facts_log.len() > FACTS_LOG {
                        c.facts_log.pop_front();
                    }
                }
            }
            ClusterObject::Pod(p) => {
                let pk = (key.namespace.clone().unwrap_or_default(), key.name.clone());
                let mut entry = pod_entry(&p).map_err(invalid)?;
                if let Some(n) = &entry.node {
                    entry.node = Some(c.interned(n));
                }
                c.upsert_pod(pk, entry);
            }
            ClusterObject::ResourceSlice(s) => {
                c.generation += 1;
                c.devices.upsert_slice(&key.name, &s).map_err(invalid)?;
            }
            ClusterObject::DeviceClass(d) => {
                c.generation += 1;
                c.devices.upsert_class(&key.name, d).map_err(invalid)?;
            }
            ClusterObject::ResourceClaim(rc) => {
                c.generation += 1;
                let namespace = key.namespace.as_deref().unwrap_or("default");
                c.devices.upsert_claim(namespace, &key.name, rc);
            }
            ClusterObject::DeviceTaintRule(r) => {
                c.generation += 1;
                c.devices.upsert_taint_rule(&r).map_err(invalid)?;
            }
            ClusterObject::ClusterInfo(info) => {
                c.generation += 1;
                c.info = (*info).clone();
                c.devices.set_version(info.kubernetes_version.as_deref());
            }
            ClusterObject::ResourceClaimTemplate(t) => {
                let mut h = DefaultHasher::new();
                serde_json::to_string(&t.spec)
                    .unwrap_or_default()
                    .hash(&mut h);
                let spec_hash = h.finish();
                let k = (key.namespace.clone().unwrap_or_default(), key.name.clone());
                // Only the spec is read: a metadata update changes no answer.
                if c.claim_templates.get(&k).map(|(_, h)| *h) != Some(spec_hash) {
                    c.generation += 1;
                    c.templates_gen += 1;
                    c.claim_templates.insert(k, (t, spec_hash));
                }
            }
            ClusterObject::NodePool(p) => {
                if c.autoscaling.pools.get(&key.name) != Some(&p) {
                    c.generation += 1;
                    c.autoscaling.pools.insert(key.name.clone(), p);
                }
            }
            ClusterObject::NodeClaim(nc) => {
                if c.autoscaling.claims.get(&key.name) != Some(&nc) {
                    c.generation += 1;
                    c.autoscaling.claims.insert(key.name.clone(), nc);
                }
            }
        }
        Ok(())
    }

    fn delete(&mut self, cluster: &str, key: &ObjectKey) {
        let Some(c) = self.clusters.get_mut(cluster) else {
            return;
        };
        match key.kind {
            ObjectKind::Node => {
                if let Some((name, _)) = c.nodes.remove_entry(key.name.as_str()) {
                    c.devices.node_changed(&name);
                    c.bump(&name);
                }
            }
            ObjectKind::Pod => {
                let pk = (key.namespace.clone().unwrap_or_default(), key.name.clone());
                c.remove_pod(&pk);
            }
            ObjectKind::ResourceSlice => {
                c.generation += 1;
                c.devices.remove_slice(&key.name);
            }
            ObjectKind::DeviceClass => {
                c.generation += 1;
                c.devices.remove_class(&key.name);
            }
            ObjectKind::ResourceClaim => {
                c.generation += 1;
                let namespace = key.namespace.as_deref().unwrap_or("default");
                c.devices.remove_claim(namespace, &key.name);
            }
            ObjectKind::DeviceTaintRule => {
                c.generation += 1;
                c.devices.remove_taint_rule(&key.name);
            }
            ObjectKind::ClusterInfo => {
                c.generation += 1;
                c.info = ClusterInfo::default();
                c.devices.set_version(None);
            }
            ObjectKind::ResourceClaimTemplate => {
                let k = (key.namespace.clone().unwrap_or_default(), key.name.clone());
                if c.claim_templates.remove(&k).is_some() {
                    c.generation += 1;
                    c.templates_gen += 1;
                }
            }
            ObjectKind::NodePool => {
                if c.autoscaling.pools.remove(&key.name).is_some() {
                    c.generation += 1;
                }
            }
            ObjectKind::NodeClaim => {
                if c.autoscaling.claims.remove(&key.name).is_some() {
                    c.generation += 1;
                }
            }
        }
    }
}

fn node_entry(n: &Node) -> Result<NodeEntry, String> {
    let name = n.metadata.name.clone().unwrap_or_default();
    if name.is_empty() {
        return Err("metadata.name is empty".into());
    }
    let status_alloc = n
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref().or(s.capacity.as_ref()));
    let allocatable = match status_alloc {
        Some(m) => ResList::from_k8s(m).map_err(|e| format!("status.allocatable.{e}"))?,
        None => ResList::new(),
    };
    let spec = n.spec.as_ref();
    Ok(NodeEntry {
        name: Arc::from(name.as_str()),
        labels: n.metadata.labels.clone().unwrap_or_default(),
        taints: spec.and_then(|s| s.taints.clone()).unwrap_or_default(),
        unschedulable: spec.and_then(|s| s.unschedulable).unwrap_or(false),
        allocatable,
    })
}

/// The key of an owner ([`ClusterView::bound_pods`]): its names joined by NUL, which no
/// Kubernetes name contains.
pub fn owner_key(namespace: &str, kind: &str, name: &str) -> String {
    format!("{namespace}\0{kind}\0{name}")
}

/// The workload identity of a pod (see [`Owner`]).
pub(crate) fn pod_owner(p: &Pod) -> Owner {
    let namespace = p
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let controller = p
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .or_else(|| p.metadata.owner_references.as_ref().and_then(|v| v.first()));
    match controller {
        Some(o) => {
            let hash = p
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("pod-template-hash"));
            if o.kind == "ReplicaSet"
                && let Some(h) = hash
                && let Some(base) = o.name.strip_suffix(&format!("-{h}"))
            {
                return Owner {
                    namespace,
                    kind: "Deployment".into(),
                    name: base.to_string(),
                };
            }
            Owner {
                namespace,
                kind: o.kind.clone(),
                name: o.name.clone(),
            }
        }
        None => Owner {
            namespace,
            kind: "Pod".into(),
            name: p.metadata.name.clone().unwrap_or_default(),
        },
    }
}

fn pod_entry(p: &Pod) -> Result<PodEntry, String> {
    let spec = p.spec.as_ref();
    let requests = match spec {
        Some(s) => pod_requests(s).map_err(|e| format!("spec.{e}"))?,
        None => ResList::new(),
    };
    let node = spec
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
        .map(Arc::from);
    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
    let terminal = matches!(phase, Some("Succeeded" | "Failed"));
    let mut claims = Vec::new();
    let statuses = p
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref());
    for rc in spec
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
    {
        if let Some(n) = &rc.resource_claim_name {
            claims.push(n.clone());
        } else if let Some(generated) = statuses
            .into_iter()
            .flatten()
            .find(|s| s.name == rc.name)
            .and_then(|s| s.resource_claim_name.clone())
        {
            claims.push(generated);
        }
    }
    let mut requests = requests;
    // The pods slot is counted separately.
    requests.remove(&ResName::Pods);
    Ok(PodEntry {
        active: node.is_some() && !terminal,
        node,
        requests: Arc::new(requests),
        priority: spec.and_then(|s| s.priority).unwrap_or(0),
        owner: Arc::new(pod_owner(p)),
        claims,
        claim_handles: ClaimHandles::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::k8s;
    use serde_json::json;

    fn node(labels: serde_json::Value, annotations: serde_json::Value, cpu: &str) -> ClusterObject {
        let n: k8s::Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "labels": labels, "annotations": annotations},
            "status": {"allocatable": {"cpu": cpu, "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True",
                    "lastHeartbeatTime": annotations["beat"].clone()}]}
        }))
        .unwrap();
        ClusterObject::Node(Arc::new(n))
    }

    fn pod(phase: &str, cpu: &str) -> ClusterObject {
        let p: k8s::Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p1", "namespace": "ml"},
            "spec": {"nodeName": "n1", "containers": [{"name": "c",
                "resources": {"requests": {"cpu": cpu}}}]},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": phase}]}
        }))
        .unwrap();
        ClusterObject::Pod(Arc::new(p))
    }

    /// Updates of fields no estimate reads (annotations, status conditions and heartbeats)
    /// leave the cluster's generation alone; a counted fact (labels, allocatable, requests,
    /// a pod that ends) moves it.
    #[test]
    fn only_updates_that_change_counted_facts_move_the_generation() {
        let mut v = View::new();
        v.apply_object(
            "c",
            node(
                json!({"a": "1"}),
                json!({"beat": "2026-11-26T00:00:00Z"}),
                "8",
            ),
        )
        .unwrap();
        v.apply_object("c", pod("Running", "1")).unwrap();
        let g = |v: &View| v.cluster("c").unwrap().generation();
        let before = g(&v);
        v.apply_object(
            "c",
            node(
                json!({"a": "1"}),
                json!({"beat": "2026-11-26T00:00:10Z"}),
                "8",
            ),
        )
        .unwrap();
        v.apply_object("c", pod("Running", "1")).unwrap();
        assert_eq!(g(&v), before, "nothing counted changed");
        v.apply_object(
            "c",
            node(
                json!({"a": "2"}),
                json!({"beat": "2026-11-26T00:00:20Z"}),
                "8",
            ),
        )
        .unwrap();
        assert!(g(&v) > before, "a label is a counted fact");
        let before = g(&v);
        v.apply_object(
            "c",
            node(
                json!({"a": "2"}),
                json!({"beat": "2026-11-26T00:00:30Z"}),
                "16",
            ),
        )
        .unwrap();
        assert!(g(&v) > before, "allocatable is a counted fact");
        let before = g(&v);
        v.apply_object("c", pod("Running", "2")).unwrap();
        assert!(g(&v) > before, "requests are counted");
        let before = g(&v);
        v.apply_object("c", pod("Succeeded", "2")).unwrap();
        assert!(g(&v) > before, "a pod that ended no longer counts");
        let usage = v
            .cluster("c")
            .unwrap()
            .usage
            .get("n1")
            .map_or(0, |u| u.pods);
        assert_eq!(usage, 0);
    }

    /// What `node_changes_since` says per node: facts-only changes carry the node's facts
    /// as they were at the stamp (the earliest of several), a pod, a capacity or a device
    /// change on the node does not, a cluster-wide change (a device class, a claim template)
    /// answers `None`, and so does a stamp older than the kept history; a facts record
    /// pushed out of the kept history makes that node's change not facts-only.
    #[test]
    fn node_changes_since_tells_facts_only_changes_from_the_rest() {
        let labelled = |a: &str, cpu: &str| {
            node(
                json!({"a": a}),
                json!({"beat": "2026-11-26T00:00:00Z"}),
                cpu,
            )
        };
        let mut v = View::new();
        v.apply_object("c", labelled("1", "8")).unwrap();
        let c = |v: &View| v.cluster("c").unwrap().stamp();
        let at = c(&v);
        let changes = |v: &View, at: &ViewStamp| v.cluster("c").unwrap().node_changes_since(at);
        assert_eq!(changes(&v, &at).map(|c| c.len()), Some(0));
        v.apply_object("c", labelled("2", "8")).unwrap();
        v.apply_object("c", labelled("3", "8")).unwrap();
        let got = changes(&v, &at).unwrap();
        assert_eq!(got.len(), 1);
        let before = got[0].before.as_ref().expect("facts only");
        assert_eq!(
            before.labels.get("a").map(String::as_str),
            Some("1"),
            "the earliest"
        );
        // A claim selecting `a: 1` passes the node at the stamp and fails it now.
        let selects = PodNodeClaim {
            node_selector: [("a".to_string(), "1".to_string())].into(),
            ..PodNodeClaim::default()
        };
        let any = PodNodeClaim::default();
        let cv = v.cluster("c").unwrap();
        assert!(got[0].leaves_fits(cv, &[&any]));
        assert!(!got[0].leaves_fits(cv, &[&any, &selects]));
        // A pod on the node: not facts-only.
        let at = c(&v);
        v.apply_object("c", pod("Running", "1")).unwrap();
        v.apply_object("c", labelled("4", "8")).unwrap();
        let got = changes(&v, &at).unwrap();
        assert!(got.len() == 1 && got[0].before.is_none());
        // Capacity: not facts-only.
        let at = c(&v);
        v.apply_object("c", labelled("4", "16")).unwrap();
        assert!(changes(&v, &at).unwrap()[0].before.is_none());
        // A device class: cluster-wide.
        let at = c(&v);
        let class: k8s::DeviceClass = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "gpu"}, "spec": {}
        }))
        .unwrap();
        v.apply_object("c", ClusterObject::DeviceClass(Arc::new(class)))
            .unwrap();
        assert!(changes(&v, &at).is_none());
        // A claim template: cluster-wide (claim references resolve to it).
        let at = c(&v);
        let tpl: k8s::ResourceClaimTemplate = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t", "namespace": "ml"}, "spec": {"spec": {}}
        }))
        .unwrap();
        v.apply_object("c", ClusterObject::ResourceClaimTemplate(Arc::new(tpl)))
            .unwrap();
        assert!(changes(&v, &at).is_none());
        // More facts changes than are kept: the node's change is no longer facts-only.
        let at = c(&v);
        for i in 0..=FACTS_LOG {
            v.apply_object("c", labelled(&format!("x{i}"), "16"))
                .unwrap();
        }
        let got = changes(&v, &at).unwrap();
        assert!(got.len() == 1 && got[0].before.is_none());
        let at = c(&v);
        v.apply_object("c", labelled("y", "16")).unwrap();
        assert!(changes(&v, &at).unwrap()[0].before.is_some());
    }
}
