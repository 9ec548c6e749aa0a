//! `kvroute-lab simulate` in small configurations: the shipped multi-LoRA workload on its
//! own 8 pods (a few hundred requests), once scaled to 16 pods, and the command end to end.
//! Virtual time only: each simulation takes well under a second even in a debug build.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvroute_lab::compare::report::RouterRun;
use kvroute_lab::loadgen::Workload;
use kvroute_lab::simulate::{Router, Setup, SimStats, SimulateArgs, simulate};

fn workload_file(name: &str) -> PathBuf {
    Path::new(kvroute_lab::WORKLOADS_DIR).join(format!("{name}.yaml"))
}

fn args(pods: Option<usize>, rates: &[f64], duration: Duration) -> SimulateArgs {
    SimulateArgs {
        workloads: Vec::new(),
        pods,
        requests: None,
        duration: Some(duration),
        rates: rates.to_vec(),
        quick: false,
        routers: Vec::new(),
        scrape_interval: Duration::from_millis(50),
        scrape_delay: Duration::from_millis(50),
        seed: None,
        jobs: Some(1),
        no_warmup: false,
        diagnose: None,
        output_dir: PathBuf::new(),
    }
}

fn run(setup: &Setup<'_>, router: Router) -> (RouterRun, SimStats) {
    simulate(setup, router).expect("the simulation runs")
}

fn p90(run: &RouterRun, step: usize) -> f64 {
    run.bench.steps[step]
        .ttft_s
        .p90
        .expect("requests succeeded")
}

/// Every planned request of every step ended, successfully or with a counted error, and
/// nothing is left in flight anywhere.
fn assert_accounted(run: &RouterRun, stats: &SimStats) {
    for step in &run.bench.steps {
        let c = step.requests;
        assert!(c.planned > 0);
        assert_eq!(c.planned, c.ok + c.errors, "{:?}", step.errors_by_kind);
        assert_eq!(step.e2e_s.count, c.ok);
    }
    assert_eq!(stats.open_at_end, 0, "requests still open at the end");
    assert_eq!(
        stats.held_at_end, 0,
        "kvroute's ledgers hold requests or tokens after every request ended"
    );
}

#[test]
fn kvroute_beats_round_robin_on_multi_lora_at_its_knee_and_every_request_is_accounted() {
    let file = workload_file("multi-lora");
    let w = Workload::from_file(&file).unwrap();
    // Its lowest rate and its knee in docs/benchmarks.md, 15 virtual seconds each.
    let a = args(None, &[2.0, 8.0], Duration::from_secs(15));
    let setup = Setup::new(&a, &w, &file).unwrap();
    let (ours, ours_stats) = run(&setup, Router::Kvroute);
    let (rr, rr_stats) = run(&setup, Router::RoundRobin);
    let (lr, lr_stats) = run(&setup, Router::LeastRequest);
    for (r, s) in [(&ours, &ours_stats), (&rr, &rr_stats), (&lr, &lr_stats)] {
        assert_accounted(r, s);
        assert_eq!(s.pods, 8);
    }
    // The same trace for every policy.
    let planned = |r: &RouterRun| -> Vec<usize> {
        r.bench.steps.iter().map(|s| s.requests.planned).collect()
    };
    assert_eq!(planned(&ours), planned(&rr));
    assert_eq!(planned(&ours), planned(&lr));
    // At the knee kvroute keeps adapters where they are loaded: far fewer loads, and a
    // first token sooner for most requests.
    let (ours_loads, rr_loads) = (ours.fleet_steps[1].lora_loads, rr.fleet_steps[1].lora_loads);
    assert!(
        ours_loads * 2.0 < rr_loads,
        "LoRA loads: kvroute {ours_loads}, round robin {rr_loads}"
    );
    assert!(
        p90(&ours, 1) < p90(&rr, 1),
        "p90 TTFT: kvroute {}, round robin {}",
        p90(&ours, 1),
        p90(&rr, 1)
    );
    assert!(ours.bench.steps[1].ttft_s.p50 < rr.bench.steps[1].ttft_s.p50);
}

#[test]
fn the_same_seed_gives_the_same_result_and_another_seed_does_not() {
    let file = workload_file("shared-prefix");
    let w = Workload::from_file(&file).unwrap();
    let a = args(Some(4), &[16.0], Duration::from_secs(10));
    let setup = Setup::new(&a, &w, &file).unwrap();
    let (first, _) = run(&setup, Router::Kvroute);
    let (again, _) = run(&setup, Router::Kvroute);
    assert_eq!(first.bench.steps, again.bench.steps);
    assert_eq!(first.fleet_steps, again.fleet_steps);
    let mut other = a.clone();
    other.seed = Some(w.seed + 1);
    let setup = Setup::new(&other, &w, &file).unwrap();
    let (different, _) = run(&setup, Router::Kvroute);
    assert_ne!(first.bench.steps, different.bench.steps);
}

#[test]
fn a_fleet_scaled_up_keeps_each_pods_load_and_copies_the_tenants() {
    let file = workload_file("multi-lora");
    let w = Workload::from_file(&file).unwrap();
    let small = Setup::new(&args(None, &[4.0], Duration::from_secs(10)), &w, &file).unwrap();
    let big = Setup::new(&args(Some(16), &[4.0], Duration::from_secs(10)), &w, &file).unwrap();
    assert_eq!((big.scale.rate, big.scale.copies), (2.0, 2));
    let (s, s_stats) = run(&small, Router::Kvroute);
    let (b, b_stats) = run(&big, Router::Kvroute);
    assert_accounted(&b, &b_stats);
    let (rs, rb) = (&s.bench.steps[0], &b.bench.steps[0]);
    assert_eq!(rb.rate, 2.0 * rs.rate);
    // Twice the requests over twice the pods (Poisson counts: within 25 %).
    let ratio = rb.requests.planned as f64 / rs.requests.planned as f64;
    assert!((1.5..2.5).contains(&ratio), "{ratio}");
    assert_eq!(s_stats.pods * 2, b_stats.pods);
    // Both copies' adapters were requested, so every pod served someone.
    assert_eq!(rb.per_pod.len(), 16, "{:?}", rb.per_pod);
}

#[test]
fn the_command_writes_compares_report_shape() {
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_kvroute-lab"))
        .arg("simulate")
        .arg("--workloads")
        .arg(workload_file("kv-pressure"))
        .args(["--pods", "4", "--rates", "8,20", "--duration", "5s"])
        .arg("--output-dir")
        .arg(out.path())
        .status()
        .unwrap();
    assert!(status.success());
    let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    for expected in [
        "## Simulation",
        "## Workload `kv-pressure`",
        "kv-pressure: kvroute / each other router",
        "| kvroute |",
        "| round-robin |",
        "| least-request |",
    ] {
        assert!(md.contains(expected), "report.md lacks {expected:?}");
    }
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).unwrap()).unwrap();
    assert_eq!(results[0]["pods"], 4);
    assert_eq!(results[0]["runs"].as_array().map(Vec::len), Some(3));
    for router in ["kvroute", "round-robin", "least-request"] {
        assert!(
            out.path()
                .join(format!("kv-pressure-{router}.json"))
                .is_file()
        );
    }
}
