//! `dramesh estimate | place | preempt`: the estimator over a snapshot of member clusters.

use std::path::{Path, PathBuf};

use dramesh_estimator::{
    EstimateOptions, Estimator, Policy, Workload, load_snapshot, load_workload, place, preempt,
};
use dramesh_model::Manifest;

use crate::table::Table;
use crate::{Failure, Output};

/// Loads the snapshot and the workload, both of which must be valid (exit 2 otherwise).
fn inputs(
    snapshot: &Path,
    workload: &[PathBuf],
) -> Result<(dramesh_estimator::View, Workload), Failure> {
    let view = load_snapshot(snapshot).map_err(Failure::input)?;
    let w = load_workload(workload).map_err(Failure::input)?;
    Ok((view, w))
}

/// The policy from `--policy`, else one found beside the workload.
fn policy(path: Option<&Path>, w: &Workload) -> Result<Option<Policy>, Failure> {
    let Some(path) = path else {
        return Ok(w.policy.clone());
    };
    let loaded = dramesh_model::load::load_path(path).map_err(Failure::input)?;
    let mut found = None;
    for l in loaded {
        if let Manifest::Other { kind, value, .. } = &l.manifest
            && (kind == "PropagationPolicy" || kind == "ClusterPropagationPolicy")
        {
            if found.is_some() {
                return Err(Failure::input(format!(
                    "{}: more than one PropagationPolicy",
                    path.display()
                )));
            }
            found = Some(
                Policy::from_value(value)
                    .map_err(|e| Failure::input(format!("{}: {e}", l.source)))?,
            );
        }
    }
    found.map(Some).ok_or_else(|| {
        Failure::input(format!(
            "{}: no PropagationPolicy or ClusterPropagationPolicy found",
            path.display()
        ))
    })
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(v).map_err(|e| Failure {
        code: 1,
        message: e.to_string(),
    })?;
    println!("{text}");
    Ok(())
}

fn excluded_text(ex: &std::collections::BTreeMap<String, u32>) -> String {
    let parts: Vec<String> = ex
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{k}={n}"))
        .collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(",")
    }
}

pub(crate) fn estimate_table(est: &dramesh_estimator::Estimate) -> String {
    let mut t = Table::new([
        "CLUSTER",
        "K8S",
        "MAX REPLICAS",
        "LIMITED BY",
        "NODES",
        "EXCLUDED",
    ]);
    // Errors are long sentences: they go below the table, referenced by number.
    let mut notes = Vec::new();
    for c in &est.clusters {
        let limited = match &c.error {
            Some(e) => {
                notes.push(format!("[{}] {}: {e}", notes.len() + 1, c.name));
                format!("error [{}]", notes.len())
            }
            None => c.limited_by.clone(),
        };
        t.row([
            c.name.clone(),
            c.kubernetes_version.clone().unwrap_or_else(|| "-".into()),
            // A lower bound (the allocation search gave up) must not read as an exact count.
            if c.is_lower_bound() {
                format!(">={}", c.max_replicas)
            } else {
                c.max_replicas.to_string()
            },
            limited,
            c.nodes_considered.to_string(),
            excluded_text(&c.excluded_nodes),
        ]);
    }
    let mut out = format!("{}total: {}\n", t.render(), est.total);
    for n in notes {
        out.push_str(&n);
        out.push('\n');
    }
    out
}

pub(crate) fn placement_table(p: &dramesh_estimator::PlacementResult) -> String {
    let mut out = format!(
        "policy {} ({}), {} replicas\n",
        p.policy, p.strategy, p.replicas
    );
    let mut t = Table::new(["CLUSTER", "REPLICAS", "AVAILABLE"]);
    for c in &p.clusters {
        let avail = p
            .available
            .get(&c.name)
            .map_or("-".to_string(), |a| a.to_string());
        t.row([c.name.clone(), c.replicas.to_string(), avail]);
    }
    if !t.is_empty() {
        out.push_str(&t.render());
    }
    if !p.filtered_out.is_empty() {
        out.push_str(&format!(
            "filtered out by cluster affinity: {}\n",
            p.filtered_out.join(", ")
        ));
    }
    if let Some(u) = &p.unschedulable {
        out.push_str(&format!("UNSCHEDULABLE: {u}\n"));
    }
    out
}

pub(crate) fn preemption_table(p: &dramesh_estimator::PreemptionResult) -> String {
    let mut out = format!(
        "preemptor {} (priority {}), {} replicas\n",
        p.preemptor, p.priority, p.replicas
    );
    if let Some(c) = &p.fits_without_preemption {
        out.push_str(&format!("fits without preemption in {c}\n"));
    }
    let mut t = Table::new([
        "CLUSTER",
        "FEASIBLE",
        "BEFORE",
        "AFTER",
        "VICTIMS",
        "EVICTED PODS",
        "TOP VICTIM PRIO",
        "NOTE",
    ]);
    for c in &p.clusters {
        let chosen = p.chosen.as_deref() == Some(c.name.as_str());
        t.row([
            if chosen {
                format!("{} *", c.name)
            } else {
                c.name.clone()
            },
            if c.feasible { "yes" } else { "no" }.to_string(),
            c.replicas_before.to_string(),
            c.replicas_after.to_string(),
            c.victims.len().to_string(),
            c.evicted_pods.to_string(),
            c.highest_victim_priority
                .map_or("-".into(), |p| p.to_string()),
            c.reason.clone().unwrap_or_default(),
        ]);
    }
    out.push_str(&t.render());
    if let Some(chosen) = p
        .chosen
        .as_deref()
        .and_then(|n| p.clusters.iter().find(|c| c.name == n))
    {
        let mut v = Table::new(["VICTIM", "PRIORITY", "PODS", "FREES"]);
        for victim in &chosen.victims {
            let frees: Vec<String> = victim
                .freed
                .iter()
                .map(|(k, q)| format!("{k}={q}"))
                .collect();
            v.row([
                format!("{} {}/{}", victim.kind, victim.namespace, victim.name),
                victim.priority.to_string(),
                victim.pods.to_string(),
                frees.join(","),
            ]);
        }
        out.push_str(&format!("victims in {} (*):\n{}", chosen.name, v.render()));
    }
    if let Some(r) = &p.reason {
        out.push_str(&format!("{r}\n"));
    }
    out
}

pub(crate) fn run_estimate(
    snapshot: &Path,
    workload: &[PathBuf],
    output: Output,
) -> Result<(), Failure> {
    let (view, w) = inputs(snapshot, workload)?;
    let est = Estimator::new().estimate(&view, &w, &EstimateOptions::default());
    match output {
        Output::Json => print_json(&est),
        Output::Table => {
            print!("{}", estimate_table(&est));
            Ok(())
        }
    }
}

pub(crate) fn run_place(
    snapshot: &Path,
    workload: &[PathBuf],
    policy_file: Option<&Path>,
    output: Output,
) -> Result<(), Failure> {
    let (view, w) = inputs(snapshot, workload)?;
    let policy = policy(policy_file, &w)?.ok_or_else(|| {
        Failure::input(
            "no placement policy: pass --policy or put a PropagationPolicy beside the workload",
        )
    })?;
    let result = place(
        &view,
        &w,
        &policy,
        &mut Estimator::new(),
        &EstimateOptions::default(),
    );
    match output {
        Output::Json => print_json(&result),
        Output::Table => {
            print!("{}", placement_table(&result));
            Ok(())
        }
    }
}

pub(crate) fn run_preempt(
    snapshot: &Path,
    workload: &[PathBuf],
    policy_file: Option<&Path>,
    output: Output,
) -> Result<(), Failure> {
    let (view, w) = inputs(snapshot, workload)?;
    let mut opts = EstimateOptions::default();
    // A policy restricts which clusters may be considered for preemption.
    if let Some(p) = policy(policy_file, &w)?
        && let Some(a) = &p.affinity
    {
        opts.clusters = a.matching_clusters(&view);
        if opts.clusters.is_empty() {
            return Err(Failure::input(format!(
                "policy {}: no cluster matches its cluster affinity",
                p.name
            )));
        }
    }
    let result = preempt(&view, &w, &mut Estimator::new(), &opts);
    match output {
        Output::Json => print_json(&result),
        Output::Table => {
            print!("{}", preemption_table(&result));
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use dramesh_estimator::{ClusterEstimate, Estimate};

    #[test]
    fn a_lower_bound_reads_as_one() {
        let c = |name: &str, n: i64, limited_by: &str, unknown_nodes: u32| ClusterEstimate {
            name: name.into(),
            max_replicas: n,
            limited_by: limited_by.into(),
            excluded_nodes: Default::default(),
            nodes_considered: 2,
            limits: Default::default(),
            kubernetes_version: None,
            error: None,
            assumed_unplaced: 0,
            unknown_nodes,
            headroom: None,
        };
        let est = Estimate {
            clusters: vec![
                c(
                    "a",
                    3,
                    "unknown: allocation budget exhausted on 2 node(s)",
                    2,
                ),
                c("b", 4, "devices", 0),
            ],
            total: 7,
        };
        let table = super::estimate_table(&est);
        let row = |name: &str| {
            table
                .lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_default()
                .split_whitespace()
                .collect::<Vec<_>>()
        };
        assert_eq!(row("a")[2], ">=3", "{table}");
        assert!(table.contains("unknown: allocation budget exhausted on 2 node(s)"));
        assert_eq!(row("b")[2], "4", "{table}");
    }
}
