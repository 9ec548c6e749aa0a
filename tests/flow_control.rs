//! Flow control end to end through a real Envoy: a request no pod has room for waits at
//! the gateway (past Envoy's 2 s `message_timeout`, which kvroute extends), goes when a
//! pod frees, leaves the queue when its client does, gets 429 with the reason when its
//! wait runs out, and waiting requests leave by priority.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{FakeMetrics, FakePod, Gateway, Kvroute, behind_envoy, http_client, test_config};

const MODEL: &str = "llama";

/// 97 % of the fake pod's 16,000-token pool in use: 480 tokens free, less than
/// [`needing_kv`] asks for.
fn full() -> FakeMetrics {
    FakeMetrics {
        kv_usage: 0.97,
        ..FakeMetrics::default()
    }
}

/// A completion that needs about 1,000 tokens of KV: it fits an empty pod, not a full one.
fn needing_kv() -> serde_json::Value {
    json!({"model": MODEL, "prompt": "hello", "max_tokens": 1_000})
}

fn empty() -> FakeMetrics {
    FakeMetrics {
        kv_usage: 0.0,
        ..FakeMetrics::default()
    }
}

/// Waits until kvroute's exposition shows `waiting` requests queued at `priority`.
async fn wait_for_queue(kvroute: &Kvroute, priority: i32, waiting: usize) {
    let line = format!("kvroute_flow_queue_requests{{priority=\"{priority}\"}} {waiting}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = kvroute.metrics_text().await;
        if text.lines().any(|l| l == line) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for `{line}`:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A completion of 12,000 tokens of KV (the fake pods hold 16,000): one at a time fits.
fn large_request() -> serde_json::Value {
    json!({"model": MODEL, "prompt": "hello", "max_tokens": 12_000})
}

/// Sends `body` with `headers` through `envoy`; the status, the serving pod, the
/// dropped-reason and retry-after headers, and the body.
async fn send(
    client: &reqwest::Client,
    envoy: &support::Envoy,
    body: serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, HashMap<&'static str, String>, String) {
    let mut request = client.post(envoy.url("/v1/completions")).json(&body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("request through Envoy");
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let pod = header("x-pod");
    let mut seen = HashMap::new();
    for name in ["x-llm-d-request-dropped-reason", "retry-after"] {
        if let Some(value) = header(name) {
            seen.insert(name, value);
        }
    }
    let text = response.text().await.expect("body");
    (status, pod, seen, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_held_while_every_pod_is_full_goes_once_one_frees_even_past_envoys_message_timeout()
 {
    let pods = vec![FakePod::start("pod-0", MODEL, &[]).await];
    pods[0].set_metrics(full());
    let config = test_config(vec![pods[0].addr]);
    let (kvroute, envoy) = behind_envoy(&pods, config, Gateway::OriginalDst).await;
    let client = http_client();
    let started = Instant::now();
    let request = {
        let (client, url) = (client.clone(), envoy.url("/v1/completions"));
        tokio::spawn(async move {
            let response = client
                .post(url)
                .json(&needing_kv())
                .send()
                .await
                .expect("request through Envoy");
            let timing = response
                .headers()
                .get("server-timing")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            (
                response.status().as_u16(),
                timing,
                response.text().await.expect("body"),
            )
        })
    };
    wait_for_queue(&kvroute, 0, 1).await;
    // Longer than the gateway's 2 s message_timeout: without kvroute's extension Envoy
    // would have given up on the answer and failed the request over by now.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(pods[0].arrivals(), 0, "nothing reached the full pod");
    pods[0].set_metrics(empty());
    let (status, timing, body) = request.await.expect("request task");
    assert_eq!(status, 200, "{body}\n{}", envoy.log());
    // The client is told how long its request waited at the gateway.
    let waited_ms: f64 = timing
        .as_deref()
        .and_then(|t| t.strip_prefix("kvroute-queue;dur="))
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("server-timing: {timing:?}"));
    assert!(waited_ms >= 2_500.0, "waited {waited_ms} ms");
    assert!(started.elapsed() >= Duration::from_millis(2_500));
    assert_eq!(pods[0].arrivals(), 1);
    wait_for_queue(&kvroute, 0, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_runs_out_is_answered_429_with_the_reason_header_and_an_openai_error() {
    let pods = vec![FakePod::start("pod-0", MODEL, &[]).await];
    pods[0].set_metrics(full());
    let mut config = test_config(vec![pods[0].addr]);
    config.flow.max_wait = Duration::from_millis(500);
    let (_kvroute, envoy) = behind_envoy(&pods, config, Gateway::OverrideHost).await;
    let (status, _, headers, body) = send(&http_client(), &envoy, needing_kv(), &[]).await;
    assert_eq!(status, 429, "{body}\n{}", envoy.log());
    assert_eq!(
        headers
            .get("x-llm-d-request-dropped-reason")
            .map(String::as_str),
        Some("rejected-ttl-expired")
    );
    assert_eq!(headers.get("retry-after").map(String::as_str), Some("1"));
    let error: serde_json::Value = serde_json::from_str(&body).expect("JSON error");
    assert_eq!(error["error"]["code"], "queue_wait_exceeded");
    assert_eq!(pods[0].arrivals(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sheddable_request_is_refused_at_once_with_429_when_no_pod_has_room() {
    let pods = vec![FakePod::start("pod-0", MODEL, &[]).await];
    pods[0].set_metrics(full());
    let mut config = test_config(vec![pods[0].addr]);
    config.flow.objectives = HashMap::from([("batch".to_owned(), -10)]);
    let (_kvroute, envoy) = behind_envoy(&pods, config, Gateway::OriginalDst).await;
    let started = Instant::now();
    let (status, _, headers, body) = send(
        &http_client(),
        &envoy,
        json!({"model": MODEL, "prompt": "hello", "max_tokens": 16}),
        &[("x-gateway-inference-objective", "batch")],
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(
        headers
            .get("x-llm-d-request-dropped-reason")
            .map(String::as_str),
        Some("rejected-saturated")
    );
    assert!(started.elapsed() < Duration::from_secs(2), "not queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_while_queued_leaves_the_queue() {
    let pods = vec![FakePod::start("pod-0", MODEL, &[]).await];
    pods[0].set_metrics(full());
    let mut config = test_config(vec![pods[0].addr]);
    config.flow.max_wait = Duration::from_secs(60);
    let (kvroute, envoy) = behind_envoy(&pods, config, Gateway::OriginalDst).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("client");
    let gave_up = impatient
        .post(envoy.url("/v1/completions"))
        .json(&needing_kv())
        .send()
        .await;
    assert!(
        gave_up.is_err(),
        "the client gave up while its request waited"
    );
    // Long before the 60 s wait bound: the request left with its client.
    wait_for_queue(&kvroute, 0, 0).await;
    pods[0].set_metrics(empty());
    kvroute.wait_for_pod(pods[0].addr, 0.0, 0).await;
    assert_eq!(
        pods[0].arrivals(),
        0,
        "the request that left was never sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_leave_by_priority_whatever_their_arrival() {
    let pods = vec![FakePod::start("pod-0", MODEL, &[]).await];
    pods[0].set_metrics(full());
    let mut config = test_config(vec![pods[0].addr]);
    config.flow.objectives = HashMap::from([("critical".to_owned(), 10)]);
    let (kvroute, envoy) = behind_envoy(&pods, config, Gateway::OriginalDst).await;
    let client = http_client();
    let spawn = |objective: &'static str| {
        let (client, url) = (client.clone(), envoy.url("/v1/completions"));
        tokio::spawn(async move {
            let response = client
                .post(url)
                .header("x-gateway-inference-objective", objective)
                .json(&large_request())
                .send()
                .await
                .expect("request through Envoy");
            response.status().as_u16()
        })
    };
    let standard = spawn("standard");
    wait_for_queue(&kvroute, 0, 1).await;
    let critical = spawn("critical");
    wait_for_queue(&kvroute, 10, 1).await;
    // Room for one of them: the later, higher-priority one must take it.
    pods[0].hold();
    let mut arrivals = pods[0].subscribe_arrivals();
    pods[0].set_metrics(empty());
    tokio::time::timeout(Duration::from_secs(10), arrivals.wait_for(|n| *n >= 1))
        .await
        .expect("one request reached the pod")
        .expect("arrivals");
    let first = pods[0]
        .last_headers()
        .expect("headers of the first arrival");
    assert_eq!(
        first
            .get("x-gateway-inference-objective")
            .and_then(|v| v.to_str().ok()),
        Some("critical")
    );
    wait_for_queue(&kvroute, 0, 1).await;
    pods[0].release();
    assert_eq!(critical.await.expect("task"), 200);
    assert_eq!(standard.await.expect("task"), 200);
    assert_eq!(pods[0].arrivals(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_ready_pod_a_request_waits_for_one_to_come_up_instead_of_a_503() {
    let pods = [FakePod::start("pod-0", MODEL, &[]).await];
    // The pod's engine is down: /metrics fails, so the pod is not ready.
    pods[0].override_metrics(Some((500, "engine starting")));
    let kvroute = Kvroute::start(test_config(vec![pods[0].addr])).await;
    kvroute
        .wait_for("the pod listed, not ready", |s| {
            s.pods().iter().all(|p| !p.healthy && p.models.is_some())
        })
        .await;
    let envoy =
        support::Envoy::start(Gateway::OriginalDst, kvroute.addrs.grpc, &[pods[0].addr]).await;
    let request = {
        let (client, url) = (http_client(), envoy.url("/v1/completions"));
        tokio::spawn(async move {
            let response = client
                .post(url)
                .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 8}))
                .send()
                .await
                .expect("request through Envoy");
            (
                response.status().as_u16(),
                response.text().await.expect("body"),
            )
        })
    };
    wait_for_queue(&kvroute, 0, 1).await;
    // The engine comes up: scraped well twice, the pod is ready, and the request goes.
    pods[0].override_metrics(None);
    let (status, body) = request.await.expect("request task");
    assert_eq!(status, 200, "{body}\n{}", envoy.log());
    assert_eq!(pods[0].arrivals(), 1);
}
