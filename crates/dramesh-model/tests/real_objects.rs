//! Real objects from ../shared/fixtures (skipped with a message when that folder is absent):
//! the nesting bound leaves ample room for them, and objects as an API server returns them load.

use std::path::{Path, PathBuf};

use dramesh_model::depth::{MAX_DEPTH, check_depth};

fn shared(sub: &str) -> Option<PathBuf> {
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/fixtures"
    ))
    .join(sub);
    if p.is_dir() {
        Some(p)
    } else {
        eprintln!("skipping: {} is absent", p.display());
        None
    }
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p
            .extension()
            .is_some_and(|e| e == "yaml" || e == "yml" || e == "json")
        {
            out.push(p);
        }
    }
}

#[test]
fn real_fixtures_nest_well_under_the_bound() {
    let Some(dir) = shared("") else { return };
    let mut all = Vec::new();
    files(&dir, &mut all);
    assert!(
        all.len() > 300,
        "expected the real fixtures, found {}",
        all.len()
    );
    let (mut deepest, mut at) = (0, PathBuf::new());
    for f in &all {
        let text = std::fs::read_to_string(f).unwrap();
        let d = check_depth(&text, usize::MAX).unwrap();
        if d > deepest {
            (deepest, at) = (d, f.clone());
        }
    }
    eprintln!("deepest real fixture: {deepest} levels ({})", at.display());
    assert!(
        deepest * 2 <= MAX_DEPTH,
        "{} nests {deepest} levels",
        at.display()
    );
}
