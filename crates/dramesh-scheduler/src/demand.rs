//! What one replica of a binding needs: the pod template of its resource template
//! (Deployment, StatefulSet, ReplicaSet, DaemonSet, Job, CronJob, Pod) with the
//! `resource.k8s.io/v1` ResourceClaimTemplates it references, as a
//! [`dramesh_estimator::Workload`]; Karmada's multi-component `spec.components` as
//! estimator [`Component`]s; or nothing for a resource that is not a workload.
//!
//! Replicas, priority and identity come from the binding (Karmada's detector already read
//! them from the template); requests, node claim and device claims from the template.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use dramesh_estimator::{ClaimRef, Component, NodeClaim, ResList, TemplateSource, Workload};
use dramesh_model::k8s::{PodSpec, PodTemplateSpec, PriorityClass, ResourceClaimTemplate};
use k8s_openapi::api::core::v1::{Affinity, Container, NodeAffinity, ResourceRequirements};
use serde_json::Value;

use crate::object::{Binding, InputError, ReplicaRequirements, decode};

/// What a binding asks of each cluster.
#[derive(Debug, Clone)]
pub enum Demand {
    /// A workload with one pod template: `replicas` of it.
    Replicas(Arc<Workload>),
    /// A multi-component workload, scheduled whole: one set of all components per cluster.
    Components(Vec<Component>),
    /// Not a workload (ConfigMap, Service, ...): every selected cluster gets it.
    Nothing,
}

impl Demand {
    /// True when replicas need DRA devices.
    pub fn needs_devices(&self) -> bool {
        matches!(self, Demand::Replicas(w) if w.needs_devices())
    }
}

/// Where a kind keeps its pod template.
fn pod_template_path(kind: &str) -> Option<&'static str> {
    match kind {
        "Deployment" | "StatefulSet" | "ReplicaSet" | "DaemonSet" | "Job" => Some("/spec/template"),
        "CronJob" => Some("/spec/jobTemplate/spec/template"),
        _ => None,
    }
}

fn claim_templates(
    values: &[Value],
) -> Result<HashMap<(String, String), Arc<ResourceClaimTemplate>>, InputError> {
    let mut out = HashMap::new();
    for v in values {
        let ns = v
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or("");
        let name = v
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        let object = format!("ResourceClaimTemplate {ns}/{name}");
        let api = v.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        if api != "resource.k8s.io/v1" {
            return Err(InputError {
                object,
                field: "apiVersion".into(),
                message: format!("{api:?} is not resource.k8s.io/v1"),
            });
        }
        let t: ResourceClaimTemplate = decode(v, &object)?;
        out.insert((ns.to_string(), name.to_string()), Arc::new(t));
    }
    Ok(out)
}

/// The pod spec of `template`, a resource template of kind `kind`.
fn pod_spec<'v>(kind: &str, template: &'v Value) -> Option<&'v Value> {
    if kind == "Pod" {
        template.get("spec")
    } else {
        pod_template_path(kind)
            .and_then(|p| template.pointer(p))
            .and_then(|t| t.get("spec"))
    }
}

/// The PriorityClass `template` (a resource template of kind `kind`) names in its pod
/// template, if any: what a reservation must carry beside the template to be decoded.
pub fn priority_class_name(kind: &str, template: &Value) -> Option<String> {
    pod_spec(kind, template)?
        .get("priorityClassName")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
}

/// Most ResourceClaimTemplates one resource template may reference (the API server allows
/// far fewer claims per pod); more are left out, and [`demand`] then names the missing one.
pub const MAX_CLAIM_TEMPLATES: usize = 32;

/// The names of the ResourceClaimTemplates `template` (a resource template of kind `kind`,
/// as the API server returns it) references from its pod template, in order, without
/// repeats: what the caller must read before calling [`demand`].
pub fn claim_template_names(kind: &str, template: &Value) -> Vec<String> {
    let spec = pod_spec(kind, template);
    let mut out: Vec<String> = Vec::new();
    let claims = spec
        .and_then(|s| s.get("resourceClaims"))
        .and_then(Value::as_array);
    for c in claims.into_iter().flatten() {
        let Some(name) = c.get("resourceClaimTemplateName").and_then(Value::as_str) else {
            continue;
        };
        if !name.is_empty() && !out.iter().any(|n| n == name) {
            out.push(name.to_string());
        }
        if out.len() == MAX_CLAIM_TEMPLATES {
            break;
        }
    }
    out
}

/// A pod spec with one container requesting what Karmada's interpreter recorded in
/// `spec.replicaRequirements`: for resource kinds without a pod template Karmada knows.
fn spec_from_requirements(r: &ReplicaRequirements) -> PodSpec {
    let claim = r.node_claim.clone().unwrap_or_default();
    PodSpec {
        containers: vec![Container {
            name: "replica".into(),
            resources: Some(ResourceRequirements {
                requests: Some(r.resource_request.clone()),
                ..ResourceRequirements::default()
            }),
            ..Container::default()
        }],
        node_selector: (!claim.node_selector.is_empty()).then_some(claim.node_selector),
        tolerations: (!claim.tolerations.is_empty()).then_some(claim.tolerations),
        affinity: claim.hard_node_affinity.map(|required| Affinity {
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(required),
                ..NodeAffinity::default()
            }),
            ..Affinity::default()
        }),
        ..PodSpec::default()
    }
}

/// Whether the binding may preempt: the binding's own `schedulePriority.preemptionPolicy`
/// when set (Karmada PR 7327); else the pod template's PriorityClass (Kubernetes defaults it
/// to `PreemptLowerPriority`; a class the replica does not know does not preempt); a binding
/// with neither never preempts (PR 7327: unset means never).
fn may_preempt(b: &Binding, spec: &PodSpec, classes: &BTreeMap<String, PriorityClass>) -> bool {
    if let Some(p) = b
        .schedule_priority
        .as_ref()
        .map(|p| p.preemption_policy.as_str())
        .filter(|p| !p.is_empty())
    {
        return p != "Never";
    }
    if spec.preemption_policy.as_deref() == Some("Never") {
        return false;
    }
    match spec
        .priority_class_name
        .as_deref()
        .filter(|n| !n.is_empty())
    {
        Some(name) => classes
            .get(name)
            .is_some_and(|pc| pc.preemption_policy.as_deref() != Some("Never")),
        None => false,
    }
}

/// `spec.replicaRequirements.resourceClaimRefs` as claim references, `None` when absent or
/// empty.
fn claim_refs(b: &Binding) -> Result<Option<Vec<ClaimRef>>, InputError> {
    let Some(refs) = b
        .replica_requirements
        .as_ref()
        .map(|r| &r.resource_claim_refs)
        .filter(|r| !r.is_empty())
    else {
        return Ok(None);
    };
    let field = "spec.replicaRequirements.resourceClaimRefs";
    ClaimRef::from_references(refs.iter().map(|r| {
        (
            r.resource_claim_template_name.as_str(),
            r.resource_claim_name.as_str(),
        )
    }))
    .map(Some)
    .map_err(|(i, message)| InputError {
        object: b.id(),
        field: i.map_or_else(|| field.to_string(), |i| format!("{field}[{i}]")),
        message,
    })
}

/// The binding's demand. `template` is the resource template (`spec.resource`) as the API
/// server returns it, `claims` the ResourceClaimTemplates of its namespace it references that
/// the Karmada API server holds (the fallback for member clusters that publish none; one
/// missing there leaves no fallback), `classes` the PriorityClasses by name. The claims are
/// the binding's `spec.replicaRequirements.resourceClaimRefs` when it has them, else the pod
/// template's `spec.resourceClaims`, resolved in each member cluster.
pub fn demand(
    b: &Binding,
    template: Option<&Value>,
    claims: &[Value],
    classes: &BTreeMap<String, PriorityClass>,
) -> Result<Demand, InputError> {
    if !b.is_workload() {
        return Ok(Demand::Nothing);
    }
    if b.components.len() > 1 {
        let mut out = Vec::with_capacity(b.components.len());
        for (i, c) in b.components.iter().enumerate() {
            let r = c.replica_requirements.clone().unwrap_or_default();
            let requests = ResList::from_k8s(&r.resource_request).map_err(|m| InputError {
                object: b.id(),
                field: format!("spec.components[{i}].replicaRequirements.resourceRequest"),
                message: m,
            })?;
            let claim = r.node_claim.unwrap_or_default();
            out.push(Component {
                name: c.name.clone(),
                replicas: i64::from(c.replicas),
                requests,
                node_claim: NodeClaim {
                    node_selector: claim.node_selector,
                    affinity: claim.hard_node_affinity,
                    tolerations: claim.tolerations,
                },
            });
        }
        return Ok(Demand::Components(out));
    }
    let r = &b.resource;
    let object = format!("{} {}/{}", r.kind, r.namespace, r.name);
    let spec = match template {
        Some(t) if r.kind == "Pod" => {
            let p: PodTemplateSpec = decode(t, &object)?;
            p.spec
        }
        Some(t) => match pod_template_path(&r.kind).map(|p| t.pointer(p)) {
            Some(Some(pt)) => {
                let p: PodTemplateSpec = decode(pt, &object).map_err(|mut e| {
                    e.field = format!("spec.template.{}", e.field);
                    e
                })?;
                p.spec
            }
            Some(None) => {
                return Err(InputError {
                    object,
                    field: "spec.template".into(),
                    message: "missing".into(),
                });
            }
            None => b.replica_requirements.as_ref().map(spec_from_requirements),
        },
        None => {
            return Err(InputError {
                object: b.id(),
                field: "spec.resource".into(),
                message: format!("the resource template {object} was not provided"),
            });
        }
    };
    let spec = spec.ok_or_else(|| InputError {
        object: object.clone(),
        field: "spec.template.spec".into(),
        message: format!(
            "missing, and the binding has no spec.replicaRequirements for kind {}",
            r.kind
        ),
    })?;
    let templates = claim_templates(claims)?;
    let preempt = may_preempt(b, &spec, classes);
    // The pod's claims are resolved in each member cluster; Karmada's own templates are the
    // fallback for clusters that publish none (`Workload::in_cluster`).
    let mut w = Workload::from_pod_spec_with(
        &r.kind,
        &r.namespace,
        &r.name,
        i64::from(b.replicas),
        spec,
        &templates,
        TemplateSource::Cluster,
    )
    .map_err(|e| InputError {
        object: object.clone(),
        field: "spec.template.spec".into(),
        message: e.to_string(),
    })?;
    // The binding's own references, when Karmada's detector wrote them, name the claims.
    if let Some(refs) = claim_refs(b)? {
        w.claim_refs = refs;
        w.refresh_fingerprint();
    }
    w.uid = (!r.uid.is_empty()).then(|| r.uid.clone());
    w.priority = b.priority();
    w.preempt_lower_priority = preempt;
    Ok(Demand::Replicas(Arc::new(w)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::object::BindingKind;
    use crate::object::tests_support::server_binding;
    use serde_json::json;

    fn deployment(extra_spec: Value) -> Value {
        let mut pod = json!({"containers": [{"name": "c", "image": "x", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}]});
        if let (Some(p), Some(e)) = (pod.as_object_mut(), extra_spec.as_object()) {
            for (k, v) in e {
                p.insert(k.clone(), v.clone());
            }
        }
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "default", "uid": "d-uid", "managedFields": []},
            "spec": {"replicas": 4, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}}, "spec": pod}},
            "status": {"replicas": 4}
        })
    }

    fn gpu_template() -> Value {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-gpu", "namespace": "default", "resourceVersion": "5"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}}
        })
    }

    fn binding() -> Binding {
        Binding::from_value(BindingKind::ResourceBinding, &server_binding()).expect("binding")
    }

    #[test]
    fn claim_template_names_come_from_the_pod_template() {
        let d = deployment(json!({"resourceClaims": [
            {"name": "a", "resourceClaimTemplateName": "one-gpu"},
            {"name": "b", "resourceClaimName": "shared"},
            {"name": "c", "resourceClaimTemplateName": "one-gpu"},
            {"name": "d", "resourceClaimTemplateName": "nic"}]}));
        assert_eq!(claim_template_names("Deployment", &d), ["one-gpu", "nic"]);
        let pod =
            json!({"spec": {"resourceClaims": [{"name": "a", "resourceClaimTemplateName": "x"}]}});
        assert_eq!(claim_template_names("Pod", &pod), ["x"]);
        // A kind without a pod template, or no claims: nothing to read.
        assert!(claim_template_names("ConfigMap", &d).is_empty());
        assert!(claim_template_names("Deployment", &deployment(json!({}))).is_empty());
    }

    #[test]
    fn the_priority_class_name_comes_from_the_pod_template() {
        let d = deployment(json!({"priorityClassName": "high"}));
        assert_eq!(
            priority_class_name("Deployment", &d).as_deref(),
            Some("high")
        );
        let pod = json!({"spec": {"priorityClassName": "low"}});
        assert_eq!(priority_class_name("Pod", &pod).as_deref(), Some("low"));
        assert_eq!(
            priority_class_name("Deployment", &deployment(json!({}))),
            None
        );
        let empty = deployment(json!({"priorityClassName": ""}));
        assert_eq!(priority_class_name("Deployment", &empty), None);
    }

    #[test]
    fn a_deployment_with_a_claim_template_needs_devices() {
        let b = binding();
        let t = deployment(
            json!({"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}),
        );
        let d = demand(&b, Some(&t), &[gpu_template()], &BTreeMap::new()).expect("demand");
        let Demand::Replicas(w) = &d else {
            panic!("{d:?}")
        };
        assert!(d.needs_devices());
        assert_eq!(w.replicas, 4, "replicas come from the binding");
        assert_eq!(w.templates.len(), 1);
        assert_eq!(w.uid.as_deref(), Some("d-uid"));
        assert_eq!(w.priority, 1000);
        assert!(
            !w.preempt_lower_priority,
            "no class, no preemptionPolicy: never"
        );
        assert_eq!(w.requests.get(&dramesh_estimator::ResName::Cpu), 500);
    }

    #[test]
    fn a_template_karmada_lacks_is_resolved_in_the_member_clusters_only() {
        let b = binding();
        let t = deployment(
            json!({"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "two-gpus"}]}),
        );
        let d = demand(&b, Some(&t), &[gpu_template()], &BTreeMap::new()).expect("demand");
        let Demand::Replicas(w) = &d else {
            panic!("{d:?}")
        };
        assert!(d.needs_devices());
        assert!(
            w.templates.is_empty(),
            "no fallback: Karmada does not hold two-gpus"
        );
        assert_eq!(
            w.claim_refs,
            [dramesh_estimator::ClaimRef::Template {
                pod_claim: "gpu".into(),
                name: "two-gpus".into()
            }]
        );
        let mut v1beta = gpu_template();
        v1beta["apiVersion"] = json!("resource.k8s.io/v1beta1");
        let t = deployment(json!({}));
        let e = demand(&b, Some(&t), &[v1beta], &BTreeMap::new()).expect_err("version");
        assert_eq!(e.field, "apiVersion");
    }

    #[test]
    fn bad_template_fields_are_named() {
        let b = binding();
        let mut t = deployment(json!({}));
        t["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] =
            json!(["x"]);
        let e = demand(&b, Some(&t), &[], &BTreeMap::new()).expect_err("cpu");
        assert_eq!(e.object, "Deployment default/web");
        assert!(
            e.field
                .starts_with("spec.template.spec.containers[0].resources"),
            "{e}"
        );
        let e = demand(&b, None, &[], &BTreeMap::new()).expect_err("no template");
        assert_eq!(e.field, "spec.resource");
    }

    #[test]
    fn preemption_policy_comes_from_the_binding_or_the_class() {
        let class = |policy: Option<&str>| {
            let mut v = json!({"metadata": {"name": "high"}, "value": 1000});
            if let Some(p) = policy {
                v["preemptionPolicy"] = json!(p);
            }
            BTreeMap::from([(
                "high".to_string(),
                crate::object::priority_class_from_value(&v).expect("class"),
            )])
        };
        let t = deployment(json!({"priorityClassName": "high"}));
        let b = binding();
        let preempts =
            |b: &Binding, classes| match demand(b, Some(&t), &[], &classes).expect("demand") {
                Demand::Replicas(w) => w.preempt_lower_priority,
                d => panic!("{d:?}"),
            };
        assert!(preempts(&b, class(None)));
        assert!(!preempts(&b, class(Some("Never"))));
        assert!(!preempts(&b, BTreeMap::new()), "unknown class");
        let mut v = server_binding();
        v["spec"]["schedulePriority"]["preemptionPolicy"] = json!("Never");
        let never = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
        assert!(
            !preempts(&never, class(None)),
            "the binding's own field wins"
        );
    }

    #[test]
    fn components_and_non_workloads() {
        let mut v = server_binding();
        v["spec"]["components"] = json!([
            {"name": "jobmanager", "replicas": 1, "replicaRequirements": {"resourceRequest": {"cpu": "1"}}},
            {"name": "taskmanager", "replicas": 3, "replicaRequirements": {"resourceRequest": {"cpu": "2", "memory": "4Gi"}}}
        ]);
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
        let Demand::Components(c) = demand(&b, None, &[], &BTreeMap::new()).expect("demand") else {
            panic!("components")
        };
        assert_eq!(c.len(), 2);
        assert_eq!(c[1].replicas, 3);
        assert_eq!(c[1].requests.get(&dramesh_estimator::ResName::Cpu), 2000);

        let mut v = server_binding();
        v["spec"]["replicas"] = json!(0);
        v["spec"]["replicaRequirements"] = json!(null);
        v["spec"]["resource"] =
            json!({"apiVersion": "v1", "kind": "ConfigMap", "namespace": "default", "name": "cfg"});
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
        assert!(matches!(
            demand(&b, None, &[], &BTreeMap::new()),
            Ok(Demand::Nothing)
        ));
    }

    #[test]
    fn unknown_kinds_use_the_replica_requirements() {
        let mut v = server_binding();
        v["spec"]["resource"]["kind"] = json!("RayCluster");
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding");
        let t = json!({"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "web", "namespace": "default"}, "spec": {}});
        let Demand::Replicas(w) = demand(&b, Some(&t), &[], &BTreeMap::new()).expect("demand")
        else {
            panic!("replicas")
        };
        assert_eq!(w.requests.get(&dramesh_estimator::ResName::Memory), 1 << 30);
    }
}
