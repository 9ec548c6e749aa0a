//! KV blocks of the engine's sequences: growing a running sequence, recompute preemption of
//! the newest one when the pool is short, and admission of a waiting one with prefix-cache hits.

use crate::kv::BlockId;

use super::{Engine, Place, RequestId, SimTime};

impl Engine {
    /// Blocks a sequence must hold to have `tokens` tokens in KV.
    fn blocks_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.cfg.block_size) as usize
    }

    /// Allocates blocks so `seq` can hold `num_computed + n` tokens; false if the pool is short.
    pub(super) fn grow(&mut self, id: RequestId, n: u32) -> bool {
        let Some(seq) = self.seqs.get(&id) else {
            return false;
        };
        let need = self
            .blocks_for(seq.num_computed + n)
            .saturating_sub(seq.blocks.len());
        if need > self.pool.num_free() as usize {
            return false;
        }
        let mut new = Vec::with_capacity(need);
        for _ in 0..need {
            match self.pool.allocate_evicting() {
                Some((b, evicted)) => {
                    new.push(b);
                    self.note_eviction(evicted);
                }
                None => break,
            }
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.blocks.extend(new);
        }
        true
    }

    /// Frees the newest running request's blocks and requeues it at the front.
    pub(super) fn preempt_newest(&mut self) -> Option<RequestId> {
        let victim = self.running.pop()?;
        let seq = self.seqs.get_mut(&victim)?;
        let blocks = std::mem::take(&mut seq.blocks);
        seq.num_computed = 0;
        seq.num_registered = 0;
        seq.preemptions += 1;
        seq.place = Place::Waiting;
        let adapter = seq.adapter;
        self.pool.free(blocks.into_iter().rev());
        self.count_adapter(adapter, Place::Running, false);
        self.count_adapter(adapter, Place::Waiting, true);
        self.waiting.push_front(victim);
        self.stats.preemptions += 1;
        Some(victim)
    }

    /// Tries to move waiting request `id` into the batch; false if the KV pool is short.
    pub(super) fn admit(
        &mut self,
        id: RequestId,
        t: SimTime,
        batch: &mut Vec<(RequestId, u32)>,
        budget: &mut u32,
    ) -> bool {
        let bs = self.cfg.block_size;
        let caching = self.cfg.enable_prefix_caching;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return true;
        };
        seq.extend_hashes(bs);
        let total = seq.tokens.len() as u32;
        // vLLM always recomputes at least the last token.
        let max_hit_blocks = ((total.saturating_sub(1)) / bs) as usize;
        let mut hits: Vec<BlockId> = Vec::new();
        if caching {
            for &h in seq.hashes.iter().take(max_hit_blocks) {
                match self.pool.lookup(h) {
                    Some(b) => hits.push(b),
                    None => break,
                }
            }
        }
        let hit_tokens = hits.len() as u32 * bs;
        let n = (total - hit_tokens).min(*budget);
        let need_new = (hit_tokens + n).div_ceil(bs) as usize - hits.len();
        let hits_free = hits.iter().filter(|&&b| self.pool.is_free(b)).count();
        if need_new + hits_free > self.pool.num_free() as usize {
            return false;
        }
        for &b in &hits {
            self.pool.touch(b);
        }
        let mut blocks = hits;
        let num_hits = blocks.len();
        for _ in 0..need_new {
            if let Some((b, evicted)) = self.pool.allocate_evicting() {
                blocks.push(b);
                self.note_eviction(evicted);
            }
        }
        self.stats.prefix_cache_queries += u64::from(total);
        self.stats.prefix_cache_hits += u64::from(hit_tokens);
        let Some(seq) = self.seqs.get_mut(&id) else {
            return true;
        };
        seq.blocks = blocks;
        seq.num_registered = num_hits;
        seq.num_computed = hit_tokens;
        seq.cached_tokens.get_or_insert(hit_tokens);
        seq.first_scheduled.get_or_insert(t);
        seq.place = Place::Running;
        let adapter = seq.adapter;
        self.count_adapter(adapter, Place::Waiting, false);
        self.count_adapter(adapter, Place::Running, true);
        self.running.push(id);
        batch.push((id, n));
        *budget -= n;
        true
    }
}
