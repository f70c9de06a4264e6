//! End-to-end check of the checker against real daemons: with anti-entropy and push disabled
//! on the replicas (hidden flags) and each agent homed on one replica, a partition must make
//! the checker report lost writes. Skips with a message when not root, or when the dramesh
//! binary is not built or does not have the `replica` subcommand yet.

use std::path::PathBuf;
use std::process::Command;

fn dramesh() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let bin = [target.join("debug/dramesh"), target.join("release/dramesh")]
        .into_iter()
        .find(|p| p.is_file())?;
    let help = Command::new(&bin)
        .args(["replica", "--help"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&help.stdout).to_string();
    (help.status.success() && text.contains("--listen-mesh")).then_some(bin)
}

#[test]
#[ignore = "the replica's --chaos-disable-anti-entropy/--chaos-disable-push still let state \
            through (replicas converge anyway); run with --ignored once they cut all replica \
            replication"]
fn broken_replication_is_reported_as_lost_writes() {
    if !dramesh_chaos::sys::is_root() {
        eprintln!("SKIP: not root");
        return;
    }
    let Some(bin) = dramesh() else {
        eprintln!("SKIP: no dramesh binary with `replica` (cargo build -p dramesh)");
        return;
    };
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_dramesh-chaos"))
        .args([
            "run",
            "--scenario",
            "partition-halves",
            "--break-replication",
        ])
        .args(["--expect-lost-writes", "--fault-ms", "4000"])
        .args(["--converge-timeout-ms", "8000", "--dramesh"])
        .arg(&bin)
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "checker did not report the lost writes\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let report = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    assert!(report.contains("FAIL"), "{report}");
    assert!(
        report.contains("lost write") || report.contains("absent"),
        "{report}"
    );
}
