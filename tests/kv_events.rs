//! Precise prefix routing end to end: simulated vLLM pods publish their KV cache events
//! over ZeroMQ exactly as vLLM does, kvroute (`--prefix-source auto`) follows them, and a
//! request through a real Envoy goes to the pod whose cache holds its prompt's prefix,
//! even when that prefix reached the pod by another path than kvroute.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{Envoy, Gateway, Kvroute, http_client, test_config};

use kvroute::kvevents::{EndpointTemplate, PrefixSource};
use kvroute_sim::{FleetConfig, PodConfig, SimFleet};

const MODEL: &str = "events-model";

/// Two pods publishing events, on consecutive ports so one template names both.
async fn fleet() -> (SimFleet, kvroute_lab::compare::KvEventTemplates) {
    let config = FleetConfig {
        model: MODEL.into(),
        speedup: 20.0,
        ..FleetConfig::uniform(2, PodConfig::default())
    };
    let (config, templates) =
        kvroute_lab::compare::with_kv_events(config).expect("ports for the events");
    let fleet = SimFleet::start(config).await.expect("the fleet starts");
    (fleet, templates)
}

/// The value of an unlabelled gauge in kvroute's exposition.
fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Waits until `name` reaches `at_least` in kvroute's exposition.
async fn wait_for_gauge(kvroute: &Kvroute, name: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = kvroute.metrics_text().await;
        if gauge(&text, name).is_some_and(|v| v >= at_least) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {name} >= {at_least}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Has each prompt computed on its pod directly, not through kvroute.
async fn compute_on(client: &reqwest::Client, prompts: &[(String, SocketAddr)]) {
    for (text, pod) in prompts {
        let status = client
            .post(format!("http://{pod}/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": text, "max_tokens": 1}))
            .send()
            .await
            .expect("the pod answers")
            .status();
        assert_eq!(status, 200);
    }
}

/// A prompt of about 300 tokens no other prompt shares a block with.
fn prompt(k: usize) -> String {
    (0..300)
        .map(|i| format!(" w{k}x{i}"))
        .collect::<Vec<_>>()
        .join("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_goes_to_the_pod_whose_events_show_its_prefix_even_if_it_came_another_way() {
    let (fleet, templates) = fleet().await;
    let pods = fleet.endpoints();
    let mut config = test_config(pods.clone());
    config.debug_decisions = 16;
    config.prefix_source = PrefixSource::Auto;
    config.kv_events.endpoint = EndpointTemplate::parse(&templates.endpoint).expect("template");
    config.kv_events.replay_endpoint =
        Some(EndpointTemplate::parse(&templates.replay).expect("template"));
    let kvroute = Kvroute::start(config).await;
    kvroute
        .wait_for("both pods scraped with their models", |s| {
            pods.iter().all(|p| {
                s.pod(*p)
                    .is_some_and(|v| v.healthy && v.metrics().is_some() && v.models.is_some())
            })
        })
        .await;
    wait_for_gauge(&kvroute, "kvroute_kv_event_streams", 2.0).await;

    // Each prompt is computed on one pod directly, not through kvroute: only that pod's
    // events can tell kvroute where it is cached.
    let client = http_client();
    let prompts: Vec<(String, SocketAddr)> = (0..6).map(|k| (prompt(k), pods[k % 2])).collect();
    compute_on(&client, &prompts).await;
    // Six prompts of at least 18 full blocks each, all announced.
    wait_for_gauge(&kvroute, "kvroute_kv_event_index_entries", 6.0 * 18.0).await;

    let envoy = Envoy::start(Gateway::OriginalDst, kvroute.addrs.grpc, &pods).await;
    let url = envoy.url("/v1/completions");
    for (k, (text, warm)) in prompts.iter().enumerate() {
        let response = client
            .post(&url)
            .json(&json!({"model": MODEL, "prompt": format!("{text} and then?"), "max_tokens": 2}))
            .send()
            .await
            .expect("Envoy answers");
        assert_eq!(response.status(), 200, "{}", envoy.log());
        let served = response
            .headers()
            .get("x-sim-pod")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
            .expect("the pod names itself");
        if pods[served] != *warm {
            let text = kvroute.metrics_text().await;
            let relevant: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("kvroute_kv_event") || l.starts_with("kvroute_tokenize"))
                .collect();
            panic!(
                "prompt {k} went to pod {served}, not to the pod caching its prefix ({warm}):\n{}",
                relevant.join("\n")
            );
        }
    }
    let text = kvroute.metrics_text().await;
    assert!(
        text.lines()
            .any(|l| l.starts_with("kvroute_tokenize_duration_seconds_count{outcome=\"ok\"} ")),
        "prompts were tokenized on the pods:\n{text}"
    );
    // The telemetry weighs what kvroute expected the pods to hold against what they say
    // they served from their caches: each prompt's 18 blocks of 16 tokens, at least.
    let predicted = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("kvroute_prefix_predicted_cached_tokens_total{source=\"kv_events\"} ")?
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(0.0);
    assert!(
        predicted >= 6.0 * 18.0 * 16.0,
        "{predicted} tokens predicted:\n{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("kvroute_pod_prefix_cache_hit_tokens_total{")),
        "the pods' own hits are mirrored:\n{text}"
    );
    // The decision trace says the prefix scores came from the events.
    let decisions: serde_json::Value = client
        .get(format!(
            "http://{}/debug/decisions",
            kvroute.addrs.debug.expect("debug pages")
        ))
        .send()
        .await
        .expect("debug pages answer")
        .json()
        .await
        .expect("JSON");
    let sources: Vec<&str> = decisions
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|d| d["prefix_source"].as_str())
        .collect();
    assert_eq!(sources, ["kv_events"; 6], "{decisions:#}");
    fleet.shutdown().await;
}

/// A `kvroute serve` process following the fleet's events: a replica.
struct Replica {
    child: std::process::Child,
    grpc: SocketAddr,
    metrics: SocketAddr,
    debug: SocketAddr,
}

impl Replica {
    fn start(pods: &[SocketAddr], templates: &kvroute_lab::compare::KvEventTemplates) -> Replica {
        let port = || kvroute_lab::envoy::free_port().expect("a free port");
        let local = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let (grpc, metrics, debug) = (local(port()), local(port()), local(port()));
        let endpoints: Vec<String> = pods.iter().map(ToString::to_string).collect();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--endpoints", &endpoints.join(",")])
            .args(["--grpc-addr", &grpc.to_string()])
            .args(["--metrics-addr", &metrics.to_string()])
            .args(["--debug-addr", &debug.to_string()])
            .args(["--health-addr", "off", "--admin-addr", "off"])
            .args([
                "--refresh-metrics-interval",
                "20ms",
                "--debug-decisions",
                "64",
            ])
            .arg("--prefix-source=auto")
            .arg(format!("--kv-events-endpoint={}", templates.endpoint))
            .arg(format!("--kv-events-replay-endpoint={}", templates.replay))
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start kvroute");
        Replica {
            child,
            grpc,
            metrics,
            debug,
        }
    }

    /// Waits until its exposition shows both pods' streams and `entries` indexed blocks.
    async fn wait_following(&self, entries: f64) {
        let client = http_client();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = match client
                .get(format!("http://{}/metrics", self.metrics))
                .send()
                .await
            {
                Ok(response) => response.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            if gauge(&text, "kvroute_kv_event_streams") == Some(2.0)
                && gauge(&text, "kvroute_kv_event_index_entries").is_some_and(|e| e >= entries)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replica {} did not catch up:\n{text}",
                self.grpc
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How many requests it routed, by its decision log.
    async fn routed(&self) -> usize {
        let decisions: serde_json::Value = http_client()
            .get(format!("http://{}/debug/decisions", self.debug))
            .send()
            .await
            .expect("debug pages answer")
            .json()
            .await
            .expect("JSON");
        decisions.as_array().map_or(0, |d| {
            d.iter().filter(|d| d["decision"].is_object()).count()
        })
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `text` and a question through Envoy: its status and the pod that served it.
async fn ask(client: &reqwest::Client, url: &str, text: &str) -> (u16, Option<usize>) {
    let response = client
        .post(url)
        .json(&json!({"model": MODEL, "prompt": format!("{text} and then?"), "max_tokens": 2}))
        .send()
        .await
        .expect("Envoy answers");
    let pod = response
        .headers()
        .get("x-sim-pod")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    (response.status().as_u16(), pod)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_agree_from_the_events_and_one_left_alone_routes_everything() {
    let (fleet, templates) = fleet().await;
    let pods = fleet.endpoints();
    // The prompts are cached before either replica starts: what the replicas know of
    // them comes from the events' replay alone, and neither ever sent them anywhere.
    let client = http_client();
    let prompts: Vec<(String, SocketAddr)> = (0..6).map(|k| (prompt(k), pods[k % 2])).collect();
    compute_on(&client, &prompts).await;
    let replicas = [
        Replica::start(&pods, &templates),
        Replica::start(&pods, &templates),
    ];
    for replica in &replicas {
        replica.wait_following(6.0 * 18.0).await;
    }
    let envoy = kvroute_lab::envoy::EnvoyProcess::start(
        kvroute_lab::envoy::Gateway::OriginalDstReplicas {
            kvroutes: [replicas[0].grpc, replicas[1].grpc],
        },
        &pods,
        &support::envoy_binary(),
        "warning",
    )
    .await
    .expect("Envoy starts");
    let url = envoy.url("/v1/completions");

    // Envoy spreads the requests over both replicas; each sends every prompt where the
    // events say it is cached.
    for round in 0..2 {
        for (k, (text, warm)) in prompts.iter().enumerate() {
            let (status, served) = ask(&client, &url, text).await;
            assert_eq!(status, 200, "round {round}, prompt {k}: {}", envoy.log());
            let served = served.expect("the pod names itself");
            assert_eq!(pods[served], *warm, "round {round}, prompt {k}");
        }
    }
    let (a, b) = (replicas[0].routed().await, replicas[1].routed().await);
    assert!(a > 0 && b > 0 && a + b == 12, "replicas routed {a} and {b}");

    // One replica dies. Until the gateway's health check takes it out (two missed
    // checks a second apart), a request sent its way is answered 503 at once; nothing
    // hangs, and then the survivor routes every request, still by the events.
    let [mut gone, survivor] = replicas;
    gone.child.kill().expect("kill a replica");
    gone.child.wait().expect("reaped");
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut in_a_row = 0;
    let mut refused = 0;
    while in_a_row < 12 {
        assert!(
            Instant::now() < deadline,
            "the survivor did not take over: {refused} refused\n{}",
            envoy.log()
        );
        let (k, (text, warm)) = prompts
            .iter()
            .enumerate()
            .nth(in_a_row % prompts.len())
            .expect("a prompt");
        match ask(&client, &url, text).await {
            (200, Some(served)) => {
                assert_eq!(pods[served], *warm, "prompt {k} after the kill");
                in_a_row += 1;
            }
            (503, None) => {
                refused += 1;
                in_a_row = 0;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("prompt {k} after the kill: {other:?}\n{}", envoy.log()),
        }
    }
    assert!(survivor.routed().await >= 12);
    drop(envoy);
    fleet.shutdown().await;
}
