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

/// Writes the CA (or reuses the one in `out`) and a leaf per identity; returns the written
/// certificate paths.
pub(crate) fn write_all(
    out: &Path,
    identities: &[PeerIdentity],
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
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_loadable_identities_and_reuses_the_ca() {
        let dir = tempfile::tempdir().unwrap();
        let ids = vec![
            replica_identity("r1").unwrap(),
            agent_identity("east/dir").unwrap(),
        ];
        let paths = write_all(dir.path(), &ids, 30).unwrap();
        assert_eq!(paths.len(), 3);
        let ca_before = std::fs::read(dir.path().join("ca.crt")).unwrap();
        let id = certs::load_identity(
            &dir.path().join("agent-east-dir.crt"),
            &dir.path().join("agent-east-dir.key"),
            &dir.path().join("ca.crt"),
        )
        .unwrap();
        assert_eq!(id.identity, ids[1]);
        write_all(dir.path(), &[replica_identity("r2").unwrap()], 30).unwrap();
        assert_eq!(std::fs::read(dir.path().join("ca.crt")).unwrap(), ca_before);
        assert!(dir.path().join("replica-r2.key").exists());
        assert!(agent_identity("no-slash").is_err());
        assert!(replica_identity("Bad").is_err());
    }
}
