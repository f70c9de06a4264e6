//! The manifests under `deploy/`: every kustomization renders and every object decodes
//! strictly, and the properties the deployment relies on hold in the rendered objects.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use dramesh_deploy_check::certmanager::{Certificate, Issuer};
use dramesh_deploy_check::{Checked, Typed, check, karmada, kustomization_dirs, render};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Container, PodSpec, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

fn deploy_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn checked(rel: &str) -> Vec<Checked> {
    let dir = deploy_root().join(rel);
    check(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

macro_rules! all {
    ($objs:expr, $variant:ident) => {
        $objs
            .iter()
            .filter_map(|c| match &c.object {
                Typed::$variant(o) => Some(o.as_ref()),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
}

fn name_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or("")
}

/// The object named `name` among `items` (exactly one).
fn named<
    'a,
    T: k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
>(
    items: Vec<&'a T>,
    name: &str,
) -> &'a T {
    one(
        items
            .into_iter()
            .filter(|o| o.metadata().name.as_deref() == Some(name))
            .collect(),
        name,
    )
}

fn one<'a, T>(items: Vec<&'a T>, what: &str) -> &'a T {
    assert_eq!(items.len(), 1, "expected exactly one {what}");
    items[0]
}

fn pod_spec_ds(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec")
}

fn pod_spec_sts(sts: &StatefulSet) -> &PodSpec {
    sts.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec")
}

fn args(c: &Container) -> Vec<&str> {
    c.args.iter().flatten().map(String::as_str).collect()
}

/// The value of `--flag=value` arguments.
fn flag_values<'a>(c: &'a Container, flag: &str) -> Vec<&'a str> {
    let prefix = format!("{flag}=");
    c.args
        .iter()
        .flatten()
        .filter_map(|a| a.strip_prefix(prefix.as_str()))
        .collect()
}

fn rule_set(rules: &[PolicyRule]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for r in rules {
        assert!(
            r.resource_names.is_none() && r.non_resource_urls.is_none(),
            "unexpected rule shape {r:?}"
        );
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                for v in &r.verbs {
                    out.insert((g.clone(), res.clone(), v.clone()));
                }
            }
        }
    }
    out
}

/// The identity URI grammar of crates/dramesh-mesh/src/identity.rs.
fn valid_identity(uri: &str) -> bool {
    let seg = |s: &str| {
        let b = s.as_bytes();
        let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        !b.is_empty()
            && b.len() <= 253
            && alnum(b[0])
            && alnum(b[b.len() - 1])
            && b.iter().all(|&c| alnum(c) || c == b'-' || c == b'.')
    };
    let Some(rest) = uri.strip_prefix("dramesh://") else {
        return false;
    };
    match rest.split('/').collect::<Vec<_>>().as_slice() {
        ["cluster", c, "agent", n] => seg(c) && seg(n),
        ["replica", id] => seg(id),
        _ => false,
    }
}

#[test]
fn every_kustomization_renders_and_decodes() {
    let root = deploy_root();
    let dirs = kustomization_dirs(&root).unwrap();
    let rel: BTreeSet<String> = dirs
        .iter()
        .map(|d| d.strip_prefix(&root).unwrap().display().to_string())
        .collect();
    for want in [
        "agent",
        "agent-hostpath",
        "replica",
        "karmada-estimator-services",
        "cert-manager",
        "cert-manager/agent-node-example",
        "overlays/example/host",
        "overlays/example/karmada-apiserver",
        "overlays/example/member1",
        "overlays/example/member2",
        "overlays/example/member3",
        "overlays/example/scheduler-policy",
    ] {
        assert!(rel.contains(want), "missing kustomization {want}: {rel:?}");
    }
    for dir in &dirs {
        let karmada_objects = render(dir).unwrap().iter().any(|r| {
            karmada::KARMADA_KINDS
                .iter()
                .any(|(v, k, _)| r.api_version() == *v && r.kind() == *k)
        });
        if karmada_objects && dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
            eprintln!(
                "skipped {}: ../shared/fixtures/karmada/crds is absent, Karmada objects cannot be checked",
                dir.display()
            );
            continue;
        }
        let objs = check(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        assert!(!objs.is_empty(), "{} renders to nothing", dir.display());
    }
}

#[test]
fn every_manifest_file_is_reached_by_some_kustomization() {
    let root = deploy_root();
    let mut used = BTreeSet::new();
    for dir in kustomization_dirs(&root).unwrap() {
        for r in render(&dir).unwrap() {
            used.insert(r.source.file.canonicalize().unwrap());
        }
    }
    let mut stack = vec![root.clone()];
    let mut unreached = Vec::new();
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let is_yaml = p
                .extension()
                .is_some_and(|x| x == "yaml" || x == "yml" || x == "json");
            let is_kustomization = p
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("kustomization"));
            if is_yaml && !is_kustomization && !used.contains(&p.canonicalize().unwrap()) {
                unreached.push(p);
            }
        }
    }
    assert!(
        unreached.is_empty(),
        "manifests no kustomization includes (so the check never sees them): {unreached:?}"
    );
}

#[test]
fn agent_rbac_is_read_only_plus_a_namespaced_lease() {
    let objs = checked("agent");
    let cr: &ClusterRole = named(all!(objs, ClusterRole), "dramesh-agent");
    let got = rule_set(cr.rules.as_deref().unwrap_or_default());
    let mut want = BTreeSet::new();
    for (g, res) in [
        ("resource.k8s.io", "resourceslices"),
        ("resource.k8s.io", "deviceclasses"),
        ("resource.k8s.io", "resourceclaims"),
        ("resource.k8s.io", "devicetaintrules"),
        ("resource.k8s.io", "resourceclaimtemplates"),
        ("", "nodes"),
        ("", "pods"),
        ("karpenter.sh", "nodepools"),
        ("karpenter.sh", "nodeclaims"),
    ] {
        for v in ["get", "list", "watch"] {
            want.insert((g.to_string(), res.to_string(), v.to_string()));
        }
    }
    assert_eq!(
        got, want,
        "ClusterRole grants exactly get/list/watch on the published kinds"
    );

    let role: &Role = one(all!(objs, Role), "Role");
    assert_eq!(role.metadata.namespace.as_deref(), Some("dramesh-system"));
    let got = rule_set(role.rules.as_deref().unwrap_or_default());
    let want: BTreeSet<_> = ["get", "create", "update"]
        .iter()
        .map(|v| {
            (
                "coordination.k8s.io".to_string(),
                "leases".to_string(),
                v.to_string(),
            )
        })
        .collect();
    assert_eq!(got, want, "the Role only manages Leases");

    let sa: &ServiceAccount = named(all!(objs, ServiceAccount), "dramesh-agent");
    let sa_name = name_of(&sa.metadata);
    let sa_ns = sa.metadata.namespace.as_deref();

    let crb: &ClusterRoleBinding = named(all!(objs, ClusterRoleBinding), "dramesh-agent");
    assert_eq!(crb.role_ref.kind, "ClusterRole");
    assert_eq!(crb.role_ref.name, name_of(&cr.metadata));
    let rb: &RoleBinding = one(all!(objs, RoleBinding), "RoleBinding");
    assert_eq!(
        rb.role_ref.kind, "Role",
        "lease rights must not come from a ClusterRole"
    );
    assert_eq!(rb.role_ref.name, name_of(&role.metadata));
    assert_eq!(rb.metadata.namespace, role.metadata.namespace);
    for subjects in [&crb.subjects, &rb.subjects] {
        let s = subjects.as_deref().unwrap_or_default();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].kind, "ServiceAccount");
        assert_eq!(s[0].name, sa_name);
        assert_eq!(s[0].namespace.as_deref(), sa_ns);
    }

    let ds: &DaemonSet = one(all!(objs, DaemonSet), "DaemonSet");
    assert_eq!(
        pod_spec_ds(ds).service_account_name.as_deref(),
        Some(sa_name)
    );
    assert_eq!(ds.metadata.namespace.as_deref(), sa_ns);
}

#[test]
fn agent_daemonset_runs_one_agent_per_node_with_probes() {
    let objs = checked("agent");
    let ds: &DaemonSet = one(all!(objs, DaemonSet), "DaemonSet");
    let spec = ds.spec.as_ref().unwrap();
    let template_labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .as_ref()
        .unwrap();
    for (k, v) in spec.selector.match_labels.as_ref().unwrap() {
        assert_eq!(
            template_labels.get(k),
            Some(v),
            "selector matches the pod template"
        );
    }
    assert_eq!(
        template_labels
            .get("app.kubernetes.io/part-of")
            .map(String::as_str),
        Some("dramesh"),
        "kustomization labels reach the pod template"
    );
    let pod = pod_spec_ds(ds);
    let c = one(pod.containers.iter().collect(), "container");
    assert_eq!(c.image.as_deref(), Some("ghcr.io/dramesh/dramesh:0.1.0"));
    let a = args(c);
    assert_eq!(a[0], "agent");
    assert_eq!(flag_values(c, "--source"), ["kube"]);
    assert_eq!(flag_values(c, "--node-name"), ["$(NODE_NAME)"]);
    // The writer is the node: the identity the signer issues names it.
    assert_eq!(flag_values(c, "--agent-name"), ["$(NODE_NAME)"]);
    // One agent per cluster publishes cluster-scoped records: the Lease holder.
    assert_eq!(flag_values(c, "--lease-namespace"), ["$(POD_NAMESPACE)"]);
    assert_eq!(
        flag_values(c, "--mesh-credential-bundle"),
        ["/etc/dramesh/tls/credentialbundle.pem"]
    );
    assert!(flag_values(c, "--mesh-cert").is_empty() && flag_values(c, "--mesh-key").is_empty());
    assert_eq!(flag_values(c, "--mesh-ca"), ["/etc/dramesh/tls/ca.crt"]);
    assert_eq!(flag_values(c, "--data-dir"), ["/var/lib/dramesh"]);
    // The Lease holder is the cluster's relay: node agents reach it at its pod IP on the mesh
    // port, which the agent listens on (a fixed port, not an ephemeral one).
    assert_eq!(flag_values(c, "--listen"), ["0.0.0.0:7947"]);
    assert_eq!(flag_values(c, "--relay-advertise"), ["$(POD_IP):7947"]);

    let env: BTreeMap<&str, &str> = c
        .env
        .iter()
        .flatten()
        .map(|e| {
            let field = e
                .value_from
                .as_ref()
                .and_then(|v| v.field_ref.as_ref())
                .map(|f| f.field_path.as_str())
                .unwrap_or("");
            (e.name.as_str(), field)
        })
        .collect();
    assert_eq!(env.get("NODE_NAME"), Some(&"spec.nodeName"));
    assert_eq!(env.get("POD_NAMESPACE"), Some(&"metadata.namespace"));
    assert_eq!(env.get("POD_IP"), Some(&"status.podIP"));

    let ports: BTreeSet<(Option<&str>, i32, Option<&str>)> = c
        .ports
        .iter()
        .flatten()
        .map(|p| (p.name.as_deref(), p.container_port, p.protocol.as_deref()))
        .collect();
    assert_eq!(
        ports,
        BTreeSet::from([
            (Some("metrics"), 9090, Some("TCP")),
            (Some("mesh"), 7947, Some("UDP")),
        ])
    );
    for (probe, path) in [
        (&c.liveness_probe, "/healthz"),
        (&c.readiness_probe, "/readyz"),
    ] {
        let http = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .expect("HTTP probe");
        assert_eq!(http.path.as_deref(), Some(path));
        assert_eq!(http.port, IntOrString::String("metrics".into()));
    }
    let res = c.resources.as_ref().expect("resources");
    let req = res.requests.as_ref().expect("requests");
    assert!(req.contains_key("cpu") && req.contains_key("memory"));
    assert!(
        res.limits
            .as_ref()
            .is_some_and(|l| l.contains_key("memory"))
    );

    let volumes: BTreeMap<&str, &str> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| Some((v.name.as_str(), v.host_path.as_ref()?.path.as_str())))
        .collect();
    let mounts: BTreeMap<&str, (&str, bool)> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            (
                m.mount_path.as_str(),
                (m.name.as_str(), m.read_only.unwrap_or(false)),
            )
        })
        .collect();
    let (data, ro) = mounts["/var/lib/dramesh"];
    assert_eq!(volumes[data], "/var/lib/dramesh");
    assert!(!ro, "the document store is written");
    let (tls, ro) = mounts["/etc/dramesh/tls"];
    assert!(ro, "certificates are mounted read-only");
    // The identity is a Pod Certificate: the kubelet's key and the dramesh signer's chain in
    // the bundle the agent reads, the mesh CA beside it.
    let sources = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == tls)
        .and_then(|v| v.projected.as_ref())
        .and_then(|p| p.sources.as_ref())
        .expect("the tls volume is projected");
    let pc = one(
        sources
            .iter()
            .filter_map(|s| s.pod_certificate.as_ref())
            .collect(),
        "podCertificate source",
    );
    assert_eq!(pc.signer_name, "dramesh.io/agent");
    assert_eq!(pc.key_type, "ECDSAP256", "a key type the signer signs");
    assert_eq!(
        pc.credential_bundle_path.as_deref(),
        Some("credentialbundle.pem")
    );
    assert!(
        pc.max_expiration_seconds
            .is_some_and(|s| (3600..=7_862_400).contains(&s)),
        "maxExpirationSeconds within the API's range"
    );
    let ca = one(
        sources
            .iter()
            .filter_map(|s| s.config_map.as_ref())
            .collect(),
        "configMap source",
    );
    assert!(
        ca.items
            .iter()
            .flatten()
            .any(|i| i.key == "ca.crt" && i.path == "ca.crt")
    );

    let sc = c.security_context.as_ref().expect("securityContext");
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
        Some(vec!["ALL".to_string()])
    );
    assert!(sc.privileged.is_none_or(|p| !p));
}

#[test]
fn member_overlays_name_their_cluster_and_every_replica() {
    for m in ["member1", "member2", "member3"] {
        let objs = checked(&format!("overlays/example/{m}"));
        let ds: &DaemonSet = one(all!(objs, DaemonSet), "DaemonSet");
        let c = &pod_spec_ds(ds).containers[0];
        assert_eq!(flag_values(c, "--cluster"), [m], "{m}");
        let replicas = flag_values(c, "--replica");
        assert_eq!(replicas.len(), 3, "{m}: one --replica per replica");
        for r in replicas {
            let (host, port) = r.rsplit_once(':').expect("host:port");
            assert!(!host.is_empty(), "{r}");
            assert_eq!(port, "7946", "{r}: the replica mesh port");
        }
        assert_eq!(c.image.as_deref(), Some("ghcr.io/dramesh/dramesh:0.1.0"));
        // The overlay keeps the base's RBAC unchanged (the agent's and the signer's).
        assert_eq!(all!(objs, ClusterRole).len(), 2);
        assert_eq!(all!(objs, Role).len(), 1);
    }
}

#[test]
fn replica_statefulset_has_storage_probes_and_spread() {
    let objs = checked("replica");
    let sts: &StatefulSet = one(all!(objs, StatefulSet), "StatefulSet");
    assert_eq!(sts.metadata.namespace.as_deref(), Some("karmada-system"));
    let spec = sts.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(3));

    let claims = spec.volume_claim_templates.as_deref().unwrap_or_default();
    let claim = one(claims.iter().collect(), "volumeClaimTemplate");
    let claim_name = name_of(&claim.metadata);
    let storage = claim
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .expect("storage request");
    assert_eq!(storage, &Quantity("10Gi".into()));

    let pod = pod_spec_sts(sts);
    let c = one(pod.containers.iter().collect(), "container");
    let data_mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == "/var/lib/dramesh")
        .expect("data mount");
    assert_eq!(data_mount.name, claim_name, "the store lives on the claim");
    assert_eq!(flag_values(c, "--data-dir"), ["/var/lib/dramesh"]);
    assert_eq!(flag_values(c, "--id"), ["$(POD_NAME)"]);
    assert_eq!(flag_values(c, "--grpc"), ["0.0.0.0:10352"]);
    assert_eq!(flag_values(c, "--api"), ["0.0.0.0:8080"]);
    assert_eq!(flag_values(c, "--listen-mesh"), ["0.0.0.0:7946"]);
    assert_eq!(args(c)[0], "replica");

    for (probe, path) in [
        (&c.startup_probe, "/healthz"),
        (&c.liveness_probe, "/healthz"),
        (&c.readiness_probe, "/readyz"),
    ] {
        let http = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .expect("HTTP probe");
        assert_eq!(http.path.as_deref(), Some(path));
        assert_eq!(http.port, IntOrString::String("api".into()));
        assert_eq!(
            http.scheme.as_deref(),
            Some("HTTPS"),
            "the API port serves TLS"
        );
    }
    assert!(
        !args(c).iter().any(|a| a.starts_with("--api-insecure")),
        "the deployed APIs never serve plaintext"
    );
    assert_eq!(
        flag_values(c, "--api-cert"),
        ["/etc/dramesh/api-tls/tls.crt"]
    );
    assert_eq!(
        flag_values(c, "--api-key"),
        ["/etc/dramesh/api-tls/tls.key"]
    );
    assert_eq!(
        flag_values(c, "--api-client-ca"),
        ["/etc/dramesh/api-tls/ca.crt"]
    );
    let api_mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == "/etc/dramesh/api-tls")
        .expect("API TLS mount");
    let api_volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == api_mount.name)
        .and_then(|v| v.secret.as_ref())
        .expect("API TLS Secret volume");
    assert_eq!(api_volume.secret_name.as_deref(), Some("dramesh-api-tls"));
    let api_port = c
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("api"))
        .expect("api port");
    assert_eq!(api_port.container_port, 8080);
    let mesh_port = c
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("mesh"))
        .expect("mesh port");
    assert_eq!(
        (mesh_port.container_port, mesh_port.protocol.as_deref()),
        (7946, Some("UDP"))
    );

    let res = c.resources.as_ref().expect("resources");
    let req = res.requests.as_ref().unwrap();
    assert_eq!(req.get("cpu"), Some(&Quantity("500m".into())));
    assert_eq!(req.get("memory"), Some(&Quantity("1Gi".into())));
    assert_eq!(
        res.limits.as_ref().and_then(|l| l.get("memory")),
        Some(&Quantity("4Gi".into()))
    );

    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    let anti = pod
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .expect("required pod anti-affinity");
    let term = one(anti.iter().collect(), "anti-affinity term");
    assert_eq!(term.topology_key, "kubernetes.io/hostname");
    let sel = term
        .label_selector
        .as_ref()
        .and_then(|s| s.match_labels.as_ref())
        .unwrap();
    for (k, v) in sel {
        assert_eq!(
            pod_labels.get(k),
            Some(v),
            "anti-affinity selects the replica pods"
        );
    }
    assert_eq!(pod.automount_service_account_token, Some(false));
}

#[test]
fn replica_services_and_disruption_budget_select_the_pods() {
    let objs = checked("replica");
    let sts: &StatefulSet = one(all!(objs, StatefulSet), "StatefulSet");
    let spec = sts.spec.as_ref().unwrap();
    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    let selects_pods = |sel: &BTreeMap<String, String>| {
        !sel.is_empty() && sel.iter().all(|(k, v)| pod_labels.get(k) == Some(v))
    };
    let services: BTreeMap<&str, &Service> = all!(objs, Service)
        .into_iter()
        .map(|s| (name_of(&s.metadata), s))
        .collect();

    let headless = services[spec.service_name.as_deref().expect("serviceName")];
    let hs = headless.spec.as_ref().unwrap();
    assert_eq!(
        hs.cluster_ip.as_deref(),
        Some("None"),
        "governing Service is headless"
    );
    assert_eq!(hs.publish_not_ready_addresses, Some(true));
    assert!(selects_pods(hs.selector.as_ref().unwrap()));

    // The seed is pod 0 through the governing Service, on the mesh port.
    let c = &pod_spec_sts(sts).containers[0];
    let seed = flag_values(c, "--seed");
    let sts_name = name_of(&sts.metadata);
    assert_eq!(
        seed,
        [format!("{sts_name}-0.{}:7946", name_of(&headless.metadata)).as_str()]
    );

    let api = services["dramesh-replica"];
    let s = api.spec.as_ref().unwrap();
    assert_eq!(s.type_.as_deref(), Some("ClusterIP"));
    assert!(selects_pods(s.selector.as_ref().unwrap()));
    let ports: BTreeMap<i32, &IntOrString> = s
        .ports
        .iter()
        .flatten()
        .map(|p| (p.port, p.target_port.as_ref().unwrap()))
        .collect();
    assert_eq!(
        ports.keys().copied().collect::<Vec<_>>(),
        [8080, 10352],
        "the ClusterIP Service exposes the API and the Karmada estimator port"
    );
    let container_ports: BTreeMap<&str, i32> = c
        .ports
        .iter()
        .flatten()
        .filter_map(|p| Some((p.name.as_deref()?, p.container_port)))
        .collect();
    for (port, target) in ports {
        let IntOrString::String(name) = target else {
            panic!("target ports are named");
        };
        assert_eq!(container_ports.get(name.as_str()), Some(&port));
    }

    let pdb: &PodDisruptionBudget = one(all!(objs, PodDisruptionBudget), "PDB");
    let ps = pdb.spec.as_ref().unwrap();
    assert_eq!(ps.min_available, Some(IntOrString::Int(2)));
    assert!(selects_pods(
        ps.selector.as_ref().unwrap().match_labels.as_ref().unwrap()
    ));
}

#[test]
fn estimator_services_are_external_names_karmada_scheduler_accepts() {
    let host = checked("overlays/example/host");
    let replica_api = all!(host, Service)
        .into_iter()
        .find(|s| name_of(&s.metadata) == "dramesh-replica")
        .expect("replica ClusterIP Service");
    let target = format!(
        "dramesh-replica.{}.svc.cluster.local",
        replica_api.metadata.namespace.as_deref().unwrap()
    );

    let objs = checked("overlays/example/karmada-apiserver");
    let services = all!(objs, Service);
    assert_eq!(
        objs.len(),
        services.len(),
        "only Services go to the Karmada API server"
    );
    let names: BTreeSet<&str> = services.iter().map(|s| name_of(&s.metadata)).collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "karmada-scheduler-estimator-member1",
            "karmada-scheduler-estimator-member2",
            "karmada-scheduler-estimator-member3",
        ])
    );
    for s in services {
        // karmada-scheduler: --scheduler-estimator-service-namespace defaults to karmada-system.
        assert_eq!(s.metadata.namespace.as_deref(), Some("karmada-system"));
        let spec = s.spec.as_ref().unwrap();
        assert_eq!(spec.type_.as_deref(), Some("ExternalName"));
        assert_eq!(spec.external_name.as_deref(), Some(target.as_str()));
        assert!(spec.selector.is_none() && spec.cluster_ip.is_none());
        // resolveCluster wants a port equal to --scheduler-estimator-port and an integer
        // targetPort; it dials <externalName>:<targetPort>.
        let port = spec
            .ports
            .iter()
            .flatten()
            .find(|p| p.port == 10352)
            .expect("port 10352");
        assert_eq!(port.target_port, Some(IntOrString::Int(10352)));
        let cluster = name_of(&s.metadata).trim_start_matches("karmada-scheduler-estimator-");
        assert_eq!(
            s.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("dramesh.io/cluster"))
                .map(String::as_str),
            Some(cluster)
        );
    }
    let ports: BTreeSet<i32> = all!(host, Service)
        .iter()
        .flat_map(|s| {
            s.spec
                .as_ref()
                .unwrap()
                .ports
                .iter()
                .flatten()
                .map(|p| p.port)
        })
        .collect();
    assert!(
        ports.contains(&10352),
        "the replicas serve the estimator port"
    );
}

#[test]
fn replica_certificates_match_the_pods_that_mount_them() {
    let objs = checked("overlays/example/host");
    let sts: &StatefulSet = one(all!(objs, StatefulSet), "StatefulSet");
    let sts_name = name_of(&sts.metadata).to_string();
    let replicas = sts.spec.as_ref().unwrap().replicas.unwrap();
    let pod = pod_spec_sts(sts);
    let tls = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "tls")
        .and_then(|v| v.projected.as_ref())
        .expect("projected tls volume");
    // Secret name -> the directory its files are projected into.
    let mut projected: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for src in tls.sources.iter().flatten() {
        let secret = src.secret.as_ref().expect("secret source");
        let files = projected.entry(secret.name.clone()).or_default();
        for item in secret.items.iter().flatten() {
            files.insert(item.path.clone());
        }
    }

    let certs: BTreeMap<&str, &Certificate> = all!(objs, Certificate)
        .into_iter()
        .map(|c| (c.spec.secret_name.as_str(), c))
        .collect();
    let issuers: BTreeSet<&str> = all!(objs, Issuer)
        .iter()
        .map(|i| name_of(&i.metadata))
        .collect();
    for n in 0..replicas {
        let pod_name = format!("{sts_name}-{n}");
        let secret = format!("{pod_name}-tls");
        let files = projected
            .get(&secret)
            .unwrap_or_else(|| panic!("pod {pod_name}: Secret {secret} is not projected"));
        let want: BTreeSet<String> = ["tls.crt", "tls.key", "ca.crt"]
            .iter()
            .map(|f| format!("{pod_name}/{f}"))
            .collect();
        assert_eq!(
            files, &want,
            "--mesh-cert=/etc/dramesh/tls/$(POD_NAME)/tls.crt resolves"
        );

        let cert = certs
            .get(secret.as_str())
            .unwrap_or_else(|| panic!("no Certificate issues {secret}"));
        let uris = cert.spec.uris.as_deref().unwrap_or_default();
        assert_eq!(
            uris,
            [format!("dramesh://replica/{pod_name}")],
            "exactly one identity"
        );
        assert!(uris.iter().all(|u| valid_identity(u)));
        let dns = cert.spec.dns_names.as_deref().unwrap_or_default();
        assert!(
            dns.iter().any(|d| d == "mesh.dramesh.invalid"),
            "mesh TLS server name"
        );
        assert!(
            dns.iter()
                .any(|d| d == "dramesh-replica.karmada-system.svc.cluster.local"),
            "the name karmada-scheduler dials through the ExternalName Services"
        );
        let usages = cert.spec.usages.as_deref().unwrap_or_default();
        for u in ["server auth", "client auth"] {
            assert!(usages.iter().any(|x| x == u), "{secret}: {u}");
        }
        assert!(issuers.contains(cert.spec.issuer_ref.name.as_str()));
    }
    let c = &pod.containers[0];
    assert_eq!(
        flag_values(c, "--mesh-cert"),
        ["/etc/dramesh/tls/$(POD_NAME)/tls.crt"]
    );
    assert_eq!(
        flag_values(c, "--mesh-key"),
        ["/etc/dramesh/tls/$(POD_NAME)/tls.key"]
    );
    assert_eq!(
        flag_values(c, "--mesh-ca"),
        ["/etc/dramesh/tls/$(POD_NAME)/ca.crt"]
    );
    let env: BTreeSet<&str> = c.env.iter().flatten().map(|e| e.name.as_str()).collect();
    assert!(env.contains("POD_NAME"));
}

#[test]
fn agent_node_certificate_example_carries_a_node_identity() {
    let objs = checked("cert-manager/agent-node-example");
    let cert: &Certificate = one(all!(objs, Certificate), "Certificate");
    let uris = cert.spec.uris.as_deref().unwrap_or_default();
    assert_eq!(uris.len(), 1);
    assert!(valid_identity(&uris[0]), "{}", uris[0]);
    assert!(uris[0].starts_with("dramesh://cluster/member1/agent/"));
    // Issued by the CA that the replica composition defines.
    let ca = checked("cert-manager");
    let issuers: Vec<&Issuer> = all!(ca, Issuer);
    assert!(
        issuers
            .iter()
            .any(|i| { name_of(&i.metadata) == cert.spec.issuer_ref.name && i.spec.ca.is_some() })
    );
}

#[test]
fn api_certificates_serve_the_names_karmada_scheduler_dials_and_name_its_client() {
    let objs = checked("overlays/example/host");
    let certs: BTreeMap<&str, &Certificate> = all!(objs, Certificate)
        .into_iter()
        .map(|c| (c.spec.secret_name.as_str(), c))
        .collect();
    let issuers: BTreeMap<&str, &Issuer> = all!(objs, Issuer)
        .into_iter()
        .map(|i| (name_of(&i.metadata), i))
        .collect();
    let server = certs
        .get("dramesh-api-tls")
        .expect("the API server Certificate");
    let dns = server.spec.dns_names.as_deref().unwrap_or_default();
    assert!(
        dns.iter()
            .any(|d| d == "dramesh-replica.karmada-system.svc.cluster.local"),
        "the name karmada-scheduler dials through the ExternalName Services"
    );
    assert!(
        server.spec.uris.is_none(),
        "an API certificate is no mesh identity"
    );
    let usages = server.spec.usages.as_deref().unwrap_or_default();
    assert!(usages.iter().any(|u| u == "server auth"));
    let client = certs
        .get("karmada-scheduler-estimator-client-tls")
        .expect("karmada-scheduler's client Certificate");
    assert_eq!(
        client.spec.common_name.as_deref(),
        Some("karmada-scheduler")
    );
    let usages = client.spec.usages.as_deref().unwrap_or_default();
    assert!(usages.iter().any(|u| u == "client auth"));
    // Both from the API CA, which is not the mesh CA: a mesh certificate is no API caller.
    for c in [server, client] {
        let issuer = issuers
            .get(c.spec.issuer_ref.name.as_str())
            .unwrap_or_else(|| panic!("no Issuer {}", c.spec.issuer_ref.name));
        let ca_secret = &issuer.spec.ca.as_ref().expect("a CA Issuer").secret_name;
        assert_eq!(ca_secret, "dramesh-api-ca");
    }
    let mesh = certs
        .get("dramesh-replica-0-tls")
        .expect("a mesh Certificate");
    assert_ne!(mesh.spec.issuer_ref.name, server.spec.issuer_ref.name);
}

#[test]
fn scheduler_role_rbac_grants_what_the_loop_uses_and_the_overlay_mounts_its_kubeconfig() {
    let objs = checked("karmada-scheduler");
    let cr: &ClusterRole = one(all!(objs, ClusterRole), "ClusterRole");
    let got = rule_set(cr.rules.as_deref().unwrap_or_default());
    let mut want = BTreeSet::new();
    let mut grant = |g: &str, resources: &[&str], verbs: &[&str]| {
        for r in resources {
            for v in verbs {
                want.insert((g.to_string(), r.to_string(), v.to_string()));
            }
        }
    };
    let bindings = ["resourcebindings", "clusterresourcebindings"];
    grant(
        "work.karmada.io",
        &bindings,
        &["get", "list", "watch", "patch"],
    );
    grant(
        "work.karmada.io",
        &["resourcebindings/status", "clusterresourcebindings/status"],
        &["patch"],
    );
    grant("cluster.karmada.io", &["clusters"], &["list", "watch"]);
    grant(
        "scheduling.k8s.io",
        &["priorityclasses"],
        &["list", "watch"],
    );
    grant(
        "apps",
        &["deployments", "statefulsets", "replicasets", "daemonsets"],
        &["get"],
    );
    grant("batch", &["jobs", "cronjobs"], &["get"]);
    grant("", &["pods"], &["get"]);
    grant("resource.k8s.io", &["resourceclaimtemplates"], &["get"]);
    grant("events.k8s.io", &["events"], &["create", "patch"]);
    assert_eq!(
        got, want,
        "exactly what the scheduler loop reads and writes"
    );
    let crb: &ClusterRoleBinding = one(all!(objs, ClusterRoleBinding), "ClusterRoleBinding");
    assert_eq!(crb.role_ref.name, name_of(&cr.metadata));
    let s = crb.subjects.as_deref().unwrap_or_default();
    assert_eq!(s.len(), 1);
    assert_eq!(
        (s[0].kind.as_str(), s[0].name.as_str()),
        ("User", "dramesh-scheduler")
    );

    // The overlay: every replica reads its kubeconfig from a mounted Secret.
    let objs = checked("overlays/example/host-scheduler");
    let sts: &StatefulSet = one(all!(objs, StatefulSet), "StatefulSet");
    let pod = pod_spec_sts(sts);
    let c = pod
        .containers
        .iter()
        .find(|c| c.name == "replica")
        .expect("replica container");
    let paths = flag_values(c, "--karmada-kubeconfig");
    assert_eq!(paths.len(), 1, "exactly one --karmada-kubeconfig");
    let path = paths[0];
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| path.starts_with(&format!("{}/", m.mount_path)))
        .unwrap_or_else(|| panic!("{path} is not under a mounted volume"));
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .expect("the mount's volume");
    assert_eq!(
        volume
            .secret
            .as_ref()
            .and_then(|s| s.secret_name.as_deref()),
        Some("dramesh-karmada-kubeconfig")
    );
    assert!(
        path.ends_with("/kubeconfig"),
        "the Secret's key is kubeconfig"
    );
}

#[test]
fn signer_may_sign_only_its_name_for_the_agents_pods() {
    let objs = checked("agent");
    let ds: &DaemonSet = one(all!(objs, DaemonSet), "DaemonSet");
    let pod = pod_spec_ds(ds);
    let requested = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.projected.as_ref())
        .flat_map(|p| p.sources.iter().flatten())
        .filter_map(|s| s.pod_certificate.as_ref())
        .map(|p| p.signer_name.as_str())
        .collect::<Vec<_>>();
    let dep: &Deployment = named(all!(objs, Deployment), "dramesh-signer");
    let dep_pod = dep.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let c = one(dep_pod.containers.iter().collect(), "signer container");
    assert_eq!(args(c)[0], "signer");
    assert_eq!(flag_values(c, "--signer-name"), requested);
    assert_eq!(
        flag_values(c, "--agent-namespace"),
        [ds.metadata.namespace.as_deref().unwrap()]
    );
    assert_eq!(
        flag_values(c, "--agent-service-account"),
        [pod.service_account_name.as_deref().unwrap()]
    );
    // The signing key is the signer's alone: no agent pod mounts a Secret.
    assert!(
        pod.volumes.iter().flatten().all(|v| v.secret.is_none()),
        "an agent pod mounts a Secret (the signing key must stay off the nodes)"
    );
    let sa = dep_pod.service_account_name.as_deref().unwrap();
    assert_ne!(Some(sa), pod.service_account_name.as_deref());

    let cr: &ClusterRole = named(all!(objs, ClusterRole), "dramesh-signer");
    let mut got = BTreeSet::new();
    for r in cr.rules.iter().flatten() {
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                for v in &r.verbs {
                    got.insert((
                        g.clone(),
                        res.clone(),
                        v.clone(),
                        r.resource_names.clone().unwrap_or_default(),
                    ));
                }
            }
        }
    }
    let g = "certificates.k8s.io".to_string();
    let mut want = BTreeSet::new();
    for v in ["get", "list", "watch"] {
        want.insert((g.clone(), "podcertificaterequests".into(), v.into(), vec![]));
    }
    for v in ["patch", "update"] {
        want.insert((
            g.clone(),
            "podcertificaterequests/status".into(),
            v.into(),
            vec![],
        ));
    }
    want.insert((
        g.clone(),
        "signers".into(),
        "sign".into(),
        requested.iter().map(|s| s.to_string()).collect(),
    ));
    assert_eq!(
        got, want,
        "the signer reads requests, writes their status, and signs only its own name"
    );
    let crb: &ClusterRoleBinding = named(all!(objs, ClusterRoleBinding), "dramesh-signer");
    assert_eq!(crb.role_ref.name, "dramesh-signer");
    let s = one(crb.subjects.iter().flatten().collect(), "subject");
    assert_eq!((s.kind.as_str(), s.name.as_str()), ("ServiceAccount", sa));
    assert_eq!(s.namespace, dep.metadata.namespace);

    for m in ["member1", "member2", "member3"] {
        let objs = checked(&format!("overlays/example/{m}"));
        let dep: &Deployment = named(all!(objs, Deployment), "dramesh-signer");
        let c = &dep
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0];
        assert_eq!(
            flag_values(c, "--cluster"),
            [m],
            "{m}: the signer names its cluster"
        );
    }
}

#[test]
fn hostpath_variant_reads_node_files_and_runs_no_signer() {
    let objs = checked("agent-hostpath");
    let ds: &DaemonSet = one(all!(objs, DaemonSet), "DaemonSet");
    let pod = pod_spec_ds(ds);
    let c = one(pod.containers.iter().collect(), "container");
    assert_eq!(flag_values(c, "--mesh-cert"), ["/etc/dramesh/tls/tls.crt"]);
    assert_eq!(flag_values(c, "--mesh-key"), ["/etc/dramesh/tls/tls.key"]);
    assert_eq!(flag_values(c, "--mesh-ca"), ["/etc/dramesh/tls/ca.crt"]);
    assert!(flag_values(c, "--mesh-credential-bundle").is_empty());
    let tls = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "tls")
        .unwrap();
    assert!(tls.projected.is_none());
    let hp = tls.host_path.as_ref().expect("hostPath");
    assert_eq!(
        (hp.path.as_str(), hp.type_.as_deref()),
        ("/etc/dramesh/tls", Some("Directory"))
    );
    assert!(
        all!(objs, Deployment).is_empty(),
        "no signer without Pod Certificates"
    );
    assert!(
        all!(objs, ClusterRole)
            .iter()
            .all(|r| r.metadata.name.as_deref() != Some("dramesh-signer"))
    );
}

#[test]
fn the_scheduler_policy_example_routes_to_dramesh_and_passes_karmadas_crd() {
    if dramesh_testkit::fixtures(dramesh_testkit::KARMADA_CRDS).is_none() {
        return;
    }
    let objs = checked("overlays/example/scheduler-policy");
    let pp = one(all!(objs, PropagationPolicy), "PropagationPolicy");
    // The name the replica's --scheduler-name defaults to.
    assert_eq!(pp["spec"]["schedulerName"], "dramesh-scheduler", "{pp:#}");
    assert_eq!(
        pp["spec"]["placement"]["replicaScheduling"]["replicaSchedulingType"],
        "Divided"
    );
    // The CRD's defaults were applied: the schema, not just the YAML, was checked.
    assert_eq!(pp["spec"]["conflictResolution"], "Abort", "{pp:#}");
}

/// Every container of every workload in every kustomization runs the one image
/// `ghcr.io/dramesh/dramesh`, tagged with this release's version: one kustomize `images:`
/// entry retags them all, and `scripts/image` tags what it builds with the same version.
#[test]
fn every_workload_runs_the_one_image_tagged_with_the_release() {
    let root = deploy_root();
    let want = format!("ghcr.io/dramesh/dramesh:{}", env!("CARGO_PKG_VERSION"));
    let mut seen = BTreeSet::new();
    for dir in kustomization_dirs(&root).unwrap() {
        let workloads = render(&dir)
            .unwrap()
            .iter()
            .any(|r| matches!(r.kind(), "DaemonSet" | "StatefulSet" | "Deployment"));
        if !workloads {
            continue;
        }
        for c in check(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let spec = match &c.object {
                Typed::DaemonSet(o) => o.spec.as_ref().and_then(|s| s.template.spec.as_ref()),
                Typed::StatefulSet(o) => o.spec.as_ref().and_then(|s| s.template.spec.as_ref()),
                Typed::Deployment(o) => o.spec.as_ref().and_then(|s| s.template.spec.as_ref()),
                _ => None,
            };
            let Some(spec) = spec else { continue };
            for ctr in spec
                .containers
                .iter()
                .chain(spec.init_containers.iter().flatten())
            {
                assert_eq!(
                    ctr.image.as_deref(),
                    Some(want.as_str()),
                    "{}: container {}",
                    dir.display(),
                    ctr.name
                );
                seen.insert(ctr.name.clone());
            }
        }
    }
    // The agent, the signer and the replica at least.
    for name in ["agent", "signer", "replica"] {
        assert!(seen.contains(name), "no {name} container checked: {seen:?}");
    }
}
