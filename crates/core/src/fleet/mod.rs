//! The fleet as the scheduler sees it.
//!
//! Two kinds of data, kept apart on purpose:
//! - [`Snapshot`]: plain data, immutable once built. What each pod last reported
//!   ([`PodMetrics`] from `/metrics`, [`ServedModels`] from `/v1/models`), its health, and a
//!   [`ModelIndex`] that classifies every model name the fleet knows, built once per
//!   snapshot rather than once per request.
//! - [`PodLoad`]: kvroute's own live counters per pod (requests in flight, tokens sent
//!   since the last scrape, prefill queued, adapters sent), updated by every routed request
//!   between two snapshots.
//!
//! [`Fleet`] pairs a snapshot with the live counters of its pods: that pair is what a pick
//! reads. Prefix memory ([`PrefixIndex`]) and health hysteresis ([`HealthTracker`]) are the
//! other bookkeeping the gateway keeps per pod.

mod adapters;
mod health;
mod load;
mod models;
mod prefix;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use adapters::{AdapterIndex, LoraSlots, PositionSet};
pub use health::{HealthPolicy, HealthTracker};
pub use load::{
    AdapterProbe, PodLoad, PrefillEnd, RECENT_ADAPTERS, Reservation, ScrapeTicket, adapter_key,
};
pub use models::{ModelClass, ModelIndex};
pub(crate) use prefix::IdentityHasher;
pub use prefix::{
    BLOCK_BYTES, BLOCK_TOKENS, DEFAULT_BUDGET_BYTES as DEFAULT_PREFIX_BUDGET_BYTES, PrefixIndex,
    PrefixMatches, block_hashes,
};

/// What one pod reported, aggregated over its engines and models.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodMetrics {
    /// Requests queued, summed over engines and models.
    pub waiting: u32,
    /// Requests in the running batch, summed over engines and models.
    pub running: u32,
    /// Fraction of KV-cache blocks in use, in `0..=1`. With several engines,
    /// their mean weighted by capacity (unweighted if a capacity is unknown).
    pub kv_usage: f64,
    /// KV-cache capacity in tokens, over all engines: the sum of the engines'
    /// `kv_cache_size_tokens` where vLLM states them, else the pod's
    /// `num_gpu_blocks × block_size`; `None` when neither is known.
    pub kv_capacity_tokens: Option<u64>,
    /// GPU KV-cache blocks of the whole pod (vLLM already sums its data-parallel
    /// engines' blocks and repeats the total on every engine's series).
    pub num_gpu_blocks: Option<u64>,
    /// Tokens per KV-cache block (the same on every engine).
    pub block_size: Option<u32>,
    /// Distinct `engine` label values seen; 1 when the pod does not label engines.
    pub engines: u32,
    /// The newest `vllm:lora_requests_info` series, if the pod serves LoRA adapters.
    pub lora: Option<LoraStatus>,
    pub preemptions_total: Option<f64>,
    /// Prompt tokens served from the prefix cache (a counter).
    pub prefix_cache_hits_total: Option<f64>,
    /// Prompt tokens looked up in the prefix cache (a counter).
    pub prefix_cache_queries_total: Option<f64>,
}

/// Adapter state from `vllm:lora_requests_info`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoraStatus {
    /// Adapter slots on the GPU; 0 when the pod does not say.
    pub max_lora: u32,
    /// Adapters with requests in the running batch.
    pub running: Vec<String>,
    /// Adapters with requests waiting.
    pub waiting: Vec<String>,
}

/// The models one pod can serve, from its `/v1/models`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServedModels {
    /// Base models (entries without a `parent`).
    pub base: Vec<String>,
    /// LoRA adapters by name, with their base model.
    pub adapters: HashMap<String, String>,
}

impl ServedModels {
    /// Whether `model` names one of this pod's base models or adapters.
    pub fn serves(&self, model: &str) -> bool {
        self.base.iter().any(|b| b == model) || self.adapters.contains_key(model)
    }

    /// Whether `model` is one of this pod's LoRA adapters.
    pub fn is_adapter(&self, model: &str) -> bool {
        self.adapters.contains_key(model)
    }
}

/// The few numbers the scheduler reads of a pod's scrape, copied out of it when the
/// pod's view is built: the snapshot's [`PodRow`]s are made from them, and the gateway
/// reads them for a pod it has in hand (its free KV, its capacity).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSignals {
    /// Requests waiting per engine (rounded up): a data-parallel pod runs one queue per
    /// engine, so its queue depth compares with a single engine's, not its total.
    pub waiting: u32,
    /// Requests waiting over all engines: KV the pod will allocate that `kv_usage` does
    /// not show yet ([`crate::scheduler::free_kv_tokens`]).
    pub queued: u32,
    /// KV-cache use, 0..=1.
    pub kv_usage: f32,
    /// KV capacity in tokens; 0 when the pod does not report it.
    pub kv_capacity_tokens: u64,
    /// KV tokens in use by the report: `kv_usage` of the capacity, to the nearest token.
    /// Computed once per scrape rather than for every pod in every pick.
    pub kv_used_tokens: u64,
}

impl LoadSignals {
    pub fn of(metrics: &PodMetrics) -> Self {
        let kv_usage = metrics.kv_usage.clamp(0.0, 1.0) as f32;
        let kv_capacity_tokens = metrics.kv_capacity_tokens.unwrap_or(0);
        LoadSignals {
            waiting: metrics.waiting.div_ceil(metrics.engines.max(1)),
            queued: metrics.waiting,
            kv_usage,
            kv_capacity_tokens,
            // `+ 0.5`, not `round()`: a library call on x86-64.
            kv_used_tokens: (kv_capacity_tokens as f64 * f64::from(kv_usage) + 0.5) as u64,
        }
    }
}

/// One pod as the scheduler sees it: plain data, as of the snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct PodView {
    pub endpoint: SocketAddr,
    /// Up or down, after hysteresis over scrape results.
    pub healthy: bool,
    /// The last successful scrape, if any; set with [`PodView::new`] or
    /// [`PodView::set_metrics`] so that `signals` follows.
    metrics: Option<Arc<PodMetrics>>,
    signals: Option<LoadSignals>,
    /// How old `metrics` was when this snapshot was built.
    pub metrics_age: Option<Duration>,
    /// What the pod's `/v1/models` said, if it answered yet.
    pub models: Option<Arc<ServedModels>>,
}

impl PodView {
    pub fn new(
        endpoint: SocketAddr,
        healthy: bool,
        metrics: Option<Arc<PodMetrics>>,
        metrics_age: Option<Duration>,
        models: Option<Arc<ServedModels>>,
    ) -> Self {
        PodView {
            endpoint,
            healthy,
            signals: metrics.as_deref().map(LoadSignals::of),
            metrics,
            metrics_age,
            models,
        }
    }

    /// The last successful scrape, if any.
    pub fn metrics(&self) -> Option<&PodMetrics> {
        self.metrics.as_deref()
    }

    /// The scheduler's numbers from the last scrape, if any.
    pub fn signals(&self) -> Option<&LoadSignals> {
        self.signals.as_ref()
    }

    pub fn set_metrics(&mut self, metrics: Option<Arc<PodMetrics>>) {
        self.signals = metrics.as_deref().map(LoadSignals::of);
        self.metrics = metrics;
    }

    /// Whether the pod runs or queues requests for `adapter`, by its LoRA metrics.
    pub fn runs_adapter(&self, adapter: &str) -> bool {
        self.metrics()
            .and_then(|m| m.lora.as_ref())
            .is_some_and(|lora| {
                lora.running
                    .iter()
                    .chain(lora.waiting.iter())
                    .any(|a| a == adapter)
            })
    }
}

/// An immutable view of the fleet: plain data, safe to share and compare.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Pods sorted by endpoint, so iteration order never depends on hashing.
    pods: Vec<PodView>,
    /// Incremented with every rebuild.
    pub generation: u64,
    /// Incremented whenever the endpoint set changes (not with every rebuild), so
    /// per-endpoint memories elsewhere know when to forget departed pods.
    pub endpoints_version: u64,
    /// Every model name the pods list or run, classified once for this snapshot.
    pub models: ModelIndex,
    /// The pods' LoRA adapter state in dense arrays, for adapter requests.
    pub adapters: AdapterIndex,
    /// What a pick reads of every pod, one row each, index-aligned with `pods`.
    rows: Vec<PodRow>,
    /// The distinct model lists of the pods, which [`PodRow::models`] names.
    model_lists: Vec<Arc<ServedModels>>,
}

/// What a pick reads of one pod, copied out of its [`PodView`] when the snapshot is
/// built. A pick over thousands of pods streams these 40-byte rows from one array
/// instead of each pod's ~100-byte view with its `Option`s (two cache lines a pod, and a
/// test per field).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PodRow {
    /// KV capacity in tokens; 0 when not reported or never scraped.
    pub(crate) capacity: u64,
    /// KV tokens in use by the last report ([`LoadSignals::kv_used_tokens`]).
    pub(crate) used: u64,
    /// [`PodView::metrics_age`] in nanoseconds; [`PodRow::NO_AGE`] when unknown.
    pub(crate) age_nanos: u64,
    pub(crate) kv_usage: f32,
    /// Requests waiting per engine ([`LoadSignals::waiting`]).
    pub(crate) waiting: u32,
    /// The pod's model list in [`Snapshot::model_list`]; [`PodRow::UNLISTED`] when its
    /// `/v1/models` has not answered.
    pub(crate) models: u32,
    pub(crate) healthy: bool,
    /// The pod has been scraped successfully: the fields above hold its report.
    pub(crate) has_metrics: bool,
    /// [`LoadSignals::queued`], at most `u16::MAX` (the two bytes the row had spare; the
    /// free-KV estimate reads no more of a queue).
    pub(crate) queued: u16,
}

impl PodRow {
    pub(crate) const NO_AGE: u64 = u64::MAX;
    pub(crate) const UNLISTED: u32 = u32::MAX;
}

/// The rows of `pods`, and their distinct model lists (the store interns equal lists,
/// so pods with the same models share one `Arc`; a fleet whose pods list different
/// adapters has as many lists as pods, hence the map).
fn rows_of(pods: &[PodView]) -> (Vec<PodRow>, Vec<Arc<ServedModels>>) {
    let mut lists: Vec<Arc<ServedModels>> = Vec::new();
    let mut ids: HashMap<*const ServedModels, u32> = HashMap::new();
    // The previous pod's list and id: most fleets have one list, found without hashing.
    let mut last: Option<(*const ServedModels, u32)> = None;
    let rows = pods
        .iter()
        .map(|pod| {
            let models = pod.models.as_ref().map_or(PodRow::UNLISTED, |models| {
                let key = Arc::as_ptr(models);
                let id = match last {
                    Some((previous, id)) if previous == key => id,
                    _ => *ids.entry(key).or_insert_with(|| {
                        lists.push(Arc::clone(models));
                        u32::try_from(lists.len() - 1).unwrap_or(PodRow::UNLISTED)
                    }),
                };
                last = Some((key, id));
                id
            });
            let signals = pod.signals();
            PodRow {
                capacity: signals.map_or(0, |s| s.kv_capacity_tokens),
                used: signals.map_or(0, |s| s.kv_used_tokens),
                // Ages past u64 nanoseconds (584 years) weigh nothing either way.
                age_nanos: pod.metrics_age.map_or(PodRow::NO_AGE, |age| {
                    u64::try_from(age.as_nanos())
                        .map_or(PodRow::NO_AGE - 1, |n| n.min(PodRow::NO_AGE - 1))
                }),
                kv_usage: signals.map_or(0.0, |s| s.kv_usage),
                waiting: signals.map_or(0, |s| s.waiting),
                models,
                healthy: pod.healthy,
                has_metrics: signals.is_some(),
                queued: signals.map_or(0, |s| u16::try_from(s.queued).unwrap_or(u16::MAX)),
            }
        })
        .collect();
    (rows, lists)
}

impl Snapshot {
    /// A snapshot of `pods` (sorted here by endpoint), with its model index.
    pub fn new(mut pods: Vec<PodView>, generation: u64, endpoints_version: u64) -> Self {
        pods.sort_by_key(|pod| pod.endpoint);
        Snapshot::from_sorted(pods, generation, endpoints_version, None)
    }

    /// [`Snapshot::new`] for pods already sorted by endpoint; what the model index read of
    /// the pods' model lists is reused from `previous` where they are the same lists.
    fn from_sorted(
        pods: Vec<PodView>,
        generation: u64,
        endpoints_version: u64,
        previous: Option<&Snapshot>,
    ) -> Self {
        let models = ModelIndex::build_after(&pods, previous.map(|p| &p.models));
        let adapters = AdapterIndex::build(&pods);
        let (rows, model_lists) = rows_of(&pods);
        Snapshot {
            pods,
            generation,
            endpoints_version,
            models,
            adapters,
            rows,
            model_lists,
        }
    }

    /// The model list a [`PodRow::models`] names.
    pub(crate) fn model_list(&self, id: u32) -> Option<&ServedModels> {
        self.model_lists.get(id as usize).map(|list| &**list)
    }

    /// The pods, sorted by endpoint.
    pub fn pods(&self) -> &[PodView] {
        &self.pods
    }

    /// Whether any pod has been scraped successfully: the readiness condition.
    pub fn has_metrics(&self) -> bool {
        self.pods
            .iter()
            .any(|pod| pod.healthy && pod.metrics.is_some())
    }

    /// The position of the pod at `endpoint` in [`Snapshot::pods`], if known.
    pub fn position(&self, endpoint: SocketAddr) -> Option<usize> {
        self.pods
            .binary_search_by(|pod| pod.endpoint.cmp(&endpoint))
            .ok()
    }

    /// The pod at `endpoint`, if known.
    pub fn pod(&self, endpoint: SocketAddr) -> Option<&PodView> {
        self.position(endpoint).map(|index| &self.pods[index])
    }
}

/// A snapshot and the live counters of its pods, index-aligned: what a pick reads.
/// The counters change between snapshots (every routed request updates them); the
/// snapshot does not.
#[derive(Debug, Clone, Default)]
pub struct Fleet {
    snapshot: Snapshot,
    loads: Vec<Arc<PodLoad>>,
}

impl Fleet {
    /// Pairs each pod with its counters; sorted by endpoint like [`Snapshot::new`].
    pub fn new(
        pods: Vec<(PodView, Arc<PodLoad>)>,
        generation: u64,
        endpoints_version: u64,
    ) -> Self {
        Fleet::build(pods, generation, endpoints_version, None)
    }

    /// [`Fleet::new`] for the fleet published after `previous`: the same fleet, built
    /// faster where the pods' model lists have not changed since.
    pub fn new_after(
        previous: &Fleet,
        pods: Vec<(PodView, Arc<PodLoad>)>,
        generation: u64,
        endpoints_version: u64,
    ) -> Self {
        Fleet::build(
            pods,
            generation,
            endpoints_version,
            Some(&previous.snapshot),
        )
    }

    fn build(
        mut pods: Vec<(PodView, Arc<PodLoad>)>,
        generation: u64,
        endpoints_version: u64,
        previous: Option<&Snapshot>,
    ) -> Self {
        pods.sort_by_key(|(pod, _)| pod.endpoint);
        let (views, loads): (Vec<PodView>, Vec<Arc<PodLoad>>) = pods.into_iter().unzip();
        Fleet {
            snapshot: Snapshot::from_sorted(views, generation, endpoints_version, previous),
            loads,
        }
    }

    /// A fleet whose pods have fresh, empty counters (benchmarks, offline simulation).
    pub fn unloaded(pods: Vec<PodView>) -> Self {
        let pods = pods
            .into_iter()
            .map(|pod| (pod, Arc::new(PodLoad::default())))
            .collect();
        Fleet::new(pods, 0, 0)
    }

    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// The live counters of the pod at `index` in [`Snapshot::pods`].
    pub fn load(&self, index: usize) -> &Arc<PodLoad> {
        &self.loads[index]
    }

    /// Each pod's row with its live counters, sorted by endpoint.
    pub(crate) fn rows(&self) -> impl ExactSizeIterator<Item = (&PodRow, &Arc<PodLoad>)> {
        self.snapshot.rows.iter().zip(&self.loads)
    }

    /// The row of the pod at `index` in [`Snapshot::pods`].
    pub(crate) fn row(&self, index: usize) -> &PodRow {
        &self.snapshot.rows[index]
    }

    /// Each pod with its live counters, sorted by endpoint.
    pub fn pods(&self) -> impl ExactSizeIterator<Item = (&PodView, &Arc<PodLoad>)> {
        self.snapshot.pods.iter().zip(&self.loads)
    }

    /// The pod at `endpoint` with its live counters, if known.
    pub fn pod(&self, endpoint: SocketAddr) -> Option<(&PodView, &Arc<PodLoad>)> {
        let index = self.snapshot.position(endpoint)?;
        Some((&self.snapshot.pods[index], &self.loads[index]))
    }
}
