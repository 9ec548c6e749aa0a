//! `kvroute-lab compare`: every router in front of the same simulated fleet, side by side.
//!
//! For each workload file and each selected router (`routers`): start a fresh fleet from the
//! workload's `fleet` section (same seed and settings for every router), start the router and
//! wait until it answers, warm up briefly, run the workload's ladder with `loadgen::bench`
//! while sampling the fleet's `/metrics` (`fleet_stats`), stop everything. Then write the raw
//! JSON of every run, `report.md` and the plots (`report`), with the flow-control target
//! checks of workloads that send objectives or tenants (`targets`), and print a short summary
//! on the terminal (`summary`). Both leave out the columns a workload does not move
//! (`columns`).

pub mod columns;
pub mod fleet_stats;
pub mod repeats;
pub mod report;
pub mod routers;
pub mod summary;
pub mod targets;

pub use routers::{KvEventTemplates, RouterKind, port_shift_template, with_kv_events};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use self::fleet_stats::{Sampler, window};
use self::report::{RouterRun, WorkloadResult};
use self::routers::Tools;
use crate::envoy::envoy_binary;
use crate::loadgen::{BenchArgs, Plan, Workload, WorkloadError, bench};
use kvroute_sim::SimFleet;

/// Flags of `kvroute-lab compare`.
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// Workload files, comma-separated [default: every crates/lab/workloads/*.yaml].
    #[arg(long, env = "KVROUTE_COMPARE_WORKLOADS", value_delimiter = ',')]
    pub workloads: Vec<PathBuf>,
    /// Routers to compare, comma-separated [default: kvroute, round-robin, least-request,
    /// sglang, vllm-router; kvroute-events, kvroute-x2 and kvroute-events-x2 when named].
    #[arg(
        long,
        env = "KVROUTE_COMPARE_ROUTERS",
        value_delimiter = ',',
        value_enum
    )]
    pub routers: Vec<RouterKind>,
    /// Fewer and shorter steps: at most 3 rates of each ladder (the lowest, the highest and
    /// one between), steps of at most 10 s; every workload and router within 3 minutes.
    #[arg(long, env = "KVROUTE_COMPARE_QUICK")]
    pub quick: bool,
    /// Replace each workload's ladder (requests per simulated second, comma-separated).
    #[arg(long, env = "KVROUTE_COMPARE_RATES", value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// Replace each workload's step duration (simulated time).
    #[arg(long, env = "KVROUTE_COMPARE_STEP_DURATION", value_parser = humantime::parse_duration)]
    pub step_duration: Option<Duration>,
    /// Where report.md, the plots and the raw JSON go.
    #[arg(
        long,
        env = "KVROUTE_COMPARE_OUTPUT_DIR",
        default_value = "bench-results"
    )]
    pub output_dir: PathBuf,
    /// Envoy binary [default: $ENVOY_BIN, ./.venv/bin/envoy, envoy on PATH].
    #[arg(long, env = "KVROUTE_COMPARE_ENVOY")]
    pub envoy: Option<PathBuf>,
    /// The gateway binary measured as `kvroute` [default: `kvroute` beside this program].
    #[arg(long, env = "KVROUTE_BIN")]
    pub kvroute: Option<PathBuf>,
    /// kvroute's scrape period, wall time [default: 50 ms of simulated time, i.e. 50 ms / the
    /// workload's speedup, but never below 20 ms of wall time]; for measuring what the
    /// scraping costs on a small machine.
    #[arg(long, env = "KVROUTE_COMPARE_KVROUTE_SCRAPE_INTERVAL", value_parser = humantime::parse_duration)]
    pub kvroute_scrape_interval: Option<Duration>,
    /// Python with sglang-router and vllm-router installed [default: ./.venv/bin/python].
    #[arg(long, env = "KVROUTE_COMPARE_PYTHON")]
    pub python: Option<PathBuf>,
    /// Run kvroute's gateways with their response observer on (envoy/, commented out by
    /// default): each request's predicted cached tokens are checked against its response,
    /// and the report counts the outcomes per router. Costs a gRPC message per response
    /// chunk, which the latencies then include.
    #[arg(long, env = "KVROUTE_COMPARE_OBSERVE_RESPONSES")]
    pub observe_responses: bool,
    /// Run the whole comparison this many times, each into OUTPUT_DIR/repeat-K, and write
    /// repeats.md: every router's p90 TTFT at each rate over the repeats, its median and
    /// range, and each repeat's ratio to the first router named. Near a knee one run's p90
    /// jumps between a low and a several times higher value for any router, so one run
    /// cannot tell two routers within 10 % apart.
    #[arg(long, env = "KVROUTE_COMPARE_REPEAT", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// Run the whole comparison once per seed (`1-8`, `3,5,9`), each workload's trace and
    /// fleet drawn from that seed instead of its own, each into OUTPUT_DIR/seed-N, and
    /// write seeds.md as `--repeat` writes repeats.md: what `simulate --seeds` gives
    /// offline, so that the two compare like with like.
    #[arg(long, env = "KVROUTE_COMPARE_SEEDS", value_parser = repeats::parse_seeds, conflicts_with = "repeat")]
    pub seeds: Option<repeats::Seeds>,
    /// Every pod tokenizes with this model directory (`tokenizer.json`, chat template), as
    /// vLLM does, instead of the simulator's synthetic tokenizer, for every router;
    /// `kvroute-events-local` tokenizes with it too (e.g. crates/lab/tokenizers/bpe-4k).
    #[arg(long, env = "KVROUTE_COMPARE_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
}

/// Wall period of the fleet sampler.
const SAMPLE_PERIOD: Duration = Duration::from_millis(250);
/// Most rates a `--quick` ladder keeps.
const QUICK_RATES: usize = 3;
/// Longest step of a `--quick` ladder, simulated time.
const QUICK_STEP: Duration = Duration::from_secs(10);

/// Up to `n` rates of `rates`, spread evenly, first and last kept.
pub fn spread_rates(rates: &[f64], n: usize) -> Vec<f64> {
    spread_positions(rates.len(), n)
        .into_iter()
        .map(|i| rates[i])
        .collect()
}

/// Up to `n` positions of a ladder of `len` steps, spread evenly, first and last kept.
pub fn spread_positions(len: usize, n: usize) -> Vec<usize> {
    if len <= n {
        return (0..len).collect();
    }
    if n < 2 {
        return (0..n).collect();
    }
    let last = len - 1;
    let mut picked: Vec<usize> = (0..n)
        .map(|i| (i as f64 * last as f64 / (n - 1) as f64).round() as usize)
        .collect();
    picked.dedup();
    picked
}

/// The workload as it runs under these flags (`--rates` as its ladder, `--quick` keeping
/// some steps, each with its own class weights) and its step length.
pub(crate) fn ladder(
    args: &CompareArgs,
    w: &Workload,
) -> Result<(Workload, Duration), WorkloadError> {
    let mut w = w.clone();
    if !args.rates.is_empty() {
        w.rates.clone_from(&args.rates);
        // Refuses rates ≤ 0, and a ladder of another length than class weights per step.
        w.validate()?;
    }
    let mut step = args.step_duration.unwrap_or(w.step_duration);
    if args.quick {
        w = w.select_steps(&spread_positions(w.rates.len(), QUICK_RATES));
        step = step.min(QUICK_STEP);
    }
    Ok((w, step))
}

fn bench_args(target: &str, file: &Path, speedup: f64) -> BenchArgs {
    BenchArgs {
        target: target.to_string(),
        workload: file.to_path_buf(),
        rate: None,
        rates: Vec::new(),
        step_duration: None,
        requests_per_step: None,
        speedup,
        output: None,
        seed: None,
        max_concurrency: 1024,
        timeout: Duration::from_secs(300),
        model: None,
        raw: false,
    }
}

/// The workloads of the files `given`, else of every `*.yaml` of the lab's workloads/.
pub(crate) fn load_workloads(given: &[PathBuf]) -> anyhow::Result<Vec<(PathBuf, Workload)>> {
    workload_files(given)?
        .into_iter()
        .map(|f| {
            let workload = Workload::from_file(&f)?;
            Ok((f, workload))
        })
        .collect()
}

/// The routers `given`, else `all`, each once, sorted.
pub(crate) fn chosen<T: Ord + Clone>(given: &[T], all: &[T]) -> Vec<T> {
    let mut chosen = if given.is_empty() { all } else { given }.to_vec();
    chosen.sort();
    chosen.dedup();
    chosen
}

/// The workload files: as given, else every `*.yaml` of the lab's workloads/.
fn workload_files(given: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    if !given.is_empty() {
        return Ok(given.to_vec());
    }
    let dir = Path::new(crate::WORKLOADS_DIR);
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {} (pass --workloads)", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    anyhow::ensure!(!files.is_empty(), "no workload files in {}", dir.display());
    Ok(files)
}

/// One router on one workload, on its own fresh fleet; everything is stopped on return.
async fn run_router(
    kind: RouterKind,
    workload: &Workload,
    file: &Path,
    rates: &[f64],
    step: Duration,
    quick: bool,
    tools: &Tools,
) -> anyhow::Result<RouterRun> {
    let wall = Instant::now();
    let mut fleet_config = workload
        .fleet_config()
        .with_context(|| format!("workload {}: fleet", workload.name))?;
    fleet_config.tokenizer = tools.tokenizer.clone();
    let speedup = fleet_config.speedup;
    let (fleet_config, kv_events) = if kind.follows_kv_events() {
        let (config, templates) = routers::with_kv_events(fleet_config)?;
        (config, Some(templates))
    } else {
        (fleet_config, None)
    };
    let fleet = SimFleet::start(fleet_config).await?;
    let pods = fleet.endpoints();
    let outcome = async {
        let router =
            routers::start(kind, &pods, speedup, workload, tools, kv_events.as_ref()).await?;
        let measured = measure(&router.base_url, workload, file, rates, step, quick, &pods).await;
        let counters = router.kvroute_counters().await;
        router.stop().await;
        Ok::<_, anyhow::Error>((measured?, counters?))
    }
    .await;
    fleet.shutdown().await;
    let ((bench, fleet_steps, fleet_total), counters) = outcome?;
    Ok(RouterRun {
        router: kind,
        bench,
        fleet_steps,
        fleet_total,
        wall_s: wall.elapsed().as_secs_f64(),
        replicas_routed: counters.routed,
        prefix_checks: counters.prefix_checks,
        kv_events: counters.kv_events,
    })
}

type Measured = (
    crate::loadgen::report::Report,
    Vec<fleet_stats::WindowStats>,
    fleet_stats::WindowStats,
);

/// Warms up, then runs the ladder while sampling the fleet.
async fn measure(
    base_url: &str,
    workload: &Workload,
    file: &Path,
    rates: &[f64],
    step: Duration,
    quick: bool,
    pods: &[std::net::SocketAddr],
) -> anyhow::Result<Measured> {
    let speedup = workload.fleet.speedup;
    // Warm-up: a few requests at the lowest rate (with that step's class mix) with another
    // seed (so no prompt of the ladder is cached by it); the same for every router.
    let lowest = (0..rates.len())
        .min_by(|&a, &b| rates[a].total_cmp(&rates[b]))
        .unwrap_or(0);
    let mut warm_workload = workload.clone();
    warm_workload.rates = rates.to_vec();
    let warm_workload = warm_workload.select_steps(&[lowest]);
    let mut warm = bench_args(base_url, file, speedup);
    warm.rate = warm_workload.rates.first().copied();
    warm.step_duration = Some(Duration::from_secs(if quick { 3 } else { 5 }));
    warm.requests_per_step = Some(if quick { 8 } else { 16 });
    warm.seed = Some(workload.seed ^ 0x77a1_6d00);
    let mut warm_plan = Plan::new(&warm, warm_workload)?;
    warm_plan.progress = false;
    let warm_report = bench(&warm_plan).await;
    let warm_ok: usize = warm_report.steps.iter().map(|s| s.requests.ok).sum();
    anyhow::ensure!(
        warm_ok > 0,
        "no warm-up request succeeded through the router"
    );

    let mut args = bench_args(base_url, file, speedup);
    args.rates = rates.to_vec();
    args.step_duration = Some(step);
    let plan = Plan::new(&args, workload.clone())?;
    let epoch = Instant::now();
    let sampler = Sampler::start(pods.to_vec(), SAMPLE_PERIOD, epoch);
    let started = epoch.elapsed().as_secs_f64();
    let report = bench(&plan).await;
    let ended = epoch.elapsed().as_secs_f64();
    let samples = sampler.finish().await;
    // Steps run one after the other: cut the samples at the cumulated step lengths.
    let mut at = started;
    let steps = report
        .steps
        .iter()
        .map(|s| {
            let from = at;
            at += s.elapsed_s / speedup;
            window(&samples, from, at.min(ended))
        })
        .collect();
    let total = window(&samples, started, ended);
    Ok((report, steps, total))
}

/// Cores, CPU model and OS of this machine, for reports.
pub(crate) fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cores} cores ({cpu}), {}", std::env::consts::OS)
}

/// `kvroute-lab compare`: runs every router on every workload, writes the report.
pub async fn run(args: CompareArgs) -> anyhow::Result<()> {
    let workloads = load_workloads(&args.workloads)?;
    let kinds = chosen(&args.routers, &RouterKind::ALL);
    for (_, w) in &workloads {
        // Refuse bad overrides before anything starts.
        let (laddered, step) = ladder(&args, w)?;
        let mut check = bench_args("http://127.0.0.1:1", Path::new(""), w.fleet.speedup);
        check.rates.clone_from(&laddered.rates);
        check.step_duration = Some(step);
        Plan::new(&check, laddered).with_context(|| format!("workload {}", w.name))?;
        w.fleet_config()
            .with_context(|| format!("workload {}: fleet", w.name))?;
    }
    let wall = Instant::now();
    if let Some(repeats::Seeds(seeds)) = &args.seeds {
        let mut runs = Vec::new();
        for (k, &seed) in seeds.iter().enumerate() {
            eprintln!(
                "kvroute-lab compare: seed {seed} ({} of {})",
                k + 1,
                seeds.len()
            );
            let seeded: Vec<(PathBuf, Workload)> = workloads
                .iter()
                .map(|(file, w)| (file.clone(), Workload { seed, ..w.clone() }))
                .collect();
            let out = args.output_dir.join(format!("seed-{seed}"));
            runs.push(run_once(&args, &seeded, &kinds, &out).await?);
        }
        let md = repeats::seeds_markdown("compare", seeds, &runs);
        let path = args.output_dir.join("seeds.md");
        write_summary(&path, &md, &format!("{} seeds", seeds.len()), wall)?;
    } else if args.repeat == 1 {
        run_once(&args, &workloads, &kinds, &args.output_dir).await?;
    } else {
        let mut repeats = Vec::new();
        for repeat in 1..=args.repeat {
            eprintln!("kvroute-lab compare: repeat {repeat} of {}", args.repeat);
            let out = args.output_dir.join(format!("repeat-{repeat}"));
            repeats.push(run_once(&args, &workloads, &kinds, &out).await?);
        }
        let path = args.output_dir.join("repeats.md");
        write_summary(
            &path,
            &repeats::markdown(&repeats),
            &format!("{} repeats", args.repeat),
            wall,
        )?;
    }
    Ok(())
}

/// Writes the summary `md` of several runs (`what`: "3 repeats") to `path`, prints it, and
/// says where it is and how long the runs took since `wall`.
fn write_summary(path: &Path, md: &str, what: &str, wall: Instant) -> anyhow::Result<()> {
    std::fs::write(path, md).with_context(|| format!("cannot write {}", path.display()))?;
    print!("{md}");
    eprintln!(
        "kvroute-lab compare: {what} in {:.0} s; {}",
        wall.elapsed().as_secs_f64(),
        path.display()
    );
    Ok(())
}

/// One whole comparison into `out`; returns its results.
async fn run_once(
    args: &CompareArgs,
    workloads: &[(PathBuf, Workload)],
    kinds: &[RouterKind],
    out: &Path,
) -> anyhow::Result<Vec<WorkloadResult>> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let tools = Tools {
        envoy: args.envoy.clone().unwrap_or_else(envoy_binary),
        kvroute: crate::gateway_binary_or(args.kvroute.as_deref())?,
        python: args
            .python
            .clone()
            .unwrap_or_else(|| PathBuf::from(".venv/bin/python")),
        log_dir: out.to_path_buf(),
        kvroute_scrape_interval: args.kvroute_scrape_interval,
        observe_responses: args.observe_responses,
        tokenizer: args.tokenizer.clone(),
    };
    let wall = Instant::now();
    let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
    eprintln!(
        "kvroute-lab compare: {} workload(s) × routers {}{}; results in {}",
        workloads.len(),
        names.join(", "),
        if args.quick { " (quick)" } else { "" },
        out.display()
    );
    let mut results = Vec::new();
    for (file, w) in workloads {
        let (w, step) = ladder(args, w)?;
        let w = &w;
        let rates = w.rates.clone();
        let mut result = WorkloadResult {
            workload: w.name.clone(),
            file: file.clone(),
            pods: w.fleet.pods,
            speedup: w.fleet.speedup,
            rates: rates.clone(),
            step_duration_s: step.as_secs_f64(),
            objectives: w.objectives.clone().unwrap_or_default(),
            capacity: w.capacity,
            runs: Vec::new(),
            failures: Vec::new(),
        };
        for &kind in kinds {
            eprintln!(
                "  {} / {}: rates {:?} req/s, steps of {:?} simulated",
                w.name,
                kind.name(),
                rates,
                step
            );
            match run_router(kind, w, file, &rates, step, args.quick, &tools).await {
                Ok(run) => {
                    let path = out.join(format!("{}-{}.json", w.name, kind.name()));
                    std::fs::write(&path, serde_json::to_string_pretty(&run)? + "\n")
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    eprintln!("    done in {:.1} s wall", run.wall_s);
                    if run.replicas_routed.len() > 1 {
                        eprintln!(
                            "    requests routed by each replica: {:?}",
                            run.replicas_routed
                        );
                    }
                    if let Some(k) = &run.kv_events {
                        eprintln!(
                            "    KV events: batches {:?}, {} gaps, replays {:?}, {} resets",
                            k.batches, k.gaps, k.replays, k.resets
                        );
                    }
                    for check in &run.prefix_checks {
                        eprintln!(
                            "    prefix predictions from {}: {} {}",
                            check.source, check.requests, check.outcome
                        );
                    }
                    result.runs.push(run);
                }
                Err(e) => {
                    eprintln!("    {} failed: {e:#}", kind.name());
                    result.failures.push((kind, format!("{e:#}")));
                }
            }
        }
        results.push(result);
    }
    let plots = write_report(args, &results, out, wall.elapsed())?;
    print!("{}", summary::terminal(&results, &plots, out));
    eprintln!(
        "kvroute-lab compare: {:.0} s; report {}",
        wall.elapsed().as_secs_f64(),
        out.join("report.md").display()
    );
    Ok(results)
}

/// Writes report.md, the plots and results.json; returns each workload's plot files.
fn write_report(
    args: &CompareArgs,
    results: &[WorkloadResult],
    out: &Path,
    took: Duration,
) -> anyhow::Result<Vec<Vec<String>>> {
    let mut md = String::from("# kvroute compare\n\n");
    let command: Vec<String> = std::env::args().collect();
    md.push_str(&format!(
        "Command: `{}`{}. Machine: {}. Took {:.0} s of wall time.\n\n",
        command.join(" "),
        if args.quick { " (quick mode)" } else { "" },
        machine(),
        took.as_secs_f64()
    ));
    md.push_str("Routers:\n\n");
    let mut kinds: Vec<RouterKind> = results
        .iter()
        .flat_map(|r| {
            r.runs
                .iter()
                .map(|x| x.router)
                .chain(r.failures.iter().map(|f| f.0))
        })
        .collect();
    kinds.sort();
    kinds.dedup();
    for k in kinds {
        md.push_str(&format!("- `{}`: {}\n", k.name(), k.description()));
    }
    md.push('\n');
    md.push_str(report::LEGEND);
    md.push('\n');
    match report::plot_font() {
        Some(font) => md.push_str(&format!("Plot labels use the font {}.\n\n", font.display())),
        None => md.push_str(
            "No TrueType font was found on this machine, so the plots are drawn without text: \
             p90 TTFT (and preemptions, LoRA loads) rise upwards against the rate to the right; \
             colours: kvroute red, round-robin blue, least-request green, sglang orange, vllm-router purple.\n\n",
        ),
    }
    write_results(&mut md, results, out)
}

/// Appends each workload's tables and plots to the report `md`, and writes it to
/// `out/report.md` and the raw results to `out/results.json`; returns each workload's plot
/// files.
pub(crate) fn write_results(
    md: &mut String,
    results: &[WorkloadResult],
    out: &Path,
) -> anyhow::Result<Vec<Vec<String>>> {
    let mut all_plots = Vec::with_capacity(results.len());
    for r in results {
        let plots = match report::plots(r, out) {
            Ok(p) => p,
            Err(e) => {
                md.push_str(&format!("(plots for {} failed: {e})\n\n", r.workload));
                Vec::new()
            }
        };
        md.push_str(&report::workload_markdown(r, &plots));
        all_plots.push(plots);
    }
    let path = out.join("report.md");
    std::fs::write(&path, &*md).with_context(|| format!("cannot write {}", path.display()))?;
    // Each workload's results, with its target checks.
    #[derive(serde::Serialize)]
    struct Entry<'a> {
        #[serde(flatten)]
        result: &'a WorkloadResult,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        targets: Vec<targets::TargetCheck>,
    }
    let entries: Vec<Entry<'_>> = results
        .iter()
        .map(|result| Entry {
            result,
            targets: targets::checks(result),
        })
        .collect();
    let path = out.join("results.json");
    std::fs::write(&path, serde_json::to_string_pretty(&entries)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(all_plots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_ladders_keep_the_first_and_last_rates() {
        assert_eq!(
            spread_rates(&[2.0, 4.0, 8.0, 12.0, 16.0], 4),
            vec![2.0, 4.0, 12.0, 16.0]
        );
        assert_eq!(spread_rates(&[1.0, 2.0], 4), vec![1.0, 2.0]);
        assert_eq!(
            spread_rates(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 3),
            vec![1.0, 4.0, 7.0]
        );
    }

    fn args(quick: bool, rates: &[f64]) -> CompareArgs {
        CompareArgs {
            workloads: Vec::new(),
            routers: Vec::new(),
            quick,
            rates: rates.to_vec(),
            step_duration: None,
            output_dir: PathBuf::from("unused"),
            envoy: None,
            kvroute: None,
            kvroute_scrape_interval: None,
            python: None,
            observe_responses: false,
            repeat: 1,
            seeds: None,
            tokenizer: None,
        }
    }

    const STEPPED: &str = "
name: stepped
rates: [2, 4, 6, 8]
fleet: {pods: 1, max_loras: 0}
classes:
  - name: a
    step_weights: [0, 1, 2, 3]
    prompt_tokens: {dist: fixed, value: 8}
    output_tokens: {dist: fixed, value: 4}
  - name: b
    prompt_tokens: {dist: fixed, value: 8}
    output_tokens: {dist: fixed, value: 4}
";

    #[test]
    fn a_quick_ladder_keeps_the_class_weights_of_the_steps_it_keeps() {
        let w = Workload::from_yaml(STEPPED).expect("valid");
        let (quick, step) = ladder(&args(true, &[]), &w).expect("ladder");
        assert_eq!(quick.rates, vec![2.0, 6.0, 8.0]);
        assert_eq!(quick.class_weights(0), vec![0.0, 1.0]);
        assert_eq!(quick.class_weights(2), vec![3.0, 1.0]);
        assert_eq!(step, QUICK_STEP);
        let (full, _) = ladder(&args(false, &[]), &w).expect("ladder");
        assert_eq!(full, w);
    }

    #[test]
    fn a_rates_override_must_match_class_weights_per_step() {
        let w = Workload::from_yaml(STEPPED).expect("valid");
        let e = ladder(&args(false, &[1.0, 2.0]), &w).expect_err("two rates for four steps");
        assert!(e.to_string().contains("step_weights has 4 entries"), "{e}");
        let (w4, _) = ladder(&args(false, &[1.0, 3.0, 5.0, 7.0]), &w).expect("four rates");
        assert_eq!(w4.rates, vec![1.0, 3.0, 5.0, 7.0]);
        assert_eq!(w4.class_weights(1), vec![1.0, 1.0]);
    }
}
