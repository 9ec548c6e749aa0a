//! The processes a soak runs and hurts: simulated pods (one `kvroute-sim` process each, so
//! one can be killed and started again on its port) and kvroute (`kvroute serve`, stopped
//! with SIGTERM or SIGKILL and started again on the same ports). Each is killed and reaped
//! when dropped: nothing outlives a run.

use std::fs::{File, OpenOptions};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use rustix::process::Signal;

use super::procstat::PidCell;
use crate::compare::routers::{KvEventTemplates, KvrouteTiming, wait_scraped};
use crate::process::Process;
use kvroute_sim::fault::{Faults, MetricsFault};

fn append_log(path: &Path) -> anyhow::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))
}

/// One simulated pod in its own `kvroute-sim` process.
pub struct SimPod {
    /// Its index (`x-sim-pod`).
    pub index: usize,
    /// Where it listens, across restarts.
    pub addr: SocketAddr,
    binary: PathBuf,
    speedup: f64,
    seed: u64,
    log: PathBuf,
    /// vLLM's `--kv-events-config`, when the pod publishes its KV cache events.
    kv_events: Option<String>,
    /// The model directory it tokenizes with, instead of the synthetic tokenizer.
    tokenizer: Option<PathBuf>,
    process: Option<Process>,
    client: reqwest::Client,
}

/// Longest a process may take to come up.
const START_LIMIT: Duration = Duration::from_secs(20);

impl SimPod {
    pub fn new(
        index: usize,
        addr: SocketAddr,
        binary: &Path,
        speedup: f64,
        seed: u64,
        log_dir: &Path,
    ) -> SimPod {
        SimPod {
            index,
            addr,
            binary: binary.to_path_buf(),
            speedup,
            seed,
            log: log_dir.join(format!("pod-{index}.log")),
            kv_events: None,
            tokenizer: None,
            process: None,
            client: reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap_or_default(),
        }
    }

    /// The pod publishes its KV cache events as vLLM does with `--kv-events-config`
    /// `config` (JSON), from every start on.
    pub fn with_kv_events(mut self, config: String) -> SimPod {
        self.kv_events = Some(config);
        self
    }

    /// The pod tokenizes with the model directory `dir` as vLLM does, from every start on.
    pub fn with_tokenizer(mut self, dir: &Path) -> SimPod {
        self.tokenizer = Some(dir.to_path_buf());
        self
    }

    /// Starts the pod on its port and waits until it answers `/health`.
    pub async fn start(&mut self) -> anyhow::Result<()> {
        let log = append_log(&self.log)?;
        let child = Command::new(&self.binary)
            .args(["--pods", "1", "--fault-switch"])
            .args(["--host", &self.addr.ip().to_string()])
            .args(["--port", &self.addr.port().to_string()])
            .args(["--first-pod-index", &self.index.to_string()])
            .args(["--speedup", &self.speedup.to_string()])
            .args(["--seed", &self.seed.to_string()])
            .args(
                self.kv_events
                    .iter()
                    .flat_map(|config| ["--kv-events-config", config.as_str()]),
            )
            .args(
                self.tokenizer
                    .iter()
                    .flat_map(|dir| [std::ffi::OsStr::new("--tokenizer"), dir.as_os_str()]),
            )
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot run {}", self.binary.display()))?;
        let mut process = Process(child);
        let url = format!("http://{}/health", self.addr);
        let deadline = Instant::now() + START_LIMIT;
        loop {
            if let Some(status) = process.exited() {
                anyhow::bail!(
                    "pod {} exited at start ({status}); see {}",
                    self.index,
                    self.log.display()
                );
            }
            if let Ok(response) = self.client.get(&url).send().await
                && response.status().is_success()
            {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "pod {} did not answer /health within {START_LIMIT:?}; see {}",
                self.index,
                self.log.display()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        self.process = Some(process);
        Ok(())
    }

    /// SIGKILL, and reaps it.
    pub fn kill(&mut self) {
        drop(self.process.take());
    }

    /// Its exit status if it exited without being told to.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.process.as_mut()?.exited()?;
        self.process = None;
        Some(status)
    }

    /// Switches how its `/metrics` answers.
    pub async fn set_metrics_fault(&self, metrics: MetricsFault) -> anyhow::Result<()> {
        let url = format!("http://{}/kvroute-sim/faults", self.addr);
        let response = self
            .client
            .post(&url)
            .json(&Faults { metrics })
            .send()
            .await
            .with_context(|| format!("pod {}: fault switch", self.index))?;
        anyhow::ensure!(
            response.status().is_success(),
            "pod {}: fault switch answered {}",
            self.index,
            response.status()
        );
        Ok(())
    }
}

/// How kvroute went away when told to.
#[derive(Debug, Clone)]
pub struct Stopped {
    /// Seconds from the signal to its exit.
    pub after_s: f64,
    /// Its exit status, in words; or that it had to be killed.
    pub how: String,
}

/// `kvroute serve` in its own process, on the same ports across restarts.
pub struct Kvroute {
    /// Its ext_proc gRPC address.
    pub grpc: SocketAddr,
    metrics: SocketAddr,
    debug: SocketAddr,
    binary: PathBuf,
    endpoints: String,
    pods: usize,
    timing: KvrouteTiming,
    drain: Duration,
    /// Where the pods publish their KV events, when kvroute follows them.
    kv_events: Option<KvEventTemplates>,
    /// The model directory kvroute tokenizes prompts with (`--tokenizer`), if any.
    tokenizer: Option<PathBuf>,
    log: PathBuf,
    process: Option<Process>,
    pid: PidCell,
}

impl Kvroute {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        binary: &Path,
        pods: &[SocketAddr],
        ports: [u16; 3],
        timing: KvrouteTiming,
        drain: Duration,
        log_dir: &Path,
        pid: PidCell,
    ) -> Kvroute {
        let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        Kvroute {
            grpc: at(ports[0]),
            metrics: at(ports[1]),
            debug: at(ports[2]),
            binary: binary.to_path_buf(),
            endpoints: pods
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
            pods: pods.len(),
            timing,
            drain,
            kv_events: None,
            tokenizer: None,
            log: log_dir.join("kvroute.log"),
            process: None,
            pid,
        }
    }

    /// kvroute follows the pods' KV events where `templates` say they publish them
    /// (`--prefix-source auto`), tokenizing prompts with the model directory `tokenizer`
    /// when given (else on a pod's `/tokenize`), from every start on.
    pub fn with_kv_events(
        mut self,
        templates: KvEventTemplates,
        tokenizer: Option<&Path>,
    ) -> Kvroute {
        self.kv_events = Some(templates);
        self.tokenizer = tokenizer.map(Path::to_path_buf);
        self
    }

    /// Its `/metrics` address.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics
    }

    /// Starts kvroute and waits until it has scraped every pod.
    pub async fn start(&mut self) -> anyhow::Result<()> {
        let log = append_log(&self.log)?;
        let millis = |d: Duration| format!("{}ms", d.as_millis().max(1));
        let child = Command::new(&self.binary)
            .args(["serve", "--endpoints", &self.endpoints])
            .args(["--grpc-addr", &self.grpc.to_string()])
            .args(["--metrics-addr", &self.metrics.to_string()])
            .args(["--debug-addr", &self.debug.to_string()])
            .args(["--health-addr", "off", "--admin-addr", "off"])
            .args([
                "--refresh-metrics-interval",
                &millis(self.timing.scrape_interval),
            ])
            .args(["--max-metrics-age", &millis(self.timing.max_metrics_age)])
            .args(["--drain-timeout", &millis(self.drain)])
            .args(
                self.kv_events
                    .iter()
                    .flat_map(KvEventTemplates::kvroute_args),
            )
            .args(
                self.tokenizer
                    .iter()
                    .map(|dir| format!("--tokenizer={}", dir.display())),
            )
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot run {} serve", self.binary.display()))?;
        let process = Process(child);
        self.pid.send_replace(Some(process.pid()));
        self.process = Some(process);
        wait_scraped(self.debug, self.pods, START_LIMIT)
            .await
            .with_context(|| {
                format!(
                    "kvroute did not scrape every pod; see {}",
                    self.log.display()
                )
            })
    }

    /// Sends `signal` and waits for the exit (SIGKILL after the drain and 5 s more).
    pub async fn stop(&mut self, signal: Signal) -> Stopped {
        let started = Instant::now();
        let Some(mut process) = self.process.take() else {
            return Stopped {
                after_s: 0.0,
                how: "was not running".into(),
            };
        };
        let how = match process.signal(signal) {
            Err(e) => format!("signal failed ({e}); killed"),
            Ok(()) => match process.wait_exit(self.drain + Duration::from_secs(5)).await {
                Some(status) => status.to_string(),
                None => format!(
                    "still running {:?} after the signal; killed",
                    self.drain + Duration::from_secs(5)
                ),
            },
        };
        drop(process);
        self.pid.send_replace(None);
        Stopped {
            after_s: started.elapsed().as_secs_f64(),
            how,
        }
    }

    /// Its exit status if it exited without being told to.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.process.as_mut()?.exited()?;
        self.process = None;
        self.pid.send_replace(None);
        Some(status)
    }
}
