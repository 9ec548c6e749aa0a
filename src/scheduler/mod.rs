//! Picking the pod for one request: a pure function of the request, a fleet snapshot
//! and the configuration (no I/O, no clock, no logging, no metrics), so the live
//! service, the benchmarks and offline simulations share it.
//!
//! 1. Hard filters, which fail the request when nothing passes: inside the gateway's
//!    subset hint, able to serve the model (else 404), healthy (else 503).
//! 2. Soft filters, each applied only when it leaves at least one pod (the decision
//!    records every one it had to relax): fresh metrics; not saturated (queue or KV);
//!    enough free KV for this request's prompt plus expected output, counting what
//!    kvroute sent since the last scrape.
//! 3. Scores, weighted sum, highest wins, random among ties:
//!    `kv·headroom + queue·limit/(limit + waiting) + inflight·(1 − inflight/max) +
//!    lora·tier + prefix·matched/blocks + prefill·scale/(scale + queued)`, where
//!    `matched` counts the prompt's leading blocks kvroute sent to the pod before (the
//!    caller looks them up; see [`crate::state::PrefixIndex`]) and `queued` the prompt
//!    tokens kvroute sent there that have not streamed a first token yet.

mod config;
mod lora;

use std::net::SocketAddr;

use rand::Rng;

pub use config::{Saturation, SchedulerConfig, Weights};
pub use lora::LoraTier;

use crate::state::{PodView, PrefixMatches, Snapshot};

/// What the scheduler needs to know about a request.
#[derive(Debug, Clone, Default)]
pub struct PickRequest<'a> {
    /// Base model or adapter requested; `None` for requests without a model (e.g.
    /// `GET /v1/models`), which any healthy pod can answer.
    pub model: Option<&'a str>,
    /// Estimated prompt tokens.
    pub prompt_tokens: u32,
    /// The request's `max_tokens`, if it set one.
    pub max_output_tokens: Option<u32>,
    /// The gateway's subset hint: only these endpoints may be picked.
    pub subset: Option<&'a [SocketAddr]>,
    /// How much of the prompt's prefix each pod likely holds in its prefix cache.
    pub prefix: Option<&'a PrefixMatches>,
}

/// Why a request could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    #[error("no endpoints are known")]
    NoEndpoints,
    #[error("none of the gateway's subset endpoints is known to kvroute")]
    NoneInSubset,
    #[error("model `{0}` is not served by any endpoint")]
    UnknownModel(String),
    #[error("no ready endpoint can serve the request")]
    NoReadyEndpoint,
}

/// Soft filters that found no pod and were therefore skipped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Relaxed {
    pub stale_metrics: bool,
    pub saturation: bool,
    pub kv_headroom: bool,
}

impl Relaxed {
    pub fn any(&self) -> bool {
        self.stale_metrics || self.saturation || self.kv_headroom
    }
}

/// The main reason the winner won, for operators and dashboards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Request without a model: any healthy pod, least loaded.
    AnyReady,
    /// Base-model request placed by load and KV headroom.
    LeastLoaded,
    /// Adapter request, winner's affinity tier.
    Lora(LoraTier),
    /// Base-model request placed where part of its prompt is likely cached.
    PrefixCache,
    /// Every pod failed a soft filter; the least bad one was taken.
    Fallback,
}

impl Reason {
    /// A bounded label value.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::AnyReady => "any_ready",
            Reason::LeastLoaded => "least_loaded",
            Reason::Lora(tier) => tier.reason(),
            Reason::PrefixCache => "prefix_cache",
            Reason::Fallback => "fallback",
        }
    }
}

/// One candidate's scores, kept for the decision trace.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CandidateScore {
    pub endpoint: SocketAddr,
    pub total: f64,
    pub kv_headroom: f64,
    pub queue: f64,
    pub inflight: f64,
    pub lora: f64,
    pub lora_tier: Option<LoraTier>,
    /// Share of the prompt's blocks the pod likely holds, 0..=1.
    pub prefix: f64,
    /// `scale / (scale + queued prefill tokens)`, 0..=1.
    pub prefill_queue: f64,
    /// Free KV tokens the scheduler estimated for the pod, if its capacity is known.
    pub free_kv_tokens: Option<u64>,
}

/// Where a request goes, and why.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Decision {
    pub endpoint: SocketAddr,
    /// Ordered alternatives for the gateway's retry, best first.
    pub fallbacks: Vec<SocketAddr>,
    pub reason: Reason,
    pub relaxed: Relaxed,
    /// Tokens this request is expected to occupy (prompt + expected output).
    pub tokens_needed: u64,
    /// Pods left after filtering.
    pub candidates: usize,
    /// The best few candidates with their scores, winner first.
    pub ranked: Vec<CandidateScore>,
}

/// Scores within this distance count as a tie, broken at random.
const TIE_EPSILON: f64 = 1e-9;

/// Soft-filter outcomes of one pod, as bits: a pod passes a filter when its bit is set.
const FRESH: u8 = 1;
const NOT_SATURATED: u8 = 2;
const FITS: u8 = 4;
/// Not a filter: the pod has metrics at all.
const HAS_METRICS: u8 = 8;
/// Sentinel for "capacity not reported" in [`Candidate::free_kv`].
const UNKNOWN: u64 = u64::MAX;

/// What the filters and scores need of one pod, read once into a compact record so the
/// later passes stay in cache (a pick over 4,096 pods must take microseconds).
#[derive(Debug, Clone, Copy)]
struct Candidate {
    index: u32,
    flags: u8,
    waiting: u32,
    inflight: u32,
    /// Prompt tokens sent to the pod and not yet past prefill.
    prefill: u64,
    kv_usage: f32,
    capacity: u64,
    /// Estimated free KV tokens, or [`UNKNOWN`].
    free_kv: u64,
}

impl Candidate {
    fn read(index: usize, pod: &PodView, tokens_needed: u64, config: &SchedulerConfig) -> Self {
        let signals = pod.signals();
        let free_kv = free_kv_tokens(pod);
        let mut flags = 0;
        if is_fresh(pod, config) {
            flags |= FRESH;
        }
        if !is_saturated(pod, config) {
            flags |= NOT_SATURATED;
        }
        if free_kv.is_none_or(|free| free >= tokens_needed) {
            flags |= FITS;
        }
        if signals.is_some() {
            flags |= HAS_METRICS;
        }
        Candidate {
            index: index as u32,
            flags,
            waiting: signals.map_or(0, |s| s.waiting),
            inflight: pod.load.inflight(),
            prefill: pod.load.prefill_tokens(),
            kv_usage: signals.map_or(0.0, |s| s.kv_usage),
            capacity: signals.map_or(0, |s| s.kv_capacity_tokens),
            free_kv: free_kv.unwrap_or(UNKNOWN),
        }
    }

    fn free_kv(&self) -> Option<u64> {
        (self.free_kv != UNKNOWN).then_some(self.free_kv)
    }
}

/// Applies the soft filters in order to the flag combinations present (`present[f]`:
/// some candidate has flags `f`). Returns the set of accepted combinations as a bitmap
/// over flag values, and which filters had to be relaxed because nothing passed them.
fn soft_filters(present: &[bool; 16]) -> (u16, Relaxed) {
    let mut accepted: u16 = 0xFFFF;
    let mut relaxed = [false; 3];
    for (position, bit) in [FRESH, NOT_SATURATED, FITS].into_iter().enumerate() {
        let passing: u16 = (0..16u16)
            .filter(|flags| (*flags as u8) & bit != 0)
            .fold(0, |set, flags| set | 1 << flags);
        let narrowed = accepted & passing;
        if (0..16).any(|flags| narrowed & (1 << flags) != 0 && present[flags]) {
            accepted = narrowed;
        } else {
            relaxed[position] = true;
        }
    }
    let relaxed = Relaxed {
        stale_metrics: relaxed[0],
        saturation: relaxed[1],
        kv_headroom: relaxed[2],
    };
    (accepted, relaxed)
}

/// Picks the pod for `request` (see the module docs for the rules).
pub fn pick<R: Rng + ?Sized>(
    request: &PickRequest<'_>,
    snapshot: &Snapshot,
    config: &SchedulerConfig,
    rng: &mut R,
) -> Result<Decision, PickError> {
    let pods = &snapshot.pods;
    if pods.is_empty() {
        return Err(PickError::NoEndpoints);
    }
    let adapter = request
        .model
        .filter(|model| lora::is_adapter(model, snapshot, config));
    let tokens_needed = tokens_needed(request, config);

    // Hard filters, counting why pods drop out so the error names the first one that
    // emptied the set.
    let mut serves = request
        .model
        .map(|model| lora::ServesModel::new(model, config));
    let (mut in_subset, mut serving) = (0usize, 0usize);
    let mut present = [false; 16];
    let mut candidates: Vec<Candidate> = Vec::with_capacity(pods.len());
    for (index, pod) in pods.iter().enumerate() {
        if request
            .subset
            .is_some_and(|subset| !subset.contains(&pod.endpoint))
        {
            continue;
        }
        in_subset += 1;
        if serves.as_mut().is_some_and(|serves| !serves.check(pod)) {
            continue;
        }
        serving += 1;
        if pod.healthy {
            let candidate = Candidate::read(index, pod, tokens_needed, config);
            present[usize::from(candidate.flags)] = true;
            candidates.push(candidate);
        }
    }
    if in_subset == 0 {
        return Err(PickError::NoneInSubset);
    }
    if serving == 0 {
        return Err(PickError::UnknownModel(
            request.model.unwrap_or_default().to_owned(),
        ));
    }
    if candidates.is_empty() {
        return Err(PickError::NoReadyEndpoint);
    }

    // Soft filters, in order, each only when it leaves someone.
    let (accepted, relaxed) = soft_filters(&present);
    let is_accepted = |c: &Candidate| accepted & (1 << c.flags) != 0;
    let max_inflight = candidates
        .iter()
        .filter(|c| is_accepted(c))
        .map(|c| c.inflight)
        .max()
        .unwrap_or(0);
    let scorer = Scorer {
        prefix: request.prefix.filter(|p| p.any() && p.request_blocks > 0),
        adapter,
        adapter_key: adapter.map_or(0, crate::state::adapter_key),
        tokens_needed,
        max_inflight,
        config,
    };
    // One pass: every accepted candidate's total (kept for the tie-break), the best
    // total, how many share it, and the `keep` best in order. The full breakdown is
    // recomputed only for the few that are kept.
    let keep = 1 + config
        .fallbacks
        .max(config.trace_candidates.saturating_sub(1));
    let mut totals: Vec<(f64, u32)> = Vec::with_capacity(candidates.len());
    let mut best = f64::NEG_INFINITY;
    let mut tied = 0usize;
    let mut top = TopK::new(keep + 1);
    for (position, c) in candidates.iter().enumerate() {
        if !is_accepted(c) {
            continue;
        }
        let total = scorer.total(c, &pods[c.index as usize]);
        if total > best + TIE_EPSILON {
            best = total;
            tied = 1;
        } else if total >= best - TIE_EPSILON {
            tied += 1;
        }
        totals.push((total, position as u32));
        top.offer(total, position as u32);
    }
    let accepted_count = totals.len();
    // Ties are broken at random: the n-th tied candidate in snapshot order (which is
    // deterministic, so the choice depends only on the seeded RNG).
    let nth = rng.random_range(0..tied.max(1));
    let winner = totals
        .iter()
        .filter(|(total, _)| *total >= best - TIE_EPSILON)
        .nth(nth)
        .map_or(0, |&(_, position)| position);
    let ranked_positions = std::iter::once(winner)
        .chain(top.into_sorted().into_iter().filter(|&p| p != winner))
        .take(keep);
    let mut ranked: Vec<CandidateScore> = ranked_positions
        .map(|position| {
            let candidate = &candidates[position as usize];
            scorer.breakdown(candidate, &pods[candidate.index as usize])
        })
        .collect();

    let reason = if relaxed.any() {
        Reason::Fallback
    } else if let Some(tier) = ranked[0].lora_tier {
        Reason::Lora(tier)
    } else if ranked[0].prefix > 0.0 {
        Reason::PrefixCache
    } else if request.model.is_none() {
        Reason::AnyReady
    } else {
        Reason::LeastLoaded
    };
    let fallbacks = ranked
        .iter()
        .skip(1)
        .take(config.fallbacks)
        .map(|c| c.endpoint)
        .collect();
    ranked.truncate(config.trace_candidates.max(1));
    Ok(Decision {
        endpoint: ranked[0].endpoint,
        fallbacks,
        reason,
        relaxed,
        tokens_needed,
        candidates: accepted_count,
        ranked,
    })
}

/// The `k` highest totals seen, best first; ties keep the earlier one.
struct TopK {
    k: usize,
    entries: Vec<(f64, u32)>,
}

impl TopK {
    fn new(k: usize) -> Self {
        TopK {
            k,
            entries: Vec::with_capacity(k + 1),
        }
    }

    fn offer(&mut self, total: f64, position: u32) {
        if self.entries.len() == self.k && self.entries.last().is_some_and(|last| total <= last.0) {
            return;
        }
        let at = self.entries.partition_point(|entry| entry.0 >= total);
        self.entries.insert(at, (total, position));
        self.entries.truncate(self.k);
    }

    fn into_sorted(self) -> Vec<u32> {
        self.entries
            .into_iter()
            .map(|(_, position)| position)
            .collect()
    }
}

/// Prompt plus expected output: `max_tokens` when set, else the configured default.
pub fn tokens_needed(request: &PickRequest<'_>, config: &SchedulerConfig) -> u64 {
    if request.model.is_none() {
        return 0;
    }
    let output = request
        .max_output_tokens
        .unwrap_or(config.default_output_tokens);
    u64::from(request.prompt_tokens) + u64::from(output)
}

fn is_fresh(pod: &PodView, config: &SchedulerConfig) -> bool {
    pod.signals().is_some()
        && pod
            .metrics_age
            .is_some_and(|age| age <= config.max_metrics_age)
}

fn is_saturated(pod: &PodView, config: &SchedulerConfig) -> bool {
    pod.signals().is_some_and(|s| {
        s.waiting >= config.saturation.queue_depth
            || f64::from(s.kv_usage) >= config.saturation.kv_usage
    })
}

/// Free KV tokens: `capacity × (1 − usage)` minus tokens kvroute sent since the last
/// scrape. `None` when the pod did not report its capacity.
pub fn free_kv_tokens(pod: &PodView) -> Option<u64> {
    let signals = pod.signals()?;
    let capacity = Some(signals.kv_capacity_tokens).filter(|c| *c > 0)?;
    let free = (capacity as f64 * (1.0 - f64::from(signals.kv_usage))) as u64;
    Some(free.saturating_sub(pod.load.unscraped_tokens()))
}

/// Pods where the request fits score ½ to 1 by the share of capacity left after
/// placing it; pods where it does not fit score 0 to ½ by how much of it fits, so that
/// when nothing fits the pod with the most room still wins.
fn kv_headroom_score(free: u64, needed: u64, capacity: u64) -> f64 {
    if capacity == 0 {
        return 0.0;
    }
    if free >= needed {
        0.5 + 0.5 * ((free - needed) as f64 / capacity as f64).min(1.0)
    } else {
        0.5 * free as f64 / needed as f64
    }
}

/// The scores of one request against candidates.
struct Scorer<'a> {
    prefix: Option<&'a PrefixMatches>,
    adapter: Option<&'a str>,
    /// [`crate::state::adapter_key`] of `adapter`.
    adapter_key: u64,
    tokens_needed: u64,
    max_inflight: u32,
    config: &'a SchedulerConfig,
}

impl Scorer<'_> {
    fn kv_headroom(&self, c: &Candidate) -> f64 {
        match (c.flags & HAS_METRICS != 0, c.free_kv()) {
            (true, Some(free)) => kv_headroom_score(free, self.tokens_needed, c.capacity),
            (true, None) => 1.0 - f64::from(c.kv_usage),
            (false, _) => 0.0,
        }
    }

    /// `limit / (limit + waiting)`: 1 for an empty queue, ½ at the saturation depth, and
    /// still decreasing beyond it, so saturated pods remain comparable.
    fn queue(&self, c: &Candidate) -> f64 {
        if c.flags & HAS_METRICS == 0 {
            return 0.0;
        }
        let limit = f64::from(self.config.saturation.queue_depth);
        limit / (limit + f64::from(c.waiting))
    }

    fn inflight(&self, c: &Candidate) -> f64 {
        if self.max_inflight == 0 {
            1.0
        } else {
            1.0 - f64::from(c.inflight) / f64::from(self.max_inflight)
        }
    }

    fn prefill_queue(&self, c: &Candidate) -> f64 {
        let scale = f64::from(self.config.prefill_queue_tokens);
        scale / (scale + c.prefill as f64)
    }

    fn lora_tier(&self, pod: &PodView) -> Option<LoraTier> {
        self.adapter
            .map(|adapter| LoraTier::of(pod, adapter, self.adapter_key))
    }

    /// Share of the prompt's leading blocks the pod holds.
    fn prefix(&self, pod: &PodView) -> f64 {
        self.prefix.map_or(0.0, |p| {
            f64::from(p.blocks_at(pod.endpoint)) / f64::from(p.request_blocks)
        })
    }

    fn total(&self, c: &Candidate, pod: &PodView) -> f64 {
        let weights = &self.config.weights;
        weights.kv_headroom * self.kv_headroom(c)
            + weights.queue * self.queue(c)
            + weights.inflight * self.inflight(c)
            + weights.lora_affinity * self.lora_tier(pod).map_or(1.0, LoraTier::score)
            + weights.prefix_affinity * self.prefix(pod)
            + weights.prefill_queue * self.prefill_queue(c)
    }

    fn breakdown(&self, c: &Candidate, pod: &PodView) -> CandidateScore {
        let lora_tier = self.lora_tier(pod);
        CandidateScore {
            endpoint: pod.endpoint,
            total: self.total(c, pod),
            kv_headroom: self.kv_headroom(c),
            queue: self.queue(c),
            inflight: self.inflight(c),
            lora: lora_tier.map_or(1.0, LoraTier::score),
            lora_tier,
            prefix: self.prefix(pod),
            prefill_queue: self.prefill_queue(c),
            free_kv_tokens: c.free_kv(),
        }
    }
}

#[cfg(test)]
mod tests;
