//! `kvroute-lab up`: kvroute by hand. A small simulated vLLM fleet serving LoRA adapters,
//! kvroute, and Envoy running the shipped fail-closed gateway, on fixed, documented ports.
//! It prints what runs where and the `curl` lines to try, then waits; Ctrl-C (or SIGTERM)
//! stops everything and waits until it is gone.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use rustix::process::Signal;

use crate::compare::routers::{wait_answering, wait_scraped};
use crate::envoy::{EnvoyProcess, Gateway, envoy_binary};
use crate::process::Process;

/// Flags of `kvroute-lab up`. The ports default to the shipped configs' own (Envoy's
/// listener 8080 and admin 9901, kvroute's ext_proc 9002 and admin API 9004, which
/// `kvroute tap` and `kvroute endpoints` reach without flags).
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Port clients send requests to (Envoy's listener).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Envoy's admin port.
    #[arg(long, default_value_t = 9901)]
    pub envoy_admin_port: u16,
    /// kvroute's ext_proc gRPC port (Envoy calls it for every request).
    #[arg(long, default_value_t = 9002)]
    pub grpc_port: u16,
    /// kvroute's admin API port (`kvroute tap`, `kvroute endpoints`).
    #[arg(long, default_value_t = 9004)]
    pub admin_port: u16,
    /// kvroute's Prometheus port (`/metrics`).
    #[arg(long, default_value_t = 9090)]
    pub metrics_port: u16,
    /// kvroute's debug pages port (`/debug/decisions`, `/debug/endpoints`).
    #[arg(long, default_value_t = 9091)]
    pub debug_port: u16,
    /// Port of the first simulated pod; pod i listens on PORT+i.
    #[arg(long, default_value_t = 8000)]
    pub pods_port: u16,
    /// Simulated pods.
    #[arg(long, default_value_t = 2)]
    pub pods: u16,
    /// LoRA adapters every pod can serve (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "finance,legal,support")]
    pub adapters: Vec<String>,
    /// GPU adapter slots per pod: with 1, a pod serving one adapter must evict it (a
    /// cold load) to serve another, which kvroute avoids.
    #[arg(long, default_value_t = 1)]
    pub max_loras: u32,
    /// The pods publish their KV cache events as vLLM does (`--kv-events-config`) and
    /// kvroute matches prompts on them (`--prefix-source auto`).
    #[arg(long)]
    pub kv_events: bool,
    /// With --kv-events: the first pod's event publisher port (pod i on PORT+i).
    #[arg(long, default_value_t = 5557)]
    pub kv_events_port: u16,
    /// With --kv-events: the first pod's replay port (pod i on PORT+i).
    #[arg(long, default_value_t = 5567)]
    pub kv_events_replay_port: u16,
    /// With --kv-events: the pods tokenize with this Hugging Face model directory as vLLM
    /// does, and kvroute tokenizes prompts itself with it (`--tokenizer`) instead of
    /// asking a pod (e.g. crates/lab/tokenizers/bpe-4k).
    #[arg(long, requires = "kv_events")]
    pub tokenizer: Option<PathBuf>,
    /// Where the logs and Envoy's configuration go.
    #[arg(long, default_value = "kvroute-up")]
    pub log_dir: PathBuf,
    /// Envoy binary [default: $ENVOY_BIN, ./.venv/bin/envoy, envoy on PATH].
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// The gateway binary [default: `kvroute` beside this program].
    #[arg(long, env = "KVROUTE_BIN")]
    pub kvroute: Option<PathBuf>,
    /// The simulator binary [default: `kvroute-sim` beside this program].
    #[arg(long)]
    pub sim: Option<PathBuf>,
}

/// The flags of the ports `up` binds besides the pods', in [`UpArgs::ports`]' order.
pub const PORT_FLAGS: [&str; 6] = [
    "--port",
    "--envoy-admin-port",
    "--grpc-port",
    "--admin-port",
    "--metrics-port",
    "--debug-port",
];

impl UpArgs {
    /// The ports named by [`PORT_FLAGS`], in order.
    pub fn ports(&self) -> [u16; 6] {
        [
            self.port,
            self.envoy_admin_port,
            self.grpc_port,
            self.admin_port,
            self.metrics_port,
            self.debug_port,
        ]
    }
}

/// The model the simulated pods serve.
const MODEL: &str = kvroute_sim::config::DEFAULT_MODEL;

/// Line that ends the printed instructions; everything is up when it shows.
pub const READY_LINE: &str = "Ctrl-C stops everything.";

/// Longest a process may take to come up.
const START_LIMIT: Duration = Duration::from_secs(30);

/// How long kvroute may drain after SIGTERM (no request is open by then, usually).
const DRAIN: Duration = Duration::from_secs(2);

/// One thing to try, as printed: what it shows, and the shell command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Try {
    pub what: String,
    pub command: String,
}

/// The commands to try against a fleet started with `args`, in the order they make sense.
pub fn tries(args: &UpArgs) -> Vec<Try> {
    let gateway = format!("http://127.0.0.1:{}", args.port);
    let post = |path: &str, body: &str| {
        format!("curl -sS {gateway}{path} -H 'content-type: application/json' -d '{body}'")
    };
    let adapter = args.adapters.first().map_or("finance", String::as_str);
    let other_adapter = args.adapters.get(1).map_or(adapter, String::as_str);
    let mut tries = vec![
        Try {
            what: "A completion. The response headers name the pod that served it (x-sim-pod)."
                .into(),
            command: post(
                "/v1/completions",
                &format!(
                    r#"{{"model": "{MODEL}", "prompt": "The capital of France is", "max_tokens": 5}}"#
                ),
            )
            .replacen("curl -sS ", "curl -sS -i ", 1),
        },
        Try {
            what: "A chat completion.".into(),
            command: post(
                "/v1/chat/completions",
                &format!(
                    r#"{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 5}}"#
                ),
            ),
        },
        Try {
            what: format!(
                "A LoRA adapter, `{adapter}`: kvroute sends it to a pod that has it loaded, or has a free slot."
            ),
            command: post(
                "/v1/completions",
                &format!(r#"{{"model": "{adapter}", "prompt": "Quarterly revenue rose", "max_tokens": 5}}"#),
            ),
        },
        Try {
            what: format!(
                "Another adapter, `{other_adapter}`. In `kvroute tap` (the last command), each pod's adapter tier shows: one whose slot holds `{adapter}` ranks lower (`evict_idle` once `{adapter}` is idle, `must_evict` while it runs)."
            ),
            command: post(
                "/v1/completions",
                &format!(
                    r#"{{"model": "{other_adapter}", "prompt": "The contract states", "max_tokens": 5}}"#
                ),
            ),
        },
        Try {
            what: "Streaming: server-sent events, one per token.".into(),
            command: post(
                "/v1/completions",
                &format!(
                    r#"{{"model": "{MODEL}", "prompt": "Once upon a time", "max_tokens": 3, "stream": true}}"#
                ),
            )
            .replacen("curl -sS ", "curl -sS -N ", 1),
        },
        Try {
            what: "An error: a model no pod serves gets 404 with an OpenAI-style JSON body, from kvroute."
                .into(),
            command: post(
                "/v1/completions",
                r#"{"model": "no-such-model", "prompt": "Hi", "max_tokens": 5}"#,
            )
            .replacen("curl -sS ", "curl -sS -i ", 1),
        },
        Try {
            what: "kvroute's view of the pods: scraped metrics, loaded adapters, requests in flight."
                .into(),
            command: admin_command("endpoints", args.admin_port),
        },
        Try {
            what: "kvroute's own metrics: requests by model, adapter and outcome.".into(),
            command: format!(
                "curl -sS http://127.0.0.1:{}/metrics | grep '^kvroute_requests_total.* [1-9]'",
                args.metrics_port
            ),
        },
    ];
    tries.push(Try {
        what: "Every routing decision, live, with each candidate's score terms (leave it running and send requests from another terminal).".into(),
        command: admin_command("tap", args.admin_port),
    });
    tries
}

/// `kvroute <command>`, with `--admin-addr` only when the port is not the default.
fn admin_command(command: &str, admin_port: u16) -> String {
    if admin_port == 9004 {
        format!("kvroute {command}")
    } else {
        format!("kvroute {command} --admin-addr 127.0.0.1:{admin_port}")
    }
}

/// What runs where, and what to try; ends with [`READY_LINE`].
pub fn instructions(args: &UpArgs, on_path: bool) -> String {
    let pods: Vec<String> = (0..args.pods)
        .map(|i| {
            format!(
                "http://127.0.0.1:{}",
                u32::from(args.pods_port) + u32::from(i)
            )
        })
        .collect();
    let mut out = format!(
        "kvroute-lab up: {} simulated vLLM pods, kvroute, and Envoy with the shipped fail-closed gateway are running.\n\n",
        args.pods
    );
    out.push_str(&format!(
        "  clients  http://127.0.0.1:{}  (Envoy, envoy/gateway-original-dst.yaml; admin http://127.0.0.1:{})\n",
        args.port, args.envoy_admin_port
    ));
    out.push_str(&format!(
        "  kvroute  ext_proc 127.0.0.1:{}, admin API 127.0.0.1:{}, http://127.0.0.1:{}/metrics, http://127.0.0.1:{}/debug/decisions\n",
        args.grpc_port, args.admin_port, args.metrics_port, args.debug_port
    ));
    out.push_str(&format!(
        "  pods     {}  (kvroute-sim: {MODEL}; adapters {}; {} adapter slot(s) per pod)\n",
        pods.join(", "),
        args.adapters.join(", "),
        args.max_loras
    ));
    out.push_str(&format!(
        "  logs     {}/  (kvroute.log, envoy.log, envoy.yaml, pods.log)\n\n",
        args.log_dir.display()
    ));
    out.push_str("Try these from another terminal:\n\n");
    for t in tries(args) {
        out.push_str(&format!("# {}\n{}\n\n", t.what, t.command));
    }
    if !on_path {
        out.push_str(
            "(`kvroute` is not on PATH: scripts/install puts it there, or run target/release/kvroute.)\n\n",
        );
    }
    out.push_str(READY_LINE);
    out.push('\n');
    out
}

/// Fails with the flag to change when one of the ports is taken.
fn check_ports_free(args: &UpArgs) -> anyhow::Result<()> {
    let mut ports: Vec<(u16, &str)> = args.ports().into_iter().zip(PORT_FLAGS).collect();
    let mut ranges = vec![(args.pods_port, "--pods-port")];
    if args.kv_events {
        ranges.push((args.kv_events_port, "--kv-events-port"));
        ranges.push((args.kv_events_replay_port, "--kv-events-replay-port"));
    }
    for (first, flag) in ranges {
        for i in 0..args.pods {
            let port = u16::try_from(u32::from(first) + u32::from(i))
                .with_context(|| format!("{flag} + --pods runs past port 65535"))?;
            ports.push((port, flag));
        }
    }
    for (i, (port, flag)) in ports.iter().enumerate() {
        if ports[..i].iter().any(|(other, _)| other == port) {
            anyhow::bail!("port {port} is given twice; change {flag}");
        }
        TcpListener::bind(("127.0.0.1", *port)).map_err(|e| {
            anyhow::anyhow!(
                "port {port} is not free ({e}); is another `kvroute-lab up` running? Pass {flag} to use another"
            )
        })?;
    }
    Ok(())
}

/// kvroute's flags for following the pods' events: each pod's publisher and replay
/// ports sit at a fixed offset from its HTTP port.
fn kv_events_flags(args: &UpArgs) -> Vec<String> {
    if !args.kv_events {
        return Vec::new();
    }
    let shifted = |to: u16| crate::compare::port_shift_template(args.pods_port, to);
    let mut flags = vec![
        "--prefix-source=auto".into(),
        format!("--kv-events-endpoint={}", shifted(args.kv_events_port)),
        format!(
            "--kv-events-replay-endpoint={}",
            shifted(args.kv_events_replay_port)
        ),
    ];
    flags.extend(
        args.tokenizer
            .iter()
            .map(|dir| format!("--tokenizer={}", dir.display())),
    );
    flags
}

fn log_file(dir: &Path, name: &str) -> anyhow::Result<std::fs::File> {
    let path = dir.join(name);
    std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))
}

/// Whether `name` is an executable file in one of PATH's directories.
fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()))
}

/// Starts the fleet, kvroute and Envoy; prints the instructions; waits for Ctrl-C.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.pods > 0, "--pods must be at least 1");
    check_ports_free(&args)?;
    let dir = &args.log_dir;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let kvroute_bin = crate::gateway_binary_or(args.kvroute.as_deref())?;
    let sim_bin = crate::sim_binary_or(args.sim.as_deref())?;
    let envoy_bin = args.envoy.clone().unwrap_or_else(envoy_binary);
    let pods: Vec<SocketAddr> = (0..args.pods)
        .map(|i| SocketAddr::from(([127, 0, 0, 1], args.pods_port + i)))
        .collect();

    eprintln!(
        "starting {} simulated pods, kvroute and Envoy (logs in {}/)",
        args.pods,
        dir.display()
    );
    let mut sim = Process(
        Command::new(&sim_bin)
            .args(["--pods", &args.pods.to_string()])
            .args(["--port", &args.pods_port.to_string(), "--host", "127.0.0.1"])
            .args(["--lora-adapters", &args.adapters.join(",")])
            .args(["--max-loras", &args.max_loras.to_string()])
            .args(args.kv_events.then(|| {
                format!(
                    r#"--kv-events-config={{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{}", "replay_endpoint": "tcp://*:{}", "topic": "kv"}}"#,
                    args.kv_events_port, args.kv_events_replay_port
                )
            }))
            .args(
                args.tokenizer
                    .iter()
                    .map(|dir| format!("--tokenizer={}", dir.display())),
            )
            .env("RUST_LOG", "info")
            // Its own process group: a terminal's Ctrl-C reaches `up` alone, which then
            // stops Envoy first, lets kvroute drain, and the pods last.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(dir, "pods.log")?)
            .spawn()
            .with_context(|| format!("cannot run {}", sim_bin.display()))?,
    );
    let local = |port: u16| SocketAddr::from(([127, 0, 0, 1], port)).to_string();
    let endpoints: Vec<String> = pods.iter().map(ToString::to_string).collect();
    let mut kvroute = Process(
        Command::new(&kvroute_bin)
            .args(["serve", "--endpoints", &endpoints.join(",")])
            .args(["--grpc-addr", &local(args.grpc_port)])
            .args(["--admin-addr", &local(args.admin_port)])
            .args(["--metrics-addr", &local(args.metrics_port)])
            .args(["--debug-addr", &local(args.debug_port)])
            .args(["--health-addr", "off"])
            .args(["--drain-timeout", &format!("{}s", DRAIN.as_secs())])
            .args(["--drain-grace", "0s"])
            .args(kv_events_flags(&args))
            .env("RUST_LOG", "info")
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(dir, "kvroute.log")?)
            .spawn()
            .with_context(|| format!("cannot run {} serve", kvroute_bin.display()))?,
    );
    let debug = SocketAddr::from(([127, 0, 0, 1], args.debug_port));
    wait_scraped(debug, pods.len(), START_LIMIT)
        .await
        .with_context(|| {
            format!(
                "kvroute did not see every pod ready; see {0}/kvroute.log and {0}/pods.log",
                dir.display()
            )
        })?;
    let envoy = EnvoyProcess::start_on(
        Gateway::OriginalDst {
            kvroute: SocketAddr::from(([127, 0, 0, 1], args.grpc_port)),
        },
        &pods,
        &envoy_bin,
        "warning",
        args.port,
        args.envoy_admin_port,
    )
    .await?;
    // Keep Envoy's configuration beside the logs, for reading; its log is copied at the end.
    std::fs::copy(envoy.config_path(), dir.join("envoy.yaml"))
        .with_context(|| format!("cannot copy Envoy's config into {}", dir.display()))?;
    let base = envoy.url("");
    let mut children = [("the simulated pods", &mut sim), ("kvroute", &mut kvroute)];
    wait_answering(&base, MODEL, START_LIMIT, || {
        for (name, child) in children.iter_mut() {
            if let Some(status) = child.exited() {
                return Err(format!("{name} exited ({status})"));
            }
        }
        Ok(())
    })
    .await
    .context("the gateway did not answer a completion")?;

    let mut signals = StopSignals::listen()?;
    print!("{}", instructions(&args, on_path("kvroute")));
    use std::io::Write;
    let _ = std::io::stdout().flush();

    let ended = signals.wait(&mut sim, &mut kvroute).await;
    eprintln!("stopping Envoy, kvroute and the pods");
    let envoy_log = envoy.log_path();
    let _ = std::fs::copy(&envoy_log, dir.join("envoy.log"));
    drop(envoy);
    let _ = kvroute.signal(Signal::TERM);
    let kvroute_exit = kvroute.wait_exit(DRAIN + Duration::from_secs(3)).await;
    drop(kvroute);
    drop(sim);
    let log = std::fs::read_to_string(dir.join("kvroute.log")).unwrap_or_default();
    let last: Vec<&str> = log.lines().rev().take(3).collect();
    eprintln!("kvroute's last log lines ({}/kvroute.log):", dir.display());
    for line in last.iter().rev() {
        eprintln!("  {line}");
    }
    match (ended, kvroute_exit) {
        (Stop::Signal, Some(status)) if status.success() => {
            println!("stopped.");
            Ok(())
        }
        (Stop::Signal, Some(status)) => {
            anyhow::bail!("kvroute exited with {status} on SIGTERM; see its log")
        }
        (Stop::Signal, None) => anyhow::bail!("kvroute did not exit on SIGTERM; it was killed"),
        (Stop::Exited(what), _) => anyhow::bail!("{what}; everything else was stopped"),
    }
}

/// Why `up` stops.
enum Stop {
    /// Ctrl-C or SIGTERM.
    Signal,
    /// A child went away by itself.
    Exited(String),
}

/// Ctrl-C and SIGTERM, listened for from the moment this is made (before the
/// instructions are printed, so that no signal falls to the default action).
struct StopSignals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn listen() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(StopSignals {
            interrupt: signal(SignalKind::interrupt()).context("cannot listen for Ctrl-C")?,
            terminate: signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?,
        })
    }

    /// Waits for Ctrl-C or SIGTERM, or for a child to exit on its own.
    async fn wait(&mut self, sim: &mut Process, kvroute: &mut Process) -> Stop {
        let exited = async {
            loop {
                if let Some(status) = sim.exited() {
                    return format!("the simulated pods exited ({status}); see pods.log");
                }
                if let Some(status) = kvroute.exited() {
                    return format!("kvroute exited ({status}); see kvroute.log");
                }
                // Other processes: no event to await across the boundary, so poll.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::select! {
            _ = self.interrupt.recv() => Stop::Signal,
            _ = self.terminate.recv() => Stop::Signal,
            what = exited => Stop::Exited(what),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    fn args(extra: &[&str]) -> UpArgs {
        Cli::parse_from(std::iter::once("up").chain(extra.iter().copied())).up
    }

    #[test]
    fn the_instructions_name_every_port_and_end_with_the_ready_line() {
        let text = instructions(&args(&[]), true);
        for port in [
            "8080", "9901", "9002", "9004", "9090", "9091", "8000", "8001",
        ] {
            assert!(text.contains(port), "port {port} missing from:\n{text}");
        }
        assert!(text.ends_with(&format!("{READY_LINE}\n")));
        assert!(!text.contains("not on PATH"));
        assert!(instructions(&args(&[]), false).contains("not on PATH"));
    }

    #[test]
    fn every_try_goes_to_the_configured_ports() {
        let up = args(&[
            "--port",
            "18080",
            "--metrics-port",
            "19090",
            "--admin-port",
            "19004",
        ]);
        let tries = tries(&up);
        let curls: Vec<&Try> = tries
            .iter()
            .filter(|t| t.command.starts_with("curl "))
            .collect();
        assert_eq!(curls.len(), 7);
        for t in &curls[..6] {
            assert!(t.command.contains("http://127.0.0.1:18080/v1/"), "{t:?}");
        }
        assert!(curls[6].command.contains("127.0.0.1:19090/metrics"));
        let kvroute: Vec<&Try> = tries
            .iter()
            .filter(|t| t.command.starts_with("kvroute "))
            .collect();
        assert_eq!(kvroute.len(), 2);
        assert!(
            kvroute
                .iter()
                .all(|t| t.command.ends_with("--admin-addr 127.0.0.1:19004"))
        );
        // With the default admin port, the plain command reaches it.
        assert!(
            super::tries(&args(&[]))
                .iter()
                .any(|t| t.command == "kvroute tap")
        );
    }

    #[test]
    fn the_adapter_tries_name_the_configured_adapters() {
        let tries = tries(&args(&["--adapters", "a1,a2"]));
        assert!(tries.iter().any(|t| t.command.contains(r#""model": "a1""#)));
        assert!(tries.iter().any(|t| t.command.contains(r#""model": "a2""#)));
    }

    /// Arguments with every port free (the defaults may be taken on this machine).
    fn free_args(extra: &[&str]) -> UpArgs {
        // Every listener is held until all ports are chosen, so no two flags get the same
        // free port, and none gets a port `extra` already names (a test's own "free" port,
        // released before this call, may come back).
        let mut held = Vec::new();
        let mut free = || loop {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            let port = listener.local_addr().expect("addr").port().to_string();
            held.push(listener);
            if !extra.contains(&port.as_str()) {
                return port;
            }
        };
        let mut all: Vec<String> = extra.iter().map(ToString::to_string).collect();
        for flag in PORT_FLAGS.into_iter().chain(["--pods-port"]) {
            if !extra.contains(&flag) {
                all.extend([flag.to_string(), free()]);
            }
        }
        drop(held);
        all.extend(["--pods".into(), "1".into()]);
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        args(&refs)
    }

    #[test]
    fn a_port_in_use_is_refused_with_the_flag_to_change() {
        check_ports_free(&free_args(&[])).expect("all free");
        let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = taken.local_addr().expect("addr").port().to_string();
        let error = check_ports_free(&free_args(&["--metrics-port", &port]))
            .expect_err("the port is taken")
            .to_string();
        assert!(error.contains("--metrics-port"), "{error}");
        let twice = free_args(&[]);
        let debug = twice.debug_port.to_string();
        let error = check_ports_free(&free_args(&[
            "--debug-port",
            &debug,
            "--metrics-port",
            &debug,
        ]))
        .expect_err("one port for two servers")
        .to_string();
        assert!(error.contains("given twice"), "{error}");
    }

    #[test]
    fn with_kv_events_kvroute_is_told_where_each_pod_publishes() {
        assert!(kv_events_flags(&args(&[])).is_empty());
        let up = args(&[
            "--kv-events",
            "--pods-port",
            "8000",
            "--kv-events-port",
            "5557",
            "--kv-events-replay-port",
            "9000",
        ]);
        assert_eq!(
            kv_events_flags(&up),
            [
                "--prefix-source=auto",
                "--kv-events-endpoint=tcp://{host}:{port-2443}",
                "--kv-events-replay-endpoint=tcp://{host}:{port+1000}",
            ]
        );
        let tokenizing = args(&["--kv-events", "--tokenizer", "crates/lab/tokenizers/bpe-4k"]);
        assert_eq!(
            kv_events_flags(&tokenizing).last().map(String::as_str),
            Some("--tokenizer=crates/lab/tokenizers/bpe-4k")
        );
        // Without events kvroute has no use for a tokenizer.
        assert!(
            Cli::try_parse_from(["up", "--tokenizer", "crates/lab/tokenizers/bpe-4k"]).is_err()
        );
    }

    #[test]
    fn with_kv_events_a_taken_event_port_is_refused_with_its_flag() {
        let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = taken.local_addr().expect("addr").port().to_string();
        let free = crate::envoy::free_port().expect("a free port").to_string();
        let error = check_ports_free(&free_args(&[
            "--kv-events",
            "--kv-events-port",
            &free,
            "--kv-events-replay-port",
            &port,
        ]))
        .expect_err("the replay port is taken")
        .to_string();
        assert!(error.contains("--kv-events-replay-port"), "{error}");
        // Without --kv-events the event ports are not used, so not checked.
        check_ports_free(&free_args(&["--kv-events-replay-port", &port])).expect("not needed");
    }
}
