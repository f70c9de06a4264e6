//! Admission by cost (issue 32 item 1) at the API level: requests over the budget wait, then
//! are refused unparsed, naming the budget; a request's charge is held until its worker
//! stops, not until its answer; a client that goes away stops its worker.

use crate::common;

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::{Duration, Instant};

use common::*;
use dramesh_api::admission::{BudgetLimits, JSON_EXPANSION, cost};
use dramesh_api::proto::karmada_service::estimator_client::EstimatorClient;
use dramesh_api::query::WireStyle;
use dramesh_api::{ApiConfig, ApiError, ApiState, Backend, ReplicaAnswer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A backend whose estimate starts (reported on `started`), then waits until the call should
/// stop ([`dramesh_api::deadline::passed`]) or, with `ignore_stop`, until `release` says so;
/// then reports when it stopped.
struct Held {
    table: dramesh_api::table::TableBackend,
    started: SyncSender<()>,
    release: std::sync::Mutex<Receiver<()>>,
    stopped: SyncSender<Instant>,
    ignore_stop: bool,
}

struct Handles {
    started: Receiver<()>,
    release: SyncSender<()>,
    stopped: Receiver<Instant>,
}

fn held(ignore_stop: bool) -> (Held, Handles) {
    let (started_tx, started) = sync_channel(16);
    let (release, release_rx) = sync_channel(16);
    let (stopped_tx, stopped) = sync_channel(16);
    (
        Held {
            table: dramesh_api::table::demo_table(),
            started: started_tx,
            release: std::sync::Mutex::new(release_rx),
            stopped: stopped_tx,
            ignore_stop,
        },
        Handles {
            started,
            release,
            stopped,
        },
    )
}

impl Backend for Held {
    fn max_available_replicas(&self, q: &dramesh_api::query::ReplicaQuery) -> ReplicaAnswer {
        self.table.max_available_replicas(q)
    }
    fn max_available_component_sets(
        &self,
        q: &dramesh_api::query::ComponentSetQuery,
    ) -> ReplicaAnswer {
        self.table.max_available_component_sets(q)
    }
    fn unschedulable_replicas(&self, q: &dramesh_api::query::UnschedulableQuery) -> ReplicaAnswer {
        self.table.unschedulable_replicas(q)
    }
    fn estimate_all(
        &self,
        _: &dramesh_api::native::EstimateRequest,
    ) -> Result<dramesh_api::native::EstimateResponse, ApiError> {
        let _ = self.started.send(());
        let give_up = Instant::now() + Duration::from_secs(30);
        let release = self.release.lock().unwrap();
        loop {
            if !self.ignore_stop && dramesh_api::deadline::passed() {
                break;
            }
            if release.recv_timeout(Duration::from_millis(5)).is_ok() || Instant::now() > give_up {
                break;
            }
        }
        let _ = self.stopped.send(Instant::now());
        Err(ApiError::Unavailable("stopped".into()))
    }
    fn place(
        &self,
        r: &dramesh_api::native::PlaceRequest,
    ) -> Result<dramesh_api::native::PlaceResponse, ApiError> {
        self.table.place(r)
    }
    fn preempt(
        &self,
        r: &dramesh_api::native::PreemptRequest,
    ) -> Result<dramesh_api::native::PreemptResponse, ApiError> {
        self.table.preempt(r)
    }
    fn status(&self) -> dramesh_api::native::StatusReport {
        self.table.status()
    }
}

const BODY: &[u8] = br#"{"workload":{"manifests":["apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, image: x}]}\n"]}}"#;

/// Sends `POST /v1/estimate` with `body` on a new connection; returns the stream.
async fn post(addr: std::net::SocketAddr, body: &[u8]) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /v1/estimate HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("head");
    s.write_all(body).await.expect("body");
    s
}

/// The status code and body of the answer on `s`.
async fn answer(mut s: tokio::net::TcpStream) -> (u16, String) {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).to_string();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    (code, text)
}

fn recv<T: Send + 'static>(rx: &Receiver<T>, limit: Duration, what: &str) -> T {
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} within {limit:?}"))
}

async fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < until, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn state_with(backend: Held, config: ApiConfig) -> ApiState {
    open(ApiState::new(Arc::new(backend))).with_config(config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_budget_requests_wait_then_get_503_naming_the_budget_unparsed() {
    let (backend, h) = held(false);
    let one = cost(BODY.len() as u64, JSON_EXPANSION);
    let state = state_with(
        backend,
        ApiConfig {
            budget: BudgetLimits {
                total: 4 * one,
                share: one + one / 2,
                wait: Duration::from_millis(500),
            },
            ..ApiConfig::default()
        },
    );
    let srv = start_http(state).await;
    let first = post(srv.addr, BODY).await;
    tokio::task::block_in_place(|| recv(&h.started, Duration::from_secs(5), "first started"));
    assert_eq!(srv.state.budget.in_use(), one);
    // The same caller's second request is over its share: it waits, then is refused. Its body
    // is not even JSON, so a 503 (not a 400) shows it was never parsed.
    let garbage = vec![b'{'; BODY.len()];
    let started = Instant::now();
    let (code, text) = answer(post(srv.addr, &garbage).await).await;
    assert_eq!(code, 503, "{text}");
    assert!(
        text.contains("--api-max-inflight-bytes") && text.contains("share"),
        "{text}"
    );
    assert!(started.elapsed() >= Duration::from_millis(450), "it waited");
    let refused = srv
        .state
        .metrics
        .api_admission_refusals_total
        .with(["http", "identity_share"])
        .get();
    assert_eq!(refused, 1);
    // Once the first ends, the next is admitted.
    h.release.send(()).unwrap();
    let (code, _) = answer(first).await;
    assert_eq!(code, 503, "the held backend answers Unavailable");
    wait_until("the charge released", Duration::from_secs(5), || {
        srv.state.budget.in_use() == 0
    })
    .await;
    let again = post(srv.addr, BODY).await;
    tokio::task::block_in_place(|| recv(&h.started, Duration::from_secs(5), "admitted again"));
    h.release.send(()).unwrap();
    let _ = answer(again).await;
    // Health and metrics are never charged.
    let metrics = reqwest_free_get(srv.addr, "/metrics").await;
    assert!(
        metrics.contains("dramesh_api_inflight_budget_bytes"),
        "{metrics}"
    );
    srv.stop().await;
}

/// `GET path` on a new connection; the whole answer.
async fn reqwest_free_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_is_held_until_the_work_ends_not_until_the_answer() {
    let (backend, h) = held(true);
    let state = state_with(
        backend,
        ApiConfig {
            request_timeout: Duration::from_millis(200),
            ..ApiConfig::default()
        },
    );
    let srv = start_http(state).await;
    let (code, text) = answer(post(srv.addr, BODY).await).await;
    assert_eq!(code, 503, "{text}");
    assert!(text.contains("did not finish"), "{text}");
    // Answered, but the worker (which ignores its deadline here) still runs: still charged.
    assert!(srv.state.budget.in_use() > 0);
    assert!(h.stopped.try_recv().is_err());
    h.release.send(()).unwrap();
    tokio::task::block_in_place(|| recv(&h.stopped, Duration::from_secs(5), "worker stopped"));
    wait_until("the charge released", Duration::from_secs(5), || {
        srv.state.budget.in_use() == 0
    })
    .await;
    assert_eq!(srv.state.metrics.api_inflight_bytes.get(), 0.0);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_stops_its_worker() {
    let (backend, h) = held(false);
    let state = state_with(
        backend,
        ApiConfig {
            request_timeout: Duration::from_secs(30),
            ..ApiConfig::default()
        },
    );
    let srv = start_http(state).await;
    let s = post(srv.addr, BODY).await;
    tokio::task::block_in_place(|| recv(&h.started, Duration::from_secs(5), "started"));
    let gone = Instant::now();
    drop(s);
    let stopped =
        tokio::task::block_in_place(|| recv(&h.stopped, Duration::from_secs(5), "worker stopped"));
    assert!(
        stopped.duration_since(gone) < Duration::from_secs(2),
        "the worker ran {:?} after its client went away",
        stopped.duration_since(gone)
    );
    wait_until("the charge released", Duration::from_secs(5), || {
        srv.state.budget.in_use() == 0
    })
    .await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_over_the_share_is_resource_exhausted_before_decoding() {
    let state = demo_state().with_config(ApiConfig {
        budget: BudgetLimits::new(1 << 20),
        ..ApiConfig::default()
    });
    let srv = start_grpc(state).await;
    let mut c = EstimatorClient::new(
        tonic::transport::Channel::from_shared(format!("http://{}", srv.addr))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    // An ordinary question fits.
    let r = c
        .max_available_replicas(member1_query().to_proto(WireStyle::V119))
        .await
        .expect("a small call is admitted");
    assert_eq!(r.into_inner().max_replicas, 32);
    // One of 8 KB costs 8 KB x the Karmada expansion, over half of 1 MiB.
    let mut big = member1_query();
    big.requirements
        .node_claim
        .node_selector
        .insert("padding".into(), "x".repeat(8 * 1024));
    let e = c
        .max_available_replicas(big.to_proto(WireStyle::V119))
        .await
        .expect_err("over the share");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("--api-max-inflight-bytes"), "{e:?}");
    assert_eq!(
        srv.state
            .metrics
            .api_admission_refusals_total
            .with([dramesh_api::metrics::API_KARMADA, "too_large"])
            .get(),
        1
    );
    assert_eq!(srv.state.budget.in_use(), 0);
    srv.stop().await;
}
