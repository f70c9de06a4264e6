//! Binding preemption through the loop (same fake API server and fleet as the parent
//! module): two lower-priority GPU bindings fill c0 and c1; a high-priority one arrives.

use super::*;

/// `Binding::id` of the binding of Deployment `name`.
fn id(name: &str) -> String {
    format!("ResourceBinding {NS}/{name}-deployment")
}

fn priority_class(name: &str, policy: &str) -> Value {
    json!({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": name}, "value": 1000, "preemptionPolicy": policy})
}

/// Deployment `name` whose pods use PriorityClass `class`.
fn deployment_of(name: &str, class: &str) -> Value {
    let mut d = deployment(name);
    d["spec"]["template"]["spec"]["priorityClassName"] = json!(class);
    d
}

/// Binding of `name`: `replicas` GPU replicas all on one cluster, `priority` as its
/// `spec.schedulePriority`.
fn aggregated(name: &str, replicas: i64, priority: Option<i32>) -> Value {
    let mut b = binding(name, replicas);
    b["spec"]["placement"]["replicaScheduling"] =
        json!({"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Aggregated"});
    if let Some(p) = priority {
        b["spec"]["schedulePriority"] = json!({"priority": p});
    }
    b
}

/// Deletes cluster `i`'s pods of Deployment `owner` and their device claims from the view, as
/// the agent reports them gone (the fleet otherwise as [`objects`]`(i, 4)`).
fn pods_leave(st: &ReplicaState, i: usize, owner: &str) {
    let all = objects(i, 4);
    let rs = format!("{owner}-abc12");
    let mut claims = HashSet::new();
    let mut changes = Vec::new();
    for o in &all {
        if let ClusterObject::Pod(p) = o {
            let owned = p
                .metadata
                .owner_references
                .iter()
                .flatten()
                .any(|r| r.name == rs);
            if owned {
                let statuses = p
                    .status
                    .as_ref()
                    .and_then(|s| s.resource_claim_statuses.as_ref());
                claims.extend(
                    statuses
                        .into_iter()
                        .flatten()
                        .filter_map(|c| c.resource_claim_name.clone()),
                );
                changes.push((format!("c{i}"), ObjectChange::Delete { key: o.key() }));
            }
        }
    }
    for o in &all {
        if let ClusterObject::ResourceClaim(c) = o
            && c.metadata.name.as_ref().is_some_and(|n| claims.contains(n))
        {
            changes.push((format!("c{i}"), ObjectChange::Delete { key: o.key() }));
        }
    }
    assert_eq!(changes.len(), 8, "4 pods and their 4 claims leave c{i}");
    st.apply_changes(&changes);
}

/// c0 and c1 (8 GPUs each) filled by the loop with `train-0` (priority 0) and `train-1`
/// (priority 100), 4 replicas of each on each cluster, their pods running.
async fn full_fleet(fake: &FakeApi) -> Option<(Arc<ReplicaState>, Running)> {
    dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS)?;
    let st = state("r1");
    publish(&st, 0, 0, None);
    publish(&st, 1, 0, None);
    setup(fake);
    fake.apply(priority_class("high", "PreemptLowerPriority"));
    fake.apply(priority_class("high-never", "Never"));
    for (name, priority) in [("train-0", None), ("train-1", Some(100))] {
        fake.apply(deployment(name));
        let mut b = binding(name, 8);
        b["spec"]["placement"]["replicaScheduling"] = json!({
            "replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted",
            "weightPreference": {"staticWeightList": [
                {"targetCluster": {"clusterNames": ["c0"]}, "weight": 1},
                {"targetCluster": {"clusterNames": ["c1"]}, "weight": 1}]}});
        if let Some(p) = priority {
            b["spec"]["schedulePriority"] = json!({"priority": p});
        }
        fake.apply(b);
    }
    let running = start(fake, st.clone(), Duration::from_millis(20));
    for name in ["train-0", "train-1"] {
        let b = wait_binding(fake, name, "victim scheduled", is_success_at_generation).await;
        assert_eq!(targets(&b), [("c0".into(), 4), ("c1".into(), 4)], "{b:#}");
    }
    // The fleet's pods are exactly these bindings' (train-0 at priority 0, train-1 at 100).
    publish(&st, 0, 4, Some(0));
    publish(&st, 1, 4, Some(0));
    // Their reservations are satisfied; the owner's housekeeping ends them.
    st.sweep_reservations();
    assert!(st.reservation_list(false).is_empty());
    Some((st, running))
}

/// Accepted writes to the binding of `name`.
fn writes_to(fake: &FakeApi, name: &str) -> usize {
    let n = format!("{name}-deployment");
    fake.writes()
        .iter()
        .filter(|w| w.kind == "ResourceBinding" && w.name == n && w.code == 200)
        .count()
}

fn condition_message(b: &Value) -> String {
    scheduled(b)
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn events_on(fake: &FakeApi, binding: &str, reason: &str) -> Vec<Value> {
    fake.list_objects("events.k8s.io/v1", "Event")
        .into_iter()
        .filter(|e| {
            e["regarding"]["kind"] == "ResourceBinding"
                && e["regarding"]["name"] == format!("{binding}-deployment")
                && e["reason"] == reason
        })
        .collect()
}

#[tokio::test]
async fn a_high_priority_gpu_binding_evicts_a_lower_one_holds_the_room_and_lands() {
    let fake = FakeApi::start().await;
    let Some((st, running)) = full_fleet(&fake).await else {
        return;
    };
    fake.apply(deployment_of("llm", "high"));
    fake.apply(aggregated("llm", 4, Some(1000)));

    // Unschedulable, and waiting for the victims.
    let b = wait_binding(&fake, "llm", "preemption initiated", |b| {
        condition_message(b).contains("waiting for them to leave it")
    })
    .await;
    assert_eq!(
        scheduled(&b).map(|c| c["reason"].clone()),
        Some(json!("Unschedulable"))
    );
    assert!(targets(&b).is_empty(), "{b:#}");
    // The room is held by one reservation for all 4 replicas at the preemptor's priority.
    let holds = st.preemption_holds(&id("llm"));
    assert_eq!(holds.len(), 1, "{holds:?}");
    let held = holds[0].cluster.clone();
    let other = if held == "c0" { "c1" } else { "c0" };
    assert!(
        condition_message(&b).contains(&format!("on cluster {held}")),
        "{b:#}"
    );
    let hold = st.reservation_status(&holds[0].id).expect("hold known");
    assert_eq!((hold.replicas, hold.priority), (4, 1000), "{hold:?}");
    assert_eq!(hold.workload.name, "llm");

    // train-0 (priority 0) leaves the held cluster the way Karmada's failover evicts;
    // train-1 (priority 100) is reprieved: evicting train-0 makes room for all 4.
    let v = wait_binding(&fake, "train-0", "victim evicted", |v| {
        v["spec"]["gracefulEvictionTasks"].is_array()
    })
    .await;
    // The eviction write itself took the held cluster off (the victim's own re-plan may
    // already have followed: its static weights put the evicted replicas elsewhere).
    let eviction = fake
        .writes()
        .into_iter()
        .find(|w| {
            w.name == "train-0-deployment"
                && w.code == 200
                && w.body["spec"]["gracefulEvictionTasks"].is_array()
        })
        .expect("the eviction patch was written");
    assert_eq!(
        targets(&eviction.body),
        [(other.to_string(), 4)],
        "{:#}",
        eviction.body
    );
    assert!(targets(&v).iter().all(|(c, _)| *c != held), "{v:#}");
    let tasks = v["spec"]["gracefulEvictionTasks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(tasks.len(), 1, "{v:#}");
    let t = &tasks[0];
    assert_eq!(t["fromCluster"], json!(held));
    assert_eq!(t["reason"], "BindingPreempted");
    assert_eq!(t["producer"], "Scheduler");
    assert_eq!(t["replicas"], 4);
    assert!(
        t["message"]
            .as_str()
            .is_some_and(|m| m.contains("llm-deployment")),
        "{t:#}"
    );
    let spared = get_binding(&fake, "train-1");
    assert_eq!(
        targets(&spared),
        [("c0".into(), 4), ("c1".into(), 4)],
        "{spared:#}"
    );
    assert!(
        spared["spec"]["gracefulEvictionTasks"].is_null(),
        "{spared:#}"
    );
    // Events on both.
    wait_until("the Preempted and PreemptionInitiated Events", || {
        !events_on(&fake, "train-0", "Preempted").is_empty()
            && !events_on(&fake, "llm", "PreemptionInitiated").is_empty()
    })
    .await;
    assert_eq!(events_on(&fake, "train-0", "Preempted").len(), 1);
    assert!(events_on(&fake, "train-1", "Preempted").is_empty());

    // A binding without priority arriving meanwhile finds no room anywhere.
    fake.apply(deployment("late"));
    fake.apply(aggregated("late", 4, None));
    wait_binding(&fake, "late", "late unschedulable", |b| {
        scheduled(b).is_some_and(|c| c["status"] == "False")
    })
    .await;

    // The victim's pods leave while the loop is stopped: the freed room is held, every
    // estimate but the preemptor's own decisions sees none of it.
    running.stop().await;
    let i = if held == "c0" { 0 } else { 1 };
    pods_leave(&st, i, "train-0");
    let probe = [deployment("probe"), claim_template()].map(|m| m.to_string());
    let est = st
        .estimate_manifests(&probe, std::slice::from_ref(&held))
        .expect("estimate");
    assert_eq!(est.total, 0, "the freed room is not held: {est:?}");

    // Running again: the preemptor lands in the held room; `late` does not take it.
    let running = start(&fake, st.clone(), Duration::from_millis(20));
    let b = wait_binding(&fake, "llm", "landed", is_success_at_generation).await;
    assert_eq!(targets(&b), [(held.clone(), 4)], "{b:#}");
    // The hold is its reservation: no second one was written for the same replicas.
    let mine: Vec<_> = st
        .reservation_list(false)
        .into_iter()
        .filter(|r| r.workload.name == "llm")
        .collect();
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert_eq!(mine[0].id, holds[0].id);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let late = get_binding(&fake, "late");
    assert!(
        targets(&late).is_empty(),
        "the held room was taken: {late:#}"
    );
    // Never more GPU replicas bound on the held cluster than it has GPUs.
    let on_held = || -> i64 {
        ["llm", "train-0", "train-1", "late"]
            .iter()
            .flat_map(|n| targets(&get_binding(&fake, n)))
            .filter(|(c, _)| *c == held)
            .map(|(_, r)| r)
            .sum()
    };
    assert_eq!(on_held(), 8);

    // Scaling up while the hold is live: the hold covers the 4 assigned replicas, not the 2
    // new ones, which find no room of their own anywhere.
    let mut scaled = get_binding(&fake, "llm");
    scaled["spec"]["replicas"] = json!(6);
    fake.apply(scaled);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(on_held(), 8);
    assert_eq!(targets(&get_binding(&fake, "llm")), [(held.clone(), 4)]);
    running.stop().await;
}

#[tokio::test]
async fn preemption_policy_never_evicts_nothing() {
    let fake = FakeApi::start().await;
    let Some((st, running)) = full_fleet(&fake).await else {
        return;
    };
    let before = (writes_to(&fake, "train-0"), writes_to(&fake, "train-1"));
    fake.apply(deployment_of("llm", "high-never"));
    fake.apply(aggregated("llm", 4, Some(1000)));
    let b = wait_binding(&fake, "llm", "unschedulable", |b| {
        scheduled(b).is_some_and(|c| c["status"] == "False")
    })
    .await;
    assert_eq!(
        scheduled(&b).map(|c| c["reason"].clone()),
        Some(json!("Unschedulable"))
    );
    // Retries see the same view; give the loop time to do anything it would.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        (writes_to(&fake, "train-0"), writes_to(&fake, "train-1")),
        before,
        "a lower-priority binding was written"
    );
    assert!(st.preemption_holds(&id("llm")).is_empty());
    assert!(
        !condition_message(&get_binding(&fake, "llm")).contains("reempt"),
        "{b:#}"
    );
    assert!(events_on(&fake, "train-0", "Preempted").is_empty());
    running.stop().await;
}

#[tokio::test]
async fn a_preemptor_that_would_not_fit_even_alone_evicts_nothing() {
    let fake = FakeApi::start().await;
    let Some((st, running)) = full_fleet(&fake).await else {
        return;
    };
    let before = (writes_to(&fake, "train-0"), writes_to(&fake, "train-1"));
    fake.apply(deployment_of("llm", "high"));
    // 9 replicas on c0, which has 8 GPUs: evicting everything there is not enough.
    let mut b = aggregated("llm", 9, Some(1000));
    b["spec"]["placement"]["clusterAffinity"] = json!({"clusterNames": ["c0"]});
    fake.apply(b);
    let b = wait_binding(&fake, "llm", "refused", |b| {
        condition_message(b).contains("No binding preempted")
    })
    .await;
    assert_eq!(
        scheduled(&b).map(|c| c["reason"].clone()),
        Some(json!("Unschedulable"))
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        (writes_to(&fake, "train-0"), writes_to(&fake, "train-1")),
        before,
        "a lower-priority binding was written"
    );
    assert!(st.preemption_holds(&id("llm")).is_empty());
    assert!(events_on(&fake, "train-0", "Preempted").is_empty());
    assert!(events_on(&fake, "llm", "PreemptionInitiated").is_empty());
    running.stop().await;
}
