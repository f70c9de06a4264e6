//! Karmada objects as the Karmada API server returns them: `work.karmada.io/v1alpha2`
//! ResourceBinding and ClusterResourceBinding, `cluster.karmada.io/v1alpha1` Cluster, and
//! `scheduling.k8s.io/v1` PriorityClass.
//!
//! Decoding accepts unknown and server-filled fields and `null` for omitted ones (what real
//! servers and older clients emit); it fails only on what a decision needs, with an
//! [`InputError`] naming the object and the field.

use std::collections::{BTreeMap, BTreeSet};

use dramesh_estimator::{Policy, ResList, TargetCluster};
use dramesh_model::k8s::{K8sQuantity, NodeSelector, PriorityClass, Taint, Toleration};
use dramesh_model::taint;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::placement::Placement;

/// An object, or a field of it, that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{object}: field {field}: {message}")]
pub struct InputError {
    /// `Kind namespace/name` (or `Kind name` for cluster-scoped objects).
    pub object: String,
    /// JSON path of the field at fault.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

/// `null` reads as the default, as Go's decoder reads it into an omitted field.
pub(crate) fn nd<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Decodes `v` into `T`, naming the failing field.
pub(crate) fn decode<'a, T: Deserialize<'a>>(v: &'a Value, object: &str) -> Result<T, InputError> {
    serde_path_to_error::deserialize(v).map_err(|e| InputError {
        object: object.to_string(),
        field: e.path().to_string(),
        message: e.inner().to_string(),
    })
}

/// `metadata`, the parts the scheduler reads.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Meta {
    /// `name`.
    #[serde(default, deserialize_with = "nd")]
    pub name: String,
    /// `namespace` (empty for cluster-scoped objects).
    #[serde(default, deserialize_with = "nd")]
    pub namespace: String,
    /// `uid`.
    #[serde(default, deserialize_with = "nd")]
    pub uid: String,
    /// `generation`.
    #[serde(default, deserialize_with = "nd")]
    pub generation: i64,
    /// `resourceVersion` (the precondition of every write).
    #[serde(default, deserialize_with = "nd")]
    pub resource_version: String,
    /// `labels`.
    #[serde(default, deserialize_with = "nd")]
    pub labels: BTreeMap<String, String>,
    /// `annotations`.
    #[serde(default, deserialize_with = "nd")]
    pub annotations: BTreeMap<String, String>,
    /// `creationTimestamp`.
    #[serde(default)]
    pub creation_timestamp: Option<Time>,
    /// `deletionTimestamp`: set while the object is being deleted.
    #[serde(default)]
    pub deletion_timestamp: Option<Time>,
}

/// Which binding kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BindingKind {
    /// `ResourceBinding` (namespaced).
    ResourceBinding,
    /// `ClusterResourceBinding` (cluster-scoped).
    ClusterResourceBinding,
}

impl BindingKind {
    /// The kind's name.
    pub fn as_str(self) -> &'static str {
        match self {
            BindingKind::ResourceBinding => "ResourceBinding",
            BindingKind::ClusterResourceBinding => "ClusterResourceBinding",
        }
    }
}

/// `spec.resource`: the resource template the binding propagates.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectReference {
    /// `apiVersion`.
    pub api_version: String,
    /// `kind`.
    pub kind: String,
    /// `namespace`.
    #[serde(default, deserialize_with = "nd")]
    pub namespace: String,
    /// `name`.
    pub name: String,
    /// `uid`.
    #[serde(default, deserialize_with = "nd")]
    pub uid: String,
    /// `resourceVersion`.
    #[serde(default, deserialize_with = "nd")]
    pub resource_version: String,
}

/// Karmada `NodeClaim`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeClaim {
    /// `hardNodeAffinity`.
    #[serde(default)]
    pub hard_node_affinity: Option<NodeSelector>,
    /// `nodeSelector`.
    #[serde(default, deserialize_with = "nd")]
    pub node_selector: BTreeMap<String, String>,
    /// `tolerations`.
    #[serde(default, deserialize_with = "nd")]
    pub tolerations: Vec<Toleration>,
}

/// `spec.replicaRequirements` (and a component's `replicaRequirements`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaRequirements {
    /// `nodeClaim`.
    #[serde(default)]
    pub node_claim: Option<NodeClaim>,
    /// `resourceRequest`.
    #[serde(default, deserialize_with = "nd")]
    pub resource_request: BTreeMap<String, K8sQuantity>,
    /// `priorityClassName`.
    #[serde(default, deserialize_with = "nd")]
    pub priority_class_name: String,
    /// `resourceClaimRefs`: the pod's claims by name, from Karmada's DRA estimator design
    /// (PR 7389). The ResourceBinding CRD among the fixtures (Karmada v1.19 line) does not
    /// have the field yet; a server whose CRD has it returns it, and it is read then.
    #[serde(default, deserialize_with = "nd")]
    pub resource_claim_refs: Vec<ResourceClaimReference>,
}

/// Karmada's `ResourceClaimReference` (`work/v1alpha2`, DRA estimator design).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceClaimReference {
    /// `resourceClaimTemplateName`: every replica gets a claim from this template.
    #[serde(default, deserialize_with = "nd")]
    pub resource_claim_template_name: String,
    /// `resourceClaimName`: an existing claim every replica shares.
    #[serde(default, deserialize_with = "nd")]
    pub resource_claim_name: String,
}

/// One of `spec.components` (multi-template workloads).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Component {
    /// `name`.
    pub name: String,
    /// `replicas` in one set.
    #[serde(default, deserialize_with = "nd")]
    pub replicas: i32,
    /// `replicaRequirements`.
    #[serde(default)]
    pub replica_requirements: Option<ReplicaRequirements>,
}

/// `spec.schedulePriority`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SchedulePriority {
    /// `priority`.
    #[serde(default, deserialize_with = "nd")]
    pub priority: i32,
    /// `preemptionPolicy` (`PreemptLowerPriority` or `Never`), the field Karmada's binding
    /// preemption proposal (PR 7327) adds; empty when the server does not have it.
    #[serde(default, deserialize_with = "nd")]
    pub preemption_policy: String,
}

/// `spec.suspension`, the part the scheduler honours.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Suspension {
    /// `scheduling`.
    #[serde(default)]
    pub scheduling: Option<bool>,
}

/// One of `spec.gracefulEvictionTasks`, with Karmada's field order and `omitempty` rules.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GracefulEvictionTask {
    /// `fromCluster`.
    pub from_cluster: String,
    /// `purgeMode`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub purge_mode: String,
    /// `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// `reason`.
    #[serde(default, deserialize_with = "nd")]
    pub reason: String,
    /// `message`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "String::is_empty"
    )]
    pub message: String,
    /// `producer`.
    #[serde(default, deserialize_with = "nd")]
    pub producer: String,
    /// `gracePeriodSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_period_seconds: Option<i32>,
    /// `suppressDeletion`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suppress_deletion: Option<bool>,
    /// `preservedLabelState`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub preserved_label_state: BTreeMap<String, String>,
    /// `creationTimestamp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<Time>,
    /// `clustersBeforeFailover`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub clusters_before_failover: Vec<String>,
}

/// A `metav1.Condition`, serialized as Go does (`lastTransitionTime` is never omitted).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `type`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `status`: `True`, `False` or `Unknown`.
    #[serde(default, deserialize_with = "nd")]
    pub status: String,
    /// `observedGeneration`.
    #[serde(default, deserialize_with = "nd", skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    /// `lastTransitionTime`.
    #[serde(default)]
    pub last_transition_time: Option<Time>,
    /// `reason`.
    #[serde(default, deserialize_with = "nd")]
    pub reason: String,
    /// `message`.
    #[serde(default, deserialize_with = "nd")]
    pub message: String,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// `status`, the fields karmada-scheduler reads and writes, serialized with Go's `omitempty`
/// rules (the status patch is the difference of two of these).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BindingStatus {
    /// `schedulerObservedGeneration`.
    #[serde(default, deserialize_with = "nd", skip_serializing_if = "is_zero")]
    pub scheduler_observed_generation: i64,
    /// `schedulerObservingAffinityName`: the `clusterAffinities` term last scheduled with.
    #[serde(
        default,
        deserialize_with = "nd",
        rename = "schedulerObservingAffinityName",
        skip_serializing_if = "String::is_empty"
    )]
    pub scheduler_observed_affinity_name: String,
    /// `lastScheduledTime`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scheduled_time: Option<Time>,
    /// `conditions`.
    #[serde(
        default,
        deserialize_with = "nd",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub conditions: Vec<Condition>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSpec {
    resource: ObjectReference,
    #[serde(default, deserialize_with = "nd")]
    replicas: i32,
    #[serde(default)]
    replica_requirements: Option<ReplicaRequirements>,
    #[serde(default, deserialize_with = "nd")]
    components: Vec<Component>,
    #[serde(default, deserialize_with = "nd")]
    clusters: Vec<TargetCluster>,
    #[serde(default, deserialize_with = "nd")]
    scheduler_name: String,
    #[serde(default)]
    schedule_priority: Option<SchedulePriority>,
    #[serde(default)]
    reschedule_triggered_at: Option<Time>,
    #[serde(default, deserialize_with = "nd")]
    graceful_eviction_tasks: Vec<GracefulEvictionTask>,
    #[serde(default)]
    suspension: Option<Suspension>,
}

#[derive(Deserialize)]
struct RawBinding {
    #[serde(default)]
    metadata: Meta,
    spec: RawSpec,
    #[serde(default, deserialize_with = "nd")]
    status: BindingStatus,
}

/// A ResourceBinding or ClusterResourceBinding.
#[derive(Debug, Clone)]
pub struct Binding {
    /// Which kind.
    pub kind: BindingKind,
    /// `metadata`.
    pub metadata: Meta,
    /// `spec.resource`.
    pub resource: ObjectReference,
    /// `spec.replicas`.
    pub replicas: i32,
    /// `spec.replicaRequirements`.
    pub replica_requirements: Option<ReplicaRequirements>,
    /// `spec.components`.
    pub components: Vec<Component>,
    /// `spec.placement` as Karmada's Go type holds it (what the applied-placement annotation
    /// records).
    pub placement: Placement,
    /// `spec.placement` as dramesh's placement reads it.
    pub policy: Policy,
    /// `spec.clusters`: the current schedule result.
    pub clusters: Vec<TargetCluster>,
    /// `spec.schedulerName`.
    pub scheduler_name: String,
    /// `spec.schedulePriority`.
    pub schedule_priority: Option<SchedulePriority>,
    /// `spec.rescheduleTriggeredAt`.
    pub reschedule_triggered_at: Option<Time>,
    /// `spec.gracefulEvictionTasks`.
    pub graceful_eviction_tasks: Vec<GracefulEvictionTask>,
    /// `spec.suspension.scheduling`.
    pub scheduling_suspended: bool,
    /// `status`.
    pub status: BindingStatus,
}

/// The annotation holding the placement a binding was last scheduled with.
pub const APPLIED_PLACEMENT: &str = "policy.karmada.io/applied-placement";

/// Labels that mark a binding as managed by Karmada's detector (the scheduler's event filter).
const MANAGED_LABELS: [&str; 3] = [
    "propagationpolicy.karmada.io/permanent-id",
    "clusterpropagationpolicy.karmada.io/permanent-id",
    "binding.karmada.io/managed-by",
];

impl Binding {
    /// Reads a binding of `kind` as the API server returns it.
    pub fn from_value(kind: BindingKind, v: &Value) -> Result<Binding, InputError> {
        let meta_name = v
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        let meta_ns = v
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or("");
        let object = match kind {
            BindingKind::ResourceBinding => format!("{} {meta_ns}/{meta_name}", kind.as_str()),
            BindingKind::ClusterResourceBinding => format!("{} {meta_name}", kind.as_str()),
        };
        let err = |field: &str, message: String| InputError {
            object: object.clone(),
            field: field.to_string(),
            message,
        };
        let raw: RawBinding = decode(v, &object)?;
        if raw.metadata.name.is_empty() {
            return Err(err("metadata.name", "required".into()));
        }
        if kind == BindingKind::ResourceBinding && raw.metadata.namespace.is_empty() {
            return Err(err(
                "metadata.namespace",
                "required for a ResourceBinding".into(),
            ));
        }
        let placement_value = v
            .pointer("/spec/placement")
            .filter(|p| !p.is_null())
            .ok_or_else(|| err("spec.placement", "required".into()))?;
        let placement: Placement = decode(placement_value, &object).map_err(|mut e| {
            e.field = format!("spec.placement.{}", e.field);
            e
        })?;
        for (i, c) in placement.spread_constraints.iter().enumerate() {
            for (name, v) in [("maxGroups", c.max_groups), ("minGroups", c.min_groups)] {
                if v < 0 {
                    return Err(err(
                        &format!("spec.placement.spreadConstraints[{i}].{name}"),
                        format!("{name} lower than 0 is not allowed"),
                    ));
                }
            }
        }
        let policy = Policy::from_placement(&raw.metadata.name, placement_value)
            .map_err(|e| err(&e.field, e.message))?;
        for (i, c) in raw.spec.clusters.iter().enumerate() {
            if c.name.is_empty() {
                return Err(err(&format!("spec.clusters[{i}].name"), "required".into()));
            }
            if c.replicas < 0 {
                return Err(err(
                    &format!("spec.clusters[{i}].replicas"),
                    "must not be negative".into(),
                ));
            }
        }
        if raw.spec.replicas < 0 {
            return Err(err("spec.replicas", "must not be negative".into()));
        }
        for (i, c) in raw.spec.components.iter().enumerate() {
            if c.name.is_empty() {
                return Err(err(
                    &format!("spec.components[{i}].name"),
                    "required".into(),
                ));
            }
            if c.replicas < 0 {
                return Err(err(
                    &format!("spec.components[{i}].replicas"),
                    "must not be negative".into(),
                ));
            }
        }
        Ok(Binding {
            kind,
            resource: raw.spec.resource,
            replicas: raw.spec.replicas,
            replica_requirements: raw.spec.replica_requirements,
            components: raw.spec.components,
            placement,
            policy,
            clusters: raw.spec.clusters,
            scheduler_name: raw.spec.scheduler_name,
            schedule_priority: raw.spec.schedule_priority,
            reschedule_triggered_at: raw.spec.reschedule_triggered_at,
            graceful_eviction_tasks: raw.spec.graceful_eviction_tasks,
            scheduling_suspended: raw
                .spec
                .suspension
                .and_then(|s| s.scheduling)
                .unwrap_or(false),
            status: raw.status,
            metadata: raw.metadata,
        })
    }

    /// `ResourceBinding namespace/name` or `ClusterResourceBinding name`.
    pub fn id(&self) -> String {
        match self.kind {
            BindingKind::ResourceBinding => format!(
                "{} {}/{}",
                self.kind.as_str(),
                self.metadata.namespace,
                self.metadata.name
            ),
            BindingKind::ClusterResourceBinding => {
                format!("{} {}", self.kind.as_str(), self.metadata.name)
            }
        }
    }

    /// Karmada's log and message form: `namespace/name`, or `name`.
    pub fn key(&self) -> String {
        match self.kind {
            BindingKind::ResourceBinding => {
                format!("{}/{}", self.metadata.namespace, self.metadata.name)
            }
            BindingKind::ClusterResourceBinding => self.metadata.name.clone(),
        }
    }

    /// `spec.schedulePriority.priority` (0 when unset).
    pub fn priority(&self) -> i32 {
        self.schedule_priority.as_ref().map_or(0, |p| p.priority)
    }

    /// Karmada `IsWorkload`: replicas, replica requirements or components.
    pub fn is_workload(&self) -> bool {
        self.replicas > 0 || self.replica_requirements.is_some() || !self.components.is_empty()
    }

    /// Whether a scheduler named `scheduler` handles this binding: Karmada's event filter
    /// (scheduler name, with the empty name meaning `default-scheduler`; scheduling not
    /// suspended; created by Karmada's detector).
    pub fn handled_by(&self, scheduler: &str) -> bool {
        handles(
            scheduler,
            &self.scheduler_name,
            self.scheduling_suspended,
            |l| self.metadata.labels.get(l).map(String::as_str),
        )
    }

    /// Replicas assigned to `cluster` in `spec.clusters`.
    pub fn assigned(&self, cluster: &str) -> i64 {
        self.clusters
            .iter()
            .find(|c| c.name == cluster)
            .map_or(0, |c| c.replicas)
    }
}

/// [`Binding::handled_by`] read from a binding as served, for one that does not decode: a
/// malformed binding is reported to the scheduler it names, and left alone by the others.
pub fn handled_by_value(v: &Value, scheduler: &str) -> bool {
    let name = v
        .pointer("/spec/schedulerName")
        .and_then(Value::as_str)
        .unwrap_or("");
    let suspended = v
        .pointer("/spec/suspension/scheduling")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    handles(scheduler, name, suspended, |l| {
        v.pointer("/metadata/labels")
            .and_then(|m| m.get(l))
            .and_then(Value::as_str)
    })
}

/// Karmada's binding event filter: the scheduler name (empty meaning `default-scheduler`),
/// scheduling not suspended, created by Karmada's detector.
fn handles<'a>(
    scheduler: &str,
    name: &str,
    suspended: bool,
    label: impl Fn(&str) -> Option<&'a str>,
) -> bool {
    let name = if name.is_empty() {
        "default-scheduler"
    } else {
        name
    };
    name == scheduler
        && !suspended
        && MANAGED_LABELS
            .iter()
            .any(|l| label(l).is_some_and(|v| !v.is_empty()))
}

/// A cluster's `Ready` condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// `status: "True"`.
    Ready,
    /// `status: "False"`.
    NotReady,
    /// `Unknown`, or no Ready condition yet.
    Unknown,
}

/// `status.resourceSummary`, parsed into Karmada's units (CPU in millis, the rest in whole
/// units, rounded up).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResourceSummary {
    /// `allocatable`.
    pub allocatable: ResList,
    /// `allocated`.
    pub allocated: ResList,
    /// `allocating`.
    pub allocating: ResList,
    /// `allocatableModelings` as (grade, count).
    pub modelings: Vec<(u32, i64)>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSummary {
    #[serde(default, deserialize_with = "nd")]
    allocatable: BTreeMap<String, K8sQuantity>,
    #[serde(default, deserialize_with = "nd")]
    allocated: BTreeMap<String, K8sQuantity>,
    #[serde(default, deserialize_with = "nd")]
    allocating: BTreeMap<String, K8sQuantity>,
    #[serde(default, deserialize_with = "nd")]
    allocatable_modelings: Vec<RawModeling>,
}

#[derive(Deserialize)]
struct RawModeling {
    grade: u32,
    count: i64,
}

/// One of `spec.resourceModels` (Karmada's `CustomizedClusterResourceModeling`): a node
/// grade and, for each resource it ranges over, the least a node of that grade has left.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResourceModel {
    /// `grade`.
    pub grade: u32,
    /// The `min` of each of `ranges`, in Karmada's units (CPU in millis, the rest in whole
    /// units rounded up); a resource named twice keeps its last range.
    pub min: ResList,
}

#[derive(Deserialize)]
struct RawModel {
    #[serde(default, deserialize_with = "nd")]
    grade: u32,
    #[serde(default, deserialize_with = "nd")]
    ranges: Vec<RawModelRange>,
}

#[derive(Deserialize)]
struct RawModelRange {
    #[serde(default, deserialize_with = "nd")]
    name: String,
    #[serde(default)]
    min: Option<K8sQuantity>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawClusterSpec {
    #[serde(default, deserialize_with = "nd")]
    provider: String,
    #[serde(default, deserialize_with = "nd")]
    region: String,
    #[serde(default, deserialize_with = "nd")]
    zone: String,
    #[serde(default, deserialize_with = "nd")]
    zones: Vec<String>,
    #[serde(default, deserialize_with = "nd")]
    taints: Vec<Taint>,
    #[serde(default, deserialize_with = "nd")]
    resource_models: Vec<RawModel>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawClusterStatus {
    #[serde(default, deserialize_with = "nd")]
    conditions: Vec<Condition>,
    #[serde(default)]
    resource_summary: Option<RawSummary>,
    #[serde(default, deserialize_with = "nd")]
    api_enablements: Vec<RawApiEnablement>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawApiEnablement {
    #[serde(default, deserialize_with = "nd")]
    group_version: String,
    #[serde(default, deserialize_with = "nd")]
    resources: Vec<RawApiResource>,
}

#[derive(Deserialize)]
struct RawApiResource {
    #[serde(default, deserialize_with = "nd")]
    kind: String,
}

#[derive(Deserialize)]
struct RawCluster {
    #[serde(default)]
    metadata: Meta,
    #[serde(default)]
    spec: Option<RawClusterSpec>,
    #[serde(default)]
    status: Option<RawClusterStatus>,
}

/// A Karmada member cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels` and `spec.provider`, `spec.region`, `spec.zone` (else the only entry
    /// of `spec.zones`): what cluster affinity matches.
    pub info: dramesh_model::ClusterInfo,
    /// `metadata.generation`.
    pub generation: i64,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// `spec.taints`.
    pub taints: Vec<Taint>,
    /// The `Ready` condition.
    pub readiness: Readiness,
    /// `status.resourceSummary`, if reported.
    pub summary: Option<ResourceSummary>,
    /// `spec.resourceModels`.
    pub models: Vec<ResourceModel>,
    /// `status.apiEnablements`: the kinds the member cluster serves, by group/version
    /// (`apps/v1`, `v1`, `kubeflow.org/v1`, ...).
    pub api_enablements: BTreeMap<String, BTreeSet<String>>,
    /// `spec.zones` is not empty (Karmada's SpreadConstraint filter reads `spec.zones`, not
    /// the deprecated `spec.zone`).
    pub has_zones: bool,
    /// The readiness taints Karmada would add that `spec.taints` lacks.
    readiness_taints: Vec<Taint>,
}

/// The taints Karmada's cluster controller puts on a cluster that is not ready
/// (`Ready=False`) or unreachable (`Ready=Unknown`).
pub const TAINT_NOT_READY: &str = "cluster.karmada.io/not-ready";
/// See [`TAINT_NOT_READY`].
pub const TAINT_UNREACHABLE: &str = "cluster.karmada.io/unreachable";

impl Cluster {
    /// Reads a Cluster as the API server returns it.
    pub fn from_value(v: &Value) -> Result<Cluster, InputError> {
        let name = v
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        let object = format!("Cluster {name}");
        let raw: RawCluster = decode(v, &object)?;
        if raw.metadata.name.is_empty() {
            return Err(InputError {
                object,
                field: "metadata.name".into(),
                message: "required".into(),
            });
        }
        let spec = raw.spec.unwrap_or(RawClusterSpec {
            provider: String::new(),
            region: String::new(),
            zone: String::new(),
            zones: Vec::new(),
            taints: Vec::new(),
            resource_models: Vec::new(),
        });
        let (conditions, summary, apis) = match raw.status {
            Some(s) => (s.conditions, s.resource_summary, s.api_enablements),
            None => (Vec::new(), None, Vec::new()),
        };
        let mut api_enablements: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for a in apis {
            api_enablements
                .entry(a.group_version)
                .or_default()
                .extend(a.resources.into_iter().map(|r| r.kind));
        }
        let readiness = match conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .map(|c| c.status.as_str())
        {
            Some("True") => Readiness::Ready,
            Some("False") => Readiness::NotReady,
            _ => Readiness::Unknown,
        };
        let summary = match summary {
            None => None,
            Some(s) => {
                let list = |m: &BTreeMap<String, K8sQuantity>, f: &str| {
                    ResList::from_k8s(m).map_err(|e| InputError {
                        object: object.clone(),
                        field: format!("status.resourceSummary.{f}"),
                        message: e,
                    })
                };
                Some(ResourceSummary {
                    allocatable: list(&s.allocatable, "allocatable")?,
                    allocated: list(&s.allocated, "allocated")?,
                    allocating: list(&s.allocating, "allocating")?,
                    modelings: s
                        .allocatable_modelings
                        .iter()
                        .map(|m| (m.grade, m.count))
                        .collect(),
                })
            }
        };
        let mut models = Vec::with_capacity(spec.resource_models.len());
        for (i, m) in spec.resource_models.iter().enumerate() {
            let mut min = ResList::new();
            for (j, r) in m.ranges.iter().enumerate() {
                let field = |f: &str| format!("spec.resourceModels[{i}].ranges[{j}].{f}");
                if r.name.is_empty() {
                    return Err(InputError {
                        object: object.clone(),
                        field: field("name"),
                        message: "required".into(),
                    });
                }
                let Some(q) = &r.min else {
                    return Err(InputError {
                        object: object.clone(),
                        field: field("min"),
                        message: "required".into(),
                    });
                };
                let one = BTreeMap::from([(r.name.clone(), q.clone())]);
                let parsed = ResList::from_k8s(&one).map_err(|e| InputError {
                    object: object.clone(),
                    field: field("min"),
                    message: e,
                })?;
                for (n, v) in parsed.iter() {
                    min.set(n.clone(), v);
                }
            }
            models.push(ResourceModel {
                grade: m.grade,
                min,
            });
        }
        let zone = if spec.zone.is_empty() && spec.zones.len() == 1 {
            spec.zones[0].clone()
        } else {
            spec.zone
        };
        let opt = |s: String| (!s.is_empty()).then_some(s);
        let readiness_taints = readiness_taints(&spec.taints, readiness);
        let has_zones = !spec.zones.is_empty();
        Ok(Cluster {
            name: raw.metadata.name,
            info: dramesh_model::ClusterInfo {
                kubernetes_version: None,
                labels: raw.metadata.labels,
                provider: opt(spec.provider),
                region: opt(spec.region),
                zone: opt(zone),
            },
            generation: raw.metadata.generation,
            deleting: raw.metadata.deletion_timestamp.is_some(),
            taints: spec.taints,
            readiness,
            summary,
            models,
            api_enablements,
            has_zones,
            readiness_taints,
        })
    }

    /// Karmada `helper.IsAPIEnabled`: `status.apiEnablements` lists `kind` under the group
    /// version `api_version` (a resource's `apiVersion`, compared as written).
    pub fn api_enabled(&self, api_version: &str, kind: &str) -> bool {
        self.api_enablements
            .get(api_version)
            .is_some_and(|kinds| kinds.contains(kind))
    }

    /// `spec.taints`, plus the taints Karmada's cluster controller puts on a cluster that is
    /// not ready (NoSchedule and NoExecute), when they are not there already: readiness is
    /// judged the way Karmada's taint-based eviction judges it, so a placement that tolerates
    /// `cluster.karmada.io/not-ready` still lands on such a cluster.
    pub fn effective_taints(&self) -> impl Iterator<Item = &Taint> {
        self.taints.iter().chain(&self.readiness_taints)
    }

    /// The first of [`Cluster::effective_taints`] with effect NoExecute (and NoSchedule too,
    /// when `no_schedule`) that none of `tolerations` tolerates.
    pub fn untolerated(&self, tolerations: &[Toleration], no_schedule: bool) -> Option<&Taint> {
        self.effective_taints().find(|t| {
            (t.effect == "NoExecute" || (no_schedule && t.effect == "NoSchedule"))
                && !tolerations.iter().any(|tol| taint::tolerates(tol, t))
        })
    }
}

fn readiness_taints(taints: &[Taint], readiness: Readiness) -> Vec<Taint> {
    let key = match readiness {
        Readiness::Ready => return Vec::new(),
        Readiness::NotReady => TAINT_NOT_READY,
        Readiness::Unknown => TAINT_UNREACHABLE,
    };
    ["NoSchedule", "NoExecute"]
        .into_iter()
        .filter(|effect| !taints.iter().any(|t| t.key == key && t.effect == *effect))
        .map(|effect| Taint {
            key: key.to_string(),
            effect: effect.to_string(),
            time_added: None,
            value: None,
        })
        .collect()
}

/// Reads a `scheduling.k8s.io/v1` PriorityClass as the API server returns it.
pub fn priority_class_from_value(v: &Value) -> Result<PriorityClass, InputError> {
    let name = v
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let object = format!("PriorityClass {name}");
    let pc: PriorityClass = decode(v, &object)?;
    if pc.metadata.name.as_deref().unwrap_or("").is_empty() {
        return Err(InputError {
            object,
            field: "metadata.name".into(),
            message: "required".into(),
        });
    }
    if pc.value.is_none() {
        return Err(InputError {
            object,
            field: "value".into(),
            message: "required".into(),
        });
    }
    if let Some(p) = pc.preemption_policy.as_deref()
        && p != "Never"
        && p != "PreemptLowerPriority"
    {
        return Err(InputError {
            object,
            field: "preemptionPolicy".into(),
            message: format!("unknown value {p:?} (PreemptLowerPriority or Never)"),
        });
    }
    Ok(pc)
}

/// Objects as a Karmada API server returns them, for tests.
#[cfg(test)]
pub(crate) mod tests_support {
    use serde_json::{Value, json};

    /// A ResourceBinding as a Karmada API server returns it: server-filled metadata,
    /// fields dramesh does not read, nulls.
    pub(crate) fn server_binding() -> Value {
        json!({
            "apiVersion": "work.karmada.io/v1alpha2",
            "kind": "ResourceBinding",
            "metadata": {
                "name": "web-deployment", "namespace": "default", "uid": "b-uid",
                "generation": 3, "resourceVersion": "812",
                "creationTimestamp": "2026-11-25T10:00:00Z",
                "labels": {"propagationpolicy.karmada.io/permanent-id": "pp-1"},
                "annotations": {"policy.karmada.io/applied-placement": "{}"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "d-uid", "controller": true}],
                "managedFields": [{"manager": "karmada-controller-manager", "operation": "Update"}],
                "finalizers": ["karmada.io/binding-controller"]
            },
            "spec": {
                "resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "default", "name": "web", "uid": "d-uid", "resourceVersion": "700"},
                "replicas": 4,
                "replicaRequirements": {"resourceRequest": {"cpu": "500m", "memory": "1Gi"}, "namespace": "default"},
                "placement": {
                    "clusterAffinity": {"clusterNames": ["m1", "m2"]},
                    "clusterTolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "replicaScheduling": {"replicaSchedulingType": "Divided", "replicaDivisionPreference": "Weighted", "weightPreference": {"dynamicWeight": "AvailableReplicas"}}
                },
                "clusters": [{"name": "m1", "replicas": 3}, {"name": "m2", "replicas": 1}],
                "schedulerName": "dramesh-scheduler",
                "schedulePriority": {"priority": 1000},
                "rescheduleTriggeredAt": null,
                "conflictResolution": "Abort",
                "propagateDeps": true,
                "gracefulEvictionTasks": [{"fromCluster": "m3", "reason": "TaintUntolerated", "producer": "TaintManager", "creationTimestamp": "2026-11-25T09:00:00Z"}]
            },
            "status": {
                "schedulerObservedGeneration": 2,
                "lastScheduledTime": "2026-11-25T10:00:05Z",
                "conditions": [{"type": "Scheduled", "status": "True", "reason": "Success", "message": "Binding has been scheduled successfully.", "lastTransitionTime": "2026-11-25T10:00:05Z"}],
                "aggregatedStatus": [{"clusterName": "m1", "applied": true, "health": "Healthy"}]
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::server_binding;
    use super::*;
    use serde_json::json;

    #[test]
    fn a_binding_as_the_server_returns_it_loads() {
        let b =
            Binding::from_value(BindingKind::ResourceBinding, &server_binding()).expect("loads");
        assert_eq!(b.id(), "ResourceBinding default/web-deployment");
        assert_eq!(b.metadata.generation, 3);
        assert_eq!(b.metadata.resource_version, "812");
        assert_eq!(b.resource.kind, "Deployment");
        assert_eq!(b.resource.uid, "d-uid");
        assert_eq!(b.replicas, 4);
        assert_eq!(b.priority(), 1000);
        assert_eq!(b.clusters.len(), 2);
        assert_eq!(b.assigned("m1"), 3);
        assert_eq!(b.graceful_eviction_tasks[0].from_cluster, "m3");
        assert_eq!(b.status.scheduler_observed_generation, 2);
        assert_eq!(b.status.conditions[0].reason, "Success");
        assert!(b.reschedule_triggered_at.is_none());
        assert_eq!(
            b.policy.strategy,
            dramesh_estimator::Strategy::DynamicWeight
        );
        assert_eq!(b.policy.tolerations.len(), 1);
        assert!(b.handled_by("dramesh-scheduler"));
        assert!(!b.handled_by("default-scheduler"));
        assert!(b.is_workload());
    }

    #[test]
    fn bad_fields_are_named() {
        let mut v = server_binding();
        v["spec"]["replicas"] = json!("four");
        let e = Binding::from_value(BindingKind::ResourceBinding, &v).expect_err("replicas");
        assert_eq!(e.object, "ResourceBinding default/web-deployment");
        assert_eq!(e.field, "spec.replicas");

        let mut v = server_binding();
        v["spec"].as_object_mut().map(|s| s.remove("placement"));
        let e = Binding::from_value(BindingKind::ResourceBinding, &v).expect_err("placement");
        assert_eq!(e.field, "spec.placement");

        let mut v = server_binding();
        v["spec"]["placement"]["clusterAffinity"] =
            json!({"labelSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}});
        let e = Binding::from_value(BindingKind::ResourceBinding, &v).expect_err("affinity");
        assert_eq!(
            e.field,
            "spec.placement.clusterAffinity.labelSelector.matchExpressions[0].values"
        );

        let mut v = server_binding();
        v["spec"]["components"] = json!([{"name": "a", "replicas": -2}]);
        let e = Binding::from_value(BindingKind::ResourceBinding, &v).expect_err("component");
        assert_eq!(e.field, "spec.components[0].replicas");

        let mut v = server_binding();
        v["spec"]["clusters"] = json!([{"name": "m1", "replicas": -1}]);
        let e = Binding::from_value(BindingKind::ResourceBinding, &v).expect_err("negative");
        assert_eq!(e.field, "spec.clusters[0].replicas");

        let mut v = server_binding();
        v["spec"]["resource"] = json!({"kind": "Deployment"});
        let e = Binding::from_value(BindingKind::ResourceBinding, &v).expect_err("resource");
        assert_eq!(e.field, "spec.resource");
        assert!(e.message.contains("apiVersion"), "{e}");
    }

    #[test]
    fn scheduler_name_filter_is_karmadas() {
        let mut v = server_binding();
        v["spec"]["schedulerName"] = json!("");
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("loads");
        assert!(b.handled_by("default-scheduler"));
        v["spec"]["schedulerName"] = json!("dramesh-scheduler");
        v["spec"]["suspension"] = json!({"scheduling": true});
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("loads");
        assert!(!b.handled_by("dramesh-scheduler"), "suspended");
        v["spec"]["suspension"] = json!(null);
        v["metadata"]["labels"] = json!({});
        let b = Binding::from_value(BindingKind::ResourceBinding, &v).expect("loads");
        assert!(!b.handled_by("dramesh-scheduler"), "not from the detector");
        assert!(!handled_by_value(&v, "dramesh-scheduler"));
        v["metadata"]["labels"] = json!({"binding.karmada.io/managed-by": "x"});
        assert!(handled_by_value(&v, "dramesh-scheduler"));
        assert!(!handled_by_value(&v, "default-scheduler"));
    }

    fn server_cluster() -> Value {
        json!({
            "apiVersion": "cluster.karmada.io/v1alpha1", "kind": "Cluster",
            "metadata": {"name": "m1", "generation": 4, "labels": {"tier": "gpu"}, "resourceVersion": "9"},
            "spec": {"syncMode": "Push", "apiEndpoint": "https://m1", "provider": "aws", "region": "eu-west-1",
                     "zones": ["eu-west-1a"], "taints": [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}],
                     "resourceModels": [{"grade": 0, "ranges": [{"name": "cpu", "min": "0", "max": "1"}]}]},
            "status": {
                "kubernetesVersion": "v1.35.0",
                "conditions": [{"type": "Ready", "status": "True", "reason": "ClusterReady", "message": "cluster is healthy and ready to accept workloads", "lastTransitionTime": "2026-11-25T09:00:00Z"}],
                "nodeSummary": {"totalNum": 3, "readyNum": 3},
                "resourceSummary": {"allocatable": {"cpu": "24", "memory": "96Gi", "pods": "330"},
                                    "allocated": {"cpu": "10500m", "memory": "40Gi", "pods": "30"},
                                    "allocating": {"cpu": "500m", "pods": "2"},
                                    "allocatableModelings": [{"grade": 0, "count": 3}]},
                "apiEnablements": [{"groupVersion": "apps/v1", "resources": [{"name": "deployments", "kind": "Deployment"}]},
                                   {"groupVersion": "v1", "resources": null},
                                   {"groupVersion": "apps/v1", "resources": [{"name": "deployments/scale", "kind": "Scale"}]}]
            }
        })
    }

    #[test]
    fn a_cluster_as_the_server_returns_it_loads() {
        let c = Cluster::from_value(&server_cluster()).expect("loads");
        assert_eq!(c.name, "m1");
        assert_eq!(c.readiness, Readiness::Ready);
        let s = c.summary.as_ref().expect("summary");
        assert_eq!(s.allocatable.get(&dramesh_estimator::ResName::Cpu), 24_000);
        assert_eq!(s.allocated.get(&dramesh_estimator::ResName::Cpu), 10_500);
        assert_eq!(s.modelings, vec![(0, 3)]);
        assert_eq!(
            c.effective_taints().count(),
            1,
            "ready: only its own taints"
        );
        assert_eq!(c.info.zone.as_deref(), Some("eu-west-1a"));
        assert!(c.has_zones);
        assert_eq!(c.info.labels.get("tier").map(String::as_str), Some("gpu"));
        // A group/version listed twice adds up; `null` resources read as none.
        assert!(c.api_enabled("apps/v1", "Deployment"));
        assert!(c.api_enabled("apps/v1", "Scale"));
        assert!(!c.api_enabled("apps/v1", "StatefulSet"));
        assert!(!c.api_enabled("v1", "Pod"));
        assert!(
            !c.api_enabled("apps/v1beta1", "Deployment"),
            "versions compare as written"
        );

        let mut v = server_cluster();
        v["status"]["conditions"][0]["status"] = json!("False");
        let c = Cluster::from_value(&v).expect("loads");
        assert_eq!(c.readiness, Readiness::NotReady);
        let mut t = c.effective_taints();
        assert!(t.any(|t| t.key == TAINT_NOT_READY && t.effect == "NoExecute"));

        let mut v = server_cluster();
        v["status"]["resourceSummary"]["allocatable"]["cpu"] = json!("lots");
        let e = Cluster::from_value(&v).expect_err("quantity");
        assert_eq!(e.object, "Cluster m1");
        assert_eq!(e.field, "status.resourceSummary.allocatable");
        assert!(e.message.contains("cpu"), "{e}");
    }

    #[test]
    fn priority_classes_are_checked() {
        let pc = priority_class_from_value(&json!({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": "high", "resourceVersion": "1"}, "value": 1000, "preemptionPolicy": "Never"
        }))
        .expect("loads");
        assert_eq!(pc.value, Some(1000));
        let e = priority_class_from_value(
            &json!({"metadata": {"name": "x"}, "value": 1, "preemptionPolicy": "Sometimes"}),
        )
        .expect_err("policy");
        assert_eq!(e.field, "preemptionPolicy");
        let e = priority_class_from_value(&json!({"metadata": {"name": "x"}})).expect_err("value");
        assert_eq!(e.object, "PriorityClass x");
        assert_eq!(e.field, "value");
    }
}
