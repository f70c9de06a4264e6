//! The shared fixtures (`shared/fixtures`, kept beside the repository and never copied into
//! it): found in the nearest ancestor of this crate that has a `shared/fixtures` folder, so a
//! clone with `../shared` and a git worktree nested deeper both find them.
//!
//! Tests that need them call [`fixtures`]: when the folder is absent the test is skipped with a
//! message, except under CI (the `CI` environment variable set, as CI sets it), where a missing
//! folder fails the test instead of letting it pass as skipped.

use std::path::{Path, PathBuf};

/// Karmada's CRD manifests (`fixtures/karmada/crds`).
pub const KARMADA_CRDS: &str = "karmada/crds";
/// Real-world DRA manifests and CEL expressions (`fixtures/real`, its README maps files to
/// features).
pub const REAL: &str = "real";

/// `shared/fixtures/<sub>` in the nearest ancestor that has `shared/fixtures`, if that exists
/// (no skip message, no CI rule: for code that works with or without it).
pub fn fixtures_dir(sub: &str) -> Option<PathBuf> {
    let root = shared_fixtures()?;
    let p = if sub.is_empty() { root } else { root.join(sub) };
    p.exists().then_some(p)
}

/// `shared/fixtures/<sub>` for a test that needs it. Absent: `None` after printing why the test
/// is skipped, or, when `CI` is set, a panic that fails the test.
pub fn fixtures(sub: &str) -> Option<PathBuf> {
    match required(fixtures_dir(sub), in_ci(), || missing(sub)) {
        Ok(found) => found,
        Err(e) => panic!("{e}"),
    }
}

/// The rule of [`fixtures`]: what was found, else a skip (`Ok(None)`, after printing why) or,
/// under CI, the failure's message.
fn required(
    found: Option<PathBuf>,
    ci: bool,
    what: impl FnOnce() -> String,
) -> Result<Option<PathBuf>, String> {
    if found.is_some() {
        return Ok(found);
    }
    let what = what();
    if ci {
        return Err(format!(
            "{what}; CI is set, so this test fails instead of being skipped"
        ));
    }
    eprintln!("SKIP (what needs it): {what}");
    Ok(None)
}

/// Whether `CI` is set (to anything but empty, `0` or `false`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"))
}

fn shared_fixtures() -> Option<PathBuf> {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|a| a.join("shared/fixtures"))
        .find(|d| d.is_dir())
}

fn missing(sub: &str) -> String {
    match shared_fixtures() {
        Some(root) => format!("{} is absent", root.join(sub).display()),
        None => format!(
            "shared/fixtures/{sub} is absent: no ancestor of {} has shared/fixtures (the \
             repository's ../shared)",
            env!("CARGO_MANIFEST_DIR")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn present_runs_absent_skips_and_absent_under_ci_fails() {
        let p = PathBuf::from("/x/shared/fixtures/real");
        assert_eq!(
            required(Some(p.clone()), true, || unreachable!()),
            Ok(Some(p))
        );
        assert_eq!(required(None, false, || "real is absent".into()), Ok(None));
        let e = required(None, true, || "real is absent".into()).unwrap_err();
        assert!(e.starts_with("real is absent; CI is set"), "{e}");
    }

    #[test]
    fn this_repository_finds_its_fixtures_beside_it_when_they_are_there() {
        // The lookup agrees with the folder: found exactly when an ancestor has it.
        let any_ancestor = Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .any(|a| a.join("shared/fixtures").is_dir());
        assert_eq!(fixtures_dir("").is_some(), any_ancestor);
        assert!(fixtures_dir("no-such-fixture-folder").is_none());
    }
}
