use std::collections::HashMap;

use kvroute_core::fleet::PrefillEnd;

use super::*;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], port))
}

fn scrape_ok(store: &PodStore, endpoint: SocketAddr, at: Instant) {
    let ticket = store.load(endpoint).expect("known").scrape_started();
    store.record_scrape(endpoint, Some(PodMetrics::default()), ticket, at);
}

#[test]
fn in_flight_tokens_are_absorbed_only_when_the_scrape_is_published() {
    let store = PodStore::new(HealthPolicy::default());
    store.set_endpoints(&[addr(1)]);
    let load = store.load(addr(1)).expect("known");
    let _request = load.reserve(500, 0, PrefillEnd::FirstToken);
    scrape_ok(&store, addr(1), Instant::now());
    assert_eq!(
        load.unscraped_tokens(),
        500,
        "old snapshot still lacks the scrape"
    );
    store.publish(Instant::now());
    assert_eq!(load.unscraped_tokens(), 0);
}

#[test]
fn new_endpoints_stay_down_until_their_first_scrape() {
    let store = PodStore::new(HealthPolicy::default());
    store.set_endpoints(&[addr(1)]);
    let fleet = store.publish(Instant::now());
    let snapshot = fleet.snapshot();
    assert!(!snapshot.pods()[0].healthy);
    assert!(!snapshot.has_metrics());
    scrape_ok(&store, addr(1), Instant::now());
    let fleet = store.publish(Instant::now());
    let snapshot = fleet.snapshot();
    assert!(snapshot.pods()[0].healthy);
    assert!(snapshot.has_metrics());
}

#[test]
fn a_pod_the_gateway_cannot_reach_is_down_in_the_fleet_before_the_report_returns() {
    let store = PodStore::new(HealthPolicy::default());
    store.set_endpoints(&[addr(1), addr(2)]);
    scrape_ok(&store, addr(1), Instant::now());
    scrape_ok(&store, addr(2), Instant::now());
    store.publish(Instant::now());
    assert!(store.fleet().snapshot().pods().iter().all(|p| p.healthy));
    // No publisher task runs here: the fleet readers see must already lack the pod.
    assert!(store.record_unreachable(addr(1)));
    let fleet = store.fleet();
    let health: Vec<bool> = fleet.snapshot().pods().iter().map(|p| p.healthy).collect();
    assert_eq!(health, [false, true]);
    assert!(!store.record_unreachable(addr(1)), "already down");
}

#[test]
fn pods_with_equal_model_lists_share_one_copy() {
    let store = PodStore::new(HealthPolicy::default());
    store.set_endpoints(&[addr(1), addr(2)]);
    let models = ServedModels {
        base: vec!["llama".into()],
        adapters: HashMap::new(),
    };
    store.record_models(addr(1), models.clone());
    store.record_models(addr(2), models);
    let fleet = store.publish(Instant::now());
    let snapshot = fleet.snapshot();
    let (a, b) = (&snapshot.pods()[0].models, &snapshot.pods()[1].models);
    assert!(matches!((a, b), (Some(a), Some(b)) if Arc::ptr_eq(a, b)));
}

#[test]
fn removed_endpoints_vanish_from_the_next_snapshot() {
    let store = PodStore::new(HealthPolicy::default());
    store.set_endpoints(&[addr(1), addr(2)]);
    store.set_endpoints(&[addr(2)]);
    let fleet = store.publish(Instant::now());
    let snapshot = fleet.snapshot();
    let endpoints: Vec<_> = snapshot.pods().iter().map(|p| p.endpoint).collect();
    assert_eq!(endpoints, vec![addr(2)]);
}

#[test]
fn snapshots_carry_the_age_of_each_pods_metrics() {
    let store = PodStore::new(HealthPolicy::default());
    store.set_endpoints(&[addr(1)]);
    let scraped = Instant::now();
    scrape_ok(&store, addr(1), scraped);
    let fleet = store.publish(scraped + Duration::from_millis(300));
    let snapshot = fleet.snapshot();
    assert_eq!(
        snapshot.pods()[0].metrics_age,
        Some(Duration::from_millis(300))
    );
}

#[test]
fn pods_are_sorted_by_endpoint_and_found_by_lookup() {
    let store = PodStore::new(HealthPolicy::default());
    store.set_endpoints(&[addr(3), addr(1), addr(2)]);
    let fleet = store.publish(Instant::now());
    let snapshot = fleet.snapshot();
    assert!(
        snapshot
            .pods()
            .windows(2)
            .all(|w| w[0].endpoint < w[1].endpoint)
    );
    assert_eq!(snapshot.pod(addr(2)).map(|p| p.endpoint), Some(addr(2)));
    assert!(snapshot.pod(addr(9)).is_none());
}

#[test]
fn an_endpoint_that_leaves_and_returns_keeps_the_requests_still_open_there() {
    let store = PodStore::new(HealthPolicy::default());
    store.set_endpoints(&[addr(1), addr(2)]);
    let open = store
        .load(addr(1))
        .expect("known")
        .reserve(700, 100, PrefillEnd::FirstToken);
    store.set_endpoints(&[addr(2)]);
    assert!(store.load(addr(1)).is_none(), "gone from the fleet");
    store.set_endpoints(&[addr(1), addr(2)]);
    let back = store.load(addr(1)).expect("back");
    assert_eq!(
        (back.inflight(), back.committed_tokens()),
        (1, 700),
        "the open request still counts"
    );
    drop(open);
    assert_eq!(back.inflight(), 0);

    // Once nothing is open there, leaving forgets it and returning starts afresh.
    store.set_endpoints(&[addr(2)]);
    store.set_endpoints(&[addr(1), addr(2)]);
    assert!(!Arc::ptr_eq(&back, &store.load(addr(1)).expect("back")));
    assert!(store.departed.lock().expect("lock").is_empty());
}

#[test]
fn rebuilds_pause_longer_when_they_cost_more_but_within_half_the_interval() {
    let (min_gap, interval) = (Duration::from_millis(5), Duration::from_millis(50));
    let gap = |micros| publish_gap(min_gap, Duration::from_micros(micros), interval);
    assert_eq!(gap(40), min_gap, "a small fleet's rebuild");
    assert_eq!(gap(400), Duration::from_millis(8), "20x the rebuild");
    assert_eq!(
        gap(5_000),
        Duration::from_millis(25),
        "at most half the interval"
    );
}
