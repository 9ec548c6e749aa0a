//! The `kvroute` command: parse, build, run.

use std::io::IsTerminal;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use kvroute::admin::tap::{EndpointsArgs, TapArgs};
use kvroute::app::{App, shutdown_signal};
use kvroute::compare::CompareArgs;
use kvroute::config::{LogFormat, ServeArgs, ServeConfig};
use kvroute::demo::DemoArgs;
use kvroute::loadgen::BenchArgs;
use kvroute::sim::SimArgs;

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache and LoRA aware endpoint picker for LLM inference behind Envoy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the Envoy ext_proc endpoint picker.
    Serve(ServeArgs),
    /// Run a fleet of simulated vLLM pods (no GPU needed).
    Sim(SimArgs),
    /// Try kvroute locally: simulated fleet + kvroute + Envoy, against Envoy round robin.
    Demo(DemoArgs),
    /// Drive an OpenAI-compatible endpoint with a workload file; report latencies as JSON.
    Bench(BenchArgs),
    /// Compare kvroute with Envoy round robin / least request, sglang-router and vllm-router
    /// on identical simulated fleets; writes a Markdown report, plots and raw JSON.
    Compare(CompareArgs),
    /// Print kvroute's routing decisions live, with the top candidates' scores.
    Tap(TapArgs),
    /// Print the endpoints kvroute routes to, with their scraped metrics.
    Endpoints(EndpointsArgs),
}

/// Logs to stderr; `RUST_LOG` overrides `default_filter`.
fn init_logging(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Colour only for a terminal: logs piped to files or collectors stay plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => {
            init_logging(args.log_format, "info,h2=warn,tower=warn,hyper=warn");
            match ServeConfig::from_args(&args) {
                Ok(config) => serve(config).await,
                Err(error) => Err(error.into()),
            }
        }
        Command::Sim(args) => {
            init_logging(LogFormat::Text, "info");
            kvroute::sim::run(args).await
        }
        Command::Demo(args) => {
            // The demo prints its own progress; kvroute's logs would drown it.
            init_logging(LogFormat::Text, "warn");
            kvroute::demo::run(args).await
        }
        Command::Bench(args) => {
            // The progress bar and the report go to the terminal; keep logs to warnings.
            init_logging(LogFormat::Text, "warn");
            kvroute::loadgen::run(args).await
        }
        Command::Compare(args) => {
            // Progress and the report go to the terminal; keep logs to warnings.
            init_logging(LogFormat::Text, "warn");
            kvroute::compare::run(args).await
        }
        Command::Tap(args) => {
            init_logging(LogFormat::Text, "warn");
            kvroute::admin::tap::tap(args).await
        }
        Command::Endpoints(args) => {
            init_logging(LogFormat::Text, "warn");
            kvroute::admin::tap::endpoints(args).await
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    let app = App::bind(config).await?;
    app.run(shutdown_signal()).await
}
