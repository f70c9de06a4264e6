//! Work shared across replicas and void decisions: loops on their own replica states, their
//! reservation documents (role records included) delivered to each other by [`bridge_all`],
//! the peers each sees alive given by the test (as the runner gives a replica's from its mesh
//! sessions).

use super::*;
use dramesh_api::native::ReservationState;
use dramesh_scheduler::share::owner;

/// Cluster `i` (`c<i>`) with 8 nodes of 4 GPUs, all free: room for every binding below.
fn publish_roomy(state: &ReplicaState, i: usize) {
    let spec = FleetSpec {
        clusters: 2,
        nodes_per_cluster: 8,
        gpus_per_node: 4,
        owners_per_cluster: 2,
        kubernetes_version: "1.35".into(),
    };
    let name = format!("c{i}");
    let mut changes = Vec::new();
    cluster_objects(&spec, i, &|_| 0, |o| {
        changes.push((name.clone(), ObjectChange::upsert(&o)))
    });
    state.apply_changes(&changes);
}

/// Successful spec writes (not `/status`) of each binding, by binding name.
fn spec_patches(fake: &FakeApi) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for w in fake.writes() {
        if w.kind == "ResourceBinding" && w.subresource.is_none() && w.code == 200 {
            *out.entry(w.name).or_default() += 1;
        }
    }
    out
}

fn uid(fake: &FakeApi, name: &str) -> String {
    get_binding(fake, name)["metadata"]["uid"]
        .as_str()
        .expect("the fake gives every object a uid")
        .to_string()
}

/// Replicas `ids`, each with the roomy fleet, their documents bridged every 50 ms, and each
/// one's peers (the others alive, not yet caught up).
fn replicas(ids: &[&str]) -> (Vec<Arc<ReplicaState>>, Vec<watch::Sender<Peers>>) {
    let states: Vec<Arc<ReplicaState>> = ids.iter().map(|id| state(id)).collect();
    for st in &states {
        publish_roomy(st, 0);
        publish_roomy(st, 1);
    }
    let peers = ids
        .iter()
        .map(|me| {
            let others = ids.iter().filter(|r| *r != me).map(|r| r.to_string());
            watch::channel(Peers {
                alive: others.collect(),
                caught_up: false,
            })
            .0
        })
        .collect();
    (states, peers)
}

/// Waits until every state holds the role records of all of them, then lets the loops decide
/// (a replica counts as caught up once it has what its peers hold).
async fn catch_up(states: &[Arc<ReplicaState>], peers: &[watch::Sender<Peers>]) {
    wait_until("every role record everywhere", || {
        states
            .iter()
            .all(|s| s.role_records().len() == states.len())
    })
    .await;
    for p in peers {
        p.send_modify(|p| p.caught_up = true);
    }
}

fn start_shared(fake: &FakeApi, st: &Arc<ReplicaState>, peers: &watch::Sender<Peers>) -> Running {
    start_with(
        fake,
        st.clone(),
        Duration::from_millis(100),
        ME,
        Confirm::default(),
        Some(peers.subscribe()),
    )
}

/// Three replicas `IDS` sharing `n` one-GPU bindings `w<i>`, their loops started, not yet
/// caught up.
struct Three {
    fake: FakeApi,
    names: Vec<String>,
    states: Vec<Arc<ReplicaState>>,
    peers: Vec<watch::Sender<Peers>>,
    mesh: tokio::task::JoinHandle<()>,
    loops: Vec<Option<Running>>,
}

const IDS: [&str; 3] = ["ra", "rb", "rc"];

async fn three(n: usize) -> Option<Three> {
    let fake = validating_fake().await?;
    setup(&fake);
    let names: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
    for n in &names {
        fake.apply(deployment(n));
        fake.apply(binding(n, 1));
    }
    let (states, peers) = replicas(&IDS);
    let mesh = bridge_all(states.clone(), Duration::from_millis(50));
    let loops = states
        .iter()
        .zip(&peers)
        .map(|(st, p)| Some(start_shared(&fake, st, p)))
        .collect();
    Some(Three {
        fake,
        names,
        states,
        peers,
        mesh,
        loops,
    })
}

#[tokio::test]
async fn three_replicas_decide_each_binding_once_each_only_its_share() {
    let Some(t) = three(30).await else { return };
    let Three {
        fake,
        names,
        states,
        peers,
        mesh,
        loops,
    } = t;
    let ids = IDS;
    let loops: Vec<Running> = loops.into_iter().flatten().collect();
    catch_up(&states, &peers).await;
    for n in &names {
        wait_binding(&fake, n, "scheduled", is_success_at_generation).await;
    }
    // Each binding's owner by rendezvous hashing of its uid over the three.
    let mut share: BTreeMap<&str, u64> = BTreeMap::new();
    for n in &names {
        *share
            .entry(owner(&uid(&fake, n), &ids).unwrap())
            .or_default() += 1;
    }
    wait_until("every outcome counted", || {
        loops.iter().map(|l| l.count("scheduled")).sum::<u64>() >= names.len() as u64
    })
    .await;
    for (id, l) in ids.iter().zip(&loops) {
        assert_eq!(
            l.count("scheduled"),
            share.get(id).copied().unwrap_or(0),
            "{id} decided other than its share {share:?}"
        );
    }
    assert!(share.values().all(|n| *n > 0), "{share:?}");
    // Exactly one spec write per binding: no two replicas decided one.
    let patches = spec_patches(&fake);
    for n in &names {
        assert_eq!(
            patches.get(&format!("{n}-deployment")),
            Some(&1),
            "{n}: {patches:?}"
        );
    }
    assert!(
        !fake
            .writes()
            .iter()
            .any(|w| w.kind == "ResourceBinding" && w.code == 409),
        "no write conflicted"
    );
    mesh.abort();
    for l in loops {
        l.stop().await;
    }
}

#[tokio::test]
async fn a_stopped_replicas_bindings_are_taken_over() {
    let Some(t) = three(45).await else { return };
    let Three {
        fake,
        names,
        states,
        peers,
        mesh,
        mut loops,
    } = t;
    let ids = IDS;
    // A slow server, so the burst is still going when rb stops.
    fake.delay_answers(Duration::from_millis(20), Duration::from_millis(150), 7);
    catch_up(&states, &peers).await;
    let rb_share = names
        .iter()
        .filter(|n| owner(&uid(&fake, n), &ids) == Some("rb"))
        .count() as u64;
    wait_until("rb scheduled one", || {
        loops[1].as_ref().is_some_and(|l| l.count("scheduled") >= 1)
    })
    .await;
    let rb = loops[1].take().expect("rb runs");
    let done_by_rb = rb.count("scheduled");
    let stopped = Instant::now();
    rb.stop().await;
    assert!(
        done_by_rb < rb_share,
        "rb finished its share ({rb_share}) before it stopped: the test shows nothing"
    );
    // The mesh sees rb gone at the latest LIVE_WINDOW after its last frame.
    tokio::time::sleep(crate::members::LIVE_WINDOW.saturating_sub(stopped.elapsed())).await;
    for p in [&peers[0], &peers[2]] {
        p.send_modify(|p| {
            p.alive.remove("rb");
        });
    }
    // Picked up at once (the peers' change reshards), then decided on a slow server.
    for n in &names {
        wait_binding(&fake, n, "scheduled", is_success_at_generation).await;
    }
    let took = stopped.elapsed();
    assert!(
        took < crate::members::LIVE_WINDOW + Duration::from_secs(3),
        "rb's bindings took {took:?} to be taken over"
    );
    let patches = spec_patches(&fake);
    for n in &names {
        assert_eq!(
            patches.get(&format!("{n}-deployment")),
            Some(&1),
            "{n}: {patches:?}"
        );
    }
    let (ra, rc) = (loops[0].take().unwrap(), loops[2].take().unwrap());
    mesh.abort();
    ra.stop().await;
    rc.stop().await;
}

/// A reservation of `replicas` one-GPU replicas of Deployment `name` on `cluster`, made by
/// `creator` on replica `owner` (its first), priority 0, holding no decision.
fn gpu_record(
    owner: &str,
    creator: &str,
    cluster: &str,
    name: &str,
    replicas: i64,
) -> resv::Record {
    resv::Record {
        id: format!("{owner}-0000000000000001"),
        owner: owner.into(),
        creator: creator.into(),
        cluster: cluster.into(),
        workload: dramesh_api::native::WorkloadRef {
            namespace: NS.into(),
            kind: "Deployment".into(),
            name: name.into(),
        },
        manifests: vec![deployment(name).to_string(), claim_template().to_string()],
        replicas,
        priority: 0,
        ttl_seconds: 300,
        bound_at_creation: 0,
        preemptor: None,
        caps: None,
        decision: None,
    }
}

/// Delivers `record` to `st`, as the mesh delivers its owner's reservation document.
fn deliver(st: &ReplicaState, record: &resv::Record) {
    let json = serde_json::to_vec(record).unwrap();
    st.apply_changes(&[(
        resv::doc_id(&record.owner).cluster.clone(),
        ObjectChange::Upsert {
            key: resv::record_key(&record.id),
            json: Arc::from(json.as_slice()),
        },
    )]);
}

/// A replica reserved all of c0's GPUs for a decision and died before writing it: once the
/// settle window and the grace have passed, the reservation is void here, its room used.
#[tokio::test]
async fn a_decision_never_written_frees_its_room_after_settle_and_grace() {
    let Some(fake) = validating_fake().await else {
        return;
    };
    let st = state("r1");
    publish(&st, 0, 0, None); // c0: 8 free GPUs
    publish(&st, 1, 4, None); // c1: none
    setup(&fake);
    // The dead replica's binding: this replica cannot place it (no such cluster), so only the
    // dead replica's decision could have put it on c0.
    fake.apply(deployment("ghost"));
    let mut ghost = binding("ghost", 8);
    ghost["spec"]["placement"]["clusterAffinity"] = json!({"clusterNames": ["c9"]});
    fake.apply(ghost);
    let decision = dramesh_scheduler::void::DecisionRef {
        kind: "ResourceBinding".into(),
        namespace: NS.into(),
        name: "ghost-deployment".into(),
        uid: uid(&fake, "ghost"),
        generation: 1,
        target: 8,
        settle_ms: 500,
    };
    let record = resv::Record {
        decision: Some(decision.clone()),
        ..gpu_record("rdead", &format!("scheduler:{ME}"), "c0", "ghost", 8)
    };
    deliver(&st, &record);
    let seen = Instant::now();
    let dead = st.reservation_status(&record.id).expect("known");
    assert_eq!(dead.status, ReservationState::Live, "{dead:?}");

    fake.apply(deployment("real"));
    fake.apply(binding("real", 2));
    let running = start(&fake, st.clone(), Duration::from_millis(20));
    // The room is held: unschedulable.
    let b = wait_binding(&fake, "real", "unschedulable", |b| scheduled(b).is_some()).await;
    assert_eq!(scheduled(&b).unwrap()["reason"], "Unschedulable", "{b:#}");
    let b = wait_binding(
        &fake,
        "real",
        "landed on the freed room",
        is_success_at_generation,
    )
    .await;
    let took = seen.elapsed();
    assert_eq!(targets(&b), [("c0".to_string(), 2)]);
    let void_after = decision.void_after();
    assert!(
        took >= void_after && took < void_after + Duration::from_secs(2),
        "landed {took:?} after the dead replica's reservation was first seen (void after {void_after:?})"
    );
    let dead = st
        .reservation_status(&record.id)
        .expect("still known: its owner is dead");
    assert_eq!(
        (dead.status, dead.remaining),
        (ReservationState::Released, 0),
        "{dead:?}"
    );
    assert!(
        dead.reason.as_deref().is_some_and(
            |r| r.contains("was never written to ResourceBinding default/ghost-deployment")
        ),
        "{dead:?}"
    );
    // The written decision's own reservation is not void, however long it waits.
    let own: Vec<_> = st
        .reservation_list(false)
        .into_iter()
        .filter(|s| s.owner == "r1")
        .collect();
    assert_eq!(own.len(), 1, "{own:?}");
    tokio::time::sleep(void_after).await;
    let mine = st.reservation_status(&own[0].id).expect("known");
    assert_eq!(mine.status, ReservationState::Live, "{mine:?}");
    running.stop().await;
}

/// A replica wrote a decision and died; later a reservation ranked before the decision's
/// (a higher priority) takes its cluster's room. Its decider would have placed the replicas
/// again; the binding's new owner does, once the reservation is old enough to be judged
/// (settle + grace after it first saw it), and only once.
#[tokio::test]
async fn a_departed_replicas_written_decision_that_loses_its_room_is_placed_again() {
    let Some(fake) = validating_fake().await else {
        return;
    };
    setup(&fake);
    let names: Vec<String> = (0..8).map(|i| format!("w{i}")).collect();
    for n in &names {
        fake.apply(deployment(n));
        fake.apply(binding(n, 1));
    }
    let (states, peers) = replicas(&["r1", "rd"]);
    let mesh = bridge_all(states.clone(), Duration::from_millis(50));
    let r1 = start_shared(&fake, &states[0], &peers[0]);
    let rd = start_shared(&fake, &states[1], &peers[1]);
    catch_up(&states, &peers).await;
    for n in &names {
        wait_binding(&fake, n, "scheduled", is_success_at_generation).await;
    }
    let by = |b: &Value| {
        b["metadata"]["annotations"][dramesh_scheduler::void::DECIDED_BY]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let ghost = names
        .iter()
        .find(|n| by(&get_binding(&fake, n)).starts_with("rd/"))
        .expect("rd decided one of 8 bindings")
        .clone();
    let lost_cluster = targets(&get_binding(&fake, &ghost))[0].0.clone();
    // rd dies: nothing more of its document arrives, and r1's members lose it.
    rd.stop().await;
    mesh.abort();
    peers[0].send_modify(|p| p.alive.clear());
    // Everything on the ghost's cluster, ranked before every decision there.
    let record = resv::Record {
        priority: 1000,
        ..gpu_record("rx", "alice", &lost_cluster, "big", 32)
    };
    deliver(&states[0], &record);
    let taken = Instant::now();
    let b = wait_binding(&fake, &ghost, "placed again by r1", |b| {
        by(b).starts_with("r1/") && is_success_at_generation(b)
    })
    .await;
    let took = taken.elapsed();
    let other = if lost_cluster == "c0" { "c1" } else { "c0" };
    assert_eq!(targets(&b), [(other.to_string(), 1)], "{b:#}");
    // rd's reservation was first seen before the injection: judged within a tick after
    // settle + grace, then decided and written.
    assert!(
        took < Duration::from_millis(100)
            + dramesh_scheduler::void::VOID_GRACE
            + Duration::from_secs(2),
        "placed again {took:?} after its room was taken"
    );
    // Once: rd's write and r1's.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        spec_patches(&fake).get(&format!("{ghost}-deployment")),
        Some(&2)
    );
    r1.stop().await;
}
