//! transformers' `continue_final_message`: the prompt ends inside the final message, so the
//! model continues it (a "prefill"). transformers appends a marker to the final message's
//! text (its last text part, where the content is a list), renders, and cuts the text at
//! the marker: right there where the template kept the marker's trailing space, else with
//! the whitespace before it stripped too (the template trimmed the content). The final
//! message's stripped text and the marker must both appear in the rendered text, or the
//! request is refused (the template dropped or rewrote them).

use crate::strings::{is_space, python_strip};

/// The marker transformers appends to the final message's text.
pub const CONTINUE_MARKER: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// The rendered text cut where the final message, whose text was `final_text` before
/// [`CONTINUE_MARKER`] was appended to it, continues; `None` where transformers refuses.
pub fn cut_at_marker(rendered: &str, final_text: &str) -> Option<String> {
    let marker = CONTINUE_MARKER.trim_end();
    if !rendered.contains(python_strip(final_text)) {
        return None;
    }
    let at = rendered.rfind(marker)?;
    if rendered[at..].starts_with(CONTINUE_MARKER) {
        Some(rendered[..at].to_owned())
    } else {
        Some(rendered[..at].trim_end_matches(is_space).to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_is_cut_at_the_marker_as_transformers_cuts_it() {
        let kept = format!("<s>user: hi</s><s>assistant: The answer is{CONTINUE_MARKER}</s>");
        assert_eq!(
            cut_at_marker(&kept, "The answer is").as_deref(),
            Some("<s>user: hi</s><s>assistant: The answer is")
        );
        // A template that trims the content drops the marker's space: whitespace before
        // the marker goes too.
        let trimmed = "assistant: The answer is \u{1f}CONTINUE_FINAL_MESSAGE_TAG</s>";
        assert_eq!(
            cut_at_marker(trimmed, "The answer is ").as_deref(),
            Some("assistant: The answer is")
        );
        // The last marker counts.
        let twice = format!("a{CONTINUE_MARKER}b{CONTINUE_MARKER}");
        assert_eq!(
            cut_at_marker(&twice, "b").as_deref(),
            Some(&*format!("a{CONTINUE_MARKER}b"))
        );
        // Refused where the template dropped the message or the marker.
        assert_eq!(cut_at_marker("assistant: </s>", "The answer"), None);
        assert_eq!(
            cut_at_marker("assistant: The answer</s>", "The answer"),
            None
        );
    }
}
