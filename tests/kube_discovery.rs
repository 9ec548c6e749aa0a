//! Kubernetes discovery against an in-process fake API server that speaks the
//! list/watch protocol: kvroute runs in-process with `--endpoint-selector` or
//! `--pool-name` equivalents, the test changes pods and pools on the fake server, and
//! asserts on the pod store's published snapshots.
//!
//! Pod IPs are loopback addresses (127.0.0.x): scrapes of them fail fast, and the
//! endpoint set is what is under test. One test puts real fake vLLM pods behind a pool.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

#[path = "support/fake_kube.rs"]
mod fake_kube;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute::config::ServeConfig;
use kvroute::discovery::{KubeTarget, KubernetesDiscovery, PodTarget};
use kvroute_core::fleet::{PrefillEnd, Snapshot};

use fake_kube::{FakeKube, Resource, pod, pool};
use support::{FakePod, Kvroute};

const NS: &str = "llm";
const PORT: u16 = 38000;
const VLLM: &[(&str, &str)] = &[("app", "vllm")];

fn ep(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("ip"), port)
}

fn endpoints(snapshot: &Snapshot) -> Vec<SocketAddr> {
    snapshot.pods().iter().map(|p| p.endpoint).collect()
}

fn selector(labels: &str, ports: &[u16]) -> KubeTarget {
    KubeTarget::Pods(PodTarget::new(
        labels.parse().expect("selector"),
        ports.to_vec(),
    ))
}

fn pool_named(name: &str) -> KubeTarget {
    KubeTarget::Pool { name: name.into() }
}

fn config(fake: &FakeKube, target: KubeTarget) -> ServeConfig {
    let mut config = support::test_config(Vec::new());
    config.kubernetes = Some(KubernetesDiscovery {
        namespace: Some(NS.into()),
        target,
        client: Some(fake.client_config()),
    });
    config
}

/// Waits until kvroute holds `n` watches open (so that what the test does next reaches
/// a watch, not the initial list).
async fn wait_watching(fake: &FakeKube, n: usize) {
    fake.wait_for("open watches", |c| c.open_watches == n).await;
}

/// Waits until the published snapshot lists exactly `expected` (sorted).
async fn wait_endpoints(kvroute: &Kvroute, what: &str, mut expected: Vec<SocketAddr>) {
    expected.sort();
    let shown = expected.clone();
    let ok = kvroute::app::wait_for_snapshot(&kvroute.store, Duration::from_secs(10), move |s| {
        endpoints(s) == expected
    })
    .await;
    assert!(
        ok,
        "timed out waiting for: {what}; wanted {shown:?}, snapshot has {:?}",
        endpoints(kvroute.store.fleet().snapshot())
    );
}

#[tokio::test]
async fn ready_pods_become_endpoints_on_every_target_port_within_a_second() {
    let fake = FakeKube::start().await;
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    fake.apply(Resource::Pods, NS, pod("b", Some("127.0.0.3"), false, VLLM));
    fake.apply(Resource::Pods, NS, pod("c", None, false, VLLM));
    fake.apply(
        Resource::Pods,
        NS,
        pod("x", Some("127.0.0.9"), true, &[("app", "other")]),
    );
    fake.apply(
        Resource::Pods,
        "elsewhere",
        pod("y", Some("127.0.0.10"), true, VLLM),
    );
    let kvroute = Kvroute::start(config(&fake, selector("app=vllm", &[PORT, PORT + 1]))).await;
    wait_endpoints(
        &kvroute,
        "the ready pod's two ports",
        vec![ep("127.0.0.2", PORT), ep("127.0.0.2", PORT + 1)],
    )
    .await;

    let started = Instant::now();
    fake.apply(Resource::Pods, NS, pod("d", Some("127.0.0.4"), true, VLLM));
    wait_endpoints(
        &kvroute,
        "a new pod",
        vec![
            ep("127.0.0.2", PORT),
            ep("127.0.0.2", PORT + 1),
            ep("127.0.0.4", PORT),
            ep("127.0.0.4", PORT + 1),
        ],
    )
    .await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(1), "took {took:?}");

    // The pending pod gets its IP and turns ready.
    fake.apply(Resource::Pods, NS, pod("c", Some("127.0.0.5"), true, VLLM));
    wait_endpoints(
        &kvroute,
        "the pod that became ready",
        vec![
            ep("127.0.0.2", PORT),
            ep("127.0.0.2", PORT + 1),
            ep("127.0.0.4", PORT),
            ep("127.0.0.4", PORT + 1),
            ep("127.0.0.5", PORT),
            ep("127.0.0.5", PORT + 1),
        ],
    )
    .await;
    let counters = fake.counters();
    assert!(
        counters.pod_selectors.iter().all(|s| s == "app=vllm"),
        "the selector goes to the server: {:?}",
        counters.pod_selectors
    );
}

#[tokio::test]
async fn a_pod_that_turns_unready_leaves_and_returns_when_ready_again() {
    let fake = FakeKube::start().await;
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    fake.apply(Resource::Pods, NS, pod("b", Some("127.0.0.3"), true, VLLM));
    let kvroute = Kvroute::start(config(&fake, selector("app=vllm", &[PORT]))).await;
    let both = vec![ep("127.0.0.2", PORT), ep("127.0.0.3", PORT)];
    wait_endpoints(&kvroute, "both pods", both.clone()).await;

    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), false, VLLM));
    wait_endpoints(&kvroute, "a unready", vec![ep("127.0.0.3", PORT)]).await;

    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    wait_endpoints(&kvroute, "a ready again", both).await;
}

#[tokio::test]
async fn a_pod_that_changes_ip_moves_its_endpoint() {
    let fake = FakeKube::start().await;
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    let kvroute = Kvroute::start(config(&fake, selector("app=vllm", &[PORT]))).await;
    wait_endpoints(&kvroute, "the old IP", vec![ep("127.0.0.2", PORT)]).await;

    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.7"), true, VLLM));
    wait_endpoints(&kvroute, "the new IP", vec![ep("127.0.0.7", PORT)]).await;
}

#[tokio::test]
async fn deleted_and_terminating_pods_leave_with_their_in_flight_accounting() {
    let fake = FakeKube::start().await;
    for (name, ip) in [("a", "127.0.0.2"), ("b", "127.0.0.3"), ("c", "127.0.0.4")] {
        fake.apply(Resource::Pods, NS, pod(name, Some(ip), true, VLLM));
    }
    let kvroute = Kvroute::start(config(&fake, selector("app=vllm", &[PORT]))).await;
    let a = ep("127.0.0.2", PORT);
    wait_endpoints(
        &kvroute,
        "three pods",
        vec![a, ep("127.0.0.3", PORT), ep("127.0.0.4", PORT)],
    )
    .await;
    let load = kvroute.store.load(a).expect("a is known");
    let request = load.reserve(1_000, 0, PrefillEnd::FirstToken);
    assert_eq!(load.inflight(), 1);

    assert!(fake.delete(Resource::Pods, NS, "a"));
    wait_endpoints(
        &kvroute,
        "a deleted",
        vec![ep("127.0.0.3", PORT), ep("127.0.0.4", PORT)],
    )
    .await;

    let mut terminating = pod("b", Some("127.0.0.3"), true, VLLM);
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
    terminating["metadata"]["deletionGracePeriodSeconds"] = 30.into();
    fake.apply(Resource::Pods, NS, terminating);
    wait_endpoints(&kvroute, "b terminating", vec![ep("127.0.0.4", PORT)]).await;

    // The deleted pod's request ends (its connections went with it); a pod at the same
    // address later starts from a clean ledger.
    drop(request);
    drop(load);
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    wait_endpoints(&kvroute, "a back", vec![a, ep("127.0.0.4", PORT)]).await;
    let fresh = kvroute.store.load(a).expect("a is known again");
    assert_eq!(
        fresh.inflight(),
        0,
        "the old in-flight count went with the pod"
    );
}

#[tokio::test]
async fn a_pod_briefly_not_ready_keeps_the_requests_still_open_on_it() {
    let fake = FakeKube::start().await;
    for (name, ip) in [("a", "127.0.0.2"), ("b", "127.0.0.3")] {
        fake.apply(Resource::Pods, NS, pod(name, Some(ip), true, VLLM));
    }
    let kvroute = Kvroute::start(config(&fake, selector("app=vllm", &[PORT]))).await;
    let (a, b) = (ep("127.0.0.2", PORT), ep("127.0.0.3", PORT));
    wait_endpoints(&kvroute, "two pods", vec![a, b]).await;
    let request =
        kvroute
            .store
            .load(a)
            .expect("a is known")
            .reserve(1_000, 0, PrefillEnd::FirstToken);

    // A readiness probe fails once: the endpoint leaves, its streams go on.
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), false, VLLM));
    wait_endpoints(&kvroute, "a not ready", vec![b]).await;
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    wait_endpoints(&kvroute, "a ready again", vec![a, b]).await;
    let back = kvroute.store.load(a).expect("a is known again");
    assert_eq!(
        (back.inflight(), back.committed_tokens()),
        (1, 1_000),
        "the request still running there counts"
    );
    drop(request);
    assert_eq!(back.inflight(), 0);
}

#[tokio::test]
async fn a_pool_selector_change_rewatches_pods_with_the_new_selector() {
    let fake = FakeKube::start().await;
    fake.apply(
        Resource::Pods,
        NS,
        pod("blue", Some("127.0.0.2"), true, &[("app", "blue")]),
    );
    fake.apply(
        Resource::Pods,
        NS,
        pod("green", Some("127.0.0.3"), true, &[("app", "green")]),
    );
    fake.apply(
        Resource::InferencePools,
        NS,
        pool("llama", &[("app", "blue")], &[PORT]),
    );
    // A pool of the same name elsewhere is not ours.
    fake.apply(
        Resource::InferencePools,
        "elsewhere",
        pool("llama", &[("app", "green")], &[PORT]),
    );
    let kvroute = Kvroute::start(config(&fake, pool_named("llama"))).await;
    wait_endpoints(&kvroute, "the blue pods", vec![ep("127.0.0.2", PORT)]).await;

    fake.apply(
        Resource::InferencePools,
        NS,
        pool("llama", &[("app", "green")], &[PORT]),
    );
    wait_endpoints(&kvroute, "the green pods", vec![ep("127.0.0.3", PORT)]).await;
    assert_eq!(
        fake.counters().pod_selectors.last().map(String::as_str),
        Some("app=green")
    );

    // Pods follow the new selector live.
    fake.apply(
        Resource::Pods,
        NS,
        pod("green-2", Some("127.0.0.4"), true, &[("app", "green")]),
    );
    fake.apply(
        Resource::Pods,
        NS,
        pod("blue-2", Some("127.0.0.5"), true, &[("app", "blue")]),
    );
    wait_endpoints(
        &kvroute,
        "the second green pod",
        vec![ep("127.0.0.3", PORT), ep("127.0.0.4", PORT)],
    )
    .await;
}

#[tokio::test]
async fn pool_target_port_changes_apply_live_and_a_deleted_pool_routes_nowhere() {
    let fake = FakeKube::start().await;
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    fake.apply(Resource::Pods, NS, pod("b", Some("127.0.0.3"), true, VLLM));
    fake.apply(Resource::InferencePools, NS, pool("llama", VLLM, &[PORT]));
    let kvroute = Kvroute::start(config(&fake, pool_named("llama"))).await;
    wait_endpoints(
        &kvroute,
        "one port",
        vec![ep("127.0.0.2", PORT), ep("127.0.0.3", PORT)],
    )
    .await;
    let pod_lists = fake.counters().lists(Resource::Pods);

    fake.apply(
        Resource::InferencePools,
        NS,
        pool("llama", VLLM, &[PORT, PORT + 1]),
    );
    wait_endpoints(
        &kvroute,
        "two ports",
        vec![
            ep("127.0.0.2", PORT),
            ep("127.0.0.2", PORT + 1),
            ep("127.0.0.3", PORT),
            ep("127.0.0.3", PORT + 1),
        ],
    )
    .await;
    fake.apply(
        Resource::InferencePools,
        NS,
        pool("llama", VLLM, &[PORT + 2]),
    );
    wait_endpoints(
        &kvroute,
        "another port",
        vec![ep("127.0.0.2", PORT + 2), ep("127.0.0.3", PORT + 2)],
    )
    .await;
    assert_eq!(
        fake.counters().lists(Resource::Pods),
        pod_lists,
        "a port change needs no new pod list"
    );

    assert!(fake.delete(Resource::InferencePools, NS, "llama"));
    wait_endpoints(&kvroute, "no pool, no endpoints", vec![]).await;
    fake.apply(Resource::InferencePools, NS, pool("llama", VLLM, &[PORT]));
    wait_endpoints(
        &kvroute,
        "the pool is back",
        vec![ep("127.0.0.2", PORT), ep("127.0.0.3", PORT)],
    )
    .await;
}

#[tokio::test]
async fn dropped_watch_connections_resume_from_their_resource_version() {
    let fake = FakeKube::start().await;
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    let kvroute = Kvroute::start(config(&fake, selector("app=vllm", &[PORT]))).await;
    wait_endpoints(&kvroute, "a", vec![ep("127.0.0.2", PORT)]).await;
    wait_watching(&fake, 1).await;
    let before = fake.counters();

    // The connection breaks mid-stream; a change lands while it is down.
    fake.break_watches();
    fake.apply(Resource::Pods, NS, pod("b", Some("127.0.0.3"), true, VLLM));
    wait_endpoints(
        &kvroute,
        "b, after a broken connection",
        vec![ep("127.0.0.2", PORT), ep("127.0.0.3", PORT)],
    )
    .await;
    fake.wait_for("a new pod watch", |c| {
        c.watches(Resource::Pods) > before.watches(Resource::Pods) && c.open_watches == 1
    })
    .await;

    // The server ends the watch (as at its timeout); another change.
    let watches = fake.counters().watches(Resource::Pods);
    fake.close_watches();
    assert!(fake.delete(Resource::Pods, NS, "a"));
    wait_endpoints(
        &kvroute,
        "a gone, after a closed watch",
        vec![ep("127.0.0.3", PORT)],
    )
    .await;
    fake.wait_for("another pod watch", |c| {
        c.watches(Resource::Pods) > watches && c.open_watches == 1
    })
    .await;

    let after = fake.counters();
    assert_eq!(
        after.lists(Resource::Pods),
        before.lists(Resource::Pods),
        "resumed from the resourceVersion, no relist"
    );
    assert_eq!(after.expired(Resource::Pods), 0);
}

#[tokio::test]
async fn an_expired_resource_version_forces_a_relist_and_the_state_converges() {
    let fake = FakeKube::start().await;
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    fake.apply(Resource::Pods, NS, pod("b", Some("127.0.0.3"), true, VLLM));
    fake.apply(Resource::InferencePools, NS, pool("llama", VLLM, &[PORT]));
    let kvroute = Kvroute::start(config(&fake, pool_named("llama"))).await;
    wait_endpoints(
        &kvroute,
        "a and b",
        vec![ep("127.0.0.2", PORT), ep("127.0.0.3", PORT)],
    )
    .await;
    wait_watching(&fake, 2).await;
    let before = fake.counters();

    // Changes the watches never see, then the history is compacted away and the
    // connections break: resuming gets 410 Gone, only a relist can catch up.
    fake.partition(true);
    assert!(fake.delete(Resource::Pods, NS, "a"));
    fake.apply(Resource::Pods, NS, pod("b", Some("127.0.0.3"), false, VLLM));
    fake.apply(Resource::Pods, NS, pod("c", Some("127.0.0.4"), true, VLLM));
    fake.compact();
    fake.break_watches();
    fake.partition(false);

    wait_endpoints(&kvroute, "the relisted state", vec![ep("127.0.0.4", PORT)]).await;
    let after = fake.counters();
    assert!(after.expired(Resource::Pods) > 0, "{after:?}");
    assert!(
        after.lists(Resource::Pods) > before.lists(Resource::Pods),
        "{after:?}"
    );
    fake.wait_for("the pool relisted after its own 410", |c| {
        c.expired(Resource::InferencePools) > 0
            && c.lists(Resource::InferencePools) > before.lists(Resource::InferencePools)
    })
    .await;

    // And it keeps watching from the new list.
    fake.apply(Resource::Pods, NS, pod("d", Some("127.0.0.5"), true, VLLM));
    wait_endpoints(
        &kvroute,
        "d, watched after the relist",
        vec![ep("127.0.0.4", PORT), ep("127.0.0.5", PORT)],
    )
    .await;
}

#[tokio::test]
async fn a_bookmark_lets_the_watch_resume_past_compacted_history() {
    let fake = FakeKube::start().await;
    fake.apply(Resource::Pods, NS, pod("a", Some("127.0.0.2"), true, VLLM));
    let kvroute = Kvroute::start(config(&fake, selector("app=vllm", &[PORT]))).await;
    wait_endpoints(&kvroute, "a", vec![ep("127.0.0.2", PORT)]).await;
    wait_watching(&fake, 1).await;
    let before = fake.counters();

    // Changes the watch filters out move the resourceVersion on without it.
    for name in ["x", "y", "z"] {
        fake.apply(
            Resource::Pods,
            NS,
            pod(name, Some("127.0.0.9"), true, &[("app", "other")]),
        );
    }
    // The bookmark carries the new version; then history is compacted to it and the
    // watch ends: resuming from the bookmark needs no relist.
    fake.bookmark();
    fake.compact();
    fake.close_watches();
    fake.wait_for("the pod watch resumed", |c| {
        c.watches(Resource::Pods) > before.watches(Resource::Pods) && c.open_watches == 1
    })
    .await;
    fake.apply(Resource::Pods, NS, pod("b", Some("127.0.0.3"), true, VLLM));
    wait_endpoints(
        &kvroute,
        "b, on the resumed watch",
        vec![ep("127.0.0.2", PORT), ep("127.0.0.3", PORT)],
    )
    .await;
    let after = fake.counters();
    assert_eq!(after.expired(Resource::Pods), 0, "{after:?}");
    assert_eq!(after.lists(Resource::Pods), before.lists(Resource::Pods));
}

#[tokio::test]
async fn discovered_endpoints_are_scraped_and_follow_the_pool() {
    let pods = [
        FakePod::start("pod-a", "llama", &[]).await,
        FakePod::start("pod-b", "llama", &[]).await,
    ];
    let fake = FakeKube::start().await;
    // One pod at 127.0.0.1 with two target ports: the two fake vLLM servers.
    fake.apply(
        Resource::Pods,
        NS,
        pod("vllm-0", Some("127.0.0.1"), true, VLLM),
    );
    fake.apply(
        Resource::InferencePools,
        NS,
        pool("llama", VLLM, &[pods[0].addr.port(), pods[1].addr.port()]),
    );
    let kvroute = Kvroute::start(config(&fake, pool_named("llama"))).await;
    kvroute.wait_until_scraped(2).await;

    fake.apply(
        Resource::InferencePools,
        NS,
        pool("llama", VLLM, &[pods[1].addr.port()]),
    );
    wait_endpoints(&kvroute, "one port left", vec![pods[1].addr]).await;
    kvroute.wait_until_scraped(1).await;
}
