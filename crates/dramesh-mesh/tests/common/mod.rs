//! Test helpers shared by the loopback QUIC tests.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dramesh_mesh::PeerIdentity;
use dramesh_mesh::certs::TlsIdentity;
use dramesh_mesh::node::NodeConfig;
use dramesh_mesh::protocol::ProtocolConfig;
use dramesh_mesh::transport::TransportConfig;
use tokio::net::UdpSocket;
use tokio::task::JoinSet;

pub(crate) const LOCAL: &str = "127.0.0.1:0";

pub(crate) fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

pub(crate) fn replica_id(id: &str) -> PeerIdentity {
    PeerIdentity::Replica { id: id.into() }
}

pub(crate) fn agent_id(cluster: &str, node: &str) -> PeerIdentity {
    PeerIdentity::Agent {
        cluster: cluster.into(),
        node: node.into(),
    }
}

/// Timers shortened so partitions are noticed and healed within a test's time.
pub(crate) fn fast_config(
    identity: TlsIdentity,
    seeds: Vec<SocketAddr>,
    connect_timeout: Duration,
) -> NodeConfig {
    let mut c = NodeConfig::new(identity, LOCAL.parse().unwrap());
    c.seeds = seeds;
    c.protocol = ProtocolConfig {
        anti_entropy_interval: Duration::from_millis(500),
        heartbeat_interval: Duration::from_millis(250),
        node_anti_entropy_interval: Duration::from_millis(500),
        node_heartbeat_interval: Duration::from_millis(250),
        peer_exchange_interval: Duration::from_millis(500),
        ..ProtocolConfig::default()
    };
    c.transport = TransportConfig {
        idle_timeout: Duration::from_millis(1500),
        keep_alive: Duration::from_millis(300),
        connect_timeout,
        backoff_min: Duration::from_millis(50),
        backoff_max: Duration::from_millis(500),
        ..TransportConfig::default()
    };
    c.tick_interval = Duration::from_millis(50);
    c
}

/// Polls `cond` every `poll` until it holds; fails the test after `limit`.
pub(crate) async fn wait_until(
    what: &str,
    limit: Duration,
    poll: Duration,
    mut cond: impl FnMut() -> bool,
) -> Duration {
    let started = Instant::now();
    loop {
        if cond() {
            return started.elapsed();
        }
        assert!(started.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(poll).await;
    }
}

/// A UDP forwarder in front of one node that drops datagrams of blocked client addresses.
pub(crate) struct Relay {
    pub addr: SocketAddr,
    /// Client source addresses whose datagrams are dropped, both ways.
    pub blocked: Arc<Mutex<HashSet<SocketAddr>>>,
    /// When each dropped client datagram arrived.
    #[allow(dead_code)] // read by tests/quic.rs only; every test crate compiles this module
    pub dropped_at: Arc<Mutex<Vec<Instant>>>,
    _tasks: JoinSet<()>,
}

impl Relay {
    pub(crate) async fn start(target: SocketAddr) -> Relay {
        let front = Arc::new(UdpSocket::bind(LOCAL).await.unwrap());
        let addr = front.local_addr().unwrap();
        let blocked: Arc<Mutex<HashSet<SocketAddr>>> = Arc::default();
        let dropped_at: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let mut tasks = JoinSet::new();
        let (front2, blocked2, dropped2) = (front.clone(), blocked.clone(), dropped_at.clone());
        tasks.spawn(async move {
            // One upstream socket per client, so the target sees distinct sources.
            let mut upstreams: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
            let mut back = JoinSet::new();
            let mut buf = vec![0u8; 65536];
            while let Ok((n, client)) = front2.recv_from(&mut buf).await {
                if blocked2.lock().unwrap().contains(&client) {
                    dropped2.lock().unwrap().push(Instant::now());
                    continue;
                }
                let up = match upstreams.get(&client) {
                    Some(u) => u.clone(),
                    None => {
                        let u = Arc::new(UdpSocket::bind(LOCAL).await.unwrap());
                        u.connect(target).await.unwrap();
                        upstreams.insert(client, u.clone());
                        let (u2, f, b) = (u.clone(), front2.clone(), blocked2.clone());
                        back.spawn(async move {
                            let mut buf = vec![0u8; 65536];
                            while let Ok(n) = u2.recv(&mut buf).await {
                                if !b.lock().unwrap().contains(&client) {
                                    let _ = f.send_to(&buf[..n], client).await;
                                }
                            }
                        });
                        u
                    }
                };
                let _ = up.send(&buf[..n]).await;
            }
        });
        Relay {
            addr,
            blocked,
            dropped_at,
            _tasks: tasks,
        }
    }
}
