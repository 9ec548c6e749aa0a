//! What `compare` and `demo` print on the terminal, in three parts: a headline per workload
//! (the knee, kvroute's p90 TTFT there against each other router's, the fleet counters that
//! move in the workload, errors), where the full report, raw JSON and plots are, then a
//! compact table per workload (a few columns per rate). Every line fits [`WIDTH`] columns
//! but a long path; the wide tables stay in report.md. Pure.

use std::fmt::Write as _;
use std::path::Path;

use super::columns::Column;
use super::report::{KNEE_FACTOR, Row, WorkloadResult, columns_of, num, ratio, same_rate};
use super::routers::RouterKind;

/// The terminal width the summary is laid out for.
pub const WIDTH: usize = 100;

/// Fleet counters the headline reports where they move, in its order.
const HEADLINE_COUNTERS: [Column; 3] = [Column::Shed, Column::LoraLoads, Column::Preemptions];

/// Columns of the compact table after the TTFT and errors, where they move, in order of
/// interest: the first [`COMPACT_EXTRAS`] that fit.
const COMPACT_CANDIDATES: [Column; 4] = [
    Column::Shed,
    Column::LoraLoads,
    Column::Preemptions,
    Column::PrefixHitRate,
];
/// Most workload-specific columns in the compact table.
const COMPACT_EXTRAS: usize = 2;

/// The whole terminal summary of `results`; `plots[i]` are the plot files of `results[i]`,
/// written with report.md and the raw JSON into `out`.
pub fn terminal(results: &[WorkloadResult], plots: &[Vec<String>], out: &Path) -> String {
    let mut s = String::new();
    for w in results {
        for line in headline(w) {
            let _ = writeln!(s, "{line}");
        }
        s.push('\n');
    }
    for line in locations(results, plots, out) {
        let _ = writeln!(s, "{line}");
    }
    for w in results {
        s.push('\n');
        for line in compact_table(w) {
            let _ = writeln!(s, "{line}");
        }
    }
    s
}

/// A workload's headline: what ran, the knee, and at the knee (else at the highest rate)
/// p90 TTFT with kvroute's ratio to each other router, the counters that move in this
/// workload, and errors.
pub fn headline(w: &WorkloadResult) -> Vec<String> {
    let rates: Vec<String> = w.rates.iter().map(|r| r.to_string()).collect();
    let mut lines = vec![format!(
        "{}: {} pods at speedup {}, rates {} req/s, steps of {} s (simulated)",
        w.workload,
        w.pods,
        w.speedup,
        rates.join(", "),
        w.step_duration_s
    )];
    for (kind, reason) in &w.failures {
        let reason = reason.lines().next().unwrap_or_default();
        lines.push(clip(&format!("  {} failed: {reason}", kind.name())));
    }
    let lowest = w.rates.iter().copied().reduce(f64::min);
    let (Some(lowest), Some(highest)) = (lowest, w.rates.iter().copied().reduce(f64::max)) else {
        return lines;
    };
    let rr = RouterKind::RoundRobin.name();
    let (at, label) = match w.knee() {
        Some(k) => {
            lines.push(format!(
                "  knee: {k} req/s, where {rr}'s p90 TTFT reaches {KNEE_FACTOR}x its value at {lowest} req/s"
            ));
            (k, format!("at the knee ({k} req/s)"))
        }
        None => {
            lines.push(if w.run(RouterKind::RoundRobin).is_some() {
                format!(
                    "  knee: not reached, {rr}'s p90 TTFT stays under {KNEE_FACTOR}x its value at {lowest} req/s"
                )
            } else {
                format!("  knee: unknown, {rr} did not run")
            });
            (highest, format!("at the highest rate ({highest} req/s)"))
        }
    };
    let rows: Vec<(RouterKind, Row)> = w
        .runs
        .iter()
        .filter_map(|run| {
            let row = run.rows().into_iter().find(|r| same_rate(r.rate, at))?;
            Some((run.router, row))
        })
        .collect();
    let ours = rows
        .iter()
        .find(|(k, _)| *k == RouterKind::Kvroute)
        .map(|(_, r)| *r);
    // kvroute first, then the others with kvroute's ratio to each.
    let ordered = rows
        .iter()
        .filter(|(k, _)| *k == RouterKind::Kvroute)
        .chain(rows.iter().filter(|(k, _)| *k != RouterKind::Kvroute));
    let items = |column: Column, cell: &dyn Fn(&Row) -> String| -> Vec<String> {
        ordered
            .clone()
            .map(|(kind, r)| {
                let times = match ours {
                    Some(k) if *kind != RouterKind::Kvroute => {
                        ratio(column.value(&k), column.value(r))
                            .map(|x| format!(" ({x:.2}x)"))
                            .unwrap_or_default()
                    }
                    _ => String::new(),
                };
                format!("{} {}{times}", kind.name(), cell(r))
            })
            .collect()
    };
    let p90 = items(Column::TtftP90, &|r| format!("{} s", num(r.ttft[1], 3)));
    lines.extend(wrap(&format!("  p90 TTFT {label}: "), &p90, "      "));
    let columns = w.columns();
    if columns.contains(&Column::TtftP90All) {
        // Where a router shed or failed requests: its p90 counting those as slowest.
        let all = items(Column::TtftP90All, &|r| match Column::TtftP90All.value(r) {
            Some(v) => format!("{v:.3} s"),
            None => Column::TtftP90All.cell(r),
        });
        let head = format!("  p90 TTFT with the unserved last {label}: ");
        lines.extend(wrap(&head, &all, "      "));
    }
    for counter in HEADLINE_COUNTERS
        .into_iter()
        .filter(|c| columns.contains(c))
    {
        let counts = items(counter, &|r| counter.cell(r));
        let head = format!("  {} {label}: ", counter.header());
        lines.extend(wrap(&head, &counts, "      "));
    }
    let errors: Vec<String> = ordered
        .map(|(kind, r)| format!("{} {}", kind.name(), Column::Errors.cell(r)))
        .collect();
    lines.extend(wrap(&format!("  errors {label}: "), &errors, "      "));
    lines
}

/// Where the full report, the raw JSON and the plots are.
pub fn locations(results: &[WorkloadResult], plots: &[Vec<String>], out: &Path) -> Vec<String> {
    let at = |file: &str| out.join(file).display().to_string();
    let mut lines = vec![format!(
        "Full report (every column, the ratios, the legend): {}",
        at("report.md")
    )];
    let json = [
        format!("{} (everything)", at("results.json")),
        format!("{} (each run)", at("<workload>-<router>.json")),
    ];
    lines.extend(wrap("Raw JSON: ", &json, "    "));
    let files: Vec<String> = plots.iter().flatten().map(|p| at(p)).collect();
    if !files.is_empty() {
        lines.extend(wrap("Plots: ", &files, "    "));
    }
    if results.iter().any(|w| w.runs.is_empty()) {
        lines.push("(a workload on which no router ran has no table below)".into());
    }
    lines
}

/// A workload's compact table: per rate and router the throughput, p90 and p99 TTFT, errors
/// and up to [`COMPACT_EXTRAS`] of the counters that move in this workload.
pub fn compact_table(w: &WorkloadResult) -> Vec<String> {
    if w.runs.is_empty() {
        return Vec::new();
    }
    let rows = w.rows();
    let kept = columns_of(&rows);
    let mut columns = vec![
        Column::RequestsPerS,
        Column::TtftP90,
        Column::TtftP99,
        Column::Errors,
    ];
    columns.extend(
        COMPACT_CANDIDATES
            .into_iter()
            .filter(|c| kept.contains(c))
            .take(COMPACT_EXTRAS),
    );
    let knee = w.knee();
    let title = format!("{} by rate (all columns in report.md):", w.workload);
    loop {
        let mut header = vec!["rate", "router"];
        header.extend(columns.iter().map(|c| c.header()));
        let mut cells = Vec::new();
        for &rate in &w.rates {
            let mut first = true;
            for (kind, rs) in &rows {
                let Some(r) = rs.iter().find(|r| same_rate(r.rate, rate)) else {
                    continue;
                };
                let rate_cell = match (first, knee.is_some_and(|k| same_rate(k, rate))) {
                    (false, _) => String::new(),
                    (true, true) => format!("{rate} knee"),
                    (true, false) => rate.to_string(),
                };
                first = false;
                let mut line = vec![rate_cell, kind.name().to_string()];
                line.extend(columns.iter().map(|c| c.cell(r)));
                cells.push(line);
            }
        }
        let table = render(&header, &cells, 2, "  ");
        let fits = table.iter().all(|l| l.chars().count() <= WIDTH);
        if fits || columns.len() <= 4 {
            return std::iter::once(title).chain(table).collect();
        }
        columns.pop();
    }
}

/// `header` and `rows` as aligned columns two spaces apart, the first `left` columns aligned
/// left and the others right, each line after `indent`.
fn render(header: &[&str], rows: &[Vec<String>], left: usize, indent: &str) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let laid: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, &w))| {
                if i < left {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        format!("{indent}{}", laid.join("  ").trim_end())
    };
    std::iter::once(line(header.to_vec()))
        .chain(
            rows.iter()
                .map(|r| line(r.iter().map(String::as_str).collect())),
        )
        .collect()
}

/// `first` then `items` joined with ", ", broken at items into lines of at most [`WIDTH`]
/// columns (an item longer than that alone on its line); later lines start with `indent`.
fn wrap(first: &str, items: &[String], indent: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = first.to_string();
    let mut empty = true;
    for (i, item) in items.iter().enumerate() {
        let piece = if i + 1 < items.len() {
            format!("{item},")
        } else {
            item.clone()
        };
        let sep = if empty { "" } else { " " };
        if !empty && line.chars().count() + sep.len() + piece.chars().count() > WIDTH {
            lines.push(line);
            line = format!("{indent}{piece}");
        } else {
            line.push_str(sep);
            line.push_str(&piece);
        }
        empty = false;
    }
    lines.push(line);
    lines
}

/// `line` cut to [`WIDTH`] columns, with `...` where it was cut.
fn clip(line: &str) -> String {
    if line.chars().count() <= WIDTH {
        return line.to_string();
    }
    let mut cut: String = line.chars().take(WIDTH - 3).collect();
    cut.push_str("...");
    cut
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::fleet_stats::WindowStats;
    use crate::compare::report::RouterRun;
    use crate::compare::targets::tests::{requests, result, run};

    /// A run of `router` at 4, 8 and 16 req/s: 40, 80 and 160 completed requests of TTFT
    /// `ttft[i]`, `shed[i]` shed, and the fleet counters `lora[i]`, `preempt[i]`.
    fn router(
        router: RouterKind,
        ttft: [f64; 3],
        shed: [usize; 3],
        lora: [f64; 3],
        preempt: [f64; 3],
    ) -> RouterRun {
        let steps = [4.0, 8.0, 16.0]
            .into_iter()
            .enumerate()
            .map(|(i, rate)| {
                let mut records = requests(None, None, rate as usize * 10, Some(ttft[i]));
                records.extend(requests(None, None, shed[i], None));
                (rate, records)
            })
            .collect();
        let mut r = run(router, steps);
        r.fleet_steps = (0..3)
            .map(|i| WindowStats {
                lora_loads: lora[i],
                preemptions: preempt[i],
                prefix_hit_rate: Some(0.0),
                ..WindowStats::default()
            })
            .collect();
        r
    }

    /// Every router, the knee at 16 req/s (round robin 0.1 s → 2.904 s), LoRA loads that
    /// move, no preemptions, no shedding.
    fn five_routers() -> WorkloadResult {
        let runs = vec![
            router(
                RouterKind::Kvroute,
                [0.05, 0.08, 0.165],
                [0; 3],
                [6.0, 17.0, 20.0],
                [0.0; 3],
            ),
            router(
                RouterKind::RoundRobin,
                [0.1, 0.2, 2.904],
                [0; 3],
                [18.0, 57.0, 96.0],
                [0.0; 3],
            ),
            router(
                RouterKind::LeastRequest,
                [0.1, 0.2, 1.2],
                [0; 3],
                [20.0, 60.0, 1096.0],
                [0.0; 3],
            ),
            router(
                RouterKind::Sglang,
                [0.1, 0.2, 0.5],
                [0; 3],
                [5.0, 10.0, 12.0],
                [0.0; 3],
            ),
            router(
                RouterKind::VllmRouter,
                [0.1, 0.3, 0.6],
                [0; 3],
                [5.0, 10.0, 13.0],
                [0.0; 3],
            ),
        ];
        let mut w = result(&[4.0, 8.0, 16.0], &[], None, runs);
        w.workload = "multi-lora".into();
        w
    }

    fn assert_fits(lines: &[String]) {
        for l in lines {
            assert!(
                l.chars().count() <= WIDTH,
                "{} columns: {l}",
                l.chars().count()
            );
        }
    }

    #[test]
    fn the_headline_gives_the_knee_kvroutes_p90_against_each_router_and_the_moving_counters() {
        let lines = headline(&five_routers());
        let text = lines.join("\n");
        assert_fits(&lines);
        assert!(lines[0].starts_with("multi-lora: 8 pods"), "{text}");
        assert!(text.contains("knee: 16 req/s"), "{text}");
        assert!(
            text.contains(
                "p90 TTFT at the knee (16 req/s): kvroute 0.165 s, round-robin 2.904 s (0.06x),"
            ),
            "{text}"
        );
        for other in [
            "least-request 1.200 s (0.14x)",
            "sglang 0.500 s (0.33x)",
            "vllm-router 0.600 s (0.28x)",
        ] {
            assert!(text.contains(other), "{other}: {text}");
        }
        assert!(
            text.contains("LoRA loads at the knee (16 req/s): kvroute 20, round-robin 96 (0.21x)"),
            "{text}"
        );
        assert!(
            text.contains("errors at the knee (16 req/s): kvroute 0/160, round-robin 0/160,"),
            "{text}"
        );
        // No router preempted or shed anything: the headline does not say so at length.
        assert!(!text.contains("preemptions"), "{text}");
        assert!(!text.contains("shed"), "{text}");
        assert!(lines.len() <= 8, "a few lines: {text}");
    }

    #[test]
    fn without_a_knee_the_headline_reads_the_highest_rate() {
        let mut w = five_routers();
        w.runs.retain(|r| r.router != RouterKind::RoundRobin);
        w.failures
            .push((RouterKind::RoundRobin, "envoy exited\nwith details".into()));
        let text = headline(&w).join("\n");
        assert!(text.contains("round-robin failed: envoy exited"), "{text}");
        assert!(!text.contains("with details"), "{text}");
        assert!(
            text.contains("knee: unknown, round-robin did not run"),
            "{text}"
        );
        assert!(
            text.contains("p90 TTFT at the highest rate (16 req/s): kvroute 0.165 s"),
            "{text}"
        );
    }

    #[test]
    fn a_workload_that_sheds_and_preempts_says_so_in_its_headline() {
        let runs = vec![
            router(
                RouterKind::Kvroute,
                [0.1; 3],
                [0, 0, 30],
                [0.0; 3],
                [0.0, 0.0, 2.0],
            ),
            router(
                RouterKind::RoundRobin,
                [0.1, 0.2, 0.5],
                [0; 3],
                [0.0; 3],
                [0.0, 5.0, 89.0],
            ),
        ];
        let w = result(&[4.0, 8.0, 16.0], &[], None, runs);
        let text = headline(&w).join("\n");
        assert!(
            text.contains("shed at the knee (16 req/s): kvroute 30, round-robin 0\n"),
            "{text}"
        );
        assert!(
            text.contains("preemptions at the knee (16 req/s): kvroute 2, round-robin 89 (0.02x)"),
            "{text}"
        );
        assert!(!text.contains("LoRA"), "{text}");
        // 30 shed of 190: the p90 of all requests falls on a shed one.
        assert!(
            text.contains(
                "p90 TTFT with the unserved last at the knee (16 req/s): kvroute unserved, \
                 round-robin 0.500 s\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn the_compact_table_fits_a_hundred_columns_with_the_workloads_counters() {
        let w = five_routers();
        let table = compact_table(&w);
        assert_fits(&table);
        let text = table.join("\n");
        assert!(table[1].contains("LoRA loads"), "{text}");
        assert!(
            !text.contains("preemptions") && !text.contains("shed"),
            "{text}"
        );
        assert!(!text.contains("prefix"), "{text}");
        // A header and one row per router and rate.
        assert_eq!(table.len(), 2 + 5 * 3, "{text}");
        let knee_row = table
            .iter()
            .find(|l| l.contains("16 knee"))
            .expect("the knee is marked");
        assert!(knee_row.contains("kvroute"), "{knee_row}");
        assert!(knee_row.trim_end().ends_with(" 20"), "{knee_row}");
        let least = table
            .iter()
            .filter(|l| l.contains("least-request"))
            .nth(2)
            .expect("least-request at 16");
        assert!(least.trim_end().ends_with(" 1096"), "{least}");
    }

    #[test]
    fn the_terminal_summary_starts_with_the_headline_and_says_where_the_files_are() {
        let w = five_routers();
        let plots = vec![vec![
            "multi-lora-ttft-p90.png".to_string(),
            "multi-lora-lora-loads.png".to_string(),
        ]];
        let text = terminal(&[w.clone(), w], &plots, Path::new("out"));
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        assert_fits(&lines);
        assert!(lines[0].starts_with("multi-lora: "), "{text}");
        let report = text.find("out/report.md").expect("the report is named");
        let plot = text
            .find("out/multi-lora-lora-loads.png")
            .expect("plots named");
        let table = text.find("by rate").expect("a compact table");
        assert!(
            text.find("p90 TTFT at the knee")
                .is_some_and(|h| h < report)
        );
        assert!(report < table && plot < table, "{text}");
        assert!(text.contains("out/results.json"), "{text}");
        // One headline and one table per workload.
        assert_eq!(text.matches("p90 TTFT at the knee").count(), 2, "{text}");
        assert_eq!(text.matches("by rate").count(), 2, "{text}");
        assert!(
            !text.contains("| "),
            "no Markdown table on the terminal: {text}"
        );
    }

    #[test]
    fn long_lists_wrap_at_items_within_the_width() {
        let items: Vec<String> = (0..30).map(|i| format!("router{i} 0.123 s")).collect();
        let lines = wrap("  p90 TTFT: ", &items, "      ");
        assert!(lines.len() > 1);
        assert_fits(&lines);
        assert!(lines[1].starts_with("      router"), "{lines:?}");
        assert_eq!(lines.join(" ").matches("router").count(), 30);
        assert_eq!(clip(&"x".repeat(150)).chars().count(), WIDTH);
    }
}
