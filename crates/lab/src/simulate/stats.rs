//! What one ladder step of a simulation measured, accumulated as requests end, and turned
//! into the load generator's [`StepReport`] and the comparison's [`WindowStats`], so the
//! report code of `compare` renders simulated runs unchanged: totals, and the same
//! statistics per class, per objective and per tenant ([`GroupStats`]) with the load
//! generator's rules (shed requests counted by reason, apart from completions and errors;
//! latencies of completed requests only; a request without an objective or a tenant in no
//! objective's or tenant's entry).

use std::collections::BTreeMap;

use kvroute_sim::stats::LogHistogram;

use super::flow::DropReason;
use crate::compare::fleet_stats::{Totals, WindowStats, kv_spread, window_between};
use crate::loadgen::Workload;
use crate::loadgen::client::ErrorKind;
use crate::loadgen::report::{
    Counts, GroupStats, Latency, StepReport, Throughput, Tokens, percentile_counting_unserved,
    sorted_finite,
};

/// The load generator's latency record of a histogram's observations: percentiles to
/// the bins' resolution, the mean exact.
pub fn latency(h: &LogHistogram) -> Latency {
    Latency {
        p50: h.quantile(0.50),
        p90: h.quantile(0.90),
        p99: h.quantile(0.99),
        mean: h.mean_secs(),
        count: usize::try_from(h.count()).unwrap_or(usize::MAX),
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

/// The labels the load generator's records carry for each class, in class order: its name,
/// and the objective and tenant it sends (if any).
#[derive(Debug, Clone, Default)]
pub struct ClassLabels {
    names: Vec<String>,
    objectives: Vec<Option<String>>,
    tenants: Vec<Option<String>>,
}

impl ClassLabels {
    pub fn of(workload: &Workload) -> ClassLabels {
        let c = &workload.classes;
        ClassLabels {
            names: c.iter().map(|c| c.name.clone()).collect(),
            objectives: c.iter().map(|c| c.objective.clone()).collect(),
            tenants: c.iter().map(|c| c.tenant.clone()).collect(),
        }
    }
}

/// One class's requests of a step.
#[derive(Debug, Clone, Default)]
pub struct GroupAcc {
    pub planned: usize,
    pub completed: usize,
    pub errors: usize,
    pub shed: usize,
    pub shed_by_reason: BTreeMap<String, usize>,
    /// TTFT (the wait at the gateway included), the pod's own TTFT and e2e of completed
    /// requests.
    pub ttft: Vec<f64>,
    pub pod_ttft: Vec<f64>,
    /// The wait at the gateway of completed requests.
    pub queue: Vec<f64>,
    pub e2e: Vec<f64>,
}

impl GroupAcc {
    /// The statistics of these classes together, over `elapsed_s`.
    fn stats<'a>(groups: impl Iterator<Item = &'a GroupAcc> + Clone, elapsed_s: f64) -> GroupStats {
        let mut shed_by_reason = BTreeMap::new();
        for g in groups.clone() {
            for (reason, n) in &g.shed_by_reason {
                *shed_by_reason.entry(reason.clone()).or_insert(0) += n;
            }
        }
        let completed = groups.clone().map(|g| g.completed).sum::<usize>();
        // The latency of one of the samples each group keeps, over every group.
        let over_groups = |samples: fn(&GroupAcc) -> &Vec<f64>| {
            Latency::of(
                groups
                    .clone()
                    .flat_map(|g| samples(g).iter().copied())
                    .collect(),
            )
        };
        let ttft = over_groups(|g| &g.ttft);
        GroupStats {
            planned: groups.clone().map(|g| g.planned).sum(),
            completed,
            errors: groups.clone().map(|g| g.errors).sum(),
            shed: groups.clone().map(|g| g.shed).sum(),
            shed_by_reason,
            requests_per_s: if elapsed_s > 0.0 {
                completed as f64 / elapsed_s
            } else {
                0.0
            },
            ttft_s: ttft,
            // No path outside the pods: the client's TTFT is the one at real scale.
            ttft_real_scale_s: ttft,
            pod_ttft_s: over_groups(|g| &g.pod_ttft),
            path_s: Latency::default(),
            queue_s: over_groups(|g| &g.queue),
            e2e_s: over_groups(|g| &g.e2e),
        }
    }
}

/// A request that streamed to the end: times in simulated seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Completion {
    pub class: usize,
    pub pod: usize,
    /// Its wait at the gateway, before it was sent to its pod.
    pub waited: f64,
    /// TTFT and e2e as the pod timed them (from its arrival at the pod).
    pub pod_ttft: f64,
    pub pod_e2e: f64,
    pub tokens: u32,
    pub prompt: u32,
    pub cached: u32,
    /// When it ended (virtual time).
    pub end_s: f64,
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
    pub shed: usize,
    pub errors_by_kind: BTreeMap<String, usize>,
    pub shed_by_reason: BTreeMap<String, usize>,
    pub status_counts: BTreeMap<String, usize>,
    /// TTFT from the request's arrival at the gateway (its wait included), and at its pod.
    pub ttft: Vec<f64>,
    pub pod_ttft: Vec<f64>,
    pub e2e: Vec<f64>,
    pub tpot: Vec<f64>,
    pub itl: LogHistogram,
    pub tokens: Tokens,
    pub per_pod: Vec<usize>,
    /// Completed requests that ended in the second half of the step's arrivals.
    pub steady: usize,
    /// Per class, in class order.
    pub groups: Vec<GroupAcc>,
    /// Requests of this step not yet ended (held at the gateway or at a pod).
    pub open: usize,
    pub counters_start: FleetCounters,
    pub counters_end: FleetCounters,
    /// Per fleet sample inside the step: (max − min) KV use, and the mean KV use.
    pub spreads: Vec<f64>,
    pub usage_sum: f64,
    pub usage_n: usize,
}

impl StepAcc {
    pub fn new(rate: f64, duration_s: f64, pods: usize, classes: usize) -> StepAcc {
        StepAcc {
            rate,
            duration_s,
            per_pod: vec![0; pods],
            groups: vec![GroupAcc::default(); classes],
            ..StepAcc::default()
        }
    }

    fn group(&mut self, class: usize) -> &mut GroupAcc {
        if class >= self.groups.len() {
            self.groups.resize(class + 1, GroupAcc::default());
        }
        &mut self.groups[class]
    }

    /// A request of `class` arrived (planned).
    pub fn arrived(&mut self, class: usize) {
        self.planned += 1;
        self.group(class).planned += 1;
    }

    /// A request of `class` that failed, with the HTTP status it got if any.
    pub fn error(&mut self, class: usize, kind: ErrorKind, status: Option<u16>) {
        if kind == ErrorKind::Dropped {
            self.dropped += 1;
        }
        self.group(class).errors += 1;
        *self
            .errors_by_kind
            .entry(kind.as_str().to_string())
            .or_insert(0) += 1;
        if let Some(s) = status {
            *self.status_counts.entry(s.to_string()).or_insert(0) += 1;
        }
    }

    /// A request of `class` that the gateway's flow control refused or dropped.
    pub fn shed(&mut self, class: usize, reason: DropReason) {
        self.shed += 1;
        let status = reason.status().to_string();
        let reason = reason.as_str();
        let g = self.group(class);
        g.shed += 1;
        *g.shed_by_reason.entry(reason.to_string()).or_insert(0) += 1;
        *self.shed_by_reason.entry(reason.to_string()).or_insert(0) += 1;
        *self.status_counts.entry(status).or_insert(0) += 1;
    }

    /// A request that streamed its tokens to the end.
    pub fn success(&mut self, c: &Completion) {
        self.ok += 1;
        *self.status_counts.entry("200".to_string()).or_insert(0) += 1;
        if let Some(n) = self.per_pod.get_mut(c.pod) {
            *n += 1;
        }
        let (ttft, e2e) = (c.waited + c.pod_ttft, c.waited + c.pod_e2e);
        self.ttft.push(ttft);
        self.pod_ttft.push(c.pod_ttft);
        self.e2e.push(e2e);
        let g = self.group(c.class);
        g.completed += 1;
        g.ttft.push(ttft);
        g.pod_ttft.push(c.pod_ttft);
        g.queue.push(c.waited);
        g.e2e.push(e2e);
        if c.tokens > 1 {
            self.tpot
                .push((c.pod_e2e - c.pod_ttft) / f64::from(c.tokens - 1));
        }
        self.tokens.output += u64::from(c.tokens);
        self.tokens.prompt += u64::from(c.prompt);
        self.tokens.cached += u64::from(c.cached);
        let since_start = c.end_s - self.start_s;
        if (self.duration_s / 2.0..=self.duration_s).contains(&since_start) {
            self.steady += 1;
        }
    }

    /// A fleet sample taken during the step.
    pub fn sample(&mut self, kv_usages: &[f64]) {
        self.spreads.extend(kv_spread(kv_usages));
        self.usage_sum += kv_usages.iter().sum::<f64>();
        self.usage_n += kv_usages.len();
    }

    /// The load generator's statistics of the step; `labels` name its classes.
    pub fn report(&self, labels: &ClassLabels) -> StepReport {
        let errors: usize = self.errors_by_kind.values().sum();
        let elapsed_s = self.end_s - self.start_s;
        let per_s = |n: f64| if elapsed_s > 0.0 { n / elapsed_s } else { 0.0 };
        let sorted = sorted_finite(self.ttft.clone());
        let ttft = Latency::of_sorted(&sorted);
        let ttft_p90_all_s = percentile_counting_unserved(&sorted, self.planned - self.ok, 0.90);
        // As the load generator's `steady_rate`.
        let d = self.duration_s;
        let steady = (d.is_finite() && d > 0.0).then(|| self.steady as f64 / (d / 2.0));
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
                shed: self.shed,
            },
            errors,
            errors_by_kind: self.errors_by_kind.clone(),
            shed_by_reason: self.shed_by_reason.clone(),
            status_counts: self.status_counts.clone(),
            throughput: Throughput {
                requests_per_s: per_s(self.ok as f64),
                output_tokens_per_s: per_s(self.tokens.output as f64),
                steady_requests_per_s: steady,
            },
            tokens: self.tokens,
            ttft_s: ttft,
            pod_ttft_s: Latency::of(self.pod_ttft.clone()),
            // No path outside the pods in a simulation: nothing to report.
            path_s: Latency::default(),
            ttft_real_scale_s: ttft,
            ttft_p90_all_s,
            itl_s: latency(&self.itl),
            tpot_s: Latency::of(self.tpot.clone()),
            e2e_s: Latency::of(self.e2e.clone()),
            per_pod: self
                .per_pod
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(i, n)| (i.to_string(), *n))
                .collect(),
            by_class: self.grouped(elapsed_s, |i| labels.names.get(i)),
            by_objective: self.grouped(elapsed_s, |i| {
                labels.objectives.get(i).and_then(Option::as_ref)
            }),
            by_tenant: self.grouped(elapsed_s, |i| {
                labels.tenants.get(i).and_then(Option::as_ref)
            }),
            records: None,
        }
    }

    /// The classes' statistics gathered by `key` (classes without one, and keys no
    /// request of the step was planned for, in no entry).
    fn grouped<'l>(
        &self,
        elapsed_s: f64,
        key: impl Fn(usize) -> Option<&'l String>,
    ) -> BTreeMap<String, GroupStats> {
        let mut keys: BTreeMap<&String, Vec<&GroupAcc>> = BTreeMap::new();
        for (i, g) in self.groups.iter().enumerate() {
            if g.planned == 0 {
                continue;
            }
            if let Some(k) = key(i) {
                keys.entry(k).or_default().push(g);
            }
        }
        keys.into_iter()
            .map(|(k, gs)| (k.clone(), GroupAcc::stats(gs.into_iter(), elapsed_s)))
            .collect()
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
            h.observe(std::time::Duration::from_secs_f64(v));
        }
        let l = latency(&h);
        for (q, got) in [(0.5, l.p50), (0.9, l.p90), (0.99, l.p99)] {
            let want = exact(values.clone(), q).expect("values");
            let got = got.expect("observed");
            assert!((got / want - 1.0).abs() < 0.006, "q {q}: {got} vs {want}");
        }
        assert_eq!(l.count, 5000);
        let mean = values.iter().sum::<f64>() / 5000.0;
        assert!((l.mean.expect("mean") - mean).abs() < 1e-9);
        assert_eq!(latency(&LogHistogram::default()).p50, None);
    }

    #[test]
    fn a_step_reports_what_its_requests_did() {
        let labels = ClassLabels {
            names: vec!["a".into(), "b".into(), "c".into()],
            objectives: vec![Some("critical".into()), Some("sheddable".into()), None],
            tenants: vec![Some("t1".into()), Some("t1".into()), None],
        };
        let mut s = StepAcc::new(2.0, 10.0, 3, 3);
        s.start_s = 5.0;
        s.end_s = 15.0;
        for class in [0, 0, 1, 1, 1] {
            s.arrived(class);
        }
        let done = |waited: f64, pod_ttft: f64, pod_e2e: f64, tokens: u32, end_s: f64| Completion {
            class: 0,
            pod: 1,
            waited,
            pod_ttft,
            pod_e2e,
            tokens,
            prompt: 100,
            cached: 20,
            end_s,
        };
        // Ends 2 s after the start (first half), then 7 s after it (second half).
        s.success(&done(0.0, 0.1, 1.1, 11, 7.0));
        s.success(&done(0.5, 0.3, 2.3, 21, 12.0));
        s.error(1, ErrorKind::Dropped, None);
        s.shed(1, DropReason::Saturated);
        s.shed(1, DropReason::TtlExpired);
        let r = s.report(&labels);
        assert_eq!(
            r.requests,
            Counts {
                planned: 5,
                sent: 4,
                ok: 2,
                errors: 1,
                dropped: 1,
                shed: 2
            }
        );
        assert_eq!(r.throughput.requests_per_s, 0.2);
        assert_eq!(r.throughput.steady_requests_per_s, Some(0.2));
        assert_eq!(r.tokens.output, 32);
        assert_eq!(r.per_pod.get("1"), Some(&2));
        assert!((r.tpot_s.p50.expect("tpot") - 0.1).abs() < 1e-9);
        // The wait at the gateway counts in TTFT and e2e, not in the pod's TTFT.
        assert!((r.ttft_s.p99.expect("ttft") - 0.8).abs() < 0.01);
        assert!((r.pod_ttft_s.p99.expect("ttft") - 0.3).abs() < 0.01);
        assert_eq!(r.ttft_real_scale_s.p90, r.ttft_s.p90);
        assert_eq!(r.status_counts["429"], 2);
        assert_eq!(r.shed_by_reason["rejected-ttl-expired"], 1);
        let critical = &r.by_objective["critical"];
        assert_eq!((critical.planned, critical.completed), (2, 2));
        let sheddable = &r.by_objective["sheddable"];
        assert_eq!(
            (sheddable.planned, sheddable.errors, sheddable.shed),
            (3, 1, 2)
        );
        assert_eq!(sheddable.shed_by_reason["rejected-saturated"], 1);
        assert_eq!(r.by_tenant["t1"].planned, 5, "both classes of the tenant");
        assert_eq!(r.by_class.len(), 2, "class c planned nothing");
    }
}
