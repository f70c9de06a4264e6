//! A watched kind as a cache plus a change stream: kube's watcher (list, then watch, relist on
//! 410 Gone, with backoff on errors) feeding a map the scheduler reads and a bounded channel of
//! changes. After a relist the changes are the difference to the cache before it, so an object
//! deleted while the watch was away is reported deleted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use futures::StreamExt;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::mpsc;

use super::Object;

/// An object's namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    /// `None` for cluster-scoped objects.
    pub namespace: Option<String>,
    /// The name.
    pub name: String,
}

/// A change to a watched kind.
#[derive(Clone, Debug)]
pub enum Change {
    /// Created or modified (for bindings: and ours).
    Applied(Arc<Object>),
    /// Deleted (for bindings: or no longer ours), as last seen.
    Deleted(Arc<Object>),
    /// The cache holds every object as of a complete list (the first, or one after a gap).
    Synced,
}

/// The current objects of a watched kind. Clones share the map.
#[derive(Clone, Default)]
pub struct Cache(Arc<RwLock<HashMap<ObjectKey, Arc<Object>>>>);

impl Cache {
    /// The object, if cached.
    pub fn get(&self, namespace: Option<&str>, name: &str) -> Option<Arc<Object>> {
        let key = ObjectKey {
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
        };
        self.read().get(&key).cloned()
    }

    /// Every cached object, ordered by namespace and name.
    pub fn list(&self) -> Vec<Arc<Object>> {
        let mut all: Vec<(ObjectKey, Arc<Object>)> = self
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all.into_iter().map(|(_, v)| v).collect()
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<ObjectKey, Arc<Object>>> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<ObjectKey, Arc<Object>>> {
        self.0.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running watch. Dropping it stops the watch.
pub struct Watch {
    cache: Cache,
    failing: Arc<Mutex<Option<String>>>,
    changes: mpsc::Receiver<Change>,
    task: tokio::task::JoinHandle<()>,
}

impl Watch {
    /// The cache (shared; updated before each change is sent).
    pub fn cache(&self) -> Cache {
        self.cache.clone()
    }

    /// The error the watch is retrying after, if its last attempt failed (403 Forbidden from
    /// missing RBAC, an unreachable server); cleared by the next event it receives.
    pub fn failing(&self) -> Option<String> {
        self.failing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The next change; `None` only if the watch task ended.
    pub async fn next(&mut self) -> Option<Change> {
        self.changes.recv().await
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether `obj` is a binding for `scheduler` (`spec.schedulerName`).
fn ours(obj: &Object, scheduler: Option<&str>) -> bool {
    scheduler.is_none_or(|s| obj.value()["spec"]["schedulerName"].as_str() == Some(s))
}

pub(super) fn start(api: Api<Object>, scheduler: Option<String>, buffer: usize) -> Watch {
    let cache = Cache::default();
    let (tx, changes) = mpsc::channel(buffer.max(1));
    let failing = Arc::new(Mutex::new(None));
    let task = tokio::spawn(run(api, scheduler, cache.clone(), failing.clone(), tx));
    Watch {
        cache,
        failing,
        changes,
        task,
    }
}

async fn run(
    api: Api<Object>,
    scheduler: Option<String>,
    cache: Cache,
    failing: Arc<Mutex<Option<String>>>,
    tx: mpsc::Sender<Change>,
) {
    let kind = api.resource_url().to_string();
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    // The objects of a relist in progress.
    let mut relist: Option<HashMap<ObjectKey, Arc<Object>>> = None;
    while let Some(ev) = events.next().await {
        *failing.lock().unwrap_or_else(|e| e.into_inner()) =
            ev.as_ref().err().map(|e| format!("watch {kind}: {e}"));
        let out: Vec<Change> = match ev {
            Err(e) => {
                tracing::warn!(watch = %kind, error = %e, "karmada watch failed; retrying with backoff");
                continue;
            }
            Ok(watcher::Event::Init) => {
                relist = Some(HashMap::new());
                continue;
            }
            Ok(watcher::Event::InitApply(o)) => {
                if ours(&o, scheduler.as_deref())
                    && let Some(r) = relist.as_mut()
                {
                    r.insert(o.key(), Arc::new(o));
                }
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                let fresh = relist.take().unwrap_or_default();
                let mut out = Vec::new();
                let mut map = cache.write();
                for (k, old) in map.iter() {
                    if !fresh.contains_key(k) {
                        out.push(Change::Deleted(old.clone()));
                    }
                }
                for (k, new) in &fresh {
                    let same = map.get(k).is_some_and(|old| {
                        old.meta().resource_version == new.meta().resource_version
                            && old.meta().uid == new.meta().uid
                    });
                    if !same {
                        out.push(Change::Applied(new.clone()));
                    }
                }
                *map = fresh;
                out.push(Change::Synced);
                out
            }
            Ok(watcher::Event::Apply(o)) => {
                let key = o.key();
                let mut map = cache.write();
                if ours(&o, scheduler.as_deref()) {
                    let o = Arc::new(o);
                    map.insert(key, o.clone());
                    vec![Change::Applied(o)]
                } else {
                    // A binding handed to another scheduler leaves ours.
                    map.remove(&key).map(Change::Deleted).into_iter().collect()
                }
            }
            Ok(watcher::Event::Delete(o)) => {
                let key = o.key();
                let was = cache.write().remove(&key);
                match was {
                    Some(_) => vec![Change::Deleted(Arc::new(o))],
                    None => Vec::new(),
                }
            }
        };
        for c in out {
            if tx.send(c).await.is_err() {
                return; // the Watch was dropped
            }
        }
    }
}
