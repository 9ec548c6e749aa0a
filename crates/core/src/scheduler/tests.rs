use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::*;
use crate::fleet::{
    LoraStatus, PodLoad, PodMetrics, PodView, PrefillEnd, ServedModels, Snapshot, adapter_key,
};
use crate::request::{EndpointSubset, InferenceRequest};

const CAPACITY: u64 = 100_000;

fn endpoint(n: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, n as u8], 8000))
}

/// A healthy, freshly scraped, idle pod serving `base` with adapters `a1`..`a4`.
fn pod(n: u16) -> PodView {
    let mut adapters = HashMap::new();
    for a in ["a1", "a2", "a3", "a4"] {
        adapters.insert(a.to_owned(), "base".to_owned());
    }
    PodView::new(
        endpoint(n),
        true,
        Some(Arc::new(PodMetrics {
            kv_capacity_tokens: Some(CAPACITY),
            lora: Some(LoraStatus {
                max_lora: 2,
                running: vec![],
                waiting: vec![],
            }),
            ..PodMetrics::default()
        })),
        Some(Duration::from_millis(10)),
        Some(Arc::new(ServedModels {
            base: vec!["base".to_owned()],
            adapters,
        })),
    )
}

fn with_metrics(mut pod: PodView, edit: impl FnOnce(&mut PodMetrics)) -> PodView {
    let mut metrics = pod.metrics().cloned().unwrap_or_default();
    edit(&mut metrics);
    pod.set_metrics(Some(Arc::new(metrics)));
    pod
}

fn fleet(pods: Vec<PodView>) -> Fleet {
    Fleet::unloaded(pods)
}

/// What a test asks of the scheduler, in the fields tests vary; [`pick`] turns it into the
/// [`RouteRequest`] the gateway would build.
#[derive(Debug, Clone, Default)]
struct Ask<'a> {
    model: Option<&'a str>,
    prompt_tokens: u32,
    max_output_tokens: Option<u32>,
    subset: Option<&'a EndpointSubset>,
    prefix: Option<&'a PrefixMatches>,
}

impl Ask<'_> {
    fn inference(&self) -> Option<InferenceRequest> {
        self.model.map(|model| InferenceRequest {
            model: model.to_owned(),
            prompt_tokens: self.prompt_tokens,
            max_output_tokens: self.max_output_tokens,
            stream: false,
            prompt_prefix: Vec::new(),
            prefix_context: 0,
        })
    }
}

fn request(model: &str, prompt_tokens: u32) -> Ask<'_> {
    Ask {
        model: Some(model),
        prompt_tokens,
        max_output_tokens: Some(100),
        subset: None,
        prefix: None,
    }
}

fn pick(
    ask: &Ask<'_>,
    fleet: &Fleet,
    config: &SchedulerConfig,
    rng: &mut SmallRng,
) -> Result<Decision, PickError> {
    let inference = ask.inference();
    let request = RouteRequest {
        inference: inference.as_ref(),
        subset: ask.subset,
    };
    super::pick(&request, ask.prefix, fleet, config, rng)
}

fn tokens_needed(ask: &Ask<'_>, config: &SchedulerConfig) -> u64 {
    let inference = ask.inference();
    let request = RouteRequest {
        inference: inference.as_ref(),
        subset: ask.subset,
    };
    super::tokens_needed(&request, config)
}

/// The default configuration's pick under ten RNG seeds (ties break differently).
fn pick_under_seeds<'a>(
    request: &'a Ask<'_>,
    fleet: &'a Fleet,
) -> impl Iterator<Item = Result<Decision, PickError>> + 'a {
    (0..10).map(move |seed| {
        pick(
            request,
            fleet,
            &SchedulerConfig::default(),
            &mut SmallRng::seed_from_u64(seed),
        )
    })
}

fn pick_seeded(request: &Ask<'_>, fleet: &Fleet) -> Result<Decision, PickError> {
    pick(
        request,
        fleet,
        &SchedulerConfig::default(),
        &mut SmallRng::seed_from_u64(7),
    )
}

#[test]
fn an_empty_fleet_is_an_error() {
    let result = pick_seeded(&request("base", 10), &fleet(vec![]));
    assert_eq!(result, Err(PickError::NoEndpoints));
}

#[test]
fn a_subset_hint_restricts_the_choice_to_its_endpoints() {
    let snapshot = fleet(vec![pod(1), pod(2), pod(3)]);
    let subset: EndpointSubset = [endpoint(2)].into_iter().collect();
    for seed in 0..20 {
        let req = Ask {
            subset: Some(&subset),
            ..request("base", 10)
        };
        let decision = pick(
            &req,
            &snapshot,
            &SchedulerConfig::default(),
            &mut SmallRng::seed_from_u64(seed),
        );
        assert_eq!(decision.map(|d| d.endpoint), Ok(endpoint(2)));
    }
}

#[test]
fn a_subset_naming_no_known_endpoint_fails() {
    let snapshot = fleet(vec![pod(1)]);
    let subset: EndpointSubset = [endpoint(9)].into_iter().collect();
    let req = Ask {
        subset: Some(&subset),
        ..request("base", 10)
    };
    assert_eq!(pick_seeded(&req, &snapshot), Err(PickError::NoneInSubset));
}

#[test]
fn a_model_no_pod_serves_is_unknown() {
    let snapshot = fleet(vec![pod(1), pod(2)]);
    assert_eq!(
        pick_seeded(&request("gpt-9", 10), &snapshot),
        Err(PickError::UnknownModel("gpt-9".into()))
    );
}

#[test]
fn a_pod_whose_model_list_cannot_be_read_turns_404_into_503_but_is_not_sent_the_model() {
    // Pod 2's /v1/models fails (timeout, 5xx, 401): it may serve gpt-9, so gpt-9 is not
    // unknown, but nothing says it does, so it is not sent there either.
    let mut unlisted = pod(2);
    unlisted.models = None;
    for healthy in [true, false] {
        unlisted.healthy = healthy;
        let snapshot = fleet(vec![pod(1), unlisted.clone()]);
        assert_eq!(
            pick_seeded(&request("gpt-9", 10), &snapshot),
            Err(PickError::ModelsNotListed {
                model: "gpt-9".into(),
                unlisted: 1
            }),
            "healthy: {healthy}"
        );
        let decision = pick_seeded(&request("base", 10), &snapshot).expect("placed");
        assert_eq!(
            decision.endpoint,
            endpoint(1),
            "listed pods serve what they list"
        );
    }
}

#[test]
fn requests_without_a_model_may_go_to_a_pod_whose_model_list_cannot_be_read() {
    let mut unlisted = pod(2);
    unlisted.models = None;
    let mut down = pod(1);
    down.healthy = false;
    let decision = pick_seeded(&Ask::default(), &fleet(vec![down, unlisted])).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
}

#[test]
fn the_adapter_map_lets_pods_of_the_base_model_serve_an_unlisted_adapter() {
    let snapshot = fleet(vec![pod(1)]);
    let mut config = SchedulerConfig::default();
    config.adapters.insert("sql-lora".into(), "base".into());
    let decision = pick(
        &request("sql-lora", 10),
        &snapshot,
        &config,
        &mut SmallRng::seed_from_u64(1),
    );
    assert_eq!(decision.map(|d| d.endpoint), Ok(endpoint(1)));
}

#[test]
fn pods_whose_shared_model_lists_alternate_are_each_asked_about_their_own() {
    // Two lists, each shared by every other pod (the snapshot numbers its lists once; the
    // model check remembers the last list's answer): "other" is served by pods 2, 4, 6 only.
    let list = |model: &str| {
        Arc::new(ServedModels {
            base: vec![model.to_owned()],
            adapters: HashMap::new(),
        })
    };
    let (base, other) = (list("base"), list("other"));
    let pods = (1..=6)
        .map(|n| {
            let mut pod = pod(n);
            pod.models = Some(Arc::clone(if n % 2 == 0 { &other } else { &base }));
            pod
        })
        .collect();
    let snapshot = fleet(pods);
    for seed in 0..20 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let config = SchedulerConfig::default();
        let to_other = pick(&request("other", 10), &snapshot, &config, &mut rng).expect("placed");
        assert!(
            [2, 4, 6].map(endpoint).contains(&to_other.endpoint),
            "{to_other:?}"
        );
        assert_eq!(to_other.candidates, 3);
        let to_base = pick(&request("base", 10), &snapshot, &config, &mut rng).expect("placed");
        assert!(
            [1, 3, 5].map(endpoint).contains(&to_base.endpoint),
            "{to_base:?}"
        );
    }
}

#[test]
fn unhealthy_pods_are_never_picked() {
    let mut down = pod(1);
    down.healthy = false;
    let snapshot = fleet(vec![down, pod(2)]);
    for seed in 0..20 {
        let decision = pick(
            &request("base", 10),
            &snapshot,
            &SchedulerConfig::default(),
            &mut SmallRng::seed_from_u64(seed),
        );
        assert_eq!(decision.map(|d| d.endpoint), Ok(endpoint(2)));
    }
}

#[test]
fn a_model_served_only_by_unhealthy_pods_has_no_ready_endpoint() {
    let mut down = pod(1);
    down.healthy = false;
    assert_eq!(
        pick_seeded(&request("base", 10), &fleet(vec![down])),
        Err(PickError::NoReadyEndpoint)
    );
}

#[test]
fn a_near_full_pod_is_avoided() {
    let full = with_metrics(pod(1), |m| m.kv_usage = 0.95);
    let snapshot = fleet(vec![full, with_metrics(pod(2), |m| m.kv_usage = 0.5)]);
    let decision = pick_seeded(&request("base", 10), &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert_eq!(decision.reason, Reason::LeastLoaded);
}

#[test]
fn a_large_prompt_goes_where_it_fits_even_if_another_pod_has_a_shorter_queue() {
    // Pod 1: empty queue but only 20k free tokens. Pod 2: a queue of 3 but 60k free.
    let tight = with_metrics(pod(1), |m| m.kv_usage = 0.79);
    let roomy = with_metrics(pod(2), |m| {
        m.kv_usage = 0.4;
        m.waiting = 3;
    });
    let snapshot = fleet(vec![tight, roomy]);
    let decision = pick_seeded(&request("base", 30_000), &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert!(!decision.relaxed.kv_headroom);
}

#[test]
fn tokens_sent_since_the_last_scrape_count_against_free_kv() {
    let busy = (pod(1), Arc::new(PodLoad::with_values(0, 95_000)));
    let other = with_metrics(pod(2), |m| m.kv_usage = 0.7);
    let snapshot = Fleet::new(vec![busy, (other, Arc::default())], 1, 1);
    let decision = pick_seeded(&request("base", 10_000), &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert_eq!(decision.ranked[0].free_kv_tokens, Some(30_000));
}

#[test]
fn when_no_pod_has_room_the_one_with_most_room_is_picked_and_the_decision_says_so() {
    let a = with_metrics(pod(1), |m| m.kv_usage = 0.7);
    let b = with_metrics(pod(2), |m| m.kv_usage = 0.6);
    let decision = pick_seeded(&request("base", 50_000), &fleet(vec![a, b])).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert!(decision.relaxed.kv_headroom);
    assert_eq!(decision.reason, Reason::Fallback);
}

#[test]
fn an_adapter_holding_pod_is_preferred() {
    let holder = with_metrics(pod(2), |m| {
        m.lora = Some(LoraStatus {
            max_lora: 2,
            running: vec!["a1".into()],
            waiting: vec![],
        });
        m.running = 3;
        m.kv_usage = 0.3;
    });
    let snapshot = fleet(vec![pod(1), holder, pod(3)]);
    let decision = pick_seeded(&request("a1", 100), &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert_eq!(decision.reason, Reason::Lora(LoraTier::Active));
}

#[test]
fn an_adapter_holding_pod_that_is_saturated_is_passed_over_for_a_free_pod() {
    let saturated_holder = with_metrics(pod(1), |m| {
        m.lora = Some(LoraStatus {
            max_lora: 2,
            running: vec!["a1".into()],
            waiting: vec![],
        });
        m.waiting = 6;
    });
    let snapshot = fleet(vec![saturated_holder, pod(2)]);
    let decision = pick_seeded(&request("a1", 100), &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert_eq!(decision.reason, Reason::Lora(LoraTier::FreeSlot));
}

#[test]
fn a_pod_with_a_free_adapter_slot_beats_one_that_must_evict() {
    let full_slots = with_metrics(pod(1), |m| {
        m.lora = Some(LoraStatus {
            max_lora: 2,
            running: vec!["a2".into(), "a3".into()],
            waiting: vec![],
        });
    });
    let snapshot = fleet(vec![full_slots, pod(2)]);
    let decision = pick_seeded(&request("a1", 100), &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert_eq!(decision.ranked[1].lora_tier, Some(LoraTier::MustEvict));
}

#[test]
fn lora_affinity_never_empties_the_candidate_set() {
    // Every pod must evict: the request is still placed.
    let busy = |n| {
        with_metrics(pod(n), |m| {
            m.lora = Some(LoraStatus {
                max_lora: 1,
                running: vec!["a2".into()],
                waiting: vec![],
            })
        })
    };
    let decision =
        pick_seeded(&request("a1", 100), &fleet(vec![busy(1), busy(2)])).expect("placed");
    assert_eq!(decision.reason, Reason::Lora(LoraTier::MustEvict));
    assert_eq!(decision.candidates, 2);
}

#[test]
fn pods_with_stale_metrics_are_avoided_while_fresh_ones_exist() {
    let mut stale = pod(1);
    stale.metrics_age = Some(Duration::from_secs(5));
    let busier_but_fresh = with_metrics(pod(2), |m| m.kv_usage = 0.6);
    let decision =
        pick_seeded(&request("base", 10), &fleet(vec![stale, busier_but_fresh])).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert!(!decision.relaxed.any());
}

/// Age weakens a pod's report in proportion; it does not exclude the pod. When the
/// scraper falls behind, a slightly old report of an idle pod still beats fresh reports
/// of busy ones, and only a much older one loses to them.
#[test]
fn old_metrics_count_less_in_proportion_to_their_age() {
    let busy_fresh = |n| {
        with_metrics(pod(n), |m| {
            m.waiting = 3;
            m.kv_usage = 0.7;
        })
    };
    let idle_aged = |age_ms| {
        let mut idle = pod(9);
        idle.metrics_age = Some(Duration::from_millis(age_ms));
        idle
    };
    let config = SchedulerConfig::default();
    assert_eq!(config.max_metrics_age, Duration::from_secs(1));
    let winner = |age_ms| {
        let pods = vec![busy_fresh(1), busy_fresh(2), idle_aged(age_ms)];
        pick_seeded(&request("base", 10), &fleet(pods))
            .expect("placed")
            .endpoint
    };
    assert_eq!(
        winner(900),
        endpoint(9),
        "within max_metrics_age: full weight"
    );
    assert_eq!(
        winner(1_500),
        endpoint(9),
        "two thirds of its weight still wins"
    );
    assert_ne!(
        winner(20_000),
        endpoint(9),
        "a twentieth of its weight loses"
    );

    // The breakdown shows the weakened terms: half the weight at twice the age.
    let pods = vec![busy_fresh(1), idle_aged(2_000)];
    let decision = pick_seeded(&request("base", 10), &fleet(pods)).expect("placed");
    let aged = decision
        .ranked
        .iter()
        .find(|c| c.endpoint == endpoint(9))
        .expect("ranked");
    assert!((aged.queue - 0.5).abs() < 0.01, "queue term {}", aged.queue);
    assert!(aged.kv_headroom <= 0.5 + 0.01 && aged.kv_headroom > 0.45);
}

#[test]
fn when_every_pod_is_saturated_the_least_bad_is_picked() {
    let a = with_metrics(pod(1), |m| m.waiting = 9);
    let b = with_metrics(pod(2), |m| m.waiting = 6);
    let decision = pick_seeded(&request("base", 10), &fleet(vec![a, b])).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert!(decision.relaxed.saturation);
    assert_eq!(decision.reason, Reason::Fallback);
}

#[test]
fn a_request_lacks_room_when_no_pod_has_its_kv_not_when_pods_are_only_saturated() {
    // Long queues, free KV: the pods take the request into their queues.
    let queued = |n| with_metrics(pod(n), |m| m.waiting = 9);
    let decision =
        pick_seeded(&request("base", 10), &fleet(vec![queued(1), queued(2)])).expect("placed");
    assert!(decision.relaxed.saturation, "{decision:?}");
    assert!(!decision.lacks_room(), "{decision:?}");
    // Nearly full pools: placing it would make a pod preempt.
    let full = |n| with_metrics(pod(n), |m| m.kv_usage = 0.9999);
    let decision =
        pick_seeded(&request("base", 1_000), &fleet(vec![full(1), full(2)])).expect("placed");
    assert!(decision.lacks_room(), "{decision:?}");
    let decision =
        pick_seeded(&request("base", 1_000), &fleet(vec![full(1), pod(3)])).expect("placed");
    assert!(!decision.lacks_room(), "{decision:?}");
}

/// Flow control declines a pick that lacks room before any pod is scored, and leaves the
/// generator as the full pick would: the next pick breaks its ties alike.
#[test]
fn a_pick_can_be_declined_on_what_its_filters_found() {
    let full = |n| with_metrics(pod(n), |m| m.kv_usage = 0.9999);
    let ask = request("base", 1_000);
    let inference = ask.inference();
    let route = RouteRequest {
        inference: inference.as_ref(),
        subset: None,
    };
    let config = SchedulerConfig::default();
    for (snapshot, lacks_room) in [
        (fleet(vec![full(1), full(2)]), true),
        (fleet(vec![full(1), pod(3)]), false),
    ] {
        let (mut early, mut whole) = (SmallRng::seed_from_u64(5), SmallRng::seed_from_u64(5));
        let picked = super::pick_unless(&route, None, &snapshot, &config, &mut early, |o| {
            o.lacks_room()
        })
        .expect("filtered");
        let decision = super::pick(&route, None, &snapshot, &config, &mut whole).expect("placed");
        assert_eq!(decision.lacks_room(), lacks_room);
        match picked {
            super::Picked::Declined(outlook) => {
                assert!(lacks_room);
                assert_eq!(
                    super::Outlook {
                        shadow: None,
                        ..outlook
                    },
                    decision.outlook()
                );
                assert!(outlook.shadow.is_some(), "no pod caches any of it");
            }
            super::Picked::Decided(early) => {
                assert!(!lacks_room);
                assert_eq!(early, decision);
            }
        }
        assert_eq!(
            rand::RngCore::next_u64(&mut early),
            rand::RngCore::next_u64(&mut whole)
        );
    }
}

/// In a dispatch pass, a request a miss's shadow covers is declined without a pick, and
/// the generator moves as the pick would have moved it.
#[test]
fn a_request_a_shadow_covers_is_declined_and_draws_as_its_pick_would() {
    use crate::flow::{Hold, Shadows};
    let full = |n| with_metrics(pod(n), |m| m.kv_usage = 0.9999);
    let snapshot = fleet(vec![full(1), full(2), full(3)]);
    let config = SchedulerConfig::default();
    let (mut passing, mut whole) = (SmallRng::seed_from_u64(9), SmallRng::seed_from_u64(9));
    let mut shadows = Shadows::default();
    for prompt in [1_000, 1_500, 1_200] {
        let ask = request("base", prompt);
        let inference = ask.inference();
        let route = RouteRequest {
            inference: inference.as_ref(),
            subset: None,
        };
        let picked = Hold::WithoutKv
            .pick(&route, None, &snapshot, &config, &mut passing, &mut shadows)
            .expect("filtered");
        let super::Picked::Declined(outlook) = picked else {
            panic!("no pod has room: {picked:?}");
        };
        // The first casts the shadow; the others, larger, are covered by it.
        assert_eq!(outlook.shadow.map(|s| s.tokens), Some(1_100));
        let decision = super::pick(&route, None, &snapshot, &config, &mut whole).expect("placed");
        assert!(decision.lacks_room());
    }
    assert_eq!(
        rand::RngCore::next_u64(&mut passing),
        rand::RngCore::next_u64(&mut whole)
    );
}

/// Waiting cannot help a request larger than any pod's whole KV pool: it is placed (and
/// the pod answers it), not held until its wait runs out.
#[test]
fn a_request_larger_than_every_pod_does_not_wait_for_room() {
    let full = |n| with_metrics(pod(n), |m| m.kv_usage = 0.95);
    let snapshot = fleet(vec![full(1), full(2)]);
    let fits_empty = u32::try_from(CAPACITY / 2).expect("small");
    let decision = pick_seeded(&request("base", fits_empty), &snapshot).expect("placed");
    assert!(
        decision.relaxed.kv_headroom && decision.could_fit,
        "{decision:?}"
    );
    assert!(decision.lacks_room());
    let too_large = u32::try_from(CAPACITY + 1).expect("small");
    let decision = pick_seeded(&request("base", too_large), &snapshot).expect("placed");
    assert!(
        decision.relaxed.kv_headroom && !decision.could_fit,
        "{decision:?}"
    );
    assert!(!decision.lacks_room());
}

/// The funnel seen at 256 and 1,000 simulated pods: when nearly every pod's queue is
/// full, the last scrape shows a few pods below the thresholds, and until the next scrape
/// every request with nowhere better to go lands there. Pod 1 reported half its KV in
/// use, but kvroute has sent it 48,000 tokens since: it is full, and saturated for a
/// request that shares nothing with it, so the request goes where it fits.
#[test]
fn what_kvroute_sent_since_the_last_scrape_counts_toward_kv_saturation() {
    let half_full = |n| with_metrics(pod(n), |m| m.kv_usage = 0.5);
    let queued = |n| {
        with_metrics(pod(n), |m| {
            m.kv_usage = 0.5;
            m.waiting = 6;
        })
    };
    let filled = (half_full(1), Arc::new(PodLoad::with_values(0, 48_000)));
    let snapshot = Fleet::new(
        vec![
            filled,
            (queued(2), Arc::default()),
            (queued(3), Arc::default()),
        ],
        1,
        1,
    );
    let decision = pick_seeded(&request("base", 4_000), &snapshot).expect("placed");
    assert_ne!(decision.endpoint, endpoint(1), "{decision:?}");
    assert!(decision.relaxed.saturation, "{decision:?}");
    assert!(!decision.relaxed.kv_headroom, "{decision:?}");

    // Before kvroute sent it anything, pod 1 is the one unsaturated pod, and takes it.
    let fresh = fleet(vec![half_full(1), queued(2), queued(3)]);
    let decision = pick_seeded(&request("base", 4_000), &fresh).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert!(!decision.relaxed.any(), "{decision:?}");
}

#[test]
fn fallbacks_are_ordered_best_first_and_exclude_the_winner() {
    let snapshot = fleet(vec![
        with_metrics(pod(1), |m| m.kv_usage = 0.5),
        with_metrics(pod(2), |m| m.kv_usage = 0.1),
        with_metrics(pod(3), |m| m.kv_usage = 0.3),
        with_metrics(pod(4), |m| m.kv_usage = 0.7),
    ]);
    let config = SchedulerConfig {
        fallbacks: 2,
        ..SchedulerConfig::default()
    };
    let decision = pick(
        &request("base", 10),
        &snapshot,
        &config,
        &mut SmallRng::seed_from_u64(7),
    )
    .expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert_eq!(decision.fallbacks, vec![endpoint(3), endpoint(1)]);
    let totals: Vec<f64> = decision.ranked.iter().map(|c| c.total).collect();
    assert!(totals.windows(2).all(|w| w[0] >= w[1]), "{totals:?}");
}

#[test]
fn ties_are_broken_by_the_rng_and_the_same_seed_gives_the_same_choice() {
    let snapshot = fleet(vec![pod(1), pod(2), pod(3)]);
    let config = SchedulerConfig::default();
    let choose = |seed| {
        pick(
            &request("base", 10),
            &snapshot,
            &config,
            &mut SmallRng::seed_from_u64(seed),
        )
        .map(|d| d.endpoint)
        .expect("placed")
    };
    let chosen: std::collections::BTreeSet<_> = (0..30).map(choose).collect();
    assert_eq!(chosen.len(), 3, "every tied pod gets picked for some seed");
    assert_eq!(choose(42), choose(42));
}

#[test]
fn requests_without_a_model_go_to_any_healthy_pod() {
    let mut down = pod(1);
    down.healthy = false;
    let req = Ask::default();
    let decision = pick_seeded(&req, &fleet(vec![down, pod(2)])).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert_eq!(decision.reason, Reason::AnyReady);
    assert_eq!(decision.tokens_needed, 0);
}

#[test]
fn reserving_each_pick_spreads_a_burst_over_equal_pods() {
    let snapshot = fleet(vec![pod(1), pod(2), pod(3), pod(4)]);
    let config = SchedulerConfig::default();
    let mut rng = SmallRng::seed_from_u64(3);
    let mut reservations = Vec::new();
    let mut per_pod: HashMap<SocketAddr, usize> = HashMap::new();
    for _ in 0..8 {
        let decision = pick(&request("base", 2_000), &snapshot, &config, &mut rng).expect("placed");
        let (_, load) = snapshot.pod(decision.endpoint).expect("known");
        reservations.push(load.reserve(decision.tokens_needed, 2_000, PrefillEnd::FirstToken));
        *per_pod.entry(decision.endpoint).or_default() += 1;
    }
    assert_eq!(per_pod.len(), 4);
    assert!(per_pod.values().all(|&n| n == 2), "{per_pod:?}");
}

#[test]
fn expected_output_defaults_when_the_request_sets_no_max_tokens() {
    let config = SchedulerConfig::default();
    let req = Ask {
        max_output_tokens: None,
        ..request("base", 1_000)
    };
    assert_eq!(
        tokens_needed(&req, &config),
        1_000 + u64::from(config.default_output_tokens)
    );
}

#[test]
fn an_adapter_sent_to_a_pod_recently_keeps_its_affinity_after_its_requests_finish() {
    // vLLM lists only adapters of running requests; pod 2 served a1 a moment ago.
    let snapshot = fleet(vec![pod(1), pod(2), pod(3)]);
    let (_, warm) = snapshot.pod(endpoint(2)).expect("known");
    warm.note_adapter(adapter_key("a1"));
    let ask = request("a1", 100);
    for decision in pick_under_seeds(&ask, &snapshot) {
        let decision = decision.expect("placed");
        assert_eq!(decision.endpoint, endpoint(2));
        assert_eq!(decision.reason, Reason::Lora(LoraTier::Warm));
    }
}

#[test]
fn a_pod_that_was_sent_more_other_adapters_than_it_has_slots_is_no_longer_warm() {
    let snapshot = fleet(vec![pod(1)]);
    let load = snapshot.load(0);
    load.note_adapter(adapter_key("a1"));
    load.note_adapter(adapter_key("a2"));
    load.note_adapter(adapter_key("a3"));
    // max_lora is 2: a1 was pushed out by a2 and a3, which now hold both slots, idle.
    let decision = pick_seeded(&request("a1", 100), &snapshot).expect("placed");
    assert_eq!(decision.reason, Reason::Lora(LoraTier::EvictIdle));
}

#[test]
fn a_pod_whose_slots_hold_idle_adapters_sent_lately_ranks_below_one_with_a_free_slot() {
    // max_lora 2, no request running anywhere: vLLM lists no adapter on either pod. Pod 1
    // was sent a2 and a3 a moment ago and keeps both loaded; loading a1 there evicts one,
    // which its next request loads again. Pod 2 was sent only a2: a slot is free.
    let snapshot = fleet(vec![pod(1), pod(2)]);
    let (_, full) = snapshot.pod(endpoint(1)).expect("known");
    full.note_adapter(adapter_key("a2"));
    full.note_adapter(adapter_key("a3"));
    let (_, half) = snapshot.pod(endpoint(2)).expect("known");
    half.note_adapter(adapter_key("a2"));
    let ask = request("a1", 100);
    for decision in pick_under_seeds(&ask, &snapshot) {
        let decision = decision.expect("placed");
        assert_eq!(decision.endpoint, endpoint(2), "{decision:?}");
        assert_eq!(decision.reason, Reason::Lora(LoraTier::FreeSlot));
        assert_eq!(decision.ranked[1].lora_tier, Some(LoraTier::EvictIdle));
    }
}

/// Prefix matches for a fleet of pods 1..=k (as every test below builds it), whose
/// positions follow their numbers.
fn matches(request_blocks: u32, held: &[(u16, u32)]) -> PrefixMatches {
    let last = held.iter().map(|&(n, _)| n).max().unwrap_or(1);
    let numbered = Snapshot::new((1..=last).map(pod).collect(), 1, 1);
    let held: Vec<_> = held
        .iter()
        .map(|&(n, blocks)| (endpoint(n), blocks))
        .collect();
    PrefixMatches::new(request_blocks, &numbered, &held)
}

#[test]
fn a_pod_holding_the_prompts_prefix_wins_among_equally_loaded_pods() {
    let snapshot = fleet(vec![pod(1), pod(2), pod(3)]);
    let held = matches(10, &[(2, 8), (3, 2)]);
    let req = Ask {
        prefix: Some(&held),
        ..request("base", 500)
    };
    for decision in pick_under_seeds(&req, &snapshot) {
        let decision = decision.expect("placed");
        assert_eq!(decision.endpoint, endpoint(2));
        assert_eq!(decision.reason, Reason::PrefixCache);
        assert!((decision.ranked[0].prefix - 0.8).abs() < 1e-9);
    }
}

/// The decision trace shows every addend of each candidate's total: the weighted terms
/// add up to it exactly, and each is its term times its weight.
#[test]
fn the_weighted_terms_of_a_candidate_add_up_to_its_total() {
    let queued = with_metrics(pod(1), |m| m.waiting = 3);
    let snapshot = fleet(vec![queued, pod(2), pod(3)]);
    let held = matches(10, &[(2, 8), (3, 2)]);
    let req = Ask {
        prefix: Some(&held),
        ..request("base", 500)
    };
    let config = SchedulerConfig::default();
    let decision = pick(&req, &snapshot, &config, &mut SmallRng::seed_from_u64(1)).expect("placed");
    assert_eq!(decision.ranked.len(), 3);
    let weights = &config.weights;
    for score in &decision.ranked {
        let w = &score.weighted;
        assert_eq!(w.sum(), score.total, "{score:?}");
        for (weighted, weight, term) in [
            (w.kv_headroom, weights.kv_headroom, score.kv_headroom),
            (w.queue, weights.queue, score.queue),
            (w.inflight, weights.inflight, score.inflight),
            (w.lora, weights.lora_affinity, score.lora),
            (w.prefix, weights.prefix_affinity, score.prefix),
            (w.prefill_queue, weights.prefill_queue, score.prefill_queue),
        ] {
            assert_eq!(weighted, weight * term, "{score:?}");
        }
    }
    assert!(decision.ranked.iter().any(|s| s.weighted.prefix > 0.0));
    assert!(decision.ranked.iter().any(|s| s.queue < 1.0));
}

#[test]
fn a_saturated_pod_holding_the_prefix_is_passed_over_for_a_free_pod() {
    let busy = with_metrics(pod(1), |m| m.waiting = 9);
    let snapshot = fleet(vec![busy, pod(2)]);
    let held = matches(10, &[(1, 10)]);
    let req = Ask {
        prefix: Some(&held),
        ..request("base", 500)
    };
    let decision = pick_seeded(&req, &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert_eq!(decision.reason, Reason::LeastLoaded);
}

#[test]
fn a_prefix_match_does_not_outweigh_a_much_heavier_load() {
    // Not saturated, but its queue and KV are far worse than the idle pod's.
    let loaded = with_metrics(pod(1), |m| {
        m.waiting = 4;
        m.kv_usage = 0.75;
    });
    let snapshot = fleet(vec![loaded, pod(2)]);
    let held = matches(10, &[(1, 3)]);
    let req = Ask {
        prefix: Some(&held),
        ..request("base", 500)
    };
    let decision = pick_seeded(&req, &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
}

#[test]
fn a_lora_tiers_name_is_its_serialised_form() {
    for tier in LoraTier::ALL {
        let json = serde_json::to_value(tier).expect("serialises");
        assert_eq!(json, tier.name());
    }
}

#[test]
fn a_pod_whose_slots_other_running_adapters_hold_is_not_warm_for_one_it_ran_earlier() {
    // max_lora 2. Pod 1 was sent b, then a (finished), then c: it runs {b, c}, so a is
    // no longer loaded there and must wait for a slot. Pod 2 has a free slot.
    let full = with_metrics(pod(1), |m| {
        m.lora = Some(LoraStatus {
            max_lora: 2,
            running: vec!["a2".into(), "a3".into()],
            waiting: vec![],
        });
    });
    let snapshot = fleet(vec![full, pod(2)]);
    let (_, load) = snapshot.pod(endpoint(1)).expect("known");
    for adapter in ["a2", "a1", "a3"] {
        load.note_adapter(adapter_key(adapter));
    }
    let decision = pick_seeded(&request("a1", 100), &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2));
    assert_eq!(decision.reason, Reason::Lora(LoraTier::FreeSlot));
    let passed_over = &decision.ranked[1];
    assert_eq!(passed_over.endpoint, endpoint(1));
    assert_eq!(passed_over.lora_tier, Some(LoraTier::MustEvict));
}

#[test]
fn a_recently_sent_adapter_stays_warm_while_a_slot_is_not_held_by_running_ones() {
    let one_running = with_metrics(pod(1), |m| {
        m.lora = Some(LoraStatus {
            max_lora: 2,
            running: vec!["a2".into()],
            waiting: vec![],
        });
    });
    let snapshot = fleet(vec![one_running]);
    let (_, load) = snapshot.pod(endpoint(1)).expect("known");
    load.note_adapter(adapter_key("a1"));
    load.note_adapter(adapter_key("a2"));
    let decision = pick_seeded(&request("a1", 100), &snapshot).expect("placed");
    assert_eq!(decision.reason, Reason::Lora(LoraTier::Warm));
}

#[test]
fn a_pod_that_does_not_report_its_adapter_slots_is_unknown_not_full() {
    let unreported = with_metrics(pod(1), |m| {
        m.lora = Some(LoraStatus {
            max_lora: 0,
            running: vec!["a2".into()],
            waiting: vec![],
        });
    });
    let decision = pick_seeded(&request("a1", 100), &fleet(vec![unreported])).expect("placed");
    assert_eq!(decision.reason, Reason::Lora(LoraTier::Unknown));
}

#[test]
fn lora_tiers_keep_the_documented_order() {
    let scores: Vec<f64> = LoraTier::ALL.iter().map(|tier| tier.score()).collect();
    assert!(scores.windows(2).all(|w| w[0] > w[1]), "{scores:?}");
}

#[test]
fn a_data_parallel_pod_is_saturated_by_its_queue_per_engine_not_its_total() {
    // DP 8 with one request waiting per engine: each engine's queue is short.
    let dp8 = with_metrics(pod(1), |m| {
        m.engines = 8;
        m.waiting = 8;
        m.kv_usage = 0.3;
    });
    let single = with_metrics(pod(2), |m| {
        m.waiting = 6;
        m.kv_usage = 0.3;
    });
    let decision = pick_seeded(&request("base", 10), &fleet(vec![dp8, single])).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1));
    assert!(!decision.relaxed.saturation, "{:?}", decision.relaxed);
    assert!((decision.ranked[0].queue - 5.0 / 6.0).abs() < 1e-9);
}

#[test]
fn a_subset_hint_of_a_bare_host_admits_that_host_and_no_other() {
    let snapshot = fleet(vec![pod(1), pod(2), pod(3)]);
    let subset = EndpointSubset::parse(["10.0.0.3"]);
    let req = Ask {
        subset: Some(&subset),
        ..request("base", 10)
    };
    for decision in pick_under_seeds(&req, &snapshot) {
        assert_eq!(decision.map(|d| d.endpoint), Ok(endpoint(3)));
    }
}

#[test]
fn every_reason_has_its_own_label() {
    let labels: std::collections::BTreeSet<&str> = Reason::all().map(|r| r.as_str()).collect();
    assert_eq!(labels.len(), Reason::all().count());
    assert_eq!(labels.len(), 11);
}

/// Reserves `decision`'s KV need on its pod, as the gateway does after a pick.
fn reserve(fleet: &Fleet, decision: &Decision, prompt: u64) -> crate::fleet::Reservation {
    let (_, load) = fleet.pod(decision.endpoint).expect("known");
    let winner = &decision.ranked[0];
    load.reserve(
        winner.kv_tokens_needed(decision.tokens_needed),
        prompt.saturating_sub(winner.cached_tokens),
        PrefillEnd::FirstToken,
    )
}

/// Publishes a scrape of every pod (as the store does): the ledger absorbs what it saw.
fn scrape_all(fleet: &Fleet) {
    for (_, load) in fleet.pods() {
        let ticket = load.scrape_started();
        load.scrape_succeeded(ticket);
    }
}

#[test]
fn a_request_counts_against_free_kv_after_the_next_scrape_until_it_ends() {
    // vLLM has allocated the prompt of the request kvroute sent (40 % of the pod) but not
    // the output still to come: the pod's peak need is the request's whole estimate.
    let long = Ask {
        max_output_tokens: Some(40_000),
        ..request("base", 40_000)
    };
    let fleet = fleet(vec![pod(1), pod(2)]);
    let first = pick_seeded(&long, &fleet).expect("placed");
    let held = reserve(&fleet, &first, 40_000);
    let busy = first.endpoint;
    scrape_all(&fleet);
    let (pod, load) = fleet.pod(busy).expect("known");
    let pod = with_metrics(pod.clone(), |m| m.kv_usage = 0.4);
    assert_eq!(free_kv_tokens(&pod, load, 1), Some(20_000), "not 60,000");

    let reported = Fleet::new(
        fleet
            .pods()
            .map(|(p, l)| {
                let view = if p.endpoint == busy {
                    pod.clone()
                } else {
                    p.clone()
                };
                (view, Arc::clone(l))
            })
            .collect(),
        1,
        0,
    );
    let second = pick_seeded(&long, &reported).expect("placed");
    assert_ne!(second.endpoint, busy, "the burst does not herd: {second:?}");
    drop(held);
    assert_eq!(
        free_kv_tokens(&pod, load, 1),
        Some(100_000),
        "released at the end, and what it held in the report freed before the next scrape"
    );
    scrape_all(&fleet);
    let others = with_metrics(pod.clone(), |m| m.kv_usage = 0.1);
    assert_eq!(
        free_kv_tokens(&others, load, 1),
        Some(90_000),
        "the next scrape shows it freed (and others' 10 %), and it is not subtracted again"
    );
}

#[test]
fn what_the_pod_reports_is_not_counted_twice() {
    // Other gateways' traffic fills 70 %; kvroute's own request (5,000 prompt tokens, up to
    // 5,000 out) is running, watched by kvroute as it streams.
    let fleet = fleet(vec![with_metrics(pod(1), |m| m.kv_usage = 0.7)]);
    let (pod, load) = fleet.pod(endpoint(1)).expect("known");
    let mut running = load.reserve(10_000, 5_000, PrefillEnd::FirstToken);
    assert_eq!(
        free_kv_tokens(pod, load, 1),
        Some(20_000),
        "not yet scraped"
    );
    scrape_all(&fleet);
    running.first_token();
    assert_eq!(
        free_kv_tokens(pod, load, 1),
        Some(25_000),
        "the report covers its prompt; its output is still to come"
    );
    running.streamed(2_000);
    let reported = with_metrics(pod.clone(), |m| m.kv_usage = 0.72);
    assert_eq!(
        free_kv_tokens(&reported, load, 1),
        Some(25_000),
        "what it streamed moved from the ledger into the report"
    );
}

/// Two replicas behind one gateway: each counts what it sent since the last scrape twice,
/// the other replica's share it cannot see.
#[test]
fn each_replica_counts_its_own_unscraped_and_committed_kv_once_per_replica() {
    // 30 % reported in use (30,000 of CAPACITY); this replica sent 10,000 tokens since.
    let fleet = fleet(vec![with_metrics(pod(1), |m| m.kv_usage = 0.3)]);
    let (pod, load) = fleet.pod(endpoint(1)).expect("known");
    let _sent = load.reserve(10_000, 5_000, PrefillEnd::NextScrape);
    assert_eq!(free_kv_tokens(pod, load, 1), Some(60_000));
    assert_eq!(free_kv_tokens(pod, load, 2), Some(50_000));
    // After the scrape, the report includes it; committed KV (10,000 a replica) stays below
    // the report either way.
    scrape_all(&fleet);
    assert_eq!(free_kv_tokens(pod, load, 2), Some(70_000));
    assert_eq!(
        free_kv_tokens(pod, load, 4),
        Some(60_000),
        "four replicas' commitments (40,000) exceed the report (30,000)"
    );
}

#[test]
fn output_still_to_come_counts_where_shared_contexts_fill_the_report() {
    // 90 % of the pod is contexts its running requests share; kvroute's 20 watched streams
    // there each have 200 output tokens to go, none of it in the report yet.
    let fleet = fleet(vec![with_metrics(pod(1), |m| m.kv_usage = 0.9)]);
    let (pod, load) = fleet.pod(endpoint(1)).expect("known");
    let mut streams: Vec<_> = (0..20)
        .map(|_| load.reserve(400, 200, PrefillEnd::FirstToken))
        .collect();
    scrape_all(&fleet);
    streams.iter_mut().for_each(|s| s.first_token());
    assert_eq!(load.committed_tokens(), 8_000, "far below the report");
    assert_eq!(free_kv_tokens(pod, load, 1), Some(6_000), "not 10,000");
}

/// One pod 80 % in use by its running batch with 10 requests in its queue (which hold no
/// block yet), where kvroute has `sent` requests in flight needing `need` tokens each,
/// all seen by a scrape.
fn pod_with_a_queue(sent: usize, need: u64) -> (Fleet, Vec<crate::fleet::Reservation>) {
    let fleet = fleet(vec![with_metrics(pod(1), |m| {
        m.kv_usage = 0.8;
        m.waiting = 10;
    })]);
    let (_, load) = fleet.pod(endpoint(1)).expect("known");
    let sent = (0..sent)
        .map(|_| load.reserve(need, need / 2, PrefillEnd::NextScrape))
        .collect();
    scrape_all(&fleet);
    (fleet, sent)
}

#[test]
fn requests_the_pod_reported_queued_count_at_the_mean_need_of_kvroutes_own_there() {
    let (fleet, sent) = pod_with_a_queue(4, 1_000);
    let (pod, load) = fleet.pod(endpoint(1)).expect("known");
    assert_eq!(load.mean_need(), 1_000);
    assert_eq!(
        free_kv_tokens(pod, load, 1),
        Some(10_000),
        "not 20,000: the queue will take 10,000 when admitted"
    );
    assert_eq!(
        free_kv_tokens(pod, load, 2),
        Some(10_000),
        "the queue is the pod's count, every replica's requests in it"
    );
    drop(sent);
    assert_eq!(load.mean_need(), 0);
    assert_eq!(
        free_kv_tokens(pod, load, 1),
        Some(24_000),
        "with nothing of kvroute's in flight there the queue's need is unknown, and what \
         its four requests held in the report (4,000) is freed"
    );
}

#[test]
fn a_pod_whose_queue_will_take_its_last_free_blocks_has_no_room() {
    // The knee of a shared-context load: the pod's running batch leaves 20 % free, but its
    // queue of 10 will take 15,000 when admitted (kvroute's own 10 there need 1,500 each).
    let (fleet, _sent) = pod_with_a_queue(10, 1_500);
    let ask = Ask {
        max_output_tokens: Some(5_000),
        ..request("base", 5_000)
    };
    let decision = pick_seeded(&ask, &fleet).expect("placed");
    assert_eq!(decision.ranked[0].free_kv_tokens, Some(5_000));
    assert!(
        decision.relaxed.kv_headroom && decision.lacks_room(),
        "placed now it would preempt: flow control holds it ({decision:?})"
    );
}

#[test]
fn cached_prompt_tokens_are_credited_against_the_kv_a_pod_must_find() {
    // 3,000-token shared context, 100-token question: pod 1 holds the context and is
    // 85 % full (mostly of that context, shared by its running requests); pod 2 is cold
    // and 75 % full. Only pod 1 can take the request without allocating the context.
    let prefix = matches(187, &[(1, 187)]);
    let ask = Ask {
        max_output_tokens: Some(200),
        prefix: Some(&prefix),
        ..request("base", 3_100)
    };
    let small = |n, usage| {
        with_metrics(pod(n), |m| {
            m.kv_capacity_tokens = Some(20_000);
            m.kv_usage = usage;
        })
    };
    let fleet = fleet(vec![small(1, 0.85), small(2, 0.75)]);
    let decision = pick_seeded(&ask, &fleet).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert!(
        !decision.relaxed.saturation && !decision.relaxed.kv_headroom,
        "the cached pod passes both filters for this request: {decision:?}"
    );
    assert_eq!(decision.ranked[0].cached_tokens, 187 * 16);
    assert_eq!(
        decision.ranked[0].kv_tokens_needed(decision.tokens_needed),
        3_100 + 200 - 187 * 16
    );
}

#[test]
fn prefix_affinity_survives_when_every_pod_fails_a_filter() {
    // Every pod is saturated by queue depth; pod 3 holds the prompt's prefix.
    let queued = |n| with_metrics(pod(n), |m| m.waiting = 9);
    let prefix = matches(100, &[(3, 100)]);
    let ask = Ask {
        prefix: Some(&prefix),
        ..request("base", 1_600)
    };
    let decision =
        pick_seeded(&ask, &fleet(vec![queued(1), queued(2), queued(3)])).expect("placed");
    assert!(decision.relaxed.saturation);
    assert_eq!(decision.endpoint, endpoint(3), "{decision:?}");
}

#[test]
fn the_prefill_a_cached_prompt_saves_counts_in_the_prefill_queue_score() {
    // Only the prefill-queue term decides: pod 2 caches 3,000 of the 3,200 prompt tokens,
    // so the request's first token there waits for 200 tokens of prefill, not 3,200.
    let config = SchedulerConfig {
        weights: Weights {
            kv_headroom: 0.0,
            queue: 0.0,
            inflight: 0.0,
            lora_affinity: 0.0,
            prefix_affinity: 0.0,
            prefill_queue: 1.0,
        },
        ..SchedulerConfig::default()
    };
    let prefix = matches(200, &[(2, 187)]);
    let ask = Ask {
        prefix: Some(&prefix),
        ..request("base", 3_200)
    };
    let snapshot = fleet(vec![pod(1), pod(2)]);
    for seed in 0..16 {
        let decision =
            pick(&ask, &snapshot, &config, &mut SmallRng::seed_from_u64(seed)).expect("placed");
        assert_eq!(decision.endpoint, endpoint(2), "seed {seed}");
        let scale = f64::from(config.prefill_queue_tokens);
        let own = (3_200 - 187 * 16) as f64;
        assert!((decision.ranked[0].prefill_queue - scale / (scale + own)).abs() < 1e-9);
    }
}

#[test]
fn kv_use_does_not_turn_a_request_away_from_the_pod_that_caches_its_context() {
    // Pod 1 runs at 90 % KV, most of it the contexts its running requests share, among
    // them this request's 3,000 tokens; pod 2 is cold at 50 %. Sending the request to pod
    // 2 would allocate the context a second time there.
    let prefix = matches(200, &[(1, 187)]);
    let ask = Ask {
        max_output_tokens: Some(200),
        prefix: Some(&prefix),
        ..request("base", 3_200)
    };
    let small = |n, usage| {
        with_metrics(pod(n), |m| {
            m.kv_capacity_tokens = Some(30_000);
            m.kv_usage = usage;
        })
    };
    let decision = pick_seeded(&ask, &fleet(vec![small(1, 0.9), small(2, 0.5)])).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert!(!decision.relaxed.any(), "{decision:?}");
    assert_eq!(decision.candidates, 2, "both pods pass the filters");

    // A request that shares nothing with pod 1 still finds it saturated.
    let cold = pick_seeded(
        &request("base", 3_200),
        &fleet(vec![small(1, 0.9), small(2, 0.5)]),
    )
    .expect("placed");
    assert_eq!(cold.endpoint, endpoint(2));
    assert_eq!(cold.candidates, 1);
}

/// A 3,200-token request, 200 tokens out, whose leading blocks `prefix` places.
fn context_request(prefix: &PrefixMatches) -> Ask<'_> {
    Ask {
        max_output_tokens: Some(200),
        prefix: Some(prefix),
        ..request("base", 3_200)
    }
}

/// Pods of 30,000 KV tokens at `usage`, with `waiting` requests queued.
fn pressed(n: u16, usage: f64, waiting: u32) -> PodView {
    with_metrics(pod(n), |m| {
        m.kv_capacity_tokens = Some(30_000);
        m.kv_usage = usage;
        m.waiting = waiting;
    })
}

#[test]
fn the_pod_holding_most_of_the_prompt_keeps_it_while_saturated_and_short_of_kv() {
    // Pod 1 caches 2,992 of the 3,200 prompt tokens but is saturated (9 waiting) and has
    // 300 tokens free against the 408 the request needs there; pod 2 is idle. Copying the
    // context to pod 2 would cost 2,992 tokens of KV more: the request queues on pod 1.
    let prefix = matches(200, &[(1, 187)]);
    let ask = context_request(&prefix);
    let snapshot = fleet(vec![pressed(1, 0.99, 9), pressed(2, 0.1, 0)]);
    let decision = pick_seeded(&ask, &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert_eq!(decision.reason, Reason::PrefixCache);
    assert!(
        !decision.relaxed.any(),
        "pod 2 passes the filters: {decision:?}"
    );
    assert_eq!(decision.candidates, 2);

    // A prompt pod 1 holds less than half of is placed as before: on pod 2.
    let short = matches(200, &[(1, 90)]);
    let ask = Ask {
        prefix: Some(&short),
        ..ask
    };
    assert_eq!(
        pick_seeded(&ask, &snapshot).expect("placed").endpoint,
        endpoint(2)
    );
}

#[test]
fn a_queued_holder_without_kv_to_start_the_prompt_lacks_room_for_flow_control() {
    // Pod 1 caches 2,992 of the 3,200 prompt tokens, has 9 requests queued and 90 tokens
    // free, less than the 208 uncached prompt tokens: the request would join that queue
    // and grow there. Stickiness still names pod 1, but the decision lacks room, so flow
    // control holds the request at the gateway until pod 1 has it.
    let prefix = matches(200, &[(1, 187)]);
    let ask = context_request(&prefix);
    let snapshot = fleet(vec![pressed(1, 0.997, 9), pressed(2, 0.1, 0)]);
    let decision = pick_seeded(&ask, &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert!(decision.relaxed.kv_headroom, "{decision:?}");
    assert!(decision.lacks_room(), "{decision:?}");
    assert_eq!(decision.reason, Reason::Fallback);

    // With room to start the prompt (300 free), or with no queue, the pod takes it now.
    for holder in [pressed(1, 0.99, 9), pressed(1, 0.997, 0)] {
        let snapshot = fleet(vec![holder, pressed(2, 0.1, 0)]);
        let decision = pick_seeded(&ask, &snapshot).expect("placed");
        assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
        assert!(!decision.lacks_room(), "{decision:?}");
    }
}

#[test]
fn requests_sent_since_the_scrape_that_a_holders_kv_cannot_hold_count_as_its_queue() {
    // Pod 1 reported no queue and 1,500 tokens free, and caches 2,992 of the prompt's
    // 3,200 tokens. kvroute has sent it seven requests of 1,000 tokens since that scrape:
    // they overfill its KV by 5,500 tokens, so five or six of them wait in its queue
    // before the report shows one. With four sent (two waiting) the holder still takes the
    // request, below the queue depth of 5; with seven the queue reaches the depth, and with
    // no KV left for the prompt the request lacks room: flow control holds it at the
    // gateway. (Their prompts count as prefilled, each having streamed a first token: a
    // holder short of KV with a prompt of kvroute's still waiting holds on that alone.)
    let prefix = matches(200, &[(1, 187)]);
    let ask = context_request(&prefix);
    let sent_since_scrape = |sent: usize| {
        let snapshot = fleet(vec![pressed(1, 0.95, 0), pressed(2, 0.1, 0)]);
        let (_, load) = snapshot.pod(endpoint(1)).expect("known");
        let reservations: Vec<_> = (0..sent)
            .map(|_| {
                let mut sent = load.reserve(1_000, 500, PrefillEnd::FirstToken);
                sent.first_token();
                sent
            })
            .collect();
        (snapshot, reservations)
    };
    let (snapshot, _sent) = sent_since_scrape(4);
    let decision = pick_seeded(&ask, &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert!(!decision.lacks_room(), "{decision:?}");

    let (snapshot, _sent) = sent_since_scrape(7);
    let decision = pick_seeded(&ask, &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert_eq!(decision.ranked[0].free_kv_tokens, Some(0));
    assert!(
        decision.relaxed.kv_headroom && decision.lacks_room(),
        "the queue kvroute's own requests make counts before a scrape shows it: \
         {decision:?}"
    );
}

#[test]
fn a_holder_short_of_kv_takes_the_request_at_once_only_when_no_prompt_it_was_sent_waits() {
    // Pod 1 reported no queue and 150 tokens free, and caches 2,992 of the prompt's 3,200
    // tokens: 208 are left to prefill, more than it has room for. With nothing kvroute sent
    // waiting there, the report is current enough and the holder takes the request at
    // once. With a streaming request kvroute sent still before its first token, the
    // report is behind that prompt and the request would queue behind it: flow control
    // holds it at the gateway until a holder has room. Its first token ends the hold.
    let prefix = matches(200, &[(1, 187)]);
    let ask = context_request(&prefix);
    let snapshot = fleet(vec![pressed(1, 0.995, 0), pressed(2, 0.1, 0)]);
    let decision = pick_seeded(&ask, &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert!(!decision.lacks_room(), "{decision:?}");

    let (_, load) = snapshot.pod(endpoint(1)).expect("known");
    let mut waiting_for_prefill = load.reserve(100, 80, PrefillEnd::FirstToken);
    let decision = pick_seeded(&ask, &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert!(
        decision.relaxed.kv_headroom && decision.lacks_room(),
        "a prompt kvroute sent still waits there: {decision:?}"
    );

    waiting_for_prefill.first_token();
    let decision = pick_seeded(&ask, &snapshot).expect("placed");
    assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
    assert!(!decision.lacks_room(), "its prefill is done: {decision:?}");
}

#[test]
fn a_prefix_holder_loaded_past_the_slack_gives_the_prefix_up() {
    let prefix = matches(200, &[(1, 187)]);
    let ask = context_request(&prefix);
    // 17 more requests than the idle pod: past the slack of 16, the context moves.
    let snapshot = fleet(vec![pressed(1, 0.99, 17), pressed(2, 0.1, 0)]);
    assert_eq!(
        pick_seeded(&ask, &snapshot).expect("placed").endpoint,
        endpoint(2)
    );
    // At the slack, it stays.
    let snapshot = fleet(vec![pressed(1, 0.99, 16), pressed(2, 0.1, 0)]);
    assert_eq!(
        pick_seeded(&ask, &snapshot).expect("placed").endpoint,
        endpoint(1)
    );
}

/// A home the KV events confirm keeps its context's requests through twice the slack of
/// a holder kvroute only remembers.
#[test]
fn a_confirmed_home_keeps_its_context_through_a_larger_imbalance() {
    let held = matches(200, &[(1, 187)]);
    let homed = held.clone().homed(0);
    let endpoint_for = |prefix: &PrefixMatches, waiting: u32| {
        let snapshot = fleet(vec![pressed(1, 0.5, waiting), pressed(2, 0.1, 0)]);
        pick_seeded(&context_request(prefix), &snapshot)
            .expect("placed")
            .endpoint
    };
    // 17 more requests than the idle pod: a remembered holder gives the context up, a
    // home keeps it.
    assert_eq!(endpoint_for(&held, 17), endpoint(2));
    assert_eq!(endpoint_for(&homed, 17), endpoint(1));
    // At 32 more the home keeps it still; past that it gives it up too.
    assert_eq!(endpoint_for(&homed, 32), endpoint(1));
    assert_eq!(endpoint_for(&homed, 33), endpoint(2));
}

/// Where the matches name a context's home, another pod's copy of the context draws
/// nothing (no stickiness, no prefix score) and is scored and reserved as holding nothing,
/// but the soft filters credit it what it caches, and the trace shows what it holds.
#[test]
fn a_copy_of_a_context_whose_home_is_another_pod_is_credited_only_by_the_filters() {
    // Pods 1 and 2 both cache 2,992 of the 3,200 prompt tokens; pod 1 is the home.
    let copies = matches(200, &[(1, 187), (2, 187)]);
    let homed = copies.clone().homed(0);
    assert_eq!(homed.home(), Some(0));
    let held = 187 * 16;

    // All idle: the home alone draws the request; without a home either copy could win.
    let idle = fleet(vec![
        pressed(1, 0.1, 0),
        pressed(2, 0.1, 0),
        pressed(3, 0.1, 0),
    ]);
    let mut winners = std::collections::HashSet::new();
    for decision in pick_under_seeds(&context_request(&homed), &idle) {
        let decision = decision.expect("placed");
        assert_eq!(decision.endpoint, endpoint(1), "{decision:?}");
        assert_eq!(decision.candidates, 3, "{decision:?}");
        assert_eq!(
            decision.ranked.len(),
            1,
            "only the home competes: {decision:?}"
        );
    }
    for decision in pick_under_seeds(&context_request(&copies), &idle) {
        let decision = decision.expect("placed");
        assert_eq!(
            decision.ranked.len(),
            2,
            "both copies compete: {decision:?}"
        );
        winners.insert(decision.endpoint);
    }
    assert_eq!(
        winners,
        [endpoint(1), endpoint(2)].into_iter().collect(),
        "ties between copies are broken at random"
    );

    // The home is loaded past its slack, pods 2 and 3 are at 95 % KV use (1,500 tokens
    // free). Pod 3 is saturated and short of the 3,400 tokens the request needs; pod 2's
    // copy makes it neither (it needs 408 there): it alone passes the filters.
    let pressed_fleet = fleet(vec![
        pressed(1, 0.5, 33),
        pressed(2, 0.95, 0),
        pressed(3, 0.95, 0),
    ]);
    let decision = pick_seeded(&context_request(&homed), &pressed_fleet).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2), "{decision:?}");
    assert!(!decision.relaxed.any(), "{decision:?}");
    let copy = &decision.ranked[0];
    assert_eq!(copy.prefix, 0.0, "a copy away from home draws nothing");
    assert_eq!(copy.cached_tokens, 0, "and is sized as holding nothing");
    assert_eq!(copy.held_tokens, held, "the trace shows what it holds");
    assert_eq!(copy.kv_tokens_needed(decision.tokens_needed), 3_400);

    // Without a home, the same copy competes as a holder and is credited in full.
    let decision = pick_seeded(&context_request(&copies), &pressed_fleet).expect("placed");
    assert_eq!(decision.endpoint, endpoint(2), "{decision:?}");
    let copy = &decision.ranked[0];
    assert!(copy.prefix > 0.9, "{copy:?}");
    assert_eq!((copy.cached_tokens, copy.held_tokens), (held, held));
}

/// A request told to leave `keep_free_tokens` free (a busy tenant beside a quiet one) lacks
/// room on a pod whose free KV covers only its own need, and fits one that has both.
#[test]
fn a_request_leaving_room_in_tokens_needs_that_much_more_free_kv() {
    // Pod 1: 2,000 tokens free; pod 2: 10,000 free (of CAPACITY).
    let free = |n, tokens: u64| {
        with_metrics(pod(n), |m| {
            m.kv_usage = 1.0 - tokens as f64 / CAPACITY as f64;
        })
    };
    let ask = request("base", 1_000);
    let mut config = SchedulerConfig::default();
    let only_small = fleet(vec![free(1, 2_000)]);
    let decision = pick(&ask, &only_small, &config, &mut SmallRng::seed_from_u64(1)).expect("ok");
    assert!(!decision.lacks_room(), "{decision:?}");
    config.keep_free_tokens = 5_000;
    let decision = pick(&ask, &only_small, &config, &mut SmallRng::seed_from_u64(1)).expect("ok");
    assert!(decision.lacks_room(), "{decision:?}");
    let both = fleet(vec![free(1, 2_000), free(2, 10_000)]);
    for seed in 0..10 {
        let decision = pick(&ask, &both, &config, &mut SmallRng::seed_from_u64(seed)).expect("ok");
        assert_eq!(decision.endpoint, endpoint(2), "{decision:?}");
        assert!(!decision.lacks_room(), "{decision:?}");
    }
    // Never more than half the pool: a reserve of the whole pool leaves 50,000 to keep.
    config.keep_free_tokens = CAPACITY;
    let roomy = fleet(vec![free(3, 52_000)]);
    let decision = pick(&ask, &roomy, &config, &mut SmallRng::seed_from_u64(1)).expect("ok");
    assert!(!decision.lacks_room(), "{decision:?}");
    let tight = fleet(vec![free(3, 50_500)]);
    let decision = pick(&ask, &tight, &config, &mut SmallRng::seed_from_u64(1)).expect("ok");
    assert!(decision.lacks_room(), "{decision:?}");
}
