//! Reading Kubernetes manifests: multi-document YAML, `kind: List`, JSON files and directories.
//!
//! Every document is decoded into the typed `k8s-openapi` object for its `apiVersion`/`kind`.
//! Decoding is strict: a field the type does not know is an error, as it is for the API server
//! with strict field validation, so a v1beta1-shaped object labelled v1 is caught here and not
//! silently mis-read. Every error names the file, the document index (and list item), the object
//! and the field path.

// LoadError is large (file, indices, object, field) by design; it is built only on failure.
#![allow(clippy::result_large_err)]

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::depth;
use crate::k8s;
use crate::object::{ClusterInfo, ClusterObject};

/// Largest manifest file read, so a stray huge file cannot exhaust memory.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// Where a document came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The file.
    pub file: PathBuf,
    /// 0-based index of the YAML document in the file.
    pub document: usize,
    /// 0-based index in `items` when the document is a `kind: List`.
    pub item: Option<usize>,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} document {}", self.file.display(), self.document)?;
        if let Some(i) = self.item {
            write!(f, " item {i}")?;
        }
        Ok(())
    }
}

/// A decoded manifest.
#[derive(Debug, Clone)]
pub enum Manifest {
    /// State published by a member cluster.
    Object(ClusterObject),
    /// A ResourceClaimTemplate.
    ResourceClaimTemplate(Arc<k8s::ResourceClaimTemplate>),
    /// A Deployment.
    Deployment(Arc<k8s::Deployment>),
    /// A StatefulSet.
    StatefulSet(Arc<k8s::StatefulSet>),
    /// A Job.
    Job(Arc<k8s::Job>),
    /// A PriorityClass.
    PriorityClass(Arc<k8s::PriorityClass>),
    /// Any other kind (for example a Karmada PropagationPolicy), left as JSON for its reader.
    Other {
        /// `apiVersion`.
        api_version: String,
        /// `kind`.
        kind: String,
        /// The whole document.
        value: Value,
    },
}

impl Manifest {
    /// The manifest's kind.
    pub fn kind(&self) -> &str {
        match self {
            Manifest::Object(o) => o.kind().as_str(),
            Manifest::ResourceClaimTemplate(_) => "ResourceClaimTemplate",
            Manifest::Deployment(_) => "Deployment",
            Manifest::StatefulSet(_) => "StatefulSet",
            Manifest::Job(_) => "Job",
            Manifest::PriorityClass(_) => "PriorityClass",
            Manifest::Other { kind, .. } => kind,
        }
    }
}

/// A decoded manifest and where it came from.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// Where it came from.
    pub source: Source,
    /// The manifest.
    pub manifest: Manifest,
}

/// A decoding failure inside one value: the JSON path of the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted path such as `spec.devices.requests[0].exactly`; empty for the whole object.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "field {}: {}", self.field, self.message)
        }
    }
}

impl std::error::Error for FieldError {}

/// A manifest that could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    /// The file.
    pub file: PathBuf,
    /// 0-based YAML document index, when the error is inside one.
    pub document: Option<usize>,
    /// 0-based index in a `kind: List`, when the error is inside one.
    pub item: Option<usize>,
    /// `Kind name` (or `Kind ns/name`) when known.
    pub object: Option<String>,
    /// JSON path of the field at fault, when known.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(d) = self.document {
            write!(f, ": document {d}")?;
        }
        if let Some(i) = self.item {
            write!(f, " item {i}")?;
        }
        if let Some(o) = &self.object {
            write!(f, " ({o})")?;
        }
        if let Some(field) = &self.field {
            write!(f, ": field {field}")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for LoadError {}

impl LoadError {
    /// An error about a whole file (no document, object or field).
    pub fn file(file: &Path, message: impl Into<String>) -> LoadError {
        LoadError {
            file: file.to_path_buf(),
            document: None,
            item: None,
            object: None,
            field: None,
            message: message.into(),
        }
    }
}

/// Decodes JSON bytes into a typed value, strictly (unknown fields are errors).
pub fn decode_json<T: DeserializeOwned + serde::Serialize>(json: &[u8]) -> Result<T, FieldError> {
    let value: Value = serde_json::from_slice(json).map_err(|e| FieldError {
        field: String::new(),
        message: format!("invalid JSON: {e}"),
    })?;
    decode_value(value)
}

/// Decodes a JSON value into a typed value, strictly (unknown fields are errors).
pub fn decode_value<T: DeserializeOwned + serde::Serialize>(value: Value) -> Result<T, FieldError> {
    let typed: T = serde_path_to_error::deserialize(&value).map_err(|e| FieldError {
        field: clean_path(&e.path().to_string()),
        message: e.inner().to_string(),
    })?;
    let back = serde_json::to_value(&typed).map_err(|e| FieldError {
        field: String::new(),
        message: format!("cannot re-encode: {e}"),
    })?;
    if let Some(field) = unknown_field(&value, &back, String::new()) {
        return Err(FieldError {
            field,
            message: "unknown field".to_string(),
        });
    }
    Ok(typed)
}

fn clean_path(p: &str) -> String {
    if p == "." {
        String::new()
    } else {
        p.to_string()
    }
}

/// The first path present in `orig` but dropped by the typed round trip.
fn unknown_field(orig: &Value, back: &Value, path: String) -> Option<String> {
    match (orig, back) {
        (Value::Object(o), Value::Object(b)) => {
            for (k, v) in o {
                if v.is_null() {
                    continue;
                }
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                match b.get(k) {
                    None => return Some(p),
                    Some(bv) => {
                        if let Some(found) = unknown_field(v, bv, p) {
                            return Some(found);
                        }
                    }
                }
            }
            None
        }
        (Value::Array(o), Value::Array(b)) => o
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (v, bv))| unknown_field(v, bv, format!("{path}[{i}]"))),
        _ => None,
    }
}

fn str_field<'a>(v: &'a Value, name: &str) -> Option<&'a str> {
    v.get(name).and_then(Value::as_str)
}

fn object_label(kind: &str, v: &Value) -> String {
    let meta = v.get("metadata");
    let name = meta
        .and_then(|m| str_field(m, "name"))
        .unwrap_or("<unnamed>");
    match meta.and_then(|m| str_field(m, "namespace")) {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}

/// Decodes one document (already parsed to JSON) into a manifest.
pub fn decode_manifest(value: Value) -> Result<Manifest, (Option<String>, FieldError)> {
    let api_version = str_field(&value, "apiVersion")
        .unwrap_or_default()
        .to_string();
    let kind = str_field(&value, "kind").unwrap_or_default().to_string();
    if kind.is_empty() {
        return Err((
            None,
            FieldError {
                field: "kind".into(),
                message: "missing".into(),
            },
        ));
    }
    let label = object_label(&kind, &value);
    let wrong_version = |want: &str| {
        Err((
            Some(label.clone()),
            FieldError {
                field: "apiVersion".into(),
                message: format!("{kind} must be {want}, got {api_version:?}"),
            },
        ))
    };
    let typed = |r: Result<Manifest, FieldError>| r.map_err(|e| (Some(label.clone()), e));
    let resource_v1 = api_version == "resource.k8s.io/v1";
    match kind.as_str() {
        "ResourceSlice" | "DeviceClass" | "ResourceClaim" | "ResourceClaimTemplate"
            if !resource_v1 =>
        {
            wrong_version("resource.k8s.io/v1 (convert older DRA API versions first)")
        }
        "ResourceSlice" => typed(
            decode_value(value)
                .map(|o| Manifest::Object(ClusterObject::ResourceSlice(Arc::new(o)))),
        ),
        "DeviceClass" => typed(
            decode_value(value).map(|o| Manifest::Object(ClusterObject::DeviceClass(Arc::new(o)))),
        ),
        "ResourceClaim" => {
            let mut value = value;
            fill_unset_condition_times(&mut value);
            typed(
                decode_value(value)
                    .map(|o| Manifest::Object(ClusterObject::ResourceClaim(Arc::new(o)))),
            )
        }
        "ResourceClaimTemplate" => {
            typed(decode_value(value).map(|o| Manifest::ResourceClaimTemplate(Arc::new(o))))
        }
        "DeviceTaintRule" => {
            if !matches!(
                api_version.as_str(),
                "resource.k8s.io/v1beta2" | "resource.k8s.io/v1alpha3" | "resource.k8s.io/v1"
            ) {
                return wrong_version("resource.k8s.io/v1beta2 or v1alpha3");
            }
            // k8s-openapi's type carries a fixed apiVersion; the shapes are the same.
            let mut value = value;
            value["apiVersion"] = Value::String("resource.k8s.io/v1beta2".into());
            typed(
                decode_value(value)
                    .map(|o| Manifest::Object(ClusterObject::DeviceTaintRule(Arc::new(o)))),
            )
        }
        "Node" | "Pod" if api_version != "v1" => wrong_version("v1"),
        "Node" => {
            typed(decode_value(value).map(|o| Manifest::Object(ClusterObject::Node(Arc::new(o)))))
        }
        "Pod" => {
            typed(decode_value(value).map(|o| Manifest::Object(ClusterObject::Pod(Arc::new(o)))))
        }
        "Deployment" | "StatefulSet" if api_version != "apps/v1" => wrong_version("apps/v1"),
        "Deployment" => typed(decode_value(value).map(|o| Manifest::Deployment(Arc::new(o)))),
        "StatefulSet" => typed(decode_value(value).map(|o| Manifest::StatefulSet(Arc::new(o)))),
        "Job" if api_version != "batch/v1" => wrong_version("batch/v1"),
        "Job" => typed(decode_value(value).map(|o| Manifest::Job(Arc::new(o)))),
        "PriorityClass" if api_version != "scheduling.k8s.io/v1" => {
            wrong_version("scheduling.k8s.io/v1")
        }
        "PriorityClass" => typed(decode_value(value).map(|o| Manifest::PriorityClass(Arc::new(o)))),
        "ClusterInfo" => {
            let spec = value
                .get("spec")
                .cloned()
                .unwrap_or(Value::Object(Default::default()));
            typed(
                decode_value::<ClusterInfo>(spec)
                    .map(|o| Manifest::Object(ClusterObject::ClusterInfo(Arc::new(o))))
                    .map_err(|e| FieldError {
                        field: prefixed("spec", &e.field),
                        message: e.message,
                    }),
            )
        }
        _ => Ok(Manifest::Other {
            api_version,
            kind,
            value,
        }),
    }
}

/// Stands for an unset condition time: Go's zero `metav1.Time` is written as null or left out.
const UNSET_TIME: &str = "1970-01-01T00:00:00Z";

/// A driver may publish `status.devices[].conditions[]` without `lastTransitionTime`; the API
/// server stores and returns them so (kubectl reads them), while k8s-openapi requires the field.
/// Only that field is filled in; everything else in a condition stays strict.
fn fill_unset_condition_times(claim: &mut Value) {
    let Some(Value::Array(devices)) = claim.pointer_mut("/status/devices") else {
        return;
    };
    for device in devices {
        let Some(Value::Array(conditions)) = device.get_mut("conditions") else {
            continue;
        };
        for c in conditions {
            if let Value::Object(c) = c
                && c.get("lastTransitionTime").is_none_or(Value::is_null)
            {
                c.insert(
                    "lastTransitionTime".into(),
                    Value::String(UNSET_TIME.into()),
                );
            }
        }
    }
}

fn prefixed(prefix: &str, field: &str) -> String {
    if field.is_empty() {
        prefix.to_string()
    } else {
        format!("{prefix}.{field}")
    }
}

/// Reads manifests from a string; `file` is used in errors and sources only.
///
/// Text nested deeper than [`depth::MAX_DEPTH`] is refused before it is parsed, so a hostile
/// file fails in time linear in its size (see [`depth`]).
pub fn load_str(file: &Path, text: &str) -> Result<Vec<Loaded>, LoadError> {
    depth::check_depth(text, depth::MAX_DEPTH).map_err(|e| LoadError::file(file, e.to_string()))?;
    let is_json = file.extension().is_some_and(|e| e == "json");
    let docs: Vec<Value> = if is_json {
        let mut out = Vec::new();
        for v in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
            out.push(v.map_err(|e| LoadError::file(file, format!("invalid JSON: {e}")))?);
        }
        out
    } else {
        let mut out = Vec::new();
        for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
            let v = <Value as serde::Deserialize>::deserialize(doc).map_err(|e| LoadError {
                document: Some(i),
                ..LoadError::file(file, format!("invalid YAML: {e}"))
            })?;
            out.push(v);
        }
        out
    };
    let mut loaded = Vec::new();
    for (d, doc) in docs.into_iter().enumerate() {
        if doc.is_null() {
            continue; // empty document, e.g. only comments
        }
        if !doc.is_object() {
            return Err(LoadError {
                document: Some(d),
                ..LoadError::file(
                    file,
                    "document is not a mapping (expected a Kubernetes object)",
                )
            });
        }
        let is_list = str_field(&doc, "kind").is_some_and(|k| k == "List" || k.ends_with("List"))
            && doc.get("items").is_some();
        let items: Vec<(Option<usize>, Value)> = if is_list {
            match doc.get("items") {
                Some(Value::Array(items)) => items
                    .iter()
                    .cloned()
                    .enumerate()
                    .map(|(i, v)| (Some(i), v))
                    .collect(),
                _ => {
                    return Err(LoadError {
                        document: Some(d),
                        field: Some("items".into()),
                        ..LoadError::file(file, "a List must have an items array")
                    });
                }
            }
        } else {
            vec![(None, doc)]
        };
        for (item, value) in items {
            let source = Source {
                file: file.to_path_buf(),
                document: d,
                item,
            };
            match decode_manifest(value) {
                Ok(manifest) => loaded.push(Loaded { source, manifest }),
                Err((object, e)) => {
                    return Err(LoadError {
                        file: file.to_path_buf(),
                        document: Some(d),
                        item,
                        object,
                        field: (!e.field.is_empty()).then_some(e.field),
                        message: e.message,
                    });
                }
            }
        }
    }
    Ok(loaded)
}

/// Reads one file or, recursively, every `.yaml`, `.yml` and `.json` file of a directory in
/// name order.
pub fn load_path(path: &Path) -> Result<Vec<Loaded>, LoadError> {
    let meta =
        std::fs::metadata(path).map_err(|e| LoadError::file(path, format!("cannot read: {e}")))?;
    if meta.is_dir() {
        let mut out = Vec::new();
        for file in manifest_files(path)? {
            out.extend(load_path(&file)?);
        }
        return Ok(out);
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(LoadError::file(
            path,
            format!(
                "file is {} bytes, over the {} byte limit",
                meta.len(),
                MAX_FILE_BYTES
            ),
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| LoadError::file(path, format!("cannot read: {e}")))?;
    load_str(path, &text)
}

/// Reads several paths in order.
pub fn load_paths<P: AsRef<Path>>(paths: &[P]) -> Result<Vec<Loaded>, LoadError> {
    let mut out = Vec::new();
    for p in paths {
        out.extend(load_path(p.as_ref())?);
    }
    Ok(out)
}

/// The manifest files below a directory, sorted by path.
pub fn manifest_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries =
            std::fs::read_dir(&d).map_err(|e| LoadError::file(&d, format!("cannot list: {e}")))?;
        for entry in entries {
            let entry = entry.map_err(|e| LoadError::file(&d, format!("cannot list: {e}")))?;
            let p = entry.path();
            let ft = entry
                .file_type()
                .map_err(|e| LoadError::file(&p, e.to_string()))?;
            if ft.is_dir() {
                stack.push(p);
            } else if p
                .extension()
                .is_some_and(|e| e == "yaml" || e == "yml" || e == "json")
            {
                files.push(p);
            }
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Vec<Loaded>, LoadError> {
        load_str(Path::new("t.yaml"), text)
    }

    const CLASS: &str = "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: gpu\nspec:\n  selectors:\n  - cel:\n      expression: device.driver == \"gpu.example.com\"\n";

    #[test]
    fn deep_nesting_is_refused_naming_file_and_limit() {
        let n = 100_000;
        let flow = format!("a: {}", "[".repeat(n));
        let block: String = (0..2_000)
            .map(|i| format!("{}k:\n", " ".repeat(i)))
            .collect();
        let dashes = format!("a:\n{}x\n", "- ".repeat(n));
        let json = format!("{}{}", "{\"a\":".repeat(n), "}".repeat(n));
        for (file, text) in [
            ("flow.yaml", flow),
            ("block.yaml", block),
            ("dashes.yaml", dashes),
            ("deep.json", json),
        ] {
            let e = load_str(Path::new(file), &text).unwrap_err().to_string();
            assert!(
                e.starts_with(file)
                    && e.contains(&format!("nesting deeper than {} levels", depth::MAX_DEPTH)),
                "{file}: {e}"
            );
        }
    }

    #[test]
    fn multi_document_and_list() {
        let text = format!(
            "{CLASS}---\n# only a comment\n---\napiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  metadata:\n    name: n1\n"
        );
        let got = load(&text).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].manifest.kind(), "DeviceClass");
        assert_eq!(got[1].manifest.kind(), "Node");
        assert_eq!(got[1].source.document, 2);
        assert_eq!(got[1].source.item, Some(0));
    }

    #[test]
    fn json_file() {
        let json =
            r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1","labels":{"a":"b"}}}"#;
        let got = load_str(Path::new("x.json"), json).unwrap();
        let Manifest::Object(ClusterObject::Node(n)) = &got[0].manifest else {
            panic!()
        };
        assert_eq!(n.metadata.name.as_deref(), Some("n1"));
    }

    #[test]
    fn unknown_field_is_named() {
        let text = "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: c\n  namespace: ns\nspec:\n  devices:\n    requests:\n    - name: gpu\n      deviceClassName: gpu\n";
        let e = load(text).unwrap_err();
        assert_eq!(e.document, Some(0));
        assert_eq!(e.object.as_deref(), Some("ResourceClaim ns/c"));
        assert_eq!(
            e.field.as_deref(),
            Some("spec.devices.requests[0].deviceClassName")
        );
        assert!(e.to_string().contains("t.yaml: document 0 (ResourceClaim ns/c): field spec.devices.requests[0].deviceClassName: unknown field"), "{e}");
    }

    #[test]
    fn wrong_type_is_named() {
        let text = "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata:\n  name: s\nspec:\n  driver: d\n  nodeName: n\n  pool:\n    name: p\n    generation: lots\n    resourceSliceCount: 1\n";
        let e = load(text).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("spec.pool.generation"), "{e}");
    }

    #[test]
    fn old_api_version_is_rejected() {
        let e = load(&CLASS.replace("resource.k8s.io/v1", "resource.k8s.io/v1beta1")).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("apiVersion"));
    }

    #[test]
    fn bad_yaml_names_document() {
        let e = load(&format!("{CLASS}---\nkey: [unclosed\n")).unwrap_err();
        assert!(e.message.contains("invalid YAML"), "{e}");
        assert_eq!(e.document, Some(1));
    }

    #[test]
    fn other_kinds_pass_through() {
        let got = load("apiVersion: policy.karmada.io/v1alpha1\nkind: PropagationPolicy\nmetadata:\n  name: p\n").unwrap();
        assert!(
            matches!(&got[0].manifest, Manifest::Other { kind, .. } if kind == "PropagationPolicy")
        );
    }

    #[test]
    fn object_json_round_trip() {
        let got = load(CLASS).unwrap();
        let Manifest::Object(obj) = &got[0].manifest else {
            panic!()
        };
        let back = ClusterObject::from_json(obj.kind(), &obj.to_json()).unwrap();
        assert_eq!(back.key(), obj.key());
    }

    #[test]
    fn directories_are_read_in_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(
            dir.path().join("b.yaml"),
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: b\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("sub/a.yml"),
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: a\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        let got = load_path(dir.path()).unwrap();
        let names: Vec<_> = got
            .iter()
            .map(|l| {
                l.source
                    .file
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .to_string()
            })
            .collect();
        assert_eq!(names, ["b.yaml", "a.yml"]);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_text_never_panics(s in "\\PC{0,200}") {
            let _ = load(&s);
        }
    }
}
