//! A userspace stand-in for `tc netem`: binds an NFQUEUE over raw netfilter netlink, holds
//! each queued packet for `delay ± jitter` and then accepts it, or drops it with probability
//! `loss`. Used because the kernels that run the suite may be built without `sch_netem`.
//!
//! Guarantees: verdicts are issued in deadline order; drops are drawn from a seeded RNG so a
//! run is repeatable given the same packet sequence; netlink input is parsed with bounds
//! checks (a malformed message is skipped, never trusted).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand::{Rng, SeedableRng, rngs::StdRng};

const NETLINK_NETFILTER: libc::c_int = 12;
const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;

/// Parameters of one delayer.
#[derive(Debug, Clone, Copy)]
pub struct DelayerConfig {
    /// NFQUEUE number to read packets from.
    pub queue: u16,
    /// Delay per packet.
    pub delay: Duration,
    /// Uniform jitter around the delay.
    pub jitter: Duration,
    /// Probability (0..1) that a packet is dropped.
    pub loss: f64,
    /// Seed of the jitter and loss random numbers.
    pub seed: u64,
}

struct Socket {
    fd: libc::c_int,
    seq: u32,
}

impl Drop for Socket {
    fn drop(&mut self) {
        // SAFETY: fd was returned by socket(2) and is closed exactly once.
        unsafe { libc::close(self.fd) };
    }
}

fn attr(buf: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(payload);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

impl Socket {
    fn open() -> Result<Socket> {
        // SAFETY: plain socket(2) call; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW, NETLINK_NETFILTER) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("netlink socket");
        }
        let sock = Socket { fd, seq: 0 };
        // SAFETY: sockaddr_nl is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: addr is a valid sockaddr_nl of the given length.
        let rc = unsafe {
            libc::bind(
                fd,
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error()).context("bind netlink socket");
        }
        Ok(sock)
    }

    fn send(&mut self, msg_type: u16, flags: u16, queue: u16, attrs: &[u8]) -> Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let len = 16 + 4 + attrs.len();
        let mut buf = Vec::with_capacity(len);
        buf.extend_from_slice(&(len as u32).to_ne_bytes());
        buf.extend_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | msg_type).to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&self.seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.push(libc::AF_UNSPEC as u8);
        buf.push(0);
        buf.extend_from_slice(&queue.to_be_bytes());
        buf.extend_from_slice(attrs);
        // SAFETY: buf is valid for len bytes; the kernel address is implicit (pid 0).
        let rc = unsafe { libc::send(self.fd, buf.as_ptr().cast(), buf.len(), 0) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error()).context("netlink send");
        }
        Ok(())
    }

    fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        // SAFETY: buf is valid for buf.len() bytes.
        let rc = unsafe { libc::recv(self.fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(rc as usize)
    }

    fn expect_ack(&self) -> Result<()> {
        let mut buf = vec![0u8; 8192];
        let n = self.recv(&mut buf).context("netlink ack")?;
        for (ty, body) in messages(&buf[..n]) {
            if ty == NLMSG_ERROR {
                let code = body
                    .get(..4)
                    .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                    .unwrap_or(-1);
                if code != 0 {
                    bail!(
                        "nfqueue config rejected: {}",
                        std::io::Error::from_raw_os_error(-code)
                    );
                }
                return Ok(());
            }
        }
        bail!("no netlink ack received")
    }

    fn verdict(&mut self, queue: u16, id: u32, verdict: u32) -> Result<()> {
        let mut payload = Vec::with_capacity(8);
        payload.extend_from_slice(&verdict.to_be_bytes());
        payload.extend_from_slice(&id.to_be_bytes());
        let mut attrs = Vec::new();
        attr(&mut attrs, NFQA_VERDICT_HDR, &payload);
        self.send(NFQNL_MSG_VERDICT, NLM_F_REQUEST, queue, &attrs)
    }
}

/// Splits a netlink datagram into (message type, payload after the 16-byte header).
pub fn messages(buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
        if len < 16 || off + len > buf.len() {
            break;
        }
        let ty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
        out.push((ty, &buf[off + 16..off + len]));
        off += (len + 3) & !3;
    }
    out
}

/// The packet id of an NFQNL_MSG_PACKET payload (after the netlink header).
pub fn packet_id(payload: &[u8]) -> Option<u32> {
    let mut off = 4; // nfgenmsg
    while off + 4 <= payload.len() {
        let len = u16::from_ne_bytes([payload[off], payload[off + 1]]) as usize;
        let ty = u16::from_ne_bytes([payload[off + 2], payload[off + 3]]) & 0x3fff;
        if len < 4 || off + len > payload.len() {
            return None;
        }
        if ty == NFQA_PACKET_HDR && len >= 8 {
            let p = &payload[off + 4..off + 8];
            return Some(u32::from_be_bytes([p[0], p[1], p[2], p[3]]));
        }
        off += (len + 3) & !3;
    }
    None
}

/// Binds the queue, prints `ready` on stdout, then delays or drops packets until killed.
pub fn run_delayer(cfg: DelayerConfig) -> Result<()> {
    use std::io::Write;
    let mut sock = Socket::open()?;
    let mut attrs = Vec::new();
    let mut cmd = vec![NFQNL_CFG_CMD_BIND, 0];
    cmd.extend_from_slice(&(libc::AF_INET as u16).to_be_bytes());
    attr(&mut attrs, NFQA_CFG_CMD, &cmd);
    sock.send(
        NFQNL_MSG_CONFIG,
        NLM_F_REQUEST | NLM_F_ACK,
        cfg.queue,
        &attrs,
    )?;
    sock.expect_ack().context("binding the queue")?;
    let mut attrs = Vec::new();
    let mut params = 0u32.to_be_bytes().to_vec();
    params.push(NFQNL_COPY_META);
    attr(&mut attrs, NFQA_CFG_PARAMS, &params);
    attr(&mut attrs, NFQA_CFG_QUEUE_MAXLEN, &8192u32.to_be_bytes());
    sock.send(
        NFQNL_MSG_CONFIG,
        NLM_F_REQUEST | NLM_F_ACK,
        cfg.queue,
        &attrs,
    )?;
    sock.expect_ack().context("setting queue parameters")?;
    println!("ready");
    std::io::stdout().flush()?;

    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut pending: BinaryHeap<Reverse<(Instant, u32)>> = BinaryHeap::new();
    let mut buf = vec![0u8; 65536];
    loop {
        let now = Instant::now();
        while let Some(Reverse((due, id))) = pending.peek().copied() {
            if due > now {
                break;
            }
            pending.pop();
            sock.verdict(cfg.queue, id, NF_ACCEPT)?;
        }
        let timeout_ms = pending
            .peek()
            .map(|Reverse((due, _))| due.saturating_duration_since(now).as_millis() as i32 + 1)
            .unwrap_or(1000);
        let mut pfd = libc::pollfd {
            fd: sock.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: pfd is one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc <= 0 {
            continue;
        }
        let n = match sock.recv(&mut buf) {
            Ok(n) => n,
            // Queue overrun: the kernel dropped some notifications; keep going.
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).context("netlink recv"),
        };
        let ids: Vec<u32> = messages(&buf[..n])
            .into_iter()
            .filter(|(ty, _)| *ty == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET)
            .filter_map(|(_, body)| packet_id(body))
            .collect();
        for id in ids {
            if cfg.loss > 0.0 && rng.random::<f64>() < cfg.loss {
                sock.verdict(cfg.queue, id, NF_DROP)?;
                continue;
            }
            let jitter = if cfg.jitter.is_zero() {
                Duration::ZERO
            } else {
                Duration::from_micros(rng.random_range(0..=cfg.jitter.as_micros() as u64))
            };
            pending.push(Reverse((Instant::now() + cfg.delay + jitter, id)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nlmsg(ty: u16, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(body);
        while !m.len().is_multiple_of(4) {
            m.push(0);
        }
        m
    }

    #[test]
    fn parses_packet_ids_from_a_batch() {
        let mut body = vec![2, 0, 0, 100]; // nfgenmsg
        let mut hdr = 0xdead_beefu32.to_be_bytes().to_vec();
        hdr.extend_from_slice(&[8, 0, 1]);
        attr(&mut body, NFQA_PACKET_HDR, &hdr);
        let mut batch = nlmsg(0x300, &body);
        batch.extend(nlmsg(0x300, &body));
        let msgs = messages(&batch);
        assert_eq!(msgs.len(), 2);
        assert_eq!(packet_id(msgs[1].1), Some(0xdead_beef));
    }

    #[test]
    fn truncated_input_is_rejected_not_trusted() {
        let mut body = vec![2, 0, 0, 100];
        attr(&mut body, NFQA_PACKET_HDR, &[0, 0, 0, 5, 8, 0, 1]);
        let msg = nlmsg(0x300, &body);
        assert!(messages(&msg[..msg.len() - 8]).is_empty());
        // An attribute that claims more bytes than present yields no id.
        let mut bad = body.clone();
        bad[4] = 200;
        assert_eq!(packet_id(&bad), None);
    }
}
