//! The loop against a slow API server (every answer 50–500 ms, seeded): writes per binding
//! stay at karmada-scheduler's count and every binding ends with its `Scheduled` condition,
//! counted from the fake server's request log.

use super::*;
use dramesh_fakeapi::Write;

/// A CPU-only Deployment `name` (room for hundreds on c0 and c1).
fn cpu_deployment(name: &str) -> Value {
    let mut d = deployment(name);
    if let Some(spec) = d["spec"]["template"]["spec"].as_object_mut() {
        spec.remove("resourceClaims");
    }
    d
}

/// A binding of Deployment `name`: Duplicated, or Divided by available replicas.
fn binding_of(name: &str, duplicated: bool) -> Value {
    let mut b = binding(name, 2);
    if duplicated {
        b["spec"]["placement"]["replicaScheduling"] =
            json!({"replicaSchedulingType": "Duplicated"});
    }
    b
}

/// The write requests to binding `name` (spec or `/status`) and the Events regarding it.
fn writes_of<'a>(
    writes: &'a [Write],
    name: &str,
) -> (Vec<&'a Write>, Vec<&'a Write>, Vec<&'a Write>) {
    let binding = format!("{name}-deployment");
    let to_binding = |status: bool| -> Vec<&Write> {
        writes
            .iter()
            .filter(|w| w.kind == "ResourceBinding" && w.name == binding)
            .filter(|w| {
                if status {
                    w.subresource.as_deref() == Some("status")
                } else {
                    w.subresource.is_none()
                }
            })
            .collect()
    };
    let events = writes
        .iter()
        .filter(|w| w.kind == "Event" && w.body["regarding"]["name"] == json!(binding))
        .collect();
    (to_binding(false), to_binding(true), events)
}

fn condition_of(b: &Value) -> (String, String, String) {
    let c = scheduled(b).cloned().unwrap_or(Value::Null);
    let s = |f: &str| c[f].as_str().unwrap_or("").to_string();
    (s("status"), s("reason"), s("message"))
}

#[tokio::test]
async fn a_slow_server_gets_one_spec_and_one_status_write_per_binding_and_every_condition() {
    let Some(fake) = validating_fake().await else {
        return;
    };
    let st = state("r1");
    publish(&st, 0, 0, None);
    publish(&st, 1, 0, None);
    setup(&fake);
    const EACH: usize = 12;
    let mut names = Vec::new();
    for i in 0..2 * EACH {
        let name = format!("w{i}");
        fake.apply(cpu_deployment(&name));
        fake.apply(binding_of(&name, i % 2 == 1));
        names.push(name);
    }
    // Its status writes refused three times in a row (every try of one decision): the spec
    // lands, the status does not, and the binding must still end with its condition.
    fake.conflict_next_status_writes("ResourceBinding", Some(NS), "w0-deployment", 3);
    // A placement the CRD schema lets through but that does not decode (an `In` selector
    // without values), and a binding whose template does not exist.
    let mut bad = binding_of("bad", false);
    bad["spec"]["placement"]["clusterAffinity"] = json!({"labelSelector":
        {"matchExpressions": [{"key": "tier", "operator": "In"}]}});
    fake.apply(bad);
    fake.apply(binding_of("gone", false));
    fake.delay_answers(Duration::from_millis(50), Duration::from_millis(500), 31);

    let started = Instant::now();
    let running = start(&fake, st.clone(), Duration::from_millis(20));
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let pending: Vec<&String> = names
            .iter()
            .filter(|n| !is_success_at_generation(&get_binding(&fake, n)))
            .collect();
        let errors_written = ["bad", "gone"]
            .iter()
            .all(|n| condition_of(&get_binding(&fake, n)).1 == "SchedulerError");
        if pending.is_empty() && errors_written {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not all scheduled within 90 s: {pending:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settled = started.elapsed();
    // A relist of every watch (the log compacted, the watches cut): nothing is written for it.
    fake.compact();
    fake.drop_watches();
    // Long enough for several retries of "gone" (1 + 2 + 4 s) and any write loop to show.
    tokio::time::sleep(Duration::from_secs(8)).await;
    // Each binding planned once (w0 twice: its first decision's status did not land): the
    // watch events of the loop's own writes and the relist planned nothing, as
    // karmada-scheduler ignores binding updates that keep the generation.
    assert_eq!(running.count("scheduled"), names.len() as u64);
    assert_eq!(running.count("unchanged"), 0, "nothing re-planned");
    running.stop().await;

    let writes = fake.writes();
    let mut spec_total = 0;
    for name in &names {
        let (spec, status, events) = writes_of(&writes, name);
        let ok = |w: &&&Write| w.code == 200;
        let spec_ok = spec.iter().filter(ok).count();
        let status_ok = status.iter().filter(ok).count();
        spec_total += spec_ok;
        assert_eq!(spec_ok, 1, "{name}: one spec patch: {spec:#?}");
        assert_eq!(status_ok, 1, "{name}: one status patch: {status:#?}");
        let refused = status.iter().filter(|w| w.code == 409).count();
        let expected_refused = if name == "w0" { 3 } else { 0 };
        assert_eq!(refused, expected_refused, "{name}: refused status writes");
        assert!(spec.iter().all(|w| w.code == 200), "{name}: {spec:#?}");
        // One success Event on the binding (the one on its Deployment likewise).
        assert_eq!(events.len(), 1, "{name}: Events {events:#?}");
        assert_eq!(events[0].body["reason"], "ScheduleBindingSucceed");
        let b = get_binding(&fake, name);
        assert!(is_success_at_generation(&b), "{name}: {b:#}");
        assert!(!targets(&b).is_empty(), "{name}: {b:#}");
    }
    assert_eq!(spec_total, names.len());
    // Duplicated: every cluster with all the replicas.
    assert_eq!(
        targets(&get_binding(&fake, "w1")),
        [("c0".to_string(), 2), ("c1".to_string(), 2)]
    );

    // The malformed binding: its condition names the field, written once, nothing else.
    let (spec, status, events) = writes_of(&writes, "bad");
    assert!(spec.is_empty(), "{spec:#?}");
    assert_eq!(status.len(), 1, "{status:#?}");
    assert!(events.is_empty(), "{events:#?}");
    let (s, reason, message) = condition_of(&get_binding(&fake, "bad"));
    assert_eq!((s.as_str(), reason.as_str()), ("False", "SchedulerError"));
    assert!(
        message.contains("spec.placement.clusterAffinity.labelSelector.matchExpressions[0].values"),
        "{message}"
    );
    // The missing template: retried, but its unchanged verdict written once, one Event.
    let (spec, status, events) = writes_of(&writes, "gone");
    assert!(spec.is_empty(), "{spec:#?}");
    assert_eq!(status.len(), 1, "{status:#?}");
    assert_eq!(events.len(), 1, "{events:#?}");
    let (s, reason, message) = condition_of(&get_binding(&fake, "gone"));
    assert_eq!((s.as_str(), reason.as_str()), ("False", "SchedulerError"));
    assert!(message.contains("does not exist"), "{message}");
    let template_reads = fake
        .requests()
        .iter()
        .filter(|r| r.starts_with("GET /apis/apps/v1/namespaces/default/deployments/gone"))
        .count();
    assert!(template_reads >= 3, "retried: {template_reads} reads");
    eprintln!(
        "slow server: {} bindings settled in {:.1} s; {} binding writes, {} Event writes in all",
        names.len() + 2,
        settled.as_secs_f64(),
        writes
            .iter()
            .filter(|w| w.kind == "ResourceBinding")
            .count(),
        writes.iter().filter(|w| w.kind == "Event").count(),
    );
}
