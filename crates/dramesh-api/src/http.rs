//! The HTTP/JSON server: the native API plus health, readiness and metrics.
//!
//! | Method and path | Body | Answer |
//! |---|---|---|
//! | `POST /v1/estimate` | [`EstimateRequest`] | [`EstimateResponse`](crate::native::EstimateResponse) |
//! | `POST /v1/place` | [`PlaceRequest`] | [`PlaceResponse`](crate::native::PlaceResponse) |
//! | `POST /v1/preempt` | [`PreemptRequest`] | [`PreemptResponse`](crate::native::PreemptResponse) |
//! | `GET /v1/status` | | [`StatusReport`](crate::native::StatusReport) |
//! | `POST /v1/reservations` | [`ReserveRequest`] | [`ReservationStatus`](crate::native::ReservationStatus) (201) |
//! | `GET /v1/reservations` | | [`ReservationList`] |
//! | `GET /v1/reservations/{id}` | | [`ReservationStatus`](crate::native::ReservationStatus) |
//! | `DELETE /v1/reservations/{id}` | | [`ReservationStatus`](crate::native::ReservationStatus), `released` (only on the owner replica) |
//! | `GET /healthz` | | 200 `ok` while the process serves |
//! | `GET /readyz` | | 200 `ready` once the ready flag is set, else 503 `not ready` |
//! | `GET /metrics` | | Prometheus text of [`Metrics`](crate::metrics::Metrics) |
//!
//! Every matched route is counted and timed by [`crate::metrics::track_http`].
//!
//! Guarantees: every request but health, readiness and metrics is charged its expected memory
//! before its body is read ([`crate::admission`]; 503 naming the budget when it stays full);
//! a body not received whole within the header timeout (counted from the end of
//! the headers) gets 408 and the connection is closed, so a client trickling a body cannot
//! hold a connection the cap cannot evict; bodies above the configured limit get 413 before
//! they are parsed; malformed
//! JSON or a field the request type does not know gets 400 with `{"error": "..."}` naming the
//! position or field; backend errors map to
//! 400/404/503/500 with the same error body.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Extension, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::admission::ChargeSlot;
use crate::auth::{Caller, Credentials, RefusalKind, http_verb};
use crate::backend::ApiError;
use crate::metrics::Method;
use crate::native::{
    EstimateRequest, PlaceRequest, PreemptRequest, ReservationList, ReserveRequest,
};
use crate::server::{ApiState, ServeError, bind};
use crate::tls::PeerCert;

fn error_body(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unavailable(_) | ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Refused(r) => match r.kind {
                RefusalKind::Unauthenticated => StatusCode::UNAUTHORIZED,
                RefusalKind::Forbidden => StatusCode::FORBIDDEN,
                RefusalKind::OverCap => StatusCode::TOO_MANY_REQUESTS,
            },
        };
        let mut r = error_body(status, &self.to_string());
        if status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        r
    }
}

fn parse<T: DeserializeOwned>(method: Method, body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        tracing::warn!(method = method.as_str(), error = %e, "malformed JSON body");
        ApiError::InvalidRequest(format!(
            "{} request body is not valid JSON of the expected shape: {e}",
            method.as_str()
        ))
    })
}

fn json<T: Serialize>(r: Result<T, ApiError>) -> Response {
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn estimate(
    State(state): State<ApiState>,
    Extension(charge): Extension<ChargeSlot>,
    body: Bytes,
) -> Response {
    let req: EstimateRequest = match parse(Method::EstimateAll, &body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    drop(body);
    let span = tracing::info_span!(
        "http",
        method = "EstimateAll",
        clusters = req.clusters.len()
    );
    json(
        state
            .call_native(Method::EstimateAll, charge.take(), move |b| {
                b.estimate_all(&req)
            })
            .instrument(span)
            .await,
    )
}

async fn place(
    State(state): State<ApiState>,
    Extension(charge): Extension<ChargeSlot>,
    body: Bytes,
) -> Response {
    let req: PlaceRequest = match parse(Method::Place, &body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    drop(body);
    let span = tracing::info_span!("http", method = "Place", clusters = req.clusters.len());
    json(
        state
            .call_native(Method::Place, charge.take(), move |b| b.place(&req))
            .instrument(span)
            .await,
    )
}

async fn preempt(
    State(state): State<ApiState>,
    Extension(charge): Extension<ChargeSlot>,
    body: Bytes,
) -> Response {
    let req: PreemptRequest = match parse(Method::Preempt, &body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    drop(body);
    let span = tracing::info_span!("http", method = "Preempt", clusters = req.clusters.len());
    json(
        state
            .call_native(Method::Preempt, charge.take(), move |b| b.preempt(&req))
            .instrument(span)
            .await,
    )
}

async fn status(
    State(state): State<ApiState>,
    Extension(charge): Extension<ChargeSlot>,
) -> Response {
    let span = tracing::info_span!("http", method = "Status");
    let ready = state.is_ready();
    json(
        state
            .call_native(Method::Status, charge.take(), |b| Ok(b.status()))
            .instrument(span)
            .await
            .map(|mut s| {
                s.ready = ready;
                s
            }),
    )
}

async fn reserve(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Extension(charge): Extension<ChargeSlot>,
    body: Bytes,
) -> Response {
    let req: ReserveRequest = match parse(Method::Reserve, &body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let span = tracing::info_span!("http", method = "Reserve", cluster = %req.cluster);
    let r = state
        .call_native(Method::Reserve, charge.take(), move |b| {
            b.reserve(&caller, &req)
        })
        .instrument(span)
        .await;
    match state.note_refusal(r) {
        Ok(r) => (StatusCode::CREATED, axum::Json(r)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn list_reservations(
    State(state): State<ApiState>,
    Extension(charge): Extension<ChargeSlot>,
) -> Response {
    let span = tracing::info_span!("http", method = "ListReservations");
    json(
        state
            .call_native(Method::ListReservations, charge.take(), |b| {
                b.reservations()
                    .map(|reservations| ReservationList { reservations })
            })
            .instrument(span)
            .await,
    )
}

async fn get_reservation(
    State(state): State<ApiState>,
    Extension(charge): Extension<ChargeSlot>,
    Path(id): Path<String>,
) -> Response {
    let span = tracing::info_span!("http", method = "GetReservation", id = %id);
    json(
        state
            .call_native(Method::GetReservation, charge.take(), move |b| {
                b.reservation(&id)
            })
            .instrument(span)
            .await,
    )
}

async fn release_reservation(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Extension(charge): Extension<ChargeSlot>,
    Path(id): Path<String>,
) -> Response {
    let span = tracing::info_span!("http", method = "Release", id = %id);
    let r = state
        .call_native(Method::Release, charge.take(), move |b| {
            b.release(&caller, &id)
        })
        .instrument(span)
        .await;
    json(state.note_refusal(r))
}

/// Authenticates and authorizes every request by [`http_verb`] (health, readiness and metrics
/// pass without credentials) and hands the [`Caller`] to the handler; refuses with 401/403.
async fn authenticate(
    State(state): State<ApiState>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(verb) = http_verb(req.method(), req.uri().path()) else {
        return next.run(req).await;
    };
    let certificate = req.extensions().get::<PeerCert>().and_then(|p| p.0.clone());
    // A header that is not ASCII cannot carry a token: kept (as empty) so it is refused.
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    let path: String = req.uri().path().chars().take(200).collect();
    let what = format!("{} {path}", req.method());
    let creds = Credentials {
        certificate: certificate.as_ref(),
        authorization: authorization.as_deref(),
    };
    match state.auth.check(&state.metrics, &creds, verb, &what).await {
        Ok(caller) => {
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

/// `router` with every request authenticated and authorized by `state`'s [`crate::auth::Auth`]
/// (see [`crate::auth`]). The daemon applies it once, around all its routes.
pub fn with_auth(router: Router, state: &ApiState) -> Router {
    router.layer(axum::middleware::from_fn_with_state(
        state.clone(),
        authenticate,
    ))
}

async fn retire_cluster(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Extension(charge): Extension<ChargeSlot>,
    Path(name): Path<String>,
) -> Response {
    let span = tracing::info_span!("http", method = "RetireCluster", cluster = %name);
    json(
        state
            .call_native(Method::RetireCluster, charge.take(), move |b| {
                b.retire_cluster(&name, &caller.identity.user)
            })
            .instrument(span)
            .await,
    )
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<ApiState>) -> Response {
    if state.is_ready() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}

async fn metrics(State(state): State<ApiState>) -> Response {
    (
        [(header::CONTENT_TYPE, dramesh_telemetry::CONTENT_TYPE)],
        state.metrics.render(),
    )
        .into_response()
}

/// Charges the request its expected memory ([`crate::admission`]: by its declared size, or the
/// size limit when it declares none), then reads the whole body within `header_timeout` and
/// the size limit before the route runs (408 and close, or 413, otherwise) and lowers the
/// charge to the body's real size. A request the budget refuses gets 503 naming the budget,
/// after its body was read and discarded (never buffered, never parsed). Health, readiness
/// and metrics are never charged.
async fn admit_and_read_body(
    State(state): State<ApiState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use crate::admission::{JSON_EXPANSION, cost};
    use http_body_util::BodyExt;
    let (mut parts, body) = req.into_parts();
    let limit = state.config.max_request_bytes;
    let wait = state.config.http.header_timeout;
    let mut charge = None;
    if http_verb(&parts.method, parts.uri.path()).is_some() {
        let declared = axum::body::HttpBody::size_hint(&body)
            .upper()
            .map_or(limit as u64, |n| n.min(limit as u64));
        let who = parts
            .extensions
            .get::<Caller>()
            .map_or(crate::auth::ANONYMOUS, |c| c.identity.user.as_str())
            .to_owned();
        match state
            .budget
            .admit(
                crate::metrics::API_HTTP,
                &who,
                cost(declared, JSON_EXPANSION),
            )
            .await
        {
            Ok(c) => charge = Some(c),
            Err(e) => {
                // Read what the client sends and drop it, so it sees the answer rather than a
                // reset connection; at most the size limit, within the header timeout.
                let mut body = body;
                let mut left = limit;
                let drained = tokio::time::timeout(wait, async {
                    while let Some(Ok(f)) = body.frame().await {
                        let n = f.data_ref().map_or(0, |d| d.len());
                        if n > left {
                            return false;
                        }
                        left -= n;
                    }
                    true
                })
                .await
                .unwrap_or(false);
                let mut r = e.into_response();
                if !drained {
                    r.headers_mut().insert(
                        header::CONNECTION,
                        header::HeaderValue::from_static("close"),
                    );
                }
                return r;
            }
        }
    }
    let bytes = match tokio::time::timeout(wait, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            return if too_large {
                error_body(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("request body exceeds {limit} bytes"),
                )
            } else {
                error_body(StatusCode::BAD_REQUEST, &format!("reading the body: {e}"))
            };
        }
        Err(_) => {
            let mut r = error_body(
                StatusCode::REQUEST_TIMEOUT,
                &format!("the request body did not arrive within {wait:?}"),
            );
            r.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
            return r;
        }
    };
    if let Some(c) = &mut charge {
        c.lower_to(cost(bytes.len() as u64, JSON_EXPANSION));
    }
    parts
        .extensions
        .insert(charge.map(ChargeSlot::new).unwrap_or_default());
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

/// The HTTP routes over `state`, with the body size limit applied.
pub fn http_router(state: ApiState) -> Router {
    let limit = state.config.max_request_bytes;
    Router::new()
        .route("/v1/estimate", post(estimate))
        .route("/v1/place", post(place))
        .route("/v1/preempt", post(preempt))
        .route("/v1/status", get(status))
        .route("/v1/reservations", post(reserve).get(list_reservations))
        .route(
            "/v1/reservations/{id}",
            get(get_reservation).delete(release_reservation),
        )
        .route("/v1/clusters/{name}", delete(retire_cluster))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            admit_and_read_body,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state.metrics.clone(),
            crate::metrics::track_http,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Serves the HTTP API on `addr` until `shutdown` completes.
pub async fn serve_http<F>(addr: SocketAddr, state: ApiState, shutdown: F) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let listener = bind(addr).await?;
    serve_http_on(listener, state, shutdown).await
}

/// Serves the HTTP API on an already bound listener (e.g. port 0 in tests).
pub async fn serve_http_on<F>(
    listener: tokio::net::TcpListener,
    state: ApiState,
    shutdown: F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    if let Ok(a) = listener.local_addr() {
        tracing::info!(addr = %a, tls = state.config.tls.is_some(), "HTTP API listening");
    }
    serve_router(
        listener,
        with_auth(http_router(state.clone()), &state),
        &state,
        shutdown,
    )
    .await
}

/// Serves `router` (already wrapped by [`with_auth`]) on `listener` with the state's HTTP
/// bounds, over TLS when the state's config has it.
pub async fn serve_router<F>(
    listener: tokio::net::TcpListener,
    router: Router,
    state: &ApiState,
    shutdown: F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let limits = state.config.http;
    let metrics = state.metrics.clone();
    let name = crate::server::HTTP_API_LISTENER;
    match &state.config.tls {
        Some(tls) => {
            dramesh_telemetry::serve_bounded_with(
                listener,
                router,
                tls.http_handshake(),
                name,
                limits,
                metrics,
                shutdown,
            )
            .await
        }
        None => {
            dramesh_telemetry::serve_bounded(listener, router, name, limits, metrics, shutdown)
                .await
        }
    }
    .map_err(ServeError::Http)
}
