//! The live waiting room: requests that fit no pod now, held until one has room.
//!
//! A held request costs no thread: its ext_proc stream awaits a oneshot answer
//! ([`crate::extproc::Waiting`]). One dispatcher task (`LivePicker::run_waiting_room`)
//! walks the queue whenever room may have appeared: a request ended, a scrape or a
//! discovery change published a new fleet, a request joined the queue. It also answers the
//! requests whose wait ran out. The order and the rules of a walk are
//! `kvroute_core::flow`'s.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kvroute_core::flow::{EntryId, Priority};
use kvroute_core::request::{EndpointSubset, InferenceRequest, RouteRequest};
use tokio::sync::{Notify, oneshot};
// Tokio's clock, so that tests can pause and advance it.
use tokio::time::Instant;

use crate::extproc::{Routed, Unrouted};
use crate::flow::FlowSettings;
use crate::telemetry::{self, ModelLabels};

use super::InFlightRequest;

/// What the dispatcher answers a held request with.
pub(super) type Answer = oneshot::Sender<Result<Routed<InFlightRequest>, Unrouted>>;

/// A held request: what placing it needs, and where its answer goes.
pub(super) struct Waiter {
    pub(super) request: Option<InferenceRequest>,
    pub(super) subset: Option<EndpointSubset>,
    /// The prompt's prefix blocks, computed once.
    pub(super) blocks: kvroute_core::kvevents::PromptBlocks,
    pub(super) first_token_visible: bool,
    pub(super) labels: ModelLabels,
    /// The pods it competes for: a digest of its base model.
    pub(super) pods_key: u64,
    pub(super) priority: Priority,
    pub(super) tenant: Arc<str>,
    /// Its last try found no ready pod at all (rather than pods without room): when its
    /// wait runs out it is answered 503, not 429.
    pub(super) no_endpoint: std::sync::atomic::AtomicBool,
    pub(super) since: Instant,
    pub(super) answer: Answer,
}

impl Waiter {
    /// The request as the scheduler sees it.
    pub(super) fn route_request(&self) -> RouteRequest<'_> {
        RouteRequest {
            inference: self.request.as_ref(),
            subset: self.subset.as_ref(),
        }
    }
}

/// The queue and the deadlines of the requests in it (`kvroute_core::flow`'s room, on
/// tokio's clock).
pub(super) type Held = kvroute_core::flow::WaitingRoom<Waiter, Instant>;

/// The waiting room shared by the picker, the dispatcher and each held request's stream.
pub(super) struct WaitingRoom {
    pub(super) settings: Arc<FlowSettings>,
    held: Mutex<Held>,
    /// Requests held, readable without the lock (the common case: none).
    count: AtomicUsize,
    /// Wakes the dispatcher: room may have appeared, or a request joined.
    pub(super) wake: Notify,
}

impl std::fmt::Debug for WaitingRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitingRoom")
            .field("settings", &self.settings)
            .field("held", &self.count.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl WaitingRoom {
    pub(super) fn new(settings: Arc<FlowSettings>) -> Self {
        WaitingRoom {
            held: Mutex::new(Held::new(&settings)),
            settings,
            count: AtomicUsize::new(0),
            wake: Notify::new(),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Held> {
        // The queue is changed in single calls; a panic mid-call leaves at worst one
        // request unanswered, which its stream's end cleans up.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// Whether a request of `priority` must queue behind requests already waiting (some
    /// of them have at least its priority): a newcomer does not pass them.
    pub(super) fn must_queue_behind(&self, priority: Priority) -> bool {
        !self.is_empty() && self.lock().must_queue_behind(priority)
    }

    /// Holds `waiter`, unless the room is full (`None`). The returned place takes the
    /// request out of the queue when dropped.
    pub(super) fn hold(self: &Arc<Self>, tenant: &str, waiter: Waiter) -> Option<HeldPlace> {
        let mut held = self.lock();
        let arrival = waiter.since;
        let (id, _) = held.hold(waiter.priority, tenant, waiter, arrival)?;
        self.changed(&held);
        drop(held);
        self.wake.notify_one();
        Some(HeldPlace {
            room: Arc::clone(self),
            id,
        })
    }

    /// The earliest deadline of a held request, if any.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        if self.is_empty() {
            return None;
        }
        self.lock()
            .next_deadline(|waiter| waiter.no_endpoint.load(Ordering::Relaxed))
    }

    /// Brings the count and the queue gauges up to date after a change.
    pub(super) fn changed(&self, held: &Held) {
        self.count.store(held.queue().len(), Ordering::Release);
        telemetry::record_queue_lengths(held.queue().band_lengths());
    }
}

/// A held request's place in the queue; dropping it (the client left, the stream ended)
/// takes the request out.
pub(super) struct HeldPlace {
    room: Arc<WaitingRoom>,
    id: EntryId,
}

impl Drop for HeldPlace {
    fn drop(&mut self) {
        let mut held = self.room.lock();
        if let Some(waiter) = held.remove(self.id) {
            self.room.changed(&held);
            drop(held);
            telemetry::record_queue_wait(
                waiter.priority,
                telemetry::QueueExit::Left,
                waiter.since.elapsed(),
            );
        }
    }
}
