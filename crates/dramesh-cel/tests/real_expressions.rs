//! Every CEL selector found in the real-world fixtures must compile (except the ones that are
//! malformed upstream, which must be rejected as syntax errors, as Kubernetes would), and
//! evaluate without internal errors.

use std::sync::Arc;

use dramesh_cel::{CelEnv, CompileError, DeviceInput, Limits};
use dramesh_model::{AttrValue, QualifiedName, Quantity, Semver};

/// The fixture, under the shared fixtures' `real/`.
const FIXTURE: &str = "real/cel-expressions.md";

/// Upstream expressions that are not valid CEL (a stray quote in a KEP example).
const MALFORMED_UPSTREAM: &[&str] = &[r#"'device.capacity['google-tpu'].tpus == quantity("16")"#];

/// `(row number, expression)` for every table row of the fixture.
fn expressions(text: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("| ") else {
            continue;
        };
        let Some((num, rest)) = rest.split_once(" | `") else {
            continue;
        };
        let Ok(num) = num.trim().parse::<u32>() else {
            continue;
        };
        let Some(end) = rest.rfind("` |") else {
            continue;
        };
        out.push((num, rest[..end].replace("\\|", "|")));
    }
    out
}

fn attr(domain_id: &str, v: AttrValue) -> (QualifiedName, AttrValue) {
    (QualifiedName::parse(domain_id, "unused"), v)
}

fn s(v: &str) -> AttrValue {
    AttrValue::String(v.into())
}

/// A device carrying many of the attributes real selectors look at.
fn rich_device(driver: &str) -> DeviceInput {
    DeviceInput::new(
        driver,
        [
            attr("dra.net/rdma", AttrValue::Bool(true)),
            attr("dra.net/numaNode", AttrValue::Int(0)),
            attr("dra.net/virtual", AttrValue::Bool(false)),
            attr("dra.net/ifName", s("gpu1rdma0")),
            attr("dra.net/name", s("eth1")),
            attr("dra.net/type", s("dummy")),
            attr("dra.net/cloudNetwork", s("dranet-net-1")),
            attr("resource.kubernetes.io/pciBusID", s("0008:06:00.0")),
            attr("gpu.example.com/model", s("LATEST-GPU-MODEL")),
            attr("gpu.example.com/type", s("gpu")),
            attr("gpu.nvidia.com/productName", s("NVIDIA A100-SXM4-40GB")),
            attr("gpu.nvidia.com/index", AttrValue::Int(2)),
            attr("gpu.nvidia.com/type", s("gpu")),
            attr(
                "gpu.nvidia.com/driverVersion",
                AttrValue::Version(Arc::new(Semver::parse("550.54.15").unwrap())),
            ),
        ],
        [
            (
                QualifiedName::parse("gpu.example.com/memory", driver),
                Quantity::parse("80Gi").unwrap(),
            ),
            (
                QualifiedName::parse("gpu.nvidia.com/memory", driver),
                Quantity::parse("40Gi").unwrap(),
            ),
            (
                QualifiedName::parse("gpu.nvidia.com/multiprocessors", driver),
                Quantity::parse("98").unwrap(),
            ),
        ],
        false,
    )
}

#[test]
fn every_real_expression_compiles_and_evaluates() {
    let Some(path) = dramesh_testkit::fixtures(FIXTURE) else {
        return;
    };
    let text = std::fs::read_to_string(&path).unwrap();
    let exprs = expressions(&text);
    assert!(exprs.len() >= 90, "only {} expressions parsed", exprs.len());
    let env = CelEnv::new(Limits::default());
    let empty = DeviceInput::new("dra.net", [], [], false);
    let rich = rich_device("gpu.nvidia.com");
    let (mut max_cost, mut compiled) = (0u64, 0usize);
    for (num, expr) in &exprs {
        if MALFORMED_UPSTREAM.contains(&expr.as_str()) {
            let e = env
                .compile(expr)
                .expect_err("malformed upstream expression");
            assert!(matches!(e, CompileError::Syntax { .. }), "#{num}: {e}");
            continue;
        }
        let sel = env
            .compile(expr)
            .unwrap_or_else(|e| panic!("#{num} `{expr}` does not compile: {e}"));
        compiled += 1;
        max_cost = max_cost.max(sel.estimated_cost());
        for dev in [&empty, &rich] {
            match env.evaluate(&sel, dev) {
                Ok(_) => {}
                // Selectors that do not guard with has() fail on devices without the key,
                // as in Kubernetes; anything else (no overload, internal error) is a bug.
                Err(e) => assert!(
                    e.message.starts_with("no such key: "),
                    "#{num} `{expr}`: {e}"
                ),
            }
        }
    }
    eprintln!(
        "{compiled} real expressions compiled; largest estimated cost {max_cost}; {} malformed upstream",
        MALFORMED_UPSTREAM.len()
    );
    assert!(max_cost < 10_000, "{max_cost}");
}

#[test]
fn spot_checks_on_a_rich_device() {
    let env = CelEnv::new(Limits::default());
    let dev = rich_device("gpu.nvidia.com");
    let cases: &[(&str, bool)] = &[
        (
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
            true,
        ),
        (
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
            false,
        ),
        (
            r#"device.capacity["gpu.nvidia.com"]["memory"].compareTo(quantity("40Gi")) >= 0"#,
            true,
        ),
        (
            r#"device.capacity['gpu.nvidia.com'].multiprocessors.isGreaterThan(quantity("50"))"#,
            true,
        ),
        (
            r#"device.capacity['gpu.nvidia.com'].multiprocessors.isLessThan(quantity("30"))"#,
            false,
        ),
        (
            "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$') && (device.attributes['gpu.nvidia.com'].index == 0 || device.attributes['gpu.nvidia.com'].index == 2 || device.attributes['gpu.nvidia.com'].index == 4 || device.attributes['gpu.nvidia.com'].index == 6)",
            true,
        ),
        (
            r#""alibaba.dra.net" in device.attributes && device.attributes["alibaba.dra.net"]["erdma"] == true"#,
            false,
        ),
        (
            r#"device.attributes["dra.net"].cloudNetwork.contains("dranet-net")"#,
            true,
        ),
        (
            r#"device.attributes["resource.kubernetes.io"]["pciBusID"] in ["0001:00:00.0","0002:00:00.0","0003:00:00.0","0008:00:00.0"]"#,
            false,
        ),
        (
            r#"has(device.attributes["dra.net"].ifName) && (device.attributes["dra.net"].ifName == "dummy0" || device.attributes["dra.net"].ifName == "gpu1rdma0")"#,
            true,
        ),
        (
            r#"device.attributes["gpu.nvidia.com"].driverVersion.isGreaterThan(semver("535.0.0"))"#,
            true,
        ),
    ];
    for (expr, want) in cases {
        let sel = env.compile(expr).unwrap();
        assert_eq!(env.evaluate(&sel, &dev), Ok(*want), "{expr}");
    }
}
