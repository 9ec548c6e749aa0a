//! A rendered prompt cut at the tokenizer's special tokens, each piece's tokens
//! remembered.
//!
//! A tokenizer splits its input at its special tokens before anything else, then
//! normalizes, pre-tokenizes and encodes each piece on its own: the pieces' encodings,
//! joined by the special tokens' ids, are the text's. A chat template writes special
//! tokens between messages, so a tenant's long system prompt is one piece, the same in
//! every request it sends. Encoding it once instead of per request takes a 32 KiB context
//! from about 8 ms of CPU to a hash and a copy (`benches/tokenize_local.rs`). Short pieces
//! repeat as much (a role's header, an agent's tool call) and each costs the tokenizer
//! several microseconds whatever its length, so they are remembered too, apart: in a
//! pool of their own, a sixteenth of the budget, where a stream of new questions pushes
//! out only other short pieces, never a tenant's context.
//!
//! Whether a tokenizer really encodes pieces independently is checked when it is loaded,
//! on probes around each special token: a `Metaspace` pre-tokenizer that marks only the
//! sequence's first word, or special tokens that strip the whitespace beside them, make
//! the pieces depend on one another, and such a tokenizer encodes every text whole.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use tokenizers::Tokenizer;

/// Pieces at least this long are remembered among the long ones, shorter ones in their own
/// pool.
const LONG_FROM_BYTES: usize = 512;
/// The share of the budget that remembers short pieces: 1 / this.
const SHORT_SHARE: usize = 16;
/// What an entry costs besides its ids: the key, the map's slot, the `Arc`'s header.
const ENTRY_OVERHEAD_BYTES: usize = 64;

/// Encodes texts piece by piece, remembering the long pieces' tokens.
pub(super) struct Pieces {
    /// The tokenizer's special tokens (those it splits at before normalizing), matched
    /// leftmost-longest as the tokenizer matches them.
    specials: AhoCorasick,
    /// Each pattern's token id.
    ids: Vec<u32>,
    /// What `add_special_tokens` puts before and after a sequence's tokens, where that is
    /// all it does (checked on probes); else such texts are encoded whole.
    wrap: Option<(Vec<u32>, Vec<u32>)>,
    /// Pieces of [`LONG_FROM_BYTES`] or more.
    remembered: Mutex<Remembered>,
    /// Shorter pieces.
    short: Mutex<Remembered>,
}

/// How much a text may have encoded afresh.
enum Fresh {
    /// This many more bytes; long pieces are remembered.
    Within(usize),
    /// Any amount, nothing remembered: the probes at load.
    Probing,
}

/// What a piece lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Reuse {
    /// Tokens copied from remembered pieces.
    pub(super) remembered: usize,
    /// Tokens encoded now.
    pub(super) encoded: usize,
}

impl Pieces {
    /// For `tokenizer`, remembering up to `budget` bytes of pieces; `None` where its
    /// pieces do not encode independently.
    pub(super) fn new(tokenizer: &Tokenizer, budget: usize) -> Option<Self> {
        let mut specials: Vec<(String, u32)> = Vec::new();
        for (id, token) in tokenizer.get_added_tokens_decoder() {
            if token.normalized {
                continue;
            }
            // Stripping the whitespace beside a token, or matching it only as a whole
            // word, ties a piece to its neighbours.
            if token.lstrip || token.rstrip || token.single_word {
                return None;
            }
            specials.push((token.content, id));
        }
        // A stable pattern order (the map's is not): ties in length break alike each time.
        specials.sort();
        let specials_matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(specials.iter().map(|(content, _)| content))
            .ok()?;
        let mut pieces = Pieces {
            specials: specials_matcher,
            ids: specials.iter().map(|&(_, id)| id).collect(),
            wrap: None,
            remembered: Mutex::new(Remembered::new(budget - budget / SHORT_SHARE)),
            short: Mutex::new(Remembered::new(budget / SHORT_SHARE)),
        };
        let probes = probes(specials.iter().map(|(content, _)| content.as_str()));
        let whole = |text: &str, add: bool| {
            tokenizer
                .encode_fast(text, add)
                .map(|e| e.get_ids().to_vec())
                .ok()
        };
        for probe in &probes {
            let (split, _) = pieces
                .encode_unwrapped(tokenizer, probe, &mut Fresh::Probing)
                .ok()??;
            if Some(split) != whole(probe, false) {
                return None;
            }
        }
        pieces.wrap = wrap_of(&probes, whole);
        Some(pieces)
    }

    /// The tokens of `text`, and how many came from remembered pieces; `None` once more
    /// than `fresh_bytes` of text not remembered would have to be encoded; `Err` where the
    /// tokenizer failed.
    pub(super) fn encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
        fresh_bytes: usize,
    ) -> Result<Option<(Vec<u32>, Reuse)>, String> {
        let mut budget = Fresh::Within(fresh_bytes);
        if !add_special_tokens {
            return self.encode_unwrapped(tokenizer, text, &mut budget);
        }
        let Some((before, after)) = &self.wrap else {
            return encode_whole(tokenizer, text, true, fresh_bytes);
        };
        let Some((body, reuse)) = self.encode_unwrapped(tokenizer, text, &mut budget)? else {
            return Ok(None);
        };
        let mut ids = Vec::with_capacity(before.len() + body.len() + after.len());
        ids.extend_from_slice(before);
        ids.extend_from_slice(&body);
        ids.extend_from_slice(after);
        Ok(Some((ids, reuse)))
    }

    /// The tokens of `text` without the sequence's special tokens, piece by piece,
    /// remembering long pieces unless `budget` says not to.
    fn encode_unwrapped(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        budget: &mut Fresh,
    ) -> Result<Option<(Vec<u32>, Reuse)>, String> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut reuse = Reuse::default();
        let mut start = 0;
        for found in self.specials.find_iter(text) {
            let piece = &text[start..found.start()];
            if !self.piece(tokenizer, piece, budget, &mut ids, &mut reuse)? {
                return Ok(None);
            }
            ids.push(self.ids[found.pattern().as_usize()]);
            start = found.end();
        }
        if !self.piece(tokenizer, &text[start..], budget, &mut ids, &mut reuse)? {
            return Ok(None);
        }
        Ok(Some((ids, reuse)))
    }

    /// Appends the tokens of `piece` (no special token in it) to `ids`; `false` where
    /// that would encode more than `budget` allows.
    fn piece(
        &self,
        tokenizer: &Tokenizer,
        piece: &str,
        budget: &mut Fresh,
        ids: &mut Vec<u32>,
        reuse: &mut Reuse,
    ) -> Result<bool, String> {
        if piece.is_empty() {
            return Ok(true);
        }
        let pool = if piece.len() >= LONG_FROM_BYTES {
            &self.remembered
        } else {
            &self.short
        };
        let remember = matches!(budget, Fresh::Within(_));
        let key = remember.then(|| xxhash_rust::xxh3::xxh3_128(piece.as_bytes()));
        if let Some(known) = key.and_then(|key| lock(pool).get(key)) {
            reuse.remembered += known.len();
            ids.extend_from_slice(&known);
            return Ok(true);
        }
        if let Fresh::Within(left) = budget {
            let Some(rest) = left.checked_sub(piece.len()) else {
                return Ok(false);
            };
            *left = rest;
        }
        let encoded: Arc<[u32]> = encode(tokenizer, piece, false)?.into();
        reuse.encoded += encoded.len();
        ids.extend_from_slice(&encoded);
        if let Some(key) = key {
            lock(pool).insert(key, encoded);
        }
        Ok(true)
    }

    /// Bytes of long pieces remembered now, and their budget.
    #[cfg(test)]
    pub(super) fn remembered_bytes(&self) -> (usize, usize) {
        let remembered = lock(&self.remembered);
        (remembered.bytes, remembered.budget)
    }

    /// Bytes of short pieces remembered now, and their budget.
    #[cfg(test)]
    pub(super) fn short_bytes(&self) -> (usize, usize) {
        let short = lock(&self.short);
        (short.bytes, short.budget)
    }
}

/// A pool of remembered pieces (a panic elsewhere while holding it leaves a consistent
/// map: each change is one insert or removal).
fn lock(pool: &Mutex<Remembered>) -> std::sync::MutexGuard<'_, Remembered> {
    pool.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The tokens of `text` encoded whole, nothing remembered; `None` where it is longer than
/// `fresh_bytes`.
pub(super) fn encode_whole(
    tokenizer: &Tokenizer,
    text: &str,
    add_special_tokens: bool,
    fresh_bytes: usize,
) -> Result<Option<(Vec<u32>, Reuse)>, String> {
    if text.len() > fresh_bytes {
        return Ok(None);
    }
    let ids = encode(tokenizer, text, add_special_tokens)?;
    let encoded = ids.len();
    Ok(Some((
        ids,
        Reuse {
            encoded,
            ..Reuse::default()
        },
    )))
}

fn encode(tokenizer: &Tokenizer, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
    tokenizer
        .encode_fast(text, add_special_tokens)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| e.to_string())
}

/// Texts around each special token: at either end, twice, beside spaces, newlines and
/// words, and without any.
fn probes<'a>(specials: impl Iterator<Item = &'a str>) -> Vec<String> {
    let words = [
        "Hello world",
        " leading space",
        "trailing space ",
        "\n\nTwo lines\nhere\n",
        "naïve café 日本語",
    ];
    let mut probes: Vec<String> = words.iter().map(|w| (*w).to_owned()).collect();
    for special in specials {
        for (a, b) in words.iter().zip(words.iter().cycle().skip(1)) {
            probes.push(format!("{special}{a}{special}{b}"));
            probes.push(format!("{a}{special}{special}{b}{special}"));
        }
    }
    probes
}

/// What encoding with `add_special_tokens` puts around every probe's own tokens, if
/// that is all it does.
fn wrap_of(
    probes: &[String],
    whole: impl Fn(&str, bool) -> Option<Vec<u32>>,
) -> Option<(Vec<u32>, Vec<u32>)> {
    let first = probes.first()?;
    let (wrapped, bare) = (whole(first, true)?, whole(first, false)?);
    let at = (0..=wrapped.len().checked_sub(bare.len())?)
        .find(|&at| wrapped[at..at + bare.len()] == bare[..])?;
    let (before, after) = (wrapped[..at].to_vec(), wrapped[at + bare.len()..].to_vec());
    probes
        .iter()
        .all(|probe| {
            let (Some(wrapped), Some(bare)) = (whole(probe, true), whole(probe, false)) else {
                return false;
            };
            wrapped.len() == before.len() + bare.len() + after.len()
                && wrapped.starts_with(&before)
                && wrapped.ends_with(&after)
                && wrapped[before.len()..before.len() + bare.len()] == bare[..]
        })
        .then_some((before, after))
}

/// Remembered pieces within a byte budget, the least recently used forgotten first.
struct Remembered {
    entries: HashMap<u128, Entry>,
    bytes: usize,
    budget: usize,
    /// Lookups so far: each entry's last use is a tick of it.
    clock: u64,
}

struct Entry {
    ids: Arc<[u32]>,
    used: u64,
}

impl Remembered {
    fn new(budget: usize) -> Self {
        Remembered {
            entries: HashMap::new(),
            bytes: 0,
            budget,
            clock: 0,
        }
    }

    fn cost(ids: &[u32]) -> usize {
        std::mem::size_of_val(ids) + ENTRY_OVERHEAD_BYTES
    }

    fn get(&mut self, key: u128) -> Option<Arc<[u32]>> {
        self.clock += 1;
        let entry = self.entries.get_mut(&key)?;
        entry.used = self.clock;
        Some(Arc::clone(&entry.ids))
    }

    fn insert(&mut self, key: u128, ids: Arc<[u32]>) {
        let cost = Self::cost(&ids);
        if cost > self.budget / 4 {
            // One piece a quarter of the budget would soon push everything else out.
            return;
        }
        self.clock += 1;
        if let Some(old) = self.entries.insert(
            key,
            Entry {
                ids,
                used: self.clock,
            },
        ) {
            self.bytes -= Self::cost(&old.ids);
        }
        self.bytes += cost;
        if self.bytes > self.budget {
            self.forget_oldest();
        }
    }

    /// Forgets the least recently used entries until three quarters of the budget are
    /// used: a sort now and then rather than a list kept in order on every lookup.
    fn forget_oldest(&mut self) {
        let mut by_use: Vec<(u64, u128)> = self
            .entries
            .iter()
            .map(|(&key, entry)| (entry.used, key))
            .collect();
        by_use.sort_unstable();
        let target = self.budget / 4 * 3;
        for (_, key) in by_use {
            if self.bytes <= target {
                break;
            }
            if let Some(entry) = self.entries.remove(&key) {
                self.bytes -= Self::cost(&entry.ids);
            }
        }
    }
}

#[cfg(test)]
mod tests;
