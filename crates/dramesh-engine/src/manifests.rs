//! The `dramesh allocate` contract: manifests in, one JSON report out.
//!
//! Inputs are DeviceClasses, ResourceSlices, Nodes, DeviceTaintRules and ResourceClaims. A
//! ResourceClaim with `status.allocation` is an existing allocation (its devices are in use);
//! every other ResourceClaim belongs to the one pod being placed, in input order. Other kinds
//! are ignored. The node's labels come from its Node object; without one the node has only
//! its name.
//!
//! What the API server would refuse is an [`InputError`] (naming the object and field):
//! malformed quantities, a request with neither or both of `exactly`/`firstAvailable`,
//! duplicate request names, bad counts or modes, a CEL selector that does not compile.
//! What Kubernetes only discovers while scheduling (unknown class, CEL runtime error, too many
//! devices, ...) is the report's `error`.
//!
//! Report JSON: `{"node", "allocated", "reason"?, "error"?, "claims": [{"namespace", "name",
//! "allocation"}]}`. `reason` is present when the claims do not fit on the node (including an
//! exhausted search budget), `error` when the pod fails as a whole; both are omitted
//! otherwise. `claims` lists the allocations (empty unless `allocated`).

use std::collections::HashSet;
use std::fmt;

use dramesh_model::k8s;
use dramesh_model::{ClusterObject, Loaded, Manifest, Quantity};

use crate::inventory::{Inventory, InventoryError};
use crate::state::AllocatedState;
use crate::{Options, Outcome, allocate};
use dramesh_model::nodesel::NodeInfo;

/// Input that Kubernetes' API validation would reject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputError {
    /// Where the object came from (file and document), when known.
    pub source: Option<String>,
    /// `Kind name` or `Kind namespace/name`.
    pub object: String,
    /// Field path, e.g. `spec.devices.requests[0].exactly.count`.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(s) = &self.source {
            write!(f, "{s}: ")?;
        }
        write!(f, "{}: field {}: {}", self.object, self.field, self.message)
    }
}

impl std::error::Error for InputError {}

/// One allocated claim of the report.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ClaimReport {
    /// Claim namespace.
    pub namespace: String,
    /// Claim name.
    pub name: String,
    /// The claim's `status.allocation`.
    pub allocation: k8s::AllocationResult,
}

/// The `dramesh allocate` result.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AllocateReport {
    /// The node allocated on.
    pub node: String,
    /// True when every claim was allocated.
    pub allocated: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Why the pod does not fit on this node.
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Why the pod cannot be scheduled anywhere as it is.
    pub error: Option<String>,
    /// The search gave up at its budget: whether the pod fits is unknown (not "no fit").
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unknown: bool,
    /// The allocated claims, in input order.
    pub claims: Vec<ClaimReport>,
}

fn from_inventory(source: &str, e: InventoryError) -> InputError {
    InputError {
        source: Some(source.to_string()),
        object: e.object,
        field: e.field,
        message: e.message,
    }
}

/// Allocates the pending claims in `loaded` on node `node`.
pub fn allocate_manifests(
    loaded: &[Loaded],
    node: &str,
    opts: &Options,
) -> Result<AllocateReport, InputError> {
    let mut inv = Inventory::new();
    let mut node_info = NodeInfo::named(node);
    let mut allocated = Vec::new();
    let mut pending = Vec::new();
    for l in loaded {
        let Manifest::Object(obj) = &l.manifest else {
            continue;
        };
        let source = l.source.to_string();
        match obj {
            ClusterObject::ResourceSlice(s) => inv
                .upsert_slice(s)
                .map_err(|e| from_inventory(&source, e))?,
            ClusterObject::DeviceClass(c) => {
                validate_class(&inv, c).map_err(|mut e| {
                    e.source = Some(source.clone());
                    e
                })?;
                inv.upsert_class(c)
                    .map_err(|e| from_inventory(&source, e))?;
            }
            ClusterObject::DeviceTaintRule(r) => inv
                .upsert_taint_rule(r)
                .map_err(|e| from_inventory(&source, e))?,
            ClusterObject::Node(n) if n.metadata.name.as_deref() == Some(node) => {
                node_info = NodeInfo::from_node(n);
            }
            ClusterObject::ResourceClaim(c) => {
                if c.status
                    .as_ref()
                    .and_then(|s| s.allocation.as_ref())
                    .is_some()
                {
                    allocated.push(c.clone());
                } else {
                    pending.push((c.clone(), source));
                }
            }
            _ => {}
        }
    }
    for (c, source) in &pending {
        validate_claim(&inv, c).map_err(|mut e| {
            e.source = Some(source.clone());
            e
        })?;
    }
    let state = AllocatedState::from_claims(allocated.iter().map(|c| &**c));
    let claims: Vec<&k8s::ResourceClaim> = pending.iter().map(|(c, _)| &**c).collect();
    let outcome = allocate(&inv, &state, &node_info, &claims, opts);
    let mut report = AllocateReport {
        node: node.to_string(),
        allocated: false,
        reason: None,
        error: None,
        unknown: false,
        claims: Vec::new(),
    };
    match outcome {
        Outcome::Allocated(results) => {
            report.allocated = true;
            report.claims = claims
                .iter()
                .zip(results)
                .map(|(c, allocation)| ClaimReport {
                    namespace: c
                        .metadata
                        .namespace
                        .clone()
                        .unwrap_or_else(|| "default".to_string()),
                    name: c.metadata.name.clone().unwrap_or_default(),
                    allocation,
                })
                .collect();
        }
        Outcome::Unsatisfiable { reason } => report.reason = Some(reason),
        Outcome::Error(e) => report.error = Some(e.to_string()),
        Outcome::BudgetExhausted { steps } => {
            report.unknown = true;
            report.reason = Some(format!(
                "search budget exhausted after {steps} steps without finding an allocation"
            ))
        }
    }
    Ok(report)
}

fn err(object: &str, field: String, message: impl Into<String>) -> InputError {
    InputError {
        source: None,
        object: object.to_string(),
        field,
        message: message.into(),
    }
}

fn validate_selectors(
    inv: &Inventory,
    object: &str,
    field: &str,
    selectors: Option<&Vec<k8s::DeviceSelector>>,
) -> Result<(), InputError> {
    for (i, s) in selectors.into_iter().flatten().enumerate() {
        let Some(cel) = &s.cel else {
            return Err(err(object, format!("{field}[{i}].cel"), "Required value"));
        };
        if let Err(e) = inv.compile_cached(&cel.expression) {
            return Err(err(
                object,
                format!("{field}[{i}].cel.expression"),
                format!("compilation failed: {e}"),
            ));
        }
    }
    Ok(())
}

fn validate_class(inv: &Inventory, c: &k8s::DeviceClass) -> Result<(), InputError> {
    let object = format!(
        "DeviceClass {}",
        c.metadata.name.as_deref().unwrap_or_default()
    );
    validate_selectors(inv, &object, "spec.selectors", c.spec.selectors.as_ref())
}

fn validate_mode(
    object: &str,
    field: &str,
    mode: Option<&str>,
    count: Option<i64>,
) -> Result<(), InputError> {
    match mode.unwrap_or("") {
        "" | "ExactCount" => {
            if let Some(n) = count
                && n < 1
            {
                return Err(err(
                    object,
                    format!("{field}.count"),
                    format!("must be greater than zero, got {n}"),
                ));
            }
        }
        "All" => {
            if count.is_some_and(|n| n != 0) {
                return Err(err(
                    object,
                    format!("{field}.count"),
                    "must not be set when allocationMode is All",
                ));
            }
        }
        other => {
            return Err(err(
                object,
                format!("{field}.allocationMode"),
                format!(
                    "unsupported count mode {other} (supported values: \"All\", \"ExactCount\")"
                ),
            ));
        }
    }
    Ok(())
}

fn validate_capacity(
    object: &str,
    field: &str,
    cap: Option<&k8s::CapacityRequirements>,
) -> Result<(), InputError> {
    for (name, q) in cap.and_then(|c| c.requests.as_ref()).into_iter().flatten() {
        match Quantity::parse(&q.0) {
            Ok(v) if v.nanos() < 0 => {
                return Err(err(
                    object,
                    format!("{field}.capacity.requests[{name}]"),
                    "must not be negative",
                ));
            }
            Ok(_) => {}
            Err(e) => {
                return Err(err(
                    object,
                    format!("{field}.capacity.requests[{name}]"),
                    e.to_string(),
                ));
            }
        }
    }
    Ok(())
}

fn validate_claim(inv: &Inventory, c: &k8s::ResourceClaim) -> Result<(), InputError> {
    let object = format!(
        "ResourceClaim {}/{}",
        c.metadata.namespace.as_deref().unwrap_or("default"),
        c.metadata.name.as_deref().unwrap_or_default()
    );
    let requests = c
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default();
    let mut names = HashSet::new();
    let mut known: HashSet<String> = HashSet::new();
    for (i, r) in requests.iter().enumerate() {
        let field = format!("spec.devices.requests[{i}]");
        if r.name.is_empty() {
            return Err(err(&object, format!("{field}.name"), "Required value"));
        }
        if !names.insert(r.name.as_str()) {
            return Err(err(
                &object,
                format!("{field}.name"),
                format!("Duplicate value: {:?}", r.name),
            ));
        }
        known.insert(r.name.clone());
        let subs = r.first_available.as_deref().unwrap_or_default();
        match (&r.exactly, subs.is_empty()) {
            (Some(_), false) => {
                return Err(err(
                    &object,
                    field,
                    "exactly one of exactly or firstAvailable must be set, not both",
                ));
            }
            (None, true) => {
                return Err(err(
                    &object,
                    field,
                    "exactly one of exactly or firstAvailable must be set",
                ));
            }
            (Some(ex), true) => {
                let f = format!("{field}.exactly");
                if ex.device_class_name.is_empty() {
                    return Err(err(
                        &object,
                        format!("{f}.deviceClassName"),
                        "Required value: missing device class name",
                    ));
                }
                validate_mode(&object, &f, ex.allocation_mode.as_deref(), ex.count)?;
                validate_selectors(
                    inv,
                    &object,
                    &format!("{f}.selectors"),
                    ex.selectors.as_ref(),
                )?;
                validate_capacity(&object, &f, ex.capacity.as_ref())?;
            }
            (None, false) => {
                if subs.len() > 8 {
                    return Err(err(
                        &object,
                        format!("{field}.firstAvailable"),
                        format!("Too many: {} must have at most 8 items", subs.len()),
                    ));
                }
                let mut sub_names = HashSet::new();
                for (j, s) in subs.iter().enumerate() {
                    let f = format!("{field}.firstAvailable[{j}]");
                    if s.name.is_empty() {
                        return Err(err(&object, format!("{f}.name"), "Required value"));
                    }
                    if !sub_names.insert(s.name.as_str()) {
                        return Err(err(
                            &object,
                            format!("{f}.name"),
                            format!("Duplicate value: {:?}", s.name),
                        ));
                    }
                    known.insert(format!("{}/{}", r.name, s.name));
                    if s.device_class_name.is_empty() {
                        return Err(err(
                            &object,
                            format!("{f}.deviceClassName"),
                            "Required value: missing device class name",
                        ));
                    }
                    validate_mode(&object, &f, s.allocation_mode.as_deref(), s.count)?;
                    validate_selectors(
                        inv,
                        &object,
                        &format!("{f}.selectors"),
                        s.selectors.as_ref(),
                    )?;
                    validate_capacity(&object, &f, s.capacity.as_ref())?;
                }
            }
        }
    }
    for (i, con) in c
        .spec
        .devices
        .iter()
        .flat_map(|d| d.constraints.iter().flatten())
        .enumerate()
    {
        let field = format!("spec.devices.constraints[{i}]");
        let attr = match (&con.match_attribute, &con.distinct_attribute) {
            (Some(a), None) | (None, Some(a)) => a,
            _ => {
                return Err(err(
                    &object,
                    field,
                    "exactly one of matchAttribute or distinctAttribute must be set",
                ));
            }
        };
        if !attr.contains('/') {
            return Err(err(
                &object,
                field,
                format!("{attr:?} must be a fully qualified name (domain/identifier)"),
            ));
        }
        for (j, r) in con.requests.iter().flatten().enumerate() {
            if !known.contains(r) {
                return Err(err(
                    &object,
                    format!("{field}.requests[{j}]"),
                    format!("{r:?} does not name a request or subrequest of this claim"),
                ));
            }
        }
    }
    Ok(())
}
