//! Polling each pod: `/metrics` (load, KV cache, LoRA state) often, `/v1/models`
//! (what it serves) now and then. Parsers are pure and live in their own files.

pub mod exposition;
pub mod models;
mod poller;
pub mod vllm;

pub use poller::{ScrapeError, ScrapeManager};
