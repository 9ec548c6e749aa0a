//! kvroute's own `/metrics`: on a healthy fleet before any request, every counter the
//! shipped Grafana dashboard rates is already a series (at 0), so its panels show 0, not
//! "no data"; a pod that leaves the fleet takes its gauges with it. Each test runs in its
//! own process (nextest), so no other test's series or settings are in the recorder.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use support::{FakePod, Kvroute, project_file, test_config};

/// The `kvroute_*_total` names the dashboard's queries use.
fn dashboard_counters() -> BTreeSet<String> {
    let path = project_file("manifests/grafana/kvroute-dashboard.json");
    let text = std::fs::read_to_string(&path).expect("dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard json");
    let mut exprs = Vec::new();
    collect_exprs(&dashboard, &mut exprs);
    let mut names = BTreeSet::new();
    for expr in exprs {
        let mut rest = expr.as_str();
        while let Some(at) = rest.find("kvroute_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            let name = &tail[..end];
            if name.ends_with("_total") {
                names.insert(name.to_owned());
            }
            rest = &tail[end..];
        }
    }
    names
}

fn collect_exprs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, inner) in map {
                match (key.as_str(), inner) {
                    ("expr", serde_json::Value::String(expr)) => out.push(expr.clone()),
                    _ => collect_exprs(inner, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|item| collect_exprs(item, out)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_counter_the_dashboard_rates_exists_at_zero_before_its_first_event() {
    let counters = dashboard_counters();
    assert!(counters.len() >= 4, "{counters:?}");
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let kvroute = Kvroute::start(test_config(vec![pod.addr])).await;
    kvroute.wait_until_scraped(1).await;
    let text = kvroute.metrics_text().await;
    let samples = kvroute_core::exposition::parse(&text).expect("valid exposition");
    for counter in &counters {
        assert!(
            samples.iter().any(|s| s.name == counter),
            "{counter} is not exported yet:\n{text}"
        );
    }
    let pod_label = pod.addr.to_string();
    let timeouts = samples.iter().find(|s| {
        s.name == "kvroute_scrape_errors_total"
            && s.label("pod") == Some(pod_label.as_str())
            && s.label("kind") == Some("timeout")
    });
    assert_eq!(timeouts.map(|s| s.value), Some(0.0), "{text}");
    for reason in ["least_loaded", "lora_active", "fallback"] {
        assert!(
            samples
                .iter()
                .any(|s| s.name == "kvroute_decisions_total" && s.label("reason") == Some(reason)),
            "no decisions series for {reason}"
        );
    }
}

fn has_pod_series(text: &str, pod: &str, name: &str) -> bool {
    let samples = kvroute_core::exposition::parse(text).expect("valid exposition");
    samples
        .iter()
        .any(|s| s.name == name && s.label("pod") == Some(pod))
}

/// Every kind of per-pod series: gauges, counters (a scrape-error kind at zero among
/// them) and the scrape histogram.
const POD_SERIES: [&str; 5] = [
    "kvroute_pod_kv_cache_usage_ratio",
    "kvroute_scrapes_total",
    "kvroute_scrape_errors_total",
    "kvroute_pod_unreachable_total",
    "kvroute_scrape_duration_seconds_count",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_leaves_the_fleet_takes_its_series_with_it() {
    let pods = [
        FakePod::start("pod-0", "llama", &[]).await,
        FakePod::start("pod-1", "llama", &[]).await,
    ];
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.idle_gauge_timeout = Duration::from_millis(500);
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(2).await;
    let (staying, leaving) = (pods[0].addr.to_string(), pods[1].addr.to_string());
    let text = kvroute.metrics_text().await;
    for name in POD_SERIES {
        assert!(has_pod_series(&text, &leaving, name), "{name}: {text}");
    }

    kvroute.store.set_endpoints(&[pods[0].addr]);
    let started = Instant::now();
    loop {
        let text = kvroute.metrics_text().await;
        for name in POD_SERIES {
            assert!(
                has_pod_series(&text, &staying, name),
                "the pod still here keeps its series, {name} (at zero too)"
            );
        }
        if POD_SERIES
            .iter()
            .all(|name| !has_pod_series(&text, &leaving, name))
        {
            // Counters kept at zero from the start outlive the idle timeout.
            for standing in ["kvroute_decisions_total{", "kvroute_requests_total{"] {
                assert!(text.contains(standing), "{standing} expired:\n{text}");
            }
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the departed pod's series are still exported:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
