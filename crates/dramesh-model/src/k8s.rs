//! The Kubernetes API types dramesh reads, re-exported from `k8s-openapi` (API level 1.36).

pub use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
pub use k8s_openapi::api::batch::v1::Job;
pub use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSpec, PodTemplateSpec,
    Taint, Toleration,
};
pub use k8s_openapi::api::resource::v1::*;
/// `DeviceTaintRule` is served as v1beta2 (and v1alpha3) in 1.36; both have this shape.
pub use k8s_openapi::api::resource::v1beta2::DeviceTaintRule;
pub use k8s_openapi::api::scheduling::v1::PriorityClass;
pub use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
