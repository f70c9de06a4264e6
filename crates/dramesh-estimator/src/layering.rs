//! Keeps the crate's modules acyclic: reads every `src/*.rs`, collects the modules each one
//! names through `crate::<module>`, and fails on a cycle (printing it), on a module `lib.rs`
//! does not declare, and on grouped `crate::{..}` paths, which this check cannot read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// module -> modules it names.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut g = BTreeMap::new();
    let entries = std::fs::read_dir(&src).expect("read src/");
    for entry in entries {
        let path = entry.expect("dir entry").path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.extension().and_then(|e| e.to_str()) != Some("rs")
            || stem == "lib"
            || stem == "layering"
        {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read module");
        assert!(
            !text.contains("crate::{"),
            "{}: name one module per `crate::` path so the layering check can read it",
            path.display()
        );
        let mut uses = BTreeSet::new();
        for (i, _) in text.match_indices("crate::") {
            let rest = &text[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // `crate::module::...`; a bare `crate::Item` names the root's re-exports.
            if rest[name.len()..].starts_with("::") && name != stem {
                uses.insert(name);
            }
        }
        g.insert(stem.to_string(), uses);
    }
    g
}

/// A cycle through `node`, if one is reachable from it.
fn find_cycle(
    g: &BTreeMap<String, BTreeSet<String>>,
    node: &str,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(at) = path.iter().position(|n| n == node) {
        let mut cycle = path[at..].to_vec();
        cycle.push(node.to_string());
        return Some(cycle);
    }
    if done.contains(node) {
        return None;
    }
    path.push(node.to_string());
    for next in g.get(node).into_iter().flatten() {
        if let Some(c) = find_cycle(g, next, path, done) {
            return Some(c);
        }
    }
    path.pop();
    done.insert(node.to_string());
    None
}

#[test]
fn modules_are_acyclic() {
    let g = graph();
    assert!(
        g.contains_key("estimate") && g.contains_key("view"),
        "{g:?}"
    );
    let lib = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs"))
        .expect("read lib.rs");
    for (module, uses) in &g {
        assert!(
            lib.contains(&format!("mod {module};")),
            "src/{module}.rs is not declared in lib.rs"
        );
        assert!(
            !lib.contains(&format!("pub mod {module};")),
            "{module} is public: modules are private, re-export items at the root"
        );
        for u in uses {
            assert!(
                g.contains_key(u) || u == "test_fleet",
                "{module} names unknown module {u}"
            );
        }
    }
    let mut done = BTreeSet::new();
    for module in g.keys() {
        if let Some(cycle) = find_cycle(&g, module, &mut Vec::new(), &mut done) {
            panic!("module cycle: {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn cycle_detection_finds_cycles() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    let cycle = find_cycle(&g, "a", &mut Vec::new(), &mut BTreeSet::new());
    assert_eq!(
        cycle,
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    assert_eq!(
        find_cycle(&g, "d", &mut Vec::new(), &mut BTreeSet::new()),
        None
    );
}
