//! The arguments the shipped manifests give `dramesh` parse: every container of the example
//! member overlay (agent and signer) is run with its rendered arguments and environment, and
//! must get past argument parsing to its first file read (the mounted credentials, absent
//! here), not stop at a usage error.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::BIN;
use dramesh_deploy_check::{Typed, check};
use k8s_openapi::api::core::v1::PodSpec;

fn expand(arg: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = arg.to_owned();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

#[test]
fn member_overlay_containers_parse_their_arguments() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/overlays/example/member1");
    let objs = check(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let pods: Vec<(&str, &PodSpec)> = objs
        .iter()
        .filter_map(|c| match &c.object {
            Typed::DaemonSet(d) => Some(("agent", d.spec.as_ref()?.template.spec.as_ref()?)),
            Typed::Deployment(d) => Some(("signer", d.spec.as_ref()?.template.spec.as_ref()?)),
            _ => None,
        })
        .collect();
    assert_eq!(
        pods.len(),
        2,
        "the agent DaemonSet and the signer Deployment"
    );
    for (what, pod) in pods {
        let c = &pod.containers[0];
        // Downward API values as the kubelet would set them.
        let env: BTreeMap<String, String> = c
            .env
            .iter()
            .flatten()
            .map(|e| {
                let v = match e.value_from.as_ref().and_then(|v| v.field_ref.as_ref()) {
                    Some(f) if f.field_path == "spec.nodeName" => "node-a".to_owned(),
                    Some(f) if f.field_path == "metadata.namespace" => "dramesh-system".to_owned(),
                    Some(f) if f.field_path == "status.podIP" => "10.0.0.7".to_owned(),
                    _ => e.value.clone().unwrap_or_default(),
                };
                (e.name.clone(), v)
            })
            .collect();
        let args: Vec<String> = c.args.iter().flatten().map(|a| expand(a, &env)).collect();
        assert!(
            args.iter().all(|a| !a.contains("$(")),
            "{what}: unexpanded variable in {args:?}"
        );
        let out = Command::new(BIN)
            .args(&args)
            .envs(&env)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", "")
            .output()
            .expect("run dramesh");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: ran without its mounts?");
        assert!(
            !stderr.contains("Usage:"),
            "{what}: the manifest's arguments do not parse: {args:?}\n{stderr}"
        );
        assert!(
            stderr.contains("/etc/dramesh/"),
            "{what}: expected to stop at reading its mounted credentials: {stderr}"
        );
    }
}
