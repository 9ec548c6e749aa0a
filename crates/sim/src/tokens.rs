//! A synthetic, prefix-stable tokenizer and the synthetic output vocabulary.
//!
//! Text is cut left to right into tokens of at most four characters, a whitespace character
//! always starting a new token (so ` the` is one token, as in BPE vocabularies). That is about
//! the ~4 characters per token of English under Llama-3's tokenizer, and two texts sharing a
//! prefix share the token prefix (up to the last, possibly cut, token), which is what prefix
//! caching and prefix-aware routers rely on. Token ids are a hash of the piece into a 128k vocab.

use super::kv::mix;

/// Size of the synthetic vocabulary (Llama 3's is 128,256).
pub const VOCAB: u32 = 128_000;

const MAX_CHARS: usize = 4;

/// Token ids of `text`.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 3 + 1);
    let mut h: u64 = 0;
    let mut n = 0usize;
    for c in text.chars() {
        if n > 0 && (n == MAX_CHARS || c.is_whitespace()) {
            out.push(piece_id(h));
            h = 0;
            n = 0;
        }
        h = mix(h, u64::from(c));
        n += 1;
    }
    if n > 0 {
        out.push(piece_id(h));
    }
    out
}

fn piece_id(h: u64) -> u32 {
    (h % u64::from(VOCAB)) as u32
}

/// One chat message as far as the template cares.
#[derive(Debug, Clone)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`.
    pub role: String,
    /// Text content (array content parts concatenated).
    pub content: String,
}

/// Renders messages with a Llama-3-style chat template (with the generation prompt).
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut s = String::from("<|begin_of_text|>");
    for m in messages {
        s.push_str("<|start_header_id|>");
        s.push_str(&m.role);
        s.push_str("<|end_header_id|>\n\n");
        s.push_str(&m.content);
        s.push_str("<|eot_id|>");
    }
    s.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
    s
}

/// Words of the synthetic output; each is one token of the tokenizer above.
const WORDS: [&str; 32] = [
    " the", " a", " of", " to", " in", " and", " is", " it", " for", " on", " as", " at", " by",
    " we", " be", " or", " an", " so", " if", " no", " up", " do", " go", " my", " me", " he",
    " us", " all", " can", " new", " one", " way",
];

/// Synthetic output token `index` of a request whose output seed is `seed`: `(id, text)`.
pub fn output_token(seed: u64, index: u32) -> (u32, &'static str) {
    // Each word's id, tokenized once (every generated token used to tokenize its word).
    static IDS: std::sync::OnceLock<[u32; WORDS.len()]> = std::sync::OnceLock::new();
    let ids = IDS.get_or_init(|| WORDS.map(|w| tokenize(w).first().copied().unwrap_or(0)));
    let i = (mix(seed, u64::from(index)) % WORDS.len() as u64) as usize;
    (ids[i], WORDS[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_about_four_characters() {
        let text = "The quick brown fox jumps over the lazy dog and keeps running far away.";
        let n = tokenize(text).len();
        assert!((text.len() / 5..=text.len() / 3).contains(&n), "{n}");
    }

    #[test]
    fn a_shared_text_prefix_gives_a_shared_token_prefix() {
        let a = tokenize("You are a helpful assistant. Question one?");
        let b = tokenize("You are a helpful assistant. Another question entirely");
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert!(common >= 8, "{common}");
    }

    #[test]
    fn each_output_word_is_one_token() {
        for w in WORDS {
            assert_eq!(tokenize(w).len(), 1, "{w:?}");
        }
    }
}
