//! Which document's value is visible for each key of each cluster.
//!
//! Several documents of one cluster may hold the same key: cluster-scoped objects while the
//! cluster Lease changes hands, or an object moving between node agents (a pod rescheduled to
//! another node shows up in the new node's document before it leaves the old one). The visible
//! value is the one from the holder with the highest (lease term, writer name); the order is
//! total, so every replica materializes the same winner whatever order documents arrive in.
//!
//! The index stores presence only; values stay in the automerge documents and are decoded only
//! for keys that changed.

use std::collections::HashMap;

#[derive(Debug)]
enum Holders {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Debug, Default)]
struct ClusterIndex {
    writers: Vec<String>,
    terms: Vec<u64>,
    writer_index: HashMap<String, u32>,
    keys: HashMap<String, Holders>,
}

impl ClusterIndex {
    fn intern(&mut self, writer: &str) -> u32 {
        if let Some(i) = self.writer_index.get(writer) {
            return *i;
        }
        let i = self.writers.len() as u32;
        self.writers.push(writer.to_string());
        self.terms.push(0);
        self.writer_index.insert(writer.to_string(), i);
        i
    }

    fn rank(&self, w: u32) -> (u64, &str) {
        (self.terms[w as usize], self.writers[w as usize].as_str())
    }
}

#[derive(Debug, Default)]
pub(crate) struct View {
    clusters: HashMap<String, ClusterIndex>,
}

impl View {
    /// The writer whose value of `key` is visible in `cluster`, if any document holds it.
    pub(crate) fn winner(&self, cluster: &str, key: &str) -> Option<&str> {
        let c = self.clusters.get(cluster)?;
        let w = match c.keys.get(key)? {
            Holders::One(w) => *w,
            Holders::Many(ws) => *ws.iter().max_by(|a, b| c.rank(**a).cmp(&c.rank(**b)))?,
        };
        Some(c.writers[w as usize].as_str())
    }

    /// Records whether `writer`'s document of `cluster` holds `key`.
    pub(crate) fn set_present(&mut self, cluster: &str, writer: &str, key: &str, present: bool) {
        if !present && !self.clusters.contains_key(cluster) {
            return;
        }
        let c = self.clusters.entry(cluster.to_string()).or_default();
        let w = c.intern(writer);
        match (c.keys.get_mut(key), present) {
            (None, true) => {
                c.keys.insert(key.to_string(), Holders::One(w));
            }
            (None, false) => {}
            (Some(h), true) => match h {
                Holders::One(x) if *x == w => {}
                Holders::One(x) => *h = Holders::Many(vec![*x, w]),
                Holders::Many(ws) => {
                    if !ws.contains(&w) {
                        ws.push(w);
                    }
                }
            },
            (Some(h), false) => match h {
                Holders::One(x) if *x == w => {
                    c.keys.remove(key);
                }
                Holders::One(_) => {}
                Holders::Many(ws) => {
                    ws.retain(|x| *x != w);
                    if ws.len() == 1 {
                        *h = Holders::One(ws[0]);
                    }
                }
            },
        }
    }

    pub(crate) fn term(&self, cluster: &str, writer: &str) -> u64 {
        self.clusters
            .get(cluster)
            .and_then(|c| c.writer_index.get(writer).map(|w| c.terms[*w as usize]))
            .unwrap_or(0)
    }

    /// The highest lease term any writer of `cluster` declares (the current Lease holder's).
    pub(crate) fn max_term(&self, cluster: &str) -> u64 {
        self.clusters
            .get(cluster)
            .and_then(|c| c.terms.iter().max().copied())
            .unwrap_or(0)
    }

    pub(crate) fn set_term(&mut self, cluster: &str, writer: &str, term: u64) {
        let c = self.clusters.entry(cluster.to_string()).or_default();
        let w = c.intern(writer);
        c.terms[w as usize] = term;
    }

    /// Number of keys visible in `cluster`.
    #[cfg(test)]
    pub(crate) fn len(&self, cluster: &str) -> usize {
        self.clusters.get(cluster).map_or(0, |c| c.keys.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn higher_term_then_writer_name_wins() {
        let mut v = View::default();
        v.set_present("c", "agent/a", "class/x", true);
        v.set_present("c", "agent/b", "class/x", true);
        assert_eq!(v.winner("c", "class/x"), Some("agent/b"));
        v.set_term("c", "agent/a", 5);
        assert_eq!(v.winner("c", "class/x"), Some("agent/a"));
        v.set_present("c", "agent/a", "class/x", false);
        assert_eq!(v.winner("c", "class/x"), Some("agent/b"));
        v.set_present("c", "agent/b", "class/x", false);
        assert_eq!(v.winner("c", "class/x"), None);
        assert_eq!(v.len("c"), 0);
        assert_eq!(v.winner("other", "class/x"), None);
    }
}
