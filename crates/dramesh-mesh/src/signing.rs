//! Signed heads with mesh identities: the store's [`HeadsSigner`] and [`HeadsVerifier`] backed by
//! the node's TLS certificate and the mesh CA.
//!
//! A writer signs with the private key of its mesh certificate; the signer credential that
//! travels with the signature is its certificate chain. A receiver accepts a signature only if
//! the chain verifies against the mesh CA exactly as a TLS client certificate would (same
//! rustls/webpki verifier, so expiry and key usage are enforced), the leaf's identity URI owns
//! the document ([`PeerIdentity::owns`]), and the signature over the statement verifies with the
//! leaf's key under the TLS 1.3 signature scheme it names.
//!
//! Wire encodings (opaque to the store): signature = scheme (TLS `SignatureScheme`, u16 big
//! endian) ‖ signature bytes; signer = for each certificate, leaf first: length (u32 big
//! endian) ‖ DER.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dramesh_store::{DocId, HeadsSigner, HeadsVerifier, Trust};
use rustls::SignatureScheme;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::sign::{Signer, SigningKey};
use sha2::{Digest as _, Sha256};

use crate::certs::TlsIdentity;
use crate::identity::PeerIdentity;

/// Schemes a writer may sign with, in order of preference (those of the mesh's certificates).
const SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ED25519,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::RSA_PSS_SHA256,
];
/// Most certificates in a signer chain.
const MAX_CHAIN: usize = 4;
/// How long a verified chain is trusted without verifying it again; never past the expiry of
/// any of its certificates, which is checked on every use. Longer than the interval at which a
/// writer of a large fleet changes its document (100,000 per-node writers at 1,000 updates/s
/// each write every ~100 s): with a one-minute lifetime nearly every signature cost a second
/// ECDSA verification, of its chain.
const CHAIN_CACHE_TTL: Duration = Duration::from_secs(30 * 60);
/// Most verified chains remembered: one per writer whose signature was verified within
/// [`CHAIN_CACHE_TTL`], so a fleet of per-node writers (100,000 documents) does not verify
/// every chain anew.
const CHAIN_CACHE_ENTRIES: usize = 131_072;
/// How long a verified signature is remembered: the node verifies a sync message's signature on
/// its connection task and the store checks it again on the protocol thread moments later
/// (see `node::verify_ahead`), or hears the same signed heads from several peers.
const PASSED_TTL: Duration = Duration::from_secs(60);
/// Most verified signatures remembered.
const PASSED_ENTRIES: usize = 65_536;

/// Why signing material could not be built from a TLS identity.
#[derive(Debug, thiserror::Error)]
pub enum SigningError {
    /// The private key is of a kind rustls cannot sign with, or offers none of the schemes.
    #[error("mesh private key cannot sign: {0}")]
    Key(String),
    /// The CA certificates do not form a usable trust store.
    #[error("mesh CA unusable for verifying signatures: {0}")]
    Ca(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Encodes a certificate chain as a signer credential.
pub fn encode_chain(chain: &[CertificateDer<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chain {
        out.extend_from_slice(&(c.len() as u32).to_be_bytes());
        out.extend_from_slice(c);
    }
    out
}

fn decode_chain(mut bytes: &[u8]) -> Result<Vec<CertificateDer<'_>>, String> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        if out.len() == MAX_CHAIN {
            return Err(format!(
                "signer chain holds more than {MAX_CHAIN} certificates"
            ));
        }
        let len = bytes
            .get(..4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or("signer chain is cut short")?;
        let der = bytes
            .get(4..4 + len)
            .ok_or("signer chain certificate is cut short")?;
        out.push(CertificateDer::from(der));
        bytes = &bytes[4 + len..];
    }
    if out.is_empty() {
        return Err("signer chain is empty".into());
    }
    Ok(out)
}

/// Signs with the node's mesh key (see the module docs).
pub struct MeshSigner {
    signer: Box<dyn Signer>,
    chain: Arc<[u8]>,
}

impl MeshSigner {
    /// The signer of `id`: its private key and certificate chain.
    pub fn new(id: &TlsIdentity) -> Result<MeshSigner, SigningError> {
        let key: Arc<dyn SigningKey> = rustls::crypto::ring::sign::any_supported_type(&id.key)
            .map_err(|e| SigningError::Key(e.to_string()))?;
        let signer = key
            .choose_scheme(SCHEMES)
            .ok_or_else(|| SigningError::Key(format!("none of {SCHEMES:?} is offered")))?;
        Ok(MeshSigner {
            signer,
            chain: encode_chain(&id.cert_chain).into(),
        })
    }
}

impl HeadsSigner for MeshSigner {
    fn signer(&self) -> Arc<[u8]> {
        self.chain.clone()
    }

    fn sign(&self, statement: &[u8]) -> Result<Vec<u8>, String> {
        let sig = self.signer.sign(statement).map_err(|e| e.to_string())?;
        let mut out = Vec::with_capacity(2 + sig.len());
        out.extend_from_slice(&u16::from(self.signer.scheme()).to_be_bytes());
        out.extend_from_slice(&sig);
        Ok(out)
    }
}

/// Verifies writers' signatures against the mesh CA (see the module docs).
pub struct MeshVerifier {
    chains: Arc<dyn ClientCertVerifier>,
    algorithms: WebPkiSupportedAlgorithms,
    /// SHA-256 of a signer chain -> its identity, when it was verified, and the earliest
    /// expiry of its certificates (seconds since the epoch).
    verified: Mutex<HashMap<[u8; 32], (PeerIdentity, Instant, u64)>>,
    /// SHA-256 of (statement, signature, signer chain) that verified -> when.
    passed: Mutex<HashMap<[u8; 32], Instant>>,
}

impl MeshVerifier {
    /// A verifier trusting `ca_certs`.
    pub fn new(ca_certs: &[CertificateDer<'static>]) -> Result<MeshVerifier, SigningError> {
        let mut roots = rustls::RootCertStore::empty();
        for c in ca_certs {
            roots
                .add(c.clone())
                .map_err(|e| SigningError::Ca(e.to_string()))?;
        }
        let provider = provider();
        let algorithms = provider.signature_verification_algorithms;
        let chains =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| SigningError::Ca(e.to_string()))?;
        Ok(MeshVerifier {
            chains,
            algorithms,
            verified: Mutex::new(HashMap::new()),
            passed: Mutex::new(HashMap::new()),
        })
    }

    /// The identity of a signer chain that verifies against the CA now.
    fn identity(&self, signer: &[u8]) -> Result<PeerIdentity, String> {
        let key: [u8; 32] = Sha256::digest(signer).into();
        let now = Instant::now();
        let unix_now = UnixTime::now();
        let fresh = |at: &Instant, expires: u64| {
            now.duration_since(*at) < CHAIN_CACHE_TTL && unix_now.as_secs() < expires
        };
        if let Some((id, at, expires)) = crate::sync::lock(&self.verified).get(&key)
            && fresh(at, *expires)
        {
            return Ok(id.clone());
        }
        let chain = decode_chain(signer)?;
        let (leaf, intermediates) = chain.split_first().ok_or("signer chain is empty")?;
        self.chains
            .verify_client_cert(leaf, intermediates, unix_now)
            .map_err(|e| format!("signer certificate does not verify against the mesh CA: {e}"))?;
        let id = PeerIdentity::from_certificate_der(leaf).map_err(|e| e.to_string())?;
        let expires = chain_expiry(&chain)?;
        let mut cache = crate::sync::lock(&self.verified);
        if cache.len() >= CHAIN_CACHE_ENTRIES {
            cache.retain(|_, (_, at, expires)| fresh(at, *expires));
            if cache.len() >= CHAIN_CACHE_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(key, (id.clone(), now, expires));
        Ok(id)
    }
}

/// The earliest `notAfter` of a verified chain's certificates, in seconds since the epoch.
fn chain_expiry(chain: &[CertificateDer<'_>]) -> Result<u64, String> {
    let mut earliest = u64::MAX;
    for der in chain {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| format!("signer certificate: {e}"))?;
        let not_after = u64::try_from(cert.validity().not_after.timestamp()).unwrap_or(0);
        earliest = earliest.min(not_after);
    }
    Ok(earliest)
}

impl HeadsVerifier for MeshVerifier {
    fn verify(
        &self,
        doc: &DocId,
        statement: &[u8],
        signature: &[u8],
        signer: &[u8],
    ) -> Result<(), String> {
        let id = self.identity(signer)?;
        if !id.owns(doc) {
            return Err(format!("signer {id} may not write {doc}"));
        }
        let key: [u8; 32] = {
            let mut h = Sha256::new();
            for part in [statement, signature, signer] {
                h.update((part.len() as u64).to_le_bytes());
                h.update(part);
            }
            h.finalize().into()
        };
        let now = Instant::now();
        if crate::sync::lock(&self.passed)
            .get(&key)
            .is_some_and(|at| now.duration_since(*at) < PASSED_TTL)
        {
            return Ok(());
        }
        let (scheme, sig) = match signature {
            [a, b, rest @ ..] => (SignatureScheme::from(u16::from_be_bytes([*a, *b])), rest),
            _ => return Err("signature is cut short".into()),
        };
        let algs = self
            .algorithms
            .mapping
            .iter()
            .find(|(s, _)| *s == scheme)
            .map(|(_, algs)| *algs)
            .ok_or_else(|| format!("signature scheme {scheme:?} is not accepted"))?;
        let chain = decode_chain(signer)?;
        let leaf = webpki::EndEntityCert::try_from(&chain[0])
            .map_err(|e| format!("signer certificate: {e}"))?;
        let alg = algs.first().ok_or("signature scheme has no algorithm")?;
        leaf.verify_signature(*alg, statement, sig)
            .map_err(|e| format!("signature by {id} does not verify: {e}"))?;
        let mut passed = crate::sync::lock(&self.passed);
        if passed.len() >= PASSED_ENTRIES {
            passed.retain(|_, at| now.duration_since(*at) < PASSED_TTL);
            if passed.len() >= PASSED_ENTRIES {
                passed.clear();
            }
        }
        passed.insert(key, now);
        Ok(())
    }
}

/// The trust a mesh node installs into its store: signing with `id`'s key, verifying against
/// its CA.
pub fn trust(id: &TlsIdentity) -> Result<Trust, SigningError> {
    Ok(Trust {
        signer: Some(Arc::new(MeshSigner::new(id)?)),
        verifier: Arc::new(MeshVerifier::new(&id.ca_certs)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs;

    /// A signature that verified is remembered (the node verifies ahead of the store); one
    /// that did not, or another signature over the same statement, is checked in full.
    #[test]
    fn a_verified_signature_is_remembered_and_nothing_else() {
        let ca = certs::generate_ca("test CA", 30).unwrap();
        let id = PeerIdentity::Agent {
            cluster: "c".into(),
            node: "n".into(),
        };
        let tls = certs::issue_identity(&ca, &id, 2).unwrap();
        let signer = MeshSigner::new(&tls).unwrap();
        let verifier = MeshVerifier::new(&tls.ca_certs).unwrap();
        let doc = DocId::new("c", "n");
        let statement = b"doc c/n generation 1 heads ...";
        let sig = signer.sign(statement).unwrap();
        let chain = signer.signer();
        verifier.verify(&doc, statement, &sig, &chain).unwrap();
        assert_eq!(crate::sync::lock(&verifier.passed).len(), 1);
        verifier.verify(&doc, statement, &sig, &chain).unwrap();
        let mut forged = sig.clone();
        let last = forged.len() - 1;
        forged[last] ^= 1;
        assert!(verifier.verify(&doc, statement, &forged, &chain).is_err());
        assert!(
            verifier
                .verify(&doc, b"another statement", &sig, &chain)
                .is_err()
        );
        assert_eq!(
            crate::sync::lock(&verifier.passed).len(),
            1,
            "a failed check was remembered"
        );
        // The document check comes first, whatever is remembered.
        let other = DocId::new("c", "m");
        assert!(verifier.verify(&other, statement, &sig, &chain).is_err());
    }

    /// A cached chain is trusted until the earliest expiry among its certificates.
    #[test]
    fn a_chain_expires_with_its_shortest_lived_certificate() {
        let ca = certs::generate_ca("test CA", 30).unwrap();
        let id = PeerIdentity::Agent {
            cluster: "c".into(),
            node: "n".into(),
        };
        let leaf = certs::issue_identity(&ca, &id, 2).unwrap();
        let now = UnixTime::now().as_secs();
        let mut chain = leaf.cert_chain.clone();
        let leaf_expiry = chain_expiry(&chain).unwrap();
        assert!(
            leaf_expiry > now + 86_400 && leaf_expiry <= now + 2 * 86_400 + 60,
            "{leaf_expiry} vs now {now}"
        );
        chain.extend(leaf.ca_certs.iter().cloned());
        assert_eq!(chain_expiry(&chain).unwrap(), leaf_expiry);
        assert!(chain_expiry(&[CertificateDer::from(vec![1, 2, 3])]).is_err());
    }
}
