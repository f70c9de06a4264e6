//! Kubernetes node selection, implemented once: a pod's `nodeSelector` map and
//! `NodeSelector` terms (required node affinity, allocation and ResourceSlice node
//! selectors). The engine, the estimator and the API all match nodes through this module.
//!
//! Semantics are those of `k8s.io/component-helpers/scheduling/corev1/nodeaffinity` over
//! `k8s.io/apimachinery` `labels.NewRequirement`:
//! - Terms are ORed, requirements inside a term are ANDed. A term without requirements, and
//!   a selector without terms, match nothing.
//! - `matchExpressions` read node labels. The key must be a qualified name and every value a
//!   valid label value. `In`/`NotIn` need at least one value, `Exists`/`DoesNotExist` none,
//!   `Gt`/`Lt` exactly one integer. `NotIn` and `DoesNotExist` match a node without the
//!   label; `Gt`/`Lt` match only a label that is an integer.
//! - `matchFields` accept only `In`/`NotIn` with exactly one value. `metadata.name` is the
//!   only field a node has; any other field reads as the empty string. A node without a name
//!   ignores `matchFields`.
//! - A malformed requirement makes its term invalid. [`matches`] (the allocator's
//!   `NewNodeSelector`) then fails the whole selector; [`matches_lazy`] (the scheduler's
//!   `LazyErrorNodeSelector`) lets another term match and reports the error only when none
//!   does.

use std::collections::BTreeMap;

use crate::k8s::{Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};

/// A node as selection sees it: its name and labels (owned).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
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
    pub fn from_node(node: &Node) -> NodeInfo {
        NodeInfo {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
        }
    }
}

/// A node as selection sees it, borrowed (so callers with their own node type copy nothing).
#[derive(Debug, Clone, Copy)]
pub struct NodeRef<'a> {
    /// `metadata.name`; empty when unknown.
    pub name: &'a str,
    /// `metadata.labels`.
    pub labels: &'a BTreeMap<String, String>,
}

impl<'a> From<&'a NodeInfo> for NodeRef<'a> {
    fn from(n: &'a NodeInfo) -> NodeRef<'a> {
        NodeRef {
            name: &n.name,
            labels: &n.labels,
        }
    }
}

/// A malformed requirement, located by its path inside the `NodeSelector`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("nodeSelectorTerms[{term}].{list}[{index}].{field}: {message}")]
pub struct SelectorError {
    /// Index of the term in `nodeSelectorTerms`.
    pub term: usize,
    /// `matchExpressions` or `matchFields`.
    pub list: &'static str,
    /// Index of the requirement in that list.
    pub index: usize,
    /// The requirement's field at fault: `key`, `operator` or `values`.
    pub field: &'static str,
    /// What is wrong, in Kubernetes' words.
    pub message: String,
}

/// A pod's `nodeSelector` map: every pair must be a label of the node.
pub fn map_matches(
    node_selector: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> bool {
    node_selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Whether `sel` selects `node`, failing when any term is malformed, as the DRA allocator
/// does (`nodeaffinity.NewNodeSelector`).
pub fn matches<'n>(
    sel: &NodeSelector,
    node: impl Into<NodeRef<'n>>,
) -> Result<bool, SelectorError> {
    let node = node.into();
    let mut matched = false;
    for (i, t) in sel.node_selector_terms.iter().enumerate() {
        // Every term is checked, so a malformed one is reported even after a match.
        matched |= term(t, i, node)?;
    }
    Ok(matched)
}

/// Whether `sel` selects `node`, as the scheduler's required node affinity does
/// (`nodeaffinity.LazyErrorNodeSelector`): a malformed term never matches, and its error is
/// returned only when no other term matches. Callers that filter nodes treat `Err` as "does
/// not match".
pub fn matches_lazy<'n>(
    sel: &NodeSelector,
    node: impl Into<NodeRef<'n>>,
) -> Result<bool, SelectorError> {
    let node = node.into();
    let mut first_error = None;
    for (i, t) in sel.node_selector_terms.iter().enumerate() {
        match term(t, i, node) {
            Ok(true) => return Ok(true),
            Ok(false) => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(false),
    }
}

/// Checks that every requirement of `sel` is well formed (what the API server's validation
/// and `NewNodeSelector` accept).
pub fn validate(sel: &NodeSelector) -> Result<(), SelectorError> {
    let labels = BTreeMap::new();
    matches(
        sel,
        NodeRef {
            name: "",
            labels: &labels,
        },
    )
    .map(|_| ())
}

/// Whether a `(nodeName, allNodes, nodeSelector)` triple of a ResourceSlice or device selects
/// `node`; an unset triple selects nothing (the allocator's `nodeMatches`).
pub fn node_matches<'n>(
    node_name: Option<&str>,
    all_nodes: bool,
    selector: Option<&NodeSelector>,
    node: impl Into<NodeRef<'n>>,
) -> Result<bool, SelectorError> {
    let node = node.into();
    if let Some(n) = node_name.filter(|n| !n.is_empty()) {
        return Ok(n == node.name);
    }
    if all_nodes {
        return Ok(true);
    }
    match selector {
        Some(s) => matches(s, node),
        None => Ok(false),
    }
}

/// One term: `Ok(matched)`, or the first malformed requirement. Every requirement is
/// checked, since a malformed one after a mismatch still makes the term invalid.
fn term(t: &NodeSelectorTerm, ti: usize, node: NodeRef<'_>) -> Result<bool, SelectorError> {
    let exprs = t.match_expressions.as_deref().unwrap_or_default();
    let fields = t.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return Ok(false);
    }
    let at = |list, index| {
        move |(field, message)| SelectorError {
            term: ti,
            list,
            index,
            field,
            message,
        }
    };
    let mut all = true;
    for (i, r) in exprs.iter().enumerate() {
        all &= label_requirement(r, node.labels.get(&r.key).map(String::as_str))
            .map_err(at("matchExpressions", i))?;
    }
    for (i, r) in fields.iter().enumerate() {
        let ok = field_requirement(r, node.name).map_err(at("matchFields", i))?;
        // A node without a name has no fields, and then fields do not constrain it.
        all &= ok || node.name.is_empty();
    }
    Ok(all)
}

type Fault = (&'static str, String);

/// A malformed label requirement: the field at fault and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct RequirementError {
    /// `key`, `operator` or `values`.
    pub field: &'static str,
    /// What is wrong, in Kubernetes' words.
    pub message: String,
}

/// One label requirement (`key`, `operator`, `values`) against a label's value (`None` when
/// the label is absent), as `labels.NewRequirement` then `Requirement.Matches`: the same
/// rule node selector terms use, for label selectors outside node selection (Karmada
/// cluster affinity). `Err` when the requirement is malformed.
pub fn requirement(
    key: &str,
    operator: &str,
    values: &[String],
    label: Option<&str>,
) -> Result<bool, RequirementError> {
    requirement_parts(key, operator, values, label)
        .map_err(|(field, message)| RequirementError { field, message })
}

fn label_requirement(r: &NodeSelectorRequirement, label: Option<&str>) -> Result<bool, Fault> {
    requirement_parts(
        &r.key,
        &r.operator,
        r.values.as_deref().unwrap_or_default(),
        label,
    )
}

fn requirement_parts(
    key: &str,
    op: &str,
    values: &[String],
    label: Option<&str>,
) -> Result<bool, Fault> {
    qualified_name(key).map_err(|m| ("key", m))?;
    match op {
        "In" | "NotIn" if values.is_empty() => {
            return Err((
                "values",
                "for 'in', 'notin' operators, values set can't be empty".into(),
            ));
        }
        "Exists" | "DoesNotExist" if !values.is_empty() => {
            return Err((
                "values",
                "values set must be empty for exists and does not exist".into(),
            ));
        }
        "Gt" | "Lt" if values.len() != 1 => {
            return Err((
                "values",
                "for 'Gt', 'Lt' operators, exactly one value is required".into(),
            ));
        }
        "Gt" | "Lt" if values[0].parse::<i64>().is_err() => {
            return Err((
                "values",
                "for 'Gt', 'Lt' operators, the value must be an integer".into(),
            ));
        }
        "In" | "NotIn" | "Exists" | "DoesNotExist" | "Gt" | "Lt" => {}
        other => {
            return Err((
                "operator",
                format!("{other:?} is not a valid node selector operator"),
            ));
        }
    }
    for v in values {
        label_value(v).map_err(|m| ("values", format!("{v:?}: {m}")))?;
    }
    Ok(match op {
        "In" => label.is_some_and(|l| values.iter().any(|v| v == l)),
        "NotIn" => label.is_none_or(|l| !values.iter().any(|v| v == l)),
        "Exists" => label.is_some(),
        "DoesNotExist" => label.is_none(),
        // Gt / Lt, whose single value parsed above.
        _ => {
            let bound: i64 = values[0].parse().unwrap_or_default();
            match label.and_then(|l| l.parse::<i64>().ok()) {
                Some(have) if op == "Gt" => have > bound,
                Some(have) => have < bound,
                None => false,
            }
        }
    })
}

fn field_requirement(r: &NodeSelectorRequirement, name: &str) -> Result<bool, Fault> {
    let values = r.values.as_deref().unwrap_or_default();
    let op = r.operator.as_str();
    if !matches!(op, "In" | "NotIn") {
        return Err((
            "operator",
            format!("{op:?} is not a valid node field selector operator"),
        ));
    }
    let [want] = values else {
        return Err((
            "values",
            format!(
                "unexpected number of value ({}) for node field selector operator {op:?}",
                values.len()
            ),
        ));
    };
    let have = if r.key == "metadata.name" { name } else { "" };
    Ok((have == want) == (op == "In"))
}

/// `IsQualifiedName`: an optional DNS-1123 subdomain prefix and `/`, then a name of at most
/// 63 alphanumerics, `-`, `_` and `.`, starting and ending alphanumeric.
fn qualified_name(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if name.contains('/') {
        return Err(format!(
            "{key:?}: a qualified name has at most one '/' (prefix/name)"
        ));
    }
    if let Some(p) = prefix {
        if p.is_empty() {
            return Err(format!("{key:?}: prefix part must be non-empty"));
        }
        dns1123_subdomain(p).map_err(|m| format!("{key:?}: prefix part {m}"))?;
    }
    if name.is_empty() {
        return Err(format!("{key:?}: name part must be non-empty"));
    }
    if name.len() > 63 {
        return Err(format!(
            "{key:?}: name part must be no more than 63 characters"
        ));
    }
    if !label_chars(name) {
        return Err(format!(
            "{key:?}: name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
        ));
    }
    Ok(())
}

/// `IsValidLabelValue`: empty, or at most 63 alphanumerics, `-`, `_` and `.`, starting and
/// ending alphanumeric.
fn label_value(v: &str) -> Result<(), String> {
    if v.len() > 63 {
        return Err("must be no more than 63 characters".into());
    }
    if !v.is_empty() && !label_chars(v) {
        return Err("a valid label value must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character".into());
    }
    Ok(())
}

fn label_chars(s: &str) -> bool {
    let b = s.as_bytes();
    b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// `IsDNS1123Subdomain`: at most 253 characters, dot-separated labels of lowercase
/// alphanumerics and `-`, each starting and ending alphanumeric.
fn dns1123_subdomain(p: &str) -> Result<(), String> {
    if p.len() > 253 {
        return Err("must be no more than 253 characters".into());
    }
    let ok = p.split('.').all(|l| {
        let b = l.as_bytes();
        let edge = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        b.first().is_some_and(edge)
            && b.last().is_some_and(edge)
            && b.iter().all(|c| edge(c) || *c == b'-')
    });
    if ok {
        Ok(())
    } else {
        Err("must be a lowercase RFC 1123 subdomain".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str, op: &str, vals: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!vals.is_empty()).then(|| vals.iter().map(|s| s.to_string()).collect()),
        }
    }

    fn exprs(rs: Vec<NodeSelectorRequirement>) -> NodeSelector {
        NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: Some(rs),
                match_fields: None,
            }],
        }
    }

    fn fields(rs: Vec<NodeSelectorRequirement>) -> NodeSelector {
        NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: None,
                match_fields: Some(rs),
            }],
        }
    }

    fn node() -> NodeInfo {
        let mut n = NodeInfo::named("node-1");
        n.labels.insert("region".into(), "r1".into());
        n.labels.insert("gen".into(), "5".into());
        n.labels.insert("model".into(), "h100".into());
        n
    }

    /// Expected outcome of one requirement on [`node`]: matches, does not, or is malformed
    /// in the named field.
    #[derive(Debug, PartialEq)]
    enum Want {
        Yes,
        No,
        Bad(&'static str),
    }
    use Want::*;

    fn outcome(r: Result<bool, SelectorError>) -> Want {
        match r {
            Ok(true) => Yes,
            Ok(false) => No,
            Err(e) => Bad(e.field),
        }
    }

    /// Every operator, empty and extra values, invalid Gt/Lt bounds, invalid keys and
    /// values, as `labels.NewRequirement` and `nodeaffinity` decide them.
    #[test]
    fn match_expressions_table() {
        let n = node();
        let cases: &[(&str, &str, &[&str], Want)] = &[
            ("region", "In", &["r1", "r2"], Yes),
            ("region", "In", &["r2"], No),
            ("zone", "In", &["a"], No),
            ("region", "In", &[], Bad("values")),
            ("region", "NotIn", &["r2"], Yes),
            ("region", "NotIn", &["r1"], No),
            ("zone", "NotIn", &["a"], Yes),
            // The case the estimator used to match: NotIn needs values.
            ("region", "NotIn", &[], Bad("values")),
            ("zone", "NotIn", &[], Bad("values")),
            ("region", "Exists", &[], Yes),
            ("zone", "Exists", &[], No),
            ("region", "Exists", &["r1"], Bad("values")),
            ("zone", "DoesNotExist", &[], Yes),
            ("region", "DoesNotExist", &[], No),
            ("zone", "DoesNotExist", &["x"], Bad("values")),
            ("gen", "Gt", &["4"], Yes),
            ("gen", "Gt", &["5"], No),
            ("gen", "Lt", &["6"], Yes),
            ("gen", "Lt", &["5"], No),
            ("gen", "Gt", &["0005"], No),
            // Non-integer labels and missing labels never satisfy Gt/Lt.
            ("model", "Gt", &["1"], No),
            ("zone", "Lt", &["1"], No),
            ("gen", "Gt", &[], Bad("values")),
            ("gen", "Gt", &["1", "2"], Bad("values")),
            ("gen", "Lt", &["five"], Bad("values")),
            ("gen", "Gt", &["4.5"], Bad("values")),
            ("gen", "Gt", &["99999999999999999999"], Bad("values")),
            // An integer that is not a valid label value (labels.NewRequirement checks both).
            ("gen", "Gt", &["-1"], Bad("values")),
            ("region", "In", &["not a label"], Bad("values")),
            ("region", "In", &[""], No),
            ("region", "Bogus", &["r1"], Bad("operator")),
            ("region", "in", &["r1"], Bad("operator")),
            ("", "Exists", &[], Bad("key")),
            ("bad key", "Exists", &[], Bad("key")),
            ("/region", "Exists", &[], Bad("key")),
            ("a/b/c", "Exists", &[], Bad("key")),
            ("Example.com/region", "Exists", &[], Bad("key")),
            ("example.com/region", "Exists", &[], No),
        ];
        for (key, op, vals, want) in cases {
            let sel = exprs(vec![req(key, op, vals)]);
            assert_eq!(
                &outcome(matches(&sel, &n)),
                want,
                "{key} {op} {vals:?} (strict)"
            );
            // Lazily a single malformed term is reported the same way (no other term matches).
            assert_eq!(
                &outcome(matches_lazy(&sel, &n)),
                want,
                "{key} {op} {vals:?} (lazy)"
            );
        }
    }

    #[test]
    fn match_fields_table() {
        let n = node();
        let cases: &[(&str, &str, &[&str], Want)] = &[
            ("metadata.name", "In", &["node-1"], Yes),
            ("metadata.name", "In", &["node-2"], No),
            ("metadata.name", "NotIn", &["node-2"], Yes),
            ("metadata.name", "NotIn", &["node-1"], No),
            ("metadata.name", "In", &[], Bad("values")),
            ("metadata.name", "In", &["node-1", "node-2"], Bad("values")),
            ("metadata.name", "NotIn", &[], Bad("values")),
            ("metadata.name", "Exists", &[], Bad("operator")),
            ("metadata.name", "Gt", &["1"], Bad("operator")),
            // Nodes have no other field: it reads as "".
            ("spec.unschedulable", "In", &["node-1"], No),
            ("spec.unschedulable", "NotIn", &["x"], Yes),
        ];
        for (key, op, vals, want) in cases {
            let sel = fields(vec![req(key, op, vals)]);
            assert_eq!(&outcome(matches(&sel, &n)), want, "{key} {op} {vals:?}");
        }
        // A node without a name ignores field requirements (but not malformed ones).
        let anon = NodeInfo::default();
        let sel = fields(vec![req("metadata.name", "In", &["node-1"])]);
        assert_eq!(matches(&sel, &anon), Ok(true));
        let bad = fields(vec![req("metadata.name", "In", &[])]);
        assert!(matches(&bad, &anon).is_err());
    }

    #[test]
    fn terms_are_ored_and_requirements_anded() {
        let n = node();
        let both = |a, b| NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: Some(vec![a]),
                match_fields: Some(vec![b]),
            }],
        };
        let hit = req("region", "In", &["r1"]);
        let miss = req("region", "In", &["r9"]);
        let name = req("metadata.name", "In", &["node-1"]);
        let other = req("metadata.name", "In", &["node-2"]);
        assert_eq!(matches(&both(hit.clone(), name.clone()), &n), Ok(true));
        assert_eq!(matches(&both(hit.clone(), other.clone()), &n), Ok(false));
        assert_eq!(matches(&both(miss.clone(), name.clone()), &n), Ok(false));
        let two_terms = NodeSelector {
            node_selector_terms: vec![
                NodeSelectorTerm {
                    match_expressions: Some(vec![miss.clone()]),
                    match_fields: None,
                },
                NodeSelectorTerm {
                    match_expressions: None,
                    match_fields: Some(vec![name.clone()]),
                },
            ],
        };
        assert_eq!(matches(&two_terms, &n), Ok(true));
        // Empty terms and empty selectors match nothing, and are not errors.
        let empty_term = NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm::default()],
        };
        assert_eq!(matches(&empty_term, &n), Ok(false));
        assert_eq!(matches(&NodeSelector::default(), &n), Ok(false));
        assert_eq!(validate(&empty_term), Ok(()));
    }

    #[test]
    fn malformed_terms_strict_and_lazy() {
        let n = node();
        let bad = NodeSelectorTerm {
            match_expressions: Some(vec![req("region", "NotIn", &[])]),
            match_fields: None,
        };
        let good = NodeSelectorTerm {
            match_expressions: Some(vec![req("region", "In", &["r1"])]),
            match_fields: None,
        };
        let sel = NodeSelector {
            node_selector_terms: vec![good.clone(), bad.clone()],
        };
        // The allocator rejects the selector even though a term matches...
        let err = matches(&sel, &n).expect_err("strict");
        assert_eq!(
            err.to_string(),
            "nodeSelectorTerms[1].matchExpressions[0].values: for 'in', 'notin' operators, values set can't be empty"
        );
        assert_eq!(validate(&sel), Err(err));
        // ...the scheduler lets the valid term match,
        assert_eq!(matches_lazy(&sel, &n), Ok(true));
        // and reports the error when nothing matches.
        let other = NodeInfo::named("node-2");
        assert!(matches_lazy(&sel, &other).is_err());
        // A malformed requirement after a mismatching one still invalidates the term.
        let late = exprs(vec![req("zone", "In", &["a"]), req("zone", "Gt", &["x"])]);
        assert!(matches(&late, &n).is_err());
    }

    #[test]
    fn node_selector_map_and_triples() {
        let n = node();
        let want = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        assert!(map_matches(&want(&[]), &n.labels));
        assert!(map_matches(&want(&[("region", "r1")]), &n.labels));
        assert!(!map_matches(
            &want(&[("region", "r1"), ("zone", "a")]),
            &n.labels
        ));
        assert!(!map_matches(&want(&[("region", "")]), &n.labels));
        assert_eq!(node_matches(None, false, None, &n), Ok(false));
        assert_eq!(node_matches(Some("node-1"), false, None, &n), Ok(true));
        assert_eq!(node_matches(Some("node-2"), true, None, &n), Ok(false));
        assert_eq!(node_matches(Some(""), true, None, &n), Ok(true));
        let sel = exprs(vec![req("region", "In", &["r1"])]);
        assert_eq!(node_matches(None, false, Some(&sel), &n), Ok(true));
    }
}
