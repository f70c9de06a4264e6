//! The Karmada side of the fake API server, driven by the real kube client: merge patches of a
//! ResourceBinding and of its `/status`, generation, optimistic concurrency, forced conflicts,
//! the write log, validation against the real CRD schema (422 naming the field), discovery.

use dramesh_fakeapi::FakeApi;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn rb_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("work.karmada.io", "v1alpha2", "ResourceBinding"),
        "resourcebindings",
    )
}

fn binding(name: &str) -> Value {
    json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "ml",
                "name": "trainer", "uid": "d-1"},
            "replicas": 3,
            "schedulerName": "dramesh-scheduler",
            "placement": {"clusterAffinity": {"clusterNames": ["m1", "m2"]},
                "replicaScheduling": {"replicaSchedulingType": "Divided",
                    "replicaDivisionPreference": "Aggregated"}}}})
}

/// Skips (loudly; fails under CI) when the CRD fixtures are not beside the repository.
fn crds(api: &FakeApi) -> bool {
    let present = dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_some();
    assert_eq!(present, api.validates_karmada_crds());
    present
}

async fn setup() -> (FakeApi, Api<DynamicObject>) {
    let fake = FakeApi::start().await;
    let api = Api::namespaced_with(fake.client(), "ml", &rb_resource());
    (fake, api)
}

fn kube_status(e: kube::Error) -> (u16, String, Value) {
    match e {
        kube::Error::Api(s) => (
            s.code,
            s.reason.clone(),
            serde_json::to_value(&s).unwrap_or(Value::Null),
        ),
        other => panic!("expected an API status, got {other}"),
    }
}

#[tokio::test]
async fn spec_and_status_merge_patches_split_as_the_status_subresource_does() {
    let (fake, api) = setup().await;
    if !crds(&fake) {
        return;
    }
    let created = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(binding("rb")).unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(created.metadata.generation, Some(1));
    assert!(created.metadata.uid.is_some());
    assert!(created.metadata.creation_timestamp.is_some());
    // The CRD's defaults are filled in as the API server does.
    assert_eq!(created.data["spec"]["conflictResolution"], "Abort");

    // Main resource: spec and annotations change, the status in the same patch is ignored.
    let spec_patch = json!({
        "metadata": {"annotations": {"policy.karmada.io/applied-placement": "{\"clusterAffinity\":{}}"}},
        "spec": {"clusters": [{"name": "m1", "replicas": 2}, {"name": "m2", "replicas": 1}]},
        "status": {"schedulerObservedGeneration": 99}});
    let after = api
        .patch("rb", &PatchParams::default(), &Patch::Merge(&spec_patch))
        .await
        .unwrap();
    assert_eq!(after.metadata.generation, Some(2));
    assert_eq!(after.data["spec"]["clusters"][1]["name"], "m2");
    assert!(
        after.data["status"]
            .get("schedulerObservedGeneration")
            .is_none()
    );

    // A metadata-only change does not bump the generation.
    let labelled = api
        .patch(
            "rb",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    assert_eq!(labelled.metadata.generation, Some(2));

    // Status: only the status lands, the generation stays.
    let status_patch = json!({
        "spec": {"replicas": 50},
        "status": {"schedulerObservedGeneration": 2, "lastScheduledTime": "2026-11-25T12:00:00Z",
            "conditions": [{"type": "Scheduled", "status": "True", "reason": "Success",
                "message": "Binding has been scheduled successfully.",
                "lastTransitionTime": "2026-11-25T12:00:00Z"}]}});
    let done = api
        .patch_status("rb", &PatchParams::default(), &Patch::Merge(&status_patch))
        .await
        .unwrap();
    assert_eq!(done.metadata.generation, Some(2));
    assert_eq!(done.data["spec"]["replicas"], 3);
    assert_eq!(done.data["status"]["schedulerObservedGeneration"], 2);
    assert_eq!(done.data["status"]["conditions"][0]["reason"], "Success");

    // The write log has every write, in order, with its exact body.
    let writes: Vec<_> = fake
        .writes()
        .into_iter()
        .filter(|w| w.kind == "ResourceBinding")
        .collect();
    assert_eq!(writes.len(), 4);
    assert_eq!(writes[0].method, "POST");
    assert_eq!(writes[1].body, spec_patch);
    assert_eq!(writes[1].content_type, "application/merge-patch+json");
    assert_eq!(writes[1].subresource, None);
    assert_eq!(writes[3].subresource.as_deref(), Some("status"));
    assert_eq!(writes[3].body, status_patch);
    assert!(writes.iter().all(|w| w.code < 300), "{writes:?}");
}

#[tokio::test]
async fn stale_resource_versions_and_forced_conflicts_answer_409_conflict() {
    let (fake, api) = setup().await;
    let created = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(binding("rb")).unwrap(),
        )
        .await
        .unwrap();
    let rv = created.metadata.resource_version.clone().unwrap();
    api.patch(
        "rb",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"x": "1"}}})),
    )
    .await
    .unwrap();
    // The first version is stale now.
    let stale = json!({"metadata": {"resourceVersion": rv}, "spec": {"clusters": [{"name": "m1", "replicas": 3}]}});
    let (code, reason, status) = kube_status(
        api.patch("rb", &PatchParams::default(), &Patch::Merge(&stale))
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (409, "Conflict"), "{status}");
    let (code, reason, _) = kube_status(
        api.patch_status("rb", &PatchParams::default(), &Patch::Merge(&stale))
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (409, "Conflict"));
    assert!(
        fake.get("ResourceBinding", Some("ml"), "rb").unwrap()["spec"]
            .get("clusters")
            .is_none()
    );

    // Forced: the next two writes conflict even with the current version, the third lands.
    fake.conflict_next_writes("ResourceBinding", Some("ml"), "rb", 2);
    let current =
        fake.get("ResourceBinding", Some("ml"), "rb").unwrap()["metadata"]["resourceVersion"]
            .clone();
    let fresh = json!({"metadata": {"resourceVersion": current}, "spec": {"clusters": [{"name": "m1", "replicas": 3}]}});
    for _ in 0..2 {
        let (code, reason, _) = kube_status(
            api.patch("rb", &PatchParams::default(), &Patch::Merge(&fresh))
                .await
                .unwrap_err(),
        );
        assert_eq!((code, reason.as_str()), (409, "Conflict"));
    }
    let landed = api
        .patch("rb", &PatchParams::default(), &Patch::Merge(&fresh))
        .await
        .unwrap();
    assert_eq!(landed.data["spec"]["clusters"][0]["replicas"], 3);
    let codes: Vec<u16> = fake.writes().iter().map(|w| w.code).collect();
    assert_eq!(codes, vec![201, 200, 409, 409, 409, 409, 200]);
}

#[tokio::test]
async fn invalid_writes_are_refused_with_the_field_named() {
    let (fake, api) = setup().await;
    if !crds(&fake) {
        return;
    }
    api.create(
        &PostParams::default(),
        &serde_json::from_value(binding("rb")).unwrap(),
    )
    .await
    .unwrap();
    let causes = |s: &Value| -> Vec<String> {
        s["details"]["causes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["field"].as_str().unwrap().to_string())
            .collect()
    };
    // A misspelt field in the spec.
    let (code, reason, s) = kube_status(
        api.patch(
            "rb",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"clusters": [{"name": "m1", "replcas": 2}]}})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (422, "Invalid"), "{s}");
    assert_eq!(causes(&s), vec!["spec.clusters[0].replcas"], "{s}");
    assert!(
        s["message"].as_str().unwrap().starts_with(
            "ResourceBinding.work.karmada.io \"rb\" is invalid: spec.clusters[0].replcas"
        ),
        "{s}"
    );
    // A condition without its required reason, with a bad status and a bad timestamp.
    let (code, _, s) = kube_status(
        api.patch_status(
            "rb",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"conditions": [{"type": "Scheduled", "status": "Yes",
                "message": "", "lastTransitionTime": "now"}]}}),
            ),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(code, 422);
    let mut got = causes(&s);
    got.sort();
    assert_eq!(
        got,
        vec![
            "status.conditions[0].lastTransitionTime",
            "status.conditions[0].reason",
            "status.conditions[0].status",
        ],
        "{s}"
    );
    // Replicas beyond int32 and a negative observedGeneration.
    let (code, _, s) = kube_status(
        api.patch(
            "rb",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"clusters": [{"name": "m1", "replicas": 4_294_967_296u64}]}}),
            ),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(
        (code, causes(&s)),
        (422, vec!["spec.clusters[0].replicas".to_string()])
    );
    // Nothing invalid was stored.
    let stored = fake.get("ResourceBinding", Some("ml"), "rb").unwrap();
    assert!(stored["spec"].get("clusters").is_none());
    assert!(
        stored
            .get("status")
            .is_none_or(|s| s.get("conditions").is_none())
    );
    // The test helper refuses invalid objects too.
    let mut wrong = binding("typo");
    wrong["spec"]["schedulerNmae"] = json!("x");
    let s = fake.try_apply(wrong).unwrap_err();
    assert_eq!(causes(&s), vec!["spec.schedulerNmae"]);
}

#[tokio::test]
async fn other_patch_types_are_unsupported_and_discovery_finds_kinds() {
    let (fake, api) = setup().await;
    api.create(
        &PostParams::default(),
        &serde_json::from_value(binding("rb")).unwrap(),
    )
    .await
    .unwrap();
    let addr = fake.url.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let body = r#"[{"op": "replace", "path": "/spec/replicas", "value": 4}]"#;
    let req = format!(
        "PATCH /apis/work.karmada.io/v1alpha2/namespaces/ml/resourcebindings/rb HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json-patch+json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 415"), "{out}");
    assert_eq!(
        fake.get("ResourceBinding", Some("ml"), "rb").unwrap()["spec"]["replicas"],
        3
    );

    for (group, version, kind, plural, namespaced) in [
        ("apps", "v1", "Deployment", "deployments", true),
        ("", "v1", "Pod", "pods", true),
        (
            "work.karmada.io",
            "v1alpha2",
            "ClusterResourceBinding",
            "clusterresourcebindings",
            false,
        ),
        (
            "cluster.karmada.io",
            "v1alpha1",
            "Cluster",
            "clusters",
            false,
        ),
    ] {
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let (ar, caps) = kube::discovery::pinned_kind(&fake.client(), &gvk)
            .await
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert_eq!(ar.plural, plural);
        assert_eq!(caps.scope == kube::discovery::Scope::Namespaced, namespaced);
    }
    // A cluster-scoped kind under a namespace does not exist.
    let wrong: Api<DynamicObject> = Api::namespaced_with(
        fake.client(),
        "ml",
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("cluster.karmada.io", "v1alpha1", "Cluster"),
            "clusters",
        ),
    );
    let (code, _, _) = kube_status(wrong.get("m1").await.unwrap_err());
    assert_eq!(code, 404);
}

/// A binding as Karmada's own controllers leave it (detector, scheduler, failover, status
/// aggregation): everything a real API server returns must load and pass the schema.
#[tokio::test]
async fn bindings_as_karmada_writes_them_pass_the_schema() {
    let fake = FakeApi::start().await;
    if !crds(&fake) {
        return;
    }
    let full = json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ClusterResourceBinding",
        "metadata": {"name": "trainer-deployment", "labels": {"propagationpolicy.karmada.io/permanent-id": "x"},
            "annotations": {"policy.karmada.io/applied-placement": "{}"},
            "finalizers": ["karmada.io/binding-controller"],
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "trainer",
                "uid": "d-1", "controller": true, "blockOwnerDeletion": true}]},
        "spec": {
            "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "ml",
                "name": "trainer", "uid": "d-1", "resourceVersion": "12"},
            "replicas": 4,
            "replicaRequirements": {"resourceRequest": {"cpu": "100m", "memory": "1Gi", "nvidia.com/gpu": 1},
                "nodeClaim": {"nodeSelector": {"gpu": "true"},
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
                "priorityClassName": "high"},
            "schedulerName": "dramesh-scheduler",
            "schedulePriority": {"priority": 1000},
            "placement": {
                "clusterAffinities": [{"affinityName": "primary", "clusterNames": ["m1"]},
                    {"affinityName": "backup", "labelSelector": {"matchLabels": {"region": "eu"}}}],
                "clusterTolerations": [{"key": "cluster.karmada.io/not-ready", "operator": "Exists",
                    "effect": "NoExecute", "tolerationSeconds": 300}],
                "spreadConstraints": [{"spreadByField": "cluster", "maxGroups": 2, "minGroups": 1}],
                "replicaScheduling": {"replicaSchedulingType": "Divided",
                    "replicaDivisionPreference": "Weighted",
                    "weightPreference": {"staticWeightList": [
                        {"targetCluster": {"clusterNames": ["m1"]}, "weight": 2}]}}},
            "clusters": [{"name": "m1", "replicas": 4}],
            "gracefulEvictionTasks": [{"fromCluster": "m2", "replicas": 2, "reason": "Preempted",
                "message": "preempted by ml/urgent", "producer": "dramesh-scheduler",
                "purgeMode": "Gracefully", "creationTimestamp": "2026-11-25T12:00:00Z"}],
            "rescheduleTriggeredAt": "2026-11-25T11:00:00Z"},
        "status": {
            "schedulerObservedGeneration": 3,
            "schedulerObservingAffinityName": "primary",
            "lastScheduledTime": "2026-11-25T12:00:00Z",
            "conditions": [{"type": "Scheduled", "status": "True", "reason": "Success",
                "message": "Binding has been scheduled successfully.", "observedGeneration": 3,
                "lastTransitionTime": "2026-11-25T12:00:00Z"}],
            "aggregatedStatus": [{"clusterName": "m1", "applied": true, "health": "Healthy",
                "status": {"readyReplicas": 4, "anything": {"nested": [1]}}}]}});
    fake.try_apply(full.clone())
        .unwrap_or_else(|s| panic!("a binding as Karmada writes it was refused: {s}"));
    let stored = fake
        .get("ClusterResourceBinding", None, "trainer-deployment")
        .unwrap();
    assert_eq!(
        stored["spec"]["gracefulEvictionTasks"][0]["reason"],
        "Preempted"
    );
    // A reason Karmada's pattern refuses (spaces) is named.
    let mut bad = full;
    bad["spec"]["gracefulEvictionTasks"][0]["reason"] = json!("preempted by urgent");
    let s = fake.try_apply(bad).unwrap_err();
    assert_eq!(
        s["details"]["causes"][0]["field"], "spec.gracefulEvictionTasks[0].reason",
        "{s}"
    );
}

/// Every CRD among the fixtures compiles for every served version: the validator implements
/// every keyword Karmada's schemas use (an unimplemented one fails compilation by name).
#[test]
fn every_fixture_crd_compiles() {
    let Some(dir) = dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS) else {
        return;
    };
    let mut compiled = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let doc: Value = serde_norway::from_str(&text).unwrap();
        for v in doc["spec"]["versions"].as_array().unwrap() {
            if v["served"] != true {
                continue;
            }
            let version = v["name"].as_str().unwrap();
            dramesh_fakeapi::schema::load_crd(&path, version).unwrap_or_else(|e| panic!("{e}"));
            compiled += 1;
        }
    }
    assert!(compiled >= 5, "only {compiled} schemas compiled");
}
