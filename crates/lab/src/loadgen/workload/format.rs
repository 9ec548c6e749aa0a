//! The workload file's serde types (`Workload` and its `fleet`, `classes`, `lora` and
//! `shared_prefix` sections) and their defaults.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use super::Dist;

/// Which OpenAI endpoint the requests use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/completions` with `prompt`.
    #[default]
    Completions,
    /// `POST /v1/chat/completions` with `messages` (the shared prefix as the system message).
    Chat,
}

impl Api {
    /// The path under `/v1`.
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/completions",
            Api::Chat => "/chat/completions",
        }
    }
}

/// A workload file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Name (reports, file names).
    pub name: String,
    /// What it models and why.
    #[serde(default)]
    pub description: String,
    /// Seed of the generator and of the fleet.
    #[serde(default)]
    pub seed: u64,
    /// Base model name.
    #[serde(default = "default_model")]
    pub model: String,
    /// Endpoint used.
    #[serde(default)]
    pub api: Api,
    /// Whether requests carry vLLM's `ignore_eos: true` (outputs run to `max_tokens`).
    #[serde(default = "yes")]
    pub ignore_eos: bool,
    /// Default rate ladder, requests per simulated second.
    pub rates: Vec<f64>,
    /// Default length of one ladder step (simulated time).
    #[serde(default = "default_step", deserialize_with = "duration")]
    pub step_duration: Duration,
    /// The simulated fleet the workload is meant for.
    pub fleet: FleetSpec,
    /// Request classes, picked by weight.
    pub classes: Vec<ClassSpec>,
    /// Objective name → priority, as `kvroute serve --objective-priority` takes it (higher is
    /// served first, negative is sheddable). None: the classes' objectives are not checked
    /// and kvroute gets no map.
    pub objectives: Option<BTreeMap<String, i32>>,
    /// Requests per simulated second the fleet completes at most for this traffic (an
    /// estimate, see docs/workloads.md): the scale of the report's target checks.
    pub capacity: Option<f64>,
}

impl Workload {
    /// The classes' weights at ladder step `step`, in class order.
    pub fn class_weights(&self, step: usize) -> Vec<f64> {
        self.classes.iter().map(|c| c.weight_at(step)).collect()
    }

    /// This workload with only the ladder steps at `keep` (positions in `rates`; others are
    /// skipped), each with its own class weights: what a shortened ladder (`--quick`, a
    /// warm-up at one rate) runs.
    pub fn select_steps(&self, keep: &[usize]) -> Workload {
        let keep: Vec<usize> = keep
            .iter()
            .copied()
            .filter(|&i| i < self.rates.len())
            .collect();
        let mut w = self.clone();
        w.rates = keep.iter().map(|&i| self.rates[i]).collect();
        for c in &mut w.classes {
            if let Some(weights) = &mut c.step_weights {
                let picked: Vec<f64> = keep
                    .iter()
                    .filter_map(|&i| weights.get(i))
                    .copied()
                    .collect();
                *weights = picked;
            }
        }
        w
    }
}

/// The `fleet` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSpec {
    /// Identical pods.
    pub pods: usize,
    /// GPU + model profile.
    #[serde(default = "default_profile")]
    pub profile: String,
    /// KV blocks per pod (default: the profile's).
    pub num_gpu_blocks: Option<u32>,
    /// GPU adapter slots per pod (default 4, the simulator's).
    pub max_loras: Option<usize>,
    /// Adapters kept in host memory (default: `max_loras`, as vLLM).
    pub max_cpu_loras: Option<usize>,
    /// Cold adapter load time in milliseconds (default 150).
    pub lora_load_ms: Option<u64>,
    /// Adapters every pod serves.
    #[serde(default)]
    pub adapters: Adapters,
    /// Simulated seconds per wall-clock second.
    #[serde(default = "one")]
    pub speedup: f64,
}

/// Adapters: a count (`lora-0` ... `lora-{n-1}`) or explicit names.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Adapters {
    /// `n` adapters named `lora-0` ... `lora-{n-1}`.
    Count(usize),
    /// These names.
    Names(Vec<String>),
}

impl Default for Adapters {
    fn default() -> Adapters {
        Adapters::Count(0)
    }
}

impl Adapters {
    /// The adapter names, in popularity rank order.
    pub fn names(&self) -> Vec<String> {
        match self {
            Adapters::Count(n) => (0..*n).map(|i| format!("lora-{i}")).collect(),
            Adapters::Names(v) => v.clone(),
        }
    }
}

/// One request class.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassSpec {
    /// Name (per-request records).
    pub name: String,
    /// Relative weight (default 1).
    pub weight: Option<f64>,
    /// Relative weight per ladder step, one per entry of `rates` (0: absent in that step);
    /// exclusive with `weight`.
    pub step_weights: Option<Vec<f64>>,
    /// Sent as `x-gateway-inference-objective` on every request of the class.
    pub objective: Option<String>,
    /// Sent as `x-gateway-inference-fairness-id` on every request of the class.
    pub tenant: Option<String>,
    /// Adapter traffic (absent: the base model).
    pub lora: Option<LoraTraffic>,
    /// Prompt length (exclusive with `shared_prefix`).
    pub prompt_tokens: Option<Dist>,
    /// Prompts sharing system prompts (exclusive with `prompt_tokens`).
    pub shared_prefix: Option<SharedPrefix>,
    /// Output length (`max_tokens`).
    pub output_tokens: Dist,
}

impl ClassSpec {
    /// The class's weight at ladder step `step` (a step past `step_weights` takes its last).
    pub fn weight_at(&self, step: usize) -> f64 {
        match &self.step_weights {
            Some(w) => w.get(step).or(w.last()).copied().unwrap_or(0.0),
            None => self.weight.unwrap_or(1.0),
        }
    }
}

/// How a class spreads over adapters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraTraffic {
    /// Share of requests for the base model.
    #[serde(default)]
    pub base_share: f64,
    /// Zipf exponent over the adapters' rank (0: uniform).
    #[serde(default = "one")]
    pub zipf_s: f64,
}

/// inference-perf's `shared_prefix` shape.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedPrefix {
    /// Distinct system prompts.
    pub num_groups: u32,
    /// Distinct questions per system prompt.
    pub num_prompts_per_group: u32,
    /// Tokens of each system prompt.
    pub system_prompt_len: u32,
    /// Tokens of each question.
    pub question_len: u32,
}

fn default_model() -> String {
    kvroute_sim::config::DEFAULT_MODEL.to_string()
}

fn default_profile() -> String {
    "h100-llama3-8b".to_string()
}

fn default_step() -> Duration {
    Duration::from_secs(60)
}

fn one<T: From<u8>>() -> T {
    T::from(1)
}

fn yes() -> bool {
    true
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(serde::de::Error::custom)
}
