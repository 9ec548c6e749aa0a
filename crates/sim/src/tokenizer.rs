//! The real tokenizer of a model (`--tokenizer DIR`), used as vLLM's OpenAI server uses it.
//!
//! Off by default: without it, pods use the synthetic tokenizer of [`crate::tokens`]. With it,
//! every prompt is tokenized by the model's own `tokenizer.json` (Hugging Face's `tokenizers`)
//! and chat requests are rendered by its Jinja chat template first. What follows is vLLM's
//! behaviour with a Hugging Face fast tokenizer; kvroute's own local tokenizer must match it
//! token for token, or its prefix hashes miss the pods' caches.
//!
//! # The model directory
//! As vLLM's `--tokenizer` takes it: `tokenizer.json` (required); `tokenizer_config.json`
//! (optional: `chat_template` and the named special tokens, each a string or an object with
//! a `content` field; `special_tokens_map.json` fills in the tokens it does not name);
//! `chat_template.jinja` (optional; when present it is the chat template), else a
//! processor's `chat_template.json`, else `tokenizer_config.json`'s. A `chat_template` given as a list of
//! named templates is used as transformers uses it: `tool_use` for a request with tools if
//! there is one, else `default`.
//!
//! # Completions (`/v1/completions`, `/v1/completions/render`, `/tokenize` with `prompt`)
//! A string prompt is encoded with `add_special_tokens` = the request's field, default
//! **true**: the post-processor adds the BOS token. Token-id prompts are taken as they are.
//!
//! # Chat (`/v1/chat/completions`, `/v1/chat/completions/render`, `/tokenize` with `messages`)
//! The messages are rendered with the chat template, then the text is encoded with
//! `add_special_tokens` = the request's field, default **false** (the template writes the BOS).
//! Rendering is transformers' `apply_chat_template`:
//! - Jinja as transformers runs it (`kvroute-chat-template`, the gateway's too): blocks
//!   trimmed and left-stripped, loop controls, Python's string methods,
//!   `raise_exception(msg)` (fails the request), `strftime_now(fmt)`, a `tojson` that
//!   writes what Python's `json.dumps` writes (no HTML escaping), string literals read and
//!   values written as Python reads and writes them;
//! - the variables `messages`, `tools` (the request's as vLLM dumps its pydantic models of
//!   them, `kvroute_chat_template::tools`; else none), `documents` (the request's, else none),
//!   `add_generation_prompt` (default true), the named special tokens, and every key of the
//!   request's `chat_template_kwargs` at the top level (overriding the others, as vLLM merges
//!   them into the same keyword arguments);
//! - each message as vLLM hands it over: `role`, `content` as one string (an array of
//!   parts: the text parts joined with `"\n"`; null: `""`), or, where the template loops
//!   over a message's content (vLLM's "openai" format), as the list of text parts, `name`
//!   when a string, an assistant's `tool_calls` (in OpenAI's typed dict's key order, each
//!   function's `arguments` parsed from its JSON string into an object, an empty list
//!   dropped, as vLLM does) and its reasoning (as both `reasoning` and
//!   `reasoning_content`, and first as `thinking`, as transformers 5 adds it), a tool
//!   message's `tool_call_id`, a developer message's `tools`; other fields are dropped.
//!   Tools and tool calls vLLM refuses (a custom tool, arguments that are not one JSON
//!   object) are a 400;
//! - with `continue_final_message` (default false; not a template variable), the text is
//!   cut right after the last occurrence of the final message's stripped content, and
//!   right-stripped; asking for it together with `add_generation_prompt` is refused.
//!
//! A template error (a `raise_exception`, an undefined operation) refuses the request; so does
//! a chat request when the directory has no chat template, as recent transformers do.
//! Adapter (LoRA) names do not change tokenization.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use minijinja::value::Serde;
use minijinja::{Environment, Value as JinjaValue};
use serde_json::Value;

/// Why a tokenizer directory could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("cannot read {path}: {error}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error (in the message, not a `source`: one line, not repeated).
        error: std::io::Error,
    },
    /// `tokenizer.json` is not a tokenizer the library can build.
    #[error("invalid tokenizer {path}: {message}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The library's reason.
        message: String,
    },
    /// `tokenizer_config.json` is not the JSON expected.
    #[error("invalid tokenizer config {path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The chat template does not compile.
    #[error("invalid chat template in {path}: {error}")]
    Template {
        /// The file holding the template.
        path: PathBuf,
        /// The Jinja error (in the message, not a `source`: one line, not repeated).
        error: minijinja::Error,
    },
}

/// Why a request's prompt could not be tokenized (a 400 for the client).
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// A chat request, but the directory has no chat template.
    #[error(
        "the tokenizer has no chat template: chat requests need one (a chat_template in \
         tokenizer_config.json, or chat_template.jinja)"
    )]
    NoChatTemplate,
    /// The tokenizer has named chat templates but none called `default` (nor `tool_use`
    /// for a request with tools).
    #[error("the tokenizer has several chat templates and none named 'default'")]
    NoDefaultTemplate,
    /// The template failed (`raise_exception`, a bad operation on the request's values).
    #[error("chat template error: {0}")]
    Render(minijinja::Error),
    /// A request field has the wrong shape.
    #[error("{0}")]
    Invalid(String),
    /// The tokenizer failed on the text.
    #[error("tokenization failed: {0}")]
    Encode(String),
}

/// Name of a lone chat template (no extension: no auto-escaping).
const DEFAULT_TEMPLATE: &str = "default";
/// The named template transformers picks when the request has tools.
const TOOL_USE_TEMPLATE: &str = "tool_use";

/// A model's tokenizer and chat template, loaded once and shared by every pod of the process.
pub struct HfTokenizer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    /// Holds the compiled chat templates, under `default` for a lone one.
    env: Environment<'static>,
    /// Names of the templates in `env` (none, `default`, or those of a named list), and
    /// whether each loops over a message's content (vLLM then hands the content over as a
    /// list of parts, its "openai" format, else as one string).
    templates: Vec<(String, bool)>,
    /// The named special tokens the tokenizer has ([`kvroute_chat_template::SPECIAL_TOKENS`]).
    special_tokens: Vec<(&'static str, String)>,
}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("dir", &self.dir)
            .field("templates", &self.templates)
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

/// The parts of `tokenizer_config.json` (or a processor's `chat_template.json`) that
/// tokenization reads: the template, and the special tokens among the other keys.
#[derive(Debug, Default, serde::Deserialize)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<Value>,
    #[serde(flatten)]
    others: serde_json::Map<String, Value>,
}

/// `tokenizer_config.json`'s `chat_template`: one template (named `default`), or a list of
/// `{"name", "template"}` objects, as transformers saves several.
fn named_templates(
    value: Option<Value>,
    config_path: &Path,
) -> Result<Vec<(String, String)>, LoadError> {
    let bad = || LoadError::Config {
        path: config_path.to_path_buf(),
        message: "chat_template must be a string or a list of {name, template} objects".into(),
    };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![(DEFAULT_TEMPLATE.to_string(), s)]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                let name = item.get("name").and_then(Value::as_str).ok_or_else(bad)?;
                let template = item
                    .get("template")
                    .and_then(Value::as_str)
                    .ok_or_else(bad)?;
                Ok((name.to_string(), template.to_string()))
            })
            .collect(),
        Some(_) => Err(bad()),
    }
}

/// A JSON file of the directory, or `None` where there is none.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, LoadError> {
    read(path)?
        .map(|text| {
            serde_json::from_str(&text).map_err(|e| LoadError::Config {
                path: path.to_path_buf(),
                message: e.to_string(),
            })
        })
        .transpose()
}

fn read(path: &Path) -> Result<Option<String>, LoadError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(LoadError::Read {
            path: path.to_path_buf(),
            error,
        }),
    }
}

impl HfTokenizer {
    /// Loads `dir` (see the module documentation for its files).
    pub fn load(dir: &Path) -> Result<HfTokenizer, LoadError> {
        let tokenizer_path = dir.join("tokenizer.json");
        let json = std::fs::read(&tokenizer_path).map_err(|error| LoadError::Read {
            path: tokenizer_path.clone(),
            error,
        })?;
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(&json).map_err(|e| LoadError::Tokenizer {
                path: tokenizer_path.clone(),
                message: e.to_string(),
            })?;

        let config_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = read_json(&config_path)?.unwrap_or_default();
        let map_path = dir.join("special_tokens_map.json");
        let map: serde_json::Map<String, Value> = read_json(&map_path)?.unwrap_or_default();
        let special_tokens = kvroute_chat_template::special_tokens(&config.others, &map);

        // chat_template.jinja, when present, is the template; then a processor's
        // chat_template.json (vLLM prefers a multimodal model's processor template); then
        // the configuration's.
        let jinja_path = dir.join("chat_template.jinja");
        let processor_path = dir.join("chat_template.json");
        let (sources, template_path) = match read(&jinja_path)? {
            Some(text) => (vec![(DEFAULT_TEMPLATE.to_string(), text)], jinja_path),
            None => match read_json::<TokenizerConfig>(&processor_path)? {
                Some(processor) => (
                    named_templates(processor.chat_template, &processor_path)?,
                    processor_path,
                ),
                None => (
                    named_templates(config.chat_template, &config_path)?,
                    config_path,
                ),
            },
        };
        let mut env = kvroute_chat_template::environment();
        let mut templates = Vec::with_capacity(sources.len());
        for (name, source) in sources {
            env.add_template_owned(
                name.clone(),
                kvroute_chat_template::template_source(&source),
            )
            .map_err(|error| LoadError::Template {
                path: template_path.clone(),
                error,
            })?;
            templates.push((name, kvroute_chat_template::loops_over_content(&source)));
        }
        Ok(HfTokenizer {
            dir: dir.to_path_buf(),
            tokenizer,
            env,
            templates,
            special_tokens,
        })
    }

    /// The directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether chat requests can be rendered.
    pub fn has_chat_template(&self) -> bool {
        !self.templates.is_empty()
    }

    /// Token ids of `text`; `add_special_tokens` runs the post-processor (BOS for Llama 3).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| PromptError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of a completion request's string `prompt`: special tokens unless the request
    /// says `"add_special_tokens": false`.
    pub fn encode_completion(
        &self,
        prompt: &str,
        request: &Value,
    ) -> Result<Vec<u32>, PromptError> {
        let add_special_tokens = flag(request, "add_special_tokens", true)?;
        self.encode(prompt, add_special_tokens)
    }

    /// Token ids of a chat request (its body's JSON): the rendered template, with no special
    /// tokens added unless the request says `"add_special_tokens": true`.
    pub fn encode_chat(&self, body: &[u8]) -> Result<Vec<u32>, PromptError> {
        let (request, ordered) = read_body(body)?;
        let add_special_tokens = flag(&request, "add_special_tokens", false)?;
        let text = self.render(&request, &ordered)?;
        self.encode(&text, add_special_tokens)
    }

    /// The chat request's prompt text (of its body's JSON): its messages rendered with the
    /// chat template.
    pub fn render_chat(&self, body: &[u8]) -> Result<String, PromptError> {
        let (request, ordered) = read_body(body)?;
        self.render(&request, &ordered)
    }

    /// [`HfTokenizer::render_chat`] of a body read by [`read_body`].
    fn render(&self, request: &Value, ordered: &JinjaValue) -> Result<String, PromptError> {
        let find = |name: &str| self.templates.iter().find(|(t, _)| t == name);
        let has_tools = request.get("tools").is_some_and(|t| !t.is_null());
        let (name, content_parts) = if self.templates.is_empty() {
            return Err(PromptError::NoChatTemplate);
        } else if let Some(template) = find(TOOL_USE_TEMPLATE).filter(|_| has_tools) {
            template
        } else if let Some(template) = find(DEFAULT_TEMPLATE) {
            template
        } else {
            return Err(PromptError::NoDefaultTemplate);
        };
        let kwargs = match request.get("chat_template_kwargs") {
            None | Some(Value::Null) => serde_json::Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(_) => return Err(invalid("'chat_template_kwargs' must be an object")),
        };
        // vLLM merges chat_template_kwargs over the request's own fields.
        let merged_flag = |key: &str, default: bool| match kwargs.get(key) {
            Some(v) => Ok(v.as_bool().unwrap_or(default)),
            None => flag(request, key, default),
        };
        let add_generation_prompt = merged_flag("add_generation_prompt", true)?;
        let continue_final_message = merged_flag("continue_final_message", false)?;
        if add_generation_prompt && continue_final_message {
            return Err(invalid(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        let messages = conversation(request, ordered, *content_parts, continue_final_message)?;

        // Later entries override earlier ones: special tokens, then the request's fields,
        // then chat_template_kwargs; `messages` is always the conversation.
        let mut ctx: BTreeMap<String, JinjaValue> = BTreeMap::new();
        for (name, token) in &self.special_tokens {
            ctx.insert((*name).into(), JinjaValue::from(token.as_str()));
        }
        // The tools as vLLM dumps its models of them; documents as given.
        let tools = match request.get("tools") {
            None | Some(Value::Null) => JinjaValue::from(()),
            Some(_) => kvroute_chat_template::tools(&ordered.get_attr("tools").unwrap_or_default())
                .map_err(|e| invalid(format!("the request {e}")))?,
        };
        ctx.insert("tools".into(), tools);
        let documents = match request.get("documents") {
            None | Some(Value::Null) => JinjaValue::from(()),
            Some(_) => {
                kvroute_chat_template::documents(&ordered.get_attr("documents").unwrap_or_default())
                    .map_err(|e| invalid(format!("the request {e}")))?
            }
        };
        ctx.insert("documents".into(), documents);
        ctx.insert(
            "add_generation_prompt".into(),
            JinjaValue::from(add_generation_prompt),
        );
        for (k, v) in &kwargs {
            if k != "continue_final_message" {
                ctx.insert(k.clone(), JinjaValue::from(Serde(v)));
            }
        }
        let final_text = messages
            .last()
            .map(|m| m.continued.clone())
            .unwrap_or_default();
        let for_template = messages
            .into_iter()
            .map(|m| JinjaValue::from_pairs(m.fields))
            .collect::<Vec<_>>();
        ctx.insert("messages".into(), JinjaValue::from(for_template));

        let template = self.env.get_template(name).map_err(PromptError::Render)?;
        let rendered = kvroute_chat_template::render(&template, JinjaValue::from_pairs(ctx))
            .map_err(PromptError::Render)?;
        if continue_final_message {
            return kvroute_chat_template::cut_at_marker(&rendered, &final_text).ok_or_else(|| {
                invalid(
                    "continue_final_message is set but the final message does not appear in the \
                     chat after applying the chat template",
                )
            });
        }
        Ok(rendered)
    }
}

/// A chat request's body read twice: for its fields, and keeping every object's order for
/// what templates print whole (tools, tool calls, documents).
fn read_body(body: &[u8]) -> Result<(Value, JinjaValue), PromptError> {
    let not_json = |e: serde_json::Error| invalid(format!("the body is not valid JSON: {e}"));
    Ok((
        serde_json::from_slice(body).map_err(not_json)?,
        serde_json::from_slice(body).map_err(not_json)?,
    ))
}

fn invalid(message: impl Into<String>) -> PromptError {
    PromptError::Invalid(message.into())
}

/// A boolean request field: absent or null gives `default`; anything but a boolean is refused.
fn flag(request: &Value, key: &str, default: bool) -> Result<bool, PromptError> {
    match request.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(format!("'{key}' must be a boolean"))),
    }
}

/// A message of the conversation as vLLM hands it to the template.
struct Message {
    /// Its fields in vLLM's order (a template that prints a message shows them so).
    fields: Vec<(&'static str, JinjaValue)>,
    /// For the final message of a `continue_final_message` request, the text it continues
    /// (transformers' marker follows it in `fields`).
    continued: String,
}

/// The messages as vLLM hands them to the template: `request`'s, with `ordered` the same
/// body read in its objects' order; in the "openai" content format (`content_parts`) each
/// content as a list of `{"type": "text", "text"}` parts, one for a string content.
fn conversation(
    request: &Value,
    ordered: &JinjaValue,
    content_parts: bool,
    continue_final_message: bool,
) -> Result<Vec<Message>, PromptError> {
    let messages = request
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("'messages' must be a list"))?;
    if continue_final_message && messages.is_empty() {
        return Err(invalid(
            "continue_final_message is set but the conversation is empty",
        ));
    }
    let ordered = ordered.get_attr("messages").unwrap_or_default();
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let continued = continue_final_message && i + 1 == messages.len();
            let ordered = ordered.get_item_by_index(i).unwrap_or_default();
            message(m, &ordered, content_parts, continued)
        })
        .collect()
}

fn message(
    m: &Value,
    ordered: &JinjaValue,
    content_parts: bool,
    continued: bool,
) -> Result<Message, PromptError> {
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("each message needs a string 'role'"))?;
    let texts: Vec<&str> = match m.get("content") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        Some(_) => return Err(invalid("a message's 'content' must be a string or a list")),
    };
    // transformers' continue_final_message: its marker after the text continued (the
    // last text part, or the whole content as one string).
    let marker = kvroute_chat_template::CONTINUE_MARKER;
    let mut continued_text = String::new();
    let content = if content_parts {
        let mut parts: Vec<String> = texts.into_iter().map(str::to_owned).collect();
        if continued {
            let last = parts.last_mut().ok_or_else(|| {
                invalid("continue_final_message is set but the final message has no text")
            })?;
            continued_text = last.clone();
            last.push_str(marker);
        }
        JinjaValue::from(parts.iter().map(|p| text_part(p)).collect::<Vec<_>>())
    } else {
        let mut text = texts.join("\n");
        if continued {
            continued_text = text.clone();
            text.push_str(marker);
        }
        JinjaValue::from(text)
    };
    let mut fields = vec![("role", JinjaValue::from(role)), ("content", content)];
    match role {
        "assistant" => {
            let calls = ordered.get_attr("tool_calls").unwrap_or_default();
            if !calls.is_none() && !calls.is_undefined() {
                let calls = kvroute_chat_template::tool_calls(&calls)
                    .map_err(|e| invalid(format!("the request {e}")))?;
                fields.extend(calls.map(|calls| ("tool_calls", calls)));
            }
            let reasoning = m
                .get("reasoning")
                .filter(|v| !v.is_null())
                .or_else(|| m.get("reasoning_content").filter(|v| !v.is_null()));
            if let Some(r) = reasoning {
                // As transformers 5 adds it, first.
                fields.insert(0, ("thinking", JinjaValue::from(Serde(r))));
                fields.push(("reasoning", JinjaValue::from(Serde(r))));
                fields.push(("reasoning_content", JinjaValue::from(Serde(r))));
            }
        }
        "tool" => {
            if let Some(id) = m.get("tool_call_id") {
                fields.push(("tool_call_id", JinjaValue::from(Serde(id))));
            }
        }
        _ => {}
    }
    if let Some(name) = m.get("name").and_then(Value::as_str) {
        fields.push(("name", JinjaValue::from(name)));
    }
    if role == "developer" {
        let tools = ordered.get_attr("tools").unwrap_or_default();
        let tools = if tools.is_undefined() {
            JinjaValue::from(())
        } else {
            tools
        };
        fields.push(("tools", tools));
    }
    Ok(Message {
        fields,
        continued: continued_text,
    })
}

fn text_part(text: &str) -> JinjaValue {
    JinjaValue::from_pairs([
        ("type", JinjaValue::from("text")),
        ("text", JinjaValue::from(text)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A request's body.
    fn bytes(request: &Value) -> Vec<u8> {
        serde_json::to_vec(request).expect("serializes")
    }

    fn fixture() -> HfTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../lab/tokenizers/bpe-4k");
        HfTokenizer::load(&dir).expect("the test tokenizer loads")
    }

    /// A temporary model directory: the fixture's tokenizer.json beside the given files.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str, files: &[(&str, &str)]) -> TempDir {
            let dir = std::env::temp_dir().join(format!(
                "kvroute-sim-tokenizer-{name}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("temp dir");
            let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../lab/tokenizers/bpe-4k/tokenizer.json");
            std::fs::copy(fixture, dir.join("tokenizer.json")).expect("copy tokenizer.json");
            for (file, text) in files {
                std::fs::write(dir.join(file), text).expect("write file");
            }
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    // Ids computed independently with Python's `tokenizers` on the fixture.
    const SENTENCE: &str = "The KV cache of every pod is scraped every 50 ms.";
    const SENTENCE_IDS: [u32; 13] = [
        0, 929, 571, 910, 321, 483, 335, 368, 3049, 483, 767, 413, 18,
    ];
    const TURN: &str = "<|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>";
    const TURN_IDS: [u32; 11] = [2, 509, 281, 3, 203, 203, 264, 80, 289, 933, 4];
    const BOS: u32 = 0;

    #[test]
    fn encoding_matches_python_tokenizers_on_the_fixture() {
        let t = fixture();
        assert_eq!(t.encode(SENTENCE, true).expect("encodes"), SENTENCE_IDS);
        assert_eq!(t.encode(TURN, false).expect("encodes"), TURN_IDS);
        assert_eq!(
            t.encode(SENTENCE, false).expect("encodes"),
            SENTENCE_IDS[1..]
        );
    }

    #[test]
    fn a_completion_gets_bos_unless_the_request_declines_it() {
        let t = fixture();
        let ids = t.encode_completion(SENTENCE, &json!({})).expect("encodes");
        assert_eq!(ids, SENTENCE_IDS);
        let ids = t
            .encode_completion(SENTENCE, &json!({"add_special_tokens": false}))
            .expect("encodes");
        assert_eq!(ids, SENTENCE_IDS[1..]);
        assert!(
            t.encode_completion(SENTENCE, &json!({"add_special_tokens": "no"}))
                .is_err()
        );
    }

    #[test]
    fn a_chat_renders_as_the_template_writes_it_with_one_bos() {
        let t = fixture();
        let request = json!({"messages": [
            {"role": "system", "content": "  Be brief.  "},
            {"role": "user", "content": "hello there"},
        ]});
        let text = t.render_chat(&bytes(&request)).expect("renders");
        assert_eq!(
            text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        let ids = t.encode_chat(&bytes(&request)).expect("encodes");
        assert_eq!(ids.first(), Some(&BOS));
        assert_eq!(ids.iter().filter(|&&id| id == BOS).count(), 1, "{ids:?}");
        assert_eq!(ids, t.encode(&text, false).expect("encodes"));

        let user_only = json!({"messages": [{"role": "user", "content": "hello there"}]});
        let ids = t.encode_chat(&bytes(&user_only)).expect("encodes");
        assert_eq!(ids[1..12], TURN_IDS);
    }

    #[test]
    fn a_chat_asking_for_special_tokens_gets_a_second_bos() {
        let t = fixture();
        let request = json!({"messages": [{"role": "user", "content": "hi"}],
                             "add_special_tokens": true});
        let ids = t.encode_chat(&bytes(&request)).expect("encodes");
        assert_eq!(ids[..2], [BOS, BOS]);
    }

    #[test]
    fn add_generation_prompt_false_drops_the_assistant_header() {
        let t = fixture();
        let request = json!({"messages": [{"role": "user", "content": "hello there"}],
                             "add_generation_prompt": false});
        let text = t.render_chat(&bytes(&request)).expect("renders");
        assert_eq!(text, format!("<|begin_of_text|>{TURN}"));
        let mut expected = vec![BOS];
        expected.extend(TURN_IDS);
        assert_eq!(t.encode_chat(&bytes(&request)).expect("encodes"), expected);
    }

    #[test]
    fn content_parts_are_joined_with_newlines() {
        let t = fixture();
        let parts = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "first"},
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "second"},
        ]}]});
        let joined = json!({"messages": [{"role": "user", "content": "first\nsecond"}]});
        assert_eq!(
            t.render_chat(&bytes(&parts)).expect("renders"),
            t.render_chat(&bytes(&joined)).expect("renders")
        );
    }

    #[test]
    fn an_unknown_role_fails_with_the_templates_message() {
        let t = fixture();
        let request = json!({"messages": [{"role": "wizard", "content": "hi"}]});
        let err = t
            .render_chat(&bytes(&request))
            .expect_err("raise_exception");
        assert!(matches!(err, PromptError::Render(_)), "{err:?}");
        assert!(err.to_string().contains("Unknown role: wizard"), "{err}");
    }

    #[test]
    fn chat_template_kwargs_reach_the_template_and_override_request_fields() {
        let dir = TempDir::new(
            "kwargs",
            &[(
                "chat_template.jinja",
                "{{ bos_token }}[{{ greeting }}|{{ add_generation_prompt }}|{{ tools is none }}|{{ tools }}]\n\
                 {% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}\n",
            )],
        );
        let t = HfTokenizer::load(&dir.0).expect("loads");
        let request = json!({"messages": [{"role": "user", "content": "hi"}],
                             "chat_template_kwargs": {"greeting": "hola",
                                                      "add_generation_prompt": false}});
        // No tokenizer_config.json: no bos_token; the trailing newline is dropped (Jinja's
        // keep_trailing_newline=False).
        assert_eq!(
            t.render_chat(&bytes(&request)).expect("renders"),
            "[hola|False|True|None]\nuser:hi"
        );
    }

    #[test]
    fn chat_template_jinja_takes_precedence_over_the_config() {
        let dir = TempDir::new(
            "precedence",
            &[
                (
                    "tokenizer_config.json",
                    r#"{"chat_template": "config", "bos_token": {"content": "<s>"}}"#,
                ),
                ("chat_template.jinja", "file {{ bos_token }}"),
            ],
        );
        let t = HfTokenizer::load(&dir.0).expect("loads");
        assert_eq!(
            t.render_chat(&bytes(&json!({"messages": []})))
                .expect("renders"),
            "file <s>"
        );
    }

    #[test]
    fn a_list_of_named_templates_picks_tool_use_for_tools_else_default() {
        let config = r#"{"chat_template": [{"name": "default", "template": "plain"},
                                           {"name": "tool_use", "template": "tools"}]}"#;
        let dir = TempDir::new("named", &[("tokenizer_config.json", config)]);
        let t = HfTokenizer::load(&dir.0).expect("loads");
        let plain = json!({"messages": []});
        let tools = json!({"messages": [], "tools": []});
        assert_eq!(t.render_chat(&bytes(&plain)).expect("renders"), "plain");
        assert_eq!(t.render_chat(&bytes(&tools)).expect("renders"), "tools");

        let config = r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#;
        let dir = TempDir::new("no-default", &[("tokenizer_config.json", config)]);
        let t = HfTokenizer::load(&dir.0).expect("loads");
        assert!(matches!(
            t.render_chat(&bytes(&plain)),
            Err(PromptError::NoDefaultTemplate)
        ));
    }

    #[test]
    fn templates_get_vllms_message_fields_and_python_helpers() {
        let template = "{% for m in messages %}{{ m.role }}\
            {% if m.tool_calls %}{% for c in m.tool_calls %} {{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}\
            {% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}\
            {% if m.name %} name={{ m.name }}{% endif %}\
            {% if m.extra is defined %} extra{% endif %}|{% endfor %}\
            {{ tools | tojson(indent=2) }}|{{ 'A-b'.lower().split('-') | join(',') }}\
            |{{ {'s': 'é<&>'} | tojson }}";
        let dir = TempDir::new("fields", &[("chat_template.jinja", template)]);
        let t = HfTokenizer::load(&dir.0).expect("loads");
        let request = json!({
            "messages": [
                {"role": "user", "content": "q", "name": "ann", "extra": 1},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": [1, 2]}"}}]},
                {"role": "tool", "content": "4", "tool_call_id": "c1"},
            ],
            "tools": [{"function": {"name": "f"}}],
        });
        assert_eq!(
            t.render_chat(&bytes(&request)).expect("renders"),
            "user name=ann|assistant f{\"x\": [1, 2]}|tool id=c1|\
             [\n  {\n    \"type\": \"function\",\n    \"function\": {\n      \"name\": \"f\",\
             \n      \"description\": null,\n      \"parameters\": null\n    }\n  }\n]\
             |a,b|{\"s\": \"é<&>\"}"
        );
    }

    #[test]
    fn tools_and_tool_calls_are_handed_over_in_the_order_and_shape_vllm_gives_them() {
        // Printed whole, as some templates print them: pydantic's dump of vLLM's tool
        // models, OpenAI's typed dict order for a call, the arguments parsed in their order
        // (the body as a client wrote it, its keys not sorted).
        let template = "{{ tools | tojson }}|{% for m in messages %}{{ m | tojson }}|{% endfor %}";
        let dir = TempDir::new("tool-order", &[("chat_template.jinja", template)]);
        let t = HfTokenizer::load(&dir.0).expect("loads");
        let body = br#"{"tools": [{"function": {"parameters": {"z": 1, "a": 2}, "name": "f"}, "type": "function"}],
            "messages": [{"role": "assistant", "content": null, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": 2}"}, "id": "c1"}]},
                {"role": "tool", "content": "4", "tool_call_id": "c1"}, {"role": "developer", "content": "d"}]}"#;
        assert_eq!(
            t.render_chat(body).expect("renders"),
            r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}}}]|{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"arguments": {"z": 1, "a": 2}, "name": "f"}, "type": "function"}]}|{"role": "tool", "content": "4", "tool_call_id": "c1"}|{"role": "developer", "content": "d", "tools": null}|"#
        );
        // What vLLM refuses is a 400.
        let custom = br#"{"tools": [{"type": "custom", "custom": {"name": "f"}}], "messages": []}"#;
        assert!(matches!(
            t.render_chat(custom),
            Err(PromptError::Invalid(_))
        ));
    }

    #[test]
    fn content_parts_special_tokens_and_a_processors_template_as_vllm_hands_them_over() {
        // The template loops over a message's content: vLLM's "openai" format hands the
        // parts over as a list, in vLLM's field order; every named special token is there.
        let template = "{% for m in messages %}{% for p in m['content'] %}{% endfor %}{% endfor %}\
            {{ messages }}|{{ pad_token }}|{{ sep_token }}";
        let dir = TempDir::new(
            "parts",
            &[
                (
                    "tokenizer_config.json",
                    r#"{"chat_template": "config", "pad_token": {"content": "<pad>"}}"#,
                ),
                (
                    "special_tokens_map.json",
                    r#"{"sep_token": "<sep>", "pad_token": "x"}"#,
                ),
                (
                    "chat_template.json",
                    &format!("{{\"chat_template\": {}}}", json!(template)),
                ),
            ],
        );
        let t = HfTokenizer::load(&dir.0).expect("loads");
        let request = json!({"messages": [
            {"name": "ann", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "role": "user"},
            {"role": "assistant", "content": "it's"},
        ]});
        // What transformers' renderer writes for the conversation vLLM builds.
        assert_eq!(
            t.render_chat(&bytes(&request)).expect("renders"),
            "[{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}], 'name': 'ann'}, \
             {'role': 'assistant', 'content': [{'type': 'text', 'text': \"it's\"}]}]\
             |<pad>|<sep>"
        );
    }

    #[test]
    fn continue_final_message_cuts_after_the_last_message() {
        let t = fixture();
        let request = json!({"messages": [
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "The answer is "},
        ], "add_generation_prompt": false, "continue_final_message": true});
        assert_eq!(
            t.render_chat(&bytes(&request)).expect("renders"),
            format!(
                "<|begin_of_text|>{TURN}<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is"
            )
        );
        let both = json!({"messages": [{"role": "user", "content": "x"}],
                          "continue_final_message": true});
        assert!(matches!(
            t.render_chat(&bytes(&both)),
            Err(PromptError::Invalid(_))
        ));
    }

    #[test]
    fn without_a_chat_template_chat_is_refused() {
        let dir = TempDir::new("no-template", &[]);
        let t = HfTokenizer::load(&dir.0).expect("loads");
        assert!(!t.has_chat_template());
        let err = t
            .encode_chat(&bytes(
                &json!({"messages": [{"role": "user", "content": "hi"}]}),
            ))
            .expect_err("no template");
        assert!(matches!(err, PromptError::NoChatTemplate));
        assert!(
            err.to_string()
                .contains("the tokenizer has no chat template")
        );
        assert_eq!(t.encode(SENTENCE, true).expect("encodes"), SENTENCE_IDS);
    }

    #[test]
    fn load_errors_name_the_path() {
        let missing = Path::new("/nonexistent/kvroute-model");
        let err = HfTokenizer::load(missing).expect_err("no such dir");
        assert!(
            err.to_string()
                .contains("/nonexistent/kvroute-model/tokenizer.json"),
            "{err}"
        );

        let dir = TempDir::new("bad-json", &[]);
        std::fs::write(dir.0.join("tokenizer.json"), "{not json").expect("write");
        let err = HfTokenizer::load(&dir.0).expect_err("invalid tokenizer.json");
        assert!(matches!(err, LoadError::Tokenizer { .. }), "{err:?}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");

        let dir = TempDir::new("bad-config", &[("tokenizer_config.json", "{")]);
        let err = HfTokenizer::load(&dir.0).expect_err("invalid config");
        assert!(err.to_string().contains("tokenizer_config.json"), "{err}");

        let dir = TempDir::new("bad-template", &[("chat_template.jinja", "{% for %}")]);
        let err = HfTokenizer::load(&dir.0).expect_err("syntax error");
        assert!(matches!(err, LoadError::Template { .. }), "{err:?}");
        assert!(err.to_string().contains("chat_template.jinja"), "{err}");
    }
}
