//! kvroute's prefix records, made on the simulation's helper thread while the loop goes on.
//!
//! Routing a request records its prompt's blocks for the chosen pod in the approximate
//! prefix index ([`PrefixIndex::record`]): at kv-pressure's prompt lengths a hundred blocks
//! set and as many of the pod's oldest forgotten, two cache misses each in the index's
//! 128 MiB of tables. At 1,000 pods that was a quarter of the loop's time. Nothing reads
//! the index until the next match, so the records are queued for the helper, which makes
//! them in order, and a match waits for them only when its result could depend on them.
//!
//! Results are those of records made in place: records are made in the order they were
//! routed (the helper takes them from the queue's front one at a time; the loop, when it
//! must wait, takes back those the helper has not started and makes them itself after the
//! one in progress), and a match reads the index before the queue is empty only when its
//! first block is held by no pod and named by no queued record. Records only add their own
//! blocks and forget others, so such a block stays unheld whatever the queue does, and a
//! match stops at its first block when no pod holds it: the match finds nothing either way.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvroute_core::fleet::{DEFAULT_PREFIX_BUDGET_BYTES, PrefixIndex, PrefixMatches, Snapshot};

use super::pods::Chores;

/// One record to make: [`PrefixIndex::record`]'s arguments.
#[derive(Debug)]
struct Record {
    endpoint: SocketAddr,
    blocks: Arc<[u64]>,
    capacity_tokens: u64,
}

impl Record {
    fn make(&self, index: &PrefixIndex) {
        index.record(self.endpoint, &self.blocks, self.capacity_tokens);
    }
}

/// The records not yet made, shared by the loop and the helper.
#[derive(Debug, Default)]
struct Queue {
    waiting: VecDeque<Record>,
    /// The blocks of the record the helper is making, while it makes it.
    making: Option<Arc<[u64]>>,
    /// Whether a chore that empties the queue is with the helper.
    emptying: bool,
}

impl Queue {
    /// Whether a waiting record, or the one being made, names `block`.
    fn names(&self, block: u64) -> bool {
        self.making.iter().any(|blocks| blocks.contains(&block))
            || self.waiting.iter().any(|r| r.blocks.contains(&block))
    }
}

/// kvroute's approximate prefix index with the records still to be made in it.
#[derive(Debug)]
pub struct Remembered {
    index: Arc<PrefixIndex>,
    queue: Arc<Mutex<Queue>>,
    /// The helper, when the simulation has one; without it records are made at once.
    chores: Chores,
}

fn lock(queue: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    queue.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Remembered {
    /// An index of the gateway's default budget.
    pub fn new() -> Self {
        Remembered {
            index: Arc::new(PrefixIndex::with_budget(DEFAULT_PREFIX_BUDGET_BYTES)),
            queue: Arc::default(),
            chores: Chores::default(),
        }
    }

    /// From now on records are made by `chores` (the simulation's helper thread).
    pub fn lend_helper(&mut self, chores: Chores) {
        self.settle();
        self.chores = chores;
    }

    /// [`PrefixIndex::matches`] as if every record routed so far had been made.
    pub fn matches(&mut self, blocks: &[u64], snapshot: &Snapshot) -> PrefixMatches {
        // Following a newer snapshot changes which pods records land on: never ahead of
        // them.
        let independent = self.index.follows(snapshot)
            && blocks
                .first()
                .is_none_or(|&first| !lock(&self.queue).names(first) && !self.index.is_held(first));
        if !independent {
            self.settle();
        }
        self.index.matches(blocks, snapshot)
    }

    /// [`PrefixIndex::record`], queued for the helper when there is one.
    pub fn record(&mut self, endpoint: SocketAddr, blocks: Arc<[u64]>, capacity_tokens: u64) {
        let record = Record {
            endpoint,
            blocks,
            capacity_tokens,
        };
        if !self.chores.is_helper() {
            return record.make(&self.index);
        }
        let mut queue = lock(&self.queue);
        queue.waiting.push_back(record);
        if queue.emptying {
            // The chore with the helper takes this one after the others.
            return;
        }
        queue.emptying = true;
        drop(queue);
        let (index, shared) = (Arc::clone(&self.index), Arc::clone(&self.queue));
        self.chores
            .hand_over(Box::new(move || empty(&index, &shared)));
    }

    /// Makes every queued record: waits for the one the helper is making, then makes the
    /// others here, in order.
    fn settle(&mut self) {
        let mut queue = lock(&self.queue);
        let taken = std::mem::take(&mut queue.waiting);
        while queue.making.is_some() {
            drop(queue);
            std::hint::spin_loop();
            queue = lock(&self.queue);
        }
        drop(queue);
        for record in &taken {
            record.make(&self.index);
        }
    }
}

/// The helper's chore: makes the queue's records from its front until it is empty.
fn empty(index: &PrefixIndex, queue: &Mutex<Queue>) {
    loop {
        let mut shared = lock(queue);
        let Some(record) = shared.waiting.pop_front() else {
            shared.emptying = false;
            return;
        };
        shared.making = Some(Arc::clone(&record.blocks));
        drop(shared);
        let _made = Made(queue);
        record.make(index);
    }
}

/// Clears the record being made however its making ends: one that panics on the helper
/// must not leave the loop waiting for it (the simulation's thread scope raises the panic
/// again when the run ends).
struct Made<'a>(&'a Mutex<Queue>);

impl Drop for Made<'_> {
    fn drop(&mut self) {
        lock(self.0).making = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::pods::Pods;
    use kvroute_core::fleet::{Fleet, PodLoad, PodView, block_hashes};

    fn fleet(pods: usize) -> Fleet {
        let pods = (0..pods)
            .map(|i| {
                let view = PodView::new(super::super::policy::endpoint(i), true, None, None, None);
                (view, Arc::new(PodLoad::default()))
            })
            .collect();
        Fleet::new_after(&Fleet::default(), pods, 1, 1)
    }

    /// Records queued for the helper leave matches as records made in place leave them,
    /// whether the helper makes them, the loop takes them back, or both.
    #[test]
    fn matches_see_every_record_routed_before_them() {
        let fleet = fleet(4);
        let snapshot = fleet.snapshot();
        // Prompts sharing heads, so most matches depend on the records before them.
        let prompts: Vec<Arc<[u64]>> = (0..200u32)
            .map(|i| {
                let text = format!("{:0>1$}", i % 7, 64 * (1 + (i % 5) as usize))
                    + &"x".repeat(64 * (i % 3) as usize)
                    + &i.to_string().repeat(64);
                Arc::from(block_hashes("m", 0, text.as_bytes()))
            })
            .collect();
        let run = |remembered: &mut Remembered| -> Vec<PrefixMatches> {
            prompts
                .iter()
                .enumerate()
                .map(|(i, blocks)| {
                    let matched = remembered.matches(blocks, snapshot);
                    remembered.record(
                        super::super::policy::endpoint(i % 4),
                        Arc::clone(blocks),
                        // Small pools, so records forget blocks too.
                        16 * 40,
                    );
                    matched
                })
                .collect()
        };
        let in_place = run(&mut Remembered::new());
        assert!(
            in_place.iter().filter(|m| m.any()).count() > 100,
            "most prompts match what came before"
        );
        std::thread::scope(|scope| {
            let mut pods = Pods::new(Vec::new());
            pods.start_helper(scope);
            let mut helped = Remembered::new();
            helped.lend_helper(pods.chores());
            assert_eq!(run(&mut helped), in_place);
        });
    }
}
