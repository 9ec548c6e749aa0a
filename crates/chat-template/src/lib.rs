//! Hugging Face chat templates rendered as transformers renders them for vLLM, with
//! minijinja. The prompt's tokens, and so the engine's KV block hashes, follow from the
//! rendered text to the character, and the engine renders with jinja2 in transformers'
//! sandboxed environment: blocks trimmed and left-stripped, loop controls,
//! `raise_exception`, `strftime_now`, a `tojson` that is Python's `json.dumps`, Python's
//! string methods. Where minijinja reads or writes differently from jinja2 this crate
//! makes it read and write as jinja2 does:
//!
//! - the source's string literals are decoded as Python decodes them, and transformers'
//!   `{% generation %}` tag is known ([`template_source`], `source.rs`);
//! - values are written as Python's `str()` writes them (lists, dicts, floats), in
//!   `{{ }}` and through the `string`, `trim`, `join`, `indent`, `center` and `truncate`
//!   filters, and the `sequence` and `iterable` tests hold where Python's do (`python.rs`);
//! - `tojson` is `json.dumps` (`json.rs`), `strftime_now` Python's `strftime` (`time.rs`);
//! - string methods cut, split and case text as Python's do, with Python's white space
//!   and line breaks, as do the `title` and `capitalize` filters (`strings.rs`).
//!
//! [`loops_over_content`] is vLLM's choice of how a message's content is handed over;
//! [`tools`] and [`tool_calls`] are a request's tools and tool calls as vLLM hands them over
//! (`tools.rs`); [`cut_at_marker`] is transformers' `continue_final_message`
//! (`continuation.rs`).
//! `scripts/compare-chat-templates.py` compares the rendering with transformers' on real
//! templates (docs/kv-events.md).

mod continuation;
mod json;
mod python;
mod source;
mod strings;
mod time;
mod tools;

use minijinja::{Environment, Error, ErrorKind, Value};

pub use continuation::{CONTINUE_MARKER, cut_at_marker};
pub use source::{loops_over_content, template_source};
pub use time::strftime;
pub use tools::{Unshaped, documents, holds_wide_number, tool_calls, tools, wide_numbers};

/// The special tokens transformers hands a chat template by name (its tokenizer's
/// `special_tokens_map`), where the tokenizer has them.
pub const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The named special tokens a tokenizer hands its template, by name: those of its
/// `tokenizer_config.json` (`config`), else of its legacy `special_tokens_map.json`
/// (`map`); each a string or an added token's `content`.
pub fn special_tokens(
    config: &serde_json::Map<String, serde_json::Value>,
    map: &serde_json::Map<String, serde_json::Value>,
) -> Vec<(&'static str, String)> {
    SPECIAL_TOKENS
        .into_iter()
        .filter_map(|name| {
            let text = token_text(config.get(name)).or_else(|| token_text(map.get(name)))?;
            Some((name, text))
        })
        .collect()
}

/// A special token's text: a string, or an added token's `content`.
fn token_text(value: Option<&serde_json::Value>) -> Option<String> {
    match value? {
        serde_json::Value::String(text) => Some(text.clone()),
        token => token
            .get("content")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned),
    }
}

/// A map's keys and values in its order, read in one pass where the map gives them so (a
/// lookup per key otherwise); `None` if it is not a map.
pub(crate) fn map_pairs(map: &Value) -> Option<Vec<(Value, Value)>> {
    if map.kind() != minijinja::value::ValueKind::Map {
        return None;
    }
    match map.as_object().and_then(|object| object.try_iter_pairs()) {
        Some(pairs) => Some(pairs.collect()),
        None => map
            .try_iter()
            .ok()?
            .map(|key| map.get_item(&key).ok().map(|item| (key, item)))
            .collect(),
    }
}

/// An argument jinja2 takes by position or by keyword: `given` by position, else the
/// keyword `name` (left unread when given by position, so that both at once is refused
/// by `Kwargs::assert_all_used`).
pub(crate) fn or_keyword<'a, T>(
    given: Option<T>,
    kwargs: &'a minijinja::value::Kwargs,
    name: &'a str,
) -> Result<Option<T>, Error>
where
    Option<T>: minijinja::value::ArgType<'a, Output = Option<T>>,
{
    match given {
        Some(given) => Ok(Some(given)),
        None => kwargs.get(name),
    }
}

/// An environment that renders chat templates as transformers' does. Add each template
/// with [`template_source`] applied to it.
pub fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    match minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
    {
        Ok(syntax) => env.set_syntax(syntax),
        Err(e) => unreachable!("the default delimiters with trimming are a valid syntax: {e}"),
    }
    env.set_unknown_method_callback(strings::unknown_method);
    env.set_formatter(python::format);
    env.add_filter("string", python::string);
    env.add_filter("trim", python::trim);
    env.add_filter("title", |text: &str| strings::title_filter(text));
    env.add_filter("capitalize", |text: &str| strings::capitalize(text));
    env.add_filter("tojson", json::tojson);
    env.add_filter("join", python::join);
    env.add_filter("indent", python::indent);
    env.add_filter("center", python::center);
    env.add_filter("truncate", python::truncate);
    env.add_test("sequence", python::is_sequence);
    env.add_test("iterable", python::is_iterable);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

/// `template` rendered with `context`, where a panic inside minijinja comes back as an
/// error instead of unwinding through the caller (2.24 panicked on an empty list or string
/// sliced backwards, as `messages[::-1]` of no messages; 3.1 renders it, and the guard
/// stays for whatever else might).
pub fn render(template: &minijinja::Template<'_, '_>, context: Value) -> Result<String, Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| template.render(context)))
        .unwrap_or_else(|panic| {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("the template engine failed: {why}"),
            ))
        })
}

/// The template's own refusal (an unknown role, roles out of order).
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// The local time as Python's `datetime.now().strftime` writes it: some templates put
/// today's date in the system prompt, as the engine renders it where it runs.
fn strftime_now(format: String) -> String {
    strftime(&format, &jiff::Zoned::now())
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::value::Serde;

    #[test]
    fn a_panic_in_the_engine_is_an_error() {
        let mut env = environment();
        // A filter that panics stands for a bug in the engine (minijinja 2.24 panicked on
        // an empty list sliced backwards).
        env.add_filter("explode", |_: Value| -> String {
            panic!("a bug in the engine")
        });
        env.add_template_owned("bug", "{{ messages | explode }}".to_owned())
            .expect("parses");
        let template = env.get_template("bug").expect("added");
        let failed = render(&template, minijinja::context! { messages => vec!["a"] })
            .expect_err("the panic is caught");
        assert!(
            failed.to_string().contains("the template engine failed"),
            "{failed}"
        );
    }

    #[test]
    fn an_empty_list_sliced_backwards_is_empty() {
        let mut env = environment();
        env.add_template_owned(
            "t",
            "{% for m in messages[::-1] %}{{ m }}{% endfor %}|".to_owned(),
        )
        .expect("parses");
        let template = env.get_template("t").expect("added");
        let empty: Vec<Value> = Vec::new();
        let none = render(&template, minijinja::context! { messages => empty });
        assert_eq!(none.expect("rendered"), "|");
        let two = render(
            &template,
            minijinja::context! { messages => vec!["a", "b"] },
        );
        assert_eq!(two.expect("rendered"), "ba|");
    }

    #[test]
    fn the_environment_renders_as_transformers_does() {
        let mut env = environment();
        env.add_template_owned(
            "t",
            template_source(
                "{% for m in messages %}\n  {{ m.content | trim }}|{{ m | tojson }}\n{% endfor %}\
                 {{ 'a\\\nb' }}{% if x is not defined %}{{ raise_exception('no ' ~ 'x') }}{% endif %}",
            ),
        )
        .expect("parses");
        let template = env.get_template("t").expect("added");
        let messages: Value =
            serde_json::from_str(r#"[{"role": "user", "content": " hi "}]"#).expect("JSON");
        let refused = template
            .render(minijinja::context! { messages => messages.clone() })
            .expect_err("raises");
        assert!(refused.to_string().contains("no x"), "{refused}");
        // What jinja2 in transformers' environment writes: `lstrip_blocks` strips the
        // whitespace before a block tag only, so the indent before `{{` stays.
        assert_eq!(
            template
                .render(minijinja::context! { messages => messages, x => 1 })
                .expect("renders"),
            "  hi|{\"role\": \"user\", \"content\": \" hi \"}\nab"
        );
    }

    /// What jinja2 3.1 (transformers' sandboxed environment) prints for each template.
    fn assert_renders_as_jinja2(cases: &[(&str, &str)]) {
        let env = environment();
        for (template, jinja2) in cases {
            let rendered = env.render_str(template, ()).expect("renders");
            assert_eq!(&rendered, jinja2, "{template}");
        }
    }

    #[test]
    fn center_and_truncate_write_as_jinja2_does() {
        let t = "{% set t = 'hello brave new world' %}";
        assert_renders_as_jinja2(&[
            ("{{ 'ab'|center(7) }}|", "   ab  |"),
            ("{{ 'ab'|center(6) }}|", "  ab  |"),
            ("{{ 'abc'|center(6) }}|", " abc  |"),
            ("{{ 'abc'|center(2) }}|", "abc|"),
            ("{{ 1.5|center(9) }}|", "   1.5   |"),
            ("{{ 'ab'.center(7, '*') }}|", "***ab**|"),
            ("{{ 'héllo wörld'.center(15, '·') }}|", "··héllo wörld··|"),
            (&format!("{t}{{{{ t|truncate(12) }}}}"), "hello..."),
            (
                &format!("{t}{{{{ t|truncate(17) }}}}"),
                "hello brave new world",
            ),
            (
                &format!("{t}{{{{ t|truncate(12, true, leeway=0) }}}}"),
                "hello bra...",
            ),
            (
                &format!("{t}{{{{ t|truncate(12, killwords=false, end='…', leeway=0) }}}}"),
                "hello…",
            ),
            ("{{ 'helloworldbrave'|truncate(8, leeway=0) }}", "hello..."),
        ]);
        // jinja2 asserts its arguments: the template fails (and the request asks a pod).
        assert!(
            environment()
                .render_str("{{ 'abc'|truncate(2) }}", ())
                .is_err()
        );
    }

    #[test]
    fn tuples_print_as_python_writes_them() {
        assert_renders_as_jinja2(&[
            ("{{ (1, 'a') }}", "(1, 'a')"),
            ("{{ (1,) }}", "(1,)"),
            ("{{ [(1, 2.5)] }}", "[(1, 2.5)]"),
            ("{{ {'b': 1, 'a': 2}|dictsort }}", "[('a', 2), ('b', 1)]"),
        ]);
    }

    #[test]
    fn join_and_indent_write_as_jinja2_does() {
        // What jinja2 3.1 prints for the same expressions.
        let env = environment();
        let context = minijinja::context! {
            s => "a\n\nb \u{2028}c\r\n",
            l => Value::from(Serde(serde_json::json!([1.5, true, null, 1e20, [1, "x"], "z"]))),
            d => Value::from(Serde(serde_json::json!([{"a": 1}, {"a": "q"}]))),
        };
        let render = |template: &str| env.render_str(template, context.clone()).expect("renders");
        assert_eq!(render("{{ s|indent }}"), "a\n\n    b \n    c\n");
        assert_eq!(render("{{ s|indent(2, true) }}"), "  a\n\n  b \n  c\n");
        assert_eq!(
            render("{{ s|indent(2, first=true, blank=true) }}"),
            "  a\n  \n  b \n  c\n  "
        );
        assert_eq!(render("{{ s|indent('> ') }}"), "a\n\n> b \n> c\n");
        assert_eq!(render("{{ l|join }}"), "1.5TrueNone1e+20[1, 'x']z");
        assert_eq!(
            render("{{ l|join(', ') }}"),
            "1.5, True, None, 1e+20, [1, 'x'], z"
        );
        assert_eq!(render("{{ d|join('-', attribute='a') }}"), "1-q");
    }

    #[test]
    fn sequences_and_iterables_are_pythons() {
        // What jinja2 3.1 prints for the same tests.
        let env = environment();
        let tests = "{{ s is sequence }}{{ m is sequence }}{{ l is sequence }}{{ u is sequence }}\
                     {{ n is sequence }}{{ 1 is sequence }}|{{ s is iterable }}{{ m is iterable }}\
                     {{ u is iterable }}{{ n is iterable }}{{ 1 is iterable }}";
        let context = minijinja::context! { s => "ab", m => minijinja::context! { k => 1 },
        l => vec![1], n => () };
        assert_eq!(
            env.render_str(tests, context).expect("renders"),
            "TrueTrueTrueTrueFalseFalse|TrueTrueTrueFalseFalse"
        );
    }
}
