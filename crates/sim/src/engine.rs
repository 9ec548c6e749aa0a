//! The engine of one simulated vLLM pod: a pure state machine advanced by explicit time.
//!
//! No tokio, no clock reads, no I/O: the caller passes `now` to [`Engine::add_request`],
//! [`Engine::advance`] and [`Engine::abort`], asks [`Engine::next_event_time`] when to come back,
//! and drains [`Engine::take_events`] (tokens and completions, each stamped with its simulated
//! time). The same engine can therefore run under the HTTP server's scaled wall clock or inside an
//! offline discrete-event simulation.
//!
//! Each step follows vLLM V1's scheduler: running requests first (decode: one token; partial
//! prefill: the next chunk), allocating KV blocks as they grow and preempting the newest running
//! request (recompute) when none is free; then, if nothing was preempted, waiting requests in FCFS
//! order while `max_num_seqs`, the `max_num_batched_tokens` budget, the KV pool and the LoRA
//! slots allow (prefix-cache hits are reused, the rest is prefilled in chunks). The step's
//! duration comes from the profile's roofline with seeded Gaussian jitter; its tokens are
//! emitted when it ends.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::kv::{BlockId, BlockPool, block_hash, mix};
use super::lora::{AdapterId, LoraLoads, LoraSlots};
use super::profile::{Profile, StepShape};
use super::stats::EngineStats;
use super::tokens::output_token;

/// Simulated time since the engine's epoch.
pub type SimTime = Duration;

/// Id the engine gives each request.
pub type RequestId = u64;

/// Scheduler and cache limits of one engine (vLLM's engine arguments).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// KV blocks in the GPU pool.
    pub num_gpu_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Most sequences in one batch.
    pub max_num_seqs: usize,
    /// Token budget of one step (chunked prefill).
    pub max_num_batched_tokens: u32,
    /// Adapter slots (distinct adapters per batch); 0 disables LoRA.
    pub max_loras: usize,
    /// Adapters kept in host memory.
    pub max_cpu_loras: usize,
    /// Time to load an adapter that is not in host memory.
    pub lora_load: Duration,
    /// Relative standard deviation of the step time.
    pub jitter: f64,
    /// Whether full blocks are reused across requests.
    pub enable_prefix_caching: bool,
    /// Seed of the jitter.
    pub seed: u64,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            num_gpu_blocks: 25_959,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_loras: 4,
            max_cpu_loras: 4,
            lora_load: Duration::from_millis(150),
            jitter: 0.02,
            enable_prefix_caching: true,
            seed: 0,
        }
    }
}

/// Why a request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model "stopped" (end of sequence) after `max_output` tokens.
    Stop,
    /// `max_tokens` was reached.
    Length,
}

/// A request as the engine sees it.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// LoRA adapter name (None: the base model).
    pub adapter: Option<String>,
    /// Tokens to generate (at least 1).
    pub max_output: u32,
    /// Reason reported once `max_output` tokens are out.
    pub finish_reason: FinishReason,
    /// Seed of the synthetic output tokens.
    pub output_seed: u64,
}

/// What happened to a request, at simulated time `at`.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The request.
    pub id: RequestId,
    /// When.
    pub at: SimTime,
    /// What.
    pub kind: EventKind,
}

/// Kinds of [`Event`].
#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// Output token number `index` (0-based) was generated.
    Token {
        /// Position in the output.
        index: u32,
        /// Synthetic token id.
        token_id: u32,
    },
    /// The request finished (after its last token event).
    Finished(Summary),
}

/// Per-request accounting reported at the end.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache at first scheduling.
    pub cached_tokens: u32,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// When it arrived.
    pub arrival: SimTime,
    /// Arrival to first scheduling.
    pub queue: Duration,
    /// Arrival to first token.
    pub ttft: Duration,
    /// Arrival to last token.
    pub e2e: Duration,
    /// Times it was preempted.
    pub preemptions: u32,
}

/// Point-in-time counts of an engine, for `/metrics` and `/get_load`.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineLoad {
    /// Requests waiting (queued, preempted, or waiting for an adapter).
    pub waiting: usize,
    /// Requests in the running batch.
    pub running: usize,
    /// Share of KV blocks referenced by requests.
    pub kv_usage: f64,
    /// Tokens held by running requests.
    pub tokens_in_use: u64,
}

/// One entry of the LoRA info history (`vllm:lora_requests_info`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraInfo {
    /// Adapters with running requests, sorted, comma-separated.
    pub running: String,
    /// Adapters with waiting requests, sorted, comma-separated.
    pub waiting: String,
    /// When this set became current.
    pub since: SimTime,
}

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
    fn extend_hashes(&mut self, block_size: u32) {
        let bs = block_size as usize;
        while (self.hashes.len() + 1) * bs <= self.tokens.len() {
            let i = self.hashes.len();
            let parent = if i == 0 { 0 } else { self.hashes[i - 1] };
            let h = block_hash(parent, &self.tokens[i * bs..(i + 1) * bs], self.extra);
            self.hashes.push(h);
        }
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
    profile: Profile,
    pool: BlockPool,
    lora: LoraSlots,
    adapters: Vec<String>,
    running_per_adapter: Vec<u32>,
    waiting_per_adapter: Vec<u32>,
    lora_dirty: bool,
    lora_history: Vec<LoraInfo>,
    seqs: HashMap<RequestId, Seq>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    inflight: Option<InFlight>,
    next_id: RequestId,
    clock: SimTime,
    rng: SmallRng,
    events: Vec<Event>,
    stats: EngineStats,
}

/// LoRA info entries kept (vLLM keeps every label set it ever exported).
const LORA_HISTORY: usize = 8;

impl Engine {
    /// A fresh engine at time zero.
    pub fn new(cfg: EngineConfig, profile: Profile) -> Engine {
        let lora = LoraSlots::new(
            cfg.max_loras,
            cfg.max_cpu_loras,
            cfg.lora_load,
            profile.lora_swap_in(),
        );
        let mut engine = Engine {
            pool: BlockPool::new(cfg.num_gpu_blocks, cfg.block_size),
            rng: SmallRng::seed_from_u64(cfg.seed),
            cfg,
            profile,
            lora,
            adapters: Vec::new(),
            running_per_adapter: Vec::new(),
            waiting_per_adapter: Vec::new(),
            lora_dirty: false,
            lora_history: Vec::new(),
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            inflight: None,
            next_id: 0,
            clock: Duration::ZERO,
            events: Vec::new(),
            stats: EngineStats::default(),
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

    /// Puts an adapter in a GPU slot at once (startup).
    pub fn preload_adapter(&mut self, name: &str) -> bool {
        let id = self.intern(name);
        self.lora.preload(id)
    }

    /// Drops an adapter from the slots and host cache (after `/v1/unload_lora_adapter`).
    pub fn unload_adapter(&mut self, name: &str) {
        if let Some(id) = self.adapters.iter().position(|a| a == name) {
            let id = id as AdapterId;
            let in_use = self.running_per_adapter[id as usize] > 0;
            self.lora.remove(id, in_use);
        }
    }

    /// Queues a request at `now` (processing everything due before it first). The output is
    /// capped to fit [`Engine::max_model_len`]; a prompt that cannot fit at all finishes at once
    /// with no tokens (counted as aborted).
    pub fn add_request(&mut self, now: SimTime, spec: RequestSpec) -> RequestId {
        self.advance(now);
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
                kind: EventKind::Finished(Summary {
                    prompt_tokens: prompt_len,
                    completion_tokens: 0,
                    cached_tokens: 0,
                    finish_reason: FinishReason::Length,
                    arrival: self.clock,
                    queue: Duration::ZERO,
                    ttft: Duration::ZERO,
                    e2e: Duration::ZERO,
                    preemptions: 0,
                }),
            });
            return id;
        }
        let seq = Seq {
            adapter,
            extra,
            tokens: spec.prompt,
            prompt_len,
            max_output: spec.max_output.clamp(1, room),
            finish_reason: spec.finish_reason,
            output_seed: spec.output_seed,
            output_len: 0,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            num_registered: 0,
            cached_tokens: None,
            arrival: self.clock,
            first_scheduled: None,
            first_token: None,
            last_token: None,
            preemptions: 0,
            place: Place::Waiting,
        };
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
        out.append(&mut self.events);
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

    /// Counters and histograms since start.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Recent LoRA info label sets, oldest first; the last one is current.
    pub fn lora_history(&self) -> &[LoraInfo] {
        &self.lora_history
    }

    /// Adapter loads into GPU slots completed so far (from disk, from the host cache).
    pub fn lora_loads(&self) -> LoraLoads {
        self.lora.loads()
    }

    /// Adapters currently in GPU slots (loaded or loading).
    pub fn resident_adapters(&self) -> Vec<String> {
        self.lora
            .resident()
            .map(|a| self.adapters[a as usize].clone())
            .collect()
    }

    fn intern(&mut self, name: &str) -> AdapterId {
        if let Some(i) = self.adapters.iter().position(|a| a == name) {
            return i as AdapterId;
        }
        self.adapters.push(name.to_string());
        self.running_per_adapter.push(0);
        self.waiting_per_adapter.push(0);
        (self.adapters.len() - 1) as AdapterId
    }

    fn count_adapter(&mut self, adapter: Option<AdapterId>, place: Place, add: bool) {
        let Some(a) = adapter else { return };
        let counts = match place {
            Place::Waiting => &mut self.waiting_per_adapter,
            Place::Running => &mut self.running_per_adapter,
        };
        let c = &mut counts[a as usize];
        let before = *c;
        if add {
            *c += 1;
        } else {
            *c = c.saturating_sub(1);
        }
        if (before == 0) != (*c == 0) {
            self.lora_dirty = true;
        }
    }

    fn refresh_lora_info(&mut self) {
        if !self.lora_dirty || !self.lora_enabled() {
            return;
        }
        self.lora_dirty = false;
        let names = |counts: &[u32]| {
            let mut v: Vec<&str> = counts
                .iter()
                .enumerate()
                .filter(|(_, c)| **c > 0)
                .map(|(i, _)| self.adapters[i].as_str())
                .collect();
            v.sort_unstable();
            v.join(",")
        };
        let running = names(&self.running_per_adapter);
        let waiting = names(&self.waiting_per_adapter);
        if let Some(last) = self.lora_history.last()
            && last.running == running
            && last.waiting == waiting
        {
            return;
        }
        self.lora_history
            .retain(|e| !(e.running == running && e.waiting == waiting));
        self.lora_history.push(LoraInfo {
            running,
            waiting,
            since: self.clock,
        });
        if self.lora_history.len() > LORA_HISTORY {
            self.lora_history.remove(0);
        }
    }

    /// Blocks a sequence must hold to have `tokens` tokens in KV.
    fn blocks_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.cfg.block_size) as usize
    }

    /// Allocates blocks so `seq` can hold `num_computed + n` tokens; false if the pool is short.
    fn grow(&mut self, id: RequestId, n: u32) -> bool {
        let Some(seq) = self.seqs.get(&id) else {
            return false;
        };
        let need = self
            .blocks_for(seq.num_computed + n)
            .saturating_sub(seq.blocks.len());
        if need > self.pool.num_free() as usize {
            return false;
        }
        let mut new = Vec::with_capacity(need);
        for _ in 0..need {
            match self.pool.allocate() {
                Some(b) => new.push(b),
                None => break,
            }
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.blocks.extend(new);
        }
        true
    }

    /// Frees the newest running request's blocks and requeues it at the front.
    fn preempt_newest(&mut self) -> Option<RequestId> {
        let victim = self.running.pop()?;
        let seq = self.seqs.get_mut(&victim)?;
        let blocks = std::mem::take(&mut seq.blocks);
        seq.num_computed = 0;
        seq.num_registered = 0;
        seq.preemptions += 1;
        seq.place = Place::Waiting;
        let adapter = seq.adapter;
        self.pool.free(blocks.into_iter().rev());
        self.count_adapter(adapter, Place::Running, false);
        self.count_adapter(adapter, Place::Waiting, true);
        self.waiting.push_front(victim);
        self.stats.preemptions += 1;
        Some(victim)
    }

    /// Builds the next batch at `t` and starts it, if there is any work.
    fn start_step(&mut self, t: SimTime) {
        debug_assert!(self.inflight.is_none());
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut batch: Vec<(RequestId, u32)> = Vec::new();
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
        let mut batch_adapters: Vec<AdapterId> = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id).and_then(|s| s.adapter))
            .collect();
        batch_adapters.sort_unstable();
        batch_adapters.dedup();
        let mut skipped: Vec<RequestId> = Vec::new();
        // (An empty batch never waits on a preemption: that would stall the engine.)
        let admit = !preempted || batch.is_empty();
        while admit && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
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
            if !self.admit(id, t, &mut batch, &mut budget) {
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
        for id in skipped.into_iter().rev() {
            self.waiting.push_front(id);
        }
        for &(id, _) in &batch {
            if let Some(a) = self.seqs.get(&id).and_then(|s| s.adapter) {
                self.lora.touch(a, t);
            }
        }

        if batch.is_empty() {
            return;
        }
        let shape = self.shape(&batch);
        let base = self.profile.step_time(&shape);
        let factor = (1.0 + self.cfg.jitter * self.gaussian()).clamp(0.5, 1.5);
        self.stats.steps += 1;
        self.inflight = Some(InFlight {
            end: t + base.mul_f64(factor),
            batch,
        });
    }

    /// Tries to move waiting request `id` into the batch; false if the KV pool is short.
    fn admit(
        &mut self,
        id: RequestId,
        t: SimTime,
        batch: &mut Vec<(RequestId, u32)>,
        budget: &mut u32,
    ) -> bool {
        let bs = self.cfg.block_size;
        let caching = self.cfg.enable_prefix_caching;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return true;
        };
        seq.extend_hashes(bs);
        let total = seq.tokens.len() as u32;
        // vLLM always recomputes at least the last token.
        let max_hit_blocks = ((total.saturating_sub(1)) / bs) as usize;
        let mut hits: Vec<BlockId> = Vec::new();
        if caching {
            for &h in seq.hashes.iter().take(max_hit_blocks) {
                match self.pool.lookup(h) {
                    Some(b) => hits.push(b),
                    None => break,
                }
            }
        }
        let hit_tokens = hits.len() as u32 * bs;
        let n = (total - hit_tokens).min(*budget);
        let need_new = (hit_tokens + n).div_ceil(bs) as usize - hits.len();
        let hits_free = hits.iter().filter(|&&b| self.pool.is_free(b)).count();
        if need_new + hits_free > self.pool.num_free() as usize {
            return false;
        }
        for &b in &hits {
            self.pool.touch(b);
        }
        let mut blocks = hits;
        let num_hits = blocks.len();
        for _ in 0..need_new {
            if let Some(b) = self.pool.allocate() {
                blocks.push(b);
            }
        }
        self.stats.prefix_cache_queries += u64::from(total);
        self.stats.prefix_cache_hits += u64::from(hit_tokens);
        let Some(seq) = self.seqs.get_mut(&id) else {
            return true;
        };
        seq.blocks = blocks;
        seq.num_registered = num_hits;
        seq.num_computed = hit_tokens;
        seq.cached_tokens.get_or_insert(hit_tokens);
        seq.first_scheduled.get_or_insert(t);
        seq.place = Place::Running;
        let adapter = seq.adapter;
        self.count_adapter(adapter, Place::Waiting, false);
        self.count_adapter(adapter, Place::Running, true);
        self.running.push(id);
        batch.push((id, n));
        *budget -= n;
        true
    }

    fn shape(&self, batch: &[(RequestId, u32)]) -> StepShape {
        let mut shape = StepShape::default();
        for &(id, n) in batch {
            if let Some(seq) = self.seqs.get(&id) {
                let done = u64::from(seq.num_computed);
                let n = u64::from(n);
                shape.new_tokens += n;
                shape.kv_tokens_read += done + n;
                shape.attention_pairs += n as f64 * (done as f64 + (n as f64 + 1.0) / 2.0);
            }
        }
        shape
    }

    fn gaussian(&mut self) -> f64 {
        // Box-Muller.
        let u1: f64 = self.rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = self.rng.random::<f64>();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    fn finish_step(&mut self, step: InFlight) {
        let t = step.end;
        let bs = self.cfg.block_size;
        for (id, n) in step.batch {
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
            while seq.num_registered < full.min(seq.blocks.len()).min(seq.hashes.len()) {
                let i = seq.num_registered;
                self.pool.cache(seq.blocks[i], seq.hashes[i]);
                seq.num_registered += 1;
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
            match seq.last_token {
                None => {
                    seq.first_token = Some(t);
                    self.stats.prompt_tokens += u64::from(seq.prompt_len);
                    self.stats.ttft.observe((t - seq.arrival).as_secs_f64());
                    if let Some(s) = seq.first_scheduled {
                        self.stats.prefill.observe((t - s).as_secs_f64());
                    }
                }
                Some(last) => self.stats.itl.observe((t - last).as_secs_f64()),
            }
            seq.last_token = Some(t);
            self.events.push(Event {
                id,
                at: t,
                kind: EventKind::Token { index, token_id },
            });
            if seq.output_len >= seq.max_output {
                self.finish(id, t);
            }
        }
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
        s.e2e.observe((t - seq.arrival).as_secs_f64());
        s.queue
            .observe((first_scheduled - seq.arrival).as_secs_f64());
        s.decode.observe((t - first_token).as_secs_f64());
        s.inference.observe((t - first_scheduled).as_secs_f64());
        s.prompt_len.observe(f64::from(seq.prompt_len));
        s.generation_len.observe(f64::from(seq.output_len));
        self.events.push(Event {
            id,
            at: t,
            kind: EventKind::Finished(Summary {
                prompt_tokens: seq.prompt_len,
                completion_tokens: seq.output_len,
                cached_tokens: seq.cached_tokens.unwrap_or(0),
                finish_reason: seq.finish_reason,
                arrival: seq.arrival,
                queue: first_scheduled - seq.arrival,
                ttft: first_token - seq.arrival,
                e2e: t - seq.arrival,
                preemptions: seq.preemptions,
            }),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn h100() -> Profile {
        Profile::by_name("h100-llama3-8b").expect("built-in profile")
    }

    fn spec(prompt: Vec<u32>, out: u32) -> RequestSpec {
        RequestSpec {
            prompt,
            adapter: None,
            max_output: out,
            finish_reason: FinishReason::Length,
            output_seed: 1,
        }
    }

    fn prompt(seed: u32, len: u32) -> Vec<u32> {
        (0..len).map(|i| seed * 100_000 + i).collect()
    }

    /// Runs the engine until idle; returns all events.
    fn run_to_end(engine: &mut Engine) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some(t) = engine.next_event_time() {
            engine.advance(t);
        }
        engine.take_events(&mut out);
        out
    }

    fn summaries(events: &[Event]) -> HashMap<RequestId, Summary> {
        events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::Finished(s) => Some((e.id, s.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_request_yields_its_tokens_then_finishes() {
        let mut e = Engine::new(EngineConfig::default(), h100());
        let id = e.add_request(Duration::ZERO, spec(prompt(1, 100), 5));
        let events = run_to_end(&mut e);
        let tokens = events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Token { .. }))
            .count();
        assert_eq!(tokens, 5);
        let s = &summaries(&events)[&id];
        assert_eq!((s.prompt_tokens, s.completion_tokens), (100, 5));
        assert!(s.ttft > 5 * MS && s.ttft < 20 * MS, "{:?}", s.ttft);
        assert_eq!(e.load().running, 0);
        assert!(e.load().kv_usage < 1e-9);
    }

    #[test]
    fn a_repeated_prompt_hits_the_prefix_cache_and_starts_sooner() {
        let mut e = Engine::new(EngineConfig::default(), h100());
        let a = e.add_request(Duration::ZERO, spec(prompt(1, 4000), 2));
        let first = summaries(&run_to_end(&mut e))[&a].clone();
        let now = e.now() + MS;
        let b = e.add_request(now, spec(prompt(1, 4000), 2));
        let second = summaries(&run_to_end(&mut e))[&b].clone();
        assert_eq!(first.cached_tokens, 0);
        assert_eq!(
            second.cached_tokens, 3984,
            "all full blocks but the last token's"
        );
        assert!(second.ttft * 5 < first.ttft, "{second:?} {first:?}");
        assert_eq!(e.stats().prefix_cache_hits, 3984);
        assert_eq!(e.stats().prefix_cache_queries, 8000);
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks_of_the_token_budget() {
        let cfg = EngineConfig {
            max_num_batched_tokens: 512,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg, h100());
        e.add_request(Duration::ZERO, spec(prompt(1, 2000), 1));
        run_to_end(&mut e);
        assert_eq!(e.stats().steps, 4);
    }

    #[test]
    fn a_full_pool_preempts_the_newest_request_which_still_completes() {
        let cfg = EngineConfig {
            num_gpu_blocks: 20,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg, h100());
        let ids: Vec<_> = (0..4)
            .map(|i| e.add_request(Duration::ZERO, spec(prompt(i, 40), 60)))
            .collect();
        let events = run_to_end(&mut e);
        let s = summaries(&events);
        assert!(e.stats().preemptions > 0);
        for id in &ids {
            assert_eq!(s[id].completion_tokens, 60);
        }
        assert_eq!(s[&ids[0]].preemptions, 0, "the oldest is never the victim");
        assert!(e.load().kv_usage < 1e-9);
    }

    #[test]
    fn an_adapter_not_in_a_slot_waits_for_its_load() {
        let cfg = EngineConfig {
            lora_load: 200 * MS,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg, h100());
        let mut r = spec(prompt(1, 10), 1);
        r.adapter = Some("sql".into());
        let id = e.add_request(Duration::ZERO, r);
        assert_eq!(e.load().waiting, 1);
        let info = e.lora_history().last().cloned().expect("lora info");
        assert_eq!((info.running.as_str(), info.waiting.as_str()), ("", "sql"));
        let s = summaries(&run_to_end(&mut e))[&id].clone();
        assert!(s.ttft >= 200 * MS && s.queue >= 200 * MS, "{s:?}");
    }

    #[test]
    fn a_batch_never_holds_more_adapters_than_max_loras() {
        let cfg = EngineConfig {
            max_loras: 2,
            lora_load: 10 * MS,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg, h100());
        let ids: Vec<_> = ["a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let mut r = spec(prompt(i as u32, 10), 50);
                r.adapter = Some(name.to_string());
                e.add_request(Duration::ZERO, r)
            })
            .collect();
        let mut max_running = 0;
        let mut events = Vec::new();
        while let Some(t) = e.next_event_time() {
            e.advance(t);
            let running = e.lora_history().last().map_or(0, |i| {
                i.running.split(',').filter(|s| !s.is_empty()).count()
            });
            max_running = max_running.max(running);
        }
        e.take_events(&mut events);
        let s = summaries(&events);
        assert_eq!(max_running, 2);
        let c = &s[&ids[2]];
        let end_a = s[&ids[0]].arrival + s[&ids[0]].e2e;
        let end_b = s[&ids[1]].arrival + s[&ids[1]].e2e;
        assert!(c.arrival + c.ttft >= end_a.min(end_b) + 10 * MS);
    }

    #[test]
    fn same_seed_same_arrivals_give_the_same_event_trace() {
        let trace = |seed: u64| {
            let cfg = EngineConfig {
                seed,
                num_gpu_blocks: 64,
                ..EngineConfig::default()
            };
            let mut e = Engine::new(cfg, h100());
            let mut out = Vec::new();
            for i in 0..12u32 {
                let now = MS * (i * 7);
                let mut r = spec(prompt(i % 3, 50 + i * 13), 20 + i);
                r.output_seed = u64::from(i);
                e.add_request(now, r);
            }
            while let Some(t) = e.next_event_time() {
                e.advance(t);
            }
            e.take_events(&mut out);
            out
        };
        assert_eq!(trace(7), trace(7));
        assert_ne!(trace(7), trace(8), "jitter depends on the seed");
    }

    #[test]
    fn a_request_larger_than_the_pool_cannot_stall_the_engine() {
        let cfg = EngineConfig {
            num_gpu_blocks: 4,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg, h100());
        let too_long = e.add_request(Duration::ZERO, spec(prompt(1, 64), 1));
        let capped = e.add_request(Duration::ZERO, spec(prompt(2, 40), 100));
        let s = summaries(&run_to_end(&mut e));
        assert_eq!(s[&too_long].completion_tokens, 0);
        assert_eq!(s[&capped].completion_tokens, 24);
        assert_eq!(e.load().waiting + e.load().running, 0);
    }

    #[test]
    fn an_aborted_request_releases_its_blocks() {
        let mut e = Engine::new(EngineConfig::default(), h100());
        let id = e.add_request(Duration::ZERO, spec(prompt(1, 1000), 100));
        e.advance(50 * MS);
        assert!(e.load().kv_usage > 0.0);
        e.abort(50 * MS, id);
        assert!(e.load().kv_usage < 1e-9);
        assert_eq!(e.load().running, 0);
        run_to_end(&mut e);
    }
}
