//! `dramesh demo --serve` as a child process, for tests of what a running replica serves.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_dramesh");

/// Addresses a demo replica prints.
#[derive(Debug, Clone)]
pub struct ReplicaAddrs {
    pub id: String,
    pub http: SocketAddr,
    pub grpc: SocketAddr,
}

/// A running `dramesh demo --serve`; stopped with SIGTERM (then killed) when dropped.
pub struct Demo {
    child: Child,
    pub replicas: Vec<ReplicaAddrs>,
    /// Every stdout line printed until the addresses were known.
    pub output: Vec<String>,
}

/// `replica r1: HTTP http://127.0.0.1:1234  (...)  gRPC 127.0.0.1:5678 (...)` -> addresses.
fn parse_serving(line: &str) -> Option<ReplicaAddrs> {
    let rest = line.trim().strip_prefix("replica ")?;
    let (id, rest) = rest.split_once(": HTTP http://")?;
    let http = rest.split_whitespace().next()?.parse().ok()?;
    let grpc = rest
        .split_once("gRPC ")?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(ReplicaAddrs {
        id: id.to_string(),
        http,
        grpc,
    })
}

impl Demo {
    /// Starts the demo with `args` after `demo --serve` and `envs`, and waits (at most 120 s)
    /// until it has converged and printed the three replicas' addresses.
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Demo {
        let mut cmd = Command::new(BIN);
        cmd.args(["demo", "--serve"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn dramesh demo --serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut demo = Demo {
            child,
            replicas: Vec::new(),
            output: Vec::new(),
        };
        while demo.replicas.len() < 3 {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(r) = parse_serving(&line) {
                        demo.replicas.push(r);
                    }
                    demo.output.push(line);
                }
                Err(e) => panic!(
                    "dramesh demo --serve did not print its addresses ({e}); output so far:\n{}",
                    demo.output.join("\n")
                ),
            }
        }
        // Keep draining stdout so the demo never blocks on a full pipe.
        std::thread::spawn(move || while rx.recv().is_ok() {});
        demo
    }

    /// Sends SIGTERM and waits (at most 20 s) for a clean exit; returns whether it exited 0.
    pub fn stop(&mut self) -> bool {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        false
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 request (Connection: close); returns status and body (chunked bodies decoded).
pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let payload = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    );
    s.write_all(req.as_bytes()).expect("send request");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header/body separator in {text:?}"));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head:?}"));
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return (status, body.to_string());
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((len, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).expect("chunk length");
        if n == 0 {
            break;
        }
        out.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    (status, out)
}

/// Names of the demo's member clusters.
pub fn demo_clusters() -> Vec<String> {
    dramesh_sim::demo_fleet()
        .into_iter()
        .map(|c| c.name)
        .collect()
}

#[test]
fn serving_lines_parse() {
    let r = parse_serving("  replica r2: HTTP http://127.0.0.1:4000  (status page /, GET /v1/status)  gRPC 127.0.0.1:4001 (Karmada Estimator + dramesh.v1)  mesh 127.0.0.1:4002").expect("parsed");
    assert_eq!(r.id, "r2");
    assert_eq!(r.http.port(), 4000);
    assert_eq!(r.grpc.port(), 4001);
    assert!(parse_serving("converged after 0.5 s").is_none());
}
