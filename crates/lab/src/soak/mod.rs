//! `kvroute-lab soak`: a bounded long run through the shipped gateway while things break.
//!
//! Starts a simulated fleet (one `kvroute-sim` process per pod, `fleet`), kvroute
//! (`kvroute serve`, `fleet`) and Envoy with a shipped gateway config; drives open-loop load
//! at a fixed rate (`load`); injects faults on a plan spread over the run (`schedule`):
//! pods killed and restarted, `/metrics` hanging or answering garbage (the simulator's fault
//! switch), kvroute stopped with SIGTERM and with SIGKILL and started again; classifies every
//! answer (`classify`) and samples kvroute's memory and CPU (`procstat`); writes `soak.json`,
//! `soak.md` and a plot (`report`). Fails when a request is lost or a process dies on its own.

pub mod classify;
pub mod fleet;
pub mod load;
pub mod procstat;
pub mod report;
pub mod schedule;

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rustix::process::Signal;
use tokio::sync::watch;
use tokio::time::Instant;

use self::classify::PodKill;
use self::fleet::{Kvroute, SimPod};
use self::load::LoadSpec;
use self::report::{FaultEvent, SoakReport};
use self::schedule::{FaultKind, METRICS_FAULT, POD_DOWN, PlannedFault};
use crate::compare::report::KvEventCounts;
use crate::compare::routers::{
    KvEventTemplates, KvrouteTiming, kv_events_config_json, kvroute_counters,
    reserve_kv_event_ports, wait_answering,
};
use crate::envoy::{EnvoyProcess, Gateway, envoy_binary, free_port};
use kvroute_sim::fault::MetricsFault;

/// Which shipped gateway runs in front of kvroute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GatewayKind {
    /// `envoy/gateway-original-dst.yaml`: fails closed (503 while kvroute is away).
    OriginalDst,
    /// `envoy/gateway-override-host.yaml`: fails open (round robin while kvroute is away).
    OverrideHost,
}

impl GatewayKind {
    fn name(self) -> &'static str {
        match self {
            GatewayKind::OriginalDst => "original-dst",
            GatewayKind::OverrideHost => "override-host",
        }
    }
}

/// Flags of `kvroute-lab soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// How long the load runs (wall time), e.g. 30m.
    #[arg(long, env = "KVROUTE_SOAK_DURATION", default_value = "2m", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Requests per wall-clock second (Poisson arrivals).
    #[arg(long, env = "KVROUTE_SOAK_RATE", default_value_t = 200.0)]
    pub rate: f64,
    /// Simulated pods, one `kvroute-sim` process each.
    #[arg(long, env = "KVROUTE_SOAK_PODS", default_value_t = 4)]
    pub pods: usize,
    /// The pods' clock factor: a 64-token answer takes about 0.5 s simulated, 50 ms of wall
    /// time at 10.
    #[arg(long, env = "KVROUTE_SOAK_SPEEDUP", default_value_t = 10.0)]
    pub speedup: f64,
    /// The gateway in front of kvroute.
    #[arg(
        long,
        env = "KVROUTE_SOAK_GATEWAY",
        value_enum,
        default_value = "original-dst"
    )]
    pub gateway: GatewayKind,
    /// Faults to inject, comma-separated [default: all].
    #[arg(long, env = "KVROUTE_SOAK_FAULTS", value_delimiter = ',', value_enum)]
    pub faults: Vec<FaultKind>,
    /// One fault slot per this much of the run (at least one fault of each kind).
    #[arg(long, env = "KVROUTE_SOAK_FAULT_EVERY", default_value = "60s", value_parser = humantime::parse_duration)]
    pub fault_every: Duration,
    /// Requests in flight at most; one arriving beyond is not sent (and reported), so a
    /// stall cannot grow the load generator without bound.
    #[arg(long, env = "KVROUTE_SOAK_MAX_IN_FLIGHT", default_value_t = 512)]
    pub max_in_flight: usize,
    /// A request without a whole answer after this long (wall time) is cut by the client
    /// and counted as lost.
    #[arg(long, env = "KVROUTE_SOAK_REQUEST_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    /// kvroute's `--drain-timeout`: how long a SIGTERM lets streams in flight finish.
    #[arg(long, env = "KVROUTE_SOAK_DRAIN_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Load generator seed.
    #[arg(long, env = "KVROUTE_SOAK_SEED", default_value_t = 1)]
    pub seed: u64,
    /// The pods publish their KV cache events as vLLM does (`--kv-events-config`, ZeroMQ)
    /// and kvroute follows them (`--prefix-source auto`, each prompt tokenized on a pod's
    /// `/tokenize`): a killed pod takes its publisher with it, and a restarted kvroute
    /// subscribes again and asks for replays.
    #[arg(long, env = "KVROUTE_SOAK_KV_EVENTS")]
    pub kv_events: bool,
    /// With `--kv-events`: every pod tokenizes with this model directory as vLLM does
    /// (`tokenizer.json`, the chat template), and kvroute tokenizes prompts itself with it
    /// (`--tokenizer`) instead of asking a pod (e.g. crates/lab/tokenizers/bpe-4k).
    #[arg(long, env = "KVROUTE_SOAK_TOKENIZER", requires = "kv_events")]
    pub tokenizer: Option<PathBuf>,
    /// Where soak.json, soak.md, the plot and the processes' logs go.
    #[arg(long, env = "KVROUTE_SOAK_OUTPUT_DIR", default_value = "soak-results")]
    pub output_dir: PathBuf,
    /// Envoy binary [default: $ENVOY_BIN, ./.venv/bin/envoy, envoy on PATH].
    #[arg(long, env = "KVROUTE_SOAK_ENVOY")]
    pub envoy: Option<PathBuf>,
    /// The gateway binary [default: `kvroute` beside this program].
    #[arg(long, env = "KVROUTE_BIN")]
    pub kvroute: Option<PathBuf>,
    /// The simulator binary [default: `kvroute-sim` beside this program].
    #[arg(long, env = "KVROUTE_SIM_BIN")]
    pub sim: Option<PathBuf>,
    /// Run nothing: redraw soak.md and the plot into --output-dir from this soak.json.
    #[arg(long)]
    pub replot: Option<PathBuf>,
}

impl SoakArgs {
    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.rate.is_finite() && self.rate > 0.0,
            "--rate must be > 0"
        );
        anyhow::ensure!(
            self.speedup.is_finite() && self.speedup > 0.0,
            "--speedup must be > 0"
        );
        anyhow::ensure!(!self.duration.is_zero(), "--duration must be > 0");
        anyhow::ensure!(
            self.pods >= 2,
            "--pods must be at least 2: a killed pod needs another to take its traffic"
        );
        anyhow::ensure!(self.max_in_flight > 0, "--max-in-flight must be > 0");
        anyhow::ensure!(
            !self.request_timeout.is_zero(),
            "--request-timeout must be > 0"
        );
        if let Some(dir) = &self.tokenizer {
            anyhow::ensure!(
                dir.join("tokenizer.json").is_file(),
                "--tokenizer {}: no tokenizer.json there",
                dir.display()
            );
        }
        Ok(())
    }
}

/// Where the pods listen when they publish KV events: each pod's publisher and replay
/// socket at one offset from its HTTP port (pod `i` on each base port + `i`, as `compare`
/// lays a fleet out), so that one endpoint template names every pod's, across restarts.
struct EventPorts {
    http: u16,
    publish: u16,
    replay: u16,
}

impl EventPorts {
    fn reserve(pods: usize) -> anyhow::Result<EventPorts> {
        let [http, publish, replay] = reserve_kv_event_ports(pods)?;
        Ok(EventPorts {
            http,
            publish,
            replay,
        })
    }

    fn port(base: u16, index: usize) -> anyhow::Result<u16> {
        u16::try_from(index)
            .ok()
            .and_then(|i| base.checked_add(i))
            .context("pod port out of range")
    }

    fn http(&self, index: usize) -> anyhow::Result<u16> {
        Self::port(self.http, index)
    }

    /// Pod `index`'s `--kv-events-config`.
    fn config(&self, index: usize) -> anyhow::Result<String> {
        Ok(kv_events_config_json(
            Self::port(self.publish, index)?,
            Self::port(self.replay, index)?,
        ))
    }

    fn templates(&self) -> KvEventTemplates {
        KvEventTemplates::shifted(self.http, self.publish, self.replay)
    }
}

/// Longest wait, once the load is over, for kvroute to follow every pod's KV event stream
/// again (a pod killed in the run's last slot comes back shortly before the end).
const STREAMS_SETTLE: Duration = Duration::from_secs(10);

/// kvroute's KV-event counts once it follows all `pods` streams, or after
/// [`STREAMS_SETTLE`] if it does not; with how long that took, in seconds.
async fn settled_kv_events(
    metrics: SocketAddr,
    pods: usize,
) -> anyhow::Result<(KvEventCounts, f64)> {
    let started = Instant::now();
    loop {
        let counts = kvroute_counters(&[metrics], true)
            .await?
            .kv_events
            .unwrap_or_default();
        let waited = started.elapsed();
        if counts.streams >= pods as u64 || waited >= STREAMS_SETTLE {
            return Ok((counts, waited.as_secs_f64()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sampling period of kvroute's memory and CPU.
const SAMPLE_PERIOD: Duration = Duration::from_secs(1);

/// Everything running, and what the run has seen happen to it.
struct Running {
    // Dropped (stopped) in this order: the gateway before what it routes to.
    envoy: EnvoyProcess,
    kvroute: Kvroute,
    pods: Vec<SimPod>,
    epoch: Instant,
    kills: watch::Sender<Vec<PodKill>>,
    unexpected_exits: Vec<String>,
}

impl Running {
    fn now_s(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    /// Until `until`, checks once a second that nothing died on its own; restarts what did
    /// (Envoy cannot be: its port is the load's target, so its death is reported).
    async fn watch_until(&mut self, until: Instant) {
        while Instant::now() < until {
            tokio::time::sleep_until(until.min(Instant::now() + Duration::from_secs(1))).await;
            let t = self.now_s();
            for pod in &mut self.pods {
                if let Some(status) = pod.exited() {
                    self.unexpected_exits
                        .push(format!("pod {} exited at {t:.1} s ({status})", pod.index));
                    if let Err(e) = pod.start().await {
                        self.unexpected_exits
                            .push(format!("pod {} could not restart: {e:#}", pod.index));
                    }
                }
            }
            if let Some(status) = self.kvroute.exited() {
                self.unexpected_exits
                    .push(format!("kvroute exited at {t:.1} s ({status})"));
                if let Err(e) = self.kvroute.start().await {
                    self.unexpected_exits
                        .push(format!("kvroute could not restart: {e:#}"));
                }
            }
            if let Some(status) = self.envoy.exited() {
                self.unexpected_exits
                    .push(format!("Envoy exited at {t:.1} s ({status})"));
                return;
            }
        }
    }

    /// Injects one fault and waits until it is over.
    async fn inject(&mut self, fault: &PlannedFault) -> anyhow::Result<FaultEvent> {
        let at_s = self.now_s();
        let detail = match (fault.kind, fault.pod) {
            (FaultKind::PodKill, Some(i)) => {
                let pod = self.pods.get_mut(i).context("no such pod")?;
                self.kills
                    .send_modify(|kills| kills.push(PodKill { pod: i, at_s }));
                pod.kill();
                tokio::time::sleep(POD_DOWN).await;
                pod.start().await?;
                format!(
                    "SIGKILL, started again after {POD_DOWN:?}, serving {:.1} s after the kill",
                    self.now_s() - at_s
                )
            }
            (FaultKind::MetricsHang | FaultKind::MetricsGarbage, Some(i)) => {
                let mode = if fault.kind == FaultKind::MetricsHang {
                    MetricsFault::Hang
                } else {
                    MetricsFault::Garbage
                };
                let pod = self.pods.get(i).context("no such pod")?;
                pod.set_metrics_fault(mode).await?;
                tokio::time::sleep(METRICS_FAULT).await;
                pod.set_metrics_fault(MetricsFault::None).await?;
                format!("/metrics {mode:?} for {METRICS_FAULT:?}").to_lowercase()
            }
            (FaultKind::KvrouteRestart | FaultKind::KvrouteKill, _) => {
                let (signal, name) = if fault.kind == FaultKind::KvrouteRestart {
                    (Signal::TERM, "SIGTERM")
                } else {
                    (Signal::KILL, "SIGKILL")
                };
                let stopped = self.kvroute.stop(signal).await;
                self.kvroute.start().await?;
                format!(
                    "{name}: exited after {:.2} s ({}); started again, scraping every pod {:.1} s after the signal",
                    stopped.after_s,
                    stopped.how,
                    self.now_s() - at_s
                )
            }
            (kind, None) => anyhow::bail!("{} planned without a pod", kind.name()),
        };
        Ok(FaultEvent {
            kind: fault.kind,
            pod: fault.pod,
            at_s,
            over_s: self.now_s(),
            detail,
            failures: Default::default(),
        })
    }
}

/// Writes the plot and soak.md into `out`, prints the Markdown; returns soak.md's path.
fn write_summary(report: &SoakReport, out: &std::path::Path) -> anyhow::Result<PathBuf> {
    let plot = match report::plot(report, out) {
        Ok(()) => Some(report::PLOT),
        Err(e) => {
            eprintln!("kvroute-lab soak: the plot failed: {e}");
            None
        }
    };
    let markdown = report.markdown(plot);
    let md_path = out.join("soak.md");
    std::fs::write(&md_path, &markdown)
        .with_context(|| format!("cannot write {}", md_path.display()))?;
    // A closed stdout (`| head`) must not turn the summary into a panic: it is in soak.md.
    let _ = writeln!(std::io::stdout(), "{markdown}");
    Ok(md_path)
}

/// `--replot`: soak.md and the plot again from a run's soak.json.
fn replot(file: &std::path::Path, out: &std::path::Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let report: SoakReport = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a soak report", file.display()))?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    write_summary(&report, out)?;
    Ok(())
}

/// `kvroute-lab soak`: runs, writes the report, fails if a request was lost.
pub async fn run(args: SoakArgs) -> anyhow::Result<()> {
    if let Some(file) = &args.replot {
        return replot(file, &args.output_dir);
    }
    args.validate()?;
    let wall = std::time::Instant::now();
    let out = &args.output_dir;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let envoy_bin = args.envoy.clone().unwrap_or_else(envoy_binary);
    let kvroute_bin = crate::gateway_binary_or(args.kvroute.as_deref())?;
    let sim_bin = crate::sim_binary_or(args.sim.as_deref())?;
    let kinds = if args.faults.is_empty() {
        FaultKind::ALL.to_vec()
    } else {
        args.faults.clone()
    };
    let plan = schedule::plan(args.duration, args.fault_every, &kinds, args.pods);
    eprintln!(
        "kvroute-lab soak: {:?} at {} req/s through Envoy ({}) and kvroute to {} pods; {} faults; results in {}",
        args.duration,
        args.rate,
        args.gateway.name(),
        args.pods,
        plan.len(),
        out.display()
    );

    let layout = if args.kv_events {
        Some(EventPorts::reserve(args.pods)?)
    } else {
        None
    };
    let mut pods = Vec::with_capacity(args.pods);
    for index in 0..args.pods {
        let port = match &layout {
            Some(layout) => layout.http(index)?,
            None => free_port()?,
        };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut pod = SimPod::new(index, addr, &sim_bin, args.speedup, args.seed, out);
        if let Some(layout) = &layout {
            pod = pod.with_kv_events(layout.config(index)?);
        }
        if let Some(dir) = &args.tokenizer {
            pod = pod.with_tokenizer(dir);
        }
        pod.start().await?;
        pods.push(pod);
    }
    let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
    let pid = Arc::new(watch::Sender::new(None));
    let mut kvroute = Kvroute::new(
        &kvroute_bin,
        &addrs,
        [free_port()?, free_port()?, free_port()?],
        KvrouteTiming::for_speedup(args.speedup),
        args.drain_timeout,
        out,
        Arc::clone(&pid),
    );
    if let Some(layout) = &layout {
        kvroute = kvroute.with_kv_events(layout.templates(), args.tokenizer.as_deref());
    }
    kvroute.start().await?;
    let gateway = match args.gateway {
        GatewayKind::OriginalDst => Gateway::OriginalDst {
            kvroute: kvroute.grpc,
        },
        GatewayKind::OverrideHost => Gateway::OverrideHost {
            kvroute: kvroute.grpc,
        },
    };
    let envoy = EnvoyProcess::start(gateway, &addrs, &envoy_bin, "warning").await?;
    let base_url = envoy.url("");
    let model = kvroute_sim::config::DEFAULT_MODEL.to_string();
    wait_answering(&base_url, &model, Duration::from_secs(30), || Ok(()))
        .await
        .context("the gateway did not answer a completion")?;

    let epoch = Instant::now();
    let (kills, kills_seen) = watch::channel(Vec::new());
    let (stop, stopped) = watch::channel(false);
    let sampler = tokio::spawn(procstat::sample(
        pid.subscribe(),
        SAMPLE_PERIOD,
        epoch,
        stopped,
    ));
    let spec = LoadSpec {
        base_url,
        rate: args.rate,
        duration: args.duration,
        max_in_flight: args.max_in_flight,
        timeout: args.request_timeout,
        seed: args.seed,
        model,
    };
    let load = tokio::spawn(load::drive(spec, epoch, kills_seen));
    let mut running = Running {
        pods,
        kvroute,
        envoy,
        epoch,
        kills,
        unexpected_exits: Vec::new(),
    };
    let mut events = Vec::with_capacity(plan.len());
    for fault in &plan {
        running
            .watch_until(epoch + Duration::from_secs_f64(fault.at_s))
            .await;
        eprintln!(
            "  {:>7.1} s: {}{}",
            running.now_s(),
            fault.kind.name(),
            fault.pod.map_or(String::new(), |p| format!(" (pod {p})"))
        );
        match running.inject(fault).await {
            Ok(event) => events.push(event),
            Err(e) => running.unexpected_exits.push(format!(
                "{} at {:.1} s failed: {e:#}",
                fault.kind.name(),
                fault.at_s
            )),
        }
    }
    running.watch_until(epoch + args.duration).await;
    let tally = load.await.context("the load generator failed")?;
    // What kvroute's subscriptions did since its last start, read while it still runs.
    let (kv_events, kv_streams_waited_s) = if args.kv_events {
        match settled_kv_events(running.kvroute.metrics_addr(), args.pods).await {
            Ok((counts, waited)) => (Some(counts), Some(waited)),
            Err(e) => {
                eprintln!("kvroute-lab soak: kvroute's KV-event counters could not be read: {e:#}");
                (None, None)
            }
        }
    } else {
        (None, None)
    };
    let _ = stop.send(true);
    let samples = sampler.await.unwrap_or_default();
    let envoy_log = running.envoy.log();
    let unexpected_exits = std::mem::take(&mut running.unexpected_exits);
    drop(running);
    let envoy_log_path = out.join("envoy.log");
    std::fs::write(&envoy_log_path, envoy_log)
        .with_context(|| format!("cannot write {}", envoy_log_path.display()))?;

    for event in &mut events {
        let (from, to) = report::window(event);
        event.failures = report::failures_between(&tally.failures_per_s, from, to);
    }
    let duration_s = args.duration.as_secs_f64();
    let lost = tally.lost();
    let errors = tally
        .outcomes
        .iter()
        .filter(|(k, _)| k.starts_with("error "))
        .map(|(_, n)| n)
        .sum();
    let report = SoakReport {
        version: report::REPORT_VERSION,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: crate::compare::machine(),
        gateway: args.gateway.name().to_string(),
        duration_s,
        rate: args.rate,
        sent_rate: tally.sent as f64 / duration_s,
        pods: args.pods,
        speedup: args.speedup,
        max_in_flight: args.max_in_flight,
        request_timeout_s: args.request_timeout.as_secs_f64(),
        seed: args.seed,
        wall_s: wall.elapsed().as_secs_f64(),
        completed: tally.count("completed"),
        errors,
        cut_by_pod_kill: tally.count("cut_by_pod_kill"),
        lost,
        failures_outside_faults: report::failures_outside(&tally.failures_per_s, &events),
        tally,
        faults: events,
        passed: lost == 0 && unexpected_exits.is_empty(),
        unexpected_exits,
        kvroute: report::resources(samples, duration_s),
        rss_growth_target_percent: report::RSS_GROWTH_TARGET_PERCENT,
        tokenizer: args.tokenizer.as_ref().map(|d| d.display().to_string()),
        kv_events,
        kv_streams_waited_s,
    };
    let json_path = out.join("soak.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("cannot write {}", json_path.display()))?;
    let md_path = write_summary(&report, out)?;
    eprintln!(
        "kvroute-lab soak: {} ({} lost); report {}",
        if report.passed { "passed" } else { "FAILED" },
        report.lost,
        md_path.display()
    );
    anyhow::ensure!(
        report.passed,
        "{} requests lost, {} unexpected exits; see {}",
        report.lost,
        report.unexpected_exits.len(),
        md_path.display()
    );
    Ok(())
}
