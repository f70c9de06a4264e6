//! ServiceAccount tokens reviewed by a Kubernetes API server (TokenReview), with the real kube
//! client against the fake API server of `dramesh-fakeapi`: a valid token reads, an unknown one
//! is refused (401), a writer group from the review may reserve, and answers are cached.

use crate::common;

use std::sync::Arc;

use common::*;
use dramesh_api::ApiState;
use dramesh_api::auth::{Auth, Policy, ReviewCache, Subject};
use dramesh_api::tokenreview::KubeTokenReviewer;
use dramesh_fakeapi::FakeApi;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn call(addr: std::net::SocketAddr, method: &str, path: &str, token: &str) -> u16 {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = r#"{"workload": {"manifests": ["kind: Deployment\n"]}, "cluster": "member-2", "replicas": 1}"#;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn service_account_tokens_are_reviewed_by_the_api_server_and_cached() {
    let fake = FakeApi::start().await;
    fake.add_token(
        "sa-token",
        "system:serviceaccount:karmada-system:karmada-scheduler",
        &[
            "system:serviceaccounts",
            "system:serviceaccounts:karmada-system",
        ],
    );
    fake.add_token(
        "ci-token",
        "system:serviceaccount:ci:deployer",
        &["ci-writers"],
    );
    let auth = Auth::new(Policy {
        writers: vec![Subject::Group("ci-writers".into())],
        ..Policy::default()
    })
    .with_reviewer(
        Arc::new(KubeTokenReviewer::new(fake.client())),
        ReviewCache::default(),
    );
    let state = ApiState::new(Arc::new(ReservingBackend::new())).with_auth(auth);
    let srv = start_http(state).await;
    assert_eq!(
        call(srv.addr, "GET", "/v1/reservations", "sa-token").await,
        200
    );
    assert_eq!(
        call(srv.addr, "GET", "/v1/reservations", "sa-token").await,
        200
    );
    assert_eq!(
        fake.token_reviews(),
        1,
        "the second call used the cached review"
    );
    assert_eq!(
        call(srv.addr, "GET", "/v1/reservations", "forged").await,
        401
    );
    assert_eq!(
        call(srv.addr, "POST", "/v1/reservations", "sa-token").await,
        403
    );
    assert_eq!(
        call(srv.addr, "POST", "/v1/reservations", "ci-token").await,
        201
    );
    assert_eq!(fake.token_reviews(), 3);
    let requests = fake.requests();
    assert!(
        requests
            .iter()
            .all(|r| r.starts_with("POST /apis/authentication.k8s.io/v1/tokenreviews")),
        "{requests:?}"
    );
    srv.stop().await;
}
