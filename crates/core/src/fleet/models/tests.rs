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

/// `pods` with their model lists shared as `lists` says (indexes into `shared`).
fn sharing(shared: &[Arc<ServedModels>], lists: &[usize]) -> Vec<PodView> {
    lists
        .iter()
        .enumerate()
        .map(|(i, &list)| {
            PodView::new(
                SocketAddr::from(([10, 0, 0, 1], i as u16 + 1)),
                true,
                None,
                None,
                Some(Arc::clone(&shared[list])),
            )
        })
        .collect()
}

fn list(base: &[&str], adapters: &[(&str, &str)]) -> Arc<ServedModels> {
    pod(1, base, adapters).models.expect("listed")
}

#[test]
fn a_build_after_the_same_lists_shares_what_it_read_and_classifies_alike() {
    let shared = [
        list(&["llama"], &[("sql", "llama")]),
        list(&["mistral"], &[]),
    ];
    let pods = sharing(&shared, &[0, 0, 1, 1, 0]);
    let first = ModelIndex::build(&pods);
    let again = ModelIndex::build_after(&pods, Some(&first));
    assert!(Arc::ptr_eq(&first.listed, &again.listed));
    assert_eq!(again, ModelIndex::build(&pods));
    assert_eq!(again.class("mistral"), Some(&ModelClass::Base));
}

#[test]
fn a_build_after_other_lists_reads_them_again() {
    let x_base = list(&["x"], &[]);
    let x_adapter = list(&[], &[("x", "llama")]);
    let shared = [x_base, x_adapter, list(&["x", "y"], &[])];
    let before = ModelIndex::build(&sharing(&shared, &[0, 1]));
    assert_eq!(before.class("x"), Some(&ModelClass::Base));
    // The same lists in another order: the first pod listing a name decides.
    for (lists, x, y) in [
        (&[1, 0][..], true, None),
        // A list replaced by another.
        (&[0, 2][..], false, Some(&ModelClass::Base)),
        // A list more.
        (&[0, 1, 2][..], false, Some(&ModelClass::Base)),
        // A list fewer.
        (&[0][..], false, None),
    ] {
        let pods = sharing(&shared, lists);
        let after = ModelIndex::build_after(&pods, Some(&before));
        assert_eq!(after, ModelIndex::build(&pods), "{lists:?}");
        assert!(!Arc::ptr_eq(&after.listed, &before.listed), "{lists:?}");
        assert_eq!(
            after.class("x").map(ModelClass::is_adapter),
            Some(x),
            "{lists:?}"
        );
        assert_eq!(after.class("y"), y, "{lists:?}");
    }
}
