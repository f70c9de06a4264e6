//! Acceptance test of retiring a member cluster, with separate `dramesh` processes.
//!
//! Two replicas (r2 seeded with r1) and folder agents for clusters `keep` and `gone`. The
//! cluster `gone` is retired through r1 with `dramesh retire`, while its agent keeps running.
//! Both replicas must drop it (status, estimates) and list it as retired, its running agent
//! must not bring it back, r2 restarted from its disk must not list it either, and the agent
//! restarted with `--rejoin` must bring it back. Every wait is bounded; processes are killed
//! when the test ends, pass or fail.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{BIN, TwoReplicas, http, status_names, wait_for};

#[test]
fn a_retired_cluster_leaves_every_replica_and_comes_back_only_by_rejoining() {
    let tmp = tempfile::tempdir().expect("tmp");
    let tmp = tmp.path();
    let mut f = TwoReplicas::start(tmp, &["keep", "gone"]);
    let (h1, h2) = (f.r1.http, f.r2.http);
    let meshes = [f.r1.mesh, f.r2.mesh];
    f.agent(tmp, "keep", &meshes, &[]);
    let gone_agent = f.agent(tmp, "gone", &meshes, &[]);
    for h in [h1, h2] {
        wait_for(
            "both clusters on both replicas",
            Duration::from_secs(60),
            || status_names(h, "clusters").filter(|c| c.len() == 2),
        );
    }

    // A name no replica knows is refused, naming it; nothing is retired.
    let (code, body) = http(h1, "DELETE", "/v1/clusters/nope", None);
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("nope"), "{body}");

    let out = Command::new(BIN)
        .args(["retire", "gone", "--api", &h1.to_string()])
        .output()
        .expect("run dramesh retire");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "dramesh retire failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("retired cluster gone"), "{stdout}");

    let only_keep = |h| {
        let listed = status_names(h, "clusters")?;
        let retired = status_names(h, "retired")?;
        (listed == ["keep"] && retired == ["gone"]).then_some(())
    };
    for h in [h1, h2] {
        wait_for(
            "gone retired on both replicas",
            Duration::from_secs(30),
            || only_keep(h),
        );
    }
    // Its agent still runs and keeps trying: the cluster stays out (heartbeats and the old
    // generation are refused), on both replicas.
    std::thread::sleep(Duration::from_secs(3));
    for h in [h1, h2] {
        assert!(only_keep(h).is_some(), "{:?}", status_names(h, "clusters"));
        let (code, body) = http(
            h,
            "POST",
            "/v1/estimate",
            Some(
                r#"{"workload":{"manifests":["apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - {name: c, image: x, resources: {requests: {cpu: '1'}}}\n"]},"clusters":["gone"]}"#,
            ),
        );
        assert_eq!(code, 404, "estimate on a retired cluster: {body}");
    }

    // r2 restarted from its disk: still gone.
    f.restart_r2(tmp);
    wait_for("r2 back without gone", Duration::from_secs(60), || {
        only_keep(h2)
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        only_keep(h2).is_some(),
        "{:?}",
        status_names(h2, "clusters")
    );

    // The agent restarted with --rejoin publishes a newer generation: the cluster is back.
    f.kill(gone_agent);
    f.agent(tmp, "gone", &meshes, &["--rejoin"]);
    for h in [h1, h2] {
        wait_for(
            "gone back on both replicas",
            Duration::from_secs(60),
            || status_names(h, "clusters").filter(|c| c.len() == 2),
        );
    }
}
