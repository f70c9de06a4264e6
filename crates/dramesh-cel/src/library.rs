//! The Kubernetes `quantity()` and `semver()` CEL libraries on top of `cel` 0.15.
//!
//! Quantities and versions are opaque CEL values (`kubernetes.Quantity`, `kubernetes.Semver`)
//! wrapping the exact [`Quantity`] and [`Semver`] of `dramesh-model`, so comparisons are exact
//! (`quantity("200M").compareTo(quantity("0.2G")) == 0`). As in Kubernetes, they support `==`
//! and `!=` (by value) but not `<`/`>`: ordering goes through `compareTo`, `isGreaterThan` and
//! `isLessThan`. Every function fails with a CEL runtime error rather than panicking.

use std::any::Any;
use std::cmp::Ordering;
use std::sync::Arc;

use cel::common::types::{
    BOOL_TYPE, CelBool, CelDouble, CelInt, CelString, INT_TYPE, STRING_TYPE, Type,
};
use cel::common::value::{CowVal, StaticVal, Val};
use cel::{DeclarationError, Env, ExecutionError};
use dramesh_model::{Quantity, Semver};

/// CEL type of quantity values.
pub(crate) static QUANTITY_TYPE: Type = Type::new_unspecified_type("kubernetes.Quantity");
/// CEL type of semantic version values.
pub(crate) static SEMVER_TYPE: Type = Type::new_unspecified_type("kubernetes.Semver");

/// A `kubernetes.Quantity` CEL value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct QuantityVal(pub(crate) Quantity);

impl Val for QuantityVal {
    fn get_type(&self) -> &Type {
        &QUANTITY_TYPE
    }
    fn cel_type() -> &'static Type {
        &QUANTITY_TYPE
    }
    fn equals(&self, other: &dyn Val) -> bool {
        other
            .downcast_ref::<QuantityVal>()
            .is_some_and(|o| o.0 == self.0)
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(*self)
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for QuantityVal {}

/// A `kubernetes.Semver` CEL value; shared because device attributes hold versions by `Arc`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SemverVal(pub(crate) Arc<Semver>);

impl Val for SemverVal {
    fn get_type(&self) -> &Type {
        &SEMVER_TYPE
    }
    fn cel_type() -> &'static Type {
        &SEMVER_TYPE
    }
    fn equals(&self, other: &dyn Val) -> bool {
        other
            .downcast_ref::<SemverVal>()
            .is_some_and(|o| o.0 == self.0)
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for SemverVal {}

type Res<'b, 'v> = Result<CowVal<'b, 'v>, ExecutionError>;

fn fail(function: &str, message: impl ToString) -> ExecutionError {
    ExecutionError::function_error(function, message)
}

/// Argument `i`, downcast to `T`; overload resolution already checked the type, so a
/// mismatch is reported as an error rather than trusted.
fn arg<'a, T: StaticVal>(
    args: &'a [CowVal<'_, '_>],
    i: usize,
    f: &str,
) -> Result<&'a T, ExecutionError> {
    args.get(i)
        .and_then(|a| a.as_ref().as_any())
        .and_then(|a| a.downcast_ref::<T>())
        .ok_or_else(|| fail(f, format!("argument {i} has an unexpected type")))
}

fn str_arg<'a>(args: &'a [CowVal<'_, '_>], i: usize, f: &str) -> Result<&'a str, ExecutionError> {
    args.get(i)
        .and_then(|a| a.downcast_ref::<CelString>())
        .map(|s| s.inner())
        .ok_or_else(|| fail(f, format!("argument {i} must be a string")))
}

fn int_arg(args: &[CowVal<'_, '_>], i: usize, f: &str) -> Result<i64, ExecutionError> {
    args.get(i)
        .and_then(|a| a.as_ref().as_any())
        .and_then(|a| a.downcast_ref::<CelInt>())
        .map(|v| *v.inner())
        .ok_or_else(|| fail(f, format!("argument {i} must be an int")))
}

fn bool_arg(args: &[CowVal<'_, '_>], i: usize, f: &str) -> Result<bool, ExecutionError> {
    args.get(i)
        .and_then(|a| a.as_ref().as_any())
        .and_then(|a| a.downcast_ref::<CelBool>())
        .map(|v| *v.inner())
        .ok_or_else(|| fail(f, format!("argument {i} must be a bool")))
}

fn ret_bool<'b, 'v>(b: bool) -> Res<'b, 'v> {
    Ok(CowVal::owned(CelBool::from(b)))
}

fn ret_int<'b, 'v>(i: i64) -> Res<'b, 'v> {
    Ok(CowVal::owned(CelInt::from(i)))
}

fn ordering(o: Ordering) -> i64 {
    match o {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    }
}

// ---- quantity ----------------------------------------------------------------------------

fn quantity<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let s = str_arg(&args, 0, "quantity")?;
    Quantity::parse(s)
        .map(|q| CowVal::owned(QuantityVal(q)))
        .map_err(|e| fail("quantity", e))
}

fn is_quantity<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    ret_bool(Quantity::parse(str_arg(&args, 0, "isQuantity")?).is_ok())
}

fn q_pair(args: &[CowVal<'_, '_>], f: &str) -> Result<(Quantity, Quantity), ExecutionError> {
    Ok((
        arg::<QuantityVal>(args, 0, f)?.0,
        arg::<QuantityVal>(args, 1, f)?.0,
    ))
}

fn q_is_greater_than<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = q_pair(&args, "isGreaterThan")?;
    ret_bool(a > b)
}

fn q_is_less_than<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = q_pair(&args, "isLessThan")?;
    ret_bool(a < b)
}

fn q_compare_to<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = q_pair(&args, "compareTo")?;
    ret_int(ordering(a.cmp(&b)))
}

fn q_sign<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let a = arg::<QuantityVal>(&args, 0, "sign")?.0;
    ret_int(ordering(a.cmp(&Quantity::ZERO)))
}

fn q_add<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = q_pair(&args, "add")?;
    a.checked_add(b)
        .map(|q| CowVal::owned(QuantityVal(q)))
        .ok_or_else(|| fail("add", "quantity overflow"))
}

fn q_add_int<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let a = arg::<QuantityVal>(&args, 0, "add")?.0;
    let b = Quantity::from_units(int_arg(&args, 1, "add")?);
    a.checked_add(b)
        .map(|q| CowVal::owned(QuantityVal(q)))
        .ok_or_else(|| fail("add", "quantity overflow"))
}

fn q_sub<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = q_pair(&args, "sub")?;
    a.checked_sub(b)
        .map(|q| CowVal::owned(QuantityVal(q)))
        .ok_or_else(|| fail("sub", "quantity overflow"))
}

fn q_sub_int<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let a = arg::<QuantityVal>(&args, 0, "sub")?.0;
    let b = Quantity::from_units(int_arg(&args, 1, "sub")?);
    a.checked_sub(b)
        .map(|q| CowVal::owned(QuantityVal(q)))
        .ok_or_else(|| fail("sub", "quantity overflow"))
}

fn q_as_integer<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let a = arg::<QuantityVal>(&args, 0, "asInteger")?.0;
    match a.as_i64() {
        Some(i) => ret_int(i),
        None if !a.is_integer() => Err(fail(
            "asInteger",
            format!("cannot convert value {a} to integer: it is not a whole number"),
        )),
        None => Err(fail(
            "asInteger",
            format!("cannot convert value {a} to integer: it overflows int64"),
        )),
    }
}

fn q_is_integer<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let a = arg::<QuantityVal>(&args, 0, "isInteger")?.0;
    ret_bool(a.as_i64().is_some())
}

fn q_as_approximate_float<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let a = arg::<QuantityVal>(&args, 0, "asApproximateFloat")?.0;
    Ok(CowVal::owned(CelDouble::from(a.as_f64())))
}

// ---- semver ------------------------------------------------------------------------------

fn parse_semver(s: &str, normalize: bool) -> Result<Semver, String> {
    if normalize {
        Semver::parse_lenient(s).map_err(|e| e.to_string())
    } else {
        Semver::parse(s).map_err(|e| e.to_string())
    }
}

fn semver<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let s = str_arg(&args, 0, "semver")?;
    parse_semver(s, false)
        .map(|v| CowVal::owned(SemverVal(Arc::new(v))))
        .map_err(|e| fail("semver", e))
}

fn semver_normalize<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let s = str_arg(&args, 0, "semver")?;
    let normalize = bool_arg(&args, 1, "semver")?;
    parse_semver(s, normalize)
        .map(|v| CowVal::owned(SemverVal(Arc::new(v))))
        .map_err(|e| fail("semver", e))
}

fn is_semver<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    ret_bool(parse_semver(str_arg(&args, 0, "isSemver")?, false).is_ok())
}

fn is_semver_normalize<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let s = str_arg(&args, 0, "isSemver")?;
    ret_bool(parse_semver(s, bool_arg(&args, 1, "isSemver")?).is_ok())
}

fn v_one<'a>(args: &'a [CowVal<'_, '_>], f: &str) -> Result<&'a Semver, ExecutionError> {
    Ok(&arg::<SemverVal>(args, 0, f)?.0)
}

fn v_pair<'a>(
    args: &'a [CowVal<'_, '_>],
    f: &str,
) -> Result<(&'a Semver, &'a Semver), ExecutionError> {
    Ok((
        &arg::<SemverVal>(args, 0, f)?.0,
        &arg::<SemverVal>(args, 1, f)?.0,
    ))
}

fn part(v: u64, f: &str) -> Result<i64, ExecutionError> {
    i64::try_from(v).map_err(|_| fail(f, "version number overflows int64"))
}

fn v_major<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    ret_int(part(v_one(&args, "major")?.major, "major")?)
}

fn v_minor<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    ret_int(part(v_one(&args, "minor")?.minor, "minor")?)
}

fn v_patch<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    ret_int(part(v_one(&args, "patch")?.patch, "patch")?)
}

fn v_is_greater_than<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = v_pair(&args, "isGreaterThan")?;
    ret_bool(a > b)
}

fn v_is_less_than<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = v_pair(&args, "isLessThan")?;
    ret_bool(a < b)
}

fn v_compare_to<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = v_pair(&args, "compareTo")?;
    ret_int(ordering(a.cmp(b)))
}

/// Registers the quantity and semver libraries on `env`.
pub(crate) fn register(env: &mut Env) -> Result<(), DeclarationError> {
    let q = || QUANTITY_TYPE.to_owned();
    let v = || SEMVER_TYPE.to_owned();
    env.add_type(q())?;
    env.add_type(v())?;

    env.add_overload(
        "quantity",
        "string_to_quantity",
        vec![STRING_TYPE],
        quantity,
    )?;
    env.add_overload(
        "isQuantity",
        "is_quantity_string",
        vec![STRING_TYPE],
        is_quantity,
    )?;
    let member: [(&str, &str, Vec<Type>, cel::common::functions::Function); 11] = [
        ("sign", "quantity_sign", vec![], q_sign),
        (
            "isGreaterThan",
            "quantity_is_greater_than",
            vec![q()],
            q_is_greater_than,
        ),
        (
            "isLessThan",
            "quantity_is_less_than",
            vec![q()],
            q_is_less_than,
        ),
        ("compareTo", "quantity_compare_to", vec![q()], q_compare_to),
        ("add", "quantity_add", vec![q()], q_add),
        ("add", "quantity_add_int", vec![INT_TYPE], q_add_int),
        ("sub", "quantity_sub", vec![q()], q_sub),
        ("sub", "quantity_sub_int", vec![INT_TYPE], q_sub_int),
        ("asInteger", "quantity_as_integer", vec![], q_as_integer),
        ("isInteger", "quantity_is_integer", vec![], q_is_integer),
        (
            "asApproximateFloat",
            "quantity_as_approximate_float",
            vec![],
            q_as_approximate_float,
        ),
    ];
    for (name, id, args, f) in member {
        env.add_member_overload(name, id, q(), args, f)?;
    }

    env.add_overload("semver", "string_to_semver", vec![STRING_TYPE], semver)?;
    env.add_overload(
        "semver",
        "string_bool_to_semver",
        vec![STRING_TYPE, BOOL_TYPE],
        semver_normalize,
    )?;
    env.add_overload("isSemver", "is_semver_string", vec![STRING_TYPE], is_semver)?;
    env.add_overload(
        "isSemver",
        "is_semver_string_bool",
        vec![STRING_TYPE, BOOL_TYPE],
        is_semver_normalize,
    )?;
    let member: [(&str, &str, Vec<Type>, cel::common::functions::Function); 6] = [
        ("major", "semver_major", vec![], v_major),
        ("minor", "semver_minor", vec![], v_minor),
        ("patch", "semver_patch", vec![], v_patch),
        (
            "isGreaterThan",
            "semver_is_greater_than",
            vec![v()],
            v_is_greater_than,
        ),
        (
            "isLessThan",
            "semver_is_less_than",
            vec![v()],
            v_is_less_than,
        ),
        ("compareTo", "semver_compare_to", vec![v()], v_compare_to),
    ];
    for (name, id, args, f) in member {
        env.add_member_overload(name, id, v(), args, f)?;
    }
    register_matches(env)?;
    register_extensions(env)
}

// ---- matches -----------------------------------------------------------------------------

/// Name the compiler rewrites `matches` calls to. `@` cannot appear in CEL source, so users
/// cannot call it directly.
pub(crate) const MATCHES_CACHED: &str = "@matches";
/// Compiled-size limit for patterns, the same at compile time (constant patterns) and run
/// time, so compiling a pattern is bounded.
pub(crate) const REGEX_SIZE_LIMIT: usize = 1 << 20;
const REGEX_CACHE_CAPACITY: usize = 1024;

type RegexCache = std::sync::RwLock<std::collections::HashMap<Box<str>, Arc<regex::Regex>>>;

/// `cel`'s own `matches` compiles its pattern on every call (tens of microseconds); this one
/// keeps compiled patterns in a bounded process-wide cache.
fn cached_regex(pattern: &str) -> Result<Arc<regex::Regex>, ExecutionError> {
    static CACHE: std::sync::OnceLock<RegexCache> = std::sync::OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(re) = cache.read().unwrap_or_else(|p| p.into_inner()).get(pattern) {
        return Ok(Arc::clone(re));
    }
    let re = regex::RegexBuilder::new(pattern)
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map(Arc::new)
        .map_err(|e| fail("matches", format!("'{pattern}' is not a valid regex: {e}")))?;
    let mut w = cache.write().unwrap_or_else(|p| p.into_inner());
    if w.len() >= REGEX_CACHE_CAPACITY {
        w.clear();
    }
    w.insert(pattern.into(), Arc::clone(&re));
    Ok(re)
}

fn matches<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let s = str_arg(&args, 0, "matches")?;
    let re = cached_regex(str_arg(&args, 1, "matches")?)?;
    ret_bool(re.is_match(s))
}

/// Registers the cached `matches` under [`MATCHES_CACHED`], callable globally and as a member.
pub(crate) fn register_matches(env: &mut Env) -> Result<(), DeclarationError> {
    env.add_overload(
        MATCHES_CACHED,
        "dramesh_matches_string_string",
        vec![STRING_TYPE, STRING_TYPE],
        matches,
    )?;
    env.add_member_overload(
        MATCHES_CACHED,
        "dramesh_string_matches_string",
        STRING_TYPE,
        vec![STRING_TYPE],
        matches,
    )
}

// ---- cel.bind (ext.Bindings) ---------------------------------------------------------------

/// `cel.bind(name, init, expr)`: evaluates `expr` with `name` bound to `init`, expanded (as in
/// cel-go) to a comprehension over an empty list whose accumulator is the binding.
pub(crate) fn bind_macro() -> cel::parser::Macro {
    use cel::common::ast::{ComprehensionExpr, Expr, ListExpr, LiteralValue};
    cel::parser::Macro::receiver("bind", 3, |helper, target, args| {
        if !matches!(target.as_ref().map(|t| &t.expr), Some(Expr::Ident(n)) if n == "cel") {
            return Ok(None);
        }
        let name = match &args[0].expr {
            Expr::Ident(n) => n.clone(),
            _ => {
                return Err(helper.new_error(
                    args[0].id,
                    "cel.bind() variable name must be a simple identifier",
                ));
            }
        };
        let result = args.remove(2);
        let init = args.remove(1);
        let range = helper.next_expr(Expr::List(ListExpr::new(Vec::new())));
        let cond = helper.next_expr(Expr::Literal(LiteralValue::Boolean(false.into())));
        let step = helper.next_expr(Expr::Ident(name.clone()));
        Ok(Some(helper.next_expr(Expr::Comprehension(Box::new(
            ComprehensionExpr {
                iter_range: range,
                iter_var: "#unused".to_string(),
                iter_var2: None,
                accu_var: name,
                accu_init: init,
                loop_cond: cond,
                loop_step: step,
                result,
            },
        )))))
    })
}

// ---- sets (ext.Sets) -------------------------------------------------------------------------

fn elements<'a>(v: &'a CowVal<'_, '_>, f: &str) -> Result<Vec<&'a dyn Val>, ExecutionError> {
    let it = v
        .as_iterable()
        .ok_or_else(|| fail(f, "arguments must be lists"))?;
    let mut iter = it.iter();
    let mut out = Vec::new();
    while let Some(x) = iter.next() {
        out.push(x as &dyn Val);
    }
    Ok(out)
}

type ListPair<'a> = (Vec<&'a dyn Val>, Vec<&'a dyn Val>);

fn list_pair<'a>(args: &'a [CowVal<'_, '_>], f: &str) -> Result<ListPair<'a>, ExecutionError> {
    match args {
        [a, b] => Ok((elements(a, f)?, elements(b, f)?)),
        _ => Err(fail(f, "expects two lists")),
    }
}

fn contains_all(a: &[&dyn Val], b: &[&dyn Val]) -> bool {
    b.iter().all(|x| a.iter().any(|y| y.equals(*x)))
}

fn sets_contains<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = list_pair(&args, "sets.contains")?;
    ret_bool(contains_all(&a, &b))
}

fn sets_equivalent<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = list_pair(&args, "sets.equivalent")?;
    ret_bool(contains_all(&a, &b) && contains_all(&b, &a))
}

fn sets_intersects<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Res<'b, 'v> {
    let (a, b) = list_pair(&args, "sets.intersects")?;
    ret_bool(b.iter().any(|x| a.iter().any(|y| y.equals(*x))))
}

/// Registers `cel.bind` and `sets.contains/equivalent/intersects`.
pub(crate) fn register_extensions(env: &mut Env) -> Result<(), DeclarationError> {
    use cel::common::types::LIST_TYPE;
    env.add_macro(bind_macro())?;
    let l = || vec![LIST_TYPE, LIST_TYPE];
    env.add_overload(
        "sets.contains",
        "list_sets_contains_list",
        l(),
        sets_contains,
    )?;
    env.add_overload(
        "sets.equivalent",
        "list_sets_equivalent_list",
        l(),
        sets_equivalent,
    )?;
    env.add_overload(
        "sets.intersects",
        "list_sets_intersects_list",
        l(),
        sets_intersects,
    )
}
