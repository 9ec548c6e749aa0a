//! kvroute's memory of which prompt prefixes it sent to which pod: an approximate view
//! of each pod's prefix cache, kept without asking the pods.
//!
//! vLLM keeps the KV blocks of finished requests and reuses them when a new prompt starts
//! with the same tokens, so a prompt sent where its prefix was sent before skips that part
//! of its prefill. Pods do not publish which prefixes they hold; kvroute remembers the
//! blocks of every prompt it routed, per pod, and forgets a pod's least recently sent
//! blocks once it remembers more than the pod's KV pool holds or its share of the index's
//! memory budget (vLLM evicts least recently used free blocks first, so the oldest are the
//! likeliest gone).
//!
//! A block is [`BLOCK_BYTES`] of prompt text (about one 16-token vLLM block at 4 bytes a
//! token). Its hash chains the hash of everything before it, seeded with the model name,
//! so equal hashes mean equal prefixes of the same model and a match can stop at the
//! first block that differs, as the pods' own prefix caches do.
//!
//! # Why matching costs the prompt's length, not the fleet's size
//!
//! Each pod's remembered blocks are *prefix-closed*: a pod that holds a block holds every
//! block before it in its chain. [`PrefixIndex::record`] keeps it so by sending a prompt's
//! blocks last first (a prompt's head is always more recent than its tail) and eviction
//! drops the least recent first. So along a request's chain, the set of pods holding block
//! `i + 1` is a subset of those holding block `i`, and it changes only where its size
//! does. A match walks the chain once, one hash lookup per block, and copies a holder set
//! only where it shrinks: with a system prompt every pod holds and user turns one pod
//! holds each, that is the fleet once and a few pods after, however many pods share the
//! prompt. (Quadratic alternatives, checking each pod against each block, took 11.5 ms
//! at 1,000 pods.)
//!
//! # Concurrency and memory
//!
//! Blocks live in [`SHARDS`] independently locked hash maps, and each pod's recency order
//! in its own lock, so matches and records of concurrent requests run in parallel and
//! outside the scheduler's placement lock. Lock order is always pod, then one shard.
//!
//! A block held by one pod, the common case for user turns, costs one 16-byte map entry
//! (the hash and a packed holder) and one 8-byte recency entry; blocks held by several
//! pods keep their holders in a sorted side list of 8 bytes each. The index counts
//! remembered (pod, block) pairs and caps them ([`PrefixIndex::max_entries`]): past the
//! cap, each pod keeps its most recent `cap / pods` blocks.
//!
//! The cap comes from a byte budget ([`PrefixIndex::with_budget`]) that bounds what the
//! index really allocates, not an average: a hash map's table doubles when it fills (and
//! when removals leave it full of tombstones), which would put its size anywhere between
//! one and two times its entries. So each shard's table is held at a fixed power-of-two
//! size chosen from the budget: the cap keeps it 85 % full on average, a shard never takes
//! a new block past its table's load limit, and a table that doubles anyway (tombstones) is
//! rebuilt at its size at once.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::Snapshot;

/// Prompt bytes per block.
pub const BLOCK_BYTES: usize = 64;
/// Tokens per block, for sizing a pod's memory from its KV capacity in tokens.
pub const BLOCK_TOKENS: u64 = 16;
/// Blocks remembered per pod whose KV capacity is unknown (a 128k-token pool).
const DEFAULT_POD_BLOCKS: usize = 8192;
/// Independently locked parts of the block map.
pub const SHARDS: usize = 64;
/// Bytes of one bucket of a shard's table: the block hash, its packed holder and the
/// table's control byte.
const BUCKET_BYTES: usize = 17;
/// The most bytes one entry of a pod's recency queue takes: the block hash, with up to
/// half again of outdated entries before compaction and a quarter of spare capacity.
const ORDER_BYTES: usize = 15;
/// Entries per bucket the cap allows on average: 85 % of the table's load limit (7/8),
/// leaving room for the tombstones of removals between rebuilds in place.
const FILL: f64 = 0.85 * 7.0 / 8.0;
/// The default budget: 128 MiB, about 3.1 million (pod, block) pairs: at 1,000 pods,
/// 3,120 blocks (≈ 50k tokens) each; at 100 pods, ≈ 500k tokens each, more than an
/// 80 GB GPU's KV pool for an 8B model.
pub const DEFAULT_BUDGET_BYTES: usize = 128 << 20;

/// How an index spends a byte budget: each shard's table size and the cap on entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sizing {
    /// Most blocks one shard's table takes (its load limit); `usize::MAX`: no limit.
    shard_limit: usize,
    max_entries: usize,
}

impl Sizing {
    /// The table size (a power of two per shard) that lets the most entries fit the
    /// budget, tables and recency queues together.
    fn for_budget(budget_bytes: usize) -> Sizing {
        let mut best = None;
        for shift in 3..48 {
            let buckets = 1usize << shift;
            let tables = SHARDS * buckets * BUCKET_BYTES;
            if tables >= budget_bytes {
                break;
            }
            let by_fill = (SHARDS * buckets) as f64 * FILL;
            let by_bytes = ((budget_bytes - tables) / ORDER_BYTES) as f64;
            let entries = by_fill.min(by_bytes) as usize;
            if best.is_none_or(|(_, most)| entries > most) {
                best = Some((buckets, entries));
            }
        }
        match best {
            Some((buckets, max_entries)) => Sizing {
                shard_limit: buckets / 8 * 7,
                max_entries: max_entries.max(1),
            },
            // A budget too small for the smallest tables: tables that small cost little.
            None => Sizing {
                shard_limit: usize::MAX,
                max_entries: (budget_bytes / (BUCKET_BYTES * 2 + ORDER_BYTES)).max(1),
            },
        }
    }
}

/// The chained block hashes of `prompt_prefix` for `model`: one per full block, in order.
/// A trailing partial block is left out, as vLLM caches only full blocks. `context` (0 for
/// none) seeds the chain with what renders into the prompt before the text, such as a
/// chat request's tools: requests that differ there share no block.
pub fn block_hashes(model: &str, context: u64, prompt_prefix: &[u8]) -> Vec<u64> {
    let mut parent = xxh3_64_with_seed(model.as_bytes(), context);
    prompt_prefix
        .chunks_exact(BLOCK_BYTES)
        .map(|block| {
            parent = xxh3_64_with_seed(block, parent);
            parent
        })
        .collect()
}

/// How many of a request's leading blocks each pod of one snapshot holds, for the
/// scheduler: indexed by the pod's position in [`Snapshot::pods`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatches {
    /// Blocks in the request (the denominator of the match share).
    pub request_blocks: u32,
    /// Prompt tokens per block: [`BLOCK_TOKENS`] (an estimate) for the approximate
    /// index's text blocks, the engine's block size for blocks known from KV events.
    pub block_tokens: u32,
    /// Matched blocks by snapshot position; empty when no pod matches.
    by_pod: Vec<u32>,
    /// The context's home ([`PrefixMatches::homed`]): where set, the one pod whose match
    /// draws the request.
    home: Option<u32>,
}

impl Default for PrefixMatches {
    fn default() -> Self {
        PrefixMatches {
            request_blocks: 0,
            block_tokens: BLOCK_TOKENS as u32,
            by_pod: Vec::new(),
            home: None,
        }
    }
}

impl PrefixMatches {
    /// Matches given by hand (tests, benchmarks, offline simulation), in the approximate
    /// index's blocks: `matched` names pods by endpoint; endpoints not in `snapshot` are
    /// left out.
    pub fn new(request_blocks: u32, snapshot: &Snapshot, matched: &[(SocketAddr, u32)]) -> Self {
        let mut by_pod = vec![0; snapshot.pods().len()];
        for &(endpoint, blocks) in matched {
            if let Some(index) = snapshot.position(endpoint) {
                by_pod[index] = blocks;
            }
        }
        if by_pod.iter().all(|&blocks| blocks == 0) {
            by_pod.clear();
        }
        PrefixMatches {
            request_blocks,
            block_tokens: BLOCK_TOKENS as u32,
            by_pod,
            home: None,
        }
    }

    /// Leading blocks of the request that the pod at `pod_index` in the snapshot holds.
    pub fn blocks_at(&self, pod_index: usize) -> u32 {
        self.by_pod.get(pod_index).copied().unwrap_or(0)
    }

    /// Leading prompt tokens of the request that the pod at `pod_index` holds.
    pub fn tokens_at(&self, pod_index: usize) -> u64 {
        u64::from(self.blocks_at(pod_index)) * u64::from(self.block_tokens)
    }

    /// Matched blocks by snapshot position, or empty when no pod matches.
    pub(crate) fn blocks_by_pod(&self) -> &[u32] {
        &self.by_pod
    }

    /// The pod holding the most leading blocks (the first in the snapshot among equals),
    /// if any pod holds one.
    pub fn best_pod(&self) -> Option<usize> {
        // Two plain passes (a maximum, then its first position) rather than one that
        // tracks both: at 1,000 pods a quarter of the cost.
        let most = self.by_pod.iter().copied().max().filter(|&most| most > 0)?;
        self.by_pod.iter().position(|&blocks| blocks == most)
    }

    /// Whether the pod at `pod_index` holds at least half of the request's blocks.
    pub fn holds_half(&self, pod_index: usize) -> bool {
        self.request_blocks > 0
            && u64::from(self.blocks_at(pod_index)) * 2 >= u64::from(self.request_blocks)
    }

    /// These matches with the pod at `pod_index` as the context's home, if it holds any
    /// of it: only the home draws the request (prefix stickiness and the prefix score read
    /// [`PrefixMatches::drawing_blocks_at`]), while every pod's match still counts as the
    /// prompt it caches (the KV the request needs there, its saturation, its prefill).
    /// The other copies then age out unless the home cannot take the request; one that
    /// takes it anyway is credited its copy by the soft filters alone (the scheduler
    /// scores and reserves it as holding nothing).
    pub fn homed(mut self, pod_index: usize) -> PrefixMatches {
        if self.blocks_at(pod_index) > 0 {
            self.home = u32::try_from(pod_index).ok();
        }
        self
    }

    /// The pod whose match alone draws the request, if the matches name one.
    pub fn home(&self) -> Option<usize> {
        self.home.map(|home| home as usize)
    }

    /// Leading blocks of the request that draw it to the pod at `pod_index`: what it
    /// holds, unless the context has another home.
    #[inline]
    pub fn drawing_blocks_at(&self, pod_index: usize) -> u32 {
        match self.home {
            Some(home) if home as usize != pod_index => 0,
            _ => self.blocks_at(pod_index),
        }
    }

    /// The most leading prompt tokens of the request that one pod holds (0: none).
    pub fn most_tokens(&self) -> u64 {
        let most = self.by_pod.iter().copied().max().unwrap_or(0);
        u64::from(most) * u64::from(self.block_tokens)
    }

    /// [`PrefixMatches::most_tokens`] of the pods that draw the request.
    pub fn most_drawing_tokens(&self) -> u64 {
        match self.home() {
            Some(home) => self.tokens_at(home),
            None => self.most_tokens(),
        }
    }

    /// Whether some pod holds part of the prompt.
    pub fn any(&self) -> bool {
        !self.by_pod.is_empty()
    }

    /// One view from two sources: `exact` (from KV events) for the pods `known` says it
    /// covers, `guessed` (the approximate index) for the others, in `exact`'s blocks.
    pub fn merge(
        exact: PrefixMatches,
        guessed: &PrefixMatches,
        pods: usize,
        known: impl Fn(usize) -> bool,
    ) -> PrefixMatches {
        let block_tokens = exact.block_tokens.max(1);
        let mut by_pod = vec![0u32; pods];
        let mut any = false;
        for (i, slot) in by_pod.iter_mut().enumerate() {
            let blocks = if known(i) {
                exact.blocks_at(i)
            } else {
                u32::try_from(guessed.tokens_at(i) / u64::from(block_tokens)).unwrap_or(u32::MAX)
            };
            *slot = blocks;
            any |= blocks > 0;
        }
        if !any {
            by_pod.clear();
        }
        PrefixMatches {
            request_blocks: exact.request_blocks,
            block_tokens,
            by_pod,
            home: None,
        }
    }
}

/// Which blocks kvroute sent to which pod. Shared by reference between concurrent
/// requests: every method takes `&self`.
#[derive(Debug)]
pub struct PrefixIndex {
    shards: Box<[Mutex<Shard>]>,
    pods: RwLock<PodTable>,
    /// The snapshot version `pods` follows (`u64::MAX`: none yet); checked without the
    /// lock on every request.
    following: AtomicU64,
    /// Remembered (pod, block) pairs, over all pods.
    entries: AtomicUsize,
    /// The most pairs remembered at once.
    max_entries: usize,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex::new()
    }
}

/// One pod holding one block: the pod's slot, and the position in the pod's recency
/// queue of the block's latest entry (older entries for the block are outdated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    slot: u32,
    at: u32,
}

/// A map entry's value, packed in 8 bytes: one holder, or (top bit set) the index of a
/// side list in the shard holding several.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packed(u64);

const MANY: u64 = 1 << 63;

impl Packed {
    fn one(holder: Holder) -> Self {
        // Slots are below 2^31 (a fleet never reaches that), so the top bit is free.
        Packed(u64::from(holder.slot & !(1 << 31)) << 32 | u64::from(holder.at))
    }

    fn many(list: u32) -> Self {
        Packed(MANY | u64::from(list))
    }

    fn decode(self) -> Result<Holder, usize> {
        if self.0 & MANY != 0 {
            Err((self.0 & u64::from(u32::MAX)) as usize)
        } else {
            Ok(Holder {
                slot: (self.0 >> 32) as u32,
                at: self.0 as u32,
            })
        }
    }
}

/// Block hashes are already uniform (xxh3 or an engine's hash): maps keyed by them use them
/// as they are.
#[derive(Default)]
pub(crate) struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

type BlockMap = HashMap<u64, Packed, BuildHasherDefault<IdentityHasher>>;

#[derive(Debug)]
struct Shard {
    blocks: BlockMap,
    /// Most blocks the table takes: its load limit at the size the budget gives it.
    limit: usize,
    /// Holder lists of blocks held by more than one pod, sorted by slot.
    lists: Vec<Vec<Holder>>,
    /// Indices of empty entries of `lists`, reused first.
    free_lists: Vec<u32>,
}

impl Shard {
    fn with_limit(limit: usize) -> Self {
        Shard {
            blocks: BlockMap::default(),
            limit,
            lists: Vec::new(),
            free_lists: Vec::new(),
        }
    }

    /// Remembers a block not in the table, unless the table is at its limit (then the
    /// block is not remembered: only a fleet growing faster than pods record can get
    /// here, as the cap keeps tables 85 % full on average). Returns whether it did.
    fn insert_new(&mut self, block: u64, packed: Packed) -> bool {
        if self.blocks.len() >= self.limit {
            return false;
        }
        self.blocks.insert(block, packed);
        // Tombstones of removed blocks use up the table's room too; when they make it
        // double, rebuild it at its size (clean), so the budget holds.
        if self.blocks.capacity() > self.limit {
            self.blocks.shrink_to(self.limit);
        }
        true
    }

    /// How many pods hold `block`.
    fn count(&self, block: u64) -> usize {
        match self.blocks.get(&block).map(|packed| packed.decode()) {
            None => 0,
            Some(Ok(_)) => 1,
            Some(Err(list)) => self.lists.get(list).map_or(0, Vec::len),
        }
    }

    /// Appends the slots of the pods holding `block` to `out`.
    fn slots(&self, block: u64, out: &mut Vec<u32>) {
        match self.blocks.get(&block).map(|packed| packed.decode()) {
            None => {}
            Some(Ok(one)) => out.push(one.slot),
            Some(Err(list)) => {
                if let Some(list) = self.lists.get(list) {
                    out.extend(list.iter().map(|h| h.slot));
                }
            }
        }
    }

    /// The holder entry of `slot` for `block`, if it holds it.
    fn holder(&self, block: u64, slot: u32) -> Option<Holder> {
        match self.blocks.get(&block)?.decode() {
            Ok(one) => (one.slot == slot).then_some(one),
            Err(list) => {
                let list = self.lists.get(list)?;
                let i = list.binary_search_by_key(&slot, |h| h.slot).ok()?;
                Some(list[i])
            }
        }
    }

    /// Sets `slot`'s position for `block`; returns whether the pod did not hold it before.
    fn set(&mut self, block: u64, holder: Holder) -> bool {
        let Some(packed) = self.blocks.get(&block).copied() else {
            return self.insert_new(block, Packed::one(holder));
        };
        match packed.decode() {
            Ok(one) if one.slot == holder.slot => {
                self.blocks.insert(block, Packed::one(holder));
                false
            }
            Ok(one) => {
                let mut list = vec![one, holder];
                list.sort_unstable_by_key(|h| h.slot);
                let index = match self.free_lists.pop() {
                    Some(index) => {
                        self.lists[index as usize] = list;
                        index
                    }
                    None => {
                        self.lists.push(list);
                        u32::try_from(self.lists.len() - 1).unwrap_or(u32::MAX)
                    }
                };
                self.blocks.insert(block, Packed::many(index));
                true
            }
            Err(index) => {
                let Some(list) = self.lists.get_mut(index) else {
                    return false;
                };
                match list.binary_search_by_key(&holder.slot, |h| h.slot) {
                    Ok(i) => {
                        list[i] = holder;
                        false
                    }
                    Err(i) => {
                        list.insert(i, holder);
                        true
                    }
                }
            }
        }
    }

    /// Forgets that `slot` holds `block` if its latest entry is at `at`; returns whether
    /// it did.
    fn remove(&mut self, block: u64, holder: Holder) -> bool {
        let Some(packed) = self.blocks.get(&block).copied() else {
            return false;
        };
        match packed.decode() {
            Ok(one) if one == holder => {
                self.blocks.remove(&block);
                true
            }
            Ok(_) => false,
            Err(index) => {
                let Some(list) = self.lists.get_mut(index) else {
                    return false;
                };
                let Ok(i) = list.binary_search_by_key(&holder.slot, |h| h.slot) else {
                    return false;
                };
                if list[i] != holder {
                    return false;
                }
                list.remove(i);
                if list.len() == 1 {
                    let last = list[0];
                    *list = Vec::new();
                    self.free_lists
                        .push(u32::try_from(index).unwrap_or(u32::MAX));
                    self.blocks.insert(block, Packed::one(last));
                }
                true
            }
        }
    }
}

/// Pods by slot, and how the current snapshot's positions map to slots.
#[derive(Debug, Default)]
struct PodTable {
    slots: HashMap<SocketAddr, u32>,
    /// By slot; `None` for a slot free for the next new pod.
    pods: Vec<Option<Arc<Mutex<PodBlocks>>>>,
    /// Each slot's endpoint (meaningful while the slot is taken).
    endpoints: Vec<SocketAddr>,
    /// For each slot, the pod's position in the followed snapshot (`u32::MAX`: none).
    positions: Vec<u32>,
    /// The `endpoints_version` of the followed snapshot.
    version: Option<u64>,
}

/// One pod's remembered blocks, least recently sent first.
#[derive(Debug)]
struct PodBlocks {
    slot: u32,
    /// Block hashes in the order they were sent. An entry is current when the block's
    /// holder entry for this pod points at its position; others were sent again later
    /// and are skipped.
    order: VecDeque<u64>,
    /// Position of `order`'s front (positions count every entry ever pushed, wrapping).
    head: u32,
    /// Blocks held (current entries of `order`).
    held: usize,
    /// Set when the pod left: a record racing with its departure changes nothing.
    gone: bool,
}

impl PodBlocks {
    fn position(&self, index: usize) -> u32 {
        self.head.wrapping_add(index as u32)
    }
}

impl PrefixIndex {
    /// An index with the default memory budget, [`DEFAULT_BUDGET_BYTES`].
    pub fn new() -> Self {
        PrefixIndex::with_budget(DEFAULT_BUDGET_BYTES)
    }

    /// An index whose maps and recency queues never take more than `budget_bytes` (see
    /// the module docs); [`PrefixIndex::max_entries`] says how many pairs that holds.
    pub fn with_budget(budget_bytes: usize) -> Self {
        PrefixIndex::sized(Sizing::for_budget(budget_bytes))
    }

    /// An index capped at `max_entries` pairs, its tables free to grow (tests, benchmarks).
    pub fn with_max_entries(max_entries: usize) -> Self {
        PrefixIndex::sized(Sizing {
            shard_limit: usize::MAX,
            max_entries: max_entries.max(1),
        })
    }

    fn sized(sizing: Sizing) -> Self {
        PrefixIndex {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(Shard::with_limit(sizing.shard_limit)))
                .collect(),
            pods: RwLock::new(PodTable::default()),
            following: AtomicU64::new(u64::MAX),
            entries: AtomicUsize::new(0),
            max_entries: sizing.max_entries,
        }
    }

    /// Remembered (pod, block) pairs over all pods.
    pub fn entries(&self) -> usize {
        self.entries.load(Ordering::Relaxed)
    }

    /// The most (pod, block) pairs remembered at once.
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    fn shard(&self, block: u64) -> MutexGuard<'_, Shard> {
        // The top bits: the map inside the shard uses the low ones.
        let index = (block >> 58) as usize % self.shards.len();
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn table(&self) -> std::sync::RwLockReadGuard<'_, PodTable> {
        self.pods.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Follows the fleet: pods of `snapshot` get a slot and pods that left are forgotten.
    /// Cheap when the snapshot's endpoint set is not newer than the one followed.
    pub fn follow(&self, snapshot: &Snapshot) {
        let newer =
            |following: u64| following == u64::MAX || snapshot.endpoints_version > following;
        if !newer(self.following.load(Ordering::Acquire)) {
            return;
        }
        let mut table = self.pods.write().unwrap_or_else(|p| p.into_inner());
        if !newer(self.following.load(Ordering::Acquire)) {
            return;
        }
        let current: HashMap<SocketAddr, usize> = snapshot
            .pods()
            .iter()
            .enumerate()
            .map(|(position, pod)| (pod.endpoint, position))
            .collect();
        let departed: Vec<SocketAddr> = table
            .slots
            .keys()
            .filter(|endpoint| !current.contains_key(endpoint))
            .copied()
            .collect();
        for endpoint in departed {
            if let Some(slot) = table.slots.remove(&endpoint)
                && let Some(pod) = table.pods.get_mut(slot as usize).and_then(Option::take)
            {
                let mut pod = pod.lock().unwrap_or_else(|p| p.into_inner());
                self.evict(&mut pod, 0);
                pod.gone = true;
                pod.order = VecDeque::new();
            }
        }
        for pod in snapshot.pods() {
            if table.slots.contains_key(&pod.endpoint) {
                continue;
            }
            let slot = match table.pods.iter().position(Option::is_none) {
                Some(free) => free,
                None => {
                    table.pods.push(None);
                    table.pods.len() - 1
                }
            };
            let slot_id = u32::try_from(slot).unwrap_or(u32::MAX);
            if table.endpoints.len() <= slot {
                table.endpoints.resize(slot + 1, pod.endpoint);
            }
            table.endpoints[slot] = pod.endpoint;
            table.pods[slot] = Some(Arc::new(Mutex::new(PodBlocks {
                slot: slot_id,
                order: VecDeque::new(),
                head: 0,
                held: 0,
                gone: false,
            })));
            table.slots.insert(pod.endpoint, slot_id);
        }
        let mut positions = vec![u32::MAX; table.pods.len()];
        for (endpoint, &slot) in &table.slots {
            if let Some(&position) = current.get(endpoint) {
                positions[slot as usize] = u32::try_from(position).unwrap_or(u32::MAX);
            }
        }
        table.positions = positions;
        table.version = Some(snapshot.endpoints_version);
        self.following
            .store(snapshot.endpoints_version, Ordering::Release);
    }

    /// Whether the index follows `snapshot`'s pods already: a match against it changes
    /// nothing but its own result.
    pub fn follows(&self, snapshot: &Snapshot) -> bool {
        let following = self.following.load(Ordering::Acquire);
        following != u64::MAX && snapshot.endpoints_version <= following
    }

    /// Whether some pod holds `block`: where none does, no pod holds any block chained
    /// after it either, and a match of a prompt starting with it finds nothing.
    pub fn is_held(&self, block: u64) -> bool {
        self.shard(block).count(block) > 0
    }

    /// For each pod of `snapshot`, how many of `blocks` it holds from the first one on.
    /// Costs one shard lookup per matched block, plus a copy of the holder set wherever
    /// it shrinks along the chain (see the module docs).
    pub fn matches(&self, blocks: &[u64], snapshot: &Snapshot) -> PrefixMatches {
        self.matches_of(blocks, BLOCK_TOKENS as u32, snapshot)
    }

    /// [`PrefixIndex::matches`] for blocks of `block_tokens` tokens each (an index fed by
    /// KV events holds the engine's blocks).
    pub fn matches_of(
        &self,
        blocks: &[u64],
        block_tokens: u32,
        snapshot: &Snapshot,
    ) -> PrefixMatches {
        self.follow(snapshot);
        let request_blocks = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
        let none = PrefixMatches {
            request_blocks,
            block_tokens,
            by_pod: Vec::new(),
            home: None,
        };
        // Levels: where the holder set shrinks, the slots holding from there on (sorted).
        let mut slots: Vec<u32> = Vec::new();
        // (first slot in `slots`, blocks matched by the level's holders)
        let mut levels: Vec<(usize, u32)> = Vec::new();
        let mut scratch: Vec<u32> = Vec::new();
        let mut previous = 0;
        for (i, &block) in blocks.iter().enumerate() {
            let depth = u32::try_from(i + 1).unwrap_or(u32::MAX);
            let shard = self.shard(block);
            let count = shard.count(block);
            if count == 0 {
                break;
            }
            if count != previous {
                previous = count;
                scratch.clear();
                shard.slots(block, &mut scratch);
                drop(shard);
                // Only pods that held every block so far. Prefix-closed memories make
                // this the whole set; the check keeps a broken chain (a hash shared by
                // two prompts) from crediting a pod with blocks it lacks at the head.
                if let Some(&(start, _)) = levels.last() {
                    let above = &slots[start..];
                    scratch.retain(|slot| above.binary_search(slot).is_ok());
                    if scratch.len() == above.len() {
                        if let Some(level) = levels.last_mut() {
                            level.1 = depth;
                        }
                        continue;
                    }
                }
                if scratch.is_empty() {
                    break;
                }
                levels.push((slots.len(), depth));
                slots.extend_from_slice(&scratch);
                continue;
            }
            if let Some(level) = levels.last_mut() {
                level.1 = depth;
            }
        }
        if levels.is_empty() {
            return none;
        }
        // A level's holders hold every block up to where the next level's pods stop;
        // writing shallow to deep leaves each pod its deepest level.
        let table = self.table();
        // Another request may have followed a newer snapshot since: then positions are
        // looked up by endpoint instead.
        let exact = table.version == Some(snapshot.endpoints_version);
        let position = |slot: u32| {
            if exact {
                table.positions.get(slot as usize).map(|&p| p as usize)
            } else {
                table
                    .endpoints
                    .get(slot as usize)
                    .and_then(|&endpoint| snapshot.position(endpoint))
            }
        };
        let mut by_pod = vec![0u32; snapshot.pods().len()];
        let mut matched = 0;
        for (l, &(start, depth)) in levels.iter().enumerate() {
            let end = levels.get(l + 1).map_or(slots.len(), |next| next.0);
            for &slot in &slots[start..end] {
                if let Some(position) = position(slot)
                    && let Some(entry) = by_pod.get_mut(position)
                {
                    *entry = depth;
                    matched += 1;
                }
            }
        }
        if matched == 0 {
            return none;
        }
        PrefixMatches {
            request_blocks,
            block_tokens,
            by_pod,
            home: None,
        }
    }

    /// Remembers that `blocks` were sent to `endpoint`, whose KV pool holds
    /// `capacity_tokens` (0: unknown), forgetting its least recently sent blocks beyond
    /// that or beyond its share of the budget. A pod not in the followed snapshot is
    /// ignored.
    pub fn record(&self, endpoint: SocketAddr, blocks: &[u64], capacity_tokens: u64) {
        if blocks.is_empty() {
            return;
        }
        let Some((pod, pods)) = self.pod(endpoint) else {
            return;
        };
        let mut pod = pod.lock().unwrap_or_else(|p| p.into_inner());
        if pod.gone {
            return;
        }
        let slot = pod.slot;
        // Last block first, so a prompt's head is always more recent than its tail and is
        // forgotten last: vLLM frees a finished request's blocks tail first for the same
        // reason, and it keeps every pod's blocks prefix-closed (module docs). A block
        // still in the newer half of the pod's order is left where it is (it cannot be
        // forgotten soon), unless a block after it in this prompt moved: a head must
        // never be older than its tail.
        let mut moved = false;
        let mut added = 0;
        for &block in blocks.iter().rev() {
            let mut shard = self.shard(block);
            if !moved && let Some(held) = shard.holder(block, slot) {
                let index = held.at.wrapping_sub(pod.head) as usize;
                if index < pod.order.len() && index >= pod.order.len() / 2 {
                    continue;
                }
            }
            let at = pod.position(pod.order.len());
            if shard.set(block, Holder { slot, at }) {
                added += 1;
            }
            drop(shard);
            push_order(&mut pod.order, block);
            moved = true;
        }
        pod.held += added;
        self.entries.fetch_add(added, Ordering::Relaxed);
        let kv_blocks = match capacity_tokens / BLOCK_TOKENS {
            0 => DEFAULT_POD_BLOCKS,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        let share = self.max_entries / pods.max(1);
        self.evict(&mut pod, kv_blocks.min(share).max(1));
        if pod.order.len() > pod.held + pod.held / 2 + 64 {
            self.compact(&mut pod);
        }
    }

    /// Forgets that `endpoint` holds `blocks`: its engine reported them evicted (KV
    /// events). Blocks it does not hold are passed over.
    pub fn forget(&self, endpoint: SocketAddr, blocks: &[u64]) {
        if blocks.is_empty() {
            return;
        }
        let Some((pod, _)) = self.pod(endpoint) else {
            return;
        };
        let mut pod = pod.lock().unwrap_or_else(|p| p.into_inner());
        if pod.gone {
            return;
        }
        let slot = pod.slot;
        let mut removed = 0;
        for &block in blocks {
            let mut shard = self.shard(block);
            if let Some(holder) = shard.holder(block, slot)
                && shard.remove(block, holder)
            {
                removed += 1;
            }
        }
        pod.held -= removed;
        self.entries.fetch_sub(removed, Ordering::Relaxed);
        // The forgotten blocks' recency entries are outdated now.
        if pod.order.len() > pod.held + pod.held / 2 + 64 {
            self.compact(&mut pod);
        }
    }

    /// The pod's record and the number of pods followed, if `endpoint` is one of them.
    fn pod(&self, endpoint: SocketAddr) -> Option<(Arc<Mutex<PodBlocks>>, usize)> {
        let table = self.table();
        let pod = table
            .slots
            .get(&endpoint)
            .and_then(|&slot| table.pods.get(slot as usize)?.clone())?;
        Some((pod, table.slots.len()))
    }

    /// Blocks remembered for `endpoint`.
    pub fn held(&self, endpoint: SocketAddr) -> usize {
        let table = self.table();
        table
            .slots
            .get(&endpoint)
            .and_then(|&slot| table.pods.get(slot as usize)?.clone())
            .map_or(0, |pod| pod.lock().unwrap_or_else(|p| p.into_inner()).held)
    }

    /// Drops the pod's least recently sent blocks until it holds at most `capacity`.
    fn evict(&self, pod: &mut PodBlocks, capacity: usize) {
        let mut removed = 0;
        while pod.held > capacity {
            let at = pod.head;
            let Some(block) = pod.order.pop_front() else {
                break;
            };
            pod.head = pod.head.wrapping_add(1);
            if self
                .shard(block)
                .remove(block, Holder { slot: pod.slot, at })
            {
                pod.held -= 1;
                removed += 1;
            }
        }
        self.entries.fetch_sub(removed, Ordering::Relaxed);
    }

    /// Drops the outdated entries of the pod's order (blocks sent again later), keeping
    /// the order's length within 1.5× the blocks held.
    fn compact(&self, pod: &mut PodBlocks) {
        let slot = pod.slot;
        let old = std::mem::take(&mut pod.order);
        let old_head = pod.head;
        pod.head = 0;
        for (index, block) in old.into_iter().enumerate() {
            let at = old_head.wrapping_add(index as u32);
            let mut shard = self.shard(block);
            if shard.holder(block, slot).is_some_and(|h| h.at == at) {
                let moved_to = pod.position(pod.order.len());
                shard.set(block, Holder { slot, at: moved_to });
                push_order(&mut pod.order, block);
            }
        }
    }
}

/// Appends to a recency queue growing it by a quarter when full, not by doubling: the
/// budget counts a quarter of spare room ([`ORDER_BYTES`]).
fn push_order(order: &mut VecDeque<u64>, block: u64) {
    if order.len() == order.capacity() {
        order.reserve_exact(order.len() / 4 + 16);
    }
    order.push_back(block);
}

#[cfg(test)]
mod tests;
