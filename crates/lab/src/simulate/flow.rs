//! The gateway's flow control in virtual time: requests' classes, the waiting room and the
//! reasons a request is shed.
//!
//! What it mirrors, with the virtual clock in place of tokio's: `src/flow.rs` (an objective
//! names a priority through the workload's `objectives`, as `--objective-priority` gives
//! them to the live kvroute; an objective not in the map gets 0; no tenant is
//! `default-flow`; the drop reasons' names) and `src/picker/waiting.rs` (the queue of
//! `kvroute_core::flow`, each request's deadline in arrival order, at most
//! [`DEFAULT_MAX_WAITING`] waiting, a newcomer queueing behind requests of its priority or
//! higher). What a pass does with the room is `policy::Kvroute::dispatch`, the mirror of
//! `LivePicker::dispatch_waiting`.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::fleet::{ModelClass, Snapshot};
use kvroute_core::flow::{EntryId, FlowQueue, Priority};
use kvroute_core::request::InferenceRequest;

use crate::loadgen::Workload;

/// Most requests waiting at once, as the live kvroute's default (`--max-queue-waiting`).
pub const DEFAULT_MAX_WAITING: usize = 4096;
/// The tenant of requests without a fairness id (the live gateway's and the reference
/// picker's name for it).
pub const DEFAULT_TENANT: &str = "default-flow";
/// Requests a dispatch pass may find without room before it stops, as the live one.
pub const MAX_MISSES_PER_PASS: usize = 16;

/// Why flow control shed a request: the value the gateway puts in
/// `x-llm-d-request-dropped-reason`, as `src/flow.rs` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// No pod has room, and the request is sheddable or the queue is full: 429.
    Saturated,
    /// It waited the longest it may and no pod had room: 429.
    TtlExpired,
    /// No ready pod for it (at once, or after its wait): 503.
    NoEndpoints,
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Saturated => "rejected-saturated",
            DropReason::TtlExpired => "rejected-ttl-expired",
            DropReason::NoEndpoints => "rejected-no-endpoints",
        }
    }

    /// The HTTP status the gateway answers with.
    pub fn status(self) -> u16 {
        match self {
            DropReason::Saturated | DropReason::TtlExpired => 429,
            DropReason::NoEndpoints => 503,
        }
    }
}

/// A request's place in flow control (`src/flow.rs`'s `RequestClass`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowClass {
    pub priority: Priority,
    pub tenant: Arc<str>,
}

/// The flow-control class of each of `workload`'s request classes, in class order: what the
/// live kvroute makes of the headers the load generator sends for it
/// (`FlowSettings::classify` with the workload's `objectives` as its map).
pub fn classes(workload: &Workload) -> Vec<FlowClass> {
    let objectives = workload.objectives.as_ref();
    workload
        .classes
        .iter()
        .map(|c| FlowClass {
            priority: c
                .objective
                .as_deref()
                .and_then(|name| objectives.and_then(|map| map.get(name.trim())))
                .copied()
                .unwrap_or(0),
            tenant: match c.tenant.as_deref().map(str::trim) {
                None | Some("") => Arc::from(DEFAULT_TENANT),
                Some(id) => Arc::from(id),
            },
        })
        .collect()
}

/// How the simulated kvroute holds requests (`src/flow.rs`'s `FlowSettings`).
#[derive(Debug, Clone, PartialEq)]
pub struct FlowSettings {
    /// Longest a request waits for room, virtual time; zero switches the queue off.
    pub max_wait: Duration,
    /// Most requests waiting at once.
    pub max_waiting: usize,
}

impl FlowSettings {
    /// Whether requests may wait at all.
    pub fn queues(&self) -> bool {
        !self.max_wait.is_zero() && self.max_waiting > 0
    }
}

/// A held request: what placing it needs (`src/picker/waiting.rs`'s `Waiter`). The answer
/// channel is the caller's `slot`.
#[derive(Debug)]
pub struct Waiter {
    /// The caller's name for the request.
    pub slot: u32,
    pub request: InferenceRequest,
    /// The prompt's prefix-block hashes, computed once.
    pub blocks: Vec<u64>,
    /// The pods it competes for: a digest of its base model.
    pub pods_key: u64,
    pub priority: Priority,
    pub tenant: Arc<str>,
    /// Its last try found no ready pod at all: when its wait runs out it is answered 503.
    pub no_endpoint: Cell<bool>,
    /// When it arrived.
    pub since: Duration,
}

/// The queue and the deadlines of the requests in it.
#[derive(Debug)]
pub struct WaitingRoom {
    pub settings: FlowSettings,
    pub queue: FlowQueue<Waiter>,
    /// Each request's deadline, by arrival (every request may wait as long, so they come
    /// due in arrival order). Requests that left early stay until their deadline.
    deadlines: VecDeque<(Duration, EntryId)>,
}

impl WaitingRoom {
    pub fn new(settings: FlowSettings) -> Self {
        WaitingRoom {
            settings,
            queue: FlowQueue::new(),
            deadlines: VecDeque::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether a request of `priority` must queue behind requests already waiting.
    pub fn must_queue_behind(&self, priority: Priority) -> bool {
        self.queue
            .highest_priority()
            .is_some_and(|highest| highest >= priority)
    }

    /// Holds `waiter` until its deadline, unless the room is full (`None`); returns its
    /// place and its deadline.
    pub fn hold(&mut self, waiter: Waiter) -> Option<(EntryId, Duration)> {
        if self.queue.len() >= self.settings.max_waiting {
            return None;
        }
        let deadline = waiter.since + self.settings.max_wait;
        let tenant = Arc::clone(&waiter.tenant);
        let id = self.queue.push(waiter.priority, &tenant, waiter);
        self.deadlines.push_back((deadline, id));
        Some((id, deadline))
    }

    /// Takes out the requests whose deadline is at or before `now`.
    pub fn expire(&mut self, now: Duration) -> Vec<Waiter> {
        let mut expired = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.front() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_front();
            if let Some(waiter) = self.queue.remove(id) {
                expired.push(waiter);
            }
        }
        expired
    }

    /// Takes a request out without serving it (its client gave up).
    pub fn leave(&mut self, id: EntryId) -> Option<Waiter> {
        self.queue.remove(id)
    }
}

/// What a request competes for in the waiting room: a digest of its base model (an adapter
/// runs on its base model's pods), as the live `pods_key`.
pub fn pods_key(model: &str, snapshot: &Snapshot, adapters: &HashMap<String, String>) -> u64 {
    let base = match adapters.get(model) {
        Some(base) => base.as_str(),
        None => match snapshot.models.class(model) {
            Some(ModelClass::Adapter { base }) => base.as_str(),
            _ => model,
        },
    };
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(base, &mut hasher);
    std::hash::Hasher::finish(&hasher)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter(slot: u32, priority: Priority, since: Duration) -> Waiter {
        Waiter {
            slot,
            request: InferenceRequest {
                model: "m".into(),
                prompt_tokens: 10,
                max_output_tokens: Some(10),
                stream: true,
                prompt_prefix: Vec::new(),
                prefix_context: 0,
            },
            blocks: Vec::new(),
            pods_key: 0,
            priority,
            tenant: Arc::from(DEFAULT_TENANT),
            no_endpoint: Cell::new(false),
            since,
        }
    }

    #[test]
    fn requests_expire_at_their_deadline_and_the_room_holds_at_most_its_bound() {
        let mut room = WaitingRoom::new(FlowSettings {
            max_wait: Duration::from_secs(15),
            max_waiting: 2,
        });
        assert!(!room.must_queue_behind(0));
        let (first, deadline) = room.hold(waiter(0, 0, Duration::ZERO)).expect("room");
        assert_eq!(deadline, Duration::from_secs(15));
        assert!(room.must_queue_behind(0) && room.must_queue_behind(-1));
        assert!(!room.must_queue_behind(1), "a higher priority passes");
        room.hold(waiter(1, 0, Duration::from_secs(1)))
            .expect("room");
        assert!(room.hold(waiter(2, 0, Duration::from_secs(2))).is_none());
        assert!(room.expire(Duration::from_millis(14_999)).is_empty());
        assert!(room.leave(first).is_some());
        // The first left: its deadline passes unnoticed; the second's is exact.
        assert!(room.expire(Duration::from_secs(15)).is_empty());
        let expired = room.expire(Duration::from_secs(16));
        assert_eq!(expired.iter().map(|w| w.slot).collect::<Vec<_>>(), [1]);
        assert!(room.is_empty());
    }

    #[test]
    fn objectives_name_priorities_and_a_class_without_a_tenant_is_default_flow() {
        let mut w = crate::loadgen::Workload::from_file(
            &std::path::Path::new(crate::WORKLOADS_DIR).join("overload-priority.yaml"),
        )
        .expect("shipped");
        w.classes[1].objective = Some("unknown".into());
        let classes = classes(&w);
        assert_eq!(classes[0].priority, 100);
        assert_eq!(classes[1].priority, 0, "an objective not in the map");
        assert_eq!(&*classes[0].tenant, DEFAULT_TENANT);
        w.objectives = None;
        assert_eq!(
            super::classes(&w)[0].priority,
            0,
            "no map: every objective 0"
        );
    }
}
