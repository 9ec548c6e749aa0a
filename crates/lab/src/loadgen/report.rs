//! Per-request records → per-step statistics → the JSON report. Pure.
//!
//! A request ends one of three ways: completed, shed by the gateway (429/503 with a dropped
//! reason; counted by reason), or failed (an error, by kind). Latency statistics and
//! throughput are over completed requests; percentiles interpolate linearly between the
//! sorted values (numpy's default). All times are simulated seconds. Besides the step's
//! totals, each step has the same statistics per class, per objective and per tenant
//! ([`GroupStats`]).

use std::collections::BTreeMap;

use serde::Serialize;

use super::client::{ErrorKind, Outcome};

/// Format version of the JSON report.
/// 2: shed requests (`shed`, `shed_by_reason`; no longer `http` errors), per-class,
/// per-objective and per-tenant statistics, `objective` and `tenant` in records.
/// 3: `ttft_p90_all_s` in each step (the p90 TTFT with shed and failed requests last).
pub const REPORT_VERSION: u32 = 3;

/// One request as sent and measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Record {
    /// Position in the step.
    pub index: usize,
    /// Workload class name.
    pub class: String,
    /// Objective sent (`x-gateway-inference-objective`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objective: Option<String>,
    /// Tenant sent (`x-gateway-inference-fairness-id`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
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
    /// Whether it completed (neither failed nor shed).
    pub fn ok(&self) -> bool {
        self.outcome.completed()
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
    pub fn of(values: Vec<f64>) -> Latency {
        Latency::of_sorted(&sorted_finite(values))
    }

    /// Statistics of finite values in ascending order ([`sorted_finite`]).
    pub fn of_sorted(values: &[f64]) -> Latency {
        let mean = (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64);
        Latency {
            p50: percentile(values, 0.50),
            p90: percentile(values, 0.90),
            p99: percentile(values, 0.99),
            mean,
            count: values.len(),
        }
    }
}

/// The finite values of `values`, in ascending order.
pub fn sorted_finite(mut values: Vec<f64>) -> Vec<f64> {
    values.retain(|v| v.is_finite());
    values.sort_by(f64::total_cmp);
    values
}

/// The `q` quantile of sorted values, interpolating linearly; None when empty.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    percentile_counting_unserved(sorted, 0, q)
}

/// The `q` quantile of a step's requests when every request not served (shed, failed or
/// never sent) counts as slower than every served one: `served` sorted, `unserved` more
/// beyond them. None where the quantile reaches an unserved request, or nothing was
/// planned. A router that refuses part of its load shortens the tail of what it serves;
/// over all requests, refusing is no faster than serving late.
pub fn percentile_counting_unserved(served: &[f64], unserved: usize, q: f64) -> Option<f64> {
    let last = (served.len() + unserved).checked_sub(1)?;
    let pos = q.clamp(0.0, 1.0) * last as f64;
    if pos.ceil() as usize >= served.len() {
        return None;
    }
    let lo = pos.floor() as usize;
    let frac = pos - lo as f64;
    let hi = pos.ceil() as usize;
    Some(served[lo] + (served[hi] - served[lo]) * frac)
}

/// Request counts of a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Requests the step planned.
    pub planned: usize,
    /// Requests sent (planned − dropped).
    pub sent: usize,
    /// Requests that completed.
    pub ok: usize,
    /// Requests that failed, dropped included.
    pub errors: usize,
    /// Requests not sent because `max_concurrency` were in flight.
    pub dropped: usize,
    /// Requests the gateway shed (planned = ok + errors + shed).
    pub shed: usize,
}

/// The statistics of one group of a step's requests: a class, an objective or a tenant.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GroupStats {
    /// Requests planned.
    pub planned: usize,
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Requests the gateway shed.
    pub shed: usize,
    /// Shed requests by the gateway's reason.
    pub shed_by_reason: BTreeMap<String, usize>,
    /// Completed requests per simulated second of the step's elapsed time.
    pub requests_per_s: f64,
    /// Time to first token of completed requests, from the moment the client sent them
    /// (wall clock × speedup, so a wait in a gateway's queue counts in simulated time).
    pub ttft_s: Latency,
    /// Time to first token at real scale (see [`Outcome::ttft_real_scale_s`]): the router's
    /// path counted once, unscaled, and a gateway's queue wait (reported in `server-timing`)
    /// in simulated time. Against a sped-up simulator `ttft_s` overstates the router's own
    /// CPU time tenfold; at speedup 1 they agree.
    pub ttft_real_scale_s: Latency,
    /// The pod's own TTFT of completed requests (see [`Outcome::pod_ttft_s`]): with
    /// `path_s`, it tells a group's slower TTFT at busier pods from one on a slower path.
    pub pod_ttft_s: Latency,
    /// Wall time outside the pod before the first token (see [`Outcome::path_s`]).
    pub path_s: Latency,
    /// The gateway's hold of completed requests, in simulated time (see
    /// [`Outcome::queue_s`]; 0 for a request it did not hold).
    pub queue_s: Latency,
    /// End to end of completed requests.
    pub e2e_s: Latency,
}

/// A [`GroupStats`] being filled.
#[derive(Debug, Default)]
struct GroupAcc {
    stats: GroupStats,
    ttft: Vec<f64>,
    real_scale: Vec<f64>,
    pod_ttft: Vec<f64>,
    path: Vec<f64>,
    queue: Vec<f64>,
    e2e: Vec<f64>,
}

impl GroupAcc {
    fn add(&mut self, o: &Outcome) {
        let s = &mut self.stats;
        s.planned += 1;
        if let Some(reason) = &o.shed_reason {
            s.shed += 1;
            *s.shed_by_reason.entry(reason.clone()).or_insert(0) += 1;
        } else if o.error_kind.is_some() {
            s.errors += 1;
        } else {
            s.completed += 1;
            self.ttft.extend(o.ttft_s);
            self.real_scale.extend(o.ttft_real_scale_s);
            self.pod_ttft.extend(o.pod_ttft_s);
            self.path.extend(o.path_s);
            if o.ttft_s.is_some() {
                self.queue.push(o.queue_s.unwrap_or(0.0));
            }
            self.e2e.extend(o.e2e_s);
        }
    }

    fn finish(self, elapsed_s: f64) -> GroupStats {
        GroupStats {
            requests_per_s: if elapsed_s > 0.0 {
                self.stats.completed as f64 / elapsed_s
            } else {
                0.0
            },
            ttft_s: Latency::of(self.ttft),
            ttft_real_scale_s: Latency::of(self.real_scale),
            pod_ttft_s: Latency::of(self.pod_ttft),
            path_s: Latency::of(self.path),
            queue_s: Latency::of(self.queue),
            e2e_s: Latency::of(self.e2e),
            ..self.stats
        }
    }
}

fn finish_groups(
    groups: BTreeMap<String, GroupAcc>,
    elapsed_s: f64,
) -> BTreeMap<String, GroupStats> {
    groups
        .into_iter()
        .map(|(k, g)| (k, g.finish(elapsed_s)))
        .collect()
}

/// Throughput: completed requests only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Throughput {
    /// Completed requests per simulated second of the step's elapsed time (from its start
    /// to its last response, so the drain of the last arrivals' outputs is included).
    pub requests_per_s: f64,
    /// Output tokens of completed requests per simulated second of the elapsed time.
    pub output_tokens_per_s: f64,
    /// Completed requests that ended in the second half of the step's arrivals
    /// (`duration_s / 2` to `duration_s` after its start), per simulated second: the rate
    /// a loaded fleet sustains, without the ramp-up and the drain. None when the records
    /// do not say when requests were sent.
    pub steady_requests_per_s: Option<f64>,
}

/// Completed requests that ended in `[duration_s / 2, duration_s]` (simulated seconds since
/// the step started: sent + end to end), per simulated second.
pub fn steady_rate(records: &[Record], duration_s: f64) -> Option<f64> {
    if !(duration_s.is_finite() && duration_s > 0.0) {
        return None;
    }
    let (from, to) = (duration_s / 2.0, duration_s);
    let ended = records
        .iter()
        .filter(|r| r.ok())
        .filter_map(|r| Some(r.sent_s + r.outcome.e2e_s?))
        .filter(|end| (from..=to).contains(end))
        .count();
    Some(ended as f64 / (to - from))
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
    /// Shed requests by the gateway's reason.
    pub shed_by_reason: BTreeMap<String, usize>,
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
    /// p90 TTFT (at real scale where measured) over every planned request, those not
    /// served counted as slower than any served ([`percentile_counting_unserved`]); None
    /// where the p90 falls on an unserved request.
    pub ttft_p90_all_s: Option<f64>,
    /// Inter-token latency (gaps between text events).
    pub itl_s: Latency,
    /// Time per output token after the first: `(e2e − ttft) / (tokens − 1)`.
    pub tpot_s: Latency,
    /// End to end.
    pub e2e_s: Latency,
    /// Successful requests per serving pod (`x-sim-pod`); absent header: not counted.
    pub per_pod: BTreeMap<String, usize>,
    /// Per class (by name).
    pub by_class: BTreeMap<String, GroupStats>,
    /// Per objective sent (requests without one are in no entry).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub by_objective: BTreeMap<String, GroupStats>,
    /// Per tenant sent (requests without one are in no entry).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub by_tenant: BTreeMap<String, GroupStats>,
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
        let mut shed_by_reason = BTreeMap::new();
        let mut status_counts = BTreeMap::new();
        let mut by_class: BTreeMap<String, GroupAcc> = BTreeMap::new();
        let mut by_objective: BTreeMap<String, GroupAcc> = BTreeMap::new();
        let mut by_tenant: BTreeMap<String, GroupAcc> = BTreeMap::new();
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
            by_class.entry(r.class.clone()).or_default().add(o);
            if let Some(objective) = &r.objective {
                by_objective.entry(objective.clone()).or_default().add(o);
            }
            if let Some(tenant) = &r.tenant {
                by_tenant.entry(tenant.clone()).or_default().add(o);
            }
            if let Some(reason) = &o.shed_reason {
                counts.shed += 1;
                *shed_by_reason.entry(reason.clone()).or_insert(0) += 1;
                continue;
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
        let (ttft, real_scale) = (sorted_finite(ttft), sorted_finite(real_scale));
        // The TTFT the comparison reads: at real scale where the pods time it.
        let basis = if real_scale.is_empty() {
            &ttft
        } else {
            &real_scale
        };
        let ttft_p90_all_s = percentile_counting_unserved(basis, counts.planned - counts.ok, 0.90);
        let per_s = |n: f64| if elapsed_s > 0.0 { n / elapsed_s } else { 0.0 };
        StepReport {
            rate,
            duration_s,
            elapsed_s,
            requests: counts,
            errors: counts.errors,
            errors_by_kind,
            shed_by_reason,
            status_counts,
            throughput: Throughput {
                requests_per_s: per_s(counts.ok as f64),
                output_tokens_per_s: per_s(tokens.output as f64),
                steady_requests_per_s: steady_rate(&records, duration_s),
            },
            tokens,
            ttft_s: Latency::of_sorted(&ttft),
            pod_ttft_s: Latency::of(pod_ttft),
            path_s: Latency::of(path),
            ttft_real_scale_s: Latency::of_sorted(&real_scale),
            ttft_p90_all_s,
            itl_s: Latency::of(itl),
            tpot_s: Latency::of(tpot),
            e2e_s: Latency::of(e2e),
            per_pod,
            by_class: finish_groups(by_class, elapsed_s),
            by_objective: finish_groups(by_objective, elapsed_s),
            by_tenant: finish_groups(by_tenant, elapsed_s),
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
    /// A Markdown table of the steps, for the terminal; then, when requests carried
    /// objectives or tenants, one of each objective's and tenant's statistics.
    pub fn table(&self) -> String {
        let mut s = String::from(
            "| rate/s | ok | shed | errors | req/s | tok/s | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | e2e p90 |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        let f = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.3}"));
        for st in &self.steps {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {:.2} | {:.0} | {} | {} | {} | {} | {} | {} |\n",
                st.rate,
                st.requests.ok,
                st.requests.shed,
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
        if self
            .steps
            .iter()
            .any(|st| !st.by_objective.is_empty() || !st.by_tenant.is_empty())
        {
            s.push_str(
                "\n| rate/s | group | ok/planned | shed | errors | req/s | TTFT p50 | TTFT p90 | e2e p90 |\n|---|---|---|---|---|---|---|---|---|\n",
            );
            for st in &self.steps {
                for (label, g) in st.groups() {
                    s.push_str(&format!(
                        "| {} | {label} | {}/{} | {} | {} | {:.2} | {} | {} | {} |\n",
                        st.rate,
                        g.completed,
                        g.planned,
                        g.shed,
                        g.errors,
                        g.requests_per_s,
                        f(g.ttft_s.p50),
                        f(g.ttft_s.p90),
                        f(g.e2e_s.p90),
                    ));
                }
            }
        }
        s
    }
}

impl StepReport {
    /// The objectives' then the tenants' statistics, labelled `objective X` / `tenant Y`.
    pub fn groups(&self) -> impl Iterator<Item = (String, &GroupStats)> {
        let objectives = self
            .by_objective
            .iter()
            .map(|(k, g)| (format!("objective {k}"), g));
        let tenants = self
            .by_tenant
            .iter()
            .map(|(k, g)| (format!("tenant {k}"), g));
        objectives.chain(tenants)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(index: usize, outcome: Outcome) -> Record {
        Record {
            index,
            class: "c".into(),
            objective: None,
            tenant: None,
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
                dropped: 1,
                shed: 0
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

    #[test]
    fn the_p90_of_all_requests_counts_the_unserved_as_slowest() {
        let served: Vec<f64> = (1..=20).map(f64::from).collect();
        // Nothing unserved: the plain percentile.
        assert_eq!(
            percentile_counting_unserved(&served, 0, 0.9),
            percentile(&served, 0.9)
        );
        // 2 of 22 unserved: position 18.9 of 0..=21, between the 19th and 20th served.
        let p = percentile_counting_unserved(&served, 2, 0.9).expect("p90 served");
        assert!((p - 19.9).abs() < 1e-9, "{p}");
        assert!(p > percentile(&served, 0.9).expect("p90"));
        // 3 of 23 unserved: position 19.8 reaches past the last served one.
        assert_eq!(percentile_counting_unserved(&served, 3, 0.9), None);
        assert_eq!(percentile_counting_unserved(&[], 1, 0.9), None);
        assert_eq!(percentile_counting_unserved(&[], 0, 0.9), None);
    }

    #[test]
    fn a_step_reads_its_shed_and_failed_requests_into_the_p90_of_all() {
        // 18 served at 1 s..18 s, one shed and one failed: p90 of all at position 17.1
        // of 0..=19, between 18 s and the first unserved one.
        let mut records: Vec<Record> = (1..=18)
            .map(|i| record(i, completed(f64::from(i as u32), 20.0)))
            .collect();
        records.push(record(19, shed(429, "rejected-ttl-expired")));
        records.push(record(20, Outcome::failed(ErrorKind::Http, "503")));
        let s = StepReport::new(1.0, 20.0, 21.0, records.clone(), false);
        assert_eq!(s.ttft_p90_all_s, None);
        // One unserved of 19: position 16.2, between 17 s and 18 s.
        records.pop();
        let s = StepReport::new(1.0, 20.0, 21.0, records, false);
        let p = s.ttft_p90_all_s.expect("p90 of all");
        assert!((p - 17.2).abs() < 1e-9, "{p}");
        assert!(p > s.ttft_s.p90.expect("p90"));
    }

    fn completed(ttft: f64, e2e: f64) -> Outcome {
        Outcome {
            status: Some(200),
            ttft_s: Some(ttft),
            e2e_s: Some(e2e),
            output_tokens: Some(4),
            text_events: 4,
            ..Outcome::default()
        }
    }

    fn shed(status: u16, reason: &str) -> Outcome {
        Outcome {
            status: Some(status),
            e2e_s: Some(0.01),
            shed_reason: Some(reason.into()),
            ..Outcome::default()
        }
    }

    fn of(class: &str, objective: &str, tenant: Option<&str>, outcome: Outcome) -> Record {
        Record {
            class: class.into(),
            objective: Some(objective.into()),
            tenant: tenant.map(str::to_owned),
            ..record(0, outcome)
        }
    }

    #[test]
    fn shed_requests_are_counted_by_reason_apart_from_completions_and_errors() {
        let records = vec![
            of("a", "critical", None, completed(0.2, 1.0)),
            of("b", "sheddable", None, shed(429, "rejected-saturated")),
            of("b", "sheddable", None, shed(429, "rejected-saturated")),
            of("b", "sheddable", None, shed(503, "rejected-shutting-down")),
            of("b", "sheddable", None, {
                // A 429 without the dropped-reason header stays an error.
                Outcome {
                    status: Some(429),
                    ..Outcome::failed(ErrorKind::Http, "429")
                }
            }),
        ];
        let s = StepReport::new(5.0, 1.0, 2.0, records, false);
        assert_eq!(
            (s.requests.ok, s.requests.shed, s.requests.errors),
            (1, 3, 1)
        );
        assert_eq!(s.errors, 1);
        assert_eq!(s.errors_by_kind["http"], 1);
        assert_eq!(s.shed_by_reason["rejected-saturated"], 2);
        assert_eq!(s.shed_by_reason["rejected-shutting-down"], 1);
        assert_eq!(s.status_counts["429"], 3);
        // Throughput and latencies count the completed request only.
        assert_eq!(s.throughput.requests_per_s, 0.5);
        assert_eq!(s.e2e_s.count, 1);
        assert_eq!(s.ttft_s.p50, Some(0.2));
        let b = &s.by_class["b"];
        assert_eq!((b.planned, b.completed, b.shed, b.errors), (4, 0, 3, 1));
        assert_eq!(b.ttft_s.count, 0);
        assert_eq!(
            s.by_objective["sheddable"].shed_by_reason["rejected-saturated"],
            2
        );
        assert!(s.by_tenant.is_empty());
    }

    #[test]
    fn each_objective_and_tenant_gets_its_own_latencies() {
        let mut records = Vec::new();
        for i in 0..10 {
            let t = f64::from(i);
            records.push(of(
                "q",
                "standard",
                Some("quiet"),
                completed(0.1 * (t + 1.0), 2.0),
            ));
            records.push(of("n", "standard", Some("noisy"), completed(1.0 + t, 5.0)));
        }
        let s = StepReport::new(2.0, 10.0, 10.0, records, false);
        let quiet = &s.by_tenant["quiet"];
        assert_eq!((quiet.planned, quiet.completed), (10, 10));
        assert!((quiet.ttft_s.p90.expect("p90") - 0.91).abs() < 1e-9);
        assert!((s.by_tenant["noisy"].ttft_s.p90.expect("p90") - 9.1).abs() < 1e-9);
        assert_eq!(quiet.requests_per_s, 1.0);
        assert_eq!(s.by_objective["standard"].completed, 20);
        assert_eq!(s.by_class.len(), 2);
        let labels: Vec<String> = s.groups().map(|(l, _)| l).collect();
        assert_eq!(
            labels,
            ["objective standard", "tenant noisy", "tenant quiet"]
        );
    }

    #[test]
    fn steady_throughput_counts_completions_in_the_second_half_of_the_arrivals() {
        let at = |sent: f64, e2e: f64| Record {
            sent_s: sent,
            ..record(0, completed(0.1, e2e))
        };
        let records = vec![
            at(0.0, 4.0), // ends at 4: first half
            at(3.0, 3.0), // ends at 6
            at(8.0, 1.0), // ends at 9
            at(9.0, 2.0), // ends at 11: after the arrivals
            Record {
                sent_s: 6.0,
                ..record(0, shed(429, "rejected-saturated"))
            },
        ];
        assert_eq!(steady_rate(&records, 10.0), Some(0.4));
        assert_eq!(steady_rate(&records, 0.0), None);
        let s = StepReport::new(1.0, 10.0, 11.0, records, false);
        assert_eq!(s.throughput.steady_requests_per_s, Some(0.4));
    }

    #[test]
    fn the_terminal_table_lists_groups_only_when_requests_carried_them() {
        let plain = StepReport::new(1.0, 1.0, 1.0, vec![record(0, completed(0.1, 1.0))], false);
        let tagged = StepReport::new(
            2.0,
            1.0,
            1.0,
            vec![of("a", "critical", Some("t1"), completed(0.1, 1.0))],
            false,
        );
        let report = |steps| Report {
            version: REPORT_VERSION,
            workload: "w".into(),
            target: String::new(),
            endpoint: String::new(),
            seed: 0,
            speedup: 1.0,
            max_concurrency: 1,
            started_unix: 0.0,
            wall_s: 0.0,
            steps,
        };
        assert!(!report(vec![plain.clone()]).table().contains("objective"));
        let table = report(vec![plain, tagged]).table();
        assert!(
            table.contains("| 2 | objective critical | 1/1 | 0 | 0 |"),
            "{table}"
        );
        assert!(table.contains("| 2 | tenant t1 |"), "{table}");
    }
}
