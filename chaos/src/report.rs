//! Figures per scenario (convergence time after heal, queries answered during the fault and
//! their latency, bytes exchanged) and the run's table, written as Markdown and JSON.
//!
//! Guarantees: percentiles use the nearest-rank method over answered queries inside the fault
//! window only; a figure that could not be measured is `null`/`-`, never zero.

use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use crate::checker::{QueryOutcome, QueryRecord, Violation, Window};

/// Everything known about one scenario's run.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioResult {
    /// Scenario name.
    pub name: String,
    /// What the scenario does.
    pub about: String,
    /// Workload seed.
    pub seed: u64,
    /// Whether every check passed.
    pub passed: bool,
    /// Changes the workload wrote.
    pub writes: usize,
    /// Time until the fleet first converged.
    pub warmup_s: Option<f64>,
    /// Time from the end of the fault until the replicas converged.
    pub converge_s: Option<f64>,
    /// Length of the fault window.
    pub fault_s: f64,
    /// Queries sent in the fault window.
    pub queries_in_fault: usize,
    /// Of those, queries answered.
    pub answered_in_fault: usize,
    /// Median answer latency in the fault window.
    pub latency_p50_ms: Option<f64>,
    /// 99th percentile answer latency in the fault window.
    pub latency_p99_ms: Option<f64>,
    /// Slowest answer in the fault window.
    pub latency_max_ms: Option<f64>,
    /// Largest data age reported in the fault window.
    pub max_data_age_s: Option<f64>,
    /// Bytes hosts sent to other hosts (iptables counters), fault start to convergence.
    pub mesh_bytes: Option<u64>,
    /// Bytes through all veths (harness queries included), same interval.
    pub veth_bytes: u64,
    /// Sum of replicas' `*bytes_sent*` metrics over the interval, when `/metrics` exists.
    pub metrics_bytes: Option<u64>,
    /// Violations of the final state check.
    pub state_violations: usize,
    /// Violations of the query check.
    pub query_violations: usize,
    /// Up to 50 violations, rendered.
    pub violations: Vec<String>,
    /// Remarks of the run (a warm-up that did not converge, what a fault did).
    pub notes: Vec<String>,
}

/// Inputs of [`summarize`].
pub struct Inputs<'a> {
    /// Scenario name.
    pub name: &'a str,
    /// What the scenario does.
    pub about: &'a str,
    /// Workload seed.
    pub seed: u64,
    /// Changes the workload wrote.
    pub writes: usize,
    /// Time until the fleet first converged.
    pub warmup_s: Option<f64>,
    /// Time from the end of the fault until the replicas converged.
    pub converge_s: Option<f64>,
    /// Every query sent.
    pub queries: &'a [QueryRecord],
    /// The fault window.
    pub fault: Window,
    /// See [`ScenarioResult::mesh_bytes`].
    pub mesh_bytes: Option<u64>,
    /// See [`ScenarioResult::veth_bytes`].
    pub veth_bytes: u64,
    /// See [`ScenarioResult::metrics_bytes`].
    pub metrics_bytes: Option<u64>,
    /// Every violation found.
    pub violations: &'a [Violation],
    /// Remarks of the run.
    pub notes: Vec<String>,
}

/// Nearest-rank percentile (`p` in 0..=100) of `v`, or `None` when empty.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s.get(rank.min(s.len()) - 1).copied()
}

/// Builds a scenario's figures.
pub fn summarize(i: Inputs<'_>) -> ScenarioResult {
    let in_fault: Vec<&QueryRecord> = i
        .queries
        .iter()
        .filter(|q| i.fault.contains(q.at_ms))
        .collect();
    let mut lat = Vec::new();
    let mut max_age: Option<f64> = None;
    for q in &in_fault {
        if let QueryOutcome::Answered { max_age_s, .. } = &q.outcome {
            lat.push(q.latency_ms);
            if let Some(a) = max_age_s {
                max_age = Some(max_age.map_or(*a, |m: f64| m.max(*a)));
            }
        }
    }
    let state_violations = i.violations.iter().filter(|v| v.is_state()).count();
    ScenarioResult {
        name: i.name.to_string(),
        about: i.about.to_string(),
        seed: i.seed,
        passed: i.violations.is_empty() && i.converge_s.is_some(),
        writes: i.writes,
        warmup_s: i.warmup_s,
        converge_s: i.converge_s,
        fault_s: i.fault.end_ms.saturating_sub(i.fault.start_ms) as f64 / 1000.0,
        queries_in_fault: in_fault.len(),
        answered_in_fault: lat.len(),
        latency_p50_ms: percentile(&lat, 50.0),
        latency_p99_ms: percentile(&lat, 99.0),
        latency_max_ms: percentile(&lat, 100.0),
        max_data_age_s: max_age,
        mesh_bytes: i.mesh_bytes,
        veth_bytes: i.veth_bytes,
        metrics_bytes: i.metrics_bytes,
        state_violations,
        query_violations: i.violations.len() - state_violations,
        violations: i
            .violations
            .iter()
            .take(50)
            .map(ToString::to_string)
            .collect(),
        notes: i.notes,
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

/// The run's table in Markdown.
pub fn table(results: &[ScenarioResult]) -> String {
    let mut s = String::from(
        "| scenario | seed | result | writes | converge s | queries answered | p99 ms | max age s | mesh bytes | metrics bytes | violations |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {}/{} | {} | {} | {} | {} | {} |\n",
            r.name,
            r.seed,
            if r.passed { "PASS" } else { "FAIL" },
            r.writes,
            opt(r.converge_s, 2),
            r.answered_in_fault,
            r.queries_in_fault,
            opt(r.latency_p99_ms, 1),
            opt(r.max_data_age_s, 1),
            r.mesh_bytes.map_or("-".into(), |b| b.to_string()),
            r.metrics_bytes.map_or("-".into(), |b| b.to_string()),
            r.state_violations + r.query_violations,
        ));
    }
    s
}

/// Writes `report.md` and `report.json` into `out`.
pub fn write(out: &Path, results: &[ScenarioResult]) -> Result<()> {
    let mut md = table(results);
    for r in results
        .iter()
        .filter(|r| !r.violations.is_empty() || !r.notes.is_empty())
    {
        md.push_str(&format!("\n## {}\n", r.name));
        for n in &r.notes {
            md.push_str(&format!("- note: {n}\n"));
        }
        for v in &r.violations {
            md.push_str(&format!("- {v}\n"));
        }
    }
    std::fs::write(out.join("report.md"), md)?;
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(results)?)?;
    Ok(())
}

/// Mesh bytes sent according to a replica's `/metrics`: the sum of the samples of
/// `dramesh_mesh_bytes_total` whose labels include `direction="sent"` (any label order, any
/// other labels such as `peer`), or else of any metric whose name contains `bytes_sent`;
/// `None` when neither is present.
pub fn mesh_bytes_sent(text: &str) -> Option<u64> {
    let labelled: Vec<&str> = text
        .lines()
        .filter(|l| {
            let name = l.split(['{', ' ']).next().unwrap_or_default();
            name == "dramesh_mesh_bytes_total" && l.contains("direction=\"sent\"")
        })
        .collect();
    if !labelled.is_empty() {
        return Some(sum_metric(&labelled.join("\n"), "dramesh_mesh_bytes_total"));
    }
    let fallback: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.split(['{', ' '])
                .next()
                .is_some_and(|n| n.contains("bytes_sent"))
        })
        .collect();
    (!fallback.is_empty()).then(|| sum_metric(&fallback.join("\n"), "bytes_sent"))
}

/// Sums Prometheus text samples whose metric name contains `needle`.
pub fn sum_metric(text: &str, needle: &str) -> u64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let name = parts.next()?;
            let metric = name.split('{').next()?;
            if !metric.contains(needle) {
                return None;
            }
            parts.next()?.parse::<f64>().ok().map(|v| v as u64)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&[3.0, 1.0], 100.0), Some(3.0));
        assert_eq!(percentile(&[], 99.0), None);
    }

    #[test]
    fn summary_counts_only_the_fault_window_and_fails_on_violations() {
        let q = |at, lat, ok: bool| QueryRecord {
            replica: "r1".into(),
            at_ms: at,
            latency_ms: lat,
            outcome: if ok {
                QueryOutcome::Answered {
                    clusters: 3,
                    min_age_s: Some(1.0),
                    max_age_s: Some(4.0),
                }
            } else {
                QueryOutcome::Failed("x".into())
            },
        };
        let qs = vec![q(0, 999.0, true), q(1500, 10.0, true), q(1600, 20.0, false)];
        let inputs = |v: &'static [Violation]| Inputs {
            name: "s",
            about: "",
            seed: 1,
            writes: 2,
            warmup_s: Some(1.0),
            converge_s: Some(0.5),
            queries: &qs,
            fault: Window {
                start_ms: 1000,
                end_ms: 2000,
            },
            mesh_bytes: Some(10),
            veth_bytes: 20,
            metrics_bytes: None,
            violations: v,
            notes: vec![],
        };
        let r = summarize(inputs(&[]));
        assert_eq!((r.queries_in_fault, r.answered_in_fault), (2, 1));
        assert_eq!(r.latency_p99_ms, Some(10.0));
        assert_eq!(r.max_data_age_s, Some(4.0));
        assert!(r.passed);
        static V: [Violation; 1] = [Violation::DigestMissing {
            replica: String::new(),
        }];
        let r = summarize(inputs(&V));
        assert!(!r.passed);
        assert_eq!(r.state_violations, 1);
        assert!(table(&[r]).contains("| s | 1 | FAIL |"));
    }

    #[test]
    fn metric_sums_match_names_with_labels() {
        let text = "# HELP x\ndramesh_mesh_bytes_sent_total{peer=\"r2\"} 100\n\
                    dramesh_mesh_bytes_sent_total{peer=\"r3\"} 50\nother_total 7\n";
        assert_eq!(sum_metric(text, "bytes_sent"), 150);
        assert_eq!(sum_metric(text, "nothing"), 0);
        assert_eq!(mesh_bytes_sent(text), Some(150), "fallback to *bytes_sent*");
        assert_eq!(mesh_bytes_sent("other_total 7\n"), None);
        let text = "dramesh_mesh_bytes_total{direction=\"sent\",peer=\"r2\"} 40\n\
                    dramesh_mesh_bytes_total{direction=\"received\",peer=\"r2\"} 99\n\
                    dramesh_mesh_bytes_total{peer=\"r3\",direction=\"sent\"} 2\n\
                    dramesh_mesh_bytes_total_created{direction=\"sent\"} 1e9\n";
        assert_eq!(mesh_bytes_sent(text), Some(42));
    }
}
