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
use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use crate::profile::{Profile, StepShape};

use super::step::{jitter_factor, step_duration};
use super::{Engine, EngineConfig, SimTime};

/// The most steps read ahead: beyond them the caller wakes the engine and asks again.
const MAX_STEPS_AHEAD: usize = 1024;

/// What reading ahead fills in, kept by the engine for the steps read: the steps'
/// durations, their jitter factors, and the generator those are drawn from.
#[derive(Debug)]
pub(super) struct Foresight {
    /// Scratch: the running sequences, in order.
    ahead: Vec<Ahead>,
    /// The durations of the steps read ahead, next first: valid until a request is added
    /// or aborted.
    pub(super) plan: VecDeque<SimTime>,
    /// The jitter factors of the next steps, drawn from `rng` ahead of them, next first.
    /// Drawn in step order whenever drawn, so they stay valid whatever the steps turn out
    /// to be.
    pub(super) jitters: VecDeque<f64>,
    pub(super) rng: SmallRng,
}

impl Foresight {
    pub(super) fn new(rng: SmallRng) -> Self {
        Foresight {
            ahead: Vec::new(),
            plan: VecDeque::new(),
            jitters: VecDeque::new(),
            rng,
        }
    }
}

/// A reading ahead: the engine's limits and profile, and what it fills in.
struct Reading<'a> {
    cfg: &'a EngineConfig,
    profile: &'a Profile,
    foresight: &'a mut Foresight,
}

/// A reading ahead taken out of its engine ([`Engine::detach_forecast`]) to be run
/// elsewhere ([`DetachedForecast::run`]), then settled back into it
/// ([`Engine::settle_forecast`]). It holds what the reading fills in (the plan, the
/// jitter factors and their generator), so the engine must not be stepped, sent or
/// aborted in between; it is then where [`Engine::next_finish_bound`] leaves it.
#[derive(Debug)]
pub struct DetachedForecast {
    /// The end of the step in flight, where the reading starts.
    end: SimTime,
    /// Free blocks in the pool.
    free: u32,
    cfg: EngineConfig,
    profile: Arc<Profile>,
    foresight: Foresight,
    /// What the reading found, once run.
    bound: Option<SimTime>,
}

/// [`Engine::detach_forecast`]'s answer.
#[derive(Debug)]
pub enum FinishBound {
    /// Known without reading a step ahead: [`Engine::next_finish_bound`].
    Known(Option<SimTime>),
    /// To be read ahead, by the reading given, then settled into the engine.
    ToRead(Box<DetachedForecast>),
}

impl DetachedForecast {
    /// No bound the reading finds is earlier than this: the end of the step in flight.
    pub fn earliest(&self) -> SimTime {
        self.end
    }

    /// Reads ahead, as [`Engine::next_finish_bound`] would have.
    pub fn run(&mut self) {
        let reading = Reading {
            cfg: &self.cfg,
            profile: &self.profile,
            foresight: &mut self.foresight,
        };
        self.bound = reading.read(self.end, self.free);
    }
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
        debug_assert!(!self.detached, "an engine read ahead twice at once");
        let (end, free) = match self.start_reading() {
            Ok(decided) => return decided,
            Err(start) => start,
        };
        let reading = Reading {
            cfg: &self.cfg,
            profile: &self.profile,
            foresight: &mut self.foresight,
        };
        reading.read(end, free)
    }

    /// [`Engine::next_finish_bound`], or, where it must read steps ahead, that reading
    /// taken out of the engine to run elsewhere (the engine is left alone until it is
    /// settled back with [`Engine::settle_forecast`]).
    pub fn detach_forecast(&mut self) -> FinishBound {
        debug_assert!(!self.detached, "an engine read ahead twice at once");
        let (end, free) = match self.start_reading() {
            Ok(decided) => return FinishBound::Known(decided),
            Err(start) => start,
        };
        self.detached = true;
        // A stand-in until the reading's own comes back.
        let stand_in = Foresight::new(SmallRng::seed_from_u64(0));
        FinishBound::ToRead(Box::new(DetachedForecast {
            end,
            free,
            cfg: self.cfg.clone(),
            profile: Arc::clone(&self.profile),
            foresight: std::mem::replace(&mut self.foresight, stand_in),
            bound: None,
        }))
    }

    /// Puts back a reading detached from this engine and run; returns its bound.
    pub fn settle_forecast(&mut self, forecast: Box<DetachedForecast>) -> Option<SimTime> {
        debug_assert!(
            self.detached,
            "a reading settled into an engine it did not leave"
        );
        self.detached = false;
        self.foresight = forecast.foresight;
        forecast.bound
    }

    /// What a reading ahead decides before reading any step (`Ok`), else where it starts:
    /// the end of the step in flight and the free blocks, with `ahead` filled in and the
    /// step in flight read.
    fn start_reading(&mut self) -> Result<Option<SimTime>, (SimTime, u32)> {
        // The steps read ahead are kept for stepping them; each reading starts afresh.
        self.foresight.plan.clear();
        let next = self.next_event_time();
        let certain =
            self.waiting.is_empty() && self.lora.next_ready().is_none() && self.kv_events.is_none();
        let Engine {
            inflight,
            running,
            seqs,
            pool,
            foresight,
            ..
        } = self;
        let ahead = &mut foresight.ahead;
        let Some(step) = inflight.as_ref().filter(|_| certain) else {
            return Ok(next);
        };
        ahead.clear();
        for id in running.iter() {
            let Some(seq) = seqs.get(id) else {
                return Ok(next);
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
        // The batch in flight lists running sequences in their order (those still running:
        // an aborted one has left `running`), possibly skipping some the budget left out.
        let mut k = 0;
        for &(id, n) in &step.batch {
            let Some(at) = running[k..].iter().position(|&r| r == id) else {
                continue;
            };
            k += at;
            if ahead[k].computed(n) {
                return Ok(Some(step.end));
            }
            k += 1;
        }
        Err((step.end, pool.num_free()))
    }
}

impl Reading<'_> {
    /// [`Engine::next_finish_bound`] from the end of the step in flight (`end`, its batch
    /// already read), with `free` blocks in the pool.
    fn read(self, end: SimTime, mut free: u32) -> Option<SimTime> {
        let cfg = self.cfg;
        let Foresight {
            ahead,
            plan,
            jitters,
            rng,
        } = self.foresight;
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
            if jitters.len() == step {
                jitters.push_back(jitter_factor(rng, cfg.jitter));
            }
            let duration = step_duration(self.profile, &shape, jitters[step]);
            plan.push_back(duration);
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
