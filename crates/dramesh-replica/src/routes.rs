//! HTTP routes a replica adds to the API crate's router.
//!
//! | Method and path | Answer |
//! |---|---|
//! | `GET /v1/status` | the API crate's status report plus `"digest"` (hex of the mesh digest root over every document held) and, per cluster, `"digest"` (hex XOR of that cluster's document fingerprints) |
//! | `GET /v1/debug/objects?cluster=NAME` | `{"cluster", "objects": {"<Kind>/<ns>/<name>" or "<Kind>/<name>": sha256 hex of the object's stored JSON}}` |
//! | `GET /`, `GET /status` | the status web page (`status_page`) |
//! | `GET /metrics` | the replica's metric set, refreshed from the mesh, store and view first ([`dramesh_mesh::observe`], reservations by `observe`) |
//!
//! Every route here is counted and timed like the API crate's ([`dramesh_api::metrics::track_http`]).
//!
//! Every other path falls through to [`dramesh_api::http_router`]. Replicas holding the same
//! documents at the same heads report equal digests, which is how tests and the chaos suite
//! decide convergence.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use dramesh_api::ApiState;
use dramesh_mesh::DocStore;
use dramesh_model::ObjectChange;
use dramesh_store::hex;
use sha2::{Digest as _, Sha256};

use dramesh_mesh::observe::Observer;

use crate::observe::ReservationCounter;
use crate::state::ReplicaState;

#[derive(Clone)]
struct Routes {
    api: ApiState,
    state: Arc<ReplicaState>,
    observer: Arc<Observer>,
    reservations: Arc<ReservationCounter>,
}

/// The replica's HTTP router: the routes above, then the API crate's.
pub(crate) fn router(api: ApiState, state: Arc<ReplicaState>, observer: Arc<Observer>) -> Router {
    Router::new()
        .route("/v1/status", get(status))
        .route("/v1/debug/objects", get(objects))
        .route("/", get(page))
        .route("/status", get(page))
        .route("/metrics", get(metrics))
        .route_layer(axum::middleware::from_fn_with_state(
            api.metrics.clone(),
            dramesh_api::metrics::track_http,
        ))
        .with_state(Routes {
            api: api.clone(),
            state,
            observer,
            reservations: Arc::new(ReservationCounter::default()),
        })
        .fallback_service(dramesh_api::http_router(api))
}

/// Each cluster of the view with its data age.
fn data_ages(state: &ReplicaState) -> Vec<(String, Option<std::time::Duration>)> {
    let names: Vec<String> = state.with_view(|v| v.clusters().map(|c| c.name.clone()).collect());
    names
        .into_iter()
        .map(|c| {
            let age = state.data_age(&c);
            (c, age)
        })
        .collect()
}

async fn page(State(r): State<Routes>) -> Response {
    let ready = r.api.is_ready();
    let state = r.state.clone();
    let peers = r.observer.peers().await;
    match r.api.run_blocking(move || status_json(&state, ready)).await {
        Ok(v) => Html(crate::status_page::render(&v, &peers)).into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("status page failed: {e}"),
        ),
    }
}

async fn metrics(State(r): State<Routes>) -> Response {
    let state = r.state.clone();
    let observer = r.observer.clone();
    let counter = r.reservations.clone();
    let ages = match r
        .api
        .run_blocking(move || {
            counter.observe(&observer.metrics, &state.reservation_list(true));
            data_ages(&state)
        })
        .await
    {
        Ok(a) => a,
        Err(e) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("metrics failed: {e}"),
            );
        }
    };
    r.observer.refresh(ages).await;
    (
        [(
            axum::http::header::CONTENT_TYPE,
            dramesh_telemetry::CONTENT_TYPE,
        )],
        r.observer.metrics.render(),
    )
        .into_response()
}

fn error(status: StatusCode, message: String) -> Response {
    (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
}

/// The status JSON with digests (see the module docs).
pub(crate) fn status_json(state: &ReplicaState, ready: bool) -> serde_json::Value {
    let mut report = state.status_report();
    report.ready = ready;
    let (root, per_cluster): (u64, Vec<(String, u64)>) = state.with_store(|store| {
        let per = report
            .clusters
            .iter()
            .map(|c| (c.name.clone(), store.cluster_fingerprint(&c.name)))
            .collect();
        (store.digest().root(), per)
    });
    let mut v = serde_json::to_value(&report).unwrap_or_default();
    v["digest"] = format!("{root:016x}").into();
    if let Some(clusters) = v["clusters"].as_array_mut() {
        for (c, (_, fp)) in clusters.iter_mut().zip(per_cluster) {
            c["digest"] = format!("{fp:016x}").into();
        }
    }
    v
}

async fn status(State(r): State<Routes>) -> Response {
    let ready = r.api.is_ready();
    let state = r.state.clone();
    match r.api.run_blocking(move || status_json(&state, ready)).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("status failed: {e}"),
        ),
    }
}

fn query_param(uri: &Uri, name: &str) -> Option<String> {
    uri.query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == name).then(|| v.to_string())
    })
}

/// `"<Kind>/<ns>/<name>"` or `"<Kind>/<name>"` -> sha256 hex of the stored JSON.
pub(crate) fn object_hashes(
    state: &ReplicaState,
    cluster: &str,
) -> serde_json::Map<String, serde_json::Value> {
    let snapshot = state.with_store(|s| s.store().snapshot());
    let mut out = serde_json::Map::new();
    for (c, change) in snapshot {
        if c != cluster {
            continue;
        }
        if let ObjectChange::Upsert { key, json } = change {
            let name = match &key.namespace {
                Some(ns) => format!("{}/{ns}/{}", key.kind, key.name),
                None => format!("{}/{}", key.kind, key.name),
            };
            out.insert(name, hex(&Sha256::digest(&json)).into());
        }
    }
    out
}

async fn objects(State(r): State<Routes>, uri: Uri) -> Response {
    let Some(cluster) = query_param(&uri, "cluster").filter(|c| !c.is_empty()) else {
        return error(
            StatusCode::BAD_REQUEST,
            "query parameter cluster=NAME is required".into(),
        );
    };
    let state = r.state.clone();
    let c = cluster.clone();
    match r.api.run_blocking(move || object_hashes(&state, &c)).await {
        Ok(objects) => axum::Json(serde_json::json!({
            "cluster": cluster,
            "objects": objects,
        }))
        .into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("listing objects failed: {e}"),
        ),
    }
}
