//! Serving bounds of the daemon processes (issue 14 items 2 and 4): they stop within 5 s of
//! SIGTERM whatever is in flight (a request whose body is still arriving, an idle keep-alive
//! connection, a gRPC connection, a frozen peer), and idle connections beyond the replica's
//! connection cap do not stop `/healthz` answering.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::*;

/// The bound on shutdown the README promises.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(5);

fn healthy(addr: std::net::SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}

/// Sends SIGTERM and returns how long the process took to exit (`None` if it did not within
/// twice the limit; it is killed by [`Procs`] then).
fn terminate(child: &mut Child) -> Option<Duration> {
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill")
            .success()
    );
    let start = Instant::now();
    wait_exit(child, SHUTDOWN_LIMIT * 2).map(|_| start.elapsed())
}

#[test]
fn replica_exits_within_5s_of_sigterm_with_requests_in_flight() {
    let tmp = tempfile::tempdir().expect("tmp");
    let certs = tmp.path().join("certs");
    make_certs(&certs, &["r1"], &[]);
    let mut at = ReplicaListen::any();
    let mut procs = Procs::default();
    procs
        .0
        .push(spawn_replica(tmp.path(), &certs, "r1", &mut at, &[]));
    wait_for("replica /healthz", Duration::from_secs(30), || {
        healthy(at.http).then_some(())
    });

    // A request in flight: headers sent, body announced but only partly sent.
    let mut slow = TcpStream::connect(at.http).expect("connect");
    slow.write_all(
        b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"workload\":",
    )
    .expect("send part of a request");
    // An idle keep-alive connection after one answered request.
    let mut idle = TcpStream::connect(at.http).expect("connect");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send");
    let mut buf = [0u8; 256];
    let n = idle.read(&mut buf).expect("answer");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    // A gRPC (HTTP/2) connection that has sent only the preface.
    let mut h2 = TcpStream::connect(at.grpc).expect("connect");
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .expect("preface");
    std::thread::sleep(Duration::from_millis(300));

    let took = terminate(&mut procs.0[0]).expect("replica still running 10 s after SIGTERM");
    assert!(
        took <= SHUTDOWN_LIMIT,
        "replica took {took:?} to exit after SIGTERM (limit {SHUTDOWN_LIMIT:?})"
    );
    drop((slow, idle, h2));
}

#[test]
fn agent_exits_within_5s_of_sigterm_while_its_replica_is_frozen() {
    let tmp = tempfile::tempdir().expect("tmp");
    let certs = tmp.path().join("certs");
    make_certs(&certs, &["r1"], &["c1/_cluster".to_string()]);
    let mut at = ReplicaListen::any();
    let mut procs = Procs::default();
    procs
        .0
        .push(spawn_replica(tmp.path(), &certs, "r1", &mut at, &[]));
    wait_for("replica /healthz", Duration::from_secs(30), || {
        healthy(at.http).then_some(())
    });
    let dir = tmp.path().join("c1");
    std::fs::create_dir_all(&dir).expect("folder");
    std::fs::write(
        dir.join("node.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata: {name: n1}\nstatus:\n  allocatable: {cpu: \"8\", memory: 32Gi, pods: \"110\"}\n",
    )
    .expect("node");
    procs.0.push(spawn_folder_agent(
        "c1",
        &dir,
        &tmp.path().join("agent"),
        &certs,
        &[at.mesh],
    ));
    wait_for(
        "the agent's cluster on the replica",
        Duration::from_secs(30),
        || {
            let (code, v) = try_http_json(at.http, "GET", "/v1/status", None)?;
            (code == 200 && v["clusters"].as_array().is_some_and(|c| !c.is_empty())).then_some(())
        },
    );
    // The replica stops answering mid-conversation: the agent's mesh work is in flight.
    let rpid = procs.0[0].id().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &rpid])
            .status()
            .expect("kill")
            .success()
    );
    std::fs::write(
        dir.join("node2.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata: {name: n2}\nstatus:\n  allocatable: {cpu: \"8\", memory: 32Gi, pods: \"110\"}\n",
    )
    .expect("node");
    std::thread::sleep(Duration::from_millis(1500));
    let took = terminate(&mut procs.0[1]);
    let _ = Command::new("kill").args(["-CONT", &rpid]).status();
    let took = took.expect("agent still running 10 s after SIGTERM");
    assert!(
        took <= SHUTDOWN_LIMIT,
        "agent took {took:?} to exit after SIGTERM (limit {SHUTDOWN_LIMIT:?})"
    );
}

#[test]
fn replica_healthz_answers_with_idle_connections_beyond_its_cap() {
    let tmp = tempfile::tempdir().expect("tmp");
    let certs = tmp.path().join("certs");
    make_certs(&certs, &["r1"], &[]);
    let mut at = ReplicaListen::any();
    let mut procs = Procs::default();
    procs.0.push(spawn_replica_with(
        tmp.path(),
        &certs,
        "r1",
        &mut at,
        &[],
        &[
            "--max-http-connections",
            "16",
            "--header-timeout",
            "60",
            "--api-writers",
            "group:system:unauthenticated",
        ],
    ));
    wait_for("replica /healthz", Duration::from_secs(30), || {
        healthy(at.http).then_some(())
    });
    let idle: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(at.http).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    assert!(
        healthy(at.http),
        "/healthz refused with 100 idle connections open"
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    let (code, text) = try_request(at.http, "GET", "/metrics", "").expect("metrics");
    assert_eq!(code, 200);
    let evicted = text
        .lines()
        .find(|l| {
            l.starts_with("dramesh_http_connections_closed_total{")
                && l.contains("reason=\"evicted_idle\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(evicted >= 80.0, "evicted {evicted}:\n{text}");
    drop(idle);
}
