//! How flow control holds requests, what a request's class is, and why one is dropped.

use std::collections::HashMap;
use std::time::Duration;

use super::Priority;

/// The tenant of requests without a fairness id (the reference picker's name for it).
pub const DEFAULT_TENANT: &str = "default-flow";
/// The longest fairness id accepted: an id is a name, not a payload, and each waiting
/// request keeps its own.
pub const MAX_FAIRNESS_ID_BYTES: usize = 256;

/// Default of [`FlowSettings::max_wait`].
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(15);
/// Default of [`FlowSettings::max_waiting`].
pub const DEFAULT_MAX_WAITING: usize = 4096;

/// A bound on waits while the queue stands (CoDel's idea, as request queues use it): a
/// queue that has not emptied for `after` is not absorbing a burst but running behind the
/// fleet, and every request in it would wait out `max_wait` before being refused anyway.
/// Then a request that has waited `wait` is answered (429) at once: the requests that are
/// served start within `wait`, the excess learns at once instead of after `max_wait`, and
/// the pods serve as many either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandingQueue {
    /// How long the queue must have held requests without a break.
    pub after: Duration,
    /// The wait allowed meanwhile.
    pub wait: Duration,
}

impl StandingQueue {
    /// The bound from its two flags; either at zero switches it off.
    pub fn from_flags(after: Duration, wait: Duration) -> Option<Self> {
        (!after.is_zero() && !wait.is_zero()).then_some(StandingQueue { after, wait })
    }
}

/// Default of [`FlowSettings::standing`].
pub const DEFAULT_STANDING: StandingQueue = StandingQueue {
    after: Duration::from_secs(5),
    wait: Duration::from_secs(2),
};

/// How flow control holds requests.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowSettings {
    /// Longest a request waits for room; then it is answered 429 (503 with no ready pod).
    /// Zero switches the queue off: a request that fits no pod goes to the least bad one.
    pub max_wait: Duration,
    /// Most requests waiting at once; beyond it a request that fits no pod is refused
    /// at once (429).
    pub max_waiting: usize,
    /// With no ready pod for a request, hold it up to `max_wait` (pods may be starting:
    /// scale from zero) rather than answer 503 at once.
    pub hold_without_endpoints: bool,
    /// Objective name → priority.
    pub objectives: HashMap<String, Priority>,
    /// The shorter bound on waits while the queue stands; `None`: `max_wait` always.
    pub standing: Option<StandingQueue>,
}

impl Default for FlowSettings {
    fn default() -> Self {
        FlowSettings {
            max_wait: DEFAULT_MAX_WAIT,
            max_waiting: DEFAULT_MAX_WAITING,
            hold_without_endpoints: true,
            objectives: HashMap::new(),
            standing: Some(DEFAULT_STANDING),
        }
    }
}

impl FlowSettings {
    /// Whether requests may wait at all.
    pub fn queues(&self) -> bool {
        !self.max_wait.is_zero() && self.max_waiting > 0
    }

    /// The class of a request from its objective and fairness-id header values.
    pub fn classify(
        &self,
        objective: Option<&str>,
        fairness_id: Option<&str>,
    ) -> Result<RequestClass, ClassError> {
        let priority = objective
            .and_then(|name| self.objectives.get(name.trim()))
            .copied()
            .unwrap_or(0);
        let tenant = match fairness_id.map(str::trim) {
            None | Some("") => DEFAULT_TENANT.to_owned(),
            Some(id) if id.len() > MAX_FAIRNESS_ID_BYTES => {
                return Err(ClassError::FairnessIdTooLong(id.len()));
            }
            Some(id) => id.to_owned(),
        };
        Ok(RequestClass { priority, tenant })
    }
}

/// A request's place in flow control.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestClass {
    pub priority: Priority,
    /// The fairness id, or [`DEFAULT_TENANT`].
    pub tenant: String,
}

impl Default for RequestClass {
    fn default() -> Self {
        RequestClass {
            priority: 0,
            tenant: DEFAULT_TENANT.to_owned(),
        }
    }
}

/// A class header kvroute refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClassError {
    #[error("the fairness id is {0} bytes long; at most {MAX_FAIRNESS_ID_BYTES} are accepted")]
    FairnessIdTooLong(usize),
}

/// Why flow control dropped a request: the value of [`DROPPED_REASON_HEADER`], as the
/// reference picker spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// No pod has room, and the request is sheddable or the queue is full: 429.
    Saturated,
    /// It waited `--max-queue-wait` and no pod had room: 429.
    TtlExpired,
    /// No ready pod for it (at once, or after its wait): 503.
    NoEndpoints,
    /// kvroute is shutting down: 503.
    ShuttingDown,
}

impl DropReason {
    pub const ALL: [DropReason; 4] = [
        DropReason::Saturated,
        DropReason::TtlExpired,
        DropReason::NoEndpoints,
        DropReason::ShuttingDown,
    ];

    /// The HTTP status the gateway answers with: 429 while pods exist but have no room,
    /// 503 when none can serve.
    pub fn status(self) -> u16 {
        match self {
            DropReason::Saturated | DropReason::TtlExpired => 429,
            DropReason::NoEndpoints | DropReason::ShuttingDown => 503,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Saturated => "rejected-saturated",
            DropReason::TtlExpired => "rejected-ttl-expired",
            DropReason::NoEndpoints => "rejected-no-endpoints",
            DropReason::ShuttingDown => "rejected-shutting-down",
        }
    }
}

/// Requests a dispatch pass may find without room before it stops: each costs a pick, and
/// the next change of capacity starts a new pass.
pub const MAX_MISSES_PER_PASS: usize = 16;
