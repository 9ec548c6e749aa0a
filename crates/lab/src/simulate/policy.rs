//! The routing policies a simulation compares, each seeing what it would see live.
//!
//! - [`Policy::Kvroute`]: the real core, as the gateway's `LivePicker` (src/picker.rs) runs
//!   it. Placing a request ([`Kvroute::route`], `LivePicker::route` and `place`): hash the
//!   prompt's prefix blocks, match them in a [`PrefixIndex`], `scheduler::pick` over the
//!   last published [`Fleet`] with the thresholds [`FlowRules::for_request`] gives the
//!   request's priority and tenant, reserve the winner's [`PodLoad`] (noting the adapter for
//!   a LoRA pick), record the blocks for the winner. The reservation is held until the
//!   response ends, and the tenant's share ([`TenantShares`]) counts the request from its
//!   routing to its end. Flow control: a request the placement's [`Hold`] declines is held
//!   in the waiting room ([`super::flow`]) or shed, and each dispatch pass
//!   ([`Kvroute::dispatch`], `LivePicker::dispatch_waiting`) answers the requests whose
//!   wait ran out and routes, in the queue's order, those that fit. The pods' metrics come
//!   from scrapes: every `interval` each pod's ledger starts a scrape
//!   ([`PodLoad::scrape_started`]) and its engine state is read; `delay` later the readings
//!   are published as the gateway's store does it (`PodStore::publish`: the ledger absorbs
//!   the scrape, a new `Fleet` is built with the metrics' ages). Prefill ends at the next
//!   scrape, as with the shipped gateways, which keep response bodies away from kvroute.
//!   With KV events ([`Kvroute::with_kv_events`], the gateway's `--prefix-source auto`),
//!   every pod's engine publishes its cache's changes after each step; they are applied to
//!   an event index at once (events cross a socket in well under a millisecond, where
//!   scrapes wait for the next interval), and a request's prompt tokens, the engine's own,
//!   are matched there.
//! - [`Policy::RoundRobin`]: Envoy's `ROUND_ROBIN` over equal hosts.
//! - [`Policy::LeastRequest`]: Envoy's `LEAST_REQUEST` over equal hosts: two hosts drawn at
//!   random (with replacement), the one with fewer active requests, the first on a tie.
//! - [`Policy::CacheAware`]: a model of sglang-router's and vllm-router's `cache_aware`
//!   ([`super::cache_aware`]).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use kvroute_core::fleet::{
    DEFAULT_PREFIX_BUDGET_BYTES, Fleet, PodLoad, PodMetrics, PodView, PrefillEnd, PrefixIndex,
    Reservation, ScrapeTicket, ServedModels, adapter_key, block_hashes,
};
use kvroute_core::flow::{EntryId, FlowRules, Hold, Holds, Shadows, TenantShares, is_sheddable};
use kvroute_core::kvevents::{
    EventBatch, IndexSink, PodEvents, PrefixSource, PromptBlocks, TokenBlocks, matches_with_events,
    token_block_hashes,
};
use kvroute_core::request::{InferenceRequest, RouteRequest};
use kvroute_core::scheduler::{self, Decision, PickError, Picked, SchedulerConfig};

use super::cache_aware::CacheAware;
use super::flow::{
    DropReason, FlowClass, FlowSettings, MAX_MISSES_PER_PASS, Waiter, WaitingRoom, pods_key,
};
use super::pods::{Chore, Chores, Errand};
use super::records::Remembered;

/// The address standing for pod `i`: ordered as the pods, so a snapshot's position of a pod
/// is its index.
pub fn endpoint(i: usize) -> SocketAddr {
    let i = u32::try_from(i).unwrap_or(u32::MAX);
    SocketAddr::from((Ipv4Addr::from(0x0a00_0000 | i), 8000))
}

/// A request routed: the pod, and what kvroute holds for it until it ends.
#[derive(Debug)]
pub struct Routed {
    pub pod: usize,
    pub reservation: Option<Reservation>,
    /// kvroute's decision (the other policies have none).
    pub decision: Option<Decision>,
    /// The tenant whose share the request counts in until it ends (kvroute only).
    pub tenant: Option<Arc<str>>,
    /// The kvroute replica that routed it (0 for the other policies).
    pub replica: usize,
}

impl Routed {
    /// Counts the request in `tenant`'s share from now until it ends, with the KV its
    /// decision needed (what the live picker records when it routes).
    fn start_for(&mut self, tenant: &Arc<str>, shares: &RefCell<TenantShares>) {
        let needed = self.decision.as_ref().map_or(0, |d| d.tokens_needed);
        shares.borrow_mut().started(tenant, needed);
        self.tenant = Some(Arc::clone(tenant));
    }
}

/// A request held in a replica's waiting room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldEntry {
    pub replica: usize,
    pub entry: EntryId,
}

/// What routing a request came to.
#[derive(Debug)]
pub enum Placement {
    Routed(Routed),
    /// Held in kvroute's waiting room at `entry` until `deadline` at the latest.
    Held {
        entry: HeldEntry,
        deadline: Duration,
    },
    /// Refused by flow control; it never reaches a pod.
    Shed(DropReason),
    /// Not routed (no such model, no pod).
    Failed(PickError),
}

/// What one dispatch pass came to: the requests (by the caller's slot) whose wait ran out,
/// and those routed, in the order they were routed.
#[derive(Debug, Default)]
pub struct Pass {
    pub expired: Vec<(u32, DropReason)>,
    pub routed: Vec<(u32, Routed)>,
}

/// One scrape of the fleet in flight.
#[derive(Debug)]
struct PendingScrape {
    started: Duration,
    /// Per pod, the ledger's ticket, taken as the scrape started.
    tickets: Vec<ScrapeTicket>,
    /// What it read and the fleet it publishes, being made off this thread for the
    /// moment it is due.
    prepared: (Duration, Errand<anyhow::Result<Prepared>>),
}

/// Per pod, what a scrape read; and the fleet it publishes.
type Prepared = (Vec<Arc<PodMetrics>>, Arc<Fleet>);

/// A scrape's pages, all of them once they have been read (the simulation reads them
/// off the loop where it can: [`super::pods::Pods::begin`]).
pub type Pages = Box<dyn FnOnce() -> anyhow::Result<Vec<Arc<PodMetrics>>> + Send>;

/// One kvroute replica's picker and store, in virtual time.
#[derive(Debug)]
pub struct Replica {
    config: SchedulerConfig,
    /// `config`, and the thresholds of requests that must leave room or may use it.
    rules: FlowRules,
    /// Requests in flight per tenant. In a cell: a dispatch pass reads it to order the
    /// queue while placing (which counts each routed request in at once), as the live one.
    shares: RefCell<TenantShares>,
    prefix: Remembered,
    /// The index the pods' KV events feed, when they publish them.
    events: Option<EventIndex>,
    rng: SmallRng,
    /// Shared with the fleets built off this thread.
    loads: Arc<[Arc<PodLoad>]>,
    models: Arc<ServedModels>,
    /// Each pod's last published scrape and when it started.
    metrics: Vec<Option<(Arc<PodMetrics>, Duration)>>,
    /// Scrapes started, not yet published: when, each pod's ledger ticket, and what is
    /// being made of their pages.
    pending: VecDeque<PendingScrape>,
    /// Who frees a replaced fleet: the helper thread, which made its pages and built it
    /// (freeing it was a third of what a publication cost the loop).
    chores: Chores,
    /// Shared with the fleet being built next, whose model index may reuse its own.
    fleet: Arc<Fleet>,
    generation: u64,
    /// Requests that fit no pod yet.
    room: WaitingRoom,
    /// Every pick scored in full, declined afterwards, no shadows ([`super::Setup::whole_picks`]).
    whole_picks: bool,
}

/// The event index and each pod's event state (`kvevents::PodSubscriber`'s, without the
/// sockets).
#[derive(Debug)]
struct EventIndex {
    index: PrefixIndex,
    pods: Vec<PodEvents>,
    /// Each pod's next sequence number.
    seq: Vec<u64>,
    /// Tokens per block of the pods' engines.
    block_tokens: u32,
}

/// What placing a request came to (`LivePicker::place`'s `Placed`).
enum Placed {
    Routed(Routed),
    /// No pod has room now; nothing was reserved.
    NoRoom,
}

/// The fleet of `metrics` (per pod, its last reading and that reading's age, or none)
/// with the pods' ledgers `loads`, each pod listing `models`; `previous` is the fleet
/// before it, whose model index it may share.
fn fleet_of(
    previous: &Fleet,
    metrics: Vec<Option<(Arc<PodMetrics>, Duration)>>,
    loads: &[Arc<PodLoad>],
    models: &Arc<ServedModels>,
    generation: u64,
) -> Fleet {
    let pods = metrics
        .into_iter()
        .zip(loads)
        .enumerate()
        .map(|(i, (m, load))| {
            let (metrics, age) = m.unzip();
            let view = PodView::new(
                endpoint(i),
                metrics.is_some(),
                metrics,
                age,
                Some(Arc::clone(models)),
            );
            (view, Arc::clone(load))
        })
        .collect();
    Fleet::new_after(previous, pods, generation, 1)
}

impl Replica {
    pub fn new(
        pods: usize,
        models: Arc<ServedModels>,
        config: SchedulerConfig,
        flow: FlowSettings,
        seed: u64,
    ) -> Self {
        Replica {
            rules: FlowRules::new(&config),
            config,
            shares: RefCell::default(),
            prefix: Remembered::new(),
            events: None,
            rng: SmallRng::seed_from_u64(seed),
            loads: (0..pods).map(|_| Arc::new(PodLoad::default())).collect(),
            models,
            metrics: vec![None; pods],
            pending: VecDeque::new(),
            chores: Chores::default(),
            fleet: Arc::default(),
            generation: 0,
            room: WaitingRoom::new(flow),
            whole_picks: false,
        }
    }

    /// Matches prompts on the pods' KV events (engines of `block_tokens`-token blocks),
    /// as the gateway's `--prefix-source auto` with every pod's events flowing.
    pub fn with_kv_events(mut self, block_tokens: u32) -> Self {
        let pods = self.loads.len();
        self.events = Some(EventIndex {
            index: PrefixIndex::with_budget(DEFAULT_PREFIX_BUDGET_BYTES),
            pods: (0..pods).map(|_| PodEvents::new()).collect(),
            seq: vec![0; pods],
            block_tokens: block_tokens.max(1),
        });
        self
    }

    /// Whether prompts are matched on KV events (the caller then passes prompt tokens).
    pub fn uses_kv_events(&self) -> bool {
        self.events.is_some()
    }

    /// Pod `pod`'s engine published `batch`.
    pub fn kv_events(&mut self, pod: usize, batch: &EventBatch) {
        let Some(events) = &mut self.events else {
            return;
        };
        events.index.follow(self.fleet.snapshot());
        let capacity = self
            .metrics
            .get(pod)
            .and_then(|m| m.as_ref())
            .and_then(|(m, _)| m.kv_capacity_tokens)
            .unwrap_or(0);
        if let (Some(state), Some(seq)) = (events.pods.get_mut(pod), events.seq.get_mut(pod)) {
            let mut sink = IndexSink {
                index: &events.index,
                endpoint: endpoint(pod),
                capacity_tokens: capacity,
            };
            state.apply(*seq, batch, &mut sink);
            *seq += 1;
        }
    }

    /// A scrape of every pod starts at `now`; `pages` gives each pod's page at that moment,
    /// in pod order. It will be published at `publish_at`: the pages are read and the
    /// fleet they publish is built now by `hand_over`'s means (the simulation's helper
    /// thread), ready by then.
    pub fn scrape(
        &mut self,
        now: Duration,
        pages: Pages,
        publish_at: Duration,
        hand_over: &mut impl FnMut(Chore),
    ) {
        let tickets = self.loads.iter().map(|l| l.scrape_started()).collect();
        // Every pod was read: at its publication, each one's age is the scrape's.
        let age = publish_at.saturating_sub(now);
        // Publications come in the order of their scrapes, one each.
        let generation = self.generation + self.pending.len() as u64 + 1;
        let (previous, loads, models) = (
            Arc::clone(&self.fleet),
            Arc::clone(&self.loads),
            Arc::clone(&self.models),
        );
        let build = move || -> anyhow::Result<Prepared> {
            let mut pages = pages()?.into_iter();
            let readings: Vec<Arc<PodMetrics>> = loads
                .iter()
                .map(|_| pages.next().unwrap_or_default())
                .collect();
            let metrics = readings
                .iter()
                .map(|m| Some((Arc::clone(m), age)))
                .collect();
            let fleet = Arc::new(fleet_of(&previous, metrics, &loads, &models, generation));
            Ok((readings, fleet))
        };
        let prepared = Errand::new(build, hand_over);
        self.pending.push_back(PendingScrape {
            started: now,
            tickets,
            prepared: (publish_at, prepared),
        });
    }

    /// Whether the next publication's fleet is built (or there is none to build), without
    /// waiting.
    pub fn publication_made(&mut self) -> bool {
        self.pending
            .front_mut()
            .is_none_or(|scrape| scrape.prepared.1.is_done())
    }

    /// The oldest pending scrape has answered: publish it (`PodStore::record_scrape` then
    /// `PodStore::publish`).
    pub fn publish(&mut self, now: Duration) -> anyhow::Result<()> {
        let mut prepared = None;
        if let Some(scrape) = self.pending.pop_front() {
            let (at, made) = scrape.prepared;
            let (readings, fleet) = made.result()??;
            for ((slot, load), (metrics, ticket)) in self
                .metrics
                .iter_mut()
                .zip(self.loads.iter())
                .zip(readings.into_iter().zip(scrape.tickets))
            {
                *slot = Some((metrics, scrape.started));
                load.scrape_succeeded(ticket);
            }
            prepared = (at == now).then_some(fleet);
        }
        self.generation += 1;
        // The fleet built for this moment, or else (published at another) one built here
        // from the same readings.
        let fleet = prepared.unwrap_or_else(|| {
            let metrics = self
                .metrics
                .iter()
                .map(|m| {
                    m.as_ref()
                        .map(|(m, at)| (Arc::clone(m), now.saturating_sub(*at)))
                })
                .collect();
            Arc::new(fleet_of(
                &self.fleet,
                metrics,
                &self.loads,
                &self.models,
                self.generation,
            ))
        });
        let replaced = std::mem::replace(&mut self.fleet, fleet);
        self.chores.hand_over(Box::new(move || drop(replaced)));
        Ok(())
    }

    /// What the pods' ledgers still hold, summed: requests in flight and tokens counted
    /// as committed, unscraped or queued for prefill. Zero once every request has ended.
    pub fn held(&self) -> u64 {
        self.loads
            .iter()
            .map(|l| {
                u64::from(l.inflight())
                    + l.committed_tokens()
                    + l.unscraped_tokens()
                    + l.prefill_tokens()
                    + l.growth_tokens()
            })
            .sum()
    }

    /// Requests waiting for room now.
    pub fn waiting(&self) -> usize {
        self.room.len()
    }

    /// `LivePicker::route`: a request of `class` arriving at `now`, named `slot` by the
    /// caller should it wait.
    pub fn route(
        &mut self,
        now: Duration,
        mut request: InferenceRequest,
        tokens: Option<Vec<u32>>,
        class: &FlowClass,
        slot: u32,
    ) -> Placement {
        let text = block_hashes(
            &request.model,
            request.prefix_context,
            &request.prompt_prefix,
        );
        // The engine's own tokens: what the gateway gets from a pod's /tokenize, whose
        // count replaces the estimate from the text (as `LivePicker` does).
        let tokens = self.events.as_ref().zip(tokens).map(|(events, tokens)| {
            request.prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
            let adapter = self
                .models
                .is_adapter(&request.model)
                .then_some(request.model.as_str());
            TokenBlocks {
                chains: token_block_hashes(adapter, &tokens, events.block_tokens),
                block_tokens: events.block_tokens,
            }
        });
        let blocks = PromptBlocks { text, tokens };
        let queues = self.room.settings.queues();
        if queues && self.room.must_queue_behind(class.priority) {
            return self.hold(now, request, blocks, class, slot, false);
        }
        // Every simulated request names a model: `Hold::Never` is flow control off.
        let shares = self.shares.borrow();
        let (hold, config) = self.rules.placement(
            Hold::on_arrival(true, class.priority, queues),
            class.priority,
            &class.tenant,
            &shares,
        );
        let placed = place(
            &mut self.prefix,
            self.events.as_ref(),
            &self.fleet,
            &mut self.rng,
            &request,
            &blocks,
            hold,
            &config,
            // On arrival: no dispatch pass, no shadows.
            (!self.whole_picks).then_some(&mut Shadows::default()),
        );
        drop(shares);
        match placed {
            Ok(Placed::Routed(mut routed)) => {
                routed.start_for(&class.tenant, &self.shares);
                Placement::Routed(routed)
            }
            Ok(Placed::NoRoom) => self.hold(now, request, blocks, class, slot, false),
            // Pods may be starting: hold rather than answer 503 (the live default).
            Err(PickError::NoEndpoints | PickError::NoReadyEndpoint)
                if queues && hold != Hold::Never =>
            {
                self.hold(now, request, blocks, class, slot, true)
            }
            Err(error) => Placement::Failed(error),
        }
    }

    /// `LivePicker::hold`: holds a request that found no room, or sheds it (a sheddable one,
    /// any with the queue off, any once the room is full).
    fn hold(
        &mut self,
        now: Duration,
        request: InferenceRequest,
        blocks: PromptBlocks,
        class: &FlowClass,
        slot: u32,
        no_endpoints: bool,
    ) -> Placement {
        if is_sheddable(class.priority) || !self.room.settings.queues() {
            return Placement::Shed(if no_endpoints {
                DropReason::NoEndpoints
            } else {
                DropReason::Saturated
            });
        }
        let pods_key = pods_key(&request.model, self.fleet.snapshot(), &self.config);
        let waiter = Waiter {
            slot,
            request,
            blocks,
            pods_key,
            priority: class.priority,
            tenant: Arc::clone(&class.tenant),
            no_endpoint: Cell::new(no_endpoints),
            since: now,
        };
        match self.room.hold(waiter) {
            Some((entry, deadline)) => Placement::Held {
                entry: HeldEntry { replica: 0, entry },
                deadline,
            },
            None => Placement::Shed(DropReason::Saturated),
        }
    }

    /// The client of a held request gave up: it leaves the room (`HeldPlace`'s drop).
    pub fn leave(&mut self, entry: EntryId) {
        self.room.leave(entry);
    }

    /// A routed request of `tenant` ended (`InFlightRequest`'s drop; its reservation goes
    /// with the caller's copy).
    pub fn ended(&mut self, tenant: &str) {
        self.shares.get_mut().ended(tenant);
    }

    /// `LivePicker::dispatch_waiting`: one pass over the waiting room at `now`. Takes out
    /// the requests whose wait ran out, then routes, in flow control's order, those that
    /// fit.
    pub fn dispatch(&mut self, now: Duration) -> Pass {
        if self.room.is_empty() {
            return Pass::default();
        }
        let starving_after = self.room.settings.max_wait / 2;
        let expired = self.room.expire(now);
        let Replica {
            rules,
            shares,
            prefix,
            events,
            rng,
            fleet,
            room,
            whole_picks,
            ..
        } = self;
        let mut shadows = Shadows::default();
        let routed = room.queue_mut().dispatch(
            MAX_MISSES_PER_PASS,
            |waiter| waiter.pods_key,
            |waiter| {
                // A tenant under its share, beside a busier one, is not kept waiting by
                // the busier one's smaller requests; a request that has waited long is not
                // passed by its own tenant's.
                if shares.borrow().under_share(&waiter.tenant) {
                    Holds::Band
                } else if now.saturating_sub(waiter.since) >= starving_after {
                    Holds::OwnTenant
                } else {
                    Holds::Nothing
                }
            },
            |waiter| {
                let (hold, config) = rules.placement(
                    Hold::WithoutKv,
                    waiter.priority,
                    &waiter.tenant,
                    &shares.borrow(),
                );
                match place(
                    prefix,
                    events.as_ref(),
                    fleet,
                    rng,
                    &waiter.request,
                    &waiter.blocks,
                    hold,
                    &config,
                    (!*whole_picks).then_some(&mut shadows),
                ) {
                    Ok(Placed::Routed(mut routed)) => {
                        routed.start_for(&waiter.tenant, shares);
                        Some(routed)
                    }
                    // Still no room: it waits on.
                    Ok(Placed::NoRoom) => {
                        waiter.no_endpoint.set(false);
                        None
                    }
                    Err(error) => {
                        let none_ready =
                            matches!(error, PickError::NoEndpoints | PickError::NoReadyEndpoint);
                        waiter.no_endpoint.set(none_ready);
                        None
                    }
                }
            },
        );
        Pass {
            // What its last try found: pods without room, or no ready pod at all.
            expired: expired
                .into_iter()
                .map(|waiter| {
                    let reason = if waiter.no_endpoint.get() {
                        DropReason::NoEndpoints
                    } else {
                        DropReason::TtlExpired
                    };
                    (waiter.slot, reason)
                })
                .collect(),
            routed: routed
                .into_iter()
                .map(|(waiter, routed)| (waiter.slot, routed))
                .collect(),
        }
    }
}

/// kvroute in virtual time: one replica, or several behind one gateway. Envoy spreads
/// its ext_proc streams over the replicas of the processor cluster in turn, so requests go
/// to the replicas in turn; each replica scrapes every pod and follows every pod's events,
/// but sees in flight, and remembers as sent, only the requests it routed itself.
#[derive(Debug)]
pub struct Kvroute {
    replicas: Vec<Replica>,
    next: usize,
}

impl Kvroute {
    pub fn new(
        pods: usize,
        models: Arc<ServedModels>,
        config: SchedulerConfig,
        flow: FlowSettings,
        seed: u64,
    ) -> Self {
        Kvroute {
            replicas: vec![Replica::new(pods, models, config, flow, seed)],
            next: 0,
        }
    }

    /// Every pick scored in full and declined afterwards, casting no shadows
    /// ([`super::Setup::whole_picks`]).
    pub fn with_whole_picks(mut self) -> Self {
        for replica in &mut self.replicas {
            replica.whole_picks = true;
        }
        self
    }

    /// `n` replicas (at least one) instead of one, each configured as the first.
    pub fn with_replicas(mut self, n: usize) -> Self {
        let Some(first) = self.replicas.first() else {
            return self;
        };
        let block_tokens = first.events.as_ref().map(|e| e.block_tokens);
        let more: Vec<Replica> = (1..n.max(1))
            .map(|r| {
                let replica = Replica::new(
                    first.loads.len(),
                    Arc::clone(&first.models),
                    first.config.clone(),
                    first.room.settings.clone(),
                    first.rng.clone().random::<u64>() ^ r as u64,
                );
                match block_tokens {
                    Some(tokens) => replica.with_kv_events(tokens),
                    None => replica,
                }
            })
            .collect();
        self.replicas.extend(more);
        self
    }

    /// Each replica's prefix records are made by `chores` (the simulation's helper
    /// thread) while the loop goes on.
    pub fn lend_helper(&mut self, chores: &Chores) {
        for replica in &mut self.replicas {
            replica.prefix.lend_helper(chores.clone());
            replica.chores = chores.clone();
        }
    }

    /// Every replica matches prompts on the pods' KV events.
    pub fn with_kv_events(mut self, block_tokens: u32) -> Self {
        self.replicas = self
            .replicas
            .into_iter()
            .map(|r| r.with_kv_events(block_tokens))
            .collect();
        self
    }

    pub fn uses_kv_events(&self) -> bool {
        self.replicas.first().is_some_and(Replica::uses_kv_events)
    }

    /// Pod `pod`'s engine published `batch`: every replica follows it.
    pub fn kv_events(&mut self, pod: usize, batch: &EventBatch) {
        for replica in &mut self.replicas {
            replica.kv_events(pod, batch);
        }
    }

    /// The pods routed over.
    #[cfg(test)]
    pub fn pods(&self) -> usize {
        self.replicas.first().map_or(0, |r| r.loads.len())
    }

    /// Every replica scrapes every pod at `now`, reading `readings` (pod `i`'s page at
    /// that moment is `readings[i]`): each replica its own copy, the last the originals.
    pub fn scrape(
        &mut self,
        now: Duration,
        pages: Pages,
        publish_at: Duration,
        hand_over: &mut impl FnMut(Chore),
    ) {
        if let [replica] = &mut self.replicas[..] {
            return replica.scrape(now, pages, publish_at, hand_over);
        }
        // Replicas scrape the same pages: read them here, a copy each.
        let read = pages();
        for replica in &mut self.replicas {
            let copy: Pages = match &read {
                Ok(pages) => {
                    let pages = pages.clone();
                    Box::new(move || Ok(pages))
                }
                Err(e) => {
                    let e = format!("{e:#}");
                    Box::new(move || Err(anyhow::anyhow!(e)))
                }
            };
            replica.scrape(now, copy, publish_at, hand_over);
        }
    }

    /// Whether a scrape's pages may be read after the scrape, while the simulation goes
    /// on: not where KV events from the pods' steps feed the index as the steps end, nor
    /// where several replicas take copies of the pages at once.
    pub fn reads_pages_later(&self) -> bool {
        self.replicas.len() == 1 && !self.uses_kv_events()
    }

    /// Whether every replica's next publication is built, without waiting.
    pub fn publication_made(&mut self) -> bool {
        self.replicas.iter_mut().all(Replica::publication_made)
    }

    pub fn publish(&mut self, now: Duration) -> anyhow::Result<()> {
        for replica in &mut self.replicas {
            replica.publish(now)?;
        }
        Ok(())
    }

    /// What the replicas' ledgers still hold, summed (zero once every request ended).
    pub fn held(&self) -> u64 {
        self.replicas.iter().map(Replica::held).sum()
    }

    pub fn waiting(&self) -> usize {
        self.replicas.iter().map(Replica::waiting).sum()
    }

    /// Routes a request on the next replica in turn.
    pub fn route(
        &mut self,
        now: Duration,
        request: InferenceRequest,
        tokens: Option<Vec<u32>>,
        class: &FlowClass,
        slot: u32,
    ) -> Placement {
        let r = self.next % self.replicas.len().max(1);
        self.next = r + 1;
        let Some(replica) = self.replicas.get_mut(r) else {
            return Placement::Failed(PickError::NoEndpoints);
        };
        match replica.route(now, request, tokens, class, slot) {
            Placement::Routed(mut routed) => {
                routed.replica = r;
                Placement::Routed(routed)
            }
            Placement::Held { entry, deadline } => Placement::Held {
                entry: HeldEntry {
                    replica: r,
                    entry: entry.entry,
                },
                deadline,
            },
            other => other,
        }
    }

    pub fn leave(&mut self, held: HeldEntry) {
        if let Some(replica) = self.replicas.get_mut(held.replica) {
            replica.leave(held.entry);
        }
    }

    /// A request routed by `replica` for `tenant` ended.
    pub fn ended(&mut self, replica: usize, tenant: &str) {
        if let Some(replica) = self.replicas.get_mut(replica) {
            replica.ended(tenant);
        }
    }

    /// Each replica's dispatch pass at `now`.
    pub fn dispatch(&mut self, now: Duration) -> Pass {
        let mut pass = Pass::default();
        for (r, replica) in self.replicas.iter_mut().enumerate() {
            let mut one = replica.dispatch(now);
            for (_, routed) in &mut one.routed {
                routed.replica = r;
            }
            pass.expired.append(&mut one.expired);
            pass.routed.append(&mut one.routed);
        }
        pass
    }
}

/// `LivePicker::place`: match, pick; unless `hold` declines the decision, reserve and
/// record.
#[allow(clippy::too_many_arguments)]
fn place(
    prefix: &mut Remembered,
    events: Option<&EventIndex>,
    fleet: &Fleet,
    rng: &mut SmallRng,
    request: &InferenceRequest,
    blocks: &PromptBlocks,
    hold: Hold,
    config: &SchedulerConfig,
    shadows: Option<&mut Shadows>,
) -> Result<Placed, PickError> {
    let route = RouteRequest {
        inference: Some(request),
        subset: None,
    };
    let guessed = prefix.matches(&blocks.text, fleet.snapshot());
    let matches = match events {
        // Every simulated pod's events flow.
        Some(events) => matches_with_events(
            PrefixSource::Auto,
            &events.index,
            blocks.tokens.as_ref(),
            guessed,
            fleet.snapshot(),
            |_| true,
        ),
        None => guessed,
    };
    let picked = match shadows {
        Some(shadows) => hold.pick(&route, Some(&matches), fleet, config, rng, shadows)?,
        // Scored in full, then declined.
        None => match scheduler::pick(&route, Some(&matches), fleet, config, rng)? {
            decision if hold.declines(&decision.outlook()) => Picked::Declined(decision.outlook()),
            decision => Picked::Decided(decision),
        },
    };
    let decision = match picked {
        Picked::Decided(decision) => decision,
        Picked::Declined(_) => return Ok(Placed::NoRoom),
    };
    let pod = fleet
        .snapshot()
        .position(decision.endpoint)
        .ok_or(PickError::NoReadyEndpoint)?;
    let mut capacity = 0;
    let reservation = fleet.pod(decision.endpoint).map(|(pod, load)| {
        capacity = pod.signals().map_or(0, |s| s.kv_capacity_tokens);
        let tier = decision.ranked.first().and_then(|c| c.lora_tier);
        if tier.is_some() {
            load.note_adapter(adapter_key(&request.model));
        }
        let winner = decision.ranked.first();
        // What the scheduler credited: a copy of a context whose home is another pod is
        // reserved as if it held nothing (`PrefixMatches::homed`).
        let cached = winner.map_or(0, |c| c.cached_tokens);
        let prompt = u64::from(request.prompt_tokens).saturating_sub(cached);
        let tokens = winner.map_or(decision.tokens_needed, |c| {
            c.kv_tokens_needed(decision.tokens_needed)
        });
        // The shipped gateways show kvroute no response body: prefill ends at a scrape.
        load.reserve(tokens, prompt, PrefillEnd::NextScrape)
    });
    prefix.record(
        decision.endpoint,
        Arc::from(blocks.text.as_slice()),
        capacity,
    );
    Ok(Placed::Routed(Routed {
        pod,
        reservation,
        decision: Some(decision),
        tenant: None,
        replica: 0,
    }))
}

/// A routing policy with its state.
#[derive(Debug)]
pub enum Policy {
    Kvroute(Box<Kvroute>),
    RoundRobin { next: usize },
    LeastRequest { rng: SmallRng },
    CacheAware(Box<CacheAware>),
}

impl Policy {
    /// Has `chores` (the simulation's helper thread) do what the policy can hand over.
    pub fn lend_helper(&mut self, chores: &Chores) {
        if let Policy::Kvroute(k) = self {
            k.lend_helper(chores);
        }
    }

    /// Routes one request arriving at `now`; `inflight` is each pod's active requests
    /// (Envoy's `rq_active`), `request` builds kvroute's parsed request when needed (and,
    /// when asked, the prompt's engine tokens), `class` is its place in kvroute's flow
    /// control and `slot` the caller's name for it should kvroute hold it.
    pub fn route(
        &mut self,
        now: Duration,
        inflight: &[u32],
        class: &FlowClass,
        slot: u32,
        request: impl FnOnce(bool) -> (InferenceRequest, Option<Vec<u32>>),
    ) -> Placement {
        let pods = inflight.len();
        if pods == 0 {
            return Placement::Failed(PickError::NoEndpoints);
        }
        let pod = match self {
            Policy::Kvroute(k) => {
                let (request, tokens) = request(k.uses_kv_events());
                return k.route(now, request, tokens, class, slot);
            }
            Policy::CacheAware(c) => {
                let (request, tokens) = request(true);
                c.route(
                    inflight,
                    &request.model,
                    tokens.as_deref().unwrap_or_default(),
                )
            }
            Policy::RoundRobin { next } => {
                let pod = *next % pods;
                *next = (pod + 1) % pods;
                pod
            }
            Policy::LeastRequest { rng } => {
                let first = rng.random_range(0..pods);
                let second = rng.random_range(0..pods);
                if inflight[second] < inflight[first] {
                    second
                } else {
                    first
                }
            }
        };
        Placement::Routed(Routed {
            pod,
            reservation: None,
            decision: None,
            tenant: None,
            replica: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::flow::StandingQueue;

    #[test]
    fn endpoints_sort_as_the_pods() {
        let mut e: Vec<SocketAddr> = (0..1000).map(endpoint).collect();
        let before = e.clone();
        e.sort();
        assert_eq!(e, before);
    }

    #[test]
    fn least_request_prefers_the_less_busy_of_two_draws() {
        let mut p = Policy::LeastRequest {
            rng: SmallRng::seed_from_u64(1),
        };
        let inflight = [9, 0, 9, 9];
        let class = FlowClass {
            priority: 0,
            tenant: Arc::from(super::super::flow::DEFAULT_TENANT),
        };
        let picks: Vec<usize> = (0..200)
            .map(
                |_| match p.route(Duration::ZERO, &inflight, &class, 0, |_| unreachable!()) {
                    Placement::Routed(r) => r.pod,
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        let idle = picks.iter().filter(|&&p| p == 1).count();
        // P(pod 1 drawn at least once in two) = 7/16.
        assert!((60..120).contains(&idle), "{idle}");
    }

    // Flow control, on a fleet whose scrapes the test writes: one or two pods of 10,000 KV
    // tokens, requests of 8,000 (prompt + max_tokens), so a pod holds one at a time.

    const MODEL: &str = "m";
    const POD_TOKENS: u64 = 10_000;

    fn metrics(waiting: u32) -> PodMetrics {
        PodMetrics {
            waiting,
            running: 0,
            kv_usage: 0.0,
            kv_capacity_tokens: Some(POD_TOKENS),
            num_gpu_blocks: Some(POD_TOKENS / 16),
            block_size: Some(16),
            engines: 1,
            lora: None,
            preemptions_total: Some(0.0),
            prefix_cache_hits_total: Some(0.0),
            prefix_cache_queries_total: Some(0.0),
        }
    }

    /// kvroute over `pods` idle pods (a scrape published at time 0), holding requests at
    /// most `max_wait` (no standing bound, which has its own test).
    fn kvroute(pods: usize, max_wait: Duration) -> Kvroute {
        kvroute_with(
            pods,
            FlowSettings {
                max_wait,
                standing: None,
                ..FlowSettings::default()
            },
        )
    }

    fn kvroute_with(pods: usize, flow: FlowSettings) -> Kvroute {
        let mut k = Kvroute::new(
            pods,
            super::super::observe::served_models(MODEL, &[]),
            SchedulerConfig::default(),
            flow,
            7,
        );
        rescrape(&mut k, Duration::ZERO, 0);
        k
    }

    #[test]
    fn a_fleet_built_ahead_is_the_one_its_publication_would_build() {
        let replica = || {
            let models = super::super::observe::served_models(MODEL, &[]);
            let flow = FlowSettings::default();
            Replica::new(3, models, SchedulerConfig::default(), flow, 7)
        };
        // Built at the scrape, by whoever `hand_over` hands it to; and, for a replica whose
        // scrapes are planned for another moment than they are published at, built at the
        // publication from the replica's own record of the readings.
        let (mut ahead, mut at_publication) = (replica(), replica());
        let delay = Duration::from_millis(50);
        let elsewhen = delay + Duration::from_nanos(1);
        for (n, waiting) in [(0u32, 0), (1, 3), (2, 1)] {
            let now = delay * n;
            let pages = move || -> Pages {
                Box::new(move || Ok((0..3).map(|i| Arc::new(metrics(waiting + i))).collect()))
            };
            ahead.scrape(now, pages(), now + delay, &mut |c| c());
            let mut lost = |chore: Chore| drop(chore);
            at_publication.scrape(now, pages(), now + elsewhen, &mut lost);
            ahead.publish(now + delay).expect("published");
            at_publication.publish(now + delay).expect("published");
            let (built, wanted) = (ahead.fleet.snapshot(), at_publication.fleet.snapshot());
            assert_eq!(built, wanted);
            assert_eq!(built.generation, u64::from(n) + 1);
            let pod = &built.pods()[2];
            assert_eq!(
                (pod.metrics_age, pod.metrics().map(|m| m.waiting)),
                (Some(delay), Some(waiting + 2))
            );
        }
        // Published at another moment than planned: built then, with the ages then.
        let pages: Pages = Box::new(|| Ok((0..3).map(|_| Arc::new(metrics(0))).collect()));
        ahead.scrape(delay * 3, pages, delay * 4, &mut |c| c());
        ahead.publish(delay * 5).expect("published");
        assert_eq!(
            ahead.fleet.snapshot().pods()[0].metrics_age,
            Some(delay * 2)
        );
    }

    /// A scrape at `now`, published at once, every pod reporting `waiting` queued requests.
    fn rescrape(k: &mut Kvroute, now: Duration, waiting: u32) {
        let pods = k.pods();
        let pages = (0..pods).map(|_| Arc::new(metrics(waiting))).collect();
        k.scrape(now, Box::new(move || Ok(pages)), now, &mut |chore| chore());
        k.publish(now).expect("published");
    }

    fn request(tokens: u32) -> InferenceRequest {
        InferenceRequest {
            model: MODEL.into(),
            prompt_tokens: tokens / 2,
            max_output_tokens: Some(tokens / 2),
            stream: true,
            prompt_prefix: Vec::new(),
            prefix_context: 0,
        }
    }

    fn class(priority: i32) -> FlowClass {
        FlowClass {
            priority,
            tenant: Arc::from(super::super::flow::DEFAULT_TENANT),
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn routed(placement: Placement) -> Routed {
        match placement {
            Placement::Routed(r) => r,
            other => panic!("not routed: {other:?}"),
        }
    }

    fn is_held(placement: &Placement) -> bool {
        matches!(placement, Placement::Held { .. })
    }

    /// Ends a routed request as the simulation does: its reservation goes, its tenant's
    /// share ends.
    /// The slots a dispatch pass routed, in its order.
    fn routed_slots(pass: &Pass) -> Vec<u32> {
        pass.routed.iter().map(|(slot, _)| *slot).collect()
    }

    fn end(k: &mut Kvroute, r: Routed) {
        let tenant = r.tenant.clone().expect("kvroute counts a tenant");
        let replica = r.replica;
        drop(r);
        k.ended(replica, &tenant);
    }

    #[test]
    fn a_request_no_pod_has_the_kv_for_waits_and_is_routed_when_a_request_ends() {
        let mut k = kvroute(1, secs(15));
        let first = routed(k.route(secs(0), request(8_000), None, &class(0), 0));
        let second = k.route(secs(1), request(8_000), None, &class(0), 1);
        assert!(is_held(&second), "{second:?}");
        assert_eq!(k.waiting(), 1);
        // A scrape changes nothing: the first request still holds the pod's KV.
        rescrape(&mut k, secs(2), 0);
        let pass = k.dispatch(secs(2));
        assert!(pass.routed.is_empty() && pass.expired.is_empty());
        end(&mut k, first);
        let pass = k.dispatch(secs(3));
        assert_eq!(routed_slots(&pass), [1]);
        assert_eq!(k.waiting(), 0);
        // A newcomer behind a waiting request of its priority queues even when it fits.
        let big = k.route(secs(4), request(8_000), None, &class(0), 2);
        assert!(is_held(&big));
        let small = k.route(secs(4), request(1_000), None, &class(0), 3);
        assert!(is_held(&small), "{small:?}");
    }

    #[test]
    fn a_sheddable_request_is_shed_when_every_pod_is_saturated() {
        let mut k = kvroute(2, secs(15));
        // Every pod's queue at the saturation threshold; both have the KV.
        rescrape(&mut k, secs(1), 5);
        let shed = k.route(secs(1), request(1_000), None, &class(-10), 0);
        assert!(
            matches!(shed, Placement::Shed(DropReason::Saturated)),
            "{shed:?}"
        );
        // A request that is not sheddable goes to a pod with the KV, saturated or not.
        routed(k.route(secs(1), request(1_000), None, &class(0), 1));
        // Not saturated: the sheddable request is placed.
        rescrape(&mut k, secs(2), 0);
        routed(k.route(secs(2), request(1_000), None, &class(-10), 2));
        assert_eq!(k.waiting(), 0, "a sheddable request never waits");
    }

    #[test]
    fn a_wait_that_runs_out_is_shed_as_ttl_expired() {
        let mut k = kvroute(1, secs(15));
        let _first = routed(k.route(secs(0), request(8_000), None, &class(0), 0));
        assert!(is_held(&k.route(
            secs(1),
            request(8_000),
            None,
            &class(0),
            1
        )));
        rescrape(&mut k, secs(15), 0);
        let pass = k.dispatch(secs(15));
        assert!(pass.expired.is_empty(), "15 s after 1 s: not yet");
        let pass = k.dispatch(secs(16));
        assert_eq!(pass.expired, [(1, DropReason::TtlExpired)]);
        assert!(pass.routed.is_empty());
        assert_eq!(k.waiting(), 0);
    }

    #[test]
    fn a_queue_that_does_not_empty_sheds_at_the_standing_wait() {
        let mut k = kvroute_with(
            1,
            FlowSettings {
                max_wait: secs(15),
                standing: Some(StandingQueue {
                    after: secs(5),
                    wait: secs(2),
                }),
                ..FlowSettings::default()
            },
        );
        let _first = routed(k.route(secs(0), request(8_000), None, &class(0), 0));
        for (slot, at) in [(1, 1), (2, 5)] {
            assert!(is_held(&k.route(
                secs(at),
                request(8_000),
                None,
                &class(0),
                slot
            )));
        }
        rescrape(&mut k, secs(5), 0);
        let pass = k.dispatch(secs(5));
        assert!(
            pass.expired.is_empty(),
            "the queue stands from 6 s (busy since 1 s)"
        );
        let pass = k.dispatch(secs(6));
        assert_eq!(pass.expired, [(1, DropReason::TtlExpired)], "waited 5 s");
        let pass = k.dispatch(Duration::from_millis(6_500));
        assert!(pass.expired.is_empty(), "the second has waited 1.5 s");
        let pass = k.dispatch(secs(7));
        assert_eq!(pass.expired, [(2, DropReason::TtlExpired)], "waited 2 s");
        assert_eq!(k.waiting(), 0);
    }

    #[test]
    fn replicas_take_requests_in_turn_and_each_sees_only_its_own_in_flight() {
        let mut k = kvroute(1, secs(15)).with_replicas(2);
        rescrape(&mut k, Duration::ZERO, 0);
        // One pod whose KV holds one 8,000-token request at a time: each replica places
        // one, not knowing of the other's (the double booking replicas risk).
        let first = routed(k.route(secs(0), request(8_000), None, &class(0), 0));
        let second = routed(k.route(secs(0), request(8_000), None, &class(0), 1));
        assert_eq!((first.replica, second.replica), (0, 1));
        // The third goes to replica 0 again, which has the first in flight: it waits there.
        let Placement::Held { entry, .. } = k.route(secs(1), request(8_000), None, &class(0), 2)
        else {
            panic!("the first replica's pod is full");
        };
        assert_eq!(entry.replica, 0);
        assert_eq!(k.waiting(), 1);
        // The second's end frees nothing for replica 0; the first's does.
        end(&mut k, second);
        assert!(k.dispatch(secs(2)).routed.is_empty());
        end(&mut k, first);
        let pass = k.dispatch(secs(3));
        assert_eq!(routed_slots(&pass), [2]);
        assert_eq!(pass.routed[0].1.replica, 0);
    }

    #[test]
    fn a_higher_priority_leaves_first() {
        let mut k = kvroute(1, secs(15));
        let first = routed(k.route(secs(0), request(8_000), None, &class(0), 0));
        assert!(is_held(&k.route(
            secs(1),
            request(8_000),
            None,
            &class(0),
            1
        )));
        // Higher than anything waiting: not behind the earlier request.
        assert!(is_held(&k.route(
            secs(2),
            request(8_000),
            None,
            &class(100),
            2
        )));
        end(&mut k, first);
        let pass = k.dispatch(secs(3));
        assert_eq!(
            routed_slots(&pass),
            [2],
            "the pod has room for one: the critical one"
        );
        assert_eq!(k.waiting(), 1);
    }

    #[test]
    fn with_no_queue_nothing_is_held() {
        let mut k = kvroute(1, Duration::ZERO);
        let _first = routed(k.route(secs(0), request(8_000), None, &class(0), 0));
        // No pod has the KV: placed anyway, on the least bad pod.
        let second = routed(k.route(secs(1), request(8_000), None, &class(0), 1));
        assert!(second.decision.expect("kvroute decides").lacks_room());
        // Sheddable requests are still refused.
        let shed = k.route(secs(1), request(8_000), None, &class(-1), 2);
        assert!(matches!(shed, Placement::Shed(DropReason::Saturated)));
        assert_eq!(k.waiting(), 0);
    }
}
