//! Shared helpers of the `dramesh` integration tests: `dramesh demo --serve` as a child process,
//! spawning replicas and folder agents with their certificates, free loopback ports, a small
//! HTTP/1.1 client, a Karmada gRPC client and bounded polling. Every wait is bounded, and
//! spawned processes are killed when their owner ([`Demo`], [`Procs`]) is dropped.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::fmt::Debug;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dramesh_api::proto::karmada_service::estimator_client::EstimatorClient;
use serde_json::Value;
use tonic::transport::Channel;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_dramesh");

/// A Deployment of 3 replicas with 4 CPU, 16 GiB and one `gpu.nvidia.com` device each.
pub(crate) const WORKLOAD: &str = r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: demo}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {deviceClassName: gpu.nvidia.com}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: gpu-inference, namespace: demo}
spec:
  replicas: 3
  selector: {matchLabels: {app: gpu-inference}}
  template:
    metadata: {labels: {app: gpu-inference}}
    spec:
      containers:
      - name: server
        image: vllm
        resources:
          requests: {cpu: "4", memory: 16Gi}
          claims: [{name: gpu}]
      resourceClaims:
      - {name: gpu, resourceClaimTemplateName: one-gpu}
"#;

/// Addresses a demo replica prints.
#[derive(Debug, Clone)]
pub(crate) struct ReplicaAddrs {
    pub(crate) id: String,
    pub(crate) http: SocketAddr,
    pub(crate) grpc: SocketAddr,
}

/// A running `dramesh demo --serve`; stopped with SIGTERM (then killed) when dropped.
pub(crate) struct Demo {
    child: Child,
    pub(crate) replicas: Vec<ReplicaAddrs>,
    /// Every stdout line printed until the addresses were known.
    pub(crate) output: Vec<String>,
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
    pub(crate) fn start(args: &[&str], envs: &[(&str, &str)]) -> Demo {
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
    pub(crate) fn stop(&mut self) -> bool {
        signal(&self.child, "TERM");
        if let Some(status) = wait_exit(&mut self.child, Duration::from_secs(20)) {
            return status.success();
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

/// Connect timeout of the test HTTP client.
const HTTP_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Read timeout of the test HTTP client: a debug-build replica may take a while to estimate.
const HTTP_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// One HTTP/1.1 request (one connection, `Connection: close`, JSON content type); returns the
/// status and the body, chunked bodies decoded. `Err` says what failed, e.g. that nothing
/// listens yet, so pollers can retry.
pub(crate) fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    try_request_as(addr, None, method, path, body)
}

/// [`try_request`] with `Authorization: Bearer <token>` when `token` is given.
pub(crate) fn try_request_as(
    addr: SocketAddr,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    try_request_via(addr, None, token, method, path, body)
}

/// [`try_request_as`], over TLS when `tls` is given, with that client configuration (which
/// must not offer ALPN `h2` alone: the HTTP listener speaks `http/1.1`), the server named
/// `127.0.0.1` as the certificates of `dramesh certs --api-server 127.0.0.1` name it.
pub(crate) fn try_request_via(
    addr: SocketAddr,
    tls: Option<&std::sync::Arc<rustls::ClientConfig>>,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let tcp = TcpStream::connect_timeout(&addr, HTTP_CONNECT_TIMEOUT)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    tcp.set_read_timeout(Some(HTTP_READ_TIMEOUT))
        .map_err(|e| format!("read timeout on {addr}: {e}"))?;
    let Some(tls) = tls else {
        return exchange(tcp, addr, &req);
    };
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("server name");
    let conn = rustls::ClientConnection::new(tls.clone(), name)
        .map_err(|e| format!("TLS client for {addr}: {e}"))?;
    exchange(rustls::StreamOwned::new(conn, tcp), addr, &req)
}

/// Sends the request `req` on `s`, a fresh connection to `addr`, and reads the answer to the
/// end: its status and body.
fn exchange(
    mut s: impl Read + Write,
    addr: SocketAddr,
    req: &str,
) -> Result<(u16, String), String> {
    s.write_all(req.as_bytes())
        .map_err(|e| format!("send to {addr}: {e}"))?;
    let mut raw = Vec::new();
    match s.read_to_end(&mut raw) {
        Ok(_) => {}
        // A TLS server that closes without close_notify: the answer is complete anyway
        // (`Connection: close`), and a cut one fails to parse below.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(format!("read from {addr}: {e}")),
    }
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| {
            format!(
                "no header/body separator in {:?}",
                String::from_utf8_lossy(&raw)
            )
        })?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = &raw[split + 4..];
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line in {head:?}"))?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        decode_chunked(body)?
    } else {
        body.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Decodes a chunked body (RFC 9112 §7.1) up to its last, empty chunk.
fn decode_chunked(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("chunked body ends without its last chunk")?;
        let line = String::from_utf8_lossy(&rest[..eol]);
        let size = line.split(';').next().unwrap_or("").trim();
        let n = usize::from_str_radix(size, 16)
            .map_err(|e| format!("chunk size line {line:?}: {e}"))?;
        if n == 0 {
            return Ok(out);
        }
        let data = &rest[eol + 2..];
        let chunk = data
            .get(..n)
            .ok_or_else(|| format!("chunk of {n} bytes cut short"))?;
        out.extend_from_slice(chunk);
        rest = data
            .get(n..)
            .and_then(|r| r.strip_prefix(b"\r\n"))
            .ok_or("chunk not followed by CRLF")?;
    }
}

/// [`try_request`] that panics on failure; `body` is sent as is.
pub(crate) fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, String) {
    try_request(addr, method, path, body.unwrap_or(""))
        .unwrap_or_else(|e| panic!("{method} {path} on {addr}: {e}"))
}

/// The body as JSON, or as a JSON string when it is not JSON (error texts).
fn json_or_string(text: String) -> Value {
    serde_json::from_str(&text).unwrap_or(Value::String(text))
}

/// A JSON request; `None` when it failed (e.g. the server is not up yet).
pub(crate) fn try_http_json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Option<(u16, Value)> {
    let payload = body.map(Value::to_string).unwrap_or_default();
    let (status, text) = try_request(addr, method, path, &payload).ok()?;
    Some((status, json_or_string(text)))
}

/// [`try_http_json`] that panics on failure.
pub(crate) fn http_json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let payload = body.map(Value::to_string).unwrap_or_default();
    let (status, text) = try_request(addr, method, path, &payload)
        .unwrap_or_else(|e| panic!("{method} {path} on {addr}: {e}"));
    (status, json_or_string(text))
}

/// A Karmada estimator gRPC client of a replica (bounded connect and call times).
pub(crate) async fn karmada_client(addr: SocketAddr) -> EstimatorClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("gRPC URI")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("gRPC connect {addr}: {e}"));
    EstimatorClient::new(channel)
}

/// A rustls client configuration trusting the CA `dir/ca.crt` of `dramesh certs`, with the
/// client certificate `dir/api-client-<user>.{crt,key}` (`--api-client <user>`) as its
/// identity; no ALPN (see [`karmada_tls_client`] for gRPC).
pub(crate) fn tls_client(dir: &Path, user: &str) -> rustls::ClientConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let read = |f: &str| {
        std::fs::read(dir.join(f)).unwrap_or_else(|e| panic!("read {}: {e}", dir.join(f).display()))
    };
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&read("ca.crt")) {
        roots.add(c.expect("CA PEM")).expect("CA certificate");
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_client_auth_cert(
            CertificateDer::pem_slice_iter(&read(&format!("api-client-{user}.crt")))
                .map(|c| c.expect("client certificate PEM"))
                .collect(),
            PrivateKeyDer::from_pem_slice(&read(&format!("api-client-{user}.key")))
                .expect("client key PEM"),
        )
        .expect("client identity")
}

/// A Karmada estimator gRPC client of the replica at `addr` over TLS with the client
/// configuration `tls`, offering ALPN `h2` as grpc-go (karmada-scheduler) does; the server is
/// named `127.0.0.1` (bounded connect and call times, as [`karmada_client`]).
pub(crate) async fn karmada_tls_client(
    addr: SocketAddr,
    tls: &rustls::ClientConfig,
) -> Result<EstimatorClient<Channel>, String> {
    let mut tls = tls.clone();
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| format!("gRPC URI: {e}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect_with_connector(tower::service_fn(move |_uri| {
            let connector = connector.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                // As Go's dialer (grpc-go) and tonic's own connector do: without it each
                // call's small writes wait ~40 ms for the server's delayed ACK.
                tcp.set_nodelay(true)?;
                let name = rustls::pki_types::ServerName::try_from("127.0.0.1")
                    .map_err(std::io::Error::other)?;
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    Ok(EstimatorClient::new(channel))
}

/// A Karmada `MaxAvailableReplicas` question for `cluster`: replicas of `cpu` and `memory`
/// with one device of DeviceClass `class` each (dramesh's DRA extension), in `namespace`,
/// tolerating `tolerations`.
pub(crate) fn karmada_dra_query(
    cluster: &str,
    namespace: &str,
    class: &str,
    (cpu, memory): (&str, &str),
    tolerations: Vec<k8s_openapi::api::core::v1::Toleration>,
) -> dramesh_api::query::ReplicaQuery {
    use dramesh_api::query::{ClaimTemplate, DraRequirements, NodeClaim, ReplicaRequirements};
    let spec = serde_json::from_value(serde_json::json!({
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}]}}
    }))
    .expect("template spec");
    let q = |s: &str| k8s_openapi::apimachinery::pkg::api::resource::Quantity(s.into());
    dramesh_api::query::ReplicaQuery {
        cluster: cluster.into(),
        requirements: ReplicaRequirements {
            node_claim: NodeClaim {
                tolerations,
                ..NodeClaim::default()
            },
            resource_request: [
                ("cpu".to_string(), q(cpu)),
                ("memory".to_string(), q(memory)),
            ]
            .into_iter()
            .collect(),
            namespace: namespace.into(),
            dra: DraRequirements {
                claim_templates: vec![ClaimTemplate {
                    pod_claim_name: "gpu".into(),
                    spec,
                }],
                shared_claims: vec![],
            },
            ..ReplicaRequirements::default()
        },
        assumed_workloads: vec![],
    }
}

/// Polls `f` every 100 ms until it returns `Some`, for at most `limit`; panics naming `what`
/// when time runs out.
pub(crate) fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let until = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < until, "timed out after {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends `signal` (`TERM`, `STOP`, `CONT`, ...) to `child` with kill(1).
pub(crate) fn signal(child: &Child, signal: &str) {
    signal_pid(child.id(), signal);
}

/// Sends `signal` to process `pid` with kill(1).
pub(crate) fn signal_pid(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status();
    assert!(
        status.as_ref().is_ok_and(|s| s.success()),
        "kill -{signal} {pid}: {status:?}"
    );
}

/// Waits (at most `limit`) for `child` to exit; `None` when it is still running (or cannot be
/// waited for). Does not kill it.
pub(crate) fn wait_exit(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => return None,
        }
    }
}

/// Runs `dramesh args`, asserts it succeeded, returns its stdout.
pub(crate) fn run_ok<S: AsRef<OsStr> + Debug>(args: &[S]) -> String {
    let out = Command::new(BIN).args(args).output().expect("run dramesh");
    assert!(
        out.status.success(),
        "dramesh {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Kills every process pushed into it when dropped, so a failing test leaves none behind.
#[derive(Default)]
pub(crate) struct Procs(pub Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `dramesh certs --out out` for the replica ids and `cluster/agent` names.
pub(crate) fn make_certs(out: &Path, replicas: &[&str], agents: &[String]) {
    make_certs_with(out, replicas, agents, &[]);
}

/// [`make_certs`] with `extra` arguments (`--api-server`, `--api-client`).
pub(crate) fn make_certs_with(out: &Path, replicas: &[&str], agents: &[String], extra: &[&str]) {
    let mut args = vec![
        "certs".to_string(),
        "--out".into(),
        out.display().to_string(),
    ];
    for r in replicas {
        args.extend(["--replica".to_string(), r.to_string()]);
    }
    for a in agents {
        args.extend(["--agent".to_string(), a.clone()]);
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    run_ok(&args);
}

/// Adds the mesh identity `<certs>/<stem>.{crt,key}` and the CA of `dramesh certs` to `cmd`,
/// which logs warnings to the test's stderr.
fn meshed(cmd: &mut Command, certs: &Path, stem: &str) {
    let cert = |stem: &str, ext: &str| certs.join(format!("{stem}.{ext}")).display().to_string();
    cmd.args(["--mesh-cert", &cert(stem, "crt")])
        .args(["--mesh-key", &cert(stem, "key")])
        .args(["--mesh-ca", &cert("ca", "crt")])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
}

/// Spawns `cmd` with the mesh identity of [`meshed`].
fn spawn_meshed(mut cmd: Command, certs: &Path, stem: &str) -> Child {
    meshed(&mut cmd, certs, stem);
    cmd.spawn()
        .unwrap_or_else(|e| panic!("spawn dramesh {stem}: {e}"))
}

/// Where a spawned replica listens.
#[derive(Debug, Clone)]
pub(crate) struct ReplicaListen {
    pub(crate) mesh: SocketAddr,
    pub(crate) http: SocketAddr,
    pub(crate) grpc: SocketAddr,
}

impl ReplicaListen {
    /// Port 0 on loopback for every listener: the replica binds them and
    /// [`spawn_replica_with`] reads back the ports it got. (No port is picked by binding and
    /// releasing it, which another process could take before the replica binds it.)
    pub(crate) fn any() -> ReplicaListen {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        ReplicaListen {
            mesh: any,
            http: any,
            grpc: any,
        }
    }

    /// The addresses of the replica's `replica started ... mesh=A http=A grpc=A` log line.
    fn from_started_line(line: &str) -> Option<ReplicaListen> {
        let field = |name: &str| -> Option<SocketAddr> {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))?
                .parse()
                .ok()
        };
        Some(ReplicaListen {
            mesh: field("mesh")?,
            http: field("http")?,
            grpc: field("grpc")?,
        })
    }
}

/// Waits (at most 60 s) for the `replica started` line of `child` (a replica logging at
/// info), forwarding its stderr to the test's: the addresses it bound, or everything it
/// printed before it exited.
fn replica_started(child: &mut Child) -> Result<ReplicaListen, String> {
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Read to the end even after the start, so the replica never blocks on a full pipe.
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            eprintln!("{line}");
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if line.contains("replica started")
                    && let Some(at) = ReplicaListen::from_started_line(&line)
                {
                    return Ok(at);
                }
                seen.push(line);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
                return Err(format!("exited ({status}): {}", seen.join("\n")));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no start within 60 s: {}", seen.join("\n")));
            }
        }
    }
}

#[test]
fn started_lines_parse() {
    let line = "2026-11-28T02:14:57Z  INFO dramesh_replica::runner: replica started replica=r0 \
                mesh=127.0.0.1:43831 http=127.0.0.1:38511 grpc=127.0.0.1:40685 api_tls=false";
    let at = ReplicaListen::from_started_line(line).expect("parsed");
    assert_eq!(
        (at.mesh.port(), at.http.port(), at.grpc.port()),
        (43831, 38511, 40685)
    );
    assert!(ReplicaListen::from_started_line("replica started replica=r0 mesh=x").is_none());
}

/// Lets every caller, anonymous included, read and write: for the tests of what a replica
/// answers (tests/api_auth.rs tests who may ask).
pub(crate) const OPEN_API: &[&str] = &["--api-writers", "group:system:unauthenticated"];

/// `dramesh replica --id id` with the certificates of `make_certs`, its data in `data/<id>`,
/// joining the mesh through `seeds`; plaintext APIs open to anyone ([`OPEN_API`]). Returns
/// once it has started, with `at` set to the addresses it bound (see [`spawn_replica_with`]).
pub(crate) fn spawn_replica(
    data: &Path,
    certs: &Path,
    id: &str,
    at: &mut ReplicaListen,
    seeds: &[SocketAddr],
) -> Child {
    spawn_replica_with(data, certs, id, at, seeds, OPEN_API)
}

/// `dramesh replica` with `extra` arguments; `--api-insecure` unless they name `--api-cert`.
/// Listens where `at` says ([`ReplicaListen::any`] for ports the replica binds itself), and
/// returns once the replica logged its start, with `at` set to the addresses it bound. A
/// restart on the ports a replica had before can find one taken meanwhile by another socket:
/// a start that fails with EADDRINUSE is retried for up to 10 s.
pub(crate) fn spawn_replica_with(
    data: &Path,
    certs: &Path,
    id: &str,
    at: &mut ReplicaListen,
    seeds: &[SocketAddr],
    extra: &[&str],
) -> Child {
    let stem = format!("replica-{id}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut cmd = Command::new(BIN);
        cmd.args(["replica", "--id", id]).args(extra);
        if !extra.contains(&"--api-cert") {
            cmd.arg("--api-insecure");
        }
        cmd.args(["--listen-mesh", &at.mesh.to_string()])
            .args(["--api", &at.http.to_string()])
            .args(["--grpc", &at.grpc.to_string()])
            .args(["--data-dir", &data.join(id).display().to_string()]);
        for s in seeds {
            cmd.args(["--seed", &s.to_string()]);
        }
        meshed(&mut cmd, certs, &stem);
        // The start line is logged at info.
        cmd.env("RUST_LOG", "warn,dramesh_replica::runner=info")
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn dramesh {stem}: {e}"));
        match replica_started(&mut child) {
            Ok(bound) => {
                *at = bound;
                return child;
            }
            Err(e) if e.contains("Address already in use") && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("replica {id} did not start: {e}"),
        }
    }
}

/// `dramesh agent` named `_cluster` (the whole-cluster publisher) for `cluster`, publishing the folder `dir` to the replicas'
/// mesh addresses, its state in `data`.
pub(crate) fn spawn_folder_agent(
    cluster: &str,
    dir: &Path,
    data: &Path,
    certs: &Path,
    replicas: &[SocketAddr],
) -> Child {
    spawn_folder_agent_with(cluster, dir, data, certs, replicas, &[])
}

/// [`spawn_folder_agent`] with `extra` arguments.
pub(crate) fn spawn_folder_agent_with(
    cluster: &str,
    dir: &Path,
    data: &Path,
    certs: &Path,
    replicas: &[SocketAddr],
    extra: &[&str],
) -> Child {
    let stem = format!("agent-{cluster}-_cluster");
    let mut cmd = Command::new(BIN);
    cmd.args(["agent", "--cluster", cluster, "--agent-name", "_cluster"])
        .args(extra)
        .args(["--source", "dir", "--dir", &dir.display().to_string()])
        .args(["--listen", "127.0.0.1:0"])
        .args(["--data-dir", &data.display().to_string()]);
    for r in replicas {
        cmd.args(["--replica", &r.to_string()]);
    }
    spawn_meshed(cmd, certs, &stem)
}

/// Names of the demo's member clusters.
pub(crate) fn demo_clusters() -> Vec<String> {
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

#[test]
fn chunked_bodies_decode_and_cut_ones_fail() {
    let body = b"4\r\nWiki\r\n6;ext=1\r\npedia \r\n0\r\n\r\n";
    assert_eq!(decode_chunked(body).as_deref(), Ok(&b"Wikipedia "[..]));
    assert!(decode_chunked(b"4\r\nWi").is_err(), "short chunk");
    assert!(decode_chunked(b"4\r\nWiki\r\n").is_err(), "no last chunk");
    assert!(decode_chunked(b"zz\r\n").is_err(), "bad size");
}

/// A folder standing for a member cluster with one Node `node_name`.
pub(crate) fn write_node_cluster(dir: &Path, node_name: &str) {
    std::fs::create_dir_all(dir).expect("mkdir");
    let node = format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {node_name}}}\nstatus:\n  allocatable: {{cpu: \"8\", memory: 32Gi, pods: \"110\"}}\n"
    );
    std::fs::write(dir.join("node.yaml"), node).expect("node");
}

/// The names listed under `field` (`clusters`, `retired`) of a replica's `/v1/status`.
pub(crate) fn status_names(addr: SocketAddr, field: &str) -> Option<Vec<String>> {
    let (code, v) = try_http_json(addr, "GET", "/v1/status", None)?;
    (code == 200).then(|| {
        v[field]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str().map(str::to_string))
            .collect()
    })
}

/// Two replicas r1 and r2 (r2 seeded with r1) with their data under `tmp`, and certificates
/// for a folder agent of each of `clusters`, whose one-node folders are `tmp/fleet/<cluster>`.
pub(crate) struct TwoReplicas {
    pub(crate) certs: std::path::PathBuf,
    pub(crate) fleet: std::path::PathBuf,
    pub(crate) r1: ReplicaListen,
    pub(crate) r2: ReplicaListen,
    /// r1 then r2, then whatever the test adds.
    pub(crate) procs: Procs,
    /// The replicas' extra arguments.
    extra: Vec<String>,
}

impl TwoReplicas {
    /// The two replicas with `extra` arguments (for example `OPEN_API`).
    pub(crate) fn start(tmp: &Path, clusters: &[&str], extra: &[&str]) -> TwoReplicas {
        let fleet = tmp.join("fleet");
        for (i, c) in clusters.iter().enumerate() {
            write_node_cluster(&fleet.join(c), &format!("n{i}"));
        }
        let certs = tmp.join("certs");
        let agents: Vec<String> = clusters.iter().map(|c| format!("{c}/_cluster")).collect();
        make_certs(&certs, &["r1", "r2"], &agents);
        let (mut r1, mut r2) = (ReplicaListen::any(), ReplicaListen::any());
        let mut procs = Procs::default();
        procs
            .0
            .push(spawn_replica_with(tmp, &certs, "r1", &mut r1, &[], extra));
        procs.0.push(spawn_replica_with(
            tmp,
            &certs,
            "r2",
            &mut r2,
            &[r1.mesh],
            extra,
        ));
        TwoReplicas {
            certs,
            fleet,
            r1,
            r2,
            procs,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// Starts the folder agent of `cluster` (state in `tmp/agent-<cluster>`) dialing
    /// `replicas`, with `extra` arguments; returns its index in `procs`.
    pub(crate) fn agent(
        &mut self,
        tmp: &Path,
        cluster: &str,
        replicas: &[SocketAddr],
        extra: &[&str],
    ) -> usize {
        self.procs.0.push(spawn_folder_agent_with(
            cluster,
            &self.fleet.join(cluster),
            &tmp.join(format!("agent-{cluster}")),
            &self.certs,
            replicas,
            extra,
        ));
        self.procs.0.len() - 1
    }

    /// Kills process `i` of `procs` and waits for it.
    pub(crate) fn kill(&mut self, i: usize) {
        let _ = self.procs.0[i].kill();
        let _ = self.procs.0[i].wait();
    }

    /// Restarts r2 from its data directory, seeded with r1.
    pub(crate) fn restart_r2(&mut self, tmp: &Path) {
        self.kill(1);
        let args: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        let seeds = [self.r1.mesh];
        self.procs.0[1] = spawn_replica_with(tmp, &self.certs, "r2", &mut self.r2, &seeds, &args);
    }
}

/// Writes `dir/karmada.yaml`, a kubeconfig whose current context points at the Karmada API
/// server `url` with a bearer token; returns its path.
pub(crate) fn write_karmada_kubeconfig(dir: &Path, url: &str) -> String {
    let path = dir.join("karmada.yaml");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: karmada\nclusters:\n- name: karmada\n  cluster:\n    server: {url}\ncontexts:\n- name: karmada\n  context:\n    cluster: karmada\n    user: sched\nusers:\n- name: sched\n  user:\n    token: t\n"
        ),
    )
    .expect("kubeconfig");
    path.display().to_string()
}

/// Replicas `ids` (each after the first seeded with the first) with their data under `tmp`,
/// and certificates for a folder agent of each of `clusters`, whose folders under
/// `tmp/fleet/<cluster>` the test writes. Processes are killed when it is dropped.
pub(crate) struct Replicas {
    pub(crate) certs: std::path::PathBuf,
    pub(crate) fleet: std::path::PathBuf,
    /// Where each replica listens, in the order of `ids`.
    pub(crate) at: Vec<ReplicaListen>,
    /// The replicas in the order of `ids`, then the agents.
    pub(crate) procs: Procs,
}

impl Replicas {
    /// Starts the replicas with `extra` arguments (for example `OPEN_API`).
    pub(crate) fn start(tmp: &Path, ids: &[&str], clusters: &[&str], extra: &[&str]) -> Replicas {
        let certs = tmp.join("certs");
        let agents: Vec<String> = clusters.iter().map(|c| format!("{c}/_cluster")).collect();
        make_certs(&certs, ids, &agents);
        Replicas::start_with_certs(tmp, &certs, ids, extra)
    }

    /// [`Replicas::start`] with the certificates already in `certs` (made by
    /// [`make_certs_with`] for `ids` and the agents).
    pub(crate) fn start_with_certs(
        tmp: &Path,
        certs: &Path,
        ids: &[&str],
        extra: &[&str],
    ) -> Replicas {
        let certs = certs.to_path_buf();
        let mut at: Vec<ReplicaListen> = Vec::new();
        let mut procs = Procs::default();
        for id in ids {
            let seeds: Vec<SocketAddr> = at.iter().take(1).map(|a| a.mesh).collect();
            let mut bound = ReplicaListen::any();
            procs.0.push(spawn_replica_with(
                tmp, &certs, id, &mut bound, &seeds, extra,
            ));
            at.push(bound);
        }
        Replicas {
            certs,
            fleet: tmp.join("fleet"),
            at,
            procs,
        }
    }

    /// The replicas' mesh addresses.
    pub(crate) fn meshes(&self) -> Vec<SocketAddr> {
        self.at.iter().map(|a| a.mesh).collect()
    }

    /// Starts the folder agent of `cluster` (folder `fleet/<cluster>`, state in
    /// `tmp/agent-<cluster>`) dialing every replica.
    pub(crate) fn agent(&mut self, tmp: &Path, cluster: &str) {
        let meshes = self.meshes();
        self.procs.0.push(spawn_folder_agent(
            cluster,
            &self.fleet.join(cluster),
            &tmp.join(format!("agent-{cluster}")),
            &self.certs,
            &meshes,
        ));
    }
}

/// Waits until the replica at `h` has `clusters` member clusters in its status and is ready
/// (caught up with a peer replica, so the mesh carries reservations between them).
pub(crate) async fn wait_clusters_and_ready(h: SocketAddr, clusters: usize) {
    tokio::task::spawn_blocking(move || {
        wait_for(
            &format!("{clusters} clusters on the replica at {h}"),
            Duration::from_secs(90),
            || status_names(h, "clusters").filter(|c| c.len() == clusters),
        );
        wait_for(
            &format!("the replica at {h} ready"),
            Duration::from_secs(60),
            || {
                try_request(h, "GET", "/readyz", "")
                    .is_ok_and(|(code, _)| code == 200)
                    .then_some(())
            },
        );
    })
    .await
    .expect("wait");
}
