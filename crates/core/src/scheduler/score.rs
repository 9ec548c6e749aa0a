//! Stage 2: the score of each accepted pod, a weighted sum of terms that each lie in
//! 0..=1 (the formula is in the module docs of [`super`]).

use super::filter::{Candidate, Demand, Filtered};
use super::lora::LoraTier;
use super::{CandidateScore, SchedulerConfig, WeightedTerms};
use crate::fleet::{Fleet, PodView, PositionSet, PrefixMatches, adapter_key};

/// The scores of one request against the candidates.
pub(super) struct Scorer<'a> {
    fleet: &'a Fleet,
    prefix: Option<&'a PrefixMatches>,
    demand: Demand<'a>,
    adapter: Option<&'a str>,
    /// [`adapter_key`] of `adapter`.
    adapter_key: u64,
    /// Pods running / queueing `adapter`, from the snapshot's adapter index.
    adapter_running: PositionSet,
    adapter_waiting: PositionSet,
    /// The most requests in flight on any accepted candidate.
    max_inflight: u32,
    /// `1 / max_inflight` and `1 / request_blocks` of the prefix match, so that the terms
    /// each candidate computes multiply: over thousands of candidates the divider, not the
    /// arithmetic, sets a pick's time.
    inverse_max_inflight: f64,
    inverse_request_blocks: f64,
    /// The queue term of a pod with `waiting` requests queued, for the short queues most
    /// pods have.
    queue_terms: [f64; QUEUE_TERMS],
    config: &'a SchedulerConfig,
}

/// Queue lengths whose queue term [`Scorer`] computes once per pick.
const QUEUE_TERMS: usize = 16;

impl<'a> Scorer<'a> {
    pub(super) fn new(
        filtered: &Filtered,
        fleet: &'a Fleet,
        prefix: Option<&'a PrefixMatches>,
        demand: Demand<'a>,
        adapter: Option<&'a str>,
        config: &'a SchedulerConfig,
    ) -> Self {
        let max_inflight = filtered.max_inflight;
        let key = adapter.map_or(0, adapter_key);
        let pods = fleet.snapshot().pods().len();
        let index = &fleet.snapshot().adapters;
        let (adapter_running, adapter_waiting) = if adapter.is_some() {
            (
                PositionSet::of(index.running(key), pods),
                PositionSet::of(index.waiting(key), pods),
            )
        } else {
            (PositionSet::default(), PositionSet::default())
        };
        let prefix = prefix.filter(|p| p.any() && p.request_blocks > 0);
        let limit = f64::from(config.saturation.queue_depth);
        Scorer {
            fleet,
            prefix,
            demand,
            adapter,
            adapter_key: key,
            adapter_running,
            adapter_waiting,
            max_inflight,
            inverse_max_inflight: if max_inflight == 0 {
                0.0
            } else {
                1.0 / f64::from(max_inflight)
            },
            inverse_request_blocks: prefix.map_or(0.0, |p| 1.0 / f64::from(p.request_blocks)),
            queue_terms: std::array::from_fn(|waiting| limit / (limit + waiting as f64)),
            config,
        }
    }

    fn pod(&self, c: &Candidate) -> &PodView {
        &self.fleet.snapshot().pods()[c.index as usize]
    }

    /// Weakened as the pod's metrics age (see `filter::Reading::trust`).
    fn kv_headroom(&self, c: &Candidate) -> f64 {
        let headroom = match (c.has_metrics(), c.free_kv()) {
            (true, Some(free)) => {
                let capacity = self.fleet.row(c.index as usize).capacity;
                kv_headroom_score(free, self.demand.needed(c.cached), capacity)
            }
            (true, None) => 1.0 - f64::from(self.fleet.row(c.index as usize).kv_usage),
            (false, _) => 0.0,
        };
        c.trust() * headroom
    }

    /// `limit / (limit + waiting)`: 1 for an empty queue, ½ at the saturation depth, and
    /// still decreasing beyond it, so saturated pods remain comparable. Weakened as the
    /// pod's metrics age.
    fn queue(&self, c: &Candidate) -> f64 {
        if !c.has_metrics() {
            return 0.0;
        }
        let term = match self.queue_terms.get(c.waiting as usize) {
            Some(&term) => term,
            None => {
                let limit = f64::from(self.config.saturation.queue_depth);
                limit / (limit + f64::from(c.waiting))
            }
        };
        c.trust() * term
    }

    fn inflight(&self, c: &Candidate) -> f64 {
        if self.max_inflight == 0 {
            1.0
        } else {
            1.0 - f64::from(c.inflight) * self.inverse_max_inflight
        }
    }

    /// `scale / (scale + queued + own)`: the request's first token waits for the prompts
    /// queued ahead of it and for its own uncached prompt, so a pod that caches most of
    /// the prompt is worth the prefill it saves, not just the share of blocks it holds.
    fn prefill_queue(&self, c: &Candidate) -> f64 {
        let scale = f64::from(self.config.prefill_queue_tokens);
        scale / (scale + (c.prefill + self.demand.uncached_prompt(c.cached)) as f64)
    }

    fn lora_tier(&self, c: &Candidate) -> Option<LoraTier> {
        let index = c.index as usize;
        self.adapter.map(|_| {
            LoraTier::decide(
                self.fleet.snapshot().adapters.slots(index),
                self.adapter_running.contains(index),
                self.adapter_waiting.contains(index),
                || self.fleet.load(index).adapter_standing(self.adapter_key),
            )
        })
    }

    /// Share of the prompt's leading blocks the pod holds.
    fn prefix(&self, c: &Candidate) -> f64 {
        self.prefix.map_or(0.0, |p| {
            f64::from(p.blocks_at(c.index as usize)) * self.inverse_request_blocks
        })
    }

    pub(super) fn total(&self, c: &Candidate) -> f64 {
        let weights = &self.config.weights;
        weights.kv_headroom * self.kv_headroom(c)
            + weights.queue * self.queue(c)
            + weights.inflight * self.inflight(c)
            + weights.lora_affinity * self.lora_tier(c).map_or(1.0, LoraTier::score)
            + weights.prefix_affinity * self.prefix(c)
            + weights.prefill_queue * self.prefill_queue(c)
    }

    pub(super) fn breakdown(&self, c: &Candidate) -> CandidateScore {
        let lora_tier = self.lora_tier(c);
        let weights = &self.config.weights;
        CandidateScore {
            endpoint: self.pod(c).endpoint,
            total: self.total(c),
            weighted: WeightedTerms {
                kv_headroom: weights.kv_headroom * self.kv_headroom(c),
                queue: weights.queue * self.queue(c),
                inflight: weights.inflight * self.inflight(c),
                lora: weights.lora_affinity * lora_tier.map_or(1.0, LoraTier::score),
                prefix: weights.prefix_affinity * self.prefix(c),
                prefill_queue: weights.prefill_queue * self.prefill_queue(c),
            },
            kv_headroom: self.kv_headroom(c),
            queue: self.queue(c),
            inflight: self.inflight(c),
            lora: lora_tier.map_or(1.0, LoraTier::score),
            lora_tier,
            prefix: self.prefix(c),
            prefill_queue: self.prefill_queue(c),
            free_kv_tokens: c.free_kv(),
            cached_tokens: u64::from(c.cached),
        }
    }
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
