//! The scheduler role's client of the Karmada API server: kube-rs I/O only, no decisions.
//!
//! What the scheduler loop calls, and what it may rely on:
//! - [`KarmadaClient::watch`]: a cache plus a change stream per [`Kind`] (ResourceBindings and
//!   ClusterResourceBindings filtered to `spec.schedulerName` = ours, Clusters,
//!   PriorityClasses). The cache is complete after each [`Change::Synced`]; a watch that falls
//!   behind (410 Gone) relists and reports what changed meanwhile, deletions included.
//! - [`KarmadaClient::get`], [`KarmadaClient::template`],
//!   [`KarmadaClient::resource_claim_template`]: reads on demand (the binding again after a
//!   conflict; `spec.resource` of any kind, found through discovery; ResourceClaimTemplates).
//! - [`KarmadaClient::patch`], [`KarmadaClient::patch_status`]: JSON merge patches of a binding
//!   and of its `/status`, bodies supplied by the caller as karmada-scheduler builds them,
//!   always conditional on the `resourceVersion` the caller read ([`BindingRef`]). A 409 is
//!   [`KarmadaError::Conflict`]: re-read and re-plan, never retried blindly here.
//! - [`KarmadaClient::event`]: an `events.k8s.io/v1` Event as kube's `Recorder` writes it
//!   (`events`: with a bounded cache), the note cut to the API server's 1 kB limit.
//!
//! Objects are handed over as the API server returned them ([`Object`]: the JSON value, its
//! parsed `metadata` beside it); typing them is the scheduling core's job. Every request but a
//! watch stops at [`KarmadaOptions::request_timeout`]; every answer is size-bounded
//! ([`KarmadaOptions::limits`], see [`bounded`]); every error names the object and, when
//! there was an answer, the HTTP status.

pub mod bounded;
mod events;
mod watch;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ApiResource, GroupVersionKind, Patch, PatchParams};
use kube::core::{DynamicResourceScope, GroupVersion};
use serde::Deserialize;
use serde_json::Value;

pub use bounded::{Limits, TooLarge};
pub use watch::{Cache, Change, ObjectKey, Watch};

/// The longest `note` the API server accepts on an `events.k8s.io/v1` Event.
const EVENT_NOTE_LIMIT: usize = 1024;

/// An object as the API server returned it, with its `metadata` parsed beside the value (kube's
/// watcher keys on it). The value is authoritative.
#[derive(Clone, Debug)]
pub struct Object {
    meta: ObjectMeta,
    value: Value,
}

impl Object {
    /// The object as served (JSON).
    pub fn value(&self) -> &Value {
        &self.value
    }

    /// `metadata`, parsed.
    pub fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    /// Namespace and name.
    pub fn key(&self) -> ObjectKey {
        ObjectKey {
            namespace: self.meta.namespace.clone(),
            name: self.meta.name.clone().unwrap_or_default(),
        }
    }
}

impl<'de> Deserialize<'de> for Object {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        let meta = match value.get("metadata") {
            Some(m) => ObjectMeta::deserialize(m).map_err(serde::de::Error::custom)?,
            None => ObjectMeta::default(),
        };
        Ok(Object { meta, value })
    }
}

impl kube::Resource for Object {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn kind(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.kind.as_str().into()
    }
    fn group(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.group.as_str().into()
    }
    fn version(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.version.as_str().into()
    }
    fn api_version(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.api_version.as_str().into()
    }
    fn plural(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.plural.as_str().into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }
    /// Required by the trait; kube's watcher never mutates. Changes here do not reach
    /// [`Object::value`].
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

/// The Karmada kinds the scheduler watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `work.karmada.io/v1alpha2` ResourceBinding (namespaced).
    ResourceBinding,
    /// `work.karmada.io/v1alpha2` ClusterResourceBinding.
    ClusterResourceBinding,
    /// `cluster.karmada.io/v1alpha1` Cluster.
    Cluster,
    /// `scheduling.k8s.io/v1` PriorityClass.
    PriorityClass,
}

impl Kind {
    fn api_resource(self) -> ApiResource {
        let (g, v, k, plural) = match self {
            Kind::ResourceBinding => (
                "work.karmada.io",
                "v1alpha2",
                "ResourceBinding",
                "resourcebindings",
            ),
            Kind::ClusterResourceBinding => (
                "work.karmada.io",
                "v1alpha2",
                "ClusterResourceBinding",
                "clusterresourcebindings",
            ),
            Kind::Cluster => ("cluster.karmada.io", "v1alpha1", "Cluster", "clusters"),
            Kind::PriorityClass => (
                "scheduling.k8s.io",
                "v1",
                "PriorityClass",
                "priorityclasses",
            ),
        };
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(g, v, k), plural)
    }

    fn is_binding(self) -> bool {
        matches!(self, Kind::ResourceBinding | Kind::ClusterResourceBinding)
    }

    /// `Kind ns/name` for messages.
    fn describe(self, namespace: Option<&str>, name: &str) -> String {
        let kind = self.api_resource().kind;
        match namespace {
            Some(ns) => format!("{kind} {ns}/{name}"),
            None => format!("{kind} {name}"),
        }
    }

    /// An `ObjectReference` to `obj` of this kind (the Event's `regarding`).
    pub fn reference(self, obj: &Object) -> ObjectReference {
        let ar = self.api_resource();
        ObjectReference {
            api_version: Some(ar.api_version),
            kind: Some(ar.kind),
            namespace: obj.meta.namespace.clone(),
            name: obj.meta.name.clone(),
            uid: obj.meta.uid.clone(),
            resource_version: obj.meta.resource_version.clone(),
            field_path: None,
        }
    }
}

/// A binding at the version the caller read: writes through it are conditional on that version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindingRef {
    /// [`Kind::ResourceBinding`] or [`Kind::ClusterResourceBinding`].
    pub kind: Kind,
    /// `None` for a ClusterResourceBinding.
    pub namespace: Option<String>,
    /// The binding's name.
    pub name: String,
    /// `metadata.resourceVersion` as read.
    pub resource_version: String,
}

impl BindingRef {
    /// The reference to `obj` as read; `None` if `kind` is not a binding kind or the object has
    /// no name or resourceVersion (never so for objects the API server returned).
    pub fn of(kind: Kind, obj: &Object) -> Option<BindingRef> {
        if !kind.is_binding() {
            return None;
        }
        Some(BindingRef {
            kind,
            namespace: obj.meta.namespace.clone(),
            name: obj.meta.name.clone()?,
            resource_version: obj.meta.resource_version.clone()?,
        })
    }

    fn describe(&self) -> String {
        self.kind.describe(self.namespace.as_deref(), &self.name)
    }
}

/// A binding's resource template (`spec.resource`): any kind the API server serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateRef {
    /// `apps/v1`, `batch/v1`, `v1`, ...
    pub api_version: String,
    /// `Deployment`, `StatefulSet`, `Job`, `Pod`, ...
    pub kind: String,
    /// The namespace (required for namespaced kinds).
    pub namespace: Option<String>,
    /// The name.
    pub name: String,
}

impl TemplateRef {
    fn describe(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{} {} {ns}/{}", self.api_version, self.kind, self.name),
            None => format!("{} {} {}", self.api_version, self.kind, self.name),
        }
    }
}

/// An Event to record on an object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventNote {
    /// `Warning` rather than `Normal`.
    pub warning: bool,
    /// Karmada's reason (`ScheduleBindingSucceed`, `ScheduleBindingFailed`, ...).
    pub reason: String,
    /// What was done (`Scheduling`, `Preempting`, ...).
    pub action: String,
    /// The human-readable message (cut to 1 kB on a character boundary).
    pub message: String,
}

/// How the client identifies itself and bounds its requests.
#[derive(Clone, Debug)]
pub struct KarmadaOptions {
    /// Bindings whose `spec.schedulerName` equals this are ours.
    pub scheduler_name: String,
    /// Events' `reportingController`.
    pub reporting_controller: String,
    /// Events' `reportingInstance` (the replica's name).
    pub reporting_instance: String,
    /// Deadline of every request except watches.
    pub request_timeout: Duration,
    /// Changes a watch buffers before it stops reading (back-pressure on a slow loop).
    pub change_buffer: usize,
    /// Size bounds of the answers (clients made by [`KarmadaClient::from_kubeconfig`]).
    pub limits: Limits,
}

impl KarmadaOptions {
    /// Options for `scheduler_name`, reporting as `dramesh-scheduler` from `instance`.
    pub fn new(scheduler_name: &str, instance: &str) -> KarmadaOptions {
        KarmadaOptions {
            scheduler_name: scheduler_name.to_string(),
            reporting_controller: "dramesh-scheduler".to_string(),
            reporting_instance: instance.to_string(),
            request_timeout: Duration::from_secs(10),
            change_buffer: 1024,
            limits: Limits::default(),
        }
    }
}

/// What went wrong talking to the Karmada API server.
#[derive(Debug, thiserror::Error)]
pub enum KarmadaError {
    /// The kubeconfig could not be read or used.
    #[error("karmada kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
    /// 409 Conflict: the object changed since it was read. Re-read and re-plan.
    #[error("{object}: conflict: {message}")]
    Conflict {
        /// `Kind ns/name`.
        object: String,
        /// The API server's message.
        message: String,
    },
    /// Any other answer that is not a success.
    #[error("{object}: HTTP {code} {reason}: {message}")]
    Api {
        /// `Kind ns/name`.
        object: String,
        /// The HTTP status.
        code: u16,
        /// The `Status` reason (`Invalid`, `Forbidden`, ...).
        reason: String,
        /// The API server's message (for 422, it names the fields).
        message: String,
    },
    /// No answer: connection, TLS or decoding trouble.
    #[error("{object}: {message}")]
    Transport {
        /// `Kind ns/name`.
        object: String,
        /// The client's error.
        message: String,
    },
    /// The answer passed its size bound.
    #[error("{object}: {bound}")]
    TooLarge {
        /// `Kind ns/name`.
        object: String,
        /// The request and the bound.
        bound: TooLarge,
    },
    /// No answer within the request deadline.
    #[error("{object}: no answer within {after:?}")]
    Timeout {
        /// `Kind ns/name`.
        object: String,
        /// The deadline.
        after: Duration,
    },
    /// The caller's input cannot be sent (the message names the field).
    #[error("{object}: {message}")]
    Request {
        /// `Kind ns/name`.
        object: String,
        /// Why.
        message: String,
    },
}

impl KarmadaError {
    /// The HTTP status of the answer, if there was one.
    pub fn status(&self) -> Option<u16> {
        match self {
            KarmadaError::Conflict { .. } => Some(409),
            KarmadaError::Api { code, .. } => Some(*code),
            _ => None,
        }
    }

    fn from_kube(object: String, e: kube::Error) -> KarmadaError {
        if let Some(t) = too_large(&e) {
            return KarmadaError::TooLarge {
                object,
                bound: TooLarge {
                    what: t.what,
                    request: t.request.clone(),
                    limit: t.limit,
                },
            };
        }
        match e {
            kube::Error::Api(s) if s.code == 409 && s.reason == "Conflict" => {
                KarmadaError::Conflict {
                    object,
                    message: s.message,
                }
            }
            kube::Error::Api(s) => KarmadaError::Api {
                object,
                code: s.code,
                reason: s.reason,
                message: s.message,
            },
            other => KarmadaError::Transport {
                object,
                message: other.to_string(),
            },
        }
    }
}

/// The [`TooLarge`] in `e`'s chain of causes, if any (an `io::Error` is looked into: its
/// `source` skips the error it wraps).
fn too_large<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a TooLarge> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<TooLarge>() {
            return Some(t);
        }
        cur = match err.downcast_ref::<std::io::Error>() {
            Some(io) => io
                .get_ref()
                .map(|inner| inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    None
}

/// The scheduler's Karmada API client. Cheap to share behind an `Arc`.
pub struct KarmadaClient {
    client: kube::Client,
    opts: KarmadaOptions,
    recorder: events::EventRecorder,
    /// Discovered template kinds: (apiVersion, kind) -> (resource, namespaced).
    kinds: Mutex<HashMap<(String, String), (ApiResource, bool)>>,
}

impl KarmadaClient {
    /// A client from a kubeconfig file's current context, its answers bounded by
    /// `opts.limits`.
    pub async fn from_kubeconfig(
        path: &Path,
        opts: KarmadaOptions,
    ) -> Result<KarmadaClient, KarmadaError> {
        let fail = |message: String| KarmadaError::Kubeconfig {
            path: path.display().to_string(),
            message,
        };
        let kubeconfig =
            kube::config::Kubeconfig::read_from(path).map_err(|e| fail(e.to_string()))?;
        if kubeconfig
            .current_context
            .as_deref()
            .is_none_or(str::is_empty)
        {
            return Err(fail("no current-context is set".into()));
        }
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .map_err(|e| fail(e.to_string()))?;
        let client = kube::client::ClientBuilder::try_from(config)
            .map_err(|e| fail(e.to_string()))?
            .with_layer(&bounded::BoundLayer(opts.limits))
            .build();
        Ok(KarmadaClient::new(client, opts))
    }

    /// A client over an existing kube client (its answers are bounded only if that client's
    /// are).
    pub fn new(client: kube::Client, opts: KarmadaOptions) -> KarmadaClient {
        let recorder = events::EventRecorder::new(
            client.clone(),
            opts.reporting_controller.clone(),
            opts.reporting_instance.clone(),
        );
        KarmadaClient {
            client,
            opts,
            recorder,
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// The scheduler name bindings are filtered on.
    pub fn scheduler_name(&self) -> &str {
        &self.opts.scheduler_name
    }

    /// Starts watching `kind` (bindings: only ours). Runs until the [`Watch`] is dropped.
    pub fn watch(&self, kind: Kind) -> Watch {
        let api: Api<Object> = Api::all_with(self.client.clone(), &kind.api_resource());
        let filter = kind.is_binding().then(|| self.opts.scheduler_name.clone());
        watch::start(api, filter, self.opts.change_buffer)
    }

    async fn deadline<T>(
        &self,
        object: &str,
        f: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, KarmadaError> {
        match tokio::time::timeout(self.opts.request_timeout, f).await {
            Ok(r) => r.map_err(|e| KarmadaError::from_kube(object.to_string(), e)),
            Err(_) => Err(KarmadaError::Timeout {
                object: object.to_string(),
                after: self.opts.request_timeout,
            }),
        }
    }

    fn api(&self, ar: &ApiResource, namespace: Option<&str>) -> Api<Object> {
        match namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, ar),
            None => Api::all_with(self.client.clone(), ar),
        }
    }

    /// Reads one object of `kind` now (not from the cache); `None` if it does not exist.
    pub async fn get(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Object>, KarmadaError> {
        let object = kind.describe(namespace, name);
        let api = self.api(&kind.api_resource(), namespace);
        self.deadline(&object, api.get_opt(name)).await
    }

    /// Reads a binding's resource template; `None` if it does not exist. The kind is found
    /// through discovery once and remembered.
    pub async fn template(&self, t: &TemplateRef) -> Result<Option<Object>, KarmadaError> {
        let object = t.describe();
        let key = (t.api_version.clone(), t.kind.clone());
        let known = self
            .kinds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .cloned();
        let (ar, namespaced) = match known {
            Some(k) => k,
            None => {
                let gv: GroupVersion =
                    t.api_version.parse().map_err(|e| KarmadaError::Request {
                        object: object.clone(),
                        message: format!("apiVersion {:?}: {e}", t.api_version),
                    })?;
                let gvk = gv.with_kind(&t.kind);
                let (ar, caps) = self
                    .deadline(&object, kube::discovery::pinned_kind(&self.client, &gvk))
                    .await?;
                let found = (ar, caps.scope == kube::discovery::Scope::Namespaced);
                self.kinds
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, found.clone());
                found
            }
        };
        let namespace = match (namespaced, t.namespace.as_deref()) {
            (true, Some(ns)) if !ns.is_empty() => Some(ns),
            (true, _) => {
                return Err(KarmadaError::Request {
                    object,
                    message: "spec.resource.namespace is required for a namespaced kind".into(),
                });
            }
            (false, _) => None,
        };
        let api = self.api(&ar, namespace);
        self.deadline(&object, api.get_opt(&t.name)).await
    }

    /// Reads a `resource.k8s.io/v1` ResourceClaimTemplate; `None` if it does not exist.
    pub async fn resource_claim_template(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Object>, KarmadaError> {
        let object = format!("ResourceClaimTemplate {namespace}/{name}");
        let ar = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceClaimTemplate"),
            "resourceclaimtemplates",
        );
        let api = self.api(&ar, Some(namespace));
        self.deadline(&object, api.get_opt(name)).await
    }

    /// Merge-patches the binding (`spec`, `metadata`; the API server ignores `status` here),
    /// conditional on `at.resource_version`. Returns the binding as written.
    pub async fn patch(&self, at: &BindingRef, body: &Value) -> Result<Object, KarmadaError> {
        self.patch_at(at, body, false).await
    }

    /// Merge-patches the binding's `/status` (the API server ignores all but `status`),
    /// conditional on `at.resource_version`. Returns the binding as written.
    pub async fn patch_status(
        &self,
        at: &BindingRef,
        body: &Value,
    ) -> Result<Object, KarmadaError> {
        self.patch_at(at, body, true).await
    }

    async fn patch_at(
        &self,
        at: &BindingRef,
        body: &Value,
        status: bool,
    ) -> Result<Object, KarmadaError> {
        let object = at.describe();
        if !at.kind.is_binding() {
            return Err(KarmadaError::Request {
                object,
                message: "only bindings are patched".into(),
            });
        }
        let mut body = body.clone();
        let Some(m) = body.as_object_mut() else {
            return Err(KarmadaError::Request {
                object,
                message: "a merge patch body must be a JSON object".into(),
            });
        };
        // The precondition: a 409 if anyone wrote since the caller read.
        let meta = m
            .entry("metadata")
            .or_insert_with(|| Value::Object(Default::default()));
        let Some(meta) = meta.as_object_mut() else {
            return Err(KarmadaError::Request {
                object,
                message: "metadata: must be an object".into(),
            });
        };
        meta.insert(
            "resourceVersion".into(),
            Value::String(at.resource_version.clone()),
        );
        let api = self.api(&at.kind.api_resource(), at.namespace.as_deref());
        let pp = PatchParams::default();
        let patch = Patch::Merge(&body);
        if status {
            self.deadline(&object, api.patch_status(&at.name, &pp, &patch))
                .await
        } else {
            self.deadline(&object, api.patch(&at.name, &pp, &patch))
                .await
        }
    }

    /// Records an Event regarding `regarding` (its namespace, or `default` for cluster-scoped
    /// objects, as kube's `Recorder` does; see [`events`]).
    pub async fn event(
        &self,
        regarding: &ObjectReference,
        note: &EventNote,
    ) -> Result<(), KarmadaError> {
        let object = format!(
            "Event on {} {}",
            regarding.kind.as_deref().unwrap_or(""),
            match &regarding.namespace {
                Some(ns) => format!("{ns}/{}", regarding.name.as_deref().unwrap_or("")),
                None => regarding.name.clone().unwrap_or_default(),
            }
        );
        let ev = events::NewEvent {
            warning: note.warning,
            reason: &note.reason,
            action: &note.action,
            note: cut(&note.message, EVENT_NOTE_LIMIT),
        };
        self.deadline(&object, self.recorder.publish(&ev, regarding))
            .await
    }
}

/// The longest prefix of `s` of at most `max` bytes ending on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_on_character_boundaries() {
        assert_eq!(cut("abc", 5), "abc");
        assert_eq!(cut("abcdef", 3), "abc");
        // 'é' is two bytes: cutting inside it backs off to before it.
        assert_eq!(cut("aé", 2), "a");
    }

    #[test]
    fn objects_keep_the_served_value_and_parse_metadata() {
        let o: Object = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "rb", "namespace": "ml", "resourceVersion": "7"},
            "spec": {"unknownToUs": 1}}))
        .unwrap();
        assert_eq!(o.meta().resource_version.as_deref(), Some("7"));
        assert_eq!(o.value()["spec"]["unknownToUs"], 1);
        let r = BindingRef::of(Kind::ResourceBinding, &o).unwrap();
        assert_eq!(r.resource_version, "7");
        assert!(BindingRef::of(Kind::Cluster, &o).is_none());
        let bad = serde_json::from_value::<Object>(serde_json::json!({"metadata": {"name": 3}}));
        assert!(bad.is_err());
    }
}
