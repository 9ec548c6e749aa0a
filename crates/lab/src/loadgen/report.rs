//! Per-request records → per-step statistics → the JSON report. Pure.
//!
//! Latency statistics are over the requests that succeeded; percentiles interpolate linearly
//! between the sorted values (numpy's default). All times are simulated seconds.

use std::collections::BTreeMap;

use serde::Serialize;

use super::client::{ErrorKind, Outcome};

/// Format version of the JSON report.
pub const REPORT_VERSION: u32 = 1;

/// One request as sent and measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Record {
    /// Position in the step.
    pub index: usize,
    /// Workload class name.
    pub class: String,
    /// `model` sent.
    pub model: String,
    /// Prompt tokens planned (simulator tokenizer).
    pub planned_prompt_tokens: u32,
    /// `max_tokens` sent.
    pub max_tokens: u32,
    /// Planned arrival since the step started.
    pub scheduled_s: f64,
    /// When it was actually sent (or dropped).
    pub sent_s: f64,
    /// What came back.
    #[serde(flatten)]
    pub outcome: Outcome,
}

impl Record {
    /// Whether it succeeded.
    pub fn ok(&self) -> bool {
        self.outcome.error_kind.is_none()
    }
}

/// Percentiles of a latency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Latency {
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
    /// Mean.
    pub mean: Option<f64>,
    /// Observations.
    pub count: usize,
}

impl Latency {
    /// Statistics of `values` (any order).
    pub fn of(mut values: Vec<f64>) -> Latency {
        values.retain(|v| v.is_finite());
        values.sort_by(f64::total_cmp);
        let mean = (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64);
        Latency {
            p50: percentile(&values, 0.50),
            p90: percentile(&values, 0.90),
            p99: percentile(&values, 0.99),
            mean,
            count: values.len(),
        }
    }
}

/// The `q` quantile of sorted values, interpolating linearly; None when empty.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let pos = q.clamp(0.0, 1.0) * last as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let frac = pos - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

/// Request counts of a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Requests the step planned.
    pub planned: usize,
    /// Requests sent (planned − dropped).
    pub sent: usize,
    /// Requests that succeeded.
    pub ok: usize,
    /// Requests that failed, dropped included.
    pub errors: usize,
    /// Requests not sent because `max_concurrency` were in flight.
    pub dropped: usize,
}

/// Throughput over the step's elapsed time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Throughput {
    /// Successful requests per simulated second.
    pub requests_per_s: f64,
    /// Output tokens of successful requests per simulated second.
    pub output_tokens_per_s: f64,
}

/// Token totals of the successful requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tokens {
    /// Output tokens (usage, else text events).
    pub output: u64,
    /// Prompt tokens (usage).
    pub prompt: u64,
    /// Prompt tokens served from the prefix cache (usage).
    pub cached: u64,
}

/// One step of the ladder.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    /// Offered rate, requests per simulated second.
    pub rate: f64,
    /// Planned length of the arrivals (simulated seconds).
    pub duration_s: f64,
    /// From the step's start to its last response (simulated seconds).
    pub elapsed_s: f64,
    /// Request counts.
    pub requests: Counts,
    /// Failed requests (= `requests.errors`).
    pub errors: usize,
    /// Failed requests by kind.
    pub errors_by_kind: BTreeMap<String, usize>,
    /// Responses by HTTP status.
    pub status_counts: BTreeMap<String, usize>,
    /// Throughput.
    pub throughput: Throughput,
    /// Token totals.
    pub tokens: Tokens,
    /// Time to first token.
    pub ttft_s: Latency,
    /// Time to first token as the pods timed it (simulator only; see
    /// [`Outcome::pod_ttft_s`]).
    pub pod_ttft_s: Latency,
    /// Wall time outside the pod before the first token (see [`Outcome::path_s`]).
    pub path_s: Latency,
    /// Time to first token at real scale (see [`Outcome::ttft_real_scale_s`]).
    pub ttft_real_scale_s: Latency,
    /// Inter-token latency (gaps between text events).
    pub itl_s: Latency,
    /// Time per output token after the first: `(e2e − ttft) / (tokens − 1)`.
    pub tpot_s: Latency,
    /// End to end.
    pub e2e_s: Latency,
    /// Successful requests per serving pod (`x-sim-pod`); absent header: not counted.
    pub per_pod: BTreeMap<String, usize>,
    /// Every request, with `--raw`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub records: Option<Vec<Record>>,
}

impl StepReport {
    /// Statistics of one step's records.
    pub fn new(
        rate: f64,
        duration_s: f64,
        elapsed_s: f64,
        records: Vec<Record>,
        keep_raw: bool,
    ) -> StepReport {
        let mut counts = Counts {
            planned: records.len(),
            ..Counts::default()
        };
        let mut errors_by_kind = BTreeMap::new();
        let mut status_counts = BTreeMap::new();
        let mut per_pod = BTreeMap::new();
        let mut tokens = Tokens::default();
        let (mut ttft, mut itl, mut tpot, mut e2e) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut pod_ttft, mut path, mut real_scale) = (Vec::new(), Vec::new(), Vec::new());
        for r in &records {
            let o = &r.outcome;
            if let Some(s) = o.status {
                *status_counts.entry(s.to_string()).or_insert(0) += 1;
            }
            match o.error_kind {
                Some(kind) => {
                    counts.errors += 1;
                    if kind == ErrorKind::Dropped {
                        counts.dropped += 1;
                    }
                    *errors_by_kind.entry(kind.as_str().to_string()).or_insert(0) += 1;
                    continue;
                }
                None => counts.ok += 1,
            }
            if let Some(pod) = &o.pod {
                *per_pod.entry(pod.clone()).or_insert(0) += 1;
            }
            tokens.output += u64::from(o.tokens());
            tokens.prompt += u64::from(o.prompt_tokens.unwrap_or(0));
            tokens.cached += u64::from(o.cached_tokens.unwrap_or(0));
            ttft.extend(o.ttft_s);
            pod_ttft.extend(o.pod_ttft_s);
            path.extend(o.path_s);
            real_scale.extend(o.ttft_real_scale_s);
            itl.extend_from_slice(&o.itl_s);
            e2e.extend(o.e2e_s);
            if let (Some(first), Some(end)) = (o.ttft_s, o.e2e_s)
                && o.tokens() > 1
            {
                tpot.push((end - first) / f64::from(o.tokens() - 1));
            }
        }
        counts.sent = counts.planned - counts.dropped;
        let per_s = |n: f64| if elapsed_s > 0.0 { n / elapsed_s } else { 0.0 };
        StepReport {
            rate,
            duration_s,
            elapsed_s,
            requests: counts,
            errors: counts.errors,
            errors_by_kind,
            status_counts,
            throughput: Throughput {
                requests_per_s: per_s(counts.ok as f64),
                output_tokens_per_s: per_s(tokens.output as f64),
            },
            tokens,
            ttft_s: Latency::of(ttft),
            pod_ttft_s: Latency::of(pod_ttft),
            path_s: Latency::of(path),
            ttft_real_scale_s: Latency::of(real_scale),
            itl_s: Latency::of(itl),
            tpot_s: Latency::of(tpot),
            e2e_s: Latency::of(e2e),
            per_pod,
            records: keep_raw.then_some(records),
        }
    }
}

/// The whole run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// [`REPORT_VERSION`].
    pub version: u32,
    /// Workload name.
    pub workload: String,
    /// Base URL driven.
    pub target: String,
    /// Endpoint path used.
    pub endpoint: String,
    /// Generator seed.
    pub seed: u64,
    /// Clock factor the times were scaled by.
    pub speedup: f64,
    /// Safety bound on requests in flight.
    pub max_concurrency: usize,
    /// Unix time the run started.
    pub started_unix: f64,
    /// Wall-clock seconds the run took.
    pub wall_s: f64,
    /// The ladder.
    pub steps: Vec<StepReport>,
}

impl Report {
    /// A Markdown table of the steps, for the terminal.
    pub fn table(&self) -> String {
        let mut s = String::from(
            "| rate/s | ok | errors | req/s | tok/s | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | e2e p90 |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        let f = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.3}"));
        for st in &self.steps {
            s.push_str(&format!(
                "| {} | {} | {} | {:.2} | {:.0} | {} | {} | {} | {} | {} | {} |\n",
                st.rate,
                st.requests.ok,
                st.errors,
                st.throughput.requests_per_s,
                st.throughput.output_tokens_per_s,
                f(st.ttft_s.p50),
                f(st.ttft_s.p90),
                f(st.ttft_s.p99),
                f(st.itl_s.p50),
                f(st.itl_s.p90),
                f(st.e2e_s.p90),
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(index: usize, outcome: Outcome) -> Record {
        Record {
            index,
            class: "c".into(),
            model: "m".into(),
            planned_prompt_tokens: 10,
            max_tokens: 5,
            scheduled_s: 0.0,
            sent_s: 0.0,
            outcome,
        }
    }

    #[test]
    fn percentiles_interpolate_between_sorted_values() {
        let v: Vec<f64> = (1..=11).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(6.0));
        assert_eq!(percentile(&v, 0.9), Some(10.0));
        assert!((percentile(&v, 0.99).expect("p99") - 10.9).abs() < 1e-9);
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[3.0], 0.99), Some(3.0));
        let l = Latency::of(vec![2.0, f64::NAN, 1.0]);
        assert_eq!((l.count, l.p50, l.mean), (2, Some(1.5), Some(1.5)));
    }

    #[test]
    fn a_step_counts_errors_apart_and_measures_only_successes() {
        let ok = Outcome {
            status: Some(200),
            pod: Some("1".into()),
            ttft_s: Some(0.5),
            itl_s: vec![0.1, 0.1, 0.1, 0.1],
            e2e_s: Some(0.9),
            output_tokens: Some(5),
            prompt_tokens: Some(10),
            cached_tokens: Some(4),
            text_events: 5,
            ..Outcome::default()
        };
        let http = Outcome {
            status: Some(503),
            e2e_s: Some(0.01),
            ..Outcome::failed(ErrorKind::Http, "503")
        };
        let records = vec![
            record(0, ok.clone()),
            record(1, ok),
            record(2, http),
            record(3, Outcome::failed(ErrorKind::Dropped, "full")),
        ];
        let s = StepReport::new(2.0, 2.0, 4.0, records, false);
        assert_eq!(
            s.requests,
            Counts {
                planned: 4,
                sent: 3,
                ok: 2,
                errors: 2,
                dropped: 1
            }
        );
        assert_eq!(s.errors_by_kind["http"], 1);
        assert_eq!(s.errors_by_kind["dropped"], 1);
        assert_eq!(s.status_counts["200"], 2);
        assert_eq!(s.status_counts["503"], 1);
        assert_eq!(s.per_pod["1"], 2);
        assert_eq!(s.tokens.output, 10);
        assert_eq!(s.throughput.requests_per_s, 0.5);
        assert_eq!(s.throughput.output_tokens_per_s, 2.5);
        assert_eq!(s.ttft_s.p90, Some(0.5));
        assert_eq!(s.e2e_s.count, 2);
        assert!((s.tpot_s.p50.expect("tpot") - 0.1).abs() < 1e-9);
        assert!(s.records.is_none());
    }
}
