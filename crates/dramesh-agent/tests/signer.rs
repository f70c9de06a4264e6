//! The Pod Certificates signer against the in-process fake API server, driven by the real kube
//! client: requests are created as a kubelet would, and the signer's status writes go through
//! the status subresource, where the fake enforces the API's rules for them.

use std::time::Duration;

use dramesh_agent::signer::{SignerConfig, SignerPolicy, SignerStats, run_signer, signing_ca};
use dramesh_fakeapi::FakeApi;
use dramesh_mesh::certs::{CaBundle, generate_ca};
use dramesh_mesh::identity::PeerIdentity;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1beta1::{PodCertificateRequest, PodCertificateRequestSpec};
use kube::api::ObjectMeta;
use rcgen::{CertificateParams, DnType, KeyPair, PublicKeyData as _, SanType, SigningKey as _};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, UnixTime};
use serde_json::Value;

const NS: &str = "dramesh-system";
const SIGNER: &str = "dramesh.io/agent";

fn csr(key: &KeyPair, params: &CertificateParams) -> ByteString {
    ByteString(params.serialize_request(key).unwrap().der().to_vec())
}

/// A request as the kubelet on `node` makes it for pod `pod` (in `ns`, service account `sa`).
fn request(name: &str, ns: &str, sa: &str, node: &str, stub: ByteString) -> Value {
    let req = PodCertificateRequest {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            ..Default::default()
        },
        spec: PodCertificateRequestSpec {
            signer_name: SIGNER.into(),
            pod_name: format!("pod-{name}"),
            pod_uid: format!("uid-{name}"),
            service_account_name: sa.into(),
            service_account_uid: "sa-uid".into(),
            node_name: node.into(),
            node_uid: format!("uid-{node}"),
            max_expiration_seconds: Some(86_400),
            stub_pkc_s10_request: stub,
            ..Default::default()
        },
        status: None,
    };
    let mut v = serde_json::to_value(&req).unwrap();
    v["apiVersion"] = "certificates.k8s.io/v1beta1".into();
    v["kind"] = "PodCertificateRequest".into();
    v
}

async fn final_status(api: &FakeApi, ns: &str, name: &str) -> Value {
    for _ in 0..200 {
        let v = api.get("PodCertificateRequest", Some(ns), name).unwrap();
        if v["status"]["conditions"]
            .as_array()
            .is_some_and(|c| !c.is_empty())
        {
            return v["status"].clone();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("request {name} got no decision within 10 s");
}

fn condition(status: &Value) -> (String, String) {
    let c = &status["conditions"][0];
    (
        c["type"].as_str().unwrap().to_owned(),
        c["reason"].as_str().unwrap().to_owned(),
    )
}

/// Verifies the issued chain exactly as a replica verifies a mesh client (rustls/webpki against
/// the mesh CA, client authentication) and returns the identity it reads from it.
fn replica_accepts(ca: &CaBundle, chain_pem: &str) -> PeerIdentity {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.cert_pem.as_bytes()).unwrap())
        .unwrap();
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.into(),
        rustls::crypto::ring::default_provider().into(),
    )
    .build()
    .unwrap();
    verifier
        .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
        .expect("a replica's verifier accepts the issued chain");
    PeerIdentity::from_certificate_der(&chain[0]).unwrap()
}

#[tokio::test]
async fn signer_issues_node_identities_and_denies_everything_else() {
    let api = FakeApi::start().await;
    let ca = generate_ca("mesh CA", 1).unwrap();
    let config = SignerConfig {
        policy: SignerPolicy {
            signer_name: SIGNER.into(),
            cluster: "east".into(),
            namespace: NS.into(),
            service_account: "dramesh-agent".into(),
            lifetime_secs: 86_400,
        },
        ca: signing_ca(&ca.cert_pem, &ca.key_pem, "test CA").unwrap(),
        retry_every: Duration::from_millis(200),
    };
    let (stats_tx, stats) = tokio::sync::watch::channel(SignerStats::default());
    let signer = tokio::spawn(run_signer(api.client(), config, stats_tx));

    // For another signer: created first, so the signer has seen it before the others land.
    let key = KeyPair::generate().unwrap();
    let mut other = request(
        "other",
        NS,
        "dramesh-agent",
        "n1",
        csr(&key, &CertificateParams::default()),
    );
    other["spec"]["signerName"] = "example.com/other".into();
    api.apply(other);

    // The agent pod on n1, its CSR trying to name n2 in the subject and a SAN.
    let n1_key = KeyPair::generate().unwrap();
    let mut greedy = CertificateParams::default();
    greedy
        .distinguished_name
        .push(DnType::CommonName, "dramesh://cluster/east/agent/n2");
    greedy.subject_alt_names = vec![SanType::URI(
        "dramesh://cluster/east/agent/n2".try_into().unwrap(),
    )];
    api.apply(request(
        "agent-n1",
        NS,
        "dramesh-agent",
        "n1",
        csr(&n1_key, &greedy),
    ));

    // A pod that is not the agent: another service account, and another namespace.
    let k = KeyPair::generate().unwrap();
    api.apply(request(
        "not-agent",
        NS,
        "default",
        "n1",
        csr(&k, &CertificateParams::default()),
    ));
    let mut elsewhere = request(
        "elsewhere",
        NS,
        "dramesh-agent",
        "n1",
        csr(&k, &CertificateParams::default()),
    );
    elsewhere["metadata"]["namespace"] = "default".into();
    api.apply(elsewhere);

    // A proof of possession that does not verify: the legacy fields, signed over another UID.
    let mut bad = request("bad-pop", NS, "dramesh-agent", "n1", ByteString(Vec::new()));
    bad["spec"]["pkixPublicKey"] =
        serde_json::to_value(ByteString(k.subject_public_key_info())).unwrap();
    bad["spec"]["proofOfPossession"] =
        serde_json::to_value(ByteString(k.sign(b"uid-someone-else").unwrap())).unwrap();
    api.apply(bad);

    let status = final_status(&api, NS, "agent-n1").await;
    assert_eq!(condition(&status), ("Issued".into(), "Issued".into()));
    let chain = status["certificateChain"].as_str().unwrap();
    let identity = replica_accepts(&ca, chain);
    assert_eq!(
        identity,
        PeerIdentity::Agent {
            cluster: "east".into(),
            node: "n1".into()
        },
        "the certificate names the node the API server attested, not the one the CSR asked for"
    );
    // The leaf is the kubelet's key, and the identity in the bundle the kubelet writes loads.
    let bundle = format!("{}{chain}", n1_key.serialize_pem());
    let loaded =
        dramesh_mesh::certs::identity_from_pem(&bundle, &bundle, &ca.cert_pem, "bundle").unwrap();
    assert_eq!(loaded.identity, identity);
    assert!(!chain.contains("agent/n2"));

    assert_eq!(
        condition(&final_status(&api, NS, "not-agent").await),
        ("Denied".into(), "NotAgentPod".into())
    );
    assert_eq!(
        condition(&final_status(&api, "default", "elsewhere").await),
        ("Denied".into(), "NotAgentPod".into())
    );
    assert_eq!(
        condition(&final_status(&api, NS, "bad-pop").await),
        ("Denied".into(), "BadProofOfPossession".into())
    );
    assert_eq!(
        *stats.borrow(),
        SignerStats {
            issued: 1,
            refused: 3
        }
    );

    // The other signer's request was never written to.
    let other = api.get("PodCertificateRequest", Some(NS), "other").unwrap();
    assert!(other.get("status").is_none_or(Value::is_null), "{other}");
    assert!(
        api.writes().iter().all(|w| w.name != "other"),
        "the signer wrote to another signer's request"
    );
    signer.abort();
}

/// The fake refuses the status writes a real API server refuses, so the signer's accepted
/// writes above are evidence: a certificate for another key, times that disagree with the
/// leaf, and any change after the request is final.
#[tokio::test]
async fn the_fake_refuses_statuses_the_api_server_refuses() {
    use dramesh_agent::signer::{SignerPolicy, SigningCa, decide};
    let api = FakeApi::start().await;
    let ca = generate_ca("mesh CA", 1).unwrap();
    let signing = SigningCa {
        ca: ca.clone(),
        chain_pem: String::new(),
    };
    let policy = SignerPolicy {
        signer_name: SIGNER.into(),
        cluster: "east".into(),
        namespace: NS.into(),
        service_account: "dramesh-agent".into(),
        lifetime_secs: 86_400,
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let key = KeyPair::generate().unwrap();
    let v = request(
        "r",
        NS,
        "dramesh-agent",
        "n1",
        csr(&key, &CertificateParams::default()),
    );
    api.apply(v.clone());
    let pcrs: kube::Api<PodCertificateRequest> = kube::Api::namespaced(api.client(), NS);
    let status_of = |req: &PodCertificateRequest| match decide(req, &policy, &signing, now) {
        dramesh_agent::signer::Decision::Write { status, .. } => status,
        other => panic!("{other:?}"),
    };
    let write = |status: &k8s_openapi::api::certificates::v1beta1::PodCertificateRequestStatus| {
        let pcrs = pcrs.clone();
        let patch = serde_json::json!({ "status": status });
        async move {
            pcrs.patch_status("r", &Default::default(), &kube::api::Patch::Merge(&patch))
                .await
        }
    };
    let is_invalid = |r: Result<PodCertificateRequest, kube::Error>| matches!(r, Err(kube::Error::Api(ref s)) if s.code == 422);
    let req: PodCertificateRequest = serde_json::from_value(v.clone()).unwrap();

    // Issued to another key: the same request with a different CSR.
    let other_key = KeyPair::generate().unwrap();
    let mut other: PodCertificateRequest = req.clone();
    other.spec.stub_pkc_s10_request = csr(&other_key, &CertificateParams::default());
    assert!(
        is_invalid(write(&status_of(&other)).await),
        "a leaf for another key"
    );

    // notAfter that is not the leaf's.
    let mut wrong = status_of(&req);
    let na = wrong.not_after.as_ref().unwrap().0.as_second();
    wrong.not_after = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::from_second(na - 60).unwrap(),
    ));
    assert!(is_invalid(write(&wrong).await), "notAfter not the leaf's");

    // The right status lands; after that nothing changes it.
    write(&status_of(&req)).await.unwrap();
    let mut denied = req.clone();
    denied.spec.service_account_name = "default".into();
    assert!(
        is_invalid(write(&status_of(&denied)).await),
        "a final status changed"
    );
}
