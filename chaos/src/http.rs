//! A minimal blocking HTTP/1.1 client over `std::net::TcpStream`, enough to talk to the
//! replicas' API from the root namespace (which has an address on the lab bridge).
//!
//! Guarantees: every request has a connect and an overall deadline; a response body larger
//! than [`MAX_BODY`] is an error, never buffered; both `Content-Length` and chunked bodies are
//! decoded.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Largest response body accepted (debug object listings of small test fleets fit easily).
pub const MAX_BODY: usize = 64 << 20;

/// A response: status code and body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
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

/// Sends one request (`Connection: close`) and reads the whole response within `timeout`.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<Response> {
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&addr, timeout.min(Duration::from_secs(3)))
        .with_context(|| format!("connect {addr}"))?;
    s.set_nodelay(true)?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: application/json\r\n"
    );
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    s.set_write_timeout(Some(timeout))?;
    s.write_all(head.as_bytes())?;
    if let Some(b) = body {
        s.write_all(b)?;
    }
    let mut raw = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("{method} {addr}{path}: no complete response within {timeout:?}");
        }
        s.set_read_timeout(Some(left))?;
        let n = match s.read(&mut chunk) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                bail!("{method} {addr}{path}: timed out after {timeout:?}")
            }
            Err(e) => return Err(e).with_context(|| format!("{method} {addr}{path}")),
        };
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&chunk[..n]);
        if raw.len() > MAX_BODY + 65536 {
            bail!("{method} {addr}{path}: response larger than {MAX_BODY} bytes");
        }
        if let Some(r) = parse_response(&raw)? {
            return Ok(r);
        }
    }
    if let Some(r) = parse_response(&raw)? {
        return Ok(r);
    }
    let head = String::from_utf8_lossy(&raw[..raw.len().min(8192)]).to_ascii_lowercase();
    if head.contains("content-length:") || head.contains("transfer-encoding:") {
        bail!("{method} {addr}{path}: connection closed mid-response");
    }
    finish_at_eof(&raw)
}

/// Parses a complete response from `raw`, or `None` when more bytes are needed.
pub fn parse_response(raw: &[u8]) -> Result<Option<Response>> {
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&raw[..end]).context("response head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let mut content_length = None;
    let mut chunked = false;
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "content-length" {
            content_length = Some(v.parse::<usize>().context("bad content-length")?);
        } else if k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        }
    }
    let rest = &raw[end + 4..];
    if chunked {
        return Ok(decode_chunked(rest)?.map(|body| Response { status, body }));
    }
    match content_length {
        Some(n) if n > MAX_BODY => bail!("content-length {n} exceeds {MAX_BODY}"),
        Some(n) if rest.len() >= n => Ok(Some(Response {
            status,
            body: rest[..n].to_vec(),
        })),
        Some(_) => Ok(None),
        // Without a length the body ends at EOF; the caller re-parses after the close.
        None => Ok(None),
    }
}

fn decode_chunked(mut rest: &[u8]) -> Result<Option<Vec<u8>>> {
    let mut body = Vec::new();
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let size_text = std::str::from_utf8(&rest[..eol]).context("chunk size not UTF-8")?;
        let size_hex = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16)
            .with_context(|| format!("bad chunk size {size_hex:?}"))?;
        if size > MAX_BODY || body.len() + size > MAX_BODY {
            bail!("chunked body exceeds {MAX_BODY} bytes");
        }
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(Some(body));
        }
        if rest.len() < size + 2 {
            return Ok(None);
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// A response whose body ends at connection close (no length header).
pub fn finish_at_eof(raw: &[u8]) -> Result<Response> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no response head")?;
    let status = std::str::from_utf8(&raw[..end])
        .ok()
        .and_then(|h| h.split_whitespace().nth(1)?.parse().ok())
        .context("bad status line")?;
    Ok(Response {
        status,
        body: raw[end + 4..].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_length_body_waits_for_all_bytes() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel";
        assert!(parse_response(raw).unwrap().is_none());
        let raw = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        let r = parse_response(raw).unwrap().unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"hello"[..]));
    }

    #[test]
    fn chunked_body_is_decoded() {
        let raw = b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let r = parse_response(raw).unwrap().unwrap();
        assert_eq!((r.status, r.body.as_slice()), (503, &b"abcde"[..]));
        assert!(r.json().is_err(), "non-2xx is an error");
    }

    #[test]
    fn oversized_length_is_refused() {
        let raw = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY + 1
        );
        assert!(parse_response(raw.as_bytes()).is_err());
    }
}
