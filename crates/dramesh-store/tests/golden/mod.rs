//! Store formats across releases: golden data directories written by each release
//! (`tests/golden/v<version>/store/`, with what they must load as in `store.json`), files of
//! the format before versioning (1.0) and files of a newer format.
//!
//! Regenerate the current release's fixture (after a format change, or for a new release):
//! `cargo test -p dramesh-store --test store golden::regenerate -- --ignored`. Fixtures of
//! earlier releases are never regenerated: every later build must load them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dramesh_store::keys::{doc_key, parse_doc_key};
use dramesh_store::{
    Attestation, CLUSTER_PUBLISHER, DocId, HeadsSigner, HeadsVerifier, ObjectChange, ObjectKey,
    ObjectKind, Proof, STORE_FORMAT, STORE_FORMAT_MINOR, Store, StoreError, SyncState, Trust, hex,
};
use serde::{Deserialize, Serialize};

use crate::common::{snapshot_view, test_config, upsert};

/// The replica whose data directory the fixture is.
const REPLICA: &str = "r0";

/// Signs with the statement's SHA-256 under a fixed credential: the store keeps and reloads
/// attestations without verifying them, so the fixture needs no certificates (which expire).
struct FixtureSigner(&'static str);

impl HeadsSigner for FixtureSigner {
    fn signer(&self) -> Arc<[u8]> {
        Arc::from(self.0.as_bytes())
    }
    fn sign(&self, statement: &[u8]) -> Result<Vec<u8>, String> {
        use sha2::Digest as _;
        Ok(sha2::Sha256::digest(statement).to_vec())
    }
}

impl HeadsVerifier for FixtureSigner {
    fn verify(&self, _: &DocId, statement: &[u8], sig: &[u8], _: &[u8]) -> Result<(), String> {
        use sha2::Digest as _;
        (sha2::Sha256::digest(statement).as_slice() == sig)
            .then_some(())
            .ok_or_else(|| "signature does not match".to_string())
    }
}

fn trust(name: &'static str) -> Trust {
    let s = Arc::new(FixtureSigner(name));
    Trust {
        signer: Some(s.clone()),
        verifier: s,
    }
}

/// What a golden data directory must load as.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Manifest {
    written_by: String,
    store_format: String,
    digest_root: String,
    documents: Vec<ManifestDoc>,
    objects: Vec<ManifestObject>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct ManifestDoc {
    cluster: String,
    writer: String,
    generation: u64,
    heads_hash: String,
    owned: bool,
    /// The copy carries the writer's signed heads (replica copies only).
    signed: bool,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, PartialOrd, Eq, Ord)]
struct ManifestObject {
    cluster: String,
    key: String,
    json: String,
}

fn key(kind: ObjectKind, ns: Option<&str>, name: &str) -> ObjectKey {
    ObjectKey::new(kind, ns, name)
}

/// One signed sync message from `from` to `to`, if `from` has one; whether it sent one.
fn send_signed(
    from: &mut Store,
    to: &mut Store,
    (doc, generation): (&DocId, u64),
    (sf, st): (&mut SyncState, &mut SyncState),
    from_writer: bool,
) -> bool {
    let Some((m, signed)) = from
        .generate_signed_sync_message(doc, generation, sf)
        .unwrap()
    else {
        return false;
    };
    let proof = Proof {
        signed: signed.as_ref(),
        from_writer,
    };
    to.receive_signed_sync_message(doc, generation, st, &m, proof, &|_| true)
        .unwrap();
    true
}

/// Sends `doc` from its writer `from` to `to` with signatures until neither has anything to
/// send.
fn sync_signed(from: &mut Store, to: &mut Store, doc: &DocId) {
    let (mut sf, mut st) = (SyncState::new(), SyncState::new());
    let generation = from.entry(doc).expect("held").generation;
    for _ in 0..20 {
        let sent = send_signed(from, to, (doc, generation), (&mut sf, &mut st), true);
        let answered = send_signed(to, from, (doc, generation), (&mut st, &mut sf), false);
        if !sent && !answered {
            return;
        }
    }
    panic!("sync of {doc} did not settle");
}

const SLICE: &str = r#"{"apiVersion":"resource.k8s.io/v1","kind":"ResourceSlice","metadata":{"name":"node-a-gpu"},"spec":{"driver":"gpu.example.com","nodeName":"node-a","pool":{"name":"node-a","generation":1,"resourceSliceCount":1},"devices":[{"name":"gpu-0","attributes":{"model":{"string":"a100"}},"capacity":{"memory":{"value":"40Gi"}}},{"name":"gpu-1","attributes":{"model":{"string":"a100"}},"capacity":{"memory":{"value":"40Gi"}}}]}}"#;
const CLASS: &str = r#"{"apiVersion":"resource.k8s.io/v1","kind":"DeviceClass","metadata":{"name":"gpu.example.com"},"spec":{"selectors":[{"cel":{"expression":"device.driver == 'gpu.example.com'"}}]}}"#;
const INFO: &str = r#"{"kind":"ClusterInfo","name":"golden","kubernetesVersion":"1.34"}"#;
const RESERVATION_1: &str = r#"{"id":"r0-0001700000000000","owner":"r0","creator":"admin","cluster":"golden","workload":{"namespace":"default","kind":"Deployment","name":"web"},"manifests":["apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web, namespace: default}\nspec:\n  replicas: 2\n  selector: {matchLabels: {app: web}}\n  template:\n    metadata: {labels: {app: web}}\n    spec:\n      containers: [{name: c, image: x, resources: {requests: {cpu: 100m}}}]\n"],"replicas":2,"priority":0,"ttlSeconds":300,"boundAtCreation":0}"#;
const RESERVATION_2: &str = r#"{"id":"r0-0001700000000001","owner":"r0","creator":"admin","cluster":"golden","workload":{"namespace":"default","kind":"Deployment","name":"train"},"manifests":["apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: train, namespace: default}\nspec:\n  replicas: 1\n  selector: {matchLabels: {app: train}}\n  template:\n    metadata: {labels: {app: train}}\n    spec:\n      containers: [{name: c, image: x, resources: {requests: {cpu: 500m}}}]\n"],"replicas":1,"priority":100,"ttlSeconds":600,"boundAtCreation":0,"preemptor":"Deployment default/train"}"#;
const RESERVATION_R1: &str = r#"{"id":"r1-0001700000000000","owner":"r1","creator":"karmada-scheduler","cluster":"golden","workload":{"namespace":"batch","kind":"Job","name":"etl"},"manifests":["apiVersion: batch/v1\nkind: Job\nmetadata: {name: etl, namespace: batch}\nspec:\n  template:\n    spec:\n      restartPolicy: Never\n      containers: [{name: c, image: x, resources: {requests: {cpu: 200m}}}]\n"],"replicas":3,"priority":0,"ttlSeconds":300,"boundAtCreation":1}"#;
const TOMBSTONE: &str =
    r#"{"cluster":"gone","retiredAtMs":1700000000000,"replica":"r0","by":"admin"}"#;

fn node_json(name: &str, cpu: &str) -> String {
    format!(
        r#"{{"apiVersion":"v1","kind":"Node","metadata":{{"name":"{name}","labels":{{"kubernetes.io/hostname":"{name}"}}}},"status":{{"allocatable":{{"cpu":"{cpu}","memory":"64Gi","pods":"110"}}}}}}"#
    )
}

fn node_upsert(name: &str, cpu: &str) -> ObjectChange {
    upsert(key(ObjectKind::Node, None, name), &node_json(name, cpu))
}

/// An in-memory store writing `doc`, signing as `signer`.
fn writer(signer: &'static str, doc: &DocId) -> Store {
    let mut s = Store::in_memory(test_config());
    s.set_trust(trust(signer));
    s.open_writer(doc).unwrap();
    s
}

fn pod_json(name: &str, node: &str) -> String {
    format!(
        r#"{{"kind":"Pod","metadata":{{"namespace":"default","name":"{name}"}},"spec":{{"nodeName":"{node}","priority":0,"containers":[{{"name":"c","resources":{{"requests":{{"cpu":"250m"}}}}}}]}},"status":{{"phase":"Running"}}}}"#
    )
}

/// Writes a replica's data directory into `dir` the way this release does: the replica's own
/// reservation and retirement documents (with history: a released reservation), and signed
/// copies of a directory agent's cluster document, a node agent's document and another
/// replica's reservation document.
fn write_fixture(dir: &Path) -> Manifest {
    let agent_doc = DocId::new("golden", CLUSTER_PUBLISHER);
    let node_doc = DocId::new("golden", "node-a");
    let own_res = DocId::reservations(REPLICA);
    let own_ret = DocId::retired(REPLICA);
    let other_res = DocId::reservations("r1");

    let (mut replica, _) = Store::open(dir, test_config()).unwrap();
    replica.set_trust(trust("replica/r0"));
    replica.open_writer(&own_res).unwrap();
    replica.open_writer(&own_ret).unwrap();
    let res = |id: &str, json: &str| upsert(key(ObjectKind::ClusterInfo, None, id), json);
    replica
        .apply(&own_res, vec![res("r0-0001700000000000", RESERVATION_1)])
        .unwrap();
    replica
        .apply(&own_res, vec![res("r0-0001700000000001", RESERVATION_2)])
        .unwrap();
    replica
        .apply(
            &own_res,
            vec![ObjectChange::Delete {
                key: key(ObjectKind::ClusterInfo, None, "r0-0001700000000000"),
            }],
        )
        .unwrap();
    replica
        .apply(&own_ret, vec![res("gone", TOMBSTONE)])
        .unwrap();

    let mut agent = writer("cluster/golden/agent/_cluster", &agent_doc);
    agent
        .apply(
            &agent_doc,
            vec![
                node_upsert("node-b", "16"),
                upsert(key(ObjectKind::DeviceClass, None, "gpu.example.com"), CLASS),
                upsert(key(ObjectKind::ClusterInfo, None, "cluster"), INFO),
            ],
        )
        .unwrap();
    sync_signed(&mut agent, &mut replica, &agent_doc);
    // Later changes append to the copy's file.
    agent
        .apply(
            &agent_doc,
            vec![
                node_upsert("node-b", "32"),
                upsert(
                    key(ObjectKind::Pod, Some("default"), "web-1"),
                    &pod_json("web-1", "node-b"),
                ),
            ],
        )
        .unwrap();
    sync_signed(&mut agent, &mut replica, &agent_doc);

    let mut node = writer("cluster/golden/agent/node-a", &node_doc);
    node.apply(
        &node_doc,
        vec![
            node_upsert("node-a", "8"),
            upsert(key(ObjectKind::ResourceSlice, None, "node-a-gpu"), SLICE),
        ],
    )
    .unwrap();
    sync_signed(&mut node, &mut replica, &node_doc);

    let mut r1 = writer("replica/r1", &other_res);
    r1.apply(&other_res, vec![res("r1-0001700000000000", RESERVATION_R1)])
        .unwrap();
    sync_signed(&mut r1, &mut replica, &other_res);

    manifest_of(
        &replica,
        &[own_res, own_ret, agent_doc, node_doc, other_res],
    )
}

fn manifest_of(store: &Store, docs: &[DocId]) -> Manifest {
    let mut documents: Vec<ManifestDoc> = docs
        .iter()
        .map(|d| {
            let e = store.entry(d).expect("held");
            ManifestDoc {
                cluster: d.cluster.clone(),
                writer: d.writer.clone(),
                generation: e.generation,
                heads_hash: hex(&e.heads_hash),
                owned: store.doc_stats(d).expect("held").owned,
                signed: store.signed_heads(d).is_some(),
            }
        })
        .collect();
    documents.sort_by(|a, b| (&a.cluster, &a.writer).cmp(&(&b.cluster, &b.writer)));
    let mut objects: Vec<ManifestObject> = snapshot_view(store)
        .into_iter()
        .map(|((cluster, k), json)| ManifestObject {
            cluster,
            key: doc_key(&k).unwrap(),
            json: String::from_utf8(json.to_vec()).unwrap(),
        })
        .collect();
    objects.sort();
    Manifest {
        written_by: concat!("dramesh ", env!("CARGO_PKG_VERSION")).to_string(),
        store_format: format!("{STORE_FORMAT}.{STORE_FORMAT_MINOR}"),
        digest_root: format!("{:016x}", store.digest().root()),
        documents,
        objects,
    }
}

fn golden_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// Regenerates this release's fixture (see the module docs).
#[test]
#[ignore = "writes tests/golden/v<version>: run by hand, see the module docs"]
fn regenerate() {
    let out = golden_root().join(concat!("v", env!("CARGO_PKG_VERSION")));
    let store_dir = out.join("store");
    if store_dir.exists() {
        std::fs::remove_dir_all(&store_dir).unwrap();
    }
    std::fs::create_dir_all(&store_dir).unwrap();
    let manifest = write_fixture(&store_dir);
    let json = serde_json::to_string_pretty(&manifest).unwrap();
    std::fs::write(out.join("store.json"), json + "\n").unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The golden directories of every release so far.
fn golden_releases() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(golden_root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("store.json").is_file())
        .collect();
    out.sort();
    out
}

#[test]
fn golden_data_directories_of_every_release_load_and_migrate() {
    let releases = golden_releases();
    assert!(
        releases
            .iter()
            .any(|p| p.ends_with(concat!("v", env!("CARGO_PKG_VERSION")))),
        "no golden fixture of this release in {}: regenerate it (module docs)",
        golden_root().display()
    );
    for release in releases {
        let name = release.display().to_string();
        let want: Manifest =
            serde_json::from_slice(&std::fs::read(release.join("store.json")).unwrap()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        copy_dir(&release.join("store"), tmp.path());
        let (mut store, report) = Store::open(tmp.path(), test_config()).unwrap();
        assert!(report.corrupt.is_empty(), "{name}: {:?}", report.corrupt);
        assert!(
            report.truncated.is_empty(),
            "{name}: {:?}",
            report.truncated
        );
        assert_eq!(
            report.removed_tmp_files + report.removed_unfinished_files,
            0
        );
        assert_eq!(report.loaded, want.documents.len(), "{name}");
        let docs: Vec<DocId> = want
            .documents
            .iter()
            .map(|d| DocId::new(d.cluster.clone(), d.writer.clone()))
            .collect();
        let mut got = manifest_of(&store, &docs);
        // What wrote it and the digest are the fixture's, the rest must be equal.
        assert_eq!(got.digest_root, want.digest_root, "{name}: digest");
        got.written_by.clone_from(&want.written_by);
        got.store_format.clone_from(&want.store_format);
        assert_eq!(got, want, "{name}");
        for (d, doc) in want.documents.iter().zip(&docs) {
            if d.signed {
                let a: &Attestation = store.signed_heads(doc).unwrap();
                assert_eq!(
                    hex(&dramesh_store::heads_hash(&a.heads)),
                    d.heads_hash,
                    "{name}: {doc}'s signed heads are its heads"
                );
            }
        }
        for o in &want.objects {
            assert!(parse_doc_key(&o.key).is_some(), "{name}: key {}", o.key);
        }
        // Every file is rewritten in this build's format by its next snapshot: the replica's
        // own documents by a rollover, and they reopen to the same objects.
        let before = snapshot_view(&store);
        for d in docs
            .iter()
            .filter(|d| d.cluster.starts_with('_') && d.writer == REPLICA)
        {
            store.open_writer(d).unwrap();
            store.rollover(d).unwrap();
            assert_eq!(
                header_format(&doc_file(tmp.path(), d)),
                (STORE_FORMAT, STORE_FORMAT_MINOR),
                "{name}: {d} not migrated"
            );
        }
        drop(store);
        let (store, report) = Store::open(tmp.path(), test_config()).unwrap();
        assert!(report.corrupt.is_empty(), "{name}: {:?}", report.corrupt);
        assert_eq!(snapshot_view(&store), before, "{name}");
    }
}

// --- Format versions ------------------------------------------------------------------------

const RECORD_HEADER: usize = 13;

/// The file of `doc` in `dir` (the only `.amdoc` whose header names it).
fn doc_file(dir: &Path, doc: &DocId) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "amdoc"))
        .find(|p| {
            let h = header_json(p);
            h["doc"]["cluster"] == doc.cluster.as_str() && h["doc"]["writer"] == doc.writer.as_str()
        })
        .unwrap_or_else(|| panic!("no file of {doc}"))
}

/// The header record (record 0, after the 8 magic bytes) of a document file.
fn header_json(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap();
    let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[8 + RECORD_HEADER..8 + RECORD_HEADER + len]).unwrap()
}

fn header_format(path: &Path) -> (u32, u32) {
    let h = header_json(path);
    (
        h["format"].as_u64().unwrap() as u32,
        h["format_minor"].as_u64().unwrap_or(0) as u32,
    )
}

/// Replaces the header record of a document file with `edit` applied to its JSON (a valid
/// record: the CRC is recomputed).
fn rewrite_header(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(path).unwrap();
    let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    let end = 8 + RECORD_HEADER + len;
    let mut json: serde_json::Value =
        serde_json::from_slice(&bytes[8 + RECORD_HEADER..end]).unwrap();
    edit(json.as_object_mut().unwrap());
    let payload = serde_json::to_vec(&json).unwrap();
    let mut out = bytes[..8].to_vec();
    let n = payload.len() as u32;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[1]);
    crc.update(&payload);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&(!n).to_le_bytes());
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.push(1);
    out.extend_from_slice(&payload);
    out.extend_from_slice(&bytes[end..]);
    std::fs::write(path, out).unwrap();
}

/// A header exactly as builds before format versions wrote it (format 1, no minor).
fn as_format_1_0(h: &mut serde_json::Map<String, serde_json::Value>) {
    h.remove("format_minor");
    h.remove("written_by");
    let keys: Vec<&String> = h.keys().collect();
    assert_eq!(
        keys,
        ["doc", "format", "fresh_bytes", "generation", "owned"],
        "the fields of a format 1.0 header"
    );
}

#[test]
fn a_previous_format_file_opens_and_is_migrated_by_its_next_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    let n1 = key(ObjectKind::Node, None, "n1");
    {
        let (mut s, _) = Store::open(dir.path(), test_config()).unwrap();
        s.open_writer(&d).unwrap();
        s.apply(&d, vec![upsert(n1.clone(), &node_json("n1", "4"))])
            .unwrap();
    }
    let path = doc_file(dir.path(), &d);
    assert_eq!(header_format(&path), (STORE_FORMAT, STORE_FORMAT_MINOR));
    rewrite_header(&path, as_format_1_0);
    assert_eq!(header_format(&path), (1, 0));

    let (mut s, report) = Store::open(dir.path(), test_config()).unwrap();
    assert!(report.corrupt.is_empty(), "{:?}", report.corrupt);
    assert_eq!(report.loaded, 1);
    let g = s.open_writer(&d).unwrap();
    assert_eq!(
        s.get("c1", &n1).as_deref(),
        Some(node_json("n1", "4").as_bytes())
    );
    // An append keeps the file's format; the next snapshot writes this build's.
    s.apply(&d, vec![upsert(n1.clone(), &node_json("n1", "8"))])
        .unwrap();
    assert_eq!(header_format(&path), (1, 0));
    let g2 = s.rollover(&d).unwrap();
    assert!(g2 > g);
    assert_eq!(header_format(&path), (STORE_FORMAT, STORE_FORMAT_MINOR));
    let h = header_json(&path);
    assert_eq!(
        h["written_by"],
        concat!("dramesh ", env!("CARGO_PKG_VERSION"))
    );
    drop(s);
    let (s, report) = Store::open(dir.path(), test_config()).unwrap();
    assert!(report.corrupt.is_empty());
    assert_eq!(
        s.get("c1", &n1).as_deref(),
        Some(node_json("n1", "8").as_bytes())
    );
}

#[test]
fn a_newer_minor_format_is_read_and_its_unknown_header_fields_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let d = DocId::new("c1", CLUSTER_PUBLISHER);
    {
        let (mut s, _) = Store::open(dir.path(), test_config()).unwrap();
        s.open_writer(&d).unwrap();
        s.apply(&d, vec![upsert(key(ObjectKind::Node, None, "n1"), "{}")])
            .unwrap();
    }
    rewrite_header(&doc_file(dir.path(), &d), |h| {
        h.insert("format_minor".into(), (STORE_FORMAT_MINOR + 1).into());
        h.insert("hint".into(), "added by a newer minor".into());
    });
    let (s, report) = Store::open(dir.path(), test_config()).unwrap();
    assert!(report.corrupt.is_empty(), "{:?}", report.corrupt);
    assert_eq!(s.doc_count(), 1);
}

#[test]
fn a_newer_format_refuses_the_directory_naming_the_file_and_both_versions_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (DocId::new("c1", "n1"), DocId::new("c2", "n1"));
    {
        let (mut s, _) = Store::open(dir.path(), test_config()).unwrap();
        for d in [&a, &b] {
            s.open_writer(d).unwrap();
            s.apply(d, vec![upsert(key(ObjectKind::Node, None, "n1"), "{}")])
                .unwrap();
        }
    }
    let newer = doc_file(dir.path(), &a);
    let damaged = doc_file(dir.path(), &b);
    rewrite_header(&newer, |h| {
        h.insert("format".into(), (STORE_FORMAT + 1).into());
        h.insert("format_minor".into(), 3.into());
        // A newer format may rename or drop anything but `format`.
        h.remove("doc");
    });
    // Beside it, a damaged file and a leftover temporary file: left as they are.
    let mut bytes = std::fs::read(&damaged).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&damaged, &bytes).unwrap();
    let tmp_file = dir.path().join("leftover.tmp");
    std::fs::write(&tmp_file, b"x").unwrap();
    let listing = |dir: &Path| {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    };
    let before = listing(dir.path());

    let err = Store::open(dir.path(), test_config())
        .err()
        .expect("a newer format opened");
    let StoreError::NewerFormat {
        path,
        found,
        supported,
        others,
    } = &err
    else {
        panic!("wrong error: {err}");
    };
    assert_eq!(path, &newer);
    assert_eq!(found, &format!("{}.3", STORE_FORMAT + 1));
    assert_eq!(supported, &format!("{STORE_FORMAT}.{STORE_FORMAT_MINOR}"));
    assert_eq!(*others, 0);
    let text = err.to_string();
    assert!(text.contains(&newer.display().to_string()), "{text}");
    assert!(
        text.contains(&format!("store format {}.3", STORE_FORMAT + 1)),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "reads store format {STORE_FORMAT}.{STORE_FORMAT_MINOR}"
        )),
        "{text}"
    );
    assert_eq!(listing(dir.path()), before, "the directory was changed");
    assert_eq!(std::fs::read(&damaged).unwrap(), bytes);

    // A newer magic is refused the same way.
    rewrite_header(&newer, |h| {
        h.insert("format".into(), STORE_FORMAT.into());
    });
    let mut raw = std::fs::read(&newer).unwrap();
    raw[7] = b'2';
    std::fs::write(&newer, &raw).unwrap();
    match Store::open(dir.path(), test_config()) {
        Err(StoreError::NewerFormat { path, found, .. }) => {
            assert_eq!(path, newer);
            assert!(found.contains("DRMSTOR2"), "{found}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a newer magic opened"),
    }
}
