//! Prompt-only endpoints: `POST /v1/completions/render`, `/v1/chat/completions/render` and
//! `/tokenize` answer the prompt's token ids without generating.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::kv::mix;
use crate::server::Pod;

use super::request::{prompt_tokens, resolve_model};
use super::{ApiError, Kind, PodState, parse_json};

fn render(pod: &Pod, raw: &Bytes, kind: Kind) -> Result<Value, ApiError> {
    let body = parse_json(raw)?;
    let (model, _) = resolve_model(pod, &body)?;
    let tokens = prompt_tokens(&body, raw, kind, pod.tokenizer.as_deref())?;
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
fn tokenize_body(pod: &Pod, raw: &Bytes) -> Result<Value, ApiError> {
    let body = parse_json(raw)?;
    resolve_model(pod, &body)?;
    let kind = if body.get("messages").is_some() {
        Kind::Chat
    } else {
        Kind::Completion
    };
    let tokens = prompt_tokens(&body, raw, kind, pod.tokenizer.as_deref())?;
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
