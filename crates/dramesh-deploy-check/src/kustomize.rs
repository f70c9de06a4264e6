//! Kustomize-style composition, for the subset of kustomize that `deploy/` uses.
//!
//! Supported kustomization fields, applied in kustomize's order after the resources are
//! gathered (patches, namespace, name prefix/suffix, labels, images):
//!
//! - `resources`: relative paths to YAML files (multi-document) or to directories holding
//!   their own kustomization, composed recursively (cycles and remote URLs are errors);
//! - `patches`: JSON 6902 operations (inline `patch` or `path`) with a `target` matched
//!   exactly on group, version, kind, name and namespace; a target matching nothing is an
//!   error; strategic-merge patches are refused;
//! - `namespace`: sets `metadata.namespace` of namespaced kinds and the namespace of
//!   ServiceAccount subjects of (Cluster)RoleBindings that have none;
//! - `namePrefix` / `nameSuffix`: rename objects. Name references are not rewritten, so a
//!   kustomization using them may only hold kinds that reference nothing by name;
//! - `labels`: `pairs` go to `metadata.labels`, and with `includeTemplates` to pod template
//!   labels; `includeSelectors: true` is refused;
//! - `images`: `name` with `newName`, `newTag` or `digest`, on containers and init
//!   containers of pod templates.
//!
//! Any other kustomization field is an error naming it. After composition, two objects with
//! the same group, kind, namespace and name are an error, as in kustomize.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dramesh_model::load::{FieldError, MAX_FILE_BYTES, decode_value};
use dramesh_model::{LoadError, Source};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::patch::{self, Operation};

/// File names kustomize recognises, in its order of preference.
pub const KUSTOMIZATION_FILES: [&str; 3] =
    ["kustomization.yaml", "kustomization.yml", "Kustomization"];

/// Deepest chain of nested kustomizations followed.
const MAX_DEPTH: usize = 32;

/// Kustomization fields this composition implements.
const SUPPORTED_FIELDS: [&str; 9] = [
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "namePrefix",
    "nameSuffix",
    "labels",
    "images",
    "patches",
];

/// Kinds without a namespace (the ones the namespace transformer must leave alone).
const CLUSTER_SCOPED: [&str; 20] = [
    "Namespace",
    "Node",
    "PersistentVolume",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "APIService",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "PriorityClass",
    "StorageClass",
    "CSIDriver",
    "RuntimeClass",
    "IngressClass",
    "DeviceClass",
    "ResourceSlice",
    "DeviceTaintRule",
    "ClusterIssuer",
];

/// Kinds that refer to other objects by name; renaming is refused when any is present,
/// because this composition does not rewrite references.
const REFERRING_KINDS: [&str; 13] = [
    "Namespace",
    "Pod",
    "Deployment",
    "StatefulSet",
    "DaemonSet",
    "ReplicaSet",
    "Job",
    "CronJob",
    "RoleBinding",
    "ClusterRoleBinding",
    "Certificate",
    "Issuer",
    "ClusterIssuer",
];

/// One composed object and the file document it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Resource {
    pub value: Value,
    pub source: Source,
}

impl Resource {
    pub fn api_version(&self) -> &str {
        self.value
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    pub fn kind(&self) -> &str {
        self.value.get("kind").and_then(Value::as_str).unwrap_or("")
    }

    pub fn name(&self) -> &str {
        self.meta_str("name").unwrap_or("")
    }

    pub fn namespace(&self) -> Option<&str> {
        self.meta_str("namespace")
    }

    fn meta_str(&self, key: &str) -> Option<&str> {
        self.value.get("metadata")?.get(key)?.as_str()
    }

    /// `Kind name` or `Kind namespace/name`, as used in errors.
    pub fn label(&self) -> String {
        match self.namespace() {
            Some(ns) => format!("{} {ns}/{}", self.kind(), self.name()),
            None => format!("{} {}", self.kind(), self.name()),
        }
    }

    fn error(&self, field: Option<String>, message: impl Into<String>) -> LoadError {
        LoadError {
            file: self.source.file.clone(),
            document: Some(self.source.document),
            item: self.source.item,
            object: Some(self.label()),
            field,
            message: message.into(),
        }
    }
}

/// `(group, version)` of an `apiVersion`; the core group is `""`.
pub fn group_version(api_version: &str) -> (&str, &str) {
    match api_version.split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", api_version),
    }
}

pub(crate) fn file_error(file: &Path, message: impl Into<String>) -> LoadError {
    LoadError {
        file: file.to_path_buf(),
        document: None,
        item: None,
        object: None,
        field: None,
        message: message.into(),
    }
}

fn field_error(file: &Path, field: impl Into<String>, message: impl Into<String>) -> LoadError {
    LoadError {
        field: Some(field.into()),
        ..file_error(file, message)
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    name_prefix: Option<String>,
    #[serde(default)]
    name_suffix: Option<String>,
    #[serde(default)]
    labels: Vec<LabelRule>,
    #[serde(default)]
    images: Vec<ImageRule>,
    #[serde(default)]
    patches: Vec<PatchRule>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct LabelRule {
    pairs: BTreeMap<String, String>,
    #[serde(default)]
    include_selectors: bool,
    #[serde(default)]
    include_templates: bool,
}

/// An `images` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ImageRule {
    pub name: String,
    #[serde(default)]
    pub new_name: Option<String>,
    #[serde(default)]
    pub new_tag: Option<String>,
    #[serde(default)]
    pub digest: Option<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PatchRule {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    patch: Option<String>,
    #[serde(default)]
    target: Option<Target>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Target {
    #[serde(default)]
    group: Option<String>,
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
}

impl Target {
    fn matches(&self, r: &Resource) -> bool {
        let (group, version) = group_version(r.api_version());
        let eq = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
        eq(&self.group, group)
            && eq(&self.version, version)
            && eq(&self.kind, r.kind())
            && eq(&self.name, r.name())
            && eq(&self.namespace, r.namespace().unwrap_or(""))
    }
}

/// The kustomization file of `dir`, if it has one.
pub fn find_kustomization(dir: &Path) -> Option<PathBuf> {
    KUSTOMIZATION_FILES
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
}

fn read_bounded(file: &Path) -> Result<String, LoadError> {
    let meta =
        std::fs::metadata(file).map_err(|e| file_error(file, format!("cannot read: {e}")))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(file_error(
            file,
            format!(
                "file is {} bytes, over the {MAX_FILE_BYTES} byte limit",
                meta.len()
            ),
        ));
    }
    std::fs::read_to_string(file).map_err(|e| file_error(file, format!("cannot read: {e}")))
}

fn yaml_documents(file: &Path, text: &str) -> Result<Vec<Value>, LoadError> {
    let mut docs = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let v = Value::deserialize(doc).map_err(|e| LoadError {
            document: Some(i),
            ..file_error(file, format!("invalid YAML: {e}"))
        })?;
        docs.push(v);
    }
    Ok(docs)
}

fn read_kustomization(file: &Path) -> Result<Kustomization, LoadError> {
    let text = read_bounded(file)?;
    let mut docs = yaml_documents(file, &text)?;
    if docs.len() != 1 {
        return Err(file_error(
            file,
            format!("a kustomization is one YAML document, found {}", docs.len()),
        ));
    }
    let value = docs.remove(0);
    let Value::Object(map) = &value else {
        return Err(file_error(file, "a kustomization must be a mapping"));
    };
    if let Some(unsupported) = map.keys().find(|k| !SUPPORTED_FIELDS.contains(&k.as_str())) {
        return Err(field_error(
            file,
            unsupported.clone(),
            format!(
                "kustomization field not supported by this check (supported: {})",
                SUPPORTED_FIELDS.join(", ")
            ),
        ));
    }
    let k: Kustomization =
        decode_value(value).map_err(|e: FieldError| field_error(file, e.field, e.message))?;
    if let Some(v) = &k.api_version
        && v != "kustomize.config.k8s.io/v1beta1"
    {
        return Err(field_error(
            file,
            "apiVersion",
            format!("expected kustomize.config.k8s.io/v1beta1, got {v:?}"),
        ));
    }
    if let Some(kind) = &k.kind
        && kind != "Kustomization"
    {
        return Err(field_error(
            file,
            "kind",
            format!("expected Kustomization, got {kind:?}"),
        ));
    }
    Ok(k)
}

/// Reads the objects of one resource file.
fn read_resources(file: &Path) -> Result<Vec<Resource>, LoadError> {
    let text = read_bounded(file)?;
    let mut out = Vec::new();
    for (d, value) in yaml_documents(file, &text)?.into_iter().enumerate() {
        if value.is_null() {
            continue;
        }
        let doc_error = |field: Option<&str>, message: String| LoadError {
            document: Some(d),
            field: field.map(str::to_string),
            ..file_error(file, message)
        };
        if !value.is_object() {
            return Err(doc_error(None, "document is not a mapping".into()));
        }
        for key in ["apiVersion", "kind"] {
            if !value.get(key).is_some_and(Value::is_string) {
                return Err(doc_error(Some(key), "missing or not a string".into()));
            }
        }
        if !value
            .get("metadata")
            .and_then(|m| m.get("name"))
            .is_some_and(Value::is_string)
        {
            return Err(doc_error(
                Some("metadata.name"),
                "missing or not a string".into(),
            ));
        }
        if value
            .get("kind")
            .and_then(Value::as_str)
            .is_some_and(|k| k.ends_with("List"))
        {
            return Err(doc_error(
                Some("kind"),
                "List documents are not supported here; write one document per object".into(),
            ));
        }
        out.push(Resource {
            value,
            source: Source {
                file: file.to_path_buf(),
                document: d,
                item: None,
            },
        });
    }
    Ok(out)
}

/// Composes the kustomization in `dir`: its resources, recursively, then its transformers.
pub fn compose(dir: &Path) -> Result<Vec<Resource>, LoadError> {
    let mut stack = Vec::new();
    let out = compose_dir(dir, &mut stack)?;
    check_unique(&out)?;
    Ok(out)
}

fn compose_dir(dir: &Path, stack: &mut Vec<PathBuf>) -> Result<Vec<Resource>, LoadError> {
    let canonical = dir
        .canonicalize()
        .map_err(|e| file_error(dir, format!("cannot resolve: {e}")))?;
    if stack.contains(&canonical) {
        return Err(file_error(
            dir,
            "kustomization cycle: directory includes itself",
        ));
    }
    if stack.len() >= MAX_DEPTH {
        return Err(file_error(
            dir,
            format!("kustomizations nested deeper than {MAX_DEPTH}"),
        ));
    }
    let kfile = find_kustomization(dir).ok_or_else(|| {
        file_error(
            dir,
            format!(
                "no kustomization file (one of {})",
                KUSTOMIZATION_FILES.join(", ")
            ),
        )
    })?;
    let k = read_kustomization(&kfile)?;

    stack.push(canonical);
    let mut out = Vec::new();
    for (i, entry) in k.resources.iter().enumerate() {
        let field = format!("resources[{i}]");
        if entry.is_empty() || entry.contains("://") || Path::new(entry).is_absolute() {
            return Err(field_error(
                &kfile,
                field,
                format!("{entry:?}: only relative local paths are supported"),
            ));
        }
        let path = dir.join(entry);
        let meta = std::fs::metadata(&path)
            .map_err(|e| field_error(&kfile, field, format!("{entry:?}: {e}")))?;
        if meta.is_dir() {
            out.extend(compose_dir(&path, stack)?);
        } else {
            out.extend(read_resources(&path)?);
        }
    }
    stack.pop();

    for (i, rule) in k.patches.iter().enumerate() {
        apply_patch(&kfile, dir, i, rule, &mut out)?;
    }
    if let Some(ns) = &k.namespace {
        set_namespace(ns, &mut out);
    }
    if k.name_prefix.is_some() || k.name_suffix.is_some() {
        rename(
            &kfile,
            k.name_prefix.as_deref().unwrap_or(""),
            k.name_suffix.as_deref().unwrap_or(""),
            &mut out,
        )?;
    }
    for (i, rule) in k.labels.iter().enumerate() {
        if rule.include_selectors {
            return Err(field_error(
                &kfile,
                format!("labels[{i}].includeSelectors"),
                "includeSelectors: true is not supported by this check (selectors are immutable; set them in the base)",
            ));
        }
        for r in &mut out {
            add_labels(r, &rule.pairs, rule.include_templates);
        }
    }
    for (i, rule) in k.images.iter().enumerate() {
        if rule.new_tag.is_some() && rule.digest.is_some() {
            return Err(field_error(
                &kfile,
                format!("images[{i}]"),
                "set newTag or digest, not both",
            ));
        }
        for r in &mut out {
            set_images(r, rule);
        }
    }
    Ok(out)
}

fn apply_patch(
    kfile: &Path,
    dir: &Path,
    index: usize,
    rule: &PatchRule,
    out: &mut [Resource],
) -> Result<(), LoadError> {
    let field = format!("patches[{index}]");
    let (origin, text) = match (&rule.path, &rule.patch) {
        (Some(p), None) => {
            let file = dir.join(p);
            let text = read_bounded(&file)?;
            (file, text)
        }
        (None, Some(text)) => (kfile.to_path_buf(), text.clone()),
        _ => {
            return Err(field_error(
                kfile,
                field,
                "a patch needs exactly one of path and patch",
            ));
        }
    };
    let mut docs = yaml_documents(&origin, &text)?;
    if docs.len() != 1 {
        return Err(field_error(
            kfile,
            field,
            format!("a patch is one YAML document, found {}", docs.len()),
        ));
    }
    let ops_value = match docs.remove(0) {
        v @ Value::Array(_) => v,
        Value::Object(_) => {
            return Err(field_error(
                kfile,
                field,
                "strategic-merge patches are not supported by this check; write a JSON 6902 patch (a list of operations) with a target",
            ));
        }
        _ => {
            return Err(field_error(
                kfile,
                field,
                "a patch must be a list of JSON 6902 operations",
            ));
        }
    };
    let ops: Vec<Operation> = decode_value(ops_value).map_err(|e| {
        field_error(
            kfile,
            format!("{field}.patch{}", bracketed(&e.field)),
            e.message,
        )
    })?;
    let target = rule.target.as_ref().ok_or_else(|| {
        field_error(
            kfile,
            format!("{field}.target"),
            "a JSON 6902 patch needs a target",
        )
    })?;
    let mut matched = 0;
    for r in out.iter_mut().filter(|r| target.matches(r)) {
        matched += 1;
        for (j, op) in ops.iter().enumerate() {
            patch::apply(&mut r.value, op).map_err(|message| {
                field_error(
                    kfile,
                    format!("{field}.patch[{j}]"),
                    format!("on {}: {message}", r.label()),
                )
            })?;
        }
    }
    if matched == 0 {
        return Err(field_error(
            kfile,
            format!("{field}.target"),
            "matches no resource of this kustomization",
        ));
    }
    Ok(())
}

/// `[0].path` for a field path `[0].path`, `.x` for `x`, `` for ``.
fn bracketed(field: &str) -> String {
    if field.is_empty() || field.starts_with('[') {
        field.to_string()
    } else {
        format!(".{field}")
    }
}

fn metadata_mut(value: &mut Value) -> Option<&mut Map<String, Value>> {
    value.get_mut("metadata")?.as_object_mut()
}

fn set_namespace(ns: &str, out: &mut [Resource]) {
    for r in out.iter_mut() {
        let kind = r.kind().to_string();
        if !CLUSTER_SCOPED.contains(&kind.as_str())
            && let Some(meta) = metadata_mut(&mut r.value)
        {
            meta.insert("namespace".into(), Value::String(ns.into()));
        }
        if matches!(kind.as_str(), "RoleBinding" | "ClusterRoleBinding")
            && let Some(Value::Array(subjects)) = r.value.get_mut("subjects")
        {
            for s in subjects.iter_mut().filter_map(Value::as_object_mut) {
                let is_sa = s.get("kind").and_then(Value::as_str) == Some("ServiceAccount");
                if is_sa && !s.contains_key("namespace") {
                    s.insert("namespace".into(), Value::String(ns.into()));
                }
            }
        }
    }
}

fn rename(kfile: &Path, prefix: &str, suffix: &str, out: &mut [Resource]) -> Result<(), LoadError> {
    if let Some(r) = out.iter().find(|r| REFERRING_KINDS.contains(&r.kind())) {
        return Err(field_error(
            kfile,
            if prefix.is_empty() {
                "nameSuffix"
            } else {
                "namePrefix"
            },
            format!(
                "this check does not rewrite name references, so it renames only kinds that refer to nothing by name; {} does",
                r.label()
            ),
        ));
    }
    for r in out.iter_mut() {
        let name = format!("{prefix}{}{suffix}", r.name());
        if let Some(meta) = metadata_mut(&mut r.value) {
            meta.insert("name".into(), Value::String(name));
        }
    }
    Ok(())
}

fn merge_labels(obj: &mut Value, pairs: &BTreeMap<String, String>) {
    let Some(map) = obj.as_object_mut() else {
        return;
    };
    let meta = map
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Some(meta) = meta.as_object_mut() else {
        return;
    };
    let labels = meta
        .entry("labels")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Some(labels) = labels.as_object_mut() {
        for (k, v) in pairs {
            labels.insert(k.clone(), Value::String(v.clone()));
        }
    }
}

/// The pod template of a workload (`spec.template`, or the Job template of a CronJob).
fn pod_template_mut(r: &mut Resource) -> Option<&mut Value> {
    match r.kind() {
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
            r.value.get_mut("spec")?.get_mut("template")
        }
        "CronJob" => r
            .value
            .get_mut("spec")?
            .get_mut("jobTemplate")?
            .get_mut("spec")?
            .get_mut("template"),
        _ => None,
    }
}

fn add_labels(r: &mut Resource, pairs: &BTreeMap<String, String>, templates: bool) {
    merge_labels(&mut r.value, pairs);
    if templates && let Some(template) = pod_template_mut(r) {
        merge_labels(template, pairs);
    }
}

/// Applies an `images` rule to one image reference; `None` when the rule does not match.
pub fn rewrite_image(image: &str, rule: &ImageRule) -> Option<String> {
    let (rest, digest) = match image.split_once('@') {
        Some((r, d)) => (r, Some(d)),
        None => (image, None),
    };
    // A ':' after the last '/' starts the tag; an earlier one is a registry port.
    let (name, tag) = match rest.rfind(':') {
        Some(i) if !rest[i..].contains('/') => (&rest[..i], Some(&rest[i + 1..])),
        _ => (rest, None),
    };
    if name != rule.name {
        return None;
    }
    let new_name = rule.new_name.as_deref().unwrap_or(name);
    let suffix = match (&rule.digest, &rule.new_tag, digest, tag) {
        (Some(d), _, _, _) => format!("@{d}"),
        (None, Some(t), _, _) => format!(":{t}"),
        (None, None, Some(d), _) => format!("@{d}"),
        (None, None, None, Some(t)) => format!(":{t}"),
        (None, None, None, None) => String::new(),
    };
    Some(format!("{new_name}{suffix}"))
}

fn set_images(r: &mut Resource, rule: &ImageRule) {
    let spec = match r.kind() {
        "Pod" => r.value.get_mut("spec"),
        _ => pod_template_mut(r).and_then(|t| t.get_mut("spec")),
    };
    let Some(spec) = spec else {
        return;
    };
    for list in ["initContainers", "containers"] {
        let Some(Value::Array(containers)) = spec.get_mut(list) else {
            continue;
        };
        for c in containers.iter_mut().filter_map(Value::as_object_mut) {
            let new = c
                .get("image")
                .and_then(Value::as_str)
                .and_then(|image| rewrite_image(image, rule));
            if let Some(new) = new {
                c.insert("image".into(), Value::String(new));
            }
        }
    }
}

fn check_unique(out: &[Resource]) -> Result<(), LoadError> {
    let mut seen: BTreeMap<(String, String, String, String), &Resource> = BTreeMap::new();
    for r in out {
        let (group, _) = group_version(r.api_version());
        let key = (
            group.to_string(),
            r.kind().to_string(),
            r.namespace().unwrap_or("").to_string(),
            r.name().to_string(),
        );
        if let Some(first) = seen.insert(key, r) {
            return Err(r.error(
                None,
                format!("duplicate object: also defined in {}", first.source),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(
        name: &str,
        new_name: Option<&str>,
        tag: Option<&str>,
        digest: Option<&str>,
    ) -> ImageRule {
        ImageRule {
            name: name.into(),
            new_name: new_name.map(Into::into),
            new_tag: tag.map(Into::into),
            digest: digest.map(Into::into),
        }
    }

    #[test]
    fn images_match_on_name_without_tag_or_digest() {
        let r = rule("ghcr.io/dramesh/dramesh", None, Some("0.2.0"), None);
        assert_eq!(
            rewrite_image("ghcr.io/dramesh/dramesh:0.1.0", &r).as_deref(),
            Some("ghcr.io/dramesh/dramesh:0.2.0")
        );
        assert_eq!(
            rewrite_image("ghcr.io/dramesh/dramesh", &r).as_deref(),
            Some("ghcr.io/dramesh/dramesh:0.2.0")
        );
        assert_eq!(rewrite_image("ghcr.io/dramesh/other:0.1.0", &r), None);
        assert_eq!(rewrite_image("ghcr.io/dramesh/dramesh-x:0.1.0", &r), None);
    }

    #[test]
    fn images_keep_tag_when_only_renamed_and_handle_ports_and_digests() {
        let r = rule(
            "localhost:5000/dramesh",
            Some("mirror.example/dramesh"),
            None,
            None,
        );
        assert_eq!(
            rewrite_image("localhost:5000/dramesh:0.1.0", &r).as_deref(),
            Some("mirror.example/dramesh:0.1.0")
        );
        assert_eq!(
            rewrite_image("localhost:5000/dramesh@sha256:abc", &r).as_deref(),
            Some("mirror.example/dramesh@sha256:abc")
        );
        let d = rule("dramesh", None, None, Some("sha256:def"));
        assert_eq!(
            rewrite_image("dramesh:0.1.0", &d).as_deref(),
            Some("dramesh@sha256:def")
        );
    }

    #[test]
    fn group_version_splits_core_and_named_groups() {
        assert_eq!(group_version("v1"), ("", "v1"));
        assert_eq!(group_version("apps/v1"), ("apps", "v1"));
    }
}
