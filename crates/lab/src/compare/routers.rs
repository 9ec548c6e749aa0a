//! Starting each router the comparison measures in front of a fleet, and stopping it.
//!
//! - `kvroute`: `kvroute serve` (the gateway binary, in its own process like every other
//!   router) behind Envoy with the shipped fail-closed gateway (ORIGINAL_DST), scraping
//!   every 50 ms of simulated time;
//! - `round-robin`, `least-request`: Envoy's own load balancers, no picker;
//! - `sglang`, `vllm-router`: `python -m sglang_router.launch_router` /
//!   `python -m vllm_router.launch_router` with `--policy cache_aware`, bound to 127.0.0.1.
//!
//! Every router is held by a guard that stops it when dropped: nothing outlives a run.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::envoy::{EnvoyProcess, Gateway, free_port};
use crate::loadgen::Workload;
use kvroute_core::flow::{DEFAULT_STANDING, StandingQueue};

/// A router the comparison can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterKind {
    /// kvroute behind Envoy (shipped fail-closed gateway).
    Kvroute,
    /// kvroute matching prompts on the pods' KV events (`--prefix-source auto`).
    KvrouteEvents,
    /// Two kvroute replicas behind one Envoy (its ext_proc cluster balancing streams over
    /// both), each with its own ledgers and approximate prefix memory.
    #[value(name = "kvroute-x2")]
    KvrouteReplicas,
    /// Two kvroute replicas behind one Envoy, both following the pods' KV events.
    #[value(name = "kvroute-events-x2")]
    KvrouteEventsReplicas,
    /// kvroute following the pods' KV events and tokenizing prompts itself with the model's
    /// tokenizer (`--tokenizer`, the directory `compare --tokenizer` gives the pods).
    KvrouteEventsLocal,
    /// Envoy ROUND_ROBIN.
    RoundRobin,
    /// Envoy LEAST_REQUEST.
    LeastRequest,
    /// sglang-router, cache_aware.
    Sglang,
    /// vllm-router, cache_aware.
    VllmRouter,
    /// `simulate`'s model of the two routers' cache_aware policy (not a live router).
    #[value(skip)]
    CacheAware,
}

impl RouterKind {
    /// Every router, in report order.
    pub const ALL: [RouterKind; 5] = [
        RouterKind::Kvroute,
        RouterKind::RoundRobin,
        RouterKind::LeastRequest,
        RouterKind::Sglang,
        RouterKind::VllmRouter,
    ];

    /// Every router including the opt-in ones, in report order (their plot colours).
    pub const EVERY: [RouterKind; 10] = [
        RouterKind::Kvroute,
        RouterKind::RoundRobin,
        RouterKind::LeastRequest,
        RouterKind::Sglang,
        RouterKind::VllmRouter,
        RouterKind::KvrouteEvents,
        RouterKind::KvrouteReplicas,
        RouterKind::KvrouteEventsReplicas,
        RouterKind::CacheAware,
        RouterKind::KvrouteEventsLocal,
    ];

    /// The name used in flags, tables and file names.
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::Kvroute => "kvroute",
            RouterKind::KvrouteEvents => "kvroute-events",
            RouterKind::KvrouteReplicas => "kvroute-x2",
            RouterKind::KvrouteEventsReplicas => "kvroute-events-x2",
            RouterKind::KvrouteEventsLocal => "kvroute-events-local",
            RouterKind::RoundRobin => "round-robin",
            RouterKind::LeastRequest => "least-request",
            RouterKind::Sglang => "sglang",
            RouterKind::VllmRouter => "vllm-router",
            RouterKind::CacheAware => "cache-aware",
        }
    }

    /// What it is, in words, for the report.
    pub fn description(self) -> &'static str {
        match self {
            RouterKind::Kvroute => {
                "kvroute behind Envoy, shipped fail-closed gateway (ORIGINAL_DST), scrape every 50 ms simulated but at most every 20 ms of wall time, requests held at most 15 s simulated (`--max-queue-wait`)"
            }
            RouterKind::KvrouteEvents => {
                "kvroute as above with `--prefix-source auto`: each pod publishes its KV cache events as vLLM does (`--kv-events-config`), kvroute follows them and matches each prompt, tokenized on a pod's `/tokenize`, against what the pods really cache"
            }
            RouterKind::KvrouteReplicas => {
                "two kvroute replicas as `kvroute`, behind one Envoy whose ext_proc cluster balances streams over both (round robin); no replica-to-replica protocol: each guesses prefixes from what it alone sent"
            }
            RouterKind::KvrouteEventsReplicas => {
                "two kvroute replicas as `kvroute-events`, behind one Envoy whose ext_proc cluster balances streams over both; each follows every pod's KV events, so both see what the pods cache"
            }
            RouterKind::KvrouteEventsLocal => {
                "kvroute as `kvroute-events`, tokenizing each prompt itself with the model's `tokenizer.json` and chat template (`--tokenizer`, the directory the pods tokenize with) instead of a pod's `/tokenize`"
            }
            RouterKind::RoundRobin => "Envoy `ROUND_ROBIN`",
            RouterKind::LeastRequest => "Envoy `LEAST_REQUEST`",
            RouterKind::Sglang => "sglang-router `--policy cache_aware` (PyPI)",
            RouterKind::VllmRouter => "vllm-router `--policy cache_aware` (PyPI)",
            RouterKind::CacheAware => {
                "`kvroute-lab simulate`'s model of the cache_aware policy of sglang-router and vllm-router (offline only)"
            }
        }
    }

    /// How many kvroute processes serve as this router (0: not kvroute).
    pub fn kvroute_replicas(self) -> usize {
        match self {
            RouterKind::Kvroute | RouterKind::KvrouteEvents | RouterKind::KvrouteEventsLocal => 1,
            RouterKind::KvrouteReplicas | RouterKind::KvrouteEventsReplicas => 2,
            _ => 0,
        }
    }

    /// Whether the fleet publishes KV events and kvroute follows them.
    pub fn follows_kv_events(self) -> bool {
        matches!(
            self,
            RouterKind::KvrouteEvents
                | RouterKind::KvrouteEventsReplicas
                | RouterKind::KvrouteEventsLocal
        )
    }

    /// The Python module and its `--log-level` for warnings (the two spell it differently).
    fn python_module(self) -> Option<(&'static str, &'static str)> {
        match self {
            RouterKind::Sglang => Some(("sglang_router.launch_router", "warn")),
            RouterKind::VllmRouter => Some(("vllm_router.launch_router", "warning")),
            _ => None,
        }
    }
}

/// Where the external programs are, and where their logs go.
#[derive(Debug, Clone)]
pub struct Tools {
    /// Envoy binary.
    pub envoy: PathBuf,
    /// The gateway binary, `kvroute`.
    pub kvroute: PathBuf,
    /// Python with sglang-router and vllm-router installed.
    pub python: PathBuf,
    /// Directory for the routers' logs.
    pub log_dir: PathBuf,
    /// kvroute's scrape period (wall time) instead of 50 ms simulated.
    pub kvroute_scrape_interval: Option<Duration>,
    /// kvroute's gateways run their response observer (`compare --observe-responses`).
    pub observe_responses: bool,
    /// The model directory the pods tokenize with (`compare --tokenizer`), which
    /// `kvroute-events-local` tokenizes with too.
    pub tokenizer: Option<PathBuf>,
}

/// What kvroute's own counters said at the end of a run.
#[derive(Debug, Default)]
pub struct KvrouteCounters {
    /// Requests each replica routed, in replica order.
    pub routed: Vec<u64>,
    /// Prefix predictions checked, summed over the replicas (none without the observer).
    pub prefix_checks: Vec<super::report::PrefixCheckCount>,
    /// What the KV-event subscriptions did, summed over the replicas (routers on events).
    pub kv_events: Option<super::report::KvEventCounts>,
}

/// What the kvroute processes whose `/metrics` listen at `metrics` counted so far, summed
/// (the KV-event subscriptions' counts when they follow the pods' events).
pub(crate) async fn kvroute_counters(
    metrics: &[SocketAddr],
    follows_kv_events: bool,
) -> anyhow::Result<KvrouteCounters> {
    let client = reqwest::Client::new();
    let mut routed = Vec::with_capacity(metrics.len());
    let mut checks: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut events = super::report::KvEventCounts::default();
    let (mut tokenize_s, mut tokenized) = (0.0, 0.0);
    for addr in metrics {
        let text = client
            .get(format!("http://{addr}/metrics"))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        const DECISIONS: &str = "kvroute_decisions_total";
        const CHECKS: &str = "kvroute_prefix_checks_total";
        const BATCHES: &str = "kvroute_kv_event_batches_total";
        const GAPS: &str = "kvroute_kv_event_gaps_total";
        const REPLAYS: &str = "kvroute_kv_event_replays_total";
        const RESETS: &str = "kvroute_kv_event_resets_total";
        const TOKENIZE_SUM: &str = "kvroute_tokenize_duration_seconds_sum";
        const TOKENIZE_COUNT: &str = "kvroute_tokenize_duration_seconds_count";
        const STREAMS: &str = "kvroute_kv_event_streams";
        const PREDICTED: &str = "kvroute_prefix_predicted_cached_tokens_total";
        let samples = kvroute_core::exposition::parse_where(&text, |name| {
            [
                DECISIONS,
                CHECKS,
                BATCHES,
                GAPS,
                REPLAYS,
                RESETS,
                TOKENIZE_SUM,
                TOKENIZE_COUNT,
                STREAMS,
                PREDICTED,
            ]
            .contains(&name)
        })
        .map_err(|e| anyhow::anyhow!("kvroute's /metrics at {addr}: {e}"))?;
        let mut decisions = 0.0;
        for sample in &samples {
            let label = |name: &str| sample.label(name).unwrap_or_default().to_owned();
            let count = sample.value as u64;
            match sample.name {
                DECISIONS => decisions += sample.value,
                CHECKS if sample.value > 0.0 => {
                    *checks
                        .entry((label("source"), label("outcome")))
                        .or_default() += count;
                }
                BATCHES => *events.batches.entry(label("result")).or_default() += count,
                GAPS => events.gaps += count,
                REPLAYS => *events.replays.entry(label("outcome")).or_default() += count,
                RESETS => events.resets += count,
                TOKENIZE_SUM => tokenize_s += sample.value,
                TOKENIZE_COUNT => {
                    tokenized += sample.value;
                    if label("tokenizer") == "local" && label("outcome") == "ok" {
                        events.tokenized_locally += count;
                    }
                }
                STREAMS => events.streams += count,
                PREDICTED => {
                    *events.predicted_tokens.entry(label("source")).or_default() += count;
                }
                _ => {}
            }
        }
        routed.push(decisions as u64);
    }
    events.tokenized = tokenized as u64;
    events.tokenize_mean_ms = (tokenized > 0.0).then(|| tokenize_s / tokenized * 1e3);
    let prefix_checks = checks
        .into_iter()
        .map(
            |((source, outcome), requests)| super::report::PrefixCheckCount {
                source,
                outcome,
                requests,
            },
        )
        .collect();
    Ok(KvrouteCounters {
        routed,
        prefix_checks,
        kv_events: follows_kv_events.then_some(events),
    })
}

/// A running router; stopped by [`RunningRouter::stop`] or when dropped.
pub struct RunningRouter {
    /// Which router.
    pub kind: RouterKind,
    /// Base URL clients send to.
    pub base_url: String,
    guard: Guard,
}

enum Guard {
    Kvroute {
        // Declared first: dropped (killed) before kvroute stops.
        envoy: EnvoyProcess,
        kvroutes: Vec<ChildGuard>,
        /// Each replica's `/metrics` address.
        metrics: Vec<SocketAddr>,
    },
    Envoy(EnvoyProcess),
    Process(ChildGuard),
}

/// A child process killed (and reaped) when dropped.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl RunningRouter {
    /// How many requests each kvroute replica routed so far (its `kvroute_decisions_total`
    /// over every reason), in replica order, and its checks of predicted cached tokens;
    /// empty for the other routers. With two replicas it shows that Envoy spread the
    /// streams over both.
    pub async fn kvroute_counters(&self) -> anyhow::Result<KvrouteCounters> {
        let Guard::Kvroute { metrics, .. } = &self.guard else {
            return Ok(KvrouteCounters::default());
        };
        kvroute_counters(metrics, self.kind.follows_kv_events()).await
    }

    /// Stops the router and waits until it is gone.
    pub async fn stop(self) {
        match self.guard {
            Guard::Kvroute {
                envoy, kvroutes, ..
            } => {
                drop(envoy);
                drop(kvroutes);
            }
            Guard::Envoy(envoy) => drop(envoy),
            Guard::Process(child) => drop(child),
        }
    }
}

/// Starts `kind` in front of `pods` (a fleet clocked `speedup` times faster) for `workload`
/// (kvroute gets its objectives' priorities) and waits until it answers a completion for
/// the workload's model.
pub async fn start(
    kind: RouterKind,
    pods: &[SocketAddr],
    speedup: f64,
    workload: &Workload,
    tools: &Tools,
    kv_events: Option<&KvEventTemplates>,
) -> anyhow::Result<RunningRouter> {
    let model = workload.model.as_str();
    let (guard, base_url) = match kind {
        RouterKind::Kvroute
        | RouterKind::KvrouteEvents
        | RouterKind::KvrouteReplicas
        | RouterKind::KvrouteEventsReplicas
        | RouterKind::KvrouteEventsLocal => {
            let mut timing = KvrouteTiming::for_speedup(speedup);
            if let Some(interval) = tools.kvroute_scrape_interval {
                timing.scrape_interval = interval;
                timing.max_metrics_age = timing.max_metrics_age.max(interval * 10);
            }
            let objectives = workload.objectives.clone().unwrap_or_default();
            let events = if kind.follows_kv_events() {
                Some(kv_events.context("kvroute-events needs a fleet publishing KV events")?)
            } else {
                None
            };
            let replicas = kind.kvroute_replicas();
            let tokenizer = if kind == RouterKind::KvrouteEventsLocal {
                Some(tools.tokenizer.as_deref().context(
                    "kvroute-events-local tokenizes with the pods' tokenizer: give `--tokenizer DIR`",
                )?)
            } else {
                None
            };
            let launch = KvrouteLaunch {
                timing,
                pods,
                objectives: &objectives,
                tools,
                kv_events: events,
                replicas,
                tokenizer,
            };
            start_kvroute(&launch).await?
        }
        RouterKind::RoundRobin | RouterKind::LeastRequest => {
            let gateway = if kind == RouterKind::RoundRobin {
                Gateway::RoundRobin
            } else {
                Gateway::LeastRequest
            };
            let envoy = EnvoyProcess::start(gateway, pods, &tools.envoy, "error").await?;
            let url = envoy.url("");
            (Guard::Envoy(envoy), url)
        }
        RouterKind::Sglang | RouterKind::VllmRouter => {
            let (module, level) = kind.python_module().unwrap_or_default();
            let log = tools.log_dir.join(format!("{}.log", kind.name()));
            let (child, url) = start_python_router(&tools.python, module, level, pods, &log)?;
            (Guard::Process(child), url)
        }
        RouterKind::CacheAware => anyhow::bail!(
            "cache-aware is `kvroute-lab simulate`'s model of the peers' policy; live, run sglang or vllm-router"
        ),
    };
    let mut router = RunningRouter {
        kind,
        base_url,
        guard,
    };
    let base = router.base_url.clone();
    let guard = &mut router.guard;
    let alive = move || match guard {
        Guard::Process(ChildGuard(child)) => match child.try_wait() {
            Ok(Some(status)) => Err(format!("it exited ({status}); see its log")),
            _ => Ok(()),
        },
        _ => Ok(()),
    };
    wait_answering(&base, model, Duration::from_secs(90), alive)
        .await
        .with_context(|| format!("{} did not become ready", kind.name()))?;
    Ok(router)
}

/// Where the pods of a fleet publish their KV events, as `kvroute serve` templates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventTemplates {
    pub endpoint: String,
    pub replay: String,
}

impl KvEventTemplates {
    /// The templates for pods whose HTTP ports start at `http`, publishers at `publish`
    /// and replay sockets at `replay`, each pod at the same offset in all three.
    pub fn shifted(http: u16, publish: u16, replay: u16) -> KvEventTemplates {
        KvEventTemplates {
            endpoint: port_shift_template(http, publish),
            replay: port_shift_template(http, replay),
        }
    }

    /// The `kvroute serve` flags that follow the pods' events where these say they
    /// publish them (`--prefix-source auto`).
    pub fn kvroute_args(&self) -> [String; 3] {
        [
            "--prefix-source=auto".to_string(),
            format!("--kv-events-endpoint={}", self.endpoint),
            format!("--kv-events-replay-endpoint={}", self.replay),
        ]
    }
}

/// Three ranges of `n` consecutive free loopback ports, apart from each other: the pods'
/// HTTP ports, their KV event publishers' and their replay sockets' (pod `i` on each
/// base + `i`), released for the pods to bind.
pub fn reserve_kv_event_ports(n: usize) -> anyhow::Result<[u16; 3]> {
    let n = u16::try_from(n).context("too many pods")?;
    // Held together, so the three ranges differ.
    let (http, a) = crate::envoy::reserve_port_range(n)?;
    let (publish, b) = crate::envoy::reserve_port_range(n)?;
    let (replay, c) = crate::envoy::reserve_port_range(n)?;
    drop((a, b, c));
    Ok([http, publish, replay])
}

/// vLLM's `--kv-events-config` publishing on ZeroMQ at `publish`, replaying at `replay`.
pub fn kv_events_config_json(publish: u16, replay: u16) -> String {
    format!(
        r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{publish}", "replay_endpoint": "tcp://*:{replay}", "topic": "kv"}}"#
    )
}

/// `config` with every pod publishing KV events as vLLM does, on consecutive loopback
/// ports (pod `i` on the base port + `i`, as vLLM offsets data-parallel ranks), its HTTP
/// ports consecutive too, so that one template (`{port+N}`) names every pod's publisher.
pub fn with_kv_events(
    mut config: kvroute_sim::FleetConfig,
) -> anyhow::Result<(kvroute_sim::FleetConfig, KvEventTemplates)> {
    let [http, publish, replay] = reserve_kv_event_ports(config.pods.len())?;
    let events =
        kvroute_sim::kv_events::KvEventsConfig::from_json(&kv_events_config_json(publish, replay))
            .map_err(|e| anyhow::anyhow!("kv events config: {e}"))?;
    config.port = http;
    for pod in &mut config.pods {
        pod.kv_events = Some(events.clone());
    }
    Ok((config, KvEventTemplates::shifted(http, publish, replay)))
}

/// The `kvroute serve` endpoint template naming, for a pod whose HTTP port is `http`,
/// port `to` on its host: `tcp://{host}:{port+N}` (or `-N`).
pub fn port_shift_template(http: u16, to: u16) -> String {
    let delta = i32::from(to) - i32::from(http);
    if delta >= 0 {
        format!("tcp://{{host}}:{{port+{delta}}}")
    } else {
        format!("tcp://{{host}}:{{port-{}}}", -delta)
    }
}

/// kvroute scrapes every 50 ms of simulated time (at least every 2 ms of wall time) and
/// counts metrics older than 1 simulated second as stale, as it would in front of real pods.
/// Never scrape faster than this in wall time: the simulated fleet shares this machine's
/// two cores with kvroute, and at 5 ms (50 ms of simulated time at speedup 10) the
/// scraping alone starved the simulator, whose late token delivery then showed up as
/// kvroute's latency (multi-lora, 2 req/s: p90 TTFT 1.64x round robin at 5 ms, 0.98x at
/// 20 ms). The cost of the floor falls on kvroute: at speedup 10 its metrics are up to
/// 200 ms of simulated time old, four times staler than the 50 ms real deployments use.
pub const MIN_WALL_SCRAPE_INTERVAL: Duration = Duration::from_millis(20);

/// The two settings of `kvroute serve` that follow the simulation's speedup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvrouteTiming {
    /// `--refresh-metrics-interval`, wall time.
    pub scrape_interval: Duration,
    /// `--max-metrics-age`, wall time.
    pub max_metrics_age: Duration,
    /// `--max-queue-wait`, wall time: kvroute's default (15 s) of simulated time, since a
    /// request waits for the simulated pods.
    pub max_queue_wait: Duration,
    /// `--standing-queue-after` and `--standing-queue-wait`, wall time: kvroute's defaults
    /// of simulated time, for the same reason.
    pub standing: StandingQueue,
}

impl KvrouteTiming {
    pub fn for_speedup(speedup: f64) -> Self {
        let scrape_interval = Duration::from_secs_f64(0.05 / speedup).max(MIN_WALL_SCRAPE_INTERVAL);
        KvrouteTiming {
            scrape_interval,
            max_metrics_age: Duration::from_secs_f64(1.0 / speedup).max(scrape_interval * 10),
            max_queue_wait: Duration::from_secs_f64(15.0 / speedup),
            standing: StandingQueue {
                after: DEFAULT_STANDING.after.div_f64(speedup),
                wait: DEFAULT_STANDING.wait.div_f64(speedup),
            },
        }
    }
}

/// `kvroute serve --objective-priority`'s value for a workload's objectives
/// (`NAME=INT,NAME=INT`, in name order); None without objectives.
pub fn objective_priority_arg(objectives: &BTreeMap<String, i32>) -> Option<String> {
    (!objectives.is_empty()).then(|| {
        objectives
            .iter()
            .map(|(name, priority)| format!("{name}={priority}"))
            .collect::<Vec<_>>()
            .join(",")
    })
}

/// How the comparison runs kvroute: `replicas` (1 or 2) `kvroute serve` processes with
/// `timing`, the workload's `objectives` as `--objective-priority`, and the pods' KV events
/// when given.
struct KvrouteLaunch<'a> {
    timing: KvrouteTiming,
    pods: &'a [SocketAddr],
    objectives: &'a BTreeMap<String, i32>,
    tools: &'a Tools,
    kv_events: Option<&'a KvEventTemplates>,
    replicas: usize,
    /// kvroute's own tokenizer (`--tokenizer`), if it tokenizes prompts itself.
    tokenizer: Option<&'a Path>,
}

/// Runs `launch`'s kvroute processes, each in its own process as every other router runs
/// (in the comparison's process it would share a runtime with the simulated fleet and the
/// load generator and queue behind their tasks), then the shipped fail-closed gateway in
/// front of them: with two, Envoy's ext_proc cluster balances streams over both.
async fn start_kvroute(launch: &KvrouteLaunch<'_>) -> anyhow::Result<(Guard, String)> {
    let KvrouteLaunch {
        pods,
        tools,
        replicas,
        ..
    } = *launch;
    // Every replica's three ports are found at once (held, so they differ) and the
    // replicas started together: a replica already running could take a later one's port
    // for an outgoing connection.
    let held: Vec<std::net::TcpListener> = (0..replicas * 3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()?;
    let addrs: Vec<SocketAddr> = held
        .iter()
        .map(std::net::TcpListener::local_addr)
        .collect::<Result<_, _>>()?;
    drop(held);
    let mut started = Vec::with_capacity(replicas);
    for (replica, ports) in addrs.chunks_exact(3).enumerate() {
        let log_name = if replica == 0 {
            "kvroute.log".to_string()
        } else {
            format!("kvroute-{}.log", replica + 1)
        };
        let child = spawn_kvroute(launch, ports, &log_name)?;
        started.push((child, ports, log_name));
    }
    let mut kvroutes = Vec::with_capacity(replicas);
    let mut grpcs = Vec::with_capacity(replicas);
    let mut metrics = Vec::with_capacity(replicas);
    for (child, ports, log_name) in started {
        wait_scraped(ports[2], pods.len(), Duration::from_secs(20))
            .await
            .with_context(|| {
                let log = tools.log_dir.join(&log_name);
                format!("kvroute did not scrape every pod; see {}", log.display())
            })?;
        kvroutes.push(child);
        grpcs.push(ports[0]);
        metrics.push(ports[1]);
    }
    let gateway = match (&grpcs[..], tools.observe_responses) {
        (&[kvroute], false) => Gateway::OriginalDst { kvroute },
        (&[kvroute], true) => Gateway::OriginalDstObserved { kvroute },
        (&[first, second], observed) => Gateway::OriginalDstReplicas {
            kvroutes: [first, second],
            observed,
        },
        _ => anyhow::bail!("the gateway takes one or two kvroute replicas, not {replicas}"),
    };
    let envoy = EnvoyProcess::start(gateway, pods, &tools.envoy, "error").await?;
    let url = envoy.url("");
    Ok((
        Guard::Kvroute {
            envoy,
            kvroutes,
            metrics,
        },
        url,
    ))
}

/// Starts one of `launch`'s `kvroute serve` processes (told how many there are), listening
/// on `ports` (ext_proc, metrics, debug), logging to `log_name` in the log directory.
fn spawn_kvroute(
    launch: &KvrouteLaunch<'_>,
    ports: &[SocketAddr],
    log_name: &str,
) -> anyhow::Result<ChildGuard> {
    let KvrouteLaunch {
        timing,
        pods,
        objectives,
        tools,
        kv_events,
        replicas,
        tokenizer,
    } = *launch;
    let exe = &tools.kvroute;
    let [grpc, metrics, debug] = ports else {
        anyhow::bail!("kvroute takes three ports, not {}", ports.len());
    };
    let endpoints: Vec<String> = pods.iter().map(ToString::to_string).collect();
    let log = tools.log_dir.join(log_name);
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let millis = |d: Duration| format!("{}ms", d.as_millis().max(1));
    // Through Python only for its `prctl`, when there is one (scripts/setup provides it).
    let mut cmd = if tools.python.exists() {
        let mut cmd = Command::new(&tools.python);
        cmd.args(["-c", EXEC_WITH_PARENT]).arg(exe);
        cmd
    } else {
        Command::new(exe)
    };
    cmd.args(["serve", "--endpoints", &endpoints.join(",")])
        .args(["--grpc-addr", &grpc.to_string()])
        .args(["--metrics-addr", &metrics.to_string()])
        .args(["--debug-addr", &debug.to_string()])
        .args(["--health-addr", "off", "--admin-addr", "off"])
        .args([
            "--refresh-metrics-interval",
            &millis(timing.scrape_interval),
        ])
        .args(["--max-metrics-age", &millis(timing.max_metrics_age)])
        .args(["--max-queue-wait", &millis(timing.max_queue_wait)])
        .args([
            "--standing-queue-after",
            &millis(timing.standing.after),
            "--standing-queue-wait",
            &millis(timing.standing.wait),
        ])
        .args(["--drain-timeout", "1s"])
        .args(["--replicas", &replicas.to_string()])
        // One `--flag=value` argument: a value cannot be taken for a flag.
        .args(objective_priority_arg(objectives).map(|map| format!("--objective-priority={map}")))
        .args(
            kv_events
                .into_iter()
                .flat_map(KvEventTemplates::kvroute_args),
        )
        .args(
            tokenizer
                .into_iter()
                .map(|dir| format!("--tokenizer={}", dir.display())),
        )
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file);
    Ok(ChildGuard(cmd.spawn().with_context(|| {
        format!("cannot run {} serve", exe.display())
    })?))
}

/// Waits until kvroute's `/debug/endpoints` shows `pods` healthy pods that listed their
/// models.
pub(crate) async fn wait_scraped(
    debug: SocketAddr,
    pods: usize,
    limit: Duration,
) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let url = format!("http://{debug}/debug/endpoints");
    let deadline = Instant::now() + limit;
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        match client.get(&url).send().await {
            Ok(response) => {
                let body: serde_json::Value = response.json().await.unwrap_or_default();
                let ready = body["endpoints"].as_array().map_or(0, |all| {
                    let listed = |p: &serde_json::Value| {
                        p["models"].as_array().is_some_and(|m| !m.is_empty())
                    };
                    all.iter()
                        .filter(|p| p["healthy"] == true && listed(p))
                        .count()
                });
                if ready == pods {
                    return Ok(());
                }
                last = format!("{ready} of {pods} pods ready");
            }
            Err(e) => last = e.to_string(),
        }
        // Polling a child process: there is no event to await across the process boundary.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("after {limit:?}: {last}")
}

/// Python that makes the kernel kill it when its parent dies (`PR_SET_PDEATHSIG`, SIGKILL;
/// kept across `exec`), then becomes the given program: a router started by a comparison
/// that is killed cannot outlive it. Linux only; elsewhere it just runs the program.
const EXEC_WITH_PARENT: &str = "\
import ctypes, os, sys
try:
    ctypes.CDLL(None).prctl(1, 9)
except Exception:
    pass
os.execv(sys.argv[1], sys.argv[1:])
";

fn start_python_router(
    python: &Path,
    module: &str,
    log_level: &str,
    pods: &[SocketAddr],
    log: &Path,
) -> anyhow::Result<(ChildGuard, String)> {
    let (port, prometheus) = (free_port()?, free_port()?);
    let log_file =
        std::fs::File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
    // `python -m module ...`, exec'd by the launcher that ties it to this process.
    let mut cmd = Command::new(python);
    cmd.args(["-c", EXEC_WITH_PARENT])
        .arg(python)
        .args(["-m", module, "--worker-urls"])
        .args(pods.iter().map(|p| format!("http://{p}")))
        .args(["--policy", "cache_aware", "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .args(["--prometheus-port", &prometheus.to_string()])
        .args(["--log-level", log_level])
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    let child = cmd.spawn().with_context(|| {
        format!(
            "cannot run {} -m {module}; run scripts/setup or pass --python",
            python.display()
        )
    })?;
    Ok((ChildGuard(child), format!("http://127.0.0.1:{port}")))
}

/// Polls with a one-token completion until the router answers 200; gives up when `alive`
/// says the router is gone.
pub(crate) async fn wait_answering(
    base: &str,
    model: &str,
    timeout: Duration,
    mut alive: impl FnMut() -> Result<(), String>,
) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()?;
    let body = serde_json::json!({"model": model, "prompt": "ready", "max_tokens": 1});
    let deadline = Instant::now() + timeout;
    loop {
        let last = match client
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => format!("status {}", r.status()),
            Err(e) => e.to_string(),
        };
        alive().map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            Instant::now() < deadline,
            "no successful completion within {timeout:?} (last: {last})"
        );
        // Another process: no event to await, so poll.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvroute_scrapes_every_fifty_simulated_milliseconds_but_not_faster_than_the_floor() {
        let real_time = KvrouteTiming::for_speedup(1.0);
        assert_eq!(real_time.scrape_interval, Duration::from_millis(50));
        assert_eq!(real_time.max_metrics_age, Duration::from_secs(1));
        let sped_up = KvrouteTiming::for_speedup(10.0);
        assert_eq!(sped_up.scrape_interval, MIN_WALL_SCRAPE_INTERVAL);
        assert_eq!(sped_up.max_metrics_age, MIN_WALL_SCRAPE_INTERVAL * 10);
        // Waits are for the simulated pods: simulated time, scaled.
        assert_eq!(sped_up.max_queue_wait, Duration::from_millis(1_500));
        assert_eq!(sped_up.standing.after, Duration::from_millis(500));
        assert_eq!(sped_up.standing.wait, Duration::from_millis(200));
    }

    #[test]
    fn kvroute_gets_the_objectives_as_one_name_equals_priority_list() {
        assert_eq!(objective_priority_arg(&BTreeMap::new()), None);
        let map = BTreeMap::from([
            ("sheddable".to_string(), -10),
            ("critical".to_string(), 100),
        ]);
        assert_eq!(
            objective_priority_arg(&map).as_deref(),
            Some("critical=100,sheddable=-10")
        );
    }

    #[test]
    fn router_names_are_the_flag_values() {
        use clap::ValueEnum;
        for kind in RouterKind::ALL {
            assert_eq!(
                RouterKind::from_str(kind.name(), false).expect("parses"),
                kind
            );
        }
    }
}
