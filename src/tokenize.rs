//! A request's prompt as the engine's token ids.
//!
//! Matching a request against the blocks the pods' KV events reported needs the prompt
//! cut into the same blocks of tokens the engine cut it into: the model's tokenizer, and
//! for a chat request its chat template, tools and generation prompt rendered exactly as
//! the engine renders them. Two ways, one file each: kvroute's own copy of the model's
//! tokenizer and template ([`local`], `--tokenizer`), for the requests it can render
//! exactly, and a pod's `POST /tokenize` ([`pod`]) for the rest, or for every request
//! when no tokenizer is given.

pub mod check;
mod local;
mod pieces;
mod pod;

pub use local::{
    LoadError, LocalTokenizer, LocalTokenizers, PromptKind, TokenizerSpec, Unsupported,
};
pub use pod::{PodTokenizer, TokenizeError, tokenize_body};
