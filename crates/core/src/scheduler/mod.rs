//! Picking the pod for one request: a pure function of the request, the fleet and the
//! configuration (no I/O, no clock, no logging, no metrics), so the live service, the
//! benchmarks and offline simulations share it. Three stages, one file each:
//!
//! 1. [`filter`]. Hard filters, which fail the request when nothing passes: inside the
//!    gateway's subset hint, able to serve the model (else 404; 503 while some pod's model
//!    list cannot be read, as it may serve it), healthy (else 503). Then
//!    soft filters, each applied only when it leaves at least one pod (the decision records
//!    every one it had to relax): not saturated (queue, or KV use unless the
//!    pod caches most of this request's prompt; KV use as reported plus what kvroute sent
//!    the pod since, so the few pods a scrape showed unsaturated do not take every request
//!    until the next one); enough free KV for the request's
//!    uncached prompt plus expected output, counting what kvroute has in flight there
//!    ([`free_kv_tokens`]).
//! 2. [`score`]. A weighted sum, highest wins:
//!    `kv·headroom + queue·limit/(limit + waiting) + inflight·(1 − inflight/max) +
//!    lora·tier + prefix·matched/blocks + prefill·scale/(scale + queued + own)`, where
//!    `matched` counts the prompt's leading blocks kvroute sent to the pod before (the
//!    caller looks them up in its [`crate::fleet::PrefixIndex`]; where the matches name
//!    a context's home, [`PrefixMatches::homed`], the other pods' copies count only in
//!    the soft filters' credit, and as nothing here and in stickiness), `queued` the prompt
//!    tokens kvroute sent there that have not streamed a first token yet, and `own` the
//!    part of this request's prompt the pod does not cache. `headroom` and the KV filters
//!    use the request's need on that pod: its uncached prompt plus its expected output.
//!    `headroom` and the queue term, read from the pod's own report, are weakened once
//!    that report is older than `max_metrics_age` (by `max_metrics_age / age`): old
//!    metrics count less, they do not exclude the pod.
//! 3. [`rank`]. The winner (random among ties), the next best as fallbacks, and the few
//!    best with their score breakdowns for the decision trace.
//!
//! Where no pod holds half the prompt (most requests), the filter's one pass over the fleet
//! also scores each pod that passes every filter, all but the in-flight term (whose scale
//! is the most in flight on one competitor, known at the end), and leaves out the pods
//! whose total cannot reach the ranking's few; the ranking completes the totals. The
//! outcome is the one the three stages make apart (`filter`'s docs).

mod config;
mod filter;
mod lora;
mod rank;
mod score;

use std::net::SocketAddr;

use rand::Rng;

pub use config::{InvalidConfig, Saturation, SchedulerConfig, Weights};
pub use lora::LoraTier;

use crate::fleet::{Fleet, PodLoad, PodView, PrefixMatches};
use crate::request::RouteRequest;

/// Why a request could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    #[error("no endpoints are known")]
    NoEndpoints,
    #[error("none of the gateway's subset endpoints is known to kvroute")]
    NoneInSubset,
    #[error("model `{0}` is not served by any endpoint")]
    UnknownModel(String),
    #[error(
        "model `{model}` is not listed by any endpoint whose model list could be read; \
         {unlisted} endpoint(s) have not answered GET /v1/models"
    )]
    ModelsNotListed { model: String, unlisted: usize },
    #[error("no ready endpoint can serve the request")]
    NoReadyEndpoint,
}

/// Soft filters that found no pod and were therefore skipped. `kv_headroom` is also set
/// when prefix stickiness keeps only pods holding the prompt's context and every one of
/// them has a queue at the saturation depth and no KV to start the prompt (see
/// `filter::filter`): the pick then lacks room as if no pod had it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Relaxed {
    pub saturation: bool,
    pub kv_headroom: bool,
}

impl Relaxed {
    pub fn any(&self) -> bool {
        self.saturation || self.kv_headroom
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
    /// Every reason a decision can carry, each LoRA tier apart.
    pub fn all() -> impl Iterator<Item = Reason> {
        [Reason::AnyReady, Reason::LeastLoaded]
            .into_iter()
            .chain(LoraTier::ALL.into_iter().map(Reason::Lora))
            .chain([Reason::PrefixCache, Reason::Fallback])
    }

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

/// What each score term adds to a candidate's total: the term times its weight. The six
/// add up to the total.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct WeightedTerms {
    pub kv_headroom: f64,
    pub queue: f64,
    pub inflight: f64,
    pub lora: f64,
    pub prefix: f64,
    pub prefill_queue: f64,
}

impl WeightedTerms {
    /// The total, summed in the order the scheduler sums it.
    pub fn sum(&self) -> f64 {
        self.kv_headroom + self.queue + self.inflight + self.lora + self.prefix + self.prefill_queue
    }
}

/// One candidate's scores, kept for the decision trace.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CandidateScore {
    pub endpoint: SocketAddr,
    /// The weighted sum of the terms below (`weighted` has each addend).
    pub total: f64,
    /// Each term times its weight.
    pub weighted: WeightedTerms,
    /// The terms, each 0..=1 before weighting.
    pub kv_headroom: f64,
    pub queue: f64,
    pub inflight: f64,
    pub lora: f64,
    pub lora_tier: Option<LoraTier>,
    /// Share of the prompt's blocks the pod likely holds, 0..=1, where they draw the
    /// request: 0 at a copy of a context whose home is another pod
    /// ([`crate::fleet::PrefixMatches::homed`]), though `cached_tokens` counts it.
    pub prefix: f64,
    /// `scale / (scale + queued prefill tokens + this request's uncached prompt)`, 0..=1.
    pub prefill_queue: f64,
    /// Free KV tokens the scheduler estimated for the pod, if its capacity is known.
    pub free_kv_tokens: Option<u64>,
    /// Prompt tokens the pod likely caches for this request, credited against its need.
    pub cached_tokens: u64,
    /// Prompt tokens the pod likely caches for this request, whether or not credited:
    /// a copy of a context whose home is another pod holds it but is credited nothing
    /// ([`crate::fleet::PrefixMatches::homed`]).
    pub held_tokens: u64,
}

impl CandidateScore {
    /// New KV the request needs on this pod: `tokens_needed` less what it caches.
    pub fn kv_tokens_needed(&self, tokens_needed: u64) -> u64 {
        tokens_needed.saturating_sub(self.cached_tokens)
    }
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
    /// Whether some candidate's whole KV pool could hold the request (or does not report its
    /// size): when no pod has room now, waiting for one to drain can succeed.
    pub could_fit: bool,
    /// The best few candidates with their scores, winner first.
    pub ranked: Vec<CandidateScore>,
}

impl Decision {
    /// What the filters found, as [`pick_unless`] shows it to its caller.
    pub fn outlook(&self) -> Outlook {
        Outlook {
            relaxed: self.relaxed,
            could_fit: self.could_fit,
            tokens_needed: self.tokens_needed,
            shadow: None,
        }
    }

    /// See [`Outlook::lacks_room`].
    pub fn lacks_room(&self) -> bool {
        self.outlook().lacks_room()
    }
}

/// What the filters found of a request before any pod is scored: enough for flow control
/// to decline placing it ([`pick_unless`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Outlook {
    pub relaxed: Relaxed,
    /// Whether some candidate's whole KV pool could hold the request.
    pub could_fit: bool,
    /// Tokens the request is expected to occupy (prompt + expected output).
    pub tokens_needed: u64,
    /// What the outlook says of other requests, where it can say something.
    pub shadow: Option<Shadow>,
}

/// What a pick that lacked room says of the picks after it: on the same fleet, with
/// nothing placed since, a request for the same model, placed by the same configuration
/// and without a subset hint, that no pod caches any of and that needs at least `tokens`
/// and at most `largest_pool` (so that some pod's whole pool still holds it), lacks room
/// too. The filters were decided on the pods' flags: without a cached share a pod's
/// saturation does not depend on the request, and a pod that cannot fit `tokens` cannot
/// fit more; so the same soft filters relax, and no pod they accept fits. Flow control
/// retries the requests it holds at every finish, and at overload most of them cover
/// one another ([`crate::flow::Shadows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Shadow {
    pub tokens: u64,
    pub largest_pool: u64,
    pub relaxed: Relaxed,
}

impl Shadow {
    /// Whether a request needing `tokens_needed`, that no pod caches any of, lacks room.
    pub fn covers(&self, tokens_needed: u64) -> bool {
        self.tokens <= tokens_needed && tokens_needed <= self.largest_pool
    }

    /// The outlook of a request it covers.
    pub fn outlook(&self, tokens_needed: u64) -> Outlook {
        Outlook {
            relaxed: self.relaxed,
            could_fit: true,
            tokens_needed,
            shadow: Some(*self),
        }
    }
}

impl Outlook {
    /// No pod has the free KV the request needs now (the pick is the least bad), yet one
    /// could hold it once it drains. Placed now, the request would make the pod preempt
    /// running requests; flow control holds it instead. (Every pod *saturated* is not
    /// enough: a pod past the thresholds that still has the KV takes the request into its
    /// queue, and starts it the moment a batch slot frees, sooner than a gateway that learns
    /// of the room at the next scrape.)
    pub fn lacks_room(&self) -> bool {
        self.relaxed.kv_headroom && self.could_fit
    }
}

/// A pick that may stop once the filters have spoken ([`pick_unless`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Picked {
    Decided(Decision),
    /// The caller declined what the filters found; nothing was scored.
    Declined(Outlook),
}

/// Picks the pod for `request` (see the module docs for the rules). `prefix` holds how
/// much of the prompt each pod likely caches, as the caller's prefix memory says.
pub fn pick<R: Rng + ?Sized>(
    request: &RouteRequest<'_>,
    prefix: Option<&PrefixMatches>,
    fleet: &Fleet,
    config: &SchedulerConfig,
    rng: &mut R,
) -> Result<Decision, PickError> {
    let ask = Ask::new(request, prefix, fleet, config);
    let filtered = filter::filter(request, fleet, &ask.demand, config, &ask.scorer)?;
    Ok(ask.decide(request, filtered, config, rng.next_u64()))
}

/// [`pick`], unless `declines` declines the [`Outlook`] its filters find: then the pods
/// are neither scored nor ranked, and where no pod passes every soft filter (at
/// overload, where flow control declines most picks of the requests it holds) only
/// their flags are read. `rng` is left as [`pick`] leaves it, so that declining early
/// changes no later decision.
pub fn pick_unless<R: Rng + ?Sized>(
    request: &RouteRequest<'_>,
    prefix: Option<&PrefixMatches>,
    fleet: &Fleet,
    config: &SchedulerConfig,
    rng: &mut R,
    declines: impl Fn(&Outlook) -> bool,
) -> Result<Picked, PickError> {
    let ask = Ask::new(request, prefix, fleet, config);
    let tokens_needed = ask.tokens_needed;
    let outlook = |relaxed, could_fit| Outlook {
        relaxed,
        could_fit,
        tokens_needed,
        shadow: None,
    };
    let screened = filter::filter_unless(
        request,
        fleet,
        &ask.demand,
        config,
        &ask.scorer,
        &|relaxed, could_fit| declines(&outlook(relaxed, could_fit)),
    )?;
    // Drawn whether or not the pick goes on: one draw per pick that passed the filters.
    let draw = rng.next_u64();
    let filtered = match screened {
        filter::Screened::Declined {
            relaxed,
            could_fit,
            largest_pool,
        } => {
            let mut declined = outlook(relaxed, could_fit);
            let cached_nowhere = prefix.is_none_or(|prefix| !prefix.any());
            if declined.lacks_room() && cached_nowhere && request.subset.is_none() {
                declined.shadow = Some(Shadow {
                    tokens: tokens_needed,
                    largest_pool,
                    relaxed,
                });
            }
            return Ok(Picked::Declined(declined));
        }
        filter::Screened::Kept(filtered) => filtered,
    };
    let found = outlook(filtered.relaxed, filtered.could_fit);
    if declines(&found) {
        return Ok(Picked::Declined(found));
    }
    Ok(Picked::Decided(ask.decide(request, filtered, config, draw)))
}

/// What a pick asks of every pod, and how it scores them.
struct Ask<'a> {
    demand: filter::Demand<'a>,
    scorer: score::Scorer<'a>,
    tokens_needed: u64,
}

impl<'a> Ask<'a> {
    fn new(
        request: &'a RouteRequest<'a>,
        prefix: Option<&'a PrefixMatches>,
        fleet: &'a Fleet,
        config: &'a SchedulerConfig,
    ) -> Self {
        let tokens_needed = tokens_needed(request, config);
        let demand = filter::Demand::new(
            u64::from(request.prompt_tokens()).min(tokens_needed),
            tokens_needed,
            prefix,
        );
        let adapter = request
            .model()
            .filter(|model| lora::is_adapter(model, fleet.snapshot(), config));
        Ask {
            demand,
            scorer: score::Scorer::new(fleet, prefix, demand, adapter, config),
            tokens_needed,
        }
    }

    /// Ranks the candidates `filtered` kept, `draw` breaking a tie, and decides.
    fn decide(
        self,
        request: &RouteRequest<'_>,
        filtered: filter::Filtered,
        config: &SchedulerConfig,
        draw: u64,
    ) -> Decision {
        let scorer = self.scorer.with_max_inflight(filtered.max_inflight);
        let ranking = rank::rank(&filtered, &scorer, config, draw);
        decide(request, &filtered, ranking, self.tokens_needed, config)
    }
}

/// The decision from a ranking: its reason, fallbacks and trace.
fn decide(
    request: &RouteRequest<'_>,
    filtered: &filter::Filtered,
    ranking: rank::Ranking,
    tokens_needed: u64,
    config: &SchedulerConfig,
) -> Decision {
    let rank::Ranking {
        winner,
        mut ranked,
        accepted,
    } = ranking;
    let relaxed = filtered.relaxed;
    let reason = if relaxed.any() {
        Reason::Fallback
    } else if let Some(tier) = winner.lora_tier {
        Reason::Lora(tier)
    } else if winner.prefix > 0.0 {
        Reason::PrefixCache
    } else if request.model().is_none() {
        Reason::AnyReady
    } else {
        Reason::LeastLoaded
    };
    let fallbacks = ranked
        .iter()
        .take(config.fallbacks)
        .map(|c| c.endpoint)
        .collect();
    ranked.truncate(config.trace_candidates.saturating_sub(1));
    let endpoint = winner.endpoint;
    ranked.insert(0, winner);
    Decision {
        endpoint,
        fallbacks,
        reason,
        relaxed,
        tokens_needed,
        candidates: accepted,
        could_fit: filtered.could_fit,
        ranked,
    }
}

/// Prompt plus expected output: `max_tokens` when set, else the configured default.
pub fn tokens_needed(request: &RouteRequest<'_>, config: &SchedulerConfig) -> u64 {
    if request.model().is_none() {
        return 0;
    }
    let output = request
        .max_output_tokens()
        .unwrap_or(config.default_output_tokens);
    u64::from(request.prompt_tokens()) + u64::from(output)
}

/// Free KV tokens: capacity minus the largest of three lower bounds of what the pod will
/// use (see [`crate::fleet::PodLoad`]): what it reports in use, plus what the requests it
/// reported queued will allocate, plus what kvroute sent since the last scrape; what the
/// requests kvroute has in flight there need at their peak; and what it reports plus the
/// output the streaming requests kvroute watches have yet to generate.
///
/// The report alone misses queued requests and output still to come, the commitments miss
/// other gateways' traffic and the prompt blocks shared with other requests; adding them
/// would count running requests twice. A request the pod reported queued holds no block
/// yet (vLLM allocates a prompt's blocks when it admits it), so its need is taken as the
/// mean need of kvroute's own requests there ([`PodLoad::mean_need`]): without it a pod
/// whose queue was full but whose running batch left a few blocks free looked free, took
/// more requests into its queue, and preempted when they were admitted. The report is
/// read less what kvroute's own requests in it have freed since, as they finished
/// ([`PodLoad::released_tokens`]): a request held for room is placed at the finish that
/// makes the room, not at the next scrape.
///
/// With `replicas` kvroute replicas behind the same gateways, what kvroute sent since the
/// last scrape and what its requests commit count that many times
/// ([`SchedulerConfig::replicas`]); the queue is the pod's own count, and what was freed
/// is only what this replica saw end. `None` when the pod did not report its capacity.
pub fn free_kv_tokens(pod: &PodView, load: &PodLoad, replicas: u32) -> Option<u64> {
    let signals = pod.signals()?;
    let used = kv_used_tokens_of(
        signals.kv_capacity_tokens,
        signals.kv_used_tokens,
        u16::try_from(signals.queued).unwrap_or(u16::MAX),
        load.unscraped_tokens(),
        load,
        replicas,
    )?;
    Some(signals.kv_capacity_tokens.saturating_sub(used))
}

/// The KV tokens a pod whose capacity, reported use and queue and unscraped tokens the
/// caller has in hand will use by kvroute's accounting ([`free_kv_tokens`] before it is
/// taken from the capacity), which may exceed its capacity: the excess waits in its queue.
/// `None` when the pod did not report its capacity. Inlined: the filter's pass over
/// thousands of pods calls it for each.
#[inline(always)]
fn kv_used_tokens_of(
    capacity: u64,
    reported: u64,
    queued: u16,
    unscraped: u64,
    load: &PodLoad,
    replicas: u32,
) -> Option<u64> {
    if capacity == 0 {
        return None;
    }
    // One replica (the usual case) without the three multiplications.
    let all = |own: u64| {
        if replicas == 1 {
            own
        } else {
            own.saturating_mul(u64::from(replicas))
        }
    };
    // The pod's queue is the pod's own count, every replica's requests in it. (At most
    // 2¹⁶ × 2³²: no overflow, and no check in a pass over thousands of pods.)
    let queued = u64::from(queued) * u64::from(load.mean_need());
    // What kvroute's requests held in the report and freed since they finished: the pod
    // admits its queue into it at once, before the next scrape shows it. Not scaled by
    // `replicas`: the others' requests end when they end, and assuming they freed as much
    // made two replicas place into room not yet there (1.24× one replica's p90 at the
    // knee of shared-prefix-pressure, against 1.02×).
    let reported = reported.saturating_sub(load.released_tokens());
    Some(
        reported
            .saturating_add(queued)
            .saturating_add(all(unscraped))
            .max(all(load.committed_tokens()))
            .max(reported.saturating_add(all(load.growth_tokens()))),
    )
}

#[cfg(test)]
mod tests;
