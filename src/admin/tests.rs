use kvroute_core::scheduler::{Reason, Relaxed, WeightedTerms};

use super::*;
use crate::shutdown;

fn record(model: Option<&str>) -> DecisionRecord {
    let endpoint = "10.0.0.1:8000".parse().expect("addr");
    DecisionRecord {
        unix_ms: 1_700_000_000_000,
        model: model.map(str::to_owned),
        prompt_tokens: 100,
        max_output_tokens: Some(50),
        held: None,
        queued_ms: 0,
        prefix_source: Some(crate::picker::PrefixFrom::KvEvents),
        decision: Some(Decision {
            endpoint,
            fallbacks: vec!["10.0.0.2:8000".parse().expect("addr")],
            reason: Reason::Lora(LoraTier::Active),
            relaxed: Relaxed {
                kv_headroom: true,
                ..Relaxed::default()
            },
            tokens_needed: 150,
            candidates: 2,
            could_fit: true,
            ranked: vec![CandidateScore {
                endpoint,
                total: 3.5,
                kv_headroom: 0.9,
                queue: 1.0,
                inflight: 0.6,
                lora: 1.0,
                lora_tier: Some(LoraTier::Active),
                prefix: 0.25,
                prefill_queue: 0.5,
                free_kv_tokens: Some(14_000),
                cached_tokens: 0,
                held_tokens: 0,
                weighted: WeightedTerms {
                    kv_headroom: 0.9,
                    queue: 1.0,
                    inflight: 0.6,
                    lora: 0.5,
                    prefix: 0.25,
                    prefill_queue: 0.25,
                },
            }],
        }),
        error: None,
    }
}

#[test]
fn a_decision_keeps_its_endpoint_reason_and_scores_on_the_wire() {
    let event = event(&record(Some("sql-lora")));
    assert_eq!(event.model.as_deref(), Some("sql-lora"));
    assert_eq!(event.max_output_tokens, Some(50));
    let Some(pb::decision_event::Outcome::Routed(routed)) = event.outcome else {
        panic!("not routed: {event:?}");
    };
    assert_eq!(routed.endpoint, "10.0.0.1:8000");
    assert_eq!(routed.fallbacks, ["10.0.0.2:8000"]);
    assert_eq!(routed.reason, "lora_active");
    assert_eq!(routed.prefix_source, "kv_events");
    assert!(
        routed
            .relaxed
            .is_some_and(|r| r.kv_headroom && !r.saturation)
    );
    assert_eq!(routed.ranked[0].lora_tier, "active");
    assert_eq!(routed.ranked[0].free_kv_tokens, Some(14_000));
    assert_eq!(routed.ranked[0].total, 3.5);
    let weighted = routed.ranked[0].weighted.expect("weighted terms");
    assert_eq!(weighted.prefix, 0.25);
    let sum = weighted.kv_headroom
        + weighted.queue
        + weighted.inflight
        + weighted.lora
        + weighted.prefix
        + weighted.prefill_queue;
    assert_eq!(sum, 3.5, "the terms on the wire add up to the total");
}

#[test]
fn the_model_filter_admits_only_that_model() {
    let filter = Filter {
        model: Some("sql-lora".into()),
    };
    assert!(filter.admits(&record(Some("sql-lora"))));
    assert!(!filter.admits(&record(Some("base"))));
    assert!(!filter.admits(&record(None)));
    assert!(Filter { model: None }.admits(&record(None)));
}

#[tokio::test]
async fn a_watcher_that_falls_behind_is_told_how_many_it_missed() {
    let (tx, decisions) = broadcast::channel(2);
    let (_stop_tx, stop) = shutdown::phase();
    let mut watcher = Watcher {
        decisions,
        stop,
        filter: Filter { model: None },
    };
    for _ in 0..5 {
        tx.send(Arc::new(record(Some("base")))).expect("send");
    }
    let first = watcher.next().await.expect("event");
    assert_eq!(
        first.outcome,
        Some(pb::decision_event::Outcome::Missed(pb::Missed { count: 3 }))
    );
    let next = watcher.next().await.expect("event");
    assert!(matches!(
        next.outcome,
        Some(pb::decision_event::Outcome::Routed(_))
    ));
}

#[tokio::test]
async fn watch_streams_end_on_shutdown() {
    let (_tx, decisions) = broadcast::channel::<Arc<DecisionRecord>>(2);
    let (stop_tx, stop) = shutdown::phase();
    let mut watcher = Watcher {
        decisions,
        stop,
        filter: Filter { model: None },
    };
    stop_tx.fire();
    assert_eq!(watcher.next().await, None);
}
