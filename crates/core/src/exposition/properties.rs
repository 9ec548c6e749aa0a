//! Property tests of the exposition parser: generated metric families, written out the
//! way exporters write them, read back to the same samples; [`parse_where`] agrees with
//! [`parse`]; no input panics, and an error names a line that is malformed by itself.

use proptest::prelude::*;

use super::*;
use crate::testing::{config, escape_label_value, tricky_char, tricky_text};

/// One sample as generated: what the parser must give back.
#[derive(Debug, Clone)]
struct Expected {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// How one sample line is spelled; none of it changes what the line means.
#[derive(Debug, Clone)]
struct Spelling {
    /// Blanks between the name or label set and the value, and before a timestamp.
    gap: &'static str,
    /// `{}` written for a sample without labels.
    empty_braces: bool,
    trailing_comma: bool,
    /// Blanks around label names, `=`, and `,`.
    spaced_labels: bool,
    value_style: usize,
    timestamp: Option<i64>,
    crlf: bool,
}

fn spelling() -> impl Strategy<Value = Spelling> {
    (
        prop::sample::select(vec![" ", "  ", "\t", " \t"]),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.2),
        0usize..6,
        prop::option::weighted(0.3, any::<i64>()),
        prop::bool::weighted(0.3),
    )
        .prop_map(
            |(gap, empty_braces, trailing_comma, spaced_labels, value_style, timestamp, crlf)| {
                Spelling {
                    gap,
                    empty_braces,
                    trailing_comma,
                    spaced_labels,
                    value_style,
                    timestamp,
                    crlf,
                }
            },
        )
}

/// `value` in one of the spellings exporters use (Go, Python, Java clients): each reads
/// back to exactly `value`.
fn spell_value(value: f64, style: usize) -> String {
    if value.is_nan() {
        return ["NaN", "nan"][style % 2].to_owned();
    }
    if value.is_infinite() {
        let sign = if value > 0.0 { "+" } else { "-" };
        return format!("{sign}{}", ["Inf", "inf", "Infinity"][style % 3]);
    }
    match style {
        0 => format!("{value:?}"),
        1 => format!("{value:e}"),
        2 => format!("{value:E}"),
        // Python's repr of a float in exponent form: `1.5e+03`.
        3 => {
            let text = format!("{value:e}");
            if text.contains("e-") {
                text
            } else {
                text.replace('e', "e+")
            }
        }
        4 if value.is_sign_positive() => format!("+{value:?}"),
        _ => format!("{value}"),
    }
}

fn write_sample(text: &mut String, sample: &Expected, spelling: &Spelling) {
    text.push_str(&sample.name);
    if !sample.labels.is_empty() || spelling.empty_braces {
        let blank = if spelling.spaced_labels { " " } else { "" };
        let labels: Vec<String> = sample
            .labels
            .iter()
            .map(|(name, value)| {
                format!(
                    "{blank}{name}{blank}={blank}\"{}\"",
                    escape_label_value(value)
                )
            })
            .collect();
        text.push('{');
        text.push_str(&labels.join(&format!("{blank},")));
        if spelling.trailing_comma && !sample.labels.is_empty() {
            text.push(',');
        }
        text.push_str(blank);
        text.push('}');
    }
    text.push_str(spelling.gap);
    text.push_str(&spell_value(sample.value, spelling.value_style));
    if let Some(timestamp) = spelling.timestamp {
        text.push_str(spelling.gap);
        text.push_str(&timestamp.to_string());
    }
    text.push_str(if spelling.crlf { "\r\n" } else { "\n" });
}

fn identifier(first: &'static str, rest: &'static str) -> impl Strategy<Value = String> {
    let pick = |chars: &'static str| prop::sample::select(chars.chars().collect::<Vec<_>>());
    (pick(first), prop::collection::vec(pick(rest), 0..12))
        .prop_map(|(first, rest)| std::iter::once(first).chain(rest).collect())
}

/// Metric names; none starts with `junk`, which [`junk_line`] keeps for itself.
fn metric_name() -> impl Strategy<Value = String> {
    prop_oneof![
        identifier("abcxyzABZ_:", "abcxyzABZ_:0129"),
        prop::sample::select(vec![
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "process_cpu_seconds_total",
        ])
        .prop_map(str::to_owned),
    ]
}

/// A label set: distinct names (never `le` or `quantile`, which families add), values of
/// any text.
fn label_set() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::vec(
        (identifier("abcxyzABZ_", "abcxyzABZ_0129"), tricky_text(12)),
        0..4,
    )
    .prop_map(|mut labels| {
        let mut seen = std::collections::HashSet::new();
        labels.retain(|(name, _)| name != "le" && name != "quantile" && seen.insert(name.clone()));
        labels
    })
}

fn sample_value() -> impl Strategy<Value = f64> {
    prop_oneof![
        3 => (0u32..1000).prop_map(f64::from),
        3 => any::<f64>(),
        1 => prop::sample::select(vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 1e-300, f64::MAX]),
    ]
}

/// One metric family's lines, before spelling: its samples in exposition order.
#[derive(Debug, Clone)]
struct Family {
    name: String,
    kind: &'static str,
    help: Option<String>,
    samples: Vec<Expected>,
}

fn plain_family() -> impl Strategy<Value = Family> {
    (
        metric_name(),
        prop::sample::select(vec!["counter", "gauge", "untyped"]),
        prop::option::of(tricky_text(20)),
        prop::collection::vec((label_set(), sample_value()), 1..4),
    )
        .prop_map(|(name, kind, help, series)| Family {
            samples: series
                .into_iter()
                .map(|(labels, value)| Expected {
                    name: name.clone(),
                    labels,
                    value,
                })
                .collect(),
            name,
            kind,
            help,
        })
}

/// A histogram: cumulative `_bucket` series with `le` bounds ending at `+Inf`, then `_sum`
/// and `_count`, all carrying the family's labels.
fn histogram_family() -> impl Strategy<Value = Family> {
    (
        metric_name(),
        prop::option::of(tricky_text(20)),
        label_set(),
        prop::collection::vec((-1e6f64..1e6, 0u32..100), 0..6),
        any::<f64>(),
    )
        .prop_map(|(name, help, labels, mut buckets, sum)| {
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut samples = Vec::new();
            let mut cumulative = 0.0;
            let bounds = buckets
                .iter()
                .map(|&(bound, count)| (format!("{bound}"), count))
                .chain(std::iter::once(("+Inf".to_owned(), 1)));
            for (bound, count) in bounds {
                cumulative += f64::from(count);
                let mut bucket_labels = labels.clone();
                bucket_labels.push(("le".to_owned(), bound));
                samples.push(Expected {
                    name: format!("{name}_bucket"),
                    labels: bucket_labels,
                    value: cumulative,
                });
            }
            samples.push(Expected {
                name: format!("{name}_sum"),
                labels: labels.clone(),
                value: sum,
            });
            samples.push(Expected {
                name: format!("{name}_count"),
                labels,
                value: cumulative,
            });
            Family {
                name,
                kind: "histogram",
                help,
                samples,
            }
        })
}

fn family() -> impl Strategy<Value = Family> {
    prop_oneof![3 => plain_family(), 1 => histogram_family()]
}

/// A page: families with their `# HELP` / `# TYPE` lines, each sample spelled its own way,
/// blank lines and free comments here and there.
fn page() -> impl Strategy<Value = (String, Vec<Expected>)> {
    prop::collection::vec(
        (
            family(),
            prop::collection::vec(spelling(), 12),
            prop::bool::weighted(0.2),
        ),
        0..6,
    )
    .prop_map(|families| {
        let mut text = String::new();
        let mut expected = Vec::new();
        for (family, spellings, blank_line) in families {
            if let Some(help) = &family.help {
                // HELP text escapes `\` and newline, as label values do, but not `"`.
                let help = help.replace('\\', r"\\").replace('\n', r"\n");
                text.push_str(&format!("# HELP {} {help}\n", family.name));
            }
            text.push_str(&format!("# TYPE {} {}\n", family.name, family.kind));
            for (sample, spelling) in family.samples.iter().zip(spellings.iter().cycle()) {
                write_sample(&mut text, sample, spelling);
            }
            if blank_line {
                text.push_str("\n \t\n# a free comment {\"\n");
            }
            expected.extend(family.samples);
        }
        (text, expected)
    })
}

fn assert_same_samples(got: &[Sample<'_>], want: &[Expected]) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    for (got, want) in got.iter().zip(want) {
        prop_assert_eq!(got.name, want.name.as_str());
        let got_labels: Vec<(&str, &str)> = got
            .labels
            .iter()
            .map(|(name, value)| (*name, value.as_ref()))
            .collect();
        let want_labels: Vec<(&str, &str)> = want
            .labels
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        prop_assert_eq!(got_labels, want_labels);
        prop_assert!(
            got.value.to_bits() == want.value.to_bits()
                || (got.value.is_nan() && want.value.is_nan()),
            "{} read as {}",
            want.value,
            got.value
        );
    }
    Ok(())
}

/// A sample with its value as bits, so that two NaNs read from one text compare equal.
fn exact<'s>(sample: &'s Sample<'_>) -> (&'s str, Vec<(&'s str, &'s str)>, u64) {
    let labels = sample
        .labels
        .iter()
        .map(|(name, value)| (*name, value.as_ref()))
        .collect();
    (sample.name, labels, sample.value.to_bits())
}

/// A line of a metric no caller wants, well-formed or not.
fn junk_line() -> impl Strategy<Value = (String, bool)> {
    let malformed = prop::sample::select(vec![
        "junk_a{a=\"1\" 1",
        "junk_b",
        "junk_c 1 2 3",
        "junk_d{a=1} 2",
        "junk_e twelve",
        "junk_f{a=\"\\t\"} 1",
        "junk_g{a=\"1\",a=\"2\"} 1",
        "junk_h 1 1.5",
        "junk_i{\u{e9}=\"1\"} 1",
    ]);
    prop_oneof![
        malformed.prop_map(|line| (line.to_owned(), false)),
        (label_set(), sample_value()).prop_map(|(labels, value)| {
            let mut line = String::new();
            let sample = Expected {
                name: "junk_ok".to_owned(),
                labels,
                value,
            };
            let spelling = Spelling {
                gap: " ",
                empty_braces: false,
                trailing_comma: false,
                spaced_labels: false,
                value_style: 0,
                timestamp: None,
                crlf: false,
            };
            write_sample(&mut line, &sample, &spelling);
            line.pop();
            (line, true)
        }),
    ]
}

/// Checks what an answer to `text` must satisfy: the line an error names exists, the lines
/// before it parse, and it is malformed by itself.
fn check_error_line(text: &str, result: &Result<Vec<Sample<'_>>, ExpositionError>) {
    let Err(err) = result else { return };
    let lines: Vec<&str> = text.split('\n').collect();
    assert!(
        (1..=lines.len()).contains(&err.line()),
        "{err} in {} lines",
        lines.len()
    );
    let before = lines[..err.line() - 1].join("\n");
    assert!(parse(&before).is_ok(), "{err}, but an earlier line fails");
    let alone = parse(lines[err.line() - 1]).expect_err("the named line is malformed");
    assert_eq!(std::mem::discriminant(&alone), std::mem::discriminant(err));
}

proptest! {
    #![proptest_config(config(400))]

    #[test]
    fn rendered_families_parse_back_to_the_same_samples((text, expected) in page()) {
        let parsed = parse(&text).map_err(|err| TestCaseError::fail(format!("{err}\n{text}")))?;
        assert_same_samples(&parsed, &expected)?;
    }

    #[test]
    fn parse_where_reads_the_wanted_samples_as_parse_does_and_skips_the_rest_unchecked(
        (text, expected) in page(),
        junk in prop::collection::vec((any::<prop::sample::Index>(), junk_line()), 0..4),
    ) {
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        for (at, (line, _)) in &junk {
            let at = at.index(lines.len() + 1);
            lines.insert(at, line.clone());
        }
        let text = lines.join("\n");
        let wanted = |name: &str| !name.starts_with("junk");

        let filtered = parse_where(&text, wanted).map_err(|err| TestCaseError::fail(format!("{err}")))?;
        assert_same_samples(&filtered, &expected)?;

        let first_malformed = lines
            .iter()
            .position(|line| line.starts_with("junk") && parse(line).is_err());
        match (parse(&text), first_malformed) {
            (Ok(all), None) => {
                let kept: Vec<_> = all.iter().filter(|s| wanted(s.name)).map(exact).collect();
                prop_assert_eq!(kept, filtered.iter().map(exact).collect::<Vec<_>>());
            }
            (Err(err), Some(index)) => prop_assert_eq!(err.line(), index + 1),
            (got, want) => prop_assert!(false, "parse gave {:?}, first malformed line {:?}", got, want),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let text = String::from_utf8_lossy(&bytes);
        let result = parse(&text);
        check_error_line(&text, &result);
    }

    #[test]
    fn text_of_the_grammars_characters_never_panics(
        text in prop::collection::vec(
            prop_oneof![
                4 => prop::sample::select(
                    "ab_:09 \t\r\n{}=\",\\#.+-eEInfNa".chars().collect::<Vec<_>>()
                ),
                1 => tricky_char(),
            ],
            0..120,
        )
        .prop_map(String::from_iter),
    ) {
        let result = parse(&text);
        check_error_line(&text, &result);
        let wanted = parse_where(&text, |name| name.len() % 2 == 0);
        if let Err(err) = &wanted {
            // A wanted line that fails fails in a full parse too, at it or earlier.
            prop_assert!(matches!(&result, Err(first) if first.line() <= err.line()));
        }
    }

    #[test]
    fn mutated_pages_never_panic_and_errors_name_the_first_bad_line(
        (text, _) in page(),
        edits in prop::collection::vec(
            (any::<prop::sample::Index>(), 0usize..3, tricky_char()),
            1..5,
        ),
    ) {
        let mut chars: Vec<char> = text.chars().collect();
        for (at, kind, c) in edits {
            let at = at.index(chars.len() + 1);
            match kind {
                0 if at < chars.len() => {
                    chars.remove(at);
                }
                1 if at < chars.len() => chars[at] = c,
                _ => chars.insert(at, c),
            }
        }
        let text: String = chars.into_iter().collect();
        let result = parse(&text);
        check_error_line(&text, &result);
    }
}
