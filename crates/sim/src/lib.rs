//! `kvroute-sim`: a fleet of simulated vLLM pods in one process.
//!
//! Each pod is an OpenAI-compatible HTTP server (`server`) in front of a pure, clock-driven
//! engine (`engine`) that models continuous batching, a KV block pool with prefix caching
//! (`kv`), recompute preemption, LoRA adapter slots with load times (`lora`) and step times from
//! a GPU roofline (`profile`). `/metrics` speaks vLLM's names (`metrics`); with vLLM's
//! `--kv-events-config`, each pod publishes its KV cache events over ZeroMQ (`kv_events`). Prompts
//! are tokenized by a synthetic tokenizer (`tokens`), or with `--tokenizer DIR` by the model's own,
//! as vLLM does (`tokenizer`). The clock runs `--speedup` times faster than the wall clock. See docs/simulator.md for the model and its limits.

mod api;
pub mod config;
pub mod engine;
pub mod fault;
pub mod kv;
pub mod kv_events;
pub mod lora;
pub mod metrics;
pub mod profile;
mod server;
pub mod stats;
pub mod tokenizer;
pub mod tokens;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

pub use config::{ConfigError, FleetConfig, PodConfig};
pub use server::{KvEventsEndpoints, SimFleet};

/// Flags of `kvroute-sim`.
#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Number of simulated pods.
    #[arg(long, env = "KVROUTE_SIM_PODS", default_value_t = 2)]
    pub pods: usize,
    /// Address the pods bind.
    #[arg(long, env = "KVROUTE_SIM_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// First port: pod i listens on PORT+i (0: an ephemeral port per pod).
    #[arg(long, env = "KVROUTE_SIM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Base model name served by every pod.
    #[arg(long, env = "KVROUTE_SIM_MODEL", default_value = config::DEFAULT_MODEL)]
    pub model: String,
    /// LoRA adapters the pods serve (comma-separated); loaded into GPU slots on demand.
    #[arg(long, env = "KVROUTE_SIM_LORA_ADAPTERS", value_delimiter = ',')]
    pub lora_adapters: Vec<String>,
    /// Adapters loaded into GPU slots at startup (comma-separated, among --lora-adapters).
    #[arg(long, env = "KVROUTE_SIM_PRELOAD_LORAS", value_delimiter = ',')]
    pub preload_loras: Vec<String>,
    /// GPU adapter slots: at most this many distinct adapters in a running batch (0: no LoRA).
    #[arg(long, env = "KVROUTE_SIM_MAX_LORAS", default_value_t = 4)]
    pub max_loras: usize,
    /// Adapters kept in host memory (reloading one of them costs only a PCIe copy) [default: max-loras].
    #[arg(long, env = "KVROUTE_SIM_MAX_CPU_LORAS")]
    pub max_cpu_loras: Option<usize>,
    /// Time to load an adapter that is not in host memory into a GPU slot, in milliseconds.
    #[arg(long, env = "KVROUTE_SIM_LORA_LOAD_MS", default_value_t = 150)]
    pub lora_load_ms: u64,
    /// KV blocks per pod [default: what the profile's GPU leaves at 0.9 memory utilisation].
    #[arg(long, env = "KVROUTE_SIM_NUM_GPU_BLOCKS")]
    pub num_gpu_blocks: Option<u32>,
    /// Tokens per KV block.
    #[arg(long, env = "KVROUTE_SIM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// Most sequences in one batch.
    #[arg(long, env = "KVROUTE_SIM_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one engine step (long prompts are prefilled in chunks of it).
    #[arg(
        long,
        env = "KVROUTE_SIM_MAX_NUM_BATCHED_TOKENS",
        default_value_t = 8192
    )]
    pub max_num_batched_tokens: u32,
    /// Longest prompt + output accepted [default: the profile's, capped by KV capacity].
    #[arg(long, env = "KVROUTE_SIM_MAX_MODEL_LEN")]
    pub max_model_len: Option<u32>,
    /// GPU + model profile timing the steps.
    #[arg(long, env = "KVROUTE_SIM_PROFILE", default_value = "h100-llama3-8b",
          value_parser = clap::builder::PossibleValuesParser::new(profile::Profile::NAMES))]
    pub profile: String,
    /// Simulated seconds per wall-clock second.
    #[arg(long, env = "KVROUTE_SIM_SPEEDUP", default_value_t = 1.0)]
    pub speedup: f64,
    /// Seed of step-time jitter and synthetic outputs.
    #[arg(long, env = "KVROUTE_SIM_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Relative standard deviation of step times.
    #[arg(long, env = "KVROUTE_SIM_JITTER", default_value_t = 0.02)]
    pub jitter: f64,
    /// Disable automatic prefix caching.
    #[arg(long, env = "KVROUTE_SIM_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,
    /// YAML file describing a heterogeneous fleet (see docs/simulator.md).
    #[arg(long, env = "KVROUTE_SIM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Index of the first pod (`x-sim-pod`, response ids, jitter seeds); for fleets run as
    /// one process per pod.
    #[arg(long, env = "KVROUTE_SIM_FIRST_POD_INDEX", default_value_t = 0)]
    pub first_pod_index: usize,
    /// Serve `POST /kvroute-sim/faults`, which switches a pod's `/metrics` into a failure
    /// mode (hang, garbage) and back; for fault tests.
    #[arg(long, env = "KVROUTE_SIM_FAULT_SWITCH")]
    pub fault_switch: bool,
    /// vLLM's KV events config (JSON with vLLM's fields), e.g. '{"enable_kv_cache_events":
    /// true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567", "topic": "kv"}':
    /// publish KV cache events over ZeroMQ; pod i uses each endpoint's port + i.
    #[arg(long, env = "KVROUTE_SIM_KV_EVENTS_CONFIG", value_name = "JSON",
          value_parser = kv_events::KvEventsConfig::from_json)]
    pub kv_events_config: Option<kv_events::KvEventsConfig>,
    /// Tokenize as vLLM does with this Hugging Face model directory's tokenizer (tokenizer.json;
    /// the chat template from chat_template.jinja or tokenizer_config.json) [default: a
    /// synthetic tokenizer of about four characters per token].
    #[arg(long, env = "KVROUTE_SIM_TOKENIZER", value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
}

/// `kvroute-sim`: starts the fleet, prints one line per pod, runs until `shutdown`.
pub async fn run(args: SimArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let config = FleetConfig::try_from(&args)?;
    let fleet = SimFleet::start(config.clone()).await?;
    let kv_events = fleet.kv_events_endpoints();
    for (i, (addr, pod)) in fleet.endpoints().iter().zip(&config.pods).enumerate() {
        let events = match kv_events.get(i).and_then(Option::as_ref) {
            Some(e) => format!(
                " kv_events={} kv_events_replay={}",
                e.endpoint,
                e.replay_endpoint.as_deref().unwrap_or("none")
            ),
            None => String::new(),
        };
        println!(
            "pod {}: http://{addr} profile={} num_gpu_blocks={} max_loras={} adapters={}{events}",
            config.first_pod_index + i,
            pod.profile.name,
            pod.engine.num_gpu_blocks,
            pod.engine.max_loras,
            pod.lora_adapters.join(",")
        );
    }
    shutdown.await;
    fleet.shutdown().await;
    Ok(())
}

/// Addresses of a fleet, for callers that want URLs.
pub fn urls(endpoints: &[SocketAddr]) -> Vec<String> {
    endpoints.iter().map(|a| format!("http://{a}")).collect()
}
