//! Latency kvroute adds per request through Envoy, against a no-op ext_proc server.
//!
//! Three Envoys in front of one instant upstream (a minimal vLLM look-alike):
//!   A. no ext_proc (a plain cluster of the one pod),
//!   B. ext_proc = a no-op processor in this file: protocol plumbing only (the body mode
//!      the gateway announces, full duplex or buffered), every request to the one pod,
//!      no parsing, no scheduling,
//!   C. ext_proc = kvroute (parsing, scheduling over live scraped metrics, accounting).
//! Reports mean / p50 / p99 per request on one keep-alive connection, then throughput
//! with 16 concurrent connections, and the ratio (C − A) / (B − A).
//!
//! Run: `scripts/setup && cargo bench --bench extproc_overhead`
//! (`-- --requests N` to change the count). Target: ratio ≤ 1.15.
//!
//! With `--rates 100,400,1000` it measures the response path instead: open-loop streaming
//! requests at each rate for `--seconds` (10), each answered with `--tokens` (32)
//! server-sent events `--token-ms` (5) apart, through the fail-closed gateway (which sends
//! every response chunk through the processor) or, with `--fail-open`, the fail-open one
//! (response bodies not sent). Per setup and rate: time to first byte and to the last
//! byte, p50 / p99, and CPU-seconds per 1,000 requests of Envoy (its process) and of the
//! processor (this process's CPU less setup A's at the same rate: the client and the
//! upstream run here in every setup). `--observed` adds setup D: kvroute behind the same
//! gateway with its optional response observer turned on (every response chunk copied to
//! kvroute in observability mode, to check cached-token predictions).

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;

use kvroute::app::App;
use kvroute::config::ServeConfig;
use kvroute::extproc::messages;
use kvroute_lab::envoy::{EnvoyProcess, Gateway, envoy_binary};
use kvroute_lab::soak::procstat;
use support::{arg, flag};

const BODY: &str = r#"{"model":"llama","prompt":"Summarise the following text in one sentence: the quick brown fox jumps over the lazy dog.","max_tokens":64}"#;

// ---- the upstream: answers at once ------------------------------------------------

const METRICS: &str = "vllm:num_requests_waiting{engine=\"0\",model_name=\"llama\"} 0.0\n\
vllm:num_requests_running{engine=\"0\",model_name=\"llama\"} 0.0\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"llama\"} 0.1\n\
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"20000\"} 1.0\n";

/// Gap between two streamed tokens of the upstream's answers.
static TOKEN_GAP: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

/// A completion streamed as vLLM does: one server-sent event per token (`max_tokens` of
/// them, `TOKEN_GAP` apart), then `[DONE]`.
fn streamed_completion(tokens: usize) -> axum::response::Response {
    let gap = *TOKEN_GAP.get_or_init(|| Duration::from_millis(5));
    let events = futures::stream::unfold(0usize, move |sent| async move {
        if sent > tokens {
            return None;
        }
        tokio::time::sleep(gap).await;
        let event = if sent == tokens {
            "data: [DONE]\n\n".to_owned()
        } else {
            format!(
                "data: {{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"model\":\"llama\",\"choices\":[{{\"index\":0,\"text\":\" tok{sent}\",\"finish_reason\":null}}]}}\n\n"
            )
        };
        Some((Ok::<_, std::convert::Infallible>(event), sent + 1))
    });
    axum::response::Response::builder()
        .header("content-type", "text/event-stream")
        .body(axum::body::Body::from_stream(events))
        .expect("response")
}

async fn start_upstream() -> SocketAddr {
    use axum::routing::{get, post};
    let router = axum::Router::new()
        .route("/metrics", get(|| async { METRICS }))
        .route(
            "/v1/models",
            get(|| async {
                axum::Json(serde_json::json!({"data": [{"id": "llama", "parent": null}]}))
            }),
        )
        .route(
            "/v1/completions",
            post(|body: String| async move {
                let request: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                if request["stream"].as_bool() == Some(true) {
                    let tokens = request["max_tokens"].as_u64().unwrap_or(16) as usize;
                    return streamed_completion(tokens);
                }
                axum::response::IntoResponse::into_response(axum::Json(serde_json::json!({
                    "choices": [{"text": "ok"}],
                    "usage": {"prompt_tokens": 30, "completion_tokens": 1}
                })))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind upstream");
    let addr = listener.local_addr().expect("addr");
    // As vLLM's server does (asyncio sets TCP_NODELAY): else a token's small write waits
    // for the ACK of the previous one (delayed ACK, 40 ms).
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

// ---- B: the no-op processor ---------------------------------------------------------

struct NoopProcessor {
    destination: String,
}

#[tonic::async_trait]
impl ExternalProcessor for NoopProcessor {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, tonic::Status>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let destination = self.destination.clone();
        tokio::spawn(async move {
            let mut body = Vec::new();
            let mut full_duplex = false;
            while let Ok(Some(message)) = inbound.message().await {
                if let Some(config) = &message.protocol_config {
                    full_duplex =
                        config.request_body_mode == BodySendMode::FullDuplexStreamed as i32;
                }
                // The same answer builders kvroute uses: only the deciding is left out.
                let answers = match message.request {
                    Some(Request::RequestHeaders(h)) if h.end_of_stream => {
                        vec![messages::route_in_headers(&destination, None)]
                    }
                    Some(Request::RequestHeaders(_)) if full_duplex => vec![],
                    Some(Request::RequestHeaders(_)) => vec![messages::continue_request_headers()],
                    Some(Request::RequestBody(b)) if full_duplex => {
                        body.extend_from_slice(&b.body);
                        if b.end_of_stream {
                            vec![
                                messages::route_in_headers(&destination, None),
                                messages::streamed_request_body(std::mem::take(&mut body), true),
                            ]
                        } else {
                            vec![]
                        }
                    }
                    Some(Request::RequestBody(_)) => {
                        vec![messages::route_in_body(&destination, None)]
                    }
                    Some(Request::ResponseHeaders(_)) => {
                        vec![messages::continue_response_headers()]
                    }
                    Some(Request::ResponseBody(b)) => {
                        vec![messages::streamed_response_body(b.body, b.end_of_stream)]
                    }
                    _ => vec![],
                };
                for answer in answers {
                    if tx.send(Ok(answer)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

async fn start_noop(destination: SocketAddr) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind noop");
    let addr = listener.local_addr().expect("addr");
    let service = ExternalProcessorServer::new(NoopProcessor {
        destination: destination.to_string(),
    });
    // The shipped gateway health-checks its picker: the no-op one answers SERVING.
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(
            kvroute::app::EXTPROC_SERVICE,
            tonic_health::ServingStatus::Serving,
        )
        .await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .add_service(service)
            .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true))),
    );
    addr
}

// ---- Envoy --------------------------------------------------------------------------

/// A: plain Envoy to the one pod; B and C: the shipped fail-closed gateway.
async fn start_envoy(pod: SocketAddr, extproc: Option<SocketAddr>) -> EnvoyProcess {
    let gateway = match extproc {
        None => Gateway::RoundRobin,
        Some(kvroute) => Gateway::OriginalDst { kvroute },
    };
    EnvoyProcess::start(gateway, &[pod], &envoy_binary(), "error")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

// ---- measurement --------------------------------------------------------------------

struct Latencies {
    mean: f64,
    p50: f64,
    p99: f64,
}

async fn sequential(envoy: &EnvoyProcess, requests: usize) -> Latencies {
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(1)
        .build()
        .expect("client");
    let url = envoy.url("/v1/completions");
    let send = || {
        client
            .post(&url)
            .header("content-type", "application/json")
            .body(BODY)
            .send()
    };
    for _ in 0..requests / 10 {
        let response = send().await.expect("warm-up request");
        assert!(
            response.status().is_success(),
            "status {}",
            response.status()
        );
        let _ = response.bytes().await;
    }
    let mut samples = Vec::with_capacity(requests);
    for _ in 0..requests {
        let started = Instant::now();
        let response = send().await.expect("request");
        assert!(
            response.status().is_success(),
            "status {}",
            response.status()
        );
        let _ = response.bytes().await.expect("body");
        samples.push(started.elapsed().as_secs_f64() * 1e3);
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    Latencies {
        mean: samples.iter().sum::<f64>() / samples.len() as f64,
        p50: at(0.5),
        p99: at(0.99),
    }
}

async fn throughput(envoy: &EnvoyProcess, connections: usize, per_connection: usize) -> f64 {
    let url = envoy.url("/v1/completions");
    let started = Instant::now();
    let workers: Vec<_> = (0..connections)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let client = reqwest::Client::builder()
                    .no_proxy()
                    .build()
                    .expect("client");
                for _ in 0..per_connection {
                    let response = client
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(BODY)
                        .send()
                        .await
                        .expect("request");
                    let _ = response.bytes().await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("worker");
    }
    (connections * per_connection) as f64 / started.elapsed().as_secs_f64()
}

// ---- the response path at fixed rates ------------------------------------------------

/// What one open-loop run measured.
struct PathRun {
    sent: usize,
    failed: usize,
    /// Milliseconds to the first body chunk (the first token) and to the last byte.
    first: Vec<f64>,
    last: Vec<f64>,
    /// CPU seconds over the run: Envoy's process, and this one (client, upstream and the
    /// in-process processor).
    envoy_cpu: f64,
    own_cpu: f64,
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// One streamed completion: milliseconds to its first chunk and to its end.
async fn stream_one(client: &reqwest::Client, url: &str, body: &str) -> Option<(f64, f64)> {
    let started = Instant::now();
    let mut response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .ok()?;
    if !response.status().is_success() {
        return None;
    }
    let mut first = None;
    while let Some(chunk) = response.chunk().await.ok()? {
        if !chunk.is_empty() && first.is_none() {
            first = Some(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    Some((first?, started.elapsed().as_secs_f64() * 1e3))
}

/// `rate` streaming requests a second for `seconds`, each sent on time whatever the
/// earlier ones are doing (open loop).
async fn open_loop(envoy: &EnvoyProcess, rate: f64, seconds: f64, tokens: usize) -> PathRun {
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let url = envoy.url("/v1/completions");
    let body = format!(
        r#"{{"model":"llama","prompt":"Summarise the following text in one sentence: the quick brown fox jumps over the lazy dog.","max_tokens":{tokens},"stream":true}}"#
    );
    for _ in 0..20 {
        stream_one(&client, &url, &body)
            .await
            .expect("warm-up request");
    }
    let usage = |pid| procstat::usage(pid).map_or(0.0, |(_, cpu)| cpu);
    let (envoy_before, own_before) = (usage(envoy.pid()), usage(std::process::id()));
    let count = (rate * seconds).round() as usize;
    let started = tokio::time::Instant::now();
    let mut requests = Vec::with_capacity(count);
    for i in 0..count {
        tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate)).await;
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        requests.push(tokio::spawn(async move {
            stream_one(&client, &url, &body).await
        }));
    }
    let (mut first, mut last, mut failed) = (Vec::new(), Vec::new(), 0);
    for request in requests {
        match request.await.ok().flatten() {
            Some((to_first, to_last)) => {
                first.push(to_first);
                last.push(to_last);
            }
            None => failed += 1,
        }
    }
    first.sort_by(f64::total_cmp);
    last.sort_by(f64::total_cmp);
    PathRun {
        sent: count,
        failed,
        first,
        last,
        envoy_cpu: usage(envoy.pid()) - envoy_before,
        own_cpu: usage(std::process::id()) - own_before,
    }
}

/// The upstream, the no-op processor and kvroute (scraping the upstream), running here:
/// the upstream's address and the two processors' gRPC addresses.
async fn start_all() -> (SocketAddr, SocketAddr, SocketAddr) {
    let pod = start_upstream().await;
    let noop = start_noop(pod).await;
    let mut config = ServeConfig::local(vec![pod]);
    config.health_addr = None;
    let app = App::bind(config).await.expect("bind kvroute");
    let kvroute_addr = app.addrs().expect("addrs").grpc;
    let store = app.store();
    tokio::spawn(app.run(std::future::pending()));
    assert!(
        kvroute::app::wait_for_snapshot(&store, Duration::from_secs(10), |s| s.has_metrics()).await
    );
    (pod, noop, kvroute_addr)
}

/// Setups A, B and C at each rate, through the fail-closed (or fail-open) gateway.
async fn response_path(
    rates: &[f64],
    seconds: f64,
    tokens: usize,
    fail_open: bool,
    observed: bool,
) {
    let (pod, noop, kvroute_addr) = start_all().await;
    let gateway = |extproc, observer| match (extproc, fail_open, observer) {
        (None, _, _) => Gateway::RoundRobin,
        (Some(kvroute), false, false) => Gateway::OriginalDst { kvroute },
        (Some(kvroute), true, false) => Gateway::OverrideHost { kvroute },
        (Some(kvroute), false, true) => Gateway::OriginalDstObserved { kvroute },
        (Some(kvroute), true, true) => Gateway::OverrideHostObserved { kvroute },
    };
    println!(
        "{} gateway; streamed answers of {tokens} tokens, {} ms apart; {seconds} s per rate",
        if fail_open {
            "fail-open"
        } else {
            "fail-closed"
        },
        TOKEN_GAP
            .get_or_init(|| Duration::from_millis(5))
            .as_millis()
    );
    println!(
        "{:<10} {:>6} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10}",
        "setup",
        "req/s",
        "sent",
        "failed",
        "1st p50",
        "1st p99",
        "end p50",
        "end p99",
        "+1st p50",
        "+1st p99",
        "envoy s/1k",
        "proc s/1k"
    );
    for &rate in rates {
        let mut baseline: Option<PathRun> = None;
        let setups = [
            ("A none", None, false),
            ("B no-op", Some(noop), false),
            ("C kvroute", Some(kvroute_addr), false),
            ("D observed", Some(kvroute_addr), true),
        ];
        let count = if observed { 4 } else { 3 };
        for (name, extproc, observer) in setups.into_iter().take(count) {
            let envoy =
                EnvoyProcess::start(gateway(extproc, observer), &[pod], &envoy_binary(), "error")
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            let run = open_loop(&envoy, rate, seconds, tokens).await;
            let per_1k = |cpu: f64| cpu * 1000.0 / run.sent.max(1) as f64;
            let (added_p50, added_p99, processor_cpu) = match &baseline {
                None => (0.0, 0.0, 0.0),
                Some(a) => (
                    quantile(&run.first, 0.5) - quantile(&a.first, 0.5),
                    quantile(&run.first, 0.99) - quantile(&a.first, 0.99),
                    per_1k(run.own_cpu - a.own_cpu),
                ),
            };
            println!(
                "{name:<10} {rate:>6.0} {:>7} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>10.2} {:>10.3} {:>10.3}",
                run.sent,
                run.failed,
                quantile(&run.first, 0.5),
                quantile(&run.first, 0.99),
                quantile(&run.last, 0.5),
                quantile(&run.last, 0.99),
                added_p50,
                added_p99,
                per_1k(run.envoy_cpu),
                processor_cpu,
            );
            if baseline.is_none() {
                baseline = Some(run);
            }
        }
    }
}

fn main() {
    // `cargo test --benches` runs bench targets in test mode: nothing to measure there.
    if flag("--test") || flag("--list") {
        return;
    }
    let requests: usize = arg("--requests").unwrap_or(2_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if let Some(rates) = arg::<String>("--rates") {
        let rates: Vec<f64> = rates
            .split(',')
            .map(|r| r.trim().parse().expect("--rates: numbers, comma-separated"))
            .collect();
        let gap = Duration::from_millis(arg("--token-ms").unwrap_or(5));
        let _ = TOKEN_GAP.set(gap);
        runtime.block_on(response_path(
            &rates,
            arg("--seconds").unwrap_or(10.0),
            arg("--tokens").unwrap_or(32),
            flag("--fail-open"),
            flag("--observed"),
        ));
        return;
    }
    runtime.block_on(async {
        let (pod, noop, kvroute_addr) = start_all().await;

        let setups: [(&str, Option<SocketAddr>); 3] = [
            ("A  Envoy, no ext_proc", None),
            ("B  Envoy + no-op ext_proc", Some(noop)),
            ("C  Envoy + kvroute", Some(kvroute_addr)),
        ];
        let mut means = Vec::new();
        println!("{requests} sequential requests per setup, one keep-alive connection; 16 connections for throughput");
        println!("{:<28} {:>9} {:>9} {:>9} {:>12}", "setup", "mean ms", "p50 ms", "p99 ms", "req/s (16c)");
        for (name, extproc) in setups {
            let envoy = start_envoy(pod, extproc).await;
            let latencies = sequential(&envoy, requests).await;
            let rate = throughput(&envoy, 16, requests / 16).await;
            println!(
                "{name:<28} {:>9.3} {:>9.3} {:>9.3} {:>12.0}",
                latencies.mean, latencies.p50, latencies.p99, rate
            );
            means.push(latencies.mean);
        }
        let noop_added = means[1] - means[0];
        let kvroute_added = means[2] - means[0];
        println!(
            "added per request: no-op {:.3} ms, kvroute {:.3} ms; ratio {:.2} (target <= 1.15)",
            noop_added,
            kvroute_added,
            kvroute_added / noop_added
        );
    });
}
