//! `dramesh allocate`: one pod's claims on one node.

use std::path::PathBuf;

use dramesh_engine::{KubeVersion, Options, allocate_manifests};

use crate::table::Table;
use crate::{Failure, Output};

pub(crate) fn run(
    node: &str,
    files: &[PathBuf],
    version: &str,
    output: Output,
) -> Result<(), Failure> {
    let version: KubeVersion = version.parse().map_err(Failure::input)?;
    let loaded = dramesh_model::load::load_paths(files).map_err(Failure::input)?;
    let opts = Options {
        version,
        ..Options::default()
    };
    let report = allocate_manifests(&loaded, node, &opts).map_err(Failure::input)?;
    let json = serde_json::to_value(&report).map_err(|e| Failure {
        code: 1,
        message: e.to_string(),
    })?;
    match output {
        // The report itself, not `json`: keeps the documented field order.
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        ),
        Output::Table => print!("{}", render(&json)),
    }
    Ok(())
}

/// Renders the report's JSON form, so the table can never disagree with `-o json`.
fn render(report: &serde_json::Value) -> String {
    let s = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
    let mut out = format!(
        "node {}: {}\n",
        s(&report["node"]),
        if report["allocated"].as_bool() == Some(true) {
            "allocated"
        } else if report["unknown"].as_bool() == Some(true) {
            "UNKNOWN (search gave up)"
        } else {
            "NOT allocated"
        }
    );
    if let Some(e) = report["error"].as_str() {
        out.push_str(&format!("error: {e}\n"));
    }
    if let Some(r) = report["reason"].as_str() {
        out.push_str(&format!("reason: {r}\n"));
    }
    let mut t = Table::new(["CLAIM", "REQUEST", "DRIVER", "POOL", "DEVICE", "NOTES"]);
    let mut selectors = Vec::new();
    for c in report["claims"].as_array().into_iter().flatten() {
        let claim = format!("{}/{}", s(&c["namespace"]), s(&c["name"]));
        let alloc = &c["allocation"];
        for r in alloc["devices"]["results"].as_array().into_iter().flatten() {
            let mut notes = Vec::new();
            if r["adminAccess"].as_bool() == Some(true) {
                notes.push("admin access".to_string());
            }
            if let Some(cap) = r["consumedCapacity"].as_object() {
                let parts: Vec<String> = cap.iter().map(|(k, v)| format!("{k}={}", s(v))).collect();
                notes.push(format!("consumes {}", parts.join(",")));
            }
            if let Some(id) = r["shareID"].as_str() {
                notes.push(format!("share {id}"));
            }
            t.row([
                claim.clone(),
                s(&r["request"]),
                s(&r["driver"]),
                s(&r["pool"]),
                s(&r["device"]),
                notes.join("; "),
            ]);
        }
        if !alloc["nodeSelector"].is_null() {
            selectors.push(format!(
                "{claim}: {}",
                node_selector_text(&alloc["nodeSelector"])
            ));
        }
    }
    if !t.is_empty() {
        out.push_str(&t.render());
    }
    for line in selectors {
        out.push_str(&format!("node selector {line}\n"));
    }
    out
}

fn node_selector_text(sel: &serde_json::Value) -> String {
    let mut terms = Vec::new();
    for term in sel["nodeSelectorTerms"].as_array().into_iter().flatten() {
        let mut reqs = Vec::new();
        for kind in ["matchFields", "matchExpressions"] {
            for r in term[kind].as_array().into_iter().flatten() {
                let values: Vec<&str> = r["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str())
                    .collect();
                reqs.push(format!(
                    "{} {} [{}]",
                    r["key"].as_str().unwrap_or(""),
                    r["operator"].as_str().unwrap_or(""),
                    values.join(",")
                ));
            }
        }
        terms.push(reqs.join(" AND "));
    }
    terms.join(" OR ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_shows_devices_and_selector() {
        let report = serde_json::json!({
            "node": "n1", "allocated": true, "reason": null, "error": null,
            "claims": [{"namespace": "default", "name": "c", "allocation": {
                "devices": {"results": [{"request": "gpu", "driver": "d", "pool": "p", "device": "gpu-0", "adminAccess": true}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}
            }}]
        });
        let text = render(&report);
        assert!(text.starts_with("node n1: allocated\n"), "{text}");
        assert!(
            text.contains("default/c  gpu      d       p     gpu-0   admin access"),
            "{text}"
        );
        assert!(
            text.contains("node selector default/c: metadata.name In [n1]"),
            "{text}"
        );
    }
}
