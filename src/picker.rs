//! The live router: runs the pure scheduler over the current snapshot, reserves the
//! chosen pod's in-flight accounting, and records what happened (metrics, debug log,
//! the live decision tap that the admin API's watchers subscribe to).
//!
//! Flow control: a request that fits no pod now (no pod has the KV it needs) is not placed
//! on the least bad pod, where it would make it preempt: it waits in the [`waiting`] room
//! until a pod has room, is refused at once when sheddable (negative priority; also when
//! every pod is saturated) or when the room is full, and gets 429 when its wait runs out.
//! A newcomer does not pass requests of its priority or higher already waiting.

mod waiting;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvroute_core::fleet::{
    Fleet, ModelClass, PrefillEnd, PrefixIndex, PrefixMatches, Reservation, Snapshot, adapter_key,
    block_hashes,
};
use kvroute_core::flow::{
    FlowRules, Hold, Holds, MAX_MISSES_PER_PASS, Shadows, TenantShares, is_sheddable, pods_key,
};
use kvroute_core::kvevents::{PromptBlocks, TokenBlocks, matches_with_events, token_block_hashes};
use kvroute_core::request::{InferenceRequest, RouteRequest};
use kvroute_core::scheduler::{Decision, Outlook, PickError, Picked, SchedulerConfig};
use serde::Serialize;
use tokio::sync::{broadcast, oneshot};
use tracing::{debug, error, info, warn};

use crate::extproc::messages::ErrorReply;
use crate::extproc::observe::PrefixPrediction;
use crate::extproc::{
    InFlight, Placement, RawRequest, ResponseSummary, Routed, Router, Unrouted, UnroutedKind,
    Waiting,
};
use crate::flow::{DropReason, FlowSettings, RequestClass};
use crate::kvevents::{PreciseIndex, PrefixSource};
use crate::store::PodStore;
use crate::telemetry::{self, ModelLabels, Outcome, QueueExit};
use crate::tokenize::check::{difference_report, first_difference};
use crate::tokenize::{
    LocalTokenizer, LocalTokenizers, PodTokenizer, PromptKind, TokenizeError, Unsupported,
    tokenize_body,
};
use kvroute_core::request::ApiKind;

use waiting::{Waiter, WaitingRoom};

/// Where a routed request came from, for its accounting.
struct Origin {
    labels: ModelLabels,
    tenant: Arc<str>,
    /// Where the decision's prefix matches came from.
    prefix: PrefixFrom,
    /// How long it waited for room, if it did.
    waited: Option<std::time::Duration>,
}

/// Where a decision's prefix matches came from, for the decision trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixFrom {
    /// What kvroute sent each pod (`--prefix-source approximate`, or a prompt that was
    /// not tokenized).
    Sent,
    /// The pods' KV events, for every candidate.
    KvEvents,
    /// The KV events of the pods whose events flow, what kvroute sent for the others.
    KvEventsAndSent,
}

impl PrefixFrom {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixFrom::Sent => "sent",
            PrefixFrom::KvEvents => "kv_events",
            PrefixFrom::KvEventsAndSent => "kv_events+sent",
        }
    }
}

/// What placing a request came to.
enum Placed {
    Routed(Decision, Option<Reservation>, PrefixFrom),
    /// No pod has room now; nothing was reserved.
    NoRoom(Outlook),
}

/// The router kvroute serves with.
pub struct LivePicker {
    store: Arc<PodStore>,
    config: SchedulerConfig,
    /// `config`, and the thresholds of requests that must leave room or may use it.
    rules: FlowRules,
    /// Requests in flight per tenant.
    shares: Arc<Mutex<TenantShares>>,
    /// Serialises pick + reserve, so two concurrent requests cannot both see the same
    /// free KV and herd onto one pod. A pick takes microseconds.
    placement: Mutex<()>,
    /// The prompt blocks sent to each pod, for prefix-cache affinity. Concurrent: matched
    /// and recorded outside the placement lock.
    prefix: PrefixIndex,
    decisions: DecisionLog,
    /// Each decision, for live watchers; built only while someone is subscribed.
    tap: broadcast::Sender<Arc<DecisionRecord>>,
    /// Requests that fit no pod yet.
    room: Arc<WaitingRoom>,
    /// Prefix matching on the pods' KV events, when switched on.
    precise: OnceLock<PreciseRouting>,
    /// This picker, for the tasks that tokenize a prompt before placing its request.
    me: OnceLock<Weak<LivePicker>>,
}

/// Prefix matching on what the pods' KV events say they cache.
#[derive(Debug)]
pub struct PreciseRouting {
    pub index: Arc<PreciseIndex>,
    /// `Precise` or `Auto` (`Approximate` never builds one).
    pub source: PrefixSource,
    /// Prompts kvroute cannot tokenize itself are asked of a pod.
    pub tokenizer: PodTokenizer,
    /// The models' own tokenizers (`--tokenizer`), tried first: no round trip.
    pub local: LocalTokenizers,
    /// Where the next tokenization starts looking for a pod.
    next_pod: AtomicUsize,
}

impl PreciseRouting {
    pub fn new(
        index: Arc<PreciseIndex>,
        source: PrefixSource,
        tokenizer: PodTokenizer,
        local: LocalTokenizers,
    ) -> Self {
        PreciseRouting {
            index,
            source,
            tokenizer,
            local,
            next_pod: AtomicUsize::new(0),
        }
    }
}

/// Decisions a watcher may fall behind by before it starts missing some.
const TAP_CAPACITY: usize = 4096;

impl LivePicker {
    pub fn new(
        store: Arc<PodStore>,
        config: SchedulerConfig,
        keep_decisions: usize,
        prefix_budget_bytes: usize,
        flow: Arc<FlowSettings>,
    ) -> Self {
        LivePicker {
            store,
            rules: FlowRules::new(&config),
            config,
            shares: Arc::default(),
            placement: Mutex::new(()),
            prefix: PrefixIndex::with_budget(prefix_budget_bytes),
            decisions: DecisionLog::new(keep_decisions),
            tap: broadcast::channel(TAP_CAPACITY).0,
            room: Arc::new(WaitingRoom::new(flow)),
            precise: OnceLock::new(),
            me: OnceLock::new(),
        }
    }

    /// Matches prompts on the pods' KV events from now on, as `precise.source` says.
    /// Once per picker; a second call changes nothing.
    pub fn match_on_events(self: &Arc<Self>, precise: PreciseRouting) {
        let _ = self.me.set(Arc::downgrade(self));
        let _ = self.precise.set(precise);
    }

    /// (pod, block) pairs the event index holds, if there is one.
    pub fn event_index_size(&self) -> Option<usize> {
        self.precise.get().map(|p| p.index.index().entries())
    }

    /// Requests waiting for room now.
    pub fn waiting(&self) -> usize {
        if self.room.is_empty() {
            0
        } else {
            self.room.lock().queue().len()
        }
    }

    /// Routes held requests as room appears, and answers those whose wait ran out. Runs
    /// until the store is dropped; wakes on a request's end, a new fleet, a new held
    /// request and the next deadline.
    pub async fn run_waiting_room(self: Arc<Self>) {
        let mut fleets = self.store.subscribe();
        loop {
            let deadline = self.room.next_deadline();
            let until_deadline = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.room.wake.notified() => {}
                changed = fleets.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = until_deadline => {}
            }
            self.dispatch_waiting(tokio::time::Instant::now());
        }
    }

    /// One pass over the waiting room at `now`: answers the requests whose wait ran out,
    /// then routes, in flow control's order, those that fit.
    fn dispatch_waiting(&self, now: tokio::time::Instant) {
        if self.room.is_empty() {
            return;
        }
        let fleet = self.store.fleet();
        let starving_after = self.room.settings.max_wait / 2;
        let mut held = self.room.lock();
        let expired = held.expire(now, |waiter| waiter.no_endpoint.load(Ordering::Relaxed));
        // What this pass's misses say of the requests after them, on `fleet`. Other
        // requests placed or finished meanwhile can make one wrong; it then waits for the
        // next pass, which the next finish starts.
        let mut shadows = Shadows::default();
        let routed = held.queue_mut().dispatch(
            MAX_MISSES_PER_PASS,
            |waiter| waiter.pods_key,
            |waiter| {
                // A tenant under its share, beside a busier one, is not kept waiting by
                // the busier one's smaller requests; a request that has waited long is not
                // passed by its own tenant's.
                if lock(&self.shares).under_share(&waiter.tenant) {
                    Holds::Band
                } else if now.saturating_duration_since(waiter.since) >= starving_after {
                    Holds::OwnTenant
                } else {
                    Holds::Nothing
                }
            },
            |waiter| self.try_place(waiter, &fleet, &mut shadows),
        );
        self.room.changed(&held);
        drop(held);
        for (waiter, bound) in expired {
            // What its last try found: pods without room, or no ready pod at all.
            let any_ready = !waiter.no_endpoint.load(Ordering::Relaxed);
            let (reason, message) = if any_ready {
                let message = if bound < self.room.settings.max_wait {
                    format!(
                        "no endpoint had room for the request within {bound:?}: the gateway's \
                         queue has not emptied for a while (more requests than the endpoints \
                         serve); retry later"
                    )
                } else {
                    format!("no endpoint had room for the request within {bound:?}; retry later")
                };
                (DropReason::TtlExpired, message)
            } else {
                let message = format!("no ready endpoint could serve the request within {bound:?}");
                (DropReason::NoEndpoints, message)
            };
            let waited = now.saturating_duration_since(waiter.since);
            telemetry::record_queue_wait(waiter.priority, QueueExit::Dropped, waited);
            self.record_after_wait(
                &waiter.route_request(),
                Err(format!("dropped ({}): {message}", reason.as_str())),
                waited,
                PrefixFrom::Sent,
            );
            let _ = waiter
                .answer
                .send(Err(dropped(reason, message, &waiter.labels)));
        }
        for (waiter, routed) in routed {
            telemetry::record_queue_wait(waiter.priority, QueueExit::Routed, now - waiter.since);
            // A client that left meanwhile drops the route, and with it the reservation.
            let _ = waiter.answer.send(Ok(routed));
        }
    }

    /// Places a held request if a pod has room now; records it when it does.
    fn try_place(
        &self,
        waiter: &Waiter,
        fleet: &Fleet,
        shadows: &mut Shadows,
    ) -> Option<Routed<InFlightRequest>> {
        let request = waiter.route_request();
        let started = Instant::now();
        let (hold, config) = self.placement(Hold::WithoutKv, waiter.priority, &waiter.tenant);
        match self.place(
            &request,
            &waiter.blocks,
            fleet,
            waiter.first_token_visible,
            hold,
            &config,
            shadows,
        ) {
            Ok(Placed::Routed(decision, reservation, prefix)) => Some(self.routed(
                &request,
                fleet,
                decision,
                reservation,
                Origin {
                    labels: waiter.labels.clone(),
                    tenant: Arc::clone(&waiter.tenant),
                    prefix,
                    waited: Some(waiter.since.elapsed()),
                },
                started.elapsed(),
            )),
            // Still no room, or no ready pod yet: it waits on.
            Ok(Placed::NoRoom(_)) => {
                waiter.no_endpoint.store(false, Ordering::Relaxed);
                None
            }
            Err(error) => {
                let none_ready =
                    matches!(error, PickError::NoEndpoints | PickError::NoReadyEndpoint);
                waiter.no_endpoint.store(none_ready, Ordering::Relaxed);
                None
            }
        }
    }

    /// Records a placed request and builds its route (`fleet`: what it was placed on).
    fn routed(
        &self,
        request: &RouteRequest<'_>,
        fleet: &Fleet,
        decision: Decision,
        reservation: Option<Reservation>,
        origin: Origin,
        elapsed: std::time::Duration,
    ) -> Routed<InFlightRequest> {
        let Origin {
            labels,
            tenant,
            prefix,
            waited,
        } = origin;
        lock(&self.shares).started(&tenant, decision.tokens_needed);
        telemetry::record_pick(elapsed, decision.reason.as_str());
        let prediction = decision.ranked.first().map(|winner| PrefixPrediction {
            cached_tokens: winner.held_tokens,
            source: prefix.as_str(),
            pod: decision.endpoint,
            block_tokens: fleet
                .snapshot()
                .pod(decision.endpoint)
                .and_then(|pod| pod.metrics())
                .and_then(|metrics| metrics.block_size)
                .unwrap_or(BLOCK_TOKENS_DEFAULT),
        });
        if let Some(prediction) = &prediction {
            telemetry::record_predicted_cached(prediction.source, prediction.cached_tokens);
        }
        telemetry::record_request(&labels, Outcome::Routed);
        debug!(
            endpoint = %decision.endpoint,
            reason = decision.reason.as_str(),
            candidates = decision.candidates,
            tokens = decision.tokens_needed,
            "routed"
        );
        match waited {
            Some(waited) => self.record_after_wait(request, Ok(&decision), waited, prefix),
            None => self.publish(|| DecisionRecord {
                prefix_source: Some(prefix),
                ..DecisionRecord::new(request, Ok(&decision))
            }),
        }
        let endpoints = std::iter::once(decision.endpoint)
            .chain(decision.fallbacks)
            .collect();
        Routed {
            endpoints,
            queued: waited,
            prediction,
            ticket: InFlightRequest {
                endpoint: decision.endpoint,
                reservation,
                store: Arc::clone(&self.store),
                labels,
                routed_at: Instant::now(),
                room: Arc::clone(&self.room),
                shares: Arc::clone(&self.shares),
                tenant,
            },
        }
    }

    /// What a request of `priority` and `tenant` that `hold` would hold is held on, and the
    /// scheduler configuration it is placed by ([`FlowRules::placement`]).
    fn placement(
        &self,
        hold: Hold,
        priority: i32,
        tenant: &str,
    ) -> (Hold, std::borrow::Cow<'_, SchedulerConfig>) {
        self.rules
            .placement(hold, priority, tenant, &lock(&self.shares))
    }

    /// Holds a request that found no room, or refuses it: a sheddable one, or any once
    /// the room is full. `no_endpoints`: it found no ready pod at all (503, not 429).
    fn hold(
        &self,
        request: &RouteRequest<'_>,
        class: &RequestClass,
        blocks: PromptBlocks,
        labels: ModelLabels,
        first_token_visible: bool,
        no_endpoints: bool,
    ) -> Placement<InFlightRequest> {
        let settings = &self.room.settings;
        let shed = |reason: DropReason, message: String| {
            telemetry::record_tenant(&class.tenant, false);
            Placement::Unrouted(dropped(reason, message, &labels))
        };
        if is_sheddable(class.priority) || !settings.queues() {
            return if no_endpoints {
                shed(
                    DropReason::NoEndpoints,
                    "no ready endpoint can serve the request".into(),
                )
            } else {
                shed(
                    DropReason::Saturated,
                    "every endpoint is at capacity and the request is sheddable; retry later"
                        .into(),
                )
            };
        }
        let pods_key = request.model().map_or(0, |model| {
            pods_key(model, self.store.fleet().snapshot(), &self.config)
        });
        let (answer, answered) = oneshot::channel();
        let waiter = Waiter {
            request: request.inference.cloned(),
            subset: request.subset.cloned(),
            blocks,
            first_token_visible,
            labels: labels.clone(),
            pods_key,
            priority: class.priority,
            tenant: Arc::from(class.tenant.as_str()),
            no_endpoint: AtomicBool::new(no_endpoints),
            since: tokio::time::Instant::now(),
            answer,
        };
        match self.room.hold(&class.tenant, waiter) {
            Some(place) => {
                telemetry::record_tenant(&class.tenant, true);
                self.record_held(request, class.priority);
                Placement::Waiting(Waiting::new(answered, Box::new(place), settings.max_wait))
            }
            None => shed(
                DropReason::Saturated,
                format!(
                    "every endpoint is at capacity and {} requests already wait; retry later",
                    settings.max_waiting
                ),
            ),
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

    /// Records a request that found no room and now waits.
    fn record_held(&self, request: &RouteRequest<'_>, priority: i32) {
        self.publish(|| DecisionRecord {
            held: Some(priority),
            ..DecisionRecord::about(request)
        });
    }

    /// Records a held request's decision, with how long it waited.
    fn record_after_wait(
        &self,
        request: &RouteRequest<'_>,
        outcome: Result<&Decision, String>,
        waited: std::time::Duration,
        prefix: PrefixFrom,
    ) {
        self.publish(|| {
            let (decision, error) = match outcome {
                Ok(decision) => (Some(decision.clone()), None),
                Err(error) => (None, Some(error)),
            };
            DecisionRecord {
                prefix_source: decision.is_some().then_some(prefix),
                decision,
                error,
                queued_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                ..DecisionRecord::about(request)
            }
        });
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
                held: None,
                queued_ms: 0,
                prefix_source: None,
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

    /// With matching on KV events, a request whose prompt a pod can tokenize waits
    /// (holding no thread) while one does, then is routed as any other; `None`: route it
    /// now, on the approximate index. A failed or late tokenization leaves the request
    /// to the approximate index too.
    fn tokenize_first(
        &self,
        request: &RouteRequest<'_>,
        raw: RawRequest<'_>,
        class: &RequestClass,
        first_token_visible: bool,
    ) -> Option<Placement<InFlightRequest>> {
        let precise = self.precise.get()?;
        let inference = request.inference?;
        let streaming = precise.index.streaming();
        if streaming.is_empty() {
            return None;
        }
        let fleet = self.store.fleet();
        let pod = tokenizing_pod(precise, fleet.snapshot(), &inference.model, &streaming)?;
        let block_tokens = pod
            .metrics()
            .and_then(|m| m.block_size)
            .unwrap_or(BLOCK_TOKENS_DEFAULT)
            .max(1);
        // A prompt shorter than a block has no block to match.
        if inference.prompt_tokens < block_tokens {
            return None;
        }
        // The model's own tokenizer where kvroute has it (an adapter's is its base
        // model's), else the pod's `/tokenize`.
        let base_model = pod
            .models
            .as_ref()
            .and_then(|m| m.adapters.get(&inference.model))
            .unwrap_or(&inference.model);
        let mut local = precise.local.for_model(base_model);
        // Blocks of an adapter's requests are stored under its name.
        let adapter = pod
            .models
            .as_ref()
            .is_some_and(|m| m.is_adapter(&inference.model))
            .then(|| inference.model.clone());
        let text = text_blocks(request);
        // A prompt whose long parts kvroute has encoded before (a tenant's context) is
        // tokenized here, in tens of microseconds, and placed at once: no task, no hop.
        if let Some(cheap) = local.as_ref() {
            let started = Instant::now();
            if let Some(tokens) = cheap.tokenize_if_cheap(raw.api, raw.body) {
                match local_outcome(started, tokens) {
                    LocalOutcome::Tokens(tokens) => {
                        check_against_pod(
                            &precise.tokenizer,
                            cheap,
                            (pod.endpoint, base_model),
                            raw.api,
                            raw.body,
                            &tokens,
                        );
                        let mut inference = inference.clone();
                        let tokens =
                            take_tokens(&mut inference, adapter.as_deref(), &tokens, block_tokens);
                        let request = RouteRequest {
                            inference: Some(&inference),
                            subset: request.subset,
                        };
                        let blocks = PromptBlocks {
                            text,
                            tokens: Some(tokens),
                        };
                        return Some(self.route_with(&request, class, first_token_visible, blocks));
                    }
                    LocalOutcome::NotOneText => return None,
                    // Left to a pod, below: not tried here again.
                    LocalOutcome::AskPod => local = None,
                }
            }
        }
        let asked = match local {
            Some(local) => Asked::Local(local, raw.api, raw.body.to_vec(), base_model.clone()),
            None => Asked::Pod(tokenize_body(raw.api, raw.body)?),
        };
        let me = self.me.get()?.upgrade()?;
        let endpoint = pod.endpoint;
        let (mut inference, subset, class) =
            (inference.clone(), request.subset.cloned(), class.clone());
        let tokenizer = precise.tokenizer.clone();
        let max_wait = tokenizer.timeout() + self.room.settings.max_wait;
        let (answer, answered) = oneshot::channel();
        tokio::spawn(async move {
            let mut answer = answer;
            let tokens = match asked {
                Asked::Local(local, api, body, model) => {
                    tokenize_here_or_on(&tokenizer, local, (endpoint, &model), api, body).await
                }
                Asked::Pod(body) => tokenize_on(&tokenizer, endpoint, body).await,
            };
            let tokens = tokens.map(|tokens| {
                take_tokens(&mut inference, adapter.as_deref(), &tokens, block_tokens)
            });
            // The client left while the prompt was tokenized.
            if answer.is_closed() {
                return;
            }
            let request = RouteRequest {
                inference: Some(&inference),
                subset: subset.as_ref(),
            };
            let blocks = PromptBlocks { text, tokens };
            match me.route_with(&request, &class, first_token_visible, blocks) {
                Placement::Routed(routed) => {
                    let _ = answer.send(Ok(routed));
                }
                Placement::Unrouted(unrouted) => {
                    let _ = answer.send(Err(unrouted));
                }
                // Flow control holds it: pass its answer on, or leave the queue when the
                // client leaves (dropping `held` takes it out).
                Placement::Waiting(held) => {
                    tokio::select! {
                        result = held => {
                            let _ = answer.send(result);
                        }
                        () = answer.closed() => {}
                    }
                }
            }
        });
        Some(Placement::Waiting(Waiting::new(
            answered,
            Box::new(()),
            max_wait,
        )))
    }

    /// Which leading blocks of the prompt each pod holds: from the KV events where the
    /// prompt was tokenized (for every pod in `precise` mode, for the pods whose events
    /// flow in `auto` mode), else from what kvroute sent.
    fn matches(&self, blocks: &PromptBlocks, fleet: &Fleet) -> (PrefixMatches, PrefixFrom) {
        let snapshot = fleet.snapshot();
        let guessed = self.prefix.matches(&blocks.text, snapshot);
        let Some(precise) = self.precise.get().filter(|_| blocks.tokens.is_some()) else {
            return (guessed, PrefixFrom::Sent);
        };
        let streaming = precise.index.streaming();
        let from = match precise.source {
            PrefixSource::Auto
                if !snapshot
                    .pods()
                    .iter()
                    .all(|pod| streaming.contains(&pod.endpoint)) =>
            {
                PrefixFrom::KvEventsAndSent
            }
            _ => PrefixFrom::KvEvents,
        };
        let matches = matches_with_events(
            precise.source,
            precise.index.index(),
            blocks.tokens.as_ref(),
            guessed,
            snapshot,
            |pod| streaming.contains(&pod.endpoint),
        );
        (matches, from)
    }

    /// Picks under the placement lock and reserves the winner's capacity, so the next
    /// pick sees this request. `blocks` are the prompt's prefix blocks.
    /// A request `hold` declines is not placed ([`Placed::NoRoom`]). `shadows`: those of
    /// the dispatch pass placing it ([`Hold::pick`]).
    #[allow(clippy::too_many_arguments)]
    fn place(
        &self,
        request: &RouteRequest<'_>,
        blocks: &PromptBlocks,
        fleet: &Fleet,
        first_token_visible: bool,
        hold: Hold,
        config: &SchedulerConfig,
        shadows: &mut Shadows,
    ) -> Result<Placed, PickError> {
        // Matching reads the indexes' own shards: concurrent requests match in parallel.
        let (matches, prefix) = self.matches(blocks, fleet);
        let placement = self.placement.lock().unwrap_or_else(|p| p.into_inner());
        let picked = hold.pick(
            request,
            Some(&matches),
            fleet,
            config,
            &mut rand::rng(),
            shadows,
        )?;
        let decision = match picked {
            Picked::Decided(decision) => decision,
            // Nothing scored: at overload, held requests are tried again and again.
            Picked::Declined(outlook) => return Ok(Placed::NoRoom(outlook)),
        };
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
            // What the scheduler credited: a copy of a context whose home is another pod is
            // reserved as if it held nothing (`PrefixMatches::homed`).
            let cached = winner.map_or(0, |c| c.cached_tokens);
            let prompt = u64::from(request.prompt_tokens()).saturating_sub(cached);
            let tokens = winner.map_or(decision.tokens_needed, |c| {
                c.kv_tokens_needed(decision.tokens_needed)
            });
            load.reserve(tokens, prompt, prefill_end)
        });
        drop(placement);
        self.prefix
            .record(decision.endpoint, &blocks.text, capacity);
        Ok(Placed::Routed(decision, reservation, prefix))
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
        raw: RawRequest<'_>,
        class: &RequestClass,
        first_token_visible: bool,
    ) -> Placement<InFlightRequest> {
        if let Some(later) = self.tokenize_first(request, raw, class, first_token_visible) {
            return later;
        }
        let blocks = PromptBlocks {
            text: text_blocks(request),
            tokens: None,
        };
        self.route_with(request, class, first_token_visible, blocks)
    }
}

/// Tokens per engine block where a pod does not say (vLLM's default on GPUs).
const BLOCK_TOKENS_DEFAULT: u32 = 16;

/// A ready pod whose events flow and which serves `model`, to tokenize a prompt: the
/// pods take turns, and at most 64 are looked at.
fn tokenizing_pod<'s>(
    precise: &PreciseRouting,
    snapshot: &'s Snapshot,
    model: &str,
    streaming: &std::collections::HashSet<SocketAddr>,
) -> Option<&'s kvroute_core::fleet::PodView> {
    let pods = snapshot.pods();
    if pods.is_empty() {
        return None;
    }
    let start = precise.next_pod.fetch_add(1, Ordering::Relaxed) % pods.len();
    (0..pods.len().min(64))
        .map(|k| &pods[(start + k) % pods.len()])
        .find(|pod| {
            pod.healthy
                && streaming.contains(&pod.endpoint)
                && pod.models.as_ref().is_some_and(|m| m.serves(model))
        })
}

/// What a tokenization will be asked of: kvroute's own tokenizer, with the request's
/// API, body and base model, or a pod, with the `/tokenize` body.
enum Asked {
    Local(Arc<LocalTokenizer>, ApiKind, Vec<u8>, String),
    Pod(Vec<u8>),
}

/// The prompt of `body` tokenized by `local`, on a blocking thread (a long prompt is
/// milliseconds of CPU), or by the pod at `endpoint` where `local` cannot render it
/// exactly. `None` where neither tokenized it.
async fn tokenize_here_or_on(
    pod: &PodTokenizer,
    local: Arc<LocalTokenizer>,
    (endpoint, model): (SocketAddr, &str),
    api: ApiKind,
    body: Vec<u8>,
) -> Option<Vec<u32>> {
    let started = Instant::now();
    let tokenizer = Arc::clone(&local);
    let worked = tokio::task::spawn_blocking(move || {
        let tokens = tokenizer.tokenize(api, &body);
        (tokens, body)
    })
    .await;
    let (tokens, body) = match worked {
        Ok(worked) => worked,
        Err(error) => {
            debug!(%error, "local tokenization did not finish; matching on what kvroute sent");
            return None;
        }
    };
    match local_outcome(started, tokens) {
        LocalOutcome::Tokens(tokens) => {
            check_against_pod(pod, &local, (endpoint, model), api, &body, &tokens);
            Some(tokens)
        }
        LocalOutcome::NotOneText => None,
        LocalOutcome::AskPod => tokenize_on(pod, endpoint, tokenize_body(api, &body)?).await,
    }
}

/// Where `local` is due a check ([`LocalTokenizer::due_for_check`]), the same prompt
/// (the request `body`, whose model's tokenizer `local` is) tokenized by the pod at
/// `endpoint` in the background and compared with `tokens`, kvroute's own. The request
/// does not wait for it. A difference stops local tokenization for the model (for its
/// prompts with tools, or with reasoning, only, where the prompt had them:
/// [`PromptKind`]): they go to the pods' `/tokenize`, which is right by construction.
fn check_against_pod(
    pod: &PodTokenizer,
    local: &Arc<LocalTokenizer>,
    (endpoint, model): (SocketAddr, &str),
    api: ApiKind,
    body: &[u8],
    tokens: &[u32],
) {
    let kind = PromptKind::of(body);
    if !local.due_for_check(kind) {
        return;
    }
    let Some(request) = tokenize_body(api, body) else {
        return;
    };
    let (pod, local, model, tokens) = (
        pod.clone(),
        Arc::clone(local),
        model.to_owned(),
        tokens.to_vec(),
    );
    tokio::spawn(async move {
        let engine = match pod.tokenize(endpoint, request).await {
            Ok(engine) => engine,
            Err(error) => {
                telemetry::record_local_tokenizer_check("failed");
                debug!(pod = %endpoint, %error, "the check of kvroute's tokens found no pod to compare with");
                return;
            }
        };
        let Some(at) = first_difference(&tokens, &engine) else {
            telemetry::record_local_tokenizer_check("agree");
            return;
        };
        telemetry::record_local_tokenizer_check("differ");
        if local.found_different(kind) {
            let difference = difference_report(&local, &tokens, &engine, at);
            let from_now_on = match kind {
                PromptKind::Plain => "its prompts are",
                PromptKind::Tools => "its prompts with tools (others still agree) are",
                PromptKind::Reasoning => "its prompts with reasoning (others still agree) are",
            };
            error!(
                model,
                pod = %endpoint,
                at,
                %difference,
                "--tokenizer makes other tokens than the engine for this model: {from_now_on} \
                 tokenized by the pods from now on (compare the directory with the model's \
                 using `kvroute tokenize --pod`)"
            );
        }
    });
}

/// What kvroute's own tokenizer made of a prompt.
enum LocalOutcome {
    Tokens(Vec<u32>),
    /// Not one sequence's text: nobody tokenizes it.
    NotOneText,
    /// Only a pod renders it exactly.
    AskPod,
}

/// `tokens`, kvroute's own tokenization begun at `started`, recorded with its outcome.
fn local_outcome(started: Instant, tokens: Result<Vec<u32>, Unsupported>) -> LocalOutcome {
    let unsupported = tokens.as_ref().err().map(Unsupported::kind);
    telemetry::record_local_tokenize(started.elapsed(), unsupported);
    match tokens {
        Ok(tokens) => LocalOutcome::Tokens(tokens),
        Err(Unsupported::NotOneText) => LocalOutcome::NotOneText,
        Err(why) => {
            if let Unsupported::LeftToPod(reason) = why
                && first_left_to_pod(reason)
            {
                // Once per kind of request, so an operator sees at the default level why
                // some prompts still wait for a pod's `/tokenize`.
                info!(
                    %why,
                    "a kind of prompt kvroute leaves to the pods' /tokenize (logged once; \
                     kvroute_tokenize_duration_seconds{{outcome=\"left_to_pod\"}} counts them)"
                );
            } else {
                debug!(%why, "prompt not tokenized locally; asking a pod");
            }
            LocalOutcome::AskPod
        }
    }
}

/// Whether `reason` (one of a few fixed phrases) is new to this process.
fn first_left_to_pod(reason: &'static str) -> bool {
    static SEEN: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if seen.contains(&reason) {
        return false;
    }
    seen.push(reason);
    true
}

/// The prompt's engine `tokens` as blocks to match, their count replacing the estimate
/// from the text in `inference`: the KV the prompt needs, and the most of it a pod can
/// hold cached.
fn take_tokens(
    inference: &mut InferenceRequest,
    adapter: Option<&str>,
    tokens: &[u32],
    block_tokens: u32,
) -> TokenBlocks {
    inference.prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    TokenBlocks {
        chains: token_block_hashes(adapter, tokens, block_tokens),
        block_tokens,
    }
}

/// The prompt of a `/tokenize` body as the pod at `endpoint` tokenizes it; `None` when
/// it failed or was late.
async fn tokenize_on(pod: &PodTokenizer, endpoint: SocketAddr, body: Vec<u8>) -> Option<Vec<u32>> {
    let started = Instant::now();
    let tokens = pod.tokenize(endpoint, body).await;
    telemetry::record_tokenize(
        started.elapsed(),
        tokens.as_ref().err().map(TokenizeError::kind),
    );
    tokens
        .inspect_err(|error| {
            debug!(pod = %endpoint, %error, "tokenization failed; matching on what kvroute sent");
        })
        .ok()
}

/// The prompt's text blocks for the approximate index. Hashing is the costly part of
/// prefix matching, so it happens before the placement lock.
fn text_blocks(request: &RouteRequest<'_>) -> Vec<u64> {
    request.inference.map_or_else(Vec::new, |r| {
        block_hashes(&r.model, r.prefix_context, &r.prompt_prefix)
    })
}

impl LivePicker {
    /// Routes `request` whose prompt blocks are `blocks`: places it now, holds it, or
    /// answers why not.
    fn route_with(
        &self,
        request: &RouteRequest<'_>,
        class: &RequestClass,
        first_token_visible: bool,
        blocks: PromptBlocks,
    ) -> Placement<InFlightRequest> {
        let fleet = self.store.fleet();
        let labels = model_labels(request.model(), fleet.snapshot(), &self.config);
        let queues = self.room.settings.queues();
        if queues && request.model().is_some() && self.room.must_queue_behind(class.priority) {
            return self.hold(request, class, blocks, labels, first_token_visible, false);
        }
        let (hold, config) = self.placement(
            Hold::on_arrival(request.model().is_some(), class.priority, queues),
            class.priority,
            &class.tenant,
        );
        let started = Instant::now();
        // On arrival: no dispatch pass, no shadows.
        let placed = self.place(
            request,
            &blocks,
            &fleet,
            first_token_visible,
            hold,
            &config,
            &mut Shadows::default(),
        );
        let elapsed = started.elapsed();
        match placed {
            Ok(Placed::Routed(decision, reservation, prefix)) => {
                telemetry::record_tenant(&class.tenant, true);
                let origin = Origin {
                    labels,
                    tenant: Arc::from(class.tenant.as_str()),
                    prefix,
                    waited: None,
                };
                Placement::Routed(self.routed(
                    request,
                    &fleet,
                    decision,
                    reservation,
                    origin,
                    elapsed,
                ))
            }
            Ok(Placed::NoRoom(outlook)) => {
                debug!(
                    saturated = outlook.relaxed.saturation,
                    tokens = outlook.tokens_needed,
                    "no pod has room"
                );
                self.hold(request, class, blocks, labels, first_token_visible, false)
            }
            // A pod whose model list kvroute cannot read is a configuration problem, not
            // one a wait mends: it is answered at once, below.
            Err(PickError::NoEndpoints | PickError::NoReadyEndpoint)
                if queues && hold != Hold::Never && self.room.settings.hold_without_endpoints =>
            {
                // Pods may be starting (scale from zero, a rollout): hold rather than 503.
                self.hold(request, class, blocks, labels, first_token_visible, true)
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
                Placement::Unrouted(Unrouted {
                    kind,
                    message: error.to_string(),
                    dropped: None,
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
    /// Told when the request ends: its pod has room again.
    room: Arc<WaitingRoom>,
    /// Its tenant's requests in flight, which it counts in until it ends.
    shares: Arc<Mutex<TenantShares>>,
    tenant: Arc<str>,
}

impl Drop for InFlightRequest {
    fn drop(&mut self) {
        // The reservation goes with this request (whichever way it ends): a held request
        // may fit now.
        self.reservation = None;
        lock(&self.shares).ended(&self.tenant);
        if !self.room.is_empty() {
            self.room.wake.notify_one();
        }
    }
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

/// A request flow control drops for `reason`, recorded: 503 when no pod can serve it, 429
/// while pods exist but have no room.
fn dropped(reason: DropReason, message: String, labels: &ModelLabels) -> Unrouted {
    let (kind, outcome) = if reason.status() == 503 {
        (UnroutedKind::Unavailable, Outcome::NoCapacity)
    } else {
        (UnroutedKind::Shed, Outcome::Shed)
    };
    telemetry::record_dropped(reason);
    telemetry::record_request(labels, outcome);
    Unrouted {
        kind,
        message,
        dropped: Some(reason),
    }
}

/// Tenants' shares are changed in single calls: a panic mid-call leaves a count off by one.
fn lock(shares: &Mutex<TenantShares>) -> std::sync::MutexGuard<'_, TenantShares> {
    shares.lock().unwrap_or_else(|p| p.into_inner())
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
    /// The request found no pod with room and waits, at this priority.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<i32>,
    /// How long the request waited for room before this decision.
    #[serde(skip_serializing_if = "is_zero")]
    pub queued_ms: u64,
    /// Where a routed request's prefix matches came from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_source: Option<PrefixFrom>,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

impl DecisionRecord {
    /// A record of `request` with no outcome yet.
    fn about(request: &RouteRequest<'_>) -> Self {
        DecisionRecord {
            unix_ms: unix_ms(),
            model: request.model().map(str::to_owned),
            prompt_tokens: request.prompt_tokens(),
            max_output_tokens: request.max_output_tokens(),
            decision: None,
            error: None,
            held: None,
            queued_ms: 0,
            prefix_source: None,
        }
    }

    fn new(request: &RouteRequest<'_>, outcome: Result<&Decision, &PickError>) -> Self {
        let (decision, error) = match outcome {
            Ok(decision) => (Some(decision.clone()), None),
            Err(error) => (None, Some(error.to_string())),
        };
        DecisionRecord {
            decision,
            error,
            ..DecisionRecord::about(request)
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
