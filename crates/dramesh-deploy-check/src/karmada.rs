//! Karmada objects (PropagationPolicy, ClusterPropagationPolicy) checked against Karmada's own
//! CRD schemas from `shared/fixtures/karmada/crds`, with the structural-schema validator the
//! fake Karmada API server runs on every write (`dramesh_fakeapi::schema`): types, enums,
//! required fields, patterns, defaults, and unknown fields as errors (the API server would
//! prune them silently). `metadata` is decoded strictly as an `ObjectMeta`.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use dramesh_fakeapi::schema::{Crd, load_crd};
use dramesh_model::load::{FieldError, decode_value};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

/// The Karmada `(apiVersion, kind)` pairs checked here, with their CRD manifest.
pub const KARMADA_KINDS: [(&str, &str, &str); 2] = [
    (
        "policy.karmada.io/v1alpha1",
        "PropagationPolicy",
        "policy.karmada.io_propagationpolicies.yaml",
    ),
    (
        "policy.karmada.io/v1alpha1",
        "ClusterPropagationPolicy",
        "policy.karmada.io_clusterpropagationpolicies.yaml",
    ),
];

/// Whether the CRD manifests are there (`shared/fixtures/karmada/crds` beside the repository);
/// without them Karmada objects cannot be checked and [`validate`] fails.
pub fn crds_available() -> bool {
    dramesh_fakeapi::karmada_crds_dir().is_some()
}

/// The compiled CRDs by file, or why they are not available.
fn crds() -> &'static Result<BTreeMap<&'static str, Crd>, String> {
    static CRDS: OnceLock<Result<BTreeMap<&'static str, Crd>, String>> = OnceLock::new();
    CRDS.get_or_init(|| {
        let dir = dramesh_fakeapi::karmada_crds_dir().ok_or_else(|| {
            "Karmada's CRD manifests (shared/fixtures/karmada/crds beside the repository) are absent: cannot check Karmada objects".to_string()
        })?;
        let mut out = BTreeMap::new();
        for (api_version, _, file) in KARMADA_KINDS {
            let version = api_version.split('/').nth(1).unwrap_or_default();
            out.insert(file, load_crd(&dir.join(file), version)?);
        }
        Ok(out)
    })
}

/// Checks `value` if `(api_version, kind)` is one of [`KARMADA_KINDS`]: the object as the API
/// server would store it (defaults filled), or the first field at fault. `None` for other kinds.
pub fn validate(api_version: &str, kind: &str, value: &Value) -> Option<Result<Value, FieldError>> {
    let (_, _, file) = KARMADA_KINDS
        .iter()
        .find(|(v, k, _)| *v == api_version && *k == kind)?;
    Some(validate_with(file, value))
}

fn validate_with(file: &str, value: &Value) -> Result<Value, FieldError> {
    let crds = crds().as_ref().map_err(|message| FieldError {
        field: String::new(),
        message: message.clone(),
    })?;
    let crd = crds.get(file).ok_or_else(|| FieldError {
        field: String::new(),
        message: format!("{file} was not loaded"),
    })?;
    decode_value::<ObjectMeta>(value.get("metadata").cloned().unwrap_or(Value::Null)).map_err(
        |e| FieldError {
            field: if e.field.is_empty() {
                "metadata".into()
            } else {
                format!("metadata.{}", e.field)
            },
            message: e.message,
        },
    )?;
    let mut stored = value.clone();
    let causes = crd.schema.validate_root(&mut stored);
    match causes.first() {
        None => Ok(stored),
        Some(c) => Err(FieldError {
            field: c.field.clone(),
            message: if causes.len() > 1 {
                format!("{} ({} more problems)", c.message, causes.len() - 1)
            } else {
                c.message.clone()
            },
        }),
    }
}
