//! Device attribute values and qualified names, in the form the allocator and CEL use.

use std::fmt;
use std::sync::Arc;

use crate::semver::Semver;

/// A DRA attribute value (`int`, `bool`, `string` or `version`). List-typed attributes
/// (KEP-5491) are alpha and off by default, so they are not represented.
#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    /// `int`.
    Int(i64),
    /// `bool`.
    Bool(bool),
    /// `string`.
    String(Arc<str>),
    /// `version` (semver 2.0.0).
    Version(Arc<Semver>),
}

impl AttrValue {
    /// Converts the v1 API form; `None` when no single-valued field is set (for example a
    /// list-typed attribute, which this API level does not support).
    pub fn from_k8s(
        a: &k8s_openapi::api::resource::v1::DeviceAttribute,
    ) -> Result<AttrValue, String> {
        let set = [
            a.int.is_some(),
            a.bool.is_some(),
            a.string.is_some(),
            a.version.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if set != 1 {
            return Err(
                if a.ints.is_some()
                    || a.bools.is_some()
                    || a.strings.is_some()
                    || a.versions.is_some()
                {
                    "list-typed attributes (DRAListTypeAttributes) are not enabled".to_string()
                } else {
                    "exactly one of int, bool, string, version must be set".to_string()
                },
            );
        }
        if let Some(i) = a.int {
            return Ok(AttrValue::Int(i));
        }
        if let Some(b) = a.bool {
            return Ok(AttrValue::Bool(b));
        }
        if let Some(s) = &a.string {
            return Ok(AttrValue::String(s.as_str().into()));
        }
        match &a.version {
            Some(v) => Semver::parse(v)
                .map(|s| AttrValue::Version(Arc::new(s)))
                .map_err(|e| e.to_string()),
            None => Err("exactly one of int, bool, string, version must be set".to_string()),
        }
    }
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::Int(i) => write!(f, "{i}"),
            AttrValue::Bool(b) => write!(f, "{b}"),
            AttrValue::String(s) => f.write_str(s),
            AttrValue::Version(v) => write!(f, "{v}"),
        }
    }
}

/// A fully qualified attribute or capacity name split into domain and identifier.
/// Unqualified names belong to the driver's domain.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QualifiedName {
    /// The domain (the driver's name for unqualified names).
    pub domain: Arc<str>,
    /// The identifier within the domain.
    pub id: Arc<str>,
}

impl QualifiedName {
    /// Splits `domain/id`; a name without `/` is placed in `driver`'s domain.
    pub fn parse(name: &str, driver: &str) -> QualifiedName {
        match name.split_once('/') {
            Some((d, id)) => QualifiedName {
                domain: d.into(),
                id: id.into(),
            },
            None => QualifiedName {
                domain: driver.into(),
                id: name.into(),
            },
        }
    }
}

impl fmt::Display for QualifiedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.domain, self.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qualified_names() {
        let q = QualifiedName::parse("resource.kubernetes.io/pcieRoot", "gpu.nvidia.com");
        assert_eq!((&*q.domain, &*q.id), ("resource.kubernetes.io", "pcieRoot"));
        let u = QualifiedName::parse("model", "gpu.nvidia.com");
        assert_eq!((&*u.domain, &*u.id), ("gpu.nvidia.com", "model"));
    }

    #[test]
    fn attribute_conversion() {
        let mut a = k8s_openapi::api::resource::v1::DeviceAttribute {
            version: Some("1.2.3".into()),
            ..Default::default()
        };
        assert!(matches!(AttrValue::from_k8s(&a), Ok(AttrValue::Version(_))));
        a.int = Some(3);
        assert!(AttrValue::from_k8s(&a).is_err(), "two values set");
        let l = k8s_openapi::api::resource::v1::DeviceAttribute {
            strings: Some(vec!["a".into()]),
            ..Default::default()
        };
        assert!(AttrValue::from_k8s(&l).unwrap_err().contains("list-typed"));
    }
}
