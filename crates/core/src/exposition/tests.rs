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
