//! Development PKI for the mesh: a project CA and replica/agent certificates (rcgen), written
//! as PEM files and loaded back as [`TlsIdentity`].
//!
//! Every leaf certificate carries exactly one identity URI SAN (see [`crate::identity`]) and
//! the fixed DNS SAN [`MESH_SERVER_NAME`], which clients use as the TLS server name: peers are
//! identified by the URI SAN after the handshake, not by address, so addresses may change.
//! Leaves are valid for both server and client authentication because replicas both accept
//! and dial.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::identity::{IdentityError, PeerIdentity};

/// DNS name present in every mesh certificate and used as the TLS server name.
pub const MESH_SERVER_NAME: &str = "mesh.dramesh.invalid";

/// Why a certificate could not be generated, read or written; each message names the file or
/// identity concerned.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen could not build a key or certificate.
    #[error("certificate generation failed for {what}: {source}")]
    Generate {
        /// What was being generated (the CA or an identity).
        what: String,
        /// rcgen's error.
        #[source]
        source: rcgen::Error,
    },
    /// A certificate or key file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A certificate or key file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file or string holds no usable PEM block of the expected kind.
    #[error("{what} holds no usable PEM {kind}: {detail}")]
    Pem {
        /// The file or input read.
        what: String,
        /// The expected block: certificate or private key.
        kind: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// A certificate does not carry exactly one valid dramesh identity.
    #[error("certificate {what} has no valid mesh identity: {source}")]
    Identity {
        /// The certificate (file or identity).
        what: String,
        /// Why the identity was refused.
        #[source]
        source: IdentityError,
    },
}

/// A certificate authority: its certificate and private key, PEM encoded.
#[derive(Debug, Clone)]
pub struct CaBundle {
    /// The CA certificate.
    pub cert_pem: String,
    /// The CA private key.
    pub key_pem: String,
}

/// A leaf certificate and its private key, PEM encoded.
#[derive(Debug, Clone)]
pub struct LeafBundle {
    /// The identity the certificate's URI SAN names.
    pub identity: PeerIdentity,
    /// The leaf certificate.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
}

/// Everything a node needs for mutual TLS, in DER form.
#[derive(Debug)]
pub struct TlsIdentity {
    /// Leaf first, then any intermediates.
    pub cert_chain: Vec<CertificateDer<'static>>,
    /// The leaf's private key.
    pub key: PrivateKeyDer<'static>,
    /// Trust anchors: peers must chain to one of these.
    pub ca_certs: Vec<CertificateDer<'static>>,
    /// Identity read from the leaf certificate.
    pub identity: PeerIdentity,
}

impl Clone for TlsIdentity {
    fn clone(&self) -> Self {
        Self {
            cert_chain: self.cert_chain.clone(),
            key: self.key.clone_key(),
            ca_certs: self.ca_certs.clone(),
            identity: self.identity.clone(),
        }
    }
}

fn gen_err(what: &str) -> impl FnOnce(rcgen::Error) -> CertError + '_ {
    move |source| CertError::Generate {
        what: what.to_owned(),
        source,
    }
}

/// Generates a self-signed development CA valid for `valid_days` days.
pub fn generate_ca(common_name: &str, valid_days: u32) -> Result<CaBundle, CertError> {
    let key = KeyPair::generate().map_err(gen_err("CA key"))?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, "dramesh");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    set_validity(&mut params, valid_days);
    let cert = params
        .self_signed(&key)
        .map_err(gen_err("CA certificate"))?;
    Ok(CaBundle {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

fn set_validity(params: &mut CertificateParams, valid_days: u32) {
    let now = time::OffsetDateTime::now_utc();
    // Tolerate modest clock skew between nodes.
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(i64::from(valid_days));
}

/// Issues a leaf certificate for `identity`, signed by `ca`.
pub fn issue_leaf(
    ca: &CaBundle,
    identity: &PeerIdentity,
    valid_days: u32,
) -> Result<LeafBundle, CertError> {
    let what = identity.uri();
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(gen_err("CA key PEM"))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key).map_err(gen_err("CA cert PEM"))?;
    let key = KeyPair::generate().map_err(gen_err(&what))?;
    let mut params = leaf_params(identity)?;
    set_validity(&mut params, valid_days);
    let cert = params.signed_by(&key, &issuer).map_err(gen_err(&what))?;
    Ok(LeafBundle {
        identity: identity.clone(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// What every mesh leaf carries: the identity URI SAN (also the CommonName), the DNS SAN
/// [`MESH_SERVER_NAME`], digital signature for both server and client authentication.
fn leaf_params(identity: &PeerIdentity) -> Result<CertificateParams, CertError> {
    let what = identity.uri();
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, what.as_str());
    params.distinguished_name = dn;
    params.subject_alt_names = vec![
        SanType::URI(what.clone().try_into().map_err(gen_err(&what))?),
        SanType::DnsName(MESH_SERVER_NAME.try_into().map_err(gen_err(&what))?),
    ];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

/// Checks that `ca` can sign: its certificate and key parse and the key is of a kind rcgen
/// signs with.
pub fn check_ca(ca: &CaBundle) -> Result<(), CertError> {
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(gen_err("CA key PEM"))?;
    Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key).map_err(gen_err("CA cert PEM"))?;
    Ok(())
}

/// Issues a mesh leaf for `identity` to a public key whose private key is held elsewhere (a
/// Pod Certificates request: the kubelet keeps the key), signed by `ca` and valid exactly from
/// `not_before` to `not_after` (Unix seconds; the API checks both against the certificate).
/// `spki_der` is the requester's DER SubjectPublicKeyInfo. Returns the leaf, PEM.
pub fn issue_leaf_for_key(
    ca: &CaBundle,
    identity: &PeerIdentity,
    spki_der: &[u8],
    not_before: i64,
    not_after: i64,
) -> Result<String, CertError> {
    let what = identity.uri();
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(gen_err("CA key PEM"))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key).map_err(gen_err("CA cert PEM"))?;
    let key = rcgen::SubjectPublicKeyInfo::from_der(spki_der).map_err(gen_err(&what))?;
    let mut params = leaf_params(identity)?;
    let at = |secs: i64| {
        time::OffsetDateTime::from_unix_timestamp(secs).map_err(|e| CertError::Generate {
            what: what.clone(),
            source: rcgen::Error::X509(format!("validity time {secs}: {e}")),
        })
    };
    params.not_before = at(not_before)?;
    params.not_after = at(not_after)?;
    let cert = params.signed_by(&key, &issuer).map_err(gen_err(&what))?;
    Ok(cert.pem())
}

fn write(path: &Path, contents: &str, private: bool) -> Result<(), CertError> {
    let err = |source| CertError::Write {
        path: path.to_owned(),
        source,
    };
    std::fs::write(path, contents).map_err(err)?;
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    #[cfg(not(unix))]
    let _ = private;
    Ok(())
}

/// Paths of one written identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PemPaths {
    /// The certificate file.
    pub cert: PathBuf,
    /// The private key file.
    pub key: PathBuf,
}

/// Writes `ca.crt` and `ca.key` into `dir` (created if needed).
pub fn write_ca(dir: &Path, ca: &CaBundle) -> Result<PemPaths, CertError> {
    std::fs::create_dir_all(dir).map_err(|source| CertError::Write {
        path: dir.to_owned(),
        source,
    })?;
    let paths = PemPaths {
        cert: dir.join("ca.crt"),
        key: dir.join("ca.key"),
    };
    write(&paths.cert, &ca.cert_pem, false)?;
    write(&paths.key, &ca.key_pem, true)?;
    Ok(paths)
}

/// File stem for an identity: `replica-<id>` or `agent-<cluster>-<node>`.
pub fn file_stem(identity: &PeerIdentity) -> String {
    match identity {
        PeerIdentity::Replica { id } => format!("replica-{id}"),
        PeerIdentity::Agent { cluster, node } => format!("agent-{cluster}-{node}"),
    }
}

/// Writes `<stem>.crt` and `<stem>.key` into `dir` (see [`file_stem`]).
pub fn write_leaf(dir: &Path, leaf: &LeafBundle) -> Result<PemPaths, CertError> {
    std::fs::create_dir_all(dir).map_err(|source| CertError::Write {
        path: dir.to_owned(),
        source,
    })?;
    let stem = file_stem(&leaf.identity);
    let paths = PemPaths {
        cert: dir.join(format!("{stem}.crt")),
        key: dir.join(format!("{stem}.key")),
    };
    write(&paths.cert, &leaf.cert_pem, false)?;
    write(&paths.key, &leaf.key_pem, true)?;
    Ok(paths)
}

/// Parses PEM text into a [`TlsIdentity`]; `what` names the source in errors.
pub fn identity_from_pem(
    cert_pem: &str,
    key_pem: &str,
    ca_pem: &str,
    what: &str,
) -> Result<TlsIdentity, CertError> {
    let pem_err = |kind: &'static str| {
        move |e: rustls::pki_types::pem::Error| CertError::Pem {
            what: what.to_owned(),
            kind,
            detail: e.to_string(),
        }
    };
    let cert_chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(pem_err("certificate"))?;
    let ca_certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(ca_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(pem_err("CA certificate"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(pem_err("private key"))?;
    let leaf = cert_chain.first().ok_or_else(|| CertError::Pem {
        what: what.to_owned(),
        kind: "certificate",
        detail: "no CERTIFICATE block".into(),
    })?;
    if ca_certs.is_empty() {
        return Err(CertError::Pem {
            what: what.to_owned(),
            kind: "CA certificate",
            detail: "no CERTIFICATE block".into(),
        });
    }
    let identity =
        PeerIdentity::from_certificate_der(leaf).map_err(|source| CertError::Identity {
            what: what.to_owned(),
            source,
        })?;
    Ok(TlsIdentity {
        cert_chain,
        key,
        ca_certs,
        identity,
    })
}

/// Largest PEM file read: a chain, key or CA bundle is a few KiB, so this leaves room for long
/// chains and many CAs while a wrong path (a log, a device) cannot exhaust memory.
pub const MAX_PEM_FILE_BYTES: u64 = 1024 * 1024;

/// Reads a PEM file of at most [`MAX_PEM_FILE_BYTES`] as text.
pub fn read_pem_file(path: &Path) -> Result<String, CertError> {
    use std::io::Read as _;
    let err = |source| CertError::Read {
        path: path.to_owned(),
        source,
    };
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(err)?
        .take(MAX_PEM_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(err)?;
    if text.len() as u64 > MAX_PEM_FILE_BYTES {
        return Err(err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {MAX_PEM_FILE_BYTES} bytes, not a PEM file of this kind"),
        )));
    }
    Ok(text)
}

/// Loads a node's certificate, key and CA from PEM files.
pub fn load_identity(cert: &Path, key: &Path, ca: &Path) -> Result<TlsIdentity, CertError> {
    let read = read_pem_file;
    identity_from_pem(
        &read(cert)?,
        &read(key)?,
        &read(ca)?,
        &cert.display().to_string(),
    )
}

/// In-memory identity issued by `ca` (tests and single-process setups).
pub fn issue_identity(
    ca: &CaBundle,
    identity: &PeerIdentity,
    valid_days: u32,
) -> Result<TlsIdentity, CertError> {
    let leaf = issue_leaf(ca, identity, valid_days)?;
    identity_from_pem(&leaf.cert_pem, &leaf.key_pem, &ca.cert_pem, &identity.uri())
}

/// A certificate of the replicas' API listeners (not a mesh identity): a server certificate
/// for `hosts` (DNS names or IP addresses), or a client certificate naming a caller the way
/// Kubernetes does (CommonName = user, Organizations = groups).
#[derive(Debug, Clone)]
pub struct ApiLeaf {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key, PEM.
    pub key_pem: String,
}

/// Issues an API certificate signed by `ca`: a server certificate when `hosts` is not empty
/// (each an IP address or a DNS name), else a client certificate for `user` in `groups`.
/// rcgen keeps one value per subject attribute type, so only the last group is written.
pub fn issue_api_leaf(
    ca: &CaBundle,
    user: &str,
    groups: &[String],
    hosts: &[String],
    valid_days: u32,
) -> Result<ApiLeaf, CertError> {
    let what = format!("API certificate {user}");
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(gen_err("CA key PEM"))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key).map_err(gen_err("CA cert PEM"))?;
    let key = KeyPair::generate().map_err(gen_err(&what))?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, user);
    for g in groups {
        dn.push(DnType::OrganizationName, g.as_str());
    }
    params.distinguished_name = dn;
    params.subject_alt_names = hosts
        .iter()
        .map(|h| match h.parse::<std::net::IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => Ok(SanType::DnsName(
                h.clone().try_into().map_err(gen_err(&what))?,
            )),
        })
        .collect::<Result<_, CertError>>()?;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![if hosts.is_empty() {
        ExtendedKeyUsagePurpose::ClientAuth
    } else {
        ExtendedKeyUsagePurpose::ServerAuth
    }];
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, valid_days);
    let cert = params.signed_by(&key, &issuer).map_err(gen_err(&what))?;
    Ok(ApiLeaf {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Writes `<stem>.crt` and `<stem>.key` (mode 0600) into `dir` (created if needed).
pub fn write_api_leaf(dir: &Path, stem: &str, leaf: &ApiLeaf) -> Result<PemPaths, CertError> {
    std::fs::create_dir_all(dir).map_err(|source| CertError::Write {
        path: dir.to_owned(),
        source,
    })?;
    let paths = PemPaths {
        cert: dir.join(format!("{stem}.crt")),
        key: dir.join(format!("{stem}.key")),
    };
    write(&paths.cert, &leaf.cert_pem, false)?;
    write(&paths.key, &leaf.key_pem, true)?;
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_write_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let ca = generate_ca("dramesh dev CA", 30).unwrap();
        let ca_paths = write_ca(dir.path(), &ca).unwrap();
        let id = PeerIdentity::Agent {
            cluster: "east".into(),
            node: "n1".into(),
        };
        let leaf = issue_leaf(&ca, &id, 30).unwrap();
        let paths = write_leaf(dir.path(), &leaf).unwrap();
        assert!(paths.cert.ends_with("agent-east-n1.crt"));
        let loaded = load_identity(&paths.cert, &paths.key, &ca_paths.cert).unwrap();
        assert_eq!(loaded.identity, id);
        assert_eq!(loaded.ca_certs.len(), 1);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&paths.key).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    /// The README's "Clock faults": a peer whose clock is up to an hour behind the issuer's
    /// still finds the certificates valid, and not more.
    #[test]
    fn issued_certificates_are_valid_from_an_hour_before_issue() {
        let ca = generate_ca("x", 30).unwrap();
        let id = PeerIdentity::Replica { id: "r1".into() };
        let leaf = issue_leaf(&ca, &id, 30).unwrap();
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        for pem in [&ca.cert_pem, &leaf.cert_pem] {
            let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
            let cert = p.parse_x509().unwrap();
            let from = cert.validity().not_before.timestamp();
            assert!(
                (now - 3600 - 60..=now - 3600).contains(&from),
                "{from} vs {now}"
            );
        }
    }

    #[test]
    fn an_oversized_pem_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let ca = generate_ca("x", 1).unwrap();
        let ca_paths = write_ca(dir.path(), &ca).unwrap();
        let big = dir.path().join("big.crt");
        // A valid CA followed by padding: only the size is wrong.
        let mut text = ca.cert_pem.clone();
        text.push_str(&"\n".repeat(MAX_PEM_FILE_BYTES as usize));
        std::fs::write(&big, text).unwrap();
        let err = load_identity(&ca_paths.cert, &ca_paths.key, &big).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, CertError::Read { .. }), "{msg}");
        assert!(
            msg.contains("big.crt") && msg.contains("larger than"),
            "{msg}"
        );
        // Within the limit it is read whole.
        std::fs::write(&big, &ca.cert_pem).unwrap();
        assert_eq!(read_pem_file(&big).unwrap(), ca.cert_pem);
    }

    #[test]
    fn certificate_without_identity_is_refused() {
        let ca = generate_ca("x", 1).unwrap();
        // The CA certificate itself has no URI SAN.
        let err = identity_from_pem(&ca.cert_pem, &ca.key_pem, &ca.cert_pem, "ca").unwrap_err();
        assert!(matches!(err, CertError::Identity { .. }), "{err}");
    }
}
