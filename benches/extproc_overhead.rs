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

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

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

const BODY: &str = r#"{"model":"llama","prompt":"Summarise the following text in one sentence: the quick brown fox jumps over the lazy dog.","max_tokens":64}"#;

// ---- the upstream: answers at once ------------------------------------------------

const METRICS: &str = "vllm:num_requests_waiting{engine=\"0\",model_name=\"llama\"} 0.0\n\
vllm:num_requests_running{engine=\"0\",model_name=\"llama\"} 0.0\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"llama\"} 0.1\n\
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"20000\"} 1.0\n";

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
            post(|| async {
                axum::Json(serde_json::json!({"choices": [{"text": "ok"}],
                    "usage": {"prompt_tokens": 30, "completion_tokens": 1}}))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind upstream");
    let addr = listener.local_addr().expect("addr");
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
                        vec![messages::route_in_headers(&destination)]
                    }
                    Some(Request::RequestHeaders(_)) if full_duplex => vec![],
                    Some(Request::RequestHeaders(_)) => vec![messages::continue_request_headers()],
                    Some(Request::RequestBody(b)) if full_duplex => {
                        body.extend_from_slice(&b.body);
                        if b.end_of_stream {
                            vec![
                                messages::route_in_headers(&destination),
                                messages::streamed_request_body(std::mem::take(&mut body), true),
                            ]
                        } else {
                            vec![]
                        }
                    }
                    Some(Request::RequestBody(_)) => vec![messages::route_in_body(&destination)],
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

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo test --benches` runs bench targets in test mode: nothing to measure there.
    if args.iter().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let requests = args
        .windows(2)
        .find(|w| w[0] == "--requests")
        .and_then(|w| w[1].parse().ok())
        .unwrap_or(2_000usize);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let pod = start_upstream().await;
        let noop = start_noop(pod).await;
        let mut config = ServeConfig::local(vec![pod]);
        config.health_addr = None;
        let app = App::bind(config).await.expect("bind kvroute");
        let kvroute_addr = app.addrs().expect("addrs").grpc;
        let store = app.store();
        tokio::spawn(app.run(std::future::pending()));
        assert!(kvroute::app::wait_for_snapshot(&store, Duration::from_secs(10), |s| s.has_metrics()).await);

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
