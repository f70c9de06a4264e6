//! No crate of the workspace has a module cycle (the estimator's layering rule, for every
//! crate): one test walking every member's `src/`.
//!
//! The cycles that existed when the check was extended to every crate are listed in `KNOWN`
//! (to be broken; each line says how). A new cycle fails, and so does a listed one that is gone,
//! so the list only shrinks.

use std::path::Path;

use dramesh_testkit::layering::{check_acyclic, workspace_sources};

/// (crate, the modules of one cycle), each with the uses that close it.
const KNOWN: &[(&str, &[&str])] = &[
    // ApiError::Refused carries auth::Refusal; auth's functions return ApiError.
    ("dramesh-api", &["auth", "backend"]),
    // ClusterObject decodes with load's field-naming decoder; load returns ClusterObjects.
    ("dramesh-model", &["load", "object"]),
    // placement uses object::nd (serde default for null) and patch::go_json; object holds
    // Placement; patch writes object's Binding.
    ("dramesh-scheduler", &["object", "patch", "placement"]),
];

#[test]
fn no_crate_has_a_module_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let sources = workspace_sources(&root).unwrap();
    // The workspace is read, not an empty list.
    for expected in [
        "dramesh-estimator",
        "dramesh-mesh",
        "dramesh-replica",
        "dramesh",
    ] {
        assert!(
            sources
                .iter()
                .any(|s| s.ends_with(format!("crates/{expected}/src"))),
            "{expected} missing from {sources:?}"
        );
    }
    assert!(
        sources.iter().any(|s| s.ends_with("chaos/src")),
        "{sources:?}"
    );
    let mut found = Vec::new();
    let mut paths = Vec::new();
    for src in &sources {
        let krate = src.parent().and_then(|p| p.file_name()).unwrap();
        let krate = krate.to_str().unwrap().to_string();
        for (modules, path) in check_acyclic(src).unwrap() {
            paths.push(format!("{krate}: {path}"));
            found.push((krate.clone(), modules));
        }
    }
    let known: Vec<(String, Vec<String>)> = KNOWN
        .iter()
        .map(|(c, m)| (c.to_string(), m.iter().map(|s| s.to_string()).collect()))
        .collect();
    let new: Vec<_> = found.iter().filter(|c| !known.contains(c)).collect();
    let gone: Vec<_> = known.iter().filter(|c| !found.contains(c)).collect();
    assert!(
        new.is_empty(),
        "new module cycles {new:?} (one path each: {paths:#?}): make the arrows go one way"
    );
    assert!(
        gone.is_empty(),
        "cycles {gone:?} are gone: remove them from KNOWN"
    );
}
