//! Tests only (a dev-dependency, never published): an in-process fake Kubernetes API server
//! speaking the list/watch protocol over plain HTTP/1.1, for driving the real kube client in
//! tests (the agent's watchers and Leases, the replica's TokenReview).
//!
//! Implemented faithfully enough for kube-runtime's watcher and our Lease code:
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
//!   close after half an event line), [`FakeApi::compact`] forgets the event log;
//! - single-object GET/POST/PUT (Leases) with `resourceVersion` optimistic concurrency: 409
//!   Conflict on a stale version, 409 AlreadyExists on a duplicate create;
//! - `POST /apis/authentication.k8s.io/v1/tokenreviews`: `authenticated: true` with the user
//!   and groups of a token registered by [`FakeApi::add_token`], else `authenticated: false`
//!   with an error; [`FakeApi::token_reviews`] counts the reviews;
//! - `/version`.
//!
//! Not implemented: label selectors (400), DELETE/PATCH over HTTP (tests mutate state
//! directly), consistent snapshots across list pages (later pages read current state; the
//! watch from the pinned version replays whatever changed, as a real watch would).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
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
}

const RESOURCES: &[Res] = &[
    Res {
        plural: "nodes",
        group_version: "v1",
        kind: "Node",
    },
    Res {
        plural: "pods",
        group_version: "v1",
        kind: "Pod",
    },
    Res {
        plural: "resourceslices",
        group_version: "resource.k8s.io/v1",
        kind: "ResourceSlice",
    },
    Res {
        plural: "deviceclasses",
        group_version: "resource.k8s.io/v1",
        kind: "DeviceClass",
    },
    Res {
        plural: "resourceclaims",
        group_version: "resource.k8s.io/v1",
        kind: "ResourceClaim",
    },
    Res {
        plural: "devicetaintrules",
        group_version: "resource.k8s.io/v1beta2",
        kind: "DeviceTaintRule",
    },
    Res {
        plural: "leases",
        group_version: "coordination.k8s.io/v1",
        kind: "Lease",
    },
];

fn res_by_kind(kind: &str) -> Res {
    *RESOURCES
        .iter()
        .find(|r| r.kind == kind)
        .unwrap_or_else(|| panic!("fake api: unknown kind {kind}"))
}

type ObjKey = (String, String); // (namespace or "", name)

struct LogEvent {
    rv: u64,
    plural: &'static str,
    /// Object before the change (None for creations).
    old: Option<Value>,
    /// Object after the change (None for deletions).
    new: Option<Value>,
}

#[derive(Default)]
struct St {
    rv: u64,
    objects: BTreeMap<&'static str, BTreeMap<ObjKey, Value>>,
    log: Vec<LogEvent>,
    /// Events at or below this version are forgotten.
    compacted: u64,
    drop_gen: u64,
    requests: Vec<String>,
    lease_writes: u64,
    /// Token -> (user, groups) for TokenReview.
    tokens: BTreeMap<String, (String, Vec<String>)>,
    token_reviews: u64,
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
        if !matches!(f, "metadata.name" | "metadata.namespace" | "spec.nodeName") {
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
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
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
        api
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

    fn write(st: &mut St, plural: &'static str, obj: Option<Value>, key: ObjKey) -> u64 {
        st.rv += 1;
        let rv = st.rv;
        let objects = st.objects.entry(plural).or_default();
        let old = objects.get(&key).cloned();
        let new = match obj {
            Some(mut o) => {
                o["metadata"]["resourceVersion"] = json!(rv.to_string());
                if o["metadata"]["uid"].is_null() {
                    o["metadata"]["uid"] = json!(format!("uid-{plural}-{}-{}", key.0, key.1));
                }
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
            plural,
            old,
            new,
        });
        rv
    }

    /// Creates or replaces an object (as a controller would).
    pub fn apply(&self, obj: Value) -> u64 {
        let kind = obj["kind"].as_str().unwrap_or_default().to_string();
        let res = res_by_kind(&kind);
        let rv = {
            let mut st = self.lock();
            Self::write(&mut st, res.plural, Some(obj.clone()), key_of(&obj))
        };
        self.notify(rv);
        rv
    }

    /// Deletes an object; returns whether it existed.
    pub fn delete(&self, kind: &str, ns: Option<&str>, name: &str) -> bool {
        let res = res_by_kind(kind);
        let key = (ns.unwrap_or("").to_string(), name.to_string());
        let rv = {
            let mut st = self.lock();
            if !st
                .objects
                .get(res.plural)
                .is_some_and(|m| m.contains_key(&key))
            {
                return false;
            }
            Self::write(&mut st, res.plural, None, key)
        };
        self.notify(rv);
        true
    }

    /// The stored object, if any.
    pub fn get(&self, kind: &str, ns: Option<&str>, name: &str) -> Option<Value> {
        let res = res_by_kind(kind);
        self.lock()
            .objects
            .get(res.plural)
            .and_then(|m| m.get(&(ns.unwrap_or("").to_string(), name.to_string())))
            .cloned()
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
        let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let (gv, rest): (String, &[&str]) = match segs.as_slice() {
            ["api", v, rest @ ..] => (v.to_string(), rest),
            ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
            _ => {
                return err(
                    404,
                    "NotFound",
                    "the server could not find the requested resource",
                );
            }
        };
        let (ns, plural, name) = match rest {
            ["namespaces", ns, plural] => (Some(*ns), *plural, None),
            ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
            [plural] => (None, *plural, None),
            [plural, name] => (None, *plural, Some(*name)),
            _ => {
                return err(
                    404,
                    "NotFound",
                    "the server could not find the requested resource",
                );
            }
        };
        let Some(res) = RESOURCES
            .iter()
            .find(|r| r.plural == plural && r.group_version == gv)
            .copied()
        else {
            return err(
                404,
                "NotFound",
                "the server could not find the requested resource",
            );
        };
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
                    &format!("{} \"{name}\" not found", res.plural),
                ),
            },
            (Method::POST, None) => {
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                self.create(res, ns, &body)
            }
            (Method::PUT, Some(name)) => {
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                self.replace(res, ns, name, &body)
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
            .get(res.plural)
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
        let objects = st.objects.get(res.plural).unwrap_or(&empty);
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

    fn create(&self, res: Res, ns: Option<&str>, body: &[u8]) -> Response<Body> {
        let Ok(mut obj) = serde_json::from_slice::<Value>(body) else {
            return err(400, "BadRequest", "invalid JSON body");
        };
        if let Some(ns) = ns {
            obj["metadata"]["namespace"] = json!(ns);
        }
        obj["apiVersion"] = json!(res.group_version);
        obj["kind"] = json!(res.kind);
        let key = key_of(&obj);
        let rv = {
            let mut st = self.lock();
            if st
                .objects
                .get(res.plural)
                .is_some_and(|m| m.contains_key(&key))
            {
                return err(
                    409,
                    "AlreadyExists",
                    &format!("{} \"{}\" already exists", res.plural, key.1),
                );
            }
            if res.plural == "leases" {
                st.lease_writes += 1;
            }
            Self::write(&mut st, res.plural, Some(obj), key.clone())
        };
        self.notify(rv);
        full(
            StatusCode::CREATED,
            &self.get_raw(res, ns, &key.1).unwrap_or(Value::Null),
        )
    }

    fn replace(&self, res: Res, ns: Option<&str>, name: &str, body: &[u8]) -> Response<Body> {
        let Ok(mut obj) = serde_json::from_slice::<Value>(body) else {
            return err(400, "BadRequest", "invalid JSON body");
        };
        if let Some(ns) = ns {
            obj["metadata"]["namespace"] = json!(ns);
        }
        obj["apiVersion"] = json!(res.group_version);
        obj["kind"] = json!(res.kind);
        let key = (ns.unwrap_or("").to_string(), name.to_string());
        let rv = {
            let mut st = self.lock();
            let Some(cur) = st.objects.get(res.plural).and_then(|m| m.get(&key)) else {
                return err(
                    404,
                    "NotFound",
                    &format!("{} \"{name}\" not found", res.plural),
                );
            };
            let want = obj["metadata"]["resourceVersion"].as_str().unwrap_or("");
            if !want.is_empty() && want != cur["metadata"]["resourceVersion"].as_str().unwrap_or("")
            {
                return err(
                    409,
                    "Conflict",
                    &format!(
                        "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                        res.plural
                    ),
                );
            }
            obj["metadata"]["uid"] = cur["metadata"]["uid"].clone();
            if res.plural == "leases" {
                st.lease_writes += 1;
            }
            Self::write(&mut st, res.plural, Some(obj), key)
        };
        self.notify(rv);
        full(
            StatusCode::OK,
            &self.get_raw(res, ns, name).unwrap_or(Value::Null),
        )
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
                        if let Some(m) = st.objects.get(res.plural) {
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
                        for e in st
                            .log
                            .iter()
                            .filter(|e| e.rv > cursor && e.plural == res.plural)
                        {
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

/// The kind's plural served by the fake (for request-log assertions).
pub fn plural(kind: &str) -> &'static str {
    res_by_kind(kind).plural
}
