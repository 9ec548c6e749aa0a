//! The `kvroute` command: parse, build, run.

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use kvroute::app::App;
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
    Serve(ServeArgs),
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,h2=warn,tower=warn,hyper=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => {
            init_logging(args.log_format);
            match ServeConfig::from_args(&args) {
                Ok(config) => serve(config).await,
                Err(error) => Err(error.into()),
            }
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
