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

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{
    self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Unexpected, Visitor,
};

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
    /// and text content of each message in order, joined by `'\n'`; non-text parts are left
    /// out. Other APIs: the string values measured, joined by `'\n'`.
    pub prompt_prefix: Vec<u8>,
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
            prompt.add_tokens(estimate_tokens(fields.tools));
            prompt.add_tokens(estimate_tokens(fields.functions));
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

/// The first bytes of a text built from pieces joined by `'\n'`, never longer than `limit`.
struct Prefix {
    bytes: Vec<u8>,
    pieces: usize,
    limit: usize,
}

impl Prefix {
    fn new(limit: usize) -> Prefix {
        Prefix {
            bytes: Vec::new(),
            pieces: 0,
            limit,
        }
    }

    fn reset(&mut self, limit: usize) {
        self.bytes.clear();
        self.pieces = 0;
        self.limit = limit;
    }

    fn room(&self) -> usize {
        self.limit.saturating_sub(self.bytes.len())
    }

    fn push(&mut self, piece: &[u8]) {
        if self.pieces > 0 {
            self.extend(b"\n");
        }
        self.extend(piece);
        self.pieces += 1;
    }

    fn extend(&mut self, bytes: &[u8]) {
        let kept = bytes.get(..self.room()).unwrap_or(bytes);
        self.bytes.extend_from_slice(kept);
    }
}

/// The measure of a prompt: its token estimate and its bounded prefix.
struct Prompt {
    tokens: u64,
    prefix: Prefix,
}

impl Default for Prompt {
    fn default() -> Prompt {
        Prompt {
            tokens: 0,
            prefix: Prefix::new(PROMPT_PREFIX_BYTES),
        }
    }
}

impl Prompt {
    fn add_tokens(&mut self, tokens: impl Into<u64>) {
        self.tokens = self.tokens.saturating_add(tokens.into());
    }

    /// Counts `text` as one separately tokenized text and appends it to the prefix.
    fn add_text(&mut self, text: &[u8]) {
        self.add_tokens(estimate_tokens(text.len()));
        self.prefix.push(text);
    }
}

/// The top-level fields that matter; absent and `null` are both `None`.
#[derive(Default)]
struct Fields {
    model: Option<String>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    stream: Option<bool>,
    prompt: Option<Prompt>,
    input: Option<Prompt>,
    messages: Option<Prompt>,
    /// Compact JSON length of `tools` and `functions` (chat only), 0 when absent.
    tools: usize,
    functions: usize,
}

/// Reads the top-level object. `field` names the field being read, so that an error raised
/// inside it can be reported against it.
struct BodySeed<'f> {
    api: ApiKind,
    field: &'f mut Option<&'static str>,
}

impl<'de> DeserializeSeed<'de> for BodySeed<'_> {
    type Value = Fields;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Fields, D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_> {
    type Value = Fields;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a request object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
        let mut fields = Fields::default();
        let chat = self.api == ApiKind::ChatCompletions;
        let other = self.api == ApiKind::Other;
        while let Some(key) = map.next_key_seed(KeySeed::<TopKey>(PhantomData))? {
            *self.field = key.name();
            match key {
                TopKey::Model => fields.model = map.next_value::<Option<ModelName>>()?.map(|m| m.0),
                TopKey::MaxTokens => {
                    fields.max_tokens = map.next_value::<Option<TokenLimit>>()?.map(|l| l.0);
                }
                TopKey::MaxCompletionTokens => {
                    fields.max_completion_tokens =
                        map.next_value::<Option<TokenLimit>>()?.map(|l| l.0);
                }
                TopKey::Stream => fields.stream = map.next_value()?,
                TopKey::Prompt if self.api == ApiKind::Completions => {
                    fields.prompt = map.next_value_seed(PromptSeed)?;
                }
                TopKey::Messages if chat => fields.messages = map.next_value_seed(MessagesSeed)?,
                TopKey::Tools if chat => fields.tools = map.next_value::<JsonLen>()?.0,
                TopKey::Functions if chat => fields.functions = map.next_value::<JsonLen>()?.0,
                TopKey::Prompt | TopKey::Input | TopKey::Messages if other => {
                    let mut prompt = Prompt::default();
                    let present = map.next_value_seed(LooseText {
                        prompt: &mut prompt,
                    })?;
                    let slot = match key {
                        TopKey::Prompt => &mut fields.prompt,
                        TopKey::Input => &mut fields.input,
                        _ => &mut fields.messages,
                    };
                    *slot = present.then_some(prompt);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            *self.field = None;
        }
        Ok(fields)
    }
}

/// An object key matched against the names a visitor cares about. Keys are only borrowed for
/// the match, so even escaped or huge unknown keys allocate nothing.
trait KeyName: Sized {
    fn from_name(name: &str) -> Self;
}

struct KeySeed<K>(PhantomData<K>);

impl<'de, K: KeyName> DeserializeSeed<'de> for KeySeed<K> {
    type Value = K;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<K, D::Error> {
        de.deserialize_str(self)
    }
}

impl<K: KeyName> Visitor<'_> for KeySeed<K> {
    type Value = K;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<K, E> {
        Ok(K::from_name(name))
    }
}

#[derive(Clone, Copy)]
enum TopKey {
    Model,
    MaxTokens,
    MaxCompletionTokens,
    Stream,
    Prompt,
    Input,
    Messages,
    Tools,
    Functions,
    Ignored,
}

impl KeyName for TopKey {
    fn from_name(name: &str) -> TopKey {
        match name {
            "model" => TopKey::Model,
            "max_tokens" => TopKey::MaxTokens,
            "max_completion_tokens" => TopKey::MaxCompletionTokens,
            "stream" => TopKey::Stream,
            "prompt" => TopKey::Prompt,
            "input" => TopKey::Input,
            "messages" => TopKey::Messages,
            "tools" => TopKey::Tools,
            "functions" => TopKey::Functions,
            _ => TopKey::Ignored,
        }
    }
}

impl TopKey {
    fn name(self) -> Option<&'static str> {
        Some(match self {
            TopKey::Model => "model",
            TopKey::MaxTokens => "max_tokens",
            TopKey::MaxCompletionTokens => "max_completion_tokens",
            TopKey::Stream => "stream",
            TopKey::Prompt => "prompt",
            TopKey::Input => "input",
            TopKey::Messages => "messages",
            TopKey::Tools => "tools",
            TopKey::Functions => "functions",
            TopKey::Ignored => return None,
        })
    }
}

/// `model`: a non-empty string.
struct ModelName(String);

impl<'de> Deserialize<'de> for ModelName {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<ModelName, D::Error> {
        de.deserialize_str(ModelNameVisitor)
    }
}

struct ModelNameVisitor;

impl Visitor<'_> for ModelNameVisitor {
    type Value = ModelName;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a non-empty string")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<ModelName, E> {
        if name.is_empty() {
            return Err(E::invalid_value(Unexpected::Str(name), &self));
        }
        Ok(ModelName(name.to_owned()))
    }
}

/// `max_tokens` / `max_completion_tokens`: a non-negative integer, saturated to `u32`. JSON has
/// one number type, so integral floats (`100.0`, `1e3`) count as integers, as the backends'
/// validation also accepts them.
struct TokenLimit(u32);

impl<'de> Deserialize<'de> for TokenLimit {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<TokenLimit, D::Error> {
        de.deserialize_any(TokenLimitVisitor)
    }
}

struct TokenLimitVisitor;

impl Visitor<'_> for TokenLimitVisitor {
    type Value = TokenLimit;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a non-negative integer")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<TokenLimit, E> {
        Ok(TokenLimit(u32::try_from(v).unwrap_or(u32::MAX)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<TokenLimit, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(E::invalid_value(Unexpected::Signed(v), &self)),
        }
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<TokenLimit, E> {
        if v >= 0.0 && v.fract() == 0.0 {
            // `as` saturates float-to-int conversions, which is the rule for huge values.
            Ok(TokenLimit(v as u32))
        } else {
            Err(E::invalid_value(Unexpected::Float(v), &self))
        }
    }
}

/// `prompt` of `/v1/completions`: a string, or a batch of strings, token ids or token id
/// arrays. `null` reads as absent.
struct PromptSeed;

impl<'de> DeserializeSeed<'de> for PromptSeed {
    type Value = Option<Prompt>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Option<Prompt>, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed {
    type Value = Option<Prompt>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, an array of strings, an array of token ids or an array of arrays")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<Prompt>, E> {
        Ok(None)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Option<Prompt>, E> {
        let mut prompt = Prompt::default();
        prompt.add_text(text.as_bytes());
        Ok(Some(prompt))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Prompt>, A::Error> {
        let mut prompt = Prompt::default();
        let mut index = 0;
        while seq
            .next_element_seed(PromptItem {
                prompt: &mut prompt,
                index,
            })?
            .is_some()
        {
            index += 1;
        }
        Ok(Some(prompt))
    }
}

/// One element of a `prompt` array. Mixed arrays are measured too: shape rules beyond what the
/// estimate needs are the backend's to enforce.
struct PromptItem<'a> {
    prompt: &'a mut Prompt,
    index: usize,
}

impl<'de> DeserializeSeed<'de> for PromptItem<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptItem<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "prompt[{}] to be a string, a token id or an array of token ids",
            self.index
        )
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<(), E> {
        if self.index == 0 {
            self.prompt.add_text(text.as_bytes());
        } else {
            self.prompt.add_tokens(estimate_tokens(text.len()));
        }
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _id: u64) -> Result<(), E> {
        self.prompt.add_tokens(1u32);
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _id: i64) -> Result<(), E> {
        self.prompt.add_tokens(1u32);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut ids = 0u64;
        while seq.next_element::<TokenId>()?.is_some() {
            ids += 1;
        }
        self.prompt.add_tokens(ids);
        Ok(())
    }
}

/// A token id: any integer (range checks are the backend's).
struct TokenId;

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<TokenId, D::Error> {
        de.deserialize_any(TokenId)
    }
}

impl Visitor<'_> for TokenId {
    type Value = TokenId;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token id (an integer)")
    }

    fn visit_u64<E: de::Error>(self, _id: u64) -> Result<TokenId, E> {
        Ok(TokenId)
    }

    fn visit_i64<E: de::Error>(self, _id: i64) -> Result<TokenId, E> {
        Ok(TokenId)
    }
}

/// `messages` of `/v1/chat/completions`: a non-empty array. `null` reads as absent.
struct MessagesSeed;

impl<'de> DeserializeSeed<'de> for MessagesSeed {
    type Value = Option<Prompt>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Option<Prompt>, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed {
    type Value = Option<Prompt>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a non-empty array of messages")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<Prompt>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Prompt>, A::Error> {
        let mut prompt = Prompt::default();
        // One buffer for every message's content text, which may arrive before its role.
        let mut text = Prefix::new(0);
        let mut index = 0;
        while seq
            .next_element_seed(MessageSeed {
                prompt: &mut prompt,
                text: &mut text,
                index,
            })?
            .is_some()
        {
            index += 1;
        }
        if index == 0 {
            return Err(de::Error::invalid_length(0, &self));
        }
        Ok(Some(prompt))
    }
}

/// One chat message: `role` (required), `content`, `tool_calls`; other keys are ignored.
struct MessageSeed<'a> {
    prompt: &'a mut Prompt,
    text: &'a mut Prefix,
    index: usize,
}

impl<'de> DeserializeSeed<'de> for MessageSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "messages[{}] to be an object", self.index)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let index = self.index;
        // The message's share of the prompt prefix can be no more than what is left of it.
        let room = self.prompt.prefix.room();
        let mut content = Content {
            text: self.text,
            text_bytes: 0,
            non_text_parts: 0,
        };
        content.reset(room);
        let mut role = None;
        let mut tool_calls = 0;
        while let Some(key) = map.next_key_seed(KeySeed::<MessageKey>(PhantomData))? {
            match key {
                MessageKey::Role => {
                    role = Some(map.next_value_seed(HeadSeed(Place::Role { index }))?);
                }
                MessageKey::Content => {
                    content.reset(room);
                    map.next_value_seed(ContentSeed {
                        content: &mut content,
                        index,
                    })?;
                }
                MessageKey::ToolCalls => tool_calls = map.next_value::<JsonLen>()?.0,
                MessageKey::Ignored => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let Some(role) = role else {
            return Err(de::Error::custom(format_args!(
                "messages[{index}] has no `role`"
            )));
        };

        let prompt = self.prompt;
        prompt.add_tokens(MESSAGE_OVERHEAD_TOKENS);
        prompt.add_tokens(estimate_tokens(content.text_bytes));
        prompt.add_tokens(
            content
                .non_text_parts
                .saturating_mul(NON_TEXT_PART_TOKENS.into()),
        );
        prompt.add_tokens(estimate_tokens(tool_calls));
        prompt.prefix.push(&role.head);
        if content.text.pieces > 0 {
            prompt.prefix.push(&content.text.bytes);
        }
        Ok(())
    }
}

enum MessageKey {
    Role,
    Content,
    ToolCalls,
    Ignored,
}

impl KeyName for MessageKey {
    fn from_name(name: &str) -> MessageKey {
        match name {
            "role" => MessageKey::Role,
            "content" => MessageKey::Content,
            "tool_calls" => MessageKey::ToolCalls,
            _ => MessageKey::Ignored,
        }
    }
}

/// The measure of one message's content: text parts (joined by `'\n'` into `text`, bounded)
/// and the count of non-text parts.
struct Content<'t> {
    text: &'t mut Prefix,
    text_bytes: usize,
    non_text_parts: u64,
}

impl Content<'_> {
    fn reset(&mut self, room: usize) {
        self.text.reset(room);
        self.text_bytes = 0;
        self.non_text_parts = 0;
    }

    /// `len` is the full text length; `head` its first bytes, enough for the prefix.
    fn add_text(&mut self, len: usize, head: &[u8]) {
        self.text_bytes = self.text_bytes.saturating_add(len);
        self.text.push(head);
    }
}

/// `content` of a message: a string, `null`, or an array of content parts.
struct ContentSeed<'a, 't> {
    content: &'a mut Content<'t>,
    index: usize,
}

impl<'de> DeserializeSeed<'de> for ContentSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "messages[{}].content to be a string, an array of content parts or null",
            self.index
        )
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<(), E> {
        self.content.add_text(text.len(), text.as_bytes());
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut part = 0;
        while seq
            .next_element_seed(PartSeed {
                content: &mut *self.content,
                message: self.index,
                part,
            })?
            .is_some()
        {
            part += 1;
        }
        Ok(())
    }
}

/// One content part. A part is text when its `type` is `"text"`, or when it has no `type` but a
/// `text` (vLLM infers the type from the keys); any other part counts as one non-text part.
struct PartSeed<'a, 't> {
    content: &'a mut Content<'t>,
    message: usize,
    part: usize,
}

impl<'de> DeserializeSeed<'de> for PartSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for PartSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "messages[{}].content[{}] to be a content part object",
            self.message, self.part
        )
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (message, part) = (self.message, self.part);
        let mut is_text = None;
        let mut text = None;
        while let Some(key) = map.next_key_seed(KeySeed::<PartKey>(PhantomData))? {
            match key {
                PartKey::Type => {
                    let kind = map.next_value_seed(HeadSeed(Place::PartType { message, part }))?;
                    is_text = Some(kind.head.as_ref() == b"text");
                }
                PartKey::Text => {
                    text = Some(map.next_value_seed(HeadSeed(Place::PartText { message, part }))?);
                }
                // Media payloads (often megabytes of base64) are skipped without a copy.
                PartKey::Ignored => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        match (is_text, text) {
            (Some(true) | None, Some(text)) => self.content.add_text(text.len, &text.head),
            (Some(true), None) => self.content.add_text(0, b""),
            _ => self.content.non_text_parts += 1,
        }
        Ok(())
    }
}

enum PartKey {
    Type,
    Text,
    Ignored,
}

impl KeyName for PartKey {
    fn from_name(name: &str) -> PartKey {
        match name {
            "type" => PartKey::Type,
            "text" => PartKey::Text,
            _ => PartKey::Ignored,
        }
    }
}

/// A string kept only as its length and first [`PROMPT_PREFIX_BYTES`] bytes: borrowed from the
/// body when it has no escapes, else a bounded copy.
struct Head<'de> {
    len: usize,
    head: Cow<'de, [u8]>,
}

/// Where a [`Head`] is read, for error messages.
#[derive(Clone, Copy)]
enum Place {
    Role { index: usize },
    PartType { message: usize, part: usize },
    PartText { message: usize, part: usize },
}

struct HeadSeed(Place);

fn head_of(bytes: &[u8]) -> &[u8] {
    bytes.get(..PROMPT_PREFIX_BYTES).unwrap_or(bytes)
}

impl<'de> DeserializeSeed<'de> for HeadSeed {
    type Value = Head<'de>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Head<'de>, D::Error> {
        de.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for HeadSeed {
    type Value = Head<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self.0 {
            Place::Role { index } => write!(f, "messages[{index}].role to be a string"),
            Place::PartType { message, part } => {
                write!(f, "messages[{message}].content[{part}].type to be a string")
            }
            Place::PartText { message, part } => {
                write!(f, "messages[{message}].content[{part}].text to be a string")
            }
        }
    }

    fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Head<'de>, E> {
        Ok(Head {
            len: text.len(),
            head: Cow::Borrowed(head_of(text.as_bytes())),
        })
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Head<'de>, E> {
        Ok(Head {
            len: text.len(),
            head: Cow::Owned(head_of(text.as_bytes()).to_vec()),
        })
    }
}

/// The length of a JSON value as serde_json would write it compactly (floats approximately),
/// measured without building it; `null` counts as 0 since nothing is sent to the model.
struct JsonLen(usize);

impl<'de> Deserialize<'de> for JsonLen {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<JsonLen, D::Error> {
        de.deserialize_any(JsonLenVisitor { top: true })
    }
}

struct JsonLenVisitor {
    top: bool,
}

impl<'de> DeserializeSeed<'de> for JsonLenVisitor {
    type Value = JsonLen;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<JsonLen, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for JsonLenVisitor {
    type Value = JsonLen;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<JsonLen, E> {
        Ok(JsonLen(if self.top { 0 } else { "null".len() }))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<JsonLen, E> {
        Ok(JsonLen(if v { "true".len() } else { "false".len() }))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<JsonLen, E> {
        Ok(JsonLen(display_len(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<JsonLen, E> {
        Ok(JsonLen(display_len(v)))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<JsonLen, E> {
        Ok(JsonLen(display_len(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<JsonLen, E> {
        Ok(JsonLen(escaped_len(v).saturating_add(2)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<JsonLen, A::Error> {
        // `[` and `]`, plus a comma before every element but the first.
        let mut len = 2usize;
        let mut first = true;
        while let Some(JsonLen(item)) = seq.next_element_seed(JsonLenVisitor { top: false })? {
            len = len.saturating_add(item).saturating_add(usize::from(!first));
            first = false;
        }
        Ok(JsonLen(len))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonLen, A::Error> {
        // `{` and `}`, plus `key:value` per entry and a comma before every entry but the first.
        let mut len = 2usize;
        let mut first = true;
        while let Some(JsonLen(key)) = map.next_key_seed(JsonLenVisitor { top: false })? {
            let JsonLen(value) = map.next_value_seed(JsonLenVisitor { top: false })?;
            len = len
                .saturating_add(key)
                .saturating_add(1)
                .saturating_add(value)
                .saturating_add(usize::from(!first));
            first = false;
        }
        Ok(JsonLen(len))
    }
}

/// The length of a string's JSON escaping, without quotes.
fn escaped_len(s: &str) -> usize {
    s.bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\x08' | b'\x0c' | b'\n' | b'\r' | b'\t' => 2,
            0..=0x1f => 6, // \u00XX
            _ => 1,
        })
        .sum()
}

fn display_len(v: impl fmt::Display) -> usize {
    struct Counter(usize);
    impl fmt::Write for Counter {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            self.0 += s.len();
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // Counter never fails, so neither can the write.
    let _ = fmt::write(&mut counter, format_args!("{v}"));
    counter.0
}

/// A field of an API this module does not model: every string in it counts as text (a `data:`
/// URL as one non-text part), every number as one token id; keys and literals count nothing.
/// Nothing here is an error, so unfamiliar shapes never turn valid traffic away. The value is
/// `false` for `null`, which reads as absent.
struct LooseText<'a> {
    prompt: &'a mut Prompt,
}

impl<'de> DeserializeSeed<'de> for LooseText<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<bool, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for LooseText<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_bool<E: de::Error>(self, _v: bool) -> Result<bool, E> {
        Ok(true)
    }

    fn visit_u64<E: de::Error>(self, _v: u64) -> Result<bool, E> {
        self.prompt.add_tokens(1u32);
        Ok(true)
    }

    fn visit_i64<E: de::Error>(self, _v: i64) -> Result<bool, E> {
        self.prompt.add_tokens(1u32);
        Ok(true)
    }

    fn visit_f64<E: de::Error>(self, _v: f64) -> Result<bool, E> {
        self.prompt.add_tokens(1u32);
        Ok(true)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<bool, E> {
        if text.starts_with("data:") {
            self.prompt.add_tokens(NON_TEXT_PART_TOKENS);
        } else {
            self.prompt.add_text(text.as_bytes());
        }
        Ok(true)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        let prompt = self.prompt;
        while seq
            .next_element_seed(LooseText {
                prompt: &mut *prompt,
            })?
            .is_some()
        {}
        Ok(true)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        let prompt = self.prompt;
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(LooseText {
                prompt: &mut *prompt,
            })?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(api: ApiKind, body: &str) -> Result<InferenceRequest, RequestError> {
        parse_request(api, body.as_bytes())
    }

    fn parsed(api: ApiKind, body: &str) -> InferenceRequest {
        match parse(api, body) {
            Ok(request) => request,
            Err(err) => panic!("{body} should parse, got {err}"),
        }
    }

    /// The field an `InvalidField` error names, or a panic showing what came instead.
    fn invalid_field(api: ApiKind, body: &str) -> &'static str {
        match parse(api, body) {
            Err(RequestError::InvalidField { field, .. }) => field,
            other => panic!("{body} should be an invalid field, got {other:?}"),
        }
    }

    fn chat(messages: &str) -> InferenceRequest {
        parsed(
            ApiKind::ChatCompletions,
            &format!(r#"{{"model":"m","messages":{messages}}}"#),
        )
    }

    fn completion(prompt: &str) -> InferenceRequest {
        parsed(
            ApiKind::Completions,
            &format!(r#"{{"model":"m","prompt":{prompt}}}"#),
        )
    }

    const OVERHEAD: u32 = MESSAGE_OVERHEAD_TOKENS;

    #[test]
    fn the_api_kind_comes_from_the_path_without_its_query() {
        assert_eq!(ApiKind::from_path("/v1/completions"), ApiKind::Completions);
        assert_eq!(
            ApiKind::from_path("/v1/chat/completions?stream=true"),
            ApiKind::ChatCompletions
        );
        assert_eq!(ApiKind::from_path("/v1/embeddings"), ApiKind::Other);
        assert_eq!(ApiKind::from_path("/v1/responses"), ApiKind::Other);
        assert_eq!(ApiKind::from_path("/v1/completions/x"), ApiKind::Other);
        assert_eq!(ApiKind::from_path(""), ApiKind::Other);
    }

    #[test]
    fn estimates_round_up_four_bytes_to_a_token_and_saturate() {
        assert_eq!(estimate_tokens(0), 0);
        assert_eq!(estimate_tokens(1), 1);
        assert_eq!(estimate_tokens(4), 1);
        assert_eq!(estimate_tokens(5), 2);
        assert_eq!(estimate_tokens(usize::MAX), u32::MAX);
    }

    #[test]
    fn a_completions_request_yields_model_prompt_budget_and_stream() {
        let request = parsed(
            ApiKind::Completions,
            r#"{"model":"llama-3-8b","prompt":"Hello, world!","max_tokens":64,"stream":true}"#,
        );
        assert_eq!(
            request,
            InferenceRequest {
                model: "llama-3-8b".to_owned(),
                prompt_tokens: 4,
                max_output_tokens: Some(64),
                stream: true,
                prompt_prefix: b"Hello, world!".to_vec(),
            }
        );
    }

    #[test]
    fn a_batch_of_string_prompts_sums_each_estimate_and_keeps_the_first_as_prefix() {
        let request = completion(r#"["abcd", "abcde", ""]"#);
        assert_eq!(request.prompt_tokens, 1 + 2);
        assert_eq!(request.prompt_prefix, b"abcd");
    }

    #[test]
    fn token_id_prompts_count_one_token_per_id_and_have_no_prefix() {
        let request = completion("[101, 2023, 2003, 0]");
        assert_eq!(request.prompt_tokens, 4);
        assert!(request.prompt_prefix.is_empty());
        assert_eq!(completion("[[1, 2], [3, 4, 5], []]").prompt_tokens, 5);
    }

    #[test]
    fn a_missing_or_null_completions_prompt_is_an_invalid_prompt() {
        assert_eq!(
            parse(ApiKind::Completions, r#"{"model":"m"}"#),
            Err(RequestError::InvalidField {
                field: "prompt",
                reason: "is required".to_owned()
            })
        );
        assert_eq!(
            invalid_field(ApiKind::Completions, r#"{"model":"m","prompt":null}"#),
            "prompt"
        );
        // Chat-style fields do not stand in for the prompt of a completion.
        assert_eq!(
            invalid_field(
                ApiKind::Completions,
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#
            ),
            "prompt"
        );
    }

    #[test]
    fn a_prompt_of_the_wrong_shape_is_an_invalid_prompt() {
        for prompt in [
            "5",
            "true",
            r#"{"text":"hi"}"#,
            "[1.5]",
            "[[1, \"x\"]]",
            "[{}]",
            "[null]",
        ] {
            let body = format!(r#"{{"model":"m","prompt":{prompt}}}"#);
            assert_eq!(
                invalid_field(ApiKind::Completions, &body),
                "prompt",
                "{body}"
            );
        }
    }

    #[test]
    fn a_wrong_type_error_says_what_was_expected_and_where() {
        let Err(RequestError::InvalidField { field, reason }) = parse(
            ApiKind::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"user","content":7}]}"#,
        ) else {
            panic!("content 7 should be refused");
        };
        assert_eq!(field, "messages");
        assert!(reason.contains("messages[1].content"), "{reason}");
        assert!(reason.contains("line 1 column"), "{reason}");
    }

    #[test]
    fn chat_messages_count_their_text_plus_a_per_message_overhead() {
        let request = chat(
            r#"[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello, world!"}]"#,
        );
        assert_eq!(request.prompt_tokens, OVERHEAD + 3 + OVERHEAD + 4);
    }

    #[test]
    fn the_chat_prefix_joins_role_and_content_of_each_message_with_newlines() {
        let request = chat(
            r#"[{"role":"system","content":"Be brief."},{"content":"Hi","role":"user","name":"x"}]"#,
        );
        // The role comes first even when the JSON gives it after the content.
        assert_eq!(request.prompt_prefix, b"system\nBe brief.\nuser\nHi");
    }

    #[test]
    fn chat_text_parts_are_counted_together_and_joined_in_the_prefix() {
        let request = chat(
            r#"[{"role":"user","content":[{"type":"text","text":"abcd"},{"text":"efgh","type":"text"},{"text":"ij"}]}]"#,
        );
        assert_eq!(request.prompt_tokens, OVERHEAD + estimate_tokens(10));
        assert_eq!(request.prompt_prefix, b"user\nabcd\nefgh\nij");
    }

    #[test]
    fn null_or_absent_chat_content_counts_only_the_overhead() {
        let request = chat(
            r#"[{"role":"user","content":"What is 2+2?"},{"role":"assistant","content":null},{"role":"assistant"}]"#,
        );
        assert_eq!(request.prompt_tokens, OVERHEAD + 3 + OVERHEAD + OVERHEAD);
        assert_eq!(
            request.prompt_prefix,
            b"user\nWhat is 2+2?\nassistant\nassistant"
        );
    }

    #[test]
    fn image_parts_add_a_fixed_estimate_and_stay_out_of_the_prefix() {
        let image = "A".repeat(1 << 20);
        let request = chat(&format!(
            r#"[{{"role":"user","content":[
                {{"type":"image_url","image_url":{{"url":"data:image/png;base64,{image}"}}}},
                {{"type":"text","text":"What is this?"}},
                {{"type":"input_audio","input_audio":{{"data":"AAAA","format":"wav"}}}}]}}]"#
        ));
        assert_eq!(
            request.prompt_tokens,
            OVERHEAD + estimate_tokens(13) + 2 * NON_TEXT_PART_TOKENS
        );
        assert_eq!(request.prompt_prefix, b"user\nWhat is this?");
        // A part that is not text keeps its text out of the count.
        let request = chat(r#"[{"role":"user","content":[{"text":"ignored","type":"refusal"}]}]"#);
        assert_eq!(request.prompt_tokens, OVERHEAD + NON_TEXT_PART_TOKENS);
        assert_eq!(request.prompt_prefix, b"user");
    }

    #[test]
    fn tools_functions_and_tool_calls_add_their_json_length() {
        let tools = r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;
        let functions = r#"[{"name":"f","parameters":{"n":-1.5,"ok":true,"x":null}}]"#;
        let request = parsed(
            ApiKind::ChatCompletions,
            &format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"tools": {tools},"functions":{functions},"tool_choice":"auto"}}"#
            ),
        );
        assert_eq!(
            request.prompt_tokens,
            OVERHEAD + 1 + estimate_tokens(tools.len()) + estimate_tokens(functions.len())
        );

        let calls = r#"[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]"#;
        let request = chat(&format!(
            r#"[{{"role":"assistant","content":null,"tool_calls":{calls}}},{{"role":"tool","tool_call_id":"c1","content":"sunny"}}]"#
        ));
        assert_eq!(
            request.prompt_tokens,
            OVERHEAD + estimate_tokens(calls.len()) + OVERHEAD + 2
        );
    }

    #[test]
    fn null_tools_count_nothing() {
        let request = parsed(
            ApiKind::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":null,"functions":null}"#,
        );
        assert_eq!(request.prompt_tokens, OVERHEAD + 1);
    }

    #[test]
    fn missing_null_or_empty_messages_are_invalid_messages() {
        for body in [
            r#"{"model":"m"}"#,
            r#"{"model":"m","messages":null}"#,
            r#"{"model":"m","messages":[]}"#,
            r#"{"model":"m","messages":"hi"}"#,
            r#"{"model":"m","prompt":"hi"}"#,
        ] {
            assert_eq!(
                invalid_field(ApiKind::ChatCompletions, body),
                "messages",
                "{body}"
            );
        }
    }

    #[test]
    fn malformed_messages_are_invalid_messages() {
        for messages in [
            r#"["hi"]"#,
            r#"[{"content":"hi"}]"#,
            r#"[{"role":1,"content":"hi"}]"#,
            r#"[{"role":"user","content":{"text":"hi"}}]"#,
            r#"[{"role":"user","content":["hi"]}]"#,
            r#"[{"role":"user","content":[{"type":"text","text":5}]}]"#,
            r#"[{"role":"user","content":[{"type":7,"text":"hi"}]}]"#,
        ] {
            let body = format!(r#"{{"model":"m","messages":{messages}}}"#);
            assert_eq!(
                invalid_field(ApiKind::ChatCompletions, &body),
                "messages",
                "{body}"
            );
        }
    }

    #[test]
    fn max_completion_tokens_takes_precedence_over_max_tokens() {
        let body = r#"{"model":"m","prompt":"x","max_tokens":10,"max_completion_tokens":20}"#;
        assert_eq!(
            parsed(ApiKind::Completions, body).max_output_tokens,
            Some(20)
        );
        let body = r#"{"model":"m","prompt":"x","max_completion_tokens":20,"max_tokens":10}"#;
        assert_eq!(
            parsed(ApiKind::Completions, body).max_output_tokens,
            Some(20)
        );
        let body = r#"{"model":"m","prompt":"x","max_completion_tokens":null,"max_tokens":10}"#;
        assert_eq!(
            parsed(ApiKind::Completions, body).max_output_tokens,
            Some(10)
        );
        let body = r#"{"model":"m","prompt":"x","max_tokens":null}"#;
        assert_eq!(parsed(ApiKind::Completions, body).max_output_tokens, None);
    }

    #[test]
    fn token_limits_accept_integral_numbers_and_saturate_above_u32() {
        for (value, expected) in [
            ("0", 0),
            ("100.0", 100),
            ("1e3", 1000),
            ("4294967296", u32::MAX),
            ("18446744073709551616", u32::MAX),
            ("1e30", u32::MAX),
        ] {
            let body = format!(r#"{{"model":"m","prompt":"x","max_tokens":{value}}}"#);
            assert_eq!(
                parsed(ApiKind::Completions, &body).max_output_tokens,
                Some(expected),
                "{body}"
            );
        }
    }

    #[test]
    fn negative_fractional_or_non_numeric_token_limits_are_invalid() {
        for value in ["-1", "1.5", "-0.5", r#""100""#, "true", "[1]", "{}"] {
            for field in ["max_tokens", "max_completion_tokens"] {
                let body = format!(r#"{{"model":"m","prompt":"x","{field}":{value}}}"#);
                assert_eq!(invalid_field(ApiKind::Completions, &body), field, "{body}");
            }
        }
    }

    #[test]
    fn stream_must_be_a_bool_and_null_or_absent_means_false() {
        let body = r#"{"model":"m","prompt":"x","stream":null}"#;
        assert!(!parsed(ApiKind::Completions, body).stream);
        let body = r#"{"model":"m","prompt":"x"}"#;
        assert!(!parsed(ApiKind::Completions, body).stream);
        for value in [r#""true""#, "1", "{}"] {
            let body = format!(r#"{{"model":"m","prompt":"x","stream":{value}}}"#);
            assert_eq!(
                invalid_field(ApiKind::Completions, &body),
                "stream",
                "{body}"
            );
        }
    }

    #[test]
    fn a_missing_or_null_model_is_missing_model() {
        for api in [
            ApiKind::Completions,
            ApiKind::ChatCompletions,
            ApiKind::Other,
        ] {
            assert_eq!(
                parse(
                    api,
                    r#"{"prompt":"x","messages":[{"role":"user","content":"x"}]}"#
                ),
                Err(RequestError::MissingModel)
            );
            assert_eq!(
                parse(api, r#"{"model":null,"prompt":"x"}"#),
                Err(RequestError::MissingModel)
            );
        }
    }

    #[test]
    fn a_non_string_or_empty_model_is_an_invalid_model() {
        for value in ["7", r#""""#, "[\"m\"]", "{}", "false"] {
            let body = format!(r#"{{"model":{value},"prompt":"x"}}"#);
            assert_eq!(
                invalid_field(ApiKind::Completions, &body),
                "model",
                "{body}"
            );
        }
    }

    #[test]
    fn a_lora_adapter_name_is_kept_as_sent() {
        let body = r#"{"model":"sql-lora\u002dv2","prompt":"x"}"#;
        assert_eq!(parsed(ApiKind::Completions, body).model, "sql-lora-v2");
    }

    #[test]
    fn an_empty_or_blank_body_is_an_empty_body() {
        assert_eq!(
            parse(ApiKind::Completions, ""),
            Err(RequestError::EmptyBody)
        );
        assert_eq!(
            parse(ApiKind::Completions, " \r\n\t"),
            Err(RequestError::EmptyBody)
        );
    }

    #[test]
    fn truncated_json_is_invalid_json_with_a_position() {
        for body in [
            r#"{"model":"m","prompt":"abc"#,
            r#"{"model":"m","prompt":[1,2"#,
            r#"{"model":"m","#,
            "{",
        ] {
            match parse(ApiKind::Completions, body) {
                Err(RequestError::InvalidJson(message)) => {
                    assert!(message.contains("line 1 column"), "{message}");
                }
                other => panic!("{body} should be invalid JSON, got {other:?}"),
            }
        }
    }

    #[test]
    fn trailing_garbage_or_broken_syntax_is_invalid_json() {
        for body in [
            r#"{"model":"m","prompt":"x"} x"#,
            r#"{"model":"m","prompt":"x"}{}"#,
            r#"{"model":"m","prompt":[1,2,]}"#,
            r#"{"model":"m","prompt":"x",}"#,
            r#"{model:"m"}"#,
            "[1,",
            "hello",
        ] {
            assert!(
                matches!(
                    parse(ApiKind::Completions, body),
                    Err(RequestError::InvalidJson(_))
                ),
                "{body}"
            );
        }
        // Whitespace around the object is fine.
        parsed(
            ApiKind::Completions,
            " \n{\"model\":\"m\",\"prompt\":\"x\"}\n ",
        );
    }

    #[test]
    fn invalid_utf8_is_invalid_json() {
        let body = b"{\"model\":\"m\",\"prompt\":\"\xff\"}";
        assert!(matches!(
            parse_request(ApiKind::Completions, body),
            Err(RequestError::InvalidJson(_))
        ));
    }

    #[test]
    fn json_that_is_not_an_object_is_not_an_object() {
        for body in ["[]", r#"[{"model":"m"}]"#, r#""m""#, "42", "null", " true "] {
            assert_eq!(
                parse(ApiKind::ChatCompletions, body),
                Err(RequestError::NotAnObject),
                "{body}"
            );
        }
    }

    #[test]
    fn unknown_fields_are_ignored_whatever_their_shape() {
        let request = parsed(
            ApiKind::Completions,
            r#"{"echo":true,"no_stop_trim":null,"model":"m","logit_bias":{"50256":-100},
                "stop":["\n"],"prompt":"abcd","sampling_params":{"nested":[[{"deep":1}]]},
                "temperature":0.7,"user":"\u00e9","messages":42}"#,
        );
        assert_eq!(request.model, "m");
        assert_eq!(request.prompt_tokens, 1);
    }

    #[test]
    fn a_repeated_key_takes_its_last_value() {
        let request = parsed(
            ApiKind::Completions,
            r#"{"model":"a","prompt":"abcdefgh","model":"b","prompt":"xy"}"#,
        );
        assert_eq!(request.model, "b");
        assert_eq!(request.prompt_tokens, 1);
        assert_eq!(request.prompt_prefix, b"xy");
    }

    #[test]
    fn other_apis_measure_prompt_then_input_then_messages() {
        let body = r#"{"model":"e5","input":"abcdefgh","prompt":"abcd"}"#;
        let request = parsed(ApiKind::Other, body);
        assert_eq!(request.prompt_tokens, 1);
        assert_eq!(request.prompt_prefix, b"abcd");

        let body = r#"{"model":"e5","prompt":null,"input":["abcd","efgh"]}"#;
        let request = parsed(ApiKind::Other, body);
        assert_eq!(request.prompt_tokens, 2);
        assert_eq!(request.prompt_prefix, b"abcd\nefgh");

        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let request = parsed(ApiKind::Other, body);
        assert_eq!(request.prompt_tokens, 2);
        assert_eq!(request.prompt_prefix, b"user\nhi");

        let body = r#"{"model":"e5","input":[[1,2,3],[4]]}"#;
        assert_eq!(parsed(ApiKind::Other, body).prompt_tokens, 4);
    }

    #[test]
    fn other_apis_without_a_prompt_have_zero_tokens() {
        let request = parsed(
            ApiKind::Other,
            r#"{"model":"m","max_tokens":5,"stream":true}"#,
        );
        assert_eq!(request.prompt_tokens, 0);
        assert!(request.prompt_prefix.is_empty());
        assert_eq!(request.max_output_tokens, Some(5));
        assert!(request.stream);
    }

    #[test]
    fn other_apis_accept_unfamiliar_input_shapes() {
        let image = "B".repeat(100_000);
        let body = format!(
            r#"{{"model":"m","input":[{{"type":"message","role":"user","content":[
                {{"type":"input_text","text":"Describe this"}},
                {{"type":"input_image","image_url":"data:image/png;base64,{image}"}}]}}]}}"#
        );
        let request = parsed(ApiKind::Other, &body);
        let text = [
            "message",
            "user",
            "input_text",
            "Describe this",
            "input_image",
        ];
        let text_tokens: u32 = text.iter().map(|t| estimate_tokens(t.len())).sum();
        assert_eq!(request.prompt_tokens, text_tokens + NON_TEXT_PART_TOKENS);
        assert_eq!(request.prompt_prefix, text.join("\n").as_bytes());
        // Other APIs still check the common fields.
        let body = r#"{"model":"m","input":"x","stream":"yes"}"#;
        assert_eq!(invalid_field(ApiKind::Other, body), "stream");
    }

    #[test]
    fn a_ten_megabyte_prompt_gets_a_sane_estimate_and_a_bounded_prefix() {
        let text = "The quick brown fox jumps over the lazy dog. ".repeat((10 << 20) / 45);
        let body = format!(r#"{{"model":"m","prompt":"{text}"}}"#);
        let request = parsed(ApiKind::Completions, &body);
        assert_eq!(request.prompt_tokens, estimate_tokens(text.len()));
        assert!(
            request.prompt_tokens > 2_500_000,
            "{}",
            request.prompt_tokens
        );
        assert_eq!(
            request.prompt_prefix,
            text.as_bytes()[..PROMPT_PREFIX_BYTES]
        );

        // Escaped text is measured after unescaping, in chat as in completions.
        let escaped = "line\\n".repeat(2 << 20);
        let request = chat(&format!(r#"[{{"role":"user","content":"{escaped}"}}]"#));
        assert_eq!(
            request.prompt_tokens,
            OVERHEAD + estimate_tokens(5 * (2 << 20))
        );
        assert_eq!(request.prompt_prefix.len(), PROMPT_PREFIX_BYTES);
        assert!(request.prompt_prefix.starts_with(b"user\nline\nline\n"));
    }

    #[test]
    fn millions_of_token_ids_are_counted() {
        let ids = vec!["31337"; 2 << 20].join(",");
        let request = completion(&format!("[[{ids}],[1]]"));
        assert_eq!(request.prompt_tokens, (2 << 20) + 1);
    }

    #[test]
    fn the_prompt_prefix_is_bounded_and_starts_with_the_prompt_text() {
        let request = completion(&format!(r#""{}""#, "x".repeat(PROMPT_PREFIX_BYTES + 1)));
        assert_eq!(request.prompt_prefix, vec![b'x'; PROMPT_PREFIX_BYTES]);

        // Many messages: later ones still count but no longer grow the prefix.
        let message = format!(r#"{{"role":"user","content":"{}"}}"#, "y".repeat(1000));
        let request = chat(&format!("[{}]", [message.as_str(); 20].join(",")));
        assert_eq!(request.prompt_tokens, 20 * (OVERHEAD + 250));
        assert_eq!(request.prompt_prefix.len(), PROMPT_PREFIX_BYTES);
        assert!(request.prompt_prefix.starts_with(b"user\nyyyy"));

        // A long role is bounded too.
        let role = "r".repeat(3 * PROMPT_PREFIX_BYTES);
        let request = chat(&format!(r#"[{{"role":"{role}","content":"hi"}}]"#));
        assert_eq!(
            request.prompt_prefix,
            role.as_bytes()[..PROMPT_PREFIX_BYTES]
        );
    }

    #[test]
    fn utf8_multibyte_text_is_counted_by_bytes() {
        // 3 characters, 9 bytes; 2 characters, 4 bytes (an escaped é and a literal é).
        assert_eq!(completion(r#""日本語""#).prompt_tokens, 3);
        let request = completion(r#""\u00e9é""#);
        assert_eq!(request.prompt_tokens, 1);
        assert_eq!(request.prompt_prefix, "éé".as_bytes());

        // The prefix is cut at a byte, which may fall inside a character.
        let text = "€".repeat(PROMPT_PREFIX_BYTES);
        let request = completion(&format!(r#""{text}""#));
        assert_eq!(
            request.prompt_tokens,
            estimate_tokens(3 * PROMPT_PREFIX_BYTES)
        );
        assert_eq!(
            request.prompt_prefix,
            text.as_bytes()[..PROMPT_PREFIX_BYTES]
        );
    }

    #[test]
    fn every_error_is_an_invalid_request_with_a_stable_code() {
        let errors = [
            (RequestError::EmptyBody, "empty_body", None),
            (RequestError::InvalidJson("x".into()), "invalid_json", None),
            (RequestError::NotAnObject, "not_an_object", None),
            (RequestError::MissingModel, "missing_model", Some("model")),
            (
                RequestError::InvalidField {
                    field: "prompt",
                    reason: "is required".into(),
                },
                "invalid_field",
                Some("prompt"),
            ),
        ];
        for (error, code, param) in errors {
            assert_eq!(error.openai_type(), "invalid_request_error");
            assert_eq!(error.code(), code);
            assert_eq!(error.param(), param);
        }
        assert_eq!(
            required("prompt").to_string(),
            "invalid `prompt`: is required"
        );
    }
}
