//! Protocol versions and features: what a node announces in its `Hello`, and the one rule that
//! decides whether a peer's announcement admits a session.
//!
//! The rule ([`admit`]):
//! - the **major** version (`Hello.protocol_version`, and the envelope version) must equal
//!   [`PROTOCOL_MAJOR`]: a major bump is a breaking change;
//! - the **minor** versions (`Hello.protocol_minor`) may differ by at most one
//!   ([`MINOR_WINDOW`]): adjacent releases interoperate, so a fleet can be upgraded one
//!   release at a time with old and new nodes mixed;
//! - the session uses the **features** both sides announce (the intersection). A peer that
//!   announces no `protocol_minor` is a build from before minor versions existed: minor 0,
//!   with the [`BASELINE_FEATURES`] implied (what those builds do). Unknown feature names (a
//!   newer peer's) are simply not in the intersection.
//!
//! The announcement is readable by builds that predate it: they check only
//! `protocol_version` (1, unchanged) and skip the fields they do not know. Anything else is
//! refused with a `Refusal` of code `VERSION` whose text names both versions.

use std::collections::BTreeSet;

use crate::wire::pb;

/// Major protocol version: equal on both ends of every session.
pub const PROTOCOL_MAJOR: u32 = 1;
/// Minor protocol version of this build. 0 is every build before minor versions were
/// announced; 1 adds the announcement itself and version refusals.
pub const PROTOCOL_MINOR: u32 = 1;
/// How far apart two minor versions may be and still hold a session.
pub const MINOR_WINDOW: u32 = 1;
/// This build's release, announced in `Hello.software` (informational).
pub const SOFTWARE: &str = concat!("dramesh ", env!("CARGO_PKG_VERSION"));

/// Signed changes (`Sync.signed`, with chains named by hash after the first).
pub const FEATURE_SIGNED_HEADS: &str = "signed-heads";
/// Bucket entries list their heads (`DocEntry.heads`), so the side ahead opens repairs.
pub const FEATURE_ENTRY_HEADS: &str = "entry-heads";
/// Heartbeats report frames handled (`Ephemeral.frames_processed`), pacing repair rounds.
pub const FEATURE_FRAMES_PROCESSED: &str = "frames-processed";
/// Cluster relays (`Hello.relay`) and their session scopes.
pub const FEATURE_CLUSTER_RELAY: &str = "cluster-relay";
/// Typed refusals of a writer's document (`Refusal`, codes 1-6).
pub const FEATURE_REFUSALS: &str = "refusals";
/// Version refusals (`Refusal` code `VERSION`) are understood (minor 1).
pub const FEATURE_VERSION_REFUSAL: &str = "version-refusal";

/// What every minor 0 build does: implied for a peer that announces no minor version.
pub const BASELINE_FEATURES: &[&str] = &[
    FEATURE_SIGNED_HEADS,
    FEATURE_ENTRY_HEADS,
    FEATURE_FRAMES_PROCESSED,
    FEATURE_CLUSTER_RELAY,
    FEATURE_REFUSALS,
];

/// What this build speaks (announced in its `Hello`).
pub const FEATURES: &[&str] = &[
    FEATURE_SIGNED_HEADS,
    FEATURE_ENTRY_HEADS,
    FEATURE_FRAMES_PROCESSED,
    FEATURE_CLUSTER_RELAY,
    FEATURE_REFUSALS,
    FEATURE_VERSION_REFUSAL,
];

/// Most features a `Hello` may announce.
pub const MAX_FEATURES: usize = 64;
/// Longest feature name.
pub const MAX_FEATURE_LEN: usize = 64;
/// Longest `Hello.software` kept (longer is cut for logs).
const MAX_SOFTWARE_LEN: usize = 128;

/// A peer's announced version, as read from its `Hello`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerVersion {
    /// Major version.
    pub major: u32,
    /// Minor version (0: a build before minor versions).
    pub minor: u32,
    /// Announced features (the baseline for minor 0 peers that list none).
    pub features: BTreeSet<String>,
    /// The peer's release text (empty from builds before it was announced).
    pub software: String,
}

impl std::fmt::Display for PeerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "protocol {}.{}", self.major, self.minor)?;
        if !self.software.is_empty() {
            write!(f, " ({})", self.software)?;
        }
        Ok(())
    }
}

/// Our own announcement, as a peer sees it.
pub fn ours() -> PeerVersion {
    PeerVersion {
        major: PROTOCOL_MAJOR,
        minor: PROTOCOL_MINOR,
        features: FEATURES.iter().map(|f| f.to_string()).collect(),
        software: SOFTWARE.to_string(),
    }
}

/// Fills the version fields of an outgoing `Hello`.
pub fn announce(h: &mut pb::Hello) {
    h.protocol_version = PROTOCOL_MAJOR;
    h.protocol_minor = PROTOCOL_MINOR;
    h.features = FEATURES.iter().map(|f| f.to_string()).collect();
    h.software = SOFTWARE.to_string();
}

/// Reads the announcement of a received `Hello`; `Err` for a malformed feature list (too many
/// names, or names that are not short lower-case words), which is a protocol violation.
pub fn read(h: &pb::Hello) -> Result<PeerVersion, String> {
    if h.features.len() > MAX_FEATURES {
        return Err(format!(
            "Hello announces {} features (at most {MAX_FEATURES})",
            h.features.len()
        ));
    }
    if let Some(bad) = h.features.iter().find(|f| {
        f.is_empty()
            || f.len() > MAX_FEATURE_LEN
            || !f
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    }) {
        return Err(format!(
            "Hello announces a malformed feature name {:?}",
            bounded(bad, MAX_FEATURE_LEN)
        ));
    }
    let features = if h.protocol_minor == 0 && h.features.is_empty() {
        BASELINE_FEATURES.iter().map(|f| f.to_string()).collect()
    } else {
        h.features.iter().cloned().collect()
    };
    Ok(PeerVersion {
        major: h.protocol_version,
        minor: h.protocol_minor,
        features,
        software: bounded(&h.software, MAX_SOFTWARE_LEN),
    })
}

fn bounded(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

/// Why a peer's version admits no session (the text a `Refusal` carries and both sides log).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VersionMismatch {
    /// Another major version.
    #[error(
        "peer speaks {peer}, this node protocol {major}.{minor} ({SOFTWARE}): major versions differ"
    )]
    Major {
        /// The peer's announcement.
        peer: PeerVersion,
        /// Ours.
        major: u32,
        /// Ours.
        minor: u32,
    },
    /// Minor versions more than [`MINOR_WINDOW`] apart.
    #[error(
        "peer speaks {peer}, this node protocol {major}.{minor} ({SOFTWARE}): minor versions more than {MINOR_WINDOW} apart (peer too {})",
        if peer.minor < *minor { "old" } else { "new" }
    )]
    Minor {
        /// The peer's announcement.
        peer: PeerVersion,
        /// Ours.
        major: u32,
        /// Ours.
        minor: u32,
    },
}

/// The rule (module docs): the features a session with `peer` uses, or why there is none.
pub fn admit(peer: &PeerVersion) -> Result<BTreeSet<String>, VersionMismatch> {
    admit_against(peer, PROTOCOL_MAJOR, PROTOCOL_MINOR, FEATURES)
}

/// [`admit`] for a node speaking `major.minor` with `features`.
fn admit_against(
    peer: &PeerVersion,
    major: u32,
    minor: u32,
    features: &[&str],
) -> Result<BTreeSet<String>, VersionMismatch> {
    if peer.major != major {
        return Err(VersionMismatch::Major {
            peer: peer.clone(),
            major,
            minor,
        });
    }
    if peer.minor.abs_diff(minor) > MINOR_WINDOW {
        return Err(VersionMismatch::Minor {
            peer: peer.clone(),
            major,
            minor,
        });
    }
    Ok(features
        .iter()
        .filter(|f| peer.features.contains(**f))
        .map(|f| f.to_string())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(major: u32, minor: u32, features: &[&str]) -> pb::Hello {
        pb::Hello {
            protocol_version: major,
            protocol_minor: minor,
            features: features.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn absent_version_is_minor_zero_with_the_baseline_and_is_admitted() {
        let v = read(&hello(1, 0, &[])).unwrap();
        assert_eq!(v.minor, 0);
        let baseline: BTreeSet<String> = BASELINE_FEATURES.iter().map(|f| f.to_string()).collect();
        assert_eq!(v.features, baseline);
        assert_eq!(admit(&v).unwrap(), baseline);
        assert!(!admit(&v).unwrap().contains(FEATURE_VERSION_REFUSAL));
    }

    #[test]
    fn adjacent_minors_are_admitted_with_the_common_features() {
        let same = read(&hello(1, PROTOCOL_MINOR, FEATURES)).unwrap();
        assert_eq!(admit(&same).unwrap().len(), FEATURES.len());
        // A newer peer with a feature we do not know, and without one of ours.
        let newer = read(&hello(
            1,
            PROTOCOL_MINOR + 1,
            &[FEATURE_SIGNED_HEADS, "teleport"],
        ))
        .unwrap();
        let got = admit(&newer).unwrap();
        assert_eq!(
            got,
            BTreeSet::from([FEATURE_SIGNED_HEADS.to_string()]),
            "intersection"
        );
    }

    #[test]
    fn too_old_too_new_and_other_majors_are_refused_naming_both_versions() {
        let new = read(&hello(1, PROTOCOL_MINOR + 2, FEATURES)).unwrap();
        let e = admit(&new).unwrap_err();
        assert!(matches!(e, VersionMismatch::Minor { .. }));
        let text = e.to_string();
        assert!(text.contains("peer too new"), "{text}");
        assert!(
            text.contains(&format!("protocol 1.{}", PROTOCOL_MINOR + 2)),
            "{text}"
        );
        assert!(
            text.contains(&format!("this node protocol 1.{PROTOCOL_MINOR}")),
            "{text}"
        );
        // Too old, against a node two minors ahead of the peer.
        let old = read(&hello(1, 0, &[])).unwrap();
        let e = admit_against(&old, 1, 2, FEATURES).unwrap_err();
        assert!(e.to_string().contains("peer too old"), "{e}");
        assert!(admit_against(&old, 1, 1, FEATURES).is_ok());
        let other = read(&hello(2, PROTOCOL_MINOR, FEATURES)).unwrap();
        assert!(matches!(
            admit(&other).unwrap_err(),
            VersionMismatch::Major { .. }
        ));
    }

    #[test]
    fn malformed_feature_lists_are_protocol_errors() {
        assert!(read(&hello(1, 1, &["Bad Name"])).is_err());
        assert!(read(&hello(1, 1, &[""])).is_err());
        let long = "a".repeat(MAX_FEATURE_LEN + 1);
        assert!(read(&hello(1, 1, &[long.as_str()])).is_err());
        let many: Vec<String> = (0..=MAX_FEATURES).map(|i| format!("f{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(read(&hello(1, 1, &many)).is_err());
    }

    #[test]
    fn announcement_round_trips() {
        let mut h = pb::Hello::default();
        announce(&mut h);
        let v = read(&h).unwrap();
        assert_eq!(v, ours());
    }
}
