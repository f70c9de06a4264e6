//! Nodes as the allocator sees them, and Kubernetes node-selector matching.
//!
//! Matching follows `component-helpers/scheduling/corev1/nodeaffinity`: terms are ORed,
//! requirements inside a term are ANDed, a term without requirements matches nothing, and a
//! malformed requirement (unknown operator, wrong number of values, unsupported field) makes
//! the whole selector an error rather than a silent mismatch.

use std::collections::BTreeMap;

use dramesh_model::k8s;

/// The node an allocation is attempted on: its name and labels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// Node name.
    pub name: String,
    /// Node labels.
    pub labels: BTreeMap<String, String>,
}

impl NodeInfo {
    /// A node known only by name (no labels).
    pub fn named(name: &str) -> NodeInfo {
        NodeInfo {
            name: name.to_string(),
            labels: BTreeMap::new(),
        }
    }

    /// Name and labels of a Kubernetes `Node`.
    pub fn from_node(node: &k8s::Node) -> NodeInfo {
        NodeInfo {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
        }
    }
}

/// Whether `node` is selected; `Err` describes a malformed selector.
pub fn node_selector_matches(sel: &k8s::NodeSelector, node: &NodeInfo) -> Result<bool, String> {
    let mut matched = false;
    for (ti, term) in sel.node_selector_terms.iter().enumerate() {
        let exprs = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        if exprs.is_empty() && fields.is_empty() {
            continue;
        }
        let mut all = true;
        for r in exprs {
            let ok = label_requirement(r, node)
                .map_err(|e| format!("nodeSelectorTerms[{ti}].matchExpressions: {e}"))?;
            all &= ok;
        }
        for r in fields {
            let ok = field_requirement(r, node)
                .map_err(|e| format!("nodeSelectorTerms[{ti}].matchFields: {e}"))?;
            all &= ok;
        }
        // Keep parsing the remaining terms so that a malformed term is always reported.
        matched |= all;
    }
    Ok(matched)
}

fn values(r: &k8s::NodeSelectorRequirement) -> &[String] {
    r.values.as_deref().unwrap_or_default()
}

fn label_requirement(r: &k8s::NodeSelectorRequirement, node: &NodeInfo) -> Result<bool, String> {
    let v = values(r);
    let label = node.labels.get(&r.key);
    match r.operator.as_str() {
        "In" | "NotIn" => {
            if v.is_empty() {
                return Err(format!(
                    "key {}: operator {} needs at least one value",
                    r.key, r.operator
                ));
            }
            let inside = label.is_some_and(|l| v.iter().any(|x| x == l));
            Ok(if r.operator == "In" { inside } else { !inside })
        }
        "Exists" | "DoesNotExist" => {
            if !v.is_empty() {
                return Err(format!(
                    "key {}: operator {} takes no values",
                    r.key, r.operator
                ));
            }
            Ok((r.operator == "Exists") == label.is_some())
        }
        "Gt" | "Lt" => {
            if v.len() != 1 {
                return Err(format!(
                    "key {}: operator {} needs exactly one value",
                    r.key, r.operator
                ));
            }
            let want: i64 = v[0]
                .parse()
                .map_err(|_| format!("key {}: {:?} is not an integer", r.key, v[0]))?;
            Ok(match label.and_then(|l| l.parse::<i64>().ok()) {
                Some(have) if r.operator == "Gt" => have > want,
                Some(have) => have < want,
                None => false,
            })
        }
        other => Err(format!("key {}: unknown operator {other:?}", r.key)),
    }
}

fn field_requirement(r: &k8s::NodeSelectorRequirement, node: &NodeInfo) -> Result<bool, String> {
    if r.key != "metadata.name" {
        return Err(format!("unsupported field {:?}", r.key));
    }
    let v = values(r);
    if v.len() != 1 {
        return Err("metadata.name needs exactly one value".to_string());
    }
    match r.operator.as_str() {
        "In" => Ok(v[0] == node.name),
        "NotIn" => Ok(v[0] != node.name),
        other => Err(format!("unsupported operator {other:?} for metadata.name")),
    }
}

/// Whether a `(nodeName, allNodes, nodeSelector)` triple selects `node`; an unset triple
/// selects nothing (as Kubernetes' `NodeMatches`).
pub(crate) fn node_matches(
    node_name: Option<&str>,
    all_nodes: bool,
    selector: Option<&k8s::NodeSelector>,
    node: &NodeInfo,
) -> Result<bool, String> {
    if let Some(n) = node_name.filter(|n| !n.is_empty()) {
        return Ok(n == node.name);
    }
    if all_nodes {
        return Ok(true);
    }
    match selector {
        Some(s) => node_selector_matches(s, node),
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str, op: &str, vals: &[&str]) -> k8s::NodeSelectorRequirement {
        k8s::NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: if vals.is_empty() {
                None
            } else {
                Some(vals.iter().map(|s| s.to_string()).collect())
            },
        }
    }

    fn sel(exprs: Vec<k8s::NodeSelectorRequirement>) -> k8s::NodeSelector {
        k8s::NodeSelector {
            node_selector_terms: vec![k8s::NodeSelectorTerm {
                match_expressions: Some(exprs),
                match_fields: None,
            }],
        }
    }

    #[test]
    fn label_operators() {
        let mut n = NodeInfo::named("node-1");
        n.labels.insert("region".into(), "r1".into());
        n.labels.insert("gen".into(), "5".into());
        assert!(node_selector_matches(&sel(vec![req("region", "In", &["r1", "r2"])]), &n).unwrap());
        assert!(!node_selector_matches(&sel(vec![req("region", "NotIn", &["r1"])]), &n).unwrap());
        assert!(node_selector_matches(&sel(vec![req("zone", "DoesNotExist", &[])]), &n).unwrap());
        assert!(node_selector_matches(&sel(vec![req("gen", "Gt", &["4"])]), &n).unwrap());
        assert!(!node_selector_matches(&sel(vec![req("gen", "Lt", &["4"])]), &n).unwrap());
        assert!(node_selector_matches(&sel(vec![req("gen", "Bogus", &["4"])]), &n).is_err());
        let empty = k8s::NodeSelector {
            node_selector_terms: vec![k8s::NodeSelectorTerm::default()],
        };
        assert!(
            !node_selector_matches(&empty, &n).unwrap(),
            "empty term matches nothing"
        );
    }

    #[test]
    fn field_selector() {
        let n = NodeInfo::named("node-1");
        let s = k8s::NodeSelector {
            node_selector_terms: vec![k8s::NodeSelectorTerm {
                match_expressions: None,
                match_fields: Some(vec![req("metadata.name", "In", &["node-1"])]),
            }],
        };
        assert!(node_selector_matches(&s, &n).unwrap());
        assert!(!node_selector_matches(&s, &NodeInfo::named("node-2")).unwrap());
        assert!(node_matches(None, false, None, &n) == Ok(false));
        assert!(node_matches(Some("node-1"), false, None, &n) == Ok(true));
    }
}
