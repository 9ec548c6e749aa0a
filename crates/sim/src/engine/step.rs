//! One scheduler step: building the batch (running requests first, then waiting ones FCFS),
//! timing it from the profile with jitter, and emitting its tokens and completions when it ends.

use rand::Rng;
use rand::rngs::SmallRng;

use crate::profile::{Profile, StepShape};
use crate::tokens::output_token;

use super::kv_events::{self, StoredLora};
use super::{Engine, Event, EventKind, FinishReason, InFlight, Place, RequestId, SimTime, Summary};

/// The jitter factor of the next step: a seeded Gaussian of relative deviation `jitter`
/// around 1 (Box-Muller, two draws from `rng`), clamped to [0.5, 1.5].
pub(super) fn jitter_factor(rng: &mut SmallRng, jitter: f64) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    let gaussian = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    (1.0 + jitter * gaussian).clamp(0.5, 1.5)
}

/// How long a step of `shape` takes: the profile's roofline, scaled by its jitter factor
/// (shared with [`Engine::next_finish_bound`], which must time the steps alike).
pub(super) fn step_duration(profile: &Profile, shape: &StepShape, factor: f64) -> SimTime {
    profile.step_time(shape).mul_f64(factor)
}

impl Engine {
    /// Builds the next batch at `t` and starts it, if there is any work.
    pub(super) fn start_step(&mut self, t: SimTime) {
        debug_assert!(self.inflight.is_none());
        let mut budget = self.cfg.max_num_batched_tokens;
        // The buffer of the last step's batch, reused.
        let mut batch = std::mem::take(&mut self.spare_batch);
        batch.clear();
        let mut preempted = false;

        // 1. Running requests, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let n = (seq.tokens.len() as u32 - seq.num_computed).min(budget);
            let mut scheduled = true;
            while !self.grow(id, n) {
                preempted = true;
                match self.preempt_newest() {
                    Some(victim) if victim == id => {
                        scheduled = false;
                        break;
                    }
                    Some(_) => {}
                    None => {
                        scheduled = false;
                        break;
                    }
                }
            }
            if !scheduled {
                break;
            }
            batch.push((id, n));
            budget -= n;
            i += 1;
        }

        // 2. Waiting requests, FCFS, unless this step had to preempt.
        // (An empty batch never waits on a preemption: that would stall the engine.)
        if (!preempted || batch.is_empty()) && !self.waiting.is_empty() {
            self.admit_waiting(t, &mut batch, &mut budget);
        }
        for &(id, _) in &batch {
            if let Some(a) = self.seqs.get(&id).and_then(|s| s.adapter) {
                self.lora.touch(a, t);
            }
        }

        if batch.is_empty() {
            self.spare_batch = batch;
            self.close_kv_batch(t);
            return;
        }
        // Each step takes the next jitter factor, drawn now or ahead by
        // `next_finish_bound`, and a step read there since the last request came or went
        // takes the duration found there.
        let factor = match self.foresight.jitters.pop_front() {
            Some(factor) => factor,
            None => jitter_factor(&mut self.foresight.rng, self.cfg.jitter),
        };
        let duration = match self.foresight.plan.pop_front() {
            Some(duration) => duration,
            None => step_duration(&self.profile, &self.shape(&batch), factor),
        };
        self.stats.steps += 1;
        self.inflight = Some(InFlight {
            end: t + duration,
            batch,
        });
    }

    /// The scheduler's second pass: waiting requests in FCFS order while the batch has
    /// budget, sequence slots, KV blocks and adapter slots for them.
    fn admit_waiting(&mut self, t: SimTime, batch: &mut Vec<(RequestId, u32)>, budget: &mut u32) {
        let mut batch_adapters = std::mem::take(&mut self.scratch_adapters);
        batch_adapters.clear();
        batch_adapters.extend(
            self.running
                .iter()
                .filter_map(|id| self.seqs.get(id).and_then(|s| s.adapter)),
        );
        batch_adapters.sort_unstable();
        batch_adapters.dedup();
        let mut skipped = std::mem::take(&mut self.scratch_skipped);
        skipped.clear();
        while *budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(id) = self.waiting.pop_front() else {
                break;
            };
            let Some(adapter) = self.seqs.get(&id).map(|s| s.adapter) else {
                continue;
            };
            if let Some(a) = adapter {
                if !self.lora.is_loaded(a) {
                    let running = &self.running_per_adapter;
                    self.lora
                        .request_load(a, t, |x| running.get(x as usize).is_some_and(|c| *c > 0));
                    skipped.push(id);
                    continue;
                }
                if !batch_adapters.contains(&a) && batch_adapters.len() >= self.cfg.max_loras {
                    skipped.push(id);
                    continue;
                }
            }
            if !self.admit(id, t, batch, budget) {
                self.waiting.push_front(id);
                break;
            }
            if let Some(a) = adapter {
                self.lora.touch(a, t);
                if !batch_adapters.contains(&a) {
                    batch_adapters.push(a);
                }
            }
        }
        for &id in skipped.iter().rev() {
            self.waiting.push_front(id);
        }
        self.scratch_adapters = batch_adapters;
        self.scratch_skipped = skipped;
    }

    fn shape(&self, batch: &[(RequestId, u32)]) -> StepShape {
        let mut shape = StepShape::default();
        for &(id, n) in batch {
            if let Some(seq) = self.seqs.get(&id) {
                shape.add(seq.num_computed, n);
            }
        }
        shape
    }

    pub(super) fn finish_step(&mut self, step: InFlight) {
        let InFlight { end: t, batch } = step;
        let bs = self.cfg.block_size;
        for &(id, n) in &batch {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue; // aborted during the step
            };
            if seq.place != Place::Running {
                continue;
            }
            seq.num_computed += n;
            // Register newly full blocks in the prefix cache.
            seq.extend_hashes(bs);
            let full = (seq.num_computed / bs) as usize;
            let first_new = seq.num_registered;
            while seq.num_registered < full.min(seq.blocks.len()).min(seq.hashes.len()) {
                let i = seq.num_registered;
                self.pool.cache(seq.blocks[i], seq.hashes[i]);
                seq.num_registered += 1;
            }
            if let Some(log) = self.kv_events.as_mut()
                && seq.num_registered > first_new
            {
                let lora = seq.adapter.map(|a| StoredLora {
                    id: a.saturating_add(1),
                    name: self.adapters.get(a as usize).cloned().unwrap_or_default(),
                });
                log.push(kv_events::stored(
                    seq,
                    first_new,
                    seq.num_registered,
                    bs,
                    lora,
                ));
            }
            if seq.num_computed < seq.tokens.len() as u32 {
                continue; // prefill chunk, no token yet
            }
            // All known tokens computed: the step sampled one more.
            let index = seq.output_len;
            let (token_id, _) = output_token(seq.output_seed, index);
            seq.tokens.push(token_id);
            seq.output_len += 1;
            self.stats.generation_tokens += 1;
            let histograms = self.cfg.histograms;
            match seq.last_token {
                None => {
                    seq.first_token = Some(t);
                    self.stats.prompt_tokens += u64::from(seq.prompt_len);
                    if histograms {
                        self.stats.ttft.observe((t - seq.arrival).as_secs_f64());
                        if let Some(s) = seq.first_scheduled {
                            self.stats.prefill.observe((t - s).as_secs_f64());
                        }
                    }
                }
                Some(last) => {
                    let gap = t - last;
                    if histograms {
                        self.stats.itl.observe(gap.as_secs_f64());
                    }
                    if let Some(gaps) = self.token_gaps.as_mut() {
                        gaps.observe(gap);
                    }
                }
            }
            seq.last_token = Some(t);
            if self.cfg.token_events {
                self.events.push(Event {
                    id,
                    at: t,
                    kind: EventKind::Token { index, token_id },
                });
            }
            if seq.output_len >= seq.max_output {
                self.finish(id, t);
            }
        }
        // One batch per step, as vLLM publishes after each `update_from_output`.
        self.close_kv_batch(t);
        self.spare_batch = batch;
    }

    fn finish(&mut self, id: RequestId, t: SimTime) {
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        self.running.retain(|&r| r != id);
        self.count_adapter(seq.adapter, Place::Running, false);
        self.pool.free(seq.blocks.iter().rev().copied());
        let first_scheduled = seq.first_scheduled.unwrap_or(seq.arrival);
        let first_token = seq.first_token.unwrap_or(t);
        let s = &mut self.stats;
        match seq.finish_reason {
            FinishReason::Stop => s.success_stop += 1,
            FinishReason::Length => s.success_length += 1,
        }
        if self.cfg.histograms {
            s.e2e.observe((t - seq.arrival).as_secs_f64());
            s.queue
                .observe((first_scheduled - seq.arrival).as_secs_f64());
            s.decode.observe((t - first_token).as_secs_f64());
            s.inference.observe((t - first_scheduled).as_secs_f64());
            s.prompt_len.observe(f64::from(seq.prompt_len));
            s.generation_len.observe(f64::from(seq.output_len));
        }
        self.events.push(Event {
            id,
            at: t,
            kind: EventKind::Finished(Box::new(Summary {
                prompt_tokens: seq.prompt_len,
                completion_tokens: seq.output_len,
                cached_tokens: seq.cached_tokens.unwrap_or(0),
                finish_reason: seq.finish_reason,
                arrival: seq.arrival,
                queue: first_scheduled - seq.arrival,
                ttft: first_token - seq.arrival,
                e2e: t - seq.arrival,
                preemptions: seq.preemptions,
            })),
        });
    }
}
