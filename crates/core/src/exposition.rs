//! Parser for the Prometheus text exposition format, version 0.0.4.
//!
//! Pure and allocation-light: sample names and label values borrow from the
//! input; only label values that contain escapes are copied. Comments
//! (`# HELP`, `# TYPE`, anything else after `#`) and blank lines are skipped.
//! A malformed sample line is an error carrying its 1-based line number, never
//! silently dropped: a pod whose `/metrics` lies must be noticed, not half-read.
//!
//! Grammar of a sample line (blanks are spaces or tabs):
//! `name [ "{" [ label "=" "\"" value "\"" { "," ... } [ "," ] ] "}" ] value [ timestamp ]`

use std::borrow::Cow;

/// One sample line: `name{labels} value [timestamp]`. The timestamp is
/// validated but not kept; the router only looks at current values.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Full sample name, suffix included (`foo_total`, `foo_bucket`, `foo_sum`).
    pub name: &'a str,
    /// Labels in exposition order; values are unescaped.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
}

impl Sample<'_> {
    /// The value of the label called `name`, if the sample carries it.
    #[must_use]
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(label, _)| *label == name)
            .map(|(_, value)| value.as_ref())
    }
}

/// Why a line could not be parsed. `line` is 1-based.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpositionError {
    #[error("line {line}: invalid metric name: {reason}")]
    MetricName { line: usize, reason: &'static str },
    #[error("line {line}: invalid label set: {reason}")]
    Labels { line: usize, reason: &'static str },
    #[error("line {line}: invalid sample value: {reason}")]
    Value { line: usize, reason: &'static str },
    #[error("line {line}: invalid timestamp: {reason}")]
    Timestamp { line: usize, reason: &'static str },
    #[error("line {line}: unexpected text after the sample: {reason}")]
    TrailingText { line: usize, reason: &'static str },
}

impl ExpositionError {
    /// The 1-based line number the error refers to.
    #[must_use]
    pub fn line(&self) -> usize {
        match self {
            Self::MetricName { line, .. }
            | Self::Labels { line, .. }
            | Self::Value { line, .. }
            | Self::Timestamp { line, .. }
            | Self::TrailingText { line, .. } => *line,
        }
    }
}

/// Parses a whole exposition text into its samples, in input order.
///
/// Accepts `\n` and `\r\n` line endings.
///
/// # Errors
///
/// The first malformed sample line, as an [`ExpositionError`] naming its line.
pub fn parse(text: &str) -> Result<Vec<Sample<'_>>, ExpositionError> {
    parse_where(text, |_| true)
}

/// Like [`parse`], but only the samples whose metric name passes `wanted`; other lines are
/// skipped after reading their name, unchecked. A vLLM `/metrics` is mostly histogram
/// buckets a picker never reads, and it is scraped many times a second.
///
/// # Errors
///
/// The first malformed line among the wanted ones (or one without a readable name).
pub fn parse_where(
    text: &str,
    wanted: impl Fn(&str) -> bool,
) -> Result<Vec<Sample<'_>>, ExpositionError> {
    let mut samples = Vec::new();
    // Lines found with `memchr` (vectorised), as `str::split` walks them more slowly.
    let mut start = 0;
    for index in 0.. {
        let Some(rest) = text.get(start..) else {
            break;
        };
        let end = memchr::memchr(b'\n', rest.as_bytes()).map_or(text.len(), |at| start + at);
        let raw = &text[start..end];
        start = end + 1;
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        let content = line.trim_start_matches(is_blank_char);
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let name_end = content
            .bytes()
            .position(|byte| !is_metric_name_char(byte))
            .unwrap_or(content.len());
        if name_end > 0 && !wanted(&content[..name_end]) {
            continue;
        }
        samples.push(parse_sample(content, index + 1)?);
    }
    Ok(samples)
}

fn is_blank(byte: u8) -> bool {
    byte == b' ' || byte == b'\t'
}

fn is_blank_char(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// Byte classes of names, one table lookup per byte instead of four comparisons (names
/// are scanned byte by byte on every line of every scrape).
const LABEL_NAME_CHAR: u8 = 1;
const METRIC_NAME_CHAR: u8 = 2;
const CLASSES: [u8; 256] = {
    let mut classes = [0u8; 256];
    let mut byte = 0;
    while byte < 256 {
        let b = byte as u8;
        if b.is_ascii_alphanumeric() || b == b'_' {
            classes[byte] = LABEL_NAME_CHAR | METRIC_NAME_CHAR;
        } else if b == b':' {
            classes[byte] = METRIC_NAME_CHAR;
        }
        byte += 1;
    }
    classes
};

fn is_metric_name_start(byte: u8) -> bool {
    byte.is_ascii_alphabetic() || byte == b'_' || byte == b':'
}

fn is_metric_name_char(byte: u8) -> bool {
    CLASSES[usize::from(byte)] & METRIC_NAME_CHAR != 0
}

fn is_label_name_start(byte: u8) -> bool {
    byte.is_ascii_alphabetic() || byte == b'_'
}

fn is_label_name_char(byte: u8) -> bool {
    CLASSES[usize::from(byte)] & LABEL_NAME_CHAR != 0
}

/// Parses one non-blank, non-comment line (leading blanks already removed).
fn parse_sample(text: &str, line: usize) -> Result<Sample<'_>, ExpositionError> {
    let mut cursor = Cursor { text, pos: 0 };

    if !cursor.peek().is_some_and(is_metric_name_start) {
        return Err(ExpositionError::MetricName {
            line,
            reason: "must start with a letter, '_' or ':'",
        });
    }
    let name = cursor.take_while(is_metric_name_char);
    match cursor.peek() {
        Some(b'{') => {}
        Some(byte) if is_blank(byte) => {}
        Some(_) => {
            return Err(ExpositionError::MetricName {
                line,
                reason: "contains a character outside [a-zA-Z0-9_:]",
            });
        }
        None => {
            return Err(ExpositionError::Value {
                line,
                reason: "missing value",
            });
        }
    }
    cursor.skip_blanks();

    let labels = if cursor.eat(b'{') {
        cursor
            .label_set()
            .map_err(|reason| ExpositionError::Labels { line, reason })?
    } else {
        Vec::new()
    };
    cursor.skip_blanks();

    let value_token = cursor.take_while(|byte| !is_blank(byte));
    if value_token.is_empty() {
        return Err(ExpositionError::Value {
            line,
            reason: "missing value",
        });
    }
    // Rust's float syntax matches Go's ParseFloat (which Prometheus uses) on
    // everything exporters write: `NaN`, `+Inf`, `-Inf`, `1.5e-3`, `1.0e+00`.
    let value: f64 = value_token.parse().map_err(|_| ExpositionError::Value {
        line,
        reason: "not a floating-point number",
    })?;
    cursor.skip_blanks();

    let timestamp_token = cursor.take_while(|byte| !is_blank(byte));
    if !timestamp_token.is_empty() && timestamp_token.parse::<i64>().is_err() {
        return Err(ExpositionError::Timestamp {
            line,
            reason: "not an integer number of milliseconds",
        });
    }
    cursor.skip_blanks();

    if cursor.peek().is_some() {
        return Err(ExpositionError::TrailingText {
            line,
            reason: "expected end of line after value and timestamp",
        });
    }
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// Byte cursor over one line. Every position it stops at is either the end or
/// an ASCII byte, so slicing `text` at those positions stays on char boundaries.
struct Cursor<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() == Some(byte) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn skip_blanks(&mut self) {
        while self.peek().is_some_and(is_blank) {
            self.pos += 1;
        }
    }

    /// Consumes bytes while `accept` holds. `accept` must reject at least the
    /// blanks or be ASCII-only, so the stop position is a char boundary.
    fn take_while(&mut self, accept: impl Fn(u8) -> bool) -> &'a str {
        let start = self.pos;
        // A slice iterator, not `peek` per byte: no bounds check per byte (this loop is
        // most of the parse, at every scrape of every pod).
        let rest = self.text.as_bytes().get(start..).unwrap_or_default();
        self.pos = start
            + rest
                .iter()
                .position(|&byte| !accept(byte))
                .unwrap_or(rest.len());
        &self.text[start..self.pos]
    }

    /// Parses the inside of `{...}`; the opening brace is already consumed.
    fn label_set(&mut self) -> Result<Vec<(&'a str, Cow<'a, str>)>, &'static str> {
        // vLLM's series carry two to four labels, its info gauges a few dozen.
        let mut labels: Vec<(&'a str, Cow<'a, str>)> = Vec::with_capacity(4);
        loop {
            self.skip_blanks();
            // `{}` and a trailing comma (`{a="1",}`) are both legal.
            if self.eat(b'}') {
                return Ok(labels);
            }
            if !self.peek().is_some_and(is_label_name_start) {
                return Err(if self.peek().is_none() {
                    "unterminated label set"
                } else {
                    "expected a label name or '}'"
                });
            }
            let name = self.take_while(is_label_name_char);
            self.skip_blanks();
            if !self.eat(b'=') {
                return Err("expected '=' after label name");
            }
            self.skip_blanks();
            if !self.eat(b'"') {
                return Err("expected '\"' to open the label value");
            }
            let value = self.label_value()?;
            // Prometheus rejects a repeated label name; so do we, rather than
            // guess which of the two values the exporter meant.
            if labels.iter().any(|(existing, _)| *existing == name) {
                return Err("duplicate label name");
            }
            labels.push((name, value));
            self.skip_blanks();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(labels);
                }
                None => return Err("unterminated label set"),
                Some(_) => return Err("expected ',' or '}' after a label value"),
            }
        }
    }

    /// Parses a label value up to its closing quote (opening quote consumed).
    /// Borrows when there is no escape; copies only when there is one.
    fn label_value(&mut self) -> Result<Cow<'a, str>, &'static str> {
        let bytes = self.text.as_bytes();
        let start = self.pos;
        let mut unescaped: Option<String> = None;
        // Start of the run of plain bytes not yet copied into `unescaped`.
        let mut run_start = start;
        let mut i = start;
        loop {
            // Straight to the next quote or backslash (vectorised): every other byte is
            // plain, and label values are most of a vLLM page's sample bytes.
            let rest = bytes.get(i..).unwrap_or_default();
            i += memchr::memchr2(b'"', b'\\', rest).unwrap_or(rest.len());
            match bytes.get(i) {
                None => return Err("unterminated label value"),
                Some(b'"') => {
                    self.pos = i + 1;
                    return Ok(match unescaped {
                        None => Cow::Borrowed(&self.text[start..i]),
                        Some(mut owned) => {
                            owned.push_str(&self.text[run_start..i]);
                            Cow::Owned(owned)
                        }
                    });
                }
                Some(b'\\') => {
                    let decoded = match bytes.get(i + 1) {
                        Some(b'\\') => '\\',
                        Some(b'"') => '"',
                        Some(b'n') => '\n',
                        None => return Err("unterminated label value"),
                        Some(_) => return Err("invalid escape in label value"),
                    };
                    let owned = unescaped.get_or_insert_with(String::new);
                    owned.push_str(&self.text[run_start..i]);
                    owned.push(decoded);
                    i += 2;
                    run_start = i;
                }
                Some(_) => i += 1,
            }
        }
    }
}

#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;
