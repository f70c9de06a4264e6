//! The accepting side of the node's endpoint: bounded handshakes, the peer's identity from
//! its certificate, and the mesh stream the dialer opens.
//!
//! Guarantees: at most [`TransportConfig::max_handshakes`](crate::transport::TransportConfig)
//! handshakes run at once (the rest are refused before any cryptography); a connection whose
//! certificate names no valid identity, or this node itself, is closed before it reaches the
//! protocol.

use std::sync::atomic::Ordering;

use tokio::task::JoinSet;
use tracing::{debug, warn};

use super::Ctx;
use super::conn::run_connection;
use crate::identity::PeerIdentity;
use crate::transport;

pub(super) async fn accept_loop(ctx: Ctx) {
    let mut handshakes = JoinSet::new();
    while let Some(incoming) = ctx.endpoint.accept().await {
        // Reap finished connection tasks so the set stays small.
        while handshakes.try_join_next().is_some() {}
        // A flood of connection attempts costs at most this many handshakes at once; the
        // rest are refused before any cryptography (their peers retry with backoff).
        let Ok(permit) = ctx.handshakes.clone().try_acquire_owned() else {
            ctx.shared
                .transport
                .handshakes_refused
                .fetch_add(1, Ordering::Relaxed);
            debug!(remote = %incoming.remote_address(), "too many handshakes in progress; refused");
            incoming.refuse();
            continue;
        };
        let ctx = ctx.clone();
        handshakes.spawn(async move {
            let remote = incoming.remote_address();
            let connecting = match incoming.accept() {
                Ok(c) => c,
                Err(e) => {
                    ctx.shared
                        .transport
                        .handshake_failures
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(%remote, error = %e, "incoming connection refused");
                    return;
                }
            };
            let connection =
                match tokio::time::timeout(ctx.transport.connect_timeout, connecting).await {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        ctx.shared
                            .transport
                            .handshake_failures
                            .fetch_add(1, Ordering::Relaxed);
                        if matches!(
                            e,
                            quinn::ConnectionError::ApplicationClosed(_)
                                | quinn::ConnectionError::LocallyClosed
                        ) {
                            // The dialer gave up (e.g. shutting down): not a security event.
                            debug!(%remote, error = %e, "handshake abandoned");
                        } else {
                            warn!(%remote, error = %e, "TLS/QUIC handshake failed");
                        }
                        return;
                    }
                    Err(_) => {
                        ctx.shared
                            .transport
                            .handshake_failures
                            .fetch_add(1, Ordering::Relaxed);
                        warn!(%remote, "handshake timed out");
                        return;
                    }
                };
            let Some(identity) = check_identity(&ctx, &connection) else {
                return;
            };
            let stream =
                tokio::time::timeout(ctx.transport.connect_timeout, connection.accept_bi()).await;
            drop(permit);
            match stream {
                Ok(Ok((send, recv))) => {
                    run_connection(&ctx, connection, identity, false, send, recv, None).await;
                }
                _ => {
                    debug!(%remote, "peer opened no mesh stream");
                    connection.close(1u32.into(), b"no stream");
                }
            }
        });
    }
    handshakes.abort_all();
}

pub(super) fn check_identity(ctx: &Ctx, connection: &quinn::Connection) -> Option<PeerIdentity> {
    match transport::peer_identity(connection) {
        Ok(id) if id == ctx.local => {
            debug!("connected to ourselves; closing");
            connection.close(3u32.into(), b"self");
            None
        }
        Ok(id) => Some(id),
        Err(e) => {
            ctx.shared
                .transport
                .identity_rejections
                .fetch_add(1, Ordering::Relaxed);
            warn!(remote = %connection.remote_address(), error = %e, "peer certificate has no valid identity");
            connection.close(4u32.into(), b"bad identity");
            None
        }
    }
}
