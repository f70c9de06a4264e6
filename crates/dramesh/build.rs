//! Records the git commit the binary is built from (`dramesh --version`).
//!
//! `DRAMESH_GIT_COMMIT` in the environment wins (builds from a tarball or in a container that
//! know their commit); otherwise `git rev-parse HEAD` when the source is a git checkout and
//! git is installed; otherwise "unknown". Never fails the build.

use std::path::Path;
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DRAMESH_GIT_COMMIT");
    let dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let commit = match std::env::var("DRAMESH_GIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => match git(&dir, &["rev-parse", "HEAD"]) {
            Some(c) => {
                // Rebuild when HEAD moves: HEAD itself, the branch it names, packed refs.
                let git_dir = git(&dir, &["rev-parse", "--absolute-git-dir"]);
                let common = git(
                    &dir,
                    &["rev-parse", "--path-format=absolute", "--git-common-dir"],
                );
                let mut watch = Vec::new();
                if let Some(g) = &git_dir {
                    watch.push(Path::new(g).join("HEAD"));
                }
                if let (Some(common), Some(head)) =
                    (&common, git(&dir, &["symbolic-ref", "-q", "HEAD"]))
                {
                    watch.push(Path::new(common).join(head));
                    watch.push(Path::new(common).join("packed-refs"));
                }
                // Only existing files: a missing one would rerun this script on every build.
                for p in watch.iter().filter(|p| p.exists()) {
                    println!("cargo:rerun-if-changed={}", p.display());
                }
                c
            }
            None => "unknown".to_string(),
        },
    };
    println!("cargo:rustc-env=DRAMESH_GIT_COMMIT={commit}");
}
