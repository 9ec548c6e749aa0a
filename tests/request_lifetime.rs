//! How long a routed request counts against its pod, through a real Envoy running each
//! shipped gateway: from routing until the response has ended, whether it streams or
//! not, and whether or not Envoy sends the response body to kvroute.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::{
    FakePod, Gateway, Kvroute, behind_envoy, http_client, stream_to_first_event, test_config,
};

const MODEL: &str = "llama";

/// How long a request that is still being answered is watched for its accounting
/// to (wrongly) end. Envoy's early close, where it happens, lands within milliseconds
/// of the response headers.
const WATCH: Duration = Duration::from_millis(600);

fn inflight(kvroute: &Kvroute, pod: &FakePod) -> u32 {
    kvroute
        .store
        .fleet()
        .pod(pod.addr)
        .map_or(0, |(_, load)| load.inflight())
}

/// (prompt tokens still counted as queued prefill, KV tokens committed) on the pod.
fn ledger(kvroute: &Kvroute, pod: &FakePod) -> (u64, u64) {
    kvroute
        .store
        .fleet()
        .pod(pod.addr)
        .map_or((0, 0), |(_, load)| {
            (load.prefill_tokens(), load.committed_tokens())
        })
}

/// Asserts the pod keeps one request in flight for the whole [`WATCH`] window.
async fn assert_still_in_flight(kvroute: &Kvroute, pod: &FakePod, what: &str) {
    let until = Instant::now() + WATCH;
    while Instant::now() < until {
        assert_eq!(
            inflight(kvroute, pod),
            1,
            "{what}: request no longer counted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 5 s) for the pod's in-flight count to drop to 0.
async fn assert_released(kvroute: &Kvroute, pod: &FakePod, what: &str) {
    let started = Instant::now();
    while inflight(kvroute, pod) > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{what}: request still counted after its response ended"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn streamed_response_is_counted_until_it_ends(gateway: Gateway) {
    let pod = FakePod::start("pod-0", MODEL, &[]).await;
    let (kvroute, envoy) = behind_envoy(
        std::slice::from_ref(&pod),
        test_config(vec![pod.addr]),
        gateway,
    )
    .await;
    pod.hold_stream();
    let response = stream_to_first_event(&http_client(), &envoy, MODEL).await;
    assert_still_in_flight(&kvroute, &pod, &format!("{gateway:?}, mid-stream")).await;
    // The prompt is past prefill: at its first token where kvroute sees the response
    // body, else once a scrape started after the request has succeeded. The KV it will
    // need stays committed until the end either way.
    let started = Instant::now();
    while ledger(&kvroute, &pod).0 > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{gateway:?}: prefill still queued mid-stream"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(inflight(&kvroute, &pod), 1);
    assert!(
        ledger(&kvroute, &pod).1 >= 8,
        "output still to come is committed"
    );

    pod.release_stream();
    let rest = response.text().await.expect("rest of the stream");
    assert!(
        rest.ends_with("data: [DONE]\n\n"),
        "stream completed: {rest}"
    );
    assert_released(&kvroute, &pod, &format!("{gateway:?}, streamed")).await;
    assert_eq!(ledger(&kvroute, &pod), (0, 0), "nothing left counted");
}

async fn unstreamed_response_is_counted_until_it_ends(gateway: Gateway) {
    let pod = FakePod::start("pod-0", MODEL, &[]).await;
    let (kvroute, envoy) = behind_envoy(
        std::slice::from_ref(&pod),
        test_config(vec![pod.addr]),
        gateway,
    )
    .await;
    pod.hold();
    let mut arrivals = pod.subscribe_arrivals();
    let request = tokio::spawn(
        http_client()
            .post(envoy.url("/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 8}))
            .send(),
    );
    tokio::time::timeout(Duration::from_secs(10), arrivals.wait_for(|n| *n == 1))
        .await
        .expect("the request reaches the pod")
        .expect("pod alive");
    assert_still_in_flight(&kvroute, &pod, &format!("{gateway:?}, generating")).await;

    pod.release();
    let response = request.await.expect("task").expect("response");
    assert_eq!(response.status(), 200);
    response.text().await.expect("body");
    assert_released(&kvroute, &pod, &format!("{gateway:?}, unstreamed")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_gateway_counts_a_streamed_response_until_it_ends() {
    streamed_response_is_counted_until_it_ends(Gateway::OriginalDst).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_gateway_counts_a_streamed_response_until_it_ends() {
    streamed_response_is_counted_until_it_ends(Gateway::OverrideHost).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_gateway_counts_an_unstreamed_response_until_it_ends() {
    unstreamed_response_is_counted_until_it_ends(Gateway::OriginalDst).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_gateway_counts_an_unstreamed_response_until_it_ends() {
    unstreamed_response_is_counted_until_it_ends(Gateway::OverrideHost).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_fail_open_gateway_walks_the_fallbacks_the_request_counts_where_it_is_served() {
    let picked = FakePod::start("pod-0", MODEL, &[]).await;
    let served = FakePod::start("pod-1", MODEL, &[]).await;
    // pod-0 looks best (empty KV), then stops listening before the request: the gateway
    // fails to connect and retries the next endpoint kvroute listed.
    picked.set_metrics(support::FakeMetrics {
        kv_usage: 0.0,
        ..support::FakeMetrics::default()
    });
    served.set_metrics(support::FakeMetrics {
        kv_usage: 0.5,
        ..support::FakeMetrics::default()
    });
    let pods = [picked, served];
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.scheduler.fallbacks = 1;
    // No scrape after the first: kvroute keeps believing pod-0 is up.
    config.scrape.interval = Duration::from_secs(3600);
    config.scheduler.max_metrics_age = Duration::from_secs(3600);
    let (kvroute, envoy) = behind_envoy(&pods, config, Gateway::OverrideHost).await;
    let [mut picked, served] = pods;
    picked.stop();
    served.hold_stream();
    let mut response = http_client()
        .post(envoy.url("/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": true}))
        .send()
        .await
        .expect("request through Envoy");
    assert_eq!(response.status(), 200);
    assert_eq!(served.arrivals(), 1, "the retry reached pod-1");
    assert!(
        response
            .headers()
            .get("x-gateway-destination-endpoint-served")
            .is_none(),
        "kvroute strips its own signal"
    );
    response
        .chunk()
        .await
        .expect("first event")
        .expect("a chunk");
    // Mid-stream: the request counts on the pod that serves it, not on the pick.
    assert_eq!(inflight(&kvroute, &picked), 0, "released from the pick");
    assert_still_in_flight(&kvroute, &served, "served pod, mid-stream").await;
    served.release_stream();
    response.text().await.expect("rest of the stream");
    assert_released(&kvroute, &served, "served pod").await;
}
