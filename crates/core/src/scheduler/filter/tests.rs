//! The filter's first pass records only the pods stickiness will likely keep, or, where
//! stickiness cannot apply, only the pods that pass every soft filter (scoring them as it
//! reads them); whatever the fleet, the outcome must be the one a pass recording every pod
//! gives.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use rand::SeedableRng;

use super::*;
use crate::fleet::{LoraStatus, PodMetrics, PodView, ServedModels, adapter_key};
use crate::request::InferenceRequest;
use crate::testing::config;

/// One pod as the property varies it.
#[derive(Debug, Clone)]
struct Pod {
    healthy: bool,
    scraped: bool,
    kv_usage: f64,
    waiting: u32,
    capacity: Option<u64>,
    inflight: u32,
    unscraped: u64,
    /// Leading blocks of the prompt the pod holds.
    blocks: u32,
    /// Its LoRA report: adapter slots, and the adapters (of [`ADAPTERS`]) running and
    /// waiting; and the adapters kvroute remembers sending it.
    lora: Option<(u32, Vec<usize>, Vec<usize>)>,
    sent_adapters: Vec<usize>,
}

/// The adapters the fleet lists (a request may name one).
const ADAPTERS: usize = 4;

fn adapter_name(a: usize) -> String {
    format!("a{a}")
}

prop_compose! {
    fn pod()(
        healthy in prop::bool::weighted(0.9),
        scraped in prop::bool::weighted(0.9),
        kv_usage in 0.0..1.0f64,
        waiting in 0..20u32,
        capacity in prop::option::weighted(0.9, 1_000..60_000u64),
        inflight in 0..40u32,
        unscraped in prop_oneof![Just(0u64), 0..20_000u64],
        blocks in prop_oneof![Just(0u32), 0..=REQUEST_BLOCKS],
        lora in prop::option::weighted(
            0.8,
            (
                0..4u32,
                prop::collection::vec(0..ADAPTERS, 0..3),
                prop::collection::vec(0..ADAPTERS, 0..2),
            ),
        ),
        sent_adapters in prop::collection::vec(0..ADAPTERS, 0..2),
    ) -> Pod {
        Pod {
            healthy,
            scraped,
            kv_usage,
            waiting,
            capacity,
            inflight,
            unscraped,
            blocks,
            lora,
            sent_adapters,
        }
    }
}

const REQUEST_BLOCKS: u32 = 40;

fn fleet_of(pods: &[Pod]) -> Fleet {
    let served = Arc::new(ServedModels {
        base: vec!["base".to_owned()],
        adapters: (0..ADAPTERS)
            .map(|a| (adapter_name(a), "base".to_owned()))
            .collect::<HashMap<_, _>>(),
    });
    let pods = pods
        .iter()
        .enumerate()
        .map(|(n, pod)| {
            let metrics = pod.scraped.then(|| {
                Arc::new(PodMetrics {
                    kv_usage: pod.kv_usage,
                    waiting: pod.waiting,
                    kv_capacity_tokens: pod.capacity,
                    lora: pod
                        .lora
                        .as_ref()
                        .map(|(slots, running, waiting)| LoraStatus {
                            max_lora: *slots,
                            running: running.iter().map(|&a| adapter_name(a)).collect(),
                            waiting: waiting.iter().map(|&a| adapter_name(a)).collect(),
                        }),
                    ..PodMetrics::default()
                })
            });
            let view = PodView::new(
                endpoint(n),
                pod.healthy,
                metrics,
                pod.scraped.then_some(Duration::from_millis(10)),
                Some(Arc::clone(&served)),
            );
            let load = PodLoad::with_values(pod.inflight, pod.unscraped);
            for &a in &pod.sent_adapters {
                load.note_adapter(adapter_key(&adapter_name(a)));
            }
            (view, Arc::new(load))
        })
        .collect();
    Fleet::new(pods, 1, 1)
}

/// The prefix matches the pods' `blocks` make in `fleet`.
fn matches_of(pods: &[Pod], fleet: &Fleet) -> PrefixMatches {
    let held: Vec<(SocketAddr, u32)> = pods
        .iter()
        .enumerate()
        .map(|(n, pod)| (endpoint(n), pod.blocks))
        .collect();
    PrefixMatches::new(REQUEST_BLOCKS, fleet.snapshot(), &held)
}

/// A request for the base model with `prompt` tokens and at most `output` out.
fn inference(prompt: u32, output: u32) -> InferenceRequest {
    inference_of("base", prompt, output)
}

/// A request for `model` with `prompt` tokens and at most `output` out.
fn inference_of(model: &str, prompt: u32, output: u32) -> InferenceRequest {
    InferenceRequest {
        model: model.to_owned(),
        prompt_tokens: prompt,
        max_output_tokens: Some(output),
        stream: false,
        prompt_prefix: Vec::new(),
        prefix_context: 0,
    }
}

fn endpoint(n: usize) -> SocketAddr {
    SocketAddr::from(([10, 1, (n / 250) as u8, (n % 250) as u8], 8000))
}

proptest! {
    #![proptest_config(config(300))]

    #[test]
    fn recording_only_the_likely_competitors_filters_as_recording_every_pod(
        pods in prop::collection::vec(pod(), 1..64),
        prompt in 0..1_000u32,
        output in 0..300u32,
        with_matches in prop::bool::weighted(0.7),
        adapter in prop::option::weighted(0.5, 0..ADAPTERS),
    ) {
        let fleet = fleet_of(&pods);
        let prefix = matches_of(&pods, &fleet);
        let adapter = adapter.map(adapter_name);
        let inference = inference_of(adapter.as_deref().unwrap_or("base"), prompt, output);
        let request = RouteRequest { inference: Some(&inference), subset: None };
        let demand = Demand::new(
            u64::from(prompt),
            u64::from(prompt) + u64::from(output),
            with_matches.then_some(&prefix),
        );
        let scheduler = SchedulerConfig::default();
        let scorer = Scorer::new(&fleet, demand.prefix, demand, adapter.as_deref(), &scheduler);
        let quick = filter(&request, &fleet, &demand, &scheduler, &scorer);
        let full = filter_reading(
            &request, &fleet, &demand, &scheduler, &scorer, Record::Caching(0),
        );
        prop_assert_eq!(quick.as_ref().map(counts), full.as_ref().map(counts));
        if let (Ok(quick), Ok(full)) = (&quick, &full) {
            // Every candidate kept competes in the full pass too (pruning drops some).
            let competing: Vec<Candidate> = full.competing().map(|(_, c)| *c).collect();
            for (_, candidate) in quick.competing() {
                prop_assert!(competing.contains(candidate), "{candidate:?}");
            }
            if quick.partials.is_empty() {
                prop_assert_eq!(quick.competing().count(), competing.len());
            }
            // Scored as read: the terms scoring the record afterwards gives.
            for (candidate, partial) in quick.candidates.iter().zip(&quick.partials) {
                let row = fleet.row(candidate.index as usize);
                prop_assert_eq!(*partial, scorer.partial(candidate, row));
            }
            // And the same decision, whatever the tie-break draws.
            for seed in 0..3 {
                let adapter = adapter.as_deref();
                prop_assert_eq!(
                    decision(&request, &fleet, demand, adapter, quick, &scheduler, seed),
                    decision(&request, &fleet, demand, adapter, full, &scheduler, seed)
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(config(300))]

    /// A pick declined on its filters' outlook is one the whole pick would have declined,
    /// one not declined is the whole pick's decision, and either leaves the generator where
    /// the whole pick does.
    #[test]
    fn a_pick_declined_before_scoring_is_the_whole_picks_and_draws_alike(
        pods in prop::collection::vec(pod(), 1..64),
        // Some prompts larger than many pods' pools: often no pod passes, and sometimes
        // none could ever fit.
        prompt in prop_oneof![0..2_000u32, 20_000..70_000u32],
        output in 0..300u32,
        with_matches in prop::bool::weighted(0.7),
        adapter in prop::option::weighted(0.5, 0..ADAPTERS),
        hold in 0..3u8,
        seed in any::<u64>(),
    ) {
        let fleet = fleet_of(&pods);
        let prefix = matches_of(&pods, &fleet);
        let adapter = adapter.map(adapter_name);
        let inference = inference_of(adapter.as_deref().unwrap_or("base"), prompt, output);
        let request = RouteRequest { inference: Some(&inference), subset: None };
        let prefix = with_matches.then_some(&prefix);
        let scheduler = SchedulerConfig::default();
        let declines = |o: &crate::scheduler::Outlook| match hold {
            0 => o.lacks_room(),
            1 => o.lacks_room() || o.relaxed.saturation,
            _ => false,
        };
        let mut whole_rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mut early_rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let whole = crate::scheduler::pick(&request, prefix, &fleet, &scheduler, &mut whole_rng);
        let early = crate::scheduler::pick_unless(
            &request, prefix, &fleet, &scheduler, &mut early_rng, declines,
        );
        match (whole, early) {
            (Err(whole), Err(early)) => prop_assert_eq!(whole, early),
            (Ok(whole), Ok(crate::scheduler::Picked::Decided(early))) => {
                prop_assert!(!declines(&whole.outlook()));
                prop_assert_eq!(whole, early);
            }
            (Ok(whole), Ok(crate::scheduler::Picked::Declined(outlook))) => {
                prop_assert!(declines(&whole.outlook()));
                // (Only a pick declined early says what its outlook means for others.)
                prop_assert_eq!(
                    whole.outlook(),
                    crate::scheduler::Outlook { shadow: None, ..outlook }
                );
            }
            (whole, early) => prop_assert!(false, "{whole:?} against {early:?}"),
        }
        prop_assert_eq!(
            rand::RngCore::next_u64(&mut whole_rng),
            rand::RngCore::next_u64(&mut early_rng)
        );
    }
}

proptest! {
    #![proptest_config(config(300))]

    /// The shadow of a pick that lacked room covers only requests that lack room too, on
    /// the same fleet: the same model, no pod caching any of the prompt, at least the
    /// tokens and at most the largest pool. A request some pod caches part of casts none.
    #[test]
    fn a_request_a_shadow_covers_lacks_room_too(
        pods in prop::collection::vec(pod(), 1..64),
        first in prop_oneof![0..2_000u32, 20_000..70_000u32],
        more in 0..40_000u32,
        output in 0..300u32,
        adapter in prop::option::weighted(0.3, 0..ADAPTERS),
        with_matches in prop::bool::weighted(0.2),
    ) {
        let fleet = fleet_of(&pods);
        let prefix = matches_of(&pods, &fleet);
        let prefix = with_matches.then_some(&prefix);
        let model = adapter.map_or_else(|| "base".to_owned(), adapter_name);
        let scheduler = SchedulerConfig::default();
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        let inference = inference_of(&model, first, output);
        let request = RouteRequest { inference: Some(&inference), subset: None };
        let picked = crate::scheduler::pick_unless(
            &request, prefix, &fleet, &scheduler, &mut rng, crate::scheduler::Outlook::lacks_room,
        );
        let Ok(crate::scheduler::Picked::Declined(outlook)) = picked else {
            return Ok(());
        };
        let Some(shadow) = outlook.shadow else {
            prop_assert!(prefix.is_some_and(PrefixMatches::any), "{outlook:?}");
            return Ok(());
        };
        prop_assert!(prefix.is_none_or(|prefix| !prefix.any()));
        let larger = inference_of(&model, first.saturating_add(more), output);
        let request = RouteRequest { inference: Some(&larger), subset: None };
        let tokens = crate::scheduler::tokens_needed(&request, &scheduler);
        let whole = crate::scheduler::pick(&request, None, &fleet, &scheduler, &mut rng)
            .expect("the same hard filters pass");
        if shadow.covers(tokens) {
            prop_assert!(whole.lacks_room(), "{shadow:?} {whole:?}");
            prop_assert_eq!(whole.outlook().relaxed, shadow.relaxed);
        }
    }
}

/// The filter's outcome, and that of a pass recording every pod.
fn both_passes(
    request: &RouteRequest<'_>,
    fleet: &Fleet,
    demand: &Demand<'_>,
    config: &SchedulerConfig,
    scorer: &Scorer<'_>,
) -> (Filtered, Filtered) {
    let quick = filter(request, fleet, demand, config, scorer).expect("some");
    let full =
        filter_reading(request, fleet, demand, config, scorer, Record::Caching(0)).expect("some");
    (quick, full)
}

/// What a filter's outcome says beside its candidates: how many the soft filters
/// accepted, the in-flight scale, what was relaxed, whether some pod could fit the
/// request.
fn counts(filtered: &Filtered) -> (usize, u32, Relaxed, bool) {
    (
        filtered.accepted,
        filtered.max_inflight,
        filtered.relaxed,
        filtered.could_fit,
    )
}

/// The decision ranking `filtered` makes, its ties broken by an RNG seeded with `seed`.
fn decision(
    request: &RouteRequest<'_>,
    fleet: &Fleet,
    demand: Demand<'_>,
    adapter: Option<&str>,
    filtered: &Filtered,
    config: &SchedulerConfig,
    seed: u64,
) -> crate::scheduler::Decision {
    let scorer = Scorer::new(fleet, demand.prefix, demand, adapter, config)
        .with_max_inflight(filtered.max_inflight);
    let draw = rand::RngCore::next_u64(&mut rand::rngs::SmallRng::seed_from_u64(seed));
    let ranking = crate::scheduler::rank::rank(filtered, &scorer, config, draw);
    crate::scheduler::decide(request, filtered, ranking, demand.tokens, config)
}

/// The prompt and output of the unit tests' request, which matches nothing.
const PROMPT: u32 = 400;
const OUTPUT: u32 = 100;

fn request_for(inference: &InferenceRequest) -> RouteRequest<'_> {
    RouteRequest {
        inference: Some(inference),
        subset: None,
    }
}

/// A fleet of pods, and the unit tests' base-model request, which matches nothing.
struct Unmatched {
    fleet: Fleet,
    inference: InferenceRequest,
    config: SchedulerConfig,
}

impl Unmatched {
    fn new(pods: &[Pod]) -> Self {
        Unmatched {
            fleet: fleet_of(pods),
            inference: inference(PROMPT, OUTPUT),
            config: SchedulerConfig::default(),
        }
    }

    fn request(&self) -> RouteRequest<'_> {
        request_for(&self.inference)
    }

    fn scorer(&self) -> Scorer<'_> {
        Scorer::new(
            &self.fleet,
            None,
            demand_without_matches(),
            None,
            &self.config,
        )
    }
}

fn demand_without_matches() -> Demand<'static> {
    Demand::new(u64::from(PROMPT), u64::from(PROMPT + OUTPUT), None)
}

/// A healthy pod with empty KV and queues and a 50,000-token pool, holding nothing of
/// the prompt and reporting no LoRA state: what the unit tests vary.
fn idle() -> Pod {
    Pod {
        healthy: true,
        scraped: true,
        kv_usage: 0.0,
        waiting: 0,
        capacity: Some(50_000),
        inflight: 0,
        unscraped: 0,
        blocks: 0,
        lora: None,
        sent_adapters: Vec::new(),
    }
}

/// `pods` pods that each pass every filter for that request, with varied KV use, queues
/// and requests in flight (up to 16).
fn every_pod_passes(pods: u32) -> Vec<Pod> {
    (0..pods)
        .map(|n| Pod {
            kv_usage: f64::from(n % 50) / 100.0,
            waiting: n % 3,
            inflight: n % 17,
            ..idle()
        })
        .collect()
}

/// On a fleet where every pod passes every filter, the pass records only the pods whose
/// total may reach the ranking's kept few, and the decision is the one recording every
/// pod makes.
#[test]
fn pods_that_cannot_rank_are_counted_but_not_recorded() {
    let pods = every_pod_passes(200);
    let case = Unmatched::new(&pods);
    let (fleet, config, request) = (&case.fleet, &case.config, case.request());
    let (demand, scorer) = (demand_without_matches(), case.scorer());
    let (quick, full) = both_passes(&request, fleet, &demand, config, &scorer);
    assert_eq!(quick.accepted, 200);
    assert_eq!(quick.max_inflight, 16);
    assert!(
        quick.candidates.len() < 100,
        "recorded {} of 200",
        quick.candidates.len()
    );
    for seed in 0..5 {
        assert_eq!(
            decision(&request, fleet, demand, None, &quick, config, seed),
            decision(&request, fleet, demand, None, &full, config, seed)
        );
    }
}

/// Where no pod holds half the prompt, the first pass keeps only the pods that pass every
/// soft filter; when none does, the fleet is read again and the filters relax.
#[test]
fn when_no_pod_passes_every_soft_filter_the_least_bad_still_compete() {
    let saturated = Pod {
        kv_usage: 0.5,
        waiting: 50,
        ..idle()
    };
    let pods = [
        saturated.clone(),
        Pod {
            waiting: 60,
            ..saturated.clone()
        },
        Pod {
            healthy: false,
            waiting: 0,
            ..saturated
        },
    ];
    let case = Unmatched::new(&pods);
    let (fleet, config, request) = (&case.fleet, &case.config, case.request());
    let (demand, scorer) = (demand_without_matches(), case.scorer());
    let filtered = filter(&request, fleet, &demand, config, &scorer).expect("some");
    let competing: Vec<u32> = filtered.competing().map(|(_, c)| c.index).collect();
    assert_eq!(competing, [0, 1], "{filtered:?}");
    assert!(filtered.relaxed.saturation);
    assert_eq!(
        filtered.candidates.len(),
        2,
        "read again, every pod recorded"
    );
    assert!(filtered.partials.is_empty(), "scored by the ranking");
    let scored = Pod {
        waiting: 0,
        ..pods[0].clone()
    };
    let case = Unmatched::new(&[pods[0].clone(), scored]);
    let (fleet, scorer) = (&case.fleet, case.scorer());
    let filtered = filter(&request, fleet, &demand, config, &scorer).expect("some");
    let competing: Vec<u32> = filtered.competing().map(|(_, c)| c.index).collect();
    assert_eq!(competing, [1], "only the pod passing every filter");
    assert!(!filtered.relaxed.any());
    assert_eq!(
        filtered.candidates.len(),
        1,
        "only the passing pod recorded"
    );
    assert_eq!(filtered.partials.len(), 1, "scored as read");
}

/// The pod caching the most is unhealthy: stickiness ends at half of what the next best
/// holder caches, below what the first pass recorded, and the pod between the two floors
/// must still compete.
#[test]
fn a_holder_below_the_likely_floor_competes_when_the_best_holder_is_unhealthy() {
    let idle = Pod {
        kv_usage: 0.1,
        ..idle()
    };
    let pods = [
        Pod {
            healthy: false,
            blocks: 40,
            ..idle.clone()
        },
        Pod {
            blocks: 24,
            ..idle.clone()
        },
        Pod {
            blocks: 14,
            ..idle.clone()
        },
        idle,
    ];
    let fleet = fleet_of(&pods);
    let prefix = matches_of(&pods, &fleet);
    let prompt = u64::from(REQUEST_BLOCKS) * u64::from(prefix.block_tokens);
    let inference = inference(u32::try_from(prompt).expect("small"), 100);
    let request = RouteRequest {
        inference: Some(&inference),
        subset: None,
    };
    let demand = Demand::new(prompt, prompt + 100, Some(&prefix));
    let config = SchedulerConfig::default();
    let scorer = Scorer::new(&fleet, demand.prefix, demand, None, &config);
    let filtered = filter(&request, &fleet, &demand, &config, &scorer).expect("some");
    let competing: Vec<u32> = filtered.competing().map(|(_, c)| c.index).collect();
    assert_eq!(competing, [1, 2], "{filtered:?}");
    assert_eq!(filtered.accepted, 3);
}

/// The in-flight scale is the most requests on one passing pod, known only once every pod
/// is read: a pod read early, with more in flight than any before it, must not be dropped
/// as if its in-flight term were already final. Here the last pod raises the scale from 10
/// to 40, and the pod with 10 in flight and the most KV headroom wins.
#[test]
fn a_late_pod_with_many_requests_in_flight_does_not_make_an_early_winner_drop() {
    const USUAL: usize = 40;
    let usual = Pod {
        kv_usage: 0.5,
        ..idle()
    };
    let mut pods = vec![usual.clone(); USUAL];
    pods.push(Pod {
        kv_usage: 0.0,
        inflight: 10,
        ..usual.clone()
    });
    pods.push(Pod {
        kv_usage: 0.7,
        inflight: 40,
        ..usual
    });
    let case = Unmatched::new(&pods);
    let (fleet, config, request) = (&case.fleet, &case.config, case.request());
    let (demand, scorer) = (demand_without_matches(), case.scorer());
    let filtered = filter(&request, fleet, &demand, config, &scorer).expect("some");
    let decision = decision(&request, fleet, demand, None, &filtered, config, 0);
    assert_eq!(decision.endpoint, endpoint(USUAL), "{decision:?}");
    assert_eq!(filtered.max_inflight, 40);
}

/// A request may reach a pod between the pass's first read of the in-flight counts and its
/// read of that pod: the scale bound then does not hold, and the pass must not prune by it.
/// Here the pass is told that no pod had more than 1 in flight while they have up to 16.
#[test]
fn a_count_that_outgrew_the_first_read_turns_pruning_off() {
    let pods = every_pod_passes(200);
    let case = Unmatched::new(&pods);
    let (fleet, config, request) = (&case.fleet, &case.config, case.request());
    let (demand, scorer) = (demand_without_matches(), case.scorer());
    let read = |pruning| {
        read_passing::<false>(&request, fleet, &demand, config, &scorer, pruning).expect("some")
    };
    let raced = read(Pruning::AssumingAtMost(1));
    let unpruned = read(Pruning::Off);
    assert_eq!(raced.recorded.len(), 200, "every passing pod recorded");
    assert_eq!(raced.recorded, unpruned.recorded);
    assert!(
        read(Pruning::Bounded).recorded.len() < 100,
        "pruned when the bound holds"
    );
}

/// An adapter request on a light fleet: a pod not running the adapter can still win on
/// the prefix it caches (a shorter prefill, a higher prefill-queue term), so the ceiling
/// that drops pods before scoring them must count what caching adds. Swept over how much
/// the pod caches (below half the prompt, where stickiness does not apply).
#[test]
fn a_pod_without_the_adapter_that_caches_part_of_the_prompt_is_not_dropped_unscored() {
    let adapter = adapter_name(0);
    let prompt = REQUEST_BLOCKS * crate::fleet::BLOCK_TOKENS as u32;
    let inference = inference_of(&adapter, prompt, OUTPUT);
    let request = request_for(&inference);
    // A short prefill queue scale (the prefill term moves most with what is cached) and
    // the default one (the prefix term does).
    for queue_tokens in [64, SchedulerConfig::default().prefill_queue_tokens] {
        let config = SchedulerConfig {
            prefill_queue_tokens: queue_tokens,
            ..SchedulerConfig::default()
        };
        sweep_the_cached_blocks(&adapter, &request, prompt, &config);
    }
}

fn sweep_the_cached_blocks(
    adapter: &str,
    request: &RouteRequest<'_>,
    prompt: u32,
    config: &SchedulerConfig,
) {
    let mut winners = Vec::new();
    for blocks in 1..REQUEST_BLOCKS / 2 {
        let pods: Vec<Pod> = (0..40)
            .map(|n| Pod {
                capacity: Some(1_000_000),
                blocks: if n == 39 { blocks } else { 0 },
                // Pods 0–9 run the adapter; pod 39 has a free slot.
                lora: Some((4, if n < 10 { vec![0] } else { vec![1] }, Vec::new())),
                ..idle()
            })
            .collect();
        let fleet = fleet_of(&pods);
        let prefix = matches_of(&pods, &fleet);
        let demand = Demand::new(u64::from(prompt), u64::from(prompt + OUTPUT), Some(&prefix));
        let scorer = Scorer::new(&fleet, demand.prefix, demand, Some(adapter), config);
        let (quick, full) = both_passes(request, &fleet, &demand, config, &scorer);
        let quick = decision(request, &fleet, demand, Some(adapter), &quick, config, 0);
        let full = decision(request, &fleet, demand, Some(adapter), &full, config, 0);
        assert_eq!(quick, full, "pod 39 caching {blocks} blocks");
        winners.push(full.endpoint == endpoint(39));
    }
    // The sweep crosses from the adapter's pods winning to the caching pod winning.
    assert!(
        winners.contains(&true) && winners.contains(&false),
        "{winners:?}"
    );
}

/// An adapter request: a pod kvroute sent the adapter to lately (likely still loaded,
/// `Warm`) outranks the pods running it once their load is heavier, so the ceiling asked
/// before reading what the pod was sent must allow for `Warm`. Swept over the load of the
/// pods running the adapter.
#[test]
fn a_pod_the_adapter_was_sent_to_lately_is_not_dropped_unscored() {
    let adapter = adapter_name(0);
    let config = SchedulerConfig::default();
    let inference = inference_of(&adapter, PROMPT, OUTPUT);
    let request = request_for(&inference);
    let demand = demand_without_matches();
    let mut winners = Vec::new();
    for usage in 0..10 {
        let pods: Vec<Pod> = (0..40)
            .map(|n| Pod {
                // Pods 0–9 run the adapter under a growing load; pod 39 was sent it.
                kv_usage: if n < 10 { f64::from(usage) / 10.0 } else { 0.0 },
                waiting: if n < 10 { usage / 3 } else { 0 },
                inflight: if n < 10 { usage } else { 0 },
                lora: Some((4, if n < 10 { vec![0] } else { vec![1] }, Vec::new())),
                sent_adapters: if n == 39 { vec![0] } else { Vec::new() },
                ..idle()
            })
            .collect();
        let fleet = fleet_of(&pods);
        let scorer = Scorer::new(&fleet, None, demand, Some(&adapter), &config);
        let (quick, full) = both_passes(&request, &fleet, &demand, &config, &scorer);
        let quick = decision(&request, &fleet, demand, Some(&adapter), &quick, &config, 0);
        let full = decision(&request, &fleet, demand, Some(&adapter), &full, &config, 0);
        assert_eq!(quick, full, "load step {usage}");
        winners.push(full.endpoint == endpoint(39));
    }
    assert!(
        winners.contains(&true) && winners.contains(&false),
        "{winners:?}"
    );
}
