//! Rendering a kustomization with the real kustomize: `kubectl kustomize` (kustomize v5.5 in
//! kubectl 1.32), or the standalone `kustomize build` when kubectl is absent.
//!
//! Each rendered object keeps the file it came from: the directory is built through a
//! temporary wrapper kustomization whose only resource is that directory and which asks for
//! `buildMetadata: [originAnnotations]`. kustomize then annotates every object with its
//! source path; the annotation is read into [`Resource::source`] and removed, so the typed
//! decoding sees the object as written plus kustomize's transformations. The wrapper adds no
//! transformer, so the objects are exactly what `kubectl kustomize <dir>` prints.
//!
//! A missing tool, a kustomize error, output over [`MAX_FILE_BYTES`] and a run longer than
//! [`RENDER_TIMEOUT`] are [`LoadError`]s naming the kustomization.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dramesh_model::load::MAX_FILE_BYTES;
use dramesh_model::{LoadError, Source};
use serde::Deserialize;
use serde_json::{Map, Value};

/// File names kustomize recognises, in its order of preference.
pub const KUSTOMIZATION_FILES: [&str; 3] =
    ["kustomization.yaml", "kustomization.yml", "Kustomization"];

/// Longest a single render may take before the tool is killed.
pub const RENDER_TIMEOUT: Duration = Duration::from_secs(120);

/// The annotation kustomize writes for `buildMetadata: [originAnnotations]`.
const ORIGIN_ANNOTATION: &str = "config.kubernetes.io/origin";

/// One rendered object and the file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Resource {
    /// The object as kustomize rendered it, without the origin annotation.
    pub value: Value,
    /// The manifest file the object came from; `document` is the first document of that file
    /// with the object's kind whose name the rendered name contains (kustomize does not
    /// report document indices), 0 if none does.
    pub source: Source,
}

impl Resource {
    /// `apiVersion`, or `""` when absent.
    pub fn api_version(&self) -> &str {
        self.value
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    /// `kind`, or `""` when absent.
    pub fn kind(&self) -> &str {
        self.value.get("kind").and_then(Value::as_str).unwrap_or("")
    }

    /// `metadata.name`, or `""` when absent.
    pub fn name(&self) -> &str {
        self.meta_str("name").unwrap_or("")
    }

    /// `metadata.namespace`, if set.
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
}

/// The kustomization file of `dir`, if it has one.
pub fn find_kustomization(dir: &Path) -> Option<PathBuf> {
    KUSTOMIZATION_FILES
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
}

/// Renders the kustomization in `dir` with kustomize and returns its objects in output order.
pub fn render(dir: &Path) -> Result<Vec<Resource>, LoadError> {
    let kfile = find_kustomization(dir).ok_or_else(|| {
        LoadError::file(
            dir,
            format!(
                "no kustomization file (one of {})",
                KUSTOMIZATION_FILES.join(", ")
            ),
        )
    })?;
    let target = dir
        .canonicalize()
        .map_err(|e| LoadError::file(dir, format!("cannot resolve: {e}")))?;
    let wrapper = tempfile::tempdir()
        .map_err(|e| LoadError::file(dir, format!("cannot create a temporary directory: {e}")))?;
    let root = wrapper
        .path()
        .canonicalize()
        .map_err(|e| LoadError::file(wrapper.path(), format!("cannot resolve: {e}")))?;
    // kustomize refuses absolute resource paths, so the wrapper names the target relatively.
    let relative = relative_to(&root, &target);
    let text = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {}\nbuildMetadata: [originAnnotations]\n",
        serde_json::Value::String(relative.display().to_string())
    );
    std::fs::write(root.join("kustomization.yaml"), text).map_err(|e| {
        LoadError::file(
            &root,
            format!("cannot write the wrapper kustomization: {e}"),
        )
    })?;

    let output = run_kustomize(&root).map_err(|message| LoadError::file(&kfile, message))?;
    let mut sources = SourceIndex::default();
    let mut out = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(&output).enumerate() {
        let value = Value::deserialize(doc).map_err(|e| {
            LoadError::file(
                &kfile,
                format!("kustomize output document {i} is not valid YAML: {e}"),
            )
        })?;
        if value.is_null() {
            continue;
        }
        out.push(sources.resource(&root, &kfile, value));
    }
    Ok(out)
}

/// `to` expressed relative to `from`; both are absolute and canonical.
fn relative_to(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component<'_>> = from.components().collect();
    let to: Vec<Component<'_>> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in common..from.len() {
        rel.push("..");
    }
    for c in &to[common..] {
        rel.push(c.as_os_str());
    }
    rel
}

/// `base.join(rel)` with `.` and `..` resolved lexically (the wrapper is gone by the time the
/// path is reported, so it cannot be canonicalized through it).
fn join_lexically(base: &Path, rel: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in base.join(rel).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// The kustomize front ends tried in order: program and the arguments before the directory.
const TOOLS: [(&str, &str); 2] = [("kubectl", "kustomize"), ("kustomize", "build")];

/// Runs the first kustomize found on `PATH` on `dir`, bounded in time and output size.
fn run_kustomize(dir: &Path) -> Result<String, String> {
    run_first(&TOOLS, dir)
}

fn run_first(tools: &[(&str, &str)], dir: &Path) -> Result<String, String> {
    for (program, subcommand) in tools {
        let spawned = Command::new(program)
            .arg(subcommand)
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match spawned {
            Ok(child) => return wait_bounded(program, child),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("cannot run {program}: {e}")),
        }
    }
    let names: Vec<String> = tools.iter().map(|(p, _)| format!("`{p}`")).collect();
    Err(format!(
        "none of {} is on PATH: install the Debian package `kubectl` (scripts/test does) to \
         render deploy/",
        names.join(", ")
    ))
}

fn wait_bounded(program: &str, mut child: std::process::Child) -> Result<String, String> {
    let limit = MAX_FILE_BYTES;
    let read_all = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(pipe) = pipe {
                // One byte past the limit tells an oversized output from one at the limit.
                let _ = pipe.take(limit + 1).read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = read_all(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = read_all(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + RENDER_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{program} did not finish within {}s",
                    RENDER_TIMEOUT.as_secs()
                ));
            }
            Err(e) => return Err(format!("waiting for {program}: {e}")),
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    if !status.success() {
        return Err(format!(
            "kustomize ({program}) failed: {}",
            kustomize_message(&String::from_utf8_lossy(&stderr))
        ));
    }
    if stdout.len() as u64 > limit {
        return Err(format!("rendered output is over the {limit} byte limit"));
    }
    String::from_utf8(stdout).map_err(|e| format!("{program} printed invalid UTF-8: {e}"))
}

/// The `err="..."` part of kubectl's log line, or the trimmed stderr.
fn kustomize_message(stderr: &str) -> String {
    let trimmed = stderr.trim();
    let quoted = trimmed
        .find("err=\"")
        .map(|start| &trimmed[start + 4..])
        .and_then(|q| q.rfind('"').filter(|&end| end > 0).map(|end| &q[..=end]));
    quoted
        .and_then(|q| serde_json::from_str::<String>(q).ok())
        .unwrap_or_else(|| trimmed.to_string())
}

/// The `(kind, name)` of every document of the manifest files seen so far.
#[derive(Default)]
struct SourceIndex {
    files: BTreeMap<PathBuf, Vec<(String, String)>>,
}

impl SourceIndex {
    fn resource(&mut self, root: &Path, kfile: &Path, mut value: Value) -> Resource {
        let origin = take_origin(&mut value);
        let file = origin
            .map(|p| join_lexically(root, Path::new(&p)))
            .unwrap_or_else(|| kfile.to_path_buf());
        let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
        let name = value
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let docs = self
            .files
            .entry(file.clone())
            .or_insert_with(|| documents(&file));
        let document = docs
            .iter()
            .position(|(k, n)| k == kind && !n.is_empty() && name.contains(n.as_str()))
            .unwrap_or(0);
        Resource {
            value,
            source: Source {
                file,
                document,
                item: None,
            },
        }
    }
}

/// Removes the origin annotation (and an annotation map it leaves empty); returns its `path`.
fn take_origin(value: &mut Value) -> Option<String> {
    let meta = value.get_mut("metadata")?.as_object_mut()?;
    let annotations = meta.get_mut("annotations")?.as_object_mut()?;
    let origin = annotations.remove(ORIGIN_ANNOTATION)?;
    if annotations.is_empty() {
        meta.remove("annotations");
    }
    #[derive(Deserialize)]
    struct Origin {
        path: Option<String>,
    }
    let origin: Origin = serde_norway::from_str(origin.as_str()?).ok()?;
    origin.path
}

/// `(kind, metadata.name)` of each YAML document of `file`; empty when it cannot be read
/// (kustomize has read it already, so this only loses the document index).
fn documents(file: &Path) -> Vec<(String, String)> {
    let Ok(text) = std::fs::read_to_string(file) else {
        return Vec::new();
    };
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| {
            let v = Value::deserialize(doc).unwrap_or(Value::Object(Map::new()));
            let field = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or("").to_string();
            (
                field(v.get("kind")),
                field(v.get("metadata").and_then(|m| m.get("name"))),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_climb_to_the_common_ancestor() {
        assert_eq!(
            relative_to(Path::new("/tmp/.tmpA"), Path::new("/work/deploy/agent")),
            PathBuf::from("../../work/deploy/agent")
        );
        assert_eq!(
            relative_to(Path::new("/work/x"), Path::new("/work/deploy")),
            PathBuf::from("../deploy")
        );
        assert_eq!(
            join_lexically(
                Path::new("/tmp/.tmpA"),
                Path::new("../../work/deploy/a.yaml")
            ),
            PathBuf::from("/work/deploy/a.yaml")
        );
    }

    #[test]
    fn a_missing_tool_is_an_error_naming_it_and_the_package() {
        let e = run_first(&[("dramesh-no-such-kustomize", "build")], Path::new("."))
            .expect_err("no such program");
        assert!(e.contains("`dramesh-no-such-kustomize`"), "{e}");
        assert!(e.contains("Debian package `kubectl`"), "{e}");
    }

    #[test]
    fn kubectl_error_lines_are_reduced_to_the_kustomize_message() {
        let line = r#"E1125 00:23:22.978444   24117 run.go:72] "command failed" err="invalid Kustomization: json: unknown field \"resource\"""#;
        assert_eq!(
            kustomize_message(line),
            r#"invalid Kustomization: json: unknown field "resource""#
        );
        assert_eq!(kustomize_message("  plain error\n"), "plain error");
    }

    #[test]
    fn the_origin_annotation_is_read_and_removed() {
        let mut v = serde_json::json!({
            "kind": "Service",
            "metadata": {"name": "s", "annotations": {ORIGIN_ANNOTATION: "path: ../a/s.yaml\n"}}
        });
        assert_eq!(take_origin(&mut v).as_deref(), Some("../a/s.yaml"));
        assert!(v["metadata"].get("annotations").is_none());
        let mut kept = serde_json::json!({
            "metadata": {"annotations": {ORIGIN_ANNOTATION: "path: x\n", "a": "b"}}
        });
        assert_eq!(take_origin(&mut kept).as_deref(), Some("x"));
        assert_eq!(
            kept["metadata"]["annotations"],
            serde_json::json!({"a": "b"})
        );
    }
}
