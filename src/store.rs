//! The pod store: what kvroute knows about every endpoint, published as immutable
//! snapshots for the picker.
//!
//! Writers (discovery, scrapers) update the store; each change marks it dirty and a
//! publisher task rebuilds the [`Fleet`] (cheap: per-pod data sits behind `Arc`s, and the
//! snapshot's model index is built once here rather than per request). Readers take the
//! current fleet without locking the writers out.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use kvroute_core::fleet::{
    Fleet, HealthPolicy, HealthTracker, PodLoad, PodMetrics, PodView, ScrapeTicket, ServedModels,
};
use tokio::sync::{Notify, watch};

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
    /// Load counters of endpoints that left while requests routed there were still open.
    /// An endpoint that comes back (a readiness flap, a discovery blip) gets its counters
    /// back, so those requests still count; entries die with the last such request.
    departed: Mutex<HashMap<SocketAddr, Weak<PodLoad>>>,
    health_policy: HealthPolicy,
    published: watch::Sender<Arc<Fleet>>,
    /// Held through a whole publish: two publishers at once (the publisher task and a
    /// passive-health mark) must not send their fleets in the other order, which would
    /// publish the older state last.
    publishing: Mutex<()>,
    dirty: Notify,
    endpoints_version: AtomicU64,
}

impl PodStore {
    pub fn new(health_policy: HealthPolicy) -> Self {
        PodStore {
            pods: Mutex::new(BTreeMap::new()),
            departed: Mutex::new(HashMap::new()),
            health_policy,
            published: watch::Sender::new(Arc::new(Fleet::default())),
            publishing: Mutex::new(()),
            dirty: Notify::new(),
            endpoints_version: AtomicU64::new(0),
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
    /// succeeds; removed ones vanish from the next snapshot. A removed endpoint's in-flight
    /// accounting lives on while its requests are open, and is taken up again if the
    /// endpoint returns meanwhile. Returns whether anything changed.
    pub fn set_endpoints(&self, endpoints: &[SocketAddr]) -> bool {
        let wanted: HashSet<&SocketAddr> = endpoints.iter().collect();
        let mut pods = self.lock();
        let mut departed = self
            .departed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let before = pods.len();
        pods.retain(|endpoint, record| {
            let keep = wanted.contains(endpoint);
            if !keep && record.load.inflight() > 0 {
                departed.insert(*endpoint, Arc::downgrade(&record.load));
            }
            keep
        });
        departed.retain(|_, load| load.strong_count() > 0);
        let mut changed = pods.len() != before;
        for endpoint in endpoints {
            pods.entry(*endpoint).or_insert_with(|| {
                changed = true;
                let load = departed
                    .remove(endpoint)
                    .and_then(|load| load.upgrade())
                    .unwrap_or_default();
                PodRecord {
                    metrics: None,
                    scraped_at: None,
                    models: None,
                    health: HealthTracker::default(),
                    load,
                    unpublished: None,
                }
            });
        }
        drop(departed);
        if changed {
            // Bumped under the lock, so a publish that sees the new set sees the new version.
            self.endpoints_version.fetch_add(1, Ordering::Relaxed);
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

    /// Records one scrape's outcome: the metrics it read, or `None` when it failed.
    /// Returns whether the pod is healthy afterwards (None when the endpoint is no longer
    /// known). `ticket` is what [`PodLoad::scrape_started`] returned when the scrape
    /// began, at `at`.
    pub fn record_scrape(
        &self,
        endpoint: SocketAddr,
        metrics: Option<PodMetrics>,
        ticket: ScrapeTicket,
        at: Instant,
    ) -> Option<bool> {
        let mut pods = self.lock();
        let record = pods.get_mut(&endpoint)?;
        match metrics {
            Some(metrics) => {
                record.metrics = Some(Arc::new(metrics));
                record.scraped_at = Some(at);
                record.unpublished = Some(ticket);
                record.health.record_success(&self.health_policy);
            }
            None => record.health.record_failure(&self.health_policy),
        }
        let healthy = record.health.is_up();
        drop(pods);
        self.dirty.notify_one();
        Some(healthy)
    }

    /// The gateway failed to connect to `endpoint` (passive health): the pod leaves
    /// rotation now rather than after its scrapes fail, and returns once they succeed
    /// again. Returns whether it was up (false also for an unknown endpoint).
    ///
    /// A pod going down is published here, before the caller answers the gateway: the
    /// client that got the failure may retry at once, and the publisher task (which may
    /// be sleeping off its coalescing gap) must not leave that retry a fleet in which the
    /// dead pod is still up. Rare (once per transition), so the O(pods) rebuild is fine.
    pub fn record_unreachable(&self, endpoint: SocketAddr) -> bool {
        let mut pods = self.lock();
        let Some(record) = pods.get_mut(&endpoint) else {
            return false;
        };
        let was_up = record.health.is_up();
        record.health.record_unreachable(&self.health_policy);
        drop(pods);
        if was_up {
            self.publish(Instant::now());
        } else {
            self.dirty.notify_one();
        }
        was_up
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

    /// Rebuilds and publishes the fleet, with metric ages measured at `now`.
    pub fn publish(&self, now: Instant) -> Arc<Fleet> {
        let _publishing = self
            .publishing
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut records = self.lock();
        let pods: Vec<(PodView, Arc<PodLoad>)> = records
            .iter_mut()
            .map(|(endpoint, record)| {
                if let Some(ticket) = record.unpublished.take() {
                    record.load.scrape_succeeded(ticket);
                }
                let view = PodView::new(
                    *endpoint,
                    record.health.is_up(),
                    record.metrics.clone(),
                    record
                        .scraped_at
                        .map(|at| now.saturating_duration_since(at)),
                    record.models.clone(),
                );
                (view, Arc::clone(&record.load))
            })
            .collect();
        let endpoints_version = self.endpoints_version.load(Ordering::Relaxed);
        drop(records);
        let previous = Arc::clone(&self.published.borrow());
        let generation = previous.snapshot().generation + 1;
        let fleet = Arc::new(Fleet::new_after(
            &previous,
            pods,
            generation,
            endpoints_version,
        ));
        self.published.send_replace(Arc::clone(&fleet));
        fleet
    }

    /// The current fleet.
    pub fn fleet(&self) -> Arc<Fleet> {
        Arc::clone(&self.published.borrow())
    }

    /// Follows every published fleet (readiness, tests waiting for a state).
    pub fn subscribe(&self) -> watch::Receiver<Arc<Fleet>> {
        self.published.subscribe()
    }

    /// Rebuilds the snapshot whenever the store changes, and at least every
    /// `max_interval` so that metric ages stay current. Runs until dropped.
    pub async fn run_publisher(self: Arc<Self>, max_interval: Duration) {
        // Coalesce bursts of scrape results into one rebuild.
        let min_gap = (max_interval / 10).clamp(Duration::from_millis(1), Duration::from_millis(5));
        loop {
            let _ = tokio::time::timeout(max_interval, self.dirty.notified()).await;
            let started = Instant::now();
            self.publish(started);
            tokio::time::sleep(publish_gap(min_gap, started.elapsed(), max_interval)).await;
        }
    }
}

/// The pause after a rebuild that took `cost`: `min_gap`, or long enough that rebuilding
/// takes at most 1/[`PUBLISH_SHARE`] of a core when that is longer, but never past half
/// the scrape interval (a scrape's result still shows within it). A rebuild walks every
/// pod and rebuilds the model and adapter indexes: at 1,000 pods scraped every 50 ms,
/// publishing every 5 ms took a tenth of kvroute's CPU.
fn publish_gap(min_gap: Duration, cost: Duration, max_interval: Duration) -> Duration {
    min_gap.max((cost * PUBLISH_SHARE).min(max_interval / 2))
}

/// See [`publish_gap`]: rebuilds take at most a 1/20th of a core.
const PUBLISH_SHARE: u32 = 20;

mod pod_tasks;

pub use pod_tasks::PodTasks;

#[cfg(test)]
mod tests;
