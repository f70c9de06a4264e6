//! The live-cluster source: kube-rs watchers in DaemonSet mode plus a Lease-elected
//! publisher of cluster-scoped records.
//!
//! Every agent runs on one node (its name from the downward API, `NODE_NAME`) and watches:
//! its own Node (`metadata.name=<node>`), its node's pods and ResourceSlices
//! (`spec.nodeName=<node>`), network-attached slices and unbound pods (`spec.nodeName=`,
//! i.e. without a node; unbound pods are published once the scheduler marked them
//! `PodScheduled=False`, see [`crate::trim::pod_owner`]), DeviceClasses, ResourceClaimTemplates
//! (names, namespaces and claim specs: what Karmada's `resourceClaimRefs` are resolved
//! against), optionally DeviceTaintRules (`resource.k8s.io/v1beta2`), Karpenter's NodePools
//! and NodeClaims (`karpenter.sh/v1`, through a dynamic client; where the CRDs are absent,
//! 404, or the agent may not list them, 403, they count as empty, logged once per failing
//! streak, and are retried with backoff), and all ResourceClaims (the API has no filter for
//! "allocated on this node", so claims are filtered
//! here by [`crate::trim::claim_owner`]). It publishes its node's records under
//! [`Scope::Node`]; while it holds the Lease it also publishes the cluster-scoped ones under
//! [`Scope::Cluster`] with the Lease term. All agents watch the cluster-scoped kinds so a new
//! leader can publish at once.
//!
//! Guarantees:
//! - Watches use kube-runtime's watcher with its default backoff; a dropped watch resumes
//!   from the last seen resourceVersion, and `410 Gone` makes the watcher re-list, after
//!   which objects missing from the list are deleted downstream ([`crate::mirror`]).
//! - The first batch for the node scope is a snapshot, sent once every node watch has
//!   listed; the first batch of each leader term is a snapshot of the cluster scope
//!   (cluster-scoped records plus ClusterInfo), sent once those watches have listed.
//! - Nothing cluster-scoped is sent while this agent is not the leader.
//! - The source stops when its output channel closes, releasing the Lease if held.

use std::sync::Arc;
use std::time::Duration;

use dramesh_model::k8s;
use dramesh_model::{ClusterInfo, ClusterObject, ObjectChange};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;

use crate::batch::{Scope, SourceEvent};
use crate::lease::{Leadership, LeaseConfig, RelayView, run_election};
use crate::mirror::{Mirror, MirrorEvent};
use crate::trim::{self, Owner, Record};

/// Settings of the kube source.
#[derive(Debug, Clone)]
pub struct KubeSourceConfig {
    /// The node this agent runs on (DaemonSet mode).
    pub node_name: String,
    /// Lease election for cluster-scoped records; `None` makes this agent publish them
    /// unconditionally with term 0 (for a cluster with a single agent).
    pub lease: Option<LeaseConfig>,
    /// Also watch `resource.k8s.io/v1beta2` DeviceTaintRules. When the API server does not
    /// serve them (404) the watch counts as empty and keeps retrying with backoff.
    pub watch_device_taint_rules: bool,
    /// Also watch Karpenter's `karpenter.sh/v1` NodePools and NodeClaims (scale-up headroom).
    /// Where Karpenter is not installed (404) or the agent may not list them (403), they
    /// count as empty, logged once, and the watch keeps retrying with backoff.
    pub watch_karpenter: bool,
    /// Objects per list page (`limit`); `None` lists without paging.
    pub page_size: Option<u32>,
    /// Cluster facts published with the detected Kubernetes version.
    pub cluster_info: ClusterInfo,
    /// How often the API server version is re-read.
    pub version_refresh: Duration,
    /// Where the election publishes what the Lease says about the cluster's relay (see
    /// [`crate::lease::RelayView`]); `None` ignores it.
    pub relay_view: Option<Arc<watch::Sender<RelayView>>>,
}

impl KubeSourceConfig {
    /// Defaults for a node agent: no election (set [`KubeSourceConfig::lease`] for DaemonSets),
    /// no DeviceTaintRules, Karpenter's objects watched, pages of 500, version re-read every
    /// 10 minutes.
    pub fn new(node_name: &str) -> KubeSourceConfig {
        KubeSourceConfig {
            node_name: node_name.to_string(),
            lease: None,
            watch_device_taint_rules: false,
            watch_karpenter: true,
            page_size: Some(500),
            cluster_info: ClusterInfo::default(),
            version_refresh: Duration::from_secs(600),
            relay_view: None,
        }
    }
}

/// Why the kube source could not run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The configuration is invalid (the message says which field).
    #[error("invalid agent configuration: {0}")]
    Config(String),
}

/// Which watch a message comes from; indexes the mirrors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WatchId {
    Node = 0,
    Pods = 1,
    NodeSlices = 2,
    Claims = 3,
    NetworkSlices = 4,
    Classes = 5,
    TaintRules = 6,
    PendingPods = 7,
    ClaimTemplates = 8,
    NodePools = 9,
    NodeClaims = 10,
}

impl WatchId {
    /// Watches of kinds another project installs (Karpenter's CRDs): a 403 on their first
    /// list, like a 404, means "not available here", so a cluster without Karpenter, or an
    /// agent whose RBAC predates it, still publishes everything else.
    fn optional(self) -> bool {
        matches!(self, WatchId::NodePools | WatchId::NodeClaims)
    }
}

/// Number of watches (one mirror each).
const WATCHES: usize = 11;

const NODE_WATCHES: [WatchId; 4] = [
    WatchId::Node,
    WatchId::Pods,
    WatchId::NodeSlices,
    WatchId::Claims,
];
const CLUSTER_WATCHES: [WatchId; 8] = [
    WatchId::Claims,
    WatchId::NetworkSlices,
    WatchId::Classes,
    WatchId::TaintRules,
    WatchId::PendingPods,
    WatchId::ClaimTemplates,
    WatchId::NodePools,
    WatchId::NodeClaims,
];

enum Internal {
    Watch(WatchId, MirrorEvent),
    Leadership(Leadership),
    Version(Option<String>),
}

/// The source's bookkeeping, separated from the I/O so its rules are testable.
struct State {
    node: String,
    mirrors: Vec<Mirror>,
    node_published: bool,
    leadership: Leadership,
    /// The term whose snapshot has been sent.
    cluster_published: Option<u64>,
    info: ClusterInfo,
    version_known: bool,
}

impl State {
    fn new(cfg: &KubeSourceConfig) -> State {
        let mut mirrors: Vec<Mirror> = (0..WATCHES)
            .map(|_| Mirror::new(Some(cfg.node_name.clone())))
            .collect();
        if !cfg.watch_device_taint_rules {
            mirrors[WatchId::TaintRules as usize].apply(MirrorEvent::InitDone);
        }
        if !cfg.watch_karpenter {
            mirrors[WatchId::NodePools as usize].apply(MirrorEvent::InitDone);
            mirrors[WatchId::NodeClaims as usize].apply(MirrorEvent::InitDone);
        }
        State {
            node: cfg.node_name.clone(),
            mirrors,
            node_published: false,
            leadership: Leadership::Follower,
            cluster_published: None,
            info: cfg.cluster_info.clone(),
            version_known: false,
        }
    }

    fn info_change(&self) -> ObjectChange {
        ObjectChange::upsert(&ClusterObject::ClusterInfo(Arc::new(self.info.clone())))
    }

    fn handle(&mut self, msg: Internal) -> Vec<SourceEvent> {
        let mut node_changes = Vec::new();
        let mut cluster_changes = Vec::new();
        match msg {
            Internal::Watch(id, ev) => {
                for (owner, change) in self.mirrors[id as usize].apply(ev) {
                    match owner {
                        Owner::Node(_) => node_changes.push(change),
                        Owner::Cluster => cluster_changes.push(change),
                    }
                }
            }
            Internal::Leadership(l) => {
                self.leadership = l;
                if let Leadership::Leader { term } = l {
                    tracing::info!(term, "publishing cluster-scoped records");
                }
                if matches!(l, Leadership::Follower) {
                    self.cluster_published = None;
                }
            }
            Internal::Version(v) => {
                self.version_known = true;
                if v.is_some() && v != self.info.kubernetes_version {
                    self.info.kubernetes_version = v;
                    cluster_changes.push(self.info_change());
                }
            }
        }
        let mut out = Vec::new();
        let node_scope = Scope::Node(self.node.clone());
        if self.node_published {
            if !node_changes.is_empty() {
                out.push(SourceEvent::Changes {
                    scope: node_scope,
                    changes: node_changes,
                });
            }
        } else if NODE_WATCHES
            .iter()
            .all(|w| self.mirrors[*w as usize].synced())
        {
            let owner = Owner::Node(self.node.clone());
            let changes = NODE_WATCHES
                .iter()
                .flat_map(|w| self.mirrors[*w as usize].upserts_of(&owner))
                .collect();
            self.node_published = true;
            out.push(SourceEvent::Snapshot {
                scope: node_scope,
                changes,
            });
        }
        if let Leadership::Leader { term } = self.leadership {
            let scope = Scope::Cluster { term };
            if self.cluster_published == Some(term) {
                if !cluster_changes.is_empty() {
                    out.push(SourceEvent::Changes {
                        scope,
                        changes: cluster_changes,
                    });
                }
            } else if self.version_known
                && CLUSTER_WATCHES
                    .iter()
                    .all(|w| self.mirrors[*w as usize].synced())
            {
                let mut changes: Vec<ObjectChange> = CLUSTER_WATCHES
                    .iter()
                    .flat_map(|w| self.mirrors[*w as usize].upserts_of(&Owner::Cluster))
                    .collect();
                changes.push(self.info_change());
                self.cluster_published = Some(term);
                out.push(SourceEvent::Snapshot { scope, changes });
            }
        }
        out
    }
}

fn check(cfg: &KubeSourceConfig) -> Result<(), AgentError> {
    if cfg.node_name.is_empty() {
        return Err(AgentError::Config(
            "node_name is empty (set NODE_NAME from the downward API spec.nodeName)".into(),
        ));
    }
    if let Some(l) = &cfg.lease {
        if l.renew_deadline >= l.duration {
            return Err(AgentError::Config(format!(
                "lease {}: renew_deadline {:?} must be shorter than duration {:?}",
                l.name, l.renew_deadline, l.duration
            )));
        }
        if l.identity.is_empty() {
            return Err(AgentError::Config(format!(
                "lease {}: identity is empty",
                l.name
            )));
        }
    }
    Ok(())
}

/// Runs the kube source until `tx` is closed (its receiver dropped), then releases the
/// Lease if held and returns.
pub async fn run_kube_source(
    client: Client,
    cfg: KubeSourceConfig,
    tx: mpsc::Sender<SourceEvent>,
) -> Result<(), AgentError> {
    check(&cfg)?;
    let (itx, mut irx) = mpsc::channel::<Internal>(1024);
    let mut tasks = JoinSet::new();
    let node = cfg.node_name.clone();
    let base = || {
        let wc = watcher::Config::default();
        match cfg.page_size {
            Some(p) => wc.page_size(p),
            None => watcher::Config {
                page_size: None,
                ..wc
            },
        }
    };
    let on_node = format!("spec.nodeName={node}");
    tasks.spawn(watch_into(
        Api::<k8s::Node>::all(client.clone()),
        base().fields(&format!("metadata.name={node}")),
        WatchId::Node,
        trim::node_record,
        itx.clone(),
    ));
    tasks.spawn(watch_into(
        Api::<k8s::Pod>::all(client.clone()),
        base().fields(&on_node),
        WatchId::Pods,
        trim::pod_record,
        itx.clone(),
    ));
    tasks.spawn(watch_into(
        Api::<k8s::ResourceSlice>::all(client.clone()),
        base().fields(&on_node),
        WatchId::NodeSlices,
        trim::slice_record,
        itx.clone(),
    ));
    tasks.spawn(watch_into(
        Api::<k8s::ResourceSlice>::all(client.clone()),
        base().fields("spec.nodeName="),
        WatchId::NetworkSlices,
        trim::slice_record,
        itx.clone(),
    ));
    // Unbound pods: a pod leaving this selection when bound is DELETED here and appears in
    // its node agent's pod watch, so it moves from the cluster scope to a node scope (both
    // may briefly hold it while the two publishers' batches are in flight).
    tasks.spawn(watch_into(
        Api::<k8s::Pod>::all(client.clone()),
        base().fields("spec.nodeName="),
        WatchId::PendingPods,
        trim::pod_record,
        itx.clone(),
    ));
    tasks.spawn(watch_into(
        Api::<k8s::ResourceClaim>::all(client.clone()),
        base(),
        WatchId::Claims,
        trim::claim_record,
        itx.clone(),
    ));
    tasks.spawn(watch_into(
        Api::<k8s::DeviceClass>::all(client.clone()),
        base(),
        WatchId::Classes,
        trim::class_record,
        itx.clone(),
    ));
    tasks.spawn(watch_into(
        Api::<k8s::ResourceClaimTemplate>::all(client.clone()),
        base(),
        WatchId::ClaimTemplates,
        trim::claim_template_record,
        itx.clone(),
    ));
    if cfg.watch_device_taint_rules {
        tasks.spawn(watch_into(
            Api::<k8s::DeviceTaintRule>::all(client.clone()),
            base(),
            WatchId::TaintRules,
            trim::taint_rule_record,
            itx.clone(),
        ));
    }
    if cfg.watch_karpenter {
        for (plural, kind, id, conv) in [
            (
                "nodepools",
                "NodePool",
                WatchId::NodePools,
                trim::nodepool_record as fn(&DynamicObject) -> Record,
            ),
            (
                "nodeclaims",
                "NodeClaim",
                WatchId::NodeClaims,
                trim::nodeclaim_record,
            ),
        ] {
            let gvk = GroupVersionKind::gvk("karpenter.sh", "v1", kind);
            let ar = ApiResource::from_gvk_with_plural(&gvk, plural);
            tasks.spawn(watch_into(
                Api::<DynamicObject>::all_with(client.clone(), &ar),
                base(),
                id,
                conv,
                itx.clone(),
            ));
        }
    }
    tasks.spawn(watch_version(
        client.clone(),
        cfg.version_refresh,
        itx.clone(),
    ));

    let (release_tx, release_rx) = oneshot::channel::<()>();
    let election = match &cfg.lease {
        Some(l) => {
            let (stx, srx) = watch::channel(Leadership::Follower);
            let api = Api::<Lease>::namespaced(client.clone(), &l.namespace);
            let relay = cfg
                .relay_view
                .clone()
                .unwrap_or_else(|| Arc::new(watch::channel(RelayView::None).0));
            let h = tokio::spawn(run_election(api, l.clone(), stx, relay, async move {
                let _ = release_rx.await;
            }));
            tasks.spawn(forward_leadership(srx, itx.clone()));
            Some(AbortOnDrop(Some(h)))
        }
        None => {
            drop(release_rx);
            let _ = itx
                .send(Internal::Leadership(Leadership::Leader { term: 0 }))
                .await;
            None
        }
    };
    drop(itx);

    let mut state = State::new(&cfg);
    loop {
        tokio::select! {
            msg = irx.recv() => {
                let Some(msg) = msg else { break };
                for ev in state.handle(msg) {
                    if tx.send(ev).await.is_err() {
                        break;
                    }
                }
            }
            () = tx.closed() => break,
        }
    }
    tasks.abort_all();
    let _ = release_tx.send(());
    if let Some(h) = election.and_then(|mut g| g.0.take()) {
        // Releasing is one GET and one PUT; do not hang shutdown on an unreachable server.
        if tokio::time::timeout(Duration::from_secs(5), h)
            .await
            .is_err()
        {
            tracing::warn!("lease release did not finish in 5 s");
        }
    }
    Ok(())
}

/// Aborts the election when the source future is dropped (cancelled) rather than returning:
/// a cancelled agent behaves like a crashed one and leaves the Lease to expire.
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = &self.0 {
            h.abort();
        }
    }
}

async fn forward_leadership(mut rx: watch::Receiver<Leadership>, tx: mpsc::Sender<Internal>) {
    loop {
        let l = *rx.borrow_and_update();
        if tx.send(Internal::Leadership(l)).await.is_err() || rx.changed().await.is_err() {
            return;
        }
    }
}

async fn watch_version(client: Client, every: Duration, tx: mpsc::Sender<Internal>) {
    loop {
        let v = match client.apiserver_version().await {
            Ok(info) => {
                let v = trim::major_minor(&info.major, &info.minor);
                if v.is_none() {
                    tracing::warn!(major = %info.major, minor = %info.minor, "cannot parse API server version");
                }
                v
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read API server version");
                None
            }
        };
        let retry = if v.is_some() {
            every
        } else {
            every.min(Duration::from_secs(30))
        };
        if tx.send(Internal::Version(v)).await.is_err() {
            return;
        }
        tokio::time::sleep(retry).await;
    }
}

async fn watch_into<K>(
    api: Api<K>,
    wc: watcher::Config,
    id: WatchId,
    conv: fn(&K) -> Record,
    tx: mpsc::Sender<Internal>,
) where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let mut stream = watcher::watcher(api, wc).default_backoff().boxed();
    let mut reported_missing = false;
    while let Some(item) = stream.next().await {
        let ev = match item {
            Ok(Event::Init) => MirrorEvent::Init,
            Ok(Event::InitApply(o)) => MirrorEvent::InitApply(conv(&o)),
            Ok(Event::InitDone) => {
                reported_missing = false;
                MirrorEvent::InitDone
            }
            Ok(Event::Apply(o)) => MirrorEvent::Apply(conv(&o)),
            Ok(Event::Delete(o)) => MirrorEvent::Delete(conv(&o).key),
            Err(watcher::Error::InitialListFailed(kube::Error::Api(s)))
                if s.code == 404 || (s.code == 403 && id.optional()) =>
            {
                if reported_missing {
                    continue;
                }
                reported_missing = true;
                if s.code == 404 {
                    tracing::warn!(watch = ?id, "resource not served by the API server; treating it as empty");
                } else {
                    tracing::warn!(watch = ?id, "listing this optional resource is forbidden; treating it as empty");
                }
                // Nothing of a kind the server does not serve exists.
                if tx
                    .send(Internal::Watch(id, MirrorEvent::Init))
                    .await
                    .is_err()
                {
                    return;
                }
                MirrorEvent::InitDone
            }
            Err(e) => {
                tracing::warn!(watch = ?id, error = %e, "watch error; retrying with backoff");
                continue;
            }
        };
        if tx.send(Internal::Watch(id, ev)).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::{ObjectKey, ObjectKind};

    fn rec(kind: ObjectKind, name: &str, owner: Option<Owner>) -> Record {
        Record {
            key: ObjectKey::new(kind, None, name),
            owner,
            json: name.as_bytes().into(),
        }
    }

    fn sync_all(s: &mut State, ids: &[WatchId]) -> Vec<SourceEvent> {
        let mut out = Vec::new();
        for id in ids {
            out.extend(s.handle(Internal::Watch(*id, MirrorEvent::Init)));
            out.extend(s.handle(Internal::Watch(*id, MirrorEvent::InitDone)));
        }
        out
    }

    #[test]
    fn node_snapshot_waits_for_every_node_watch() {
        let mut s = State::new(&KubeSourceConfig::new("n1"));
        s.handle(Internal::Watch(WatchId::Node, MirrorEvent::Init));
        s.handle(Internal::Watch(
            WatchId::Node,
            MirrorEvent::InitApply(rec(ObjectKind::Node, "n1", Some(Owner::Node("n1".into())))),
        ));
        assert!(
            s.handle(Internal::Watch(WatchId::Node, MirrorEvent::InitDone))
                .is_empty()
        );
        let out = sync_all(
            &mut s,
            &[WatchId::Pods, WatchId::NodeSlices, WatchId::Claims],
        );
        assert_eq!(out.len(), 1);
        let SourceEvent::Snapshot { scope, changes } = &out[0] else {
            panic!("expected a snapshot, got {out:?}")
        };
        assert_eq!(scope, &Scope::Node("n1".into()));
        assert_eq!(changes.len(), 1);
        // Afterwards changes flow incrementally.
        let out = s.handle(Internal::Watch(
            WatchId::Pods,
            MirrorEvent::Apply(rec(ObjectKind::Pod, "p", Some(Owner::Node("n1".into())))),
        ));
        assert!(matches!(&out[..], [SourceEvent::Changes { changes, .. }] if changes.len() == 1));
    }

    #[test]
    fn cluster_records_only_flow_while_leading() {
        let mut s = State::new(&KubeSourceConfig::new("n1"));
        sync_all(&mut s, &NODE_WATCHES);
        sync_all(&mut s, &CLUSTER_WATCHES);
        s.handle(Internal::Version(Some("1.36".into())));
        let class = rec(ObjectKind::DeviceClass, "gpu", Some(Owner::Cluster));
        let out = s.handle(Internal::Watch(WatchId::Classes, MirrorEvent::Apply(class)));
        assert!(
            out.is_empty(),
            "a follower publishes nothing cluster-scoped"
        );
        let out = s.handle(Internal::Leadership(Leadership::Leader { term: 2 }));
        let [SourceEvent::Snapshot { scope, changes }] = &out[..] else {
            panic!("expected a snapshot, got {out:?}")
        };
        assert_eq!(scope, &Scope::Cluster { term: 2 });
        let kinds: Vec<_> = changes.iter().map(|c| c.key().kind).collect();
        assert!(kinds.contains(&ObjectKind::DeviceClass));
        assert!(kinds.contains(&ObjectKind::ClusterInfo));
        let out = s.handle(Internal::Leadership(Leadership::Follower));
        assert!(out.is_empty());
        let out = s.handle(Internal::Watch(
            WatchId::Classes,
            MirrorEvent::Apply(rec(ObjectKind::DeviceClass, "mig", Some(Owner::Cluster))),
        ));
        assert!(out.is_empty());
        // A new term gets a fresh snapshot with everything, including what changed meanwhile.
        let out = s.handle(Internal::Leadership(Leadership::Leader { term: 4 }));
        let [SourceEvent::Snapshot { scope, changes }] = &out[..] else {
            panic!("expected a snapshot, got {out:?}")
        };
        assert_eq!(scope, &Scope::Cluster { term: 4 });
        assert_eq!(changes.len(), 3);
    }

    #[test]
    fn config_is_checked() {
        assert!(check(&KubeSourceConfig::new("")).is_err());
        let mut c = KubeSourceConfig::new("n1");
        let mut l = LeaseConfig::new("ns", "l", "me");
        l.renew_deadline = l.duration;
        c.lease = Some(l);
        assert!(check(&c).is_err());
    }
}
