//! kvroute's own gRPC admin API (`proto/kvroute/admin/v1/admin.proto`): a live tap on
//! routing decisions and the current endpoint snapshot, for `kvroute tap` and
//! `kvroute endpoints`. Served on `--admin-addr`, loopback by default.
//!
//! The picker publishes each decision on a broadcast channel, and only builds it while
//! someone watches; a watcher that falls behind is told how many it missed, and routing
//! never waits for it.

pub mod tap;

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use tonic::{Request, Response, Status};
use tracing::debug;

use kvroute_core::fleet::{Fleet, PodLoad, PodView};
use kvroute_core::scheduler::{CandidateScore, Decision, LoraTier};

use crate::picker::{DecisionRecord, LivePicker};
use crate::shutdown::Phase;
use crate::store::PodStore;

/// The generated messages, client and server of `kvroute.admin.v1`.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("kvroute.admin.v1");
}

use pb::admin_server::{Admin, AdminServer};

/// The admin service over the live picker and the pod store.
pub struct AdminService {
    picker: Arc<LivePicker>,
    store: Arc<PodStore>,
    /// Fires on shutdown: open watch streams end.
    stop: Phase,
}

impl AdminService {
    pub fn new(picker: Arc<LivePicker>, store: Arc<PodStore>, stop: Phase) -> Self {
        AdminService {
            picker,
            store,
            stop,
        }
    }

    pub fn into_server(self) -> AdminServer<Self> {
        AdminServer::new(self)
    }
}

type DecisionStream = Pin<Box<dyn Stream<Item = Result<pb::DecisionEvent, Status>> + Send>>;

/// What one watcher asked to see.
struct Filter {
    model: Option<String>,
}

impl Filter {
    fn admits(&self, record: &DecisionRecord) -> bool {
        self.model
            .as_deref()
            .is_none_or(|model| record.model.as_deref() == Some(model))
    }
}

struct Watcher {
    decisions: broadcast::Receiver<Arc<DecisionRecord>>,
    stop: Phase,
    filter: Filter,
}

impl Watcher {
    /// The next event for this watcher, or `None` when the stream should end.
    async fn next(&mut self) -> Option<pb::DecisionEvent> {
        loop {
            let received = tokio::select! {
                received = self.decisions.recv() => received,
                () = self.stop.fired() => return None,
            };
            match received {
                Ok(record) if self.filter.admits(&record) => return Some(event(&record)),
                Ok(_) => {}
                Err(RecvError::Lagged(count)) => {
                    debug!(missed = count, "a decision watcher fell behind");
                    return Some(missed(count));
                }
                Err(RecvError::Closed) => return None,
            }
        }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    type WatchDecisionsStream = DecisionStream;

    async fn watch_decisions(
        &self,
        request: Request<pb::WatchDecisionsRequest>,
    ) -> Result<Response<DecisionStream>, Status> {
        let request = request.into_inner();
        let watcher = Watcher {
            decisions: self.picker.watch(),
            stop: self.stop.clone(),
            filter: Filter {
                model: Some(request.model).filter(|model| !model.is_empty()),
            },
        };
        let events = futures::stream::unfold(watcher, |mut watcher| async move {
            let event = watcher.next().await?;
            Some((Ok(event), watcher))
        });
        Ok(Response::new(Box::pin(events)))
    }

    async fn list_endpoints(
        &self,
        _request: Request<pb::ListEndpointsRequest>,
    ) -> Result<Response<pb::ListEndpointsResponse>, Status> {
        Ok(Response::new(endpoints(&self.store.fleet())))
    }
}

/// The wire form of one decision.
pub fn event(record: &DecisionRecord) -> pb::DecisionEvent {
    let outcome = match (&record.decision, &record.error, record.held) {
        (Some(decision), _, _) => {
            let mut routed = routed(decision);
            routed.prefix_source = record.prefix_source.map_or("", |p| p.as_str()).to_owned();
            Some(pb::decision_event::Outcome::Routed(routed))
        }
        (None, Some(error), _) => Some(pb::decision_event::Outcome::Error(error.clone())),
        (None, None, Some(priority)) => {
            Some(pb::decision_event::Outcome::Held(pb::Held { priority }))
        }
        (None, None, None) => None,
    };
    pb::DecisionEvent {
        unix_ms: u64::try_from(record.unix_ms).unwrap_or(u64::MAX),
        model: record.model.clone(),
        prompt_tokens: record.prompt_tokens,
        max_output_tokens: record.max_output_tokens,
        outcome,
        queued_ms: record.queued_ms,
    }
}

fn missed(count: u64) -> pb::DecisionEvent {
    pb::DecisionEvent {
        unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        outcome: Some(pb::decision_event::Outcome::Missed(pb::Missed { count })),
        ..Default::default()
    }
}

fn routed(decision: &Decision) -> pb::Routed {
    pb::Routed {
        endpoint: decision.endpoint.to_string(),
        fallbacks: decision.fallbacks.iter().map(ToString::to_string).collect(),
        reason: decision.reason.as_str().to_owned(),
        relaxed: Some(pb::Relaxed {
            saturation: decision.relaxed.saturation,
            kv_headroom: decision.relaxed.kv_headroom,
        }),
        tokens_needed: decision.tokens_needed,
        candidates: u32::try_from(decision.candidates).unwrap_or(u32::MAX),
        ranked: decision.ranked.iter().map(candidate).collect(),
        prefix_source: String::new(),
    }
}

fn candidate(score: &CandidateScore) -> pb::CandidateScore {
    pb::CandidateScore {
        endpoint: score.endpoint.to_string(),
        total: score.total,
        kv_headroom: score.kv_headroom,
        queue: score.queue,
        inflight: score.inflight,
        lora: score.lora,
        lora_tier: score
            .lora_tier
            .map(LoraTier::name)
            .unwrap_or_default()
            .to_owned(),
        free_kv_tokens: score.free_kv_tokens,
        prefix: score.prefix,
        prefill_queue: score.prefill_queue,
        cached_tokens: score.cached_tokens,
        held_tokens: score.held_tokens,
        weighted: Some(pb::WeightedTerms {
            kv_headroom: score.weighted.kv_headroom,
            queue: score.weighted.queue,
            inflight: score.weighted.inflight,
            lora: score.weighted.lora,
            prefix: score.weighted.prefix,
            prefill_queue: score.weighted.prefill_queue,
        }),
    }
}

/// The wire form of the fleet: served by `ListEndpoints` and, as JSON, by
/// `/debug/endpoints`.
pub fn endpoints(fleet: &Fleet) -> pb::ListEndpointsResponse {
    pb::ListEndpointsResponse {
        generation: fleet.snapshot().generation,
        endpoints: fleet
            .pods()
            .map(|(pod, load)| endpoint(pod, load))
            .collect(),
    }
}

fn endpoint(pod: &PodView, load: &PodLoad) -> pb::Endpoint {
    let metrics = pod.metrics().map(|m| pb::PodMetrics {
        waiting: m.waiting,
        running: m.running,
        kv_usage: m.kv_usage,
        kv_capacity_tokens: m.kv_capacity_tokens,
        lora: m.lora.as_ref().map(|l| pb::LoraStatus {
            max_lora: l.max_lora,
            running: l.running.clone(),
            waiting: l.waiting.clone(),
        }),
    });
    let (models, adapters) = match pod.models.as_deref() {
        Some(models) => (
            models.base.clone(),
            models
                .adapters
                .iter()
                .map(|(adapter, base)| (adapter.clone(), base.clone()))
                .collect(),
        ),
        None => Default::default(),
    };
    pb::Endpoint {
        endpoint: pod.endpoint.to_string(),
        healthy: pod.healthy,
        metrics_age_seconds: pod.metrics_age.map(|age| age.as_secs_f64()),
        metrics,
        models,
        adapters,
        inflight: load.inflight(),
        unscraped_tokens: load.unscraped_tokens(),
        committed_tokens: load.committed_tokens(),
        prefill_tokens: load.prefill_tokens(),
        growth_tokens: load.growth_tokens(),
    }
}

#[cfg(test)]
mod tests;
