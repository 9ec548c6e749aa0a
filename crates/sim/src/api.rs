//! The HTTP API of one simulated pod: vLLM's OpenAI-compatible endpoints and what the peer routers
//! ask of a worker (REFERENCE.md §5). Unknown request fields are ignored.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::engine::{FinishReason, RequestId, RequestSpec, Summary};
use super::kv::mix;
use super::server::{Out, Pod};
use super::tokens::{ChatMessage, output_token, render_chat, tokenize};

type PodState = State<Arc<Pod>>;

/// An error answered in vLLM's JSON shape.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "BadRequestError",
            param: None,
        }
    }

    fn not_found(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "NotFoundError",
            param,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }
        });
        (self.status, axum::Json(body)).into_response()
    }
}

fn parse_json(body: &Bytes) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    if v.is_object() {
        Ok(v)
    } else {
        Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// A request, parsed and resolved against the pod.
struct Parsed {
    /// Model name as requested (base or adapter).
    model: String,
    adapter: Option<String>,
    prompt: Vec<u32>,
    max_tokens: Option<u32>,
    stream: bool,
    include_usage: bool,
}

fn text_of_content(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

fn messages_of(body: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_request("'messages' must be a list"))?;
    Ok(msgs
        .iter()
        .map(|m| ChatMessage {
            role: m
                .get("role")
                .and_then(Value::as_str)
                .unwrap_or("user")
                .to_string(),
            content: m.get("content").map(text_of_content).unwrap_or_default(),
        })
        .collect())
}

fn ids_of(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

fn prompt_tokens(body: &Value, kind: Kind) -> Result<Vec<u32>, ApiError> {
    let tokens = match kind {
        Kind::Chat => tokenize(&render_chat(&messages_of(body)?)),
        Kind::Completion => match body.get("prompt") {
            Some(Value::String(s)) => tokenize(s),
            Some(Value::Array(items)) => match items.first() {
                Some(Value::String(s)) => tokenize(s),
                Some(Value::Array(inner)) => ids_of(inner)
                    .ok_or_else(|| ApiError::bad_request("token ids must be integers"))?,
                Some(_) => {
                    ids_of(items).ok_or_else(|| ApiError::bad_request("invalid 'prompt'"))?
                }
                None => Vec::new(),
            },
            _ => return Err(ApiError::bad_request("'prompt' is required")),
        },
    };
    if tokens.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    Ok(tokens)
}

/// Resolves `model` to the base model or one of the pod's adapters; unknown → 404.
fn resolve_model(pod: &Pod, body: &Value) -> Result<(String, Option<String>), ApiError> {
    let Some(name) = body.get("model").and_then(Value::as_str) else {
        return Ok((pod.model.clone(), None));
    };
    if name == pod.model {
        return Ok((name.to_string(), None));
    }
    if pod.lock().adapters.iter().any(|a| a == name) {
        return Ok((name.to_string(), Some(name.to_string())));
    }
    Err(ApiError::not_found(
        format!("The model `{name}` does not exist."),
        Some("model"),
    ))
}

fn parse(pod: &Pod, body: &Value, kind: Kind) -> Result<Parsed, ApiError> {
    let (model, adapter) = resolve_model(pod, body)?;
    let prompt = prompt_tokens(body, kind)?;
    let max_tokens = match body
        .get("max_completion_tokens")
        .filter(|v| !v.is_null())
        .or_else(|| body.get("max_tokens").filter(|v| !v.is_null()))
    {
        None => None,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Some(u32::try_from(n).unwrap_or(u32::MAX)),
            _ => {
                return Err(ApiError::bad_request(
                    "max_tokens must be at least 1, got invalid value",
                ));
            }
        },
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Parsed {
        model,
        adapter,
        prompt,
        max_tokens,
        stream,
        include_usage,
    })
}

/// Mean output length when the request gives no `max_tokens`.
const MEAN_FREE_OUTPUT: f64 = 200.0;

/// Builds the engine request: output length from `max_tokens` (exactly that many, finish
/// `length`), else drawn from a seeded exponential (finish `stop`).
fn spec_of(pod: &Pod, p: &Parsed, max_model_len: u32) -> Result<RequestSpec, ApiError> {
    let prompt_len = p.prompt.len() as u32;
    let prompt_hash = p
        .prompt
        .iter()
        .fold(0x5151_u64, |h, &t| mix(h, u64::from(t)));
    let adapter_hash = p.adapter.as_deref().map_or(0, |a| {
        tokenize(a).iter().fold(1, |h, &t| mix(h, u64::from(t)))
    });
    let output_seed = mix(
        mix(pod.seed, prompt_hash),
        adapter_hash ^ u64::from(p.max_tokens.unwrap_or(0)),
    );
    let room = max_model_len.saturating_sub(prompt_len);
    let (max_output, finish_reason) = match p.max_tokens {
        Some(n) => {
            if u64::from(prompt_len) + u64::from(n) > u64::from(max_model_len) {
                return Err(ApiError::bad_request(format!(
                    "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt_len} in the messages, {n} in the completion). Please reduce the length of the messages or completion.",
                    u64::from(prompt_len) + u64::from(n)
                )));
            }
            (n, FinishReason::Length)
        }
        None => {
            if room == 0 {
                return Err(ApiError::bad_request(format!(
                    "This model's maximum context length is {max_model_len} tokens. However, your request has {prompt_len} input tokens. Please reduce the length of the input messages."
                )));
            }
            let u = (mix(output_seed, 0x0u64) >> 11) as f64 / (1u64 << 53) as f64;
            let len = (-(1.0 - u).ln() * MEAN_FREE_OUTPUT).ceil().max(1.0) as u32;
            (len.min(room).min(4096), FinishReason::Stop)
        }
    };
    Ok(RequestSpec {
        prompt: p.prompt.clone(),
        adapter: p.adapter.clone(),
        max_output,
        finish_reason,
        output_seed,
    })
}

/// Cancels the engine request if the response is dropped before it completes.
struct AbortGuard {
    pod: Arc<Pod>,
    id: RequestId,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            self.pod.abort(self.id);
        }
    }
}

fn usage_json(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "completion_tokens": s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    })
}

/// The pod's timing of one request, simulated seconds from its arrival at the pod.
fn timing_json(s: &Summary) -> Value {
    json!({
        "queue_s": s.queue.as_secs_f64(),
        "ttft_s": s.ttft.as_secs_f64(),
    })
}

fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn ms(d: std::time::Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

async fn generate(pod: Arc<Pod>, body: Bytes, kind: Kind) -> Result<Response, ApiError> {
    let body = parse_json(&body)?;
    let parsed = parse(&pod, &body, kind)?;
    let max_model_len = pod.lock().engine.max_model_len();
    let spec = spec_of(&pod, &parsed, max_model_len)?;
    let output_seed = spec.output_seed;
    let max_output = spec.max_output;
    let finish = finish_str(spec.finish_reason);
    let Some((id, rx)) = pod.submit(spec) else {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is shutting down".into(),
            kind: "ServiceUnavailableError",
            param: None,
        });
    };
    let guard = AbortGuard {
        pod: pod.clone(),
        id,
        armed: true,
    };
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let fmt = Format {
        kind,
        id: pod.response_id(prefix, id),
        created: unix_now(),
        model_json: Value::String(parsed.model.clone()).to_string(),
        output_seed,
        max_output,
        finish,
        include_usage: parsed.include_usage,
    };
    if parsed.stream {
        Ok(stream_response(fmt, rx, guard))
    } else {
        complete_response(fmt, rx, guard).await
    }
}

/// How to write a response's chunks.
struct Format {
    kind: Kind,
    id: String,
    created: u64,
    model_json: String,
    output_seed: u64,
    max_output: u32,
    finish: &'static str,
    include_usage: bool,
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

fn stream_response(fmt: Format, rx: mpsc::UnboundedReceiver<Out>, guard: AbortGuard) -> Response {
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

async fn complete_response(
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

/// `POST /v1/completions`.
pub(crate) async fn completions(State(pod): PodState, body: Bytes) -> Response {
    generate(pod, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(State(pod): PodState, body: Bytes) -> Response {
    generate(pod, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn render(pod: &Pod, body: &Bytes, kind: Kind) -> Result<Value, ApiError> {
    let body = parse_json(body)?;
    let (model, _) = resolve_model(pod, &body)?;
    let tokens = prompt_tokens(&body, kind)?;
    let max_tokens = body.get("max_tokens").cloned().unwrap_or(Value::Null);
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let seq = tokens.iter().fold(7u64, |h, &t| mix(h, u64::from(t)));
    Ok(json!({
        "request_id": pod.response_id(prefix, seq),
        "token_ids": tokens,
        "features": null,
        "sampling_params": {"max_tokens": max_tokens},
        "model": model,
    }))
}

/// `POST /v1/completions/render`: a list with one rendered prompt (vLLM's shape).
pub(crate) async fn completions_render(State(pod): PodState, body: Bytes) -> Response {
    match render(&pod, &body, Kind::Completion) {
        Ok(v) => axum::Json(Value::Array(vec![v])).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/chat/completions/render`: the rendered conversation's token ids.
pub(crate) async fn chat_render(State(pod): PodState, body: Bytes) -> Response {
    match render(&pod, &body, Kind::Chat) {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /tokenize`: `prompt` or `messages`.
fn tokenize_body(pod: &Pod, body: &Bytes) -> Result<Value, ApiError> {
    let body = parse_json(body)?;
    resolve_model(pod, &body)?;
    let kind = if body.get("messages").is_some() {
        Kind::Chat
    } else {
        Kind::Completion
    };
    let tokens = prompt_tokens(&body, kind)?;
    let max_model_len = pod.lock().engine.max_model_len();
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": null,
    }))
}

/// `POST /tokenize`.
pub(crate) async fn tokenize_endpoint(State(pod): PodState, body: Bytes) -> Response {
    match tokenize_body(&pod, &body) {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/models`: the base model, then each adapter with its `parent`.
pub(crate) async fn models(State(pod): PodState) -> Response {
    let (adapters, max_model_len) = {
        let core = pod.lock();
        (core.adapters.clone(), core.engine.max_model_len())
    };
    let card = |id: &str, root: &str, parent: Option<&str>| {
        json!({
            "id": id, "object": "model", "created": pod.created, "owned_by": "vllm",
            "root": root, "parent": parent, "max_model_len": max_model_len,
            "permission": [{
                "id": format!("modelperm-{id}"), "object": "model_permission",
                "created": pod.created, "allow_create_engine": false, "allow_sampling": true,
                "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                "allow_fine_tuning": false, "organization": "*", "group": null,
                "is_blocking": false,
            }],
        })
    };
    let mut data = vec![card(&pod.model, &pod.model, None)];
    for a in &adapters {
        data.push(card(a, &format!("/adapters/{a}"), Some(&pod.model)));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

fn lora_name(body: &Value) -> Result<String, ApiError> {
    body.get("lora_name")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .ok_or_else(|| ApiError::bad_request("'lora_name' is required"))
}

/// `POST /v1/load_lora_adapter`: registers an adapter (it loads into a slot on first use).
pub(crate) async fn load_lora(State(pod): PodState, body: Bytes) -> Response {
    let result = (|| {
        let body = parse_json(&body)?;
        let name = lora_name(&body)?;
        let mut core = pod.lock();
        if !core.engine.lora_enabled() {
            return Err(ApiError::bad_request(
                "LoRA is not enabled on this server (max_loras is 0).",
            ));
        }
        if name == pod.model || core.adapters.contains(&name) {
            return Err(ApiError {
                status: StatusCode::BAD_REQUEST,
                message: format!("The lora adapter '{name}' has already been loaded."),
                kind: "InvalidUserInput",
                param: None,
            });
        }
        core.adapters.push(name.clone());
        Ok(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    })();
    match result {
        Ok(text) => (StatusCode::OK, text).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/unload_lora_adapter`.
pub(crate) async fn unload_lora(State(pod): PodState, body: Bytes) -> Response {
    let result = (|| {
        let body = parse_json(&body)?;
        let name = lora_name(&body)?;
        let mut core = pod.lock();
        let Some(i) = core.adapters.iter().position(|a| a == &name) else {
            return Err(ApiError::not_found(
                format!("The lora adapter '{name}' cannot be found."),
                None,
            ));
        };
        core.adapters.remove(i);
        core.engine.unload_adapter(&name);
        Ok(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    })();
    match result {
        Ok(text) => (StatusCode::OK, text).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /health`: 200 with an empty body.
pub(crate) async fn health() -> StatusCode {
    StatusCode::OK
}

/// `GET /metrics`.
pub(crate) async fn metrics(State(pod): PodState) -> Response {
    let text = pod.metrics();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// `GET /get_load` (SGLang's shape, used by power-of-two routing).
pub(crate) async fn get_load(State(pod): PodState) -> Response {
    let l = pod.load();
    axum::Json(json!([{
        "dp_rank": 0,
        "num_reqs": l.running + l.waiting,
        "num_waiting_reqs": l.waiting,
        "num_tokens": l.tokens_in_use,
    }]))
    .into_response()
}

/// `GET /server_info`, `/get_server_info`.
pub(crate) async fn server_info(State(pod): PodState) -> Response {
    let core = pod.lock();
    let cfg = core.engine.config();
    let body = json!({
        "model_path": pod.model,
        "served_model_name": pod.model,
        "max_total_num_tokens": u64::from(cfg.num_gpu_blocks) * u64::from(cfg.block_size),
        "max_running_requests": cfg.max_num_seqs,
        "chunked_prefill_size": cfg.max_num_batched_tokens,
        "page_size": cfg.block_size,
        "context_length": core.engine.max_model_len(),
        "max_loras_per_batch": cfg.max_loras,
        "dp_size": 1,
        "tp_size": 1,
        "profile": core.engine.profile().name,
        "simulated": true,
    });
    drop(core);
    axum::Json(body).into_response()
}

/// `GET /model_info`, `/get_model_info`.
pub(crate) async fn model_info(State(pod): PodState) -> Response {
    axum::Json(json!({
        "model_path": pod.model,
        "tokenizer_path": pod.model,
        "is_generation": true,
    }))
    .into_response()
}

/// `GET /version`.
pub(crate) async fn version() -> Response {
    axum::Json(json!({"version": concat!("kvroute-sim-", env!("CARGO_PKG_VERSION"))}))
        .into_response()
}

/// Anything else: 404 in vLLM's error shape.
pub(crate) async fn not_found() -> Response {
    ApiError::not_found("Not Found", None).into_response()
}
