//! The fleet: `dramesh` replica and agent processes, each started with `ip netns exec` in its
//! own namespace, logging to its own file, killable with SIGKILL and restartable with the same
//! arguments (and so the same data directory).
//!
//! Guarantees: only processes this module spawned are signalled, by pid; `Drop` kills every
//! process still running; a replica's API address is reachable from the harness's bridge
//! address.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::http;
use crate::net::Lab;
use crate::sys;

/// UDP port of every replica's mesh endpoint.
pub const MESH_PORT: u16 = 7400;
/// TCP port of every replica's HTTP API.
pub const API_PORT: u16 = 8080;
/// TCP port of every replica's gRPC API.
pub const GRPC_PORT: u16 = 9090;
/// Name every agent is given (`agent-<cluster>-<AGENT_NAME>.crt`).
/// Folder agents publish whole clusters, which only the reserved whole-cluster publisher name
/// (`dramesh_store::CLUSTER_PUBLISHER`) may do.
pub const AGENT_NAME: &str = "_cluster";

/// A managed process.
#[derive(Debug)]
pub struct Proc {
    /// Process name (`r1`, `agent-<cluster>`...).
    pub name: String,
    /// Network namespace it runs in.
    pub ns: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    /// How many times it was started.
    pub starts: u32,
}

impl Proc {
    fn start(&mut self, dramesh: &Path) -> Result<()> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening log {:?}", self.log))?;
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(dramesh)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} in {}", self.name, self.ns))?;
        self.child = Some(child);
        self.starts += 1;
        Ok(())
    }

    /// SIGKILLs the process (no-op when not running) and reaps it.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            sys::signal(c.id(), libc::SIGKILL)?;
            c.wait()?;
        }
        Ok(())
    }

    /// Whether the process is running (it may have exited by itself).
    pub fn running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }
}

/// Settings of a fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// The `dramesh` binary.
    pub dramesh: PathBuf,
    /// Working folder of the run (certificates, data, logs).
    pub dir: PathBuf,
    /// Replica names.
    pub replicas: Vec<String>,
    /// (host name, cluster name, snapshot folder) per agent.
    pub agents: Vec<(String, String, PathBuf)>,
    /// Extra arguments for every replica.
    pub replica_extra_args: Vec<String>,
    /// Each agent talks to one replica only (its "home", by index) instead of all of them.
    pub agents_home_only: bool,
    /// Replica name to a libfaketime offset such as `+7200`.
    pub clock_offsets: BTreeMap<String, String>,
}

/// The running processes of one scenario.
#[derive(Debug)]
pub struct Fleet {
    cfg: FleetConfig,
    /// Processes by name.
    pub procs: BTreeMap<String, Proc>,
    /// Each replica's HTTP API address.
    pub api: BTreeMap<String, SocketAddr>,
}

/// Path of libfaketime's multi-threaded library, when installed.
pub fn libfaketime() -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
}

impl Fleet {
    /// Generates certificates, then starts the replicas (waiting until each is ready) and
    /// the agents.
    pub fn start(lab: &Lab, cfg: FleetConfig, ready_timeout: Duration) -> Result<Fleet> {
        let certs = cfg.dir.join("certs");
        std::fs::create_dir_all(cfg.dir.join("logs"))?;
        let mut args: Vec<String> = vec!["certs".into(), "--out".into(), path_str(&certs)?];
        for r in &cfg.replicas {
            args.extend(["--replica".into(), r.clone()]);
        }
        for (_, cluster, _) in &cfg.agents {
            args.extend(["--agent".into(), format!("{cluster}/{AGENT_NAME}")]);
        }
        let out = Command::new(&cfg.dramesh)
            .args(&args)
            .output()
            .with_context(|| format!("running {:?} certs", cfg.dramesh))?;
        if !out.status.success() {
            bail!(
                "`dramesh certs` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let ca = path_str(&certs.join("ca.crt"))?;
        let mut fleet = Fleet {
            cfg: cfg.clone(),
            procs: BTreeMap::new(),
            api: BTreeMap::new(),
        };
        let mesh: Vec<(String, String)> = cfg
            .replicas
            .iter()
            .map(|r| Ok((r.clone(), format!("{}:{MESH_PORT}", lab.host(r)?.ip))))
            .collect::<Result<_>>()?;
        for r in &cfg.replicas {
            let h = lab.host(r)?;
            let mut a: Vec<String> = vec![
                "replica".into(),
                "--id".into(),
                r.clone(),
                "--listen-mesh".into(),
                format!("{}:{MESH_PORT}", h.ip),
                "--api".into(),
                format!("{}:{API_PORT}", h.ip),
                "--grpc".into(),
                format!("{}:{GRPC_PORT}", h.ip),
            ];
            for (other, addr) in &mesh {
                if other != r {
                    a.extend(["--seed".into(), addr.clone()]);
                }
            }
            a.extend([
                "--data-dir".into(),
                path_str(&cfg.dir.join("data").join(r))?,
                "--mesh-cert".into(),
                path_str(&certs.join(format!("replica-{r}.crt")))?,
                "--mesh-key".into(),
                path_str(&certs.join(format!("replica-{r}.key")))?,
                "--mesh-ca".into(),
                ca.clone(),
            ]);
            // The harness calls the APIs over plain HTTP, anonymously, from inside the lab, and
            // retires clusters (admin) in `retire-in-partition`.
            a.extend([
                "--api-insecure".into(),
                "--api-admins".into(),
                "group:system:unauthenticated".into(),
            ]);
            a.extend(cfg.replica_extra_args.iter().cloned());
            let mut env = vec![("RUST_LOG".to_string(), "info".to_string())];
            if let Some(off) = cfg.clock_offsets.get(r) {
                let lib = libfaketime().context(
                    "clock-shift needs libfaketime (Debian package `faketime`), not installed",
                )?;
                env.push(("LD_PRELOAD".into(), path_str(&lib)?));
                env.push(("FAKETIME".into(), off.clone()));
                // Shift only the wall clock: monotonic timers stay true, as on a real host
                // whose NTP is wrong.
                env.push(("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()));
                env.push(("FAKETIME_NO_CACHE".into(), "1".into()));
            }
            fleet
                .api
                .insert(r.clone(), SocketAddr::new(h.ip.into(), API_PORT));
            fleet.procs.insert(
                r.clone(),
                Proc {
                    name: r.clone(),
                    ns: h.ns.clone(),
                    args: a,
                    env,
                    log: cfg.dir.join("logs").join(format!("{r}.log")),
                    child: None,
                    starts: 0,
                },
            );
        }
        for (i, (host, cluster, dir)) in cfg.agents.iter().enumerate() {
            let h = lab.host(host)?;
            let mut a: Vec<String> = vec![
                "agent".into(),
                "--cluster".into(),
                cluster.clone(),
                "--source".into(),
                "dir".into(),
                "--dir".into(),
                path_str(dir)?,
                "--agent-name".into(),
                AGENT_NAME.into(),
            ];
            if cfg.agents_home_only {
                a.extend(["--replica".into(), mesh[i % mesh.len()].1.clone()]);
            } else {
                for (_, addr) in &mesh {
                    a.extend(["--replica".into(), addr.clone()]);
                }
            }
            let stem = format!("agent-{cluster}-{AGENT_NAME}");
            a.extend([
                "--data-dir".into(),
                path_str(&cfg.dir.join("data").join(host))?,
                "--mesh-cert".into(),
                path_str(&certs.join(format!("{stem}.crt")))?,
                "--mesh-key".into(),
                path_str(&certs.join(format!("{stem}.key")))?,
                "--mesh-ca".into(),
                ca.clone(),
            ]);
            fleet.procs.insert(
                host.clone(),
                Proc {
                    name: host.clone(),
                    ns: h.ns.clone(),
                    args: a,
                    env: vec![("RUST_LOG".to_string(), "info".to_string())],
                    log: cfg.dir.join("logs").join(format!("{host}.log")),
                    child: None,
                    starts: 0,
                },
            );
        }
        for r in &cfg.replicas {
            fleet.start_proc(r)?;
        }
        // A replica is only ready once it holds cluster data, which needs the agents: wait
        // for liveness here and let the warm-up convergence wait for the data.
        for r in &cfg.replicas {
            fleet.wait_path(r, "/healthz", ready_timeout)?;
        }
        for (host, _, _) in &cfg.agents {
            fleet.start_proc(host)?;
        }
        Ok(fleet)
    }

    /// Starts (or restarts) process `name`.
    pub fn start_proc(&mut self, name: &str) -> Result<()> {
        let dramesh = self.cfg.dramesh.clone();
        self.proc(name)?.start(&dramesh)
    }

    /// The managed process `name`.
    pub fn proc(&mut self, name: &str) -> Result<&mut Proc> {
        self.procs
            .get_mut(name)
            .with_context(|| format!("no process named {name}"))
    }

    /// SIGKILLs process `name`.
    pub fn kill(&mut self, name: &str) -> Result<()> {
        self.proc(name)?.kill()
    }

    /// The run's working folder (the scenario's output folder).
    pub fn dir(&self) -> &Path {
        &self.cfg.dir
    }

    /// The data directory of process `name`.
    pub fn data_dir(&self, name: &str) -> PathBuf {
        self.cfg.dir.join("data").join(name)
    }

    /// Whether replica `r` answers `GET /readyz` with 200.
    pub fn is_ready(&self, r: &str) -> bool {
        self.answers(r, "/readyz")
    }

    fn answers(&self, r: &str, path: &str) -> bool {
        self.api.get(r).is_some_and(|a| {
            http::request(*a, "GET", path, None, Duration::from_millis(800))
                .is_ok_and(|resp| resp.status == 200)
        })
    }

    /// Waits until replica `r` is ready, failing early if its process died.
    pub fn wait_ready(&mut self, r: &str, timeout: Duration) -> Result<()> {
        self.wait_path(r, "/readyz", timeout)
    }

    /// Waits until replica `r` answers `GET path` with 200, failing early if it died.
    pub fn wait_path(&mut self, r: &str, path: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            sys::check_stop()?;
            if self.answers(r, path) {
                return Ok(());
            }
            if !self.proc(r)?.running() {
                bail!(
                    "replica {r} exited before becoming ready; see {:?}",
                    self.cfg.dir.join("logs").join(format!("{r}.log"))
                );
            }
            if Instant::now() > deadline {
                bail!("replica {r}: GET {path} not 200 within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops every process: SIGTERM, a short grace period, then SIGKILL.
    pub fn stop_all(&mut self) {
        for p in self.procs.values_mut() {
            if let Some(c) = &p.child {
                let _ = sys::signal(c.id(), libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline && self.procs.values_mut().any(Proc::running) {
            std::thread::sleep(Duration::from_millis(50));
        }
        for p in self.procs.values_mut() {
            let _ = p.kill();
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for p in self.procs.values_mut() {
            let _ = p.kill();
        }
    }
}

fn path_str(p: &Path) -> Result<String> {
    p.to_str()
        .map(str::to_string)
        .with_context(|| format!("path {p:?} is not UTF-8"))
}

/// Truncates the largest regular file under `dir` to `fraction` of its length; returns it.
pub fn truncate_largest_file(dir: &Path, fraction: f64) -> Result<(PathBuf, u64, u64)> {
    fn walk(d: &Path, best: &mut Option<(PathBuf, u64)>) -> std::io::Result<()> {
        for e in std::fs::read_dir(d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                walk(&e.path(), best)?;
            } else if t.is_file() {
                let len = e.metadata()?.len();
                if best.as_ref().is_none_or(|(_, l)| len > *l) {
                    *best = Some((e.path(), len));
                }
            }
        }
        Ok(())
    }
    let mut best = None;
    walk(dir, &mut best).with_context(|| format!("scanning {dir:?}"))?;
    let (path, len) = best.with_context(|| format!("no file to truncate under {dir:?}"))?;
    let new_len = ((len as f64) * fraction.clamp(0.0, 1.0)) as u64;
    let f = OpenOptions::new()
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {path:?}"))?;
    f.set_len(new_len)
        .with_context(|| format!("truncating {path:?}"))?;
    Ok((path, len, new_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncates_the_largest_file() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("small"), [0u8; 10]).unwrap();
        std::fs::write(d.path().join("sub/big"), [1u8; 1000]).unwrap();
        let (p, before, after) = truncate_largest_file(d.path(), 0.5).unwrap();
        assert!(p.ends_with("sub/big"));
        assert_eq!((before, after), (1000, 500));
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 500);
        assert!(truncate_largest_file(&d.path().join("sub/none"), 0.5).is_err());
    }
}
