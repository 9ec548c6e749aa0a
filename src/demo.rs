//! `kvroute demo`: kvroute on a laptop. Starts a simulated vLLM fleet, kvroute and a
//! real Envoy, drives a seeded multi-LoRA workload through it, then does the same on a
//! fresh identical fleet behind Envoy's round robin, and prints both side by side.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::app::{App, wait_for_snapshot};
use crate::compare::fleet_stats::parse_pod;
use crate::config::ServeConfig;
use crate::gateway::{EnvoyProcess, Gateway, envoy_binary};
use crate::sim::{FleetConfig, PodConfig, SimFleet};

/// Flags of `kvroute demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Simulated pods.
    #[arg(long, default_value_t = 4)]
    pub pods: usize,
    /// LoRA adapters in the workload (Zipf popularity).
    #[arg(long, default_value_t = 8)]
    pub adapters: usize,
    /// Adapter slots per pod (vLLM's --max-loras).
    #[arg(long, default_value_t = 2)]
    pub max_loras: usize,
    /// KV-cache blocks of 16 tokens per pod (small, to create pressure).
    #[arg(long, default_value_t = 1_200)]
    pub num_gpu_blocks: u32,
    /// Requests per router.
    #[arg(long, default_value_t = 240)]
    pub requests: usize,
    /// Poisson arrival rate, requests per simulated second.
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// Simulated seconds per wall-clock second.
    #[arg(long, default_value_t = 2.0)]
    pub speedup: f64,
    /// Seed of the workload and the fleet.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Envoy binary [default: $ENVOY_BIN, ./.venv/bin/envoy, envoy on PATH].
    #[arg(long)]
    pub envoy: Option<PathBuf>,
}

/// One request of the workload.
#[derive(Debug, Clone)]
struct Job {
    at: Duration,
    model: String,
    prompt: String,
    max_tokens: u32,
}

fn workload(args: &DemoArgs, base_model: &str) -> Vec<Job> {
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let zipf: Vec<f64> = (0..args.adapters).map(|k| 1.0 / (k as f64 + 1.0)).collect();
    let zipf_total: f64 = zipf.iter().sum();
    let mut at = 0.0;
    (0..args.requests)
        .map(|i| {
            at += -(1.0 - rng.random::<f64>()).ln() / args.rate;
            let model = if args.adapters == 0 || rng.random::<f64>() < 0.25 {
                base_model.to_owned()
            } else {
                let mut pick = rng.random::<f64>() * zipf_total;
                let mut index = 0;
                while index + 1 < zipf.len() && pick > zipf[index] {
                    pick -= zipf[index];
                    index += 1;
                }
                format!("lora-{index}")
            };
            // Heavy-tailed prompt lengths: log-uniform 100..4,000 tokens. "abc " is one
            // token for the simulator's tokenizer (pieces of at most 4 characters).
            let tokens = (100.0 * 40f64.powf(rng.random::<f64>())) as usize;
            let prompt = format!("request {i}: ") + &"abc ".repeat(tokens);
            Job {
                at: Duration::from_secs_f64(at),
                model,
                prompt,
                max_tokens: rng.random_range(16..=256),
            }
        })
        .collect()
}

/// What one request saw, in simulated time.
#[derive(Debug, Clone, Default)]
struct Outcome {
    ok: bool,
    ttft: f64,
    e2e: f64,
    pod: Option<String>,
}

async fn send(client: &reqwest::Client, url: &str, job: &Job, speedup: f64) -> Outcome {
    let body = serde_json::json!({
        "model": job.model, "prompt": job.prompt, "max_tokens": job.max_tokens,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let started = Instant::now();
    let Ok(mut response) = client.post(url).json(&body).send().await else {
        return Outcome::default();
    };
    let pod = response
        .headers()
        .get("x-sim-pod")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let status_ok = response.status().is_success();
    let mut ttft = None;
    // A stream counts as served only if it ends with `data: [DONE]`; the marker may
    // straddle two chunks, so keep the tail of the previous one.
    let mut tail: Vec<u8> = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        ttft.get_or_insert_with(|| started.elapsed());
        tail.extend_from_slice(&chunk);
        let keep_from = tail.len().saturating_sub(32);
        tail.drain(..keep_from);
    }
    let ok = status_ok && tail.windows(6).any(|w| w == b"[DONE]");
    let e2e = started.elapsed();
    Outcome {
        ok,
        ttft: ttft.unwrap_or(e2e).as_secs_f64() * speedup,
        e2e: e2e.as_secs_f64() * speedup,
        pod,
    }
}

async fn drive(url: &str, jobs: &[Job], speedup: f64) -> Vec<Outcome> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap_or_default();
    let url: Arc<str> = url.into();
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(jobs.len());
    for job in jobs {
        tokio::time::sleep_until(started + job.at.div_f64(speedup)).await;
        let (client, url, job) = (client.clone(), Arc::clone(&url), job.clone());
        tasks.push(tokio::spawn(async move {
            send(&client, &url, &job, speedup).await
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(task.await.unwrap_or_default());
    }
    outcomes
}

struct Summary {
    router: &'static str,
    ok: usize,
    errors: usize,
    ttft: [f64; 3],
    e2e_p90: f64,
    preemptions: f64,
    lora_loads: f64,
    prefix_hit_rate: f64,
    busiest_share: f64,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Fleet totals from each pod's /metrics: preemptions, prefix-cache hits and queries,
/// and adapter loads (the simulator's own `kvroute_sim:lora_loads_total`).
async fn fleet_counters(pods: &[SocketAddr]) -> (f64, f64, f64, f64) {
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap_or_default();
    let (mut preemptions, mut hits, mut queries, mut lora_loads) = (0.0, 0.0, 0.0, 0.0);
    for pod in pods {
        let Ok(response) = client.get(format!("http://{pod}/metrics")).send().await else {
            continue;
        };
        let Ok(text) = response.text().await else {
            continue;
        };
        if let Some(sample) = parse_pod(&text) {
            preemptions += sample.preemptions;
            hits += sample.prefix_hits;
            queries += sample.prefix_queries;
            lora_loads += sample.lora_loads_disk + sample.lora_loads_host;
        }
    }
    (preemptions, hits, queries, lora_loads)
}

fn fleet_config(args: &DemoArgs) -> FleetConfig {
    let mut pod = PodConfig::default();
    pod.engine.num_gpu_blocks = args.num_gpu_blocks;
    pod.engine.max_loras = args.max_loras;
    pod.engine.max_cpu_loras = args.max_loras;
    pod.lora_adapters = (0..args.adapters).map(|a| format!("lora-{a}")).collect();
    FleetConfig {
        speedup: args.speedup,
        seed: args.seed,
        ..FleetConfig::uniform(args.pods, pod)
    }
}

async fn run_one(
    args: &DemoArgs,
    router: &'static str,
    with_kvroute: bool,
    envoy: &std::path::Path,
) -> anyhow::Result<Summary> {
    let config = fleet_config(args);
    let jobs = workload(args, &config.model);
    let fleet = SimFleet::start(config).await?;
    let pods = fleet.endpoints();
    let mut kvroute_task = None;
    let gateway = if with_kvroute {
        let mut serve = ServeConfig::local(pods.clone());
        // Scrape at 50 ms of simulated time.
        serve.scrape.interval =
            Duration::from_secs_f64(0.05 / args.speedup).max(Duration::from_millis(10));
        let app = App::bind(serve).await?;
        let addr = app.addrs()?.grpc;
        let store = app.store();
        kvroute_task = Some(tokio::spawn(app.run(std::future::pending())));
        let scraped = wait_for_snapshot(&store, Duration::from_secs(10), |s| {
            s.pods.iter().all(|p| p.healthy && p.models.is_some())
        })
        .await;
        anyhow::ensure!(scraped, "kvroute did not scrape the simulated fleet");
        Gateway::OriginalDst { kvroute: addr }
    } else {
        Gateway::RoundRobin
    };
    let envoy = EnvoyProcess::start(gateway, &pods, envoy, "error").await?;
    eprintln!(
        "  {router}: {} requests through Envoy on port {}",
        jobs.len(),
        envoy.port
    );
    let outcomes = drive(&envoy.url("/v1/completions"), &jobs, args.speedup).await;
    let (preemptions, hits, queries, lora_loads) = fleet_counters(&pods).await;
    drop(envoy);
    if let Some(task) = kvroute_task {
        task.abort();
    }
    fleet.shutdown().await;

    let mut ttfts: Vec<f64> = outcomes.iter().filter(|o| o.ok).map(|o| o.ttft).collect();
    let mut e2es: Vec<f64> = outcomes.iter().filter(|o| o.ok).map(|o| o.e2e).collect();
    ttfts.sort_by(f64::total_cmp);
    e2es.sort_by(f64::total_cmp);
    let mut per_pod: BTreeMap<String, usize> = BTreeMap::new();
    for outcome in outcomes.iter().filter(|o| o.ok) {
        *per_pod
            .entry(outcome.pod.clone().unwrap_or_default())
            .or_default() += 1;
    }
    let ok = ttfts.len();
    Ok(Summary {
        router,
        ok,
        errors: outcomes.len() - ok,
        ttft: [
            percentile(&ttfts, 0.5),
            percentile(&ttfts, 0.9),
            percentile(&ttfts, 0.99),
        ],
        e2e_p90: percentile(&e2es, 0.9),
        preemptions,
        lora_loads,
        prefix_hit_rate: if queries > 0.0 { hits / queries } else { 0.0 },
        busiest_share: per_pod.values().max().copied().unwrap_or(0) as f64 / ok.max(1) as f64,
    })
}

/// Runs the demo and prints the comparison.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.pods > 0 && args.requests > 0,
        "--pods and --requests must be above zero"
    );
    anyhow::ensure!(
        args.rate > 0.0 && args.speedup > 0.0,
        "--rate and --speedup must be above zero"
    );
    let envoy = args.envoy.clone().unwrap_or_else(envoy_binary);
    eprintln!(
        "kvroute demo: {} simulated pods ({} KV blocks, {} adapter slots each), {} requests at {}/s over {} LoRA adapters",
        args.pods, args.num_gpu_blocks, args.max_loras, args.requests, args.rate, args.adapters
    );
    let kvroute = run_one(&args, "kvroute", true, &envoy)
        .await
        .context("kvroute run failed")?;
    let round_robin = run_one(&args, "envoy round robin", false, &envoy)
        .await
        .context("round-robin run failed")?;
    println!();
    println!(
        "| router | ok | errors | TTFT p50 s | TTFT p90 s | TTFT p99 s | e2e p90 s | LoRA loads | preemptions | prefix hit rate | busiest pod share |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for s in [&kvroute, &round_robin] {
        println!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0} | {:.0} | {:.2} | {:.2} |",
            s.router,
            s.ok,
            s.errors,
            s.ttft[0],
            s.ttft[1],
            s.ttft[2],
            s.e2e_p90,
            s.lora_loads,
            s.preemptions,
            s.prefix_hit_rate,
            s.busiest_share
        );
    }
    println!();
    println!(
        "TTFT p90, kvroute / round robin: {:.2}  (simulated seconds; same fleet, same seeded workload)",
        kvroute.ttft[1] / round_robin.ttft[1]
    );
    Ok(())
}
