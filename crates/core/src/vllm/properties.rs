//! Property tests of the vLLM page readers: generated pods (one or several engines, current
//! or legacy names, with or without cache config, LoRA series, counters, and the histogram
//! noise a real page is mostly made of) written as `/metrics` text read back to the numbers
//! put in; `/v1/models` answers read back to their base models and adapters; no input,
//! whole or mutated, panics either reader.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::testing::{config, json_value, sample_line, tricky_char, tricky_text};

const FIXTURES: [&str; 5] = [
    include_str!("../../tests/fixtures/metrics/vllm-v0.11-single-engine.txt"),
    include_str!("../../tests/fixtures/metrics/vllm-v0.6-legacy.txt"),
    include_str!("../../tests/fixtures/metrics/vllm-dp2-lora.txt"),
    include_str!("../../tests/fixtures/metrics/vllm-v0.11-dp4.txt"),
    include_str!("../../tests/fixtures/metrics/not-vllm.txt"),
];

#[derive(Debug, Clone)]
struct Engine {
    /// Requests waiting and running per served model name.
    waiting: Vec<u32>,
    running: Vec<u32>,
    kv_usage: f64,
    /// `kv_cache_size_tokens` of this engine's cache config, when stated.
    tokens: Option<u64>,
    preemptions: u32,
    prefix_hits: u32,
    prefix_queries: u32,
}

#[derive(Debug, Clone)]
struct Lora {
    max_lora: u32,
    running: Vec<String>,
    waiting: Vec<String>,
}

#[derive(Debug, Clone)]
struct Pod {
    engines: Vec<Engine>,
    /// Engine labels written on single-engine pods too (`engine="0"`).
    label_single_engine: bool,
    legacy_kv_name: bool,
    /// `(num_gpu_blocks, block_size)` of `cache_config_info`; `None`: no such series.
    cache: Option<(Option<u64>, Option<u32>)>,
    /// LoRA series in page order; the one with the largest timestamp is current.
    lora: Vec<(u32, Lora)>,
    counters: bool,
    noise: Vec<(String, Vec<u32>)>,
}

fn adapter_name() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "sql-lora",
        "chat_lora",
        "a",
        "\u{e9}t\u{e9}-lora",
        "x:y",
    ])
    .prop_map(str::to_owned)
}

fn lora() -> impl Strategy<Value = Lora> {
    (
        0u32..16,
        prop::collection::vec(adapter_name(), 0..3),
        prop::collection::vec(adapter_name(), 0..3),
    )
        .prop_map(|(max_lora, running, waiting)| Lora {
            max_lora,
            running,
            waiting,
        })
}

fn engine(models: usize) -> impl Strategy<Value = Engine> {
    (
        prop::collection::vec(0u32..500, models),
        prop::collection::vec(0u32..500, models),
        prop_oneof![4 => 0.0f64..=1.0, 1 => 1.0f64..1.2, 1 => Just(0.0)],
        prop::option::weighted(0.7, 1u64..10_000_000),
        (0u32..1000, 0u32..100_000, 0u32..100_000),
    )
        .prop_map(
            |(waiting, running, kv_usage, tokens, (preemptions, hits, queries))| Engine {
                waiting,
                running,
                kv_usage,
                tokens,
                preemptions,
                prefix_hits: hits,
                prefix_queries: queries,
            },
        )
}

fn pod() -> impl Strategy<Value = Pod> {
    (1usize..=2, 1usize..=4)
        .prop_flat_map(|(models, engines)| prop::collection::vec(engine(models), engines))
        .prop_flat_map(|engines| {
            (
                Just(engines),
                any::<bool>(),
                prop::bool::weighted(0.2),
                prop::option::weighted(
                    0.8,
                    (
                        prop::option::weighted(0.9, 1u64..1_000_000),
                        prop::option::weighted(0.9, prop::sample::select(vec![16u32, 32, 64])),
                    ),
                ),
                prop::collection::vec((0u32..2_000_000_000, lora()), 0..3),
                any::<bool>(),
                prop::collection::vec(
                    (
                        prop::sample::select(vec![
                            "vllm:e2e_request_latency_seconds",
                            "vllm:time_to_first_token_seconds",
                            "vllm:request_prompt_tokens",
                        ])
                        .prop_map(str::to_owned),
                        prop::collection::vec(0u32..50, 1..8),
                    ),
                    0..3,
                ),
            )
        })
        .prop_map(
            |(engines, label_single_engine, legacy_kv_name, cache, lora, counters, noise)| Pod {
                engines,
                label_single_engine,
                legacy_kv_name,
                cache,
                lora,
                counters,
                noise,
            },
        )
}

fn labels(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(name, value)| ((*name).to_owned(), value.clone()))
        .collect()
}

fn or_none<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "None".to_owned(), |value| value.to_string())
}

/// The pod's page, the way vLLM (prometheus_client) writes it.
fn render(pod: &Pod) -> String {
    let mut text = String::new();
    let mut line = |name: &str, labels: Vec<(String, String)>, value: f64| {
        text.push_str(&sample_line(name, &labels, &format!("{value:?}")));
        text.push('\n');
    };
    let labelled = pod.engines.len() > 1 || pod.label_single_engine;
    let engine_label = |index: usize| labelled.then(|| ("engine", index.to_string()));
    for (name, bounds) in &pod.noise {
        let mut cumulative = 0;
        for (bound, count) in bounds.iter().enumerate() {
            cumulative += count;
            let le = ("le", format!("{:?}", 0.5 * (bound as f64 + 1.0)));
            line(
                &format!("{name}_bucket"),
                labels(&[le]),
                f64::from(cumulative),
            );
        }
        line(&format!("{name}_count"), Vec::new(), f64::from(cumulative));
    }
    for (index, engine) in pod.engines.iter().enumerate() {
        let engine_label: Vec<(&str, String)> = engine_label(index).into_iter().collect();
        for (model, (waiting, running)) in engine.waiting.iter().zip(&engine.running).enumerate() {
            let mut series = engine_label.clone();
            series.push(("model_name", format!("model-{model}")));
            line(WAITING, labels(&series), f64::from(*waiting));
            line(RUNNING, labels(&series), f64::from(*running));
        }
        let kv_name = if pod.legacy_kv_name {
            KV_USAGE_LEGACY
        } else {
            KV_USAGE
        };
        line(kv_name, labels(&engine_label), engine.kv_usage);
        if pod.counters {
            line(
                PREEMPTIONS,
                labels(&engine_label),
                f64::from(engine.preemptions),
            );
            line(
                PREFIX_HITS,
                labels(&engine_label),
                f64::from(engine.prefix_hits),
            );
            line(
                PREFIX_QUERIES,
                labels(&engine_label),
                f64::from(engine.prefix_queries),
            );
        }
        if let Some((blocks, block_size)) = pod.cache {
            let mut series = vec![
                ("block_size", or_none(block_size)),
                ("cache_dtype", "auto".to_owned()),
                ("num_gpu_blocks", or_none(blocks)),
            ];
            series.extend(engine_label.iter().cloned());
            if let Some(tokens) = engine.tokens {
                series.push(("kv_cache_size_tokens", tokens.to_string()));
            }
            line(CACHE_CONFIG, labels(&series), 1.0);
        }
    }
    if pod.cache.is_some() {
        // prometheus_client's child for a label set merely named: describes no engine.
        line(CACHE_CONFIG, labels(&[("engine", String::new())]), 0.0);
    }
    for (timestamp, lora) in &pod.lora {
        let series = [
            ("max_lora", lora.max_lora.to_string()),
            ("running_lora_adapters", lora.running.join(",")),
            ("waiting_lora_adapters", lora.waiting.join(",")),
        ];
        line(LORA_INFO, labels(&series), f64::from(*timestamp));
    }
    text
}

/// What [`parse_vllm_metrics`] must read from the page of `pod`.
fn expected(pod: &Pod) -> PodMetrics {
    let sum = |of: fn(&Engine) -> u32| pod.engines.iter().map(|e| u64::from(of(e))).sum::<u64>();
    let all_tokens: Option<Vec<u64>> = pod
        .cache
        .and_then(|_| pod.engines.iter().map(|e| e.tokens).collect());
    let weights: Vec<f64> = match &all_tokens {
        Some(tokens) => tokens.iter().map(|&t| t as f64).collect(),
        None => vec![1.0; pod.engines.len()],
    };
    let total_weight: f64 = weights.iter().sum();
    let kv_usage = pod
        .engines
        .iter()
        .zip(&weights)
        .map(|(engine, weight)| engine.kv_usage.min(1.0) * weight / total_weight)
        .sum::<f64>()
        .clamp(0.0, 1.0);
    let (blocks, block_size) = pod.cache.unwrap_or((None, None));
    let labelled = pod.engines.len() > 1 || pod.label_single_engine;
    // Equal timestamps: the first series stays current.
    let newest = pod
        .lora
        .iter()
        .fold(None::<&(u32, Lora)>, |newest, series| match newest {
            Some(known) if known.0 >= series.0 => Some(known),
            _ => Some(series),
        });
    let counter = |of: fn(&Engine) -> u32| pod.counters.then(|| sum(of) as f64);
    PodMetrics {
        waiting: u32::try_from(
            pod.engines
                .iter()
                .flat_map(|e| &e.waiting)
                .map(|&w| u64::from(w))
                .sum::<u64>(),
        )
        .expect("small"),
        running: u32::try_from(
            pod.engines
                .iter()
                .flat_map(|e| &e.running)
                .map(|&r| u64::from(r))
                .sum::<u64>(),
        )
        .expect("small"),
        kv_usage,
        kv_capacity_tokens: match (&all_tokens, blocks, block_size) {
            (Some(tokens), _, _) => Some(tokens.iter().sum()),
            (None, Some(blocks), Some(size)) => Some(blocks * u64::from(size)),
            _ => None,
        },
        num_gpu_blocks: blocks,
        block_size,
        engines: if labelled {
            pod.engines.len() as u32
        } else {
            1
        },
        lora: newest.map(|(_, lora)| LoraStatus {
            max_lora: lora.max_lora,
            running: lora.running.clone(),
            waiting: lora.waiting.clone(),
        }),
        preemptions_total: counter(|e| e.preemptions),
        prefix_cache_hits_total: counter(|e| e.prefix_hits),
        prefix_cache_queries_total: counter(|e| e.prefix_queries),
    }
}

/// A `/v1/models` entry: `(id, parent)`, the parent absent (`None`), `null`
/// (`Some(None)`), or named.
type ModelEntry = (String, Option<Option<String>>);

fn model_entry() -> impl Strategy<Value = ModelEntry> {
    let id = prop_oneof![
        prop::sample::select(vec!["llama", "sql-lora", "qwen", "chat-lora"])
            .prop_map(str::to_owned),
        tricky_text(10),
    ];
    (
        id,
        prop::option::of(prop::option::of(
            prop::sample::select(vec!["llama", "qwen", "sql-lora"]).prop_map(str::to_owned),
        )),
    )
}

fn models_body(entries: &[ModelEntry], extra: &[(String, Value)]) -> Vec<u8> {
    let data: Vec<Value> = entries
        .iter()
        .map(|(id, parent)| {
            let mut entry = serde_json::Map::new();
            entry.insert("id".into(), id.clone().into());
            entry.insert("object".into(), "model".into());
            entry.insert("max_model_len".into(), 8192.into());
            if let Some(parent) = parent {
                entry.insert(
                    "parent".into(),
                    parent.clone().map_or(Value::Null, Value::from),
                );
            }
            for (key, value) in extra {
                if key != "id" && key != "parent" {
                    entry.insert(key.clone(), value.clone());
                }
            }
            Value::Object(entry)
        })
        .collect();
    serde_json::to_vec(&json!({"object": "list", "data": data})).expect("serializes")
}

proptest! {
    #![proptest_config(config(300))]

    #[test]
    fn rendered_pods_parse_to_the_values_put_in(pod in pod()) {
        let text = render(&pod);
        let got = parse_vllm_metrics(&text)
            .map_err(|err| TestCaseError::fail(format!("{err}\n{text}")))?;
        let want = expected(&pod);
        prop_assert!((got.kv_usage - want.kv_usage).abs() < 1e-9, "kv usage {} != {}\n{}", got.kv_usage, want.kv_usage, text);
        prop_assert_eq!(PodMetrics { kv_usage: want.kv_usage, ..got }, want);
    }

    #[test]
    fn mutated_fixture_pages_never_panic(
        fixture in prop::sample::select(FIXTURES.to_vec()),
        edits in prop::collection::vec(
            (any::<prop::sample::Index>(), 0usize..4, tricky_char()),
            1..6,
        ),
    ) {
        let mut text = fixture.to_owned();
        for (at, kind, c) in edits {
            // Edits land on char boundaries: the caller decodes the body before parsing.
            let boundaries: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
            let at = boundaries[at.index(boundaries.len())];
            match kind {
                0 if at < text.len() => {
                    text.remove(at);
                }
                1 => text.insert(at, c),
                2 => text.insert_str(at, "\nvllm:num_requests_waiting{engine=\"9\"} "),
                _ => text.truncate(at),
            }
        }
        if let Err(VllmMetricsError::Exposition(err)) = parse_vllm_metrics(&text) {
            prop_assert!(err.line() <= text.split('\n').count());
        }
    }

    #[test]
    fn arbitrary_text_never_panics_the_metrics_reader(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = parse_vllm_metrics(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn model_lists_parse_to_their_base_models_and_adapters(
        entries in prop::collection::vec(model_entry(), 0..6),
        extra in prop::collection::vec((tricky_text(6), json_value(2)), 0..3),
    ) {
        let served = parse_models(&models_body(&entries, &extra))
            .map_err(|err| TestCaseError::fail(err.to_string()))?;
        let mut sorted = served.base.clone();
        sorted.sort();
        sorted.dedup();
        prop_assert_eq!(&served.base, &sorted, "base models are sorted and distinct");
        for (id, parent) in &entries {
            match parent {
                Some(Some(parent)) if parent != id => prop_assert!(served.adapters.contains_key(id)),
                _ => prop_assert!(served.base.contains(id)),
            }
            prop_assert!(served.serves(id));
        }
        // An adapter's base is the parent its last entry names.
        for (id, base) in &served.adapters {
            let last = entries.iter().rev().find_map(|(entry, parent)| match parent {
                Some(Some(parent)) if entry == id && parent != id => Some(parent),
                _ => None,
            });
            prop_assert_eq!(Some(base), last);
        }
        prop_assert!(served.base.iter().all(|id| entries.iter().any(|(entry, _)| entry == id)));
    }

    #[test]
    fn arbitrary_bytes_or_json_never_panic_the_models_reader(
        bytes in prop::collection::vec(any::<u8>(), 0..120),
        value in json_value(5),
    ) {
        let _ = parse_models(&bytes);
        let _ = parse_models(&serde_json::to_vec(&json!({"data": [value.clone()]})).expect("serializes"));
        let _ = parse_models(&serde_json::to_vec(&value).expect("serializes"));
    }
}
