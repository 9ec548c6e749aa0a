//! What streams that never send cost kvroute: opens N ext_proc streams (HTTP/2, spread
//! over C connections) that send nothing, as a broken or hostile client would, and
//! reads kvroute's resident memory (`VmRSS`) before, while they are open, and after they
//! are gone. kvroute runs as its own process (the release binary), so the client's
//! memory is not counted.
//!
//! Run: `cargo bench --bench idle_streams -- --streams 20000 --connections 4`.
//! Target (hardening issue): 20,000 such streams cost ≤ 50 MB, and it all comes back.
//! Extra arguments after `--kvroute-args` go to `kvroute serve` (e.g.
//! `--grpc-max-streams-per-connection 100000` to see the cost of every stream accepted).

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;

use support::{Killed, arg, extra_kvroute_args};

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

/// kvroute's own count of open ext_proc streams.
async fn open_streams(metrics: SocketAddr) -> String {
    let text = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    text.lines()
        .find(|l| l.starts_with("kvroute_extproc_streams "))
        .map_or_else(|| "absent".into(), |l| l.to_owned())
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

#[tokio::main]
async fn main() {
    let streams = arg("--streams").unwrap_or(20_000);
    let connections = arg("--connections").unwrap_or(4).max(1);
    let port = kvroute_lab::envoy::free_port().expect("port");
    let grpc = SocketAddr::from(([127, 0, 0, 1], port));
    let metrics = SocketAddr::from((
        [127, 0, 0, 1],
        kvroute_lab::envoy::free_port().expect("port"),
    ));
    // No pod answers at this endpoint: idle streams never reach the router anyway.
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--endpoints", "127.0.0.1:9"])
        .args(["--grpc-addr", &grpc.to_string()])
        .args([
            "--metrics-addr",
            &metrics.to_string(),
            "--debug-addr",
            "off",
        ])
        .args(["--health-addr", "off", "--admin-addr", "off"])
        .args(extra_kvroute_args())
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kvroute");
    let kvroute = Killed(child);
    let pid = kvroute.0.id();
    let url = format!("http://{grpc}");
    let started = Instant::now();
    let channels = loop {
        let mut channels = Vec::new();
        for _ in 0..connections {
            match tonic::transport::Endpoint::from_shared(url.clone())
                .expect("endpoint")
                .connect()
                .await
            {
                Ok(channel) => channels.push(channel),
                Err(_) => break,
            }
        }
        if channels.len() == connections {
            break channels;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "kvroute never listened"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_kib(pid);

    // Each call returns once kvroute has accepted the stream; its request side stays open
    // and silent for as long as the future holding it lives.
    let (opened_tx, mut opened_rx) = tokio::sync::mpsc::unbounded_channel();
    let (close_tx, close_rx) = tokio::sync::watch::channel(false);
    for index in 0..streams {
        let mut client = ExternalProcessorClient::new(channels[index % connections].clone());
        let opened = opened_tx.clone();
        let mut close = close_rx.clone();
        tokio::spawn(async move {
            // Sends nothing, and ends (closing the stream) when told to.
            let silent = futures::stream::unfold(close.clone(), |mut close| async move {
                let _ = close.wait_for(|c| *c).await;
                None::<(ProcessingRequest, _)>
            });
            // A stream over the connection's limit waits at the client for a free slot:
            // after a few seconds it counts as not accepted.
            let answer = tokio::time::timeout(Duration::from_secs(5), client.process(silent))
                .await
                .map_err(|_| tonic::Status::resource_exhausted("not accepted"))
                .and_then(|answer| answer);
            let _ = opened.send(answer.as_ref().err().map(|s| s.code()));
            let _ = close.wait_for(|c| *c).await;
            if let Ok(answer) = answer {
                // Reads kvroute's end of the stream.
                let mut answers = answer.into_inner();
                while let Ok(Some(_)) = answers.message().await {}
            }
        });
    }
    drop(opened_tx);
    let (mut open, mut refused) = (0usize, 0usize);
    while let Some(outcome) = opened_rx.recv().await {
        match outcome {
            None => open += 1,
            Some(_) => refused += 1,
        }
        if open + refused == streams {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = rss_kib(pid);
    let streams_during = open_streams(metrics).await;
    close_tx.send_replace(true);
    drop(channels);
    // Freed memory may go back to the system after a delay (the allocator's decay):
    // watch for up to 30 s.
    let closed = Instant::now();
    let mut after = rss_kib(pid);
    while closed.elapsed() < Duration::from_secs(30)
        && after.saturating_sub(before) > (during.saturating_sub(before)) / 10
    {
        tokio::time::sleep(Duration::from_secs(1)).await;
        after = rss_kib(pid);
    }
    println!(
        "RSS settled {:.0} s after the streams closed",
        closed.elapsed().as_secs_f64()
    );
    let streams_after = open_streams(metrics).await;
    println!("kvroute_extproc_streams: {streams_during} while open, {streams_after} after");
    println!(
        "{streams} idle streams on {connections} connections: {open} accepted, {refused} not accepted (over the per-connection limit or --max-silent-streams)"
    );
    println!(
        "kvroute RSS: before {:.1} MiB, open {:.1} MiB (+{:.1} MiB, {:.1} KiB/stream), after {:.1} MiB (+{:.1} MiB kept)",
        mib(before),
        mib(during),
        mib(during.saturating_sub(before)),
        during.saturating_sub(before) as f64 / open.max(1) as f64,
        mib(after),
        mib(after.saturating_sub(before)),
    );
}
