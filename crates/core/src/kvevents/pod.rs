//! One pod's event stream applied to a prefix index: the engine's block hashes become
//! kvroute's token-chain hashes, sequence numbers are checked for gaps.
//!
//! # Why kvroute rehashes the tokens
//! An engine's block hash depends on its hash function and seed (`--prefix-caching-hash-algo`,
//! `PYTHONHASHSEED`), which a router cannot know. The events carry each block's token ids,
//! so kvroute chains its own hash over them ([`chain`]), exactly as it does for a request's
//! tokens: equal chains mean equal token prefixes under the same adapter, whatever the
//! engine's hash. The engine's hash is kept only to resolve later events that name it (a
//! child's parent, a removal), in a map from engine hash to kvroute's.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::net::SocketAddr;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::event::{BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::fleet::{IdentityHasher, PrefixIndex};

/// Seeds the root of every chain, so token chains never collide with the approximate
/// index's text chains.
const ROOT_SEED: u64 = 0x6b76_726f_7574_6531;

/// The hash of the empty prefix of a sequence under `adapter` (`None`: the base model).
pub fn chain_root(adapter: Option<&str>) -> u64 {
    xxh3_64_with_seed(adapter.unwrap_or("").as_bytes(), ROOT_SEED)
}

/// The hash of the prefix `parent` followed by one block of tokens.
pub fn chain(parent: u64, block: &[u32]) -> u64 {
    // Hash the tokens' little-endian bytes; a block is 16 tokens in practice, so one
    // stack buffer serves, and longer blocks go through the loop in pieces.
    let mut buf = [0u8; 256];
    let mut hash = parent;
    for piece in block.chunks(buf.len() / 4) {
        for (bytes, token) in buf.chunks_exact_mut(4).zip(piece) {
            bytes.copy_from_slice(&token.to_le_bytes());
        }
        hash = xxh3_64_with_seed(&buf[..piece.len() * 4], hash);
    }
    hash
}

/// The chained hashes of a request's full blocks of `block_size` tokens under `adapter`:
/// what [`PodEvents`] puts in the index for the same tokens.
pub fn token_block_hashes(adapter: Option<&str>, tokens: &[u32], block_size: u32) -> Vec<u64> {
    let mut parent = chain_root(adapter);
    tokens
        .chunks_exact(block_size.max(1) as usize)
        .map(|block| {
            parent = chain(parent, block);
            parent
        })
        .collect()
}

/// Where a stream's blocks go as they are stored and evicted.
pub trait BlockSink {
    /// Blocks (kvroute's chain hashes) the engine now holds.
    fn store(&mut self, chains: &[u64]);
    /// Blocks it no longer holds.
    fn evict(&mut self, chains: &[u64]);
}

/// A pod's blocks in the event index, straight from its one engine's stream.
#[derive(Debug)]
pub struct IndexSink<'a> {
    pub index: &'a PrefixIndex,
    pub endpoint: SocketAddr,
    /// The pod's KV pool in tokens (0: unknown), which bounds what the index keeps of it.
    pub capacity_tokens: u64,
}

impl BlockSink for IndexSink<'_> {
    fn store(&mut self, chains: &[u64]) {
        self.index
            .record(self.endpoint, chains, self.capacity_tokens);
    }

    fn evict(&mut self, chains: &[u64]) {
        self.index.forget(self.endpoint, chains);
    }
}

/// The blocks of a data-parallel pod, whose engines publish one stream each: a block is
/// the pod's while any of its engines holds it, so each is counted over the engines and
/// enters or leaves the index only with its first holder or its last.
#[derive(Debug, Default)]
pub struct EngineCounts {
    counts: HashMap<u64, u32, BuildHasherDefault<IdentityHasher>>,
}

impl EngineCounts {
    /// A sink that counts blocks here and passes the pod's changes on to `index`.
    pub fn sink<'a>(&'a mut self, index: IndexSink<'a>) -> CountedSink<'a> {
        CountedSink {
            counts: &mut self.counts,
            index,
        }
    }
}

/// [`EngineCounts::sink`].
#[derive(Debug)]
pub struct CountedSink<'a> {
    counts: &'a mut HashMap<u64, u32, BuildHasherDefault<IdentityHasher>>,
    index: IndexSink<'a>,
}

impl BlockSink for CountedSink<'_> {
    fn store(&mut self, chains: &[u64]) {
        let first: Vec<u64> = chains
            .iter()
            .copied()
            .filter(|chain| {
                let count = self.counts.entry(*chain).or_insert(0);
                *count += 1;
                *count == 1
            })
            .collect();
        self.index.store(&first);
    }

    fn evict(&mut self, chains: &[u64]) {
        let mut last = Vec::new();
        for chain in chains {
            if let std::collections::hash_map::Entry::Occupied(mut count) =
                self.counts.entry(*chain)
            {
                *count.get_mut() -= 1;
                if *count.get() == 0 {
                    count.remove();
                    last.push(*chain);
                }
            }
        }
        self.index.evict(&last);
    }
}

/// Where an arriving sequence number stands against those applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sequence {
    /// The first batch seen, or the one after the last applied: apply it.
    Next,
    /// Batches `missing_from..seq` never arrived: replay them first.
    Gap {
        /// The first missing sequence number.
        missing_from: u64,
    },
    /// Already applied (a replay overlapping the live stream): drop it.
    Seen,
}

/// What applying batches did, for telemetry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Blocks that entered the index.
    pub stored: u64,
    /// Blocks that left it.
    pub removed: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
    /// Blocks left out on purpose: another medium or cache group, extra hash keys, or an
    /// adapter named only by id.
    pub skipped: u64,
    /// Blocks whose parent kvroute never saw stored (events before it subscribed, or a
    /// skipped parent): they cannot be matched from a request's tokens.
    pub unresolved: u64,
    /// Events of a type kvroute does not know.
    pub unknown: u64,
    /// Events that contradict themselves (token count against block count).
    pub malformed: u64,
}

impl std::ops::AddAssign for Applied {
    fn add_assign(&mut self, o: Applied) {
        self.stored += o.stored;
        self.removed += o.removed;
        self.cleared += o.cleared;
        self.skipped += o.skipped;
        self.unresolved += o.unresolved;
        self.unknown += o.unknown;
        self.malformed += o.malformed;
    }
}

/// A block the engine holds, as kvroute indexes it.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// kvroute's chain hash of the block.
    chain: u64,
    /// How many copies the engine reported stored and not yet removed: vLLM can cache
    /// two physical blocks under one hash (two requests computing the same prefix at
    /// once) and reports each store and each eviction.
    copies: u32,
}

/// The event state of one engine of one pod: what it holds, by engine hash, and the
/// sequence number expected next.
#[derive(Default)]
pub struct PodEvents {
    held: HashMap<u64, Held, BuildHasherDefault<IdentityHasher>>,
    next_seq: Option<u64>,
}

impl std::fmt::Debug for PodEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodEvents")
            .field("held", &self.held.len())
            .field("next_seq", &self.next_seq)
            .finish()
    }
}

impl PodEvents {
    /// A pod never heard from.
    pub fn new() -> Self {
        PodEvents::default()
    }

    /// Blocks held (indexed) now.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The sequence number expected next; `None` before the first batch.
    pub fn next_seq(&self) -> Option<u64> {
        self.next_seq
    }

    /// Where `seq` stands; does not change the state ([`PodEvents::apply`] does). Before
    /// any batch, a publisher's first (0) is next, and a later one follows a gap: what
    /// came before it may still be in the publisher's replay buffer.
    pub fn sequence(&self, seq: u64) -> Sequence {
        match self.next_seq {
            None if seq == 0 => Sequence::Next,
            None => Sequence::Gap { missing_from: 0 },
            Some(next) if seq == next => Sequence::Next,
            Some(next) if seq < next => Sequence::Seen,
            Some(next) => Sequence::Gap { missing_from: next },
        }
    }

    /// Takes batch `seq` as the next one whatever came before: the missing batches cannot
    /// be had (the caller dropped what they may have changed, [`PodEvents::reset`]).
    pub fn rebase(&mut self, seq: u64) {
        self.next_seq = Some(seq);
    }

    /// Applies batch `seq` to `sink` (the index, for one pod), and expects `seq + 1` next.
    pub fn apply(&mut self, seq: u64, batch: &EventBatch, sink: &mut impl BlockSink) -> Applied {
        let mut applied = Applied::default();
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(stored) => self.store(stored, sink, &mut applied),
                KvEvent::BlockRemoved(removed) => self.remove(removed, sink, &mut applied),
                KvEvent::AllBlocksCleared => {
                    applied.cleared += 1;
                    applied.removed += self.clear(sink);
                }
                KvEvent::Other => applied.unknown += 1,
            }
        }
        self.next_seq = Some(seq.saturating_add(1));
        applied
    }

    /// Forgets everything the engine held (its stream broke beyond repair, or it left), so
    /// the index never claims blocks that may be gone; the next batch starts afresh.
    pub fn reset(&mut self, sink: &mut impl BlockSink) -> u64 {
        self.next_seq = None;
        self.clear(sink)
    }

    fn clear(&mut self, sink: &mut impl BlockSink) -> u64 {
        let chains: Vec<u64> = self.held.drain().map(|(_, held)| held.chain).collect();
        sink.evict(&chains);
        chains.len() as u64
    }

    fn store(&mut self, stored: &BlockStored, sink: &mut impl BlockSink, applied: &mut Applied) {
        let blocks = stored.block_hashes.len() as u64;
        let gpu = stored.medium.as_deref().is_none_or(|m| m == "GPU");
        let adapter_unnamed = stored.lora_id.is_some() && stored.lora_name.is_none();
        if !gpu || stored.group_idx.is_some_and(|g| g != 0) || stored.keyed || adapter_unnamed {
            applied.skipped += blocks;
            return;
        }
        let size = stored.block_size as usize;
        if size == 0 || stored.token_ids.len() != size * stored.block_hashes.len() {
            applied.malformed += 1;
            return;
        }
        let mut parent = match stored.parent_block_hash {
            None => chain_root(stored.lora_name.as_deref()),
            Some(hash) => match self.held.get(&hash) {
                Some(held) => held.chain,
                None => {
                    applied.unresolved += blocks;
                    return;
                }
            },
        };
        let mut new = Vec::with_capacity(stored.block_hashes.len());
        for (&hash, tokens) in stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(size))
        {
            parent = chain(parent, tokens);
            let held = self.held.entry(hash).or_insert(Held {
                chain: parent,
                copies: 0,
            });
            held.copies = held.copies.saturating_add(1);
            // A second copy under a known hash changes nothing the index sees; the
            // chain recorded first stays (the tokens are the same by the hash's
            // definition).
            if held.copies == 1 {
                new.push(parent);
            }
        }
        applied.stored += new.len() as u64;
        sink.store(&new);
    }

    fn remove(&mut self, removed: &BlockRemoved, sink: &mut impl BlockSink, applied: &mut Applied) {
        let gpu = removed.medium.as_deref().is_none_or(|m| m == "GPU");
        if !gpu || removed.group_idx.is_some_and(|g| g != 0) {
            return;
        }
        let mut gone = Vec::new();
        for hash in &removed.block_hashes {
            let std::collections::hash_map::Entry::Occupied(mut entry) = self.held.entry(*hash)
            else {
                continue;
            };
            let held = entry.get_mut();
            held.copies -= 1;
            if held.copies == 0 {
                gone.push(entry.remove().chain);
            }
        }
        applied.removed += gone.len() as u64;
        sink.evict(&gone);
    }
}
