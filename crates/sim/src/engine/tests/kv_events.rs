//! KV cache events: what the engine announces when it registers, evicts and clears blocks,
//! checked against the block pool itself.

use std::collections::HashMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

fn with_events(cfg: EngineConfig) -> Engine {
    let mut e = Engine::new(cfg, h100());
    e.set_kv_events(true);
    e
}

/// Runs the engine until idle; returns the KV event batches.
fn batches_to_end(e: &mut Engine) -> Vec<KvEventBatch> {
    run_to_end(e);
    let mut out = Vec::new();
    e.take_kv_events(&mut out);
    out
}

fn stored(event: &KvCacheEvent) -> Option<&BlockStored> {
    match event {
        KvCacheEvent::BlockStored(s) => Some(s),
        _ => None,
    }
}

fn all_stored(batches: &[KvEventBatch]) -> Vec<&BlockStored> {
    batches
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(stored)
        .collect()
}

fn removed_hashes(batches: &[KvEventBatch]) -> Vec<u64> {
    batches
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(|e| match e {
            KvCacheEvent::BlockRemoved { block_hashes } => Some(block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn a_prefilled_prompt_is_announced_once_with_its_full_blocks_tokens() {
    let mut e = with_events(EngineConfig::default());
    let p = prompt(1, 100);
    e.add_request(Duration::ZERO, spec(p.clone(), 1));
    while let Some(t) = e.next_event_time() {
        e.advance(t);
    }
    let mut tokens = Vec::new();
    e.take_events(&mut tokens);
    let mut batches = Vec::new();
    e.take_kv_events(&mut batches);

    assert_eq!(batches.len(), 1, "one step, one batch: {batches:?}");
    assert_eq!(batches[0].at, tokens[0].at, "stamped with the step's end");
    let [KvCacheEvent::BlockStored(s)] = batches[0].events.as_slice() else {
        panic!("one BlockStored: {:?}", batches[0].events);
    };
    assert_eq!(s.block_hashes.len(), 6, "100 tokens fill 6 blocks of 16");
    assert_eq!(s.parent_block_hash, None);
    assert_eq!(s.token_ids, p[..96]);
    assert_eq!((s.block_size, s.lora.clone()), (16, None));
    for (i, h) in s.block_hashes.iter().enumerate() {
        assert!(e.pool.lookup(*h).is_some(), "block {i} is cached");
    }
    let mut again = Vec::new();
    e.take_kv_events(&mut again);
    assert!(again.is_empty(), "taking drains");
}

#[test]
fn a_prompt_extending_a_cached_prefix_names_its_last_cached_block_as_parent() {
    let mut e = with_events(EngineConfig::default());
    e.add_request(Duration::ZERO, spec(prompt(1, 64), 1));
    let first = batches_to_end(&mut e);
    let now = e.now() + MS;
    let longer = prompt(1, 104);
    e.add_request(now, spec(longer.clone(), 1));
    let second = batches_to_end(&mut e);

    let a = all_stored(&first)[0];
    let b = all_stored(&second);
    assert_eq!(b.len(), 1, "{second:?}");
    assert_eq!(b[0].parent_block_hash, a.block_hashes.last().copied());
    assert_eq!(b[0].block_hashes.len(), 2, "blocks 4 and 5 are new");
    assert_eq!(b[0].token_ids, longer[64..96]);
}

#[test]
fn each_prefill_chunk_is_a_batch_chained_to_the_previous_chunk() {
    let cfg = EngineConfig {
        max_num_batched_tokens: 32,
        ..EngineConfig::default()
    };
    let mut e = with_events(cfg);
    let p = prompt(1, 80);
    e.add_request(Duration::ZERO, spec(p.clone(), 1));
    let batches = batches_to_end(&mut e);

    assert_eq!(batches.len(), 3, "chunks of 32, 32 and 16 tokens");
    assert!(batches.windows(2).all(|w| w[0].at < w[1].at));
    let chunks = all_stored(&batches);
    let sizes: Vec<usize> = chunks.iter().map(|s| s.block_hashes.len()).collect();
    assert_eq!(sizes, [2, 2, 1]);
    assert_eq!(chunks[0].parent_block_hash, None);
    for pair in chunks.windows(2) {
        assert_eq!(
            pair[1].parent_block_hash,
            pair[0].block_hashes.last().copied()
        );
    }
    let tokens: Vec<u32> = chunks.iter().flat_map(|s| s.token_ids.clone()).collect();
    assert_eq!(tokens, p);
}

#[test]
fn allocation_that_takes_cached_blocks_announces_each_evicted_hash_first() {
    let cfg = EngineConfig {
        num_gpu_blocks: 8,
        ..EngineConfig::default()
    };
    let mut e = with_events(cfg);
    e.add_request(Duration::ZERO, spec(prompt(1, 64), 1));
    let first = batches_to_end(&mut e);
    let a = all_stored(&first)[0].block_hashes.clone();
    let now = e.now() + MS;
    e.add_request(now, spec(prompt(2, 100), 1));
    let second = batches_to_end(&mut e);

    // The free queue holds the four never-used blocks, then A's blocks tail first: B's seven
    // blocks take the never-used ones, then A's last three.
    assert_eq!(second.len(), 1);
    let events = &second[0].events;
    let expected_removed: Vec<KvCacheEvent> = [a[3], a[2], a[1]]
        .into_iter()
        .map(|h| KvCacheEvent::BlockRemoved {
            block_hashes: vec![h],
        })
        .collect();
    assert_eq!(events[..3], expected_removed);
    assert!(matches!(events[3], KvCacheEvent::BlockStored(_)));
    assert_eq!(events.len(), 4);
    assert!(
        e.pool.lookup(a[0]).is_some(),
        "A's first block is still cached"
    );
    assert!(e.pool.lookup(a[1]).is_none());
}

#[test]
fn a_block_recomputed_beside_its_cached_copy_is_announced_and_removed_twice() {
    let cfg = EngineConfig {
        num_gpu_blocks: 10,
        ..EngineConfig::default()
    };
    let mut e = with_events(cfg);
    e.add_request(Duration::ZERO, spec(prompt(1, 64), 1));
    let first = all_stored(&batches_to_end(&mut e))[0].block_hashes.clone();
    // The same prompt again: vLLM recomputes the last token, so the fourth block is computed
    // anew beside its cached copy, and registered (and announced) a second time.
    let now = e.now() + MS;
    e.add_request(now, spec(prompt(1, 64), 1));
    let second = batches_to_end(&mut e);
    let again = all_stored(&second);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].block_hashes, [first[3]]);
    assert_eq!(again[0].parent_block_hash, Some(first[2]));

    let now = e.now() + MS;
    e.add_request(now, spec(prompt(3, 150), 1));
    let mut removals: HashMap<u64, usize> = HashMap::new();
    for h in removed_hashes(&batches_to_end(&mut e)) {
        *removals.entry(h).or_default() += 1;
    }
    let counts: Vec<usize> = first.iter().map(|h| removals[h]).collect();
    assert_eq!(
        counts,
        [1, 1, 1, 2],
        "both copies of the fourth block are evicted"
    );
}

#[test]
fn adapters_are_named_and_numbered_in_the_order_the_engine_first_saw_them() {
    let mut e = with_events(EngineConfig::default());
    e.preload_adapter("chat");
    let mut sql = spec(prompt(1, 32), 1);
    sql.adapter = Some("sql".into());
    let mut chat = spec(prompt(1, 32), 1);
    chat.adapter = Some("chat".into());
    e.add_request(Duration::ZERO, sql);
    e.add_request(Duration::ZERO, chat);
    e.add_request(Duration::ZERO, spec(prompt(1, 32), 1));
    let batches = batches_to_end(&mut e);

    let mut by_adapter: HashMap<Option<String>, &BlockStored> = HashMap::new();
    for s in all_stored(&batches) {
        by_adapter.insert(s.lora.as_ref().map(|l| l.name.clone()), s);
    }
    let lora = |name: &str| by_adapter[&Some(name.to_string())].lora.clone();
    assert_eq!(
        lora("chat"),
        Some(StoredLora {
            id: 1,
            name: "chat".into()
        })
    );
    assert_eq!(
        lora("sql"),
        Some(StoredLora {
            id: 2,
            name: "sql".into()
        })
    );
    let base = by_adapter[&None];
    let sql = by_adapter[&Some("sql".to_string())];
    assert_eq!(base.token_ids, sql.token_ids);
    assert_ne!(
        base.block_hashes, sql.block_hashes,
        "the adapter is part of the hash"
    );
}

/// Blocks announced and not yet removed, as a consumer of the events would keep them.
#[derive(Default)]
struct Ledger {
    live: HashMap<u64, usize>,
    stores: usize,
    removals: usize,
}

impl Ledger {
    fn apply(&mut self, batches: &mut Vec<KvEventBatch>) {
        for batch in batches.drain(..) {
            for event in batch.events {
                match event {
                    KvCacheEvent::BlockStored(s) => {
                        assert_eq!(s.token_ids.len(), s.block_hashes.len() * 16);
                        if let Some(parent) = s.parent_block_hash {
                            assert!(self.live.contains_key(&parent), "the parent is cached");
                        }
                        for h in s.block_hashes {
                            *self.live.entry(h).or_default() += 1;
                            self.stores += 1;
                        }
                    }
                    KvCacheEvent::BlockRemoved { block_hashes } => {
                        for h in block_hashes {
                            let n = self.live.get_mut(&h).expect("only announced blocks go");
                            *n -= 1;
                            if *n == 0 {
                                self.live.remove(&h);
                            }
                            self.removals += 1;
                        }
                    }
                    KvCacheEvent::AllBlocksCleared => self.live.clear(),
                }
            }
        }
    }
}

#[test]
fn the_announced_blocks_always_match_the_pool_through_a_busy_run() {
    let cfg = EngineConfig {
        num_gpu_blocks: 48,
        max_num_batched_tokens: 96,
        max_loras: 2,
        lora_load: 5 * MS,
        seed: 3,
        ..EngineConfig::default()
    };
    let mut e = with_events(cfg);
    let mut rng = SmallRng::seed_from_u64(17);
    let mut now = Duration::ZERO;
    let mut ledger = Ledger::default();
    let mut batches = Vec::new();
    for i in 0..120u32 {
        now += MS * rng.random_range(0..15);
        let shared = rng.random_range(0..4);
        let mut p = prompt(shared, rng.random_range(16..120));
        p.extend(prompt(1_000 + i, rng.random_range(0..60)));
        let mut r = spec(p, rng.random_range(1..40));
        r.adapter = match rng.random_range(0..4) {
            0 => Some("a".into()),
            1 => Some("b".into()),
            _ => None,
        };
        e.add_request(now, r);
        e.take_kv_events(&mut batches);
        ledger.apply(&mut batches);
    }
    run_to_end(&mut e);
    e.take_kv_events(&mut batches);
    ledger.apply(&mut batches);

    let mut in_pool: HashMap<u64, usize> = HashMap::new();
    for h in e.pool.registered_hashes() {
        *in_pool.entry(h).or_default() += 1;
    }
    assert_eq!(
        ledger.live, in_pool,
        "announced = registered, copies included"
    );
    assert!(
        ledger.stores > 200 && ledger.removals > 100,
        "a busy run: {} stored, {} removed",
        ledger.stores,
        ledger.removals
    );
    assert!(e.stats().preemptions > 0, "preemption is exercised too");
}

#[test]
fn events_change_nothing_the_engine_does() {
    let trace = |on: bool| {
        let cfg = EngineConfig {
            num_gpu_blocks: 40,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg, h100());
        e.set_kv_events(on);
        for i in 0..20u32 {
            e.add_request(MS * (i * 3), spec(prompt(i % 4, 60 + i * 7), 10 + i));
        }
        let events = run_to_end(&mut e);
        (events, e.stats().preemptions, e.stats().prefix_cache_hits)
    };
    assert_eq!(trace(true), trace(false));
}

#[test]
fn nothing_is_recorded_when_off_or_without_prefix_caching() {
    let mut off = Engine::new(EngineConfig::default(), h100());
    off.add_request(Duration::ZERO, spec(prompt(1, 100), 1));
    assert!(batches_to_end(&mut off).is_empty());

    let cfg = EngineConfig {
        enable_prefix_caching: false,
        ..EngineConfig::default()
    };
    let mut no_cache = with_events(cfg);
    assert!(!no_cache.kv_events_enabled(), "vLLM registers no blocks");
    no_cache.add_request(Duration::ZERO, spec(prompt(1, 100), 1));
    assert!(batches_to_end(&mut no_cache).is_empty());

    let mut switched = with_events(EngineConfig::default());
    switched.add_request(Duration::ZERO, spec(prompt(1, 100), 1));
    run_to_end(&mut switched);
    switched.set_kv_events(false);
    let mut out = Vec::new();
    switched.take_kv_events(&mut out);
    assert!(out.is_empty(), "switching off drops what was not taken");
}

#[test]
fn a_prefix_cache_reset_clears_everything_but_not_while_a_request_holds_blocks() {
    let mut e = with_events(EngineConfig::default());
    let id = e.add_request(Duration::ZERO, spec(prompt(1, 1000), 50));
    e.advance(100 * MS);
    assert!(!e.reset_prefix_cache(100 * MS), "a request holds blocks");
    e.abort(100 * MS, id);
    let mut before = Vec::new();
    e.take_kv_events(&mut before);
    assert!(!before.is_empty());

    assert!(e.reset_prefix_cache(101 * MS));
    let mut batches = Vec::new();
    e.take_kv_events(&mut batches);
    assert_eq!(
        batches,
        [KvEventBatch {
            at: 101 * MS,
            events: vec![KvCacheEvent::AllBlocksCleared],
        }]
    );
    assert!(e.pool.registered_hashes().is_empty());
    let again = e.add_request(102 * MS, spec(prompt(1, 1000), 1));
    assert_eq!(summaries(&run_to_end(&mut e))[&again].cached_tokens, 0);
}
