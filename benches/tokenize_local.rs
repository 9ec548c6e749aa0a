//! kvroute's own tokenizer (`--tokenizer`): the CPU a request's prompt costs before it is
//! matched on the KV event index, where the alternative is a round trip to a pod's
//! `/tokenize` (`docs/kv-events.md`). Chats with a long shared system prompt (a tenant's
//! context, the workload precise routing is for) and a short question, and completions of
//! the same text, on the lab's byte-level BPE (`crates/lab/tokenizers/bpe-4k`, 4,096
//! tokens: smaller vocabularies cut text into more tokens, so this errs on the dear side).
//! Each with the long pieces remembered (the default: a context sent again is copied, a
//! new one encoded and remembered) and encoded whole (`--tokenizer-cache-mib 0`).
//!
//! An agent's turn with tools and tool calls too.
//!
//! Run: `cargo bench --bench tokenize_local`

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
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
    let dir = root.join("crates/lab/tokenizers/bpe-4k");
    // Remembering the long pieces (the default), and encoding every prompt whole.
    let remembering = LocalTokenizer::load(&dir, 64 << 20).unwrap();
    let whole = LocalTokenizer::load(&dir, 0).unwrap();
    let mut group = c.benchmark_group("tokenize_local");
    for chars in [2_000, 8_000, 32_000] {
        let context = text(chars);
        let chat = |context: &str| {
            serde_json::to_vec(&json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": context},
                    {"role": "user", "content": "What does the second paragraph say about replicas?"},
                ],
            }))
            .unwrap()
        };
        let shared = chat(&context);
        let completion = serde_json::to_vec(&json!({"model": "m", "prompt": context})).unwrap();
        let tokens = whole
            .tokenize(ApiKind::ChatCompletions, &shared)
            .unwrap()
            .len();
        group.throughput(Throughput::Elements(tokens as u64));
        // A tenant's context sent again: its piece is remembered.
        group.bench_with_input(
            BenchmarkId::new("chat_shared_context", tokens),
            &shared,
            |b, body| b.iter(|| remembering.tokenize(ApiKind::ChatCompletions, black_box(body))),
        );
        // A context never seen: encoded, then remembered (the price of a miss).
        let mut fresh = 0u64;
        group.bench_function(BenchmarkId::new("chat_new_context", tokens), |b| {
            b.iter_batched(
                || {
                    fresh += 1;
                    chat(&format!("{fresh} {context}"))
                },
                |body| remembering.tokenize(ApiKind::ChatCompletions, &body),
                BatchSize::SmallInput,
            )
        });
        group.bench_with_input(
            BenchmarkId::new("chat_whole", tokens),
            &shared,
            |b, body| b.iter(|| whole.tokenize(ApiKind::ChatCompletions, black_box(body))),
        );
        group.bench_with_input(
            BenchmarkId::new("completion_shared", tokens),
            &completion,
            |b, body| b.iter(|| remembering.tokenize(ApiKind::Completions, black_box(body))),
        );
        group.bench_with_input(
            BenchmarkId::new("completion_whole", tokens),
            &completion,
            |b, body| b.iter(|| whole.tokenize(ApiKind::Completions, black_box(body))),
        );
    }
    agent_turns(&mut group);
    group.finish();
}

/// An agent's turn: a long system prompt, five tools with JSON schemas, and a history of
/// tool calls and results, rendered by a template that writes the tools as JSON into the
/// system turn (as Llama 3.1's and Qwen's do). Before tools were rendered here, such a
/// request waited for a pod's `/tokenize`.
fn agent_turns(group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            root.join("crates/lab/tokenizers/bpe-4k").join(file),
            dir.path().join(file),
        )
        .unwrap();
    }
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n\
         {%- if loop.first and tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}\
         {%- if m.tool_calls %}{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \
         \"arguments\": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}\
         <|eot_id|>{%- endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n",
    )
    .unwrap();
    let tokenizer = LocalTokenizer::load(dir.path(), 64 << 20).unwrap();
    let tools: Vec<_> = [
        "read_file",
        "write_file",
        "run_tests",
        "search_code",
        "list_dir",
    ]
    .iter()
    .map(|name| {
        json!({"type": "function", "function": {"name": name,
                "description": format!("{name}: see the repository's conventions before calling."),
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string", "description": "A path inside the repository."},
                    "limit": {"type": "integer", "minimum": 1}}, "required": ["path"]}}})
    })
    .collect();
    let mut messages = vec![
        json!({"role": "system", "content": text(8_000)}),
        json!({"role": "user", "content": "Fix the failing test in the scheduler."}),
    ];
    for k in 0..4 {
        let id = format!("call_{k}");
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
            "type": "function", "function": {"name": "read_file",
            "arguments": format!("{{\"path\": \"src/scheduler/part{k}.rs\", \"limit\": 200}}")}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": text(600 + 100 * k)}));
    }
    let body =
        serde_json::to_vec(&json!({"model": "m", "tools": tools, "messages": messages})).unwrap();
    let tokens = tokenizer
        .tokenize(ApiKind::ChatCompletions, &body)
        .unwrap()
        .len();
    group.throughput(Throughput::Elements(tokens as u64));
    group.bench_with_input(
        BenchmarkId::new("chat_agent_turn", tokens),
        &body,
        |b, body| b.iter(|| tokenizer.tokenize(ApiKind::ChatCompletions, black_box(body))),
    );
}

criterion_group!(benches, tokenize);
criterion_main!(benches);
