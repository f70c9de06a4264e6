//! Dialing: which addresses a node keeps a connection to, and one loop per address that dials,
//! runs the connection and redials with backoff.
//!
//! Guarantees: at most one dial loop per address; a loop whose address is no longer wanted
//! ends, closing its connection; refusals and unreachable peers are logged at most once a
//! minute per address and always counted.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, warn};

use super::Ctx;
use super::conn::run_connection;
use super::endpoint::check_identity;
use crate::identity::PeerIdentity;
use crate::sync::lock;
use crate::transport::MESH_SERVER_NAME;

/// Keeps one dial loop per address to dial, and ends the loops (and their connections) of
/// addresses no longer dialed.
///
/// Replicas, and agents without a relay target, dial the seeds and every replica learned
/// through peer exchange (replicas split the pairs). An agent with a relay target
/// ([`MeshHandle::set_relay_target`](super::MeshHandle::set_relay_target)) that is not itself the relay dials only the relay, and
/// the replicas too while it has had no session with the relay for
/// [`NodeConfig::relay_fallback`](super::NodeConfig::relay_fallback): nothing it writes waits for a relay that is down. Once a
/// session with the relay is up again, the direct ones are closed.
pub(super) async fn dial_manager(ctx: Ctx, seeds: Vec<SocketAddr>, own_addr: SocketAddr) {
    let mut dialing: HashMap<SocketAddr, watch::Sender<bool>> = HashMap::new();
    let mut loops = JoinSet::new();
    let mut check = tokio::time::interval(Duration::from_millis(250));
    let mut relay_down_since: Option<Instant> = None;
    loop {
        check.tick().await;
        if ctx.shared.closing.load(Ordering::Relaxed) {
            break;
        }
        let relay_target = *lock(&ctx.shared.relay_target);
        let (known, relay_up) = {
            let view = lock(&ctx.shared.view);
            (view.known_replicas.clone(), view.relay_session)
        };
        let via_relay = !ctx.local.is_replica()
            && !ctx.shared.relay.load(Ordering::Relaxed)
            && relay_target.is_some_and(|t| t != own_addr);
        let mut targets: Vec<(SocketAddr, Option<PeerIdentity>)> = Vec::new();
        let mut direct = true;
        if via_relay && let Some(relay) = relay_target {
            targets.push((relay, None));
            relay_down_since = if relay_up {
                None
            } else {
                relay_down_since.or(Some(Instant::now()))
            };
            direct = relay_down_since.is_some_and(|t| t.elapsed() >= ctx.relay_fallback);
        } else {
            relay_down_since = None;
        }
        if direct {
            targets.extend(seeds.iter().map(|a| (*a, None)));
            let local_uri = ctx.local.uri();
            for (uri, addr) in known {
                let Ok(addr) = addr.parse::<SocketAddr>() else {
                    continue;
                };
                let Ok(id) = PeerIdentity::parse_uri(&uri) else {
                    continue;
                };
                // Replicas split dialing between pairs; agents dial every replica.
                if ctx.local.is_replica() && local_uri > uri {
                    continue;
                }
                targets.push((addr, Some(id)));
            }
        }
        targets.retain(|(addr, _)| *addr != own_addr);
        let wanted: HashSet<SocketAddr> = targets.iter().map(|(a, _)| *a).collect();
        dialing.retain(|addr, w| {
            let keep = wanted.contains(addr);
            if !keep {
                let _ = w.send(false);
            }
            keep
        });
        for (addr, id) in targets {
            if dialing.contains_key(&addr) {
                continue;
            }
            let (tx, rx) = watch::channel(true);
            dialing.insert(addr, tx);
            loops.spawn(dial_loop(ctx.clone(), addr, id, rx));
        }
        while loops.try_join_next().is_some() {}
    }
    loops.abort_all();
}

/// How often a dial loop logs that a certificate was refused on its address, or that the
/// address could not be reached.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);

/// Whether a log line last written at `last` may be written again now (and if so, notes it).
fn log_due(last: &mut Option<Instant>) -> bool {
    if last.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_EVERY) {
        *last = Some(Instant::now());
        return true;
    }
    false
}

/// Keeps a connection to `addr` up: dial, run, and redial with backoff and jitter.
async fn dial_loop(
    ctx: Ctx,
    addr: SocketAddr,
    mut target: Option<PeerIdentity>,
    wanted: watch::Receiver<bool>,
) {
    let mut backoff = ctx.transport.backoff_min;
    let mut refusal_logged: Option<Instant> = None;
    let mut unreachable_logged: Option<Instant> = None;
    loop {
        if ctx.shared.closing.load(Ordering::Relaxed) || !*wanted.borrow() {
            return;
        }
        if let Some(id) = &target
            && lock(&ctx.shared.view).connected.contains(id)
        {
            // Someone (maybe the peer) already holds a connection to this identity.
            tokio::time::sleep(Duration::from_millis(250)).await;
            continue;
        }
        let started = Instant::now();
        // TLS 1.3 clients finish their handshake before the server checks their certificate,
        // so a refusal shows either as a failed dial or as the close of a fresh connection.
        let ended = match dial_once(&ctx, addr).await {
            Ok((connection, identity, send, recv)) => {
                target = Some(identity.clone());
                run_connection(
                    &ctx,
                    connection.clone(),
                    identity,
                    true,
                    send,
                    recv,
                    Some(wanted.clone()),
                )
                .await;
                if started.elapsed() > Duration::from_secs(5) {
                    backoff = ctx.transport.backoff_min;
                }
                connection.close_reason()
            }
            Err(e) => {
                ctx.shared
                    .transport
                    .dial_failures
                    .fetch_add(1, Ordering::Relaxed);
                debug!(%addr, error = %e, "dial failed");
                let refused =
                    matches!(&e, DialError::Connection(c) if certificate_refusal(c).is_some());
                if !refused && log_due(&mut unreachable_logged) {
                    let peer = target
                        .as_ref()
                        .map_or_else(|| "unknown identity".to_string(), ToString::to_string);
                    warn!(%addr, %peer, error = %e, "mesh peer unreachable; retrying (logged at most once a minute per peer)");
                }
                match e {
                    // The timeout spaced this attempt from the last; sleeping on top of it
                    // only delays finding the peer once it is reachable again (a healed
                    // partition).
                    DialError::TimedOut => continue,
                    DialError::Connection(c) => Some(c),
                    DialError::Other(_) => None,
                }
            }
        };
        if let Some(why) = ended.as_ref().and_then(certificate_refusal) {
            ctx.shared
                .transport
                .certificate_refusals
                .fetch_add(1, Ordering::Relaxed);
            if log_due(&mut refusal_logged) {
                let peer = target
                    .as_ref()
                    .map_or_else(|| "unknown identity".to_string(), ToString::to_string);
                warn!(%addr, %peer, reason = %why, "mesh certificate refused; retrying (logged at most once a minute per peer)");
            }
        }
        let jitter: f64 = rand::rng().random_range(0.5..1.5);
        tokio::time::sleep(backoff.mul_f64(jitter)).await;
        backoff = (backoff * 2).min(ctx.transport.backoff_max);
    }
}

/// Why a dial failed.
enum DialError {
    /// Nothing came back within the connect timeout (the peer is unreachable or down).
    TimedOut,
    /// The QUIC connection failed (handshake, TLS).
    Connection(quinn::ConnectionError),
    /// Anything else (no route, refused identity, ...).
    Other(String),
}

impl std::fmt::Display for DialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DialError::TimedOut => f.write_str("handshake timed out"),
            DialError::Connection(e) => write!(f, "{e}"),
            DialError::Other(e) => f.write_str(e),
        }
    }
}

/// The refusal a connection ended with, if it ended in a TLS alert (carried as a QUIC crypto
/// error, codes 0x100-0x1ff): who refused, the alert by its TLS name (`BadCertificate`,
/// `UnknownCA`, `DecryptError` when a chain's signature does not verify, ...), and the peer's
/// reason text. TLS 1.3 clients finish their handshake before the server checks their
/// certificate, so a refused client certificate shows as the peer closing with the alert.
fn certificate_refusal(e: &quinn::ConnectionError) -> Option<String> {
    let (code, by, detail) = match e {
        quinn::ConnectionError::ConnectionClosed(c) => (
            u64::from(c.error_code),
            "the peer refused this node's TLS handshake (its certificate, or the handshake itself)",
            String::from_utf8_lossy(&c.reason).into_owned(),
        ),
        quinn::ConnectionError::TransportError(t) => (
            u64::from(t.code),
            "this node refused the peer's TLS handshake",
            t.reason.clone(),
        ),
        _ => return None,
    };
    if !(0x100..0x200).contains(&code) {
        return None;
    }
    let alert = rustls::AlertDescription::from((code & 0xff) as u8);
    Some(if detail.is_empty() {
        format!("{by}: TLS alert {alert:?}")
    } else {
        format!("{by}: TLS alert {alert:?} ({detail})")
    })
}

type Dialed = (
    quinn::Connection,
    PeerIdentity,
    quinn::SendStream,
    quinn::RecvStream,
);

async fn dial_once(ctx: &Ctx, addr: SocketAddr) -> Result<Dialed, DialError> {
    let client = lock(&ctx.client).clone();
    let connecting = ctx
        .endpoint
        .connect_with(client, addr, MESH_SERVER_NAME)
        .map_err(|e| DialError::Other(e.to_string()))?;
    let connection = tokio::time::timeout(ctx.transport.connect_timeout, connecting)
        .await
        .map_err(|_| DialError::TimedOut)?
        .map_err(DialError::Connection)?;
    let identity = check_identity(ctx, &connection)
        .ok_or_else(|| DialError::Other("peer identity refused".to_string()))?;
    // The acceptor sees the stream once bytes arrive: the Hello queued by the protocol.
    let (send, recv) = connection.open_bi().await.map_err(DialError::Connection)?;
    Ok((connection, identity, send, recv))
}

#[cfg(test)]
mod tests {
    use super::certificate_refusal;

    fn closed_by_peer(code: u64, reason: &str) -> quinn::ConnectionError {
        quinn::ConnectionError::ConnectionClosed(quinn::ConnectionClose {
            error_code: quinn::TransportErrorCode::crypto((code & 0xff) as u8),
            frame_type: None,
            reason: reason.as_bytes().to_vec().into(),
        })
    }

    #[test]
    fn tls_alerts_are_named_and_other_closes_are_not_refusals() {
        let why = certificate_refusal(&closed_by_peer(
            0x130,
            "invalid peer certificate: UnknownIssuer",
        ))
        .expect("UnknownCA is a refusal");
        assert!(
            why.contains("the peer refused this node's TLS handshake"),
            "{why}"
        );
        assert!(why.contains("TLS alert UnknownCA"), "{why}");
        assert!(why.contains("UnknownIssuer"), "{why}");
        let why = certificate_refusal(&closed_by_peer(0x12a, "")).expect("BadCertificate");
        assert!(why.ends_with("TLS alert BadCertificate"), "{why}");
        // A chain from another CA with the same name: its signature does not verify.
        let why = certificate_refusal(&closed_by_peer(0x133, "")).expect("DecryptError");
        assert!(why.ends_with("TLS alert DecryptError"), "{why}");
        // Any alert is named, not only certificate ones (handshake_failure, 40).
        let why = certificate_refusal(&closed_by_peer(0x128, "")).expect("HandshakeFailure");
        assert!(why.ends_with("TLS alert HandshakeFailure"), "{why}");
        assert_eq!(
            certificate_refusal(&quinn::ConnectionError::LocallyClosed),
            None
        );
        assert_eq!(certificate_refusal(&quinn::ConnectionError::TimedOut), None);
    }
}
