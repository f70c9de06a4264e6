//! The test network: one Linux bridge, one network namespace per host, veth pairs, and the
//! firewall chains that faults are written into.
//!
//! Layout of a lab with id `ID` and subnet index `k` (chosen free at creation time):
//! - bridge `dmcbID` in the root namespace with address `10.213.k.1/24` (the harness itself,
//!   which sends queries and reads status from there);
//! - per host `h`: namespace `dmc-ID-h`, interface `eth0` with `10.213.k.(11+i)/24`; no default
//!   route, so nothing a host sends can leave the bridge;
//! - per host, iptables chains `DMC_CHAOS` (partition drops, hooked into INPUT and OUTPUT),
//!   `DMC_NETEM` (hands packets from other hosts to a userspace delayer through NFQUEUE; the
//!   kernels this runs on may lack `sch_netem`) and `DMC_ACCT` (counts bytes sent to other hosts).
//!
//! Guarantees: every namespace, veth and bridge is named with the `dmc-`/`dmcb`/`dmv` prefixes
//! and removed on [`Lab::teardown`] (also run by `Drop`), and [`cleanup_all`] removes whatever a
//! crashed run left. Traffic to and from the harness address is never dropped or delayed, so
//! the harness can keep measuring replicas a fault has cut off from their peers.

use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};

use crate::sys;

/// Prefix of every namespace this crate creates.
pub const NS_PREFIX: &str = "dmc-";
/// Prefix of every bridge this crate creates.
pub const BRIDGE_PREFIX: &str = "dmcb";
/// Prefix of every host-side veth this crate creates.
pub const VETH_PREFIX: &str = "dmv";

static LAB_COUNTER: AtomicU32 = AtomicU32::new(0);

/// One emulated machine.
#[derive(Debug, Clone)]
pub struct Host {
    /// Logical name used by scenarios (`r1`, `agent-us-east-train`...).
    pub name: String,
    /// Network namespace.
    pub ns: String,
    /// Address on the bridge.
    pub ip: Ipv4Addr,
    /// Host side of its veth pair.
    pub veth: String,
}

/// The network of one run. Dropping it tears everything down.
#[derive(Debug)]
pub struct Lab {
    /// Run id, part of every namespace and link name.
    pub id: String,
    /// Bridge device.
    pub bridge: String,
    /// Third octet of the run's subnet, `10.213.<subnet>.0/24`.
    pub subnet: u8,
    /// The bridge's address.
    pub gateway: Ipv4Addr,
    hosts: Vec<Host>,
    helper_exe: PathBuf,
    delayers: Vec<Child>,
    torn_down: bool,
}

/// Packet impairment applied to traffic between hosts (not to the harness's own traffic).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Impairment {
    /// Added delay per packet.
    pub delay_ms: u64,
    /// Uniform jitter around the delay.
    pub jitter_ms: u64,
    /// Probability (0..1) that a packet is dropped.
    pub loss: f64,
}

impl Lab {
    /// Creates the bridge and one namespace per name. `helper_exe` is this crate's binary,
    /// started inside namespaces as the NFQUEUE delayer.
    pub fn create(names: &[&str], helper_exe: &Path) -> Result<Lab> {
        if !sys::is_root() {
            bail!("the chaos lab needs root (network namespaces, veths, iptables)");
        }
        if names.len() > 200 {
            bail!("at most 200 hosts per lab, got {}", names.len());
        }
        let n = LAB_COUNTER.fetch_add(1, Ordering::SeqCst);
        let id = format!("{:x}{n}", std::process::id());
        let bridge = format!("{BRIDGE_PREFIX}{id}");
        let mut lab = Lab {
            id: id.clone(),
            bridge: bridge.clone(),
            subnet: 0,
            gateway: Ipv4Addr::UNSPECIFIED,
            hosts: Vec::new(),
            helper_exe: helper_exe.to_path_buf(),
            delayers: Vec::new(),
            torn_down: false,
        };
        sys::run("ip", &["link", "add", &bridge, "type", "bridge"])?;
        sys::run("ip", &["link", "set", &bridge, "up"])?;
        lab.subnet = claim_subnet(&bridge, std::process::id().wrapping_mul(31) + n)?;
        lab.gateway = Ipv4Addr::new(10, 213, lab.subnet, 1);
        for (i, name) in names.iter().enumerate() {
            let ip = Ipv4Addr::new(10, 213, lab.subnet, 11 + i as u8);
            let host = Host {
                name: (*name).to_string(),
                ns: format!("{NS_PREFIX}{id}-{name}"),
                ip,
                veth: format!("{VETH_PREFIX}{id}h{i}"),
            };
            lab.add_host(&host, i)
                .with_context(|| format!("setting up host {name}"))?;
            lab.hosts.push(host);
        }
        lab.wait_links_up()?;
        Ok(lab)
    }

    /// Waits until the bridge and every veth report carrier, so the first packet a test
    /// sends is not dropped by a link still coming up.
    fn wait_links_up(&self) -> Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let up = |dev: &str| {
            std::fs::read_to_string(format!("/sys/class/net/{dev}/operstate"))
                .is_ok_and(|s| s.trim() == "up")
        };
        while !(up(&self.bridge) && self.hosts.iter().all(|h| up(&h.veth))) {
            if std::time::Instant::now() > deadline {
                bail!("links of lab {} did not come up within 5 s", self.id);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(())
    }

    fn add_host(&self, h: &Host, i: usize) -> Result<()> {
        let peer = format!("{VETH_PREFIX}{}p{i}", self.id);
        sys::run("ip", &["netns", "add", &h.ns])?;
        sys::run(
            "ip",
            &[
                "link", "add", &h.veth, "type", "veth", "peer", "name", &peer,
            ],
        )?;
        sys::run("ip", &["link", "set", &peer, "netns", &h.ns])?;
        sys::run(
            "ip",
            &["link", "set", &h.veth, "master", &self.bridge, "up"],
        )?;
        sys::run_in(&h.ns, "ip", &["link", "set", &peer, "name", "eth0"])?;
        sys::run_in(
            &h.ns,
            "ip",
            &["addr", "add", &format!("{}/24", h.ip), "dev", "eth0"],
        )?;
        sys::run_in(&h.ns, "ip", &["link", "set", "eth0", "up"])?;
        sys::run_in(&h.ns, "ip", &["link", "set", "lo", "up"])?;
        let subnet = format!("10.213.{}.0/24", self.subnet);
        let gw = self.gateway.to_string();
        let rules = format!(
            "*filter\n\
             :DMC_CHAOS - [0:0]\n\
             :DMC_NETEM - [0:0]\n\
             :DMC_ACCT - [0:0]\n\
             -A INPUT -j DMC_CHAOS\n\
             -A INPUT -j DMC_NETEM\n\
             -A OUTPUT -j DMC_CHAOS\n\
             -A OUTPUT -j DMC_ACCT\n\
             -A DMC_ACCT -d {gw}/32 -j RETURN\n\
             -A DMC_ACCT -d {subnet} -j RETURN\n\
             COMMIT\n"
        );
        restore_in(&h.ns, &rules)
    }

    /// The hosts, in creation order.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// The host with logical name `name`.
    pub fn host(&self, name: &str) -> Result<&Host> {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .with_context(|| format!("no host named {name} in lab {}", self.id))
    }

    /// Drops every packet from `from` when it arrives at `to` (a one-way cut).
    pub fn block(&self, from: &str, to: &str) -> Result<()> {
        let f = self.host(from)?.ip.to_string();
        let t = self.host(to)?;
        sys::run_in(
            &t.ns,
            "iptables",
            &["-A", "DMC_CHAOS", "-s", &f, "-j", "DROP"],
        )?;
        Ok(())
    }

    /// Cuts every link between a host of `a` and a host of `b`, both directions.
    pub fn partition(&self, a: &[String], b: &[String]) -> Result<()> {
        for x in a {
            for y in b {
                self.block(x, y)?;
                self.block(y, x)?;
            }
        }
        Ok(())
    }

    /// Cuts `name` off from every other host (the harness can still reach it).
    pub fn isolate(&self, name: &str) -> Result<()> {
        let others: Vec<String> = self
            .hosts
            .iter()
            .filter(|h| h.name != name)
            .map(|h| h.name.clone())
            .collect();
        self.partition(&[name.to_string()], &others)
    }

    /// Delays (and randomly drops) packets between hosts: each host hands what it receives
    /// from other hosts to a delayer process in its namespace.
    pub fn impair(&mut self, imp: Impairment, seed: u64) -> Result<()> {
        let subnet = format!("10.213.{}.0/24", self.subnet);
        let gw = format!("{}/32", self.gateway);
        for (i, h) in self.hosts.clone().iter().enumerate() {
            let queue = (100 + i).to_string();
            let mut child = Command::new("ip")
                .args(["netns", "exec", &h.ns])
                .arg(&self.helper_exe)
                .args([
                    "netem-queue",
                    "--queue",
                    &queue,
                    "--delay-ms",
                    &imp.delay_ms.to_string(),
                    "--jitter-ms",
                    &imp.jitter_ms.to_string(),
                    "--loss",
                    &imp.loss.to_string(),
                    "--seed",
                    &(seed.wrapping_add(i as u64)).to_string(),
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .with_context(|| format!("starting the delayer in {}", h.ns))?;
            let mut line = String::new();
            if let Some(out) = child.stdout.take() {
                BufReader::new(out).read_line(&mut line)?;
            }
            if line.trim() != "ready" {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "the delayer in {} did not start (said {:?}); NFQUEUE unavailable?",
                    h.ns,
                    line.trim()
                );
            }
            self.delayers.push(child);
            sys::run_in(
                &h.ns,
                "iptables",
                &["-A", "DMC_NETEM", "-s", &gw, "-j", "RETURN"],
            )?;
            sys::run_in(
                &h.ns,
                "iptables",
                &[
                    "-A",
                    "DMC_NETEM",
                    "-s",
                    &subnet,
                    "-j",
                    "NFQUEUE",
                    "--queue-num",
                    &queue,
                    "--queue-bypass",
                ],
            )?;
        }
        Ok(())
    }

    /// Removes every partition and impairment.
    pub fn heal(&mut self) -> Result<()> {
        for h in &self.hosts {
            sys::run_in(&h.ns, "iptables", &["-F", "DMC_CHAOS"])?;
            sys::run_in(&h.ns, "iptables", &["-F", "DMC_NETEM"])?;
        }
        self.stop_delayers();
        Ok(())
    }

    fn stop_delayers(&mut self) {
        for mut c in self.delayers.drain(..) {
            let _ = sys::signal(c.id(), libc::SIGKILL);
            let _ = c.wait();
        }
    }

    /// Bytes all hosts have sent to other hosts (not to the harness) since creation.
    pub fn mesh_bytes(&self) -> Result<u64> {
        let mut total = 0u64;
        for h in &self.hosts {
            let out = sys::run_in(&h.ns, "iptables", &["-nvxL", "DMC_ACCT"])?;
            total += parse_acct(&out, &format!("10.213.{}.0/24", self.subnet));
        }
        Ok(total)
    }

    /// Bytes through each host's veth (both directions, harness traffic included), from sysfs.
    pub fn veth_bytes(&self) -> u64 {
        self.hosts
            .iter()
            .map(|h| {
                ["rx_bytes", "tx_bytes"]
                    .iter()
                    .filter_map(|f| {
                        std::fs::read_to_string(format!("/sys/class/net/{}/statistics/{f}", h.veth))
                            .ok()?
                            .trim()
                            .parse::<u64>()
                            .ok()
                    })
                    .sum::<u64>()
            })
            .sum()
    }

    /// Removes the namespaces (killing anything still running in them) and the bridge.
    pub fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        self.stop_delayers();
        for h in &self.hosts {
            kill_ns_pids(&h.ns);
            let _ = sys::run("ip", &["netns", "del", &h.ns]);
        }
        let _ = sys::run("ip", &["link", "del", &self.bridge]);
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.teardown();
    }
}

fn restore_in(ns: &str, rules: &str) -> Result<()> {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "iptables-restore", "--noflush"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start iptables-restore (install the iptables package)")?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(rules.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "iptables-restore in {ns} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Picks `k` so that `10.213.k.0/24` is used by no other interface, and assigns `.1` to
/// the bridge; retries when a concurrent run picked the same `k`.
fn claim_subnet(bridge: &str, start: u32) -> Result<u8> {
    for attempt in 0..250u32 {
        let k = ((start + attempt * 7) % 250 + 2) as u8;
        let prefix = format!("10.213.{k}.");
        let used = |exclude: &str| -> Result<bool> {
            let out = sys::run("ip", &["-4", "-o", "addr", "show"])?;
            Ok(out.lines().any(|l| {
                l.contains(&format!("inet {prefix}"))
                    && l.split_whitespace().nth(1) != Some(exclude)
            }))
        };
        if used("")? {
            continue;
        }
        sys::run(
            "ip",
            &["addr", "add", &format!("10.213.{k}.1/24"), "dev", bridge],
        )?;
        if used(bridge)? {
            let _ = sys::run(
                "ip",
                &["addr", "del", &format!("10.213.{k}.1/24"), "dev", bridge],
            );
            continue;
        }
        return Ok(k);
    }
    bail!("no free 10.213.k.0/24 subnet for bridge {bridge}")
}

/// Sums the byte counters of DMC_ACCT's rule matching `subnet` in `iptables -nvxL` output.
pub fn parse_acct(listing: &str, subnet: &str) -> u64 {
    listing
        .lines()
        .filter(|l| l.split_whitespace().any(|w| w == subnet))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

fn kill_ns_pids(ns: &str) {
    if let Ok(out) = sys::run("ip", &["netns", "pids", ns]) {
        for pid in out.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let _ = sys::signal(pid, libc::SIGKILL);
        }
    }
}

/// What [`cleanup_all`] removed.
#[derive(Debug, Default)]
pub struct Cleanup {
    /// Namespaces deleted.
    pub namespaces: Vec<String>,
    /// Links deleted.
    pub links: Vec<String>,
}

/// Removes every namespace, bridge and veth with this crate's prefixes (from any run, live or
/// crashed), killing the processes inside those namespaces. Idempotent.
pub fn cleanup_all() -> Result<Cleanup> {
    cleanup_where(
        |ns| ns.starts_with(NS_PREFIX),
        |l| l.starts_with(BRIDGE_PREFIX) || l.starts_with(VETH_PREFIX),
    )
}

/// Removes what belongs to the lab with id `id` only (other runs are left alone).
pub fn cleanup_lab(id: &str) -> Result<Cleanup> {
    let ns = format!("{NS_PREFIX}{id}-");
    let bridge = format!("{BRIDGE_PREFIX}{id}");
    let (vh, vp) = (format!("{VETH_PREFIX}{id}h"), format!("{VETH_PREFIX}{id}p"));
    cleanup_where(
        |n| n.starts_with(&ns),
        |l| l == bridge || l.starts_with(&vh) || l.starts_with(&vp),
    )
}

fn cleanup_where(
    ns_match: impl Fn(&str) -> bool,
    link_match: impl Fn(&str) -> bool,
) -> Result<Cleanup> {
    let mut done = Cleanup::default();
    let list = sys::run("ip", &["netns", "list"])?;
    for ns in list.lines().filter_map(|l| l.split_whitespace().next()) {
        if ns_match(ns) {
            kill_ns_pids(ns);
            sys::run("ip", &["netns", "del", ns])?;
            done.namespaces.push(ns.to_string());
        }
    }
    let links = sys::run("ip", &["-o", "link", "show"])?;
    for l in links.lines() {
        let Some(name) = l.split(": ").nth(1) else {
            continue;
        };
        let name = name.split('@').next().unwrap_or(name);
        if link_match(name) {
            // A veth may vanish with its peer's namespace between listing and deleting.
            if sys::run("ip", &["link", "del", name]).is_ok() {
                done.links.push(name.to_string());
            }
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acct_counters_sum_the_subnet_rule_only() {
        let listing = "Chain DMC_ACCT (1 references)\n\
            pkts      bytes target     prot opt in     out     source               destination\n\
               3      180 RETURN     0    --  *      *       0.0.0.0/0            10.213.7.1\n\
              12     4096 RETURN     0    --  *      *       0.0.0.0/0            10.213.7.0/24\n";
        assert_eq!(parse_acct(listing, "10.213.7.0/24"), 4096);
        assert_eq!(parse_acct(listing, "10.213.8.0/24"), 0);
    }
}
