//! Real-world DRA manifests (`../shared/fixtures/real`, next to the repository) against the loader,
//! the CEL environment and the allocator.
//!
//! What is checked:
//! - every YAML file that is not a template loads without a panic; a file that fails to load gives an
//!   error whose text names the file; the files the fixtures' README lists as malformed fail; every
//!   other failure is either an older DRA API version (counted) or listed in [`KNOWN_LOAD_ERRORS`]
//!   with the reason, so a new failure (or a stale entry) makes the test fail;
//! - every DeviceClass selector and every ResourceClaim / ResourceClaimTemplate request selector
//!   compiles in the DRA CEL environment;
//! - claims built from real templates, allocated against real node dumps, get the devices a person
//!   derives from the Kubernetes rules (first fit in pool, slice, device order; constraints).
//!
//! Every test prints a message and returns when the fixtures directory is absent.

use std::path::{Path, PathBuf};

use dramesh_cel::CelEnv;
use dramesh_engine::{Options, allocate_manifests};
use dramesh_model::ClusterObject;
use dramesh_model::load::{Loaded, Manifest, load_path, load_str};
use serde_json::{Value, json};

fn fixtures_root() -> Option<PathBuf> {
    dramesh_testkit::fixtures(dramesh_testkit::REAL)
}

/// Files the fixtures' README lists as malformed upstream examples kept as negative tests.
const README_MALFORMED: &[&str] = &[
    "kubernetes-website/resourceclaim.yaml",
    "kubernetes-enhancements-keps/kep4815-tpu-4x4-claim.yaml",
    "kubernetes-enhancements-keps/kep4815-multihost-tpu-slices.yaml",
    "kubernetes-enhancements-keps/kep4816-firstavailable-claim-v1beta2.yaml",
    "kubernetes-enhancements-keps/kep5491-list-attribute-claim.yaml",
    "kubeflow-trainer/resourceclaimtemplates-h100-a100-admin.yaml",
    "intel-resource-drivers/gpu/examples/pod-inline-aligned-gpus.yaml",
];

/// Other files that are expected not to load: (path, substring of the error, why).
const KNOWN_LOAD_ERRORS: &[(&str, &str, &str)] = &[
    // Fragments and non-Kubernetes documents (no `kind`, or not a mapping).
    (
        "amd-gpu-dra-driver/resourceclaim-status-fragment.yaml",
        "kind",
        "a bare status: fragment",
    ),
    (
        "dra-driver-cpu/devices-fragment-node-allocatable-grouped.yaml",
        "kind",
        "a devices: fragment",
    ),
    (
        "dra-driver-cpu/devices-fragment-node-allocatable-individual.yaml",
        "kind",
        "a devices: fragment",
    ),
    (
        "dra-example-driver/helm/values.yaml",
        "kind",
        "Helm values, not an object",
    ),
    (
        "google-tpu-dra-driver/resourceslice-devices-v6e-fragment.yaml",
        "kind",
        "a devices: fragment",
    ),
    (
        "kubeflow-trainer/jobset-podspec-result-fragment.yaml",
        "kind",
        "a pod spec fragment",
    ),
    (
        "kubeflow-trainer/trainjob-runtimepatches-fragment.yaml",
        "kind",
        "a TrainJob fragment",
    ),
    (
        "kubernetes-enhancements-keps/kep4815-a100-mig-devices-fragment.yaml",
        "kind",
        "a devices: fragment",
    ),
    (
        "kubernetes-enhancements-keps/kep4815-a100-sharedcounters-fragment.yaml",
        "kind",
        "a sharedCounters: fragment",
    ),
    (
        "kubernetes-enhancements-keps/kep5677-partitiontypeattribute-slice-fragment.yaml",
        "kind",
        "a slice spec fragment",
    ),
    (
        "kueue/config/configuration-deviceclassmappings-multi-class-fragment.yaml",
        "kind",
        "a Kueue configuration fragment",
    ),
    (
        "nvidia-dra-driver-gpu/quickstart-v1/mig-parted-config.yaml",
        "kind",
        "a mig-parted config, not a Kubernetes object",
    ),
    (
        "nvidia-dra-driver-gpu/device-fragments/full-gpu-a100-device.yaml",
        "not a mapping",
        "a single device list item",
    ),
    (
        "nvidia-dra-driver-gpu/device-fragments/mig-1g5gb-a100-device.yaml",
        "not a mapping",
        "a single device list item",
    ),
    (
        "nvidia-dra-driver-gpu/device-fragments/vfio-a100-device.yaml",
        "not a mapping",
        "a single device list item",
    ),
    (
        "nvidia-dra-driver-gpu/device-fragments/resourceslice-list-skeleton.yaml",
        "Device",
        "a skeleton with '...' placeholders",
    ),
    (
        "wg-device-management/pools-two-nodes-dgxa100.prototype.yaml",
        "not a mapping",
        "prototype API, not resource.k8s.io",
    ),
    // Illustrative KEP snippets that are not valid objects of the API they name.
    (
        "kubernetes-enhancements-keps/kep4815-mig-claim-matchattribute-parentuuid.yaml",
        "spec.spec",
        "a ResourceClaim written in template shape (spec.spec)",
    ),
    (
        "kubernetes-enhancements-keps/kep4815-tpu-consumer-deployment.yaml",
        "podAffinityTerm",
        "required anti-affinity written with the preferred-term shape",
    ),
    (
        "kubernetes-enhancements-keps/kep5517-cpu-devices-direct-mapping.yaml",
        "DeviceAttribute",
        "untyped attribute values (KEP draft shape)",
    ),
    (
        "kubernetes-enhancements-keps/kep5517-socket-consumable-capacity-mapping.yaml",
        "DeviceAttribute",
        "untyped attribute values (KEP draft shape)",
    ),
    // Fields newer than the 1.36 API (KEP-5941, proposed for 1.37+), unknown to k8s-openapi 1.36.
    (
        "kubernetes-enhancements-keps/kep5941-counter-slice-with-requestpolicy.yaml",
        "requestPolicy",
        "counter requestPolicy is a KEP-5941 proposal",
    ),
    (
        "kubernetes-enhancements-keps/kep5941-vf-device-slice-valuefrom.yaml",
        "valueFrom",
        "counter valueFrom is a KEP-5941 proposal",
    ),
    // Documents published without apiVersion.
    (
        "dra-example-driver/demo-examples/device-taints-tolerations/device-taint-pod-noschedule/4-pod-not-scheduled.yaml",
        "apiVersion",
        "the Pod has no apiVersion as published",
    ),
];

fn walk_yaml(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            walk_yaml(&path, out);
        } else if path.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(path);
        }
    }
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .to_string_lossy()
        .replace('\\', "/")
}

/// Helm/Go templates, which are not YAML until rendered (the README's "templates" category).
fn is_template(rel: &str, text: &str) -> bool {
    rel.ends_with(".helm-template.yaml") || rel.ends_with(".tmpl.yaml") || text.contains("{{")
}

/// Every non-template file, loaded: (relative path, result).
fn load_all(root: &Path) -> Vec<(String, Result<Vec<Loaded>, String>)> {
    let mut files = Vec::new();
    walk_yaml(root, &mut files);
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let rel = relative(root, &f);
        let text = std::fs::read_to_string(&f)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", f.display()));
        if is_template(&rel, &text) {
            continue;
        }
        // The error is rendered inside the closure so only its text crosses the unwind boundary.
        let loaded = std::panic::catch_unwind(|| load_path(&f).map_err(|e| e.to_string()))
            .unwrap_or_else(|_| panic!("the loader panicked on {rel}"));
        out.push((rel, loaded));
    }
    out
}

#[test]
fn every_real_fixture_loads_or_fails_clearly() {
    let Some(root) = fixtures_root() else { return };
    let readme = std::fs::read_to_string(root.join("README.md")).expect("fixtures README");
    for m in README_MALFORMED {
        let name = m.rsplit('/').next().unwrap_or(m);
        assert!(
            readme.contains(name),
            "{m} is not listed as malformed in the fixtures README any more"
        );
    }
    let results = load_all(&root);
    let mut problems = Vec::new();
    let (mut ok, mut older, mut malformed, mut known) = (0, 0, 0, 0);
    for (rel, result) in &results {
        let is_malformed = README_MALFORMED.contains(&rel.as_str());
        let known_entry = KNOWN_LOAD_ERRORS.iter().find(|(p, _, _)| p == rel);
        match result {
            Ok(_) if is_malformed => problems.push(format!(
                "{rel}: listed as malformed in the README but loads"
            )),
            Ok(_) if known_entry.is_some() => problems.push(format!(
                "{rel}: listed in KNOWN_LOAD_ERRORS but loads (stale entry)"
            )),
            Ok(_) => ok += 1,
            Err(e) => {
                if !e.contains(rel.as_str()) {
                    problems.push(format!("{rel}: the load error does not name the file: {e}"));
                }
                if is_malformed {
                    malformed += 1;
                } else if e.contains("convert older DRA API versions") {
                    older += 1;
                } else if let Some((_, needle, _)) = known_entry {
                    if e.contains(needle) {
                        known += 1;
                    } else {
                        problems.push(format!(
                            "{rel}: expected an error mentioning {needle:?}, got: {e}"
                        ));
                    }
                } else {
                    problems.push(format!("{rel}: unexpected load error: {e}"));
                }
            }
        }
    }
    for (p, _, _) in KNOWN_LOAD_ERRORS {
        if !results.iter().any(|(rel, _)| rel == p) {
            problems.push(format!(
                "{p}: in KNOWN_LOAD_ERRORS but not among the fixtures"
            ));
        }
    }
    eprintln!(
        "real fixtures: {} files: {ok} loaded, {older} older DRA API versions (v1beta1/v1beta2/v1alpha3), \
         {malformed} malformed as documented, {known} other known errors",
        results.len()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert_eq!(
        malformed,
        README_MALFORMED.len(),
        "every README-malformed file must fail"
    );
    assert!(
        ok >= 150,
        "only {ok} fixture files loaded; expected most of them"
    );
}

/// The CEL selector expressions of one manifest: (where, expression).
fn selector_expressions(m: &Manifest) -> Vec<(String, String)> {
    let (kind, value, requests_at) = match m {
        Manifest::Object(ClusterObject::DeviceClass(c)) => {
            let v = serde_json::to_value(&**c).unwrap_or(Value::Null);
            let mut out = Vec::new();
            collect_selectors(&v["spec"]["selectors"], "spec.selectors", &mut out);
            return out;
        }
        Manifest::Object(ClusterObject::ResourceClaim(c)) => (
            "ResourceClaim",
            serde_json::to_value(&**c).unwrap_or(Value::Null),
            "/spec/devices/requests",
        ),
        Manifest::Object(ClusterObject::ResourceClaimTemplate(t)) => (
            "ResourceClaimTemplate",
            serde_json::to_value(&**t).unwrap_or(Value::Null),
            "/spec/spec/devices/requests",
        ),
        _ => return Vec::new(),
    };
    let mut out = Vec::new();
    let requests = value
        .pointer(requests_at)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for (i, r) in requests.iter().enumerate() {
        let at = format!("{kind} requests[{i}]");
        collect_selectors(
            &r["exactly"]["selectors"],
            &format!("{at}.exactly.selectors"),
            &mut out,
        );
        for (j, s) in r["firstAvailable"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            collect_selectors(
                &s["selectors"],
                &format!("{at}.firstAvailable[{j}].selectors"),
                &mut out,
            );
        }
    }
    out
}

fn collect_selectors(list: &Value, at: &str, out: &mut Vec<(String, String)>) {
    for (i, s) in list.as_array().into_iter().flatten().enumerate() {
        if let Some(e) = s.pointer("/cel/expression").and_then(Value::as_str) {
            out.push((format!("{at}[{i}]"), e.to_string()));
        }
    }
}

#[test]
fn every_real_selector_compiles() {
    let Some(root) = fixtures_root() else { return };
    let env = CelEnv::new(Default::default());
    let mut failures = Vec::new();
    let mut compiled = 0usize;
    for (rel, result) in load_all(&root) {
        let Ok(loaded) = result else { continue };
        for l in &loaded {
            for (at, expr) in selector_expressions(&l.manifest) {
                match env.compile(&expr) {
                    Ok(_) => compiled += 1,
                    Err(e) => failures.push(format!("{rel} ({}) {at}: {expr:?}: {e}", l.source)),
                }
            }
        }
    }
    eprintln!("real fixtures: {compiled} selector expressions compiled");
    assert!(
        failures.is_empty(),
        "{} selector expressions do not compile:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        compiled >= 50,
        "only {compiled} selectors found; the walk is broken"
    );
}

// ---------------------------------------------------------------------------------------------
// Real-world allocations.

fn load_rel(root: &Path, rel: &str) -> Vec<Loaded> {
    load_path(&root.join(rel)).unwrap_or_else(|e| panic!("{rel} must load: {e}"))
}

fn template_spec(loaded: &[Loaded], name: &str) -> Value {
    loaded
        .iter()
        .find_map(|l| match &l.manifest {
            Manifest::Object(ClusterObject::ResourceClaimTemplate(t))
                if t.metadata.name.as_deref() == Some(name) =>
            {
                serde_json::to_value(&**t)
                    .ok()
                    .map(|v| v["spec"]["spec"].clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no ResourceClaimTemplate {name}"))
}

/// The ResourceClaim the control plane would create from a template for one pod, optionally
/// already allocated.
fn claim_from(spec: &Value, name: &str, namespace: &str, allocation: Option<&Value>) -> Loaded {
    let mut claim = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    });
    if let Some(a) = allocation {
        claim["status"] = json!({ "allocation": a });
    }
    one_object(&claim, name)
}

fn node_object(name: &str) -> Loaded {
    one_object(
        &json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}),
        name,
    )
}

fn one_object(v: &Value, name: &str) -> Loaded {
    let path = PathBuf::from(format!("<generated {name}>.json"));
    let mut loaded = load_str(&path, &v.to_string())
        .unwrap_or_else(|e| panic!("generated object {name} does not load: {e}"));
    assert_eq!(loaded.len(), 1);
    loaded.remove(0)
}

/// Allocates one pod's claims; returns the report as JSON.
fn allocate(inputs: &[Loaded], node: &str) -> Value {
    let report = allocate_manifests(inputs, node, &Options::default())
        .unwrap_or_else(|e| panic!("allocation input rejected: {e}"));
    serde_json::to_value(&report).expect("report serializes")
}

/// (request, driver, device) of each result of the report's only claim, in result order.
fn picked(report: &Value) -> Vec<(String, String, String)> {
    let claims = report["claims"].as_array().cloned().unwrap_or_default();
    assert_eq!(claims.len(), 1, "one claim per pod: {report}");
    claims[0]["allocation"]["devices"]["results"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (s("request"), s("driver"), s("device"))
        })
        .collect()
}

/// Allocates one claim per pod from `spec`, pod after pod (each pod sees the previous pods'
/// claims as allocated), and returns what every pod got (`None`: not schedulable on the node).
fn sequential_pods(
    base: &[Loaded],
    spec: &Value,
    node: &str,
    pods: usize,
    already: Vec<Loaded>,
) -> Vec<Option<Vec<(String, String, String)>>> {
    let mut allocated = already;
    let mut out = Vec::new();
    for i in 0..pods {
        let name = format!("worker-{i}-claim");
        let mut inputs: Vec<Loaded> = base.to_vec();
        inputs.push(node_object(node));
        inputs.extend(allocated.iter().cloned());
        inputs.push(claim_from(spec, &name, "default", None));
        let report = allocate(&inputs, node);
        if report["allocated"].as_bool() == Some(true) {
            let got = picked(&report);
            let allocation = &report["claims"][0]["allocation"];
            allocated.push(claim_from(spec, &name, "default", Some(allocation)));
            let node_sel = &allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0];
            assert_eq!(
                node_sel["key"], "metadata.name",
                "node-local devices: {allocation}"
            );
            assert_eq!(
                node_sel["values"][0], node,
                "pinned to the node: {allocation}"
            );
            out.push(Some(got));
        } else {
            assert!(
                report["error"].is_null(),
                "pod {i} failed with an error instead of not fitting: {report}"
            );
            out.push(None);
        }
    }
    out
}

fn want(items: &[(&str, &str, &str)]) -> Option<Vec<(String, String, String)>> {
    Some(
        items
            .iter()
            .map(|(r, d, n)| (r.to_string(), d.to_string(), n.to_string()))
            .collect(),
    )
}

const P4D: &str = "ip-192-168-153-160.ec2.internal";

fn p4d_inputs(root: &Path) -> (Vec<Loaded>, Vec<Loaded>) {
    let mut base = Vec::new();
    base.extend(load_rel(
        root,
        "nvidia-dra-driver-gpu/helm/deviceclasses.rendered.yaml",
    ));
    base.extend(load_rel(
        root,
        "dranet/examples/aws_eks_examples/gpu-efa/device-class.yaml",
    ));
    base.extend(load_rel(
        root,
        "dranet/examples/aws_eks_examples/gpu-efa/resourceslice-gpu.yaml",
    ));
    base.extend(load_rel(
        root,
        "dranet/examples/aws_eks_examples/gpu-efa/resourceslice-dranet.yaml",
    ));
    let templates = load_rel(
        root,
        "dranet/examples/aws_eks_examples/gpu-efa/resource-claim-template.yaml",
    );
    (base, templates)
}

/// AWS p4d.24xlarge: 8 A100 (gpu-0..7, two per PCIe root pci0000:{10,20,90,a0}) published by
/// gpu.nvidia.com, and 4 EFA + 4 ENA NICs by dra.net (one EFA per root; the EFA class selects only
/// `pciDevice == 'Elastic Fabric Adapter (EFA)'`). Template `gpu-efa-aligned` asks for 1 GPU + 1 EFA
/// with `matchAttribute: resource.kubernetes.io/pcieRoot`.
///
/// By hand, one pod after another, first fit in slice order with backtracking:
/// - pod 0: gpu-0 (pci0000:10) and the first EFA on pci0000:10, pci-0000-10-1b-0;
/// - pod 1: gpu-1 is on pci0000:10 whose only EFA is taken, so the search backtracks to gpu-2
///   (pci0000:20) + pci-0000-20-1b-0;
/// - pod 2: gpu-1 and gpu-3 fail the same way, gpu-4 + pci-0000-90-1b-0;
/// - pod 3: gpu-6 + pci-0000-a0-1b-0;
/// - pod 4: all four EFAs are in use, so no aligned pair exists: not schedulable on this node,
///   although 4 GPUs are still free.
#[test]
fn aws_p4d_gpu_efa_aligned_pods() {
    let Some(root) = fixtures_root() else { return };
    let (base, templates) = p4d_inputs(&root);
    let spec = template_spec(&templates, "gpu-efa-aligned");
    let got = sequential_pods(&base, &spec, P4D, 5, Vec::new());
    let pair = |gpu: &'static str, efa: &'static str| {
        want(&[("gpu", "gpu.nvidia.com", gpu), ("efa", "dra.net", efa)])
    };
    assert_eq!(
        got,
        vec![
            pair("gpu-0", "pci-0000-10-1b-0"),
            pair("gpu-2", "pci-0000-20-1b-0"),
            pair("gpu-4", "pci-0000-90-1b-0"),
            pair("gpu-6", "pci-0000-a0-1b-0"),
            None,
        ]
    );
}

/// Same node with the claim of the fixture's real allocated worker (`resource-claim.yaml`:
/// gpu-6 + pci-0000-a0-1b-0) already in place. That file itself does not load (its status
/// conditions lack lastTransitionTime), so its allocation is restated here.
///
/// By hand: aligned pods get gpu-0/pci0000:10, gpu-2/pci0000:20 and gpu-4/pci0000:90; a fourth pod
/// would need gpu-7 (the only free GPU on pci0000:a0) with pci-0000-a0-1b-0, which the existing
/// claim holds: not schedulable. The unaligned template on the empty node takes the first GPU and
/// the first EFA in slice order: gpu-0 + pci-0000-10-1b-0.
#[test]
fn aws_p4d_with_real_allocated_claim() {
    let Some(root) = fixtures_root() else { return };
    let (base, templates) = p4d_inputs(&root);
    let aligned = template_spec(&templates, "gpu-efa-aligned");
    let real = json!({
        "devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": P4D, "device": "gpu-6"},
            {"request": "efa", "driver": "dra.net", "pool": P4D, "device": "pci-0000-a0-1b-0"}
        ]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [P4D]}
        ]}]}
    });
    let existing = claim_from(
        &aligned,
        "nccl-test-dra-worker-0-gpu-efa-example",
        "default",
        Some(&real),
    );
    let got = sequential_pods(&base, &aligned, P4D, 4, vec![existing]);
    let pair = |gpu: &'static str, efa: &'static str| {
        want(&[("gpu", "gpu.nvidia.com", gpu), ("efa", "dra.net", efa)])
    };
    assert_eq!(
        got,
        vec![
            pair("gpu-0", "pci-0000-10-1b-0"),
            pair("gpu-2", "pci-0000-20-1b-0"),
            pair("gpu-4", "pci-0000-90-1b-0"),
            None,
        ]
    );

    let unaligned = template_spec(&templates, "gpu-efa-unaligned");
    let got = sequential_pods(&base, &unaligned, P4D, 1, Vec::new());
    assert_eq!(
        got,
        vec![want(&[
            ("gpu", "gpu.nvidia.com", "gpu-0"),
            ("efa", "dra.net", "pci-0000-10-1b-0")
        ])]
    );
}

const KIND_WORKER: &str = "dra-example-driver-cluster-worker";

/// dra-example-driver on kind (gpu profile): one slice with gpu-0..gpu-7 (80Gi, model
/// LATEST-GPU-MODEL). Template `multiple-gpus` has two requests (gpu-1, gpu-2) of class
/// gpu.example.com. By hand: each pod takes the next two free GPUs in slice order, so pods 0..3
/// get (gpu-0, gpu-1), (gpu-2, gpu-3), (gpu-4, gpu-5), (gpu-6, gpu-7) and pod 4 does not fit.
/// The `single-gpu-cel` template (model == LATEST-GPU-MODEL, memory >= 4Gi) gets gpu-0.
#[test]
fn dra_example_driver_kind_gpus() {
    let Some(root) = fixtures_root() else { return };
    let mut base = load_rel(
        &root,
        "dra-example-driver/helm/deviceclass-gpu.rendered.yaml",
    );
    base.extend(load_rel(
        &root,
        "dra-example-driver/resourceslice-kind-worker-gpu-profile.yaml",
    ));
    let multi = load_rel(
        &root,
        "dra-example-driver/demo-examples/basic-multiple-requests/basic-multiple-requests.yaml",
    );
    let spec = template_spec(&multi, "multiple-gpus");
    let got = sequential_pods(&base, &spec, KIND_WORKER, 5, Vec::new());
    let two = |a: &'static str, b: &'static str| {
        want(&[
            ("gpu-1", "gpu.example.com", a),
            ("gpu-2", "gpu.example.com", b),
        ])
    };
    assert_eq!(
        got,
        vec![
            two("gpu-0", "gpu-1"),
            two("gpu-2", "gpu-3"),
            two("gpu-4", "gpu-5"),
            two("gpu-6", "gpu-7"),
            None,
        ]
    );

    let cel = load_rel(
        &root,
        "dra-example-driver/demo-examples/cel-selector/cel-selector.yaml",
    );
    let spec = template_spec(&cel, "single-gpu-cel");
    let got = sequential_pods(&base, &spec, KIND_WORKER, 1, Vec::new());
    assert_eq!(got, vec![want(&[("gpu", "gpu.example.com", "gpu-0")])]);
}

/// Intel node `rpl-s`: gpu.intel.com publishes an integrated i915 GPU (0000-00-02-0-0x7d67) and a
/// discrete xe GPU (0000-04-00-0-0xe211); gaudi.intel.com publishes two Gaudi2
/// (0000-a0-00-0-0x1020, 0000-b0-00-0-0x1020). Template `claim1` asks for an `ai-accelerator`
/// with `firstAvailable: [gpu (class gpu.intel.com), gaudi (class gaudi.intel.com)]`.
/// By hand: pods 0 and 1 get the two GPUs in slice order via subrequest `gpu`; pods 2 and 3 fall
/// back to subrequest `gaudi`; pod 4 does not fit.
#[test]
fn intel_first_available_gpu_then_gaudi() {
    let Some(root) = fixtures_root() else { return };
    let mut base = load_rel(&root, "intel-resource-drivers/gpu/base/device-class.yaml");
    base.extend(load_rel(
        &root,
        "intel-resource-drivers/gaudi/base/device-class.yaml",
    ));
    base.extend(load_rel(
        &root,
        "intel-resource-drivers/gpu/resourceslice-rpl-s-node.yaml",
    ));
    base.extend(load_rel(
        &root,
        "intel-resource-drivers/gaudi/resourceslice-rpl-s-node.yaml",
    ));
    let templates = load_rel(
        &root,
        "intel-resource-drivers/gpu/examples/pod-inline-first-available.yaml",
    );
    let spec = template_spec(&templates, "claim1");
    let got = sequential_pods(&base, &spec, "rpl-s", 5, Vec::new());
    let one =
        |sub: &'static str, driver: &'static str, dev: &'static str| want(&[(sub, driver, dev)]);
    assert_eq!(
        got,
        vec![
            one("ai-accelerator/gpu", "gpu.intel.com", "0000-00-02-0-0x7d67"),
            one("ai-accelerator/gpu", "gpu.intel.com", "0000-04-00-0-0xe211"),
            one(
                "ai-accelerator/gaudi",
                "gaudi.intel.com",
                "0000-a0-00-0-0x1020"
            ),
            one(
                "ai-accelerator/gaudi",
                "gaudi.intel.com",
                "0000-b0-00-0-0x1020"
            ),
            None,
        ]
    );
}
