//! Small OS helpers: running tools (`ip`, `iptables`) with their output checked, signal
//! handling that turns SIGINT/SIGTERM into a flag the runner polls (so every guard's `Drop`
//! still runs and no namespace is left behind), and process signalling by pid.
//!
//! Guarantees: a failed tool invocation is an error naming the command line and its stderr;
//! nothing here kills a process it was not given the pid of.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to [`stop_requested`] instead of killing the process, so the
/// harness can tear its namespaces down before exiting.
pub fn install_signal_handlers() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only performs an atomic store, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// True once SIGINT or SIGTERM was received.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Fails with a clear error when a stop was requested; called between run steps.
pub fn check_stop() -> Result<()> {
    if stop_requested() {
        bail!("interrupted by signal; tearing down");
    }
    Ok(())
}

/// Runs `program args...`, returning stdout; a non-zero exit is an error with stderr.
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot start `{program}` (is it installed?)"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs a command inside network namespace `ns` (`ip netns exec ns ...`).
pub fn run_in(ns: &str, program: &str, args: &[&str]) -> Result<String> {
    let mut full = vec!["netns", "exec", ns, program];
    full.extend_from_slice(args);
    run("ip", &full)
}

/// Sends `sig` to `pid`; a process that is already gone is not an error.
pub fn signal(pid: u32, sig: libc::c_int) -> Result<()> {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        bail!("pid {pid} out of range");
    };
    // SAFETY: kill(2) with a specific positive pid has no memory-safety preconditions.
    let rc = unsafe { libc::kill(p, sig) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ESRCH) {
            return Err(err).with_context(|| format!("kill({pid}, {sig})"));
        }
    }
    Ok(())
}

/// True when this process runs as root (namespaces and firewall rules need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Whether `program` is found on PATH.
pub fn have(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|d| {
            let p = d.join(program);
            p.is_file()
        })
    })
}
