//! The pure, seeded request generator: Poisson arrivals of a ladder step, each request's class,
//! model (base or Zipf-drawn adapter), prompt text and `max_tokens`, and its JSON body.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use kvroute_sim::kv::mix;

use super::{Api, Workload};

impl Workload {
    /// The requests of ladder step `step` at `rate` requests per simulated second: Poisson
    /// arrivals from time zero until `duration` or `max_requests`, whichever comes first,
    /// each of a class drawn by the classes' weights at that step.
    pub fn plan_step(
        &self,
        seed: u64,
        step: usize,
        rate: f64,
        duration: Duration,
        max_requests: Option<usize>,
    ) -> Vec<Request> {
        let mut generator = Generator::new(self, seed, step);
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
pub(crate) const WORDS: [&str; 64] = [
    " the", " and", " for", " not", " are", " but", " can", " one", " all", " any", " new", " now",
    " old", " see", " two", " way", " who", " boy", " did", " its", " let", " put", " say", " she",
    " too", " use", " day", " get", " has", " him", " his", " how", " man", " our", " out", " own",
    " run", " set", " sun", " red", " big", " box", " car", " cat", " dog", " eat", " far", " fun",
    " hot", " job", " key", " law", " low", " map", " net", " oil", " pay", " sea", " sit", " top",
    " war", " yes", " of", " to",
];

pub(crate) fn words(rng: &mut impl Rng, n: u32) -> String {
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

/// Cumulative shares of `weights` (the last is 1), for [`draw`].
pub(crate) fn cdf(weights: impl Iterator<Item = f64>) -> Vec<f64> {
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

/// An index drawn by the cumulative shares `cdf`.
pub(crate) fn draw(cdf: &[f64], rng: &mut impl Rng) -> usize {
    let u: f64 = rng.random();
    cdf.iter()
        .position(|&c| u < c)
        .unwrap_or(cdf.len().saturating_sub(1))
}

impl<'w> Generator<'w> {
    fn new(workload: &'w Workload, seed: u64, step: usize) -> Generator<'w> {
        let adapters = workload.fleet.adapters.names();
        let zipf_cdf = workload
            .classes
            .iter()
            .map(|c| {
                let s = c.lora.as_ref().map_or(0.0, |l| l.zipf_s);
                cdf((1..=adapters.len()).map(|k| (k as f64).powf(-s)))
            })
            .collect();
        let class_cdf = cdf(workload.class_weights(step).into_iter());
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
