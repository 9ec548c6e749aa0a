//! The gRPC admin API: decisions stream to watchers as requests are routed through the
//! ext_proc service (a tonic client plays Envoy's part), the endpoint list mirrors the
//! fake pods' metrics, and the `tap` / `endpoints` commands print them.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use kvroute::admin::pb::admin_client::AdminClient;
use kvroute::admin::pb::decision_event::Outcome;
use kvroute::admin::pb::{DecisionEvent, ListEndpointsRequest, Routed, WatchDecisionsRequest};
use kvroute::config::ServeConfig;
use support::{FakeMetrics, FakePod, Kvroute, test_config};

const WAIT: Duration = Duration::from_secs(10);

/// kvroute for tests, with the admin API on an ephemeral loopback port.
fn admin_config(pods: &[FakePod]) -> ServeConfig {
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.admin_addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    config
}

fn admin_addr(kvroute: &Kvroute) -> SocketAddr {
    kvroute.addrs.admin.expect("the admin API is on")
}

async fn admin_client(kvroute: &Kvroute) -> AdminClient<Channel> {
    AdminClient::connect(format!("http://{}", admin_addr(kvroute)))
        .await
        .expect("connect to the admin API")
}

/// Opens a decision stream; the watcher is subscribed once this returns.
async fn watch(kvroute: &Kvroute, model: &str) -> tonic::Streaming<DecisionEvent> {
    admin_client(kvroute)
        .await
        .watch_decisions(WatchDecisionsRequest {
            model: model.into(),
        })
        .await
        .expect("WatchDecisions")
        .into_inner()
}

async fn next_event(events: &mut tonic::Streaming<DecisionEvent>) -> DecisionEvent {
    tokio::time::timeout(WAIT, events.message())
        .await
        .expect("a decision in time")
        .expect("no gRPC error")
        .expect("the stream is open")
}

fn routed(event: &DecisionEvent) -> &Routed {
    match &event.outcome {
        Some(Outcome::Routed(routed)) => routed,
        other => panic!("expected a routed decision, got {other:?}"),
    }
}

/// Plays Envoy for one buffered POST to /v1/completions with `body`, and waits for
/// kvroute's answer to the body (routed or refused).
async fn send_request(kvroute: &Kvroute, body: &str) {
    let mut client = ExternalProcessorClient::connect(format!("http://{}", kvroute.addrs.grpc))
        .await
        .expect("connect ext_proc");
    let (send, receive) = mpsc::channel(4);
    let mut answers = client
        .process(ReceiverStream::new(receive))
        .await
        .expect("open ext_proc stream")
        .into_inner();
    let header = |key: &str, value: &str| HeaderValue {
        key: key.to_owned(),
        raw_value: value.as_bytes().to_vec(),
        ..HeaderValue::default()
    };
    let mode = BodySendMode::Buffered as i32;
    let headers = ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode,
            response_body_mode: mode,
            ..ProtocolConfiguration::default()
        }),
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", "/v1/completions"),
                    header("content-type", "application/json"),
                ],
            }),
            end_of_stream: false,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    };
    let body = ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: body.as_bytes().to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    };
    send.send(headers).await.expect("send headers");
    send.send(body).await.expect("send body");
    // The headers' answer, then the body's (the routing decision or an error).
    for _ in 0..2 {
        let answer = tokio::time::timeout(WAIT, answers.message())
            .await
            .expect("an ext_proc answer in time")
            .expect("no gRPC error");
        if answer.is_none() {
            break;
        }
    }
}

fn completion(model: &str) -> String {
    format!(r#"{{"model":"{model}","prompt":"The capital of France is","max_tokens":4}}"#)
}

/// Two pods serving `llama` (and the adapter `sql-lora`), the first nearly full.
async fn two_pods_second_preferred() -> ([FakePod; 2], Kvroute) {
    let pods = [
        FakePod::start("pod-0", "llama", &["sql-lora"]).await,
        FakePod::start("pod-1", "llama", &["sql-lora"]).await,
    ];
    pods[0].set_metrics(FakeMetrics {
        kv_usage: 0.95,
        ..FakeMetrics::default()
    });
    let kvroute = Kvroute::start(admin_config(&pods)).await;
    kvroute.wait_until_current(&pods).await;
    (pods, kvroute)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_request_reaches_a_watcher_with_its_endpoint_reason_and_scores() {
    // Both pods pass every filter (neither saturated); the first is busier.
    let pods = [
        FakePod::start("pod-0", "llama", &[]).await,
        FakePod::start("pod-1", "llama", &[]).await,
    ];
    pods[0].set_metrics(FakeMetrics {
        kv_usage: 0.6,
        waiting: 2,
        ..FakeMetrics::default()
    });
    let kvroute = Kvroute::start(admin_config(&pods)).await;
    kvroute.wait_until_current(&pods).await;
    let mut events = watch(&kvroute, "").await;
    send_request(&kvroute, &completion("llama")).await;

    let event = next_event(&mut events).await;
    assert_eq!(event.model.as_deref(), Some("llama"));
    assert_eq!(event.max_output_tokens, Some(4));
    assert!(event.prompt_tokens > 0, "{event:?}");
    assert!(event.unix_ms > 0);
    let routed = routed(&event);
    assert_eq!(routed.endpoint, pods[1].addr.to_string());
    assert_eq!(routed.reason, "least_loaded");
    assert_eq!(routed.candidates, 2);
    assert!(routed.tokens_needed >= 4, "{routed:?}");
    assert_eq!(routed.ranked.len(), 2, "{routed:?}");
    let (winner, runner_up) = (&routed.ranked[0], &routed.ranked[1]);
    assert_eq!(winner.endpoint, pods[1].addr.to_string());
    assert_eq!(runner_up.endpoint, pods[0].addr.to_string());
    assert!(winner.total > runner_up.total, "{routed:?}");
    assert!(winner.kv_headroom > runner_up.kv_headroom, "{routed:?}");
    assert!(winner.queue > runner_up.queue, "{routed:?}");
    assert!(
        !routed
            .relaxed
            .is_some_and(|r| r.kv_headroom || r.saturation)
    );
    assert_eq!(
        winner.lora_tier, "",
        "a base-model request has no LoRA tier"
    );
    // 1,000 blocks of 16 tokens, 90 % free.
    assert!(
        winner
            .free_kv_tokens
            .is_some_and(|free| (14_000..=14_400).contains(&free)),
        "{winner:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_filter_passes_only_that_models_decisions() {
    let (_pods, kvroute) = two_pods_second_preferred().await;
    let mut adapter_only = watch(&kvroute, "sql-lora").await;
    let mut everything = watch(&kvroute, "").await;
    send_request(&kvroute, &completion("llama")).await;
    send_request(&kvroute, &completion("sql-lora")).await;

    let first = next_event(&mut everything).await;
    let second = next_event(&mut everything).await;
    assert_eq!(first.model.as_deref(), Some("llama"));
    assert_eq!(second.model.as_deref(), Some("sql-lora"));

    let event = next_event(&mut adapter_only).await;
    assert_eq!(event.model.as_deref(), Some("sql-lora"));
    let routed = routed(&event);
    assert!(routed.reason.starts_with("lora_"), "{routed:?}");
    assert!(
        routed.ranked.iter().all(|c| !c.lora_tier.is_empty()),
        "{routed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_cannot_be_placed_is_streamed_with_its_error() {
    let (_pods, kvroute) = two_pods_second_preferred().await;
    let mut events = watch(&kvroute, "").await;
    send_request(&kvroute, &completion("no-such-model")).await;
    let event = next_event(&mut events).await;
    match &event.outcome {
        Some(Outcome::Error(error)) => assert!(error.contains("no-such-model"), "{error}"),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// A request refused before routing (here, a body that is not JSON) reaches the watchers
/// with its status, code and path, as unplaceable ones do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_before_routing_is_streamed_with_its_reason() {
    let (_pods, kvroute) = two_pods_second_preferred().await;
    let mut events = watch(&kvroute, "").await;
    send_request(&kvroute, r#"{"model": "llama", "prompt": "#).await;
    let event = next_event(&mut events).await;
    assert_eq!(event.model, None);
    match &event.outcome {
        Some(Outcome::Error(error)) => {
            assert!(
                error.starts_with("refused 400 ") && error.contains("on /v1/completions"),
                "{error}"
            );
        }
        other => panic!("expected an error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_endpoints_reflects_the_fake_pods_metrics() {
    let pods = [
        FakePod::start("pod-0", "llama", &["sql-lora"]).await,
        FakePod::start("pod-1", "llama", &[]).await,
    ];
    pods[0].set_metrics(FakeMetrics {
        waiting: 3,
        running: 5,
        kv_usage: 0.4,
        max_lora: 4,
        running_adapters: vec!["sql-lora".into()],
        ..FakeMetrics::default()
    });
    let kvroute = Kvroute::start(admin_config(&pods)).await;
    kvroute.wait_until_current(&pods).await;

    let listed = admin_client(&kvroute)
        .await
        .list_endpoints(ListEndpointsRequest {})
        .await
        .expect("ListEndpoints")
        .into_inner();
    assert!(listed.generation > 0);
    assert_eq!(listed.endpoints.len(), 2);
    let first = listed
        .endpoints
        .iter()
        .find(|e| e.endpoint == pods[0].addr.to_string())
        .expect("pod-0 listed");
    assert!(first.healthy);
    assert!(first.metrics_age_seconds.is_some());
    let metrics = first.metrics.as_ref().expect("scraped");
    assert_eq!((metrics.waiting, metrics.running), (3, 5));
    assert!((metrics.kv_usage - 0.4).abs() < 1e-9);
    assert_eq!(metrics.kv_capacity_tokens, Some(16_000));
    let lora = metrics.lora.as_ref().expect("LoRA status");
    assert_eq!(lora.max_lora, 4);
    assert_eq!(lora.running, ["sql-lora"]);
    assert!(lora.waiting.is_empty());
    assert_eq!(first.models, ["llama"]);
    assert_eq!(
        first.adapters.get("sql-lora").map(String::as_str),
        Some("llama")
    );
    assert_eq!(first.inflight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_end_cleanly_when_kvroute_shuts_down() {
    let (_pods, mut kvroute) = two_pods_second_preferred().await;
    let mut events = watch(&kvroute, "").await;
    tokio::time::timeout(Duration::from_secs(5), kvroute.stop())
        .await
        .expect("kvroute stops promptly with a watcher attached");
    let end = tokio::time::timeout(WAIT, events.message())
        .await
        .expect("the stream ends in time");
    assert!(matches!(end, Ok(None)), "a clean end, got {end:?}");
}

/// Runs `kvroute ARGS...` to completion (bounded) and returns its stdout.
async fn run_kvroute(args: Vec<String>) -> String {
    let output = tokio::time::timeout(
        WAIT,
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_kvroute"))
                .args(&args)
                .output()
                .expect("run kvroute")
        }),
    )
    .await
    .expect("kvroute finishes in time")
    .expect("join");
    assert!(
        output.status.success(),
        "kvroute {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoints_command_prints_the_snapshot_as_json_and_as_a_table() {
    let (pods, kvroute) = two_pods_second_preferred().await;
    let addr = admin_addr(&kvroute).to_string();

    let json = run_kvroute(vec![
        "endpoints".into(),
        "--admin-addr".into(),
        addr.clone(),
        "--json".into(),
    ])
    .await;
    let listed: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    let endpoints = listed["endpoints"].as_array().expect("endpoints array");
    assert_eq!(endpoints.len(), 2, "{json}");
    for pod in &pods {
        let entry = endpoints
            .iter()
            .find(|e| e["endpoint"] == pod.addr.to_string())
            .unwrap_or_else(|| panic!("{} missing: {json}", pod.addr));
        assert_eq!(entry["healthy"], true, "{json}");
        assert_eq!(entry["models"][0], "llama", "{json}");
    }
    let full = endpoints
        .iter()
        .find(|e| e["endpoint"] == pods[0].addr.to_string())
        .expect("pod-0");
    assert_eq!(full["metrics"]["kv_usage"], 0.95, "{json}");

    let table = run_kvroute(vec!["endpoints".into(), "--admin-addr".into(), addr]).await;
    assert!(table.starts_with("ENDPOINT"), "{table}");
    let row = table
        .lines()
        .find(|line| line.starts_with(&pods[0].addr.to_string()))
        .unwrap_or_else(|| panic!("no row for pod-0: {table}"));
    assert!(row.contains("95%") && row.contains("llama"), "{row}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tap_command_prints_each_decision_and_stops_on_ctrl_c() {
    let (pods, kvroute) = two_pods_second_preferred().await;
    let mut tap = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["tap", "--admin-addr", &admin_addr(&kvroute).to_string()])
        .args(["--model", "llama"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kvroute tap");
    let stdout = tap.stdout.take().expect("stdout");
    let (lines_tx, mut lines) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });

    // The tap subscribes some time after it starts: route until it reports a decision.
    let deadline = tokio::time::Instant::now() + WAIT;
    let first = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the tap printed nothing"
        );
        send_request(&kvroute, &completion("llama")).await;
        if let Ok(line) = tokio::time::timeout(Duration::from_millis(250), lines.recv()).await {
            break line.expect("tap output");
        }
    };
    assert!(first.contains("llama prompt="), "{first}");
    assert!(
        first.contains(&format!("-> {} least_loaded", pods[1].addr)),
        "{first}"
    );
    let candidate = tokio::time::timeout(WAIT, lines.recv())
        .await
        .expect("a candidate line")
        .expect("tap output");
    assert!(
        candidate
            .trim_start()
            .starts_with(&pods[1].addr.to_string())
            && candidate.contains("total="),
        "{candidate}"
    );
    // The printed addends (every weighted term) add up to the printed total, to rounding.
    let (total, addends) = candidate
        .split_once("total=")
        .and_then(|(_, rest)| rest.split_once(" = "))
        .expect("total=T = addends");
    let total: f64 = total.parse().expect("total");
    let addends = addends.split(" tier=").next().unwrap_or(addends);
    let addends = addends.split(" cached=").next().unwrap_or(addends);
    let addends = addends.split(" free_kv=").next().unwrap_or(addends);
    let terms: Vec<(&str, f64)> = addends
        .split(" + ")
        .map(|term| {
            let (name, value) = term.trim().split_once(' ').expect("name value");
            (name, value.parse().expect("a number"))
        })
        .collect();
    let names: Vec<&str> = terms.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        names,
        ["kv", "queue", "inflight", "lora", "prefix", "prefill"],
        "{candidate}"
    );
    let sum: f64 = terms.iter().map(|(_, value)| value).sum();
    assert!(
        (sum - total).abs() <= 0.004,
        "{sum} vs {total}: {candidate}"
    );

    // Ctrl-C ends it cleanly.
    let interrupted = Command::new("kill")
        .args(["-INT", &tap.id().to_string()])
        .status()
        .expect("kill -INT");
    assert!(interrupted.success());
    let status = tokio::time::timeout(
        WAIT,
        tokio::task::spawn_blocking(move || tap.wait().expect("wait for tap")),
    )
    .await
    .expect("the tap exits in time")
    .expect("join");
    assert!(status.success(), "{status}");
}
