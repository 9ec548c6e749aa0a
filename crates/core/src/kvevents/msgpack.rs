//! A zero-copy MessagePack reader: just what decoding vLLM's KV event batches needs.
//!
//! vLLM encodes its batches with msgspec; a decoder that builds a generic value tree
//! (`rmpv::Value`) allocates once per token id, and a batch of a long prompt carries
//! thousands. This reader walks the bytes in place: scalars come out as they are read,
//! strings and binaries as slices of the input, and anything not needed is skipped
//! without being built.

use rmp::Marker;

/// Why a payload does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsgpackError {
    /// The payload ends inside a value.
    #[error("truncated at byte {0}")]
    Truncated(usize),
    /// A value of another type stands where `expected` was needed.
    #[error("expected {expected} at byte {at}, found {found}")]
    Type {
        /// What the schema needs there.
        expected: &'static str,
        /// What the payload has there.
        found: &'static str,
        /// Byte offset of the value.
        at: usize,
    },
    /// A string is not UTF-8.
    #[error("invalid UTF-8 in a string at byte {0}")]
    Utf8(usize),
    /// Arrays and maps nest deeper than any KV event does.
    #[error("nesting deeper than {MAX_DEPTH} at byte {0}")]
    TooDeep(usize),
}

/// Deepest nesting [`Reader::skip`] follows: KV events nest four levels (batch, events,
/// event, extra keys); a hostile payload must not recurse the stack away.
pub const MAX_DEPTH: usize = 32;

/// The type of the next value, as far as the decoder cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Nil => "nil",
            Kind::Bool => "bool",
            Kind::Int => "integer",
            Kind::Float => "float",
            Kind::Str => "string",
            Kind::Bin => "binary",
            Kind::Array => "array",
            Kind::Map => "map",
            Kind::Ext => "extension",
        }
    }
}

fn kind_of(marker: Marker) -> Kind {
    match marker {
        Marker::Null => Kind::Nil,
        Marker::True | Marker::False => Kind::Bool,
        Marker::FixPos(_)
        | Marker::FixNeg(_)
        | Marker::U8
        | Marker::U16
        | Marker::U32
        | Marker::U64
        | Marker::I8
        | Marker::I16
        | Marker::I32
        | Marker::I64 => Kind::Int,
        Marker::F32 | Marker::F64 => Kind::Float,
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => Kind::Str,
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => Kind::Bin,
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => Kind::Array,
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => Kind::Map,
        // 0xc1, never used: read as an extension so that it is skipped or refused by type.
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32
        | Marker::Reserved => Kind::Ext,
    }
}

/// A cursor over one MessagePack payload.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, at: 0 }
    }

    /// Byte offset of the next value.
    pub fn position(&self) -> usize {
        self.at
    }

    /// Whether every byte was read.
    pub fn is_at_end(&self) -> bool {
        self.at >= self.bytes.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or(MsgpackError::Truncated(self.at))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], MsgpackError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn peek_marker(&self) -> Result<Marker, MsgpackError> {
        self.bytes
            .get(self.at)
            .map(|&b| Marker::from_u8(b))
            .ok_or(MsgpackError::Truncated(self.at))
    }

    /// The type of the next value, without reading it.
    pub fn peek(&self) -> Result<Kind, MsgpackError> {
        self.peek_marker().map(kind_of)
    }

    fn mismatch<T>(&self, expected: &'static str) -> Result<T, MsgpackError> {
        let found = self.peek().map_or("nothing", Kind::name);
        Err(MsgpackError::Type {
            expected,
            found,
            at: self.at,
        })
    }

    /// Reads a nil if one is next; returns whether it did.
    pub fn nil(&mut self) -> Result<bool, MsgpackError> {
        if self.peek()? == Kind::Nil {
            self.at += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// An integer that fits `u64` (negative integers are refused).
    pub fn u64(&mut self) -> Result<u64, MsgpackError> {
        let start = self.at;
        let value: Option<u64> = match self.peek_marker()? {
            Marker::FixPos(v) => {
                self.at += 1;
                Some(u64::from(v))
            }
            Marker::U8 => {
                self.at += 1;
                Some(u64::from(u8::from_be_bytes(self.be()?)))
            }
            Marker::U16 => {
                self.at += 1;
                Some(u64::from(u16::from_be_bytes(self.be()?)))
            }
            Marker::U32 => {
                self.at += 1;
                Some(u64::from(u32::from_be_bytes(self.be()?)))
            }
            Marker::U64 => {
                self.at += 1;
                Some(u64::from_be_bytes(self.be()?))
            }
            // msgspec writes non-negative ints in the smallest unsigned form, but other
            // encoders may use signed markers for them.
            Marker::I8 => {
                self.at += 1;
                u64::try_from(i8::from_be_bytes(self.be()?)).ok()
            }
            Marker::I16 => {
                self.at += 1;
                u64::try_from(i16::from_be_bytes(self.be()?)).ok()
            }
            Marker::I32 => {
                self.at += 1;
                u64::try_from(i32::from_be_bytes(self.be()?)).ok()
            }
            Marker::I64 => {
                self.at += 1;
                u64::try_from(i64::from_be_bytes(self.be()?)).ok()
            }
            Marker::FixNeg(_) => None,
            _ => return self.mismatch("an unsigned integer"),
        };
        value.ok_or(MsgpackError::Type {
            expected: "an unsigned integer",
            found: "a negative integer",
            at: start,
        })
    }

    /// A float (or an integer, read as a float).
    pub fn f64(&mut self) -> Result<f64, MsgpackError> {
        match self.peek_marker()? {
            Marker::F32 => {
                self.at += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            Marker::F64 => {
                self.at += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            Marker::FixNeg(v) => {
                self.at += 1;
                Ok(f64::from(v))
            }
            _ if self.peek()? == Kind::Int => self.u64().map(|v| v as f64),
            _ => self.mismatch("a float"),
        }
    }

    /// A string, borrowed from the payload.
    pub fn str(&mut self) -> Result<&'a str, MsgpackError> {
        let len = match self.peek_marker()? {
            Marker::FixStr(n) => {
                self.at += 1;
                usize::from(n)
            }
            Marker::Str8 => {
                self.at += 1;
                usize::from(u8::from_be_bytes(self.be()?))
            }
            Marker::Str16 => {
                self.at += 1;
                usize::from(u16::from_be_bytes(self.be()?))
            }
            Marker::Str32 => {
                self.at += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.mismatch("a string"),
        };
        let start = self.at;
        std::str::from_utf8(self.take(len)?).map_err(|_| MsgpackError::Utf8(start))
    }

    /// A binary, borrowed from the payload.
    pub fn bin(&mut self) -> Result<&'a [u8], MsgpackError> {
        let len = match self.peek_marker()? {
            Marker::Bin8 => {
                self.at += 1;
                usize::from(u8::from_be_bytes(self.be()?))
            }
            Marker::Bin16 => {
                self.at += 1;
                usize::from(u16::from_be_bytes(self.be()?))
            }
            Marker::Bin32 => {
                self.at += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.mismatch("a binary"),
        };
        self.take(len)
    }

    /// The length of an array, whose items follow.
    pub fn array(&mut self) -> Result<usize, MsgpackError> {
        match self.peek_marker()? {
            Marker::FixArray(n) => {
                self.at += 1;
                Ok(usize::from(n))
            }
            Marker::Array16 => {
                self.at += 1;
                Ok(usize::from(u16::from_be_bytes(self.be()?)))
            }
            Marker::Array32 => {
                self.at += 1;
                Ok(u32::from_be_bytes(self.be()?) as usize)
            }
            _ => self.mismatch("an array"),
        }
    }

    /// The number of entries of a map, whose keys and values follow in turn.
    pub fn map(&mut self) -> Result<usize, MsgpackError> {
        match self.peek_marker()? {
            Marker::FixMap(n) => {
                self.at += 1;
                Ok(usize::from(n))
            }
            Marker::Map16 => {
                self.at += 1;
                Ok(usize::from(u16::from_be_bytes(self.be()?)))
            }
            Marker::Map32 => {
                self.at += 1;
                Ok(u32::from_be_bytes(self.be()?) as usize)
            }
            _ => self.mismatch("a map"),
        }
    }

    /// Skips the next value, whatever it is.
    pub fn skip(&mut self) -> Result<(), MsgpackError> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: usize) -> Result<(), MsgpackError> {
        if depth > MAX_DEPTH {
            return Err(MsgpackError::TooDeep(self.at));
        }
        let marker = self.peek_marker()?;
        match kind_of(marker) {
            Kind::Nil | Kind::Bool => {
                self.at += 1;
                Ok(())
            }
            Kind::Int => match marker {
                Marker::FixNeg(_) => {
                    self.at += 1;
                    Ok(())
                }
                Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => {
                    let width = match marker {
                        Marker::I8 => 1,
                        Marker::I16 => 2,
                        Marker::I32 => 4,
                        _ => 8,
                    };
                    self.take(1 + width).map(drop)
                }
                _ => self.u64().map(drop),
            },
            Kind::Float => self.f64().map(drop),
            Kind::Str => self.str().map(drop),
            Kind::Bin => self.bin().map(drop),
            Kind::Array => {
                let n = self.array()?;
                for _ in 0..n {
                    self.skip_at(depth + 1)?;
                }
                Ok(())
            }
            Kind::Map => {
                let n = self.map()?;
                for _ in 0..n {
                    self.skip_at(depth + 1)?;
                    self.skip_at(depth + 1)?;
                }
                Ok(())
            }
            Kind::Ext => {
                self.at += 1;
                let len = match marker {
                    Marker::FixExt1 => 1,
                    Marker::FixExt2 => 2,
                    Marker::FixExt4 => 4,
                    Marker::FixExt8 => 8,
                    Marker::FixExt16 => 16,
                    Marker::Ext8 => usize::from(u8::from_be_bytes(self.be()?)),
                    Marker::Ext16 => usize::from(u16::from_be_bytes(self.be()?)),
                    Marker::Ext32 => u32::from_be_bytes(self.be()?) as usize,
                    // The reserved byte carries nothing after it.
                    _ => return Ok(()),
                };
                // The type byte, then the data.
                self.take(1 + len).map(drop)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(write: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out);
        out
    }

    #[test]
    fn integers_of_every_width_read_back() {
        for value in [
            0u64,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u64::from(u32::MAX) + 1,
            u64::MAX,
        ] {
            let bytes = encoded(|out| {
                rmp::encode::write_uint(out, value).expect("vec write");
            });
            assert_eq!(Reader::new(&bytes).u64(), Ok(value), "{value}");
        }
        let bytes = encoded(|out| {
            rmp::encode::write_sint(out, -3).expect("vec write");
        });
        assert!(matches!(
            Reader::new(&bytes).u64(),
            Err(MsgpackError::Type { .. })
        ));
    }

    #[test]
    fn skip_passes_over_nested_values_and_extensions() {
        let bytes = encoded(|out| {
            rmp::encode::write_array_len(out, 3).expect("vec write");
            rmp::encode::write_map_len(out, 1).expect("vec write");
            rmp::encode::write_str(out, "k").expect("vec write");
            rmp::encode::write_f64(out, 1.5).expect("vec write");
            rmp::encode::write_ext_meta(out, 3, 7).expect("vec write");
            out.extend_from_slice(&[1, 2, 3]);
            rmp::encode::write_sint(out, -100_000).expect("vec write");
            rmp::encode::write_str(out, "after").expect("vec write");
        });
        let mut reader = Reader::new(&bytes);
        reader.skip().expect("skips");
        assert_eq!(reader.str(), Ok("after"));
        assert!(reader.is_at_end());
    }

    #[test]
    fn truncated_and_hostile_payloads_are_errors_not_panics() {
        let bytes = encoded(|out| {
            rmp::encode::write_array_len(out, 2).expect("vec write");
            rmp::encode::write_str(out, "abc").expect("vec write");
        });
        for end in 0..bytes.len() {
            assert!(Reader::new(&bytes[..end]).skip().is_err(), "{end}");
        }
        assert!(Reader::new(&bytes).skip().is_err(), "one item is missing");
        // A string claiming 4 GiB.
        assert_eq!(
            Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff]).str(),
            Err(MsgpackError::Truncated(5))
        );
        let deep = vec![0x91u8; 10_000];
        assert!(matches!(
            Reader::new(&deep).skip(),
            Err(MsgpackError::TooDeep(_))
        ));
    }
}
