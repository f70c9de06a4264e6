//! Consumable capacity (KEP-5075): how much of each device capacity a request consumes, and
//! whether that fits next to what is already consumed.
//!
//! Arithmetic follows Kubernetes 1.34-1.36: `validRange` step rounding works on whole units
//! rounded up (`Quantity.Value()`); the fractional milli-unit path only exists from 1.37.
//! Capacity names in requests are resolved with the device's driver as default domain, so
//! `bw` and `<driver>/bw` name the same capacity.

use std::collections::HashMap;

use dramesh_model::quantity::Format;
use dramesh_model::{QualifiedName, Quantity};

use crate::inventory::{Cap, Device, Policy};

const NANO: i128 = 1_000_000_000;

fn ceil_units(q: Quantity) -> i128 {
    q.units_ceil()
}

/// The amount a request consumes from one capacity (requested value rounded by the policy,
/// or the policy default, or the whole capacity when nothing is requested).
pub(crate) fn consumed_amount(requested: Option<Quantity>, cap: &Cap) -> Quantity {
    let Some(req) = requested else {
        return cap
            .policy
            .as_ref()
            .and_then(|p| p.default)
            .unwrap_or(cap.value);
    };
    let Some(policy) = &cap.policy else {
        return req;
    };
    if let Some(range) = &policy.range {
        if req < range.min {
            return range.min;
        }
        let Some(step) = range.step else {
            return req;
        };
        let (r, m, s) = (
            ceil_units(req),
            ceil_units(range.min),
            ceil_units(step).max(1),
        );
        let added = r - m;
        let n = added / s + i128::from(added % s != 0);
        let units = m.saturating_add(s.saturating_mul(n));
        let fmt = if step.format() == Format::BinarySi {
            Format::BinarySi
        } else {
            Format::DecimalSi
        };
        return Quantity::from_nanos(units.saturating_mul(NANO), fmt);
    }
    if !policy.valid_values.is_empty() {
        return policy
            .valid_values
            .iter()
            .find(|v| req <= **v)
            .copied()
            .unwrap_or(req);
    }
    req
}

/// True when a (rounded) consumption is not allowed by the policy.
pub(crate) fn violates_policy(consumed: Quantity, policy: Option<&Policy>) -> bool {
    let Some(p) = policy else {
        return false;
    };
    if p.default == Some(consumed) {
        return false;
    }
    if let Some(range) = &p.range {
        if range.max.is_some_and(|max| consumed > max) {
            return true;
        }
        if let Some(step) = range.step {
            let s = ceil_units(step).max(1);
            return (ceil_units(consumed) - ceil_units(range.min)) % s != 0;
        }
        return false;
    }
    if !p.valid_values.is_empty() {
        return !p.valid_values.contains(&consumed);
    }
    false
}

/// Consumption of every capacity of `dev` for these capacity requests, if the device can
/// take it next to `already` (allocated claims) and `allocating` (this run). `None` means
/// "skip this device": a requested capacity the device lacks, a policy violation, or not
/// enough left.
pub(crate) fn check(
    dev: &Device,
    driver: &str,
    requests: &[(String, Quantity)],
    already: Option<&HashMap<QualifiedName, i128>>,
    allocating: Option<&HashMap<QualifiedName, i128>>,
) -> Option<Vec<Quantity>> {
    let mut resolved: Vec<Option<Quantity>> = vec![None; dev.capacity.len()];
    for (name, q) in requests {
        let qn = QualifiedName::parse(name, driver);
        let idx = dev.capacity.iter().position(|c| c.qn == qn)?;
        resolved[idx] = Some(*q);
    }
    let mut out = Vec::with_capacity(dev.capacity.len());
    for (cap, req) in dev.capacity.iter().zip(resolved) {
        let consumed = consumed_amount(req, cap);
        if violates_policy(consumed, cap.policy.as_ref()) {
            return None;
        }
        let prior = already.and_then(|m| m.get(&cap.qn)).copied().unwrap_or(0)
            + allocating
                .and_then(|m| m.get(&cap.qn))
                .copied()
                .unwrap_or(0);
        if prior + consumed.nanos() > cap.value.nanos() {
            return None;
        }
        out.push(consumed);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Range;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    fn cap(value: &str, policy: Option<Policy>) -> Cap {
        Cap {
            raw: "bw".into(),
            qn: QualifiedName::parse("bw", "drv"),
            value: q(value),
            policy,
        }
    }

    fn range(default: &str, min: &str, step: Option<&str>, max: Option<&str>) -> Policy {
        Policy {
            default: Some(q(default)),
            valid_values: vec![],
            range: Some(Range {
                min: q(min),
                max: max.map(q),
                step: step.map(q),
            }),
        }
    }

    #[test]
    fn range_rounding() {
        let c = cap("10", Some(range("2", "2", Some("2"), Some("4"))));
        assert_eq!(consumed_amount(Some(q("1")), &c), q("2"), "below min");
        assert_eq!(consumed_amount(Some(q("3")), &c), q("4"), "step rounding");
        assert_eq!(consumed_amount(None, &c), q("2"), "default");
        assert!(violates_policy(q("6"), c.policy.as_ref()), "over max");
        assert!(!violates_policy(q("4"), c.policy.as_ref()));
        let binary = cap("10Gi", Some(range("1Gi", "1Gi", Some("1Gi"), None)));
        assert_eq!(
            consumed_amount(Some(q("1.5Gi")), &binary).to_string(),
            "2Gi",
            "keeps the step's suffix family"
        );
    }

    #[test]
    fn valid_values_rounding() {
        let p = Policy {
            default: Some(q("1")),
            valid_values: vec![q("1"), q("3")],
            range: None,
        };
        let c = cap("4", Some(p));
        assert_eq!(consumed_amount(Some(q("2")), &c), q("3"));
        assert_eq!(consumed_amount(Some(q("5")), &c), q("5"));
        assert!(violates_policy(q("5"), c.policy.as_ref()));
        assert_eq!(
            consumed_amount(None, &cap("7", None)),
            q("7"),
            "whole capacity"
        );
    }
}
