//! Stage 2: the score of each accepted pod, a weighted sum of terms that each lie in
//! 0..=1 (the formula is in the module docs of [`super`]).

use super::filter::{Candidate, Demand, as_f64};
use super::lora::LoraTier;
use super::{CandidateScore, SchedulerConfig, WeightedTerms};
use crate::fleet::{AdapterProbe, Fleet, PodRow, PodView, PositionSet, PrefixMatches, adapter_key};

/// The scores of one request against the candidates.
pub(super) struct Scorer<'a> {
    fleet: &'a Fleet,
    prefix: Option<&'a PrefixMatches>,
    demand: Demand<'a>,
    adapter: Option<&'a str>,
    /// [`adapter_key`] of `adapter`.
    adapter_key: u64,
    /// Its bit in the pods' summaries of remembered adapters.
    adapter_probe: AdapterProbe,
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
    /// The weighted terms of [`Scorer::ceiling`] but the LoRA, prefix and in-flight ones,
    /// for a pod caching none of the prompt and for one caching some.
    ceiling_uncached: f64,
    ceiling_cached: f64,
    config: &'a SchedulerConfig,
}

/// Queue lengths whose queue term [`Scorer`] computes once per pick.
const QUEUE_TERMS: usize = 16;

/// A candidate's weighted terms but the in-flight one, whose scale (the most requests in
/// flight on one competing candidate) is known only once the filters are done: the
/// filter's pass scores the pods it keeps while they are at hand, the ranking completes
/// the sum ([`Scorer::complete`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Partial {
    /// The KV headroom and queue terms, summed.
    head: f64,
    lora: f64,
    prefix: f64,
    prefill_queue: f64,
}

impl<'a> Scorer<'a> {
    /// The scorer of one request; [`Scorer::with_max_inflight`] completes it once the
    /// filters are done.
    pub(super) fn new(
        fleet: &'a Fleet,
        prefix: Option<&'a PrefixMatches>,
        demand: Demand<'a>,
        adapter: Option<&'a str>,
        config: &'a SchedulerConfig,
    ) -> Self {
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
            adapter_probe: AdapterProbe::of(key),
            adapter_running,
            adapter_waiting,
            max_inflight: 0,
            inverse_max_inflight: 0.0,
            inverse_request_blocks: prefix.map_or(0.0, |p| 1.0 / f64::from(p.request_blocks)),
            queue_terms: std::array::from_fn(|waiting| limit / (limit + waiting as f64)),
            // The KV headroom and queue terms at their greatest, and the prefill queue's
            // (whose greatest with none of the prompt cached is below 1).
            ceiling_uncached: {
                let w = &config.weights;
                let scale = f64::from(config.prefill_queue_tokens);
                let prefill_queue = scale / (scale + as_f64(demand.uncached_prompt(0)));
                w.kv_headroom + w.queue + w.prefill_queue * prefill_queue
            },
            ceiling_cached: {
                let w = &config.weights;
                w.kv_headroom + w.queue + w.prefill_queue
            },
            config,
        }
    }

    /// The scorer with the most requests in flight on one competing candidate (the
    /// in-flight term's scale).
    pub(super) fn with_max_inflight(mut self, max_inflight: u32) -> Self {
        self.max_inflight = max_inflight;
        self.inverse_max_inflight = if max_inflight == 0 {
            0.0
        } else {
            1.0 / f64::from(max_inflight)
        };
        self
    }

    fn pod(&self, c: &Candidate) -> &PodView {
        &self.fleet.snapshot().pods()[c.index as usize]
    }

    /// Weakened as the pod's metrics age (see `filter::Reading::trust`).
    /// `row` is the candidate's row in the snapshot.
    #[inline]
    fn kv_headroom(&self, c: &Candidate, row: &PodRow) -> f64 {
        let headroom = match (c.has_metrics(), c.free_kv()) {
            (true, Some(free)) => {
                kv_headroom_score(free, self.demand.needed(c.cached), row.capacity)
            }
            (true, None) => 1.0 - f64::from(row.kv_usage),
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
        self.inflight_term(c.inflight)
    }

    #[inline]
    fn inflight_term(&self, inflight: u32) -> f64 {
        if self.max_inflight == 0 {
            1.0
        } else {
            1.0 - f64::from(inflight) * self.inverse_max_inflight
        }
    }

    /// `scale / (scale + queued + own)`: the request's first token waits for the prompts
    /// queued ahead of it and for its own uncached prompt, so a pod that caches most of
    /// the prompt is worth the prefill it saves, not just the share of blocks it holds.
    fn prefill_queue(&self, c: &Candidate) -> f64 {
        let scale = f64::from(self.config.prefill_queue_tokens);
        scale / (scale + as_f64(c.prefill + self.demand.uncached_prompt(c.cached)))
    }

    /// The test inlined, the tier out of line: in the filter's pass over thousands of
    /// pods, a base-model request pays one branch and an adapter request a call.
    #[inline(always)]
    fn lora_tier(&self, c: &Candidate) -> Option<LoraTier> {
        self.adapter?;
        Some(self.adapter_tier(c.index as usize))
    }

    #[inline(never)]
    fn adapter_tier(&self, index: usize) -> LoraTier {
        self.tier_with(index, || {
            let load = self.fleet.load(index);
            load.standing_if_not_remembered(self.adapter_probe)
                .unwrap_or_else(|| load.adapter_standing(self.adapter_key))
        })
    }

    /// The adapter's tier on the pod at `index`, `recency` saying where the adapter
    /// stands among those kvroute sent the pod lately (asked only when it matters).
    #[inline(always)]
    fn tier_with(
        &self,
        index: usize,
        recency: impl FnOnce() -> (Option<usize>, usize),
    ) -> LoraTier {
        LoraTier::decide(
            self.fleet.snapshot().adapters.slots(index),
            self.adapter_running.contains(index),
            self.adapter_waiting.contains(index),
            recency,
        )
    }

    /// Share of the prompt's leading blocks the pod holds, where they draw the request
    /// to it ([`PrefixMatches::drawing_blocks_at`]: not at a copy of a context whose home
    /// is elsewhere).
    fn prefix(&self, c: &Candidate) -> f64 {
        self.prefix.map_or(0.0, |p| {
            f64::from(p.drawing_blocks_at(c.index as usize)) * self.inverse_request_blocks
        })
    }

    /// Prompt tokens the pod caches, whether or not they draw the request to it
    /// (`Candidate::cached`): what the trace shows and the per-request check compares with
    /// what the engine served.
    fn held_tokens(&self, c: &Candidate) -> u64 {
        self.demand.prefix.map_or(0, |p| {
            let blocks = p.blocks_at(c.index as usize);
            u64::from(self.demand.cached(blocks, u64::from(p.block_tokens)))
        })
    }

    /// Every weighted term of `c`, whose row in the snapshot is `row`, but the in-flight
    /// one.
    #[inline(always)]
    pub(super) fn partial(&self, c: &Candidate, row: &PodRow) -> Partial {
        self.partial_with_lora(c, row, self.lora_term(c))
    }

    /// The weighted LoRA term of `c`.
    #[inline(always)]
    pub(super) fn lora_term(&self, c: &Candidate) -> f64 {
        self.config.weights.lora_affinity * self.lora_tier(c).map_or(1.0, LoraTier::score)
    }

    /// [`Scorer::partial`] with `c`'s weighted LoRA term already at hand.
    #[inline(always)]
    pub(super) fn partial_with_lora(&self, c: &Candidate, row: &PodRow, lora: f64) -> Partial {
        let weights = &self.config.weights;
        Partial {
            head: weights.kv_headroom * self.kv_headroom(c, row) + weights.queue * self.queue(c),
            lora,
            prefix: weights.prefix_affinity * self.prefix(c),
            prefill_queue: weights.prefill_queue * self.prefill_queue(c),
        }
    }

    /// The most [`Scorer::lora_term`] of an adapter request can be for `c` without asking
    /// where the adapter stands among those kvroute sent the pod lately: its term where
    /// the summary on the pod's counters' line rules the adapter out (most pods of a
    /// light fleet); elsewhere a pod neither running nor queueing it is at best `Warm`.
    /// Reading the standing is an atomic scan of a second cache line of the pod's, which
    /// most pods need not pay.
    #[inline(always)]
    pub(super) fn lora_term_ceiling(&self, c: &Candidate) -> f64 {
        let index = c.index as usize;
        let tier = self.tier_with(index, || {
            self.fleet
                .load(index)
                .standing_if_not_remembered(self.adapter_probe)
                // Standing first among the adapters sent lately: `Warm` where it is asked.
                .unwrap_or((Some(0), 0))
        });
        self.config.weights.lora_affinity * tier.score()
    }

    /// Whether the request names an adapter (its LoRA term differs from pod to pod).
    pub(super) fn for_adapter(&self) -> bool {
        self.adapter.is_some()
    }

    /// The most `c`'s total can be with the in-flight term at `inflight_term`, knowing
    /// only its weighted LoRA term `lora`: the other terms at their greatest (each lies in
    /// 0..=1; the prefill queue's is at most `scale / (scale + uncached prompt)`, reached
    /// with nothing queued). Cheaper than the partial, and what lets a pod that cannot
    /// reach the ranking's kept few be dropped before it is scored.
    #[inline(always)]
    pub(super) fn ceiling(&self, c: &Candidate, lora: f64, inflight_term: f64) -> f64 {
        let rest = if c.cached == 0 {
            self.ceiling_uncached
        } else {
            self.ceiling_cached
        };
        let weights = &self.config.weights;
        rest + weights.inflight * inflight_term + lora + weights.prefix_affinity * self.prefix(c)
    }

    /// Bounds on the total of a candidate whose other terms are `partial`, with an
    /// in-flight term between `lowest` and `highest` (the term before its weight).
    /// Computed with the total's own additions, so rounding moves them as it moves it.
    #[inline(always)]
    pub(super) fn bounds(&self, partial: &Partial, lowest: f64, highest: f64) -> (f64, f64) {
        let (a, b) = (self.sum(partial, lowest), self.sum(partial, highest));
        (a.min(b), a.max(b))
    }

    /// The total of a candidate with `inflight` requests in flight whose other terms are
    /// `partial`: the terms summed in the order of the module docs' formula, so that a
    /// total completed from a partial equals [`Scorer::total`] to the bit.
    #[inline]
    pub(super) fn complete(&self, partial: &Partial, inflight: u32) -> f64 {
        self.sum(partial, self.inflight_term(inflight))
    }

    /// The terms of `partial` and the in-flight `term`, weighted, summed in the order of
    /// the module docs' formula: one spelling for totals and their bounds alike.
    #[inline(always)]
    fn sum(&self, partial: &Partial, term: f64) -> f64 {
        partial.head
            + self.config.weights.inflight * term
            + partial.lora
            + partial.prefix
            + partial.prefill_queue
    }

    pub(super) fn total(&self, c: &Candidate) -> f64 {
        let row = self.fleet.row(c.index as usize);
        self.complete(&self.partial(c, row), c.inflight)
    }

    pub(super) fn breakdown(&self, c: &Candidate) -> CandidateScore {
        let row = self.fleet.row(c.index as usize);
        let lora_tier = self.lora_tier(c);
        let weights = &self.config.weights;
        CandidateScore {
            endpoint: self.pod(c).endpoint,
            total: self.total(c),
            weighted: WeightedTerms {
                kv_headroom: weights.kv_headroom * self.kv_headroom(c, row),
                queue: weights.queue * self.queue(c),
                inflight: weights.inflight * self.inflight(c),
                lora: weights.lora_affinity * lora_tier.map_or(1.0, LoraTier::score),
                prefix: weights.prefix_affinity * self.prefix(c),
                prefill_queue: weights.prefill_queue * self.prefill_queue(c),
            },
            kv_headroom: self.kv_headroom(c, row),
            queue: self.queue(c),
            inflight: self.inflight(c),
            lora: lora_tier.map_or(1.0, LoraTier::score),
            lora_tier,
            prefix: self.prefix(c),
            prefill_queue: self.prefill_queue(c),
            free_kv_tokens: c.free_kv(),
            cached_tokens: u64::from(c.cached),
            held_tokens: self.held_tokens(c),
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
        0.5 + 0.5 * (as_f64(free - needed) / as_f64(capacity)).min(1.0)
    } else {
        0.5 * as_f64(free) / as_f64(needed)
    }
}
