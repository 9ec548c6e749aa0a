//! The flow-control targets, checked on the measured numbers of each router. Pure.
//!
//! * **Priority under overload** (a workload with a `capacity`, an objective of priority ≥ 0
//!   and one below 0, e.g. `overload-priority`): at the step nearest 2× capacity against the
//!   step nearest half of it, each protected objective's p90 TTFT at most
//!   [`PROTECTED_P90_RATIO`] × its value at half load; every shed request of a sheddable
//!   objective; steady throughput at 2× at least [`OVERLOAD_THROUGHPUT_SHARE`] × capacity
//!   (with round robin's at the same step beside it: in a 60 s step the second half is not
//!   yet the fleet's steady state and reads above the long-run capacity, ~1.1×, for any
//!   router that keeps the pods busy). Steady throughput counts the completions in the
//!   second half of the step's arrivals, not the report's `req/s` (see `priority_checks`).
//! * **Fairness** (a workload with two tenants or more and a step in which one tenant sends
//!   alone, e.g. `noisy-tenant`): that tenant's p90 TTFT in each step shared with others at
//!   most [`QUIET_TENANT_P90_RATIO`] × its p90 when alone.
//!
//! TTFT is the per-objective and per-tenant one at real scale: the pod's own TTFT, the
//! router's path counted once, and a gateway's queue wait (which kvroute reports in
//! `server-timing`) in simulated time, since it waits for the simulated pods (see
//! `loadgen::client::Outcome::ttft_real_scale_s`).

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde::Serialize;

use super::report::{WorkloadResult, ratio, same_rate};
use super::routers::RouterKind;
use crate::loadgen::report::StepReport;

/// Most a protected objective's p90 TTFT may grow from half load to 2× capacity.
pub const PROTECTED_P90_RATIO: f64 = 1.5;
/// Least share of the capacity completed at 2× capacity.
pub const OVERLOAD_THROUGHPUT_SHARE: f64 = 0.95;
/// Most a tenant's p90 TTFT may grow when others share the fleet with it.
pub const QUIET_TENANT_P90_RATIO: f64 = 1.3;

/// One target, checked on one router's run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TargetCheck {
    /// The router measured.
    pub router: RouterKind,
    /// What is checked, short.
    pub check: String,
    /// The measured ratio or count.
    pub value: Option<f64>,
    /// The target, in words (`≤ 1.5`).
    pub target: String,
    /// Whether it is met; None when a number is missing.
    pub met: Option<bool>,
    /// The sentence the report prints: the numbers behind the value.
    pub line: String,
}

impl TargetCheck {
    fn verdict(&self) -> &'static str {
        match self.met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "not measured",
        }
    }
}

/// Every check that applies to `w`, router by router.
pub fn checks(w: &WorkloadResult) -> Vec<TargetCheck> {
    let mut out = priority_checks(w);
    out.extend(fairness_checks(w));
    out
}

/// The Markdown section of `checks` (empty without any).
pub fn markdown(w: &WorkloadResult, checks: &[TargetCheck]) -> String {
    let mut s = String::new();
    if checks.is_empty() {
        return s;
    }
    let _ = writeln!(s, "### {}: target checks\n", w.workload);
    s.push_str(
        "Computed from the per-objective and per-tenant numbers above (TTFT from the moment the \
         client sent the request).\n\n",
    );
    for c in checks {
        let _ = writeln!(s, "- `{}`: {} — {}", c.router.name(), c.line, c.verdict());
    }
    s.push('\n');
    s
}

/// The position of the rate nearest `target` by ratio (None without rates).
fn nearest(rates: &[f64], target: f64) -> Option<usize> {
    let distance = |r: f64| (r / target).ln().abs();
    (0..rates.len())
        .filter(|&i| rates[i] > 0.0)
        .min_by(|&a, &b| distance(rates[a]).total_cmp(&distance(rates[b])))
}

fn secs(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.3} s"))
}

fn num(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}"))
}

fn step(steps: &[StepReport], rate: f64) -> Option<&StepReport> {
    steps.iter().find(|s| same_rate(s.rate, rate))
}

fn priority_checks(w: &WorkloadResult) -> Vec<TargetCheck> {
    let mut out = Vec::new();
    let Some(capacity) = w.capacity.filter(|c| *c > 0.0) else {
        return out;
    };
    let mut protected: Vec<(&str, i32)> = w
        .objectives
        .iter()
        .filter(|(_, p)| **p >= 0)
        .map(|(n, p)| (n.as_str(), *p))
        .collect();
    protected.sort_by_key(|(_, p)| std::cmp::Reverse(*p));
    let sheddable: Vec<&str> = w
        .objectives
        .iter()
        .filter(|(_, p)| **p < 0)
        .map(|(n, _)| n.as_str())
        .collect();
    if protected.is_empty() || sheddable.is_empty() {
        return out;
    }
    let (Some(half), Some(over)) = (
        nearest(&w.rates, capacity / 2.0),
        nearest(&w.rates, 2.0 * capacity),
    ) else {
        return out;
    };
    if half == over {
        return out;
    }
    let (half_rate, over_rate) = (w.rates[half], w.rates[over]);
    let reference = w
        .run(RouterKind::RoundRobin)
        .and_then(|rr| step(&rr.bench.steps, over_rate))
        .and_then(|s| s.throughput.steady_requests_per_s);
    for run in &w.runs {
        let steps = &run.bench.steps;
        // A run that kept no per-objective statistics (one without objectives) has nothing to check.
        if steps.iter().all(|s| s.by_objective.is_empty()) {
            continue;
        }
        let (Some(h), Some(o)) = (step(steps, half_rate), step(steps, over_rate)) else {
            continue;
        };
        for &(name, _) in &protected {
            let p90 = |s: &StepReport| {
                s.by_objective
                    .get(name)
                    .and_then(|g| g.ttft_real_scale_s.p90)
            };
            let (at_over, at_half) = (p90(o), p90(h));
            let value = ratio(at_over, at_half);
            out.push(TargetCheck {
                router: run.router,
                check: format!("{name} p90 TTFT at 2× capacity / at half load"),
                value,
                target: format!("≤ {PROTECTED_P90_RATIO}"),
                met: value.map(|v| v <= PROTECTED_P90_RATIO),
                line: format!(
                    "{name} p90 TTFT at {over_rate} req/s ({:.1}× capacity): {} vs {} at {half_rate} req/s ({:.1}×): ratio {}, target ≤ {PROTECTED_P90_RATIO}",
                    over_rate / capacity,
                    secs(at_over),
                    secs(at_half),
                    half_rate / capacity,
                    num(value),
                ),
            });
        }
        let shed: usize = steps.iter().map(|s| s.requests.shed).sum();
        let shed_sheddable: usize = steps
            .iter()
            .flat_map(|s| sheddable.iter().filter_map(|o| s.by_objective.get(*o)))
            .map(|g| g.shed)
            .sum();
        let others = shed.saturating_sub(shed_sheddable);
        out.push(TargetCheck {
            router: run.router,
            check: "shed requests not of a sheddable objective".into(),
            value: Some(others as f64),
            target: "0".into(),
            met: Some(others == 0),
            line: format!(
                "shed over the ladder: {shed}, of which {others} not of a sheddable objective ({}), target 0",
                sheddable.join(", ")
            ),
        });
        // Not the tables' `req/s` (completed requests per second of the arrival window): at
        // 2× capacity a router that queues everything completes every request in the end,
        // and that figure would read 2× capacity for a fleet that serves 1×, the backlog
        // drained after the arrivals credited to them. The rate of completions in the second
        // half of the arrivals is the rate the loaded fleet sustains, and the check reads it
        // for every router alike.
        let steady = o.throughput.steady_requests_per_s;
        let value = ratio(steady, Some(capacity));
        // Round robin never sheds and keeps every pod busy: what this fleet completed at
        // this step, measured the same way.
        let rr = match reference {
            Some(r) if run.router != RouterKind::RoundRobin => format!(
                "; round robin {r:.2} req/s at this step (ratio {})",
                num(ratio(steady, Some(r)))
            ),
            _ => String::new(),
        };
        out.push(TargetCheck {
            router: run.router,
            check: "steady throughput at 2× capacity / capacity".into(),
            value,
            target: format!("≥ {OVERLOAD_THROUGHPUT_SHARE}"),
            met: value.map(|v| v >= OVERLOAD_THROUGHPUT_SHARE),
            line: format!(
                "completed at {over_rate} req/s (second half of the step): {} req/s vs capacity {capacity} req/s: {}, target ≥ {OVERLOAD_THROUGHPUT_SHARE}{rr}",
                num(steady),
                num(value),
            ),
        });
    }
    out
}

fn fairness_checks(w: &WorkloadResult) -> Vec<TargetCheck> {
    let mut out = Vec::new();
    for run in &w.runs {
        let steps = &run.bench.steps;
        let present = |s: &StepReport, t: &str| s.by_tenant.get(t).is_some_and(|g| g.planned > 0);
        let tenants: BTreeSet<&str> = steps
            .iter()
            .flat_map(|s| s.by_tenant.keys().map(String::as_str))
            .collect();
        if tenants.len() < 2 {
            continue;
        }
        for &quiet in tenants
            .iter()
            .filter(|t| steps.iter().all(|s| present(s, t)))
        {
            let others = || tenants.iter().copied().filter(move |t| *t != quiet);
            let Some(alone) = steps.iter().find(|s| others().all(|t| !present(s, t))) else {
                continue;
            };
            let p90 = |s: &StepReport| s.by_tenant.get(quiet).and_then(|g| g.ttft_real_scale_s.p90);
            let base = p90(alone);
            for shared in steps.iter().filter(|s| others().any(|t| present(s, t))) {
                let offered = |t: &str| {
                    let n = shared.by_tenant.get(t).map_or(0, |g| g.planned);
                    n as f64 / shared.duration_s.max(f64::MIN_POSITIVE)
                };
                let others_rate: f64 = others().map(offered).sum();
                let load = w.capacity.map_or_else(String::new, |c| {
                    format!(", {:.1}× capacity", shared.rate / c)
                });
                let value = ratio(p90(shared), base);
                out.push(TargetCheck {
                    router: run.router,
                    check: format!("tenant {quiet} p90 TTFT shared / alone"),
                    value,
                    target: format!("≤ {QUIET_TENANT_P90_RATIO}"),
                    met: value.map(|v| v <= QUIET_TENANT_P90_RATIO),
                    line: format!(
                        "tenant {quiet} p90 TTFT at {} req/s ({quiet} {:.1} req/s, others {others_rate:.1} req/s{load}): {} vs {} alone at {} req/s: ratio {}, target ≤ {QUIET_TENANT_P90_RATIO}",
                        shared.rate,
                        offered(quiet),
                        secs(p90(shared)),
                        secs(base),
                        alone.rate,
                        num(value),
                    ),
                });
            }
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    use super::*;
    use crate::compare::report::RouterRun;
    use crate::loadgen::client::Outcome;
    use crate::loadgen::report::{REPORT_VERSION, Record, Report};

    /// Arrivals of every test step, simulated seconds.
    pub(crate) const DURATION: f64 = 10.0;

    /// `n` requests of one objective and tenant: completed with TTFT `ttft`, ending in the
    /// second half of the step, or shed as saturated when `ttft` is None.
    pub(crate) fn requests(
        objective: Option<&str>,
        tenant: Option<&str>,
        n: usize,
        ttft: Option<f64>,
    ) -> Vec<Record> {
        let outcome = match ttft {
            Some(t) => Outcome {
                status: Some(200),
                ttft_s: Some(t),
                ttft_real_scale_s: Some(t),
                e2e_s: Some(t + 0.5),
                output_tokens: Some(2),
                ..Outcome::default()
            },
            None => Outcome {
                status: Some(429),
                e2e_s: Some(0.01),
                shed_reason: Some("rejected-saturated".into()),
                ..Outcome::default()
            },
        };
        (0..n)
            .map(|index| Record {
                index,
                class: objective.or(tenant).unwrap_or("c").into(),
                objective: objective.map(str::to_owned),
                tenant: tenant.map(str::to_owned),
                model: "m".into(),
                planned_prompt_tokens: 1,
                max_tokens: 2,
                scheduled_s: 0.75 * DURATION,
                sent_s: 0.75 * DURATION,
                outcome: outcome.clone(),
            })
            .collect()
    }

    pub(crate) fn run(router: RouterKind, steps: Vec<(f64, Vec<Record>)>) -> RouterRun {
        let steps: Vec<StepReport> = steps
            .into_iter()
            .map(|(rate, records)| StepReport::new(rate, DURATION, DURATION, records, false))
            .collect();
        RouterRun {
            router,
            fleet_steps: vec![Default::default(); steps.len()],
            fleet_total: Default::default(),
            wall_s: 0.0,
            replicas_routed: Vec::new(),
            prefix_checks: Vec::new(),
            kv_events: None,
            bench: Report {
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
            },
        }
    }

    pub(crate) fn result(
        rates: &[f64],
        objectives: &[(&str, i32)],
        capacity: Option<f64>,
        runs: Vec<RouterRun>,
    ) -> WorkloadResult {
        WorkloadResult {
            workload: "w".into(),
            file: PathBuf::from("w.yaml"),
            pods: 8,
            speedup: 10.0,
            rates: rates.to_vec(),
            step_duration_s: DURATION,
            objectives: objectives
                .iter()
                .map(|(n, p)| (n.to_string(), *p))
                .collect::<BTreeMap<_, _>>(),
            capacity,
            runs,
            failures: Vec::new(),
        }
    }

    /// An overload ladder at 11 and 44 req/s for a capacity of 22: at 44, critical TTFT
    /// `critical_over`, `completed` critical requests, `shed_critical` critical requests shed
    /// and 30 sheddable ones shed.
    fn overload(
        router: RouterKind,
        critical_over: f64,
        completed: usize,
        shed_critical: usize,
    ) -> RouterRun {
        let mut half = requests(Some("critical"), None, 40, Some(0.2));
        half.extend(requests(Some("sheddable"), None, 60, Some(0.2)));
        let mut over = requests(Some("critical"), None, completed, Some(critical_over));
        over.extend(requests(Some("critical"), None, shed_critical, None));
        over.extend(requests(Some("sheddable"), None, 30, None));
        run(router, vec![(11.0, half), (44.0, over)])
    }

    const OBJECTIVES: [(&str, i32); 2] = [("critical", 100), ("sheddable", -10)];

    #[test]
    fn priority_checks_compare_two_times_capacity_with_half_load() {
        let w = result(
            &[11.0, 22.0, 44.0],
            &OBJECTIVES,
            Some(22.0),
            vec![
                overload(RouterKind::Kvroute, 0.25, 105, 0),
                overload(RouterKind::RoundRobin, 1.0, 50, 1),
            ],
        );
        let c = checks(&w);
        assert_eq!(c.len(), 6, "{c:#?}");
        let kv: Vec<&TargetCheck> = c
            .iter()
            .filter(|c| c.router == RouterKind::Kvroute)
            .collect();
        assert_eq!(
            kv[0].line,
            "critical p90 TTFT at 44 req/s (2.0× capacity): 0.250 s vs 0.200 s at 11 req/s (0.5×): ratio 1.25, target ≤ 1.5"
        );
        assert_eq!(kv[0].met, Some(true));
        assert_eq!((kv[1].value, kv[1].met), (Some(0.0), Some(true)));
        // 105 completions in the last 5 s of the step: 21 req/s, 0.95 of 22.
        assert!((kv[2].value.expect("share") - 21.0 / 22.0).abs() < 1e-9);
        assert_eq!(kv[2].met, Some(true));
        assert!(
            kv[2].line.contains("round robin 10.00 req/s"),
            "{}",
            kv[2].line
        );
        let rr: Vec<&TargetCheck> = c
            .iter()
            .filter(|c| c.router == RouterKind::RoundRobin)
            .collect();
        assert_eq!((rr[0].value, rr[0].met), (Some(5.0), Some(false)));
        assert_eq!((rr[1].value, rr[1].met), (Some(1.0), Some(false)));
        assert_eq!(rr[2].met, Some(false));
        let md = markdown(&w, &c);
        assert!(md.contains("### w: target checks"), "{md}");
        assert!(
            md.contains("- `kvroute`: critical p90 TTFT at 44 req/s"),
            "{md}"
        );
        assert!(md.contains("target ≤ 1.5 — **missed**"), "{md}");
    }

    #[test]
    fn priority_checks_need_a_capacity_and_both_kinds_of_objective() {
        let runs = || vec![overload(RouterKind::Kvroute, 0.25, 105, 0)];
        assert!(checks(&result(&[11.0, 44.0], &OBJECTIVES, None, runs())).is_empty());
        let all_protected = [("critical", 100), ("sheddable", 0)];
        assert!(checks(&result(&[11.0, 44.0], &all_protected, Some(22.0), runs())).is_empty());
        // One rate: half load and 2× would be the same step.
        assert!(checks(&result(&[44.0], &OBJECTIVES, Some(22.0), runs())).is_empty());
    }

    fn tenants(router: RouterKind, quiet_shared: f64) -> RouterRun {
        let alone = requests(None, Some("b"), 30, Some(0.2));
        let mut shared = requests(None, Some("b"), 30, Some(quiet_shared));
        shared.extend(requests(None, Some("a"), 300, Some(3.0)));
        run(router, vec![(3.0, alone), (33.0, shared)])
    }

    #[test]
    fn fairness_checks_compare_the_quiet_tenant_with_its_step_alone() {
        let w = result(
            &[3.0, 33.0],
            &[],
            Some(22.0),
            vec![
                tenants(RouterKind::Kvroute, 0.24),
                tenants(RouterKind::RoundRobin, 0.5),
            ],
        );
        let c = checks(&w);
        // Tenant a is absent from the first step: only b is checked, once per router.
        assert_eq!(c.len(), 2, "{c:#?}");
        assert_eq!(
            c[0].line,
            "tenant b p90 TTFT at 33 req/s (b 3.0 req/s, others 30.0 req/s, 1.5× capacity): 0.240 s vs 0.200 s alone at 3 req/s: ratio 1.20, target ≤ 1.3"
        );
        assert_eq!(c[0].met, Some(true));
        assert_eq!(
            (c[1].router, c[1].met),
            (RouterKind::RoundRobin, Some(false))
        );
        assert!((c[1].value.expect("ratio") - 2.5).abs() < 1e-9);
    }

    #[test]
    fn no_checks_without_a_step_alone_or_a_second_tenant() {
        let both = || {
            let mut r = requests(None, Some("b"), 10, Some(0.2));
            r.extend(requests(None, Some("a"), 10, Some(0.2)));
            r
        };
        let w = result(
            &[3.0, 33.0],
            &[],
            None,
            vec![run(
                RouterKind::Kvroute,
                vec![(3.0, both()), (33.0, both())],
            )],
        );
        assert!(checks(&w).is_empty());
        let one = result(
            &[3.0],
            &[],
            None,
            vec![run(
                RouterKind::Kvroute,
                vec![(3.0, requests(None, Some("b"), 10, Some(0.2)))],
            )],
        );
        assert!(checks(&one).is_empty());
        assert!(markdown(&one, &[]).is_empty());
    }

    #[test]
    fn the_nearest_rate_is_nearest_by_ratio() {
        assert_eq!(nearest(&[4.0, 11.0, 22.0, 33.0, 44.0], 11.0), Some(1));
        // 30 is 1.47× from 44, 50 only 1.14×.
        assert_eq!(nearest(&[30.0, 50.0], 44.0), Some(1));
        assert_eq!(nearest(&[], 1.0), None);
    }
}
