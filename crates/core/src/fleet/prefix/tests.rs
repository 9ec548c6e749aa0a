use super::*;

fn pod(port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], port))
}

fn text(seed: u8, blocks: usize) -> Vec<u8> {
    (0..blocks * BLOCK_BYTES)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
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
    let mut index = PrefixIndex::new();
    let shared = block_hashes("m", 0, &text(1, 8));
    index.record(pod(1), &shared[..6], 0);
    index.record(pod(2), &shared[..2], 0);
    // pod 3 holds later blocks but not the first: no match.
    index.record(pod(3), &shared[1..], 0);
    let matches = index.matches(&shared);
    assert_eq!(matches.request_blocks, 8);
    assert_eq!(matches.blocks_at(pod(1)), 6);
    assert_eq!(matches.blocks_at(pod(2)), 2);
    assert_eq!(matches.blocks_at(pod(3)), 0);
    assert_eq!(matches.blocks_at(pod(4)), 0);
}

#[test]
fn a_pod_forgets_its_least_recently_sent_blocks_beyond_its_kv_pool_tail_first() {
    let mut index = PrefixIndex::new();
    let old = block_hashes("m", 0, &text(1, 4));
    let new = block_hashes("m", 0, &text(2, 4));
    // Room for 6 blocks of 16 tokens.
    index.record(pod(1), &old, 6 * BLOCK_TOKENS);
    index.record(pod(1), &new, 6 * BLOCK_TOKENS);
    assert_eq!(index.held(pod(1)), 6);
    assert_eq!(
        index.matches(&old).blocks_at(pod(1)),
        2,
        "the older prompt lost its last two blocks, not its head"
    );
    assert_eq!(index.matches(&new).blocks_at(pod(1)), 4);
}

#[test]
fn sending_a_prefix_again_makes_it_recent() {
    let mut index = PrefixIndex::new();
    let a = block_hashes("m", 0, &text(1, 3));
    let b = block_hashes("m", 0, &text(2, 3));
    let c = block_hashes("m", 0, &text(3, 3));
    let capacity = 6 * BLOCK_TOKENS;
    index.record(pod(1), &a, capacity);
    index.record(pod(1), &b, capacity);
    index.record(pod(1), &a, capacity);
    index.record(pod(1), &c, capacity);
    assert_eq!(index.matches(&a).blocks_at(pod(1)), 3, "a was used after b");
    assert_eq!(index.matches(&b).blocks_at(pod(1)), 0);
    assert_eq!(index.matches(&c).blocks_at(pod(1)), 3);
}

#[test]
fn repeated_prompts_keep_the_order_queue_bounded() {
    let mut index = PrefixIndex::new();
    let blocks = block_hashes("m", 0, &text(1, 16));
    for _ in 0..1000 {
        index.record(pod(1), &blocks, 32 * BLOCK_TOKENS);
    }
    let queue = index.pods[0].order.len();
    assert!(queue <= 2 * 16 + 1024 + 16, "queue grew to {queue}");
    assert_eq!(index.matches(&blocks).blocks_at(pod(1)), 16);
}

#[test]
fn pods_that_leave_are_forgotten_and_their_slot_reused() {
    let mut index = PrefixIndex::new();
    let blocks = block_hashes("m", 0, &text(1, 4));
    index.record(pod(1), &blocks, 0);
    index.record(pod(2), &blocks, 0);
    index.retain_pods(&[pod(2)]);
    let matches = index.matches(&blocks);
    assert_eq!(matches.blocks_at(pod(1)), 0);
    assert_eq!(matches.blocks_at(pod(2)), 4);
    index.record(pod(3), &blocks[..1], 0);
    assert_eq!(index.pods.len(), 2, "slot of the departed pod reused");
    assert_eq!(index.matches(&blocks).blocks_at(pod(3)), 1);
    assert!(index.holders.values().all(|h| h.len() <= 2));
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
