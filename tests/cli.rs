//! The `kvroute` binary itself: configuration errors, serving, and a clean stop on
//! SIGTERM.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use support::FakePod;

/// Kills the child if the test fails before it is stopped on purpose.
struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

#[test]
fn serving_without_endpoints_exits_with_a_one_line_reason() {
    let output = kvroute()
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .env_remove("KVROUTE_ENDPOINTS")
        .env_remove("KVROUTE_CONFIG")
        .output()
        .expect("run kvroute");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("no endpoints"), "{stderr}");
}

#[test]
fn a_malformed_flag_is_refused_before_anything_binds() {
    let output = kvroute()
        .args([
            "serve",
            "--endpoints",
            "10.0.0.1:8000",
            "--refresh-metrics-interval",
            "soon",
        ])
        .output()
        .expect("run kvroute");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--refresh-metrics-interval"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_metrics_and_stops_cleanly_on_sigterm() {
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let mut child = kvroute()
        .args(["serve", "--endpoints", &pod.addr.to_string()])
        .args([
            "--grpc-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--health-addr",
            "off",
        ])
        .args([
            "--admin-addr",
            "off",
            "--debug-addr",
            "off",
            "--drain-timeout",
            "1s",
        ])
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvroute");
    // The log names the bound addresses and says when the first scrape made it ready.
    let stderr = child.stderr.take().expect("stderr");
    let mut guard = KillOnDrop(Some(child));
    let (metrics_addr, ready) = tokio::task::spawn_blocking(move || {
        // Either line may come first.
        let (mut metrics_addr, mut ready) = (None, false);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("metrics HTTP listening") {
                metrics_addr = line.split("addr=").nth(1).map(|a| a.trim().to_owned());
            }
            ready |= line.contains("ready: endpoint metrics available");
            if ready && metrics_addr.is_some() {
                break;
            }
        }
        (metrics_addr, ready)
    })
    .await
    .expect("log reader");
    assert!(ready, "kvroute never became ready");
    let metrics_addr = metrics_addr.expect("metrics address logged");
    let text = support::http_client()
        .get(format!("http://{metrics_addr}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    assert!(text.contains("kvroute_pod_healthy"), "{text}");
    // The binary's allocator reports what it holds and maps.
    let gauge = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} in /metrics: {text}"))
    };
    let (allocated, resident) = (
        gauge("kvroute_memory_allocated_bytes"),
        gauge("kvroute_memory_resident_bytes"),
    );
    assert!(
        allocated > 0.0 && resident >= allocated,
        "allocated {allocated}, resident {resident}"
    );
    // The prefix index's size, against its default budget.
    let capacity = kvroute_core::fleet::PrefixIndex::new().max_entries();
    assert_eq!(
        gauge("kvroute_prefix_index_capacity_entries"),
        capacity as f64
    );
    assert!(gauge("kvroute_prefix_index_entries") <= capacity as f64);

    let mut child = guard.0.take().expect("still running");
    let pid = child.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .expect("join")
        .expect("wait");
    drop(guard);
    assert!(status.success(), "kvroute exited with {status} on SIGTERM");
}

/// The laboratory's commands, run through the gateway binary: forwarded to the program
/// beside it that now holds them, or refused with where they went. A copy of the gateway
/// alone in a directory plays the shipped image.
#[test]
fn moved_commands_run_from_the_laboratory_binaries_or_say_where_they_went() {
    let built = std::path::Path::new(env!("CARGO_BIN_EXE_kvroute"));
    for (command, program, usage) in [
        ("sim", "kvroute-sim", "Usage: kvroute-sim"),
        ("demo", "kvroute-lab", "Usage: kvroute-lab demo"),
        ("bench", "kvroute-lab", "Usage: kvroute-lab bench"),
        ("compare", "kvroute-lab", "Usage: kvroute-lab compare"),
    ] {
        assert!(
            built.with_file_name(program).is_file(),
            "{program} is not built beside kvroute: run the workspace's tests \
             (cargo nextest run --workspace)"
        );
        let output = kvroute()
            .args([command, "--help"])
            .output()
            .expect("run kvroute");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "kvroute {command} --help");
        assert!(
            stdout.contains(usage),
            "kvroute {command} --help:\n{stdout}"
        );

        let alone = tempfile::tempdir().expect("tempdir");
        let copy = alone.path().join("kvroute");
        std::fs::copy(built, &copy).expect("copy kvroute");
        let output = Command::new(&copy)
            .args([command, "--help"])
            .output()
            .expect("run the copy");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("`{command}` is a command of `{program}`")),
            "{stderr}"
        );
    }
}

#[test]
fn a_tokenizer_directory_that_does_not_load_is_refused_with_its_path() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = kvroute()
        .args([
            "serve",
            "--endpoints",
            "10.0.0.1:8000",
            "--prefix-source",
            "auto",
        ])
        .arg(format!("--tokenizer={}", dir.path().display()))
        .args([
            "--grpc-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args([
            "--health-addr",
            "off",
            "--admin-addr",
            "off",
            "--debug-addr",
            "off",
        ])
        .output()
        .expect("run kvroute");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let expected = dir.path().join("tokenizer.json");
    assert!(stderr.contains(&expected.display().to_string()), "{stderr}");
}

/// The lab's test tokenizer, the one the simulated pods below tokenize with.
fn test_tokenizer() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crates/lab/tokenizers/bpe-4k")
}

/// `kvroute tokenize --pod`'s report on `body` for the directory `tokenizer`, and
/// whether the command succeeded.
async fn tokenize_against(
    tokenizer: &std::path::Path,
    pod: std::net::SocketAddr,
    body: &'static str,
) -> (bool, serde_json::Value) {
    let mut command = kvroute();
    command
        .arg("tokenize")
        .arg("--tokenizer")
        .arg(tokenizer)
        .args(["--pod", &pod.to_string(), "--text"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let output = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut child = command.spawn().expect("run kvroute tokenize");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(body.as_bytes())
            .expect("write the body");
        child.wait_with_output().expect("kvroute tokenize ends")
    })
    .await
    .expect("the command's thread");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("a JSON report ({e}); stderr: {stderr}"));
    (output.status.success(), report)
}

/// `kvroute tokenize --probes`' exit status and output for the directory `tokenizer`.
async fn probes_against(
    tokenizer: &std::path::Path,
    pod: std::net::SocketAddr,
) -> (Option<i32>, String) {
    let mut command = kvroute();
    command
        .arg("tokenize")
        .arg("--tokenizer")
        .arg(tokenizer)
        .args(["--pod", &pod.to_string()])
        .args(["--probes", "meta-llama/Llama-3.1-8B-Instruct"]);
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("the command's thread")
        .expect("run kvroute tokenize --probes");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvroute_tokenize_agrees_with_a_pod_of_the_same_tokenizer_and_shows_where_another_differs()
{
    let fleet = kvroute_sim::SimFleet::start(kvroute_sim::FleetConfig {
        port: 0,
        tokenizer: Some(test_tokenizer()),
        ..kvroute_sim::FleetConfig::uniform(1, kvroute_sim::PodConfig::default())
    })
    .await
    .expect("the pod starts");
    let pod = fleet.endpoints()[0];
    let body = r#"{"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [
        {"role": "system", "content": "The KV cache of every pod is scraped every 50 ms."},
        {"role": "user", "content": "Which pod holds my context?"}]}"#;

    let (agrees, report) = tokenize_against(&test_tokenizer(), pod, body).await;
    assert!(agrees, "{report:#}");
    assert_eq!(report["agrees"], true, "{report:#}");
    assert_eq!(report["local"]["ids"], report["pod"]["ids"], "{report:#}");
    let text = report["local"]["text"].as_str().expect("the rendered text");
    assert!(
        text.starts_with("<|begin_of_text|><|start_header_id|>system"),
        "{text}"
    );
    assert!(report["local"]["tokens"].as_u64() > Some(20), "{report:#}");

    // The same tokenizer with a template that writes the roles in capitals: the tokens
    // part at the first header's role.
    let other = tempfile::tempdir().expect("temp dir");
    std::fs::copy(
        test_tokenizer().join("tokenizer.json"),
        other.path().join("tokenizer.json"),
    )
    .expect("copy tokenizer.json");
    std::fs::write(
        other.path().join("chat_template.jinja"),
        "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m.role | upper }}\
         <|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endfor %}",
    )
    .expect("write the template");
    std::fs::copy(
        test_tokenizer().join("tokenizer_config.json"),
        other.path().join("tokenizer_config.json"),
    )
    .expect("copy tokenizer_config.json");
    // The built-in probes find the same: every chat differs, the completions (no
    // template) agree.
    let (status, stdout) = probes_against(other.path(), pod).await;
    assert_eq!(status, Some(1), "{stdout}");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    let summary = lines.last().expect("a summary line");
    assert_eq!(summary["probes"], 16, "{summary}");
    let differing: Vec<&str> = summary["differing"]
        .as_array()
        .expect("names")
        .iter()
        .filter_map(serde_json::Value::as_str)
        .collect();
    assert_eq!(differing.len(), 14, "{summary}");
    assert!(
        differing.iter().all(|name| !name.starts_with("completion")),
        "{summary}"
    );
    let (status, stdout) = probes_against(&test_tokenizer(), pod).await;
    assert_eq!(status, Some(0), "{stdout}");
    assert!(
        stdout
            .trim_end()
            .ends_with(r#"{"differing":[],"pod_refused":[],"probes":16}"#),
        "{stdout}"
    );

    // A template that refuses system messages (as Gemma 2's does), on kvroute's side and
    // the pod's: the two probes with one are refused by the pod, not counted as differing.
    let refusing = tempfile::tempdir().expect("temp dir");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(test_tokenizer().join(file), refusing.path().join(file)).expect("copy");
    }
    std::fs::write(
        refusing.path().join("chat_template.jinja"),
        "{%- for m in messages %}{%- if m.role == 'system' %}\
         {{- raise_exception('System role not supported') }}{%- endif %}\
         {{ m.role }}: {{ m.content }}\n{%- endfor %}",
    )
    .expect("write the template");
    let refusing_fleet = kvroute_sim::SimFleet::start(kvroute_sim::FleetConfig {
        port: 0,
        tokenizer: Some(refusing.path().to_owned()),
        ..kvroute_sim::FleetConfig::uniform(1, kvroute_sim::PodConfig::default())
    })
    .await
    .expect("the pod starts");
    let (status, stdout) = probes_against(refusing.path(), refusing_fleet.endpoints()[0]).await;
    assert_eq!(status, Some(0), "{stdout}");
    assert!(
        stdout.trim_end().ends_with(
            r#"{"differing":[],"pod_refused":["system and user","several turns"],"probes":16}"#
        ),
        "{stdout}"
    );
    refusing_fleet.shutdown().await;

    let (agrees, report) = tokenize_against(other.path(), pod, body).await;
    assert!(!agrees, "{report:#}");
    assert_eq!(report["agrees"], false, "{report:#}");
    let difference = &report["first_difference"];
    assert_eq!(difference["at"], 2, "{report:#}");
    assert!(
        difference["local"]["text"]
            .as_str()
            .is_some_and(|t| t.contains("SYSTEM")),
        "{report:#}"
    );
    assert!(
        difference["pod"]["text"]
            .as_str()
            .is_some_and(|t| t.contains("system")),
        "{report:#}"
    );
    fleet.shutdown().await;
}
