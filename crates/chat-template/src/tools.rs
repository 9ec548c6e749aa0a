//! A request's tools, and its messages' tool calls and tool results, as vLLM's OpenAI
//! server hands them to the chat template. Templates print them (`tools | tojson`, each
//! call's `arguments | tojson`), so their fields' order and defaults are part of the
//! prompt:
//!
//! - **tools** are pydantic models (`ChatCompletionToolsParam`, `FunctionDefinition`, extra
//!   fields allowed) handed over as `tool.model_dump()`: `type` then `function`, and in the
//!   function `name`, `description` and `parameters` (each `None` when absent), then any
//!   extra field in the request's order;
//! - **tool calls** are validated as OpenAI's `ChatCompletionMessageToolCallParam` typed
//!   dict, which writes its declared keys first in their declared order (`id`, `function`,
//!   `type`; in the function `arguments`, `name`), then any extra key in the request's
//!   order; `arguments`, a JSON string, is parsed into the object it holds (an empty
//!   string: `{}`), and an empty list of calls is dropped (vLLM's
//!   `_postprocess_messages`);
//! - a tool message's `tool_call_id` is kept when the request has the key;
//! - **documents** (for retrieval-augmented templates) are validated as
//!   `list[dict[str, str]]` and handed over as they are.
//!
//! What vLLM refuses or a vLLM release handles differently (a custom tool or tool call,
//! arguments that are not one JSON object, a field of the wrong type), and what Python
//! reads otherwise than serde_json ([`holds_wide_number`]), is [`Unshaped`]: the caller
//! leaves such a request to an engine to render.

use minijinja::Value;
use minijinja::value::ValueKind;

/// Why tools or tool calls are not shaped here: what the request has ("has tools that
/// are not a list").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unshaped(pub &'static str);

impl std::fmt::Display for Unshaped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// Whether `value` holds a number without a fraction at or beyond 2⁶³ in magnitude. JSON's
/// integers beyond 64 bits, which Python keeps whole and `json.dumps` writes digit for
/// digit, reach a template from serde_json as floats (written `1e+20`), and cannot be
/// told from a float the request wrote so: a template that prints either may print other
/// text than the engine's. [`tool_calls`] checks the calls; a caller of [`tools`] checks
/// the tools with [`wide_numbers`] (walking a tool's schema costs more than shaping it).
pub fn holds_wide_number(value: &Value) -> bool {
    const WIDE: f64 = 9_223_372_036_854_775_808.0;
    match value.kind() {
        ValueKind::Number if !value.is_integer() => {
            f64::try_from(value.clone()).is_ok_and(|x| x.fract() == 0.0 && x.abs() >= WIDE)
        }
        ValueKind::Seq => value
            .try_iter()
            .is_ok_and(|mut items| items.any(|item| holds_wide_number(&item))),
        // A map's values read in one pass where it can (a request's JSON objects can),
        // without collecting them.
        ValueKind::Map => match value.as_object().and_then(|map| map.try_iter_pairs()) {
            Some(mut pairs) => pairs.any(|(_, item)| holds_wide_number(&item)),
            None => crate::map_pairs(value)
                .is_some_and(|pairs| pairs.iter().any(|(_, item)| holds_wide_number(item))),
        },
        _ => false,
    }
}

/// Whether `text` holds 19 ASCII digits in a row, as every integer beyond 64 bits written
/// out does (2⁶³ has 19 digits): a test of eight bytes at a time, so that only a text that
/// may hold one pays for [`holds_wide_number`]'s walk.
fn long_digit_run(text: &[u8]) -> bool {
    const RUN: u32 = 19;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut run = 0u32;
    let mut words = text.chunks_exact(8);
    for word in &mut words {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(word);
        let x = u64::from_le_bytes(bytes);
        // Each byte's high bit: set in `from_0` where its low seven bits are at least
        // '0', in `past_9` where they are past '9' (no carry crosses a byte: at most
        // 0x7f + 0x50), and clear in `x` where the byte is ASCII.
        let low = x & !HIGH;
        let from_0 = low.wrapping_add(0x5050_5050_5050_5050);
        let past_9 = low.wrapping_add(0x4646_4646_4646_4646);
        let others = !(from_0 & !past_9 & !x) & HIGH;
        if others == 0 {
            run += 8;
        } else {
            // The digits before the word's first other byte end the run so far; those
            // after its last begin the next.
            run += others.trailing_zeros() / 8;
            if run >= RUN {
                return true;
            }
            run = others.leading_zeros() / 8;
        }
        if run >= RUN {
            return true;
        }
    }
    for &byte in words.remainder() {
        run = if byte.is_ascii_digit() { run + 1 } else { 0 };
        if run >= RUN {
            return true;
        }
    }
    false
}

const WIDE_NUMBER: Unshaped = Unshaped("holds an integer beyond 64 bits (or a float that large)");

/// Refused where `parsed`, read from the JSON `text`, [`holds_wide_number`]: walked only
/// where the text has a [`long_digit_run`].
pub fn wide_numbers(text: &str, parsed: &Value) -> Result<(), Unshaped> {
    if long_digit_run(text.as_bytes()) && holds_wide_number(parsed) {
        Err(WIDE_NUMBER)
    } else {
        Ok(())
    }
}

/// vLLM's `[tool.model_dump() for tool in request.tools]` of a request's `tools`, read in
/// the request's order (a `minijinja::Value` deserialized from its JSON).
pub fn tools(tools: &Value) -> Result<Value, Unshaped> {
    items(tools, "has tools that are not a list")?
        .iter()
        .map(tool)
        .collect::<Result<Vec<_>, _>>()
        .map(Value::from)
}

/// An assistant message's `tool_calls` as the template receives them; `None` where vLLM
/// drops them (an empty list).
pub fn tool_calls(calls: &Value) -> Result<Option<Value>, Unshaped> {
    if holds_wide_number(calls) {
        return Err(WIDE_NUMBER);
    }
    let calls = items(calls, "has tool_calls that are not a list")?;
    if calls.is_empty() {
        return Ok(None);
    }
    calls
        .iter()
        .map(tool_call)
        .collect::<Result<Vec<_>, _>>()
        .map(|calls| Some(Value::from(calls)))
}

/// A request's `documents` as the template receives them: each an object of strings, in
/// the request's order.
pub fn documents(documents: &Value) -> Result<Value, Unshaped> {
    let documents = items(documents, "has documents that are not a list")?;
    for document in &documents {
        let entries =
            map_entries(document).ok_or(Unshaped("has a document that is not an object"))?;
        if !entries.iter().all(|(_, value)| is_str(value)) {
            return Err(Unshaped("has a document whose values are not all strings"));
        }
    }
    Ok(Value::from(documents))
}

fn items(list: &Value, not_a_list: &'static str) -> Result<Vec<Value>, Unshaped> {
    if list.kind() != ValueKind::Seq {
        return Err(Unshaped(not_a_list));
    }
    list.try_iter()
        .map(Iterator::collect)
        .map_err(|_| Unshaped(not_a_list))
}

/// A map's entries in its order; `None` if it is not a map with string keys.
fn map_entries(map: &Value) -> Option<Vec<(String, Value)>> {
    crate::map_pairs(map)?
        .into_iter()
        .map(|(key, value)| Some((key.as_str()?.to_owned(), value)))
        .collect()
}

/// An object of the `declared` fields, in their order, then the `extra` ones: how pydantic
/// writes a model or typed dict that allows extra fields.
fn declared_then_extra<const N: usize>(
    declared: [(&str, Value); N],
    extra: Vec<(String, Value)>,
) -> Value {
    Value::from_pairs(
        declared
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value))
            .chain(extra),
    )
}

/// The entries of `map` named `declared`, in that order (each present, or `None` where the
/// map lacks it), and the others in the map's order.
fn split<const N: usize>(
    map: Vec<(String, Value)>,
    declared: [&str; N],
) -> ([Option<Value>; N], Vec<(String, Value)>) {
    let mut fields = std::array::from_fn(|_| None);
    let mut extra = Vec::new();
    for (key, value) in map {
        match declared.iter().position(|name| *name == key) {
            Some(i) => fields[i] = Some(value),
            None => extra.push((key, value)),
        }
    }
    (fields, extra)
}

fn is_str(value: &Value) -> bool {
    value.kind() == ValueKind::String
}

/// One tool, as `ChatCompletionToolsParam.model_dump()` writes it.
fn tool(tool: &Value) -> Result<Value, Unshaped> {
    let entries = map_entries(tool).ok_or(Unshaped("has a tool that is not an object"))?;
    let ([kind, function], extra) = split(entries, ["type", "function"]);
    if kind.is_some_and(|kind| kind.as_str() != Some("function")) {
        return Err(Unshaped("has a tool that is not a function"));
    }
    let function = function.ok_or(Unshaped("has a tool with no function"))?;
    let entries =
        map_entries(&function).ok_or(Unshaped("has a tool whose function is not an object"))?;
    let ([name, description, parameters], function_extra) =
        split(entries, ["name", "description", "parameters"]);
    let name = name
        .filter(is_str)
        .ok_or(Unshaped("has a tool function with no string name"))?;
    let description = description.unwrap_or_else(|| Value::from(()));
    if !is_str(&description) && !description.is_none() {
        return Err(Unshaped("has a tool description that is not a string"));
    }
    let parameters = parameters.unwrap_or_else(|| Value::from(()));
    if parameters.kind() != ValueKind::Map && !parameters.is_none() {
        return Err(Unshaped("has tool parameters that are not an object"));
    }
    let function = declared_then_extra(
        [
            ("name", name),
            ("description", description),
            ("parameters", parameters),
        ],
        function_extra,
    );
    Ok(declared_then_extra(
        [("type", Value::from("function")), ("function", function)],
        extra,
    ))
}

/// One tool call, as the typed dict validates it and vLLM parses its arguments.
fn tool_call(call: &Value) -> Result<Value, Unshaped> {
    let entries = map_entries(call).ok_or(Unshaped("has a tool call that is not an object"))?;
    let ([id, function, kind], extra) = split(entries, ["id", "function", "type"]);
    let id = id
        .filter(is_str)
        .ok_or(Unshaped("has a tool call with no string id"))?;
    let kind = kind
        .filter(|kind| kind.as_str() == Some("function"))
        .ok_or(Unshaped("has a tool call that is not a function call"))?;
    let entries = function
        .as_ref()
        .and_then(map_entries)
        .ok_or(Unshaped("has a tool call with no function"))?;
    let ([arguments, name], function_extra) = split(entries, ["arguments", "name"]);
    let name = name
        .filter(is_str)
        .ok_or(Unshaped("has a tool call function with no string name"))?;
    let arguments = match arguments.as_ref().and_then(Value::as_str) {
        None => return Err(Unshaped("has tool call arguments that are not a string")),
        Some("") => Value::from_pairs(std::iter::empty::<(String, Value)>()),
        Some(json) => match serde_json::from_str::<Value>(json) {
            Ok(parsed) if parsed.kind() == ValueKind::Map => {
                wide_numbers(json, &parsed)?;
                parsed
            }
            // vLLM releases differ here: an error, the value as it is, or `{}`.
            _ => {
                return Err(Unshaped(
                    "has tool call arguments that are not one JSON object",
                ));
            }
        },
    };
    let function = declared_then_extra([("arguments", arguments), ("name", name)], function_extra);
    Ok(declared_then_extra(
        [("id", id), ("function", function), ("type", kind)],
        extra,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(json: &str) -> Value {
        serde_json::from_str(json).expect("JSON")
    }

    fn json(value: &Value) -> String {
        serde_json::to_string(value).expect("serializes")
    }

    #[test]
    fn tools_are_dumped_with_their_defaults_in_the_models_order() {
        // What pydantic's model_dump wrote for this request (pydantic 2.14, vLLM's models).
        let request = value(
            r#"[{"function": {"parameters": {"type": "object", "properties": {"b": {}, "a": {}}},
                               "name": "f", "strict": true}, "type": "function"},
                {"type": "function", "function": {"name": "g"}, "x": 1}]"#,
        );
        assert_eq!(
            json(&tools(&request).expect("shaped")),
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"type":"object","properties":{"b":{},"a":{}}},"strict":true}},{"type":"function","function":{"name":"g","description":null,"parameters":null},"x":1}]"#
        );
        assert_eq!(json(&tools(&value("[]")).expect("shaped")), "[]");
    }

    #[test]
    fn tool_calls_take_the_typed_dicts_order_and_parsed_arguments() {
        let calls = value(
            r#"[{"type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2.0, \"é\"]}", "zz": 3},
                 "id": "c1", "x": 9},
                {"id": "c2", "type": "function", "function": {"arguments": "", "name": "g"}}]"#,
        );
        assert_eq!(
            json(&tool_calls(&calls).expect("shaped").expect("kept")),
            r#"[{"id":"c1","function":{"arguments":{"b":1,"a":[2.0,"é"]},"name":"f","zz":3},"type":"function","x":9},{"id":"c2","function":{"arguments":{},"name":"g"},"type":"function"}]"#
        );
        assert_eq!(
            tool_calls(&value("[]")),
            Ok(None),
            "an empty list is dropped"
        );
        // 64-bit integers stay whole, as in Python.
        let widest = value(
            r#"[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"u\": 18446744073709551615, \"i\": -9223372036854775808, \"x\": 1e18}"}}]"#,
        );
        assert_eq!(
            json(&tool_calls(&widest).expect("shaped").expect("kept")),
            r#"[{"id":"c","function":{"arguments":{"u":18446744073709551615,"i":-9223372036854775808,"x":1e+18},"name":"f"},"type":"function"}]"#
        );
    }

    #[test]
    fn a_long_digit_run_is_found_wherever_it_lies() {
        // Against a byte-at-a-time count, on texts of digits, letters and multi-byte
        // characters at every alignment.
        let naive = |text: &[u8]| {
            let mut run = 0;
            text.iter().any(|byte| {
                run = if byte.is_ascii_digit() { run + 1 } else { 0 };
                run >= 19
            })
        };
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let pieces: [&[u8]; 5] = [b"7", b"0123456789", b"a", "é".as_bytes(), b"\xff"];
        let (mut with, mut without) = (0, 0);
        for _ in 0..20_000 {
            let mut text = Vec::new();
            for _ in 0..next() % 12 {
                let piece = pieces[(next() % 5) as usize];
                for _ in 0..next() % 4 {
                    text.extend_from_slice(piece);
                }
            }
            let expected = naive(&text);
            assert_eq!(
                long_digit_run(&text),
                expected,
                "{:?}",
                String::from_utf8_lossy(&text)
            );
            if expected { with += 1 } else { without += 1 }
        }
        assert!(
            with > 1_000 && without > 1_000,
            "{with} with, {without} without"
        );
        assert!(!long_digit_run(b"{\"n\": 922337203685477580}"));
        assert!(long_digit_run(b"{\"n\": 9223372036854775808}"));
    }

    #[test]
    fn what_vllm_refuses_or_reads_differently_is_left_unshaped() {
        for (calls, why) in [
            (r#"{"id": "c"}"#, "tool_calls that are not a list"),
            (
                r#"[{"function": {"name": "f", "arguments": "{}"}, "type": "function"}]"#,
                "with no string id",
            ),
            (
                r#"[{"id": "c", "custom": {"name": "f", "input": ""}, "type": "custom"}]"#,
                "not a function call",
            ),
            (
                r#"[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]"#,
                "not one JSON object",
            ),
            (
                r#"[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]"#,
                "not one JSON object",
            ),
            (
                r#"[{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]"#,
                "not a string",
            ),
            (
                r#"[{"id": "c", "type": "function", "function": {"arguments": "{}"}}]"#,
                "no string name",
            ),
            // Python keeps the integer whole; serde_json makes it a float.
            (
                r#"[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"n\": [123456789012345678901234567890]}"}}]"#,
                "beyond 64 bits",
            ),
            // A float that large is refused too where no text says which it was.
            (
                r#"[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "n": -1e19}]"#,
                "beyond 64 bits",
            ),
        ] {
            let refused = tool_calls(&value(calls)).expect_err(calls);
            assert!(refused.0.contains(why), "{calls}: {refused}");
        }
        for (list, why) in [
            (r#"{"title": "t"}"#, "not a list"),
            (r#"["t"]"#, "not an object"),
            (r#"[{"title": "t", "page": 3}]"#, "not all strings"),
        ] {
            let refused = documents(&value(list)).expect_err(list);
            assert!(refused.0.contains(why), "{list}: {refused}");
        }
        let kept = r#"[{"title":"b","text":"x"},{"text":"y","title":"a"}]"#;
        assert_eq!(json(&documents(&value(kept)).expect("shaped")), kept);
        for (list, why) in [
            (r#"{"type": "function"}"#, "not a list"),
            (
                r#"[{"type": "custom", "custom": {"name": "f"}}]"#,
                "not a function",
            ),
            (r#"[{"type": "function"}]"#, "no function"),
            (r#"[{"function": {"name": 3}}]"#, "no string name"),
            (
                r#"[{"function": {"name": "f", "description": 3}}]"#,
                "description",
            ),
            (
                r#"[{"function": {"name": "f", "parameters": [1]}}]"#,
                "parameters",
            ),
        ] {
            let refused = tools(&value(list)).expect_err(list);
            assert!(refused.0.contains(why), "{list}: {refused}");
        }
    }
}
