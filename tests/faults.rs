//! Faults through a real Envoy running the shipped gateways: a picker that freezes
//! (SIGSTOP), dies (SIGKILL) and comes back; a pod that dies under traffic; clients that
//! try to reach a pod's management API or pick a pod themselves. Every client gets an
//! answer (a status and an OpenAI-style JSON error) and nothing hangs.
//!
//! The time a client waits is measured here but not asserted beyond the client's own
//! timeout (10 s, against 330 s before the gateways bounded it): the bound itself is
//! a property of the Envoy configuration, documented in docs/reliability.md.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use support::{Envoy, FakePod, Gateway, Kvroute, behind_envoy, stream_to_first_event, test_config};

const MODEL: &str = "llama";

/// A client that gives up well before Envoy's stream idle timeout (300 s): a request
/// that times out here is one the gateway left hanging.
fn impatient_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client")
}

/// One completion through the gateway: status, body (parsed when JSON), `retry-after`,
/// and how long it took.
struct Answer {
    status: u16,
    body: serde_json::Value,
    retry_after: Option<String>,
    pod: Option<String>,
    took: Duration,
}

impl Answer {
    fn error_code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or_default()
    }
}

async fn send(client: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> Answer {
    let started = Instant::now();
    let mut request = client
        .post(url)
        .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 4}));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("no answer from the gateway within the client's timeout: {e}"));
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (retry_after, pod) = (header("retry-after"), header("x-pod"));
    let text = response.text().await.expect("body");
    Answer {
        status,
        body: serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        retry_after,
        pod,
        took: started.elapsed(),
    }
}

async fn complete(client: &reqwest::Client, envoy: &Envoy) -> Answer {
    send(client, &envoy.url("/v1/completions"), &[]).await
}

/// Sends until a request is served (the gateway's health check has seen kvroute back),
/// at most `limit`. Envoy is another process: there is no event to await.
async fn until_served(client: &reqwest::Client, envoy: &Envoy, limit: Duration) -> Answer {
    let deadline = Instant::now() + limit;
    loop {
        let answer = complete(client, envoy).await;
        if answer.status == 200 || Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The kvroute binary as a child process, so it can be frozen and killed.
struct PickerProcess {
    child: Option<Child>,
    grpc: SocketAddr,
    pods: Vec<SocketAddr>,
}

impl PickerProcess {
    /// Starts kvroute on `grpc` for `pods` and waits until it has scraped one.
    fn start(grpc: SocketAddr, pods: &[SocketAddr]) -> PickerProcess {
        let mut picker = PickerProcess {
            child: None,
            grpc,
            pods: pods.to_vec(),
        };
        picker.restart();
        picker
    }

    fn restart(&mut self) {
        let endpoints: Vec<String> = self.pods.iter().map(ToString::to_string).collect();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--endpoints", &endpoints.join(",")])
            .args(["--grpc-addr", &self.grpc.to_string()])
            .args(["--metrics-addr", "127.0.0.1:0", "--debug-addr", "off"])
            .args(["--health-addr", "off", "--admin-addr", "off"])
            .args([
                "--refresh-metrics-interval",
                "20ms",
                "--drain-timeout",
                "1s",
            ])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kvroute");
        let stderr = child.stderr.take().expect("stderr");
        // The log says when the first scrape made it ready; keep draining it afterwards
        // so the child never blocks on a full pipe.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut ready_tx = Some(ready_tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("ready: endpoint metrics available")
                    && let Some(tx) = ready_tx.take()
                {
                    let _ = tx.send(());
                }
            }
        });
        self.child = Some(child);
        ready_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("kvroute became ready");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// Whether it has exited (reaped if so).
    fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|child| child.try_wait().ok().flatten().is_some())
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PickerProcess {
    fn drop(&mut self) {
        if !self.exited() {
            // A frozen child must be thawed to die cleanly.
            self.signal("CONT");
        }
        self.kill();
    }
}

fn loopback_port() -> SocketAddr {
    let port = kvroute_lab::envoy::free_port().expect("free port");
    SocketAddr::from(([127, 0, 0, 1], port))
}

async fn two_pods() -> [FakePod; 2] {
    [
        FakePod::start("pod-a", MODEL, &[]).await,
        FakePod::start("pod-b", MODEL, &[]).await,
    ]
}

/// Two pods, kvroute as a process, `gateway` in front, one request served.
async fn picker_process_behind(
    gateway: Gateway,
) -> ([FakePod; 2], PickerProcess, Envoy, reqwest::Client) {
    let pods = two_pods().await;
    let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
    let picker = PickerProcess::start(loopback_port(), &addrs);
    let envoy = Envoy::start(gateway, picker.grpc, &addrs).await;
    let client = impatient_client();
    assert_eq!(complete(&client, &envoy).await.status, 200);
    (pods, picker, envoy, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_or_dead_picker_costs_a_fail_closed_client_a_prompt_503_never_a_hang() {
    let (_pods, mut picker, envoy, client) = picker_process_behind(Gateway::OriginalDst).await;

    // Frozen: a deadlock, a starved node, a black-holed path look the same.
    picker.signal("STOP");
    let mut waits = Vec::new();
    for _ in 0..3 {
        let answer = complete(&client, &envoy).await;
        assert_eq!(answer.status, 503, "{}", answer.body);
        assert_eq!(answer.error_code(), "picker_unavailable", "{}", answer.body);
        assert_eq!(answer.retry_after.as_deref(), Some("1"));
        waits.push(answer.took);
    }
    eprintln!("frozen picker, fail-closed: answered 503 after {waits:?}");
    picker.signal("CONT");
    let back = until_served(&client, &envoy, Duration::from_secs(10)).await;
    assert_eq!(back.status, 200, "served again once thawed: {}", back.body);

    // Dead, then restarted on the same port.
    picker.kill();
    let answer = complete(&client, &envoy).await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(answer.error_code(), "picker_unavailable", "{}", answer.body);
    eprintln!(
        "dead picker, fail-closed: answered 503 after {:?}",
        answer.took
    );
    picker.restart();
    let back = until_served(&client, &envoy, Duration::from_secs(10)).await;
    assert_eq!(
        back.status, 200,
        "served again once restarted: {}",
        back.body
    );
}

/// kvroute told to stop (SIGTERM) drains: it keeps answering while the gateway's health
/// check takes it out, then exits. Through that whole time and after it, every client of
/// the fail-closed gateway gets either its completion or a 503 with an OpenAI-style JSON
/// error (never Envoy's bare 500 or an empty body).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_picker_leaves_every_fail_closed_client_an_answer_it_can_read() {
    let (_pods, mut picker, envoy, client) = picker_process_behind(Gateway::OriginalDst).await;
    picker.signal("TERM");
    let (mut during, mut after) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(20);
    while after.len() < 3 {
        assert!(
            Instant::now() < deadline,
            "kvroute did not exit within 20 s of SIGTERM"
        );
        let alive = !picker.exited();
        let answer = complete(&client, &envoy).await;
        assert!(
            answer.status == 200
                || (answer.status == 503 && answer.error_code() == "picker_unavailable"),
            "during the drain: {} {}",
            answer.status,
            answer.body
        );
        if answer.status == 503 {
            assert_eq!(answer.retry_after.as_deref(), Some("1"), "{}", answer.body);
        }
        if alive {
            during.push(answer.status);
        } else {
            after.push(answer.status);
        }
        // Paced like a client retrying: the drain lasts about a second.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("while draining: {during:?}; after exit: {after:?}");
    assert!(
        !during.is_empty(),
        "no request was sent while kvroute drained"
    );
    assert!(after.iter().all(|status| *status == 503), "{after:?}");
}

/// A streamed answer already routed when kvroute dies reaches its end: the response
/// does not pass through kvroute on either gateway, and both filters go on without it.
async fn a_stream_routed_before_the_picker_dies_still_completes(gateway: Gateway) {
    let (pods, mut picker, envoy, client) = picker_process_behind(gateway).await;
    for pod in &pods {
        pod.hold_stream();
    }
    let response = stream_to_first_event(&client, &envoy, MODEL).await;

    picker.kill();
    // A new request fails once the gateway has seen the picker's connection end, so the
    // stream below goes on after that, not before it.
    let refused = complete(&client, &envoy).await;
    if gateway == Gateway::OriginalDst {
        assert_eq!(refused.status, 503, "{}", refused.body);
    }
    for pod in &pods {
        pod.release_stream();
    }
    let rest = response
        .text()
        .await
        .expect("the rest of the stream, not a reset");
    assert!(
        rest.ends_with("data: [DONE]\n\n"),
        "{gateway:?}: the stream completed after the picker died: {rest}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_routed_before_the_picker_dies_completes_on_the_fail_closed_gateway() {
    a_stream_routed_before_the_picker_dies_still_completes(Gateway::OriginalDst).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_routed_before_the_picker_dies_completes_on_the_fail_open_gateway() {
    a_stream_routed_before_the_picker_dies_still_completes(Gateway::OverrideHost).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_or_dead_picker_lets_the_fail_open_gateway_forward_promptly() {
    let (_pods, mut picker, envoy, client) = picker_process_behind(Gateway::OverrideHost).await;

    picker.signal("STOP");
    let mut waits = Vec::new();
    for _ in 0..3 {
        let answer = complete(&client, &envoy).await;
        assert_eq!(
            answer.status, 200,
            "forwarded without a pick: {}",
            answer.body
        );
        waits.push(answer.took);
    }
    eprintln!("frozen picker, fail-open: forwarded after {waits:?}");
    picker.signal("CONT");
    picker.kill();
    let answer = complete(&client, &envoy).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    picker.restart();
    assert_eq!(
        until_served(&client, &envoy, Duration::from_secs(10))
            .await
            .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_failing_open_a_clients_destination_header_picks_no_pod() {
    let pods = two_pods().await;
    let (mut kvroute, envoy) = behind_envoy(
        &pods,
        test_config(pods.iter().map(|p| p.addr).collect()),
        Gateway::OverrideHost,
    )
    .await;
    kvroute.stop().await;
    let client = impatient_client();
    let pinned = pods[1].addr.to_string();
    for _ in 0..6 {
        let answer = send(
            &client,
            &envoy.url("/v1/completions"),
            &[("x-gateway-destination-endpoint", &pinned)],
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    // Round robin, as if the client had said nothing: the header was removed before
    // the load balancer could read it.
    assert_eq!((pods[0].arrivals(), pods[1].arrivals()), (3, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_off_the_inference_api_never_reach_a_pod_through_either_gateway() {
    for gateway in [Gateway::OriginalDst, Gateway::OverrideHost] {
        let pods = two_pods().await;
        let (_kvroute, envoy) = behind_envoy(
            &pods,
            test_config(pods.iter().map(|p| p.addr).collect()),
            gateway,
        )
        .await;
        let client = impatient_client();
        for path in [
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/metrics",
            "/v1/completions/../load_lora_adapter",
            "/start_profile",
        ] {
            let answer = send(&client, &envoy.url(path), &[]).await;
            assert_eq!(answer.status, 404, "{gateway:?} {path}: {}", answer.body);
            assert_eq!(answer.error_code(), "unknown_path", "{gateway:?} {path}");
        }
        // A model listing still passes; an inference request without a body is the
        // client's error, not a model-less request for any pod.
        let models = client
            .get(envoy.url("/v1/models?x=1"))
            .send()
            .await
            .expect("GET /v1/models");
        assert_eq!(models.status(), 200, "{gateway:?}");
        let empty = client
            .post(envoy.url("/v1/completions"))
            .send()
            .await
            .expect("empty POST");
        assert_eq!(empty.status(), 400, "{gateway:?}");
        let body: serde_json::Value = empty.json().await.expect("JSON error");
        assert_eq!(body["error"]["code"], "empty_body", "{gateway:?}");
        assert_eq!(pods[0].arrivals() + pods[1].arrivals(), 0, "{gateway:?}");
    }
}

/// A TCP front for a pod that can be killed as a process is: it stops listening (the
/// next connection is refused) and resets the connections it holds.
struct KillableFront {
    addr: SocketAddr,
    kill: tokio::sync::watch::Sender<bool>,
}

impl KillableFront {
    async fn start(target: SocketAddr) -> KillableFront {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind front");
        let addr = listener.local_addr().expect("front addr");
        let (kill, killed) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            let mut killed_accepting = killed.clone();
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    _ = killed_accepting.wait_for(|k| *k) => return,
                };
                let Ok((client, _)) = accepted else { return };
                let mut killed = killed.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let mut client = client;
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = killed.wait_for(|k| *k) => {
                            // RST, as the kernel sends for a killed process's sockets.
                            let _ = client.set_zero_linger();
                        }
                    }
                });
            }
        });
        KillableFront { addr, kill }
    }

    fn kill(&self) {
        self.kill.send_replace(true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_dies_under_traffic_costs_at_most_one_request() {
    for gateway in [Gateway::OriginalDst, Gateway::OverrideHost] {
        let pods = two_pods().await;
        let fronts = [
            KillableFront::start(pods[0].addr).await,
            KillableFront::start(pods[1].addr).await,
        ];
        let addrs: Vec<SocketAddr> = fronts.iter().map(|f| f.addr).collect();
        let mut config = test_config(addrs.clone());
        // Scrapes alone never take the pod out here: what does is the gateway's report
        // of the failed connection.
        config.health.failures_to_mark_down = 1_000_000;
        // override_host walks a list; ORIGINAL_DST takes exactly one address.
        if matches!(gateway, Gateway::OverrideHost) {
            config.scheduler.fallbacks = 1;
        }
        let kvroute = Kvroute::start(config).await;
        kvroute.wait_until_scraped(2).await;
        let envoy = Envoy::start(gateway, kvroute.addrs.grpc, &addrs).await;
        let client = impatient_client();
        for _ in 0..4 {
            let answer = complete(&client, &envoy).await;
            assert_eq!(answer.status, 200, "{gateway:?}: {}", answer.body);
        }
        fronts[0].kill();
        let mut failures = Vec::new();
        for _ in 0..20 {
            let answer = complete(&client, &envoy).await;
            if answer.status != 200 {
                assert_eq!(answer.status, 503, "{gateway:?}: {}", answer.body);
                assert!(
                    answer.body["error"]["message"].is_string(),
                    "{}",
                    answer.body
                );
                assert_eq!(answer.retry_after.as_deref(), Some("1"), "{gateway:?}");
                failures.push(answer.body);
            } else {
                assert_eq!(answer.pod.as_deref(), Some("pod-b"), "{gateway:?}");
            }
        }
        assert!(failures.len() <= 1, "{gateway:?}: {failures:?}");
        if !failures.is_empty() {
            let reported = format!("kvroute_pod_unreachable_total{{pod=\"{}\"}} 1", addrs[0]);
            let metrics = kvroute.metrics_text().await;
            assert!(metrics.contains(&reported), "{gateway:?}: {metrics}");
        }
        eprintln!(
            "{gateway:?}: {} failed request(s) after the pod died",
            failures.len()
        );
    }
}

/// Silent streams holding `--max-silent-streams` (a client that opens ext_proc streams and
/// never speaks) cost clients of the fail-closed gateway an explicit 503, not a hang: Envoy's
/// stream is refused (RESOURCE_EXHAUSTED), its filter fails open into the cluster that fails
/// closed. Once the silent streams are gone, requests are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_streams_at_their_bound_cost_fail_closed_clients_a_503_not_a_hang() {
    use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;

    let pods = two_pods().await;
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.max_silent_streams = 1;
    let (kvroute, envoy) = behind_envoy(&pods, config, Gateway::OriginalDst).await;
    let client = impatient_client();
    assert_eq!(complete(&client, &envoy).await.status, 200);

    // One stream that never sends holds the bound.
    let mut picker = ExternalProcessorClient::connect(format!("http://{}", kvroute.addrs.grpc))
        .await
        .expect("connect");
    let (silent, receive) = tokio::sync::mpsc::channel::<ProcessingRequest>(1);
    let held = picker
        .process(tokio_stream::wrappers::ReceiverStream::new(receive))
        .await
        .expect("the first silent stream is admitted");
    let answer = complete(&client, &envoy).await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(answer.error_code(), "picker_unavailable", "{}", answer.body);
    assert_eq!(answer.retry_after.as_deref(), Some("1"));

    drop((silent, held));
    let back = until_served(&client, &envoy, Duration::from_secs(10)).await;
    assert_eq!(
        back.status, 200,
        "served once the silent stream left: {}",
        back.body
    );
}
