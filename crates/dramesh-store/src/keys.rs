//! Document key layout: the mapping between [`ObjectKey`] and the root-map key of a document.
//!
//! Every object is one root-map entry, so an update rewrites one scalar and nothing else:
//!
//! | kind              | key                      |
//! |-------------------|--------------------------|
//! | `Node`            | `node/<name>`            |
//! | `Pod`             | `pod/<ns>/<name>`        |
//! | `ResourceSlice`   | `slice/<name>`           |
//! | `ResourceClaim`   | `claim/<ns>/<name>`      |
//! | `DeviceClass`     | `class/<name>`           |
//! | `DeviceTaintRule` | `taintrule/<name>`       |
//! | `ClusterInfo`     | `meta/<name>` (`meta/cluster`) |
//!
//! Keys starting with `_` are reserved for the store itself ([`TERM_KEY`], [`REJOIN_KEY`]). Names and namespaces
//! must be non-empty and must not contain `/` (Kubernetes names never do), which makes the
//! mapping a bijection: [`parse_doc_key`] inverts [`doc_key`].

use crate::error::StoreError;
use crate::object::{ObjectKey, ObjectKind};

/// Root-map key holding the writer's lease term (`u64`), used to rank documents of one cluster
/// that hold the same key (cluster-scoped objects during a lease handover).
pub const TERM_KEY: &str = "_term";

/// Root-map key holding the generation (`u64`, the writer's clock in ms) at which the writer
/// last asked to rejoin the fleet (`dramesh agent --rejoin`, [`crate::Store::rejoin`]). It is
/// written into the base of that generation and carried into every later one like any value,
/// so an automatic rollover keeps it and never moves it: a document of a retired cluster is
/// accepted only when it is later than the retirement ([`crate::Store::retire_cluster`]).
pub const REJOIN_KEY: &str = "_rejoin";

fn prefix(kind: ObjectKind) -> &'static str {
    match kind {
        ObjectKind::Node => "node",
        ObjectKind::Pod => "pod",
        ObjectKind::ResourceSlice => "slice",
        ObjectKind::ResourceClaim => "claim",
        ObjectKind::DeviceClass => "class",
        ObjectKind::DeviceTaintRule => "taintrule",
        ObjectKind::ClusterInfo => "meta",
    }
}

fn kind_of_prefix(p: &str) -> Option<ObjectKind> {
    Some(match p {
        "node" => ObjectKind::Node,
        "pod" => ObjectKind::Pod,
        "slice" => ObjectKind::ResourceSlice,
        "claim" => ObjectKind::ResourceClaim,
        "class" => ObjectKind::DeviceClass,
        "taintrule" => ObjectKind::DeviceTaintRule,
        "meta" => ObjectKind::ClusterInfo,
        _ => return None,
    })
}

fn valid_segment(s: &str) -> bool {
    !s.is_empty() && !s.contains('/')
}

/// The document key for an object.
///
/// Fails when the name or namespace is empty or contains `/`, or when the namespace presence
/// does not match the kind (pods and claims are namespaced, everything else is not).
pub fn doc_key(key: &ObjectKey) -> Result<String, StoreError> {
    let bad = |reason: &str| StoreError::InvalidKey {
        key: format!("{key:?}"),
        reason: reason.to_string(),
    };
    if !valid_segment(&key.name) {
        return Err(bad("name must be non-empty and must not contain '/'"));
    }
    let p = prefix(key.kind);
    match (&key.namespace, key.kind.namespaced()) {
        (Some(ns), true) => {
            if !valid_segment(ns) {
                return Err(bad("namespace must be non-empty and must not contain '/'"));
            }
            Ok(format!("{p}/{ns}/{}", key.name))
        }
        (None, false) => Ok(format!("{p}/{}", key.name)),
        (None, true) => Err(bad("this kind is namespaced but no namespace was given")),
        (Some(_), false) => Err(bad("this kind is cluster-scoped but a namespace was given")),
    }
}

/// Inverse of [`doc_key`]; `None` for reserved keys and keys this version does not know
/// (a newer agent may publish kinds an older replica ignores).
pub fn parse_doc_key(s: &str) -> Option<ObjectKey> {
    let (p, rest) = s.split_once('/')?;
    let kind = kind_of_prefix(p)?;
    if kind.namespaced() {
        let (ns, name) = rest.split_once('/')?;
        if !valid_segment(ns) || !valid_segment(name) {
            return None;
        }
        Some(ObjectKey {
            kind,
            namespace: Some(ns.to_string()),
            name: name.to_string(),
        })
    } else {
        if !valid_segment(rest) {
            return None;
        }
        Some(ObjectKey {
            kind,
            namespace: None,
            name: rest.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(kind: ObjectKind, ns: Option<&str>, name: &str) -> ObjectKey {
        ObjectKey {
            kind,
            namespace: ns.map(str::to_string),
            name: name.to_string(),
        }
    }

    #[test]
    fn round_trip_every_kind() {
        let keys = [
            k(ObjectKind::Node, None, "n1"),
            k(ObjectKind::Pod, Some("default"), "p"),
            k(ObjectKind::ResourceSlice, None, "s"),
            k(ObjectKind::ResourceClaim, Some("ns"), "c"),
            k(ObjectKind::DeviceClass, None, "gpu.example.com"),
            k(ObjectKind::DeviceTaintRule, None, "r"),
            k(ObjectKind::ClusterInfo, None, "cluster"),
        ];
        for key in keys {
            let s = doc_key(&key).unwrap();
            assert_eq!(parse_doc_key(&s), Some(key));
        }
        assert_eq!(
            doc_key(&k(ObjectKind::Pod, Some("a"), "b")).unwrap(),
            "pod/a/b"
        );
        assert_eq!(
            doc_key(&k(ObjectKind::ClusterInfo, None, "cluster")).unwrap(),
            "meta/cluster"
        );
    }

    #[test]
    fn rejects_bad_keys() {
        assert!(doc_key(&k(ObjectKind::Node, None, "a/b")).is_err());
        assert!(doc_key(&k(ObjectKind::Node, None, "")).is_err());
        assert!(doc_key(&k(ObjectKind::Pod, None, "p")).is_err());
        assert!(doc_key(&k(ObjectKind::Node, Some("ns"), "n")).is_err());
        assert_eq!(parse_doc_key(TERM_KEY), None);
        assert_eq!(parse_doc_key("node/a/b"), None);
        assert_eq!(parse_doc_key("pod/x"), None);
        assert_eq!(parse_doc_key("widget/x"), None);
    }
}
