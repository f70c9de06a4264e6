//! The Kubernetes DRA CEL environment for device selectors, on the `cel` 0.15 crate.
//!
//! [`CelEnv`] compiles selector expressions ([`CelEnv::compile`], cached by expression text)
//! and evaluates them against one device ([`CelEnv::evaluate`], cached by selector id and the
//! device's 128-bit content hash, errors included).
//!
//! The environment mirrors `k8s.io/dynamic-resource-allocation/cel`:
//! - one variable, `device`, with `driver`, `attributes[domain][id]`, `capacity[domain][id]`
//!   and `allowMultipleAllocations` (see [`device`]);
//! - an unknown domain in `device.attributes` / `device.capacity` is an empty map, an unknown
//!   id inside a domain is the runtime error `no such key: <id>`;
//! - the Kubernetes `quantity()` and `semver()` libraries (see [`library`]), the CEL standard
//!   library (with `matches`, optional values and the standard macros) and the strings
//!   extension (`lowerAscii`, `upperAscii`, `split`, `replace`, ...);
//! - the result must be a bool, otherwise evaluation fails with
//!   "expression must evaluate to bool";
//! - limits: expressions of at most [`Limits::max_expression_bytes`] bytes, and a worst-case
//!   cost bound of [`Limits::max_cost`], enforced statically (see [`cost`] for exactly what is
//!   enforced and how it differs from Kubernetes' runtime cost accounting).
//!
//! Guarantees: `compile` and `evaluate` never panic on any input (a panic inside the `cel`
//! crate is caught and reported as an error), both caches are bounded, and everything is
//! `Send + Sync`. Parsing, and evaluation of expressions deeper than 16 levels, run on a
//! dedicated thread with a 64 MiB stack, so no input can overflow the caller's stack (the
//! `cel` parser and interpreter recurse once per nesting level with large frames).
//! `matches` keeps compiled regular expressions in a bounded process-wide cache (`cel`'s own
//! recompiles the pattern on every call).

pub mod cost;
pub mod device;
pub mod library;

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use cel::common::ast::SourceInfo;
use cel::common::ast::{EntryExpr, Expr};
use cel::common::types::CelBool;
use cel::{Context, Env, ExecutionError, IdedExpr, Value};

pub use device::DeviceInput;

use cost::DeviceBounds;
use device::DeviceResolver;

/// Limits applied to every selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest accepted expression, in bytes (Kubernetes: 10 KiB).
    pub max_expression_bytes: usize,
    /// Largest accepted worst-case cost estimate (Kubernetes: 1,000,000 per evaluation).
    pub max_cost: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_expression_bytes: 10 * 1024,
            max_cost: 1_000_000,
        }
    }
}

/// Why an expression was rejected at compile time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    #[error("expression is {len} bytes long, over the limit of {limit} bytes")]
    /// The expression is longer than the size limit.
    TooLong {
        /// Length in bytes.
        len: usize,
        /// Maximum length in bytes.
        limit: usize,
    },
    #[error("syntax error: {message}")]
    /// The expression does not parse.
    Syntax {
        /// The parser's message.
        message: String,
    },
    #[error("{}{}", .message, position_suffix(*.line, *.column))]
    /// The expression parses but is not valid in the DRA environment.
    Invalid {
        /// What is invalid.
        message: String,
        /// 1-based position of the offending sub-expression, when known (0 otherwise).
        line: u32,
        /// 1-based column, 0 when unknown.
        column: u32,
    },
    #[error(
        "expression is nested more than {limit} levels deep (comprehensions count as three levels)"
    )]
    /// The expression nests too deeply.
    TooDeep {
        /// Maximum nesting depth.
        limit: u32,
    },
    #[error(
        "estimated worst-case cost {estimated} exceeds the limit of {limit} (the expression could run too long on some device)"
    )]
    /// The estimated worst-case cost exceeds the limit.
    TooCostly {
        /// Estimated worst-case cost.
        estimated: u64,
        /// Maximum cost.
        limit: u64,
    },
    #[error("internal error in the CEL parser: {message}")]
    /// The parser failed internally.
    Internal {
        /// The parser's message.
        message: String,
    },
}

fn position_suffix(line: u32, column: u32) -> String {
    if line == 0 {
        String::new()
    } else {
        format!(" (at line {line}, column {column})")
    }
}

/// Why an evaluation failed; fatal for the pod being scheduled, as in Kubernetes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EvalError {
    /// What went wrong.
    pub message: String,
}

impl EvalError {
    fn new(message: impl Into<String>) -> EvalError {
        EvalError {
            message: message.into(),
        }
    }
}

/// Cache counters, for tests and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Expressions currently in the compile cache (successful or not).
    pub compiled: usize,
    /// Compiled-expression cache hits.
    pub compile_hits: u64,
    /// Compiled-expression cache misses.
    pub compile_misses: u64,
    /// Entries currently in the result cache.
    pub result_entries: usize,
    /// Result cache hits.
    pub result_hits: u64,
    /// Result cache misses.
    pub result_misses: u64,
}

struct SelectorInner {
    id: u32,
    /// The [`CelEnv`] that compiled it: ids are only unique within one environment.
    env_id: u64,
    expression: Box<str>,
    expr: IdedExpr,
    estimated_cost: u64,
    /// Weighted expression depth; deep expressions are evaluated on a dedicated stack.
    depth: u32,
}

/// A compiled selector. Cheap to clone.
#[derive(Clone)]
pub struct Selector(Arc<SelectorInner>);

impl Selector {
    /// Identifier unique within the [`CelEnv`] that compiled it.
    pub fn id(&self) -> u32 {
        self.0.id
    }

    /// The expression as written.
    pub fn expression(&self) -> &str {
        &self.0.expression
    }

    /// Worst-case cost estimate for a device within Kubernetes' validation limits.
    pub fn estimated_cost(&self) -> u64 {
        self.0.estimated_cost
    }
}

impl std::fmt::Debug for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Selector")
            .field("id", &self.0.id)
            .field("expression", &self.0.expression)
            .field("estimated_cost", &self.0.estimated_cost)
            .finish()
    }
}

/// Expressions at most this deep are evaluated on the caller's stack. The `cel` interpreter
/// recurses once per level with large frames (tens of KiB per level in debug builds), so
/// deeper ones run on a dedicated thread with [`BIG_STACK`] bytes of stack: no accepted
/// expression can overflow the caller's stack. Real selectors are far shallower.
const INLINE_DEPTH: u32 = 16;
/// Stack for deep evaluations and for parsing (the ANTLR parser also recurses per level).
const BIG_STACK: usize = 64 << 20;

/// Runs `f` on a fresh thread with a [`BIG_STACK`] stack; `None` when the thread cannot be
/// created. Panics inside `f` must be caught by `f`.
fn on_big_stack<R: Send>(f: impl FnOnce() -> R + Send) -> Option<R> {
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("dramesh-cel-deep".into())
            .stack_size(BIG_STACK)
            .spawn_scoped(scope, f)
            .ok()?
            .join()
            .ok()
    })
}

/// Compile-cache capacity: the cache is cleared when it would grow beyond this.
const MAX_PROGRAMS: usize = 4096;
const RESULT_SHARDS: usize = 16;
/// Default result-cache capacity (entries across all shards).
pub const DEFAULT_RESULT_CAPACITY: usize = 1 << 18;

type ResultMap = HashMap<(u32, u128), Result<bool, EvalError>>;

/// The selector environment: compiler, evaluator and caches. `Send + Sync`; share it by `Arc`.
pub struct CelEnv {
    env: Arc<Env>,
    env_id: u64,
    limits: Limits,
    programs: RwLock<HashMap<Box<str>, Result<Selector, CompileError>>>,
    next_id: AtomicU32,
    results: Vec<Mutex<ResultMap>>,
    shard_capacity: usize,
    compile_hits: AtomicU64,
    compile_misses: AtomicU64,
    result_hits: AtomicU64,
    result_misses: AtomicU64,
}

fn build_env() -> Env {
    let mut env = Env::stdlib();
    // Both registrations are static; failing would be a bug in this crate, not bad input.
    env.add_extension(cel::extensions::strings)
        .expect("the strings extension registers once");
    library::register(&mut env).expect("the quantity and semver libraries register once");
    env
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_string()
    }
}

/// 1-based line and column of character offset `offset` in `src`.
fn line_column(src: &str, offset: u32) -> (u32, u32) {
    let (mut line, mut col) = (1u32, 1u32);
    for (i, ch) in src.chars().enumerate() {
        if i as u64 >= u64::from(offset) {
            break;
        }
        if ch == '\n' {
            line += 1;
            col = 1;
        } else {
            col += 1;
        }
    }
    (line, col)
}

/// Rewrites `matches` calls to the cached-regex implementation.
fn use_cached_regex(e: &mut IdedExpr) {
    match &mut e.expr {
        Expr::Call(call) => {
            let arity = call.args.len() + usize::from(call.target.is_some());
            if call.func_name == "matches" && arity == 2 {
                call.func_name = library::MATCHES_CACHED.to_string();
            }
            if let Some(t) = call.target.as_deref_mut() {
                use_cached_regex(t);
            }
            call.args.iter_mut().for_each(use_cached_regex);
        }
        Expr::Comprehension(c) => {
            for sub in [
                &mut c.iter_range,
                &mut c.accu_init,
                &mut c.loop_cond,
                &mut c.loop_step,
                &mut c.result,
            ] {
                use_cached_regex(sub);
            }
        }
        Expr::List(l) => l.elements.iter_mut().for_each(use_cached_regex),
        Expr::Map(m) => {
            for entry in &mut m.entries {
                if let EntryExpr::MapEntry(me) = &mut entry.expr {
                    use_cached_regex(&mut me.key);
                    use_cached_regex(&mut me.value);
                }
            }
        }
        Expr::Select(s) => use_cached_regex(&mut s.operand),
        Expr::Struct(_) | Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
    }
}

fn eval_message(e: &ExecutionError) -> String {
    match e {
        ExecutionError::NoSuchKey(k) => format!("no such key: {k}"),
        other => other.to_string(),
    }
}

impl CelEnv {
    /// An environment with these limits.
    pub fn new(limits: Limits) -> CelEnv {
        CelEnv::with_result_capacity(limits, DEFAULT_RESULT_CAPACITY)
    }

    /// Like [`CelEnv::new`] with a result cache of about `capacity` entries (at least one
    /// per shard). A full shard is cleared before inserting.
    pub fn with_result_capacity(limits: Limits, capacity: usize) -> CelEnv {
        static NEXT_ENV: AtomicU64 = AtomicU64::new(0);
        CelEnv {
            env: Arc::new(build_env()),
            env_id: NEXT_ENV.fetch_add(1, Ordering::Relaxed),
            limits,
            programs: RwLock::new(HashMap::new()),
            next_id: AtomicU32::new(0),
            results: (0..RESULT_SHARDS)
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
            shard_capacity: capacity.div_ceil(RESULT_SHARDS).max(1),
            compile_hits: AtomicU64::new(0),
            compile_misses: AtomicU64::new(0),
            result_hits: AtomicU64::new(0),
            result_misses: AtomicU64::new(0),
        }
    }

    /// The limits in effect.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Compiles `expression`, or returns the cached outcome of an earlier compile.
    pub fn compile(&self, expression: &str) -> Result<Selector, CompileError> {
        if expression.len() > self.limits.max_expression_bytes {
            return Err(CompileError::TooLong {
                len: expression.len(),
                limit: self.limits.max_expression_bytes,
            });
        }
        if let Some(hit) = self
            .programs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(expression)
        {
            self.compile_hits.fetch_add(1, Ordering::Relaxed);
            return hit.clone();
        }
        self.compile_misses.fetch_add(1, Ordering::Relaxed);
        let outcome = self.compile_uncached(expression);
        let mut programs = self.programs.write().unwrap_or_else(|p| p.into_inner());
        if let Some(existing) = programs.get(expression) {
            // Another thread compiled it meanwhile: keep one id per expression.
            return existing.clone();
        }
        if programs.len() >= MAX_PROGRAMS {
            programs.clear();
        }
        programs.insert(expression.into(), outcome.clone());
        outcome
    }

    fn compile_uncached(&self, expression: &str) -> Result<Selector, CompileError> {
        let env = &self.env;
        // Parsing recurses deeply on nested input, so it never runs on the caller's stack.
        let parsed = on_big_stack(|| {
            catch_unwind(AssertUnwindSafe(|| {
                env.parser().parse_with_source_info(expression)
            }))
        })
        .ok_or_else(|| CompileError::Internal {
            message: "could not start the parser thread".to_string(),
        })?;
        let (mut expr, source_info): (IdedExpr, SourceInfo) = match parsed {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                let mut message = e
                    .errors
                    .iter()
                    .take(3)
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("\n");
                if e.errors.len() > 3 {
                    message.push_str(&format!("\n(and {} more errors)", e.errors.len() - 3));
                }
                return Err(CompileError::Syntax { message });
            }
            Err(p) => {
                return Err(CompileError::Internal {
                    message: panic_message(p.as_ref()),
                });
            }
        };
        let estimate = cost::check(&expr, &DeviceBounds::KUBERNETES).map_err(|e| {
            let (line, column) = source_info
                .offset_for(e.expr_id)
                .map_or((0, 0), |(start, _)| line_column(expression, start));
            if e.too_deep {
                CompileError::TooDeep {
                    limit: cost::MAX_DEPTH,
                }
            } else {
                CompileError::Invalid {
                    message: e.message,
                    line,
                    column,
                }
            }
        })?;
        if estimate.cost > self.limits.max_cost {
            return Err(CompileError::TooCostly {
                estimated: estimate.cost,
                limit: self.limits.max_cost,
            });
        }
        // Depth is bounded by the check above, so this recursion is too.
        use_cached_regex(&mut expr);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        Ok(Selector(Arc::new(SelectorInner {
            id,
            env_id: self.env_id,
            expression: expression.into(),
            expr,
            estimated_cost: estimate.cost,
            depth: estimate.depth,
        })))
    }

    fn shard(&self, key: &(u32, u128)) -> &Mutex<ResultMap> {
        let mix = (key.1 as u64) ^ u64::from(key.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        &self.results[(mix % RESULT_SHARDS as u64) as usize]
    }

    /// Evaluates `selector` on `device`; the outcome, error or not, is cached per
    /// (selector id, device content).
    pub fn evaluate(&self, selector: &Selector, device: &DeviceInput) -> Result<bool, EvalError> {
        if selector.0.env_id != self.env_id {
            // Compiled by another environment: its id could collide with one of ours.
            return self.evaluate_uncached(selector, device);
        }
        let key = (selector.id(), device.hash());
        let shard = self.shard(&key);
        if let Some(hit) = shard.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            self.result_hits.fetch_add(1, Ordering::Relaxed);
            return hit.clone();
        }
        self.result_misses.fetch_add(1, Ordering::Relaxed);
        let outcome = self.evaluate_uncached(selector, device);
        let mut map = shard.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= self.shard_capacity {
            map.clear();
        }
        map.insert(key, outcome.clone());
        outcome
    }

    /// Evaluates without consulting or filling the result cache (benchmarks, diagnostics).
    pub fn evaluate_uncached(
        &self,
        selector: &Selector,
        device: &DeviceInput,
    ) -> Result<bool, EvalError> {
        if !device.bounds().within(&DeviceBounds::KUBERNETES) {
            // The compile-time bound assumed validated device data; re-check for this device.
            let bounds = device.bounds().max(&DeviceBounds::KUBERNETES);
            let estimate =
                cost::check(&selector.0.expr, &bounds).map_err(|e| EvalError::new(e.message))?;
            if estimate.cost > self.limits.max_cost {
                return Err(EvalError::new(format!(
                    "estimated worst-case cost {} on device of driver {} exceeds the limit of {} (the device has {} attributes and capacities, or strings longer than Kubernetes allows)",
                    estimate.cost,
                    device.driver(),
                    self.limits.max_cost,
                    device.bounds().entries
                )));
            }
        }
        let value = device.value();
        let resolver = DeviceResolver(value);
        let run = || {
            let mut ctx = Context::with_env(Arc::clone(&self.env));
            ctx.set_variable_resolver(&resolver);
            match Value::resolve_val(&selector.0.expr, &ctx) {
                Ok(v) => match v.downcast_ref::<CelBool>() {
                    Some(b) => Ok(*b.inner()),
                    None => Err(EvalError::new(format!(
                        "expression must evaluate to bool, got {}",
                        v.get_type().name()
                    ))),
                },
                Err(e) => Err(EvalError::new(eval_message(&e))),
            }
        };
        let guarded = || match catch_unwind(AssertUnwindSafe(run)) {
            Ok(r) => r,
            Err(p) => Err(EvalError::new(format!(
                "internal error in the CEL interpreter: {}",
                panic_message(p.as_ref())
            ))),
        };
        if selector.0.depth <= INLINE_DEPTH {
            guarded()
        } else {
            on_big_stack(guarded).unwrap_or_else(|| {
                Err(EvalError::new(
                    "could not start a thread to evaluate a deeply nested selector",
                ))
            })
        }
    }

    /// Cache counters so far.
    pub fn stats(&self) -> CacheStats {
        let compiled = self
            .programs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .len();
        let result_entries = self
            .results
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum();
        CacheStats {
            compiled,
            compile_hits: self.compile_hits.load(Ordering::Relaxed),
            compile_misses: self.compile_misses.load(Ordering::Relaxed),
            result_entries,
            result_hits: self.result_hits.load(Ordering::Relaxed),
            result_misses: self.result_misses.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests;
