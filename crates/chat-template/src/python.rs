//! Values written into a rendered prompt as Python's Jinja writes them: transformers
//! renders chat templates with jinja2, which prints a list or a dict with Python's
//! `str()` (`[{'type': 'text', 'text': 'hi'}]`), where minijinja would print JSON-like
//! text. A template that prints a message's content parts, which vLLM hands over as a
//! list where the template loops over them elsewhere, puts exactly that text into the
//! prompt. Floats follow Python's `repr` too (`2.5e+20`, `1e-05`), and the filters that
//! turn a value into text (`string`, `trim`, `join`, `indent`, `center`, `truncate`)
//! use Python's `str()`.

use std::fmt::Write;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind, Output, State};

use crate::or_keyword;
use crate::strings::{Ends, strip};

/// The environment's formatter: lists, dicts and floats as Python writes them, the rest as
/// minijinja does (which already writes `True`, `False` and `None` as Python does).
pub(crate) fn format(
    out: &mut Output<'_>,
    state: &mut State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            repr(&mut text, value)?;
            out.write_str(&text).map_err(write_error)
        }
        ValueKind::Number if !value.is_integer() => out
            .write_str(&float_repr(f64::try_from(value.clone())?))
            .map_err(write_error),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// jinja2's `center` filter: Python's `str(value).center(width)`.
pub(crate) fn center(value: &Value, width: Option<i64>) -> Result<String, Error> {
    Ok(crate::strings::center(
        &str_of(value)?,
        width.unwrap_or(80),
        ' ',
    ))
}

/// jinja2's `truncate` filter (see [`crate::strings::truncate`]), by position or keyword
/// (`leeway` by keyword only: a fourth positional argument fails, and asks a pod).
pub(crate) fn truncate(
    value: &Value,
    length: Option<i64>,
    killwords: Option<bool>,
    end: Option<String>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let length = or_keyword(length, &kwargs, "length")?.unwrap_or(255);
    let killwords = or_keyword(killwords, &kwargs, "killwords")?.unwrap_or(false);
    let end: Option<String> = or_keyword(end, &kwargs, "end")?;
    let leeway: Option<i64> = kwargs.get("leeway")?;
    kwargs.assert_all_used()?;
    crate::strings::truncate(
        &str_of(value)?,
        length,
        killwords,
        end.as_deref().unwrap_or("..."),
        leeway.unwrap_or(5),
    )
}

/// Jinja's `string` filter as jinja2 runs it: Python's `str()`.
pub(crate) fn string(value: &Value) -> Result<String, Error> {
    str_of(value)
}

/// Jinja's `trim` filter as jinja2 runs it: Python's `str(value).strip(chars)` (a list
/// of content parts trimmed is the text of the list).
pub(crate) fn trim(value: &Value, chars: Option<String>) -> Result<String, Error> {
    Ok(strip(&str_of(value)?, chars.as_deref(), Ends::Both).to_owned())
}

/// jinja2's `join` filter: each item (or its `attribute`, a dotted path) written with
/// Python's `str()` (`1e+20`, `True`, `[1, 'x']`), where minijinja's writes its own text.
pub(crate) fn join(
    value: &Value,
    separator: Option<Value>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let separator = or_keyword(separator, &kwargs, "d")?;
    let attribute: Option<Value> = kwargs.get("attribute")?;
    kwargs.assert_all_used()?;
    let separator = match separator {
        Some(separator) => str_of(&separator)?,
        None => String::new(),
    };
    let mut text = String::new();
    for (i, item) in value.try_iter()?.enumerate() {
        if i > 0 {
            text.push_str(&separator);
        }
        let item = match &attribute {
            Some(path) => attribute_of(&item, path)?,
            None => item,
        };
        text.push_str(&str_of(&item)?);
    }
    Ok(text)
}

/// jinja2's attribute getter: a dotted path, whose parts that are digits index a list.
fn attribute_of(item: &Value, path: &Value) -> Result<Value, Error> {
    if let Ok(index) = i64::try_from(path.clone()) {
        return item.get_item(&Value::from(index));
    }
    let path = path.as_str().unwrap_or_default().to_owned();
    let mut value = item.clone();
    for part in path.split('.') {
        value = match part.parse::<i64>() {
            Ok(index) => value.get_item(&Value::from(index))?,
            Err(_) => value.get_attr(part)?,
        };
    }
    Ok(value)
}

/// jinja2's `indent` filter: the lines (Python's line breaks, each written back as `\n`)
/// after the first indented by `width` spaces or by the text `width`, the first too with
/// `first`, blank lines too with `blank`.
pub(crate) fn indent(
    value: &Value,
    width: Option<Value>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let width = or_keyword(width, &kwargs, "width")?;
    let first = first
        .or(kwargs.get::<Option<bool>>("first")?)
        .unwrap_or(false);
    let blank = blank
        .or(kwargs.get::<Option<bool>>("blank")?)
        .unwrap_or(false);
    kwargs.assert_all_used()?;
    let indention = match width {
        None => "    ".to_owned(),
        Some(width) if width.kind() == ValueKind::String => str_of(&width)?,
        Some(width) => " ".repeat(usize::try_from(width).unwrap_or(0)),
    };
    // jinja2 appends a newline first, so that a text ending in one keeps it.
    let text = str_of(value)? + "\n";
    let lines = crate::strings::splitlines(&text, false);
    let mut indented = if blank {
        lines.join(&format!("\n{indention}"))
    } else {
        let mut rest = lines.iter();
        let mut indented = rest.next().copied().unwrap_or_default().to_owned();
        for line in rest {
            indented.push('\n');
            if !line.is_empty() {
                indented.push_str(&indention);
            }
            indented.push_str(line);
        }
        indented
    };
    if first {
        indented.insert_str(0, &indention);
    }
    Ok(indented)
}

/// jinja2's `sequence` test: what has a length and an item by index in Python (strings,
/// lists and dicts; jinja2's undefined too), where minijinja's holds for lists only.
pub(crate) fn is_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Seq
            | ValueKind::Map
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Undefined
    )
}

/// jinja2's `iterable` test: minijinja's, but for `None`, which Python cannot iterate.
pub(crate) fn is_iterable(value: &Value) -> bool {
    !value.is_none() && value.try_iter().is_ok()
}

/// Python's `str()` of a value.
fn str_of(value: &Value) -> Result<String, Error> {
    Ok(match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        // An undefined value prints as nothing in jinja2.
        ValueKind::Undefined => String::new(),
        _ => {
            let mut text = String::new();
            repr(&mut text, value)?;
            text
        }
    })
}

fn write_error(e: std::fmt::Error) -> Error {
    Error::new(ErrorKind::WriteFailure, e.to_string())
}

/// Python's `repr` of a value held in a list or dict.
fn repr(out: &mut String, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            // A tuple (`(1, 2)`, `dictsort`'s pairs) as Python writes one: `(1,)` alone.
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut items = 0;
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr(out, &item)?;
                items += 1;
            }
            if tuple && items == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr(out, &key)?;
                out.push_str(": ");
                repr(out, &value.get_item(&key)?)?;
            }
            out.push('}');
        }
        ValueKind::String => string_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Number if !value.is_integer() => {
            out.push_str(&float_repr(f64::try_from(value.clone())?));
        }
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// Python's `repr` of a string: single quotes unless the text holds one and no double
/// quote; backslashes, the quote, `\n`, `\r`, `\t` escaped; characters Python does not
/// print as themselves written as `\xNN`, `\uNNNN` or `\UNNNNNNNN`.
fn string_repr(out: &mut String, text: &str) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !printable(c) => {
                let code = u32::from(c);
                let _ = match code {
                    0..=0xff => write!(out, "\\x{code:02x}"),
                    0x100..=0xffff => write!(out, "\\u{code:04x}"),
                    _ => write!(out, "\\U{code:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Whether Python's `str.isprintable` holds for `c`: not a control, format, separator
/// (but the space), private-use or surrogate character. Unassigned code points, which
/// Python escapes too, are not known here and are written as they are.
fn printable(c: char) -> bool {
    !matches!(u32::from(c),
        0x00..=0x1f | 0x7f..=0xa0 | 0xad
        | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x1680 | 0x180e
        | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064 | 0x2066..=0x206f
        | 0x3000 | 0xe000..=0xf8ff | 0xfeff | 0xfff9..=0xfffb
        | 0x1_1000..=0x1_10ff
        | 0xe_0001 | 0xe_0020..=0xe_007f | 0xf_0000..=0x10_ffff)
}

/// Python's `repr` of a float: the shortest digits that read back the same, positional
/// for exponents from -4 to 15 (with `.0` when whole), else `d.ddde+XX`.
pub(crate) fn float_repr(value: f64) -> String {
    if value.is_nan() {
        return "nan".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.into();
    }
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let positional = format!("{value}");
        if positional.contains('.') {
            positional
        } else {
            format!("{positional}.0")
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn python(value: Value) -> String {
        let mut out = String::new();
        repr(&mut out, &value).expect("repr");
        out
    }

    #[test]
    fn lists_and_dicts_read_as_pythons_str_writes_them() {
        // Each expected text is what CPython's repr() gives.
        let parts: Value = serde_json::from_str::<Value>(
            r#"[{"type": "text", "text": "it's"}, {"type": "text", "text": "a \"b\"\n\\"}]"#,
        )
        .expect("parts");
        assert_eq!(
            python(parts),
            r#"[{'type': 'text', 'text': "it's"}, {'type': 'text', 'text': 'a "b"\n\\'}]"#
        );
        let mixed: Value =
            serde_json::from_str(r#"{"n": null, "t": true, "i": 3, "f": 0.5, "l": []}"#)
                .expect("mixed");
        assert_eq!(
            python(mixed),
            "{'n': None, 't': True, 'i': 3, 'f': 0.5, 'l': []}"
        );
        assert_eq!(
            python(Value::from("both ' and \" \u{7} \u{a0} \u{200b} é 日本")),
            r#"'both \' and " \x07 \xa0 \u200b é 日本'"#
        );
    }

    #[test]
    fn the_text_filters_read_a_list_as_pythons_str_writes_it() {
        let parts: Value =
            serde_json::from_str(r#"[{"type": "text", "text": "hi"}]"#).expect("parts");
        assert_eq!(
            trim(&parts, None).expect("trim"),
            "[{'type': 'text', 'text': 'hi'}]"
        );
        assert_eq!(trim(&Value::from("  a b \n"), None).expect("trim"), "a b");
        assert_eq!(
            trim(&Value::from("xxaxbxx"), Some("x".into())).expect("trim"),
            "axb"
        );
        assert_eq!(string(&Value::from(true)).expect("string"), "True");
        assert_eq!(string(&Value::from(2.5)).expect("string"), "2.5");
        assert_eq!(string(&Value::UNDEFINED).expect("string"), "");
    }

    #[test]
    fn floats_read_as_pythons_repr_writes_them() {
        for (value, python) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (2.5e20, "2.5e+20"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-1.5e-7, "-1.5e-07"),
            (123.456, "123.456"),
        ] {
            assert_eq!(float_repr(value), python, "{value}");
        }
    }
}
