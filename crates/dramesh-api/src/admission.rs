//! Admission by cost: every API request is charged the memory it is expected to need before
//! any of it is parsed, against one budget per replica.
//!
//! * **Cost.** Charged in two steps. Before the request is decoded, [`cost`]: a fixed
//!   [`BASE_COST`] plus its body bytes times the expansion measured for its wire format
//!   ([`JSON_EXPANSION`] for HTTP/JSON bodies, [`NATIVE_PROTO_EXPANSION`] for `dramesh.v1`,
//!   [`KARMADA_PROTO_EXPANSION`] for the Karmada estimator's messages). Then, before any
//!   manifest text in it is parsed, its nodes (the linear pre-scan of `dramesh_model::depth`)
//!   times [`NODE_COST`], added to the same charge by the worker ([`grow_current`]). The
//!   factors are worst cases measured on crafted bodies (docs/performance.md, "Admission by
//!   cost"): the peak memory of a request divided by its bytes or nodes.
//! * **Budget.** [`Budget`]: at most `total` bytes charged at once, and at most `share` of them
//!   to one identity, so one reader cannot starve the others. A request over budget waits up to
//!   `wait` for charges to be released, then is refused with a message naming the budget
//!   (HTTP 503, gRPC RESOURCE_EXHAUSTED, `dramesh_api_admission_refusals_total`); it is never
//!   parsed. A request whose cost alone exceeds the share is refused at once.
//! * **Release.** A [`Charge`] is released when it is dropped. The servers move it into the
//!   blocking worker that computes the answer, so it is released when the work ends, not when
//!   the answer is sent (a request that timed out still holds its charge until its worker
//!   stops at the deadline, [`crate::deadline`]).
//!
//! HTTP requests are charged by their `Content-Length` (or the size limit) before the body is
//! read; a refused body is read and discarded, never buffered. gRPC requests are charged by
//! their message size before tonic decodes them ([`crate::grpc::GrpcGate`]), after authentication (the
//! identity a share is kept for).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use std::time::Duration;

use tokio::sync::Notify;

use crate::backend::ApiError;
use crate::metrics::Metrics;

/// Charged to every request besides its body's expansion: buffers, the answer, the span.
pub const BASE_COST: u64 = 64 * 1024;
/// Peak memory per byte of an HTTP/JSON request body until its manifests are parsed
/// (measured: 54x for a manifest given as a JSON object `{"a":[1,1,...]}`, which is held as a
/// JSON value; 5.6x for manifests given as text).
pub const JSON_EXPANSION: u64 = 64;
/// Peak memory per byte of a `dramesh.v1` gRPC message until its manifests are parsed
/// (text fields: the message and its decoded strings, as for text manifests over HTTP).
pub const NATIVE_PROTO_EXPANSION: u64 = 8;
/// Peak memory per byte of a Karmada estimator message (worst case from the struct sizes:
/// repeated empty messages, two bytes each on the wire, are a 112-byte struct once decoded,
/// up to twice that with the vector's spare capacity, and 136 bytes more once converted to
/// Kubernetes types).
pub const KARMADA_PROTO_EXPANSION: u64 = 384;
/// Peak memory per manifest node (scalar or collection, as the pre-scan counts them) while
/// a request's manifests are decoded and used (measured worst case: a pod's `volumes` of
/// `{name: a}` items, 3,080 bytes per node, each item a Kubernetes `Volume` struct with its
/// thirty optional sources; a flow sequence of one-letter strings costs 74 bytes per node).
pub const NODE_COST: u64 = 3_200;

/// The expected memory of a request of `body_bytes` whose bytes expand by `expansion`.
pub fn cost(body_bytes: u64, expansion: u64) -> u64 {
    BASE_COST.saturating_add(body_bytes.saturating_mul(expansion))
}

/// Bounds of the admission budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetLimits {
    /// Bytes charged to requests in progress at most (`--api-max-inflight-bytes`).
    pub total: u64,
    /// Bytes charged to one identity at most.
    pub share: u64,
    /// How long a request over budget waits for room before it is refused.
    pub wait: Duration,
}

impl BudgetLimits {
    /// `total` bytes, half of them per identity, 1 s of waiting.
    pub fn new(total: u64) -> BudgetLimits {
        BudgetLimits {
            total,
            share: total / 2,
            wait: Duration::from_secs(1),
        }
    }
}

impl Default for BudgetLimits {
    /// 1 GiB (the daemon sizes it from the container's memory limit).
    fn default() -> Self {
        BudgetLimits::new(1 << 30)
    }
}

#[derive(Debug, Default)]
struct Used {
    total: u64,
    by: HashMap<String, u64>,
}

/// The replica-wide budget (see the module docs). Cheap to share.
#[derive(Debug)]
pub struct Budget {
    limits: BudgetLimits,
    used: Mutex<Used>,
    freed: Notify,
    metrics: Arc<Metrics>,
}

/// Bytes charged to one request; released when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<Budget>,
    api: &'static str,
    who: String,
    bytes: u64,
}

impl Charge {
    /// The bytes charged.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Lowers the charge to `bytes` once the request's real size is known (never raises it).
    pub fn lower_to(&mut self, bytes: u64) {
        if bytes < self.bytes {
            let less = self.bytes - bytes;
            self.budget.release(&self.who, less);
            self.bytes = bytes;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.release(&self.who, self.bytes);
    }
}

/// Why a request could not be charged.
enum Full {
    Budget,
    Share,
}

impl Budget {
    /// A budget with `limits`, reporting into `metrics`.
    pub fn new(limits: BudgetLimits, metrics: Arc<Metrics>) -> Arc<Budget> {
        metrics.api_inflight_budget_bytes.set(limits.total as f64);
        Arc::new(Budget {
            limits,
            used: Mutex::new(Used::default()),
            freed: Notify::new(),
            metrics,
        })
    }

    /// The budget's bounds.
    pub fn limits(&self) -> BudgetLimits {
        self.limits
    }

    /// Bytes charged now.
    pub fn in_use(&self) -> u64 {
        self.lock().total
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Used> {
        // A panic while holding the lock leaves counts that are still consistent.
        self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn try_take(
        self: &Arc<Self>,
        api: &'static str,
        who: &str,
        bytes: u64,
    ) -> Result<Charge, Full> {
        let mut used = self.lock();
        let mine = used.by.get(who).copied().unwrap_or(0);
        if used.total.saturating_add(bytes) > self.limits.total {
            return Err(Full::Budget);
        }
        if mine.saturating_add(bytes) > self.limits.share {
            return Err(Full::Share);
        }
        used.total += bytes;
        *used.by.entry(who.to_owned()).or_insert(0) += bytes;
        self.metrics.api_inflight_bytes.set(used.total as f64);
        Ok(Charge {
            budget: self.clone(),
            api,
            who: who.to_owned(),
            bytes,
        })
    }

    fn release(&self, who: &str, bytes: u64) {
        {
            let mut used = self.lock();
            used.total = used.total.saturating_sub(bytes);
            if let Some(n) = used.by.get_mut(who) {
                *n = n.saturating_sub(bytes);
                if *n == 0 {
                    used.by.remove(who);
                }
            }
            self.metrics.api_inflight_bytes.set(used.total as f64);
        }
        self.freed.notify_waiters();
    }

    /// Charges `bytes` to `who`, waiting up to the budget's `wait` for room; a refusal is
    /// counted under `api` and says which bound was full.
    pub async fn admit(
        self: &Arc<Self>,
        api: &'static str,
        who: &str,
        bytes: u64,
    ) -> Result<Charge, ApiError> {
        self.admit_beyond(api, who, bytes, 0).await
    }

    /// [`Budget::admit`] for a request already charged `held` bytes (which count towards
    /// the share when deciding whether it can ever fit).
    async fn admit_beyond(
        self: &Arc<Self>,
        api: &'static str,
        who: &str,
        bytes: u64,
        held: u64,
    ) -> Result<Charge, ApiError> {
        let l = self.limits;
        if bytes.saturating_add(held) > l.share {
            return Err(self.refuse(
                api,
                "too_large",
                format!(
                    "this request is expected to need {} bytes of memory, more than one caller's share ({} bytes) of the API memory budget (--api-max-inflight-bytes {}); send a smaller request",
                    bytes.saturating_add(held),
                    l.share,
                    l.total
                ),
            ));
        }
        let until = tokio::time::Instant::now() + l.wait;
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            let why = match self.try_take(api, who, bytes) {
                Ok(c) => return Ok(c),
                Err(why) => why,
            };
            if tokio::time::timeout_at(until, freed).await.is_err() {
                let used = self.lock();
                let mine = used.by.get(who).copied().unwrap_or(0);
                let (reason, what) = match why {
                    Full::Budget => (
                        "budget",
                        format!(
                            "the API memory budget (--api-max-inflight-bytes {}) has {} bytes in use",
                            l.total, used.total
                        ),
                    ),
                    Full::Share => (
                        "identity_share",
                        format!(
                            "{who} already has {mine} of its {} bytes share of the API memory budget (--api-max-inflight-bytes {}) in use",
                            l.share, l.total
                        ),
                    ),
                };
                drop(used);
                return Err(self.refuse(
                    api,
                    reason,
                    format!(
                        "{what}; this request needs {bytes} bytes and waited {:?}: retry later",
                        l.wait
                    ),
                ));
            }
        }
    }

    fn refuse(&self, api: &'static str, reason: &'static str, message: String) -> ApiError {
        self.metrics
            .api_admission_refusals_total
            .with([api, reason])
            .inc();
        tracing::debug!(api, reason, %message, "request refused by the admission budget");
        ApiError::Overloaded(message)
    }
}

thread_local! {
    static CURRENT: std::cell::RefCell<Option<Charge>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` (a backend call on a blocking worker) with `charge` as the call's charge, which
/// [`grow_current`] raises; the charge, raised or not, is released when `f` returns.
pub fn scoped_charge<R>(charge: Option<Charge>, f: impl FnOnce() -> R) -> R {
    struct Release(Option<Charge>);
    impl Drop for Release {
        fn drop(&mut self) {
            let prev = self.0.take();
            // The call's charge (maybe raised) is dropped here: released.
            drop(CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), prev)));
        }
    }
    let _release = Release(CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), charge)));
    f()
}

/// Adds `bytes` to the charge of the backend call running on this (blocking) thread, waiting
/// as [`Budget::admit`] does; `Ok` without effect outside a charged call. Call it before the
/// memory is spent (the replica: with the manifests' pre-scanned node count times
/// [`NODE_COST`], before parsing them).
pub fn grow_current(bytes: u64) -> Result<(), ApiError> {
    let Some(charge) = CURRENT.with(|c| c.borrow_mut().take()) else {
        return Ok(());
    };
    let more = match tokio::runtime::Handle::try_current() {
        Ok(rt) => rt.block_on(charge.budget.admit_beyond(
            charge.api,
            &charge.who,
            bytes,
            charge.bytes,
        )),
        Err(_) => Err(ApiError::Internal(
            "a charged call runs outside the runtime".into(),
        )),
    };
    let mut charge = charge;
    let r = more.map(|mut m| {
        charge.bytes += std::mem::take(&mut m.bytes);
    });
    CURRENT.with(|c| *c.borrow_mut() = Some(charge));
    r
}

/// Where a request's [`Charge`] waits in its extensions until the handler moves it into the
/// worker (extensions must be `Clone`; the charge itself must not be).
#[derive(Debug, Clone, Default)]
pub struct ChargeSlot(Arc<Mutex<Option<Charge>>>);

impl ChargeSlot {
    /// A slot holding `c`.
    pub fn new(c: Charge) -> ChargeSlot {
        ChargeSlot(Arc::new(Mutex::new(Some(c))))
    }

    /// The charge, once.
    pub fn take(&self) -> Option<Charge> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(total: u64, share: u64) -> Arc<Budget> {
        Budget::new(
            BudgetLimits {
                total,
                share,
                wait: Duration::from_millis(200),
            },
            Arc::new(Metrics::new()),
        )
    }

    #[tokio::test]
    async fn over_budget_waits_then_is_refused_naming_the_budget() {
        let b = budget(100, 60);
        let a = b.admit("http", "a", 60).await.unwrap();
        // Over a's share.
        let e = b.admit("http", "a", 10).await.unwrap_err().to_string();
        assert!(
            e.contains("share") && e.contains("--api-max-inflight-bytes 100"),
            "{e}"
        );
        // Another identity fits in what is left, but not beyond the total.
        let c = b.admit("http", "c", 40).await.unwrap();
        let e = b.admit("http", "d", 1).await.unwrap_err().to_string();
        assert!(
            e.contains("budget") && e.contains("100 bytes in use"),
            "{e}"
        );
        assert_eq!(b.in_use(), 100);
        // Too large alone: refused at once.
        let e = b.admit("http", "d", 61).await.unwrap_err().to_string();
        assert!(e.contains("more than one caller's share"), "{e}");
        let m = &b.metrics;
        let refused = |r: &str| m.api_admission_refusals_total.with(["http", r]).get();
        assert_eq!(
            (
                refused("identity_share"),
                refused("budget"),
                refused("too_large")
            ),
            (1, 1, 1)
        );
        drop((a, c));
        assert_eq!(b.in_use(), 0);
        assert_eq!(m.api_inflight_bytes.get(), 0.0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_worker_raises_its_charge_and_releases_it_all_at_its_end() {
        let b = budget(1000, 600);
        let c = b.admit("http", "a", 100).await.unwrap();
        let b2 = b.clone();
        let (grown, too_much, inside) = tokio::task::spawn_blocking(move || {
            scoped_charge(Some(c), || {
                let grown = grow_current(300);
                let inside = b2.in_use();
                // 400 held + 300 more is over the 600 share: refused at once.
                let too_much = grow_current(300).unwrap_err().to_string();
                (grown, too_much, inside)
            })
        })
        .await
        .unwrap();
        assert_eq!(grown, Ok(()));
        assert_eq!(inside, 400);
        assert!(too_much.contains("700 bytes"), "{too_much}");
        assert_eq!(b.in_use(), 0, "released with the worker's end");
        // Outside a charged call: nothing to grow.
        assert_eq!(grow_current(1 << 40), Ok(()));
    }

    #[tokio::test]
    async fn a_waiting_request_is_admitted_when_a_charge_is_released() {
        let b = budget(100, 100);
        let mut a = b.admit("http", "a", 100).await.unwrap();
        let b2 = b.clone();
        let waiter =
            tokio::spawn(async move { b2.admit("http", "b", 50).await.map(|c| c.bytes()) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.lower_to(50);
        assert_eq!(waiter.await.unwrap().unwrap(), 50);
        assert_eq!(b.in_use(), 50);
    }
}
