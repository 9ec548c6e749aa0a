//! Publishing the engine's KV cache events as vLLM does (`vllm/distributed/kv_events.py`).
//!
//! `config` reads vLLM's `--kv-events-config` JSON (`KVEventsConfig`) and the endpoints each
//! pod binds; `wire` encodes a batch in vLLM's msgpack shape; `publisher` runs one pod's
//! ZeroMQ PUB socket and replay ROUTER socket as tokio tasks fed by a bounded queue, so a slow
//! or absent subscriber never holds the engine back. The engine's side (what is recorded and
//! when) is [`crate::engine::KvCacheEvent`].

pub mod config;
pub mod publisher;
pub mod wire;

pub use config::{KvEventsConfig, KvEventsError, PodEndpoints, PublisherKind};
pub use publisher::{KvEventSink, PublisherCounts, PublisherTasks};
