//! `compare --repeat N` and `simulate --seeds A-B`: the same comparison run several
//! times (live, or offline with another seed each time), and each router's p90 TTFT at
//! each rate over the runs.
//!
//! Near a workload's knee one run's p90 is either low or several times higher (a burst that
//! builds a queue the step never drains), for any router, so the ratio of two routers'
//! p90s in one run can land anywhere from a third to several times whatever the routers
//! (docs/kv-events.md, "Several replicas"). Runs show the spread, the mean and median, and
//! each run's ratio to the first router named, which one run cannot.

use std::fmt::Write;

use super::report::{WorkloadResult, num, ratio, same_rate};
use super::routers::RouterKind;

/// The seeds of `--seeds`, in the order given, each once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seeds(pub Vec<u64>);

/// Most seeds one `--seeds` runs (each a whole comparison or simulation).
const MAX_SEEDS: u64 = 10_000;

/// `--seeds`: comma-separated seeds and inclusive ranges (`1-32`).
pub fn parse_seeds(text: &str) -> Result<Seeds, String> {
    let mut seeds: Vec<u64> = Vec::new();
    for item in text.split(',').map(str::trim) {
        let number = |s: &str| {
            s.trim()
                .parse::<u64>()
                .map_err(|e| format!("`{s}` in `{text}` is not a seed: {e}"))
        };
        let (first, last) = match item.split_once('-') {
            Some((first, last)) => (number(first)?, number(last)?),
            None => {
                let seed = number(item)?;
                (seed, seed)
            }
        };
        if first > last {
            return Err(format!(
                "`{item}`: a range runs from the lower seed to the higher"
            ));
        }
        if last - first >= MAX_SEEDS || seeds.len() as u64 + (last - first) >= MAX_SEEDS {
            return Err(format!("`{text}` names more than {MAX_SEEDS} seeds"));
        }
        for seed in first..=last {
            if !seeds.contains(&seed) {
                seeds.push(seed);
            }
        }
    }
    Ok(Seeds(seeds))
}

/// Runs up to this many list each one's value in the table; more list only the summary
/// (each run's report is in its own directory).
const LISTED_RUNS: usize = 10;

/// One router's figures at one rate, one entry per run (`None`: no value that time).
struct Series {
    router: RouterKind,
    p90: Vec<Option<f64>>,
    /// The p90 of all requests, the unserved counted as slowest (infinite where it fell on
    /// one).
    p90_all: Vec<Option<f64>>,
    hit_rate: Vec<Option<f64>>,
    shed: Vec<Option<f64>>,
    preemptions: Vec<Option<f64>>,
    lora_loads: Vec<Option<f64>>,
}

/// The figures of `workload` (its position in each run's results) at `rate`, per router
/// in the first run's order.
fn series(runs: &[Vec<WorkloadResult>], workload: usize, rate: f64) -> Vec<Series> {
    let Some(first) = runs.first().and_then(|r| r.get(workload)) else {
        return Vec::new();
    };
    first
        .runs
        .iter()
        .map(|run| {
            let rows: Vec<_> = runs
                .iter()
                .map(|results| {
                    let run = results.get(workload)?.run(run.router)?;
                    run.rows().into_iter().find(|row| same_rate(row.rate, rate))
                })
                .collect();
            let each = |f: &dyn Fn(&super::report::Row) -> Option<f64>| {
                rows.iter().map(|row| row.as_ref().and_then(f)).collect()
            };
            Series {
                router: run.router,
                p90: each(&|row| row.ttft[1]),
                p90_all: each(&|row| {
                    (row.requests > 0).then(|| row.ttft_p90_all.unwrap_or(f64::INFINITY))
                }),
                hit_rate: each(&|row| row.prefix_hit_rate),
                shed: each(&|row| Some(row.shed as f64)),
                preemptions: each(&|row| Some(row.preemptions)),
                lora_loads: each(&|row| Some(row.lora_loads)),
            }
        })
        .collect()
}

/// The finite values among `values`.
fn finite(values: impl IntoIterator<Item = Option<f64>>) -> Vec<f64> {
    values
        .into_iter()
        .flatten()
        .filter(|v| v.is_finite())
        .collect()
}

/// The median of the finite values, if any.
fn median(values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let mut v = finite(values);
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

/// The mean of the finite values, if any.
fn mean(values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let v = finite(values);
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn joined(values: &[Option<f64>], digits: usize) -> String {
    values
        .iter()
        .map(|v| num(*v, digits))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// `repeats.md` of `compare --repeat N`: see [`markdown_of`].
pub fn markdown(repeats: &[Vec<WorkloadResult>]) -> String {
    markdown_of(
        &format!(
            "# kvroute-lab compare: {} repeats\n\nEach repeat is a whole comparison (its report \
             in `repeat-K/`).",
            repeats.len()
        ),
        "repeat",
        repeats,
    )
}

/// `seeds.md` of `kvroute-lab <command> --seeds`: [`markdown_of`] over one run per seed,
/// under a heading that names the command line and the seeds.
pub fn seeds_markdown(command: &str, seeds: &[u64], runs: &[Vec<WorkloadResult>]) -> String {
    let names = |seeds: &[u64]| {
        seeds
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let listed = match seeds {
        [first @ .., last] if seeds.len() > 6 => format!("{}, …, {last}", names(&first[..3])),
        _ => names(seeds),
    };
    let line: Vec<String> = std::env::args().collect();
    markdown_of(
        &format!(
            "# kvroute-lab {command}: {} seeds\n\nCommand: `{}`. Seeds {listed}, each a whole \
             run (its report in `seed-N/`).",
            seeds.len(),
            line.join(" ")
        ),
        "seed",
        runs,
    )
}

/// Below `heading`, for each workload, each rate and each router: the p90 TTFT over the
/// runs (each run's when there are at most [`LISTED_RUNS`], named `each` in the column
/// heads), their mean, median and range, and for every router but the first named the
/// ratio of its mean to the first router's, each run's ratio to the first router's p90 and
/// the median of those ratios; then the mean p90 over all requests (the unserved counted
/// as slowest; `unserved in K` where it fell on an unserved request in K runs), and the
/// mean prefix hit rate, requests shed, preemptions and adapter loads.
pub fn markdown_of(heading: &str, each: &str, runs: &[Vec<WorkloadResult>]) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{heading} p90 TTFT in seconds (the reports' `TTFT p90 s`); ratios are to the first \
         router named: of the means, and {each} by {each} with their median. `p90 all`: the \
         reports' `TTFT p90 all s` (shed and failed requests counted as slower than any \
         served), mean. Hit rate, shed, preemptions and LoRA loads are means over the {} \
         runs.",
        runs.len()
    );
    let Some(first) = runs.first() else {
        return md;
    };
    let listed = runs.len() <= LISTED_RUNS;
    for (index, workload) in first.iter().enumerate() {
        let reference = workload.runs.first().map(|run| run.router);
        let reference_name = reference.map_or("-", RouterKind::name);
        let (each_p90, each_ratio) = if listed {
            (
                format!(" p90 TTFT, each {each} |"),
                format!(" ÷ {reference_name}, each {each} |"),
            )
        } else {
            (String::new(), String::new())
        };
        let columns = 12 + 2 * usize::from(listed);
        let _ = writeln!(
            md,
            "\n## {}\n\n| rate | router |{each_p90} mean | median | min–max | mean ÷ {reference_name} |{each_ratio} median ÷ | p90 all | hit rate | shed | preemptions | LoRA loads |\n|{}",
            workload.workload,
            "---|".repeat(columns)
        );
        for &rate in &workload.rates {
            let all = series(runs, index, rate);
            let base = all.first().map(|s| s.p90.clone()).unwrap_or_default();
            let base_mean = mean(base.iter().copied());
            for s in &all {
                let values = finite(s.p90.iter().copied());
                let low = values.iter().copied().reduce(f64::min);
                let high = values.iter().copied().reduce(f64::max);
                let mean_p90 = mean(s.p90.iter().copied());
                let (mean_ratio, ratios, median_ratio) = if Some(s.router) == reference {
                    (None, String::new(), String::new())
                } else {
                    let ratios: Vec<Option<f64>> = s
                        .p90
                        .iter()
                        .zip(&base)
                        .map(|(&v, &b)| ratio(v, b))
                        .collect();
                    (
                        ratio(mean_p90, base_mean),
                        joined(&ratios, 2),
                        num(median(ratios.iter().copied()), 2),
                    )
                };
                let mut row = format!("| {} | {} |", num(Some(rate), 0), s.router.name());
                if listed {
                    let _ = write!(row, " {} |", joined(&s.p90, 3));
                }
                let _ = write!(
                    row,
                    " {} | {} | {}–{} | {} |",
                    num(mean_p90, 3),
                    num(median(s.p90.iter().copied()), 3),
                    num(low, 3),
                    num(high, 3),
                    num(mean_ratio, 2),
                );
                if listed {
                    let _ = write!(row, " {ratios} |");
                }
                let unserved = s.p90_all.iter().filter(|v| v.is_some_and(f64::is_infinite));
                let unserved = unserved.count();
                let p90_all = if unserved > 0 {
                    format!("unserved in {unserved}")
                } else {
                    num(mean(s.p90_all.iter().copied()), 3)
                };
                let _ = writeln!(
                    md,
                    "{row} {median_ratio} | {p90_all} | {} | {} | {} | {} |",
                    num(mean(s.hit_rate.iter().copied()), 3),
                    num(mean(s.shed.iter().copied()), 1),
                    num(mean(s.preemptions.iter().copied()), 1),
                    num(mean(s.lora_loads.iter().copied()), 1),
                );
            }
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::report::RouterRun;
    use crate::compare::targets::tests::{requests, result, run};

    /// A run of `router` with one step at `rate` whose every request took `ttft` seconds.
    fn one_step(router: RouterKind, rate: f64, ttft: f64) -> RouterRun {
        run(router, vec![(rate, requests(None, None, 10, Some(ttft)))])
    }

    /// One workload's results per run, two routers whose p90s are `pairs`.
    fn runs_of(pairs: &[(f64, f64)]) -> Vec<Vec<WorkloadResult>> {
        pairs
            .iter()
            .map(|&(one, two)| {
                vec![result(
                    &[36.0],
                    &[],
                    None,
                    vec![
                        one_step(RouterKind::KvrouteEvents, 36.0, one),
                        one_step(RouterKind::KvrouteEventsReplicas, 36.0, two),
                    ],
                )]
            })
            .collect()
    }

    /// The table row of `router` in `md`.
    fn row<'a>(md: &'a str, router: &str) -> &'a str {
        md.lines()
            .find(|line| line.starts_with(&format!("| 36 | {router} |")))
            .unwrap_or_else(|| panic!("no row of {router} in {md}"))
    }

    #[test]
    fn each_router_gets_its_repeats_mean_median_range_and_ratios_to_the_first_router() {
        let md = markdown(&runs_of(&[(1.0, 0.8), (2.0, 7.0), (1.5, 0.9)]));
        assert!(md.starts_with("# kvroute-lab compare: 3 repeats"), "{md}");
        assert!(md.contains("| p90 TTFT, each repeat |"), "{md}");
        let first = row(&md, "kvroute-events");
        assert!(
            first.starts_with(
                "| 36 | kvroute-events | 1.000 / 2.000 / 1.500 | 1.500 | 1.500 | 1.000–2.000 | - |  |  |"
            ),
            "{first}"
        );
        // Means 2.9 against 1.5: 1.93; per repeat 0.80, 3.50, 0.60, median 0.80.
        let second = row(&md, "kvroute-events-x2");
        assert!(
            second.starts_with(
                "| 36 | kvroute-events-x2 | 0.800 / 7.000 / 0.900 | 2.900 | 0.900 | 0.800–7.000 | 1.93 | 0.80 / 3.50 / 0.60 | 0.80 |"
            ),
            "{second}"
        );
    }

    #[test]
    fn more_runs_than_are_listed_keep_only_the_summary_columns() {
        let pairs: Vec<(f64, f64)> = (1..=12).map(|k| (1.0, f64::from(k) / 4.0)).collect();
        let md = markdown_of("# seeds", "seed", &runs_of(&pairs));
        assert!(!md.contains("each seed |"), "{md}");
        // Mean of 0.25..=3.0 in quarters: 1.625; median 1.625; ratios the same over 1.0.
        let second = row(&md, "kvroute-events-x2");
        assert!(
            second.starts_with(
                "| 36 | kvroute-events-x2 | 1.625 | 1.625 | 0.250–3.000 | 1.62 | 1.62 |"
            ),
            "{second}"
        );
        let columns = |line: &str| line.matches('|').count();
        let head = md
            .lines()
            .find(|line| line.starts_with("| rate |"))
            .unwrap_or_default();
        assert_eq!(columns(head), columns(second), "{md}");
    }

    #[test]
    fn the_p90_of_all_requests_is_a_mean_only_where_every_run_served_its_p90() {
        // The first router sheds 5 of 100 requests in the first run (p90 of all on a served
        // one) and 15 in the second (on a shed one); the second router serves everything.
        let step = |served: usize, ttft: f64| {
            let mut records = requests(None, None, served, Some(ttft));
            records.extend(requests(None, None, 100 - served, None));
            run(RouterKind::Kvroute, vec![(36.0, records)])
        };
        let runs: Vec<Vec<WorkloadResult>> = [(95, 1.0), (85, 2.0)]
            .into_iter()
            .map(|(served, ttft)| {
                vec![result(
                    &[36.0],
                    &[],
                    None,
                    vec![
                        step(served, ttft),
                        one_step(RouterKind::RoundRobin, 36.0, 3.0),
                    ],
                )]
            })
            .collect();
        let md = markdown(&runs);
        assert!(md.contains("| median ÷ | p90 all | hit rate |"), "{md}");
        assert!(row(&md, "kvroute").contains("| unserved in 1 |"), "{md}");
        assert!(row(&md, "round-robin").contains("| 3.000 | - |"), "{md}");
    }

    #[test]
    fn seeds_are_numbers_and_ranges_in_the_order_given_each_once() {
        assert_eq!(parse_seeds("1-3"), Ok(Seeds(vec![1, 2, 3])));
        assert_eq!(parse_seeds("9, 2-3,3,1"), Ok(Seeds(vec![9, 2, 3, 1])));
        assert_eq!(parse_seeds("7"), Ok(Seeds(vec![7])));
        for bad in ["", "3-1", "a", "1-", "-2", "0-10000"] {
            assert!(parse_seeds(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two_and_gaps_are_skipped() {
        assert_eq!(
            median([Some(4.0), None, Some(1.0), Some(3.0), Some(2.0)]),
            Some(2.5)
        );
        assert_eq!(median([None, Some(f64::NAN)]), None);
    }
}
