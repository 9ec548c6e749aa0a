use super::*;

fn one(text: &str) -> Sample<'_> {
    let mut samples = parse(text).expect("valid exposition");
    assert_eq!(samples.len(), 1, "expected exactly one sample");
    samples.remove(0)
}

fn labels_of<'s>(sample: &'s Sample<'_>) -> Vec<(&'s str, &'s str)> {
    sample
        .labels
        .iter()
        .map(|(name, value)| (*name, value.as_ref()))
        .collect()
}

#[test]
fn a_bare_sample_has_a_name_a_value_and_no_labels() {
    let sample = one("up 1\n");
    assert_eq!(sample.name, "up");
    assert!(sample.labels.is_empty());
    assert_eq!(sample.value, 1.0);
}

#[test]
fn comments_and_blank_lines_are_skipped() {
    let text = "# HELP up Whether up.\n# TYPE up gauge\n\n   \n# free-form comment\nup 1\n\t# indented comment\n";
    let samples = parse(text).unwrap();
    assert_eq!(samples.len(), 1);
    assert_eq!(samples[0].name, "up");
}

#[test]
fn an_empty_text_has_no_samples() {
    assert!(parse("").unwrap().is_empty());
    assert!(parse("\n\n# only comments\n").unwrap().is_empty());
}

#[test]
fn labels_are_read_in_order_and_by_name() {
    let sample = one(r#"vllm:num_requests_waiting{engine="0",model_name="llama"} 3"#);
    assert_eq!(
        labels_of(&sample),
        vec![("engine", "0"), ("model_name", "llama")]
    );
    assert_eq!(sample.label("model_name"), Some("llama"));
    assert_eq!(sample.label("engine"), Some("0"));
    assert_eq!(sample.label("absent"), None);
}

#[test]
fn escaped_quotes_in_label_values_are_unescaped() {
    let sample = one(r#"m{a="say \"hi\""} 1"#);
    assert_eq!(sample.label("a"), Some(r#"say "hi""#));
}

#[test]
fn escaped_backslashes_and_newlines_in_label_values_are_unescaped() {
    let sample = one(r#"m{path="C:\\dir\\file",msg="two\nlines"} 1"#);
    assert_eq!(sample.label("path"), Some(r"C:\dir\file"));
    assert_eq!(sample.label("msg"), Some("two\nlines"));
}

#[test]
fn label_values_without_escapes_are_borrowed_not_copied() {
    let sample = one(r#"m{a="plain",b="with \"escape\""} 1"#);
    assert!(matches!(sample.labels[0].1, Cow::Borrowed("plain")));
    assert!(matches!(sample.labels[1].1, Cow::Owned(_)));
}

#[test]
fn non_ascii_label_values_are_kept_intact() {
    let sample = one("m{a=\"caf\u{e9} \u{1f600}\",b=\"\u{e9}\\\"\u{e9}\"} 1");
    assert_eq!(sample.label("a"), Some("caf\u{e9} \u{1f600}"));
    assert_eq!(sample.label("b"), Some("\u{e9}\"\u{e9}"));
}

#[test]
fn empty_label_sets_and_empty_label_values_are_accepted() {
    let sample = one("m{} 2");
    assert!(sample.labels.is_empty());
    let sample = one(r#"m{a=""} 2"#);
    assert_eq!(sample.label("a"), Some(""));
}

#[test]
fn a_trailing_comma_in_a_label_set_is_accepted() {
    let sample = one(r#"m{a="1",b="2",} 5"#);
    assert_eq!(labels_of(&sample), vec![("a", "1"), ("b", "2")]);
}

#[test]
fn blanks_around_label_tokens_are_tolerated() {
    let sample = one("m { a = \"1\" ,\tb=\"2\" } 5");
    assert_eq!(labels_of(&sample), vec![("a", "1"), ("b", "2")]);
    assert_eq!(sample.value, 5.0);
}

#[test]
fn a_value_may_follow_the_closing_brace_directly() {
    assert_eq!(one(r#"m{a="1"}7"#).value, 7.0);
}

#[test]
fn special_and_scientific_values_parse() {
    assert!(one("m NaN").value.is_nan());
    assert_eq!(one("m +Inf").value, f64::INFINITY);
    assert_eq!(one("m -Inf").value, f64::NEG_INFINITY);
    assert_eq!(one("m 1.0e+00").value, 1.0);
    assert_eq!(one("m 2.5E-3").value, 0.0025);
    assert_eq!(one("m -7").value, -7.0);
    assert_eq!(one("m 1.7301234567e+09").value, 1_730_123_456.7);
}

#[test]
fn an_optional_timestamp_after_the_value_is_accepted() {
    let sample = one("m{a=\"1\"} 3 1730000000000");
    assert_eq!(sample.value, 3.0);
    assert_eq!(one("m 3 -5").value, 3.0);
}

#[test]
fn crlf_line_endings_are_accepted() {
    let samples = parse("# TYPE a gauge\r\na 1\r\nb{x=\"y\"} 2 123\r\n\r\n").unwrap();
    assert_eq!(samples.len(), 2);
    assert_eq!(samples[1].label("x"), Some("y"));
    assert_eq!(samples[1].value, 2.0);
}

#[test]
fn histogram_series_keep_their_suffixes_and_le_labels() {
    let text = "\
# TYPE h histogram
h_bucket{le=\"0.1\"} 1.0
h_bucket{le=\"+Inf\"} 3.0
h_sum 0.9
h_count 3.0
";
    let samples = parse(text).unwrap();
    let names: Vec<&str> = samples.iter().map(|s| s.name).collect();
    assert_eq!(names, ["h_bucket", "h_bucket", "h_sum", "h_count"]);
    assert_eq!(samples[1].label("le"), Some("+Inf"));
}

#[test]
fn a_missing_value_is_an_error_with_its_line_number() {
    let err = parse("ok 1\nbroken\n").unwrap_err();
    assert!(
        matches!(err, ExpositionError::Value { line: 2, .. }),
        "{err}"
    );
    let err = parse("ok 1\n\nbroken{a=\"b\"}\n").unwrap_err();
    assert_eq!(err.line(), 3);
}

#[test]
fn a_non_numeric_value_is_an_error() {
    let err = parse("m{a=\"1\"} twelve").unwrap_err();
    assert!(
        matches!(err, ExpositionError::Value { line: 1, .. }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "line 1: invalid sample value: not a floating-point number"
    );
}

#[test]
fn an_unterminated_label_value_is_an_error() {
    let err = parse("# c\nm{a=\"open} 1").unwrap_err();
    assert!(
        matches!(err, ExpositionError::Labels { line: 2, .. }),
        "{err}"
    );
}

#[test]
fn an_unterminated_label_set_is_an_error() {
    let err = parse(r#"m{a="1" 1"#).unwrap_err();
    assert!(matches!(err, ExpositionError::Labels { .. }), "{err}");
    let err = parse(r#"m{a="1","#).unwrap_err();
    assert!(matches!(err, ExpositionError::Labels { .. }), "{err}");
}

#[test]
fn an_unknown_escape_in_a_label_value_is_an_error() {
    let err = parse(r#"m{a="tab\there"} 1"#).unwrap_err();
    assert!(matches!(err, ExpositionError::Labels { .. }), "{err}");
}

#[test]
fn an_unquoted_label_value_is_an_error() {
    let err = parse("m{a=1} 1").unwrap_err();
    assert!(matches!(err, ExpositionError::Labels { .. }), "{err}");
}

#[test]
fn a_duplicate_label_name_is_an_error() {
    let err = parse(r#"m{a="1",a="2"} 1"#).unwrap_err();
    assert!(matches!(err, ExpositionError::Labels { .. }), "{err}");
}

#[test]
fn empty_entries_in_a_label_set_are_an_error() {
    for text in [r#"m{,} 1"#, r#"m{a="1",,} 1"#, r#"m{a="1" b="2"} 1"#] {
        let err = parse(text).unwrap_err();
        assert!(
            matches!(err, ExpositionError::Labels { .. }),
            "{text}: {err}"
        );
    }
}

#[test]
fn an_invalid_metric_name_is_an_error() {
    for text in ["9lives 1", "{a=\"1\"} 1", "bad-name 1", "\"quoted\" 1"] {
        let err = parse(text).unwrap_err();
        assert!(
            matches!(err, ExpositionError::MetricName { line: 1, .. }),
            "{text}: {err}"
        );
    }
}

#[test]
fn a_non_integer_timestamp_is_an_error() {
    let err = parse("m 1 12.5").unwrap_err();
    assert!(
        matches!(err, ExpositionError::Timestamp { line: 1, .. }),
        "{err}"
    );
}

#[test]
fn text_after_the_timestamp_is_an_error() {
    let err = parse("m 1 1000 extra").unwrap_err();
    assert!(
        matches!(err, ExpositionError::TrailingText { line: 1, .. }),
        "{err}"
    );
}

/// xorshift64*: a tiny deterministic generator, so property tests need no
/// new dependency and every failure reproduces from its seed.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    fn pick<'p, T>(&mut self, items: &'p [T]) -> &'p T {
        &items[self.below(items.len())]
    }
}

/// Characters that stress the label-value lexer: escapes, quotes, the
/// label-set punctuation, comment markers, blanks and multi-byte UTF-8.
const VALUE_CHARS: &[char] = &[
    'a',
    'z',
    'Q',
    '0',
    '9',
    '_',
    ' ',
    '\t',
    '\\',
    '"',
    '\n',
    ',',
    '=',
    '{',
    '}',
    '#',
    '.',
    '\u{e9}',
    '\u{1f600}',
    '\u{4e2d}',
];

fn random_identifier(rng: &mut XorShift, first: &[u8], rest: &[u8]) -> String {
    let mut name = String::new();
    name.push(*rng.pick(first) as char);
    for _ in 0..rng.below(12) {
        name.push(*rng.pick(rest) as char);
    }
    name
}

fn random_value(rng: &mut XorShift) -> f64 {
    match rng.below(8) {
        0 => f64::NAN,
        1 => f64::INFINITY,
        2 => f64::NEG_INFINITY,
        3 => rng.below(1000) as f64,
        _ => {
            let candidate = f64::from_bits(rng.next());
            if candidate.is_finite() {
                candidate
            } else {
                0.5
            }
        }
    }
}

fn render_value(rng: &mut XorShift, value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value == f64::INFINITY {
        "+Inf".to_owned()
    } else if value == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else if rng.chance(2) {
        format!("{value:e}")
    } else {
        format!("{value:?}")
    }
}

fn escape_label_value(value: &str) -> String {
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

struct Expected {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

#[test]
fn rendered_random_samples_parse_back_to_the_same_samples() {
    const METRIC_START: &[u8] = b"abcxyzABZ_:";
    const METRIC_REST: &[u8] = b"abcxyzABZ_:0129";
    const LABEL_START: &[u8] = b"abcxyzABZ_";
    const LABEL_REST: &[u8] = b"abcxyzABZ_0129";

    for seed in 1..=200u64 {
        let mut rng = XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut text = String::new();
        let mut expected = Vec::new();
        for _ in 0..rng.below(20) {
            if rng.chance(4) {
                text.push_str("# HELP some_metric Help with \"quotes\" and \\ too.\n");
            }
            let name = random_identifier(&mut rng, METRIC_START, METRIC_REST);
            let mut labels: Vec<(String, String)> = Vec::new();
            for _ in 0..rng.below(5) {
                let label = random_identifier(&mut rng, LABEL_START, LABEL_REST);
                if labels.iter().any(|(existing, _)| *existing == label) {
                    continue;
                }
                let value: String = (0..rng.below(10)).map(|_| *rng.pick(VALUE_CHARS)).collect();
                labels.push((label, value));
            }
            let value = random_value(&mut rng);

            text.push_str(&name);
            if !labels.is_empty() || rng.chance(3) {
                let rendered: Vec<String> = labels
                    .iter()
                    .map(|(label, value)| format!("{label}=\"{}\"", escape_label_value(value)))
                    .collect();
                text.push('{');
                text.push_str(&rendered.join(","));
                if !labels.is_empty() && rng.chance(4) {
                    text.push(',');
                }
                text.push('}');
            }
            text.push(' ');
            text.push_str(&render_value(&mut rng, value));
            if rng.chance(3) {
                text.push_str(&format!(" {}", rng.next() as i64));
            }
            text.push_str(if rng.chance(3) { "\r\n" } else { "\n" });
            expected.push(Expected {
                name,
                labels,
                value,
            });
        }

        let parsed = parse(&text).unwrap_or_else(|err| panic!("seed {seed}: {err}\n{text}"));
        assert_eq!(parsed.len(), expected.len(), "seed {seed}");
        for (got, want) in parsed.iter().zip(&expected) {
            assert_eq!(got.name, want.name, "seed {seed}");
            let got_labels: Vec<(&str, &str)> = labels_of(got);
            let want_labels: Vec<(&str, &str)> = want
                .labels
                .iter()
                .map(|(label, value)| (label.as_str(), value.as_str()))
                .collect();
            assert_eq!(got_labels, want_labels, "seed {seed}");
            assert!(
                got.value.to_bits() == want.value.to_bits()
                    || (got.value.is_nan() && want.value.is_nan()),
                "seed {seed}: {} != {}",
                got.value,
                want.value
            );
        }
    }
}

#[test]
fn arbitrary_byte_soup_never_panics() {
    // Bytes biased towards the ones the grammar cares about, plus
    // invalid UTF-8 (made lossy, as a caller decoding a body would).
    const ALPHABET: &[u8] = b"ab_:09 \t\r\n{}=\",\\#.+-eEInfNa\xc3\xa9\xff\x00";
    for seed in 1..=2000u64 {
        let mut rng = XorShift(seed.wrapping_mul(0xd1b5_4a32_d192_ed03));
        let bytes: Vec<u8> = (0..rng.below(120))
            .map(|_| {
                if rng.chance(5) {
                    rng.next() as u8
                } else {
                    *rng.pick(ALPHABET)
                }
            })
            .collect();
        let text = String::from_utf8_lossy(&bytes);
        let _ = parse(&text);
    }
}

#[test]
fn mutated_valid_expositions_never_panic() {
    let base = "# HELP m help\n# TYPE m gauge\nm{a=\"x\\\"y\",b=\"\u{e9}\\n\",} 1.5e3 1000\r\nn NaN\nh_bucket{le=\"+Inf\"} 3\n";
    for seed in 1..=2000u64 {
        let mut rng = XorShift(seed.wrapping_mul(0x94d0_49bb_1331_11eb));
        let mut chars: Vec<char> = base.chars().collect();
        for _ in 0..=rng.below(4) {
            let at = rng.below(chars.len() + 1);
            match rng.below(3) {
                0 if at < chars.len() => {
                    chars.remove(at);
                }
                1 if at < chars.len() => chars[at] = *rng.pick(VALUE_CHARS),
                _ => chars.insert(at, *rng.pick(VALUE_CHARS)),
            }
        }
        let text: String = chars.into_iter().collect();
        if let Err(err) = parse(&text) {
            assert!(err.line() >= 1, "seed {seed}: line numbers are 1-based");
        }
    }
}
