//! The folder source: a directory of manifests (one cluster) polled for changes.
//!
//! Every `poll_every` the folder's `.yaml`/`.yml`/`.json` files are listed. A file whose
//! modification time and size are unchanged since the last poll, and whose mtime is older
//! than the previous poll (so a same-size rewrite within the file system's timestamp
//! granularity cannot hide), is skipped; otherwise it is read and its SHA-256 compared, and
//! only a changed content is decoded with the strict loader. The union of all files' objects
//! is diffed against what was published last, giving upserts and deletes.
//!
//! A file that fails to load (half-written, invalid YAML, an unknown field) is reported with
//! `tracing::warn!` and its previously loaded objects are KEPT: a broken save must not
//! delete state. Removing the file deletes its objects. A folder that cannot be listed keeps
//! everything as well. An entry that cannot be examined (a symlink loop or a dangling link, a
//! subfolder or file without permission) is reported by path and reason with
//! `tracing::warn!`, again once a minute while it lasts and at once when its error changes;
//! the rest of the folder is published as usual, and a file that was readable before keeps its
//! objects. Reads never follow a loop, so nothing hangs.
//!
//! Objects are published as loaded (not trimmed), so unbound pods appear with their full
//! status, including the `PodScheduled` condition the unschedulable-replica count reads.
//!
//! Scope: a folder has no per-node agents or leader, so everything is published under
//! `Scope::Cluster { term }` with the configured term; the first batch is a snapshot.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use dramesh_model::load::{self, MAX_FILE_BYTES};
use dramesh_model::{Manifest, ObjectKey};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::batch::{Scope, SourceEvent};
use crate::mirror::diff_states;

/// Settings of the folder source.
#[derive(Debug, Clone)]
pub struct DirConfig {
    /// How often the folder is re-read.
    pub poll_every: Duration,
    /// Term of the `Scope::Cluster` the folder is published under.
    pub term: u64,
}

impl Default for DirConfig {
    fn default() -> Self {
        DirConfig {
            poll_every: Duration::from_millis(500),
            term: 0,
        }
    }
}

#[derive(Debug, Clone)]
struct FileState {
    mtime: Option<SystemTime>,
    size: u64,
    hash: [u8; 32],
    objects: Objects,
}

/// The folder's last seen files and their objects.
#[derive(Debug, Default)]
pub struct DirState {
    files: BTreeMap<PathBuf, FileState>,
    last_poll: Option<SystemTime>,
    /// Entries that could not be examined: the error last reported for each, and when.
    unreadable: BTreeMap<PathBuf, (String, Instant)>,
}

/// How often an entry that stays unreadable is reported again.
const REPORT_EVERY: Duration = Duration::from_secs(60);

type Objects = Vec<(ObjectKey, Arc<[u8]>)>;

fn read_objects(path: &Path, bytes: &[u8]) -> Result<Objects, String> {
    let text =
        std::str::from_utf8(bytes).map_err(|e| format!("{}: not UTF-8: {e}", path.display()))?;
    let loaded = load::load_str(path, text).map_err(|e| e.to_string())?;
    Ok(loaded
        .into_iter()
        .filter_map(|l| match l.manifest {
            Manifest::Object(o) => Some((o.key(), o.to_json().into())),
            other => {
                tracing::debug!(file = %path.display(), kind = other.kind(), "ignoring non-cluster-state manifest");
                None
            }
        })
        .collect())
}

impl DirState {
    /// Re-reads what changed below `dir` and returns the current objects by key. When two
    /// files define the same object the later path wins.
    pub fn poll(&mut self, dir: &Path) -> BTreeMap<ObjectKey, Arc<[u8]>> {
        let poll_started = SystemTime::now();
        match load::list_manifest_files(dir) {
            Ok(listing) => {
                let paths = listing.files;
                // Files below an entry that cannot be examined (a folder without permission)
                // keep their objects, as a file that does not load does.
                let hidden = |p: &Path| listing.unreadable.iter().any(|(q, _)| p.starts_with(q));
                self.files.retain(|p, _| paths.contains(p) || hidden(p));
                self.unreadable.retain(|p, _| {
                    paths.contains(p) || listing.unreadable.iter().any(|(q, _)| q == p)
                });
                for (p, why) in listing.unreadable {
                    self.report_unreadable(&p, why);
                }
                for p in paths {
                    self.poll_file(&p);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot list manifest folder; keeping the last state")
            }
        }
        self.last_poll = Some(poll_started);
        let mut out = BTreeMap::new();
        for f in self.files.values() {
            for (k, j) in &f.objects {
                out.insert(k.clone(), j.clone());
            }
        }
        out
    }

    /// Entries that could not be examined, with why (e.g. a symlink loop).
    pub fn unreadable(&self) -> impl Iterator<Item = (&Path, &str)> {
        self.unreadable
            .iter()
            .map(|(p, (e, _))| (p.as_path(), e.as_str()))
    }

    /// Notes that `path` cannot be examined, logging it when it is new, its error changed, or
    /// it was last logged [`REPORT_EVERY`] ago.
    fn report_unreadable(&mut self, path: &Path, why: String) {
        let due = match self.unreadable.get(path) {
            Some((e, at)) => *e != why || at.elapsed() >= REPORT_EVERY,
            None => true,
        };
        if due {
            tracing::warn!(file = %path.display(), error = %why, "cannot examine an entry of the manifest folder; publishing the rest, keeping its previous objects (reported again once a minute while it lasts)");
            self.unreadable
                .insert(path.to_path_buf(), (why, Instant::now()));
        }
    }

    fn poll_file(&mut self, path: &Path) {
        let meta = match std::fs::metadata(path) {
            Ok(m) => {
                self.unreadable.remove(path);
                m
            }
            // Gone between listing and reading: the next listing drops it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !is_symlink(path) => return,
            Err(e) => {
                let why = if is_symlink(path) {
                    format!("symbolic link cannot be followed: {e}")
                } else {
                    e.to_string()
                };
                self.report_unreadable(path, why);
                return;
            }
        };
        let mtime = meta.modified().ok();
        let prev = self.files.get(path);
        let settled = match (mtime, self.last_poll) {
            (Some(m), Some(last)) => m + Duration::from_secs(2) < last,
            _ => false,
        };
        if let Some(p) = prev
            && p.mtime == mtime
            && p.size == meta.len()
            && settled
        {
            return;
        }
        if meta.len() > MAX_FILE_BYTES {
            tracing::warn!(file = %path.display(), size = meta.len(), limit = MAX_FILE_BYTES, "manifest file too large; keeping its previous objects");
            return;
        }
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) => {
                self.report_unreadable(path, format!("cannot read: {e}"));
                return;
            }
        };
        let hash: [u8; 32] = Sha256::digest(&bytes).into();
        if let Some(p) = self.files.get_mut(path)
            && p.hash == hash
        {
            p.mtime = mtime;
            p.size = meta.len();
            return;
        }
        match read_objects(path, &bytes) {
            Ok(objects) => {
                self.files.insert(
                    path.to_path_buf(),
                    FileState {
                        mtime,
                        size: meta.len(),
                        hash,
                        objects,
                    },
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "manifest file does not load; keeping its previous objects");
                // Remember the broken content so it is not re-reported every poll; its
                // objects stay as they were.
                let objects = self
                    .files
                    .get(path)
                    .map(|p| p.objects.clone())
                    .unwrap_or_default();
                self.files.insert(
                    path.to_path_buf(),
                    FileState {
                        mtime,
                        size: meta.len(),
                        hash,
                        objects,
                    },
                );
            }
        }
    }
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// Polls `dir` until `tx` is closed. The first event is a snapshot of the folder; later
/// ones carry only differences.
pub async fn run_dir_source(dir: PathBuf, cfg: DirConfig, tx: mpsc::Sender<SourceEvent>) {
    let scope = Scope::Cluster { term: cfg.term };
    let mut state = DirState::default();
    let mut published: Option<BTreeMap<ObjectKey, Arc<[u8]>>> = None;
    loop {
        let (s, current) = {
            let dir = dir.clone();
            let mut s = std::mem::take(&mut state);
            // File reads and YAML decoding block; keep them off the async workers.
            match tokio::task::spawn_blocking(move || {
                let cur = s.poll(&dir);
                (s, cur)
            })
            .await
            {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "folder poll failed");
                    return;
                }
            }
        };
        state = s;
        let ev = match &published {
            None => Some(SourceEvent::Snapshot {
                scope: scope.clone(),
                changes: diff_states(&BTreeMap::new(), &current),
            }),
            Some(old) => {
                let changes = diff_states(old, &current);
                (!changes.is_empty()).then(|| SourceEvent::Changes {
                    scope: scope.clone(),
                    changes,
                })
            }
        };
        published = Some(current);
        if let Some(ev) = ev
            && tx.send(ev).await.is_err()
        {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(cfg.poll_every) => {}
            () = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::ObjectKind;

    const NODE_A: &str = "apiVersion: v1\nkind: Node\nmetadata:\n  name: a\n";
    const NODE_B: &str = "apiVersion: v1\nkind: Node\nmetadata:\n  name: b\n";

    fn names(m: &BTreeMap<ObjectKey, Arc<[u8]>>) -> Vec<String> {
        m.keys().map(|k| k.name.clone()).collect()
    }

    #[test]
    fn broken_file_keeps_previous_objects_and_removal_deletes() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("nodes.yaml");
        std::fs::write(&f, format!("{NODE_A}---\n{NODE_B}")).unwrap();
        let mut s = DirState::default();
        assert_eq!(names(&s.poll(dir.path())), ["a", "b"]);
        // Half-written: the second document is cut.
        std::fs::write(
            &f,
            format!("{NODE_A}---\napiVersion: v1\nkind: Node\nmetadata: ["),
        )
        .unwrap();
        assert_eq!(names(&s.poll(dir.path())), ["a", "b"]);
        std::fs::write(&f, NODE_A).unwrap();
        assert_eq!(names(&s.poll(dir.path())), ["a"]);
        std::fs::remove_file(&f).unwrap();
        assert!(s.poll(dir.path()).is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn symlink_loops_are_reported_by_path_and_do_not_hang() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), NODE_A).unwrap();
        // A link to itself, and two links to each other.
        std::os::unix::fs::symlink("self.yaml", dir.path().join("self.yaml")).unwrap();
        std::os::unix::fs::symlink("y.yaml", dir.path().join("x.yaml")).unwrap();
        std::os::unix::fs::symlink("x.yaml", dir.path().join("y.yaml")).unwrap();
        // A link to the folder itself: not a manifest, never descended into.
        std::os::unix::fs::symlink(".", dir.path().join("again")).unwrap();
        let mut st = DirState::default();
        assert_eq!(names(&st.poll(dir.path())), vec!["a"]);
        let bad: Vec<(String, String)> = st
            .unreadable()
            .map(|(p, e)| {
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    e.to_string(),
                )
            })
            .collect();
        let files: Vec<&str> = bad.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(files, vec!["self.yaml", "x.yaml", "y.yaml"]);
        for (f, e) in &bad {
            assert!(e.contains("symbolic link"), "{f}: {e}");
        }
        // Fixing one clears it; the others stay reported.
        std::fs::remove_file(dir.path().join("self.yaml")).unwrap();
        st.poll(dir.path());
        assert_eq!(st.unreadable().count(), 2);
    }

    #[cfg(unix)]
    #[test]
    fn unreadable_entries_are_reported_and_the_rest_published() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), NODE_A).unwrap();
        // A loop of links without a manifest name, and a subfolder that cannot be listed.
        std::os::unix::fs::symlink("loop", dir.path().join("loop")).unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join("b.yaml"), NODE_B).unwrap();
        let mut st = DirState::default();
        assert_eq!(names(&st.poll(dir.path())), ["a", "b"]);
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o000)).unwrap();
        let listable = std::fs::read_dir(&sub).is_ok(); // root reads any folder
        let now = st.poll(dir.path());
        let bad: Vec<String> = st
            .unreadable()
            .map(|(p, e)| format!("{}: {e}", p.display()))
            .collect();
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(
            bad.iter()
                .any(|b| b.contains("/loop: symbolic link cannot be followed")),
            "{bad:?}"
        );
        if !listable {
            assert!(
                bad.iter().any(|b| b.contains("/sub: cannot list")),
                "{bad:?}"
            );
        }
        // b.yaml cannot be seen for now: its objects stay, like a's.
        assert_eq!(names(&now), ["a", "b"]);
    }

    #[test]
    fn same_size_rewrite_is_noticed() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("n.yaml");
        std::fs::write(&f, NODE_A).unwrap();
        let mut s = DirState::default();
        let first = s.poll(dir.path());
        std::fs::write(&f, NODE_B).unwrap(); // same length, likely same mtime tick
        let second = s.poll(dir.path());
        assert_eq!(names(&first), ["a"]);
        assert_eq!(names(&second), ["b"]);
        let k = ObjectKey::new(ObjectKind::Node, None, "b");
        assert!(second.contains_key(&k));
    }

    #[test]
    fn unbound_pods_are_published_with_their_scheduling_condition() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("pending.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: ml}\n\
             spec: {containers: [{name: c}]}\n\
             status: {phase: Pending, conditions: [{type: PodScheduled, status: 'False', \
             reason: Unschedulable, lastTransitionTime: '2025-01-01T00:00:00Z'}]}\n",
        )
        .unwrap();
        let objs = DirState::default().poll(dir.path());
        let json = &objs[&ObjectKey::new(ObjectKind::Pod, Some("ml"), "p")];
        let v: serde_json::Value = serde_json::from_slice(json).unwrap();
        assert!(v["spec"].get("nodeName").is_none());
        assert_eq!(v["status"]["conditions"][0]["reason"], "Unschedulable");
        assert_eq!(
            v["status"]["conditions"][0]["lastTransitionTime"],
            "2025-01-01T00:00:00Z"
        );
    }

    /// The real dra-example-driver file (a Namespace, a ResourceClaimTemplate, two Pods)
    /// dropped into the folder publishes the template under its namespaced key.
    #[test]
    fn resource_claim_templates_are_published() {
        let Some(real) = dramesh_testkit::fixtures(
            "real/dra-example-driver/demo-examples/basic-resourceclaimtemplate/basic-resourceclaimtemplate.yaml",
        ) else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(&real, dir.path().join("templates.yaml")).unwrap();
        let mut s = DirState::default();
        let objs = s.poll(dir.path());
        let key = ObjectKey::new(
            ObjectKind::ResourceClaimTemplate,
            Some("basic-resourceclaimtemplate"),
            "single-gpu",
        );
        let v: serde_json::Value = serde_json::from_slice(&objs[&key]).unwrap();
        assert_eq!(
            v["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"],
            "gpu.example.com"
        );
        let kinds: Vec<ObjectKind> = objs.keys().map(|k| k.kind).collect();
        assert_eq!(
            kinds,
            [
                ObjectKind::Pod,
                ObjectKind::Pod,
                ObjectKind::ResourceClaimTemplate
            ],
            "the Namespace is not cluster state"
        );
        std::fs::remove_file(dir.path().join("templates.yaml")).unwrap();
        assert!(s.poll(dir.path()).is_empty());
    }

    #[tokio::test]
    async fn source_sends_snapshot_then_changes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), NODE_A).unwrap();
        let (tx, mut rx) = mpsc::channel(16);
        let cfg = DirConfig {
            poll_every: Duration::from_millis(20),
            term: 7,
        };
        let h = tokio::spawn(run_dir_source(dir.path().to_path_buf(), cfg, tx));
        let first = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        let SourceEvent::Snapshot { scope, changes } = first else {
            panic!("expected a snapshot")
        };
        assert_eq!(scope, Scope::Cluster { term: 7 });
        assert_eq!(changes.len(), 1);
        std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
        let next = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        let SourceEvent::Changes { changes, .. } = next else {
            panic!("expected changes")
        };
        assert!(
            matches!(&changes[..], [dramesh_model::ObjectChange::Delete { key }] if key.name == "a")
        );
        drop(rx);
        tokio::time::timeout(Duration::from_secs(10), h)
            .await
            .unwrap()
            .unwrap();
    }
}
