//! Tunables of the scheduler, with the defaults kvroute ships.

use std::collections::HashMap;
use std::time::Duration;

use serde::Deserialize;

/// Relative importance of each scorer. Scores are each in 0..=1; the pod with the
/// highest weighted sum wins.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    /// Free KV tokens left after placing this request, as a share of the pod's capacity.
    pub kv_headroom: f64,
    /// Requests waiting in the pod's own queue.
    pub queue: f64,
    /// Requests kvroute has sent to the pod and not yet seen finish.
    pub inflight: f64,
    /// Whether the requested LoRA adapter is already running on the pod.
    pub lora_affinity: f64,
    /// Share of the prompt's prefix the pod likely holds in its prefix cache.
    pub prefix_affinity: f64,
    /// Prompt tokens kvroute sent to the pod that still wait for their first token.
    pub prefill_queue: f64,
}

impl Default for Weights {
    fn default() -> Self {
        // LoRA affinity outweighs load because a cold adapter load costs hundreds of
        // milliseconds, more than a few queued decode steps; saturated pods are filtered
        // out before scoring, so affinity never outweighs an overloaded pod.
        Weights {
            kv_headroom: 2.0,
            queue: 2.0,
            inflight: 1.0,
            lora_affinity: 3.0,
            // As the reference picker weighs its prefix scorer: a full match outweighs
            // an idle pod's whole KV and queue advantage only in part, and saturated
            // pods are filtered out first, so a hot prefix cannot pile onto one pod.
            prefix_affinity: 3.0,
            // A request's first token waits for every prompt queued ahead of it on the
            // pod; kvroute sees that queue at once, a scrape only later.
            prefill_queue: 2.0,
        }
    }
}

/// A scheduler setting outside its range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidConfig {
    #[error("weight {name} must be a finite number >= 0, got {value}")]
    Weight { name: &'static str, value: f64 },
    #[error("saturation.kv_usage must be in (0, 1], got {0}")]
    SaturationKvUsage(f64),
    #[error("saturation.queue_depth must be at least 1")]
    SaturationQueueDepth,
    #[error("prefill_queue_tokens must be at least 1")]
    PrefillQueueTokens,
    #[error("max metrics age must be above zero")]
    MaxMetricsAge,
    #[error("keep_free must be in [0, 1), got {0}")]
    KeepFree(f64),
    #[error("replicas must be at least 1")]
    Replicas,
}

impl Weights {
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        let all = [
            ("kv_headroom", self.kv_headroom),
            ("queue", self.queue),
            ("inflight", self.inflight),
            ("lora_affinity", self.lora_affinity),
            ("prefix_affinity", self.prefix_affinity),
            ("prefill_queue", self.prefill_queue),
        ];
        for (name, weight) in all {
            if !weight.is_finite() || weight < 0.0 {
                return Err(InvalidConfig::Weight {
                    name,
                    value: weight,
                });
            }
        }
        Ok(())
    }
}

/// When a pod counts as saturated (GIE's defaults: queue 5, KV 0.8).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Saturation {
    /// Requests waiting in the pod's queue at or above which it is saturated.
    pub queue_depth: u32,
    /// KV-cache use (0..1) at or above which it is saturated.
    pub kv_usage: f64,
}

impl Default for Saturation {
    fn default() -> Self {
        Saturation {
            queue_depth: 5,
            kv_usage: 0.8,
        }
    }
}

/// Everything [`crate::scheduler::pick`] needs besides the request and the fleet.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub weights: Weights,
    pub saturation: Saturation,
    /// A pod's metrics count fully up to this age; older, its KV and queue scores are
    /// scaled by `max_metrics_age / age`.
    pub max_metrics_age: Duration,
    /// Output tokens to expect when a request sets no `max_tokens`.
    pub default_output_tokens: u32,
    /// Queued prefill tokens at which a pod's prefill-queue score halves: about 0.1 s of
    /// prefill for an 8B model on one H100.
    pub prefill_queue_tokens: u32,
    /// Ordered fallback endpoints sent after the chosen one. Off by default: Envoy's
    /// ORIGINAL_DST cluster reads the header as one address and fails on a list; the
    /// override_host policy accepts lists.
    pub fallbacks: usize,
    /// How many ranked candidates a decision keeps, with their scores, for operators.
    pub trace_candidates: usize,
    /// Adapter name → base model, for adapters that pods do not list in `/v1/models`.
    pub adapters: HashMap<String, String>,
    /// Share of each pod's KV capacity (0..1) a request must leave free to pass the KV
    /// headroom filter. 0 by default; flow control sets it for requests that must leave
    /// room for others (sheddable ones, a tenant over its fair share).
    pub keep_free: f64,
    /// KV tokens a request must leave free on its pod besides, when more than `keep_free`
    /// of the pool (at most half the pool): flow control sets it for a tenant over its
    /// share, from the size of the quieter tenants' requests. 0 by default.
    pub keep_free_tokens: u64,
    /// kvroute replicas behind the same gateways, this one included. Each sees only the
    /// requests it routed itself, so between two scrapes it counts the KV it sent a pod that
    /// many times: the gateways spread requests evenly over the replicas, and replicas
    /// following the same KV events send a prompt to the same pods. 1 by default.
    pub replicas: u32,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            weights: Weights::default(),
            saturation: Saturation::default(),
            max_metrics_age: Duration::from_secs(1),
            default_output_tokens: 256,
            prefill_queue_tokens: 4096,
            fallbacks: 0,
            trace_candidates: 4,
            adapters: HashMap::new(),
            keep_free: 0.0,
            keep_free_tokens: 0,
            replicas: 1,
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        self.weights.validate()?;
        let kv = self.saturation.kv_usage;
        if !(kv > 0.0 && kv <= 1.0) {
            return Err(InvalidConfig::SaturationKvUsage(kv));
        }
        if self.saturation.queue_depth == 0 {
            return Err(InvalidConfig::SaturationQueueDepth);
        }
        if self.prefill_queue_tokens == 0 {
            return Err(InvalidConfig::PrefillQueueTokens);
        }
        if self.max_metrics_age.is_zero() {
            return Err(InvalidConfig::MaxMetricsAge);
        }
        if !(0.0..1.0).contains(&self.keep_free) {
            return Err(InvalidConfig::KeepFree(self.keep_free));
        }
        if self.replicas == 0 {
            return Err(InvalidConfig::Replicas);
        }
        Ok(())
    }
}
