//! Stage 1: which pods may take the request. Hard filters fail the request when they
//! empty the set; soft filters apply only when someone passes them.
//!
//! Each pod is read from its row of the snapshot's dense table ([`PodRow`]) and its live
//! counters, once. The pods that may compete become compact [`Candidate`]s; the others
//! are only counted by flag combination ([`filter`] says when the fleet is read again).
//! Where the prompt's context is held, the pods that may compete are its holders (most of
//! a fleet that shares a system prompt is not recorded); where it is not, they are the
//! pods that pass every soft filter, scored but for the in-flight term as they are read
//! ([`Scorer::partial`]). Soft-filter outcomes are bits of `flags`; the filters are
//! applied to the flag combinations present (at most 8) rather than to each pod.

use std::borrow::Cow;
use std::time::Duration;

use super::lora::{Serves, ServesModel};
use super::rank::kept;
use super::score::{Partial, Scorer};
use super::{PickError, Relaxed, SchedulerConfig, kv_used_tokens_of};
use crate::fleet::{Fleet, PodLoad, PodRow, PodView, PrefixMatches};
use crate::request::RouteRequest;
use prune::{PRUNE_FROM_PODS, Prune, Pruning, most_inflight_anywhere};

/// Soft-filter outcomes of one pod, as bits: a pod passes a filter when its bit is set.
pub(super) const NOT_SATURATED: u8 = 1;
pub(super) const FITS: u8 = 2;
/// A pod that passes every soft filter has both bits.
const PASSES: u8 = NOT_SATURATED | FITS;
/// Not a filter: the pod has metrics at all.
pub(super) const HAS_METRICS: u8 = 4;
/// Flag combinations: `flags` takes values below this.
const COMBINATIONS: usize = 8;
/// [`Filtered::competes`] when every candidate kept competes.
const ALL_COMPETE: u16 = (1 << COMBINATIONS) - 1;
/// [`Candidate::trust`] of metrics no older than `max_metrics_age`.
const FULL_TRUST: u8 = u8::MAX;
/// [`Candidate::trust`] by its byte: `trust / 255`, computed once at compile time (the
/// same division, so the same values), as a pick reads it twice per candidate.
static TRUST_WEIGHTS: [f64; 256] = {
    let mut weights = [0.0; 256];
    let mut trust = 0;
    while trust < weights.len() {
        weights[trust] = trust as f64 / FULL_TRUST as f64;
        trust += 1;
    }
    weights
};
/// Sentinel for "capacity not reported" in [`Candidate::free_kv`].
const UNKNOWN: u64 = u64::MAX;

/// What the filters and scores need of one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Candidate {
    /// Position in the snapshot.
    pub(super) index: u32,
    pub(super) flags: u8,
    /// How far the pod's own report can be trusted, by its age, in 1/255ths (a byte keeps
    /// the record at 40 bytes; the scores read capacity and KV use from the pod's row, for
    /// the few candidates that compete): see [`Reading::trust`].
    trust: u8,
    pub(super) waiting: u32,
    pub(super) inflight: u32,
    /// Prompt tokens sent to the pod and not yet past prefill.
    pub(super) prefill: u64,
    /// Prompt tokens the pod likely holds in its prefix cache for this request, where
    /// they draw the request to it ([`Demand::drawing`]): what stickiness and the scores
    /// read (a prompt estimate fits in 32 bits; kept small, as every pass over thousands
    /// of candidates streams this record). The soft filters' flags credit every pod what
    /// it caches.
    pub(super) cached: u32,
    /// Estimated free KV tokens, or [`UNKNOWN`].
    free_kv: u64,
}

/// What the request asks of any pod, before crediting what a pod caches.
#[derive(Debug, Clone, Copy)]
pub(super) struct Demand<'a> {
    pub(super) prompt: u64,
    /// Prompt plus expected output.
    pub(super) tokens: u64,
    pub(super) prefix: Option<&'a PrefixMatches>,
    /// `prefix`'s home ([`PrefixMatches::home`]), or `usize::MAX` where every holder
    /// draws the request: read once, not at every pod of a pass.
    home: usize,
}

impl<'a> Demand<'a> {
    /// A request needing `tokens` (prompt plus expected output) for a `prompt`-token
    /// prompt that pods hold as `prefix` says.
    pub(super) fn new(prompt: u64, tokens: u64, prefix: Option<&'a PrefixMatches>) -> Self {
        Demand {
            prompt,
            tokens,
            prefix,
            home: prefix.and_then(PrefixMatches::home).unwrap_or(usize::MAX),
        }
    }
}

impl Demand<'_> {
    /// [`Demand::cached`] where the request has `MATCHES`, else nothing (a loop over a
    /// fleet for a request without matches needs none).
    #[inline(always)]
    fn cached_if<const MATCHES: bool>(&self, blocks: u32, block_tokens: u64) -> u32 {
        if MATCHES {
            self.cached(blocks, block_tokens)
        } else {
            0
        }
    }

    /// Prompt tokens a pod holding `blocks` of the prompt's leading blocks (kvroute sent it
    /// the same ones) likely caches, for blocks of `block_tokens`.
    pub(super) fn cached(&self, blocks: u32, block_tokens: u64) -> u32 {
        let tokens = (u64::from(blocks) * block_tokens).min(self.prompt);
        u32::try_from(tokens).unwrap_or(u32::MAX)
    }

    /// New KV the request needs on a pod caching `cached` of its prompt tokens.
    pub(super) fn needed(&self, cached: u32) -> u64 {
        self.tokens.saturating_sub(u64::from(cached))
    }

    /// Prompt tokens a pod caching `cached` of them must prefill.
    pub(super) fn uncached_prompt(&self, cached: u32) -> u64 {
        self.prompt.saturating_sub(u64::from(cached))
    }

    /// Whether the matches name the context's home ([`PrefixMatches::homed`]).
    pub(super) fn homed(&self) -> bool {
        self.home != usize::MAX
    }

    /// Of the `cached` prompt tokens the pod at `index` caches, those that draw the
    /// request to it (prefix stickiness): all of them, unless the context has another
    /// home ([`PrefixMatches::homed`]).
    #[inline(always)]
    pub(super) fn drawing(&self, index: usize, cached: u32) -> u32 {
        if self.home == usize::MAX || self.home == index {
            cached
        } else {
            0
        }
    }
}

/// What reading a pod into its [`Candidate`] needs of the request and the configuration,
/// gathered once per pick rather than once per pod.
struct Reading<'a> {
    demand: &'a Demand<'a>,
    config: &'a SchedulerConfig,
    /// `max_metrics_age` in nanoseconds, so that fresh pods need no `Duration`.
    max_age_nanos: u64,
    /// Whether something must stay free besides the request's need (`keep_free`,
    /// `keep_free_tokens`).
    keeps: bool,
}

impl<'a> Reading<'a> {
    fn new(demand: &'a Demand<'a>, config: &'a SchedulerConfig) -> Self {
        Reading {
            demand,
            config,
            max_age_nanos: u64::try_from(config.max_metrics_age.as_nanos()).unwrap_or(u64::MAX),
            keeps: config.keep_free > 0.0 || config.keep_free_tokens > 0,
        }
    }

    /// How much the report of the pod in `row` counts, by its age: fully up to
    /// `max_metrics_age`, then `max_metrics_age / age` (half at twice the age, a tenth at
    /// ten times); nothing without an age. Old metrics weaken the pod's KV and queue
    /// scores in proportion rather than excluding the pod: when the scraper falls behind on
    /// a large fleet, excluding every pod past a threshold herded all traffic onto
    /// whichever pods were scraped last. What kvroute itself sent (in flight, queued
    /// prefill, committed KV) is always current and is not weakened. Ages are compared in
    /// nanoseconds: most pods are fresh, and a `Duration` from nanoseconds costs a division.
    fn trust(&self, row: &PodRow) -> u8 {
        if row.age_nanos == PodRow::NO_AGE {
            return 0;
        }
        if row.age_nanos <= self.max_age_nanos {
            return FULL_TRUST;
        }
        let age = Duration::from_nanos(row.age_nanos);
        let share = self.config.max_metrics_age.as_secs_f64() / age.as_secs_f64();
        (share * f64::from(FULL_TRUST)).round() as u8
    }
}

impl Reading<'_> {
    /// The soft-filter flags of the pod in `row` caching `cached` of the prompt's tokens
    /// ([`Demand::cached`]), and its free KV tokens ([`UNKNOWN`] when it does not report
    /// its capacity). Cached blocks are shared, not allocated again: the request needs only
    /// the rest of its prompt, and the blocks it shares do not make the pod full for it.
    #[inline(always)]
    fn flags(&self, row: &PodRow, load: &PodLoad, cached: u32) -> (u8, u64) {
        // A pod never scraped is neither saturated nor full by what it reported.
        if !row.has_metrics {
            return (NOT_SATURATED | FITS, UNKNOWN);
        }
        let (demand, config) = (self.demand, self.config);
        let mut flags = NOT_SATURATED | FITS | HAS_METRICS;
        let unscraped = load.unscraped_tokens();
        let used = self.kv_used(row, load, unscraped);
        let queue_full = queue_reaches(row, load, used, config.saturation.queue_depth);
        if is_saturated(
            row,
            queue_full,
            unscraped,
            u64::from(cached),
            demand.prompt,
            config,
        ) {
            flags &= !NOT_SATURATED;
        }
        let Some(used) = used else {
            return (flags, UNKNOWN);
        };
        let free = row.capacity.saturating_sub(used);
        if !self.fits(row, free, cached) {
            flags &= !FITS;
        }
        (flags, free)
    }

    /// The KV tokens the pod in `row` will use ([`kv_used_tokens_of`]), whose unscraped
    /// tokens the caller read; `None` where it does not report its capacity.
    #[inline(always)]
    fn kv_used(&self, row: &PodRow, load: &PodLoad, unscraped: u64) -> Option<u64> {
        kv_used_tokens_of(
            row.capacity,
            row.used,
            row.queued,
            unscraped,
            load,
            self.config.replicas,
        )
    }

    /// Whether `free` KV tokens of the pod in `row` hold the request's need besides what
    /// must stay free: `keep_free` of the pool rounded up, or `keep_free_tokens` when
    /// more, though never more than half the pool (a quieter tenant's one huge request
    /// must not take half of every pod from a busier one).
    #[inline(always)]
    fn fits(&self, row: &PodRow, free: u64, cached: u32) -> bool {
        let config = self.config;
        let keep = if self.keeps {
            let capacity = row.capacity;
            ((capacity as f64 * config.keep_free).ceil() as u64)
                .max(config.keep_free_tokens.min(capacity / 2))
        } else {
            0
        };
        free >= self.demand.needed(cached).saturating_add(keep)
    }

    /// [`Reading::flags`] of a pod that passes every soft filter, `None` for one that
    /// fails one: the pass that keeps only the passing pods stops at the first filter
    /// that fails (most failing pods are saturated, and skip the free-KV arithmetic).
    #[inline(always)]
    fn passing_flags(&self, row: &PodRow, load: &PodLoad, cached: u32) -> Option<(u8, u64)> {
        if !row.has_metrics {
            return Some((NOT_SATURATED | FITS, UNKNOWN));
        }
        let config = self.config;
        // Saturated by its report alone (most failing pods): no KV arithmetic.
        if row.waiting >= config.saturation.queue_depth {
            return None;
        }
        let unscraped = load.unscraped_tokens();
        let used = self.kv_used(row, load, unscraped);
        if is_saturated(
            row,
            queue_reaches(row, load, used, config.saturation.queue_depth),
            unscraped,
            u64::from(cached),
            self.demand.prompt,
            config,
        ) {
            return None;
        }
        let flags = NOT_SATURATED | FITS | HAS_METRICS;
        match used {
            None => Some((flags, UNKNOWN)),
            Some(used) => {
                let free = row.capacity.saturating_sub(used);
                self.fits(row, free, cached).then_some((flags, free))
            }
        }
    }
}

/// Whether the pod's queue by kvroute's accounting reaches `depth`: its report, or the
/// requests its KV will not hold (`used` beyond its capacity, at the mean need of
/// kvroute's requests there) when more. Between two scrapes the report misses the
/// requests kvroute sent since that the pod could not admit: a context's home kept taking
/// its tenants' requests at once, its report showing a short queue, until the next scrape
/// showed the long one. (Compared without dividing: the pass over thousands of pods.) On
/// a data-parallel pod the report's queue is per engine while the requests beyond its KV
/// are the whole pod's: between two scrapes such a pod reads saturated when its KV is
/// overfilled by `depth` requests, rather than `depth` per engine.
#[inline(always)]
fn queue_reaches(row: &PodRow, load: &PodLoad, used: Option<u64>, depth: u32) -> bool {
    row.waiting >= depth
        || used.is_some_and(|used| {
            used > row.capacity
                && used - row.capacity >= u64::from(depth) * u64::from(load.mean_need().max(1))
        })
}

/// Requests on a pod by what is known now: kvroute's own `inflight`, or the queue the pod
/// reported (`waiting`) when other gateways' requests make it the longer.
fn load(inflight: u32, waiting: u32) -> u32 {
    inflight.max(waiting)
}

/// The queue the pod in `row` reported; none for a pod never scraped.
fn reported_waiting(row: &PodRow) -> u32 {
    if row.has_metrics { row.waiting } else { 0 }
}

impl Candidate {
    /// The pod at `index` in the snapshot, caching `cached` of the prompt's tokens.
    fn read(
        index: usize,
        row: &PodRow,
        load: &PodLoad,
        cached: u32,
        reading: &Reading<'_>,
    ) -> Self {
        let (flags, free_kv) = reading.flags(row, load, cached);
        Candidate::with_flags(index, row, load, cached, reading, flags, free_kv)
    }

    /// [`Candidate::read`] of a pod whose flags and free KV are known.
    #[inline(always)]
    fn with_flags(
        index: usize,
        row: &PodRow,
        load: &PodLoad,
        cached: u32,
        reading: &Reading<'_>,
        flags: u8,
        free_kv: u64,
    ) -> Self {
        Candidate {
            index: index as u32,
            flags,
            trust: reading.trust(row),
            waiting: reported_waiting(row),
            inflight: load.inflight(),
            prefill: load.prefill_tokens(),
            cached: reading.demand.drawing(index, cached),
            free_kv,
        }
    }

    /// Requests on the pod by what is known now ([`load`]).
    pub(super) fn load(&self) -> u32 {
        load(self.inflight, self.waiting)
    }

    pub(super) fn free_kv(&self) -> Option<u64> {
        (self.free_kv != UNKNOWN).then_some(self.free_kv)
    }

    pub(super) fn has_metrics(&self) -> bool {
        self.flags & HAS_METRICS != 0
    }

    /// The weight (0..=1) of what the pod reported, by its age, looked up: a pick over
    /// thousands of candidates is bound by the divider as much as by anything.
    pub(super) fn trust(&self) -> f64 {
        TRUST_WEIGHTS[usize::from(self.trust)]
    }
}

/// The pods that passed the hard filters and compete for the request.
#[derive(Debug, PartialEq)]
pub(super) struct Filtered {
    /// Healthy pods that may serve the request, in snapshot order: those whose flags are
    /// in `competes` compete ([`Filtered::competing`]). Where stickiness applies, only
    /// the ones that the soft filters accept (see [`accepts`]) and that hold enough of the
    /// prompt's prefix ([`sticky_floor`]) are kept, and all of them compete.
    pub(super) candidates: Vec<Candidate>,
    /// The flag combinations that compete, as a bitmap over flag values: without
    /// stickiness, the soft filters' verdict (the candidates are not copied again to drop
    /// the others: on a fleet of thousands that copy cost as much as a tenth of the pick).
    pub(super) competes: u16,
    /// When the first pass kept only the pods that pass every soft filter, each one's
    /// terms but the in-flight one, computed as it was read ([`Scorer::partial`]); else
    /// empty, and the ranking scores the competing candidates itself.
    pub(super) partials: Vec<Partial>,
    /// How many pods the soft filters accepted, before prefix stickiness.
    pub(super) accepted: usize,
    /// The most requests in flight on one accepted pod (the in-flight score's scale).
    pub(super) max_inflight: u32,
    pub(super) relaxed: Relaxed,
    /// Some candidate's whole KV pool could hold the request, or does not report its size.
    pub(super) could_fit: bool,
}

impl Filtered {
    /// The candidates that compete, with their positions in `candidates`.
    pub(super) fn competing(&self) -> impl Iterator<Item = (usize, &Candidate)> {
        let competes = self.competes;
        self.candidates
            .iter()
            .enumerate()
            .filter(move |(_, candidate)| competes & (1 << candidate.flags) != 0)
    }
}

/// Whether `candidate` competes: the soft filters accept its flags (`accepted`, a bitmap
/// over flag values), or it holds the prompt's prefix while stickiness applies
/// ([`sticky_floor`]). A holder stays in whatever the soft filters say of it: the request
/// goes to one of them, queueing there if it must, rather than copy the context;
/// `relaxed` still says what the filters found.
fn accepts(candidate: &Candidate, accepted: u16, sticky_floor: u32) -> bool {
    accepted & (1 << candidate.flags) != 0 || (sticky_floor > 0 && candidate.cached >= sticky_floor)
}

/// Which candidates a pass over the fleet reads in full ([`Candidate::read`]) and
/// keeps; it counts the others by flag combination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Record {
    /// Those caching at least this many prompt tokens (0: every candidate).
    Caching(u32),
    /// Those that pass every soft filter, scored as they are read (but for the in-flight
    /// term): when some pod does, the soft filters keep exactly those.
    Passing,
}

/// What one pass over the fleet found of the pods that passed the hard filters.
struct Pass {
    /// The candidates the pass's [`Record`] keeps, read in full, in snapshot order.
    recorded: Vec<Candidate>,
    /// [`Scorer::partial`] of each recorded candidate, in [`Record::Passing`].
    partials: Vec<Partial>,
    /// The candidates not recorded by flag combination: how many, and the most requests
    /// in flight on one of them.
    others: [(usize, u32); COMBINATIONS],
    /// The same of the recorded candidates.
    recorded_by_flags: [(usize, u32); COMBINATIONS],
    could_fit: bool,
    /// The most prompt tokens that draw the request to one candidate
    /// ([`Demand::drawing`]).
    best_drawing: u32,
    /// The least [`Candidate::load`] of all candidates.
    least_load: u32,
}

/// Runs the hard filters (the error names the first one that emptied the set), then the
/// soft filters.
///
/// When the prompt's context is held by some pod, stickiness will most likely leave only
/// the pods caching half of the best holder's share, so the first pass keeps records of
/// those alone and only counts the others (which compete, if at all, as their flags say).
/// On a fleet where every pod holds the system prompt that skips the record, the trust,
/// the queued prefill and the later passes of thousands of pods. Should stickiness end
/// lower (the best holder is unhealthy or cannot serve the model) or not apply (the
/// holders carry too much more load), the fleet is read again in full: the result is the
/// same either way.
///
/// Where no pod holds half the prompt, stickiness cannot apply: the first pass then keeps
/// only the pods that pass every soft filter, scoring each while it is at hand. Until one
/// passes it also records each pod in full: should none pass them all (at overload), the
/// pass has recorded every pod, and the soft filters relax as they must.
pub(super) fn filter(
    request: &RouteRequest<'_>,
    fleet: &Fleet,
    demand: &Demand<'_>,
    config: &SchedulerConfig,
    scorer: &Scorer<'_>,
) -> Result<Filtered, PickError> {
    let likely_floor = likely_sticky_floor(demand);
    let first = if likely_floor == 0 {
        Record::Passing
    } else {
        Record::Caching(likely_floor)
    };
    filter_reading(request, fleet, demand, config, scorer, first)
}

/// What [`filter_unless`] found.
#[derive(Debug)]
pub(super) enum Screened {
    /// The candidates, as [`filter`] keeps them.
    Kept(Filtered),
    /// What the caller declined, before the pods were read in full, with the largest KV
    /// pool among the pods that may serve the request (`u64::MAX` where one does not
    /// report its size).
    Declined {
        relaxed: Relaxed,
        could_fit: bool,
        largest_pool: u64,
    },
}

/// [`filter`], unless `declines` declines what the soft filters found (`relaxed`, and
/// whether some pod could fit the request). Where stickiness cannot apply and no pod
/// passes every soft filter (every pick at overload), that is known from the pods'
/// flags alone, and a declined pick reads nothing more; otherwise the fleet is read as
/// [`filter`] reads it and the caller judges its outcome.
pub(super) fn filter_unless(
    request: &RouteRequest<'_>,
    fleet: &Fleet,
    demand: &Demand<'_>,
    config: &SchedulerConfig,
    scorer: &Scorer<'_>,
    declines: &dyn Fn(Relaxed, bool) -> bool,
) -> Result<Screened, PickError> {
    if likely_sticky_floor(demand) > 0 {
        return filter(request, fleet, demand, config, scorer).map(Screened::Kept);
    }
    let flags = if demand.prefix.is_some_and(PrefixMatches::any) {
        flags_unless_passing::<true>(request, fleet, demand, config)?
    } else {
        flags_unless_passing::<false>(request, fleet, demand, config)?
    };
    let Some((present, could_fit, largest_pool)) = flags else {
        return filter_reading(request, fleet, demand, config, scorer, Record::Passing)
            .map(Screened::Kept);
    };
    // No pod passes: the soft filters relax as they will once every pod is read (without
    // a holder of half the prompt, stickiness cannot apply).
    let (_, relaxed) = soft_filters(&present);
    if declines(relaxed, could_fit) {
        return Ok(Screened::Declined {
            relaxed,
            could_fit,
            largest_pool,
        });
    }
    filter_reading(request, fleet, demand, config, scorer, Record::Caching(0)).map(Screened::Kept)
}

/// The soft-filter flag combinations present among the pods that pass the hard filters,
/// whether one could fit the request ([`read_pods`]' `could_fit`) and the largest pool
/// among them (`u64::MAX` where one does not report its size), unless some pod passes
/// every soft filter (`None`).
#[inline(never)]
fn flags_unless_passing<const MATCHES: bool>(
    request: &RouteRequest<'_>,
    fleet: &Fleet,
    demand: &Demand<'_>,
    config: &SchedulerConfig,
) -> Result<Option<([bool; COMBINATIONS], bool, u64)>, PickError> {
    let mut hard = HardFilters::new(request, fleet, config)?;
    let pods = fleet.snapshot().pods().len();
    let reading = Reading::new(demand, config);
    let (block_tokens, blocks) = blocks_by_pod(demand, pods);
    let (mut present, mut admitted, mut tally) = ([false; COMBINATIONS], 0, Tally::EMPTY);
    let mut largest_pool = 0;
    for ((index, (row, load)), &blocks) in fleet.rows().enumerate().zip(blocks.iter()) {
        if !hard.admit(index, row) {
            continue;
        }
        let cached = demand.cached_if::<MATCHES>(blocks, block_tokens);
        let (flags, _) = reading.flags(row, load, cached);
        if flags & PASSES == PASSES {
            return Ok(None);
        }
        present[usize::from(flags)] = true;
        admitted += 1;
        // The least load and the best cached share matter only to stickiness.
        tally.note(row, demand, cached, demand.drawing(index, cached), 0);
        largest_pool = largest_pool.max(if row.capacity == 0 {
            u64::MAX
        } else {
            row.capacity
        });
    }
    hard.verdict(admitted)?;
    Ok(Some((present, tally.could_fit, largest_pool)))
}

/// [`filter`], whose first pass records as `first` says.
fn filter_reading(
    request: &RouteRequest<'_>,
    fleet: &Fleet,
    demand: &Demand<'_>,
    config: &SchedulerConfig,
    scorer: &Scorer<'_>,
    first: Record,
) -> Result<Filtered, PickError> {
    let read = |record| match record {
        Record::Caching(floor) => read_pods(request, fleet, demand, config, floor),
        // A request without matches caches nothing anywhere: that loop needs no matches.
        Record::Passing if demand.prefix.is_some_and(PrefixMatches::any) => {
            read_passing::<true>(request, fleet, demand, config, scorer, Pruning::Bounded)
        }
        Record::Passing => {
            read_passing::<false>(request, fleet, demand, config, scorer, Pruning::Bounded)
        }
    };
    let mut pass = read(first)?;
    let mut sticky_floor = sticky_floor(&pass, demand);
    let likely_floor = match first {
        Record::Caching(floor) => floor,
        Record::Passing => 0,
    };
    // (A pass of passing pods in which none passed read every pod in full.)
    if sticky_floor < likely_floor {
        pass = read(Record::Caching(0))?;
        sticky_floor = self::sticky_floor(&pass, demand);
    }
    let present =
        std::array::from_fn(|flags| pass.others[flags].0 + pass.recorded_by_flags[flags].0 > 0);
    let (accepted, mut relaxed) = soft_filters(&present);
    let Pass {
        recorded: mut candidates,
        partials,
        others,
        recorded_by_flags,
        could_fit,
        ..
    } = pass;
    // The pods not recorded cache less than the floor: their flags alone decide.
    let (mut accepted_count, mut max_inflight) = (0, 0);
    let mut count_accepted = |by_flags: &[(usize, u32); COMBINATIONS]| {
        for (flags, &(count, most_inflight)) in by_flags.iter().enumerate() {
            if accepted & (1 << flags) != 0 {
                accepted_count += count;
                max_inflight = max_inflight.max(most_inflight);
            }
        }
    };
    count_accepted(&others);
    if sticky_floor == 0 {
        // Every candidate was recorded, and its flags alone decide too.
        count_accepted(&recorded_by_flags);
        return Ok(Filtered {
            candidates,
            competes: accepted,
            partials,
            accepted: accepted_count,
            max_inflight,
            relaxed,
            could_fit,
        });
    }
    // Once, so that the passes that score and rank read only the pods that compete.
    candidates.retain(|candidate| {
        if !accepts(candidate, accepted, sticky_floor) {
            return false;
        }
        accepted_count += 1;
        max_inflight = max_inflight.max(candidate.inflight);
        candidate.cached >= sticky_floor
    });
    // Stickiness keeps the context's pods whatever the filters said. When every one of them
    // has a queue at the saturation depth and none the KV to start even the request's
    // uncached prompt, the pick lacks room as if every pod did: flow control holds the
    // request at the gateway until a holder has room (or sheds it), where it would have
    // joined the holder's queue and, admitted, grown until the pod preempted. A holder with
    // no queue, or with room for the prompt, still takes it at once: holding waits for the
    // next scrape, which cost p90 TTFT below the knee when any holder short of KV held. A
    // holder short of KV whose queue is short only by its report does not: when prompts
    // kvroute sent it still wait for their prefill, the report is behind them, and the
    // request would queue behind them too.
    if sticky_floor > 0
        && !candidates.iter().any(|c| {
            c.flags & FITS != 0
                || (c.flags & NOT_SATURATED != 0 && c.prefill == 0)
                || c.free_kv()
                    .is_none_or(|free| free >= demand.uncached_prompt(c.cached))
        })
    {
        relaxed.kv_headroom = true;
    }
    Ok(Filtered {
        candidates,
        competes: ALL_COMPETE,
        partials: Vec::new(),
        accepted: accepted_count,
        max_inflight,
        relaxed,
        could_fit,
    })
}

/// The prefix matches of a request without any, for fleets up to this size (larger
/// ones allocate theirs): most requests, spared an allocation per pick.
static NO_BLOCKS: [u32; 4096] = [0; 4096];

/// The hard filters of one pass, counting the pods each excludes (so that a pod that
/// passes costs no counter), and the error that names the first to empty the set.
struct HardFilters<'a> {
    request: &'a RouteRequest<'a>,
    pods: &'a [PodView],
    serves: Option<ServesModel<'a>>,
    outside_subset: usize,
    not_serving: usize,
    unlisted: usize,
}

impl<'a> HardFilters<'a> {
    fn new(
        request: &'a RouteRequest<'a>,
        fleet: &'a Fleet,
        config: &'a SchedulerConfig,
    ) -> Result<Self, PickError> {
        if fleet.snapshot().pods().is_empty() {
            return Err(PickError::NoEndpoints);
        }
        Ok(HardFilters {
            request,
            pods: fleet.snapshot().pods(),
            serves: request
                .model()
                .map(|model| ServesModel::new(model, fleet.snapshot(), config)),
            outside_subset: 0,
            not_serving: 0,
            unlisted: 0,
        })
    }

    /// Whether the pod at `index`, whose row is `row`, may take the request: inside the
    /// subset, serving the model, healthy.
    #[inline(always)]
    fn admit(&mut self, index: usize, row: &PodRow) -> bool {
        if self
            .request
            .subset
            .is_some_and(|subset| !subset.contains(self.pods[index].endpoint))
        {
            self.outside_subset += 1;
            return false;
        }
        let serves = match self.serves.as_mut() {
            Some(serves) => serves.check(row, index),
            None => Serves::Yes,
        };
        match serves {
            Serves::Yes => row.healthy,
            Serves::No => {
                self.not_serving += 1;
                false
            }
            Serves::Unlisted => {
                self.unlisted += 1;
                false
            }
        }
    }

    /// The error of a pass that admitted `healthy` pods, if it admitted none.
    fn verdict(&self, healthy: usize) -> Result<(), PickError> {
        let in_subset = self.pods.len() - self.outside_subset;
        if in_subset == 0 {
            return Err(PickError::NoneInSubset);
        }
        if in_subset == self.not_serving + self.unlisted {
            let model = self.request.model().unwrap_or_default().to_owned();
            return Err(match self.unlisted {
                0 => PickError::UnknownModel(model),
                unlisted => PickError::ModelsNotListed { model, unlisted },
            });
        }
        if healthy == 0 {
            return Err(PickError::NoReadyEndpoint);
        }
        Ok(())
    }
}

/// The tokens of a prompt block, and the prefix matches walked beside the rows of `pods`
/// pods, without an index check per pod: one entry a pod (zeros where nothing matches).
fn blocks_by_pod<'a>(demand: &Demand<'a>, pods: usize) -> (u64, Cow<'a, [u32]>) {
    let block_tokens = demand
        .prefix
        .map_or(0, |prefix| u64::from(prefix.block_tokens));
    let blocks = demand.prefix.map_or(&[][..], PrefixMatches::blocks_by_pod);
    let blocks = if blocks.len() == pods {
        Cow::Borrowed(blocks)
    } else if blocks.is_empty() && pods <= NO_BLOCKS.len() {
        Cow::Borrowed(&NO_BLOCKS[..pods])
    } else {
        let mut padded = vec![0; pods];
        let known = blocks.len().min(pods);
        padded[..known].copy_from_slice(&blocks[..known]);
        Cow::Owned(padded)
    };
    (block_tokens, blocks)
}

/// What a pass keeps of every pod it reads, for the soft filters and stickiness.
#[derive(Clone, Copy)]
struct Tally {
    could_fit: bool,
    /// The most prompt tokens that draw the request to one pod ([`Demand::drawing`]).
    best_drawing: u32,
    least_load: u32,
}

impl Tally {
    const EMPTY: Tally = Tally {
        could_fit: false,
        best_drawing: 0,
        least_load: u32::MAX,
    };

    /// Notes the pod in `row`, caching `cached` of the prompt (`drawing` of them drawing
    /// the request there, [`Demand::drawing`]), with `load` requests on it.
    #[inline(always)]
    fn note(&mut self, row: &PodRow, demand: &Demand<'_>, cached: u32, drawing: u32, load: u32) {
        // A pod that does not report its pool's size might hold anything.
        self.could_fit =
            self.could_fit || row.capacity == 0 || row.capacity >= demand.needed(cached);
        self.best_drawing = self.best_drawing.max(drawing);
        self.least_load = self.least_load.min(load);
    }
}

/// Counts a pod with `flags` and `inflight` requests in its flag combination's entry.
#[inline(always)]
fn count(by_flags: &mut [(usize, u32); COMBINATIONS], flags: u8, inflight: u32) {
    let (count, most_inflight) = &mut by_flags[usize::from(flags)];
    *count += 1;
    *most_inflight = (*most_inflight).max(inflight);
}

/// One pass over the fleet: the hard filters, then each remaining pod read into its
/// [`Candidate`], recorded when it caches at least `record_floor` prompt tokens and
/// counted in [`Pass::others`] otherwise.
#[inline(never)]
fn read_pods(
    request: &RouteRequest<'_>,
    fleet: &Fleet,
    demand: &Demand<'_>,
    config: &SchedulerConfig,
    record_floor: u32,
) -> Result<Pass, PickError> {
    let mut hard = HardFilters::new(request, fleet, config)?;
    let pods = fleet.snapshot().pods().len();
    let mut recorded = if record_floor == 0 {
        Vec::with_capacity(pods)
    } else {
        Vec::new()
    };
    let mut others = [(0usize, 0u32); COMBINATIONS];
    let mut recorded_by_flags = [(0usize, 0u32); COMBINATIONS];
    let mut tally = Tally::EMPTY;
    let reading = Reading::new(demand, config);
    let (block_tokens, blocks) = blocks_by_pod(demand, pods);
    for ((index, (row, load)), &blocks) in fleet.rows().enumerate().zip(blocks.iter()) {
        if !hard.admit(index, row) {
            continue;
        }
        let cached = demand.cached(blocks, block_tokens);
        let drawing = demand.drawing(index, cached);
        if drawing >= record_floor {
            let candidate = Candidate::read(index, row, load, cached, &reading);
            tally.note(row, demand, cached, drawing, candidate.load());
            count(&mut recorded_by_flags, candidate.flags, candidate.inflight);
            recorded.push(candidate);
        } else {
            // Only what the counts need: fewer values live across the loop.
            let (flags, _) = reading.flags(row, load, cached);
            let inflight = load.inflight();
            tally.note(
                row,
                demand,
                cached,
                drawing,
                self::load(inflight, reported_waiting(row)),
            );
            count(&mut others, flags, inflight);
        }
    }
    hard.verdict(recorded.len() + others.iter().map(|(count, _)| count).sum::<usize>())?;
    Ok(Pass {
        recorded,
        partials: Vec::new(),
        others,
        recorded_by_flags,
        could_fit: tally.could_fit,
        best_drawing: tally.best_drawing,
        least_load: tally.least_load,
    })
}

/// [`read_pods`] recording only the candidates that pass every soft filter
/// ([`Record::Passing`]), each scored by `scorer` as it is read. For requests no pod
/// holds half the prompt of. Until some pod passes, each pod is also read in full, as
/// [`read_pods`] with no floor reads it: a pass in which none passes (every pick at
/// overload) is then that pass, and the fleet is not read again; the pods read before
/// the first that passes are forgotten.
///
/// As `pruning` says, a passing pod whose total cannot reach the ranking's kept few is
/// counted but not recorded ([`Prune`]); the ranking comes out the same.
#[inline(never)]
fn read_passing<const MATCHES: bool>(
    request: &RouteRequest<'_>,
    fleet: &Fleet,
    demand: &Demand<'_>,
    config: &SchedulerConfig,
    scorer: &Scorer<'_>,
    pruning: Pruning,
) -> Result<Pass, PickError> {
    let mut hard = HardFilters::new(request, fleet, config)?;
    let reading = Reading::new(demand, config);
    if let Some(none_passes) = read_until_passing::<MATCHES>(&mut hard, fleet, demand, &reading)? {
        return Ok(none_passes);
    }
    let pods = fleet.snapshot().pods().len();
    let (mut recorded, mut partials) = (Vec::with_capacity(pods), Vec::with_capacity(pods));
    let mut recorded_by_flags = [(0usize, 0u32); COMBINATIONS];
    let (block_tokens, blocks) = blocks_by_pod(demand, pods);
    let most_anywhere = match pruning {
        Pruning::Off => None,
        _ if pods < PRUNE_FROM_PODS => None,
        Pruning::Bounded => Some(most_inflight_anywhere(fleet)),
        #[cfg(test)]
        Pruning::AssumingAtMost(most) => Some(most),
    };
    let mut pruning = most_anywhere.map(|most| Prune::new(most, kept(config)));
    // Some pod passes, so nothing is kept of a pod that fails a soft filter: the filters
    // keep exactly the pods that pass, and the pods that fail one count nowhere (neither
    // among the accepted nor in the in-flight scale). Neither is whether some pod could
    // fit the request (a pod that passes fits it), nor the least load (without a holder
    // of half the prompt stickiness, which compares loads, cannot apply). The pods read
    // before the first that passes are read again, at the cost of a filter each: this
    // loop over every pod ran faster than one over the rest (tried).
    for ((index, (row, load)), &blocks) in fleet.rows().enumerate().zip(blocks.iter()) {
        if !hard.admit(index, row) {
            continue;
        }
        let cached = demand.cached_if::<MATCHES>(blocks, block_tokens);
        let Some((flags, free_kv)) = reading.passing_flags(row, load, cached) else {
            continue;
        };
        let candidate = Candidate::with_flags(index, row, load, cached, &reading, flags, free_kv);
        count(&mut recorded_by_flags, flags, candidate.inflight);
        // For an adapter request the LoRA term alone often rules a pod out (one not
        // running the adapter is at least 0.3 below one that does at the default
        // weights, 1.2 with a free slot): first at its best without the pod's
        // remembered adapters, then as it is.
        if let Some(pruning) = pruning.as_mut()
            && scorer.for_adapter()
            && pruning.drops_unscored(scorer, &candidate, scorer.lora_term_ceiling(&candidate))
        {
            continue;
        }
        let lora = scorer.lora_term(&candidate);
        if let Some(pruning) = pruning.as_mut()
            && scorer.for_adapter()
            && pruning.drops_unscored(scorer, &candidate, lora)
        {
            continue;
        }
        let partial = scorer.partial_with_lora(&candidate, row, lora);
        if let Some(pruning) = pruning.as_mut()
            && pruning.drops(scorer, &partial, candidate.inflight)
        {
            continue;
        }
        partials.push(partial);
        recorded.push(candidate);
    }
    if pruning.is_some_and(|pruning| !pruning.bound_held()) {
        // A request arrived at some pod between the two reads of the counters: the bound
        // did not hold, so nothing is dropped.
        return read_passing::<MATCHES>(request, fleet, demand, config, scorer, Pruning::Off);
    }
    Ok(Pass {
        could_fit: true,
        recorded,
        partials,
        others: [(0, 0); COMBINATIONS],
        recorded_by_flags,
        best_drawing: 0,
        least_load: 0,
    })
}

/// The start of [`read_passing`]: each pod read in full, as [`read_pods`] with no floor
/// reads it, until one passes every soft filter (`None`); if none does, that pass. A
/// function apart from the loop that follows, which it would slow down (that loop is the
/// pick's hottest, over most of the fleet when any pod passes). Its twin for a pick that
/// may be declined, [`flags_unless_passing`], reads only the flags: one loop serving both
/// (the pass's candidates only counted when not recorded) made a declined pick 7–8 %
/// slower (tried).
#[inline(never)]
fn read_until_passing<const MATCHES: bool>(
    hard: &mut HardFilters<'_>,
    fleet: &Fleet,
    demand: &Demand<'_>,
    reading: &Reading<'_>,
) -> Result<Option<Pass>, PickError> {
    let pods = fleet.snapshot().pods().len();
    let (block_tokens, blocks) = blocks_by_pod(demand, pods);
    let (mut recorded, mut recorded_by_flags) = (Vec::new(), [(0usize, 0u32); COMBINATIONS]);
    let mut tally = Tally::EMPTY;
    for ((index, (row, load)), &blocks) in fleet.rows().enumerate().zip(blocks.iter()) {
        if !hard.admit(index, row) {
            continue;
        }
        let cached = demand.cached_if::<MATCHES>(blocks, block_tokens);
        let (flags, free_kv) = reading.flags(row, load, cached);
        if flags & PASSES == PASSES {
            return Ok(None);
        }
        let candidate = Candidate::with_flags(index, row, load, cached, reading, flags, free_kv);
        tally.note(row, demand, cached, candidate.cached, candidate.load());
        count(&mut recorded_by_flags, flags, candidate.inflight);
        if recorded.is_empty() {
            recorded.reserve(pods);
        }
        recorded.push(candidate);
    }
    hard.verdict(recorded.len())?;
    Ok(Some(Pass {
        recorded,
        partials: Vec::new(),
        others: [(0, 0); COMBINATIONS],
        recorded_by_flags,
        could_fit: tally.could_fit,
        best_drawing: tally.best_drawing,
        least_load: tally.least_load,
    }))
}

/// The sticky floor ([`sticky_floor`]) if the pod caching the most of the prompt is a
/// candidate and stickiness applies: half of what that pod caches. The true floor is
/// never higher.
fn likely_sticky_floor(demand: &Demand<'_>) -> u32 {
    let Some(prefix) = demand.prefix else {
        return 0;
    };
    let most = prefix.most_drawing_tokens().min(demand.prompt);
    holders_floor(u32::try_from(most).unwrap_or(u32::MAX), demand.prompt)
}

/// The cached prompt tokens a candidate needs to stay among the holders when the best
/// holder caches `best` of a `prompt`-token prompt: half of `best` once it caches at least
/// half the prompt, else 0 (no stickiness).
fn holders_floor(best: u32, prompt: u64) -> u32 {
    if prompt == 0 || u64::from(best) * 2 < prompt {
        0
    } else {
        best / 2
    }
}

/// Prefix stickiness: when a candidate caches at least half of the prompt, only
/// candidates caching at least half as much compete (counting only what draws the
/// request, [`Demand::drawing`]: where the context has a home, its home alone), unless
/// even the least loaded of them carries [`STICKY_SLACK`] ([`HOME_SLACK`] for a home)
/// more requests ([`Candidate::load`]) than the least loaded candidate of all.
/// Copying a long context to another pod costs KV the whole fleet shares, so the context
/// moves only for a real imbalance, as with the cache-aware peers. Returns the cached
/// tokens a candidate needs to compete (0: everyone). Valid when the pass recorded every
/// candidate caching that much (the caller reads the fleet again when it did not).
fn sticky_floor(pass: &Pass, demand: &Demand<'_>) -> u32 {
    let floor = holders_floor(pass.best_drawing, demand.prompt);
    if floor == 0 {
        return 0;
    }
    let holders_least = pass
        .recorded
        .iter()
        .filter(|c| c.cached >= floor)
        .map(Candidate::load)
        .min()
        .unwrap_or(u32::MAX);
    let slack = if demand.homed() {
        HOME_SLACK
    } else {
        STICKY_SLACK
    };
    if holders_least > pass.least_load.saturating_add(slack) {
        0
    } else {
        floor
    }
}

/// Requests by which a prefix holder's load may exceed the least loaded candidate's while
/// it keeps the prefix's requests. Chosen with `kvroute-lab simulate` on
/// `shared-prefix-pressure` over 8 trace seeds (docs/benchmarks.md): 16 gave the lowest
/// p90 TTFT below the knee, 64 a lower one at and past it, 4 lost most of the gain; with
/// no limit, one pod could take every request of a hot prefix.
const STICKY_SLACK: u32 = 16;

/// [`STICKY_SLACK`] where the context has a home ([`PrefixMatches::homed`]): the pod
/// kvroute last sent it to, which the engine's KV events show still holds it. The
/// approximate memory cannot see an eviction, so a larger slack would hold requests on a
/// pod that may have to compute the context again (32 and 64 lost below the knee on
/// `shared-prefix-pressure`: 1.4-1.8× the p90 at 28 req/s); a home the events confirm
/// holds it. Chosen with `kvroute-lab simulate` on `shared-prefix-pressure` under
/// `kvroute-events` over 32 seeds and two scrape timings (docs/kv-events.md): 32 took
/// the knee's p90 to 0.62-0.73× that of 16 and past it 0.84-1.02×, with the p90 below
/// the knee within 6 % (medians equal); 64 did about as well, and a larger slack lets one
/// pod keep more of a hot context's requests.
const HOME_SLACK: u32 = 32;

/// Applies the soft filters in order to the flag combinations present (`present[f]`:
/// some candidate has flags `f`). Returns the set of accepted combinations as a bitmap
/// over flag values, and which filters had to be relaxed because nothing passed them.
fn soft_filters(present: &[bool; COMBINATIONS]) -> (u16, Relaxed) {
    let mut accepted: u16 = (1 << COMBINATIONS) - 1;
    let mut relaxed = [false; 2];
    for (position, bit) in [NOT_SATURATED, FITS].into_iter().enumerate() {
        let passing: u16 = (0..COMBINATIONS as u16)
            .filter(|flags| (*flags as u8) & bit != 0)
            .fold(0, |set, flags| set | 1 << flags);
        let narrowed = accepted & passing;
        if (0..COMBINATIONS).any(|flags| narrowed & (1 << flags) != 0 && present[flags]) {
            accepted = narrowed;
        } else {
            relaxed[position] = true;
        }
    }
    let relaxed = Relaxed {
        saturation: relaxed[0],
        kv_headroom: relaxed[1],
    };
    (accepted, relaxed)
}

/// A long queue (`queue_full`: the report's, or the requests kvroute sent since that the
/// pod's KV will not hold, at the saturation depth: [`queue_reaches`]), or KV use at the
/// threshold. KV use does not make a pod saturated for a request whose prompt it mostly
/// caches (`cached`, at least half of `prompt`): on a shared-prefix load pods run near
/// full *because* their requests share cached contexts, and sending a request away from
/// its context allocates the context again elsewhere and evicts others' (the filter that
/// checks free KV still applies to what it needs anew).
///
/// KV use is the pod's report plus the KV that the requests kvroute sent it since will
/// need (their uncached prompt and expected output: the report cannot show them), as free
/// KV counts it. The report alone is up to two scrape periods old: when nearly every pod's
/// queue was full, the few pods it showed below the threshold took every request that had
/// nowhere better to go until the next scrape (tens each on a simulated fleet of hundreds,
/// as the number grows with the fleet's rate), then kept those requests' contexts, so
/// their tenants came back to them.
fn is_saturated(
    row: &PodRow,
    queue_full: bool,
    unscraped: u64,
    cached: u64,
    prompt: u64,
    config: &SchedulerConfig,
) -> bool {
    let shares_its_context = cached > 0 && cached * 2 >= prompt;
    queue_full
        || (!shares_its_context
            && kv_usage_reaches(row, unscraped, config.replicas, config.saturation.kv_usage))
}

/// `tokens` as a float, through a signed conversion (one instruction on x86-64, where an
/// unsigned one takes several); token counts never approach 2⁶³.
pub(super) fn as_f64(tokens: u64) -> f64 {
    tokens.min(i64::MAX as u64) as i64 as f64
}

/// Whether the pod's reported KV use plus the share of its capacity that the requests
/// kvroute sent it since that report will need (`replicas` times: each replica sees its
/// own) reaches `threshold`. Compared as `unscraped × replicas ≥ (threshold − reported) ×
/// capacity`, without the division by capacity: the pick over thousands of pods is bound
/// by the divider as much as by anything.
fn kv_usage_reaches(row: &PodRow, unscraped: u64, replicas: u32, threshold: f64) -> bool {
    let reported = f64::from(row.kv_usage);
    if reported >= threshold {
        return true;
    }
    match (row.capacity, unscraped) {
        (0, _) | (_, 0) => false,
        (capacity, unscraped) => {
            as_f64(unscraped) * f64::from(replicas) >= (threshold - reported) * as_f64(capacity)
        }
    }
}

mod prune;
#[cfg(test)]
mod tests;
