//! The `kvroute` command, the gateway: parse, build, run. The simulator is
//! `kvroute-sim`; benchmarks, comparisons and the demo are `kvroute-lab`.

use std::io::IsTerminal;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use kvroute::admin::tap::{EndpointsArgs, TapArgs};
use kvroute::app::{App, shutdown_signal};
use kvroute::config::{LogFormat, ServeArgs, ServeConfig};
use kvroute::tokenize::check::TokenizeArgs;

/// jemalloc, with its background threads purging freed pages, rather than the system
/// allocator: memory freed after a burst (a flood of streams, a wave of large bodies)
/// goes back to the system within seconds instead of staying in per-thread arenas
/// (docs/reliability.md has the measurement).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache and LoRA aware endpoint picker for LLM inference behind Envoy",
    after_help = "To try kvroute by hand: `kvroute-lab up` (scripts/up in a source tree). \
                  The simulator is `kvroute-sim`; `bench`, `compare` and `demo` are \
                  `kvroute-lab` subcommands. `kvroute sim|bench|compare|demo` runs them when \
                  they are installed beside kvroute (a source build), not in the image."
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
    /// Tokenize a request body's prompt as `serve --tokenizer DIR` does, and with
    /// --pod compare the tokens with the engine's own (exit status 1 if they differ).
    Tokenize(TokenizeArgs),
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

/// Subcommands of the one-binary days that now live in the laboratory binaries: the
/// program that runs them, and whether the subcommand's name stays on its command line.
const MOVED: [(&str, &str, bool); 4] = [
    ("sim", "kvroute-sim", false),
    ("bench", "kvroute-lab", true),
    ("compare", "kvroute-lab", true),
    ("demo", "kvroute-lab", true),
];

/// Runs a moved subcommand in place of this process, with the same arguments, when its
/// binary sits beside this one; otherwise says where it went. Returns only on failure.
fn forward_moved(subcommand: &str) -> Option<std::process::ExitCode> {
    use std::os::unix::process::CommandExt;

    let &(name, program, keep_name) = MOVED.iter().find(|(name, ..)| *name == subcommand)?;
    let sibling = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join(program)))
        .filter(|path| path.is_file());
    let Some(sibling) = sibling else {
        eprintln!(
            "kvroute: `{name}` is a command of `{program}`, which is not installed beside \
             kvroute (build it with `cargo build --release -p {program}`)"
        );
        return Some(std::process::ExitCode::from(2));
    };
    let skip = if keep_name { 1 } else { 2 };
    let error = std::process::Command::new(&sibling)
        .args(std::env::args_os().skip(skip))
        .exec();
    eprintln!("kvroute: cannot run {}: {error}", sibling.display());
    Some(std::process::ExitCode::FAILURE)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let first = std::env::args_os().nth(1);
    if let Some(code) = first.as_ref().and_then(|arg| forward_moved(arg.to_str()?)) {
        return code;
    }
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
        Command::Tokenize(args) => {
            init_logging(LogFormat::Text, "warn");
            match kvroute::tokenize::check::tokenize(args).await {
                // The tokens differ from the pod's: the report says where.
                Ok(false) => return std::process::ExitCode::FAILURE,
                Ok(true) => Ok(()),
                Err(error) => Err(error),
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
    kvroute::telemetry::register_allocator_stats(kvroute::telemetry::jemalloc_stats);
    let app = App::bind(config).await?;
    app.run(shutdown_signal()).await
}
