//! The comparison's results: per-router runs → rows per workload and rate → `report.md`
//! (tables, ratios kvroute / each other router, the knee rate, per-objective and per-tenant
//! tables and target checks where requests carried objectives or tenants) and PNG plots
//! (plotters). The row building, knee and ratio computations are pure.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use serde::Serialize;

use super::fleet_stats::WindowStats;
use super::routers::RouterKind;
use super::targets;
use crate::loadgen::report::Report;

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
    /// Successful requests per simulated second.
    pub requests_per_s: f64,
    /// Completed requests per simulated second in the second half of the step's arrivals.
    pub steady_requests_per_s: Option<f64>,
    /// Output tokens per simulated second.
    pub output_tokens_per_s: f64,
    /// TTFT p50, p90, p99 (s) at real scale: the pods' simulated TTFT plus the wall time
    /// spent outside them, unscaled, except a gateway queue wait (in simulated time); the
    /// client's TTFT where the pods report no timing.
    pub ttft: [Option<f64>; 3],
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
                    requests_per_s: s.throughput.requests_per_s,
                    steady_requests_per_s: s.throughput.steady_requests_per_s,
                    output_tokens_per_s: s.throughput.output_tokens_per_s,
                    ttft: if s.ttft_real_scale_s.p90.is_some() {
                        let t = &s.ttft_real_scale_s;
                        [t.p50, t.p90, t.p99]
                    } else {
                        [s.ttft_s.p50, s.ttft_s.p90, s.ttft_s.p99]
                    },
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
}

fn num(v: Option<f64>, digits: usize) -> String {
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
    let rows: Vec<(RouterKind, Vec<Row>)> = w.runs.iter().map(|r| (r.router, r.rows())).collect();
    for &rate in &w.rates {
        let marker = if knee.is_some_and(|k| same_rate(k, rate)) {
            " — knee"
        } else {
            ""
        };
        let _ = writeln!(s, "### {} at {rate} req/s{marker}\n", w.workload);
        s.push_str(
            "| router | req/s | tok/s | TTFT p50 s | TTFT p90 s | TTFT p99 s | pod TTFT p90 s | path p50 ms | path p90 ms | client TTFT p90 s | ITL p50 s | ITL p90 s | e2e p90 s | errors | shed | preemptions | LoRA loads | prefix hit rate | KV spread |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for (kind, rs) in &rows {
            let Some(r) = rs.iter().find(|r| same_rate(r.rate, rate)) else {
                continue;
            };
            let _ = writeln!(
                s,
                "| {} | {:.2} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}/{} | {} | {:.0} | {:.0} | {} | {} |",
                kind.name(),
                r.requests_per_s,
                r.output_tokens_per_s,
                num(r.ttft[0], 3),
                num(r.ttft[1], 3),
                num(r.ttft[2], 3),
                num(r.pod_ttft_p90, 3),
                num(r.path_ms[0], 1),
                num(r.path_ms[1], 1),
                num(r.client_ttft_p90, 3),
                num(r.itl[0], 4),
                num(r.itl[1], 4),
                num(r.e2e_p90, 3),
                r.errors,
                r.requests,
                r.shed,
                r.preemptions,
                r.lora_loads,
                num(r.prefix_hit_rate, 3),
                num(r.kv_spread, 3),
            );
        }
        s.push('\n');
    }
    s.push_str(&ratio_markdown(w, &rows, knee));
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

fn ratio_markdown(
    w: &WorkloadResult,
    rows: &[(RouterKind, Vec<Row>)],
    knee: Option<f64>,
) -> String {
    let mut s = String::new();
    let Some((_, ours)) = rows.iter().find(|(k, _)| *k == RouterKind::Kvroute) else {
        return s;
    };
    if rows.len() < 2 {
        return s;
    }
    let _ = writeln!(
        s,
        "### {}: kvroute / each other router\n\nBelow 1 is better for kvroute, except throughput (above 1 is better). `-`: not defined (a zero or missing denominator).\n",
        w.workload
    );
    s.push_str(
        "| rate | vs | TTFT p50 | TTFT p90 | TTFT p99 | pod TTFT p90 | client TTFT p90 | e2e p90 | throughput | preemptions | LoRA loads | KV spread |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
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
            let _ = writeln!(
                s,
                "| {rate}{marker} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                kind.name(),
                num(ratio(k.ttft[0], o.ttft[0]), 2),
                num(ratio(k.ttft[1], o.ttft[1]), 2),
                num(ratio(k.ttft[2], o.ttft[2]), 2),
                num(ratio(k.pod_ttft_p90, o.pod_ttft_p90), 2),
                num(ratio(k.client_ttft_p90, o.client_ttft_p90), 2),
                num(ratio(k.e2e_p90, o.e2e_p90), 2),
                num(ratio(Some(k.requests_per_s), Some(o.requests_per_s)), 2),
                num(ratio(Some(k.preemptions), Some(o.preemptions)), 2),
                num(ratio(Some(k.lora_loads), Some(o.lora_loads)), 2),
                num(ratio(k.kv_spread, o.kv_spread), 2),
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
        "| rate | router | group | completed/planned | shed | errors | req/s | real-scale TTFT p50 s | real-scale TTFT p90 s | client TTFT p90 s | e2e p90 s |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for &rate in &w.rates {
        for run in &w.runs {
            let Some(step) = run.bench.steps.iter().find(|st| same_rate(st.rate, rate)) else {
                continue;
            };
            for (label, g) in step.groups() {
                let _ = writeln!(
                    s,
                    "| {rate} | {} | {label} | {}/{} | {} | {} | {:.2} | {} | {} | {} | {} |",
                    run.router.name(),
                    g.completed,
                    g.planned,
                    shed_cell(g.shed, &g.shed_by_reason),
                    g.errors,
                    g.requests_per_s,
                    num(g.ttft_real_scale_s.p50, 3),
                    num(g.ttft_real_scale_s.p90, 3),
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
requests per simulated second of the step's elapsed time.
";

/// Column meanings, for the top of the report.
pub const LEGEND: &str = "\
Columns: `req/s`, `tok/s`: successful requests and output tokens per simulated second;
`TTFT`: time to first token at real scale, the pod's own TTFT (simulated time, from the
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
reason), neither successes nor errors; `preemptions`, `LoRA loads` (GPU slot loads, disk + host): fleet counters over the
step (from `/metrics` sampled every ~250 ms of wall time, cut at the step boundaries by
interpolation); `prefix hit rate`: prefix-cache hit tokens / queried tokens over the step;
`KV spread`: mean over the step's samples of (max − min) KV-cache usage across pods (0–1).
";

// ---------------------------------------------------------------------------------------
// Plots.

const COLOURS: [RGBColor; 5] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
];

fn colour(kind: RouterKind) -> RGBColor {
    let i = RouterKind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
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

/// One panel: a line per router of `value(row)` against the rate.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    w: &WorkloadResult,
    title: &str,
    y_desc: &str,
    value: impl Fn(&Row) -> Option<f64>,
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
                .filter_map(|r| Some((r.rate, value(r)?)))
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
    // All zero (e.g. no preemptions): a 0–1 axis rather than a degenerate one.
    let y_max = if highest > 0.0 { highest * 1.1 } else { 1.0 };
    let mut builder = ChartBuilder::on(area);
    builder.margin(12);
    if text {
        builder
            .caption(title, ("sans-serif", 20))
            .x_label_area_size(40)
            .y_label_area_size(60);
    }
    let mut chart = builder.build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("rate, requests per simulated second")
            .y_desc(y_desc);
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;
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

/// Writes `<workload>-ttft-p90.png` and `<workload>-preemptions-lora.png` into `dir`;
/// returns their file names.
pub fn plots(w: &WorkloadResult, dir: &Path) -> Result<Vec<String>, String> {
    let ttft = format!("{}-ttft-p90.png", w.workload);
    let fleet = format!("{}-preemptions-lora.png", w.workload);
    let draw = || -> PlotResult {
        let ttft_path = dir.join(&ttft);
        let root = BitMapBackend::new(&ttft_path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        panel(
            &root,
            w,
            &format!("{}: p90 TTFT vs rate", w.workload),
            "p90 TTFT, simulated s",
            |r| r.ttft[1],
        )?;
        root.present()?;
        let fleet_path = dir.join(&fleet);
        let root = BitMapBackend::new(&fleet_path, (1400, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(700);
        panel(
            &left,
            w,
            &format!("{}: preemptions per step", w.workload),
            "preemptions",
            |r| Some(r.preemptions),
        )?;
        panel(
            &right,
            w,
            &format!("{}: LoRA loads per step", w.workload),
            "adapter loads",
            |r| Some(r.lora_loads),
        )?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| e.to_string())?;
    Ok(vec![ttft, fleet])
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(md.contains("| errors | shed | preemptions |"), "{md}");
        assert!(md.contains("### w: per objective and tenant"), "{md}");
        assert!(
            md.contains(
                "| 44 | kvroute | objective critical | 8/8 | 0 | 0 | 0.80 | 0.250 | 0.250 | 0.250 | 0.750 |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| 44 | kvroute | objective sheddable | 0/3 | 3 (rejected-saturated 3) | 0 | 0.00 | - | - | - | - |"),
            "{md}"
        );
        assert!(md.contains("### w: target checks"), "{md}");
        assert!(
            md.contains("critical p90 TTFT at 44 req/s (2.0× capacity): 0.250 s vs 0.200 s"),
            "{md}"
        );
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
    }
}
