//! What kvroute reads from a chat template's source before rendering it: how the
//! messages' content is handed over (vLLM decides it from the template's loops), and the
//! transformers-only tags it rewrites for minijinja.

/// `source` as minijinja must read it to render what jinja2 renders in transformers:
/// its string literals decoded as Python decodes them, `{% generation %}` blocks known.
pub fn template_source(source: &str) -> String {
    with_python_string_escapes(&without_generation_tags(source))
}

/// One `{% ... %}` statement's text, without its whitespace-control marks.
fn statements(source: &str) -> impl Iterator<Item = &str> {
    let mut rest = source;
    std::iter::from_fn(move || {
        let start = rest.find("{%")?;
        let after = &rest[start + 2..];
        let end = after.find("%}").unwrap_or(after.len());
        let statement = after[..end]
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        rest = &after[end..];
        Some(statement)
    })
}

/// Whether the template loops over a message's content, as vLLM detects it from the
/// template (its "openai" content format then hands the template the list of parts;
/// otherwise one string, "string"): a `for` over `M['content']` or `M.content`, where `M`
/// is the target of a `for` over `messages` or over a variable set from it (each possibly
/// sliced or filtered). Loops over anything else that merely mentions the content (its
/// lines, a variable holding it) are not that.
pub fn loops_over_content(source: &str) -> bool {
    let mut loops: Vec<(&str, &str)> = Vec::new();
    let mut assignments: Vec<(&str, &str)> = Vec::new();
    for statement in statements(source) {
        if let Some(head) = statement.strip_prefix("for ")
            && let Some((target, iterable)) = split_top_level(head, " in ")
        {
            loops.push((target.trim(), loop_iterable(iterable)));
        } else if let Some(head) = statement.strip_prefix("set ")
            && let Some((target, value)) = split_top_level(head, "=")
        {
            assignments.push((target.trim(), value));
        }
    }
    // `messages`, and every variable set from it, transitively.
    let mut lists = vec!["messages"];
    let mut next = 0;
    while let Some(&list) = lists.get(next) {
        for &(target, value) in &assignments {
            if is_name(target) && !lists.contains(&target) && elements_of(value) == list {
                lists.push(target);
            }
        }
        next += 1;
    }
    let messages: Vec<&str> = loops
        .iter()
        .filter(|(target, iterable)| is_name(target) && lists.contains(&elements_of(iterable)))
        .map(|(target, _)| *target)
        .collect();
    loops.iter().any(|(_, iterable)| {
        let iterable = elements_of(iterable);
        messages.iter().any(|message| {
            iterable
                .strip_prefix(message)
                .is_some_and(|key| matches!(key, "['content']" | "[\"content\"]" | ".content"))
        })
    })
}

/// A `for` loop's iterable without the loop's own `if` filter or `recursive`.
fn loop_iterable(iterable: &str) -> &str {
    let iterable = split_top_level(iterable, " if ").map_or(iterable, |(before, _)| before);
    let iterable = iterable.trim();
    iterable
        .strip_suffix(" recursive")
        .unwrap_or(iterable)
        .trim()
}

/// The expression whose elements `expression` yields, as vLLM's detection follows it:
/// filters (`x | reverse`) and slices (`x[1:]`) are looked through.
fn elements_of(expression: &str) -> &str {
    let mut expression = split_top_level(expression, "|")
        .map_or(expression, |(before, _)| before)
        .trim();
    while let Some(inner) = expression.strip_suffix(']')
        && let Some(open) = matching_open(inner)
        && split_top_level(&inner[open + 1..], ":").is_some()
    {
        expression = inner[..open].trim_end();
    }
    expression
}

/// Where the `[` that the `]` ending `text]` closes opens.
fn matching_open(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (at, c) in text.char_indices().rev() {
        match c {
            ']' | ')' => depth += 1,
            '[' if depth == 0 => return Some(at),
            '[' | '(' => depth = depth.checked_sub(1)?,
            _ => {}
        }
    }
    None
}

/// `text` split at the first `separator` outside brackets, parentheses and quotes.
fn split_top_level<'a>(text: &'a str, separator: &str) -> Option<(&'a str, &'a str)> {
    let (mut depth, mut quote) = (0usize, None);
    for (at, c) in text.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '(' | '[' | '{') => depth += 1,
            (None, ')' | ']' | '}') => depth = depth.saturating_sub(1),
            (None, _) if depth == 0 && text[at..].starts_with(separator) => {
                return Some((&text[..at], &text[at + separator.len()..]));
            }
            _ => {}
        }
    }
    None
}

fn is_name(text: &str) -> bool {
    !text.is_empty() && text.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// `source` with transformers' `{% generation %}` blocks (which mark the assistant's
/// tokens for training masks, and render their body unchanged) as `{% if true %}`
/// blocks, which minijinja knows and which trim whitespace as the tags did.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("%}") else {
            break;
        };
        let inner = &after[..end];
        let left = if inner.starts_with(['-', '+']) {
            &inner[..1]
        } else {
            ""
        };
        let right = if inner.ends_with(['-', '+']) {
            &inner[inner.len() - 1..]
        } else {
            ""
        };
        let word = inner[left.len()..inner.len() - right.len()].trim();
        let replacement = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        out.push_str(&rest[..start]);
        match replacement {
            Some(statement) => out.push_str(&format!("{{%{left} {statement} {right}%}}")),
            None => out.push_str(&rest[start..start + 2 + end + 2]),
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

/// `source` with its string literals' escapes that Python reads and minijinja does not
/// rewritten as minijinja reads them (jinja2 decodes a literal as Python does): a
/// backslash before a line break continues the line (Mistral's templates cut their
/// long system prompts so), `\a` and `\v` are a bell and a vertical tab, `\/` is two
/// characters, `\UXXXXXXXX` is one. Text outside `{{ }}` and `{% %}` is left alone.
fn with_python_string_escapes(source: &str) -> String {
    #[derive(Clone, Copy, PartialEq)]
    enum At {
        Text,
        Comment,
        Tag(&'static str),
        Literal(&'static str, char),
    }
    let mut out = String::with_capacity(source.len());
    let mut at = At::Text;
    let mut rest = source;
    while let Some(c) = rest.chars().next() {
        let mut taken = c.len_utf8();
        match at {
            At::Text => {
                for (open, next) in [
                    ("{{", At::Tag("}}")),
                    ("{%", At::Tag("%}")),
                    ("{#", At::Comment),
                ] {
                    if rest.starts_with(open) {
                        at = next;
                        taken = 2;
                    }
                }
                out.push_str(&rest[..taken]);
            }
            At::Comment => {
                if rest.starts_with("#}") {
                    at = At::Text;
                    taken = 2;
                }
                out.push_str(&rest[..taken]);
            }
            At::Tag(close) => {
                if rest.starts_with(close) {
                    at = At::Text;
                    taken = 2;
                } else if c == '\'' || c == '"' {
                    at = At::Literal(close, c);
                }
                out.push_str(&rest[..taken]);
            }
            At::Literal(close, quote) => {
                if c == quote {
                    at = At::Tag(close);
                    out.push(c);
                } else if c == '\\' {
                    let escape = &rest[1..];
                    taken = 1 + escape.chars().next().map_or(0, char::len_utf8);
                    match escape.chars().next() {
                        Some('\n') => {}
                        Some('\r') if escape[1..].starts_with('\n') => taken += 1,
                        Some('\r') => {}
                        Some('a') => out.push_str("\\x07"),
                        Some('v') => out.push_str("\\x0b"),
                        Some('/') => out.push_str("\\\\/"),
                        Some('U') => match escape
                            .get(1..9)
                            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
                            .and_then(char::from_u32)
                        {
                            Some(c) => {
                                for unit in c.encode_utf16(&mut [0; 2]) {
                                    out.push_str(&format!("\\u{unit:04x}"));
                                }
                                taken += 8;
                            }
                            None => out.push_str(&rest[..taken]),
                        },
                        _ => out.push_str(&rest[..taken]),
                    }
                } else {
                    out.push(c);
                }
            }
        }
        rest = &rest[taken..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_a_list_of_parts_only_where_a_loop_walks_a_messages_content() {
        for (template, parts) in [
            // The loops of the multimodal templates.
            (
                "{% for message in messages %}{% for item in message['content'] %}{% endfor %}{% endfor %}",
                true,
            ),
            (
                "{%- for m in messages -%}{%- for c in m.content | selectattr('type') -%}{%- endfor -%}{%- endfor -%}",
                true,
            ),
            (
                "{%- set loop_messages = messages[1:] %}{% for message in loop_messages if message.role != 'system' %}\
                 {% for part in message[\"content\"] %}{% endfor %}{% endfor %}",
                true,
            ),
            (
                "{% for message in messages[::-1] %}{% for part in message.content[1:] %}{% endfor %}{% endfor %}",
                true,
            ),
            // Loops that only mention the content.
            (
                "{% for message in messages %}{% for line in message['content'].split('\\n') %}{% endfor %}{% endfor %}",
                false,
            ),
            (
                "{% for message in messages %}{% set content = message['content'] %}{% for c in content %}{% endfor %}{% endfor %}",
                false,
            ),
            (
                "{% for tool in tools %}{% for x in tool.content %}{% endfor %}{% endfor %}",
                false,
            ),
            ("{{ messages[0]['content'] }}", false),
        ] {
            assert_eq!(loops_over_content(template), parts, "{template}");
        }
    }

    #[test]
    fn string_literals_read_as_python_reads_them() {
        assert_eq!(
            with_python_string_escapes(
                "a\\\n{{ 'b\\\nc\\\r\nd' }}\\\n{% set x = \"\\a\\v\\/\\U0001F600\\n\\\\\" %}{# '\\\n #}"
            ),
            "a\\\n{{ 'bcd' }}\\\n{% set x = \"\\x07\\x0b\\\\/\\ud83d\\ude00\\n\\\\\" %}{# '\\\n #}"
        );
        // A quote inside the other quotes does not end the literal.
        assert_eq!(
            with_python_string_escapes("{{ \"it's \\\n\" }}"),
            "{{ \"it's \" }}"
        );
    }

    #[test]
    fn generation_tags_become_blocks_that_keep_their_whitespace_control() {
        assert_eq!(
            without_generation_tags("a{%- generation %}b{% endgeneration -%}c{%generation%}"),
            "a{%- if true %}b{% endif -%}c{% if true %}"
        );
        assert_eq!(
            without_generation_tags("{{ x }}{% if y %}"),
            "{{ x }}{% if y %}"
        );
    }
}
