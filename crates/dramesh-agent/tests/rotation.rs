//! A running agent picks up a rotated credential file (the kubelet's Pod Certificates bundle)
//! without restarting: a replica that refused its expired certificate accepts the renewed one.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dramesh_agent::{Agent, AgentConfig, AgentSource, CoalesceConfig, CredentialFiles};
use dramesh_mesh::PeerIdentity;
use dramesh_mesh::certs::{self, CaBundle};
use dramesh_mesh::mem_store::MemStore;
use dramesh_mesh::node::{MeshHandle, NodeConfig};
use rcgen::{KeyPair, PublicKeyData as _};

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A credential bundle as the kubelet writes it: the key, then the chain.
fn bundle(ca: &CaBundle, id: &PeerIdentity, not_before: i64, not_after: i64) -> String {
    let key = KeyPair::generate().unwrap();
    let leaf = certs::issue_leaf_for_key(
        ca,
        id,
        &key.subject_public_key_info(),
        not_before,
        not_after,
    )
    .unwrap();
    format!("{}{leaf}", key.serialize_pem())
}

fn write_atomically(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Waits (at most 20 s) until `replica` has refused `n` handshakes in all.
async fn refused(replica: &MeshHandle, n: u64) {
    let start = Instant::now();
    while replica.transport_counters().handshake_failures < n {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "fewer than {n} handshakes refused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_presents_a_rotated_certificate_without_restarting() {
    let dir = tempfile::tempdir().unwrap();
    let ca = certs::generate_ca("mesh CA", 1).unwrap();
    let ca_path = dir.path().join("ca.crt");
    std::fs::write(&ca_path, &ca.cert_pem).unwrap();
    let replica_id =
        certs::issue_identity(&ca, &PeerIdentity::Replica { id: "r0".into() }, 1).unwrap();
    let replica = MeshHandle::start(
        NodeConfig::new(replica_id, "127.0.0.1:0".parse().unwrap()),
        Arc::new(Mutex::new(MemStore::new())),
    )
    .await
    .unwrap();

    let me = PeerIdentity::Agent {
        cluster: "east".into(),
        node: "n1".into(),
    };
    let now = unix_now();
    // Expired an hour ago: the kubelet has already rotated it, the agent has not yet.
    let bundle_path = dir.path().join("credentialbundle.pem");
    write_atomically(&bundle_path, &bundle(&ca, &me, now - 7200, now - 3600));
    let identity = certs::load_identity(&bundle_path, &bundle_path, &ca_path).unwrap();
    let source = dir.path().join("objects");
    std::fs::create_dir(&source).unwrap();
    let agent = Agent::start(AgentConfig {
        identity,
        replicas: vec![replica.local_addr()],
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: None,
        source: AgentSource::Dir {
            path: source,
            poll_every: Duration::from_millis(200),
        },
        protocol: Default::default(),
        coalesce: CoalesceConfig::default(),
        metrics: None,
        http: Default::default(),
        rejoin: false,
        credentials: Some(CredentialFiles {
            cert: bundle_path.clone(),
            key: bundle_path.clone(),
            ca: ca_path.clone(),
            every: Duration::from_millis(100),
        }),
    })
    .await
    .unwrap();

    // The replica refuses the expired certificate: the agent's dials fail their handshakes.
    refused(&replica, 1).await;
    assert!(
        !replica.connected_identities().contains(&me),
        "the replica accepted an expired certificate"
    );

    // A certificate for another node in the file is not taken up.
    let other = PeerIdentity::Agent {
        cluster: "east".into(),
        node: "n2".into(),
    };
    write_atomically(&bundle_path, &bundle(&ca, &other, now - 60, now + 3600));
    // Two more dials (the file is re-read every 100 ms, dials back off 0.2-2 s) are still
    // refused: the agent kept its expired certificate (the other one would be accepted).
    let before = replica.transport_counters().handshake_failures;
    refused(&replica, before + 2).await;
    assert!(!replica.connected_identities().contains(&other));
    assert!(!replica.connected_identities().contains(&me));

    // The kubelet writes the renewed bundle; the agent's next dial presents it.
    write_atomically(&bundle_path, &bundle(&ca, &me, now - 60, now + 3600));
    let start = Instant::now();
    while !replica.connected_identities().contains(&me) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the agent never connected with its rotated certificate"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    agent.shutdown().await;
    replica.shutdown().await;
}
