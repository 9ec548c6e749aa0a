//! vLLM's KV cache events: what each engine really caches, published over ZeroMQ.
//!
//! With `--kv-events-config`, every vLLM engine publishes each block it stores in or
//! evicts from its prefix cache. kvroute decodes the batches ([`decode_batch`]) and
//! applies them per pod ([`PodEvents`]) to a prefix index keyed by its own chain hash of
//! the blocks' token ids, the same hash it computes from a request's tokens
//! ([`token_block_hashes`]). That index is exact for the events received, where the
//! approximate one guesses from what kvroute sent. This module is pure: the sockets, the
//! replay requests and the telemetry live in the gateway.

mod event;
pub mod msgpack;
mod pod;

pub use event::{BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent, decode_batch};
pub use pod::{Applied, PodEvents, Sequence, chain, chain_root, token_block_hashes};

#[cfg(test)]
mod tests;
