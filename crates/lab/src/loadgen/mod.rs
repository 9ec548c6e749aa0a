//! `kvroute-lab bench`: an open-loop load generator for any OpenAI-compatible endpoint.
//!
//! For each rate of a ladder it plans a step of Poisson arrivals from a workload file
//! (`workload`, pure and seeded), sends every request streamed at its arrival time whatever
//! the others are doing (`client`, one measured request, with its class's objective and
//! tenant headers), waits for the step's stragglers, and turns the records into statistics
//! (`report`: completed, shed by a gateway, failed; per step and per class, objective and
//! tenant). Times are in simulated seconds: arrival times
//! are divided by `--speedup` and measured latencies multiplied by it, so a run against a
//! `kvroute-sim` fleet clocked 10× faster reads like one against real pods. See
//! docs/workloads.md.

pub mod client;
pub mod report;
pub mod workload;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use reqwest::header::{HeaderMap, HeaderValue};

use self::client::{ErrorKind, FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, Outcome};
use self::report::{Record, Report, StepReport};
pub use self::workload::{Workload, WorkloadError};

/// Flags of `kvroute-lab bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Base URL of the OpenAI-compatible endpoint (e.g. http://127.0.0.1:8080).
    #[arg(long, env = "KVROUTE_BENCH_TARGET")]
    pub target: String,
    /// Workload file (crates/lab/workloads/*.yaml).
    #[arg(long, env = "KVROUTE_BENCH_WORKLOAD")]
    pub workload: PathBuf,
    /// One rate, requests per simulated second [default: the workload's ladder].
    #[arg(long, env = "KVROUTE_BENCH_RATE", conflicts_with = "rates")]
    pub rate: Option<f64>,
    /// A ladder of rates, comma-separated [default: the workload's].
    #[arg(long, env = "KVROUTE_BENCH_RATES", value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// Arrivals of one step last this long, simulated time [default: the workload's].
    #[arg(long, env = "KVROUTE_BENCH_STEP_DURATION", value_parser = humantime::parse_duration)]
    pub step_duration: Option<Duration>,
    /// At most this many requests per step (the step ends at whichever limit comes first).
    #[arg(long, env = "KVROUTE_BENCH_REQUESTS_PER_STEP")]
    pub requests_per_step: Option<usize>,
    /// The target's clock factor (`kvroute-sim --speedup`): arrivals are divided by it,
    /// latencies multiplied by it.
    #[arg(long, env = "KVROUTE_BENCH_SPEEDUP", default_value_t = 1.0)]
    pub speedup: f64,
    /// Write the JSON report here [default: stdout].
    #[arg(long, env = "KVROUTE_BENCH_OUTPUT")]
    pub output: Option<PathBuf>,
    /// Generator seed [default: the workload's].
    #[arg(long, env = "KVROUTE_BENCH_SEED")]
    pub seed: Option<u64>,
    /// Safety bound: a request arriving while this many are in flight is dropped (an error).
    #[arg(long, env = "KVROUTE_BENCH_MAX_CONCURRENCY", default_value_t = 1024)]
    pub max_concurrency: usize,
    /// A request taking longer fails, simulated time.
    #[arg(long, env = "KVROUTE_BENCH_TIMEOUT", default_value = "300s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Base model name to send [default: the workload's].
    #[arg(long, env = "KVROUTE_BENCH_MODEL")]
    pub model: Option<String>,
    /// Include every request's record in the JSON.
    #[arg(long, env = "KVROUTE_BENCH_RAW")]
    pub raw: bool,
}

/// Why a bench run cannot start.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The workload file is wrong.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// A flag is out of range.
    #[error("{0}")]
    Invalid(String),
}

/// Most requests one step may plan.
const MAX_REQUESTS_PER_STEP: f64 = 1_000_000.0;

/// A validated run: the workload and the flags resolved against it.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The workload (with `--model` applied).
    pub workload: Workload,
    /// Full URL of the endpoint.
    pub url: String,
    /// Base URL as given.
    pub target: String,
    /// The ladder.
    pub rates: Vec<f64>,
    /// Arrivals per step, simulated time.
    pub step_duration: Duration,
    /// Request cap per step.
    pub requests_per_step: Option<usize>,
    /// Clock factor.
    pub speedup: f64,
    /// Generator seed.
    pub seed: u64,
    /// Requests in flight at most.
    pub max_concurrency: usize,
    /// Per-request timeout, simulated time.
    pub timeout: Duration,
    /// Keep every record.
    pub raw: bool,
    /// Draw a progress bar (on a terminal).
    pub progress: bool,
    /// The flow-control headers of each class's requests, in class order.
    pub class_headers: Vec<HeaderMap>,
}

/// The headers a class's requests carry: its objective and its tenant, when it has them.
pub fn class_headers(class: &workload::ClassSpec) -> Result<HeaderMap, BenchError> {
    let mut headers = HeaderMap::new();
    for (name, value) in [
        (OBJECTIVE_HEADER, &class.objective),
        (FAIRNESS_ID_HEADER, &class.tenant),
    ] {
        if let Some(v) = value {
            let v = HeaderValue::from_str(v).map_err(|e| {
                BenchError::Invalid(format!("class {}: {name}: {v:?}: {e}", class.name))
            })?;
            headers.insert(name, v);
        }
    }
    Ok(headers)
}

/// `base` + `/v1` + the API path (`base` may already end in `/v1`).
pub fn endpoint_url(base: &str, api: workload::Api) -> String {
    let base = base.trim_end_matches('/');
    if base.ends_with("/v1") {
        format!("{base}{}", api.path())
    } else {
        format!("{base}/v1{}", api.path())
    }
}

impl Plan {
    /// Resolves the flags against the workload file and checks them.
    pub fn new(args: &BenchArgs, mut workload: Workload) -> Result<Plan, BenchError> {
        let bad = |m: String| Err(BenchError::Invalid(m));
        let url = reqwest::Url::parse(&args.target)
            .map_err(|e| BenchError::Invalid(format!("--target {:?}: {e}", args.target)))?;
        if !matches!(url.scheme(), "http" | "https") {
            return bad(format!(
                "--target must be an http(s) URL, got {}",
                args.target
            ));
        }
        if let Some(m) = &args.model {
            workload.model = m.clone();
        }
        let rates = match (args.rate, args.rates.is_empty()) {
            (Some(r), _) => vec![r],
            (None, false) => args.rates.clone(),
            (None, true) => workload.rates.clone(),
        };
        if rates.is_empty() || rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return bad(format!("rates must be > 0, got {rates:?}"));
        }
        if let Some(steps) = workload
            .classes
            .iter()
            .filter_map(|c| c.step_weights.as_ref().map(Vec::len))
            .find(|&n| n != rates.len())
        {
            return bad(format!(
                "workload {} weighs its classes per step of a {steps}-rate ladder; a ladder override must have {steps} rates, got {rates:?}",
                workload.name,
            ));
        }
        let class_headers = workload
            .classes
            .iter()
            .map(class_headers)
            .collect::<Result<Vec<_>, _>>()?;
        if !(args.speedup.is_finite() && args.speedup > 0.0) {
            return bad(format!("--speedup must be > 0, got {}", args.speedup));
        }
        if args.max_concurrency == 0 {
            return bad("--max-concurrency must be > 0".into());
        }
        if args.timeout.is_zero() {
            return bad("--timeout must be > 0".into());
        }
        if args.requests_per_step == Some(0) {
            return bad("--requests-per-step must be > 0".into());
        }
        let step_duration = args.step_duration.unwrap_or(workload.step_duration);
        if step_duration.is_zero() {
            return bad("--step-duration must be > 0".into());
        }
        let largest = rates.iter().copied().fold(0.0, f64::max) * step_duration.as_secs_f64();
        if args.requests_per_step.is_none() && largest > MAX_REQUESTS_PER_STEP {
            return bad(format!(
                "a step would plan ~{largest:.0} requests; lower the rate or --step-duration, or set --requests-per-step"
            ));
        }
        Ok(Plan {
            url: endpoint_url(&args.target, workload.api),
            target: args.target.clone(),
            rates,
            step_duration,
            requests_per_step: args.requests_per_step,
            speedup: args.speedup,
            seed: args.seed.unwrap_or(workload.seed),
            max_concurrency: args.max_concurrency,
            timeout: args.timeout,
            raw: args.raw,
            progress: std::io::stderr().is_terminal(),
            class_headers,
            workload,
        })
    }
}

fn progress_bar(plan: &Plan, rate: f64, len: usize) -> ProgressBar {
    if !plan.progress {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    let style = ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} done, {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(format!("{} @ {rate}/s", plan.workload.name));
    bar
}

/// Runs one step: sends `requests` at their arrival times, waits for every response.
async fn run_step(
    plan: &Plan,
    client: &reqwest::Client,
    requests: Vec<workload::Request>,
    bar: &ProgressBar,
) -> (Vec<Record>, Duration) {
    let speedup = plan.speedup;
    let timeout = plan.timeout.div_f64(speedup);
    let url: Arc<str> = Arc::from(plan.url.as_str());
    let limit = Arc::new(Semaphore::new(plan.max_concurrency));
    let started = tokio::time::Instant::now();
    let mut records: Vec<Option<Record>> = vec![None; requests.len()];
    let mut tasks: JoinSet<(usize, Record)> = JoinSet::new();
    let (mut errors, mut shed) = (0usize, 0usize);
    let mut finish = |i: usize, r: Record, records: &mut Vec<Option<Record>>| {
        if r.outcome.error_kind.is_some() {
            errors += 1;
        }
        if r.outcome.shed_reason.is_some() {
            shed += 1;
        }
        bar.inc(1);
        bar.set_message(format!("{errors} errors, {shed} shed"));
        records[i] = Some(r);
    };
    let mut pending = requests.into_iter().enumerate().peekable();
    while let Some((_, next)) = pending.peek() {
        let due = started + next.at.div_f64(speedup);
        tokio::select! {
            biased;
            Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                if let Ok((i, r)) = joined {
                    finish(i, r, &mut records);
                }
            }
            () = tokio::time::sleep_until(due) => {
                let Some((i, request)) = pending.next() else { break };
                let sent_s = started.elapsed().as_secs_f64() * speedup;
                let spec = &plan.workload.classes[request.class];
                let mut record = Record {
                    index: i,
                    class: spec.name.clone(),
                    objective: spec.objective.clone(),
                    tenant: spec.tenant.clone(),
                    model: request.model.clone(),
                    planned_prompt_tokens: request.prompt_tokens,
                    max_tokens: request.max_tokens,
                    scheduled_s: request.at.as_secs_f64(),
                    sent_s,
                    outcome: Outcome::default(),
                };
                let Ok(permit) = Arc::clone(&limit).try_acquire_owned() else {
                    record.outcome = Outcome::failed(
                        ErrorKind::Dropped,
                        format!("{} requests already in flight", plan.max_concurrency),
                    );
                    finish(i, record, &mut records);
                    continue;
                };
                let body = request.body(plan.workload.api, plan.workload.ignore_eos);
                let headers = plan.class_headers.get(request.class).cloned().unwrap_or_default();
                let (client, url) = (client.clone(), Arc::clone(&url));
                tasks.spawn(async move {
                    record.outcome =
                        client::send(&client, &url, &body, headers, timeout, speedup).await;
                    drop(permit);
                    (i, record)
                });
            }
        }
    }
    while let Some(joined) = tasks.join_next().await {
        if let Ok((i, r)) = joined {
            finish(i, r, &mut records);
        }
    }
    let elapsed = started.elapsed();
    // A task that panicked leaves its slot empty: count it as a stream error.
    let records = records
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.unwrap_or_else(|| Record {
                index: i,
                class: String::new(),
                objective: None,
                tenant: None,
                model: String::new(),
                planned_prompt_tokens: 0,
                max_tokens: 0,
                scheduled_s: 0.0,
                sent_s: 0.0,
                outcome: Outcome::failed(ErrorKind::Stream, "the request task failed"),
            })
        })
        .collect();
    (records, elapsed)
}

/// Runs the whole ladder and returns the report.
pub async fn bench(plan: &Plan) -> Report {
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(plan.max_concurrency)
        .build()
        .unwrap_or_default();
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let wall = Instant::now();
    let mut steps = Vec::with_capacity(plan.rates.len());
    for (step, &rate) in plan.rates.iter().enumerate() {
        let requests = plan.workload.plan_step(
            plan.seed,
            step,
            rate,
            plan.step_duration,
            plan.requests_per_step,
        );
        let bar = progress_bar(plan, rate, requests.len());
        let (records, elapsed) = run_step(plan, &client, requests, &bar).await;
        bar.finish();
        steps.push(StepReport::new(
            rate,
            plan.step_duration.as_secs_f64(),
            elapsed.as_secs_f64() * plan.speedup,
            records,
            plan.raw,
        ));
    }
    Report {
        version: report::REPORT_VERSION,
        workload: plan.workload.name.clone(),
        target: plan.target.clone(),
        endpoint: plan.url.clone(),
        seed: plan.seed,
        speedup: plan.speedup,
        max_concurrency: plan.max_concurrency,
        started_unix,
        wall_s: wall.elapsed().as_secs_f64(),
        steps,
    }
}

/// `kvroute-lab bench`: runs the ladder, writes the JSON report, prints a table to stderr.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let workload = Workload::from_file(&args.workload)?;
    let plan = Plan::new(&args, workload)?;
    eprintln!(
        "kvroute-lab bench: workload {} against {}, rates {:?}/s, steps of {:?} (simulated, speedup {})",
        plan.workload.name, plan.url, plan.rates, plan.step_duration, plan.speedup
    );
    let report = bench(&plan).await;
    let json = serde_json::to_string_pretty(&report)?;
    match &args.output {
        Some(path) => std::fs::write(path, json + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => println!("{json}"),
    }
    eprintln!("\n{}", report.table());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOW: &str = "
name: flow
rates: [2, 20]
fleet: {pods: 1, max_loras: 0}
objectives: {critical: 100, sheddable: -10}
classes:
  - name: a
    objective: critical
    tenant: t-a
    step_weights: [0, 10]
    prompt_tokens: {dist: fixed, value: 8}
    output_tokens: {dist: fixed, value: 4}
  - name: b
    objective: sheddable
    prompt_tokens: {dist: fixed, value: 8}
    output_tokens: {dist: fixed, value: 4}
";

    fn args(rates: &[f64]) -> BenchArgs {
        BenchArgs {
            target: "http://127.0.0.1:1".into(),
            workload: PathBuf::new(),
            rate: None,
            rates: rates.to_vec(),
            step_duration: None,
            requests_per_step: None,
            speedup: 1.0,
            output: None,
            seed: None,
            max_concurrency: 8,
            timeout: Duration::from_secs(1),
            model: None,
            raw: false,
        }
    }

    #[test]
    fn a_plan_holds_each_classs_flow_control_headers() {
        let w = Workload::from_yaml(FLOW).expect("valid");
        let plan = Plan::new(&args(&[]), w).expect("plan");
        let a = &plan.class_headers[0];
        assert_eq!(a[OBJECTIVE_HEADER], "critical");
        assert_eq!(a[FAIRNESS_ID_HEADER], "t-a");
        let b = &plan.class_headers[1];
        assert_eq!(b[OBJECTIVE_HEADER], "sheddable");
        assert!(b.get(FAIRNESS_ID_HEADER).is_none());
    }

    #[test]
    fn a_ladder_override_must_match_the_class_weights_per_step() {
        let w = Workload::from_yaml(FLOW).expect("valid");
        let e = Plan::new(&args(&[5.0]), w.clone()).expect_err("one rate for two steps");
        assert!(e.to_string().contains("must have 2 rates"), "{e}");
        let plan = Plan::new(&args(&[3.0, 30.0]), w.clone()).expect("two rates");
        assert_eq!(plan.rates, vec![3.0, 30.0]);
        // One step of it is a workload of its own.
        let one = w.select_steps(&[1]);
        Plan::new(&args(&[5.0]), one).expect("one rate for one step");
    }
}
