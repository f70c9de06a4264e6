//! Log lines rate-limited per key: a failure that repeats (a refused handshake from one peer,
//! an unreachable replica, an unreadable file) is logged once per key per interval, so it is
//! never silent and never floods the log.
//!
//! Guarantee: [`Throttle::allow`] answers `true` for a key at most once per interval, and the
//! table holds at most `max_keys` keys (when it is full of keys seen within the interval, new
//! keys are suppressed until older ones age out, so a flood of distinct peers cannot grow it).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One log line per key per interval.
#[derive(Debug)]
pub struct Throttle<K> {
    every: Duration,
    max_keys: usize,
    last: Mutex<HashMap<K, Instant>>,
}

/// The interval the daemons use: once a minute.
pub const EVERY_MINUTE: Duration = Duration::from_secs(60);

impl<K: Hash + Eq + Clone> Throttle<K> {
    /// At most one `true` per key per `every`, remembering at most `max_keys` keys.
    pub fn new(every: Duration, max_keys: usize) -> Self {
        Throttle {
            every,
            max_keys: max_keys.max(1),
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Whether to log for `key` now (and if so, the next `true` for it is one interval away).
    pub fn allow(&self, key: &K) -> bool {
        self.allow_at(key, Instant::now())
    }

    fn allow_at(&self, key: &K, now: Instant) -> bool {
        // A panic while holding the lock leaves a map that is still consistent.
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = last.get_mut(key) {
            if now.saturating_duration_since(*t) < self.every {
                return false;
            }
            *t = now;
            return true;
        }
        if last.len() >= self.max_keys {
            let every = self.every;
            last.retain(|_, t| now.saturating_duration_since(*t) < every);
            if last.len() >= self.max_keys {
                return false;
            }
        }
        last.insert(key.clone(), now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_per_key_per_interval_and_bounded() {
        let t = Throttle::new(Duration::from_secs(60), 2);
        let t0 = Instant::now();
        assert!(t.allow_at(&"a", t0));
        assert!(!t.allow_at(&"a", t0 + Duration::from_secs(59)));
        assert!(t.allow_at(&"a", t0 + Duration::from_secs(60)));
        assert!(t.allow_at(&"b", t0));
        // Full of keys seen within the interval: a third is suppressed...
        assert!(!t.allow_at(&"c", t0 + Duration::from_secs(1)));
        // ...until "b" ages out.
        assert!(t.allow_at(&"c", t0 + Duration::from_secs(61)));
    }
}
