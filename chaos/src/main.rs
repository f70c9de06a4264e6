//! `dramesh-chaos`: runs the chaos partition suite (`run`), removes what a crashed run left
//! (`cleanup`), and provides the helpers it starts inside namespaces (`netem-queue`, the
//! delay/loss stand-in for `tc netem`; `stand-in-server`, a tiny TCP/UDP echo used by the
//! network tests before the real daemons exist).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use dramesh_chaos::scenario::{self, Profile, RunOptions};
use dramesh_chaos::{net, nfqueue, report, sys};

#[derive(Parser)]
#[command(name = "dramesh-chaos", about = "Chaos partition suite for dramesh")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs a profile (or one scenario of it) and writes report.md / report.json.
    Run {
        #[arg(long, default_value = "quick")]
        profile: String,
        /// Run only these scenarios (any scenario name, also outside the profile).
        #[arg(long)]
        scenario: Vec<String>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The dramesh binary; default target/{release,debug}/dramesh.
        #[arg(long)]
        dramesh: Option<PathBuf>,
        #[arg(long, default_value = "target/chaos")]
        out: PathBuf,
        /// Extra argument for every replica (repeatable), e.g. --replica-arg=--chaos-disable-anti-entropy.
        #[arg(long = "replica-arg", allow_hyphen_values = true)]
        replica_args: Vec<String>,
        /// Each agent talks to one replica only instead of all of them.
        #[arg(long)]
        agents_home_only: bool,
        /// Shorthand: no anti-entropy and no peer exchange on replicas, home-only agents.
        #[arg(long)]
        break_replication: bool,
        /// Succeed only if every scenario reports lost writes (the checker's own test).
        #[arg(long)]
        expect_lost_writes: bool,
        /// Override the fault window (ms).
        #[arg(long)]
        fault_ms: Option<u64>,
        /// Override warm-up and post-heal convergence timeouts (ms).
        #[arg(long)]
        converge_timeout_ms: Option<u64>,
        /// Override the warm-up convergence timeout only (ms); wins over --converge-timeout-ms.
        #[arg(long)]
        warmup_timeout_ms: Option<u64>,
        /// Changes per second the workload driver makes, instead of the profile's (or the
        /// scenario's) rate. Each change rewrites only the files of the kinds it touched.
        #[arg(long)]
        write_rate: Option<f64>,
    },
    /// Removes every dmc-* namespace and dmcb*/dmv* link (idempotent).
    Cleanup,
    /// Lists the scenarios and profiles.
    List,
    #[command(hide = true)]
    NetemQueue {
        #[arg(long)]
        queue: u16,
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
        #[arg(long, default_value_t = 0)]
        jitter_ms: u64,
        #[arg(long, default_value_t = 0.0)]
        loss: f64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Network probe for tests: `tcp` connects and reads the reply (prints ms), `udp-send`
    /// sends one datagram, `udp-recv` waits for one (exit 1 on timeout).
    #[command(hide = true)]
    Probe {
        mode: String,
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
    /// TCP (`ok` + echo of the first line) and UDP echo server, for network tests.
    StandInServer {
        #[arg(long)]
        listen: SocketAddr,
    },
}

fn find_dramesh(explicit: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if !p.is_file() {
            bail!("--dramesh {p:?} does not exist");
        }
        return Ok(std::fs::canonicalize(p)?);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    for p in [target.join("release/dramesh"), target.join("debug/dramesh")] {
        if p.is_file() {
            return Ok(std::fs::canonicalize(p)?);
        }
    }
    bail!("no dramesh binary: build it (cargo build -p dramesh) or pass --dramesh PATH")
}

fn stand_in_server(listen: SocketAddr) -> Result<()> {
    let udp = UdpSocket::bind(listen).with_context(|| format!("udp bind {listen}"))?;
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(&buf[..n], from);
        }
    });
    let tcp = TcpListener::bind(listen).with_context(|| format!("tcp bind {listen}"))?;
    for s in tcp.incoming() {
        let Ok(mut s) = s else { continue };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).unwrap_or(0);
        let _ = s.write_all(b"ok ");
        let _ = s.write_all(&buf[..n]);
    }
    Ok(())
}

fn probe(mode: &str, addr: SocketAddr, timeout: Duration) -> Result<ExitCode> {
    let start = std::time::Instant::now();
    match mode {
        "tcp" => {
            let mut s = std::net::TcpStream::connect_timeout(&addr, timeout)?;
            s.set_read_timeout(Some(timeout))?;
            s.write_all(b"ping\n")?;
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf)?;
            if !buf[..n].starts_with(b"ok") {
                bail!("unexpected reply {:?}", String::from_utf8_lossy(&buf[..n]));
            }
        }
        "udp-send" => {
            let s = UdpSocket::bind("0.0.0.0:0")?;
            s.send_to(b"ping", addr)?;
        }
        "udp-recv" => {
            let s = UdpSocket::bind(addr)?;
            s.set_read_timeout(Some(timeout))?;
            println!("listening");
            std::io::stdout().flush()?;
            let mut buf = [0u8; 64];
            if s.recv_from(&mut buf).is_err() {
                return Ok(ExitCode::FAILURE);
            }
        }
        other => bail!("unknown probe mode {other:?} (tcp, udp-send, udp-recv)"),
    }
    // The reader may have closed the pipe already; the exit code is the answer.
    let _ = writeln!(
        std::io::stdout(),
        "{:.1}",
        start.elapsed().as_secs_f64() * 1000.0
    );
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    match real_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dramesh-chaos: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn real_main() -> Result<ExitCode> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Cleanup => {
            let c = net::cleanup_all()?;
            println!(
                "removed {} namespaces, {} links",
                c.namespaces.len(),
                c.links.len()
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::List => {
            for s in scenario::all_scenarios(10_000) {
                println!("{:<20} {}", s.name, s.about);
            }
            for p in ["quick", "full"] {
                let prof = Profile::named(p)?;
                println!("profile {p}: {}", prof.scenarios.join(", "));
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::NetemQueue {
            queue,
            delay_ms,
            jitter_ms,
            loss,
            seed,
        } => {
            nfqueue::run_delayer(nfqueue::DelayerConfig {
                queue,
                delay: Duration::from_millis(delay_ms),
                jitter: Duration::from_millis(jitter_ms),
                loss,
                seed,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Probe {
            mode,
            addr,
            timeout_ms,
        } => probe(&mode, addr, Duration::from_millis(timeout_ms)),
        Cmd::StandInServer { listen } => {
            stand_in_server(listen)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Run {
            profile,
            scenario: only,
            seed,
            dramesh,
            out,
            mut replica_args,
            mut agents_home_only,
            break_replication,
            expect_lost_writes,
            fault_ms,
            converge_timeout_ms,
            warmup_timeout_ms,
            write_rate,
        } => {
            sys::install_signal_handlers();
            let mut prof = Profile::named(&profile)?;
            if let Some(f) = fault_ms {
                prof.fault_ms = f;
            }
            if let Some(c) = converge_timeout_ms {
                prof.converge_timeout_ms = c;
                prof.warmup_timeout_ms = c;
            }
            if let Some(w) = warmup_timeout_ms {
                prof.warmup_timeout_ms = w;
            }
            if break_replication {
                // Push and relay stay on, so the warm-up converges and only what a fault cuts
                // off is lost: with no anti-entropy nothing re-sends it after the heal. Without
                // peer exchange each agent knows only its home replica; otherwise it would
                // dial every replica and its own anti-entropy would repair the loss.
                replica_args.push("--chaos-disable-anti-entropy".into());
                replica_args.push("--chaos-disable-peer-exchange".into());
                agents_home_only = true;
            }
            let all = scenario::all_scenarios(prof.fault_ms);
            let names: Vec<String> = if only.is_empty() {
                prof.scenarios.iter().map(|s| s.to_string()).collect()
            } else {
                only
            };
            let mut chosen = Vec::new();
            for n in &names {
                chosen.push(
                    all.iter()
                        .find(|s| s.name == n)
                        .with_context(|| format!("unknown scenario {n:?} (see `list`)"))?
                        .clone(),
                );
            }
            std::fs::create_dir_all(&out)?;
            let opts = RunOptions {
                dramesh: find_dramesh(dramesh)?,
                helper_exe: std::env::current_exe()?,
                out: std::fs::canonicalize(&out)?,
                seed,
                replica_extra_args: replica_args,
                agents_home_only,
                write_rate,
            };
            let mut results = Vec::new();
            for sc in &chosen {
                eprintln!("== scenario {} (seed {seed}): {}", sc.name, sc.about);
                match scenario::run_scenario(sc, &prof, &opts) {
                    Ok(r) => {
                        for v in r.violations.iter().take(10) {
                            eprintln!("   violation: {v}");
                        }
                        eprintln!(
                            "   {} (converge {:?} s)",
                            if r.passed { "PASS" } else { "FAIL" },
                            r.converge_s
                        );
                        results.push(r);
                    }
                    Err(e) => {
                        sys::check_stop()?;
                        bail!("scenario {} could not run: {e:#}", sc.name);
                    }
                }
            }
            report::write(&opts.out, &results)?;
            println!("{}", report::table(&results));
            println!("report: {}", opts.out.join("report.md").display());
            let ok = if expect_lost_writes {
                let all_lost = results.iter().all(|r| {
                    r.violations
                        .iter()
                        .any(|v| v.contains("lost write") || v.contains("absent"))
                });
                println!(
                    "expect-lost-writes: {}",
                    if all_lost {
                        "the checker reported lost writes, as expected"
                    } else {
                        "NOT reported: the checker missed broken replication"
                    }
                );
                all_lost
            } else {
                results.iter().all(|r| r.passed)
            };
            // The closing line CI reads: in expect mode a scenario "passes" when the checker
            // caught the broken replication.
            let failed = if expect_lost_writes {
                usize::from(!ok) * results.len()
            } else {
                results.iter().filter(|r| !r.passed).count()
            };
            println!(
                "chaos: {} passed, {} failed",
                results.len() - failed,
                failed
            );
            Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}
