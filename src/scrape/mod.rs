//! Polling each pod: `/metrics` (load, KV cache, LoRA state) often, `/v1/models`
//! (what it serves) now and then. The parsers are pure and live in `kvroute-core`;
//! this module owns the HTTP side and its settings.

mod connection;
mod http1;
mod poller;

use std::path::PathBuf;
use std::time::Duration;

pub(crate) use connection::{PodStream, open as open_pod_stream};
pub use poller::{ScrapeError, ScrapeManager, tls_connector};

/// How pods are polled.
#[derive(Debug, Clone, PartialEq)]
pub struct ScrapeConfig {
    pub interval: Duration,
    pub timeout: Duration,
    pub models_interval: Duration,
    /// Most scrapes in flight at once; `None`: one per pod, no overall cap.
    pub concurrency: Option<usize>,
    /// Largest /metrics or /v1/models body read; a pod sending more is failing.
    pub max_response_bytes: usize,
    /// Bearer token for `/v1/models` on pods started with vLLM's `--api-key` (which
    /// guards `/v1/*`, not `/metrics`).
    pub pod_api_key: Option<ApiKey>,
    /// Scrape over HTTPS, trusting only the CAs in this PEM bundle; `None`: plain HTTP.
    pub pod_ca_bundle: Option<PathBuf>,
}

/// A secret that never appears in logs or debug output.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(pub String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(redacted)")
    }
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
            models_interval: Duration::from_secs(5),
            concurrency: None,
            max_response_bytes: 8 << 20,
            pod_api_key: None,
            pod_ca_bundle: None,
        }
    }
}
