//! File descriptors of a daemon: the soft limit raised to the hard one at start, and API
//! connection caps that leave a reserve API clients can never take from the store, the mesh
//! and the process itself.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Descriptors kept out of reach of API clients at least: store files, the mesh's UDP socket
/// and its tasks, log and telemetry exporters, and accepts in flight.
pub(crate) const MIN_RESERVE: u64 = 256;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit and returns the soft limit in force
/// (`None` when it cannot be read, or is unlimited).
pub(crate) fn raise_nofile() -> Option<u64> {
    let Rlimit { current, maximum } = getrlimit(Resource::Nofile);
    if current != maximum {
        let raised = Rlimit {
            current: maximum,
            maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::info!(from = ?current, to = ?maximum, "raised the open-file limit to the hard limit");
                return maximum;
            }
            Err(e) => {
                tracing::warn!(error = %e, soft = ?current, hard = ?maximum, "cannot raise the open-file limit");
            }
        }
    }
    current
}

/// Connection caps for `listeners` API listeners asking for `wanted` each, under a soft
/// descriptor limit `nofile`: a quarter of the limit (at least [`MIN_RESERVE`]) is reserved,
/// the rest shared evenly. Never below 1.
pub(crate) fn api_cap(nofile: Option<u64>, listeners: u64, wanted: usize) -> usize {
    let Some(limit) = nofile else {
        return wanted;
    };
    let reserve = (limit / 4).max(MIN_RESERVE);
    let share = limit.saturating_sub(reserve) / listeners.max(1);
    let share = usize::try_from(share).unwrap_or(usize::MAX);
    wanted.min(share).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_leave_the_reserve() {
        // 1024 descriptors: 256 reserved, 384 per listener.
        assert_eq!(api_cap(Some(1024), 2, 512), 384);
        assert_eq!(api_cap(Some(1024), 2, 100), 100);
        // 20000: a quarter reserved, the requested cap fits.
        assert_eq!(api_cap(Some(20_000), 2, 512), 512);
        assert_eq!(api_cap(Some(20_000), 2, 100_000), 7_500);
        // Tiny limits still allow one connection; unlimited keeps what was asked.
        assert_eq!(api_cap(Some(100), 2, 512), 1);
        assert_eq!(api_cap(None, 2, 512), 512);
        // Two listeners at the cap plus the reserve never exceed the limit.
        for limit in [300u64, 1024, 4096, 65_536] {
            let cap = api_cap(Some(limit), 2, usize::MAX) as u64;
            assert!(2 * cap + (limit / 4).max(MIN_RESERVE) <= limit, "{limit}");
        }
    }
}
