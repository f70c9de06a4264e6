//! Node filtering as Karmada's estimator does it: nodeSelector, required node affinity,
//! and NoSchedule/NoExecute taints against tolerations (an unschedulable node needs a
//! toleration of `node.kubernetes.io/unschedulable:NoSchedule`).
//!
//! Guarantees: a node passes only when every check passes; a failure names the first
//! check that failed so explanations can count exclusions by reason.

use std::collections::BTreeMap;

use dramesh_model::k8s::{NodeSelector, NodeSelectorRequirement, Taint, Toleration};

/// What a replica requires of a node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeClaim {
    pub node_selector: BTreeMap<String, String>,
    pub affinity: Option<NodeSelector>,
    pub tolerations: Vec<Toleration>,
}

/// Why a node was excluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Exclusion {
    NodeSelector,
    NodeAffinity,
    Taint,
    Unschedulable,
}

impl Exclusion {
    pub fn as_str(self) -> &'static str {
        match self {
            Exclusion::NodeSelector => "nodeSelector",
            Exclusion::NodeAffinity => "nodeAffinity",
            Exclusion::Taint => "taints",
            Exclusion::Unschedulable => "unschedulable",
        }
    }
}

/// The node facts filtering reads.
pub struct NodeFacts<'a> {
    pub name: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub taints: &'a [Taint],
    pub unschedulable: bool,
}

impl NodeClaim {
    pub fn check(&self, node: &NodeFacts<'_>) -> Result<(), Exclusion> {
        for (k, v) in &self.node_selector {
            if node.labels.get(k) != Some(v) {
                return Err(Exclusion::NodeSelector);
            }
        }
        if let Some(aff) = &self.affinity
            && !node_selector_matches(aff, node.name, node.labels)
        {
            return Err(Exclusion::NodeAffinity);
        }
        if node.unschedulable {
            let t = Taint {
                key: "node.kubernetes.io/unschedulable".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            };
            if !self.tolerations.iter().any(|tol| tolerates(tol, &t)) {
                return Err(Exclusion::Unschedulable);
            }
        }
        for t in node.taints {
            if t.effect != "NoSchedule" && t.effect != "NoExecute" {
                continue;
            }
            if !self.tolerations.iter().any(|tol| tolerates(tol, t)) {
                return Err(Exclusion::Taint);
            }
        }
        Ok(())
    }
}

/// Kubernetes toleration matching (Equal / Exists; empty key with Exists matches all).
pub fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if let Some(e) = tol.effect.as_deref()
        && !e.is_empty()
        && e != taint.effect
    {
        return false;
    }
    let key = tol.key.as_deref().unwrap_or("");
    let op = tol.operator.as_deref().unwrap_or("Equal");
    if key.is_empty() {
        return op == "Exists";
    }
    if key != taint.key {
        return false;
    }
    match op {
        "Exists" => true,
        "Equal" | "" => tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        _ => false,
    }
}

/// ORed terms, ANDed requirements; an empty term list matches nothing.
pub fn node_selector_matches(
    sel: &NodeSelector,
    name: &str,
    labels: &BTreeMap<String, String>,
) -> bool {
    sel.node_selector_terms.iter().any(|term| {
        let exprs = term.match_expressions.as_deref().unwrap_or(&[]);
        let fields = term.match_fields.as_deref().unwrap_or(&[]);
        if exprs.is_empty() && fields.is_empty() {
            return false;
        }
        exprs
            .iter()
            .all(|r| requirement_matches(r, labels.get(&r.key).map(String::as_str)))
            && fields.iter().all(|r| {
                let v = (r.key == "metadata.name").then_some(name);
                requirement_matches(r, v)
            })
    })
}

fn requirement_matches(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or(&[]);
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (value, values.first()) else {
                return false;
            };
            match (v.parse::<i64>(), bound.parse::<i64>()) {
                (Ok(v), Ok(b)) => {
                    if r.operator == "Gt" {
                        v > b
                    } else {
                        v < b
                    }
                }
                _ => false,
            }
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toleration_rules() {
        let taint = Taint {
            key: "k".into(),
            value: Some("v".into()),
            effect: "NoSchedule".into(),
            ..Default::default()
        };
        let eq = Toleration {
            key: Some("k".into()),
            operator: Some("Equal".into()),
            value: Some("v".into()),
            ..Default::default()
        };
        assert!(tolerates(&eq, &taint));
        let wrong = Toleration {
            value: Some("x".into()),
            ..eq.clone()
        };
        assert!(!tolerates(&wrong, &taint));
        let all = Toleration {
            operator: Some("Exists".into()),
            ..Default::default()
        };
        assert!(tolerates(&all, &taint));
        let other_effect = Toleration {
            effect: Some("NoExecute".into()),
            ..eq
        };
        assert!(!tolerates(&other_effect, &taint));
    }
}
