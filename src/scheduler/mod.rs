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

    let mut candidates: Vec<usize> = match request.subset {
        Some(subset) => (0..pods.len())
            .filter(|&i| subset.contains(&pods[i].endpoint))
            .collect(),
        None => (0..pods.len()).collect(),
    };
    if candidates.is_empty() {
        return Err(PickError::NoneInSubset);
    }

    let adapter = request
        .model
        .filter(|model| lora::is_adapter(model, snapshot, config));
    if let Some(model) = request.model {
        candidates.retain(|&i| lora::may_serve(&pods[i], model, config));
        if candidates.is_empty() {
            return Err(PickError::UnknownModel(model.to_owned()));
        }
    }

    candidates.retain(|&i| pods[i].healthy);
    if candidates.is_empty() {
        return Err(PickError::NoReadyEndpoint);
    }

    let tokens_needed = tokens_needed(request, config);
    let mut relaxed = Relaxed::default();
    relaxed.stale_metrics = !narrow(&mut candidates, |i| is_fresh(&pods[i], config));
    relaxed.saturation = !narrow(&mut candidates, |i| !is_saturated(&pods[i], config));
    relaxed.kv_headroom = !narrow(&mut candidates, |i| {
        free_kv_tokens(&pods[i]).is_none_or(|free| free >= tokens_needed)
    });

    let max_inflight = candidates
        .iter()
        .map(|&i| pods[i].load.inflight())
        .max()
        .unwrap_or(0);
    let mut scored: Vec<CandidateScore> = candidates
        .iter()
        .map(|&i| score(&pods[i], adapter, tokens_needed, max_inflight, config))
        .collect();

    let best = scored
        .iter()
        .map(|c| c.total)
        .fold(f64::NEG_INFINITY, f64::max);
    let tied = scored
        .iter()
        .filter(|c| c.total >= best - TIE_EPSILON)
        .count();
    // The n-th tied candidate in snapshot order; snapshot order is deterministic, so
    // the choice depends only on the seeded RNG.
    let nth = rng.random_range(0..tied);
    let winner_index = scored
        .iter()
        .enumerate()
        .filter(|(_, c)| c.total >= best - TIE_EPSILON)
        .nth(nth)
        .map_or(0, |(index, _)| index);
    scored.swap(0, winner_index);

    let keep = 1 + config
        .fallbacks
        .max(config.trace_candidates.saturating_sub(1));
    let rest = &mut scored[1..];
    let by_score_desc = |a: &CandidateScore, b: &CandidateScore| b.total.total_cmp(&a.total);
    if rest.len() > keep {
        rest.select_nth_unstable_by(keep - 1, by_score_desc);
    }
    let ranked_len = scored.len().min(keep);
    scored[1..ranked_len].sort_by(by_score_desc);
    scored.truncate(ranked_len);

    let winner = &scored[0];
    let reason = if relaxed.any() {
        Reason::Fallback
    } else if let Some(tier) = winner.lora_tier {
        Reason::Lora(tier)
    } else if request.model.is_none() {
        Reason::AnyReady
    } else {
        Reason::LeastLoaded
    };
    let fallbacks = scored
        .iter()
        .skip(1)
        .take(config.fallbacks)
        .map(|c| c.endpoint)
        .collect();
    let candidates = candidates.len();
    scored.truncate(config.trace_candidates.max(1));
    Ok(Decision {
        endpoint: scored[0].endpoint,
        fallbacks,
        reason,
        relaxed,
        tokens_needed,
        candidates,
        ranked: scored,
    })
}

/// Keeps the candidates that pass `keep`, unless none would: then keeps all and
/// returns false (the filter was relaxed).
fn narrow(candidates: &mut Vec<usize>, keep: impl Fn(usize) -> bool) -> bool {
    if !candidates.iter().any(|&i| keep(i)) {
        return false;
    }
    candidates.retain(|&i| keep(i));
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
    pod: &PodView,
    adapter: Option<&str>,
    tokens_needed: u64,
    max_inflight: u32,
    config: &SchedulerConfig,
) -> CandidateScore {
    let weights = &config.weights;
    let free = free_kv_tokens(pod);
    let kv_headroom = match (pod.metrics.as_ref(), free) {
        (Some(metrics), Some(free)) => {
            kv_headroom_score(free, tokens_needed, metrics.kv_capacity_tokens.unwrap_or(0))
        }
        (Some(metrics), None) => 1.0 - metrics.kv_usage.clamp(0.0, 1.0),
        (None, _) => 0.0,
    };
    // `limit / (limit + waiting)`: 1 for an empty queue, ½ at the saturation depth, and
    // still decreasing beyond it, so saturated pods remain comparable.
    let queue = pod.metrics.as_ref().map_or(0.0, |metrics| {
        let limit = f64::from(config.saturation.queue_depth);
        limit / (limit + f64::from(metrics.waiting))
    });
    let inflight = if max_inflight == 0 {
        1.0
    } else {
        1.0 - f64::from(pod.load.inflight()) / f64::from(max_inflight)
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
        free_kv_tokens: free,
    }
}

#[cfg(test)]
mod tests;
