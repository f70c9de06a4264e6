//! Karpenter objects (`karpenter.sh/v1`) as Karpenter writes them load trimmed through the
//! manifest loader, and bad ones name their field.

use dramesh_model::Quantity;

/// The manifests of `text`, or the error's field.
fn load(text: &str) -> Result<Vec<dramesh_model::Loaded>, Option<String>> {
    dramesh_model::load::load_str(std::path::Path::new("pools.yaml"), text).map_err(|e| e.field)
}

#[test]
fn objects_as_karpenter_writes_them_load_trimmed_and_bad_ones_name_the_field() {
    let dir = std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/karpenter"
    ));
    let got = dramesh_model::load::load_paths(&[
        dir.join("nodepool-gpu.yaml"),
        dir.join("nodeclaims-gpu.yaml"),
    ])
    .unwrap();
    let kinds: Vec<&str> = got.iter().map(|l| l.manifest.kind()).collect();
    assert_eq!(kinds, ["NodePool", "NodeClaim", "NodeClaim"]);
    let dramesh_model::Manifest::Object(dramesh_model::ClusterObject::NodePool(p)) =
        &got[0].manifest
    else {
        panic!("{:?}", got[0].manifest)
    };
    assert_eq!(p.metadata.name, "gpu-pool");
    assert_eq!(
        p.spec.limits["cpu"],
        Quantity::from_units(1000),
        "an integer limit"
    );
    assert_eq!(p.spec.limits["nvidia.com/gpu"], Quantity::from_units(24));
    assert_eq!(p.listed_instance_types(), ["p4d.24xlarge", "p5.48xlarge"]);
    // The record round-trips through its own JSON (what replicas decode).
    let o = dramesh_model::ClusterObject::NodePool(p.clone());
    let back = dramesh_model::ClusterObject::from_json(o.kind(), &o.to_json()).unwrap();
    assert_eq!(back.to_json(), o.to_json());

    let e = load("apiVersion: karpenter.sh/v1beta1\nkind: NodePool\nmetadata: {name: p}\n")
        .unwrap_err();
    assert_eq!(e.as_deref(), Some("apiVersion"));
    let e = load(
        "apiVersion: karpenter.sh/v1\nkind: NodePool\nmetadata: {name: p}\nspec: {limits: {cpu: lots}}\n",
    )
    .unwrap_err();
    assert_eq!(e.as_deref(), Some("spec.limits.cpu"));
    let e = load("apiVersion: karpenter.sh/v1\nkind: NodeClaim\nmetadata: {labels: {a: b}}\n")
        .unwrap_err();
    assert_eq!(e.as_deref(), Some("metadata.name"));
    // Another project's NodePool kind is not Karpenter's: passed through.
    let other = load("apiVersion: example.com/v1\nkind: NodePool\nmetadata: {name: p}\n").unwrap();
    assert!(matches!(
        other[0].manifest,
        dramesh_model::Manifest::Other { .. }
    ));
}
