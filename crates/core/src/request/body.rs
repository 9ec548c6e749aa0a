//! The top-level request object: which fields are read, and how each is checked.

use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Unexpected, Visitor};

use super::*;

/// The top-level fields that matter; absent and `null` are both `None`.
#[derive(Default)]
pub(super) struct Fields {
    pub(super) model: Option<String>,
    pub(super) max_tokens: Option<u32>,
    pub(super) max_completion_tokens: Option<u32>,
    pub(super) stream: Option<bool>,
    pub(super) prompt: Option<Prompt>,
    pub(super) input: Option<Prompt>,
    pub(super) messages: Option<Prompt>,
    /// Compact JSON length and digest of `tools` and `functions` (chat only), zero when
    /// absent.
    pub(super) tools: JsonLen,
    pub(super) functions: JsonLen,
}

/// Reads the top-level object. `field` names the field being read, so that an error raised
/// inside it can be reported against it.
pub(super) struct BodySeed<'f> {
    pub(super) api: ApiKind,
    pub(super) field: &'f mut Option<&'static str>,
}

impl<'de> DeserializeSeed<'de> for BodySeed<'_> {
    type Value = Fields;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Fields, D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_> {
    type Value = Fields;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a request object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
        let mut fields = Fields::default();
        let chat = self.api == ApiKind::ChatCompletions;
        let other = self.api == ApiKind::Other;
        while let Some(key) = map.next_key_seed(KeySeed::<TopKey>(PhantomData))? {
            *self.field = key.name();
            match key {
                TopKey::Model => fields.model = map.next_value::<Option<ModelName>>()?.map(|m| m.0),
                TopKey::MaxTokens => {
                    fields.max_tokens = map.next_value::<Option<TokenLimit>>()?.map(|l| l.0);
                }
                TopKey::MaxCompletionTokens => {
                    fields.max_completion_tokens =
                        map.next_value::<Option<TokenLimit>>()?.map(|l| l.0);
                }
                TopKey::Stream => fields.stream = map.next_value()?,
                TopKey::Prompt if self.api == ApiKind::Completions => {
                    fields.prompt = map.next_value_seed(PromptSeed)?;
                }
                TopKey::Messages if chat => fields.messages = map.next_value_seed(MessagesSeed)?,
                TopKey::Tools if chat => fields.tools = map.next_value::<JsonLen>()?,
                TopKey::Functions if chat => fields.functions = map.next_value::<JsonLen>()?,
                TopKey::Prompt | TopKey::Input | TopKey::Messages if other => {
                    let mut prompt = Prompt::default();
                    let present = map.next_value_seed(LooseText {
                        prompt: &mut prompt,
                    })?;
                    let slot = match key {
                        TopKey::Prompt => &mut fields.prompt,
                        TopKey::Input => &mut fields.input,
                        _ => &mut fields.messages,
                    };
                    *slot = present.then_some(prompt);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            *self.field = None;
        }
        Ok(fields)
    }
}

/// An object key matched against the names a visitor cares about. Keys are only borrowed for
/// the match, so even escaped or huge unknown keys allocate nothing.
pub(super) trait KeyName: Sized {
    fn from_name(name: &str) -> Self;
}

pub(super) struct KeySeed<K>(pub(super) PhantomData<K>);

impl<'de, K: KeyName> DeserializeSeed<'de> for KeySeed<K> {
    type Value = K;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<K, D::Error> {
        de.deserialize_str(self)
    }
}

impl<K: KeyName> Visitor<'_> for KeySeed<K> {
    type Value = K;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<K, E> {
        Ok(K::from_name(name))
    }
}

#[derive(Clone, Copy)]
pub(super) enum TopKey {
    Model,
    MaxTokens,
    MaxCompletionTokens,
    Stream,
    Prompt,
    Input,
    Messages,
    Tools,
    Functions,
    Ignored,
}

impl KeyName for TopKey {
    fn from_name(name: &str) -> TopKey {
        match name {
            "model" => TopKey::Model,
            "max_tokens" => TopKey::MaxTokens,
            "max_completion_tokens" => TopKey::MaxCompletionTokens,
            "stream" => TopKey::Stream,
            "prompt" => TopKey::Prompt,
            "input" => TopKey::Input,
            "messages" => TopKey::Messages,
            "tools" => TopKey::Tools,
            "functions" => TopKey::Functions,
            _ => TopKey::Ignored,
        }
    }
}

impl TopKey {
    pub(super) fn name(self) -> Option<&'static str> {
        Some(match self {
            TopKey::Model => "model",
            TopKey::MaxTokens => "max_tokens",
            TopKey::MaxCompletionTokens => "max_completion_tokens",
            TopKey::Stream => "stream",
            TopKey::Prompt => "prompt",
            TopKey::Input => "input",
            TopKey::Messages => "messages",
            TopKey::Tools => "tools",
            TopKey::Functions => "functions",
            TopKey::Ignored => return None,
        })
    }
}

/// `model`: a non-empty string.
pub(super) struct ModelName(String);

impl<'de> Deserialize<'de> for ModelName {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<ModelName, D::Error> {
        de.deserialize_str(ModelNameVisitor)
    }
}

pub(super) struct ModelNameVisitor;

impl Visitor<'_> for ModelNameVisitor {
    type Value = ModelName;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a non-empty string")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<ModelName, E> {
        if name.is_empty() {
            return Err(E::invalid_value(Unexpected::Str(name), &self));
        }
        Ok(ModelName(name.to_owned()))
    }
}

/// `max_tokens` / `max_completion_tokens`: a non-negative integer, saturated to `u32`. JSON has
/// one number type, so integral floats (`100.0`, `1e3`) count as integers, as the backends'
/// validation also accepts them.
pub(super) struct TokenLimit(u32);

impl<'de> Deserialize<'de> for TokenLimit {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<TokenLimit, D::Error> {
        de.deserialize_any(TokenLimitVisitor)
    }
}

pub(super) struct TokenLimitVisitor;

impl Visitor<'_> for TokenLimitVisitor {
    type Value = TokenLimit;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a non-negative integer")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<TokenLimit, E> {
        Ok(TokenLimit(u32::try_from(v).unwrap_or(u32::MAX)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<TokenLimit, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(E::invalid_value(Unexpected::Signed(v), &self)),
        }
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<TokenLimit, E> {
        if v >= 0.0 && v.fract() == 0.0 {
            // `as` saturates float-to-int conversions, which is the rule for huge values.
            Ok(TokenLimit(v as u32))
        } else {
            Err(E::invalid_value(Unexpected::Float(v), &self))
        }
    }
}
