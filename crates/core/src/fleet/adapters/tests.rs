use std::net::SocketAddr;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::fleet::{PodLoad, PodMetrics};
use crate::scheduler::LoraTier;

const NAMES: [&str; 5] = ["a", "b", "c", "d", "e"];

fn pod(n: usize, lora: Option<LoraStatus>) -> PodView {
    let metrics = PodMetrics {
        lora,
        ..PodMetrics::default()
    };
    let endpoint = SocketAddr::from(([10, 0, (n >> 8) as u8, n as u8], 8000));
    PodView::new(endpoint, true, Some(Arc::new(metrics)), None, None)
}

fn names() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(prop::sample::select(&NAMES[..]), 0..5)
        .prop_map(|names| names.into_iter().map(str::to_owned).collect())
}

fn status() -> impl Strategy<Value = Option<LoraStatus>> {
    prop::option::of(
        (0u32..4, names(), names()).prop_map(|(max_lora, running, waiting)| LoraStatus {
            max_lora,
            running,
            waiting,
        }),
    )
}

proptest! {
    /// The index gives every pod the tier its own lists give, for every adapter,
    /// whatever kvroute sent it lately.
    #[test]
    fn tiers_from_the_index_equal_tiers_from_each_pods_lists(
        statuses in prop::collection::vec(status(), 1..40),
        sent in prop::collection::vec(prop::sample::select(&NAMES[..]), 0..4),
    ) {
        let pods: Vec<PodView> = statuses
            .into_iter()
            .enumerate()
            .map(|(n, status)| pod(n, status))
            .collect();
        let index = AdapterIndex::build(&pods);
        let load = PodLoad::default();
        for name in &sent {
            load.note_adapter(adapter_key(name));
        }
        for adapter in NAMES {
            let key = adapter_key(adapter);
            let running = PositionSet::of(index.running(key), pods.len());
            let waiting = PositionSet::of(index.waiting(key), pods.len());
            for (position, pod) in pods.iter().enumerate() {
                let from_lists = LoraTier::of(pod, &load, adapter, key);
                let from_index = LoraTier::decide(
                    index.slots(position),
                    running.contains(position),
                    waiting.contains(position),
                    || load.adapter_standing(key),
                );
                prop_assert_eq!(from_index, from_lists, "pod {} adapter {}", position, adapter);
            }
        }
    }
}

#[test]
fn a_name_listed_twice_counts_once() {
    let pods = [pod(
        0,
        Some(LoraStatus {
            max_lora: 2,
            running: vec!["a".into(), "a".into()],
            waiting: vec!["a".into(), "b".into()],
        }),
    )];
    let index = AdapterIndex::build(&pods);
    assert_eq!(
        index.slots(0),
        LoraSlots {
            reported: true,
            max_lora: 2,
            running: 1,
            in_use: 2
        }
    );
    assert_eq!(index.running(adapter_key("a")), &[0]);
    assert_eq!(index.waiting(adapter_key("b")), &[0]);
    assert!(index.running(adapter_key("b")).is_empty());
}
