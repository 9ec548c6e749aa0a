//! The pod store: what kvroute knows about every endpoint, published as immutable
//! snapshots for the scheduler.
//!
//! Writers (discovery, scrapers) update the store; each change marks it dirty and a
//! publisher task rebuilds the [`Snapshot`] (cheap: per-pod data sits behind `Arc`s).
//! Readers take the current snapshot without locking the writers out.

mod health;
mod load;
mod prefix;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};

pub use health::{HealthPolicy, HealthTracker};
pub use load::{PodLoad, RECENT_ADAPTERS, Reservation, ScrapeTicket, adapter_key};
pub use prefix::{BLOCK_BYTES, PrefixIndex, PrefixMatches, block_hashes};

use crate::scrape::vllm::PodMetrics;

/// The models one pod can serve, from its `/v1/models`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServedModels {
    /// Base models (entries without a `parent`).
    pub base: Vec<String>,
    /// LoRA adapters by name, with their base model.
    pub adapters: HashMap<String, String>,
}

impl ServedModels {
    /// Whether `model` names one of this pod's base models or adapters.
    pub fn serves(&self, model: &str) -> bool {
        self.base.iter().any(|b| b == model) || self.adapters.contains_key(model)
    }

    /// Whether `model` is one of this pod's LoRA adapters.
    pub fn is_adapter(&self, model: &str) -> bool {
        self.adapters.contains_key(model)
    }
}

/// The few numbers the scheduler reads for every pod, copied out of the scrape when
/// the snapshot is built, so a pick over thousands of pods finds them in place rather
/// than behind a pointer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSignals {
    pub waiting: u32,
    /// KV-cache use, 0..=1.
    pub kv_usage: f32,
    /// KV capacity in tokens; 0 when the pod does not report it.
    pub kv_capacity_tokens: u64,
}

impl LoadSignals {
    pub fn of(metrics: &PodMetrics) -> Self {
        LoadSignals {
            waiting: metrics.waiting,
            kv_usage: metrics.kv_usage.clamp(0.0, 1.0) as f32,
            kv_capacity_tokens: metrics.kv_capacity_tokens.unwrap_or(0),
        }
    }
}

/// One pod as the scheduler sees it.
#[derive(Debug, Clone)]
pub struct PodView {
    pub endpoint: SocketAddr,
    /// Up or down, after hysteresis over scrape results.
    pub healthy: bool,
    /// The last successful scrape, if any; set with [`PodView::new`] or
    /// [`PodView::set_metrics`] so that `signals` follows.
    metrics: Option<Arc<PodMetrics>>,
    signals: Option<LoadSignals>,
    /// How old `metrics` was when this snapshot was built.
    pub metrics_age: Option<Duration>,
    /// What the pod's `/v1/models` said, if it answered yet.
    pub models: Option<Arc<ServedModels>>,
    /// kvroute's own in-flight accounting for this pod (live counters).
    pub load: Arc<PodLoad>,
}

impl PodView {
    pub fn new(
        endpoint: SocketAddr,
        healthy: bool,
        metrics: Option<Arc<PodMetrics>>,
        metrics_age: Option<Duration>,
        models: Option<Arc<ServedModels>>,
        load: Arc<PodLoad>,
    ) -> Self {
        PodView {
            endpoint,
            healthy,
            signals: metrics.as_deref().map(LoadSignals::of),
            metrics,
            metrics_age,
            models,
            load,
        }
    }

    /// The last successful scrape, if any.
    pub fn metrics(&self) -> Option<&PodMetrics> {
        self.metrics.as_deref()
    }

    /// The scheduler's numbers from the last scrape, if any.
    pub fn signals(&self) -> Option<&LoadSignals> {
        self.signals.as_ref()
    }

    pub fn set_metrics(&mut self, metrics: Option<Arc<PodMetrics>>) {
        self.signals = metrics.as_deref().map(LoadSignals::of);
        self.metrics = metrics;
    }
}

/// An immutable view of the fleet.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Pods sorted by endpoint, so iteration order never depends on hashing.
    pub pods: Vec<PodView>,
    /// Incremented with every rebuild.
    pub generation: u64,
    /// Incremented whenever the endpoint set changes (not with every rebuild), so
    /// per-endpoint memories elsewhere know when to forget departed pods.
    pub endpoints_version: u64,
}

impl Snapshot {
    /// Whether any pod has been scraped successfully: the readiness condition.
    pub fn has_metrics(&self) -> bool {
        self.pods
            .iter()
            .any(|pod| pod.healthy && pod.metrics.is_some())
    }

    /// The pod at `endpoint`, if known.
    pub fn pod(&self, endpoint: SocketAddr) -> Option<&PodView> {
        self.pods
            .binary_search_by(|pod| pod.endpoint.cmp(&endpoint))
            .ok()
            .map(|index| &self.pods[index])
    }
}

#[derive(Debug)]
struct PodRecord {
    metrics: Option<Arc<PodMetrics>>,
    scraped_at: Option<Instant>,
    models: Option<Arc<ServedModels>>,
    health: HealthTracker,
    load: Arc<PodLoad>,
    /// The ticket of a successful scrape whose metrics are not yet published: the
    /// in-flight ledger absorbs it when they are, so a pick never sees the new
    /// accounting with the old metrics.
    unpublished: Option<ScrapeTicket>,
}

/// What kvroute knows about each endpoint.
#[derive(Debug)]
pub struct PodStore {
    pods: Mutex<BTreeMap<SocketAddr, PodRecord>>,
    health_policy: HealthPolicy,
    published: watch::Sender<Arc<Snapshot>>,
    dirty: Notify,
    endpoints_version: std::sync::atomic::AtomicU64,
}

impl PodStore {
    pub fn new(health_policy: HealthPolicy) -> Self {
        PodStore {
            pods: Mutex::new(BTreeMap::new()),
            health_policy,
            published: watch::Sender::new(Arc::new(Snapshot::default())),
            dirty: Notify::new(),
            endpoints_version: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<SocketAddr, PodRecord>> {
        // Records are replaced field by field; a panic mid-update leaves at worst one
        // stale field, which the next scrape overwrites.
        self.pods
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Replaces the endpoint set. New endpoints start down until their first scrape
    /// succeeds; removed ones vanish from the next snapshot together with their
    /// in-flight accounting. Returns whether anything changed.
    pub fn set_endpoints(&self, endpoints: &[SocketAddr]) -> bool {
        let wanted: std::collections::HashSet<&SocketAddr> = endpoints.iter().collect();
        let mut pods = self.lock();
        let before = pods.len();
        pods.retain(|endpoint, _| wanted.contains(endpoint));
        let mut changed = pods.len() != before;
        for endpoint in endpoints {
            pods.entry(*endpoint).or_insert_with(|| {
                changed = true;
                PodRecord {
                    metrics: None,
                    scraped_at: None,
                    models: None,
                    health: HealthTracker::default(),
                    load: Arc::new(PodLoad::default()),
                    unpublished: None,
                }
            });
        }
        if changed {
            // Bumped under the lock, so a publish that sees the new set sees the new version.
            self.endpoints_version
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        drop(pods);
        if changed {
            self.dirty.notify_one();
        }
        changed
    }

    /// The endpoints currently known.
    pub fn endpoints(&self) -> Vec<SocketAddr> {
        self.lock().keys().copied().collect()
    }

    /// The load counters of an endpoint, for the scraper's ticketing.
    pub fn load(&self, endpoint: SocketAddr) -> Option<Arc<PodLoad>> {
        self.lock()
            .get(&endpoint)
            .map(|record| Arc::clone(&record.load))
    }

    /// Records one scrape's outcome. Returns whether the pod is healthy afterwards
    /// (None when the endpoint is no longer known).
    /// `ticket` is what [`PodLoad::scrape_started`] returned when the scrape began, at
    /// `at`.
    pub fn record_scrape<E>(
        &self,
        endpoint: SocketAddr,
        outcome: Result<PodMetrics, E>,
        ticket: ScrapeTicket,
        at: Instant,
    ) -> Option<bool> {
        let mut pods = self.lock();
        let record = pods.get_mut(&endpoint)?;
        match outcome {
            Ok(metrics) => {
                record.metrics = Some(Arc::new(metrics));
                record.scraped_at = Some(at);
                record.unpublished = Some(ticket);
                record.health.record_success(&self.health_policy);
            }
            Err(_) => record.health.record_failure(&self.health_policy),
        }
        let healthy = record.health.is_up();
        drop(pods);
        self.dirty.notify_one();
        Some(healthy)
    }

    /// Records what the pod's `/v1/models` said.
    /// Pods serving the same models share one `Arc`, which lets the scheduler check
    /// a model once per distinct list rather than once per pod.
    pub fn record_models(&self, endpoint: SocketAddr, models: ServedModels) {
        let mut pods = self.lock();
        if pods
            .get(&endpoint)
            .is_none_or(|r| r.models.as_deref() == Some(&models))
        {
            return;
        }
        let shared = pods
            .values()
            .filter_map(|r| r.models.as_ref())
            .find(|m| ***m == models)
            .cloned()
            .unwrap_or_else(|| Arc::new(models));
        if let Some(record) = pods.get_mut(&endpoint) {
            record.models = Some(shared);
        }
        drop(pods);
        self.dirty.notify_one();
    }

    /// Rebuilds and publishes the snapshot, with metric ages measured at `now`.
    pub fn publish(&self, now: Instant) -> Arc<Snapshot> {
        let mut records = self.lock();
        let pods: Vec<PodView> = records
            .iter_mut()
            .map(|(endpoint, record)| {
                if let Some(ticket) = record.unpublished.take() {
                    record.load.scrape_succeeded(ticket);
                }
                PodView::new(
                    *endpoint,
                    record.health.is_up(),
                    record.metrics.clone(),
                    record
                        .scraped_at
                        .map(|at| now.saturating_duration_since(at)),
                    record.models.clone(),
                    Arc::clone(&record.load),
                )
            })
            .collect();
        let endpoints_version = self
            .endpoints_version
            .load(std::sync::atomic::Ordering::Relaxed);
        drop(records);
        let generation = self.published.borrow().generation + 1;
        let snapshot = Arc::new(Snapshot {
            pods,
            generation,
            endpoints_version,
        });
        self.published.send_replace(Arc::clone(&snapshot));
        snapshot
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(&self.published.borrow())
    }

    /// Follows every published snapshot (readiness, tests waiting for a state).
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.published.subscribe()
    }

    /// Rebuilds the snapshot whenever the store changes, and at least every
    /// `max_interval` so that metric ages stay current. Runs until dropped.
    pub async fn run_publisher(self: Arc<Self>, max_interval: Duration) {
        // Coalesce bursts of scrape results into one rebuild.
        let min_gap = (max_interval / 10).clamp(Duration::from_millis(1), Duration::from_millis(5));
        loop {
            let _ = tokio::time::timeout(max_interval, self.dirty.notified()).await;
            self.publish(Instant::now());
            tokio::time::sleep(min_gap).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    fn scrape_ok(store: &PodStore, endpoint: SocketAddr, at: Instant) {
        let ticket = store.load(endpoint).expect("known").scrape_started();
        store.record_scrape::<()>(endpoint, Ok(PodMetrics::default()), ticket, at);
    }

    #[test]
    fn in_flight_tokens_are_absorbed_only_when_the_scrape_is_published() {
        let store = PodStore::new(HealthPolicy::default());
        store.set_endpoints(&[addr(1)]);
        let load = store.load(addr(1)).expect("known");
        let _request = load.reserve(500, 0);
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
        let snapshot = store.publish(Instant::now());
        assert!(!snapshot.pods[0].healthy);
        assert!(!snapshot.has_metrics());
        scrape_ok(&store, addr(1), Instant::now());
        let snapshot = store.publish(Instant::now());
        assert!(snapshot.pods[0].healthy);
        assert!(snapshot.has_metrics());
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
        let snapshot = store.publish(Instant::now());
        let (a, b) = (&snapshot.pods[0].models, &snapshot.pods[1].models);
        assert!(matches!((a, b), (Some(a), Some(b)) if Arc::ptr_eq(a, b)));
    }

    #[test]
    fn removed_endpoints_vanish_from_the_next_snapshot() {
        let store = PodStore::new(HealthPolicy::default());
        store.set_endpoints(&[addr(1), addr(2)]);
        store.set_endpoints(&[addr(2)]);
        let snapshot = store.publish(Instant::now());
        let endpoints: Vec<_> = snapshot.pods.iter().map(|p| p.endpoint).collect();
        assert_eq!(endpoints, vec![addr(2)]);
    }

    #[test]
    fn snapshots_carry_the_age_of_each_pods_metrics() {
        let store = PodStore::new(HealthPolicy::default());
        store.set_endpoints(&[addr(1)]);
        let scraped = Instant::now();
        scrape_ok(&store, addr(1), scraped);
        let snapshot = store.publish(scraped + Duration::from_millis(300));
        assert_eq!(
            snapshot.pods[0].metrics_age,
            Some(Duration::from_millis(300))
        );
    }

    #[test]
    fn pods_are_sorted_by_endpoint_and_found_by_lookup() {
        let store = PodStore::new(HealthPolicy::default());
        store.set_endpoints(&[addr(3), addr(1), addr(2)]);
        let snapshot = store.publish(Instant::now());
        assert!(
            snapshot
                .pods
                .windows(2)
                .all(|w| w[0].endpoint < w[1].endpoint)
        );
        assert_eq!(snapshot.pod(addr(2)).map(|p| p.endpoint), Some(addr(2)));
        assert!(snapshot.pod(addr(9)).is_none());
    }
}
