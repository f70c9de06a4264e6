//! The kube source against an in-process fake API server (`dramesh-fakeapi`), driven by
//! the real kube client: initial chunked list, watch events, dropped watches, 410 re-lists,
//! node deletion, Lease handover between two agents, and the relay address the holder publishes
//! on the Lease for the other agents.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::time::Duration;

use dramesh_agent::{
    Batch, CoalesceConfig, KubeSourceConfig, LeaseConfig, RelayView, Scope, run_kube_source,
    spawn_coalescer,
};
use dramesh_fakeapi::FakeApi;
use dramesh_model::{ClusterObject, ObjectChange, ObjectKey, ObjectKind};
use dramesh_sim::{ClusterSpec, NodeGroup, NodeShape};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

const LIMIT: Duration = Duration::from_secs(30);

fn to_value(o: &ClusterObject) -> Value {
    serde_json::from_slice(&o.to_json()).unwrap()
}

/// A sim cluster with two A100 nodes (half their GPUs in use), plus a network-attached
/// slice and a claim allocated from it, and a DeviceTaintRule. Returns the node names.
fn seed(api: &FakeApi) -> Vec<String> {
    let cluster = dramesh_sim::generate(&ClusterSpec {
        name: "c1".into(),
        kubernetes_version: "1.36".into(),
        region: "us-east-1".into(),
        groups: vec![NodeGroup {
            shape: NodeShape::A100Efa,
            count: 2,
            used_fraction: 0.5,
        }],
    });
    let mut nodes = Vec::new();
    for o in &cluster.objects {
        match o {
            ClusterObject::ClusterInfo(_) => continue,
            ClusterObject::Node(n) => nodes.push(n.metadata.name.clone().unwrap()),
            _ => {}
        }
        let mut v = to_value(o);
        // Noise the agent must trim.
        v["metadata"]["managedFields"] = json!([{"manager": "kubelet", "operation": "Update"}]);
        v["metadata"]["annotations"] =
            json!({"kubectl.kubernetes.io/last-applied-configuration": "{}"});
        api.apply(v);
    }
    api.apply(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "fabric-switch-0"},
        "spec": {"driver": "dra.net", "allNodes": true,
            "pool": {"name": "fabric", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "vf-0"}]}}),
    );
    api.apply(json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "fabric-claim", "namespace": "ml"},
        "spec": {"devices": {"requests": [{"name": "vf", "exactly": {"deviceClassName": "efa.networking.k8s.aws"}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "vf", "driver": "dra.net", "pool": "fabric", "device": "vf-0"}]}}}}));
    api.apply(
        json!({"apiVersion": "resource.k8s.io/v1beta2", "kind": "DeviceTaintRule",
        "metadata": {"name": "drain-gpu-0"},
        "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "device": "gpu-0"},
            "taint": {"key": "maintenance", "effect": "NoSchedule"}}}),
    );
    nodes.sort();
    nodes
}

/// What a store would hold: records per scope.
#[derive(Default, Debug)]
struct View {
    scopes: HashMap<Scope, BTreeMap<ObjectKey, Value>>,
    batches: usize,
}

impl View {
    fn apply(&mut self, b: Batch) {
        self.batches += 1;
        let s = self.scopes.entry(b.scope.clone()).or_default();
        if b.snapshot {
            s.clear();
        }
        for c in b.changes {
            match c {
                ObjectChange::Upsert { key, json } => {
                    s.insert(key, serde_json::from_slice(&json).unwrap());
                }
                ObjectChange::Delete { key } => {
                    s.remove(&key);
                }
            }
        }
    }

    fn node(&self, n: &str) -> Option<&BTreeMap<ObjectKey, Value>> {
        self.scopes.get(&Scope::Node(n.to_string()))
    }

    fn cluster(&self, term: u64) -> Option<&BTreeMap<ObjectKey, Value>> {
        self.scopes.get(&Scope::Cluster { term })
    }

    fn has(&self, scope: &Scope, kind: ObjectKind, ns: Option<&str>, name: &str) -> bool {
        self.scopes
            .get(scope)
            .is_some_and(|s| s.contains_key(&ObjectKey::new(kind, ns, name)))
    }

    fn count(&self, scope: &Scope, kind: ObjectKind) -> usize {
        self.scopes
            .get(scope)
            .map_or(0, |s| s.keys().filter(|k| k.kind == kind).count())
    }
}

struct Agent {
    rx: mpsc::Receiver<Batch>,
    view: View,
    task: JoinHandle<Result<(), dramesh_agent::AgentError>>,
}

impl Agent {
    fn start(api: &FakeApi, node: &str, lease: Option<LeaseConfig>) -> Agent {
        let (tx, rx) = spawn_coalescer(CoalesceConfig {
            max_delay: Duration::from_millis(50),
            max_pending: 1000,
        });
        let mut cfg = KubeSourceConfig::new(node);
        cfg.page_size = Some(2); // several pages per list: exercises `continue`
        cfg.lease = lease;
        cfg.watch_device_taint_rules = true;
        cfg.cluster_info.region = Some("us-east-1".into());
        let task = tokio::spawn(run_kube_source(api.client(), cfg, tx));
        Agent {
            rx,
            view: View::default(),
            task,
        }
    }

    /// Applies batches until `pred` holds (panics after the time limit).
    async fn until(&mut self, what: &str, pred: impl Fn(&View) -> bool) {
        let fut = async {
            while !pred(&self.view) {
                match self.rx.recv().await {
                    Some(b) => self.view.apply(b),
                    None => panic!("agent output closed while waiting for {what}"),
                }
            }
        };
        if tokio::time::timeout(LIMIT, fut).await.is_err() {
            panic!(
                "timed out waiting for {what}; view: {:#?}",
                self.view.scopes.keys().collect::<Vec<_>>()
            );
        }
    }

    /// Applies whatever batches arrive within `d`.
    async fn drain_for(&mut self, d: Duration) {
        let end = tokio::time::Instant::now() + d;
        while let Ok(Some(b)) = tokio::time::timeout_at(end, self.rx.recv()).await {
            self.view.apply(b);
        }
    }
}

fn lease(identity: &str, duration_ms: u64) -> LeaseConfig {
    let mut l = LeaseConfig::new("kube-system", "dramesh-agent", identity);
    l.duration = Duration::from_millis(duration_ms);
    l.renew_every = Duration::from_millis(200);
    l.renew_deadline = Duration::from_millis(duration_ms * 2 / 3);
    l
}

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(Duration::from_secs(120), f)
        .await
        .expect("test exceeded its time bound");
}

fn pod(name: &str, node: &str, phase: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"nodeName": node, "priority": 10,
            "containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "1"}}}]},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True"}]}})
}

fn count_requests(api: &FakeApi, needle: &str, watch: bool) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.contains(needle) && r.contains("watch=true") == watch)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_list_publishes_node_and_cluster_snapshots() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        let me = nodes[0].clone();
        let mut a = Agent::start(&api, &me, None);
        let node_scope = Scope::Node(me.clone());
        a.until("node snapshot", |v| v.node(&me).is_some()).await;
        a.until("cluster snapshot", |v| v.cluster(0).is_some()).await;
        let v = &a.view;
        assert!(v.has(&node_scope, ObjectKind::Node, None, &me));
        assert_eq!(v.count(&node_scope, ObjectKind::Node), 1);
        assert_eq!(v.count(&node_scope, ObjectKind::ResourceSlice), 2, "GPU + EFA slices");
        assert_eq!(v.count(&node_scope, ObjectKind::Pod), 2, "two 2-GPU pods per node");
        assert_eq!(v.count(&node_scope, ObjectKind::ResourceClaim), 2);
        assert!(v.node(&nodes[1]).is_none(), "another node's records are not ours");
        // Every node-scoped record is about this node.
        for (k, obj) in v.node(&me).unwrap() {
            match k.kind {
                ObjectKind::Pod | ObjectKind::ResourceSlice => {
                    assert_eq!(obj["spec"]["nodeName"], me.as_str(), "{k}")
                }
                ObjectKind::ResourceClaim => assert_eq!(
                    obj["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"][0],
                    me.as_str()
                ),
                _ => {}
            }
            assert!(obj["metadata"].get("managedFields").is_none(), "{k} not trimmed");
            assert!(obj["metadata"].get("annotations").is_none(), "{k} not trimmed");
        }
        let cs = Scope::Cluster { term: 0 };
        assert_eq!(v.count(&cs, ObjectKind::DeviceClass), 4);
        assert!(v.has(&cs, ObjectKind::ResourceSlice, None, "fabric-switch-0"));
        assert!(v.has(&cs, ObjectKind::ResourceClaim, Some("ml"), "fabric-claim"));
        assert!(v.has(&cs, ObjectKind::DeviceTaintRule, None, "drain-gpu-0"));
        assert_eq!(v.count(&cs, ObjectKind::ResourceSlice), 1, "node slices are node-scoped");
        let info = &v.cluster(0).unwrap()[&ObjectKey::new(ObjectKind::ClusterInfo, None, "cluster")];
        assert_eq!(info["kubernetesVersion"], "1.36");
        assert_eq!(info["region"], "us-east-1");
        // The lists were chunked and the node watches filtered on the server.
        let reqs = api.requests();
        assert!(reqs.iter().any(|r| r.contains("/resourceclaims?") && r.contains("limit=2") && r.contains("continue=")), "{reqs:#?}");
        assert!(reqs.iter().any(|r| r.contains("/pods?") && r.contains(&format!("fieldSelector=spec.nodeName%3D{me}"))), "{reqs:#?}");
        assert!(reqs.iter().any(|r| r.contains("/nodes?") && r.contains(&format!("fieldSelector=metadata.name%3D{me}"))), "{reqs:#?}");
        assert!(reqs.iter().any(|r| r.contains("watch=true") && r.contains("allowWatchBookmarks=true")));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_events_reach_batches() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        let me = nodes[0].clone();
        let ns = Scope::Node(me.clone());
        let mut a = Agent::start(&api, &me, None);
        a.until("node snapshot", |v| v.node(&me).is_some()).await;

        api.apply(pod("new-pod", &me, "Running"));
        api.apply(pod("elsewhere", &nodes[1], "Running"));
        a.until("added pod", |v| {
            v.has(&ns, ObjectKind::Pod, Some("ml"), "new-pod")
        })
        .await;

        let slice_name = format!("{me}-dra.net");
        let mut slice = api.get("ResourceSlice", None, &slice_name).unwrap();
        slice["spec"]["pool"]["generation"] = json!(2);
        api.apply(slice);
        a.until("modified slice", |v| {
            v.node(&me)
                .and_then(|s| {
                    s.get(&ObjectKey::new(
                        ObjectKind::ResourceSlice,
                        None,
                        &slice_name,
                    ))
                })
                .is_some_and(|o| o["spec"]["pool"]["generation"] == 2)
        })
        .await;

        api.apply(pod("new-pod", &me, "Succeeded"));
        a.until("finished pod removed", |v| {
            !v.has(&ns, ObjectKind::Pod, Some("ml"), "new-pod")
        })
        .await;

        let victim = a
            .view
            .node(&me)
            .unwrap()
            .keys()
            .find(|k| k.kind == ObjectKind::Pod)
            .unwrap()
            .clone();
        assert!(api.delete("Pod", victim.namespace.as_deref(), &victim.name));
        a.until("deleted pod", |v| {
            !v.has(
                &ns,
                ObjectKind::Pod,
                victim.namespace.as_deref(),
                &victim.name,
            )
        })
        .await;

        // A heartbeat-only Node update changes nothing published.
        let before = a.view.batches;
        let mut node = api.get("Node", None, &me).unwrap();
        node["metadata"]["annotations"] = json!({"node.alpha.kubernetes.io/ttl": "0"});
        api.apply(node);
        a.drain_for(Duration::from_millis(800)).await;
        assert_eq!(
            a.view.batches, before,
            "trimmed-equal updates are suppressed"
        );
        assert!(!a.view.has(&ns, ObjectKind::Pod, Some("ml"), "elsewhere"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_watch_resumes_without_losing_events() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        let me = nodes[0].clone();
        let ns = Scope::Node(me.clone());
        let mut a = Agent::start(&api, &me, None);
        a.until("node snapshot", |v| v.node(&me).is_some()).await;
        // Let the pod watch be established and bookmarked.
        a.drain_for(Duration::from_millis(500)).await;
        let pod_lists = count_requests(&api, "/api/v1/pods?", false);
        let pod_watches = count_requests(&api, "/api/v1/pods?", true);
        let victim = a
            .view
            .node(&me)
            .unwrap()
            .keys()
            .find(|k| k.kind == ObjectKind::Pod)
            .unwrap()
            .clone();
        // Changes made while every watch is cut are only visible through replay.
        api.drop_watches_and(|api| {
            api.apply(pod("during-outage", &me, "Running"));
            assert!(api.delete("Pod", victim.namespace.as_deref(), &victim.name));
        });
        a.until("replayed add and delete", |v| {
            v.has(&ns, ObjectKind::Pod, Some("ml"), "during-outage")
                && !v.has(
                    &ns,
                    ObjectKind::Pod,
                    victim.namespace.as_deref(),
                    &victim.name,
                )
        })
        .await;
        assert!(
            count_requests(&api, "/api/v1/pods?", true) > pod_watches,
            "the watch reconnected"
        );
        assert_eq!(
            count_requests(&api, "/api/v1/pods?", false),
            pod_lists,
            "resumed without a re-list"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_410_relists_and_removes_objects_deleted_meanwhile() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        let me = nodes[0].clone();
        let ns = Scope::Node(me.clone());
        let mut a = Agent::start(&api, &me, None);
        a.until("node snapshot", |v| v.node(&me).is_some()).await;
        a.until("cluster snapshot", |v| v.cluster(0).is_some())
            .await;
        let pod_lists = count_requests(&api, "/api/v1/pods?", false);
        let victim = a
            .view
            .node(&me)
            .unwrap()
            .keys()
            .find(|k| k.kind == ObjectKind::Pod)
            .unwrap()
            .clone();
        api.drop_watches_and(|api| {
            assert!(api.delete("Pod", victim.namespace.as_deref(), &victim.name));
            assert!(api.delete("DeviceClass", None, "mig.nvidia.com"));
            api.apply(pod("after-gap", &me, "Running"));
            // The deletions fall out of the event history: resuming watches get 410.
            api.compact();
        });
        a.until("re-listed state", |v| {
            !v.has(
                &ns,
                ObjectKind::Pod,
                victim.namespace.as_deref(),
                &victim.name,
            ) && v.has(&ns, ObjectKind::Pod, Some("ml"), "after-gap")
                && !v.has(
                    &Scope::Cluster { term: 0 },
                    ObjectKind::DeviceClass,
                    None,
                    "mig.nvidia.com",
                )
        })
        .await;
        assert!(
            count_requests(&api, "/api/v1/pods?", false) > pod_lists,
            "410 forced a re-list"
        );
        assert_eq!(
            a.view
                .count(&Scope::Cluster { term: 0 }, ObjectKind::DeviceClass),
            3
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_deletion_is_published() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        let me = nodes[0].clone();
        let ns = Scope::Node(me.clone());
        let mut a = Agent::start(&api, &me, None);
        a.until("node snapshot", |v| v.node(&me).is_some()).await;
        assert!(api.delete("Node", None, &me));
        for s in [format!("{me}-gpu.nvidia.com"), format!("{me}-dra.net")] {
            assert!(api.delete("ResourceSlice", None, &s));
        }
        a.until("node and slices gone", |v| {
            !v.has(&ns, ObjectKind::Node, None, &me) && v.count(&ns, ObjectKind::ResourceSlice) == 0
        })
        .await;
        // Re-creating it is picked up again.
        api.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": me, "labels": {"x": "y"}}}));
        a.until("node back", |v| v.has(&ns, ObjectKind::Node, None, &me)).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_handover_after_expiry_raises_the_term() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        let mut a = Agent::start(&api, &nodes[0], Some(lease("agent-a", 1500)));
        a.until("A leads term 0", |v| {
            v.cluster(0).is_some_and(|s| s.len() > 4)
        })
        .await;
        let mut b = Agent::start(&api, &nodes[1], Some(lease("agent-b", 1500)));
        b.until("B node snapshot", |v| v.node(&nodes[1]).is_some())
            .await;
        b.drain_for(Duration::from_millis(1000)).await;
        assert!(
            !b.view
                .scopes
                .keys()
                .any(|s| matches!(s, Scope::Cluster { .. })),
            "B must not publish cluster records while A holds the lease"
        );
        // A crashes: it stops renewing without releasing.
        a.task.abort();
        let crashed = tokio::time::Instant::now();
        b.until("B leads term 1", |v| v.cluster(1).is_some()).await;
        assert!(
            crashed.elapsed() >= Duration::from_millis(1000),
            "took over only after expiry"
        );
        let s = b.view.cluster(1).unwrap();
        assert_eq!(
            s.keys()
                .filter(|k| k.kind == ObjectKind::DeviceClass)
                .count(),
            4
        );
        assert!(s.contains_key(&ObjectKey::new(
            ObjectKind::ResourceClaim,
            Some("ml"),
            "fabric-claim"
        )));
        assert!(s.contains_key(&ObjectKey::new(ObjectKind::ClusterInfo, None, "cluster")));
        let l = api
            .get("Lease", Some("kube-system"), "dramesh-agent")
            .unwrap();
        assert_eq!(l["spec"]["holderIdentity"], "agent-b");
        assert_eq!(l["spec"]["leaseTransitions"], 1);
        // The new leader publishes cluster-scoped changes under its term.
        let mut class = api.get("DeviceClass", None, "gpu.nvidia.com").unwrap();
        class["spec"]["extendedResourceName"] = json!("example.com/gpu");
        api.apply(class);
        b.until("class change under term 1", |v| {
            v.cluster(1)
                .and_then(|s| {
                    s.get(&ObjectKey::new(
                        ObjectKind::DeviceClass,
                        None,
                        "gpu.nvidia.com",
                    ))
                })
                .is_some_and(|o| o["spec"]["extendedResourceName"] == "example.com/gpu")
        })
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_releases_the_lease() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        // A long lease: B can only get it this fast if A releases it.
        let mut a = Agent::start(&api, &nodes[0], Some(lease("agent-a", 20_000)));
        a.until("A leads", |v| v.cluster(0).is_some()).await;
        let mut b = Agent::start(&api, &nodes[1], Some(lease("agent-b", 20_000)));
        b.until("B node snapshot", |v| v.node(&nodes[1]).is_some())
            .await;
        let Agent { rx, task, .. } = a;
        drop(rx); // the consumer goes away: A shuts down and releases
        tokio::time::timeout(LIMIT, task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let released = tokio::time::Instant::now();
        b.until("B leads term 1", |v| v.cluster(1).is_some()).await;
        assert!(
            released.elapsed() < Duration::from_secs(10),
            "took {:?}",
            released.elapsed()
        );
        let l = api
            .get("Lease", Some("kube-system"), "dramesh-agent")
            .unwrap();
        assert_eq!(l["spec"]["holderIdentity"], "agent-b");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_publishes_its_relay_address_and_followers_read_it() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        let start = |node: &str, identity: &str, relay: Option<&str>| {
            let (tx, rx) = tokio::sync::watch::channel(RelayView::None);
            let (btx, brx) = spawn_coalescer(CoalesceConfig {
                max_delay: Duration::from_millis(50),
                max_pending: 1000,
            });
            let mut cfg = KubeSourceConfig::new(node);
            let mut l = lease(identity, 1500);
            l.relay_addr = relay.map(str::to_string);
            cfg.lease = Some(l);
            cfg.relay_view = Some(std::sync::Arc::new(tx));
            let task = tokio::spawn(run_kube_source(api.client(), cfg, btx));
            (rx, brx, task)
        };
        let (mut a_view, a_rx, a_task) = start(&nodes[0], "agent-a", Some("10.0.0.1:7947"));
        let wait = |rx: &mut tokio::sync::watch::Receiver<RelayView>, want: RelayView| {
            let mut rx = rx.clone();
            async move {
                tokio::time::timeout(LIMIT, rx.wait_for(|v| *v == want))
                    .await
                    .expect("relay view")
                    .expect("election running");
            }
        };
        wait(&mut a_view, RelayView::Me).await;
        let l = api
            .get("Lease", Some("kube-system"), "dramesh-agent")
            .unwrap();
        assert_eq!(
            l["metadata"]["annotations"]["dramesh.io/relay"],
            "10.0.0.1:7947"
        );
        // B follows A's relay; it has no relay address of its own.
        let (mut b_view, _b_rx, b_task) = start(&nodes[1], "agent-b", None);
        wait(&mut b_view, RelayView::Holder("10.0.0.1:7947".into())).await;
        // A shuts down and releases; B takes over and, relaying nothing, removes the address.
        drop(a_rx);
        tokio::time::timeout(LIMIT, a_task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        wait(&mut b_view, RelayView::Me).await;
        let l = api
            .get("Lease", Some("kube-system"), "dramesh-agent")
            .unwrap();
        assert!(
            l["metadata"]["annotations"]["dramesh.io/relay"].is_null(),
            "{l}"
        );
        b_task.abort();
    })
    .await;
}

fn pending_pod(name: &str, since: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "labels": {"pod-template-hash": "5d8f9c"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": "trainer-5d8f9c", "uid": "rs-1", "controller": true}]},
        "spec": {"priority": 10,
            "containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "1"}}}]},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
            "reason": "Unschedulable", "lastTransitionTime": since,
            "message": "0/2 nodes are available: 2 Insufficient cpu."}]}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_pods_reach_the_cluster_scope_and_move_when_bound() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        let me = nodes[0].clone();
        let ns = Scope::Node(me.clone());
        let cs = Scope::Cluster { term: 0 };
        api.apply(pending_pod("stuck-before-start", "2025-01-01T00:00:00Z"));
        let mut a = Agent::start(&api, &me, None);
        a.until("cluster snapshot with the pending pod", |v| {
            v.has(&cs, ObjectKind::Pod, Some("ml"), "stuck-before-start")
        })
        .await;
        let p = &a.view.cluster(0).unwrap()
            [&ObjectKey::new(ObjectKind::Pod, Some("ml"), "stuck-before-start")];
        assert_eq!(p["status"]["conditions"][0]["type"], "PodScheduled");
        assert_eq!(p["status"]["conditions"][0]["reason"], "Unschedulable");
        assert_eq!(p["status"]["conditions"][0]["lastTransitionTime"], "2025-01-01T00:00:00Z");
        assert!(p["status"]["conditions"][0].get("message").is_none());
        assert_eq!(p["metadata"]["ownerReferences"][0]["name"], "trainer-5d8f9c");
        assert_eq!(a.view.count(&cs, ObjectKind::Pod), 1, "bound pods stay node-scoped");
        // The pending pods were watched with a server-side selector for "no node".
        let reqs = api.requests();
        let unbound_selector = |r: &String| {
            r.contains("/pods?")
                && r.split(['?', '&'])
                    .any(|kv| kv == "fieldSelector=spec.nodeName%3D")
        };
        assert!(reqs.iter().any(unbound_selector), "{reqs:#?}");

        // A pod created later, and one the scheduler has not tried yet (not published).
        api.apply(pending_pod("stuck-later", "2025-01-01T00:01:00Z"));
        let mut fresh = pending_pod("not-tried", "2025-01-01T00:01:00Z");
        fresh["status"] = json!({"phase": "Pending"});
        api.apply(fresh);
        a.until("watched pending pod", |v| {
            v.has(&cs, ObjectKind::Pod, Some("ml"), "stuck-later")
        })
        .await;
        assert!(!a.view.has(&cs, ObjectKind::Pod, Some("ml"), "not-tried"));

        // Binding moves it: it leaves the unbound selection and enters this node's.
        let mut bound = pending_pod("stuck-later", "2025-01-01T00:01:00Z");
        bound["spec"]["nodeName"] = json!(me);
        bound["status"] = json!({"phase": "Running", "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2025-01-01T00:02:00Z"}]});
        api.apply(bound);
        a.until("bound pod moved to the node scope", |v| {
            !v.has(&cs, ObjectKind::Pod, Some("ml"), "stuck-later")
                && v.has(&ns, ObjectKind::Pod, Some("ml"), "stuck-later")
        })
        .await;
        assert!(api.delete("Pod", Some("ml"), "stuck-before-start"));
        a.until("deleted pending pod", |v| {
            !v.has(&cs, ObjectKind::Pod, Some("ml"), "stuck-before-start")
        })
        .await;
    })
    .await;
}

/// A real ResourceClaimTemplate (dra-example-driver's `multiple-gpus`, two GPU requests) from
/// `shared/fixtures/real` in the nearest ancestor, as JSON; `None` (with a message) when the folder is absent, a
/// failure when `CI` is set.
fn real_claim_template() -> Option<Value> {
    let f = dramesh_testkit::fixtures(
        "real/dra-example-driver/demo-examples/basic-multiple-requests/basic-multiple-requests.yaml",
    )?;
    dramesh_model::load::load_path(&f)
        .unwrap()
        .into_iter()
        .find_map(|l| match l.manifest {
            dramesh_model::Manifest::Object(o @ ClusterObject::ResourceClaimTemplate(_)) => {
                Some(to_value(&o))
            }
            _ => None,
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_claim_templates_reach_the_cluster_scope_trimmed() {
    let Some(mut tpl) = real_claim_template() else {
        return;
    };
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        let me = nodes[0].clone();
        // As an API server returns it: bookkeeping and labels the agent must drop.
        tpl["apiVersion"] = json!("resource.k8s.io/v1");
        tpl["kind"] = json!("ResourceClaimTemplate");
        tpl["metadata"]["labels"] = json!({"app": "demo"});
        tpl["metadata"]["managedFields"] = json!([{"manager": "kubectl", "operation": "Update"}]);
        tpl["spec"]["metadata"] = json!({"labels": {"claim": "demo"}});
        api.apply(tpl.clone());
        let ns = "basic-multiple-requests";
        let cs = Scope::Cluster { term: 0 };
        let key = ObjectKey::new(ObjectKind::ResourceClaimTemplate, Some(ns), "multiple-gpus");
        let mut a = Agent::start(&api, &me, Some(lease("a", 3000)));
        a.until("template in the cluster scope", |v| {
            v.has(
                &cs,
                ObjectKind::ResourceClaimTemplate,
                Some(ns),
                "multiple-gpus",
            )
        })
        .await;
        let got = a.view.cluster(0).unwrap()[&key].clone();
        assert_eq!(
            got["metadata"],
            json!({"name": "multiple-gpus", "namespace": ns})
        );
        assert_eq!(
            got["spec"],
            json!({"spec": tpl["spec"]["spec"]}),
            "the claim spec, no claim metadata"
        );
        assert_eq!(
            got["spec"]["spec"]["devices"]["requests"]
                .as_array()
                .map(Vec::len),
            Some(2)
        );
        assert!(
            a.view.node(&me).is_some_and(|s| s
                .keys()
                .all(|k| k.kind != ObjectKind::ResourceClaimTemplate)),
            "templates are the Lease holder's"
        );
        // It decodes as the view reads it.
        let bytes = serde_json::to_vec(&got).unwrap();
        assert!(ClusterObject::from_json(ObjectKind::ResourceClaimTemplate, &bytes).is_ok());

        // A label-only change publishes nothing; a spec change does; a deletion deletes.
        let before = a.view.batches;
        let mut labelled = api
            .get("ResourceClaimTemplate", Some(ns), "multiple-gpus")
            .unwrap();
        labelled["metadata"]["labels"] = json!({"app": "other"});
        api.apply(labelled);
        a.drain_for(Duration::from_millis(800)).await;
        assert_eq!(
            a.view.batches, before,
            "trimmed-equal updates are suppressed"
        );
        let mut changed = api
            .get("ResourceClaimTemplate", Some(ns), "multiple-gpus")
            .unwrap();
        changed["spec"]["spec"]["devices"]["requests"][1]["exactly"]["count"] = json!(3);
        api.apply(changed);
        a.until("changed template", |v| {
            v.cluster(0).and_then(|s| s.get(&key)).is_some_and(|t| {
                t["spec"]["spec"]["devices"]["requests"][1]["exactly"]["count"] == 3
            })
        })
        .await;
        assert!(api.delete("ResourceClaimTemplate", Some(ns), "multiple-gpus"));
        a.until("deleted template", |v| {
            !v.has(
                &cs,
                ObjectKind::ResourceClaimTemplate,
                Some(ns),
                "multiple-gpus",
            )
        })
        .await;
        a.task.abort();
    })
    .await;
}

/// The Karpenter objects of tests/karpenter as Karpenter writes them (one list item each).
fn karpenter_objects() -> Vec<Value> {
    let dir = std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/karpenter"
    ));
    let mut out = Vec::new();
    for f in ["nodepool-gpu.yaml", "nodeclaims-gpu.yaml"] {
        let text = std::fs::read_to_string(dir.join(f)).unwrap();
        let v: Value = serde_norway::from_str(&text).unwrap();
        match v["items"].as_array() {
            Some(items) => out.extend(items.iter().cloned()),
            None => out.push(v),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_objects_are_published_trimmed_by_the_lease_holder() {
    bounded(async {
        let api = FakeApi::start().await;
        let nodes = seed(&api);
        for o in karpenter_objects() {
            api.apply(o);
        }
        let mut a = Agent::start(&api, &nodes[0], None);
        let cs = Scope::Cluster { term: 0 };
        a.until("the NodePool and both NodeClaims", |v| {
            v.count(&cs, ObjectKind::NodePool) == 1 && v.count(&cs, ObjectKind::NodeClaim) == 2
        })
        .await;
        let c = a.view.cluster(0).unwrap();
        let pool = &c[&ObjectKey::new(ObjectKind::NodePool, None, "gpu-pool")];
        assert_eq!(pool["apiVersion"], "karpenter.sh/v1");
        assert_eq!(pool["spec"]["limits"]["nvidia.com/gpu"], "24");
        assert_eq!(
            pool["spec"]["limits"]["cpu"], "1k",
            "int-or-string, canonical: {pool}"
        );
        let reqs = pool["spec"]["template"]["spec"]["requirements"]
            .as_array()
            .unwrap();
        assert_eq!(reqs[0]["values"], json!(["p4d.24xlarge", "p5.48xlarge"]));
        // Trimmed: what headroom does not read is not published.
        assert!(pool["spec"].get("disruption").is_none(), "{pool}");
        assert!(pool.get("status").is_none(), "{pool}");
        assert!(pool["metadata"].get("annotations").is_none(), "{pool}");
        let claim = &c[&ObjectKey::new(ObjectKind::NodeClaim, None, "gpu-pool-x7k2p")];
        assert_eq!(
            claim["metadata"]["labels"]["karpenter.sh/nodepool"],
            "gpu-pool"
        );
        assert_eq!(claim["status"]["capacity"]["nvidia.com/gpu"], "8");
        assert_eq!(
            claim["status"]["nodeName"],
            "ip-192-168-153-160.ec2.internal"
        );
        assert_eq!(
            claim["status"]["conditions"][1],
            json!({"type": "Launched", "status": "True"}),
            "conditions without times or messages: {claim}"
        );
        assert!(claim.get("spec").is_none(), "{claim}");
        // Node agents do not hold them: they are cluster-scoped.
        assert_eq!(
            a.view
                .count(&Scope::Node(nodes[0].clone()), ObjectKind::NodePool),
            0
        );

        // A pool deleted in the cluster is deleted downstream.
        assert!(api.delete("NodePool", None, "gpu-pool"));
        a.until("the NodePool deleted", |v| {
            v.count(&cs, ObjectKind::NodePool) == 0
        })
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_without_karpenter_or_without_its_rbac_still_publishes_everything_else() {
    bounded(async {
        for forbid in [false, true] {
            let api = FakeApi::start().await;
            let nodes = seed(&api);
            for k in ["NodePool", "NodeClaim"] {
                if forbid {
                    api.forbid(k);
                } else {
                    api.hide(k);
                }
            }
            let mut a = Agent::start(&api, &nodes[0], None);
            a.until("cluster snapshot", |v| v.cluster(0).is_some())
                .await;
            let cs = Scope::Cluster { term: 0 };
            assert_eq!(
                a.view.count(&cs, ObjectKind::DeviceClass),
                4,
                "forbid={forbid}"
            );
            assert_eq!(a.view.count(&cs, ObjectKind::NodePool), 0);
            assert!(
                count_requests(&api, "/nodepools", false) >= 1,
                "the agent asked: {:#?}",
                api.requests()
            );
        }
    })
    .await;
}
