//! Cost of prefix matching and recording when many pods hold the same system prompt,
//! and the index's memory per remembered (pod, block).
//! Run: `cargo bench -p kvroute-core --bench prefix_index`.
//!
//! Every pod has been sent one shared system prompt (2 KiB or 16 KiB, 32 or 256 blocks)
//! followed by a 1 KiB user turn of its own; the measured request carries the system
//! prompt and a new user turn. Targets: match cost linear in the request's blocks and
//! independent of how many pods hold the prompt; ≤ 48 bytes per (pod, block).

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

use kvroute_core::fleet::{PodView, PrefixIndex, Snapshot, block_hashes};

mod support;
use support::live_bytes;

const CAPACITY_TOKENS: u64 = 400_000;

fn endpoint(i: usize) -> SocketAddr {
    SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8000))
}

fn text(seed: usize, bytes: usize) -> Vec<u8> {
    (0..bytes)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i * 7) % 251) as u8)
        .collect()
}

fn prompt(system: &[u8], user_seed: usize) -> Vec<u64> {
    let mut prompt = system.to_vec();
    prompt.extend(text(user_seed + 1_000_000, 1024));
    block_hashes("llama", 0, &prompt)
}

fn snapshot(pods: usize) -> Snapshot {
    let views = (0..pods)
        .map(|i| PodView::new(endpoint(i), true, None, None, None))
        .collect();
    Snapshot::new(views, 1, 1)
}

/// An index in which each of `pods` pods was sent the system prompt and a turn of its own.
fn filled(pods: usize, system: &[u8], snapshot: &Snapshot) -> PrefixIndex {
    let index = PrefixIndex::new();
    index.follow(snapshot);
    for i in 0..pods {
        index.record(endpoint(i), &prompt(system, i), CAPACITY_TOKENS);
    }
    index
}

fn bench_shared_prompt(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefix_index");
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    for system_bytes in [2048usize, 16384] {
        let system = text(7, system_bytes);
        for pods in [100usize, 300, 1000] {
            let snapshot = snapshot(pods);
            let index = filled(pods, &system, &snapshot);
            let request = prompt(&system, usize::MAX / 2);
            let label = format!("{}KiB/{pods}", system_bytes / 1024);
            group.bench_with_input(BenchmarkId::new("match", &label), &request, |b, r| {
                b.iter(|| index.matches(black_box(r), &snapshot))
            });
            let mut turn = 0usize;
            group.bench_with_input(BenchmarkId::new("record", &label), &system, |b, s| {
                // A new turn each time on one pod: the system prompt's blocks are
                // refreshed and the turn's blocks are new.
                let prompts: Vec<Vec<u64>> = (0..64).map(|t| prompt(s, pods + t)).collect();
                b.iter(|| {
                    turn += 1;
                    index.record(endpoint(turn % pods), &prompts[turn % 64], CAPACITY_TOKENS)
                })
            });
        }
    }
    group.finish();
}

/// Live bytes per remembered (pod, block), printed (not timed): right after filling, and
/// in a steady state where every pod forgets blocks (its order queue then carries
/// outdated entries and the maps have grown and shrunk).
fn report_memory(_: &mut Criterion) {
    for (system_bytes, pods) in [(0usize, 1000usize), (16384, 1000)] {
        let system = text(7, system_bytes);
        let snapshot = snapshot(pods);
        let before = live_bytes();
        let index = filled(pods, &system, &snapshot);
        let bytes = live_bytes().saturating_sub(before);
        report(
            &format!("{system_bytes} B shared prompt + 1 KiB turn each"),
            pods,
            &index,
            bytes,
        );
    }
    // 300 pods of 1,000 blocks (16k tokens) each, sent the 16 KiB system prompt with 40
    // turns of 2 KiB each: 1,536 blocks per pod, so each forgets its oldest turns.
    let (pods, system) = (300usize, text(7, 16384));
    let snapshot = snapshot(pods);
    let before = live_bytes();
    let index = PrefixIndex::new();
    index.follow(&snapshot);
    for turn in 0..40 {
        for i in 0..pods {
            let mut prompt = system.clone();
            prompt.extend(text(turn * pods + i, 2048));
            index.record(endpoint(i), &block_hashes("llama", 0, &prompt), 16_000);
        }
    }
    let bytes = live_bytes().saturating_sub(before);
    report(
        "16 KiB shared prompt + 40 turns of 2 KiB, 1,000-block pools",
        pods,
        &index,
        bytes,
    );
}

fn report(case: &str, pods: usize, index: &PrefixIndex, bytes: usize) {
    let entries: usize = (0..pods).map(|i| index.held(endpoint(i))).sum();
    println!(
        "prefix_index memory: {pods} pods, {case}: {entries} (pod, block) entries, \
         {bytes} bytes, {:.1} B per entry",
        bytes as f64 / entries as f64
    );
}

criterion_group!(benches, report_memory, bench_shared_prompt);
criterion_main!(benches);
