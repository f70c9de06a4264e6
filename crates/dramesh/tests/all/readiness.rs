//! A restarted replica is not ready until it has caught up, with separate `dramesh`
//! processes.
//!
//! Replicas r1 and r2 and a folder agent for cluster `keep` that reaches both. r2 is killed;
//! while it is down, cluster `late` joins through an agent that reaches r1 only. r2 restarts
//! from its disk with r1 as seed. From the moment it starts, `/readyz` is polled: the first
//! time it answers 200, r2's status must already list `late`, which only r1 could give it.
//! Every wait is bounded; processes are killed when the test ends, pass or fail.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{TwoReplicas, status_names, wait_for};

fn ready(addr: SocketAddr) -> bool {
    common::try_request(addr, "GET", "/readyz", "").is_ok_and(|(code, _)| code == 200)
}

#[test]
fn a_restarted_replica_is_ready_only_once_it_holds_what_its_peer_holds() {
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let mut f = TwoReplicas::start(tmp, &["keep", "late"], common::OPEN_API);
    let (h1, h2) = (f.r1.http, f.r2.http);
    f.agent(tmp, "keep", &[f.r1.mesh, f.r2.mesh], &[]);
    for h in [h1, h2] {
        wait_for("keep on both replicas", Duration::from_secs(60), || {
            status_names(h, "clusters").filter(|c| c == &["keep"])
        });
    }
    wait_for("r2 ready", Duration::from_secs(60), || {
        ready(h2).then_some(())
    });

    f.kill(1);
    f.agent(tmp, "late", &[f.r1.mesh], &[]);
    wait_for("late on r1", Duration::from_secs(60), || {
        status_names(h1, "clusters").filter(|c| c.len() == 2)
    });

    f.restart_r2(tmp);
    let started = Instant::now();
    while !ready(h2) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "r2 not ready within 60 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let listed = status_names(h2, "clusters").expect("r2 status");
    assert!(
        listed.contains(&"late".to_string()),
        "r2 was ready {:?} after its start while missing `late` (it lists {listed:?})",
        started.elapsed()
    );
}
