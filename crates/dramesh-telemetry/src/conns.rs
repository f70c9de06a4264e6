//! The open connections of one listener, with fair eviction at the cap: shared by every HTTP
//! listener ([`crate::serve_bounded`]) and the replica's gRPC listener.
//!
//! A listener keeps two tables. Connections still in their handshake (TLS) hold a place in a
//! small table of their own ([`ConnLimits::max_handshakes`]), so unauthenticated clients that
//! open sockets and send nothing can only ever push each other out, never a connection that
//! completed its handshake. A connection that completes its handshake moves to the main
//! table ([`ConnLimits::max_connections`]).
//!
//! Guarantees of [`ConnTable::admit`]: below the cap a connection is admitted; at the cap the
//! connection idle the longest (no request in flight, tracked by [`Activity::enter`] guards)
//! is told to close, connections without a verified client identity first
//! ([`Activity::set_trusted`]); when every connection has a request in flight the new one is
//! refused. In the handshake table nothing is ever in flight, so the oldest handshake is the
//! one pushed out, those whose client has sent nothing yet first (the listeners mark a
//! connection trusted there once its first bytes arrive).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Bounds of a listener's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections past their handshake at most.
    pub max_connections: usize,
    /// Connections in their handshake at most (separately from the above).
    pub max_handshakes: usize,
    /// Time a connection has from its accept to complete its handshake.
    pub handshake_timeout: Duration,
}

/// What one connection is doing, shared by its task and the table.
#[derive(Debug)]
pub struct Activity {
    busy: AtomicUsize,
    idle_since: Mutex<Instant>,
    close: Notify,
    closing: AtomicBool,
    trusted: AtomicBool,
}

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity {
            busy: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            close: Notify::new(),
            closing: AtomicBool::new(false),
            trusted: AtomicBool::new(false),
        })
    }

    /// Marks a request in flight until the guard is dropped (which restarts the idle clock).
    pub fn enter(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    /// The connection presented a verified identity: evicted only after those that did not.
    pub fn set_trusted(&self) {
        self.trusted.store(true, Ordering::Release);
    }

    /// Whether the table told this connection to close.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Resolves once the table tells this connection to close (evicted to make room).
    pub async fn closed(&self) {
        loop {
            let notified = self.close.notified();
            if self.is_closing() {
                return;
            }
            notified.await;
        }
    }

    fn tell_close(&self) {
        self.closing.store(true, Ordering::Release);
        self.close.notify_waiters();
    }

    fn idle_since(&self) -> Instant {
        *self.idle_since.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether the peer of a just accepted socket has sent something already (its TLS
/// ClientHello, its request), without consuming it. A listener behind on a burst of accepts
/// marks such a connection trusted in its handshake table at once, before its task runs.
pub fn has_sent(stream: tokio::net::TcpStream) -> std::io::Result<(tokio::net::TcpStream, bool)> {
    let s = stream.into_std()?;
    let mut b = [0u8; 1];
    let sent = matches!(s.peek(&mut b), Ok(n) if n > 0);
    Ok((tokio::net::TcpStream::from_std(s)?, sent))
}

/// Takes a place for a just accepted socket in a listener's handshake table (counting a
/// handshake it pushes out as `handshake_evicted` of `listener`), trusted at once when its
/// peer has sent something already ([`has_sent`]), with TCP_NODELAY set. `None` when the
/// socket is unusable.
pub fn start_handshake(
    handshakes: &Arc<ConnTable>,
    stream: tokio::net::TcpStream,
    listener: &str,
    metrics: &crate::Metrics,
) -> Option<(tokio::net::TcpStream, Slot)> {
    let (stream, sent) = match has_sent(stream) {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(listener, error = %e, "accepted socket unusable");
            return None;
        }
    };
    // Nothing is ever in flight in the handshake table: there is always room.
    let (shaking, how) = handshakes.admit()?;
    if sent {
        shaking.activity.set_trusted();
    }
    if how == Admitted::Evicted {
        metrics.http_connection_closed(listener, "handshake_evicted");
    }
    no_delay(&stream);
    Some((stream, shaking))
}

/// A request in flight on a connection (see [`Activity::enter`]).
#[derive(Debug)]
pub struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Open connections of one table, by admission number.
#[derive(Debug)]
pub struct ConnTable {
    max: usize,
    next: AtomicU64,
    slots: Mutex<BTreeMap<u64, Arc<Activity>>>,
}

/// A connection's place in a [`ConnTable`]; dropping it frees the place.
#[derive(Debug)]
pub struct Slot {
    id: u64,
    table: Arc<ConnTable>,
    /// What the connection is doing.
    pub activity: Arc<Activity>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.table.lock().remove(&self.id);
    }
}

/// What [`ConnTable::admit`] did to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    /// There was room.
    Free,
    /// Another connection was told to close.
    Evicted,
}

impl ConnTable {
    /// A table of at most `max` connections (at least 1).
    pub fn new(max: usize) -> Arc<ConnTable> {
        Arc::new(ConnTable {
            max: max.max(1),
            next: AtomicU64::new(0),
            slots: Mutex::new(BTreeMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Activity>>> {
        // A panic while holding this lock leaves a map that is still consistent.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connections holding a place.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no connection holds a place.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A place for a new connection (see the module docs), or `None` when every connection
    /// has a request in flight.
    pub fn admit(self: &Arc<Self>) -> Option<(Slot, Admitted)> {
        let mut slots = self.lock();
        let mut how = Admitted::Free;
        if slots.len() >= self.max {
            let victim = slots
                .iter()
                .filter(|(_, a)| a.busy.load(Ordering::Acquire) == 0)
                .min_by_key(|(_, a)| (a.trusted.load(Ordering::Acquire), a.idle_since()))
                .map(|(id, _)| *id)?;
            if let Some(a) = slots.remove(&victim) {
                a.tell_close();
            }
            how = Admitted::Evicted;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let activity = Activity::new();
        slots.insert(id, activity.clone());
        drop(slots);
        Some((
            Slot {
                id,
                table: self.clone(),
                activity,
            },
            how,
        ))
    }
}

/// Sets TCP_NODELAY on an accepted connection: replies are small writes that Nagle's algorithm
/// plus delayed ACKs would hold for ~40 ms (`crate::http`'s module doc).
pub fn no_delay(stream: &tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY on an accepted connection");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_the_cap_the_longest_idle_untrusted_connection_goes_first() {
        let t = ConnTable::new(3);
        let (a, _) = t.admit().unwrap();
        let (b, _) = t.admit().unwrap();
        let (c, how) = t.admit().unwrap();
        assert_eq!(how, Admitted::Free);
        // a is the oldest but trusted; b is busy; so c goes.
        a.activity.set_trusted();
        let busy = b.activity.enter();
        let (d, how) = t.admit().unwrap();
        assert_eq!(how, Admitted::Evicted);
        assert!(c.activity.is_closing() && !a.activity.is_closing());
        assert_eq!(t.len(), 3);
        // Untrusted idle connections go before the trusted a, whatever their age.
        let (e, _) = t.admit().unwrap();
        assert!(d.activity.is_closing() && !a.activity.is_closing());
        let (f, _) = t.admit().unwrap();
        assert!(e.activity.is_closing() && !a.activity.is_closing());
        // With b and f busy, a is the only idle one left.
        let busy_f = f.activity.enter();
        let (_g, _) = t.admit().unwrap();
        assert!(a.activity.is_closing() && !b.activity.is_closing());
        drop((busy, busy_f, c));
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn every_connection_busy_refuses_and_a_dropped_slot_frees_its_place() {
        let t = ConnTable::new(1);
        let (a, _) = t.admit().unwrap();
        let g = a.activity.enter();
        assert!(t.admit().is_none());
        drop(g);
        drop(a);
        assert!(t.is_empty());
        assert_eq!(t.admit().map(|(_, h)| h), Some(Admitted::Free));
    }

    #[tokio::test]
    async fn closed_resolves_when_evicted() {
        let t = ConnTable::new(1);
        let (a, _) = t.admit().unwrap();
        let act = a.activity.clone();
        let waiter = tokio::spawn(async move { act.closed().await });
        tokio::task::yield_now().await;
        let _b = t.admit().unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("closed() resolved")
            .unwrap();
    }
}
