use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use super::*;
use crate::fleet::{LoraStatus, PodMetrics, ServedModels};

fn pod(port: u16, base: &[&str], adapters: &[(&str, &str)]) -> PodView {
    let models = ServedModels {
        base: base.iter().map(|b| b.to_string()).collect(),
        adapters: adapters
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect::<HashMap<_, _>>(),
    };
    PodView::new(
        SocketAddr::from(([10, 0, 0, 1], port)),
        true,
        None,
        None,
        Some(Arc::new(models)),
    )
}

#[test]
fn listed_names_are_classified_as_base_or_adapter_with_their_base() {
    let index = ModelIndex::build(&[pod(1, &["llama"], &[("sql", "llama")])]);
    assert_eq!(index.class("llama"), Some(&ModelClass::Base));
    assert_eq!(
        index.class("sql"),
        Some(&ModelClass::Adapter {
            base: "llama".into()
        })
    );
    assert_eq!(index.class("mistral"), None);
}

#[test]
fn the_first_pod_listing_a_name_decides_its_class() {
    let index = ModelIndex::build(&[pod(1, &["x"], &[]), pod(2, &[], &[("x", "llama")])]);
    assert_eq!(index.class("x"), Some(&ModelClass::Base));
}

#[test]
fn an_adapter_entry_wins_over_a_base_entry_on_the_same_pod() {
    let index = ModelIndex::build(&[pod(1, &["x"], &[("x", "llama")])]);
    assert!(index.class("x").is_some_and(ModelClass::is_adapter));
}

#[test]
fn an_adapter_that_only_runs_is_known_as_an_unlisted_adapter() {
    let mut running = pod(1, &["llama"], &[]);
    running.set_metrics(Some(Arc::new(PodMetrics {
        lora: Some(LoraStatus {
            max_lora: 2,
            running: vec!["fresh".into()],
            waiting: vec!["queued".into()],
        }),
        ..PodMetrics::default()
    })));
    let index = ModelIndex::build(&[running]);
    assert_eq!(index.class("fresh"), Some(&ModelClass::UnlistedAdapter));
    assert_eq!(index.class("queued"), Some(&ModelClass::UnlistedAdapter));
    assert_eq!(index.len(), 3);
}
