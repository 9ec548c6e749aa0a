//! The msgpack payload of one published batch, byte for byte what vLLM's msgspec encoder
//! writes (`vllm/distributed/kv_events.py`, vLLM 0.26 and main).
//!
//! - The batch (`KVEventBatch`, still `array_like`) is an array `[ts, events,
//!   data_parallel_rank]`: `ts` a float64 (seconds since the epoch), the rank an integer
//!   (the publisher fills it in, so it is never omitted).
//! - Each event (`KVCacheEvent`: `tag=True`, `omit_defaults=True`, no longer `array_like`
//!   since vllm-project/vllm#42892) is a map: `"type"` (the class name) first, then the
//!   fields in declaration order. Fields without a default are always written, `nil` when
//!   None; fields whose default is None are left out when None.
//! - `BlockStored`: `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`,
//!   `medium`, `lora_name`, `extra_keys` (one entry per block: `[lora_name]` for an adapter,
//!   nil for the base model, as `generate_block_hash_extra_keys` gives them), `group_idx`,
//!   `kv_cache_spec_kind` (`kv_cache_spec_sliding_window` is None for full attention, so
//!   omitted). `BlockRemoved`: `block_hashes`, `medium`, `group_idx`. `AllBlocksCleared`:
//!   only its tag.
//! - Block hashes are unsigned 64-bit integers (vLLM's default,
//!   `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`); integers take msgpack's shortest form, as
//!   msgspec writes them.
//!
//! Older vLLM releases made every struct `array_like`: an event was `["BlockStored",
//! block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`. The
//! simulator writes the current form only.

use std::convert::Infallible;

use rmp::encode::{self, ByteBuf, ValueWriteError};

use crate::engine::{BlockStored, KvCacheEvent, KvEventBatch};

/// Where the simulator's blocks live (vLLM's `MEDIUM_GPU`).
pub const MEDIUM_GPU: &str = "GPU";

/// The attention kind of the simulator's one KV cache group (vLLM's `KVCacheSpecKind`).
pub const KV_CACHE_SPEC_KIND: &str = "full_attention";

/// The simulator's one KV cache group.
pub const GROUP_IDX: u64 = 0;

/// A batch that msgpack cannot carry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A list longer than msgpack's 32-bit lengths.
    #[error("{what} has {len} items, more than msgpack can count")]
    TooLong {
        /// Which list.
        what: &'static str,
        /// Its length.
        len: usize,
    },
}

/// Encodes `batch` as vLLM's `KVEventBatch`, published at `ts` by data-parallel rank
/// `data_parallel_rank`.
pub fn encode_batch(
    batch: &KvEventBatch,
    ts: f64,
    data_parallel_rank: u32,
) -> Result<Vec<u8>, WireError> {
    let mut w = Writer(ByteBuf::with_capacity(64 + 8 * batch.events.len()));
    w.array("a batch", 3)?;
    w.f64(ts);
    w.array("a batch's events", batch.events.len())?;
    for event in &batch.events {
        match event {
            KvCacheEvent::BlockStored(stored) => w.block_stored(stored)?,
            KvCacheEvent::BlockRemoved { block_hashes } => {
                w.map(4);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.uints("block_hashes", block_hashes.iter().copied())?;
                w.str("medium");
                w.str(MEDIUM_GPU);
                w.str("group_idx");
                w.uint(GROUP_IDX);
            }
            KvCacheEvent::AllBlocksCleared => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
        }
    }
    w.uint(u64::from(data_parallel_rank));
    Ok(w.0.into_vec())
}

/// A msgpack writer into memory (which cannot fail).
struct Writer(ByteBuf);

/// The value of a write into memory: its error type is uninhabited.
fn written<T>(result: Result<T, ValueWriteError<Infallible>>) -> T {
    match result {
        Ok(value) => value,
        Err(
            ValueWriteError::InvalidMarkerWrite(never) | ValueWriteError::InvalidDataWrite(never),
        ) => match never {},
    }
}

impl Writer {
    fn block_stored(&mut self, s: &BlockStored) -> Result<(), WireError> {
        self.map(11);
        self.str("type");
        self.str("BlockStored");
        self.str("block_hashes");
        self.uints("block_hashes", s.block_hashes.iter().copied())?;
        self.str("parent_block_hash");
        match s.parent_block_hash {
            Some(h) => self.uint(h),
            None => self.nil(),
        }
        self.str("token_ids");
        self.uints("token_ids", s.token_ids.iter().map(|&t| u64::from(t)))?;
        self.str("block_size");
        self.uint(u64::from(s.block_size));
        self.str("lora_id");
        match &s.lora {
            Some(lora) => self.uint(u64::from(lora.id)),
            None => self.nil(),
        }
        self.str("medium");
        self.str(MEDIUM_GPU);
        self.str("lora_name");
        match &s.lora {
            Some(lora) => self.str(&lora.name),
            None => self.nil(),
        }
        self.str("extra_keys");
        self.array("extra_keys", s.block_hashes.len())?;
        for _ in &s.block_hashes {
            match &s.lora {
                Some(lora) => {
                    self.array("an extra key", 1)?;
                    self.str(&lora.name);
                }
                None => self.nil(),
            }
        }
        self.str("group_idx");
        self.uint(GROUP_IDX);
        self.str("kv_cache_spec_kind");
        self.str(KV_CACHE_SPEC_KIND);
        Ok(())
    }

    fn array(&mut self, what: &'static str, len: usize) -> Result<(), WireError> {
        let n = u32::try_from(len).map_err(|_| WireError::TooLong { what, len })?;
        written(encode::write_array_len(&mut self.0, n));
        Ok(())
    }

    fn uints(
        &mut self,
        what: &'static str,
        values: impl ExactSizeIterator<Item = u64>,
    ) -> Result<(), WireError> {
        self.array(what, values.len())?;
        for v in values {
            self.uint(v);
        }
        Ok(())
    }

    /// A map of a fixed, small number of fields.
    fn map(&mut self, fields: u32) {
        written(encode::write_map_len(&mut self.0, fields));
    }

    fn str(&mut self, s: &str) {
        written(encode::write_str(&mut self.0, s));
    }

    fn uint(&mut self, v: u64) {
        written(encode::write_uint(&mut self.0, v));
    }

    fn f64(&mut self, v: f64) {
        written(encode::write_f64(&mut self.0, v));
    }

    fn nil(&mut self) {
        match encode::write_nil(&mut self.0) {
            Ok(()) => {}
            Err(never) => match never {},
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::engine::StoredLora;

    /// A msgpack fixstr, written out by hand.
    fn fixstr(s: &str) -> Vec<u8> {
        assert!(s.len() < 32);
        let mut out = vec![0xa0 | s.len() as u8];
        out.extend_from_slice(s.as_bytes());
        out
    }

    fn concat(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    #[test]
    fn a_batch_is_written_as_vllms_msgspec_writes_it() {
        let batch = KvEventBatch {
            at: Duration::from_secs(3),
            events: vec![
                KvCacheEvent::BlockStored(BlockStored {
                    block_hashes: vec![5, u64::MAX],
                    parent_block_hash: None,
                    token_ids: vec![7, 300, 70_000, 1],
                    block_size: 2,
                    lora: Some(StoredLora {
                        id: 1,
                        name: "sql".into(),
                    }),
                }),
                KvCacheEvent::BlockRemoved {
                    block_hashes: vec![200],
                },
                KvCacheEvent::AllBlocksCleared,
            ],
        };
        let bytes = encode_batch(&batch, 1.5, 0).expect("encodes");

        let stored = concat(&[
            &[0x8b], // a map of 11 fields
            &fixstr("type"),
            &fixstr("BlockStored"),
            &fixstr("block_hashes"),
            &[
                0x92, 0x05, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            ],
            &fixstr("parent_block_hash"),
            &[0xc0],
            &fixstr("token_ids"),
            // 7, then 300 as uint16, 70000 as uint32, 1
            &[
                0x94, 0x07, 0xcd, 0x01, 0x2c, 0xce, 0x00, 0x01, 0x11, 0x70, 0x01,
            ],
            &fixstr("block_size"),
            &[0x02],
            &fixstr("lora_id"),
            &[0x01],
            &fixstr("medium"),
            &fixstr("GPU"),
            &fixstr("lora_name"),
            &fixstr("sql"),
            &fixstr("extra_keys"),
            &[0x92, 0x91],
            &fixstr("sql"),
            &[0x91],
            &fixstr("sql"),
            &fixstr("group_idx"),
            &[0x00],
            &fixstr("kv_cache_spec_kind"),
            &fixstr("full_attention"),
        ]);
        let removed = concat(&[
            &[0x84],
            &fixstr("type"),
            &fixstr("BlockRemoved"),
            &fixstr("block_hashes"),
            &[0x91, 0xcc, 0xc8],
            &fixstr("medium"),
            &fixstr("GPU"),
            &fixstr("group_idx"),
            &[0x00],
        ]);
        let cleared = concat(&[&[0x81], &fixstr("type"), &fixstr("AllBlocksCleared")]);
        let expected = concat(&[
            &[0x93], // [ts, events, data_parallel_rank]
            &[0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0],
            &[0x93],
            &stored,
            &removed,
            &cleared,
            &[0x00],
        ]);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn a_base_model_block_has_nil_adapter_fields_and_a_nil_extra_key_per_block() {
        let batch = KvEventBatch {
            at: Duration::ZERO,
            events: vec![KvCacheEvent::BlockStored(BlockStored {
                block_hashes: vec![1, 2],
                parent_block_hash: Some(9),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora: None,
            })],
        };
        let bytes = encode_batch(&batch, 0.0, 3).expect("encodes");
        let fields = concat(&[
            &fixstr("parent_block_hash"),
            &[0x09],
            &fixstr("token_ids"),
            &[0x94, 1, 2, 3, 4],
            &fixstr("block_size"),
            &[0x02],
            &fixstr("lora_id"),
            &[0xc0],
            &fixstr("medium"),
            &fixstr("GPU"),
            &fixstr("lora_name"),
            &[0xc0],
            &fixstr("extra_keys"),
            &[0x92, 0xc0, 0xc0],
        ]);
        assert!(
            bytes.windows(fields.len()).any(|w| w == fields.as_slice()),
            "{bytes:02x?}"
        );
        assert_eq!(bytes.last(), Some(&0x03), "the rank closes the batch");
    }
}
