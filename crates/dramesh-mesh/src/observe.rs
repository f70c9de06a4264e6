//! Observability of a running replica or agent: fills the daemon's metric set
//! ([`dramesh_telemetry::Metrics`]) from the mesh node and the store, tracks when each peer last
//! delivered a change of each cluster, and gives the status page its peer rows.
//!
//! Gauges are refreshed on every `/metrics` scrape and status page load ([`Observer::refresh`]),
//! so a scrape never shows values older than the scrape itself. Mesh counters that the node
//! keeps as running totals (bytes per connection, refused writes) are turned into Prometheus
//! counters by adding the growth since the previous refresh; a connection that restarted its
//! totals counts from zero again, so counters never go down.
//!
//! Sync lag per peer and cluster is the time since the newest change of that cluster arrived
//! from that peer, on this process's monotonic clock (wall clocks of different machines are
//! never compared). It grows while a cluster is quiet; `docs_behind` (what the peer's last
//! heartbeat reported as differing) is the measure of how far behind a peer is.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dramesh_telemetry::{Direction, Metrics};

use crate::PeerIdentity;
use crate::node::{AppliedChange, MeshHandle, PeerStatus};
use crate::store_adapter::MeshStore;
use crate::sync::lock;

/// The `peer` label and the status page's name of a mesh identity (its URI without scheme).
pub fn peer_label(id: &PeerIdentity) -> String {
    let uri = id.uri();
    uri.strip_prefix("dramesh://").unwrap_or(&uri).to_string()
}

fn peer_kind(id: &PeerIdentity) -> &'static str {
    match id {
        PeerIdentity::Replica { .. } => "replica",
        PeerIdentity::Agent { .. } => "agent",
    }
}

/// One live mesh connection as the status page shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerRow {
    /// [`peer_label`] of the peer's identity.
    pub peer: String,
    /// `replica` or `agent`.
    pub kind: &'static str,
    /// The peer's UDP address.
    pub addr: SocketAddr,
    /// Whether this side dialed the connection.
    pub dialed: bool,
    /// Whether the peer's hello arrived.
    pub hello_received: bool,
    /// Time since anything arrived from the peer.
    pub last_heard: Duration,
    /// QUIC's round-trip estimate.
    pub rtt: Duration,
    /// Documents the peer's last heartbeat reported as differing.
    pub docs_behind: usize,
    /// Bytes sent on this connection.
    pub bytes_sent: u64,
    /// Bytes received on this connection.
    pub bytes_received: u64,
    /// Per cluster: time since the newest change of it arrived from this peer.
    pub sync_lag: BTreeMap<String, Duration>,
}

#[derive(Default)]
struct Totals {
    /// (peer, cluster) -> arrival of the newest change.
    arrivals: BTreeMap<(String, String), Instant>,
    /// peer -> (bytes sent, bytes received) as of the last refresh.
    bytes: HashMap<String, (u64, u64)>,
    /// reason -> refused-write total as of the last refresh.
    rejected: HashMap<&'static str, u64>,
    /// (listener, reason) -> failed TLS handshakes of the mesh as of the last refresh.
    tls: HashMap<(&'static str, &'static str), u64>,
}

/// Metrics and peer state of one replica or agent.
pub struct Observer {
    /// The daemon's metric set, rendered by its `/metrics` handler.
    pub metrics: Arc<Metrics>,
    mesh: Arc<MeshHandle>,
    store: Arc<Mutex<MeshStore>>,
    totals: Mutex<Totals>,
}

impl Observer {
    /// An observer filling `metrics` from `mesh` and the store it replicates.
    pub fn new(
        metrics: Arc<Metrics>,
        mesh: Arc<MeshHandle>,
        store: Arc<Mutex<MeshStore>>,
    ) -> Arc<Observer> {
        Arc::new(Observer {
            metrics,
            mesh,
            store,
            totals: Mutex::new(Totals::default()),
        })
    }

    /// Notes that a change of `a.doc.cluster` arrived from `a.from` now.
    pub fn applied(&self, a: &AppliedChange) {
        lock(&self.totals)
            .arrivals
            .insert((peer_label(&a.from), a.doc.cluster.clone()), Instant::now());
    }

    /// Live connections with their sync lag per cluster, sorted by peer.
    pub async fn peers(&self) -> Vec<PeerRow> {
        let peers = self.mesh.peers().await;
        self.rows(&peers)
    }

    fn rows(&self, peers: &[PeerStatus]) -> Vec<PeerRow> {
        let totals = lock(&self.totals);
        let mut rows: Vec<PeerRow> = peers
            .iter()
            .map(|p| {
                let peer = peer_label(&p.identity);
                let sync_lag = totals
                    .arrivals
                    .range((peer.clone(), String::new())..)
                    .take_while(|((pp, _), _)| *pp == peer)
                    .map(|((_, c), t)| (c.clone(), t.elapsed()))
                    .collect();
                PeerRow {
                    kind: peer_kind(&p.identity),
                    addr: p.remote_addr,
                    dialed: p.dialed,
                    hello_received: p.hello_received,
                    last_heard: p.last_heard.elapsed(),
                    rtt: p.rtt,
                    docs_behind: p.docs_behind,
                    bytes_sent: p.bytes_sent,
                    bytes_received: p.bytes_received,
                    sync_lag,
                    peer,
                }
            })
            .collect();
        rows.sort_by(|a, b| a.peer.cmp(&b.peer).then(a.addr.cmp(&b.addr)));
        rows
    }

    /// Brings every gauge and mirrored counter up to date; `data_ages` are the view's clusters
    /// with their data age (empty for an agent). Returns the peer rows it used.
    pub async fn refresh(&self, data_ages: Vec<(String, Option<Duration>)>) -> Vec<PeerRow> {
        let peers = self.mesh.peers().await;
        let rows = self.rows(&peers);
        self.refresh_mesh(&rows);
        let m = &self.metrics;
        m.view_data_age_seconds.retain(|_| false);
        for (c, age) in data_ages {
            if let Some(age) = age {
                m.set_view_data_age(&c, age);
            }
        }
        let store = self.store.clone();
        let metrics = self.metrics.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || refresh_store(&store, &metrics)).await {
            tracing::warn!(error = %e, "store statistics for /metrics panicked");
        }
        rows
    }

    fn refresh_mesh(&self, rows: &[PeerRow]) {
        let m = &self.metrics;
        let mut totals = lock(&self.totals);
        let mut kinds: BTreeMap<&str, f64> = BTreeMap::new();
        let connected: BTreeSet<String> = rows.iter().map(|r| r.peer.clone()).collect();
        // Gauges describe live connections only; the byte counters of a peer that left stay
        // (so sums over peers never go down) and continue when it reconnects.
        m.mesh_peer_docs_behind.retain(|[p]| connected.contains(p));
        totals.bytes.retain(|p, _| connected.contains(p));
        m.mesh_sync_lag_seconds.retain(|_| false);
        for r in rows {
            *kinds.entry(r.kind).or_default() += 1.0;
            m.mesh_peer_docs_behind
                .with([&r.peer])
                .set(r.docs_behind as f64);
            for (c, lag) in &r.sync_lag {
                m.set_sync_lag(&r.peer, c, *lag);
            }
            let last = totals.bytes.entry(r.peer.clone()).or_insert((0, 0));
            m.add_mesh_bytes(&r.peer, Direction::Sent, growth(&mut last.0, r.bytes_sent));
            m.add_mesh_bytes(
                &r.peer,
                Direction::Received,
                growth(&mut last.1, r.bytes_received),
            );
        }
        for k in ["replica", "agent"] {
            m.mesh_peers
                .with([k])
                .set(kinds.get(k).copied().unwrap_or(0.0));
        }
        let c = self.mesh.counters();
        let t = self.mesh.transport_counters();
        let out_of_scope = lock(&self.store).store().out_of_scope_records();
        for (reason, now) in [
            ("out_of_scope", out_of_scope),
            ("unauthorized", c.rejected_unauthorized),
            ("refused_by_store", c.rejected_by_store),
            ("bad_signature", c.rejected_bad_signature),
            ("stale_generation", c.stale_generation),
            ("version_refused", c.version_refusals_sent),
            ("identity_rejected", t.identity_rejections),
            ("handshake_failed", t.handshake_failures),
        ] {
            let last = totals.rejected.entry(reason).or_insert(0);
            m.reject_writes(reason, growth(last, now));
        }
        // Failed mesh handshakes in the API listeners' family: those of incoming
        // connections, and dials that ended in a TLS alert (logged naming it).
        for (key, now) in [
            (("mesh", "handshake_failed"), t.handshake_failures),
            (("mesh_dial", "tls_alert"), t.certificate_refusals),
        ] {
            let last = totals.tls.entry(key).or_insert(0);
            let n = growth(last, now);
            if n > 0 {
                m.tls_handshake_failures_total
                    .with([key.0, key.1])
                    .inc_by(n);
            }
        }
    }
}

/// How much a running total grew since `last` (all of it when it restarted lower), updating
/// `last`.
fn growth(last: &mut u64, now: u64) -> u64 {
    let d = if now >= *last { now - *last } else { now };
    *last = now;
    d
}

/// Stored bytes and history length per cluster, and the document count.
fn refresh_store(store: &Mutex<MeshStore>, m: &Metrics) {
    let mut bytes: BTreeMap<String, u64> = BTreeMap::new();
    let mut changes: BTreeMap<String, u64> = BTreeMap::new();
    let docs = {
        let s = lock(store);
        let docs = s.store().entries();
        for d in &docs {
            if let Some(st) = s.store().doc_stats(&d.doc) {
                *bytes.entry(d.doc.cluster.clone()).or_default() += st.stored_bytes;
                *changes.entry(d.doc.cluster.clone()).or_default() += st.num_changes;
            }
        }
        docs.len()
    };
    m.store_documents.set(docs as f64);
    m.store_bytes.retain(|[c]| bytes.contains_key(c));
    m.store_history_changes
        .retain(|[c]| changes.contains_key(c));
    for (c, b) in bytes {
        m.store_bytes.with([&c]).set(b as f64);
    }
    for (c, n) in changes {
        m.store_history_changes.with([&c]).set(n as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_never_goes_negative() {
        let mut last = 0;
        assert_eq!(growth(&mut last, 10), 10);
        assert_eq!(growth(&mut last, 15), 5);
        assert_eq!(
            growth(&mut last, 3),
            3,
            "a restarted total counts from zero"
        );
        assert_eq!(growth(&mut last, 3), 0);
    }

    #[test]
    fn peer_labels_drop_the_scheme() {
        let r = PeerIdentity::Replica { id: "r1".into() };
        assert_eq!(peer_label(&r), "replica/r1");
        let a = PeerIdentity::Agent {
            cluster: "c1".into(),
            node: "n1".into(),
        };
        assert_eq!(peer_label(&a), "cluster/c1/agent/n1");
        assert_eq!(peer_kind(&a), "agent");
    }
}
