//! Property tests of [`parse_request`]. The body is read by streaming visitors; here the
//! module documentation's rules are worked out a second time, plainly, on a
//! `serde_json::Value` tree ([`expected`]), and the two readings must agree on every
//! generated request, valid or not. Digests and JSON lengths come from the crate's own
//! [`JsonLen`] run over the tree: what is checked is the walk, not the hash.

use proptest::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::ser::{CompactFormatter, Formatter};
use serde_json::{Map, Value};

use super::*;
use crate::testing::{config, json_value, tricky_text};

const APIS: [ApiKind; 3] = [
    ApiKind::Completions,
    ApiKind::ChatCompletions,
    ApiKind::Other,
];

fn api() -> impl Strategy<Value = ApiKind> {
    prop::sample::select(APIS.to_vec())
}

// ---------------------------------------------------------------------------------------
// The second reading of the rules.

/// How a body is refused: `RequestError::code` and `RequestError::param`.
type Refusal = (&'static str, Option<&'static str>);

fn invalid(field: &'static str) -> Refusal {
    ("invalid_field", Some(field))
}

/// Texts measured so far: a token estimate, and the texts the prefix joins with `'\n'`.
#[derive(Default)]
struct Measure {
    tokens: u64,
    texts: Vec<Vec<u8>>,
}

impl Measure {
    fn text(&mut self, text: &str) {
        self.tokens += u64::from(estimate_tokens(text.len()));
        self.texts.push(text.as_bytes().to_vec());
    }

    fn prefix(&self) -> Vec<u8> {
        let mut prefix = self.texts.join(&b'\n');
        prefix.truncate(PROMPT_PREFIX_BYTES);
        prefix
    }
}

fn json_len(value: &Value) -> JsonLen {
    JsonLen::deserialize(value).expect("a Value is valid JSON")
}

/// The digest a content part's payload value adds.
fn payload_digest(value: &Value) -> u64 {
    JsonLenVisitor {
        top: false,
        measure: false,
    }
    .deserialize(value)
    .expect("a Value is valid JSON")
    .digest
}

fn is_integer(value: &Value) -> bool {
    value.as_u64().is_some() || value.as_i64().is_some()
}

/// `max_tokens` / `max_completion_tokens`.
fn token_limit(value: &Value) -> Result<Option<u32>, ()> {
    match value {
        Value::Null => Ok(None),
        Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(v), _, _) => Ok(Some(u32::try_from(v).unwrap_or(u32::MAX))),
            (None, Some(_negative), _) => Err(()),
            (None, None, Some(v)) if v >= 0.0 && v.fract() == 0.0 => Ok(Some(v as u32)),
            _ => Err(()),
        },
        _ => Err(()),
    }
}

/// `prompt` of `/v1/completions`.
fn completions_prompt(value: &Value) -> Result<Option<Measure>, ()> {
    let mut prompt = Measure::default();
    match value {
        Value::Null => return Ok(None),
        Value::String(text) => prompt.text(text),
        Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                match item {
                    Value::String(text) if index == 0 => prompt.text(text),
                    Value::String(text) => prompt.tokens += u64::from(estimate_tokens(text.len())),
                    item if is_integer(item) => prompt.tokens += 1,
                    Value::Array(ids) if ids.iter().all(is_integer) => {
                        prompt.tokens += ids.len() as u64;
                    }
                    _ => return Err(()),
                }
            }
        }
        _ => return Err(()),
    }
    Ok(Some(prompt))
}

/// One message's `content`: its text bytes, its pieces for the prefix, its non-text parts.
#[derive(Default)]
struct Content {
    text_bytes: usize,
    pieces: Vec<Vec<u8>>,
    non_text_parts: u64,
}

fn content(value: &Value) -> Result<Content, ()> {
    let mut content = Content::default();
    match value {
        Value::Null => {}
        Value::String(text) => {
            content.text_bytes = text.len();
            content.pieces.push(text.as_bytes().to_vec());
        }
        Value::Array(parts) => {
            for part in parts {
                let Value::Object(part) = part else {
                    return Err(());
                };
                let (mut is_text, mut text, mut payload) = (None, None, 0u64);
                for (key, value) in part {
                    match key.as_str() {
                        "type" => is_text = Some(value.as_str().ok_or(())? == "text"),
                        "text" => text = Some(value.as_str().ok_or(())?),
                        _ => payload = json_len::mix(payload, payload_digest(value)),
                    }
                }
                match (is_text, text) {
                    (Some(true) | None, Some(text)) => {
                        content.text_bytes += text.len();
                        content.pieces.push(text.as_bytes().to_vec());
                    }
                    (Some(true), None) => content.pieces.push(Vec::new()),
                    _ => {
                        content.non_text_parts += 1;
                        content
                            .pieces
                            .push(format!("\0part:{payload:016x}").into_bytes());
                    }
                }
            }
        }
        _ => return Err(()),
    }
    Ok(content)
}

/// `messages` of `/v1/chat/completions`.
fn chat_messages(value: &Value) -> Result<Option<Measure>, ()> {
    let messages = match value {
        Value::Null => return Ok(None),
        Value::Array(messages) if !messages.is_empty() => messages,
        _ => return Err(()),
    };
    let mut prompt = Measure::default();
    for message in messages {
        let Value::Object(message) = message else {
            return Err(());
        };
        let (mut role, mut body, mut tool_calls) = (None, Content::default(), 0);
        for (key, value) in message {
            match key.as_str() {
                "role" => role = Some(value.as_str().ok_or(())?),
                "content" => body = content(value)?,
                "tool_calls" => tool_calls = json_len(value).len,
                _ => {}
            }
        }
        let role = role.ok_or(())?;
        prompt.tokens += u64::from(MESSAGE_OVERHEAD_TOKENS)
            + u64::from(estimate_tokens(body.text_bytes))
            + body.non_text_parts * u64::from(NON_TEXT_PART_TOKENS)
            + u64::from(estimate_tokens(tool_calls));
        prompt.texts.push(role.as_bytes().to_vec());
        if !body.pieces.is_empty() {
            prompt.texts.push(body.pieces.join(&b'\n'));
        }
    }
    Ok(Some(prompt))
}

/// A prompt-like field of the other APIs; `false` for `null`.
fn loose(value: &Value, prompt: &mut Measure) -> bool {
    match value {
        Value::Null => return false,
        Value::Bool(_) => {}
        Value::Number(_) => prompt.tokens += 1,
        Value::String(text) if text.starts_with("data:") => {
            prompt.tokens += u64::from(NON_TEXT_PART_TOKENS);
        }
        Value::String(text) => prompt.text(text),
        Value::Array(items) => items.iter().for_each(|item| {
            loose(item, prompt);
        }),
        Value::Object(entries) => entries.values().for_each(|item| {
            loose(item, prompt);
        }),
    }
    true
}

/// What [`parse_request`] must make of `body`, read entry by entry in the order it is
/// serialized (the first bad field is the one reported).
fn expected(api: ApiKind, body: &Map<String, Value>) -> Result<InferenceRequest, Refusal> {
    let (chat, other) = (api == ApiKind::ChatCompletions, api == ApiKind::Other);
    let mut model = None;
    let (mut max_tokens, mut max_completion_tokens, mut stream) = (None, None, None);
    let (mut prompt, mut input, mut messages) = (None, None, None);
    let (mut tools, mut functions) = (JsonLen::default(), JsonLen::default());
    for (key, value) in body {
        match key.as_str() {
            "model" => {
                model = match value {
                    Value::Null => None,
                    Value::String(name) if !name.is_empty() => Some(name.clone()),
                    _ => return Err(invalid("model")),
                }
            }
            "max_tokens" => max_tokens = token_limit(value).map_err(|()| invalid("max_tokens"))?,
            "max_completion_tokens" => {
                max_completion_tokens =
                    token_limit(value).map_err(|()| invalid("max_completion_tokens"))?;
            }
            "stream" => {
                stream = match value {
                    Value::Null => None,
                    Value::Bool(stream) => Some(*stream),
                    _ => return Err(invalid("stream")),
                }
            }
            "prompt" if api == ApiKind::Completions => {
                prompt = completions_prompt(value).map_err(|()| invalid("prompt"))?;
            }
            "messages" if chat => {
                messages = chat_messages(value).map_err(|()| invalid("messages"))?;
            }
            "tools" if chat => tools = json_len(value),
            "functions" if chat => functions = json_len(value),
            "prompt" | "input" | "messages" if other => {
                let mut measure = Measure::default();
                let present = loose(value, &mut measure).then_some(measure);
                match key.as_str() {
                    "prompt" => prompt = present,
                    "input" => input = present,
                    _ => messages = present,
                }
            }
            _ => {}
        }
    }
    let model = model.ok_or(("missing_model", Some("model")))?;
    let prompt = match api {
        ApiKind::Completions => prompt.ok_or(invalid("prompt"))?,
        ApiKind::ChatCompletions => {
            let mut prompt = messages.ok_or(invalid("messages"))?;
            prompt.tokens += u64::from(estimate_tokens(tools.len));
            prompt.tokens += u64::from(estimate_tokens(functions.len));
            prompt
        }
        ApiKind::Other => prompt.or(input).or(messages).unwrap_or_default(),
    };
    Ok(InferenceRequest {
        model,
        prompt_tokens: u32::try_from(prompt.tokens).unwrap_or(u32::MAX),
        max_output_tokens: max_completion_tokens.or(max_tokens),
        stream: stream.unwrap_or(false),
        prompt_prefix: prompt.prefix(),
        prefix_context: match (tools.digest, functions.digest) {
            (0, 0) => 0,
            (tools, functions) => json_len::mix(tools, functions).max(1),
        },
    })
}

fn refusal(err: &RequestError) -> Refusal {
    (err.code(), err.param())
}

// ---------------------------------------------------------------------------------------
// Generators.

/// Model names: real-looking ones, and any text (empty included: an invalid model).
fn model_name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "meta-llama/Llama-3.1-8B-Instruct",
            "sql-lora",
            "Qwen/Qwen2.5-7B",
            "mod\u{e8}le/\u{65e5}\u{672c}-\u{1f600}",
        ])
        .prop_map(str::to_owned),
        tricky_text(24),
    ]
}

/// Prompt text: mostly short, sometimes longer than the prefix kept.
fn prompt_text() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => tricky_text(40),
        1 => (tricky_text(6), 1usize..4000).prop_map(|(piece, times)| piece.repeat(times)),
        1 => tricky_text(20).prop_map(|text| format!("data:image/png;base64,{text}")),
    ]
}

fn token_ids() -> impl Strategy<Value = Value> {
    prop::collection::vec(
        prop_oneof![
            (0u64..200_000).prop_map(Value::from),
            any::<i64>().prop_map(Value::from)
        ],
        0..8,
    )
    .prop_map(Value::Array)
}

fn token_limit_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u64..10_000).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0u32..10_000).prop_map(|n| Value::from(f64::from(n))),
        Just(Value::from(1e300)),
    ]
}

/// `prompt` of `/v1/completions` in each shape the API allows.
fn completions_prompt_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        prompt_text().prop_map(Value::String),
        prop::collection::vec(prompt_text().prop_map(Value::String), 0..4).prop_map(Value::Array),
        token_ids(),
        prop::collection::vec(token_ids(), 0..4).prop_map(Value::Array),
    ]
}

fn object(entries: Vec<(String, Value)>) -> Value {
    Value::Object(entries.into_iter().collect())
}

/// A chat content part: text (typed or inferred), an image, audio, an empty text part, or
/// anything with extra keys.
fn content_part() -> impl Strategy<Value = Value> {
    prop_oneof![
        prompt_text().prop_map(|text| object(vec![
            ("type".into(), "text".into()),
            ("text".into(), text.into())
        ])),
        prompt_text().prop_map(|text| object(vec![("text".into(), text.into())])),
        tricky_text(30).prop_map(|url| object(vec![
            ("type".into(), "image_url".into()),
            ("image_url".into(), object(vec![("url".into(), url.into())])),
        ])),
        tricky_text(30).prop_map(|data| object(vec![
            ("type".into(), "input_audio".into()),
            (
                "input_audio".into(),
                object(vec![
                    ("data".into(), data.into()),
                    ("format".into(), "wav".into())
                ])
            ),
        ])),
        Just(object(vec![("type".into(), "text".into())])),
        (
            prop::option::of(tricky_text(6)),
            prop::collection::vec((tricky_text(6), json_value(2)), 0..3)
        )
            .prop_map(|(kind, mut entries)| {
                entries.extend(kind.map(|kind| ("type".to_owned(), Value::String(kind))));
                object(entries)
            }),
    ]
}

fn message_content() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => prompt_text().prop_map(Value::String),
        1 => Just(Value::Null),
        3 => prop::collection::vec(content_part(), 0..4).prop_map(Value::Array),
    ]
}

fn chat_message() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            prop::sample::select(vec!["system", "user", "assistant", "tool"])
                .prop_map(str::to_owned),
            tricky_text(8),
        ],
        prop::option::weighted(0.9, message_content()),
        prop::option::weighted(0.2, json_value(3)),
        prop::collection::vec((tricky_text(6), json_value(2)), 0..2),
    )
        .prop_map(|(role, content, tool_calls, mut entries)| {
            entries.push(("role".into(), role.into()));
            entries.extend(content.map(|content| ("content".to_owned(), content)));
            entries.extend(tool_calls.map(|calls| ("tool_calls".to_owned(), calls)));
            object(entries)
        })
}

fn messages_value() -> impl Strategy<Value = Value> {
    prop::collection::vec(chat_message(), 1..5).prop_map(Value::Array)
}

fn tools_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        tricky_text(12).prop_map(|name| {
            serde_json::json!([{"type": "function", "function": {
                "name": name, "parameters": {"type": "object", "properties": {}}}}])
        }),
        json_value(3),
    ]
}

/// Which valid value each known field takes, for `api`.
fn known_fields(api: ApiKind) -> Vec<(&'static str, BoxedStrategy<Value>)> {
    let prompt = match api {
        ApiKind::Completions => completions_prompt_value().boxed(),
        _ => json_value(3).boxed(),
    };
    let messages = match api {
        ApiKind::ChatCompletions => messages_value().boxed(),
        _ => json_value(3).boxed(),
    };
    vec![
        ("model", model_name().prop_map(Value::String).boxed()),
        ("max_tokens", token_limit_value().boxed()),
        ("max_completion_tokens", token_limit_value().boxed()),
        ("stream", any::<bool>().prop_map(Value::Bool).boxed()),
        ("prompt", prompt),
        ("messages", messages),
        ("input", json_value(3).boxed()),
        ("tools", tools_value().boxed()),
        ("functions", tools_value().boxed()),
    ]
}

/// A request body for `api`: each known field absent or present, plus unknown fields of any
/// shape. With `junk`, a present field is sometimes `null` or a value of any type instead.
fn request_body(api: ApiKind, junk: bool) -> impl Strategy<Value = Map<String, Value>> {
    let fields: Vec<BoxedStrategy<Option<(&'static str, Value)>>> = known_fields(api)
        .into_iter()
        .map(|(key, valid)| {
            let value = if junk {
                prop_oneof![6 => valid, 1 => Just(Value::Null), 2 => json_value(3)].boxed()
            } else {
                valid
            };
            // The fields the API requires are nearly always present.
            let presence = match (key, api) {
                ("model", _)
                | ("prompt", ApiKind::Completions)
                | ("messages", ApiKind::ChatCompletions) => 0.95,
                _ => 0.4,
            };
            prop::option::weighted(presence, value.prop_map(move |value| (key, value))).boxed()
        })
        .collect();
    let extra = prop::collection::vec((tricky_text(10), json_value(3)), 0..3);
    (fields, extra).prop_map(|(known, extra)| {
        // Unknown keys first, so a known key that collides with one keeps its chosen value.
        let mut body: Map<String, Value> = extra.into_iter().collect();
        for (key, value) in known.into_iter().flatten() {
            body.insert(key.to_owned(), value);
        }
        body
    })
}

/// Serializes with every string character, keys included, written as a `\uXXXX` escape
/// (astral characters as surrogate pairs): the same request, read through serde_json's
/// escape-decoding path instead of borrowed slices.
struct EscapeEverything;

impl Formatter for EscapeEverything {
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        for unit in fragment.encode_utf16() {
            write!(writer, "\\u{unit:04x}")?;
        }
        Ok(())
    }

    fn write_char_escape<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        escape: serde_json::ser::CharEscape,
    ) -> std::io::Result<()> {
        CompactFormatter.write_char_escape(writer, escape)
    }
}

fn escaped_json(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, EscapeEverything);
    value
        .serialize(&mut serializer)
        .expect("a Value serializes");
    out
}

/// The ways a valid body can be spoiled while staying close to it.
#[derive(Debug, Clone)]
enum Mutation {
    Truncate(prop::sample::Index),
    FlipByte(prop::sample::Index, u8),
    Insert(prop::sample::Index, Vec<u8>),
    /// `[` × n … `]` × n around the byte at the index: a deeply nested value.
    Nest(prop::sample::Index, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let snippet = prop_oneof![
        prop::sample::select(vec![
            &b"["[..],
            b"{",
            b"\"",
            b"\\",
            b"\\u",
            b"\\ud800",
            b"\\udc00",
            b"\\ud800\\u0041",
            b"1e400",
            b"-1e400",
            b"18446744073709551616",
            b"-9223372036854775809",
            b"-0",
            b"1.5",
            b"\xff",
            b"\xc3",
            b"\xed\xa0\x80",
            b"\xf4\x90\x80\x80",
            b",",
            b":",
            b"null",
            b"true",
            b"}",
            b"]",
            b"\"model\":",
            b"\"prompt\":[",
            b"\0",
            b" \t\r\n",
        ])
        .prop_map(<[u8]>::to_vec),
        prop::collection::vec(any::<u8>(), 1..6),
    ];
    prop_oneof![
        any::<prop::sample::Index>().prop_map(Mutation::Truncate),
        (any::<prop::sample::Index>(), 1u8..=255)
            .prop_map(|(at, mask)| Mutation::FlipByte(at, mask)),
        (any::<prop::sample::Index>(), snippet).prop_map(|(at, bytes)| Mutation::Insert(at, bytes)),
        (
            any::<prop::sample::Index>(),
            prop_oneof![1usize..200, 100usize..5000]
        )
            .prop_map(|(at, depth)| Mutation::Nest(at, depth)),
    ]
}

fn mutate(body: &mut Vec<u8>, mutation: &Mutation) {
    match mutation {
        Mutation::Truncate(at) => body.truncate(at.index(body.len() + 1)),
        Mutation::FlipByte(at, mask) if !body.is_empty() => {
            let at = at.index(body.len());
            body[at] ^= mask;
        }
        Mutation::FlipByte(..) => {}
        Mutation::Insert(at, bytes) => {
            let at = at.index(body.len() + 1);
            body.splice(at..at, bytes.iter().copied());
        }
        Mutation::Nest(at, depth) => {
            let at = at.index(body.len() + 1);
            let end = (at + 1).min(body.len());
            body.splice(end..end, std::iter::repeat_n(b']', *depth));
            body.splice(at..at, std::iter::repeat_n(b'[', *depth));
        }
    }
}

/// Whether `body` is one JSON value by the grammar, as serde_json skims it (strings and
/// numbers not decoded).
fn is_json(body: &[u8]) -> bool {
    serde_json::from_slice::<IgnoredAny>(body).is_ok()
}

/// Whether serde_json reads `body` into a value tree: the grammar, plus every string free
/// of lone surrogate escapes and every number within `f64`'s range.
fn is_json_tree(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body).is_ok()
}

/// What any answer must satisfy, whatever the body.
fn check_answer(body: &[u8], answer: &Result<InferenceRequest, RequestError>) {
    match answer {
        Ok(request) => {
            assert!(!request.model.is_empty());
            assert!(request.prompt_prefix.len() <= PROMPT_PREFIX_BYTES);
            assert!(is_json(body), "accepted a body serde_json refuses");
        }
        // Only bodies serde_json cannot read are said not to be JSON. (The converse does
        // not hold: a lone surrogate in an ignored field is skimmed, not decoded.)
        Err(RequestError::InvalidJson(reason)) => {
            assert!(!is_json_tree(body), "valid JSON called invalid: {reason}");
        }
        Err(RequestError::EmptyBody) => assert!(body.trim_ascii().is_empty()),
        // A field can be refused before the syntax error after it is reached.
        Err(_) => {}
    }
}

/// `value` with each float replaced by an integer: floats are the one kind whose printed
/// length [`JsonLen`] only approximates. (Filtering them out instead would reject too many
/// cases for a long run.)
fn without_floats(value: Value) -> Value {
    match value {
        Value::Number(n) if n.is_f64() => Value::from(n.as_f64().map_or(0, f64::to_bits)),
        Value::Array(items) => Value::Array(items.into_iter().map(without_floats).collect()),
        Value::Object(entries) => Value::Object(
            entries
                .into_iter()
                .map(|(key, value)| (key, without_floats(value)))
                .collect(),
        ),
        other => other,
    }
}

/// The body as serde_json reads it back, which the rules are then applied to: serde_json's
/// float parsing may land one ulp away from what its printer wrote, and the digests of
/// `tools` see the number read, not the one generated.
fn read_back(bytes: &[u8]) -> Map<String, Value> {
    serde_json::from_slice(bytes).expect("a serialized Map reads back")
}

// ---------------------------------------------------------------------------------------
// The properties.

proptest! {
    #![proptest_config(config(400))]

    #[test]
    fn arbitrary_bytes_never_panic(api in api(), body in prop::collection::vec(any::<u8>(), 0..200)) {
        let answer = parse_request(api, &body);
        check_answer(&body, &answer);
    }

    #[test]
    fn arbitrary_json_values_never_panic(api in api(), value in json_value(6)) {
        let body = serde_json::to_vec(&value).expect("a Value serializes");
        let answer = parse_request(api, &body);
        check_answer(&body, &answer);
    }

    #[test]
    fn near_valid_requests_never_panic_and_are_refused_for_the_right_reason(
        (api, body) in api().prop_flat_map(|api| (Just(api), request_body(api, false))),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut bytes = serde_json::to_vec(&body).expect("a Value serializes");
        for mutation in &mutations {
            mutate(&mut bytes, mutation);
        }
        let answer = parse_request(api, &bytes);
        check_answer(&bytes, &answer);
    }

    #[test]
    fn valid_requests_parse_to_the_model_and_prompt_they_carry(
        (api, body) in api().prop_flat_map(|api| (Just(api), request_body(api, false))),
    ) {
        let bytes = serde_json::to_vec(&body).expect("a Value serializes");
        let answer = parse_request(api, &bytes);
        let want = expected(api, &read_back(&bytes));
        match (&answer, &want) {
            (Ok(got), Ok(want)) => {
                prop_assert_eq!(Some(got.model.as_str()), body.get("model").and_then(Value::as_str));
                if let Some(Value::String(text)) = body.get("prompt").filter(|_| api == ApiKind::Completions) {
                    prop_assert_eq!(&got.prompt_prefix[..], &text.as_bytes()[..text.len().min(PROMPT_PREFIX_BYTES)]);
                }
                prop_assert_eq!(got, want);
            }
            // Generated valid fields may still be refused: an empty model, an absent
            // required field. Then for the same reason.
            _ => prop_assert_eq!(answer.as_ref().map_err(refusal), want.as_ref().map_err(|r| *r)),
        }
    }

    #[test]
    fn the_streaming_reader_agrees_with_the_rules_read_on_a_value_tree(
        (api, body) in api().prop_flat_map(|api| (Just(api), request_body(api, true))),
    ) {
        let bytes = serde_json::to_vec(&body).expect("a Value serializes");
        let answer = parse_request(api, &bytes).map_err(|err| refusal(&err));
        prop_assert_eq!(answer, expected(api, &read_back(&bytes)));
    }

    #[test]
    fn whitespace_and_escapes_do_not_change_what_is_read(
        (api, body) in api().prop_flat_map(|api| (Just(api), request_body(api, true))),
    ) {
        let value = Value::Object(body);
        let compact = parse_request(api, &serde_json::to_vec(&value).expect("serializes"))
            .map_err(|err| refusal(&err));
        let pretty = parse_request(api, &serde_json::to_vec_pretty(&value).expect("serializes"))
            .map_err(|err| refusal(&err));
        let escaped = parse_request(api, &escaped_json(&value)).map_err(|err| refusal(&err));
        prop_assert_eq!(&compact, &pretty);
        prop_assert_eq!(&compact, &escaped);
    }

    #[test]
    fn json_len_is_the_compact_serialization_length_of_values_without_floats(
        value in json_value(5).prop_map(without_floats),
    ) {
        let text = serde_json::to_string(&value).expect("serializes");
        let streamed: JsonLen = serde_json::from_str(&text).expect("valid JSON");
        let top_null = value.is_null();
        prop_assert_eq!(streamed.len, if top_null { 0 } else { text.len() });
        prop_assert_eq!(streamed, json_len(&value));
    }
}
