use std::path::PathBuf;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::{AddedToken, Tokenizer};

use super::*;

fn fixture() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crates/lab/tokenizers/bpe-4k");
    Tokenizer::from_file(dir.join("tokenizer.json")).expect("the fixture loads")
}

fn whole(tokenizer: &Tokenizer, text: &str, add_special_tokens: bool) -> Vec<u32> {
    tokenizer
        .encode_fast(text, add_special_tokens)
        .expect("encodes")
        .get_ids()
        .to_vec()
}

/// A random text of words, whitespace, accents and the fixture's special tokens, now and
/// then a long run that is remembered.
fn random_text(rng: &mut SmallRng, long: &[String]) -> String {
    const FRAGMENTS: [&str; 14] = [
        "the",
        " cache",
        "  pods",
        "\n",
        "\n\n",
        " ",
        "é",
        "日本",
        "42",
        "don't",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|begin_of_text|>",
    ];
    let mut text = String::new();
    for _ in 0..rng.random_range(0..40) {
        if rng.random_bool(0.05) {
            text.push_str(&long[rng.random_range(0..long.len())]);
        } else {
            text.push_str(FRAGMENTS[rng.random_range(0..FRAGMENTS.len())]);
        }
    }
    text
}

#[test]
fn pieces_encode_as_the_whole_text_encodes_remembered_or_not() {
    let tokenizer = fixture();
    let pieces = Pieces::new(&tokenizer, 1 << 20).expect("the fixture encodes by pieces");
    assert!(
        pieces.wrap.is_some(),
        "its BOS is all add_special_tokens adds"
    );
    let docs = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/kv-events.md"),
    )
    .expect("docs");
    let long: Vec<String> = (0..4)
        .map(|k| docs.chars().skip(k * 3_000).take(2_000).collect())
        .collect();
    let mut rng = SmallRng::seed_from_u64(7);
    let mut remembered = 0;
    for case in 0..400 {
        let text = random_text(&mut rng, &long);
        for add in [false, true] {
            let (ids, reuse) = pieces
                .encode(&tokenizer, &text, add, usize::MAX)
                .expect("encodes")
                .expect("within no limit");
            assert_eq!(
                ids,
                whole(&tokenizer, &text, add),
                "case {case} ({add}): {text:?}"
            );
            remembered += reuse.remembered;
        }
    }
    assert!(
        remembered > 0,
        "the long runs were copied, not encoded again"
    );
}

#[test]
fn a_long_piece_is_encoded_once_then_copied() {
    let tokenizer = fixture();
    let pieces = Pieces::new(&tokenizer, 1 << 20).expect("by pieces");
    let context = "A tenant's context, long enough to remember. ".repeat(40);
    let text = |question: &str| {
        format!("<|start_header_id|>system<|end_header_id|>{context}<|eot_id|>{question}")
    };
    let (_, first) = pieces
        .encode(&tokenizer, &text("Who?"), false, usize::MAX)
        .expect("encodes")
        .expect("encodes");
    assert_eq!(first.remembered, 0);
    let (ids, second) = pieces
        .encode(&tokenizer, &text("Why?"), false, usize::MAX)
        .expect("encodes")
        .expect("encodes");
    assert_eq!(ids, whole(&tokenizer, &text("Why?"), false));
    assert!(second.remembered > 300 && second.encoded < 5, "{second:?}");
}

#[test]
fn remembered_pieces_stay_within_the_budget_the_least_recently_used_forgotten_first() {
    let tokenizer = fixture();
    let budget = 40_000;
    let pieces = Pieces::new(&tokenizer, budget).expect("by pieces");
    let piece = |k: usize| format!("Context number {k}: {}", "words of it ".repeat(60));
    let reused = |k: usize| {
        pieces
            .encode(&tokenizer, &piece(k), false, usize::MAX)
            .expect("encodes")
            .expect("encodes")
            .1
            .remembered
    };
    reused(0);
    for k in 1..60 {
        // Piece 0 is used all along: never the least recent.
        assert!(reused(0) > 0, "piece 0 forgotten at {k}");
        reused(k);
        let (bytes, budget) = pieces.remembered_bytes();
        assert!(bytes <= budget, "{bytes} bytes remembered");
    }
    assert_eq!(reused(1), 0, "an early piece unused since was forgotten");
    assert!(reused(59) > 0, "the latest piece is remembered");
}

#[test]
fn short_pieces_are_remembered_apart_and_cannot_push_a_context_out() {
    let tokenizer = fixture();
    let budget = 64 << 10;
    let pieces = Pieces::new(&tokenizer, budget).expect("by pieces");
    let context = "A tenant's context, long enough to remember. ".repeat(40);
    let system = format!("<|start_header_id|>system<|end_header_id|>{context}<|eot_id|>");
    let user =
        |question: &str| format!("<|start_header_id|>user<|end_header_id|>{question}<|eot_id|>");
    let encode = |text: &str| {
        pieces
            .encode(&tokenizer, text, false, usize::MAX)
            .expect("encodes")
            .expect("encodes")
    };
    let first = format!("{system}{}", user("Who?"));
    encode(&first);
    // The headers and the question were remembered too: nothing is encoded again.
    let (ids, again) = encode(&first);
    assert_eq!(ids, whole(&tokenizer, &first, false));
    assert_eq!(again.encoded, 0, "{again:?}");
    // Twice the whole budget of new questions while the context waits: they push out
    // each other only.
    let (_, short_budget) = pieces.short_bytes();
    assert_eq!(short_budget, budget / 16);
    let mut filled = 0;
    for k in 0.. {
        let question = format!("question number {k}, asked once and never again");
        let (ids, _) = encode(&user(&question));
        filled += 4 * ids.len() + 64;
        let (bytes, within) = pieces.short_bytes();
        assert!(bytes <= within, "{bytes} bytes of short pieces");
        if filled > 2 * budget {
            break;
        }
    }
    // The context is still copied (the header before it, a short piece, was pushed out).
    let (_, reuse) = encode(&system);
    let context_tokens = whole(&tokenizer, &context, false).len();
    assert!(
        reuse.remembered >= context_tokens,
        "the context stays: {reuse:?}"
    );
    let (_, reuse) = encode(&user("question number 0, asked once and never again"));
    assert!(
        reuse.encoded > 0,
        "the first question was forgotten: {reuse:?}"
    );
}

#[test]
fn tokenizers_whose_pieces_depend_on_each_other_encode_whole() {
    // A special token that strips the whitespace beside it.
    let mut stripping = fixture();
    stripping.add_special_tokens(&[AddedToken::from("<|strip|>", true).lstrip(true)]);
    assert!(Pieces::new(&stripping, 1 << 20).is_none());

    // A Metaspace pre-tokenizer that marks only the sequence's first word: after a
    // special token, a word is not the first.
    let vocab = [
        ("<unk>", 0),
        ("▁Hello", 1),
        ("Hello", 2),
        ("▁world", 3),
        ("<s>", 4),
    ]
    .into_iter()
    .map(|(token, id)| (token.to_owned(), id))
    .collect();
    let model = WordLevel::builder()
        .vocab(vocab)
        .unk_token("<unk>".into())
        .build()
        .expect("a model");
    let mut first_only = Tokenizer::new(model);
    first_only.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, true)));
    first_only.add_special_tokens(&[AddedToken::from("<s>", true)]);
    assert_ne!(
        whole(&first_only, "<s>Hello world", false)[1],
        whole(&first_only, "Hello world", false)[0],
        "the probe would see the difference"
    );
    assert!(Pieces::new(&first_only, 1 << 20).is_none());
}

#[test]
fn within_a_budget_only_what_is_remembered_is_free() {
    let tokenizer = fixture();
    let pieces = Pieces::new(&tokenizer, 1 << 20).expect("by pieces");
    let context = "A tenant's context, long enough to remember. ".repeat(40);
    let text = format!("<|start_header_id|>system<|end_header_id|>{context}<|eot_id|>Who?");
    // Unseen, the context is more than 200 bytes of fresh text: not within them.
    assert_eq!(
        pieces
            .encode(&tokenizer, &text, false, 200)
            .expect("encodes"),
        None
    );
    let (whole_ids, _) = pieces
        .encode(&tokenizer, &text, false, usize::MAX)
        .expect("encodes")
        .expect("no limit");
    // Remembered now: only the question's few bytes are fresh.
    let (ids, reuse) = pieces
        .encode(&tokenizer, &text, false, 200)
        .expect("encodes")
        .expect("within 200 bytes");
    assert_eq!(ids, whole_ids);
    assert!(reuse.remembered > 500 && reuse.encoded < 10, "{reuse:?}");
}
