//! Test rig shared by the black-box tests: small fake vLLM pods whose `/metrics` the
//! test controls, an in-process kvroute on ephemeral ports, and a real Envoy.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::sync::{oneshot, watch};

use kvroute::app::{App, BoundAddrs};
use kvroute::config::ServeConfig;
use kvroute::store::PodStore;
use kvroute_core::fleet::Snapshot;
use kvroute_lab::envoy::EnvoyProcess;

/// What a fake pod reports at `/metrics`, rendered in vLLM's exposition format.
#[derive(Debug, Clone)]
pub struct FakeMetrics {
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f64,
    pub num_gpu_blocks: u64,
    pub block_size: u32,
    pub max_lora: u32,
    pub running_adapters: Vec<String>,
    pub waiting_adapters: Vec<String>,
}

impl Default for FakeMetrics {
    fn default() -> Self {
        FakeMetrics {
            waiting: 0,
            running: 0,
            kv_usage: 0.1,
            num_gpu_blocks: 1_000,
            block_size: 16,
            max_lora: 2,
            running_adapters: Vec::new(),
            waiting_adapters: Vec::new(),
        }
    }
}

impl FakeMetrics {
    pub fn render(&self, model: &str) -> String {
        format!(
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{engine=\"0\",model_name=\"{model}\"}} {waiting}.0\n\
             # HELP vllm:num_requests_running Number of requests in model execution batches.\n\
             # TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{{engine=\"0\",model_name=\"{model}\"}} {running}.0\n\
             # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
             # TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"{model}\"}} {kv}\n\
             # HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
             # TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"{block}\",cache_dtype=\"auto\",engine=\"0\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{blocks}\"}} 1.0\n\
             # HELP vllm:lora_requests_info Running stats on lora requests.\n\
             # TYPE vllm:lora_requests_info gauge\n\
             vllm:lora_requests_info{{max_lora=\"{max_lora}\",running_lora_adapters=\"{running_adapters}\",waiting_lora_adapters=\"{waiting_adapters}\"}} 1.7e+09\n",
            waiting = self.waiting,
            running = self.running,
            kv = self.kv_usage,
            block = self.block_size,
            blocks = self.num_gpu_blocks,
            max_lora = self.max_lora,
            running_adapters = self.running_adapters.join(","),
            waiting_adapters = self.waiting_adapters.join(","),
        )
    }
}

struct PodState {
    name: String,
    model: String,
    adapters: Vec<String>,
    metrics: Mutex<FakeMetrics>,
    /// Completions answered (or arrived, while held).
    arrivals: watch::Sender<usize>,
    /// While true, completions wait before answering.
    hold: watch::Sender<bool>,
    /// While true, streamed completions send their headers and first event, then wait
    /// before the rest: a response that is still streaming.
    hold_stream: watch::Sender<bool>,
    /// Headers of the last completion request.
    last_headers: Mutex<Option<HeaderMap>>,
    /// When set, `/metrics` answers with this body instead (e.g. a lying page).
    metrics_override: Mutex<Option<(StatusCode, String)>>,
    /// While true, `/metrics` never answers.
    metrics_hang: watch::Sender<bool>,
    /// The query string of the last `/metrics` request.
    last_metrics_query: Mutex<Option<String>>,
    /// When set, `/v1/models` answers 401 to requests without `Authorization: Bearer <key>`,
    /// as vLLM started with `--api-key` does.
    api_key: Mutex<Option<String>>,
}

/// A minimal vLLM look-alike: `/metrics`, `/v1/models`, `/v1/completions`,
/// `/v1/chat/completions`. Every answer carries `x-pod: <name>`.
pub struct FakePod {
    pub addr: SocketAddr,
    state: Arc<PodState>,
    stop: Option<oneshot::Sender<()>>,
}

impl FakePod {
    pub async fn start(name: &str, model: &str, adapters: &[&str]) -> FakePod {
        let state = Arc::new(PodState {
            name: name.to_owned(),
            model: model.to_owned(),
            adapters: adapters.iter().map(|a| (*a).to_owned()).collect(),
            metrics: Mutex::new(FakeMetrics::default()),
            arrivals: watch::Sender::new(0),
            hold: watch::Sender::new(false),
            hold_stream: watch::Sender::new(false),
            last_headers: Mutex::new(None),
            metrics_override: Mutex::new(None),
            metrics_hang: watch::Sender::new(false),
            last_metrics_query: Mutex::new(None),
            api_key: Mutex::new(None),
        });
        let router = axum::Router::new()
            .route("/metrics", get(metrics))
            .route("/v1/models", get(models))
            .route("/v1/completions", post(completion))
            .route("/v1/chat/completions", post(completion))
            .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
            .with_state(Arc::clone(&state));
        let (addr, stop) = serve_on_loopback(router).await;
        FakePod {
            addr,
            state,
            stop: Some(stop),
        }
    }

    pub fn name(&self) -> &str {
        &self.state.name
    }

    pub fn set_metrics(&self, metrics: FakeMetrics) {
        *self.state.metrics.lock().expect("lock") = metrics;
    }

    /// Makes `/metrics` answer `status` with `body` until cleared with `None`.
    pub fn override_metrics(&self, answer: Option<(u16, &str)>) {
        *self.state.metrics_override.lock().expect("lock") = answer.map(|(status, body)| {
            (
                StatusCode::from_u16(status).expect("status"),
                body.to_owned(),
            )
        });
    }

    /// Makes `/metrics` hang (never answer) while `hang` is true.
    pub fn hang_metrics(&self, hang: bool) {
        self.state.metrics_hang.send_replace(hang);
    }

    /// Makes `/v1/models` require `key` (vLLM's `--api-key`), or not.
    pub fn require_api_key(&self, key: Option<&str>) {
        *self.state.api_key.lock().expect("lock") = key.map(str::to_owned);
    }

    pub fn metrics(&self) -> FakeMetrics {
        self.state.metrics.lock().expect("lock").clone()
    }

    /// Completions that reached this pod.
    pub fn arrivals(&self) -> usize {
        *self.state.arrivals.borrow()
    }

    pub fn subscribe_arrivals(&self) -> watch::Receiver<usize> {
        self.state.arrivals.subscribe()
    }

    /// Makes completions wait until [`FakePod::release`].
    pub fn hold(&self) {
        self.state.hold.send_replace(true);
    }

    pub fn release(&self) {
        self.state.hold.send_replace(false);
    }

    /// Makes streamed completions stop after their first event until
    /// [`FakePod::release_stream`].
    pub fn hold_stream(&self) {
        self.state.hold_stream.send_replace(true);
    }

    pub fn release_stream(&self) {
        self.state.hold_stream.send_replace(false);
    }

    /// The query string kvroute's last scrape of `/metrics` carried.
    pub fn last_metrics_query(&self) -> Option<String> {
        self.state.last_metrics_query.lock().expect("lock").clone()
    }

    pub fn last_headers(&self) -> Option<HeaderMap> {
        self.state.last_headers.lock().expect("lock").clone()
    }

    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl Drop for FakePod {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn metrics(
    State(pod): State<Arc<PodState>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    *pod.last_metrics_query.lock().expect("lock") = query;
    let mut hang = pod.metrics_hang.subscribe();
    let _ = hang.wait_for(|hang| !*hang).await;
    if let Some((status, body)) = pod.metrics_override.lock().expect("lock").clone() {
        return (status, body).into_response();
    }
    let metrics = pod.metrics.lock().expect("lock").clone();
    metrics.render(&pod.model).into_response()
}

async fn models(State(pod): State<Arc<PodState>>, headers: HeaderMap) -> Response {
    let required = pod.api_key.lock().expect("lock").clone();
    if let Some(key) = required {
        let expected = format!("Bearer {key}");
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if given != Some(expected.as_str()) {
            let error = serde_json::json!({"error": "Unauthorized"});
            return (StatusCode::UNAUTHORIZED, Json(error)).into_response();
        }
    }
    let mut data = vec![serde_json::json!({"id": pod.model, "object": "model", "parent": null})];
    for adapter in &pod.adapters {
        data.push(serde_json::json!({"id": adapter, "object": "model", "parent": pod.model}));
    }
    Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

async fn completion(State(pod): State<Arc<PodState>>, headers: HeaderMap, body: Bytes) -> Response {
    *pod.last_headers.lock().expect("lock") = Some(headers);
    pod.arrivals.send_modify(|n| *n += 1);
    let mut hold = pod.hold.subscribe();
    let _ = hold.wait_for(|held| !*held).await;
    let request: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(error) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("pod got invalid JSON: {error}"),
            )
                .into_response();
        }
    };
    let model = request["model"].as_str().unwrap_or_default().to_owned();
    let pod_header = [("x-pod", pod.name.clone())];
    if request["stream"].as_bool() == Some(true) {
        let mut events = Vec::new();
        for word in ["streamed", " from ", pod.name.as_str()] {
            let chunk = serde_json::json!({"object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": word}]});
            events.push(format!("data: {chunk}\n\n"));
        }
        let usage = serde_json::json!({"object": "text_completion", "model": model, "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}});
        events.push(format!("data: {usage}\n\ndata: [DONE]\n\n"));
        let gate = pod.hold_stream.subscribe();
        let sse = futures::stream::unfold((events.into_iter(), gate, true), |state| async move {
            let (mut events, mut gate, first) = state;
            let event = events.next()?;
            if !first {
                let _ = gate.wait_for(|held| !*held).await;
            }
            Some((
                Ok::<_, std::convert::Infallible>(event),
                (events, gate, false),
            ))
        });
        let sse = axum::body::Body::from_stream(sse);
        return (
            pod_header,
            [(header::CONTENT_TYPE, "text/event-stream")],
            sse,
        )
            .into_response();
    }
    let answer = serde_json::json!({
        "object": "text_completion", "model": model, "pod": pod.name,
        "prompt_bytes": body.len(),
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    });
    (pod_header, Json(answer)).into_response()
}

/// Serves `router` on an ephemeral loopback port until the returned sender is used or
/// dropped.
pub async fn serve_on_loopback(router: axum::Router) -> (SocketAddr, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
    });
    (addr, stop)
}

/// `envoy --mode validate` with these arguments passes.
pub fn envoy_validate(args: &[String]) {
    let output = std::process::Command::new(envoy_binary())
        .arg("--mode")
        .arg("validate")
        .args(args)
        .arg("--disable-hot-restart")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", envoy_binary().display()));
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "envoy {args:?} is invalid:\n{text}"
    );
    assert!(text.contains("OK"), "{text}");
}

/// `envoy --mode validate -c path` passes.
pub fn envoy_validate_file(path: &std::path::Path) {
    envoy_validate(&["--config-path".to_owned(), path.display().to_string()]);
}

/// kvroute running in this process.
pub struct Kvroute {
    pub addrs: BoundAddrs,
    pub store: Arc<PodStore>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Kvroute {
    pub async fn start(config: ServeConfig) -> Kvroute {
        let app = App::bind(config).await.expect("bind kvroute");
        let addrs = app.addrs().expect("addrs");
        let store = app.store();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(app.run(async {
            let _ = stopped.await;
        }));
        Kvroute {
            addrs,
            store,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Waits until a published snapshot satisfies `ready` (fails the test after 10 s).
    pub async fn wait_for(&self, what: &str, ready: impl Fn(&Snapshot) -> bool) {
        let ok = kvroute::app::wait_for_snapshot(&self.store, Duration::from_secs(10), ready).await;
        assert!(ok, "timed out waiting for: {what}");
    }

    /// Waits until every pod is healthy with metrics and models.
    pub async fn wait_until_scraped(&self, pods: usize) {
        self.wait_for("all pods scraped", |s| {
            s.pods().len() == pods
                && s.pods()
                    .iter()
                    .all(|p| p.healthy && p.metrics().is_some() && p.models.is_some())
        })
        .await;
    }

    /// Waits until every pod is scraped and the snapshot shows what each reports now.
    pub async fn wait_until_current(&self, pods: &[FakePod]) {
        self.wait_until_scraped(pods.len()).await;
        for pod in pods {
            let metrics = pod.metrics();
            self.wait_for_pod(pod.addr, metrics.kv_usage, metrics.waiting)
                .await;
        }
    }

    /// Waits until the pod at `addr` reports `kv_usage` and `waiting` as given.
    pub async fn wait_for_pod(&self, addr: SocketAddr, kv_usage: f64, waiting: u32) {
        self.wait_for("pod metrics to update", move |s| {
            s.pod(addr)
                .and_then(|p| p.metrics())
                .is_some_and(|m| (m.kv_usage - kv_usage).abs() < 1e-9 && m.waiting == waiting)
        })
        .await;
    }

    /// kvroute's own `/metrics` exposition.
    pub async fn metrics_text(&self) -> String {
        http_client()
            .get(format!("http://{}/metrics", self.addrs.metrics))
            .send()
            .await
            .expect("GET kvroute /metrics")
            .text()
            .await
            .expect("kvroute /metrics body")
    }

    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
        }
    }
}

impl Drop for Kvroute {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// kvroute with `config` in front of `pods`, scraped up to date, behind a real Envoy.
pub async fn behind_envoy(
    pods: &[FakePod],
    config: ServeConfig,
    gateway: Gateway,
) -> (Kvroute, Envoy) {
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_current(pods).await;
    let endpoints: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
    let envoy = Envoy::start(gateway, kvroute.addrs.grpc, &endpoints).await;
    (kvroute, envoy)
}

/// kvroute configured for tests: loopback ephemeral ports, quick scrapes.
/// A series' value in an exposition (`name` with its labels, if any); 0 when absent.
pub fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Waits until `name` reaches `at_least` in kvroute's exposition; returns the exposition
/// as it was then.
pub async fn wait_for_metric(kvroute: &Kvroute, name: &str, at_least: f64) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = kvroute.metrics_text().await;
        if metric_value(&text, name) >= at_least {
            return text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {name} >= {at_least}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// kvroute's decision log (`/debug/decisions`) at its debug address.
pub async fn decision_log(debug: SocketAddr) -> serde_json::Value {
    http_client()
        .get(format!("http://{debug}/debug/decisions"))
        .send()
        .await
        .expect("debug pages answer")
        .json()
        .await
        .expect("JSON")
}

pub fn test_config(endpoints: Vec<SocketAddr>) -> ServeConfig {
    let mut config = ServeConfig::local(endpoints);
    config.scrape.interval = Duration::from_millis(20);
    config.drain_timeout = Duration::from_millis(200);
    config
}

pub fn project_file(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// The Envoy binary: `$ENVOY_BIN`, else the project's `.venv/bin/envoy`.
pub fn envoy_binary() -> PathBuf {
    std::env::var_os("ENVOY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| project_file(".venv/bin/envoy"))
}

/// Which shipped Envoy configuration to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gateway {
    OriginalDst,
    OverrideHost,
    /// The fail-closed config with another `request_body_mode`.
    OriginalDstWithRequestBodyMode(&'static str),
    /// The fail-closed config reaching kvroute over mutual TLS, with the certificates in
    /// this directory (see `kvroute_lab::envoy::Gateway::OriginalDstOverTls`).
    OriginalDstOverTls(&'static str),
    /// The fail-closed config reaching HTTPS pods, trusting the CA bundle at this path.
    OriginalDstToHttpsPods(&'static str),
    /// The fail-closed config with its response observer turned on.
    OriginalDstObserved,
    /// The fail-open config with its response observer turned on.
    OverrideHostObserved,
}

/// A real Envoy running a shipped config, rewritten for this test's ports.
pub struct Envoy(EnvoyProcess);

/// Sends a streamed completion of `model` through `envoy` and reads its first
/// server-sent event; the response is returned for the rest of the stream.
pub async fn stream_to_first_event(
    client: &reqwest::Client,
    envoy: &Envoy,
    model: &str,
) -> reqwest::Response {
    let mut response = client
        .post(envoy.url("/v1/completions"))
        .json(&serde_json::json!({"model": model, "prompt": "hello", "max_tokens": 8, "stream": true}))
        .send()
        .await
        .expect("request through Envoy");
    assert_eq!(response.status(), 200);
    let first = response
        .chunk()
        .await
        .expect("first event")
        .expect("a chunk");
    assert!(first.starts_with(b"data: "), "first SSE event arrived");
    response
}

impl Envoy {
    /// Starts Envoy and waits until it is ready. Call it from the test's own thread:
    /// Envoy exits when the thread that started it does.
    pub async fn start(gateway: Gateway, kvroute: SocketAddr, pods: &[SocketAddr]) -> Envoy {
        let gateway = match gateway {
            Gateway::OriginalDst => kvroute_lab::envoy::Gateway::OriginalDst { kvroute },
            Gateway::OverrideHost => kvroute_lab::envoy::Gateway::OverrideHost { kvroute },
            Gateway::OriginalDstWithRequestBodyMode(mode) => {
                kvroute_lab::envoy::Gateway::OriginalDstWithRequestBodyMode { kvroute, mode }
            }
            Gateway::OriginalDstOverTls(certs) => {
                kvroute_lab::envoy::Gateway::OriginalDstOverTls { kvroute, certs }
            }
            Gateway::OriginalDstToHttpsPods(pod_ca) => {
                kvroute_lab::envoy::Gateway::OriginalDstToHttpsPods { kvroute, pod_ca }
            }
            Gateway::OriginalDstObserved => {
                kvroute_lab::envoy::Gateway::OriginalDstObserved { kvroute }
            }
            Gateway::OverrideHostObserved => {
                kvroute_lab::envoy::Gateway::OverrideHostObserved { kvroute }
            }
        };
        let level = std::env::var("ENVOY_LOG_LEVEL").unwrap_or_else(|_| "warning".into());
        let process = EnvoyProcess::start(gateway, pods, &envoy_binary(), &level)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        Envoy(process)
    }

    pub fn url(&self, path: &str) -> String {
        self.0.url(path)
    }

    pub fn log(&self) -> String {
        self.0.log()
    }
}

pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client")
}

/// POSTs a completion through Envoy; returns status, the serving pod (x-pod) and body.
pub async fn complete(
    client: &reqwest::Client,
    envoy: &Envoy,
    body: serde_json::Value,
) -> (u16, Option<String>, String) {
    let response = client
        .post(envoy.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("request through Envoy");
    let status = response.status().as_u16();
    let pod = response
        .headers()
        .get("x-pod")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let text = response.text().await.expect("body");
    (status, pod, text)
}
