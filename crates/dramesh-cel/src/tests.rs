//! Unit tests of the selector environment.

use std::sync::Arc;

use dramesh_model::{AttrValue, QualifiedName, Quantity, Semver};

use super::*;

const DRIVER: &str = "gpu.example.com";

fn q(s: &str) -> Quantity {
    Quantity::parse(s).unwrap()
}

fn s(v: &str) -> AttrValue {
    AttrValue::String(v.into())
}

fn gpu() -> DeviceInput {
    DeviceInput::new(
        DRIVER,
        [
            (QualifiedName::parse("model", DRIVER), s("LATEST-GPU-MODEL")),
            (QualifiedName::parse("index", DRIVER), AttrValue::Int(2)),
            (QualifiedName::parse("sriov", DRIVER), AttrValue::Bool(true)),
            (
                QualifiedName::parse("productName", DRIVER),
                s("NVIDIA A100-SXM4-40GB"),
            ),
            (
                QualifiedName::parse("driverVersion", DRIVER),
                AttrValue::Version(Arc::new(Semver::parse("1.2.3").unwrap())),
            ),
            (
                QualifiedName::parse("resource.kubernetes.io/pciBusID", DRIVER),
                s("0008:06:00.0"),
            ),
        ],
        [
            (QualifiedName::parse("memory", DRIVER), q("40Gi")),
            (QualifiedName::parse("cores", DRIVER), q("1500m")),
        ],
        false,
    )
}

fn env() -> CelEnv {
    CelEnv::new(Limits::default())
}

fn eval(env: &CelEnv, expr: &str, dev: &DeviceInput) -> Result<bool, EvalError> {
    let sel = env
        .compile(expr)
        .unwrap_or_else(|e| panic!("{expr:?} should compile: {e}"));
    env.evaluate(&sel, dev)
}

fn yes(expr: &str) {
    assert_eq!(eval(&env(), expr, &gpu()), Ok(true), "{expr}");
}

fn no(expr: &str) {
    assert_eq!(eval(&env(), expr, &gpu()), Ok(false), "{expr}");
}

fn eval_err(expr: &str) -> String {
    match eval(&env(), expr, &gpu()) {
        Err(e) => e.message,
        Ok(b) => panic!("{expr} should fail, got {b}"),
    }
}

fn compile_err(expr: &str) -> CompileError {
    match env().compile(expr) {
        Err(e) => e,
        Ok(_) => panic!("{expr} should not compile"),
    }
}

#[test]
fn device_fields_and_both_index_forms() {
    yes("device.driver == 'gpu.example.com'");
    yes(r#"device.attributes["gpu.example.com"].model == "LATEST-GPU-MODEL""#);
    yes(r#"device.attributes["gpu.example.com"]["model"] == "LATEST-GPU-MODEL""#);
    yes(r#"device.attributes["gpu.example.com"].index == 2"#);
    yes(r#"device.attributes["gpu.example.com"].sriov"#);
    yes(r#"device.attributes["resource.kubernetes.io"].pciBusID == "0008:06:00.0""#);
    yes("device.allowMultipleAllocations == false");
    yes(r#"device.capacity["gpu.example.com"].memory == quantity("40Gi")"#);
    no(r#"device.attributes["gpu.example.com"].model == "other""#);
}

#[test]
fn has_and_in() {
    yes(r#"has(device.attributes["gpu.example.com"].model)"#);
    no(r#"has(device.attributes["gpu.example.com"].nothere)"#);
    yes(r#""gpu.example.com" in device.attributes"#);
    yes(r#""resource.kubernetes.io" in device.attributes"#);
    no(r#""unknown.domain" in device.attributes"#);
    yes(r#""memory" in device.capacity["gpu.example.com"]"#);
    yes(r#"device.attributes.size() == 2 && size(device.capacity) == 1"#);
    yes(r#"device.attributes.exists(d, d == "resource.kubernetes.io")"#);
    yes(r#"device.attributes["gpu.example.com"].all(k, k.size() > 0)"#);
}

#[test]
fn missing_domain_is_an_empty_map_and_missing_key_is_an_error() {
    yes(r#"device.attributes["unknown.domain"].size() == 0"#);
    no(r#"has(device.attributes["unknown.domain"].model)"#);
    yes(r#"device.capacity["unknown.domain"].size() == 0"#);
    let msg = eval_err(r#"device.attributes["gpu.example.com"].nothere == 1"#);
    assert_eq!(msg, "no such key: nothere");
    let msg = eval_err(r#"device.attributes["unknown.domain"].model == "x""#);
    assert_eq!(msg, "no such key: model");
    let msg = eval_err(r#"device.capacity["unknown.domain"]["memory"].isInteger()"#);
    assert_eq!(msg, "no such key: memory");
    // Guarded access is the robust way to write it.
    no(
        r#"has(device.attributes["unknown.domain"].model) && device.attributes["unknown.domain"].model == "x""#,
    );
    yes(r#"device.attributes["unknown.domain"].?model.orValue("none") == "none""#);
}

#[test]
fn quantity_library() {
    yes(r#"quantity("1Gi") == quantity("1024Mi")"#);
    yes(r#"quantity("200M").compareTo(quantity("0.2G")) == 0"#);
    yes(r#"quantity("50M").compareTo(quantity("50Mi")) == -1"#);
    yes(r#"quantity("2").compareTo(quantity("1")) == 1"#);
    yes(r#"isQuantity("10Gi") && !isQuantity("ten")"#);
    yes(r#"quantity("2").isGreaterThan(quantity("1500m"))"#);
    no(r#"quantity("2").isLessThan(quantity("1500m"))"#);
    yes(r#"quantity("1").add(quantity("500m")) == quantity("1500m")"#);
    yes(r#"quantity("1").add(2) == quantity("3")"#);
    yes(r#"quantity("1").sub(quantity("500m")) == quantity("500m")"#);
    yes(r#"quantity("1").sub(3).sign() == -1"#);
    yes(r#"quantity("0").sign() == 0 && quantity("5m").sign() == 1"#);
    yes(r#"quantity("1Ki").asInteger() == 1024"#);
    yes(r#"quantity("1Ki").isInteger() && !quantity("1500m").isInteger()"#);
    yes(r#"quantity("1500m").asApproximateFloat() == 1.5"#);
    yes(r#"device.capacity["gpu.example.com"].memory.compareTo(quantity("40Gi")) >= 0"#);
    yes(r#"device.capacity["gpu.example.com"].memory.isGreaterThan(quantity("10Gi"))"#);
    assert!(eval_err(r#"quantity("1500m").asInteger() == 1"#).contains("not a whole number"));
    assert!(eval_err(r#"quantity("100Ei").asInteger() == 1"#).contains("overflows"));
    assert!(eval_err(r#"quantity("ten") == quantity("10")"#).contains("quantity"));
    // Ordering operators are not defined on quantities, as in Kubernetes.
    assert!(eval_err(r#"quantity("1") < quantity("2")"#).contains("_<_"));
}

#[test]
fn capacity_of_another_driver_without_the_domain_is_empty() {
    let env = env();
    let d = gpu();
    let sel = env
        .compile(r#"device.capacity["gpu.example.com"].cores.compareTo(quantity("1")) > 0"#)
        .unwrap();
    assert_eq!(env.evaluate(&sel, &d), Ok(true));
}

#[test]
fn semver_library() {
    yes(
        r#"semver("1.2.3").major() == 1 && semver("1.2.3").minor() == 2 && semver("1.2.3").patch() == 3"#,
    );
    yes(r#"semver("1.2.3").isLessThan(semver("1.10.0"))"#);
    yes(r#"semver("2.0.0").isGreaterThan(semver("2.0.0-rc.1"))"#);
    yes(r#"semver("1.0.0").compareTo(semver("1.0.0")) == 0"#);
    yes(r#"semver("1.0.0").compareTo(semver("1.0.1")) == -1"#);
    yes(r#"semver("v1.2", true) == semver("1.2.0")"#);
    yes(r#"isSemver("1.2.3") && !isSemver("v1.2") && isSemver("v1.2", true)"#);
    yes(r#"semver("1.2.3") == semver("1.2.3+build.5")"#);
    assert!(eval_err(r#"semver("v1") == semver("1.0.0")"#).contains("semver"));
    // Version attributes are semver values.
    yes(r#"device.attributes["gpu.example.com"].driverVersion.isGreaterThan(semver("1.0.0"))"#);
    yes(r#"device.attributes["gpu.example.com"].driverVersion == semver("1.2.3")"#);
    yes(r#"device.attributes["gpu.example.com"].driverVersion.minor() == 2"#);
}

#[test]
fn string_helpers() {
    let a = r#"device.attributes["gpu.example.com"]"#;
    yes(&format!(
        "{a}.productName.lowerAscii().matches('^.*a100.*$')"
    ));
    yes(&format!(
        "{a}.productName.upperAscii().contains('A100-SXM4')"
    ));
    yes(&format!(
        "{a}.model.startsWith('LATEST') && {a}.model.endsWith('MODEL')"
    ));
    yes(&format!("{a}.model.size() == 16 && size({a}.model) == 16"));
    yes(&format!("matches({a}.model, 'GPU')"));
    yes(&format!("{a}.model.split('-').size() == 3"));
    yes(&format!(
        "{a}.model.replace('-', '_') == 'LATEST_GPU_MODEL'"
    ));
    yes(&format!("{a}.model.indexOf('GPU') == 7"));
    yes(&format!("{a}.model.substring(0, 6) == 'LATEST'"));
    no(&format!("{a}.model.contains('AMD')"));
    // Non-constant patterns are compiled (and cached) at run time.
    yes(&format!(
        "{a}.productName.matches({a}.model.substring(0, 1) + '?.*A100')"
    ));
    let msg = eval_err(&format!("{a}.model.matches({a}.model + '[')"));
    assert!(msg.contains("not a valid regex"), "{msg}");
}

#[test]
fn cel_builtins() {
    yes(
        r#"device.attributes["resource.kubernetes.io"]["pciBusID"] in ["0001:00:00.0", "0008:06:00.0"]"#,
    );
    no(r#"device.attributes["gpu.example.com"].index in [0, 4, 6]"#);
    yes("[1, 2, 3].exists(x, x == 2) && [1, 2, 3].all(x, x > 0)");
    yes("[1, 2, 3].map(x, x * 2) == [2, 4, 6] && [1, 2, 3].filter(x, x > 1).size() == 2");
    yes("[1, 2, 3].exists_one(x, x == 3)");
    yes("device.attributes['gpu.example.com'].index <= 2 ? true : false");
    yes("1 == 1.0 && 'a' != 1");
}

#[test]
fn unqualified_and_qualified_names_share_the_driver_domain() {
    let d = DeviceInput::new(
        DRIVER,
        [
            (QualifiedName::parse("model", DRIVER), s("a")),
            (
                QualifiedName::parse("gpu.example.com/family", DRIVER),
                s("b"),
            ),
        ],
        [],
        true,
    );
    let env = env();
    assert_eq!(
        eval(
            &env,
            r#"device.attributes["gpu.example.com"].model == "a" && device.attributes["gpu.example.com"].family == "b""#,
            &d
        ),
        Ok(true)
    );
    assert_eq!(eval(&env, "device.allowMultipleAllocations", &d), Ok(true));
}

#[test]
fn too_long_expression() {
    let long = format!("device.driver == '{}'", "x".repeat(10 * 1024));
    let e = compile_err(&long);
    assert!(
        matches!(e, CompileError::TooLong { limit: 10240, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("10240 bytes"), "{e}");
    let small = CelEnv::new(Limits {
        max_expression_bytes: 10,
        ..Limits::default()
    });
    assert!(matches!(
        small.compile("device.driver == 'x'"),
        Err(CompileError::TooLong { len: 20, limit: 10 })
    ));
}

#[test]
fn non_bool_result() {
    // Statically known non-bool results are compile errors...
    for expr in ["1 + 2", "'abc'", "device.driver", "[true]", "quantity('1')"] {
        let e = compile_err(expr);
        assert!(
            e.to_string().contains("must evaluate to bool"),
            "{expr}: {e}"
        );
    }
    // ...dynamic ones are evaluation errors.
    let msg = eval_err(r#"device.attributes["gpu.example.com"].model"#);
    assert_eq!(msg, "expression must evaluate to bool, got string");
    let msg = eval_err(r#"device.attributes["gpu.example.com"].driverVersion"#);
    assert_eq!(
        msg,
        "expression must evaluate to bool, got kubernetes.Semver"
    );
}

#[test]
fn declarations_are_checked_at_compile_time() {
    let e = compile_err("noSuchVar == 1");
    assert!(
        e.to_string()
            .contains("undeclared reference to 'noSuchVar'"),
        "{e}"
    );
    assert!(e.to_string().contains("line 1, column 1"), "{e}");
    let e = compile_err("device.driver == 'a' && device.drvier == 'b'");
    assert!(e.to_string().contains("undefined field 'drvier'"), "{e}");
    assert!(e.to_string().contains("column 31"), "{e}");
    let e = compile_err("device.driver.noSuchFunction()");
    assert!(e.to_string().contains("noSuchFunction"), "{e}");
    let e = compile_err("device.driver.matches('[unclosed')");
    assert!(e.to_string().contains("invalid regular expression"), "{e}");
    let e = compile_err("device.driver ==");
    assert!(matches!(e, CompileError::Syntax { .. }), "{e}");
    let e = compile_err("Foo{a: 1}");
    assert!(e.to_string().contains("Foo"), "{e}");
    // A bad argument type is only known at runtime.
    assert!(eval_err("device.driver.startsWith(1)").contains("startsWith"));
}

#[test]
fn cost_guard_rejects_runaway_comprehensions() {
    let list = format!(
        "[{}]",
        (0..100)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    // 100^3 iterations.
    let expr = format!("{list}.all(a, {list}.all(b, {list}.all(c, a + b + c >= 0)))");
    let e = compile_err(&expr);
    match e {
        CompileError::TooCostly { estimated, limit } => {
            assert!(estimated > 1_000_000, "{estimated}");
            assert_eq!(limit, 1_000_000);
        }
        other => panic!("expected TooCostly, got {other}"),
    }
    // Two levels are fine.
    let ok = format!("{list}.all(a, {list}.exists(b, a == b))");
    let sel = env().compile(&ok).unwrap();
    assert!(sel.estimated_cost() > 10_000 && sel.estimated_cost() < 1_000_000);
    // Nesting over device maps is bounded by Kubernetes' 32-entry limit.
    let sel = env()
        .compile("device.attributes.all(d, device.attributes[d].all(k, k.size() < 100))")
        .unwrap();
    assert!(sel.estimated_cost() < 100_000, "{}", sel.estimated_cost());
    // A tighter budget rejects it.
    let tight = CelEnv::new(Limits {
        max_cost: 100,
        ..Limits::default()
    });
    assert!(matches!(
        tight.compile("device.attributes.all(d, device.attributes[d].all(k, k.size() < 100))"),
        Err(CompileError::TooCostly { .. })
    ));
}

#[test]
fn cost_guard_rechecks_oversized_devices() {
    let env = CelEnv::new(Limits {
        max_cost: 20_000,
        ..Limits::default()
    });
    let expr = "device.attributes.all(d, device.attributes[d].all(k, k.size() < 100))";
    let sel = env.compile(expr).unwrap();
    // Within Kubernetes bounds the compile-time estimate holds.
    assert_eq!(env.evaluate(&sel, &gpu()), Ok(true));
    // A device with 5000 attributes (not valid in Kubernetes) exceeds the budget.
    let big = DeviceInput::new(
        DRIVER,
        (0..5000).map(|i| {
            (
                QualifiedName::parse(&format!("a{i}"), DRIVER),
                AttrValue::Int(i),
            )
        }),
        [],
        false,
    );
    let e = env.evaluate(&sel, &big).unwrap_err();
    assert!(e.message.contains("exceeds the limit of 20000"), "{e}");
    // Cheap selectors still run on it.
    let cheap = env.compile("device.driver == 'gpu.example.com'").unwrap();
    assert_eq!(env.evaluate(&cheap, &big), Ok(true));
}

#[test]
fn depth_is_bounded() {
    let deep = format!("{}true{}", "!(".repeat(60), ")".repeat(60));
    let e = compile_err(&deep);
    assert!(
        matches!(
            e,
            CompileError::TooDeep { .. } | CompileError::Syntax { .. }
        ),
        "{e}"
    );
    let fine = format!("{}true{}", "!(".repeat(10), ")".repeat(10));
    assert_eq!(eval(&env(), &fine, &gpu()), Ok(true));
}

#[test]
fn compile_is_cached() {
    let env = env();
    let a = env.compile("device.driver == 'x'").unwrap();
    let b = env.compile("device.driver == 'x'").unwrap();
    assert_eq!(a.id(), b.id());
    assert_eq!(a.expression(), "device.driver == 'x'");
    let c = env.compile("device.driver == 'y'").unwrap();
    assert_ne!(a.id(), c.id());
    assert!(env.compile("1 +").is_err());
    assert!(env.compile("1 +").is_err());
    let st = env.stats();
    assert_eq!(st.compiled, 3);
    assert_eq!((st.compile_hits, st.compile_misses), (2, 3));
}

#[test]
fn results_are_cached_per_selector_and_device_content() {
    let env = env();
    let sel = env
        .compile("device.attributes['gpu.example.com'].index == 2")
        .unwrap();
    let d1 = gpu();
    assert_eq!(env.evaluate(&sel, &d1), Ok(true));
    assert_eq!(env.evaluate(&sel, &d1), Ok(true));
    let st = env.stats();
    assert_eq!((st.result_hits, st.result_misses), (1, 1));

    // Same content built separately (attributes in another order): a hit.
    let d2 = DeviceInput::new(
        DRIVER,
        gpu_attrs_reversed(),
        [
            (QualifiedName::parse("cores", DRIVER), q("1500m")),
            (QualifiedName::parse("memory", DRIVER), q("40Gi")),
        ],
        false,
    );
    assert_eq!(d1.hash(), d2.hash());
    assert_eq!(env.evaluate(&sel, &d2), Ok(true));
    assert_eq!(env.stats().result_hits, 2);

    // Different content: a miss with its own result.
    let d3 = DeviceInput::new(
        DRIVER,
        [(QualifiedName::parse("index", DRIVER), AttrValue::Int(3))],
        [],
        false,
    );
    assert_ne!(d1.hash(), d3.hash());
    assert_eq!(env.evaluate(&sel, &d3), Ok(false));
    assert_eq!(env.stats().result_misses, 2);

    // Errors are cached too.
    let bad = env
        .compile("device.attributes['gpu.example.com'].nothere == 1")
        .unwrap();
    let e1 = env.evaluate(&bad, &d3).unwrap_err();
    let e2 = env.evaluate(&bad, &d3).unwrap_err();
    assert_eq!(e1, e2);
    assert_eq!(env.stats().result_hits, 3);
}

fn gpu_attrs_reversed() -> Vec<(QualifiedName, AttrValue)> {
    let mut v = vec![
        (QualifiedName::parse("model", DRIVER), s("LATEST-GPU-MODEL")),
        (QualifiedName::parse("index", DRIVER), AttrValue::Int(2)),
        (QualifiedName::parse("sriov", DRIVER), AttrValue::Bool(true)),
        (
            QualifiedName::parse("productName", DRIVER),
            s("NVIDIA A100-SXM4-40GB"),
        ),
        (
            QualifiedName::parse("driverVersion", DRIVER),
            AttrValue::Version(Arc::new(Semver::parse("1.2.3").unwrap())),
        ),
        (
            QualifiedName::parse("resource.kubernetes.io/pciBusID", DRIVER),
            s("0008:06:00.0"),
        ),
    ];
    v.reverse();
    v
}

#[test]
fn hash_distinguishes_types_and_flags() {
    let mk = |v: AttrValue, multi: bool| {
        DeviceInput::new(DRIVER, [(QualifiedName::parse("x", DRIVER), v)], [], multi)
    };
    let h = |d: DeviceInput| d.hash();
    assert_ne!(h(mk(AttrValue::Int(1), false)), h(mk(s("1"), false)));
    assert_ne!(
        h(mk(AttrValue::Int(1), false)),
        h(mk(AttrValue::Int(1), true))
    );
    assert_ne!(
        h(mk(AttrValue::Bool(true), false)),
        h(mk(AttrValue::Int(1), false))
    );
    assert_eq!(h(mk(s("a"), false)), h(mk(s("a"), false)));
}

#[test]
fn result_cache_is_bounded() {
    let env = CelEnv::with_result_capacity(Limits::default(), 32);
    let sel = env
        .compile("device.attributes['gpu.example.com'].index >= 0")
        .unwrap();
    for i in 0..1000 {
        let d = DeviceInput::new(
            DRIVER,
            [(QualifiedName::parse("index", DRIVER), AttrValue::Int(i))],
            [],
            false,
        );
        assert_eq!(env.evaluate(&sel, &d), Ok(true));
    }
    let st = env.stats();
    assert!(st.result_entries <= 32, "{}", st.result_entries);
    assert_eq!(st.result_misses, 1000);
}

#[test]
fn env_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<CelEnv>();
    assert_send_sync::<Selector>();
    assert_send_sync::<DeviceInput>();
}

#[test]
fn the_device_value_is_built_once() {
    let env = env();
    let d = gpu();
    let a = env.compile("device.driver == 'gpu.example.com'").unwrap();
    let b = env
        .compile("device.attributes['gpu.example.com'].index == 2")
        .unwrap();
    assert_eq!(env.evaluate_uncached(&a, &d), Ok(true));
    let first: *const device::DeviceVal = d.value();
    assert_eq!(env.evaluate_uncached(&b, &d), Ok(true));
    assert!(std::ptr::eq(first, d.value()));
}

#[test]
fn optional_syntax_is_available() {
    yes(r#"device.attributes["gpu.example.com"].?model.hasValue()"#);
    no(r#"device.attributes["gpu.example.com"].?nothere.hasValue()"#);
    yes(r#"device.attributes["gpu.example.com"].?index.orValue(0) == 2"#);
}

#[test]
fn deepest_accepted_expressions_run_on_a_small_stack() {
    // Builds the deepest expression of each form that compiles and evaluates it on a thread
    // with a 1 MiB stack (debug builds use far more stack per level than release builds).
    let forms: Vec<Box<dyn Fn(usize) -> String>> = vec![
        Box::new(|n| format!("{}true{}", "!(".repeat(n), ")".repeat(n))),
        Box::new(|n| format!("{}1{} != []", "[".repeat(n), "]".repeat(n))),
        Box::new(|n| format!("{}1{} > 0", "(".repeat(n), " + 1)".repeat(n))),
        Box::new(|n| {
            let mut e = "true".to_string();
            for i in 0..n {
                e = format!("[1].all(x{i}, {e})");
            }
            e
        }),
        Box::new(|n| {
            format!(
                "{}device.driver{} != ''",
                "(".repeat(n),
                ".lowerAscii())".repeat(n)
            )
        }),
    ];
    let env = Arc::new(env());
    let dev = Arc::new(gpu());
    for (i, form) in forms.iter().enumerate() {
        let accepted: Vec<usize> = (1..200)
            .take_while(|n| env.compile(&form(*n)).is_ok())
            .collect();
        let deepest = *accepted
            .last()
            .unwrap_or_else(|| panic!("form {i} never compiles"));
        // The deepest one that still runs inline on the caller's stack.
        let inline = accepted
            .iter()
            .copied()
            .rev()
            .find(|n| {
                env.compile(&form(*n))
                    .is_ok_and(|s| s.0.depth <= INLINE_DEPTH)
            })
            .unwrap_or_else(|| panic!("form {i} is never inline"));
        for n in [inline, deepest] {
            let expr = form(n);
            let (env, dev) = (Arc::clone(&env), Arc::clone(&dev));
            let r = std::thread::Builder::new()
                .stack_size(1 << 20)
                .spawn(move || {
                    let sel = env.compile(&expr).unwrap();
                    env.evaluate_uncached(&sel, &dev)
                })
                .unwrap()
                .join()
                .unwrap();
            assert!(r.is_ok(), "form {i} nesting {n}: {r:?}");
        }
    }
}

#[test]
fn bind_sets_and_namespaced_functions() {
    yes(
        r#"cel.bind(a, device.attributes["gpu.example.com"], a.model == "LATEST-GPU-MODEL" && a.index == 2)"#,
    );
    yes("cel.bind(x, [1, 2], cel.bind(y, x.size(), y == 2))");
    let e = compile_err("cel.bind(1, 2, true)");
    assert!(e.to_string().contains("simple identifier"), "{e}");
    yes("sets.contains([1, 2, 3], [3, 1]) && !sets.contains([1], [2])");
    yes("sets.equivalent([1, 2, 2], [2, 1]) && !sets.equivalent([1], [1, 2])");
    yes("sets.intersects(['a', 'b'], ['b']) && !sets.intersects([1], [])");
    yes("optional.of(1).hasValue() && !optional.none().hasValue()");
    yes(r#"strings.quote("a") == "\"a\"""#);
    // `sets` is only a namespace when not shadowed by a variable.
    yes("[[1]].all(sets, sets.size() == 1)");
    let e = compile_err("sets.nothing([1], [2])");
    assert!(e.to_string().contains("sets.nothing"), "{e}");
}

#[test]
fn repeated_names_keep_the_last_value() {
    let d = DeviceInput::new(
        DRIVER,
        [
            (QualifiedName::parse("model", DRIVER), s("first")),
            (
                QualifiedName::parse("gpu.example.com/model", DRIVER),
                s("second"),
            ),
        ],
        [],
        false,
    );
    assert_eq!(
        eval(
            &env(),
            "device.attributes['gpu.example.com'].model == 'second'",
            &d
        ),
        Ok(true)
    );
}

#[test]
fn selectors_from_another_env_are_not_mixed_up() {
    let (a, b) = (env(), env());
    let sa = a.compile("device.driver == 'gpu.example.com'").unwrap();
    let sb = b.compile("device.driver == 'other'").unwrap();
    assert_eq!(sa.id(), sb.id(), "both are the first selector of their env");
    let d = gpu();
    assert_eq!(b.evaluate(&sb, &d), Ok(false));
    assert_eq!(b.evaluate(&sa, &d), Ok(true));
}
