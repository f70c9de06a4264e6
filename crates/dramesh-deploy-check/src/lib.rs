//! Checks the deployment manifests under `deploy/` the way an API server with strict field
//! validation would see them after `kubectl apply -k`.
//!
//! Two steps:
//!
//! 1. [`render`] builds a kustomization with the real kustomize (`kubectl kustomize`), keeping
//!    for every object the manifest file it came from.
//! 2. [`decode`] decodes every rendered object into its typed `k8s-openapi` value with
//!    [`dramesh_model::load::decode_value`], which re-encodes the value and reports any field
//!    the type dropped as `unknown field`. cert-manager kinds, absent from `k8s-openapi`, are
//!    decoded into the hand-written schema in [`certmanager`], which rejects unknown fields
//!    too; Karmada kinds are checked against Karmada's CRD schemas ([`karmada`]). A kind with
//!    no typed schema here is an error.
//!
//! Every error is a [`LoadError`] naming the source file, the object and the field; a
//! kustomize error names the kustomization file and carries kustomize's message.

// LoadError is large (file, indices, object, field) by design; it is built only on failure.
#![allow(clippy::result_large_err)]

pub mod certmanager;
pub mod karmada;
mod render;
mod typed;

use std::path::{Path, PathBuf};

pub use dramesh_model::{LoadError, Source};
pub use render::{KUSTOMIZATION_FILES, RENDER_TIMEOUT, Resource, find_kustomization, render};
pub use typed::{Checked, KNOWN_KINDS, Typed, decode};

/// Renders the kustomization in `dir` and decodes every resulting object strictly.
pub fn check(dir: &Path) -> Result<Vec<Checked>, LoadError> {
    render(dir)?.iter().map(decode).collect()
}

/// Every directory at or below `root` that holds a kustomization file, sorted by path.
pub fn kustomization_dirs(root: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if find_kustomization(&dir).is_some() {
            found.push(dir.clone());
        }
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| LoadError::file(&dir, format!("cannot list: {e}")))?;
        for entry in entries {
            let entry = entry.map_err(|e| LoadError::file(&dir, format!("cannot list: {e}")))?;
            let is_dir = entry
                .file_type()
                .map_err(|e| LoadError::file(&entry.path(), e.to_string()))?
                .is_dir();
            if is_dir {
                stack.push(entry.path());
            }
        }
    }
    found.sort();
    Ok(found)
}
