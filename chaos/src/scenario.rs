//! Named fault scenarios, the quick and full profiles, and the runner that plays one scenario:
//! lab and fleet up, warm-up convergence, fault + workload + queries, heal, convergence, check.
//!
//! Host names: replicas `r1`..`r3`; agents `a0`..`a2` (one per member cluster of the demo
//! fleet). Guarantees: every scenario gets a fresh lab and fleet that are torn down whatever
//! happens (guards); the scenario's seed fixes the workload's change sequence and the loss
//! draws; all records are written under the scenario's output folder.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::checker::{
    self, ClusterState, Isolation, QueryOutcome, QueryPolicy, QueryRecord, ReplicaObservation,
    Violation, Window,
};
use crate::fleet::{Fleet, FleetConfig};
use crate::http;
use crate::net::{Impairment, Lab};
use crate::report::{self, ScenarioResult};
use crate::sched::Karmada;
use crate::sys;
use crate::workload::{Mix, Workload};

/// Names of the three replicas.
pub const REPLICAS: [&str; 3] = ["r1", "r2", "r3"];
/// Names of the three agents' hosts.
pub const AGENTS: [&str; 3] = ["a0", "a1", "a2"];

/// A fault injected for the fault window.
#[derive(Debug, Clone, Serialize)]
pub enum Fault {
    /// Both directions cut between every host of `a` and every host of `b`.
    Partition {
        /// Hosts on one side.
        a: Vec<String>,
        /// Hosts on the other side.
        b: Vec<String>,
    },
    /// Packets from `from` never arrive at `to`; the other direction works.
    OneWay {
        /// Sending hosts whose packets are dropped.
        from: Vec<String>,
        /// Receiving hosts.
        to: Vec<String>,
    },
    /// One replica cut off from every other host.
    Isolate {
        /// The replica.
        replica: String,
    },
    /// Delay, jitter and loss on every link between hosts.
    Impair(Impairment),
    /// SIGKILL a process at the start; restart it from its disk after `down_ms`.
    Kill {
        /// The process name.
        proc: String,
        /// How long it stays down.
        down_ms: u64,
    },
    /// SIGKILL a replica, truncate its largest data file to half, restart after `down_ms`.
    TruncateDisk {
        /// The replica.
        replica: String,
        /// How long it stays down.
        down_ms: u64,
    },
    /// [`Fault::Partition`], and at its start the cluster of agent host `AGENTS[cluster]` is
    /// retired through replica `via` (on side `a`, away from that agent, whose side keeps
    /// receiving its changes until the heal). Its agent keeps running. After the heal no
    /// replica may list it.
    RetireInPartition {
        /// Hosts on one side.
        a: Vec<String>,
        /// Hosts on the other side.
        b: Vec<String>,
        /// The replica asked to retire it.
        via: String,
        /// Index of the retired cluster (and its agent host) in the fleet.
        cluster: usize,
    },
    /// At the start (after cutting `partition`, if any) the cluster of agent host
    /// `AGENTS[cluster]` is retired through replica `via`, while the driver changes every
    /// cluster, the retired one included, `write_rate` times a second ([`Mix::Churn`]): the
    /// retired cluster's agent keeps publishing and rolling its document over. The tombstone
    /// is then held for `hold_ms` after the heal, changes going on: a replica that has dropped
    /// the cluster must never list it again (sampled every 500 ms from the retirement to the
    /// end), and the agent must have rolled over during the hold, or the hold proves nothing.
    RetireUnderLoad {
        /// Both directions cut between these two sides for the fault window, if given.
        partition: Option<(Vec<String>, Vec<String>)>,
        /// The replica asked to retire it.
        via: String,
        /// Index of the retired cluster (and its agent host) in the fleet.
        cluster: usize,
        /// Changes per second the driver makes, from the retirement to the end of the hold.
        write_rate: f64,
        /// How long the tombstone is held after the heal.
        hold_ms: u64,
    },
    /// The replicas schedule Karmada bindings (the scheduler role, confirming `confirm`)
    /// while the mesh between `a` and `b` is cut. At the start, `oversubscribe` × what fits of
    /// one-GPU bindings for cluster `AGENTS[cluster]`'s cluster are created over the first
    /// half of the window; the driver makes no changes (what fits stays fixed). Bound replicas
    /// are sampled until `hold_ms` after the heal. Every mode must bind exactly what fits
    /// (no more, every slot used) within `repair_ms` of the heal; `strict` also forbids any
    /// overcommit during the cut.
    SchedulerPartition {
        /// Hosts on one side.
        a: Vec<String>,
        /// Hosts on the other side.
        b: Vec<String>,
        /// `--scheduler-confirm` of every replica.
        confirm: String,
        /// Whether no overcommit is allowed at any instant.
        strict: bool,
        /// The member cluster the bindings name.
        cluster: usize,
        /// Bindings per replica that fits.
        oversubscribe: u32,
        /// Sampling after the heal.
        hold_ms: u64,
        /// Bound on the repair after the heal.
        repair_ms: u64,
        /// Replicas whose wall clock is shifted (libfaketime offsets such as `-7200`).
        clocks: Vec<(String, String)>,
    },
    /// The replica runs with its wall clock shifted by `offset` (libfaketime syntax).
    ClockShift {
        /// The replica.
        replica: String,
        /// The shift, e.g. `+7200`.
        offset: String,
    },
}

/// A named scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Scenario {
    /// Scenario name.
    pub name: &'static str,
    /// What it does, for the report.
    pub about: &'static str,
    /// The fault it injects.
    pub fault: Fault,
}

fn hosts(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// The scheduler scenarios' fault: replicas cut r1 / r2+r3 (agents reach every replica),
/// 3x more one-GPU bindings for the first cluster than fit, what fits again within 2 s of the
/// heal, sampled until 10 s after it; replicas confirming `confirm` (`strict`: never more
/// than fits, at any instant).
fn scheduler_partition(confirm: &str) -> Fault {
    scheduler_partition_skewed(confirm, &[])
}

/// [`scheduler_partition`] with the wall clocks of `clocks` shifted.
fn scheduler_partition_skewed(confirm: &str, clocks: &[(&str, &str)]) -> Fault {
    Fault::SchedulerPartition {
        a: hosts(&["r1"]),
        b: hosts(&["r2", "r3"]),
        confirm: confirm.into(),
        strict: confirm == "strict",
        cluster: 0,
        oversubscribe: 3,
        hold_ms: 10_000,
        repair_ms: 2_000,
        clocks: clocks
            .iter()
            .map(|(r, o)| (r.to_string(), o.to_string()))
            .collect(),
    }
}

/// Every scenario, for a fault window of `fault_ms`.
pub fn all_scenarios(fault_ms: u64) -> Vec<Scenario> {
    vec![
        Scenario {
            name: "partition-halves",
            about: "r1+a0 | r2+r3+a1+a2, both directions",
            fault: Fault::Partition {
                a: hosts(&["r1", "a0"]),
                b: hosts(&["r2", "r3", "a1", "a2"]),
            },
        },
        Scenario {
            name: "partition-one-way",
            about: "packets from r2,r3,a1,a2 never reach r1,a0",
            fault: Fault::OneWay {
                from: hosts(&["r2", "r3", "a1", "a2"]),
                to: hosts(&["r1", "a0"]),
            },
        },
        Scenario {
            name: "isolate-replica",
            about: "r2 cut off from every replica and agent",
            fault: Fault::Isolate {
                replica: "r2".into(),
            },
        },
        Scenario {
            name: "lossy-slow-links",
            about: "80 ms +0-40 ms delay and 5% loss on every inter-host packet",
            fault: Fault::Impair(Impairment {
                delay_ms: 80,
                jitter_ms: 40,
                loss: 0.05,
            }),
        },
        Scenario {
            name: "replica-sigkill",
            about: "r3 SIGKILLed, restarted from its disk halfway through",
            fault: Fault::Kill {
                proc: "r3".into(),
                down_ms: fault_ms / 2,
            },
        },
        Scenario {
            name: "agent-sigkill",
            about: "agent a1 SIGKILLed, restarted halfway through",
            fault: Fault::Kill {
                proc: "a1".into(),
                down_ms: fault_ms / 2,
            },
        },
        Scenario {
            name: "disk-truncate",
            about: "r2 killed, its largest data file cut in half, restarted",
            fault: Fault::TruncateDisk {
                replica: "r2".into(),
                down_ms: fault_ms / 3,
            },
        },
        Scenario {
            name: "retire-in-partition",
            about: "r1+a0 | r2+r3+a1+a2; a2's cluster retired through r1 while a2 keeps publishing",
            fault: Fault::RetireInPartition {
                a: hosts(&["r1", "a0"]),
                b: hosts(&["r2", "r3", "a1", "a2"]),
                via: "r1".into(),
                cluster: 2,
            },
        },
        Scenario {
            name: "retire-under-load",
            about: "a2's cluster retired through r1 while the driver makes 220 changes/s, a2's included; held 60 s",
            fault: Fault::RetireUnderLoad {
                partition: None,
                via: "r1".into(),
                cluster: 2,
                write_rate: 220.0,
                hold_ms: 60_000,
            },
        },
        Scenario {
            name: "retire-under-load-partition",
            about: "r1+a0 | r2+r3+a1+a2; a2's cluster retired through r1 at 220 changes/s, a2's included; held 60 s after the heal",
            fault: Fault::RetireUnderLoad {
                partition: Some((hosts(&["r1", "a0"]), hosts(&["r2", "r3", "a1", "a2"]))),
                via: "r1".into(),
                cluster: 2,
                write_rate: 220.0,
                hold_ms: 60_000,
            },
        },
        Scenario {
            name: "scheduler-partition",
            about: "r1 | r2+r3 (agents reach all); 3x more one-GPU bindings than fit arrive during the cut, replicas confirm after writing; exactly what fits within 2 s of the heal",
            fault: scheduler_partition("after-write"),
        },
        Scenario {
            name: "scheduler-partition-before-write",
            about: "the same, replicas confirming before writing",
            fault: scheduler_partition("before-write"),
        },
        Scenario {
            name: "scheduler-partition-strict",
            about: "the same, replicas confirming strictly (a majority of the 3 must hold a decision): never more bound than fits, at any instant",
            fault: scheduler_partition("strict"),
        },
        Scenario {
            name: "scheduler-partition-strict-clock-skew",
            about: "the strict case with the majority side's clocks 2.5 h apart: r2's wall clock 30 min behind, r3's 2 h ahead (libfaketime): never more bound than fits, at any instant",
            fault: scheduler_partition_skewed("strict", &[("r2", "-1800"), ("r3", "+7200")]),
        },
        Scenario {
            name: "clock-shift",
            about: "r3's wall clock runs 2 h ahead (libfaketime; monotonic clock untouched)",
            fault: Fault::ClockShift {
                replica: "r3".into(),
                offset: "+7200".into(),
            },
        },
    ]
}

/// Timing and selection of a profile.
#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    /// Profile name (`quick`, `full`).
    pub name: String,
    /// Scenarios it runs, by name.
    pub scenarios: Vec<&'static str>,
    /// Length of the fault window.
    pub fault_ms: u64,
    /// Time between workload changes.
    pub write_interval_ms: u64,
    /// Time between estimate queries to each replica.
    pub query_interval_ms: u64,
    /// An answer slower than this fails the query check.
    pub latency_bound_ms: f64,
    /// Longest wait for the fleet to converge before the fault.
    pub warmup_timeout_ms: u64,
    /// Longest wait for convergence after the fault.
    pub converge_timeout_ms: u64,
}

impl Profile {
    /// The profile of this name, or an error listing the known ones.
    pub fn named(name: &str) -> Result<Profile> {
        match name {
            "quick" => Ok(Profile {
                name: "quick".into(),
                scenarios: vec![
                    "partition-halves",
                    "isolate-replica",
                    "replica-sigkill",
                    "disk-truncate",
                    "retire-in-partition",
                    "scheduler-partition",
                    "scheduler-partition-strict",
                ],
                fault_ms: 10_000,
                write_interval_ms: 250,
                query_interval_ms: 200,
                latency_bound_ms: 1000.0,
                warmup_timeout_ms: 45_000,
                converge_timeout_ms: 45_000,
            }),
            "full" => Ok(Profile {
                name: "full".into(),
                scenarios: all_scenarios(0).iter().map(|s| s.name).collect(),
                fault_ms: 30_000,
                write_interval_ms: 200,
                query_interval_ms: 150,
                latency_bound_ms: 1000.0,
                warmup_timeout_ms: 60_000,
                converge_timeout_ms: 90_000,
            }),
            other => bail!("unknown profile {other:?} (quick, full)"),
        }
    }
}

/// Options of a run beyond the profile.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The `dramesh` binary.
    pub dramesh: PathBuf,
    /// The chaos binary, re-executed as the delay helper.
    pub helper_exe: PathBuf,
    /// Output folder (logs, reports).
    pub out: PathBuf,
    /// Workload seed.
    pub seed: u64,
    /// Extra arguments for every replica.
    pub replica_extra_args: Vec<String>,
    /// Each agent talks to its home replica only.
    pub agents_home_only: bool,
    /// Changes per second the driver makes, instead of the profile's (or the scenario's) rate.
    pub write_rate: Option<f64>,
}

/// A scenario's own seed: the run seed mixed with the scenario name.
pub fn scenario_seed(seed: u64, name: &str) -> u64 {
    name.bytes().fold(seed ^ 0x9e37_79b9_7f4a_7c15, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

const ESTIMATE_BODY: &str = r#"{"workload":{"manifests":["apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  name: chaos-probe-gpu\n  namespace: chaos\nspec:\n  spec:\n    devices:\n      requests:\n      - name: gpu\n        exactly:\n          deviceClassName: gpu.nvidia.com\n          count: 1\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: chaos-probe\n  namespace: chaos\nspec:\n  replicas: 1\n  selector:\n    matchLabels:\n      app: chaos-probe\n  template:\n    metadata:\n      labels:\n        app: chaos-probe\n    spec:\n      resourceClaims:\n      - name: gpu\n        resourceClaimTemplateName: chaos-probe-gpu\n      containers:\n      - name: main\n        image: busybox\n        resources:\n          requests:\n            cpu: \"1\"\n          claims:\n          - name: gpu\n"]}}"#;

fn ages(v: &serde_json::Value) -> Vec<f64> {
    v["clusters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["dataAgeSeconds"].as_f64())
        .collect()
}

/// Sends one estimate query (and reads the data age from `/v1/status` if the estimate does
/// not carry it).
pub fn query_once(addr: SocketAddr, replica: &str, t0: Instant, timeout: Duration) -> QueryRecord {
    let at_ms = t0.elapsed().as_millis() as u64;
    let start = Instant::now();
    let res = http::request(
        addr,
        "POST",
        "/v1/estimate",
        Some(ESTIMATE_BODY.as_bytes()),
        timeout,
    )
    .and_then(|r| r.json());
    let latency_ms = start.elapsed().as_secs_f64() * 1000.0;
    let outcome = match res {
        Err(e) => QueryOutcome::Failed(format!("{e:#}")),
        Ok(v) => {
            let clusters = v["clusters"].as_array().map_or(0, Vec::len);
            let mut a = ages(&v);
            if a.is_empty()
                && let Ok(s) =
                    http::request(addr, "GET", "/v1/status", None, timeout).and_then(|r| r.json())
            {
                a = ages(&s);
            }
            QueryOutcome::Answered {
                clusters,
                min_age_s: a.iter().copied().reduce(f64::min),
                max_age_s: a.iter().copied().reduce(f64::max),
            }
        }
    };
    QueryRecord {
        replica: replica.to_string(),
        at_ms,
        latency_ms,
        outcome,
    }
}

/// Reads one replica's digest and objects of `clusters`.
pub fn observe(addr: SocketAddr, replica: &str, clusters: &[String]) -> ReplicaObservation {
    let t = Duration::from_secs(5);
    let read = || -> Result<(ClusterState, Option<String>, Vec<String>)> {
        let status = http::request(addr, "GET", "/v1/status", None, t)?.json()?;
        let digest = status["digest"].as_str().map(str::to_string);
        let listed: Vec<String> = status["clusters"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str().map(str::to_string))
            .collect();
        let mut state = ClusterState::new();
        for c in clusters.iter().filter(|c| listed.contains(c)) {
            let v = http::request(
                addr,
                "GET",
                &format!("/v1/debug/objects?cluster={c}"),
                None,
                t,
            )?
            .json()
            .with_context(|| format!("debug objects of {c}"))?;
            let objs = v["objects"]
                .as_object()
                .with_context(|| format!("debug objects of {c}: no `objects` map"))?;
            state.insert(
                c.clone(),
                objs.iter()
                    .map(|(k, h)| (k.clone(), h.as_str().unwrap_or_default().to_string()))
                    .collect(),
            );
        }
        Ok((state, digest, listed))
    };
    match read() {
        Ok((state, digest, listed)) => ReplicaObservation {
            replica: replica.to_string(),
            state: Ok(state),
            digest,
            listed,
        },
        Err(e) => ReplicaObservation {
            replica: replica.to_string(),
            state: Err(format!("{e:#}")),
            digest: None,
            listed: Vec::new(),
        },
    }
}

/// Mesh bytes sent by each replica according to its `/metrics` (replicas that do not answer
/// or expose no such metric are left out).
pub fn metrics_bytes(api: &BTreeMap<String, SocketAddr>) -> BTreeMap<String, u64> {
    let mut sent = BTreeMap::new();
    for (r, a) in api {
        let Ok(resp) = http::request(*a, "GET", "/metrics", None, Duration::from_secs(3)) else {
            continue;
        };
        if resp.status != 200 {
            continue;
        }
        if let Some(b) = report::mesh_bytes_sent(&String::from_utf8_lossy(&resp.body)) {
            sent.insert(r.clone(), b);
        }
    }
    sent
}

/// Bytes sent between two `/metrics` readings, summed over replicas; `None` when no replica
/// exposed the metric at the end. A counter that went down (the replica restarted, or its
/// per-peer series was dropped with the connection) counts from zero, so this is a lower bound.
pub fn metrics_growth(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> Option<u64> {
    if after.is_empty() {
        return None;
    }
    Some(
        after
            .iter()
            .map(|(r, a)| match before.get(r) {
                Some(b) if b <= a => a - b,
                _ => *a,
            })
            .sum(),
    )
}

struct Observed {
    violations: Vec<Violation>,
}

fn observe_all(
    fleet: &Fleet,
    expected: &ClusterState,
    retired: &[String],
    lw: &BTreeMap<(String, String), u64>,
) -> Observed {
    let clusters: Vec<String> = expected.keys().cloned().collect();
    let obs: Vec<ReplicaObservation> = fleet
        .api
        .iter()
        .map(|(r, a)| observe(*a, r, &clusters))
        .collect();
    Observed {
        violations: checker::check_state(expected, retired, lw, &obs),
    }
}

/// Polls until the replicas hold `expected`, list no `retired` cluster and agree on the
/// digest, or `timeout`.
fn converge(
    fleet: &Fleet,
    expected: &ClusterState,
    retired: &[String],
    lw: &BTreeMap<(String, String), u64>,
    timeout: Duration,
) -> Result<(Option<Duration>, Vec<Violation>)> {
    let start = Instant::now();
    loop {
        sys::check_stop()?;
        let o = observe_all(fleet, expected, retired, lw);
        if o.violations.is_empty() {
            return Ok((Some(start.elapsed()), vec![]));
        }
        if start.elapsed() > timeout {
            return Ok((None, o.violations));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Plays one scenario end to end.
pub fn run_scenario(sc: &Scenario, profile: &Profile, opts: &RunOptions) -> Result<ScenarioResult> {
    let seed = scenario_seed(opts.seed, sc.name);
    let dir = opts.out.join(sc.name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {dir:?}"))?;
    }
    std::fs::create_dir_all(&dir)?;
    let mut names: Vec<&str> = REPLICAS.to_vec();
    names.extend(AGENTS);
    let mut lab = Lab::create(&names, &opts.helper_exe)?;
    let mut wl = Workload::new(&dir.join("snapshots"), &dramesh_sim::demo_fleet(), seed)?;
    let clusters = wl.cluster_names();
    let mut clock_offsets = BTreeMap::new();
    match &sc.fault {
        Fault::ClockShift { replica, offset } => {
            clock_offsets.insert(replica.clone(), offset.clone());
        }
        Fault::SchedulerPartition { clocks, .. } => clock_offsets.extend(clocks.iter().cloned()),
        _ => {}
    }
    let mut notes = Vec::new();
    let mut replica_extra_args = opts.replica_extra_args.clone();
    let karmada = match &sc.fault {
        Fault::SchedulerPartition { confirm, .. } => {
            let k = Karmada::start(lab.gateway, &dir, &clusters, confirm, REPLICAS.len())?;
            if !k.validates() {
                // Scheduling is checked either way; only the CRD check of writes is missing.
                notes.push("binding writes not checked against Karmada's CRDs (../shared/fixtures/karmada/crds absent)".into());
            }
            replica_extra_args.extend(k.replica_args());
            Some(k)
        }
        _ => None,
    };
    let cfg = FleetConfig {
        dramesh: opts.dramesh.clone(),
        dir: dir.clone(),
        replicas: hosts(&REPLICAS),
        agents: AGENTS
            .iter()
            .zip(&clusters)
            .map(|(h, c)| (h.to_string(), c.clone(), wl.cluster_dir(c)))
            .collect(),
        replica_extra_args,
        agents_home_only: opts.agents_home_only,
        clock_offsets,
    };
    let mut fleet = Fleet::start(&lab, cfg, Duration::from_secs(30))?;

    let expected0 = wl.expected()?;
    let (warm, warm_v) = converge(
        &fleet,
        &expected0,
        &[],
        &BTreeMap::new(),
        Duration::from_millis(profile.warmup_timeout_ms),
    )?;
    if warm.is_none() {
        notes.push(format!(
            "warm-up did not converge ({} violations, first: {})",
            warm_v.len(),
            warm_v.first().map(ToString::to_string).unwrap_or_default()
        ));
    }

    // Queries run on their own threads, one per replica, for the whole scenario.
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let records = Arc::new(Mutex::new(Vec::<QueryRecord>::new()));
    let mut threads = Vec::new();
    for (r, a) in fleet.api.clone() {
        let (stop, records) = (stop.clone(), records.clone());
        let interval = Duration::from_millis(profile.query_interval_ms);
        let timeout = Duration::from_millis((profile.latency_bound_ms * 3.0) as u64);
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let q = query_once(a, &r, t0, timeout);
                if let Ok(mut v) = records.lock() {
                    v.push(q);
                }
                std::thread::sleep(interval);
            }
        }));
    }
    let outcome = play_fault(
        sc,
        profile,
        opts.write_rate,
        &mut lab,
        &mut fleet,
        &mut wl,
        karmada.as_ref(),
        t0,
        seed,
        &mut notes,
    );
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        let _ = t.join();
    }
    let (fault_window, down, isolations, bytes_before, veth_before, metrics_before, held) =
        outcome?;

    let expected = wl.expected()?;
    let lw = wl.last_writes();
    let (conv, mut violations) = converge(
        &fleet,
        &expected,
        wl.retired(),
        &lw,
        Duration::from_millis(profile.converge_timeout_ms),
    )?;
    // Measured from the heal (the end of the fault window), not from when the check began.
    let converge_s = conv.map(|_| {
        (t0.elapsed().as_millis() as u64).saturating_sub(fault_window.end_ms) as f64 / 1000.0
    });
    let mesh_bytes = lab
        .mesh_bytes()
        .ok()
        .map(|b| b.saturating_sub(bytes_before));
    let veth_bytes = lab.veth_bytes().saturating_sub(veth_before);
    let metrics = metrics_growth(&metrics_before, &metrics_bytes(&fleet.api));

    let queries = records.lock().map(|v| v.clone()).unwrap_or_default();
    let policy = QueryPolicy {
        latency_bound_ms: profile.latency_bound_ms,
        fault: fault_window,
        down,
        isolations,
    };
    violations.extend(held);
    violations.extend(checker::check_queries(&hosts(&REPLICAS), &queries, &policy));
    fleet.stop_all();
    drop(fleet);
    lab.teardown();

    write_jsonl(&dir.join("changes.jsonl"), &wl.changes)?;
    write_jsonl(&dir.join("queries.jsonl"), &queries)?;
    let result = report::summarize(report::Inputs {
        name: sc.name,
        about: sc.about,
        seed,
        writes: wl.changes.len(),
        warmup_s: warm.map(|d| d.as_secs_f64()),
        converge_s,
        queries: &queries,
        fault: fault_window,
        mesh_bytes,
        veth_bytes,
        metrics_bytes: metrics,
        violations: &violations,
        notes,
    });
    std::fs::write(dir.join("result.json"), serde_json::to_vec_pretty(&result)?)?;
    Ok(result)
}

type FaultOutcome = (
    Window,
    BTreeMap<String, Vec<Window>>,
    Vec<Isolation>,
    u64,
    u64,
    BTreeMap<String, u64>,
    Vec<Violation>,
);

/// Retires cluster `AGENTS[cluster]`'s cluster through replica `via`; returns its name and
/// the time of the retirement (`retiredAtMs`).
fn retire(fleet: &Fleet, wl: &mut Workload, via: &str, cluster: usize) -> Result<(String, u64)> {
    let name = wl
        .cluster_names()
        .get(cluster)
        .cloned()
        .with_context(|| format!("retire: the fleet has no cluster #{cluster}"))?;
    let addr = *fleet
        .api
        .get(via)
        .with_context(|| format!("retire: no replica {via}"))?;
    let r = http::request(
        addr,
        "DELETE",
        &format!("/v1/clusters/{name}"),
        None,
        Duration::from_secs(5),
    )?;
    if r.status != 200 {
        bail!(
            "retire {name} through {via}: HTTP {}: {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
    }
    let at = r
        .json()
        .ok()
        .and_then(|v| v["retiredAtMs"].as_u64())
        .with_context(|| format!("retire {name} through {via}: no retiredAtMs in the answer"))?;
    wl.retire(&name)?;
    Ok((name, at))
}

/// The generation of the one document in the data directory `dir` of an agent: its file's
/// header (`"generation":<n>`), if readable now.
pub fn agent_generation(dir: &Path) -> Option<u64> {
    for entry in std::fs::read_dir(dir).ok()? {
        let path = entry.ok()?.path();
        if path.extension().is_some_and(|e| e == "amdoc") {
            let mut head = vec![0u8; 1024];
            let n = std::io::Read::read(&mut std::fs::File::open(&path).ok()?, &mut head).ok()?;
            let head = String::from_utf8_lossy(&head[..n]).to_string();
            let at = head.find("\"generation\":")? + "\"generation\":".len();
            let digits: String = head[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            return digits.parse().ok();
        }
    }
    None
}

/// What the tombstone watch of [`Fault::RetireUnderLoad`] saw.
#[derive(Default)]
struct HoldWatch {
    /// Replicas that have dropped the retired cluster.
    dropped: std::collections::BTreeSet<String>,
    /// Listed again after being dropped.
    back: Vec<Violation>,
    /// Generations of the retired agent's document begun after the retirement, with when
    /// (ms since the scenario started) each was first seen.
    generations: BTreeMap<u64, u64>,
}

/// Samples every 500 ms, until `stop`: which replicas list `cluster` (one that has dropped it
/// and lists it again is a violation), and the generation of its agent's document (`dir`).
fn watch_hold(
    api: BTreeMap<String, SocketAddr>,
    cluster: String,
    dir: PathBuf,
    retired_at_ms: u64,
    t0: Instant,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<HoldWatch> {
    std::thread::spawn(move || {
        let mut w = HoldWatch::default();
        while !stop.load(Ordering::SeqCst) {
            let at_ms = t0.elapsed().as_millis() as u64;
            if let Some(g) = agent_generation(&dir).filter(|g| *g > retired_at_ms) {
                w.generations.entry(g).or_insert(at_ms);
            }
            for (r, a) in &api {
                let Ok(v) = http::request(*a, "GET", "/v1/status", None, Duration::from_secs(2))
                    .and_then(|r| r.json())
                else {
                    continue;
                };
                let listed = v["clusters"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["name"].as_str() == Some(cluster.as_str()));
                if !listed {
                    w.dropped.insert(r.clone());
                } else if w.dropped.remove(r) {
                    w.back.push(Violation::RetiredClusterBack {
                        replica: r.clone(),
                        cluster: cluster.clone(),
                        at_ms,
                    });
                }
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        w
    })
}

/// A scheduler scenario in progress.
struct SchedRun {
    /// The clusters every binding names.
    clusters: Vec<String>,
    /// Bindings to create, and created so far.
    total: usize,
    created: usize,
    /// Time between creations.
    every: Duration,
    sampler: std::thread::JoinHandle<Vec<checker::BindSample>>,
    policy: checker::SchedulePolicy,
}

/// Replicas of the chaos probe (one CPU, one GPU) that fit in `cluster`, the same on every
/// replica (they converged in the warm-up), or an error naming what differed.
fn fit_everywhere(fleet: &Fleet, cluster: &str) -> Result<i64> {
    let mut fits = BTreeMap::new();
    for (r, a) in &fleet.api {
        let v = http::request(
            *a,
            "POST",
            "/v1/estimate",
            Some(ESTIMATE_BODY.as_bytes()),
            Duration::from_secs(10),
        )
        .and_then(|r| r.json())
        .with_context(|| format!("estimating what fits on {r}"))?;
        let fit = v["clusters"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["name"] == cluster)
            .and_then(|c| c["maxReplicas"].as_i64())
            .with_context(|| format!("{r}'s estimate has no maxReplicas for {cluster}: {v}"))?;
        fits.insert(r.clone(), fit);
    }
    let first = *fits.values().next().context("no replica to ask")?;
    if first <= 0 || fits.values().any(|f| *f != first) {
        bail!("what fits in {cluster} is not one positive number on every replica: {fits:?}");
    }
    Ok(first)
}

#[allow(clippy::too_many_arguments)]
fn play_fault(
    sc: &Scenario,
    profile: &Profile,
    write_rate: Option<f64>,
    lab: &mut Lab,
    fleet: &mut Fleet,
    wl: &mut Workload,
    karmada: Option<&Karmada>,
    t0: Instant,
    seed: u64,
    notes: &mut Vec<String>,
) -> Result<FaultOutcome> {
    let ms = |t: Instant| t.duration_since(t0).as_millis() as u64;
    // Let the query threads record a baseline before the fault.
    std::thread::sleep(Duration::from_millis(500));
    let bytes_before = lab.mesh_bytes().unwrap_or(0);
    let veth_before = lab.veth_bytes();
    let metrics_before = metrics_bytes(&fleet.api);
    let fault_start = Instant::now();
    let mut down: BTreeMap<String, Vec<Window>> = BTreeMap::new();
    let mut isolations = Vec::new();
    // (process, restart due, killed at, is replica)
    let mut pending_restart: Option<(String, Instant, Instant, bool)> = None;
    let mut awaiting_ready: Option<(String, Instant)> = None;
    let watch_stop = Arc::new(AtomicBool::new(false));
    let mut watch: Option<(String, std::thread::JoinHandle<HoldWatch>)> = None;
    let (scenario_rate, hold_ms) = match &sc.fault {
        Fault::RetireUnderLoad {
            write_rate,
            hold_ms,
            ..
        } => (Some(*write_rate), *hold_ms),
        Fault::SchedulerPartition { hold_ms, .. } => (None, *hold_ms),
        _ => (None, 0),
    };
    // The scheduler scenarios keep what fits fixed: the driver changes nothing.
    let drive = !matches!(sc.fault, Fault::SchedulerPartition { .. });
    let sampler_stop = Arc::new(AtomicBool::new(false));
    let mut sched: Option<SchedRun> = None;
    let interval = match write_rate.or(scenario_rate) {
        Some(r) if r > 0.0 => Duration::from_secs_f64(1.0 / r),
        _ => Duration::from_millis(profile.write_interval_ms),
    };
    let writes_before = wl.changes.len();
    match &sc.fault {
        Fault::Partition { a, b } => lab.partition(a, b)?,
        Fault::RetireInPartition { a, b, via, cluster } => {
            lab.partition(a, b)?;
            let (name, _) = retire(fleet, wl, via, *cluster)?;
            notes.push(format!("retired {name} through {via}"));
        }
        Fault::RetireUnderLoad {
            partition,
            via,
            cluster,
            write_rate: _,
            hold_ms: _,
        } => {
            if let Some((a, b)) = partition {
                lab.partition(a, b)?;
            }
            let (name, at) = retire(fleet, wl, via, *cluster)?;
            wl.mix = Mix::Churn;
            wl.write_retired = true;
            let dir = fleet.data_dir(AGENTS[*cluster]);
            watch = Some((
                name.clone(),
                watch_hold(
                    fleet.api.clone(),
                    name.clone(),
                    dir,
                    at,
                    t0,
                    watch_stop.clone(),
                ),
            ));
            notes.push(format!(
                "retired {name} through {via} at {at} ms since the epoch"
            ));
        }
        Fault::OneWay { from, to } => {
            for f in from {
                for t in to {
                    lab.block(f, t)?;
                }
            }
        }
        Fault::Isolate { replica } => {
            lab.isolate(replica)?;
            isolations.push(Isolation {
                replica: replica.clone(),
                from_ms: ms(fault_start),
                slack_s: 5.0,
            });
        }
        Fault::Impair(imp) => lab.impair(*imp, seed)?,
        Fault::Kill { proc, down_ms } => {
            fleet.kill(proc)?;
            pending_restart = Some((
                proc.clone(),
                fault_start + Duration::from_millis(*down_ms),
                fault_start,
                REPLICAS.contains(&proc.as_str()),
            ));
        }
        Fault::TruncateDisk { replica, down_ms } => {
            fleet.kill(replica)?;
            let (p, before, after) =
                crate::fleet::truncate_largest_file(&fleet.data_dir(replica), 0.5)?;
            notes.push(format!(
                "truncated {} from {before} to {after} bytes",
                p.display()
            ));
            pending_restart = Some((
                replica.clone(),
                fault_start + Duration::from_millis(*down_ms),
                fault_start,
                true,
            ));
        }
        Fault::ClockShift { .. } => {}
        Fault::SchedulerPartition {
            a,
            b,
            strict,
            cluster,
            oversubscribe,
            repair_ms,
            ..
        } => {
            let k = karmada.context("a scheduler scenario without its Karmada API server")?;
            // A replica decides nothing before it has caught up with a peer (ready): the cut
            // must find every replica scheduling.
            for r in REPLICAS {
                fleet
                    .wait_ready(r, Duration::from_secs(60))
                    .with_context(|| format!("{r} not ready before the cut"))?;
            }
            let name = wl
                .cluster_names()
                .get(*cluster)
                .cloned()
                .with_context(|| format!("the fleet has no cluster #{cluster}"))?;
            let fit = fit_everywhere(fleet, &name)?;
            let total = fit as usize * *oversubscribe as usize;
            notes.push(format!(
                "{fit} one-GPU replicas fit in {name} (every replica's estimate); {total} bindings created during the cut"
            ));
            lab.partition(a, b)?;
            sched = Some(SchedRun {
                clusters: vec![name.clone()],
                total,
                created: 0,
                every: Duration::from_millis(profile.fault_ms / 2) / total.max(1) as u32,
                sampler: k.sampler(t0, Duration::from_millis(100), sampler_stop.clone()),
                policy: checker::SchedulePolicy {
                    fit: BTreeMap::from([(name, fit)]),
                    bindings: total,
                    heal_ms: 0,
                    repair_ms: *repair_ms,
                    strict: *strict,
                },
            });
        }
    }
    let fault_end = fault_start + Duration::from_millis(profile.fault_ms);
    let mut next_write = Instant::now();
    // At hundreds of changes a second the writes due are caught up in bursts (at most 50 per
    // round, so restarts stay on time); the tick is shorter than the write interval.
    let tick = Duration::from_millis(20)
        .min(interval / 2)
        .max(Duration::from_millis(1));
    let mut write_due = |wl: &mut Workload, now: Instant| -> Result<()> {
        let mut n = 0;
        while now >= next_write && n < 50 {
            wl.step(ms(now))?;
            next_write += interval;
            n += 1;
        }
        if now >= next_write {
            // Behind by more than a burst: the rate is what this machine sustains.
            next_write = now;
        }
        Ok(())
    };
    while Instant::now() < fault_end {
        sys::check_stop()?;
        let now = Instant::now();
        if drive {
            write_due(wl, now)?;
        }
        if let (Some(run), Some(k)) = (sched.as_mut(), karmada) {
            while run.created < run.total && now >= fault_start + run.every * run.created as u32 {
                k.create_binding(run.created, &run.clusters)?;
                run.created += 1;
            }
        }
        if let Some((p, due, killed, is_replica)) = pending_restart.clone()
            && now >= due
        {
            fleet.start_proc(&p)?;
            pending_restart = None;
            if is_replica {
                awaiting_ready = Some((p, killed));
            }
        }
        if let Some((r, killed)) = awaiting_ready.clone()
            && fleet.is_ready(&r)
        {
            down.entry(r.clone()).or_default().push(Window {
                start_ms: ms(killed),
                end_ms: ms(Instant::now()),
            });
            awaiting_ready = None;
        }
        std::thread::sleep(tick);
    }
    let heal = Instant::now();
    lab.heal()?;
    // The tombstone is held after the heal, changes going on.
    let hold_end = heal + Duration::from_millis(hold_ms);
    while Instant::now() < hold_end {
        sys::check_stop()?;
        if drive {
            write_due(wl, Instant::now())?;
        }
        std::thread::sleep(tick);
    }
    let mut held = Vec::new();
    if let Some(mut run) = sched {
        sampler_stop.store(true, Ordering::SeqCst);
        let samples = run
            .sampler
            .join()
            .map_err(|_| anyhow::anyhow!("the binding sampler panicked"))?;
        run.policy.heal_ms = ms(heal);
        let (sum, v) = checker::check_schedule(&samples, &run.policy);
        notes.push(format!(
            "created {} of {} bindings; worst overcommit {} replica(s) at {} ms, overcommitted {:.1} s in all; {}; {} bound at the end",
            run.created,
            run.total,
            sum.worst_over,
            sum.worst_at_ms.map_or("-".into(), |t| t.to_string()),
            sum.over_ms as f64 / 1000.0,
            match sum.repaired_after_heal_ms {
                Some(r) => format!("what fits again {:.1} s after the heal", r as f64 / 1000.0),
                None => "nothing over what fits after the heal".into(),
            },
            sum.final_bound,
        ));
        if run.created < run.total {
            bail!(
                "created {} of {} bindings during the fault window",
                run.created,
                run.total
            );
        }
        write_jsonl(&fleet.dir().join("bindings.jsonl"), &samples)?;
        held.extend(v);
    }
    if let Some((name, h)) = watch {
        watch_stop.store(true, Ordering::SeqCst);
        let w = h
            .join()
            .map_err(|_| anyhow::anyhow!("the tombstone watch panicked"))?;
        let elapsed = fault_start.elapsed().as_secs_f64();
        let writes = wl.changes.len() - writes_before;
        notes.push(format!(
            "{writes} changes in {elapsed:.1} s from the retirement ({:.0}/s)",
            writes as f64 / elapsed
        ));
        let in_hold = w.generations.values().filter(|at| **at >= ms(heal)).count();
        notes.push(format!(
            "the agent of {name} started {} generations after the retirement, {in_hold} of them during the {} s hold after the heal",
            w.generations.len(),
            hold_ms / 1000
        ));
        held.extend(w.back);
        if in_hold == 0 {
            held.push(Violation::HoldUnproven {
                detail: format!(
                    "the agent of {name} did not roll over during the {} s hold ({} generations after the retirement)",
                    hold_ms / 1000,
                    w.generations.len()
                ),
            });
        }
    }
    if let Some((p, _, killed, is_replica)) = pending_restart {
        fleet.start_proc(&p)?;
        if is_replica {
            awaiting_ready = Some((p, killed));
        }
    }
    if let Some((r, killed)) = awaiting_ready {
        let ready = fleet.wait_ready(&r, Duration::from_secs(30));
        down.entry(r.clone()).or_default().push(Window {
            start_ms: ms(killed),
            end_ms: ms(Instant::now()),
        });
        if let Err(e) = ready {
            notes.push(format!("{r} did not come back: {e:#}"));
        }
    }
    Ok((
        Window {
            start_ms: ms(fault_start),
            // A held tombstone is part of the fault: convergence is measured from its end.
            end_ms: ms(heal.max(hold_end)),
        },
        down,
        isolations,
        bytes_before,
        veth_before,
        metrics_before,
        held,
    ))
}

fn write_jsonl<T: Serialize>(path: &Path, items: &[T]) -> Result<()> {
    let mut s = String::new();
    for i in items {
        s.push_str(&serde_json::to_string(i)?);
        s.push('\n');
    }
    std::fs::write(path, s).with_context(|| format!("writing {path:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_name_existing_scenarios_and_quick_fits_three_minutes() {
        let all: Vec<&str> = all_scenarios(1000).iter().map(|s| s.name).collect();
        for p in ["quick", "full"] {
            let prof = Profile::named(p).unwrap();
            for s in &prof.scenarios {
                assert!(all.contains(s), "{p} names unknown scenario {s}");
            }
        }
        let q = Profile::named("quick").unwrap();
        // Per scenario: fault window plus roughly 15 s of start, warm-up and convergence
        // (measured: 6 scenarios in 97 s, 16 s each, on the 2-core VM).
        let budget = q.scenarios.len() as u64 * (q.fault_ms + 15_000);
        assert!(budget <= 180_000, "quick profile budget {budget} ms");
        assert!(Profile::named("slow").is_err());
    }

    #[test]
    fn metrics_growth_counts_a_reset_counter_from_zero() {
        let m = |v: &[(&str, u64)]| -> BTreeMap<String, u64> {
            v.iter().map(|(k, b)| (k.to_string(), *b)).collect()
        };
        let before = m(&[("r1", 100), ("r2", 500)]);
        // r1 grew by 50; r2 restarted and has sent 30 since; r3 appeared with 7.
        let after = m(&[("r1", 150), ("r2", 30), ("r3", 7)]);
        assert_eq!(metrics_growth(&before, &after), Some(87));
        assert_eq!(metrics_growth(&before, &BTreeMap::new()), None);
    }

    #[test]
    fn scenario_seeds_differ_per_scenario_and_are_stable() {
        assert_eq!(scenario_seed(1, "a"), scenario_seed(1, "a"));
        assert_ne!(scenario_seed(1, "a"), scenario_seed(1, "b"));
        assert_ne!(scenario_seed(1, "a"), scenario_seed(2, "a"));
    }

    #[test]
    fn estimate_body_is_json_with_one_manifest() {
        let v: serde_json::Value = serde_json::from_str(ESTIMATE_BODY).unwrap();
        let m = v["workload"]["manifests"][0].as_str().unwrap();
        assert!(m.contains("kind: Deployment") && m.contains("kind: ResourceClaimTemplate"));
    }
}
