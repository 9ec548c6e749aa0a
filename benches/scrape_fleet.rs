//! What watching a large fleet costs kvroute: N pods on loopback, served by one cheap
//! responder process (this one) that answers `/metrics` with real vLLM-shaped text (the
//! simulator's renderer, restricted by `name[]` as vLLM's prometheus_client app does) and
//! `/v1/models` as vLLM does. kvroute runs as its own process (the release binary) and
//! scrapes them all; this measures its CPU, its memory and how old the metrics it routes
//! on are.
//!
//! Run: `cargo bench --bench scrape_fleet -- --pods 1000 --seconds 20`.
//! Targets (scale issue): at 1,000 pods polled every 50 ms, kvroute's CPU ≤ 0.5 core,
//! p99 metrics age ≤ 2× the interval, RSS ≤ 256 MB with the prefix index at its default
//! budget (`--fill-prefix` requests of 16 KiB unique prompts are routed first, through
//! kvroute's ext_proc port, to fill it).
//!
//! Age is read where it is exact: the responder stamps every `/metrics` request it serves,
//! and at random instants of the measured window a pod's age is the time since its last
//! scrape began (what the scheduler sees, less the snapshot's publish delay of ≤ 5 ms).
//! `--whole-page` makes the pods ignore the `name[]` filter (what filtering saves).
//! Extra arguments after `--kvroute-args` go to `kvroute serve`; `--kvroute PATH` measures
//! another kvroute binary (an earlier build, for before-and-after runs).

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use kvroute_lab::soak::procstat;
use kvroute_sim::engine::{Engine, EngineConfig, FinishReason, RequestSpec};
use kvroute_sim::metrics::{RenderContext, render, restrict};
use kvroute_sim::profile::Profile;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;

use support::{Killed, arg, extra_kvroute_args, flag};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const ADAPTERS: [&str; 3] = ["sql-lora", "chat-lora", "code-lora"];

/// The kvroute binary to measure: `--kvroute PATH` (another build, for before and after
/// in the same minutes), else this build's.
fn kvroute_binary() -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--kvroute")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_kvroute").to_owned())
}

/// A busy pod's whole `/metrics` page, from the simulator's renderer: requests running and
/// queued, KV in use, adapters in `vllm:lora_requests_info`, every histogram.
fn full_page() -> String {
    let profile = Profile::by_name("h100-llama3-8b").expect("built-in profile");
    let mut engine = Engine::new(EngineConfig::default(), profile);
    let mut t = Duration::ZERO;
    for i in 0..40u32 {
        let spec = RequestSpec {
            prompt: (0..2000).map(|k| k * 7 + i).collect(),
            adapter: (i % 2 == 1).then(|| ADAPTERS[i as usize % ADAPTERS.len()].to_owned()),
            max_output: 300,
            finish_reason: FinishReason::Length,
            output_seed: u64::from(i),
        };
        engine.add_request(t, spec);
        t += Duration::from_millis(25);
    }
    engine.advance(t + Duration::from_millis(500));
    render(
        &engine,
        RenderContext {
            model: MODEL,
            epoch_unix: 1.7e9,
        },
    )
}

fn models_json() -> String {
    let card = |id: &str, parent: Option<&str>| {
        serde_json::json!({
            "id": id, "object": "model", "created": 1_700_000_000, "owned_by": "vllm",
            "root": parent.map_or_else(|| id.to_owned(), |_| format!("/adapters/{id}")),
            "parent": parent, "max_model_len": 131_072,
            "permission": [{"id": format!("modelperm-{id}"), "object": "model_permission",
                "created": 1_700_000_000, "allow_create_engine": false, "allow_sampling": true,
                "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                "allow_fine_tuning": false, "organization": "*", "group": null,
                "is_blocking": false}],
        })
    };
    let mut data = vec![card(MODEL, None)];
    data.extend(ADAPTERS.iter().map(|a| card(a, Some(MODEL))));
    serde_json::json!({"object": "list", "data": data}).to_string()
}

/// Decodes `%XX` escapes (the query kvroute sends is plain ASCII).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(byte) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(byte);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).expect("ASCII query")
}

/// Every pod's answers, built once; and when each pod's `/metrics` was asked for.
struct Responder {
    full: String,
    /// Restricted pages by query string (kvroute always sends the same one).
    restricted: Mutex<HashMap<String, Arc<Vec<u8>>>>,
    models: Vec<u8>,
    scrapes: Vec<Mutex<Vec<Instant>>>,
    bytes_served: AtomicU64,
    /// Ignore `name[]` and send the whole page, as a server without the filter would.
    whole_page: bool,
}

impl Responder {
    fn metrics_body(&self, query: Option<&str>) -> Arc<Vec<u8>> {
        let query = query.unwrap_or_default();
        let mut cache = self.restricted.lock().unwrap();
        Arc::clone(cache.entry(query.to_owned()).or_insert_with(|| {
            let names: Vec<String> = query
                .split('&')
                .filter_map(|pair| pair.split_once('='))
                .filter(|(key, _)| percent_decode(key) == "name[]")
                .map(|(_, value)| percent_decode(value))
                .collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let text = if names.is_empty() {
                self.full.clone()
            } else {
                restrict(&self.full, &names)
            };
            Arc::new(text.into_bytes())
        }))
    }

    /// Serves one keep-alive HTTP/1.1 connection of GETs.
    async fn serve(self: Arc<Self>, pod: usize, mut socket: TcpStream) {
        let _ = socket.set_nodelay(true);
        let mut buffer = Vec::with_capacity(2048);
        let mut chunk = [0u8; 2048];
        loop {
            let head_end = loop {
                if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                    break end + 4;
                }
                match socket.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                }
            };
            let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
            buffer.drain(..head_end);
            let target = head.split(' ').nth(1).unwrap_or("/");
            let (path, query) = match target.split_once('?') {
                Some((path, query)) => (path, Some(query)),
                None => (target, None),
            };
            let (content_type, body): (&str, Arc<Vec<u8>>) = match path {
                "/metrics" => {
                    self.scrapes[pod].lock().unwrap().push(Instant::now());
                    let query = if self.whole_page { None } else { query };
                    (
                        "text/plain; version=0.0.4; charset=utf-8",
                        self.metrics_body(query),
                    )
                }
                "/v1/models" => ("application/json", Arc::new(self.models.clone())),
                _ => ("application/json", Arc::new(b"{}".to_vec())),
            };
            let mut answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            answer.extend_from_slice(&body);
            self.bytes_served
                .fetch_add(answer.len() as u64, Ordering::Relaxed);
            if socket.write_all(&answer).await.is_err() {
                return;
            }
        }
    }
}

/// The prompt of fill request `i`: about 16 KiB of words no other request shares.
fn unique_prompt(i: u64) -> String {
    let mut rng = SmallRng::seed_from_u64(i);
    let mut prompt = format!("request {i}:");
    while prompt.len() < 16 * 1024 {
        prompt.push(' ');
        let word: u32 = rng.random_range(0..50_000);
        prompt.push_str(&format!("w{word}"));
    }
    prompt
}

fn header_pairs(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    }
}

/// Routes one completion through kvroute's ext_proc port, as Envoy would in buffered mode;
/// returns whether kvroute answered the body (the routing decision).
async fn route_one(channel: tonic::transport::Channel, prompt: String) -> bool {
    let mut client = ExternalProcessorClient::new(channel);
    let (send, receive) = tokio::sync::mpsc::channel(4);
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 16});
    send.send(ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: BodySendMode::None as i32,
            ..ProtocolConfiguration::default()
        }),
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(header_pairs(&[
                (":method", "POST"),
                (":path", "/v1/completions"),
                ("content-type", "application/json"),
            ])),
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    })
    .await
    .expect("queue headers");
    send.send(ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: body.to_string().into_bytes(),
            end_of_stream: true,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    })
    .await
    .expect("queue body");
    let Ok(answers) = client.process(ReceiverStream::new(receive)).await else {
        return false;
    };
    let mut answers = answers.into_inner();
    while let Ok(Some(answer)) = answers.message().await {
        if matches!(answer.response, Some(Response::RequestBody(_))) {
            return true;
        }
    }
    false
}

/// Sums the samples of `name` (any labels) in kvroute's own `/metrics`.
async fn kvroute_metric(metrics: SocketAddr, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[tokio::main]
async fn main() {
    let pods: usize = arg("--pods").unwrap_or(1000);
    let interval_ms: u64 = arg("--interval-ms").unwrap_or(50);
    let seconds: u64 = arg("--seconds").unwrap_or(20);
    let fill: u64 = arg("--fill-prefix").unwrap_or(20_000);

    let full = full_page();
    let responder = Arc::new(Responder {
        restricted: Mutex::new(HashMap::new()),
        models: models_json().into_bytes(),
        scrapes: (0..pods).map(|_| Mutex::new(Vec::new())).collect(),
        bytes_served: AtomicU64::new(0),
        whole_page: flag("--whole-page"),
        full,
    });
    let mut endpoints = Vec::with_capacity(pods);
    for pod in 0..pods {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a pod");
        endpoints.push(listener.local_addr().expect("address"));
        let responder = Arc::clone(&responder);
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(Arc::clone(&responder).serve(pod, socket));
            }
        });
    }
    println!(
        "{pods} pods on loopback; /metrics page {} B whole, {} B as kvroute asks for it",
        responder.full.len(),
        responder
            .metrics_body(Some(&kvroute_core::vllm::metrics_query()))
            .len()
    );

    let port = || kvroute_lab::envoy::free_port().expect("port");
    let grpc = SocketAddr::from(([127, 0, 0, 1], port()));
    let metrics = SocketAddr::from(([127, 0, 0, 1], port()));
    let list: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
    let child = Command::new(kvroute_binary())
        .arg("serve")
        .args(["--endpoints", &list.join(",")])
        .args(["--grpc-addr", &grpc.to_string()])
        .args([
            "--metrics-addr",
            &metrics.to_string(),
            "--debug-addr",
            "off",
        ])
        .args(["--health-addr", "off", "--admin-addr", "off"])
        .args(["--refresh-metrics-interval", &format!("{interval_ms}ms")])
        .args(extra_kvroute_args())
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start kvroute");
    let kvroute = Killed(child);
    let pid = kvroute.0.id();

    // Ready: every pod scraped a few times (healthy) and its models listed.
    let started = Instant::now();
    loop {
        let slowest = responder
            .scrapes
            .iter()
            .map(|s| s.lock().unwrap().len())
            .min()
            .unwrap_or(0);
        if slowest >= 5 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "kvroute did not scrape every pod within 2 minutes (slowest: {slowest} scrapes)"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "every pod scraped 5 times after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    if fill > 0 {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect to kvroute");
        let filling = Instant::now();
        let next = Arc::new(AtomicU64::new(0));
        let routed = Arc::new(AtomicU64::new(0));
        let workers: Vec<_> = (0..16)
            .map(|_| {
                let (channel, next, routed) =
                    (channel.clone(), Arc::clone(&next), Arc::clone(&routed));
                tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= fill {
                            break;
                        }
                        if route_one(channel.clone(), unique_prompt(i)).await {
                            routed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.await.expect("fill worker");
        }
        println!(
            "filled the prefix index: {} of {fill} requests of 16 KiB routed in {:.1} s; \
             index {:.0} of {:.0} entries",
            routed.load(Ordering::Relaxed),
            filling.elapsed().as_secs_f64(),
            kvroute_metric(metrics, "kvroute_prefix_index_entries").await,
            kvroute_metric(metrics, "kvroute_prefix_index_capacity_entries").await,
        );
    }

    // The measured window: kvroute only scrapes (and publishes snapshots).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let errors_before = kvroute_metric(metrics, "kvroute_scrape_errors_total").await;
    let (_, cpu_before) = procstat::usage(pid).expect("kvroute's /proc");
    let (_, own_before) = procstat::usage(std::process::id()).expect("own /proc");
    let bytes_before = responder.bytes_served.load(Ordering::Relaxed);
    let window_start = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let window_end = Instant::now();
    let (rss, cpu_after) = procstat::usage(pid).expect("kvroute's /proc");
    let (_, own_after) = procstat::usage(std::process::id()).expect("own /proc");
    let bytes = responder.bytes_served.load(Ordering::Relaxed) - bytes_before;
    let errors = kvroute_metric(metrics, "kvroute_scrape_errors_total").await - errors_before;
    let wall = (window_end - window_start).as_secs_f64();

    let mut rng = SmallRng::seed_from_u64(7);
    let (mut ages, mut gaps) = (Vec::new(), Vec::new());
    let mut scrapes_in_window = 0usize;
    for times in &responder.scrapes {
        let times = times.lock().unwrap();
        let in_window = times
            .iter()
            .filter(|t| **t >= window_start && **t <= window_end)
            .count();
        scrapes_in_window += in_window;
        for pair in times.windows(2) {
            if pair[1] >= window_start && pair[1] <= window_end {
                gaps.push((pair[1] - pair[0]).as_secs_f64() * 1000.0);
            }
        }
        for _ in 0..100 {
            let at = window_start + Duration::from_secs_f64(rng.random_range(0.0..wall));
            let last = times.iter().rev().find(|t| **t <= at);
            // A pod never scraped before `at` is as old as the window so far.
            let age = last.map_or(at - window_start, |t| at - *t);
            ages.push(age.as_secs_f64() * 1000.0);
        }
    }
    ages.sort_by(f64::total_cmp);
    gaps.sort_by(f64::total_cmp);
    let scrapes_per_s = scrapes_in_window as f64 / wall;
    println!(
        "kvroute over {wall:.1} s: CPU {:.3} cores; RSS {:.1} MiB; {scrapes_per_s:.0} scrapes/s \
         (wanted {:.0}); {:.1} MB/s of /metrics text; {errors:.0} scrape errors",
        (cpu_after - cpu_before) / wall,
        rss as f64 / (1024.0 * 1024.0),
        pods as f64 * 1000.0 / interval_ms as f64,
        bytes as f64 / wall / 1e6,
    );
    println!(
        "metrics age at random instants (ms): p50 {:.1}, p90 {:.1}, p99 {:.1}, max {:.1} \
         (interval {interval_ms} ms)",
        quantile(&ages, 0.5),
        quantile(&ages, 0.9),
        quantile(&ages, 0.99),
        ages.last().copied().unwrap_or(f64::NAN),
    );
    println!(
        "gap between a pod's scrapes (ms): p50 {:.1}, p99 {:.1}, max {:.1}",
        quantile(&gaps, 0.5),
        quantile(&gaps, 0.99),
        gaps.last().copied().unwrap_or(f64::NAN),
    );
    println!(
        "kvroute's allocator: {:.1} MiB allocated, {:.1} MiB resident",
        kvroute_metric(metrics, "kvroute_memory_allocated_bytes").await / 1048576.0,
        kvroute_metric(metrics, "kvroute_memory_resident_bytes").await / 1048576.0,
    );
    println!(
        "the responder (this process) used {:.3} cores",
        (own_after - own_before) / wall
    );
}
