//! Turns a vLLM `/metrics` page into the few numbers the router needs.
//!
//! Labels are read by name, never by position: vLLM's label sets differ
//! between versions (older `cache_config_info` carries a dozen more labels)
//! and between deployments (`engine` appears on data-parallel pods). Series
//! are summed or combined across `engine` and `model_name` values.
//!
//! A page that is not vLLM's, or that reports impossible values (negative or
//! NaN queue lengths), is an error rather than a pod that looks idle.

use super::exposition::{self, ExpositionError, Sample};

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
    /// KV-cache capacity in tokens, over all engines; `None` if any engine's
    /// is unknown.
    pub kv_capacity_tokens: Option<u64>,
    /// GPU KV-cache blocks, summed over engines; `None` if any is unknown.
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

    let mut waiting = Total::default();
    let mut running = Total::default();
    let mut preemptions = Total::default();
    let mut prefix_hits = Total::default();
    let mut prefix_queries = Total::default();
    let mut kv_usage: Vec<EngineValue<'_>> = Vec::new();
    let mut kv_usage_legacy: Vec<EngineValue<'_>> = Vec::new();
    let mut caches: Vec<EngineCache<'_>> = Vec::new();
    // (timestamp, sample) of the newest LoRA series so far.
    let mut newest_lora: Option<(f64, &Sample<'_>)> = None;
    let mut engines: Vec<&str> = Vec::new();

    for sample in samples.iter().filter(|s| s.name.starts_with("vllm:")) {
        let engine = engine_of(sample);
        if let Some(name) = engine
            && !engines.contains(&name)
        {
            engines.push(name);
        }
        match sample.name {
            WAITING => waiting.add(count_value(WAITING, sample.value)?),
            RUNNING => running.add(count_value(RUNNING, sample.value)?),
            PREEMPTIONS => preemptions.add(finite_non_negative(PREEMPTIONS, sample.value)?),
            PREFIX_HITS => prefix_hits.add(finite_non_negative(PREFIX_HITS, sample.value)?),
            PREFIX_QUERIES => {
                prefix_queries.add(finite_non_negative(PREFIX_QUERIES, sample.value)?)
            }
            // Validated once we know which of the two names is in use.
            KV_USAGE => kv_usage.push(EngineValue {
                engine,
                value: sample.value,
            }),
            KV_USAGE_LEGACY => kv_usage_legacy.push(EngineValue {
                engine,
                value: sample.value,
            }),
            CACHE_CONFIG => {
                // An info gauge is 1 while current. prometheus_client also
                // creates a child (value 0) for every label set merely named,
                // e.g. a template `engine=""`; such a series describes no engine.
                if finite_non_negative(CACHE_CONFIG, sample.value)? == 0.0 {
                    continue;
                }
                let cache = EngineCache::from_sample(engine, sample)?;
                // One description per engine; a repeated one replaces the earlier.
                match caches.iter_mut().find(|known| known.engine == engine) {
                    Some(known) => *known = cache,
                    None => caches.push(cache),
                }
            }
            LORA_INFO => {
                // The value is the unix time of the update; each distinct
                // adapter set is its own series, so old ones linger.
                let timestamp = finite_non_negative(LORA_INFO, sample.value)?;
                if newest_lora.is_none_or(|(newest, _)| timestamp > newest) {
                    newest_lora = Some((timestamp, sample));
                }
            }
            _ => {}
        }
    }

    // Prefer the current name; the legacy one only when the current is absent
    // (vLLM versions in between expose both, with the same values).
    let (kv_metric, kv_usage) = if kv_usage.is_empty() {
        (KV_USAGE_LEGACY, kv_usage_legacy)
    } else {
        (KV_USAGE, kv_usage)
    };
    if kv_usage.is_empty() {
        return Err(VllmMetricsError::Missing(KV_USAGE));
    }
    for entry in &kv_usage {
        finite_non_negative(kv_metric, entry.value)?;
    }
    let waiting = waiting.require(WAITING)?;
    let running = running.require(RUNNING)?;

    Ok(PodMetrics {
        waiting: to_u32(WAITING, waiting)?,
        running: to_u32(RUNNING, running)?,
        kv_usage: weighted_kv_usage(&kv_usage, &caches),
        kv_capacity_tokens: sum_all(caches.iter().map(|c| c.capacity_tokens))?,
        num_gpu_blocks: sum_all(caches.iter().map(|c| c.num_gpu_blocks))?,
        block_size: common_block_size(&caches)?,
        engines: u32::try_from(engines.len()).unwrap_or(u32::MAX).max(1),
        lora: newest_lora
            .map(|(_, sample)| lora_status(sample))
            .transpose()?,
        preemptions_total: preemptions.into_option(),
        prefix_cache_hits_total: prefix_hits.into_option(),
        prefix_cache_queries_total: prefix_queries.into_option(),
    })
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
#[derive(Debug)]
struct EngineCache<'s> {
    engine: Option<&'s str>,
    num_gpu_blocks: Option<u64>,
    block_size: Option<u32>,
    capacity_tokens: Option<u64>,
}

impl<'s> EngineCache<'s> {
    fn from_sample(engine: Option<&'s str>, sample: &Sample<'_>) -> Result<Self, VllmMetricsError> {
        let num_gpu_blocks: Option<u64> = numeric_label(CACHE_CONFIG, sample, "num_gpu_blocks")?;
        let block_size: Option<u32> = numeric_label(CACHE_CONFIG, sample, "block_size")?;
        // Newer vLLM states the capacity in tokens; it is authoritative for
        // hybrid models, whose blocks do not map to tokens by a plain product.
        let capacity_tokens =
            match numeric_label::<u64>(CACHE_CONFIG, sample, "kv_cache_size_tokens")? {
                Some(tokens) => Some(tokens),
                None => match (num_gpu_blocks, block_size) {
                    (Some(blocks), Some(size)) => {
                        Some(blocks.checked_mul(u64::from(size)).ok_or_else(|| {
                            invalid(CACHE_CONFIG, "num_gpu_blocks * block_size overflows")
                        })?)
                    }
                    _ => None,
                },
            };
        Ok(Self {
            engine,
            num_gpu_blocks,
            block_size,
            capacity_tokens,
        })
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

/// Sum over engines, `None` when there are none or any one is unknown: a
/// partial total would understate the pod.
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
/// large engine counts for more; unweighted when any capacity is unknown.
///
/// Each value is clamped to 1: vLLM reports a fraction of blocks, but some
/// versions briefly report slightly more than 1 while blocks are being freed,
/// and the router must not read that as more than full.
fn weighted_kv_usage(usage: &[EngineValue<'_>], caches: &[EngineCache<'_>]) -> f64 {
    let capacity_of = |engine: Option<&str>| {
        caches
            .iter()
            .find(|cache| cache.engine == engine)
            .and_then(|cache| cache.capacity_tokens)
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
mod tests {
    use super::*;

    const V0_11_SINGLE: &str =
        include_str!("../../tests/fixtures/metrics/vllm-v0.11-single-engine.txt");
    const V0_6_LEGACY: &str = include_str!("../../tests/fixtures/metrics/vllm-v0.6-legacy.txt");
    const DP2_LORA: &str = include_str!("../../tests/fixtures/metrics/vllm-dp2-lora.txt");
    const NOT_VLLM: &str = include_str!("../../tests/fixtures/metrics/not-vllm.txt");

    /// A minimal page with the three required gauges and `extra` lines after.
    fn page(waiting: &str, running: &str, kv_usage: &str, extra: &str) -> String {
        format!(
            "vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
             vllm:num_requests_running{{model_name=\"m\"}} {running}\n\
             vllm:kv_cache_usage_perc{{model_name=\"m\"}} {kv_usage}\n\
             {extra}\n"
        )
    }

    fn page_with(extra: &str) -> String {
        page("1.0", "2.0", "0.5", extra)
    }

    fn assert_close(actual: f64, expected: f64) {
        assert!(
            (actual - expected).abs() < 1e-12,
            "expected {expected}, got {actual}"
        );
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|name| (*name).to_owned()).collect()
    }

    #[test]
    fn v0_11_single_engine_fixture_reads_every_field() {
        let metrics = parse_vllm_metrics(V0_11_SINGLE).unwrap();
        assert_eq!(
            metrics,
            PodMetrics {
                waiting: 2,
                running: 14,
                // 12164 of 29472 blocks in use.
                kv_usage: 12164.0 / 29472.0,
                kv_capacity_tokens: Some(29472 * 16),
                num_gpu_blocks: Some(29472),
                block_size: Some(16),
                engines: 1,
                lora: None,
                preemptions_total: Some(3.0),
                prefix_cache_hits_total: Some(182112.0),
                prefix_cache_queries_total: Some(431360.0),
            }
        );
    }

    #[test]
    fn v0_6_legacy_fixture_reads_gpu_cache_usage_and_the_old_cache_config() {
        let metrics = parse_vllm_metrics(V0_6_LEGACY).unwrap();
        assert_eq!(
            metrics,
            PodMetrics {
                waiting: 5,
                running: 32,
                // 26803 of 27153 blocks in use.
                kv_usage: 26803.0 / 27153.0,
                kv_capacity_tokens: Some(27153 * 16),
                num_gpu_blocks: Some(27153),
                block_size: Some(16),
                engines: 1,
                lora: None,
                preemptions_total: Some(17.0),
                prefix_cache_hits_total: None,
                prefix_cache_queries_total: None,
            }
        );
    }

    #[test]
    fn dp2_lora_fixture_sums_engines_and_picks_the_newest_lora_series() {
        let metrics = parse_vllm_metrics(DP2_LORA).unwrap();
        // Engine 0: 31 % of 224000 tokens; engine 1: 62 % of 192000 tokens.
        let expected_kv = (0.31 * 224000.0 + 0.62 * 192000.0) / 416000.0;
        assert_close(metrics.kv_usage, expected_kv);
        assert_eq!(
            metrics,
            PodMetrics {
                waiting: 4,
                running: 16,
                kv_usage: metrics.kv_usage,
                kv_capacity_tokens: Some(416000),
                num_gpu_blocks: Some(26000),
                block_size: Some(16),
                engines: 2,
                lora: Some(LoraStatus {
                    max_lora: 4,
                    running: names(&["sql-lora", "tweet-summary"]),
                    waiting: names(&["legal-v2"]),
                }),
                preemptions_total: Some(7.0),
                prefix_cache_hits_total: Some(4000.0),
                prefix_cache_queries_total: Some(12000.0),
            }
        );
    }

    #[test]
    fn a_page_without_vllm_metrics_is_reported_as_missing() {
        let err = parse_vllm_metrics(NOT_VLLM).unwrap_err();
        assert!(matches!(err, VllmMetricsError::Missing(_)), "{err}");
    }

    #[test]
    fn an_empty_page_is_reported_as_missing() {
        let err = parse_vllm_metrics("").unwrap_err();
        assert!(matches!(err, VllmMetricsError::Missing(_)), "{err}");
    }

    #[test]
    fn each_required_metric_is_named_when_missing() {
        let without = |skip: &str| {
            page_with("")
                .lines()
                .filter(|line| !line.starts_with(skip))
                .collect::<Vec<_>>()
                .join("\n")
        };
        for metric in [WAITING, RUNNING, KV_USAGE] {
            let err = parse_vllm_metrics(&without(metric)).unwrap_err();
            assert!(
                matches!(err, VllmMetricsError::Missing(name) if name == metric),
                "{metric}: {err}"
            );
        }
    }

    #[test]
    fn a_malformed_line_is_an_exposition_error_with_its_line_number() {
        let err = parse_vllm_metrics(&page_with("vllm:num_requests_waiting{model_name=\"m\" 3"))
            .unwrap_err();
        match err {
            VllmMetricsError::Exposition(inner) => assert_eq!(inner.line(), 4),
            other => panic!("expected an exposition error, got {other}"),
        }
    }

    #[test]
    fn the_new_kv_usage_name_wins_over_the_legacy_one() {
        let metrics = parse_vllm_metrics(&page_with(
            "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9",
        ))
        .unwrap();
        assert_eq!(metrics.kv_usage, 0.5);
    }

    #[test]
    fn a_broken_legacy_kv_series_is_ignored_when_the_new_name_is_present() {
        let metrics = parse_vllm_metrics(&page_with("vllm:gpu_cache_usage_perc NaN")).unwrap();
        assert_eq!(metrics.kv_usage, 0.5);
    }

    #[test]
    fn a_broken_legacy_kv_series_is_invalid_when_it_is_the_only_one() {
        let text = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:gpu_cache_usage_perc -1\n";
        let err = parse_vllm_metrics(text).unwrap_err();
        assert!(
            matches!(
                err,
                VllmMetricsError::Invalid {
                    metric: KV_USAGE_LEGACY,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn kv_usage_above_one_is_clamped_to_one() {
        let text = page("0", "0", "1.0000001", "");
        assert_eq!(parse_vllm_metrics(&text).unwrap().kv_usage, 1.0);
    }

    #[test]
    fn nan_negative_or_infinite_gauges_are_invalid() {
        let cases = [
            (WAITING, page("NaN", "0", "0", "")),
            (WAITING, page("-1", "0", "0", "")),
            (RUNNING, page("0", "+Inf", "0", "")),
            (KV_USAGE, page("0", "0", "NaN", "")),
            (KV_USAGE, page("0", "0", "-0.1", "")),
            (
                PREEMPTIONS,
                page("0", "0", "0", "vllm:num_preemptions_total -Inf"),
            ),
            (
                PREFIX_HITS,
                page("0", "0", "0", "vllm:prefix_cache_hits_total -3"),
            ),
        ];
        for (metric, text) in cases {
            let err = parse_vllm_metrics(&text).unwrap_err();
            assert!(
                matches!(err, VllmMetricsError::Invalid { metric: name, .. } if name == metric),
                "{metric}: {err}"
            );
        }
    }

    #[test]
    fn a_fractional_queue_length_is_invalid() {
        let err = parse_vllm_metrics(&page("1.5", "0", "0", "")).unwrap_err();
        assert!(
            matches!(
                err,
                VllmMetricsError::Invalid {
                    metric: WAITING,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn scientific_notation_values_parse() {
        let metrics = parse_vllm_metrics(&page("1.0e+00", "1.2e+01", "2.5e-01", "")).unwrap();
        assert_eq!(
            (metrics.waiting, metrics.running, metrics.kv_usage),
            (1, 12, 0.25)
        );
    }

    #[test]
    fn queues_are_summed_over_models_and_engines() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 1
vllm:num_requests_waiting{engine=\"0\",model_name=\"b\"} 2
vllm:num_requests_waiting{engine=\"1\",model_name=\"a\"} 4
vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 8
vllm:num_requests_running{engine=\"1\",model_name=\"a\"} 16
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.2
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"a\"} 0.4
";
        let metrics = parse_vllm_metrics(text).unwrap();
        assert_eq!(
            (metrics.waiting, metrics.running, metrics.engines),
            (7, 24, 2)
        );
        // No cache config, so no capacities: a plain mean.
        assert_close(metrics.kv_usage, 0.3);
        assert_eq!(metrics.kv_capacity_tokens, None);
        assert_eq!(metrics.num_gpu_blocks, None);
    }

    #[test]
    fn kv_cache_size_tokens_is_preferred_over_blocks_times_block_size() {
        let metrics = parse_vllm_metrics(&page_with(
            "vllm:cache_config_info{num_gpu_blocks=\"100\",block_size=\"528\",kv_cache_size_tokens=\"40000\"} 1",
        ))
        .unwrap();
        assert_eq!(metrics.kv_capacity_tokens, Some(40000));
        assert_eq!(metrics.num_gpu_blocks, Some(100));
        assert_eq!(metrics.block_size, Some(528));
    }

    #[test]
    fn cache_config_labels_are_read_by_name_in_any_order() {
        let metrics = parse_vllm_metrics(&page_with(
            "vllm:cache_config_info{swap_space=\"4\",num_gpu_blocks=\"10\",cache_dtype=\"auto\",block_size=\"32\",sliding_window=\"None\"} 1.0",
        ))
        .unwrap();
        assert_eq!(metrics.kv_capacity_tokens, Some(320));
        assert_eq!(metrics.block_size, Some(32));
    }

    #[test]
    fn none_block_counts_leave_the_capacity_unknown() {
        let metrics = parse_vllm_metrics(&page_with(
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1",
        ))
        .unwrap();
        assert_eq!(metrics.num_gpu_blocks, None);
        assert_eq!(metrics.kv_capacity_tokens, None);
        assert_eq!(metrics.block_size, Some(16));
    }

    #[test]
    fn one_engine_with_unknown_capacity_makes_the_total_unknown() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\"} 0
vllm:num_requests_running{engine=\"0\"} 0
vllm:kv_cache_usage_perc{engine=\"0\"} 0.1
vllm:kv_cache_usage_perc{engine=\"1\"} 0.3
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"} 1
vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"None\"} 1
";
        let metrics = parse_vllm_metrics(text).unwrap();
        assert_eq!(metrics.kv_capacity_tokens, None);
        assert_eq!(metrics.num_gpu_blocks, None);
        assert_close(metrics.kv_usage, 0.2);
    }

    #[test]
    fn a_zero_valued_cache_config_series_is_ignored() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\"} 0
vllm:num_requests_running{engine=\"0\"} 0
vllm:kv_cache_usage_perc{engine=\"0\"} 0.1
vllm:cache_config_info{block_size=\"16\",engine=\"\",num_gpu_blocks=\"None\"} 0.0
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"} 1.0
";
        let metrics = parse_vllm_metrics(text).unwrap();
        assert_eq!(metrics.num_gpu_blocks, Some(1000));
        assert_eq!(metrics.engines, 1);
    }

    #[test]
    fn a_garbled_numeric_cache_label_is_invalid() {
        let err = parse_vllm_metrics(&page_with(
            "vllm:cache_config_info{block_size=\"sixteen\",num_gpu_blocks=\"10\"} 1",
        ))
        .unwrap_err();
        assert!(
            matches!(
                err,
                VllmMetricsError::Invalid {
                    metric: CACHE_CONFIG,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn engines_disagreeing_on_block_size_is_invalid() {
        let text = "\
vllm:num_requests_waiting 0
vllm:num_requests_running 0
vllm:kv_cache_usage_perc 0
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1\"} 1
vllm:cache_config_info{block_size=\"32\",engine=\"1\",num_gpu_blocks=\"1\"} 1
";
        let err = parse_vllm_metrics(text).unwrap_err();
        assert!(
            matches!(
                err,
                VllmMetricsError::Invalid {
                    metric: CACHE_CONFIG,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn the_lora_series_with_the_largest_timestamp_wins_wherever_it_is() {
        let metrics = parse_vllm_metrics(&page_with(
            "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 1.7e+09\n\
             vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"new\",waiting_lora_adapters=\"\"} 1.9e+09\n\
             vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"middle\",waiting_lora_adapters=\"\"} 1.8e+09",
        ))
        .unwrap();
        let lora = metrics.lora.unwrap();
        assert_eq!(lora.running, names(&["new"]));
        assert!(lora.waiting.is_empty());
        assert_eq!(lora.max_lora, 2);
    }

    #[test]
    fn adapter_lists_are_split_trimmed_and_empty_names_dropped() {
        let metrics = parse_vllm_metrics(&page_with(
            "vllm:lora_requests_info{waiting_lora_adapters=\" a , ,b,\",running_lora_adapters=\"None\",max_lora=\"None\"} 1",
        ))
        .unwrap();
        assert_eq!(
            metrics.lora,
            Some(LoraStatus {
                max_lora: 0,
                running: Vec::new(),
                waiting: names(&["a", "b"]),
            })
        );
    }

    #[test]
    fn a_nan_lora_timestamp_is_invalid() {
        let err = parse_vllm_metrics(&page_with(
            "vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} NaN",
        ))
        .unwrap_err();
        assert!(
            matches!(
                err,
                VllmMetricsError::Invalid {
                    metric: LORA_INFO,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_queue_too_long_for_u32_is_invalid() {
        let err = parse_vllm_metrics(&page("5e9", "0", "0", "")).unwrap_err();
        assert!(
            matches!(
                err,
                VllmMetricsError::Invalid {
                    metric: WAITING,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn unrelated_series_do_not_count_as_engines() {
        let metrics = parse_vllm_metrics(&page_with(
            "python_info{engine=\"x\"} 1\nvllm:other{engine=\"\"} 1",
        ))
        .unwrap();
        assert_eq!(metrics.engines, 1);
    }
}
