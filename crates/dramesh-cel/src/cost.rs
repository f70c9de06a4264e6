//! Static checks and worst-case cost estimation for selector expressions.
//!
//! `cel` 0.15 has no runtime cost accounting, so the bound is enforced before evaluation:
//!
//! 1. **Declarations** (what Kubernetes' type checker rejects): the only variable is `device`
//!    (plus comprehension variables), `device` has only the fields `driver`, `attributes`,
//!    `capacity` and `allowMultipleAllocations`, every called function must be one this
//!    environment declares, struct literals are rejected, and constant regular expressions
//!    given to `matches` must compile.
//! 2. **Result type**: an expression whose result is statically known not to be a bool
//!    (a literal, arithmetic, `size()`, ...) is rejected.
//! 3. **Depth**: the expression tree may be at most [`MAX_DEPTH`] levels deep, which bounds the
//!    interpreter's recursion (and so its stack use).
//! 4. **Cost**: an abstract interpretation computes, for every sub-expression, an upper bound on
//!    the size of its value (`Shape`) and on the work to evaluate it. Device data is bounded
//!    by `DeviceBounds` (Kubernetes validation limits by default: 32 attributes + capacities
//!    per device, strings of at most 64 bytes, domains of 63, ids of 32); literals by their
//!    text. Comprehensions multiply the per-iteration cost by the bound on the range's length,
//!    so nested loops over large lists are caught. The unit roughly follows cel-go's: 1 per
//!    operator, call, selection or iteration; 0.1 per byte for string work; 1 per element
//!    for list scans; 10 for a list literal and 30 for a map literal.
//!
//! The estimate is computed at compile time with the Kubernetes bounds, and again at
//! evaluation for a device that exceeds them (inventory from an unvalidated source), so no
//! evaluation runs whose bound exceeds the limit.
//!
//! # Differences from Kubernetes
//!
//! - Kubernetes counts the cost actually spent while evaluating (`cel.CostLimit`, 1,000,000)
//!   and aborts at the limit with a runtime error; the API server additionally rejects
//!   expressions whose *estimated* cost exceeds the limit. Here only the worst-case estimate
//!   is enforced: an expression is either rejected up front (`CompileError::TooCostly`, or an
//!   `EvalError` for an oversized device) or runs to completion. An expression Kubernetes
//!   would accept because its actual cost stays low on real devices, but whose worst case is
//!   over the limit, is rejected here (the API server's estimator rejects those too).
//! - The cost units approximate cel-go's but are not identical, so costs near the limit can
//!   differ; every real-world selector in the fixtures estimates below 100.
//! - Non-bool results and undeclared names are found by this checker rather than a full CEL
//!   type checker: a type error that depends on runtime types (e.g. `device.driver + 1`) is
//!   an evaluation error here but a compile error in Kubernetes.
//! - The regular-expression size limit is 1 MiB of compiled program (RE2 in Kubernetes has its
//!   own, different limit).

use std::rc::Rc;

use cel::IdedExpr;
use cel::common::ast::{EntryExpr, Expr, LiteralValue};
use dramesh_model::{AttrValue, QualifiedName, Quantity};

/// Maximum depth of the expression tree (after macro expansion, comprehensions counting as
/// three levels).
pub const MAX_DEPTH: u32 = 48;

/// Bounds on the device data a selector can see, used to size `device.*` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceBounds {
    /// Attributes plus capacities per device.
    pub entries: u64,
    pub driver_len: u64,
    pub domain_len: u64,
    pub id_len: u64,
    /// Longest string (or version string) attribute value.
    pub value_len: u64,
}

impl DeviceBounds {
    /// Kubernetes validation limits for a ResourceSlice device.
    pub(crate) const KUBERNETES: DeviceBounds = DeviceBounds {
        entries: 32,
        driver_len: 63,
        domain_len: 63,
        id_len: 32,
        value_len: 64,
    };

    pub(crate) fn of(
        driver: &str,
        attributes: &[(QualifiedName, AttrValue)],
        capacity: &[(QualifiedName, Quantity)],
    ) -> DeviceBounds {
        let names = attributes
            .iter()
            .map(|(n, _)| n)
            .chain(capacity.iter().map(|(n, _)| n));
        let mut b = DeviceBounds {
            entries: (attributes.len() + capacity.len()) as u64,
            driver_len: driver.len() as u64,
            domain_len: 0,
            id_len: 0,
            value_len: 0,
        };
        for n in names {
            b.domain_len = b.domain_len.max(n.domain.len() as u64);
            b.id_len = b.id_len.max(n.id.len() as u64);
        }
        for (_, v) in attributes {
            let len = match v {
                AttrValue::String(s) => s.len() as u64,
                AttrValue::Version(v) => v.to_string().len() as u64,
                AttrValue::Int(_) | AttrValue::Bool(_) => 0,
            };
            b.value_len = b.value_len.max(len);
        }
        b
    }

    /// True when every bound of `self` is within `limit`.
    pub(crate) fn within(&self, limit: &DeviceBounds) -> bool {
        self.entries <= limit.entries
            && self.driver_len <= limit.driver_len
            && self.domain_len <= limit.domain_len
            && self.id_len <= limit.id_len
            && self.value_len <= limit.value_len
    }

    pub(crate) fn max(&self, o: &DeviceBounds) -> DeviceBounds {
        DeviceBounds {
            entries: self.entries.max(o.entries),
            driver_len: self.driver_len.max(o.driver_len),
            domain_len: self.domain_len.max(o.domain_len),
            id_len: self.id_len.max(o.id_len),
            value_len: self.value_len.max(o.value_len),
        }
    }
}

/// What is statically known about a value's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bool,
    Int,
    Uint,
    Double,
    String,
    Bytes,
    Null,
    List,
    Map,
    Quantity,
    Semver,
    Device,
    Type,
    Optional,
    Dyn,
}

/// Upper bounds on a value: `len` is the number of elements/entries (list, map) or bytes
/// (string, bytes); `weight` bounds the value's total size including nested values, so every
/// part of a value is bounded by the whole's weight.
#[derive(Debug, Clone)]
struct Shape {
    kind: Kind,
    len: u64,
    weight: u64,
    /// List elements, map values or the optional's value, when known.
    elem: Option<Rc<Shape>>,
    /// Map keys, when known.
    key: Option<Rc<Shape>>,
}

impl Shape {
    fn scalar(kind: Kind) -> Shape {
        Shape {
            kind,
            len: 0,
            weight: 1,
            elem: None,
            key: None,
        }
    }
    fn string(len: u64) -> Shape {
        Shape {
            kind: Kind::String,
            len,
            weight: len.saturating_add(1),
            elem: None,
            key: None,
        }
    }
    /// A value of unknown type no bigger than `weight`.
    fn dyn_within(weight: u64) -> Shape {
        Shape {
            kind: Kind::Dyn,
            len: weight,
            weight,
            elem: None,
            key: None,
        }
    }
    fn elem(&self) -> Shape {
        self.elem
            .as_deref()
            .cloned()
            .unwrap_or_else(|| Shape::dyn_within(self.weight))
    }
    fn key(&self) -> Shape {
        self.key
            .as_deref()
            .cloned()
            .unwrap_or_else(|| Shape::dyn_within(self.weight))
    }
    /// A shape covering both `a` and `b`.
    fn join(a: &Shape, b: &Shape) -> Shape {
        let join_opt = |x: &Option<Rc<Shape>>, y: &Option<Rc<Shape>>| match (x, y) {
            (Some(x), Some(y)) => Some(Rc::new(Shape::join(x, y))),
            _ => None,
        };
        Shape {
            kind: if a.kind == b.kind { a.kind } else { Kind::Dyn },
            len: a.len.max(b.len),
            weight: a.weight.max(b.weight),
            elem: join_opt(&a.elem, &b.elem),
            key: join_opt(&a.key, &b.key),
        }
    }
}

/// A rejected expression: what is wrong and the node it is about.
#[derive(Debug, Clone)]
pub(crate) struct CheckError {
    pub message: String,
    pub expr_id: u64,
    /// The expression exceeds [`MAX_DEPTH`].
    pub too_deep: bool,
}

/// The result of a successful check.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Estimate {
    pub cost: u64,
    /// Interpreter recursion depth, comprehensions counting as three levels.
    pub depth: u32,
}

/// String work costs 0.1 per byte, rounded up.
fn str_cost(len: u64) -> u64 {
    len.div_ceil(10)
}

struct Checker<'a> {
    bounds: &'a DeviceBounds,
    scope: Vec<(String, Shape)>,
    max_depth: u32,
}

type Out = Result<(Shape, u64), CheckError>;

fn err(id: u64, message: impl Into<String>) -> CheckError {
    CheckError {
        message: message.into(),
        expr_id: id,
        too_deep: false,
    }
}

/// Checks `expr` and estimates its worst-case cost against `bounds`.
pub(crate) fn check(expr: &IdedExpr, bounds: &DeviceBounds) -> Result<Estimate, CheckError> {
    let mut c = Checker {
        bounds,
        scope: Vec::new(),
        max_depth: 0,
    };
    let (shape, cost) = c.walk(expr, 1)?;
    match shape.kind {
        Kind::Bool | Kind::Dyn => {}
        other => {
            return Err(err(
                expr.id,
                format!(
                    "expression must evaluate to bool, but its type is {}",
                    kind_name(other)
                ),
            ));
        }
    }
    Ok(Estimate {
        cost,
        depth: c.max_depth,
    })
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Bool => "bool",
        Kind::Int => "int",
        Kind::Uint => "uint",
        Kind::Double => "double",
        Kind::String => "string",
        Kind::Bytes => "bytes",
        Kind::Null => "null_type",
        Kind::List => "list",
        Kind::Map => "map",
        Kind::Quantity => "kubernetes.Quantity",
        Kind::Semver => "kubernetes.Semver",
        Kind::Device => "kubernetes.DRADevice",
        Kind::Type => "type",
        Kind::Optional => "optional_type",
        Kind::Dyn => "dyn",
    }
}

/// Function namespaces: `ns.f(..)` calls the function `ns.f`.
const NAMESPACES: &[&str] = &["optional", "sets", "strings"];

const TYPE_NAMES: &[&str] = &[
    "bool",
    "int",
    "uint",
    "double",
    "string",
    "bytes",
    "list",
    "map",
    "null_type",
    "type",
    "optional_type",
    "kubernetes.Quantity",
    "kubernetes.Semver",
];

impl Checker<'_> {
    fn lookup(&self, name: &str) -> Option<&Shape> {
        self.scope
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s)
    }

    fn device_field(&self, id: u64, field: &str) -> Result<Shape, CheckError> {
        let b = self.bounds;
        let domains = b.entries;
        let domain_map = |value: Shape| {
            // One domain's map: at most `entries` ids.
            let entry = b.id_len + value.weight + 1;
            Rc::new(Shape {
                kind: Kind::Map,
                len: b.entries,
                weight: b.entries.saturating_mul(entry).saturating_add(1),
                elem: Some(Rc::new(value)),
                key: Some(Rc::new(Shape::string(b.id_len))),
            })
        };
        let outer = |inner: Rc<Shape>| Shape {
            kind: Kind::Map,
            len: domains,
            weight: domains
                .saturating_mul(b.domain_len + 1)
                .saturating_add(inner.weight),
            elem: Some(inner),
            key: Some(Rc::new(Shape::string(b.domain_len))),
        };
        match field {
            "driver" => Ok(Shape::string(b.driver_len)),
            "allowMultipleAllocations" => Ok(Shape::scalar(Kind::Bool)),
            "attributes" => Ok(outer(domain_map(Shape::dyn_within(b.value_len + 1)))),
            "capacity" => Ok(outer(domain_map(Shape::scalar(Kind::Quantity)))),
            other => Err(err(
                id,
                format!(
                    "undefined field '{other}' of device (fields: driver, attributes, capacity, allowMultipleAllocations)"
                ),
            )),
        }
    }

    fn walk(&mut self, e: &IdedExpr, depth: u32) -> Out {
        if depth > MAX_DEPTH {
            return Err(CheckError {
                too_deep: true,
                ..err(
                    e.id,
                    format!("expression is nested more than {MAX_DEPTH} levels deep"),
                )
            });
        }
        self.max_depth = self.max_depth.max(depth);
        let d = depth + 1;
        match &e.expr {
            Expr::Unspecified => Err(err(e.id, "incomplete expression")),
            Expr::Literal(l) => Ok((
                match l {
                    LiteralValue::Boolean(_) => Shape::scalar(Kind::Bool),
                    LiteralValue::Int(_) => Shape::scalar(Kind::Int),
                    LiteralValue::UInt(_) => Shape::scalar(Kind::Uint),
                    LiteralValue::Double(_) => Shape::scalar(Kind::Double),
                    LiteralValue::Null => Shape::scalar(Kind::Null),
                    LiteralValue::String(s) => Shape::string(s.inner().len() as u64),
                    LiteralValue::Bytes(b) => Shape {
                        kind: Kind::Bytes,
                        ..Shape::string(b.inner().len() as u64)
                    },
                },
                0,
            )),
            Expr::Ident(name) => {
                if let Some(s) = self.lookup(name) {
                    return Ok((s.clone(), 1));
                }
                if name == "device" {
                    return Ok((Shape::scalar(Kind::Device), 1));
                }
                if TYPE_NAMES.contains(&name.as_str()) {
                    return Ok((Shape::scalar(Kind::Type), 1));
                }
                Err(err(e.id, format!("undeclared reference to '{name}'")))
            }
            Expr::Select(sel) => {
                // `kubernetes.Quantity` and friends spell type names as selections.
                if let Expr::Ident(root) = &sel.operand.expr
                    && !sel.test
                    && self.lookup(root).is_none()
                    && TYPE_NAMES.contains(&format!("{root}.{}", sel.field).as_str())
                {
                    return Ok((Shape::scalar(Kind::Type), 1));
                }
                let (operand, c) = self.walk(&sel.operand, d)?;
                let field = match operand.kind {
                    Kind::Device => self.device_field(e.id, &sel.field)?,
                    Kind::Map | Kind::Dyn => operand.elem(),
                    Kind::Optional => Shape {
                        kind: Kind::Optional,
                        ..Shape::dyn_within(operand.weight)
                    },
                    other => {
                        return Err(err(
                            e.id,
                            format!("type {} has no fields", kind_name(other)),
                        ));
                    }
                };
                let shape = if sel.test {
                    Shape::scalar(Kind::Bool)
                } else {
                    field
                };
                Ok((shape, c.saturating_add(1)))
            }
            Expr::List(list) => {
                let mut cost: u64 = 10;
                let mut weight: u64 = 1;
                let mut elem: Option<Shape> = None;
                for el in &list.elements {
                    let (s, c) = self.walk(el, d)?;
                    cost = cost.saturating_add(c);
                    weight = weight.saturating_add(s.weight).saturating_add(1);
                    elem = Some(match elem {
                        None => s,
                        Some(prev) => Shape::join(&prev, &s),
                    });
                }
                Ok((
                    Shape {
                        kind: Kind::List,
                        len: list.elements.len() as u64,
                        weight,
                        elem: elem.map(Rc::new),
                        key: None,
                    },
                    cost,
                ))
            }
            Expr::Map(map) => {
                let mut cost: u64 = 30;
                let mut weight: u64 = 1;
                let mut key: Option<Shape> = None;
                let mut value: Option<Shape> = None;
                for entry in &map.entries {
                    let EntryExpr::MapEntry(me) = &entry.expr else {
                        return Err(err(
                            entry.id,
                            "field initializers are not allowed in a map literal",
                        ));
                    };
                    let (k, ck) = self.walk(&me.key, d)?;
                    let (v, cv) = self.walk(&me.value, d)?;
                    cost = cost.saturating_add(ck).saturating_add(cv);
                    weight = weight
                        .saturating_add(k.weight)
                        .saturating_add(v.weight)
                        .saturating_add(1);
                    key = Some(match key {
                        None => k,
                        Some(p) => Shape::join(&p, &k),
                    });
                    value = Some(match value {
                        None => v,
                        Some(p) => Shape::join(&p, &v),
                    });
                }
                Ok((
                    Shape {
                        kind: Kind::Map,
                        len: map.entries.len() as u64,
                        weight,
                        elem: value.map(Rc::new),
                        key: key.map(Rc::new),
                    },
                    cost,
                ))
            }
            Expr::Struct(s) => Err(err(
                e.id,
                format!("undeclared reference to message type '{}'", s.type_name),
            )),
            Expr::Comprehension(comp) => {
                // A comprehension's evaluation nests scopes and loop frames: weigh it more.
                let d = depth + 3;
                let (range, c_range) = self.walk(&comp.iter_range, d)?;
                let n = range.len;
                let (first, second) = match range.kind {
                    Kind::Map => (range.key(), Some(range.elem())),
                    Kind::List => (range.elem(), Some(Shape::scalar(Kind::Int))),
                    _ => (
                        Shape::dyn_within(range.weight),
                        Some(Shape::dyn_within(range.weight)),
                    ),
                };
                // Two-variable comprehensions bind (index|key, value).
                let vars: Vec<(String, Shape)> = match &comp.iter_var2 {
                    None => vec![(comp.iter_var.clone(), first)],
                    Some(v2) => {
                        let (k, v) = match range.kind {
                            Kind::List => (Shape::scalar(Kind::Int), range.elem()),
                            _ => (first, second.unwrap_or_else(|| range.elem())),
                        };
                        vec![(comp.iter_var.clone(), k), (v2.clone(), v)]
                    }
                };
                let (init, c_init) = self.walk(&comp.accu_init, d)?;

                // First pass with the initial accumulator gives the growth of one step.
                let base = self.scope.len();
                self.scope.push((comp.accu_var.clone(), init.clone()));
                self.scope.extend(vars.iter().cloned());
                let first_step = self.walk(&comp.loop_step, d);
                self.scope.truncate(base);
                let (step, _) = first_step?;
                let grow = |a: u64, b: u64| a.saturating_add(n.saturating_mul(b.saturating_sub(a)));
                let accu = Shape {
                    kind: if step.kind == init.kind {
                        init.kind
                    } else {
                        Kind::Dyn
                    },
                    len: grow(init.len, step.len),
                    weight: grow(init.weight, step.weight),
                    elem: step.elem.clone().or(init.elem.clone()),
                    key: step.key.clone().or(init.key.clone()),
                };

                // Second pass with the widened accumulator gives the per-iteration cost.
                self.scope.push((comp.accu_var.clone(), accu.clone()));
                self.scope.extend(vars.iter().cloned());
                let cond = self.walk(&comp.loop_cond, d);
                let step = self.walk(&comp.loop_step, d);
                self.scope.truncate(base);
                let (_, c_cond) = cond?;
                let (_, c_step) = step?;

                self.scope.push((comp.accu_var.clone(), accu));
                let result = self.walk(&comp.result, d);
                self.scope.truncate(base);
                let (result, c_result) = result?;

                let per_iteration = c_cond.saturating_add(c_step).saturating_add(1);
                let cost = c_range
                    .saturating_add(c_init)
                    .saturating_add(n.saturating_mul(per_iteration))
                    .saturating_add(c_result);
                Ok((result, cost))
            }
            Expr::Call(call) => {
                // `sets.contains(a, b)` parses as a call on the identifier `sets`: a
                // namespaced function when `sets` is not a variable.
                if let Some(Expr::Ident(ns)) = call.target.as_deref().map(|t| &t.expr)
                    && NAMESPACES.contains(&ns.as_str())
                    && self.lookup(ns).is_none()
                {
                    let mut args = Vec::with_capacity(call.args.len());
                    for a in &call.args {
                        args.push(self.walk(a, d)?);
                    }
                    let base = args.iter().fold(0u64, |acc, (_, c)| acc.saturating_add(*c));
                    let a: Vec<&Shape> = args.iter().map(|(s, _)| s).collect();
                    let name = format!("{ns}.{}", call.func_name);
                    let (shape, own) = self.call(e.id, &name, None, &a, &call.args)?;
                    return Ok((shape, base.saturating_add(own)));
                }
                let target = match &call.target {
                    Some(t) => Some(self.walk(t, d)?),
                    None => None,
                };
                let mut args = Vec::with_capacity(call.args.len());
                for a in &call.args {
                    args.push(self.walk(a, d)?);
                }
                let base: u64 = target
                    .iter()
                    .chain(args.iter())
                    .fold(0u64, |acc, (_, c)| acc.saturating_add(*c));
                let t = target.as_ref().map(|(s, _)| s);
                let a: Vec<&Shape> = args.iter().map(|(s, _)| s).collect();
                let (shape, own) = self.call(e.id, &call.func_name, t, &a, &call.args)?;
                Ok((shape, base.saturating_add(own)))
            }
        }
    }

    /// Result shape and own cost (excluding the arguments' cost) of a call.
    fn call(
        &self,
        id: u64,
        name: &str,
        target: Option<&Shape>,
        args: &[&Shape],
        arg_exprs: &[IdedExpr],
    ) -> Result<(Shape, u64), CheckError> {
        use Kind::*;
        let n = args.len();
        let undeclared = || {
            Err(err(
                id,
                match target {
                    Some(_) => format!(
                        "undeclared reference to member function '{name}' with {n} argument(s)"
                    ),
                    None => {
                        format!("undeclared reference to function '{name}' with {n} argument(s)")
                    }
                },
            ))
        };
        let bool_ = Shape::scalar(Bool);
        let int_ = Shape::scalar(Int);
        let w = |i: usize| args.get(i).map_or(0, |s| s.weight);
        let tw = target.map_or(0, |s| s.weight);
        match (name, target, n) {
            ("_&&_" | "_||_", None, 2) => Ok((bool_, 1)),
            ("!_" | "@not_strictly_false", None, 1) => Ok((bool_, 1)),
            ("_?_:_", None, 3) => Ok((Shape::join(args[1], args[2]), 1)),
            ("_==_" | "_!=_", None, 2) => Ok((bool_, 1 + str_cost(w(0).min(w(1))))),
            ("_<_" | "_<=_" | "_>_" | "_>=_", None, 2) => Ok((bool_, 1 + str_cost(w(0).min(w(1))))),
            ("@in", None, 2) => {
                let scan = if args[1].kind == Map {
                    1
                } else {
                    args[1].len.saturating_mul(1 + str_cost(w(0)))
                };
                Ok((bool_, 1u64.saturating_add(scan)))
            }
            ("_+_", None, 2) => {
                let (l, r) = (args[0], args[1]);
                let kind = if l.kind == r.kind { l.kind } else { Dyn };
                let shape = Shape {
                    kind,
                    len: l.len.saturating_add(r.len),
                    weight: l.weight.saturating_add(r.weight),
                    elem: match (&l.elem, &r.elem) {
                        (Some(x), Some(y)) => Some(Rc::new(Shape::join(x, y))),
                        _ => None,
                    },
                    key: None,
                };
                let own = match kind {
                    String | Bytes | List | Dyn => 1 + str_cost(l.len.saturating_add(r.len)),
                    _ => 1,
                };
                Ok((shape, own))
            }
            ("_-_" | "_*_" | "_/_" | "_%_", None, 2) => {
                let kind = if args[0].kind == args[1].kind {
                    args[0].kind
                } else {
                    Dyn
                };
                Ok((Shape::scalar(kind), 1))
            }
            ("-_", None, 1) => Ok((Shape::scalar(args[0].kind), 1)),
            ("_[_]", None, 2) => {
                let c = args[0];
                let shape = match c.kind {
                    Device => return Err(err(id, "device cannot be indexed; use device.<field>")),
                    List | Map | Dyn => c.elem(),
                    Optional => Shape {
                        kind: Optional,
                        ..Shape::dyn_within(c.weight)
                    },
                    other => {
                        return Err(err(
                            id,
                            format!("type {} cannot be indexed", kind_name(other)),
                        ));
                    }
                };
                Ok((shape, 1))
            }
            ("_[?_]" | "_?._", None, 2) => {
                let inner = if args[0].kind == Device {
                    match arg_exprs.get(1).map(|a| &a.expr) {
                        Some(Expr::Literal(LiteralValue::String(s))) => {
                            self.device_field(id, s.inner())?
                        }
                        _ => Shape::dyn_within(w(0)),
                    }
                } else {
                    args[0].elem()
                };
                Ok((
                    Shape {
                        kind: Optional,
                        len: 0,
                        weight: inner.weight,
                        elem: Some(Rc::new(inner)),
                        key: None,
                    },
                    1,
                ))
            }
            ("size", None, 1) => Ok((int_, 1)),
            ("size", Some(_), 0) => Ok((int_, 1)),
            ("contains" | "startsWith" | "endsWith", Some(_), 1) => Ok((bool_, 1 + str_cost(tw))),
            ("matches", _, _) if (target.is_some() && n == 1) || (target.is_none() && n == 2) => {
                let (s, re, re_expr) = if target.is_some() {
                    (tw, w(0), arg_exprs.first())
                } else {
                    (w(0), w(1), arg_exprs.get(1))
                };
                if let Some(IdedExpr {
                    id: re_id,
                    expr: Expr::Literal(LiteralValue::String(p)),
                }) = re_expr
                {
                    regex::RegexBuilder::new(p.inner())
                        .size_limit(crate::library::REGEX_SIZE_LIMIT)
                        .build()
                        .map_err(|e| err(*re_id, format!("invalid regular expression: {e}")))?;
                }
                Ok((
                    bool_,
                    1u64.saturating_add(str_cost(s).max(1).saturating_mul(str_cost(re).max(1))),
                ))
            }
            ("lowerAscii" | "upperAscii" | "trim" | "reverse", Some(_), 0) => {
                Ok((Shape::string(tw), 1 + str_cost(tw)))
            }
            ("strings.quote", None, 1) => Ok((
                Shape::string(w(0).saturating_mul(6).saturating_add(2)),
                1 + str_cost(w(0)),
            )),
            ("charAt", Some(_), 1) => Ok((Shape::string(4), 1 + str_cost(tw))),
            ("indexOf" | "lastIndexOf", Some(_), 1 | 2) => {
                Ok((int_, 1 + str_cost(tw.saturating_mul(w(0).max(1)))))
            }
            ("substring", Some(_), 1 | 2) => Ok((Shape::string(tw), 1 + str_cost(tw))),
            ("replace", Some(_), 2 | 3) => {
                let out = tw.saturating_add(tw.saturating_add(1).saturating_mul(w(1)));
                Ok((Shape::string(out), 1 + str_cost(out)))
            }
            ("split", Some(_), 1 | 2) => Ok((
                Shape {
                    kind: List,
                    len: tw.saturating_add(1),
                    weight: tw.saturating_mul(2).saturating_add(2),
                    elem: Some(Rc::new(Shape::string(tw))),
                    key: None,
                },
                1 + str_cost(tw),
            )),
            ("join", Some(t), 0 | 1) => {
                let out = t.weight.saturating_add(t.len.saturating_mul(w(0)));
                Ok((Shape::string(out), 1 + str_cost(out)))
            }
            ("format", Some(_), 1) => {
                let out = tw.saturating_mul(w(0).saturating_add(1));
                Ok((Shape::string(out), 1 + str_cost(out)))
            }
            ("int" | "uint" | "double" | "bool" | "bytes" | "string" | "dyn" | "type", None, 1) => {
                let shape = match name {
                    "int" => int_,
                    "uint" => Shape::scalar(Uint),
                    "double" => Shape::scalar(Double),
                    "bool" => bool_,
                    "bytes" => Shape {
                        kind: Bytes,
                        ..Shape::string(w(0))
                    },
                    "string" => Shape::string(w(0).max(32)),
                    "type" => Shape::scalar(Type),
                    _ => args[0].clone(),
                };
                Ok((shape, 1 + str_cost(w(0))))
            }
            ("quantity", None, 1) => Ok((Shape::scalar(Quantity), 1 + str_cost(w(0)))),
            ("isQuantity", None, 1) => Ok((bool_, 1 + str_cost(w(0)))),
            ("semver", None, 1 | 2) => Ok((Shape::scalar(Semver), 1 + str_cost(w(0)))),
            ("isSemver", None, 1 | 2) => Ok((bool_, 1 + str_cost(w(0)))),
            ("sign" | "asInteger" | "major" | "minor" | "patch", Some(_), 0) => Ok((int_, 1)),
            ("isInteger", Some(_), 0) => Ok((bool_, 1)),
            ("asApproximateFloat", Some(_), 0) => Ok((Shape::scalar(Double), 1)),
            ("isGreaterThan" | "isLessThan", Some(_), 1) => Ok((bool_, 1)),
            ("compareTo", Some(_), 1) => Ok((int_, 1)),
            ("add" | "sub", Some(_), 1) => Ok((Shape::scalar(Quantity), 1)),
            ("optional.none", None, 0) => Ok((Shape::scalar(Optional), 1)),
            ("optional.of" | "optional.ofNonZeroValue", None, 1) => Ok((
                Shape {
                    kind: Optional,
                    len: 0,
                    weight: w(0),
                    elem: Some(Rc::new(args[0].clone())),
                    key: None,
                },
                1,
            )),
            ("sets.contains" | "sets.equivalent" | "sets.intersects", None, 2) => Ok((
                bool_,
                1u64.saturating_add(args[0].len.saturating_mul(args[1].len).saturating_mul(2)),
            )),
            ("hasValue", Some(_), 0) => Ok((bool_, 1)),
            ("value", Some(t), 0) => Ok((t.elem(), 1)),
            ("orValue", Some(t), 1) => Ok((Shape::join(&t.elem(), args[0]), 1)),
            ("or", Some(t), 1) => Ok((Shape::join(t, args[0]), 1)),
            _ => undeclared(),
        }
    }
}
