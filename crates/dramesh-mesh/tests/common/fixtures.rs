//! Fixtures shared by the sans-I/O and relay tests: a Node change, an in-memory store, and the
//! protocol configuration without answer or relay delays.
// Each test crate that includes this uses some of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use dramesh_mesh::protocol::ProtocolConfig;
use dramesh_store::{Durability, ObjectChange, ObjectKey, ObjectKind, Store, StoreConfig};

/// Node `name` with `cpu` allocatable.
pub(crate) fn node_change(name: &str, cpu: &str) -> ObjectChange {
    let json = format!(
        r#"{{"apiVersion":"v1","kind":"Node","metadata":{{"name":"{name}"}},"status":{{"allocatable":{{"cpu":"{cpu}"}}}}}}"#
    );
    ObjectChange::Upsert {
        key: ObjectKey::new(ObjectKind::Node, None, name),
        json: Arc::from(json.into_bytes().into_boxed_slice()),
    }
}

/// A store in memory, without fsync.
pub(crate) fn mem_store() -> Store {
    Store::in_memory(StoreConfig {
        durability: Durability::None,
        ..StoreConfig::default()
    })
}

/// Fixed jitter, answers and relays at once.
pub(crate) fn config() -> ProtocolConfig {
    ProtocolConfig {
        jitter_seed: 7,
        relay_delay: Duration::ZERO,
        ack_delay: Duration::ZERO,
        ..ProtocolConfig::default()
    }
}
