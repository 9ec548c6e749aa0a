//! `prompt` of `/v1/completions`: a string, a batch of strings, token ids, or batches of ids.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};

use super::*;

/// `prompt` of `/v1/completions`: a string, or a batch of strings, token ids or token id
/// arrays. `null` reads as absent.
pub(super) struct PromptSeed;

impl<'de> DeserializeSeed<'de> for PromptSeed {
    type Value = Option<Prompt>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Option<Prompt>, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed {
    type Value = Option<Prompt>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, an array of strings, an array of token ids or an array of arrays")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<Prompt>, E> {
        Ok(None)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Option<Prompt>, E> {
        let mut prompt = Prompt::default();
        prompt.add_text(text.as_bytes());
        Ok(Some(prompt))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Prompt>, A::Error> {
        let mut prompt = Prompt::default();
        let mut index = 0;
        while seq
            .next_element_seed(PromptItem {
                prompt: &mut prompt,
                index,
            })?
            .is_some()
        {
            index += 1;
        }
        Ok(Some(prompt))
    }
}

/// One element of a `prompt` array. Mixed arrays are measured too: shape rules beyond what the
/// estimate needs are the backend's to enforce.
pub(super) struct PromptItem<'a> {
    pub(super) prompt: &'a mut Prompt,
    pub(super) index: usize,
}

impl<'de> DeserializeSeed<'de> for PromptItem<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptItem<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "prompt[{}] to be a string, a token id or an array of token ids",
            self.index
        )
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<(), E> {
        if self.index == 0 {
            self.prompt.add_text(text.as_bytes());
        } else {
            self.prompt.add_tokens(estimate_tokens(text.len()));
        }
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _id: u64) -> Result<(), E> {
        self.prompt.add_tokens(1u32);
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _id: i64) -> Result<(), E> {
        self.prompt.add_tokens(1u32);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut ids = 0u64;
        while seq.next_element::<TokenId>()?.is_some() {
            ids += 1;
        }
        self.prompt.add_tokens(ids);
        Ok(())
    }
}

/// A token id: any integer (range checks are the backend's).
pub(super) struct TokenId;

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<TokenId, D::Error> {
        de.deserialize_any(TokenId)
    }
}

impl Visitor<'_> for TokenId {
    type Value = TokenId;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id (an integer)")
    }

    fn visit_u64<E: de::Error>(self, _id: u64) -> Result<TokenId, E> {
        Ok(TokenId)
    }

    fn visit_i64<E: de::Error>(self, _id: i64) -> Result<TokenId, E> {
        Ok(TokenId)
    }
}
