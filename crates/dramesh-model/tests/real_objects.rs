//! Real objects from ../shared/fixtures (skipped with a message when that folder is absent):
//! the nesting bound leaves ample room for them, and objects as an API server returns them load.

use std::path::{Path, PathBuf};

use dramesh_model::depth::{MAX_DEPTH, check_depth};
use dramesh_model::load;

fn shared(sub: &str) -> Option<PathBuf> {
    dramesh_testkit::fixtures(sub)
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p
            .extension()
            .is_some_and(|e| e == "yaml" || e == "yml" || e == "json")
        {
            out.push(p);
        }
    }
}

#[test]
fn real_fixtures_nest_well_under_the_bound() {
    let Some(dir) = shared("") else { return };
    let mut all = Vec::new();
    files(&dir, &mut all);
    assert!(
        all.len() > 300,
        "expected the real fixtures, found {}",
        all.len()
    );
    let (mut deepest, mut at) = (0, PathBuf::new());
    for f in &all {
        let text = std::fs::read_to_string(f).unwrap();
        let d = check_depth(&text, usize::MAX).unwrap();
        if d > deepest {
            (deepest, at) = (d, f.clone());
        }
    }
    eprintln!("deepest real fixture: {deepest} levels ({})", at.display());
    assert!(
        deepest * 2 <= MAX_DEPTH,
        "{} nests {deepest} levels",
        at.display()
    );
}

/// Allocated claims dumped from real clusters: dranet's `status.devices[].conditions[]` carry no
/// `lastTransitionTime` (kubectl accepts that; the Go zero time is omitted).
#[test]
fn real_dranet_allocated_claims_load() {
    let Some(dir) = shared("real/dranet/examples") else {
        return;
    };
    for f in [
        "azure_aks_examples/gb300/resource-claim.yaml",
        "aws_eks_examples/gpu-efa/resource-claim.yaml",
    ] {
        let got = load::load_path(&dir.join(f)).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            got.iter().any(|l| l.manifest.kind() == "ResourceClaim"),
            "{f}: no claim"
        );
    }
}

/// Tolerating the missing timestamp does not loosen anything else in a condition.
#[test]
fn device_conditions_stay_strict() {
    let claim = |cond: &str| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: c\n  namespace: n\nspec: {{}}\nstatus:\n  devices:\n  - driver: d\n    pool: p\n    device: x\n    conditions:\n    - {cond}\n"
        )
    };
    let ok = claim("{type: Ready, status: \"True\", reason: R, message: \"\"}");
    load::load_str(Path::new("c.yaml"), &ok).unwrap();
    let typo =
        claim("{type: Ready, status: \"True\", reason: R, message: \"\", lastTransitonTime: x}");
    let e = load::load_str(Path::new("c.yaml"), &typo)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("status.devices[0].conditions[0].lastTransitonTime: unknown field"),
        "{e}"
    );
    let old = ok.replace("resource.k8s.io/v1", "resource.k8s.io/v1beta1");
    let e = load::load_str(Path::new("c.yaml"), &old)
        .unwrap_err()
        .to_string();
    assert!(e.contains("field apiVersion"), "{e}");
}

/// A replica reads a record's owner from the fields the ownership rules look at
/// (`owner_of_json`); on every real object it must name the owner decoding the whole object
/// names.
#[test]
fn owner_read_from_json_matches_the_decoded_objects_owner() {
    let Some(dir) = shared("real") else { return };
    let mut all = Vec::new();
    files(&dir, &mut all);
    let mut checked = 0;
    for f in &all {
        let Ok(loaded) = load::load_path(f) else {
            continue;
        };
        for l in loaded {
            let load::Manifest::Object(obj) = l.manifest else {
                continue;
            };
            let json = obj.to_json();
            let read = dramesh_model::owner::owner_of_json(obj.kind(), &json)
                .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            assert_eq!(read, obj.owner(), "{}: {:?}", f.display(), obj.key());
            checked += 1;
        }
    }
    assert!(checked > 100, "only {checked} real objects checked");
    eprintln!("{checked} real objects: owners agree");
}
