//! The merge patches karmada-scheduler sends, byte for byte: `patchScheduleResultForResourceBinding`
//! (the schedule result in `spec.clusters` and the placement in the applied-placement
//! annotation), `patchBindingStatusCondition` (the `Scheduled` condition, and on success
//! `schedulerObservedGeneration` and `lastScheduledTime`), `patchBindingStatusWithAffinityName`,
//! and the generation-only status patch of a binding that needs no scheduling.
//!
//! Karmada builds each body with `jsonpatch.CreateMergePatch` over the Go-marshalled old and
//! new objects: an RFC 7386 merge patch, lists replaced whole, map keys sorted, `<`, `>` and
//! `&` escaped as Go's encoder escapes them, and nothing sent when nothing changed. The
//! functions here diff only the fields the scheduler changes, which gives the same body
//! because every other field is equal on both sides. The time is an argument.

use dramesh_estimator::TargetCluster;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Map, Value, json};

use crate::object::{APPLIED_PLACEMENT, Binding, BindingStatus, Condition};

/// Go's `json.Marshal` string escaping on top of serde_json's: `<`, `>`, `&`, U+2028 and
/// U+2029 as `\uXXXX`. These characters only occur inside JSON strings, so replacing them in
/// the encoded text is exact.
pub fn go_json(encoded: &str) -> String {
    if !encoded
        .chars()
        .any(|c| matches!(c, '<' | '>' | '&' | '\u{2028}' | '\u{2029}'))
    {
        return encoded.to_string();
    }
    let mut out = String::with_capacity(encoded.len() + 16);
    for c in encoded.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

/// RFC 7386 merge patch turning `old` into `new` (`jsonpatch.CreateMergePatch`): `None` when
/// they are equal. Both must be objects; anything else is replaced whole.
pub fn merge_diff(old: &Value, new: &Value) -> Option<Value> {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut out = Map::new();
            for (k, nv) in n {
                match o.get(k) {
                    None => {
                        out.insert(k.clone(), nv.clone());
                    }
                    Some(ov) if ov == nv => {}
                    Some(ov @ Value::Object(_)) if nv.is_object() => {
                        if let Some(d) = merge_diff(ov, nv) {
                            out.insert(k.clone(), d);
                        }
                    }
                    Some(_) => {
                        out.insert(k.clone(), nv.clone());
                    }
                }
            }
            for k in o.keys() {
                if !n.contains_key(k) {
                    out.insert(k.clone(), Value::Null);
                }
            }
            (!out.is_empty()).then_some(Value::Object(out))
        }
        _ if old == new => None,
        _ => Some(new.clone()),
    }
}

fn body(v: &Value) -> String {
    go_json(&v.to_string())
}

/// Longest message dramesh puts in a condition or a task (bytes): error texts can quote
/// whole objects, and the API server bounds a condition's message at 32 kB.
pub const MAX_MESSAGE: usize = 1024;

/// `s` cut to at most `max` bytes on a character boundary.
pub fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// A write to a binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patch {
    /// True for the `status` subresource.
    pub status: bool,
    /// The `application/merge-patch+json` body.
    pub body: String,
}

/// The binding's `Scheduled` condition reasons (`work/v1alpha2` `BindingReason*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// `Success`.
    Success,
    /// `NoClusterFit`: no cluster passed the filters.
    NoClusterFit,
    /// `Unschedulable`: the clusters that fit cannot hold the replicas.
    Unschedulable,
    /// `SchedulerError`: anything else.
    SchedulerError,
}

impl Reason {
    /// The reason as Karmada spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Success => "Success",
            Reason::NoClusterFit => "NoClusterFit",
            Reason::Unschedulable => "Unschedulable",
            Reason::SchedulerError => "SchedulerError",
        }
    }
}

/// The `Scheduled` condition a decision sets (Karmada `util.NewCondition`: no observed
/// generation, the transition time left to [`set_condition`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledCondition {
    /// `True` on success.
    pub status: bool,
    /// `reason`.
    pub reason: Reason,
    /// `message`.
    pub message: String,
}

/// apimachinery `meta.SetStatusCondition`: a new condition type is appended with `now` as
/// its transition time; an existing one takes the new status, reason, message and observed
/// generation, and `now` as transition time only when its status changes.
pub fn set_condition(conditions: &mut Vec<Condition>, new: Condition, now: &Time) {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        None => {
            let mut new = new;
            if new.last_transition_time.is_none() {
                new.last_transition_time = Some(now.clone());
            }
            conditions.push(new);
        }
        Some(c) => {
            if c.status != new.status {
                c.status = new.status;
                c.last_transition_time = Some(new.last_transition_time.unwrap_or(now.clone()));
            }
            c.reason = new.reason;
            c.message = new.message;
            c.observed_generation = new.observed_generation;
        }
    }
}

fn status_patch(old: &BindingStatus, new: &BindingStatus) -> Option<Patch> {
    let (Ok(o), Ok(n)) = (serde_json::to_value(old), serde_json::to_value(new)) else {
        return None;
    };
    merge_diff(&o, &n).map(|d| Patch {
        status: true,
        body: body(&json!({ "status": d })),
    })
}

/// `spec.clusters` as Go marshals it (`replicas` omitted when 0).
pub(crate) fn clusters_value(clusters: &[TargetCluster]) -> Value {
    Value::Array(
        clusters
            .iter()
            .map(|c| {
                if c.replicas == 0 {
                    json!({ "name": c.name })
                } else {
                    json!({ "name": c.name, "replicas": c.replicas })
                }
            })
            .collect(),
    )
}

fn spec_fields(
    annotations: &std::collections::BTreeMap<String, String>,
    clusters: &[TargetCluster],
) -> Value {
    let mut meta = Map::new();
    if !annotations.is_empty() {
        meta.insert("annotations".into(), json!(annotations));
    }
    let mut spec = Map::new();
    if !clusters.is_empty() {
        spec.insert("clusters".into(), clusters_value(clusters));
    }
    json!({ "metadata": meta, "spec": spec })
}

/// `patchScheduleResultForResourceBinding` (and its ClusterResourceBinding twin): the merge
/// patch of `spec.clusters` to `clusters` with the applied-placement annotation set to the
/// binding's placement. `None` when both are already so.
pub fn schedule_result(b: &Binding, clusters: &[TargetCluster]) -> Option<Patch> {
    let old = spec_fields(&b.metadata.annotations, &b.clusters);
    let mut annotations = b.metadata.annotations.clone();
    annotations.insert(APPLIED_PLACEMENT.to_string(), b.placement.to_go_json());
    let new = spec_fields(&annotations, clusters);
    merge_diff(&old, &new).map(|d| Patch {
        status: false,
        body: body(&d),
    })
}

/// `patchBindingStatusCondition`: the status patch setting the `Scheduled` condition and,
/// when it is `True`, `schedulerObservedGeneration` (the binding's generation) and
/// `lastScheduledTime` (`now`). `None` when the status would not change.
///
/// Unlike Karmada, `lastScheduledTime` is moved only when `refresh` (the decision changed
/// `spec.clusters`, or a reschedule was requested, which `lastScheduledTime` acknowledges)
/// or when the condition or the observed generation change with it: deciding a binding
/// again to the same result writes nothing, so Duplicated bindings, which are decided
/// whenever they are looked at, are not written every second.
pub fn scheduled_condition(
    b: &Binding,
    cond: &ScheduledCondition,
    now: &Time,
    refresh: bool,
) -> Option<Patch> {
    let mut new = b.status.clone();
    set_condition(
        &mut new.conditions,
        Condition {
            type_: "Scheduled".into(),
            status: if cond.status { "True" } else { "False" }.into(),
            observed_generation: 0,
            last_transition_time: None,
            reason: cond.reason.as_str().into(),
            message: cond.message.clone(),
        },
        now,
    );
    if cond.status {
        new.scheduler_observed_generation = b.metadata.generation;
        if refresh || new != b.status || new.last_scheduled_time.is_none() {
            new.last_scheduled_time = Some(now.clone());
        }
    }
    status_patch(&b.status, &new)
}

/// The status patch putting a `Scheduled=False` condition with reason `SchedulerError` and
/// `message` on a binding that cannot be decoded (`v` as served; only its `status` is read,
/// leniently): a malformed placement is reported on the binding, not only in a log. `None`
/// when the binding carries that condition already.
pub fn error_condition(v: &Value, message: &str, now: &Time) -> Option<Patch> {
    let old: BindingStatus = v
        .get("status")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
        .unwrap_or_default();
    let mut new = old.clone();
    set_condition(
        &mut new.conditions,
        Condition {
            type_: "Scheduled".into(),
            status: "False".into(),
            observed_generation: 0,
            last_transition_time: None,
            reason: Reason::SchedulerError.as_str().into(),
            message: message.to_string(),
        },
        now,
    );
    status_patch(&old, &new)
}

/// `patchBindingStatusWithAffinityName`: records the `clusterAffinities` term scheduled with.
pub fn affinity_name(b: &Binding, name: &str) -> Option<Patch> {
    let mut new = b.status.clone();
    new.scheduler_observed_affinity_name = name.to_string();
    status_patch(&b.status, &new)
}

/// The status patch of a binding that needed no scheduling but whose generation moved on:
/// `schedulerObservedGeneration` set to it.
pub fn observed_generation(b: &Binding) -> Option<Patch> {
    let mut new = b.status.clone();
    new.scheduler_observed_generation = b.metadata.generation;
    status_patch(&b.status, &new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::object::{BindingKind, tests_support::server_binding};
    use k8s_openapi::jiff::Timestamp;

    fn binding(v: Value) -> Binding {
        Binding::from_value(BindingKind::ResourceBinding, &v).expect("binding")
    }

    fn at(s: &str) -> Time {
        Time(s.parse::<Timestamp>().expect("time"))
    }

    #[test]
    fn merge_diff_is_rfc7386() {
        let old = json!({"a": 1, "b": {"c": 2, "d": 3}, "e": [1, 2], "f": "x"});
        let new = json!({"a": 1, "b": {"c": 2, "d": 4}, "e": [1], "g": true});
        assert_eq!(
            merge_diff(&old, &new),
            Some(json!({"b": {"d": 4}, "e": [1], "f": null, "g": true}))
        );
        assert_eq!(merge_diff(&old, &old), None);
    }

    #[test]
    fn go_escapes_html_characters() {
        assert_eq!(
            go_json(r#"{"m":"a<b>&c"}"#),
            r#"{"m":"a\u003cb\u003e\u0026c"}"#
        );
        assert_eq!(go_json("{}"), "{}");
    }

    #[test]
    fn schedule_result_patch_sets_clusters_and_the_applied_placement() {
        let mut v = server_binding();
        v["metadata"]["annotations"] = json!({"keep": "me"});
        let b = binding(v);
        let p = schedule_result(
            &b,
            &[
                TargetCluster {
                    name: "m1".into(),
                    replicas: 2,
                },
                TargetCluster {
                    name: "m2".into(),
                    replicas: 2,
                },
            ],
        )
        .expect("patch");
        assert!(!p.status);
        let placement = b.placement.to_go_json();
        let want = json!({
            "metadata": {"annotations": {APPLIED_PLACEMENT: placement}},
            "spec": {"clusters": [{"name": "m1", "replicas": 2}, {"name": "m2", "replicas": 2}]}
        });
        assert_eq!(p.body, want.to_string());
        // Keys sorted, the annotation's JSON escaped inside the string.
        assert!(p.body.starts_with(r#"{"metadata":{"annotations":{"policy.karmada.io/applied-placement":"{\"clusterAffinity\":{\"clusterNames\":[\"m1\",\"m2\"]},\"clusterTolerations\":"#), "{}", p.body);
    }

    #[test]
    fn schedule_result_patch_is_empty_when_nothing_changes_and_null_when_cleared() {
        let mut v = server_binding();
        let b0 = binding(v.clone());
        v["metadata"]["annotations"] = json!({APPLIED_PLACEMENT: b0.placement.to_go_json()});
        let b = binding(v);
        let same = b.clusters.clone();
        assert_eq!(schedule_result(&b, &same), None);
        // A failed fit clears the result: Go omits the empty list, the patch nulls it.
        let p = schedule_result(&b, &[]).expect("patch");
        assert_eq!(p.body, r#"{"spec":{"clusters":null}}"#);
        // Zero replicas are omitted as Go's omitempty does.
        let p = schedule_result(
            &b,
            &[TargetCluster {
                name: "m1".into(),
                replicas: 0,
            }],
        )
        .expect("patch");
        assert_eq!(p.body, r#"{"spec":{"clusters":[{"name":"m1"}]}}"#);
    }

    #[test]
    fn success_condition_sets_generation_and_time_and_keeps_transition_time() {
        let b = binding(server_binding());
        let now = at("2026-11-25T12:00:00Z");
        let ok = ScheduledCondition {
            status: true,
            reason: Reason::Success,
            message: "Binding has been scheduled successfully.".into(),
        };
        let p = scheduled_condition(&b, &ok, &now, true).expect("patch");
        assert!(p.status);
        // The condition list is replaced whole; its status did not change, so its
        // transition time stays.
        assert_eq!(
            p.body,
            r#"{"status":{"lastScheduledTime":"2026-11-25T12:00:00Z","schedulerObservedGeneration":3}}"#
        );
    }

    #[test]
    fn failure_condition_flips_the_status_with_a_new_transition_time() {
        let b = binding(server_binding());
        let now = at("2026-11-25T12:00:00Z");
        let fail = ScheduledCondition {
            status: false,
            reason: Reason::NoClusterFit,
            message: "0/3 clusters are available: 3 cluster(s) did not match the placement cluster affinity constraint.".into(),
        };
        let p = scheduled_condition(&b, &fail, &now, false).expect("patch");
        let v: Value = serde_json::from_str(&p.body).expect("json");
        assert_eq!(
            v,
            json!({"status": {"conditions": [{
                "type": "Scheduled", "status": "False", "reason": "NoClusterFit",
                "message": fail.message, "lastTransitionTime": "2026-11-25T12:00:00Z"
            }]}})
        );
        // Not scheduled: generation and time untouched.
        assert!(!p.body.contains("schedulerObservedGeneration"));
        // The same failure again changes nothing: no patch.
        let mut again = b.clone();
        set_condition(
            &mut again.status.conditions,
            Condition {
                type_: "Scheduled".into(),
                status: "False".into(),
                reason: "NoClusterFit".into(),
                message: fail.message.clone(),
                ..Condition::default()
            },
            &now,
        );
        assert_eq!(
            scheduled_condition(&again, &fail, &at("2026-11-25T12:05:00Z"), false),
            None
        );
    }

    #[test]
    fn the_same_success_again_writes_nothing() {
        let mut v = server_binding();
        v["status"]["schedulerObservedGeneration"] = json!(3);
        v["status"]["conditions"] = json!([{"type": "Scheduled", "status": "True", "reason": "Success",
            "message": "Binding has been scheduled successfully.", "lastTransitionTime": "2026-11-25T09:00:00Z"}]);
        v["status"]["lastScheduledTime"] = json!("2026-11-25T09:00:00Z");
        let b = binding(v);
        let ok = ScheduledCondition {
            status: true,
            reason: Reason::Success,
            message: "Binding has been scheduled successfully.".into(),
        };
        let later = at("2026-11-25T12:00:00Z");
        assert_eq!(scheduled_condition(&b, &ok, &later, false), None);
        // A new result (or a requested reschedule) moves the time.
        assert_eq!(
            scheduled_condition(&b, &ok, &later, true)
                .expect("patch")
                .body,
            r#"{"status":{"lastScheduledTime":"2026-11-25T12:00:00Z"}}"#
        );
    }

    #[test]
    fn an_undecodable_binding_gets_a_scheduler_error_once() {
        let now = at("2026-11-25T12:00:00Z");
        let mut v = server_binding();
        v["spec"]["placement"]["spreadConstraints"] =
            json!([{"spreadByField": "cluster", "maxGroups": -1}]);
        let msg = "ResourceBinding default/web-deployment: field spec.placement.spreadConstraints[0].maxGroups: maxGroups lower than 0 is not allowed";
        let p = error_condition(&v, msg, &now).expect("patch");
        let body: Value = serde_json::from_str(&p.body).expect("json");
        assert!(p.status);
        assert_eq!(
            body,
            json!({"status": {"conditions": [{"type": "Scheduled", "status": "False",
                "reason": "SchedulerError", "message": msg, "lastTransitionTime": "2026-11-25T12:00:00Z"}]}})
        );
        // Written once: the same error again changes nothing.
        merge_patch_into(&mut v, &body);
        assert_eq!(error_condition(&v, msg, &at("2026-11-25T12:01:00Z")), None);
        // A status that does not decode reads as empty.
        let mut odd = server_binding();
        odd["status"] = json!({"conditions": "not a list"});
        assert!(error_condition(&odd, msg, &now).is_some());
    }

    /// RFC 7386 applied to `v` (the tests' stand-in for the API server).
    fn merge_patch_into(v: &mut Value, p: &Value) {
        match (v, p) {
            (Value::Object(t), Value::Object(m)) => {
                for (k, pv) in m {
                    if pv.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch_into(t.entry(k.clone()).or_insert(Value::Null), pv);
                    }
                }
            }
            (t, p) => *t = p.clone(),
        }
    }

    #[test]
    fn a_new_condition_is_appended_after_the_others() {
        let mut v = server_binding();
        v["status"]["conditions"] = json!([{"type": "FullyApplied", "status": "True", "reason": "FullyAppliedSuccess", "message": "", "lastTransitionTime": "2026-11-25T09:00:00Z"}]);
        let b = binding(v);
        let now = at("2026-11-25T12:00:00Z");
        let ok = ScheduledCondition {
            status: true,
            reason: Reason::Success,
            message: "Binding has been scheduled successfully.".into(),
        };
        let p = scheduled_condition(&b, &ok, &now, true).expect("patch");
        assert_eq!(
            p.body,
            concat!(
                r#"{"status":{"conditions":[{"lastTransitionTime":"2026-11-25T09:00:00Z","message":"","reason":"FullyAppliedSuccess","status":"True","type":"FullyApplied"},"#,
                r#"{"lastTransitionTime":"2026-11-25T12:00:00Z","message":"Binding has been scheduled successfully.","reason":"Success","status":"True","type":"Scheduled"}],"#,
                r#""lastScheduledTime":"2026-11-25T12:00:00Z","schedulerObservedGeneration":3}}"#
            )
        );
    }

    #[test]
    fn affinity_name_and_generation_patches() {
        let b = binding(server_binding());
        assert_eq!(
            affinity_name(&b, "primary").expect("patch").body,
            r#"{"status":{"schedulerObservingAffinityName":"primary"}}"#
        );
        assert_eq!(
            observed_generation(&b).expect("patch").body,
            r#"{"status":{"schedulerObservedGeneration":3}}"#
        );
        let mut v = server_binding();
        v["status"]["schedulerObservedGeneration"] = json!(3);
        assert_eq!(observed_generation(&binding(v)), None);
    }
}
