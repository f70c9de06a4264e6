//! Electing the one agent that publishes cluster-scoped records, with a
//! `coordination.k8s.io/v1` Lease.
//!
//! Writes use the Lease's `resourceVersion` for optimistic concurrency, so of two agents
//! racing for the same Lease exactly one write wins (the other gets `409 Conflict` and
//! re-reads). Expiry is judged the way client-go does, by local observation rather than by
//! comparing clocks: a candidate takes over only after the Lease record has stayed unchanged
//! for its full `leaseDurationSeconds` as seen by the candidate itself. A holder that cannot
//! renew steps down after `renew_deadline` (shorter than the duration), so it stops
//! publishing before anyone else can acquire. The term is the Lease's `leaseTransitions`,
//! which grows by one on every change of holder.
//!
//! The holder is also its cluster's mesh relay when it has a relay address
//! ([`LeaseConfig::relay_addr`]): it writes it on the Lease as the annotation
//! [`RELAY_ANNOTATION`] with every acquire and renewal (and removes the annotation when it has
//! none, so a previous holder's address never outlives its term), and every agent reads it with
//! the Lease it already polls ([`RelayView`]). A release removes it.

use std::time::Duration;

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use tokio::sync::watch;
use tokio::time::Instant;

/// Lease settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This agent's identity in `holderIdentity` (e.g. the pod name).
    pub identity: String,
    /// `leaseDurationSeconds` written when holding (rounded up to whole seconds, at least 1).
    pub duration: Duration,
    /// How often the holder renews and a candidate re-reads.
    pub renew_every: Duration,
    /// A holder that has not renewed successfully for this long steps down. Must be shorter
    /// than `duration`.
    pub renew_deadline: Duration,
    /// The mesh address this agent serves its cluster's node agents on while it holds the
    /// Lease (it is then the cluster's relay); `None`: it relays nothing.
    pub relay_addr: Option<String>,
}

/// Annotation of the Lease naming the holder's relay address (`host:port`).
pub const RELAY_ANNOTATION: &str = "dramesh.io/relay";
/// Longest relay address believed from the annotation.
pub const MAX_RELAY_ADDR: usize = 256;

/// What the Lease says about the cluster's relay, as this agent last read it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RelayView {
    /// Nobody holds the Lease, or the holder publishes no relay address (no relay: agents
    /// dial the replicas).
    #[default]
    None,
    /// This agent holds the Lease.
    Me,
    /// Another agent holds it and serves the cluster's node agents at this address.
    Holder(String),
}

impl LeaseConfig {
    /// Defaults: 15 s duration, renew every 5 s, step down after 10 s without renewal.
    pub fn new(namespace: &str, name: &str, identity: &str) -> LeaseConfig {
        LeaseConfig {
            namespace: namespace.to_string(),
            name: name.to_string(),
            identity: identity.to_string(),
            duration: Duration::from_secs(15),
            renew_every: Duration::from_secs(5),
            renew_deadline: Duration::from_secs(10),
            relay_addr: None,
        }
    }
}

/// Whether this agent currently publishes cluster-scoped records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leadership {
    /// Another agent (or none) holds the Lease.
    Follower,
    /// This agent holds the Lease.
    Leader {
        /// The Lease term it acquired.
        term: u64,
    },
}

/// The fields of a Lease the decision reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// `holderIdentity`, when set and non-empty.
    pub holder: Option<String>,
    /// `leaseDurationSeconds`.
    pub duration: Duration,
    /// `leaseTransitions` (the term).
    pub transitions: u64,
    /// The [`RELAY_ANNOTATION`], when set, non-empty and at most [`MAX_RELAY_ADDR`] bytes.
    pub relay: Option<String>,
}

impl LeaseRecord {
    /// The fields read from a Lease object (missing ones as zero or `None`).
    pub fn of(lease: &Lease) -> LeaseRecord {
        let spec = lease.spec.as_ref();
        LeaseRecord {
            holder: spec
                .and_then(|s| s.holder_identity.clone())
                .filter(|h| !h.is_empty()),
            duration: Duration::from_secs(
                spec.and_then(|s| s.lease_duration_seconds)
                    .unwrap_or(0)
                    .max(0) as u64,
            ),
            transitions: spec.and_then(|s| s.lease_transitions).unwrap_or(0).max(0) as u64,
            relay: lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(RELAY_ANNOTATION))
                .filter(|a| !a.is_empty() && a.len() <= MAX_RELAY_ADDR)
                .cloned(),
        }
    }

    /// The cluster's relay as this record tells agent `me`.
    pub fn relay_view(&self, me: &str) -> RelayView {
        match (&self.holder, &self.relay) {
            (Some(h), _) if h == me => RelayView::Me,
            (Some(_), Some(addr)) => RelayView::Holder(addr.clone()),
            _ => RelayView::None,
        }
    }
}

/// What to do after reading the Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseAction {
    /// No Lease exists: create it holding it, term 0.
    Create,
    /// We hold it: renew, same term.
    Renew {
        /// The current term.
        term: u64,
    },
    /// Free or expired: take it with the next term.
    Acquire {
        /// The next term.
        term: u64,
    },
    /// Someone else holds it; it would expire after `remaining` more unchanged time.
    Follow {
        /// The current holder.
        holder: String,
        /// Time until it would expire if nothing changes.
        remaining: Duration,
    },
}

/// Decides from the current record (`None` if there is no Lease) and how long this agent
/// has seen the record unchanged.
pub fn decide(record: Option<&LeaseRecord>, me: &str, unchanged_for: Duration) -> LeaseAction {
    let Some(r) = record else {
        return LeaseAction::Create;
    };
    match &r.holder {
        Some(h) if h == me => LeaseAction::Renew {
            term: r.transitions,
        },
        Some(h) if unchanged_for < r.duration => LeaseAction::Follow {
            holder: h.clone(),
            remaining: r.duration - unchanged_for,
        },
        _ => LeaseAction::Acquire {
            term: r.transitions + 1,
        },
    }
}

fn duration_secs(d: Duration) -> i32 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(s.max(1)).unwrap_or(i32::MAX)
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// The Lease object to write for `action` given the current one.
pub fn lease_for(
    cfg: &LeaseConfig,
    current: Option<&Lease>,
    action: &LeaseAction,
) -> Option<Lease> {
    let (term, acquiring) = match action {
        LeaseAction::Create => (0, true),
        LeaseAction::Renew { term } => (*term, false),
        LeaseAction::Acquire { term } => (*term, true),
        LeaseAction::Follow { .. } => return None,
    };
    let mut lease = current.cloned().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(cfg.name.clone()),
            namespace: Some(cfg.namespace.clone()),
            ..Default::default()
        },
        spec: None,
    });
    let mut spec = lease.spec.take().unwrap_or_default();
    let t = now();
    if acquiring {
        spec.acquire_time = Some(t.clone());
    }
    spec.renew_time = Some(t);
    spec.holder_identity = Some(cfg.identity.clone());
    spec.lease_duration_seconds = Some(duration_secs(cfg.duration));
    spec.lease_transitions = Some(i32::try_from(term).unwrap_or(i32::MAX));
    lease.spec = Some(spec);
    set_relay_annotation(&mut lease, cfg.relay_addr.as_deref());
    Some(lease)
}

/// Sets the [`RELAY_ANNOTATION`] to `addr`, or removes it.
fn set_relay_annotation(lease: &mut Lease, addr: Option<&str>) {
    match addr {
        Some(addr) => {
            lease
                .metadata
                .annotations
                .get_or_insert_with(BTreeMap::new)
                .insert(RELAY_ANNOTATION.to_string(), addr.to_string());
        }
        None => {
            if let Some(a) = lease.metadata.annotations.as_mut() {
                a.remove(RELAY_ANNOTATION);
            }
        }
    }
}

/// A write lost the optimistic-concurrency race.
fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Runs the election until `shutdown` resolves, publishing the current [`Leadership`] on
/// `state` and what the Lease says about the cluster's relay on `relay`. On shutdown a held
/// Lease is released (holder cleared, duration 1 s, relay annotation removed) so another agent
/// can take over at once.
pub async fn run_election(
    api: Api<Lease>,
    cfg: LeaseConfig,
    state: watch::Sender<Leadership>,
    relay: std::sync::Arc<watch::Sender<RelayView>>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut observed: Option<(Option<String>, Option<String>, Instant)> = None;
    let mut last_renew: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let started = Instant::now();
        let mut retry_now = false;
        match api.get_opt(&cfg.name).await {
            Ok(current) => {
                // The record's identity is its resourceVersion (and holder, for servers
                // that reuse versions): any write restarts the expiry clock.
                let fingerprint = current.as_ref().map(|l| {
                    (
                        l.metadata.resource_version.clone(),
                        l.spec.as_ref().and_then(|s| s.holder_identity.clone()),
                    )
                });
                let unchanged_for = match (&observed, &fingerprint) {
                    (Some((rv, h, since)), Some((crv, ch))) if rv == crv && h == ch => {
                        started.saturating_duration_since(*since)
                    }
                    _ => {
                        observed = fingerprint.map(|(rv, h)| (rv, h, started));
                        Duration::ZERO
                    }
                };
                let record = current.as_ref().map(LeaseRecord::of);
                let view = record
                    .as_ref()
                    .map_or(RelayView::None, |r| r.relay_view(&cfg.identity));
                let action = decide(record.as_ref(), &cfg.identity, unchanged_for);
                match lease_for(&cfg, current.as_ref(), &action) {
                    None => {
                        if let LeaseAction::Follow { holder, remaining } = &action {
                            tracing::debug!(%holder, ?remaining, lease = %cfg.name, "lease held by another agent");
                        }
                        last_renew = None;
                        state.send_if_modified(|s| {
                            std::mem::replace(s, Leadership::Follower) != Leadership::Follower
                        });
                        relay.send_if_modified(|r| std::mem::replace(r, view.clone()) != view);
                    }
                    Some(lease) => {
                        let term = lease
                            .spec
                            .as_ref()
                            .and_then(|s| s.lease_transitions)
                            .unwrap_or(0)
                            .max(0) as u64;
                        let written = if current.is_some() {
                            api.replace(&cfg.name, &PostParams::default(), &lease).await
                        } else {
                            api.create(&PostParams::default(), &lease).await
                        };
                        match written {
                            Ok(_) => {
                                last_renew = Some(started);
                                let new = Leadership::Leader { term };
                                state.send_if_modified(|s| std::mem::replace(s, new) != new);
                                relay.send_if_modified(|r| {
                                    std::mem::replace(r, RelayView::Me) != RelayView::Me
                                });
                            }
                            Err(e) if is_conflict(&e) => {
                                // Someone else wrote first; re-read at once.
                                retry_now = true;
                            }
                            Err(e) => {
                                tracing::warn!(lease = %cfg.name, error = %e, "cannot write lease");
                            }
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(lease = %cfg.name, error = %e, "cannot read lease"),
        }
        if let Some(t) = last_renew
            && t.elapsed() >= cfg.renew_deadline
        {
            tracing::warn!(lease = %cfg.name, "lease not renewed in time; stepping down");
            last_renew = None;
            state.send_if_modified(|s| {
                std::mem::replace(s, Leadership::Follower) != Leadership::Follower
            });
            relay.send_if_modified(|r| std::mem::replace(r, RelayView::None) != RelayView::None);
        }
        let pause = if retry_now {
            Duration::ZERO
        } else {
            cfg.renew_every
        };
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = &mut shutdown => break,
        }
    }
    if matches!(*state.borrow(), Leadership::Leader { .. }) {
        state.send_replace(Leadership::Follower);
        relay.send_replace(RelayView::None);
        release(&api, &cfg).await;
    }
}

async fn release(api: &Api<Lease>, cfg: &LeaseConfig) {
    let Ok(Some(mut lease)) = api.get_opt(&cfg.name).await else {
        return;
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
        return;
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(now());
    set_relay_annotation(&mut lease, None);
    if let Err(e) = api.replace(&cfg.name, &PostParams::default(), &lease).await {
        tracing::warn!(lease = %cfg.name, error = %e, "cannot release lease");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(holder: Option<&str>, secs: u64, transitions: u64) -> LeaseRecord {
        LeaseRecord {
            holder: holder.map(str::to_string),
            duration: Duration::from_secs(secs),
            transitions,
            relay: None,
        }
    }

    #[test]
    fn the_holder_publishes_its_relay_address_and_a_holder_without_one_removes_it() {
        let mut cfg = LeaseConfig::new("ns", "l", "a");
        cfg.relay_addr = Some("10.0.0.1:7947".into());
        let l = lease_for(&cfg, None, &LeaseAction::Create).unwrap();
        let r = LeaseRecord::of(&l);
        assert_eq!(r.relay.as_deref(), Some("10.0.0.1:7947"));
        assert_eq!(r.relay_view("a"), RelayView::Me);
        assert_eq!(r.relay_view("b"), RelayView::Holder("10.0.0.1:7947".into()));
        // b takes over without a relay address: a's address must not outlive a's term.
        let mut b = LeaseConfig::new("ns", "l", "b");
        b.relay_addr = None;
        let l = lease_for(&b, Some(&l), &LeaseAction::Acquire { term: 1 }).unwrap();
        let r = LeaseRecord::of(&l);
        assert_eq!(r.relay, None);
        assert_eq!(r.relay_view("a"), RelayView::None);
        assert_eq!(r.relay_view("b"), RelayView::Me);
        // No holder: no relay, whatever the annotation says; an oversized one is ignored.
        let mut free = rec(None, 1, 2);
        free.relay = Some("10.0.0.1:7947".into());
        assert_eq!(free.relay_view("a"), RelayView::None);
        let mut l = l;
        l.metadata.annotations = Some(BTreeMap::from([(
            RELAY_ANNOTATION.to_string(),
            "x".repeat(MAX_RELAY_ADDR + 1),
        )]));
        assert_eq!(LeaseRecord::of(&l).relay, None);
    }

    #[test]
    fn missing_lease_is_created() {
        assert_eq!(decide(None, "a", Duration::ZERO), LeaseAction::Create);
    }

    #[test]
    fn own_lease_is_renewed_with_same_term() {
        let r = rec(Some("a"), 15, 4);
        assert_eq!(
            decide(Some(&r), "a", Duration::from_secs(100)),
            LeaseAction::Renew { term: 4 }
        );
    }

    #[test]
    fn live_lease_of_another_is_followed() {
        let r = rec(Some("b"), 15, 4);
        assert_eq!(
            decide(Some(&r), "a", Duration::from_secs(10)),
            LeaseAction::Follow {
                holder: "b".into(),
                remaining: Duration::from_secs(5)
            }
        );
    }

    #[test]
    fn expired_or_released_lease_is_acquired_with_next_term() {
        let r = rec(Some("b"), 15, 4);
        assert_eq!(
            decide(Some(&r), "a", Duration::from_secs(15)),
            LeaseAction::Acquire { term: 5 }
        );
        let free = rec(None, 1, 5);
        assert_eq!(
            decide(Some(&free), "a", Duration::ZERO),
            LeaseAction::Acquire { term: 6 }
        );
    }

    #[test]
    fn written_lease_carries_identity_duration_and_term() {
        let mut cfg = LeaseConfig::new("kube-system", "dramesh", "agent-a");
        cfg.duration = Duration::from_millis(1500);
        let l = lease_for(&cfg, None, &LeaseAction::Create).unwrap();
        let s = l.spec.unwrap();
        assert_eq!(s.holder_identity.as_deref(), Some("agent-a"));
        assert_eq!(s.lease_duration_seconds, Some(2));
        assert_eq!(s.lease_transitions, Some(0));
        assert!(s.acquire_time.is_some() && s.renew_time.is_some());
        assert_eq!(l.metadata.namespace.as_deref(), Some("kube-system"));
        assert!(
            lease_for(
                &cfg,
                None,
                &LeaseAction::Follow {
                    holder: "b".into(),
                    remaining: Duration::ZERO
                }
            )
            .is_none()
        );
    }

    #[test]
    fn record_reads_empty_holder_as_free() {
        let lease = Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(String::new()),
                lease_duration_seconds: Some(15),
                lease_transitions: Some(3),
                ..Default::default()
            }),
        };
        assert_eq!(LeaseRecord::of(&lease), rec(None, 15, 3));
    }
}
