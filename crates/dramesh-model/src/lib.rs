//! The data model of dramesh: Kubernetes DRA (`resource.k8s.io/v1`) and core types, exact
//! quantities and semantic versions, manifest loading with precise errors, and the typed
//! objects and changes that flow from member clusters to the views.
//!
//! This crate is pure: no I/O beyond reading manifest files in [`load`].

pub mod attr;
pub mod depth;
pub mod k8s;
pub mod karpenter;
pub mod load;
pub mod nodesel;
pub mod object;
pub mod owner;
pub mod quantity;
pub mod semver;
pub mod taint;

pub use attr::{AttrValue, QualifiedName};
pub use load::{LoadError, Loaded, Manifest, Source};
pub use object::{ClusterInfo, ClusterObject, ObjectChange, ObjectKey, ObjectKind};
pub use quantity::Quantity;
pub use semver::Semver;
