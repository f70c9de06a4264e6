//! The lab's network machinery, tested with stand-in processes (no dramesh needed): hosts
//! reach each other, partitions block and heal, one-way cuts are one-way, the harness still
//! reaches an isolated host, the NFQUEUE delayer adds latency, and `cleanup_all` removes a
//! lab that was never torn down. Each test skips with a message when not root or when
//! namespaces/iptables are unavailable; CI runs as root with iptables installed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dramesh_chaos::net::{self, Impairment, Lab};
use dramesh_chaos::sys;

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dramesh-chaos"))
}

fn lab_or_skip(names: &[&str]) -> Option<Lab> {
    if !sys::is_root() {
        eprintln!("SKIP: not root; the netns tests need root");
        return None;
    }
    for tool in ["ip", "iptables", "iptables-restore"] {
        if !sys::have(tool) {
            eprintln!("SKIP: {tool} not installed (apt-get install -y iproute2 iptables)");
            return None;
        }
    }
    match Lab::create(names, &exe()) {
        Ok(l) => Some(l),
        Err(e) => {
            eprintln!("SKIP: cannot create a lab here: {e:#}");
            None
        }
    }
}

struct Bg(Child);
impl Drop for Bg {
    fn drop(&mut self) {
        let _ = sys::signal(self.0.id(), libc::SIGKILL);
        let _ = self.0.wait();
    }
}

fn server(lab: &Lab, host: &str) -> (Bg, String) {
    let h = lab.host(host).unwrap();
    let addr = format!("{}:7000", h.ip);
    let child = Command::new("ip")
        .args(["netns", "exec", &h.ns])
        .arg(exe())
        .args(["stand-in-server", "--listen", &addr])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until it listens (probing from the root namespace, which is always allowed).
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(Instant::now() < deadline, "stand-in server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (Bg(child), addr)
}

/// TCP round trip from `from` to `addr` within `timeout_ms`: Some(ms) or None.
fn tcp(lab: &Lab, from: &str, addr: &str, timeout_ms: u64) -> Option<f64> {
    let h = lab.host(from).unwrap();
    let out = Command::new("ip")
        .args(["netns", "exec", &h.ns])
        .arg(exe())
        .args(["probe", "tcp", "--addr", addr, "--timeout-ms"])
        .arg(timeout_ms.to_string())
        .output()
        .unwrap();
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// Whether one UDP datagram sent from `from` arrives at `to`.
fn udp_arrives(lab: &Lab, from: &str, to: &str) -> bool {
    let (f, t) = (lab.host(from).unwrap(), lab.host(to).unwrap());
    let addr = format!("{}:7100", t.ip);
    let mut rx = Command::new("ip")
        .args(["netns", "exec", &t.ns])
        .arg(exe())
        .args(["probe", "udp-recv", "--addr", &addr, "--timeout-ms", "700"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(rx.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "listening");
    let sent = Command::new("ip")
        .args(["netns", "exec", &f.ns])
        .arg(exe())
        .args(["probe", "udp-send", "--addr", &addr])
        .status()
        .unwrap();
    assert!(sent.success());
    rx.wait().unwrap().success()
}

fn ns_exists(ns: &str) -> bool {
    sys::run("ip", &["netns", "list"])
        .unwrap()
        .lines()
        .any(|l| l.split_whitespace().next() == Some(ns))
}

#[test]
fn partition_blocks_and_heal_restores() {
    let Some(mut lab) = lab_or_skip(&["h1", "h2", "h3"]) else {
        return;
    };
    let (_srv, addr) = server(&lab, "h2");
    assert!(tcp(&lab, "h1", &addr, 2000).is_some(), "h1 reaches h2");
    lab.partition(&["h1".into()], &["h2".into()]).unwrap();
    assert_eq!(tcp(&lab, "h1", &addr, 500), None, "partitioned");
    assert!(tcp(&lab, "h3", &addr, 2000).is_some(), "h3 unaffected");
    lab.heal().unwrap();
    assert!(tcp(&lab, "h1", &addr, 2000).is_some(), "healed");
}

#[test]
fn one_way_cut_is_one_way() {
    let Some(lab) = lab_or_skip(&["h1", "h2"]) else {
        return;
    };
    assert!(udp_arrives(&lab, "h1", "h2"));
    lab.block("h1", "h2").unwrap();
    assert!(!udp_arrives(&lab, "h1", "h2"), "h1 -> h2 is cut");
    assert!(udp_arrives(&lab, "h2", "h1"), "h2 -> h1 still flows");
}

#[test]
fn harness_reaches_an_isolated_host_and_bytes_are_counted() {
    let Some(lab) = lab_or_skip(&["h1", "h2"]) else {
        return;
    };
    let (_srv, addr) = server(&lab, "h1");
    let before = lab.mesh_bytes().unwrap();
    assert!(tcp(&lab, "h2", &addr, 2000).is_some());
    let after = lab.mesh_bytes().unwrap();
    assert!(
        after > before,
        "host-to-host bytes counted ({before} -> {after})"
    );
    lab.isolate("h1").unwrap();
    assert_eq!(tcp(&lab, "h2", &addr, 500), None, "peers cut off");
    let s = std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(2));
    assert!(s.is_ok(), "the harness (bridge address) still reaches h1");
    assert!(lab.veth_bytes() > 0);
}

#[test]
fn delayer_adds_latency_and_heal_removes_it() {
    let Some(mut lab) = lab_or_skip(&["h1", "h2"]) else {
        return;
    };
    let (_srv, addr) = server(&lab, "h2");
    let base = tcp(&lab, "h1", &addr, 2000).expect("baseline");
    if let Err(e) = lab.impair(
        Impairment {
            delay_ms: 100,
            jitter_ms: 0,
            loss: 0.0,
        },
        1,
    ) {
        eprintln!("SKIP: NFQUEUE delayer unavailable here: {e:#}");
        return;
    }
    // Connect (SYN, SYN-ACK) and request/reply each cross a delayed hop: >= 2 x 100 ms.
    let slow = tcp(&lab, "h1", &addr, 5000).expect("delayed but delivered");
    assert!(
        slow >= 200.0,
        "delayed round trip {slow} ms (baseline {base} ms)"
    );
    lab.heal().unwrap();
    let fast = tcp(&lab, "h1", &addr, 2000).expect("after heal");
    assert!(fast < 100.0, "after heal {fast} ms");
}

#[test]
fn cleanup_removes_a_lab_that_was_never_torn_down() {
    let Some(lab) = lab_or_skip(&["h1"]) else {
        return;
    };
    let ns = lab.host("h1").unwrap().ns.clone();
    let bridge = lab.bridge.clone();
    let id = lab.id.clone();
    std::mem::forget(lab); // as if the harness had crashed
    assert!(ns_exists(&ns));
    // Only this lab's leftovers: other tests' labs run concurrently.
    let done = net::cleanup_lab(&id).unwrap();
    assert!(done.namespaces.contains(&ns), "{done:?}");
    assert!(!ns_exists(&ns));
    assert!(!Path::new(&format!("/sys/class/net/{bridge}")).exists());
    assert!(done.links.contains(&bridge), "{done:?}");
    // Idempotent.
    let again = net::cleanup_lab(&id).unwrap();
    assert!(again.namespaces.is_empty() && again.links.is_empty());
}
