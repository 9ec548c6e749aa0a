//! kvroute's own tokenizer (`--tokenizer`): the CPU a request's prompt costs before it is
//! matched on the KV event index, where the alternative is a round trip to a pod's
//! `/tokenize` (`docs/kv-events.md`). Chats with a long shared system prompt (a tenant's
//! context, the workload precise routing is for) and a short question, and completions of
//! the same text, on the lab's byte-level BPE (`crates/lab/tokenizers/bpe-4k`, 4,096
//! tokens: smaller vocabularies cut text into more tokens, so this errs on the dear side).
//!
//! Run: `cargo bench --bench tokenize_local`

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute::tokenize::LocalTokenizer;
use kvroute_core::request::ApiKind;
use serde_json::json;

/// English text of `chars` characters: the project's own docs, repeated as needed.
fn text(chars: usize) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let docs = std::fs::read_to_string(root.join("docs/kv-events.md")).unwrap();
    docs.chars().cycle().take(chars).collect()
}

fn tokenize(c: &mut Criterion) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tokenizer = LocalTokenizer::load(&root.join("crates/lab/tokenizers/bpe-4k")).unwrap();
    let mut group = c.benchmark_group("tokenize_local");
    for chars in [2_000, 8_000, 32_000] {
        let context = text(chars);
        let chat = serde_json::to_vec(&json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": context},
                {"role": "user", "content": "What does the second paragraph say about replicas?"},
            ],
        }))
        .unwrap();
        let completion = serde_json::to_vec(&json!({"model": "m", "prompt": context})).unwrap();
        let tokens = tokenizer
            .tokenize(ApiKind::ChatCompletions, &chat)
            .unwrap()
            .len();
        group.throughput(Throughput::Elements(tokens as u64));
        group.bench_with_input(BenchmarkId::new("chat", tokens), &chat, |b, body| {
            b.iter(|| tokenizer.tokenize(ApiKind::ChatCompletions, black_box(body)))
        });
        group.bench_with_input(
            BenchmarkId::new("completion", tokens),
            &completion,
            |b, body| b.iter(|| tokenizer.tokenize(ApiKind::Completions, black_box(body))),
        );
    }
    group.finish();
}

criterion_group!(benches, tokenize);
criterion_main!(benches);
