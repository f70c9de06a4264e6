//! Tracing setup for the daemons: env-filtered fmt logs on stderr, plus span export over
//! OTLP/gRPC when an endpoint is configured.
//!
//! Guarantees:
//! - the stderr log filter comes from `RUST_LOG` when set (an invalid value is an error naming
//!   `RUST_LOG`), else from [`TelemetryConfig::default_filter`] (`info`);
//! - the export filter is independent of the log filter, so a quiet daemon (`warn` logs) still
//!   exports its spans: `INFO` and above from `dramesh*` targets, `WARN` and above from others;
//! - OTLP export is on exactly when [`TelemetryConfig::otlp_endpoint`] or
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` is a non-empty string; spans then go through a batch processor
//!   to the endpoint with resource attributes `service.name`, `service.version` and, if set,
//!   `service.instance.id`;
//! - events of the export path itself (`h2`, `hyper`, `tonic`, `tower`, `opentelemetry*`) never
//!   become exported spans, so exporting cannot feed itself;
//! - spans still buffered are flushed when the [`TelemetryGuard`] is shut down or dropped, bounded
//!   by [`TelemetryConfig::shutdown_timeout`].
//!
//! The gRPC channel lives on the Tokio runtime, so OTLP export needs [`init`] to be called inside
//! a runtime, and the flush on drop needs a multi-thread runtime (or no runtime at all); on a
//! current-thread runtime call [`TelemetryGuard::shutdown`] and await it instead.

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Subscriber;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::fmt::writer::BoxMakeWriter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// `service.name` of the control-plane replica.
pub const SERVICE_REPLICA: &str = "dramesh-replica";
/// `service.name` of the member-cluster agent.
pub const SERVICE_AGENT: &str = "dramesh-agent";
/// Environment variable read when no endpoint is configured.
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// How a daemon sets up tracing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// `service.name` resource attribute, e.g. [`SERVICE_REPLICA`].
    pub service_name: String,
    /// `service.instance.id` resource attribute (replica or agent identity), if any.
    pub instance_id: Option<String>,
    /// OTLP/gRPC collector, e.g. `http://127.0.0.1:4317`. `None` falls back to
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`; neither set means no export. Only `http://` is supported.
    pub otlp_endpoint: Option<String>,
    /// Filter directives used when `RUST_LOG` is unset or empty.
    pub default_filter: String,
    /// Deadline of one OTLP export call.
    pub export_timeout: Duration,
    /// Longest the final flush may take.
    pub shutdown_timeout: Duration,
    /// Colour codes in the stderr output.
    pub ansi: bool,
}

impl TelemetryConfig {
    /// Logs at `info`, no OTLP export unless the environment names an endpoint.
    pub fn new(service_name: impl Into<String>) -> Self {
        Self {
            service_name: service_name.into(),
            instance_id: None,
            otlp_endpoint: None,
            default_filter: "info".to_owned(),
            export_timeout: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(5),
            ansi: false,
        }
    }

    /// [`Self::new`] for the replica's service name.
    pub fn replica() -> Self {
        Self::new(SERVICE_REPLICA)
    }

    /// [`Self::new`] for the agent's service name.
    pub fn agent() -> Self {
        Self::new(SERVICE_AGENT)
    }

    /// Exports spans to this OTLP/gRPC endpoint.
    pub fn with_otlp_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.otlp_endpoint = Some(endpoint.into());
        self
    }

    /// Sets the `service.instance.id` resource attribute.
    pub fn with_instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance_id = Some(id.into());
        self
    }

    /// The endpoint export will use: the configured one, else the environment's, else none.
    pub fn resolved_otlp_endpoint(&self) -> Option<String> {
        self.otlp_endpoint
            .clone()
            .filter(|e| !e.trim().is_empty())
            .or_else(|| {
                std::env::var(OTLP_ENDPOINT_ENV)
                    .ok()
                    .filter(|e| !e.trim().is_empty())
            })
            .map(|e| e.trim().to_owned())
    }
}

/// Why tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The log filter does not parse.
    #[error("log filter from {source_name} is invalid: {message}")]
    Filter {
        /// `RUST_LOG` or `TelemetryConfig.default_filter`.
        source_name: &'static str,
        /// The parser's message.
        message: String,
    },
    /// The OTLP endpoint is not a usable URL.
    #[error("OTLP endpoint {endpoint:?}: {message}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        message: String,
    },
    /// Export was asked for outside a Tokio runtime.
    #[error(
        "OTLP export to {endpoint:?} needs a Tokio runtime: call telemetry init from inside the runtime"
    )]
    NoRuntime {
        /// The configured endpoint.
        endpoint: String,
    },
    /// The OTLP exporter could not be built.
    #[error("OTLP exporter for {endpoint:?} could not be built: {message}")]
    Exporter {
        /// The configured endpoint.
        endpoint: String,
        /// The exporter's message.
        message: String,
    },
    /// Another global subscriber was installed first.
    #[error("a global tracing subscriber is already installed: {0}")]
    AlreadyInitialized(String),
    /// The final span flush failed.
    #[error("flushing spans failed: {0}")]
    Flush(String),
}

/// Keeps span export alive; flushes and shuts the exporter down when shut down or dropped.
#[derive(Debug)]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
    endpoint: Option<String>,
    shutdown_timeout: Duration,
}

impl TelemetryGuard {
    /// Whether spans are exported over OTLP.
    pub fn otlp_enabled(&self) -> bool {
        self.provider.is_some()
    }

    /// The collector spans go to, when exporting.
    pub fn otlp_endpoint(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// Exports every finished span now. Safe on any runtime flavour.
    pub async fn flush(&self) -> Result<(), TelemetryError> {
        let Some(p) = self.provider.clone() else {
            return Ok(());
        };
        // The SDK blocks until its batch thread has exported; that thread needs the runtime's
        // I/O, so never block a runtime thread on it.
        tokio::task::spawn_blocking(move || p.force_flush())
            .await
            .map_err(|e| TelemetryError::Flush(e.to_string()))?
            .map_err(|e| TelemetryError::Flush(e.to_string()))
    }

    /// Flushes and stops export. Safe on any runtime flavour.
    pub async fn shutdown(mut self) -> Result<(), TelemetryError> {
        let Some(p) = self.provider.take() else {
            return Ok(());
        };
        let t = self.shutdown_timeout;
        tokio::task::spawn_blocking(move || p.shutdown_with_timeout(t))
            .await
            .map_err(|e| TelemetryError::Flush(e.to_string()))?
            .map_err(|e| TelemetryError::Flush(e.to_string()))
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        let Some(p) = self.provider.take() else {
            return;
        };
        let t = self.shutdown_timeout;
        let run = move || {
            if let Err(e) = p.shutdown_with_timeout(t) {
                eprintln!("dramesh-telemetry: flushing spans on shutdown failed: {e}");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(run)
            }
            // On a current-thread runtime this thread drives the channel, so the flush can only
            // time out; it is still attempted so the exporter stops cleanly.
            _ => run(),
        }
    }
}

/// A subscriber installed for the current thread only (see [`init_for_tests`]).
#[derive(Debug)]
pub struct ScopedTelemetry {
    // Field order matters: the subscriber is uninstalled before the exporter is flushed.
    _default: tracing::subscriber::DefaultGuard,
    /// Flushes the exporter when dropped.
    pub guard: TelemetryGuard,
}

impl ScopedTelemetry {
    /// Uninstalls the subscriber, then flushes and stops export.
    pub async fn shutdown(self) -> Result<(), TelemetryError> {
        let ScopedTelemetry { _default, guard } = self;
        drop(_default);
        guard.shutdown().await
    }
}

/// Installs the process-wide subscriber (also forwarding `log` records). Call once, early in
/// `main`, inside the Tokio runtime when OTLP export may be on; keep the guard until exit.
pub fn init(cfg: &TelemetryConfig) -> Result<TelemetryGuard, TelemetryError> {
    let (subscriber, guard) = build(cfg, false)?;
    if let Some(p) = &guard.provider {
        opentelemetry::global::set_tracer_provider(p.clone());
    }
    subscriber
        .try_init()
        .map_err(|e| TelemetryError::AlreadyInitialized(e.to_string()))?;
    Ok(guard)
}

/// Installs a subscriber for the current thread until the returned value is dropped; output goes
/// through the test harness's capture. Tests can each call this without conflicting. Spans made
/// on other threads (tasks on other runtime workers) are not seen.
pub fn init_for_tests(cfg: &TelemetryConfig) -> Result<ScopedTelemetry, TelemetryError> {
    let (subscriber, guard) = build(cfg, true)?;
    let default = tracing::subscriber::set_default(subscriber);
    Ok(ScopedTelemetry {
        _default: default,
        guard,
    })
}

/// The subscriber [`init`] installs, for callers that install it themselves.
pub fn subscriber(
    cfg: &TelemetryConfig,
) -> Result<(impl Subscriber + Send + Sync + 'static, TelemetryGuard), TelemetryError> {
    build(cfg, false)
}

fn build(
    cfg: &TelemetryConfig,
    test_writer: bool,
) -> Result<(impl Subscriber + Send + Sync + 'static, TelemetryGuard), TelemetryError> {
    let filter = env_filter(cfg)?;
    let writer = if test_writer {
        BoxMakeWriter::new(tracing_subscriber::fmt::TestWriter::new())
    } else {
        BoxMakeWriter::new(std::io::stderr)
    };
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(cfg.ansi)
        .with_filter(filter);

    let endpoint = cfg.resolved_otlp_endpoint();
    let (otel, provider) = match &endpoint {
        None => (None, None),
        Some(ep) => {
            let provider = tracer_provider(cfg, ep)?;
            let tracer = provider.tracer("dramesh");
            let layer = tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                    exported(meta.target(), *meta.level())
                }));
            (Some(layer), Some(provider))
        }
    };
    let subscriber = tracing_subscriber::registry().with(fmt).with(otel);
    Ok((
        subscriber,
        TelemetryGuard {
            provider,
            endpoint,
            shutdown_timeout: cfg.shutdown_timeout,
        },
    ))
}

fn env_filter(cfg: &TelemetryConfig) -> Result<EnvFilter, TelemetryError> {
    match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(s) if !s.trim().is_empty() => {
            EnvFilter::try_new(&s).map_err(|e| TelemetryError::Filter {
                source_name: "RUST_LOG",
                message: e.to_string(),
            })
        }
        _ => EnvFilter::try_new(&cfg.default_filter).map_err(|e| TelemetryError::Filter {
            source_name: "TelemetryConfig.default_filter",
            message: e.to_string(),
        }),
    }
}

fn is_export_path(target: &str) -> bool {
    ["h2", "hyper", "tonic", "tower", "opentelemetry"]
        .iter()
        .any(|p| target.starts_with(p))
}

/// Whether spans and events of `target` at `level` go to the OTLP exporter.
fn exported(target: &str, level: tracing::Level) -> bool {
    if is_export_path(target) {
        return false;
    }
    // Levels order by verbosity: ERROR < WARN < INFO < DEBUG < TRACE.
    if target.starts_with("dramesh") {
        level <= tracing::Level::INFO
    } else {
        level <= tracing::Level::WARN
    }
}

fn tracer_provider(cfg: &TelemetryConfig, ep: &str) -> Result<SdkTracerProvider, TelemetryError> {
    if !ep.starts_with("http://") {
        return Err(TelemetryError::Endpoint {
            endpoint: ep.to_owned(),
            message: "only plaintext http:// OTLP/gRPC endpoints are supported (no TLS support is built in)".to_owned(),
        });
    }
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(TelemetryError::NoRuntime {
            endpoint: ep.to_owned(),
        });
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(ep)
        .with_timeout(cfg.export_timeout)
        .build()
        .map_err(|e| TelemetryError::Exporter {
            endpoint: ep.to_owned(),
            message: e.to_string(),
        })?;
    let mut resource = Resource::builder()
        .with_service_name(cfg.service_name.clone())
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    if let Some(id) = &cfg.instance_id {
        resource = resource.with_attribute(KeyValue::new("service.instance.id", id.clone()));
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_endpoint_wins_and_blank_means_none() {
        let cfg = TelemetryConfig::replica().with_otlp_endpoint("  http://127.0.0.1:4317 ");
        assert_eq!(
            cfg.resolved_otlp_endpoint().as_deref(),
            Some("http://127.0.0.1:4317")
        );
        assert_eq!(cfg.service_name, SERVICE_REPLICA);
        assert_eq!(TelemetryConfig::agent().service_name, SERVICE_AGENT);
    }

    #[test]
    fn no_endpoint_means_no_export_and_no_runtime_needed() {
        let mut cfg = TelemetryConfig::agent();
        // An explicit blank endpoint only disables export if the environment has none either.
        if std::env::var(OTLP_ENDPOINT_ENV).is_ok_and(|v| !v.trim().is_empty()) {
            eprintln!("skipping: {OTLP_ENDPOINT_ENV} is set in this environment");
            return;
        }
        cfg.otlp_endpoint = Some(String::new());
        let scoped = init_for_tests(&cfg).unwrap();
        assert!(!scoped.guard.otlp_enabled());
        assert_eq!(scoped.guard.otlp_endpoint(), None);
    }

    #[test]
    fn https_endpoint_is_refused_with_reason() {
        let cfg = TelemetryConfig::agent().with_otlp_endpoint("https://collector:4317");
        let err = init_for_tests(&cfg).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("https://collector:4317") && msg.contains("http://"),
            "{msg}"
        );
    }

    #[test]
    fn export_outside_runtime_is_an_error_not_a_panic() {
        let cfg = TelemetryConfig::agent().with_otlp_endpoint("http://127.0.0.1:4317");
        let err = init_for_tests(&cfg).unwrap_err();
        assert!(matches!(err, TelemetryError::NoRuntime { .. }), "{err}");
    }

    #[test]
    fn export_filter_keeps_dramesh_info_and_drops_its_own_path() {
        use tracing::Level;
        assert!(exported("dramesh_telemetry::spans", Level::INFO));
        assert!(!exported("dramesh_api::grpc", Level::DEBUG));
        assert!(!exported("quinn_proto::connection", Level::INFO));
        assert!(exported("quinn_proto::connection", Level::WARN));
        assert!(!exported("tonic::transport", Level::ERROR));
    }

    #[test]
    fn bad_default_filter_names_its_source() {
        if std::env::var("RUST_LOG").is_ok_and(|v| !v.trim().is_empty()) {
            eprintln!("skipping: RUST_LOG is set in this environment");
            return;
        }
        let mut cfg = TelemetryConfig::agent();
        cfg.default_filter = "foo=notalevel".into();
        let err = init_for_tests(&cfg).unwrap_err();
        assert!(
            err.to_string().contains("TelemetryConfig.default_filter"),
            "{err}"
        );
    }
}
