//! The gRPC server: Karmada's `Estimator` service (wire-compatible with karmada-scheduler and
//! karmada-descheduler v1.17 through v1.19+) and the native `dramesh.v1.Dramesh` service, on
//! one port (Karmada's default is [`KARMADA_ESTIMATOR_PORT`]).
//!
//! Guarantees: the Karmada methods answer for any cluster of the view named by the request's
//! `cluster` field, and answer 0 rather than an error when the cluster is unknown, stale, or
//! its computation fails or times out (karmada-scheduler discards every cluster's accurate
//! answer when one estimator errors). Only a malformed request gets an error
//! (InvalidArgument, naming the field). Messages above the configured size are refused before decoding
//! (tonic answers OutOfRange, "decoded message length too large").

use std::net::SocketAddr;

use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::backend::ApiError;
use crate::metrics::Method;
use crate::proto::karmada as kpb;
use crate::proto::karmada_service::estimator_server::{Estimator, EstimatorServer};
use crate::proto::native as npb;
use crate::proto::native::dramesh_server::{Dramesh, DrameshServer};
use crate::query::{ComponentSetQuery, ReplicaQuery, UnschedulableQuery};
use crate::server::{ApiState, ServeError, bind};

/// Karmada's default scheduler-estimator port (`--server-port`, `--scheduler-estimator-port`).
pub const KARMADA_ESTIMATOR_PORT: u16 = 10352;

/// The value of the `object` metadata Karmada attaches (`kind=Deployment, name=ns/name`), for logs.
fn object_of<T>(r: &Request<T>) -> String {
    r.metadata()
        .get("object")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.chars().take(256).collect())
        .unwrap_or_default()
}

/// Implements Karmada's `Estimator` service over an [`ApiState`].
#[derive(Clone)]
pub struct KarmadaEstimator {
    state: ApiState,
}

impl KarmadaEstimator {
    pub fn new(state: ApiState) -> Self {
        KarmadaEstimator { state }
    }

    fn invalid(&self, method: Method, e: impl std::fmt::Display) -> Status {
        self.state.metrics.error(method);
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
        let object = object_of(&request);
        let req = request.into_inner();
        let span = tracing::info_span!("karmada", method = m.as_str(), cluster = %req.cluster, object = %object);
        async move {
            self.state.metrics.request(m);
            let q = ReplicaQuery::from_proto(req).map_err(|e| self.invalid(m, e))?;
            let cluster = q.cluster.clone();
            let n = self
                .state
                .call_karmada(m, &cluster, move |b| b.max_available_replicas(&q))
                .await;
            Ok(Response::new(kpb::MaxAvailableReplicasResponse {
                max_replicas: n,
            }))
        }
        .instrument(span)
        .await
    }

    async fn max_available_component_sets(
        &self,
        request: Request<kpb::MaxAvailableComponentSetsRequest>,
    ) -> Result<Response<kpb::MaxAvailableComponentSetsResponse>, Status> {
        let m = Method::MaxAvailableComponentSets;
        let object = object_of(&request);
        let req = request.into_inner();
        let span = tracing::info_span!("karmada", method = m.as_str(), cluster = %req.cluster, object = %object);
        async move {
            self.state.metrics.request(m);
            let q = ComponentSetQuery::from_proto(req).map_err(|e| self.invalid(m, e))?;
            let cluster = q.cluster.clone();
            let n = self
                .state
                .call_karmada(m, &cluster, move |b| b.max_available_component_sets(&q))
                .await;
            Ok(Response::new(kpb::MaxAvailableComponentSetsResponse {
                max_sets: n,
            }))
        }
        .instrument(span)
        .await
    }

    async fn get_unschedulable_replicas(
        &self,
        request: Request<kpb::UnschedulableReplicasRequest>,
    ) -> Result<Response<kpb::UnschedulableReplicasResponse>, Status> {
        let m = Method::GetUnschedulableReplicas;
        let object = object_of(&request);
        let req = request.into_inner();
        let span = tracing::info_span!("karmada", method = m.as_str(), cluster = %req.cluster, object = %object);
        async move {
            self.state.metrics.request(m);
            let q = UnschedulableQuery::from_proto(req);
            let cluster = q.cluster.clone();
            let n = self
                .state
                .call_karmada(m, &cluster, move |b| b.unschedulable_replicas(&q))
                .await;
            Ok(Response::new(kpb::UnschedulableReplicasResponse {
                unschedulable_replicas: n,
            }))
        }
        .instrument(span)
        .await
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        match e {
            ApiError::InvalidRequest(m) => Status::invalid_argument(m),
            ApiError::NotFound(m) => Status::not_found(m),
            ApiError::Unavailable(m) => Status::unavailable(m),
            ApiError::Internal(m) => Status::internal(m),
        }
    }
}

/// Implements the native `dramesh.v1.Dramesh` service over an [`ApiState`].
#[derive(Clone)]
pub struct NativeService {
    state: ApiState,
}

impl NativeService {
    pub fn new(state: ApiState) -> Self {
        NativeService { state }
    }
}

#[tonic::async_trait]
impl Dramesh for NativeService {
    async fn estimate_all(
        &self,
        request: Request<npb::EstimateRequest>,
    ) -> Result<Response<npb::EstimateResponse>, Status> {
        let req = crate::native::EstimateRequest::from(request.into_inner());
        let span = tracing::info_span!(
            "native",
            method = "EstimateAll",
            clusters = req.clusters.len()
        );
        let r = self
            .state
            .call_native(Method::EstimateAll, move |b| b.estimate_all(&req))
            .instrument(span)
            .await?;
        Ok(Response::new(r.into()))
    }

    async fn place(
        &self,
        request: Request<npb::PlaceRequest>,
    ) -> Result<Response<npb::PlaceResponse>, Status> {
        let req = crate::native::PlaceRequest::from(request.into_inner());
        let span = tracing::info_span!("native", method = "Place", clusters = req.clusters.len());
        let r = self
            .state
            .call_native(Method::Place, move |b| b.place(&req))
            .instrument(span)
            .await?;
        Ok(Response::new(r.into()))
    }

    async fn preempt(
        &self,
        request: Request<npb::PreemptRequest>,
    ) -> Result<Response<npb::PreemptResponse>, Status> {
        let req = crate::native::PreemptRequest::from(request.into_inner());
        let span = tracing::info_span!("native", method = "Preempt", clusters = req.clusters.len());
        let r = self
            .state
            .call_native(Method::Preempt, move |b| b.preempt(&req))
            .instrument(span)
            .await?;
        Ok(Response::new(r.into()))
    }

    async fn status(
        &self,
        _request: Request<npb::StatusRequest>,
    ) -> Result<Response<npb::StatusResponse>, Status> {
        let span = tracing::info_span!("native", method = "Status");
        let mut r = self
            .state
            .call_native(Method::Status, |b| Ok(b.status()))
            .instrument(span)
            .await?;
        r.ready = self.state.is_ready();
        Ok(Response::new(r.into()))
    }
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
        tracing::info!(addr = %a, "gRPC API listening (Karmada Estimator + dramesh.v1)");
    }
    // The server-side timeout backs up the per-call timeouts for the wire part of a request.
    let wire_timeout = state.config.request_timeout + std::time::Duration::from_secs(5);
    tonic::transport::Server::builder()
        .timeout(wire_timeout)
        .add_service(karmada_service(&state))
        .add_service(native_service(&state))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await?;
    Ok(())
}
