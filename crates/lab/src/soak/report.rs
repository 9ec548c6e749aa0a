//! The soak's results: `soak.json` (everything), `soak.md` (a summary) and
//! `kvroute-rss-cpu.png` (kvroute's memory and CPU over the run, faults marked). The
//! summaries of the samples and the fault windows are pure.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use super::load::Tally;
use super::procstat::Sample;
use super::schedule::FaultKind;
use crate::compare::report::{KvEventCounts, plot_font};

/// The JSON report's format version.
pub const REPORT_VERSION: u32 = 1;
/// Growth of kvroute's resident memory over the second half of a run that passes review.
pub const RSS_GROWTH_TARGET_PERCENT: f64 = 10.0;
/// Seconds after a fault is over that still count as its aftermath.
pub const AFTERMATH_S: f64 = 10.0;
/// The plot's file name.
pub const PLOT: &str = "kvroute-rss-cpu.png";

/// One fault as it happened.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FaultEvent {
    /// What.
    pub kind: FaultKind,
    /// On which pod.
    pub pod: Option<usize>,
    /// When it struck, seconds since the start.
    pub at_s: f64,
    /// When it was over: the pod or kvroute serving again, `/metrics` answering again.
    pub over_s: f64,
    /// What happened, in words.
    pub detail: String,
    /// Requests that did not complete and ended from `at_s` to `over_s` + [`AFTERMATH_S`],
    /// by outcome.
    pub failures: BTreeMap<String, u64>,
}

/// Failures counted in `per_s` for the seconds from `from` (inclusive) to `to` (exclusive),
/// whole seconds.
pub fn failures_between(
    per_s: &BTreeMap<u64, BTreeMap<String, u64>>,
    from: f64,
    to: f64,
) -> BTreeMap<String, u64> {
    let first = from.max(0.0).floor() as u64;
    let last = to.max(0.0).ceil() as u64;
    let mut sum = BTreeMap::new();
    for (_, counts) in per_s.range(first..last) {
        for (key, n) in counts {
            *sum.entry(key.clone()).or_default() += n;
        }
    }
    sum
}

/// Failures at seconds outside every fault's window.
pub fn failures_outside(
    per_s: &BTreeMap<u64, BTreeMap<String, u64>>,
    faults: &[FaultEvent],
) -> BTreeMap<String, u64> {
    let inside = |second: u64| {
        faults.iter().any(|f| {
            let (from, to) = window(f);
            second >= from.floor() as u64 && second < to.ceil() as u64
        })
    };
    let mut sum = BTreeMap::new();
    for (second, counts) in per_s {
        if !inside(*second) {
            for (key, n) in counts {
                *sum.entry(key.clone()).or_default() += n;
            }
        }
    }
    sum
}

/// A fault's window of attribution.
pub fn window(f: &FaultEvent) -> (f64, f64) {
    (f.at_s, f.over_s + AFTERMATH_S)
}

/// kvroute's memory and CPU over the run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Resources {
    /// Mean resident memory over the first 10 s of load, MiB.
    pub rss_start_mib: Option<f64>,
    /// Mean over the 10 s around the middle of the run, MiB.
    pub rss_mid_mib: Option<f64>,
    /// Mean over the last 10 s, MiB.
    pub rss_end_mib: Option<f64>,
    /// Highest reading of the second half, MiB.
    pub rss_max_second_half_mib: Option<f64>,
    /// (end - mid) / mid, percent.
    pub rss_growth_second_half_percent: Option<f64>,
    /// Whether one kvroute process ran through the whole second half (growth is only
    /// meaningful then).
    pub one_process_in_second_half: bool,
    /// CPU, percent of one core: mean, 95th percentile, highest.
    pub cpu_mean_percent: Option<f64>,
    pub cpu_p95_percent: Option<f64>,
    pub cpu_max_percent: Option<f64>,
    /// Every sample (one a second).
    pub samples: Vec<Sample>,
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// Summarises the samples of a run of `duration_s`.
pub fn resources(samples: Vec<Sample>, duration_s: f64) -> Resources {
    let half = duration_s / 2.0;
    let rss_in = |from: f64, to: f64| {
        mean(
            samples
                .iter()
                .filter(|s| s.t_s >= from && s.t_s < to)
                .map(|s| s.rss_mib),
        )
    };
    let end = samples.iter().map(|s| s.t_s).fold(0.0, f64::max);
    let rss_start_mib = rss_in(0.0, 10.0);
    let rss_mid_mib = rss_in(half - 5.0, half + 5.0);
    let rss_end_mib = rss_in(end - 10.0, end + 1.0);
    let second_half: Vec<&Sample> = samples.iter().filter(|s| s.t_s >= half).collect();
    let one_process_in_second_half =
        second_half.windows(2).all(|w| w[0].pid == w[1].pid) && !second_half.is_empty();
    let rss_growth_second_half_percent = match (rss_mid_mib, rss_end_mib) {
        (Some(mid), Some(end)) if mid > 0.0 => Some(100.0 * (end - mid) / mid),
        _ => None,
    };
    let mut cpu: Vec<f64> = samples.iter().filter_map(|s| s.cpu_percent).collect();
    cpu.sort_by(f64::total_cmp);
    let p95 = (!cpu.is_empty()).then(|| {
        let rank = ((cpu.len() as f64) * 0.95).ceil() as usize;
        cpu[rank.clamp(1, cpu.len()) - 1]
    });
    Resources {
        rss_start_mib,
        rss_mid_mib,
        rss_end_mib,
        rss_max_second_half_mib: second_half.iter().map(|s| s.rss_mib).reduce(f64::max),
        rss_growth_second_half_percent,
        one_process_in_second_half,
        cpu_mean_percent: mean(cpu.iter().copied()),
        cpu_p95_percent: p95,
        cpu_max_percent: cpu.last().copied(),
        samples,
    }
}

/// Everything a soak measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoakReport {
    pub version: u32,
    /// The command line.
    pub command: String,
    /// Cores, CPU, OS.
    pub machine: String,
    /// `original-dst` (fail-closed) or `override-host` (fail-open).
    pub gateway: String,
    pub duration_s: f64,
    /// Asked rate, requests per wall second.
    pub rate: f64,
    /// Requests sent per second of load.
    pub sent_rate: f64,
    pub pods: usize,
    pub speedup: f64,
    pub max_in_flight: usize,
    pub request_timeout_s: f64,
    pub seed: u64,
    /// Wall seconds from starting the fleet to the report.
    pub wall_s: f64,
    pub completed: u64,
    /// Explicit error answers (status + OpenAI-style JSON error).
    pub errors: u64,
    pub cut_by_pod_kill: u64,
    pub lost: u64,
    /// Every count: sent, skipped, outcomes by key, by request kind, per second.
    pub tally: Tally,
    pub faults: Vec<FaultEvent>,
    /// Failures that ended outside every fault's window.
    pub failures_outside_faults: BTreeMap<String, u64>,
    /// Processes that exited without being told to.
    pub unexpected_exits: Vec<String>,
    pub kvroute: Resources,
    pub rss_growth_target_percent: f64,
    /// With `--tokenizer`: the model directory the pods and kvroute tokenized with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// With `--kv-events`: what kvroute's subscriptions counted since its last start, read
    /// at the end of the load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventCounts>,
    /// How long after the load kvroute took to follow every pod's stream again (up to a
    /// bound, after which the counts are read as they are).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_streams_waited_s: Option<f64>,
    /// No request lost and no process died on its own.
    pub passed: bool,
}

impl SoakReport {
    /// Whether the memory target is met (None: not measurable).
    pub fn rss_target_met(&self) -> Option<bool> {
        let growth = self.kvroute.rss_growth_second_half_percent?;
        self.kvroute
            .one_process_in_second_half
            .then_some(growth <= self.rss_growth_target_percent)
    }

    /// The Markdown summary.
    pub fn markdown(&self, plot: Option<&str>) -> String {
        let mut md = String::from("# kvroute soak\n\n");
        let f1 = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.1}"));
        let _ = writeln!(
            md,
            "**{}**: {} lost, {} completed, {} explicit errors, {} streams cut by pod kills, {} not sent (in-flight bound).\n",
            if self.passed { "PASSED" } else { "FAILED" },
            self.lost,
            self.completed,
            self.errors,
            self.cut_by_pod_kill,
            self.tally.skipped
        );
        let _ = writeln!(
            md,
            "Command: `{}`. Machine: {}.\n",
            self.command, self.machine
        );
        let _ = writeln!(
            md,
            "Load: {:.0} s at {} req/s asked, {:.1} req/s sent ({} requests), through Envoy ({} gateway) and kvroute to {} simulated pods (one `kvroute-sim` process each, speedup {}); at most {} in flight; a request without a whole answer after {} s is cut by the client. Wall time {:.0} s.\n",
            self.duration_s,
            self.rate,
            self.sent_rate,
            self.tally.sent,
            self.gateway,
            self.pods,
            self.speedup,
            self.max_in_flight,
            self.request_timeout_s,
            self.wall_s
        );
        if let Some(dir) = &self.tokenizer {
            let _ = writeln!(
                md,
                "The pods and kvroute tokenized prompts with `{dir}` (kvroute's `--tokenizer`).\n"
            );
        }
        md.push_str("## Outcomes\n\n| outcome | requests |\n|---|---:|\n");
        for (key, n) in &self.tally.outcomes {
            let _ = writeln!(md, "| {key} | {n} |");
        }
        if self.tally.skipped > 0 {
            let _ = writeln!(
                md,
                "| not sent (in-flight bound) | {} |",
                self.tally.skipped
            );
        }
        md.push_str("\n## Faults\n\n| at (s) | fault | pod | what happened | over (s) | failures until 10 s after |\n|---:|---|---:|---|---:|---|\n");
        for f in &self.faults {
            let failures = counts_or_none(&f.failures);
            let _ = writeln!(
                md,
                "| {:.1} | {} | {} | {} | {:.1} | {} |",
                f.at_s,
                f.kind.name(),
                f.pod.map_or("-".into(), |p| p.to_string()),
                f.detail,
                f.over_s,
                failures
            );
        }
        let outside = counts_or_none(&self.failures_outside_faults);
        let _ = writeln!(md, "\nFailures outside every fault's window: {outside}.\n");
        if !self.unexpected_exits.is_empty() {
            md.push_str("Processes that exited on their own:\n\n");
            for e in &self.unexpected_exits {
                let _ = writeln!(md, "- {e}");
            }
            md.push('\n');
        }
        let r = &self.kvroute;
        md.push_str("## kvroute's memory and CPU\n\n");
        let _ = writeln!(
            md,
            "RSS (MiB): start {}, middle {}, end {}, highest in the second half {}; growth over the second half {} % (target ≤ {} %{}).\n",
            f1(r.rss_start_mib),
            f1(r.rss_mid_mib),
            f1(r.rss_end_mib),
            f1(r.rss_max_second_half_mib),
            f1(r.rss_growth_second_half_percent),
            self.rss_growth_target_percent,
            match self.rss_target_met() {
                Some(true) => ": met",
                Some(false) => ": MISSED",
                None => ": not measurable, kvroute restarted in the second half",
            }
        );
        let _ = writeln!(
            md,
            "CPU (% of one core, 1 s samples): mean {}, p95 {}, highest {}.\n",
            f1(r.cpu_mean_percent),
            f1(r.cpu_p95_percent),
            f1(r.cpu_max_percent)
        );
        if let Some(plot) = plot {
            let _ = writeln!(md, "![kvroute RSS and CPU]({plot})\n");
        }
        if let Some(k) = &self.kv_events {
            md.push_str(&kv_events_markdown(
                k,
                self.pods,
                self.kv_streams_waited_s.unwrap_or(0.0),
            ));
        }
        if !self.tally.lost_examples.is_empty() {
            md.push_str("## Lost requests (first ones)\n\n");
            for e in &self.tally.lost_examples {
                let _ = writeln!(md, "- {e}");
            }
        }
        md
    }
}

/// What kvroute's KV-event subscriptions did, as read at the end of the load (once it
/// followed every stream, `waited_s` after).
fn kv_events_markdown(k: &KvEventCounts, pods: usize, waited_s: f64) -> String {
    let mut md = String::from("## KV events (kvroute's counters since its last start)\n\n");
    let _ = writeln!(
        md,
        "Streams connected and in sequence at the end: {} of {pods} pods ({waited_s:.1} s after the load ended). Event batches: {}. Gaps found: {}; replays: {}; pods' entries dropped and rebuilt: {}.\n",
        k.streams,
        counts_or_none(&k.batches),
        k.gaps,
        counts_or_none(&k.replays),
        k.resets
    );
    let _ = writeln!(
        md,
        "Prompts tokenized: {} ({} by kvroute itself, the rest on a pod's /tokenize; mean {} ms). Prompt tokens predicted cached on the chosen pod, by source: {}.\n",
        k.tokenized,
        k.tokenized_locally,
        k.tokenize_mean_ms
            .map_or("n/a".to_string(), |ms| format!("{ms:.2}")),
        counts_or_none(&k.predicted_tokens)
    );
    md
}

fn fault_colour(kind: FaultKind) -> RGBColor {
    match kind {
        FaultKind::PodKill => RGBColor(214, 39, 40),
        FaultKind::MetricsHang => RGBColor(255, 127, 14),
        FaultKind::MetricsGarbage => RGBColor(148, 103, 189),
        FaultKind::KvrouteRestart => RGBColor(44, 160, 44),
        FaultKind::KvrouteKill => RGBColor(0, 0, 0),
    }
}

type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// Samples per plotted point at most: a long run's CPU is drawn as means over this many
/// seconds, which keeps the plot readable (and its PNG small) instead of a band of noise.
const PLOT_POINTS: usize = 600;

/// Means of `value` over runs of `per` consecutive samples of one process.
fn smoothed(
    samples: &[Sample],
    per: usize,
    value: &impl Fn(&Sample) -> Option<f64>,
) -> Vec<(u32, f64, f64)> {
    let mut points = Vec::new();
    for process in samples.chunk_by(|a, b| a.pid == b.pid) {
        for run in process.chunks(per.max(1)) {
            let values: Vec<(f64, f64)> = run
                .iter()
                .filter_map(|s| Some((s.t_s, value(s)?)))
                .collect();
            if values.is_empty() {
                continue;
            }
            let n = values.len() as f64;
            let t = values.iter().map(|v| v.0).sum::<f64>() / n;
            let v = values.iter().map(|v| v.1).sum::<f64>() / n;
            points.push((process[0].pid, t, v));
        }
    }
    points
}

/// `kind: n, kind: n` in the map's order, the kinds counted zero times left out, or
/// `none`.
fn counts_or_none(counts: &BTreeMap<String, u64>) -> String {
    let counted: Vec<String> = counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(kind, n)| format!("{kind}: {n}"))
        .collect();
    if counted.is_empty() {
        return "none".to_string();
    }
    counted.join(", ")
}

/// One panel: `value` of the samples against time (means over a few seconds in long runs),
/// a line per kvroute process, the faults as vertical lines.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    report: &SoakReport,
    title: &str,
    y_desc: &str,
    value: impl Fn(&Sample) -> Option<f64>,
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    let text = plot_font().is_some();
    let samples = &report.kvroute.samples;
    let per = samples.len().div_ceil(PLOT_POINTS);
    let points = smoothed(samples, per, &value);
    let x_max = report.duration_s.max(1.0) * 1.02;
    let highest = points.iter().map(|p| p.2).fold(0.0, f64::max);
    let y_max = if highest > 0.0 { highest * 1.15 } else { 1.0 };
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
    // No minor grid: it would be most of the PNG's bytes.
    mesh.light_line_style(WHITE);
    if text {
        mesh.x_desc("seconds since the load started").y_desc(y_desc);
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;
    let mut shown: Vec<FaultKind> = Vec::new();
    for f in &report.faults {
        let c = fault_colour(f.kind);
        let drawn = chart.draw_series(std::iter::once(PathElement::new(
            vec![(f.at_s, 0.0), (f.at_s, y_max)],
            c.mix(0.6).stroke_width(1),
        )))?;
        if text && !shown.contains(&f.kind) {
            shown.push(f.kind);
            drawn
                .label(f.kind.name())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
        }
    }
    // One line per process: a restart starts a new line.
    let mut segment: Vec<(f64, f64)> = Vec::new();
    let mut pid = None;
    let blue = RGBColor(31, 119, 180);
    for (process, t, v) in points {
        if pid != Some(process) && !segment.is_empty() {
            chart.draw_series(LineSeries::new(
                std::mem::take(&mut segment),
                blue.stroke_width(2),
            ))?;
        }
        pid = Some(process);
        segment.push((t, v));
    }
    chart.draw_series(LineSeries::new(segment, blue.stroke_width(2)))?;
    if text && !shown.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

/// Draws [`PLOT`] into `dir`.
pub fn plot(report: &SoakReport, dir: &Path) -> Result<(), String> {
    let path = dir.join(PLOT);
    let draw = || -> PlotResult {
        let root = BitMapBackend::new(&path, (1100, 760)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(380);
        panel(
            &top,
            report,
            "kvroute resident memory",
            "RSS, MiB",
            |s: &Sample| Some(s.rss_mib),
        )?;
        panel(
            &bottom,
            report,
            "kvroute CPU",
            "% of one core",
            |s: &Sample| s.cpu_percent,
        )?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: f64, pid: u32, rss_mib: f64, cpu: Option<f64>) -> Sample {
        Sample {
            t_s,
            pid,
            rss_mib,
            cpu_percent: cpu,
        }
    }

    #[test]
    fn rss_growth_compares_the_end_with_the_middle_of_one_process() {
        // 100 s: 20 MiB until the middle, then a rise to 22 MiB by the end.
        let samples: Vec<Sample> = (0..100)
            .map(|t| {
                let t = f64::from(t);
                let rss = if t < 50.0 {
                    20.0
                } else {
                    20.0 + 2.0 * (t - 50.0) / 50.0
                };
                sample(t, 7, rss, Some(t))
            })
            .collect();
        let r = resources(samples, 100.0);
        assert_eq!(r.rss_start_mib, Some(20.0));
        assert!(r.one_process_in_second_half);
        let growth = r.rss_growth_second_half_percent.expect("growth");
        assert!((growth - 8.0).abs() < 1.0, "{growth}");
        assert_eq!(r.cpu_max_percent, Some(99.0));
        assert_eq!(r.cpu_p95_percent, Some(94.0));
    }

    #[test]
    fn long_runs_are_plotted_as_means_that_never_mix_two_processes() {
        let samples = vec![
            sample(0.0, 1, 10.0, Some(10.0)),
            sample(1.0, 1, 12.0, Some(20.0)),
            sample(2.0, 1, 14.0, None),
            sample(3.0, 2, 5.0, Some(40.0)),
        ];
        let cpu = smoothed(&samples, 2, &|s: &Sample| s.cpu_percent);
        assert_eq!(cpu, vec![(1, 0.5, 15.0), (2, 3.0, 40.0)]);
        let rss = smoothed(&samples, 2, &|s: &Sample| Some(s.rss_mib));
        assert_eq!(rss, vec![(1, 0.5, 11.0), (1, 2.0, 14.0), (2, 3.0, 5.0)]);
    }

    #[test]
    fn a_restart_in_the_second_half_is_flagged() {
        let samples = vec![
            sample(40.0, 1, 20.0, None),
            sample(60.0, 1, 21.0, None),
            sample(70.0, 2, 10.0, None),
            sample(99.0, 2, 12.0, None),
        ];
        assert!(!resources(samples, 100.0).one_process_in_second_half);
    }

    #[test]
    fn failures_are_summed_per_fault_window_and_outside() {
        let mut per_s: BTreeMap<u64, BTreeMap<String, u64>> = BTreeMap::new();
        for (second, key) in [(5, "lost reset"), (21, "error 503 x"), (35, "error 503 x")] {
            *per_s
                .entry(second)
                .or_default()
                .entry(key.to_string())
                .or_default() += 1;
        }
        let fault = FaultEvent {
            kind: FaultKind::PodKill,
            pod: Some(0),
            at_s: 20.5,
            over_s: 23.5,
            detail: String::new(),
            failures: BTreeMap::new(),
        };
        let (from, to) = window(&fault);
        assert_eq!(failures_between(&per_s, from, to)["error 503 x"], 1);
        let outside = failures_outside(&per_s, &[fault]);
        assert_eq!(outside["lost reset"], 1);
        assert_eq!(outside["error 503 x"], 1, "35 s is past 23.5 + 10 s");
    }
}
