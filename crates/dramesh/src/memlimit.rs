//! The container's memory limit, read from its cgroup, and the API admission budget defaulted
//! from it (`--api-max-inflight-bytes`).

use std::path::Path;

/// The budget when the limit is unknown or unlimited: 1 GiB.
pub(crate) const FALLBACK_BUDGET: u64 = 1 << 30;

/// The share of the memory limit API requests in progress may be charged by default: a
/// quarter, leaving the rest to the view, the estimator's caches, the store and the mesh.
pub(crate) const LIMIT_FRACTION: u64 = 4;

/// The memory limit of this process's cgroup in bytes: cgroup v2 `memory.max`, else v1
/// `memory.limit_in_bytes`; `None` when there is none (unlimited, or no cgroup file).
pub(crate) fn cgroup_memory_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    limit_under(Path::new("/sys/fs/cgroup"), &own)
}

/// [`cgroup_memory_limit`] with the cgroup file system mounted at `root` and `/proc/self/cgroup`
/// reading `own`.
fn limit_under(root: &Path, own: &str) -> Option<u64> {
    let mut candidates = Vec::new();
    for line in own.lines() {
        // `0::/path` (v2) or `N:memory:/path` (v1).
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        let rel = path.trim_start_matches('/');
        if ctrl.is_empty() {
            candidates.push(root.join(rel).join("memory.max"));
        } else if ctrl.split(',').any(|c| c == "memory") {
            candidates.push(root.join("memory").join(rel).join("memory.limit_in_bytes"));
        }
    }
    // Inside a container's cgroup namespace its own cgroup is the root.
    candidates.push(root.join("memory.max"));
    candidates.push(root.join("memory").join("memory.limit_in_bytes"));
    candidates
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .and_then(|text| {
            let t = text.trim();
            // "max" (v2) or a page-rounded i64::MAX (v1) mean unlimited.
            t.parse::<u64>().ok().filter(|n| *n < (1 << 62))
        })
}

/// The default admission budget: a quarter of `limit`, or [`FALLBACK_BUDGET`] without one.
pub(crate) fn default_budget(limit: Option<u64>) -> u64 {
    limit.map_or(FALLBACK_BUDGET, |l| (l / LIMIT_FRACTION).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_v1_and_unlimited() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        assert_eq!(limit_under(root, "0::/pod/c1\n"), None);
        std::fs::create_dir_all(root.join("pod/c1")).unwrap();
        std::fs::write(root.join("pod/c1/memory.max"), "max\n").unwrap();
        assert_eq!(limit_under(root, "0::/pod/c1\n"), None);
        std::fs::write(root.join("pod/c1/memory.max"), "4294967296\n").unwrap();
        assert_eq!(limit_under(root, "0::/pod/c1\n"), Some(4 << 30));
        std::fs::create_dir_all(root.join("memory/k")).unwrap();
        std::fs::write(
            root.join("memory/k/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        assert_eq!(limit_under(root, "5:memory:/k\n"), None);
        std::fs::write(root.join("memory/k/memory.limit_in_bytes"), "536870912\n").unwrap();
        assert_eq!(limit_under(root, "5:cpu,memory:/k\n"), Some(512 << 20));
        assert_eq!(default_budget(Some(4 << 30)), 1 << 30);
        assert_eq!(default_budget(None), FALLBACK_BUDGET);
    }
}
