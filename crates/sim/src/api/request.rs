//! Request bodies: the prompt's token ids (`prompt` or `messages`), the `model` resolved to the
//! base model or an adapter, and the engine request built from them.

use serde_json::Value;

use crate::engine::{FinishReason, RequestSpec};
use crate::kv::mix;
use crate::server::Pod;
use crate::tokenizer::{HfTokenizer, PromptError};
use crate::tokens::{ChatMessage, render_chat, tokenize};

use super::{ApiError, Kind};

/// A request, parsed and resolved against the pod.
pub(super) struct Parsed {
    /// Model name as requested (base or adapter).
    pub(super) model: String,
    pub(super) adapter: Option<String>,
    pub(super) prompt: Vec<u32>,
    pub(super) max_tokens: Option<u32>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
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

impl From<PromptError> for ApiError {
    fn from(e: PromptError) -> ApiError {
        ApiError::bad_request(e.to_string())
    }
}

/// Token ids of a text prompt: the model's tokenizer (vLLM's rules, see [`crate::tokenizer`])
/// when the pod has one, else the synthetic tokenizer.
fn text_tokens(
    tokenizer: Option<&HfTokenizer>,
    text: &str,
    body: &Value,
) -> Result<Vec<u32>, ApiError> {
    match tokenizer {
        Some(t) => Ok(t.encode_completion(text, body)?),
        None => Ok(tokenize(text)),
    }
}

/// The prompt's token ids: `messages` rendered and tokenized (chat), or `prompt` as text or
/// token ids (completion). `raw` is the body `body` was read from: a model's chat template
/// gets some of it in its objects' order.
pub(super) fn prompt_tokens(
    body: &Value,
    raw: &[u8],
    kind: Kind,
    tokenizer: Option<&HfTokenizer>,
) -> Result<Vec<u32>, ApiError> {
    let tokens = match kind {
        Kind::Chat => match tokenizer {
            Some(t) => t.encode_chat(raw)?,
            None => tokenize(&render_chat(&messages_of(body)?)),
        },
        Kind::Completion => match body.get("prompt") {
            Some(Value::String(s)) => text_tokens(tokenizer, s, body)?,
            Some(Value::Array(items)) => match items.first() {
                Some(Value::String(s)) => text_tokens(tokenizer, s, body)?,
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
pub(super) fn resolve_model(pod: &Pod, body: &Value) -> Result<(String, Option<String>), ApiError> {
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

pub(super) fn parse(pod: &Pod, body: &Value, raw: &[u8], kind: Kind) -> Result<Parsed, ApiError> {
    let (model, adapter) = resolve_model(pod, body)?;
    let prompt = prompt_tokens(body, raw, kind, pod.tokenizer.as_deref())?;
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
pub(super) fn spec_of(pod: &Pod, p: &Parsed, max_model_len: u32) -> Result<RequestSpec, ApiError> {
    let prompt_len = p.prompt.len() as u32;
    let prompt_hash = p
        .prompt
        .iter()
        .fold(0x5151_u64, |h, &t| mix(h, u64::from(t)));
    // The synthetic tokenizer whatever the pod's: this only seeds output lengths, which must
    // not change with `--tokenizer`.
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
