//! Decoding rendered objects into typed values, strictly.
//!
//! Each `(apiVersion, kind)` the manifests use maps to one `k8s-openapi` type (or a
//! [`crate::certmanager`] type); decoding goes through
//! [`dramesh_model::load::decode_value`], so a field the type does not know is an
//! `unknown field` error with its path. An `(apiVersion, kind)` without a typed schema here is
//! an error as well: nothing reaches the cluster unchecked.

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};

use dramesh_model::load::{FieldError, decode_value};
use dramesh_model::{LoadError, Source};
use serde_json::Value;

use crate::render::Resource;
use crate::{certmanager, karmada};

/// A rendered object decoded into its type (one variant per entry of [`KNOWN_KINDS`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Typed {
    /// A `Namespace`.
    Namespace(Box<Namespace>),
    /// A `ServiceAccount`.
    ServiceAccount(Box<ServiceAccount>),
    /// A `Service`.
    Service(Box<Service>),
    /// A `Secret`.
    Secret(Box<Secret>),
    /// A `ConfigMap`.
    ConfigMap(Box<ConfigMap>),
    /// A `DaemonSet`.
    DaemonSet(Box<DaemonSet>),
    /// A `StatefulSet`.
    StatefulSet(Box<StatefulSet>),
    /// A `Deployment`.
    Deployment(Box<Deployment>),
    /// A `ClusterRole`.
    ClusterRole(Box<ClusterRole>),
    /// A `ClusterRoleBinding`.
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    /// A `Role`.
    Role(Box<Role>),
    /// A `RoleBinding`.
    RoleBinding(Box<RoleBinding>),
    /// A `PodDisruptionBudget`.
    PodDisruptionBudget(Box<PodDisruptionBudget>),
    /// A `certmanager::Issuer`.
    Issuer(Box<certmanager::Issuer>),
    /// A `certmanager::Certificate`.
    Certificate(Box<certmanager::Certificate>),
    /// A Karmada `PropagationPolicy`, as the API server would store it (CRD defaults filled).
    PropagationPolicy(Box<Value>),
    /// A Karmada `ClusterPropagationPolicy`, as the API server would store it.
    ClusterPropagationPolicy(Box<Value>),
}

/// A decoded object and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    /// The manifest file the object came from.
    pub source: Source,
    /// The decoded object.
    pub object: Typed,
}

/// The `(apiVersion, kind)` pairs [`decode`] accepts.
pub const KNOWN_KINDS: [(&str, &str); 17] = [
    ("v1", "Namespace"),
    ("v1", "ServiceAccount"),
    ("v1", "Service"),
    ("v1", "Secret"),
    ("v1", "ConfigMap"),
    ("apps/v1", "DaemonSet"),
    ("apps/v1", "StatefulSet"),
    ("apps/v1", "Deployment"),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("policy/v1", "PodDisruptionBudget"),
    (certmanager::API_VERSION, "Issuer"),
    (certmanager::API_VERSION, "Certificate"),
    (karmada::KARMADA_KINDS[0].0, karmada::KARMADA_KINDS[0].1),
    (karmada::KARMADA_KINDS[1].0, karmada::KARMADA_KINDS[1].1),
];

fn typed<T, F>(r: &Resource, wrap: F) -> Result<Typed, FieldError>
where
    T: serde::de::DeserializeOwned + serde::Serialize,
    F: FnOnce(Box<T>) -> Typed,
{
    decode_value::<T>(r.value.clone()).map(|o| wrap(Box::new(o)))
}

/// A Karmada kind of [`KNOWN_KINDS`], checked against its CRD.
fn karmada_typed(r: &Resource) -> Result<Typed, FieldError> {
    let Some(checked) = karmada::validate(r.api_version(), r.kind(), &r.value) else {
        return Err(FieldError {
            field: "kind".into(),
            message: format!(
                "{}/{} is not a Karmada kind checked here",
                r.api_version(),
                r.kind()
            ),
        });
    };
    checked.map(|v| match r.kind() {
        "ClusterPropagationPolicy" => Typed::ClusterPropagationPolicy(Box::new(v)),
        _ => Typed::PropagationPolicy(Box::new(v)),
    })
}

/// Decodes one rendered object strictly.
pub fn decode(r: &Resource) -> Result<Checked, LoadError> {
    let decoded = match (r.api_version(), r.kind()) {
        ("v1", "Namespace") => typed(r, Typed::Namespace),
        ("v1", "ServiceAccount") => typed(r, Typed::ServiceAccount),
        ("v1", "Service") => typed(r, Typed::Service),
        ("v1", "Secret") => typed(r, Typed::Secret),
        ("v1", "ConfigMap") => typed(r, Typed::ConfigMap),
        ("apps/v1", "DaemonSet") => typed(r, Typed::DaemonSet),
        ("apps/v1", "StatefulSet") => typed(r, Typed::StatefulSet),
        ("apps/v1", "Deployment") => typed(r, Typed::Deployment),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => typed(r, Typed::ClusterRole),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            typed(r, Typed::ClusterRoleBinding)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => typed(r, Typed::Role),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => typed(r, Typed::RoleBinding),
        ("policy/v1", "PodDisruptionBudget") => typed(r, Typed::PodDisruptionBudget),
        (certmanager::API_VERSION, "Issuer") => {
            decode_value::<certmanager::Issuer>(r.value.clone()).and_then(|i| {
                i.validate()?;
                Ok(Typed::Issuer(Box::new(i)))
            })
        }
        (certmanager::API_VERSION, "Certificate") => {
            decode_value::<certmanager::Certificate>(r.value.clone()).and_then(|c| {
                c.validate()?;
                Ok(Typed::Certificate(Box::new(c)))
            })
        }
        (api_version, "PropagationPolicy" | "ClusterPropagationPolicy")
            if api_version == karmada::KARMADA_KINDS[0].0 =>
        {
            karmada_typed(r)
        }
        (api_version, kind) => Err(FieldError {
            field: "kind".into(),
            message: format!(
                "no typed schema for {api_version}/{kind} in this check (known: {})",
                KNOWN_KINDS
                    .iter()
                    .map(|(v, k)| format!("{v}/{k}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    };
    decoded
        .map(|object| Checked {
            source: r.source.clone(),
            object,
        })
        .map_err(|e| LoadError {
            file: r.source.file.clone(),
            document: Some(r.source.document),
            item: r.source.item,
            object: Some(r.label()),
            field: (!e.field.is_empty()).then_some(e.field),
            message: e.message,
        })
}
