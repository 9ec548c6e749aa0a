//! The live router: runs the pure scheduler over the current snapshot, reserves the
//! chosen pod's in-flight accounting, and records what happened (metrics, debug log).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tracing::debug;

use crate::extproc::{RouteError, RouteRequest, Routed, Router};
use crate::scheduler::{self, Decision, PickRequest, SchedulerConfig};
use crate::state::{PodStore, Snapshot};
use crate::telemetry::{self, ModelLabels};

/// The router kvroute serves with.
pub struct LivePicker {
    store: Arc<PodStore>,
    config: SchedulerConfig,
    /// Serialises pick + reserve, so two concurrent requests cannot both see the same
    /// free KV and herd onto one pod. A pick takes microseconds.
    placement: Mutex<()>,
    decisions: DecisionLog,
}

impl LivePicker {
    pub fn new(store: Arc<PodStore>, config: SchedulerConfig, keep_decisions: usize) -> Self {
        LivePicker {
            store,
            config,
            placement: Mutex::new(()),
            decisions: DecisionLog::new(keep_decisions),
        }
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
        };
        let labels = model_labels(pick_request.model, &snapshot, &self.config);
        let started = Instant::now();
        let placed = {
            let _placement = self.placement.lock().unwrap_or_else(|p| p.into_inner());
            scheduler::pick(&pick_request, &snapshot, &self.config, &mut rand::rng()).map(
                |decision| {
                    let reservation = snapshot
                        .pod(decision.endpoint)
                        .map(|pod| pod.load.reserve(decision.tokens_needed));
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
                self.decisions.push(&pick_request, Ok(decision));
                Ok(Routed {
                    endpoints,
                    labels,
                    reservation,
                })
            }
            Err(error) => {
                debug!(%error, "not routed");
                self.decisions.push(&pick_request, Err(error.to_string()));
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

/// The last N decisions with their candidates' scores, for operators.
#[derive(Debug)]
pub struct DecisionLog {
    capacity: usize,
    entries: Mutex<VecDeque<DecisionRecord>>,
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

    fn push(&self, request: &PickRequest<'_>, outcome: Result<Decision, String>) {
        if self.capacity == 0 {
            return;
        }
        let (decision, error) = match outcome {
            Ok(decision) => (Some(decision), None),
            Err(error) => (None, Some(error)),
        };
        let record = DecisionRecord {
            unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis()),
            model: request.model.map(str::to_owned),
            prompt_tokens: request.prompt_tokens,
            max_output_tokens: request.max_output_tokens,
            decision,
            error,
        };
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() == self.capacity {
            entries.pop_front();
        }
        entries.push_back(record);
    }

    /// The kept decisions, newest last.
    pub fn recent(&self) -> Vec<DecisionRecord> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.iter().cloned().collect()
    }
}
