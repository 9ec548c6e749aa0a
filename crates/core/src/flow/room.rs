//! The waiting room: the queue, each request's deadline, and the bound on how many wait.
//! Generic over the clock (`D`): the gateway's is tokio's `Instant`, a simulation's its
//! virtual time.

use std::collections::VecDeque;
use std::ops::{Add, Sub};
use std::time::Duration;

use super::{EntryId, FlowQueue, FlowSettings, Priority, StandingQueue};

/// Requests waiting for room, with their deadlines.
#[derive(Debug)]
pub struct WaitingRoom<T, D> {
    queue: FlowQueue<T>,
    /// Each request's deadline and priority, by arrival: every request may wait as long,
    /// so deadlines come due in arrival order. Requests that left early stay here until
    /// their deadline and are skipped then.
    deadlines: VecDeque<(D, EntryId, Priority)>,
    max_waiting: usize,
    max_wait: Duration,
    standing: Option<StandingQueue>,
    /// When the queue last went from empty to holding a request: it has held requests
    /// without a break since, as long as it is not empty.
    busy_since: Option<D>,
    /// The arrival the last deadline counted from.
    last_arrival: Option<D>,
}

impl<T, D> WaitingRoom<T, D>
where
    D: Ord + Copy + Add<Duration, Output = D> + Sub<Duration, Output = D>,
{
    /// A room for at most `settings.max_waiting` requests, each waiting at most
    /// `settings.max_wait` (`settings.standing`'s wait while the queue stands).
    pub fn new(settings: &FlowSettings) -> Self {
        WaitingRoom {
            queue: FlowQueue::new(),
            deadlines: VecDeque::new(),
            max_waiting: settings.max_waiting,
            max_wait: settings.max_wait,
            standing: settings.standing.filter(|s| s.wait < settings.max_wait),
            busy_since: None,
            last_arrival: None,
        }
    }

    /// The queue, in flow control's order.
    pub fn queue(&self) -> &FlowQueue<T> {
        &self.queue
    }

    /// The queue, to dispatch from.
    pub fn queue_mut(&mut self) -> &mut FlowQueue<T> {
        &mut self.queue
    }

    /// Whether a request of `priority` must queue behind requests already waiting (some of
    /// them have at least its priority): a newcomer does not pass them.
    pub fn must_queue_behind(&self, priority: Priority) -> bool {
        self.queue
            .highest_priority()
            .is_some_and(|highest| highest >= priority)
    }

    /// Holds `item`, which arrived at `arrival`, at the end of its tenant's queue in its
    /// band until `arrival + max_wait`, unless the room is full (`None`, and the item is
    /// dropped). Returns its place and its deadline.
    pub fn hold(
        &mut self,
        priority: Priority,
        tenant: &str,
        item: T,
        arrival: D,
    ) -> Option<(EntryId, D)> {
        if self.queue.len() >= self.max_waiting {
            return None;
        }
        // Deadlines must come due in the order they are pushed (the scans below stop at
        // the first one not due). Two requests stamped just before racing for the
        // gateway's lock can arrive here out of order: the later one counts from the
        // earlier one's stamp, microseconds later.
        let arrival = self.last_arrival.map_or(arrival, |last| arrival.max(last));
        self.last_arrival = Some(arrival);
        if self.queue.is_empty() {
            self.busy_since = Some(arrival);
        }
        let deadline = arrival + self.max_wait;
        let id = self.queue.push(priority, tenant, item);
        self.deadlines.push_back((deadline, id, priority));
        Some((id, deadline))
    }

    /// Whether the queue stands at `now`: it has held requests without a break for the
    /// standing bound's `after`, so the waits of requests at or below the default priority
    /// are bounded by its `wait` ([`WaitingRoom::wait_bound`]).
    pub fn stands(&self, now: D) -> bool {
        self.standing.is_some_and(|standing| {
            !self.queue.is_empty()
                && self
                    .busy_since
                    .is_some_and(|since| since + standing.after <= now)
        })
    }

    /// The longest a request of `priority` may wait at `now`: `max_wait`, or the standing
    /// bound's wait while the queue stands. Requests above the default priority always
    /// get `max_wait`: an operator who raised an objective asked for it to be served, not
    /// shed early (and sheddable ones never wait).
    pub fn wait_bound(&self, priority: Priority, now: D) -> Duration {
        match self.standing {
            Some(standing) if priority <= 0 && self.stands(now) => standing.wait,
            _ => self.max_wait,
        }
    }

    /// The earliest time a request still waiting must leave, if any: its deadline, or,
    /// with the standing bound, once it has waited that bound's `wait` while the queue has
    /// stood for its `after` (`waits_for_pods` as for [`WaitingRoom::expire`]).
    pub fn next_deadline(&mut self, waits_for_pods: impl Fn(&T) -> bool) -> Option<D> {
        // Requests that left early are dropped from the front on the way.
        while let Some(&(_, id, _)) = self.deadlines.front() {
            if self.queue.contains(id) {
                break;
            }
            self.deadlines.pop_front();
        }
        let &(deadline, _, _) = self.deadlines.front()?;
        let Some((standing, since)) = self.standing.zip(self.busy_since) else {
            return Some(deadline);
        };
        // The first request the bound applies to arrived at its deadline less `max_wait`,
        // and has waited `wait` at its deadline less `max_wait - wait`.
        let shortened = self
            .deadlines
            .iter()
            .find(|&&(_, id, priority)| {
                standing_bound_applies(&self.queue, id, priority, &waits_for_pods)
            })
            .map(|&(at, _, _)| (at - (self.max_wait - standing.wait)).max(since + standing.after));
        Some(shortened.map_or(deadline, |at| at.min(deadline)))
    }

    /// Takes out the requests whose wait has run out at `now` ([`WaitingRoom::wait_bound`]),
    /// each with the bound it ran out of: those past their deadline first, then, while the
    /// queue stands, those that waited the standing bound, each in arrival order.
    /// `waits_for_pods` names requests that wait for a pod to come up at all rather than
    /// for room (scale from zero, a rollout): they keep `max_wait`, as a fleet without
    /// ready pods is not behind its capacity but starting.
    pub fn expire(&mut self, now: D, waits_for_pods: impl Fn(&T) -> bool) -> Vec<(T, Duration)> {
        let mut expired = Vec::new();
        while let Some(&(deadline, id, _)) = self.deadlines.front() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_front();
            if let Some(item) = self.queue.remove(id) {
                expired.push((item, self.max_wait));
            }
        }
        if let Some(standing) = self.standing.filter(|_| self.stands(now)) {
            // Every request may wait as long, so "has waited `wait`" is "deadline at or
            // before `now` plus what `wait` leaves of `max_wait`": a prefix of the deque,
            // in which requests above the default priority stay.
            // One pass over that prefix, keeping in order the requests that stay: taking
            // each expired one out of the middle of the deque would shift the ones kept
            // before it every time (quadratic under a band of critical requests).
            let due = now + (self.max_wait - standing.wait);
            let prefix = self
                .deadlines
                .partition_point(|&(deadline, _, _)| deadline <= due);
            let mut kept = Vec::new();
            for entry in self.deadlines.drain(..prefix) {
                let (_, id, priority) = entry;
                // Still waiting, and the standing bound does not apply to it.
                let stays = self.queue.contains(id)
                    && !standing_bound_applies(&self.queue, id, priority, &waits_for_pods);
                if stays {
                    kept.push(entry);
                } else if let Some(item) = self.queue.remove(id) {
                    expired.push((item, standing.wait));
                }
            }
            for entry in kept.into_iter().rev() {
                self.deadlines.push_front(entry);
            }
        }
        expired
    }

    /// Takes a request out before its deadline (its client left).
    pub fn remove(&mut self, id: EntryId) -> Option<T> {
        self.queue.remove(id)
    }
}

/// Whether the standing bound's shorter wait applies to the request `id` of `priority`
/// waiting in `queue`: it is at or below the default priority ([`WaitingRoom::wait_bound`])
/// and not waiting for a pod to come up (`waits_for_pods`). False once it left. A function
/// of the queue alone, so that [`WaitingRoom::expire`] asks it while draining the deadlines.
fn standing_bound_applies<T>(
    queue: &FlowQueue<T>,
    id: EntryId,
    priority: Priority,
    waits_for_pods: impl Fn(&T) -> bool,
) -> bool {
    priority <= 0 && queue.get(id).is_some_and(|item| !waits_for_pods(item))
}

#[cfg(test)]
mod tests {
    use super::*;

    impl<T, D> WaitingRoom<T, D>
    where
        D: Ord + Copy + Add<Duration, Output = D> + Sub<Duration, Output = D>,
    {
        /// What ran out at `now`, when no request waits for pods.
        fn expire_all(&mut self, now: D) -> Vec<T> {
            self.expire(now, |_| false)
                .into_iter()
                .map(|(item, _)| item)
                .collect()
        }
    }

    fn room(
        max_waiting: usize,
        standing: Option<StandingQueue>,
    ) -> WaitingRoom<&'static str, Duration> {
        WaitingRoom::new(&FlowSettings {
            max_wait: Duration::from_secs(10),
            max_waiting,
            standing,
            ..FlowSettings::default()
        })
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// A room of 100 whose queue stands after `after` seconds and then bounds waits by
    /// `wait` seconds.
    fn standing_room(after: u64, wait: u64) -> WaitingRoom<&'static str, Duration> {
        room(
            100,
            Some(StandingQueue {
                after: secs(after),
                wait: secs(wait),
            }),
        )
    }

    #[test]
    fn waits_run_out_in_arrival_order_and_a_full_room_refuses() {
        let mut room = room(3, None);
        let (first, deadline) = room.hold(0, "t", "first", secs(0)).expect("room");
        assert_eq!(deadline, secs(10));
        room.hold(5, "t", "second", secs(10)).expect("room");
        room.hold(0, "u", "third", secs(20)).expect("room");
        assert!(room.hold(0, "t", "fourth", secs(30)).is_none(), "full");
        assert!(room.must_queue_behind(5) && room.must_queue_behind(0));
        assert!(!room.must_queue_behind(6));
        assert_eq!(room.remove(first), Some("first"));
        assert_eq!(
            room.next_deadline(|_| false),
            Some(secs(20)),
            "the one that left is skipped"
        );
        assert!(!room.stands(secs(25)), "no standing bound configured");
        assert_eq!(room.expire_all(secs(25)), ["second"]);
        assert_eq!(room.expire_all(secs(25)), Vec::<&str>::new());
        assert_eq!(room.next_deadline(|_| false), Some(secs(30)));
        assert_eq!(room.queue().len(), 1);
    }

    #[test]
    fn a_queue_that_has_not_emptied_for_the_standing_time_bounds_waits_by_the_shorter_wait() {
        let mut room = standing_room(5, 2);
        room.hold(0, "t", "a", secs(0)).expect("room");
        room.hold(0, "t", "b", secs(4)).expect("room");
        // A burst: before the queue has stood for 5 s, "a" may wait its whole 10 s.
        assert!(!room.stands(secs(4)));
        assert_eq!(room.wait_bound(0, secs(4)), secs(10));
        assert!(room.expire_all(secs(4)).is_empty());
        assert_eq!(
            room.next_deadline(|_| false),
            Some(secs(5)),
            "when the queue will stand"
        );
        // From 5 s the queue stands: "a" has waited 5 s (out), "b" 1 s (stays until 6 s).
        assert!(room.stands(secs(5)));
        assert_eq!(room.expire_all(secs(5)), ["a"]);
        assert_eq!(room.next_deadline(|_| false), Some(secs(6)));
        assert_eq!(room.expire_all(secs(6)), ["b"]);
        // Empty, the queue no longer stands; the next request starts a new busy period.
        assert!(!room.stands(secs(7)));
        room.hold(0, "t", "c", secs(20)).expect("room");
        assert!(!room.stands(secs(24)));
        assert!(
            room.expire_all(secs(24)).is_empty(),
            "a new burst waits its whole bound"
        );
        assert_eq!(room.next_deadline(|_| false), Some(secs(25)));
        assert_eq!(
            room.expire_all(secs(25)),
            ["c"],
            "stands from 25 s, and c waited 5 s"
        );
    }

    #[test]
    fn raised_priorities_and_requests_waiting_for_pods_keep_the_longest_wait() {
        let mut room = standing_room(1, 2);
        room.hold(0, "t", "plain", secs(0)).expect("room");
        room.hold(100, "t", "critical", secs(0)).expect("room");
        room.hold(0, "t", "starting", secs(0)).expect("room");
        room.hold(0, "t", "later", secs(2)).expect("room");
        assert_eq!(room.wait_bound(0, secs(3)), secs(2));
        assert_eq!(room.wait_bound(100, secs(3)), secs(10));
        let expired = room.expire(secs(3), |item| *item == "starting");
        assert_eq!(expired, [("plain", secs(2))]);
        let starting = |item: &&str| *item == "starting";
        assert_eq!(
            room.next_deadline(starting),
            Some(secs(4)),
            "\"later\" has waited 2 s at 4 s"
        );
        assert_eq!(room.expire(secs(4), starting), [("later", secs(2))]);
        assert_eq!(room.next_deadline(starting), Some(secs(10)));
        let expired = room.expire(secs(10), |item| *item == "starting");
        assert_eq!(expired, [("critical", secs(10)), ("starting", secs(10))]);
    }

    #[test]
    fn an_arrival_stamped_before_the_previous_ones_counts_from_it() {
        let mut room = standing_room(1, 2);
        let (_, first) = room.hold(100, "t", "critical", secs(3)).expect("room");
        let (_, second) = room.hold(0, "t", "plain", secs(2)).expect("room");
        assert_eq!((first, second), (secs(13), secs(13)), "in push order");
        // The plain one is due at 5 s (counted from 3 s), and is taken out then: the
        // critical one before it in the deque does not hide it.
        assert_eq!(room.next_deadline(|_| false), Some(secs(5)));
        assert_eq!(room.expire_all(secs(5)), ["plain"]);
        assert_eq!(room.next_deadline(|_| false), Some(secs(13)));
    }

    #[test]
    fn a_standing_wait_not_below_the_longest_wait_changes_nothing() {
        let mut room = standing_room(1, 10);
        room.hold(0, "t", "a", secs(0)).expect("room");
        assert!(!room.stands(secs(9)));
        assert_eq!(room.next_deadline(|_| false), Some(secs(10)));
        assert!(room.expire_all(secs(9)).is_empty());
    }
}
