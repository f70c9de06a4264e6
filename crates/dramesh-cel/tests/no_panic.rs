//! Random input never panics `compile` or `evaluate` (the fuzz target in `fuzz/` does the same
//! with coverage guidance; this runs on stable as part of `cargo test`).

use std::sync::{Arc, OnceLock};

use dramesh_cel::{CelEnv, DeviceInput, Limits};
use dramesh_model::{AttrValue, QualifiedName, Quantity, Semver};
use proptest::prelude::*;

fn env() -> &'static CelEnv {
    static ENV: OnceLock<CelEnv> = OnceLock::new();
    ENV.get_or_init(|| CelEnv::new(Limits::default()))
}

fn device() -> &'static DeviceInput {
    static DEV: OnceLock<DeviceInput> = OnceLock::new();
    DEV.get_or_init(|| {
        let d = "gpu.example.com";
        DeviceInput::new(
            d,
            [
                (
                    QualifiedName::parse("model", d),
                    AttrValue::String("A100".into()),
                ),
                (QualifiedName::parse("index", d), AttrValue::Int(1)),
                (QualifiedName::parse("ok", d), AttrValue::Bool(true)),
                (
                    QualifiedName::parse("v", d),
                    AttrValue::Version(Arc::new(
                        Semver::parse("1.2.3").unwrap_or_else(|e| panic!("{e}")),
                    )),
                ),
            ],
            [(
                QualifiedName::parse("memory", d),
                Quantity::parse("40Gi").unwrap_or_else(|e| panic!("{e}")),
            )],
            false,
        )
    })
}

fn run(expr: &str) {
    if let Ok(sel) = env().compile(expr) {
        let _ = env().evaluate(&sel, device());
    }
}

/// Fragments of selector syntax, so random combinations reach past the parser.
const TOKENS: &[&str] = &[
    "device",
    ".",
    "attributes",
    "capacity",
    "driver",
    "allowMultipleAllocations",
    "[",
    "]",
    "(",
    ")",
    "\"gpu.example.com\"",
    "'x'",
    "model",
    "index",
    "memory",
    "v",
    "==",
    "!=",
    "<",
    ">=",
    "&&",
    "||",
    "!",
    "?",
    ":",
    "has",
    "in",
    "quantity(\"1Gi\")",
    "semver(\"1.0.0\")",
    "compareTo",
    "isGreaterThan",
    "isLessThan",
    "add",
    "sub",
    "asInteger",
    "sign",
    "major",
    "lowerAscii()",
    "matches",
    "startsWith",
    "size()",
    "exists",
    "all",
    "map",
    "filter",
    "x",
    ",",
    "1",
    "-1",
    "2.5",
    "true",
    "null",
    "[1, 2]",
    "{'a': 1}",
    ".?",
    "orValue",
    "+",
    "*",
    "/",
    "%",
    "b\"x\"",
    "9223372036854775807",
    "int",
    "string",
    "type",
    "dyn",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    #[test]
    fn arbitrary_strings_do_not_panic(s in "\\PC{0,80}") {
        run(&s);
    }

    #[test]
    fn token_soup_does_not_panic(toks in proptest::collection::vec(proptest::sample::select(TOKENS), 0..24)) {
        let expr = toks.join(" ");
        run(&expr);
        run(&toks.concat());
    }
}

#[test]
fn known_tricky_inputs_do_not_panic() {
    for expr in [
        "",
        "{a: 1}",
        "{1: 2, 1: 3} == {}",
        "Foo{a: 1}",
        "device.attributes[1]",
        "device[\"driver\"] == 'x'",
        "device.attributes['x'].?y.value()",
        "[1,2].map(x, y, x)",
        "device.attributes.all(k, v, true)",
        "dyn(device).driver == 'x'",
        "type(device) == int",
        "quantity('1').add(9223372036854775807).add(9223372036854775807).isInteger()",
        "\"\\xff\" == b'\\xff'",
        "'a'.matches('(((((((((((a*)*)*)*)*)*)*)*)*)*)*)')",
        "9223372036854775807 + 1 == 0",
        "-9223372036854775808 / -1 == 0",
        ")))(((",
        "\u{0}",
        "device.",
    ] {
        run(expr);
    }
}
