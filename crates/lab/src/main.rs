//! The `kvroute-lab` command: the load generator, the fleet comparison and the demo.
//! The gateway (`kvroute`) is measured as a separate process.

use clap::{Parser, Subcommand};
use mimalloc::MiMalloc;
use tracing_subscriber::EnvFilter;

use kvroute_lab::compare::CompareArgs;
use kvroute_lab::demo::DemoArgs;
use kvroute_lab::loadgen::BenchArgs;
use kvroute_lab::simulate::SimulateArgs;
use kvroute_lab::soak::SoakArgs;
use kvroute_lab::up::UpArgs;

/// The offline simulation allocates and frees on every event (requests, readings, snapshots
/// of a thousand pods): mimalloc took 12 % off a simulation of 1,000 pods against glibc's
/// allocator (docs/performance.md).
#[global_allocator]
static ALLOCATOR: MiMalloc = MiMalloc;

#[derive(Parser)]
#[command(
    name = "kvroute-lab",
    version,
    about = "Benchmarks and comparisons of kvroute on simulated vLLM fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Try kvroute locally: simulated fleet + kvroute + Envoy, against Envoy round robin.
    Demo(DemoArgs),
    /// Try kvroute by hand: a simulated fleet with LoRA adapters, kvroute and the shipped
    /// Envoy gateway on fixed ports; prints `curl` lines to try; Ctrl-C stops everything.
    Up(UpArgs),
    /// Drive an OpenAI-compatible endpoint with a workload file; report latencies as JSON.
    Bench(BenchArgs),
    /// Compare kvroute with Envoy round robin / least request, sglang-router and vllm-router
    /// on identical simulated fleets; writes a Markdown report, plots and raw JSON.
    Compare(CompareArgs),
    /// A long run through Envoy and kvroute while pods are killed, `/metrics` breaks and
    /// kvroute restarts; fails if any request is lost. Writes JSON, Markdown and a plot.
    Soak(SoakArgs),
    /// The whole fleet offline, in virtual time: kvroute's routing core, round robin and
    /// least request against the simulator's engine for every pod (no sockets, no waits);
    /// writes compare's report shape. `--pods` scales a workload to any fleet size.
    Simulate(SimulateArgs),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Progress and reports go to the terminal; logs are kept to warnings.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A closed stderr (a supervisor gone) must not turn a log line into a panic.
        .log_internal_errors(false)
        .init();
    let result = match cli.command {
        Command::Demo(args) => kvroute_lab::demo::run(args).await,
        Command::Up(args) => kvroute_lab::up::run(args).await,
        Command::Bench(args) => kvroute_lab::loadgen::run(args).await,
        Command::Compare(args) => kvroute_lab::compare::run(args).await,
        Command::Soak(args) => kvroute_lab::soak::run(args).await,
        // CPU-bound and synchronous: it runs on this thread (and its own workers).
        Command::Simulate(args) => kvroute_lab::simulate::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute-lab: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
