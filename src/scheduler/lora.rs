//! LoRA adapter affinity: which pods can serve an adapter and how cheaply.
//!
//! vLLM reports, in `vllm:lora_requests_info`, the adapters of its running and waiting
//! requests and `max_lora`, the number of adapters a batch may hold. A pod already
//! running the adapter serves it with no load; a pod with a free slot pays one load; a
//! pod where the adapter is queued will load it soon; a pod with all slots busy must
//! first finish or evict another adapter's requests.

use crate::state::{PodView, Snapshot};

use super::SchedulerConfig;

/// How cheaply a pod can serve a given adapter, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraTier {
    /// The adapter is in the pod's running batch.
    Active,
    /// The pod has a free adapter slot.
    FreeSlot,
    /// The pod reports no LoRA state (fresh pod or LoRA metrics missing).
    Unknown,
    /// Requests for the adapter already wait on the pod.
    Waiting,
    /// Every slot holds another adapter.
    MustEvict,
}

impl LoraTier {
    pub fn of(pod: &PodView, adapter: &str) -> LoraTier {
        let Some(lora) = pod.metrics.as_ref().and_then(|m| m.lora.as_ref()) else {
            return LoraTier::Unknown;
        };
        if lora.running.iter().any(|a| a == adapter) {
            return LoraTier::Active;
        }
        if lora.waiting.iter().any(|a| a == adapter) {
            return LoraTier::Waiting;
        }
        let mut in_use: Vec<&str> = lora
            .running
            .iter()
            .chain(lora.waiting.iter())
            .map(String::as_str)
            .collect();
        in_use.sort_unstable();
        in_use.dedup();
        if (in_use.len() as u64) < u64::from(lora.max_lora) {
            LoraTier::FreeSlot
        } else {
            LoraTier::MustEvict
        }
    }

    /// The affinity score in 0..=1.
    pub fn score(self) -> f64 {
        match self {
            LoraTier::Active => 1.0,
            LoraTier::FreeSlot => 0.6,
            LoraTier::Unknown => 0.5,
            LoraTier::Waiting => 0.4,
            LoraTier::MustEvict => 0.0,
        }
    }

    /// A bounded label value.
    pub fn reason(self) -> &'static str {
        match self {
            LoraTier::Active => "lora_active",
            LoraTier::FreeSlot => "lora_free_slot",
            LoraTier::Unknown => "lora_unknown",
            LoraTier::Waiting => "lora_waiting",
            LoraTier::MustEvict => "lora_evict",
        }
    }
}

/// Whether `model` names a LoRA adapter anywhere in the fleet or the configuration.
pub fn is_adapter(model: &str, snapshot: &Snapshot, config: &SchedulerConfig) -> bool {
    config.adapters.contains_key(model)
        || snapshot.pods.iter().any(|pod| {
            pod.models.as_ref().is_some_and(|m| m.is_adapter(model)) || runs_adapter(pod, model)
        })
}

/// Whether the pod may serve `model`. A pod whose `/v1/models` has not answered yet
/// may: refusing it would turn a slow start into 404s.
pub fn may_serve(pod: &PodView, model: &str, config: &SchedulerConfig) -> bool {
    let Some(models) = pod.models.as_ref() else {
        return true;
    };
    models.serves(model)
        || runs_adapter(pod, model)
        || config
            .adapters
            .get(model)
            .is_some_and(|base| models.base.iter().any(|b| b == base))
}

fn runs_adapter(pod: &PodView, adapter: &str) -> bool {
    pod.metrics
        .as_ref()
        .and_then(|m| m.lora.as_ref())
        .is_some_and(|lora| {
            lora.running
                .iter()
                .chain(lora.waiting.iter())
                .any(|a| a == adapter)
        })
}
