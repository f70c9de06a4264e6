//! Karpenter's `NodePool` and `NodeClaim` (`karpenter.sh/v1`), trimmed to what scale-up
//! headroom reads: a pool's limits, the instance types its template allows and its labels;
//! a claim's labels (its pool and instance type), capacity, allocatable and condition states.
//!
//! Karpenter's CRDs gain fields with every release, so these types read the fields they know
//! and ignore the others (the loader's strict "unknown field" rule is for DRA and core kinds a
//! user writes; these are objects a controller writes). The fields they do read are typed:
//! a quantity that does not parse, or a list of the wrong shape, fails naming the field. Every
//! list and map is bounded ([`MAX_REQUIREMENTS`] after Karpenter's own CRD, the rest
//! generous), so a hostile record cannot make a replica hold or scan without bound.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::quantity::Quantity;

/// The label Karpenter puts on every NodeClaim and Node it launches: the NodePool's name.
pub const NODEPOOL_LABEL: &str = "karpenter.sh/nodepool";
/// The well-known instance-type label (nodes, NodeClaims and requirement keys).
pub const INSTANCE_TYPE_LABEL: &str = "node.kubernetes.io/instance-type";
/// The only Karpenter API version read.
pub const API_VERSION: &str = "karpenter.sh/v1";

/// Requirements per template (Karpenter's CRD: `maxItems: 100`).
pub const MAX_REQUIREMENTS: usize = 100;
/// Values per requirement (the CRD sets no bound; instance-type lists run to hundreds).
pub const MAX_VALUES: usize = 4096;
/// Entries of a resource map (limits, capacity, allocatable) or a label map.
pub const MAX_ENTRIES: usize = 256;
/// Conditions kept per NodeClaim.
pub const MAX_CONDITIONS: usize = 64;

/// The metadata kept: name and labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    /// `metadata.name`.
    #[serde(default)]
    pub name: String,
    /// `metadata.labels`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

fn api_version() -> String {
    API_VERSION.to_string()
}

fn node_pool_kind() -> String {
    "NodePool".to_string()
}

fn node_claim_kind() -> String {
    "NodeClaim".to_string()
}

/// A Karpenter NodePool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePool {
    /// `karpenter.sh/v1` (kept so a trimmed object is a manifest again).
    #[serde(rename = "apiVersion", default = "api_version")]
    pub api_version: String,
    /// `NodePool`.
    #[serde(default = "node_pool_kind")]
    pub kind: String,
    /// Name and labels.
    #[serde(default)]
    pub metadata: Meta,
    /// What headroom reads of the spec.
    #[serde(default)]
    pub spec: NodePoolSpec,
}

impl Default for NodePool {
    fn default() -> Self {
        NodePool {
            api_version: api_version(),
            kind: node_pool_kind(),
            metadata: Meta::default(),
            spec: NodePoolSpec::default(),
        }
    }
}

/// `NodePool.spec`, trimmed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePoolSpec {
    /// `spec.limits`: bounds on the sum of the capacity of the pool's nodes. A resource
    /// without a limit is unbounded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Quantity>,
    /// `spec.template`.
    #[serde(default)]
    pub template: NodeClaimTemplate,
}

/// `NodePool.spec.template`, trimmed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeClaimTemplate {
    /// `spec.template.metadata` (labels every launched node gets).
    #[serde(default)]
    pub metadata: TemplateMeta,
    /// `spec.template.spec`.
    #[serde(default)]
    pub spec: TemplateSpec,
}

/// `spec.template.metadata`, trimmed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateMeta {
    /// Labels of launched nodes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// `spec.template.spec`, trimmed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateSpec {
    /// Node selector requirements launched nodes satisfy (instance types, zones, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requirements: Vec<Requirement>,
}

/// A node selector requirement with Karpenter's optional `minValues`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Requirement {
    /// Label key.
    pub key: String,
    /// `In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`, `Lt`.
    pub operator: String,
    /// Values.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
    /// Karpenter's `minValues` (kept so a trimmed pool reads as written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_values: Option<i64>,
}

impl Requirement {
    /// Whether a node with label value `value` (`None`: no such label) satisfies this
    /// requirement (`labels.Requirement.Matches`; `Gt`/`Lt` compare integers, and a value
    /// that is not one does not match).
    pub fn matches(&self, value: Option<&str>) -> bool {
        let int = |s: &str| s.parse::<i64>().ok();
        match self.operator.as_str() {
            "In" => value.is_some_and(|v| self.values.iter().any(|x| x == v)),
            "NotIn" => !value.is_some_and(|v| self.values.iter().any(|x| x == v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            "Gt" | "Lt" => {
                let (Some(v), Some(bound)) = (
                    value.and_then(int),
                    self.values.first().and_then(|b| int(b)),
                ) else {
                    return false;
                };
                if self.operator == "Gt" {
                    v > bound
                } else {
                    v < bound
                }
            }
            _ => false,
        }
    }
}

impl NodePool {
    /// Whether the pool's template admits instance type `t`: every requirement on the
    /// instance-type label holds for it (no such requirement admits every type).
    pub fn allows_instance_type(&self, t: &str) -> bool {
        self.spec
            .template
            .spec
            .requirements
            .iter()
            .filter(|r| r.key == INSTANCE_TYPE_LABEL)
            .all(|r| r.matches(Some(t)))
    }

    /// The instance types an `In` requirement names (sorted, without duplicates); empty when
    /// the template does not list them (then any type its other requirements admit).
    pub fn listed_instance_types(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .spec
            .template
            .spec
            .requirements
            .iter()
            .filter(|r| r.key == INSTANCE_TYPE_LABEL && r.operator == "In")
            .flat_map(|r| r.values.iter().cloned())
            .filter(|t| self.allows_instance_type(t))
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// A Karpenter NodeClaim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeClaim {
    /// `karpenter.sh/v1` (kept so a trimmed object is a manifest again).
    #[serde(rename = "apiVersion", default = "api_version")]
    pub api_version: String,
    /// `NodeClaim`.
    #[serde(default = "node_claim_kind")]
    pub kind: String,
    /// Name and labels (`karpenter.sh/nodepool`, the instance type once launched).
    #[serde(default)]
    pub metadata: Meta,
    /// What headroom reads of the status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<NodeClaimStatus>,
}

impl Default for NodeClaim {
    fn default() -> Self {
        NodeClaim {
            api_version: api_version(),
            kind: node_claim_kind(),
            metadata: Meta::default(),
            status: None,
        }
    }
}

/// `NodeClaim.status`, trimmed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeClaimStatus {
    /// Estimated full capacity of the node (what Karpenter counts against the limits).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capacity: BTreeMap<String, Quantity>,
    /// Estimated allocatable capacity (what Karmada's plugin subtracts).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocatable: BTreeMap<String, Quantity>,
    /// The Node the claim became.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Condition types and states (times and messages dropped: they change on every
    /// transition without changing what headroom reads).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A condition reduced to type and status.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    /// `type`.
    #[serde(rename = "type", default)]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    #[serde(default)]
    pub status: String,
}

impl NodeClaim {
    /// The NodePool that launched the claim (its `karpenter.sh/nodepool` label).
    pub fn pool(&self) -> Option<&str> {
        self.metadata
            .labels
            .get(NODEPOOL_LABEL)
            .map(String::as_str)
            .filter(|p| !p.is_empty())
    }

    /// The claim's instance type label, once Karpenter has launched it.
    pub fn instance_type(&self) -> Option<&str> {
        self.metadata
            .labels
            .get(INSTANCE_TYPE_LABEL)
            .map(String::as_str)
    }

    /// Whether condition `type_` is `True`.
    pub fn condition_true(&self, type_: &str) -> bool {
        self.status
            .iter()
            .flat_map(|s| &s.conditions)
            .any(|c| c.type_ == type_ && c.status == "True")
    }
}

/// A field of the wrong size: (JSON path, what is wrong).
pub type BoundError = (String, String);

fn bound<T>(field: &str, items: &[T], max: usize) -> Result<(), BoundError> {
    if items.len() > max {
        return Err((
            field.to_string(),
            format!("{} entries, at most {max} are read", items.len()),
        ));
    }
    Ok(())
}

fn bound_map<K, V>(field: &str, m: &BTreeMap<K, V>) -> Result<(), BoundError> {
    if m.len() > MAX_ENTRIES {
        return Err((
            field.to_string(),
            format!("{} entries, at most {MAX_ENTRIES} are read", m.len()),
        ));
    }
    Ok(())
}

fn check_name(name: &str) -> Result<(), BoundError> {
    if name.is_empty() {
        return Err(("metadata.name".into(), "must be set".into()));
    }
    Ok(())
}

/// A Karpenter kind with size bounds, checked whenever one is decoded.
pub trait Bounded {
    /// Checks the bounds (and that the object has a name).
    fn check(&self) -> Result<(), BoundError>;
}

impl Bounded for NodePool {
    fn check(&self) -> Result<(), BoundError> {
        check_name(&self.metadata.name)?;
        bound_map("metadata.labels", &self.metadata.labels)?;
        bound_map("spec.limits", &self.spec.limits)?;
        bound_map(
            "spec.template.metadata.labels",
            &self.spec.template.metadata.labels,
        )?;
        let reqs = &self.spec.template.spec.requirements;
        bound("spec.template.spec.requirements", reqs, MAX_REQUIREMENTS)?;
        for (i, r) in reqs.iter().enumerate() {
            bound(
                &format!("spec.template.spec.requirements[{i}].values"),
                &r.values,
                MAX_VALUES,
            )?;
        }
        Ok(())
    }
}

impl Bounded for NodeClaim {
    fn check(&self) -> Result<(), BoundError> {
        check_name(&self.metadata.name)?;
        bound_map("metadata.labels", &self.metadata.labels)?;
        if let Some(s) = &self.status {
            bound_map("status.capacity", &s.capacity)?;
            bound_map("status.allocatable", &s.allocatable)?;
            bound("status.conditions", &s.conditions, MAX_CONDITIONS)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(op: &str, values: &[&str]) -> Requirement {
        Requirement {
            key: INSTANCE_TYPE_LABEL.into(),
            operator: op.into(),
            values: values.iter().map(|s| s.to_string()).collect(),
            min_values: None,
        }
    }

    #[test]
    fn requirement_operators() {
        assert!(req("In", &["a", "b"]).matches(Some("b")));
        assert!(!req("In", &["a"]).matches(Some("b")));
        assert!(!req("In", &["a"]).matches(None));
        assert!(req("NotIn", &["a"]).matches(Some("b")));
        assert!(req("NotIn", &["a"]).matches(None));
        assert!(!req("NotIn", &["a"]).matches(Some("a")));
        assert!(req("Exists", &[]).matches(Some("x")));
        assert!(!req("Exists", &[]).matches(None));
        assert!(req("DoesNotExist", &[]).matches(None));
        assert!(req("Gt", &["4"]).matches(Some("8")));
        assert!(!req("Gt", &["4"]).matches(Some("4")));
        assert!(!req("Gt", &["4"]).matches(Some("x")));
        assert!(req("Lt", &["4"]).matches(Some("3")));
        assert!(!req("Bogus", &[]).matches(Some("3")));
    }

    #[test]
    fn instance_types_a_pool_allows() {
        let mut p = NodePool::default();
        p.metadata.name = "gpu".into();
        assert!(p.allows_instance_type("anything"));
        assert!(p.listed_instance_types().is_empty());
        p.spec.template.spec.requirements = vec![
            req("In", &["p5.48xlarge", "p4d.24xlarge", "p5.48xlarge"]),
            req("NotIn", &["p4d.24xlarge"]),
        ];
        assert!(p.allows_instance_type("p5.48xlarge"));
        assert!(!p.allows_instance_type("p4d.24xlarge"));
        assert!(!p.allows_instance_type("m5.large"));
        assert_eq!(p.listed_instance_types(), ["p5.48xlarge"]);
    }

    #[test]
    fn bounds_name_the_field() {
        let mut p = NodePool::default();
        assert_eq!(p.check().unwrap_err().0, "metadata.name");
        p.metadata.name = "x".into();
        p.spec.template.spec.requirements = vec![req("In", &["a"]); MAX_REQUIREMENTS + 1];
        assert_eq!(p.check().unwrap_err().0, "spec.template.spec.requirements");
        p.spec.template.spec.requirements = vec![Requirement {
            values: vec!["v".into(); MAX_VALUES + 1],
            ..req("In", &[])
        }];
        assert_eq!(
            p.check().unwrap_err().0,
            "spec.template.spec.requirements[0].values"
        );
        let mut c = NodeClaim::default();
        c.metadata.name = "c".into();
        c.status = Some(NodeClaimStatus {
            conditions: vec![Condition::default(); MAX_CONDITIONS + 1],
            ..Default::default()
        });
        assert_eq!(c.check().unwrap_err().0, "status.conditions");
    }
}
