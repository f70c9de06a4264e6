//! The scheduler's write path through the Karmada client, per binding as karmada-scheduler
//! writes it: merge patch of `spec.clusters` + applied-placement annotation, merge patch of
//! `/status`, one Event. Against the in-process fake API server over loopback HTTP (which also
//! validates each binding write against the CRD schema), so this bounds the client side plus a
//! cheap server, not a real Karmada API server. Reports bindings/s and per-binding latency with
//! 1 and with 32 bindings in flight.
//!
//! `cargo bench -p dramesh-replica --bench karmada_writes` (`-- N` sets the binding count).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dramesh_fakeapi::FakeApi;
use dramesh_replica::karmada::{BindingRef, EventNote, KarmadaClient, KarmadaOptions, Kind};
use serde_json::json;

fn binding(name: &str) -> serde_json::Value {
    json!({"apiVersion": "work.karmada.io/v1alpha2", "kind": "ResourceBinding",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"resource": {"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "ml",
                "name": name, "uid": "u"},
            "replicas": 3, "schedulerName": "dramesh-scheduler",
            "placement": {"clusterAffinity": {"clusterNames": ["m1", "m2"]},
                "replicaScheduling": {"replicaSchedulingType": "Divided",
                    "replicaDivisionPreference": "Aggregated"}}}})
}

/// Writes one binding's schedule result, status and Event; returns the time it took.
async fn schedule_one(c: &KarmadaClient, fake: &FakeApi, name: &str) -> Duration {
    let start = Instant::now();
    let obj = fake
        .get("ResourceBinding", Some("ml"), name)
        .expect("seeded");
    let obj: dramesh_replica::karmada::Object = serde_json::from_value(obj).expect("object");
    let at = BindingRef::of(Kind::ResourceBinding, &obj).expect("binding");
    let spec = json!({"metadata": {"annotations": {"policy.karmada.io/applied-placement":
            obj.value()["spec"]["placement"].to_string()}},
        "spec": {"clusters": [{"name": "m1", "replicas": 2}, {"name": "m2", "replicas": 1}]}});
    let written = c.patch(&at, &spec).await.expect("spec patch");
    let at = BindingRef::of(Kind::ResourceBinding, &written).expect("binding");
    let status = json!({"status": {"conditions": [{"type": "Scheduled", "status": "True",
            "reason": "Success", "message": "Binding has been scheduled successfully.",
            "lastTransitionTime": "2026-11-25T12:00:00Z"}],
        "schedulerObservedGeneration": written.meta().generation,
        "lastScheduledTime": "2026-11-25T12:00:00Z"}});
    let done = c.patch_status(&at, &status).await.expect("status patch");
    let note = EventNote {
        warning: false,
        reason: "ScheduleBindingSucceed".into(),
        action: "Scheduling".into(),
        message: "Binding has been scheduled successfully. Result: {m1:2, m2:1}".into(),
    };
    c.event(&Kind::ResourceBinding.reference(&done), &note)
        .await
        .expect("event");
    start.elapsed()
}

fn report(label: &str, n: usize, total: Duration, mut lat: Vec<Duration>) {
    lat.sort();
    let at = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
    println!(
        "{label}: {n} bindings in {:.2} s = {:.0} bindings/s; per binding p50 {:.2} ms, p99 {:.2} ms",
        total.as_secs_f64(),
        n as f64 / total.as_secs_f64(),
        at(0.5).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3,
    );
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(1000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let fake = FakeApi::start().await;
        if !fake.validates_karmada_crds() {
            println!("note: Karmada CRD fixtures not found; writes are not schema-validated");
        }
        for i in 0..2 * n {
            fake.apply(binding(&format!("rb-{i}")));
        }
        let c = Arc::new(KarmadaClient::new(
            fake.client(),
            KarmadaOptions::new("dramesh-scheduler", "bench"),
        ));
        // Sequential: one binding at a time.
        let start = Instant::now();
        let mut lat = Vec::with_capacity(n);
        for i in 0..n {
            lat.push(schedule_one(&c, &fake, &format!("rb-{i}")).await);
        }
        report("1 in flight", n, start.elapsed(), lat);
        // 32 in flight.
        let start = Instant::now();
        let sem = Arc::new(tokio::sync::Semaphore::new(32));
        let mut tasks = Vec::with_capacity(n);
        for i in n..2 * n {
            let (c, fake, sem) = (c.clone(), fake.clone(), sem.clone());
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire_owned().await.expect("semaphore");
                schedule_one(&c, &fake, &format!("rb-{i}")).await
            }));
        }
        let mut lat = Vec::with_capacity(n);
        for t in tasks {
            lat.push(t.await.expect("task"));
        }
        report("32 in flight", n, start.elapsed(), lat);
    });
}
