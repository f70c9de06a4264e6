//! `GET /metrics` for a daemon's HTTP server.
//!
//! The route renders the registry on every scrape (no caching, so values are never stale) and
//! answers with [`crate::CONTENT_TYPE`]. Merge it into an existing axum router or serve it alone
//! with [`serve_metrics`].

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;
use crate::registry::CONTENT_TYPE;

/// The scrape path.
pub const METRICS_PATH: &str = "/metrics";

/// A router with only `GET /metrics`.
pub fn metrics_router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(METRICS_PATH, get(scrape))
        .with_state(metrics)
}

async fn scrape(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics.render())
}

/// Serves [`metrics_router`] on `listener` until `shutdown` resolves.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, metrics_router(metrics))
        .with_graceful_shutdown(shutdown)
        .await
}
