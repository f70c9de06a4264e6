//! Tests only (a dev-dependency, never published): an in-process fake Kubernetes API server
//! speaking the list/watch protocol over plain HTTP/1.1, for driving the real kube client in
//! tests (the agent's watchers and Leases, the replica's TokenReview, the scheduler's Karmada
//! client).
//!
//! Implemented faithfully enough for kube-runtime's watcher, kube's event `Recorder` and our
//! Lease and Karmada code:
//! - collection GET with `limit`/`continue` chunking (the continue token pins the first page's
//!   resourceVersion; an expired token answers 410 `Expired`), `fieldSelector` on
//!   `metadata.name`, `metadata.namespace`, `spec.nodeName` (`=`, `==`, `!=`, comma-joined),
//!   400 for other fields;
//! - `?watch=true`: newline-delimited JSON events over a chunked response, replaying the
//!   event log after `resourceVersion`, ADDED/MODIFIED/DELETED with field-selector
//!   transitions (an object leaving the selection is DELETED, entering it ADDED), BOOKMARKs
//!   when `allowWatchBookmarks=true`, `timeoutSeconds`, an ERROR event with a 410 Status when
//!   the requested version has been compacted away;
//! - test controls: [`FakeApi::drop_watches`] cuts every open watch mid-chunk (an abrupt
//!   close after half an event line), [`FakeApi::compact`] forgets the event log,
//!   [`FakeApi::conflict_next_writes`] makes the next writes to an object answer 409
//!   ([`FakeApi::conflict_next_status_writes`] only those to its `/status`),
//!   [`FakeApi::apply_before_next_write`] lets another writer change an object just before
//!   the next write to it, [`FakeApi::delay_answers`] makes every answer but a watch's take a
//!   seeded random time (a slow server), and
//!   [`FakeApi::writes`] reads back every write request in order;
//! - single-object GET/POST/PUT/PATCH with `resourceVersion` optimistic concurrency: 409
//!   Conflict (a `Status` with reason `Conflict`) when the body's `metadata.resourceVersion`
//!   is not current, 409 AlreadyExists on a duplicate create. PATCH takes
//!   `application/merge-patch+json` (RFC 7386); other patch types answer 415 (no kube code
//!   path we use sends them: kube's event `Recorder` and our Karmada client merge-patch);
//! - the `/status` subresource where the kind has one: the main resource ignores `status`
//!   changes and `/status` ignores everything but `status`; `metadata.generation` counts
//!   changes outside `metadata` and `status` (kinds that track it); every write sets
//!   `resourceVersion`, creations `uid` and `creationTimestamp`;
//! - Karmada kinds (`work.karmada.io/v1alpha2` ResourceBinding and ClusterResourceBinding,
//!   `cluster.karmada.io/v1alpha1` Cluster) besides the core, apps, batch, scheduling, DRA and
//!   events kinds. Every object written to a binding kind is validated against the real CRD's
//!   `openAPIV3Schema` ([`schema`], from `shared/fixtures/karmada/crds` beside the repository;
//!   see [`karmada_crds_dir`]), with a 422 `Invalid` whose `details.causes` name the fields.
//!   Fields the schema does not know are refused (the API server prunes them; tests want to
//!   know). Cluster's CRD is not among the fixtures: Clusters are stored as written.
//!   `events.k8s.io/v1` Events get the API server's field checks (required fields, `type`,
//!   lengths, `note` at most 1 kB);
//! - `certificates.k8s.io/v1beta1` PodCertificateRequests with the status rules a signer could
//!   break (one final condition; a final status is immutable; `Issued` carries the chain and its
//!   times) and `fieldSelector` on `spec.signerName`;
//! - discovery as far as kube's `discovery::pinned_kind` needs it (`/api/v1`, `/apis/<g>/<v>`);
//! - `POST /apis/authentication.k8s.io/v1/tokenreviews`: `authenticated: true` with the user
//!   and groups of a token registered by [`FakeApi::add_token`], else `authenticated: false`
//!   with an error; [`FakeApi::token_reviews`] counts the reviews;
//! - `/version`.
//!
//! Not implemented: label selectors (400), DELETE over HTTP (tests mutate state directly),
//! `generateName`, consistent snapshots across list pages (later pages read current state; the
//! watch from the pinned version replays whatever changed, as a real watch would).

pub mod schema;

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

type Body = BoxBody<Bytes, std::io::Error>;

/// A resource the fake serves.
#[derive(Clone, Copy)]
struct Res {
    plural: &'static str,
    group_version: &'static str,
    kind: &'static str,
    namespaced: bool,
    /// Has a `/status` subresource: the main resource ignores `status`, `/status` all else.
    status: bool,
    /// Tracks `metadata.generation` (bumped on changes outside `metadata` and `status`).
    generation: bool,
    /// The CRD manifest (under [`karmada_crds_dir`]) whose schema every write must pass.
    crd: Option<&'static str>,
}

const fn res(
    plural: &'static str,
    group_version: &'static str,
    kind: &'static str,
    namespaced: bool,
    status: bool,
    generation: bool,
) -> Res {
    Res {
        plural,
        group_version,
        kind,
        namespaced,
        status,
        generation,
        crd: None,
    }
}

const fn crd(
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
    file: &'static str,
) -> Res {
    Res {
        plural,
        group_version: "work.karmada.io/v1alpha2",
        kind,
        namespaced,
        status: true,
        generation: true,
        crd: Some(file),
    }
}

/// Served kinds. Where two share a kind (Event), the first is what kind-only lookups mean.
const RESOURCES: &[Res] = &[
    res("nodes", "v1", "Node", false, true, false),
    res("pods", "v1", "Pod", true, true, false),
    res(
        "resourceslices",
        "resource.k8s.io/v1",
        "ResourceSlice",
        false,
        false,
        false,
    ),
    res(
        "deviceclasses",
        "resource.k8s.io/v1",
        "DeviceClass",
        false,
        false,
        false,
    ),
    res(
        "resourceclaims",
        "resource.k8s.io/v1",
        "ResourceClaim",
        true,
        true,
        false,
    ),
    res(
        "resourceclaimtemplates",
        "resource.k8s.io/v1",
        "ResourceClaimTemplate",
        true,
        false,
        false,
    ),
    res(
        "devicetaintrules",
        "resource.k8s.io/v1beta2",
        "DeviceTaintRule",
        false,
        true,
        false,
    ),
    res(
        "leases",
        "coordination.k8s.io/v1",
        "Lease",
        true,
        false,
        false,
    ),
    res(
        "podcertificaterequests",
        "certificates.k8s.io/v1beta1",
        "PodCertificateRequest",
        true,
        true,
        false,
    ),
    res(
        "nodepools",
        "karpenter.sh/v1",
        "NodePool",
        false,
        true,
        true,
    ),
    res(
        "nodeclaims",
        "karpenter.sh/v1",
        "NodeClaim",
        false,
        true,
        true,
    ),
    res("deployments", "apps/v1", "Deployment", true, true, true),
    res("statefulsets", "apps/v1", "StatefulSet", true, true, true),
    res("jobs", "batch/v1", "Job", true, true, true),
    res(
        "priorityclasses",
        "scheduling.k8s.io/v1",
        "PriorityClass",
        false,
        false,
        false,
    ),
    res("events", "events.k8s.io/v1", "Event", true, false, false),
    res("events", "v1", "Event", true, false, false),
    res(
        "clusters",
        "cluster.karmada.io/v1alpha1",
        "Cluster",
        false,
        true,
        true,
    ),
    crd(
        "resourcebindings",
        "ResourceBinding",
        true,
        "work.karmada.io_resourcebindings.yaml",
    ),
    crd(
        "clusterresourcebindings",
        "ClusterResourceBinding",
        false,
        "work.karmada.io_clusterresourcebindings.yaml",
    ),
];

fn res_by_kind(kind: &str) -> Res {
    *RESOURCES
        .iter()
        .find(|r| r.kind == kind)
        .unwrap_or_else(|| panic!("fake api: unknown kind {kind}"))
}

fn res_by_gvk(api_version: &str, kind: &str) -> Res {
    *RESOURCES
        .iter()
        .find(|r| r.kind == kind && r.group_version == api_version)
        .unwrap_or_else(|| panic!("fake api: unknown kind {api_version} {kind}"))
}

/// Where the Karmada CRD manifests are: `shared/fixtures/karmada/crds` in the nearest ancestor
/// of this crate that has one (the repository's `../shared`, also from a git worktree nested
/// deeper). `None` when absent: binding writes are then stored unvalidated, and tests that
/// need validation must print a skip message ([`FakeApi::validates_karmada_crds`]).
pub fn karmada_crds_dir() -> Option<PathBuf> {
    dramesh_testkit::fixtures_dir(dramesh_testkit::KARMADA_CRDS)
}

/// The compiled schemas by CRD file name, loaded once per process.
fn crd_schemas() -> Option<&'static BTreeMap<&'static str, schema::Crd>> {
    static SCHEMAS: OnceLock<Option<BTreeMap<&'static str, schema::Crd>>> = OnceLock::new();
    SCHEMAS
        .get_or_init(|| {
            let dir = karmada_crds_dir()?;
            let mut out = BTreeMap::new();
            for r in RESOURCES {
                if let Some(file) = r.crd {
                    let version = r.group_version.split('/').nth(1).unwrap_or_default();
                    // A fixture that does not load is a broken test setup: say so loudly.
                    let c = schema::load_crd(&dir.join(file), version)
                        .unwrap_or_else(|e| panic!("fake api: {e}"));
                    out.insert(file, c);
                }
            }
            Some(out)
        })
        .as_ref()
}

/// One write request as the fake received it, for asserting exact bodies and their order.
#[derive(Clone, Debug)]
pub struct Write {
    /// `POST`, `PUT` or `PATCH`.
    pub method: String,
    /// The served kind (`ResourceBinding`, `Event`, ...).
    pub kind: &'static str,
    /// The kind's `apiVersion`.
    pub api_version: &'static str,
    /// The namespace in the URL.
    pub namespace: Option<String>,
    /// The object's name (from the URL, or the body's for a create).
    pub name: String,
    /// `Some("status")` for the status subresource.
    pub subresource: Option<String>,
    /// The request's `content-type`.
    pub content_type: String,
    /// The request body (`Null` if it was not JSON).
    pub body: Value,
    /// The HTTP status the fake answered.
    pub code: u16,
    /// When the write was answered.
    pub at: std::time::Instant,
}

type ObjKey = (String, String); // (namespace or "", name)
/// A served resource's identity: (group/version, plural).
type ResId = (&'static str, &'static str);

impl Res {
    fn id(&self) -> ResId {
        (self.group_version, self.plural)
    }

    fn group(&self) -> &'static str {
        self.group_version
            .split_once('/')
            .map(|(g, _)| g)
            .unwrap_or("")
    }
}

struct LogEvent {
    rv: u64,
    res: ResId,
    /// Object before the change (None for creations).
    old: Option<Value>,
    /// Object after the change (None for deletions).
    new: Option<Value>,
}

#[derive(Default)]
struct St {
    rv: u64,
    objects: BTreeMap<ResId, BTreeMap<ObjKey, Value>>,
    log: Vec<LogEvent>,
    /// Events at or below this version are forgotten.
    compacted: u64,
    drop_gen: u64,
    requests: Vec<String>,
    lease_writes: u64,
    /// Token -> (user, groups) for TokenReview.
    tokens: BTreeMap<String, (String, Vec<String>)>,
    token_reviews: u64,
    /// Every write request, in order.
    writes: Vec<Write>,
    /// Writes to these objects still to be refused with 409 Conflict.
    conflicts: BTreeMap<(ResId, ObjKey), u32>,
    /// Writes to these objects' `/status` still to be refused with 409 Conflict.
    status_conflicts: BTreeMap<(ResId, ObjKey), u32>,
    /// Objects stored just before the next write to them is looked at.
    before_write: BTreeMap<(ResId, ObjKey), Value>,
    /// Lists (not watches) of these kinds are answered only after the delay.
    slow_lists: BTreeMap<&'static str, std::time::Duration>,
    /// Every answer but a watch's is delayed by a random time in this range, drawn from
    /// this generator's state ([`FakeApi::delay_answers`]).
    slow_answers: Option<(Duration, Duration, u64)>,
    /// Counter for `uid`s (unique across deletions and re-creations).
    uids: u64,
    /// Kinds every request for which is refused with 403 (RBAC that does not grant them).
    forbidden: BTreeSet<&'static str>,
    /// Kinds answered 404 as if their API were not installed.
    hidden: BTreeSet<&'static str>,
}

/// The fake API server. Cloning shares the state.
#[derive(Clone)]
pub struct FakeApi {
    st: Arc<Mutex<St>>,
    changed: Arc<watch::Sender<u64>>,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// Interval of BOOKMARK events on watches that ask for them.
    pub bookmark_every: Duration,
}

fn key_of(v: &Value) -> ObjKey {
    let m = &v["metadata"];
    (
        m["namespace"].as_str().unwrap_or("").to_string(),
        m["name"].as_str().unwrap_or("").to_string(),
    )
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code})
}

fn full(code: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(serde_json::to_vec(v).unwrap_or_default()))
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *r.status_mut() = code;
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}

fn err(code: u16, reason: &str, message: &str) -> Response<Body> {
    full(
        StatusCode::from_u16(code).unwrap(),
        &status(code, reason, message),
    )
}

fn pct_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match h {
                    Some(c) => {
                        out.push(c);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(q: Option<&str>) -> BTreeMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (pct_decode(k), pct_decode(v)),
            None => (pct_decode(p), String::new()),
        })
        .collect()
}

/// A parsed field selector: (field, wanted value, negated).
type Selector = Vec<(String, String, bool)>;

fn parse_selector(s: Option<&String>) -> Result<Selector, String> {
    let mut out = Vec::new();
    for part in s
        .map(String::as_str)
        .unwrap_or("")
        .split(',')
        .filter(|p| !p.is_empty())
    {
        let (f, v, neg) = if let Some((f, v)) = part.split_once("!=") {
            (f, v, true)
        } else if let Some((f, v)) = part.split_once("==") {
            (f, v, false)
        } else if let Some((f, v)) = part.split_once('=') {
            (f, v, false)
        } else {
            return Err(format!("invalid field selector {part:?}"));
        };
        if !matches!(
            f,
            "metadata.name" | "metadata.namespace" | "spec.nodeName" | "spec.signerName"
        ) {
            return Err(format!("field label not supported: {f}"));
        }
        out.push((f.to_string(), v.to_string(), neg));
    }
    Ok(out)
}

fn field(v: &Value, f: &str) -> String {
    let x = match f {
        "metadata.name" => &v["metadata"]["name"],
        "metadata.namespace" => &v["metadata"]["namespace"],
        "spec.signerName" => &v["spec"]["signerName"],
        _ => &v["spec"]["nodeName"],
    };
    x.as_str().unwrap_or("").to_string()
}

fn selects(sel: &Selector, ns: Option<&str>, v: &Value) -> bool {
    if let Some(ns) = ns
        && v["metadata"]["namespace"].as_str() != Some(ns)
    {
        return false;
    }
    sel.iter()
        .all(|(f, want, neg)| (field(v, f) == *want) != *neg)
}

impl FakeApi {
    /// Starts the server on 127.0.0.1 with an ephemeral port.
    pub async fn start() -> FakeApi {
        FakeApi::start_on(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("binding the fake API server to 127.0.0.1")
    }

    /// Starts the server on `addr` (port 0: an ephemeral one), for clients in other network
    /// namespaces (the chaos suite's replicas).
    pub async fn start_on(addr: std::net::SocketAddr) -> std::io::Result<FakeApi> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let api = FakeApi {
            st: Arc::new(Mutex::new(St {
                rv: 100,
                ..Default::default()
            })),
            changed: Arc::new(watch::channel(0).0),
            url,
            bookmark_every: Duration::from_millis(300),
        };
        let srv = api.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                // As a real API server's: Go sets TCP_NODELAY on every connection. Without it
                // a watch event written behind an unacknowledged one waits for the client's
                // delayed ACK (40 ms on Linux).
                let _ = stream.set_nodelay(true);
                let srv = srv.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let srv = srv.clone();
                        async move { Ok::<_, Infallible>(srv.handle(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(api)
    }

    /// A kubeconfig (YAML text) whose current context points at this server with a bearer
    /// token, for code under test that reads kubeconfig files.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: tester\nusers:\n- name: tester\n  user:\n    token: t\n",
            self.url
        )
    }

    /// A kube client for this server.
    pub fn client(&self) -> kube::Client {
        let cfg = kube::Config::new(self.url.parse().unwrap());
        kube::Client::try_from(cfg).unwrap()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, St> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self, rv: u64) {
        self.changed.send_replace(rv);
    }

    fn write(st: &mut St, res: Res, obj: Option<Value>, key: ObjKey) -> u64 {
        st.rv += 1;
        let rv = st.rv;
        let objects = st.objects.entry(res.id()).or_default();
        let old = objects.get(&key).cloned();
        let new = match obj {
            Some(mut o) => {
                o["metadata"]["resourceVersion"] = json!(rv.to_string());
                objects.insert(key, o.clone());
                Some(o)
            }
            None => {
                objects.remove(&key);
                None
            }
        };
        // A DELETED event carries the object's final state at the deletion's version.
        let old = if new.is_none() {
            old.map(|mut o| {
                o["metadata"]["resourceVersion"] = json!(rv.to_string());
                o
            })
        } else {
            old
        };
        st.log.push(LogEvent {
            rv,
            res: res.id(),
            old,
            new,
        });
        rv
    }

    /// Sets the server-managed metadata of `obj` about to replace `cur` (None: a creation):
    /// `uid` and `creationTimestamp` kept from `cur` or given on creation, and
    /// `metadata.generation` where the kind tracks it.
    fn stamp(st: &mut St, res: Res, cur: Option<&Value>, obj: &mut Value) {
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        match cur {
            Some(c) => {
                obj["metadata"]["uid"] = c["metadata"]["uid"].clone();
                obj["metadata"]["creationTimestamp"] = c["metadata"]["creationTimestamp"].clone();
            }
            None => {
                if obj["metadata"]["uid"].as_str().is_none_or(str::is_empty) {
                    st.uids += 1;
                    obj["metadata"]["uid"] = json!(format!(
                        "{:08x}-fake-{}-{}",
                        st.uids,
                        res.plural,
                        obj["metadata"]["name"].as_str().unwrap_or("")
                    ));
                }
                if obj["metadata"]["creationTimestamp"].is_null() {
                    let now = k8s_openapi::jiff::Timestamp::now().as_second();
                    let now = k8s_openapi::jiff::Timestamp::from_second(now).unwrap_or_default();
                    obj["metadata"]["creationTimestamp"] = json!(now.to_string());
                }
            }
        }
        if res.generation {
            let generation = match cur {
                None => 1,
                Some(c) => {
                    let g = c["metadata"]["generation"].as_i64().unwrap_or(1);
                    if spec_of(c) == spec_of(obj) { g } else { g + 1 }
                }
            };
            obj["metadata"]["generation"] = json!(generation);
        }
    }

    /// Validates `obj` as the API server would for its kind: the CRD schema (pruning nulls and
    /// filling defaults, as the API server does) or the built-in rules the fake knows.
    fn validate(res: Res, obj: &mut Value) -> Vec<schema::Cause> {
        let mut causes = Vec::new();
        if obj["metadata"]["name"].as_str().is_none_or(str::is_empty) {
            causes.push(schema::Cause {
                reason: "FieldValueRequired",
                message: "Required value: name or generateName is required".into(),
                field: "metadata.name".into(),
            });
        }
        if let Some(file) = res.crd
            && let Some(c) = crd_schemas().and_then(|m| m.get(file))
        {
            causes.extend(c.schema.validate_root(obj));
        }
        if res.group_version == "events.k8s.io/v1" {
            causes.extend(event_causes(obj));
        }
        causes
    }

    /// Creates or replaces an object (as a controller would: the whole object, status
    /// included). Server-managed metadata is set as for any write; objects of a CRD kind must
    /// pass its schema.
    ///
    /// # Panics
    /// When the object is invalid for its kind (a broken test).
    pub fn apply(&self, obj: Value) -> u64 {
        match self.try_apply(obj) {
            Ok(rv) => rv,
            Err(status) => panic!("fake api: apply refused: {}", status["message"]),
        }
    }

    /// [`FakeApi::apply`], answering the 422 `Status` instead of panicking when the object is
    /// invalid.
    pub fn try_apply(&self, mut obj: Value) -> Result<u64, Value> {
        let kind = obj["kind"].as_str().unwrap_or_default().to_string();
        let api_version = obj["apiVersion"].as_str().unwrap_or_default();
        let res = RESOURCES
            .iter()
            .find(|r| r.kind == kind && r.group_version == api_version)
            .copied()
            .unwrap_or_else(|| res_by_kind(&kind));
        let key = key_of(&obj);
        let rv = {
            let mut st = self.lock();
            let cur = st.objects.get(&res.id()).and_then(|m| m.get(&key)).cloned();
            Self::stamp(&mut st, res, cur.as_ref(), &mut obj);
            let causes = Self::validate(res, &mut obj);
            if !causes.is_empty() {
                return Err(invalid_status(res, &key.1, &causes));
            }
            Self::write(&mut st, res, Some(obj), key)
        };
        self.notify(rv);
        Ok(rv)
    }

    /// Deletes an object; returns whether it existed.
    pub fn delete(&self, kind: &str, ns: Option<&str>, name: &str) -> bool {
        let res = res_by_kind(kind);
        let key = (ns.unwrap_or("").to_string(), name.to_string());
        let rv = {
            let mut st = self.lock();
            if !st
                .objects
                .get(&res.id())
                .is_some_and(|m| m.contains_key(&key))
            {
                return false;
            }
            Self::write(&mut st, res, None, key)
        };
        self.notify(rv);
        true
    }

    /// The stored object, if any (`kind` alone: for Event, `events.k8s.io/v1`).
    pub fn get(&self, kind: &str, ns: Option<&str>, name: &str) -> Option<Value> {
        self.get_raw(res_by_kind(kind), ns, name)
    }

    /// Every stored object of `api_version` `kind`, ordered by namespace and name.
    pub fn list_objects(&self, api_version: &str, kind: &str) -> Vec<Value> {
        let res = res_by_gvk(api_version, kind);
        self.lock()
            .objects
            .get(&res.id())
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Makes the next `n` writes (PUT or PATCH, main resource or `/status`) to the object
    /// answer 409 Conflict, as when another writer got there first.
    pub fn conflict_next_writes(&self, kind: &str, ns: Option<&str>, name: &str, n: u32) {
        let res = res_by_kind(kind);
        let key = (ns.unwrap_or("").to_string(), name.to_string());
        self.lock().conflicts.insert((res.id(), key), n);
    }

    /// Makes the next `n` writes to the object's `/status` subresource answer 409 Conflict
    /// (writes to the main resource go through): a writer whose spec write lands and whose
    /// status write does not.
    pub fn conflict_next_status_writes(&self, kind: &str, ns: Option<&str>, name: &str, n: u32) {
        let res = res_by_kind(kind);
        let key = (ns.unwrap_or("").to_string(), name.to_string());
        self.lock().status_conflicts.insert((res.id(), key), n);
    }

    /// Stores `obj` (as [`FakeApi::apply`] would) just before the next write to the same
    /// object is looked at, as when another writer got there first: that write then meets
    /// the new `resourceVersion`.
    pub fn apply_before_next_write(&self, obj: Value) {
        let kind = obj["kind"].as_str().unwrap_or_default();
        let res = res_by_gvk(obj["apiVersion"].as_str().unwrap_or_default(), kind);
        let key = key_of(&obj);
        self.lock().before_write.insert((res.id(), key), obj);
    }

    /// Answers every later list (not watch) of `kind` only after `delay`, as a slow or large
    /// collection would be: a client's watches of several kinds then sync in another order.
    pub fn delay_lists(&self, kind: &str, delay: std::time::Duration) {
        if let Some(r) = RESOURCES.iter().find(|r| r.kind == kind) {
            self.lock().slow_lists.insert(r.kind, delay);
        }
    }

    /// Makes the server slow, as a loaded API server in front of a slow etcd is: every later
    /// request but a watch is answered after a random delay between `min` and `max`, half
    /// of it before the request is carried out and half after (so a write's watch event
    /// usually reaches watchers before the writer has its answer). The delays are drawn
    /// from a generator seeded with `seed`, one per request in the order requests arrive.
    pub fn delay_answers(&self, min: Duration, max: Duration, seed: u64) {
        self.lock().slow_answers = Some((min, max.max(min), seed));
    }

    /// The next delay of [`FakeApi::delay_answers`], if it is on (splitmix64).
    fn answer_delay(&self) -> Option<Duration> {
        let mut st = self.lock();
        let (min, max, state) = st.slow_answers.as_mut()?;
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let span = (*max - *min).as_micros() as u64 + 1;
        Some(*min + Duration::from_micros(z % span))
    }

    /// Refuses every later request for `kind` with 403 Forbidden, as an API server does when
    /// the caller's RBAC does not grant the resource.
    pub fn forbid(&self, kind: &str) {
        if let Some(r) = RESOURCES.iter().find(|r| r.kind == kind) {
            self.lock().forbidden.insert(r.kind);
        }
    }

    /// Answers every later request for `kind` with 404, as an API server without its CRD.
    pub fn hide(&self, kind: &str) {
        if let Some(r) = RESOURCES.iter().find(|r| r.kind == kind) {
            self.lock().hidden.insert(r.kind);
        }
    }

    /// Every write request (POST, PUT, PATCH) received so far, in order, with the answer's code.
    pub fn writes(&self) -> Vec<Write> {
        self.writes_from(0)
    }

    /// The write requests from the `start`th on (what [`FakeApi::writes`] would list after
    /// its first `start`): a caller polling a long run reads only what is new.
    pub fn writes_from(&self, start: usize) -> Vec<Write> {
        self.lock().writes.get(start..).unwrap_or_default().to_vec()
    }

    /// Whether writes to the Karmada binding kinds are validated against the CRD schemas
    /// (false when the fixtures are absent; see [`karmada_crds_dir`]).
    pub fn validates_karmada_crds(&self) -> bool {
        crd_schemas().is_some()
    }

    /// Cuts every open watch connection mid-event, then runs `f` before any watch can resume
    /// (the watchers see `f`'s changes only through replay on reconnect).
    pub fn drop_watches_and<R>(&self, f: impl FnOnce(&FakeApi) -> R) -> R {
        self.lock().drop_gen += 1;
        self.notify(0);
        f(self)
    }

    /// Cuts every open watch connection mid-event.
    pub fn drop_watches(&self) {
        self.drop_watches_and(|_| ());
    }

    /// Forgets the event log up to now: watches resuming from older versions get 410.
    pub fn compact(&self) {
        let mut st = self.lock();
        st.compacted = st.rv;
        let c = st.compacted;
        st.log.retain(|e| e.rv > c);
    }

    /// Requests seen so far, as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    /// Lease creations and updates accepted so far.
    pub fn lease_writes(&self) -> u64 {
        self.lock().lease_writes
    }

    /// Makes TokenReview accept `token` as `user` in `groups`.
    pub fn add_token(&self, token: &str, user: &str, groups: &[&str]) {
        self.lock().tokens.insert(
            token.to_owned(),
            (
                user.to_owned(),
                groups.iter().map(|g| g.to_string()).collect(),
            ),
        );
    }

    /// TokenReviews answered so far.
    pub fn token_reviews(&self) -> u64 {
        self.lock().token_reviews
    }

    /// Answers a TokenReview as the API server's token authenticators would.
    fn review(&self, body: &[u8]) -> Response<Body> {
        let Ok(review) = serde_json::from_slice::<Value>(body) else {
            return err(400, "BadRequest", "the request body is not JSON");
        };
        let Some(token) = review["spec"]["token"].as_str() else {
            return err(422, "Invalid", "spec.token: Required value");
        };
        let mut st = self.lock();
        st.token_reviews += 1;
        let status = match st.tokens.get(token) {
            Some((user, groups)) => json!({
                "authenticated": true,
                "user": {"username": user, "uid": format!("uid-{user}"), "groups": groups},
            }),
            None => json!({"authenticated": false, "error": "invalid bearer token"}),
        };
        full(
            StatusCode::CREATED,
            &json!({
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "metadata": {"creationTimestamp": null},
                "spec": review["spec"].clone(),
                "status": status,
            }),
        )
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let watch = query(req.uri().query())
            .get("watch")
            .is_some_and(|w| w == "true" || w == "1");
        let Some(delay) = (!watch).then(|| self.answer_delay()).flatten() else {
            return self.serve(req).await;
        };
        tokio::time::sleep(delay / 2).await;
        let answer = self.serve(req).await;
        tokio::time::sleep(delay - delay / 2).await;
        answer
    }

    async fn serve(&self, req: Request<Incoming>) -> Response<Body> {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let q = query(req.uri().query());
        self.lock().requests.push(format!(
            "{method} {path}{}",
            req.uri()
                .query()
                .map(|q| format!("?{q}"))
                .unwrap_or_default()
        ));
        if path == "/version" {
            return full(
                StatusCode::OK,
                &json!({"major": "1", "minor": "36+", "gitVersion": "v1.36.0-fake", "gitCommit": "0",
                    "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25",
                    "compiler": "gc", "platform": "linux/amd64"}),
            );
        }
        if method == Method::POST && path == "/apis/authentication.k8s.io/v1/tokenreviews" {
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            return self.review(&body);
        }
        if method == Method::GET
            && let Some(found) = discovery(&path)
        {
            return found;
        }
        let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let (gv, rest): (String, &[&str]) = match segs.as_slice() {
            ["api", v, rest @ ..] => (v.to_string(), rest),
            ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
            _ => return not_found(),
        };
        let (ns, plural, name, sub) = match rest {
            ["namespaces", ns, plural] => (Some(*ns), *plural, None, None),
            ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name), None),
            ["namespaces", ns, plural, name, sub] => (Some(*ns), *plural, Some(*name), Some(*sub)),
            [plural] => (None, *plural, None, None),
            [plural, name] => (None, *plural, Some(*name), None),
            [plural, name, sub] => (None, *plural, Some(*name), Some(*sub)),
            _ => return not_found(),
        };
        let Some(res) = RESOURCES
            .iter()
            .find(|r| r.plural == plural && r.group_version == gv)
            .copied()
        else {
            return not_found();
        };
        // A namespaced kind's single objects live under a namespace; a cluster-scoped kind has none.
        let scope_ok = if res.namespaced {
            (name.is_none() && method != Method::POST) || ns.is_some()
        } else {
            ns.is_none()
        };
        let sub_ok = match sub {
            None => true,
            Some("status") => res.status,
            Some(_) => false,
        };
        if !scope_ok || !sub_ok {
            return not_found();
        }
        let (forbidden, hidden) = {
            let st = self.lock();
            (
                st.forbidden.contains(res.kind),
                st.hidden.contains(res.kind),
            )
        };
        if hidden {
            return not_found();
        }
        if forbidden {
            return err(
                403,
                "Forbidden",
                &format!("{} is forbidden: the fake grants nothing on it", res.plural),
            );
        }
        let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
        if method == Method::GET && name.is_none() && !watching {
            let delay = self.lock().slow_lists.get(res.kind).copied();
            if let Some(d) = delay {
                tokio::time::sleep(d).await;
            }
        }
        let content_type = req
            .headers()
            .get("content-type")
            .and_then(|c| c.to_str().ok())
            .unwrap_or("")
            .to_string();
        match (method, name) {
            (Method::GET, None) if q.get("watch").is_some_and(|w| w == "true" || w == "1") => {
                self.watch(res, ns, &q)
            }
            (Method::GET, None) => self.list(res, ns, &q),
            (Method::GET, Some(name)) => match self.get_raw(res, ns, name) {
                Some(v) => full(StatusCode::OK, &v),
                None => err(
                    404,
                    "NotFound",
                    &format!("{} \"{name}\" not found", qualified(res)),
                ),
            },
            (m @ (Method::POST | Method::PUT | Method::PATCH), name) => {
                let create = m == Method::POST;
                if create != name.is_none() {
                    return err(
                        405,
                        "MethodNotAllowed",
                        "the server does not allow this method on the requested resource",
                    );
                }
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let parsed = serde_json::from_slice::<Value>(&body).ok();
                let write = Op {
                    method: m.clone(),
                    res,
                    ns,
                    name: name.map(str::to_string),
                    sub: sub.map(str::to_string),
                    content_type: content_type.clone(),
                };
                let (resp, code, obj_name) = self.commit(&write, parsed.as_ref());
                self.lock().writes.push(Write {
                    method: m.to_string(),
                    kind: res.kind,
                    api_version: res.group_version,
                    namespace: ns.map(str::to_string),
                    name: obj_name,
                    subresource: write.sub,
                    content_type,
                    body: parsed.unwrap_or(Value::Null),
                    code,
                    at: std::time::Instant::now(),
                });
                resp
            }
            _ => err(
                405,
                "MethodNotAllowed",
                "not supported by the fake API server",
            ),
        }
    }

    fn get_raw(&self, res: Res, ns: Option<&str>, name: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(&res.id())
            .and_then(|m| m.get(&(ns.unwrap_or("").to_string(), name.to_string())))
            .cloned()
    }

    fn list(&self, res: Res, ns: Option<&str>, q: &BTreeMap<String, String>) -> Response<Body> {
        if q.contains_key("labelSelector") {
            return err(
                400,
                "BadRequest",
                "label selectors are not supported by the fake API server",
            );
        }
        let sel = match parse_selector(q.get("fieldSelector")) {
            Ok(s) => s,
            Err(e) => return err(400, "BadRequest", &e),
        };
        let limit: usize = q
            .get("limit")
            .and_then(|l| l.parse().ok())
            .filter(|l| *l > 0)
            .unwrap_or(usize::MAX);
        let st = self.lock();
        let (snapshot_rv, after): (u64, Option<ObjKey>) = match q
            .get("continue")
            .filter(|c| !c.is_empty())
        {
            Some(tok) => {
                let parts: Vec<&str> = tok.splitn(3, '|').collect();
                let [rv, kns, kname] = parts.as_slice() else {
                    return err(400, "BadRequest", "invalid continue token");
                };
                let rv: u64 = rv.parse().unwrap_or(0);
                if rv <= st.compacted && rv != st.rv {
                    return err(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                    );
                }
                (rv, Some((kns.to_string(), kname.to_string())))
            }
            None => (st.rv, None),
        };
        let empty = BTreeMap::new();
        let objects = st.objects.get(&res.id()).unwrap_or(&empty);
        let mut items = Vec::new();
        let mut next = None;
        for (k, v) in objects {
            if after.as_ref().is_some_and(|a| k <= a) || !selects(&sel, ns, v) {
                continue;
            }
            if items.len() == limit {
                next = items.last().map(|last: &Value| {
                    let (a, b) = key_of(last);
                    format!("{snapshot_rv}|{a}|{b}")
                });
                break;
            }
            items.push(v.clone());
        }
        let mut meta = json!({"resourceVersion": snapshot_rv.to_string()});
        if let Some(c) = next {
            meta["continue"] = json!(c);
            meta["remainingItemCount"] = json!(0);
        }
        full(
            StatusCode::OK,
            &json!({"kind": format!("{}List", res.kind), "apiVersion": res.group_version, "metadata": meta, "items": items}),
        )
    }

    /// One write (create, replace or merge patch, main resource or `/status`), as the API
    /// server runs it. Returns the answer, its code and the object's name.
    fn commit(&self, op: &Op, body: Option<&Value>) -> (Response<Body>, u16, String) {
        let res = op.res;
        let url_name = op.name.clone().unwrap_or_default();
        let fail = |code: u16, reason: &str, msg: &str, name: &str| {
            (err(code, reason, msg), code, name.to_string())
        };
        let is_patch = op.method == Method::PATCH;
        if is_patch && op.content_type != "application/merge-patch+json" {
            return fail(
                415,
                "UnsupportedMediaType",
                &format!(
                    "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json (the fake serves no other patch type; got {:?})",
                    op.content_type
                ),
                &url_name,
            );
        }
        let Some(body) = body.filter(|b| b.is_object()) else {
            return fail(
                400,
                "BadRequest",
                "the request body is not a JSON object",
                &url_name,
            );
        };
        let name = op
            .name
            .clone()
            .or_else(|| body["metadata"]["name"].as_str().map(str::to_string))
            .unwrap_or_default();
        let key = (op.ns.unwrap_or("").to_string(), name.clone());
        let mut st = self.lock();
        if let Some(other) = st.before_write.remove(&(res.id(), key.clone())) {
            drop(st);
            if let Err(status) = self.try_apply(other) {
                eprintln!(
                    "fake api: apply before write refused: {}",
                    status["message"]
                );
            }
            st = self.lock();
        }
        let cur = st.objects.get(&res.id()).and_then(|m| m.get(&key)).cloned();
        let mut obj = match (&cur, op.method.clone()) {
            (Some(_), Method::POST) => {
                return fail(
                    409,
                    "AlreadyExists",
                    &format!("{} \"{name}\" already exists", qualified(res)),
                    &name,
                );
            }
            (None, Method::POST) => body.clone(),
            (None, _) => {
                return fail(
                    404,
                    "NotFound",
                    &format!("{} \"{name}\" not found", qualified(res)),
                    &name,
                );
            }
            (Some(c), _) if is_patch => {
                let mut o = c.clone();
                merge_patch(&mut o, body);
                o
            }
            (Some(_), _) => body.clone(),
        };
        let conflict = format!(
            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
            qualified(res)
        );
        if let Some(c) = &cur {
            let forced = st.conflicts.get_mut(&(res.id(), key.clone()));
            if let Some(n) = forced.filter(|n| **n > 0) {
                *n -= 1;
                return fail(409, "Conflict", &conflict, &name);
            }
            if op.sub.as_deref() == Some("status") {
                let forced = st.status_conflicts.get_mut(&(res.id(), key.clone()));
                if let Some(n) = forced.filter(|n| **n > 0) {
                    *n -= 1;
                    return fail(409, "Conflict", &conflict, &name);
                }
            }
            let want = obj["metadata"]["resourceVersion"].as_str().unwrap_or("");
            if !want.is_empty() && want != c["metadata"]["resourceVersion"].as_str().unwrap_or("") {
                return fail(409, "Conflict", &conflict, &name);
            }
            let uid = obj["metadata"]["uid"].as_str().unwrap_or("");
            if !uid.is_empty() && uid != c["metadata"]["uid"].as_str().unwrap_or("") {
                return fail(
                    409,
                    "Conflict",
                    &format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                        c["metadata"]["uid"].as_str().unwrap_or("")
                    ),
                    &name,
                );
            }
        }
        if obj["metadata"]["name"].as_str().is_some_and(|n| n != name) && !name.is_empty() {
            return fail(
                400,
                "BadRequest",
                &format!(
                    "the name of the object ({}) does not match the name on the URL ({name})",
                    obj["metadata"]["name"].as_str().unwrap_or("")
                ),
                &name,
            );
        }
        match (op.ns, obj["metadata"]["namespace"].as_str()) {
            (Some(want), Some(got)) if want != got => {
                return fail(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                    &name,
                );
            }
            _ => {}
        }
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        obj["metadata"]["name"] = json!(name);
        if let Some(ns) = op.ns {
            obj["metadata"]["namespace"] = json!(ns);
        }
        obj["apiVersion"] = json!(res.group_version);
        obj["kind"] = json!(res.kind);
        // The status subresource splits what each endpoint may change.
        if let Some(c) = &cur
            && res.status
        {
            if op.sub.is_some() {
                let status = obj.get("status").cloned();
                obj = c.clone();
                set_or_remove(&mut obj, "status", status);
            } else {
                set_or_remove(&mut obj, "status", c.get("status").cloned());
            }
        } else if op.method == Method::POST && res.status {
            // A create through the main resource carries no status (the API server drops it).
            if let Some(m) = obj.as_object_mut() {
                m.remove("status");
            }
        }
        if res.plural == "podcertificaterequests"
            && let Err(message) = pcr_status_update(cur.as_ref(), &obj)
        {
            return fail(422, "Invalid", &message, &name);
        }
        Self::stamp(&mut st, res, cur.as_ref(), &mut obj);
        let causes = Self::validate(res, &mut obj);
        if !causes.is_empty() {
            let status = invalid_status(res, &name, &causes);
            return (full(StatusCode::UNPROCESSABLE_ENTITY, &status), 422, name);
        }
        if res.plural == "leases" {
            st.lease_writes += 1;
        }
        let rv = Self::write(&mut st, res, Some(obj), key.clone());
        let stored = st
            .objects
            .get(&res.id())
            .and_then(|m| m.get(&key))
            .cloned()
            .unwrap_or(Value::Null);
        drop(st);
        self.notify(rv);
        let code = if cur.is_none() {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        };
        (full(code, &stored), code.as_u16(), name)
    }

    fn watch(&self, res: Res, ns: Option<&str>, q: &BTreeMap<String, String>) -> Response<Body> {
        if q.contains_key("labelSelector") {
            return err(
                400,
                "BadRequest",
                "label selectors are not supported by the fake API server",
            );
        }
        let sel = match parse_selector(q.get("fieldSelector")) {
            Ok(s) => s,
            Err(e) => return err(400, "BadRequest", &e),
        };
        let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
        let timeout = Duration::from_secs(
            q.get("timeoutSeconds")
                .and_then(|t| t.parse().ok())
                .unwrap_or(1800),
        );
        let from: Option<u64> = q
            .get("resourceVersion")
            .and_then(|r| r.parse().ok())
            .filter(|r| *r != 0);
        let ns = ns.map(str::to_string);
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(64);
        let api = self.clone();
        let mut changed = self.changed.subscribe();
        tokio::spawn(async move {
            let line = |t: &str, o: &Value| -> Bytes {
                let mut v =
                    serde_json::to_vec(&json!({"type": t, "object": o})).unwrap_or_default();
                v.push(b'\n');
                Bytes::from(v)
            };
            let mut initial = Vec::new();
            let (start_gen, mut cursor, too_old) = {
                let st = api.lock();
                match from {
                    Some(rv) if rv < st.compacted => (
                        st.drop_gen,
                        rv,
                        Some(format!(
                            "too old resource version: {rv} ({})",
                            st.compacted + 1
                        )),
                    ),
                    Some(rv) => (st.drop_gen, rv, None),
                    None => {
                        if let Some(m) = st.objects.get(&res.id()) {
                            for v in m.values().filter(|v| selects(&sel, ns.as_deref(), v)) {
                                initial.push(line("ADDED", v));
                            }
                        }
                        (st.drop_gen, st.rv, None)
                    }
                }
            };
            if let Some(msg) = too_old {
                let _ = tx
                    .send(Ok(Frame::data(line(
                        "ERROR",
                        &status(410, "Expired", &msg),
                    ))))
                    .await;
                return;
            }
            for l in initial {
                if tx.send(Ok(Frame::data(l))).await.is_err() {
                    return;
                }
            }
            let deadline = tokio::time::Instant::now() + timeout;
            let mut last_bookmark = tokio::time::Instant::now();
            loop {
                let mut out = Vec::new();
                let mut cut = false;
                let mut gone = None;
                {
                    let st = api.lock();
                    if st.drop_gen != start_gen {
                        cut = true;
                    } else if cursor < st.compacted {
                        gone = Some(format!(
                            "too old resource version: {cursor} ({})",
                            st.compacted + 1
                        ));
                    } else {
                        // The log is in version order: start after the cursor.
                        let first = st.log.partition_point(|e| e.rv <= cursor);
                        for e in st.log[first..].iter().filter(|e| e.res == res.id()) {
                            let was = e
                                .old
                                .as_ref()
                                .is_some_and(|o| selects(&sel, ns.as_deref(), o));
                            let is = e
                                .new
                                .as_ref()
                                .is_some_and(|o| selects(&sel, ns.as_deref(), o));
                            match (was, is, &e.new, &e.old) {
                                (false, true, Some(n), _) => out.push(line("ADDED", n)),
                                (true, true, Some(n), _) => out.push(line("MODIFIED", n)),
                                (true, false, Some(n), _) => out.push(line("DELETED", n)),
                                (true, false, None, Some(o)) => out.push(line("DELETED", o)),
                                _ => {}
                            }
                        }
                        cursor = st.rv;
                    }
                }
                if cut {
                    // Half an event line, then an abrupt close inside the chunked body.
                    let _ = tx
                        .send(Ok(Frame::data(Bytes::from_static(
                            b"{\"type\":\"MODIFIED\",\"object\":{\"kind\"",
                        ))))
                        .await;
                    let _ = tx
                        .send(Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionReset,
                            "watch dropped by test",
                        )))
                        .await;
                    return;
                }
                if let Some(msg) = gone {
                    let _ = tx
                        .send(Ok(Frame::data(line(
                            "ERROR",
                            &status(410, "Expired", &msg),
                        ))))
                        .await;
                    return;
                }
                let sent_any = !out.is_empty();
                for l in out {
                    if tx.send(Ok(Frame::data(l))).await.is_err() {
                        return;
                    }
                }
                if bookmarks && !sent_any && last_bookmark.elapsed() >= api.bookmark_every {
                    last_bookmark = tokio::time::Instant::now();
                    let bm = json!({"kind": res.kind, "apiVersion": res.group_version,
                        "metadata": {"resourceVersion": cursor.to_string()}});
                    if tx
                        .send(Ok(Frame::data(line("BOOKMARK", &bm))))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                if tokio::time::Instant::now() >= deadline {
                    return; // clean end of the chunked response, as at timeoutSeconds
                }
                tokio::select! {
                    _ = changed.changed() => {}
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                    () = tx.closed() => return,
                }
            }
        });
        let body = StreamBody::new(tokio_stream_from(rx));
        let mut r = Response::new(BodyExt::boxed(body));
        r.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        r
    }
}

fn tokio_stream_from(
    mut rx: mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>,
) -> impl futures::Stream<Item = Result<Frame<Bytes>, std::io::Error>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// A write request, routed.
struct Op<'a> {
    method: Method,
    res: Res,
    ns: Option<&'a str>,
    name: Option<String>,
    sub: Option<String>,
    content_type: String,
}

fn not_found() -> Response<Body> {
    err(
        404,
        "NotFound",
        "the server could not find the requested resource",
    )
}

/// `plural.group` as the API server names a resource in messages (`pods` for the core group).
fn qualified(res: Res) -> String {
    match res.group() {
        "" => res.plural.to_string(),
        g => format!("{}.{g}", res.plural),
    }
}

/// The API server's rules for a PodCertificateRequest's status that a signer could break: at
/// most one of the final conditions `Issued`, `Denied`, `Failed` (status `True`), a final
/// status never changes again, and an `Issued` one carries the chain and its three times.
fn pcr_status_update(cur: Option<&Value>, new: &Value) -> Result<(), String> {
    const FINAL: [&str; 3] = ["Issued", "Denied", "Failed"];
    let finals = |v: &Value| -> Vec<String> {
        v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["type"].as_str())
            .filter(|t| FINAL.contains(t))
            .map(str::to_owned)
            .collect()
    };
    let now = finals(new);
    if now.len() > 1 {
        return Err(format!(
            "status.conditions: there may be at most one condition with type \"Issued\", \"Denied\", or \"Failed\" (got {now:?})"
        ));
    }
    if let Some(cur) = cur
        && !finals(cur).is_empty()
        && cur.get("status") != new.get("status")
    {
        return Err(
            "status: immutable after PodCertificateRequest is issued, denied, or failed".into(),
        );
    }
    match now.first().map(String::as_str) {
        Some("Issued") => pcr_issued(new),
        Some(_) => {
            for f in [
                "certificateChain",
                "notBefore",
                "notAfter",
                "beginRefreshAt",
            ] {
                if !new["status"][f].is_null() {
                    return Err(format!(
                        "status.{f}: non-condition status fields must be empty when denying or failing the PodCertificateRequest"
                    ));
                }
            }
            Ok(())
        }
        None => Ok(()),
    }
}

/// The API server's checks of an `Issued` status against the request and the leaf
/// certificate: issued to the requested key, times equal to the leaf's, `notBefore` within
/// 5 minutes of now, a lifetime in `[1h, maxExpirationSeconds]`, `beginRefreshAt` in
/// `[notBefore+10m, notAfter-10m]`.
fn pcr_issued(new: &Value) -> Result<(), String> {
    use x509_parser::prelude::FromDer as _;
    let st = &new["status"];
    let time = |f: &str| -> Result<i64, String> {
        st[f]
            .as_str()
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map(|t| t.as_second())
            .ok_or_else(|| {
                format!("status.{f}: Required value: must be present and consistent with the issued certificate")
            })
    };
    let (nb, na, refresh) = (
        time("notBefore")?,
        time("notAfter")?,
        time("beginRefreshAt")?,
    );
    let chain = st["certificateChain"].as_str().unwrap_or_default();
    let (_, pem) = x509_parser::pem::parse_x509_pem(chain.as_bytes()).map_err(|_| {
        "status.certificateChain: issued certificate chain must contain at least one certificate"
            .to_string()
    })?;
    let (_, leaf) = x509_parser::parse_x509_certificate(&pem.contents).map_err(|_| {
        "status.certificateChain: leaf certificate does not parse as valid X.509".to_string()
    })?;
    let bytes = |f: &str| -> Vec<u8> {
        serde_json::from_value::<k8s_openapi::ByteString>(new["spec"][f].clone())
            .map(|b| b.0)
            .unwrap_or_default()
    };
    let csr = bytes("stubPKCS10Request");
    let want = if csr.is_empty() {
        bytes("pkixPublicKey")
    } else {
        x509_parser::certification_request::X509CertificationRequest::from_der(&csr)
            .map(|(_, r)| r.certification_request_info.subject_pki.raw.to_vec())
            .unwrap_or_default()
    };
    if leaf.public_key().raw != want.as_slice() {
        return Err(
            "status.certificateChain: leaf certificate was not issued to the requested public key"
                .into(),
        );
    }
    if nb != leaf.validity().not_before.timestamp() {
        return Err(
            "status.notBefore: must be set to the NotBefore time encoded in the leaf certificate"
                .into(),
        );
    }
    if na != leaf.validity().not_after.timestamp() {
        return Err(
            "status.notAfter: must be set to the NotAfter time encoded in the leaf certificate"
                .into(),
        );
    }
    if (nb - k8s_openapi::jiff::Timestamp::now().as_second()).abs() >= 300 {
        return Err(
            "status.notBefore: must be set to within 5 minutes of kube-apiserver's current time"
                .into(),
        );
    }
    let max = new["spec"]["maxExpirationSeconds"]
        .as_i64()
        .unwrap_or(86_400);
    if na - nb < 3600 || na - nb > max {
        return Err(format!(
            "status.certificateChain: leaf certificate lifetime must be >= 1 hour and <= spec.maxExpirationSeconds ({max})"
        ));
    }
    if refresh < nb + 600 || refresh > na - 600 {
        return Err(
            "status.beginRefreshAt: must be at least 10 minutes after status.notBefore and before status.notAfter"
                .into(),
        );
    }
    Ok(())
}

/// Everything `metadata.generation` counts: the object without `metadata` and `status`.
fn spec_of(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    v
}

fn set_or_remove(obj: &mut Value, field: &str, v: Option<Value>) {
    if let Some(m) = obj.as_object_mut() {
        match v {
            Some(v) => {
                m.insert(field.to_string(), v);
            }
            None => {
                m.remove(field);
            }
        }
    }
}

/// RFC 7386 JSON merge patch: objects merge key by key, `null` removes, anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(t) = target {
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// The 422 `Status` the API server answers for an invalid object.
fn invalid_status(res: Res, name: &str, causes: &[schema::Cause]) -> Value {
    let kind = match res.group() {
        "" => res.kind.to_string(),
        g => format!("{}.{g}", res.kind),
    };
    let listed: Vec<String> = causes
        .iter()
        .map(|c| format!("{}: {}", c.field, c.message))
        .collect();
    let what = if listed.len() == 1 {
        listed[0].clone()
    } else {
        format!("[{}]", listed.join(", "))
    };
    let causes: Vec<Value> = causes
        .iter()
        .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
        .collect();
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("{kind} \"{name}\" is invalid: {what}"),
        "reason": "Invalid",
        "details": {"name": name, "group": res.group(), "kind": res.kind, "causes": causes},
        "code": 422})
}

/// The API server's field checks for `events.k8s.io/v1` Events (`ValidateEventCreate`).
fn event_causes(ev: &Value) -> Vec<schema::Cause> {
    let mut out = Vec::new();
    let mut cause = |reason, message: String, field: &str| {
        out.push(schema::Cause {
            reason,
            message,
            field: field.to_string(),
        })
    };
    for (f, max) in [
        ("reportingController", 253),
        ("reportingInstance", 128),
        ("action", 128),
        ("reason", 128),
    ] {
        match ev[f].as_str() {
            None | Some("") => cause("FieldValueRequired", "Required value".into(), f),
            Some(s) if s.len() > max => cause(
                "FieldValueTooLong",
                format!("Too long: may not be more than {max} bytes"),
                f,
            ),
            Some(_) => {}
        }
    }
    if ev["eventTime"].as_str().is_none_or(str::is_empty) {
        cause("FieldValueRequired", "Required value".into(), "eventTime");
    }
    match ev["type"].as_str() {
        Some("Normal" | "Warning") => {}
        t => cause(
            "FieldValueInvalid",
            format!(
                "Invalid value: {t:?}: has invalid value, supported values are Normal and Warning"
            ),
            "type",
        ),
    }
    if ev["note"].as_str().is_some_and(|n| n.len() > 1024) {
        cause(
            "FieldValueInvalid",
            "Invalid value: can have at most 1024 characters".into(),
            "note",
        );
    }
    if ev["regarding"]["namespace"]
        .as_str()
        .is_some_and(|n| !n.is_empty() && Some(n) != ev["metadata"]["namespace"].as_str())
    {
        cause(
            "FieldValueInvalid",
            "Invalid value: does not match event.namespace".into(),
            "regarding.namespace",
        );
    }
    out
}

/// Discovery documents (`/api`, `/api/v1`, `/apis`, `/apis/<group>/<version>`) for the served kinds.
fn discovery(path: &str) -> Option<Response<Body>> {
    let path = path.trim_end_matches('/');
    let resources = |gv: &str| -> Vec<Value> {
        let mut out = Vec::new();
        for r in RESOURCES.iter().filter(|r| r.group_version == gv) {
            let verbs = ["create", "get", "list", "patch", "update", "watch"];
            out.push(
                json!({"name": r.plural, "singularName": r.kind.to_lowercase(),
                "namespaced": r.namespaced, "kind": r.kind, "verbs": verbs}),
            );
            if r.status {
                out.push(json!({"name": format!("{}/status", r.plural), "singularName": "",
                    "namespaced": r.namespaced, "kind": r.kind, "verbs": ["get", "patch", "update"]}));
            }
        }
        out
    };
    let doc = match path {
        "/api" => json!({"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}),
        "/api/v1" => json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1",
            "resources": resources("v1")}),
        "/apis" => {
            let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for r in RESOURCES.iter().filter(|r| !r.group().is_empty()) {
                let v = groups.entry(r.group()).or_default();
                if !v.contains(&r.group_version) {
                    v.push(r.group_version);
                }
            }
            let groups: Vec<Value> = groups
                .into_iter()
                .map(|(g, gvs)| {
                    let versions: Vec<Value> = gvs
                        .iter()
                        .map(|gv| json!({"groupVersion": gv, "version": gv.split_once('/').map(|(_, v)| v).unwrap_or(gv)}))
                        .collect();
                    json!({"name": g, "versions": versions, "preferredVersion": versions[0]})
                })
                .collect();
            json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        }
        p => {
            let gv = p.strip_prefix("/apis/")?;
            if gv.split('/').count() != 2 || !RESOURCES.iter().any(|r| r.group_version == gv) {
                return None;
            }
            json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
                "resources": resources(gv)})
        }
    };
    Some(full(StatusCode::OK, &doc))
}

/// The kind's plural served by the fake (for request-log assertions).
pub fn plural(kind: &str) -> &'static str {
    res_by_kind(kind).plural
}

#[cfg(test)]
mod tests {
    use super::merge_patch;
    use serde_json::json;

    /// The examples of RFC 7386, appendix A.
    #[test]
    fn merge_patch_follows_rfc_7386() {
        let cases = [
            (json!({"a": "b"}), json!({"a": "c"}), json!({"a": "c"})),
            (
                json!({"a": "b"}),
                json!({"b": "c"}),
                json!({"a": "b", "b": "c"}),
            ),
            (json!({"a": "b"}), json!({"a": null}), json!({})),
            (
                json!({"a": "b", "b": "c"}),
                json!({"a": null}),
                json!({"b": "c"}),
            ),
            (json!({"a": ["b"]}), json!({"a": "c"}), json!({"a": "c"})),
            (json!({"a": "c"}), json!({"a": ["b"]}), json!({"a": ["b"]})),
            (
                json!({"a": {"b": "c"}}),
                json!({"a": {"b": "d", "c": null}}),
                json!({"a": {"b": "d"}}),
            ),
            (
                json!({"a": [{"b": "c"}]}),
                json!({"a": [1]}),
                json!({"a": [1]}),
            ),
            (json!(["a", "b"]), json!(["c", "d"]), json!(["c", "d"])),
            (json!({"a": "b"}), json!(["c"]), json!(["c"])),
            (json!({"a": "foo"}), json!(null), json!(null)),
            (json!({"a": "foo"}), json!("bar"), json!("bar")),
            (
                json!({"e": null}),
                json!({"a": 1}),
                json!({"e": null, "a": 1}),
            ),
            (
                json!([1, 2]),
                json!({"a": "b", "c": null}),
                json!({"a": "b"}),
            ),
            (
                json!({}),
                json!({"a": {"bb": {"ccc": null}}}),
                json!({"a": {"bb": {}}}),
            ),
        ];
        for (target, patch, want) in cases {
            let mut got = target.clone();
            merge_patch(&mut got, &patch);
            assert_eq!(got, want, "{target} + {patch}");
        }
    }
}
