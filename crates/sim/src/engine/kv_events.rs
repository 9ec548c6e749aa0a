//! KV cache events, recorded as vLLM's `BlockPool` records them (`vllm/v1/core/block_pool.py`)
//! and drained once per engine step as vLLM's `EngineCore` drains `scheduler.take_events()`.
//!
//! Off by default and then costless (one `Option` test where a block is registered or
//! evicted). When on, the engine records:
//! - [`KvCacheEvent::BlockStored`] when a request's newly full blocks are registered in the
//!   prefix cache: one event per request per step (`cache_full_blocks`), with the new blocks'
//!   hashes, the hash of the block before them (none for a request's first block), their token
//!   ids concatenated, and the request's adapter;
//! - [`KvCacheEvent::BlockRemoved`] when allocation takes a free block that still carried a
//!   registered hash (`_maybe_evict_cached_block`): one event per evicted block;
//! - [`KvCacheEvent::AllBlocksCleared`] when [`Engine::reset_prefix_cache`] succeeds.
//!
//! The events of one step (the evictions made while scheduling it and the blocks it filled)
//! form one [`KvEventBatch`] stamped with the step's end; steps that touch no cached block
//! make no batch, as vLLM publishes nothing for them. Every block announced as stored is
//! announced as removed exactly once when it is evicted (or cleared by a reset).
//!
//! The block hashes are this engine's chained hashes (`crate::kv::block_hash`), not vLLM's
//! SHA-256 ones: a consumer that indexes by `token_ids` sees the same thing from both.

use super::{Engine, Seq, SimTime};

/// One KV cache event (vLLM's `KVCacheEvent` subclasses in `vllm/distributed/kv_events.py`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvCacheEvent {
    /// Full blocks of one request were registered in the prefix cache.
    BlockStored(BlockStored),
    /// A registered block lost its hash to eviction.
    BlockRemoved {
        /// The evicted hash (vLLM announces one block per event).
        block_hashes: Vec<u64>,
    },
    /// Every registered hash was forgotten (a prefix cache reset).
    AllBlocksCleared,
}

/// vLLM's `BlockStored`, less the fields that are constant in this simulator (the wire adds
/// them: medium, KV cache group, attention kind).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    /// The newly registered blocks' hashes, in prompt order.
    pub block_hashes: Vec<u64>,
    /// The hash of the block before the first one; None when the first one starts the prompt.
    pub parent_block_hash: Option<u64>,
    /// The blocks' tokens, concatenated (`block_size` per block).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The adapter the blocks were computed with; None for the base model.
    pub lora: Option<StoredLora>,
}

/// The adapter of a [`BlockStored`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredLora {
    /// vLLM's `lora_id` (`lora_int_id`): 1-based, in the order this engine first saw the
    /// adapter, as vLLM numbers adapters in the order it loads them.
    pub id: u32,
    /// vLLM's `lora_name`: the adapter's name, which vLLM also puts in the block hash.
    pub name: String,
}

/// The events of one engine step (vLLM publishes each as one `KVEventBatch`).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Simulated time the step ended (or the reset happened).
    pub at: SimTime,
    /// In the order they happened.
    pub events: Vec<KvCacheEvent>,
}

/// What the engine keeps while events are on.
#[derive(Debug, Default)]
pub(super) struct KvEventLog {
    /// Events of the step in progress.
    pending: Vec<KvCacheEvent>,
    /// Closed batches not yet taken.
    batches: Vec<KvEventBatch>,
}

impl KvEventLog {
    pub(super) fn push(&mut self, event: KvCacheEvent) {
        self.pending.push(event);
    }

    /// Closes the step's batch, if it has events.
    pub(super) fn close(&mut self, at: SimTime) {
        if !self.pending.is_empty() {
            let events = std::mem::take(&mut self.pending);
            self.batches.push(KvEventBatch { at, events });
        }
    }
}

/// The `BlockStored` of `seq`'s blocks `first..end` (a request's blocks just registered).
pub(super) fn stored(
    seq: &Seq,
    first: usize,
    end: usize,
    block_size: u32,
    lora: Option<StoredLora>,
) -> KvCacheEvent {
    let bs = block_size as usize;
    let block_hashes = seq.hashes.get(first..end).unwrap_or_default().to_vec();
    let token_ids = seq
        .tokens
        .get(first * bs..end * bs)
        .unwrap_or_default()
        .to_vec();
    let parent_block_hash = first
        .checked_sub(1)
        .and_then(|i| seq.hashes.get(i))
        .copied();
    KvCacheEvent::BlockStored(BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora,
    })
}

impl Engine {
    /// Switches KV cache event recording on or off (off drops what was not taken). Like vLLM,
    /// an engine without prefix caching registers no blocks and so records nothing.
    pub fn set_kv_events(&mut self, on: bool) {
        if !on || !self.cfg.enable_prefix_caching {
            self.kv_events = None;
        } else if self.kv_events.is_none() {
            self.kv_events = Some(KvEventLog::default());
        }
    }

    /// Whether KV cache events are being recorded.
    pub fn kv_events_enabled(&self) -> bool {
        self.kv_events.is_some()
    }

    /// Moves the batches of the steps completed so far into `out`, oldest first: call it
    /// after [`Engine::advance`] (or any call that advances) to publish them.
    pub fn take_kv_events(&mut self, out: &mut Vec<KvEventBatch>) {
        if let Some(log) = self.kv_events.as_mut() {
            out.append(&mut log.batches);
        }
    }

    /// Forgets every cached prefix (vLLM's `reset_prefix_cache`, used after a weight update):
    /// at `now`, and only if no request holds a block; returns whether it did. Records
    /// [`KvCacheEvent::AllBlocksCleared`] in a batch of its own at once (vLLM publishes it with
    /// the next step).
    pub fn reset_prefix_cache(&mut self, now: SimTime) -> bool {
        self.advance(now);
        if !self.pool.reset_prefix_cache() {
            return false;
        }
        if let Some(log) = self.kv_events.as_mut() {
            log.push(KvCacheEvent::AllBlocksCleared);
            log.close(self.clock);
        }
        true
    }

    /// Records that allocation took a block that carried `evicted`.
    pub(super) fn note_eviction(&mut self, evicted: Option<u64>) {
        if let (Some(hash), Some(log)) = (evicted, self.kv_events.as_mut()) {
            log.push(KvCacheEvent::BlockRemoved {
                block_hashes: vec![hash],
            });
        }
    }

    /// Closes the batch of the step that ended at `at`.
    pub(super) fn close_kv_batch(&mut self, at: SimTime) {
        if let Some(log) = self.kv_events.as_mut() {
            log.close(at);
        }
    }
}
