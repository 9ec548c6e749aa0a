//! KV cache events end to end: `kvroute-sim --kv-events-config` pods publish what their
//! engines cache and evict, and an independent decoder (`kv_events_subscriber.py`: pyzmq and
//! msgpack from the workspace's `.venv`, installed by `scripts/setup`) reads it as a vLLM
//! subscriber would. Every connection goes over loopback (the PUB sockets bind `*`, every
//! interface, because vLLM binds only on a wildcard); every wait is bounded.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_sim::kv_events::KvEventsConfig;
use kvroute_sim::{FleetConfig, PodConfig, SimFleet};
use serde_json::{Value, json};
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const BLOCK_SIZE: usize = 16;
const STARTUP: Duration = Duration::from_secs(30);
const CHECKS: Duration = Duration::from_secs(90);

/// The workspace's Python, with pyzmq and msgpack.
fn venv_python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    let imports = Command::new(&python)
        .args(["-c", "import zmq, msgpack"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        imports,
        "{} cannot import zmq and msgpack: run scripts/setup (it installs pyzmq and msgpack \
         from scripts/requirements.txt into .venv)",
        python.display()
    );
    python
}

/// A child process killed when the test ends, however it ends.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The lines a child prints on stdout, as they come.
fn lines(child: &mut Child) -> mpsc::Receiver<String> {
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The next line, or None once the child closed stdout or `deadline` passed.
fn next_line(rx: &mpsc::Receiver<String>, deadline: Instant) -> Option<String> {
    let left = deadline.saturating_duration_since(Instant::now());
    rx.recv_timeout(left).ok()
}

/// A port `p` such that `p` and `p + 1` are free on every interface (pod i binds `p + i`).
fn two_free_ports() -> u16 {
    for _ in 0..100 {
        let first = TcpListener::bind("0.0.0.0:0").expect("an ephemeral port");
        let port = first.local_addr().expect("bound").port();
        if port < u16::MAX && TcpListener::bind(("0.0.0.0", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no two consecutive free ports");
}

/// A pod as `kvroute-sim` announces it.
#[derive(Debug)]
struct PodLine {
    http: SocketAddr,
    kv_events: String,
    kv_events_replay: String,
}

fn parse_pod_line(line: &str) -> Option<PodLine> {
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .map(str::to_string)
    };
    let http = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http://"))?
        .parse()
        .ok()?;
    Some(PodLine {
        http,
        kv_events: field("kv_events=")?,
        kv_events_replay: field("kv_events_replay=")?,
    })
}

/// `kvroute-sim` with two pods publishing on `tcp://*:PUB+i`, replaying on
/// `tcp://127.0.0.1:REPLAY+i`, 40 KV blocks each (so that a few prompts evict).
fn start_sim() -> (Process, Vec<PodLine>, u16, u16) {
    for _ in 0..3 {
        let (publish, replay) = (two_free_ports(), two_free_ports());
        let config = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("tcp://*:{publish}"),
            "replay_endpoint": format!("tcp://127.0.0.1:{replay}"),
            "topic": "kv",
        });
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
            .args(["--pods", "2", "--port", "0", "--speedup", "20"])
            .args(["--num-gpu-blocks", "40", "--max-num-seqs", "8"])
            .args(["--kv-events-config", &config.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("kvroute-sim starts");
        let rx = lines(&mut child);
        let process = Process(child);
        let deadline = Instant::now() + STARTUP;
        let mut pods = Vec::new();
        while pods.len() < 2 {
            match next_line(&rx, deadline) {
                Some(line) => pods.extend(parse_pod_line(&line)),
                // It exited (a port taken since it was probed) or hung: try new ports.
                None => break,
            }
        }
        if pods.len() == 2 {
            return (process, pods, publish, replay);
        }
    }
    panic!("kvroute-sim did not start with KV events on");
}

async fn tokens(c: &reqwest::Client, pod: SocketAddr, prompt: &str) -> Vec<u64> {
    let res = c
        .post(format!("http://{pod}/tokenize"))
        .json(&json!({"model": MODEL, "prompt": prompt}))
        .send()
        .await
        .expect("tokenize");
    assert_eq!(res.status(), 200);
    let body: Value = res.json().await.expect("json");
    body["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("a token id"))
        .collect()
}

async fn complete(c: &reqwest::Client, pod: SocketAddr, prompt: &str) {
    let res = c
        .post(format!("http://{pod}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert_eq!(res.status(), 200, "{:?}", res.text().await);
}

fn words(tag: &str, range: std::ops::Range<usize>) -> String {
    range
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn send_line(stdin: &mut ChildStdin, value: &Value) {
    writeln!(stdin, "{value}").expect("the decoder reads its expectations");
    stdin.flush().expect("flush");
}

#[tokio::test]
async fn pods_publish_their_cache_as_vllm_does_and_replay_it() {
    let python = venv_python();
    let (_sim, pods, publish, replay) = start_sim();
    for (i, pod) in pods.iter().enumerate() {
        assert_eq!(
            pod.kv_events,
            format!("tcp://0.0.0.0:{}", publish + i as u16)
        );
        assert_eq!(
            pod.kv_events_replay,
            format!("tcp://127.0.0.1:{}", replay + i as u16)
        );
    }

    // The decoder subscribes to port + i for pod i, computed here, not read from the sim.
    let config = json!({
        "topic": "kv",
        "pods": (0..2u16).map(|i| json!({
            "endpoint": format!("tcp://127.0.0.1:{}", publish + i),
            "replay": format!("tcp://127.0.0.1:{}", replay + i),
        })).collect::<Vec<_>>(),
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kv_events_subscriber.py");
    let mut child = Command::new(python)
        .arg(script)
        .arg(config.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the decoder starts");
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let out = lines(&mut child);
    let _decoder = Process(child);
    let ready = next_line(&out, Instant::now() + STARTUP);
    assert_eq!(ready.as_deref(), Some("ready"), "the decoder subscribed");

    // Pod 0: a prompt, one sharing its first part (a prefix-cache hit), then one long enough
    // to evict both from the 40-block pool. Pod 1: one prompt of its own.
    let c = reqwest::Client::new();
    let (p0, p1) = (pods[0].http, pods[1].http);
    let first = words("alpha", 0..120);
    let second = format!("{} {}", words("alpha", 0..60), words("beta", 0..60));
    let third = words("gamma", 0..200);
    let other = words("delta", 0..80);
    let mut expected = [Vec::new(), Vec::new()];
    for (pod, prompt) in [(p0, &first), (p0, &second), (p0, &third), (p1, &other)] {
        let ids = tokens(&c, pod, prompt).await;
        complete(&c, pod, prompt).await;
        let index = usize::from(pod == p1);
        expected[index].push(ids);
    }
    let lens: Vec<Vec<usize>> = expected
        .iter()
        .map(|p| p.iter().map(Vec::len).collect())
        .collect();
    assert!(
        lens[0][0] / BLOCK_SIZE >= 8 && lens[0][2] / BLOCK_SIZE >= 30,
        "prompt lengths {lens:?}"
    );
    send_line(
        &mut stdin,
        &json!({
            "block_size": BLOCK_SIZE,
            "pods": [
                {"prompts": expected[0], "evicts": true},
                {"prompts": expected[1], "evicts": false},
            ],
        }),
    );

    let deadline = Instant::now() + CHECKS;
    let mut report = Vec::new();
    while let Some(line) = next_line(&out, deadline) {
        report.push(line);
    }
    assert_eq!(
        report.first().map(String::as_str),
        Some("ok"),
        "the decoder's verdict:\n{}",
        report.join("\n")
    );
}

#[tokio::test]
async fn a_publisher_without_a_wildcard_connects_to_a_subscriber_that_binds() {
    let mut sub = SubSocket::new();
    sub.subscribe("kv").await.expect("subscribes");
    let listener = TcpListener::bind("127.0.0.1:0").expect("an ephemeral port");
    let port = listener.local_addr().expect("bound").port();
    let mut monitor = sub.monitor();
    sub.bind_listener(listener)
        .await
        .expect("the subscriber binds");

    let endpoint = format!("tcp://127.0.0.1:{port}");
    let pod = PodConfig {
        kv_events: Some(KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: endpoint.clone(),
            topic: "kv".into(),
            ..KvEventsConfig::default()
        }),
        ..PodConfig::default()
    };
    let fleet = SimFleet::start(FleetConfig {
        speedup: 20.0,
        ..FleetConfig::uniform(1, pod)
    })
    .await
    .expect("the fleet starts");
    let published = fleet.kv_events_endpoints()[0]
        .clone()
        .expect("it publishes");
    assert_eq!(published.endpoint, endpoint);
    assert_eq!(published.replay_endpoint, None);

    let accepted = async {
        while let Some(event) = monitor.next().await {
            if matches!(event, SocketEvent::Accepted(..)) {
                return;
            }
        }
    };
    tokio::time::timeout(STARTUP, accepted)
        .await
        .expect("the publisher connects");

    // Our subscription reaches the publisher a moment after it connected, and a PUB socket
    // drops what nobody has subscribed to yet: new prompts until one batch comes through.
    let c = reqwest::Client::new();
    let pod = fleet.endpoints()[0];
    let deadline = Instant::now() + STARTUP;
    let mut attempt = 0;
    let message = loop {
        complete(&c, pod, &words(&format!("try{attempt}x"), 0..40)).await;
        attempt += 1;
        match tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
            Ok(Ok(message)) => break message,
            _ => assert!(Instant::now() < deadline, "no batch arrived"),
        }
    };
    let frames = message.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    assert_eq!(frames[0].as_ref(), b"kv");
    assert_eq!(frames[1].len(), 8);
    assert_eq!(frames[2].first(), Some(&0x93), "a batch is a 3-array");
    fleet.shutdown().await;
}
