//! Turns a vLLM `/metrics` page into the few numbers the router needs.
//!
//! Labels are read by name, never by position: vLLM's label sets differ
//! between versions (older `cache_config_info` carries a dozen more labels)
//! and between deployments (`engine` appears on data-parallel pods). Series
//! are summed or combined across `engine` and `model_name` values.
//!
//! Data-parallel pods (`--data-parallel-size N`, one `engine` label value per rank), as
//! vLLM's own code means the numbers (docs/vllm-metrics.md has the version table):
//! - queue and running: per engine; the pod's are their sums;
//! - KV use: per engine; the pod's is their mean, weighted by per-engine capacity where
//!   vLLM states it;
//! - `cache_config_info`: one series per engine, all carrying the frontend's one
//!   `CacheConfig`, whose `num_gpu_blocks` is already the **pod's** total (summed over
//!   engines at start-up): taken once, never summed again. Newer vLLM adds
//!   `kv_cache_size_tokens`, **per engine**: summed.
//!
//! A page that is not vLLM's, or that reports impossible values (negative or
//! NaN queue lengths), is an error rather than a pod that looks idle.

mod models;

pub use models::{ModelsError, parse_models};

use crate::exposition::{self, ExpositionError, Sample};
use crate::fleet::{LoraStatus, PodMetrics};

const WAITING: &str = "vllm:num_requests_waiting";
const RUNNING: &str = "vllm:num_requests_running";
const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
/// Name of [`KV_USAGE`] before vLLM v1; read only when the new name is absent.
const KV_USAGE_LEGACY: &str = "vllm:gpu_cache_usage_perc";
const CACHE_CONFIG: &str = "vllm:cache_config_info";
const LORA_INFO: &str = "vllm:lora_requests_info";
const PREEMPTIONS: &str = "vllm:num_preemptions_total";
const PREFIX_HITS: &str = "vllm:prefix_cache_hits_total";
const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries_total";
/// Every series read here; the rest of the text is skipped unparsed.
const READ: [&str; 9] = [
    WAITING,
    RUNNING,
    KV_USAGE,
    KV_USAGE_LEGACY,
    CACHE_CONFIG,
    LORA_INFO,
    PREEMPTIONS,
    PREFIX_HITS,
    PREFIX_QUERIES,
];

/// The query string that asks a vLLM `/metrics` page for only the series read here:
/// `name[]=` once per sample name, URL-encoded. vLLM serves `/metrics` with
/// prometheus_client's ASGI app, which then renders only those samples (a few hundred
/// bytes instead of tens of kilobytes of histograms); a server that ignores the query
/// returns the whole page, which parses the same.
pub fn metrics_query() -> String {
    READ.iter()
        .map(|name| format!("name%5B%5D={}", name.replace(':', "%3A")))
        .collect::<Vec<_>>()
        .join("&")
}

/// Why a page could not be turned into [`PodMetrics`].
#[derive(Debug, thiserror::Error)]
pub enum VllmMetricsError {
    #[error("malformed exposition text: {0}")]
    Exposition(#[from] ExpositionError),
    /// A required metric is absent: most likely not a vLLM `/metrics` page.
    #[error("required metric {0} is missing (not a vLLM /metrics page?)")]
    Missing(&'static str),
    #[error("invalid {metric}: {reason}")]
    Invalid {
        metric: &'static str,
        reason: String,
    },
}

/// Parses a vLLM `/metrics` page.
///
/// `vllm:num_requests_waiting`, `vllm:num_requests_running` and a KV usage
/// gauge (`vllm:kv_cache_usage_perc`, or the older `vllm:gpu_cache_usage_perc`)
/// are required; everything else is optional.
///
/// # Errors
///
/// [`VllmMetricsError::Exposition`] for text that is not valid exposition
/// format, [`VllmMetricsError::Missing`] when a required metric is absent and
/// [`VllmMetricsError::Invalid`] for impossible values (NaN, negative, ...).
pub fn parse_vllm_metrics(text: &str) -> Result<PodMetrics, VllmMetricsError> {
    let samples = exposition::parse_where(text, |name| READ.contains(&name))?;
    let mut page = Page::default();
    for sample in samples.iter().filter(|s| s.name.starts_with("vllm:")) {
        page.add(sample)?;
    }
    page.finish()
}

/// What a page says so far, series by series.
#[derive(Default)]
struct Page<'s> {
    waiting: Total,
    running: Total,
    preemptions: Total,
    prefix_hits: Total,
    prefix_queries: Total,
    kv_usage: Vec<EngineValue<'s>>,
    kv_usage_legacy: Vec<EngineValue<'s>>,
    caches: Vec<EngineCache<'s>>,
    /// (timestamp, sample) of the newest LoRA series so far.
    newest_lora: Option<(f64, &'s Sample<'s>)>,
    engines: Vec<&'s str>,
}

impl<'s> Page<'s> {
    fn add(&mut self, sample: &'s Sample<'s>) -> Result<(), VllmMetricsError> {
        let engine = engine_of(sample);
        if let Some(name) = engine
            && !self.engines.contains(&name)
        {
            self.engines.push(name);
        }
        let value = sample.value;
        match sample.name {
            WAITING => self.waiting.add(count_value(WAITING, value)?),
            RUNNING => self.running.add(count_value(RUNNING, value)?),
            PREEMPTIONS => self
                .preemptions
                .add(finite_non_negative(PREEMPTIONS, value)?),
            PREFIX_HITS => self
                .prefix_hits
                .add(finite_non_negative(PREFIX_HITS, value)?),
            PREFIX_QUERIES => {
                let queries = finite_non_negative(PREFIX_QUERIES, value)?;
                self.prefix_queries.add(queries);
            }
            // Validated once we know which of the two names is in use.
            KV_USAGE => self.kv_usage.push(EngineValue { engine, value }),
            KV_USAGE_LEGACY => self.kv_usage_legacy.push(EngineValue { engine, value }),
            CACHE_CONFIG => self.add_cache(engine, sample)?,
            LORA_INFO => {
                // The value is the unix time of the update; each distinct
                // adapter set is its own series, so old ones linger.
                let timestamp = finite_non_negative(LORA_INFO, value)?;
                if self
                    .newest_lora
                    .is_none_or(|(newest, _)| timestamp > newest)
                {
                    self.newest_lora = Some((timestamp, sample));
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn add_cache(
        &mut self,
        engine: Option<&'s str>,
        sample: &'s Sample<'s>,
    ) -> Result<(), VllmMetricsError> {
        // An info gauge is 1 while current. prometheus_client also creates a child
        // (value 0) for every label set merely named, e.g. a template `engine=""`;
        // such a series describes no engine.
        if finite_non_negative(CACHE_CONFIG, sample.value)? == 0.0 {
            return Ok(());
        }
        let cache = EngineCache::from_sample(engine, sample)?;
        // One description per engine; a repeated one replaces the earlier.
        match self.caches.iter_mut().find(|known| known.engine == engine) {
            Some(known) => *known = cache,
            None => self.caches.push(cache),
        }
        Ok(())
    }

    fn finish(self) -> Result<PodMetrics, VllmMetricsError> {
        // Prefer the current name; the legacy one only when the current is absent
        // (vLLM versions in between expose both, with the same values).
        let (kv_metric, kv_usage) = if self.kv_usage.is_empty() {
            (KV_USAGE_LEGACY, self.kv_usage_legacy)
        } else {
            (KV_USAGE, self.kv_usage)
        };
        if kv_usage.is_empty() {
            return Err(VllmMetricsError::Missing(KV_USAGE));
        }
        for entry in &kv_usage {
            finite_non_negative(kv_metric, entry.value)?;
        }
        let waiting = self.waiting.require(WAITING)?;
        let running = self.running.require(RUNNING)?;
        let caches = self.caches;
        let block_size = common_block_size(&caches)?;
        Ok(PodMetrics {
            waiting: to_u32(WAITING, waiting)?,
            running: to_u32(RUNNING, running)?,
            kv_usage: weighted_kv_usage(&kv_usage, &caches),
            kv_capacity_tokens: pod_capacity_tokens(&caches, block_size)?,
            num_gpu_blocks: pod_gpu_blocks(&caches),
            block_size,
            engines: u32::try_from(self.engines.len()).unwrap_or(u32::MAX).max(1),
            lora: self
                .newest_lora
                .map(|(_, sample)| lora_status(sample))
                .transpose()?,
            preemptions_total: self.preemptions.into_option(),
            prefix_cache_hits_total: self.prefix_hits.into_option(),
            prefix_cache_queries_total: self.prefix_queries.into_option(),
        })
    }
}

/// The sample's `engine` label; an empty value counts as no label.
fn engine_of<'s>(sample: &'s Sample<'_>) -> Option<&'s str> {
    sample.label("engine").filter(|engine| !engine.is_empty())
}

/// A running sum over every series of one metric, remembering whether any
/// series was seen at all (absent and zero mean different things).
#[derive(Default)]
struct Total {
    sum: f64,
    seen: bool,
}

impl Total {
    fn add(&mut self, value: f64) {
        self.sum += value;
        self.seen = true;
    }

    fn require(self, metric: &'static str) -> Result<f64, VllmMetricsError> {
        self.into_option().ok_or(VllmMetricsError::Missing(metric))
    }

    fn into_option(self) -> Option<f64> {
        self.seen.then_some(self.sum)
    }
}

fn invalid(metric: &'static str, reason: impl Into<String>) -> VllmMetricsError {
    VllmMetricsError::Invalid {
        metric,
        reason: reason.into(),
    }
}

/// Every gauge and counter we read is a size, a count or a time: NaN,
/// infinities and negatives can only come from a broken exporter.
fn finite_non_negative(metric: &'static str, value: f64) -> Result<f64, VllmMetricsError> {
    if value.is_nan() {
        Err(invalid(metric, "value is NaN"))
    } else if value.is_infinite() {
        Err(invalid(metric, "value is infinite"))
    } else if value < 0.0 {
        Err(invalid(metric, format!("value {value} is negative")))
    } else {
        Ok(value)
    }
}

/// A request count: finite, non-negative and whole (vLLM writes `3.0`).
fn count_value(metric: &'static str, value: f64) -> Result<f64, VllmMetricsError> {
    let value = finite_non_negative(metric, value)?;
    if value.fract() != 0.0 {
        return Err(invalid(
            metric,
            format!("count {value} is not a whole number"),
        ));
    }
    Ok(value)
}

fn to_u32(metric: &'static str, total: f64) -> Result<u32, VllmMetricsError> {
    if total > f64::from(u32::MAX) {
        return Err(invalid(
            metric,
            format!("count {total} does not fit in u32"),
        ));
    }
    // In range, whole and non-negative (checked per sample), so exact.
    Ok(total as u32)
}

/// One engine's value of a per-engine gauge.
struct EngineValue<'s> {
    engine: Option<&'s str>,
    value: f64,
}

/// What `vllm:cache_config_info` says about one engine.
///
/// vLLM has one `CacheConfig` per pod, in its API frontend, and emits it once per engine
/// (data-parallel rank) with that engine's `engine` label. Its `num_gpu_blocks` is the
/// **pod's** total: the frontend sums the blocks every DP engine reports at start-up.
/// `kv_cache_size_tokens` (newer vLLM; absent up to v0.11) is **per engine**.
#[derive(Debug)]
struct EngineCache<'s> {
    engine: Option<&'s str>,
    /// The pod's GPU blocks, over all its engines.
    pod_gpu_blocks: Option<u64>,
    block_size: Option<u32>,
    /// This engine's own capacity in tokens, when vLLM states it.
    engine_tokens: Option<u64>,
}

impl<'s> EngineCache<'s> {
    fn from_sample(engine: Option<&'s str>, sample: &Sample<'_>) -> Result<Self, VllmMetricsError> {
        Ok(Self {
            engine,
            pod_gpu_blocks: numeric_label(CACHE_CONFIG, sample, "num_gpu_blocks")?,
            block_size: numeric_label(CACHE_CONFIG, sample, "block_size")?,
            engine_tokens: numeric_label(CACHE_CONFIG, sample, "kv_cache_size_tokens")?,
        })
    }
}

/// The pod's GPU blocks: the value every engine's series repeats (the largest, should
/// a page ever disagree: a partial value would understate the pod).
fn pod_gpu_blocks(caches: &[EngineCache<'_>]) -> Option<u64> {
    caches.iter().filter_map(|cache| cache.pod_gpu_blocks).max()
}

/// The pod's KV capacity in tokens. Newer vLLM states each engine's capacity in tokens
/// (authoritative for hybrid models, whose blocks do not map to tokens by a plain
/// product): their sum. Otherwise the pod's blocks times the block size.
fn pod_capacity_tokens(
    caches: &[EngineCache<'_>],
    block_size: Option<u32>,
) -> Result<Option<u64>, VllmMetricsError> {
    if !caches.is_empty() && caches.iter().all(|cache| cache.engine_tokens.is_some()) {
        return sum_all(caches.iter().map(|cache| cache.engine_tokens));
    }
    match (pod_gpu_blocks(caches), block_size) {
        (Some(blocks), Some(size)) => {
            Ok(Some(blocks.checked_mul(u64::from(size)).ok_or_else(
                || invalid(CACHE_CONFIG, "num_gpu_blocks * block_size overflows"),
            )?))
        }
        _ => Ok(None),
    }
}

/// Reads a numeric label of an info-style series (`metric` names it in errors).
/// Absent, empty and `None` (Python's, stringified) all mean "not stated".
fn numeric_label<T: std::str::FromStr>(
    metric: &'static str,
    sample: &Sample<'_>,
    label: &str,
) -> Result<Option<T>, VllmMetricsError> {
    match sample.label(label).map(str::trim) {
        None | Some("" | "None") => Ok(None),
        Some(text) => text.parse().map(Some).map_err(|_| {
            let shown: String = text.chars().take(40).collect();
            invalid(
                metric,
                format!("label {label}={shown:?} is not a non-negative integer"),
            )
        }),
    }
}

/// Sum over engines, `None` when any one is unknown: a partial total would
/// understate the pod.
fn sum_all(values: impl Iterator<Item = Option<u64>>) -> Result<Option<u64>, VllmMetricsError> {
    let mut total: Option<u64> = None;
    for value in values {
        let Some(value) = value else {
            return Ok(None);
        };
        let sum = total.unwrap_or(0).checked_add(value);
        total = Some(sum.ok_or_else(|| invalid(CACHE_CONFIG, "total over engines overflows"))?);
    }
    Ok(total)
}

/// All engines of a pod share one cache config; disagreement means the page
/// cannot be trusted.
fn common_block_size(caches: &[EngineCache<'_>]) -> Result<Option<u32>, VllmMetricsError> {
    let mut common: Option<u32> = None;
    for size in caches.iter().filter_map(|cache| cache.block_size) {
        match common {
            Some(known) if known != size => {
                return Err(invalid(
                    CACHE_CONFIG,
                    format!("engines disagree on block_size ({known} vs {size})"),
                ));
            }
            _ => common = Some(size),
        }
    }
    Ok(common)
}

/// Mean KV usage over engines, weighted by each engine's capacity so that a
/// large engine counts for more; unweighted when vLLM does not state per-engine
/// capacities (up to v0.11 only the pod's total is known, and DP engines of one
/// pod run the same model on the same kind of GPU).
///
/// Each value is clamped to 1: vLLM reports a fraction of blocks, but some
/// versions briefly report slightly more than 1 while blocks are being freed,
/// and the router must not read that as more than full.
fn weighted_kv_usage(usage: &[EngineValue<'_>], caches: &[EngineCache<'_>]) -> f64 {
    let capacity_of = |engine: Option<&str>| {
        caches
            .iter()
            .find(|cache| cache.engine == engine)
            .and_then(|cache| cache.engine_tokens)
            .filter(|&tokens| tokens > 0)
    };
    let weights: Option<Vec<f64>> = usage
        .iter()
        .map(|entry| capacity_of(entry.engine).map(|tokens| tokens as f64))
        .collect();
    let weights = weights.unwrap_or_else(|| vec![1.0; usage.len()]);
    // `usage` is non-empty and every weight is positive, so the total is too.
    let total_weight: f64 = weights.iter().sum();
    // Normalising the weights first keeps a single engine's value exact.
    let mean: f64 = usage
        .iter()
        .zip(&weights)
        .map(|(entry, weight)| entry.value.min(1.0) * (weight / total_weight))
        .sum();
    mean.clamp(0.0, 1.0)
}

fn lora_status(sample: &Sample<'_>) -> Result<LoraStatus, VllmMetricsError> {
    Ok(LoraStatus {
        max_lora: numeric_label(LORA_INFO, sample, "max_lora")?.unwrap_or(0),
        running: adapter_list(sample.label("running_lora_adapters")),
        waiting: adapter_list(sample.label("waiting_lora_adapters")),
    })
}

/// vLLM joins adapter names with ','. An absent, empty or `None` label is an
/// empty list; blank names between commas are dropped.
fn adapter_list(label: Option<&str>) -> Vec<String> {
    match label.map(str::trim) {
        None | Some("None") => Vec::new(),
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
            .collect(),
    }
}

#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;
