//! One streamed request, measured: time to first token, the gaps between text events, end to
//! end, usage, status, the serving pod, and what went wrong, or that the gateway shed it.
//!
//! Times are taken on the wall clock from the moment the request is sent and multiplied by
//! `scale` (the simulator's speedup), so they come out in simulated seconds.
//!
//! Flow control (the Gateway API Inference Extension's and llm-d's names): a request may carry
//! [`OBJECTIVE_HEADER`] and [`FAIRNESS_ID_HEADER`]; a gateway that sheds it answers 429 (or 503)
//! with [`DROPPED_REASON_HEADER`], which makes the outcome *shed* with that reason: neither a
//! success nor an error.

use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;
use serde::Serialize;
use serde_json::Value;

/// The request's objective name; the gateway maps it to a priority.
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// The request's tenant (flow) id; the gateway takes turns between tenants of a priority.
pub const FAIRNESS_ID_HEADER: &str = "x-gateway-inference-fairness-id";
/// Why the gateway shed a request (`rejected-saturated`, `rejected-ttl-expired`, ...).
pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";
/// The `server-timing` metric in which kvroute says how long it held a request.
pub const QUEUE_TIMING: &str = "kvroute-queue";
/// Longest shed reason kept; a longer header value is cut (reports key counts by it).
const MAX_REASON_BYTES: usize = 64;

/// What went wrong with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Not sent: `--max-concurrency` requests were already in flight.
    Dropped,
    /// No connection or no response head.
    Connect,
    /// `--timeout` passed.
    Timeout,
    /// A status other than 2xx.
    Http,
    /// The body broke off, held an error event or an event that is not JSON.
    Stream,
    /// The stream ended without `data: [DONE]`.
    Incomplete,
}

impl ErrorKind {
    /// The name used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Dropped => "dropped",
            ErrorKind::Connect => "connect",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Http => "http",
            ErrorKind::Stream => "stream",
            ErrorKind::Incomplete => "incomplete",
        }
    }
}

/// The measurements of one request (simulated seconds).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Outcome {
    /// HTTP status, when a response head came back.
    pub status: Option<u16>,
    /// `x-sim-pod` response header.
    pub pod: Option<String>,
    /// Send to the first data event carrying output text.
    pub ttft_s: Option<f64>,
    /// Arrival at the pod to first token, as the simulator timed it (`kvroute_sim.ttft_s`
    /// in the usage chunk): simulated time with nothing of the client's or the router's
    /// wall-clock delays scaled into it. None against anything but the simulator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_ttft_s: Option<f64>,
    /// Wall seconds before the first token that the request spent outside the pod's
    /// simulated clock (load generator, router, proxies, HTTP, this machine's scheduling):
    /// the client's wall-clock TTFT minus the pod's TTFT in wall time. Needs `pod_ttft_s`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path_s: Option<f64>,
    /// How long the gateway held the request for a pod with room, in simulated seconds (the
    /// `kvroute-queue` entry of its `server-timing` response header, wall time × scale).
    /// Part of `path_s`, but unlike the rest of the path it scales: it waits for the pods.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_s: Option<f64>,
    /// Time to first token at real scale: the pod's simulated TTFT, plus `path_s` unscaled
    /// except the gateway's queue wait (`queue_s`), which is counted in simulated time.
    /// At speedup `s` the simulator runs `s` times faster than a GPU and the load arrives
    /// `s` times faster in wall time, so `ttft_s` multiplies every wall-clock millisecond of
    /// routing and proxying by `s`; on a real fleet those milliseconds count once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_real_scale_s: Option<f64>,
    /// Gaps between successive data events carrying text.
    pub itl_s: Vec<f64>,
    /// Send to the end of the body.
    pub e2e_s: Option<f64>,
    /// `usage.completion_tokens`.
    pub output_tokens: Option<u32>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u32>,
    /// Data events carrying text.
    pub text_events: u32,
    /// What went wrong.
    pub error_kind: Option<ErrorKind>,
    /// Details of the error.
    pub error: Option<String>,
    /// The gateway shed the request (429 or 503 with [`DROPPED_REASON_HEADER`]): the reason.
    /// A shed request has no error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shed_reason: Option<String>,
}

impl Outcome {
    /// An outcome that failed with `kind`.
    pub fn failed(kind: ErrorKind, message: impl Into<String>) -> Outcome {
        Outcome {
            error_kind: Some(kind),
            error: Some(message.into()),
            ..Outcome::default()
        }
    }

    fn fail(&mut self, kind: ErrorKind, message: impl Into<String>) {
        self.error_kind = Some(kind);
        self.error = Some(message.into());
    }

    /// Whether it completed: neither failed nor shed.
    pub fn completed(&self) -> bool {
        self.error_kind.is_none() && self.shed_reason.is_none()
    }

    /// Output tokens from usage, else the text events counted.
    pub fn tokens(&self) -> u32 {
        self.output_tokens.unwrap_or(self.text_events)
    }
}

/// Splits a byte stream into the data payloads of Server-Sent Events.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Feeds bytes; returns the data payloads of the events completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let block: Vec<u8> = self.buf.drain(..end + sep).collect();
            let text = String::from_utf8_lossy(&block[..end]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        events
    }
}

/// Position and length of the first blank-line separator (`\n\n` or `\r\n\r\n`).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// What one data payload says.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// `[DONE]`.
    Done,
    /// A chunk; `text` whether it carries output text, `usage` when it carries usage.
    Chunk {
        /// Carries non-empty output text.
        text: bool,
        /// `(completion, prompt, cached)` tokens.
        usage: Option<(Option<u32>, Option<u32>, Option<u32>)>,
        /// The simulator's `kvroute_sim.ttft_s`.
        pod_ttft: Option<f64>,
    },
    /// An error event.
    Error(String),
    /// Not JSON.
    Invalid,
}

fn count(v: &Value, pointer: &str) -> Option<u32> {
    v.pointer(pointer)
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
}

/// Reads one data payload (completions or chat chunks).
pub fn classify(data: &str) -> Payload {
    if data.trim() == "[DONE]" {
        return Payload::Done;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return Payload::Invalid;
    };
    if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
        let message = e
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| e.to_string(), str::to_owned);
        return Payload::Error(message);
    }
    let non_empty = |p: &str| {
        v.pointer(p)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
    };
    let text = non_empty("/choices/0/text")
        || non_empty("/choices/0/delta/content")
        || non_empty("/choices/0/delta/reasoning_content");
    let usage = v.get("usage").filter(|u| u.is_object()).map(|_| {
        (
            count(&v, "/usage/completion_tokens"),
            count(&v, "/usage/prompt_tokens"),
            count(&v, "/usage/prompt_tokens_details/cached_tokens"),
        )
    });
    let pod_ttft = v.pointer("/kvroute_sim/ttft_s").and_then(Value::as_f64);
    Payload::Chunk {
        text,
        usage,
        pod_ttft,
    }
}

fn seconds(d: Duration, scale: f64) -> f64 {
    d.as_secs_f64() * scale
}

/// The longest prefix of `s` of at most `n` bytes that ends on a character boundary.
fn cut(s: &str, n: usize) -> &str {
    if s.len() <= n {
        return s;
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    format!("{}...", cut(s, n))
}

/// The gateway's queue wait in wall milliseconds: `dur` of the `kvroute-queue` metric of
/// the `server-timing` header (`kvroute-queue;dur=12.5`), if present.
pub fn queue_wait_ms(headers: &HeaderMap) -> Option<f64> {
    headers
        .get_all("server-timing")
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .find_map(|metric| {
            let mut parts = metric.split(';').map(str::trim);
            if parts.next() != Some(QUEUE_TIMING) {
                return None;
            }
            parts
                .find_map(|param| param.strip_prefix("dur="))
                .and_then(|ms| ms.parse::<f64>().ok())
                .filter(|ms| ms.is_finite() && *ms >= 0.0)
        })
}

/// The shed reason of a response with `status` and `headers`: the dropped-reason header of
/// a 429 or 503 (cut to 64 bytes), else None (any other failure stays an error).
pub fn shed_reason(status: u16, headers: &HeaderMap) -> Option<String> {
    if !matches!(status, 429 | 503) {
        return None;
    }
    let value = headers.get(DROPPED_REASON_HEADER)?;
    let reason = String::from_utf8_lossy(value.as_bytes());
    let reason = reason.trim();
    (!reason.is_empty()).then(|| cut(reason, MAX_REASON_BYTES).to_string())
}

/// Sends one streamed request with `headers` to `url` and measures it. `timeout` is
/// wall-clock time.
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: HeaderMap,
    timeout: Duration,
    scale: f64,
) -> Outcome {
    let started = Instant::now();
    let mut out = Outcome::default();
    let response = client
        .post(url)
        .headers(headers)
        .json(body)
        .timeout(timeout)
        .send()
        .await;
    let mut response = match response {
        Ok(r) => r,
        Err(e) if e.is_timeout() => return Outcome::failed(ErrorKind::Timeout, e.to_string()),
        Err(e) => return Outcome::failed(ErrorKind::Connect, format!("{e:#}")),
    };
    out.status = Some(response.status().as_u16());
    out.pod = response
        .headers()
        .get("x-sim-pod")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    out.queue_s = queue_wait_ms(response.headers()).map(|ms| ms / 1e3 * scale);
    if !response.status().is_success() {
        let status = response.status();
        let shed = shed_reason(status.as_u16(), response.headers());
        let text = response.text().await.unwrap_or_default();
        out.e2e_s = Some(seconds(started.elapsed(), scale));
        if shed.is_some() {
            out.shed_reason = shed;
            return out;
        }
        out.fail(
            ErrorKind::Http,
            format!("{status}: {}", truncate(&text, 200)),
        );
        return out;
    }
    let mut parser = SseParser::default();
    let mut last_text: Option<Instant> = None;
    let mut done = false;
    'read: loop {
        let chunk = match response.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                let kind = if e.is_timeout() {
                    ErrorKind::Timeout
                } else {
                    ErrorKind::Stream
                };
                out.fail(kind, format!("{e:#}"));
                break;
            }
        };
        let now = Instant::now();
        for data in parser.push(&chunk) {
            match classify(&data) {
                Payload::Done => {
                    done = true;
                    break 'read;
                }
                Payload::Chunk {
                    text,
                    usage,
                    pod_ttft,
                } => {
                    if pod_ttft.is_some() {
                        out.pod_ttft_s = pod_ttft;
                    }
                    if text {
                        out.text_events += 1;
                        match last_text {
                            None => out.ttft_s = Some(seconds(now - started, scale)),
                            Some(prev) => out.itl_s.push(seconds(now - prev, scale)),
                        }
                        last_text = Some(now);
                    }
                    if let Some((completion, prompt, cached)) = usage {
                        out.output_tokens = completion;
                        out.prompt_tokens = prompt;
                        out.cached_tokens = cached;
                    }
                }
                Payload::Error(message) => {
                    out.fail(ErrorKind::Stream, format!("error event: {message}"));
                    break 'read;
                }
                Payload::Invalid => {
                    out.fail(
                        ErrorKind::Stream,
                        format!("event is not JSON: {}", truncate(&data, 100)),
                    );
                    break 'read;
                }
            }
        }
    }
    out.e2e_s = Some(seconds(started.elapsed(), scale));
    if let (Some(client), Some(pod)) = (out.ttft_s, out.pod_ttft_s) {
        let path = ((client - pod) / scale).max(0.0);
        out.path_s = Some(path);
        // The queue wait is wall time the request spent waiting for the simulated pods:
        // at real scale it lasts `scale` times longer; the rest of the path does not.
        let queued = out.queue_s.unwrap_or(0.0);
        out.ttft_real_scale_s = Some(pod + (path - queued / scale).max(0.0) + queued);
    }
    if !done && out.error_kind.is_none() {
        out.fail(ErrorKind::Incomplete, "the stream ended without [DONE]");
    }
    out
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::thread::JoinHandle;

    use super::*;
    use crate::loadgen::class_headers;
    use crate::loadgen::workload::{ClassSpec, Dist};

    /// A one-request HTTP server on 127.0.0.1:0: answers `response` (a whole HTTP/1.1
    /// response) and hands back the request's head, lowercased.
    fn serve_once(response: &'static str) -> (String, JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!(
            "http://{}/v1/completions",
            listener.local_addr().expect("addr")
        );
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let mut reader = BufReader::new(stream);
            let mut head = String::new();
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).expect("read");
                if line == "\r\n" || line.is_empty() {
                    break;
                }
                head.push_str(&line.to_ascii_lowercase());
            }
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            let mut body = vec![0; length];
            reader.read_exact(&mut body).expect("body");
            let mut stream = reader.into_inner();
            stream.write_all(response.as_bytes()).expect("write");
            head
        });
        (url, server)
    }

    const STREAM: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
        data: {\"choices\":[{\"text\":\" the\"}]}\n\n\
        data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n\
        data: [DONE]\n\n";

    fn class(objective: Option<&str>, tenant: Option<&str>) -> ClassSpec {
        ClassSpec {
            name: "c".into(),
            weight: None,
            step_weights: None,
            objective: objective.map(str::to_owned),
            tenant: tenant.map(str::to_owned),
            lora: None,
            prompt_tokens: Some(Dist::Fixed { value: 1 }),
            shared_prefix: None,
            output_tokens: Dist::Fixed { value: 1 },
        }
    }

    async fn send_to(url: &str, headers: HeaderMap) -> Outcome {
        let body = serde_json::json!({"model": "m", "prompt": "x", "stream": true});
        send(
            &reqwest::Client::new(),
            url,
            &body,
            headers,
            Duration::from_secs(10),
            1.0,
        )
        .await
    }

    #[tokio::test]
    async fn a_class_objective_and_tenant_travel_as_the_gateway_headers() {
        let (url, server) = serve_once(STREAM);
        let headers = class_headers(&class(Some("critical"), Some("tenant-b"))).expect("valid");
        let outcome = send_to(&url, headers).await;
        let head = server.join().expect("server");
        assert!(
            head.contains("x-gateway-inference-objective: critical\r\n"),
            "{head}"
        );
        assert!(
            head.contains("x-gateway-inference-fairness-id: tenant-b\r\n"),
            "{head}"
        );
        assert!(outcome.completed(), "{outcome:?}");
        assert_eq!(outcome.output_tokens, Some(1));
    }

    #[tokio::test]
    async fn a_class_without_objective_or_tenant_sends_neither_header() {
        let (url, server) = serve_once(STREAM);
        let headers = class_headers(&class(None, None)).expect("valid");
        assert!(headers.is_empty());
        let outcome = send_to(&url, headers).await;
        let head = server.join().expect("server");
        assert!(!head.contains("x-gateway-inference"), "{head}");
        assert!(outcome.completed(), "{outcome:?}");
    }

    #[tokio::test]
    async fn a_429_with_a_dropped_reason_is_shed_not_an_error() {
        let (url, server) = serve_once(
            "HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\n\
             x-llm-d-request-dropped-reason: rejected-saturated\r\ncontent-type: application/json\r\n\
             content-length: 64\r\nconnection: close\r\n\r\n\
             {\"error\":{\"message\":\"saturated\",\"type\":\"rate_limit\",\"code\":429}}",
        );
        let outcome = send_to(&url, HeaderMap::new()).await;
        server.join().expect("server");
        assert_eq!(outcome.status, Some(429));
        assert_eq!(outcome.shed_reason.as_deref(), Some("rejected-saturated"));
        assert_eq!(outcome.error_kind, None);
        assert!(!outcome.completed());
        assert!(outcome.e2e_s.is_some());
    }

    #[tokio::test]
    async fn a_503_without_a_dropped_reason_stays_an_http_error() {
        let (url, server) = serve_once(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\nconnection: close\r\n\r\nbusy",
        );
        let outcome = send_to(&url, HeaderMap::new()).await;
        server.join().expect("server");
        assert_eq!(outcome.status, Some(503));
        assert_eq!(outcome.shed_reason, None);
        assert_eq!(outcome.error_kind, Some(ErrorKind::Http));
    }

    #[test]
    fn only_429_and_503_with_a_reason_are_shed() {
        let mut headers = HeaderMap::new();
        headers.insert(
            DROPPED_REASON_HEADER,
            reqwest::header::HeaderValue::from_static("rejected-shutting-down"),
        );
        assert_eq!(
            shed_reason(503, &headers).as_deref(),
            Some("rejected-shutting-down")
        );
        assert_eq!(shed_reason(500, &headers), None);
        assert_eq!(shed_reason(429, &HeaderMap::new()), None);
        let long = "r".repeat(100);
        headers.insert(
            DROPPED_REASON_HEADER,
            reqwest::header::HeaderValue::from_str(&long).expect("header"),
        );
        assert_eq!(shed_reason(429, &headers).map(|r| r.len()), Some(64));
        headers.insert(
            DROPPED_REASON_HEADER,
            reqwest::header::HeaderValue::from_static(" "),
        );
        assert_eq!(shed_reason(429, &headers), None);
    }

    #[test]
    fn the_gateway_queue_wait_is_read_from_server_timing() {
        let with = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(
                "server-timing",
                reqwest::header::HeaderValue::from_static(value),
            );
            queue_wait_ms(&headers)
        };
        assert_eq!(with("kvroute-queue;dur=12.5"), Some(12.5));
        assert_eq!(
            with("db;dur=3, kvroute-queue; desc=\"held\"; dur=40"),
            Some(40.0)
        );
        assert_eq!(with("db;dur=3"), None);
        assert_eq!(with("kvroute-queue;dur=-1"), None);
        assert_eq!(queue_wait_ms(&HeaderMap::new()), None);
    }

    #[test]
    fn sse_events_split_across_chunks_are_reassembled() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b":1}\n\ndata: [DO"), vec!["{\"a\":1}"]);
        assert_eq!(p.push(b"NE]\r\n\r\n: comment\n\n"), vec!["[DONE]"]);
        assert!(p.push(b"").is_empty());
    }

    #[test]
    fn payloads_are_told_apart() {
        assert_eq!(classify("[DONE]"), Payload::Done);
        assert_eq!(classify("nope"), Payload::Invalid);
        assert_eq!(
            classify(r#"{"choices":[{"index":0,"text":" the"}]}"#),
            Payload::Chunk {
                text: true,
                usage: None,
                pod_ttft: None,
            }
        );
        assert_eq!(
            classify(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#),
            Payload::Chunk {
                text: false,
                usage: None,
                pod_ttft: None,
            }
        );
        assert_eq!(
            classify(
                r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":0}},"kvroute_sim":{"queue_s":0.5,"ttft_s":0.75}}"#
            ),
            Payload::Chunk {
                text: false,
                usage: Some((Some(4), Some(9), Some(0))),
                pod_ttft: Some(0.75),
            }
        );
        assert_eq!(
            classify(r#"{"error":{"message":"boom","code":500}}"#),
            Payload::Error("boom".into())
        );
    }
}
