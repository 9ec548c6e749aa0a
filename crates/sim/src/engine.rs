//! The engine of one simulated vLLM pod: a pure state machine advanced by explicit time.
//!
//! No tokio, no clock reads, no I/O: the caller passes `now` to [`Engine::add_request`],
//! [`Engine::advance`] and [`Engine::abort`], asks [`Engine::next_event_time`] when to come back,
//! and drains [`Engine::take_events`] (tokens and completions, each stamped with its simulated
//! time) and, when switched on, [`Engine::take_kv_events`] (vLLM's KV cache events, one batch
//! per step). The same engine can therefore run under the HTTP server's scaled wall clock or inside an
//! offline discrete-event simulation.
//!
//! Each step follows vLLM V1's scheduler: running requests first (decode: one token; partial
//! prefill: the next chunk), allocating KV blocks as they grow and preempting the newest running
//! request (recompute) when none is free; then, if nothing was preempted, waiting requests in FCFS
//! order while `max_num_seqs`, the `max_num_batched_tokens` budget, the KV pool and the LoRA
//! slots allow (prefix-cache hits are reused, the rest is prefilled in chunks). The step's
//! duration comes from the profile's roofline with seeded Gaussian jitter; its tokens are
//! emitted when it ends.
//!
//! Layout: `types` holds the public configuration, request and event types, `step` one
//! scheduler step, `blocks` KV block growth, preemption and admission, `adapters` the LoRA
//! bookkeeping, `kv_events` the KV cache events, `forecast` reading ahead to the next
//! finish (for a caller that wakes the engine only when something outside it can tell).
//! The engine's state and its public clock-driven API live here.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::kv::{BlockId, BlockPool, block_hash, mix};
use super::lora::{AdapterId, LoraSlots};
use super::profile::Profile;
use super::stats::{EngineStats, GapLog, LogHistogram};

mod adapters;
mod blocks;
mod forecast;
mod kv_events;
mod step;
mod types;

pub use forecast::{DetachedForecast, FinishBound};
pub use kv_events::{BlockStored, KvCacheEvent, KvEventBatch, StoredLora};
pub use types::{
    EngineConfig, EngineLoad, Event, EventKind, FinishReason, LoraInfo, RequestId, RequestSpec,
    SimTime, Summary,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Waiting,
    Running,
}

#[derive(Debug)]
struct Seq {
    adapter: Option<AdapterId>,
    extra: u64,
    tokens: Vec<u32>,
    prompt_len: u32,
    max_output: u32,
    finish_reason: FinishReason,
    output_seed: u64,
    output_len: u32,
    num_computed: u32,
    blocks: Vec<BlockId>,
    hashes: Vec<u64>,
    num_registered: usize,
    cached_tokens: Option<u32>,
    arrival: SimTime,
    first_scheduled: Option<SimTime>,
    first_token: Option<SimTime>,
    last_token: Option<SimTime>,
    preemptions: u32,
    place: Place,
}

impl Seq {
    /// `spec` arriving at `arrival`, its output capped to the `room` its prompt leaves.
    fn queued(
        spec: RequestSpec,
        adapter: Option<AdapterId>,
        extra: u64,
        room: u32,
        arrival: SimTime,
    ) -> Seq {
        Seq {
            adapter,
            extra,
            prompt_len: spec.prompt.len() as u32,
            tokens: spec.prompt,
            max_output: spec.max_output.clamp(1, room),
            finish_reason: spec.finish_reason,
            output_seed: spec.output_seed,
            output_len: 0,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            num_registered: 0,
            cached_tokens: None,
            arrival,
            first_scheduled: None,
            first_token: None,
            last_token: None,
            preemptions: 0,
            place: Place::Waiting,
        }
    }

    fn extend_hashes(&mut self, block_size: u32) {
        let bs = block_size as usize;
        // Room for every block the tokens' room holds (the prompt and the output to come).
        let blocks = self.tokens.capacity() / bs.max(1);
        if self.hashes.capacity() < blocks {
            self.hashes.reserve_exact(blocks - self.hashes.len());
        }
        while (self.hashes.len() + 1) * bs <= self.tokens.len() {
            let i = self.hashes.len();
            let parent = if i == 0 { 0 } else { self.hashes[i - 1] };
            let h = block_hash(parent, &self.tokens[i * bs..(i + 1) * bs], self.extra);
            self.hashes.push(h);
        }
    }
}

/// The engine's requests by id. Ids are handed out in order and requests end roughly in
/// the order they came, so the live ones lie in a short window of ids: a slot per id in
/// that window finds one with an index where a hash map probed its table first (a cache
/// miss of its own, at every visit to an engine that a thousand others have since
/// evicted from the cache).
#[derive(Debug, Default)]
struct SeqTable {
    /// The id of `slots`' first entry.
    first: RequestId,
    /// A slot for each id from `first`, empty once its request has ended (or was never
    /// queued); never empty at the front.
    slots: VecDeque<Option<Seq>>,
}

impl SeqTable {
    /// Files `seq` under `id`, which is above every id filed before.
    fn insert(&mut self, id: RequestId, seq: Seq) {
        if self.slots.is_empty() {
            self.first = id;
        }
        let Some(at) = id
            .checked_sub(self.first)
            .and_then(|at| usize::try_from(at).ok())
            .filter(|&at| at >= self.slots.len())
        else {
            debug_assert!(false, "request ids are filed in order");
            return;
        };
        self.slots.resize_with(at, || None);
        self.slots.push_back(Some(seq));
    }

    fn index(&self, id: RequestId) -> Option<usize> {
        usize::try_from(id.checked_sub(self.first)?).ok()
    }

    fn get(&self, id: &RequestId) -> Option<&Seq> {
        self.slots.get(self.index(*id)?)?.as_ref()
    }

    fn get_mut(&mut self, id: &RequestId) -> Option<&mut Seq> {
        let at = self.index(*id)?;
        self.slots.get_mut(at)?.as_mut()
    }

    fn remove(&mut self, id: &RequestId) -> Option<Seq> {
        let at = self.index(*id)?;
        let seq = self.slots.get_mut(at)?.take();
        while let Some(None) = self.slots.front() {
            self.slots.pop_front();
            self.first += 1;
        }
        seq
    }
}

#[derive(Debug)]
struct InFlight {
    end: SimTime,
    batch: Vec<(RequestId, u32)>,
}

/// The engine of one pod.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    /// Shared with its readings ahead when they run elsewhere ([`Engine::detach_forecast`]).
    profile: Arc<Profile>,
    pool: BlockPool,
    lora: LoraSlots,
    adapters: Vec<String>,
    running_per_adapter: Vec<u32>,
    waiting_per_adapter: Vec<u32>,
    lora_dirty: bool,
    lora_history: Vec<LoraInfo>,
    seqs: SeqTable,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    inflight: Option<InFlight>,
    next_id: RequestId,
    clock: SimTime,
    events: Vec<Event>,
    /// The gaps between consecutive output tokens of a request, when tokens are not
    /// events ([`EngineConfig::token_events`] off): until [`Engine::take_token_gaps`].
    token_gaps: Option<GapLog>,
    kv_events: Option<kv_events::KvEventLog>,
    stats: EngineStats,
    /// The steps' timing: what reading ahead fills in, and the jitter's generator.
    foresight: forecast::Foresight,
    /// A reading ahead run elsewhere holds `foresight` until it is settled: nothing may
    /// step the engine meanwhile.
    detached: bool,
    /// Buffers of a step, kept from step to step.
    spare_batch: Vec<(RequestId, u32)>,
    scratch_adapters: Vec<AdapterId>,
    scratch_skipped: Vec<RequestId>,
}

impl Engine {
    /// A fresh engine at time zero. Engines of one fleet may share their profile (an
    /// `Arc`): a step reads it, and one copy stays in cache where a thousand would not.
    pub fn new(cfg: EngineConfig, profile: impl Into<Arc<Profile>>) -> Engine {
        let profile = profile.into();
        let lora = LoraSlots::new(
            cfg.max_loras,
            cfg.max_cpu_loras,
            cfg.lora_load,
            profile.lora_swap_in(),
        );
        let token_gaps = (!cfg.token_events).then(GapLog::default);
        let foresight = forecast::Foresight::new(SmallRng::seed_from_u64(cfg.seed));
        let mut engine = Engine {
            pool: BlockPool::new(cfg.num_gpu_blocks, cfg.block_size),
            cfg,
            profile,
            lora,
            adapters: Vec::new(),
            running_per_adapter: Vec::new(),
            waiting_per_adapter: Vec::new(),
            lora_dirty: false,
            lora_history: Vec::new(),
            seqs: SeqTable::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            inflight: None,
            next_id: 0,
            clock: Duration::ZERO,
            events: Vec::new(),
            token_gaps,
            kv_events: None,
            stats: EngineStats::default(),
            foresight,
            detached: false,
            spare_batch: Vec::new(),
            scratch_adapters: Vec::new(),
            scratch_skipped: Vec::new(),
        };
        if engine.lora_enabled() {
            engine.lora_history.push(LoraInfo {
                running: String::new(),
                waiting: String::new(),
                since: Duration::ZERO,
            });
        }
        engine
    }

    /// The limits this engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The profile timing its steps.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Whether LoRA is enabled (`max_loras > 0`).
    pub fn lora_enabled(&self) -> bool {
        self.cfg.max_loras > 0
    }

    /// The largest prompt + output this engine accepts (model length and KV capacity).
    pub fn max_model_len(&self) -> u32 {
        let capacity = self.cfg.num_gpu_blocks.saturating_mul(self.cfg.block_size);
        self.profile.max_model_len.min(capacity)
    }

    /// Simulated time of the last processed event or call.
    pub fn now(&self) -> SimTime {
        self.clock
    }

    /// Queues a request at `now` (processing everything due before it first). The output is
    /// capped to fit [`Engine::max_model_len`]; a prompt that cannot fit at all finishes at once
    /// with no tokens (counted as aborted).
    pub fn add_request(&mut self, now: SimTime, spec: RequestSpec) -> RequestId {
        self.advance(now);
        self.foresight.plan.clear();
        let id = self.next_id;
        self.next_id += 1;
        let adapter = match (&spec.adapter, self.lora_enabled()) {
            (Some(name), true) => Some(self.intern(name)),
            _ => None,
        };
        let extra = adapter.map_or(0, |a| mix(u64::from(a) + 1, 0x10a));
        let prompt_len = spec.prompt.len() as u32;
        let room = self.max_model_len().saturating_sub(prompt_len);
        if prompt_len == 0 || room == 0 {
            // Could never fit the pool (the HTTP layer answers 400 before this): drop it.
            self.stats.aborted += 1;
            self.events.push(Event {
                id,
                at: self.clock,
                kind: EventKind::Finished(Box::new(Summary {
                    prompt_tokens: prompt_len,
                    completion_tokens: 0,
                    cached_tokens: 0,
                    finish_reason: FinishReason::Length,
                    arrival: self.clock,
                    queue: Duration::ZERO,
                    ttft: Duration::ZERO,
                    e2e: Duration::ZERO,
                    preemptions: 0,
                })),
            });
            return id;
        }
        let seq = Seq::queued(spec, adapter, extra, room, self.clock);
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        self.count_adapter(adapter, Place::Waiting, true);
        if self.inflight.is_none() {
            self.start_step(self.clock);
        }
        self.refresh_lora_info();
        id
    }

    /// Cancels a request (client went away). Unknown or finished ids are ignored.
    pub fn abort(&mut self, now: SimTime, id: RequestId) {
        self.advance(now);
        self.foresight.plan.clear();
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        match seq.place {
            Place::Waiting => self.waiting.retain(|&w| w != id),
            Place::Running => self.running.retain(|&r| r != id),
        }
        self.count_adapter(seq.adapter, seq.place, false);
        self.pool.free(seq.blocks.iter().rev().copied());
        self.stats.aborted += 1;
        self.refresh_lora_info();
    }

    /// When the engine next has something to do (a step ending, an adapter load completing).
    pub fn next_event_time(&self) -> Option<SimTime> {
        let step = self.inflight.as_ref().map(|f| f.end);
        let lora = self.lora.next_ready();
        match (step, lora) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Processes every event due at or before `now`, in time order.
    pub fn advance(&mut self, now: SimTime) {
        debug_assert!(
            !self.detached,
            "an engine stepped while read ahead elsewhere"
        );
        while let Some(t) = self.next_event_time() {
            if t > now {
                break;
            }
            self.clock = self.clock.max(t);
            let loads_due = self.lora.next_ready().is_some_and(|r| r <= t);
            if loads_due {
                self.lora.complete_loads(t);
                if self.inflight.is_none() {
                    self.start_step(t);
                }
            } else if let Some(step) = self.inflight.take() {
                self.finish_step(step);
                self.start_step(t);
            }
            self.refresh_lora_info();
        }
        self.clock = self.clock.max(now);
    }

    /// Moves the events produced so far into `out`.
    pub fn take_events(&mut self, out: &mut Vec<Event>) {
        if out.is_empty() {
            // An empty buffer (the usual caller's) trades places: nothing is copied.
            std::mem::swap(out, &mut self.events);
        } else {
            out.append(&mut self.events);
        }
    }

    /// Adds to `into` the gaps between consecutive output tokens of each request since
    /// the last call, and forgets them. Only an engine whose tokens are not events
    /// ([`EngineConfig::token_events`]) counts them: for another, this adds nothing.
    pub fn take_token_gaps(&mut self, into: &mut LogHistogram) {
        if let Some(gaps) = self.token_gaps.as_mut() {
            gaps.take_into(into);
        }
    }

    /// Queue, batch and KV use now.
    pub fn load(&self) -> EngineLoad {
        let tokens_in_use = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(|s| u64::from(s.num_computed))
            .sum();
        EngineLoad {
            waiting: self.waiting.len(),
            running: self.running.len(),
            kv_usage: self.pool.usage(),
            tokens_in_use,
        }
    }

    /// Requests waiting and running, and the share of KV blocks in use: [`Engine::load`]
    /// without summing the batch's tokens, for callers that read it very often (an
    /// offline simulation scraping a thousand pods every 50 ms of virtual time).
    pub fn gauges(&self) -> (usize, usize, f64) {
        (self.waiting.len(), self.running.len(), self.pool.usage())
    }

    /// Counters and histograms since start.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests;
