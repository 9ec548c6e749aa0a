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
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::flow::{self, EntryId, FlowQueue, Priority};
pub use kvroute_core::flow::{
    DEFAULT_TENANT, DropReason, FlowSettings, MAX_MISSES_PER_PASS, pods_key,
};
use kvroute_core::kvevents::PromptBlocks;
use kvroute_core::request::InferenceRequest;

use crate::loadgen::Workload;

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
    let settings = FlowSettings {
        objectives: workload
            .objectives
            .iter()
            .flatten()
            .map(|(name, priority)| (name.clone(), *priority))
            .collect(),
        ..FlowSettings::default()
    };
    workload
        .classes
        .iter()
        .map(|c| {
            // Tenant ids the workload allows are within the gateway's bound.
            let class = settings
                .classify(c.objective.as_deref(), c.tenant.as_deref())
                .unwrap_or_default();
            FlowClass {
                priority: class.priority,
                tenant: Arc::from(class.tenant),
            }
        })
        .collect()
}

/// A held request: what placing it needs (`src/picker/waiting.rs`'s `Waiter`). The answer
/// channel is the caller's `slot`.
#[derive(Debug)]
pub struct Waiter {
    /// The caller's name for the request.
    pub slot: u32,
    pub request: InferenceRequest,
    /// The prompt's prefix blocks, computed once.
    pub blocks: PromptBlocks,
    /// The pods it competes for: a digest of its base model.
    pub pods_key: u64,
    pub priority: Priority,
    pub tenant: Arc<str>,
    /// Its last try found no ready pod at all: when its wait runs out it is answered 503.
    pub no_endpoint: Cell<bool>,
    /// When it arrived.
    pub since: Duration,
}

/// The live waiting room's state (`src/picker/waiting.rs`), in virtual time:
/// `kvroute_core::flow`'s room, deadlines at arrival plus the longest wait.
#[derive(Debug)]
pub struct WaitingRoom {
    pub settings: FlowSettings,
    room: flow::WaitingRoom<Waiter, Duration>,
}

impl WaitingRoom {
    pub fn new(settings: FlowSettings) -> Self {
        WaitingRoom {
            room: flow::WaitingRoom::new(&settings),
            settings,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.room.queue().is_empty()
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.room.queue().len()
    }

    /// Whether a request of `priority` must queue behind requests already waiting.
    pub fn must_queue_behind(&self, priority: Priority) -> bool {
        self.room.must_queue_behind(priority)
    }

    /// Holds `waiter` until its deadline, unless the room is full (`None`); returns its
    /// place and its deadline.
    pub fn hold(&mut self, waiter: Waiter) -> Option<(EntryId, Duration)> {
        let (tenant, arrival) = (Arc::clone(&waiter.tenant), waiter.since);
        self.room.hold(waiter.priority, &tenant, waiter, arrival)
    }

    /// Takes out the requests whose wait has run out at `now`: their deadline, or the
    /// standing bound's shorter wait (`kvroute_core::flow::WaitingRoom::expire`).
    pub fn expire(&mut self, now: Duration) -> Vec<Waiter> {
        self.room
            .expire(now, |waiter| waiter.no_endpoint.get())
            .into_iter()
            .map(|(waiter, _)| waiter)
            .collect()
    }

    /// Takes a request out without serving it (its client gave up).
    pub fn leave(&mut self, id: EntryId) -> Option<Waiter> {
        self.room.remove(id)
    }

    /// The queue, to dispatch from.
    pub fn queue_mut(&mut self) -> &mut FlowQueue<Waiter> {
        self.room.queue_mut()
    }
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
            blocks: PromptBlocks::default(),
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
            standing: None,
            ..FlowSettings::default()
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
