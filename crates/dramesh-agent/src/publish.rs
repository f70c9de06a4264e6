//! The agent's publishing side: a member-cluster agent as a running process (`dramesh agent`,
//! or in-process for the demo): source (folder or Kubernetes watches) -> coalescer -> the agent's own document in
//! the store -> the mesh.
//!
//! The agent writes exactly one document, `(cluster, agent name)`, which is the document its
//! certificate identity `dramesh://cluster/<cluster>/agent/<agent name>` owns in the mesh.
//! Every coalesced batch becomes one automerge commit, acknowledged (durable) before the mesh
//! is told to push it.
//!
//! Scopes: a batch is either node-local ([`Scope::Node`]) or cluster-scoped
//! ([`Scope::Cluster`]); both may land in the same document (a DaemonSet agent holding the
//! Lease). A snapshot batch replaces its scope's records: every key previously written under
//! that scope and absent from the snapshot is deleted. Keys found in the document at start
//! (written by a previous run) are assigned to a scope by the same rule the kube source uses
//! ([`crate::trim`]), or all to the cluster scope in folder mode, so a restart followed
//! by a snapshot removes what disappeared meanwhile.
//!
//! Relay (DaemonSet mode with a Lease): whatever the Lease says about the cluster's relay
//! ([`RelayView`]) is applied to the mesh node: the holder with a relay address is the relay
//! ([`MeshHandle::set_relay`]); every other agent dials the holder's published address
//! ([`MeshHandle::set_relay_target`]), or the replicas when there is none (and while the
//! relay is unreachable, see `NodeConfig::relay_fallback`). Copies of other nodes' documents
//! left from an earlier term as relay are dropped at start.
//!
//! Observability: every committed batch is a `mesh.sync` span (`peer = "*"`: it is pushed to
//! every connected replica) and counts in `dramesh_agent_batches_total`; with
//! [`AgentConfig::metrics`] set the agent serves `GET /metrics` (mesh peers, bytes, refused
//! writes, its document's size and history) on that address, its only HTTP listener.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use dramesh_mesh::PeerIdentity;
use dramesh_mesh::certs::TlsIdentity;
use dramesh_mesh::daemon::{open_store, stopped};
use dramesh_mesh::node::{MeshHandle, NodeConfig};
use dramesh_mesh::observe::Observer;
use dramesh_mesh::protocol::ProtocolConfig;
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_model::{ClusterObject, ObjectChange, ObjectKey};
use dramesh_store::DocId;
use dramesh_telemetry::Metrics;
use dramesh_telemetry::spans::{fields, record_count};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::Instrument as _;

use crate::lease::RelayView;
use crate::trim::{self, Owner};
use crate::{Batch, CoalesceConfig, DirConfig, Scope};

/// Where the agent reads its cluster from.
#[derive(Clone, Debug)]
pub enum AgentSource {
    /// A folder of manifests standing for the whole cluster.
    Dir {
        /// The folder.
        path: PathBuf,
        /// How often it is re-read.
        poll_every: Duration,
    },
    /// The Kubernetes API (in-cluster or kubeconfig), DaemonSet mode.
    Kube {
        /// The node this agent runs on.
        node_name: String,
        /// Namespace of the Lease electing the cluster-scoped publisher; `None` publishes
        /// cluster-scoped records unconditionally (single agent).
        lease_namespace: Option<String>,
        /// Also watch `resource.k8s.io/v1beta2` DeviceTaintRules.
        watch_device_taint_rules: bool,
        /// The mesh address (`host:port`) node agents reach this agent at: while it holds the
        /// Lease it is its cluster's relay and publishes the address on the Lease. `None`:
        /// it never relays (it still follows another holder's relay).
        relay_advertise: Option<String>,
    },
}

/// How an agent is started.
#[derive(Clone)]
pub struct AgentConfig {
    /// Mesh certificate; its identity must be `dramesh://cluster/<cluster>/agent/<name>`.
    pub identity: TlsIdentity,
    /// Replica mesh addresses to dial (more are learned through peer exchange).
    pub replicas: Vec<SocketAddr>,
    /// Local UDP address to bind.
    pub listen: SocketAddr,
    /// Store directory; `None` keeps the document in memory only (demo).
    pub data_dir: Option<PathBuf>,
    /// Where the cluster's objects come from.
    pub source: AgentSource,
    /// Replication switches and limits of the mesh node.
    pub protocol: ProtocolConfig,
    /// How bursts of changes become batches.
    pub coalesce: CoalesceConfig,
    /// TCP address to serve Prometheus `GET /metrics` on; `None` serves nothing.
    pub metrics: Option<SocketAddr>,
    /// Bounds of the metrics listener (connections, header and idle timeout).
    pub http: dramesh_telemetry::HttpLimits,
    /// Start a new generation of the document at once, keeping its contents, that asks to
    /// rejoin the fleet ([`dramesh_store::Store::rejoin`]): how the agent of a cluster
    /// retired from the fleet comes back. Replicas refuse every generation of a retired
    /// cluster that does not rejoin after the retirement, including the ones the agent rolls
    /// over to by itself; this is the only way back (a fresh data directory is not).
    pub rejoin: bool,
    /// Files the identity was read from, watched for a rotated credential; `None` never
    /// reloads (demo, tests).
    pub credentials: Option<CredentialFiles>,
}

/// Where the agent's mesh credential lives, read again every `every`: a certificate chain, its
/// key and the CA. With Pod Certificates, `cert` and `key` are the same credential bundle (the
/// kubelet writes the key and chain into one file, atomically); with a hostPath they are
/// `tls.crt` and `tls.key`.
#[derive(Debug, Clone)]
pub struct CredentialFiles {
    /// The certificate chain (leaf first).
    pub cert: PathBuf,
    /// The private key.
    pub key: PathBuf,
    /// The mesh CA.
    pub ca: PathBuf,
    /// How often the files are read again.
    pub every: std::time::Duration,
}

/// A running agent.
pub struct Agent {
    /// Member cluster name (from the certificate).
    pub cluster: String,
    /// Agent (writer) name (from the certificate).
    pub name: String,
    mesh: Arc<MeshHandle>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScopeKind {
    Node,
    Cluster,
}

fn kind_of(scope: &Scope) -> ScopeKind {
    match scope {
        Scope::Node(_) => ScopeKind::Node,
        Scope::Cluster { .. } => ScopeKind::Cluster,
    }
}

/// Which scope each key of the agent's document was written under.
#[derive(Debug, Default)]
struct ScopeTracker {
    owner: BTreeMap<ObjectKey, ScopeKind>,
}

/// The scope the kube source would publish an existing record under.
fn natural_scope(key: &ObjectKey, json: &[u8]) -> ScopeKind {
    let owner = match ClusterObject::from_json(key.kind, json) {
        Ok(ClusterObject::Node(_)) | Ok(ClusterObject::Pod(_)) => Some(Owner::Node(String::new())),
        Ok(ClusterObject::ResourceSlice(s)) => trim::slice_record(&s).owner,
        Ok(ClusterObject::ResourceClaim(c)) => trim::claim_owner(&c),
        _ => Some(Owner::Cluster),
    };
    match owner {
        Some(Owner::Node(_)) => ScopeKind::Node,
        _ => ScopeKind::Cluster,
    }
}

impl ScopeTracker {
    /// Assigns the keys already in the document: all to the cluster scope in folder mode,
    /// by kind and content otherwise.
    fn from_existing(existing: &[(ObjectKey, Arc<[u8]>)], folder: bool) -> ScopeTracker {
        let owner = existing
            .iter()
            .map(|(k, json)| {
                let s = if folder {
                    ScopeKind::Cluster
                } else {
                    natural_scope(k, json)
                };
                (k.clone(), s)
            })
            .collect();
        ScopeTracker { owner }
    }

    /// The changes to write for `batch` (a snapshot adds deletes for what it no longer
    /// names), updating the ownership record.
    fn changes_for(&mut self, batch: Batch) -> Vec<ObjectChange> {
        let scope = kind_of(&batch.scope);
        let mut out = batch.changes;
        if batch.snapshot {
            let named: BTreeSet<&ObjectKey> = out.iter().map(ObjectChange::key).collect();
            let gone: Vec<ObjectKey> = self
                .owner
                .iter()
                .filter(|(k, s)| **s == scope && !named.contains(k))
                .map(|(k, _)| k.clone())
                .collect();
            out.extend(gone.into_iter().map(|key| ObjectChange::Delete { key }));
        }
        for c in &out {
            match c {
                ObjectChange::Upsert { key, .. } => {
                    self.owner.insert(key.clone(), scope);
                }
                ObjectChange::Delete { key } => {
                    self.owner.remove(key);
                }
            }
        }
        out
    }
}

impl Agent {
    /// Opens the store and the writer document, starts the mesh node, the source, the
    /// coalescer and the writer.
    pub async fn start(config: AgentConfig) -> anyhow::Result<Agent> {
        let (cluster, name) = match &config.identity.identity {
            PeerIdentity::Agent { cluster, node } => (cluster.clone(), node.clone()),
            other => anyhow::bail!("the mesh certificate is for {other}, not an agent"),
        };
        let doc = DocId::new(cluster.clone(), name.clone());
        let what = format!("agent {cluster}/{name}");
        let dir = config.data_dir.clone();
        let rejoin = config.rejoin;
        let (store, existing) = {
            let doc = doc.clone();
            tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
                let store = open_store(dir.as_deref(), &what).with_context(|| match &dir {
                    Some(d) => format!("{what}: opening the store in {}", d.display()),
                    None => format!("{what}: opening the store"),
                })?;
                let mut store = MeshStore::new(store, false);
                store
                    .open_writer(&doc)
                    .with_context(|| format!("{what}: opening its document"))?;
                // Copies this agent carried as its cluster's relay in an earlier run: it pulls
                // them again if it relays again.
                let dropped = dramesh_mesh::DocStore::drop_copies(&mut store);
                if dropped > 0 {
                    tracing::info!(dropped, "dropped the documents carried as relay before");
                }
                if rejoin {
                    let generation = store
                        .rejoin(&doc)
                        .with_context(|| format!("{what}: starting a new generation to rejoin"))?;
                    tracing::info!(%doc, generation, "rejoining the fleet with a new generation");
                }
                let existing: Vec<(ObjectKey, Arc<[u8]>)> = store
                    .store()
                    .snapshot()
                    .into_iter()
                    .filter(|(c, _)| *c == doc.cluster)
                    .filter_map(|(_, ch)| match ch {
                        ObjectChange::Upsert { key, json } => Some((key, json)),
                        ObjectChange::Delete { .. } => None,
                    })
                    .collect();
                // Nothing reads this store's objects back from here on (what it published is
                // tracked by the scope tracker; replicas serve the view): it keeps none, so a
                // write or a relayed change costs no value reads and comparisons.
                store.stop_serving_view();
                Ok((store, existing))
            })
            .await
            .context("store loader panicked")??
        };
        let folder = matches!(config.source, AgentSource::Dir { .. });
        let tracker = ScopeTracker::from_existing(&existing, folder);
        let store = Arc::new(Mutex::new(store));
        let mut node = NodeConfig::new(config.identity.clone(), config.listen);
        node.seeds = config.replicas.clone();
        node.protocol = config.protocol.clone();
        let mesh = Arc::new(
            MeshHandle::start(node, store.clone())
                .await
                .with_context(|| format!("agent {cluster}/{name}: starting the mesh"))?,
        );
        let (stop, stop_rx) = watch::channel(false);
        let (events, batches_rx) = crate::spawn_coalescer(config.coalesce);
        let mut tasks = JoinSet::new();
        let observer = Observer::new(Arc::new(Metrics::new()), mesh.clone(), store.clone());
        let metrics_addr = match config.metrics {
            None => None,
            Some(addr) => {
                let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
                    format!("agent {cluster}/{name}: binding the metrics listener on {addr}")
                })?;
                let local = listener.local_addr()?;
                let router = axum::Router::new()
                    .route(dramesh_telemetry::METRICS_PATH, axum::routing::get(scrape))
                    .with_state(observer.clone());
                let shutdown = stopped(stop_rx.clone());
                let (limits, metrics) = (config.http, observer.metrics.clone());
                tasks.spawn(async move {
                    if let Err(e) = dramesh_telemetry::serve_bounded(
                        listener, router, "agent", limits, metrics, shutdown,
                    )
                    .await
                    {
                        tracing::error!(error = %e, "metrics listener failed");
                    }
                });
                Some(local)
            }
        };
        match config.source.clone() {
            AgentSource::Dir { path, poll_every } => {
                let stop = stopped(stop_rx.clone());
                tasks.spawn(async move {
                    let cfg = DirConfig {
                        poll_every,
                        term: 0,
                    };
                    tokio::select! {
                        () = crate::run_dir_source(path, cfg, events) => {}
                        () = stop => {}
                    }
                });
            }
            AgentSource::Kube {
                node_name,
                lease_namespace,
                watch_device_taint_rules,
                relay_advertise,
            } => {
                let client = kube::Client::try_default()
                    .await
                    .context("building the Kubernetes client (in-cluster config or kubeconfig)")?;
                let mut cfg = crate::KubeSourceConfig::new(&node_name);
                cfg.watch_device_taint_rules = watch_device_taint_rules;
                cfg.lease = lease_namespace.map(|ns| {
                    let mut l =
                        crate::LeaseConfig::new(&ns, &format!("dramesh-agent-{cluster}"), &name);
                    l.relay_addr = relay_advertise.clone();
                    l
                });
                if cfg.lease.is_some() {
                    let (tx, rx) = watch::channel(RelayView::None);
                    cfg.relay_view = Some(Arc::new(tx));
                    let (mesh, stop) = (mesh.clone(), stopped(stop_rx.clone()));
                    let relays = relay_advertise.is_some();
                    tasks.spawn(async move {
                        tokio::select! {
                            () = follow_relay(rx, mesh, relays) => {}
                            () = stop => {}
                        }
                    });
                }
                let stop = stopped(stop_rx.clone());
                tasks.spawn(async move {
                    tokio::select! {
                        r = crate::run_kube_source(client, cfg, events) => {
                            if let Err(e) = r {
                                tracing::error!(error = %e, "kube source stopped");
                            }
                        }
                        () = stop => {}
                    }
                });
            }
        }
        if let Some(files) = config.credentials.clone() {
            let (mesh, store, stop) = (mesh.clone(), store.clone(), stopped(stop_rx.clone()));
            tasks.spawn(async move {
                tokio::select! {
                    () = reload_credentials(files, mesh, store) => {}
                    () = stop => {}
                }
            });
        }
        let batches = Arc::new(AtomicU64::new(0));
        tasks.spawn(write_batches(
            batches_rx,
            tracker,
            store.clone(),
            mesh.clone(),
            doc,
            batches.clone(),
            observer.metrics.clone(),
        ));
        tracing::info!(%cluster, agent = %name, mesh = %mesh.local_addr(), metrics = ?metrics_addr, "agent started");
        Ok(Agent {
            cluster,
            name,
            mesh,
            stop,
            tasks,
        })
    }

    /// Stops the source (the writer flushes what the coalescer holds) and the mesh node.
    pub async fn shutdown(mut self) {
        dramesh_mesh::daemon::shutdown(&self.stop, &mut self.tasks, self.mesh).await;
        tracing::info!(cluster = %self.cluster, agent = %self.name, "agent stopped");
    }
}

/// What the mesh node does about a [`RelayView`]: (be the relay, the relay to dial). The Lease
/// holder relays only when it has a relay address (`can_relay`); every other agent dials the
/// holder's published relay, or nobody but the replicas when there is none.
fn relay_plan(view: &RelayView, can_relay: bool) -> (bool, Option<&str>) {
    match view {
        RelayView::Me => (can_relay, None),
        RelayView::Holder(addr) => (false, Some(addr.as_str())),
        RelayView::None => (false, None),
    }
}

/// Applies every [`RelayView`] the election publishes to the mesh node (see [`relay_plan`]).
/// A relay address that does not resolve within 5 s is logged and treated as no relay.
async fn follow_relay(
    mut view: watch::Receiver<RelayView>,
    mesh: Arc<MeshHandle>,
    can_relay: bool,
) {
    loop {
        let v = view.borrow_and_update().clone();
        let (relay, target) = relay_plan(&v, can_relay);
        let resolved = match target {
            None => None,
            Some(addr) => {
                let lookup = tokio::time::timeout(
                    Duration::from_secs(5),
                    tokio::net::lookup_host(addr.to_string()),
                )
                .await;
                match lookup {
                    Ok(Ok(mut addrs)) => addrs.next(),
                    Ok(Err(e)) => {
                        tracing::warn!(relay = %addr, error = %e, "the cluster's relay address does not resolve; dialing the replicas");
                        None
                    }
                    Err(_) => {
                        tracing::warn!(relay = %addr, "resolving the cluster's relay address timed out; dialing the replicas");
                        None
                    }
                }
            }
        };
        mesh.set_relay(relay).await;
        mesh.set_relay_target(resolved);
        if view.changed().await.is_err() {
            return;
        }
    }
}

/// Reads `files` every `files.every` and, when their contents changed, switches the mesh to the
/// new certificate (see [`MeshHandle::rotate_identity`]). A credential that does not load (a
/// pair read mid-rotation, a certificate for another identity) is logged and tried again at the
/// next read; the node keeps its current one meanwhile.
pub async fn reload_credentials(
    files: CredentialFiles,
    mesh: Arc<MeshHandle>,
    store: Arc<Mutex<MeshStore>>,
) {
    let read = |files: &CredentialFiles| -> Option<[u8; 32]> {
        use sha2::Digest as _;
        let mut h = sha2::Sha256::new();
        for p in [&files.cert, &files.key, &files.ca] {
            h.update(dramesh_mesh::certs::read_pem_file(p).ok()?);
            h.update([0]);
        }
        Some(h.finalize().into())
    };
    let mut current = read(&files);
    let mut tick = tokio::time::interval(files.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let seen = read(&files);
        if seen.is_none() || seen == current {
            continue;
        }
        let loaded = dramesh_mesh::certs::load_identity(&files.cert, &files.key, &files.ca)
            .map_err(|e| e.to_string())
            .and_then(|id| mesh.rotate_identity(&id, &store).map_err(|e| e.to_string()));
        match loaded {
            Ok(()) => current = seen,
            Err(error) => {
                tracing::warn!(%error, cert = %files.cert.display(), "rotated mesh credential not loaded; keeping the current one");
            }
        }
    }
}

/// `GET /metrics` of the agent: refreshed from the mesh and store, then rendered.
async fn scrape(
    axum::extract::State(observer): axum::extract::State<Arc<Observer>>,
) -> impl axum::response::IntoResponse {
    observer.refresh(Vec::new()).await;
    (
        [(
            axum::http::header::CONTENT_TYPE,
            dramesh_telemetry::CONTENT_TYPE,
        )],
        observer.metrics.render(),
    )
}

/// Commits each batch as one change of the agent's document, then has the mesh push it.
async fn write_batches(
    mut rx: mpsc::Receiver<Batch>,
    mut tracker: ScopeTracker,
    store: Arc<Mutex<MeshStore>>,
    mesh: Arc<MeshHandle>,
    doc: DocId,
    count: Arc<AtomicU64>,
    metrics: Arc<Metrics>,
) {
    let mut term: Option<u64> = None;
    while let Some(batch) = rx.recv().await {
        let scope = batch.scope.clone();
        let snapshot = batch.snapshot;
        let new_term = match &scope {
            Scope::Cluster { term: t } if term != Some(*t) => Some(*t),
            _ => None,
        };
        let changes = tracker.changes_for(batch);
        let n = changes.len();
        let store = store.clone();
        let d = doc.clone();
        let span = dramesh_telemetry::sync_span("*");
        span.record(fields::CLUSTER, doc.cluster.as_str());
        record_count(&span, fields::CHANGES_APPLIED, n as u64);
        let in_task = span.clone();
        let r = tokio::task::spawn_blocking(move || -> Result<(), dramesh_store::StoreError> {
            let _entered = in_task.enter();
            // The store guards plain data, consistent between calls: a panic elsewhere that
            // poisoned it does not stop publishing.
            let mut s = store
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(t) = new_term {
                s.set_lease_term(&d, t)?;
            }
            s.apply(&d, changes)?;
            Ok(())
        })
        .await;
        match r {
            Ok(Ok(())) => {
                if let Some(t) = new_term {
                    term = Some(t);
                }
                count.fetch_add(1, Ordering::Relaxed);
                metrics.agent_batches_total.with(["ok"]).inc();
                span.record(fields::OTEL_STATUS_CODE, "ok");
                tracing::debug!(parent: &span, %scope, snapshot, changes = n, "batch committed");
                mesh.notify_local_change(doc.clone()).instrument(span).await;
            }
            Ok(Err(e)) => {
                metrics.agent_batches_total.with(["error"]).inc();
                span.record(fields::OTEL_STATUS_CODE, "error");
                // The store keeps what it could not persist out of the offered history; the
                // next snapshot (or change of the same keys) writes it again.
                tracing::error!(%scope, error = %e, "batch not committed");
            }
            Err(e) => tracing::error!(error = %e, "batch writer panicked"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::ObjectKind;

    fn up(kind: ObjectKind, name: &str) -> ObjectChange {
        ObjectChange::Upsert {
            key: ObjectKey::new(kind, None, name),
            json: Arc::from(b"{}".as_slice()),
        }
    }

    fn names(changes: &[ObjectChange]) -> Vec<String> {
        changes
            .iter()
            .map(|c| match c {
                ObjectChange::Upsert { key, .. } => format!("+{}", key.name),
                ObjectChange::Delete { key } => format!("-{}", key.name),
            })
            .collect()
    }

    #[test]
    fn only_the_holder_with_an_address_relays_and_the_others_follow_it() {
        assert_eq!(relay_plan(&RelayView::Me, true), (true, None));
        assert_eq!(relay_plan(&RelayView::Me, false), (false, None));
        let h = RelayView::Holder("10.0.0.1:7947".into());
        assert_eq!(relay_plan(&h, true), (false, Some("10.0.0.1:7947")));
        assert_eq!(relay_plan(&RelayView::None, true), (false, None));
    }

    #[test]
    fn snapshot_replaces_only_its_scope() {
        let mut t = ScopeTracker::default();
        let node = |changes, snapshot| Batch {
            scope: Scope::Node("n".into()),
            changes,
            snapshot,
        };
        let cluster = |changes, snapshot| Batch {
            scope: Scope::Cluster { term: 1 },
            changes,
            snapshot,
        };
        t.changes_for(node(
            vec![up(ObjectKind::Node, "a"), up(ObjectKind::Node, "b")],
            true,
        ));
        t.changes_for(cluster(vec![up(ObjectKind::DeviceClass, "c1")], true));
        let out = t.changes_for(node(vec![up(ObjectKind::Node, "a")], true));
        assert_eq!(names(&out), ["+a", "-b"]);
        let out = t.changes_for(cluster(vec![], true));
        assert_eq!(names(&out), ["-c1"]);
        // Incremental batches delete nothing on their own.
        let out = t.changes_for(node(vec![up(ObjectKind::Node, "z")], false));
        assert_eq!(names(&out), ["+z"]);
    }

    #[test]
    fn existing_keys_are_assigned_by_content() {
        let sim = dramesh_sim::generate(&dramesh_sim::demo_fleet()[0]);
        let existing: Vec<(ObjectKey, Arc<[u8]>)> = sim
            .objects
            .iter()
            .map(|o| (o.key(), Arc::from(o.to_json())))
            .collect();
        let kube = ScopeTracker::from_existing(&existing, false);
        let folder = ScopeTracker::from_existing(&existing, true);
        for (k, _) in &existing {
            let want = match k.kind {
                ObjectKind::Node | ObjectKind::Pod | ObjectKind::ResourceSlice => ScopeKind::Node,
                ObjectKind::ResourceClaim => ScopeKind::Node,
                _ => ScopeKind::Cluster,
            };
            assert_eq!(kube.owner[k], want, "{k}");
            assert_eq!(folder.owner[k], ScopeKind::Cluster);
        }
    }
}
