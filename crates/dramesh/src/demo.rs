//! `dramesh demo`: the whole system in one process, with no Kubernetes.
//!
//! Generates the simulated demo fleet (three member clusters) into a temporary folder,
//! issues a CA and certificates in memory, starts three replicas and one folder agent per
//! cluster on 127.0.0.1 (real QUIC with mutual TLS between them), shows replication progress
//! until every replica holds every object with equal digests, then prints estimates for
//! sample DRA workloads (answered by replica r1 and checked against r2 and r3), a placement
//! by a dynamic-weight PropagationPolicy, and a preemption. With `--serve` everything keeps
//! running and the API addresses are printed.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use dramesh_agent::CoalesceConfig;
use dramesh_api::auth::{AUTHENTICATED, Auth, Caps, Policy, Subject, UNAUTHENTICATED};
use dramesh_mesh::PeerIdentity;
use dramesh_mesh::certs;
use dramesh_mesh::protocol::ProtocolConfig;
use dramesh_mesh::store::DocStore;
use dramesh_model::ObjectChange;

use dramesh_agent::{Agent, AgentConfig, AgentSource};
use dramesh_replica::{Replica, ReplicaConfig};

const LOCAL: &str = "127.0.0.1:0";

const PRIORITY_CLASSES: &str = r#"
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: urgent}
value: 500
preemptionPolicy: PreemptLowerPriority
"#;

/// 1 GPU per replica.
const ONE_GPU: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: demo}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {deviceClassName: gpu.nvidia.com}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: gpu-inference, namespace: demo}
spec:
  replicas: 20
  selector: {matchLabels: {app: gpu-inference}}
  template:
    metadata: {labels: {app: gpu-inference}}
    spec:
      containers:
      - name: server
        image: vllm/vllm-openai:v0.11
        resources:
          requests: {cpu: "4", memory: 16Gi}
          claims: [{name: gpu}]
      resourceClaims:
      - {name: gpu, resourceClaimTemplateName: one-gpu}
---
apiVersion: policy.karmada.io/v1alpha1
kind: PropagationPolicy
metadata: {name: gpu-inference, namespace: demo}
spec:
  resourceSelectors:
  - {apiVersion: apps/v1, kind: Deployment, name: gpu-inference}
  placement:
    clusterAffinity:
      labelSelector:
        matchLabels: {dramesh.io/gpu: "true"}
    replicaScheduling:
      replicaSchedulingType: Divided
      replicaDivisionPreference: Weighted
      weightPreference:
        dynamicWeight: AvailableReplicas
"#;

/// Two GPUs and one EFA NIC on the same PCIe root.
const GPU_EFA: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: gpus-with-efa, namespace: demo}
spec:
  spec:
    devices:
      requests:
      - name: gpus
        exactly: {deviceClassName: gpu.nvidia.com, count: 2}
      - name: nic
        exactly: {deviceClassName: efa.networking.k8s.aws}
      constraints:
      - requests: [gpus, nic]
        matchAttribute: resource.kubernetes.io/pcieRoot
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: allreduce, namespace: demo}
spec:
  replicas: 1
  selector: {matchLabels: {app: allreduce}}
  template:
    metadata: {labels: {app: allreduce}}
    spec:
      containers:
      - name: worker
        image: nccl-tests:2.13
        resources:
          requests: {cpu: "8", memory: 64Gi}
          claims: [{name: devices}]
      resourceClaims:
      - {name: devices, resourceClaimTemplateName: gpus-with-efa}
"#;

/// One MIG 1g.10gb slice of an H100.
const MIG: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: mig-1g, namespace: demo}
spec:
  spec:
    devices:
      requests:
      - name: mig
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
          - cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: notebook, namespace: demo}
spec:
  replicas: 1
  selector: {matchLabels: {app: notebook}}
  template:
    metadata: {labels: {app: notebook}}
    spec:
      containers:
      - name: jupyter
        image: jupyter/pytorch-notebook
        resources:
          requests: {cpu: "1", memory: 8Gi}
          claims: [{name: mig}]
      resourceClaims:
      - {name: mig, resourceClaimTemplateName: mig-1g}
"#;

/// A 4Gi share of a shared L4.
const SHARED_L4: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: l4-share, namespace: demo}
spec:
  spec:
    devices:
      requests:
      - name: share
        exactly:
          deviceClassName: shared-gpu.nvidia.com
          capacity:
            requests: {memory: 4Gi}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: embedder, namespace: demo}
spec:
  replicas: 1
  selector: {matchLabels: {app: embedder}}
  template:
    metadata: {labels: {app: embedder}}
    spec:
      containers:
      - name: embed
        image: text-embeddings-inference:1.8
        resources:
          requests: {cpu: "1", memory: 4Gi}
          claims: [{name: share}]
      resourceClaims:
      - {name: share, resourceClaimTemplateName: l4-share}
"#;

/// A high-priority job needing 6 A100s per replica: only eviction of batch work makes room.
const URGENT: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: six-a100, namespace: demo}
spec:
  spec:
    devices:
      requests:
      - name: gpus
        exactly:
          deviceClassName: gpu.nvidia.com
          count: 6
          selectors:
          - cel: {expression: "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-SXM4-40GB'"}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: urgent-finetune, namespace: demo}
spec:
  replicas: 4
  selector: {matchLabels: {app: urgent-finetune}}
  template:
    metadata: {labels: {app: urgent-finetune}}
    spec:
      priorityClassName: urgent
      containers:
      - name: train
        image: nvcr.io/nvidia/pytorch:25.01-py3
        resources:
          requests: {cpu: "16", memory: 128Gi}
          claims: [{name: gpus}]
      resourceClaims:
      - {name: gpus, resourceClaimTemplateName: six-a100}
"#;

/// The sample estimates: title and manifests.
pub(crate) fn samples() -> Vec<(&'static str, Vec<String>)> {
    vec![
        ("1 GPU per replica (4 CPU, 16Gi)", vec![ONE_GPU.to_string()]),
        (
            "2 GPUs + 1 EFA NIC on the same PCIe root (pcieRoot matchAttribute)",
            vec![GPU_EFA.to_string()],
        ),
        ("one MIG 1g.10gb slice of an H100", vec![MIG.to_string()]),
        (
            "a 4Gi share of a shared L4 (consumable capacity)",
            vec![SHARED_L4.to_string()],
        ),
    ]
}

fn preemption_manifests() -> Vec<String> {
    vec![PRIORITY_CLASSES.to_string(), URGENT.to_string()]
}

struct Progress {
    clusters: usize,
    objects: usize,
    digest: u64,
}

fn progress(r: &Replica, expected: &BTreeMap<String, usize>) -> (Progress, bool) {
    let (snapshot, digest) = r
        .state
        .with_store(|store| (store.store().snapshot(), store.digest().root()));
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    for (c, ch) in &snapshot {
        if matches!(ch, ObjectChange::Upsert { .. }) {
            *per.entry(c.clone()).or_default() += 1;
        }
    }
    let complete = expected.iter().all(|(c, n)| per.get(c) == Some(n));
    let clusters = expected
        .iter()
        .filter(|(c, n)| per.get(*c) == Some(*n))
        .count();
    (
        Progress {
            clusters,
            objects: per.values().sum(),
            digest,
        },
        complete,
    )
}

/// Runs the demo (see the module docs).
pub(crate) async fn run(serve: bool, tls: crate::apiauth::TlsArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let api_tls = tls.load()?;
    // In-process on 127.0.0.1: plaintext lets anyone read and reserve; with TLS only
    // authenticated callers (a client certificate from --api-client-ca) may.
    let everyone = if api_tls.is_some() {
        vec![Subject::Group(AUTHENTICATED.into())]
    } else {
        vec![
            Subject::Group(AUTHENTICATED.into()),
            Subject::Group(UNAUTHENTICATED.into()),
        ]
    };
    let auth = Arc::new(Auth::new(Policy {
        readers: Vec::new(),
        writers: everyone,
        admins: Vec::new(),
    }));
    let tmp = tempfile::tempdir().context("creating a temporary folder")?;
    let fleet_dir = tmp.path().join("fleet");
    let mut expected = BTreeMap::new();
    for spec in dramesh_sim::demo_fleet() {
        let c = dramesh_sim::generate(&spec);
        dramesh_sim::write_snapshot(&fleet_dir, &c)
            .with_context(|| format!("writing cluster {} to {}", c.name, fleet_dir.display()))?;
        expected.insert(c.name.clone(), c.objects.len());
    }
    let total: usize = expected.values().sum();
    println!(
        "dramesh demo: {} member clusters ({}), {total} objects, written to {}",
        expected.len(),
        expected.keys().cloned().collect::<Vec<_>>().join(", "),
        fleet_dir.display()
    );
    println!("starting 3 replicas and 3 agents in this process: QUIC with mutual TLS on 127.0.0.1");

    let ca = certs::generate_ca("dramesh demo CA", 1)?;
    let local: SocketAddr = LOCAL.parse()?;
    let mut replicas: Vec<Replica> = Vec::new();
    for id in ["r1", "r2", "r3"] {
        let identity = certs::issue_identity(&ca, &PeerIdentity::Replica { id: id.into() }, 1)?;
        let seeds = replicas
            .first()
            .map(|r| vec![r.mesh_addr])
            .unwrap_or_default();
        let r = Replica::start(ReplicaConfig {
            identity,
            listen_mesh: local,
            api: local,
            grpc: local,
            seeds,
            data_dir: None,
            stale_after: Duration::from_secs(120),
            estimate_cache_bound: dramesh_estimator::CacheBound::View,
            estimate_autoscaler_headroom: false,
            protocol: ProtocolConfig::default(),
            mesh_verify_threads: None,
            ready_timeout: dramesh_replica::DEFAULT_READY_TIMEOUT,
            api_config: dramesh_api::ApiConfig {
                tls: api_tls.clone(),
                ..dramesh_api::ApiConfig::default()
            },
            auth: auth.clone(),
            caps: Caps::default(),
            scheduler: None,
        })
        .await?;
        replicas.push(r);
    }
    let replica_addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.mesh_addr).collect();
    let mut agents: Vec<Agent> = Vec::new();
    for cluster in expected.keys() {
        let identity = certs::issue_identity(
            &ca,
            &PeerIdentity::Agent {
                cluster: cluster.clone(),
                node: dramesh_mesh::identity::CLUSTER_PUBLISHER.into(),
            },
            1,
        )?;
        agents.push(
            Agent::start(AgentConfig {
                identity,
                replicas: replica_addrs.clone(),
                listen: local,
                data_dir: None,
                source: AgentSource::Dir {
                    path: fleet_dir.join(cluster),
                    poll_every: Duration::from_millis(500),
                },
                protocol: ProtocolConfig::default(),
                coalesce: CoalesceConfig::default(),
                metrics: None,
                http: Default::default(),
                rejoin: false,
                credentials: None,
            })
            .await?,
        );
    }

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last: Vec<String> = vec![String::new(); replicas.len()];
    let converged_digest = loop {
        let mut all_complete = true;
        let mut digests = Vec::new();
        for (i, r) in replicas.iter().enumerate() {
            let (p, complete) = progress(r, &expected);
            all_complete &= complete;
            digests.push(p.digest);
            let line = format!(
                "replica {}: {}/{} clusters, {}/{} objects",
                r.id,
                p.clusters,
                expected.len(),
                p.objects,
                total
            );
            if line != last[i] {
                println!("  {line}");
                last[i] = line;
            }
        }
        if all_complete && digests.windows(2).all(|w| w[0] == w[1]) {
            // The store holds everything; make sure each view has taken it in too.
            for r in &replicas {
                r.state.catch_up();
            }
            break digests[0];
        }
        if Instant::now() > deadline {
            bail!("the replicas did not converge within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!(
        "converged after {:.1} s: every replica holds {total} objects of {} clusters, mesh digest {converged_digest:016x}",
        started.elapsed().as_secs_f64(),
        expected.len()
    );

    let r1 = &replicas[0];
    let others = &replicas[1..];
    let other_names = others
        .iter()
        .map(|r| r.id.as_str())
        .collect::<Vec<_>>()
        .join(" and ");
    println!(
        "\n== Estimates: max replicas per cluster, answered by replica {} ==",
        r1.id
    );
    for (title, manifests) in samples() {
        let est = r1.state.estimate_manifests(&manifests, &[])?;
        let want = serde_json::to_value(&est)?;
        for o in others {
            let got = serde_json::to_value(o.state.estimate_manifests(&manifests, &[])?)?;
            if got != want {
                bail!(
                    "replica {} answered {title} differently from {}: {got} vs {want}",
                    o.id,
                    r1.id
                );
            }
        }
        println!("\n-- {title}");
        print!("{}", crate::plan::estimate_table(&est));
    }
    println!("\n(replicas {other_names} gave identical answers to every estimate)");

    println!(
        "\n== Placement: Deployment demo/gpu-inference, PropagationPolicy Divided / dynamicWeight AvailableReplicas =="
    );
    let placement = r1
        .state
        .place_manifests(&[ONE_GPU.to_string()], &[], None, false)?;
    for o in others {
        let got = o
            .state
            .place_manifests(&[ONE_GPU.to_string()], &[], None, false)?;
        if serde_json::to_value(&got)? != serde_json::to_value(&placement)? {
            bail!("replica {} placed differently from {}", o.id, r1.id);
        }
    }
    print!("{}", crate::plan::placement_table(&placement));

    println!(
        "\n== Preemption: Deployment demo/urgent-finetune (priority 500, 6 A100 GPUs per replica) =="
    );
    let pre = r1
        .state
        .preempt_manifests(&preemption_manifests(), &[], None, false)?;
    for o in others {
        let got = o
            .state
            .preempt_manifests(&preemption_manifests(), &[], None, false)?;
        if serde_json::to_value(&got)? != serde_json::to_value(&pre)? {
            bail!(
                "replica {} chose a different preemption from {}",
                o.id,
                r1.id
            );
        }
    }
    print!("{}", crate::plan::preemption_table(&pre));

    if serve {
        println!("\nserving (ctrl-c to stop):");
        let scheme = if api_tls.is_some() { "https" } else { "http" };
        for r in &replicas {
            println!(
                "  replica {}: HTTP {scheme}://{}  (status page /, GET /v1/status, POST /v1/estimate, /metrics)  gRPC {} (Karmada Estimator + dramesh.v1)  mesh {}",
                r.id, r.http_addr, r.grpc_addr, r.mesh_addr
            );
        }
        println!(
            "  agents poll {}: edit a file there to see the replicas follow",
            fleet_dir.display()
        );
        crate::shutdown_signal().await;
    }

    let mut stops = tokio::task::JoinSet::new();
    for a in agents {
        stops.spawn(a.shutdown());
    }
    for r in replicas {
        stops.spawn(r.shutdown());
    }
    crate::stop_within("demo", async { while stops.join_next().await.is_some() {} }).await;
    println!(
        "\ndemo finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    drop(tmp);
    Ok(())
}
