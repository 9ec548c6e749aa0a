//! KV block pool with vLLM-style automatic prefix caching.
//!
//! Blocks hold `block_size` tokens. A full block is identified by a chained hash
//! (`hash(parent hash, its tokens, extra key)`, the extra key being the LoRA adapter), so a block
//! can be shared only by sequences whose whole prefix up to it is identical. Blocks whose reference
//! count drops to zero go to the tail of a free queue but keep their hash: they stay reusable
//! until allocation pops them from the head (least recently freed first) and evicts the hash.
//! As in vLLM, usage counts cached-but-unreferenced blocks as free.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A hasher for the engine's integer keys (request ids, chained block hashes): one
/// multiply per word. The maps it keys are never iterated, so it changes no result; with
/// the two changes beside it (a binary search per histogram observation, output token ids
/// looked up) it took a quarter off an offline simulation of 1,000 pods
/// (docs/performance.md, "Offline simulation").
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

/// A map keyed by integers, hashed with [`IntHasher`].
pub(crate) type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// Tokens hashed in one call of [`block_hash`]: vLLM's block sizes (up to 64) in one.
const HASHED_TOKENS: usize = 64;

/// Chained hash of one full block of tokens: xxh3 of the tokens' bytes, seeded with the
/// parent's hash and the extra key. (A multiply-mix per token, as before, was a seventh of
/// a 1,000-pod simulation's loop: sixteen dependent rounds a block. Only equality of these
/// hashes matters: they name blocks in the pool and in KV events, whose subscribers chain
/// the token ids themselves.)
pub fn block_hash(parent: u64, tokens: &[u32], extra: u64) -> u64 {
    let mut h = mix(parent ^ 0x9e37_79b9_7f4a_7c15, extra);
    let mut bytes = [0u8; 4 * HASHED_TOKENS];
    for chunk in tokens.chunks(HASHED_TOKENS) {
        for (to, token) in bytes.chunks_exact_mut(4).zip(chunk) {
            to.copy_from_slice(&token.to_le_bytes());
        }
        h = xxh3_64_with_seed(&bytes[..4 * chunk.len()], h);
    }
    h
}

/// A small, fast 64-bit mixer (splitmix64 finaliser over `a ^ b·k`).
pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0xbf58_476d_1ce4_e5b9).rotate_left(31);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One block's state: 24 bytes (the hash's presence a flag beside the links rather than
/// an `Option`, which took 32), so that more of a pool's blocks share a cache line: at
/// 1,000 pods each pool is cold when its turn comes.
#[derive(Debug, Clone, Copy)]
struct Block {
    /// The registered hash, meaningful while `hashed`.
    hash: u64,
    ref_cnt: u32,
    prev: u32,
    next: u32,
    free: bool,
    hashed: bool,
}

impl Block {
    const FRESH: Block = Block {
        hash: 0,
        ref_cnt: 0,
        prev: NIL,
        next: NIL,
        free: false,
        hashed: false,
    };

    fn take_hash(&mut self) -> Option<u64> {
        std::mem::replace(&mut self.hashed, false).then_some(self.hash)
    }
}

/// The pool of GPU KV blocks of one engine.
///
/// The free queue starts as every block in id order, and blocks freed later join its tail,
/// so the blocks never used yet are always its head, in order: they are not kept in the
/// queue, and `blocks` holds only the blocks used so far (the next fresh one is
/// `blocks.len()`). A pool thus costs memory for the blocks its traffic reached, not for
/// the whole pool (a thousand 80 GB pools of which each uses a fraction, offline), and
/// allocation takes the same blocks as a queue of them all would.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: u32,
    /// Blocks in the pool.
    capacity: u32,
    /// The blocks used at least once, by id: ids from `blocks.len()` on are fresh.
    blocks: Vec<Block>,
    /// Head and tail of the queue of free blocks that were used before.
    head: u32,
    tail: u32,
    num_free: u32,
    cached: IntMap<u64, BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` empty blocks.
    pub fn new(num_blocks: u32, block_size: u32) -> BlockPool {
        BlockPool {
            block_size: block_size.max(1),
            capacity: num_blocks,
            blocks: Vec::new(),
            head: NIL,
            tail: NIL,
            num_free: num_blocks,
            cached: IntMap::default(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> u32 {
        self.capacity
    }

    /// Blocks not referenced by any sequence (cached or empty).
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    /// vLLM's `kv_cache_usage_perc`: share of blocks referenced by sequences.
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            return 0.0;
        }
        1.0 - f64::from(self.num_free) / f64::from(self.capacity)
    }

    /// Blocks the prefix cache can still serve (full blocks with a hash).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// The cached block holding this hash, if any.
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Whether a block is unreferenced (so taking it uses one free block).
    pub fn is_free(&self, id: BlockId) -> bool {
        self.blocks[id as usize].free
    }

    /// Takes a reference on a cached block (removing it from the free queue if needed).
    pub fn touch(&mut self, id: BlockId) {
        if self.blocks[id as usize].free {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_cnt += 1;
    }

    /// Pops the least recently freed block, evicting its cached hash.
    pub fn allocate(&mut self) -> Option<BlockId> {
        self.allocate_evicting().map(|(id, _)| id)
    }

    /// [`BlockPool::allocate`], also saying which registered hash the block lost (what vLLM's
    /// `_maybe_evict_cached_block` announces as `BlockRemoved`).
    pub fn allocate_evicting(&mut self) -> Option<(BlockId, Option<u64>)> {
        if (self.blocks.len() as u32) < self.capacity {
            // The head of the queue is the first block never used.
            let id = self.blocks.len() as u32;
            self.blocks.push(Block {
                ref_cnt: 1,
                ..Block::FRESH
            });
            self.num_free -= 1;
            return Some((id, None));
        }
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        let block = &mut self.blocks[id as usize];
        let evicted = block.take_hash();
        block.ref_cnt = 1;
        if let Some(h) = evicted
            && self.cached.get(&h) == Some(&id)
        {
            self.cached.remove(&h);
        }
        Some((id, evicted))
    }

    /// Drops one reference on each block; blocks reaching zero join the free queue in this order
    /// (so pass a sequence's blocks tail first: its last blocks are evicted first).
    pub fn free<I: IntoIterator<Item = BlockId>>(&mut self, ids: I) {
        for id in ids {
            let block = &mut self.blocks[id as usize];
            block.ref_cnt = block.ref_cnt.saturating_sub(1);
            if block.ref_cnt == 0 && !block.free {
                self.push_tail(id);
            }
        }
    }

    /// Registers a full block under its chained hash. Lookups find the first block registered
    /// under a hash (as vLLM's `get_one_block`); a later duplicate (two requests computed the
    /// same prefix at once) keeps the hash too, so that its eviction is reported as vLLM
    /// reports it, but is never found by a lookup.
    pub fn cache(&mut self, id: BlockId, hash: u64) {
        let block = &mut self.blocks[id as usize];
        if block.hashed {
            return;
        }
        block.hash = hash;
        block.hashed = true;
        self.cached.entry(hash).or_insert(id);
    }

    /// Blocks referenced by sequences.
    pub fn num_in_use(&self) -> u32 {
        self.num_blocks() - self.num_free
    }

    /// Forgets every registered hash (vLLM's `reset_prefix_cache`); false, and nothing
    /// forgotten, while a sequence still holds a block.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_in_use() > 0 {
            return false;
        }
        self.cached.clear();
        for block in &mut self.blocks {
            block.hashed = false;
        }
        true
    }

    /// Every hash a block carries (registered, including duplicates), for tests that check the
    /// events announced against the pool.
    #[cfg(test)]
    pub(crate) fn registered_hashes(&self) -> Vec<u64> {
        self.blocks
            .iter()
            .filter(|b| b.hashed)
            .map(|b| b.hash)
            .collect()
    }

    fn push_tail(&mut self, id: BlockId) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
            b.free = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.free = false;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_takes_the_least_recently_freed_block() {
        let mut pool = BlockPool::new(3, 16);
        let a = pool.allocate().expect("free block");
        let b = pool.allocate().expect("free block");
        assert_eq!(pool.num_free(), 1);
        pool.free([b, a]);
        assert_eq!(pool.num_free(), 3);
        // block 2 was never used and sits first; then b, then a.
        assert_eq!(pool.allocate(), Some(2));
        assert_eq!(pool.allocate(), Some(b));
        assert_eq!(pool.allocate(), Some(a));
        assert_eq!(pool.allocate(), None);
        assert!((pool.usage() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_pool_holds_only_the_blocks_it_used_and_takes_fresh_ones_before_freed_ones() {
        let mut pool = BlockPool::new(1_000_000, 16);
        assert_eq!(pool.blocks.len(), 0, "nothing allocated for unused blocks");
        assert_eq!(pool.num_free(), 1_000_000);
        let a = pool.allocate().expect("free block");
        pool.cache(a, 5);
        pool.free([a]);
        // The queue is every fresh block, then `a`: a second allocation is fresh.
        assert_eq!(pool.allocate(), Some(1));
        assert_eq!(
            pool.lookup(5),
            Some(a),
            "a stays cached behind the fresh blocks"
        );
        assert_eq!(pool.blocks.len(), 2);
        assert_eq!(pool.num_in_use(), 1);
        let mut small = BlockPool::new(2, 16);
        let first = small.allocate().expect("free block");
        small.cache(first, 9);
        small.free([first]);
        let _fresh = small.allocate().expect("free block");
        assert_eq!(small.allocate_evicting(), Some((first, Some(9))));
        assert_eq!(small.lookup(9), None);
        assert_eq!(small.allocate(), None);
    }

    #[test]
    fn a_freed_block_stays_cached_until_it_is_evicted() {
        let mut pool = BlockPool::new(2, 16);
        let a = pool.allocate().expect("free block");
        pool.cache(a, 42);
        pool.free([a]);
        assert_eq!(pool.lookup(42), Some(a));
        assert!(pool.usage() < 1e-9, "cached blocks count as free");
        pool.touch(a);
        assert_eq!(pool.num_free(), 1);
        pool.free([a]);
        let _other = pool.allocate().expect("free block");
        assert_eq!(pool.lookup(42), Some(a), "the never-used block went first");
        let again = pool.allocate().expect("free block");
        assert_eq!(again, a);
        assert_eq!(pool.lookup(42), None, "eviction removes the hash");
    }

    #[test]
    fn shared_blocks_are_freed_only_by_the_last_holder() {
        let mut pool = BlockPool::new(1, 16);
        let a = pool.allocate().expect("free block");
        pool.cache(a, 7);
        pool.touch(a);
        pool.free([a]);
        assert_eq!(pool.num_free(), 0);
        pool.free([a]);
        assert_eq!(pool.num_free(), 1);
    }

    #[test]
    fn chained_hashes_differ_by_parent_and_adapter() {
        let toks = [1, 2, 3];
        assert_ne!(block_hash(0, &toks, 0), block_hash(1, &toks, 0));
        assert_ne!(block_hash(0, &toks, 0), block_hash(0, &toks, 1));
        assert_eq!(block_hash(5, &toks, 9), block_hash(5, &toks, 9));
        assert_ne!(block_hash(0, &toks, 0), block_hash(0, &[1, 2, 4], 0));
        assert_ne!(block_hash(0, &toks, 0), block_hash(0, &[1, 2, 3, 0], 0));
        // Blocks longer than one call's tokens: every token counts.
        let long: Vec<u32> = (0..200).collect();
        for at in [0, 63, 64, 130, 199] {
            let mut other = long.clone();
            other[at] += 1;
            assert_ne!(block_hash(0, &long, 0), block_hash(0, &other, 0), "{at}");
        }
    }
}
