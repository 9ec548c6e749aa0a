//! Counters and histograms an engine accumulates (rendered by `metrics`).

use std::time::Duration;

/// vLLM's buckets for `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for `vllm:inter_token_latency_seconds`.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets for the request-level latency histograms (e2e, queue, prefill, decode).
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// 1-2-5 buckets up to the model length, as vLLM builds for token-count histograms.
pub const TOKEN_COUNT_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];

/// A Prometheus histogram with fixed upper bounds (`+Inf` implied).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        // The first bound at or above `v` (bounds ascend); none for NaN or above the last.
        let i = self.bounds.partition_point(|&b| b < v);
        if !v.is_nan()
            && let Some(count) = self.counts.get_mut(i)
        {
            *count += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Upper bounds.
    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// Cumulative counts per bound (without `+Inf`).
    pub fn cumulative(&self) -> Vec<u64> {
        let mut acc = 0;
        self.counts
            .iter()
            .map(|c| {
                acc += c;
                acc
            })
            .collect()
    }

    /// Sum of observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Mean of observations (0 when empty).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum / self.count as f64
        }
    }
}

/// Latencies too many to keep one by one (a million requests stream hundreds of tokens
/// each): counts in bins 1/128 of an octave wide (0.54 %), from 1 µs to 4.6 hours, and
/// the exact sum. Histograms of the same quantity add up ([`LogHistogram::add`]), so
/// each engine can count its own tokens' gaps and an offline simulation sum them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogHistogram {
    bins: Vec<u64>,
    count: u64,
    /// The durations observed, summed exactly: their mean does not depend on the order
    /// they come in or on how they were split between histograms.
    sum_nanos: u128,
}

/// Bins per octave, as a power of two: the mantissa bits kept.
const MANTISSA_BITS: u32 = 7;
/// Exponent of the lowest octave (2^-20 s ≈ 1 µs).
const LOWEST_EXP: i64 = -20;
/// Octaves covered.
const OCTAVES: i64 = 34;
/// Bins, the underflow bin included.
const LOG_BINS: usize = (OCTAVES << MANTISSA_BITS) as usize + 1;

impl Default for LogHistogram {
    fn default() -> Self {
        LogHistogram {
            bins: vec![0; LOG_BINS],
            count: 0,
            sum_nanos: 0,
        }
    }
}

impl LogHistogram {
    fn bin(v: f64) -> usize {
        if v.is_nan() || v <= 0.0 {
            return 0;
        }
        let bits = v.to_bits();
        let exp = ((bits >> 52) & 0x7ff) as i64 - 1023;
        if exp < LOWEST_EXP {
            return 0;
        }
        let key = (((exp - LOWEST_EXP) << MANTISSA_BITS) as u64
            | (bits >> (52 - MANTISSA_BITS)) & ((1 << MANTISSA_BITS) - 1))
            + 1;
        (key as usize).min(LOG_BINS - 1)
    }

    /// The middle of a bin (0 for the underflow bin).
    fn value(bin: usize) -> f64 {
        if bin == 0 {
            return 0.0;
        }
        let key = (bin - 1) as i64;
        let exp = (key >> MANTISSA_BITS) + LOWEST_EXP;
        let mantissa = (key & ((1 << MANTISSA_BITS) - 1)) as f64 + 0.5;
        2f64.powi(exp as i32) * (1.0 + mantissa / f64::from(1u32 << MANTISSA_BITS))
    }

    /// Observes a duration, binned in seconds.
    pub fn observe(&mut self, d: Duration) {
        self.bins[Self::bin(d.as_secs_f64())] += 1;
        self.count += 1;
        self.sum_nanos += d.as_nanos();
    }

    /// Forgets every observation, keeping the bins' room.
    pub fn clear(&mut self) {
        self.bins.fill(0);
        self.count = 0;
        self.sum_nanos = 0;
    }

    /// Adds what `other` observed.
    pub fn add(&mut self, other: &LogHistogram) {
        if other.count == 0 {
            return;
        }
        for (mine, theirs) in self.bins.iter_mut().zip(&other.bins) {
            *mine += theirs;
        }
        self.count += other.count;
        self.sum_nanos += other.sum_nanos;
    }

    /// Observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The observation of rank ⌊q·(n−1)⌋ (as the load generator's percentiles start
    /// from), to the bins' resolution; `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let last = self.count.checked_sub(1)?;
        let rank = (q.clamp(0.0, 1.0) * last as f64).floor() as u64;
        let mut seen = 0;
        for (bin, &n) in self.bins.iter().enumerate() {
            seen += n;
            if seen > rank {
                return Some(Self::value(bin));
            }
        }
        None
    }

    /// The exact mean in seconds; `None` when empty.
    pub fn mean_secs(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum_nanos as f64 * 1e-9 / self.count as f64)
    }
}

/// Token gaps on their way into a [`LogHistogram`]: kept in arrival order and binned a
/// batch at a time. An offline simulation visits each of a thousand engines for a few
/// steps at a time, and a histogram's bins (35 KB) are cold at every visit: binning each
/// gap as it comes cost a cache miss or more per token, a batch of them one per line of
/// bins it touches. The counts are the same either way.
#[derive(Debug, Clone)]
pub struct GapLog {
    /// Gaps not yet binned, in nanoseconds.
    pending: Vec<u64>,
    binned: LogHistogram,
}

/// Gaps a [`GapLog`] keeps before binning them: 2 KB an engine.
const PENDING_GAPS: usize = 256;

impl Default for GapLog {
    fn default() -> Self {
        GapLog {
            pending: Vec::with_capacity(PENDING_GAPS),
            binned: LogHistogram::default(),
        }
    }
}

impl GapLog {
    /// Counts one gap.
    #[inline]
    pub fn observe(&mut self, gap: Duration) {
        // Gaps past 584 years (u64 nanoseconds) do not occur in virtual time; such a gap
        // would be binned at once.
        match u64::try_from(gap.as_nanos()) {
            Ok(nanos) => {
                self.pending.push(nanos);
                if self.pending.len() == PENDING_GAPS {
                    self.bin_pending();
                }
            }
            Err(_) => self.binned.observe(gap),
        }
    }

    fn bin_pending(&mut self) {
        for &nanos in &self.pending {
            self.binned.observe(Duration::from_nanos(nanos));
        }
        self.pending.clear();
    }

    /// Gaps counted since the last call.
    pub fn count(&self) -> u64 {
        self.pending.len() as u64 + self.binned.count()
    }

    /// Adds every gap counted to `into`, and forgets them.
    pub fn take_into(&mut self, into: &mut LogHistogram) {
        self.bin_pending();
        if self.binned.count() > 0 {
            into.add(&self.binned);
            self.binned.clear();
        }
    }
}

/// Everything an engine counts since it started.
#[derive(Debug, Clone)]
pub struct EngineStats {
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: u64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: u64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: u64,
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_cache_hits: u64,
    /// `vllm:request_success_total{finished_reason="stop"}`.
    pub success_stop: u64,
    /// `vllm:request_success_total{finished_reason="length"}`.
    pub success_length: u64,
    /// `vllm:request_success_total{finished_reason="abort"}`.
    pub aborted: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Inter-token latency.
    pub itl: Histogram,
    /// Arrival to last token.
    pub e2e: Histogram,
    /// Arrival to first scheduling.
    pub queue: Histogram,
    /// First scheduling to first token.
    pub prefill: Histogram,
    /// First token to last token.
    pub decode: Histogram,
    /// First scheduling to last token.
    pub inference: Histogram,
    /// Prompt tokens per request.
    pub prompt_len: Histogram,
    /// Output tokens per request.
    pub generation_len: Histogram,
}

impl Default for EngineStats {
    fn default() -> EngineStats {
        EngineStats {
            prompt_tokens: 0,
            generation_tokens: 0,
            preemptions: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            success_stop: 0,
            success_length: 0,
            aborted: 0,
            steps: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
            queue: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prefill: Histogram::new(REQUEST_LATENCY_BUCKETS),
            decode: Histogram::new(REQUEST_LATENCY_BUCKETS),
            inference: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prompt_len: Histogram::new(TOKEN_COUNT_BUCKETS),
            generation_len: Histogram::new(TOKEN_COUNT_BUCKETS),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_log_bins_exactly_what_a_histogram_would() {
        let gaps: Vec<Duration> = (0..1_000u64)
            .map(|i| Duration::from_nanos(7_000_000 + (i * 7_919) % 900_000))
            .chain([Duration::ZERO, Duration::from_secs(3_600)])
            .collect();
        let mut log = GapLog::default();
        let mut want = LogHistogram::default();
        for (i, &gap) in gaps.iter().enumerate() {
            log.observe(gap);
            want.observe(gap);
            assert_eq!(log.count(), i as u64 + 1);
        }
        let mut got = LogHistogram::default();
        log.take_into(&mut got);
        assert_eq!(got, want);
        assert_eq!(log.count(), 0, "taken gaps are forgotten");
        log.observe(Duration::from_millis(8));
        let mut again = LogHistogram::default();
        log.take_into(&mut again);
        assert_eq!(again.count(), 1);
    }

    #[test]
    fn histogram_counts_are_cumulative_and_overflow_goes_to_inf_only() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        h.observe(0.5);
        h.observe(1.5);
        h.observe(9.0);
        assert_eq!(h.cumulative(), vec![1, 2]);
        assert_eq!(h.count(), 3);
        assert!((h.sum() - 11.0).abs() < 1e-9);
    }

    #[test]
    fn log_histograms_of_two_halves_add_up_to_the_whole() {
        let gaps: Vec<Duration> = (1..=999u64)
            .map(|i| Duration::from_nanos(i * i * 7_919))
            .collect();
        let (mut whole, mut odd, mut even) = Default::default();
        for (i, &gap) in gaps.iter().enumerate() {
            LogHistogram::observe(&mut whole, gap);
            LogHistogram::observe(if i % 2 == 0 { &mut even } else { &mut odd }, gap);
        }
        let mut sum = LogHistogram::default();
        sum.add(&odd);
        sum.add(&even);
        assert_eq!(sum, whole);
        assert_eq!(sum.count(), 999);
        let mean = gaps.iter().sum::<Duration>().as_secs_f64() / 999.0;
        assert!((sum.mean_secs().expect("observed") - mean).abs() < 1e-12);
        assert!(sum.quantile(0.5) < sum.quantile(0.9));
        assert_eq!(LogHistogram::default().quantile(0.5), None);
    }
}
