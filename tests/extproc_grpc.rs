//! The ext_proc service over real gRPC, driven by a tonic client playing Envoy's part,
//! in both body modes; plus the gRPC health services.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    body_mutation,
};
use envoy_types::pb::google::protobuf::value::Kind;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use support::{FakeMetrics, FakePod, Kvroute, test_config};

fn headers_message(path: &str, end_of_stream: bool, mode: BodySendMode) -> ProcessingRequest {
    let pairs = [
        (":method", "POST"),
        (":path", path),
        ("content-type", "application/json"),
    ];
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: mode as i32,
            ..ProtocolConfiguration::default()
        }),
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: (*k).to_owned(),
                        raw_value: v.as_bytes().to_vec(),
                        ..HeaderValue::default()
                    })
                    .collect(),
            }),
            end_of_stream,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn body_message(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// An open ext_proc stream: send messages, receive answers.
struct Stream {
    send: mpsc::Sender<ProcessingRequest>,
    answers: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(kvroute: &Kvroute) -> Stream {
        Stream::open_at(kvroute.addrs.grpc).await
    }

    /// A stream on a new connection to `addr` (kvroute's ext_proc port, or a relay to it).
    async fn open_at(addr: std::net::SocketAddr) -> Stream {
        Stream::try_open_at(addr).await.expect("open stream")
    }

    /// [`Stream::open_at`], with kvroute's refusal of the stream as the error.
    async fn try_open_at(addr: std::net::SocketAddr) -> Result<Stream, tonic::Status> {
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        let (send, receive) = mpsc::channel(16);
        let answers = client
            .process(ReceiverStream::new(receive))
            .await?
            .into_inner();
        Ok(Stream { send, answers })
    }

    async fn send(&self, message: ProcessingRequest) {
        self.send.send(message).await.expect("send");
    }

    async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(5), self.answers.message())
            .await
            .expect("answer in time")
            .expect("no gRPC error")
            .expect("an answer")
    }
}

fn destination(answer: &ProcessingResponse) -> Option<String> {
    let common = match answer.response.as_ref()? {
        Response::RequestHeaders(h) => h.response.as_ref()?,
        Response::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    let header = common
        .header_mutation
        .as_ref()?
        .set_headers
        .first()?
        .header
        .as_ref()?;
    let from_header = String::from_utf8(header.raw_value.clone()).ok()?;
    let Some(Kind::StructValue(lb)) = &answer
        .dynamic_metadata
        .as_ref()?
        .fields
        .get("envoy.lb")?
        .kind
    else {
        return None;
    };
    let Some(Kind::StringValue(from_metadata)) =
        &lb.fields.get("x-gateway-destination-endpoint")?.kind
    else {
        return None;
    };
    assert_eq!(
        &from_header, from_metadata,
        "header and metadata must match"
    );
    assert!(common.clear_route_cache);
    Some(from_header)
}

async fn two_pods() -> [FakePod; 2] {
    [
        FakePod::start("pod-0", "llama", &[]).await,
        FakePod::start("pod-1", "llama", &[]).await,
    ]
}

async fn two_pods_second_preferred() -> ([FakePod; 2], Kvroute) {
    let pods = two_pods().await;
    pods[0].set_metrics(FakeMetrics {
        kv_usage: 0.95,
        ..FakeMetrics::default()
    });
    let kvroute = Kvroute::start(test_config(pods.iter().map(|p| p.addr).collect())).await;
    kvroute.wait_until_scraped(2).await;
    kvroute.wait_for_pod(pods[0].addr, 0.95, 0).await;
    (pods, kvroute)
}

const COMPLETION: &[u8] =
    br#"{"model":"llama","prompt":"The capital of France is","max_tokens":4}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_mode_routes_in_the_body_answer() {
    let (pods, kvroute) = two_pods_second_preferred().await;
    let mut stream = Stream::open(&kvroute).await;
    stream
        .send(headers_message(
            "/v1/completions",
            false,
            BodySendMode::Buffered,
        ))
        .await;
    let first = stream.next().await;
    assert!(matches!(first.response, Some(Response::RequestHeaders(_))));
    assert_eq!(
        destination(&first),
        None,
        "headers are answered at once, unrouted"
    );
    stream.send(body_message(COMPLETION, true)).await;
    let answer = stream.next().await;
    assert!(matches!(answer.response, Some(Response::RequestBody(_))));
    assert_eq!(destination(&answer), Some(pods[1].addr.to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_mode_holds_the_headers_then_streams_the_body_back() {
    let (pods, kvroute) = two_pods_second_preferred().await;
    let mut stream = Stream::open(&kvroute).await;
    stream
        .send(headers_message(
            "/v1/completions",
            false,
            BodySendMode::FullDuplexStreamed,
        ))
        .await;
    let (first_half, second_half) = COMPLETION.split_at(20);
    stream.send(body_message(first_half, false)).await;
    stream.send(body_message(second_half, true)).await;
    let headers_answer = stream.next().await;
    assert!(matches!(
        headers_answer.response,
        Some(Response::RequestHeaders(_))
    ));
    assert_eq!(destination(&headers_answer), Some(pods[1].addr.to_string()));
    let body_answer = stream.next().await;
    let Some(Response::RequestBody(body)) = body_answer.response else {
        panic!("streamed body expected");
    };
    let mutation = body
        .response
        .and_then(|c| c.body_mutation)
        .and_then(|m| m.mutation);
    let Some(body_mutation::Mutation::StreamedResponse(streamed)) = mutation else {
        panic!("streamed response expected");
    };
    assert_eq!(streamed.body, COMPLETION);
    assert!(streamed.end_of_stream);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_only_request_is_routed_in_the_headers_answer() {
    let (pods, kvroute) = two_pods_second_preferred().await;
    let mut stream = Stream::open(&kvroute).await;
    stream
        .send(headers_message(
            "/v1/models",
            true,
            BodySendMode::FullDuplexStreamed,
        ))
        .await;
    let answer = stream.next().await;
    let chosen = destination(&answer).expect("routed");
    assert!(pods.iter().any(|p| p.addr.to_string() == chosen));
}

async fn health_client(addr: std::net::SocketAddr) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    HealthClient::new(channel)
}

async fn health_status(addr: std::net::SocketAddr, service: &str) -> ServingStatus {
    let mut client = health_client(addr).await;
    let response = client
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .expect("health check");
    response.into_inner().status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_whether_any_pod_is_scraped_while_liveness_always_serves() {
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    // A pod whose /metrics fails: nothing is scraped, so kvroute is not ready.
    pod.override_metrics(Some((500, "engine dead")));
    let mut config = test_config(vec![pod.addr]);
    // Answer at once rather than hold the request for a pod to come up (the default,
    // tested in src/picker/tests.rs), so that the answer shows the state now.
    config.flow.hold_without_endpoints = false;
    let kvroute = Kvroute::start(config).await;
    let grpc = kvroute.addrs.grpc;
    assert_eq!(
        health_status(grpc, "liveness").await,
        ServingStatus::Serving
    );
    assert_eq!(
        health_status(grpc, "readiness").await,
        ServingStatus::NotServing
    );
    assert_eq!(
        health_status(grpc, "envoy.service.ext_proc.v3.ExternalProcessor").await,
        ServingStatus::NotServing
    );

    // Requests get 503 while no pod is ready. The pod's model list must be in first: a
    // down pod that never listed its models serves nothing, and the answer would be 404
    // (the poller reads /v1/models after its first /metrics attempt, so this can lag).
    kvroute
        .wait_for("the pod's models listed", |s| {
            s.pods().iter().all(|p| p.models.is_some())
        })
        .await;
    let Some(Response::ImmediateResponse(reply)) = route_one_buffered(&kvroute).await.response
    else {
        panic!("immediate response expected");
    };
    assert_eq!(reply.status.map(|s| s.code), Some(503));

    // The pod recovers: readiness turns to serving, observed through Watch.
    let mut health = health_client(grpc).await;
    let mut watch = health
        .watch(HealthCheckRequest {
            service: "readiness".into(),
        })
        .await
        .expect("watch")
        .into_inner();
    pod.override_metrics(None);
    let ready = tokio::time::timeout(Duration::from_secs(10), async {
        while let Ok(Some(update)) = watch.message().await {
            if update.status() == ServingStatus::Serving {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    assert!(ready, "readiness never turned to serving");
    assert_eq!(
        health_status(grpc, "envoy.service.ext_proc.v3.ExternalProcessor").await,
        ServingStatus::Serving
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_metrics_lie_or_fail_is_taken_out_and_comes_back() {
    let pods = two_pods().await;
    let kvroute = Kvroute::start(test_config(pods.iter().map(|p| p.addr).collect())).await;
    kvroute.wait_until_scraped(2).await;
    let bad = pods[0].addr;
    pods[0].override_metrics(Some((
        200,
        "vllm:num_requests_waiting{engine=\"0\"} banana\n",
    )));
    kvroute
        .wait_for("pod-0 marked down", move |s| {
            s.pod(bad).is_some_and(|p| !p.healthy)
        })
        .await;
    pods[0].override_metrics(None);
    kvroute
        .wait_for("pod-0 back up", move |s| {
            s.pod(bad).is_some_and(|p| p.healthy)
        })
        .await;
}

async fn route_one_buffered(kvroute: &Kvroute) -> ProcessingResponse {
    let mut stream = Stream::open(kvroute).await;
    stream
        .send(headers_message(
            "/v1/completions",
            false,
            BodySendMode::Buffered,
        ))
        .await;
    stream.next().await;
    stream.send(body_message(COMPLETION, true)).await;
    stream.next().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decision_log_shows_every_top_candidates_scores_when_enabled() {
    let pods = two_pods().await;
    pods[0].set_metrics(FakeMetrics {
        kv_usage: 0.6,
        ..FakeMetrics::default()
    });
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.debug_decisions = 8;
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(2).await;
    kvroute.wait_for_pod(pods[0].addr, 0.6, 0).await;
    let answer = route_one_buffered(&kvroute).await;
    assert_eq!(destination(&answer), Some(pods[1].addr.to_string()));

    let log = support::decision_log(kvroute.addrs.debug.expect("debug pages on")).await;
    let last = &log.as_array().expect("a list")[0];
    assert_eq!(last["model"], "llama");
    assert_eq!(last["decision"]["endpoint"], pods[1].addr.to_string());
    assert_eq!(last["decision"]["reason"], "least_loaded");
    let ranked = last["decision"]["ranked"].as_array().expect("ranked");
    assert_eq!(ranked.len(), 2);
    assert!(ranked[0]["total"].as_f64() > ranked[1]["total"].as_f64());
    assert!(ranked[0]["kv_headroom"].as_f64() > ranked[1]["kv_headroom"].as_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decision_log_is_off_by_default_and_says_how_to_enable_it() {
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let kvroute = Kvroute::start(test_config(vec![pod.addr])).await;
    let url = format!(
        "http://{}/debug/decisions",
        kvroute.addrs.debug.expect("debug pages on")
    );
    let response = support::http_client().get(url).send().await.expect("get");
    assert_eq!(response.status(), 404);
    let body: serde_json::Value = response.json().await.expect("json");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--debug-decisions"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_metrics_count_requests_and_show_each_pods_scraped_state() {
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    pod.set_metrics(FakeMetrics {
        kv_usage: 0.25,
        waiting: 2,
        ..FakeMetrics::default()
    });
    let kvroute = Kvroute::start(test_config(vec![pod.addr])).await;
    kvroute.wait_until_scraped(1).await;
    kvroute.wait_for_pod(pod.addr, 0.25, 2).await;
    route_one_buffered(&kvroute).await;
    let text = kvroute.metrics_text().await;
    let samples = kvroute_core::exposition::parse(&text).expect("valid exposition");
    let value = |name: &str, label: (&str, &str)| {
        samples
            .iter()
            .filter(|s| s.name == name && s.label(label.0) == Some(label.1))
            .map(|s| s.value)
            .sum::<f64>()
    };
    let pod_label = pod.addr.to_string();
    assert!(
        value("kvroute_requests_total", ("outcome", "routed")) >= 1.0,
        "{text}"
    );
    assert_eq!(
        value("kvroute_pod_kv_cache_usage_ratio", ("pod", &pod_label)),
        0.25
    );
    assert_eq!(
        value("kvroute_pod_requests_waiting", ("pod", &pod_label)),
        2.0
    );
    assert_eq!(value("kvroute_pod_healthy", ("pod", &pod_label)), 1.0);
    assert!(text.contains("kvroute_pick_duration_seconds_bucket"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_metrics_hang_is_taken_out_after_the_scrape_timeout() {
    let pods = two_pods().await;
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.scrape.timeout = Duration::from_millis(100);
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(2).await;
    let hung = pods[0].addr;
    pods[0].hang_metrics(true);
    kvroute
        .wait_for("the hung pod marked down", move |s| {
            s.pod(hung).is_some_and(|p| !p.healthy)
        })
        .await;
    // Requests keep flowing to the healthy pod meanwhile.
    for _ in 0..3 {
        let answer = route_one_buffered(&kvroute).await;
        assert_eq!(destination(&answer), Some(pods[1].addr.to_string()));
    }
    pods[0].hang_metrics(false);
    kvroute
        .wait_for("the pod back once it answers", move |s| {
            s.pod(hung).is_some_and(|p| p.healthy)
        })
        .await;
}

/// A full-duplex completion whose headers and first body bytes are sent and whose body
/// has not ended: kvroute holds it, waiting for the rest.
async fn held_completion(kvroute: &Kvroute) -> Stream {
    let held = Stream::open(kvroute).await;
    held.send(headers_message(
        "/v1/completions",
        false,
        BodySendMode::FullDuplexStreamed,
    ))
    .await;
    held.send(body_message(&COMPLETION[..10], false)).await;
    held
}

/// On shutdown kvroute keeps routing until the drain deadline (readiness already off),
/// then answers a request still waiting for its route with 503 rather than ending its
/// stream cleanly, which Envoy would read as "continue unrouted".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_the_drain_requests_are_routed_and_at_its_end_a_held_one_gets_503() {
    let pods = two_pods().await;
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.drain_timeout = Duration::from_secs(2);
    let mut kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(2).await;
    let grpc = kvroute.addrs.grpc;
    let mut readiness = health_client(grpc)
        .await
        .watch(HealthCheckRequest {
            service: "readiness".into(),
        })
        .await
        .expect("watch readiness")
        .into_inner();

    // Held: full duplex, headers sent, the body never ends.
    let mut held = held_completion(&kvroute).await;

    let stopping = tokio::spawn(async move {
        kvroute.stop().await;
    });
    let not_ready = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(update)) = readiness.message().await {
            if update.status() == ServingStatus::NotServing {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(not_ready, Ok(true), "readiness turns off at once");
    drop(readiness);

    // Draining: a new stream (on a new connection) is still routed.
    let mut late = Stream::open_at(grpc).await;
    late.send(headers_message(
        "/v1/models",
        true,
        BodySendMode::FullDuplexStreamed,
    ))
    .await;
    let answer = late.next().await;
    assert!(destination(&answer).is_some(), "routed: {answer:?}");
    drop(late);

    // The deadline: the held request is answered, not passed on unrouted.
    let answer = held.next().await;
    let Some(Response::ImmediateResponse(reply)) = answer.response else {
        panic!("an immediate response expected: {answer:?}");
    };
    assert_eq!(reply.status.map(|s| s.code), Some(503));
    let error: serde_json::Value = serde_json::from_slice(&reply.body).expect("json error");
    assert_eq!(error["error"]["code"], "shutting_down");
    drop(held);
    let stopped = tokio::time::timeout(Duration::from_secs(5), stopping).await;
    assert!(stopped.is_ok(), "kvroute stops once the drain is over");
}

/// After the grace, the drain waits for the streams still open and then ends, long
/// before its timeout: a kvroute restarted in place is back sooner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_ends_when_the_last_open_stream_does() {
    let pods = two_pods().await;
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.drain_timeout = Duration::from_secs(60);
    config.drain_grace = Duration::from_millis(100);
    let mut kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(2).await;

    // Open (the call returned, so kvroute counts it), its body not yet ended.
    let mut held = held_completion(&kvroute).await;
    let stopping = tokio::spawn(async move {
        kvroute.stop().await;
    });

    // Well past the grace, the open request is still served to its end.
    tokio::time::sleep(Duration::from_millis(500)).await;
    held.send(body_message(&COMPLETION[10..], true)).await;
    let answer = held.next().await;
    assert!(
        destination(&answer).is_some(),
        "routed after the grace: {answer:?}"
    );
    assert!(
        !stopping.is_finished(),
        "the drain waits for the open stream"
    );

    drop(held);
    let stopped = tokio::time::timeout(Duration::from_secs(15), stopping).await;
    assert!(
        stopped.is_ok(),
        "kvroute stops once its last stream ends, not at the 60 s drain timeout"
    );
}

/// Past `--max-connections` a new connection is closed on arrival and counted; the place
/// of a connection that ends is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_closed_on_arrival_and_counted() {
    let pods = two_pods().await;
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.max_connections = 2;
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(2).await;
    let grpc = kvroute.addrs.grpc;

    let first = Stream::open(&kvroute).await;
    let _second = Stream::open(&kvroute).await;
    let refused = async {
        let mut client = ExternalProcessorClient::connect(format!("http://{grpc}")).await?;
        let (_send, receive) = mpsc::channel(1);
        client.process(ReceiverStream::new(receive)).await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    }
    .await;
    assert!(refused.is_err(), "a third connection is refused");
    let text = kvroute.metrics_text().await;
    assert!(
        text.lines()
            .any(|line| line
                .starts_with(r#"kvroute_connections_refused_total{listener="ext_proc"}"#)),
        "{text}"
    );

    // One ends: a new connection gets its place (once kvroute has seen it close).
    drop(first);
    let try_once = || async {
        let mut client = ExternalProcessorClient::connect(format!("http://{grpc}")).await?;
        let (send, receive) = mpsc::channel(1);
        send.send(headers_message(
            "/v1/models",
            true,
            BodySendMode::FullDuplexStreamed,
        ))
        .await?;
        let mut answers = client
            .process(ReceiverStream::new(receive))
            .await?
            .into_inner();
        Ok::<_, Box<dyn std::error::Error>>(answers.message().await?.is_some())
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut served = false;
    while !served && std::time::Instant::now() < deadline {
        served = matches!(
            tokio::time::timeout(Duration::from_secs(2), try_once()).await,
            Ok(Ok(true))
        );
    }
    assert!(served, "a connection is served again once one has ended");
}

/// kvroute asks each pod's `/metrics` for the series it reads only, by name
/// (`?name[]=`, which vLLM's prometheus_client app honours).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_ask_only_for_the_series_kvroute_reads() {
    let pods = two_pods().await;
    let kvroute = Kvroute::start(test_config(pods.iter().map(|p| p.addr).collect())).await;
    kvroute.wait_until_scraped(2).await;
    let query = pods[0].last_metrics_query().expect("a query string");
    let names: Vec<String> = query
        .split('&')
        .map(|pair| {
            let (key, value) = pair.split_once('=').expect("key=value");
            assert_eq!(key, "name%5B%5D", "{query}");
            value.replace("%3A", ":")
        })
        .collect();
    for series in [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
        "vllm:prefix_cache_queries_total",
    ] {
        assert!(names.iter().any(|n| n == series), "{series} in {names:?}");
    }
}

/// A TCP relay to `target` that can be cut: afterwards it forwards nothing either way but
/// keeps both connections open, as a gateway node that vanished without a FIN looks.
async fn cuttable_relay(
    target: std::net::SocketAddr,
) -> (std::net::SocketAddr, tokio::sync::watch::Sender<bool>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind relay");
    let addr = listener.local_addr().expect("relay addr");
    let (cut, cut_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = tokio::net::TcpStream::connect(target)
                .await
                .expect("relay connects");
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            for (mut from, mut to) in [(client_read, server_write), (server_read, client_write)] {
                let mut cut = cut_rx.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let cut_now = async {
                            let _ = cut.wait_for(|cut| *cut).await;
                        };
                        let read = tokio::select! {
                            read = from.read(&mut buf) => read,
                            () = cut_now => {
                                // Hold both halves open and silent until the test ends.
                                std::future::pending::<()>().await;
                                return;
                            }
                        };
                        match read {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if to.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        }
    });
    (addr, cut)
}

/// A gateway that disappears without closing its connection does not keep its requests
/// counted against a pod: keepalive pings go unanswered, kvroute closes the connection and
/// the stream's reservation is released within interval + timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_vanishes_silently_releases_its_requests_within_the_keepalive_bound() {
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let mut config = test_config(vec![pod.addr]);
    config.grpc_keepalive.interval = Duration::from_millis(100);
    config.grpc_keepalive.timeout = Duration::from_millis(100);
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(1).await;
    let (relay, cut) = cuttable_relay(kvroute.addrs.grpc).await;

    let mut stream = Stream::open_at(relay).await;
    // A header-only request is routed at once and holds its reservation until the
    // stream ends (no response phases follow).
    stream
        .send(headers_message(
            "/v1/models",
            true,
            BodySendMode::FullDuplexStreamed,
        ))
        .await;
    assert!(destination(&stream.next().await).is_some());
    let inflight = || {
        let fleet = kvroute.store.fleet();
        fleet.pod(pod.addr).map_or(0, |(_, load)| load.inflight())
    };
    assert_eq!(inflight(), 1);

    cut.send_replace(true);
    let started = std::time::Instant::now();
    // Nothing announces the release (the counters are atomics, not events): poll them,
    // bounded well above interval + timeout.
    while inflight() > 0 && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        inflight(),
        0,
        "still counted {:?} after the cut",
        started.elapsed()
    );
    drop(stream);
}

/// A non-streaming request answers only when it is complete, so its first response bytes
/// cannot mark the end of its prefill: the next scrape that saw it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_requests_queued_prefill_ends_without_any_response_bytes() {
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let mut config = test_config(vec![pod.addr]);
    // Scrapes held back below must not take the pod out.
    config.health.failures_to_mark_down = 1_000_000;
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(1).await;
    // No scrape that starts after the request is routed may finish until the first check
    // is done (every 20 ms one would, and end the prefill before it).
    pod.hang_metrics(true);
    let mut stream = Stream::open(&kvroute).await;
    stream
        .send(headers_message(
            "/v1/completions",
            false,
            BodySendMode::FullDuplexStreamed,
        ))
        .await;
    // COMPLETION does not set `stream`: a non-streaming request.
    stream.send(body_message(COMPLETION, true)).await;
    assert!(destination(&stream.next().await).is_some(), "routed");
    let prefill = |fleet: &kvroute_core::fleet::Fleet| {
        fleet
            .pod(pod.addr)
            .map_or(0, |(_, load)| load.prefill_tokens())
    };
    assert!(prefill(&kvroute.store.fleet()) > 0, "queued at first");
    // No response phase follows; each scrape publishes a fleet.
    let mut fleets = kvroute.store.subscribe();
    pod.hang_metrics(false);
    let ended = tokio::time::timeout(
        Duration::from_secs(5),
        fleets.wait_for(|fleet| prefill(fleet) == 0),
    )
    .await;
    assert!(matches!(ended, Ok(Ok(_))), "the next scrape ends it");
    let fleet = kvroute.store.fleet();
    let (_, load) = fleet.pod(pod.addr).expect("known");
    assert_eq!(
        load.inflight(),
        1,
        "still in flight: only its prefill ended"
    );
    drop(stream);
}

/// Passes raw bytes as gRPC messages, to send what no protobuf encoder would.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        let mut bytes = vec![0; bytes::Buf::remaining(src)];
        bytes::Buf::copy_to_slice(src, &mut bytes);
        Ok(Some(bytes))
    }
}

/// A message that is not a `ProcessingRequest` ends the stream with a gRPC error, not
/// with `grpc-status: 0` (which would read as a clean end to the peer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_message_ends_the_stream_with_a_grpc_error() {
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let kvroute = Kvroute::start(test_config(vec![pod.addr])).await;
    kvroute.wait_until_scraped(1).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", kvroute.addrs.grpc))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    // Field 1 with wire type 7, which protobuf does not have.
    let junk = tokio_stream::iter(vec![vec![0x0f, 0xff, 0xff]]);
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
    );
    let ended = match grpc
        .streaming(tonic::Request::new(junk), path, RawCodec)
        .await
    {
        Ok(response) => match response.into_inner().message().await {
            Ok(Some(answer)) => panic!("an answer to junk: {answer:?}"),
            Ok(None) => Ok(()),
            Err(status) => Err(status),
        },
        Err(status) => Err(status),
    };
    let status = ended.expect_err("the stream ends with an error status");
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
}

/// A stream may not sit on kvroute's memory: one that never speaks is closed with
/// DEADLINE_EXCEEDED once the read timeout passes, and a request whose body stalls is
/// answered 408; a request read in time is routed as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_do_not_deliver_their_request_in_time_are_ended() {
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let mut config = test_config(vec![pod.addr]);
    config.request_read_timeout = Duration::from_millis(300);
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(1).await;

    let mut silent = Stream::open(&kvroute).await;
    let ended = tokio::time::timeout(Duration::from_secs(5), silent.answers.message())
        .await
        .expect("ended in time");
    let status = ended.expect_err("an error status");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");

    let mut stalled = Stream::open(&kvroute).await;
    stalled
        .send(headers_message(
            "/v1/completions",
            false,
            BodySendMode::FullDuplexStreamed,
        ))
        .await;
    stalled.send(body_message(b"{\"model\":", false)).await;
    let answer = stalled.next().await;
    let Some(Response::ImmediateResponse(reply)) = answer.response else {
        panic!("an immediate answer: {answer:?}");
    };
    assert_eq!(reply.status.map(|s| s.code), Some(408));

    assert!(destination(&route_one_buffered(&kvroute).await).is_some());
}

/// Silent streams spread over many connections cannot pile up: beyond
/// `--max-silent-streams` streams that have sent nothing, a new stream is refused
/// (RESOURCE_EXHAUSTED) and counted; a stream that speaks stops counting, and one that is
/// admitted routes as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_sent_nothing_are_capped_across_connections() {
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let mut config = test_config(vec![pod.addr]);
    config.max_silent_streams = 3;
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(1).await;

    // Three silent streams, each on its own connection.
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(Stream::open(&kvroute).await);
    }
    let Err(status) = Stream::try_open_at(kvroute.addrs.grpc).await else {
        panic!("a fourth silent stream is refused");
    };
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let text = kvroute.metrics_text().await;
    assert!(
        text.lines()
            .any(|l| l == "kvroute_extproc_silent_streams_refused_total 1"),
        "{text}"
    );

    // One of them speaks: it no longer counts, and a new stream is admitted.
    silent[0]
        .send(headers_message(
            "/v1/completions",
            false,
            BodySendMode::FullDuplexStreamed,
        ))
        .await;
    silent[0]
        .send(body_message(br#"{"model":"llama","prompt":"hi"}"#, true))
        .await;
    let answer = silent[0].next().await;
    assert!(destination(&answer).is_some(), "{answer:?}");
    let admitted = Stream::try_open_at(kvroute.addrs.grpc).await;
    assert!(admitted.is_ok(), "a new stream is admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observing_stream_gets_no_answer_and_is_ended_by_kvroute_once_the_body_has() {
    let pods = two_pods().await;
    let kvroute = Kvroute::start(test_config(pods.iter().map(|p| p.addr).collect())).await;
    let mut stream = Stream::open(&kvroute).await;
    // Envoy's observing filter: response headers and body, never waiting for answers.
    let observed = |request| ProcessingRequest {
        request: Some(request),
        observability_mode: true,
        ..ProcessingRequest::default()
    };
    stream
        .send(observed(Request::ResponseHeaders(HttpHeaders::default())))
        .await;
    for (chunk, last) in [
        (b"data: {}\n\n".as_slice(), false),
        (b"data: [DONE]\n\n", true),
    ] {
        stream
            .send(observed(Request::ResponseBody(HttpBody {
                body: chunk.to_vec(),
                end_of_stream: last,
                ..HttpBody::default()
            })))
            .await;
    }
    // The send side stays open (Envoy holds it for its deferred close): the end comes
    // from kvroute, with no answer before it.
    let end = tokio::time::timeout(Duration::from_secs(5), stream.answers.message())
        .await
        .expect("kvroute ends the stream in time");
    assert!(
        matches!(end, Ok(None)),
        "the stream ends cleanly with no answer: {end:?}"
    );
}
