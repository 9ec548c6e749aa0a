//! A model of the `cache_aware` policy that sglang-router and vllm-router both run by
//! default (sglang-router 0.3.2 and vllm-router 0.1.17, the versions `compare` installs,
//! with the same defaults), so that `simulate` can put kvroute beside the cache-aware
//! peers on the same trace and over many seeds, where a live run is one draw at a
//! chaotic knee.
//!
//! Per request, as both routers do:
//! - the load is each worker's requests in flight through the router; when the fleet is
//!   imbalanced, `max − min > 64` and `max > 1.5 × min`, the least loaded worker wins
//!   (the first on a tie);
//! - otherwise the worker whose tree holds the longest prefix of the prompt wins when that
//!   prefix is more than 0.3 of the prompt; below that, the worker whose tree is smallest;
//! - the prompt is inserted into the winner's tree.
//!
//! Simplifications, each small next to what it models: the trees hold the engine's
//! token ids in chained blocks of [`BLOCK`] tokens (vllm-router matches on token ids,
//! sglang-router on characters), so a match is counted in whole blocks; trees are per
//! model, as vllm-router keeps them; among workers tied on the longest match the first
//! wins (the routers take whichever their map yields first); nothing is evicted (their
//! budgets, 2^25–2^26 characters per worker, hold every workload's prompts many times over).

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use kvroute_sim::kv::mix;

/// Tokens per tree block: the match's granularity.
pub const BLOCK: usize = 16;
/// `--cache-threshold`: the share of the prompt a match must exceed.
pub const CACHE_THRESHOLD: f64 = 0.3;
/// `--balance-abs-threshold`.
pub const BALANCE_ABS: u32 = 64;
/// `--balance-rel-threshold`.
pub const BALANCE_REL: f64 = 1.5;

/// The block hashes are already well mixed: the set hashes them as they are.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type BlockSet = HashSet<u64, BuildHasherDefault<Identity>>;

/// Each worker's tree, as the set of the chained hashes of the prompts' leading blocks
/// sent to it (a block is in the tree with every block before it).
#[derive(Debug, Default)]
pub struct CacheAware {
    trees: Vec<BlockSet>,
    /// Tokens in each tree (its size, as the routers count characters).
    sizes: Vec<u64>,
}

/// The chained hashes of `tokens`' whole blocks, seeded with the model.
fn block_chain(model: &str, tokens: &[u32]) -> Vec<u64> {
    let mut h = model
        .bytes()
        .fold(0x9e37_79b9_7f4a_7c15, |h, b| mix(h, u64::from(b)));
    tokens
        .chunks_exact(BLOCK)
        .map(|block| {
            h = block.iter().fold(h, |h, &t| mix(h, u64::from(t)));
            h
        })
        .collect()
}

impl CacheAware {
    pub fn new(pods: usize) -> Self {
        CacheAware {
            trees: (0..pods).map(|_| BlockSet::default()).collect(),
            sizes: vec![0; pods],
        }
    }

    /// The worker for a prompt of `tokens` for `model`, given each worker's requests in
    /// flight through the router; the prompt joins that worker's tree.
    pub fn route(&mut self, inflight: &[u32], model: &str, tokens: &[u32]) -> usize {
        let pods = inflight.len().min(self.trees.len());
        if pods == 0 {
            return 0;
        }
        let (mut least, mut most) = (0, 0);
        for i in 1..pods {
            if inflight[i] < inflight[least] {
                least = i;
            }
            if inflight[i] > inflight[most] {
                most = i;
            }
        }
        let (min, max) = (inflight[least], inflight[most]);
        let chain = block_chain(model, tokens);
        let pod = if max - min > BALANCE_ABS && f64::from(max) > BALANCE_REL * f64::from(min) {
            least
        } else {
            let (mut best, mut matched) = (0, 0);
            for (i, tree) in self.trees.iter().enumerate().take(pods) {
                let n = chain.iter().take_while(|h| tree.contains(h)).count();
                if n > matched {
                    (best, matched) = (i, n);
                }
            }
            let rate = if tokens.is_empty() {
                0.0
            } else {
                (matched * BLOCK) as f64 / tokens.len() as f64
            };
            if rate > CACHE_THRESHOLD {
                best
            } else {
                (0..pods).min_by_key(|&i| self.sizes[i]).unwrap_or(0)
            }
        };
        let added = chain.iter().filter(|&&h| self.trees[pod].insert(h)).count();
        self.sizes[pod] += (added * BLOCK) as u64;
        pod
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(context: u32, question: u32) -> Vec<u32> {
        (0..3_000)
            .map(|t| context * 100_000 + t)
            .chain((0..200).map(|t| 1_000_000 + question * 1_000 + t))
            .collect()
    }

    #[test]
    fn a_prompt_follows_its_context_and_new_contexts_go_to_the_smallest_tree() {
        let mut policy = CacheAware::new(4);
        let idle = [0; 4];
        // Four contexts, each new: each to the smallest tree, so one per worker.
        let homes: Vec<usize> = (0..4)
            .map(|c| policy.route(&idle, "m", &prompt(c, 0)))
            .collect();
        let mut sorted = homes.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![0, 1, 2, 3]);
        // Later questions on each context go home, whatever the moderate load says.
        let load = [10, 0, 30, 5];
        for (c, &home) in homes.iter().enumerate() {
            assert_eq!(policy.route(&load, "m", &prompt(c as u32, 7)), home);
        }
        // The same tokens for another model share nothing: all of them are new.
        let before = policy.sizes.clone();
        let other = policy.route(&idle, "other", &prompt(0, 0));
        assert_eq!(policy.sizes[other] - before[other], 3_200);
    }

    #[test]
    fn an_imbalanced_fleet_sends_to_the_least_loaded_worker() {
        let mut policy = CacheAware::new(3);
        let home = policy.route(&[0, 0, 0], "m", &prompt(1, 0));
        let mut load = [50, 50, 50];
        load[home] = 200;
        let least = (0..3).find(|&i| i != home).unwrap_or(0);
        load[least] = 10;
        // 200 − 10 > 64 and 200 > 1.5 × 10: the context moves to the least loaded.
        assert_eq!(policy.route(&load, "m", &prompt(1, 1)), least);
        // Within the absolute threshold the context stays home.
        let mut load = [0, 0, 0];
        load[home] = 64;
        assert_eq!(policy.route(&load, "m", &prompt(1, 2)), home);
    }
}
