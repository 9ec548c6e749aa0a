//! The live router: runs the pure scheduler over the current snapshot, reserves the
//! chosen pod's in-flight accounting, and records what happened (metrics, debug log,
//! the live decision tap that the admin API's watchers subscribe to).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::broadcast;
use tracing::debug;

use crate::extproc::{RouteError, RouteRequest, Routed, Router};
use crate::scheduler::{self, Decision, PickRequest, SchedulerConfig};
use crate::state::{PodStore, PrefixIndex, Snapshot, block_hashes};
use crate::telemetry::{self, ModelLabels};

/// The router kvroute serves with.
pub struct LivePicker {
    store: Arc<PodStore>,
    config: SchedulerConfig,
    /// Serialises pick + reserve, so two concurrent requests cannot both see the same
    /// free KV and herd onto one pod. A pick takes microseconds.
    placement: Mutex<Placement>,
    decisions: DecisionLog,
    /// Each decision, for live watchers; built only while someone is subscribed.
    tap: broadcast::Sender<Arc<DecisionRecord>>,
}

/// What placing a request reads and updates besides the pods' counters.
#[derive(Debug, Default)]
struct Placement {
    /// The prompt blocks sent to each pod, for prefix-cache affinity.
    prefix: PrefixIndex,
    /// The snapshot's endpoint set `prefix` was last pruned to.
    endpoints_version: u64,
}

/// Decisions a watcher may fall behind by before it starts missing some.
const TAP_CAPACITY: usize = 4096;

impl LivePicker {
    pub fn new(store: Arc<PodStore>, config: SchedulerConfig, keep_decisions: usize) -> Self {
        LivePicker {
            store,
            config,
            placement: Mutex::new(Placement::default()),
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
    fn record(&self, request: &PickRequest<'_>, outcome: Result<Decision, String>) {
        let watched = self.tap.receiver_count() > 0;
        if !watched && !self.decisions.enabled() {
            return;
        }
        let record = Arc::new(DecisionRecord::new(request, outcome));
        if watched {
            // Fails only when the last watcher left in between: nothing to do.
            let _ = self.tap.send(Arc::clone(&record));
        }
        self.decisions.push(record);
    }

    /// The recent decisions kept for `/debug/decisions` (empty when switched off).
    pub fn decisions(&self) -> &DecisionLog {
        &self.decisions
    }
}

impl Router for LivePicker {
    fn route(&self, request: &RouteRequest<'_>) -> Result<Routed, RouteError> {
        let snapshot = self.store.snapshot();
        let inference = request.inference;
        let pick_request = PickRequest {
            model: inference.map(|r| r.model.as_str()),
            prompt_tokens: inference.map_or(0, |r| r.prompt_tokens),
            max_output_tokens: inference.and_then(|r| r.max_output_tokens),
            subset: request.subset,
            prefix: None,
        };
        // Hashing is the costly part of prefix matching, so it happens before the lock.
        let blocks = inference.map_or_else(Vec::new, |r| block_hashes(&r.model, &r.prompt_prefix));
        let labels = model_labels(pick_request.model, &snapshot, &self.config);
        let started = Instant::now();
        let placed = {
            let mut placement = self.placement.lock().unwrap_or_else(|p| p.into_inner());
            if placement.endpoints_version != snapshot.endpoints_version {
                let endpoints: Vec<_> = snapshot.pods.iter().map(|pod| pod.endpoint).collect();
                placement.prefix.retain_pods(&endpoints);
                placement.endpoints_version = snapshot.endpoints_version;
            }
            let matches = placement.prefix.matches(&blocks);
            let pick_request = PickRequest {
                prefix: Some(&matches),
                ..pick_request.clone()
            };
            scheduler::pick(&pick_request, &snapshot, &self.config, &mut rand::rng()).map(
                |decision| {
                    let pod = snapshot.pod(decision.endpoint);
                    let reservation = pod.map(|pod| {
                        let prompt = u64::from(pick_request.prompt_tokens);
                        pod.load.reserve(decision.tokens_needed, prompt)
                    });
                    if let Some(pod) = pod {
                        let capacity = pod.signals().map_or(0, |s| s.kv_capacity_tokens);
                        placement.prefix.record(pod.endpoint, &blocks, capacity);
                    }
                    // An adapter request (it has a LoRA tier): the pod now holds the adapter.
                    if let (Some(pod), Some(model), Some(_)) = (
                        pod,
                        pick_request.model,
                        decision.ranked.first().and_then(|c| c.lora_tier),
                    ) {
                        pod.load.note_adapter(crate::state::adapter_key(model));
                    }
                    (decision, reservation)
                },
            )
        };
        let elapsed = started.elapsed();
        match placed {
            Ok((decision, reservation)) => {
                telemetry::record_pick(elapsed, decision.reason.as_str());
                debug!(
                    endpoint = %decision.endpoint,
                    reason = decision.reason.as_str(),
                    candidates = decision.candidates,
                    tokens = decision.tokens_needed,
                    "routed"
                );
                let endpoints = std::iter::once(decision.endpoint)
                    .chain(decision.fallbacks.iter().copied())
                    .collect();
                self.record(&pick_request, Ok(decision));
                Ok(Routed {
                    endpoints,
                    labels,
                    reservation,
                })
            }
            Err(error) => {
                debug!(%error, "not routed");
                self.record(&pick_request, Err(error.to_string()));
                Err(RouteError { error, labels })
            }
        }
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
    if let Some(base) = config.adapters.get(model) {
        return ModelLabels {
            model: base.clone(),
            adapter: model.to_owned(),
        };
    }
    for pod in &snapshot.pods {
        let Some(models) = pod.models.as_ref() else {
            continue;
        };
        if let Some(base) = models.adapters.get(model) {
            return ModelLabels {
                model: base.clone(),
                adapter: model.to_owned(),
            };
        }
        if models.base.iter().any(|b| b == model) {
            return ModelLabels {
                model: model.to_owned(),
                adapter: String::new(),
            };
        }
    }
    ModelLabels::other()
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
    fn new(request: &PickRequest<'_>, outcome: Result<Decision, String>) -> Self {
        let (decision, error) = match outcome {
            Ok(decision) => (Some(decision), None),
            Err(error) => (None, Some(error)),
        };
        DecisionRecord {
            unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis()),
            model: request.model.map(str::to_owned),
            prompt_tokens: request.prompt_tokens,
            max_output_tokens: request.max_output_tokens,
            decision,
            error,
        }
    }
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
mod tests {
    use super::*;
    use crate::state::HealthPolicy;

    fn picker(keep_decisions: usize) -> LivePicker {
        let store = Arc::new(PodStore::new(HealthPolicy::default()));
        LivePicker::new(store, SchedulerConfig::default(), keep_decisions)
    }

    fn route_unplaceable(picker: &LivePicker) {
        let request = RouteRequest {
            inference: None,
            subset: None,
        };
        assert!(picker.route(&request).is_err(), "no pods: not routed");
    }

    #[test]
    fn a_watcher_sees_each_decision_even_with_the_debug_log_off() {
        let picker = picker(0);
        route_unplaceable(&picker);
        let mut watcher = picker.watch();
        route_unplaceable(&picker);
        let record = watcher.try_recv().expect("the decision after subscribing");
        assert_eq!(record.error.as_deref(), Some("no endpoints are known"));
        assert!(
            watcher.try_recv().is_err(),
            "nothing from before subscribing"
        );
        assert!(picker.decisions().recent().is_empty());
    }

    #[test]
    fn the_debug_log_keeps_the_last_decisions_without_watchers() {
        let picker = picker(2);
        for _ in 0..3 {
            route_unplaceable(&picker);
        }
        assert_eq!(picker.decisions().recent().len(), 2);
    }
}
