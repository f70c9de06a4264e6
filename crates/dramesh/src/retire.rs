//! `dramesh retire`: asks one replica's HTTP API to retire a member cluster
//! (`DELETE /v1/clusters/{name}`) and prints what it answered.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig, TlsProvider};

use crate::Failure;

/// Largest answer read (a retirement record, or an error message).
const MAX_ANSWER: u64 = 64 * 1024;

fn failure(message: String) -> Failure {
    Failure { code: 1, message }
}

/// How the command authenticates to the replica.
pub(crate) struct Credentials {
    /// Bearer token file.
    pub(crate) token_file: Option<PathBuf>,
    /// CA of the replica's API certificate (https).
    pub(crate) ca_file: Option<PathBuf>,
    /// Client certificate (https), with its key.
    pub(crate) cert_file: Option<PathBuf>,
    /// Key of the client certificate.
    pub(crate) key_file: Option<PathBuf>,
}

/// The base URL of `api`: `host:port` gets `http://`.
fn base_url(api: &str) -> Result<String, Failure> {
    let api = api.trim_end_matches('/');
    if api.is_empty() {
        return Err(Failure::input("--api: empty address"));
    }
    if api.starts_with("http://") || api.starts_with("https://") {
        Ok(api.to_string())
    } else if api.contains("://") {
        Err(Failure::input(format!(
            "--api {api}: only http:// and https:// URLs are supported"
        )))
    } else {
        Ok(format!("http://{api}"))
    }
}

fn read_file(flag: &str, path: &Path) -> Result<Vec<u8>, Failure> {
    std::fs::read(path).map_err(|e| Failure::input(format!("{flag} {}: {e}", path.display())))
}

/// The PEM certificates in `path`, at least one.
fn certificates(flag: &str, path: &Path) -> Result<Vec<Certificate<'static>>, Failure> {
    let pem = read_file(flag, path)?;
    let certs: Vec<Certificate<'static>> = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect();
    if certs.is_empty() {
        return Err(Failure::input(format!(
            "{flag} {}: no PEM certificate in it",
            path.display()
        )));
    }
    Ok(certs)
}

/// The TLS settings of `creds`: the CA as the only root (else the public web roots), and the
/// client certificate when given.
fn tls_config(creds: &Credentials) -> Result<TlsConfig, Failure> {
    let mut b = TlsConfig::builder().provider(TlsProvider::Rustls);
    if let Some(ca) = &creds.ca_file {
        b = b.root_certs(RootCerts::new_with_certs(&certificates("--ca-file", ca)?));
    }
    if let (Some(cert), Some(key)) = (&creds.cert_file, &creds.key_file) {
        let chain = certificates("--cert-file", cert)?;
        let key_pem = read_file("--key-file", key)?;
        let key = PrivateKey::from_pem(&key_pem)
            .map_err(|e| Failure::input(format!("--key-file {}: {e}", key.display())))?;
        b = b.client_cert(Some(ClientCert::new_with_certs(&chain, key)));
    }
    Ok(b.build())
}

/// Reads a bearer token: the file's first line, trimmed.
fn read_token(path: &Path) -> Result<String, Failure> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Failure::input(format!("--token-file {}: {e}", path.display())))?;
    let token = text.lines().next().unwrap_or_default().trim().to_string();
    if token.is_empty() {
        return Err(Failure::input(format!(
            "--token-file {}: the file holds no token",
            path.display()
        )));
    }
    Ok(token)
}

/// Retires `cluster` through the replica at `api`.
pub(crate) fn run(
    cluster: &str,
    api: &str,
    creds: &Credentials,
    timeout: Duration,
) -> Result<(), Failure> {
    if !dramesh_store::valid_segment(cluster) {
        return Err(Failure::input(format!(
            "cluster {cluster:?}: not a valid cluster name (1-253 chars of [a-z0-9.-], starting and ending alphanumeric)"
        )));
    }
    let base = base_url(api)?;
    if base.starts_with("https://") && creds.ca_file.is_none() {
        // This build trusts no public roots: the replicas' API CA is the operator's own.
        return Err(Failure::input(format!(
            "--api {base}: https needs --ca-file, the CA that signed the replica's API certificate"
        )));
    }
    let url = format!("{base}/v1/clusters/{cluster}");
    let token = creds.token_file.as_deref().map(read_token).transpose()?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .tls_config(tls_config(creds)?)
        .build()
        .into();
    let mut req = agent.delete(&url).header("Accept", "application/json");
    if let Some(t) = &token {
        req = req.header("Authorization", &format!("Bearer {t}"));
    }
    let mut resp = req
        .call()
        .map_err(|e| failure(format!("DELETE {url}: {e}")))?;
    let status = resp.status().as_u16();
    let body = resp
        .body_mut()
        .with_config()
        .limit(MAX_ANSWER)
        .read_to_string()
        .map_err(|e| failure(format!("DELETE {url}: reading the answer: {e}")))?;
    if !(200..300).contains(&status) {
        let message = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or(body);
        return Err(failure(format!("DELETE {url}: HTTP {status}: {message}")));
    }
    let v: serde_json::Value = serde_json::from_str(&body)
        .map_err(|e| failure(format!("DELETE {url}: the answer is not JSON: {e}")))?;
    println!(
        "retired cluster {} at {} ms (replica {}); every replica drops it as the retirement reaches it",
        v["name"].as_str().unwrap_or(cluster),
        v["retiredAtMs"].as_u64().unwrap_or_default(),
        v["replica"].as_str().unwrap_or("?"),
    );
    Ok(())
}
