//! Polling each pod: `/metrics` (load, KV cache, LoRA state) often, `/v1/models`
//! (what it serves) now and then. The parsers are pure and live in `kvroute-core`;
//! this module owns the HTTP side and its settings.

mod poller;

use std::time::Duration;

pub use poller::{ScrapeError, ScrapeManager};

/// How pods are polled.
#[derive(Debug, Clone, PartialEq)]
pub struct ScrapeConfig {
    pub interval: Duration,
    pub timeout: Duration,
    pub models_interval: Duration,
    pub concurrency: usize,
    /// Largest /metrics or /v1/models body read; a pod sending more is failing.
    pub max_response_bytes: usize,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
            models_interval: Duration::from_secs(5),
            concurrency: 64,
            max_response_bytes: 8 << 20,
        }
    }
}
