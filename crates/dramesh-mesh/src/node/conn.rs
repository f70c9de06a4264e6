//! Connection tasks: one per session, moving frames between a QUIC stream (or an in-process
//! link) and the protocol thread, within the connection's and the node's outbound budgets.
//!
//! Guarantees: a reader hands the driver only frames that passed the wire's size and decoding
//! checks (a bad frame closes the connection); a writer gives back a frame's budget once it is
//! written or dropped, even if the connection dies first; every connection that announced
//! itself to the driver (`Event::Connected`) is followed by its `Event::Disconnected`.

use std::net::SocketAddr;
use std::sync::Arc;
#[cfg(feature = "test-util")]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tracing::{debug, warn};

use super::Ctx;
use super::driver::Event;
use crate::identity::PeerIdentity;
use crate::protocol::ConnId;
use crate::wire;

#[derive(Default)]
pub(super) struct ConnStats {
    pub(super) bytes_sent: AtomicU64,
    pub(super) bytes_received: AtomicU64,
}

/// A queued frame, its per-connection permits, and its share of the node-wide budget (given
/// back when the frame is written or dropped, even if the connection dies first).
pub(super) type QueuedFrame = (Vec<u8>, u32, OwnedSemaphorePermit);

pub(super) struct Outbound {
    pub(super) tx: mpsc::UnboundedSender<QueuedFrame>,
    pub(super) budget: Arc<Semaphore>,
    pub(super) max_permits: u32,
}

/// The transport under one session.
#[derive(Clone)]
pub(super) enum Link {
    Quic(quinn::Connection),
    /// An in-process peer ([`MeshHandle::attach_local`]).
    #[cfg(feature = "test-util")]
    Local(Arc<LocalClose>),
}

impl Link {
    pub(super) fn close(&self, code: u32, reason: &[u8]) {
        match self {
            Link::Quic(c) => c.close(code.into(), reason),
            #[cfg(feature = "test-util")]
            Link::Local(l) => l.close(),
        }
    }

    pub(super) fn remote_address(&self) -> SocketAddr {
        match self {
            Link::Quic(c) => c.remote_address(),
            #[cfg(feature = "test-util")]
            Link::Local(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
        }
    }

    pub(super) fn rtt(&self) -> Duration {
        match self {
            Link::Quic(c) => c.rtt(),
            #[cfg(feature = "test-util")]
            Link::Local(_) => Duration::ZERO,
        }
    }
}

/// The queue of frames to one peer, with its byte budget, and the connection's counters.
pub(super) type OutQueue = (mpsc::UnboundedReceiver<QueuedFrame>, Arc<Semaphore>);

pub(super) fn outbound_for(ctx: &Ctx) -> (Outbound, OutQueue, Arc<ConnStats>) {
    let budget_bytes = ctx
        .transport
        .outbound_budget_bytes
        .max(wire::MAX_FRAME_SIZE);
    let max_permits = u32::try_from(budget_bytes).unwrap_or(u32::MAX);
    let budget = Arc::new(Semaphore::new(max_permits as usize));
    let (tx, rx) = mpsc::unbounded_channel::<QueuedFrame>();
    let outbound = Outbound {
        tx,
        budget: budget.clone(),
        max_permits,
    };
    (outbound, (rx, budget), Arc::new(ConnStats::default()))
}

/// The peer's end of an in-process connection ([`MeshHandle::attach_local`]).
#[cfg(feature = "test-util")]
pub struct LocalLink {
    pub(super) tx: mpsc::Sender<Vec<u8>>,
    pub(super) closed: Arc<LocalClose>,
}

#[cfg(feature = "test-util")]
impl LocalLink {
    /// Sends one length-prefixed frame to the node; `false` once the link is closed.
    pub async fn send(&self, frame: Vec<u8>) -> bool {
        !self.closed.is_closed() && self.tx.send(frame).await.is_ok()
    }

    /// [`LocalLink::send`] from outside an async context.
    pub fn blocking_send(&self, frame: Vec<u8>) -> bool {
        !self.closed.is_closed() && self.tx.blocking_send(frame).is_ok()
    }

    /// Whether either side closed the link.
    pub fn is_closed(&self) -> bool {
        self.closed.is_closed()
    }

    /// Closes the link (the node sees the peer disconnect).
    pub fn close(&self) {
        self.closed.close();
    }
}

/// Closing an in-process link: a flag and a wake-up for its reader.
#[cfg(feature = "test-util")]
#[derive(Default)]
pub(super) struct LocalClose {
    closed: AtomicBool,
    notify: tokio::sync::Notify,
}

#[cfg(feature = "test-util")]
impl LocalClose {
    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.notify.notify_waiters();
        self.notify.notify_one();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }
}

/// Runs an in-process connection until either side closes it: the peer's frames are decoded
/// and checked exactly as a QUIC stream's, the node's are handed to `sink`.
#[cfg(feature = "test-util")]
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_local(
    ctx: Ctx,
    conn: ConnId,
    identity: PeerIdentity,
    mut from_peer: mpsc::Receiver<Vec<u8>>,
    (mut to_peer, budget): OutQueue,
    sink: Box<dyn Fn(Vec<u8>) + Send + Sync>,
    closed: Arc<LocalClose>,
    stats: Arc<ConnStats>,
) {
    let writer = async {
        while let Some((frame, permits, total)) = to_peer.recv().await {
            budget.add_permits(permits as usize);
            drop(total);
            stats
                .bytes_sent
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            ctx.shared
                .transport
                .bytes_sent
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            sink(frame);
        }
    };
    let reader = async {
        while let Some(frame) = from_peer.recv().await {
            let env = frame
                .get(..wire::FRAME_HEADER_LEN)
                .and_then(|h| <[u8; wire::FRAME_HEADER_LEN]>::try_from(h).ok())
                .ok_or_else(|| "frame shorter than its header".to_string())
                .and_then(|h| wire::check_frame_len(h).map_err(|e| e.to_string()))
                .and_then(|len| {
                    if frame.len() != wire::FRAME_HEADER_LEN + len {
                        return Err("frame length does not match its header".to_string());
                    }
                    wire::decode_payload(&frame[wire::FRAME_HEADER_LEN..])
                        .map_err(|e| e.to_string())
                });
            let env = match env {
                Ok(env) => env,
                Err(error) => {
                    ctx.shared
                        .transport
                        .bad_frames
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(%identity, %error, "bad frame on an in-process link; closing it");
                    break;
                }
            };
            stats
                .bytes_received
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            ctx.shared
                .transport
                .bytes_received
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            if ctx.events.send(Event::Frame(conn, env)).await.is_err() {
                break;
            }
        }
    };
    let closed_wait = async {
        while !closed.is_closed() {
            closed.notify.notified().await;
        }
    };
    tokio::select! {
        () = writer => {}
        () = reader => {}
        () = closed_wait => {}
    }
    closed.close();
    let _ = ctx.events.send(Event::Disconnected(conn)).await;
}

/// Runs one established connection until it ends.
pub(super) async fn run_connection(
    ctx: &Ctx,
    connection: quinn::Connection,
    identity: PeerIdentity,
    dialed: bool,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    wanted: Option<watch::Receiver<bool>>,
) {
    let conn = ConnId(ctx.next_conn.fetch_add(1, Ordering::Relaxed));
    let (outbound, (mut rx, budget), stats) = outbound_for(ctx);
    if ctx
        .events
        .send(Event::Connected {
            conn,
            identity: identity.clone(),
            dialed,
            connection: Link::Quic(connection.clone()),
            outbound,
            stats: stats.clone(),
        })
        .await
        .is_err()
    {
        return;
    }
    debug!(local = %ctx.local, %identity, conn = conn.0, dialed, "mesh connection up");
    let writer_stats = stats.clone();
    let writer_shared = ctx.shared.clone();
    let writer = async move {
        while let Some((frame, permits, total)) = rx.recv().await {
            let res = send.write_all(&frame).await;
            budget.add_permits(permits as usize);
            drop(total);
            if res.is_err() {
                break;
            }
            writer_stats
                .bytes_sent
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            writer_shared
                .transport
                .bytes_sent
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
        }
        let _ = send.finish();
    };
    let reader = async {
        loop {
            match wire::read_frame(&mut recv).await {
                Ok(Some((env, len))) => {
                    stats
                        .bytes_received
                        .fetch_add(len as u64, Ordering::Relaxed);
                    ctx.shared
                        .transport
                        .bytes_received
                        .fetch_add(len as u64, Ordering::Relaxed);
                    if ctx.events.send(Event::Frame(conn, env)).await.is_err() {
                        break;
                    }
                }
                Ok(None) => break,
                Err(wire::FrameError::Io(_)) => break,
                Err(e) => {
                    ctx.shared
                        .transport
                        .bad_frames
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(%identity, error = %e, "bad frame; closing connection");
                    connection.close(5u32.into(), b"bad frame");
                    break;
                }
            }
        }
    };
    tokio::select! {
        _ = writer => {}
        _ = reader => {}
        _ = connection.closed() => {}
        () = unwanted(wanted) => {}
    }
    connection.close(0u32.into(), b"done");
    let _ = ctx.events.send(Event::Disconnected(conn)).await;
    debug!(local = %ctx.local, %identity, conn = conn.0, "mesh connection down");
}

/// Resolves once `wanted` says the connection is no longer wanted (never without one).
async fn unwanted(wanted: Option<watch::Receiver<bool>>) {
    let Some(mut wanted) = wanted else {
        return std::future::pending().await;
    };
    while *wanted.borrow_and_update() {
        if wanted.changed().await.is_err() {
            return;
        }
    }
}
