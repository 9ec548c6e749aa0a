//! The comparison's results: per-router runs → rows per workload and rate → `report.md`
//! (tables, ratios kvroute / each other router, the knee rate, per-objective and per-tenant
//! tables and target checks where requests carried objectives or tenants) and PNG plots
//! (plotters). Columns and plots that read zero for a whole workload are left out
//! ([`columns`](super::columns)). The row building, knee and ratio computations are pure.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::{Deserialize, Serialize};

use super::columns::{Column, kept_columns};
use super::fleet_stats::WindowStats;
use super::routers::RouterKind;
use super::targets;
use crate::loadgen::report::Report;

/// Requests whose predicted cached tokens kvroute checked against their response, for one
/// prediction source and outcome (`kvroute_prefix_checks_total`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PrefixCheckCount {
    pub source: String,
    pub outcome: String,
    pub requests: u64,
}

/// What kvroute's KV-event subscriptions did over a run, summed over its replicas
/// (`kvroute_kv_event_*_total` and `kvroute_tokenize_duration_seconds`): whether the index
/// a run's placements read was whole.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvEventCounts {
    /// Event batches by result (`applied`, `seen`, `out_of_order`, `undecodable`,
    /// `malformed`).
    pub batches: BTreeMap<String, u64>,
    /// Sequence gaps found.
    pub gaps: u64,
    /// Replays asked for, by outcome.
    pub replays: BTreeMap<String, u64>,
    /// Pods whose entries were dropped and rebuilt.
    pub resets: u64,
    /// Tokenizations of prompts, on a pod's `/tokenize` or by kvroute itself with
    /// `--tokenizer` (a prompt kvroute leaves to a pod counts in both), and their mean
    /// time.
    pub tokenized: u64,
    pub tokenize_mean_ms: Option<f64>,
    /// Of those, the prompts kvroute tokenized itself (`--tokenizer`).
    #[serde(default)]
    pub tokenized_locally: u64,
    /// Pods whose event stream was connected and in sequence when read.
    #[serde(default)]
    pub streams: u64,
    /// Prompt tokens predicted cached on the chosen pod, by where the prediction came
    /// from (`sent`, `kv_events`, `kv_events+sent`).
    #[serde(default)]
    pub predicted_tokens: BTreeMap<String, u64>,
}

/// One router's run of one workload: the load generator's report and the fleet's activity.
#[derive(Debug, Clone, Serialize)]
pub struct RouterRun {
    /// Which router.
    pub router: RouterKind,
    /// The load generator's report (simulated times).
    pub bench: Report,
    /// The fleet's activity per step of the ladder, in step order.
    pub fleet_steps: Vec<WindowStats>,
    /// The fleet's activity over the whole ladder.
    pub fleet_total: WindowStats,
    /// Wall seconds from starting the fleet to stopping everything.
    pub wall_s: f64,
    /// Requests each kvroute replica routed over the run, warm-up included (empty for the
    /// other routers and offline).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replicas_routed: Vec<u64>,
    /// kvroute's checks of its predicted cached tokens against the responses, over every
    /// replica and the whole run (`--observe-responses`; empty otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prefix_checks: Vec<PrefixCheckCount>,
    /// kvroute's KV-event subscriptions over the run (routers on KV events only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventCounts>,
}

/// Everything measured on one workload.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadResult {
    /// Workload name.
    pub workload: String,
    /// File it came from.
    pub file: PathBuf,
    /// Pods in its fleet.
    pub pods: usize,
    /// The fleet's clock factor.
    pub speedup: f64,
    /// The ladder run.
    pub rates: Vec<f64>,
    /// Arrivals per step, simulated seconds.
    pub step_duration_s: f64,
    /// The workload's objectives and their priorities (empty: none).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub objectives: BTreeMap<String, i32>,
    /// The workload's estimated capacity, requests per simulated second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<f64>,
    /// Routers that ran, in report order.
    pub runs: Vec<RouterRun>,
    /// Routers that could not run, with the reason.
    pub failures: Vec<(RouterKind, String)>,
}

/// One table row: a router at a rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Row {
    /// Offered rate, requests per simulated second.
    pub rate: f64,
    /// Successful requests per simulated second of the step's arrival window (see
    /// [`per_arrival_second`]).
    pub requests_per_s: f64,
    /// Completed requests per simulated second in the second half of the step's arrivals.
    pub steady_requests_per_s: Option<f64>,
    /// Output tokens of the successful requests per simulated second of the arrival window.
    pub output_tokens_per_s: f64,
    /// TTFT p50, p90, p99 (s) at real scale: the pods' simulated TTFT plus the wall time
    /// spent outside them, unscaled, except a gateway queue wait (in simulated time); the
    /// client's TTFT where the pods report no timing.
    pub ttft: [Option<f64>; 3],
    /// TTFT p90 over every planned request, those not served (shed, failed) counted as
    /// slower than any served; None where it falls on one not served (see
    /// `StepReport::ttft_p90_all_s`).
    pub ttft_p90_all: Option<f64>,
    /// TTFT p90 from the client's clock, wall time × speedup (s).
    pub client_ttft_p90: Option<f64>,
    /// TTFT p90 as the pods timed it (s, simulated).
    pub pod_ttft_p90: Option<f64>,
    /// Wall time outside the pods before the first token, p50 and p90 (ms).
    pub path_ms: [Option<f64>; 2],
    /// ITL p50, p90 (s).
    pub itl: [Option<f64>; 2],
    /// e2e p90 (s).
    pub e2e_p90: Option<f64>,
    /// Failed requests.
    pub errors: usize,
    /// Requests the gateway shed.
    pub shed: usize,
    /// Requests planned.
    pub requests: usize,
    /// Preemptions in the fleet.
    pub preemptions: f64,
    /// Adapter loads in the fleet.
    pub lora_loads: f64,
    /// Prefix-cache hit rate (tokens).
    pub prefix_hit_rate: Option<f64>,
    /// Mean KV spread across pods.
    pub kv_spread: Option<f64>,
}

/// `count` per simulated second of a step's arrival window `window_s`, the time over which
/// its requests were sent (`StepReport::duration_s`); 0 for an empty or unknown window.
///
/// The comparison's throughput: what a router completed of the load offered in the window,
/// whenever it completed it (a request that fails, times out or is shed does not count). The
/// load generator's own `throughput.requests_per_s` divides by the step's elapsed time
/// instead, the drain after the last arrival included, so a router that completes the same
/// requests but drains its queue more slowly reads lower there: a drain is latency, which
/// the TTFT and e2e columns show, not lost throughput.
pub fn per_arrival_second(count: f64, window_s: f64) -> f64 {
    if window_s.is_finite() && window_s > 0.0 {
        count / window_s
    } else {
        0.0
    }
}

impl RouterRun {
    /// One row per step.
    pub fn rows(&self) -> Vec<Row> {
        self.bench
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let fleet = self.fleet_steps.get(i).copied().unwrap_or_default();
                Row {
                    rate: s.rate,
                    requests_per_s: per_arrival_second(s.requests.ok as f64, s.duration_s),
                    steady_requests_per_s: s.throughput.steady_requests_per_s,
                    output_tokens_per_s: per_arrival_second(s.tokens.output as f64, s.duration_s),
                    ttft: if s.ttft_real_scale_s.p90.is_some() {
                        let t = &s.ttft_real_scale_s;
                        [t.p50, t.p90, t.p99]
                    } else {
                        [s.ttft_s.p50, s.ttft_s.p90, s.ttft_s.p99]
                    },
                    ttft_p90_all: s.ttft_p90_all_s,
                    client_ttft_p90: s.ttft_s.p90,
                    pod_ttft_p90: s.pod_ttft_s.p90,
                    path_ms: [s.path_s.p50, s.path_s.p90].map(|v| v.map(|v| v * 1e3)),
                    itl: [s.itl_s.p50, s.itl_s.p90],
                    e2e_p90: s.e2e_s.p90,
                    errors: s.errors,
                    shed: s.requests.shed,
                    requests: s.requests.planned,
                    preemptions: fleet.preemptions,
                    lora_loads: fleet.lora_loads,
                    prefix_hit_rate: fleet.prefix_hit_rate,
                    kv_spread: fleet.kv_spread_mean,
                }
            })
            .collect()
    }
}

/// How far p90 TTFT must rise over its value at the lowest rate to mark the knee.
pub const KNEE_FACTOR: f64 = 3.0;

/// The knee: the lowest rate whose p90 TTFT is at least [`KNEE_FACTOR`] × the p90 TTFT at the
/// lowest rate. `points` are (rate, p90 TTFT) in any order; rates without a p90 (no request
/// succeeded) are skipped. None when the lowest rate has no positive p90 or no rate reaches it.
pub fn knee_rate(points: &[(f64, Option<f64>)]) -> Option<f64> {
    let mut sorted: Vec<(f64, f64)> = points
        .iter()
        .filter_map(|&(r, p)| Some((r, p?)))
        .filter(|(r, p)| r.is_finite() && p.is_finite())
        .collect();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let &(_, base) = sorted.first()?;
    if base <= 0.0 {
        return None;
    }
    sorted
        .iter()
        .skip(1)
        .find(|(_, p)| *p >= KNEE_FACTOR * base)
        .map(|(r, _)| *r)
}

/// `a / b` when both are known and `b > 0`.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a.is_finite() && b.is_finite() => Some(a / b),
        _ => None,
    }
}

impl WorkloadResult {
    pub(crate) fn run(&self, kind: RouterKind) -> Option<&RouterRun> {
        self.runs.iter().find(|r| r.router == kind)
    }

    /// The knee rate by round robin's p90 TTFT, if round robin ran.
    pub fn knee(&self) -> Option<f64> {
        let rr = self.run(RouterKind::RoundRobin)?;
        let points: Vec<(f64, Option<f64>)> =
            rr.rows().iter().map(|r| (r.rate, r.ttft[1])).collect();
        knee_rate(&points)
    }

    /// Each router's rows, in run order.
    pub fn rows(&self) -> Vec<(RouterKind, Vec<Row>)> {
        self.runs.iter().map(|r| (r.router, r.rows())).collect()
    }

    /// The columns this workload's tables keep (see [`columns`](super::columns)).
    pub fn columns(&self) -> Vec<Column> {
        columns_of(&self.rows())
    }
}

/// The columns kept for a workload whose routers' rows are `rows` ([`WorkloadResult::rows`]).
pub fn columns_of(rows: &[(RouterKind, Vec<Row>)]) -> Vec<Column> {
    kept_columns(rows.iter().flat_map(|(_, rs)| rs))
}

pub(crate) fn num(v: Option<f64>, digits: usize) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
}

pub(crate) fn same_rate(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(1.0)
}

/// The Markdown section of one workload (tables, knee, ratios); `plots` are the image files
/// (relative to the report) to link.
pub fn workload_markdown(w: &WorkloadResult, plots: &[String]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "## Workload `{}`\n", w.workload);
    let _ = writeln!(
        s,
        "File `{}`; {} pods at speedup {}; rates {:?} req/s; steps of {} s (simulated).\n",
        w.file.display(),
        w.pods,
        w.speedup,
        w.rates,
        w.step_duration_s
    );
    let knee = w.knee();
    match (knee, w.run(RouterKind::RoundRobin)) {
        (Some(k), _) => {
            let _ = writeln!(
                s,
                "**Knee rate: {k} req/s** (the lowest rate where round robin's p90 TTFT reaches {KNEE_FACTOR}× its value at the lowest rate).\n"
            );
        }
        (None, Some(_)) => {
            let _ = writeln!(
                s,
                "Knee rate: not reached (round robin's p90 TTFT stays below {KNEE_FACTOR}× its value at the lowest rate on this ladder).\n"
            );
        }
        (None, None) => {
            let _ = writeln!(s, "Knee rate: unknown (round robin did not run).\n");
        }
    }
    for (kind, reason) in &w.failures {
        let _ = writeln!(s, "**{} failed**: {reason}\n", kind.name());
    }
    let rows = w.rows();
    let columns = columns_of(&rows);
    let header: Vec<&str> = columns.iter().map(|c| c.header()).collect();
    for &rate in &w.rates {
        let marker = if knee.is_some_and(|k| same_rate(k, rate)) {
            " — knee"
        } else {
            ""
        };
        let _ = writeln!(s, "### {} at {rate} req/s{marker}\n", w.workload);
        let _ = writeln!(
            s,
            "| router | {} |\n|---|{}",
            header.join(" | "),
            "---|".repeat(columns.len())
        );
        for (kind, rs) in &rows {
            let Some(r) = rs.iter().find(|r| same_rate(r.rate, rate)) else {
                continue;
            };
            let cells: Vec<String> = columns.iter().map(|c| c.cell(r)).collect();
            let _ = writeln!(s, "| {} | {} |", kind.name(), cells.join(" | "));
        }
        s.push('\n');
    }
    s.push_str(&ratio_markdown(w, &rows, &columns, knee));
    s.push_str(&prefix_checks_markdown(w));
    s.push_str(&kv_events_markdown(w));
    if w.has_groups() {
        s.push_str(&groups_markdown(w));
    }
    s.push_str(&targets::markdown(w, &targets::checks(w)));
    if !plots.is_empty() {
        s.push_str("Plots: ");
        let links: Vec<String> = plots.iter().map(|p| format!("[{p}]({p})")).collect();
        s.push_str(&links.join(", "));
        s.push_str("\n\n");
        for p in plots {
            let _ = writeln!(s, "![{p}]({p})\n");
        }
    }
    s
}

/// With `--observe-responses`: how kvroute's predicted cached tokens compared with what the
/// pods reported, per router and prediction source, over the whole run.
fn prefix_checks_markdown(w: &WorkloadResult) -> String {
    const OUTCOMES: [&str; 5] = ["as_predicted", "fewer", "more", "other_pod", "unreported"];
    let mut s = String::new();
    let mut rows = Vec::new();
    for run in w.runs.iter().filter(|r| !r.prefix_checks.is_empty()) {
        let sources: BTreeSet<&str> = run
            .prefix_checks
            .iter()
            .map(|c| c.source.as_str())
            .collect();
        for source in sources {
            let count = |outcome: &str| {
                run.prefix_checks
                    .iter()
                    .find(|c| c.source == source && c.outcome == outcome)
                    .map_or(0, |c| c.requests)
            };
            let cells: Vec<String> = OUTCOMES.iter().map(|o| count(o).to_string()).collect();
            rows.push(format!(
                "| {} | {source} | {} |",
                run.router.name(),
                cells.join(" | ")
            ));
        }
    }
    if rows.is_empty() {
        return s;
    }
    let _ = writeln!(
        s,
        "Prefix predictions checked against the responses' cached tokens (whole run; within a block is as predicted):\n\n\
         | router | source | {} |\n|---|---|{}",
        OUTCOMES.join(" | "),
        "---|".repeat(OUTCOMES.len())
    );
    for row in rows {
        let _ = writeln!(s, "{row}");
    }
    s.push('\n');
    s
}

/// For the routers on KV events: what their subscriptions did over the whole run.
fn kv_events_markdown(w: &WorkloadResult) -> String {
    let mut s = String::new();
    let runs: Vec<(&RouterRun, &KvEventCounts)> = w
        .runs
        .iter()
        .filter_map(|r| r.kv_events.as_ref().map(|k| (r, k)))
        .collect();
    if runs.is_empty() {
        return s;
    }
    s.push_str(
        "KV events followed (whole run, every replica; a gap is a batch missed, then asked \
         for again or the pod's entries rebuilt):\n\n\
         | router | batches applied | other batches | gaps | replays | resets | prompts tokenized | tokenize mean ms |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for (run, k) in runs {
        let applied = k.batches.get("applied").copied().unwrap_or(0);
        let others: Vec<String> = k
            .batches
            .iter()
            .filter(|(result, n)| result.as_str() != "applied" && **n > 0)
            .map(|(result, n)| format!("{n} {result}"))
            .collect();
        let replays: Vec<String> = k
            .replays
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(outcome, n)| format!("{n} {outcome}"))
            .collect();
        let or_none = |v: Vec<String>| {
            if v.is_empty() {
                "0".to_owned()
            } else {
                v.join(", ")
            }
        };
        let _ = writeln!(
            s,
            "| {} | {applied} | {} | {} | {} | {} | {} | {} |",
            run.router.name(),
            or_none(others),
            k.gaps,
            or_none(replays),
            k.resets,
            k.tokenized,
            k.tokenize_mean_ms
                .map_or("-".to_owned(), |ms| format!("{ms:.2}"))
        );
    }
    s.push('\n');
    s
}

/// The ratio table: a column of it stays when its column stays in the workload's tables.
fn ratio_markdown(
    w: &WorkloadResult,
    rows: &[(RouterKind, Vec<Row>)],
    columns: &[Column],
    knee: Option<f64>,
) -> String {
    let mut s = String::new();
    let Some((_, ours)) = rows.iter().find(|(k, _)| *k == RouterKind::Kvroute) else {
        return s;
    };
    if rows.len() < 2 {
        return s;
    }
    let ratios: Vec<(Column, &str)> = Column::RATIOS
        .into_iter()
        .filter(|(c, _)| columns.contains(c))
        .collect();
    let _ = writeln!(
        s,
        "### {}: kvroute / each other router\n\nBelow 1 is better for kvroute, except throughput (above 1 is better). `-`: not defined (a zero or missing denominator, or a p90 of all requests that falls on an unserved one).\n",
        w.workload
    );
    let header: Vec<&str> = ratios.iter().map(|(_, h)| *h).collect();
    let _ = writeln!(
        s,
        "| rate | vs | {} |\n|---|---|{}",
        header.join(" | "),
        "---|".repeat(ratios.len())
    );
    for &rate in &w.rates {
        let Some(k) = ours.iter().find(|r| same_rate(r.rate, rate)) else {
            continue;
        };
        let marker = if knee.is_some_and(|kn| same_rate(kn, rate)) {
            " (knee)"
        } else {
            ""
        };
        for (kind, rs) in rows.iter().filter(|(k, _)| *k != RouterKind::Kvroute) {
            let Some(o) = rs.iter().find(|r| same_rate(r.rate, rate)) else {
                continue;
            };
            let cells: Vec<String> = ratios
                .iter()
                .map(|(c, _)| num(ratio(c.value(k), c.value(o)), 2))
                .collect();
            let _ = writeln!(
                s,
                "| {rate}{marker} | {} | {} |",
                kind.name(),
                cells.join(" | ")
            );
        }
    }
    s.push('\n');
    s
}

impl WorkloadResult {
    /// Whether the runs' requests carried more than one objective or more than one tenant.
    pub fn has_groups(&self) -> bool {
        let (mut objectives, mut tenants) = (BTreeSet::new(), BTreeSet::new());
        for step in self.runs.iter().flat_map(|r| &r.bench.steps) {
            objectives.extend(step.by_objective.keys());
            tenants.extend(step.by_tenant.keys());
        }
        objectives.len() > 1 || tenants.len() > 1
    }
}

/// `n`, then its reasons: `12 (rejected-saturated 10, rejected-ttl-expired 2)`.
fn shed_cell(n: usize, by_reason: &BTreeMap<String, usize>) -> String {
    if by_reason.is_empty() {
        return n.to_string();
    }
    let reasons: Vec<String> = by_reason.iter().map(|(r, k)| format!("{r} {k}")).collect();
    format!("{n} ({})", reasons.join(", "))
}

/// Each objective's and tenant's statistics, per rate and router.
fn groups_markdown(w: &WorkloadResult) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "### {}: per objective and tenant\n\n{GROUPS_LEGEND}",
        w.workload
    );
    s.push_str(
        "| rate | router | group | completed/planned | shed | errors | req/s | real-scale TTFT p50 s | real-scale TTFT p90 s | pod TTFT p90 s | path p50 ms | path p90 ms | queue p90 s | client TTFT p90 s | e2e p90 s |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for &rate in &w.rates {
        for run in &w.runs {
            let Some(step) = run.bench.steps.iter().find(|st| same_rate(st.rate, rate)) else {
                continue;
            };
            for (label, g) in step.groups() {
                let _ = writeln!(
                    s,
                    "| {rate} | {} | {label} | {}/{} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    run.router.name(),
                    g.completed,
                    g.planned,
                    shed_cell(g.shed, &g.shed_by_reason),
                    g.errors,
                    per_arrival_second(g.completed as f64, step.duration_s),
                    num(g.ttft_real_scale_s.p50, 3),
                    num(g.ttft_real_scale_s.p90, 3),
                    num(g.pod_ttft_s.p90, 3),
                    num(g.path_s.p50.map(|p| p * 1e3), 1),
                    num(g.path_s.p90.map(|p| p * 1e3), 1),
                    num(g.queue_s.p90, 3),
                    num(g.ttft_s.p90, 3),
                    num(g.e2e_s.p90, 3),
                );
            }
        }
    }
    s.push('\n');
    s
}

/// What the per-objective and per-tenant columns mean.
const GROUPS_LEGEND: &str = "\
`client TTFT` runs from the moment the client sent the request, on the client's clock (wall
time × speedup), so the router's own CPU time counts 10× at speedup 10; `real-scale TTFT` (what
the target checks read) counts the time outside the pods once, unscaled, except a gateway's
queue wait, which kvroute reports in `server-timing` and which counts in simulated time: it is
the simulated pods the request waits for. `shed`: requests a gateway answered 429 or 503 with
`x-llm-d-request-dropped-reason`, by reason (neither completed nor errors); `req/s`: completed
requests per simulated second of the step's arrival window, as in the tables above; `pod TTFT`
the pod's own, `path` the wall time outside the pod before the first token (the gateway's
queue wait included), `queue` the gateway's hold in simulated time (0 for a request it did not
hold).
";

/// Column meanings, for the top of the report.
pub const LEGEND: &str = "\
Columns: `req/s`, `tok/s`: completed requests and their output tokens per simulated second
of the step's arrival window (the time over which its requests were sent, the drain after
the last arrival not counted; a request failed, timed out or shed by the end of the drain is
not completed): what the router served of the offered load. Arrivals are Poisson, so a step
plans about rate × window requests (the denominator of `errors`), and `req/s` may read a
little off the rate with nothing lost. (The raw JSON's `throughput.requests_per_s` is the load
generator's: per second of the step's elapsed time, drain included.) `TTFT`: time to first token at real scale, the pod's own TTFT (simulated time, from the
request's arrival at the pod: queueing, prefill, adapter loads, preemptions, everything the
routing decision causes) plus `path`, the wall time the request spent outside the pod before
its first token (load generator, router, Envoy, HTTP, this machine's scheduling), counted
once, except a wait in kvroute's queue for a pod with room (reported in `server-timing`), which
counts in simulated time like the pods it waits for; `pod TTFT`: the first part alone; `client TTFT`: the client's wall clock × speedup,
which also multiplies `path` by the speedup (at speedup 10, 1 ms of routing reads as 10 ms,
and the routers carry 10× the request rate in wall time on two cores); ITL (gaps between
streamed text events; bursty against the simulator at speedup > 1, see docs/workloads.md),
e2e: simulated seconds, successful requests only; `errors`: failed /
planned; `shed`: requests a gateway with flow control refused (429/503 with a dropped
reason), neither successes nor errors; `TTFT p90 all`: p90 TTFT over every planned request, a
shed or failed one counting as slower than any served (`unserved` where the p90 falls on one),
so that a router refusing part of the load does not read faster for it (kept only where some
router left a request unserved); `preemptions`, `LoRA loads` (GPU slot loads, disk + host): fleet counters over the
step (from `/metrics` sampled every ~250 ms of wall time, cut at the step boundaries by
interpolation); `prefix hit rate`: prefix-cache hit tokens / queried tokens over the step;
`KV spread`: mean over the step's samples of (max − min) KV-cache usage across pods (0–1).
A column (and its ratio and plot) that reads zero or absent for every router at every rate of
a workload is left out of that workload's tables; the throughput, TTFT and errors columns
always stay.
";

// ---------------------------------------------------------------------------------------
// Plots.

const COLOURS: [RGBColor; 8] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn colour(kind: RouterKind) -> RGBColor {
    let i = RouterKind::EVERY
        .iter()
        .position(|k| *k == kind)
        .unwrap_or(0);
    COLOURS[i % COLOURS.len()]
}

/// Where the plots' font came from: registered once from a TrueType file found at run time
/// (DejaVu Sans, Debian's `fonts-dejavu-core`, or the copy matplotlib ships on PyPI); None:
/// the plots are drawn without text.
pub fn plot_font() -> Option<&'static Path> {
    static FONT: OnceLock<Option<PathBuf>> = OnceLock::new();
    FONT.get_or_init(|| {
        let mut candidates: Vec<PathBuf> = [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        if let Ok(dirs) = std::fs::read_dir(".venv/lib") {
            for d in dirs.flatten() {
                candidates.push(
                    d.path()
                        .join("site-packages/matplotlib/mpl-data/fonts/ttf/DejaVuSans.ttf"),
                );
            }
        }
        candidates.into_iter().find(|p| {
            let Ok(bytes) = std::fs::read(p) else {
                return false;
            };
            // Registered once for the process: the font must live as long as plotters' registry.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
        })
    })
    .as_deref()
}

type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// A tick label without trailing zeros: `2`, `2.5`, `0.25`.
fn tick(v: &f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// What one panel draws: a line per router of `value(row)` against the rate.
struct Panel<'a> {
    title: String,
    y_desc: &'a str,
    value: fn(&Row) -> Option<f64>,
    /// A count: integer tick labels.
    integer: bool,
}

/// Draws `p` on `area`, with the knee rate `knee` as a dashed vertical line.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    w: &WorkloadResult,
    knee: Option<f64>,
    p: &Panel<'_>,
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    let text = plot_font().is_some();
    let series: Vec<(RouterKind, Vec<(f64, f64)>)> = w
        .runs
        .iter()
        .map(|run| {
            let pts = run
                .rows()
                .iter()
                .filter_map(|r| Some((r.rate, (p.value)(r)?)))
                .filter(|(_, v)| v.is_finite())
                .collect();
            (run.router, pts)
        })
        .collect();
    let x_max = w.rates.iter().copied().fold(0.0, f64::max).max(1e-9) * 1.05;
    let highest = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, v)| *v))
        .fold(0.0, f64::max);
    // All zero: a 0–1 axis rather than a degenerate one (a panel reads zero everywhere only
    // when the plot has another panel that does not).
    let y_max = match (highest > 0.0, p.integer) {
        (false, _) => 1.0,
        (true, false) => highest * 1.1,
        (true, true) => (highest * 1.1).ceil(),
    };
    let mut builder = ChartBuilder::on(area);
    builder.margin(12);
    if text {
        builder
            .caption(&p.title, ("sans-serif", 20))
            .x_label_area_size(40)
            .y_label_area_size(60);
    }
    let mut chart = builder.build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    let mut mesh = chart.configure_mesh();
    let integer_label = |v: &f64| format!("{v:.0}");
    if text {
        mesh.x_desc("rate, requests per simulated second")
            .y_desc(p.y_desc)
            .x_label_formatter(&tick)
            .y_label_formatter(&tick);
        if p.integer {
            // At most one label per integer of the axis: plotters then steps by 1, 2, 5, 10,
            // ... and every label is a whole number.
            mesh.y_labels((y_max as usize + 1).min(10))
                .y_label_formatter(&integer_label);
        }
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;
    if let Some(k) = knee {
        let grey = RGBColor(90, 90, 90);
        chart.draw_series(DashedLineSeries::new(
            [(k, 0.0), (k, y_max)],
            8,
            6,
            grey.stroke_width(2),
        ))?;
        if text {
            // Beside the line, on the side with room: left of a knee in the right half.
            let (h, label) = if k > x_max / 2.0 {
                (HPos::Right, format!("knee {k} req/s "))
            } else {
                (HPos::Left, format!(" knee {k} req/s"))
            };
            let style = ("sans-serif", 16)
                .into_font()
                .color(&grey)
                .pos(Pos::new(h, VPos::Top));
            chart.draw_series(std::iter::once(Text::new(label, (k, y_max), style)))?;
        }
    }
    for (kind, pts) in series {
        let c = colour(kind);
        let drawn = chart.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?;
        if text {
            drawn
                .label(kind.name())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
        }
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))?;
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

/// The fleet-counter panels worth drawing for `w`, with the plot's file name: preemptions and
/// LoRA loads, each only where some router moved it (see [`columns`](super::columns)).
fn fleet_panels(w: &WorkloadResult) -> (String, Vec<Panel<'static>>) {
    let columns = w.columns();
    let mut panels = Vec::new();
    let mut name = w.workload.clone();
    if columns.contains(&Column::Preemptions) {
        name.push_str("-preemptions");
        panels.push(Panel {
            title: format!("{}: preemptions per step", w.workload),
            y_desc: "preemptions",
            value: |r| Some(r.preemptions),
            integer: true,
        });
    }
    if columns.contains(&Column::LoraLoads) {
        name.push_str(if panels.is_empty() {
            "-lora-loads"
        } else {
            "-lora"
        });
        panels.push(Panel {
            title: format!("{}: LoRA loads per step", w.workload),
            y_desc: "adapter loads",
            value: |r| Some(r.lora_loads),
            integer: true,
        });
    }
    (format!("{name}.png"), panels)
}

/// Writes `<workload>-ttft-p90.png` and the fleet counters that moved,
/// `<workload>-preemptions-lora.png` (or `-preemptions.png`, `-lora-loads.png`; none when
/// neither moved) into `dir`, each with the knee marked; returns their file names.
pub fn plots(w: &WorkloadResult, dir: &Path) -> Result<Vec<String>, String> {
    let knee = w.knee();
    let ttft = format!("{}-ttft-p90.png", w.workload);
    let (fleet, fleet_panels) = fleet_panels(w);
    let draw = || -> PlotResult {
        let ttft_path = dir.join(&ttft);
        let root = BitMapBackend::new(&ttft_path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let p90 = Panel {
            title: format!("{}: p90 TTFT vs rate", w.workload),
            y_desc: "p90 TTFT, simulated s",
            value: |r| r.ttft[1],
            integer: false,
        };
        panel(&root, w, knee, &p90)?;
        root.present()?;
        if fleet_panels.is_empty() {
            return Ok(());
        }
        let fleet_path = dir.join(&fleet);
        let width = 700 * fleet_panels.len() as u32;
        let root = BitMapBackend::new(&fleet_path, (width, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let areas = root.split_evenly((1, fleet_panels.len()));
        for (area, p) in areas.iter().zip(&fleet_panels) {
            panel(area, w, knee, p)?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| e.to_string())?;
    let mut files = vec![ttft];
    if !fleet_panels.is_empty() {
        files.push(fleet);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::report::StepReport;

    #[test]
    fn the_knee_is_the_first_rate_at_three_times_the_lowest_rates_p90() {
        let pts = [
            (8.0, Some(0.9)),
            (2.0, Some(0.1)),
            (4.0, Some(0.29)),
            (12.0, Some(2.0)),
        ];
        assert_eq!(knee_rate(&pts), Some(8.0));
        // Exactly three times counts.
        assert_eq!(knee_rate(&[(1.0, Some(0.5)), (2.0, Some(1.5))]), Some(2.0));
    }

    #[test]
    fn no_knee_without_a_rise_or_a_baseline() {
        assert_eq!(knee_rate(&[(1.0, Some(0.1)), (2.0, Some(0.2))]), None);
        assert_eq!(
            knee_rate(&[(1.0, None), (2.0, Some(5.0))]),
            None,
            "a missing baseline is skipped: 2.0 becomes the lowest"
        );
        assert_eq!(knee_rate(&[(1.0, Some(0.0)), (2.0, Some(5.0))]), None);
        assert_eq!(knee_rate(&[]), None);
        // A rate where nothing succeeded is skipped, not taken as the knee.
        assert_eq!(
            knee_rate(&[(1.0, Some(0.1)), (2.0, None), (3.0, Some(0.4))]),
            Some(3.0)
        );
    }

    #[test]
    fn tick_labels_have_no_trailing_zeros() {
        let labels: Vec<String> = [16.0, 2.5, 0.25, 0.0, 100.0].iter().map(tick).collect();
        assert_eq!(labels, ["16", "2.5", "0.25", "0", "100"]);
    }

    #[test]
    fn ratios_need_a_positive_denominator() {
        assert_eq!(ratio(Some(1.0), Some(4.0)), Some(0.25));
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
    }

    #[test]
    fn a_workload_with_objectives_gets_a_table_per_objective_and_its_target_checks() {
        use crate::compare::targets::tests::{requests, result, run};
        let mut half = requests(Some("critical"), None, 4, Some(0.2));
        half.extend(requests(Some("sheddable"), None, 6, Some(0.3)));
        let mut over = requests(Some("critical"), None, 8, Some(0.25));
        over.extend(requests(Some("sheddable"), None, 3, None));
        let w = result(
            &[11.0, 44.0],
            &[("critical", 100), ("sheddable", -10)],
            Some(22.0),
            vec![run(RouterKind::Kvroute, vec![(11.0, half), (44.0, over)])],
        );
        assert!(w.has_groups());
        let rows = w.runs[0].rows();
        assert_eq!((rows[1].shed, rows[1].errors, rows[1].requests), (3, 0, 11));
        let md = workload_markdown(&w, &[]);
        // Shedding moves in this workload; the fleet counters do not.
        assert!(md.contains("| e2e p90 s | errors | shed |\n"), "{md}");
        assert!(!md.contains("preemptions"), "{md}");
        assert!(md.contains("### w: per objective and tenant"), "{md}");
        assert!(
            md.contains(
                "| 44 | kvroute | objective critical | 8/8 | 0 | 0 | 0.80 | 0.250 | 0.250 | - | - | - | 0.000 | 0.250 | 0.750 |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| 44 | kvroute | objective sheddable | 0/3 | 3 (rejected-saturated 3) | 0 | 0.00 | - | - | - | - | - | - | - | - |"),
            "{md}"
        );
        assert!(md.contains("### w: target checks"), "{md}");
        assert!(
            md.contains("critical p90 TTFT at 44 req/s (2.0× capacity): 0.250 s vs 0.200 s"),
            "{md}"
        );
    }

    /// A step of `ok` completed requests of 1 s TTFT and 2 output tokens each, whose last
    /// response came `elapsed_s` after the step started (arrivals over 10 s), with `lora`
    /// LoRA loads in the fleet.
    fn step(rate: f64, ok: usize, elapsed_s: f64, lora: f64) -> (StepReport, WindowStats) {
        use crate::compare::targets::tests::{DURATION, requests};
        let records = requests(None, None, ok, Some(1.0));
        let fleet = WindowStats {
            lora_loads: lora,
            ..WindowStats::default()
        };
        (
            StepReport::new(rate, DURATION, elapsed_s, records, false),
            fleet,
        )
    }

    fn router_run(router: RouterKind, steps: Vec<(StepReport, WindowStats)>) -> RouterRun {
        let mut r = crate::compare::targets::tests::run(router, Vec::new());
        (r.bench.steps, r.fleet_steps) = steps.into_iter().unzip();
        r
    }

    #[test]
    fn throughput_is_completed_requests_over_the_arrival_window_not_the_drain() {
        // 164 requests sent over 10 s; kvroute's last response at 10.5 s, round robin's
        // after a 7 s drain. Both served all: the same throughput.
        let kv = router_run(RouterKind::Kvroute, vec![step(16.0, 164, 10.5, 0.0)]);
        let rr = router_run(RouterKind::RoundRobin, vec![step(16.0, 164, 17.0, 0.0)]);
        let (k, o) = (kv.rows()[0], rr.rows()[0]);
        assert_eq!(k.requests_per_s, 16.4);
        assert_eq!(o.requests_per_s, 16.4);
        assert_eq!(k.output_tokens_per_s, 32.8);
        // The load generator's figure divided by the elapsed time, drain included.
        assert!(rr.bench.steps[0].throughput.requests_per_s < 10.0);
        let w = crate::compare::targets::tests::result(&[16.0], &[], None, vec![kv, rr]);
        let md = workload_markdown(&w, &[]);
        let ratio_row = md
            .lines()
            .find(|l| l.starts_with("| 16 | round-robin |"))
            .unwrap_or_default();
        assert!(ratio_row.ends_with("| 1.00 |"), "throughput 1.00: {md}");
        // Requests that did not complete are not throughput.
        let half = router_run(RouterKind::Kvroute, vec![step(16.0, 82, 10.5, 0.0)]);
        assert_eq!(half.rows()[0].requests_per_s, 8.2);
        assert_eq!(per_arrival_second(5.0, 0.0), 0.0);
        assert_eq!(per_arrival_second(5.0, f64::NAN), 0.0);
    }

    #[test]
    fn each_workload_keeps_the_columns_and_ratios_it_moves() {
        let with_adapters = crate::compare::targets::tests::result(
            &[4.0, 16.0],
            &[],
            None,
            vec![
                router_run(
                    RouterKind::Kvroute,
                    vec![step(4.0, 40, 10.0, 6.0), step(16.0, 160, 10.0, 20.0)],
                ),
                router_run(
                    RouterKind::RoundRobin,
                    vec![step(4.0, 40, 10.0, 18.0), step(16.0, 160, 10.0, 96.0)],
                ),
            ],
        );
        let mut without = with_adapters.clone();
        for run in &mut without.runs {
            for f in &mut run.fleet_steps {
                f.lora_loads = 0.0;
            }
        }
        let md = workload_markdown(&with_adapters, &[]);
        assert!(md.contains("| errors | LoRA loads |\n"), "{md}");
        assert!(md.contains("| throughput | LoRA loads |\n"), "{md}");
        assert!(md.contains("| 0/160 | 96 |\n"), "{md}");
        assert!(md.contains("| 1.00 | 0.21 |\n"), "{md}");
        for gone in ["preemptions", "shed", "prefix hit rate", "ITL", "KV spread"] {
            assert!(!md.contains(&format!("| {gone}")), "{gone}: {md}");
        }
        let md = workload_markdown(&without, &[]);
        assert!(!md.contains("LoRA loads"), "{md}");
        assert!(md.contains("| errors |\n"), "{md}");
        assert!(md.contains("| throughput |\n"), "{md}");
        assert!(md.contains("| round-robin | 16.00 | 32 |"), "{md}");
    }

    #[test]
    fn fleet_plots_leave_out_the_counters_no_router_moved() {
        let mut w = crate::compare::targets::tests::result(
            &[4.0, 16.0],
            &[],
            None,
            vec![router_run(
                RouterKind::Kvroute,
                vec![step(4.0, 40, 10.0, 0.0), step(16.0, 160, 10.0, 3.0)],
            )],
        );
        let (name, panels) = fleet_panels(&w);
        assert_eq!(name, "w-lora-loads.png");
        assert_eq!(panels.len(), 1);
        assert!(panels[0].integer);
        w.runs[0].fleet_steps[0].preemptions = 4.0;
        let (name, panels) = fleet_panels(&w);
        assert_eq!((name.as_str(), panels.len()), ("w-preemptions-lora.png", 2));
        for f in &mut w.runs[0].fleet_steps {
            *f = WindowStats::default();
        }
        assert!(fleet_panels(&w).1.is_empty());
    }

    #[test]
    fn plots_are_written_for_the_panels_that_move() {
        let dir = tempfile::tempdir().expect("tempdir");
        let w = crate::compare::targets::tests::result(
            &[4.0, 16.0],
            &[],
            None,
            vec![router_run(
                RouterKind::Kvroute,
                vec![step(4.0, 40, 10.0, 0.0), step(16.0, 160, 10.0, 0.0)],
            )],
        );
        let files = plots(&w, dir.path()).expect("plots");
        assert_eq!(files, vec!["w-ttft-p90.png".to_string()]);
        let png = std::fs::read(dir.path().join(&files[0])).expect("png");
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 1);
    }

    #[test]
    fn a_workload_without_objectives_or_tenants_has_no_group_table_or_checks() {
        use crate::compare::targets::tests::{requests, result, run};
        let w = result(
            &[4.0],
            &[],
            None,
            vec![run(
                RouterKind::RoundRobin,
                vec![(4.0, requests(None, Some("only"), 5, Some(0.1)))],
            )],
        );
        assert!(!w.has_groups());
        let md = workload_markdown(&w, &[]);
        assert!(!md.contains("per objective and tenant"), "{md}");
        assert!(!md.contains("target checks"), "{md}");
        assert!(!md.contains("Prefix predictions checked"), "{md}");
    }

    #[test]
    fn observed_runs_get_a_table_of_their_prefix_checks_per_source() {
        use crate::compare::targets::tests::{requests, result, run};
        let mut kvroute = run(
            RouterKind::Kvroute,
            vec![(4.0, requests(None, None, 5, Some(0.1)))],
        );
        let check = |source: &str, outcome: &str, requests| PrefixCheckCount {
            source: source.into(),
            outcome: outcome.into(),
            requests,
        };
        kvroute.prefix_checks = vec![
            check("kv_events", "as_predicted", 90),
            check("kv_events", "fewer", 8),
            check("sent", "more", 3),
        ];
        let rr = run(
            RouterKind::RoundRobin,
            vec![(4.0, requests(None, None, 5, Some(0.1)))],
        );
        let md = workload_markdown(&result(&[4.0], &[], None, vec![kvroute, rr]), &[]);
        let table = md
            .split_once("Prefix predictions checked")
            .and_then(|(_, rest)| rest.split("\n\n").nth(1))
            .expect("a table of checks");
        assert!(
            table.contains("| kvroute | kv_events | 90 | 8 | 0 | 0 | 0 |"),
            "{table}"
        );
        assert!(
            table.contains("| kvroute | sent | 0 | 0 | 3 | 0 | 0 |"),
            "{table}"
        );
        assert!(
            !table.contains("round-robin"),
            "only routers that checked: {table}"
        );
    }

    #[test]
    fn routers_on_kv_events_get_a_table_of_what_their_subscriptions_did() {
        use crate::compare::targets::tests::{requests, result, run};
        let mut events = run(
            RouterKind::KvrouteEvents,
            vec![(4.0, requests(None, None, 5, Some(0.1)))],
        );
        events.kv_events = Some(KvEventCounts {
            batches: [("applied".to_owned(), 1_200), ("seen".to_owned(), 3)].into(),
            gaps: 2,
            replays: [("replayed".to_owned(), 1), ("unavailable".to_owned(), 0)].into(),
            resets: 1,
            tokenized: 40,
            tokenize_mean_ms: Some(0.4),
            ..KvEventCounts::default()
        });
        let kvroute = run(
            RouterKind::Kvroute,
            vec![(4.0, requests(None, None, 5, Some(0.1)))],
        );
        let md = workload_markdown(&result(&[4.0], &[], None, vec![events, kvroute]), &[]);
        let table = md
            .split_once("KV events followed")
            .and_then(|(_, rest)| rest.split("\n\n").nth(1))
            .expect("a table of the subscriptions");
        assert!(
            table.contains("| kvroute-events | 1200 | 3 seen | 2 | 1 replayed | 1 | 40 | 0.40 |"),
            "{table}"
        );
        assert!(
            !table.contains("| kvroute |"),
            "only routers on events: {table}"
        );
        let md = workload_markdown(
            &result(
                &[4.0],
                &[],
                None,
                vec![run(
                    RouterKind::Kvroute,
                    vec![(4.0, requests(None, None, 5, Some(0.1)))],
                )],
            ),
            &[],
        );
        assert!(!md.contains("KV events followed"), "{md}");
    }
}
