//! The integration tests of dramesh-telemetry, as one test binary (each file a module; nextest still runs every test in its own process).
mod common;

mod metrics_http;
mod metrics_render;
mod otlp_export;
mod serve_bounds;
