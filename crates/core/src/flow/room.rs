//! The waiting room: the queue, each request's deadline, and the bound on how many wait.
//! Generic over the clock (`D`): the gateway's is tokio's `Instant`, a simulation's its
//! virtual time.

use std::collections::VecDeque;

use super::{EntryId, FlowQueue, Priority};

/// Requests waiting for room, with their deadlines.
#[derive(Debug)]
pub struct WaitingRoom<T, D> {
    queue: FlowQueue<T>,
    /// Each request's deadline, by arrival: every request may wait as long, so deadlines
    /// come due in arrival order. Requests that left early stay here until their deadline
    /// and are skipped then.
    deadlines: VecDeque<(D, EntryId)>,
    max_waiting: usize,
}

impl<T, D: Ord + Copy> WaitingRoom<T, D> {
    /// A room for at most `max_waiting` requests.
    pub fn new(max_waiting: usize) -> Self {
        WaitingRoom {
            queue: FlowQueue::new(),
            deadlines: VecDeque::new(),
            max_waiting,
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

    /// Holds `item` until `deadline` at the end of its tenant's queue in its band, unless
    /// the room is full (`None`, and the item is dropped).
    pub fn hold(
        &mut self,
        priority: Priority,
        tenant: &str,
        item: T,
        deadline: D,
    ) -> Option<EntryId> {
        if self.queue.len() >= self.max_waiting {
            return None;
        }
        let id = self.queue.push(priority, tenant, item);
        self.deadlines.push_back((deadline, id));
        Some(id)
    }

    /// The earliest deadline of a request still waiting, if any.
    pub fn next_deadline(&mut self) -> Option<D> {
        // Requests that left early are dropped from the front on the way.
        while let Some(&(deadline, id)) = self.deadlines.front() {
            if self.queue.contains(id) {
                return Some(deadline);
            }
            self.deadlines.pop_front();
        }
        None
    }

    /// Takes out the requests whose deadline is at or before `now`, in arrival order.
    pub fn expire(&mut self, now: D) -> Vec<T> {
        let mut expired = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.front() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_front();
            if let Some(item) = self.queue.remove(id) {
                expired.push(item);
            }
        }
        expired
    }

    /// Takes a request out before its deadline (its client left).
    pub fn remove(&mut self, id: EntryId) -> Option<T> {
        self.queue.remove(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_run_out_in_arrival_order_and_a_full_room_refuses() {
        let mut room: WaitingRoom<&str, u32> = WaitingRoom::new(3);
        let first = room.hold(0, "t", "first", 10).expect("room");
        room.hold(5, "t", "second", 20).expect("room");
        room.hold(0, "u", "third", 30).expect("room");
        assert!(room.hold(0, "t", "fourth", 40).is_none(), "full");
        assert!(room.must_queue_behind(5) && room.must_queue_behind(0));
        assert!(!room.must_queue_behind(6));
        assert_eq!(room.remove(first), Some("first"));
        assert_eq!(
            room.next_deadline(),
            Some(20),
            "the one that left is skipped"
        );
        assert_eq!(room.expire(25), ["second"]);
        assert_eq!(room.expire(25), Vec::<&str>::new());
        assert_eq!(room.next_deadline(), Some(30));
        assert_eq!(room.queue().len(), 1);
    }
}
