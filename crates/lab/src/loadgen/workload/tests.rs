//! Unit tests of the workload format, validation and generator.

use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::generator::{WORDS, words};
use super::*;

const YAML: &str = "
name: t
seed: 3
rates: [4]
step_duration: 100s
fleet: {pods: 2, num_gpu_blocks: 2000, max_loras: 2, adapters: 4, speedup: 5}
classes:
  - name: lora
    lora: {base_share: 0.25, zipf_s: 1.0}
    prompt_tokens: {dist: lognormal, median: 200, sigma: 1.0, min: 8, max: 4000}
    output_tokens: {dist: uniform, min: 10, max: 30}
  - name: prefix
    weight: 1
    shared_prefix: {num_groups: 3, num_prompts_per_group: 2, system_prompt_len: 50, question_len: 7}
    output_tokens: {dist: fixed, value: 9}
";

#[test]
fn every_prompt_word_is_one_simulator_token() {
    for w in WORDS {
        assert_eq!(kvroute_sim::tokens::tokenize(w).len(), 1, "{w:?}");
    }
    let mut rng = SmallRng::seed_from_u64(1);
    let text = words(&mut rng, 321);
    assert_eq!(kvroute_sim::tokens::tokenize(&text).len(), 321);
}

#[test]
fn a_shared_prefix_prompt_has_the_promised_token_count_and_prefix() {
    let w = Workload::from_yaml(YAML).expect("valid");
    let reqs = w.plan_step(1, 0, 50.0, Duration::from_secs(10), None);
    let prefixed: Vec<&Request> = reqs.iter().filter(|r| r.class == 1).collect();
    assert!(prefixed.len() > 100, "{}", prefixed.len());
    let systems: std::collections::HashSet<&str> = prefixed
        .iter()
        .filter_map(|r| r.system.as_deref())
        .collect();
    assert_eq!(systems.len(), 3);
    for r in prefixed {
        let body = r.body(Api::Completions, true);
        let prompt = body["prompt"].as_str().expect("prompt");
        assert_eq!(kvroute_sim::tokens::tokenize(prompt).len(), 57);
        assert_eq!(r.prompt_tokens, 57);
        assert_eq!(r.model, w.model);
        assert_eq!(r.max_tokens, 9);
    }
}

#[test]
fn the_body_streams_with_usage_and_chat_puts_the_prefix_in_the_system_message() {
    let r = Request {
        at: Duration::ZERO,
        class: 0,
        model: "m".into(),
        system: Some(Arc::from(" sys")),
        prompt: " q".into(),
        prompt_tokens: 2,
        max_tokens: 5,
    };
    let b = r.body(Api::Completions, true);
    assert_eq!(b["prompt"], " sys q");
    assert_eq!(b["stream"], true);
    assert_eq!(b["stream_options"]["include_usage"], true);
    assert_eq!(b["max_tokens"], 5);
    assert_eq!(b["ignore_eos"], true);
    let c = r.body(Api::Chat, false);
    assert_eq!(c["messages"][0]["role"], "system");
    assert_eq!(c["messages"][1]["content"], " q");
    assert!(c.get("ignore_eos").is_none());
}

#[test]
fn bad_workloads_are_refused_with_a_reason() {
    let e = Workload::from_yaml(&YAML.replace("rates: [4]", "rates: []")).expect_err("no rates");
    assert!(e.to_string().contains("rates"), "{e}");
    let e = Workload::from_yaml(&YAML.replace("max: 4000", "max: 40000")).expect_err("too long");
    assert!(e.to_string().contains("model length"), "{e}");
    let e = Workload::from_yaml(&YAML.replace("adapters: 4", "adapters: 0"))
        .expect_err("lora without adapters");
    assert!(e.to_string().contains("adapters"), "{e}");
    let e = Workload::from_yaml(&YAML.replace("pods: 2", "pods: 0")).expect_err("no pods");
    assert!(e.to_string().contains("fleet"), "{e}");
    assert!(Workload::from_yaml(&YAML.replace("weight: 1", "colour: 1")).is_err());
    assert!(Workload::from_yaml(&YAML.replace("dist: fixed", "dist: gamma")).is_err());
}

#[test]
fn the_fleet_section_builds_the_fleet_config() {
    let w = Workload::from_yaml(YAML).expect("valid");
    let f = w.fleet_config().expect("fleet");
    assert_eq!(f.pods.len(), 2);
    assert_eq!(f.speedup, 5.0);
    assert_eq!(f.seed, 3);
    assert_eq!(f.port, 0);
    let p = &f.pods[1];
    assert_eq!(p.engine.num_gpu_blocks, 2000);
    assert_eq!((p.engine.max_loras, p.engine.max_cpu_loras), (2, 2));
    assert_eq!(p.engine.lora_load, Duration::from_millis(150));
    assert_eq!(
        p.lora_adapters,
        vec!["lora-0", "lora-1", "lora-2", "lora-3"]
    );
}
