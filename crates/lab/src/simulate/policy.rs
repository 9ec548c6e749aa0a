//! The routing policies a simulation compares, each seeing what it would see live.
//!
//! - [`Policy::Kvroute`]: the real core. For each request, as the gateway's
//!   `LivePicker::place` (src/picker.rs) does it: hash the prompt's prefix blocks, match
//!   them in a [`PrefixIndex`], `scheduler::pick` over the last published [`Fleet`],
//!   reserve the winner's [`PodLoad`] (noting the adapter for a LoRA pick), record the
//!   blocks for the winner. The reservation is held until the response ends. The pods'
//!   metrics come from scrapes: every `interval` each pod's ledger starts a scrape
//!   ([`PodLoad::scrape_started`]) and its engine state is read; `delay` later the readings
//!   are published as the gateway's store does it (`PodStore::publish`: the ledger absorbs
//!   the scrape, a new `Fleet` is built with the metrics' ages). Prefill ends at the next
//!   scrape, as with the shipped gateways, which keep response bodies away from kvroute.
//! - [`Policy::RoundRobin`]: Envoy's `ROUND_ROBIN` over equal hosts.
//! - [`Policy::LeastRequest`]: Envoy's `LEAST_REQUEST` over equal hosts: two hosts drawn at
//!   random (with replacement), the one with fewer active requests, the first on a tie.

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
use kvroute_core::request::{InferenceRequest, RouteRequest};
use kvroute_core::scheduler::{self, Decision, PickError, SchedulerConfig};

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
}

/// One scrape of the fleet in flight: when it started, and per pod what it read with the
/// ledger's ticket.
type PendingScrape = (Duration, Vec<(Arc<PodMetrics>, ScrapeTicket)>);

/// kvroute's picker and store, in virtual time.
#[derive(Debug)]
pub struct Kvroute {
    config: SchedulerConfig,
    prefix: PrefixIndex,
    rng: SmallRng,
    loads: Vec<Arc<PodLoad>>,
    models: Arc<ServedModels>,
    /// Each pod's last published scrape and when it started.
    metrics: Vec<Option<(Arc<PodMetrics>, Duration)>>,
    /// Scrapes started, not yet published: (started at, per pod: metrics and ticket).
    pending: VecDeque<PendingScrape>,
    fleet: Fleet,
    generation: u64,
}

impl Kvroute {
    pub fn new(pods: usize, models: Arc<ServedModels>, config: SchedulerConfig, seed: u64) -> Self {
        Kvroute {
            config,
            prefix: PrefixIndex::with_budget(DEFAULT_PREFIX_BUDGET_BYTES),
            rng: SmallRng::seed_from_u64(seed),
            loads: (0..pods).map(|_| Arc::new(PodLoad::default())).collect(),
            models,
            metrics: vec![None; pods],
            pending: VecDeque::new(),
            fleet: Fleet::default(),
            generation: 0,
        }
    }

    /// A scrape of every pod starts at `now`; `read(i)` is pod `i`'s page at that moment.
    pub fn scrape(&mut self, now: Duration, mut read: impl FnMut(usize) -> PodMetrics) {
        let readings = self
            .loads
            .iter()
            .enumerate()
            .map(|(i, load)| {
                let ticket = load.scrape_started();
                (Arc::new(read(i)), ticket)
            })
            .collect();
        self.pending.push_back((now, readings));
    }

    /// The oldest pending scrape has answered: publish it (`PodStore::record_scrape` then
    /// `PodStore::publish`).
    pub fn publish(&mut self, now: Duration) {
        if let Some((started, readings)) = self.pending.pop_front() {
            for ((slot, load), (metrics, ticket)) in
                self.metrics.iter_mut().zip(&self.loads).zip(readings)
            {
                *slot = Some((metrics, started));
                load.scrape_succeeded(ticket);
            }
        }
        self.generation += 1;
        let pods = self
            .metrics
            .iter()
            .zip(&self.loads)
            .enumerate()
            .map(|(i, (m, load))| {
                let view = PodView::new(
                    endpoint(i),
                    m.is_some(),
                    m.as_ref().map(|(m, _)| Arc::clone(m)),
                    m.as_ref().map(|(_, at)| now.saturating_sub(*at)),
                    Some(Arc::clone(&self.models)),
                );
                (view, Arc::clone(load))
            })
            .collect();
        self.fleet = Fleet::new(pods, self.generation, 1);
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

    /// `LivePicker::place`: match, pick, reserve, record.
    pub fn route(&mut self, request: &InferenceRequest) -> Result<Routed, PickError> {
        let blocks = block_hashes(
            &request.model,
            request.prefix_context,
            &request.prompt_prefix,
        );
        let route = RouteRequest {
            inference: Some(request),
            subset: None,
        };
        let matches = self.prefix.matches(&blocks, self.fleet.snapshot());
        let decision = scheduler::pick(
            &route,
            Some(&matches),
            &self.fleet,
            &self.config,
            &mut self.rng,
        )?;
        let mut capacity = 0;
        let reservation = self.fleet.pod(decision.endpoint).map(|(pod, load)| {
            capacity = pod.signals().map_or(0, |s| s.kv_capacity_tokens);
            let tier = decision.ranked.first().and_then(|c| c.lora_tier);
            if tier.is_some() {
                load.note_adapter(adapter_key(&request.model));
            }
            let winner = decision.ranked.first();
            let cached = winner.map_or(0, |c| c.cached_tokens);
            let prompt = u64::from(request.prompt_tokens).saturating_sub(cached);
            let tokens = winner.map_or(decision.tokens_needed, |c| {
                c.kv_tokens_needed(decision.tokens_needed)
            });
            // The shipped gateways show kvroute no response body: prefill ends at a scrape.
            load.reserve(tokens, prompt, PrefillEnd::NextScrape)
        });
        self.prefix.record(decision.endpoint, &blocks, capacity);
        let pod = self
            .fleet
            .snapshot()
            .position(decision.endpoint)
            .ok_or(PickError::NoReadyEndpoint)?;
        Ok(Routed {
            pod,
            reservation,
            decision: Some(decision),
        })
    }
}

/// A routing policy with its state.
#[derive(Debug)]
pub enum Policy {
    Kvroute(Box<Kvroute>),
    RoundRobin { next: usize },
    LeastRequest { rng: SmallRng },
}

impl Policy {
    /// Routes one request; `inflight` is each pod's active requests (Envoy's `rq_active`),
    /// `request` builds kvroute's parsed request when needed.
    pub fn route(
        &mut self,
        inflight: &[u32],
        request: impl FnOnce() -> InferenceRequest,
    ) -> Result<Routed, PickError> {
        let pods = inflight.len();
        if pods == 0 {
            return Err(PickError::NoEndpoints);
        }
        match self {
            Policy::Kvroute(k) => k.route(&request()),
            Policy::RoundRobin { next } => {
                let pod = *next % pods;
                *next = (pod + 1) % pods;
                Ok(Routed {
                    pod,
                    reservation: None,
                    decision: None,
                })
            }
            Policy::LeastRequest { rng } => {
                let first = rng.random_range(0..pods);
                let second = rng.random_range(0..pods);
                let pod = if inflight[second] < inflight[first] {
                    second
                } else {
                    first
                };
                Ok(Routed {
                    pod,
                    reservation: None,
                    decision: None,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let picks: Vec<usize> = (0..200)
            .map(|_| p.route(&inflight, || unreachable!()).expect("pods").pod)
            .collect();
        let idle = picks.iter().filter(|&&p| p == 1).count();
        // P(pod 1 drawn at least once in two) = 7/16.
        assert!((60..120).contains(&idle), "{idle}");
    }
}
