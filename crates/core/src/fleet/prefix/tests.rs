use proptest::prelude::*;

use super::*;
use crate::fleet::PodView;

fn pod(port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], port))
}

fn text(seed: u8, blocks: usize) -> Vec<u8> {
    (0..blocks * BLOCK_BYTES)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

fn snapshot(ports: &[u16], version: u64) -> Snapshot {
    let pods = ports
        .iter()
        .map(|&port| PodView::new(pod(port), true, None, None, None))
        .collect();
    Snapshot::new(pods, version, version)
}

/// An index following a snapshot of `ports`.
fn index_for(ports: &[u16]) -> (PrefixIndex, Snapshot) {
    let index = PrefixIndex::new();
    let snapshot = snapshot(ports, 1);
    index.follow(&snapshot);
    (index, snapshot)
}

/// Leading blocks of `blocks` the pod at `port` holds, as a match reports it.
fn matched(index: &PrefixIndex, snapshot: &Snapshot, blocks: &[u64], port: u16) -> u32 {
    let position = snapshot.position(pod(port)).expect("pod in snapshot");
    index.matches(blocks, snapshot).blocks_at(position)
}

/// Leading blocks of `blocks` the pod holds, read block by block from the map.
fn held_prefix(index: &PrefixIndex, port: u16, blocks: &[u64]) -> u32 {
    let slot = index.table().slots[&pod(port)];
    blocks
        .iter()
        .take_while(|&&block| index.shard(block).holder(block, slot).is_some())
        .count() as u32
}

fn order_len(index: &PrefixIndex, port: u16) -> usize {
    let table = index.table();
    let slot = table.slots[&pod(port)];
    let pod = table.pods[slot as usize].clone().expect("slot taken");
    pod.lock().expect("pod lock").order.len()
}

#[test]
fn equal_prefixes_hash_equal_and_the_first_difference_changes_every_later_block() {
    let a = text(1, 4);
    let mut b = a.clone();
    b[BLOCK_BYTES + 3] ^= 0xFF;
    let (ha, hb) = (block_hashes("m", 0, &a), block_hashes("m", 0, &b));
    assert_eq!(ha.len(), 4);
    assert_eq!(ha[0], hb[0]);
    assert!(ha[1..].iter().zip(&hb[1..]).all(|(x, y)| x != y));
}

#[test]
fn the_model_seeds_the_chain_and_a_partial_block_is_left_out() {
    let prompt = text(7, 2);
    assert_ne!(block_hashes("a", 0, &prompt), block_hashes("b", 0, &prompt));
    assert_eq!(
        block_hashes("a", 0, &prompt[..BLOCK_BYTES * 2 - 1]).len(),
        1
    );
}

#[test]
fn a_match_counts_leading_blocks_and_stops_at_the_first_missing_one() {
    let (index, snapshot) = index_for(&[1, 2, 3, 4]);
    let shared = block_hashes("m", 0, &text(1, 8));
    index.record(pod(1), &shared[..6], 0);
    index.record(pod(2), &shared[..2], 0);
    // pod 3 holds later blocks but not the first: no match.
    index.record(pod(3), &shared[1..], 0);
    let matches = index.matches(&shared, &snapshot);
    assert_eq!(matches.request_blocks, 8);
    let at = |port| matches.blocks_at(snapshot.position(pod(port)).expect("pod"));
    assert_eq!(at(1), 6);
    assert_eq!(at(2), 2);
    assert_eq!(at(3), 0);
    assert_eq!(at(4), 0);
}

#[test]
fn pods_holding_a_chain_to_different_depths_each_get_their_own_depth() {
    let ports: Vec<u16> = (1..=40).collect();
    let (index, snapshot) = index_for(&ports);
    let chain = block_hashes("m", 0, &text(3, 64));
    // Pod p holds the first p + 1 blocks (one level per pod), and pod 40 the whole chain.
    for &port in &ports {
        let depth = (usize::from(port) + 1).min(chain.len());
        index.record(pod(port), &chain[..depth], 0);
    }
    let request = block_hashes("m", 0, &text(3, 64));
    let matches = index.matches(&request, &snapshot);
    for &port in &ports {
        let position = snapshot.position(pod(port)).expect("pod");
        assert_eq!(
            matches.blocks_at(position),
            u32::from(port) + 1,
            "pod {port}"
        );
    }
}

#[test]
fn a_pod_forgets_its_least_recently_sent_blocks_beyond_its_kv_pool_tail_first() {
    let (index, snapshot) = index_for(&[1]);
    let old = block_hashes("m", 0, &text(1, 4));
    let new = block_hashes("m", 0, &text(2, 4));
    // Room for 6 blocks of 16 tokens.
    index.record(pod(1), &old, 6 * BLOCK_TOKENS);
    index.record(pod(1), &new, 6 * BLOCK_TOKENS);
    assert_eq!(index.held(pod(1)), 6);
    assert_eq!(index.entries(), 6);
    assert_eq!(
        matched(&index, &snapshot, &old, 1),
        2,
        "the older prompt lost its last two blocks, not its head"
    );
    assert_eq!(matched(&index, &snapshot, &new, 1), 4);
}

#[test]
fn sending_a_prefix_again_makes_it_recent() {
    let (index, snapshot) = index_for(&[1]);
    let a = block_hashes("m", 0, &text(1, 3));
    let b = block_hashes("m", 0, &text(2, 3));
    let c = block_hashes("m", 0, &text(3, 3));
    let capacity = 6 * BLOCK_TOKENS;
    index.record(pod(1), &a, capacity);
    index.record(pod(1), &b, capacity);
    // a sits in the older half of the pod's order, so sending it again moves it.
    index.record(pod(1), &a, capacity);
    index.record(pod(1), &c, capacity);
    assert_eq!(matched(&index, &snapshot, &a, 1), 3, "a was used after b");
    assert_eq!(matched(&index, &snapshot, &b, 1), 0);
    assert_eq!(matched(&index, &snapshot, &c, 1), 3);
}

#[test]
fn a_shared_head_sent_again_with_a_new_tail_stays_older_than_nothing_after_it() {
    // The head is in the newer half (not moved on its own) but a new tail forces it
    // to move too: evicting the pod's oldest blocks must never leave a tail without
    // its head.
    let (index, snapshot) = index_for(&[1]);
    let system = text(9, 4);
    let turn = |seed: u8| {
        let mut prompt = system.clone();
        prompt.extend(text(seed, 2));
        block_hashes("m", 0, &prompt)
    };
    let capacity = 10 * BLOCK_TOKENS;
    for seed in 0..20u8 {
        let blocks = turn(seed);
        index.record(pod(1), &blocks, capacity);
        assert_eq!(matched(&index, &snapshot, &blocks, 1), 6);
        assert_eq!(held_prefix(&index, 1, &blocks), 6);
    }
    // The system prompt is held; of the old turns only the most recent survive.
    assert_eq!(matched(&index, &snapshot, &turn(0), 1), 4);
    assert_eq!(index.held(pod(1)), 10);
}

#[test]
fn repeated_prompts_keep_the_order_queue_bounded() {
    let (index, snapshot) = index_for(&[1]);
    let blocks = block_hashes("m", 0, &text(1, 16));
    let other = block_hashes("m", 0, &text(2, 16));
    for round in 0..1000 {
        index.record(pod(1), if round % 3 == 0 { &other } else { &blocks }, 0);
    }
    let queue = order_len(&index, 1);
    assert!(queue <= 32 + 16 + 64 + 32, "queue grew to {queue}");
    assert_eq!(matched(&index, &snapshot, &blocks, 1), 16);
    assert_eq!(matched(&index, &snapshot, &other, 1), 16);
}

#[test]
fn the_budget_caps_every_pods_share() {
    let index = PrefixIndex::with_max_entries(40);
    let snapshot = snapshot(&[1, 2, 3, 4], 1);
    index.follow(&snapshot);
    for port in 1..=4u16 {
        for seed in 0..5u8 {
            let blocks = block_hashes("m", 0, &text(seed * 10 + port as u8, 8));
            index.record(pod(port), &blocks, 0);
        }
    }
    assert_eq!(index.max_entries(), 40);
    for port in 1..=4 {
        assert_eq!(index.held(pod(port)), 10, "pod {port}");
    }
    assert_eq!(index.entries(), 40);
    // The most recent prompt of each pod survives whole.
    let last = block_hashes("m", 0, &text(40 + 2, 8));
    assert_eq!(matched(&index, &snapshot, &last, 2), 8);
}

#[test]
fn the_default_budget_gives_tables_of_a_fixed_size_and_43_bytes_per_pair_at_most() {
    let sizing = Sizing::for_budget(DEFAULT_BUDGET_BYTES);
    assert_eq!(sizing.shard_limit, 65_536 / 8 * 7);
    let tables = SHARDS * 65_536 * BUCKET_BYTES;
    let queues = sizing.max_entries * ORDER_BYTES;
    assert!(tables + queues <= DEFAULT_BUDGET_BYTES);
    assert!(sizing.max_entries > 3_000_000, "{}", sizing.max_entries);
    assert!(DEFAULT_BUDGET_BYTES / sizing.max_entries <= 43);
    // A budget too small for the smallest tables still holds something.
    assert!(Sizing::for_budget(1000).max_entries >= 1);
}

/// What an index has allocated for its tables (at the size their load says) and queues.
fn allocated_bytes(index: &PrefixIndex) -> usize {
    let tables: usize = index
        .shards
        .iter()
        .map(|shard| {
            let shard = shard.lock().expect("shard lock");
            // A table of B buckets holds 7/8 B: its capacity says its size.
            let capacity = shard.blocks.capacity().max(shard.blocks.len());
            let buckets = (capacity * 8 / 7).next_power_of_two();
            let lists: usize = shard.lists.iter().map(|l| l.capacity() * 8 + 24).sum();
            buckets * BUCKET_BYTES + lists
        })
        .sum();
    let table = index.table();
    let queues: usize = table
        .pods
        .iter()
        .flatten()
        .map(|pod| pod.lock().expect("pod lock").order.capacity() * 8)
        .sum();
    tables + queues
}

/// Unique prompts churn every table (each record adds blocks and evicts as many): the
/// tables must not double under the tombstones this leaves, and the whole stays within the
/// budget.
#[test]
fn the_budget_bounds_what_the_index_allocates_under_churn() {
    let budget = 1 << 20;
    let index = PrefixIndex::with_budget(budget);
    let ports: Vec<u16> = (1..=8).collect();
    let snapshot = snapshot(&ports, 1);
    index.follow(&snapshot);
    let limit = Sizing::for_budget(budget).shard_limit;
    for round in 0..400u32 {
        for &port in &ports {
            let prompt: Vec<u8> = (0..64 * BLOCK_BYTES)
                .map(|i| (i as u32 ^ round.wrapping_mul(2654435761) ^ u32::from(port) << 20) as u8)
                .collect();
            let blocks = block_hashes("m", u64::from(round) << 16 | u64::from(port), &prompt);
            index.record(pod(port), &blocks, 0);
        }
    }
    assert!(index.entries() <= index.max_entries());
    assert!(index.entries() * 10 >= index.max_entries() * 9, "filled");
    for shard in index.shards.iter() {
        let shard = shard.lock().expect("shard lock");
        assert!(
            shard.blocks.capacity() <= limit,
            "a table grew to {} (limit {limit})",
            shard.blocks.capacity()
        );
    }
    let bytes = allocated_bytes(&index);
    assert!(
        bytes <= budget,
        "{bytes} bytes allocated for a {budget}-byte budget"
    );
}

#[test]
fn pods_that_leave_are_forgotten_and_their_slot_reused() {
    let (index, first) = index_for(&[1, 2]);
    let blocks = block_hashes("m", 0, &text(1, 4));
    index.record(pod(1), &blocks, 0);
    index.record(pod(2), &blocks, 0);
    let second = snapshot(&[2, 3], 2);
    let matches = index.matches(&blocks, &second);
    assert_eq!(matches.blocks_at(second.position(pod(2)).expect("pod")), 4);
    assert_eq!(index.entries(), 4, "pod 1's blocks went with it");
    index.record(pod(3), &blocks[..1], 0);
    assert_eq!(
        index.table().pods.len(),
        2,
        "slot of the departed pod reused"
    );
    assert_eq!(matched(&index, &second, &blocks, 3), 1);
    // A record for a pod no longer in the fleet changes nothing.
    index.record(pod(1), &blocks, 0);
    assert_eq!(index.held(pod(1)), 0);
    // A request still holding the first snapshot gets matches by its own positions.
    let old = index.matches(&blocks, &first);
    assert_eq!(old.blocks_at(first.position(pod(2)).expect("pod")), 4);
    assert_eq!(old.blocks_at(first.position(pod(1)).expect("pod")), 0);
}

#[test]
fn concurrent_records_and_matches_keep_the_index_consistent() {
    let ports: Vec<u16> = (1..=8).collect();
    let (index, snapshot) = index_for(&ports);
    let system = text(5, 8);
    std::thread::scope(|scope| {
        for thread in 0..4u8 {
            let (index, snapshot, system) = (&index, &snapshot, &system);
            scope.spawn(move || {
                for i in 0..500u16 {
                    let mut prompt = system.clone();
                    prompt.extend(text(thread.wrapping_mul(7).wrapping_add(i as u8), 3));
                    let blocks = block_hashes("m", 0, &prompt);
                    let port = 1 + (i + u16::from(thread)) % 8;
                    let _ = index.matches(&blocks, snapshot);
                    index.record(pod(port), &blocks, 40 * BLOCK_TOKENS);
                }
            });
        }
    });
    let total: usize = ports.iter().map(|&port| index.held(pod(port))).sum();
    assert_eq!(index.entries(), total);
    let system_blocks = block_hashes("m", 0, &system);
    for &port in &ports {
        assert!(index.held(pod(port)) <= 40);
        assert_eq!(
            matched(&index, &snapshot, &system_blocks, port),
            8,
            "pod {port}"
        );
    }
}

#[test]
fn prompts_under_different_contexts_share_no_block() {
    let prompt = text(1, 4);
    let (plain, weather, stocks) = (
        block_hashes("m", 0, &prompt),
        block_hashes("m", 11, &prompt),
        block_hashes("m", 12, &prompt),
    );
    assert_eq!(plain.len(), 4);
    assert!(
        plain
            .iter()
            .all(|b| !weather.contains(b) && !stocks.contains(b))
    );
    assert!(weather.iter().all(|b| !stocks.contains(b)));
}

proptest! {
    /// Whatever is sent where, every pod's memory stays prefix-closed and within its
    /// capacity, the most recent prompt of each pod is held whole, and a match reports
    /// exactly the leading blocks each pod holds.
    #[test]
    fn matches_agree_with_what_each_pod_holds(
        sends in prop::collection::vec((0u16..5, 0usize..6, 1usize..6), 1..120),
        capacity in 4u64..24,
    ) {
        let ports: Vec<u16> = (0..5).collect();
        let (index, snapshot) = index_for(&ports);
        // A small tree of prompts: six branches off two shared heads.
        let prompts: Vec<Vec<u64>> = (0..6u8)
            .map(|branch| {
                let mut prompt = text(branch % 2, 3);
                prompt.extend(text(100 + branch, 4));
                block_hashes("m", 0, &prompt)
            })
            .collect();
        let mut last: Vec<Option<Vec<u64>>> = vec![None; ports.len()];
        for &(port, branch, len) in &sends {
            let blocks = &prompts[branch][..len.min(prompts[branch].len())];
            index.record(pod(port), blocks, capacity * BLOCK_TOKENS);
            last[port as usize] = Some(blocks.to_vec());
        }
        for prompt in &prompts {
            let matches = index.matches(prompt, &snapshot);
            for &port in &ports {
                let position = snapshot.position(pod(port)).expect("pod");
                prop_assert_eq!(matches.blocks_at(position), held_prefix(&index, port, prompt));
                // Prefix-closed: nothing held past the first block missing.
                let slot = index.table().slots[&pod(port)];
                let prefix = held_prefix(&index, port, prompt) as usize;
                prop_assert!(prompt[prefix..].iter().all(|&b| index.shard(b).holder(b, slot).is_none()));
            }
        }
        for &port in &ports {
            prop_assert!(index.held(pod(port)) as u64 <= capacity);
            if let Some(blocks) = &last[port as usize] {
                let fits = blocks.len().min(capacity as usize);
                prop_assert_eq!(held_prefix(&index, port, blocks) as usize, fits);
            }
        }
        let total: usize = ports.iter().map(|&port| index.held(pod(port))).sum();
        prop_assert_eq!(index.entries(), total);
    }
}
