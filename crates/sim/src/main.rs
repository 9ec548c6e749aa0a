//! The `kvroute-sim` command: a fleet of simulated vLLM pods, until Ctrl-C or SIGTERM.

use clap::Parser;
use tracing_subscriber::EnvFilter;

use kvroute_sim::SimArgs;

#[derive(Parser)]
#[command(
    name = "kvroute-sim",
    version,
    about = "A fleet of simulated vLLM pods (OpenAI API and vLLM /metrics, no GPU needed)"
)]
struct Cli {
    #[command(flatten)]
    args: SimArgs,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The zeromq crate logs every subscriber that comes and goes at info: noise here.
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,zeromq=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A closed stderr (a supervisor gone) must not turn a log line into a panic.
        .log_internal_errors(false)
        .init();
    match kvroute_sim::run(cli.args, shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute-sim: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
