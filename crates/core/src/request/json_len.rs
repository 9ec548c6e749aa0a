//! The compact JSON length of a value (`tools`, `functions`, `tool_calls`), measured
//! without building it, and a digest of its content.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The length of a JSON value as serde_json would write it compactly (floats approximately),
/// measured without building it; `null` counts as 0 since nothing is sent to the model. With
/// it, a digest of the value's content (order-sensitive, blind to whitespace), so that two
/// requests whose `tools` or media differ do not pass for sharing a prompt prefix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct JsonLen {
    pub(super) len: usize,
    pub(super) digest: u64,
}

impl<'de> Deserialize<'de> for JsonLen {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<JsonLen, D::Error> {
        de.deserialize_any(JsonLenVisitor {
            top: true,
            measure: true,
        })
    }
}

/// Reads a value for its [`JsonLen`]; with `measure` off only the digest is computed (media
/// payloads of megabytes need no length).
pub(super) struct JsonLenVisitor {
    pub(super) top: bool,
    pub(super) measure: bool,
}

impl JsonLenVisitor {
    fn inner(&self) -> JsonLenVisitor {
        JsonLenVisitor {
            top: false,
            measure: self.measure,
        }
    }
}

/// Digest seeds per kind of JSON value, so `"1"` and `1` differ.
const STRING: u64 = 1;
const NUMBER: u64 = 2;
const TRUE: u64 = 3;
const FALSE: u64 = 4;
const NULL: u64 = 5;
const ARRAY: u64 = 6;
const OBJECT: u64 = 7;

/// Chains `value` into `digest`.
pub(super) fn mix(digest: u64, value: u64) -> u64 {
    xxh3_64_with_seed(&value.to_le_bytes(), digest)
}

fn number(v: impl fmt::Display) -> JsonLen {
    // The text's first 40 bytes and its length tell numbers apart (f64 prints without an
    // exponent, so 1e300 is 301 digits long).
    let mut text = SmallText::default();
    let _ = fmt::write(&mut text, format_args!("{v}"));
    JsonLen {
        len: text.len,
        digest: mix(xxh3_64_with_seed(text.kept(), NUMBER), text.len as u64),
    }
}

impl<'de> DeserializeSeed<'de> for JsonLenVisitor {
    type Value = JsonLen;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<JsonLen, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for JsonLenVisitor {
    type Value = JsonLen;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<JsonLen, E> {
        Ok(JsonLen {
            len: if self.top { 0 } else { "null".len() },
            digest: if self.top { 0 } else { NULL },
        })
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<JsonLen, E> {
        Ok(JsonLen {
            len: if v { "true".len() } else { "false".len() },
            digest: if v { TRUE } else { FALSE },
        })
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<JsonLen, E> {
        Ok(number(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<JsonLen, E> {
        Ok(number(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<JsonLen, E> {
        Ok(number(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<JsonLen, E> {
        let len = if self.measure {
            escaped_len(v).saturating_add(2)
        } else {
            0
        };
        Ok(JsonLen {
            len,
            digest: xxh3_64_with_seed(v.as_bytes(), STRING),
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<JsonLen, A::Error> {
        // `[` and `]`, plus a comma before every element but the first.
        let mut total = JsonLen {
            len: 2,
            digest: ARRAY,
        };
        let mut first = true;
        while let Some(item) = seq.next_element_seed(self.inner())? {
            total.len = total
                .len
                .saturating_add(item.len)
                .saturating_add(usize::from(!first));
            total.digest = mix(total.digest, item.digest);
            first = false;
        }
        Ok(total)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonLen, A::Error> {
        // `{` and `}`, plus `key:value` per entry and a comma before every entry but the first.
        let mut total = JsonLen {
            len: 2,
            digest: OBJECT,
        };
        let mut first = true;
        while let Some(key) = map.next_key_seed(self.inner())? {
            let value = map.next_value_seed(self.inner())?;
            total.len = total
                .len
                .saturating_add(key.len)
                .saturating_add(1)
                .saturating_add(value.len)
                .saturating_add(usize::from(!first));
            total.digest = mix(mix(total.digest, key.digest), value.digest);
            first = false;
        }
        Ok(total)
    }
}

/// A number's text on the stack: its first 40 bytes, and its whole length.
struct SmallText {
    bytes: [u8; 40],
    len: usize,
}

impl Default for SmallText {
    fn default() -> Self {
        SmallText {
            bytes: [0; 40],
            len: 0,
        }
    }
}

impl SmallText {
    fn kept(&self) -> &[u8] {
        &self.bytes[..self.len.min(self.bytes.len())]
    }
}

impl fmt::Write for SmallText {
    /// Keeps what fits, counts everything.
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let start = self.len.min(self.bytes.len());
        let kept = s.len().min(self.bytes.len() - start);
        self.bytes[start..start + kept].copy_from_slice(&s.as_bytes()[..kept]);
        self.len = self.len.saturating_add(s.len());
        Ok(())
    }
}

/// The length of a string's JSON escaping, without quotes.
pub(super) fn escaped_len(s: &str) -> usize {
    s.bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\x08' | b'\x0c' | b'\n' | b'\r' | b'\t' => 2,
            0..=0x1f => 6, // \u00XX
            _ => 1,
        })
        .sum()
}
