//! `compare --repeat N`: the same comparison run N times, and each router's p90 TTFT at
//! each rate over the repeats.
//!
//! Near a workload's knee one run's p90 is either low or several times higher (a burst that
//! builds a queue the step never drains), for any router, so the ratio of two routers'
//! p90s in one run can land anywhere from a third to several times whatever the routers
//! (docs/kv-events.md, "Several replicas"). Repeats show the spread, the median, and each
//! repeat's ratio to the first router named, which one run cannot.

use std::fmt::Write;

use super::report::{WorkloadResult, num, same_rate};
use super::routers::RouterKind;

/// One router's p90 TTFT at one rate, one value per repeat (`None`: no value that time).
struct Series {
    router: RouterKind,
    p90: Vec<Option<f64>>,
}

/// The p90s of `workload` (its position in each repeat's results) at `rate`, per router
/// in the first repeat's order.
fn series(repeats: &[Vec<WorkloadResult>], workload: usize, rate: f64) -> Vec<Series> {
    let Some(first) = repeats.first().and_then(|r| r.get(workload)) else {
        return Vec::new();
    };
    first
        .runs
        .iter()
        .map(|run| Series {
            router: run.router,
            p90: repeats
                .iter()
                .map(|results| {
                    let run = results.get(workload)?.run(run.router)?;
                    run.rows()
                        .into_iter()
                        .find(|row| same_rate(row.rate, rate))?
                        .ttft[1]
                })
                .collect(),
        })
        .collect()
}

/// The median of the finite values, if any.
fn median(values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let mut v: Vec<f64> = values
        .into_iter()
        .flatten()
        .filter(|v| v.is_finite())
        .collect();
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

fn joined(values: &[Option<f64>], digits: usize) -> String {
    values
        .iter()
        .map(|v| num(*v, digits))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// `repeats.md`: for each workload, each rate and each router, the p90 TTFT of every
/// repeat, their median and range, and (for every router but the first named) each
/// repeat's ratio to the first router's p90 and the median of those ratios.
pub fn markdown(repeats: &[Vec<WorkloadResult>]) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# kvroute-lab compare: {} repeats\n\nEach repeat is a whole comparison (its report in \
         `repeat-K/`). p90 TTFT in seconds (the reports' `TTFT p90 s`); ratios are to the \
         first router named, repeat by repeat.",
        repeats.len()
    );
    let Some(first) = repeats.first() else {
        return md;
    };
    for (index, workload) in first.iter().enumerate() {
        let reference = workload.runs.first().map(|run| run.router);
        let _ = writeln!(
            md,
            "\n## {}\n\n| rate | router | p90 TTFT, each repeat | median | min–max | ÷ {}, each repeat | median ÷ |\n|---|---|---|---|---|---|---|",
            workload.workload,
            reference.map_or("-", RouterKind::name)
        );
        for &rate in &workload.rates {
            let all = series(repeats, index, rate);
            let base = all.first().map(|s| s.p90.clone()).unwrap_or_default();
            for s in &all {
                let finite = || s.p90.iter().flatten().copied().filter(|v| v.is_finite());
                let (low, high) = (finite().reduce(f64::min), finite().reduce(f64::max));
                let (ratios, median_ratio) = if Some(s.router) == reference {
                    (String::new(), String::new())
                } else {
                    let ratios: Vec<Option<f64>> = s
                        .p90
                        .iter()
                        .zip(&base)
                        .map(|(v, b)| match (v, b) {
                            (Some(v), Some(b)) if *b > 0.0 => Some(v / b),
                            _ => None,
                        })
                        .collect();
                    (joined(&ratios, 2), num(median(ratios.iter().copied()), 2))
                };
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {}–{} | {} | {} |",
                    num(Some(rate), 0),
                    s.router.name(),
                    joined(&s.p90, 3),
                    num(median(s.p90.iter().copied()), 3),
                    num(low, 3),
                    num(high, 3),
                    ratios,
                    median_ratio
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

    #[test]
    fn each_router_gets_its_repeats_median_range_and_ratio_to_the_first_router() {
        let repeats: Vec<Vec<WorkloadResult>> = [(1.0, 0.8), (2.0, 7.0), (1.5, 0.9)]
            .into_iter()
            .map(|(one, two)| {
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
            .collect();
        let md = markdown(&repeats);
        assert!(md.contains("# kvroute-lab compare: 3 repeats"), "{md}");
        assert!(
            md.contains(
                "| 36 | kvroute-events | 1.000 / 2.000 / 1.500 | 1.500 | 1.000–2.000 |  |  |"
            ),
            "{md}"
        );
        assert!(
            md.contains(
                "| 36 | kvroute-events-x2 | 0.800 / 7.000 / 0.900 | 0.900 | 0.800–7.000 | 0.80 / 3.50 / 0.60 | 0.80 |"
            ),
            "{md}"
        );
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
