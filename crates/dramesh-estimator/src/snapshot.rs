//! Loading a fleet snapshot from disk: one folder per member cluster (folder name =
//! cluster name) holding YAML/JSON of Nodes, Pods, ResourceSlices, DeviceClasses,
//! ResourceClaims, DeviceTaintRules and an optional ClusterInfo (`cluster.yaml`).
//!
//! Guarantees: every object lands in its folder's cluster through [`View::apply_object`],
//! the same path a replication stream uses; any other kind in a cluster folder is an
//! error naming the file, so a misplaced workload is not silently ignored.

use std::path::{Path, PathBuf};

use dramesh_model::{Manifest, load};

use crate::view::{ApplyError, View};

/// Why a snapshot could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The directory cannot be listed.
    #[error("cannot read snapshot directory {dir}: {message}")]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// The I/O error.
        message: String,
    },
    /// A manifest cannot be read.
    #[error(transparent)]
    Load(Box<load::LoadError>),
    /// A file holds a kind that is not cluster state.
    #[error("{file}: kind {kind} does not belong in a cluster snapshot")]
    UnexpectedKind {
        /// The file.
        file: PathBuf,
        /// The kind found.
        kind: String,
    },
    /// An object cannot be applied to the view.
    #[error("{file}: {source}")]
    Apply {
        /// The file.
        file: PathBuf,
        /// Why.
        #[source]
        source: Box<ApplyError>,
    },
}

impl From<load::LoadError> for SnapshotError {
    fn from(e: load::LoadError) -> Self {
        SnapshotError::Load(Box::new(e))
    }
}

/// Loads every cluster folder of `dir` into a new view.
pub fn load_snapshot(dir: &Path) -> Result<View, SnapshotError> {
    let mut view = View::new();
    let entries = std::fs::read_dir(dir).map_err(|e| SnapshotError::Dir {
        dir: dir.to_path_buf(),
        message: e.to_string(),
    })?;
    let mut folders = Vec::new();
    for e in entries {
        let e = e.map_err(|e| SnapshotError::Dir {
            dir: dir.to_path_buf(),
            message: e.to_string(),
        })?;
        // Follow symbolic links: a linked cluster folder is a cluster folder, and a broken
        // link is an error rather than a silently missing cluster.
        let path = e.path();
        let meta = std::fs::metadata(&path).map_err(|e| SnapshotError::Dir {
            dir: path.clone(),
            message: e.to_string(),
        })?;
        if meta.is_dir() {
            folders.push(path);
        }
    }
    folders.sort();
    if folders.is_empty() {
        return Err(SnapshotError::Dir {
            dir: dir.to_path_buf(),
            message: "no cluster folders (expected one sub-directory per member cluster)".into(),
        });
    }
    for folder in folders {
        let cluster = folder
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        view.ensure_cluster(&cluster);
        for item in load::load_path(&folder)? {
            match item.manifest {
                Manifest::Object(obj) => {
                    view.apply_object(&cluster, obj)
                        .map_err(|source| SnapshotError::Apply {
                            file: item.source.file.clone(),
                            source: Box::new(source),
                        })?
                }
                other => {
                    return Err(SnapshotError::UnexpectedKind {
                        file: item.source.file,
                        kind: other.kind().to_string(),
                    });
                }
            }
        }
    }
    Ok(view)
}
