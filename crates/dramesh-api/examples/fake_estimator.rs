//! Serves the Karmada estimator and native gRPC API (and optionally HTTP) over the fixed
//! [`demo_table`] backend, so external clients (e.g. `tests/python/karmada_client.py`) can be
//! tested without a mesh.
//!
//! Usage: `cargo run -p dramesh-api --example fake_estimator -- [GRPC_ADDR] [HTTP_ADDR]`
//! (default gRPC `127.0.0.1:10352`, no HTTP, plaintext, anonymous reads allowed). Stops on Ctrl-C.

use std::net::SocketAddr;
use std::sync::Arc;

use dramesh_api::auth::{AUTHENTICATED, Auth, Policy, Subject, UNAUTHENTICATED};
use dramesh_api::table::demo_table;
use dramesh_api::{ApiState, serve_grpc, serve_http};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let mut args = std::env::args().skip(1);
    let grpc: SocketAddr = args
        .next()
        .as_deref()
        .unwrap_or("127.0.0.1:10352")
        .parse()?;
    let http: Option<SocketAddr> = args.next().map(|a| a.parse()).transpose()?;
    // A fake on loopback: anyone, anonymous included, may read (never write).
    let state = ApiState::new(Arc::new(demo_table())).with_auth(Auth::new(Policy {
        readers: vec![
            Subject::Group(UNAUTHENTICATED.into()),
            Subject::Group(AUTHENTICATED.into()),
        ],
        writers: Vec::new(),
        admins: Vec::new(),
    }));
    state.set_ready(true);
    let (tx, rx) = tokio::sync::watch::channel(false);
    let stop = move || {
        let mut rx = rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let grpc_task = tokio::spawn(serve_grpc(grpc, state.clone(), stop()));
    let http_task = http.map(|addr| tokio::spawn(serve_http(addr, state.clone(), stop())));
    tokio::signal::ctrl_c().await?;
    let _ = tx.send(true);
    grpc_task.await??;
    if let Some(t) = http_task {
        t.await??;
    }
    Ok(())
}
