//! Feeds arbitrary UTF-8 to `CelEnv::compile` and evaluates whatever compiles on a fixed
//! device: neither may panic. Run with `cargo +nightly fuzz run compile`.
#![no_main]

use std::sync::{Arc, OnceLock};

use dramesh_cel::{CelEnv, DeviceInput, Limits};
use dramesh_model::{AttrValue, QualifiedName, Quantity, Semver};
use libfuzzer_sys::fuzz_target;

fn env() -> &'static CelEnv {
    static ENV: OnceLock<CelEnv> = OnceLock::new();
    ENV.get_or_init(|| CelEnv::new(Limits::default()))
}

fn device() -> &'static DeviceInput {
    static DEV: OnceLock<DeviceInput> = OnceLock::new();
    DEV.get_or_init(|| {
        let d = "gpu.example.com";
        let version = Semver::parse("1.2.3").map(Arc::new).ok();
        let mut attrs = vec![
            (
                QualifiedName::parse("model", d),
                AttrValue::String("A100".into()),
            ),
            (QualifiedName::parse("index", d), AttrValue::Int(1)),
            (QualifiedName::parse("ok", d), AttrValue::Bool(true)),
        ];
        if let Some(v) = version {
            attrs.push((
                QualifiedName::parse("driverVersion", d),
                AttrValue::Version(v),
            ));
        }
        let memory = Quantity::parse("40Gi").unwrap_or_default();
        DeviceInput::new(
            d,
            attrs,
            [(QualifiedName::parse("memory", d), memory)],
            false,
        )
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(expr) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(selector) = env().compile(expr) {
        let _ = env().evaluate(&selector, device());
    }
});
