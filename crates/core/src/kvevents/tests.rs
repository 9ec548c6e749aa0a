//! Event batches are encoded here with `rmp` in the shapes msgspec gives them (field order
//! and omissions as vLLM's structs declare them), then decoded and applied to an index.

use std::net::SocketAddr;

use rmp::encode as enc;

use super::*;
use crate::fleet::{PodView, PrefixIndex, Snapshot};

fn pod(port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 2], port))
}

fn index_for(ports: &[u16]) -> (PrefixIndex, Snapshot) {
    let pods = ports
        .iter()
        .map(|&port| PodView::new(pod(port), true, None, None, None))
        .collect();
    let snapshot = Snapshot::new(pods, 1, 1);
    let index = PrefixIndex::new();
    index.follow(&snapshot);
    (index, snapshot)
}

const BS: u32 = 4;

/// A stored event as current vLLM sends it: a map, `type` first, fields in declaration
/// order, the defaulted ones (`extra_keys`, `group_idx`, …) left out.
fn stored_map(out: &mut Vec<u8>, hashes: &[u64], parent: Option<u64>, tokens: &[u32]) {
    stored_map_with(out, hashes, parent, tokens, None, "GPU");
}

fn stored_map_with(
    out: &mut Vec<u8>,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    lora: Option<(u64, &str)>,
    medium: &str,
) {
    enc::write_map_len(out, 8).expect("vec");
    enc::write_str(out, "type").expect("vec");
    enc::write_str(out, "BlockStored").expect("vec");
    enc::write_str(out, "block_hashes").expect("vec");
    enc::write_array_len(out, hashes.len() as u32).expect("vec");
    for &h in hashes {
        enc::write_uint(out, h).expect("vec");
    }
    enc::write_str(out, "parent_block_hash").expect("vec");
    match parent {
        Some(h) => drop(enc::write_uint(out, h).expect("vec")),
        None => enc::write_nil(out).expect("vec"),
    }
    enc::write_str(out, "token_ids").expect("vec");
    enc::write_array_len(out, tokens.len() as u32).expect("vec");
    for &t in tokens {
        enc::write_uint(out, u64::from(t)).expect("vec");
    }
    enc::write_str(out, "block_size").expect("vec");
    enc::write_uint(out, u64::from(BS)).expect("vec");
    enc::write_str(out, "lora_id").expect("vec");
    match lora {
        Some((id, _)) => drop(enc::write_uint(out, id).expect("vec")),
        None => enc::write_nil(out).expect("vec"),
    }
    enc::write_str(out, "medium").expect("vec");
    enc::write_str(out, medium).expect("vec");
    enc::write_str(out, "lora_name").expect("vec");
    match lora {
        Some((_, name)) => enc::write_str(out, name).expect("vec"),
        None => enc::write_nil(out).expect("vec"),
    }
}

fn removed_map(out: &mut Vec<u8>, hashes: &[u64]) {
    enc::write_map_len(out, 3).expect("vec");
    enc::write_str(out, "type").expect("vec");
    enc::write_str(out, "BlockRemoved").expect("vec");
    enc::write_str(out, "block_hashes").expect("vec");
    enc::write_array_len(out, hashes.len() as u32).expect("vec");
    for &h in hashes {
        enc::write_uint(out, h).expect("vec");
    }
    enc::write_str(out, "medium").expect("vec");
    enc::write_str(out, "GPU").expect("vec");
}

/// A batch map around `events` already encoded (`n` of them).
fn batch_map(n: u32, events: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    enc::write_map_len(&mut out, 3).expect("vec");
    enc::write_str(&mut out, "ts").expect("vec");
    enc::write_f64(&mut out, 1_764_900_000.25).expect("vec");
    enc::write_str(&mut out, "events").expect("vec");
    enc::write_array_len(&mut out, n).expect("vec");
    out.extend_from_slice(events);
    enc::write_str(&mut out, "data_parallel_rank").expect("vec");
    enc::write_uint(&mut out, 0).expect("vec");
    out
}

fn tokens(from: u32, blocks: u32) -> Vec<u32> {
    (from..from + blocks * BS).collect()
}

fn decoded(payload: &[u8]) -> EventBatch {
    decode_batch(payload).expect("decodes")
}

#[test]
fn a_batch_of_current_vllm_decodes_field_by_field() {
    let mut events = Vec::new();
    stored_map_with(
        &mut events,
        &[11, 12],
        Some(10),
        &tokens(100, 2),
        Some((3, "finance")),
        "GPU",
    );
    removed_map(&mut events, &[7]);
    let batch = decoded(&batch_map(2, &events));
    assert_eq!(batch.ts, 1_764_900_000.25);
    assert_eq!(batch.data_parallel_rank, Some(0));
    assert_eq!(
        batch.events,
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![11, 12],
                parent_block_hash: Some(10),
                token_ids: tokens(100, 2),
                block_size: BS,
                lora_id: Some(3),
                lora_name: Some("finance".into()),
                medium: Some("GPU".into()),
                keyed: false,
                group_idx: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![7],
                medium: Some("GPU".into()),
                group_idx: None,
            }),
        ]
    );
}

#[test]
fn an_array_like_batch_of_an_older_vllm_decodes() {
    // vLLM 0.9: `[ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id],
    // ["BlockRemoved", hashes], ["AllBlocksCleared"]]]`.
    let mut out = Vec::new();
    enc::write_array_len(&mut out, 2).expect("vec");
    enc::write_f64(&mut out, 2.5).expect("vec");
    enc::write_array_len(&mut out, 3).expect("vec");
    enc::write_array_len(&mut out, 6).expect("vec");
    enc::write_str(&mut out, "BlockStored").expect("vec");
    enc::write_array_len(&mut out, 1).expect("vec");
    enc::write_uint(&mut out, u64::MAX).expect("vec");
    enc::write_nil(&mut out).expect("vec");
    enc::write_array_len(&mut out, BS).expect("vec");
    for t in 0..BS {
        enc::write_uint(&mut out, u64::from(t)).expect("vec");
    }
    enc::write_uint(&mut out, u64::from(BS)).expect("vec");
    enc::write_nil(&mut out).expect("vec");
    enc::write_array_len(&mut out, 2).expect("vec");
    enc::write_str(&mut out, "BlockRemoved").expect("vec");
    enc::write_array_len(&mut out, 1).expect("vec");
    enc::write_uint(&mut out, 5).expect("vec");
    enc::write_array_len(&mut out, 1).expect("vec");
    enc::write_str(&mut out, "AllBlocksCleared").expect("vec");
    let batch = decoded(&out);
    assert_eq!(batch.ts, 2.5);
    assert_eq!(batch.data_parallel_rank, None);
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("{:?}", batch.events[0]);
    };
    assert_eq!(stored.block_hashes, vec![u64::MAX]);
    assert_eq!(stored.parent_block_hash, None);
    assert_eq!(stored.token_ids, tokens(0, 1));
    assert_eq!(stored.medium, None);
    assert_eq!(
        batch.events[1],
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![5],
            medium: None,
            group_idx: None
        })
    );
    assert_eq!(batch.events[2], KvEvent::AllBlocksCleared);
}

#[test]
fn byte_hashes_read_as_the_integer_vllm_would_have_sent() {
    // With VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, hashes are the 32 sha256 bytes; the
    // integer form is their last eight bytes, big-endian.
    let mut digest = [0xAAu8; 32];
    digest[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    let mut events = Vec::new();
    enc::write_map_len(&mut events, 2).expect("vec");
    enc::write_str(&mut events, "type").expect("vec");
    enc::write_str(&mut events, "BlockRemoved").expect("vec");
    enc::write_str(&mut events, "block_hashes").expect("vec");
    enc::write_array_len(&mut events, 1).expect("vec");
    enc::write_bin(&mut events, &digest).expect("vec");
    let batch = decoded(&batch_map(1, &events));
    assert_eq!(
        batch.events[0],
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![0x0102_0304_0506_0708],
            medium: None,
            group_idx: None
        })
    );
}

#[test]
fn fields_and_event_types_a_newer_vllm_adds_are_passed_over() {
    let mut events = Vec::new();
    enc::write_map_len(&mut events, 2).expect("vec");
    enc::write_str(&mut events, "type").expect("vec");
    enc::write_str(&mut events, "BlockPinned").expect("vec");
    enc::write_str(&mut events, "pins").expect("vec");
    enc::write_array_len(&mut events, 1).expect("vec");
    enc::write_map_len(&mut events, 1).expect("vec");
    enc::write_str(&mut events, "deep").expect("vec");
    enc::write_f32(&mut events, 0.5).expect("vec");
    enc::write_map_len(&mut events, 3).expect("vec");
    enc::write_str(&mut events, "block_hashes").expect("vec");
    enc::write_array_len(&mut events, 1).expect("vec");
    enc::write_uint(&mut events, 9).expect("vec");
    enc::write_str(&mut events, "kv_cache_spec_kind").expect("vec");
    enc::write_str(&mut events, "full_attention").expect("vec");
    // The tag may come last in a map.
    enc::write_str(&mut events, "type").expect("vec");
    enc::write_str(&mut events, "BlockRemoved").expect("vec");
    let batch = decoded(&batch_map(2, &events));
    assert_eq!(batch.events[0], KvEvent::Other);
    assert!(matches!(&batch.events[1], KvEvent::BlockRemoved(r) if r.block_hashes == [9]));
}

#[test]
fn broken_batches_are_errors_that_name_what_is_wrong() {
    let mut events = Vec::new();
    stored_map(&mut events, &[1], None, &tokens(0, 1));
    let good = batch_map(1, &events);
    for end in 0..good.len() {
        assert!(decode_batch(&good[..end]).is_err(), "cut at {end}");
    }
    let mut trailing = good.clone();
    trailing.push(0xc0);
    assert_eq!(decode_batch(&trailing), Err(DecodeError::Trailing(1)));
    let mut missing = Vec::new();
    enc::write_map_len(&mut missing, 1).expect("vec");
    enc::write_str(&mut missing, "type").expect("vec");
    enc::write_str(&mut missing, "BlockStored").expect("vec");
    assert_eq!(
        decode_batch(&batch_map(1, &missing)),
        Err(DecodeError::Missing {
            event: "BlockStored",
            field: "block_hashes"
        })
    );
    assert!(decode_batch(b"not msgpack at all").is_err());
}

/// Applies one batch of encoded events as sequence `seq`.
fn apply(
    state: &mut PodEvents,
    index: &PrefixIndex,
    port: u16,
    seq: u64,
    n: u32,
    events: &[u8],
) -> Applied {
    state.apply(seq, &decoded(&batch_map(n, events)), &mut sink(index, port))
}

fn sink(index: &PrefixIndex, port: u16) -> IndexSink<'_> {
    IndexSink {
        index,
        endpoint: pod(port),
        capacity_tokens: 0,
    }
}

fn matched(index: &PrefixIndex, snapshot: &Snapshot, chains: &[u64], port: u16) -> u32 {
    let position = snapshot.position(pod(port)).expect("pod");
    index.matches(chains, snapshot).blocks_at(position)
}

#[test]
fn stored_blocks_match_a_request_with_the_same_tokens_whatever_the_engines_hash() {
    let (index, snapshot) = index_for(&[1, 2]);
    let mut a = PodEvents::new();
    let mut b = PodEvents::new();
    let prompt = tokens(500, 3);
    // Two engines with different hash seeds store the same tokens in two events each.
    let mut events = Vec::new();
    stored_map(&mut events, &[0xA1, 0xA2], None, &prompt[..8]);
    stored_map(&mut events, &[0xA3], Some(0xA2), &prompt[8..12]);
    let applied = apply(&mut a, &index, 1, 0, 2, &events);
    assert_eq!(applied.stored, 3);
    let mut events = Vec::new();
    stored_map(&mut events, &[0xB1], None, &prompt[..4]);
    apply(&mut b, &index, 2, 0, 1, &events);

    let mut request = prompt.clone();
    request.extend([1, 2, 3]); // a partial block after the shared three
    let chains = token_block_hashes(None, &request, BS);
    assert_eq!(chains.len(), 3);
    assert_eq!(matched(&index, &snapshot, &chains, 1), 3);
    assert_eq!(matched(&index, &snapshot, &chains, 2), 1);
    let other = token_block_hashes(None, &tokens(501, 3), BS);
    assert!(!index.matches(&other, &snapshot).any());
}

#[test]
fn an_evicted_block_ends_the_match_where_the_engine_would_miss() {
    let (index, snapshot) = index_for(&[1]);
    let mut state = PodEvents::new();
    let prompt = tokens(0, 4);
    let mut events = Vec::new();
    stored_map(&mut events, &[1, 2, 3, 4], None, &prompt);
    apply(&mut state, &index, 1, 0, 1, &events);
    let chains = token_block_hashes(None, &prompt, BS);
    assert_eq!(matched(&index, &snapshot, &chains, 1), 4);
    let mut events = Vec::new();
    removed_map(&mut events, &[4, 3]);
    let applied = apply(&mut state, &index, 1, 1, 1, &events);
    assert_eq!(applied.removed, 2);
    assert_eq!(matched(&index, &snapshot, &chains, 1), 2);
    assert_eq!(index.held(pod(1)), 2);
    assert_eq!(state.held(), 2);
}

#[test]
fn a_hash_stored_twice_is_held_until_both_copies_are_evicted() {
    let (index, snapshot) = index_for(&[1]);
    let mut state = PodEvents::new();
    let prompt = tokens(0, 1);
    let mut events = Vec::new();
    stored_map(&mut events, &[1], None, &prompt);
    stored_map(&mut events, &[1], None, &prompt);
    apply(&mut state, &index, 1, 0, 2, &events);
    let chains = token_block_hashes(None, &prompt, BS);
    let mut events = Vec::new();
    removed_map(&mut events, &[1]);
    apply(&mut state, &index, 1, 1, 1, &events);
    assert_eq!(matched(&index, &snapshot, &chains, 1), 1, "one copy left");
    apply(&mut state, &index, 1, 2, 1, &events);
    assert_eq!(matched(&index, &snapshot, &chains, 1), 0);
}

#[test]
fn blocks_under_an_adapter_match_only_that_adapters_requests() {
    let (index, snapshot) = index_for(&[1]);
    let mut state = PodEvents::new();
    let prompt = tokens(0, 2);
    let mut events = Vec::new();
    stored_map_with(
        &mut events,
        &[1, 2],
        None,
        &prompt,
        Some((1, "legal")),
        "GPU",
    );
    apply(&mut state, &index, 1, 0, 1, &events);
    let legal = token_block_hashes(Some("legal"), &prompt, BS);
    assert_eq!(matched(&index, &snapshot, &legal, 1), 2);
    let base = token_block_hashes(None, &prompt, BS);
    assert_eq!(matched(&index, &snapshot, &base, 1), 0);
    let finance = token_block_hashes(Some("finance"), &prompt, BS);
    assert_eq!(matched(&index, &snapshot, &finance, 1), 0);
}

#[test]
fn blocks_kvroute_cannot_match_from_text_are_left_out_and_counted() {
    let (index, _) = index_for(&[1]);
    let mut state = PodEvents::new();
    let mut events = Vec::new();
    // Offloaded to CPU; an adapter named only by id (older vLLM); a child whose parent
    // was stored before kvroute subscribed.
    stored_map_with(&mut events, &[1], None, &tokens(0, 1), None, "CPU");
    enc::write_array_len(&mut events, 6).expect("vec");
    enc::write_str(&mut events, "BlockStored").expect("vec");
    enc::write_array_len(&mut events, 1).expect("vec");
    enc::write_uint(&mut events, 2).expect("vec");
    enc::write_nil(&mut events).expect("vec");
    enc::write_array_len(&mut events, BS).expect("vec");
    for t in 0..BS {
        enc::write_uint(&mut events, u64::from(t)).expect("vec");
    }
    enc::write_uint(&mut events, u64::from(BS)).expect("vec");
    enc::write_uint(&mut events, 4).expect("vec");
    stored_map(&mut events, &[3, 4], Some(99), &tokens(0, 2));
    let applied = apply(&mut state, &index, 1, 0, 3, &events);
    assert_eq!(applied.skipped, 2);
    assert_eq!(applied.unresolved, 2);
    assert_eq!(applied.stored, 0);
    assert_eq!(index.held(pod(1)), 0);
    // A token count that disagrees with the block count is malformed, not indexed.
    let mut events = Vec::new();
    stored_map(&mut events, &[5, 6], None, &tokens(0, 1));
    let applied = apply(&mut state, &index, 1, 1, 1, &events);
    assert_eq!(applied.malformed, 1);
    assert_eq!(index.held(pod(1)), 0);
}

#[test]
fn sequence_numbers_tell_next_gap_and_seen() {
    let (index, _) = index_for(&[1]);
    let mut state = PodEvents::new();
    assert_eq!(
        state.sequence(0),
        Sequence::Next,
        "a publisher's first batch"
    );
    assert_eq!(
        state.sequence(41),
        Sequence::Gap { missing_from: 0 },
        "the earlier ones may be in the replay buffer"
    );
    state.rebase(41);
    assert_eq!(state.sequence(41), Sequence::Next);
    apply(&mut state, &index, 1, 41, 0, &[]);
    assert_eq!(state.sequence(42), Sequence::Next);
    assert_eq!(state.sequence(45), Sequence::Gap { missing_from: 42 });
    assert_eq!(state.sequence(40), Sequence::Seen);
    assert_eq!(state.next_seq(), Some(42));
}

#[test]
fn clearing_forgets_everything_the_pod_held() {
    let (index, snapshot) = index_for(&[1, 2]);
    let mut one = PodEvents::new();
    let mut two = PodEvents::new();
    let prompt = tokens(0, 2);
    let mut events = Vec::new();
    stored_map(&mut events, &[1, 2], None, &prompt);
    apply(&mut one, &index, 1, 0, 1, &events);
    apply(&mut two, &index, 2, 0, 1, &events);
    let mut cleared = Vec::new();
    enc::write_map_len(&mut cleared, 1).expect("vec");
    enc::write_str(&mut cleared, "type").expect("vec");
    enc::write_str(&mut cleared, "AllBlocksCleared").expect("vec");
    let applied = apply(&mut one, &index, 1, 1, 1, &cleared);
    assert_eq!((applied.cleared, applied.removed), (1, 2));
    let chains = token_block_hashes(None, &prompt, BS);
    assert_eq!(matched(&index, &snapshot, &chains, 1), 0);
    assert_eq!(
        matched(&index, &snapshot, &chains, 2),
        2,
        "other pods keep theirs"
    );
    assert_eq!(two.reset(&mut sink(&index, 2)), 2);
    assert_eq!(two.next_seq(), None);
    assert!(!index.matches(&chains, &snapshot).any());
}

#[test]
fn a_merged_view_takes_each_pods_figure_from_the_source_that_covers_it() {
    use crate::fleet::PrefixMatches;
    let (_, snapshot) = index_for(&[1, 2, 3]);
    // Events say pod 1 holds 2 of 8 engine blocks (32 tokens each) and pod 2 none; the
    // approximate index guessed 5 blocks for pod 2 and 6 for pod 3 (16-token blocks too).
    let mut exact = PrefixMatches::new(8, &snapshot, &[(pod(1), 2)]);
    exact.block_tokens = 32;
    let guessed = PrefixMatches::new(20, &snapshot, &[(pod(2), 5), (pod(3), 6)]);
    let at = |port| snapshot.position(pod(port)).expect("pod");
    let streaming = [at(1), at(2)];
    let merged = PrefixMatches::merge(exact, &guessed, 3, |i| streaming.contains(&i));
    assert_eq!(merged.request_blocks, 8);
    assert_eq!(merged.blocks_at(at(1)), 2);
    assert_eq!(
        merged.blocks_at(at(2)),
        0,
        "events know better than the guess"
    );
    assert_eq!(
        merged.tokens_at(at(3)),
        96,
        "6 × 16 guessed tokens in 32-token blocks"
    );
    let none = PrefixMatches::merge(PrefixMatches::default(), &guessed, 3, |_| true);
    assert!(!none.any());
}

#[test]
fn a_data_parallel_pod_holds_a_block_while_any_of_its_engines_does() {
    let (index, snapshot) = index_for(&[1]);
    let mut counts = EngineCounts::default();
    let (mut rank0, mut rank1) = (PodEvents::new(), PodEvents::new());
    let prompt = tokens(0, 2);
    let chains = token_block_hashes(None, &prompt, BS);
    let mut events = Vec::new();
    stored_map(&mut events, &[1, 2], None, &prompt);
    let batch = decoded(&batch_map(1, &events));
    // Both engines compute the prompt (under their own hashes, here the same).
    rank0.apply(0, &batch, &mut counts.sink(sink(&index, 1)));
    rank1.apply(0, &batch, &mut counts.sink(sink(&index, 1)));
    assert_eq!(index.held(pod(1)), 2);
    let mut events = Vec::new();
    removed_map(&mut events, &[1, 2]);
    let removed = decoded(&batch_map(1, &events));
    rank0.apply(1, &removed, &mut counts.sink(sink(&index, 1)));
    assert_eq!(
        matched(&index, &snapshot, &chains, 1),
        2,
        "rank 1 still holds it"
    );
    rank1.apply(1, &removed, &mut counts.sink(sink(&index, 1)));
    assert_eq!(matched(&index, &snapshot, &chains, 1), 0);
    // One engine's reset drops only what no other engine holds.
    rank0.apply(2, &batch, &mut counts.sink(sink(&index, 1)));
    rank1.apply(2, &batch, &mut counts.sink(sink(&index, 1)));
    rank0.reset(&mut counts.sink(sink(&index, 1)));
    assert_eq!(index.held(pod(1)), 2);
}

/// Pod `port`'s engine, just subscribed to, stores `prompt`'s blocks under `hashes` in its
/// first batch.
fn stored_once(index: &PrefixIndex, port: u16, hashes: &[u64], prompt: &[u32]) {
    let mut events = Vec::new();
    stored_map(&mut events, hashes, None, prompt);
    apply(&mut PodEvents::new(), index, port, 0, 1, &events);
}

/// `prompt`'s token blocks as a tokenized request carries them.
fn token_blocks(prompt: &[u32]) -> TokenBlocks {
    TokenBlocks {
        chains: token_block_hashes(None, prompt, BS),
        block_tokens: BS,
    }
}

/// Pods 1 and 2 both store the whole 3-block prompt; pod 3 stores nothing.
fn two_copies() -> (PrefixIndex, Snapshot, TokenBlocks) {
    let (index, snapshot) = index_for(&[1, 2, 3]);
    let prompt = tokens(700, 3);
    stored_once(&index, 1, &[0xC1, 0xC2, 0xC3], &prompt);
    stored_once(&index, 2, &[0xD1, 0xD2, 0xD3], &prompt);
    (index, snapshot, token_blocks(&prompt))
}

#[test]
fn where_the_events_show_copies_the_pod_kvroute_sent_the_context_to_alone_draws_it() {
    let (index, snapshot, blocks) = two_copies();
    let at = |port| snapshot.position(pod(port)).expect("pod");
    // kvroute's memory: it sent the prompt (8 text blocks of 8) to pod 2, and a little of
    // it to pod 1.
    let sent = |home: &[(SocketAddr, u32)]| PrefixMatches::new(8, &snapshot, home);
    for source in [PrefixSource::Auto, PrefixSource::Precise] {
        let homed = matches_with_events(
            source,
            &index,
            Some(&blocks),
            sent(&[(pod(1), 1), (pod(2), 8)]),
            &snapshot,
            |_| true,
        );
        assert_eq!(homed.home(), Some(at(2)), "{source:?}: pod 2 is the home");
        assert_eq!(
            (homed.drawing_blocks_at(at(2)), homed.blocks_at(at(2))),
            (3, 3),
            "{source:?}: the home draws the request by its match"
        );
        assert_eq!(
            (homed.drawing_blocks_at(at(1)), homed.blocks_at(at(1))),
            (0, 3),
            "{source:?}: the other copy draws nothing, but still holds the prompt"
        );
        assert_eq!(homed.most_drawing_tokens(), 3 * u64::from(BS));
    }

    let auto = |tokens: Option<&TokenBlocks>, memory| {
        matches_with_events(
            PrefixSource::Auto,
            &index,
            tokens,
            memory,
            &snapshot,
            |_| true,
        )
    };
    // The home the memory names lost the context (pod 3 holds nothing by its events):
    // the events decide alone, every copy counting.
    let lost = auto(Some(&blocks), sent(&[(pod(3), 8)]));
    assert_eq!(lost.home(), None);
    assert_eq!((lost.blocks_at(at(1)), lost.blocks_at(at(2))), (3, 3));
    assert_eq!(lost.blocks_at(at(3)), 0);

    // The memory's best pod holds under half of the prompt by the memory: no home.
    let weak = auto(Some(&blocks), sent(&[(pod(2), 3)]));
    assert_eq!(weak.home(), None);
    assert_eq!((weak.blocks_at(at(1)), weak.blocks_at(at(2))), (3, 3));

    // Without tokens (not tokenized), the memory is the matches.
    let untokenized = auto(None, sent(&[(pod(1), 1), (pod(2), 8)]));
    assert_eq!(untokenized.blocks_at(at(1)), 1);
    assert_eq!(untokenized.request_blocks, 8);
}

#[test]
fn a_home_whose_events_hold_under_half_the_prompt_is_no_home() {
    let (index, snapshot) = index_for(&[1, 2]);
    let prompt = tokens(900, 4);
    // Pod 1 holds all 4 blocks; pod 2 (where kvroute last sent the prompt) only the first.
    stored_once(&index, 1, &[0xE1, 0xE2, 0xE3, 0xE4], &prompt);
    stored_once(&index, 2, &[0xF1], &prompt[..BS as usize]);
    let blocks = token_blocks(&prompt);
    let at = |port| snapshot.position(pod(port)).expect("pod");
    let matches = matches_with_events(
        PrefixSource::Auto,
        &index,
        Some(&blocks),
        PrefixMatches::new(8, &snapshot, &[(pod(2), 8)]),
        &snapshot,
        |_| true,
    );
    assert_eq!(matches.home(), None);
    assert_eq!(
        matches.drawing_blocks_at(at(1)),
        4,
        "the copy the events show draws the request"
    );
    assert_eq!(matches.blocks_at(at(2)), 1);
}
