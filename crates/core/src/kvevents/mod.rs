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

use crate::fleet::{PodView, PrefixIndex, PrefixMatches, Snapshot};

pub use event::{BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent, decode_batch};
pub use pod::{
    Applied, BlockSink, CountedSink, EngineCounts, IndexSink, PodEvents, Sequence, chain,
    chain_root, token_block_hashes,
};

/// Where prefix matches come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefixSource {
    /// What kvroute sent to each pod (no events needed).
    #[default]
    Approximate,
    /// The pods' KV events, for every pod: a pod whose events do not flow matches
    /// nothing.
    Precise,
    /// The pods' KV events for pods whose events flow, what kvroute sent for the others.
    Auto,
}

impl PrefixSource {
    /// Whether this source subscribes to the pods' events.
    pub fn uses_events(self) -> bool {
        !matches!(self, PrefixSource::Approximate)
    }
}

/// A prompt's blocks as the event index keys them: chained hashes of the engine's token
/// blocks ([`token_block_hashes`]), `block_tokens` tokens each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBlocks {
    pub chains: Vec<u64>,
    pub block_tokens: u32,
}

/// A prompt's prefix blocks, for matching against both indexes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptBlocks {
    /// Chained hashes of the prompt text's blocks (the approximate index's,
    /// [`crate::fleet::block_hashes`]).
    pub text: Vec<u64>,
    /// The engine's token blocks, when the prompt was tokenized.
    pub tokens: Option<TokenBlocks>,
}

/// The prefix matches a pick uses: `guessed` (the approximate index's) unless the prompt
/// was tokenized, else the event index's, for every pod (`Precise`) or for the pods
/// `streams` says are followed, `guessed` for the others (`Auto`).
///
/// One rule joins the two sources: where the pod kvroute's own memory credits most (the
/// one it last sent the prompt's context to, its *home*) holds half the prompt by that
/// memory and by the events too, it alone draws the request ([`PrefixMatches::homed`]:
/// the other copies still count as the prompt they cache). The events show every copy of
/// a context, and a tenant whose requests follow the copies by load keeps several warm;
/// past a fleet's knee those copies take the KV other tenants' contexts need (on
/// `shared-prefix-pressure`, 32 seeds: prefix hit rate 0.843 against 0.880 for the memory
/// alone, docs/kv-events.md). Drawn home, a tenant's other copies age out. Where the home
/// lost the context, the events decide as before.
pub fn matches_with_events(
    source: PrefixSource,
    events: &PrefixIndex,
    tokens: Option<&TokenBlocks>,
    guessed: PrefixMatches,
    snapshot: &Snapshot,
    streams: impl Fn(&PodView) -> bool,
) -> PrefixMatches {
    let Some(tokens) = tokens.filter(|_| source.uses_events()) else {
        return guessed;
    };
    let exact = events.matches_of(&tokens.chains, tokens.block_tokens, snapshot);
    let matches = match source {
        PrefixSource::Auto => {
            let pods = snapshot.pods();
            PrefixMatches::merge(exact, &guessed, pods.len(), |i| streams(&pods[i]))
        }
        PrefixSource::Precise | PrefixSource::Approximate => exact,
    };
    match guessed.best_pod() {
        Some(home) if guessed.holds_half(home) && matches.holds_half(home) => matches.homed(home),
        _ => matches,
    }
}

#[cfg(test)]
mod tests;
