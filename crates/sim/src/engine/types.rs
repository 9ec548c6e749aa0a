//! The engine's public types: its configuration, the requests it takes, the events and
//! summaries it emits, and the load and LoRA snapshots it reports.

use std::time::Duration;

/// Simulated time since the engine's epoch.
pub type SimTime = Duration;

/// Id the engine gives each request.
pub type RequestId = u64;

/// Scheduler and cache limits of one engine (vLLM's engine arguments).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// KV blocks in the GPU pool.
    pub num_gpu_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Most sequences in one batch.
    pub max_num_seqs: usize,
    /// Token budget of one step (chunked prefill).
    pub max_num_batched_tokens: u32,
    /// Adapter slots (distinct adapters per batch); 0 disables LoRA.
    pub max_loras: usize,
    /// Adapters kept in host memory.
    pub max_cpu_loras: usize,
    /// Time to load an adapter that is not in host memory.
    pub lora_load: Duration,
    /// Relative standard deviation of the step time.
    pub jitter: f64,
    /// Whether full blocks are reused across requests.
    pub enable_prefix_caching: bool,
    /// Seed of the jitter.
    pub seed: u64,
    /// Whether the engine keeps its latency and length histograms (`vllm:time_to_first_token_seconds`
    /// and the others on `/metrics`). An offline simulation, which measures every request
    /// itself and reads no pod's page, switches them off: observing every token's latency
    /// into a histogram of each of a thousand pods costs a tenth of its time.
    pub histograms: bool,
    /// Whether each output token is an [`EventKind::Token`] event. Off, the engine only
    /// counts the gaps between a request's tokens ([`Engine::take_token_gaps`]): an
    /// offline simulation, which streams nothing, measures inter-token latency from them
    /// without handing over an event for each of a hundred million tokens.
    ///
    /// [`Engine::take_token_gaps`]: super::Engine::take_token_gaps
    pub token_events: bool,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            num_gpu_blocks: 25_959,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_loras: 4,
            max_cpu_loras: 4,
            lora_load: Duration::from_millis(150),
            jitter: 0.02,
            enable_prefix_caching: true,
            seed: 0,
            histograms: true,
            token_events: true,
        }
    }
}

/// Why a request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model "stopped" (end of sequence) after `max_output` tokens.
    Stop,
    /// `max_tokens` was reached.
    Length,
}

/// A request as the engine sees it.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// LoRA adapter name (None: the base model).
    pub adapter: Option<String>,
    /// Tokens to generate (at least 1).
    pub max_output: u32,
    /// Reason reported once `max_output` tokens are out.
    pub finish_reason: FinishReason,
    /// Seed of the synthetic output tokens.
    pub output_seed: u64,
}

/// What happened to a request, at simulated time `at`.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The request.
    pub id: RequestId,
    /// When.
    pub at: SimTime,
    /// What.
    pub kind: EventKind,
}

/// Kinds of [`Event`].
#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// Output token number `index` (0-based) was generated.
    Token {
        /// Position in the output.
        index: u32,
        /// Synthetic token id.
        token_id: u32,
    },
    /// The request finished (after its last token event, where tokens are events).
    /// Boxed: an event is pushed and moved for every token, and the summary would triple
    /// the size of all of them.
    Finished(Box<Summary>),
}

/// Per-request accounting reported at the end.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache at first scheduling.
    pub cached_tokens: u32,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// When it arrived.
    pub arrival: SimTime,
    /// Arrival to first scheduling.
    pub queue: Duration,
    /// Arrival to first token.
    pub ttft: Duration,
    /// Arrival to last token.
    pub e2e: Duration,
    /// Times it was preempted.
    pub preemptions: u32,
}

/// Point-in-time counts of an engine, for `/metrics` and `/get_load`.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineLoad {
    /// Requests waiting (queued, preempted, or waiting for an adapter).
    pub waiting: usize,
    /// Requests in the running batch.
    pub running: usize,
    /// Share of KV blocks referenced by requests.
    pub kv_usage: f64,
    /// Tokens held by running requests.
    pub tokens_in_use: u64,
}

/// One entry of the LoRA info history (`vllm:lora_requests_info`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraInfo {
    /// Adapters with running requests, sorted, comma-separated.
    pub running: String,
    /// Adapters with waiting requests, sorted, comma-separated.
    pub waiting: String,
    /// When this set became current.
    pub since: SimTime,
}
