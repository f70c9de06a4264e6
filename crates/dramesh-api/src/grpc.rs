//! The gRPC server: Karmada's `Estimator` service (wire-compatible with karmada-scheduler and
//! karmada-descheduler v1.17 through v1.19+) and the native `dramesh.v1.Dramesh` service, on
//! one port (Karmada's default is [`KARMADA_ESTIMATOR_PORT`]).
//!
//! Guarantees: the Karmada methods answer for any cluster of the view named by the request's
//! `cluster` field, and answer 0 rather than an error when the cluster is unknown, stale, or
//! its computation fails or times out (karmada-scheduler discards every cluster's accurate
//! answer when one estimator errors). Only a malformed request gets an error
//! (InvalidArgument, naming the field). Messages above the configured size are refused before decoding
//! (OutOfRange). Every call passes [`GrpcGate`] first: authenticated, and
//! charged its expected memory before it is decoded (RESOURCE_EXHAUSTED when the budget stays
//! full, the Karmada methods included: an error, not a 0 that would read as "does not fit").

use std::net::SocketAddr;

use tonic::{Request, Response, Status};
use tracing::Instrument;

use dramesh_telemetry::spans::fields;

use crate::admission;
use crate::auth::{Caller, Credentials, RefusalKind, Verb};
use crate::backend::{ApiError, Backend};
use crate::metrics::{API_KARMADA, API_NATIVE_GRPC, Method};
use crate::proto::karmada as kpb;
use crate::proto::karmada_service::estimator_server::{Estimator, EstimatorServer};
use crate::proto::native as npb;
use crate::proto::native::dramesh_server::{Dramesh, DrameshServer};
use crate::query::{ComponentSetQuery, ReplicaQuery, UnschedulableQuery};
use crate::server::{ApiState, ServeError, bind};

/// Karmada's default scheduler-estimator port (`--server-port`, `--scheduler-estimator-port`).
pub const KARMADA_ESTIMATOR_PORT: u16 = 10352;

/// The Karmada estimator's gRPC service name (the first segment of its method paths).
pub(crate) const KARMADA_SERVICE: &str =
    crate::proto::karmada_service::estimator_server::SERVICE_NAME;

/// The value of the `object` metadata Karmada attaches (`kind=Deployment, name=ns/name`), for
/// logs. Call it inside the log macro: tracing evaluates it only when the event is enabled.
fn object_of<T>(r: &Request<T>) -> String {
    r.metadata()
        .get("object")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.chars().take(256).collect())
        .unwrap_or_default()
}

/// The credentials a gRPC request presents and what the gate found out about them (the
/// identity it authenticated, the request's admission charge), taken out of it before it is
/// consumed.
struct Creds {
    certificate: Option<crate::auth::Identity>,
    authorization: Option<String>,
    authenticated: Option<crate::auth::Identity>,
    charge: Option<crate::admission::Charge>,
}

impl Creds {
    fn of<T>(r: &Request<T>) -> Creds {
        Creds {
            authenticated: r.extensions().get::<Authenticated>().map(|a| a.0.clone()),
            charge: r
                .extensions()
                .get::<crate::admission::ChargeSlot>()
                .and_then(crate::admission::ChargeSlot::take),
            certificate: r
                .extensions()
                .get::<crate::server::GrpcConnInfo>()
                .and_then(|i| i.certificate.0.clone()),
            // A value that is not ASCII cannot be a bearer token: kept (as empty) so it is
            // refused rather than ignored.
            authorization: r
                .metadata()
                .get("authorization")
                .map(|v| v.to_str().unwrap_or_default().to_owned()),
        }
    }

    async fn check(&self, state: &ApiState, verb: Verb, m: Method) -> Result<Caller, Status> {
        if let Some(id) = &self.authenticated {
            return state
                .auth
                .authorize(id.clone(), verb, &format!("call {}", m.as_str()))
                .map_err(|r| state.auth.refused(&state.metrics, r).into());
        }
        let creds = Credentials {
            certificate: self.certificate.as_ref(),
            authorization: self.authorization.as_deref(),
        };
        Ok(state.caller(&creds, verb, m).await?)
    }
}

/// Serves one RPC inside an `api.request` span, recording its count, latency and code.
async fn observed<T>(
    state: &ApiState,
    api: &'static str,
    method: Method,
    cluster: Option<&str>,
    fut: impl Future<Output = Result<T, Status>>,
) -> Result<Response<T>, Status> {
    let span = dramesh_telemetry::api_span(api, method.as_str());
    if let Some(c) = cluster {
        span.record(fields::CLUSTER, c);
    }
    let timer = state.metrics.start_api_request(api, method.as_str());
    let r = fut.instrument(span.clone()).await;
    // "OK", else tonic's name of the code ("InvalidArgument", "Unavailable").
    let code: std::borrow::Cow<'static, str> = match &r {
        Ok(_) => "OK".into(),
        Err(s) => format!("{:?}", s.code()).into(),
    };
    span.record(fields::CODE, &*code);
    span.record(
        fields::OTEL_STATUS_CODE,
        if r.is_ok() { "ok" } else { "error" },
    );
    timer.finish(&code);
    r.map(Response::new)
}

/// Implements Karmada's `Estimator` service over an [`ApiState`].
#[derive(Clone)]
pub struct KarmadaEstimator {
    state: ApiState,
}

impl KarmadaEstimator {
    /// The service answering from `state`.
    pub fn new(state: ApiState) -> Self {
        KarmadaEstimator { state }
    }

    fn invalid(&self, method: Method, e: impl std::fmt::Display) -> Status {
        tracing::warn!(method = method.as_str(), error = %e, "malformed request");
        Status::invalid_argument(e.to_string())
    }
}

#[tonic::async_trait]
impl Estimator for KarmadaEstimator {
    async fn max_available_replicas(
        &self,
        request: Request<kpb::MaxAvailableReplicasRequest>,
    ) -> Result<Response<kpb::MaxAvailableReplicasResponse>, Status> {
        let m = Method::MaxAvailableReplicas;
        tracing::debug!(
            method = m.as_str(),
            cluster = %request.get_ref().cluster,
            object = %object_of(&request),
            "request"
        );
        let mut creds = Creds::of(&request);
        let req = request.into_inner();
        let cluster = req.cluster.clone();
        observed(&self.state, API_KARMADA, m, Some(&cluster), async move {
            let charge = creds.charge.take();
            creds.check(&self.state, Verb::Read, m).await?;
            let q = ReplicaQuery::from_proto(req).map_err(|e| self.invalid(m, e))?;
            let cluster = q.cluster.clone();
            let n = self
                .state
                .call_karmada(m, &cluster, charge, move |b| b.max_available_replicas(&q))
                .await;
            Ok(kpb::MaxAvailableReplicasResponse { max_replicas: n })
        })
        .await
    }

    async fn max_available_component_sets(
        &self,
        request: Request<kpb::MaxAvailableComponentSetsRequest>,
    ) -> Result<Response<kpb::MaxAvailableComponentSetsResponse>, Status> {
        let m = Method::MaxAvailableComponentSets;
        tracing::debug!(
            method = m.as_str(),
            cluster = %request.get_ref().cluster,
            object = %object_of(&request),
            "request"
        );
        let mut creds = Creds::of(&request);
        let req = request.into_inner();
        let cluster = req.cluster.clone();
        observed(&self.state, API_KARMADA, m, Some(&cluster), async move {
            let charge = creds.charge.take();
            creds.check(&self.state, Verb::Read, m).await?;
            let q = ComponentSetQuery::from_proto(req).map_err(|e| self.invalid(m, e))?;
            let cluster = q.cluster.clone();
            let n = self
                .state
                .call_karmada(m, &cluster, charge, move |b| {
                    b.max_available_component_sets(&q)
                })
                .await;
            Ok(kpb::MaxAvailableComponentSetsResponse { max_sets: n })
        })
        .await
    }

    async fn get_unschedulable_replicas(
        &self,
        request: Request<kpb::UnschedulableReplicasRequest>,
    ) -> Result<Response<kpb::UnschedulableReplicasResponse>, Status> {
        let m = Method::GetUnschedulableReplicas;
        tracing::debug!(
            method = m.as_str(),
            cluster = %request.get_ref().cluster,
            object = %object_of(&request),
            "request"
        );
        let mut creds = Creds::of(&request);
        let req = request.into_inner();
        let cluster = req.cluster.clone();
        observed(&self.state, API_KARMADA, m, Some(&cluster), async move {
            let charge = creds.charge.take();
            creds.check(&self.state, Verb::Read, m).await?;
            let q = UnschedulableQuery::from_proto(req);
            let cluster = q.cluster.clone();
            let n = self
                .state
                .call_karmada(m, &cluster, charge, move |b| b.unschedulable_replicas(&q))
                .await;
            Ok(kpb::UnschedulableReplicasResponse {
                unschedulable_replicas: n,
            })
        })
        .await
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        match e {
            ApiError::InvalidRequest(m) => Status::invalid_argument(m),
            ApiError::NotFound(m) => Status::not_found(m),
            ApiError::Unavailable(m) => Status::unavailable(m),
            ApiError::Overloaded(m) => Status::resource_exhausted(m),
            ApiError::Internal(m) => Status::internal(m),
            ApiError::Refused(r) => match r.kind {
                RefusalKind::Unauthenticated => Status::unauthenticated(r.message),
                RefusalKind::Forbidden => Status::permission_denied(r.message),
                RefusalKind::OverCap => Status::resource_exhausted(r.message),
            },
        }
    }
}

/// Implements the native `dramesh.v1.Dramesh` service over an [`ApiState`].
#[derive(Clone)]
pub struct NativeService {
    state: ApiState,
}

impl NativeService {
    /// The service answering from `state`.
    pub fn new(state: ApiState) -> Self {
        NativeService { state }
    }

    /// Serves an RPC that is exactly one backend call: observed, run under the native call
    /// limits, and its answer converted to the wire message.
    async fn call<T, W, F>(
        &self,
        creds: Creds,
        verb: Verb,
        m: Method,
        cluster: Option<&str>,
        f: F,
    ) -> Result<Response<W>, Status>
    where
        T: Into<W> + Send + 'static,
        F: FnOnce(&dyn Backend, &Caller) -> Result<T, ApiError> + Send + 'static,
    {
        observed(&self.state, API_NATIVE_GRPC, m, cluster, async move {
            let mut creds = creds;
            let charge = creds.charge.take();
            let caller = creds.check(&self.state, verb, m).await?;
            let r = self
                .state
                .call_native(m, charge, move |b| f(b, &caller))
                .await;
            Ok(self.state.note_refusal(r)?.into())
        })
        .await
    }
}

#[tonic::async_trait]
impl Dramesh for NativeService {
    async fn estimate_all(
        &self,
        request: Request<npb::EstimateRequest>,
    ) -> Result<Response<npb::EstimateResponse>, Status> {
        let creds = Creds::of(&request);
        let req = crate::native::EstimateRequest::from(request.into_inner());
        self.call(creds, Verb::Read, Method::EstimateAll, None, move |b, _| {
            b.estimate_all(&req)
        })
        .await
    }

    async fn place(
        &self,
        request: Request<npb::PlaceRequest>,
    ) -> Result<Response<npb::PlaceResponse>, Status> {
        let creds = Creds::of(&request);
        let req = crate::native::PlaceRequest::from(request.into_inner());
        self.call(creds, Verb::Read, Method::Place, None, move |b, _| {
            b.place(&req)
        })
        .await
    }

    async fn preempt(
        &self,
        request: Request<npb::PreemptRequest>,
    ) -> Result<Response<npb::PreemptResponse>, Status> {
        let creds = Creds::of(&request);
        let req = crate::native::PreemptRequest::from(request.into_inner());
        self.call(creds, Verb::Read, Method::Preempt, None, move |b, _| {
            b.preempt(&req)
        })
        .await
    }

    async fn status(
        &self,
        request: Request<npb::StatusRequest>,
    ) -> Result<Response<npb::StatusResponse>, Status> {
        let m = Method::Status;
        let mut creds = Creds::of(&request);
        observed(&self.state, API_NATIVE_GRPC, m, None, async move {
            creds.check(&self.state, Verb::Read, m).await?;
            let charge = creds.charge.take();
            let mut r = self
                .state
                .call_native(m, charge, |b| Ok(b.status()))
                .await?;
            r.ready = self.state.is_ready();
            Ok(r.into())
        })
        .await
    }

    async fn reserve(
        &self,
        request: Request<npb::ReserveRequest>,
    ) -> Result<Response<npb::Reservation>, Status> {
        let creds = Creds::of(&request);
        let req = crate::native::ReserveRequest::from(request.into_inner());
        let cluster = req.cluster.clone();
        self.call(
            creds,
            Verb::Write,
            Method::Reserve,
            Some(&cluster),
            move |b, caller| b.reserve(caller, &req),
        )
        .await
    }

    async fn release(
        &self,
        request: Request<npb::ReleaseRequest>,
    ) -> Result<Response<npb::Reservation>, Status> {
        let mut creds = Creds::of(&request);
        let id = request.into_inner().id;
        let m = Method::Release;
        observed(&self.state, API_NATIVE_GRPC, m, None, async move {
            let caller = creds.check(&self.state, Verb::Write, m).await?;
            let id = required_id(m, id)?;
            let charge = creds.charge.take();
            let r = self
                .state
                .call_native(m, charge, move |b| b.release(&caller, &id))
                .await;
            Ok(self.state.note_refusal(r)?.into())
        })
        .await
    }

    async fn get_reservation(
        &self,
        request: Request<npb::GetReservationRequest>,
    ) -> Result<Response<npb::Reservation>, Status> {
        let mut creds = Creds::of(&request);
        let id = request.into_inner().id;
        let m = Method::GetReservation;
        observed(&self.state, API_NATIVE_GRPC, m, None, async move {
            creds.check(&self.state, Verb::Read, m).await?;
            let id = required_id(m, id)?;
            let charge = creds.charge.take();
            let r = self
                .state
                .call_native(m, charge, move |b| b.reservation(&id))
                .await?;
            Ok(r.into())
        })
        .await
    }

    async fn list_reservations(
        &self,
        request: Request<npb::ListReservationsRequest>,
    ) -> Result<Response<npb::ListReservationsResponse>, Status> {
        let m = Method::ListReservations;
        let mut creds = Creds::of(&request);
        observed(&self.state, API_NATIVE_GRPC, m, None, async move {
            creds.check(&self.state, Verb::Read, m).await?;
            let charge = creds.charge.take();
            let reservations = self
                .state
                .call_native(m, charge, |b| b.reservations())
                .await?;
            Ok(crate::native::ReservationList { reservations }.into())
        })
        .await
    }
}

/// The reservation id of a Release or GetReservation request. Over HTTP it is a path
/// segment and cannot be empty; over gRPC an empty one is a client mistake, not a lookup.
fn required_id(m: Method, id: String) -> Result<String, Status> {
    if id.is_empty() {
        tracing::warn!(method = m.as_str(), "malformed request: empty id");
        return Err(Status::invalid_argument(format!(
            "{} request: field id is required",
            m.as_str()
        )));
    }
    Ok(id)
}

/// The Karmada `Estimator` service with the state's size limit applied.
pub fn karmada_service(state: &ApiState) -> EstimatorServer<KarmadaEstimator> {
    EstimatorServer::new(KarmadaEstimator::new(state.clone()))
        .max_decoding_message_size(state.config.max_request_bytes)
}

/// The native `dramesh.v1.Dramesh` service with the state's size limit applied.
pub fn native_service(state: &ApiState) -> DrameshServer<NativeService> {
    DrameshServer::new(NativeService::new(state.clone()))
        .max_decoding_message_size(state.config.max_request_bytes)
}

/// Serves both gRPC services on `addr` until `shutdown` completes.
pub async fn serve_grpc<F>(addr: SocketAddr, state: ApiState, shutdown: F) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let listener = bind(addr).await?;
    serve_grpc_on(listener, state, shutdown).await
}

/// Serves both gRPC services on an already bound listener (e.g. port 0 in tests).
pub async fn serve_grpc_on<F>(
    listener: tokio::net::TcpListener,
    state: ApiState,
    shutdown: F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    if let Ok(a) = listener.local_addr() {
        tracing::info!(
            addr = %a,
            tls = state.config.tls.is_some(),
            client_certificates = state.config.tls.as_ref().is_some_and(|t| t.client_auth()),
            "gRPC API listening (Karmada Estimator + dramesh.v1)"
        );
    }
    // The server-side timeout backs up the per-call timeouts for the wire part of a request.
    let wire_timeout = state.config.request_timeout + std::time::Duration::from_secs(5);
    let limits = state.config.grpc;
    let gate_state = state.clone();
    tonic::transport::Server::builder()
        .timeout(wire_timeout)
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .layer(tower::layer::layer_fn(move |inner| {
            GrpcGate::new(inner, gate_state.clone())
        }))
        .add_service(karmada_service(&state))
        .add_service(native_service(&state))
        .serve_with_incoming_shutdown(
            crate::server::GrpcIncoming::new(
                listener,
                limits,
                state.metrics.clone(),
                state.config.tls.clone(),
            ),
            shutdown,
        )
        .await?;
    Ok(())
}

/// The identity the gRPC gate authenticated, for the handler to authorize.
#[derive(Debug, Clone)]
pub(crate) struct Authenticated(pub(crate) crate::auth::Identity);

/// Tower middleware around the gRPC services: marks the connection busy while a request is in
/// flight (so idle connections are known, [`crate::server::GrpcLimits`]), authenticates the
/// caller, and charges the request by its message size before tonic decodes it.
#[derive(Clone)]
pub struct GrpcGate<S> {
    inner: S,
    state: crate::server::ApiState,
}

impl<S> GrpcGate<S> {
    /// `inner` gated by `state`'s budget and authentication.
    pub fn new(inner: S, state: crate::server::ApiState) -> GrpcGate<S> {
        GrpcGate { inner, state }
    }
}

type GrpcRequest = tonic::codegen::http::Request<tonic::body::Body>;
type GrpcResponse = tonic::codegen::http::Response<tonic::body::Body>;

impl<S> tonic::codegen::Service<GrpcRequest> for GrpcGate<S>
where
    S: tonic::codegen::Service<GrpcRequest, Response = GrpcResponse> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = GrpcResponse;
    type Error = S::Error;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<GrpcResponse, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: GrpcRequest) -> Self::Future {
        // The ready service answers this call; its clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let state = self.state.clone();
        Box::pin(async move {
            let _busy = req
                .extensions()
                .get::<crate::server::GrpcConnInfo>()
                .and_then(|i| i.activity.as_ref())
                .map(|a| a.enter());
            match gate(&state, req).await {
                Ok(req) => inner.call(req).await,
                Err(status) => Ok(status.into_http()),
            }
        })
    }
}

/// Authenticates and charges one gRPC request (see [`GrpcGate`]).
async fn gate(
    state: &crate::server::ApiState,
    req: GrpcRequest,
) -> Result<GrpcRequest, tonic::Status> {
    use http_body_util::BodyExt;
    let (mut parts, body) = req.into_parts();
    let karmada = parts
        .uri
        .path()
        .starts_with(&format!("/{}/", KARMADA_SERVICE));
    let (api, expansion) = if karmada {
        (
            crate::metrics::API_KARMADA,
            admission::KARMADA_PROTO_EXPANSION,
        )
    } else {
        (
            crate::metrics::API_NATIVE_GRPC,
            admission::NATIVE_PROTO_EXPANSION,
        )
    };
    let certificate = parts
        .extensions
        .get::<crate::server::GrpcConnInfo>()
        .and_then(|i| i.certificate.0.clone());
    // A value that is not ASCII cannot be a bearer token: kept (as empty) so it is refused.
    let authorization = parts
        .headers
        .get("authorization")
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    let creds = crate::auth::Credentials {
        certificate: certificate.as_ref(),
        authorization: authorization.as_deref(),
    };
    let identity = match state.auth.authenticate(&creds).await {
        Ok(id) => id,
        Err(r) => return Err(state.auth.refused(&state.metrics, r).into()),
    };
    // One gRPC message with its 5-byte frame header; tonic refuses larger ones when decoding.
    let limit = state.config.max_request_bytes.saturating_add(5);
    let bytes = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Err(tonic::Status::out_of_range(format!(
                "request message too large (over {} bytes), or not received whole: {e}",
                state.config.max_request_bytes
            )));
        }
    };
    let charge = state
        .budget
        .admit(
            api,
            &identity.user,
            admission::cost(bytes.len() as u64, expansion),
        )
        .await?;
    parts.extensions.insert(Authenticated(identity));
    parts.extensions.insert(admission::ChargeSlot::new(charge));
    Ok(tonic::codegen::http::Request::from_parts(
        parts,
        tonic::body::Body::new(http_body_util::Full::new(bytes)),
    ))
}
