//! Flow control, the pure part. A request that fits no pod now waits, and requests leave in
//! order of priority (highest band first), then by tenant in turn (round robin between the
//! tenants waiting in a band, so one tenant's burst cannot starve another's), then by
//! arrival.
//!
//! No clock, no I/O. The gateway (`src/picker.rs`) holds the queue under a lock, runs the
//! scheduler to learn what fits and decides when a wait has run out; the offline simulation
//! can run the same rules in virtual time.
//!
//! - [`settings`]: how long and how many requests may wait, a request's class (priority,
//!   tenant) and why one is dropped;
//! - [`queue`]: the order ([`FlowQueue`]: bands, tenants in turn, arrival; `dispatch`), and
//!   [`room`]: the queue with each request's deadline and a bound ([`WaitingRoom`]);
//! - [`rules`]: when a request is held ([`Hold`]) and against which thresholds it is placed
//!   (sheddable requests and a busy tenant leave headroom, a quiet tenant may use it);
//! - [`shares`]: each tenant's requests in flight ([`TenantShares`]);
//! - [`shadows`]: what a dispatch pass's misses say of the requests after them
//!   ([`Shadows`]).

mod queue;
mod room;
mod rules;
mod settings;
mod shadows;
mod shares;

pub use queue::{EntryId, FlowQueue, Holds};
pub use room::WaitingRoom;
pub use rules::{FlowRules, HEADROOM, Hold, pods_key};
pub use settings::{
    ClassError, DEFAULT_MAX_WAIT, DEFAULT_MAX_WAITING, DEFAULT_STANDING, DEFAULT_TENANT,
    DropReason, FlowSettings, MAX_FAIRNESS_ID_BYTES, MAX_MISSES_PER_PASS, RequestClass,
    StandingQueue,
};
pub use shadows::Shadows;
pub use shares::TenantShares;

/// A request's priority: higher is served first; below zero it is sheddable (refused
/// rather than queued when no pod has room), as the Gateway API Inference Extension's
/// `InferenceObjective` defines it.
pub type Priority = i32;

/// Whether requests of `priority` are refused rather than queued when no pod has room.
pub fn is_sheddable(priority: Priority) -> bool {
    priority < 0
}
