//! `kvroute-lab simulate`: the whole fleet offline, in virtual time.
//!
//! The real routing core (`kvroute_core`: request parsing, prefix index, `scheduler::pick`,
//! the in-flight and LoRA ledgers) against the simulator's engine model
//! (`kvroute_sim::engine`) for every pod, fed the load generator's trace, with no sockets,
//! no processes and no wall-clock waits. Each policy runs the same seeded trace on a fresh
//! fleet; the results are written in `compare`'s report shape (its row, knee and ratio code
//! renders them), plus the simulation's own statistics.
//!
//! What is modelled as the live comparison runs it: kvroute's scrapes every
//! `--scrape-interval` of virtual time, each seen `--scrape-delay` after it started (the
//! scrape's round trip and the store's publication); the shipped fail-closed gateway (a
//! request counts against its pod until its response ends; queued prefill until the next
//! scrape); Envoy's round robin and least request (two random choices); `bench`'s warm-up,
//! its ladder (each step starting when the previous one's last response ended), its 300 s
//! timeout and its cap on requests in flight. What is not: anything outside the pods (no
//! network, no proxy, no router CPU time: `path` is empty), the peer routers (sglang,
//! vllm-router), and the bursty token delivery of a sped-up simulator (ITL here is the gap
//! between engine steps).
//!
//! kvroute runs with the gateway's flow control (`src/picker.rs`): a request no pod has
//! the KV for waits at the gateway, at most `--max-queue-wait` of virtual time (the lab gives
//! the live kvroute 15 s simulated), and leaves by priority, tenants in turn; sheddable
//! requests are refused. Requests carry their class's objective (a priority through the
//! workload's `objectives`) and tenant, and the report has `compare`'s per-class,
//! per-objective and per-tenant statistics and target checks.
//!
//! Layout: `trace` draws the requests (the load generator's draws, lazily), `observe` is
//! what a scrape of a simulated pod reads, `policy` the routers, `flow` kvroute's waiting
//! room and requests' classes, `run` the event loop, `stats` the per-step accumulators
//! behind `compare`'s report types, `diagnose` the optional decision and per-pod traces
//! (`--diagnose N`), `pods` the engines and the helper thread that shares their work,
//! `ready` and `records` what else the helper does (requests made ready ahead, kvroute's
//! prefix records).

mod cache_aware;
mod diagnose;
mod flow;
mod observe;
mod pods;
mod policy;
mod ready;
mod records;
mod run;
mod stats;
pub mod trace;

pub use run::simulate;
pub use trace::Scale;

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::compare::repeats::{Seeds, parse_seeds};
use crate::compare::report::{RouterRun, WorkloadResult};
use crate::compare::{RouterKind, machine, spread_positions};
use crate::loadgen::Workload;
use kvroute_core::flow::StandingQueue;

/// A policy the simulation can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Router {
    /// kvroute's scheduler, prefix index and ledgers (`kvroute_core`).
    Kvroute,
    /// kvroute matching prompts on the engines' KV events (`--prefix-source auto`).
    KvrouteEvents,
    /// Two kvroute replicas (as `--replicas 2`, whatever `--replicas` says; opt-in).
    #[value(name = "kvroute-x2")]
    KvrouteX2,
    /// Two kvroute replicas on the engines' KV events (opt-in).
    #[value(name = "kvroute-events-x2")]
    KvrouteEventsX2,
    /// Envoy `ROUND_ROBIN`.
    RoundRobin,
    /// Envoy `LEAST_REQUEST` (two random choices, fewer active requests).
    LeastRequest,
    /// A model of sglang-router's and vllm-router's `cache_aware` policy (opt-in).
    CacheAware,
}

impl Router {
    /// Whether the engines publish KV events and kvroute follows them.
    pub fn follows_kv_events(self) -> bool {
        matches!(self, Router::KvrouteEvents | Router::KvrouteEventsX2)
    }

    /// The kvroute replicas of this policy in `setup` (`--replicas`, or 2 for the `-x2`
    /// policies).
    pub fn replicas(self, setup: &Setup<'_>) -> usize {
        match self {
            Router::KvrouteX2 | Router::KvrouteEventsX2 => 2,
            _ => setup.replicas.max(1),
        }
    }

    /// The policies a simulation runs unless told otherwise, in report order.
    pub const ALL: [Router; 4] = [
        Router::Kvroute,
        Router::KvrouteEvents,
        Router::RoundRobin,
        Router::LeastRequest,
    ];

    /// The comparison's name for it (reports, file names).
    pub fn kind(self) -> RouterKind {
        match self {
            Router::Kvroute => RouterKind::Kvroute,
            Router::KvrouteEvents => RouterKind::KvrouteEvents,
            Router::KvrouteX2 => RouterKind::KvrouteReplicas,
            Router::KvrouteEventsX2 => RouterKind::KvrouteEventsReplicas,
            Router::RoundRobin => RouterKind::RoundRobin,
            Router::LeastRequest => RouterKind::LeastRequest,
            Router::CacheAware => RouterKind::CacheAware,
        }
    }

    fn description(self) -> &'static str {
        match self {
            Router::Kvroute => {
                "kvroute_core's prefix index, `scheduler::pick` (default configuration) and in-flight ledgers, as `LivePicker` runs them behind the fail-closed gateway, with its flow control (requests no pod has the KV for held at most --max-queue-wait, by priority and tenants in turn; sheddable ones refused); metrics from scrapes every --scrape-interval, seen --scrape-delay late"
            }
            Router::KvrouteEvents => {
                "kvroute as above with `--prefix-source auto`: each engine publishes its KV cache events after every step, applied at once to kvroute's event index, and each prompt's engine tokens are matched there"
            }
            Router::KvrouteX2 => {
                "two replicas of kvroute as above behind the one gateway (requests to them in turn), each told `--replicas 2`: each scrapes every pod but sees in flight, and remembers as sent, only its own requests"
            }
            Router::KvrouteEventsX2 => {
                "two replicas of kvroute on KV events as above behind the one gateway (requests to them in turn), each told `--replicas 2` and following every engine's events"
            }
            Router::RoundRobin => "Envoy `ROUND_ROBIN` (each pod in turn)",
            Router::LeastRequest => {
                "Envoy `LEAST_REQUEST` (two pods drawn at random, the one with fewer active requests)"
            }
            Router::CacheAware => {
                "a model of the `cache_aware` policy of sglang-router and vllm-router at their defaults (not the routers themselves): the least loaded pod when max − min requests in flight > 64 and max > 1.5 × min, else the pod whose tree holds the longest prefix of the prompt when it is more than 0.3 of it, else the pod with the smallest tree (trees of 16-token blocks per model, nothing evicted)"
            }
        }
    }
}

/// Flags of `kvroute-lab simulate`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// Workload files, comma-separated [default: every crates/lab/workloads/*.yaml].
    #[arg(long, env = "KVROUTE_SIMULATE_WORKLOADS", value_delimiter = ',')]
    pub workloads: Vec<PathBuf>,
    /// Simulated pods [default: each workload's own fleet]. Scaling keeps every pod's load:
    /// with k = pods / the workload's pods, rates (and the cap on requests in flight, and
    /// the warm-up) are multiplied by k, and the workload's tenants are copied round(k)
    /// times: each request goes to a copy drawn uniformly, with the copy's own adapters
    /// (`lora-3-c7`) and shared system prompts (rewritten so that copies share no prefix).
    /// The classes' flow-control tenants and objectives are not copied: each keeps its
    /// share of the traffic.
    #[arg(long, env = "KVROUTE_SIMULATE_PODS")]
    pub pods: Option<usize>,
    /// Requests over the whole ladder, split evenly between its steps; each step then
    /// lasts until its share has arrived (instead of the workload's step duration).
    #[arg(long, env = "KVROUTE_SIMULATE_REQUESTS", conflicts_with = "duration")]
    pub requests: Option<usize>,
    /// Arrivals of one ladder step last this long, virtual time [default: the workload's].
    #[arg(long, env = "KVROUTE_SIMULATE_DURATION", value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// Replace each workload's ladder (requests per second for the workload's own fleet,
    /// scaled with --pods), comma-separated.
    #[arg(long, env = "KVROUTE_SIMULATE_RATES", value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// As `compare --quick`: at most 3 rates of each ladder, steps of at most 10 s.
    #[arg(long, env = "KVROUTE_SIMULATE_QUICK")]
    pub quick: bool,
    /// Policies to run, comma-separated [default: all].
    #[arg(
        long,
        env = "KVROUTE_SIMULATE_ROUTERS",
        value_delimiter = ',',
        value_enum
    )]
    pub routers: Vec<Router>,
    /// kvroute's scrape period, virtual time.
    #[arg(long, env = "KVROUTE_SIMULATE_SCRAPE_INTERVAL", default_value = "50ms", value_parser = humantime::parse_duration)]
    pub scrape_interval: Duration,
    /// How long after a scrape starts kvroute routes with what it read, virtual time.
    #[arg(long, env = "KVROUTE_SIMULATE_SCRAPE_DELAY", default_value = "50ms", value_parser = humantime::parse_duration)]
    pub scrape_delay: Duration,
    /// kvroute's `--max-queue-wait`, virtual time: the longest a request no pod has the KV
    /// for waits at the gateway before it is shed (429 `rejected-ttl-expired`); 0 switches
    /// the queue off (a request no pod has the KV for goes to the least bad pod; sheddable
    /// requests are still refused). The default is what `compare` gives the live kvroute.
    #[arg(long, env = "KVROUTE_SIMULATE_MAX_QUEUE_WAIT", default_value = "15s", value_parser = humantime::parse_duration)]
    pub max_queue_wait: Duration,
    /// kvroute's `--standing-queue-wait`, virtual time: while the queue has not emptied
    /// for `--standing-queue-after`, a request that has waited this long is shed (0: off).
    #[arg(long, env = "KVROUTE_SIMULATE_STANDING_QUEUE_WAIT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub standing_queue_wait: Duration,
    /// kvroute's `--standing-queue-after`, virtual time.
    #[arg(long, env = "KVROUTE_SIMULATE_STANDING_QUEUE_AFTER", default_value = "5s", value_parser = humantime::parse_duration)]
    pub standing_queue_after: Duration,
    /// Seed of the trace, the engines and the policies [default: the workload's].
    #[arg(long, env = "KVROUTE_SIMULATE_SEED", conflicts_with = "seeds")]
    pub seed: Option<u64>,
    /// Run everything once per seed (`1-32`, `3,5,9`, or both: `1-4,9`), each seed's report
    /// in OUTPUT_DIR/seed-N, and write seeds.md: every router's p90 TTFT at each rate, its
    /// mean, median and range over the seeds, the ratio of its mean to the first router's
    /// and the median of the per-seed ratios, and the mean hit rate, shed and preemptions.
    /// Near a knee one seed's p90 says little; the docs' offline claims are over 32 seeds.
    #[arg(long, env = "KVROUTE_SIMULATE_SEEDS", value_parser = parse_seeds)]
    pub seeds: Option<Seeds>,
    /// Simulations run at once, one thread each [default: the machine's cores].
    #[arg(long, env = "KVROUTE_SIMULATE_JOBS")]
    pub jobs: Option<usize>,
    /// Skip the warm-up `compare` runs before each ladder.
    #[arg(long, env = "KVROUTE_SIMULATE_NO_WARMUP")]
    pub no_warmup: bool,
    /// Diagnostics: write every N-th kvroute decision (relaxed filters, the best
    /// candidates' score breakdowns) to `<workload>-kvroute-decisions.jsonl`, each pod's
    /// queue, running requests, KV use, requests in flight and requests routed at every
    /// fleet sample to `<workload>-<policy>-pods.csv`, and every N-th completed request's
    /// arrival, pod, replica, waits and cached tokens to `<workload>-<policy>-requests.csv`
    /// in the output directory.
    #[arg(long, env = "KVROUTE_SIMULATE_DIAGNOSE", value_name = "N")]
    pub diagnose: Option<u64>,
    /// kvroute replicas behind the one gateway (requests go to them in turn; each scrapes
    /// and follows every pod but sees only its own requests in flight and sent, and is told
    /// the replica count as `kvroute serve --replicas`).
    #[arg(long, env = "KVROUTE_SIMULATE_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub replicas: u16,
    /// Where report.md, the plots and the JSON go.
    #[arg(
        long,
        env = "KVROUTE_SIMULATE_OUTPUT_DIR",
        default_value = "simulate-results"
    )]
    pub output_dir: PathBuf,
}

/// `bench`'s defaults that `compare` keeps, per the workload's own fleet.
const MAX_CONCURRENCY: f64 = 1024.0;
const TIMEOUT: Duration = Duration::from_secs(300);
/// `compare`'s sampler period, wall time (× the workload's speedup in virtual time).
const SAMPLE_PERIOD: Duration = Duration::from_millis(250);
const QUICK_RATES: usize = 3;
const QUICK_STEP: Duration = Duration::from_secs(10);

/// `compare`'s warm-up before a ladder: a few requests at the lowest rate, another seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Warmup {
    pub requests: usize,
    pub duration: Duration,
}

/// One workload, scaled to a fleet, ready to simulate under any policy.
#[derive(Debug, Clone)]
pub struct Setup<'w> {
    /// The workload as run: with `--rates` as its ladder and the steps `--quick` keeps.
    pub workload: Cow<'w, Workload>,
    pub file: PathBuf,
    pub pods: usize,
    pub scale: Scale,
    /// The ladder, per the workload's own fleet (scaled by `scale.rate` when run).
    pub rates: Vec<f64>,
    /// Arrivals per step (None: until `requests_per_step`).
    pub step_duration: Option<Duration>,
    pub requests_per_step: Option<usize>,
    pub seed: u64,
    pub scrape_interval: Duration,
    pub scrape_delay: Duration,
    /// kvroute's longest wait at the gateway (zero: no queue).
    pub max_queue_wait: Duration,
    /// kvroute's bound on waits while its queue stands (`None`: off).
    pub standing: Option<StandingQueue>,
    pub sample_period: Duration,
    pub max_concurrency: usize,
    pub timeout: Duration,
    pub warmup: Option<Warmup>,
    /// `--diagnose`: keep every N-th decision, write the files into this directory.
    pub diagnose: Option<(u64, PathBuf)>,
    /// kvroute replicas (`--replicas`).
    pub replicas: usize,
    /// Threads one simulation may use to advance its pods at a scrape (the cores left to
    /// it by the simulations running beside it); the results do not depend on it.
    pub threads: usize,
    /// kvroute scores every pick in full and declines it afterwards, casting no shadows
    /// (as before `scheduler::pick_unless`): for the test that shows declining early
    /// changes no result. Off.
    pub whole_picks: bool,
}

impl<'w> Setup<'w> {
    /// The setup `args` describe for `workload`.
    pub fn new(args: &SimulateArgs, workload: &'w Workload, file: &Path) -> anyhow::Result<Self> {
        let pods = args.pods.unwrap_or(workload.fleet.pods);
        anyhow::ensure!(pods > 0, "--pods must be at least 1");
        anyhow::ensure!(
            !args.scrape_interval.is_zero(),
            "--scrape-interval must be above zero"
        );
        let scale = Scale::for_pods(workload, pods);
        let mut workload = Cow::Borrowed(workload);
        if !args.rates.is_empty() {
            let mut w = workload.into_owned();
            w.rates.clone_from(&args.rates);
            // Refuses rates ≤ 0, and a ladder of another length than class weights per step.
            w.validate()?;
            workload = Cow::Owned(w);
        }
        let mut step = args.duration.unwrap_or(workload.step_duration);
        if args.quick {
            let keep = spread_positions(workload.rates.len(), QUICK_RATES);
            workload = Cow::Owned(workload.select_steps(&keep));
            step = step.min(QUICK_STEP);
        }
        let rates = workload.rates.clone();
        anyhow::ensure!(!step.is_zero(), "--duration must be above zero");
        let (step_duration, requests_per_step) = match args.requests {
            Some(n) => {
                anyhow::ensure!(n > 0, "--requests must be at least 1");
                (None, Some(n.div_ceil(rates.len())))
            }
            None => (Some(step), None),
        };
        let warmup = (!args.no_warmup).then(|| Warmup {
            requests: ((if args.quick { 8.0 } else { 16.0 }) * scale.rate).ceil() as usize,
            duration: Duration::from_secs(if args.quick { 3 } else { 5 }),
        });
        let seed = args.seed.unwrap_or(workload.seed);
        let sample_period = SAMPLE_PERIOD.mul_f64(workload.fleet.speedup.max(1.0));
        Ok(Setup {
            workload,
            file: file.to_path_buf(),
            pods,
            scale,
            rates,
            step_duration,
            requests_per_step,
            seed,
            scrape_interval: args.scrape_interval,
            scrape_delay: args.scrape_delay,
            max_queue_wait: args.max_queue_wait,
            standing: StandingQueue::from_flags(
                args.standing_queue_after,
                args.standing_queue_wait,
            ),
            sample_period,
            max_concurrency: (MAX_CONCURRENCY * scale.rate).ceil().max(1.0) as usize,
            timeout: TIMEOUT,
            warmup,
            diagnose: args.diagnose.map(|n| (n, args.output_dir.clone())),
            replicas: usize::from(args.replicas),
            threads: 1,
            whole_picks: false,
        })
    }
}

/// What a simulation cost and covered, beside its measurements.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SimStats {
    pub workload: String,
    pub router: Option<RouterKind>,
    pub pods: usize,
    /// Arrivals, warm-up included.
    pub requests: u64,
    /// Output tokens the engines generated (token events).
    pub tokens: u64,
    /// Engine steps and adapter loads processed (a pod's due event).
    pub engine_wakeups: u64,
    /// Scrapes of the whole fleet.
    pub scrapes: u64,
    /// Arrivals + engine wake-ups + scrapes.
    pub events: u64,
    /// Virtual seconds simulated.
    pub virtual_s: f64,
    /// Wall seconds it took.
    pub wall_s: f64,
    /// Wall seconds inside the policy's routing (kvroute: hashing, matching, pick, reserve).
    pub route_wall_s: f64,
    /// Requests not ended when the ladder finished (always 0).
    pub open_at_end: usize,
    /// What kvroute's ledgers still held at the end (requests and tokens; always 0).
    pub held_at_end: u64,
    /// kvroute's decisions, and those that relaxed each soft filter (nothing passed it).
    pub decisions: u64,
    pub relaxed_saturation: u64,
    pub relaxed_kv_headroom: u64,
    /// Requests kvroute held at the gateway, and those it shed (at once or after a wait).
    pub held: u64,
    pub shed: u64,
}

impl SimStats {
    /// Events per wall second.
    pub fn events_per_s(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.events as f64 / self.wall_s
        } else {
            0.0
        }
    }
}

type JobResult = anyhow::Result<(RouterRun, SimStats)>;

/// Runs every (setup, router) job on `jobs` threads; results in job order.
fn run_jobs(setups: &[Setup<'_>], routers: &[Router], jobs: usize) -> Vec<JobResult> {
    let list: Vec<(usize, Router)> = (0..setups.len())
        .flat_map(|s| routers.iter().map(move |&r| (s, r)))
        .collect();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<JobResult>>> =
        Mutex::new((0..list.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.clamp(1, list.len().max(1)) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(s, router)) = list.get(i) else {
                        break;
                    };
                    let setup = &setups[s];
                    let result = simulate(setup, router).map(|(run, mut stats)| {
                        stats.workload = setup.workload.name.clone();
                        (run, stats)
                    });
                    match &result {
                        Ok((_, st)) => eprintln!(
                            "  {} / {} ({} pods): {} requests, {:.0} s virtual in {:.1} s wall ({:.2} M events/s)",
                            setup.workload.name,
                            router.kind().name(),
                            setup.pods,
                            st.requests,
                            st.virtual_s,
                            st.wall_s,
                            st.events_per_s() / 1e6
                        ),
                        Err(e) => eprintln!(
                            "  {} / {} failed: {e:#}",
                            setup.workload.name,
                            router.kind().name()
                        ),
                    }
                    let mut all = results.lock().unwrap_or_else(|p| p.into_inner());
                    all[i] = Some(result);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(anyhow::anyhow!("the simulation thread failed"))))
        .collect()
}

/// `kvroute-lab simulate`: simulates every policy on every workload (once per seed of
/// `--seeds`), writes the report (each seed's, and seeds.md over them).
pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    let workloads = crate::compare::load_workloads(&args.workloads)?;
    let routers = crate::compare::chosen(&args.routers, &Router::ALL);
    // Each seed's setups and output directory; without --seeds, the one run as asked.
    let runs: Vec<(Option<u64>, PathBuf)> = match &args.seeds {
        Some(Seeds(seeds)) => seeds
            .iter()
            .map(|&seed| (Some(seed), args.output_dir.join(format!("seed-{seed}"))))
            .collect(),
        None => vec![(args.seed, args.output_dir.clone())],
    };
    anyhow::ensure!(!runs.is_empty(), "--seeds names no seed");
    let mut setups: Vec<Setup<'_>> = Vec::new();
    for (seed, out) in &runs {
        for (f, w) in &workloads {
            let mut setup =
                Setup::new(&args, w, f).with_context(|| format!("workload {}", w.name))?;
            if let Some(seed) = seed {
                setup.seed = *seed;
            }
            setup.diagnose = args.diagnose.map(|n| (n, out.clone()));
            setups.push(setup);
        }
    }
    for (_, out) in &runs {
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let jobs = args.jobs.unwrap_or(cores);
    // The cores no simulation runs on are shared among those that do.
    let running = jobs.clamp(1, (setups.len() * routers.len()).max(1));
    for setup in &mut setups {
        setup.threads = (cores / running).max(1);
    }
    let names: Vec<&str> = routers.iter().map(|r| r.kind().name()).collect();
    eprintln!(
        "kvroute-lab simulate: {} workload(s) × {}{}, {} at a time; results in {}",
        workloads.len(),
        names.join(", "),
        match runs.len() {
            1 => String::new(),
            n => format!(" × {n} seeds"),
        },
        jobs,
        args.output_dir.display()
    );
    let wall = Instant::now();
    let mut results = run_jobs(&setups, &routers, jobs).into_iter();
    let took = wall.elapsed();
    let mut per_seed = Vec::new();
    for ((_, out), setups) in runs.iter().zip(setups.chunks(workloads.len().max(1))) {
        let (workload_results, plots) =
            write_run(&args, &routers, setups, &mut results, out, took, jobs)?;
        if args.seeds.is_none() {
            // The terminal gets compare's headline and compact tables; report.md has everything.
            print!(
                "{}",
                crate::compare::summary::terminal(&workload_results, &plots, out)
            );
        }
        per_seed.push(workload_results);
    }
    let report = if let Some(Seeds(seeds)) = &args.seeds {
        let md = crate::compare::repeats::seeds_markdown("simulate", seeds, &per_seed);
        let path = args.output_dir.join("seeds.md");
        std::fs::write(&path, &md).with_context(|| format!("cannot write {}", path.display()))?;
        print!("{md}");
        path
    } else {
        args.output_dir.join("report.md")
    };
    eprintln!(
        "kvroute-lab simulate: {:.1} s; report {}",
        took.as_secs_f64(),
        report.display()
    );
    Ok(())
}

/// Takes the results of `setups` (one run's workloads) from `results`, in job order, and
/// writes that run's per-router JSON, report.md, plots and simulation.json into `out`.
#[allow(clippy::too_many_arguments)]
fn write_run(
    args: &SimulateArgs,
    routers: &[Router],
    setups: &[Setup<'_>],
    results: &mut impl Iterator<Item = JobResult>,
    out: &Path,
    took: Duration,
    jobs: usize,
) -> anyhow::Result<(Vec<WorkloadResult>, Vec<Vec<String>>)> {
    let mut workload_results = Vec::new();
    let mut sim_stats = Vec::new();
    for setup in setups {
        let mut result = WorkloadResult {
            workload: setup.workload.name.clone(),
            file: setup.file.clone(),
            pods: setup.pods,
            speedup: 1.0,
            rates: setup.rates.iter().map(|r| r * setup.scale.rate).collect(),
            // With --requests, the planned length of the first step's arrivals.
            step_duration_s: setup.step_duration.map_or_else(
                || {
                    let first = setup.rates.first().copied().unwrap_or(1.0) * setup.scale.rate;
                    setup.requests_per_step.unwrap_or(0) as f64 / first
                },
                |d| d.as_secs_f64(),
            ),
            objectives: setup.workload.objectives.clone().unwrap_or_default(),
            capacity: setup.workload.capacity.map(|c| c * setup.scale.rate),
            runs: Vec::new(),
            failures: Vec::new(),
        };
        for &router in routers {
            match results.next() {
                Some(Ok((run, stats))) => {
                    let path = out.join(format!(
                        "{}-{}.json",
                        setup.workload.name,
                        router.kind().name()
                    ));
                    std::fs::write(&path, serde_json::to_string_pretty(&run)? + "\n")
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    result.runs.push(run);
                    sim_stats.push(stats);
                }
                Some(Err(e)) => result.failures.push((router.kind(), format!("{e:#}"))),
                None => {}
            }
        }
        workload_results.push(result);
    }
    let plots = write_report(
        args,
        routers,
        setups,
        &workload_results,
        &sim_stats,
        out,
        took,
        jobs,
    )?;
    Ok((workload_results, plots))
}

/// Column meanings for a simulated report.
const LEGEND: &str = "\
Columns as in `kvroute-lab compare`, in virtual (simulated) seconds: `req/s`, `tok/s`:
successful requests and output tokens per second; `TTFT`: time to first token, from the
request's arrival at the gateway: a wait in kvroute's queue, then the pod's own TTFT, `pod
TTFT` (the simulation has no network, proxy or router CPU time, so `TTFT` and `client TTFT`
are the same and `path` is empty); ITL: gaps between a request's tokens, i.e. the engine's
step times (percentiles to 0.5 %); e2e: successful requests only, from the arrival at the
gateway; `errors`: failed / planned; `shed`: requests kvroute's flow control refused or
dropped (neither successes nor errors); `preemptions`, `LoRA loads` (GPU slot loads, disk +
host): the engines' counters at the step's boundaries, exactly; `prefix hit rate`:
prefix-cache hit tokens / queried tokens; `KV spread`: mean over samples (every 250 ms × the
workload's speedup, as `compare` samples) of (max − min) KV-cache use across pods. In the
simulation table, `held`: requests kvroute held at the gateway (routed later or shed),
`shed`: as above, over the warm-up and the ladder.
";

#[allow(clippy::too_many_arguments)]
fn write_report(
    args: &SimulateArgs,
    routers: &[Router],
    setups: &[Setup<'_>],
    results: &[WorkloadResult],
    stats: &[SimStats],
    out: &Path,
    took: Duration,
    jobs: usize,
) -> anyhow::Result<Vec<Vec<String>>> {
    use std::fmt::Write as _;
    let mut md = String::from("# kvroute simulate\n\n");
    let command: Vec<String> = std::env::args().collect();
    let _ = writeln!(
        md,
        "Command: `{}`. Machine: {}. Took {:.1} s of wall time ({jobs} simulation(s) at a time). \
         Virtual time: scrapes every {:?}, seen {:?} late; kvroute holds requests at most {}.\n",
        command.join(" "),
        machine(),
        took.as_secs_f64(),
        args.scrape_interval,
        args.scrape_delay,
        if args.max_queue_wait.is_zero() {
            "0 (its queue is off)".to_string()
        } else {
            format!("{:?}", args.max_queue_wait)
        }
    );
    md.push_str("Policies:\n\n");
    for r in routers {
        let _ = writeln!(md, "- `{}`: {}", r.kind().name(), r.description());
    }
    md.push('\n');
    md.push_str("## Simulation\n\n");
    md.push_str(
        "| workload | policy | pods | scale | requests | held | shed | output tokens | virtual s | wall s | events | events/s | routing µs/request |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in stats {
        let scale = setups
            .iter()
            .find(|x| x.workload.name == s.workload)
            .map_or(1.0, |x| x.scale.rate);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {scale:.2}× | {} | {} | {} | {} | {:.0} | {:.1} | {} | {:.2} M | {:.2} |",
            s.workload,
            s.router.map_or("-", RouterKind::name),
            s.pods,
            s.requests,
            s.held,
            s.shed,
            s.tokens,
            s.virtual_s,
            s.wall_s,
            s.events,
            s.events_per_s() / 1e6,
            if s.requests > 0 {
                s.route_wall_s / s.requests as f64 * 1e6
            } else {
                0.0
            }
        );
    }
    md.push('\n');
    md.push_str(LEGEND);
    md.push('\n');
    let plots = crate::compare::write_results(&mut md, results, out)?;
    let path = out.join("simulation.json");
    std::fs::write(&path, serde_json::to_string_pretty(stats)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(plots)
}
