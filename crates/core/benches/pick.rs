//! Cost of one scheduling decision, `scheduler::pick`, by fleet size.
//! Run: `cargo bench -p kvroute-core --bench pick`. Targets: ≤ 2 µs at 8 pods, ≤ 20 µs at
//! 1,000 and ≤ 50 µs at 4,096, with LoRA affinity and a shared-prefix match (every pod
//! holds the request's 2 KiB system prompt, one pod its whole prompt), with LoRA
//! affinity alone and for the base model, on a fleet about half of whose pods are
//! saturated; `base_model_light` on a fleet where every pod passes every filter;
//! `pick_cold`: some of the same with the fleet out of cache before each pick. Also the
//! per-snapshot model index build.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use kvroute_core::fleet::{
    AdapterIndex, Fleet, LoraStatus, ModelIndex, PodLoad, PodMetrics, PodView, PrefixMatches,
    ServedModels, adapter_key,
};
use kvroute_core::request::{InferenceRequest, RouteRequest};
use kvroute_core::scheduler::{Outlook, Picked, SchedulerConfig, pick, pick_unless};

const ADAPTERS: usize = 16;

/// A fleet with varied load: KV use 0–95 %, queues 0–7 (about half the pods saturated
/// by one or the other), two of 16 adapters running per pod, some in-flight accounting.
fn fleet(pods: usize, rng: &mut SmallRng) -> Fleet {
    fleet_loaded(pods, rng, Load::Varied)
}

/// How loaded a benchmark fleet's pods are.
#[derive(Clone, Copy, PartialEq)]
enum Load {
    /// KV use 0–95 %, queues 0–7: about half the pods fail a soft filter.
    Varied,
    /// KV use 0–60 %, queues 0–2: every pod passes every filter, so every pod is read
    /// in full and scored (the pick's most expensive fleet of a given size).
    Light,
    /// KV use 99.6–100 %, queues 8–15: no pod has room for the request (past the knee,
    /// where flow control holds requests and tries them again at every finish).
    Full,
}

fn fleet_loaded(pods: usize, rng: &mut SmallRng, load: Load) -> Fleet {
    let (waiting, kv_usage) = match load {
        Load::Varied => (0..8, 0.0..0.95),
        Load::Light => (0..3, 0.0..0.6),
        Load::Full => (8..16, 0.996..1.0),
    };
    let adapter_names: Vec<String> = (0..ADAPTERS).map(|a| format!("adapter-{a}")).collect();
    let served = Arc::new(ServedModels {
        base: vec!["llama".into()],
        adapters: adapter_names
            .iter()
            .map(|a| (a.clone(), "llama".to_owned()))
            .collect::<HashMap<_, _>>(),
    });
    let pods = (0..pods)
        .map(|i| {
            let endpoint = SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8000));
            let running = vec![
                adapter_names[rng.random_range(0..ADAPTERS)].clone(),
                adapter_names[rng.random_range(0..ADAPTERS)].clone(),
            ];
            let view = PodView::new(
                endpoint,
                true,
                Some(Arc::new(PodMetrics {
                    waiting: rng.random_range(waiting.clone()),
                    running: rng.random_range(0..64),
                    kv_usage: rng.random_range(kv_usage.clone()),
                    kv_capacity_tokens: Some(400_000),
                    num_gpu_blocks: Some(25_000),
                    block_size: Some(16),
                    engines: 1,
                    lora: Some(LoraStatus {
                        max_lora: 4,
                        running,
                        waiting: Vec::new(),
                    }),
                    ..PodMetrics::default()
                })),
                Some(Duration::from_millis(20)),
                Some(Arc::clone(&served)),
            );
            let load = PodLoad::with_values(rng.random_range(0..16), rng.random_range(0..20_000));
            (view, Arc::new(load))
        })
        .collect::<Vec<_>>();
    Fleet::new(pods, 1, 1)
}

/// The requests each fleet size is picked for, by case name (`..._light`: the request
/// against a [`Load::Light`] fleet, where every pod is scored; `..._full`: against a
/// [`Load::Full`] one, where flow control declines the pick, `_declined` when it says so
/// before the pods are scored, with `pick_unless`).
const CASES: [&str; 7] = [
    "base_model",
    "lora_adapter",
    "lora_adapter_shared_prefix",
    "base_model_light",
    "lora_adapter_light",
    "base_model_full",
    "base_model_full_declined",
];

/// The fleet a case is picked against.
fn fleet_of(case: &str, pods: usize, rng: &mut SmallRng) -> Fleet {
    let load = if case.ends_with("_light") {
        Load::Light
    } else if case.contains("_full") {
        Load::Full
    } else {
        Load::Varied
    };
    fleet_loaded(pods, rng, load)
}

/// Runs `f` with the request (and prefix matches) of `case` against `snapshot`.
fn with_case<T>(
    case: &str,
    snapshot: &Fleet,
    f: impl FnOnce(&RouteRequest<'_>, Option<&PrefixMatches>) -> T,
) -> T {
    let base_body = InferenceRequest {
        model: "llama".into(),
        prompt_tokens: 1_500,
        max_output_tokens: Some(256),
        stream: false,
        prompt_prefix: Vec::new(),
        prefix_context: 0,
    };
    let body = match case {
        "base_model" | "base_model_light" | "base_model_full" | "base_model_full_declined" => {
            base_body
        }
        _ => InferenceRequest {
            model: "adapter-3".into(),
            ..base_body
        },
    };
    let request = RouteRequest {
        inference: Some(&body),
        subset: None,
    };
    if case != "lora_adapter_shared_prefix" {
        return f(&request, None);
    }
    // A 1,500-token prompt is 94 blocks: every pod holds the first 32 (the system
    // prompt), one pod all of them.
    let size = snapshot.snapshot().pods().len();
    let held: Vec<(SocketAddr, u32)> = snapshot
        .snapshot()
        .pods()
        .iter()
        .enumerate()
        .map(|(i, pod)| (pod.endpoint, if i == size / 2 { 94 } else { 32 }))
        .collect();
    let prefix = shared_prefix(94, snapshot, &held);
    f(&request, Some(&prefix))
}

fn bench_pick(c: &mut Criterion) {
    let mut group = c.benchmark_group("pick");
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    let config = SchedulerConfig::default();
    for size in [8usize, 64, 512, 1000, 4096] {
        for case in CASES {
            let mut rng = SmallRng::seed_from_u64(42);
            let snapshot = fleet_of(case, size, &mut rng);
            with_case(case, &snapshot, |request, prefix| {
                if case.contains("_full") {
                    let placed = picked(case, request, prefix, &snapshot, &config, &mut rng);
                    assert!(!placed, "{case}: no pod has room");
                }
                group.bench_with_input(BenchmarkId::new(case, size), &snapshot, |b, snapshot| {
                    b.iter(|| {
                        picked(
                            case,
                            black_box(request),
                            prefix,
                            snapshot,
                            &config,
                            &mut rng,
                        )
                    })
                });
            });
        }
    }
    group.finish();
}

/// The same picks with the caches' contents replaced before each (not timed): every pick
/// reads the fleet from memory, as in a gateway whose other work (tokio's other tasks,
/// the scrapes' parsing) ran since the last pick, rather than from the core's own cache
/// as `pick` measures it.
fn bench_pick_cold(c: &mut Criterion) {
    let mut group = c.benchmark_group("pick_cold");
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    let config = SchedulerConfig::default();
    // Larger than the last-level cache (32 MiB on the machine the docs quote).
    let mut other_work = vec![0u64; 64 << 20 >> 3];
    for size in [1000usize, 4096] {
        for case in ["base_model_light", "lora_adapter_light", "lora_adapter"] {
            let mut rng = SmallRng::seed_from_u64(42);
            let snapshot = fleet_of(case, size, &mut rng);
            // Each pod was lately sent requests for the adapters it runs and one other.
            for (pod, load) in snapshot.pods() {
                let running = pod.metrics().and_then(|m| m.lora.as_ref());
                for adapter in running.iter().flat_map(|lora| &lora.running) {
                    load.note_adapter(adapter_key(adapter));
                }
                load.note_adapter(adapter_key(&format!(
                    "adapter-{}",
                    rng.random_range(0..ADAPTERS)
                )));
            }
            with_case(case, &snapshot, |request, prefix| {
                group.bench_with_input(BenchmarkId::new(case, size), &snapshot, |b, snapshot| {
                    b.iter_batched(
                        || {
                            for word in other_work.iter_mut().step_by(8) {
                                *word = word.wrapping_add(1);
                            }
                            black_box(&other_work);
                        },
                        |()| {
                            picked(
                                case,
                                black_box(request),
                                prefix,
                                snapshot,
                                &config,
                                &mut rng,
                            )
                        },
                        BatchSize::PerIteration,
                    )
                });
            });
        }
    }
    group.finish();
}

/// `PICK_COUNT=case/pods/picks`: builds the fleet and runs that many picks, nothing
/// else, for an instruction count under `valgrind --tool=cachegrind` (`scripts/pick-
/// instructions`). This VM's timings move 2× between runs; instruction counts do not.
fn count_picks(spec: &str) {
    let parts: Vec<&str> = spec.split('/').collect();
    let [case, pods, picks] = parts[..] else {
        panic!("PICK_COUNT={spec}: expected case/pods/picks");
    };
    assert!(CASES.contains(&case), "unknown case {case}");
    let (pods, picks): (usize, usize) = (pods.parse().unwrap(), picks.parse().unwrap());
    let mut rng = SmallRng::seed_from_u64(42);
    let snapshot = fleet_of(case, pods, &mut rng);
    let config = SchedulerConfig::default();
    with_case(case, &snapshot, |request, prefix| {
        for _ in 0..picks {
            black_box(picked(
                case,
                black_box(request),
                prefix,
                &snapshot,
                &config,
                &mut rng,
            ));
        }
    });
}

/// One pick of `case`: whether it placed the request.
fn picked(
    case: &str,
    request: &RouteRequest<'_>,
    prefix: Option<&PrefixMatches>,
    fleet: &Fleet,
    config: &SchedulerConfig,
    rng: &mut SmallRng,
) -> bool {
    if case.ends_with("_declined") {
        let picked = pick_unless(request, prefix, fleet, config, rng, Outlook::lacks_room);
        return matches!(picked, Ok(Picked::Decided(_)));
    }
    pick(request, prefix, fleet, config, rng).is_ok_and(|d| !d.lacks_room())
}

fn shared_prefix(request_blocks: u32, fleet: &Fleet, held: &[(SocketAddr, u32)]) -> PrefixMatches {
    PrefixMatches::new(request_blocks, fleet.snapshot(), held)
}

/// The model index is built once per published snapshot (not per request): its cost
/// bounds how often the store can publish.
fn bench_model_index(c: &mut Criterion) {
    let mut group = c.benchmark_group("model_index");
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    for size in [64usize, 1000, 4096] {
        let fleet = fleet(size, &mut SmallRng::seed_from_u64(42));
        let pods = fleet.snapshot().pods();
        group.bench_with_input(BenchmarkId::new("build", size), pods, |b, pods| {
            b.iter(|| ModelIndex::build(black_box(pods)))
        });
        group.bench_with_input(
            BenchmarkId::new("adapter_index_build", size),
            pods,
            |b, pods| b.iter(|| AdapterIndex::build(black_box(pods))),
        );
        // A whole publish, as the store makes it: the snapshot of every pod with its
        // dense rows and both indexes.
        let pods: Vec<(PodView, Arc<PodLoad>)> = fleet
            .pods()
            .map(|(pod, load)| (pod.clone(), Arc::clone(load)))
            .collect();
        group.bench_with_input(BenchmarkId::new("publish", size), &pods, |b, pods| {
            b.iter(|| Fleet::new(black_box(pods.clone()), 2, 1))
        });
        // The store's publish every scrape interval: after a fleet whose pods listed the
        // same models (what the model index read of the lists is reused).
        group.bench_with_input(BenchmarkId::new("republish", size), &pods, |b, pods| {
            b.iter(|| Fleet::new_after(&fleet, black_box(pods.clone()), 2, 1))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_pick, bench_pick_cold, bench_model_index);

fn main() {
    if let Ok(spec) = std::env::var("PICK_COUNT") {
        count_picks(&spec);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
