//! Which requests kvroute routes to pods at all: the paths clients may reach, and how
//! large a body it reads. Everything else a vLLM pod serves (LoRA loading, profiling,
//! `/metrics`, sleep/wake, cache resets) is management, and a gateway that forwards any
//! path lets every client drive it.

use std::sync::Arc;

use kvroute_core::request::ApiKind;

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

/// What the exchange accepts from a client before routing.
#[derive(Debug, Clone)]
pub struct RequestPolicy {
    /// Largest request body read; above it: 413.
    pub max_body_bytes: usize,
    /// Exact paths (query string aside) that are routed; anything else: 404.
    pub allowed_paths: Arc<[String]>,
}

impl RequestPolicy {
    pub fn new(max_body_bytes: usize, allowed_paths: &[String]) -> Self {
        RequestPolicy {
            max_body_bytes,
            allowed_paths: allowed_paths.into(),
        }
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
    fn inference_paths_need_a_body_and_listing_models_does_not() {
        assert!(needs_body("/v1/completions"));
        assert!(needs_body("/v1/chat/completions?x=1"));
        assert!(needs_body("/v1/embeddings"));
        assert!(!needs_body("/v1/models"));
    }
}
