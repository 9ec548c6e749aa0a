//! Which requests kvroute routes to pods at all: the paths clients may reach, and how
//! large a body it reads. Everything else a vLLM pod serves (LoRA loading, profiling,
//! `/metrics`, sleep/wake, cache resets) is management, and a gateway that forwards any
//! path lets every client drive it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_core::request::ApiKind;

use crate::flow::FlowSettings;

/// The paths routed by default: the OpenAI inference API a client needs.
///
/// Left out, each for a reason: `/v1/responses` (a `previous_response_id` lives in one
/// pod's memory, so routing by load breaks conversations), `/tokenize` and
/// `/detokenize` (tools, not inference; add them if clients use them), audio and
/// multipart APIs (kvroute cannot read their bodies), and every management path.
pub const DEFAULT_ALLOWED_PATHS: [&str; 4] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/embeddings",
];

/// Default of [`RequestPolicy::read_timeout`]: Envoy sends a request's headers at once
/// and its body as it arrives, so only a stalled client or a stream that never speaks
/// takes this long.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Default of [`RequestPolicy::max_silent_streams`]: about 22 MiB of streams that sent
/// nothing (≈ 5.6 KiB each), against thousands a second of Envoy's streams, each silent
/// only until its headers arrive a moment after it opens.
pub const DEFAULT_MAX_SILENT_STREAMS: usize = 4096;

/// Default of [`RequestPolicy::held_body_budget`]: 64 bodies of the default 16 MiB limit.
pub const DEFAULT_HELD_BODY_BUDGET: usize = 1 << 30;

/// What the exchange accepts from a client before routing.
#[derive(Debug)]
pub struct RequestPolicy {
    /// Largest request body read; above it: 413.
    pub max_body_bytes: usize,
    /// Exact paths (query string aside) that are routed; anything else: 404.
    pub allowed_paths: Arc<[String]>,
    /// Request bodies held at once, across all streams, while kvroute reads them;
    /// beyond it a request gets 503 with `retry-after` rather than kvroute running out
    /// of memory.
    pub held_body_budget: BodyBudget,
    /// How long a stream may take, from its start, to deliver its whole request; then a
    /// request is answered 408 and a stream that sent nothing is closed.
    pub read_timeout: Duration,
    /// Streams that have sent no message yet, across all connections; a stream opened
    /// beyond it is refused (RESOURCE_EXHAUSTED), so silent streams spread over many
    /// connections cannot hold more than this many streams' memory.
    pub max_silent_streams: usize,
    /// How a request's class headers are read (objective → priority, fairness id).
    pub flow: Arc<FlowSettings>,
}

impl RequestPolicy {
    pub fn new(max_body_bytes: usize, allowed_paths: &[String]) -> Self {
        RequestPolicy {
            max_body_bytes,
            allowed_paths: allowed_paths.into(),
            held_body_budget: BodyBudget::new(DEFAULT_HELD_BODY_BUDGET),
            read_timeout: DEFAULT_READ_TIMEOUT,
            max_silent_streams: DEFAULT_MAX_SILENT_STREAMS,
            flow: Arc::new(FlowSettings::default()),
        }
    }

    /// The same policy, reading request classes with `flow`.
    pub fn with_flow(mut self, flow: Arc<FlowSettings>) -> Self {
        self.flow = flow;
        self
    }

    /// The same policy with another read timeout.
    pub fn with_read_timeout(mut self, timeout: Duration) -> Self {
        self.read_timeout = timeout;
        self
    }

    /// The same policy admitting at most `streams` silent streams at once.
    pub fn with_max_silent_streams(mut self, streams: usize) -> Self {
        self.max_silent_streams = streams;
        self
    }

    /// The same policy with a budget of `bytes` for held bodies.
    pub fn with_held_body_budget(mut self, bytes: usize) -> Self {
        self.held_body_budget = BodyBudget::new(bytes);
        self
    }

    /// The default paths and `max_body_bytes`.
    pub fn with_default_paths(max_body_bytes: usize) -> Self {
        let paths: Vec<String> = DEFAULT_ALLOWED_PATHS.map(str::to_owned).to_vec();
        RequestPolicy::new(max_body_bytes, &paths)
    }

    /// Whether `path` (an HTTP `:path`, possibly with a query) may reach a pod.
    pub fn allows(&self, path: &str) -> bool {
        let path = path_only(path);
        self.allowed_paths.iter().any(|allowed| allowed == path)
    }
}

/// Bytes of request bodies held across all streams, against a limit.
#[derive(Debug)]
pub struct BodyBudget {
    held: AtomicUsize,
    limit: usize,
}

impl BodyBudget {
    pub fn new(limit: usize) -> Self {
        BodyBudget {
            held: AtomicUsize::new(0),
            limit,
        }
    }

    /// Takes `bytes` from the budget, unless that would pass the limit.
    pub fn try_take(&self, bytes: usize) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&total| total <= self.limit)
            })
            .is_ok()
    }

    /// Returns what [`BodyBudget::try_take`] took.
    pub fn give_back(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// Whether a request on `path` must carry a body to be served: the APIs whose body
/// names the model and holds the input.
pub fn needs_body(path: &str) -> bool {
    match ApiKind::from_path(path) {
        ApiKind::Completions | ApiKind::ChatCompletions => true,
        ApiKind::Other => path_only(path) == "/v1/embeddings",
    }
}

fn path_only(path: &str) -> &str {
    path.split_once('?').map_or(path, |(path, _query)| path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listed_paths_are_allowed_whatever_their_query() {
        let policy = RequestPolicy::with_default_paths(1024);
        assert!(policy.allows("/v1/chat/completions"));
        assert!(policy.allows("/v1/models?limit=1"));
        for refused in [
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/metrics",
            "/v1/completions/",
            "/V1/completions",
            "/v1/chat/completions/../../metrics",
            "",
            "*",
        ] {
            assert!(!policy.allows(refused), "{refused} must be refused");
        }
    }

    #[test]
    fn the_body_budget_refuses_what_would_pass_its_limit_and_takes_back_returns() {
        let budget = BodyBudget::new(100);
        assert!(budget.try_take(60));
        assert!(!budget.try_take(41), "161 > 100");
        assert!(budget.try_take(40));
        assert_eq!(budget.held(), 100);
        budget.give_back(60);
        assert!(budget.try_take(60));
        assert!(!budget.try_take(usize::MAX), "no overflow");
    }

    #[test]
    fn inference_paths_need_a_body_and_listing_models_does_not() {
        assert!(needs_body("/v1/completions"));
        assert!(needs_body("/v1/chat/completions?x=1"));
        assert!(needs_body("/v1/embeddings"));
        assert!(!needs_body("/v1/models"));
    }
}
