//! Keeps a crate's modules acyclic: reads every `.rs` file under its `src/`, collects the
//! top-level modules each top-level module names through `crate::<module>::` (also inside
//! grouped `crate::{a::X, b::{Y, Z}}` paths), and finds the cycles in that graph.
//!
//! A file belongs to the top-level module of its path (`src/karmada/watch.rs` to `karmada`); the
//! crate root (`lib.rs`, `main.rs`) and `src/bin/` are not modules of the graph. Comment lines are
//! skipped (doc links are not dependencies); test modules inside a file count like the rest.
//! A module named through `use crate::module;` alone, without a `::` after it, is not seen.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level module -> the other top-level modules it names.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The module graph of the crate whose sources are in `src`.
pub fn module_graph(src: &Path) -> Result<Graph, String> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    // First the modules, so that a path naming a root item (`crate::Item`) is not taken for one.
    let mut graph = Graph::new();
    let mut owner = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(src).map_err(|e| e.to_string())?;
        let mut parts = rel.components();
        let first = parts
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or_default();
        let top = first.strip_suffix(".rs").unwrap_or(first);
        if matches!(top, "lib" | "main" | "bin") {
            continue;
        }
        graph.entry(top.to_string()).or_default();
        owner.push((f, top.to_string()));
    }
    for (f, top) in owner {
        let text = std::fs::read_to_string(f).map_err(|e| format!("read {}: {e}", f.display()))?;
        for name in named_modules(&text) {
            if name != top && graph.contains_key(&name) {
                graph.entry(top.clone()).or_default().insert(name);
            }
        }
    }
    Ok(graph)
}

/// The module cycles of `g`: each set of modules that all reach each other (a strongly
/// connected component of more than one module), sorted.
pub fn cycles(g: &Graph) -> Vec<Vec<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(n) = todo.pop() {
            for next in g.get(&n).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = g.keys().map(|k| (k, reach(k))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    for (m, r) in &reaches {
        if !r.contains(*m) || out.iter().any(|c| c.contains(*m)) {
            continue;
        }
        let component = r
            .iter()
            .filter(|n| reaches.get(n).is_some_and(|back| back.contains(*m)))
            .cloned()
            .collect();
        out.push(component);
    }
    out
}

/// The module cycles of the crate whose sources are in `src` (see [`cycles`]), each with one
/// path around it, as `a -> b -> a`.
pub fn check_acyclic(src: &Path) -> Result<Vec<(Vec<String>, String)>, String> {
    let g = module_graph(src)?;
    Ok(cycles(&g)
        .into_iter()
        .map(|c| {
            let path = find_cycle(&g, &c[0], &mut Vec::new(), &mut BTreeSet::new())
                .unwrap_or_default()
                .join(" -> ");
            (c, path)
        })
        .collect())
}

/// A cycle through `node` or reachable from it, if there is one (`done` holds the nodes already
/// known to reach none, shared between calls).
pub fn find_cycle(
    g: &Graph,
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

/// The source folders of every package of the workspace at `root` (its `members`, `dir/*`
/// globs expanded), sorted.
pub fn workspace_sources(root: &Path) -> Result<Vec<PathBuf>, String> {
    let manifest = root.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)
        .map_err(|e| format!("read {}: {e}", manifest.display()))?;
    let members = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("members"))
        .and_then(|l| l.trim().strip_prefix('='))
        .ok_or_else(|| format!("{}: no one-line `members = [..]`", manifest.display()))?;
    let mut out = Vec::new();
    for m in members.trim().trim_matches(['[', ']']).split(',') {
        let m = m.trim().trim_matches('"');
        if m.is_empty() {
            continue;
        }
        let dirs = match m.strip_suffix("/*") {
            Some(parent) => {
                let parent = root.join(parent);
                let entries = std::fs::read_dir(&parent)
                    .map_err(|e| format!("read {}: {e}", parent.display()))?;
                entries
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.join("Cargo.toml").is_file())
                    .collect()
            }
            None => vec![root.join(m)],
        };
        out.extend(dirs.into_iter().map(|d| d.join("src")));
    }
    out.sort();
    Ok(out)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("read {}: {e}", dir.display()))?;
    for e in entries {
        let p = e
            .map_err(|e| format!("read {}: {e}", dir.display()))?
            .path();
        if p.is_dir() {
            rust_files(&p, out)?;
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
    out.sort();
    Ok(())
}

/// First segments of the `crate::` paths in `text` that go on with `::` (module paths), outside
/// comment lines, grouped paths included.
fn named_modules(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
        for (i, _) in line.match_indices("crate::") {
            // `$crate::` in a macro names the crate from outside; not a module edge.
            if line[..i].ends_with('$') {
                continue;
            }
            paths(&line[i + "crate::".len()..], &mut out);
        }
    }
    // A grouped path can span lines: read those from the whole text.
    for (i, _) in text.match_indices("crate::{") {
        paths(&text[i + "crate::".len()..], &mut out);
    }
    out
}

/// Reads one path tail (`module::...` or `{a::X, b}`) and adds the module segments it names.
fn paths(rest: &str, out: &mut BTreeSet<String>) {
    if let Some(group) = rest.strip_prefix('{') {
        let mut depth = 0usize;
        let mut start = 0;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    segment(&group[start..i], out);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    segment(&group[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        return;
    }
    segment(rest, out);
}

fn segment(s: &str, out: &mut BTreeSet<String>) {
    let s = s.trim_start();
    let name: String = s
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    if !name.is_empty() && s[name.len()..].starts_with("::") {
        out.insert(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &[&str])]) -> Graph {
        edges
            .iter()
            .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
            .collect()
    }

    #[test]
    fn cycle_detection_finds_cycles() {
        let g = graph(&[("a", &["b"]), ("b", &["c"]), ("c", &["a"]), ("d", &[])]);
        assert_eq!(
            find_cycle(&g, "a", &mut Vec::new(), &mut BTreeSet::new()),
            Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
        );
        assert_eq!(
            find_cycle(&g, "d", &mut Vec::new(), &mut BTreeSet::new()),
            None
        );
    }

    #[test]
    fn cycles_are_the_strongly_connected_components() {
        let g = graph(&[
            ("a", &["b"]),
            ("b", &["c", "d"]),
            ("c", &["a"]),
            ("d", &["e"]),
            ("e", &["d"]),
            ("f", &["a"]),
        ]);
        let want: Vec<Vec<String>> = vec![
            vec!["a".into(), "b".into(), "c".into()],
            vec!["d".into(), "e".into()],
        ];
        assert_eq!(cycles(&g), want);
        assert!(cycles(&graph(&[("a", &["b"]), ("b", &[])])).is_empty());
    }

    #[test]
    fn named_modules_reads_plain_grouped_and_nested_paths() {
        let text = "use crate::view::View;\n\
                    use crate::{fit::{Fit, Cache}, hash::h,\n    Item, quota::Q};\n\
                    // see crate::commented::X\n\
                    let x = crate::estimate(1);\n\
                    $crate::macro_path::m!();\n";
        let got: Vec<String> = named_modules(text).into_iter().collect();
        assert_eq!(got, ["fit", "hash", "quota", "view"]);
    }

    #[test]
    fn a_cycle_in_a_crate_on_disk_is_reported() {
        let dir = std::env::temp_dir().join(format!("dramesh-testkit-{}", std::process::id()));
        let src = dir.join("src");
        std::fs::create_dir_all(src.join("b")).unwrap();
        std::fs::write(src.join("lib.rs"), "mod a; mod b;\nuse crate::a::X;").unwrap();
        std::fs::write(src.join("a.rs"), "use crate::b::inner::Y;").unwrap();
        std::fs::write(src.join("b.rs"), "mod inner;").unwrap();
        std::fs::write(src.join("b/inner.rs"), "use crate::{a::X};").unwrap();
        let cyclic = check_acyclic(&src).unwrap();
        std::fs::write(src.join("b/inner.rs"), "use crate::Root;").unwrap();
        let acyclic = check_acyclic(&src).unwrap();
        let g = module_graph(&src).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let ab = vec!["a".to_string(), "b".to_string()];
        assert_eq!(cyclic, vec![(ab, "a -> b -> a".to_string())]);
        assert!(acyclic.is_empty(), "{acyclic:?}");
        assert_eq!(g, graph(&[("a", &["b"]), ("b", &[])]));
    }
}
