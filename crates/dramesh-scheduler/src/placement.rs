//! Karmada's `policy/v1alpha1.Placement` with its Go field order and `omitempty` rules, so
//! that serializing it gives the bytes `json.Marshal` gives: karmada-scheduler records them
//! in the `policy.karmada.io/applied-placement` annotation, and compares the binding's
//! placement with them to decide whether the placement changed (`placementChanged`).
//!
//! Decoding is Go's: unknown fields are dropped, `null` reads as absent. Empty and absent
//! lists compare equal (Go's `reflect.DeepEqual` tells a nil slice from an empty one; the
//! API server never returns an empty list where the user wrote none).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::object::nd;

/// `corev1.Toleration` in Go's field order (k8s-openapi orders fields alphabetically).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Toleration {
    /// `key`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub key: String,
    /// `operator`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub operator: String,
    /// `value`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub value: String,
    /// `effect`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub effect: String,
    /// `tolerationSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toleration_seconds: Option<i64>,
}

/// A `matchExpressions` item of a label or field selector.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct Requirement {
    /// `key`.
    #[serde(default, deserialize_with = "nd")]
    pub key: String,
    /// `operator`.
    #[serde(default, deserialize_with = "nd")]
    pub operator: String,
    /// `values`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub values: Vec<String>,
}

/// `metav1.LabelSelector`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// `matchLabels`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub match_labels: BTreeMap<String, String>,
    /// `matchExpressions`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub match_expressions: Vec<Requirement>,
}

/// `FieldSelector`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FieldSelector {
    /// `matchExpressions`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub match_expressions: Vec<Requirement>,
}

/// `ClusterAffinity`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterAffinity {
    /// `labelSelector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_selector: Option<LabelSelector>,
    /// `fieldSelector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_selector: Option<FieldSelector>,
    /// `clusterNames`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub cluster_names: Vec<String>,
    /// `exclude`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub exclude: Vec<String>,
}

/// `OverflowClusterAffinity`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OverflowAffinity {
    /// `affinityName`.
    #[serde(default, deserialize_with = "nd")]
    pub affinity_name: String,
    /// The inlined `ClusterAffinity`.
    #[serde(flatten)]
    pub affinity: ClusterAffinity,
}

/// `ClusterAffinityTerm`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterAffinityTerm {
    /// `affinityName`.
    #[serde(default, deserialize_with = "nd")]
    pub affinity_name: String,
    /// The inlined `ClusterAffinity`.
    #[serde(flatten)]
    pub affinity: ClusterAffinity,
    /// `overflowAffinities`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub overflow_affinities: Vec<OverflowAffinity>,
}

/// `SpreadConstraint`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SpreadConstraint {
    /// `spreadByField`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub spread_by_field: String,
    /// `spreadByLabel`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub spread_by_label: String,
    /// `maxGroups`.
    #[serde(default, deserialize_with = "nd", skip_serializing_if = "is_zero")]
    pub max_groups: i64,
    /// `minGroups`.
    #[serde(default, deserialize_with = "nd", skip_serializing_if = "is_zero")]
    pub min_groups: i64,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// `StaticClusterWeight` (`targetCluster` is not `omitempty`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StaticClusterWeight {
    /// `targetCluster`.
    #[serde(default, deserialize_with = "nd")]
    pub target_cluster: ClusterAffinity,
    /// `weight`.
    #[serde(default, deserialize_with = "nd")]
    pub weight: i64,
}

/// `ClusterPreferences`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPreferences {
    /// `staticWeightList`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub static_weight_list: Vec<StaticClusterWeight>,
    /// `dynamicWeight`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub dynamic_weight: String,
}

/// `ReplicaSchedulingStrategy`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaScheduling {
    /// `replicaSchedulingType`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub replica_scheduling_type: String,
    /// `replicaDivisionPreference`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub replica_division_preference: String,
    /// `weightPreference`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_preference: Option<ClusterPreferences>,
}

/// `WorkloadAffinityTerm` / `WorkloadAntiAffinityTerm`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadAffinityTerm {
    /// `groupByLabelKey`.
    #[serde(default, deserialize_with = "nd")]
    pub group_by_label_key: String,
}

/// `WorkloadAffinity`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadAffinity {
    /// `affinity`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<WorkloadAffinityTerm>,
    /// `antiAffinity`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anti_affinity: Option<WorkloadAffinityTerm>,
}

/// `Placement`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// `clusterAffinity`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_affinity: Option<ClusterAffinity>,
    /// `clusterAffinities`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub cluster_affinities: Vec<ClusterAffinityTerm>,
    /// `clusterTolerations`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub cluster_tolerations: Vec<Toleration>,
    /// `spreadConstraints`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub spread_constraints: Vec<SpreadConstraint>,
    /// `replicaScheduling`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_scheduling: Option<ReplicaScheduling>,
    /// `workloadAffinity`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_affinity: Option<WorkloadAffinity>,
}

impl Placement {
    /// `json.Marshal(placement)`: the applied-placement annotation's value.
    pub fn to_go_json(&self) -> String {
        // Every field is a string, number, list or map of those: serializing cannot fail.
        crate::patch::go_json(&serde_json::to_string(self).unwrap_or_default())
    }

    /// Karmada `placementChanged`: whether this placement differs from the one recorded in
    /// the applied-placement annotation `applied` (absent: changed; unreadable: unchanged,
    /// as Karmada logs and carries on), given the `clusterAffinities` term last scheduled with.
    pub fn changed_since(&self, applied: Option<&str>, observed_affinity: &str) -> bool {
        let Some(applied) = applied.filter(|a| !a.is_empty()) else {
            return true;
        };
        let Ok(applied) = serde_json::from_str::<Placement>(applied) else {
            return false;
        };
        if *self == applied {
            return false;
        }
        if self.cluster_affinity != applied.cluster_affinity
            || self.cluster_tolerations != applied.cluster_tolerations
            || self.spread_constraints != applied.spread_constraints
            || self.replica_scheduling != applied.replica_scheduling
        {
            return true;
        }
        // Only clusterAffinities (or fields the scheduler does not read) differ: changed when
        // the term in use changed or is gone.
        if observed_affinity.is_empty() {
            return true;
        }
        let find = |p: &Placement| {
            p.cluster_affinities
                .iter()
                .find(|t| t.affinity_name == observed_affinity)
                .cloned()
        };
        match (find(self), find(&applied)) {
            (Some(a), Some(b)) => a != b,
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn marshals_in_go_field_order_with_omitempty() {
        // Keys in the input in another order, empty lists, a null, an unknown field.
        let p: Placement = serde_json::from_value(json!({
            "replicaScheduling": {"weightPreference": {"staticWeightList": [
                {"weight": 2, "targetCluster": {"clusterNames": ["m1"]}},
                {"weight": 1, "targetCluster": {}}]},
                "replicaDivisionPreference": "Weighted", "replicaSchedulingType": "Divided"},
            "spreadConstraints": [{"minGroups": 1, "maxGroups": 2, "spreadByField": "cluster"}],
            "clusterTolerations": [{"effect": "NoSchedule", "operator": "Exists", "key": "gpu"}],
            "clusterAffinity": {"exclude": [], "clusterNames": ["m1", "m2"], "labelSelector": {"matchLabels": {"b": "2", "a": "1"}}, "fieldSelector": null},
            "somethingNew": true
        }))
        .expect("decodes");
        assert_eq!(
            p.to_go_json(),
            concat!(
                r#"{"clusterAffinity":{"labelSelector":{"matchLabels":{"a":"1","b":"2"}},"clusterNames":["m1","m2"]},"#,
                r#""clusterTolerations":[{"key":"gpu","operator":"Exists","effect":"NoSchedule"}],"#,
                r#""spreadConstraints":[{"spreadByField":"cluster","maxGroups":2,"minGroups":1}],"#,
                r#""replicaScheduling":{"replicaSchedulingType":"Divided","replicaDivisionPreference":"Weighted","#,
                r#""weightPreference":{"staticWeightList":[{"targetCluster":{"clusterNames":["m1"]},"weight":2},{"targetCluster":{},"weight":1}]}}}"#
            )
        );
    }

    #[test]
    fn affinity_terms_inline_their_affinity() {
        let p: Placement = serde_json::from_value(json!({"clusterAffinities": [
            {"clusterNames": ["a"], "affinityName": "primary"},
            {"affinityName": "backup", "labelSelector": {"matchExpressions": [{"key": "k", "operator": "Exists"}]}}
        ]}))
        .expect("decodes");
        assert_eq!(
            p.to_go_json(),
            r#"{"clusterAffinities":[{"affinityName":"primary","clusterNames":["a"]},{"affinityName":"backup","labelSelector":{"matchExpressions":[{"key":"k","operator":"Exists"}]}}]}"#
        );
    }

    #[test]
    fn placement_changed_follows_karmada() {
        let p: Placement = serde_json::from_value(json!({"clusterAffinities": [
            {"affinityName": "a", "clusterNames": ["m1"]},
            {"affinityName": "b", "clusterNames": ["m2"]}
        ]}))
        .expect("decodes");
        let same = p.to_go_json();
        assert!(p.changed_since(None, "a"), "never applied");
        assert!(!p.changed_since(Some(&same), "a"));
        assert!(
            !p.changed_since(Some("not json"), "a"),
            "unreadable: unchanged"
        );
        // Term b changed; the binding runs with term a: unchanged.
        let mut q = p.clone();
        q.cluster_affinities[1].affinity.cluster_names = vec!["m3".into()];
        assert!(!q.changed_since(Some(&same), "a"));
        assert!(q.changed_since(Some(&same), "b"));
        assert!(q.changed_since(Some(&same), ""), "no term observed yet");
        // Tolerations are outside the terms: changed.
        let mut r = p.clone();
        r.cluster_tolerations = vec![Toleration {
            key: "x".into(),
            operator: "Exists".into(),
            ..Toleration::default()
        }];
        assert!(r.changed_since(Some(&same), "a"));
    }
}
