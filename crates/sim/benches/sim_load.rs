//! CPU cost of the simulator under load (a measurement, not a check):
//!
//! ```sh
//! cargo bench --bench sim_load
//! KVROUTE_SIM_LOAD_SECS=20 KVROUTE_SIM_LOAD_STREAMS=300 cargo bench --bench sim_load
//! ```
//!
//! The fleet runs on its own runtime (threads `sim-rt`), the load generator on another
//! (`load-rt`), so the CPU time of each is read separately from `/proc/self/task/*/stat`.
//! A non-streamed request now and then compares its wall-clock latency × speedup with the
//! simulated latency it reports: near 1 means the simulator keeps up with its own clock.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_sim::{FleetConfig, PodConfig, SimFleet};
use serde_json::json;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// CPU seconds used so far by this process's threads whose name starts with `prefix`.
fn cpu_seconds(prefix: &str) -> f64 {
    let mut ticks = 0u64;
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return f64::NAN;
    };
    for task in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[open + 1..close].starts_with(prefix) {
            continue;
        }
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // After the command: state is field 3, utime 14, stime 15.
        let utime: u64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0);
        let stime: u64 = fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
        ticks += utime + stime;
    }
    ticks as f64 / 100.0 // USER_HZ is 100 on Linux
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `cargo test --benches` runs bench targets in test mode: nothing to measure there.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let secs: u64 = env_or("KVROUTE_SIM_LOAD_SECS", 10);
    let streams: usize = env_or("KVROUTE_SIM_LOAD_STREAMS", 300);
    let speedup: f64 = env_or("KVROUTE_SIM_LOAD_SPEEDUP", 1.0);
    let pods: usize = env_or("KVROUTE_SIM_LOAD_PODS", 16);

    let sim_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sim-rt")
        .enable_all()
        .build()
        .expect("sim runtime");
    let load_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("load-rt")
        .enable_all()
        .build()
        .expect("load runtime");

    let config = FleetConfig {
        speedup,
        seed: 1,
        ..FleetConfig::uniform(pods, PodConfig::default())
    };
    let fleet = sim_rt
        .block_on(SimFleet::start(config))
        .expect("fleet starts");
    let endpoints = fleet.endpoints();

    let tokens = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    let (sim0, load0, t0) = (
        cpu_seconds("sim-rt"),
        cpu_seconds("load-rt"),
        Instant::now(),
    );
    let ratios = load_rt.block_on(async {
        let c = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(secs);
        let shared = "You are a helpful assistant. ".repeat(60);
        let workers = (0..streams).map(|w| {
            let c = c.clone();
            let addr = endpoints[w % endpoints.len()];
            let tokens = tokens.clone();
            let requests = requests.clone();
            let shared = shared.clone();
            async move {
                let mut ratios = Vec::new();
                let mut i = 0u64;
                while Instant::now() < deadline {
                    i += 1;
                    let prompt = format!("{shared} user {w} question {i}: tell me more.");
                    let stream = !(w as u64 + i).is_multiple_of(10);
                    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 200,
                                      "stream": stream});
                    let started = Instant::now();
                    let Ok(mut res) = c
                        .post(format!("http://{addr}/v1/completions"))
                        .json(&body)
                        .send()
                        .await
                    else {
                        continue;
                    };
                    if stream {
                        while let Ok(Some(chunk)) = res.chunk().await {
                            let n = chunk.windows(6).filter(|w| w == b"data: ").count();
                            tokens.fetch_add(n as u64, Ordering::Relaxed);
                        }
                    } else {
                        let sim_e2e: f64 = res
                            .headers()
                            .get("x-sim-e2e-ms")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(f64::NAN);
                        let _ = res.bytes().await;
                        let wall = started.elapsed().as_secs_f64() * 1e3 * speedup;
                        ratios.push(wall / sim_e2e);
                        tokens.fetch_add(200, Ordering::Relaxed);
                    }
                    requests.fetch_add(1, Ordering::Relaxed);
                }
                ratios
            }
        });
        futures::future::join_all(workers).await
    });
    let wall = t0.elapsed().as_secs_f64();
    let (sim_cpu, load_cpu) = (cpu_seconds("sim-rt") - sim0, cpu_seconds("load-rt") - load0);
    let mut ratios: Vec<f64> = ratios
        .into_iter()
        .flatten()
        .filter(|r| r.is_finite())
        .collect();
    ratios.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        ratios
            .get(((ratios.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    println!(
        "pods={pods} streams={streams} speedup={speedup} wall={wall:.1}s requests={} tokens/s={:.0}",
        requests.load(Ordering::Relaxed),
        tokens.load(Ordering::Relaxed) as f64 / wall
    );
    println!(
        "simulator CPU: {:.1}% of one core ({sim_cpu:.2}s); load generator CPU: {:.1}% ({load_cpu:.2}s)",
        100.0 * sim_cpu / wall,
        100.0 * load_cpu / wall
    );
    println!(
        "wall×speedup / simulated e2e over {} requests: p50 {:.3} p90 {:.3} max {:.3}",
        ratios.len(),
        pct(0.5),
        pct(0.9),
        pct(1.0)
    );
    sim_rt.block_on(fleet.shutdown());
}
