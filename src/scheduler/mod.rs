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
//!    `kv·headroom + queue·limit/(limit + waiting) + inflight·(1 − inflight/max) + lora·tier`.

mod config;
mod lora;

use std::net::SocketAddr;

use rand::Rng;

pub use config::{Saturation, SchedulerConfig, Weights};
pub use lora::LoraTier;

use crate::state::{PodView, Snapshot};

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

/// What the filters and scores need of one pod, read once into a compact record so the
/// later passes stay in cache (a pick over 4,096 pods must take microseconds).
#[derive(Debug, Clone, Copy)]
struct Candidate {
    index: usize,
    fresh: bool,
    saturated: bool,
    fits: bool,
    /// Estimated free KV tokens, when the pod reports its capacity.
    free_kv: Option<u64>,
    capacity: u64,
    kv_usage: f64,
    waiting: u32,
    has_metrics: bool,
    inflight: u32,
}

impl Candidate {
    fn read(index: usize, pod: &PodView, tokens_needed: u64, config: &SchedulerConfig) -> Self {
        let metrics = pod.metrics.as_deref();
        let free_kv = free_kv_tokens(pod);
        Candidate {
            index,
            fresh: is_fresh(pod, config),
            saturated: is_saturated(pod, config),
            fits: free_kv.is_none_or(|free| free >= tokens_needed),
            free_kv,
            capacity: metrics.and_then(|m| m.kv_capacity_tokens).unwrap_or(0),
            kv_usage: metrics.map_or(0.0, |m| m.kv_usage.clamp(0.0, 1.0)),
            waiting: metrics.map_or(0, |m| m.waiting),
            has_metrics: metrics.is_some(),
            inflight: pod.load.inflight(),
        }
    }
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
            candidates.push(Candidate::read(index, pod, tokens_needed, config));
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

    let mut relaxed = Relaxed::default();
    relaxed.stale_metrics = !narrow(&mut candidates, |c| c.fresh);
    relaxed.saturation = !narrow(&mut candidates, |c| !c.saturated);
    relaxed.kv_headroom = !narrow(&mut candidates, |c| c.fits);

    let max_inflight = candidates.iter().map(|c| c.inflight).max().unwrap_or(0);
    let score_of = |c: &Candidate| {
        score(
            c,
            &pods[c.index],
            adapter,
            tokens_needed,
            max_inflight,
            config,
        )
    };
    // Totals only here; the full breakdown is recomputed for the few that are kept.
    let mut totals: Vec<(f64, usize)> = candidates
        .iter()
        .enumerate()
        .map(|(position, c)| (score_of(c).total, position))
        .collect();

    let best = totals
        .iter()
        .map(|(total, _)| *total)
        .fold(f64::NEG_INFINITY, f64::max);
    let is_tied = |total: f64| total >= best - TIE_EPSILON;
    let tied = totals.iter().filter(|(total, _)| is_tied(*total)).count();
    // The n-th tied candidate in snapshot order; snapshot order is deterministic, so
    // the choice depends only on the seeded RNG.
    let nth = rng.random_range(0..tied);
    let winner_position = totals
        .iter()
        .enumerate()
        .filter(|(_, (total, _))| is_tied(*total))
        .nth(nth)
        .map_or(0, |(position, _)| position);
    totals.swap(0, winner_position);

    let keep = 1 + config
        .fallbacks
        .max(config.trace_candidates.saturating_sub(1));
    let by_score_desc = |a: &(f64, usize), b: &(f64, usize)| b.0.total_cmp(&a.0);
    let rest = &mut totals[1..];
    if rest.len() > keep {
        rest.select_nth_unstable_by(keep - 1, by_score_desc);
    }
    let ranked_len = totals.len().min(keep);
    totals[1..ranked_len].sort_by(by_score_desc);
    let mut ranked: Vec<CandidateScore> = totals[..ranked_len]
        .iter()
        .map(|&(_, position)| score_of(&candidates[position]))
        .collect();

    let reason = if relaxed.any() {
        Reason::Fallback
    } else if let Some(tier) = ranked[0].lora_tier {
        Reason::Lora(tier)
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
        candidates: candidates.len(),
        ranked,
    })
}

/// Keeps the candidates that pass `keep`, unless none would: then keeps all and
/// returns false (the filter was relaxed).
fn narrow(candidates: &mut Vec<Candidate>, keep: impl Fn(&Candidate) -> bool) -> bool {
    if !candidates.iter().any(&keep) {
        return false;
    }
    candidates.retain(keep);
    true
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
    pod.metrics.is_some()
        && pod
            .metrics_age
            .is_some_and(|age| age <= config.max_metrics_age)
}

fn is_saturated(pod: &PodView, config: &SchedulerConfig) -> bool {
    pod.metrics.as_ref().is_some_and(|m| {
        m.waiting >= config.saturation.queue_depth || m.kv_usage >= config.saturation.kv_usage
    })
}

/// Free KV tokens: `capacity × (1 − usage)` minus tokens kvroute sent since the last
/// scrape. `None` when the pod did not report its capacity.
pub fn free_kv_tokens(pod: &PodView) -> Option<u64> {
    let metrics = pod.metrics.as_ref()?;
    let capacity = metrics.kv_capacity_tokens?;
    let free = (capacity as f64 * (1.0 - metrics.kv_usage.clamp(0.0, 1.0))) as u64;
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

fn score(
    candidate: &Candidate,
    pod: &PodView,
    adapter: Option<&str>,
    tokens_needed: u64,
    max_inflight: u32,
    config: &SchedulerConfig,
) -> CandidateScore {
    let weights = &config.weights;
    let kv_headroom = match (candidate.has_metrics, candidate.free_kv) {
        (true, Some(free)) => kv_headroom_score(free, tokens_needed, candidate.capacity),
        (true, None) => 1.0 - candidate.kv_usage,
        (false, _) => 0.0,
    };
    // `limit / (limit + waiting)`: 1 for an empty queue, ½ at the saturation depth, and
    // still decreasing beyond it, so saturated pods remain comparable.
    let queue = if candidate.has_metrics {
        let limit = f64::from(config.saturation.queue_depth);
        limit / (limit + f64::from(candidate.waiting))
    } else {
        0.0
    };
    let inflight = if max_inflight == 0 {
        1.0
    } else {
        1.0 - f64::from(candidate.inflight) / f64::from(max_inflight)
    };
    let lora_tier = adapter.map(|adapter| LoraTier::of(pod, adapter));
    let lora = lora_tier.map_or(1.0, LoraTier::score);
    let total = weights.kv_headroom * kv_headroom
        + weights.queue * queue
        + weights.inflight * inflight
        + weights.lora_affinity * lora;
    CandidateScore {
        endpoint: pod.endpoint,
        total,
        kv_headroom,
        queue,
        inflight,
        lora,
        lora_tier,
        free_kv_tokens: candidate.free_kv,
    }
}

#[cfg(test)]
mod tests;
