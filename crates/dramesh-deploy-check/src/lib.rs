//! Checks the deployment manifests under `deploy/` the way an API server with strict field
//! validation would see them after `kubectl apply -k`.
//!
//! Two steps:
//!
//! 1. [`compose`] builds a kustomization in pure Rust, for the subset of kustomize the
//!    manifests use (see [`kustomize`] for the exact list). Anything outside that subset is an
//!    error naming the kustomization file and field, never silently ignored, so a composed
//!    result is either what kustomize would produce or an error.
//! 2. [`decode`] decodes every composed object into its typed `k8s-openapi` value with
//!    [`dramesh_model::load::decode_value`], which re-encodes the value and reports any field
//!    the type dropped as `unknown field`. cert-manager kinds, absent from `k8s-openapi`, are
//!    decoded into the hand-written schema in [`certmanager`], which rejects unknown fields
//!    too. A kind with no typed schema here is an error.
//!
//! Every error is a [`LoadError`] naming the source file, the YAML document, the object and
//! the field.

// LoadError is large (file, indices, object, field) by design; it is built only on failure.
#![allow(clippy::result_large_err)]

pub mod certmanager;
pub mod kustomize;
pub mod patch;
pub mod typed;

use std::path::{Path, PathBuf};

pub use dramesh_model::{LoadError, Source};
pub use kustomize::{Resource, compose, find_kustomization};
pub use typed::{Checked, Typed, decode};

/// Composes the kustomization in `dir` and decodes every resulting object strictly.
pub fn check(dir: &Path) -> Result<Vec<Checked>, LoadError> {
    compose(dir)?.iter().map(decode).collect()
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
            .map_err(|e| kustomize::file_error(&dir, format!("cannot list: {e}")))?;
        for entry in entries {
            let entry =
                entry.map_err(|e| kustomize::file_error(&dir, format!("cannot list: {e}")))?;
            let is_dir = entry
                .file_type()
                .map_err(|e| kustomize::file_error(&entry.path(), e.to_string()))?
                .is_dir();
            if is_dir {
                stack.push(entry.path());
            }
        }
    }
    found.sort();
    Ok(found)
}
