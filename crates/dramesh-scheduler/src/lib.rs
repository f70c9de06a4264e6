//! dramesh-scheduler: the pure core of the Karmada scheduler role. A dramesh replica
//! schedules the ResourceBindings and ClusterResourceBindings whose `spec.schedulerName`
//! names it, as karmada-scheduler would, with device-aware estimates from its own view.
//!
//! JSON objects as the Karmada API server returns them go in ([`Binding`], [`Cluster`],
//! PriorityClasses, resource templates and ResourceClaimTemplates); decisions and the merge
//! patch bodies karmada-scheduler would send come out. No async runtime, no client, no
//! clock: the time of a write is an argument.
//!
//! - [`object`]: typed input, lenient with what servers emit, strict where a decision needs it.
//! - [`placement`]: Karmada's `Placement` in Go's field order (the applied-placement annotation).
//! - [`demand`]: what one replica needs, from the resource template.
//! - [`trigger`]: when to schedule ([`plan`]) and when to retry ([`Backoff`]).
//! - [`general`]: Karmada's general estimator (resource summary and resource models).
//! - [`decide`](mod@decide): filter, estimate, select, assign ([`decide()`]).
//! - [`patch`]: the bodies of the writes.
//! - [`preempt`](mod@preempt): which lower-priority bindings to evict, and their patches.
//! - [`share`]: which of the replicas sharing the work owns a binding (rendezvous hashing).
//! - [`void`](mod@void): when a decision's reservation holds nothing (the decision is not in
//!   the binding).

pub mod decide;
pub mod demand;
pub mod general;
pub mod object;
pub mod patch;
pub mod placement;
pub mod preempt;
pub mod share;
pub mod trigger;
pub mod void;

pub use decide::{Decision, Event, Fleet, Retry, decide, decide_after_loss};
pub use demand::{Demand, claim_template_names, demand, priority_class_name};
pub use general::{general_estimate, general_replicas, general_sets};
pub use object::{Binding, BindingKind, Cluster, InputError, Readiness, ResourceModel};
pub use patch::{Patch, Reason, ScheduledCondition};
pub use placement::Placement;
pub use preempt::{Eviction, PreemptionPlan, plan_preemption};
pub use trigger::{Action, Backoff, RetryState, Trigger, affected_by_cluster, plan};
