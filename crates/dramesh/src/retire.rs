//! `dramesh retire`: asks one replica's HTTP API to retire a member cluster
//! (`DELETE /v1/clusters/{name}`) and prints what it answered.

use std::path::Path;
use std::time::Duration;

use crate::Failure;

/// Largest answer read (a retirement record, or an error message).
const MAX_ANSWER: u64 = 64 * 1024;

fn failure(message: String) -> Failure {
    Failure { code: 1, message }
}

/// The base URL of `api`: `host:port` gets `http://`.
fn base_url(api: &str) -> Result<String, Failure> {
    let api = api.trim_end_matches('/');
    if api.is_empty() {
        return Err(Failure::input("--api: empty address"));
    }
    if api.starts_with("http://") {
        Ok(api.to_string())
    } else if api.starts_with("https://") {
        Err(Failure::input(format!(
            "--api {api}: https is not supported by this command yet; use the replica's plain HTTP listener"
        )))
    } else if api.contains("://") {
        Err(Failure::input(format!(
            "--api {api}: only http:// URLs are supported"
        )))
    } else {
        Ok(format!("http://{api}"))
    }
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
    token_file: Option<&Path>,
    timeout: Duration,
) -> Result<(), Failure> {
    if !dramesh_store::valid_segment(cluster) {
        return Err(Failure::input(format!(
            "cluster {cluster:?}: not a valid cluster name (1-253 chars of [a-z0-9.-], starting and ending alphanumeric)"
        )));
    }
    let url = format!("{}/v1/clusters/{cluster}", base_url(api)?);
    let token = token_file.map(read_token).transpose()?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
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
