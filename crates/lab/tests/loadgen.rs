//! `kvroute bench`: the seeded generator follows its workload file, every shipped workload is
//! valid, and a bench run against simulated pods reports every field with zero errors.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use kvroute_lab::loadgen::workload::{Dist, Request};
use kvroute_lab::loadgen::{BenchArgs, Plan, Workload};
use kvroute_sim::SimFleet;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::Value;

const SHIPPED: [&str; 8] = [
    "multi-lora",
    "multi-lora-fits",
    "kv-pressure",
    "shared-prefix-pressure",
    "shared-prefix",
    "mixed",
    "overload-priority",
    "noisy-tenant",
];

fn workloads_dir() -> PathBuf {
    PathBuf::from(kvroute_lab::WORKLOADS_DIR)
}

fn shipped(name: &str) -> Workload {
    Workload::from_file(&workloads_dir().join(format!("{name}.yaml"))).expect("shipped workload")
}

fn args(target: String, workload: PathBuf) -> BenchArgs {
    BenchArgs {
        target,
        workload,
        rate: None,
        rates: Vec::new(),
        step_duration: None,
        requests_per_step: None,
        speedup: 1.0,
        output: None,
        seed: None,
        max_concurrency: 256,
        timeout: Duration::from_secs(60),
        model: None,
        raw: false,
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn the_generator_is_deterministic_for_a_seed_and_differs_across_seeds_and_steps() {
    let w = shipped("mixed");
    let d = Duration::from_secs(30);
    let a = w.plan_step(7, 0, 10.0, d, None);
    assert!(a.len() > 200, "{}", a.len());
    assert_eq!(a, w.plan_step(7, 0, 10.0, d, None));
    assert_ne!(a, w.plan_step(8, 0, 10.0, d, None));
    assert_ne!(a, w.plan_step(7, 1, 10.0, d, None));
    let capped = w.plan_step(7, 0, 10.0, d, Some(25));
    assert_eq!(capped.len(), 25);
    assert_eq!(capped[..], a[..25], "a cap truncates the same plan");
}

#[test]
fn arrivals_are_poisson_at_the_rate() {
    let w = shipped("kv-pressure");
    let rate = 20.0;
    let plan = w.plan_step(1, 0, rate, Duration::from_secs(500), None);
    let expected = rate * 500.0;
    let n = plan.len() as f64;
    assert!((n - expected).abs() < 0.05 * expected, "{n} arrivals");
    let gaps: Vec<f64> = plan
        .windows(2)
        .map(|p| (p[1].at - p[0].at).as_secs_f64())
        .collect();
    let m = mean(&gaps);
    let sd = (gaps.iter().map(|g| (g - m).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
    assert!((m * rate - 1.0).abs() < 0.05, "mean gap {m}");
    // Exponential gaps: coefficient of variation 1 (a regular schedule would give 0).
    assert!((sd / m - 1.0).abs() < 0.08, "cv {}", sd / m);
    assert!(plan.windows(2).all(|p| p[0].at <= p[1].at));
    assert!(plan.iter().all(|r| r.at < Duration::from_secs(500)));
}

#[test]
fn lengths_follow_their_distributions() {
    let mut rng = SmallRng::seed_from_u64(5);
    let lognormal = Dist::Lognormal {
        median: 1024.0,
        sigma: 1.0,
        min: 1,
        max: 1_000_000,
    };
    let mut v: Vec<f64> = (0..20_000)
        .map(|_| f64::from(lognormal.sample(&mut rng)))
        .collect();
    v.sort_by(f64::total_cmp);
    let median = v[v.len() / 2];
    assert!((median / 1024.0 - 1.0).abs() < 0.05, "median {median}");
    // mean = median * e^(sigma^2 / 2) = 1.65 x median: heavy right tail.
    let m = mean(&v);
    assert!((m / (1024.0 * 0.5f64.exp()) - 1.0).abs() < 0.08, "mean {m}");
    assert!(
        v[v.len() * 99 / 100] > 8.0 * median,
        "p99 {}",
        v[v.len() * 99 / 100]
    );

    let clamped = Dist::Lognormal {
        median: 100.0,
        sigma: 2.0,
        min: 50,
        max: 400,
    };
    let c: Vec<u32> = (0..2_000).map(|_| clamped.sample(&mut rng)).collect();
    assert!(c.iter().all(|&x| (50..=400).contains(&x)));
    assert!(c.contains(&50) && c.contains(&400));

    let uniform = Dist::Uniform { min: 10, max: 30 };
    let u: Vec<f64> = (0..10_000)
        .map(|_| f64::from(uniform.sample(&mut rng)))
        .collect();
    assert!((mean(&u) - 20.0).abs() < 0.5);
    let e = Dist::Exponential {
        mean: 200.0,
        min: 1,
        max: 100_000,
    };
    let x: Vec<f64> = (0..20_000).map(|_| f64::from(e.sample(&mut rng))).collect();
    assert!((mean(&x) / 200.0 - 1.0).abs() < 0.05, "{}", mean(&x));
}

#[test]
fn adapters_are_drawn_with_zipf_popularity() {
    let w = shipped("multi-lora");
    let plan = w.plan_step(3, 0, 50.0, Duration::from_secs(200), None);
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for r in &plan {
        *counts.entry(r.model.clone()).or_default() += 1;
    }
    let n = plan.len() as f64;
    assert_eq!(counts.len(), 16, "{counts:?}");
    assert!(!counts.contains_key(&w.model), "base_share is 0");
    let harmonic: f64 = (1..=16).map(|k| 1.0 / f64::from(k)).sum();
    let share = |name: &str| counts[name] as f64 / n;
    assert!(
        (share("lora-0") - 1.0 / harmonic).abs() < 0.02,
        "{counts:?}"
    );
    let ratio = share("lora-0") / share("lora-3");
    assert!((ratio - 4.0).abs() < 0.6, "rank 1 / rank 4 = {ratio}");
    assert!(share("lora-15") < share("lora-7") && share("lora-7") < share("lora-1"));
}

#[test]
fn class_weights_and_shared_prefix_groups_are_honoured() {
    let w = shipped("mixed");
    let plan = w.plan_step(9, 0, 40.0, Duration::from_secs(200), None);
    let n = plan.len() as f64;
    let by_class = |c: usize| plan.iter().filter(|r| r.class == c).count() as f64 / n;
    for (c, weight) in [(0, 0.4), (1, 0.3), (2, 0.3)] {
        assert!(
            (by_class(c) - weight).abs() < 0.03,
            "class {c}: {}",
            by_class(c)
        );
    }
    let prefixed: Vec<&Request> = plan.iter().filter(|r| r.class == 2).collect();
    let systems: HashSet<&str> = prefixed
        .iter()
        .filter_map(|r| r.system.as_deref())
        .collect();
    let prompts: HashSet<(&str, &str)> = prefixed
        .iter()
        .filter_map(|r| Some((r.system.as_deref()?, r.prompt.as_str())))
        .collect();
    assert_eq!(systems.len(), 16);
    assert!(
        prompts.len() > 100 && prompts.len() <= 128,
        "{}",
        prompts.len()
    );
    assert!(
        prefixed
            .iter()
            .all(|r| r.prompt_tokens == 1700 && r.max_tokens == 200)
    );
    // The long-tail class is the base model, the LoRA class adapters only.
    assert!(
        plan.iter()
            .filter(|r| r.class == 1)
            .all(|r| r.model == w.model)
    );
    assert!(
        plan.iter()
            .filter(|r| r.class == 0)
            .all(|r| r.model.starts_with("lora-"))
    );
}

#[test]
fn every_shipped_workload_parses_and_builds_a_valid_fleet() {
    let mut found: Vec<String> = std::fs::read_dir(workloads_dir())
        .expect("benches/workloads")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| {
            let w = Workload::from_file(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let fleet = w.fleet_config().expect("fleet");
            fleet.validate().expect("valid fleet");
            let pods = if w.name == "shared-prefix-pressure" {
                4
            } else {
                8
            };
            assert_eq!(fleet.pods.len(), pods, "{}", w.name);
            assert!(fleet.speedup >= 1.0);
            assert_eq!(
                p.file_stem().and_then(|s| s.to_str()),
                Some(w.name.as_str())
            );
            for pod in &fleet.pods {
                assert!(pod.engine.max_cpu_loras >= pod.engine.max_loras);
            }
            w.name
        })
        .collect();
    found.sort();
    let mut expected: Vec<String> = SHIPPED.iter().map(|s| s.to_string()).collect();
    expected.sort();
    assert_eq!(found, expected);

    let ml = shipped("multi-lora").fleet_config().expect("fleet");
    assert_eq!(ml.pods[0].lora_adapters.len(), 16);
    assert_eq!(ml.pods[0].engine.max_loras, 2);
    let fits = shipped("multi-lora-fits").fleet_config().expect("fleet");
    let slots: usize = fits.pods.iter().map(|p| p.engine.max_loras).sum();
    assert!(slots >= fits.pods[0].lora_adapters.len());
    assert_eq!(fits.pods[0].engine.max_loras, 4);
    let kv = shipped("kv-pressure").fleet_config().expect("fleet");
    assert!(kv.pods[0].engine.num_gpu_blocks < 4_000);
}

#[test]
fn the_flow_control_workloads_send_what_docs_workloads_says() {
    let d = Duration::from_secs(600);
    let share = |plan: &[Request], class: usize| {
        plan.iter().filter(|r| r.class == class).count() as f64 / plan.len() as f64
    };
    // overload-priority: 40 % critical at every step, half and twice the capacity on the ladder.
    let w = shipped("overload-priority");
    let capacity = w.capacity.expect("capacity");
    assert!(w.rates.contains(&(capacity / 2.0)) && w.rates.contains(&(2.0 * capacity)));
    let objectives = w.objectives.clone().expect("objectives");
    assert!(objectives["critical"] > 0 && objectives["sheddable"] < 0);
    assert_eq!(w.classes[0].objective.as_deref(), Some("critical"));
    let top = w.rates.len() - 1;
    let plan = w.plan_step(w.seed, top, w.rates[top], d, None);
    let critical = share(&plan, 0);
    assert!((critical - 0.4).abs() < 0.01, "{critical}");
    // The critical requests alone stay below capacity at the top step.
    assert!(critical * w.rates[top] < 0.85 * capacity);
    // noisy-tenant: tenant-b alone first, then tenant-a at 10x tenant-b's unchanged rate,
    // together above capacity.
    let w = shipped("noisy-tenant");
    assert_eq!(w.classes[0].tenant.as_deref(), Some("tenant-a"));
    assert_eq!(w.classes[1].tenant.as_deref(), Some("tenant-b"));
    let alone = w.plan_step(w.seed, 0, w.rates[0], d, None);
    assert!(alone.iter().all(|r| r.class == 1));
    let shared = w.plan_step(w.seed, 1, w.rates[1], d, None);
    let b_rate =
        |plan: &[Request]| plan.iter().filter(|r| r.class == 1).count() as f64 / d.as_secs_f64();
    let (b_alone, b_shared) = (b_rate(&alone), b_rate(&shared));
    assert!(
        (b_shared / b_alone - 1.0).abs() < 0.1,
        "{b_alone} {b_shared}"
    );
    let a_over_b = share(&shared, 0) / share(&shared, 1);
    assert!((a_over_b - 10.0).abs() < 1.0, "{a_over_b}");
    assert!(w.rates[1] > w.capacity.expect("capacity"));
}

fn step(report: &Value, i: usize) -> &Value {
    &report["steps"][i]
}

fn number(v: &Value, pointer: &str) -> f64 {
    v.pointer(pointer)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{pointer} missing in {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_against_one_simulated_pod_reports_every_field_with_zero_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("small.yaml");
    std::fs::write(
        &path,
        "name: small\nseed: 11\nrates: [20]\nstep_duration: 2s\n\
         fleet: {pods: 1, num_gpu_blocks: 3000, max_loras: 2, adapters: 3, speedup: 10}\n\
         classes:\n\
         \x20 - name: lora\n\
         \x20   lora: {base_share: 0.2, zipf_s: 1.0}\n\
         \x20   prompt_tokens: {dist: lognormal, median: 200, sigma: 0.5, min: 16, max: 1000}\n\
         \x20   output_tokens: {dist: uniform, min: 8, max: 24}\n",
    )
    .expect("write workload");
    let workload = Workload::from_file(&path).expect("valid");
    let fleet = SimFleet::start(workload.fleet_config().expect("fleet"))
        .await
        .expect("fleet starts");
    let pod = fleet.endpoints()[0];
    let output = dir.path().join("report.json");
    let mut a = args(format!("http://{pod}"), path);
    a.rates = vec![20.0, 40.0];
    a.requests_per_step = Some(20);
    a.speedup = 10.0;
    a.output = Some(output.clone());
    a.raw = true;
    let started = std::time::Instant::now();
    kvroute_lab::loadgen::run(a).await.expect("bench runs");
    assert!(started.elapsed() < Duration::from_secs(20));
    let metrics = reqwest::get(format!("http://{pod}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    fleet.shutdown().await;

    let report: Value =
        serde_json::from_slice(&std::fs::read(&output).expect("report")).expect("JSON");
    assert_eq!(report["workload"], "small");
    assert_eq!(report["speedup"], 10.0);
    assert_eq!(report["seed"], 11);
    assert!(
        report["endpoint"]
            .as_str()
            .expect("endpoint")
            .ends_with("/v1/completions")
    );
    assert!(number(&report, "/wall_s") > 0.0);
    assert_eq!(report["steps"].as_array().expect("steps").len(), 2);
    for (i, rate) in [(0, 20.0), (1, 40.0)] {
        let s = step(&report, i);
        assert_eq!(number(s, "/rate"), rate);
        assert_eq!(number(s, "/requests/planned"), 20.0, "{s}");
        assert_eq!(number(s, "/requests/ok"), 20.0, "{s}");
        assert_eq!(number(s, "/errors"), 0.0, "{s}");
        assert_eq!(number(s, "/requests/dropped"), 0.0);
        assert_eq!(s["errors_by_kind"], serde_json::json!({}));
        assert_eq!(s["status_counts"]["200"], 20);
        assert_eq!(s["per_pod"], serde_json::json!({"0": 20}));
        assert!(number(s, "/elapsed_s") > 0.0);
        let rps = number(s, "/throughput/requests_per_s");
        assert!(rps > 1.0 && rps < 3.0 * rate, "{rps}");
        let tps = number(s, "/throughput/output_tokens_per_s");
        assert!(
            tps > 8.0 * rps * 0.9 && tps < 24.0 * rps * 1.1,
            "{tps} vs {rps}"
        );
        for key in ["ttft_s", "e2e_s"] {
            let (p50, p90, p99) = (
                number(s, &format!("/{key}/p50")),
                number(s, &format!("/{key}/p90")),
                number(s, &format!("/{key}/p99")),
            );
            assert!(
                0.0 < p50 && p50 <= p90 && p90 <= p99 && p99 < 30.0,
                "{key}: {s}"
            );
        }
        // Prefill of a few hundred tokens on an H100: milliseconds, plus adapter loads.
        assert!(number(s, "/ttft_s/p50") < 2.0);
        assert!(number(s, "/e2e_s/p50") > number(s, "/ttft_s/p50"));
        let (i50, i90) = (number(s, "/itl_s/p50"), number(s, "/itl_s/p90"));
        assert!(0.0 <= i50 && i50 <= i90 && i90 < 1.0, "{s}");
        let tpot = number(s, "/tpot_s/p50");
        assert!(
            tpot > 0.004 && tpot < 0.1,
            "decode step of an 8B model: {tpot}"
        );
        let records = s["records"].as_array().expect("--raw records");
        assert_eq!(records.len(), 20);
        for r in records {
            assert_eq!(r["status"], 200);
            assert_eq!(r["pod"], "0");
            assert!(r["error"].is_null());
            assert_eq!(r["output_tokens"], r["max_tokens"], "{r}");
            assert_eq!(r["text_events"], r["max_tokens"]);
            assert_eq!(
                r["itl_s"].as_array().map(Vec::len),
                r["max_tokens"].as_u64().map(|n| n as usize - 1)
            );
            let planned = r["planned_prompt_tokens"].as_u64().expect("planned");
            assert_eq!(r["prompt_tokens"].as_u64(), Some(planned), "{r}");
        }
    }
    // The adapters were loaded; the simulator counts it.
    let disk = metrics
        .lines()
        .find(|l| l.starts_with("kvroute_sim:lora_loads_total") && l.contains("source=\"disk\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .expect("lora loads counter");
    assert!(disk >= 1.0, "{disk}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shipped_workload_runs_against_one_pod_of_its_fleet() {
    for name in SHIPPED {
        let path = workloads_dir().join(format!("{name}.yaml"));
        // The first step, with its class weights (a workload may weigh them per step).
        let workload = shipped(name).select_steps(&[0]);
        let mut config = workload.fleet_config().expect("fleet");
        config.pods.truncate(1);
        config.speedup = 50.0;
        let fleet = SimFleet::start(config).await.expect("fleet starts");
        let mut a = args(format!("http://{}", fleet.endpoints()[0]), path);
        a.rate = Some(workload.rates[0]);
        a.requests_per_step = Some(4);
        a.speedup = 50.0;
        // Simulated time: a minute of wall time, for a loaded 2-core machine.
        a.timeout = Duration::from_secs(3000);
        let plan = Plan::new(&a, workload).expect("plan");
        let report = kvroute_lab::loadgen::bench(&plan).await;
        fleet.shutdown().await;
        let s = &report.steps[0];
        assert_eq!(s.requests.ok, 4, "{name}: {s:?}");
        assert_eq!(s.errors, 0, "{name}");
    }
}

#[tokio::test]
async fn an_unreachable_target_gives_connect_errors_not_a_failure() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let mut a = args(
        format!("http://{addr}"),
        workloads_dir().join("kv-pressure.yaml"),
    );
    a.rate = Some(1000.0);
    a.requests_per_step = Some(5);
    let plan = Plan::new(&a, shipped("kv-pressure")).expect("plan");
    let report = kvroute_lab::loadgen::bench(&plan).await;
    let s = &report.steps[0];
    assert_eq!((s.requests.ok, s.errors), (0, 5));
    assert_eq!(s.errors_by_kind.get("connect"), Some(&5));
    assert_eq!(s.ttft_s.p50, None);
    let json = serde_json::to_value(&report).expect("JSON");
    assert!(json["steps"][0]["ttft_s"]["p50"].is_null());
}

#[test]
fn bad_flags_are_refused_with_a_reason() {
    let w = shipped("kv-pressure");
    let path = workloads_dir().join("kv-pressure.yaml");
    let mut a = args("http://127.0.0.1:1".into(), path.clone());
    a.speedup = 0.0;
    assert!(
        Plan::new(&a, w.clone())
            .expect_err("speedup")
            .to_string()
            .contains("speedup")
    );
    let mut a = args("ftp://x".into(), path.clone());
    a.rate = Some(1.0);
    assert!(Plan::new(&a, w.clone()).is_err());
    let mut a = args("http://127.0.0.1:1".into(), path.clone());
    a.rates = vec![1.0, -2.0];
    assert!(Plan::new(&a, w.clone()).is_err());
    let mut a = args("http://127.0.0.1:1".into(), path);
    a.rate = Some(1e6);
    a.step_duration = Some(Duration::from_secs(3600));
    assert!(
        Plan::new(&a, w.clone())
            .expect_err("too many")
            .to_string()
            .contains("requests")
    );
    a.requests_per_step = Some(100);
    let plan = Plan::new(&a, w).expect("capped");
    assert_eq!(plan.rates, vec![1e6]);
    assert_eq!(plan.url, "http://127.0.0.1:1/v1/completions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrivals_beyond_max_concurrency_are_dropped_not_queued() {
    let workload = shipped("kv-pressure");
    let mut config = workload.fleet_config().expect("fleet");
    config.pods.truncate(1);
    let fleet = SimFleet::start(config).await.expect("fleet starts");
    let mut a = args(
        format!("http://{}", fleet.endpoints()[0]),
        workloads_dir().join("kv-pressure.yaml"),
    );
    // 5 arrivals within a few milliseconds; each request decodes at least 16 tokens (> 100 ms).
    a.rate = Some(1000.0);
    a.requests_per_step = Some(5);
    a.max_concurrency = 1;
    let plan = Plan::new(&a, workload).expect("plan");
    let report = kvroute_lab::loadgen::bench(&plan).await;
    fleet.shutdown().await;
    let s = &report.steps[0];
    assert_eq!(s.requests.ok, 1, "{s:?}");
    assert_eq!((s.requests.dropped, s.requests.sent), (4, 1));
    assert_eq!(s.errors_by_kind.get("dropped"), Some(&4));
}
