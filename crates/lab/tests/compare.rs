//! `kvroute-lab compare` end to end, in a tiny configuration: kvroute and Envoy round robin in
//! front of a two-pod simulated fleet, one small workload written here, two short rates at a
//! high speedup. Loopback only; needs Envoy (`scripts/setup`, or `ENVOY_BIN`).

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
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

/// A temporary directory holding [`WORKLOAD`] as `tiny.yaml`, and that file's path.
fn tiny_workload() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let workload = dir.path().join("tiny.yaml");
    std::fs::write(&workload, WORKLOAD).expect("write workload");
    (dir, workload)
}

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

/// `kvroute-lab compare` of `routers` on `workload` into `out`, its processes marked with
/// `marker`, no setting taken from the environment.
fn compare(workload: &Path, routers: &str, out: &Path, marker: &str) -> std::process::Output {
    compare_with(workload, routers, &[], out, marker)
}

/// [`compare`] with more flags.
fn compare_with(
    workload: &Path,
    routers: &str,
    flags: &[&str],
    out: &Path,
    marker: &str,
) -> std::process::Output {
    lab("compare")
        .arg("--workloads")
        .arg(workload)
        .args(["--routers", routers])
        .args(flags)
        .arg("--output-dir")
        .arg(out)
        .arg("--python")
        .arg(in_workspace(".venv/bin/python"))
        .env("KVROUTE_COMPARE_TEST_MARK", marker)
        .env_remove("KVROUTE_COMPARE_WORKLOADS")
        .env_remove("KVROUTE_COMPARE_ROUTERS")
        .env_remove("KVROUTE_COMPARE_RATES")
        .env_remove("KVROUTE_COMPARE_STEP_DURATION")
        .env_remove("KVROUTE_COMPARE_QUICK")
        .output()
        .expect("run kvroute-lab compare")
}

/// The rows of a router in report.md's per-rate tables (those with an `errors` column),
/// each cell by its column's header.
fn rows_of(report: &str, router: &str) -> Vec<BTreeMap<String, String>> {
    let cells = |line: &str| -> Vec<String> {
        line.trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect()
    };
    let mut header = Vec::new();
    let mut rows = Vec::new();
    for line in report.lines() {
        if line.starts_with("| router |") {
            header = cells(line);
        } else if line.starts_with(&format!("| {router} |")) && header.iter().any(|h| h == "errors")
        {
            rows.push(header.iter().cloned().zip(cells(line)).collect());
        }
    }
    rows
}

#[test]
fn a_tiny_comparison_writes_tables_plots_and_json_and_leaves_nothing_running() {
    let (dir, workload) = tiny_workload();
    let out = dir.path().join("results");
    let marker = format!("{}-{}", std::process::id(), line!());
    let started = Instant::now();
    let output = compare(&workload, "kvroute,round-robin", &out, &marker);
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
            let (errors, planned) = cells["errors"].split_once('/').expect("errors/planned");
            let errors: usize = errors.parse().expect("errors");
            let planned: usize = planned.parse().expect("planned");
            assert!(planned > 0 && errors == 0, "{router}: {cells:?}");
            for (column, cell) in cells
                .iter()
                .filter(|(c, _)| *c != "errors" && *c != "router")
            {
                let value: f64 = cell
                    .parse()
                    .unwrap_or_else(|_| panic!("{router}: {column} {cell:?} is not a number"));
                assert!(value.is_finite() && value >= 0.0, "{router}: {cells:?}");
            }
            for column in ["req/s", "tok/s", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s"] {
                assert!(
                    cells.contains_key(column),
                    "{column} is always kept: {cells:?}"
                );
            }
            assert!(
                !cells.contains_key("shed"),
                "nothing is shed without flow control, so no shed column: {cells:?}"
            );
            let number = |c: &str| cells[c].parse::<f64>().expect("number");
            // Completed requests over the 10 s of arrivals, never above what was planned.
            let throughput = number("req/s");
            assert!(throughput > 0.0 && throughput <= planned as f64 / 10.0 + 1e-9);
            // TTFT at real scale is the pod's own TTFT plus the time outside the pod.
            assert!(
                number("pod TTFT p90 s") > 0.0,
                "the simulator times each request: {cells:?}"
            );
            assert!(
                number("TTFT p90 s") >= number("pod TTFT p90 s"),
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

    // The plots the report links: the p90 TTFT, and the fleet counters that moved.
    let plots: Vec<&str> = report
        .lines()
        .filter_map(|l| l.strip_prefix("![")?.split(']').next())
        .collect();
    assert!(plots.contains(&"tiny-ttft-p90.png"), "{report}");
    let lora_loads = rows_of(&report, "round-robin")
        .iter()
        .any(|r| r.get("LoRA loads").is_some_and(|v| v != "0"));
    assert_eq!(
        plots.iter().any(|p| p.contains("lora")),
        lora_loads,
        "a LoRA plot exactly when the LoRA loads column stays: {report}"
    );
    for file in
        plots
            .into_iter()
            .chain(["tiny-kvroute.json", "tiny-round-robin.json", "results.json"])
    {
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
    let (dir, workload) = tiny_workload();
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
    let lines: Vec<&str> = stdout.lines().collect();
    // A headline first, then where the files are, then a compact table.
    assert!(lines[0].starts_with("tiny: 2 pods"), "{stdout}");
    assert!(lines[1].starts_with("  knee: "), "{stdout}");
    assert!(lines[2].starts_with("  p90 TTFT at "), "{stdout}");
    assert!(lines[2].contains("round-robin"), "{stdout}");
    let report = stdout
        .find(&out.join("report.md").display().to_string())
        .expect("the report is named");
    let plot = out.join("tiny-ttft-p90.png");
    assert!(plot.exists(), "{stderr}");
    assert!(
        stdout.contains(&plot.display().to_string()),
        "the demo names its plots:\n{stdout}"
    );
    let table = stdout.find("tiny by rate").expect("a compact table");
    assert!(report < table, "{stdout}");
    let dir_name = out.display().to_string();
    for line in lines.iter().filter(|l| !l.contains(&dir_name)) {
        assert!(line.chars().count() <= 100, "too wide: {line}\n{stdout}");
        assert!(
            !line.starts_with('|'),
            "no Markdown table on the terminal:\n{stdout}"
        );
    }
    // The compact table: one row per rate and router, the router in the second column or,
    // after the first row of a rate, in the first.
    let routers_in_table: Vec<&str> = stdout[table..]
        .lines()
        .skip(2)
        .filter_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            fields
                .iter()
                .find(|f| f.chars().next().is_some_and(char::is_alphabetic) && **f != "knee")
                .copied()
        })
        .collect();
    assert_eq!(
        routers_in_table,
        ["kvroute", "round-robin", "kvroute", "round-robin"],
        "{stdout}"
    );
}

#[test]
fn two_kvroute_replicas_on_kv_events_share_one_envoy_and_route_every_request() {
    let (dir, workload) = tiny_workload();
    let out = dir.path().join("results");
    let marker = format!("{}-{}", std::process::id(), line!());
    let output = compare(&workload, "kvroute-events-x2", &out, &marker);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kvroute-lab compare failed:\n{stderr}"
    );
    let leftover = processes_marked("KVROUTE_COMPARE_TEST_MARK", &marker);
    assert!(leftover.is_empty(), "still running: {leftover:?}");
    // Each replica has its own log; both were started.
    for log in ["kvroute.log", "kvroute-2.log"] {
        assert!(out.join(log).is_file(), "{log} missing:\n{stderr}");
    }

    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md");
    let rows = rows_of(&report, "kvroute-events-x2");
    assert_eq!(rows.len(), 2, "one row per rate:\n{report}");
    let mut planned_total = 0;
    for cells in &rows {
        let (errors, planned) = cells["errors"].split_once('/').expect("errors/planned");
        assert_eq!(errors, "0", "{cells:?}");
        planned_total += planned.parse::<u64>().expect("planned");
    }
    // Envoy spread the ext_proc streams over both replicas, and between them they routed
    // every request of the ladder (and the warm-up's).
    let run: serde_json::Value = serde_json::from_slice(
        &std::fs::read(out.join("tiny-kvroute-events-x2.json")).expect("json"),
    )
    .expect("parses");
    let routed: Vec<u64> = run["replicas_routed"]
        .as_array()
        .expect("replicas_routed")
        .iter()
        .map(|v| v.as_u64().expect("a count"))
        .collect();
    assert_eq!(routed.len(), 2, "{run}");
    assert!(
        routed.iter().all(|&n| n > 0),
        "each replica routed: {routed:?}"
    );
    assert!(
        routed.iter().sum::<u64>() >= planned_total,
        "{routed:?} against {planned_total} planned"
    );
    // Both replicas followed the pods' events whole, and the report says so.
    let events = &run["kv_events"];
    assert!(
        events["batches"]["applied"]
            .as_u64()
            .expect("applied batches")
            > 0,
        "{events}"
    );
    assert!(
        events["tokenized"].as_u64().expect("prompts tokenized") >= planned_total,
        "every prompt was tokenized: {events}"
    );
    assert!(
        report.contains("| kvroute-events-x2 |") && report.contains("KV events followed"),
        "{report}"
    );
}

#[test]
fn seeds_run_the_comparison_once_per_trace_seed_and_summarize_them() {
    let (dir, workload) = tiny_workload();
    let out = dir.path().join("results");
    let marker = format!("{}-{}", std::process::id(), line!());
    let output = compare_with(&workload, "round-robin", &["--seeds", "3,4"], &out, &marker);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "compare failed:\n{stderr}");
    assert!(processes_marked("KVROUTE_COMPARE_TEST_MARK", &marker).is_empty());
    // Each seed drew its own trace: the step's planned requests and p90 come from it.
    let at_4 = |seed: u64| -> (u64, f64) {
        let run: serde_json::Value = serde_json::from_slice(
            &std::fs::read(out.join(format!("seed-{seed}/tiny-round-robin.json"))).expect("json"),
        )
        .expect("parses");
        let step = &run["bench"]["steps"][0];
        assert_eq!(step["rate"], 4.0);
        let p90 = step["ttft_real_scale_s"]["p90"]
            .as_f64()
            .or_else(|| step["ttft_s"]["p90"].as_f64())
            .expect("a p90");
        (step["requests"]["planned"].as_u64().expect("planned"), p90)
    };
    let (three, four) = (at_4(3), at_4(4));
    assert_ne!(three, four, "the two seeds ran the same trace");
    let md = std::fs::read_to_string(out.join("seeds.md")).expect("seeds.md");
    assert!(md.starts_with("# kvroute-lab compare: 2 seeds"), "{md}");
    let expected = format!("| 4 | round-robin | {:.3} / {:.3} |", three.1, four.1);
    assert!(md.contains(&expected), "{expected} not in\n{md}");
}
