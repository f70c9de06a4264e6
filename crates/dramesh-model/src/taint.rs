//! Kubernetes taint toleration, implemented once: `k8s.io/api/core/v1`
//! `Toleration.ToleratesTaint`, which DRA's device tolerations repeat field for field
//! (`resourceclaim.ToleratesTaint`). The estimator's node filter, the API's table backend and
//! the engine's device taints all match through [`fields_tolerate`].
//!
//! The rule, field by field:
//! - an empty or absent `effect` matches every effect, else it must equal the taint's;
//! - an empty or absent `key` matches every key, else it must equal the taint's;
//! - operator `Exists` matches any value; `Equal` or an empty operator needs the values to be
//!   equal (absent reads as empty); any other operator matches nothing.
//!
//! API validation only admits an empty key with `Exists`; this module does not validate, it
//! answers as Kubernetes' matcher does for whatever it is given.

use crate::k8s::{Taint, Toleration};

/// The toleration fields the rule reads, borrowed from a node or a device toleration.
#[derive(Debug, Clone, Copy, Default)]
pub struct TolerationFields<'a> {
    /// `key`; absent or empty matches every key.
    pub key: Option<&'a str>,
    /// `operator`: `Exists`, `Equal` or absent (`Equal`).
    pub operator: Option<&'a str>,
    /// `value`, compared under `Equal`; absent reads as empty.
    pub value: Option<&'a str>,
    /// `effect`; absent or empty matches every effect.
    pub effect: Option<&'a str>,
}

/// Whether a toleration with fields `tol` tolerates the taint `key=value:effect`.
pub fn fields_tolerate(tol: TolerationFields<'_>, key: &str, value: &str, effect: &str) -> bool {
    if tol.effect.is_some_and(|e| !e.is_empty() && e != effect) {
        return false;
    }
    if tol.key.is_some_and(|k| !k.is_empty() && k != key) {
        return false;
    }
    match tol.operator.unwrap_or("") {
        "" | "Equal" => tol.value.unwrap_or("") == value,
        "Exists" => true,
        _ => false,
    }
}

/// Whether `tol` tolerates `taint` (`Toleration.ToleratesTaint`).
pub fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    let fields = TolerationFields {
        key: tol.key.as_deref(),
        operator: tol.operator.as_deref(),
        value: tol.value.as_deref(),
        effect: tol.effect.as_deref(),
    };
    fields_tolerate(
        fields,
        &taint.key,
        taint.value.as_deref().unwrap_or(""),
        &taint.effect,
    )
}

/// Whether any of `tolerations` tolerates `taint`.
pub fn tolerated(tolerations: &[Toleration], taint: &Taint) -> bool {
    tolerations.iter().any(|t| tolerates(t, taint))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(str::to_string),
            effect: effect.into(),
            ..Default::default()
        }
    }

    fn tol(
        key: Option<&str>,
        op: Option<&str>,
        value: Option<&str>,
        effect: Option<&str>,
    ) -> Toleration {
        Toleration {
            key: key.map(str::to_string),
            operator: op.map(str::to_string),
            value: value.map(str::to_string),
            effect: effect.map(str::to_string),
            ..Default::default()
        }
    }

    /// The cases of `Toleration.ToleratesTaint` (k8s.io/api core/v1), one row each.
    #[test]
    fn pins_kubernetes_tolerates_taint() {
        let gpu = taint("gpu", Some("h100"), "NoSchedule");
        let cases: &[(Toleration, &Taint, bool, &str)] = &[
            (
                tol(Some("gpu"), Some("Equal"), Some("h100"), None),
                &gpu,
                true,
                "Equal, same value",
            ),
            (
                tol(Some("gpu"), None, Some("h100"), None),
                &gpu,
                true,
                "no operator means Equal",
            ),
            (
                tol(Some("gpu"), Some(""), Some("h100"), None),
                &gpu,
                true,
                "empty operator means Equal",
            ),
            (
                tol(Some("gpu"), Some("Equal"), Some("a100"), None),
                &gpu,
                false,
                "Equal, other value",
            ),
            (
                tol(Some("gpu"), Some("Equal"), None, None),
                &gpu,
                false,
                "Equal, no value vs a value",
            ),
            (
                tol(Some("gpu"), Some("Exists"), None, None),
                &gpu,
                true,
                "Exists ignores the value",
            ),
            (
                tol(Some("cpu"), Some("Exists"), None, None),
                &gpu,
                false,
                "other key",
            ),
            (
                tol(None, Some("Exists"), None, None),
                &gpu,
                true,
                "no key with Exists matches all",
            ),
            (
                tol(Some(""), Some("Exists"), None, None),
                &gpu,
                true,
                "empty key with Exists matches all",
            ),
            (
                tol(None, Some("Equal"), Some("h100"), None),
                &gpu,
                true,
                "empty key, Equal compares values",
            ),
            (
                tol(None, Some("Equal"), None, None),
                &gpu,
                false,
                "empty key, Equal, other value",
            ),
            (
                tol(Some("gpu"), Some("Exists"), None, Some("")),
                &gpu,
                true,
                "empty effect matches all",
            ),
            (
                tol(Some("gpu"), Some("Exists"), None, Some("NoSchedule")),
                &gpu,
                true,
                "same effect",
            ),
            (
                tol(Some("gpu"), Some("Exists"), None, Some("NoExecute")),
                &gpu,
                false,
                "other effect",
            ),
            (
                tol(Some("gpu"), Some("Exists"), None, Some("PreferNoSchedule")),
                &gpu,
                false,
                "Prefer is another effect",
            ),
            (
                tol(Some("gpu"), Some("Gt"), Some("1"), None),
                &gpu,
                false,
                "unknown operator",
            ),
            (
                tol(Some("gpu"), Some("exists"), None, None),
                &gpu,
                false,
                "operators are case-sensitive",
            ),
        ];
        for (t, taint, want, why) in cases {
            assert_eq!(tolerates(t, taint), *want, "{why}: {t:?}");
        }
        for effect in ["NoSchedule", "PreferNoSchedule", "NoExecute"] {
            let t = taint("k", None, effect);
            assert!(
                tolerates(&tol(None, Some("Exists"), None, None), &t),
                "{effect}"
            );
            assert!(
                tolerates(&tol(Some("k"), None, None, Some(effect)), &t),
                "{effect}"
            );
            assert!(
                tolerates(&tol(Some("k"), None, Some(""), None), &t),
                "{effect}: empty == absent value"
            );
        }
        assert!(tolerated(
            &[
                tol(Some("x"), None, None, None),
                tol(Some("gpu"), Some("Exists"), None, None)
            ],
            &gpu
        ));
        assert!(!tolerated(&[], &gpu));
    }
}
