//! The dramesh Pod Certificates signer: issues each agent pod its mesh identity
//! `dramesh://cluster/<cluster>/agent/<node>` from a `certificates.k8s.io/v1beta1`
//! `PodCertificateRequest`, so no node is provisioned by hand.
//!
//! The kubelet creates one request per `podCertificate` projected volume, with a key pair it
//! generated and keeps; the API server fills in (and checks at creation) the pod, its service
//! account and the node the pod is bound to. [`decide`] is the whole policy, a pure function
//! of the request, the signer's configuration and the time:
//! - requests for another signer name, and requests already `Issued`, `Denied` or `Failed`,
//!   are left alone;
//! - the pod must run in the agent's namespace under the agent's service account, with no
//!   `unverifiedUserAnnotations` (the signer understands none), else `Denied`;
//! - the proof of possession must verify: the stub PKCS#10 request's self-signature (1.36
//!   kubelets), or the legacy `proofOfPossession` over the pod UID's ASCII bytes with
//!   `pkixPublicKey` (Ed25519 directly, ECDSA over its SHA-256 digest), else `Denied`;
//! - only ECDSA P-256/P-384 and Ed25519 keys are signed (the mesh's signature schemes), others
//!   are `Denied` with reason `UnsupportedKeyType`;
//! - the identity's node is `spec.nodeName`, which the API server attests: nothing the pod
//!   chose reaches the certificate. A node name that is not a valid identity segment is
//!   `Denied`.
//!
//! An issued certificate starts at most [`BACKDATE_SECS`] before now (the API server wants
//! `notBefore` within 5 minutes of its clock), lives `min(lifetime, maxExpirationSeconds)`
//! (never under one hour, the API's floor), and asks the kubelet to refresh it two thirds in
//! (`beginRefreshAt`, kept inside the API's `[notBefore+10m, notAfter-10m]`).
//!
//! [`run_signer`] is the I/O edge: a watch of the requests for the signer name and a status
//! write per decision, retried until it lands.

use std::collections::BTreeSet;
use std::time::Duration;

use dramesh_mesh::certs::{CaBundle, issue_leaf_for_key};
use dramesh_mesh::identity::{CLUSTER_PUBLISHER, PeerIdentity};
use dramesh_store::valid_segment;
use futures::StreamExt;
use k8s_openapi::api::certificates::v1beta1::{
    PodCertificateRequest, PodCertificateRequestSpec, PodCertificateRequestStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use x509_parser::oid_registry::{
    OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_NIST_EC_P384, OID_SIG_ED25519,
};
use x509_parser::prelude::FromDer;
use x509_parser::x509::SubjectPublicKeyInfo;

/// The API's shortest certificate lifetime (and shortest `maxExpirationSeconds`).
pub const MIN_LIFETIME_SECS: i64 = 3600;
/// `maxExpirationSeconds` the API server sets when the projection names none.
pub const DEFAULT_MAX_EXPIRATION_SECS: i64 = 86_400;
/// How far before now a certificate starts: tolerates a replica clock slightly behind the
/// signer's, well inside the API server's 5-minute window for `notBefore`.
pub const BACKDATE_SECS: i64 = 60;
/// The API keeps `beginRefreshAt` this far from both ends of the validity.
const REFRESH_MARGIN_SECS: i64 = 600;

/// Condition types the API gives meaning to; at most one is ever set, and then the status is
/// final.
pub const ISSUED: &str = "Issued";
/// The signer refuses the request.
pub const DENIED: &str = "Denied";
/// The signer could not issue (its own fault, not the request's).
pub const FAILED: &str = "Failed";
/// The reason the API names for a key type the signer does not sign.
pub const UNSUPPORTED_KEY_TYPE: &str = "UnsupportedKeyType";

/// Whom the signer issues to, and how.
#[derive(Debug, Clone)]
pub struct SignerPolicy {
    /// The signer name requests must carry (e.g. `dramesh.io/agent`).
    pub signer_name: String,
    /// The member cluster named in every identity.
    pub cluster: String,
    /// The agent DaemonSet's namespace.
    pub namespace: String,
    /// The agent DaemonSet's service account.
    pub service_account: String,
    /// Longest lifetime issued (shortened to the request's `maxExpirationSeconds`).
    pub lifetime_secs: i64,
}

/// The signing CA: the certificate that signs (first PEM block of `ca.cert_pem`) and its key.
/// Any further certificates in `chain_pem` (intermediates up to, not including, the root the
/// replicas trust) follow the leaf in every issued chain.
#[derive(Debug, Clone)]
pub struct SigningCa {
    /// The signing certificate and key.
    pub ca: CaBundle,
    /// Intermediates appended to each issued chain (may be empty).
    pub chain_pem: String,
}

/// What to do with one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Not for this signer, or already final: write nothing.
    Skip,
    /// Write this status through the status subresource.
    Write {
        /// The whole new status.
        status: PodCertificateRequestStatus,
        /// What it says, for logs and tests.
        verdict: Verdict,
    },
}

/// The outcome written into a request's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// A certificate for this identity.
    Issued(PeerIdentity),
    /// Refused: condition `Denied` with this reason.
    Denied {
        /// The condition reason (CamelCase).
        reason: &'static str,
        /// Why, for the operator.
        message: String,
    },
    /// Not issued through no fault of the request: condition `Failed`.
    Failed {
        /// The condition reason.
        reason: &'static str,
        /// Why, for the operator.
        message: String,
    },
}

/// The final condition type of a request, if it has one.
pub fn final_condition(status: Option<&PodCertificateRequestStatus>) -> Option<&str> {
    status?
        .conditions
        .iter()
        .flatten()
        .find(|c| c.status == "True" && [ISSUED, DENIED, FAILED].contains(&c.type_.as_str()))
        .map(|c| c.type_.as_str())
}

/// The policy (see the module docs). `now` is Unix seconds.
pub fn decide(
    req: &PodCertificateRequest,
    policy: &SignerPolicy,
    ca: &SigningCa,
    now: i64,
) -> Decision {
    let spec = &req.spec;
    if spec.signer_name != policy.signer_name || final_condition(req.status.as_ref()).is_some() {
        return Decision::Skip;
    }
    let refusal = match check(req, policy) {
        Err(refusal) => refusal,
        Ok((identity, spki)) => match issue(spec, policy, ca, &identity, &spki, now) {
            Ok(status) => {
                return Decision::Write {
                    status,
                    verdict: Verdict::Issued(identity),
                };
            }
            Err(refusal) => refusal,
        },
    };
    let (type_, reason, message) = (refusal.type_, refusal.reason, refusal.message.clone());
    let verdict = if refusal.type_ == DENIED {
        Verdict::Denied {
            reason: refusal.reason,
            message: refusal.message,
        }
    } else {
        Verdict::Failed {
            reason: refusal.reason,
            message: refusal.message,
        }
    };
    Decision::Write {
        status: PodCertificateRequestStatus {
            conditions: Some(vec![condition(type_, reason, &message, now)]),
            ..Default::default()
        },
        verdict,
    }
}

/// Why a request gets no certificate: the condition type ([`DENIED`] or [`FAILED`]), its
/// reason and message.
struct Refusal {
    type_: &'static str,
    reason: &'static str,
    message: String,
}

fn denied(reason: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        type_: DENIED,
        reason,
        message: message.into(),
    }
}

fn failed(message: impl Into<String>) -> Refusal {
    Refusal {
        type_: FAILED,
        reason: "SigningFailed",
        message: message.into(),
    }
}

/// Who the request is for and the key to certify, or why it is refused.
fn check(
    req: &PodCertificateRequest,
    policy: &SignerPolicy,
) -> Result<(PeerIdentity, Vec<u8>), Refusal> {
    let spec = &req.spec;
    let namespace = req.metadata.namespace.as_deref().unwrap_or("");
    if namespace != policy.namespace || spec.service_account_name != policy.service_account {
        return Err(denied(
            "NotAgentPod",
            format!(
                "pod {namespace}/{} runs as service account {:?}; {} signs only for service \
                 account {:?} in namespace {:?}",
                spec.pod_name,
                spec.service_account_name,
                policy.signer_name,
                policy.service_account,
                policy.namespace
            ),
        ));
    }
    if let Some(keys) = spec
        .unverified_user_annotations
        .as_ref()
        .filter(|a| !a.is_empty())
    {
        let keys: Vec<&str> = keys.keys().map(String::as_str).collect();
        return Err(denied(
            "UnknownUserAnnotation",
            format!(
                "{} understands no user annotations; got {keys:?}",
                policy.signer_name
            ),
        ));
    }
    let node = &spec.node_name;
    if !valid_segment(node) || node == CLUSTER_PUBLISHER {
        return Err(denied(
            "InvalidNodeName",
            format!("node name {node:?} cannot be a mesh identity segment"),
        ));
    }
    let spki = proven_key(spec)?;
    Ok((
        PeerIdentity::Agent {
            cluster: policy.cluster.clone(),
            node: node.clone(),
        },
        spki,
    ))
}

/// The key types the signer certifies, by what ring verifies the legacy proof with.
enum KeyType {
    Ed25519,
    EcdsaP256,
    EcdsaP384,
}

fn key_type(spki: &SubjectPublicKeyInfo<'_>) -> Result<KeyType, Refusal> {
    let alg = &spki.algorithm;
    if alg.algorithm == OID_SIG_ED25519 {
        return Ok(KeyType::Ed25519);
    }
    if alg.algorithm == OID_KEY_TYPE_EC_PUBLIC_KEY {
        let curve = alg.parameters.as_ref().and_then(|p| p.as_oid().ok());
        if curve.as_ref() == Some(&OID_EC_P256) {
            return Ok(KeyType::EcdsaP256);
        }
        if curve.as_ref() == Some(&OID_NIST_EC_P384) {
            return Ok(KeyType::EcdsaP384);
        }
    }
    Err(denied(
        UNSUPPORTED_KEY_TYPE,
        format!(
            "key algorithm {} is not signed; use keyType ECDSAP256 (or ECDSAP384, ED25519)",
            alg.algorithm
        ),
    ))
}

/// The DER SubjectPublicKeyInfo whose private key the requester has proven to hold.
fn proven_key(spec: &PodCertificateRequestSpec) -> Result<Vec<u8>, Refusal> {
    let bad = |m: String| denied("BadProofOfPossession", m);
    let pkix = spec.pkix_public_key.as_ref().filter(|k| !k.0.is_empty());
    let csr = &spec.stub_pkc_s10_request.0;
    if !csr.is_empty() {
        if pkix.is_some() {
            return Err(bad(
                "both stubPKCS10Request and pkixPublicKey are set; the API allows one".into(),
            ));
        }
        let (rest, req) =
            x509_parser::certification_request::X509CertificationRequest::from_der(csr)
                .map_err(|e| bad(format!("stubPKCS10Request does not parse: {e}")))?;
        if !rest.is_empty() {
            return Err(bad("stubPKCS10Request has trailing bytes".into()));
        }
        let spki = &req.certification_request_info.subject_pki;
        key_type(spki)?;
        req.verify_signature()
            .map_err(|e| bad(format!("stubPKCS10Request signature does not verify: {e}")))?;
        return Ok(spki.raw.to_vec());
    }
    let pkix =
        pkix.ok_or_else(|| bad("neither stubPKCS10Request nor pkixPublicKey is set".into()))?;
    let (rest, spki) = SubjectPublicKeyInfo::from_der(&pkix.0)
        .map_err(|e| bad(format!("pkixPublicKey does not parse: {e}")))?;
    if !rest.is_empty() {
        return Err(bad("pkixPublicKey has trailing bytes".into()));
    }
    use ring::signature as sig;
    let alg: &dyn sig::VerificationAlgorithm = match key_type(&spki)? {
        KeyType::Ed25519 => &sig::ED25519,
        // Go's ecdsa.SignASN1 over SHA-256(pod UID), whatever the curve.
        KeyType::EcdsaP256 => &sig::ECDSA_P256_SHA256_ASN1,
        KeyType::EcdsaP384 => &sig::ECDSA_P384_SHA256_ASN1,
    };
    let proof = spec
        .proof_of_possession
        .as_ref()
        .map(|p| p.0.as_slice())
        .unwrap_or_default();
    sig::UnparsedPublicKey::new(alg, &spki.subject_public_key.data)
        .verify(spec.pod_uid.as_bytes(), proof)
        .map_err(|_| {
            bad(format!(
                "proofOfPossession is not a signature of pod UID {:?} by pkixPublicKey",
                spec.pod_uid
            ))
        })?;
    Ok(pkix.0.clone())
}

fn time(secs: i64) -> Result<Time, Refusal> {
    k8s_openapi::jiff::Timestamp::from_second(secs)
        .map(Time)
        .map_err(|e| failed(format!("time {secs} out of range: {e}")))
}

fn condition(type_: &str, reason: &str, message: &str, now: i64) -> Condition {
    Condition {
        type_: type_.to_owned(),
        status: "True".to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        // `now` is a sane clock reading; the epoch stands in only if it is not.
        last_transition_time: time(now).unwrap_or(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
        observed_generation: None,
    }
}

fn issue(
    spec: &PodCertificateRequestSpec,
    policy: &SignerPolicy,
    ca: &SigningCa,
    identity: &PeerIdentity,
    spki: &[u8],
    now: i64,
) -> Result<PodCertificateRequestStatus, Refusal> {
    let max = spec
        .max_expiration_seconds
        .map_or(DEFAULT_MAX_EXPIRATION_SECS, i64::from);
    let lifetime = policy.lifetime_secs.min(max);
    if lifetime < MIN_LIFETIME_SECS {
        return Err(denied(
            "LifetimeTooShort",
            format!(
                "the certificate may live {lifetime} s (maxExpirationSeconds {max}, signer \
                 lifetime {} s); the API requires at least {MIN_LIFETIME_SECS} s",
                policy.lifetime_secs
            ),
        ));
    }
    let not_before = now - BACKDATE_SECS;
    let not_after = not_before + lifetime;
    let refresh = (not_before + lifetime * 2 / 3).clamp(
        not_before + REFRESH_MARGIN_SECS,
        not_after - REFRESH_MARGIN_SECS,
    );
    let leaf = issue_leaf_for_key(&ca.ca, identity, spki, not_before, not_after)
        .map_err(|e| failed(e.to_string()))?;
    let mut chain = leaf;
    if !ca.chain_pem.trim().is_empty() {
        if !chain.ends_with('\n') {
            chain.push('\n');
        }
        chain.push_str(ca.chain_pem.trim_start());
    }
    Ok(PodCertificateRequestStatus {
        certificate_chain: Some(chain),
        not_before: Some(time(not_before)?),
        not_after: Some(time(not_after)?),
        begin_refresh_at: Some(time(refresh)?),
        conditions: Some(vec![condition(
            ISSUED,
            "Issued",
            &format!("issued {identity}"),
            now,
        )]),
    })
}

/// How [`run_signer`] talks to the API server.
#[derive(Debug, Clone)]
pub struct SignerConfig {
    /// The policy.
    pub policy: SignerPolicy,
    /// The signing CA.
    pub ca: SigningCa,
    /// Delay before a failed status write is tried again.
    pub retry_every: Duration,
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Counts of what the signer wrote (for logs and tests).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SignerStats {
    /// Certificates issued.
    pub issued: u64,
    /// Requests denied or failed.
    pub refused: u64,
}

/// Watches the `PodCertificateRequest`s of `config.policy.signer_name` in every namespace and
/// writes each decision through the status subresource, conditional on the resourceVersion it
/// was made from. A write that fails (conflict, API unavailable) is decided again from a
/// fresh read after `retry_every`. Runs until the watch stream ends.
pub async fn run_signer(
    client: kube::Client,
    config: SignerConfig,
    stats: tokio::sync::watch::Sender<SignerStats>,
) -> anyhow::Result<()> {
    let all: Api<PodCertificateRequest> = Api::all(client.clone());
    let selector = format!("spec.signerName={}", config.policy.signer_name);
    let stream = watcher(all, watcher::Config::default().fields(&selector));
    let mut stream = std::pin::pin!(stream);
    // (namespace, name) of requests whose status write failed.
    let mut retry: BTreeSet<(String, String)> = BTreeSet::new();
    let mut tick = tokio::time::interval(config.retry_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let batch: Vec<PodCertificateRequest> = tokio::select! {
            ev = stream.next() => match ev {
                None => return Ok(()),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "PodCertificateRequest watch error (retried by the watcher)");
                    continue;
                }
                Some(Ok(watcher::Event::Apply(r) | watcher::Event::InitApply(r))) => vec![r],
                Some(Ok(_)) => continue,
            },
            _ = tick.tick(), if !retry.is_empty() => {
                let mut fresh = Vec::new();
                for (ns, name) in std::mem::take(&mut retry) {
                    let api: Api<PodCertificateRequest> = Api::namespaced(client.clone(), &ns);
                    match api.get_opt(&name).await {
                        Ok(Some(r)) => fresh.push(r),
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(namespace = %ns, %name, error = %e, "re-reading PodCertificateRequest");
                            retry.insert((ns, name));
                        }
                    }
                }
                fresh
            }
        };
        for req in batch {
            let Decision::Write { status, verdict } =
                decide(&req, &config.policy, &config.ca, unix_now())
            else {
                continue;
            };
            let ns = req.metadata.namespace.clone().unwrap_or_default();
            let name = req.metadata.name.clone().unwrap_or_default();
            let api: Api<PodCertificateRequest> = Api::namespaced(client.clone(), &ns);
            let patch = serde_json::json!({
                "metadata": {"resourceVersion": req.metadata.resource_version},
                "status": status,
            });
            match api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => match &verdict {
                    Verdict::Issued(identity) => {
                        tracing::info!(namespace = %ns, %name, %identity, "issued pod certificate");
                        stats.send_modify(|s| s.issued += 1);
                    }
                    Verdict::Denied { reason, message } | Verdict::Failed { reason, message } => {
                        tracing::warn!(namespace = %ns, %name, %reason, %message, "refused pod certificate request");
                        stats.send_modify(|s| s.refused += 1);
                    }
                },
                Err(e) => {
                    tracing::warn!(namespace = %ns, %name, error = %e, "writing PodCertificateRequest status; will retry");
                    retry.insert((ns, name));
                }
            }
        }
    }
}

/// [`run_signer`] with the in-cluster configuration (or the kubeconfig), counting nothing.
pub async fn run_with_default_client(config: SignerConfig) -> anyhow::Result<()> {
    let client = kube::Client::try_default().await.map_err(|e| {
        anyhow::anyhow!("building the Kubernetes client (in-cluster config or kubeconfig): {e}")
    })?;
    let (stats, _) = tokio::sync::watch::channel(SignerStats::default());
    run_signer(client, config, stats).await
}

/// Reads the signing CA: `cert_pem` holds the signing certificate first and any
/// intermediates after it; `key_pem` its private key. `what` names the source in errors.
pub fn signing_ca(cert_pem: &str, key_pem: &str, what: &str) -> anyhow::Result<SigningCa> {
    const END: &str = "-----END CERTIFICATE-----";
    let Some(at) = cert_pem.find(END) else {
        anyhow::bail!("{what}: no CERTIFICATE block in the signing CA certificate file");
    };
    let (first, rest) = cert_pem.split_at(at + END.len());
    let ca = CaBundle {
        cert_pem: format!("{}\n", first.trim_start()),
        key_pem: key_pem.to_owned(),
    };
    // Fail at start, not at the first request, if the certificate or key does not load.
    dramesh_mesh::certs::check_ca(&ca).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
    Ok(SigningCa {
        ca,
        chain_pem: rest.trim_start().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use kube::api::ObjectMeta;
    use rcgen::{KeyPair, PublicKeyData as _, SigningKey as _};

    const NOW: i64 = 1_800_000_000;

    fn policy() -> SignerPolicy {
        SignerPolicy {
            signer_name: "dramesh.io/agent".into(),
            cluster: "east".into(),
            namespace: "dramesh-system".into(),
            service_account: "dramesh-agent".into(),
            lifetime_secs: 86_400,
        }
    }

    fn ca() -> SigningCa {
        SigningCa {
            ca: dramesh_mesh::certs::generate_ca("test CA", 1).unwrap(),
            chain_pem: String::new(),
        }
    }

    /// A request as a 1.36 kubelet sends it: a stub CSR signed by the pod's new key.
    fn request(key: &KeyPair, node: &str) -> PodCertificateRequest {
        let csr = rcgen::CertificateParams::default()
            .serialize_request(key)
            .unwrap();
        PodCertificateRequest {
            metadata: ObjectMeta {
                name: Some("req-1".into()),
                namespace: Some("dramesh-system".into()),
                ..Default::default()
            },
            spec: PodCertificateRequestSpec {
                signer_name: "dramesh.io/agent".into(),
                pod_name: "dramesh-agent-x".into(),
                pod_uid: "uid-1".into(),
                service_account_name: "dramesh-agent".into(),
                service_account_uid: "sa-uid".into(),
                node_name: node.into(),
                node_uid: "node-uid".into(),
                max_expiration_seconds: Some(86_400),
                stub_pkc_s10_request: ByteString(csr.der().to_vec()),
                ..Default::default()
            },
            status: None,
        }
    }

    fn issued(d: &Decision) -> (&PodCertificateRequestStatus, &PeerIdentity) {
        match d {
            Decision::Write {
                status,
                verdict: Verdict::Issued(id),
            } => (status, id),
            other => panic!("expected an issued certificate, got {other:?}"),
        }
    }

    fn denial(d: &Decision) -> &'static str {
        match d {
            Decision::Write {
                status,
                verdict: Verdict::Denied { reason, .. },
            } => {
                assert_eq!(final_condition(Some(status)), Some(DENIED));
                assert!(status.certificate_chain.is_none());
                reason
            }
            other => panic!("expected a denial, got {other:?}"),
        }
    }

    #[test]
    fn issues_the_attested_node_identity_with_consistent_times() {
        let key = KeyPair::generate().unwrap();
        let d = decide(&request(&key, "n1"), &policy(), &ca(), NOW);
        let (status, id) = issued(&d);
        let want = PeerIdentity::Agent {
            cluster: "east".into(),
            node: "n1".into(),
        };
        assert_eq!(*id, want);
        let chain = status.certificate_chain.as_deref().unwrap();
        let (_, pem) = x509_parser::pem::parse_x509_pem(chain.as_bytes()).unwrap();
        let der = pem.contents;
        assert_eq!(PeerIdentity::from_certificate_der(&der).unwrap(), want);
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        // Issued to the requester's key, not one the signer made up.
        assert_eq!(
            cert.public_key().raw,
            key.subject_public_key_info().as_slice()
        );
        let nb = cert.validity().not_before.timestamp();
        let na = cert.validity().not_after.timestamp();
        assert_eq!(status.not_before.as_ref().unwrap().0.as_second(), nb);
        assert_eq!(status.not_after.as_ref().unwrap().0.as_second(), na);
        assert_eq!(nb, NOW - BACKDATE_SECS);
        assert_eq!(na - nb, 86_400);
        let refresh = status.begin_refresh_at.as_ref().unwrap().0.as_second();
        assert!(refresh >= nb + 600 && refresh <= na - 600, "{refresh}");
        assert_eq!(final_condition(Some(status)), Some(ISSUED));
    }

    #[test]
    fn lifetime_follows_max_expiration_and_refuses_below_an_hour() {
        let key = KeyPair::generate().unwrap();
        let mut req = request(&key, "n1");
        req.spec.max_expiration_seconds = Some(3600);
        let d = decide(&req, &policy(), &ca(), NOW);
        let (status, _) = issued(&d);
        let nb = status.not_before.as_ref().unwrap().0.as_second();
        let na = status.not_after.as_ref().unwrap().0.as_second();
        assert_eq!(na - nb, 3600);
        let refresh = status.begin_refresh_at.as_ref().unwrap().0.as_second();
        assert!(refresh >= nb + 600 && refresh <= na - 600);
        let mut short = policy();
        short.lifetime_secs = 600;
        assert_eq!(
            denial(&decide(&request(&key, "n1"), &short, &ca(), NOW)),
            "LifetimeTooShort"
        );
    }

    #[test]
    fn other_signers_and_final_requests_are_left_alone() {
        let key = KeyPair::generate().unwrap();
        let mut req = request(&key, "n1");
        req.spec.signer_name = "example.com/other".into();
        assert_eq!(decide(&req, &policy(), &ca(), NOW), Decision::Skip);
        let mut req = request(&key, "n1");
        req.status = Some(PodCertificateRequestStatus {
            conditions: Some(vec![condition(DENIED, "X", "", NOW)]),
            ..Default::default()
        });
        assert_eq!(decide(&req, &policy(), &ca(), NOW), Decision::Skip);
    }

    #[test]
    fn pods_other_than_the_agent_are_denied() {
        let key = KeyPair::generate().unwrap();
        let mut req = request(&key, "n1");
        req.metadata.namespace = Some("default".into());
        assert_eq!(denial(&decide(&req, &policy(), &ca(), NOW)), "NotAgentPod");
        let mut req = request(&key, "n1");
        req.spec.service_account_name = "default".into();
        assert_eq!(denial(&decide(&req, &policy(), &ca(), NOW)), "NotAgentPod");
        let mut req = request(&key, "n1");
        req.spec.unverified_user_annotations =
            Some([("example.com/node".to_owned(), "n2".to_owned())].into());
        assert_eq!(
            denial(&decide(&req, &policy(), &ca(), NOW)),
            "UnknownUserAnnotation"
        );
        for node in ["_cluster", "N1", ""] {
            let req = request(&key, node);
            assert_eq!(
                denial(&decide(&req, &policy(), &ca(), NOW)),
                "InvalidNodeName"
            );
        }
    }

    #[test]
    fn a_csr_whose_signature_does_not_verify_is_denied() {
        let key = KeyPair::generate().unwrap();
        let mut req = request(&key, "n1");
        let csr = &mut req.spec.stub_pkc_s10_request.0;
        let last = csr.len() - 1;
        csr[last] ^= 0x01;
        assert_eq!(
            denial(&decide(&req, &policy(), &ca(), NOW)),
            "BadProofOfPossession"
        );
        let mut req = request(&key, "n1");
        req.spec.stub_pkc_s10_request = ByteString(Vec::new());
        assert_eq!(
            denial(&decide(&req, &policy(), &ca(), NOW)),
            "BadProofOfPossession"
        );
    }

    fn legacy(key: &KeyPair, signed_uid: &str) -> PodCertificateRequest {
        let mut req = request(key, "n1");
        req.spec.stub_pkc_s10_request = ByteString(Vec::new());
        req.spec.pkix_public_key = Some(ByteString(key.subject_public_key_info()));
        req.spec.proof_of_possession = Some(ByteString(key.sign(signed_uid.as_bytes()).unwrap()));
        req
    }

    #[test]
    fn legacy_proof_over_the_pod_uid_is_checked_per_key_type() {
        for alg in [
            &rcgen::PKCS_ED25519,
            &rcgen::PKCS_ECDSA_P256_SHA256,
            &rcgen::PKCS_ECDSA_P384_SHA384,
        ] {
            let key = KeyPair::generate_for(alg).unwrap();
            if alg == &rcgen::PKCS_ECDSA_P384_SHA384 {
                // rcgen signs P-384 over SHA-384; Go's kubelet signs SHA-256(pod UID), which
                // ring checks as ECDSA_P384_SHA256: a SHA-384 proof must not pass.
                assert_eq!(
                    denial(&decide(&legacy(&key, "uid-1"), &policy(), &ca(), NOW)),
                    "BadProofOfPossession"
                );
                continue;
            }
            issued(&decide(&legacy(&key, "uid-1"), &policy(), &ca(), NOW));
            assert_eq!(
                denial(&decide(&legacy(&key, "uid-2"), &policy(), &ca(), NOW)),
                "BadProofOfPossession",
                "{alg:?}"
            );
        }
    }

    /// An RSA-3072 SubjectPublicKeyInfo (a key type the kubelet may generate; ring cannot).
    const RSA_3072_SPKI: &str = concat!(
        "MIIBojANBgkqhkiG9w0BAQEFAAOCAY8AMIIBigKCAYEAwKF8h5oTJ4WlM4xwvH5MSmHW02e54XNHn8806JrwUO81",
        "ap/wIO2v9IZe65fn7zx7Q/P9sXCvYGWAtaaYMzsacyvvV6aiCJgTw1Mj284IBV6uoNh6vm7X69uZnlxRlbJywjMA",
        "T7gg/nnbK0SOHjV+Seq5U0p60drRaaQjHv5N8LBfQR+PjotkiqEYjA+oBaakYveRQ9N4HZHHB5Rh+tMEgnhJP+pp",
        "KsA4VmBSZqMsMx+BD6E7cZmCwrFk/8WM21TJmQcoO/yuPu61XWr4cc50MEXkkt1JrWsVSYqgqAmlE3ahE3DWVIj6",
        "V7nsL5uogtdqximHZEWyK5omYNEbOlV3YSnb4TFZkfAy/e8cO4wIoA63JVw0H8zLAG2rroLVkifLPF3vfRdoh4cI",
        "PnyvYbgDKfo9i6dVFQA8+1uJ+hKXMGPAi0pOULYqa4YdDAU1kOJSZ4wmBJlf8Je+kYdYFvLXE/2v0yqirZanI5jw",
        "QKt8J7uwfI5+46b5UnjtWFTowpTTAgMBAAE=",
    );

    #[test]
    fn key_types_the_mesh_does_not_sign_with_are_denied_as_unsupported() {
        let key = KeyPair::generate().unwrap();
        let mut req = legacy(&key, "uid-1");
        req.spec.pkix_public_key =
            Some(serde_json::from_value(serde_json::json!(RSA_3072_SPKI)).unwrap());
        assert_eq!(
            denial(&decide(&req, &policy(), &ca(), NOW)),
            UNSUPPORTED_KEY_TYPE
        );
    }

    #[test]
    fn intermediates_follow_the_leaf() {
        let root = dramesh_mesh::certs::generate_ca("root", 1).unwrap();
        let mut signing = ca();
        signing.chain_pem = root.cert_pem.clone();
        let key = KeyPair::generate().unwrap();
        let d = decide(&request(&key, "n1"), &policy(), &signing, NOW);
        let chain = issued(&d).0.certificate_chain.clone().unwrap();
        assert_eq!(chain.matches("BEGIN CERTIFICATE").count(), 2);
        assert!(chain.ends_with(&root.cert_pem));
    }
}
