//! Workload files (`crates/lab/workloads/*.yaml`) and the pure, seeded request generator.
//!
//! A workload says what traffic to send (a weighted mix of request classes), at which rates by
//! default, and which simulated fleet it is meant for, so that a comparison can start identical
//! fleets from it ([`Workload::fleet_config`]). Every length is in tokens of the simulator's
//! tokenizer (about 4 characters of English each; see docs/simulator.md).
//!
//! ```yaml
//! name: multi-lora                 # required
//! description: free text
//! seed: 1                          # workload seed (--seed overrides); default 0
//! model: meta-llama/Llama-3.1-8B-Instruct   # base model (default: the simulator's)
//! api: completions                 # completions (default) | chat
//! ignore_eos: true                 # send vLLM's ignore_eos so outputs run to max_tokens (default true)
//! rates: [2, 4, 8]                 # default ladder, requests per simulated second (required)
//! step_duration: 60s               # default length of one ladder step, simulated time (default 60s)
//! fleet:                           # the simulated fleet this workload is meant for
//!   pods: 8                        # required
//!   profile: h100-llama3-8b        # default h100-llama3-8b
//!   num_gpu_blocks: 1926           # default: what the profile's GPU leaves for KV
//!   max_loras: 2                   # default 4 (the simulator's); 0 disables LoRA
//!   max_cpu_loras: 2               # default: max_loras (vLLM's default)
//!   lora_load_ms: 150              # default 150
//!   adapters: 16                   # a count (named lora-0, lora-1, ...) or a list of names
//!   speedup: 10                    # simulated seconds per wall second (default 1)
//! classes:                         # at least one; a request picks a class by weight
//!   - name: chat                   # required
//!     weight: 1                    # default 1
//!     lora: {base_share: 0.1, zipf_s: 1.0}   # optional: adapter traffic over fleet.adapters
//!     prompt_tokens: {dist: lognormal, median: 300, sigma: 1.0, min: 16, max: 4000}
//!     output_tokens: {dist: uniform, min: 16, max: 256}
//!   - name: rag
//!     shared_prefix: {num_groups: 16, num_prompts_per_group: 8,
//!                     system_prompt_len: 1500, question_len: 200}
//!     output_tokens: {dist: fixed, value: 200}
//! ```
//!
//! Distributions (`dist`): `fixed {value}`, `uniform {min, max}` (integers, both included),
//! `lognormal {median, sigma, min, max}` (`median · e^(sigma·N(0,1))`, rounded and clamped; its
//! mean before clamping is `median · e^(sigma²/2)`), `exponential {mean, min, max}`.
//!
//! `lora`: with probability `base_share` a request goes to the base model, otherwise to an
//! adapter of `fleet.adapters` drawn with Zipf popularity (the adapter of rank `k`, counting from
//! 1 in list order, has weight `1 / k^zipf_s`; `zipf_s: 0` is uniform). Without `lora` the class
//! uses the base model.
//!
//! `shared_prefix` (inference-perf's `shared_prefix` data shape): `num_groups` system prompts of
//! `system_prompt_len` tokens, each with `num_prompts_per_group` questions of `question_len`
//! tokens; every request draws one of these `num_groups × num_prompts_per_group` prompts
//! uniformly. A class has either `prompt_tokens` or `shared_prefix`, not both.
//!
//! Generation is pure: the same workload, seed, step, rate and limits give the same requests.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};

use kvroute_sim::kv::mix;
use kvroute_sim::profile::Profile;
use kvroute_sim::{ConfigError, FleetConfig, PodConfig};

/// Why a workload was refused.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file does not parse.
    #[error("invalid workload {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_norway::Error,
    },
    /// A value is out of range or inconsistent.
    #[error("workload {name:?}: {reason}")]
    Invalid {
        /// The workload's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The fleet section does not make a valid simulated fleet.
    #[error("workload {name:?}: fleet: {source}")]
    Fleet {
        /// The workload's name.
        name: String,
        /// The simulator's reason.
        source: ConfigError,
    },
}

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
    /// Relative weight.
    #[serde(default = "one")]
    pub weight: f64,
    /// Adapter traffic (absent: the base model).
    pub lora: Option<LoraTraffic>,
    /// Prompt length (exclusive with `shared_prefix`).
    pub prompt_tokens: Option<Dist>,
    /// Prompts sharing system prompts (exclusive with `prompt_tokens`).
    pub shared_prefix: Option<SharedPrefix>,
    /// Output length (`max_tokens`).
    pub output_tokens: Dist,
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

/// A distribution of token counts.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "dist", rename_all = "snake_case", deny_unknown_fields)]
pub enum Dist {
    /// Always `value`.
    Fixed {
        /// The count.
        value: u32,
    },
    /// Uniform over `min..=max`.
    Uniform {
        /// Smallest.
        min: u32,
        /// Largest.
        max: u32,
    },
    /// `median · e^(sigma·N(0,1))`, rounded, clamped to `min..=max`.
    Lognormal {
        /// Median before clamping.
        median: f64,
        /// Standard deviation of the logarithm.
        sigma: f64,
        /// Smallest.
        min: u32,
        /// Largest.
        max: u32,
    },
    /// Exponential with `mean`, rounded up, clamped to `min..=max`.
    Exponential {
        /// Mean before clamping.
        mean: f64,
        /// Smallest.
        min: u32,
        /// Largest.
        max: u32,
    },
}

impl Dist {
    /// Draws one count (at least 1).
    pub fn sample(&self, rng: &mut impl Rng) -> u32 {
        let v = match *self {
            Dist::Fixed { value } => value,
            Dist::Uniform { min, max } => rng.random_range(min..=max),
            Dist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => clamp_round(median * (sigma * gaussian(rng)).exp(), min, max),
            Dist::Exponential { mean, min, max } => {
                let u: f64 = rng.random();
                clamp_round((-(1.0 - u).ln() * mean).ceil(), min, max)
            }
        };
        v.max(1)
    }

    /// The largest count it can draw.
    pub fn max(&self) -> u32 {
        match *self {
            Dist::Fixed { value } => value,
            Dist::Uniform { max, .. }
            | Dist::Lognormal { max, .. }
            | Dist::Exponential { max, .. } => max,
        }
    }

    fn check(&self) -> Result<(), String> {
        let ok = match *self {
            Dist::Fixed { value } => value >= 1,
            Dist::Uniform { min, max } => min >= 1 && min <= max,
            Dist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => median > 0.0 && median.is_finite() && sigma >= 0.0 && min >= 1 && min <= max,
            Dist::Exponential { mean, min, max } => {
                mean > 0.0 && mean.is_finite() && min >= 1 && min <= max
            }
        };
        if ok {
            Ok(())
        } else {
            Err(format!("invalid distribution {self:?}"))
        }
    }
}

fn clamp_round(v: f64, min: u32, max: u32) -> u32 {
    v.round().clamp(f64::from(min), f64::from(max)) as u32
}

/// A standard normal draw (Box-Muller).
fn gaussian(rng: &mut impl Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
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

impl Workload {
    /// Reads and validates a workload file.
    pub fn from_file(path: &Path) -> Result<Workload, WorkloadError> {
        let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let workload: Workload =
            serde_norway::from_str(&text).map_err(|source| WorkloadError::Parse {
                path: path.to_path_buf(),
                source,
            })?;
        workload.validate()?;
        Ok(workload)
    }

    /// Parses and validates workload YAML text.
    pub fn from_yaml(text: &str) -> Result<Workload, WorkloadError> {
        let workload: Workload =
            serde_norway::from_str(text).map_err(|source| WorkloadError::Parse {
                path: PathBuf::from("<yaml>"),
                source,
            })?;
        workload.validate()?;
        Ok(workload)
    }

    /// Checks ranges and cross-field rules (including that the fleet section is valid).
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |reason: String| WorkloadError::Invalid {
            name: self.name.clone(),
            reason,
        };
        if self.name.is_empty() {
            return Err(bad("name is empty".into()));
        }
        if self.rates.is_empty() || self.rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return Err(bad(format!(
                "rates must be a non-empty list of numbers > 0, got {:?}",
                self.rates
            )));
        }
        if self.step_duration.is_zero() {
            return Err(bad("step_duration must be > 0".into()));
        }
        if self.classes.is_empty() {
            return Err(bad("at least one class is needed".into()));
        }
        let adapters = self.fleet.adapters.names();
        for c in &self.classes {
            let name = &c.name;
            if !(c.weight.is_finite() && c.weight > 0.0) {
                return Err(bad(format!("class {name}: weight must be > 0")));
            }
            match (&c.prompt_tokens, &c.shared_prefix) {
                (Some(d), None) => d.check().map_err(|e| bad(format!("class {name}: {e}")))?,
                (None, Some(p)) => {
                    if p.num_groups == 0
                        || p.num_prompts_per_group == 0
                        || p.system_prompt_len == 0
                        || p.question_len == 0
                    {
                        return Err(bad(format!(
                            "class {name}: shared_prefix values must be > 0"
                        )));
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "class {name}: give either prompt_tokens or shared_prefix"
                    )));
                }
            }
            c.output_tokens
                .check()
                .map_err(|e| bad(format!("class {name}: {e}")))?;
            if let Some(l) = &c.lora {
                let valid =
                    (0.0..=1.0).contains(&l.base_share) && l.zipf_s.is_finite() && l.zipf_s >= 0.0;
                if !valid {
                    return Err(bad(format!(
                        "class {name}: lora.base_share must be in [0, 1] and zipf_s >= 0"
                    )));
                }
                if adapters.is_empty() && l.base_share < 1.0 {
                    return Err(bad(format!(
                        "class {name}: lora traffic but fleet.adapters is empty"
                    )));
                }
            }
        }
        let fleet = self.fleet_config().map_err(|source| WorkloadError::Fleet {
            name: self.name.clone(),
            source,
        })?;
        let max_len = fleet
            .pods
            .iter()
            .map(|p| {
                let capacity = p.engine.num_gpu_blocks.saturating_mul(p.engine.block_size);
                p.profile.max_model_len.min(capacity)
            })
            .min()
            .unwrap_or(0);
        for c in &self.classes {
            let longest = c.max_prompt_tokens() + c.output_tokens.max();
            // Chat templates add a few tokens; leave room for them.
            if u64::from(longest) + 64 > u64::from(max_len) {
                return Err(bad(format!(
                    "class {}: prompt + output can reach {longest} tokens, over the fleet's model length {max_len}",
                    c.name
                )));
            }
        }
        Ok(())
    }

    /// The simulated fleet this workload is meant for, on ephemeral ports of 127.0.0.1.
    pub fn fleet_config(&self) -> Result<FleetConfig, ConfigError> {
        let f = &self.fleet;
        let profile = Profile::by_name(&f.profile)
            .ok_or_else(|| ConfigError::UnknownProfile(f.profile.clone()))?;
        let mut pod = PodConfig::default();
        pod.engine.num_gpu_blocks = f
            .num_gpu_blocks
            .unwrap_or_else(|| profile.default_num_gpu_blocks(pod.engine.block_size));
        pod.profile = profile;
        if let Some(v) = f.max_loras {
            pod.engine.max_loras = v;
        }
        pod.engine.max_cpu_loras = f.max_cpu_loras.unwrap_or(pod.engine.max_loras);
        if let Some(ms) = f.lora_load_ms {
            pod.engine.lora_load = Duration::from_millis(ms);
        }
        pod.lora_adapters = f.adapters.names();
        let config = FleetConfig {
            model: self.model.clone(),
            speedup: f.speedup,
            seed: self.seed,
            ..FleetConfig::uniform(f.pods, pod)
        };
        config.validate()?;
        if config
            .pods
            .iter()
            .any(|p| p.engine.max_cpu_loras < p.engine.max_loras)
        {
            return Err(ConfigError::Invalid(
                "max_cpu_loras must be >= max_loras".into(),
            ));
        }
        Ok(config)
    }

    /// The requests of ladder step `step` at `rate` requests per simulated second: Poisson
    /// arrivals from time zero until `duration` or `max_requests`, whichever comes first.
    pub fn plan_step(
        &self,
        seed: u64,
        step: usize,
        rate: f64,
        duration: Duration,
        max_requests: Option<usize>,
    ) -> Vec<Request> {
        let mut generator = Generator::new(self, seed);
        let mut rng = SmallRng::seed_from_u64(mix(mix(seed, 0xa771), step as u64));
        let limit = max_requests.unwrap_or(usize::MAX);
        let end = duration.as_secs_f64();
        let mut at = 0.0;
        let mut out = Vec::new();
        while out.len() < limit {
            let u: f64 = rng.random();
            at += -(1.0 - u).ln() / rate;
            if at >= end {
                break;
            }
            out.push(generator.next(Duration::from_secs_f64(at), &mut rng));
        }
        out
    }
}

impl ClassSpec {
    fn max_prompt_tokens(&self) -> u32 {
        match (&self.prompt_tokens, &self.shared_prefix) {
            (Some(d), _) => d.max(),
            (None, Some(p)) => p.system_prompt_len + p.question_len,
            (None, None) => 0,
        }
    }
}

/// One planned request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Arrival, simulated time since the step started.
    pub at: Duration,
    /// Index of its class in the workload.
    pub class: usize,
    /// `model` field: the base model or an adapter.
    pub model: String,
    /// The shared system prompt, if the class has one.
    pub system: Option<Arc<str>>,
    /// The request's own prompt text (the question, under a shared prefix).
    pub prompt: String,
    /// Tokens of `system` + `prompt` in the simulator's tokenizer (chat templates add some).
    pub prompt_tokens: u32,
    /// `max_tokens`.
    pub max_tokens: u32,
}

impl Request {
    /// The JSON body: streamed, with usage in the last chunk.
    pub fn body(&self, api: Api, ignore_eos: bool) -> Value {
        let mut body = match api {
            Api::Completions => {
                let prompt = match &self.system {
                    Some(s) => format!("{s}{}", self.prompt),
                    None => self.prompt.clone(),
                };
                json!({"model": self.model, "prompt": prompt})
            }
            Api::Chat => {
                let mut messages = Vec::with_capacity(2);
                if let Some(s) = &self.system {
                    messages.push(json!({"role": "system", "content": s.as_ref()}));
                }
                messages.push(json!({"role": "user", "content": self.prompt}));
                json!({"model": self.model, "messages": messages})
            }
        };
        if let Some(map) = body.as_object_mut() {
            map.insert("max_tokens".into(), json!(self.max_tokens));
            map.insert("stream".into(), json!(true));
            map.insert("stream_options".into(), json!({"include_usage": true}));
            if ignore_eos {
                map.insert("ignore_eos".into(), json!(true));
            }
        }
        body
    }
}

/// Short common English words, each one token in the simulator's tokenizer with its leading
/// space (and, being common, almost surely one in Llama-3's): prompts are random sequences of them.
const WORDS: [&str; 64] = [
    " the", " and", " for", " not", " are", " but", " can", " one", " all", " any", " new", " now",
    " old", " see", " two", " way", " who", " boy", " did", " its", " let", " put", " say", " she",
    " too", " use", " day", " get", " has", " him", " his", " how", " man", " our", " out", " own",
    " run", " set", " sun", " red", " big", " box", " car", " cat", " dog", " eat", " far", " fun",
    " hot", " job", " key", " law", " low", " map", " net", " oil", " pay", " sea", " sit", " top",
    " war", " yes", " of", " to",
];

fn words(rng: &mut impl Rng, n: u32) -> String {
    let mut s = String::with_capacity(n as usize * 4);
    for _ in 0..n {
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

/// The prompts of a shared-prefix class: system prompts and their questions.
#[derive(Debug)]
struct PrefixPool {
    systems: Vec<Arc<str>>,
    questions: Vec<Vec<String>>,
    tokens: u32,
}

/// Draws request contents for a workload (models, prompts, lengths).
#[derive(Debug)]
struct Generator<'w> {
    workload: &'w Workload,
    adapters: Vec<String>,
    zipf_cdf: Vec<Vec<f64>>,
    class_cdf: Vec<f64>,
    pools: Vec<Option<PrefixPool>>,
}

fn cdf(weights: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut acc = 0.0;
    let mut v: Vec<f64> = weights
        .map(|w| {
            acc += w;
            acc
        })
        .collect();
    if let Some(total) = v.last().copied().filter(|t| *t > 0.0) {
        for x in &mut v {
            *x /= total;
        }
    }
    v
}

fn draw(cdf: &[f64], rng: &mut impl Rng) -> usize {
    let u: f64 = rng.random();
    cdf.iter()
        .position(|&c| u < c)
        .unwrap_or(cdf.len().saturating_sub(1))
}

impl<'w> Generator<'w> {
    fn new(workload: &'w Workload, seed: u64) -> Generator<'w> {
        let adapters = workload.fleet.adapters.names();
        let zipf_cdf = workload
            .classes
            .iter()
            .map(|c| {
                let s = c.lora.as_ref().map_or(0.0, |l| l.zipf_s);
                cdf((1..=adapters.len()).map(|k| (k as f64).powf(-s)))
            })
            .collect();
        let class_cdf = cdf(workload.classes.iter().map(|c| c.weight));
        // The prefix pools depend on the seed only, so every ladder step shares them.
        let pools = workload
            .classes
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let p = c.shared_prefix.as_ref()?;
                let mut rng = SmallRng::seed_from_u64(mix(mix(seed, 0x9f1), i as u64));
                let systems = (0..p.num_groups)
                    .map(|_| Arc::from(words(&mut rng, p.system_prompt_len)))
                    .collect();
                let questions = (0..p.num_groups)
                    .map(|_| {
                        (0..p.num_prompts_per_group)
                            .map(|_| words(&mut rng, p.question_len))
                            .collect()
                    })
                    .collect();
                Some(PrefixPool {
                    systems,
                    questions,
                    tokens: p.system_prompt_len + p.question_len,
                })
            })
            .collect();
        Generator {
            workload,
            adapters,
            zipf_cdf,
            class_cdf,
            pools,
        }
    }

    fn next(&mut self, at: Duration, rng: &mut SmallRng) -> Request {
        let class = draw(&self.class_cdf, rng);
        let spec = &self.workload.classes[class];
        let model = match &spec.lora {
            Some(l) if !self.adapters.is_empty() && rng.random::<f64>() >= l.base_share => {
                self.adapters[draw(&self.zipf_cdf[class], rng)].clone()
            }
            _ => self.workload.model.clone(),
        };
        let (system, prompt, prompt_tokens) = match (&self.pools[class], &spec.prompt_tokens) {
            (Some(pool), _) => {
                let g = rng.random_range(0..pool.systems.len());
                let q = rng.random_range(0..pool.questions[g].len());
                (
                    Some(Arc::clone(&pool.systems[g])),
                    pool.questions[g][q].clone(),
                    pool.tokens,
                )
            }
            (None, Some(d)) => {
                let n = d.sample(rng);
                (None, words(rng, n), n)
            }
            (None, None) => (None, words(rng, 1), 1),
        };
        Request {
            at,
            class,
            model,
            system,
            prompt,
            prompt_tokens,
            max_tokens: spec.output_tokens.sample(rng),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = "
name: t
seed: 3
rates: [4]
step_duration: 100s
fleet: {pods: 2, num_gpu_blocks: 2000, max_loras: 2, adapters: 4, speedup: 5}
classes:
  - name: lora
    lora: {base_share: 0.25, zipf_s: 1.0}
    prompt_tokens: {dist: lognormal, median: 200, sigma: 1.0, min: 8, max: 4000}
    output_tokens: {dist: uniform, min: 10, max: 30}
  - name: prefix
    weight: 1
    shared_prefix: {num_groups: 3, num_prompts_per_group: 2, system_prompt_len: 50, question_len: 7}
    output_tokens: {dist: fixed, value: 9}
";

    #[test]
    fn every_prompt_word_is_one_simulator_token() {
        for w in WORDS {
            assert_eq!(kvroute_sim::tokens::tokenize(w).len(), 1, "{w:?}");
        }
        let mut rng = SmallRng::seed_from_u64(1);
        let text = words(&mut rng, 321);
        assert_eq!(kvroute_sim::tokens::tokenize(&text).len(), 321);
    }

    #[test]
    fn a_shared_prefix_prompt_has_the_promised_token_count_and_prefix() {
        let w = Workload::from_yaml(YAML).expect("valid");
        let reqs = w.plan_step(1, 0, 50.0, Duration::from_secs(10), None);
        let prefixed: Vec<&Request> = reqs.iter().filter(|r| r.class == 1).collect();
        assert!(prefixed.len() > 100, "{}", prefixed.len());
        let systems: std::collections::HashSet<&str> = prefixed
            .iter()
            .filter_map(|r| r.system.as_deref())
            .collect();
        assert_eq!(systems.len(), 3);
        for r in prefixed {
            let body = r.body(Api::Completions, true);
            let prompt = body["prompt"].as_str().expect("prompt");
            assert_eq!(kvroute_sim::tokens::tokenize(prompt).len(), 57);
            assert_eq!(r.prompt_tokens, 57);
            assert_eq!(r.model, w.model);
            assert_eq!(r.max_tokens, 9);
        }
    }

    #[test]
    fn the_body_streams_with_usage_and_chat_puts_the_prefix_in_the_system_message() {
        let r = Request {
            at: Duration::ZERO,
            class: 0,
            model: "m".into(),
            system: Some(Arc::from(" sys")),
            prompt: " q".into(),
            prompt_tokens: 2,
            max_tokens: 5,
        };
        let b = r.body(Api::Completions, true);
        assert_eq!(b["prompt"], " sys q");
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["max_tokens"], 5);
        assert_eq!(b["ignore_eos"], true);
        let c = r.body(Api::Chat, false);
        assert_eq!(c["messages"][0]["role"], "system");
        assert_eq!(c["messages"][1]["content"], " q");
        assert!(c.get("ignore_eos").is_none());
    }

    #[test]
    fn bad_workloads_are_refused_with_a_reason() {
        let e =
            Workload::from_yaml(&YAML.replace("rates: [4]", "rates: []")).expect_err("no rates");
        assert!(e.to_string().contains("rates"), "{e}");
        let e =
            Workload::from_yaml(&YAML.replace("max: 4000", "max: 40000")).expect_err("too long");
        assert!(e.to_string().contains("model length"), "{e}");
        let e = Workload::from_yaml(&YAML.replace("adapters: 4", "adapters: 0"))
            .expect_err("lora without adapters");
        assert!(e.to_string().contains("adapters"), "{e}");
        let e = Workload::from_yaml(&YAML.replace("pods: 2", "pods: 0")).expect_err("no pods");
        assert!(e.to_string().contains("fleet"), "{e}");
        assert!(Workload::from_yaml(&YAML.replace("weight: 1", "colour: 1")).is_err());
        assert!(Workload::from_yaml(&YAML.replace("dist: fixed", "dist: gamma")).is_err());
    }

    #[test]
    fn the_fleet_section_builds_the_fleet_config() {
        let w = Workload::from_yaml(YAML).expect("valid");
        let f = w.fleet_config().expect("fleet");
        assert_eq!(f.pods.len(), 2);
        assert_eq!(f.speedup, 5.0);
        assert_eq!(f.seed, 3);
        assert_eq!(f.port, 0);
        let p = &f.pods[1];
        assert_eq!(p.engine.num_gpu_blocks, 2000);
        assert_eq!((p.engine.max_loras, p.engine.max_cpu_loras), (2, 2));
        assert_eq!(p.engine.lora_load, Duration::from_millis(150));
        assert_eq!(
            p.lora_adapters,
            vec!["lora-0", "lora-1", "lora-2", "lora-3"]
        );
    }
}
