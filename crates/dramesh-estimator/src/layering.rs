//! Keeps the crate's modules layered: no module cycle (the workspace-wide check of
//! `dramesh_testkit::layering`, which every crate runs), and the estimator's own rules on top:
//! every `src/*.rs` is declared in `lib.rs`, privately (items are re-exported at the root).

use std::path::Path;

use dramesh_testkit::layering::{check_acyclic, module_graph};

#[test]
fn modules_are_acyclic() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = module_graph(&src).expect("read src/");
    assert!(
        g.contains_key("estimate") && g.contains_key("view") && g["estimate"].contains("view"),
        "{g:?}"
    );
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read lib.rs");
    for module in g.keys().filter(|m| *m != "layering") {
        assert!(
            lib.contains(&format!("mod {module};")),
            "src/{module}.rs is not declared in lib.rs"
        );
        assert!(
            !lib.contains(&format!("pub mod {module};")),
            "{module} is public: modules are private, re-export items at the root"
        );
    }
    let cycles = check_acyclic(&src).expect("read src/");
    assert!(cycles.is_empty(), "module cycles: {cycles:?}");
}
