//! `/metrics` of a simulated pod, in the exposition format and names of a recent vLLM (V1 engine).
//!
//! Like Python's `prometheus_client`, labels are sorted by name, floats are written with a
//! decimal point, counters are declared without their `_total` suffix in `# HELP` / `# TYPE`,
//! and `vllm:lora_requests_info` keeps one series per label set it has exported, the newest
//! (largest value: a unix timestamp) being current. Some series are the simulator's own and not
//! vLLM's: `kvroute_sim:lora_loads_total{source="disk"|"host"}`, adapter loads for benchmarks,
//! and, on a pod publishing KV events, where it publishes and how many batches went out or were
//! dropped ([`render_kv_events`]).

use std::fmt::Write;

use super::engine::Engine;
use super::kv_events::KvEventSink;
use super::stats::Histogram;

/// What the renderer needs besides the engine.
#[derive(Debug, Clone, Copy)]
pub struct RenderContext<'a> {
    /// Served model name (`model_name` label).
    pub model: &'a str,
    /// Unix time (seconds) of simulated time zero.
    pub epoch_unix: f64,
}

fn f(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else {
        format!("{v:?}")
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn labels(pairs: &[(&str, &str)]) -> String {
    let mut sorted: Vec<&(&str, &str)> = pairs.iter().collect();
    sorted.sort_by_key(|(k, _)| *k);
    let inner: Vec<String> = sorted
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    format!("{{{}}}", inner.join(","))
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn gauge(out: &mut String, name: &str, help: &str, base: &[(&str, &str)], v: f64) {
    header(out, name, "gauge", help);
    let _ = writeln!(out, "{name}{} {}", labels(base), f(v));
}

fn counter(out: &mut String, name: &str, help: &str, base: &[(&str, &str)], v: u64) {
    header(out, name, "counter", help);
    let _ = writeln!(out, "{name}_total{} {}", labels(base), f(v as f64));
}

fn histogram(out: &mut String, name: &str, help: &str, base: &[(&str, &str)], h: &Histogram) {
    header(out, name, "histogram", help);
    for (bound, count) in h.bounds().iter().zip(h.cumulative()) {
        let le = f(*bound);
        let mut l = base.to_vec();
        l.push(("le", &le));
        let _ = writeln!(out, "{name}_bucket{} {}", labels(&l), f(count as f64));
    }
    let mut l = base.to_vec();
    l.push(("le", "+Inf"));
    let _ = writeln!(out, "{name}_bucket{} {}", labels(&l), f(h.count() as f64));
    let _ = writeln!(out, "{name}_count{} {}", labels(base), f(h.count() as f64));
    let _ = writeln!(out, "{name}_sum{} {}", labels(base), f(h.sum()));
}

/// Renders the exposition text of one pod.
pub fn render(engine: &Engine, ctx: RenderContext<'_>) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let base: &[(&str, &str)] = &[("engine", "0"), ("model_name", ctx.model)];
    let load = engine.load();
    let stats = engine.stats();
    let cfg = engine.config();

    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        base,
        load.running as f64,
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        base,
        load.waiting as f64,
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        base,
        load.kv_usage,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        base,
        stats.prefix_cache_queries,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        base,
        stats.prefix_cache_hits,
    );
    counter(
        &mut out,
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        base,
        stats.preemptions,
    );
    counter(
        &mut out,
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        base,
        stats.prompt_tokens,
    );
    counter(
        &mut out,
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        base,
        stats.generation_tokens,
    );

    header(
        &mut out,
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
    );
    for (reason, v) in [
        ("stop", stats.success_stop),
        ("length", stats.success_length),
        ("abort", stats.aborted),
    ] {
        let mut l = base.to_vec();
        l.push(("finished_reason", reason));
        let _ = writeln!(
            out,
            "vllm:request_success_total{} {}",
            labels(&l),
            f(v as f64)
        );
    }

    let hists: [(&str, &str, &Histogram); 9] = [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &stats.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &stats.itl,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &stats.e2e,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &stats.queue,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            &stats.inference,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            &stats.prefill,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            &stats.decode,
        ),
        (
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            &stats.prompt_len,
        ),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &stats.generation_len,
        ),
    ];
    for (name, help, h) in hists {
        histogram(&mut out, name, help, base, h);
    }

    let num_blocks = cfg.num_gpu_blocks.to_string();
    let block_size = cfg.block_size.to_string();
    let capacity = (u64::from(cfg.num_gpu_blocks) * u64::from(cfg.block_size)).to_string();
    let prefix = if cfg.enable_prefix_caching {
        "True"
    } else {
        "False"
    };
    gauge(
        &mut out,
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        &[
            ("block_size", &block_size),
            ("cache_dtype", "auto"),
            ("calculate_kv_scales", "False"),
            ("cpu_offload_gb", "0"),
            ("enable_prefix_caching", prefix),
            ("engine", "0"),
            ("gpu_memory_utilization", "0.9"),
            ("is_attention_free", "False"),
            ("kv_cache_size_tokens", &capacity),
            ("num_cpu_blocks", "None"),
            ("num_gpu_blocks", &num_blocks),
            ("num_gpu_blocks_override", "None"),
            ("prefix_caching_hash_algo", "sha256"),
            ("sliding_window", "None"),
            ("swap_space", "4"),
            ("swap_space_bytes", "4294967296"),
        ],
        1.0,
    );

    if engine.lora_enabled() {
        let max_lora = cfg.max_loras.to_string();
        header(
            &mut out,
            "vllm:lora_requests_info",
            "gauge",
            "Running stats on lora requests.",
        );
        for info in engine.lora_history() {
            let l = labels(&[
                ("max_lora", &max_lora),
                ("running_lora_adapters", &info.running),
                ("waiting_lora_adapters", &info.waiting),
            ]);
            let ts = ctx.epoch_unix + info.since.as_secs_f64();
            let _ = writeln!(out, "vllm:lora_requests_info{l} {}", f(ts));
        }
        // Not a vLLM metric: the simulator's own count, for benchmarks.
        let loads = engine.lora_loads();
        header(
            &mut out,
            "kvroute_sim:lora_loads",
            "counter",
            "Adapter loads into a GPU slot completed, by where the weights came from (simulator only, not a vLLM metric).",
        );
        for (source, v) in [("disk", loads.disk), ("host", loads.host)] {
            let mut l = base.to_vec();
            l.push(("source", source));
            let _ = writeln!(
                out,
                "kvroute_sim:lora_loads_total{} {}",
                labels(&l),
                f(v as f64)
            );
        }
    }
    out
}

/// Appends a publishing pod's KV event series: where it publishes (an info gauge) and its
/// batches by outcome (published, or dropped because the queue to the publisher was full).
pub fn render_kv_events(out: &mut String, model: &str, sink: &KvEventSink) {
    use std::sync::atomic::Ordering;
    let base: &[(&str, &str)] = &[("engine", "0"), ("model_name", model)];
    let replay = sink.replay_endpoint.as_deref().unwrap_or("");
    let mut info = base.to_vec();
    info.extend([
        ("endpoint", sink.endpoint.as_str()),
        ("replay_endpoint", replay),
        ("topic", sink.topic.as_str()),
    ]);
    header(
        out,
        "kvroute_sim:kv_events_publisher_info",
        "gauge",
        "Where this pod publishes its KV cache events (simulator only, not a vLLM metric).",
    );
    let _ = writeln!(
        out,
        "kvroute_sim:kv_events_publisher_info{} 1.0",
        labels(&info)
    );
    header(
        out,
        "kvroute_sim:kv_event_batches",
        "counter",
        "KV cache event batches published, or dropped because the queue to the publisher was full (simulator only, not a vLLM metric).",
    );
    let counts = sink.counts();
    for (outcome, n) in [
        ("dropped", counts.dropped.load(Ordering::Relaxed)),
        ("published", counts.published.load(Ordering::Relaxed)),
    ] {
        let mut l = base.to_vec();
        l.push(("outcome", outcome));
        let _ = writeln!(
            out,
            "kvroute_sim:kv_event_batches_total{} {}",
            labels(&l),
            f(n as f64)
        );
    }
}

/// The exposition `text` with only the samples whose name is in `names`, and the
/// `# HELP` / `# TYPE` lines of the families that keep a sample: what prometheus_client's
/// restricted registry renders (it matches sample names, so a counter is asked for by its
/// `_total` name and a histogram by its `_bucket`, `_count` and `_sum` names).
pub fn restrict(text: &str, names: &[&str]) -> String {
    let mut out = String::with_capacity(text.len().min(4096));
    let mut family_header = String::new();
    for line in text.lines() {
        if line.starts_with("# HELP ") {
            family_header.clear();
        }
        if line.starts_with('#') {
            family_header.push_str(line);
            family_header.push('\n');
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or_default();
        if names.contains(&name) {
            out.push_str(&family_header);
            family_header.clear();
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::profile::Profile;

    #[test]
    fn the_exposition_has_vllm_names_and_sorted_labels() {
        let profile = Profile::by_name("h100-llama3-8b").expect("profile");
        let engine = Engine::new(EngineConfig::default(), profile);
        let text = render(
            &engine,
            RenderContext {
                model: "m",
                epoch_unix: 1.7e9,
            },
        );
        assert!(text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n"));
        assert!(text.contains("# TYPE vllm:num_preemptions counter\n"));
        assert!(text.contains("vllm:num_preemptions_total{engine=\"0\",model_name=\"m\"} 0.0\n"));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 0.0"
        ));
        assert!(text.contains("num_gpu_blocks=\"25959\""));
        assert!(text.contains(
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1700000000.0"
        ));
        assert!(text.contains(
            "kvroute_sim:lora_loads_total{engine=\"0\",model_name=\"m\",source=\"disk\"} 0.0\n"
        ));
    }

    #[test]
    fn adapter_loads_are_counted_by_source_from_disk_then_from_the_host_cache() {
        use crate::engine::{FinishReason, RequestSpec};
        let profile = Profile::by_name("h100-llama3-8b").expect("profile");
        let cfg = EngineConfig {
            max_loras: 1,
            max_cpu_loras: 2,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(cfg, profile);
        // a (cold), b (cold, evicts a), a again (from the host cache).
        for (i, adapter) in ["a", "b", "a"].into_iter().enumerate() {
            let now = engine.now();
            engine.add_request(
                now,
                RequestSpec {
                    prompt: vec![i as u32 + 1; 32],
                    adapter: Some(adapter.into()),
                    max_output: 2,
                    finish_reason: FinishReason::Length,
                    output_seed: 1,
                },
            );
            while let Some(t) = engine.next_event_time() {
                engine.advance(t);
            }
        }
        let text = render(
            &engine,
            RenderContext {
                model: "m",
                epoch_unix: 0.0,
            },
        );
        assert!(
            text.contains("# TYPE kvroute_sim:lora_loads counter\n"),
            "{text}"
        );
        assert!(text.contains(
            "kvroute_sim:lora_loads_total{engine=\"0\",model_name=\"m\",source=\"disk\"} 2.0\n"
        ));
        assert!(text.contains(
            "kvroute_sim:lora_loads_total{engine=\"0\",model_name=\"m\",source=\"host\"} 1.0\n"
        ));
        let without_lora = Engine::new(
            EngineConfig {
                max_loras: 0,
                ..EngineConfig::default()
            },
            Profile::by_name("h100-llama3-8b").expect("profile"),
        );
        let text = render(
            &without_lora,
            RenderContext {
                model: "m",
                epoch_unix: 0.0,
            },
        );
        assert!(!text.contains("kvroute_sim:lora_loads"));
    }
}
