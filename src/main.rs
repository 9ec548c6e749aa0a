//! The `kvroute` command, the gateway: parse, build, run. The simulator is
//! `kvroute-sim`; benchmarks, comparisons and the demo are `kvroute-lab`.

use std::io::IsTerminal;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use kvroute::admin::tap::{EndpointsArgs, TapArgs};
use kvroute::app::{App, shutdown_signal};
use kvroute::config::{LogFormat, ServeArgs, ServeConfig};

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
    Serve(Box<ServeArgs>),
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
        .with_writer(std::io::stderr)
        // A closed stderr (a supervisor gone) must not turn a log line into a panic.
        .log_internal_errors(false);
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
