use kvroute_core::fleet::HealthPolicy;

use super::*;

fn picker(keep_decisions: usize) -> LivePicker {
    let store = Arc::new(PodStore::new(HealthPolicy::default()));
    LivePicker::new(
        store,
        SchedulerConfig::default(),
        keep_decisions,
        kvroute_core::fleet::DEFAULT_PREFIX_BUDGET_BYTES,
    )
}

fn route_unplaceable(picker: &LivePicker) {
    let request = RouteRequest {
        inference: None,
        subset: None,
    };
    assert!(picker.route(&request, true).is_err(), "no pods: not routed");
}

#[test]
fn a_watcher_sees_each_decision_even_with_the_debug_log_off() {
    let picker = picker(0);
    route_unplaceable(&picker);
    let mut watcher = picker.watch();
    route_unplaceable(&picker);
    let record = watcher.try_recv().expect("the decision after subscribing");
    assert_eq!(record.error.as_deref(), Some("no endpoints are known"));
    assert!(
        watcher.try_recv().is_err(),
        "nothing from before subscribing"
    );
    assert!(picker.decisions().recent().is_empty());
}

#[test]
fn the_debug_log_keeps_the_last_decisions_without_watchers() {
    let picker = picker(2);
    for _ in 0..3 {
        route_unplaceable(&picker);
    }
    assert_eq!(picker.decisions().recent().len(), 2);
}
