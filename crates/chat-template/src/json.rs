//! transformers' `tojson` filter: Python's `json.dumps(x, ensure_ascii=False, indent=None,
//! separators=None, sort_keys=False)`, each overridable by keyword. Jinja's own `tojson`
//! escapes HTML characters and writes no spaces, which would change the prompt.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

use crate::python::float_repr;

/// How `json.dumps` was asked to write.
struct Style {
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

pub(crate) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let invalid = |message: &str| Error::new(ErrorKind::InvalidOperation, message.to_owned());
    let indent = match indent.filter(|v| !v.is_none() && !v.is_undefined()) {
        None => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(s)) => Some(s.to_owned()),
            _ => return Err(invalid("tojson: indent must be an integer or a string")),
        },
    };
    let (item_separator, key_separator) = match separators.filter(|s| !s.is_none()) {
        Some(pair) => {
            let parts: Vec<String> = pair
                .try_iter()?
                .map(|part| part.as_str().map(str::to_owned).unwrap_or_default())
                .collect();
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => return Err(invalid("tojson: separators must be a pair of strings")),
            }
        }
        // Python's defaults: no space before a line break when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = Style {
        indent,
        item_separator,
        key_separator,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

fn newline(out: &mut String, style: &Style, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline(out, style, depth + 1);
                write(out, item, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = crate::map_pairs(value).ok_or_else(|| {
                Error::new(
                    ErrorKind::BadSerialization,
                    "tojson: a map that cannot be read",
                )
            })?;
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                entries.sort_by(|(a, _), (b, _)| a.cmp(b));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline(out, style, depth + 1);
                // JSON keys are strings: Python writes a number or a boolean key as its text.
                match key.as_str() {
                    Some(text) => write_string(out, text, style.ensure_ascii),
                    None => write_string(out, &key_text(key)?, style.ensure_ascii),
                }
                out.push_str(&style.key_separator);
                write(out, item, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        ValueKind::String => {
            write_string(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => {
            let float = f64::try_from(value.clone())?;
            out.push_str(&match float_repr(float).as_str() {
                "nan" => "NaN".to_owned(),
                "inf" => "Infinity".to_owned(),
                "-inf" => "-Infinity".to_owned(),
                repr => repr.to_owned(),
            });
        }
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::None | ValueKind::Undefined => out.push_str("null"),
        kind => {
            return Err(Error::new(
                ErrorKind::BadSerialization,
                format!("tojson: a {kind} is not JSON"),
            ));
        }
    }
    Ok(())
}

/// A non-string dict key as `json.dumps` writes it.
fn key_text(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Number if !key.is_integer() => float_repr(f64::try_from(key.clone())?),
        _ => key.to_string(),
    })
}

fn write_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.reserve(text.len() + 2);
    out.push('"');
    // Runs of characters written as they are go in whole.
    let mut plain = 0;
    for (at, c) in text.char_indices() {
        let escaped = match c {
            '"' => "\\\"",
            '\\' => "\\\\",
            '\n' => "\\n",
            '\r' => "\\r",
            '\t' => "\\t",
            '\u{8}' => "\\b",
            '\u{c}' => "\\f",
            c if u32::from(c) < 0x20 || (ensure_ascii && !c.is_ascii()) => "",
            _ => continue,
        };
        out.push_str(&text[plain..at]);
        plain = at + c.len_utf8();
        if escaped.is_empty() {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            out.push_str(escaped);
        }
    }
    out.push_str(&text[plain..]);
    out.push('"');
}

#[cfg(test)]
mod tests {
    use minijinja::Environment;

    fn render(source: &str, value: &str) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", super::tojson);
        let value: minijinja::Value = serde_json::from_str(value).expect("JSON");
        env.render_str(source, minijinja::context! { v => value })
            .expect("renders")
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        // Each expected text is CPython's json.dumps(..., ensure_ascii=False) of the value.
        let value = r#"{"b": [1, 2.5, true, null, "<é>\n"], "a": {}, "c": []}"#;
        assert_eq!(
            render("{{ v | tojson }}", value),
            r#"{"b": [1, 2.5, true, null, "<é>\n"], "a": {}, "c": []}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2, sort_keys=true) }}", value),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null,\n    \"<é>\\n\"\n  ],\n  \"c\": []\n}"
        );
        assert_eq!(
            render(
                "{{ v | tojson(separators=[',', ':'], ensure_ascii=true) }}",
                r#"["é", 1e20]"#
            ),
            r#"["\u00e9",1e+20]"#
        );
        // Every escape between runs of plain text, at either end too (CPython's output).
        let text = r#""plain \"q\" back\\\\ nl\n cr\r tab\t bs\b ff\f ctl\u0001 é 日本 🎉 end""#;
        assert_eq!(render("{{ v | tojson }}", text), text);
        assert_eq!(
            render("{{ v | tojson(ensure_ascii=true) }}", text),
            r#""plain \"q\" back\\\\ nl\n cr\r tab\t bs\b ff\f ctl\u0001 \u00e9 \u65e5\u672c \ud83c\udf89 end""#
        );
        assert_eq!(render("{{ v | tojson }}", r#""\n\"""#), r#""\n\"""#);
    }
}
