//! The scheduler's Karmada client with the real kube client against the fake Karmada API server
//! of `dramesh-fakeapi`: kubeconfig errors name the file, watches see create/update/delete and
//! recover from 410 Gone, templates and ResourceClaimTemplates are read, karmada-scheduler-shaped
//! spec and status patches land and pass the CRD schema, conflicts are `Conflict`, invalid bodies
//! are refused with the field named, and Events are recorded.

use std::time::Duration;

use dramesh_fakeapi::FakeApi;
use dramesh_replica::karmada::{
    BindingRef, Change, EventNote, KarmadaClient, KarmadaError, KarmadaOptions, Kind, Limits,
    TemplateRef, Watch,
};
use serde_json::{Value, json};

const ME: &str = "dramesh-scheduler";

fn binding(ns: &str, name: &str, scheduler: &str) -> Value {
    json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": ns,
                "name": "trainer", "uid": "d-1"},
            "replicas": 3,
            "schedulerName": scheduler,
            "placement": {"clusterAffinity": {"clusterNames": ["m1", "m2"]},
                "replicaScheduling": {"replicaSchedulingType": "Divided",
                    "replicaDivisionPreference": "Aggregated"}}}})
}

fn cluster(name: &str, ready: bool) -> Value {
    json!({"apiVersion": "cluster.karmada.io/v1alpha1", "kind": "Cluster",
        "metadata": {"name": name, "labels": {"region": "eu"}},
        "spec": {"syncMode": "Push"},
        "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
            "reason": "ClusterReady", "message": "", "lastTransitionTime": "2026-11-25T12:00:00Z"}]}})
}

async fn client(fake: &FakeApi) -> KarmadaClient {
    KarmadaClient::new(fake.client(), KarmadaOptions::new(ME, "replica-a"))
}

/// The next change, within a deadline.
async fn next(w: &mut Watch) -> Change {
    tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .expect("a change within 10 s")
        .expect("the watch is running")
}

fn applied(c: &Change) -> Option<String> {
    match c {
        Change::Applied(o) => o.meta().name.clone(),
        _ => None,
    }
}

fn deleted(c: &Change) -> Option<String> {
    match c {
        Change::Deleted(o) => o.meta().name.clone(),
        _ => None,
    }
}

#[tokio::test]
async fn kubeconfig_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.yaml");
    let e = KarmadaClient::from_kubeconfig(&missing, KarmadaOptions::new(ME, "r"))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, KarmadaError::Kubeconfig { .. }), "{e}");
    assert!(e.to_string().contains("nope.yaml"), "{e}");

    let no_context = dir.path().join("no-context.yaml");
    std::fs::write(
        &no_context,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: k\n  cluster:\n    server: http://127.0.0.1:1\ncontexts: []\nusers: []\n",
    )
    .unwrap();
    let e = KarmadaClient::from_kubeconfig(&no_context, KarmadaOptions::new(ME, "r"))
        .await
        .err()
        .unwrap();
    let msg = e.to_string();
    assert!(
        msg.contains("no-context.yaml") && msg.contains("current-context"),
        "{msg}"
    );

    // A working kubeconfig reaches the server.
    let fake = FakeApi::start().await;
    fake.apply(binding("ml", "rb", ME));
    let good = dir.path().join("karmada.yaml");
    std::fs::write(&good, fake.kubeconfig()).unwrap();
    let c = KarmadaClient::from_kubeconfig(&good, KarmadaOptions::new(ME, "r"))
        .await
        .unwrap();
    let rb = c
        .get(Kind::ResourceBinding, Some("ml"), "rb")
        .await
        .unwrap();
    assert_eq!(rb.unwrap().value()["spec"]["replicas"], 3);
}

#[tokio::test]
async fn binding_watch_keeps_ours_and_recovers_from_gone() {
    let fake = FakeApi::start().await;
    fake.apply(binding("ml", "mine", ME));
    fake.apply(binding("ml", "theirs", "default-scheduler"));
    let c = client(&fake).await;
    let mut w = c.watch(Kind::ResourceBinding);
    assert_eq!(applied(&next(&mut w).await).as_deref(), Some("mine"));
    assert!(matches!(next(&mut w).await, Change::Synced));
    assert_eq!(w.cache().len(), 1);

    // Update, create, and a binding leaving us for another scheduler.
    let mut m = fake.get("ResourceBinding", Some("ml"), "mine").unwrap();
    m["spec"]["replicas"] = json!(5);
    fake.apply(m);
    let ch = next(&mut w).await;
    assert_eq!(applied(&ch).as_deref(), Some("mine"));
    let Change::Applied(o) = ch else {
        unreachable!()
    };
    assert_eq!(o.value()["spec"]["replicas"], 5);
    assert_eq!(o.meta().generation, Some(2));
    fake.apply(binding("ml", "second", ME));
    assert_eq!(applied(&next(&mut w).await).as_deref(), Some("second"));
    fake.apply(binding("ml", "second", "default-scheduler"));
    assert_eq!(deleted(&next(&mut w).await).as_deref(), Some("second"));
    // Another scheduler's binding never shows.
    let mut t = fake.get("ResourceBinding", Some("ml"), "theirs").unwrap();
    t["spec"]["replicas"] = json!(9);
    fake.apply(t);
    fake.delete("ResourceBinding", Some("ml"), "theirs");
    fake.apply(binding("ml", "third", ME));
    assert_eq!(applied(&next(&mut w).await).as_deref(), Some("third"));
    assert!(fake.delete("ResourceBinding", Some("ml"), "third"));
    assert_eq!(deleted(&next(&mut w).await).as_deref(), Some("third"));

    // A gap: the watch is cut, changes happen, the log is compacted (410 Gone on resume).
    fake.drop_watches_and(|api| {
        assert!(api.delete("ResourceBinding", Some("ml"), "mine"));
        api.apply(binding("ml", "during-gap", ME));
        api.compact();
    });
    let mut seen = Vec::new();
    loop {
        let ch = next(&mut w).await;
        if matches!(ch, Change::Synced) {
            break;
        }
        seen.push((applied(&ch), deleted(&ch)));
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![
            (None, Some("mine".to_string())),
            (Some("during-gap".to_string()), None)
        ]
    );
    let names: Vec<_> = w
        .cache()
        .list()
        .iter()
        .map(|o| o.meta().name.clone().unwrap())
        .collect();
    assert_eq!(names, vec!["during-gap"]);
    // The gap was bridged by a relist (the resumed watch got 410 Gone), not by replay.
    let lists = fake
        .requests()
        .iter()
        .filter(|r| {
            r.starts_with("GET /apis/work.karmada.io/v1alpha2/resourcebindings")
                && !r.contains("watch=true")
        })
        .count();
    assert_eq!(lists, 2, "{:?}", fake.requests());
}

#[tokio::test]
async fn cluster_and_priority_class_watches_see_changes() {
    let fake = FakeApi::start().await;
    fake.apply(cluster("m1", true));
    fake.apply(
        json!({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": "high"}, "value": 1000, "preemptionPolicy": "PreemptLowerPriority"}),
    );
    let c = client(&fake).await;
    let mut clusters = c.watch(Kind::Cluster);
    let mut classes = c.watch(Kind::PriorityClass);
    assert_eq!(applied(&next(&mut clusters).await).as_deref(), Some("m1"));
    assert!(matches!(next(&mut clusters).await, Change::Synced));
    assert_eq!(applied(&next(&mut classes).await).as_deref(), Some("high"));
    assert!(matches!(next(&mut classes).await, Change::Synced));
    // A cluster turns NotReady, another joins, one leaves.
    fake.apply(cluster("m1", false));
    let Change::Applied(m1) = next(&mut clusters).await else {
        panic!("expected m1 applied")
    };
    assert_eq!(m1.value()["status"]["conditions"][0]["status"], "False");
    fake.apply(cluster("m2", true));
    assert_eq!(applied(&next(&mut clusters).await).as_deref(), Some("m2"));
    assert!(fake.delete("Cluster", None, "m1"));
    assert_eq!(deleted(&next(&mut clusters).await).as_deref(), Some("m1"));
    assert!(clusters.cache().get(None, "m2").is_some());
    assert_eq!(
        classes.cache().get(None, "high").unwrap().value()["value"],
        1000
    );
}

#[tokio::test]
async fn templates_and_claim_templates_are_read() {
    let fake = FakeApi::start().await;
    fake.apply(json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "trainer", "namespace": "ml"},
        "spec": {"replicas": 3, "template": {"spec": {"containers": [{"name": "c", "image": "i"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}}}}));
    fake.apply(json!({"apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}}));
    fake.apply(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": "ml"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu",
            "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}}}),
    );
    let c = client(&fake).await;
    let t = |api_version: &str, kind: &str, name: &str| TemplateRef {
        api_version: api_version.into(),
        kind: kind.into(),
        namespace: Some("ml".into()),
        name: name.into(),
    };
    let d = c
        .template(&t("apps/v1", "Deployment", "trainer"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        d.value()["spec"]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
        "one-gpu"
    );
    let j = c.template(&t("batch/v1", "Job", "train")).await.unwrap();
    assert!(j.is_some());
    assert!(
        c.template(&t("apps/v1", "StatefulSet", "none"))
            .await
            .unwrap()
            .is_none()
    );
    let e = c
        .template(&t("example.com/v1", "Widget", "w"))
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("example.com/v1 Widget ml/w"), "{e}");
    let mut no_ns = t("apps/v1", "Deployment", "trainer");
    no_ns.namespace = None;
    let e = c.template(&no_ns).await.err().unwrap();
    assert!(e.to_string().contains("spec.resource.namespace"), "{e}");
    let rct = c
        .resource_claim_template("ml", "one-gpu")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rct.value()["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"],
        "gpu.nvidia.com"
    );
    assert!(
        c.resource_claim_template("ml", "absent")
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn schedule_result_and_status_land_and_conflicts_are_distinct() {
    let fake = FakeApi::start().await;
    // Without the CRD fixtures the writes are not schema-checked (and under CI this fails).
    let validated = dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_some();
    assert_eq!(validated, fake.validates_karmada_crds());
    fake.apply(binding("ml", "rb", ME));
    let c = client(&fake).await;
    let read = c
        .get(Kind::ResourceBinding, Some("ml"), "rb")
        .await
        .unwrap()
        .unwrap();
    let at = BindingRef::of(Kind::ResourceBinding, &read).unwrap();

    // As patchScheduleResultForResourceBinding: spec.clusters and the applied placement.
    let placement = read.value()["spec"]["placement"].to_string();
    let spec = json!({"metadata": {"annotations": {"policy.karmada.io/applied-placement": placement}},
        "spec": {"clusters": [{"name": "m1", "replicas": 2}, {"name": "m2", "replicas": 1}]}});
    let written = c.patch(&at, &spec).await.unwrap();
    assert_eq!(written.value()["spec"]["clusters"][0]["replicas"], 2);
    let generation = written.meta().generation.unwrap();
    // As patchBindingStatusCondition with a successful result.
    let status = json!({"status": {
        "conditions": [{"type": "Scheduled", "status": "True", "reason": "Success",
            "message": "Binding has been scheduled successfully.",
            "lastTransitionTime": "2026-11-25T12:00:00Z"}],
        "schedulerObservedGeneration": generation,
        "lastScheduledTime": "2026-11-25T12:00:00Z"}});
    let after = BindingRef::of(Kind::ResourceBinding, &written).unwrap();
    let done = c.patch_status(&after, &status).await.unwrap();
    assert_eq!(
        done.value()["status"]["schedulerObservedGeneration"],
        generation
    );
    assert_eq!(done.meta().generation, Some(generation));

    let writes: Vec<_> = fake
        .writes()
        .into_iter()
        .filter(|w| w.kind == "ResourceBinding")
        .collect();
    assert_eq!(writes.len(), 2);
    assert_eq!(writes[0].content_type, "application/merge-patch+json");
    assert_eq!(writes[0].subresource, None);
    // The body is the caller's, plus the version it was read at.
    let mut expected = spec.clone();
    expected["metadata"]["resourceVersion"] = json!(at.resource_version);
    assert_eq!(writes[0].body, expected);
    assert_eq!(writes[1].subresource.as_deref(), Some("status"));
    assert_eq!(writes[1].body["status"], status["status"]);
    assert!(writes.iter().all(|w| w.code == 200));

    // The first read is stale now: Conflict, and nothing changes.
    let e = c
        .patch(&at, &json!({"spec": {"clusters": []}}))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, KarmadaError::Conflict { .. }), "{e}");
    assert!(e.to_string().contains("ResourceBinding ml/rb"), "{e}");
    // A forced conflict on a fresh read too; after it, the write lands.
    let fresh = BindingRef::of(
        Kind::ResourceBinding,
        &c.get(Kind::ResourceBinding, Some("ml"), "rb")
            .await
            .unwrap()
            .unwrap(),
    )
    .unwrap();
    fake.conflict_next_writes("ResourceBinding", Some("ml"), "rb", 1);
    let e = c.patch_status(&fresh, &status).await.err().unwrap();
    assert!(matches!(e, KarmadaError::Conflict { .. }), "{e}");
    assert_eq!(e.status(), Some(409));
    let stored = fake.get("ResourceBinding", Some("ml"), "rb").unwrap();
    assert_eq!(stored["spec"]["clusters"][1]["name"], "m2");

    if validated {
        // A misspelt field is refused with the field named, and does not land.
        let e = c
            .patch(
                &fresh,
                &json!({"spec": {"clusters": [{"name": "m1", "replica": 3}]}}),
            )
            .await
            .err()
            .unwrap();
        match &e {
            KarmadaError::Api {
                code,
                reason,
                message,
                object,
            } => {
                assert_eq!((*code, reason.as_str()), (422, "Invalid"));
                assert!(message.contains("spec.clusters[0].replica"), "{message}");
                assert_eq!(object, "ResourceBinding ml/rb");
            }
            other => panic!("expected 422, got {other}"),
        }
        let e = c
            .patch_status(
                &fresh,
                &json!({"status": {"lastScheduledTime": "just now"}}),
            )
            .await
            .err()
            .unwrap();
        assert_eq!(e.status(), Some(422), "{e}");
        assert!(e.to_string().contains("status.lastScheduledTime"), "{e}");
    }
    // Not an object: refused before sending.
    let e = c.patch(&fresh, &json!([1])).await.err().unwrap();
    assert!(matches!(e, KarmadaError::Request { .. }), "{e}");
}

#[tokio::test]
async fn events_are_recorded_on_bindings_with_the_note_cut_to_the_limit() {
    let fake = FakeApi::start().await;
    fake.apply(binding("ml", "rb", ME));
    let c = client(&fake).await;
    let rb = c
        .get(Kind::ResourceBinding, Some("ml"), "rb")
        .await
        .unwrap()
        .unwrap();
    let regarding = Kind::ResourceBinding.reference(&rb);
    let long = "é".repeat(700); // 1400 bytes
    c.event(
        &regarding,
        &EventNote {
            warning: true,
            reason: "ScheduleBindingFailed".into(),
            action: "Scheduling".into(),
            message: long,
        },
    )
    .await
    .unwrap();
    let events = fake.list_objects("events.k8s.io/v1", "Event");
    assert_eq!(events.len(), 1);
    let ev = &events[0];
    assert_eq!(ev["metadata"]["namespace"], "ml");
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["reason"], "ScheduleBindingFailed");
    assert_eq!(ev["reportingController"], ME);
    assert_eq!(ev["reportingInstance"], "replica-a");
    assert_eq!(ev["regarding"]["kind"], "ResourceBinding");
    assert_eq!(ev["regarding"]["uid"], rb.meta().uid.clone().unwrap());
    let note = ev["note"].as_str().unwrap();
    assert!(note.len() <= 1024 && note.len() > 1000, "{}", note.len());
    // The same event again is a series on the same object (kube's Recorder patches it).
    let again = EventNote {
        warning: true,
        reason: "ScheduleBindingFailed".into(),
        action: "Scheduling".into(),
        message: "again".into(),
    };
    c.event(&regarding, &again).await.unwrap();
    let events = fake.list_objects("events.k8s.io/v1", "Event");
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["series"]["count"], 2);
    // A refused Event is an error naming the object.
    let bad = EventNote {
        reason: "R".repeat(200),
        ..again
    };
    let e = c.event(&regarding, &bad).await.err().unwrap();
    assert_eq!(e.status(), Some(422), "{e}");
    assert!(e.to_string().contains("ResourceBinding ml/rb"), "{e}");
}

#[tokio::test]
async fn cluster_resource_bindings_are_watched_patched_and_get_events() {
    let fake = FakeApi::start().await;
    let mut crb = binding("ml", "shared", ME);
    crb["kind"] = json!("ClusterResourceBinding");
    crb["metadata"].as_object_mut().unwrap().remove("namespace");
    fake.apply(crb);
    let c = client(&fake).await;
    let mut w = c.watch(Kind::ClusterResourceBinding);
    let Change::Applied(o) = next(&mut w).await else {
        panic!("expected the binding")
    };
    assert!(matches!(next(&mut w).await, Change::Synced));
    assert_eq!(o.key().namespace, None);
    let at = BindingRef::of(Kind::ClusterResourceBinding, &o).unwrap();
    let done = c
        .patch(
            &at,
            &json!({"spec": {"clusters": [{"name": "m1", "replicas": 3}]}}),
        )
        .await
        .unwrap();
    assert_eq!(done.value()["spec"]["clusters"][0]["name"], "m1");
    // The watch sees our own write.
    let Change::Applied(seen) = next(&mut w).await else {
        panic!("expected the patched binding")
    };
    assert_eq!(seen.meta().resource_version, done.meta().resource_version);
    let at = BindingRef::of(Kind::ClusterResourceBinding, &done).unwrap();
    c.patch_status(
        &at,
        &json!({"status": {"schedulerObservedGeneration": done.meta().generation}}),
    )
    .await
    .unwrap();
    c.event(
        &Kind::ClusterResourceBinding.reference(&done),
        &EventNote {
            warning: false,
            reason: "ScheduleBindingSucceed".into(),
            action: "Scheduling".into(),
            message: "Binding has been scheduled successfully. Result {m1:3}".into(),
        },
    )
    .await
    .unwrap();
    let events = fake.list_objects("events.k8s.io/v1", "Event");
    assert_eq!(events.len(), 1);
    // Cluster-scoped objects' Events live in `default`, as kube's Recorder puts them.
    assert_eq!(events[0]["metadata"]["namespace"], "default");
    assert_eq!(events[0]["regarding"]["kind"], "ClusterResourceBinding");
}

#[tokio::test]
async fn a_failing_watch_says_why() {
    // A port nothing listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cfg = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
    let c = KarmadaClient::new(
        kube::Client::try_from(cfg).unwrap(),
        KarmadaOptions::new(ME, "r"),
    );
    let w = c.watch(Kind::Cluster);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let why = loop {
        if let Some(why) = w.failing() {
            break why;
        }
        assert!(tokio::time::Instant::now() < deadline, "no error reported");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(why.contains("clusters"), "{why}");
    // A read against the same server is an error naming the object, not a hang.
    let e = c.get(Kind::Cluster, None, "m1").await.err().unwrap();
    assert!(e.to_string().starts_with("Cluster m1"), "{e}");
    assert_eq!(e.status(), None);
}

/// A client made from a kubeconfig for `fake` (the replica's path), with `limits`.
async fn bounded_client(fake: &FakeApi, dir: &std::path::Path, limits: Limits) -> KarmadaClient {
    let path = dir.join("karmada.yaml");
    std::fs::write(&path, fake.kubeconfig()).unwrap();
    let mut opts = KarmadaOptions::new(ME, "r");
    opts.limits = limits;
    KarmadaClient::from_kubeconfig(&path, opts).await.unwrap()
}

/// `obj` with an annotation of `bytes` bytes.
fn padded(mut obj: Value, bytes: usize) -> Value {
    obj["metadata"]["annotations"] = json!({"example.com/padding": "x".repeat(bytes)});
    obj
}

/// Polls `w.failing()` (at most 10 s) until it holds `want`; returns it.
async fn failing_with(w: &Watch, want: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(why) = w.failing().filter(|m| m.contains(want)) {
            return why;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the watch is not failing with {want:?}: {:?}",
            w.failing()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn answers_past_their_size_bound_fail_naming_the_object_and_the_bound() {
    let fake = FakeApi::start().await;
    let dir = tempfile::tempdir().unwrap();
    let limits = Limits {
        object: 64 << 10,
        list: 1 << 20,
    };
    let c = bounded_client(&fake, dir.path(), limits).await;
    fake.apply(cluster("small", true));
    let mut w = c.watch(Kind::Cluster);
    assert_eq!(applied(&next(&mut w).await).as_deref(), Some("small"));
    assert!(matches!(next(&mut w).await, Change::Synced));
    // Answers within the bounds pass.
    assert!(c.get(Kind::Cluster, None, "small").await.unwrap().is_some());

    // A watch event past the object bound: the watch fails (and keeps failing, since it
    // resumes from before the event) instead of buffering it.
    fake.apply(padded(cluster("huge", true), 100 << 10));
    let why = failing_with(
        &w,
        "a watch event from GET /apis/cluster.karmada.io/v1alpha1/clusters exceeds the bound of 65536 bytes",
    )
    .await;
    assert!(why.contains("watch"), "{why}");
    assert!(w.cache().get(None, "huge").is_none());

    // A get past the bound names the object.
    let e = c.get(Kind::Cluster, None, "huge").await.unwrap_err();
    assert!(matches!(e, KarmadaError::TooLarge { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.starts_with("Cluster huge: "), "{msg}");
    assert!(
        msg.contains(
            "GET /apis/cluster.karmada.io/v1alpha1/clusters/huge exceeds the bound of 65536 bytes"
        ),
        "{msg}"
    );

    // A patch whose answer (the object as written) is past the bound.
    fake.apply(padded(binding("ml", "rb", ME), 100 << 10));
    let rb = fake.get("ResourceBinding", Some("ml"), "rb").unwrap();
    let at = BindingRef {
        kind: Kind::ResourceBinding,
        namespace: Some("ml".into()),
        name: "rb".into(),
        resource_version: rb["metadata"]["resourceVersion"].as_str().unwrap().into(),
    };
    let e = c
        .patch(
            &at,
            &json!({"spec": {"clusters": [{"name": "m1", "replicas": 3}]}}),
        )
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, KarmadaError::TooLarge { .. }), "{e:?}");
    assert!(msg.starts_with("ResourceBinding ml/rb: "), "{msg}");
    assert!(
        msg.contains("PATCH") && msg.contains("65536 bytes"),
        "{msg}"
    );

    // A list page past the list bound: the watch of a client with a smaller one never syncs.
    let small = Limits {
        object: 64 << 10,
        list: 96 << 10,
    };
    let c2 = bounded_client(&fake, dir.path(), small).await;
    let w2 = c2.watch(Kind::Cluster);
    failing_with(
        &w2,
        "the answer from GET /apis/cluster.karmada.io/v1alpha1/clusters exceeds the bound of 98304 bytes",
    )
    .await;
    assert!(w2.cache().is_empty());
}
