//! The simulator's engine behaviours, observed through each pod's HTTP API only
//! (`usage`, `x-sim-*` timing headers, `/metrics` read with kvroute's own parser).

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute_core::fleet::PodMetrics;
use kvroute_core::vllm::parse_vllm_metrics;
use kvroute_sim::profile::{Profile, StepShape};
use kvroute_sim::{FleetConfig, PodConfig, SimFleet};
use serde_json::{Value, json};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn pod() -> PodConfig {
    PodConfig::default()
}

async fn start(pods: Vec<PodConfig>, speedup: f64) -> SimFleet {
    let config = FleetConfig {
        speedup,
        seed: 1,
        pods,
        ..FleetConfig::default()
    };
    SimFleet::start(config).await.expect("fleet starts")
}

/// `n` words of exactly one token each (` abc`), different for each `tag`.
fn prompt(tag: u64, n: usize) -> String {
    let mut s = String::with_capacity(n * 4);
    let mut x = tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1234_5678;
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push(' ');
        for k in 0..3 {
            s.push((b'a' + ((x >> (k * 5)) % 26) as u8) as char);
        }
    }
    s
}

struct Timing {
    body: Value,
    arrival_ms: f64,
    queue_ms: f64,
    ttft_ms: f64,
    e2e_ms: f64,
    preemptions: u32,
}

fn header_f64(res: &reqwest::Response, name: &str) -> f64 {
    res.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("header {name}"))
}

async fn complete(c: &reqwest::Client, addr: SocketAddr, body: Value) -> Timing {
    let res = c
        .post(format!("http://{addr}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("request");
    assert_eq!(res.status(), 200);
    let t = Timing {
        body: Value::Null,
        arrival_ms: header_f64(&res, "x-sim-arrival-ms"),
        queue_ms: header_f64(&res, "x-sim-queue-ms"),
        ttft_ms: header_f64(&res, "x-sim-ttft-ms"),
        e2e_ms: header_f64(&res, "x-sim-e2e-ms"),
        preemptions: header_f64(&res, "x-sim-preemptions") as u32,
    };
    Timing {
        body: res.json().await.expect("json"),
        ..t
    }
}

async fn metrics(c: &reqwest::Client, addr: SocketAddr) -> PodMetrics {
    let text = c
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    parse_vllm_metrics(&text).expect("kvroute parses the simulator's /metrics")
}

/// The usage's cached tokens; vLLM leaves `prompt_tokens_details` out when none were.
fn cached(t: &Timing) -> u64 {
    let usage = &t.body["usage"];
    assert!(usage["prompt_tokens"].is_u64(), "a usage object: {usage}");
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test]
async fn a_repeated_long_prompt_hits_the_prefix_cache_and_gets_a_lower_ttft() {
    let fleet = start(vec![pod()], 20.0).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let body = json!({"model": MODEL, "prompt": prompt(1, 4000), "max_tokens": 4});
    let first = complete(&c, addr, body.clone()).await;
    let second = complete(&c, addr, body).await;
    assert_eq!(cached(&first), 0);
    assert_eq!(
        cached(&second),
        3984,
        "every full block but the last token's"
    );
    assert!(
        second.ttft_ms * 4.0 < first.ttft_ms,
        "{} vs {}",
        second.ttft_ms,
        first.ttft_ms
    );

    let m = metrics(&c, addr).await;
    assert_eq!(m.prefix_cache_hits_total, Some(3984.0));
    fleet.shutdown().await;

    // The same, seen by a streaming client on the wall clock (speedup 2: ~150 ms vs ~5 ms).
    let fleet = start(vec![pod()], 2.0).await;
    let addr = fleet.endpoints()[0];
    let stream_ttft = |p: String| {
        let c = c.clone();
        async move {
            let started = Instant::now();
            let res = c
                .post(format!("http://{addr}/v1/completions"))
                .json(&json!({"model": MODEL, "prompt": p, "max_tokens": 2, "stream": true}))
                .send()
                .await
                .expect("request");
            let mut res = res;
            res.chunk().await.expect("bytes").expect("first chunk");
            let ttft = started.elapsed();
            while res.chunk().await.expect("bytes").is_some() {}
            ttft
        }
    };
    let cold = stream_ttft(prompt(2, 8000)).await;
    let warm = stream_ttft(prompt(2, 8000)).await;
    assert!(warm * 3 < cold, "{warm:?} vs {cold:?}");
    let m = metrics(&c, addr).await;
    assert_eq!(m.prefix_cache_hits_total, Some(7984.0));
    fleet.shutdown().await;
}

#[tokio::test]
async fn filling_the_kv_pool_drives_usage_toward_one_then_preempts() {
    let mut p = pod();
    p.engine.num_gpu_blocks = 64; // 1,024 tokens
    let fleet = start(vec![p], 10.0).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    // 8 requests of 96 + 150 tokens: 16 blocks each at the end, 128 in all.
    let requests = futures::future::join_all((0..8).map(|i| {
        let c = c.clone();
        async move {
            let body = json!({"model": MODEL, "prompt": prompt(100 + i, 96), "max_tokens": 150});
            complete(&c, addr, body).await
        }
    }));
    let observer = async {
        let mut max_usage: f64 = 0.0;
        for _ in 0..2000 {
            let m = metrics(&c, addr).await;
            max_usage = max_usage.max(m.kv_usage);
            if m.running == 0 && m.waiting == 0 && max_usage > 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        max_usage
    };
    let (results, max_usage) = tokio::join!(requests, observer);
    assert!(max_usage > 0.9, "peak usage {max_usage}");
    let m = metrics(&c, addr).await;
    assert!(m.preemptions_total.unwrap_or(0.0) > 0.0, "{m:?}");
    assert!(results.iter().any(|t| t.preemptions > 0));
    for t in &results {
        assert_eq!(t.body["usage"]["completion_tokens"], 150);
    }
    assert!(m.kv_usage < 1e-9, "everything freed at the end");
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_request_for_an_adapter_not_in_a_slot_waits_for_the_load() {
    let mut p = pod();
    p.lora_adapters = vec!["sql".into(), "chat".into()];
    p.engine.max_loras = 2;
    p.engine.lora_load = Duration::from_millis(300);
    let fleet = start(vec![p], 1.0).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let started = Instant::now();
    let res = c
        .post(format!("http://{addr}/v1/completions"))
        .json(&json!({"model": "sql", "prompt": prompt(3, 50), "max_tokens": 3, "stream": true}))
        .send()
        .await
        .expect("request");
    // The request is queued once the headers are back; the load takes 300 ms.
    let m = metrics(&c, addr).await;
    let lora = m.lora.expect("lora info");
    assert_eq!(lora.waiting, vec!["sql".to_string()]);
    assert!(lora.running.is_empty());
    assert_eq!(lora.max_lora, 2);
    assert_eq!(m.waiting, 1);
    let mut res = res;
    res.chunk().await.expect("bytes").expect("first chunk");
    let ttft = started.elapsed();
    assert!(ttft >= Duration::from_millis(300), "{ttft:?}");
    while res.chunk().await.expect("bytes").is_some() {}
    // Now loaded: the next request for it starts at once.
    let warm = complete(
        &c,
        addr,
        json!({"model": "sql", "prompt": prompt(4, 50), "max_tokens": 1}),
    )
    .await;
    assert!(warm.ttft_ms < 30.0, "{}", warm.ttft_ms);
    fleet.shutdown().await;
}

#[tokio::test]
async fn with_max_loras_two_three_adapters_never_run_in_one_batch() {
    let mut p = pod();
    p.lora_adapters = vec!["a".into(), "b".into(), "c".into()];
    p.engine.max_loras = 2;
    p.engine.lora_load = Duration::from_millis(50);
    let fleet = start(vec![p], 10.0).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let requests =
        futures::future::join_all(["a", "b", "c"].into_iter().enumerate().map(|(i, name)| {
            let c = c.clone();
            async move {
                let body =
                    json!({"model": name, "prompt": prompt(10 + i as u64, 64), "max_tokens": 100});
                complete(&c, addr, body).await
            }
        }));
    let observer = async {
        let (mut most_running, mut saw_waiting) = (0, false);
        for _ in 0..2000 {
            let m = metrics(&c, addr).await;
            let lora = m.lora.expect("lora info");
            most_running = most_running.max(lora.running.len());
            saw_waiting |= !lora.waiting.is_empty() && lora.running.len() == 2;
            if m.running == 0 && m.waiting == 0 && most_running > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        (most_running, saw_waiting)
    };
    let (results, (most_running, saw_waiting)) = tokio::join!(requests, observer);
    assert_eq!(most_running, 2);
    assert!(saw_waiting, "a third adapter waited while two ran");
    // Whichever adapter got its first token last started after another one finished.
    let mut by_first_token: Vec<&Timing> = results.iter().collect();
    by_first_token
        .sort_by(|x, y| (x.arrival_ms + x.ttft_ms).total_cmp(&(y.arrival_ms + y.ttft_ms)));
    let last = by_first_token[2];
    let earliest_end = by_first_token[..2]
        .iter()
        .map(|t| t.arrival_ms + t.e2e_ms)
        .fold(f64::MAX, f64::min);
    assert!(
        last.arrival_ms + last.ttft_ms >= earliest_end + 50.0,
        "third adapter started at {} before a slot freed at {earliest_end} + load",
        last.arrival_ms + last.ttft_ms
    );
    assert!(last.queue_ms >= 50.0);
    fleet.shutdown().await;
}

#[tokio::test]
async fn ttft_grows_with_prompt_length_as_the_profile_says() {
    let p = pod();
    let profile = p.profile.clone();
    let fleet = start(vec![p], 50.0).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let mut ttfts = Vec::new();
    for (i, n) in [500u64, 2000, 8000].into_iter().enumerate() {
        let body =
            json!({"model": MODEL, "prompt": prompt(200 + i as u64, n as usize), "max_tokens": 1});
        let t = complete(&c, addr, body).await;
        let predicted = profile
            .step_time(&StepShape {
                new_tokens: n,
                kv_tokens_read: n,
                attention_pairs: n as f64 * (n as f64 + 1.0) / 2.0,
            })
            .as_secs_f64()
            * 1e3;
        let ratio = t.ttft_ms / predicted;
        assert!(
            (0.85..1.15).contains(&ratio),
            "{n} tokens: {} ms vs {predicted} ms",
            t.ttft_ms
        );
        ttfts.push(t.ttft_ms);
    }
    assert!(ttfts[0] < ttfts[1] && ttfts[1] < ttfts[2], "{ttfts:?}");
    fleet.shutdown().await;
}

#[tokio::test]
async fn itl_grows_with_batch_size_as_the_profile_says() {
    let fleet = start(vec![pod()], 20.0).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let itl = |t: &Timing, n: f64| (t.e2e_ms - t.ttft_ms) / (n - 1.0);
    let alone = complete(
        &c,
        addr,
        json!({"model": MODEL, "prompt": prompt(300, 1000), "max_tokens": 64}),
    )
    .await;
    let single = itl(&alone, 64.0);
    let profile = Profile::by_name("h100-llama3-8b").expect("profile");
    let decode = |batch: u64, ctx: u64| {
        profile
            .step_time(&StepShape {
                new_tokens: batch,
                kv_tokens_read: batch * ctx,
                attention_pairs: (batch * ctx) as f64,
            })
            .as_secs_f64()
            * 1e3
    };
    let expected_single = decode(1, 1032);
    assert!(
        (single / expected_single - 1.0).abs() < 0.1,
        "{single} vs {expected_single}"
    );
    let batch = futures::future::join_all((0..48).map(|i| {
        let c = c.clone();
        async move {
            let body = json!({"model": MODEL, "prompt": prompt(400 + i, 2000), "max_tokens": 64});
            complete(&c, addr, body).await
        }
    }))
    .await;
    let mean: f64 = batch.iter().map(|t| itl(t, 64.0)).sum::<f64>() / batch.len() as f64;
    assert!(
        mean > 1.4 * single && mean >= 0.9 * decode(48, 2032),
        "batch ITL {mean} ms vs single {single} ms"
    );
    fleet.shutdown().await;
}
