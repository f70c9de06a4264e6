//! The hash maps of the estimator's internal indexes and caches, whose keys are node names,
//! pool names and fingerprints (the per-node hot path hashes several per node).
//!
//! foldhash with a fixed seed: fast on short keys, and deterministic, so iteration orders do
//! not differ between replicas or runs. Keys come from member clusters the mesh already
//! authenticates, so hash flooding is not a concern for these maps.

use std::collections::{HashMap, HashSet};

/// Hash map of the estimator's indexes.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;
/// Hash set of the estimator's indexes.
pub(crate) type FastSet<K> = HashSet<K, foldhash::fast::FixedState>;
