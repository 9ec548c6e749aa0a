//! One policy on one workload, in virtual time: the discrete-event loop.
//!
//! Everything that happens is an event at a virtual instant, taken in time order (ties in
//! the order they were scheduled): a request arriving (drawn from the trace when due), a
//! pod's engine finishing a step or an adapter load (each engine's
//! [`Engine::next_event_time`], only for the engine that has one), a client timeout, a
//! scrape starting, a scrape's readings being published, a held request's deadline, a fleet
//! sample for the report. Nothing sleeps and nothing reads a clock but the wall-time
//! statistics.
//!
//! kvroute's flow control: a request kvroute holds waits in its waiting room, counted as in
//! flight by the client (as `bench` counts a request the gateway holds), until a dispatch
//! pass routes it or its deadline sheds it. A pass runs after each event that would wake the
//! live dispatcher (`LivePicker::run_waiting_room`): a request's end (several at one
//! instant, as one engine step ends them, wake it once), a published scrape, a request
//! joining the queue, a deadline.
//!
//! The ladder runs as `bench` runs it behind `compare`: a short warm-up at the lowest rate
//! with another seed (not reported), then each step, the next starting when the last
//! response of the previous one has ended. The fleet keeps its state (caches, adapters)
//! from step to step.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::fleet::PodMetrics;
use kvroute_core::kvevents::{BlockStored, EventBatch, KvEvent};
use kvroute_core::scheduler::{PickError, SchedulerConfig};
use kvroute_sim::engine::{
    DetachedForecast, Engine, Event, EventKind, FinishBound, FinishReason, KvCacheEvent,
    KvEventBatch, RequestSpec,
};
use kvroute_sim::kv::mix;

use super::cache_aware::CacheAware;
use super::diagnose::{Diagnostics, PodSample, RequestOutcome};
use super::flow::{self, FlowClass, FlowSettings};
use super::observe::served_models;
use super::pods::{Errand, HELPER_FROM_PODS, Pod, Pods};
use super::policy::{HeldEntry, Kvroute, Pages, Placement, Policy, Routed};
use super::ready::{Preparation, Ready, ReadyTrace};
use super::stats::{ClassLabels, Completion, FleetCounters, StepAcc, window_of};
use super::trace::{StepTrace, TraceRequest};
use super::{Router, Setup, SimStats};
use crate::compare::report::RouterRun;
use crate::loadgen::client::ErrorKind;
use crate::loadgen::report::{REPORT_VERSION, Report};

type SimTime = Duration;

/// Scheduled events; arrivals and timeouts are kept apart (they come in order anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Pod `i`'s engine has something due.
    Pod(u32),
    /// Every pod's scrape starts.
    Scrape,
    /// The oldest pending scrape is published.
    Publish,
    /// A held request's wait runs out (kvroute's dispatcher wakes).
    Deadline,
    /// The fleet's KV use is sampled for the report.
    Sample,
}

/// When a pod's engine is woken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stepping {
    /// Only when a request may finish there ([`Engine::next_finish_bound`]), besides the
    /// moments something reads it (a request sent or timing out, a scrape, a sample): what
    /// it does between, its tokens, is collected then. The results are those of
    /// `EveryEvent`; a pod stepping every 10–25 ms of virtual time but finishing a request
    /// about once a second wakes tens of times less.
    ToFinishBounds,
    /// At every engine event (each step's end), as the pods' servers run.
    #[cfg_attr(not(test), allow(dead_code))]
    EveryEvent,
}

/// A request between its arrival and its end: held at the gateway, then at its pod.
struct Open {
    serial: u64,
    step: usize,
    /// Its class in the workload.
    class: usize,
    arrived: SimTime,
    stage: Stage,
}

enum Stage {
    /// In kvroute's waiting room at `entry`; what sending it needs once routed.
    Held {
        request: Box<TraceRequest>,
        entry: HeldEntry,
    },
    /// At its pod.
    Sent(Sent),
}

struct Sent {
    pod: u32,
    engine_id: u64,
    /// How long it waited at the gateway.
    waited: SimTime,
    /// kvroute's hold on the pod's accounting, released when the request ends (dropped).
    _reservation: Option<kvroute_core::fleet::Reservation>,
    /// The tenant whose share it counts in (kvroute), until it ends.
    tenant: Option<Arc<str>>,
    /// The kvroute replica that routed it.
    replica: usize,
}

/// Where a request being sent to its pod comes from.
#[derive(Debug, Clone, Copy)]
enum Origin {
    /// Routed on arrival: not yet counted as open.
    Arrival,
    /// Routed after a wait: counted as open since its arrival, with this serial.
    Held { serial: u64 },
}

/// What sending a request needs beside the trace request and the route.
#[derive(Debug, Clone, Copy)]
struct Head {
    slot: u32,
    step: usize,
    class: usize,
    arrived: SimTime,
    origin: Origin,
}

/// A pod's reading ahead to its next finish bound, running on the helper thread while the
/// loop goes on: the loop leaves the pod alone until it is settled ([`World::settle`]),
/// which it is before the loop reaches the earliest bound it can find.
struct Forecasting {
    earliest: SimTime,
    /// The queue order taken for the pod's wake-up when the bound was asked for: ties
    /// with other events break as if it had been read then.
    order: u64,
    read: Errand<Box<DetachedForecast>>,
}

struct World<'s> {
    setup: &'s Setup<'s>,
    pods: Pods,
    /// When the queue wakes each pod next (kept apart from the pods: a wake-up that
    /// turns out stale must not touch its pod).
    due: Vec<Option<SimTime>>,
    stepping: Stepping,
    inflight: Vec<u32>,
    policy: Policy,
    queue: BinaryHeap<Reverse<(SimTime, u64, Ev)>>,
    order: u64,
    /// Pods whose next finish bound is being read ahead on the helper thread.
    forecasting: Vec<(usize, Forecasting)>,
    slots: Vec<Option<Open>>,
    free: Vec<u32>,
    timeouts: VecDeque<(SimTime, u32, u64)>,
    serial: u64,
    open_total: usize,
    steps: Vec<StepAcc>,
    adapter_names: Vec<String>,
    events: Vec<Event>,
    /// Buffer for the engines' KV event batches (kvroute-events).
    kv_batches: Vec<KvEventBatch>,
    words: Vec<u8>,
    max_model_len: u32,
    stats: SimStats,
    kv_sample: Vec<f64>,
    /// Requests routed to each pod since the step began.
    routed: Vec<u32>,
    diagnostics: Option<Diagnostics>,
    pod_samples: Vec<PodSample>,
    /// Each workload class's priority and tenant, and its labels in the report.
    classes: Vec<FlowClass>,
    labels: ClassLabels,
    /// Something that wakes kvroute's dispatcher happened while handling the current event.
    wake: bool,
}

/// An engine's batch as kvroute decodes it off the wire (`kvroute_sim::kv_events::wire`
/// writes the same fields).
fn event_batch(batch: &KvEventBatch) -> EventBatch {
    let events = batch
        .events
        .iter()
        .map(|event| match event {
            KvCacheEvent::BlockStored(stored) => KvEvent::BlockStored(BlockStored {
                block_hashes: stored.block_hashes.clone(),
                parent_block_hash: stored.parent_block_hash,
                token_ids: stored.token_ids.clone(),
                block_size: stored.block_size,
                lora_id: stored.lora.as_ref().map(|l| u64::from(l.id)),
                lora_name: stored.lora.as_ref().map(|l| l.name.clone()),
                medium: Some("GPU".into()),
                keyed: false,
                group_idx: Some(0),
            }),
            KvCacheEvent::BlockRemoved { block_hashes } => {
                KvEvent::BlockRemoved(kvroute_core::kvevents::BlockRemoved {
                    block_hashes: block_hashes.clone(),
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                })
            }
            KvCacheEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
        })
        .collect();
    EventBatch {
        ts: batch.at.as_secs_f64(),
        events,
        data_parallel_rank: Some(0),
    }
}

fn secs(t: SimTime) -> f64 {
    t.as_secs_f64()
}

impl<'s> World<'s> {
    fn new(setup: &'s Setup<'s>, router: Router) -> anyhow::Result<World<'s>> {
        let fleet = setup.workload.fleet_config()?;
        let pod = fleet
            .pods
            .first()
            .ok_or_else(|| anyhow::anyhow!("the workload's fleet has no pod"))?;
        let adapter_names = setup.scale.adapter_names(&setup.workload);
        let profile = Arc::new(pod.profile.clone());
        let pods: Vec<Pod> = (0..setup.pods)
            .map(|i| {
                let mut cfg = pod.engine.clone();
                // As `SimFleet::start` seeds pod i.
                cfg.seed = mix(setup.seed, i as u64);
                // No pod's page is read: the requests are measured here.
                cfg.histograms = false;
                // Nothing is streamed: the engines count their tokens' gaps, taken at
                // each step's end (steps do not overlap: a step ends with its last
                // response, so every gap counted during it is one of its requests').
                cfg.token_events = false;
                Pod::new(Engine::new(cfg, Arc::clone(&profile)))
            })
            .collect();
        let mut pods = pods;
        if router.follows_kv_events() {
            for p in &mut pods {
                p.engine.set_kv_events(true);
            }
        }
        let max_model_len = pods.first().map_or(0, |p| p.engine.max_model_len());
        let policy = match router {
            Router::Kvroute
            | Router::KvrouteEvents
            | Router::KvrouteX2
            | Router::KvrouteEventsX2 => {
                let replicas = router.replicas(setup);
                let config = SchedulerConfig {
                    // As `compare` runs kvroute: stale after ten scrape periods, at least 1 s.
                    max_metrics_age: (setup.scrape_interval * 10).max(Duration::from_secs(1)),
                    // Each replica told how many there are, as `kvroute serve --replicas`.
                    replicas: u32::try_from(replicas).unwrap_or(u32::MAX),
                    ..SchedulerConfig::default()
                };
                let models = served_models(&setup.workload.model, &adapter_names);
                // The classes carry the objectives' priorities already (`flow::classes`).
                let flow = FlowSettings {
                    max_wait: setup.max_queue_wait,
                    standing: setup.standing,
                    ..FlowSettings::default()
                };
                let kvroute =
                    Kvroute::new(setup.pods, models, config, flow, mix(setup.seed, 0x91c6));
                let kvroute = if router.follows_kv_events() {
                    kvroute.with_kv_events(pod.engine.block_size)
                } else {
                    kvroute
                };
                let kvroute = kvroute.with_replicas(replicas);
                Policy::Kvroute(Box::new(if setup.whole_picks {
                    kvroute.with_whole_picks()
                } else {
                    kvroute
                }))
            }
            Router::RoundRobin => Policy::RoundRobin { next: 0 },
            Router::CacheAware => Policy::CacheAware(Box::new(CacheAware::new(setup.pods))),
            Router::LeastRequest => Policy::LeastRequest {
                rng: rand::SeedableRng::seed_from_u64(mix(setup.seed, 0x1ea5)),
            },
        };
        Ok(World {
            setup,
            inflight: vec![0; setup.pods],
            due: vec![None; pods.len()],
            pods: Pods::new(pods),
            stepping: Stepping::ToFinishBounds,
            policy,
            queue: BinaryHeap::new(),
            order: 0,
            forecasting: Vec::new(),
            slots: Vec::new(),
            free: Vec::new(),
            timeouts: VecDeque::new(),
            serial: 0,
            open_total: 0,
            steps: Vec::new(),
            adapter_names,
            events: Vec::new(),
            kv_batches: Vec::new(),
            words: Vec::new(),
            max_model_len,
            stats: SimStats {
                router: Some(router.kind()),
                pods: setup.pods,
                ..SimStats::default()
            },
            kv_sample: Vec::with_capacity(setup.pods),
            routed: vec![0; setup.pods],
            diagnostics: match &setup.diagnose {
                Some((every, dir)) => Some(Diagnostics::create(
                    dir,
                    &format!("{}-{}", setup.workload.name, router.kind().name()),
                    *every,
                )?),
                None => None,
            },
            pod_samples: Vec::new(),
            classes: flow::classes(&setup.workload),
            labels: ClassLabels::of(&setup.workload),
            wake: false,
        })
    }

    fn schedule(&mut self, at: SimTime, ev: Ev) {
        self.order += 1;
        self.queue.push(Reverse((at, self.order, ev)));
    }

    /// Puts pod `i`'s next wake-up in the queue if it changed (after it was woken, or sent
    /// or aborted a request: what it will do next is unchanged by anything else). Where a
    /// helper thread runs, a bound that needs reading steps ahead is read there, and put
    /// in the queue when settled.
    fn reschedule(&mut self, i: usize) {
        self.order += 1;
        let order = self.order;
        let helped = self.pods.has_helper();
        let bound = {
            let engine = &mut self.pods.at(i).engine;
            match self.stepping {
                Stepping::ToFinishBounds if helped => engine.detach_forecast(),
                Stepping::ToFinishBounds => FinishBound::Known(engine.next_finish_bound()),
                Stepping::EveryEvent => FinishBound::Known(engine.next_event_time()),
            }
        };
        let next = match bound {
            FinishBound::Known(next) => next,
            FinishBound::ToRead(mut reading) => {
                let earliest = reading.earliest();
                let pods = &mut self.pods;
                let work = move || {
                    reading.run();
                    reading
                };
                let read = Errand::new(work, &mut |chore| pods.hand_over(chore));
                let forecasting = Forecasting {
                    earliest,
                    order,
                    read,
                };
                self.forecasting.push((i, forecasting));
                return;
            }
        };
        self.set_due(i, next, order);
    }

    /// Pod `i`'s next wake-up is at `next`, in queue order `order`.
    fn set_due(&mut self, i: usize, next: Option<SimTime>, order: u64) {
        if next != self.due[i] {
            self.due[i] = next;
            if let Some(t) = next {
                self.queue.push(Reverse((t, order, Ev::Pod(i as u32))));
            }
        }
    }

    /// Settles pod `i`'s reading ahead, if one is running: the pod is whole again and its
    /// wake-up in the queue.
    fn settle(&mut self, i: usize) -> anyhow::Result<()> {
        let Some(k) = self.forecasting.iter().position(|(pod, _)| *pod == i) else {
            return Ok(());
        };
        let (_, forecasting) = self.forecasting.swap_remove(k);
        let reading = forecasting.read.result()?;
        let next = self.pods.at(i).engine.settle_forecast(reading);
        self.set_due(i, next, forecasting.order);
        Ok(())
    }

    /// Settles the readings ahead that may find a bound at or before `horizon` (all of
    /// them when there is none).
    fn settle_until(&mut self, horizon: Option<SimTime>) -> anyhow::Result<()> {
        while let Some(&(i, _)) = self
            .forecasting
            .iter()
            .find(|(_, f)| horizon.is_none_or(|h| f.earliest <= h))
        {
            self.settle(i)?;
        }
        Ok(())
    }

    /// Advances every pod to `now` and takes what it did, for reading the fleet at `now`;
    /// with `read`, returns each pod's metrics then.
    fn catch_up(&mut self, now: SimTime, read: bool) -> anyhow::Result<Vec<Arc<PodMetrics>>> {
        self.settle_until(None)?;
        let readings = self.pods.advance_all(now, read)?;
        for i in 0..self.pods.len() {
            self.drain(i);
        }
        Ok(readings)
    }

    fn counters(&self) -> FleetCounters {
        let mut c = FleetCounters::default();
        for p in self.pods.iter() {
            let s = p.engine.stats();
            let loads = p.engine.lora_loads();
            c.preemptions += s.preemptions;
            c.prefix_hits += s.prefix_cache_hits;
            c.prefix_queries += s.prefix_cache_queries;
            c.lora_loads_disk += loads.disk;
            c.lora_loads_host += loads.host;
        }
        c
    }

    /// Takes pod `i`'s engine events and applies them to their requests.
    fn drain(&mut self, i: usize) {
        let mut events = std::mem::take(&mut self.events);
        self.pods.at(i).engine.take_events(&mut events);
        for ev in events.drain(..) {
            let Some(slot) = self.pods.at(i).slots.get(ev.id as usize).copied() else {
                continue;
            };
            match ev.kind {
                // The pods' tokens are not events ([`World::new`]): their gaps are taken
                // from the engines at the step's end.
                EventKind::Token { .. } => {}
                EventKind::Finished(summary) => {
                    let Some(open) = self.close(slot) else {
                        continue;
                    };
                    let Stage::Sent(sent) = &open.stage else {
                        continue;
                    };
                    let step = &mut self.steps[open.step];
                    if summary.completion_tokens == 0 {
                        step.error(open.class, ErrorKind::Stream, Some(200));
                    } else {
                        step.success(&Completion {
                            class: open.class,
                            pod: sent.pod as usize,
                            waited: secs(sent.waited),
                            pod_ttft: secs(summary.ttft),
                            pod_e2e: secs(summary.e2e),
                            tokens: summary.completion_tokens,
                            prompt: summary.prompt_tokens,
                            cached: summary.cached_tokens,
                            end_s: secs(ev.at),
                        });
                        if let Some(d) = &mut self.diagnostics {
                            d.request(&RequestOutcome {
                                arrived: secs(open.arrived),
                                step: open.step,
                                pod: sent.pod as usize,
                                replica: sent.replica,
                                waited: secs(sent.waited),
                                pod_ttft: secs(summary.ttft),
                                prompt_tokens: summary.prompt_tokens,
                                cached_tokens: summary.cached_tokens,
                            });
                        }
                    }
                }
            }
        }
        self.events = events;
        if let Policy::Kvroute(k) = &mut self.policy
            && k.uses_kv_events()
        {
            self.pods.at(i).engine.take_kv_events(&mut self.kv_batches);
            for batch in self.kv_batches.drain(..) {
                k.kv_events(i, &event_batch(&batch));
            }
        }
    }

    /// Ends the request in `slot`: releases its pod's accounting (dropping the
    /// reservation), its tenant's share and its step's count. A request that was at a pod
    /// wakes kvroute's dispatcher (`InFlightRequest`'s drop).
    fn close(&mut self, slot: u32) -> Option<Open> {
        let open = self.slots.get_mut(slot as usize)?.take()?;
        self.free.push(slot);
        self.open_total -= 1;
        self.steps[open.step].open -= 1;
        if let Stage::Sent(sent) = &open.stage {
            self.inflight[sent.pod as usize] -= 1;
            self.ended(sent.replica, sent.tenant.as_deref());
        }
        Some(open)
    }

    /// A routed request of `tenant` ended: its share ends, and kvroute's dispatcher wakes.
    fn ended(&mut self, replica: usize, tenant: Option<&str>) {
        if let (Policy::Kvroute(k), Some(tenant)) = (&mut self.policy, tenant) {
            k.ended(replica, tenant);
            self.wake = true;
        }
    }

    fn arrive(&mut self, now: SimTime, step: usize, ready: Ready) -> anyhow::Result<()> {
        let Ready {
            request,
            inference,
            tokens: prompt,
        } = ready;
        let request = &request;
        self.stats.requests += 1;
        let class = request.class;
        self.steps[step].arrived(class);
        if self.open_total >= self.setup.max_concurrency {
            self.steps[step].error(class, ErrorKind::Dropped, None);
            return Ok(());
        }
        let api = self.setup.workload.api;
        let model = request.model(&self.setup.workload.model, &self.adapter_names);
        let slot = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            (self.slots.len() - 1) as u32
        });
        let flow_class = self
            .classes
            .get(class)
            .cloned()
            .unwrap_or_else(|| FlowClass {
                priority: 0,
                tenant: Arc::from(flow::DEFAULT_TENANT),
            });
        let words = &mut self.words;
        let wall = Instant::now();
        let engine_prompt = &prompt;
        let placement = self
            .policy
            .route(now, &self.inflight, &flow_class, slot, |tokens| {
                let inference = inference.unwrap_or_else(|| request.inference(api, model, words));
                // The prompt as the engine tokenizes it (the gateway asks a pod's
                // /tokenize), when kvroute matches on KV events.
                (inference, tokens.then(|| engine_prompt.clone()))
            });
        self.stats.route_wall_s += wall.elapsed().as_secs_f64();
        match placement {
            Placement::Routed(routed) => {
                let head = Head {
                    slot,
                    step,
                    class,
                    arrived: now,
                    origin: Origin::Arrival,
                };
                self.send(now, head, request, routed, Some(prompt))?;
            }
            Placement::Held { entry, deadline } => {
                self.serial += 1;
                self.slots[slot as usize] = Some(Open {
                    serial: self.serial,
                    step,
                    class,
                    arrived: now,
                    stage: Stage::Held {
                        request: Box::new(request.clone()),
                        entry,
                    },
                });
                self.open_total += 1;
                self.steps[step].open += 1;
                self.timeouts
                    .push_back((now + self.setup.timeout, slot, self.serial));
                self.schedule(deadline, Ev::Deadline);
                self.stats.held += 1;
                self.wake = true;
            }
            Placement::Shed(reason) => {
                self.free.push(slot);
                self.stats.shed += 1;
                self.steps[step].shed(class, reason);
            }
            Placement::Failed(e) => {
                self.free.push(slot);
                let status = match e {
                    PickError::UnknownModel(_) => 404,
                    _ => 503,
                };
                self.steps[step].error(class, ErrorKind::Http, Some(status));
            }
        }
        Ok(())
    }

    /// Sends a routed request to its pod at `now`; `prompt` is its prompt as the engine
    /// tokenizes it, when already made.
    fn send(
        &mut self,
        now: SimTime,
        head: Head,
        request: &TraceRequest,
        routed: Routed,
        prompt: Option<Vec<u32>>,
    ) -> anyhow::Result<()> {
        let Head {
            slot,
            step,
            class,
            arrived,
            origin,
        } = head;
        if let Some(decision) = &routed.decision {
            self.stats.decisions += 1;
            self.stats.relaxed_saturation += u64::from(decision.relaxed.saturation);
            self.stats.relaxed_kv_headroom += u64::from(decision.relaxed.kv_headroom);
            if let Some(d) = &mut self.diagnostics {
                d.decision(secs(now), step, request, routed.pod, decision)?;
            }
        }
        if let Some(n) = self.routed.get_mut(routed.pod) {
            *n += 1;
        }
        let api = self.setup.workload.api;
        let prompt = prompt.unwrap_or_else(|| request.engine_tokens(api, &mut self.words));
        // The simulator's API refuses what can never fit (HTTP 400) before its engine.
        if prompt.len() as u64 + u64::from(request.max_tokens) > u64::from(self.max_model_len) {
            self.steps[step].error(class, ErrorKind::Http, Some(400));
            self.free.push(slot);
            if let Origin::Held { .. } = origin {
                self.open_total -= 1;
                self.steps[step].open -= 1;
            }
            self.ended(routed.replica, routed.tenant.as_deref());
            return Ok(());
        }
        let serial = match origin {
            Origin::Held { serial } => serial,
            Origin::Arrival => {
                self.serial += 1;
                self.serial
            }
        };
        let spec = RequestSpec {
            prompt,
            adapter: request
                .adapter
                .and_then(|a| self.adapter_names.get(a as usize).cloned()),
            max_output: request.max_tokens,
            finish_reason: FinishReason::Length,
            // Output token ids only seed cache blocks no later prompt reads.
            output_seed: mix(self.setup.seed, serial),
        };
        let i = routed.pod;
        self.settle(i)?;
        let engine_id = {
            let mut pod = self.pods.at(i);
            let engine_id = pod.engine.add_request(now, spec);
            let slots = &mut pod.slots;
            if engine_id as usize >= slots.len() {
                slots.resize(engine_id as usize + 1, u32::MAX);
            }
            slots[engine_id as usize] = slot;
            engine_id
        };
        self.slots[slot as usize] = Some(Open {
            serial,
            step,
            class,
            arrived,
            stage: Stage::Sent(Sent {
                pod: i as u32,
                engine_id,
                waited: now - arrived,
                _reservation: routed.reservation,
                tenant: routed.tenant,
                replica: routed.replica,
            }),
        });
        self.inflight[i] += 1;
        if let Origin::Arrival = origin {
            self.open_total += 1;
            self.steps[step].open += 1;
            self.timeouts
                .push_back((now + self.setup.timeout, slot, serial));
        }
        self.drain(i);
        self.reschedule(i);
        Ok(())
    }

    /// kvroute's dispatch pass at `now`: sheds the held requests whose wait ran out, sends
    /// those a pod has room for.
    fn dispatch(&mut self, now: SimTime) -> anyhow::Result<()> {
        let Policy::Kvroute(k) = &mut self.policy else {
            return Ok(());
        };
        if k.waiting() == 0 {
            return Ok(());
        }
        let wall = Instant::now();
        let pass = k.dispatch(now);
        self.stats.route_wall_s += wall.elapsed().as_secs_f64();
        for (slot, reason) in pass.expired {
            if let Some(open) = self.close(slot) {
                self.stats.shed += 1;
                self.steps[open.step].shed(open.class, reason);
            }
        }
        for (slot, routed) in pass.routed {
            let Some(open) = self.slots.get_mut(slot as usize).and_then(Option::take) else {
                continue;
            };
            let Stage::Held { request, .. } = open.stage else {
                continue;
            };
            let head = Head {
                slot,
                step: open.step,
                class: open.class,
                arrived: open.arrived,
                origin: Origin::Held {
                    serial: open.serial,
                },
            };
            self.send(now, head, &request, routed, None)?;
        }
        Ok(())
    }

    /// The client gives up on the request in `slot` (`bench --timeout`).
    fn time_out(&mut self, now: SimTime, slot: u32, serial: u64) -> anyhow::Result<()> {
        let live = self
            .slots
            .get(slot as usize)
            .and_then(Option::as_ref)
            .is_some_and(|o| o.serial == serial);
        if !live {
            return Ok(());
        }
        // Its pod catches up first: the tokens streamed until now count as they came.
        if let Some(Some(Open {
            stage: Stage::Sent(sent),
            ..
        })) = self.slots.get(slot as usize)
        {
            let i = sent.pod as usize;
            self.settle(i)?;
            self.pods.at(i).engine.advance(now);
            self.drain(i);
        }
        let Some(open) = self.close(slot) else {
            return Ok(());
        };
        match &open.stage {
            // Its stream ends: it leaves the waiting room.
            Stage::Held { entry, .. } => {
                if let Policy::Kvroute(k) = &mut self.policy {
                    k.leave(*entry);
                }
            }
            Stage::Sent(sent) => {
                let i = sent.pod as usize;
                self.pods.at(i).engine.abort(now, sent.engine_id);
                self.reschedule(i);
            }
        }
        self.steps[open.step].error(open.class, ErrorKind::Timeout, None);
        Ok(())
    }

    /// A scrape at `now`, to be published at `publish_at`.
    fn scrape(&mut self, now: SimTime, publish_at: SimTime) -> anyhow::Result<()> {
        self.stats.scrapes += 1;
        let Policy::Kvroute(k) = &self.policy else {
            self.catch_up(now, false)?;
            return Ok(());
        };
        // With a helper, the pages are read while the loop goes on (`Pods::begin`); the
        // readings are the same.
        let pages: Pages = if k.reads_pages_later() && self.pods.has_helper() {
            self.settle_until(None)?;
            let readings = self.pods.begin(now)?;
            Box::new(move || readings.take())
        } else {
            let readings = self.catch_up(now, true)?;
            Box::new(move || Ok(readings))
        };
        if let Policy::Kvroute(k) = &mut self.policy {
            let pods = &mut self.pods;
            k.scrape(now, pages, publish_at, &mut |chore| pods.hand_over(chore));
        }
        Ok(())
    }

    /// A scrape's readings are published: a new fleet, which wakes kvroute's dispatcher.
    fn publish(&mut self, now: SimTime) -> anyhow::Result<()> {
        // The scrape's pods not advanced yet are swept here too, beside the helper,
        // rather than waited for.
        self.pods.complete()?;
        if let Policy::Kvroute(k) = &mut self.policy {
            // While the helper builds the fleet, readings ahead it has not started are
            // read here instead of waiting.
            while !k.publication_made()
                && self
                    .forecasting
                    .iter_mut()
                    .any(|(_, forecasting)| forecasting.read.do_here())
            {}
            k.publish(now)?;
            self.wake = true;
        }
        Ok(())
    }

    fn sample(&mut self, now: SimTime, step: usize) -> anyhow::Result<()> {
        self.catch_up(now, false)?;
        self.kv_sample.clear();
        self.kv_sample
            .extend(self.pods.iter().map(|p| p.engine.gauges().2));
        let sample = std::mem::take(&mut self.kv_sample);
        self.steps[step].sample(&sample);
        self.kv_sample = sample;
        if let Some(d) = &mut self.diagnostics {
            self.pod_samples.clear();
            self.pod_samples
                .extend(self.pods.iter().zip(&self.inflight).zip(&self.routed).map(
                    |((p, &inflight), &routed)| {
                        let (waiting, running, kv_usage) = p.engine.gauges();
                        PodSample {
                            waiting,
                            running,
                            kv_usage,
                            inflight,
                            routed,
                        }
                    },
                ));
            d.pods(secs(now), step, &self.pod_samples)?;
        }
        Ok(())
    }

    /// Handles the next event before `arrival` (if any); returns its time, or None when the
    /// arrival comes first.
    fn next_before(
        &mut self,
        arrival: Option<SimTime>,
        step: usize,
    ) -> anyhow::Result<Option<SimTime>> {
        // What may come next needs the wake-ups of the readings ahead that can find one by
        // then (none finds one before its earliest).
        let next = |world: &Self| {
            let queued = world.queue.peek().map(|Reverse((t, _, _))| *t);
            let timeout = world.timeouts.front().map(|(t, _, _)| *t);
            [queued, timeout, arrival].into_iter().flatten().min()
        };
        if !self.forecasting.is_empty() {
            self.settle_until(next(self))?;
        }
        let queued = self.queue.peek().map(|Reverse((t, _, _))| *t);
        let timeout = self.timeouts.front().map(|(t, _, _)| *t);
        let Some(first) = [queued, timeout].into_iter().flatten().min() else {
            return Ok(None);
        };
        if arrival.is_some_and(|a| a < first) {
            return Ok(None);
        }
        if timeout == Some(first) && queued.is_none_or(|q| first < q) {
            if let Some((t, slot, serial)) = self.timeouts.pop_front() {
                self.time_out(t, slot, serial)?;
            }
            return Ok(Some(first));
        }
        let Some(Reverse((t, _, ev))) = self.queue.pop() else {
            return Ok(Some(first));
        };
        match ev {
            Ev::Pod(i) => {
                let i = i as usize;
                self.settle(i)?;
                if self.due[i] == Some(t) {
                    self.stats.engine_wakeups += 1;
                    self.due[i] = None;
                    self.pods.at(i).engine.advance(t);
                    self.drain(i);
                    self.reschedule(i);
                }
            }
            Ev::Scrape => {
                let delay = self.setup.scrape_delay;
                self.scrape(t, t + delay)?;
                if delay.is_zero() {
                    self.publish(t)?;
                } else {
                    self.schedule(t + delay, Ev::Publish);
                }
                self.schedule(t + self.setup.scrape_interval, Ev::Scrape);
            }
            Ev::Publish => self.publish(t)?,
            Ev::Deadline => self.wake = true,
            Ev::Sample => {
                self.sample(t, step)?;
                self.schedule(t + self.setup.sample_period, Ev::Sample);
            }
        }
        Ok(Some(t))
    }

    /// Runs one step (or the warm-up) from `start` to its last response; returns its end.
    fn run_step(
        &mut self,
        start: SimTime,
        step: usize,
        trace: impl Iterator<Item = TraceRequest> + Send + 'static,
    ) -> anyhow::Result<SimTime> {
        let mut now = start;
        self.routed.fill(0);
        self.steps[step].start_s = secs(start);
        self.catch_up(now, false)?;
        self.steps[step].counters_start = self.counters();
        let preparation = Preparation {
            api: self.setup.workload.api,
            model: Arc::from(self.setup.workload.model.as_str()),
            adapters: Arc::from(self.adapter_names.as_slice()),
            bodies: matches!(self.policy, Policy::Kvroute(_)),
        };
        let mut trace = ReadyTrace::new(trace, preparation);
        let mut next = trace.next(&mut self.pods)?;
        loop {
            let arrival = next.as_ref().map(|r| start + r.request.at);
            if arrival.is_none() && self.steps[step].open == 0 {
                break;
            }
            match self.next_before(arrival, step)? {
                Some(t) => now = now.max(t),
                None => {
                    if let Some(ready) = next.take() {
                        now = now.max(start + ready.request.at);
                        self.arrive(now, step, ready)?;
                        next = trace.next(&mut self.pods)?;
                    }
                }
            }
            if std::mem::take(&mut self.wake) {
                self.dispatch(now)?;
            }
        }
        self.steps[step].end_s = secs(now);
        self.catch_up(now, false)?;
        self.steps[step].counters_end = self.counters();
        for mut pod in self.pods.iter() {
            pod.engine.take_token_gaps(&mut self.steps[step].itl);
        }
        Ok(now)
    }
}

/// Runs `router` over the setup's ladder; returns the run as `compare` records one, and
/// the simulation's own statistics.
pub fn simulate(setup: &Setup<'_>, router: Router) -> anyhow::Result<(RouterRun, SimStats)> {
    simulate_stepping(setup, router, Stepping::ToFinishBounds)
}

fn simulate_stepping(
    setup: &Setup<'_>,
    router: Router,
    stepping: Stepping,
) -> anyhow::Result<(RouterRun, SimStats)> {
    std::thread::scope(|scope| {
        let wall = Instant::now();
        let mut world = World::new(setup, router)?;
        world.stepping = stepping;
        if setup.threads > 1 && setup.pods >= HELPER_FROM_PODS {
            world.pods.start_helper(scope);
            world.policy.lend_helper(&world.pods.chores());
        }
        run_world(world, router, wall)
    })
}

/// Runs the world's ladder (a simulation of `router` started at `wall`).
fn run_world(
    mut world: World<'_>,
    router: Router,
    wall: Instant,
) -> anyhow::Result<(RouterRun, SimStats)> {
    let setup = world.setup;
    let scale = setup.scale;
    // kvroute is ready once it has a snapshot: a first scrape at time zero, published at once.
    if matches!(world.policy, Policy::Kvroute(_)) {
        world.scrape(Duration::ZERO, Duration::ZERO)?;
        world.publish(Duration::ZERO)?;
        world.schedule(setup.scrape_interval, Ev::Scrape);
    }
    world.schedule(Duration::ZERO, Ev::Sample);
    let mut now = Duration::ZERO;
    let lowest = setup.rates.iter().copied().fold(f64::INFINITY, f64::min);
    // As `compare`: the warm-up has the class mix of the lowest rate's step.
    let lowest_step = setup.rates.iter().position(|&r| r == lowest).unwrap_or(0);
    let warm_workload = setup.workload.select_steps(&[lowest_step]);
    if let Some(warm) = setup.warmup {
        world.steps.push(StepAcc::new(
            lowest * scale.rate,
            secs(warm.duration),
            setup.pods,
            setup.workload.classes.len(),
        ));
        let trace = StepTrace::new(
            &warm_workload,
            setup.seed ^ 0x77a1_6d00,
            0,
            lowest,
            scale,
            warm.duration,
            Some(warm.requests),
        );
        now = world.run_step(now, 0, trace)?;
    }
    let first = world.steps.len();
    for (i, &rate) in setup.rates.iter().enumerate() {
        let index = world.steps.len();
        let duration = setup.step_duration.unwrap_or(Duration::MAX);
        world.steps.push(StepAcc::new(
            rate * scale.rate,
            setup.step_duration.map_or(
                setup.requests_per_step.unwrap_or(0) as f64 / (rate * scale.rate),
                secs,
            ),
            setup.pods,
            setup.workload.classes.len(),
        ));
        let trace = StepTrace::new(
            &setup.workload,
            setup.seed,
            i,
            rate,
            scale,
            duration,
            setup.requests_per_step,
        );
        now = world.run_step(now, index, trace)?;
    }
    let measured = &world.steps[first..];
    let mut spreads = Vec::new();
    let (mut usage_sum, mut usage_n) = (0.0, 0);
    for s in measured {
        spreads.extend_from_slice(&s.spreads);
        usage_sum += s.usage_sum;
        usage_n += s.usage_n;
    }
    let fleet_total = match (measured.first(), measured.last()) {
        (Some(a), Some(b)) => window_of(
            a.counters_start,
            b.counters_end,
            &spreads,
            usage_sum,
            usage_n,
        ),
        _ => Default::default(),
    };
    let wall_s = wall.elapsed().as_secs_f64();
    let mut stats = std::mem::take(&mut world.stats);
    stats.virtual_s = secs(now);
    stats.wall_s = wall_s;
    stats.events = stats.requests + stats.engine_wakeups + stats.scrapes;
    stats.tokens = world
        .pods
        .iter()
        .map(|p| p.engine.stats().generation_tokens)
        .sum();
    let bench = Report {
        version: REPORT_VERSION,
        workload: setup.workload.name.clone(),
        target: format!("kvroute-lab simulate ({} pods)", setup.pods),
        endpoint: String::new(),
        seed: setup.seed,
        speedup: 1.0,
        max_concurrency: setup.max_concurrency,
        started_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
            - wall_s,
        wall_s,
        steps: measured.iter().map(|s| s.report(&world.labels)).collect(),
    };
    let run = RouterRun {
        router: router.kind(),
        bench,
        fleet_steps: measured.iter().map(StepAcc::window).collect(),
        fleet_total,
        wall_s,
        replicas_routed: Vec::new(),
        prefix_checks: Vec::new(),
        kv_events: None,
    };
    // Every request ended, and kvroute holds nothing any more.
    stats.open_at_end = world.open_total;
    if let Policy::Kvroute(k) = &world.policy {
        stats.held_at_end = k.held();
    }
    if let Some(d) = world.diagnostics.take() {
        d.finish()?;
    }
    Ok((run, stats))
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::loadgen::Workload;
    use crate::loadgen::workload::WORDS;
    use crate::simulate::SimulateArgs;
    use kvroute_sim::stats::LogHistogram;

    /// kv-pressure's pod alone (30,816 KV tokens), scraped once, at time 0.
    fn setup_args() -> SimulateArgs {
        SimulateArgs {
            workloads: Vec::new(),
            pods: Some(1),
            requests: None,
            duration: None,
            rates: Vec::new(),
            quick: false,
            routers: Vec::new(),
            scrape_interval: Duration::from_secs(3600),
            scrape_delay: Duration::ZERO,
            max_queue_wait: Duration::from_secs(15),
            standing_queue_wait: Duration::from_secs(2),
            standing_queue_after: Duration::from_secs(5),
            seed: None,
            seeds: None,
            jobs: Some(1),
            no_warmup: true,
            diagnose: None,
            replicas: 1,
            output_dir: PathBuf::new(),
        }
    }

    /// A request of 16,000 prompt tokens (kvroute's estimate and the engine's alike), the
    /// `n`-th 4-byte word repeated (no prefix shared with another `n`), and 16 output
    /// tokens: the pod's KV holds one at a time.
    fn big(at: Duration, n: usize) -> TraceRequest {
        let word = WORDS
            .iter()
            .enumerate()
            .filter(|(_, w)| w.len() == 4)
            .nth(n)
            .expect("4-byte words")
            .0 as u8;
        TraceRequest {
            at,
            class: 0,
            adapter: None,
            system: None,
            own: Arc::from(vec![word; 16_000]),
            prompt_tokens: 16_000,
            max_tokens: 16,
        }
    }

    /// A run as JSON without its wall-clock times.
    fn outcome(run: &RouterRun, stats: &SimStats) -> serde_json::Value {
        fn strip(v: &mut serde_json::Value) {
            match v {
                serde_json::Value::Object(map) => {
                    map.retain(|k, _| !k.contains("wall") && !k.contains("started"));
                    map.values_mut().for_each(strip);
                }
                serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
                _ => {}
            }
        }
        let mut stats = stats.clone();
        stats.engine_wakeups = 0;
        stats.events = 0;
        let mut v = serde_json::json!({ "run": run, "stats": stats });
        strip(&mut v);
        v
    }

    #[test]
    fn pods_woken_at_their_finish_bounds_give_the_results_of_pods_woken_at_every_step() {
        for (name, pods, routers) in [
            // Preemptions, prefix hits and held requests.
            (
                "kv-pressure.yaml",
                3,
                &[Router::Kvroute, Router::RoundRobin][..],
            ),
            // Adapter loads, which keep a pod stepping while requests wait for them.
            (
                "multi-lora.yaml",
                6,
                &[Router::Kvroute, Router::LeastRequest, Router::RoundRobin][..],
            ),
        ] {
            let file = Path::new(crate::WORKLOADS_DIR).join(name);
            let w = Workload::from_file(&file).expect("shipped");
            let args = SimulateArgs {
                pods: Some(pods),
                requests: Some(1_500),
                scrape_interval: Duration::from_millis(50),
                scrape_delay: Duration::from_millis(50),
                no_warmup: false,
                ..setup_args()
            };
            let setup = Setup::new(&args, &w, &file).expect("setup");
            for &router in routers {
                let (run, lazy) =
                    simulate_stepping(&setup, router, Stepping::ToFinishBounds).expect("runs");
                let (every_run, every) =
                    simulate_stepping(&setup, router, Stepping::EveryEvent).expect("runs");
                assert_eq!(
                    outcome(&run, &lazy),
                    outcome(&every_run, &every),
                    "{name} {router:?}"
                );
                assert!(lazy.requests >= 1_500, "{name} {router:?}: {lazy:?}");
                assert!(
                    lazy.engine_wakeups * 3 < every.engine_wakeups,
                    "{name} {router:?}: {} vs {} wake-ups",
                    lazy.engine_wakeups,
                    every.engine_wakeups
                );
            }
        }
    }

    #[test]
    fn a_simulation_helped_by_a_second_thread_gives_the_results_of_one_thread() {
        // The helper sweeps the catch-ups (a scrape's while the loop goes on, the loop
        // advancing first the pods it touches), builds the fleets scrapes publish, makes
        // requests ready, reads pods' finish bounds ahead and makes kvroute's prefix
        // records (which shared-prefix's next requests match at once).
        for name in ["kv-pressure.yaml", "multi-lora.yaml", "shared-prefix.yaml"] {
            let file = Path::new(crate::WORKLOADS_DIR).join(name);
            let w = Workload::from_file(&file).expect("shipped");
            let args = SimulateArgs {
                pods: Some(HELPER_FROM_PODS),
                requests: Some(2_000),
                scrape_interval: Duration::from_millis(50),
                scrape_delay: Duration::from_millis(50),
                ..setup_args()
            };
            let mut setup = Setup::new(&args, &w, &file).expect("setup");
            let (alone_run, alone) = simulate(&setup, Router::Kvroute).expect("runs");
            setup.threads = 2;
            let (helped_run, helped) = simulate(&setup, Router::Kvroute).expect("runs");
            assert_eq!(
                outcome(&helped_run, &helped),
                outcome(&alone_run, &alone),
                "{name}"
            );
            assert!(helped.requests >= 2_000, "{name}: {helped:?}");
        }
    }

    /// Past the knee flow control holds requests and retries them at every finish: picks
    /// declined on their filters (`pick_unless`) and the misses' shadows (`Hold::pick`)
    /// must give the results of scoring every pick in full and declining it afterwards.
    #[test]
    fn declining_picks_early_gives_the_results_of_scoring_every_pick() {
        let file = Path::new(crate::WORKLOADS_DIR).join("kv-pressure.yaml");
        let w = Workload::from_file(&file).expect("shipped");
        let args = SimulateArgs {
            pods: Some(16),
            requests: Some(3_000),
            rates: vec![28.0],
            scrape_interval: Duration::from_millis(50),
            scrape_delay: Duration::from_millis(50),
            ..setup_args()
        };
        let mut setup = Setup::new(&args, &w, &file).expect("setup");
        let (early_run, early) = simulate(&setup, Router::Kvroute).expect("runs");
        setup.whole_picks = true;
        let (whole_run, whole) = simulate(&setup, Router::Kvroute).expect("runs");
        assert_eq!(outcome(&early_run, &early), outcome(&whole_run, &whole));
        // Past the knee: requests were held, and retried.
        assert!(early.held >= 300, "{early:?}");
    }

    #[test]
    fn pods_half_advanced_by_the_helper_thread_are_where_pods_advanced_on_one_are() {
        let file = Path::new(crate::WORKLOADS_DIR).join("kv-pressure.yaml");
        let w = Workload::from_file(&file).expect("shipped");
        let args = SimulateArgs {
            pods: Some(5),
            ..setup_args()
        };
        let setup = Setup::new(&args, &w, &file).expect("setup");
        let fleet = |helper: bool| {
            std::thread::scope(|scope| {
                let mut world = World::new(&setup, Router::RoundRobin).expect("world");
                if helper {
                    world.pods.start_helper(scope);
                }
                for i in 0..world.pods.len() {
                    for n in 0..3 {
                        let at = Duration::from_millis(n * 40);
                        let request = big(at, i * 3 + n as usize);
                        let prompt = request.engine_tokens(w.api, &mut world.words);
                        world.pods.at(i).engine.add_request(
                            at,
                            RequestSpec {
                                prompt,
                                adapter: None,
                                max_output: 16 + i as u32,
                                finish_reason: FinishReason::Length,
                                output_seed: n,
                            },
                        );
                    }
                }
                let mut readings = Vec::new();
                for ms in [100, 900, 2_500, 60_000] {
                    let now = Duration::from_millis(ms);
                    readings.push(world.pods.advance_all(now, true).expect("advanced"));
                }
                let events: Vec<(Vec<Event>, LogHistogram)> = (0..world.pods.len())
                    .map(|i| {
                        let (mut events, mut gaps) = (Vec::new(), LogHistogram::default());
                        world.pods.at(i).engine.take_events(&mut events);
                        world.pods.at(i).engine.take_token_gaps(&mut gaps);
                        (events, gaps)
                    })
                    .collect();
                (events, readings)
            })
        };
        let (events, readings) = fleet(false);
        // Each pod finished its three requests, 16 or more tokens each.
        assert!(
            events
                .iter()
                .all(|(e, gaps)| e.len() == 3 && gaps.count() >= 3 * 15),
            "{events:?}"
        );
        assert!(readings.iter().all(|r| r.len() == 5));
        // Mid-run, some pods are busy and some are not yet (the pods' queues differ).
        assert!(readings[0].iter().any(|m| m.waiting > 0), "{readings:?}");
        let (helped, helped_readings) = fleet(true);
        assert_eq!(helped, events);
        assert_eq!(helped_readings, readings);
    }

    #[test]
    fn a_held_request_is_sent_the_moment_a_request_ends_without_waiting_for_a_scrape() {
        let file = Path::new(crate::WORKLOADS_DIR).join("kv-pressure.yaml");
        let w = Workload::from_file(&file).expect("shipped");
        let args = setup_args();
        let setup = Setup::new(&args, &w, &file).expect("setup");
        let mut world = World::new(&setup, Router::Kvroute).expect("world");
        world
            .scrape(Duration::ZERO, Duration::ZERO)
            .expect("scraped");
        world.publish(Duration::ZERO).expect("published");
        world.schedule(setup.scrape_interval, Ev::Scrape);
        world.steps.push(StepAcc::new(1.0, 1.0, 1, w.classes.len()));
        let trace = vec![big(Duration::ZERO, 0), big(Duration::from_millis(1), 1)];
        world
            .run_step(Duration::ZERO, 0, trace.into_iter())
            .expect("runs");
        let step = &world.steps[0];
        assert_eq!((step.ok, step.shed, world.stats.held), (2, 0, 1));
        // The second waited from its arrival to the first's end, and no longer.
        let first_end = step.e2e[0];
        let waited = step.ttft[1] - step.pod_ttft[1];
        assert!(first_end > 0.1, "{first_end}");
        assert!(
            (waited - (first_end - 0.001)).abs() < 1e-6,
            "{waited} vs {first_end}"
        );
        assert_eq!(world.open_total, 0);
    }
}
