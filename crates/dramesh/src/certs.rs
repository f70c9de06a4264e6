//! `dramesh certs`: a development PKI for the mesh.
//!
//! Writes `ca.crt`/`ca.key` and one certificate and key per identity with the mesh crate's
//! writers: `replica-<id>.crt/.key` for `dramesh://replica/<id>` and
//! `agent-<cluster>-<name>.crt/.key` for `dramesh://cluster/<cluster>/agent/<name>`. An
//! existing `ca.crt`/`ca.key` pair in the directory is reused, so identities can be added
//! later without re-issuing the others. Keys are written with mode 0600.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use dramesh_mesh::PeerIdentity;
use dramesh_mesh::certs::{self, CaBundle};

/// Parses `CLUSTER/NAME` into an agent identity.
pub(crate) fn agent_identity(spec: &str) -> anyhow::Result<PeerIdentity> {
    let (cluster, name) = spec
        .split_once('/')
        .with_context(|| format!("--agent {spec:?}: expected CLUSTER/NAME"))?;
    let uri = format!("dramesh://cluster/{cluster}/agent/{name}");
    PeerIdentity::parse_uri(&uri).with_context(|| format!("--agent {spec:?}"))
}

/// Parses a replica id into an identity.
pub(crate) fn replica_identity(id: &str) -> anyhow::Result<PeerIdentity> {
    PeerIdentity::parse_uri(&format!("dramesh://replica/{id}"))
        .with_context(|| format!("--replica {id:?}"))
}

/// API certificates to write next to the mesh ones.
#[derive(Debug, Default)]
pub(crate) struct ApiCerts {
    /// Hosts of the one server certificate (none: no server certificate).
    pub(crate) servers: Vec<String>,
    /// Client certificates: user and groups.
    pub(crate) clients: Vec<(String, Vec<String>)>,
}

/// Parses `USER` or `USER=GROUP`. One group at most: rcgen writes one Organization per
/// subject (certificates from other issuers may carry several; all are read as groups).
pub(crate) fn api_client(spec: &str) -> anyhow::Result<(String, Vec<String>)> {
    let (user, group) = spec.split_once('=').unwrap_or((spec, ""));
    if user.is_empty() || group.contains(',') {
        anyhow::bail!("--api-client {spec:?}: expected USER or USER=GROUP (one group)");
    }
    let groups = (!group.is_empty())
        .then(|| group.to_owned())
        .into_iter()
        .collect();
    Ok((user.to_owned(), groups))
}

/// The file stem of a client certificate for `user`: `api-client-<user>` with every
/// character outside `[A-Za-z0-9_.-]` replaced by `-`.
pub(crate) fn api_client_stem(user: &str) -> String {
    let safe: String = user
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    format!("api-client-{safe}")
}

/// Writes the CA (or reuses the one in `out`), a leaf per identity and the API certificates;
/// returns the written certificate paths.
pub(crate) fn write_all(
    out: &Path,
    identities: &[PeerIdentity],
    api: &ApiCerts,
    valid_days: u32,
) -> anyhow::Result<Vec<PathBuf>> {
    let (crt, key) = (out.join("ca.crt"), out.join("ca.key"));
    let ca = if crt.exists() && key.exists() {
        CaBundle {
            cert_pem: std::fs::read_to_string(&crt)
                .with_context(|| format!("reading {}", crt.display()))?,
            key_pem: std::fs::read_to_string(&key)
                .with_context(|| format!("reading {}", key.display()))?,
        }
    } else {
        let ca = certs::generate_ca("dramesh mesh CA", valid_days)?;
        certs::write_ca(out, &ca)?;
        ca
    };
    let mut written = vec![crt];
    for id in identities {
        let leaf = certs::issue_leaf(&ca, id, valid_days)
            .with_context(|| format!("issuing a certificate for {id}"))?;
        written.push(certs::write_leaf(out, &leaf)?.cert);
    }
    if !api.servers.is_empty() {
        let leaf = certs::issue_api_leaf(&ca, "dramesh-api", &[], &api.servers, valid_days)
            .context("issuing the API server certificate")?;
        written.push(certs::write_api_leaf(out, "api-server", &leaf)?.cert);
    }
    for (user, groups) in &api.clients {
        let leaf = certs::issue_api_leaf(&ca, user, groups, &[], valid_days)
            .with_context(|| format!("issuing an API client certificate for {user}"))?;
        written.push(certs::write_api_leaf(out, &api_client_stem(user), &leaf)?.cert);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DER of the first PEM certificate in `pem`.
    fn first_der(pem: &[u8]) -> Vec<u8> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        CertificateDer::from_pem_slice(pem).unwrap().to_vec()
    }

    #[test]
    fn writes_loadable_identities_and_reuses_the_ca() {
        let dir = tempfile::tempdir().unwrap();
        let ids = vec![
            replica_identity("r1").unwrap(),
            agent_identity("east/dir").unwrap(),
        ];
        let api = ApiCerts {
            servers: vec!["localhost".into(), "127.0.0.1".into()],
            clients: vec![api_client("alice=ops").unwrap()],
        };
        let paths = write_all(dir.path(), &ids, &api, 30).unwrap();
        assert_eq!(paths.len(), 5);
        let tls = dramesh_api::tls::ApiTls::load(&dramesh_api::tls::TlsFiles {
            cert: dir.path().join("api-server.crt"),
            key: dir.path().join("api-server.key"),
            client_ca: Some(dir.path().join("ca.crt")),
        })
        .unwrap();
        assert!(tls.client_auth());
        let pem = std::fs::read(dir.path().join("api-client-alice.crt")).unwrap();
        let der = first_der(&pem);
        let who = dramesh_api::tls::certificate_identity(&der).unwrap();
        assert_eq!(who.user, "alice");
        assert_eq!(who.groups, ["ops", dramesh_api::auth::AUTHENTICATED]);
        assert!(api_client("=ops").is_err());
        assert!(api_client("alice=ops,dev").is_err());
        assert_eq!(api_client_stem("system:x/y"), "api-client-system-x-y");
        let ca_before = std::fs::read(dir.path().join("ca.crt")).unwrap();
        let id = certs::load_identity(
            &dir.path().join("agent-east-dir.crt"),
            &dir.path().join("agent-east-dir.key"),
            &dir.path().join("ca.crt"),
        )
        .unwrap();
        assert_eq!(id.identity, ids[1]);
        write_all(
            dir.path(),
            &[replica_identity("r2").unwrap()],
            &ApiCerts::default(),
            30,
        )
        .unwrap();
        assert_eq!(std::fs::read(dir.path().join("ca.crt")).unwrap(), ca_before);
        assert!(dir.path().join("replica-r2.key").exists());
        assert!(agent_identity("no-slash").is_err());
        assert!(replica_identity("Bad").is_err());
    }
}
