//! The live router: runs the pure scheduler over the current snapshot, reserves the
//! chosen pod's in-flight accounting, and records what happened (metrics, debug log,
//! the live decision tap that the admin API's watchers subscribe to).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvroute_core::fleet::{
    Fleet, ModelClass, PrefillEnd, PrefixIndex, Reservation, Snapshot, adapter_key, block_hashes,
};
use kvroute_core::request::RouteRequest;
use kvroute_core::scheduler::{self, Decision, PickError, SchedulerConfig};
use serde::Serialize;
use tokio::sync::broadcast;
use tracing::{debug, warn};

use crate::extproc::messages::ErrorReply;
use crate::extproc::{InFlight, ResponseSummary, Routed, Router, Unrouted, UnroutedKind};
use crate::store::PodStore;
use crate::telemetry::{self, ModelLabels, Outcome};

/// The router kvroute serves with.
pub struct LivePicker {
    store: Arc<PodStore>,
    config: SchedulerConfig,
    /// Serialises pick + reserve, so two concurrent requests cannot both see the same
    /// free KV and herd onto one pod. A pick takes microseconds.
    placement: Mutex<()>,
    /// The prompt blocks sent to each pod, for prefix-cache affinity. Concurrent: matched
    /// and recorded outside the placement lock.
    prefix: PrefixIndex,
    decisions: DecisionLog,
    /// Each decision, for live watchers; built only while someone is subscribed.
    tap: broadcast::Sender<Arc<DecisionRecord>>,
}

/// Decisions a watcher may fall behind by before it starts missing some.
const TAP_CAPACITY: usize = 4096;

impl LivePicker {
    pub fn new(
        store: Arc<PodStore>,
        config: SchedulerConfig,
        keep_decisions: usize,
        prefix_budget_bytes: usize,
    ) -> Self {
        LivePicker {
            store,
            config,
            placement: Mutex::new(()),
            prefix: PrefixIndex::with_budget(prefix_budget_bytes),
            decisions: DecisionLog::new(keep_decisions),
            tap: broadcast::channel(TAP_CAPACITY).0,
        }
    }

    /// Every decision from now on. A receiver that falls more than a few thousand
    /// decisions behind gets `RecvError::Lagged` with the count it missed; routing
    /// never waits for it.
    pub fn watch(&self) -> broadcast::Receiver<Arc<DecisionRecord>> {
        self.tap.subscribe()
    }

    /// Records a decision for the debug log and the watchers; costs one uncontended
    /// lock (`receiver_count`) when neither wants it: nothing is built or cloned.
    fn record(&self, request: &RouteRequest<'_>, outcome: Result<&Decision, &PickError>) {
        self.publish(|| DecisionRecord::new(request, outcome));
    }

    /// Records a request refused before routing, as a decision with its error.
    fn record_refusal(&self, path: &str, reply: &ErrorReply) {
        self.publish(|| {
            // The path is the client's own input: a bounded, printable part of it.
            let shown: String = path
                .chars()
                .take(100)
                .map(|c| if c.is_control() { '?' } else { c })
                .collect();
            DecisionRecord {
                unix_ms: unix_ms(),
                model: None,
                prompt_tokens: 0,
                max_output_tokens: None,
                decision: None,
                error: Some(format!(
                    "refused {} {} on {shown}: {}",
                    reply.status, reply.code, reply.message
                )),
            }
        });
    }

    /// Hands a record to the watchers and the debug log; builds it only if one wants it.
    fn publish(&self, build: impl FnOnce() -> DecisionRecord) {
        let watched = self.tap.receiver_count() > 0;
        if !watched && !self.decisions.enabled() {
            return;
        }
        let record = Arc::new(build());
        if watched {
            // Fails only when the last watcher left in between: nothing to do.
            let _ = self.tap.send(Arc::clone(&record));
        }
        self.decisions.push(record);
    }

    /// (pod, block) pairs the prefix index remembers, and the most it may.
    pub fn prefix_index_size(&self) -> (usize, usize) {
        (self.prefix.entries(), self.prefix.max_entries())
    }

    /// The recent decisions kept for `/debug/decisions` (empty when switched off).
    pub fn decisions(&self) -> &DecisionLog {
        &self.decisions
    }

    /// Picks under the placement lock and reserves the winner's capacity, so the next
    /// pick sees this request. `blocks` are the prompt's prefix-block hashes.
    fn place(
        &self,
        request: &RouteRequest<'_>,
        blocks: &[u64],
        fleet: &Fleet,
        first_token_visible: bool,
    ) -> Result<(Decision, Option<Reservation>), PickError> {
        // Matching reads the index's own shards: concurrent requests match in parallel.
        let matches = self.prefix.matches(blocks, fleet.snapshot());
        let placement = self.placement.lock().unwrap_or_else(|p| p.into_inner());
        let decision = scheduler::pick(
            request,
            Some(&matches),
            fleet,
            &self.config,
            &mut rand::rng(),
        )?;
        let mut capacity = 0;
        let reservation = fleet.pod(decision.endpoint).map(|(pod, load)| {
            capacity = pod.signals().map_or(0, |s| s.kv_capacity_tokens);
            // An adapter request (it has a LoRA tier): the pod now holds the adapter.
            let tier = decision.ranked.first().and_then(|c| c.lora_tier);
            if let (Some(model), Some(_)) = (request.model(), tier) {
                load.note_adapter(adapter_key(model));
            }
            // A non-streaming answer arrives whole, and a gateway that keeps response
            // bodies from kvroute shows no first token: either way the prefill ends
            // when the pod's own report can include the request.
            let streaming = request.inference.is_some_and(|r| r.stream);
            let prefill_end = if streaming && first_token_visible {
                PrefillEnd::FirstToken
            } else {
                PrefillEnd::NextScrape
            };
            // Cached prompt blocks are neither recomputed nor allocated again.
            let winner = decision.ranked.first();
            let cached = winner.map_or(0, |c| c.cached_tokens);
            let prompt = u64::from(request.prompt_tokens()).saturating_sub(cached);
            let tokens = winner.map_or(decision.tokens_needed, |c| {
                c.kv_tokens_needed(decision.tokens_needed)
            });
            load.reserve(tokens, prompt, prefill_end)
        });
        drop(placement);
        self.prefix.record(decision.endpoint, blocks, capacity);
        Ok((decision, reservation))
    }
}

impl Router for LivePicker {
    type Ticket = InFlightRequest;

    fn refused(&self, path: &str, reply: &ErrorReply) {
        self.record_refusal(path, reply);
    }

    fn route(
        &self,
        request: &RouteRequest<'_>,
        first_token_visible: bool,
    ) -> Result<Routed<InFlightRequest>, Unrouted> {
        let fleet = self.store.fleet();
        let labels = model_labels(request.model(), fleet.snapshot(), &self.config);
        // Hashing is the costly part of prefix matching, so it happens before the lock.
        let blocks = request.inference.map_or_else(Vec::new, |r| {
            block_hashes(&r.model, r.prefix_context, &r.prompt_prefix)
        });
        let started = Instant::now();
        let placed = self.place(request, &blocks, &fleet, first_token_visible);
        let elapsed = started.elapsed();
        match placed {
            Ok((decision, reservation)) => {
                telemetry::record_pick(elapsed, decision.reason.as_str());
                telemetry::record_request(&labels, Outcome::Routed);
                debug!(
                    endpoint = %decision.endpoint,
                    reason = decision.reason.as_str(),
                    candidates = decision.candidates,
                    tokens = decision.tokens_needed,
                    "routed"
                );
                self.record(request, Ok(&decision));
                let endpoints = std::iter::once(decision.endpoint)
                    .chain(decision.fallbacks)
                    .collect();
                Ok(Routed {
                    endpoints,
                    ticket: InFlightRequest {
                        endpoint: decision.endpoint,
                        reservation,
                        store: Arc::clone(&self.store),
                        labels,
                        routed_at: Instant::now(),
                    },
                })
            }
            Err(error) => {
                debug!(%error, "not routed");
                self.record(request, Err(&error));
                let (kind, outcome) = match error {
                    PickError::UnknownModel(_) => {
                        (UnroutedKind::UnknownModel, Outcome::UnknownModel)
                    }
                    PickError::NoEndpoints
                    | PickError::NoneInSubset
                    | PickError::ModelsNotListed { .. }
                    | PickError::NoReadyEndpoint => {
                        (UnroutedKind::Unavailable, Outcome::NoCapacity)
                    }
                };
                telemetry::record_request(&labels, outcome);
                Err(Unrouted {
                    kind,
                    message: error.to_string(),
                })
            }
        }
    }
}

/// A request the picker routed, until its response ends: holds the pod's in-flight
/// reservation and records the request's outcome when it finishes.
#[derive(Debug)]
pub struct InFlightRequest {
    /// The pod the request went to: the pick, or where the gateway says it was served.
    endpoint: SocketAddr,
    reservation: Option<Reservation>,
    /// Where the pods' counters live, should the request move to another pod.
    store: Arc<PodStore>,
    labels: ModelLabels,
    routed_at: Instant,
}

impl InFlight for InFlightRequest {
    fn first_token(&mut self) {
        if let Some(reservation) = self.reservation.as_mut() {
            reservation.first_token();
        }
    }

    fn streamed(&mut self, events: u64) {
        if let Some(reservation) = self.reservation.as_mut() {
            reservation.streamed(events);
        }
    }

    fn served_by(&mut self, endpoint: std::net::SocketAddr) {
        // A pod kvroute does not know (it left the fleet meanwhile) keeps nothing.
        self.endpoint = endpoint;
        if let (Some(reservation), Some(load)) =
            (self.reservation.take(), self.store.load(endpoint))
        {
            self.reservation = Some(reservation.move_to(&load));
        }
    }

    fn unreachable(&mut self) {
        telemetry::record_unreachable(self.endpoint);
        if self.store.record_unreachable(self.endpoint) {
            warn!(endpoint = %self.endpoint, "the gateway cannot connect to this pod: out of rotation until it scrapes well again");
        }
    }

    fn finish(self, response: ResponseSummary) {
        telemetry::record_request_done(
            &self.labels,
            response.status,
            self.routed_at.elapsed(),
            response.completion_tokens,
        );
        // Dropping `self.reservation` releases the pod's in-flight accounting.
    }
}

/// Bounded telemetry labels: a model only when the fleet (or the config) knows it.
fn model_labels(model: Option<&str>, snapshot: &Snapshot, config: &SchedulerConfig) -> ModelLabels {
    let Some(model) = model else {
        return ModelLabels {
            model: "none".into(),
            adapter: String::new(),
        };
    };
    let adapter_of = |base: &str| ModelLabels {
        model: base.to_owned(),
        adapter: model.to_owned(),
    };
    if let Some(base) = config.adapters.get(model) {
        return adapter_of(base);
    }
    match snapshot.models.class(model) {
        Some(ModelClass::Base) => ModelLabels {
            model: model.to_owned(),
            adapter: String::new(),
        },
        Some(ModelClass::Adapter { base }) => adapter_of(base),
        Some(ModelClass::UnlistedAdapter) | None => ModelLabels::other(),
    }
}

/// One entry of the decision log.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    pub unix_ms: u128,
    pub model: Option<String>,
    pub prompt_tokens: u32,
    pub max_output_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<Decision>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl DecisionRecord {
    fn new(request: &RouteRequest<'_>, outcome: Result<&Decision, &PickError>) -> Self {
        let (decision, error) = match outcome {
            Ok(decision) => (Some(decision.clone()), None),
            Err(error) => (None, Some(error.to_string())),
        };
        DecisionRecord {
            unix_ms: unix_ms(),
            model: request.model().map(str::to_owned),
            prompt_tokens: request.prompt_tokens(),
            max_output_tokens: request.max_output_tokens(),
            decision,
            error,
        }
    }
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// The last N decisions with their candidates' scores, for operators.
#[derive(Debug)]
pub struct DecisionLog {
    capacity: usize,
    entries: Mutex<VecDeque<Arc<DecisionRecord>>>,
}

impl DecisionLog {
    pub fn new(capacity: usize) -> Self {
        DecisionLog {
            capacity,
            entries: Mutex::new(VecDeque::with_capacity(capacity)),
        }
    }

    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    fn push(&self, record: Arc<DecisionRecord>) {
        if self.capacity == 0 {
            return;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() == self.capacity {
            entries.pop_front();
        }
        entries.push_back(record);
    }

    /// The kept decisions, newest last.
    pub fn recent(&self) -> Vec<DecisionRecord> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.iter().map(|record| (**record).clone()).collect()
    }
}

#[cfg(test)]
mod tests;
