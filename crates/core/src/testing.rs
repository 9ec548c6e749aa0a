//! What the parsers' property tests share: the case-count policy, text and JSON generators,
//! and a writer of Prometheus sample lines.

use proptest::prelude::*;
use serde_json::Value;

/// The configuration of one property: `ci_cases` cases from a fixed seed, so that every run
/// of `cargo test` tries the same inputs. `PROPTEST_CASES` and `PROPTEST_RNG_SEED`, when set,
/// win, so a long or fresh run needs no code change (`PROPTEST_CASES=1000000 cargo test ...`).
/// `ProptestConfig::with_cases` would ignore the variable; `ProptestConfig::default()` reads it
/// but would give every property the same 256 cases, too many for the slow ones in CI.
pub(crate) fn config(ci_cases: u32) -> ProptestConfig {
    let mut config = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = ci_cases;
    }
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        // "kvroute" in ASCII.
        config.rng_seed = proptest::test_runner::RngSeed::Fixed(0x006b_7672_6f75_7465);
    }
    config
}

/// One character, biased towards those parsers trip on: quotes, backslashes, control
/// characters, separators, multi-byte UTF-8 (two, three and four bytes), BOM, U+2028.
pub(crate) fn tricky_char() -> impl Strategy<Value = char> {
    prop_oneof![
        6 => proptest::char::range(' ', '~'),
        2 => prop::sample::select(vec![
            '"', '\\', '\n', '\r', '\t', '\0', '\u{1}', '\u{8}', '\u{c}', '\u{1f}', '\u{7f}',
            '/', '{', '}', '[', ']', ',', ':', '=', '#',
        ]),
        2 => prop::sample::select(vec![
            '\u{e9}', '\u{20ac}', '\u{65e5}', '\u{1f600}', '\u{feff}', '\u{2028}', '\u{fffd}',
            '\u{10ffff}',
        ]),
        1 => any::<char>(),
    ]
}

/// A short string of [`tricky_char`]s.
pub(crate) fn tricky_text(max_chars: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(tricky_char(), 0..=max_chars).prop_map(String::from_iter)
}

/// A JSON number of every representation serde_json keeps apart: small and huge unsigned,
/// negative, integral and fractional floats, extremes. (Non-finite floats become `null`.)
pub(crate) fn json_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u64..100_000).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0u32..100_000).prop_map(|n| Value::from(f64::from(n))),
        any::<f64>().prop_map(Value::from),
        prop::sample::select(vec![
            -0.0,
            0.5,
            1e300,
            -1e300,
            f64::MAX,
            f64::MIN_POSITIVE,
            4.9e-324
        ])
        .prop_map(Value::from),
    ]
}

/// Any JSON value, at most `depth` containers deep.
pub(crate) fn json_value(depth: u32) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        json_number(),
        tricky_text(12).prop_map(Value::String),
    ];
    leaf.prop_recursive(depth, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((tricky_text(8), inner), 0..6)
                .prop_map(|entries| Value::Object(entries.into_iter().collect())),
        ]
    })
}

/// A label value as the exposition format writes it: `\`, `"` and newline escaped.
pub(crate) fn escape_label_value(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str(r"\\"),
            '"' => escaped.push_str(r#"\""#),
            '\n' => escaped.push_str(r"\n"),
            other => escaped.push(other),
        }
    }
    escaped
}

/// One sample line, without its line ending: `name{a="1",b="2"} value`.
pub(crate) fn sample_line(name: &str, labels: &[(String, String)], value: &str) -> String {
    let mut line = name.to_owned();
    if !labels.is_empty() {
        let rendered: Vec<String> = labels
            .iter()
            .map(|(label, value)| format!("{label}=\"{}\"", escape_label_value(value)))
            .collect();
        line.push('{');
        line.push_str(&rendered.join(","));
        line.push('}');
    }
    line.push(' ');
    line.push_str(value);
    line
}
