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

use super::driver::Event;
use super::{Ctx, Shared};
use crate::identity::PeerIdentity;
use crate::protocol::ConnId;
use crate::sync::lock;
use crate::wire::{self, pb};
use dramesh_store::HeadsVerifier;

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

/// Verifies a received sync message's signature on its connection's task, ahead of the
/// protocol thread: the verifier remembers signatures that passed, so the store's check there
/// is a lookup. Taking in a fleet of new documents, these ECDSA verifications (the writer's
/// chain and its signed heads) were a fifth of the protocol thread's work, and connection tasks
/// run on other threads. Only messages that carry their signer chain: a chain named by hash
/// (sent earlier on the session) is resolved by the protocol, which verifies those itself. Only
/// documents `from` may deliver at all ([`crate::store::may_deliver`]): an agent cannot make
/// the node verify signatures for other clusters, which the protocol refuses unverified. The
/// outcome is not used here; a bad signature is refused by the store as before.
fn verify_ahead(shared: &Shared, from: &PeerIdentity, env: &pb::Envelope) {
    let verifier = lock(&shared.verifier).clone();
    verify_sync_signature(verifier.as_ref(), from, env);
}

/// [`verify_ahead`] with a given verifier.
fn verify_sync_signature(verifier: &dyn HeadsVerifier, from: &PeerIdentity, env: &pb::Envelope) {
    let Some(pb::envelope::Body::Sync(s)) = &env.body else {
        return;
    };
    let Some(w) = s.signed.as_ref().filter(|w| !w.signer.is_empty()) else {
        return;
    };
    let (Some(doc), Ok(a)) = (
        wire::doc_from_wire(s.doc.as_ref()),
        wire::signed_from_wire(w),
    ) else {
        return;
    };
    if !crate::store::may_deliver(from, &doc) {
        return;
    }
    let statement = dramesh_store::attest::statement(&doc, s.generation, &a.heads);
    let _ = verifier.verify(&doc, &statement, &a.signature, &a.signer);
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
            verify_ahead(&ctx.shared, &identity, &env);
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
                    verify_ahead(&ctx.shared, &identity, &env);
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

#[cfg(test)]
mod tests {

    /// Signatures are verified ahead only for sync messages carrying their chain, about a
    /// document the sender may deliver at all: an agent cannot make the node verify another
    /// cluster's signatures.
    #[test]
    fn signatures_are_verified_ahead_only_for_documents_the_sender_may_deliver() {
        use super::{HeadsVerifier, verify_sync_signature};
        use crate::PeerIdentity;
        use crate::wire::pb;
        use dramesh_store::DocId;
        use std::sync::atomic::{AtomicUsize, Ordering};

        #[derive(Default)]
        struct Counting(AtomicUsize);
        impl HeadsVerifier for Counting {
            fn verify(&self, _: &DocId, _: &[u8], _: &[u8], _: &[u8]) -> Result<(), String> {
                self.0.fetch_add(1, Ordering::Relaxed);
                Err("not checked in this test".into())
            }
        }
        let sync = |cluster: &str, signer: &[u8]| {
            crate::wire::envelope(pb::envelope::Body::Sync(pb::Sync {
                doc: Some((&DocId::new(cluster, "n1")).into()),
                generation: 1,
                payload: vec![],
                signed: Some(pb::SignedHeads {
                    heads: vec![vec![7; 32]],
                    signature: vec![1, 2, 3],
                    signer: signer.to_vec(),
                    signer_sha256: vec![],
                }),
            }))
        };
        let agent = PeerIdentity::Agent {
            cluster: "c1".into(),
            node: "n2".into(),
        };
        let replica = PeerIdentity::Replica { id: "r1".into() };
        let v = Counting::default();
        let count = || v.0.load(Ordering::Relaxed);
        verify_sync_signature(&v, &agent, &sync("c1", b"chain"));
        assert_eq!(count(), 1, "own cluster, chain carried");
        verify_sync_signature(&v, &agent, &sync("c2", b"chain"));
        assert_eq!(count(), 1, "another cluster's document from an agent");
        verify_sync_signature(&v, &replica, &sync("c2", b"chain"));
        assert_eq!(count(), 2, "replicas may relay any document");
        verify_sync_signature(&v, &replica, &sync("c2", b""));
        assert_eq!(count(), 2, "a chain named by hash is left to the protocol");
    }
}
