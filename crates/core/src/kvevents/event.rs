//! vLLM's KV cache events, decoded from the msgpack payload of one published batch.
//!
//! vLLM (`vllm/distributed/kv_events.py`) encodes an `EventBatch` and its tagged events
//! with msgspec. Two wire shapes exist, and both are read:
//! - **maps** (current vLLM): a batch is `{"ts", "events", "data_parallel_rank"}` and an
//!   event `{"type": "BlockStored", "block_hashes": …}`; fields whose value is their
//!   default are left out (`omit_defaults`);
//! - **arrays** (vLLM releases whose structs were `array_like`): a batch is
//!   `[ts, events, (data_parallel_rank)]` and an event `["BlockStored", block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, (medium), (lora_name), …]`, each
//!   release appending fields at the end.
//!
//! Block hashes are unsigned 64-bit integers by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`)
//! or the raw hash bytes; bytes are read as the integer vLLM would have sent (their last
//! eight bytes, big-endian), so both settings give one identity.
//!
//! Fields and event types this code does not know are skipped: a newer vLLM adds fields,
//! and an older kvroute must keep indexing what it understands.

use super::msgpack::{Kind, MsgpackError, Reader};

/// One published batch: the events of one engine step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    /// When the engine published it (seconds since the epoch, the engine's clock).
    pub ts: f64,
    /// The events, in the order the engine made them.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank of the engine that published it, when stated.
    pub data_parallel_rank: Option<u32>,
}

/// One KV cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Full blocks entered the engine's prefix cache.
    BlockStored(BlockStored),
    /// Cached blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The engine dropped its whole prefix cache.
    AllBlocksCleared,
    /// An event type this version of kvroute does not know (a newer vLLM's): skipped.
    Other,
}

/// `BlockStored`: consecutive full blocks of one sequence, chained after `parent`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// The engine's hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<u64>,
    /// The engine's hash of the block before the first one; `None` at a sequence's start.
    pub parent_block_hash: Option<u64>,
    /// The blocks' token ids, concatenated (`block_size` per block).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter's integer id (older vLLM's only adapter field).
    pub lora_id: Option<u64>,
    /// The LoRA adapter's name (newer vLLM).
    pub lora_name: Option<String>,
    /// Where the blocks live (`"GPU"`, or an offloading tier); `None` from older vLLM.
    pub medium: Option<String>,
    /// Whether some block's hash has extra keys beyond the adapter's name (multimodal
    /// inputs, a cache salt, prompt embeddings): such blocks match only requests that
    /// carry the same keys, which kvroute cannot tell from the text.
    pub keyed: bool,
    /// The KV cache group (hybrid models have several); `None`: the only one.
    pub group_idx: Option<u32>,
}

/// `BlockRemoved`: blocks evicted from the prefix cache.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: Vec<u64>,
    /// Where they were evicted from; `None` from older vLLM.
    pub medium: Option<String>,
    /// The KV cache group; `None`: the only one.
    pub group_idx: Option<u32>,
}

/// Why a batch does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not MessagePack of the expected shape.
    #[error(transparent)]
    Msgpack(#[from] MsgpackError),
    /// A required field is missing from an event.
    #[error("{event} without {field}")]
    Missing {
        /// The event type.
        event: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// A value is out of range.
    #[error("{0}")]
    Invalid(&'static str),
    /// Bytes follow the batch.
    #[error("{0} bytes after the batch")]
    Trailing(usize),
}

/// Most events one batch may carry, and most items one list in it: a bound on what a
/// corrupt or hostile length prefix can make the decoder reserve.
const MAX_ITEMS: usize = 1 << 20;

/// Decodes one batch's payload (the third frame of a published message).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let batch = match r.peek()? {
        Kind::Map => batch_from_map(&mut r)?,
        _ => batch_from_array(&mut r)?,
    };
    if !r.is_at_end() {
        return Err(DecodeError::Trailing(payload.len() - r.position()));
    }
    Ok(batch)
}

fn batch_from_map(r: &mut Reader<'_>) -> Result<EventBatch, DecodeError> {
    let mut batch = EventBatch::default();
    for _ in 0..r.map()? {
        match r.str()? {
            "ts" => batch.ts = r.f64()?,
            "events" => batch.events = events(r)?,
            "data_parallel_rank" => batch.data_parallel_rank = opt_u32(r)?,
            _ => r.skip()?,
        }
    }
    Ok(batch)
}

fn batch_from_array(r: &mut Reader<'_>) -> Result<EventBatch, DecodeError> {
    let n = r.array()?;
    if n < 2 {
        return Err(DecodeError::Invalid("a batch array needs ts and events"));
    }
    let mut batch = EventBatch {
        ts: r.f64()?,
        events: events(r)?,
        data_parallel_rank: None,
    };
    if n > 2 {
        batch.data_parallel_rank = opt_u32(r)?;
    }
    for _ in 3..n {
        r.skip()?;
    }
    Ok(batch)
}

fn events(r: &mut Reader<'_>) -> Result<Vec<KvEvent>, DecodeError> {
    let n = bounded(r.array()?)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(match r.peek()? {
            Kind::Map => event_from_map(r)?,
            _ => event_from_array(r)?,
        });
    }
    Ok(out)
}

fn bounded(n: usize) -> Result<usize, DecodeError> {
    if n > MAX_ITEMS {
        return Err(DecodeError::Invalid("a list longer than 2^20 items"));
    }
    Ok(n)
}

/// The fields of a stored or removed event as they are read, before the event type (a
/// map's `type` key may come after them) says which are required.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<u64>,
    lora_name: Option<String>,
    medium: Option<String>,
    extra_keys: Option<ExtraKeys>,
    group_idx: Option<u32>,
}

/// What the per-block extra keys say: each block's keys, reduced to whether they hold
/// anything but strings (the adapter's name is a string), and the strings seen.
struct ExtraKeys {
    non_strings: bool,
    strings: Vec<String>,
}

impl Fields {
    fn read(&mut self, name: &str, r: &mut Reader<'_>) -> Result<(), DecodeError> {
        match name {
            "block_hashes" => self.block_hashes = Some(hashes(r)?),
            "parent_block_hash" => self.parent_block_hash = opt_hash(r)?,
            "token_ids" => self.token_ids = Some(tokens(r)?),
            "block_size" => {
                self.block_size = Some(
                    u32::try_from(r.u64()?)
                        .map_err(|_| DecodeError::Invalid("block_size over 2^32"))?,
                );
            }
            "lora_id" => self.lora_id = opt(r, Reader::u64)?,
            "lora_name" => self.lora_name = opt(r, Reader::str)?.map(str::to_owned),
            "medium" => self.medium = opt(r, Reader::str)?.map(str::to_owned),
            "extra_keys" => self.extra_keys = extra_keys(r)?,
            "group_idx" => self.group_idx = opt_u32(r)?,
            _ => r.skip()?,
        }
        Ok(())
    }

    fn into_event(self, tag: &str) -> Result<KvEvent, DecodeError> {
        match tag {
            "BlockStored" => {
                let event = "BlockStored";
                let missing = |field| DecodeError::Missing { event, field };
                let block_hashes = self.block_hashes.ok_or(missing("block_hashes"))?;
                let token_ids = self.token_ids.ok_or(missing("token_ids"))?;
                let block_size = self.block_size.ok_or(missing("block_size"))?;
                // Keys other than the adapter's own name change the blocks' hashes in a
                // way text cannot reproduce.
                let keyed = self.extra_keys.is_some_and(|keys| {
                    keys.non_strings
                        || keys
                            .strings
                            .iter()
                            .any(|s| Some(s.as_str()) != self.lora_name.as_deref())
                });
                Ok(KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash: self.parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id: self.lora_id,
                    lora_name: self.lora_name,
                    medium: self.medium,
                    keyed,
                    group_idx: self.group_idx,
                }))
            }
            "BlockRemoved" => Ok(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes.ok_or(DecodeError::Missing {
                    event: "BlockRemoved",
                    field: "block_hashes",
                })?,
                medium: self.medium,
                group_idx: self.group_idx,
            })),
            "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
            _ => Ok(KvEvent::Other),
        }
    }
}

fn event_from_map(r: &mut Reader<'_>) -> Result<KvEvent, DecodeError> {
    let mut tag = None;
    let mut fields = Fields::default();
    for _ in 0..r.map()? {
        match r.str()? {
            "type" => tag = Some(r.str()?),
            name => fields.read(name, r)?,
        }
    }
    let tag = tag.ok_or(DecodeError::Invalid("an event map without its type"))?;
    fields.into_event(tag)
}

/// Positional fields of the array-like events, in the order vLLM releases declared them.
const STORED_FIELDS: [&str; 9] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

fn event_from_array(r: &mut Reader<'_>) -> Result<KvEvent, DecodeError> {
    let n = r.array()?;
    if n == 0 {
        return Err(DecodeError::Invalid("an event array without its type"));
    }
    let tag = r.str()?;
    let names: &[&str] = match tag {
        "BlockStored" => &STORED_FIELDS,
        "BlockRemoved" => &REMOVED_FIELDS,
        _ => &[],
    };
    let mut fields = Fields::default();
    for i in 1..n {
        match names.get(i - 1) {
            Some(name) => fields.read(name, r)?,
            None => r.skip()?,
        }
    }
    fields.into_event(tag)
}

fn opt<'a, T>(
    r: &mut Reader<'a>,
    read: impl FnOnce(&mut Reader<'a>) -> Result<T, MsgpackError>,
) -> Result<Option<T>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    Ok(Some(read(r)?))
}

fn opt_u32(r: &mut Reader<'_>) -> Result<Option<u32>, DecodeError> {
    opt(r, Reader::u64)?
        .map(|v| u32::try_from(v).map_err(|_| DecodeError::Invalid("an index over 2^32")))
        .transpose()
}

/// A block hash: an integer, or the hash's bytes (read as vLLM's integer form).
fn hash(r: &mut Reader<'_>) -> Result<u64, DecodeError> {
    if r.peek()? == Kind::Bin {
        let bytes = r.bin()?;
        let tail = &bytes[bytes.len().saturating_sub(8)..];
        return Ok(tail.iter().fold(0u64, |h, &b| h << 8 | u64::from(b)));
    }
    Ok(r.u64()?)
}

fn opt_hash(r: &mut Reader<'_>) -> Result<Option<u64>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    hash(r).map(Some)
}

fn hashes(r: &mut Reader<'_>) -> Result<Vec<u64>, DecodeError> {
    let n = bounded(r.array()?)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(out)
}

fn tokens(r: &mut Reader<'_>) -> Result<Vec<u32>, DecodeError> {
    let n = bounded(r.array()?)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(
            u32::try_from(r.u64()?).map_err(|_| DecodeError::Invalid("a token id over 2^32"))?,
        );
    }
    Ok(out)
}

/// `extra_keys`: nil, or one entry per block, each nil or a tuple of keys.
fn extra_keys(r: &mut Reader<'_>) -> Result<Option<ExtraKeys>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    let mut keys = ExtraKeys {
        non_strings: false,
        strings: Vec::new(),
    };
    for _ in 0..bounded(r.array()?)? {
        if r.nil()? {
            continue;
        }
        for _ in 0..bounded(r.array()?)? {
            if r.peek()? == Kind::Str {
                let s = r.str()?;
                if !keys.strings.iter().any(|k| k == s) {
                    keys.strings.push(s.to_owned());
                }
            } else {
                keys.non_strings = true;
                r.skip()?;
            }
        }
    }
    Ok(Some(keys))
}
