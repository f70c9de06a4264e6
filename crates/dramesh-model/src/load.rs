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

/// Decodes a Karpenter object (`karpenter.sh/v1`) leniently: fields the trimmed type does not
/// have are ignored (a controller's CRD grows with every release), the fields it reads are
/// typed (errors name their path), and its bounds are checked ([`crate::karpenter::Bounded`]).
pub fn decode_karpenter<T: DeserializeOwned + crate::karpenter::Bounded>(
    value: Value,
) -> Result<T, FieldError> {
    let typed: T = serde_path_to_error::deserialize(&value).map_err(|e| FieldError {
        field: clean_path(&e.path().to_string()),
        message: e.inner().to_string(),
    })?;
    typed
        .check()
        .map_err(|(field, message)| FieldError { field, message })?;
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
        "ResourceClaimTemplate" => typed(
            decode_value(value)
                .map(|o| Manifest::Object(ClusterObject::ResourceClaimTemplate(Arc::new(o)))),
        ),
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
        "NodePool" | "NodeClaim" if api_version.starts_with("karpenter.sh/") => {
            if api_version != crate::karpenter::API_VERSION {
                return wrong_version(crate::karpenter::API_VERSION);
            }
            typed(if kind == "NodePool" {
                decode_karpenter(value)
                    .map(|o| Manifest::Object(ClusterObject::NodePool(Arc::new(o))))
            } else {
                decode_karpenter(value)
                    .map(|o| Manifest::Object(ClusterObject::NodeClaim(Arc::new(o))))
            })
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
/// Text nested deeper than [`depth::MAX_DEPTH`] or with more than [`depth::MAX_NODES`] nodes is
/// refused before it is parsed, so a hostile file fails in time and memory linear in its size
/// (see [`depth`]).
pub fn load_str(file: &Path, text: &str) -> Result<Vec<Loaded>, LoadError> {
    load_str_with(file, text, &depth::Limits::default())
}

/// [`load_str`] with other pre-scan limits (e.g. [`REQUEST_LIMITS`] for manifests in a request).
pub fn load_str_with(
    file: &Path,
    text: &str,
    limits: &depth::Limits,
) -> Result<Vec<Loaded>, LoadError> {
    let scan = depth::prescan(text, limits).map_err(|e| LoadError::file(file, e.to_string()))?;
    let octals = &scan.plain_octals;
    let mut loaded = Vec::new();
    let is_json = file.extension().is_some_and(|e| e == "json");
    // Each document is decoded as soon as it is parsed, so only one parsed document is held.
    if is_json {
        for (d, v) in serde_json::Deserializer::from_str(text)
            .into_iter::<Value>()
            .enumerate()
        {
            let v = v.map_err(|e| LoadError::file(file, format!("invalid JSON: {e}")))?;
            decode_document(file, d, v, &[], &mut loaded)?;
        }
    } else {
        for (d, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
            let v = <Value as serde::Deserialize>::deserialize(doc).map_err(|e| LoadError {
                document: Some(d),
                ..LoadError::file(file, format!("invalid YAML: {e}"))
            })?;
            decode_document(file, d, v, octals, &mut loaded)?;
        }
    }
    Ok(loaded)
}

/// Pre-scan limits for manifests sent in an API request: 100,000 nodes (a workload's manifests
/// are a few hundred), about 15 MB of parser memory at most.
pub const REQUEST_LIMITS: depth::Limits = depth::Limits {
    max_depth: depth::MAX_DEPTH,
    max_nodes: 100_000,
};

/// Decodes document `d` of `file` (one object or a List) into `loaded`.
fn decode_document(
    file: &Path,
    d: usize,
    doc: Value,
    octals: &[String],
    loaded: &mut Vec<Loaded>,
) -> Result<(), LoadError> {
    if doc.is_null() {
        return Ok(()); // empty document, e.g. only comments
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
        let mut doc = doc;
        match doc.get_mut("items").map(Value::take) {
            Some(Value::Array(items)) => items
                .into_iter()
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
        match decode_yaml11(value, octals) {
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
    Ok(())
}

/// [`decode_manifest`], reading as kubectl does the unquoted YAML 1.1 octal integers (`0755`,
/// listed in `octals` by the pre-scan) that the YAML 1.2 parser left as strings: where a typed
/// field refuses such a string, it becomes the integer and the object is decoded again. A field
/// that accepts strings keeps the text, and a quoted `"0755"` in an integer field still fails
/// unless the same text also appears unquoted in the file.
fn decode_yaml11(
    value: Value,
    octals: &[String],
) -> Result<Manifest, (Option<String>, FieldError)> {
    if octals.is_empty() {
        return decode_manifest(value);
    }
    let mut value = value;
    loop {
        let err = match decode_manifest(value.clone()) {
            Ok(m) => return Ok(m),
            Err(e) => e,
        };
        let slot = value_at_mut(&mut value, &err.1.field);
        let number = match slot.as_deref() {
            Some(Value::String(s)) if octals.binary_search(s).is_ok() => octal_value(s),
            _ => None,
        };
        match (slot, number) {
            (Some(slot), Some(n)) => *slot = n,
            _ => return Err(err),
        }
    }
}

/// The integer a YAML 1.1 octal scalar stands for (`-0755` is -493).
fn octal_value(s: &str) -> Option<Value> {
    let (negative, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let n = i64::from_str_radix(digits, 8).ok()?;
    Some(Value::from(if negative { -n } else { n }))
}

/// The value at a serde_path_to_error path (`a.b[0].c`); `None` when a key holds `.` or `[`
/// and the path is ambiguous, or when nothing is there.
fn value_at_mut<'a>(value: &'a mut Value, path: &str) -> Option<&'a mut Value> {
    if path.is_empty() {
        return None;
    }
    let mut cur = value;
    for part in path.split('.') {
        let (key, mut rest) = match part.find('[') {
            Some(i) => part.split_at(i),
            None => (part, ""),
        };
        if !key.is_empty() {
            cur = cur.as_object_mut()?.get_mut(key)?;
        }
        while let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']')?;
            let index: usize = r[..end].parse().ok()?;
            cur = cur.as_array_mut()?.get_mut(index)?;
            rest = &r[end + 1..];
        }
        if !rest.is_empty() {
            return None;
        }
    }
    Some(cur)
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

/// The manifest files below a directory, sorted by path; the first entry that cannot be
/// examined (see [`list_manifest_files`]) is an error.
pub fn manifest_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let listing = list_manifest_files(dir)?;
    if let Some((p, why)) = listing.unreadable.into_iter().next() {
        return Err(LoadError::file(&p, why));
    }
    Ok(listing.files)
}

/// What [`list_manifest_files`] found below a directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// `.yaml`, `.yml` and `.json` files (or links to files), sorted by path.
    pub files: Vec<PathBuf>,
    /// Entries that could not be examined, with why: a folder that cannot be listed, a link
    /// that cannot be followed (a loop, a dangling target), sorted by path.
    pub unreadable: Vec<(PathBuf, String)>,
}

/// The manifest files below `dir`, and the entries below it that could not be examined; only
/// `dir` itself failing to list is an error. Subfolders are descended, links to folders are
/// not (a link to an ancestor would loop); a link is examined through its target, so a loop of
/// links is reported and never followed forever.
pub fn list_manifest_files(dir: &Path) -> Result<Listing, LoadError> {
    let mut out = Listing::default();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if d == dir => return Err(LoadError::file(&d, format!("cannot list: {e}"))),
            Err(e) => {
                out.unreadable.push((d, format!("cannot list: {e}")));
                continue;
            }
        };
        for entry in entries {
            let entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    out.unreadable
                        .push((d.clone(), format!("cannot list: {e}")));
                    continue;
                }
            };
            let p = entry.path();
            let ft = match entry.file_type() {
                Ok(ft) => ft,
                Err(e) => {
                    out.unreadable.push((p, e.to_string()));
                    continue;
                }
            };
            let manifest = p
                .extension()
                .is_some_and(|e| e == "yaml" || e == "yml" || e == "json");
            if ft.is_dir() {
                stack.push(p);
            } else if ft.is_symlink() {
                match std::fs::metadata(&p) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) if manifest => out.files.push(p),
                    Ok(_) => {}
                    Err(e) => out
                        .unreadable
                        .push((p, format!("symbolic link cannot be followed: {e}"))),
                }
            } else if manifest {
                out.files.push(p);
            }
        }
    }
    out.files.sort();
    out.unreadable.sort();
    Ok(out)
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

    fn pod_with_mode(mode: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: n}}\nspec:\n  containers: [{{name: c, image: i}}]\n  volumes:\n  - name: a\n    configMap: {{name: a, defaultMode: {mode}}}\n  - name: b\n    secret: {{secretName: b, defaultMode: {mode}, items: [{{key: k, path: p, mode: 0600}}]}}\n"
        )
    }

    fn modes(l: &[Loaded]) -> Vec<Option<i32>> {
        let Manifest::Object(ClusterObject::Pod(p)) = &l[0].manifest else {
            panic!("not a pod")
        };
        let vols = p.spec.as_ref().unwrap().volumes.as_ref().unwrap();
        let secret = vols[1].secret.as_ref().unwrap();
        vec![
            vols[0].config_map.as_ref().unwrap().default_mode,
            secret.default_mode,
            secret.items.as_ref().unwrap()[0].mode,
        ]
    }

    #[test]
    fn yaml11_octal_integers_load_as_kubectl_reads_them() {
        let l = load(&pod_with_mode("0755")).unwrap();
        assert_eq!(modes(&l), [Some(0o755), Some(0o755), Some(0o600)]);
        // Decimal and YAML 1.2 forms are unchanged.
        assert_eq!(
            modes(&load(&pod_with_mode("420")).unwrap()),
            [Some(420), Some(420), Some(0o600)]
        );
        assert_eq!(
            modes(&load(&pod_with_mode("0o644")).unwrap()),
            [Some(0o644), Some(0o644), Some(0o600)]
        );
        // A quoted string is a string, as for kubectl: refused, naming the field.
        let e = load(&pod_with_mode("\"0644\"")).unwrap_err().to_string();
        assert!(
            e.contains("field spec.volumes[0].configMap.defaultMode"),
            "{e}"
        );
        // A string field keeps the text.
        let l = load("apiVersion: v1\nkind: Node\nmetadata:\n  name: n\n  labels: {mode: 0755}\n")
            .unwrap();
        let Manifest::Object(ClusterObject::Node(n)) = &l[0].manifest else {
            panic!("not a node")
        };
        assert_eq!(n.metadata.labels.as_ref().unwrap()["mode"], "0755");
        // Unknown fields stay refused even next to an octal value.
        let e = load(
            &pod_with_mode("0755").replace("defaultMode: 0755}", "defaultMode: 0755, bogus: 0755}"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("unknown field"), "{e}");
    }

    #[test]
    fn wide_text_is_refused_before_parsing() {
        let wide = format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\ndata: {{a: [{}]}}\n",
            vec!["1"; 200_000].join(",")
        );
        let e = load_str_with(Path::new("w.yaml"), &wide, &REQUEST_LIMITS)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("w.yaml: ") && e.contains("more than 100000 YAML nodes"),
            "{e}"
        );
        // Files take more.
        assert!(load_str(Path::new("w.yaml"), &wide).is_ok());
    }

    #[test]
    fn list_items_are_decoded_in_order() {
        let l = load("apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Node, metadata: {name: a}}\n- {apiVersion: v1, kind: Node, metadata: {name: b}}\n")
            .unwrap();
        let items: Vec<_> = l.iter().map(|l| l.source.item).collect();
        assert_eq!(items, [Some(0), Some(1)]);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_text_never_panics(s in "\\PC{0,200}") {
            let _ = load(&s);
        }
    }
}
