//! The simulated trace: the requests `bench` would send for a workload, drawn lazily, one at
//! a time, as word indices instead of text.
//!
//! [`StepTrace`] makes the same draws as the load generator's `Workload::plan_step` (same
//! seeds, same order: arrival, class, adapter, prompt words, output length), so at the
//! workload's own fleet size the simulated trace *is* the live one; the tests compare them
//! request by request. Two things differ, both for scale: nothing is kept once routed (a
//! million requests of kilobytes each would not fit), and a prompt is a list of word
//! indices, turned into the simulator's token ids and kvroute's parsed request directly
//! rather than through JSON text (the tests check both against `tokenize` and
//! `parse_request` of the real body).
//!
//! Scaling to more pods ([`Scale`]): `copies` independent copies of the workload's tenants.
//! Each request is drawn as for the original fleet, then given a copy, uniformly: an
//! adapter `lora-3` becomes `lora-3` in copy 0 and `lora-3-c<j>` in copy `j`, and a shared
//! system prompt gets its first three words rewritten per copy, so copies share no prefix
//! block. Copy 0 is the original: with one copy the trace is unchanged.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use kvroute_core::request::{
    InferenceRequest, MESSAGE_OVERHEAD_TOKENS, PROMPT_PREFIX_BYTES, estimate_tokens,
};
use kvroute_sim::kv::mix;
use kvroute_sim::tokens::VOCAB;

use crate::loadgen::workload::{Api, WORDS, Workload, cdf, draw};

/// Words of a system prompt rewritten per tenant copy.
const COPY_WORDS: usize = 3;

/// How the workload is scaled to the simulated fleet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    /// Rates are multiplied by this (simulated pods / the workload's pods).
    pub rate: f64,
    /// Copies of the tenants (adapters, shared system prompts).
    pub copies: u32,
}

impl Scale {
    /// The scale that keeps each pod's load when `pods` replace the workload's fleet.
    pub fn for_pods(workload: &Workload, pods: usize) -> Scale {
        let rate = pods as f64 / workload.fleet.pods.max(1) as f64;
        Scale {
            rate,
            copies: u32::try_from(rate.round().max(1.0) as u64).unwrap_or(u32::MAX),
        }
    }

    /// The adapter names of the scaled fleet: every copy of the workload's adapters,
    /// copy by copy, in rank order within each (index = copy × adapters + rank).
    pub fn adapter_names(&self, workload: &Workload) -> Vec<String> {
        let base = workload.fleet.adapters.names();
        (0..self.copies)
            .flat_map(|copy| {
                base.iter().map(move |name| match copy {
                    0 => name.clone(),
                    j => format!("{name}-c{j}"),
                })
            })
            .collect()
    }
}

/// A shared system prompt as one tenant copy sees it.
#[derive(Debug, Clone)]
pub struct System {
    /// The generated words.
    pub words: Arc<[u8]>,
    /// Tenant copy (0: as generated).
    pub copy: u32,
}

/// One request of the trace.
#[derive(Debug, Clone)]
pub struct TraceRequest {
    /// Arrival since the step started.
    pub at: Duration,
    /// Class index in the workload.
    pub class: usize,
    /// Adapter index in [`Scale::adapter_names`]; None for the base model.
    pub adapter: Option<u32>,
    /// The shared system prompt, if the class has one.
    pub system: Option<System>,
    /// The request's own words (the question, under a shared prefix).
    pub own: Arc<[u8]>,
    /// Tokens the generator planned (`Request::prompt_tokens`).
    pub prompt_tokens: u32,
    /// `max_tokens`.
    pub max_tokens: u32,
}

impl System {
    /// The words, rewritten for this copy: the first [`COPY_WORDS`] words read as a number
    /// in base 64, plus the copy, so no two copies (nor a copy and the original) agree.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.words);
        if self.copy == 0 {
            return;
        }
        let start = out.len() - self.words.len();
        let head = &mut out[start..start + self.words.len().min(COPY_WORDS)];
        let modulus = 64u64.pow(head.len() as u32);
        let original = head.iter().fold(0u64, |n, w| n * 64 + u64::from(*w));
        let mut n = (original + u64::from(self.copy)) % modulus;
        for w in head.iter_mut().rev() {
            *w = (n % 64) as u8;
            n /= 64;
        }
    }
}

fn word_bytes(words: &[u8]) -> usize {
    words.iter().map(|&w| WORDS[usize::from(w)].len()).sum()
}

/// The simulator's tokenizer (`kvroute_sim::tokens::tokenize`) as a state machine fed piece
/// by piece: a word of the generator (one whitespace then at most three characters) is one
/// token whatever precedes it, so its state is looked up rather than hashed again.
struct Tokenizer {
    out: Vec<u32>,
    hash: u64,
    chars: usize,
}

/// Tokenizer state after each word of [`WORDS`], fed from a token boundary.
fn word_states() -> &'static [(u64, usize); 64] {
    static STATES: std::sync::OnceLock<[(u64, usize); 64]> = std::sync::OnceLock::new();
    STATES.get_or_init(|| {
        let mut states = [(0, 0); 64];
        for (state, word) in states.iter_mut().zip(WORDS) {
            let mut t = Tokenizer::new(0);
            t.text(word);
            *state = (t.hash, t.chars);
        }
        states
    })
}

impl Tokenizer {
    const MAX_CHARS: usize = 4;

    fn new(capacity: usize) -> Tokenizer {
        Tokenizer {
            out: Vec::with_capacity(capacity),
            hash: 0,
            chars: 0,
        }
    }

    fn flush(&mut self) {
        self.out.push((self.hash % u64::from(VOCAB)) as u32);
        self.hash = 0;
        self.chars = 0;
    }

    fn text(&mut self, text: &str) {
        for c in text.chars() {
            if self.chars > 0 && (self.chars == Self::MAX_CHARS || c.is_whitespace()) {
                self.flush();
            }
            self.hash = mix(self.hash, u64::from(c));
            self.chars += 1;
        }
    }

    fn words(&mut self, words: &[u8]) {
        let states = word_states();
        for &w in words {
            // Every word starts with a space: a token boundary.
            if self.chars > 0 {
                self.flush();
            }
            (self.hash, self.chars) = states[usize::from(w)];
        }
    }

    fn finish(mut self) -> Vec<u32> {
        if self.chars > 0 {
            self.flush();
        }
        self.out
    }
}

/// [`InferenceRequest::prompt_prefix`] as the parser builds it: pieces joined by `'\n'`,
/// cut at [`PROMPT_PREFIX_BYTES`].
struct PrefixWriter {
    bytes: Vec<u8>,
    pieces: usize,
}

impl PrefixWriter {
    fn room(&self) -> usize {
        PROMPT_PREFIX_BYTES.saturating_sub(self.bytes.len())
    }

    fn raw(&mut self, bytes: &[u8]) {
        let kept = bytes.get(..self.room()).unwrap_or(bytes);
        self.bytes.extend_from_slice(kept);
    }

    fn words(&mut self, words: &[u8]) {
        for &w in words {
            if self.room() == 0 {
                return;
            }
            self.raw(WORDS[usize::from(w)].as_bytes());
        }
    }

    fn piece(&mut self, write: impl FnOnce(&mut PrefixWriter)) {
        if self.pieces > 0 {
            self.raw(b"\n");
        }
        write(self);
        self.pieces += 1;
    }
}

impl TraceRequest {
    /// The model the request names: its adapter's name in `adapters` (by
    /// [`Scale::adapter_names`]), else the base model `base`; empty for an adapter with no
    /// name there.
    pub fn model<'a>(&self, base: &'a str, adapters: &'a [String]) -> &'a str {
        match self.adapter {
            Some(a) => adapters.get(a as usize).map_or("", String::as_str),
            None => base,
        }
    }

    /// The system prompt's words for this request's copy, into `buf` (cleared).
    fn system_words<'b>(&self, buf: &'b mut Vec<u8>) -> Option<&'b [u8]> {
        buf.clear();
        let system = self.system.as_ref()?;
        system.write(buf);
        Some(buf.as_slice())
    }

    /// The prompt's token ids as the simulator's API makes them from the request body
    /// (`tokenize` of the prompt, or of the chat template's rendering of the messages).
    pub fn engine_tokens(&self, api: Api, buf: &mut Vec<u8>) -> Vec<u32> {
        let system = self.system_words(buf);
        // A token per word, a few for the chat template, and room for the output the
        // engine appends (without it the prompt was copied once more as the output came).
        let mut t = Tokenizer::new(
            system.map_or(0, <[u8]>::len) + self.own.len() + 32 + self.max_tokens as usize,
        );
        match api {
            Api::Completions => {
                if let Some(s) = system {
                    t.words(s);
                }
                t.words(&self.own);
            }
            Api::Chat => {
                // kvroute_sim::tokens::render_chat, message by message.
                t.text("<|begin_of_text|>");
                if let Some(s) = system {
                    t.text("<|start_header_id|>system<|end_header_id|>\n\n");
                    t.words(s);
                    t.text("<|eot_id|>");
                }
                t.text("<|start_header_id|>user<|end_header_id|>\n\n");
                t.words(&self.own);
                t.text("<|eot_id|>");
                t.text("<|start_header_id|>assistant<|end_header_id|>\n\n");
            }
        }
        t.finish()
    }

    /// What kvroute's parser makes of this request's body (`parse_request`).
    pub fn inference(&self, api: Api, model: &str, buf: &mut Vec<u8>) -> InferenceRequest {
        let system = self.system_words(buf);
        let mut prefix = PrefixWriter {
            bytes: Vec::new(),
            pieces: 0,
        };
        let prompt_tokens = match api {
            Api::Completions => {
                let bytes = system.map_or(0, word_bytes) + word_bytes(&self.own);
                prefix.piece(|p| {
                    if let Some(s) = system {
                        p.words(s);
                    }
                    p.words(&self.own);
                });
                estimate_tokens(bytes)
            }
            Api::Chat => {
                let mut tokens = 0u32;
                if let Some(s) = system {
                    tokens += MESSAGE_OVERHEAD_TOKENS + estimate_tokens(word_bytes(s));
                    prefix.piece(|p| p.raw(b"system"));
                    prefix.piece(|p| p.words(s));
                }
                tokens += MESSAGE_OVERHEAD_TOKENS + estimate_tokens(word_bytes(&self.own));
                prefix.piece(|p| p.raw(b"user"));
                prefix.piece(|p| p.words(&self.own));
                tokens
            }
        };
        InferenceRequest {
            model: model.to_string(),
            prompt_tokens,
            max_output_tokens: Some(self.max_tokens),
            stream: true,
            prompt_prefix: prefix.bytes,
            prefix_context: 0,
        }
    }

    /// The prompt as text (system prompt, then the request's own words), for tests.
    pub fn text(&self) -> (Option<String>, String) {
        let mut buf = Vec::new();
        let render = |words: &[u8]| words.iter().map(|&w| WORDS[usize::from(w)]).collect();
        let system = self.system_words(&mut buf).map(render);
        (system, render(&self.own))
    }
}

/// The prompts of a shared-prefix class.
#[derive(Debug)]
struct PrefixPool {
    systems: Vec<Arc<[u8]>>,
    questions: Vec<Vec<Arc<[u8]>>>,
    tokens: u32,
}

fn words(rng: &mut impl Rng, n: u32) -> Vec<u8> {
    (0..n)
        .map(|_| rng.random_range(0..WORDS.len()) as u8)
        .collect()
}

/// The load generator's request contents (`loadgen::workload::generator::Generator`),
/// drawing word indices where it draws words.
#[derive(Debug)]
struct Contents {
    /// The workload, owned: a trace travels to the helper thread to draw its requests.
    workload: Workload,
    adapters: usize,
    zipf_cdf: Vec<Vec<f64>>,
    class_cdf: Vec<f64>,
    pools: Vec<Option<PrefixPool>>,
}

impl Contents {
    fn new(workload: &Workload, seed: u64, step: usize) -> Contents {
        let adapters = workload.fleet.adapters.names().len();
        let zipf_cdf = workload
            .classes
            .iter()
            .map(|c| {
                let s = c.lora.as_ref().map_or(0.0, |l| l.zipf_s);
                cdf((1..=adapters).map(|k| (k as f64).powf(-s)))
            })
            .collect();
        let class_cdf = cdf(workload.class_weights(step).into_iter());
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
                            .map(|_| Arc::from(words(&mut rng, p.question_len)))
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
        Contents {
            workload: workload.clone(),
            adapters,
            zipf_cdf,
            class_cdf,
            pools,
        }
    }

    fn next(&self, at: Duration, rng: &mut SmallRng) -> TraceRequest {
        let class = draw(&self.class_cdf, rng);
        let spec = &self.workload.classes[class];
        let adapter = match &spec.lora {
            Some(l) if self.adapters > 0 && rng.random::<f64>() >= l.base_share => {
                Some(draw(&self.zipf_cdf[class], rng) as u32)
            }
            _ => None,
        };
        let (system, own, prompt_tokens) = match (&self.pools[class], &spec.prompt_tokens) {
            (Some(pool), _) => {
                let g = rng.random_range(0..pool.systems.len());
                let q = rng.random_range(0..pool.questions[g].len());
                let system = System {
                    words: Arc::clone(&pool.systems[g]),
                    copy: 0,
                };
                (Some(system), Arc::clone(&pool.questions[g][q]), pool.tokens)
            }
            (None, Some(d)) => {
                let n = d.sample(rng);
                (None, Arc::from(words(rng, n)), n)
            }
            (None, None) => (None, Arc::from(words(rng, 1)), 1),
        };
        TraceRequest {
            at,
            class,
            adapter,
            system,
            own,
            prompt_tokens,
            max_tokens: spec.output_tokens.sample(rng),
        }
    }
}

/// The requests of one ladder step, in arrival order, drawn as they are taken: Poisson
/// arrivals at `rate × scale.rate` until `duration` or `max_requests`.
#[derive(Debug)]
pub struct StepTrace {
    contents: Contents,
    rng: SmallRng,
    copy_rng: SmallRng,
    copies: u32,
    adapters: u32,
    rate: f64,
    end: f64,
    at: f64,
    left: usize,
}

impl StepTrace {
    /// Step `step` of the ladder at `rate` (the workload's rate, before scaling).
    pub fn new(
        workload: &Workload,
        seed: u64,
        step: usize,
        rate: f64,
        scale: Scale,
        duration: Duration,
        max_requests: Option<usize>,
    ) -> StepTrace {
        StepTrace {
            contents: Contents::new(workload, seed, step),
            rng: SmallRng::seed_from_u64(mix(mix(seed, 0xa771), step as u64)),
            copy_rng: SmallRng::seed_from_u64(mix(mix(seed, 0xc0b1e5), step as u64)),
            copies: scale.copies.max(1),
            adapters: u32::try_from(workload.fleet.adapters.names().len()).unwrap_or(u32::MAX),
            rate: rate * scale.rate,
            end: duration.as_secs_f64(),
            at: 0.0,
            left: max_requests.unwrap_or(usize::MAX),
        }
    }
}

impl Iterator for StepTrace {
    type Item = TraceRequest;

    fn next(&mut self) -> Option<TraceRequest> {
        if self.left == 0 {
            return None;
        }
        let u: f64 = self.rng.random();
        self.at += -(1.0 - u).ln() / self.rate;
        if self.at >= self.end {
            self.left = 0;
            return None;
        }
        self.left -= 1;
        let mut request = self
            .contents
            .next(Duration::from_secs_f64(self.at), &mut self.rng);
        if self.copies > 1 {
            let copy = self.copy_rng.random_range(0..self.copies);
            if let Some(a) = request.adapter.as_mut() {
                *a += copy * self.adapters;
            }
            if let Some(s) = request.system.as_mut() {
                s.copy = copy;
            }
        }
        Some(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::workload::Request;
    use kvroute_core::request::{ApiKind, parse_request};
    use kvroute_sim::tokens::{ChatMessage, render_chat, tokenize};

    fn shipped() -> Vec<Workload> {
        let dir = std::path::Path::new(crate::WORKLOADS_DIR);
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .expect("workloads dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        files
            .iter()
            .map(|f| Workload::from_file(f).expect("workload"))
            .collect()
    }

    fn one() -> Scale {
        Scale {
            rate: 1.0,
            copies: 1,
        }
    }

    fn simulator_tokens(api: Api, live: &Request) -> Vec<u32> {
        match api {
            Api::Completions => {
                let system = live.system.as_deref().unwrap_or("");
                tokenize(&format!("{system}{}", live.prompt))
            }
            Api::Chat => {
                let mut messages = Vec::new();
                if let Some(s) = &live.system {
                    messages.push(ChatMessage {
                        role: "system".into(),
                        content: s.to_string(),
                    });
                }
                messages.push(ChatMessage {
                    role: "user".into(),
                    content: live.prompt.clone(),
                });
                tokenize(&render_chat(&messages))
            }
        }
    }

    #[test]
    fn the_trace_is_the_load_generators_request_for_request() {
        for w in shipped() {
            let rate = w.rates[w.rates.len() / 2];
            let duration = Duration::from_secs(10);
            let live = w.plan_step(w.seed, 1, rate, duration, Some(60));
            let ours: Vec<TraceRequest> =
                StepTrace::new(&w, w.seed, 1, rate, one(), duration, Some(60)).collect();
            assert_eq!(live.len(), ours.len(), "{}", w.name);
            let names = one().adapter_names(&w);
            let mut buf = Vec::new();
            for (l, o) in live.iter().zip(&ours) {
                assert_eq!(l.at, o.at, "{}", w.name);
                assert_eq!(l.class, o.class);
                let model = o.adapter.map_or(w.model.as_str(), |a| &names[a as usize]);
                assert_eq!(l.model, model);
                let (system, own) = o.text();
                assert_eq!(l.system.as_deref(), system.as_deref());
                assert_eq!(l.prompt, own);
                assert_eq!(
                    (l.prompt_tokens, l.max_tokens),
                    (o.prompt_tokens, o.max_tokens)
                );
                // What the simulator and kvroute make of the real body.
                assert_eq!(
                    o.engine_tokens(w.api, &mut buf),
                    simulator_tokens(w.api, l),
                    "{}",
                    w.name
                );
                let kind = match w.api {
                    Api::Completions => ApiKind::Completions,
                    Api::Chat => ApiKind::ChatCompletions,
                };
                let body = serde_json::to_vec(&l.body(w.api, w.ignore_eos)).expect("json");
                let parsed = parse_request(kind, &body).expect("parses");
                assert_eq!(o.inference(w.api, model, &mut buf), parsed, "{}", w.name);
            }
        }
    }

    #[test]
    fn tenant_copies_share_no_prefix_and_copy_zero_is_the_original() {
        let w = shipped()
            .into_iter()
            .find(|w| w.name == "shared-prefix")
            .expect("shipped");
        let scale = Scale {
            rate: 4.0,
            copies: 4,
        };
        let requests: Vec<TraceRequest> =
            StepTrace::new(&w, 1, 0, 8.0, scale, Duration::from_secs(5), None).collect();
        let copies: std::collections::BTreeSet<u32> = requests
            .iter()
            .filter_map(|r| r.system.as_ref().map(|s| s.copy))
            .collect();
        assert_eq!(copies.len(), 4, "every copy is drawn");
        let mut buf = Vec::new();
        let first = requests.first().expect("requests");
        let system = first.system.clone().expect("shared prefix");
        let heads: Vec<Vec<u8>> = (0..4)
            .map(|copy| {
                buf.clear();
                System {
                    words: Arc::clone(&system.words),
                    copy,
                }
                .write(&mut buf);
                assert_eq!(buf[COPY_WORDS..], system.words[COPY_WORDS..]);
                buf[..COPY_WORDS].to_vec()
            })
            .collect();
        assert_eq!(heads[0], system.words[..COPY_WORDS]);
        for i in 0..4 {
            for j in i + 1..4 {
                assert_ne!(heads[i], heads[j]);
            }
        }
        let lora = shipped()
            .into_iter()
            .find(|w| w.name == "multi-lora")
            .expect("shipped");
        let names = scale.adapter_names(&lora);
        assert_eq!(names.len(), 4 * 16);
        assert_eq!(names[..2], ["lora-0".to_string(), "lora-1".to_string()]);
        assert_eq!(names[16], "lora-0-c1");
    }
}
