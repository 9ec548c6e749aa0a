//! Prompt-like fields of the other APIs (`/v1/embeddings`, `/v1/responses`, ...): every
//! string counts as text, every number as a token id.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::*;

/// A field of an API this module does not model: every string in it counts as text (a `data:`
/// URL as one non-text part), every number as one token id; keys and literals count nothing.
/// Nothing here is an error, so unfamiliar shapes never turn valid traffic away. The value is
/// `false` for `null`, which reads as absent.
pub(super) struct LooseText<'a> {
    pub(super) prompt: &'a mut Prompt,
}

impl<'de> DeserializeSeed<'de> for LooseText<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<bool, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for LooseText<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_bool<E: de::Error>(self, _v: bool) -> Result<bool, E> {
        Ok(true)
    }

    fn visit_u64<E: de::Error>(self, _v: u64) -> Result<bool, E> {
        self.prompt.add_tokens(1u32);
        Ok(true)
    }

    fn visit_i64<E: de::Error>(self, _v: i64) -> Result<bool, E> {
        self.prompt.add_tokens(1u32);
        Ok(true)
    }

    fn visit_f64<E: de::Error>(self, _v: f64) -> Result<bool, E> {
        self.prompt.add_tokens(1u32);
        Ok(true)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<bool, E> {
        if text.starts_with("data:") {
            self.prompt.add_tokens(NON_TEXT_PART_TOKENS);
        } else {
            self.prompt.add_text(text.as_bytes());
        }
        Ok(true)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        let prompt = self.prompt;
        while seq
            .next_element_seed(LooseText {
                prompt: &mut *prompt,
            })?
            .is_some()
        {}
        Ok(true)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        let prompt = self.prompt;
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(LooseText {
                prompt: &mut *prompt,
            })?;
        }
        Ok(true)
    }
}
