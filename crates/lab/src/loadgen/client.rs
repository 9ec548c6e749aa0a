//! One streamed request, measured: time to first token, the gaps between text events, end to
//! end, usage, status, the serving pod, and what went wrong.
//!
//! Times are taken on the wall clock from the moment the request is sent and multiplied by
//! `scale` (the simulator's speedup), so they come out in simulated seconds.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

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
    /// Time to first token at real scale: the pod's simulated TTFT plus `path_s` unscaled.
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

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Sends one streamed request to `url` and measures it. `timeout` is wall-clock time.
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    timeout: Duration,
    scale: f64,
) -> Outcome {
    let started = Instant::now();
    let mut out = Outcome::default();
    let response = client.post(url).json(body).timeout(timeout).send().await;
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
    if !response.status().is_success() {
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        out.e2e_s = Some(seconds(started.elapsed(), scale));
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
        out.ttft_real_scale_s = Some(pod + path);
    }
    if !done && out.error_kind.is_none() {
        out.fail(ErrorKind::Incomplete, "the stream ended without [DONE]");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
