//! Test helpers shared by the loopback QUIC tests.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::UdpSocket;
use tokio::task::JoinSet;

pub const LOCAL: &str = "127.0.0.1:0";

/// A UDP forwarder in front of one node that drops datagrams of blocked client addresses.
pub struct Relay {
    pub addr: SocketAddr,
    /// Client source addresses whose datagrams are dropped, both ways.
    pub blocked: Arc<Mutex<HashSet<SocketAddr>>>,
    _tasks: JoinSet<()>,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> Relay {
        let front = Arc::new(UdpSocket::bind(LOCAL).await.unwrap());
        let addr = front.local_addr().unwrap();
        let blocked: Arc<Mutex<HashSet<SocketAddr>>> = Arc::default();
        let mut tasks = JoinSet::new();
        let (front2, blocked2) = (front.clone(), blocked.clone());
        tasks.spawn(async move {
            // One upstream socket per client, so the target sees distinct sources.
            let mut upstreams: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
            let mut back = JoinSet::new();
            let mut buf = vec![0u8; 65536];
            while let Ok((n, client)) = front2.recv_from(&mut buf).await {
                if blocked2.lock().unwrap().contains(&client) {
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
            _tasks: tasks,
        }
    }
}
