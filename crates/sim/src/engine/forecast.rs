//! Reading ahead to an engine's next finish without stepping it.
//!
//! An offline simulation of a thousand pods need not wake a pod at every step: between a
//! request's arrival and the next request's end, nothing a pod does is seen outside it but
//! its tokens, which can be collected later. What the caller must not miss is a finish (it
//! frees the router's accounting). [`Engine::next_finish_bound`] says how far the engine may
//! be left alone: it replays the scheduler's decisions on a copy of the few numbers they
//! read (each running sequence's length, computed tokens, output and blocks; the free
//! blocks; the jitter generator's state) for as long as those decisions are certain, which
//! is while nothing waits, no adapter loads and no step can run short of blocks.

use std::collections::VecDeque;

use rand::rngs::SmallRng;

use crate::profile::{Profile, StepShape};

use super::step::{jitter_factor, step_duration};
use super::{Engine, EngineConfig, RequestId, SimTime};

/// The most steps read ahead: beyond them the caller wakes the engine and asks again.
const MAX_STEPS_AHEAD: usize = 1024;

/// The engine's fields a reading ahead reads and fills in.
struct Reading<'a> {
    running: &'a [RequestId],
    cfg: &'a EngineConfig,
    profile: &'a Profile,
    /// The running sequences, in order.
    ahead: &'a mut [Ahead],
    /// The durations of the steps read.
    plan: &'a mut VecDeque<SimTime>,
    /// The engine's jitter factors drawn ahead, extended from `rng` as steps need them.
    jitters: &'a mut VecDeque<f64>,
    rng: &'a mut SmallRng,
}

/// A running sequence as the scheduler sees it, read ahead.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Ahead {
    tokens: u32,
    computed: u32,
    output: u32,
    max_output: u32,
    blocks: u32,
    /// Tokens scheduled in the step being read.
    scheduled: u32,
}

impl Ahead {
    /// The step computed `n` more tokens; true if that sampled the sequence's last token.
    fn computed(&mut self, n: u32) -> bool {
        self.computed += n;
        if self.computed < self.tokens {
            return false; // a prefill chunk: no token yet
        }
        self.tokens += 1;
        self.output += 1;
        self.output >= self.max_output
    }
}

impl Engine {
    /// A time up to which the engine can be advanced without any request finishing, as
    /// long as no request is added or aborted meanwhile; `None` when it has nothing to do.
    ///
    /// It is the end of the step in which a request first finishes when that is certain;
    /// otherwise an earlier step's end (at the latest [`Engine::next_event_time`]) from
    /// which the engine's course is not certain without stepping it: a step that may have
    /// to preempt, requests waiting for admission, an adapter load, KV events being
    /// recorded (each step's events are then visible), or [`MAX_STEPS_AHEAD`] steps.
    /// Advancing to it emits exactly what stepping to it one event at a time emits.
    pub fn next_finish_bound(&mut self) -> Option<SimTime> {
        // The steps read ahead are kept for stepping them; each reading starts afresh.
        self.plan.clear();
        let next = self.next_event_time();
        let certain =
            self.waiting.is_empty() && self.lora.next_ready().is_none() && self.kv_events.is_none();
        let Engine {
            inflight,
            running,
            seqs,
            pool,
            cfg,
            profile,
            rng,
            ahead,
            plan,
            jitters,
            ..
        } = self;
        let Some(step) = inflight.as_ref().filter(|_| certain) else {
            return next;
        };
        ahead.clear();
        for id in running.iter() {
            let Some(seq) = seqs.get(id) else {
                return next;
            };
            ahead.push(Ahead {
                tokens: seq.tokens.len() as u32,
                computed: seq.num_computed,
                output: seq.output_len,
                max_output: seq.max_output,
                blocks: seq.blocks.len() as u32,
                scheduled: 0,
            });
        }
        let reading = Reading {
            running,
            cfg,
            profile,
            ahead,
            plan,
            jitters,
            rng,
        };
        reading.read(step.end, &step.batch, pool.num_free())
    }
}

impl Reading<'_> {
    /// [`Engine::next_finish_bound`] from the step in flight (`batch`, ending at `end`),
    /// with `free` blocks in the pool.
    fn read(self, end: SimTime, batch: &[(RequestId, u32)], mut free: u32) -> Option<SimTime> {
        let (cfg, ahead) = (self.cfg, self.ahead);
        // The batch in flight lists running sequences in their order (those still running:
        // an aborted one has left `running`), possibly skipping some the budget left out.
        let mut k = 0;
        for &(id, n) in batch {
            let Some(at) = self.running[k..].iter().position(|&r| r == id) else {
                continue;
            };
            k += at;
            if ahead[k].computed(n) {
                return Some(end);
            }
            k += 1;
        }
        let mut t = end;
        let bs = cfg.block_size;
        for step in 0..MAX_STEPS_AHEAD {
            // The scheduler's first pass (`start_step`): running sequences oldest first,
            // each its remaining prefill or one decode token, while the budget lasts.
            let mut budget = cfg.max_num_batched_tokens;
            let mut shape = StepShape::default();
            let mut any = false;
            for a in ahead.iter_mut() {
                a.scheduled = 0;
                if budget == 0 {
                    continue;
                }
                let n = (a.tokens - a.computed).min(budget);
                let need = (a.computed + n).div_ceil(bs).saturating_sub(a.blocks);
                if need > free {
                    // It may preempt: only stepping it tells.
                    return Some(t);
                }
                free -= need;
                a.blocks += need;
                a.scheduled = n;
                budget -= n;
                shape.add(a.computed, n);
                any = true;
            }
            if !any {
                // Nothing left running: the engine idles once the step in flight ends.
                return None;
            }
            if self.jitters.len() == step {
                self.jitters.push_back(jitter_factor(self.rng, cfg.jitter));
            }
            let duration = step_duration(self.profile, &shape, self.jitters[step]);
            self.plan.push_back(duration);
            t += duration;
            let mut finished = false;
            for a in ahead.iter_mut().filter(|a| a.scheduled > 0) {
                finished |= a.computed(a.scheduled);
            }
            if finished {
                return Some(t);
            }
        }
        Some(t)
    }
}
