//! The workload being estimated, placed or used as a preemptor: one Deployment,
//! StatefulSet, Job or Pod, reduced to what one replica needs (requests, node claim,
//! ResourceClaimTemplates, shared claims), its replica count, priority and identity.
//!
//! Guarantees: every ResourceClaimTemplate the pod template references is resolved, either
//! from the templates given with it or, as Karmada's `resourceClaimRefs` are, in each member
//! cluster ([`Workload::claim_refs`], [`Workload::in_cluster`]); a template found nowhere is
//! an error naming it. The fingerprint changes whenever anything that affects per-node fit
//! changes.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;

use dramesh_model::k8s::{PodSpec, PodTemplateSpec, PriorityClass, ResourceClaimTemplate};
use dramesh_model::{Manifest, load, nodesel};

use crate::filter::NodeClaim;
use crate::policy::{Policy, PolicyError};
use crate::resources::{ResList, pod_requests};

/// Why a workload could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A manifest cannot be read.
    #[error(transparent)]
    Load(Box<load::LoadError>),
    /// The files hold no workload.
    #[error("no Deployment, StatefulSet, Job or Pod found in the workload files")]
    NoWorkload,
    /// The files hold more than one workload.
    #[error("more than one workload in the files: {first} and {second}")]
    Ambiguous {
        /// The first workload found.
        first: String,
        /// The second.
        second: String,
    },
    /// A referenced ResourceClaimTemplate is not in the files.
    #[error(
        "{workload}: pod template references ResourceClaimTemplate {namespace}/{name}, which was not provided"
    )]
    MissingTemplate {
        /// `Kind namespace/name` of the workload.
        workload: String,
        /// Namespace of the template.
        namespace: String,
        /// Name of the template.
        name: String,
    },
    /// The named PriorityClass is not in the files.
    #[error(
        "{workload}: spec.template.spec.priorityClassName {name:?} names no PriorityClass in the files"
    )]
    MissingPriorityClass {
        /// `Kind namespace/name` of the workload.
        workload: String,
        /// The PriorityClass name.
        name: String,
    },
    /// A field of the workload is invalid.
    #[error("{workload}: {message}")]
    Invalid {
        /// `Kind namespace/name` of the workload.
        workload: String,
        /// The field path and what is wrong.
        message: String,
    },
    /// The PropagationPolicy in the files is invalid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl From<load::LoadError> for WorkloadError {
    fn from(e: load::LoadError) -> Self {
        WorkloadError::Load(Box::new(e))
    }
}

/// A claim of the pod named by reference and resolved in each member cluster: Karmada's
/// `ResourceClaimReference` (`work/v1alpha2` `ReplicaRequirements.resourceClaimRefs`, from the
/// DRA estimator design of karmada-io/karmada PR 7389), with the pod claim it stands for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClaimRef {
    /// `resourceClaimTemplateName`: every replica gets a fresh claim from the
    /// ResourceClaimTemplate of this name in the workload's namespace of the cluster.
    Template {
        /// The pod claim (`spec.resourceClaims[].name`) the reference stands for.
        pod_claim: String,
        /// The template's name.
        name: String,
    },
    /// `resourceClaimName`: an existing ResourceClaim of the workload's namespace that every
    /// replica shares. It must exist in the cluster; it is allocated once, not per replica.
    Claim(String),
}

impl ClaimRef {
    /// The `i`-th entry of Karmada's `resourceClaimRefs`, as its Go type carries it: the
    /// template name wins when both are set (Karmada's extraction rule); `None` when neither
    /// is. Its pod claim is `ref-<i>` (the reference carries none).
    pub fn from_reference(i: usize, template_name: &str, claim_name: &str) -> Option<ClaimRef> {
        if !template_name.is_empty() {
            Some(ClaimRef::Template {
                pod_claim: format!("ref-{i}"),
                name: template_name.to_string(),
            })
        } else if !claim_name.is_empty() {
            Some(ClaimRef::Claim(claim_name.to_string()))
        } else {
            None
        }
    }
}

impl ClaimRef {
    /// Karmada's `resourceClaimRefs` list, each entry as (`resourceClaimTemplateName`,
    /// `resourceClaimName`), by [`ClaimRef::from_reference`]. Err names the entry at fault
    /// (`None`: the list, longer than [`MAX_CLAIM_REFS`]) and what is wrong, for the caller to
    /// put its field path on.
    pub fn from_references<'a>(
        refs: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Vec<ClaimRef>, (Option<usize>, String)> {
        if refs.len() > MAX_CLAIM_REFS {
            return Err((
                None,
                format!(
                    "{} entries, more than the {MAX_CLAIM_REFS} claims a pod may have",
                    refs.len()
                ),
            ));
        }
        refs.enumerate()
            .map(|(i, (template, claim))| {
                ClaimRef::from_reference(i, template, claim).ok_or_else(|| {
                    (
                        Some(i),
                        "names neither a resourceClaimTemplateName nor a resourceClaimName"
                            .to_string(),
                    )
                })
            })
            .collect()
    }
}

/// Most claim references one workload may carry: Kubernetes' limit of claims per pod.
pub const MAX_CLAIM_REFS: usize = 32;

/// How [`Workload::from_pod_spec_with`] finds the ResourceClaimTemplates a pod spec names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateSource {
    /// Only among the templates given: a name missing there is
    /// [`WorkloadError::MissingTemplate`] (request field 100, whose templates have
    /// made-up names).
    Given,
    /// In each member cluster, as Karmada's `resourceClaimRefs` are: the pod's claims
    /// become [`Workload::claim_refs`]; the given templates, when they include every name,
    /// are the fallback for clusters that publish no ResourceClaimTemplates (see
    /// [`Workload::in_cluster`]).
    Cluster,
}

/// One ResourceClaimTemplate reference of the pod template.
#[derive(Debug, Clone)]
pub struct TemplateRef {
    /// `spec.resourceClaims[].name` in the pod.
    pub pod_claim: String,
    /// The template.
    pub template: Arc<ResourceClaimTemplate>,
}

/// What one replica of a workload needs, and who it is.
#[derive(Debug, Clone)]
pub struct Workload {
    /// `Deployment`, `StatefulSet`, `Job` or `Pod`.
    pub kind: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `metadata.uid`, when known.
    pub uid: Option<String>,
    /// Replicas (`spec.replicas`, or `parallelism` for Jobs).
    pub replicas: i64,
    /// The pod template's spec.
    pub pod_spec: Arc<PodSpec>,
    /// Requests of one replica (containers and overhead, as the scheduler counts them).
    pub requests: ResList,
    /// What one replica requires of a node.
    pub node_claim: NodeClaim,
    /// ResourceClaimTemplates: each replica gets its own claims.
    pub templates: Vec<TemplateRef>,
    /// `resourceClaimName` references: claims shared by all replicas.
    pub shared_claims: Vec<String>,
    /// Claims resolved in each member cluster (Karmada's `resourceClaimRefs`); when not
    /// empty, [`Workload::in_cluster`] decides per cluster whether they or `templates` and
    /// `shared_claims` apply.
    pub claim_refs: Vec<ClaimRef>,
    /// Pod priority.
    pub priority: i32,
    /// True unless the PriorityClass says `preemptionPolicy: Never`.
    pub preempt_lower_priority: bool,
    /// A PropagationPolicy found with the workload files, if any.
    pub policy: Option<Policy>,
    /// Hash of everything that affects per-node fit (cache key).
    pub fingerprint: u64,
}

impl Workload {
    /// `Kind namespace/name`.
    pub fn id(&self) -> String {
        format!("{} {}/{}", self.kind, self.namespace, self.name)
    }

    /// True when replicas need DRA devices.
    pub fn needs_devices(&self) -> bool {
        !self.templates.is_empty() || !self.shared_claims.is_empty() || !self.claim_refs.is_empty()
    }

    /// The workload as it is estimated in one member cluster, or `None` when that is the
    /// workload itself. The rule for [`Workload::claim_refs`]:
    ///
    /// * no references: the workload's own claims;
    /// * the cluster publishes ResourceClaimTemplates (`publishes`), or the workload has no
    ///   claims of its own: the references, each template looked up by `lookup(namespace,
    ///   name)` (the template and a hash of its spec) in the workload's namespace; one that is
    ///   missing is an error naming it (`ResourceClaimTemplate ml/gpu not found in cluster
    ///   c1`), which answers 0 for the cluster. Shared claims are checked where devices are
    ///   fitted (a missing one is `ResourceClaim ml/x not found in cluster c1`);
    /// * the cluster publishes none (an agent that does not watch them): the workload's own
    ///   claims, the templates the caller gave (Karmada's own copies, request field 100).
    pub fn in_cluster(
        &self,
        cluster: &str,
        publishes: bool,
        lookup: impl Fn(&str, &str) -> Option<(Arc<ResourceClaimTemplate>, u64)>,
    ) -> Result<Option<Workload>, String> {
        let own = !self.templates.is_empty() || !self.shared_claims.is_empty();
        if self.claim_refs.is_empty() || (own && !publishes) {
            return Ok(None);
        }
        let mut h = DefaultHasher::new();
        self.fingerprint.hash(&mut h);
        let mut templates = Vec::new();
        let mut shared = Vec::new();
        for r in &self.claim_refs {
            match r {
                ClaimRef::Template { pod_claim, name } => {
                    let (template, spec_hash) = lookup(&self.namespace, name).ok_or_else(|| {
                        format!(
                            "ResourceClaimTemplate {}/{name} not found in cluster {cluster}",
                            self.namespace
                        )
                    })?;
                    (pod_claim, spec_hash).hash(&mut h);
                    templates.push(TemplateRef {
                        pod_claim: pod_claim.clone(),
                        template,
                    });
                }
                ClaimRef::Claim(name) => {
                    name.hash(&mut h);
                    shared.push(name.clone());
                }
            }
        }
        Ok(Some(Workload {
            templates,
            shared_claims: shared,
            claim_refs: Vec::new(),
            fingerprint: h.finish(),
            ..self.clone()
        }))
    }

    /// Builds a workload from decoded manifests.
    pub fn from_manifests(manifests: &[Manifest]) -> Result<Workload, WorkloadError> {
        let mut found: Option<(String, String, String, Option<String>, i64, PodTemplateSpec)> =
            None;
        let mut templates: HashMap<(String, String), Arc<ResourceClaimTemplate>> = HashMap::new();
        let mut classes: HashMap<String, Arc<PriorityClass>> = HashMap::new();
        let mut policy = None;
        for m in manifests {
            let candidate = match m {
                Manifest::Deployment(d) => Some((
                    "Deployment",
                    &d.metadata,
                    d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1) as i64,
                    d.spec.as_ref().map(|s| s.template.clone()),
                )),
                Manifest::StatefulSet(s) => Some((
                    "StatefulSet",
                    &s.metadata,
                    s.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1) as i64,
                    s.spec.as_ref().map(|s| s.template.clone()),
                )),
                Manifest::Job(j) => Some((
                    "Job",
                    &j.metadata,
                    j.spec.as_ref().and_then(|s| s.parallelism).unwrap_or(1) as i64,
                    j.spec.as_ref().map(|s| s.template.clone()),
                )),
                Manifest::Object(dramesh_model::ClusterObject::Pod(p)) => Some((
                    "Pod",
                    &p.metadata,
                    1,
                    Some(PodTemplateSpec {
                        metadata: Some(p.metadata.clone()),
                        spec: p.spec.clone(),
                    }),
                )),
                Manifest::Object(dramesh_model::ClusterObject::ResourceClaimTemplate(t)) => {
                    let ns = t
                        .metadata
                        .namespace
                        .clone()
                        .unwrap_or_else(|| "default".into());
                    let name = t.metadata.name.clone().unwrap_or_default();
                    templates.insert((ns, name), t.clone());
                    None
                }
                Manifest::PriorityClass(pc) => {
                    classes.insert(pc.metadata.name.clone().unwrap_or_default(), pc.clone());
                    None
                }
                Manifest::Other { kind, value, .. }
                    if kind == "PropagationPolicy" || kind == "ClusterPropagationPolicy" =>
                {
                    if policy.is_none() {
                        policy = Some(Policy::from_value(value)?);
                    }
                    None
                }
                _ => None,
            };
            if let Some((kind, meta, replicas, template)) = candidate {
                let ns = meta.namespace.clone().unwrap_or_else(|| "default".into());
                let name = meta.name.clone().unwrap_or_default();
                let label = format!("{kind} {ns}/{name}");
                if let Some(f) = &found {
                    return Err(WorkloadError::Ambiguous {
                        first: format!("{} {}/{}", f.0, f.1, f.2),
                        second: label,
                    });
                }
                let template = template.ok_or_else(|| WorkloadError::Invalid {
                    workload: label.clone(),
                    message: "spec.template is missing".into(),
                })?;
                found = Some((
                    kind.to_string(),
                    ns,
                    name,
                    meta.uid.clone(),
                    replicas,
                    template,
                ));
            }
        }
        let (kind, namespace, name, uid, replicas, template) =
            found.ok_or(WorkloadError::NoWorkload)?;
        let label = format!("{kind} {namespace}/{name}");
        let spec = template.spec.ok_or_else(|| WorkloadError::Invalid {
            workload: label.clone(),
            message: "spec.template.spec is missing".into(),
        })?;
        let priority = match spec
            .priority_class_name
            .as_deref()
            .filter(|n| !n.is_empty())
        {
            Some(pcn) => match classes.get(pcn) {
                Some(pc) => (
                    pc.value.unwrap_or(0),
                    pc.preemption_policy.as_deref() != Some("Never"),
                ),
                None if spec.priority.is_some() => (spec.priority.unwrap_or(0), true),
                None => {
                    return Err(WorkloadError::MissingPriorityClass {
                        workload: label,
                        name: pcn.to_string(),
                    });
                }
            },
            None => (
                spec.priority.unwrap_or(0),
                spec.preemption_policy.as_deref() != Some("Never"),
            ),
        };
        // Users' files are held to what the API server would accept; queries from a scheduler
        // are matched as the scheduler does (a malformed term matches no node).
        if let Some(required) = spec
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|n| {
                n.required_during_scheduling_ignored_during_execution
                    .as_ref()
            })
        {
            nodesel::validate(required).map_err(|e| WorkloadError::Invalid {
                workload: label.clone(),
                message: format!(
                    "spec.template.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.{e}"
                ),
            })?;
        }
        let mut w = Workload::from_pod_spec_with(
            &kind,
            &namespace,
            &name,
            replicas,
            spec,
            &templates,
            TemplateSource::Cluster,
        )?;
        w.uid = uid;
        w.priority = priority.0;
        w.preempt_lower_priority = priority.1;
        w.policy = policy;
        Ok(w)
    }

    /// Builds a workload from a pod spec and the templates it references, which must all be
    /// given (keyed by namespace and name): [`TemplateSource::Given`].
    pub fn from_pod_spec(
        kind: &str,
        namespace: &str,
        name: &str,
        replicas: i64,
        spec: PodSpec,
        templates: &HashMap<(String, String), Arc<ResourceClaimTemplate>>,
    ) -> Result<Workload, WorkloadError> {
        Workload::from_pod_spec_with(
            kind,
            namespace,
            name,
            replicas,
            spec,
            templates,
            TemplateSource::Given,
        )
    }

    /// Builds a workload from a pod spec, finding the templates it references as `source`
    /// says.
    pub fn from_pod_spec_with(
        kind: &str,
        namespace: &str,
        name: &str,
        replicas: i64,
        spec: PodSpec,
        templates: &HashMap<(String, String), Arc<ResourceClaimTemplate>>,
        source: TemplateSource,
    ) -> Result<Workload, WorkloadError> {
        let label = format!("{kind} {namespace}/{name}");
        let requests = pod_requests(&spec).map_err(|m| WorkloadError::Invalid {
            workload: label.clone(),
            message: format!("spec.template.spec.{m}"),
        })?;
        let mut refs = Vec::new();
        let mut shared = Vec::new();
        let mut claim_refs = Vec::new();
        let mut all_given = true;
        for rc in spec.resource_claims.iter().flatten() {
            // The template name wins when both are set, as in Karmada's extraction.
            if let Some(t) = &rc.resource_claim_template_name {
                claim_refs.push(ClaimRef::Template {
                    pod_claim: rc.name.clone(),
                    name: t.clone(),
                });
                match templates.get(&(namespace.to_string(), t.clone())) {
                    Some(tpl) => refs.push(TemplateRef {
                        pod_claim: rc.name.clone(),
                        template: tpl.clone(),
                    }),
                    None if source == TemplateSource::Cluster => all_given = false,
                    None => {
                        return Err(WorkloadError::MissingTemplate {
                            workload: label.clone(),
                            namespace: namespace.to_string(),
                            name: t.clone(),
                        });
                    }
                }
            } else if let Some(c) = &rc.resource_claim_name {
                claim_refs.push(ClaimRef::Claim(c.clone()));
                shared.push(c.clone());
            }
        }
        match source {
            TemplateSource::Given => claim_refs.clear(),
            // A fallback is all of the pod's claims or none of them.
            TemplateSource::Cluster if !all_given => {
                refs.clear();
                shared.clear();
            }
            TemplateSource::Cluster => {}
        }
        let affinity = spec
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|n| {
                n.required_during_scheduling_ignored_during_execution
                    .clone()
            });
        let node_claim = NodeClaim {
            node_selector: spec.node_selector.clone().unwrap_or_default(),
            affinity,
            tolerations: spec.tolerations.clone().unwrap_or_default(),
        };
        let mut w = Workload {
            kind: kind.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: None,
            replicas,
            pod_spec: Arc::new(spec),
            requests,
            node_claim,
            templates: refs,
            shared_claims: shared,
            claim_refs,
            priority: 0,
            preempt_lower_priority: true,
            policy: None,
            fingerprint: 0,
        };
        w.refresh_fingerprint();
        Ok(w)
    }

    /// Recomputes the fingerprint after fields were changed by hand.
    pub fn refresh_fingerprint(&mut self) {
        let mut h = DefaultHasher::new();
        self.namespace.hash(&mut h);
        self.requests.hash(&mut h);
        serde_json::to_string(&self.node_claim.affinity)
            .unwrap_or_default()
            .hash(&mut h);
        self.node_claim.node_selector.hash(&mut h);
        serde_json::to_string(&self.node_claim.tolerations)
            .unwrap_or_default()
            .hash(&mut h);
        for t in &self.templates {
            t.pod_claim.hash(&mut h);
            serde_json::to_string(&t.template.spec)
                .unwrap_or_default()
                .hash(&mut h);
        }
        self.shared_claims.hash(&mut h);
        self.claim_refs.hash(&mut h);
        self.fingerprint = h.finish();
    }

    /// Requests as a plain map, for output.
    pub fn requests_map(&self) -> BTreeMap<String, String> {
        self.requests.to_map()
    }
}

/// Loads a workload (and the ResourceClaimTemplates, PriorityClasses and an optional
/// PropagationPolicy next to it) from files or directories.
pub fn load_workload<P: AsRef<Path>>(paths: &[P]) -> Result<Workload, WorkloadError> {
    let loaded = load::load_paths(paths)?;
    let manifests: Vec<Manifest> = loaded.into_iter().map(|l| l.manifest).collect();
    Workload::from_manifests(&manifests)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn deployment(operator: &str, values: &str) -> Result<Workload, WorkloadError> {
        let yaml = format!(
            r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, namespace: default}}
spec:
  replicas: 2
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      containers: [{{name: c, image: x}}]
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
            - matchExpressions: [{{key: zone, operator: {operator}, values: {values}}}]
"#
        );
        let loaded = load::load_str(Path::new("web.yaml"), &yaml).expect("decodes");
        let manifests: Vec<Manifest> = loaded.into_iter().map(|l| l.manifest).collect();
        Workload::from_manifests(&manifests)
    }

    /// Users' files are held to what the API server accepts: a malformed required node
    /// affinity is an error naming the workload and the field.
    #[test]
    fn malformed_node_affinity_is_rejected_with_its_path() {
        assert!(deployment("NotIn", "[a]").is_ok());
        let err = deployment("NotIn", "[]").expect_err("NotIn needs values");
        assert_eq!(
            err.to_string(),
            "Deployment default/web: spec.template.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].values: for 'in', 'notin' operators, values set can't be empty"
        );
        assert!(deployment("Gt", "[ten]").is_err());
    }
}
