use kvroute_core::fleet::HealthPolicy;

use super::*;

fn picker(keep_decisions: usize) -> LivePicker {
    let store = Arc::new(PodStore::new(HealthPolicy::default()));
    LivePicker::new(
        store,
        SchedulerConfig::default(),
        keep_decisions,
        kvroute_core::fleet::DEFAULT_PREFIX_BUDGET_BYTES,
        // Without pods a request would wait for one: answer at once here.
        Arc::new(FlowSettings {
            hold_without_endpoints: false,
            ..FlowSettings::default()
        }),
    )
}

/// The raw request of routing tests that give the parsed form only.
fn no_body() -> RawRequest<'static> {
    RawRequest {
        api: kvroute_core::request::ApiKind::Completions,
        body: &[],
    }
}

fn route_unplaceable(picker: &LivePicker) {
    let request = RouteRequest {
        inference: None,
        subset: None,
    };
    let placement = picker.route(&request, no_body(), &RequestClass::default(), true);
    assert!(
        matches!(placement, Placement::Unrouted(_)),
        "no pods: not routed"
    );
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

#[test]
fn each_reason_to_leave_a_prompt_to_the_pods_is_told_once() {
    // Reasons no other test gives: the set is the process's.
    let (a, b) = ("has a test's first reason", "has a test's second reason");
    assert!(first_left_to_pod(a));
    assert!(!first_left_to_pod(a));
    assert!(first_left_to_pod(b));
    assert!(!first_left_to_pod(b) && !first_left_to_pod(a));
}

mod waiting_room {
    use std::net::SocketAddr;
    use std::time::Duration;

    use kvroute_core::fleet::{PodMetrics, ServedModels};
    use kvroute_core::request::InferenceRequest;
    use tokio::time::Instant;

    use super::*;
    use crate::flow::{DropReason, StandingQueue};

    const POD: &str = "10.0.0.1:8000";
    /// A pod's KV pool: room for one request of [`request`] at a time.
    const CAPACITY: u64 = 1_000;

    fn pod() -> SocketAddr {
        POD.parse().expect("addr")
    }

    /// A fleet of one pod serving model `m`, scraped with `kv_usage` and `waiting`.
    fn store_with_pod(kv_usage: f64, waiting: u32) -> Arc<PodStore> {
        let store = Arc::new(PodStore::new(HealthPolicy::default()));
        store.set_endpoints(&[pod()]);
        store.record_models(
            pod(),
            ServedModels {
                base: vec!["m".to_owned()],
                ..ServedModels::default()
            },
        );
        scrape(&store, kv_usage, waiting);
        store
    }

    /// One scrape of the pod, published.
    fn scrape(store: &PodStore, kv_usage: f64, waiting: u32) {
        let ticket = store.load(pod()).expect("known").scrape_started();
        let metrics = PodMetrics {
            kv_usage,
            waiting,
            kv_capacity_tokens: Some(CAPACITY),
            ..PodMetrics::default()
        };
        store.record_scrape(pod(), Some(metrics), ticket, std::time::Instant::now());
        store.publish(std::time::Instant::now());
    }

    fn picker_over(store: Arc<PodStore>, flow: FlowSettings) -> Arc<LivePicker> {
        Arc::new(LivePicker::new(
            store,
            SchedulerConfig::default(),
            0,
            kvroute_core::fleet::DEFAULT_PREFIX_BUDGET_BYTES,
            Arc::new(flow),
        ))
    }

    /// 600 tokens of KV: 500 of prompt, 100 of output.
    fn request() -> InferenceRequest {
        InferenceRequest {
            model: "m".to_owned(),
            prompt_tokens: 500,
            max_output_tokens: Some(100),
            stream: false,
            prompt_prefix: Vec::new(),
            prefix_context: 0,
        }
    }

    fn class(priority: i32) -> RequestClass {
        RequestClass {
            priority,
            ..RequestClass::default()
        }
    }

    fn route(picker: &LivePicker, priority: i32) -> Placement<InFlightRequest> {
        let inference = request();
        let request = RouteRequest {
            inference: Some(&inference),
            subset: None,
        };
        picker.route(&request, no_body(), &class(priority), false)
    }

    fn held(placement: Placement<InFlightRequest>) -> Waiting<InFlightRequest> {
        match placement {
            Placement::Waiting(waiting) => waiting,
            other => panic!("expected the request to wait, got {other:?}"),
        }
    }

    fn dropped(placement: Placement<InFlightRequest>) -> Unrouted {
        match placement {
            Placement::Unrouted(unrouted) => unrouted,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// Whether the wait has resolved, without waiting for it.
    fn resolved(
        waiting: &mut Waiting<InFlightRequest>,
    ) -> Option<Result<Routed<InFlightRequest>, Unrouted>> {
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        match std::pin::Pin::new(waiting).poll(&mut cx) {
            std::task::Poll::Ready(outcome) => Some(outcome),
            std::task::Poll::Pending => None,
        }
    }

    #[tokio::test]
    async fn a_request_no_pod_has_room_for_waits_and_goes_when_a_scrape_shows_room() {
        let store = store_with_pod(0.95, 0);
        let picker = picker_over(Arc::clone(&store), FlowSettings::default());
        let waiting = held(route(&picker, 0));
        assert_eq!(picker.waiting(), 1);
        let room = tokio::spawn(Arc::clone(&picker).run_waiting_room());
        scrape(&store, 0.0, 0);
        let routed = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("routed once the pod has room")
            .expect("routed, not refused");
        assert_eq!(routed.endpoints, [pod()]);
        assert_eq!(picker.waiting(), 0);
        room.abort();
    }

    #[tokio::test]
    async fn a_request_that_ends_makes_room_for_the_one_waiting() {
        let store = store_with_pod(0.0, 0);
        let picker = picker_over(Arc::clone(&store), FlowSettings::default());
        let Placement::Routed(first) = route(&picker, 0) else {
            panic!("the first request fits");
        };
        let second = held(route(&picker, 0));
        let room = tokio::spawn(Arc::clone(&picker).run_waiting_room());
        first.ticket.finish(ResponseSummary::default());
        let routed = tokio::time::timeout(Duration::from_secs(10), second)
            .await
            .expect("routed once the first request ended")
            .expect("routed");
        assert_eq!(routed.endpoints, [pod()]);
        room.abort();
    }

    #[tokio::test]
    async fn higher_priorities_leave_first_and_a_newcomer_does_not_pass_its_band() {
        let store = store_with_pod(0.95, 0);
        let picker = picker_over(Arc::clone(&store), FlowSettings::default());
        let mut low = held(route(&picker, 0));
        let mut high = held(route(&picker, 10));
        // Room for one request: the higher priority takes it though it came later.
        scrape(&store, 0.0, 0);
        // A newcomer of the low band finds room but queues behind the waiting ones.
        let mut newcomer = held(route(&picker, 0));
        picker.dispatch_waiting(Instant::now());
        let Some(Ok(_routed)) = resolved(&mut high) else {
            panic!("the high-priority request goes first");
        };
        assert!(resolved(&mut low).is_none(), "no room left for the low one");
        assert!(resolved(&mut newcomer).is_none());
        assert_eq!(picker.waiting(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_runs_out_is_answered_429_with_the_reason() {
        let store = store_with_pod(0.95, 0);
        let flow = FlowSettings {
            max_wait: Duration::from_secs(2),
            ..FlowSettings::default()
        };
        let picker = picker_over(store, flow);
        let waiting = held(route(&picker, 0));
        let room = tokio::spawn(Arc::clone(&picker).run_waiting_room());
        let started = Instant::now();
        let refused = waiting.await.expect_err("no room ever came");
        assert_eq!(refused.kind, UnroutedKind::Shed);
        assert_eq!(refused.dropped, Some(DropReason::TtlExpired));
        assert!(started.elapsed() >= Duration::from_secs(2));
        assert_eq!(picker.waiting(), 0);
        room.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_that_does_not_empty_sheds_at_the_standing_wait_but_a_raised_priority_waits_on()
    {
        let store = store_with_pod(0.95, 0);
        let flow = FlowSettings {
            max_wait: Duration::from_secs(10),
            standing: Some(StandingQueue {
                after: Duration::from_secs(1),
                wait: Duration::from_secs(2),
            }),
            ..FlowSettings::default()
        };
        let picker = picker_over(store, flow);
        let plain = held(route(&picker, 0));
        let critical = held(route(&picker, 100));
        let room = tokio::spawn(Arc::clone(&picker).run_waiting_room());
        let started = Instant::now();
        let refused = plain.await.expect_err("no room ever came");
        assert_eq!(refused.dropped, Some(DropReason::TtlExpired));
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(2),
            "the standing wait, not 10 s"
        );
        assert!(
            refused.message.contains("has not emptied"),
            "{}",
            refused.message
        );
        assert_eq!(picker.waiting(), 1, "the raised priority waits on");
        let refused = critical.await.expect_err("no room ever came");
        assert_eq!(refused.dropped, Some(DropReason::TtlExpired));
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert!(
            !refused.message.contains("has not emptied"),
            "{}",
            refused.message
        );
        assert_eq!(picker.waiting(), 0);
        room.abort();
    }

    #[tokio::test]
    async fn a_sheddable_request_is_refused_at_once_rather_than_queued() {
        let picker = picker_over(store_with_pod(0.95, 0), FlowSettings::default());
        let refused = dropped(route(&picker, -1));
        assert_eq!(refused.kind, UnroutedKind::Shed);
        assert_eq!(refused.dropped, Some(DropReason::Saturated));
        assert_eq!(picker.waiting(), 0);
    }

    /// 50 tokens of KV (40 of prompt, 10 of output) for `tenant` at `priority`.
    fn route_small(picker: &LivePicker, priority: i32, tenant: &str) -> Placement<InFlightRequest> {
        let inference = InferenceRequest {
            prompt_tokens: 40,
            max_output_tokens: Some(10),
            ..request()
        };
        let request = RouteRequest {
            inference: Some(&inference),
            subset: None,
        };
        let class = RequestClass {
            priority,
            tenant: tenant.to_owned(),
        };
        picker.route(&request, no_body(), &class, false)
    }

    #[tokio::test]
    async fn a_sheddable_request_must_leave_room_that_a_standard_one_may_take() {
        // A pod at 75 % KV: under the 80 % threshold, over the 70 % a sheddable request
        // must leave.
        let picker = picker_over(store_with_pod(0.75, 0), FlowSettings::default());
        let refused = dropped(route_small(&picker, -1, "t"));
        assert_eq!(refused.dropped, Some(DropReason::Saturated));
        assert!(matches!(route_small(&picker, 0, "t"), Placement::Routed(_)));
    }

    /// Routes small requests of `tenant` (kept in `routed`) until one is held, which it
    /// returns; fails if `limit` are routed first.
    fn fill_until_held(
        picker: &LivePicker,
        tenant: &str,
        routed: &mut Vec<Routed<InFlightRequest>>,
        limit: usize,
    ) -> Waiting<InFlightRequest> {
        loop {
            match route_small(picker, 0, tenant) {
                Placement::Routed(r) => routed.push(r),
                Placement::Waiting(waiting) => return waiting,
                Placement::Unrouted(refused) => panic!("{refused:?}"),
            }
            assert!(routed.len() < limit, "{tenant} never had to wait");
        }
    }

    #[tokio::test]
    async fn a_quiet_tenant_uses_the_headroom_a_busy_one_must_leave() {
        // 60 % full; each small request takes 5 % more until the next scrape.
        let picker = picker_over(store_with_pod(0.6, 0), FlowSettings::default());
        let mut routed = Vec::new();
        let Placement::Routed(quiet) = route_small(&picker, 0, "quiet") else {
            panic!("room for the quiet tenant's first request");
        };
        routed.push(quiet);
        // The busy tenant fills the pod until, over its share, it must leave a tenth free.
        let mut busy = fill_until_held(&picker, "busy", &mut routed, 20);
        assert!(
            routed.len() >= 4,
            "{} routed before it waited",
            routed.len()
        );
        // The quiet tenant queues behind it (its band's order); the next pass, which its
        // arrival starts, sends it on into the room the busy tenant had to leave.
        let mut quiet = held(route_small(&picker, 0, "quiet"));
        picker.dispatch_waiting(Instant::now());
        assert!(matches!(resolved(&mut quiet), Some(Ok(_))));
        assert!(resolved(&mut busy).is_none());
        assert_eq!(picker.waiting(), 1);
    }

    #[tokio::test]
    async fn a_quiet_tenant_is_not_held_for_kv_the_busy_one_took() {
        let store = store_with_pod(0.0, 0);
        let picker = picker_over(Arc::clone(&store), FlowSettings::default());
        let mut routed = Vec::new();
        let mut busy = fill_until_held(&picker, "busy", &mut routed, 40);
        // The pod now reports itself full: no room even for the headroom.
        scrape(&store, 0.99, 0);
        // The quiet tenant, with nothing in flight beside the busy one, queues behind it
        // (its band's order), and the pass its arrival starts sends it to the pod anyway:
        // the pod queues it, rather than the gateway until a scrape shows room.
        let mut quiet = held(route_small(&picker, 0, "quiet"));
        picker.dispatch_waiting(Instant::now());
        assert!(matches!(resolved(&mut quiet), Some(Ok(_))));
        assert!(resolved(&mut busy).is_none(), "the busy tenant waits on");
        assert_eq!(picker.waiting(), 1);
    }

    #[tokio::test]
    async fn a_full_waiting_room_refuses_the_next_request() {
        let flow = FlowSettings {
            max_waiting: 1,
            ..FlowSettings::default()
        };
        let picker = picker_over(store_with_pod(0.95, 0), flow);
        let _first = held(route(&picker, 0));
        let refused = dropped(route(&picker, 0));
        assert_eq!(refused.dropped, Some(DropReason::Saturated));
    }

    #[tokio::test]
    async fn a_client_that_leaves_takes_its_request_out_of_the_queue() {
        let picker = picker_over(store_with_pod(0.95, 0), FlowSettings::default());
        let waiting = held(route(&picker, 0));
        assert_eq!(picker.waiting(), 1);
        drop(waiting);
        assert_eq!(picker.waiting(), 0);
    }

    #[tokio::test]
    async fn with_the_queue_off_a_request_goes_to_the_least_bad_pod() {
        let flow = FlowSettings {
            max_wait: Duration::ZERO,
            ..FlowSettings::default()
        };
        let picker = picker_over(store_with_pod(0.95, 0), flow);
        assert!(matches!(route(&picker, 0), Placement::Routed(_)));
    }

    #[tokio::test]
    async fn with_no_ready_pod_a_request_waits_for_one_to_come_up() {
        let store = Arc::new(PodStore::new(HealthPolicy::default()));
        let picker = picker_over(Arc::clone(&store), FlowSettings::default());
        let waiting = held(route(&picker, 0));
        let room = tokio::spawn(Arc::clone(&picker).run_waiting_room());
        store.set_endpoints(&[pod()]);
        store.record_models(
            pod(),
            ServedModels {
                base: vec!["m".to_owned()],
                ..ServedModels::default()
            },
        );
        scrape(&store, 0.0, 0);
        let routed = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("routed once a pod is up")
            .expect("routed");
        assert_eq!(routed.endpoints, [pod()]);
        room.abort();
    }

    #[tokio::test]
    async fn with_no_ready_pod_and_no_wait_configured_the_answer_is_503_at_once() {
        let store = Arc::new(PodStore::new(HealthPolicy::default()));
        let flow = FlowSettings {
            hold_without_endpoints: false,
            ..FlowSettings::default()
        };
        let picker = picker_over(store, flow);
        let refused = dropped(route(&picker, 0));
        assert_eq!(refused.kind, UnroutedKind::Unavailable);
    }
}
