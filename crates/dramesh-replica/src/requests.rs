//! Requests as estimator workloads: the native API's manifests, and Karmada's
//! `ReplicaRequirements` turned into the same kind of pod spec a Deployment would have (one
//! container with the requests, node selector, required node affinity, tolerations, and
//! resource claims for the DRA templates and shared claims), so the Karmada path and the
//! native manifest path estimate identical workloads identically. Karmada's
//! `resourceClaimRefs` become the workload's claim references, resolved in each member
//! cluster; field 100's templates are then the fallback for clusters that publish none.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use dramesh_api::ApiError;
use dramesh_api::query::{self, ReplicaRequirements};
use dramesh_estimator::{AssumedWorkload, View, Workload};
use dramesh_model::load::{self, REQUEST_LIMITS};
use dramesh_model::{Manifest, k8s};

/// Decodes the native request's manifests (YAML or JSON text) into one workload. Each text is
/// pre-scanned with [`REQUEST_LIMITS`], so parser memory stays small whatever the body holds;
/// before any is parsed, the call's admission charge is raised by their node count times
/// [`dramesh_api::admission::NODE_COST`] (a text the pre-scan refuses is left to the loader,
/// which reports it); decoding stops between texts once the call's deadline passed or its
/// caller went away ([`dramesh_api::deadline::passed`]).
pub(crate) fn workload_from_manifests(manifests: &[String]) -> Result<Workload, ApiError> {
    let nodes: u64 = manifests
        .iter()
        .map_while(|t| dramesh_model::depth::prescan(t, &REQUEST_LIMITS).ok())
        .map(|p| p.nodes as u64)
        .sum();
    dramesh_api::admission::grow_current(nodes.saturating_mul(dramesh_api::admission::NODE_COST))?;
    let mut all: Vec<Manifest> = Vec::new();
    for (i, text) in manifests.iter().enumerate() {
        if dramesh_api::deadline::passed() {
            return Err(ApiError::Unavailable(format!(
                "stopped decoding the workload's manifests at workload.manifests[{i}]: {}",
                dramesh_estimator::DEADLINE_EXCEEDED
            )));
        }
        let name = format!("workload.manifests[{i}]");
        let loaded = load::load_str_with(Path::new(&name), text, &REQUEST_LIMITS)
            .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
        all.extend(loaded.into_iter().map(|l| l.manifest));
    }
    Workload::from_manifests(&all).map_err(|e| ApiError::InvalidRequest(e.to_string()))
}

/// Name of the synthetic ResourceClaimTemplate standing for pod claim `pod_claim`.
fn template_name(pod_claim: &str) -> String {
    format!("karmada-{pod_claim}")
}

/// The pod spec a Karmada `ReplicaRequirements` describes (see the module docs), with the
/// ResourceClaimTemplates it references by (namespace, name).
pub(crate) fn pod_spec_of(
    r: &ReplicaRequirements,
    with_dra: bool,
) -> (
    k8s::PodSpec,
    HashMap<(String, String), Arc<k8s::ResourceClaimTemplate>>,
) {
    use k8s_openapi::api::core::v1::{
        Affinity, Container, NodeAffinity, PodResourceClaim, ResourceClaim as ContainerClaim,
        ResourceRequirements,
    };
    let namespace = if r.namespace.is_empty() {
        "default".to_string()
    } else {
        r.namespace.clone()
    };
    let mut pod_claims = Vec::new();
    let mut container_claims = Vec::new();
    let mut templates = HashMap::new();
    if with_dra {
        for t in &r.dra.claim_templates {
            let name = template_name(&t.pod_claim_name);
            pod_claims.push(PodResourceClaim {
                name: t.pod_claim_name.clone(),
                resource_claim_template_name: Some(name.clone()),
                resource_claim_name: None,
            });
            container_claims.push(ContainerClaim {
                name: t.pod_claim_name.clone(),
                request: None,
            });
            let tpl = k8s::ResourceClaimTemplate {
                metadata: k8s::ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(namespace.clone()),
                    ..Default::default()
                },
                spec: t.spec.clone(),
            };
            templates.insert((namespace.clone(), name), Arc::new(tpl));
        }
        for c in &r.dra.shared_claims {
            pod_claims.push(PodResourceClaim {
                name: c.clone(),
                resource_claim_name: Some(c.clone()),
                resource_claim_template_name: None,
            });
            container_claims.push(ContainerClaim {
                name: c.clone(),
                request: None,
            });
        }
    }
    let requests: BTreeMap<String, k8s::K8sQuantity> = r
        .resource_request
        .iter()
        .map(|(k, q)| (k.clone(), q.clone()))
        .collect();
    let container = Container {
        name: "replica".into(),
        resources: Some(ResourceRequirements {
            requests: (!requests.is_empty()).then_some(requests),
            claims: (!container_claims.is_empty()).then_some(container_claims),
            ..Default::default()
        }),
        ..Default::default()
    };
    let nc = &r.node_claim;
    let spec = k8s::PodSpec {
        containers: vec![container],
        node_selector: (!nc.node_selector.is_empty()).then(|| nc.node_selector.clone()),
        affinity: nc.node_affinity.clone().map(|a| Affinity {
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(a),
                ..Default::default()
            }),
            ..Default::default()
        }),
        tolerations: (!nc.tolerations.is_empty()).then(|| nc.tolerations.clone()),
        resource_claims: (!pod_claims.is_empty()).then_some(pod_claims),
        priority_class_name: (!r.priority_class_name.is_empty())
            .then(|| r.priority_class_name.clone()),
        ..Default::default()
    };
    (spec, templates)
}

/// The estimator workload of one Karmada replica (`replicas` of them).
pub(crate) fn workload_of(
    name: &str,
    r: &ReplicaRequirements,
    replicas: i64,
    with_dra: bool,
) -> Result<Workload, String> {
    let (spec, templates) = pod_spec_of(r, with_dra);
    let namespace = if r.namespace.is_empty() {
        "default"
    } else {
        r.namespace.as_str()
    };
    let mut w = Workload::from_pod_spec("Deployment", namespace, name, replicas, spec, &templates)
        .map_err(|e| e.to_string())?;
    // `resourceClaimRefs` are resolved in each member cluster; field 100's claims are the
    // fallback where a cluster publishes no templates (`Workload::in_cluster`).
    if with_dra && !r.claim_refs.is_empty() {
        w.claim_refs = r.claim_refs.clone();
        w.refresh_fingerprint();
    }
    Ok(w)
}

/// Karmada assumed workloads as the estimator's deductions for `cluster`, with the DRA
/// claims of their requirements: each in-flight replica holds its own device allocation
/// (shared claims once), placed first-fit like its requests.
///
/// They are implied reservations of the one query that carries them and are not written to
/// the reservation document: karmada-scheduler resends its whole assumed set with every
/// query and drops entries once bound, so writing them would double-count them on the next
/// query and leave no release signal. Written reservations are deducted in addition.
pub(crate) fn assumed_of(
    cluster: &str,
    assumed: &[query::AssumedWorkload],
) -> Result<Vec<AssumedWorkload>, String> {
    let mut out = Vec::new();
    for (i, a) in assumed.iter().enumerate() {
        for c in &a.components {
            let mut req = c.requirements.clone();
            if req.namespace.is_empty() {
                req.namespace = a.namespace.clone();
            }
            let w = workload_of(&c.name, &req, i64::from(c.replicas), true)
                .map_err(|e| format!("assumedWorkloads[{i}] component {:?}: {e}", c.name))?;
            out.push(AssumedWorkload::from_workload(
                cluster,
                &w,
                i64::from(c.replicas),
            ));
        }
    }
    Ok(out)
}

/// `Ok` when every named cluster is in the view, else `NotFound` naming the missing ones.
pub(crate) fn check_clusters(view: &View, clusters: &[String]) -> Result<(), ApiError> {
    let unknown: Vec<&str> = clusters
        .iter()
        .filter(|c| view.cluster(c).is_none())
        .map(String::as_str)
        .collect();
    if unknown.is_empty() {
        Ok(())
    } else {
        Err(ApiError::NotFound(format!(
            "cluster(s) not in this replica's view: {}",
            unknown.join(", ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_request_manifests_are_refused_before_parsing() {
        // 150,000 scalars in 300 KB: under any body limit, over the request's node bound.
        let wide = format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\ndata: {{a: [{}]}}\n",
            vec!["1"; 150_000].join(",")
        );
        let Err(ApiError::InvalidRequest(e)) =
            workload_from_manifests(&["kind: Namespace\n".to_string(), wide])
        else {
            panic!("wide manifest accepted");
        };
        assert!(
            e.starts_with("workload.manifests[1]: ") && e.contains("more than 100000 YAML nodes"),
            "{e}"
        );
    }
}
