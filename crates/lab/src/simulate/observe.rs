//! What kvroute's scraper would read from a simulated pod, built from the engine's state.
//!
//! The live path renders the engine into vLLM's exposition text (`kvroute_sim::metrics`)
//! and parses it back (`kvroute_core::vllm::parse_vllm_metrics`): tens of microseconds a
//! pod, too slow for a thousand pods scraped twenty times a virtual second. [`pod_metrics`]
//! builds the same [`PodMetrics`] from the engine directly; a test checks that both agree
//! at every step of a run with preemptions, adapter loads and prefix hits.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_core::fleet::{LoraStatus, PodMetrics, ServedModels};
use kvroute_sim::engine::{Engine, LoraInfo};

/// The adapter list of a `vllm:lora_requests_info` label, as the parser splits it.
fn adapter_list(label: &str) -> Vec<String> {
    label
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The LoRA series the parser takes as current: the first of the newest timestamp.
fn current_lora(history: &[LoraInfo]) -> Option<&LoraInfo> {
    let mut newest: Option<&LoraInfo> = None;
    for info in history {
        if newest.is_none_or(|n| info.since > n.since) {
            newest = Some(info);
        }
    }
    newest
}

/// The pod's metrics as kvroute parses its `/metrics` page.
pub fn pod_metrics(engine: &Engine) -> PodMetrics {
    let (waiting, running, kv_usage) = engine.gauges();
    let cfg = engine.config();
    let stats = engine.stats();
    let lora = if engine.lora_enabled() {
        current_lora(engine.lora_history()).map(|info| LoraStatus {
            max_lora: u32::try_from(cfg.max_loras).unwrap_or(u32::MAX),
            running: adapter_list(&info.running),
            waiting: adapter_list(&info.waiting),
        })
    } else {
        None
    };
    PodMetrics {
        waiting: u32::try_from(waiting).unwrap_or(u32::MAX),
        running: u32::try_from(running).unwrap_or(u32::MAX),
        kv_usage,
        kv_capacity_tokens: Some(u64::from(cfg.num_gpu_blocks) * u64::from(cfg.block_size)),
        num_gpu_blocks: Some(u64::from(cfg.num_gpu_blocks)),
        block_size: Some(cfg.block_size),
        engines: 1,
        lora,
        preemptions_total: Some(stats.preemptions as f64),
        prefix_cache_hits_total: Some(stats.prefix_cache_hits as f64),
        prefix_cache_queries_total: Some(stats.prefix_cache_queries as f64),
    }
}

/// What every simulated pod's `/v1/models` lists: the base model and each adapter.
pub fn served_models(model: &str, adapters: &[String]) -> Arc<ServedModels> {
    Arc::new(ServedModels {
        base: vec![model.to_string()],
        adapters: adapters
            .iter()
            .map(|a| (a.clone(), model.to_string()))
            .collect::<HashMap<_, _>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::vllm::{parse_models, parse_vllm_metrics};
    use kvroute_sim::engine::{EngineConfig, FinishReason, RequestSpec};
    use kvroute_sim::metrics::{RenderContext, render};
    use kvroute_sim::profile::Profile;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    use std::time::Duration;

    fn parsed(engine: &Engine) -> PodMetrics {
        let text = render(
            engine,
            RenderContext {
                model: "m",
                epoch_unix: 1.7e9,
            },
        );
        parse_vllm_metrics(&text).expect("the simulator's page parses")
    }

    #[test]
    fn the_direct_view_equals_the_parsed_page_through_a_busy_run() {
        let profile = Profile::by_name("h100-llama3-8b").expect("profile");
        let cfg = EngineConfig {
            num_gpu_blocks: 300,
            max_loras: 2,
            max_cpu_loras: 3,
            seed: 7,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(cfg, profile);
        let mut rng = SmallRng::seed_from_u64(11);
        let mut now = Duration::ZERO;
        let (mut preempted, mut hits) = (false, false);
        for i in 0..150u32 {
            now += Duration::from_millis(rng.random_range(0..40));
            let adapter = match rng.random_range(0..5) {
                0 => None,
                a => Some(format!("lora-{a}")),
            };
            // A few shared prefixes, so that the cache hits.
            let prefix = rng.random_range(0..4u32);
            let mut prompt: Vec<u32> = (0..rng.random_range(64..600))
                .map(|t| prefix * 1000 + t)
                .collect();
            prompt.push(i);
            engine.add_request(
                now,
                RequestSpec {
                    prompt,
                    adapter,
                    max_output: rng.random_range(1..400),
                    finish_reason: FinishReason::Length,
                    output_seed: u64::from(i),
                },
            );
            engine.advance(now);
            let direct = pod_metrics(&engine);
            if i.is_multiple_of(3) {
                assert_eq!(direct, parsed(&engine), "request {i}");
            }
            preempted |= direct.preemptions_total.is_some_and(|p| p > 0.0);
            hits |= direct.prefix_cache_hits_total.is_some_and(|p| p > 0.0);
        }
        let mut step = 0u32;
        while let Some(t) = engine.next_event_time() {
            engine.advance(t);
            step += 1;
            if step.is_multiple_of(16) {
                assert_eq!(pod_metrics(&engine), parsed(&engine), "step {step}");
            }
        }
        assert!(
            preempted && hits,
            "the run exercised preemption and the cache"
        );
        assert!(engine.lora_loads().disk > 0);
    }

    #[test]
    fn the_served_models_are_what_the_simulators_model_list_parses_to() {
        let adapters = vec!["a".to_string(), "b".to_string()];
        let listed = serde_json::json!({"object": "list", "data": [
            {"id": "m", "object": "model", "root": "m", "parent": null},
            {"id": "a", "object": "model", "root": "/adapters/a", "parent": "m"},
            {"id": "b", "object": "model", "root": "/adapters/b", "parent": "m"},
        ]});
        let parsed = parse_models(listed.to_string().as_bytes()).expect("parses");
        assert_eq!(*served_models("m", &adapters), parsed);
    }
}
