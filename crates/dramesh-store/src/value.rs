//! How an object's JSON is held as a document value: deflated behind the marker byte
//! [`DEFLATED`] (no JSON text begins with NUL) when that is smaller, plain otherwise, and plain
//! bytes or strings as written before values were deflated are read as they are.
//!
//! Deflating matters for memory: automerge keeps every value twice (in its operations and in
//! the raw change that carried it), and a node's records (~9 KB of JSON) deflate about 3×, so a
//! replica's copy of a per-node document shrinks from ~26 KB to ~14 KB. Reading is bounded:
//! a value that inflates beyond [`MAX_VALUE_BYTES`], or does not inflate, is not a value.

use std::cell::RefCell;
use std::io::Write as _;
use std::sync::Arc;

use flate2::{Decompress, FlushDecompress, Status};

/// First byte of a deflated value.
pub(crate) const DEFLATED: u8 = 0;
/// Largest inflated value accepted (a Kubernetes object is at most 1.5 MiB in etcd).
pub(crate) const MAX_VALUE_BYTES: usize = 4 * 1024 * 1024;

/// The stored form of `json`: deflated (fastest level) behind [`DEFLATED`] when that is
/// smaller, else `json` itself.
pub(crate) fn encode(json: &[u8]) -> Vec<u8> {
    let mut out = vec![DEFLATED];
    let mut e = flate2::write::DeflateEncoder::new(&mut out, flate2::Compression::fast());
    let deflated = e.write_all(json).and_then(|()| e.finish().map(|_| ()));
    if deflated.is_ok() && out.len() < json.len() {
        out
    } else {
        json.to_vec()
    }
}

/// The JSON a stored value holds: inflated when it is deflated, as it is otherwise; `None` when
/// it does not inflate or inflates beyond [`MAX_VALUE_BYTES`].
pub(crate) fn decode(stored: &[u8]) -> Option<Arc<[u8]>> {
    match stored.split_first() {
        Some((&DEFLATED, deflated)) => INFLATER
            .with(|d| inflate(&mut d.borrow_mut(), deflated))
            .map(Arc::from),
        _ => Some(Arc::from(stored)),
    }
}

thread_local! {
    /// One inflater per thread, reset for each value: a fresh one allocates and clears ~40 KB
    /// of state, which cost more than inflating a node's records.
    static INFLATER: RefCell<Decompress> = RefCell::new(Decompress::new(false));
}

fn inflate(d: &mut Decompress, deflated: &[u8]) -> Option<Vec<u8>> {
    d.reset(false);
    let mut json = Vec::with_capacity((deflated.len() * 4).min(MAX_VALUE_BYTES + 1));
    loop {
        if json.len() == json.capacity() {
            if json.len() > MAX_VALUE_BYTES {
                return None;
            }
            json.reserve_exact(json.len().clamp(1024, MAX_VALUE_BYTES + 1 - json.len()));
        }
        let (read, written) = (d.total_in(), d.total_out());
        let input = deflated.get(usize::try_from(read).ok()?..)?;
        match d.decompress_vec(input, &mut json, FlushDecompress::None) {
            Ok(Status::StreamEnd) => break,
            Ok(_) if d.total_in() == read && d.total_out() == written => return None,
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    (json.len() <= MAX_VALUE_BYTES).then_some(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trips_deflated_when_smaller_and_plain_otherwise() {
        let big = br#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1","labels":{"a":"b","a2":"b","a3":"b"}},"status":{"allocatable":{"cpu":"8","memory":"64Gi"},"capacity":{"cpu":"8","memory":"64Gi"}}}"#;
        let stored = encode(big);
        assert_eq!(stored[0], DEFLATED);
        assert!(stored.len() < big.len());
        assert_eq!(&*decode(&stored).unwrap(), &big[..]);
        // Too small to gain: kept as it is (and JSON never starts with the marker).
        let small = br#"{"a":1}"#;
        assert_eq!(encode(small), small.to_vec());
        assert_eq!(&*decode(small).unwrap(), &small[..]);
        // Values written before deflating are read as they are.
        assert_eq!(&*decode(big).unwrap(), &big[..]);
    }

    #[test]
    fn values_that_do_not_inflate_or_inflate_too_far_are_not_values() {
        assert!(decode(&[DEFLATED, 0xff, 0xff, 0xff]).is_none());
        // Cut short: no end of stream.
        let whole = encode(&vec![b'x'; 10_000]);
        assert!(decode(&whole[..whole.len() / 2]).is_none());
        // The thread's inflater is reset between values.
        assert_eq!(decode(&whole).map(|v| v.len()), Some(10_000));
        let bomb = encode(&vec![b' '; MAX_VALUE_BYTES + 1]);
        assert!(bomb.len() < 64 * 1024, "{}", bomb.len());
        assert!(decode(&bomb).is_none());
        let edge = encode(&vec![b' '; MAX_VALUE_BYTES]);
        assert_eq!(decode(&edge).map(|v| v.len()), Some(MAX_VALUE_BYTES));
    }
}
