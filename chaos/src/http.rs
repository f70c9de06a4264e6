//! The harness's HTTP client for the replicas' API (reached from the root namespace, which has
//! an address on the lab bridge): a thin layer over `ureq` that keeps the calls the harness
//! makes to one function.
//!
//! Guarantees: every request has a connect deadline and an overall deadline; a response body
//! larger than [`MAX_BODY`] is an error, never buffered whole; non-2xx statuses are returned
//! as responses, so callers see the status and the body.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Largest response body accepted (debug object listings of small test fleets fit easily).
pub const MAX_BODY: u64 = 64 << 20;

/// A response: status code and body.
#[derive(Debug, Clone)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// The whole body.
    pub body: Vec<u8>,
}

impl Response {
    /// The body parsed as JSON, when the status is 2xx.
    pub fn json(&self) -> Result<serde_json::Value> {
        if !(200..300).contains(&self.status) {
            bail!(
                "HTTP {}: {}",
                self.status,
                String::from_utf8_lossy(&self.body[..self.body.len().min(300)])
            );
        }
        serde_json::from_slice(&self.body).context("response body is not JSON")
    }
}

/// Sends one request with a JSON body (if any) and reads the whole response within `timeout`.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<Response> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .timeout_connect(Some(timeout.min(Duration::from_secs(3))))
        .http_status_as_error(false)
        .build()
        .into();
    let url = format!("http://{addr}{path}");
    let sent = match (method, body) {
        ("GET", None) => agent.get(&url).header("Accept", "application/json").call(),
        ("POST", Some(b)) => agent
            .post(&url)
            .header("Accept", "application/json")
            .content_type("application/json")
            .send(b),
        ("DELETE", None) => agent.delete(&url).call(),
        _ => bail!("{method} {path}: the harness sends GET, DELETE or a POST with a body"),
    };
    let mut resp = sent.with_context(|| format!("{method} {url}"))?;
    let status = resp.status().as_u16();
    let body = resp
        .body_mut()
        .with_config()
        .limit(MAX_BODY)
        .read_to_vec()
        .with_context(|| format!("{method} {url}: reading the body"))?;
    Ok(Response { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// Serves one connection: reads the request head, then writes `response`.
    fn serve_once(response: Vec<u8>, delay: Duration) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            std::thread::sleep(delay);
            let _ = s.write_all(&response);
        });
        addr
    }

    #[test]
    fn status_and_json_body_come_back() {
        let addr = serve_once(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 9\r\nConnection: close\r\n\r\n{\"a\": 1}\n"
                .to_vec(),
            Duration::ZERO,
        );
        let r = request(addr, "GET", "/readyz", None, Duration::from_secs(5)).unwrap();
        assert_eq!(r.status, 503);
        assert!(r.json().unwrap_err().to_string().contains("HTTP 503"));

        let addr = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n4\r\n: 1}\r\n0\r\n\r\n"
                .to_vec(),
            Duration::ZERO,
        );
        let r = request(
            addr,
            "POST",
            "/v1/estimate",
            Some(b"{}"),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(r.json().unwrap(), serde_json::json!({"a": 1}));
    }

    #[test]
    fn an_oversized_body_is_refused() {
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY + 1
        );
        let addr = serve_once(head.into_bytes(), Duration::ZERO);
        assert!(request(addr, "GET", "/x", None, Duration::from_secs(5)).is_err());
    }

    #[test]
    fn a_silent_server_hits_the_deadline() {
        let addr = serve_once(Vec::new(), Duration::from_secs(3));
        let start = std::time::Instant::now();
        assert!(request(addr, "GET", "/x", None, Duration::from_millis(300)).is_err());
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }
}
