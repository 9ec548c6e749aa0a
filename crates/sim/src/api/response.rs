//! Writing a generation's answer in vLLM's shapes: an SSE stream of coalesced chunks (role,
//! tokens, usage with the pod's timing) or, unstreamed, the whole JSON body with `x-sim-*` headers.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::Summary;
use crate::server::Out;
use crate::tokens::output_token;

use super::generate::AbortGuard;
use super::{ApiError, Kind};

/// The usage object as vLLM writes it with `--enable-prompt-tokens-details`: the details
/// only when some of the prompt came from the prefix cache (vLLM leaves them out at 0).
fn usage_json(s: &Summary) -> Value {
    let mut usage = json!({
        "prompt_tokens": s.prompt_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "completion_tokens": s.completion_tokens,
    });
    if s.cached_tokens > 0 {
        usage["prompt_tokens_details"] = json!({"cached_tokens": s.cached_tokens});
    }
    usage
}

/// The pod's timing of one request, simulated seconds from its arrival at the pod.
fn timing_json(s: &Summary) -> Value {
    json!({
        "queue_s": s.queue.as_secs_f64(),
        "ttft_s": s.ttft.as_secs_f64(),
    })
}

fn ms(d: std::time::Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

/// How to write a response's chunks.
pub(super) struct Format {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model_json: String,
    pub(super) output_seed: u64,
    pub(super) max_output: u32,
    pub(super) finish: &'static str,
    pub(super) include_usage: bool,
}

impl Format {
    fn object(&self) -> &'static str {
        match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }

    fn head(&self) -> String {
        format!(
            r#"{{"id":"{}","object":"{}","created":{},"model":{},"choices":["#,
            self.id,
            self.object(),
            self.created,
            self.model_json
        )
    }

    /// One SSE event for token `index`.
    fn token_chunk(&self, out: &mut String, index: u32) {
        let (_, word) = output_token(self.output_seed, index);
        let finish = if index + 1 >= self.max_output {
            format!("\"{}\"", self.finish)
        } else {
            "null".to_string()
        };
        out.push_str("data: ");
        out.push_str(&self.head());
        match self.kind {
            Kind::Completion => out.push_str(&format!(
                r#"{{"index":0,"text":"{word}","logprobs":null,"finish_reason":{finish},"stop_reason":null}}]}}"#
            )),
            Kind::Chat => out.push_str(&format!(
                r#"{{"index":0,"delta":{{"content":"{word}"}},"logprobs":null,"finish_reason":{finish},"stop_reason":null}}]}}"#
            )),
        }
        out.push_str("\n\n");
    }

    fn role_chunk(&self, out: &mut String) {
        out.push_str("data: ");
        out.push_str(&self.head());
        out.push_str(
            r#"{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
        );
        out.push_str("\n\n");
    }

    /// The usage chunk, which also carries the pod's own timing of the request in
    /// simulated seconds (`kvroute_sim`, not an OpenAI field): benchmarks read it to
    /// separate where a request waited from what the client's wall clock adds.
    fn usage_chunk(&self, out: &mut String, s: &Summary) {
        out.push_str("data: ");
        out.push_str(&self.head());
        out.push_str("],\"usage\":");
        out.push_str(&usage_json(s).to_string());
        out.push_str(",\"kvroute_sim\":");
        out.push_str(&timing_json(s).to_string());
        out.push_str("}\n\n");
    }
}

struct StreamState {
    fmt: Format,
    rx: mpsc::UnboundedReceiver<Out>,
    guard: AbortGuard,
    started: bool,
    done: bool,
}

impl StreamState {
    /// Appends the SSE text for one event; returns whether the stream is complete.
    fn write(&mut self, out: &mut String, ev: Out) -> bool {
        if !self.started {
            self.started = true;
            if self.fmt.kind == Kind::Chat {
                self.fmt.role_chunk(out);
            }
        }
        match ev {
            Out::Token { index } => {
                self.fmt.token_chunk(out, index);
                false
            }
            Out::Done(s) => {
                if self.fmt.include_usage {
                    self.fmt.usage_chunk(out, &s);
                }
                out.push_str("data: [DONE]\n\n");
                self.guard.armed = false;
                true
            }
        }
    }
}

pub(super) fn stream_response(
    fmt: Format,
    rx: mpsc::UnboundedReceiver<Out>,
    guard: AbortGuard,
) -> Response {
    let state = StreamState {
        fmt,
        rx,
        guard,
        started: false,
        done: false,
    };
    let stream = futures::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let first = st.rx.recv().await?;
        let mut out = String::with_capacity(512);
        st.done = st.write(&mut out, first);
        // Coalesce whatever else is already there into one write.
        while !st.done {
            match st.rx.try_recv() {
                Ok(ev) => st.done = st.write(&mut out, ev),
                Err(_) => break,
            }
        }
        Some((Ok::<Bytes, Infallible>(Bytes::from(out)), st))
    });
    let mut res = Response::new(Body::from_stream(stream));
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

pub(super) async fn complete_response(
    fmt: Format,
    mut rx: mpsc::UnboundedReceiver<Out>,
    mut guard: AbortGuard,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut summary = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            Out::Token { index } => text.push_str(output_token(fmt.output_seed, index).1),
            Out::Done(s) => {
                summary = Some(s);
                break;
            }
        }
    }
    guard.armed = false;
    let Some(s) = summary else {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is shutting down".into(),
            kind: "ServiceUnavailableError",
            param: None,
        });
    };
    let model: Value = serde_json::from_str(&fmt.model_json).unwrap_or(Value::Null);
    let choice = match fmt.kind {
        Kind::Completion => json!({
            "index": 0, "text": text, "logprobs": null,
            "finish_reason": fmt.finish, "stop_reason": null, "prompt_logprobs": null,
        }),
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": null,
                        "annotations": null, "audio": null, "function_call": null,
                        "tool_calls": [], "reasoning_content": null},
            "logprobs": null, "finish_reason": fmt.finish, "stop_reason": null,
        }),
    };
    let object = match fmt.kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion",
    };
    let body = json!({
        "id": fmt.id, "object": object, "created": fmt.created, "model": model,
        "choices": [choice], "usage": usage_json(&s),
        "system_fingerprint": null, "prompt_logprobs": null, "kv_transfer_params": null,
    });
    let mut res = axum::Json(body).into_response();
    let h = res.headers_mut();
    for (name, value) in [
        ("x-sim-arrival-ms", ms(s.arrival)),
        ("x-sim-queue-ms", ms(s.queue)),
        ("x-sim-ttft-ms", ms(s.ttft)),
        ("x-sim-e2e-ms", ms(s.e2e)),
        ("x-sim-preemptions", s.preemptions.to_string()),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    }
    Ok(res)
}
