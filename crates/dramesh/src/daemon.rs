//! What the agent and the replica share as running daemons: a stop signal watched by their
//! tasks, and one shutdown order (signal, drain the tasks for at most 5 s, then the mesh node).

use std::sync::Arc;
use std::time::Duration;

use dramesh_mesh::node::MeshHandle;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Resolves once `true` is sent on the stop channel (or its sender is gone).
pub async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

/// Signals stop, waits up to 5 s for the tasks to finish (then aborts the rest), and shuts the
/// mesh node down if no task still holds it.
pub async fn shutdown(stop: &watch::Sender<bool>, tasks: &mut JoinSet<()>, mesh: Arc<MeshHandle>) {
    let _ = stop.send(true);
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(5), drain)
        .await
        .is_err()
    {
        tasks.abort_all();
    }
    match Arc::try_unwrap(mesh) {
        Ok(m) => m.shutdown().await,
        Err(m) => drop(m),
    }
}
