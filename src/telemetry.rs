//! kvroute's own Prometheus metrics: every name, its help text and its labels live
//! here, so dashboards and this file can be checked against each other.
//!
//! Label values are bounded: pods by endpoint (the fleet's size), models by what the
//! fleet serves (anything else is `other`), outcomes and reasons by fixed enums. No
//! request ids, no prompts.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, Unit, counter, describe_counter, describe_gauge, describe_histogram,
    gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;

use kvroute_core::fleet::PodMetrics;
use kvroute_core::flow::Priority;

use crate::flow::{DEFAULT_TENANT, DropReason};
use kvroute_core::scheduler::Reason;

/// How long a gauge no one sets stays exported by default: a departed pod's gauges leave
/// with it.
pub const GAUGE_IDLE_TIMEOUT: Duration = Duration::from_secs(120);

pub const REQUESTS: &str = "kvroute_requests_total";
pub const PICK_DURATION: &str = "kvroute_pick_duration_seconds";
pub const DECISIONS: &str = "kvroute_decisions_total";
pub const REQUEST_DURATION: &str = "kvroute_request_duration_seconds";
pub const COMPLETION_TOKENS: &str = "kvroute_completion_tokens_total";
pub const POD_KV_USAGE: &str = "kvroute_pod_kv_cache_usage_ratio";
pub const POD_KV_CAPACITY: &str = "kvroute_pod_kv_cache_capacity_tokens";
pub const POD_WAITING: &str = "kvroute_pod_requests_waiting";
pub const POD_RUNNING: &str = "kvroute_pod_requests_running";
pub const POD_RUNNING_ADAPTERS: &str = "kvroute_pod_running_lora_adapters";
pub const POD_INFLIGHT: &str = "kvroute_pod_inflight_requests";
pub const POD_HEALTHY: &str = "kvroute_pod_healthy";
pub const SCRAPES: &str = "kvroute_scrapes_total";
pub const SCRAPE_ERRORS: &str = "kvroute_scrape_errors_total";
pub const SCRAPE_DURATION: &str = "kvroute_scrape_duration_seconds";
pub const SNAPSHOT_AGE: &str = "kvroute_snapshot_metrics_age_seconds";
pub const ENDPOINTS: &str = "kvroute_endpoints";
pub const UPSTREAM_UNREACHABLE: &str = "kvroute_pod_unreachable_total";
pub const EXTPROC_STREAMS: &str = "kvroute_extproc_streams";
pub const CONNECTIONS_REFUSED: &str = "kvroute_connections_refused_total";
pub const SILENT_STREAMS_REFUSED: &str = "kvroute_extproc_silent_streams_refused_total";
pub const MEMORY_ALLOCATED: &str = "kvroute_memory_allocated_bytes";
pub const MEMORY_RESIDENT: &str = "kvroute_memory_resident_bytes";
pub const PREFIX_INDEX_ENTRIES: &str = "kvroute_prefix_index_entries";
pub const PREFIX_INDEX_CAPACITY: &str = "kvroute_prefix_index_capacity_entries";
pub const FLOW_QUEUE: &str = "kvroute_flow_queue_requests";
pub const FLOW_QUEUE_WAIT: &str = "kvroute_flow_queue_wait_seconds";
pub const FLOW_DROPPED: &str = "kvroute_flow_dropped_total";
pub const FLOW_TENANT_REQUESTS: &str = "kvroute_flow_tenant_requests_total";
pub const KV_EVENT_BATCHES: &str = "kvroute_kv_event_batches_total";
pub const KV_EVENT_BLOCKS: &str = "kvroute_kv_event_blocks_total";
pub const KV_EVENT_GAPS: &str = "kvroute_kv_event_gaps_total";
pub const KV_EVENT_REPLAYS: &str = "kvroute_kv_event_replays_total";
pub const KV_EVENT_RESETS: &str = "kvroute_kv_event_resets_total";
pub const KV_EVENT_STREAMS: &str = "kvroute_kv_event_streams";
pub const KV_EVENT_INDEX_ENTRIES: &str = "kvroute_kv_event_index_entries";
pub const TOKENIZE_DURATION: &str = "kvroute_tokenize_duration_seconds";
pub const LOCAL_TOKENS: &str = "kvroute_local_tokenizer_tokens_total";
pub const LOCAL_TOKENIZER_CHECKS: &str = "kvroute_local_tokenizer_checks_total";
pub const PREFIX_PREDICTED: &str = "kvroute_prefix_predicted_cached_tokens_total";
pub const POD_PREFIX_HITS: &str = "kvroute_pod_prefix_cache_hit_tokens_total";
pub const PREFIX_CHECKS: &str = "kvroute_prefix_checks_total";
pub const PREFIX_CHECKED_TOKENS: &str = "kvroute_prefix_checked_tokens_total";

/// The `source` values of [`PREFIX_PREDICTED`] (`picker::PrefixFrom::as_str`).
pub const PREFIX_SOURCES: [&str; 3] = ["sent", "kv_events", "kv_events+sent"];

/// The `result` values of [`KV_EVENT_BATCHES`].
pub const KV_BATCH_RESULTS: [&str; 5] = [
    "applied",
    "seen",
    "out_of_order",
    "undecodable",
    "malformed",
];
/// The `action` values of [`KV_EVENT_BLOCKS`].
pub const KV_BLOCK_ACTIONS: [&str; 5] = ["stored", "removed", "skipped", "unresolved", "malformed"];
/// The `outcome` values of [`KV_EVENT_REPLAYS`].
pub const KV_REPLAY_OUTCOMES: [&str; 3] = ["answered", "failed", "timeout"];

/// Distinct tenants that get their own label value in [`FLOW_TENANT_REQUESTS`]; later
/// ones count as `other`, so a client inventing ids cannot grow the exposition.
pub const MAX_TENANT_LABELS: usize = 64;

/// Request outcomes, the `outcome` label of [`REQUESTS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Routed,
    BadRequest,
    UnknownModel,
    TooLarge,
    NoCapacity,
    /// The gateway is configured in a way kvroute cannot route with.
    Misconfigured,
    /// A path outside the routed inference API.
    NotFound,
    /// No pod had room, and flow control refused to hold the request (longer): 429.
    Shed,
}

impl Outcome {
    pub const ALL: [Outcome; 8] = [
        Outcome::Routed,
        Outcome::BadRequest,
        Outcome::UnknownModel,
        Outcome::TooLarge,
        Outcome::NoCapacity,
        Outcome::Misconfigured,
        Outcome::NotFound,
        Outcome::Shed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Routed => "routed",
            Outcome::BadRequest => "bad_request",
            Outcome::UnknownModel => "unknown_model",
            Outcome::TooLarge => "too_large",
            Outcome::NoCapacity => "no_capacity",
            Outcome::Misconfigured => "misconfigured_gateway",
            Outcome::NotFound => "not_found",
            Outcome::Shed => "shed",
        }
    }
}

/// The `model` and `adapter` labels of one request, already bounded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelLabels {
    pub model: String,
    pub adapter: String,
}

impl ModelLabels {
    /// Labels for requests whose model is unknown or absent.
    pub fn other() -> Self {
        ModelLabels {
            model: "other".into(),
            adapter: String::new(),
        }
    }
}

/// Why kvroute's metrics recorder could not be installed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid histogram buckets: {0}")]
    Buckets(String),
    #[error("a different metrics recorder is already installed")]
    RecorderTaken,
}

static HANDLE: OnceLock<Result<PrometheusHandle, TelemetryError>> = OnceLock::new();

/// How often recorded histogram samples are folded into their buckets.
pub const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Folds the histogram samples recorded since the last pass into their buckets, and
/// expires idle series, every `every`. The exporter otherwise keeps each sample until the
/// next `/metrics` render: with no Prometheus scraping kvroute, memory grew with every
/// request (about 0.5 MiB a minute at 200 requests/s in the soak).
pub async fn run_upkeep(handle: PrometheusHandle, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        touch_standing_series();
        handle.run_upkeep();
    }
}

/// Installs the process-wide recorder once and returns its handle (later calls, e.g.
/// several servers in one test process, share it, with the first call's settings).
/// A series nobody updates for `idle_timeout` leaves the exposition: the series of a pod
/// that left the fleet, of a model or adapter no longer requested. Series that must stay
/// at zero are touched before every render ([`touch_standing_series`]).
pub fn install(idle_gauge_timeout: Duration) -> Result<PrometheusHandle, TelemetryError> {
    HANDLE
        .get_or_init(|| build_and_install(idle_gauge_timeout))
        .clone()
}

fn build_and_install(idle_gauge_timeout: Duration) -> Result<PrometheusHandle, TelemetryError> {
    let latency_buckets = [
        0.000_001, 0.000_002, 0.000_005, 0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_2, 0.000_5,
        0.001, 0.005, 0.01,
    ];
    let request_buckets = [
        0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
    ];
    let wait_buckets = [
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    let scrape_buckets = [
        0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    ];
    let recorder = PrometheusBuilder::new()
        // A pod's series are updated at every scrape (its counters at zero too); a pod
        // that left the fleet updates them no more, and they go after this long, so a
        // fleet whose pods come and go does not grow kvroute's exposition for ever.
        .idle_timeout(MetricKindMask::ALL, Some(idle_gauge_timeout))
        .set_buckets_for_metric(Matcher::Full(PICK_DURATION.into()), &latency_buckets)
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(REQUEST_DURATION.into()), &request_buckets)
        })
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(SCRAPE_DURATION.into()), &scrape_buckets)
        })
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(FLOW_QUEUE_WAIT.into()), &wait_buckets)
        })
        // A pod's /tokenize: a loopback round trip is a fraction of a millisecond, a long
        // chat rendered in Python tens of them; kvroute's own tokenizer a few per 10k tokens.
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(TOKENIZE_DURATION.into()), &scrape_buckets)
        })
        .map_err(|e| TelemetryError::Buckets(e.to_string()))?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|_| TelemetryError::RecorderTaken)?;
    describe();
    register_counters();
    Ok(handle)
}

fn describe() {
    describe_counter!(
        REQUESTS,
        "Requests seen by the endpoint picker, by model, adapter and outcome."
    );
    describe_histogram!(
        PICK_DURATION,
        Unit::Seconds,
        "Time spent choosing an endpoint for one request."
    );
    describe_counter!(
        DECISIONS,
        "Routing decisions by the reason the chosen pod won."
    );
    describe_histogram!(
        REQUEST_DURATION,
        Unit::Seconds,
        "Time from the routing decision to the end of the upstream response, by outcome."
    );
    describe_counter!(
        COMPLETION_TOKENS,
        "Completion tokens reported in response usage, by model."
    );
    describe_gauge!(POD_KV_USAGE, "KV-cache use (0-1) each pod last reported.");
    describe_gauge!(
        POD_KV_CAPACITY,
        "KV-cache capacity in tokens each pod last reported."
    );
    describe_gauge!(
        POD_WAITING,
        "Requests waiting in each pod's queue, as last scraped."
    );
    describe_gauge!(
        POD_RUNNING,
        "Requests running on each pod, as last scraped."
    );
    describe_gauge!(
        POD_RUNNING_ADAPTERS,
        "Distinct LoRA adapters in each pod's running batch."
    );
    describe_gauge!(
        POD_INFLIGHT,
        "Requests kvroute sent to each pod that have not finished."
    );
    describe_gauge!(
        POD_HEALTHY,
        "1 while the pod is in rotation, 0 while taken out."
    );
    describe_counter!(SCRAPES, "Scrapes of pod /metrics attempted.");
    describe_counter!(
        SCRAPE_ERRORS,
        "Failed scrapes of pod /metrics, by kind of failure."
    );
    describe_histogram!(
        SCRAPE_DURATION,
        Unit::Seconds,
        "Duration of one /metrics scrape."
    );
    describe_gauge!(
        SNAPSHOT_AGE,
        Unit::Seconds,
        "Age of the oldest healthy pod's metrics in the current snapshot."
    );
    describe_gauge!(ENDPOINTS, "Endpoints known to kvroute, by health.");
    describe_gauge!(
        EXTPROC_STREAMS,
        "ext_proc streams open now (one per request between the gateway and its response's end)."
    );
    describe_counter!(
        UPSTREAM_UNREACHABLE,
        "Requests the gateway could not connect to their pod for; the pod leaves rotation at once."
    );
    describe_counter!(
        CONNECTIONS_REFUSED,
        "Connections closed on arrival because their listener held --max-connections already."
    );
    describe_counter!(
        SILENT_STREAMS_REFUSED,
        "ext_proc streams refused (RESOURCE_EXHAUSTED) on arrival because --max-silent-streams streams had sent nothing yet."
    );
    describe_gauge!(
        MEMORY_ALLOCATED,
        Unit::Bytes,
        "Heap bytes kvroute holds, as its allocator counts them."
    );
    describe_gauge!(
        MEMORY_RESIDENT,
        Unit::Bytes,
        "Physical memory kvroute's allocator maps: held, its metadata, freed pages not yet returned."
    );
    describe_gauge!(
        PREFIX_INDEX_ENTRIES,
        "(pod, prompt block) pairs kvroute remembers for prefix-cache affinity."
    );
    describe_gauge!(
        FLOW_QUEUE,
        "Requests waiting at the gateway for a pod with room, by priority."
    );
    describe_histogram!(
        FLOW_QUEUE_WAIT,
        Unit::Seconds,
        "Time requests waited at the gateway for room, by priority and how the wait ended (routed, dropped, left)."
    );
    describe_counter!(
        FLOW_DROPPED,
        "Requests flow control refused or dropped, by reason (the x-llm-d-request-dropped-reason value)."
    );
    describe_counter!(
        FLOW_TENANT_REQUESTS,
        "Requests admitted (routed or queued) and shed, by tenant (fairness id; after 64 distinct ids, other)."
    );
    describe_counter!(
        KV_EVENT_BATCHES,
        "KV event batches received from the pods' publishers, by result (applied; seen: already applied, a replay overlapping the live stream; out_of_order; undecodable; malformed frames)."
    );
    describe_counter!(
        KV_EVENT_BLOCKS,
        "Blocks in applied KV events, by action (stored, removed: in or out of the index; skipped: another medium or cache group, extra hash keys, an adapter named only by id; unresolved: parent never seen; malformed: token count against block count)."
    );
    describe_counter!(
        KV_EVENT_GAPS,
        "Gaps in a pod's KV event sequence numbers (each answered by a replay request)."
    );
    describe_counter!(
        KV_EVENT_REPLAYS,
        "Replay requests to the pods' replay sockets, by outcome (answered, failed, timeout)."
    );
    describe_counter!(
        KV_EVENT_RESETS,
        "Times a pod's entries in the event index were dropped: a gap no replay filled, or its publisher restarted."
    );
    describe_gauge!(
        KV_EVENT_STREAMS,
        "Pods whose KV event stream is connected and in sequence."
    );
    describe_histogram!(
        TOKENIZE_DURATION,
        Unit::Seconds,
        "Time to tokenize a prompt before matching it on the KV event index, by tokenizer (pod: its /tokenize; local: kvroute's own, --tokenizer) and outcome (pod: ok, http, timeout, status, answer; local: ok, or why the pod was asked instead: left_to_pod, no_chat_template, render, encode, not_one_text)."
    );
    describe_counter!(
        LOCAL_TOKENS,
        "Tokens kvroute's own tokenizer produced, by source: remembered (copied from a long piece of text it had encoded before, such as a shared system prompt) or encoded."
    );
    describe_counter!(
        LOCAL_TOKENIZER_CHECKS,
        "Prompts kvroute's own tokenizer made that were also sent to a pod's /tokenize to check them (--tokenizer-check-every), by result: agree, differ (local tokenization of that model stops), failed (the pod did not answer)."
    );
    describe_counter!(
        PREFIX_PREDICTED,
        "Prompt tokens kvroute expected the chosen pod to find in its prefix cache, by where the prediction came from (sent, kv_events, kv_events+sent): against the pods' own kvroute_pod_prefix_cache_hit_tokens_total, it shows when the prefix index drifts from the engines."
    );
    describe_counter!(
        POD_PREFIX_HITS,
        "Prompt tokens each pod served from its prefix cache (vLLM's prefix_cache_hits counter, as last scraped)."
    );
    describe_counter!(
        PREFIX_CHECKS,
        "Routed requests whose response kvroute saw, by the prediction's source and how the pod's own usage.prompt_tokens_details.cached_tokens compared with it: as_predicted (within a block), fewer, more, other_pod (a retry went elsewhere), unreported (no usage in the response)."
    );
    describe_counter!(
        PREFIX_CHECKED_TOKENS,
        "Over the requests checked against their response (kvroute_prefix_checks_total, outcomes as_predicted, fewer and more): the cached prompt tokens kvroute predicted and those the pod served (kind)."
    );
    describe_gauge!(
        KV_EVENT_INDEX_ENTRIES,
        "(pod, block) pairs in the index built from the pods' KV events."
    );
    describe_gauge!(
        PREFIX_INDEX_CAPACITY,
        "The most (pod, prompt block) pairs the prefix index keeps (--prefix-index-mib); at it, each pod keeps an equal share of its most recent blocks."
    );
}

/// Counters that exist from the start and stay, at 0 until their first event.
static STANDING: OnceLock<Vec<Counter>> = OnceLock::new();

/// The counters dashboards rate exist from the start, at 0: a rate over no series shows
/// "no data" rather than 0 on a fleet where nothing went wrong yet.
fn register_counters() {
    let other = ModelLabels::other();
    let mut standing: Vec<Counter> = Outcome::ALL
        .iter()
        .map(|outcome| {
            counter!(REQUESTS, "model" => other.model.clone(), "adapter" => other.adapter.clone(), "outcome" => outcome.as_str())
        })
        .collect();
    standing.push(
        counter!(COMPLETION_TOKENS, "model" => other.model.clone(), "adapter" => other.adapter),
    );
    standing.extend(Reason::all().map(|reason| counter!(DECISIONS, "reason" => reason.as_str())));
    standing.extend(
        DropReason::ALL
            .iter()
            .map(|reason| counter!(FLOW_DROPPED, "reason" => reason.as_str())),
    );
    standing.extend(["admitted", "shed"].map(
        |outcome| counter!(FLOW_TENANT_REQUESTS, "tenant" => DEFAULT_TENANT, "outcome" => outcome),
    ));
    standing.extend(
        KV_BATCH_RESULTS
            .iter()
            .map(|&result| counter!(KV_EVENT_BATCHES, "result" => result)),
    );
    standing.extend(
        KV_BLOCK_ACTIONS
            .iter()
            .map(|&action| counter!(KV_EVENT_BLOCKS, "action" => action)),
    );
    standing.extend(
        KV_REPLAY_OUTCOMES
            .iter()
            .map(|&outcome| counter!(KV_EVENT_REPLAYS, "outcome" => outcome)),
    );
    standing.extend(
        PREFIX_SOURCES
            .iter()
            .map(|&source| counter!(PREFIX_PREDICTED, "source" => source)),
    );
    for source in PREFIX_SOURCES {
        standing.extend(crate::extproc::observe::CheckOutcome::ALL.map(
            |outcome| counter!(PREFIX_CHECKS, "source" => source, "outcome" => outcome.as_str()),
        ));
        standing.extend(
            ["predicted", "served"]
                .map(|kind| counter!(PREFIX_CHECKED_TOKENS, "source" => source, "kind" => kind)),
        );
    }
    standing.push(counter!(KV_EVENT_GAPS));
    standing.push(counter!(KV_EVENT_RESETS));
    standing
        .extend(["remembered", "encoded"].map(|source| counter!(LOCAL_TOKENS, "source" => source)));
    // A `differ` that appears from nothing is what an alert on a wrong --tokenizer waits for.
    standing.extend(
        ["agree", "differ", "failed"]
            .map(|result| counter!(LOCAL_TOKENIZER_CHECKS, "result" => result)),
    );
    let _ = STANDING.set(standing);
    // The default band's queue length, at 0 until something waits.
    let _ = STANDING_GAUGES.set(vec![gauge!(FLOW_QUEUE, "priority" => "0")]);
    touch_standing_series();
}

/// Gauges that exist from the start and stay.
static STANDING_GAUGES: OnceLock<Vec<Gauge>> = OnceLock::new();

/// Marks the standing series as current, so that the idle timeout never takes them.
pub fn touch_standing_series() {
    for counter in STANDING.get().into_iter().flatten() {
        counter.increment(0);
    }
    for gauge in STANDING_GAUGES.get().into_iter().flatten() {
        gauge.increment(0.0);
    }
}

/// The series one pod's poller updates at every scrape, resolved once. Updating a held
/// handle skips the registry's lookup (a label string built, hashed and compared per
/// series): at 1,000 pods polled every 50 ms that lookup was a tenth of the scraper's CPU.
///
/// The exporter drops a series nobody updated for `--idle-gauge-timeout`, and a handle
/// held across that would keep updating a series that is no longer exported. Every scrape
/// updates the counters (at zero too), the scrape histogram and the health and in-flight
/// gauges, so they never go idle while the pod is polled; the load gauges are set only by
/// successful scrapes, so they are resolved again on the first success after a failure.
pub struct PodSeries {
    pod: String,
    unreachable: Counter,
    scrapes: Counter,
    scrape_duration: Histogram,
    /// By kind, as [`PodSeries::new`] was given them.
    errors: Vec<(&'static str, Counter)>,
    healthy: Gauge,
    inflight: Gauge,
    load: Option<LoadGauges>,
}

struct LoadGauges {
    /// The pod's own prefix cache hits (a counter kvroute mirrors).
    prefix_hits: Counter,
    kv_usage: Gauge,
    kv_capacity: Gauge,
    waiting: Gauge,
    running: Gauge,
    running_adapters: Gauge,
}

impl PodSeries {
    /// The pod's series, its counters registered at 0 as it joins: every kind of scrape
    /// error is a series from the start.
    pub fn new(endpoint: SocketAddr, error_kinds: &[&'static str]) -> Self {
        let pod = pod_label(endpoint);
        let unreachable = counter!(UPSTREAM_UNREACHABLE, "pod" => pod.clone());
        unreachable.increment(0);
        let scrapes = counter!(SCRAPES, "pod" => pod.clone());
        scrapes.increment(0);
        let errors = error_kinds
            .iter()
            .map(|&kind| {
                let counter = counter!(SCRAPE_ERRORS, "pod" => pod.clone(), "kind" => kind);
                counter.increment(0);
                (kind, counter)
            })
            .collect();
        PodSeries {
            scrape_duration: histogram!(SCRAPE_DURATION, "pod" => pod.clone()),
            healthy: gauge!(POD_HEALTHY, "pod" => pod.clone()),
            inflight: gauge!(POD_INFLIGHT, "pod" => pod.clone()),
            unreachable,
            scrapes,
            errors,
            load: None,
            pod,
        }
    }

    /// One `/metrics` scrape: its duration, its error kind if it failed, the pod's health
    /// after it and the requests kvroute has in flight there.
    pub fn record_scrape(
        &self,
        duration: Duration,
        error_kind: Option<&'static str>,
        healthy: bool,
        inflight: u32,
    ) {
        self.scrapes.increment(1);
        self.scrape_duration.record(duration.as_secs_f64());
        if let Some(kind) = error_kind {
            self.record_error(kind);
        }
        // The pod's counters at zero stay while it is polled: touched, they never idle.
        for (_, counter) in &self.errors {
            counter.increment(0);
        }
        self.unreachable.increment(0);
        self.healthy.set(if healthy { 1.0 } else { 0.0 });
        self.inflight.set(f64::from(inflight));
    }

    /// A failed scrape of kind `kind` (one of those given to [`PodSeries::new`]; another
    /// is looked up in the registry).
    pub fn record_error(&self, kind: &'static str) {
        match self.errors.iter().find(|(k, _)| *k == kind) {
            Some((_, counter)) => counter.increment(1),
            None => {
                counter!(SCRAPE_ERRORS, "pod" => self.pod.clone(), "kind" => kind).increment(1);
            }
        }
    }

    /// What a successful scrape read.
    pub fn record_metrics(&mut self, metrics: &PodMetrics) {
        let pod = &self.pod;
        let load = self.load.get_or_insert_with(|| LoadGauges {
            prefix_hits: counter!(POD_PREFIX_HITS, "pod" => pod.clone()),
            kv_usage: gauge!(POD_KV_USAGE, "pod" => pod.clone()),
            kv_capacity: gauge!(POD_KV_CAPACITY, "pod" => pod.clone()),
            waiting: gauge!(POD_WAITING, "pod" => pod.clone()),
            running: gauge!(POD_RUNNING, "pod" => pod.clone()),
            running_adapters: gauge!(POD_RUNNING_ADAPTERS, "pod" => pod.clone()),
        });
        load.kv_usage.set(metrics.kv_usage);
        if let Some(hits) = metrics.prefix_cache_hits_total {
            load.prefix_hits.absolute(hits.max(0.0) as u64);
        }
        if let Some(capacity) = metrics.kv_capacity_tokens {
            load.kv_capacity.set(capacity as f64);
        }
        load.waiting.set(f64::from(metrics.waiting));
        load.running.set(f64::from(metrics.running));
        let adapters = metrics.lora.as_ref().map_or(0, |lora| lora.running.len());
        load.running_adapters.set(adapters as f64);
    }

    /// A scrape failed: the load gauges may go idle and be dropped by the exporter before
    /// the next success, which then resolves them again.
    pub fn metrics_missed(&mut self) {
        self.load = None;
    }
}

fn pod_label(endpoint: SocketAddr) -> String {
    endpoint.to_string()
}

pub fn record_request(labels: &ModelLabels, outcome: Outcome) {
    counter!(REQUESTS, "model" => labels.model.clone(), "adapter" => labels.adapter.clone(), "outcome" => outcome.as_str())
        .increment(1);
}

pub fn record_pick(duration: Duration, reason: &'static str) {
    histogram!(PICK_DURATION).record(duration.as_secs_f64());
    counter!(DECISIONS, "reason" => reason).increment(1);
}

pub fn record_request_done(
    labels: &ModelLabels,
    status: Option<u16>,
    duration: Duration,
    completion_tokens: Option<u64>,
) {
    let class = match status {
        Some(200..=299) => "2xx",
        Some(400..=499) => "4xx",
        Some(500..=599) => "5xx",
        Some(_) => "other",
        None => "unknown",
    };
    histogram!(REQUEST_DURATION, "status" => class).record(duration.as_secs_f64());
    if let Some(tokens) = completion_tokens {
        counter!(COMPLETION_TOKENS, "model" => labels.model.clone(), "adapter" => labels.adapter.clone())
            .increment(tokens);
    }
}

/// What the allocator reports: bytes the program holds, and bytes of physical memory the
/// allocator maps (held, its own metadata, and freed pages not yet returned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorStats {
    pub allocated: u64,
    pub resident: u64,
}

static ALLOCATOR_STATS: std::sync::OnceLock<fn() -> Option<AllocatorStats>> =
    std::sync::OnceLock::new();

/// Registers how to read the allocator's statistics (the binary owns the allocator); the
/// gauges are refreshed at every `/metrics` render. A growing resident set with a flat
/// allocated one is fragmentation; both growing is a structure that keeps growing.
pub fn register_allocator_stats(read: fn() -> Option<AllocatorStats>) {
    let _ = ALLOCATOR_STATS.set(read);
}

/// jemalloc's counters, refreshed (its `epoch` advanced) at each read. Meaningful only in
/// a program whose global allocator is jemalloc (the `kvroute` binary).
pub fn jemalloc_stats() -> Option<AllocatorStats> {
    use tikv_jemalloc_ctl::{epoch, stats};
    epoch::advance().ok()?;
    Some(AllocatorStats {
        allocated: u64::try_from(stats::allocated::read().ok()?).ok()?,
        resident: u64::try_from(stats::resident::read().ok()?).ok()?,
    })
}

/// Sets the prefix index's gauges (read when `/metrics` is scraped).
pub fn record_prefix_index(entries: usize, capacity: usize) {
    gauge!(PREFIX_INDEX_ENTRIES).set(entries as f64);
    gauge!(PREFIX_INDEX_CAPACITY).set(capacity as f64);
}

/// Sets the event index's gauge (read when `/metrics` is scraped).
pub fn record_kv_event_index(entries: usize) {
    gauge!(KV_EVENT_INDEX_ENTRIES).set(entries as f64);
}

/// One KV event batch received; `result` is one of [`KV_BATCH_RESULTS`].
pub fn record_kv_batch(result: &'static str) {
    counter!(KV_EVENT_BATCHES, "result" => result).increment(1);
}

/// The blocks of one applied batch, by what happened to them.
pub fn record_kv_blocks(applied: &kvroute_core::kvevents::Applied) {
    for (action, n) in [
        ("stored", applied.stored),
        ("removed", applied.removed),
        ("skipped", applied.skipped),
        ("unresolved", applied.unresolved),
        ("malformed", applied.malformed),
    ] {
        if n > 0 {
            counter!(KV_EVENT_BLOCKS, "action" => action).increment(n);
        }
    }
}

/// A routed request the chosen pod was expected to hold `tokens` of in its prefix cache,
/// by the index `source` says.
pub fn record_predicted_cached(source: &'static str, tokens: u64) {
    counter!(PREFIX_PREDICTED, "source" => source).increment(tokens);
}

/// A request's predicted cached tokens checked against its response (`served`: what the
/// pod reported, when it did and it was the pod predicted for).
pub fn record_prefix_check(
    source: &'static str,
    outcome: crate::extproc::observe::CheckOutcome,
    predicted: u64,
    served: Option<u64>,
) {
    counter!(PREFIX_CHECKS, "source" => source, "outcome" => outcome.as_str()).increment(1);
    if let Some(served) = served {
        counter!(PREFIX_CHECKED_TOKENS, "source" => source, "kind" => "predicted")
            .increment(predicted);
        counter!(PREFIX_CHECKED_TOKENS, "source" => source, "kind" => "served").increment(served);
    }
}

/// One prompt tokenized on a pod (`failure`: why not, if it failed).
pub fn record_tokenize(duration: Duration, failure: Option<&'static str>) {
    histogram!(TOKENIZE_DURATION, "outcome" => failure.unwrap_or("ok"), "tokenizer" => "pod")
        .record(duration.as_secs_f64());
}

/// One prompt tokenized by kvroute's own tokenizer (`unsupported`: why it was not, the
/// pod being asked instead).
pub fn record_local_tokenize(duration: Duration, unsupported: Option<&'static str>) {
    histogram!(TOKENIZE_DURATION, "outcome" => unsupported.unwrap_or("ok"), "tokenizer" => "local")
        .record(duration.as_secs_f64());
}

/// The tokens of one prompt kvroute's own tokenizer made: `remembered` copied from
/// pieces it had encoded before, `encoded` encoded now.
pub fn record_local_tokens(remembered: usize, encoded: usize) {
    counter!(LOCAL_TOKENS, "source" => "remembered").increment(remembered as u64);
    counter!(LOCAL_TOKENS, "source" => "encoded").increment(encoded as u64);
}

/// One check of kvroute's own tokens against a pod's: `agree`, `differ` or `failed`.
pub fn record_local_tokenizer_check(result: &'static str) {
    counter!(LOCAL_TOKENIZER_CHECKS, "result" => result).increment(1);
}

/// A gap in a pod's sequence numbers.
pub fn record_kv_gap() {
    counter!(KV_EVENT_GAPS).increment(1);
}

/// One replay request; `outcome` is one of [`KV_REPLAY_OUTCOMES`].
pub fn record_kv_replay(outcome: &'static str) {
    counter!(KV_EVENT_REPLAYS, "outcome" => outcome).increment(1);
}

/// A pod's entries dropped from the event index (`blocks` of them).
pub fn record_kv_reset(blocks: u64) {
    counter!(KV_EVENT_RESETS).increment(1);
    counter!(KV_EVENT_BLOCKS, "action" => "removed").increment(blocks);
}

/// How many pods' event streams are connected and in sequence.
pub fn set_kv_event_streams(streams: usize) {
    gauge!(KV_EVENT_STREAMS).set(streams as f64);
}

/// Sets the allocator gauges, if a reader is registered.
pub fn record_allocator_stats() {
    if let Some(stats) = ALLOCATOR_STATS.get().and_then(|read| read()) {
        gauge!(MEMORY_ALLOCATED).set(stats.allocated as f64);
        gauge!(MEMORY_RESIDENT).set(stats.resident as f64);
    }
}

/// One open ext_proc stream, counted in [`EXTPROC_STREAMS`] until dropped.
pub struct OpenStream(());

impl OpenStream {
    pub fn open() -> OpenStream {
        gauge!(EXTPROC_STREAMS).increment(1.0);
        OpenStream(())
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        gauge!(EXTPROC_STREAMS).decrement(1.0);
    }
}

/// Exposes `listener`'s refusal count from the start, at zero, so a rate over it exists
/// before the first refusal.
pub fn register_connection_refusals(listener: &'static str) {
    counter!(CONNECTIONS_REFUSED, "listener" => listener).increment(0);
}

/// Exports the silent-stream refusal counter at 0 before the first refusal.
pub fn register_silent_stream_refusals() {
    counter!(SILENT_STREAMS_REFUSED).increment(0);
}

/// An ext_proc stream was refused on arrival: too many streams had sent nothing yet.
pub fn record_silent_stream_refused() {
    counter!(SILENT_STREAMS_REFUSED).increment(1);
}

/// A connection to `listener` was closed on arrival: the listener was full.
pub fn record_connection_refused(listener: &'static str) {
    counter!(CONNECTIONS_REFUSED, "listener" => listener).increment(1);
}

/// The gateway reported a connect failure to `endpoint` (passive health).
pub fn record_unreachable(endpoint: SocketAddr) {
    counter!(UPSTREAM_UNREACHABLE, "pod" => pod_label(endpoint)).increment(1);
}

pub fn record_fleet(healthy: usize, unhealthy: usize, oldest_metrics: Option<Duration>) {
    gauge!(ENDPOINTS, "health" => "healthy").set(healthy as f64);
    gauge!(ENDPOINTS, "health" => "unhealthy").set(unhealthy as f64);
    gauge!(SNAPSHOT_AGE).set(oldest_metrics.map_or(0.0, |age| age.as_secs_f64()));
}

/// How a request's wait at the gateway ended, the `outcome` label of [`FLOW_QUEUE_WAIT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueExit {
    Routed,
    Dropped,
    /// The client went away.
    Left,
}

impl QueueExit {
    fn as_str(self) -> &'static str {
        match self {
            QueueExit::Routed => "routed",
            QueueExit::Dropped => "dropped",
            QueueExit::Left => "left",
        }
    }
}

/// Priorities that had requests waiting at the last update: their gauge is set to 0 when
/// their band empties, rather than left at its last length.
static QUEUED_BANDS: std::sync::Mutex<Vec<Priority>> = std::sync::Mutex::new(Vec::new());

/// Sets the queue gauges from the lengths of the bands now waiting.
pub fn record_queue_lengths(bands: impl Iterator<Item = (Priority, usize)>) {
    let mut previous = QUEUED_BANDS.lock().unwrap_or_else(|p| p.into_inner());
    let now: Vec<(Priority, usize)> = bands.collect();
    for priority in previous.iter() {
        if !now.iter().any(|(p, _)| p == priority) {
            gauge!(FLOW_QUEUE, "priority" => priority.to_string()).set(0.0);
        }
    }
    for (priority, length) in &now {
        gauge!(FLOW_QUEUE, "priority" => priority.to_string()).set(*length as f64);
    }
    *previous = now.into_iter().map(|(p, _)| p).collect();
}

/// One request's wait at the gateway, ended as `exit`.
pub fn record_queue_wait(priority: Priority, exit: QueueExit, waited: Duration) {
    histogram!(FLOW_QUEUE_WAIT, "priority" => priority.to_string(), "outcome" => exit.as_str())
        .record(waited.as_secs_f64());
}

/// A request flow control refused or dropped.
pub fn record_dropped(reason: DropReason) {
    counter!(FLOW_DROPPED, "reason" => reason.as_str()).increment(1);
}

/// Tenants with a label of their own so far.
static TENANT_LABELS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// A request of `tenant` admitted (routed or queued) or shed.
pub fn record_tenant(tenant: &str, admitted: bool) {
    let label = {
        let mut known = TENANT_LABELS.lock().unwrap_or_else(|p| p.into_inner());
        if known.iter().any(|t| t == tenant) {
            tenant.to_owned()
        } else if known.len() < MAX_TENANT_LABELS {
            known.push(tenant.to_owned());
            tenant.to_owned()
        } else {
            "other".to_owned()
        }
    };
    let outcome = if admitted { "admitted" } else { "shed" };
    counter!(FLOW_TENANT_REQUESTS, "tenant" => label, "outcome" => outcome).increment(1);
}
