//! Cost of reading one pod's `/metrics` page, as kvroute asks for it (`name[]=` for the
//! series it reads, as vLLM's prometheus_client app then renders them): at 1,000 pods
//! scraped every 50 ms this runs 20,000 times a second.
//! Run: `cargo bench -p kvroute-core --bench exposition`. `PARSE_COUNT=fixture/N` parses
//! that page N times and nothing else, for an instruction count under
//! `valgrind --tool=cachegrind` (this VM's timings move 2× between runs; instruction
//! counts do not).

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group};

use kvroute_core::vllm::{metrics_query, parse_vllm_metrics};

/// Real vLLM pages (see the fixtures' README): one engine, and two data-parallel engines
/// serving LoRA adapters.
const FIXTURES: [&str; 2] = ["vllm-v0.11-single-engine", "vllm-dp2-lora"];

/// The fixture's page restricted to the families kvroute asks for, comments included,
/// as prometheus_client renders a `name[]` query.
fn restricted_page(fixture: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/metrics/{fixture}.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    let whole = std::fs::read_to_string(&path).expect("fixture");
    let names: Vec<String> = metrics_query()
        .split('&')
        .filter_map(|pair| pair.strip_prefix("name%5B%5D="))
        .map(|name| name.replace("%3A", ":"))
        .collect();
    let family = |line: &str| {
        let rest = line
            .strip_prefix("# HELP ")
            .or_else(|| line.strip_prefix("# TYPE "))
            .unwrap_or(line);
        let end = rest.find(['{', ' ']).unwrap_or(rest.len());
        names.iter().any(|name| *name == rest[..end])
    };
    whole
        .lines()
        .filter(|line| family(line))
        .map(|line| format!("{line}\n"))
        .collect()
}

fn bench_parse(c: &mut Criterion) {
    let mut group = c.benchmark_group("parse_vllm_metrics");
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    for fixture in FIXTURES {
        let page = restricted_page(fixture);
        parse_vllm_metrics(&page).expect("a vLLM page");
        group.bench_with_input(BenchmarkId::new(fixture, page.len()), &page, |b, page| {
            b.iter(|| parse_vllm_metrics(black_box(page)).ok())
        });
    }
    group.finish();
}

criterion_group!(benches, bench_parse);

fn main() {
    if let Ok(spec) = std::env::var("PARSE_COUNT") {
        let (fixture, count) = spec.split_once('/').expect("PARSE_COUNT=fixture/N");
        let page = restricted_page(fixture);
        for _ in 0..count.parse::<usize>().expect("a count") {
            black_box(parse_vllm_metrics(black_box(&page)).ok());
        }
        return;
    }
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
