//! A control-plane replica as a running process (`dramesh replica`, or in-process for the
//! demo): the persistent store, the QUIC mesh node, the estimation view fed from the mesh,
//! and the Karmada gRPC, native gRPC and HTTP APIs.
//!
//! Readiness rule (`/readyz`, `ready` in `/v1/status`), re-evaluated every 250 ms:
//! 1. *Caught up*: every document the store held on disk is in the view (the view is built
//!    from the loaded store before anything is served), and then either the anti-entropy
//!    digest of some peer replica has equalled ours once, or no peer replica had a session
//!    with this one within [`ReplicaConfig::ready_timeout`] (a replica started without
//!    seeds does not wait). Once caught up, a replica stays caught up.
//! 2. The view holds at least one member cluster (a fresh fleet is not ready until some
//!    agent publishes).
//! 3. Not every cluster is stale: while all of them are older than `stale_after`, every
//!    Karmada answer would be 0, so the replica reports not ready until one is fresh again.
//!
//! Data age of a cluster (the staleness behind Karmada's zero answers): the time, on this
//! replica's monotonic clock, since a change for one of the cluster's documents was applied
//! here, or since a heartbeat from one of the cluster's agents connected to this replica
//! arrived, whichever is later; heartbeats of an agent whose document the store refuses
//! (e.g. a generation from a clock far ahead) do not count. Clusters loaded from disk count
//! as heard from at start.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use dramesh_api::ApiState;
use dramesh_mesh::PeerIdentity;
use dramesh_mesh::certs::TlsIdentity;
use dramesh_mesh::daemon::{open_store, stopped};
use dramesh_mesh::node::{MeshHandle, NodeConfig};
use dramesh_mesh::observe::{Observer, peer_label};
use dramesh_mesh::protocol::ProtocolConfig;
use dramesh_mesh::store_adapter::MeshStore;
use dramesh_telemetry::spans::{fields, record_count};
use tokio::sync::{broadcast, watch};
use tokio::task::JoinSet;

use crate::backend::ReplicaBackend;
use crate::state::ReplicaState;

/// How a replica is started.
#[derive(Clone)]
pub struct ReplicaConfig {
    /// Mesh certificate; its identity must be `dramesh://replica/<id>`.
    pub identity: TlsIdentity,
    /// UDP address of the mesh endpoint.
    pub listen_mesh: SocketAddr,
    /// TCP address of the HTTP API (native JSON, status page, health, metrics).
    pub api: SocketAddr,
    /// TCP address of the gRPC API (Karmada estimator and `dramesh.v1`).
    pub grpc: SocketAddr,
    /// Mesh addresses of other replicas to dial.
    pub seeds: Vec<SocketAddr>,
    /// Store directory; `None` keeps documents in memory only (demo).
    pub data_dir: Option<PathBuf>,
    /// Karmada answers for a cluster not heard from for this long are 0.
    pub stale_after: Duration,
    /// Bound of the estimator's caches (default [`dramesh_estimator::CacheBound::View`]).
    pub estimate_cache_bound: dramesh_estimator::CacheBound,
    /// Count scale-up headroom from Karpenter NodePools (`--estimate-autoscaler-headroom`):
    /// Karmada answers include it, native estimates report it separately, placement and
    /// preemption count it when a request asks to.
    pub estimate_autoscaler_headroom: bool,
    /// Replication switches and limits of the mesh node.
    pub protocol: ProtocolConfig,
    /// Threads checking writers' signatures on received changes ahead of the mesh's protocol
    /// thread ([`NodeConfig::verify_threads`]; 0: on that thread). `None`: the node's default,
    /// the CPUs this process may use.
    pub mesh_verify_threads: Option<usize>,
    /// How long a starting replica waits for a peer replica to be reachable before it counts
    /// as caught up from its disk alone (see the module docs).
    pub ready_timeout: Duration,
    /// Limits, deadlines, connection bounds and TLS of the HTTP and gRPC APIs.
    pub api_config: dramesh_api::ApiConfig,
    /// Who may call the APIs (credentials, verbs).
    pub auth: Arc<dramesh_api::auth::Auth>,
    /// Per-identity caps of reservations.
    pub caps: dramesh_api::auth::Caps,
    /// The Karmada scheduler role, when this replica schedules bindings.
    pub scheduler: Option<crate::SchedulerRole>,
}

/// Default of [`ReplicaConfig::ready_timeout`] (and of `--ready-timeout`).
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running replica.
pub struct Replica {
    /// The replica id from the certificate.
    pub id: String,
    /// What the APIs answer from.
    pub state: Arc<ReplicaState>,
    /// Bound mesh address.
    pub mesh_addr: SocketAddr,
    /// Bound HTTP API address.
    pub http_addr: SocketAddr,
    /// Bound gRPC API address.
    pub grpc_addr: SocketAddr,
    mesh: Arc<MeshHandle>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Replica {
    /// Opens the store, builds the view, starts the mesh and the API servers.
    pub async fn start(config: ReplicaConfig) -> anyhow::Result<Replica> {
        let id = match &config.identity.identity {
            PeerIdentity::Replica { id } => id.clone(),
            other => anyhow::bail!("the mesh certificate is for {other}, not a replica"),
        };
        let dir = config.data_dir.clone();
        let what = format!("replica {id}");
        let store = tokio::task::spawn_blocking(move || {
            open_store(dir.as_deref(), &what).with_context(|| match &dir {
                Some(d) => format!("{what}: opening the store in {}", d.display()),
                None => format!("{what}: opening the store"),
            })
        })
        .await
        .context("store loader panicked")??;
        let store = Arc::new(Mutex::new(MeshStore::new(store, true)));
        let state = {
            let store = store.clone();
            let id = id.clone();
            let stale = config.stale_after;
            let cache_bound = config.estimate_cache_bound;
            let headroom = config.estimate_autoscaler_headroom;
            let caps = config.caps;
            tokio::task::spawn_blocking(move || {
                let state = ReplicaState::new(&id, stale, store);
                state.set_estimate_cache_bound(cache_bound);
                state.set_autoscaler_headroom(headroom);
                state.set_caps(caps);
                state
            })
            .await
            .context("view builder panicked")?
        };
        let (loaded_nodes, loaded_clusters) = state.with_view(|v| {
            let nodes: usize = v.clusters().map(|c| c.node_count()).sum();
            (nodes, v.clusters().count())
        });
        let metrics = Arc::new(dramesh_telemetry::Metrics::new());
        // Before anything listens: an unusable kubeconfig fails the start cleanly.
        let karmada = match &config.scheduler {
            Some(role) => {
                let opts = crate::karmada::KarmadaOptions::new(&role.name, &id);
                let client = crate::karmada::KarmadaClient::from_kubeconfig(&role.kubeconfig, opts)
                    .await
                    .with_context(|| format!("replica {id}: the scheduler role"))?;
                Some((
                    Arc::new(client),
                    role.clone(),
                    crate::scheduler::SchedulerMetrics::register(&metrics),
                ))
            }
            None => None,
        };
        let api = ApiState::new(Arc::new(ReplicaBackend {
            state: state.clone(),
        }))
        .with_metrics(metrics.clone())
        .with_config(config.api_config.clone())
        .with_auth(config.auth.clone());
        let mut node = NodeConfig::new(config.identity.clone(), config.listen_mesh);
        node.seeds = config.seeds.clone();
        node.protocol = config.protocol.clone();
        if let Some(n) = config.mesh_verify_threads {
            node.verify_threads = n;
        }
        let mesh = Arc::new(
            MeshHandle::start(node, store.clone())
                .await
                .with_context(|| {
                    format!("replica {id}: starting the mesh on {}", config.listen_mesh)
                })?,
        );
        let http = tokio::net::TcpListener::bind(config.api)
            .await
            .with_context(|| format!("replica {id}: binding the HTTP API on {}", config.api))?;
        let grpc = tokio::net::TcpListener::bind(config.grpc)
            .await
            .with_context(|| format!("replica {id}: binding the gRPC API on {}", config.grpc))?;
        let http_addr = http.local_addr()?;
        let grpc_addr = grpc.local_addr()?;
        let observer = Observer::new(metrics, mesh.clone(), store.clone());
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        {
            let router = crate::routes::router(api.clone(), state.clone(), observer.clone());
            let router = dramesh_api::with_auth(router, &api);
            let shutdown = stopped(stop_rx.clone());
            let api = api.clone();
            tasks.spawn(async move {
                if let Err(e) = dramesh_api::serve_router(http, router, &api, shutdown).await {
                    tracing::error!(error = %e, "HTTP API failed");
                }
            });
        }
        {
            let api = api.clone();
            let shutdown = stopped(stop_rx.clone());
            tasks.spawn(async move {
                if let Err(e) = dramesh_api::serve_grpc_on(grpc, api, shutdown).await {
                    tracing::error!(error = %e, "gRPC API failed");
                }
            });
        }
        tasks.spawn(feed(
            mesh.subscribe(),
            observer,
            state.clone(),
            stop_rx.clone(),
        ));
        let (peers_tx, peers_rx) = watch::channel(crate::members::Peers::default());
        tasks.spawn(readiness(
            mesh.clone(),
            state.clone(),
            api.clone(),
            if config.seeds.is_empty() {
                Duration::ZERO
            } else {
                config.ready_timeout
            },
            peers_tx,
            stop_rx.clone(),
        ));
        tasks.spawn(push_own_docs(mesh.clone(), state.clone(), stop_rx.clone()));
        if let Some((client, role, metrics)) = karmada {
            tasks.spawn(crate::scheduler::run(
                state.clone(),
                client,
                role,
                metrics,
                Some(peers_rx),
                stop_rx.clone(),
            ));
        }
        tasks.spawn(watch_agents(mesh.clone(), state.clone(), stop_rx));
        tracing::info!(
            replica = %id,
            mesh = %mesh.local_addr(),
            http = %http_addr,
            grpc = %grpc_addr,
            api_tls = api.config.tls.is_some(),
            clusters = loaded_clusters,
            nodes = loaded_nodes,
            ready = api.is_ready(),
            "replica started"
        );
        Ok(Replica {
            id,
            state,
            mesh_addr: mesh.local_addr(),
            http_addr,
            grpc_addr,
            mesh,
            stop,
            tasks,
        })
    }

    /// Stops the APIs, the feeder and the mesh node.
    pub async fn shutdown(mut self) {
        dramesh_mesh::daemon::shutdown(&self.stop, &mut self.tasks, self.mesh).await;
        tracing::info!(replica = %self.id, "replica stopped");
    }
}

/// Moves the store's queued view changes into the view whenever the mesh applied something,
/// and every 250 ms regardless (a lagging broadcast receiver skips notifications).
async fn feed(
    mut applied: broadcast::Receiver<dramesh_mesh::node::AppliedChange>,
    observer: Arc<Observer>,
    state: Arc<ReplicaState>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        let mut touched = BTreeSet::new();
        let mut from = BTreeSet::new();
        tokio::select! {
            r = applied.recv() => match r {
                Ok(a) => {
                    observer.applied(&a);
                    from.insert(peer_label(&a.from));
                    touched.insert(a.doc.cluster);
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::debug!(skipped = n, "applied-change notifications skipped");
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = tick.tick() => {}
            _ = stop.wait_for(|v| *v) => return,
        }
        while let Ok(a) = applied.try_recv() {
            observer.applied(&a);
            from.insert(peer_label(&a.from));
            touched.insert(a.doc.cluster);
        }
        // One `mesh.sync` span per round that brought remote changes into the view.
        let span = (!touched.is_empty()).then(|| {
            let span = dramesh_telemetry::sync_span(&join(&from));
            span.record(fields::CLUSTER, join(&touched).as_str());
            span
        });
        let state = state.clone();
        let r = tokio::task::spawn_blocking(move || {
            let _entered = span.as_ref().map(|s| s.enter());
            let now = Instant::now();
            let applied = state.catch_up();
            if let Some(s) = &span {
                record_count(s, fields::CHANGES_APPLIED, applied as u64);
            }
            for c in &touched {
                // The replicas' own documents are not member-cluster data: they never refresh it.
                if !dramesh_store::is_replica_scope(c) {
                    state.touch(c, now);
                }
            }
            state.sweep_reservations();
        })
        .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "applying changes to the view panicked");
        }
    }
}

fn join(set: &BTreeSet<String>) -> String {
    set.iter().map(String::as_str).collect::<Vec<_>>().join(",")
}

/// Keeps the API's ready flag to the rule in the module docs, and tells the scheduler role
/// which peer replicas are alive and whether this one caught up (`peers`, see
/// [`crate::members`]). `wait` is how long to wait for a peer replica to be reachable at all.
async fn readiness(
    mesh: Arc<MeshHandle>,
    state: Arc<ReplicaState>,
    api: ApiState,
    wait: Duration,
    peers: watch::Sender<crate::members::Peers>,
    mut stop: watch::Receiver<bool>,
) {
    let started = Instant::now();
    let mut caught_up = false;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|v| *v) => return,
        }
        let now = Instant::now();
        let connected = mesh.peers().await;
        let alive: BTreeSet<String> = connected
            .iter()
            .filter(|p| {
                p.hello_received
                    && now.saturating_duration_since(p.last_heard) < crate::members::LIVE_WINDOW
            })
            .filter_map(|p| match &p.identity {
                PeerIdentity::Replica { id } => Some(id.clone()),
                _ => None,
            })
            .collect();
        if !caught_up {
            let replicas: Vec<_> = connected
                .iter()
                .filter(|p| p.identity.is_replica() && p.hello_received)
                .collect();
            if let Some(p) = replicas.iter().find(|p| p.digest_matched) {
                caught_up = true;
                tracing::info!(peer = %p.identity, after_ms = started.elapsed().as_millis() as u64, "caught up: digest matched a peer replica's");
            } else if replicas.is_empty() && started.elapsed() >= wait {
                caught_up = true;
                tracing::info!(
                    waited_ms = wait.as_millis() as u64,
                    "no peer replica reachable: caught up from the store on disk"
                );
            }
        }
        peers.send_if_modified(|p| {
            let changed = p.alive != alive || p.caught_up != caught_up;
            p.alive = alive;
            p.caught_up = caught_up;
            changed
        });
        let (has_cluster, all_stale) = {
            let state = state.clone();
            match tokio::task::spawn_blocking(move || {
                (
                    state.with_view(|v| v.clusters().next().is_some()),
                    state.all_stale(),
                )
            })
            .await
            {
                Ok(r) => r,
                Err(_) => continue,
            }
        };
        let ready = caught_up && has_cluster && !all_stale;
        if ready != api.is_ready() {
            api.set_ready(ready);
            tracing::info!(
                ready,
                caught_up,
                has_cluster,
                all_stale,
                "readiness changed"
            );
        }
    }
}

/// Heartbeats of directly connected agents keep their cluster's data fresh, unless the store
/// refuses the agent's document: a heartbeat says the agent is alive, not that its data
/// arrives.
async fn watch_agents(
    mesh: Arc<MeshHandle>,
    state: Arc<ReplicaState>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|v| *v) => return,
        }
        for p in mesh.peers().await {
            if let PeerIdentity::Agent { cluster, .. } = &p.identity
                && p.hello_received
                && p.refused.is_none()
            {
                state.touch(cluster, p.last_heard);
            }
        }
    }
}

/// Offers this replica's reservation and retirement documents to every peer as soon as one
/// was written (anti-entropy would deliver them too, within seconds; offering an unchanged
/// document costs one heads comparison per peer).
async fn push_own_docs(
    mesh: Arc<MeshHandle>,
    state: Arc<ReplicaState>,
    mut stop: watch::Receiver<bool>,
) {
    let docs = [
        dramesh_store::DocId::reservations(state.replica.clone()),
        dramesh_store::DocId::retired(state.replica.clone()),
    ];
    let changed = state.own_docs_changed.clone();
    loop {
        let written = tokio::select! {
            _ = changed.notified() => true,
            _ = stop.wait_for(|v| *v) => false,
        };
        if !written {
            return;
        }
        for doc in &docs {
            mesh.notify_local_change(doc.clone()).await;
        }
    }
}
