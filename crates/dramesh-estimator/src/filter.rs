//! Node filtering as Karmada's estimator does it: nodeSelector, required node affinity
//! (both matched by `dramesh_model::nodesel`, the one implementation of node selection),
//! and NoSchedule/NoExecute taints against tolerations (matched by `dramesh_model::taint`; an
//! unschedulable node needs a toleration of `node.kubernetes.io/unschedulable:NoSchedule`).
//!
//! Guarantees: a node passes only when every check passes; a failure names the first
//! check that failed so explanations can count exclusions by reason.

use std::collections::BTreeMap;

use dramesh_model::k8s::{NodeSelector, Taint, Toleration};
use dramesh_model::{nodesel, taint};

/// What a replica requires of a node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeClaim {
    /// `spec.nodeSelector`: labels the node must have.
    pub node_selector: BTreeMap<String, String>,
    /// Required node affinity (`requiredDuringSchedulingIgnoredDuringExecution`).
    pub affinity: Option<NodeSelector>,
    /// `spec.tolerations`.
    pub tolerations: Vec<Toleration>,
}

/// Why a node was excluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Exclusion {
    /// `nodeSelector` does not match the node's labels.
    NodeSelector,
    /// Required node affinity does not select the node.
    NodeAffinity,
    /// A NoSchedule or NoExecute taint is not tolerated.
    Taint,
    /// The node is cordoned and the replica does not tolerate that.
    Unschedulable,
}

impl Exclusion {
    /// The name explanations count this reason under.
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
    /// Node name.
    pub name: &'a str,
    /// Node labels.
    pub labels: &'a BTreeMap<String, String>,
    /// Node taints.
    pub taints: &'a [Taint],
    /// `spec.unschedulable`.
    pub unschedulable: bool,
}

impl NodeClaim {
    /// Ok when the node passes every check, else the first check that failed.
    pub fn check(&self, node: &NodeFacts<'_>) -> Result<(), Exclusion> {
        if !nodesel::map_matches(&self.node_selector, node.labels) {
            return Err(Exclusion::NodeSelector);
        }
        let at = nodesel::NodeRef {
            name: node.name,
            labels: node.labels,
        };
        // As the scheduler: a malformed term never matches, another term still may.
        if let Some(aff) = &self.affinity
            && nodesel::matches_lazy(aff, at) != Ok(true)
        {
            return Err(Exclusion::NodeAffinity);
        }
        if node.unschedulable {
            let t = Taint {
                key: "node.kubernetes.io/unschedulable".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            };
            if !taint::tolerated(&self.tolerations, &t) {
                return Err(Exclusion::Unschedulable);
            }
        }
        for t in node.taints {
            if t.effect != "NoSchedule" && t.effect != "NoExecute" {
                continue;
            }
            if !taint::tolerated(&self.tolerations, t) {
                return Err(Exclusion::Taint);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn affinity(key: &str, op: &str, values: Option<Vec<String>>) -> NodeClaim {
        NodeClaim {
            affinity: Some(NodeSelector {
                node_selector_terms: vec![dramesh_model::k8s::NodeSelectorTerm {
                    match_expressions: Some(vec![dramesh_model::k8s::NodeSelectorRequirement {
                        key: key.into(),
                        operator: op.into(),
                        values,
                    }]),
                    match_fields: None,
                }],
            }),
            ..NodeClaim::default()
        }
    }

    /// `NotIn` without values is an invalid requirement in Kubernetes, so the term matches
    /// no node (the estimator used to treat it as "not in the empty set" and match all).
    #[test]
    fn not_in_without_values_excludes_the_node() {
        let labels = BTreeMap::from([("zone".to_string(), "a".to_string())]);
        let node = NodeFacts {
            name: "n1",
            labels: &labels,
            taints: &[],
            unschedulable: false,
        };
        for values in [None, Some(vec![])] {
            assert_eq!(
                affinity("zone", "NotIn", values.clone()).check(&node),
                Err(Exclusion::NodeAffinity),
                "{values:?}"
            );
            assert_eq!(
                affinity("gpu", "NotIn", values).check(&node),
                Err(Exclusion::NodeAffinity)
            );
        }
        assert_eq!(
            affinity("zone", "NotIn", Some(vec!["b".into()])).check(&node),
            Ok(())
        );
        assert_eq!(
            affinity("zone", "Gt", Some(vec!["x".into()])).check(&node),
            Err(Exclusion::NodeAffinity)
        );
    }
}
