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
    for (text, pod) in &prompts {
        let status = client
            .post(format!("http://{pod}/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": text, "max_tokens": 1}))
            .send()
            .await
            .expect("the pod answers")
            .status();
        assert_eq!(status, 200);
    }
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
