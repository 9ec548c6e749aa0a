//! Parsing of OpenAI-style request bodies into what the router needs.
//!
//! Envoy hands the endpoint picker the whole body; the scheduler only needs the model name, a
//! prompt size, the output budget, whether the response streams, and a bounded prompt prefix.
//! The body is walked once by serde visitors that measure text as it streams past: no
//! `serde_json::Value` tree is built and no prompt is copied (serde_json lends unescaped strings
//! straight from the body and decodes escaped ones into one reused scratch buffer), so a 16 MiB
//! body costs little more than the body itself.
//!
//! Token estimates (no tokenizer here: the router must not depend on each model's vocabulary):
//! - text: [`estimate_tokens`], `ceil(bytes / 4)`, once per separately sent text (each batch
//!   prompt, each chat message's content);
//! - token-id prompts: one token per id;
//! - chat: [`MESSAGE_OVERHEAD_TOKENS`] per message, [`NON_TEXT_PART_TOKENS`] per non-text
//!   content part, and the estimate of the compact JSON length of `tools`, `functions` and each
//!   message's `tool_calls`, which chat templates render into the prompt;
//! - other APIs: every string value of the first present of `prompt`, `input`, `messages` counts
//!   as text (a `data:` URL as one non-text part), every number as one token id.
//!
//! A key given twice takes its last value, as Python's `json` (which vLLM uses) does.

mod body;
mod chat;
mod completions;
mod json_len;
mod loose;
mod subset;
mod text;

use serde::de::{DeserializeSeed, IgnoredAny};

pub use subset::EndpointSubset;

// The visitors reach each other through this module: each file names what it needs with
// `use super::*`.
use body::*;
use chat::*;
use completions::*;
use json_len::*;
use loose::*;
use text::*;

/// How many bytes of prompt text [`InferenceRequest::prompt_prefix`] keeps at most: 256
/// prefix-cache blocks of 64 bytes, the depth the reference picker matches.
pub const PROMPT_PREFIX_BYTES: usize = 16 * 1024;

/// Bytes per token in [`estimate_tokens`]: the usual figure for English text under BPE
/// tokenizers (GPT, Llama, Qwen families); code and non-Latin scripts run denser, so this
/// underestimates them somewhat.
pub const BYTES_PER_TOKEN: usize = 4;

/// Tokens added per chat message for its role and the template's separators (`<|im_start|>`,
/// `<|eot_id|>` and the like), which the message text itself does not show.
pub const MESSAGE_OVERHEAD_TOKENS: u32 = 4;

/// Tokens counted for each non-text chat content part (image, audio, video, file). 576 is one
/// LLaVA-1.5 image (24 × 24 patches); the real cost depends on the model's encoder and the
/// media's size, which the router cannot know without decoding it.
pub const NON_TEXT_PART_TOKENS: u32 = 576;

/// Which OpenAI API the request targets, from the HTTP path (query string ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiKind {
    /// `/v1/completions`
    Completions,
    /// `/v1/chat/completions`
    ChatCompletions,
    /// Anything else: `/v1/embeddings`, `/v1/responses`, ...
    Other,
}

impl ApiKind {
    /// Classifies an HTTP path such as Envoy's `:path` header. Matching is exact: the backends
    /// serve these routes only at these paths.
    pub fn from_path(path: &str) -> ApiKind {
        let path = path.split_once('?').map_or(path, |(path, _query)| path);
        match path {
            "/v1/completions" => ApiKind::Completions,
            "/v1/chat/completions" => ApiKind::ChatCompletions,
            _ => ApiKind::Other,
        }
    }
}

/// What the router needs from one request body. No prompt text is kept (memory, privacy)
/// except a bounded prefix for prefix-aware routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferenceRequest {
    /// As sent: a base model name or a LoRA adapter name.
    pub model: String,
    /// Estimated prompt length; see the module documentation for the rules.
    pub prompt_tokens: u32,
    /// `max_completion_tokens`, else `max_tokens`, else `None`.
    pub max_output_tokens: Option<u32>,
    /// `stream`; absent or `null` is `false`.
    pub stream: bool,
    /// The first [`PROMPT_PREFIX_BYTES`] bytes (or fewer) of the prompt text, cut at a byte, not
    /// a character, boundary. Completions: the prompt, or the first prompt of a batch (each
    /// batch prompt is its own sequence in the KV cache); empty for token-id prompts. Chat: role
    /// and content of each message in order, joined by `'\n'`, a non-text part standing as a
    /// marker with its payload's digest (`\0part:` and 16 hex digits). Other APIs: the string
    /// values measured, joined by `'\n'`.
    pub prompt_prefix: Vec<u8>,
    /// A digest of what the chat template renders into the prompt besides the messages: the
    /// `tools` and `functions` definitions (most templates put them before the first
    /// message). 0 when there are none. Requests that differ here share no prefix.
    pub prefix_context: u64,
}

/// A request as routing sees it, from the ext_proc exchange through the picker to the
/// scheduler: the parsed body, if there is one, and the gateway's subset hint.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteRequest<'a> {
    /// The parsed body; `None` for requests without one (`GET /v1/models`, or another
    /// path whose body is not an inference request): any ready pod may answer those.
    pub inference: Option<&'a InferenceRequest>,
    /// The gateway's subset hint: only these endpoints may be picked.
    pub subset: Option<&'a EndpointSubset>,
}

impl RouteRequest<'_> {
    /// The base model or adapter requested, if any.
    pub fn model(&self) -> Option<&str> {
        self.inference.map(|r| r.model.as_str())
    }

    /// Estimated prompt tokens (0 without a body).
    pub fn prompt_tokens(&self) -> u32 {
        self.inference.map_or(0, |r| r.prompt_tokens)
    }

    /// The request's `max_tokens`, if it set one.
    pub fn max_output_tokens(&self) -> Option<u32> {
        self.inference.and_then(|r| r.max_output_tokens)
    }
}

/// Why a body was refused. Every variant is the client's fault (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("request body is empty")]
    EmptyBody,
    /// serde_json's message, with line and column.
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("request body is not a JSON object")]
    NotAnObject,
    #[error("request body has no `model`")]
    MissingModel,
    #[error("invalid `{field}`: {reason}")]
    InvalidField { field: &'static str, reason: String },
}

impl RequestError {
    /// The OpenAI error `type` for this error.
    pub fn openai_type(&self) -> &'static str {
        "invalid_request_error"
    }

    /// A stable snake_case code per variant, for the OpenAI error `code` and for metric labels.
    pub fn code(&self) -> &'static str {
        match self {
            RequestError::EmptyBody => "empty_body",
            RequestError::InvalidJson(_) => "invalid_json",
            RequestError::NotAnObject => "not_an_object",
            RequestError::MissingModel => "missing_model",
            RequestError::InvalidField { .. } => "invalid_field",
        }
    }

    /// The top-level request field at fault, for the OpenAI error `param`.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            RequestError::MissingModel => Some("model"),
            RequestError::InvalidField { field, .. } => Some(field),
            _ => None,
        }
    }
}

/// Estimates the tokens in `text_bytes` bytes of text: `ceil(bytes / BYTES_PER_TOKEN)`,
/// saturating at `u32::MAX`.
pub fn estimate_tokens(text_bytes: usize) -> u32 {
    u32::try_from(text_bytes.div_ceil(BYTES_PER_TOKEN)).unwrap_or(u32::MAX)
}

/// Parses the body of a request to `api`.
pub fn parse_request(api: ApiKind, body: &[u8]) -> Result<InferenceRequest, RequestError> {
    let Some(&first) = body
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
    else {
        return Err(RequestError::EmptyBody);
    };
    if first != b'{' {
        // Tell "valid JSON, wrong type" from "not JSON" without building anything.
        return Err(match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => RequestError::NotAnObject,
            Err(err) => RequestError::InvalidJson(err.to_string()),
        });
    }

    let mut field = None;
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = BodySeed {
        api,
        field: &mut field,
    }
    .deserialize(&mut de)
    .and_then(|fields| de.end().map(|()| fields));
    let fields = parsed.map_err(|err| body_error(&err, field))?;

    let model = fields.model.ok_or(RequestError::MissingModel)?;
    let prompt = match api {
        ApiKind::Completions => fields.prompt.ok_or_else(|| required("prompt"))?,
        ApiKind::ChatCompletions => {
            let mut prompt = fields.messages.ok_or_else(|| required("messages"))?;
            prompt.add_tokens(estimate_tokens(fields.tools.len));
            prompt.add_tokens(estimate_tokens(fields.functions.len));
            prompt
        }
        ApiKind::Other => fields
            .prompt
            .or(fields.input)
            .or(fields.messages)
            .unwrap_or_default(),
    };
    Ok(InferenceRequest {
        model,
        prompt_tokens: u32::try_from(prompt.tokens).unwrap_or(u32::MAX),
        max_output_tokens: fields.max_completion_tokens.or(fields.max_tokens),
        stream: fields.stream.unwrap_or(false),
        prompt_prefix: prompt.prefix.bytes,
        prefix_context: match (fields.tools.digest, fields.functions.digest) {
            (0, 0) => 0,
            (tools, functions) => json_len::mix(tools, functions).max(1),
        },
    })
}

/// Maps a serde_json error to ours: a data error (wrong type or value) raised while a known
/// field was being read belongs to that field; anything else is malformed JSON.
fn body_error(err: &serde_json::Error, field: Option<&'static str>) -> RequestError {
    match (err.classify(), field) {
        (serde_json::error::Category::Data, Some(field)) => RequestError::InvalidField {
            field,
            reason: err.to_string(),
        },
        _ => RequestError::InvalidJson(err.to_string()),
    }
}

fn required(field: &'static str) -> RequestError {
    RequestError::InvalidField {
        field,
        reason: "is required".to_owned(),
    }
}

#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;
