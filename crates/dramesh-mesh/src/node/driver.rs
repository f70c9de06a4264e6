//! The protocol driver: the thread that owns the [`Protocol`] and the connection table, feeds
//! it events in batches, commits what a batch changed and only then releases its frames.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc, oneshot};
use tracing::{debug, error, info, warn};

use super::commit::Syncer;
use super::conn::{ConnStats, Link, Outbound};
use super::verify::VerifyPool;
use super::{AppliedChange, PeerStatus, Shared};
use crate::identity::PeerIdentity;
use crate::protocol::{ConnId, Output, Protocol, Ticket};
use crate::store::{DocStore, RejectReason};
use crate::sync::lock;
use crate::wire::{self, pb};
use dramesh_store::{DocId, PendingSync, StoreError};

/// What the driver is told by the handle, the connection tasks and the timer.
pub(super) enum Event {
    Connected {
        conn: ConnId,
        identity: PeerIdentity,
        dialed: bool,
        connection: Link,
        outbound: Outbound,
        stats: Arc<ConnStats>,
    },
    SetRelay(bool),
    Disconnected(ConnId),
    Frame(ConnId, pb::Envelope),
    LocalChange(DocId),
    Peers(oneshot::Sender<Vec<PeerStatus>>),
    Shutdown,
}

struct ConnEntry {
    identity: PeerIdentity,
    dialed: bool,
    connection: Link,
    outbound: Outbound,
    stats: Arc<ConnStats>,
}

/// Most events the protocol thread handles before it commits and releases their outputs.
const MAX_BATCH_EVENTS: usize = 256;

/// Most signature checks out on the verifier threads: beyond it the protocol thread takes no
/// new events until some are done, so parked messages stay bounded and the connections'
/// bounded queues push back on the senders as before.
const MAX_CHECKS_IN_FLIGHT: usize = 4 * MAX_BATCH_EVENTS;

/// The verifier threads and the channel they report done checks on.
pub(super) struct Verifiers {
    pub(super) pool: VerifyPool,
    pub(super) done: mpsc::UnboundedReceiver<Ticket>,
}

/// The protocol thread: owns the [`Protocol`], locks the store per event.
///
/// Group commit: the thread takes every event already queued (up to [`MAX_BATCH_EVENTS`]),
/// handles them, asks the store to make what they changed durable ([`DocStore::flush`], one
/// fsync per touched document instead of one per message), and only then sends the frames
/// and announces the applied changes they produced. No reply, relay, digest or heads that
/// reflects a received change leaves the node before that change is durable. If the flush
/// fails the batch's frames are dropped and the affected sessions' sync states reset, so
/// nothing undurable is acknowledged and anti-entropy retries later. When the next batch is
/// already queued, the fsync ([`DocStore::begin_flush`]) runs on the sync thread (`commit`)
/// while the thread handles that batch, and the batch's outputs are released once it is done
/// ([`DocStore::complete_flush`]; looked for after each event of that batch, so they wait
/// for their fsync, not for the whole next batch), before the next batch's: a healing replica
/// otherwise spent a quarter of its time waiting in `syncfs`. A failed sync drops its batch's outputs; the next
/// batch's commit covers its files again, so the later outputs that may reflect them still wait
/// for them.
///
/// Timers: the thread sleeps until the protocol's [`Protocol::poll_timeout`] (no sooner than
/// `tick_interval` after the last run, no later than [`MAX_SLEEP`]) or the next event, and
/// every batch that finds the timers due ends with a tick, so they run on time even when
/// frames keep the queue full (a healing replica otherwise went seconds without heartbeats,
/// which tell peers how far it got, and without its delayed answers and relays).
///
/// Signature checks: with `verifiers` the protocol hands them out ([`Protocol::poll_verify`])
/// and the thread queues them on the verifier threads after each event; checks reported done are handed back
/// ([`Protocol::on_verified`]) at the start of the next batch, before its new events.
#[allow(clippy::too_many_arguments)]
pub(super) fn drive<S: DocStore>(
    protocol: Protocol,
    store: Arc<Mutex<S>>,
    mut events: mpsc::Receiver<Event>,
    applied: broadcast::Sender<AppliedChange>,
    shared: Arc<Shared>,
    max_sessions: usize,
    tick_interval: Duration,
    verifiers: Option<Verifiers>,
) {
    let (pool, mut done) = match verifiers {
        Some(v) => (Some(v.pool), Some(v.done)),
        None => (None, None),
    };
    let mut driver = Driver {
        pool,
        sync_thread: SyncThread::NotStarted,
        committing: None,
        unchecked: Vec::new(),
        local_uri: protocol.local().uri(),
        protocol,
        store,
        applied,
        shared,
        max_sessions,
        tick_interval,
        conns: HashMap::new(),
        held: Vec::new(),
        pushed: HashSet::new(),
        conns_changed: true,
        last_tick: Instant::now(),
    };
    // Only a timer: waiting for the next event or the next timer, whichever comes first.
    let clock = match tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the protocol thread's clock; the mesh node stops");
            return;
        }
    };
    let mut batch: Vec<Event> = Vec::with_capacity(MAX_BATCH_EVENTS);
    let mut checked: Vec<Ticket> = Vec::new();
    loop {
        let in_flight = driver.protocol.verifications_in_flight();
        let wake = Wake {
            take_events: in_flight < MAX_CHECKS_IN_FLIGHT,
            in_flight,
            deadline: driver.next_tick(),
        };
        if !next_batch(
            &clock,
            &mut events,
            &mut done,
            &mut batch,
            &mut checked,
            wake,
        ) {
            break;
        }
        driver.handle_checked(&mut checked);
        let stop = driver.handle_batch(&mut batch);
        driver.tick_if_due();
        driver.generate_pushes();
        // The previous batch's sync ran while this one was handled.
        driver.finish_commit();
        driver.begin_commit();
        // Only a batch that is taken at once may run alongside the sync: waiting for events with
        // outputs held would delay them.
        let next_ready = !stop
            && !events.is_empty()
            && driver.protocol.verifications_in_flight() < MAX_CHECKS_IN_FLIGHT;
        if !next_ready {
            driver.finish_commit();
        }
        driver.publish();
        if stop {
            break;
        }
    }
    driver.finish_commit();
    driver.close_all();
}

/// Longest the protocol thread goes without running its timers, whatever
/// [`Protocol::poll_timeout`] says: a bound, should a timer ever go unreported.
const MAX_SLEEP: Duration = Duration::from_secs(1);

/// What [`next_batch`] waits for: new events (unless too many checks are out), checks done (of
/// `in_flight` out), and until when.
struct Wake {
    take_events: bool,
    in_flight: usize,
    deadline: Instant,
}

/// How long the thread, woken by finished checks alone while more are out, waits for the rest
/// (or an event) before it handles them: a burst of signed messages finishes its checks within
/// a few milliseconds, and handling each as it finished cost a commit (a `syncfs`) per
/// document or two.
const CHECK_LINGER: Duration = Duration::from_millis(3);

/// What woke [`wait_one`].
enum Woken {
    Event(Option<Event>),
    Checked(Option<Ticket>),
}

/// Waits until `until` for the next event (when `take_events`) or finished check; `None` when
/// the time passed first.
fn wait_one(
    clock: &tokio::runtime::Runtime,
    events: &mut mpsc::Receiver<Event>,
    done: &mut Option<mpsc::UnboundedReceiver<Ticket>>,
    take_events: bool,
    until: Instant,
) -> Option<Woken> {
    let deadline = tokio::time::Instant::from_std(until);
    // The timer is made inside the clock's context (a `Sleep` needs its runtime).
    let wait = async {
        let check = async {
            match done.as_mut() {
                Some(d) => d.recv().await,
                None => std::future::pending().await,
            }
        };
        let event = async {
            if take_events {
                events.recv().await
            } else {
                std::future::pending().await
            }
        };
        let either = async {
            tokio::select! {
                biased;
                t = check => Woken::Checked(t),
                e = event => Woken::Event(e),
            }
        };
        tokio::time::timeout_at(deadline, either).await
    };
    clock.block_on(wait).ok()
}

/// Waits until `wake.deadline` for an event (when `wake.take_events`) or a check reported done,
/// then takes every check already done and every event already queued (up to
/// [`MAX_BATCH_EVENTS`]); woken by checks alone while more are out, it waits up to
/// [`CHECK_LINGER`] for those too. Nothing when the deadline passed first, `false` once every
/// event sender is gone.
fn next_batch(
    clock: &tokio::runtime::Runtime,
    events: &mut mpsc::Receiver<Event>,
    done: &mut Option<mpsc::UnboundedReceiver<Ticket>>,
    batch: &mut Vec<Event>,
    checked: &mut Vec<Ticket>,
    wake: Wake,
) -> bool {
    let drain_done = |done: &mut Option<mpsc::UnboundedReceiver<Ticket>>,
                      checked: &mut Vec<Ticket>| {
        if let Some(d) = done.as_mut() {
            while let Ok(t) = d.try_recv() {
                checked.push(t);
            }
        }
    };
    drain_done(done, checked);
    let mut first = None;
    if wake.take_events {
        match events.try_recv() {
            Ok(e) => first = Some(e),
            Err(mpsc::error::TryRecvError::Disconnected) => return false,
            Err(mpsc::error::TryRecvError::Empty) => {}
        }
    }
    if first.is_none() && checked.is_empty() {
        match wait_one(clock, events, done, wake.take_events, wake.deadline) {
            Some(Woken::Event(Some(e))) => first = Some(e),
            Some(Woken::Event(None)) => return false,
            Some(Woken::Checked(Some(t))) => checked.push(t),
            // The pool holds a sender as long as it lives.
            Some(Woken::Checked(None)) => *done = None,
            None => return true,
        }
    }
    if first.is_none() && !checked.is_empty() {
        let until = (Instant::now() + CHECK_LINGER).min(wake.deadline);
        while checked.len() < wake.in_flight {
            drain_done(done, checked);
            if checked.len() >= wake.in_flight {
                break;
            }
            match wait_one(clock, events, done, wake.take_events, until) {
                Some(Woken::Checked(Some(t))) => checked.push(t),
                Some(Woken::Event(Some(e))) => {
                    first = Some(e);
                    break;
                }
                Some(Woken::Event(None)) => return false,
                Some(Woken::Checked(None)) => {
                    *done = None;
                    break;
                }
                None => break,
            }
        }
    }
    let Some(first) = first else {
        return true;
    };
    batch.push(first);
    while batch.len() < MAX_BATCH_EVENTS {
        match events.try_recv() {
            Ok(e) => batch.push(e),
            Err(_) => break,
        }
    }
    true
}

/// The protocol thread's state: the protocol, the connection table, and what the batch being
/// handled produced.
/// The node's sync thread: started with the first sync (a node agent that relays nothing
/// never needs one); once it could not start or it ended, commits run on the protocol thread.
enum SyncThread {
    NotStarted,
    Running(Syncer),
    Unavailable,
}

impl SyncThread {
    fn running(&mut self) -> Option<&mut Syncer> {
        match self {
            SyncThread::Running(s) => Some(s),
            SyncThread::NotStarted | SyncThread::Unavailable => None,
        }
    }
}

struct Driver<S> {
    protocol: Protocol,
    /// The verifier threads (see [`drive`]).
    pool: Option<VerifyPool>,
    /// The thread that runs a batch's fsync while the next batch is handled (see [`drive`]).
    sync_thread: SyncThread,
    /// The sync running on the sync thread and the outputs of the batch it makes durable.
    committing: Option<(Arc<PendingSync>, Vec<Output>)>,
    /// Checks handed out with no pool to run them: handed back at once, for the store to check.
    unchecked: Vec<Ticket>,
    store: Arc<Mutex<S>>,
    applied: broadcast::Sender<AppliedChange>,
    shared: Arc<Shared>,
    max_sessions: usize,
    tick_interval: Duration,
    local_uri: String,
    conns: HashMap<ConnId, ConnEntry>,
    /// The batch's outputs, held until what produced them is durable.
    held: Vec<Output>,
    /// Documents whose local change the batch already pushed.
    pushed: HashSet<DocId>,
    /// Whether the set of connections changed since the view last listed it (a relay holds a
    /// session per node of its cluster: listing them after every batch cost a quarter of its
    /// protocol thread).
    conns_changed: bool,
    last_tick: Instant,
}

impl<S: DocStore> Driver<S> {
    /// When the timers next need to run: when the protocol asks, but not sooner than
    /// `tick_interval` after the last run nor later than [`MAX_SLEEP`] after it.
    fn next_tick(&self) -> Instant {
        let latest = self.last_tick + MAX_SLEEP;
        match self.protocol.poll_timeout() {
            Some(at) => at.max(self.last_tick + self.tick_interval).min(latest),
            None => latest,
        }
    }

    /// Runs the protocol's timers if they are due (asked after the batch's events, which may
    /// have scheduled some).
    fn tick_if_due(&mut self) {
        let now = Instant::now();
        if now < self.next_tick() {
            return;
        }
        self.last_tick = now;
        let outputs = {
            let mut s = lock(&self.store);
            self.protocol.on_tick(&mut *s, now)
        };
        self.hold(outputs);
    }

    /// Queues the signature checks the protocol handed out on the verifier threads.
    fn dispatch_checks(&mut self) {
        while let Some(job) = self.protocol.poll_verify() {
            match &mut self.pool {
                Some(pool) => pool.submit(job),
                None => self.unchecked.push(job.ticket),
            }
        }
    }

    /// Closes at once the connections the protocol closes (closing acknowledges nothing, and
    /// later frames of the batch from them are then ignored), holds every other output, and
    /// queues the checks the protocol handed out.
    fn hold(&mut self, outputs: Vec<Output>) {
        for out in outputs {
            match out {
                Output::Close { conn, reason } => self.close(conn, &reason),
                other => self.held.push(other),
            }
        }
        self.dispatch_checks();
    }

    /// Hands the protocol back the signature checks that are done (and any that had no
    /// thread to run on): the messages parked behind them go to the store.
    fn handle_checked(&mut self, checked: &mut Vec<Ticket>) {
        checked.append(&mut self.unchecked);
        if checked.is_empty() {
            return;
        }
        let now = Instant::now();
        let outputs: Vec<Output> = {
            let mut s = lock(&self.store);
            checked
                .drain(..)
                .flat_map(|t| self.protocol.on_verified(&mut *s, t, now))
                .collect()
        };
        self.hold(outputs);
        self.poll_commit();
    }

    /// Hands the batch's events to the protocol, closing at once the connections it closes
    /// and holding every other output. `true` when the batch asked the thread to stop (the
    /// events queued behind the shutdown are dropped).
    fn handle_batch(&mut self, batch: &mut Vec<Event>) -> bool {
        self.pushed.clear();
        for event in batch.drain(..) {
            let now = Instant::now();
            let outputs = match event {
                Event::Shutdown => return true,
                Event::Connected {
                    conn,
                    identity,
                    dialed,
                    connection,
                    outbound,
                    stats,
                } => {
                    let entry = ConnEntry {
                        identity,
                        dialed,
                        connection,
                        outbound,
                        stats,
                    };
                    self.on_connected(conn, entry, now)
                }
                Event::Disconnected(conn) => {
                    if self.conns.remove(&conn).is_some() {
                        self.conns_changed = true;
                        self.protocol.on_disconnected(conn);
                    }
                    vec![]
                }
                Event::SetRelay(on) => self.set_relay(on),
                Event::Frame(conn, env) => {
                    if self.conns.contains_key(&conn) {
                        let mut s = lock(&self.store);
                        self.protocol.handle_frame(&mut *s, conn, env, now)
                    } else {
                        vec![]
                    }
                }
                Event::LocalChange(doc) => {
                    // The application wrote before it notified, so the first push of a batch
                    // already carries every write whose notification is queued behind it.
                    if self.pushed.insert(doc.clone()) {
                        let mut s = lock(&self.store);
                        self.protocol.on_local_change(&mut *s, &doc)
                    } else {
                        vec![]
                    }
                }
                Event::Peers(reply) => {
                    let _ = reply.send(peer_statuses(&self.protocol, &self.conns));
                    vec![]
                }
            };
            self.hold(outputs);
            self.poll_commit();
        }
        false
    }

    /// A new connection: kept, unless it duplicates one to the same identity that wins (both
    /// ends keep the one dialed by the smaller identity URI, or the newer one when the same
    /// side dialed both) or the node already has [`TransportConfig::max_sessions`](crate::transport::TransportConfig).
    fn on_connected(&mut self, conn: ConnId, entry: ConnEntry, now: Instant) -> Vec<Output> {
        let existing = self
            .conns
            .iter()
            .find(|(_, e)| e.identity == entry.identity)
            .map(|(c, e)| (*c, e.dialed));
        let keep_new = match existing {
            None => true,
            Some((_, old_dialed)) if old_dialed == entry.dialed => true,
            Some(_) => {
                // Keep the connection dialed by the smaller identity URI.
                let we_are_smaller = self.local_uri < entry.identity.uri();
                entry.dialed == we_are_smaller
            }
        };
        let transport = &self.shared.transport;
        if keep_new && existing.is_none() && self.conns.len() >= self.max_sessions {
            transport.sessions_refused.fetch_add(1, Ordering::Relaxed);
            warn!(identity = %entry.identity, max_sessions = self.max_sessions, "too many sessions; connection closed");
            entry.connection.close(6, b"too many sessions");
            return vec![];
        }
        if !keep_new {
            transport
                .duplicate_connections
                .fetch_add(1, Ordering::Relaxed);
            entry.connection.close(2, b"duplicate connection");
            return vec![];
        }
        if let Some((old, _)) = existing
            && let Some(e) = self.conns.remove(&old)
        {
            transport
                .duplicate_connections
                .fetch_add(1, Ordering::Relaxed);
            e.connection.close(2, b"duplicate connection");
            self.protocol.on_disconnected(old);
        }
        self.conns_changed = true;
        let identity = entry.identity.clone();
        self.conns.insert(conn, entry);
        self.protocol.on_connected(conn, identity, now)
    }

    /// Becomes or stops being the cluster's relay; a node that stops drops what it carried.
    fn set_relay(&mut self, on: bool) -> Vec<Output> {
        let closes = self.protocol.set_relay(on);
        if !on {
            let dropped = lock(&self.store).drop_copies();
            if dropped > 0 {
                info!(
                    dropped,
                    "no longer the cluster's relay: dropped the documents it carried"
                );
            }
        }
        closes
    }

    /// Closes a connection and ends its session.
    fn close(&mut self, conn: ConnId, reason: &str) {
        if let Some(e) = self.conns.remove(&conn) {
            self.conns_changed = true;
            e.connection.close(1, reason.as_bytes());
            self.protocol.on_disconnected(conn);
        }
    }

    /// The batch's coalesced pushes: one per (connection, document).
    fn generate_pushes(&mut self) {
        if self.protocol.has_deferred_pushes() {
            let mut s = lock(&self.store);
            self.held.extend(self.protocol.flush_pushes(&mut *s));
        }
    }

    /// Starts making what the batch received durable: its sync goes to the sync thread and the
    /// batch's outputs wait for it ([`Driver::finish_commit`]). Without the thread, or when
    /// the store has nothing to run elsewhere, the batch is committed and released here.
    fn begin_commit(&mut self) {
        let outputs = std::mem::take(&mut self.held);
        let begun = lock(&self.store).begin_flush();
        let sync = match begun {
            Ok(Some(sync)) => Arc::new(sync),
            Ok(None) => return self.release(outputs),
            Err(e) => return self.drop_outputs(&e, outputs),
        };
        if self.syncer().is_some_and(|s| s.submit(&sync)) {
            self.committing = Some((sync, outputs));
        } else {
            let r = sync.run();
            self.complete(sync, r, outputs);
        }
    }

    /// The sync thread, started with the first sync; `None` when it cannot run.
    fn syncer(&mut self) -> Option<&mut Syncer> {
        if let SyncThread::NotStarted = self.sync_thread {
            self.sync_thread = match Syncer::start() {
                Ok(s) => SyncThread::Running(s),
                Err(e) => {
                    warn!(error = %e, "cannot start the mesh node's sync thread; committing on the protocol thread");
                    SyncThread::Unavailable
                }
            };
        }
        self.sync_thread.running()
    }

    /// Waits for the sync of the batch before, then releases its outputs (or drops them if it
    /// failed).
    fn finish_commit(&mut self) {
        if self.committing.is_some() {
            let result = self.sync_thread.running().and_then(Syncer::wait);
            self.committed(result);
        }
    }

    /// Releases the batch before as soon as its sync is done, between the events of the next
    /// batch, so its outputs wait for their fsync and not for the next batch as well.
    fn poll_commit(&mut self) {
        if self.committing.is_some() {
            match self.sync_thread.running().map(Syncer::try_wait) {
                Some(None) => {}
                Some(Some(result)) => self.committed(result),
                None => self.committed(None),
            }
        }
    }

    /// The sync of the batch before reported `result` (`None`: the thread is gone, so it is
    /// not known durable).
    fn committed(&mut self, result: Option<Result<(), StoreError>>) {
        let Some((sync, outputs)) = self.committing.take() else {
            return;
        };
        let result = match result {
            Some(r) => r,
            None => {
                error!("the mesh node's sync thread ended; committing on the protocol thread");
                self.sync_thread = SyncThread::Unavailable;
                Err(StoreError::Io {
                    path: Default::default(),
                    source: std::io::Error::other("the mesh node's sync thread ended"),
                })
            }
        };
        self.complete(sync, result, outputs);
    }

    /// Books a sync's result with the store, then releases the outputs it held, or drops them.
    fn complete(
        &mut self,
        sync: Arc<PendingSync>,
        result: Result<(), StoreError>,
        outputs: Vec<Output>,
    ) {
        let completed = match Arc::try_unwrap(sync) {
            Ok(sync) => lock(&self.store).complete_flush(sync, result),
            // The thread drops its handle before it reports (see `commit`), so this does not
            // happen; if it did, the outputs wait for nothing that is known durable.
            Err(_) => Err(RejectReason::Store(
                "a sync was still held by the sync thread".into(),
            )),
        };
        match completed {
            Ok(()) => self.release(outputs),
            Err(e) => self.drop_outputs(&e, outputs),
        }
    }

    /// Drops the outputs of a batch whose changes are not durable (and tells the protocol), so
    /// nothing undurable is acknowledged.
    fn drop_outputs(&mut self, e: &RejectReason, outputs: Vec<Output>) {
        warn!(error = %e, frames = outputs.len(), "store flush failed; outputs of the batch dropped");
        for out in outputs {
            if let Output::Send { conn, envelope } = out {
                self.protocol.on_dropped(conn, &envelope);
            }
        }
    }

    /// Sends a committed batch's frames within the budgets, closes what the batch closed,
    /// announces the applied changes, then runs the store's deferred upkeep.
    fn release(&mut self, outputs: Vec<Output>) {
        for out in outputs {
            match out {
                Output::Send { conn, envelope } => self.send(conn, envelope),
                Output::Close { conn, reason } => self.close(conn, &reason),
                Output::Applied {
                    doc,
                    generation,
                    from,
                } => {
                    let _ = self.applied.send(AppliedChange {
                        doc,
                        generation,
                        from,
                    });
                }
            }
        }
        lock(&self.store).maintain();
    }

    /// Queues one frame on its connection if both the connection's and the node's outbound
    /// budgets take it; otherwise drops it and tells the protocol.
    fn send(&mut self, conn: ConnId, envelope: pb::Envelope) {
        let Some(entry) = self.conns.get(&conn) else {
            return;
        };
        let frame = match wire::encode_frame(&envelope) {
            Ok(f) => f,
            Err(e) => {
                warn!(peer = %entry.identity, error = %e, "cannot encode frame; dropped");
                return;
            }
        };
        let shared = &self.shared;
        let len = u32::try_from(frame.len()).unwrap_or(u32::MAX);
        let permits = len.min(entry.outbound.max_permits);
        let total = shared
            .outbound_total
            .clone()
            .try_acquire_many_owned(len.min(shared.outbound_total_max));
        let own = entry.outbound.budget.try_acquire_many(permits);
        match (own, total) {
            (Ok(p), Ok(total)) => {
                p.forget();
                let _ = entry.outbound.tx.send((frame, permits, total));
            }
            _ => {
                shared
                    .transport
                    .frames_dropped
                    .fetch_add(1, Ordering::Relaxed);
                debug!(peer = %entry.identity, "outbound budget exhausted; frame dropped");
                self.protocol.on_dropped(conn, &envelope);
            }
        }
    }

    /// Publishes what the handle reads between batches (replicas, connections, counters).
    fn publish(&mut self) {
        let mut view = lock(&self.shared.view);
        if view.known_replicas != *self.protocol.known_replicas() {
            view.known_replicas = self.protocol.known_replicas().clone();
        }
        if std::mem::take(&mut self.conns_changed) {
            view.connected = self.conns.values().map(|e| e.identity.clone()).collect();
        }
        view.counters = self.protocol.counters().clone();
        view.relay_session = self.protocol.has_relay_session();
    }

    /// Closes every connection (the thread is stopping).
    fn close_all(self) {
        for (_, e) in self.conns {
            e.connection.close(0, b"shutdown");
        }
    }
}

fn peer_statuses(protocol: &Protocol, conns: &HashMap<ConnId, ConnEntry>) -> Vec<PeerStatus> {
    protocol
        .sessions()
        .into_iter()
        .filter_map(|s| {
            let e = conns.get(&s.conn)?;
            Some(PeerStatus {
                identity: s.identity,
                remote_addr: e.connection.remote_address(),
                dialed: e.dialed,
                hello_received: s.hello_received,
                last_heard: s.last_heard,
                bytes_sent: e.stats.bytes_sent.load(Ordering::Relaxed),
                bytes_received: e.stats.bytes_received.load(Ordering::Relaxed),
                rtt: e.connection.rtt(),
                docs_behind: s.docs_behind,
                digest_matched: s.digest_matched,
                refused: s.refused,
                relay: s.relay,
            })
        })
        .collect()
}
