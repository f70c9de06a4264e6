//! The `dramesh` command-line contract: outputs and exit codes.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::BIN;

fn dramesh(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run dramesh")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}

const INVENTORY: &str = r#"
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.example.com}
spec:
  selectors:
  - cel: {expression: "device.driver == 'gpu.example.com'"}
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: node-1-gpus}
spec:
  driver: gpu.example.com
  nodeName: node-1
  pool: {name: node-1, generation: 1, resourceSliceCount: 1}
  devices:
  - name: gpu-0
    attributes: {model: {string: a100}}
  - name: gpu-1
    attributes: {model: {string: h100}}
"#;

fn claim(name: &str, selector: &str) -> String {
    format!(
        r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: team-a}}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.example.com
        selectors:
        - cel: {{expression: "{selector}"}}
"#
    )
}

/// `dramesh allocate --node node-1` on [`INVENTORY`] and claim `c1` with the CEL `selector`,
/// then `extra` arguments.
fn allocate_c1(selector: &str, extra: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let inv = write(dir.path(), "inv.yaml", INVENTORY);
    let c = write(dir.path(), "claim.yaml", &claim("c1", selector));
    let mut args = vec!["allocate", "--node", "node-1", "-f", &inv, "-f", &c];
    args.extend_from_slice(extra);
    dramesh(&args)
}

/// Asserts exit code 0 (showing stderr otherwise) and parses stdout as JSON.
fn json_exit_0(out: &Output) -> serde_json::Value {
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn allocate_json_contract() {
    let out = allocate_c1(
        "device.attributes['gpu.example.com'].model == 'h100'",
        &["-o", "json"],
    );
    let v = json_exit_0(&out);
    assert_eq!(v["node"], "node-1");
    assert_eq!(v["allocated"], true);
    assert_eq!(v["claims"][0]["namespace"], "team-a");
    assert_eq!(v["claims"][0]["name"], "c1");
    let r = &v["claims"][0]["allocation"]["devices"]["results"][0];
    assert_eq!(
        (r["request"].as_str(), r["device"].as_str()),
        (Some("gpu"), Some("gpu-1"))
    );
    assert_eq!(
        v["claims"][0]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"]
            [0],
        "node-1"
    );
}

#[test]
fn allocate_reports_pod_errors_with_exit_zero() {
    // A missing attribute key is a CEL runtime error: it fails the pod, it is not "no fit".
    let out = allocate_c1(
        "device.attributes['gpu.example.com'].memory == 1",
        &["-o", "json"],
    );
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["allocated"], false);
    assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
}

#[test]
fn allocate_says_why_a_node_does_not_fit() {
    let out = allocate_c1("device.attributes['gpu.example.com'].model == 'b200'", &[]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("node node-1: NOT allocated"), "{text}");
    assert!(text.contains("reason:"), "{text}");
}

#[test]
fn invalid_input_exits_2_naming_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        dir.path(),
        "bad.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: c, namespace: ns}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      deviceClassName: gpu\n",
    );
    let out = dramesh(&["allocate", "--node", "node-1", "-f", &bad]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.yaml") && err.contains("spec.devices.requests[0].deviceClassName"),
        "{err}"
    );
    let missing = dramesh(&["allocate", "--node", "n", "-f", "/nonexistent/x.yaml"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/x.yaml"));
}

#[test]
fn allocate_runs_a_conformance_case_file() {
    let case = repo().join("tests/allocator/basic-simple.yaml");
    let out = dramesh(&[
        "allocate",
        "--node",
        "node-1",
        "-f",
        case.to_str().unwrap(),
        "-o",
        "json",
    ]);
    let v = json_exit_0(&out);
    assert_eq!(v["allocated"], true);
}

/// A replica without API TLS and without `--api-insecure` refuses to start, naming both ways
/// out; a token file with a bad line names the file and line.
#[test]
fn replica_refuses_plaintext_apis_unless_asked_and_names_bad_token_files() {
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    common::make_certs(&certs, &["r1"], &[]);
    let c = |f: &str| certs.join(f).display().to_string();
    let base = |extra: &[&str]| {
        let mut a: Vec<String> = [
            "replica",
            "--id",
            "r1",
            "--listen-mesh",
            "127.0.0.1:0",
            "--api",
            "127.0.0.1:0",
            "--grpc",
            "127.0.0.1:0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend([
            "--data-dir".into(),
            tmp.path().join("data").display().to_string(),
            "--mesh-cert".into(),
            c("replica-r1.crt"),
            "--mesh-key".into(),
            c("replica-r1.key"),
            "--mesh-ca".into(),
            c("ca.crt"),
        ]);
        a.extend(extra.iter().map(|s| s.to_string()));
        let out = Command::new(BIN).args(&a).output().expect("run dramesh");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = base(&[]);
    assert!(!ok);
    assert!(
        err.contains("--api-cert") && err.contains("--api-insecure"),
        "{err}"
    );
    let tokens = write(tmp.path(), "tokens.csv", "t1,alice,1\nt2\n");
    let (ok, err) = base(&["--api-insecure", "--api-token-file", &tokens]);
    assert!(!ok);
    assert!(err.contains("tokens.csv, line 2"), "{err}");
    let (ok, err) = base(&["--api-insecure", "--api-cert", &c("replica-r1.crt")]);
    assert!(!ok, "{err}");
}

/// An agent told to be its cluster's relay needs the Lease (it relays only while holding it), a
/// fixed mesh port and a HOST:PORT address; each mistake is named before anything starts.
#[test]
fn agent_relay_address_needs_the_lease_a_fixed_port_and_host_port() {
    let base = |extra: &[&str]| {
        let mut a = vec![
            "agent",
            "--cluster",
            "c1",
            "--agent-name",
            "n1",
            "--source",
            "kube",
            "--replica",
            "127.0.0.1:7946",
            "--data-dir",
            "/nonexistent/data",
            "--mesh-credential-bundle",
            "/nonexistent/bundle.pem",
            "--mesh-ca",
            "/nonexistent/ca.crt",
        ];
        a.extend_from_slice(extra);
        dramesh(&a)
    };
    let out = base(&["--relay-advertise", "10.0.0.7:7947"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--lease-namespace"), "{err}");
    let lease = ["--lease-namespace", "dramesh-system"];
    let out = base(&[lease[0], lease[1], "--relay-advertise", "10.0.0.7:7947"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("needs one"), "ephemeral --listen port: {err}");
    let fixed = ["--listen", "0.0.0.0:7947"];
    for bad in ["10.0.0.7", ":7947", "10.0.0.7:port"] {
        let out = base(&[
            lease[0],
            lease[1],
            fixed[0],
            fixed[1],
            "--relay-advertise",
            bad,
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains("expected HOST:PORT"), "{bad}: {err}");
    }
    // A good address gets past the checks to the credentials.
    let out = base(&[
        lease[0],
        lease[1],
        fixed[0],
        fixed[1],
        "--relay-advertise",
        "10.0.0.7:7947",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/"), "{err}");
}

#[test]
fn version_names_the_release_commit_protocol_and_store_format() {
    let out = dramesh(&["--version"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        concat!("dramesh ", env!("CARGO_PKG_VERSION")),
        "{text}"
    );
    let commit = lines[1].strip_prefix("commit: ").expect("a commit line");
    assert!(
        commit == "unknown"
            || (commit.len() == 40 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{commit}"
    );
    use dramesh_mesh::version::{PROTOCOL_MAJOR, PROTOCOL_MINOR};
    assert!(
        lines[2].starts_with(&format!(
            "mesh protocol: {PROTOCOL_MAJOR}.{PROTOCOL_MINOR} "
        )),
        "{text}"
    );
    assert!(
        lines[3].starts_with(&format!(
            "store format: {}.{} ",
            dramesh_store::STORE_FORMAT,
            dramesh_store::STORE_FORMAT_MINOR
        )),
        "{text}"
    );
}

/// `--mesh-verify-threads` is bounded: a value that would start a thread per shard beyond 256
/// is refused before anything starts, naming the flag.
#[test]
fn replica_refuses_more_than_256_verifier_threads() {
    let out = dramesh(&[
        "replica",
        "--id",
        "r1",
        "--data-dir",
        "/nonexistent/data",
        "--mesh-verify-threads",
        "100000",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--mesh-verify-threads"), "{err}");
    assert!(err.contains("0..=256"), "{err}");
}
