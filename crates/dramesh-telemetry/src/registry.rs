//! A small metrics registry rendering the Prometheus text exposition format, version 0.0.4.
//!
//! Guarantees:
//! - metric and label names are validated when a family is registered, and a name is registered at
//!   most once per [`Registry`];
//! - rendered output is deterministic: families in registration order, series sorted by label
//!   values, labels in declaration order;
//! - label values and HELP text are escaped as the format requires (`\\`, `\"`, `\n`);
//! - histogram buckets are rendered cumulatively, always end with `le="+Inf"`, and `_count` equals
//!   the `+Inf` bucket because both come from one locked snapshot;
//! - the number of series per family is bounded ([`DEFAULT_MAX_SERIES`]); label values past the
//!   bound land in an unrendered overflow cell and are counted in
//!   `dramesh_telemetry_series_dropped_total{metric}`, so a peer that invents label values (peer
//!   names, reasons) cannot grow memory without limit. Label values are also truncated to
//!   [`MAX_LABEL_VALUE_BYTES`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Series a family keeps before further label combinations are dropped.
pub const DEFAULT_MAX_SERIES: usize = 4096;
/// Longest label value kept, in bytes; longer values are cut at a character boundary.
pub const MAX_LABEL_VALUE_BYTES: usize = 256;
/// The content type a `/metrics` endpoint serves this format with.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const DROPPED_NAME: &str = "dramesh_telemetry_series_dropped_total";

/// Why a metric family could not be registered.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MetricsError {
    #[error("metric name {name:?} is invalid: must match [a-zA-Z_:][a-zA-Z0-9_:]*")]
    /// The family name is not a Prometheus metric name.
    InvalidMetricName {
        /// The name given.
        name: String,
    },
    #[error(
        "metric {metric:?}: label name {label:?} is invalid: must match [a-zA-Z_][a-zA-Z0-9_]*, not start with \"__\", and not be \"le\" on a histogram"
    )]
    /// A label name is not a Prometheus label name.
    InvalidLabelName {
        /// The family.
        metric: String,
        /// The label name given.
        label: String,
    },
    #[error("metric {metric:?}: label name {label:?} is declared twice")]
    /// A label name appears twice.
    DuplicateLabel {
        /// The family.
        metric: String,
        /// The repeated label name.
        label: String,
    },
    #[error("metric {name:?} is already registered")]
    /// A family of this name exists.
    AlreadyRegistered {
        /// The name given.
        name: String,
    },
    #[error(
        "histogram {metric:?}: buckets must be non-empty, finite and strictly increasing (got {buckets:?})"
    )]
    /// Histogram buckets are empty, not finite or not increasing.
    InvalidBuckets {
        /// The family.
        metric: String,
        /// The buckets given.
        buckets: Vec<f64>,
    },
}

/// One kind of metric value: counter, gauge or histogram.
pub trait Metric: Send + Sync + 'static {
    /// The `# TYPE` keyword.
    const TYPE: &'static str;
    /// What every series of a family is created from (histogram bucket bounds).
    type Config: Clone + Send + Sync + 'static;
    /// A zeroed value.
    fn new(config: &Self::Config) -> Self;
    /// Appends this series' sample lines. `labels` is the already escaped `k="v",...` list
    /// without braces, possibly empty.
    fn encode(&self, name: &str, labels: &str, out: &mut String);
}

/// A monotonically increasing integer count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    /// Adds `n`.
    pub fn inc_by(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// The current total.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Metric for Counter {
    const TYPE: &'static str = "counter";
    type Config = ();
    fn new(_: &()) -> Self {
        Self::default()
    }
    fn encode(&self, name: &str, labels: &str, out: &mut String) {
        write_sample(out, name, "", labels, None, &self.get().to_string());
    }
}

/// A value that can go up and down.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    /// Sets the value.
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }
    /// Adds `delta` (negative to subtract).
    pub fn add(&self, delta: f64) {
        // fetch_update retries on contention; the closure never returns None.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + delta).to_bits())
            });
    }
    /// Adds one.
    pub fn inc(&self) {
        self.add(1.0);
    }
    /// Subtracts one.
    pub fn dec(&self) {
        self.add(-1.0);
    }
    /// The current value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

impl Metric for Gauge {
    const TYPE: &'static str = "gauge";
    type Config = ();
    fn new(_: &()) -> Self {
        Self::default()
    }
    fn encode(&self, name: &str, labels: &str, out: &mut String) {
        write_sample(out, name, "", labels, None, &fmt_f64(self.get()));
    }
}

/// Bucketed observations with their sum and count.
#[derive(Debug)]
pub struct Histogram {
    bounds: Arc<[f64]>,
    state: Mutex<HistogramState>,
}

#[derive(Debug)]
struct HistogramState {
    /// Per-bucket (not cumulative) counts; the last slot is the +Inf bucket.
    counts: Vec<u64>,
    sum: f64,
}

/// A consistent copy of a histogram's state, buckets cumulative.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound, cumulative count)`, ending with `(+Inf, count)`.
    pub buckets: Vec<(f64, u64)>,
    /// Sum of all observations.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
}

impl Histogram {
    /// Records one observation. NaN is ignored because it would poison `_sum` forever.
    pub fn observe(&self, v: f64) {
        if v.is_nan() {
            return;
        }
        let idx = self.bounds.partition_point(|b| *b < v);
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.counts[idx] += 1;
        s.sum += v;
    }

    /// The current state, taken under one lock.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut cum = 0u64;
        let mut buckets = Vec::with_capacity(s.counts.len());
        for (i, c) in s.counts.iter().enumerate() {
            cum += c;
            buckets.push((self.bounds.get(i).copied().unwrap_or(f64::INFINITY), cum));
        }
        HistogramSnapshot {
            buckets,
            sum: s.sum,
            count: cum,
        }
    }
}

impl Metric for Histogram {
    const TYPE: &'static str = "histogram";
    type Config = Arc<[f64]>;
    fn new(bounds: &Arc<[f64]>) -> Self {
        Self {
            bounds: bounds.clone(),
            state: Mutex::new(HistogramState {
                counts: vec![0; bounds.len() + 1],
                sum: 0.0,
            }),
        }
    }
    fn encode(&self, name: &str, labels: &str, out: &mut String) {
        let snap = self.snapshot();
        for (le, c) in &snap.buckets {
            write_sample(
                out,
                name,
                "_bucket",
                labels,
                Some(&fmt_f64(*le)),
                &c.to_string(),
            );
        }
        write_sample(out, name, "_sum", labels, None, &fmt_f64(snap.sum));
        write_sample(out, name, "_count", labels, None, &snap.count.to_string());
    }
}

/// All series of one metric name, keyed by their label values.
pub struct Family<M: Metric, const N: usize> {
    name: String,
    help: String,
    label_names: [&'static str; N],
    config: M::Config,
    max_series: usize,
    series: RwLock<BTreeMap<[String; N], Arc<M>>>,
    overflow: Arc<M>,
    dropped: AtomicU64,
}

/// A counter family with `N` labels.
pub type CounterVec<const N: usize> = Family<Counter, N>;
/// A gauge family with `N` labels.
pub type GaugeVec<const N: usize> = Family<Gauge, N>;
/// A histogram family with `N` labels.
pub type HistogramVec<const N: usize> = Family<Histogram, N>;

impl<M: Metric, const N: usize> Family<M, N> {
    /// The family name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The label names, in series-key order.
    pub fn label_names(&self) -> &[&'static str; N] {
        &self.label_names
    }

    /// The series for these label values (in declaration order), created on first use. Callers on
    /// hot paths may keep the returned handle. Past the series bound the shared overflow cell is
    /// returned, which is never rendered.
    pub fn with(&self, values: [&str; N]) -> Arc<M> {
        let key = values.map(|v| truncate(v, MAX_LABEL_VALUE_BYTES));
        if let Some(m) = self.get_truncated(&key) {
            return m;
        }
        let mut w = self.series.write().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = w.get(&key as &dyn LabelKey) {
            return m.clone();
        }
        if w.len() >= self.max_series {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return self.overflow.clone();
        }
        let m = Arc::new(M::new(&self.config));
        w.insert(key.map(str::to_owned), m.clone());
        m
    }

    /// The series for these label values if it exists (never creates one).
    pub fn get(&self, values: [&str; N]) -> Option<Arc<M>> {
        self.get_truncated(&values.map(|v| truncate(v, MAX_LABEL_VALUE_BYTES)))
    }

    /// Looks a series up by borrowed label values, so recording into an existing series
    /// (every hot-path call after the first) allocates nothing.
    fn get_truncated(&self, key: &[&str; N]) -> Option<Arc<M>> {
        self.series
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(key as &dyn LabelKey)
            .cloned()
    }

    /// Calls `f` with every rendered series, in label-value order.
    pub fn for_each(&self, mut f: impl FnMut(&[String; N], &M)) {
        for (k, m) in self.series.read().unwrap_or_else(|e| e.into_inner()).iter() {
            f(k, m);
        }
    }

    /// Forgets one series (a peer that left, a cluster that was removed). Returns whether it existed.
    pub fn remove(&self, values: [&str; N]) -> bool {
        let key = values.map(|v| truncate(v, MAX_LABEL_VALUE_BYTES));
        self.series
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key as &dyn LabelKey)
            .is_some()
    }

    /// Keeps only the series whose label values satisfy `keep`.
    pub fn retain(&self, mut keep: impl FnMut(&[String; N]) -> bool) {
        self.series
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|k, _| keep(k));
    }

    /// Number of series currently rendered.
    pub fn len(&self) -> usize {
        self.series.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether the family has no series yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Label combinations refused because the family was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

trait Collect: Send + Sync {
    fn name(&self) -> &str;
    fn encode(&self, out: &mut String);
    fn dropped(&self) -> u64;
}

impl<M: Metric, const N: usize> Collect for Family<M, N> {
    fn name(&self) -> &str {
        &self.name
    }
    fn encode(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP {} {}", self.name, escape_help(&self.help));
        let _ = writeln!(out, "# TYPE {} {}", self.name, M::TYPE);
        let series = self.series.read().unwrap_or_else(|e| e.into_inner());
        let mut labels = String::new();
        for (values, m) in series.iter() {
            labels.clear();
            for (i, (k, v)) in self.label_names.iter().zip(values.iter()).enumerate() {
                if i > 0 {
                    labels.push(',');
                }
                labels.push_str(k);
                labels.push_str("=\"");
                escape_label_value_into(v, &mut labels);
                labels.push('"');
            }
            m.encode(&self.name, &labels, out);
        }
    }
    fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// A set of metric families rendered together.
pub struct Registry {
    families: RwLock<Vec<Arc<dyn Collect>>>,
    max_series: usize,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fams = self.families.read().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("Registry")
            .field(
                "families",
                &fams.iter().map(|c| c.name()).collect::<Vec<_>>(),
            )
            .field("max_series", &self.max_series)
            .finish()
    }
}

impl Registry {
    /// A registry keeping at most `DEFAULT_MAX_SERIES` series per family.
    pub fn new() -> Self {
        Self::with_max_series(DEFAULT_MAX_SERIES)
    }

    /// A registry whose families each keep at most `max_series` series (at least 1).
    pub fn with_max_series(max_series: usize) -> Self {
        Self {
            families: RwLock::new(Vec::new()),
            max_series: max_series.max(1),
        }
    }

    /// Registers a counter family.
    pub fn counter_vec<const N: usize>(
        &self,
        name: &str,
        help: &str,
        labels: [&'static str; N],
    ) -> Result<Arc<CounterVec<N>>, MetricsError> {
        self.register(name, help, labels, ())
    }

    /// Registers a gauge family.
    pub fn gauge_vec<const N: usize>(
        &self,
        name: &str,
        help: &str,
        labels: [&'static str; N],
    ) -> Result<Arc<GaugeVec<N>>, MetricsError> {
        self.register(name, help, labels, ())
    }

    /// `buckets` are the finite upper bounds; `+Inf` is implicit.
    pub fn histogram_vec<const N: usize>(
        &self,
        name: &str,
        help: &str,
        labels: [&'static str; N],
        buckets: &[f64],
    ) -> Result<Arc<HistogramVec<N>>, MetricsError> {
        let ok = !buckets.is_empty()
            && buckets.iter().all(|b| b.is_finite())
            && buckets.windows(2).all(|w| w[0] < w[1]);
        if !ok {
            return Err(MetricsError::InvalidBuckets {
                metric: name.to_owned(),
                buckets: buckets.to_vec(),
            });
        }
        if labels.contains(&"le") {
            return Err(MetricsError::InvalidLabelName {
                metric: name.to_owned(),
                label: "le".to_owned(),
            });
        }
        self.register(name, help, labels, Arc::from(buckets))
    }

    /// An unlabelled counter; its single series is rendered from registration on.
    pub fn counter(&self, name: &str, help: &str) -> Result<Arc<Counter>, MetricsError> {
        Ok(self.counter_vec(name, help, [])?.with([]))
    }

    /// An unlabelled gauge; its single series is rendered from registration on.
    pub fn gauge(&self, name: &str, help: &str) -> Result<Arc<Gauge>, MetricsError> {
        Ok(self.gauge_vec(name, help, [])?.with([]))
    }

    /// An unlabelled histogram; its single series is rendered from registration on.
    pub fn histogram(
        &self,
        name: &str,
        help: &str,
        buckets: &[f64],
    ) -> Result<Arc<Histogram>, MetricsError> {
        Ok(self.histogram_vec(name, help, [], buckets)?.with([]))
    }

    fn register<M: Metric, const N: usize>(
        &self,
        name: &str,
        help: &str,
        labels: [&'static str; N],
        config: M::Config,
    ) -> Result<Arc<Family<M, N>>, MetricsError> {
        if !valid_metric_name(name) || name == DROPPED_NAME {
            return Err(MetricsError::InvalidMetricName {
                name: name.to_owned(),
            });
        }
        for (i, l) in labels.iter().enumerate() {
            if !valid_label_name(l) {
                return Err(MetricsError::InvalidLabelName {
                    metric: name.to_owned(),
                    label: (*l).to_owned(),
                });
            }
            if labels[..i].contains(l) {
                return Err(MetricsError::DuplicateLabel {
                    metric: name.to_owned(),
                    label: (*l).to_owned(),
                });
            }
        }
        let mut fams = self.families.write().unwrap_or_else(|e| e.into_inner());
        if fams.iter().any(|f| f.name() == name) {
            return Err(MetricsError::AlreadyRegistered {
                name: name.to_owned(),
            });
        }
        let fam = Arc::new(Family {
            name: name.to_owned(),
            help: help.to_owned(),
            label_names: labels,
            overflow: Arc::new(M::new(&config)),
            config,
            max_series: self.max_series,
            series: RwLock::new(BTreeMap::new()),
            dropped: AtomicU64::new(0),
        });
        fams.push(fam.clone());
        Ok(fam)
    }

    /// The whole registry in text exposition format 0.0.4.
    pub fn render(&self) -> String {
        let fams = self.families.read().unwrap_or_else(|e| e.into_inner());
        let mut out = String::with_capacity(4096);
        for f in fams.iter() {
            f.encode(&mut out);
        }
        let _ = writeln!(
            out,
            "# HELP {DROPPED_NAME} Label combinations not recorded because the metric reached its series limit."
        );
        let _ = writeln!(out, "# TYPE {DROPPED_NAME} counter");
        let mut labels = String::new();
        for f in fams.iter().filter(|f| f.dropped() > 0) {
            labels.clear();
            labels.push_str("metric=\"");
            escape_label_value_into(f.name(), &mut labels);
            labels.push('"');
            write_sample(
                &mut out,
                DROPPED_NAME,
                "",
                &labels,
                None,
                &f.dropped().to_string(),
            );
        }
        out
    }
}

fn write_sample(
    out: &mut String,
    name: &str,
    suffix: &str,
    labels: &str,
    le: Option<&str>,
    value: &str,
) {
    out.push_str(name);
    out.push_str(suffix);
    match (labels.is_empty(), le) {
        (true, None) => {}
        (false, None) => {
            out.push('{');
            out.push_str(labels);
            out.push('}');
        }
        (true, Some(le)) => {
            let _ = write!(out, "{{le=\"{le}\"}}");
        }
        (false, Some(le)) => {
            let _ = write!(out, "{{{labels},le=\"{le}\"}}");
        }
    }
    out.push(' ');
    out.push_str(value);
    out.push('\n');
}

/// Formats a sample value or bucket bound the way the format spells special values.
pub fn fmt_f64(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v == f64::INFINITY {
        "+Inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        // Display never uses exponent notation and round-trips exactly.
        format!("{v}")
    }
}

/// Escapes a label value: backslash, double quote and line feed.
pub fn escape_label_value(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    escape_label_value_into(v, &mut s);
    s
}

fn escape_label_value_into(v: &str, out: &mut String) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn escape_help(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// Label values as a series key: owned (`[String; N]`, stored in the map) or borrowed
/// (`[&str; N]`, looked up). Both compare value by value as `[String; N]` does, which is what
/// lets the map find a stored key from borrowed values without allocating.
trait LabelKey {
    fn arity(&self) -> usize;
    fn value(&self, i: usize) -> &str;
}

impl<const N: usize> LabelKey for [String; N] {
    fn arity(&self) -> usize {
        N
    }
    fn value(&self, i: usize) -> &str {
        &self[i]
    }
}

impl<const N: usize> LabelKey for [&str; N] {
    fn arity(&self) -> usize {
        N
    }
    fn value(&self, i: usize) -> &str {
        self[i]
    }
}

impl Ord for dyn LabelKey + '_ {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let a = (0..self.arity()).map(|i| self.value(i));
        a.cmp((0..other.arity()).map(|i| other.value(i)))
    }
}

impl PartialOrd for dyn LabelKey + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for dyn LabelKey + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for dyn LabelKey + '_ {}

impl<'a, const N: usize> std::borrow::Borrow<dyn LabelKey + 'a> for [String; N] {
    fn borrow(&self) -> &(dyn LabelKey + 'a) {
        self
    }
}

fn truncate(v: &str, max: usize) -> &str {
    if v.len() <= max {
        return v;
    }
    let mut end = max;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    &v[..end]
}

fn valid_metric_name(n: &str) -> bool {
    let mut chars = n.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(n: &str) -> bool {
    let mut chars = n.chars();
    !n.starts_with("__")
        && matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_names_and_duplicates() {
        let r = Registry::new();
        assert!(matches!(
            r.counter_vec("1bad", "h", []),
            Err(MetricsError::InvalidMetricName { .. })
        ));
        assert!(matches!(
            r.counter_vec("ok_total", "h", ["__x"]),
            Err(MetricsError::InvalidLabelName { .. })
        ));
        assert!(matches!(
            r.counter_vec("ok_total", "h", ["a", "a"]),
            Err(MetricsError::DuplicateLabel { .. })
        ));
        assert!(matches!(
            r.histogram_vec("h_seconds", "h", ["le"], &[1.0]),
            Err(MetricsError::InvalidLabelName { .. })
        ));
        assert!(matches!(
            r.histogram("h2_seconds", "h", &[2.0, 1.0]),
            Err(MetricsError::InvalidBuckets { .. })
        ));
        assert!(r.counter_vec("ok_total", "h", ["a"]).is_ok());
        assert_eq!(
            r.gauge("ok_total", "h").err(),
            Some(MetricsError::AlreadyRegistered {
                name: "ok_total".into()
            })
        );
    }

    #[test]
    fn escaping_and_special_values() {
        assert_eq!(escape_label_value("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
        assert_eq!(escape_help("x\\y\nz\""), "x\\\\y\\nz\"");
        assert_eq!(fmt_f64(f64::INFINITY), "+Inf");
        assert_eq!(fmt_f64(f64::NEG_INFINITY), "-Inf");
        assert_eq!(fmt_f64(f64::NAN), "NaN");
        assert_eq!(fmt_f64(0.005), "0.005");
        assert_eq!(fmt_f64(3.0), "3");
    }

    #[test]
    fn histogram_bucket_boundaries_are_inclusive() {
        let r = Registry::new();
        let h = r.histogram("x", "h", &[1.0, 2.0]).unwrap();
        for v in [0.5, 1.0, 1.5, 2.0, 3.0, f64::NAN] {
            h.observe(v);
        }
        let s = h.snapshot();
        assert_eq!(
            s.buckets,
            vec![(1.0, 2), (2.0, 4), (f64::INFINITY, 5)],
            "le is an inclusive upper bound; NaN is ignored"
        );
        assert_eq!(s.count, 5);
        assert_eq!(s.sum, 8.0);
    }

    #[test]
    fn series_limit_drops_and_reports() {
        let r = Registry::with_max_series(2);
        let c = r.counter_vec("c_total", "h", ["peer"]).unwrap();
        c.with(["a"]).inc();
        c.with(["b"]).inc();
        c.with(["c"]).inc_by(5);
        c.with(["a"]).inc();
        assert_eq!(c.len(), 2);
        assert_eq!(c.dropped(), 1);
        let text = r.render();
        assert!(text.contains("c_total{peer=\"a\"} 2\n"), "{text}");
        assert!(!text.contains("peer=\"c\""), "{text}");
        assert!(
            text.contains("dramesh_telemetry_series_dropped_total{metric=\"c_total\"} 1\n"),
            "{text}"
        );
        assert!(c.remove(["a"]));
        assert!(!c.remove(["a"]));
        c.with(["d"]).inc();
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn long_label_values_are_truncated_on_char_boundary() {
        let r = Registry::new();
        let g = r.gauge_vec("g", "h", ["peer"]).unwrap();
        let long = "é".repeat(MAX_LABEL_VALUE_BYTES); // 2 bytes each
        g.with([&long]).set(1.0);
        let text = r.render();
        let line = text.lines().find(|l| l.starts_with("g{")).unwrap();
        let value = line
            .trim_start_matches("g{peer=\"")
            .split('"')
            .next()
            .unwrap();
        assert_eq!(value.len(), MAX_LABEL_VALUE_BYTES);
        assert!(value.chars().all(|c| c == 'é'));
    }

    #[test]
    fn borrowed_lookups_find_stored_series() {
        let r = Registry::new();
        let c = r.counter_vec("c", "h", ["a", "b"]).unwrap();
        // Keys that differ only past the first value, and a prefix key, must stay distinct.
        for (a, b) in [("x", "2"), ("x", "10"), ("xy", ""), ("", "x")] {
            c.with([a, b]).inc();
        }
        assert!(Arc::ptr_eq(&c.with(["x", "2"]), &c.with(["x", "2"])));
        assert_eq!(c.len(), 4);
        assert_eq!(c.get(["x", "10"]).map(|m| m.get()), Some(1));
        assert!(c.get(["x", "3"]).is_none());
        let long = "v".repeat(MAX_LABEL_VALUE_BYTES + 9);
        c.with([&long, "b"]).inc_by(2);
        assert_eq!(
            c.get([&long[..MAX_LABEL_VALUE_BYTES], "b"])
                .map(|m| m.get()),
            Some(2)
        );
        assert!(c.remove(["xy", ""]) && !c.remove(["xy", ""]));
        let mut order = Vec::new();
        c.for_each(|k, _| order.push(k.clone()));
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(order, sorted, "stored order is the owned keys' order");
    }

    #[test]
    fn gauge_add_is_atomic_across_threads() {
        let g = Arc::new(Gauge::default());
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let g = g.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        g.inc();
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(g.get(), 4000.0);
    }
}
