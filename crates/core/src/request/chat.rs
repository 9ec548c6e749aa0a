//! `messages` of `/v1/chat/completions`: roles, text content and non-text parts.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::*;

/// `messages` of `/v1/chat/completions`: a non-empty array. `null` reads as absent.
pub(super) struct MessagesSeed;

impl<'de> DeserializeSeed<'de> for MessagesSeed {
    type Value = Option<Prompt>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Option<Prompt>, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed {
    type Value = Option<Prompt>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a non-empty array of messages")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<Prompt>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Prompt>, A::Error> {
        let mut prompt = Prompt::default();
        // One buffer for every message's content text, which may arrive before its role.
        let mut text = Prefix::new(0);
        let mut index = 0;
        while seq
            .next_element_seed(MessageSeed {
                prompt: &mut prompt,
                text: &mut text,
                index,
            })?
            .is_some()
        {
            index += 1;
        }
        if index == 0 {
            return Err(de::Error::invalid_length(0, &self));
        }
        Ok(Some(prompt))
    }
}

/// One chat message: `role` (required), `content`, `tool_calls`; other keys are ignored.
pub(super) struct MessageSeed<'a> {
    pub(super) prompt: &'a mut Prompt,
    pub(super) text: &'a mut Prefix,
    pub(super) index: usize,
}

impl<'de> DeserializeSeed<'de> for MessageSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "messages[{}] to be an object", self.index)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let index = self.index;
        // The message's share of the prompt prefix can be no more than what is left of it.
        let room = self.prompt.prefix.room();
        let mut content = Content {
            text: self.text,
            text_bytes: 0,
            non_text_parts: 0,
        };
        content.reset(room);
        let mut role = None;
        let mut tool_calls = 0;
        while let Some(key) = map.next_key_seed(KeySeed::<MessageKey>(PhantomData))? {
            match key {
                MessageKey::Role => {
                    role = Some(map.next_value_seed(HeadSeed(Place::Role { index }))?);
                }
                MessageKey::Content => {
                    content.reset(room);
                    map.next_value_seed(ContentSeed {
                        content: &mut content,
                        index,
                    })?;
                }
                MessageKey::ToolCalls => tool_calls = map.next_value::<JsonLen>()?.len,
                MessageKey::Ignored => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let Some(role) = role else {
            return Err(de::Error::custom(format_args!(
                "messages[{index}] has no `role`"
            )));
        };

        let prompt = self.prompt;
        prompt.add_tokens(MESSAGE_OVERHEAD_TOKENS);
        prompt.add_tokens(estimate_tokens(content.text_bytes));
        prompt.add_tokens(
            content
                .non_text_parts
                .saturating_mul(NON_TEXT_PART_TOKENS.into()),
        );
        prompt.add_tokens(estimate_tokens(tool_calls));
        prompt.prefix.push(&role.head);
        if content.text.pieces > 0 {
            prompt.prefix.push(&content.text.bytes);
        }
        Ok(())
    }
}

pub(super) enum MessageKey {
    Role,
    Content,
    ToolCalls,
    Ignored,
}

impl KeyName for MessageKey {
    fn from_name(name: &str) -> MessageKey {
        match name {
            "role" => MessageKey::Role,
            "content" => MessageKey::Content,
            "tool_calls" => MessageKey::ToolCalls,
            _ => MessageKey::Ignored,
        }
    }
}

/// The measure of one message's content: text parts (joined by `'\n'` into `text`, bounded)
/// and the count of non-text parts.
pub(super) struct Content<'t> {
    pub(super) text: &'t mut Prefix,
    pub(super) text_bytes: usize,
    pub(super) non_text_parts: u64,
}

impl Content<'_> {
    pub(super) fn reset(&mut self, room: usize) {
        self.text.reset(room);
        self.text_bytes = 0;
        self.non_text_parts = 0;
    }

    /// `len` is the full text length; `head` its first bytes, enough for the prefix.
    pub(super) fn add_text(&mut self, len: usize, head: &[u8]) {
        self.text_bytes = self.text_bytes.saturating_add(len);
        self.text.push(head);
    }

    /// A non-text part: counted for its tokens, and stood for in the prefix by a marker
    /// with its payload's digest, where the model sees it.
    pub(super) fn add_part(&mut self, payload_digest: u64) {
        self.non_text_parts += 1;
        let mut marker = *b"\0part:0000000000000000";
        for (index, slot) in marker[6..].iter_mut().enumerate() {
            let nibble = (payload_digest >> (60 - 4 * index)) & 0xf;
            *slot = b"0123456789abcdef"[nibble as usize];
        }
        self.text.push(&marker);
    }
}

/// `content` of a message: a string, `null`, or an array of content parts.
pub(super) struct ContentSeed<'a, 't> {
    pub(super) content: &'a mut Content<'t>,
    pub(super) index: usize,
}

impl<'de> DeserializeSeed<'de> for ContentSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "messages[{}].content to be a string, an array of content parts or null",
            self.index
        )
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<(), E> {
        self.content.add_text(text.len(), text.as_bytes());
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut part = 0;
        while seq
            .next_element_seed(PartSeed {
                content: &mut *self.content,
                message: self.index,
                part,
            })?
            .is_some()
        {
            part += 1;
        }
        Ok(())
    }
}

/// One content part. A part is text when its `type` is `"text"`, or when it has no `type` but a
/// `text` (vLLM infers the type from the keys); any other part counts as one non-text part.
pub(super) struct PartSeed<'a, 't> {
    pub(super) content: &'a mut Content<'t>,
    pub(super) message: usize,
    pub(super) part: usize,
}

impl<'de> DeserializeSeed<'de> for PartSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for PartSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "messages[{}].content[{}] to be a content part object",
            self.message, self.part
        )
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (message, part) = (self.message, self.part);
        let mut is_text = None;
        let mut text = None;
        // What the part carries besides its type and text (an image URL, audio data...),
        // digested without a copy: two different images must not read as one prefix.
        let mut payload = 0u64;
        while let Some(key) = map.next_key_seed(KeySeed::<PartKey>(PhantomData))? {
            match key {
                PartKey::Type => {
                    let kind = map.next_value_seed(HeadSeed(Place::PartType { message, part }))?;
                    is_text = Some(kind.head.as_ref() == b"text");
                }
                PartKey::Text => {
                    text = Some(map.next_value_seed(HeadSeed(Place::PartText { message, part }))?);
                }
                PartKey::Ignored => {
                    let value = map.next_value_seed(JsonLenVisitor {
                        top: false,
                        measure: false,
                    })?;
                    payload = mix(payload, value.digest);
                }
            }
        }
        match (is_text, text) {
            (Some(true) | None, Some(text)) => self.content.add_text(text.len, &text.head),
            (Some(true), None) => self.content.add_text(0, b""),
            _ => self.content.add_part(payload),
        }
        Ok(())
    }
}

pub(super) enum PartKey {
    Type,
    Text,
    Ignored,
}

impl KeyName for PartKey {
    fn from_name(name: &str) -> PartKey {
        match name {
            "type" => PartKey::Type,
            "text" => PartKey::Text,
            _ => PartKey::Ignored,
        }
    }
}

/// A string kept only as its length and first [`PROMPT_PREFIX_BYTES`] bytes: borrowed from the
/// body when it has no escapes, else a bounded copy.
pub(super) struct Head<'de> {
    pub(super) len: usize,
    pub(super) head: Cow<'de, [u8]>,
}

/// Where a [`Head`] is read, for error messages.
#[derive(Clone, Copy)]
pub(super) enum Place {
    Role { index: usize },
    PartType { message: usize, part: usize },
    PartText { message: usize, part: usize },
}

pub(super) struct HeadSeed(Place);

pub(super) fn head_of(bytes: &[u8]) -> &[u8] {
    bytes.get(..PROMPT_PREFIX_BYTES).unwrap_or(bytes)
}

impl<'de> DeserializeSeed<'de> for HeadSeed {
    type Value = Head<'de>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Head<'de>, D::Error> {
        de.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for HeadSeed {
    type Value = Head<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Place::Role { index } => write!(f, "messages[{index}].role to be a string"),
            Place::PartType { message, part } => {
                write!(f, "messages[{message}].content[{part}].type to be a string")
            }
            Place::PartText { message, part } => {
                write!(f, "messages[{message}].content[{part}].text to be a string")
            }
        }
    }

    fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Head<'de>, E> {
        Ok(Head {
            len: text.len(),
            head: Cow::Borrowed(head_of(text.as_bytes())),
        })
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Head<'de>, E> {
        Ok(Head {
            len: text.len(),
            head: Cow::Owned(head_of(text.as_bytes()).to_vec()),
        })
    }
}
