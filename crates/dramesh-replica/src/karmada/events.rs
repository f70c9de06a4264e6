//! `events.k8s.io/v1` Events as kube's `Recorder` writes them, with a bounded cache.
//!
//! An event is created as a new object (named `<regarding name>.<nanoseconds, hex>`); the same
//! event again (same regarding object, type, reason and action, as client-go's `tools/events`
//! keys it) within [`CACHE_TTL`] patches that object with a series count instead, as kube's
//! `Recorder` does. kube's `Recorder` keeps every event it wrote for its TTL and
//! walks all of them on each publish: at a scheduler's rate (hundreds of events a second)
//! that walk grew to milliseconds per event. Here the cache is bounded ([`CACHE_ENTRIES`])
//! and expires oldest first, each publish costing O(1) amortized.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, Patch, PatchParams, PostParams};

/// How long an event is remembered for aggregation (kube's `Recorder` value).
pub(crate) const CACHE_TTL: SignedDuration = SignedDuration::from_mins(6);

/// Most events remembered at once; the oldest is forgotten first (a repeat of it then
/// starts a new event object, which is what a reader would see after the TTL anyway).
pub(crate) const CACHE_ENTRIES: usize = 4096;

/// What makes two events the same event.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    warning: bool,
    reason: String,
    action: String,
    regarding: (String, String, String, String, String),
}

/// One event to record (see [`EventRecorder::publish`]).
pub(crate) struct NewEvent<'a> {
    pub(crate) warning: bool,
    pub(crate) reason: &'a str,
    pub(crate) action: &'a str,
    pub(crate) note: &'a str,
}

#[derive(Default)]
struct Cache {
    by_key: HashMap<Key, K8sEvent>,
    /// Keys by when they were last observed, oldest first (a key observed again is pushed
    /// again; stale positions are skipped when reached).
    order: VecDeque<(Timestamp, Key)>,
}

impl Cache {
    /// Forgets events last observed before `cutoff`, and the oldest beyond the bound.
    fn expire(&mut self, cutoff: Timestamp) {
        while let Some((at, key)) = self.order.front() {
            // Repeats of one event add positions too: those are bounded as well.
            let over = self.by_key.len() > CACHE_ENTRIES || self.order.len() > 2 * CACHE_ENTRIES;
            if *at >= cutoff && !over {
                break;
            }
            let current = self.by_key.get(key).map(last_observed);
            if current == Some(*at) {
                self.by_key.remove(key);
            }
            self.order.pop_front();
        }
    }
}

fn last_observed(e: &K8sEvent) -> Timestamp {
    e.series
        .as_ref()
        .map(|s| s.last_observed_time.0)
        .or(e.event_time.as_ref().map(|t| t.0))
        .unwrap_or(Timestamp::UNIX_EPOCH)
}

/// Writes Events for one reporting controller and instance.
pub(crate) struct EventRecorder {
    client: kube::Client,
    controller: String,
    instance: String,
    cache: Mutex<Cache>,
}

impl EventRecorder {
    pub(crate) fn new(client: kube::Client, controller: String, instance: String) -> Self {
        EventRecorder {
            client,
            controller,
            instance,
            cache: Mutex::new(Cache::default()),
        }
    }

    /// Records `ev` regarding `regarding`, in its namespace (`default` for cluster-scoped
    /// objects).
    pub(crate) async fn publish(
        &self,
        ev: &NewEvent<'_>,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = Key {
            warning: ev.warning,
            reason: ev.reason.to_string(),
            action: ev.action.to_string(),
            regarding: (
                regarding.api_version.clone().unwrap_or_default(),
                regarding.kind.clone().unwrap_or_default(),
                regarding.namespace.clone().unwrap_or_default(),
                regarding.name.clone().unwrap_or_default(),
                regarding.uid.clone().unwrap_or_default(),
            ),
        };
        let cached = {
            let mut cache = crate::sync::lock(&self.cache);
            cache.expire(now - CACHE_TTL);
            cache.by_key.get(&key).cloned()
        };
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let events: Api<K8sEvent> = Api::namespaced(self.client.clone(), namespace);
        let event = match cached {
            Some(mut e) => {
                let count = e.series.as_ref().map_or(2, |s| s.count + 1);
                e.series = Some(EventSeries {
                    count,
                    last_observed_time: MicroTime(now),
                });
                let name = e.metadata.name.clone().unwrap_or_default();
                events
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&e))
                    .await?;
                e
            }
            None => {
                let e = self.new_event(ev, regarding, now);
                events.create(&PostParams::default(), &e).await?;
                e
            }
        };
        let mut cache = crate::sync::lock(&self.cache);
        cache.order.push_back((now, key.clone()));
        cache.by_key.insert(key, event);
        cache.expire(now - CACHE_TTL);
        Ok(())
    }

    fn new_event(
        &self,
        ev: &NewEvent<'_>,
        regarding: &ObjectReference,
        now: Timestamp,
    ) -> K8sEvent {
        K8sEvent {
            action: Some(ev.action.to_string()),
            reason: Some(ev.reason.to_string()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            note: Some(ev.note.to_string()),
            metadata: ObjectMeta {
                namespace: regarding.namespace.clone(),
                name: Some(format!(
                    "{}.{:x}",
                    regarding.name.as_deref().unwrap_or(&self.controller),
                    now.as_nanosecond()
                )),
                ..Default::default()
            },
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(if ev.warning { "Warning" } else { "Normal" }.into()),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: usize) -> Key {
        Key {
            warning: false,
            reason: "Scheduled".into(),
            action: format!("a{n}"),
            regarding: Default::default(),
        }
    }

    fn event_at(t: Timestamp) -> K8sEvent {
        K8sEvent {
            event_time: Some(MicroTime(t)),
            ..Default::default()
        }
    }

    #[test]
    fn the_cache_forgets_by_age_and_beyond_its_bound() {
        let t0 = Timestamp::now();
        let mut c = Cache::default();
        for n in 0..CACHE_ENTRIES + 10 {
            c.by_key.insert(key(n), event_at(t0));
            c.order.push_back((t0, key(n)));
        }
        c.expire(t0 - CACHE_TTL);
        assert_eq!(c.by_key.len(), CACHE_ENTRIES);
        assert!(!c.by_key.contains_key(&key(0)), "the oldest go first");
        assert!(c.by_key.contains_key(&key(CACHE_ENTRIES + 9)));
        // Observed again later: its first position no longer expires it.
        let t1 = t0 + SignedDuration::from_mins(5);
        c.by_key.insert(key(20), event_at(t1));
        c.order.push_back((t1, key(20)));
        c.expire(t0 + SignedDuration::from_secs(1));
        assert_eq!(c.by_key.len(), 1);
        assert!(c.by_key.contains_key(&key(20)));
        c.expire(t1 + SignedDuration::from_secs(1));
        assert!(c.by_key.is_empty());
        assert!(c.order.is_empty());
    }
}
