//! Overcommit resolution of in-flight reservations.
//!
//! Several scheduler replicas may reserve the same free capacity at the same moment; once
//! their reservations have been merged every replica must decide, on its own and identically,
//! which of them hold capacity. [`resolve`] is that decision, a pure function of the view and
//! the set of live reservations:
//!
//! 1. Reservations are grouped by cluster and ranked by [`rank`]: higher priority first, then
//!    the smaller reservation id (ids are unique, so the order is total).
//! 2. Walking that order, a reservation is **admitted** when the cluster's estimate of its
//!    workload, with every reservation admitted before it deducted (as Karmada assumed
//!    workloads: first-fit over nodes in name order), still fits all of its replicas. An
//!    admitted reservation is deducted from every later check and from estimates.
//! 3. Every other reservation is **conflicted**: it holds nothing, and names the
//!    highest-ranked admitted reservation of its cluster as the winner.
//!
//! Guarantees: the result does not depend on the order of the input slice, and two replicas
//! whose views and reservation sets are equal compute equal results (the estimator is
//! deterministic), whether they resolve from nothing or from an earlier resolution carried
//! over node changes ([`resolve_cluster`]: carrying is exact or not done). A reservation is all or nothing: one that fits only partly is conflicted.
//! Deductions are by resource requests and pod slots (cpu, memory, extended resources such
//! as `nvidia.com/gpu`, pods), the same model as Karmada assumed workloads, and by DRA
//! devices: each reserved replica of a workload with claims holds its own allocation of the
//! workload's ResourceClaimTemplates (and its shared claims once), placed first-fit as the
//! estimator counts device fit (see [`crate::estimate::AssumedWorkload`]).

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::assumed::{Assumed, AssumedList, AssumedWorkload, Reach};
use crate::estimate::{EstimateOptions, Estimator};
use crate::view::{ClusterView, View, ViewStamp};
use crate::workload::Workload;

/// One live reservation, as resolution needs it.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// Unique id; the tiebreak between equal priorities.
    pub id: Arc<str>,
    /// Member cluster the capacity is reserved in.
    pub cluster: Arc<str>,
    /// Priority of the reserved workload.
    pub priority: i32,
    /// Replicas still to be held: the reserved replicas minus those the member cluster
    /// already reports bound. Zero holds nothing and is always admitted.
    pub replicas: i64,
    /// The per-replica requirements.
    pub workload: Arc<Workload>,
}

/// The outcome for one reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Holds its replicas: deducted from estimates.
    Admitted,
    /// Holds nothing: it did not fit after the higher-ranked admitted reservations.
    Conflicted {
        /// The highest-ranked admitted reservation of the same cluster, if any.
        winner: Option<Arc<str>>,
        /// Replicas that were still available to it.
        available: i64,
        /// Why it could not be checked at all (unknown cluster, estimator error).
        reason: Option<String>,
    },
}

/// One reservation at its place in its cluster's ranking, with its outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ranked {
    /// The reservation's id.
    pub id: Arc<str>,
    /// Its priority.
    pub priority: i32,
    /// The replicas resolved ([`Reservation::replicas`]).
    pub replicas: i64,
    /// Its outcome.
    pub admission: Admission,
}

/// The resolution of one cluster's reservations.
#[derive(Debug, Clone, Default)]
pub struct ClusterResolution {
    /// Every reservation of the cluster in rank order, with its outcome.
    pub ranked: Vec<Ranked>,
    /// The admitted ones as estimator deductions, in rank order.
    pub assumed: Vec<Arc<AssumedWorkload>>,
    /// The place in `ranked` of each entry of `assumed`.
    pub assumed_at: Vec<usize>,
    /// The view of the cluster it holds on.
    stamp: ViewStamp,
    /// Per entry of `ranked`: the replicas its check found the cluster to fit (`None`: not
    /// checked, holding nothing, or the check failed).
    counts: Vec<Option<i64>>,
    /// Per workload shape (fingerprint) of `ranked`: the replicas the cluster fits with
    /// nothing deducted.
    bases: Vec<(u64, i64)>,
    /// Where each admitted reservation's first-fit deduction ends, in the order of
    /// `assumed` (`None`: unknown).
    reaches: Option<Vec<Reach>>,
    /// Entries of `ranked` taken from the previous resolution without an estimate.
    reused: usize,
}

impl ClusterResolution {
    /// The entry of reservation `id`, whose priority is `priority` (a binary search: the
    /// ranking is ordered by both).
    pub fn get(&self, id: &str, priority: i32) -> Option<&Ranked> {
        self.ranked
            .binary_search_by(|r| rank_order(r.priority, &r.id, priority, id))
            .ok()
            .map(|i| &self.ranked[i])
    }

    /// The id of each entry of `assumed`, in the same order.
    pub fn assumed_ids(&self) -> impl Iterator<Item = &Arc<str>> {
        self.assumed_at.iter().map(|&i| &self.ranked[i].id)
    }

    /// The view of the cluster this resolution holds on.
    pub fn stamp(&self) -> ViewStamp {
        self.stamp
    }

    /// Entries taken from the previous resolution without an estimate ([`resolve_cluster`]).
    pub fn reused(&self) -> usize {
        self.reused
    }

    /// How many of the first entries of the ranking are `list`'s (the same reservation,
    /// priority and replicas, in the same places).
    fn ranks_as(&self, list: &[&Reservation]) -> usize {
        self.ranked
            .iter()
            .zip(list)
            .take_while(|(a, b)| {
                (Arc::ptr_eq(&a.id, &b.id) || a.id == b.id)
                    && a.priority == b.priority
                    && a.replicas == b.replicas
            })
            .count()
    }

    /// Keeps the first `n` entries of the ranking.
    fn truncate(&mut self, n: usize) {
        self.ranked.truncate(n);
        self.counts.truncate(n);
        let admitted = self.assumed_at.iter().take_while(|&&i| i < n).count();
        self.assumed.truncate(admitted);
        self.assumed_at.truncate(admitted);
    }

    /// This resolution of `list` (ranked), made on an earlier view of `cluster`, brought to
    /// `view` as it is, as far as that is exact without checking again: `None` when the
    /// changes since are not all of a node (see [`ClusterView::node_changes_since`]).
    /// Otherwise the entries that rank as before, up to the first admitted one whose
    /// first-fit reached the first changed node that may change a fit, and cut at the first
    /// whose outcome the changes turn (the rest are checked again). Why it is exact: a
    /// check's count is the sum of independent per-node answers (workloads without shared
    /// claims, no device held outside its node). A changed node that leaves every fit as it
    /// was changes no answer. Any other changed node comes after every node the kept
    /// admitted reservations were deducted from, all their replicas placed, so their
    /// deductions are the same, the node holds none of them in any kept check, and its
    /// answer there is its answer with nothing deducted: each kept count moves by what its
    /// workload's count with nothing deducted moved (kept per shape in `bases`), which one
    /// memoized estimate per shape gives.
    fn carried(
        &self,
        view: &View,
        estimator: &mut Estimator,
        cluster: &str,
        list: &[&Reservation],
    ) -> Option<ClusterResolution> {
        let cv = view.cluster(cluster)?;
        let changes = cv.node_changes_since(&self.stamp)?;
        let same = self.ranks_as(list);
        let claims = crate::view::judged_node_claims(
            list[..same]
                .iter()
                .map(|r| (&r.workload.node_claim, !r.workload.shared_claims.is_empty())),
        )?;
        // The first changed node (in name order) that may change a fit.
        let first = changes
            .iter()
            .find(|ch| !ch.leaves_fits(cv, &claims))
            .map(|ch| &ch.node);
        let mut keep = same;
        if let Some(first) = first {
            // Kept: the reservations ranked before the first admitted one whose first-fit
            // reached that node (every changed node after it is reached later still).
            let reaches = self.reaches.as_ref()?;
            if let Some((&at, _)) = self
                .assumed_at
                .iter()
                .zip(reaches)
                .find(|(_, r)| !r.passes(first))
            {
                keep = keep.min(at);
            }
        }
        let mut out = self.clone();
        out.truncate(keep);
        out.stamp = cv.stamp();
        if first.is_some() {
            let mut shifts: Vec<(u64, Option<i64>)> = Vec::new();
            for (i, r) in list[..keep].iter().enumerate() {
                if r.replicas <= 0 {
                    continue;
                }
                let fp = r.workload.fingerprint;
                let shift = match shifts.iter().find(|(f, _)| *f == fp) {
                    Some((_, s)) => *s,
                    None => {
                        let was = self.bases.iter().find(|(f, _)| *f == fp).map(|(_, b)| *b);
                        let now = base_count(view, estimator, cluster, &r.workload);
                        let s = was.zip(now).map(|(w, n)| n - w);
                        shifts.push((fp, s));
                        s
                    }
                };
                let (Some(shift), Some(count)) = (shift, out.counts[i]) else {
                    out.truncate(i);
                    break;
                };
                let count = count + shift;
                let admitted = count >= r.replicas;
                if admitted != matches!(out.ranked[i].admission, Admission::Admitted) {
                    out.truncate(i);
                    break;
                }
                out.counts[i] = Some(count);
                if let Admission::Conflicted { available, .. } = &mut out.ranked[i].admission {
                    *available = count;
                }
            }
        }
        Some(out)
    }

    /// Records what a later resolution needs to carry this one to another view: the stamp,
    /// each shape's count with nothing deducted, where the deductions end.
    /// `known`: how many of the admitted reservations (the first ones) still have their
    /// deduction's end in `reaches` (an extension keeps those; they are not computed again).
    fn finish(
        &mut self,
        view: &View,
        estimator: &mut Estimator,
        cluster: &str,
        list: &[&Reservation],
        known: usize,
    ) {
        self.stamp = view
            .cluster(cluster)
            .map(ClusterView::stamp)
            .unwrap_or_default();
        let mut bases: Vec<(u64, i64)> = Vec::new();
        let mut tried: Vec<u64> = Vec::new();
        for r in list {
            let fp = r.workload.fingerprint;
            if r.replicas > 0 && !tried.contains(&fp) {
                tried.push(fp);
                // Unknown (the estimate failed): entries of this shape are checked again
                // after any change that is not fit-neutral.
                if let Some(n) = base_count(view, estimator, cluster, &r.workload) {
                    bases.push((fp, n));
                }
            }
        }
        self.bases = bases;
        let list: AssumedList = self.assumed.clone().into();
        let kept = self
            .reaches
            .take()
            .filter(|r| known > 0 && r.len() == known);
        let start = kept.as_ref().map_or(0, Vec::len);
        self.reaches = estimator
            .deduction_reaches(view, cluster, &list, start)
            .map(|more| {
                let mut r = kept.unwrap_or_default();
                r.extend(more);
                r
            });
    }
}

/// Replicas of `w` that `cluster` fits with nothing deducted (`None`: the estimate failed).
fn base_count(view: &View, estimator: &mut Estimator, cluster: &str, w: &Workload) -> Option<i64> {
    let opts = EstimateOptions {
        clusters: vec![cluster.to_string()],
        ..EstimateOptions::default()
    };
    let est = estimator.estimate(view, w, &opts);
    est.cluster(cluster)
        .filter(|c| c.error.is_none())
        .map(|c| c.max_replicas)
}

/// The result of [`resolve`]: each cluster's resolution.
#[derive(Debug, Clone, Default)]
pub struct Resolution {
    /// By cluster name.
    pub clusters: BTreeMap<String, ClusterResolution>,
}

impl Resolution {
    /// The outcome of one reservation (a linear search).
    pub fn admission(&self, id: &str) -> Option<&Admission> {
        self.clusters
            .values()
            .flat_map(|c| &c.ranked)
            .find(|r| &*r.id == id)
            .map(|r| &r.admission)
    }

    /// Every admitted reservation as an estimator deduction.
    pub fn assumed(&self) -> Assumed {
        let mut out = Assumed::default();
        for (cluster, c) in &self.clusters {
            out.set(cluster, c.assumed.clone().into());
        }
        out
    }

    /// The ids of the admitted reservations, cluster by cluster in rank order.
    pub fn assumed_ids(&self) -> Vec<&str> {
        self.clusters
            .values()
            .flat_map(|c| c.assumed_ids())
            .map(|id| &**id)
            .collect()
    }
}

/// The resolution order: priority descending, then creation ascending (the sequence number
/// ending the id, `<owner>-<seq>`, which replicas start from their wall clock in ms), then id
/// ascending. Ranking by creation first, not by owner, keeps a reservation that arrives from
/// another replica among those made at the same time: ranked by id alone, every reservation
/// of one replica would rank before every one of another, and each arriving batch would
/// resolve the whole of the other replica's again.
fn rank_order(pa: i32, ida: &str, pb: i32, idb: &str) -> Ordering {
    rank_key(pa, ida).cmp(&rank_key(pb, idb))
}

/// [`rank_order`] of two reservations: `Less` when `a` is resolved first.
pub fn rank_cmp(a: &Reservation, b: &Reservation) -> Ordering {
    rank_order(a.priority, &a.id, b.priority, &b.id)
}

/// What [`rank_order`] compares, as one key.
fn rank_key(priority: i32, id: &str) -> (std::cmp::Reverse<i32>, (usize, &str), &str) {
    (std::cmp::Reverse(priority), seq_of(id), id)
}

/// The sequence number ending `id` as (digits, digits): numeric order without parsing;
/// `(0, "")` for an id without one.
fn seq_of(id: &str) -> (usize, &str) {
    match id.rsplit_once('-') {
        Some((_, seq)) if !seq.is_empty() && seq.bytes().all(|b| b.is_ascii_digit()) => {
            let seq = seq.trim_start_matches('0');
            (seq.len(), seq)
        }
        _ => (0, ""),
    }
}

/// Decides which reservations hold capacity (see the module docs).
pub fn resolve(view: &View, estimator: &mut Estimator, reservations: &[Reservation]) -> Resolution {
    let mut by_cluster: BTreeMap<&str, Vec<Reservation>> = BTreeMap::new();
    for r in reservations {
        by_cluster.entry(&r.cluster).or_default().push(r.clone());
    }
    Resolution {
        clusters: by_cluster
            .into_iter()
            .map(|(c, list)| {
                (
                    c.to_string(),
                    resolve_cluster(view, estimator, c, &list, None),
                )
            })
            .collect(),
    }
}

/// [`resolve`] of the reservations of one cluster (those of `reservations` in `cluster`),
/// reusing `previous`, an earlier result of this function for the same cluster: the
/// reservations ranked before the first difference between the two rankings keep their
/// outcomes (an outcome depends only on the reservations ranked before it), and only the rest
/// are checked, each with one estimate. When the view of the cluster changed since
/// `previous`, it is first carried to the view as it is where that is exact (see
/// `ClusterResolution::carried`: node changes that leave every fit as it was, or that come
/// after every deduction, shift counts by one memoized estimate per workload shape), else
/// nothing is reused. Besides those estimates, the work is copying pointers, one per
/// reservation.
pub fn resolve_cluster(
    view: &View,
    estimator: &mut Estimator,
    cluster: &str,
    reservations: &[Reservation],
    previous: Option<&ClusterResolution>,
) -> ClusterResolution {
    let mut list: Vec<&Reservation> = reservations
        .iter()
        .filter(|r| &*r.cluster == cluster)
        .collect();
    // The rank key computed once per reservation, not per comparison.
    list.sort_by_cached_key(|r| rank_key(r.priority, &r.id));
    let mut out = ClusterResolution {
        ranked: Vec::with_capacity(list.len()),
        ..ClusterResolution::default()
    };
    let stamp = view
        .cluster(cluster)
        .map(ClusterView::stamp)
        .unwrap_or_default();
    let carried;
    let previous = match previous {
        Some(p) if p.stamp != stamp => {
            carried = p.carried(view, estimator, cluster, &list);
            carried.as_ref()
        }
        p => p,
    };
    let mut kept = 0;
    if let Some(p) = previous {
        kept = p.ranks_as(&list);
        out.ranked.extend_from_slice(&p.ranked[..kept]);
        out.counts.extend_from_slice(&p.counts[..kept]);
        // `assumed` is in rank order: the admitted ones among the kept come first.
        let admitted = p.assumed_at.iter().take_while(|&&i| i < kept).count();
        out.assumed.extend_from_slice(&p.assumed[..admitted]);
        out.assumed_at.extend_from_slice(&p.assumed_at[..admitted]);
    }
    out.reused = kept;
    out.check(view, estimator, cluster, list[kept..].iter().copied());
    out.finish(view, estimator, cluster, &list, 0);
    out
}

impl ClusterResolution {
    /// Whether `r` ranks after every reservation resolved here, so that
    /// [`ClusterResolution::extend`] can add it.
    pub fn ranks_after_all(&self, r: &Reservation) -> bool {
        self.ranked
            .last()
            .is_none_or(|l| rank_order(l.priority, &l.id, r.priority, &r.id) == Ordering::Less)
    }

    /// Resolves `more` after everything resolved here: each must rank after every
    /// reservation of `ranked` and after those before it in `more` (checked: out of order
    /// is `Err`, and nothing is resolved). The result is what [`resolve_cluster`] of all of
    /// them gives, at the cost of one estimate per reservation of `more`.
    pub fn extend(
        &mut self,
        view: &View,
        estimator: &mut Estimator,
        cluster: &str,
        more: &[Reservation],
    ) -> Result<(), String> {
        let mut last = self.ranked.last().map(|r| (r.priority, r.id.clone()));
        for r in more {
            if let Some((p, id)) = &last
                && rank_order(*p, id, r.priority, &r.id) != Ordering::Less
            {
                return Err(format!("reservation {} does not rank after {id}", r.id));
            }
            last = Some((r.priority, r.id.clone()));
        }
        if self.stamp
            != view
                .cluster(cluster)
                .map(ClusterView::stamp)
                .unwrap_or_default()
        {
            return Err(format!("the view of cluster {cluster} changed since"));
        }
        let admitted = self.assumed.len();
        self.check(view, estimator, cluster, more.iter());
        // Shapes new here get their counts with nothing deducted.
        let mut list: Vec<&Reservation> = Vec::new();
        for r in more {
            if !self.bases.iter().any(|(f, _)| *f == r.workload.fingerprint) {
                list.push(r);
            }
        }
        let mut bases = std::mem::take(&mut self.bases);
        self.finish(view, estimator, cluster, &list, admitted);
        bases.append(&mut self.bases);
        self.bases = bases;
        Ok(())
    }

    /// Checks `list`, in rank order after everything in `self`, one estimate each with every
    /// admitted reservation before it deducted, and appends the outcomes.
    fn check<'a>(
        &mut self,
        view: &View,
        estimator: &mut Estimator,
        cluster: &str,
        list: impl Iterator<Item = &'a Reservation>,
    ) {
        let mut winner: Option<Arc<str>> =
            self.assumed_at.first().map(|&i| self.ranked[i].id.clone());
        // The admitted list as the estimator takes it, copied again only after it grew.
        let mut shared: Option<Assumed> = None;
        for r in list {
            let admission = if r.replicas <= 0 {
                self.counts.push(None);
                Admission::Admitted
            } else {
                let assumed = shared.get_or_insert_with(|| {
                    let mut a = Assumed::default();
                    a.set(cluster, self.assumed.clone().into());
                    a
                });
                let opts = EstimateOptions {
                    assumed: assumed.clone(),
                    clusters: vec![cluster.to_string()],
                    ..EstimateOptions::default()
                };
                let est = estimator.estimate(view, &r.workload, &opts);
                let (available, reason) = match est.cluster(cluster) {
                    None => (0, Some(format!("cluster {cluster} is not in the view"))),
                    Some(c) => match &c.error {
                        Some(e) => (0, Some(e.clone())),
                        None => (c.max_replicas, None),
                    },
                };
                self.counts.push(reason.is_none().then_some(available));
                if reason.is_none() && available >= r.replicas {
                    self.assumed.push(Arc::new(AssumedWorkload::from_shared(
                        cluster,
                        &r.workload,
                        r.replicas,
                    )));
                    self.assumed_at.push(self.ranked.len());
                    winner.get_or_insert_with(|| r.id.clone());
                    shared = None;
                    Admission::Admitted
                } else {
                    Admission::Conflicted {
                        winner: winner.clone(),
                        available,
                        reason,
                    }
                }
            };
            self.ranked.push(Ranked {
                id: r.id.clone(),
                priority: r.priority,
                replicas: r.replicas,
                admission,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dramesh_model::load::load_str;
    use dramesh_model::{Manifest, ObjectChange};
    use std::path::Path;

    /// One cluster `c` with two nodes of 4 GPUs (extended resource) each.
    fn view() -> View {
        let mut v = View::new();
        for n in ["n1", "n2"] {
            let yaml = format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: {n}}}\nstatus: {{allocatable: {{cpu: '64', memory: 256Gi, pods: '110', nvidia.com/gpu: '4'}}}}\n"
            );
            for l in load_str(Path::new("node.yaml"), &yaml).unwrap() {
                let Manifest::Object(o) = l.manifest else {
                    panic!("not an object")
                };
                v.apply("c", &ObjectChange::upsert(&o)).unwrap();
            }
        }
        v
    }

    fn workload(name: &str, gpus: u32) -> Arc<Workload> {
        let yaml = format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}, namespace: ml}}\nspec:\n  replicas: 1\n  selector: {{matchLabels: {{app: {name}}}}}\n  template:\n    metadata: {{labels: {{app: {name}}}}}\n    spec:\n      containers:\n      - name: c\n        resources: {{requests: {{cpu: '1', nvidia.com/gpu: '{gpus}'}}, limits: {{nvidia.com/gpu: '{gpus}'}}}}\n"
        );
        let ms: Vec<Manifest> = load_str(Path::new("w.yaml"), &yaml)
            .unwrap()
            .into_iter()
            .map(|l| l.manifest)
            .collect();
        Arc::new(Workload::from_manifests(&ms).unwrap())
    }

    fn res(id: &str, priority: i32, replicas: i64, w: &Arc<Workload>) -> Reservation {
        Reservation {
            id: id.into(),
            cluster: "c".into(),
            priority,
            replicas,
            workload: w.clone(),
        }
    }

    fn gpus_left(v: &View, r: &Resolution) -> i64 {
        let one = workload("probe", 1);
        let opts = EstimateOptions {
            assumed: r.assumed(),
            ..EstimateOptions::default()
        };
        Estimator::new().estimate(v, &one, &opts).total
    }

    /// One cluster `c` with two nodes of 4 DRA GPUs each (no `nvidia.com/gpu`).
    fn dra_view() -> View {
        let spec = dramesh_sim::typed::FleetSpec {
            clusters: 1,
            nodes_per_cluster: 2,
            gpus_per_node: 4,
            owners_per_cluster: 1,
            kubernetes_version: "1.36".into(),
        };
        let mut v = View::new();
        dramesh_sim::typed::cluster_objects(&spec, 0, &|_| 0, |o| {
            v.apply_object("c", o).unwrap();
        });
        v
    }

    /// A workload whose replicas each claim `gpus` DRA GPUs through a ResourceClaimTemplate.
    fn dra_workload(name: &str, gpus: i64) -> Arc<Workload> {
        dra_workload_on(name, gpus, serde_json::json!({}))
    }

    /// [`dra_workload`] with `nodeSelector: node_selector`.
    fn dra_workload_on(name: &str, gpus: i64, node_selector: serde_json::Value) -> Arc<Workload> {
        let tpl: dramesh_model::k8s::ResourceClaimTemplate =
            serde_json::from_value(serde_json::json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "gpu", "namespace": "ml"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": dramesh_sim::typed::CLASS, "count": gpus}}]}}}
            }))
            .unwrap();
        let templates = std::collections::HashMap::from([(
            ("ml".to_string(), "gpu".to_string()),
            Arc::new(tpl),
        )]);
        let spec = serde_json::json!({
            "containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}],
            "nodeSelector": node_selector,
        });
        Arc::new(
            Workload::from_pod_spec(
                "Deployment",
                "ml",
                name,
                1,
                serde_json::from_value(spec).unwrap(),
                &templates,
            )
            .unwrap(),
        )
    }

    fn dra_gpus_left(v: &View, r: &Resolution) -> i64 {
        let opts = EstimateOptions {
            assumed: r.assumed(),
            ..EstimateOptions::default()
        };
        Estimator::new()
            .estimate(v, &dra_workload("probe", 1), &opts)
            .total
    }

    /// Resolving a cluster again from its previous resolution, as reservations arrive,
    /// change and end anywhere in the ranking, gives what resolving from nothing gives.
    #[test]
    fn resolving_from_the_previous_resolution_equals_resolving_afresh() {
        let spec = dramesh_sim::typed::FleetSpec {
            clusters: 1,
            nodes_per_cluster: 6,
            gpus_per_node: 4,
            owners_per_cluster: 1,
            kubernetes_version: "1.36".into(),
        };
        let mut v = View::new();
        dramesh_sim::typed::cluster_objects(&spec, 0, &|n| n % 3, |o| {
            v.apply_object("c", o).unwrap();
        });
        let shapes = [dra_workload("one", 1), dra_workload("two", 2)];
        let mut rng = dramesh_testkit::Lcg(12345);
        let mut next = |m: u64| rng.next(m);
        let mut live: Vec<Reservation> = Vec::new();
        let mut est = Estimator::new();
        let mut previous: Option<ClusterResolution> = None;
        let (mut conflicted, mut reused) = (0, 0);
        for step in 0..60 {
            match next(6) {
                0 if !live.is_empty() => {
                    let i = next(live.len() as u64) as usize;
                    live.remove(i);
                }
                1 if !live.is_empty() => {
                    let i = next(live.len() as u64) as usize;
                    live[i].replicas = next(3) as i64;
                }
                _ => {
                    let mut r = res(
                        &format!("r{:04}", next(10_000)),
                        next(3) as i32,
                        1 + next(4) as i64,
                        &shapes[next(2) as usize],
                    );
                    r.cluster = "c".into();
                    live.push(r);
                }
            }
            let fresh = resolve_cluster(&v, &mut Estimator::new(), "c", &live, None);
            let again = resolve_cluster(&v, &mut est, "c", &live, previous.as_ref());
            assert_eq!(again.ranked, fresh.ranked, "step {step}");
            assert!(again.assumed_ids().eq(fresh.assumed_ids()), "step {step}");
            let as_whole = |c: &ClusterResolution| Resolution {
                clusters: BTreeMap::from([("c".to_string(), c.clone())]),
            };
            assert_eq!(
                dra_gpus_left(&v, &as_whole(&again)),
                dra_gpus_left(&v, &as_whole(&fresh))
            );
            let whole = resolve(&v, &mut Estimator::new(), &live);
            let whole_ranked = whole.clusters.get("c").map_or(&[][..], |c| &c.ranked[..]);
            assert_eq!(whole_ranked, &fresh.ranked[..], "step {step}");
            // Every reservation can be found in the ranking by id and priority.
            for r in &live {
                let got = fresh.get(&r.id, r.priority).map(|g| &g.id);
                assert_eq!(got, Some(&r.id), "step {step}");
            }
            if let Some(p) = &previous {
                reused += p
                    .ranked
                    .iter()
                    .zip(&fresh.ranked)
                    .take_while(|(a, b)| a == b)
                    .count();
            }
            conflicted += fresh
                .ranked
                .iter()
                .filter(|r| matches!(r.admission, Admission::Conflicted { .. }))
                .count();
            previous = Some(again);
        }
        assert!(conflicted > 0, "the fleet should run out of GPUs");
        assert!(reused > 100, "most steps should reuse a prefix ({reused})");
    }

    /// Node changes in random order (relabels no workload selects on, relabels one does,
    /// cordons, pods started and ended), each followed by resolving the same reservations
    /// from the last resolution with the same estimator: it equals resolving from nothing
    /// with a fresh estimator, and estimates deducting it equal a fresh estimator's. Most
    /// changes are carried without checking anything again (fit-neutral, or after every
    /// deduction, where counts move by each shape's count with nothing deducted), and some
    /// of those move the count of a conflicted reservation.
    #[test]
    fn resolutions_carried_over_node_changes_equal_resolving_afresh() {
        let spec = dramesh_sim::typed::FleetSpec {
            clusters: 1,
            nodes_per_cluster: 40,
            gpus_per_node: 4,
            owners_per_cluster: 1,
            kubernetes_version: "1.36".into(),
        };
        let mut v = View::new();
        let mut nodes = Vec::new();
        dramesh_sim::typed::cluster_objects(&spec, 0, &|n| n % 3, |o| {
            if let dramesh_model::ClusterObject::Node(n) = &o {
                nodes.push((**n).clone());
            }
            v.apply_object("c", o).unwrap();
        });
        let shapes = [
            dra_workload("one", 1),
            dra_workload("two", 2),
            dra_workload_on("sel", 1, serde_json::json!({"gpu": "a100"})),
        ];
        let mut rng = dramesh_testkit::Lcg(7);
        let mut next = |m: u64| rng.next(m);
        // Small ones, admitted within the first nodes, and three too big to fit.
        let mut live: Vec<Reservation> = (0..12)
            .map(|i| res(&format!("r-{i}"), 0, 1 + next(2) as i64, &shapes[i % 3]))
            .collect();
        for (i, w) in shapes.iter().enumerate() {
            live.push(res(&format!("big-{i}"), 0, 130, w));
        }
        let pod = |node: &str, i: usize| -> dramesh_model::ClusterObject {
            let p: dramesh_model::k8s::Pod = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("cpu-{i}"), "namespace": "other"},
                "spec": {"nodeName": node, "containers": [{"name": "c",
                    "resources": {"requests": {"cpu": "100"}}}]},
                "status": {"phase": "Running"}
            }))
            .unwrap();
            dramesh_model::ClusterObject::Pod(Arc::new(p))
        };
        let mut pods: Vec<Option<dramesh_model::ClusterObject>> = vec![None; nodes.len()];
        let mut est = Estimator::new();
        let mut last = resolve_cluster(&v, &mut est, "c", &live, None);
        let probe = dra_workload("probe", 1);
        let (mut carried, mut moved, mut neutral, mut partly) = (0, 0, 0, 0);
        for step in 0..200 {
            let i = next(nodes.len() as u64) as usize;
            let node = &mut nodes[i];
            let name = node.metadata.name.clone().unwrap();
            let labels = node.metadata.labels.get_or_insert_default();
            let change = next(5);
            match change {
                0 => {
                    // Selected on by "sel".
                    if labels.remove("gpu").is_none() {
                        labels.insert("gpu".into(), "a100".into());
                    }
                }
                1 => {
                    let spec = node.spec.get_or_insert_default();
                    spec.unschedulable = Some(!spec.unschedulable.unwrap_or(false));
                }
                2 => {
                    labels.insert("update".into(), step.to_string());
                }
                _ => match pods[i].take() {
                    Some(p) => v
                        .apply("c", &ObjectChange::Delete { key: p.key() })
                        .unwrap(),
                    None => {
                        let p = pod(&name, i);
                        v.apply_object("c", p.clone()).unwrap();
                        pods[i] = Some(p);
                    }
                },
            }
            if change < 3 {
                let o = dramesh_model::ClusterObject::Node(Arc::new(node.clone()));
                v.apply_object("c", o).unwrap();
            }
            let fresh = resolve_cluster(&v, &mut Estimator::new(), "c", &live, None);
            let again = resolve_cluster(&v, &mut est, "c", &live, Some(&last));
            assert_eq!(again.ranked, fresh.ranked, "step {step}");
            assert!(again.assumed_ids().eq(fresh.assumed_ids()), "step {step}");
            if again.reused() > 0 && again.reused() < live.len() {
                partly += 1;
            }
            if again.reused() == live.len() {
                carried += 1;
                if fresh.ranked != last.ranked {
                    moved += 1;
                }
                if change == 2 {
                    neutral += 1;
                }
            }
            let opts = EstimateOptions {
                assumed: Resolution {
                    clusters: BTreeMap::from([("c".to_string(), fresh.clone())]),
                }
                .assumed(),
                ..EstimateOptions::default()
            };
            assert_eq!(
                est.estimate(&v, &probe, &opts),
                Estimator::new().estimate(&v, &probe, &opts),
                "step {step}"
            );
            last = again;
        }
        assert!(carried > 80, "most changes are carried ({carried})");
        assert!(neutral > 20, "irrelevant relabels are carried ({neutral})");
        assert!(
            moved > 10,
            "carried changes move conflicted counts ({moved})"
        );
        assert!(carried < 200, "some changes are checked again ({carried})");
        assert!(
            partly > 5,
            "changes before the last deduction keep the reservations ranked before the first \
             that reached them ({partly})"
        );
    }

    /// Extending a resolution with reservations that rank after all others gives what
    /// resolving all of them gives; one that does not rank last is refused, changing nothing.
    #[test]
    fn extending_with_reservations_ranked_last_equals_resolving_all() {
        let v = dra_view();
        let w = dra_workload("w", 1);
        let all: Vec<Reservation> = (0..6).map(|i| res(&format!("r{i}"), 0, 2, &w)).collect();
        let whole = resolve_cluster(&v, &mut Estimator::new(), "c", &all, None);
        let mut est = Estimator::new();
        let mut part = resolve_cluster(&v, &mut est, "c", &all[..2], None);
        part.extend(&v, &mut est, "c", &all[2..4]).unwrap();
        // Where each deduction ends, kept over an extension, is where it ends resolving all.
        let four = resolve_cluster(&v, &mut Estimator::new(), "c", &all[..4], None);
        assert!(four.reaches.as_ref().is_some_and(|r| r.len() == 4));
        assert_eq!(part.reaches, four.reaches);
        part.extend(&v, &mut est, "c", &all[4..]).unwrap();
        assert_eq!(part.ranked, whole.ranked);
        assert!(part.assumed_ids().eq(whole.assumed_ids()));
        assert_eq!(part.reaches, whole.reaches);
        // 8 GPUs, 2 per reservation: four admitted, two conflicted.
        assert_eq!(part.assumed.len(), 4);
        let before = part.ranked.clone();
        assert!(
            part.extend(&v, &mut est, "c", &[res("a0", 0, 1, &w)])
                .is_err()
        );
        assert!(
            part.extend(&v, &mut est, "c", &[res("z9", 5, 1, &w)])
                .is_err(),
            "a higher priority ranks first"
        );
        assert!(
            part.extend(
                &v,
                &mut est,
                "c",
                &[res("z1", 0, 1, &w), res("z0", 0, 1, &w)]
            )
            .is_err(),
            "out of order among themselves"
        );
        assert_eq!(part.ranked, before);
    }

    #[test]
    fn dra_reservations_hold_devices_and_priority_decides() {
        let v = dra_view();
        let w = dra_workload("w", 1);
        // Both want the last 8 GPUs; the higher priority one wins whatever the ids.
        let input = [res("a", 100, 8, &w), res("b", 200, 8, &w)];
        for order in [input.to_vec(), input.iter().rev().cloned().collect()] {
            let r = resolve(&v, &mut Estimator::new(), &order);
            assert_eq!(r.admission("b"), Some(&Admission::Admitted));
            assert_eq!(
                r.admission("a"),
                Some(&Admission::Conflicted {
                    winner: Some("b".into()),
                    available: 0,
                    reason: None
                })
            );
            assert!(r.assumed().iter().all(|a| a.claims.is_some()));
            assert_eq!(dra_gpus_left(&v, &r), 0);
        }
        // 8 against 6: the 6 win by priority, the 8 see the 2 left.
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[res("big", 100, 8, &w), res("small", 200, 6, &w)],
        );
        assert_eq!(r.admission("small"), Some(&Admission::Admitted));
        assert_eq!(
            r.admission("big"),
            Some(&Admission::Conflicted {
                winner: Some("small".into()),
                available: 2,
                reason: None
            })
        );
        assert_eq!(dra_gpus_left(&v, &r), 2);
        // Devices per replica count: 3 x 2 GPUs leave 2, so 2 x 1 GPU still fit.
        let two = dra_workload("two", 2);
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[res("x", 0, 3, &two), res("y", 0, 3, &w), res("z", 0, 2, &w)],
        );
        assert_eq!(r.admission("x"), Some(&Admission::Admitted));
        assert!(matches!(
            r.admission("y"),
            Some(Admission::Conflicted { winner: Some(win), available: 2, .. }) if &**win == "x"
        ));
        assert_eq!(r.admission("z"), Some(&Admission::Admitted));
        assert_eq!(dra_gpus_left(&v, &r), 0);
    }

    #[test]
    fn equal_priority_is_decided_by_id_whatever_the_input_order() {
        let v = view();
        let w = workload("w", 1);
        let a = res("r1-1", 0, 8, &w);
        let b = res("r2-1", 0, 8, &w);
        for input in [vec![a.clone(), b.clone()], vec![b.clone(), a.clone()]] {
            let r = resolve(&v, &mut Estimator::new(), &input);
            assert_eq!(r.admission("r1-1"), Some(&Admission::Admitted));
            assert_eq!(
                r.admission("r2-1"),
                Some(&Admission::Conflicted {
                    winner: Some("r1-1".into()),
                    available: 0,
                    reason: None
                })
            );
            assert_eq!(gpus_left(&v, &r), 0);
        }
    }

    #[test]
    fn priority_beats_id_and_the_loser_is_not_deducted() {
        let v = view();
        let w = workload("w", 1);
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[res("a", 100, 8, &w), res("b", 200, 6, &w)],
        );
        assert_eq!(r.admission("b"), Some(&Admission::Admitted));
        assert_eq!(
            r.admission("a"),
            Some(&Admission::Conflicted {
                winner: Some("b".into()),
                available: 2,
                reason: None
            })
        );
        assert_eq!(gpus_left(&v, &r), 2);
        // Only the admitted one is deducted, and it is named.
        assert_eq!(r.assumed_ids(), ["b"]);
        assert_eq!(r.assumed().len(), 1);
    }

    #[test]
    fn partial_fit_is_a_conflict_but_later_smaller_ones_still_fit() {
        let v = view();
        let two = workload("two", 2);
        let one = workload("one", 1);
        // 8 GPUs: "a" takes 3 × 2 = 6; "b" wants 2 × 2 = 4 (only 2 left): conflicted;
        // "c" wants 2 × 1 = 2: admitted.
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[
                res("a", 0, 3, &two),
                res("b", 0, 2, &two),
                res("c", 0, 2, &one),
            ],
        );
        assert_eq!(r.admission("a"), Some(&Admission::Admitted));
        assert!(matches!(
            r.admission("b"),
            Some(Admission::Conflicted { winner: Some(w), available: 1, .. }) if &**w == "a"
        ));
        assert_eq!(r.admission("c"), Some(&Admission::Admitted));
        assert_eq!(gpus_left(&v, &r), 0);
    }

    #[test]
    fn satisfied_reservations_hold_nothing_and_unknown_clusters_conflict() {
        let v = view();
        let w = workload("w", 1);
        let mut gone = res("x", 0, 0, &w);
        gone.replicas = 0;
        let mut elsewhere = res("y", 0, 1, &w);
        elsewhere.cluster = "nowhere".into();
        let r = resolve(
            &v,
            &mut Estimator::new(),
            &[gone, elsewhere, res("z", 0, 3, &w)],
        );
        assert_eq!(r.admission("x"), Some(&Admission::Admitted));
        assert_eq!(r.admission("z"), Some(&Admission::Admitted));
        assert!(matches!(
            r.admission("y"),
            Some(Admission::Conflicted {
                reason: Some(_),
                ..
            })
        ));
        assert_eq!(gpus_left(&v, &r), 5);
    }
}
