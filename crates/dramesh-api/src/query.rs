//! Plain Rust forms of the Karmada estimator requests, converted from either wire generation.
//!
//! Karmada v1.17 clients embed Kubernetes messages (`resourceRequest`, `nodeAffinity`,
//! `tolerations`); v1.19+ clients send the same objects as gogo-marshalled bytes
//! (`resourceRequestBytes`, `nodeAffinityBytes`, `tolerationsBytes`); v1.18 clients send both.
//! Conversion prefers a non-empty bytes field and otherwise reads the embedded field, as
//! Karmada's own helpers do, so the three generations of an equivalent request convert to the
//! same value.
//!
//! Guarantees: conversion never panics on network input; every failure is a
//! [`ConvertError`] naming the field path. Kubernetes objects are normalised the way their
//! JSON form would decode (an empty string or list becomes `None`), so a query is equal to one
//! built from the pod template's JSON. [`ReplicaQuery::to_proto`] encodes a query in a chosen
//! [`WireStyle`], which tests and clients use to produce each generation.

use std::collections::{BTreeMap, HashMap};

use dramesh_estimator::ClaimRef;
use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Toleration,
};
use k8s_openapi::api::resource::v1::ResourceClaimTemplateSpec;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use prost::Message;

use crate::proto::{k8s_core, k8s_resource, karmada as pb};

/// A request field that could not be converted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConvertError {
    /// Path of the field in the request, e.g. `replicaRequirements.resourceRequestBytes[cpu]`.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConvertError {
    ConvertError {
        field: field.into(),
        message: message.into(),
    }
}

/// What a replica requires of a node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeClaim {
    /// Labels a node must carry (`nodeSelector`).
    pub node_selector: BTreeMap<String, String>,
    /// Required node affinity (`requiredDuringSchedulingIgnoredDuringExecution`).
    pub node_affinity: Option<NodeSelector>,
    /// Tolerations of the pod template.
    pub tolerations: Vec<Toleration>,
}

/// One ResourceClaimTemplate used by the pod template: every replica gets a fresh claim.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimTemplate {
    /// `spec.resourceClaims[].name` in the pod template.
    pub pod_claim_name: String,
    /// The template's spec.
    pub spec: ResourceClaimTemplateSpec,
}

/// DRA devices each replica needs (dramesh extension, field 100).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraRequirements {
    /// Claim templates: every replica gets its own claims.
    pub claim_templates: Vec<ClaimTemplate>,
    /// Existing ResourceClaims in the workload's namespace that all replicas share.
    pub shared_claims: Vec<String>,
}

impl DraRequirements {
    /// No claim templates and no shared claims.
    pub fn is_empty(&self) -> bool {
        self.claim_templates.is_empty() && self.shared_claims.is_empty()
    }
}

/// Per-replica requirements.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplicaRequirements {
    /// Node selection and tolerations.
    pub node_claim: NodeClaim,
    /// Requests by resource name (`cpu`, `memory`, `ephemeral-storage`, extended resources,
    /// `hugepages-*`), as Karmada sends them: already summed over containers, init containers
    /// and overhead.
    pub resource_request: BTreeMap<String, Quantity>,
    /// Namespace of the workload (may be empty for component requirements, whose namespace
    /// is on the request).
    pub namespace: String,
    /// PriorityClass of the pod template.
    pub priority_class_name: String,
    /// DRA devices per replica.
    pub dra: DraRequirements,
    /// Karmada's `resourceClaimRefs` (dramesh extension number until upstream assigns one,
    /// see proto/karmada/README.md): the pod's claims by name, resolved in each member
    /// cluster. A template reference's pod claim is `ref-<index>` (the wire carries none).
    pub claim_refs: Vec<ClaimRef>,
}

fn claim_refs_from_proto(
    refs: Vec<pb::ResourceClaimReference>,
    path: &str,
) -> Result<Vec<ClaimRef>, ConvertError> {
    ClaimRef::from_references(refs.iter().map(|r| {
        (
            r.resource_claim_template_name.as_str(),
            r.resource_claim_name.as_str(),
        )
    }))
    .map_err(|(i, message)| match i {
        Some(i) => err(format!("{path}.resourceClaimRefs[{i}]"), message),
        None => err(format!("{path}.resourceClaimRefs"), message),
    })
}

fn claim_refs_to_proto(refs: &[ClaimRef]) -> Vec<pb::ResourceClaimReference> {
    refs.iter()
        .map(|r| match r {
            ClaimRef::Template { name, .. } => pb::ResourceClaimReference {
                resource_claim_template_name: name.clone(),
                resource_claim_name: String::new(),
            },
            ClaimRef::Claim(name) => pb::ResourceClaimReference {
                resource_claim_template_name: String::new(),
                resource_claim_name: name.clone(),
            },
        })
        .collect()
}

/// One component of a multi-template workload.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Component {
    /// Component name.
    pub name: String,
    /// Replicas of this component in one complete set.
    pub replicas: i32,
    /// Requirements of one replica of it.
    pub requirements: ReplicaRequirements,
}

/// An in-flight workload already sent to the cluster whose pods are not bound yet; its
/// footprint must be deducted before estimating.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AssumedWorkload {
    /// Its namespace (for components without one).
    pub namespace: String,
    /// Its components and their in-flight replicas.
    pub components: Vec<Component>,
}

/// `MaxAvailableReplicas`: how many replicas of one template fit on `cluster`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplicaQuery {
    /// Member cluster asked about.
    pub cluster: String,
    /// Requirements of one replica.
    pub requirements: ReplicaRequirements,
    /// In-flight workloads to deduct first.
    pub assumed_workloads: Vec<AssumedWorkload>,
}

/// `MaxAvailableComponentSets`: how many complete sets of all components fit on `cluster`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ComponentSetQuery {
    /// Member cluster asked about.
    pub cluster: String,
    /// Namespace of the workload.
    pub namespace: String,
    /// The components of one set.
    pub components: Vec<Component>,
    /// In-flight workloads to deduct first.
    pub assumed_workloads: Vec<AssumedWorkload>,
}

/// A workload in a member cluster (`GetUnschedulableReplicas`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObjectRef {
    /// API version (e.g. `apps/v1`).
    pub api_version: String,
    /// Kind (e.g. `Deployment`).
    pub kind: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// `GetUnschedulableReplicas`: pods of `workload` unschedulable for longer than `threshold`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnschedulableQuery {
    /// Member cluster asked about.
    pub cluster: String,
    /// The workload whose pods are counted.
    pub workload: ObjectRef,
    /// Go `time.Duration` on the wire (nanoseconds); negative values are treated as zero.
    pub threshold: std::time::Duration,
}

/// Which Karmada wire generation to encode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireStyle {
    /// Karmada <= v1.17: embedded Kubernetes messages only.
    V117,
    /// Karmada v1.19+: bytes fields only.
    V119,
    /// Karmada v1.18: both (dual write).
    V118,
}

impl WireStyle {
    fn legacy(self) -> bool {
        matches!(self, WireStyle::V117 | WireStyle::V118)
    }
    fn bytes(self) -> bool {
        matches!(self, WireStyle::V118 | WireStyle::V119)
    }
}

// ---------------------------------------------------------------------------------------
// Kubernetes messages <-> k8s-openapi types

fn non_empty(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.is_empty())
}

fn requirement_from_proto(r: k8s_core::NodeSelectorRequirement) -> NodeSelectorRequirement {
    NodeSelectorRequirement {
        key: r.key.unwrap_or_default(),
        operator: r.operator.unwrap_or_default(),
        values: Some(r.values).filter(|v| !v.is_empty()),
    }
}

fn requirements_from_proto(
    reqs: Vec<k8s_core::NodeSelectorRequirement>,
) -> Option<Vec<NodeSelectorRequirement>> {
    Some(
        reqs.into_iter()
            .map(requirement_from_proto)
            .collect::<Vec<_>>(),
    )
    .filter(|v| !v.is_empty())
}

/// Converts a `k8s.io.api.core.v1.NodeSelector` message.
pub fn node_selector_from_proto(s: k8s_core::NodeSelector) -> NodeSelector {
    NodeSelector {
        node_selector_terms: s
            .node_selector_terms
            .into_iter()
            .map(|t| NodeSelectorTerm {
                match_expressions: requirements_from_proto(t.match_expressions),
                match_fields: requirements_from_proto(t.match_fields),
            })
            .collect(),
    }
}

/// Converts a `k8s.io.api.core.v1.Toleration` message.
pub fn toleration_from_proto(t: k8s_core::Toleration) -> Toleration {
    Toleration {
        key: non_empty(t.key),
        operator: non_empty(t.operator),
        value: non_empty(t.value),
        effect: non_empty(t.effect),
        toleration_seconds: t.toleration_seconds,
    }
}

fn requirement_to_proto(r: &NodeSelectorRequirement) -> k8s_core::NodeSelectorRequirement {
    k8s_core::NodeSelectorRequirement {
        key: Some(r.key.clone()),
        operator: Some(r.operator.clone()),
        values: r.values.clone().unwrap_or_default(),
    }
}

/// Encodes a NodeSelector as Kubernetes' protobuf message.
pub fn node_selector_to_proto(s: &NodeSelector) -> k8s_core::NodeSelector {
    k8s_core::NodeSelector {
        node_selector_terms: s
            .node_selector_terms
            .iter()
            .map(|t| k8s_core::NodeSelectorTerm {
                match_expressions: t
                    .match_expressions
                    .iter()
                    .flatten()
                    .map(requirement_to_proto)
                    .collect(),
                match_fields: t
                    .match_fields
                    .iter()
                    .flatten()
                    .map(requirement_to_proto)
                    .collect(),
            })
            .collect(),
    }
}

/// Encodes a Toleration as Kubernetes' protobuf message. Like gogo's non-nullable strings,
/// every string field is written, empty when unset.
pub fn toleration_to_proto(t: &Toleration) -> k8s_core::Toleration {
    k8s_core::Toleration {
        key: Some(t.key.clone().unwrap_or_default()),
        operator: Some(t.operator.clone().unwrap_or_default()),
        value: Some(t.value.clone().unwrap_or_default()),
        effect: Some(t.effect.clone().unwrap_or_default()),
        toleration_seconds: t.toleration_seconds,
    }
}

fn quantity_from_proto(q: k8s_resource::Quantity, field: &str) -> Result<Quantity, ConvertError> {
    match q.string {
        Some(s) if !s.trim().is_empty() => Ok(Quantity(s)),
        _ => Err(err(field, "Quantity has no value")),
    }
}

/// Encodes a Quantity as Kubernetes' protobuf message (its canonical string in field 1).
pub fn quantity_to_proto(q: &Quantity) -> k8s_resource::Quantity {
    k8s_resource::Quantity {
        string: Some(q.0.clone()),
    }
}

// ---------------------------------------------------------------------------------------
// Karmada messages -> plain types

fn node_claim_from_proto(c: Option<pb::NodeClaim>, path: &str) -> Result<NodeClaim, ConvertError> {
    let Some(c) = c else {
        return Ok(NodeClaim::default());
    };
    let node_affinity = if !c.node_affinity_bytes.is_empty() {
        let s = k8s_core::NodeSelector::decode(c.node_affinity_bytes.as_slice()).map_err(|e| {
            err(
                format!("{path}.nodeAffinityBytes"),
                format!("not a protobuf k8s.io.api.core.v1.NodeSelector: {e}"),
            )
        })?;
        Some(node_selector_from_proto(s))
    } else {
        c.node_affinity.map(node_selector_from_proto)
    };
    let tolerations = if !c.tolerations_bytes.is_empty() {
        c.tolerations_bytes
            .iter()
            .enumerate()
            .map(|(i, b)| {
                k8s_core::Toleration::decode(b.as_slice())
                    .map(toleration_from_proto)
                    .map_err(|e| {
                        err(
                            format!("{path}.tolerationsBytes[{i}]"),
                            format!("not a protobuf k8s.io.api.core.v1.Toleration: {e}"),
                        )
                    })
            })
            .collect::<Result<Vec<_>, _>>()?
    } else {
        c.tolerations
            .into_iter()
            .map(toleration_from_proto)
            .collect()
    };
    Ok(NodeClaim {
        node_selector: c.node_selector.into_iter().collect(),
        node_affinity,
        tolerations,
    })
}

fn requests_from_proto(
    bytes: HashMap<String, Vec<u8>>,
    legacy: HashMap<String, k8s_resource::Quantity>,
    path: &str,
) -> Result<BTreeMap<String, Quantity>, ConvertError> {
    let mut out = BTreeMap::new();
    if !bytes.is_empty() {
        for (name, b) in bytes {
            let field = format!("{path}.resourceRequestBytes[{name}]");
            let q = k8s_resource::Quantity::decode(b.as_slice()).map_err(|e| {
                err(
                    field.clone(),
                    format!("not a protobuf k8s.io.apimachinery.pkg.api.resource.Quantity: {e}"),
                )
            })?;
            out.insert(name, quantity_from_proto(q, &field)?);
        }
    } else {
        for (name, q) in legacy {
            let field = format!("{path}.resourceRequest[{name}]");
            out.insert(name, quantity_from_proto(q, &field)?);
        }
    }
    Ok(out)
}

fn dra_from_proto(
    d: Option<pb::DraRequirements>,
    path: &str,
) -> Result<DraRequirements, ConvertError> {
    let Some(d) = d else {
        return Ok(DraRequirements::default());
    };
    let claim_templates = d
        .claim_templates
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let spec = serde_json::from_slice::<ResourceClaimTemplateSpec>(&t.spec_json).map_err(|e| {
                err(
                    format!(
                        "{path}.draRequirements.claimTemplates[{i}] (podClaimName {:?}).specJson",
                        t.pod_claim_name
                    ),
                    format!("not a JSON resource.k8s.io/v1 ResourceClaimTemplateSpec: {e}"),
                )
            })?;
            Ok(ClaimTemplate {
                pod_claim_name: t.pod_claim_name,
                spec,
            })
        })
        .collect::<Result<Vec<_>, ConvertError>>()?;
    Ok(DraRequirements {
        claim_templates,
        shared_claims: d.shared_claim_names,
    })
}

impl ReplicaRequirements {
    /// Converts `ReplicaRequirements` of either wire generation.
    pub fn from_proto(r: pb::ReplicaRequirements, path: &str) -> Result<Self, ConvertError> {
        Ok(ReplicaRequirements {
            node_claim: node_claim_from_proto(r.node_claim, &format!("{path}.nodeClaim"))?,
            resource_request: requests_from_proto(
                r.resource_request_bytes,
                r.resource_request,
                path,
            )?,
            namespace: r.namespace,
            priority_class_name: r.priority_class_name,
            dra: dra_from_proto(r.dra_requirements, path)?,
            claim_refs: claim_refs_from_proto(r.resource_claim_refs, path)?,
        })
    }

    /// Converts `ComponentReplicaRequirements` (which has no namespace of its own).
    pub fn from_component_proto(
        r: pb::ComponentReplicaRequirements,
        path: &str,
    ) -> Result<Self, ConvertError> {
        Ok(ReplicaRequirements {
            node_claim: node_claim_from_proto(r.node_claim, &format!("{path}.nodeClaim"))?,
            resource_request: requests_from_proto(
                r.resource_request_bytes,
                r.resource_request,
                path,
            )?,
            namespace: String::new(),
            priority_class_name: r.priority_class_name,
            dra: dra_from_proto(r.dra_requirements, path)?,
            // Karmada's design keeps claim references out of components.
            claim_refs: Vec::new(),
        })
    }
}

impl Component {
    /// Converts a component of either wire generation; `path` prefixes field errors.
    pub fn from_proto(c: pb::Component, path: &str) -> Result<Self, ConvertError> {
        if c.replicas < 0 {
            return Err(err(
                format!("{path}.replicas"),
                format!("must not be negative, got {}", c.replicas),
            ));
        }
        let requirements = match c.replica_requirements {
            Some(r) => ReplicaRequirements::from_component_proto(
                r,
                &format!("{path}.replicaRequirements"),
            )?,
            None => ReplicaRequirements::default(),
        };
        Ok(Component {
            name: c.name,
            replicas: c.replicas,
            requirements,
        })
    }
}

fn components_from_proto(
    cs: Vec<pb::Component>,
    path: &str,
) -> Result<Vec<Component>, ConvertError> {
    cs.into_iter()
        .enumerate()
        .map(|(i, c)| Component::from_proto(c, &format!("{path}[{i}]")))
        .collect()
}

fn assumed_from_proto(a: Vec<pb::AssumedWorkload>) -> Result<Vec<AssumedWorkload>, ConvertError> {
    a.into_iter()
        .enumerate()
        .map(|(i, w)| {
            Ok(AssumedWorkload {
                components: components_from_proto(
                    w.components,
                    &format!("assumedWorkloads[{i}].components"),
                )?,
                namespace: w.namespace,
            })
        })
        .collect()
}

impl ReplicaQuery {
    /// Converts a `MaxAvailableReplicasRequest` of either wire generation.
    pub fn from_proto(r: pb::MaxAvailableReplicasRequest) -> Result<Self, ConvertError> {
        let requirements = match r.replica_requirements {
            Some(req) => ReplicaRequirements::from_proto(req, "replicaRequirements")?,
            None => ReplicaRequirements::default(),
        };
        Ok(ReplicaQuery {
            cluster: r.cluster,
            requirements,
            assumed_workloads: assumed_from_proto(r.assumed_workloads)?,
        })
    }

    /// Encodes the query as a `MaxAvailableReplicasRequest` of the given generation. `V117`
    /// drops the assumed workloads and `V117`/`V119` write only their own fields.
    pub fn to_proto(&self, style: WireStyle) -> pb::MaxAvailableReplicasRequest {
        pb::MaxAvailableReplicasRequest {
            cluster: self.cluster.clone(),
            replica_requirements: Some(pb::ReplicaRequirements {
                node_claim: Some(node_claim_to_proto(&self.requirements.node_claim, style)),
                resource_request: legacy_requests(&self.requirements.resource_request, style),
                namespace: self.requirements.namespace.clone(),
                priority_class_name: self.requirements.priority_class_name.clone(),
                resource_request_bytes: byte_requests(&self.requirements.resource_request, style),
                dra_requirements: dra_to_proto(&self.requirements.dra),
                resource_claim_refs: claim_refs_to_proto(&self.requirements.claim_refs),
            }),
            assumed_workloads: assumed_to_proto(&self.assumed_workloads, style),
        }
    }
}

impl ComponentSetQuery {
    /// Converts a `MaxAvailableComponentSetsRequest` of either wire generation.
    pub fn from_proto(r: pb::MaxAvailableComponentSetsRequest) -> Result<Self, ConvertError> {
        Ok(ComponentSetQuery {
            cluster: r.cluster,
            namespace: r.namespace,
            components: components_from_proto(r.components, "components")?,
            assumed_workloads: assumed_from_proto(r.assumed_workloads)?,
        })
    }

    /// Encodes the query as a `MaxAvailableComponentSetsRequest` of the given generation.
    pub fn to_proto(&self, style: WireStyle) -> pb::MaxAvailableComponentSetsRequest {
        pb::MaxAvailableComponentSetsRequest {
            cluster: self.cluster.clone(),
            components: components_to_proto(&self.components, style),
            namespace: self.namespace.clone(),
            assumed_workloads: assumed_to_proto(&self.assumed_workloads, style),
        }
    }
}

impl UnschedulableQuery {
    /// Converts the request (a negative threshold reads as zero).
    pub fn from_proto(r: pb::UnschedulableReplicasRequest) -> Self {
        let res = r.resource.unwrap_or_default();
        UnschedulableQuery {
            cluster: r.cluster,
            workload: ObjectRef {
                api_version: res.api_version,
                kind: res.kind,
                namespace: res.namespace,
                name: res.name,
            },
            threshold: std::time::Duration::from_nanos(
                u64::try_from(r.unschedulable_threshold).unwrap_or(0),
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------
// plain types -> Karmada messages

fn node_claim_to_proto(c: &NodeClaim, style: WireStyle) -> pb::NodeClaim {
    let affinity = c.node_affinity.as_ref().map(node_selector_to_proto);
    let tolerations: Vec<k8s_core::Toleration> =
        c.tolerations.iter().map(toleration_to_proto).collect();
    pb::NodeClaim {
        node_affinity: if style.legacy() {
            affinity.clone()
        } else {
            None
        },
        node_selector: c
            .node_selector
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        tolerations: if style.legacy() {
            tolerations.clone()
        } else {
            Vec::new()
        },
        node_affinity_bytes: match (&affinity, style.bytes()) {
            (Some(a), true) => a.encode_to_vec(),
            _ => Vec::new(),
        },
        tolerations_bytes: if style.bytes() {
            tolerations.iter().map(Message::encode_to_vec).collect()
        } else {
            Vec::new()
        },
    }
}

fn legacy_requests(
    r: &BTreeMap<String, Quantity>,
    style: WireStyle,
) -> HashMap<String, k8s_resource::Quantity> {
    if !style.legacy() {
        return HashMap::new();
    }
    r.iter()
        .map(|(k, q)| (k.clone(), quantity_to_proto(q)))
        .collect()
}

fn byte_requests(r: &BTreeMap<String, Quantity>, style: WireStyle) -> HashMap<String, Vec<u8>> {
    if !style.bytes() {
        return HashMap::new();
    }
    r.iter()
        .map(|(k, q)| (k.clone(), quantity_to_proto(q).encode_to_vec()))
        .collect()
}

fn dra_to_proto(d: &DraRequirements) -> Option<pb::DraRequirements> {
    if d.is_empty() {
        return None;
    }
    Some(pb::DraRequirements {
        claim_templates: d
            .claim_templates
            .iter()
            .map(|t| pb::DraClaimTemplate {
                pod_claim_name: t.pod_claim_name.clone(),
                // Serialising a typed k8s-openapi value cannot fail: it has no non-string map keys.
                spec_json: serde_json::to_vec(&t.spec).unwrap_or_default(),
            })
            .collect(),
        shared_claim_names: d.shared_claims.clone(),
    })
}

fn components_to_proto(cs: &[Component], style: WireStyle) -> Vec<pb::Component> {
    cs.iter()
        .map(|c| pb::Component {
            name: c.name.clone(),
            replicas: c.replicas,
            replica_requirements: Some(pb::ComponentReplicaRequirements {
                node_claim: Some(node_claim_to_proto(&c.requirements.node_claim, style)),
                resource_request: legacy_requests(&c.requirements.resource_request, style),
                priority_class_name: c.requirements.priority_class_name.clone(),
                resource_request_bytes: byte_requests(&c.requirements.resource_request, style),
                dra_requirements: dra_to_proto(&c.requirements.dra),
            }),
        })
        .collect()
}

fn assumed_to_proto(a: &[AssumedWorkload], style: WireStyle) -> Vec<pb::AssumedWorkload> {
    if style == WireStyle::V117 {
        return Vec::new();
    }
    a.iter()
        .map(|w| pb::AssumedWorkload {
            namespace: w.namespace.clone(),
            components: components_to_proto(&w.components, style),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity(s.to_string())
    }

    fn sample() -> ReplicaQuery {
        let spec: ResourceClaimTemplateSpec = serde_json::from_value(serde_json::json!({
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com", "count": 2}}]}}
        }))
        .expect("template spec");
        ReplicaQuery {
            cluster: "member-1".into(),
            requirements: ReplicaRequirements {
                node_claim: NodeClaim {
                    node_selector: BTreeMap::from([("zone".to_string(), "a".to_string())]),
                    node_affinity: Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            match_expressions: Some(vec![NodeSelectorRequirement {
                                key: "gpu".into(),
                                operator: "In".into(),
                                values: Some(vec!["h100".into(), "a100".into()]),
                            }]),
                            match_fields: None,
                        }],
                    }),
                    tolerations: vec![
                        Toleration {
                            key: Some("nvidia.com/gpu".into()),
                            operator: Some("Exists".into()),
                            effect: Some("NoSchedule".into()),
                            ..Default::default()
                        },
                        Toleration {
                            key: Some("node.kubernetes.io/not-ready".into()),
                            operator: Some("Exists".into()),
                            effect: Some("NoExecute".into()),
                            toleration_seconds: Some(300),
                            ..Default::default()
                        },
                    ],
                },
                resource_request: BTreeMap::from([
                    ("cpu".to_string(), q("500m")),
                    ("memory".to_string(), q("1Gi")),
                    ("nvidia.com/gpu".to_string(), q("1")),
                ]),
                namespace: "ml".into(),
                priority_class_name: "high".into(),
                dra: DraRequirements {
                    claim_templates: vec![ClaimTemplate {
                        pod_claim_name: "gpus".into(),
                        spec,
                    }],
                    shared_claims: vec!["shared-nic".into()],
                },
                claim_refs: vec![
                    ClaimRef::Template {
                        pod_claim: "ref-0".into(),
                        name: "gpu-tmpl".into(),
                    },
                    ClaimRef::Claim("shared-nic".into()),
                ],
            },
            assumed_workloads: vec![AssumedWorkload {
                namespace: "ml".into(),
                components: vec![Component {
                    name: "worker".into(),
                    replicas: 3,
                    requirements: ReplicaRequirements {
                        resource_request: BTreeMap::from([("cpu".to_string(), q("2"))]),
                        ..Default::default()
                    },
                }],
            }],
        }
    }

    fn roundtrip(style: WireStyle, query: &ReplicaQuery) -> ReplicaQuery {
        // Through real wire bytes, as a remote client would send them.
        let bytes = query.to_proto(style).encode_to_vec();
        let decoded = pb::MaxAvailableReplicasRequest::decode(bytes.as_slice()).expect("decode");
        ReplicaQuery::from_proto(decoded).expect("convert")
    }

    #[test]
    fn all_wire_generations_convert_to_the_same_query() {
        let query = sample();
        let v118 = roundtrip(WireStyle::V118, &query);
        let v119 = roundtrip(WireStyle::V119, &query);
        assert_eq!(v118, query);
        assert_eq!(v119, query);
        // v1.17 has no assumed workloads on the wire.
        let mut without_assumed = query.clone();
        without_assumed.assumed_workloads.clear();
        assert_eq!(roundtrip(WireStyle::V117, &query), without_assumed);
    }

    #[test]
    fn legacy_and_bytes_fields_are_really_different_fields() {
        let query = sample();
        let v117 = query.to_proto(WireStyle::V117);
        let r = v117.replica_requirements.as_ref().expect("requirements");
        assert!(r.resource_request_bytes.is_empty());
        assert_eq!(r.resource_request.len(), 3);
        let nc = r.node_claim.as_ref().expect("node claim");
        assert!(nc.node_affinity_bytes.is_empty() && nc.tolerations_bytes.is_empty());
        assert!(nc.node_affinity.is_some());
        let v119 = query.to_proto(WireStyle::V119);
        let r = v119.replica_requirements.as_ref().expect("requirements");
        assert!(r.resource_request.is_empty());
        let nc = r.node_claim.as_ref().expect("node claim");
        assert!(nc.node_affinity.is_none() && nc.tolerations.is_empty());
        assert_eq!(nc.tolerations_bytes.len(), 2);
    }

    /// The number `ReplicaRequirements.resourceClaimRefs` has in the .proto file: the one
    /// place it is written (switching to Karmada's number is editing that line).
    fn claim_refs_field_number() -> u64 {
        let proto = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../proto/karmada/pkg/estimator/pb/estimator.proto");
        let text = std::fs::read_to_string(&proto).expect("estimator.proto");
        let line = text
            .lines()
            .find(|l| l.contains("resourceClaimRefs ="))
            .expect("a resourceClaimRefs field");
        let n = line
            .split('=')
            .nth(1)
            .and_then(|r| r.trim().trim_end_matches(';').trim().parse().ok())
            .expect("a field number");
        // Not a number Karmada's ReplicaRequirements uses or reserves, nor field 100.
        assert!(n > 5 && n != 100, "{n}");
        n
    }

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// A length-delimited field as protoc-gen-go writes it: tag, length, bytes.
    fn ld(field: u64, bytes: &[u8], out: &mut Vec<u8>) {
        varint(field << 3 | 2, out);
        varint(bytes.len() as u64, out);
        out.extend_from_slice(bytes);
    }

    /// A `MaxAvailableReplicasRequest` with `resourceClaimRefs`, encoded by hand the way
    /// protoc-gen-go (Karmada's client) writes it: fields in number order, proto3 strings
    /// left out when empty, the map entry as key 1 / value 2, each Quantity as
    /// `resource.Quantity#Marshal()` bytes.
    #[test]
    fn resource_claim_refs_decode_from_go_style_bytes() {
        let n = claim_refs_field_number();
        let mut cpu = Vec::new();
        ld(1, b"cpu", &mut cpu);
        ld(2, b"\x0a\x01\x32", &mut cpu); // Quantity "2"
        let mut template_ref = Vec::new();
        ld(1, b"gpu-tmpl", &mut template_ref);
        let mut claim_ref = Vec::new();
        ld(2, b"shared-nic", &mut claim_ref);
        let mut both = Vec::new();
        ld(1, b"nic-tmpl", &mut both);
        ld(2, b"ignored", &mut both);
        let mut req = Vec::new();
        ld(3, b"ml", &mut req);
        ld(5, &cpu, &mut req);
        for r in [&template_ref, &claim_ref, &both] {
            ld(n, r, &mut req);
        }
        let mut msg = Vec::new();
        ld(1, b"member-1", &mut msg);
        ld(2, &req, &mut msg);
        let decoded = pb::MaxAvailableReplicasRequest::decode(msg.as_slice()).expect("decode");
        // prost writes the same bytes back: the hand encoding is the canonical one.
        assert_eq!(decoded.encode_to_vec(), msg);
        let got = ReplicaQuery::from_proto(decoded).expect("convert");
        assert_eq!(got.cluster, "member-1");
        assert_eq!(got.requirements.namespace, "ml");
        assert_eq!(got.requirements.resource_request["cpu"], q("2"));
        assert_eq!(
            got.requirements.claim_refs,
            [
                ClaimRef::Template {
                    pod_claim: "ref-0".into(),
                    name: "gpu-tmpl".into()
                },
                ClaimRef::Claim("shared-nic".into()),
                // Both set: the template name wins, as in Karmada's extraction.
                ClaimRef::Template {
                    pod_claim: "ref-2".into(),
                    name: "nic-tmpl".into()
                },
            ]
        );
        assert!(got.requirements.dra.is_empty(), "field 100 was not sent");

        // The same bytes at another number are an unknown field, skipped: the number read
        // from the .proto file is the one the generated code uses.
        let mut elsewhere = Vec::new();
        ld(n + 1, &template_ref, &mut elsewhere);
        let mut msg = Vec::new();
        ld(2, &elsewhere, &mut msg);
        let got = ReplicaQuery::from_proto(
            pb::MaxAvailableReplicasRequest::decode(msg.as_slice()).expect("decode"),
        )
        .expect("convert");
        assert!(got.requirements.claim_refs.is_empty());
    }

    #[test]
    fn empty_or_too_many_claim_refs_are_named() {
        let r = |refs: Vec<pb::ResourceClaimReference>| pb::MaxAvailableReplicasRequest {
            cluster: "c".into(),
            replica_requirements: Some(pb::ReplicaRequirements {
                resource_claim_refs: refs,
                ..Default::default()
            }),
            assumed_workloads: vec![],
        };
        let e = ReplicaQuery::from_proto(r(vec![Default::default()])).expect_err("empty");
        assert_eq!(e.field, "replicaRequirements.resourceClaimRefs[0]");
        let many = vec![
            pb::ResourceClaimReference {
                resource_claim_name: "c".into(),
                ..Default::default()
            };
            dramesh_estimator::MAX_CLAIM_REFS + 1
        ];
        let e = ReplicaQuery::from_proto(r(many)).expect_err("too many");
        assert_eq!(e.field, "replicaRequirements.resourceClaimRefs");
    }

    #[test]
    fn quantity_bytes_are_the_kubernetes_encoding() {
        // resource.Quantity#Marshal() of "500m": field 1, length 4, "500m".
        assert_eq!(
            quantity_to_proto(&q("500m")).encode_to_vec(),
            b"\x0a\x04500m".to_vec()
        );
    }

    #[test]
    fn gogo_encoded_toleration_with_empty_strings_decodes_like_json() {
        // gogo writes every non-nullable string, even empty ones: key="", operator="Exists",
        // value="", effect="" (tolerate everything).
        let bytes = b"\x0a\x00\x12\x06Exists\x1a\x00\x22\x00".to_vec();
        let mut r = pb::MaxAvailableReplicasRequest {
            cluster: "c".into(),
            replica_requirements: Some(pb::ReplicaRequirements {
                node_claim: Some(pb::NodeClaim {
                    tolerations_bytes: vec![bytes],
                    ..Default::default()
                }),
                ..Default::default()
            }),
            assumed_workloads: vec![],
        };
        let got = ReplicaQuery::from_proto(r.clone()).expect("convert");
        let want: Toleration =
            serde_json::from_value(serde_json::json!({"operator": "Exists"})).expect("json");
        assert_eq!(got.requirements.node_claim.tolerations, vec![want]);

        // Bytes win over the embedded field when both are present.
        if let Some(nc) = r
            .replica_requirements
            .as_mut()
            .and_then(|x| x.node_claim.as_mut())
        {
            nc.tolerations = vec![k8s_core::Toleration {
                key: Some("other".into()),
                ..Default::default()
            }];
        }
        let got = ReplicaQuery::from_proto(r).expect("convert");
        assert_eq!(
            got.requirements.node_claim.tolerations[0]
                .operator
                .as_deref(),
            Some("Exists")
        );
    }

    #[test]
    fn malformed_fields_are_named() {
        let r = pb::MaxAvailableReplicasRequest {
            cluster: "c".into(),
            replica_requirements: Some(pb::ReplicaRequirements {
                resource_request_bytes: HashMap::from([(
                    "cpu".to_string(),
                    vec![0x0a, 0x09, b'1'],
                )]),
                ..Default::default()
            }),
            assumed_workloads: vec![],
        };
        let e = ReplicaQuery::from_proto(r).expect_err("truncated quantity");
        assert_eq!(e.field, "replicaRequirements.resourceRequestBytes[cpu]");

        let r = pb::MaxAvailableReplicasRequest {
            cluster: "c".into(),
            replica_requirements: Some(pb::ReplicaRequirements {
                dra_requirements: Some(pb::DraRequirements {
                    claim_templates: vec![pb::DraClaimTemplate {
                        pod_claim_name: "gpu".into(),
                        spec_json: b"{\"spec\": 3}".to_vec(),
                    }],
                    shared_claim_names: vec![],
                }),
                ..Default::default()
            }),
            assumed_workloads: vec![],
        };
        let e = ReplicaQuery::from_proto(r).expect_err("bad template");
        assert!(
            e.field.contains("claimTemplates[0]") && e.field.contains("gpu"),
            "{e}"
        );

        let r = pb::MaxAvailableComponentSetsRequest {
            cluster: "c".into(),
            components: vec![pb::Component {
                name: "a".into(),
                replicas: -1,
                replica_requirements: None,
            }],
            ..Default::default()
        };
        let e = ComponentSetQuery::from_proto(r).expect_err("negative replicas");
        assert_eq!(e.field, "components[0].replicas");
    }

    #[test]
    fn component_sets_convert_identically_across_generations() {
        let s = sample();
        let query = ComponentSetQuery {
            cluster: "member-2".into(),
            namespace: "ml".into(),
            components: vec![
                Component {
                    name: "jobmanager".into(),
                    replicas: 1,
                    requirements: ReplicaRequirements {
                        namespace: String::new(),
                        claim_refs: Vec::new(),
                        ..s.requirements.clone()
                    },
                },
                Component {
                    name: "taskmanager".into(),
                    replicas: 4,
                    requirements: ReplicaRequirements {
                        resource_request: BTreeMap::from([("cpu".to_string(), q("4"))]),
                        ..Default::default()
                    },
                },
            ],
            assumed_workloads: s.assumed_workloads.clone(),
        };
        for style in [WireStyle::V118, WireStyle::V119] {
            let bytes = query.to_proto(style).encode_to_vec();
            let back = ComponentSetQuery::from_proto(
                pb::MaxAvailableComponentSetsRequest::decode(bytes.as_slice()).expect("decode"),
            )
            .expect("convert");
            assert_eq!(back, query, "{style:?}");
        }
    }
}
