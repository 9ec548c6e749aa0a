//! Prompts tokenized in kvroute itself, from the model's own `tokenizer.json` and chat
//! template (`--tokenizer [MODEL=]DIR`), as vLLM's OpenAI server makes them:
//!
//! - a completion's `prompt` (one string) is encoded with `add_special_tokens` (the
//!   request's field, default true: the tokenizer's post-processor adds the BOS);
//! - a chat's `messages` are rendered with the chat template (Jinja, as transformers'
//!   `apply_chat_template` runs it: blocks trimmed and left-stripped, loop controls,
//!   `raise_exception`, `strftime_now`, Python's string methods; a list of named
//!   templates' `tool_use` for a request with tools, else its `default`), with
//!   `add_generation_prompt` (default true), the request's `tools` as vLLM dumps its
//!   models of them (else none), its `documents` as it gives them (else none), the
//!   tokenizer's named special tokens (`bos_token`, `eos_token`, `unk_token`,
//!   `sep_token`, `pad_token`, `cls_token`, `mask_token`: `tokenizer_config.json`'s, else
//!   `special_tokens_map.json`'s) and the request's `chat_template_kwargs`; with
//!   `continue_final_message` (and the generation prompt declined) the text is cut
//!   where the final message continues, as transformers cuts it
//!   (`kvroute_chat_template::cut_at_marker`); the text is encoded with `add_special_tokens`
//!   default false (the template writes the BOS itself). A message is its role, its
//!   content (one string, its text parts joined by a newline: vLLM's "string" content
//!   format; or a list of text parts where the template loops over the content:
//!   "openai"), an assistant's tool calls (their arguments parsed) and reasoning (as both
//!   `reasoning` and `reasoning_content`, as vLLM hands it over, and as `thinking`
//!   before the other fields, as transformers 5 adds it), a tool result's
//!   `tool_call_id`, its name, and a developer message's `tools` (none). The tools and
//!   tool calls are shaped by `kvroute_chat_template::tools`, which says how.
//!
//! What a local rendering could get wrong is left to the pod's `/tokenize`
//! ([`super::pod`]), which renders it exactly: a request carrying its own chat template
//! (in its fields or its `chat_template_kwargs`, as tools, documents or
//! `continue_final_message` named there), tools, tool calls or documents vLLM refuses or
//! whose handling changed between its releases (a custom tool, arguments that are not one
//! JSON object), non-text content. Removing the round trip matters most below a fleet's
//! knee, where it is a visible part of the time to first token, and it takes the
//! tokenization off the pods' API servers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use minijinja::value::Serde;
use minijinja::{Environment, Error as TemplateError, Value};
use serde::Deserialize;
use serde_json::value::RawValue;

use kvroute_core::request::ApiKind;

use super::pieces::{Pieces, encode_whole};
use kvroute_chat_template::{loops_over_content, special_tokens, template_source};

/// The template's name in its environment.
const CHAT: &str = "chat";
/// The name of the template for requests with tools, where the tokenizer names one.
const TOOL_USE: &str = "tool_use";
/// Most text [`LocalTokenizer::tokenize_if_cheap`] encodes afresh: about 500 tokens,
/// a few hundred microseconds at most.
pub const CHEAP_BYTES: usize = 2048;
/// Longest request body tokenized here: about 250k tokens of text, past any context.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Why a tokenizer directory could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer {path}: {message}")]
pub struct LoadError {
    path: PathBuf,
    message: String,
}

impl LoadError {
    fn new(path: &Path, message: impl ToString) -> Self {
        LoadError {
            path: path.to_owned(),
            message: message.to_string(),
        }
    }
}

/// Why a prompt was not tokenized here. Except for [`Unsupported::NotOneText`], which no
/// tokenizer can make one sequence of, the pod's `/tokenize` is asked instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsupported {
    #[error("the prompt is not one text (a batch, token ids, or a body that does not parse)")]
    NotOneText,
    #[error("the request {0}, which only the pod renders exactly")]
    LeftToPod(&'static str),
    #[error("the tokenizer has no chat template")]
    NoChatTemplate,
    #[error("the chat template failed: {0}")]
    Render(String),
    #[error("encoding failed: {0}")]
    Encode(String),
}

impl Unsupported {
    /// A bounded label value.
    pub fn kind(&self) -> &'static str {
        match self {
            Unsupported::NotOneText => "not_one_text",
            Unsupported::LeftToPod(_) => "left_to_pod",
            Unsupported::NoChatTemplate => "no_chat_template",
            Unsupported::Render(_) => "render",
            Unsupported::Encode(_) => "encode",
        }
    }
}

/// `--tokenizer [MODEL=]DIR`: a model directory as Hugging Face ships it, for one
/// model (and its adapters) or, without `MODEL=`, for every model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerSpec {
    pub model: Option<String>,
    pub dir: PathBuf,
}

impl FromStr for TokenizerSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (model, dir) = match s.split_once('=') {
            Some((model, dir)) if !model.is_empty() => (Some(model.to_owned()), dir),
            Some(_) => return Err(format!("`{s}`: the model before `=` is empty")),
            None => (None, s),
        };
        if dir.is_empty() {
            return Err(format!("`{s}`: no directory"));
        }
        Ok(TokenizerSpec {
            model,
            dir: PathBuf::from(dir),
        })
    }
}

/// The loaded tokenizers, by the base model they serve.
#[derive(Debug, Default, Clone)]
pub struct LocalTokenizers {
    by_model: HashMap<String, Arc<LocalTokenizer>>,
    /// The directory for every other model, and its checks kept by model (each model's
    /// first prompt is checked, and a difference sets the directory aside for that model
    /// alone); the models are those some pod serves.
    any: Option<Arc<Loaded>>,
    any_by_model: Arc<RwLock<HashMap<String, Arc<LocalTokenizer>>>>,
    /// [`LocalTokenizers::checking_every`]'s, for the models `any` serves from now on.
    every: u64,
}

impl LocalTokenizers {
    /// Loads every directory of `specs`, sharing `cache_bytes` between them for the
    /// pieces of text they remember (0: none); the first error names its path.
    pub fn load(specs: &[TokenizerSpec], cache_bytes: usize) -> Result<Self, LoadError> {
        let mut loaded = LocalTokenizers::default();
        let cache_bytes = cache_bytes / specs.len().max(1);
        for spec in specs {
            let tokenizer = Arc::new(LocalTokenizer::load(&spec.dir, cache_bytes)?);
            // What an operator checks first when prompts stop matching the events.
            tracing::info!(
                model = spec.model.as_deref().unwrap_or("every model"),
                dir = %spec.dir.display(),
                vocab = tokenizer.loaded.tokenizer.get_vocab_size(true),
                chat_template = tokenizer.loaded.chat.is_some(),
                remembers_pieces = tokenizer.loaded.pieces.is_some(),
                "local tokenizer loaded"
            );
            match &spec.model {
                Some(model) => {
                    loaded.by_model.insert(model.clone(), tokenizer);
                }
                None => loaded.any = Some(Arc::clone(&tokenizer.loaded)),
            }
        }
        Ok(loaded)
    }

    pub fn is_empty(&self) -> bool {
        self.by_model.is_empty() && self.any.is_none()
    }

    /// The same tokenizers, each checking its first prompt and then every `every`th
    /// against the engine's ([`LocalTokenizer::due_for_check`]; 0: never).
    pub fn checking_every(mut self, every: u64) -> Self {
        self.every = every;
        let any_by_model = self
            .any_by_model
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        for tokenizer in self.by_model.values().chain(any_by_model.values()) {
            tokenizer.checks.every.store(every, Ordering::Relaxed);
        }
        drop(any_by_model);
        self
    }

    /// The tokenizer of `base_model` (an adapter's requests use its base model's), unless
    /// a check found it making other tokens than the engine for that model.
    pub fn for_model(&self, base_model: &str) -> Option<Arc<LocalTokenizer>> {
        let tokenizer = match self.by_model.get(base_model) {
            Some(tokenizer) => Arc::clone(tokenizer),
            None => self.any_for(base_model)?,
        };
        (!tokenizer.differs()).then_some(tokenizer)
    }

    /// The directory for every model, with `model`'s own checks.
    fn any_for(&self, model: &str) -> Option<Arc<LocalTokenizer>> {
        let any = self.any.as_ref()?;
        let read = |map: &HashMap<String, Arc<LocalTokenizer>>| map.get(model).cloned();
        if let Some(tokenizer) = read(
            &self
                .any_by_model
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        ) {
            return Some(tokenizer);
        }
        let mut by_model = self
            .any_by_model
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let tokenizer = by_model
            .entry(model.to_owned())
            .or_insert_with(|| Arc::new(LocalTokenizer::checking(any, self.every)));
        Some(Arc::clone(tokenizer))
    }
}

/// One model's tokenizer and chat template, and the checks of what it made.
#[derive(Debug)]
pub struct LocalTokenizer {
    loaded: Arc<Loaded>,
    checks: Checks,
}

/// A model directory, loaded.
struct Loaded {
    tokenizer: tokenizers::Tokenizer,
    chat: Option<ChatTemplate>,
    /// Texts encoded piece by piece between special tokens, the pieces remembered
    /// (`None`: encoded whole, where the tokenizer's pieces depend on one another or
    /// nothing may be remembered).
    pieces: Option<Pieces>,
}

/// The checks of a tokenizer's prompts against the engine's own tokens, kept apart for
/// prompts with tools, with reasoning and with neither ([`PromptKind`]).
#[derive(Debug, Default)]
struct Checks {
    /// Check the first prompt of each kind and then every this many (0: never).
    every: AtomicU64,
    /// Prompts tokenized so far, by kind.
    tokenized: [AtomicU64; KINDS],
    /// A check found other tokens than the engine's, by kind.
    differs: [AtomicBool; KINDS],
}

/// Prompts checked apart: tools and tool calls are shaped by rules of their own
/// (`kvroute_chat_template::tools`), and reasoning by transformers' release (5 adds
/// `thinking`), which an engine release may change while the rest of its rendering stays
/// the same, so a difference found on such a prompt sets aside the local rendering of
/// prompts of its kind alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    Plain = 0,
    /// The body mentions tools: a field or a role starting `"tool` (tools, tool calls, a
    /// tool's result), and no reasoning. Text that quotes such a name only puts a prompt
    /// in this class.
    Tools = 1,
    /// The body mentions reasoning (a field starting `"reasoning`), with or without tools.
    Reasoning = 2,
}

const KINDS: usize = 3;

impl PromptKind {
    /// The kind a prompt is counted and checked as: the most particular it has.
    pub fn of(body: &[u8]) -> PromptKind {
        if mentions_reasoning(body) {
            PromptKind::Reasoning
        } else if mentions_tools(body) {
            PromptKind::Tools
        } else {
            PromptKind::Plain
        }
    }
}

fn mentions_tools(body: &[u8]) -> bool {
    memchr::memmem::find(body, b"\"tool").is_some()
}

fn mentions_reasoning(body: &[u8]) -> bool {
    memchr::memmem::find(body, b"\"reasoning").is_some()
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("vocab", &self.tokenizer.get_vocab_size(true))
            .field("chat_template", &self.chat.is_some())
            .field("remembers_pieces", &self.pieces.is_some())
            .finish()
    }
}

/// A chat template ready to render, with what the tokenizer's configuration gives it.
struct ChatTemplate {
    env: Environment<'static>,
    /// Messages' content as a list of text parts (the template loops over it), else one
    /// string.
    content_parts: bool,
    /// A list of named templates' `tool_use`, which transformers renders where the request
    /// has tools (as [`CHAT`] is rendered otherwise), added as [`TOOL_USE`]: whether it
    /// gets content as parts.
    tool_use: Option<bool>,
    /// The named special tokens the tokenizer has, by name
    /// ([`kvroute_chat_template::SPECIAL_TOKENS`]).
    special_tokens: Vec<(&'static str, String)>,
}

/// `chat_template_kwargs` that name what only the pod renders exactly (vLLM merges the
/// request's keyword arguments over its own, so these replace the request's tools,
/// documents or template) or what it refuses.
const KWARGS_LEFT_TO_POD: [&str; 6] = [
    "tools",
    "documents",
    "chat_template",
    "continue_final_message",
    "messages",
    "tokenize",
];

/// What `tokenizer_config.json` says that tokenization reads: the template, and the
/// special tokens (among the other keys).
#[derive(Deserialize, Default)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<serde_json::Value>,
    #[serde(flatten)]
    others: serde_json::Map<String, serde_json::Value>,
}

impl LocalTokenizer {
    /// Loads `dir`: `tokenizer.json` (required), `tokenizer_config.json` (its
    /// `chat_template` and special tokens), `special_tokens_map.json` (the special tokens
    /// the configuration does not name), and `chat_template.jinja` or
    /// `chat_template.json`, which take precedence over the configuration's template. Up to
    /// `cache_bytes` of long pieces' tokens are remembered (`pieces.rs`).
    pub fn load(dir: &Path, cache_bytes: usize) -> Result<Self, LoadError> {
        let file = dir.join("tokenizer.json");
        let tokenizer =
            tokenizers::Tokenizer::from_file(&file).map_err(|e| LoadError::new(&file, e))?;
        let config_file = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = read_json(&config_file)?.unwrap_or_default();
        let map_file = dir.join("special_tokens_map.json");
        let special_tokens_map: serde_json::Map<String, serde_json::Value> =
            read_json(&map_file)?.unwrap_or_default();
        let special_tokens = special_tokens(&config.others, &special_tokens_map);
        // transformers' order: `chat_template.jinja`, then a processor's
        // `chat_template.json` (vLLM prefers a multimodal model's processor template to
        // its tokenizer's), then the configuration's.
        let jinja_file = dir.join("chat_template.jinja");
        let json_file = dir.join("chat_template.json");
        let (source, tool_use, source_file) = match std::fs::read_to_string(&jinja_file) {
            Ok(source) => (Some(source), None, jinja_file),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let (template, file) = match read_json::<TokenizerConfig>(&json_file)? {
                    Some(processor) => (processor.chat_template, json_file),
                    None => (config.chat_template, config_file),
                };
                let named = |name| {
                    template
                        .as_ref()
                        .and_then(|t| named_template(t, name))
                        .map(str::to_owned)
                };
                (named(DEFAULT), named(TOOL_USE), file)
            }
            Err(e) => return Err(LoadError::new(&jinja_file, e)),
        };
        let chat = source
            .map(|source| {
                ChatTemplate::new(source, tool_use, special_tokens)
                    .map_err(|e| LoadError::new(&source_file, e))
            })
            .transpose()?;
        let pieces = (cache_bytes > 0)
            .then(|| Pieces::new(&tokenizer, cache_bytes))
            .flatten();
        Ok(LocalTokenizer {
            loaded: Arc::new(Loaded {
                tokenizer,
                chat,
                pieces,
            }),
            checks: Checks::default(),
        })
    }

    /// The token ids vLLM makes of the prompt of `body`, a request of `api`.
    pub fn tokenize(&self, api: ApiKind, body: &[u8]) -> Result<Vec<u32>, Unsupported> {
        let (text, add_special_tokens) = self.prompt_text(api, body)?;
        self.encode_prompt(&text, add_special_tokens)
    }

    /// [`LocalTokenizer::tokenize`] if it encodes at most [`CHEAP_BYTES`] of text it has
    /// not remembered (a shared context seen before and a short question: tens of
    /// microseconds, cheaper done at once than handed to a blocking thread); `None`
    /// where it would encode more, to be done where a long encoding blocks nobody.
    pub fn tokenize_if_cheap(
        &self,
        api: ApiKind,
        body: &[u8],
    ) -> Option<Result<Vec<u32>, Unsupported>> {
        self.tokenize_within(api, body, CHEAP_BYTES)
    }

    /// The tokens of `body`'s prompt, or `None` once more than `fresh_bytes` of text not
    /// remembered would have to be encoded.
    fn tokenize_within(
        &self,
        api: ApiKind,
        body: &[u8],
        fresh_bytes: usize,
    ) -> Option<Result<Vec<u32>, Unsupported>> {
        match self.prompt_text(api, body) {
            Ok((text, add_special_tokens)) => {
                self.encode_within(&text, add_special_tokens, fresh_bytes)
            }
            Err(unsupported) => Some(Err(unsupported)),
        }
    }

    /// The tokens of a [`LocalTokenizer::prompt_text`], as [`LocalTokenizer::tokenize`]
    /// makes them (for a caller that has the text already).
    pub fn encode_prompt(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, Unsupported> {
        self.encode_within(text, add_special_tokens, usize::MAX)
            .unwrap_or_else(|| Err(Unsupported::Encode("no limit, yet over it".into())))
    }

    /// The tokens of `text`, or `None` once more than `fresh_bytes` of text not
    /// remembered would have to be encoded.
    fn encode_within(
        &self,
        text: &str,
        add_special_tokens: bool,
        fresh_bytes: usize,
    ) -> Option<Result<Vec<u32>, Unsupported>> {
        let Loaded {
            tokenizer, pieces, ..
        } = &*self.loaded;
        let encoded = match pieces {
            Some(pieces) => pieces.encode(tokenizer, text, add_special_tokens, fresh_bytes),
            None => encode_whole(tokenizer, text, add_special_tokens, fresh_bytes),
        };
        match encoded {
            Ok(Some((ids, reuse))) => {
                crate::telemetry::record_local_tokens(reuse.remembered, reuse.encoded);
                Some(Ok(ids))
            }
            Ok(None) => None,
            Err(e) => Some(Err(Unsupported::Encode(e))),
        }
    }

    /// The text vLLM encodes for `body`, and whether it adds the special tokens.
    pub fn prompt_text(&self, api: ApiKind, body: &[u8]) -> Result<(String, bool), Unsupported> {
        // A bound on the CPU one request can cost kvroute (about 1 µs a token, a quarter
        // of a second here); a longer prompt is a pod's to tokenize.
        if body.len() > MAX_BODY_BYTES {
            return Err(Unsupported::LeftToPod("is longer than kvroute tokenizes"));
        }
        let request: PromptRequest<'_> =
            serde_json::from_slice(body).map_err(|_| Unsupported::NotOneText)?;
        match api {
            ApiKind::Completions => {
                let prompt = request.prompt.ok_or(Unsupported::NotOneText)?;
                let text: String =
                    serde_json::from_str(prompt.get()).map_err(|_| Unsupported::NotOneText)?;
                Ok((text, request.add_special_tokens.unwrap_or(true)))
            }
            ApiKind::ChatCompletions => {
                let chat = self
                    .loaded
                    .chat
                    .as_ref()
                    .ok_or(Unsupported::NoChatTemplate)?;
                // A prompt with tools and reasoning is set aside by a difference found on
                // either kind.
                let differs =
                    |kind: PromptKind| self.checks.differs[kind as usize].load(Ordering::Relaxed);
                if differs(PromptKind::Tools) && mentions_tools(body) {
                    return Err(Unsupported::LeftToPod(
                        "has tools, which a check found rendered otherwise by the engine",
                    ));
                }
                if differs(PromptKind::Reasoning) && mentions_reasoning(body) {
                    return Err(Unsupported::LeftToPod(
                        "has reasoning, which a check found rendered otherwise by the engine",
                    ));
                }
                Ok((
                    chat.render(&request)?,
                    request.add_special_tokens.unwrap_or(false),
                ))
            }
            ApiKind::Other => Err(Unsupported::NotOneText),
        }
    }
}

impl LocalTokenizer {
    /// The directory `loaded` (sharing its remembered pieces) with checks of its own,
    /// checking every `every`th prompt.
    fn checking(loaded: &Arc<Loaded>, every: u64) -> LocalTokenizer {
        let checks = Checks::default();
        checks.every.store(every, Ordering::Relaxed);
        LocalTokenizer {
            loaded: Arc::clone(loaded),
            checks,
        }
    }

    /// Whether the prompt just tokenized, of `kind`, should also be tokenized by the
    /// engine and the two compared: the first of its kind, then every
    /// [`LocalTokenizers::checking_every`]th. A tokenizer that disagrees with the engine
    /// misses every precise match without an error; the check finds it, and catches an
    /// engine whose template or tokenizer changed under a running kvroute.
    pub fn due_for_check(&self, kind: PromptKind) -> bool {
        let every = self.checks.every.load(Ordering::Relaxed);
        every > 0
            && self.checks.tokenized[kind as usize]
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(every)
    }

    /// Notes that a check of a prompt of `kind` found other tokens than the engine's:
    /// from now on the pods tokenize this model's prompts (those with tools, or with
    /// reasoning, only, for such a prompt). Whether it is the first such finding for the
    /// kind.
    pub fn found_different(&self, kind: PromptKind) -> bool {
        !self.checks.differs[kind as usize].swap(true, Ordering::Relaxed)
    }

    /// Whether a check of a prompt with neither tools nor reasoning found other tokens
    /// than the engine's (the tokenizer is then set aside for the model).
    pub fn differs(&self) -> bool {
        self.checks.differs[PromptKind::Plain as usize].load(Ordering::Relaxed)
    }

    /// The text of `ids`, special tokens included (for showing where tokens differ).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.loaded
            .tokenizer
            .decode(ids, false)
            .unwrap_or_else(|e| format!("<cannot decode: {e}>"))
    }
}

/// The request fields that decide a prompt's tokens.
#[derive(Deserialize)]
struct PromptRequest<'a> {
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(borrow, default)]
    chat_template: Option<&'a RawValue>,
    /// Read in its order (a dict a template prints keeps it, as in Python).
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    documents: Option<&'a RawValue>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

/// The fields of a message that vLLM hands a template. Tool calls, and the other fields
/// whose null differs from their absence, are read as written, in their order.
#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<serde_json::Value>,
    #[serde(default)]
    content: Option<serde_json::Value>,
    #[serde(default)]
    name: Option<serde_json::Value>,
    #[serde(default)]
    reasoning: Option<serde_json::Value>,
    #[serde(default)]
    reasoning_content: Option<serde_json::Value>,
    #[serde(default, deserialize_with = "present")]
    tool_calls: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    tool_call_id: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    tools: Option<Value>,
}

/// A field that is present, null or not (`None` only where the key is absent).
fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(deserializer).map(Some)
}

impl ChatTemplate {
    fn new(
        source: String,
        tool_use: Option<String>,
        special_tokens: Vec<(&'static str, String)>,
    ) -> Result<Self, TemplateError> {
        let content_parts = loops_over_content(&source);
        let mut env = kvroute_chat_template::environment();
        env.add_template_owned(CHAT, template_source(&source))?;
        let tool_use = match tool_use {
            Some(source) => {
                env.add_template_owned(TOOL_USE, template_source(&source))?;
                Some(loops_over_content(&source))
            }
            None => None,
        };
        Ok(ChatTemplate {
            env,
            content_parts,
            tool_use,
            special_tokens,
        })
    }

    /// The conversation of `request` as the template writes it.
    fn render(&self, request: &PromptRequest<'_>) -> Result<String, Unsupported> {
        let messages = request.messages.as_ref().ok_or(Unsupported::NotOneText)?;
        if request.chat_template.is_some_and(|v| v.get() != "null") {
            return Err(Unsupported::LeftToPod("brings its own chat template"));
        }
        let kwargs = keyword_arguments(request.chat_template_kwargs.as_ref())?;
        if kwargs
            .iter()
            .any(|(_, value)| kvroute_chat_template::holds_wide_number(value))
        {
            return Err(Unsupported::LeftToPod(
                "has chat_template_kwargs that hold an integer beyond 64 bits",
            ));
        }
        if kwargs
            .iter()
            .any(|(name, value)| !value.is_none() && KWARGS_LEFT_TO_POD.contains(&name.as_str()))
        {
            return Err(Unsupported::LeftToPod(
                "names tools, documents or a template in its chat_template_kwargs",
            ));
        }
        let continued = request.continue_final_message == Some(true);
        // transformers refuses both at once, and vLLM's default adds the generation prompt.
        if continued
            && (request.add_generation_prompt != Some(false)
                || kwargs
                    .iter()
                    .any(|(name, _)| name == "add_generation_prompt"))
        {
            return Err(Unsupported::LeftToPod(
                "continues its final message and adds a generation prompt",
            ));
        }
        // `None` where the request has none; a list (maybe empty) where it has some, which
        // picks a tokenizer's `tool_use` template as transformers does.
        let tools = shaped(
            request.tools,
            "has tools that do not parse",
            kvroute_chat_template::tools,
        )?;
        let documents = shaped(
            request.documents,
            "has documents that do not parse",
            kvroute_chat_template::documents,
        )?;
        let (template, content_parts) = match self.tool_use.filter(|_| tools.is_some()) {
            Some(content_parts) => (TOOL_USE, content_parts),
            None => (CHAT, self.content_parts),
        };
        let last = messages.len().saturating_sub(1);
        let mut final_text = String::new();
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, message)| {
                let continued = continued && i == last;
                let (value, text) = message_for_template(message, content_parts, continued)?;
                if continued {
                    final_text = text;
                }
                Ok(value)
            })
            .collect::<Result<Vec<_>, Unsupported>>()?;
        if continued && messages.is_empty() {
            return Err(Unsupported::Render(
                "continue_final_message is set but the conversation is empty".into(),
            ));
        }
        // Later entries override earlier ones. `tools` and `documents` are none, not
        // undefined, as transformers passes them (`tools is not none` is true of an
        // undefined value); the request's keyword arguments override the special tokens
        // and the generation prompt, not the conversation.
        let mut context: Vec<(String, Value)> = vec![
            ("tools".into(), tools.unwrap_or_else(|| Value::from(()))),
            (
                "documents".into(),
                documents.unwrap_or_else(|| Value::from(())),
            ),
            (
                "add_generation_prompt".into(),
                Value::from(request.add_generation_prompt.unwrap_or(true)),
            ),
        ];
        for (name, token) in &self.special_tokens {
            context.push(((*name).into(), Value::from(token.as_str())));
        }
        context.extend(kwargs);
        context.push(("messages".into(), Value::from(messages)));
        let context = Value::from_pairs(context);
        let rendered = self
            .env
            .get_template(template)
            .and_then(|template| kvroute_chat_template::render(&template, context))
            .map_err(|e| Unsupported::Render(e.to_string()))?;
        if !continued {
            return Ok(rendered);
        }
        kvroute_chat_template::cut_at_marker(&rendered, &final_text).ok_or_else(|| {
            Unsupported::Render(
                "continue_final_message is set but the final message does not appear in the \
                 rendered chat"
                    .into(),
            )
        })
    }
}

/// A request field vLLM hands the template after validating it (`shape`): `None` where
/// the request has none. Read in its order, as Python keeps a dict's.
fn shaped(
    field: Option<&RawValue>,
    unparsable: &'static str,
    shape: fn(&Value) -> Result<Value, kvroute_chat_template::Unshaped>,
) -> Result<Option<Value>, Unsupported> {
    let Some(field) = field.filter(|field| field.get() != "null") else {
        return Ok(None);
    };
    let value: Value =
        serde_json::from_str(field.get()).map_err(|_| Unsupported::LeftToPod(unparsable))?;
    kvroute_chat_template::wide_numbers(field.get(), &value).map_err(left_to_pod)?;
    shape(&value).map(Some).map_err(left_to_pod)
}

/// What vLLM would refuse, or what vLLM releases shape differently.
fn left_to_pod(unshaped: kvroute_chat_template::Unshaped) -> Unsupported {
    Unsupported::LeftToPod(unshaped.0)
}

/// One message as vLLM hands it to the template, its fields in vLLM's order (a template
/// that prints a message shows them so): its role; its content as one string (text parts
/// joined by a newline) or, with `content_parts`, as a list of text parts; an assistant's
/// tool calls ([`kvroute_chat_template::tool_calls`]) and reasoning (under both its names);
/// a tool result's `tool_call_id`; its name if it is a string; a developer's tools (none).
/// Where the message is `continued` (the final one of a `continue_final_message`
/// request), transformers' marker follows its text, and the text before the marker comes
/// back with the message, for [`kvroute_chat_template::cut_at_marker`].
fn message_for_template(
    message: &Message,
    content_parts: bool,
    continued: bool,
) -> Result<(Value, String), Unsupported> {
    // No content is an empty string (an empty list of parts), as vLLM hands it over.
    let mut texts: Vec<std::borrow::Cow<'_, str>> = match &message.content {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::String(text)) => vec![text.as_str().into()],
        Some(serde_json::Value::Array(parts)) => parts
            .iter()
            .map(|part| {
                let text = part.get("text").and_then(serde_json::Value::as_str);
                match part.get("type").and_then(serde_json::Value::as_str) {
                    Some("text") => text.map(Into::into),
                    _ => None,
                }
                .ok_or(Unsupported::LeftToPod("has content other than text"))
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(Unsupported::LeftToPod("has content other than text")),
    };
    // The text a continued message continues, before transformers' marker is appended to
    // it: its last text part, or its whole content as one string.
    let mut final_text = String::new();
    if content_parts {
        if continued {
            let last = texts.last_mut().ok_or_else(|| {
                Unsupported::Render(
                    "continue_final_message is set but the final message has no text".into(),
                )
            })?;
            final_text = last.to_string();
            last.to_mut()
                .push_str(kvroute_chat_template::CONTINUE_MARKER);
        }
    } else {
        texts = vec![texts.join("\n").into()];
        if continued {
            final_text = texts[0].to_string();
            texts[0]
                .to_mut()
                .push_str(kvroute_chat_template::CONTINUE_MARKER);
        }
    }
    let content = if content_parts {
        Value::from(
            texts
                .into_iter()
                .map(|text| {
                    Value::from_pairs([("type", Value::from("text")), ("text", Value::from(text))])
                })
                .collect::<Vec<_>>(),
        )
    } else {
        Value::from(texts.concat())
    };
    let role = message.role.as_ref();
    let is = |name: &str| role.and_then(serde_json::Value::as_str) == Some(name);
    let mut fields: Vec<(&str, Value)> = Vec::with_capacity(6);
    fields.extend(role.map(|role| ("role", Value::from(Serde(role)))));
    fields.push(("content", content));
    if is("assistant") {
        if let Some(calls) = message.tool_calls.as_ref().filter(|calls| !calls.is_none()) {
            let calls = kvroute_chat_template::tool_calls(calls).map_err(left_to_pod)?;
            fields.extend(calls.map(|calls| ("tool_calls", calls)));
        }
        let reasoning = [&message.reasoning, &message.reasoning_content]
            .into_iter()
            .find_map(|field| field.as_ref().filter(|value| !value.is_null()))
            .map(|v| Value::from(Serde(v)));
        if let Some(reasoning) = reasoning {
            // transformers 5 hands it over as `thinking` too, first (gpt-oss's templates
            // read that name); 4.x does not, and the checks against the engine, which
            // count prompts with reasoning apart ([`PromptKind`]), find an engine on it.
            fields.insert(0, ("thinking", reasoning.clone()));
            fields.push(("reasoning", reasoning.clone()));
            fields.push(("reasoning_content", reasoning));
        }
    } else if is("tool") {
        fields.extend(message.tool_call_id.clone().map(|id| ("tool_call_id", id)));
    }
    let name = message.name.as_ref().filter(|name| name.is_string());
    fields.extend(name.map(|name| ("name", Value::from(Serde(name)))));
    if is("developer") {
        if message.tools.as_ref().is_some_and(|tools| !tools.is_none()) {
            return Err(Unsupported::LeftToPod("has a developer message with tools"));
        }
        fields.push(("tools", Value::from(())));
    }
    Ok((Value::from_pairs(fields), final_text))
}

/// The request's `chat_template_kwargs` by name, in their order (none: no arguments).
fn keyword_arguments(kwargs: Option<&Value>) -> Result<Vec<(String, Value)>, Unsupported> {
    let Some(kwargs) = kwargs.filter(|kwargs| !kwargs.is_none()) else {
        return Ok(Vec::new());
    };
    let not_an_object =
        || Unsupported::LeftToPod("has chat_template_kwargs that are not an object");
    if kwargs.kind() != minijinja::value::ValueKind::Map {
        return Err(not_an_object());
    }
    kwargs
        .try_iter()
        .map_err(|_| not_an_object())?
        .map(|name| {
            let value = kwargs.get_item(&name).map_err(|_| not_an_object())?;
            let name = name.as_str().ok_or_else(not_an_object)?.to_owned();
            Ok((name, value))
        })
        .collect()
}

/// A JSON file of the model directory, or `None` where there is none.
fn read_json<T: serde::de::DeserializeOwned>(file: &Path) -> Result<Option<T>, LoadError> {
    match std::fs::read(file) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| LoadError::new(file, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(LoadError::new(file, e)),
    }
}

/// The name transformers renders a list of named templates' by default.
const DEFAULT: &str = "default";

/// The chat template `name` of a `chat_template` field: the string itself for the
/// default, else the list's entry of that name.
fn named_template<'a>(value: &'a serde_json::Value, name: &str) -> Option<&'a str> {
    match value {
        serde_json::Value::String(source) if name == DEFAULT => Some(source),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(serde_json::Value::as_str) == Some(name))
            .and_then(|t| t.get("template"))
            .and_then(serde_json::Value::as_str),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
