//! Who may call the APIs: TLS as karmada-scheduler's estimator client uses it (CA only, CA and
//! client certificate, skip-verify), plaintext refused by a TLS listener, bearer tokens, verbs,
//! and refusals counted by identity and reason.

use crate::common;

use std::sync::Arc;

use common::*;
use dramesh_api::ApiState;
use dramesh_api::auth::{AUTHENTICATED, Auth, Policy, Subject, TokenFile, UNAUTHENTICATED};
use dramesh_api::proto::karmada_service::estimator_client::EstimatorClient;
use dramesh_api::query::WireStyle;
use dramesh_api::tls::ApiTls;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

struct Pem {
    cert: String,
    key: String,
}

fn ca(name: &str) -> Pem {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = p.self_signed(&key).unwrap();
    Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

fn leaf(ca: &Pem, cn: &str, orgs: &[&str], sans: &[&str], client: bool) -> Pem {
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, KeyPair::from_pem(&ca.key).unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut p =
        CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    p.distinguished_name.push(DnType::CommonName, cn);
    for o in orgs {
        p.distinguished_name.push(DnType::OrganizationName, *o);
    }
    p.extended_key_usages = vec![if client {
        ExtendedKeyUsagePurpose::ClientAuth
    } else {
        ExtendedKeyUsagePurpose::ServerAuth
    }];
    let cert = p.signed_by(&key, &issuer).unwrap();
    Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

struct Pki {
    ca: Pem,
    server: Pem,
    scheduler: Pem,
    stranger: Pem,
}

fn pki() -> Pki {
    let ca_ = ca("test CA");
    let other = ca("other CA");
    Pki {
        server: leaf(&ca_, "dramesh", &[], &["localhost", "127.0.0.1"], false),
        scheduler: leaf(&ca_, "karmada-scheduler", &["karmada"], &[], true),
        stranger: leaf(&other, "karmada-scheduler", &["karmada"], &[], true),
        ca: ca_,
    }
}

fn tls(p: &Pki) -> ApiTls {
    ApiTls::from_pem(
        &p.server.cert,
        "server.crt",
        &p.server.key,
        "server.key",
        Some((&p.ca.cert, "ca.crt")),
    )
    .expect("server TLS")
}

fn state(p: &Pki, policy: Policy) -> ApiState {
    let mut s = ApiState::new(Arc::new(dramesh_api::table::demo_table())).with_auth(
        Auth::new(policy).with_tokens(
            TokenFile::parse(
                "reader-token,reader,1\nwriter-token,writer,2,\"team-a\"\n",
                std::path::Path::new("tokens.csv"),
            )
            .unwrap(),
        ),
    );
    s.config.tls = Some(tls(p));
    s
}

/// karmada-scheduler's verification choices.
enum Verify<'a> {
    /// `--scheduler-estimator-ca-file`, optionally with a client certificate.
    Ca(&'a Pem, Option<&'a Pem>),
    /// `--insecure-skip-estimator-verify`.
    Skip,
}

#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn client_config(v: &Verify<'_>, alpn: &[u8]) -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let b = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let (b, cert) = match v {
        Verify::Ca(ca, cert) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(ca.cert.as_bytes()) {
                roots.add(c.unwrap()).unwrap();
            }
            (b.with_root_certificates(roots), *cert)
        }
        Verify::Skip => (
            b.dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerify(provider))),
            None,
        ),
    };
    let mut c = match cert {
        Some(p) => b
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(p.cert.as_bytes())
                    .map(Result::unwrap)
                    .collect(),
                PrivateKeyDer::from_pem_slice(p.key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => b.with_no_client_auth(),
    };
    c.alpn_protocols = vec![alpn.to_vec()];
    c
}

/// A gRPC channel over TLS as grpc-go dials it (ALPN h2, server name "localhost").
async fn tls_channel(addr: std::net::SocketAddr, v: Verify<'_>) -> Result<Channel, String> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config(&v, b"h2")));
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_uri| {
            let connector = connector.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let tls = connector
                    .connect(ServerName::try_from("localhost").unwrap(), tcp)
                    .await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .map_err(|e| format!("{e:?}"))
}

async fn ask(c: Channel) -> Result<i32, tonic::Status> {
    EstimatorClient::new(c)
        .max_available_replicas(member1_query().to_proto(WireStyle::V119))
        .await
        .map(|r| r.into_inner().max_replicas)
}

#[tokio::test]
async fn karmada_scheduler_tls_choices_all_work_and_plaintext_is_refused() {
    let p = pki();
    // karmada-scheduler without a client certificate is anonymous: this listener lets
    // anonymous callers read, as a deployment relying on server TLS alone would.
    let srv = start_grpc(state(
        &p,
        Policy {
            readers: vec![
                Subject::Group(UNAUTHENTICATED.into()),
                Subject::Group(AUTHENTICATED.into()),
            ],
            ..Policy::default()
        },
    ))
    .await;
    let want = 32;
    let ca_only = tls_channel(srv.addr, Verify::Ca(&p.ca, None))
        .await
        .unwrap();
    assert_eq!(ask(ca_only).await.unwrap(), want);
    let with_cert = tls_channel(srv.addr, Verify::Ca(&p.ca, Some(&p.scheduler)))
        .await
        .unwrap();
    assert_eq!(ask(with_cert).await.unwrap(), want);
    let skip = tls_channel(srv.addr, Verify::Skip).await.unwrap();
    assert_eq!(ask(skip).await.unwrap(), want);

    // Plaintext HTTP/2 to the TLS listener: never answered.
    let plain = Endpoint::from_shared(format!("http://{}", srv.addr))
        .unwrap()
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(std::time::Duration::from_secs(5))
        .connect_lazy();
    let e = ask(plain).await.expect_err("plaintext to a TLS listener");
    assert_ne!(e.code(), Code::Ok);

    // A client certificate from another CA fails the handshake.
    let stranger = tls_channel(srv.addr, Verify::Ca(&p.ca, Some(&p.stranger))).await;
    match stranger {
        Err(_) => {}
        // TLS 1.3 clients learn of a refused certificate on their first read.
        Ok(c) => assert!(
            ask(c).await.is_err(),
            "a foreign client certificate was accepted"
        ),
    }
    // Both failed handshakes are counted by reason (issue 32 item 2).
    let failures = |reason: &str| {
        srv.state
            .metrics
            .tls_handshake_failures_total
            .with([dramesh_api::GRPC_LISTENER, reason])
            .get()
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while failures("not_tls") == 0 || failures("unknown_ca") == 0 {
        assert!(
            std::time::Instant::now() < until,
            "not counted by reason: {}",
            srv.state.metrics.render()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    srv.stop().await;
}

#[tokio::test]
async fn the_client_certificate_names_the_caller() {
    let p = pki();
    // Only karmada-scheduler (by its certificate's CommonName) may read.
    let srv = start_grpc(state(
        &p,
        Policy {
            readers: vec![Subject::User("karmada-scheduler".into())],
            ..Policy::default()
        },
    ))
    .await;
    let with_cert = tls_channel(srv.addr, Verify::Ca(&p.ca, Some(&p.scheduler)))
        .await
        .unwrap();
    assert_eq!(ask(with_cert).await.unwrap(), 32);
    let anonymous = tls_channel(srv.addr, Verify::Ca(&p.ca, None))
        .await
        .unwrap();
    let e = ask(anonymous).await.expect_err("anonymous read");
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    // A bearer token over gRPC metadata names another user: known, but not a reader.
    let c = tls_channel(srv.addr, Verify::Ca(&p.ca, None))
        .await
        .unwrap();
    let mut req = tonic::Request::new(member1_query().to_proto(WireStyle::V119));
    req.metadata_mut()
        .insert("authorization", "Bearer reader-token".parse().unwrap());
    let e = EstimatorClient::new(c)
        .max_available_replicas(req)
        .await
        .expect_err("not a reader");
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    assert!(e.message().contains("reader"), "{e}");
    let metrics = srv.state.metrics.render();
    assert!(
        metrics.contains(
            r#"dramesh_api_refusals_total{identity="system:anonymous",reason="no_credentials"} 1"#
        ),
        "{metrics}"
    );
    assert!(
        metrics
            .contains(r#"dramesh_api_refusals_total{identity="reader",reason="forbidden_read"} 1"#),
        "{metrics}"
    );
    srv.stop().await;
}

/// One HTTP/1.1 request over TLS; `(status, body)`.
async fn https(
    addr: std::net::SocketAddr,
    v: Verify<'_>,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config(&v, b"http/1.1")));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut s = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    let body = body.unwrap_or("");
    req.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ));
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, text)
}

#[tokio::test]
async fn http_verbs_tokens_and_open_health_endpoints() {
    let p = pki();
    let st = state(
        &p,
        Policy {
            writers: vec![Subject::Group("team-a".into())],
            ..Policy::default()
        },
    );
    let backend_state = ApiState {
        backend: Arc::new(ReservingBackend::new()),
        ..st
    };
    let srv = start_http(backend_state).await;
    let ca = || Verify::Ca(&p.ca, None);
    let reserve = r#"{"workload": {"manifests": ["kind: Deployment\n"]}, "cluster": "member-2", "replicas": 2}"#;
    // Health, readiness and metrics need no credentials.
    assert_eq!(
        https(srv.addr, ca(), "GET", "/healthz", None, None).await.0,
        200
    );
    assert_eq!(
        https(srv.addr, ca(), "GET", "/metrics", None, None).await.0,
        200
    );
    // Everything else does.
    let (code, text) = https(
        srv.addr,
        ca(),
        "POST",
        "/v1/reservations",
        None,
        Some(reserve),
    )
    .await;
    assert_eq!(code, 401, "{text}");
    assert!(
        text.contains("WWW-Authenticate: Bearer") || text.contains("www-authenticate: Bearer"),
        "{text}"
    );
    let (code, _) = https(
        srv.addr,
        ca(),
        "GET",
        "/v1/reservations",
        Some("no-such-token"),
        None,
    )
    .await;
    assert_eq!(code, 401);
    let (code, text) = https(
        srv.addr,
        ca(),
        "POST",
        "/v1/reservations",
        Some("reader-token"),
        Some(reserve),
    )
    .await;
    assert_eq!(code, 403, "{text}");
    assert!(
        text.contains("reader may not") && text.contains("write"),
        "{text}"
    );
    assert_eq!(
        https(
            srv.addr,
            ca(),
            "GET",
            "/v1/reservations",
            Some("reader-token"),
            None
        )
        .await
        .0,
        200
    );
    let (code, text) = https(
        srv.addr,
        ca(),
        "POST",
        "/v1/reservations",
        Some("writer-token"),
        Some(reserve),
    )
    .await;
    assert_eq!(code, 201, "{text}");
    // Retiring a cluster is admin; a writer is not one.
    assert_eq!(
        https(
            srv.addr,
            ca(),
            "DELETE",
            "/v1/clusters/member-2",
            Some("writer-token"),
            None
        )
        .await
        .0,
        403
    );
    let metrics = srv.state.metrics.render();
    for line in [
        r#"dramesh_api_refusals_total{identity="system:anonymous",reason="no_credentials"} 1"#,
        r#"dramesh_api_refusals_total{identity="system:anonymous",reason="bad_token"} 1"#,
        r#"dramesh_api_refusals_total{identity="reader",reason="forbidden_write"} 1"#,
        r#"dramesh_api_refusals_total{identity="writer",reason="forbidden_admin"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    srv.stop().await;
}

#[tokio::test]
async fn native_grpc_reservations_need_a_writer_and_carry_the_caller() {
    let p = pki();
    let st = state(
        &p,
        Policy {
            writers: vec![Subject::Group("team-a".into())],
            ..Policy::default()
        },
    );
    let srv = start_grpc(ApiState {
        backend: Arc::new(ReservingBackend::new()),
        ..st
    })
    .await;
    let reserve = || dramesh_api::proto::native::ReserveRequest {
        workload: Some(dramesh_api::proto::native::Workload {
            manifests: vec!["kind: Deployment\n".into()],
        }),
        cluster: "member-2".into(),
        replicas: Some(1),
        priority: None,
        ttl_seconds: Some(60),
    };
    let client = dramesh_api::proto::native::dramesh_client::DrameshClient::new;
    let c = tls_channel(srv.addr, Verify::Ca(&p.ca, None))
        .await
        .unwrap();
    let e = client(c.clone())
        .reserve(reserve())
        .await
        .expect_err("anonymous");
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    let as_token = |t: &str| {
        let mut r = tonic::Request::new(reserve());
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
        r
    };
    let e = client(c.clone())
        .reserve(as_token("reader-token"))
        .await
        .expect_err("a reader");
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    let ok = client(c.clone())
        .reserve(as_token("writer-token"))
        .await
        .expect("a writer reserves");
    assert!(!ok.into_inner().id.is_empty());
    let mut bad = tonic::Request::new(dramesh_api::proto::native::StatusRequest {});
    bad.metadata_mut()
        .insert("authorization", "Basic d3Jvbmc=".parse().unwrap());
    let e = client(c).status(bad).await.expect_err("not a bearer token");
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    srv.stop().await;
}
