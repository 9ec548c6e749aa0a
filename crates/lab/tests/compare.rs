//! `kvroute-lab compare` end to end, in a tiny configuration: kvroute and Envoy round robin in
//! front of a two-pod simulated fleet, one small workload written here, two short rates at a
//! high speedup. Loopback only; needs Envoy (`scripts/setup`, or `ENVOY_BIN`).

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

mod support;

use support::{envoy_binary, in_workspace, processes_marked};

const WORKLOAD: &str = "\
name: tiny
description: two pods, two adapters with one slot each, short prompts
seed: 11
api: completions
rates: [4, 8]
step_duration: 10s
fleet:
  pods: 2
  num_gpu_blocks: 600
  max_loras: 1
  lora_load_ms: 150
  adapters: 2
  speedup: 20
classes:
  - name: chat
    lora: {base_share: 0.5, zipf_s: 1.0}
    prompt_tokens: {dist: lognormal, median: 64, sigma: 0.5, min: 8, max: 512}
    output_tokens: {dist: lognormal, median: 32, sigma: 0.5, min: 4, max: 128}
";

/// `kvroute-lab` with the gateway binary of this build: cargo builds the workspace's
/// binaries into the directory above this test's.
fn lab(command: &str) -> Command {
    let kvroute = Path::new(env!("CARGO_BIN_EXE_kvroute-lab")).with_file_name("kvroute");
    assert!(
        kvroute.is_file(),
        "{} is missing: run the tests of the whole workspace (cargo nextest run --workspace)",
        kvroute.display()
    );
    let mut lab = Command::new(env!("CARGO_BIN_EXE_kvroute-lab"));
    lab.arg(command)
        .arg("--kvroute")
        .arg(kvroute)
        .arg("--envoy")
        .arg(envoy_binary());
    lab
}

/// The table rows of a router in report.md: every cell after the name.
fn rows_of<'a>(report: &'a str, router: &str) -> Vec<Vec<&'a str>> {
    report
        .lines()
        .filter(|l| l.starts_with(&format!("| {router} |")))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(str::trim)
                .skip(1)
                .collect()
        })
        .collect()
}

#[test]
fn a_tiny_comparison_writes_tables_plots_and_json_and_leaves_nothing_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let workload = dir.path().join("tiny.yaml");
    std::fs::write(&workload, WORKLOAD).expect("write workload");
    let out = dir.path().join("results");
    let marker = format!("{}-{}", std::process::id(), line!());
    let started = Instant::now();
    let output = lab("compare")
        .arg("--workloads")
        .arg(&workload)
        .args(["--routers", "kvroute,round-robin"])
        .arg("--output-dir")
        .arg(&out)
        .arg("--python")
        .arg(in_workspace(".venv/bin/python"))
        .env("KVROUTE_COMPARE_TEST_MARK", &marker)
        .env_remove("KVROUTE_COMPARE_WORKLOADS")
        .env_remove("KVROUTE_COMPARE_ROUTERS")
        .env_remove("KVROUTE_COMPARE_RATES")
        .env_remove("KVROUTE_COMPARE_STEP_DURATION")
        .env_remove("KVROUTE_COMPARE_QUICK")
        .output()
        .expect("run kvroute-lab compare");
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kvroute-lab compare failed:\n{stderr}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");

    let leftover = processes_marked("KVROUTE_COMPARE_TEST_MARK", &marker);
    assert!(leftover.is_empty(), "still running: {leftover:?}");

    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md");
    assert!(report.contains("## Workload `tiny`"), "{report}");
    assert!(report.contains("### tiny at 4 req/s"), "{report}");
    assert!(report.contains("### tiny at 8 req/s"), "{report}");
    assert!(report.contains("kvroute / each other router"), "{report}");
    for router in ["kvroute", "round-robin"] {
        let rows = rows_of(&report, router);
        assert_eq!(rows.len(), 2, "one row per rate for {router}:\n{report}");
        for cells in rows {
            assert_eq!(cells.len(), 18, "{cells:?}");
            let (errors, planned) = cells[12].split_once('/').expect("errors/planned");
            let errors: usize = errors.parse().expect("errors");
            let planned: usize = planned.parse().expect("planned");
            assert!(planned > 0 && errors == 0, "{router}: {cells:?}");
            for (i, cell) in cells.iter().enumerate() {
                if i == 12 {
                    continue;
                }
                let value: f64 = cell
                    .parse()
                    .unwrap_or_else(|_| panic!("{router}: cell {i} {cell:?} is not a number"));
                assert!(value.is_finite() && value >= 0.0, "{router}: {cells:?}");
            }
            assert_eq!(
                cells[13], "0",
                "nothing is shed without flow control: {cells:?}"
            );
            let throughput: f64 = cells[0].parse().expect("req/s");
            assert!(throughput > 0.0);
            // TTFT at real scale is the pod's own TTFT plus the time outside the pod.
            let number = |i: usize| cells[i].parse::<f64>().expect("number");
            assert!(
                number(5) > 0.0,
                "the simulator times each request: {cells:?}"
            );
            assert!(
                number(3) >= number(5),
                "TTFT p90 >= pod TTFT p90: {cells:?}"
            );
        }
    }
    // The ratio table has one row per rate against round robin.
    let ratios = report
        .lines()
        .filter(|l| l.split('|').nth(2).map(str::trim) == Some("round-robin"))
        .count();
    assert_eq!(ratios, 2, "{report}");

    for file in [
        "tiny-ttft-p90.png",
        "tiny-preemptions-lora.png",
        "tiny-kvroute.json",
        "tiny-round-robin.json",
        "results.json",
    ] {
        let meta = std::fs::metadata(out.join(file)).unwrap_or_else(|_| panic!("{file} missing"));
        assert!(meta.len() > 0, "{file} is empty");
    }
    let png = std::fs::read(out.join("tiny-ttft-p90.png")).expect("png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let run: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("tiny-kvroute.json")).expect("json"))
            .expect("parses");
    assert_eq!(run["router"], "kvroute");
    assert_eq!(run["bench"]["steps"].as_array().map(Vec::len), Some(2));
    assert_eq!(run["fleet_steps"].as_array().map(Vec::len), Some(2));
    assert!(run["fleet_total"]["samples"].as_u64().unwrap_or(0) > 0);
    assert!(run["fleet_total"]["prefix_queries"].as_f64().unwrap_or(0.0) > 0.0);
}

#[test]
fn the_demo_compares_kvroute_with_round_robin_and_says_where_the_plots_are() {
    let dir = tempfile::tempdir().expect("tempdir");
    let workload = dir.path().join("tiny.yaml");
    std::fs::write(&workload, WORKLOAD).expect("write workload");
    let out = dir.path().join("demo");
    let output = lab("demo")
        .arg("--workload")
        .arg(&workload)
        .arg("--output-dir")
        .arg(&out)
        .output()
        .expect("run kvroute-lab demo");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kvroute-lab demo failed:\n{stderr}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    for router in ["kvroute", "round-robin"] {
        assert_eq!(rows_of(&stdout, router).len(), 2, "{router}:\n{stdout}");
    }
    for router in ["least-request", "sglang", "vllm-router"] {
        assert!(
            rows_of(&stdout, router).is_empty(),
            "{router} ran:\n{stdout}"
        );
    }
    let plot = out.join("tiny-ttft-p90.png");
    assert!(plot.exists(), "{stderr}");
    assert!(
        stderr.contains(&plot.display().to_string()),
        "the demo names its plots:\n{stderr}"
    );
}
