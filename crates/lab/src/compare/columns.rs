//! The columns of a workload's per-rate table and which of them the workload keeps. Pure.
//!
//! A column that reads zero (at the precision it is printed with) or absent for every router
//! at every rate of a workload carries no information for that workload: `LoRA loads` without
//! adapters, `shed` without flow control, `prefix hit rate` without shared prefixes. It is
//! left out of that workload's tables, in report.md (the ratio table included) and on the
//! terminal alike, and a plot of it is not drawn. The decision is per workload: the same
//! column stays in another workload's tables where some router moves it. The throughput,
//! TTFT and errors columns always stay: they are the comparison itself, and "0 errors" is a
//! finding.

use super::report::{Row, num};

/// One column of the per-rate table, in table order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Column {
    RequestsPerS,
    OutputTokensPerS,
    TtftP50,
    TtftP90,
    TtftP99,
    TtftP90All,
    PodTtftP90,
    PathP50,
    PathP90,
    ClientTtftP90,
    ItlP50,
    ItlP90,
    E2eP90,
    Errors,
    Shed,
    Preemptions,
    LoraLoads,
    PrefixHitRate,
    KvSpread,
}

impl Column {
    /// Every column, in table order.
    pub const ALL: [Column; 19] = [
        Column::RequestsPerS,
        Column::OutputTokensPerS,
        Column::TtftP50,
        Column::TtftP90,
        Column::TtftP99,
        Column::TtftP90All,
        Column::PodTtftP90,
        Column::PathP50,
        Column::PathP90,
        Column::ClientTtftP90,
        Column::ItlP50,
        Column::ItlP90,
        Column::E2eP90,
        Column::Errors,
        Column::Shed,
        Column::Preemptions,
        Column::LoraLoads,
        Column::PrefixHitRate,
        Column::KvSpread,
    ];

    /// The columns of the ratio table (kvroute / each other router), in its order, each with
    /// its header there.
    pub const RATIOS: [(Column, &'static str); 11] = [
        (Column::TtftP50, "TTFT p50"),
        (Column::TtftP90, "TTFT p90"),
        (Column::TtftP99, "TTFT p99"),
        (Column::TtftP90All, "TTFT p90 all"),
        (Column::PodTtftP90, "pod TTFT p90"),
        (Column::ClientTtftP90, "client TTFT p90"),
        (Column::E2eP90, "e2e p90"),
        (Column::RequestsPerS, "throughput"),
        (Column::Preemptions, "preemptions"),
        (Column::LoraLoads, "LoRA loads"),
        (Column::KvSpread, "KV spread"),
    ];

    /// Its header in report.md.
    pub fn header(self) -> &'static str {
        match self {
            Column::RequestsPerS => "req/s",
            Column::OutputTokensPerS => "tok/s",
            Column::TtftP50 => "TTFT p50 s",
            Column::TtftP90 => "TTFT p90 s",
            Column::TtftP99 => "TTFT p99 s",
            Column::TtftP90All => "TTFT p90 all s",
            Column::PodTtftP90 => "pod TTFT p90 s",
            Column::PathP50 => "path p50 ms",
            Column::PathP90 => "path p90 ms",
            Column::ClientTtftP90 => "client TTFT p90 s",
            Column::ItlP50 => "ITL p50 s",
            Column::ItlP90 => "ITL p90 s",
            Column::E2eP90 => "e2e p90 s",
            Column::Errors => "errors",
            Column::Shed => "shed",
            Column::Preemptions => "preemptions",
            Column::LoraLoads => "LoRA loads",
            Column::PrefixHitRate => "prefix hit rate",
            Column::KvSpread => "KV spread",
        }
    }

    /// The number behind a cell; None: not measured (e.g. no request completed).
    pub fn value(self, r: &Row) -> Option<f64> {
        match self {
            Column::RequestsPerS => Some(r.requests_per_s),
            Column::OutputTokensPerS => Some(r.output_tokens_per_s),
            Column::TtftP50 => r.ttft[0],
            Column::TtftP90 => r.ttft[1],
            Column::TtftP99 => r.ttft[2],
            Column::TtftP90All => r.ttft_p90_all,
            Column::PodTtftP90 => r.pod_ttft_p90,
            Column::PathP50 => r.path_ms[0],
            Column::PathP90 => r.path_ms[1],
            Column::ClientTtftP90 => r.client_ttft_p90,
            Column::ItlP50 => r.itl[0],
            Column::ItlP90 => r.itl[1],
            Column::E2eP90 => r.e2e_p90,
            Column::Errors => Some(r.errors as f64),
            Column::Shed => Some(r.shed as f64),
            Column::Preemptions => Some(r.preemptions),
            Column::LoraLoads => Some(r.lora_loads),
            Column::PrefixHitRate => r.prefix_hit_rate,
            Column::KvSpread => r.kv_spread,
        }
        .filter(|v| v.is_finite())
    }

    /// Decimal places the column is printed with.
    pub fn digits(self) -> usize {
        match self {
            Column::OutputTokensPerS
            | Column::Errors
            | Column::Shed
            | Column::Preemptions
            | Column::LoraLoads => 0,
            Column::PathP50 | Column::PathP90 => 1,
            Column::RequestsPerS => 2,
            Column::ItlP50 | Column::ItlP90 => 4,
            _ => 3,
        }
    }

    /// The cell as report.md prints it (`errors` as failed / planned; `unserved` where
    /// the p90 of all requests falls on one not served).
    pub fn cell(self, r: &Row) -> String {
        match self {
            Column::Errors => format!("{}/{}", r.errors, r.requests),
            Column::TtftP90All if r.ttft_p90_all.is_none() && r.requests > 0 => {
                "unserved".to_string()
            }
            _ => num(self.value(r), self.digits()),
        }
    }

    /// Whether it stays when it reads zero everywhere.
    fn essential(self) -> bool {
        matches!(
            self,
            Column::RequestsPerS
                | Column::OutputTokensPerS
                | Column::TtftP50
                | Column::TtftP90
                | Column::TtftP99
                | Column::Errors
        )
    }

    /// Whether some row prints a non-zero value in this column.
    pub fn moves<'a>(self, rows: impl IntoIterator<Item = &'a Row>) -> bool {
        let zero = 0.5 * 10f64.powi(-(self.digits() as i32));
        rows.into_iter()
            .filter_map(|r| self.value(r))
            .any(|v| v.abs() >= zero)
    }

    /// Whether a workload whose rows (every router, every rate) are `rows` keeps it. The
    /// p90 of all requests stays where some router left a request unserved: elsewhere it
    /// is the p90 column again.
    pub fn kept<'a>(self, rows: impl IntoIterator<Item = &'a Row>) -> bool {
        match self {
            Column::TtftP90All => rows.into_iter().any(|r| r.errors + r.shed > 0),
            _ => self.essential() || self.moves(rows),
        }
    }
}

/// The columns a workload whose rows (every router, every rate) are `rows` keeps, in table
/// order.
pub fn kept_columns<'a>(rows: impl IntoIterator<Item = &'a Row> + Clone) -> Vec<Column> {
    Column::ALL
        .into_iter()
        .filter(|c| c.kept(rows.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(preemptions: f64, lora_loads: f64, prefix: Option<f64>) -> Row {
        Row {
            rate: 4.0,
            requests_per_s: 3.9,
            steady_requests_per_s: None,
            output_tokens_per_s: 500.0,
            ttft: [Some(0.1), Some(0.2), Some(0.3)],
            ttft_p90_all: Some(0.2),
            client_ttft_p90: Some(0.2),
            pod_ttft_p90: Some(0.19),
            path_ms: [Some(1.0), Some(2.0)],
            itl: [Some(0.01), Some(0.02)],
            e2e_p90: Some(2.0),
            errors: 0,
            shed: 0,
            requests: 40,
            preemptions,
            lora_loads,
            prefix_hit_rate: prefix,
            kv_spread: Some(0.1),
        }
    }

    #[test]
    fn a_column_zero_or_absent_for_every_router_at_every_rate_is_left_out() {
        let rows = [row(0.0, 12.0, Some(0.0)), row(0.0, 30.0, None)];
        let kept = kept_columns(&rows);
        assert!(kept.contains(&Column::LoraLoads), "{kept:?}");
        for gone in [Column::Preemptions, Column::PrefixHitRate, Column::Shed] {
            assert!(!kept.contains(&gone), "{gone:?} in {kept:?}");
        }
        // The comparison itself stays, zero errors included.
        for stays in [Column::RequestsPerS, Column::TtftP90, Column::Errors] {
            assert!(kept.contains(&stays), "{stays:?} not in {kept:?}");
        }
    }

    #[test]
    fn one_router_at_one_rate_keeps_a_column_and_the_decision_is_per_workload() {
        let quiet = [row(0.0, 0.0, None), row(0.0, 0.0, None)];
        let one_preemption = [row(0.0, 0.0, None), row(1.0, 0.0, None)];
        assert!(!kept_columns(&quiet).contains(&Column::Preemptions));
        assert!(kept_columns(&one_preemption).contains(&Column::Preemptions));
        assert!(!kept_columns(&one_preemption).contains(&Column::LoraLoads));
    }

    #[test]
    fn the_p90_of_all_requests_shows_only_where_a_request_went_unserved() {
        let served = [row(0.0, 0.0, None), row(0.0, 0.0, None)];
        assert!(!kept_columns(&served).contains(&Column::TtftP90All));
        let mut refused = row(0.0, 0.0, None);
        refused.shed = 12;
        refused.ttft_p90_all = None;
        let rows = [row(0.0, 0.0, None), refused];
        assert!(kept_columns(&rows).contains(&Column::TtftP90All));
        assert_eq!(Column::TtftP90All.cell(&refused), "unserved");
        assert_eq!(Column::TtftP90All.cell(&rows[0]), "0.200");
    }

    #[test]
    fn a_value_that_prints_as_zero_counts_as_zero() {
        // Preemptions are interpolated between samples: 0.2 prints as "0".
        assert!(!Column::Preemptions.moves(&[row(0.2, 0.0, None)]));
        assert!(Column::Preemptions.moves(&[row(0.6, 0.0, None)]));
        assert!(Column::PrefixHitRate.moves(&[row(0.0, 0.0, Some(0.001))]));
        assert!(!Column::PrefixHitRate.moves(&[row(0.0, 0.0, Some(0.0004))]));
    }
}
