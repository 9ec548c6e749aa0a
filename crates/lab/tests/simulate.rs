//! `kvroute-lab simulate` in small configurations: the shipped multi-LoRA workload on its
//! own 8 pods (a few hundred requests), once scaled to 16 pods, kvroute's flow control on
//! the overload and tenant workloads, and the command end to end. Virtual time only: each
//! simulation takes well under a second even in a debug build.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvroute_lab::compare::report::RouterRun;
use kvroute_lab::loadgen::Workload;
use kvroute_lab::loadgen::report::StepReport;
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
        max_queue_wait: Duration::from_secs(15),
        standing_queue_wait: Duration::from_secs(2),
        standing_queue_after: Duration::from_secs(5),
        seed: None,
        seeds: None,
        jobs: Some(1),
        no_warmup: false,
        diagnose: None,
        replicas: 1,
        output_dir: PathBuf::new(),
    }
}

/// Runs `kvroute-lab simulate` on the shipped `workload` with `args`, into `out`, and
/// checks that it succeeded.
fn simulate_command(workload: &str, args: &[&str], out: &Path) {
    let status = Command::new(env!("CARGO_BIN_EXE_kvroute-lab"))
        .arg("simulate")
        .arg("--workloads")
        .arg(workload_file(workload))
        .args(args)
        .arg("--output-dir")
        .arg(out)
        .status()
        .unwrap();
    assert!(status.success(), "simulate {workload} {args:?}: {status}");
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
        assert_eq!(
            c.planned,
            c.ok + c.errors + c.shed,
            "{:?}",
            step.errors_by_kind
        );
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
fn the_cache_aware_model_keeps_prefixes_home_as_round_robin_does_not() {
    // The peers' policy, modelled: requests sharing a system prompt follow it to the pod
    // whose tree holds it, so the fleet's prefix cache hits far more often than when every
    // pod takes its turn; every request is accounted for.
    let file = workload_file("shared-prefix");
    let w = Workload::from_file(&file).unwrap();
    let a = args(Some(4), &[16.0], Duration::from_secs(15));
    let setup = Setup::new(&a, &w, &file).unwrap();
    let (model, model_stats) = run(&setup, Router::CacheAware);
    let (rr, rr_stats) = run(&setup, Router::RoundRobin);
    assert_accounted(&model, &model_stats);
    assert_accounted(&rr, &rr_stats);
    assert_eq!(model.router.name(), "cache-aware");
    let hits = |r: &RouterRun| {
        r.fleet_steps[0]
            .prefix_hit_rate
            .expect("the pods counted queries")
    };
    assert!(
        hits(&model) > hits(&rr) + 0.1,
        "prefix hit rate: cache-aware model {}, round robin {}",
        hits(&model),
        hits(&rr)
    );
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

/// Shed requests of a step by reason.
fn shed(step: &StepReport, reason: &str) -> usize {
    step.shed_by_reason.get(reason).copied().unwrap_or(0)
}

#[test]
fn at_twice_the_capacity_kvroute_sheds_only_sheddable_requests_and_holds_none_without_a_queue() {
    let file = workload_file("overload-priority");
    let w = Workload::from_file(&file).unwrap();
    let mut a = args(None, &[44.0], Duration::from_secs(20));
    let setup = Setup::new(&a, &w, &file).unwrap();
    let (on, on_stats) = run(&setup, Router::Kvroute);
    assert_accounted(&on, &on_stats);
    let step = &on.bench.steps[0];
    let (critical, sheddable) = (
        &step.by_objective["critical"],
        &step.by_objective["sheddable"],
    );
    assert!(sheddable.shed > 0, "{sheddable:?}");
    assert_eq!(sheddable.shed, shed(step, "rejected-saturated"));
    assert_eq!(critical.shed, 0, "{critical:?}");
    assert_eq!(critical.completed, critical.planned);
    assert!(
        on_stats.shed as usize >= step.requests.shed,
        "the warm-up's too"
    );
    // Round robin has no flow control: nothing shed, the same requests planned.
    let (rr, rr_stats) = run(&setup, Router::RoundRobin);
    assert_accounted(&rr, &rr_stats);
    assert_eq!(rr.bench.steps[0].requests.shed, 0);
    assert_eq!(
        rr.bench.steps[0].by_objective["critical"].planned,
        critical.planned
    );
    assert!(
        critical.ttft_s.p90 < rr.bench.steps[0].by_objective["critical"].ttft_s.p90,
        "critical p90 TTFT: kvroute {:?}, round robin {:?}",
        critical.ttft_s.p90,
        rr.bench.steps[0].by_objective["critical"].ttft_s.p90
    );
    // Queue off: nothing waits; sheddable requests are still refused.
    a.max_queue_wait = Duration::ZERO;
    let setup = Setup::new(&a, &w, &file).unwrap();
    let (off, off_stats) = run(&setup, Router::Kvroute);
    assert_accounted(&off, &off_stats);
    assert_eq!(off_stats.held, 0);
    assert!(on_stats.held > 0, "with the queue some requests wait");
    let step = &off.bench.steps[0];
    assert_eq!(step.requests.shed, shed(step, "rejected-saturated"));
    assert_eq!(step.by_objective["critical"].shed, 0);
}

#[test]
fn a_wait_that_runs_out_is_shed_as_ttl_expired_and_counts_in_ttft_until_then() {
    let file = workload_file("noisy-tenant");
    let w = Workload::from_file(&file).unwrap();
    // tenant-a at 1.4× the fleet's capacity beside tenant-b; waits of at most 1 s.
    let mut a = args(None, &[3.0, 33.0], Duration::from_secs(20));
    a.max_queue_wait = Duration::from_secs(1);
    let setup = Setup::new(&a, &w, &file).unwrap();
    let (run_, stats) = run(&setup, Router::Kvroute);
    assert_accounted(&run_, &stats);
    let busy = &run_.bench.steps[1];
    let expired = shed(busy, "rejected-ttl-expired");
    assert!(expired > 0, "{:?}", busy.shed_by_reason);
    assert_eq!(busy.requests.shed, expired, "no sheddable objective here");
    assert!(busy.by_tenant["tenant-a"].shed > 0);
    assert_eq!(run_.bench.steps[0].requests.shed, 0, "tenant-b alone fits");
    assert!(!run_.bench.steps[0].by_tenant.contains_key("tenant-a"));
    // A completed request's TTFT is its wait (at most 1 s) plus the pod's own.
    assert_eq!(busy.ttft_s.count, busy.pod_ttft_s.count);
    let waited = busy.ttft_s.mean.unwrap() - busy.pod_ttft_s.mean.unwrap();
    assert!(waited > 0.0 && waited <= 1.0 + 1e-9, "mean wait {waited}");
}
#[test]
fn the_command_writes_compares_report_shape() {
    let out = tempfile::tempdir().unwrap();
    simulate_command(
        "kv-pressure",
        &["--pods", "4", "--rates", "8,20", "--duration", "5s"],
        out.path(),
    );
    let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    for expected in [
        "## Simulation",
        "## Workload `kv-pressure`",
        "kv-pressure: kvroute / each other router",
        "| kvroute |",
        "| kvroute-events |",
        "| round-robin |",
        "| least-request |",
    ] {
        assert!(md.contains(expected), "report.md lacks {expected:?}");
    }
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).unwrap()).unwrap();
    assert_eq!(results[0]["pods"], 4);
    assert_eq!(results[0]["runs"].as_array().map(Vec::len), Some(4));
    for router in ["kvroute", "kvroute-events", "round-robin", "least-request"] {
        assert!(
            out.path()
                .join(format!("kv-pressure-{router}.json"))
                .is_file()
        );
    }
}

#[test]
fn seeds_run_everything_once_per_seed_and_summarize_the_p90s_over_them() {
    let out = tempfile::tempdir().unwrap();
    simulate_command(
        "kv-pressure",
        &[
            "--pods",
            "4",
            "--rates",
            "8,20",
            "--duration",
            "5s",
            "--routers",
            "kvroute,round-robin",
            "--seeds",
            "3,5-6",
        ],
        out.path(),
    );
    // Each seed's p90s at the second rate (kv-pressure's 20 req/s for 8 pods, 10 on 4),
    // from its own report.
    let p90_at = |seed: u64, router: usize| -> f64 {
        let path = out.path().join(format!("seed-{seed}")).join("results.json");
        let results: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let steps = &results[0]["runs"][router]["bench"]["steps"];
        assert_eq!(steps[1]["rate"], 10.0);
        steps[1]["ttft_s"]["p90"].as_f64().unwrap()
    };
    let seeds = [3, 5, 6];
    let kvroute: Vec<f64> = seeds.iter().map(|&s| p90_at(s, 0)).collect();
    let round_robin: Vec<f64> = seeds.iter().map(|&s| p90_at(s, 1)).collect();
    assert!(
        kvroute.windows(2).any(|w| w[0] != w[1]),
        "each seed is its own trace: {kvroute:?}"
    );
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let md = std::fs::read_to_string(out.path().join("seeds.md")).unwrap();
    assert!(md.starts_with("# kvroute-lab simulate: 3 seeds"), "{md}");
    let row = |router: &str| {
        md.lines()
            .find(|line| line.starts_with(&format!("| 10 | {router} |")))
            .unwrap_or_else(|| panic!("no row of {router} at 10 req/s: {md}"))
            .split('|')
            .map(str::trim)
            .collect::<Vec<_>>()
    };
    let (ours, theirs) = (row("kvroute"), row("round-robin"));
    let listed: Vec<f64> = ours[3].split(" / ").map(|v| v.parse().unwrap()).collect();
    for (shown, exact) in listed.iter().zip(&kvroute) {
        assert!(
            (shown - exact).abs() < 0.0006,
            "{listed:?} against {kvroute:?}"
        );
    }
    let shown_mean: f64 = theirs[4].parse().unwrap();
    assert!((shown_mean - mean(&round_robin)).abs() < 0.0006, "{md}");
    let ratio: f64 = theirs[7].parse().unwrap();
    assert!(
        (ratio - mean(&round_robin) / mean(&kvroute)).abs() < 0.006,
        "{md}"
    );
}

#[test]
fn diagnostics_list_every_completed_request_with_the_waits_its_ttft_is_made_of() {
    let out = tempfile::tempdir().unwrap();
    let file = workload_file("shared-prefix-pressure");
    let w = Workload::from_file(&file).unwrap();
    let mut a = args(Some(4), &[28.0], Duration::from_secs(10));
    a.diagnose = Some(1);
    a.replicas = 2;
    a.output_dir = out.path().to_path_buf();
    let setup = Setup::new(&a, &w, &file).unwrap();
    let (run, _) = run(&setup, Router::KvrouteEvents);
    let csv = std::fs::read_to_string(
        out.path()
            .join("shared-prefix-pressure-kvroute-events-requests.csv"),
    )
    .unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some("arrived,step,pod,replica,waited_s,pod_ttft_s,ttft_s,prompt_tokens,cached_tokens")
    );
    let rows: Vec<Vec<f64>> = lines
        .map(|line| line.split(',').map(|f| f.parse().unwrap()).collect())
        .collect();
    // The warm-up step, then the measured one.
    let measured: Vec<&Vec<f64>> = rows.iter().filter(|r| r[1] == 1.0).collect();
    let step = &run.bench.steps[0];
    assert_eq!(measured.len(), step.requests.ok);
    let mean = measured.iter().map(|r| r[6]).sum::<f64>() / measured.len() as f64;
    assert!(
        (mean - step.ttft_s.mean.unwrap()).abs() < 1e-3,
        "the listed TTFTs average {mean}, the report's {:?}",
        step.ttft_s.mean
    );
    for r in &measured {
        assert!((r[4] + r[5] - r[6]).abs() < 2e-4, "{r:?}");
        assert!(r[2] < 4.0 && r[3] < 2.0, "pod and replica in range: {r:?}");
        assert!(r[8] <= r[7], "cached tokens within the prompt: {r:?}");
    }
    assert!(
        measured.iter().any(|r| r[3] == 1.0) && measured.iter().any(|r| r[8] > 0.0),
        "both replicas routed, and some prompts were cached"
    );
}

#[test]
fn the_command_reports_each_objectives_statistics_and_the_target_checks() {
    let out = tempfile::tempdir().unwrap();
    simulate_command(
        "overload-priority",
        &["--rates", "11,44", "--duration", "10s", "--no-warmup"],
        out.path(),
    );
    let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    for expected in [
        "| requests | held | shed |",
        "### overload-priority: per objective and tenant",
        "| 44 | kvroute | objective sheddable |",
        "rejected-saturated",
        "### overload-priority: target checks",
        "- `kvroute`: critical p90 TTFT at 44 req/s",
    ] {
        assert!(md.contains(expected), "report.md lacks {expected:?}");
    }
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).unwrap()).unwrap();
    let targets = results[0]["targets"].as_array().unwrap();
    let kvroute_shed = targets
        .iter()
        .find(|t| {
            t["router"] == "kvroute" && t["check"] == "shed requests not of a sheddable objective"
        })
        .unwrap();
    assert_eq!(kvroute_shed["met"], true, "{kvroute_shed}");
    let throughput = targets
        .iter()
        .find(|t| t["router"] == "kvroute" && t["check"].as_str().unwrap().contains("throughput"))
        .unwrap();
    assert!(
        throughput["value"].is_number(),
        "steady throughput measured"
    );
}

#[test]
fn kvroute_on_kv_events_accounts_for_every_request_with_one_replica_or_two() {
    let file = workload_file("shared-prefix");
    let w = Workload::from_file(&file).unwrap();
    let a = args(Some(4), &[16.0], Duration::from_secs(10));
    let setup = Setup::new(&a, &w, &file).unwrap();
    let (rr, _) = run(&setup, Router::RoundRobin);
    let hit_rate = |r: &RouterRun| r.fleet_total.prefix_hit_rate.unwrap_or(0.0);
    for replicas in [1, 2] {
        let setup = Setup {
            replicas,
            ..setup.clone()
        };
        let (events, stats) = run(&setup, Router::KvrouteEvents);
        assert_accounted(&events, &stats);
        // Each prompt goes where the engines say its shared prefix is cached.
        assert!(
            hit_rate(&events) > hit_rate(&rr) + 0.1,
            "{replicas} replica(s): prefix hit rate {} against round robin's {}",
            hit_rate(&events),
            hit_rate(&rr)
        );
        if replicas == 2 {
            // The `-x2` policy is two replicas whatever `--replicas` says, so one run can
            // set it beside one replica.
            let one = Setup {
                replicas: 1,
                ..setup.clone()
            };
            let (x2, _) = run(&one, Router::KvrouteEventsX2);
            assert_eq!(x2.router.name(), "kvroute-events-x2");
            assert_eq!(
                serde_json::to_value(&x2.bench.steps).unwrap(),
                serde_json::to_value(&events.bench.steps).unwrap()
            );
        }
    }
}
