//! End to end through a real Envoy: client → Envoy (ext_proc) → kvroute → Envoy →
//! fake vLLM pod. Each test builds its own fleet, kvroute and Envoy on loopback.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;
use support::{FakeMetrics, FakePod, Gateway, behind_envoy, complete, http_client, test_config};

const MODEL: &str = "llama";

async fn fleet(n: usize, adapters: &[&str]) -> Vec<FakePod> {
    let mut pods = Vec::new();
    for i in 0..n {
        pods.push(FakePod::start(&format!("pod-{i}"), MODEL, adapters).await);
    }
    pods
}

fn addrs(pods: &[FakePod]) -> Vec<std::net::SocketAddr> {
    pods.iter().map(|p| p.addr).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_near_full_pod_is_avoided() {
    let pods = fleet(2, &[]).await;
    pods[0].set_metrics(FakeMetrics {
        kv_usage: 0.97,
        ..FakeMetrics::default()
    });
    pods[1].set_metrics(FakeMetrics {
        kv_usage: 0.3,
        ..FakeMetrics::default()
    });
    let (_kvroute, envoy) =
        behind_envoy(&pods, test_config(addrs(&pods)), Gateway::OriginalDst).await;
    let client = http_client();
    for _ in 0..10 {
        let (status, pod, body) = complete(
            &client,
            &envoy,
            json!({"model": MODEL, "prompt": "hello", "max_tokens": 16}),
        )
        .await;
        assert_eq!(status, 200, "{body}\n{}", envoy.log());
        assert_eq!(pod.as_deref(), Some("pod-1"));
    }
    assert_eq!(pods[0].arrivals(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_prompt_goes_where_it_fits_even_if_another_pod_has_a_shorter_queue() {
    let pods = fleet(2, &[]).await;
    // 16,000-token pools. pod-0: empty queue, 3,360 tokens free. pod-1: queue of 3,
    // 11,200 free.
    pods[0].set_metrics(FakeMetrics {
        kv_usage: 0.79,
        ..FakeMetrics::default()
    });
    pods[1].set_metrics(FakeMetrics {
        kv_usage: 0.3,
        waiting: 3,
        ..FakeMetrics::default()
    });
    let (kvroute, envoy) =
        behind_envoy(&pods, test_config(addrs(&pods)), Gateway::OriginalDst).await;
    let client = http_client();

    // ~8,000 tokens at 4 bytes per token: fits only on pod-1.
    let large = "lorem ipsum ".repeat(2_700);
    let (status, pod, body) = complete(
        &client,
        &envoy,
        json!({"model": MODEL, "prompt": large, "max_tokens": 64}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(pod.as_deref(), Some("pod-1"));
    let answer: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert!(
        answer["prompt_bytes"].as_u64().is_some_and(|n| n > 32_000),
        "the whole body reached the pod"
    );

    // The fake pod's report never held the large request's blocks, yet kvroute reads it
    // less what that request freed at its end, if a scrape saw the request, until a scrape
    // started after the end (as a real pod's report would show them gone): wait for a
    // report of pod-1 taken after the end, so that pod-1 is read as it reports itself.
    // The first new value may come from a scrape sent before the end and answered after
    // it; a pod is scraped one request at a time, so the second comes from a scrape sent
    // after the first was answered, after the end.
    for kv_usage in [0.31, 0.32] {
        pods[1].set_metrics(FakeMetrics {
            kv_usage,
            waiting: 3,
            ..FakeMetrics::default()
        });
        kvroute.wait_for_pod(pods[1].addr, kv_usage, 3).await;
    }

    // A small prompt fits both, and pod-0's empty queue wins.
    let (_, pod, _) = complete(
        &client,
        &envoy,
        json!({"model": MODEL, "prompt": "hi", "max_tokens": 16}),
    )
    .await;
    assert_eq!(pod.as_deref(), Some("pod-0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_holding_pod_is_preferred_until_it_saturates() {
    let pods = fleet(3, &["sql-lora", "chat-lora"]).await;
    let holding = FakeMetrics {
        running: 2,
        kv_usage: 0.4,
        running_adapters: vec!["sql-lora".into()],
        ..FakeMetrics::default()
    };
    pods[1].set_metrics(holding.clone());
    let (kvroute, envoy) =
        behind_envoy(&pods, test_config(addrs(&pods)), Gateway::OriginalDst).await;
    let client = http_client();
    for _ in 0..5 {
        let (status, pod, body) = complete(
            &client,
            &envoy,
            json!({"model": "sql-lora", "prompt": "select", "max_tokens": 16}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(pod.as_deref(), Some("pod-1"));
    }

    // The holder saturates (queue of 8): the next requests go to free pods.
    pods[1].set_metrics(FakeMetrics {
        waiting: 8,
        ..holding
    });
    kvroute.wait_for_pod(pods[1].addr, 0.4, 8).await;
    for _ in 0..5 {
        let (status, pod, _) = complete(
            &client,
            &envoy,
            json!({"model": "sql-lora", "prompt": "select", "max_tokens": 16}),
        )
        .await;
        assert_eq!(status, 200);
        assert_ne!(pod.as_deref(), Some("pod-1"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_between_two_scrapes_spreads_instead_of_herding() {
    let pods = fleet(4, &[]).await;
    for pod in &pods {
        pod.hold();
    }
    let mut config = test_config(addrs(&pods));
    // One scrape at start, then none during the test: only kvroute's own in-flight
    // accounting can tell the pods apart.
    config.scrape.interval = Duration::from_secs(3600);
    config.scheduler.max_metrics_age = Duration::from_secs(3600);
    let (_kvroute, envoy) = behind_envoy(&pods, config, Gateway::OriginalDst).await;
    let client = http_client();

    let burst: Vec<_> = (0..8)
        .map(|i| {
            let client = client.clone();
            let url = envoy.url("/v1/completions");
            tokio::spawn(async move {
                client
                    .post(url)
                    .json(&json!({"model": MODEL, "prompt": format!("request {i}"), "max_tokens": 32}))
                    .send()
                    .await
            })
        })
        .collect();
    let mut arrivals: Vec<_> = pods.iter().map(FakePod::subscribe_arrivals).collect();
    let all_arrived = async {
        loop {
            let total: usize = arrivals.iter_mut().map(|a| *a.borrow_and_update()).sum();
            if total >= 8 {
                return;
            }
            let changes = arrivals.iter_mut().map(|a| Box::pin(a.changed()));
            let _ = futures::future::select_all(changes).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), all_arrived)
        .await
        .expect("all 8 requests reach a pod");
    let per_pod: Vec<usize> = pods.iter().map(FakePod::arrivals).collect();
    for pod in &pods {
        pod.release();
    }
    for request in burst {
        let response = request.await.expect("task").expect("response");
        assert_eq!(response.status(), 200);
    }
    assert_eq!(per_pod, vec![2, 2, 2, 2], "8 requests over 4 idle pods");
}

/// The shipped gateways start and serve without a warning (Envoy warns, for one, when
/// nothing bounds its client connections).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_gateways_start_and_serve_without_warnings() {
    let pods = fleet(1, &[]).await;
    let client = http_client();
    for gateway in [Gateway::OriginalDst, Gateway::OverrideHost] {
        let (_kvroute, envoy) = behind_envoy(&pods, test_config(addrs(&pods)), gateway).await;
        let (status, _, body) =
            complete(&client, &envoy, json!({"model": MODEL, "prompt": "hi"})).await;
        assert_eq!(status, 200, "{body}");
        let log = envoy.log();
        let warnings: Vec<&str> = log
            .lines()
            .filter(|line| line.contains("][warning][") || line.contains("][error]["))
            .collect();
        assert!(warnings.is_empty(), "{gateway:?}: {warnings:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_style_errors_through_envoy() {
    let pods = fleet(1, &[]).await;
    let (_kvroute, envoy) =
        behind_envoy(&pods, test_config(addrs(&pods)), Gateway::OriginalDst).await;
    let client = http_client();

    let response = client
        .post(envoy.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(r#"{"model": "llama", "prompt": "#)
        .send()
        .await
        .expect("response");
    assert_eq!(response.status(), 400);
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/json")
    );
    let error: serde_json::Value = response.json().await.expect("json error");
    assert_eq!(error["error"]["type"], "invalid_request_error");

    let (status, _, body) = complete(&client, &envoy, json!({"prompt": "no model"})).await;
    assert_eq!(status, 400, "{body}");

    let (status, _, body) = complete(
        &client,
        &envoy,
        json!({"model": "gpt-unknown", "prompt": "hi"}),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).expect("json error");
    assert_eq!(error["error"]["code"], "model_not_found");
    assert_eq!(pods[0].arrivals(), 0, "no bad request reached a pod");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sent_destination_header_is_ignored() {
    let pods = fleet(2, &[]).await;
    pods[0].set_metrics(FakeMetrics {
        kv_usage: 0.97,
        ..FakeMetrics::default()
    });
    let (_kvroute, envoy) =
        behind_envoy(&pods, test_config(addrs(&pods)), Gateway::OriginalDst).await;
    let client = http_client();
    let response = client
        .post(envoy.url("/v1/completions"))
        .header("x-gateway-destination-endpoint", pods[0].addr.to_string())
        .json(&json!({"model": MODEL, "prompt": "aim at pod-0"}))
        .send()
        .await
        .expect("response");
    assert_eq!(response.status(), 200);
    assert_eq!(
        response
            .headers()
            .get("x-pod")
            .and_then(|v| v.to_str().ok()),
        Some("pod-1")
    );
    let seen = pods[1].last_headers().expect("pod-1 got the request");
    let destination = seen
        .get("x-gateway-destination-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        destination.starts_with(&pods[1].addr.to_string()),
        "{destination}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_models_listings_and_large_bodies_pass_through() {
    let pods = fleet(2, &[]).await;
    let (_kvroute, envoy) =
        behind_envoy(&pods, test_config(addrs(&pods)), Gateway::OriginalDst).await;
    let client = http_client();

    let response = client
        .post(envoy.url("/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": "stream please", "stream": true}))
        .send()
        .await
        .expect("response");
    assert_eq!(response.status(), 200);
    let text = response.text().await.expect("sse");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert_eq!(
        text.matches("data: ").count(),
        5,
        "every SSE event arrives: {text}"
    );

    let models = client
        .get(envoy.url("/v1/models"))
        .send()
        .await
        .expect("response");
    assert_eq!(models.status(), 200);
    let listing: serde_json::Value = models.json().await.expect("json");
    assert_eq!(listing["data"][0]["id"], MODEL);

    // 3 MB: many ext_proc chunks in, many ≤ 62,000-byte chunks back out.
    let prompt = "abcdefgh".repeat(375_000);
    let (status, _, body) = complete(
        &client,
        &envoy,
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{}", &body[..body.len().min(300)]);
    let answer: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert!(
        answer["prompt_bytes"]
            .as_u64()
            .is_some_and(|n| n > 3_000_000)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_gets_413() {
    let pods = fleet(1, &[]).await;
    let mut config = test_config(addrs(&pods));
    config.max_body_bytes = 100_000;
    let (_kvroute, envoy) = behind_envoy(&pods, config, Gateway::OriginalDst).await;
    let prompt = "x".repeat(300_000);
    let (status, _, body) = complete(
        &http_client(),
        &envoy,
        json!({"model": MODEL, "prompt": prompt}),
    )
    .await;
    assert_eq!(status, 413, "{body}\n{}", envoy.log());
    let error: serde_json::Value = serde_json::from_str(&body).expect("json error");
    assert_eq!(error["error"]["code"], "request_too_large");
    assert_eq!(pods[0].arrivals(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_fail_open_config_requests_still_succeed_when_kvroute_is_stopped() {
    let pods = fleet(2, &[]).await;
    pods[0].set_metrics(FakeMetrics {
        kv_usage: 0.6,
        ..FakeMetrics::default()
    });
    // override_host accepts kvroute's fallback list.
    let mut config = test_config(addrs(&pods));
    config.scheduler.fallbacks = 1;
    let (mut kvroute, envoy) = behind_envoy(&pods, config, Gateway::OverrideHost).await;
    let client = http_client();
    for _ in 0..4 {
        let (status, pod, body) =
            complete(&client, &envoy, json!({"model": MODEL, "prompt": "hi"})).await;
        assert_eq!(status, 200, "{body}\n{}", envoy.log());
        assert_eq!(pod.as_deref(), Some("pod-1"), "kvroute's pick is honoured");
        let destination = pods[1].last_headers().and_then(|h| {
            h.get("x-gateway-destination-endpoint")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
        assert_eq!(
            destination,
            Some(format!("{},{}", pods[1].addr, pods[0].addr))
        );
    }

    kvroute.stop().await;
    let mut served: HashMap<String, usize> = HashMap::new();
    for i in 0..6 {
        let (status, pod, body) =
            complete(&client, &envoy, json!({"model": MODEL, "prompt": "hi"})).await;
        assert_eq!(
            status,
            200,
            "request {i} after stop: {body}\n{}",
            envoy.log()
        );
        *served.entry(pod.unwrap_or_default()).or_default() += 1;
    }
    assert_eq!(
        served.len(),
        2,
        "round robin over both pods without kvroute: {served:?}"
    );
}

/// Body modes kvroute cannot route in are refused with an explicit error at the first
/// message, through a real Envoy; a partial buffered body gets 413, not a parse error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_modes_that_cannot_route_are_refused_with_a_clear_error_through_envoy() {
    let pods = fleet(1, &[]).await;
    let client = http_client();
    let (_kvroute, envoy) = behind_envoy(
        &pods,
        test_config(addrs(&pods)),
        Gateway::OriginalDstWithRequestBodyMode("STREAMED"),
    )
    .await;
    let (status, _, body) =
        complete(&client, &envoy, json!({"model": MODEL, "prompt": "hi"})).await;
    assert_eq!(status, 500, "{body}\n{}", envoy.log());
    let error: serde_json::Value = serde_json::from_str(&body).expect("json error");
    assert_eq!(error["error"]["code"], "unsupported_body_mode", "{body}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("STREAMED")),
        "{body}"
    );
    assert_eq!(pods[0].arrivals(), 0, "nothing reached the pod unrouted");
    drop(envoy);

    let (_kvroute, envoy) = behind_envoy(
        &pods,
        test_config(addrs(&pods)),
        Gateway::OriginalDstWithRequestBodyMode("BUFFERED_PARTIAL"),
    )
    .await;
    let (status, pod, body) =
        complete(&client, &envoy, json!({"model": MODEL, "prompt": "hi"})).await;
    assert_eq!(status, 200, "a body that fits is routed: {body}");
    assert_eq!(pod.as_deref(), Some("pod-0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_model_list_cannot_be_read_answers_503_not_404_until_kvroute_can_list_it() {
    let pods = fleet(1, &[]).await;
    pods[0].require_api_key(Some("sk-pod"));
    let without_key = support::Kvroute::start(test_config(addrs(&pods))).await;
    without_key
        .wait_for("the pod scraped, its models refused", |s| {
            s.pods()
                .iter()
                .all(|p| p.healthy && p.metrics().is_some() && p.models.is_none())
        })
        .await;
    let envoy =
        support::Envoy::start(Gateway::OriginalDst, without_key.addrs.grpc, &addrs(&pods)).await;
    let client = http_client();
    let (status, _, body) =
        complete(&client, &envoy, json!({"model": MODEL, "prompt": "hi"})).await;
    assert_eq!(status, 503, "a served model is not unknown: {body}");
    let error: serde_json::Value = serde_json::from_str(&body).expect("json error");
    assert_eq!(error["error"]["code"], "no_ready_endpoint");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("/v1/models")),
        "{error}"
    );
    assert_eq!(pods[0].arrivals(), 0);
    drop(envoy);
    drop(without_key);

    let mut config = test_config(addrs(&pods));
    config.scrape.pod_api_key = Some(kvroute::scrape::ApiKey("sk-pod".into()));
    let (_kvroute, envoy) = {
        let kvroute = support::Kvroute::start(config).await;
        kvroute.wait_until_current(&pods).await;
        let envoy =
            support::Envoy::start(Gateway::OriginalDst, kvroute.addrs.grpc, &addrs(&pods)).await;
        (kvroute, envoy)
    };
    let (status, pod, body) =
        complete(&client, &envoy, json!({"model": MODEL, "prompt": "hi"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(pod.as_deref(), Some("pod-0"));
}
