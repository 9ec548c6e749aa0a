use super::*;

#[test]
fn a_reservation_counts_until_dropped() {
    let load = Arc::new(PodLoad::default());
    let first = load.reserve(100, 0, PrefillEnd::FirstToken);
    let second = load.reserve(50, 0, PrefillEnd::FirstToken);
    assert_eq!(load.inflight(), 2);
    assert_eq!(load.unscraped_tokens(), 150);
    drop(first);
    assert_eq!(load.inflight(), 1);
    assert_eq!(load.unscraped_tokens(), 50);
    drop(second);
    assert_eq!(load.inflight(), 0);
    assert_eq!(load.unscraped_tokens(), 0);
}

#[test]
fn a_scrape_started_after_the_request_absorbs_its_tokens_but_not_its_count() {
    let load = Arc::new(PodLoad::default());
    let request = load.reserve(100, 0, PrefillEnd::FirstToken);
    let ticket = load.scrape_started();
    load.scrape_succeeded(ticket);
    assert_eq!(load.unscraped_tokens(), 0);
    assert_eq!(load.inflight(), 1);
    drop(request);
    assert_eq!(load.unscraped_tokens(), 0);
    assert_eq!(load.inflight(), 0);
}

#[test]
fn committed_tokens_outlive_every_scrape_until_the_request_ends() {
    let load = Arc::new(PodLoad::default());
    let first = load.reserve(8_000, 4_000, PrefillEnd::FirstToken);
    let second = load.reserve(500, 100, PrefillEnd::NextScrape);
    for _ in 0..3 {
        let ticket = load.scrape_started();
        load.scrape_succeeded(ticket);
    }
    assert_eq!(load.unscraped_tokens(), 0);
    assert_eq!(
        load.committed_tokens(),
        8_500,
        "vLLM does not report future output"
    );
    drop(first);
    assert_eq!(load.committed_tokens(), 500);
    drop(second);
    assert_eq!(load.committed_tokens(), 0);
}

#[test]
fn a_scrape_started_before_the_request_does_not_absorb_it() {
    let load = Arc::new(PodLoad::default());
    let ticket = load.scrape_started();
    let _request = load.reserve(100, 0, PrefillEnd::FirstToken);
    load.scrape_succeeded(ticket);
    assert_eq!(load.unscraped_tokens(), 100);
    let next = load.scrape_started();
    load.scrape_succeeded(next);
    assert_eq!(load.unscraped_tokens(), 0);
}

#[test]
fn a_request_a_scrape_saw_frees_its_share_of_the_report_when_it_ends_until_a_later_scrape() {
    let load = Arc::new(PodLoad::default());
    let seen = load.reserve(1_000, 400, PrefillEnd::NextScrape);
    let first = load.scrape_started();
    let unseen = load.reserve(300, 100, PrefillEnd::NextScrape);
    load.scrape_succeeded(first);
    drop(unseen);
    assert_eq!(
        load.released_tokens(),
        0,
        "no report counted it: it leaves the unscraped sum instead"
    );
    // A scrape under way when the request ends may have read the pod before it ended.
    let during = load.scrape_started();
    drop(seen);
    assert_eq!(load.released_tokens(), 1_000);
    load.scrape_succeeded(during);
    assert_eq!(load.released_tokens(), 1_000);
    let after = load.scrape_started();
    load.scrape_succeeded(after);
    assert_eq!(
        load.released_tokens(),
        0,
        "a scrape started after the end shows it"
    );
}

#[test]
fn recently_sent_adapters_are_remembered_most_recent_first() {
    let load = PodLoad::default();
    let (a, b, c) = (adapter_key("a"), adapter_key("b"), adapter_key("c"));
    assert_eq!(load.adapter_recency(a), None);
    load.note_adapter(a);
    load.note_adapter(b);
    load.note_adapter(c);
    load.note_adapter(a);
    assert_eq!(load.adapter_recency(a), Some(0));
    assert_eq!(load.adapter_recency(c), Some(1));
    assert_eq!(load.adapter_recency(b), Some(2));
    assert_eq!(load.adapter_standing(b), (Some(2), 3));
    assert_eq!(load.adapter_standing(adapter_key("d")), (None, 3));
    for n in 0..RECENT_ADAPTERS {
        load.note_adapter(adapter_key(&format!("other-{n}")));
    }
    assert_eq!(
        load.adapter_recency(a),
        None,
        "only the last few are remembered"
    );
}

#[test]
fn the_summary_of_remembered_adapters_answers_as_the_list_where_it_can() {
    let load = PodLoad::default();
    let names: Vec<String> = (0..200).map(|n| format!("adapter-{n}")).collect();
    for (sent, name) in names.iter().enumerate() {
        load.note_adapter(adapter_key(name));
        for other in &names {
            let key = adapter_key(other);
            if let Some(standing) = load.standing_if_not_remembered(AdapterProbe::of(key)) {
                assert_eq!(standing, load.adapter_standing(key), "{other} after {sent}");
            }
            if load.adapter_recency(key).is_some() {
                assert_eq!(
                    load.standing_if_not_remembered(AdapterProbe::of(key)),
                    None,
                    "{other}"
                );
            }
        }
    }
    // Eight remembered adapters set at most eight of the 56 bits: most others are ruled
    // out from the summary alone.
    let answered = names
        .iter()
        .filter(|n| {
            load.standing_if_not_remembered(AdapterProbe::of(adapter_key(n)))
                .is_some()
        })
        .count();
    assert!(answered > 150, "{answered}");
    assert_eq!(
        PodLoad::default().standing_if_not_remembered(AdapterProbe::of(adapter_key("a"))),
        Some((None, 0))
    );
}

#[test]
fn a_pick_reads_the_counters_and_the_summary_from_one_cache_line() {
    assert!(std::mem::offset_of!(PodLoad, recent_summary) + 8 <= 64);
    assert_eq!(std::mem::offset_of!(PodLoad, recent_adapters), 64);
}

#[test]
fn prompt_tokens_wait_for_prefill_until_the_first_token_or_the_end() {
    let load = Arc::new(PodLoad::default());
    let mut streaming = load.reserve(300, 200, PrefillEnd::FirstToken);
    let failed = load.reserve(90, 80, PrefillEnd::FirstToken);
    assert_eq!(load.prefill_tokens(), 280);
    streaming.first_token();
    streaming.first_token();
    assert_eq!(load.prefill_tokens(), 80, "counted off once");
    drop(failed);
    assert_eq!(load.prefill_tokens(), 0, "a request that ends unstreamed");
    drop(streaming);
    assert_eq!(load.prefill_tokens(), 0);
}

#[test]
fn a_failed_scrape_absorbs_nothing() {
    let load = Arc::new(PodLoad::default());
    let _request = load.reserve(100, 0, PrefillEnd::FirstToken);
    let _failed = load.scrape_started();
    let _also_failed = load.scrape_started();
    assert_eq!(load.unscraped_tokens(), 100);
}

#[test]
fn releasing_after_absorption_does_not_subtract_twice() {
    let load = Arc::new(PodLoad::default());
    let old = load.reserve(100, 0, PrefillEnd::FirstToken);
    let ticket = load.scrape_started();
    let new = load.reserve(40, 0, PrefillEnd::FirstToken);
    load.scrape_succeeded(ticket);
    drop(old);
    assert_eq!(load.unscraped_tokens(), 40);
    drop(new);
    assert_eq!(load.unscraped_tokens(), 0);
}

#[test]
fn a_non_streaming_requests_prefill_ends_at_the_next_scrape_not_at_its_answer() {
    let load = Arc::new(PodLoad::default());
    // A scrape already under way when the request is sent cannot have seen it...
    let early = load.scrape_started();
    let batch = load.reserve(1_100, 1_000, PrefillEnd::NextScrape);
    assert_eq!(
        load.prefill_tokens(),
        1_000,
        "queued until the pod shows it"
    );
    load.scrape_succeeded(early);
    assert_eq!(load.prefill_tokens(), 1_000);
    // ...one that began after it has: the pod's own queue now reports it.
    let late = load.scrape_started();
    load.scrape_succeeded(late);
    assert_eq!(load.prefill_tokens(), 0);
    drop(batch);
    assert_eq!(load.prefill_tokens(), 0, "no double release");
    assert_eq!(load.inflight(), 0);
}

#[test]
fn a_non_streaming_answer_before_any_scrape_ends_its_prefill_once() {
    let load = Arc::new(PodLoad::default());
    let mut quick = load.reserve(300, 200, PrefillEnd::NextScrape);
    let _other = load.reserve(300, 100, PrefillEnd::NextScrape);
    assert_eq!(load.prefill_tokens(), 300);
    quick.first_token();
    quick.first_token();
    assert_eq!(load.prefill_tokens(), 100);
    drop(quick);
    assert_eq!(load.prefill_tokens(), 100);
}

#[test]
fn a_reservation_moved_to_the_pod_that_served_counts_there_only() {
    let (picked, served) = (Arc::new(PodLoad::default()), Arc::new(PodLoad::default()));
    let reservation = picked.reserve(1_000, 600, PrefillEnd::FirstToken);
    let mut moved = reservation.move_to(&served);
    for (load, expected) in [(&picked, (0, 0, 0, 0)), (&served, (1, 1_000, 1_000, 600))] {
        assert_eq!(
            (
                load.inflight(),
                load.committed_tokens(),
                load.unscraped_tokens(),
                load.prefill_tokens()
            ),
            expected
        );
    }
    moved.first_token();
    assert_eq!(served.prefill_tokens(), 0);
    drop(moved);
    assert_eq!((served.inflight(), served.committed_tokens()), (0, 0));
}

#[test]
fn a_watched_stream_counts_the_output_it_has_yet_to_generate() {
    let load = Arc::new(PodLoad::default());
    let mut watched = load.reserve(1_200, 1_000, PrefillEnd::FirstToken);
    let unwatched = load.reserve(500, 300, PrefillEnd::NextScrape);
    assert_eq!(
        load.growth_tokens(),
        200,
        "only the watched stream says how it grows"
    );
    watched.first_token();
    assert_eq!(load.growth_tokens(), 200);
    watched.streamed(150);
    assert_eq!(load.growth_tokens(), 50);
    watched.streamed(400);
    assert_eq!(load.growth_tokens(), 0, "never below zero");
    drop(unwatched);
    let mut another = load.reserve(600, 100, PrefillEnd::FirstToken);
    another.first_token();
    another.streamed(100);
    let moved = another.move_to(&Arc::new(PodLoad::default()));
    assert_eq!(load.growth_tokens(), 0, "moved away with its request");
    assert_eq!(moved.load.growth_tokens(), 400, "the output still to come");
    drop((watched, moved));
    assert_eq!(load.growth_tokens(), 0);

    // A request kvroute does not watch, past its prefill, moves without growth or prompt.
    let mut unwatched = load.reserve(700, 300, PrefillEnd::NextScrape);
    unwatched.first_token();
    let elsewhere = Arc::new(PodLoad::default());
    let moved = unwatched.move_to(&elsewhere);
    assert_eq!(
        (elsewhere.growth_tokens(), elsewhere.prefill_tokens()),
        (0, 0)
    );
    assert_eq!(elsewhere.committed_tokens(), 700);
    drop(moved);
    assert_eq!(elsewhere.committed_tokens(), 0);
}
