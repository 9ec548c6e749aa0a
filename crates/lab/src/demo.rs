//! `kvroute-lab demo`: kvroute on a laptop. The quick comparison of kvroute behind a real Envoy
//! against Envoy's round robin, on two fresh, identical simulated vLLM fleets, with the
//! multi-LoRA workload built into the binary (or any workload file). It prints a headline
//! (the knee, p90 TTFT there, the counters that matter), where the report, raw JSON and plots
//! were written, and a compact table per rate (`compare::summary`).

use std::path::PathBuf;

use anyhow::Context;

use crate::compare::{self, CompareArgs, RouterKind};

/// The workload the demo runs unless told otherwise (`crates/lab/workloads/multi-lora.yaml`).
const DEFAULT_WORKLOAD: &str = include_str!("../workloads/multi-lora.yaml");

/// Flags of `kvroute-lab demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Workload file [default: the built-in multi-LoRA workload, 16 adapters over 8 pods
    /// with 2 adapter slots each].
    #[arg(long)]
    pub workload: Option<PathBuf>,
    /// Where the report, the plots and the raw JSON go.
    #[arg(long, default_value = "demo-results")]
    pub output_dir: PathBuf,
    /// Run the workload's whole ladder instead of the quick one (3 rates, 10 s steps).
    #[arg(long)]
    pub full: bool,
    /// Envoy binary [default: $ENVOY_BIN, ./.venv/bin/envoy, envoy on PATH].
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// The gateway binary [default: `kvroute` beside this program].
    #[arg(long, env = "KVROUTE_BIN")]
    pub kvroute: Option<PathBuf>,
}

/// Runs the comparison; its summary names what it wrote.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let out = args.output_dir;
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let workload = match args.workload {
        Some(path) => path,
        None => {
            let path = out.join("multi-lora.yaml");
            std::fs::write(&path, DEFAULT_WORKLOAD)
                .with_context(|| format!("cannot write {}", path.display()))?;
            path
        }
    };
    compare::run(CompareArgs {
        workloads: vec![workload],
        routers: vec![RouterKind::Kvroute, RouterKind::RoundRobin],
        quick: !args.full,
        rates: Vec::new(),
        step_duration: None,
        output_dir: out,
        envoy: args.envoy,
        kvroute: args.kvroute,
        kvroute_scrape_interval: None,
        python: None,
        observe_responses: false,
        repeat: 1,
        seeds: None,
        tokenizer: None,
    })
    .await
}
