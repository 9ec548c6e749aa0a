//! Cost of following vLLM's KV events: decoding a published batch, and applying it to the
//! event index; matching a prompt against the index at 1,000 pods; and the index's memory
//! per (pod, block) it holds.
//! Run: `cargo bench -p kvroute-core --bench kv_events`.
//!
//! A steady stream as an engine under load publishes it: each batch is one engine step with
//! 8 requests storing 4 new 16-token blocks each (32 `BlockStored` blocks) and the 32 blocks
//! stored 64 steps earlier evicted (`BlockRemoved`, one per block, as vLLM sends them), in
//! vLLM 0.26's encoding (an array batch of map events). Target: ≥ 200,000 block events a
//! second decoded and indexed on one core.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::net::SocketAddr;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rmp::encode as enc;

use kvroute_core::fleet::{PodView, PrefixIndex, PrefixMatches, Snapshot};
use kvroute_core::kvevents::{
    IndexSink, PodEvents, PrefixSource, TokenBlocks, decode_batch, matches_with_events,
    token_block_hashes,
};

mod support;
use support::live_bytes;

const BLOCK: u32 = 16;
const REQUESTS: u64 = 8;
const BLOCKS_PER_REQUEST: u64 = 4;
/// Steps a block stays cached.
const LIFETIME: u64 = 64;
/// Distinct steps in the cycle replayed (a multiple of the lifetime).
const STEPS: u64 = 4 * LIFETIME;

fn pod() -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], 8000))
}

fn key(out: &mut Vec<u8>, name: &str) {
    enc::write_str(out, name).unwrap();
}

/// The engine hash of block `b` of request `r` at step `s` (distinct over the cycle).
fn hash(s: u64, r: u64, b: u64) -> u64 {
    (s * REQUESTS + r) * BLOCKS_PER_REQUEST + b + 1
}

/// Step `s`'s batch, encoded as vLLM 0.26 publishes it.
fn step(s: u64) -> Vec<u8> {
    let evicted = (s + STEPS - LIFETIME) % STEPS;
    let mut out = Vec::new();
    enc::write_array_len(&mut out, 3).unwrap();
    enc::write_f64(&mut out, 1.7e9 + s as f64).unwrap();
    enc::write_array_len(&mut out, (REQUESTS + REQUESTS * BLOCKS_PER_REQUEST) as u32).unwrap();
    for r in 0..REQUESTS {
        for b in 0..BLOCKS_PER_REQUEST {
            enc::write_map_len(&mut out, 3).unwrap();
            key(&mut out, "type");
            key(&mut out, "BlockRemoved");
            key(&mut out, "block_hashes");
            enc::write_array_len(&mut out, 1).unwrap();
            enc::write_uint(&mut out, hash(evicted, r, b)).unwrap();
            key(&mut out, "medium");
            key(&mut out, "GPU");
        }
    }
    for r in 0..REQUESTS {
        enc::write_map_len(&mut out, 11).unwrap();
        key(&mut out, "type");
        key(&mut out, "BlockStored");
        key(&mut out, "block_hashes");
        enc::write_array_len(&mut out, BLOCKS_PER_REQUEST as u32).unwrap();
        for b in 0..BLOCKS_PER_REQUEST {
            enc::write_uint(&mut out, hash(s, r, b)).unwrap();
        }
        key(&mut out, "parent_block_hash");
        enc::write_nil(&mut out).unwrap();
        key(&mut out, "token_ids");
        enc::write_array_len(&mut out, (BLOCKS_PER_REQUEST as u32) * BLOCK).unwrap();
        for t in 0..BLOCKS_PER_REQUEST * u64::from(BLOCK) {
            enc::write_uint(&mut out, (hash(s, r, 0) * 7919 + t * 104_729) % 128_000).unwrap();
        }
        key(&mut out, "block_size");
        enc::write_uint(&mut out, u64::from(BLOCK)).unwrap();
        key(&mut out, "lora_id");
        enc::write_nil(&mut out).unwrap();
        key(&mut out, "medium");
        key(&mut out, "GPU");
        key(&mut out, "lora_name");
        enc::write_nil(&mut out).unwrap();
        key(&mut out, "extra_keys");
        enc::write_array_len(&mut out, BLOCKS_PER_REQUEST as u32).unwrap();
        for _ in 0..BLOCKS_PER_REQUEST {
            enc::write_nil(&mut out).unwrap();
        }
        key(&mut out, "group_idx");
        enc::write_uint(&mut out, 0).unwrap();
        key(&mut out, "kv_cache_spec_kind");
        key(&mut out, "full_attention");
    }
    enc::write_uint(&mut out, 0).unwrap();
    out
}

fn sink(index: &PrefixIndex, capacity_tokens: u64) -> IndexSink<'_> {
    IndexSink {
        index,
        endpoint: pod(),
        capacity_tokens,
    }
}

fn index() -> PrefixIndex {
    let index = PrefixIndex::new();
    index.follow(&Snapshot::new(
        vec![PodView::new(pod(), true, None, None, None)],
        1,
        1,
    ));
    index
}

fn events(c: &mut Criterion) {
    let batches: Vec<Vec<u8>> = (0..STEPS).map(step).collect();
    let blocks_per_batch = 2 * REQUESTS * BLOCKS_PER_REQUEST;
    let mut group = c.benchmark_group("kv_events");
    group.throughput(Throughput::Elements(blocks_per_batch));
    let mut i = 0usize;
    group.bench_function("decode", |b| {
        b.iter(|| {
            i = (i + 1) % batches.len();
            black_box(decode_batch(&batches[i]).unwrap())
        })
    });
    let index = index();
    let mut state = PodEvents::new();
    // Warm: the index holds LIFETIME steps' blocks from here on.
    let mut seq = 0u64;
    for payload in &batches {
        state.apply(seq, &decode_batch(payload).unwrap(), &mut sink(&index, 0));
        seq += 1;
    }
    group.bench_function("decode_and_apply", |b| {
        b.iter(|| {
            let payload = &batches[(seq % STEPS) as usize];
            let applied = state.apply(seq, &decode_batch(payload).unwrap(), &mut sink(&index, 0));
            seq += 1;
            black_box(applied)
        })
    });
    group.finish();
}

/// Bytes per (pod, block) the event state and the index hold, printed once.
fn memory(_: &mut Criterion) {
    let before = live_bytes();
    let index = index();
    let mut state = PodEvents::new();
    // Stores only: 200,000 blocks held (a large H100 pool).
    let mut seq = 0;
    let mut held = 0u64;
    while held < 200_000 {
        let mut out = Vec::new();
        enc::write_array_len(&mut out, 2).unwrap();
        enc::write_f64(&mut out, 0.0).unwrap();
        enc::write_array_len(&mut out, 1).unwrap();
        enc::write_map_len(&mut out, 5).unwrap();
        key(&mut out, "type");
        key(&mut out, "BlockStored");
        key(&mut out, "block_hashes");
        enc::write_array_len(&mut out, 64).unwrap();
        for b in 0..64 {
            enc::write_uint(&mut out, held + b + 1).unwrap();
        }
        key(&mut out, "parent_block_hash");
        enc::write_nil(&mut out).unwrap();
        key(&mut out, "token_ids");
        enc::write_array_len(&mut out, 64 * BLOCK).unwrap();
        // Token ids no other block repeats (equal tokens would be one chain).
        for t in 0..u64::from(64 * BLOCK) {
            let id = (held * u64::from(64 * BLOCK) + t).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 47;
            enc::write_uint(&mut out, id).unwrap();
        }
        key(&mut out, "block_size");
        enc::write_uint(&mut out, u64::from(BLOCK)).unwrap();
        // The pod's KV capacity in tokens: the index keeps what the pool can hold.
        state.apply(
            seq,
            &decode_batch(&out).unwrap(),
            &mut sink(&index, 4_000_000),
        );
        seq += 1;
        held += 64;
    }
    let bytes = live_bytes() - before;
    println!(
        "kv_events memory: {} blocks held, {} index entries, {:.1} bytes per (pod, block) (event state and index together)",
        state.held(),
        index.entries(),
        bytes as f64 / state.held() as f64
    );
}

/// A 3,000-token context held by two of 1,000 pods by their events, matched as `auto`
/// does, with kvroute's memory naming one of them (the home rule applies) or a pod that
/// lost it (the rule is checked, the events decide).
fn matching(c: &mut Criterion) {
    const PODS: usize = 1000;
    let endpoint = |i: usize| SocketAddr::from(([10, 1, (i / 250) as u8, (i % 250) as u8], 8000));
    let snapshot = Snapshot::new(
        (0..PODS)
            .map(|i| PodView::new(endpoint(i), true, None, None, None))
            .collect(),
        1,
        1,
    );
    let index = PrefixIndex::new();
    index.follow(&snapshot);
    let tokens: Vec<u32> = (0..3000).map(|t| (t * 7919 + 13) % 128_000).collect();
    let blocks = TokenBlocks {
        chains: token_block_hashes(None, &tokens, BLOCK),
        block_tokens: BLOCK,
    };
    for holder in [3, 700] {
        index.record(endpoint(holder), &blocks.chains, 0);
    }
    let text_blocks = 188;
    let mut group = c.benchmark_group("kv_events_matching");
    for (case, home) in [("home_holds", 700), ("home_lost", 5)] {
        let guessed = PrefixMatches::new(text_blocks, &snapshot, &[(endpoint(home), text_blocks)]);
        group.bench_function(case, |b| {
            b.iter(|| {
                black_box(matches_with_events(
                    PrefixSource::Auto,
                    &index,
                    Some(&blocks),
                    guessed.clone(),
                    &snapshot,
                    |_| true,
                ))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, events, matching, memory);
criterion_main!(benches);
