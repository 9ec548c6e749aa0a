//! The compact JSON length of a value (`tools`, `functions`, `tool_calls`), measured
//! without building it.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// The length of a JSON value as serde_json would write it compactly (floats approximately),
/// measured without building it; `null` counts as 0 since nothing is sent to the model.
pub(super) struct JsonLen(pub(super) usize);

impl<'de> Deserialize<'de> for JsonLen {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<JsonLen, D::Error> {
        de.deserialize_any(JsonLenVisitor { top: true })
    }
}

pub(super) struct JsonLenVisitor {
    pub(super) top: bool,
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
        Ok(JsonLen(if self.top { 0 } else { "null".len() }))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<JsonLen, E> {
        Ok(JsonLen(if v { "true".len() } else { "false".len() }))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<JsonLen, E> {
        Ok(JsonLen(display_len(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<JsonLen, E> {
        Ok(JsonLen(display_len(v)))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<JsonLen, E> {
        Ok(JsonLen(display_len(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<JsonLen, E> {
        Ok(JsonLen(escaped_len(v).saturating_add(2)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<JsonLen, A::Error> {
        // `[` and `]`, plus a comma before every element but the first.
        let mut len = 2usize;
        let mut first = true;
        while let Some(JsonLen(item)) = seq.next_element_seed(JsonLenVisitor { top: false })? {
            len = len.saturating_add(item).saturating_add(usize::from(!first));
            first = false;
        }
        Ok(JsonLen(len))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonLen, A::Error> {
        // `{` and `}`, plus `key:value` per entry and a comma before every entry but the first.
        let mut len = 2usize;
        let mut first = true;
        while let Some(JsonLen(key)) = map.next_key_seed(JsonLenVisitor { top: false })? {
            let JsonLen(value) = map.next_value_seed(JsonLenVisitor { top: false })?;
            len = len
                .saturating_add(key)
                .saturating_add(1)
                .saturating_add(value)
                .saturating_add(usize::from(!first));
            first = false;
        }
        Ok(JsonLen(len))
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

pub(super) fn display_len(v: impl fmt::Display) -> usize {
    struct Counter(usize);
    impl fmt::Write for Counter {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            self.0 += s.len();
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // Counter never fails, so neither can the write.
    let _ = fmt::write(&mut counter, format_args!("{v}"));
    counter.0
}
