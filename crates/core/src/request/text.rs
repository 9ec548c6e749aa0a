//! The measure of a prompt as it streams past: a token estimate and a bounded prefix.

use super::*;

/// The first bytes of a text built from pieces joined by `'\n'`, never longer than `limit`.
pub(super) struct Prefix {
    pub(super) bytes: Vec<u8>,
    pub(super) pieces: usize,
    pub(super) limit: usize,
}

impl Prefix {
    pub(super) fn new(limit: usize) -> Prefix {
        Prefix {
            bytes: Vec::new(),
            pieces: 0,
            limit,
        }
    }

    pub(super) fn reset(&mut self, limit: usize) {
        self.bytes.clear();
        self.pieces = 0;
        self.limit = limit;
    }

    pub(super) fn room(&self) -> usize {
        self.limit.saturating_sub(self.bytes.len())
    }

    pub(super) fn push(&mut self, piece: &[u8]) {
        if self.pieces > 0 {
            self.extend(b"\n");
        }
        self.extend(piece);
        self.pieces += 1;
    }

    pub(super) fn extend(&mut self, bytes: &[u8]) {
        let kept = bytes.get(..self.room()).unwrap_or(bytes);
        self.bytes.extend_from_slice(kept);
    }
}

/// The measure of a prompt: its token estimate and its bounded prefix.
pub(super) struct Prompt {
    pub(super) tokens: u64,
    pub(super) prefix: Prefix,
}

impl Default for Prompt {
    fn default() -> Prompt {
        Prompt {
            tokens: 0,
            prefix: Prefix::new(PROMPT_PREFIX_BYTES),
        }
    }
}

impl Prompt {
    pub(super) fn add_tokens(&mut self, tokens: impl Into<u64>) {
        self.tokens = self.tokens.saturating_add(tokens.into());
    }

    /// Counts `text` as one separately tokenized text and appends it to the prefix.
    pub(super) fn add_text(&mut self, text: &[u8]) {
        self.add_tokens(estimate_tokens(text.len()));
        self.prefix.push(text);
    }
}
