//! What one ladder step of a simulation measured, accumulated as requests end, and turned
//! into the load generator's [`StepReport`] and the comparison's [`WindowStats`], so the
//! report code of `compare` renders simulated runs unchanged.

use std::collections::BTreeMap;

use crate::compare::fleet_stats::{Totals, WindowStats, kv_spread, window_between};
use crate::loadgen::client::ErrorKind;
use crate::loadgen::report::{Counts, Latency, StepReport, Throughput, Tokens};

/// Latencies too many to keep one by one (a million requests stream hundreds of tokens
/// each): counts in bins 1/128 of an octave wide (0.54 %), from 1 µs to 4.6 hours.
#[derive(Debug, Clone)]
pub struct LogHistogram {
    bins: Vec<u64>,
    count: u64,
    sum: f64,
}

/// Bins per octave, as a power of two: the mantissa bits kept.
const MANTISSA_BITS: u32 = 7;
/// Exponent of the lowest octave (2^-20 s ≈ 1 µs).
const LOWEST_EXP: i64 = -20;
/// Octaves covered.
const OCTAVES: i64 = 34;

impl Default for LogHistogram {
    fn default() -> Self {
        LogHistogram {
            bins: vec![0; (OCTAVES << MANTISSA_BITS) as usize + 1],
            count: 0,
            sum: 0.0,
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
        (key as usize).min((OCTAVES << MANTISSA_BITS) as usize)
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

    pub fn observe(&mut self, v: f64) {
        if v.is_finite() {
            self.bins[Self::bin(v)] += 1;
            self.count += 1;
            self.sum += v;
        }
    }

    fn quantile(&self, q: f64) -> Option<f64> {
        let last = self.count.checked_sub(1)?;
        // The sample of rank ⌊q·(n−1)⌋, as `percentile` starts from.
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

    /// Percentiles to the bins' resolution; the mean is exact.
    pub fn latency(&self) -> Latency {
        Latency {
            p50: self.quantile(0.50),
            p90: self.quantile(0.90),
            p99: self.quantile(0.99),
            mean: (self.count > 0).then(|| self.sum / self.count as f64),
            count: usize::try_from(self.count).unwrap_or(usize::MAX),
        }
    }
}

/// Fleet counters summed over the pods, read at a step's boundaries.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FleetCounters {
    pub preemptions: u64,
    pub lora_loads_disk: u64,
    pub lora_loads_host: u64,
    pub prefix_hits: u64,
    pub prefix_queries: u64,
}

/// One step (or the warm-up) being measured.
#[derive(Debug, Clone, Default)]
pub struct StepAcc {
    /// Offered rate, requests per simulated second (scaled to the fleet).
    pub rate: f64,
    /// Planned arrivals, simulated seconds.
    pub duration_s: f64,
    /// Virtual seconds at the step's start and at its last response.
    pub start_s: f64,
    pub end_s: f64,
    pub planned: usize,
    pub dropped: usize,
    pub ok: usize,
    pub errors_by_kind: BTreeMap<String, usize>,
    pub status_counts: BTreeMap<String, usize>,
    pub ttft: Vec<f64>,
    pub e2e: Vec<f64>,
    pub tpot: Vec<f64>,
    pub itl: LogHistogram,
    pub tokens: Tokens,
    pub per_pod: Vec<usize>,
    /// Requests of this step not yet ended.
    pub open: usize,
    pub counters_start: FleetCounters,
    pub counters_end: FleetCounters,
    /// Per fleet sample inside the step: (max − min) KV use, and the mean KV use.
    pub spreads: Vec<f64>,
    pub usage_sum: f64,
    pub usage_n: usize,
}

impl StepAcc {
    pub fn new(rate: f64, duration_s: f64, pods: usize) -> StepAcc {
        StepAcc {
            rate,
            duration_s,
            per_pod: vec![0; pods],
            ..StepAcc::default()
        }
    }

    /// A request that failed, with the HTTP status it got if any.
    pub fn error(&mut self, kind: ErrorKind, status: Option<u16>) {
        if kind == ErrorKind::Dropped {
            self.dropped += 1;
        }
        *self
            .errors_by_kind
            .entry(kind.as_str().to_string())
            .or_insert(0) += 1;
        if let Some(s) = status {
            *self.status_counts.entry(s.to_string()).or_insert(0) += 1;
        }
    }

    /// A request that streamed `tokens` tokens to the end.
    pub fn success(
        &mut self,
        pod: usize,
        ttft: f64,
        e2e: f64,
        tokens: u32,
        prompt: u32,
        cached: u32,
    ) {
        self.ok += 1;
        *self.status_counts.entry("200".to_string()).or_insert(0) += 1;
        if let Some(n) = self.per_pod.get_mut(pod) {
            *n += 1;
        }
        self.ttft.push(ttft);
        self.e2e.push(e2e);
        if tokens > 1 {
            self.tpot.push((e2e - ttft) / f64::from(tokens - 1));
        }
        self.tokens.output += u64::from(tokens);
        self.tokens.prompt += u64::from(prompt);
        self.tokens.cached += u64::from(cached);
    }

    /// A fleet sample taken during the step.
    pub fn sample(&mut self, kv_usages: &[f64]) {
        self.spreads.extend(kv_spread(kv_usages));
        self.usage_sum += kv_usages.iter().sum::<f64>();
        self.usage_n += kv_usages.len();
    }

    /// The load generator's statistics of the step.
    pub fn report(&self) -> StepReport {
        let errors: usize = self.errors_by_kind.values().sum();
        let elapsed_s = self.end_s - self.start_s;
        let per_s = |n: f64| if elapsed_s > 0.0 { n / elapsed_s } else { 0.0 };
        let ttft = Latency::of(self.ttft.clone());
        StepReport {
            rate: self.rate,
            duration_s: self.duration_s,
            elapsed_s,
            requests: Counts {
                planned: self.planned,
                sent: self.planned - self.dropped,
                ok: self.ok,
                errors,
                dropped: self.dropped,
                // No gateway queue in the simulation: nothing is shed.
                shed: 0,
            },
            errors,
            errors_by_kind: self.errors_by_kind.clone(),
            shed_by_reason: BTreeMap::new(),
            status_counts: self.status_counts.clone(),
            throughput: Throughput {
                requests_per_s: per_s(self.ok as f64),
                output_tokens_per_s: per_s(self.tokens.output as f64),
                // Request end times are not kept.
                steady_requests_per_s: None,
            },
            tokens: self.tokens,
            ttft_s: ttft,
            pod_ttft_s: ttft,
            // No path outside the pods in a simulation: nothing to report.
            path_s: Latency::default(),
            ttft_real_scale_s: ttft,
            itl_s: self.itl.latency(),
            tpot_s: Latency::of(self.tpot.clone()),
            e2e_s: Latency::of(self.e2e.clone()),
            per_pod: self
                .per_pod
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(i, n)| (i.to_string(), *n))
                .collect(),
            // Not kept per class: the simulation models no flow control, which is what
            // the per-class statistics are for.
            by_class: BTreeMap::new(),
            by_objective: BTreeMap::new(),
            by_tenant: BTreeMap::new(),
            records: None,
        }
    }

    /// The fleet's activity during the step.
    pub fn window(&self) -> WindowStats {
        window_of(
            self.counters_start,
            self.counters_end,
            &self.spreads,
            self.usage_sum,
            self.usage_n,
        )
    }
}

/// Fleet activity between two counter readings, with the KV samples taken between them.
pub fn window_of(
    a: FleetCounters,
    b: FleetCounters,
    spreads: &[f64],
    usage_sum: f64,
    usage_n: usize,
) -> WindowStats {
    window_between(a.into(), b.into(), spreads, usage_sum, usage_n)
}

impl From<FleetCounters> for Totals {
    fn from(c: FleetCounters) -> Totals {
        Totals {
            preemptions: c.preemptions as f64,
            prefix_hits: c.prefix_hits as f64,
            prefix_queries: c.prefix_queries as f64,
            lora_loads_disk: c.lora_loads_disk as f64,
            lora_loads_host: c.lora_loads_host as f64,
        }
    }
}

/// Percentiles of exact values (kept for tests of the histogram).
#[cfg(test)]
fn exact(mut v: Vec<f64>, q: f64) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    crate::loadgen::report::percentile(&v, q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_percentiles_are_within_half_a_percent_of_the_exact_ones() {
        let values: Vec<f64> = (1..=5000).map(|i| 0.001 * f64::from(i).powf(1.3)).collect();
        let mut h = LogHistogram::default();
        for &v in &values {
            h.observe(v);
        }
        let l = h.latency();
        for (q, got) in [(0.5, l.p50), (0.9, l.p90), (0.99, l.p99)] {
            let want = exact(values.clone(), q).expect("values");
            let got = got.expect("observed");
            assert!((got / want - 1.0).abs() < 0.006, "q {q}: {got} vs {want}");
        }
        assert_eq!(l.count, 5000);
        let mean = values.iter().sum::<f64>() / 5000.0;
        assert!((l.mean.expect("mean") - mean).abs() < 1e-9);
        assert_eq!(LogHistogram::default().latency().p50, None);
    }

    #[test]
    fn a_step_reports_what_its_requests_did() {
        let mut s = StepAcc::new(2.0, 10.0, 3);
        s.planned = 4;
        s.start_s = 5.0;
        s.end_s = 15.0;
        s.success(1, 0.1, 1.1, 11, 100, 40);
        s.success(1, 0.3, 2.3, 21, 100, 0);
        s.error(ErrorKind::Dropped, None);
        s.error(ErrorKind::Timeout, None);
        let r = s.report();
        assert_eq!(
            r.requests,
            Counts {
                planned: 4,
                sent: 3,
                ok: 2,
                errors: 2,
                dropped: 1,
                shed: 0
            }
        );
        assert_eq!(r.throughput.requests_per_s, 0.2);
        assert_eq!(r.tokens.output, 32);
        assert_eq!(r.per_pod.get("1"), Some(&2));
        assert!((r.tpot_s.p50.expect("tpot") - 0.1).abs() < 1e-9);
        assert_eq!(r.ttft_real_scale_s.p90, r.ttft_s.p90);
    }
}
