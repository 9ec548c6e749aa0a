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

const FLOW: &str = "
name: flow
rates: [2, 8, 16]
fleet: {pods: 2, num_gpu_blocks: 2000, max_loras: 0}
objectives: {critical: 100, sheddable: -10}
capacity: 8
classes:
  - name: crit
    objective: critical
    tenant: team-a
    prompt_tokens: {dist: fixed, value: 8}
    output_tokens: {dist: fixed, value: 4}
  - name: bulk
    objective: sheddable
    step_weights: [0, 1, 3]
    prompt_tokens: {dist: fixed, value: 8}
    output_tokens: {dist: fixed, value: 4}
";

#[test]
fn objectives_tenants_and_step_weights_are_read_from_the_file() {
    let w = Workload::from_yaml(FLOW).expect("valid");
    let objectives = w.objectives.as_ref().expect("objectives");
    assert_eq!(objectives["critical"], 100);
    assert_eq!(objectives["sheddable"], -10);
    assert_eq!(w.capacity, Some(8.0));
    assert_eq!(w.classes[0].objective.as_deref(), Some("critical"));
    assert_eq!(w.classes[0].tenant.as_deref(), Some("team-a"));
    assert_eq!(w.classes[1].tenant, None);
    assert_eq!(w.class_weights(0), vec![1.0, 0.0]);
    assert_eq!(w.class_weights(2), vec![1.0, 3.0]);
    // Without the new fields nothing changes.
    let plain = Workload::from_yaml(YAML).expect("valid");
    assert_eq!((plain.objectives.as_ref(), plain.capacity), (None, None));
    assert_eq!(plain.class_weights(5), vec![1.0, 1.0]);
}

#[test]
fn a_class_with_weight_zero_in_a_step_sends_nothing_in_it() {
    let w = Workload::from_yaml(FLOW).expect("valid");
    let d = Duration::from_secs(60);
    let alone = w.plan_step(1, 0, 20.0, d, None);
    assert!(alone.len() > 1000, "{}", alone.len());
    assert!(alone.iter().all(|r| r.class == 0));
    let mixed = w.plan_step(1, 2, 20.0, d, None);
    let bulk = mixed.iter().filter(|r| r.class == 1).count() as f64 / mixed.len() as f64;
    assert!((bulk - 0.75).abs() < 0.03, "{bulk}");
}

#[test]
fn selecting_steps_keeps_each_steps_rate_and_class_weights() {
    let w = Workload::from_yaml(FLOW).expect("valid");
    let s = w.select_steps(&[0, 2, 7]);
    assert_eq!(s.rates, vec![2.0, 16.0]);
    assert_eq!(s.classes[1].step_weights.as_deref(), Some(&[0.0, 3.0][..]));
    s.validate().expect("still valid");
    // The same requests as the original step, once the position is the same.
    let d = Duration::from_secs(5);
    assert_eq!(
        w.select_steps(&[2]).plan_step(4, 0, 9.0, d, None),
        w.select_steps(&[2, 0]).plan_step(4, 0, 9.0, d, None)
    );
    assert_eq!(w.select_steps(&[2]).class_weights(0), w.class_weights(2));
}

#[test]
fn bad_flow_control_fields_are_refused_with_a_reason() {
    let refused = |from: &str, to: &str, why: &str| {
        let yaml = FLOW.replace(from, to);
        assert_ne!(yaml, FLOW, "{from:?} is not in the fixture");
        let e = Workload::from_yaml(&yaml).expect_err(why);
        assert!(e.to_string().contains(why), "{e}");
    };
    refused(
        "objective: sheddable",
        "objective: batch",
        "not in objectives",
    );
    refused(
        "{critical: 100, sheddable: -10}",
        "{}",
        "objectives is empty",
    );
    refused("critical: 100,", "\"crit,ical\": 100,", "without ','");
    refused("tenant: team-a", "tenant: \"\"", "1 to 128 bytes");
    refused(
        "tenant: team-a",
        &format!("tenant: {}", "x".repeat(129)),
        "1 to 128 bytes",
    );
    refused("tenant: team-a", "tenant: \"team a\"", "visible ASCII");
    refused(
        "step_weights: [0, 1, 3]",
        "step_weights: [0, 1]",
        "2 entries for a ladder of 3",
    );
    refused(
        "step_weights: [0, 1, 3]",
        "step_weights: [0, -1, 3]",
        "numbers >= 0",
    );
    refused(
        "step_weights: [0, 1, 3]",
        "step_weights: [0, 1, 3]\n    weight: 2",
        "not both",
    );
    refused("capacity: 8", "capacity: 0", "capacity must be > 0");
    // A step where every class is absent.
    let yaml = FLOW
        .replace(
            "    tenant: team-a\n",
            "    tenant: team-a\n    step_weights: [1, 1, 0]\n",
        )
        .replace("[0, 1, 3]", "[0, 1, 0]");
    let e = Workload::from_yaml(&yaml).expect_err("empty step");
    assert!(e.to_string().contains("ladder step 2"), "{e}");
    // A tenant of exactly 128 bytes is fine; objectives may be left out altogether.
    let long = FLOW.replace("tenant: team-a", &format!("tenant: {}", "x".repeat(128)));
    Workload::from_yaml(&long).expect("128 bytes");
    let unmapped = FLOW.replace("objectives: {critical: 100, sheddable: -10}\n", "");
    let w = Workload::from_yaml(&unmapped).expect("no map: objectives unchecked");
    assert_eq!(w.classes[1].objective.as_deref(), Some("sheddable"));
}
