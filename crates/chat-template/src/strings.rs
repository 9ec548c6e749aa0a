//! Python's `str` methods, and the jinja2 filters built on them, as a template's strings
//! run them in transformers. minijinja-contrib's `pycompat` gives templates most of them,
//! written with Rust's string functions; where those read or cut text otherwise than
//! Python, a message holding such text would render to other tokens than the engine's,
//! and precise prefix routing would miss that request without an error anywhere. The
//! methods whose results differ are written here as Python defines them; the rest go to
//! `pycompat`:
//!
//! - white space is `str.isspace`: Unicode's, and the four separators U+001C to U+001F
//!   (`strip`, `lstrip`, `rstrip`, `split()`, `rsplit()`, the `trim` filter);
//! - `splitlines` breaks at `\r`, `\v`, `\f`, U+001C–U+001E, U+0085, U+2028 and U+2029
//!   as well as `\n` and `\r\n`;
//! - `find`, `rfind`, `index` and `rindex` count characters, not bytes; `count` of an
//!   empty string is the characters plus one (`pycompat`'s never returns);
//! - `split(sep, maxsplit)` keeps what follows the last cut whole, `split('')` raises as
//!   Python does, and `rsplit` exists;
//! - `title` starts a word after any character without case (digits too) and
//!   `capitalize` title-cases its first character (`ß` becomes `Ss`), as does the jinja2
//!   `capitalize` filter; jinja2's `title` filter starts words after white space and
//!   `-([{<` only;
//! - the `is...` tests are false for an empty string, and `islower`/`isupper` look only at
//!   characters with case (`"a1".islower()` is true).
//!
//! Left to `pycompat`, close but not the same: `isdigit`, `isnumeric`, `isalpha` and
//! `isalnum` of a non-empty string use Rust's Unicode classes (they differ from Python's
//! for some numerals and combining marks).

use minijinja::value::{Kwargs, from_args};
use minijinja::{Error, ErrorKind, State, Value};

use crate::or_keyword;

/// The environment's callback for methods minijinja does not have.
pub(crate) fn unknown_method(
    state: &mut State<'_, '_>,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(text) = value.as_str()
        && let Some(result) = string_method(text, method, args)?
    {
        return Ok(result);
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// `text.method(args)` where this module writes it; `None` for the methods it leaves to
/// `pycompat`.
fn string_method(text: &str, method: &str, args: &[Value]) -> Result<Option<Value>, Error> {
    Ok(Some(match method {
        "strip" | "lstrip" | "rstrip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            let ends = match method {
                "lstrip" => Ends::Start,
                "rstrip" => Ends::End,
                _ => Ends::Both,
            };
            Value::from(strip(text, chars, ends))
        }
        "split" | "rsplit" => {
            let (sep, maxsplit, kwargs): (Option<&str>, Option<i64>, Kwargs) = from_args(args)?;
            let sep = or_keyword(sep, &kwargs, "sep")?;
            let maxsplit = or_keyword(maxsplit, &kwargs, "maxsplit")?;
            kwargs.assert_all_used()?;
            // Python's -1 (or any negative number): no limit.
            let limit = maxsplit.and_then(|n| usize::try_from(n).ok());
            let parts = match (sep, method) {
                (Some(""), _) => return Err(invalid("empty separator")),
                (Some(sep), "split") => split_at(text, sep, limit),
                (Some(sep), _) => rsplit_at(text, sep, limit),
                (None, "split") => split_space(text, limit),
                (None, _) => rsplit_space(text, limit),
            };
            Value::from_iter(parts.into_iter().map(Value::from))
        }
        "splitlines" => {
            let (keepends, kwargs): (Option<bool>, Kwargs) = from_args(args)?;
            let keepends = or_keyword(keepends, &kwargs, "keepends")?.unwrap_or(false);
            kwargs.assert_all_used()?;
            Value::from_iter(splitlines(text, keepends).into_iter().map(Value::from))
        }
        "count" => {
            let (sub,): (&str,) = from_args(args)?;
            Value::from(count(text, sub))
        }
        "find" | "rfind" | "index" | "rindex" => {
            let (sub,): (&str,) = from_args(args)?;
            let at = if method.starts_with('r') {
                text.rfind(sub)
            } else {
                text.find(sub)
            };
            match at {
                Some(at) => Value::from(text[..at].chars().count()),
                None if method.ends_with("find") => Value::from(-1),
                None => return Err(invalid("substring not found")),
            }
        }
        "title" => {
            let () = from_args(args)?;
            Value::from(title(text))
        }
        "capitalize" => {
            let () = from_args(args)?;
            Value::from(capitalize(text))
        }
        "center" => {
            let (width, fill): (i64, Option<&str>) = from_args(args)?;
            let mut fill = fill.unwrap_or(" ").chars();
            let (Some(fill), None) = (fill.next(), fill.next()) else {
                return Err(invalid(
                    "The fill character must be exactly one character long",
                ));
            };
            Value::from(center(text, width, fill))
        }
        "isspace" => {
            let () = from_args(args)?;
            Value::from(!text.is_empty() && text.chars().all(is_space))
        }
        "islower" | "isupper" => {
            let () = from_args(args)?;
            Value::from(cased_as(text, method == "islower"))
        }
        "isdigit" | "isnumeric" | "isalpha" | "isalnum" if text.is_empty() => {
            let () = from_args(args)?;
            Value::from(false)
        }
        _ => return Ok(None),
    }))
}

fn invalid(message: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.to_owned())
}

/// Python's `str.isspace` for one character: Unicode's white space and the four
/// information separators (U+001C to U+001F), which Python counts and Unicode does not.
pub(crate) fn is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

#[derive(Clone, Copy)]
pub(crate) enum Ends {
    Start,
    End,
    Both,
}

/// `strip`, `lstrip`, `rstrip`: the characters of `chars`, or Python's white space.
pub(crate) fn strip<'a>(text: &'a str, chars: Option<&str>, ends: Ends) -> &'a str {
    let strips = |c: char| match chars {
        Some(chars) => chars.contains(c),
        None => is_space(c),
    };
    match ends {
        Ends::Start => text.trim_start_matches(strips),
        Ends::End => text.trim_end_matches(strips),
        Ends::Both => text.trim_matches(strips),
    }
}

/// Python's `str.strip()`, for the continuation's cut.
pub(crate) fn python_strip(text: &str) -> &str {
    strip(text, None, Ends::Both)
}

/// `text.split(sep, maxsplit)`: at most `limit` cuts, the rest whole.
fn split_at<'a>(text: &'a str, sep: &str, limit: Option<usize>) -> Vec<&'a str> {
    match limit {
        Some(cuts) => text.splitn(cuts + 1, sep).collect(),
        None => text.split(sep).collect(),
    }
}

/// `text.rsplit(sep, maxsplit)`: the cuts counted from the end.
fn rsplit_at<'a>(text: &'a str, sep: &str, limit: Option<usize>) -> Vec<&'a str> {
    let mut parts: Vec<&str> = match limit {
        Some(cuts) => text.rsplitn(cuts + 1, sep).collect(),
        None => text.rsplit(sep).collect(),
    };
    parts.reverse();
    parts
}

/// `text.split()`: the runs of non-space characters; after `limit` cuts, the rest from
/// the next word on, its trailing white space kept.
fn split_space(text: &str, limit: Option<usize>) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut rest = text.trim_start_matches(is_space);
    while !rest.is_empty() {
        if limit.is_some_and(|cuts| parts.len() == cuts) {
            parts.push(rest);
            break;
        }
        let end = rest.find(is_space).unwrap_or(rest.len());
        parts.push(&rest[..end]);
        rest = rest[end..].trim_start_matches(is_space);
    }
    parts
}

/// `text.rsplit()`: as `split()`, counted from the end (the rest's leading white space
/// kept).
fn rsplit_space(text: &str, limit: Option<usize>) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut rest = text.trim_end_matches(is_space);
    while !rest.is_empty() {
        if limit.is_some_and(|cuts| parts.len() == cuts) {
            parts.push(rest);
            break;
        }
        let start = rest
            .char_indices()
            .rev()
            .find(|&(_, c)| is_space(c))
            .map_or(0, |(at, c)| at + c.len_utf8());
        parts.push(&rest[start..]);
        rest = rest[..start].trim_end_matches(is_space);
    }
    parts.reverse();
    parts
}

/// Python's line boundaries (`str.splitlines`); `\r\n` is one.
fn is_line_break(c: char) -> bool {
    matches!(
        c,
        '\n' | '\r'
            | '\u{0b}'
            | '\u{0c}'
            | '\u{1c}'
            | '\u{1d}'
            | '\u{1e}'
            | '\u{85}'
            | '\u{2028}'
            | '\u{2029}'
    )
}

pub(crate) fn splitlines(text: &str, keepends: bool) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        if !is_line_break(c) {
            continue;
        }
        let mut end = at + c.len_utf8();
        if c == '\r' && chars.next_if(|&(_, next)| next == '\n').is_some() {
            end += 1;
        }
        lines.push(&text[start..if keepends { end } else { at }]);
        start = end;
    }
    if start < text.len() {
        lines.push(&text[start..]);
    }
    lines
}

/// `text.count(sub)`: occurrences that do not overlap; an empty `sub` is found before
/// every character and at the end.
fn count(text: &str, sub: &str) -> usize {
    if sub.is_empty() {
        text.chars().count() + 1
    } else {
        text.matches(sub).count()
    }
}

/// Python's notion of a character with case (Unicode's `Cased`).
fn is_cased(c: char) -> bool {
    c.is_lowercase() || c.is_uppercase() || is_titlecase(c)
}

/// The title-case letters (Unicode's `Lt`): neither lower nor upper case.
fn is_titlecase(c: char) -> bool {
    matches!(c,
        '\u{1c5}' | '\u{1c8}' | '\u{1cb}' | '\u{1f2}'
        | '\u{1f88}'..='\u{1f8f}' | '\u{1f98}'..='\u{1f9f}' | '\u{1fa8}'..='\u{1faf}'
        | '\u{1fbc}' | '\u{1fcc}' | '\u{1ffc}')
}

/// `islower` (`lower`) or `isupper`: some character with case, and every one of them in
/// that case.
fn cased_as(text: &str, lower: bool) -> bool {
    let mut cased = false;
    for c in text.chars() {
        let (this, other) = if lower {
            (c.is_lowercase(), c.is_uppercase())
        } else {
            (c.is_uppercase(), c.is_lowercase())
        };
        if other || is_titlecase(c) {
            return false;
        }
        cased |= this;
    }
    cased
}

/// One character in title case, as Python's `str.title` writes a word's first: the four
/// Latin digraphs have their own title-case letter, and where the upper case is several
/// letters (`ß`, the `ﬁ` ligatures) only the first is upper.
fn push_title(out: &mut String, c: char) {
    let digraph = match c {
        '\u{1c4}'..='\u{1c6}' => Some('\u{1c5}'),
        '\u{1c7}'..='\u{1c9}' => Some('\u{1c8}'),
        '\u{1ca}'..='\u{1cc}' => Some('\u{1cb}'),
        '\u{1f1}'..='\u{1f3}' => Some('\u{1f2}'),
        _ => None,
    };
    if let Some(title) = digraph {
        out.push(title);
        return;
    }
    let mut upper = c.to_uppercase();
    if let Some(first) = upper.next() {
        out.push(first);
    }
    out.extend(upper.flat_map(char::to_lowercase));
}

/// `str.title()`: a cased character after one without case starts a word.
fn title(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut after_cased = false;
    for c in text.chars() {
        if after_cased {
            out.extend(c.to_lowercase());
        } else {
            push_title(&mut out, c);
        }
        after_cased = is_cased(c);
    }
    out
}

/// `str.capitalize()`: the first character in title case, the rest in lower case (the
/// jinja2 filter `capitalize` calls it).
pub(crate) fn capitalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    if let Some(first) = chars.next() {
        push_title(&mut out, first);
    }
    for c in chars {
        out.extend(c.to_lowercase());
    }
    out
}

/// Python's `str.center(width, fill)`: `text` padded on both sides to `width` characters,
/// the odd one on the left when `width` is odd, else on the right (CPython's `pad`).
pub(crate) fn center(text: &str, width: i64, fill: char) -> String {
    let Ok(width) = usize::try_from(width) else {
        return text.to_owned();
    };
    let Some(margin) = width.checked_sub(text.chars().count()) else {
        return text.to_owned();
    };
    let left = margin / 2 + (margin & width & 1);
    let mut out = String::with_capacity(text.len() + margin * fill.len_utf8());
    out.extend(std::iter::repeat_n(fill, left));
    out.push_str(text);
    out.extend(std::iter::repeat_n(fill, margin - left));
    out
}

/// jinja2's `truncate(length=255, killwords=False, end='...', leeway=None)` with the
/// environment's default policy (a leeway of 5): text within `length + leeway` characters
/// is kept whole; longer text is cut to `length − len(end)` characters, back to its last
/// space unless `killwords`, and `end` appended.
pub(crate) fn truncate(
    text: &str,
    length: i64,
    killwords: bool,
    end: &str,
    leeway: i64,
) -> Result<String, Error> {
    let end_len = end.chars().count() as i64;
    if length < end_len {
        return Err(invalid(&format!(
            "expected length >= {end_len}, got {length}"
        )));
    }
    if leeway < 0 {
        return Err(invalid(&format!("expected leeway >= 0, got {leeway}")));
    }
    if text.chars().count() as i64 <= length.saturating_add(leeway) {
        return Ok(text.to_owned());
    }
    let keep = usize::try_from(length - end_len).unwrap_or(0);
    let head = match text.char_indices().nth(keep) {
        Some((at, _)) => &text[..at],
        None => text,
    };
    let head = if killwords {
        head
    } else {
        head.rsplit_once(' ').map_or(head, |(before, _)| before)
    };
    Ok(format!("{head}{end}"))
}

/// jinja2's `title` filter: each piece between runs of white space and `-([{<` with its
/// first character upper-cased (Python's `upper`, not title case) and the rest lowered.
pub(crate) fn title_filter(text: &str) -> String {
    let starts_word = |c: char| is_space(c) || matches!(c, '-' | '(' | '{' | '[' | '<');
    let mut out = String::with_capacity(text.len());
    let mut word_start = true;
    for c in text.chars() {
        if starts_word(c) {
            out.push(c);
            word_start = true;
        } else if word_start {
            out.extend(c.to_uppercase());
            word_start = false;
        } else {
            out.extend(c.to_lowercase());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The template `expression` of `text` (bound to `s`), rendered.
    fn eval(expression: &str, text: &str) -> String {
        crate::environment()
            .render_str(
                &format!("{{{{ {expression} }}}}"),
                minijinja::context! { s => text },
            )
            .unwrap_or_else(|error| format!("error: {error}"))
    }

    // Each expected value below is what CPython 3.11 prints for the same expression: the
    // crate's environment writes values as Python does.

    #[test]
    fn white_space_is_pythons() {
        let text = "\u{1c}\u{a0} a\u{1f}b \u{2003}\n";
        assert_eq!(eval("s.strip()", text), "a\u{1f}b");
        assert_eq!(eval("s.lstrip()", text), "a\u{1f}b \u{2003}\n");
        assert_eq!(eval("s.rstrip()", text), "\u{1c}\u{a0} a\u{1f}b");
        assert_eq!(
            eval("s.strip('\\n ')", text),
            "\u{1c}\u{a0} a\u{1f}b \u{2003}"
        );
        assert_eq!(eval("s.split()", text), "['a', 'b']");
        assert_eq!(eval("s.isspace()", "\u{1d}\t"), "True");
        assert_eq!(eval("s.isspace()", ""), "False");
        assert_eq!(python_strip("\u{1e} x \u{1e}"), "x");
    }

    #[test]
    fn split_and_rsplit_cut_as_python_does() {
        let text = "  a  b  c  ";
        assert_eq!(eval("s.split(None, 1)", text), "['a', 'b  c  ']");
        assert_eq!(eval("s.split(maxsplit=1)", text), "['a', 'b  c  ']");
        assert_eq!(eval("s.rsplit(None, 1)", text), "['  a  b', 'c']");
        assert_eq!(eval("s.split()", "   "), "[]");
        assert_eq!(eval("s.split(' ')", " a "), "['', 'a', '']");
        assert_eq!(eval("s.split('/', 1)", "a/b/c"), "['a', 'b/c']");
        assert_eq!(eval("s.rsplit('/', 1)", "a/b/c"), "['a/b', 'c']");
        assert_eq!(eval("s.split('/', -1)", "a/b/c"), "['a', 'b', 'c']");
        assert_eq!(eval("s.split(sep='</think>')[-1]", "x</think>y"), "y");
        assert_eq!(eval("s.split('/', 0)", "a/b"), "['a/b']");
        assert!(eval("s.split('')", "ab").contains("empty separator"));
    }

    #[test]
    fn lines_break_where_python_breaks_them() {
        let text = "a\rb\r\nc\u{2028}d\u{b}e\u{85}f\n";
        assert_eq!(
            eval("s.splitlines()", text),
            "['a', 'b', 'c', 'd', 'e', 'f']"
        );
        assert_eq!(
            eval("s.splitlines(True)", "a\r\nb\u{2029}c"),
            "['a\\r\\n', 'b\\u2029', 'c']"
        );
        assert_eq!(eval("s.splitlines(keepends=True)", "x\n"), "['x\\n']");
        assert_eq!(eval("s.splitlines()", ""), "[]");
        assert_eq!(eval("s.splitlines()", "\n"), "['']");
    }

    #[test]
    fn positions_count_characters_and_count_of_nothing_ends() {
        assert_eq!(eval("s.find('b')", "日本b日本b"), "2");
        assert_eq!(eval("s.rfind('b')", "日本b日本b"), "5");
        assert_eq!(eval("s.find('z')", "日本"), "-1");
        assert_eq!(eval("s.rfind('')", "日本"), "2");
        assert_eq!(eval("s.index('本')", "日本"), "1");
        assert!(eval("s.rindex('z')", "日本").contains("substring not found"));
        assert_eq!(eval("s.count('')", "日本"), "3");
        assert_eq!(eval("s.count('aa')", "aaaaa"), "2");
    }

    #[test]
    fn case_follows_python() {
        assert_eq!(eval("s.title()", "they're 1st ßig ǆ"), "They'Re 1St Ssig ǅ");
        assert_eq!(eval("s.capitalize()", "ßUPER ǆ"), "Ssuper ǆ");
        assert_eq!(
            eval("s|title", "they're o'neil-smith (ok) 1st"),
            "They're O'neil-Smith (Ok) 1st"
        );
        assert_eq!(eval("s.islower()", "a1 b"), "True");
        assert_eq!(eval("s.islower()", "1"), "False");
        assert_eq!(eval("s.isupper()", "A1 B"), "True");
        assert_eq!(eval("s.isupper()", "Aǅ"), "False");
        assert_eq!(eval("s.isdigit()", ""), "False");
        assert_eq!(eval("s.isascii()", ""), "True");
        // Left to pycompat.
        assert_eq!(eval("s.upper()", "straße"), "STRASSE");
    }
}
