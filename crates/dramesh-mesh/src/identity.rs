//! Peer identities and the document references they are allowed to write.
//!
//! A peer's identity is taken only from the URI SAN of its mutually authenticated TLS
//! certificate: `dramesh://cluster/<cluster>/agent/<node>` for an agent and
//! `dramesh://replica/<id>` for a control-plane replica. Parsing is strict: every
//! segment must be a lowercase DNS-label-like name (`[a-z0-9]([a-z0-9.-]*[a-z0-9])?`,
//! at most 253 bytes) and any other shape is rejected, so two spellings can never
//! denote the same identity.
//!
//! An agent named [`CLUSTER_PUBLISHER`] (`dramesh://cluster/<cluster>/agent/_cluster`) publishes
//! the whole cluster (`--source dir`); every other agent name is a node, whose agent may publish
//! only that node's records (replicas enforce it, see `dramesh-store`).
//!
//! Documents ([`DocId`]) are named by (cluster, writer) segments of the same shape
//! ([`valid_segment`]), plus the reserved scopes [`RESERVATION_SCOPE`](dramesh_store::RESERVATION_SCOPE)
//! and [`RETIRED_SCOPE`](dramesh_store::RETIRED_SCOPE) for a replica's reservations and
//! retired clusters, which no agent identity can name.

use std::fmt;

pub use dramesh_store::CLUSTER_PUBLISHER;
use dramesh_store::{DocId, valid_segment};

/// URI scheme of every mesh identity.
pub const IDENTITY_SCHEME: &str = "dramesh://";

/// Who a peer is, as proven by its certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PeerIdentity {
    /// An agent publishing the state of `node` in member cluster `cluster`.
    Agent {
        /// The member cluster (`dramesh://cluster/<cluster>/...`).
        cluster: String,
        /// The node (`.../agent/<node>`).
        node: String,
    },
    /// A control-plane replica holding a converged copy of every document.
    Replica {
        /// The replica id (`dramesh://replica/<id>`).
        id: String,
    },
}

/// Why an identity URI was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The URI has another scheme.
    #[error("identity URI {uri:?} does not start with {IDENTITY_SCHEME:?}")]
    Scheme {
        /// The URI as given.
        uri: String,
    },
    /// The URI's path has neither identity shape.
    #[error(
        "identity URI {uri:?} is neither dramesh://cluster/<cluster>/agent/<node> nor dramesh://replica/<id>"
    )]
    Shape {
        /// The URI as given.
        uri: String,
    },
    /// A segment is not a valid name.
    #[error(
        "identity URI {uri:?}: segment {segment:?} must be 1-253 chars of [a-z0-9.-], starting and ending alphanumeric"
    )]
    Segment {
        /// The URI as given.
        uri: String,
        /// The refused segment.
        segment: String,
    },
    /// The certificate carries no identity.
    #[error("certificate has no dramesh:// URI SAN")]
    Missing,
    /// The certificate carries more than one identity.
    #[error("certificate has {count} dramesh:// URI SANs; exactly one is required")]
    Ambiguous {
        /// How many it carries.
        count: usize,
    },
    /// The certificate does not parse as X.509 (the parser's message).
    #[error("certificate could not be parsed: {0}")]
    Certificate(String),
}

impl PeerIdentity {
    /// Parses an identity URI strictly (see the module docs).
    pub fn parse_uri(uri: &str) -> Result<Self, IdentityError> {
        let rest = uri
            .strip_prefix(IDENTITY_SCHEME)
            .ok_or_else(|| IdentityError::Scheme {
                uri: uri.to_owned(),
            })?;
        let parts: Vec<&str> = rest.split('/').collect();
        let check = |segment: &str| {
            if valid_segment(segment) {
                Ok(segment.to_owned())
            } else {
                Err(IdentityError::Segment {
                    uri: uri.to_owned(),
                    segment: segment.to_owned(),
                })
            }
        };
        match parts.as_slice() {
            ["cluster", cluster, "agent", node] => Ok(PeerIdentity::Agent {
                cluster: check(cluster)?,
                node: if *node == CLUSTER_PUBLISHER {
                    CLUSTER_PUBLISHER.to_owned()
                } else {
                    check(node)?
                },
            }),
            ["replica", id] => Ok(PeerIdentity::Replica { id: check(id)? }),
            _ => Err(IdentityError::Shape {
                uri: uri.to_owned(),
            }),
        }
    }

    /// The canonical URI of this identity (the inverse of [`PeerIdentity::parse_uri`]).
    pub fn uri(&self) -> String {
        match self {
            PeerIdentity::Agent { cluster, node } => {
                format!("{IDENTITY_SCHEME}cluster/{cluster}/agent/{node}")
            }
            PeerIdentity::Replica { id } => format!("{IDENTITY_SCHEME}replica/{id}"),
        }
    }

    /// Whether this is a replica (not an agent).
    pub fn is_replica(&self) -> bool {
        matches!(self, PeerIdentity::Replica { .. })
    }

    /// Whether this identity may author the document `doc`: an agent only its own
    /// (cluster, writer) document, a replica only its own reservation and retirement documents
    /// (it relays everything else).
    pub fn owns(&self, doc: &DocId) -> bool {
        match self {
            PeerIdentity::Agent { cluster, node } => doc.cluster == *cluster && doc.writer == *node,
            PeerIdentity::Replica { id } => doc.is_replica_scope() && doc.writer == *id,
        }
    }

    /// Extracts the identity from a DER certificate: exactly one `dramesh://` URI SAN.
    pub fn from_certificate_der(der: &[u8]) -> Result<Self, IdentityError> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| IdentityError::Certificate(e.to_string()))?;
        let san = cert
            .subject_alternative_name()
            .map_err(|e| IdentityError::Certificate(e.to_string()))?;
        let uris: Vec<&str> = san
            .map(|ext| {
                ext.value
                    .general_names
                    .iter()
                    .filter_map(|name| match name {
                        x509_parser::extensions::GeneralName::URI(uri) => Some(*uri),
                        _ => None,
                    })
                    .filter(|uri| uri.starts_with(IDENTITY_SCHEME))
                    .collect()
            })
            .unwrap_or_default();
        match uris.as_slice() {
            [] => Err(IdentityError::Missing),
            [uri] => PeerIdentity::parse_uri(uri),
            many => Err(IdentityError::Ambiguous { count: many.len() }),
        }
    }
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_round_trips() {
        let a = PeerIdentity::parse_uri("dramesh://cluster/east-1/agent/node-7.x").unwrap();
        assert_eq!(
            a,
            PeerIdentity::Agent {
                cluster: "east-1".into(),
                node: "node-7.x".into()
            }
        );
        assert_eq!(a.uri(), "dramesh://cluster/east-1/agent/node-7.x");
        let r = PeerIdentity::parse_uri("dramesh://replica/r0").unwrap();
        assert_eq!(r.uri(), "dramesh://replica/r0");
        assert!(r.is_replica());
    }

    #[test]
    fn rejects_everything_else() {
        for bad in [
            "https://replica/r0",
            "dramesh://replica/",
            "dramesh://replica/R0",
            "dramesh://replica/r0/",
            "dramesh://replica/-r0",
            "dramesh://replica/r0-",
            "dramesh://replica/r_0",
            "dramesh://cluster/a/agent",
            "dramesh://cluster/a/node/b",
            "dramesh://cluster//agent/b",
            "dramesh://cluster/a/agent/b/c",
            "dramesh://replica/r0?x=1",
            "dramesh://replica/r%30",
            "dramesh:///replica/r0",
        ] {
            assert!(PeerIdentity::parse_uri(bad).is_err(), "{bad} accepted");
        }
        let long = format!("dramesh://replica/{}", "a".repeat(254));
        assert!(PeerIdentity::parse_uri(&long).is_err());
    }

    #[test]
    fn ownership_is_own_cluster_and_writer_only() {
        let a = PeerIdentity::Agent {
            cluster: "a".into(),
            node: "n1".into(),
        };
        assert!(a.owns(&DocId::new("a", "n1")));
        assert!(!a.owns(&DocId::new("a", "n2")));
        assert!(!a.owns(&DocId::new("b", "n1")));
        assert!(!PeerIdentity::Replica { id: "r".into() }.owns(&DocId::new("a", "n1")));
    }

    #[test]
    fn replicas_own_only_their_reservation_and_retirement_documents() {
        let r1 = PeerIdentity::Replica { id: "r1".into() };
        assert!(r1.owns(&DocId::reservations("r1")));
        assert!(!r1.owns(&DocId::reservations("r2")));
        assert!(r1.owns(&DocId::retired("r1")));
        assert!(!r1.owns(&DocId::retired("r2")));
        assert!(DocId::retired("r1").is_valid());
        assert!(!r1.owns(&DocId::new("r1", "r1")));
        assert!(DocId::reservations("r1").is_valid());
        assert!(!DocId::reservations("R1").is_valid());
        assert!(!DocId::new("_other", "r1").is_valid());
        // No agent can be named into the reserved scope: its cluster segment must be valid.
        assert!(PeerIdentity::parse_uri("dramesh://cluster/_reservations/agent/r1").is_err());
        assert!(PeerIdentity::parse_uri("dramesh://cluster/_retired/agent/r1").is_err());
        let a = PeerIdentity::Agent {
            cluster: "c".into(),
            node: "r1".into(),
        };
        assert!(!a.owns(&DocId::reservations("r1")));
        assert!(!a.owns(&DocId::retired("r1")));
    }
}
