//! What the agent and the replica daemons share around a mesh node: opening their store
//! (reporting what was dropped), a stop signal watched by their tasks, and one shutdown order
//! (signal, drain the tasks for at most [`DRAIN_LIMIT`], then the mesh node).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dramesh_store::{Durability, Store, StoreConfig, StoreError};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::node::MeshHandle;

/// Opens the store directory, or an in-memory store without durability when `dir` is `None`
/// (the demo). Corrupt files and torn tails the store dropped are logged as warnings, naming
/// `what` (the daemon) and the file.
pub fn open_store(dir: Option<&Path>, what: &str) -> Result<Store, StoreError> {
    let Some(dir) = dir else {
        return Ok(Store::in_memory(StoreConfig {
            durability: Durability::None,
            ..StoreConfig::default()
        }));
    };
    let (store, report) = Store::open(dir, StoreConfig::default())?;
    for c in &report.corrupt {
        tracing::warn!(
            daemon = what,
            path = %c.path.display(),
            moved_to = %c.moved_to.display(),
            doc = ?c.doc,
            reason = %c.reason,
            "corrupt document file dropped; it will be resynced from peers"
        );
    }
    for t in &report.truncated {
        tracing::warn!(daemon = what, doc = %t.doc, bytes = t.bytes, "torn tail of an interrupted write truncated");
    }
    tracing::info!(daemon = what, dir = %dir.display(), loaded = report.loaded, corrupt = report.corrupt.len(), "store opened");
    Ok(store)
}

/// Resolves once `true` is sent on the stop channel (or its sender is gone).
pub async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

/// Longest [`shutdown`] waits for a daemon's tasks before aborting them. Short, so that with
/// the mesh's own close the whole stop fits the binary's 5 s shutdown bound.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// Signals stop, waits up to [`DRAIN_LIMIT`] for the tasks to finish (then aborts the rest),
/// and shuts the mesh node down if no task still holds it.
pub async fn shutdown(stop: &watch::Sender<bool>, tasks: &mut JoinSet<()>, mesh: Arc<MeshHandle>) {
    let _ = stop.send(true);
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(DRAIN_LIMIT, drain).await.is_err() {
        tasks.abort_all();
    }
    match Arc::try_unwrap(mesh) {
        Ok(m) => m.shutdown().await,
        Err(m) => drop(m),
    }
}
