//! `kvroute-lab soak` end to end, short: two simulated pods, kvroute and the fail-closed
//! Envoy gateway, 12 s of load at a low rate, one pod killed halfway and started again;
//! then the same on the pods' KV events, with kvroute killed and started again too.
//! Loopback only; needs Envoy (`scripts/setup`, or `ENVOY_BIN`) and the workspace's
//! `kvroute` and `kvroute-sim` binaries beside `kvroute-lab`.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

mod support;

use support::{envoy_binary, processes_marked};

/// A binary of the workspace, built beside this test's `kvroute-lab`.
fn beside_lab(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_kvroute-lab")).with_file_name(name);
    assert!(
        path.is_file(),
        "{} is missing: run the tests of the whole workspace (cargo nextest run --workspace)",
        path.display()
    );
    path
}

/// Runs `kvroute-lab soak` for 12 s at 20 req/s on two pods with `args` added, into
/// `out`: checks that it passed within its bound and left no process behind; returns its
/// `soak.json`.
fn short_soak(out: &Path, args: &[&str]) -> serde_json::Value {
    let marker = format!("{}-{}", std::process::id(), args.join(" "));
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_kvroute-lab"))
        .arg("soak")
        .args(["--duration", "12s", "--rate", "20", "--pods", "2"])
        .args(args)
        .arg("--output-dir")
        .arg(out)
        .arg("--kvroute")
        .arg(beside_lab("kvroute"))
        .arg("--sim")
        .arg(beside_lab("kvroute-sim"))
        .arg("--envoy")
        .arg(envoy_binary())
        .env("KVROUTE_SOAK_TEST_MARK", &marker)
        .output()
        .expect("run kvroute-lab soak");
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kvroute-lab soak failed:\n{stderr}"
    );
    assert!(took < Duration::from_secs(45), "took {took:?}");
    let leftover = processes_marked("KVROUTE_SOAK_TEST_MARK", &marker);
    assert!(leftover.is_empty(), "still running: {leftover:?}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("soak.json")).expect("soak.json"))
            .expect("JSON");
    assert_eq!(report["passed"], true);
    assert_eq!(report["lost"], 0);
    let sent = report["tally"]["sent"].as_u64().expect("sent");
    let completed = report["completed"].as_u64().expect("completed");
    assert!(sent > 150, "about 240 requests in 12 s at 20/s: {sent}");
    assert!(completed * 10 > sent * 8, "{completed} of {sent} completed");
    report
}

#[test]
fn a_short_soak_with_a_pod_kill_loses_nothing_and_reports_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("soak");
    let report = short_soak(&out, &["--faults", "pod-kill"]);
    let faults = report["faults"].as_array().expect("faults");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(faults[0]["kind"], "pod-kill");
    let samples = report["kvroute"]["samples"].as_array().expect("samples");
    assert!(samples.len() >= 10, "one a second: {}", samples.len());
    assert!(report["kvroute"]["rss_end_mib"].as_f64().expect("rss") > 1.0);
    assert!(report.get("kv_events").is_none(), "not followed: {report}");

    let summary = std::fs::read_to_string(out.join("soak.md")).expect("soak.md");
    assert!(summary.contains("**PASSED**"), "{summary}");
    assert!(summary.contains("| pod-kill | 0 |"), "{summary}");
    let png = std::fs::read(out.join("kvroute-rss-cpu.png")).expect("png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}

/// With the pods publishing KV events and kvroute following them: a pod killed (its
/// publisher with it, its sequence starting again) and kvroute killed (its index and
/// subscriptions gone) lose no request, and by the end kvroute follows both pods' streams
/// again and has placed prompts on what their events say they cache.
#[test]
fn a_short_soak_on_kv_events_through_a_pod_kill_and_a_kvroute_kill_loses_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("soak-kv-events");
    let report = short_soak(&out, &["--kv-events", "--faults", "pod-kill,kvroute-kill"]);
    let kinds: Vec<&str> = report["faults"]
        .as_array()
        .expect("faults")
        .iter()
        .filter_map(|f| f["kind"].as_str())
        .collect();
    assert_eq!(kinds.len(), 2, "{kinds:?}");
    assert!(
        kinds.contains(&"pod-kill") && kinds.contains(&"kvroute-kill"),
        "{kinds:?}"
    );
    let events = &report["kv_events"];
    assert_eq!(
        events["streams"], 2,
        "both pods followed at the end: {events}"
    );
    let applied = events["batches"]["applied"].as_u64().unwrap_or(0);
    assert!(applied > 0, "event batches applied: {events}");
    assert!(events["tokenized"].as_u64().unwrap_or(0) > 0, "{events}");
    // Half the chats share one of eight system prompts: after kvroute's restart the
    // events alone tell it where they are cached.
    let predicted = events["predicted_tokens"]["kv_events"]
        .as_u64()
        .unwrap_or(0);
    assert!(predicted > 0, "matches on the events: {events}");

    let summary = std::fs::read_to_string(out.join("soak.md")).expect("soak.md");
    assert!(summary.contains("**PASSED**"), "{summary}");
    assert!(
        summary.contains("Streams connected and in sequence at the end: 2 of 2 pods ("),
        "{summary}"
    );
}
