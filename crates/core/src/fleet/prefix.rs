//! kvroute's memory of which prompt prefixes it sent to which pod: an approximate view
//! of each pod's prefix cache, kept without asking the pods.
//!
//! vLLM keeps the KV blocks of finished requests and reuses them when a new prompt starts
//! with the same tokens, so a prompt sent where its prefix was sent before skips that part
//! of its prefill. Pods do not publish which prefixes they hold; kvroute remembers the
//! blocks of every prompt it routed, per pod, and forgets a pod's oldest blocks once it
//! remembers more than the pod's KV pool can hold (vLLM evicts least recently used free
//! blocks first, so the oldest are the likeliest gone).
//!
//! A block is [`BLOCK_BYTES`] of prompt text (about one 16-token vLLM block at 4 bytes a
//! token). Its hash chains the hash of everything before it, seeded with the model name,
//! so equal hashes mean equal prefixes of the same model and a match can stop at the
//! first block that differs, as the pods' own prefix caches do.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Prompt bytes per block.
pub const BLOCK_BYTES: usize = 64;
/// Tokens per block, for sizing a pod's memory from its KV capacity in tokens.
pub const BLOCK_TOKENS: u64 = 16;
/// Blocks remembered per pod whose KV capacity is unknown (a 128k-token pool).
const DEFAULT_POD_BLOCKS: usize = 8192;

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

/// How many of a request's leading blocks each pod holds, for the scheduler. Only pods
/// holding at least the first block are listed, sorted by endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatches {
    /// Blocks in the request (the denominator of the match share).
    pub request_blocks: u32,
    matched: Vec<(SocketAddr, u32)>,
}

impl PrefixMatches {
    /// Matches given by hand (tests, benchmarks, offline simulation).
    pub fn new(request_blocks: u32, mut matched: Vec<(SocketAddr, u32)>) -> Self {
        matched.sort_unstable_by_key(|(endpoint, _)| *endpoint);
        matched.retain(|(_, blocks)| *blocks > 0);
        PrefixMatches {
            request_blocks,
            matched,
        }
    }

    /// Leading blocks of the request that `endpoint` holds.
    pub fn blocks_at(&self, endpoint: SocketAddr) -> u32 {
        if self.matched.is_empty() {
            return 0;
        }
        self.matched
            .binary_search_by_key(&endpoint, |(e, _)| *e)
            .map_or(0, |i| self.matched[i].1)
    }

    /// Whether some pod holds part of the prompt.
    pub fn any(&self) -> bool {
        !self.matched.is_empty()
    }
}

/// Which blocks kvroute sent to which pod, most recent last per pod.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    /// Bumped on every block recorded; orders blocks by last use.
    clock: u64,
    /// Pods holding each block, with when each last received it.
    holders: HashMap<u64, Vec<(u32, u64)>>,
    pods: Vec<PodBlocks>,
    slots: HashMap<SocketAddr, u32>,
}

#[derive(Debug)]
struct PodBlocks {
    endpoint: SocketAddr,
    /// Blocks in order of use, with the clock at that use. An entry whose clock differs
    /// from the one in `holders` was used again later and is skipped on eviction.
    order: VecDeque<(u64, u64)>,
    /// Blocks held (distinct entries of `order` still current).
    held: usize,
    /// Set when the pod left the fleet: its slot is reused by the next new pod.
    vacant: bool,
}

impl PrefixIndex {
    pub fn new() -> Self {
        PrefixIndex::default()
    }

    /// For each pod, how many of `blocks` it holds from the first one on.
    pub fn matches(&self, blocks: &[u64]) -> PrefixMatches {
        let request_blocks = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
        let Some(first) = blocks.first().and_then(|b| self.holders.get(b)) else {
            return PrefixMatches::new(request_blocks, Vec::new());
        };
        // Pods still matching, with their matched length so far; shrinks block by block.
        let mut alive: Vec<(u32, u32)> = first.iter().map(|&(slot, _)| (slot, 1)).collect();
        let mut done: Vec<(u32, u32)> = Vec::new();
        for block in &blocks[1..] {
            let holders = self.holders.get(block).map_or(&[][..], Vec::as_slice);
            alive.retain_mut(|(slot, matched)| {
                if holders.iter().any(|(s, _)| s == slot) {
                    *matched += 1;
                    true
                } else {
                    done.push((*slot, *matched));
                    false
                }
            });
            if alive.is_empty() {
                break;
            }
        }
        done.extend(alive);
        let matched = done
            .into_iter()
            .filter_map(|(slot, n)| {
                let pod = self.pods.get(slot as usize)?;
                (!pod.vacant).then_some((pod.endpoint, n))
            })
            .collect();
        PrefixMatches::new(request_blocks, matched)
    }

    /// Remembers that `blocks` were sent to `endpoint`, whose KV pool holds
    /// `capacity_tokens` (0: unknown), forgetting its least recently sent blocks beyond that.
    pub fn record(&mut self, endpoint: SocketAddr, blocks: &[u64], capacity_tokens: u64) {
        if blocks.is_empty() {
            return;
        }
        let slot = self.slot(endpoint);
        let capacity = match capacity_tokens / BLOCK_TOKENS {
            0 => DEFAULT_POD_BLOCKS,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        // Last block first, so a prompt's head is its most recent part and is forgotten
        // last: vLLM frees a finished request's blocks tail first for the same reason, and
        // a prefix whose first block is gone matches nothing at all.
        for &block in blocks.iter().rev() {
            self.clock += 1;
            let now = self.clock;
            let holders = self.holders.entry(block).or_default();
            let pod = &mut self.pods[slot as usize];
            match holders.iter_mut().find(|(s, _)| *s == slot) {
                Some(entry) => entry.1 = now,
                None => {
                    holders.push((slot, now));
                    pod.held += 1;
                }
            }
            pod.order.push_back((block, now));
        }
        self.evict(slot, capacity);
    }

    /// Forgets pods that are not in `endpoints` (they left the fleet).
    pub fn retain_pods(&mut self, endpoints: &[SocketAddr]) {
        let current: std::collections::HashSet<&SocketAddr> = endpoints.iter().collect();
        let gone: Vec<u32> = self
            .slots
            .iter()
            .filter(|(endpoint, _)| !current.contains(endpoint))
            .map(|(_, slot)| *slot)
            .collect();
        for slot in gone {
            self.evict(slot, 0);
            let pod = &mut self.pods[slot as usize];
            pod.order = VecDeque::new();
            pod.vacant = true;
            let endpoint = pod.endpoint;
            self.slots.remove(&endpoint);
        }
    }

    /// Blocks remembered for `endpoint`.
    pub fn held(&self, endpoint: SocketAddr) -> usize {
        self.slots
            .get(&endpoint)
            .map_or(0, |&slot| self.pods[slot as usize].held)
    }

    fn slot(&mut self, endpoint: SocketAddr) -> u32 {
        if let Some(&slot) = self.slots.get(&endpoint) {
            return slot;
        }
        let fresh = PodBlocks {
            endpoint,
            order: VecDeque::new(),
            held: 0,
            vacant: false,
        };
        let slot = match self.pods.iter().position(|pod| pod.vacant) {
            Some(index) => {
                self.pods[index] = fresh;
                index
            }
            None => {
                self.pods.push(fresh);
                self.pods.len() - 1
            }
        };
        let slot = u32::try_from(slot).unwrap_or(u32::MAX);
        self.slots.insert(endpoint, slot);
        slot
    }

    /// Drops the pod's oldest blocks until it holds at most `capacity`, and compacts its
    /// order queue when re-used blocks have left too many outdated entries in it.
    fn evict(&mut self, slot: u32, capacity: usize) {
        let Some(pod) = self.pods.get_mut(slot as usize) else {
            return;
        };
        while pod.held > capacity {
            let Some((block, at)) = pod.order.pop_front() else {
                break;
            };
            let Some(holders) = self.holders.get_mut(&block) else {
                continue;
            };
            let before = holders.len();
            holders.retain(|&(s, t)| !(s == slot && t == at));
            if holders.len() < before {
                pod.held -= 1;
                if holders.is_empty() {
                    self.holders.remove(&block);
                }
            }
        }
        if pod.order.len() > 2 * pod.held + 1024 {
            let holders = &self.holders;
            pod.order.retain(|(block, at)| {
                holders
                    .get(block)
                    .is_some_and(|h| h.iter().any(|&(s, t)| s == slot && t == *at))
            });
        }
    }
}

#[cfg(test)]
mod tests;
