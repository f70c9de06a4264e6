//! Broken and edge-case kustomizations in temporary directories: the check must fail with the
//! file, object and field named, and what kustomize renders must reach the typed decoding
//! with each object's source file.

use std::path::{Path, PathBuf};

use dramesh_deploy_check::{LoadError, Typed, check, render};
use serde_json::Value;

fn write(dir: &Path, rel: &str, text: &str) -> PathBuf {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, text).unwrap();
    p
}

fn kustomization(dir: &Path, rel_dir: &str, body: &str) {
    let path = if rel_dir.is_empty() {
        "kustomization.yaml".to_string()
    } else {
        format!("{rel_dir}/kustomization.yaml")
    };
    write(
        dir,
        &path,
        &format!("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n{body}"),
    );
}

fn expect_err(dir: &Path) -> LoadError {
    match check(dir) {
        Ok(objs) => panic!("expected an error, got {} objects", objs.len()),
        Err(e) => e,
    }
}

const SERVICE: &str = "apiVersion: v1
kind: Service
metadata:
  name: svc
spec:
  selector:
    app: x
  ports:
    - port: 80
";

const DAEMONSET: &str = "apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: ds
spec:
  selector:
    matchLabels:
      app: x
  template:
    metadata:
      labels:
        app: x
    spec:
      containers:
        - name: c
          image: ghcr.io/dramesh/dramesh:0.1.0
          args: [agent]
";

#[test]
fn unknown_field_in_a_manifest_names_file_object_and_field() {
    let t = tempfile::tempdir().unwrap();
    let bad = DAEMONSET.replace(
        "          args: [agent]\n",
        "          args: [agent]\n          imagePullPolicyy: Always\n",
    );
    let file = write(t.path(), "ds.yaml", &bad);
    kustomization(t.path(), "", "resources:\n  - ds.yaml\n");
    let e = expect_err(t.path());
    assert_eq!(e.file, file);
    assert_eq!(e.object.as_deref(), Some("DaemonSet ds"));
    assert_eq!(
        e.field.as_deref(),
        Some("spec.template.spec.containers[0].imagePullPolicyy")
    );
    assert_eq!(e.message, "unknown field");
    let text = e.to_string();
    assert!(
        text.contains("ds.yaml") && text.contains("imagePullPolicyy"),
        "{text}"
    );
}

#[test]
fn a_wrongly_typed_field_is_an_error_with_its_path() {
    let t = tempfile::tempdir().unwrap();
    write(
        t.path(),
        "svc.yaml",
        &SERVICE.replace("port: 80", "port: eighty"),
    );
    kustomization(t.path(), "", "resources:\n  - svc.yaml\n");
    let e = expect_err(t.path());
    assert_eq!(e.field.as_deref(), Some("spec.ports[0].port"));
}

#[test]
fn an_unknown_field_introduced_by_an_overlay_patch_is_caught_after_composition() {
    let t = tempfile::tempdir().unwrap();
    write(t.path(), "base/ds.yaml", DAEMONSET);
    kustomization(t.path(), "base", "resources:\n  - ds.yaml\n");
    kustomization(
        t.path(),
        "overlay",
        "resources:\n  - ../base\npatches:\n  - target:\n      kind: DaemonSet\n      name: ds\n    patch: |-\n      - op: add\n        path: /spec/template/spec/hostNetwrok\n        value: true\n",
    );
    let e = expect_err(&t.path().join("overlay"));
    assert_eq!(e.field.as_deref(), Some("spec.template.spec.hostNetwrok"));
    assert!(e.file.ends_with("base/ds.yaml"), "{}", e.file.display());
}

#[test]
fn cert_manager_objects_reject_unknown_fields_and_bad_values() {
    let cert = "apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: c
spec:
  secretName: c-tls
  uris: [dramesh://replica/r0]
  usages: [server auth]
  issuerRef:
    name: ca
";
    let cases = [
        (
            cert.replace("  uris:", "  subjectAltNames: [x]\n  uris:"),
            "spec.subjectAltNames",
        ),
        (cert.replace("server auth", "server-auth"), "spec.usages[0]"),
        (
            cert.replace("    name: ca\n", "    name: ca\n    kind: Issur\n"),
            "spec.issuerRef.kind",
        ),
        (
            cert.replace(
                "  secretName: c-tls\n",
                "  secretName: c-tls\n  duration: 90d\n",
            ),
            "spec.duration",
        ),
        (
            cert.replace("kind: Certificate", "kind: Certificate\nstatus: {}"),
            "status",
        ),
    ];
    for (text, field) in cases {
        let t = tempfile::tempdir().unwrap();
        write(t.path(), "cert.yaml", &text);
        kustomization(t.path(), "", "resources:\n  - cert.yaml\n");
        let e = expect_err(t.path());
        assert_eq!(e.field.as_deref(), Some(field), "{e}");
        assert_eq!(e.object.as_deref(), Some("Certificate c"));
    }
    // The unmodified Certificate is accepted.
    let t = tempfile::tempdir().unwrap();
    write(t.path(), "cert.yaml", cert);
    kustomization(t.path(), "", "resources:\n  - cert.yaml\n");
    let objs = check(t.path()).unwrap();
    assert!(matches!(objs[0].object, Typed::Certificate(_)));
}

#[test]
fn an_issuer_needs_exactly_one_type() {
    let t = tempfile::tempdir().unwrap();
    write(
        t.path(),
        "issuer.yaml",
        "apiVersion: cert-manager.io/v1\nkind: Issuer\nmetadata:\n  name: i\nspec:\n  selfSigned: {}\n  ca:\n    secretName: s\n",
    );
    kustomization(t.path(), "", "resources:\n  - issuer.yaml\n");
    assert_eq!(expect_err(t.path()).field.as_deref(), Some("spec"));
}

#[test]
fn kinds_without_a_typed_schema_are_refused() {
    let t = tempfile::tempdir().unwrap();
    write(
        t.path(),
        "x.yaml",
        "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n",
    );
    kustomization(t.path(), "", "resources:\n  - x.yaml\n");
    let e = expect_err(t.path());
    assert_eq!(e.field.as_deref(), Some("kind"));
    assert!(e.message.contains("example.com/v1/Widget"), "{e}");
    // An apps/v1beta2 DaemonSet is not silently read as apps/v1.
    let t = tempfile::tempdir().unwrap();
    write(
        t.path(),
        "ds.yaml",
        &DAEMONSET.replace("apps/v1", "apps/v1beta2"),
    );
    kustomization(t.path(), "", "resources:\n  - ds.yaml\n");
    assert_eq!(expect_err(t.path()).field.as_deref(), Some("kind"));
}

#[test]
fn kustomize_errors_name_the_kustomization_and_carry_kustomize_message() {
    for (body, says) in [
        ("resource:\n  - svc.yaml\n", "unknown field \"resource\""),
        ("resources:\n  - missing.yaml\n", "missing.yaml"),
        (
            "resources:\n  - svc.yaml\npatches:\n  - patch: |-\n      - op: add\n        path: /x\n        value: 1\n",
            "must specify a target",
        ),
        (
            "resources:\n  - svc.yaml\n  - svc2.yaml\n",
            "already registered id",
        ),
    ] {
        let t = tempfile::tempdir().unwrap();
        write(t.path(), "svc.yaml", SERVICE);
        write(t.path(), "svc2.yaml", SERVICE);
        kustomization(t.path(), "", body);
        let e = expect_err(t.path());
        assert_eq!(e.file, t.path().join("kustomization.yaml"), "{e}");
        assert!(e.message.contains(says), "{body}: {e}");
        assert!(
            !e.message.contains("run.go"),
            "kubectl's log prefix is stripped: {e}"
        );
    }

    let t = tempfile::tempdir().unwrap();
    kustomization(t.path(), "a", "resources:\n  - ../b\n");
    kustomization(t.path(), "b", "resources:\n  - ../a\n");
    assert!(expect_err(&t.path().join("a")).message.contains("cycle"));

    let t = tempfile::tempdir().unwrap();
    let e = expect_err(t.path());
    assert!(e.message.contains("no kustomization file"), "{e}");
}

#[test]
fn a_patch_adding_an_unknown_field_is_caught_by_the_typed_decoding() {
    for patch in [
        "      - op: replace\n        path: /spec/nope\n        value: 1\n",
        "      - op: add\n        path: /spec/nope\n        value: 1\n",
    ] {
        let t = tempfile::tempdir().unwrap();
        let file = write(t.path(), "ds.yaml", DAEMONSET);
        kustomization(
            t.path(),
            "",
            &format!(
                "resources:\n  - ds.yaml\npatches:\n  - target:\n      kind: DaemonSet\n    patch: |-\n{patch}"
            ),
        );
        let e = expect_err(t.path());
        assert_eq!(e.file, file);
        assert_eq!(e.field.as_deref(), Some("spec.nope"), "{e}");
    }
}

#[test]
fn renamed_objects_keep_their_source_and_references_follow() {
    let t = tempfile::tempdir().unwrap();
    let file = write(
        t.path(),
        "rbac.yaml",
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: cr\nrules: []\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: crb\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: cr\nsubjects:\n  - kind: ServiceAccount\n    name: sa\n    namespace: ns\n",
    );
    kustomization(t.path(), "", "namePrefix: x-\nresources:\n  - rbac.yaml\n");
    let objs = render(t.path()).unwrap();
    let crb = objs
        .iter()
        .find(|r| r.kind() == "ClusterRoleBinding")
        .expect("binding");
    assert_eq!(crb.name(), "x-crb");
    assert_eq!(crb.value["roleRef"]["name"], "x-cr");
    assert_eq!(crb.source.file, file);
    assert_eq!(crb.source.document, 1, "second document of rbac.yaml");
    assert!(
        crb.value["metadata"].get("annotations").is_none(),
        "the origin annotation is not passed on"
    );
}

#[test]
fn transformers_reach_the_typed_objects() {
    let t = tempfile::tempdir().unwrap();
    write(t.path(), "base/ds.yaml", DAEMONSET);
    write(t.path(), "base/svc.yaml", SERVICE);
    write(
        t.path(),
        "base/rbac.yaml",
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: cr\nrules: []\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: crb\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: cr\nsubjects:\n  - kind: ServiceAccount\n    name: sa\n",
    );
    kustomization(
        t.path(),
        "base",
        "namespace: ns1\nlabels:\n  - pairs:\n      team: a\n    includeTemplates: true\nresources:\n  - ds.yaml\n  - svc.yaml\n  - rbac.yaml\n",
    );
    write(t.path(), "svc-only/svc.yaml", SERVICE);
    kustomization(
        t.path(),
        "svc-only",
        "nameSuffix: -east\nnamespace: ns2\nresources:\n  - svc.yaml\n",
    );
    kustomization(
        t.path(),
        "overlay",
        "resources:\n  - ../base\n  - ../svc-only\nimages:\n  - name: ghcr.io/dramesh/dramesh\n    newName: mirror.example/dramesh\n    newTag: 0.2.0\npatches:\n  - target:\n      group: apps\n      version: v1\n      kind: DaemonSet\n      name: ds\n      namespace: ns1\n    patch: |-\n      - op: add\n        path: /spec/template/spec/containers/0/args/-\n        value: --cluster=member1\n",
    );
    let objs = render(&t.path().join("overlay")).unwrap();
    let get = |kind: &str, name: &str| -> &Value {
        &objs
            .iter()
            .find(|r| r.kind() == kind && r.name() == name)
            .unwrap_or_else(|| panic!("{kind} {name}"))
            .value
    };
    let ds = get("DaemonSet", "ds");
    assert_eq!(ds["metadata"]["namespace"], "ns1");
    assert_eq!(ds["metadata"]["labels"]["team"], "a");
    assert_eq!(ds["spec"]["template"]["metadata"]["labels"]["team"], "a");
    assert!(ds["spec"]["selector"]["matchLabels"].get("team").is_none());
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["image"], "mirror.example/dramesh:0.2.0");
    assert_eq!(c["args"], serde_json::json!(["agent", "--cluster=member1"]));
    let cr = get("ClusterRole", "cr");
    assert!(
        cr["metadata"].get("namespace").is_none(),
        "cluster-scoped kinds keep no namespace"
    );
    let crb = get("ClusterRoleBinding", "crb");
    // kustomize leaves a ServiceAccount subject without a namespace alone (the composer this
    // check used before set it), so deploy/ states subject namespaces explicitly.
    assert!(crb["subjects"][0].get("namespace").is_none(), "{crb}");
    assert_eq!(get("Service", "svc")["metadata"]["namespace"], "ns1");
    assert_eq!(get("Service", "svc-east")["metadata"]["namespace"], "ns2");
    // And every rendered object decodes.
    assert_eq!(check(&t.path().join("overlay")).unwrap().len(), 5);
}

#[test]
fn a_typo_in_a_copy_of_the_real_replica_manifests_is_caught() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/replica");
    let t = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, t.path().join(p.file_name().unwrap())).unwrap();
    }
    assert!(check(t.path()).is_ok(), "the unmodified copy is valid");
    let sts = t.path().join("statefulset.yaml");
    let text = std::fs::read_to_string(&sts).unwrap();
    let broken = text.replacen("  serviceName:", "  servicename: typo\n  serviceName:", 1);
    assert_ne!(text, broken);
    std::fs::write(&sts, broken).unwrap();
    let e = expect_err(t.path());
    assert_eq!(e.file, sts);
    assert_eq!(
        e.object.as_deref(),
        Some("StatefulSet karmada-system/dramesh-replica")
    );
    assert_eq!(e.field.as_deref(), Some("spec.servicename"));
}

#[test]
fn a_mistake_in_a_copy_of_the_scheduler_policy_example_fails_karmadas_crd() {
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/overlays/example/scheduler-policy");
    let text = std::fs::read_to_string(src.join("propagationpolicy.yaml")).unwrap();
    let kust = std::fs::read_to_string(src.join("kustomization.yaml")).unwrap();
    let copy = |policy: &str| {
        let t = tempfile::tempdir().unwrap();
        let file = write(t.path(), "propagationpolicy.yaml", policy);
        write(t.path(), "kustomization.yaml", &kust);
        (t, file)
    };
    let (t, _) = copy(&text);
    assert!(check(t.path()).is_ok(), "the unmodified copy is valid");
    let cases = [
        // A misspelt field the API server would prune: the policy would reach karmada-scheduler.
        ("schedulerName:", "schedulerNmae:", "spec.schedulerNmae"),
        (
            "replicaSchedulingType: Divided",
            "replicaSchedulingType: Split",
            "spec.placement.replicaScheduling.replicaSchedulingType",
        ),
        (
            "dynamicWeight: AvailableReplicas",
            "dynamicWeight: Available",
            "spec.placement.replicaScheduling.weightPreference.dynamicWeight",
        ),
        (
            "      name: train",
            "      nmae: train",
            "spec.resourceSelectors[0].nmae",
        ),
    ];
    for (from, to, field) in cases {
        let broken = text.replacen(from, to, 1);
        assert_ne!(text, broken, "{from} is in the example");
        let (t, file) = copy(&broken);
        let e = expect_err(t.path());
        assert_eq!(e.file, file, "{e}");
        assert_eq!(
            e.object.as_deref(),
            Some("PropagationPolicy ml/gpu-training"),
            "{e}"
        );
        assert_eq!(e.field.as_deref(), Some(field), "{e}");
    }
}
