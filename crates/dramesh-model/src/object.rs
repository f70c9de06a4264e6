//! Typed Kubernetes objects as dramesh moves them around, and the keys that name them.
//!
//! Every part of dramesh that carries cluster state (the manifest loader, the CRDT store, the
//! cluster view) speaks in [`ClusterObject`]s and [`ObjectChange`]s, so one object has one
//! decoding path from YAML, JSON or a replicated document.

use std::fmt;
use std::sync::Arc;

use crate::k8s;
use crate::karpenter;

/// The kinds of object a member cluster publishes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum ObjectKind {
    /// A Node.
    Node,
    /// A Pod (trimmed).
    Pod,
    /// A ResourceSlice.
    ResourceSlice,
    /// A DeviceClass.
    DeviceClass,
    /// A ResourceClaim.
    ResourceClaim,
    /// A DeviceTaintRule.
    DeviceTaintRule,
    /// Cluster facts: Kubernetes version, labels (`cluster.yaml` or the agent's report).
    ClusterInfo,
    /// A ResourceClaimTemplate (what Karmada's `resourceClaimRefs` name, resolved in each
    /// member cluster).
    ResourceClaimTemplate,
    /// A Karpenter NodePool (`karpenter.sh/v1`, trimmed).
    NodePool,
    /// A Karpenter NodeClaim (`karpenter.sh/v1`, trimmed).
    NodeClaim,
}

impl ObjectKind {
    /// Every kind.
    pub const ALL: [ObjectKind; 10] = [
        ObjectKind::Node,
        ObjectKind::Pod,
        ObjectKind::ResourceSlice,
        ObjectKind::DeviceClass,
        ObjectKind::ResourceClaim,
        ObjectKind::DeviceTaintRule,
        ObjectKind::ClusterInfo,
        ObjectKind::ResourceClaimTemplate,
        ObjectKind::NodePool,
        ObjectKind::NodeClaim,
    ];

    /// The Kubernetes kind name.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectKind::Node => "Node",
            ObjectKind::Pod => "Pod",
            ObjectKind::ResourceSlice => "ResourceSlice",
            ObjectKind::DeviceClass => "DeviceClass",
            ObjectKind::ResourceClaim => "ResourceClaim",
            ObjectKind::DeviceTaintRule => "DeviceTaintRule",
            ObjectKind::ClusterInfo => "ClusterInfo",
            ObjectKind::ResourceClaimTemplate => "ResourceClaimTemplate",
            ObjectKind::NodePool => "NodePool",
            ObjectKind::NodeClaim => "NodeClaim",
        }
    }

    /// True for namespaced kinds.
    pub fn namespaced(self) -> bool {
        matches!(
            self,
            ObjectKind::Pod | ObjectKind::ResourceClaim | ObjectKind::ResourceClaimTemplate
        )
    }
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Identity of one object within one cluster.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ObjectKey {
    /// Kind.
    pub kind: ObjectKind,
    /// Namespace, for namespaced kinds.
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
}

impl ObjectKey {
    /// A key from its parts.
    pub fn new(kind: ObjectKind, namespace: Option<&str>, name: &str) -> ObjectKey {
        ObjectKey {
            kind,
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
        }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {ns}/{}", self.kind, self.name),
            None => write!(f, "{} {}", self.kind, self.name),
        }
    }
}

/// Cluster-level facts that are not Kubernetes objects.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClusterInfo {
    /// `major.minor` of the member cluster's API server, e.g. `1.35`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes_version: Option<String>,
    /// Cluster labels (Karmada cluster affinity reads them).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    /// Karmada-style provider / region / zone, used by spread constraints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
}

/// One typed object of a member cluster.
#[derive(Debug, Clone)]
pub enum ClusterObject {
    /// A Node.
    Node(Arc<k8s::Node>),
    /// A Pod.
    Pod(Arc<k8s::Pod>),
    /// A ResourceSlice.
    ResourceSlice(Arc<k8s::ResourceSlice>),
    /// A DeviceClass.
    DeviceClass(Arc<k8s::DeviceClass>),
    /// A ResourceClaim.
    ResourceClaim(Arc<k8s::ResourceClaim>),
    /// A DeviceTaintRule.
    DeviceTaintRule(Arc<k8s::DeviceTaintRule>),
    /// The cluster's facts.
    ClusterInfo(Arc<ClusterInfo>),
    /// A ResourceClaimTemplate.
    ResourceClaimTemplate(Arc<k8s::ResourceClaimTemplate>),
    /// A Karpenter NodePool.
    NodePool(Arc<karpenter::NodePool>),
    /// A Karpenter NodeClaim.
    NodeClaim(Arc<karpenter::NodeClaim>),
}

fn meta_key(
    kind: ObjectKind,
    m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> ObjectKey {
    let ns = if kind.namespaced() {
        Some(m.namespace.clone().unwrap_or_else(|| "default".to_string()))
    } else {
        None
    };
    ObjectKey {
        kind,
        namespace: ns,
        name: m.name.clone().unwrap_or_default(),
    }
}

impl ClusterObject {
    /// The object's kind.
    pub fn kind(&self) -> ObjectKind {
        match self {
            ClusterObject::Node(_) => ObjectKind::Node,
            ClusterObject::Pod(_) => ObjectKind::Pod,
            ClusterObject::ResourceSlice(_) => ObjectKind::ResourceSlice,
            ClusterObject::DeviceClass(_) => ObjectKind::DeviceClass,
            ClusterObject::ResourceClaim(_) => ObjectKind::ResourceClaim,
            ClusterObject::DeviceTaintRule(_) => ObjectKind::DeviceTaintRule,
            ClusterObject::ClusterInfo(_) => ObjectKind::ClusterInfo,
            ClusterObject::ResourceClaimTemplate(_) => ObjectKind::ResourceClaimTemplate,
            ClusterObject::NodePool(_) => ObjectKind::NodePool,
            ClusterObject::NodeClaim(_) => ObjectKind::NodeClaim,
        }
    }

    /// The object's key.
    pub fn key(&self) -> ObjectKey {
        let kind = self.kind();
        match self {
            ClusterObject::Node(o) => meta_key(kind, &o.metadata),
            ClusterObject::Pod(o) => meta_key(kind, &o.metadata),
            ClusterObject::ResourceSlice(o) => meta_key(kind, &o.metadata),
            ClusterObject::DeviceClass(o) => meta_key(kind, &o.metadata),
            ClusterObject::ResourceClaim(o) => meta_key(kind, &o.metadata),
            ClusterObject::DeviceTaintRule(o) => meta_key(kind, &o.metadata),
            ClusterObject::ClusterInfo(_) => ObjectKey::new(kind, None, "cluster"),
            ClusterObject::ResourceClaimTemplate(o) => meta_key(kind, &o.metadata),
            ClusterObject::NodePool(o) => ObjectKey::new(kind, None, &o.metadata.name),
            ClusterObject::NodeClaim(o) => ObjectKey::new(kind, None, &o.metadata.name),
        }
    }

    /// Compact JSON, the form objects take inside replicated documents.
    pub fn to_json(&self) -> Vec<u8> {
        let r = match self {
            ClusterObject::Node(o) => serde_json::to_vec(&**o),
            ClusterObject::Pod(o) => serde_json::to_vec(&**o),
            ClusterObject::ResourceSlice(o) => serde_json::to_vec(&**o),
            ClusterObject::DeviceClass(o) => serde_json::to_vec(&**o),
            ClusterObject::ResourceClaim(o) => serde_json::to_vec(&**o),
            ClusterObject::DeviceTaintRule(o) => serde_json::to_vec(&**o),
            ClusterObject::ClusterInfo(o) => serde_json::to_vec(&**o),
            ClusterObject::ResourceClaimTemplate(o) => serde_json::to_vec(&**o),
            ClusterObject::NodePool(o) => serde_json::to_vec(&**o),
            ClusterObject::NodeClaim(o) => serde_json::to_vec(&**o),
        };
        // Serializing these plain data types to a Vec cannot fail.
        r.unwrap_or_default()
    }

    /// Decodes the JSON of an object of a known kind (the inverse of [`Self::to_json`]).
    pub fn from_json(
        kind: ObjectKind,
        json: &[u8],
    ) -> Result<ClusterObject, crate::load::FieldError> {
        use crate::load::decode_json;
        Ok(match kind {
            ObjectKind::Node => ClusterObject::Node(Arc::new(decode_json(json)?)),
            ObjectKind::Pod => ClusterObject::Pod(Arc::new(decode_json(json)?)),
            ObjectKind::ResourceSlice => ClusterObject::ResourceSlice(Arc::new(decode_json(json)?)),
            ObjectKind::DeviceClass => ClusterObject::DeviceClass(Arc::new(decode_json(json)?)),
            ObjectKind::ResourceClaim => ClusterObject::ResourceClaim(Arc::new(decode_json(json)?)),
            ObjectKind::DeviceTaintRule => {
                ClusterObject::DeviceTaintRule(Arc::new(decode_json(json)?))
            }
            ObjectKind::ClusterInfo => ClusterObject::ClusterInfo(Arc::new(decode_json(json)?)),
            ObjectKind::ResourceClaimTemplate => {
                ClusterObject::ResourceClaimTemplate(Arc::new(decode_json(json)?))
            }
            ObjectKind::NodePool => {
                ClusterObject::NodePool(Arc::new(crate::load::decode_karpenter(json_value(json)?)?))
            }
            ObjectKind::NodeClaim => ClusterObject::NodeClaim(Arc::new(
                crate::load::decode_karpenter(json_value(json)?)?,
            )),
        })
    }
}

fn json_value(json: &[u8]) -> Result<serde_json::Value, crate::load::FieldError> {
    serde_json::from_slice(json).map_err(|e| crate::load::FieldError {
        field: String::new(),
        message: format!("invalid JSON: {e}"),
    })
}

/// One change to one cluster's state, as carried from an agent to the views.
#[derive(Debug, Clone)]
pub enum ObjectChange {
    /// The object now has this value (compact JSON of the typed object).
    Upsert {
        /// The object's key.
        key: ObjectKey,
        /// Compact JSON of the typed object.
        json: Arc<[u8]>,
    },
    /// The object is gone.
    Delete {
        /// The object's key.
        key: ObjectKey,
    },
}

impl ObjectChange {
    /// The change that sets `obj`.
    pub fn upsert(obj: &ClusterObject) -> ObjectChange {
        ObjectChange::Upsert {
            key: obj.key(),
            json: obj.to_json().into(),
        }
    }

    /// The key the change is about.
    pub fn key(&self) -> &ObjectKey {
        match self {
            ObjectChange::Upsert { key, .. } | ObjectChange::Delete { key } => key,
        }
    }
}
