//! The peer routers (sglang-router, vllm-router) in front of a simulated fleet: the
//! simulator answers everything they ask of a worker. They come from PyPI into the
//! project's `.venv` (`scripts/setup`); `KVROUTE_PEER_PYTHON` names another Python.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_core::vllm::parse_vllm_metrics;
use kvroute_sim::{FleetConfig, PodConfig, SimFleet};
use serde_json::{Value, json};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn free_port() -> u16 {
    kvroute_lab::envoy::free_port().expect("free port")
}

struct Router(Child);

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn with_router(module: &str, policy: &str) {
    let fleet = SimFleet::start(FleetConfig {
        speedup: 10.0,
        ..FleetConfig::uniform(2, PodConfig::default())
    })
    .await
    .expect("fleet");
    let urls: Vec<String> = fleet
        .endpoints()
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    let (port, prom) = (free_port(), free_port());
    let python = std::env::var("KVROUTE_PEER_PYTHON").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../.venv/bin/python").to_owned()
    });
    let mut cmd = Command::new(python);
    cmd.args(["-m", module, "--worker-urls"])
        .args(&urls)
        .args(["--policy", policy, "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .args(["--prometheus-port", &prom.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _router = Router(cmd.spawn().expect("router starts"));
    let c = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ok = c
            .get(format!("{base}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "{module} did not become healthy");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let shared = "You are a helpful assistant who answers briefly. ".repeat(20);
    for i in 0..8 {
        let body = json!({"model": MODEL, "prompt": format!("{shared} question {i}"),
                          "max_tokens": 5, "stream": i % 2 == 0});
        let res = c
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .expect("routed request");
        assert_eq!(res.status(), 200, "{module} {policy}");
        let text = res.text().await.expect("body");
        if i % 2 == 0 {
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        } else {
            let v: Value = serde_json::from_str(&text).expect("json");
            assert_eq!(v["usage"]["completion_tokens"], 5);
        }
        let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": format!("hi {i}")}],
                          "max_tokens": 3});
        let res = c
            .post(format!("{base}/v1/chat/completions"))
            .json(&chat)
            .send()
            .await
            .expect("routed chat");
        assert_eq!(res.status(), 200, "{module} {policy} chat");
    }
    let mut served = 0.0;
    for addr in fleet.endpoints() {
        let text = c
            .get(format!("http://{addr}/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        let m = parse_vllm_metrics(&text).expect("parse");
        served += m.prefix_cache_queries_total.unwrap_or(0.0);
    }
    assert!(served > 0.0);
    fleet.shutdown().await;
}

#[tokio::test]
async fn sglang_router_serves_through_the_simulated_fleet() {
    with_router("sglang_router.launch_router", "cache_aware").await;
    with_router("sglang_router.launch_router", "power_of_two").await;
}

#[tokio::test]
async fn vllm_router_serves_through_the_simulated_fleet() {
    with_router("vllm_router.launch_router", "cache_aware").await;
    with_router("vllm_router.launch_router", "power_of_two").await;
}
