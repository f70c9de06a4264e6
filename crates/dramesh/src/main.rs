//! `dramesh`: device-aware multi-cluster estimation for Kubernetes DRA.
//!
//! Exit codes: 0 when the inputs were valid (whatever the answer), 2 when an input cannot be
//! read or is not valid, 1 for any other failure.

mod allocate;
mod apiauth;
mod certs;
mod demo;
mod fds;
mod memlimit;
mod plan;
mod retire;
mod table;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

/// mimalloc instead of glibc malloc. A replica holds ~100,000 automerge documents and its
/// protocol, QUIC and store threads allocate and free small objects across threads all the
/// time; glibc's arenas spent 30-40 % of the mesh's CPU consolidating free chunks at that
/// size, and with mimalloc the fleet-scale mesh bench healed in half the time with a tenth of
/// the steady propagation latency (docs/performance.md, "Allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// What `dramesh --version` prints after the name: the release, the git commit it was built
/// from (see `build.rs`), and the versions of the mesh protocol and the store's files this
/// build speaks (ARCHITECTURE.md, "Compatibility").
static LONG_VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    use dramesh_mesh::version as mesh;
    format!(
        "{}\ncommit: {}\nmesh protocol: {}.{} (accepts peers of minor {}..={}; features: {})\nstore format: {}.{} (reads every {}.x)",
        env!("CARGO_PKG_VERSION"),
        env!("DRAMESH_GIT_COMMIT"),
        mesh::PROTOCOL_MAJOR,
        mesh::PROTOCOL_MINOR,
        mesh::PROTOCOL_MINOR.saturating_sub(mesh::MINOR_WINDOW),
        mesh::PROTOCOL_MINOR + mesh::MINOR_WINDOW,
        mesh::FEATURES.join(", "),
        dramesh_store::STORE_FORMAT,
        dramesh_store::STORE_FORMAT_MINOR,
        dramesh_store::STORE_FORMAT,
    )
});

#[derive(Parser)]
#[command(
    name = "dramesh",
    version,
    long_version = LONG_VERSION.as_str(),
    about = "Device-aware estimation, placement and preemption for multi-cluster Kubernetes DRA"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub(crate) enum Output {
    #[default]
    Table,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Allocate the claims of one pod on one node, exactly as kube-scheduler would.
    ///
    /// Inputs: DeviceClass, ResourceSlice, Node, DeviceTaintRule and ResourceClaim manifests.
    /// A ResourceClaim with status.allocation is an existing allocation; every other
    /// ResourceClaim belongs to the pod being allocated, in input order.
    Allocate {
        /// Node to allocate on.
        #[arg(long)]
        node: String,
        /// Manifest file or directory (YAML, multi-document, kind: List, or JSON). Repeatable.
        #[arg(short = 'f', long = "filename", required = true)]
        files: Vec<PathBuf>,
        /// Kubernetes minor version whose allocator semantics to use.
        #[arg(long, default_value = "1.36", value_parser = ["1.34", "1.35", "1.36"])]
        kubernetes_version: String,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Max replicas of a workload per member cluster (Karmada MaxAvailableReplicas, device-aware).
    ///
    /// SNAPSHOT holds one folder per member cluster (folder name = cluster name) with YAML of
    /// Nodes, Pods, ResourceSlices, DeviceClasses, ResourceClaims and an optional cluster.yaml.
    Estimate {
        #[arg(long)]
        snapshot: PathBuf,
        /// Deployment, StatefulSet, Job or Pod, plus the ResourceClaimTemplates it references.
        #[arg(short = 'w', long, required = true)]
        workload: Vec<PathBuf>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Spread a workload's replicas over member clusters by a Karmada PropagationPolicy.
    Place {
        #[arg(long)]
        snapshot: PathBuf,
        #[arg(short = 'w', long, required = true)]
        workload: Vec<PathBuf>,
        /// PropagationPolicy or ClusterPropagationPolicy YAML (default: one beside the workload).
        #[arg(long)]
        policy: Option<PathBuf>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Choose lower-priority workloads to evict so a workload fits (device-aware).
    Preempt {
        #[arg(long)]
        snapshot: PathBuf,
        #[arg(short = 'w', long, required = true)]
        workload: Vec<PathBuf>,
        /// Restrict the candidate clusters to a policy's cluster affinity.
        #[arg(long)]
        policy: Option<PathBuf>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Write a development CA and mesh certificates (ca.crt/ca.key, replica-<id>.crt/.key,
    /// agent-<cluster>-<name>.crt/.key), and API certificates (api-server.crt/.key,
    /// api-client-<user>.crt/.key). An existing CA in the folder is reused.
    Certs {
        #[arg(long)]
        out: PathBuf,
        /// Replica id (identity dramesh://replica/<id>). Repeatable.
        #[arg(long = "replica")]
        replicas: Vec<String>,
        /// CLUSTER/NAME (identity dramesh://cluster/<cluster>/agent/<name>). Repeatable.
        #[arg(long = "agent")]
        agents: Vec<String>,
        /// Host (DNS name or IP address) of the replicas' API server certificate
        /// (api-server.crt). Repeatable: one certificate for all.
        #[arg(long = "api-server")]
        api_servers: Vec<String>,
        /// USER or USER=GROUP: an API client certificate (api-client-<user>.crt) with
        /// CommonName USER and Organization GROUP. Repeatable.
        #[arg(long = "api-client")]
        api_clients: Vec<String>,
        /// Validity of every certificate, in days.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
    /// Run a control-plane replica: replicated store, QUIC mesh, Karmada + native APIs.
    Replica {
        /// Replica id; must match the certificate's dramesh://replica/<id>.
        #[arg(long)]
        id: String,
        /// UDP address of the mesh endpoint.
        #[arg(long)]
        listen_mesh: String,
        /// HTTP API address (/v1/status, /v1/estimate, /healthz, /readyz, /metrics).
        #[arg(long)]
        api: String,
        /// gRPC address (Karmada Estimator service and dramesh.v1).
        #[arg(long)]
        grpc: String,
        /// Mesh address of another replica to dial. Repeatable.
        #[arg(long = "seed")]
        seeds: Vec<String>,
        #[arg(long)]
        data_dir: PathBuf,
        #[arg(long)]
        mesh_cert: PathBuf,
        #[arg(long)]
        mesh_key: PathBuf,
        #[arg(long)]
        mesh_ca: PathBuf,
        /// Karmada estimates answer 0 for a cluster not heard from for this many seconds.
        #[arg(long, default_value_t = 120)]
        stale_after: u64,
        /// Byte bound of the estimator's result caches (least recently used evicted first).
        /// Default: a quarter of the view's estimated size, at least 32 MiB and at most 512 MiB.
        #[arg(long)]
        estimate_cache_bytes: Option<usize>,
        /// Count scale-up headroom: the replicas new nodes of a cluster's Karpenter NodePools
        /// could hold within their limits. Karmada answers include it; native answers report
        /// it as headroomReplicas; placement and preemption count it when a request asks to.
        #[arg(long)]
        estimate_autoscaler_headroom: bool,
        /// Seconds a restarted replica waits for a peer replica to be reachable before it is
        /// ready from its disk alone (with a peer, it is ready once their digests matched).
        #[arg(long, default_value_t = dramesh_replica::DEFAULT_READY_TIMEOUT.as_secs())]
        ready_timeout: u64,
        /// Threads checking writers' signatures on received changes ahead of the mesh's
        /// protocol thread (0: on that thread; at most 256). Default: the CPUs this process
        /// may use (its cgroup's CPU quota counts).
        #[arg(long, value_parser = clap::value_parser!(u16).range(0..=256))]
        mesh_verify_threads: Option<u16>,
        /// Chaos testing only: no digest probes (anti-entropy).
        #[arg(long)]
        chaos_disable_anti_entropy: bool,
        /// Chaos testing only: no immediate push or relay of changes.
        #[arg(long)]
        chaos_disable_push: bool,
        /// Chaos testing only: no PeerExchange, so agents know only the replicas they dial.
        #[arg(long, hide = true)]
        chaos_disable_peer_exchange: bool,
        #[command(flatten)]
        limits: ApiLimitArgs,
        #[command(flatten)]
        security: Box<apiauth::ApiAuthArgs>,
        /// Kubeconfig of the Karmada API server: this replica then schedules the
        /// ResourceBindings and ClusterResourceBindings whose spec.schedulerName is
        /// --scheduler-name.
        #[arg(long)]
        karmada_kubeconfig: Option<PathBuf>,
        /// The scheduler name this replica answers to (with --karmada-kubeconfig).
        #[arg(long, default_value = dramesh_replica::DEFAULT_SCHEDULER_NAME, requires = "karmada_kubeconfig")]
        scheduler_name: String,
        /// Milliseconds a scheduling decision's reservations wait for other replicas'
        /// earlier ones before their admission is checked (with --karmada-kubeconfig).
        #[arg(long, default_value_t = dramesh_replica::DEFAULT_SETTLE.as_millis() as u64, requires = "karmada_kubeconfig")]
        scheduler_settle_ms: u64,
        /// When a decision's reservations are confirmed against other replicas':
        /// after-write (write at once; a loser's replicas move one settle window later),
        /// before-write (wait the settle window first), or strict (a majority of the
        /// --scheduler-members replicas must hold them first; no overcommit, partitions
        /// included, and no device decision without a majority).
        #[arg(long, default_value = "after-write", requires = "karmada_kubeconfig")]
        scheduler_confirm: dramesh_replica::Confirm,
        /// How many replicas have the scheduler role (the StatefulSet's replicas): strict
        /// confirmation needs a majority of them.
        #[arg(long, requires = "karmada_kubeconfig", required_if_eq("scheduler_confirm", "strict"),
            value_parser = clap::value_parser!(u32).range(1..))]
        scheduler_members: Option<u32>,
        /// Whether the replicas with the same --scheduler-name split the bindings among
        /// themselves (each binding decided by one live replica, by rendezvous hashing of
        /// its uid); false: every replica decides every binding.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set, requires = "karmada_kubeconfig")]
        scheduler_shard: bool,
        /// Nice value asked for the scheduler role's deciding thread (-20..19; 0: the
        /// process's). Decisions are made one at a time on it, so on a busy machine its
        /// priority sets the latency tail. A value below the process's needs CAP_SYS_NICE;
        /// without it the thread keeps the process's priority (logged, and shown by
        /// dramesh_scheduler_decider_nice).
        #[arg(long, default_value_t = dramesh_replica::DEFAULT_DECIDER_NICE,
            allow_negative_numbers = true, requires = "karmada_kubeconfig",
            value_parser = clap::value_parser!(i32).range(-20..=19))]
        scheduler_decider_nice: i32,
        /// OTLP/gRPC collector for spans (http://host:4317); default $OTEL_EXPORTER_OTLP_ENDPOINT, else no export.
        #[arg(long)]
        otlp_endpoint: Option<String>,
    },
    /// Run a member-cluster agent publishing DRA inventory to the replicas.
    Agent {
        /// Member cluster name; must match the certificate.
        #[arg(long)]
        cluster: String,
        /// Agent (writer) name; must match the certificate's dramesh://cluster/<c>/agent/<name>.
        #[arg(long)]
        agent_name: String,
        #[arg(long, value_enum)]
        source: SourceKind,
        /// Folder of manifests standing for the cluster (--source dir).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Folder poll period in milliseconds (--source dir).
        #[arg(long, default_value_t = 500)]
        poll_ms: u64,
        /// Node this agent runs on (--source kube); defaults to the agent name.
        #[arg(long, env = "NODE_NAME")]
        node_name: Option<String>,
        /// Namespace of the Lease electing the cluster-scoped publisher (--source kube);
        /// without it this agent publishes cluster-scoped records unconditionally.
        #[arg(long)]
        lease_namespace: Option<String>,
        /// Also watch resource.k8s.io/v1beta2 DeviceTaintRules (--source kube).
        #[arg(long)]
        watch_device_taint_rules: bool,
        /// HOST:PORT at which the cluster's node agents reach this agent's mesh endpoint
        /// (--source kube with --lease-namespace; --listen needs a fixed port). While this
        /// agent holds the Lease it is the cluster's relay and publishes the address on the
        /// Lease; every other agent then dials it instead of the replicas.
        #[arg(long, requires = "lease_namespace")]
        relay_advertise: Option<String>,
        /// Mesh address of a replica. Repeatable; more are learned from the replicas.
        #[arg(long = "replica", required = true)]
        replicas: Vec<String>,
        /// Local UDP address to bind.
        #[arg(long, default_value = "0.0.0.0:0")]
        listen: String,
        #[arg(long)]
        data_dir: PathBuf,
        /// Certificate chain file (with --mesh-key), e.g. a node's hostPath tls.crt.
        #[arg(long, requires = "mesh_key")]
        mesh_cert: Option<PathBuf>,
        /// Private key file (with --mesh-cert).
        #[arg(long, requires = "mesh_cert")]
        mesh_key: Option<PathBuf>,
        /// The kubelet's Pod Certificates credential bundle (the private key, then the chain
        /// the dramesh signer issued), instead of --mesh-cert and --mesh-key.
        #[arg(long, conflicts_with_all = ["mesh_cert", "mesh_key"], required_unless_present = "mesh_cert")]
        mesh_credential_bundle: Option<PathBuf>,
        #[arg(long)]
        mesh_ca: PathBuf,
        /// Seconds between reads of the credential files: a rotated certificate is used for
        /// new connections without a restart (0: never read again).
        #[arg(long, default_value_t = 60)]
        mesh_reload_secs: u64,
        /// Serve Prometheus /metrics on this TCP address (the agent has no other HTTP listener).
        #[arg(long)]
        metrics: Option<String>,
        /// Open connections of the --metrics listener at most (see README, "Bounds").
        #[arg(long, default_value_t = 64)]
        max_http_connections: usize,
        /// Seconds a client has to send a request's headers; also the keep-alive idle timeout.
        #[arg(long, default_value_t = 10)]
        header_timeout: u64,
        /// OTLP/gRPC collector for spans (http://host:4317); default $OTEL_EXPORTER_OTLP_ENDPOINT, else no export.
        #[arg(long)]
        otlp_endpoint: Option<String>,
        /// Start a new generation of this agent's document that asks to rejoin the fleet: the
        /// only way a cluster retired with `dramesh retire` comes back (replicas refuse what
        /// was published before, and every later generation that does not rejoin, whether
        /// a rollover or a fresh data directory started it). A one-time action: leave it out
        /// of the agent's usual arguments, or every restart rejoins.
        #[arg(long)]
        rejoin: bool,
    },
    /// Run the Pod Certificates signer of a member cluster: issues each agent pod the identity
    /// dramesh://cluster/<cluster>/agent/<node> of the node the API server attests.
    Signer {
        /// Member cluster named in every identity.
        #[arg(long)]
        cluster: String,
        /// Signer name the agent DaemonSet's podCertificate volume requests.
        #[arg(long, default_value = "dramesh.io/agent")]
        signer_name: String,
        /// Namespace of the agent DaemonSet.
        #[arg(long, default_value = "dramesh-system")]
        agent_namespace: String,
        /// Service account of the agent DaemonSet.
        #[arg(long, default_value = "dramesh-agent")]
        agent_service_account: String,
        /// Signing CA certificate (PEM; intermediates up to the mesh CA may follow it).
        #[arg(long)]
        ca_cert: PathBuf,
        /// Signing CA private key (PEM).
        #[arg(long)]
        ca_key: PathBuf,
        /// Longest certificate lifetime in seconds (shortened to a request's
        /// maxExpirationSeconds; at least 3600).
        #[arg(long, default_value_t = 86_400)]
        lifetime_secs: i64,
        /// OTLP/gRPC collector for spans (http://host:4317); default $OTEL_EXPORTER_OTLP_ENDPOINT, else no export.
        #[arg(long)]
        otlp_endpoint: Option<String>,
    },
    /// Retire a member cluster from the fleet: every replica drops its data, now and after
    /// partitions heal and restarts, until one of its agents starts with --rejoin.
    Retire {
        /// The member cluster.
        cluster: String,
        /// HTTP API of any replica: https://host:port (or http://host:port, or host:port for
        /// plain HTTP).
        #[arg(long)]
        api: String,
        /// File holding a bearer token sent as `Authorization: Bearer <token>`.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// CA certificate (PEM) that signed the replica's API certificate (https).
        #[arg(long)]
        ca_file: Option<PathBuf>,
        /// Client certificate (PEM) presented to the replica (https), with --key-file.
        #[arg(long, requires = "key_file")]
        cert_file: Option<PathBuf>,
        /// Private key (PEM) of --cert-file.
        #[arg(long, requires = "cert_file")]
        key_file: Option<PathBuf>,
        /// Seconds to wait for the answer.
        #[arg(long, default_value_t = 10)]
        timeout: u64,
    },
    /// Simulated fleet, 3 replicas and 3 agents in this process: estimates, placement, preemption.
    Demo {
        /// Keep everything running and print the API addresses.
        #[arg(long)]
        serve: bool,
        /// With --api-cert, the demo's APIs serve TLS and answer authenticated callers only
        /// (any client certificate from --api-client-ca); without, plaintext on 127.0.0.1
        /// to anyone.
        #[command(flatten)]
        tls: apiauth::TlsArgs,
        /// OTLP/gRPC collector for spans (http://host:4317); default $OTEL_EXPORTER_OTLP_ENDPOINT, else no export.
        #[arg(long)]
        otlp_endpoint: Option<String>,
    },
}

/// Bounds of a replica's API listeners (README, "Bounds and timeouts").
#[derive(clap::Args, Clone, Copy, Debug)]
struct ApiLimitArgs {
    /// Open connections of the HTTP API at most; lowered to fit the descriptor limit.
    #[arg(long, default_value_t = 512)]
    max_http_connections: usize,
    /// Open connections of the gRPC API at most; lowered to fit the descriptor limit.
    #[arg(long, default_value_t = 512)]
    max_grpc_connections: usize,
    /// Seconds a client has to send a request's headers (HTTP) or the HTTP/2 preface (gRPC);
    /// also how long an idle HTTP keep-alive connection stays open.
    #[arg(long, default_value_t = 10)]
    header_timeout: u64,
    /// Seconds one native API call (estimate, place, preempt, reservations) may compute.
    #[arg(long, default_value_t = 10)]
    request_timeout: u64,
    /// Memory API requests in progress may be charged at once, in bytes (suffixes Ki, Mi, Gi);
    /// one caller at most half. Default: a quarter of the container's memory limit (cgroup),
    /// 1Gi without one.
    #[arg(long, value_parser = parse_bytes)]
    api_max_inflight_bytes: Option<u64>,
}

/// Bytes, optionally with a binary suffix (`512Mi`, `2Gi`).
fn parse_bytes(s: &str) -> Result<u64, String> {
    let (digits, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, ""),
    };
    let mult: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => {
            return Err(format!(
                "{s:?}: expected bytes, optionally with Ki, Mi or Gi"
            ));
        }
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?}: expected a positive number of bytes"))
}

impl ApiLimitArgs {
    /// The API configuration, with connection caps fitted under the descriptor limit
    /// `nofile` (raised at start), leaving the reserve of [`fds::api_cap`].
    fn config(self, nofile: Option<u64>) -> dramesh_api::ApiConfig {
        let header = Duration::from_secs(self.header_timeout.max(1));
        let http = fds::api_cap(nofile, 2, self.max_http_connections);
        let grpc = fds::api_cap(nofile, 2, self.max_grpc_connections);
        if http < self.max_http_connections || grpc < self.max_grpc_connections {
            tracing::warn!(
                nofile,
                http,
                grpc,
                "API connection caps lowered to keep a descriptor reserve for the store and the mesh"
            );
        }
        let d = dramesh_api::ApiConfig::default();
        let budget = self.api_max_inflight_bytes.unwrap_or_else(|| {
            let limit = memlimit::cgroup_memory_limit();
            let b = memlimit::default_budget(limit);
            tracing::info!(
                memory_limit = limit,
                budget = b,
                "API admission budget defaulted from the container's memory limit"
            );
            b
        });
        dramesh_api::ApiConfig {
            budget: dramesh_api::admission::BudgetLimits::new(budget),
            request_timeout: Duration::from_secs(self.request_timeout.max(1)),
            http: dramesh_telemetry::HttpLimits {
                max_connections: http,
                header_timeout: header,
                ..Default::default()
            },
            grpc: dramesh_api::GrpcLimits {
                max_connections: grpc,
                preface_timeout: header,
                ..d.grpc
            },
            ..d
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum SourceKind {
    Dir,
    Kube,
}

/// An error with its exit code: 2 for bad input, 1 otherwise.
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn input(message: impl std::fmt::Display) -> Failure {
        Failure {
            code: 2,
            message: message.to_string(),
        }
    }
}

/// Resolves `host:port` (an IP literal or a name) to one socket address.
fn resolve(addr: &str, flag: &str) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .map_err(|e| anyhow::anyhow!("{flag} {addr}: {e}"))?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{flag} {addr}: resolves to no address"))
}

/// How long a peer name that does not resolve yet is retried at start: replicas of a
/// StatefulSet start in parallel, and a peer's DNS record exists only once its pod does.
const PEER_NAME_PATIENCE: Duration = Duration::from_secs(60);

/// Resolves every `host:port` of `flag` like [`resolve`], retrying those that fail to resolve
/// (not those that are malformed) once a second for up to `patience`, with a warning naming
/// them every 10 s; then fails naming the first that still does not resolve.
async fn resolve_peers(
    addrs: &[String],
    flag: &str,
    patience: Duration,
    lookup: impl AsyncFn(&str) -> std::io::Result<Option<SocketAddr>>,
) -> anyhow::Result<Vec<SocketAddr>> {
    let start = tokio::time::Instant::now();
    let mut warned = start;
    loop {
        let mut out = Vec::with_capacity(addrs.len());
        let mut pending = None;
        for a in addrs {
            match lookup(a).await {
                Ok(Some(sa)) => out.push(sa),
                Ok(None) => pending = pending.or(Some((a, "resolves to no address".to_string()))),
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                    anyhow::bail!("{flag} {a}: {e}")
                }
                Err(e) => pending = pending.or(Some((a, e.to_string()))),
            }
        }
        let Some((a, why)) = pending else {
            return Ok(out);
        };
        let now = tokio::time::Instant::now();
        if now.duration_since(start) >= patience {
            anyhow::bail!("{flag} {a}: {why} (retried for {} s)", patience.as_secs());
        }
        if now.duration_since(warned) >= Duration::from_secs(10) {
            warned = now;
            tracing::warn!(flag, addr = %a, error = %why, "a peer name does not resolve yet; retrying");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// [`resolve_peers`] with the system resolver.
async fn resolve_peers_now(addrs: &[String], flag: &str) -> anyhow::Result<Vec<SocketAddr>> {
    resolve_peers(addrs, flag, PEER_NAME_PATIENCE, async |a: &str| {
        tokio::net::lookup_host(a).await.map(|mut i| i.next())
    })
    .await
}

/// Completes on ctrl-c or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("ctrl-c: shutting down"),
        () = term => tracing::info!("SIGTERM: shutting down"),
    }
}

/// Longest a daemon's graceful stop (API drain, tasks, mesh close) may take after the signal;
/// what is still running then is dropped, so the process exits within [`SHUTDOWN_LIMIT`].
const STOP_GRACE: Duration = Duration::from_millis(3500);
/// Longest the span flush at exit may take.
const FLUSH_GRACE: Duration = Duration::from_millis(500);
/// Longest the runtime waits for blocking tasks (a computation in flight) at exit; they stop
/// at their own deadline, and the process exit ends any that do not.
const RUNTIME_GRACE: Duration = Duration::from_millis(250);
/// What the README promises: a daemon exits this soon after SIGTERM or ctrl-c.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(5);
const _: () = assert!(
    STOP_GRACE.as_millis() + FLUSH_GRACE.as_millis() + RUNTIME_GRACE.as_millis()
        < SHUTDOWN_LIMIT.as_millis()
);

/// Runs a daemon's graceful stop for at most [`STOP_GRACE`].
pub(crate) async fn stop_within(what: &str, stop: impl std::future::Future<Output = ()>) {
    if tokio::time::timeout(STOP_GRACE, stop).await.is_err() {
        tracing::warn!(
            daemon = what,
            grace = ?STOP_GRACE,
            "graceful stop did not finish in time; exiting anyway"
        );
    }
}

/// Tracing setup of a daemon: logs to stderr filtered by `RUST_LOG` (default
/// `default_filter`), spans exported over OTLP when `otlp_endpoint` or
/// `OTEL_EXPORTER_OTLP_ENDPOINT` names a collector.
fn telemetry(
    service: &str,
    instance: String,
    default_filter: &str,
    otlp_endpoint: Option<String>,
) -> dramesh_telemetry::TelemetryConfig {
    let mut cfg = dramesh_telemetry::TelemetryConfig::new(service).with_instance_id(instance);
    cfg.default_filter = default_filter.to_string();
    cfg.otlp_endpoint = otlp_endpoint;
    cfg
}

/// Runs an async command on a multi-threaded runtime with tracing set up by `telemetry`;
/// buffered spans are flushed before returning.
fn daemon(
    telemetry: dramesh_telemetry::TelemetryConfig,
    fut: impl std::future::Future<Output = anyhow::Result<()>>,
) -> Result<(), Failure> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure {
            code: 1,
            message: format!("cannot start the async runtime: {e}"),
        })?;
    let r = rt.block_on(async {
        let guard = dramesh_telemetry::init(&telemetry)?;
        if let Some(ep) = guard.otlp_endpoint() {
            tracing::info!(endpoint = ep, "exporting spans over OTLP");
        }
        let r = fut.await;
        match tokio::time::timeout(FLUSH_GRACE, guard.shutdown()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "flushing spans at exit failed"),
            Err(_) => tracing::warn!(grace = ?FLUSH_GRACE, "flushing spans at exit timed out"),
        }
        r
    });
    // Dropping the runtime would wait for every blocking task, however long it runs.
    rt.shutdown_timeout(RUNTIME_GRACE);
    r.map_err(|e| Failure {
        code: 1,
        message: format!("{e:#}"),
    })
}

fn run_certs(
    out: &std::path::Path,
    replicas: &[String],
    agents: &[String],
    api_servers: &[String],
    api_clients: &[String],
    days: u32,
) -> Result<(), Failure> {
    let mut ids = Vec::new();
    for r in replicas {
        ids.push(certs::replica_identity(r).map_err(|e| Failure::input(format!("{e:#}")))?);
    }
    for a in agents {
        ids.push(certs::agent_identity(a).map_err(|e| Failure::input(format!("{e:#}")))?);
    }
    let api = certs::ApiCerts {
        servers: api_servers.to_vec(),
        clients: api_clients
            .iter()
            .map(|c| certs::api_client(c))
            .collect::<anyhow::Result<_>>()
            .map_err(|e| Failure::input(format!("{e:#}")))?,
    };
    let written = certs::write_all(out, &ids, &api, days).map_err(|e| Failure {
        code: 1,
        message: format!("{e:#}"),
    })?;
    for p in written {
        println!("{}", p.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Allocate {
            node,
            files,
            kubernetes_version,
            output,
        } => allocate::run(&node, &files, &kubernetes_version, output),
        Command::Estimate {
            snapshot,
            workload,
            output,
        } => plan::run_estimate(&snapshot, &workload, output),
        Command::Place {
            snapshot,
            workload,
            policy,
            output,
        } => plan::run_place(&snapshot, &workload, policy.as_deref(), output),
        Command::Preempt {
            snapshot,
            workload,
            policy,
            output,
        } => plan::run_preempt(&snapshot, &workload, policy.as_deref(), output),
        Command::Certs {
            out,
            replicas,
            agents,
            api_servers,
            api_clients,
            days,
        } => run_certs(&out, &replicas, &agents, &api_servers, &api_clients, days),
        Command::Replica {
            id,
            listen_mesh,
            api,
            grpc,
            seeds,
            data_dir,
            mesh_cert,
            mesh_key,
            mesh_ca,
            stale_after,
            estimate_cache_bytes,
            estimate_autoscaler_headroom,
            ready_timeout,
            mesh_verify_threads,
            chaos_disable_anti_entropy,
            chaos_disable_push,
            chaos_disable_peer_exchange,
            limits,
            security,
            karmada_kubeconfig,
            scheduler_name,
            scheduler_settle_ms,
            scheduler_confirm,
            scheduler_members,
            scheduler_shard,
            scheduler_decider_nice,
            otlp_endpoint,
        } => daemon(
            telemetry(
                dramesh_telemetry::SERVICE_REPLICA,
                id.clone(),
                "info",
                otlp_endpoint,
            ),
            async move {
                let identity = dramesh_mesh::certs::load_identity(&mesh_cert, &mesh_key, &mesh_ca)?;
                let security = security.build().await?;
                let want = dramesh_mesh::PeerIdentity::Replica { id: id.clone() };
                if identity.identity != want {
                    anyhow::bail!(
                        "--id {id}: the certificate {} is for {}, not {want}",
                        mesh_cert.display(),
                        identity.identity
                    );
                }
                let protocol = dramesh_mesh::protocol::ProtocolConfig {
                    anti_entropy: !chaos_disable_anti_entropy,
                    push: !chaos_disable_push,
                    peer_exchange: !chaos_disable_peer_exchange,
                    ..Default::default()
                };
                if chaos_disable_anti_entropy || chaos_disable_push || chaos_disable_peer_exchange {
                    tracing::warn!(
                        anti_entropy = protocol.anti_entropy,
                        push = protocol.push,
                        peer_exchange = protocol.peer_exchange,
                        "chaos switches set: replication is deliberately degraded"
                    );
                }
                let r = dramesh_replica::Replica::start(dramesh_replica::ReplicaConfig {
                    identity,
                    listen_mesh: resolve(&listen_mesh, "--listen-mesh")?,
                    api: resolve(&api, "--api")?,
                    grpc: resolve(&grpc, "--grpc")?,
                    seeds: resolve_peers_now(&seeds, "--seed").await?,
                    data_dir: Some(data_dir),
                    stale_after: Duration::from_secs(stale_after),
                    estimate_cache_bound: estimate_cache_bytes
                        .map_or(dramesh_estimator::CacheBound::View, |b| {
                            dramesh_estimator::CacheBound::Bytes(b)
                        }),
                    estimate_autoscaler_headroom,
                    protocol,
                    mesh_verify_threads: mesh_verify_threads.map(usize::from),
                    ready_timeout: Duration::from_secs(ready_timeout),
                    api_config: dramesh_api::ApiConfig {
                        tls: security.tls,
                        ..limits.config(fds::raise_nofile())
                    },
                    auth: security.auth,
                    caps: security.caps,
                    scheduler: karmada_kubeconfig.map(|kubeconfig| {
                        dramesh_replica::SchedulerRole {
                            kubeconfig,
                            name: scheduler_name,
                            settle: Duration::from_millis(scheduler_settle_ms),
                            confirm: scheduler_confirm,
                            shard: scheduler_shard,
                            members: scheduler_members.map_or(1, |m| m as usize),
                            decider_nice: scheduler_decider_nice,
                        }
                    }),
                })
                .await?;
                shutdown_signal().await;
                stop_within("replica", r.shutdown()).await;
                Ok(())
            },
        ),
        Command::Agent {
            cluster,
            agent_name,
            source,
            dir,
            poll_ms,
            node_name,
            lease_namespace,
            watch_device_taint_rules,
            relay_advertise,
            replicas,
            listen,
            data_dir,
            mesh_cert,
            mesh_key,
            mesh_credential_bundle,
            mesh_ca,
            mesh_reload_secs,
            metrics,
            max_http_connections,
            header_timeout,
            otlp_endpoint,
            rejoin,
        } => daemon(
            telemetry(
                dramesh_telemetry::SERVICE_AGENT,
                format!("{cluster}/{agent_name}"),
                "info",
                otlp_endpoint,
            ),
            async move {
                let listen_addr = resolve(&listen, "--listen")?;
                if let Some(relay) = &relay_advertise {
                    if listen_addr.port() == 0 {
                        anyhow::bail!(
                            "--relay-advertise {relay}: node agents dial this agent at a fixed port, so --listen {listen} needs one"
                        );
                    }
                    let bad = relay.len() > dramesh_agent::lease::MAX_RELAY_ADDR
                        || relay
                            .rsplit_once(':')
                            .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err());
                    if bad {
                        anyhow::bail!(
                            "--relay-advertise {relay}: expected HOST:PORT of at most {} bytes",
                            dramesh_agent::lease::MAX_RELAY_ADDR
                        );
                    }
                }
                let (mesh_cert, mesh_key) = match (mesh_credential_bundle, mesh_cert, mesh_key) {
                    (Some(bundle), None, None) => (bundle.clone(), bundle),
                    (None, Some(cert), Some(key)) => (cert, key),
                    _ => anyhow::bail!(
                        "give --mesh-credential-bundle, or both --mesh-cert and --mesh-key"
                    ),
                };
                let identity = dramesh_mesh::certs::load_identity(&mesh_cert, &mesh_key, &mesh_ca)?;
                let credentials = (mesh_reload_secs > 0).then(|| dramesh_agent::CredentialFiles {
                    cert: mesh_cert.clone(),
                    key: mesh_key.clone(),
                    ca: mesh_ca.clone(),
                    every: Duration::from_secs(mesh_reload_secs),
                });
                let want = dramesh_mesh::PeerIdentity::Agent {
                    cluster: cluster.clone(),
                    node: agent_name.clone(),
                };
                if identity.identity != want {
                    anyhow::bail!(
                        "--cluster {cluster} --agent-name {agent_name}: the certificate {} is for {}, not {want}",
                        mesh_cert.display(),
                        identity.identity
                    );
                }
                let source = match source {
                    SourceKind::Dir if agent_name != dramesh_mesh::identity::CLUSTER_PUBLISHER => {
                        anyhow::bail!(
                            "--source dir publishes every node of the cluster, which only the whole-cluster publisher may: use --agent-name {} (certificate dramesh://cluster/{cluster}/agent/{}); replicas refuse other nodes' records from per-node agents",
                            dramesh_mesh::identity::CLUSTER_PUBLISHER,
                            dramesh_mesh::identity::CLUSTER_PUBLISHER
                        );
                    }
                    SourceKind::Dir => dramesh_agent::AgentSource::Dir {
                        path: dir
                            .ok_or_else(|| anyhow::anyhow!("--source dir needs --dir PATH"))?,
                        poll_every: Duration::from_millis(poll_ms.max(10)),
                    },
                    SourceKind::Kube => dramesh_agent::AgentSource::Kube {
                        node_name: node_name.unwrap_or_else(|| agent_name.clone()),
                        lease_namespace,
                        watch_device_taint_rules,
                        relay_advertise: relay_advertise.clone(),
                    },
                };
                let a = dramesh_agent::Agent::start(dramesh_agent::AgentConfig {
                    identity,
                    replicas: resolve_peers_now(&replicas, "--replica").await?,
                    listen: listen_addr,
                    data_dir: Some(data_dir),
                    source,
                    protocol: dramesh_mesh::protocol::ProtocolConfig::default(),
                    coalesce: dramesh_agent::CoalesceConfig::default(),
                    metrics: metrics.map(|m| resolve(&m, "--metrics")).transpose()?,
                    http: dramesh_telemetry::HttpLimits {
                        max_connections: fds::api_cap(fds::raise_nofile(), 1, max_http_connections),
                        header_timeout: Duration::from_secs(header_timeout.max(1)),
                        ..Default::default()
                    },
                    rejoin,
                    credentials,
                })
                .await?;
                shutdown_signal().await;
                stop_within("agent", a.shutdown()).await;
                Ok(())
            },
        ),
        Command::Signer {
            cluster,
            signer_name,
            agent_namespace,
            agent_service_account,
            ca_cert,
            ca_key,
            lifetime_secs,
            otlp_endpoint,
        } => daemon(
            telemetry("dramesh-signer", cluster.clone(), "info", otlp_endpoint),
            async move {
                let read = |p: &PathBuf| {
                    std::fs::read_to_string(p)
                        .map_err(|e| anyhow::anyhow!("reading {}: {e}", p.display()))
                };
                let ca = dramesh_agent::signer::signing_ca(
                    &read(&ca_cert)?,
                    &read(&ca_key)?,
                    &ca_cert.display().to_string(),
                )?;
                if !dramesh_store::valid_segment(&cluster) {
                    anyhow::bail!("--cluster {cluster:?} is not a valid identity segment");
                }
                let config = dramesh_agent::signer::SignerConfig {
                    policy: dramesh_agent::signer::SignerPolicy {
                        signer_name,
                        cluster,
                        namespace: agent_namespace,
                        service_account: agent_service_account,
                        lifetime_secs: lifetime_secs.max(dramesh_agent::signer::MIN_LIFETIME_SECS),
                    },
                    ca,
                    retry_every: Duration::from_secs(5),
                };
                tokio::select! {
                    r = dramesh_agent::signer::run_with_default_client(config) => r,
                    () = shutdown_signal() => Ok(()),
                }
            },
        ),
        Command::Retire {
            cluster,
            api,
            token_file,
            ca_file,
            cert_file,
            key_file,
            timeout,
        } => retire::run(
            &cluster,
            &api,
            &retire::Credentials {
                token_file,
                ca_file,
                cert_file,
                key_file,
            },
            Duration::from_secs(timeout.max(1)),
        ),
        Command::Demo {
            serve,
            tls,
            otlp_endpoint,
        } => daemon(
            telemetry(
                dramesh_telemetry::SERVICE_REPLICA,
                "demo".into(),
                "warn",
                otlp_endpoint,
            ),
            demo::run(serve, tls),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("dramesh: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_name_that_resolves_late_is_waited_for() {
        let tries = Cell::new(0);
        let start = tokio::time::Instant::now();
        let got = resolve_peers(
            &["10.0.0.1:7946".into(), "replica-0.peers:7946".into()],
            "--seed",
            Duration::from_secs(60),
            async |a: &str| {
                if a.starts_with("10.") {
                    return Ok(Some(addr(a)));
                }
                tries.set(tries.get() + 1);
                if tries.get() < 3 {
                    Err(std::io::Error::other("Name or service not known"))
                } else {
                    Ok(Some(addr("10.0.0.2:7946")))
                }
            },
        )
        .await
        .unwrap();
        assert_eq!(got, vec![addr("10.0.0.1:7946"), addr("10.0.0.2:7946")]);
        assert_eq!(tries.get(), 3);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_malformed_address_fails_at_once_and_a_missing_name_after_the_patience() {
        let start = tokio::time::Instant::now();
        let e = resolve_peers(
            &["no-port".into()],
            "--seed",
            Duration::from_secs(60),
            async |_: &str| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "invalid socket address",
                ))
            },
        )
        .await
        .unwrap_err();
        assert_eq!(e.to_string(), "--seed no-port: invalid socket address");
        assert_eq!(start.elapsed(), Duration::ZERO);

        let e = resolve_peers(
            &["gone:7946".into()],
            "--replica",
            Duration::from_secs(60),
            async |_: &str| Ok(None),
        )
        .await
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "--replica gone:7946: resolves to no address (retried for 60 s)"
        );
        assert_eq!(start.elapsed(), Duration::from_secs(60));
    }
}
