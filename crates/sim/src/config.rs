//! Fleet configuration: from the `kvroute-sim` flags, optionally refined per pod by a YAML file.
//!
//! ```yaml
//! # every key optional; pod groups inherit the command-line values they do not set
//! model: meta-llama/Llama-3.1-8B-Instruct
//! tokenizer: /models/Llama-3.1-8B-Instruct   # as --tokenizer: shared by every pod
//! speedup: 10
//! seed: 7
//! pods:
//!   - count: 2
//!     profile: h100-llama3-8b
//!     num_gpu_blocks: 4000
//!     lora_adapters: [sql, chat]
//!     preload_loras: [sql]
//!   - profile: a100-llama3-8b
//!     max_loras: 2
//!     kv_events_config: {enable_kv_cache_events: true, endpoint: "tcp://*:5557"}
//! ```

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::SimArgs;
use super::engine::EngineConfig;
use super::kv_events::KvEventsConfig;
use super::kv_events::config::{PubTarget, clash};
use super::profile::Profile;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The profile name is not built in.
    #[error("unknown profile {0:?} (known: {known})", known = Profile::NAMES.join(", "))]
    UnknownProfile(String),
    /// The YAML file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML file does not parse.
    #[error("invalid config {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_norway::Error,
    },
    /// A value is out of range.
    #[error("{0}")]
    Invalid(String),
}

/// One simulated pod.
#[derive(Debug, Clone, PartialEq)]
pub struct PodConfig {
    /// GPU + model timing.
    pub profile: Profile,
    /// Scheduler and cache limits (its `seed` is derived from the fleet seed at start).
    pub engine: EngineConfig,
    /// Adapters the pod serves (`--lora-modules`): listed in `/v1/models`, loadable on demand.
    pub lora_adapters: Vec<String>,
    /// Adapters put in GPU slots at startup.
    pub preload_loras: Vec<String>,
    /// vLLM's KV events config (`--kv-events-config`); None: no events.
    pub kv_events: Option<KvEventsConfig>,
}

impl Default for PodConfig {
    fn default() -> PodConfig {
        let profile = Profile::by_name("h100-llama3-8b").unwrap_or_else(|| unreachable!());
        let engine = EngineConfig {
            num_gpu_blocks: profile.default_num_gpu_blocks(16),
            ..EngineConfig::default()
        };
        PodConfig {
            profile,
            engine,
            lora_adapters: Vec::new(),
            preload_loras: Vec::new(),
            kv_events: None,
        }
    }
}

/// A whole simulated fleet.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetConfig {
    /// Address to bind.
    pub host: IpAddr,
    /// First port; pod `i` listens on `port + i`. 0: each pod gets its own ephemeral port.
    pub port: u16,
    /// Base model name served by every pod.
    pub model: String,
    /// Simulated seconds per wall-clock second.
    pub speedup: f64,
    /// Seed of jitter and synthetic outputs.
    pub seed: u64,
    /// The pods.
    pub pods: Vec<PodConfig>,
    /// Index of the first pod (`x-sim-pod`, response ids, jitter seeds): a fleet started as
    /// one process per pod gives each process its pod's index, so the pods stay distinct
    /// and behave as they would in a single process.
    pub first_pod_index: usize,
    /// Serve `POST /kvroute-sim/faults` (see [`crate::fault`]): a test switches a pod's
    /// `/metrics` into a failure mode. Off by default: no pod has it unless asked.
    pub fault_switch: bool,
    /// Hugging Face model directory whose tokenizer every pod uses (`--tokenizer`, loaded
    /// once at start); None: the synthetic tokenizer of [`crate::tokens`].
    pub tokenizer: Option<PathBuf>,
}

/// The base model served when none is named.
pub const DEFAULT_MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

impl Default for FleetConfig {
    fn default() -> FleetConfig {
        FleetConfig {
            host: IpAddr::from([127, 0, 0, 1]),
            port: 0,
            model: DEFAULT_MODEL.to_string(),
            speedup: 1.0,
            seed: 0,
            pods: vec![PodConfig::default(); 2],
            first_pod_index: 0,
            fault_switch: false,
            tokenizer: None,
        }
    }
}

impl FleetConfig {
    /// `n` identical pods on ephemeral ports.
    pub fn uniform(n: usize, pod: PodConfig) -> FleetConfig {
        FleetConfig {
            pods: vec![pod; n],
            ..FleetConfig::default()
        }
    }

    /// Checks ranges and cross-field rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.pods.is_empty() {
            return bad("a fleet needs at least one pod".into());
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return bad(format!("speedup must be > 0, got {}", self.speedup));
        }
        if self.port != 0 && usize::from(self.port) + self.pods.len() - 1 > usize::from(u16::MAX) {
            return bad(format!(
                "ports {}..{} exceed 65535",
                self.port,
                usize::from(self.port) + self.pods.len() - 1
            ));
        }
        if self.model.is_empty() {
            return bad("model name is empty".into());
        }
        for (i, p) in self.pods.iter().enumerate() {
            let e = &p.engine;
            if e.block_size == 0 || e.num_gpu_blocks == 0 {
                return bad(format!(
                    "pod {i}: block_size and num_gpu_blocks must be > 0"
                ));
            }
            if e.max_num_seqs == 0 || e.max_num_batched_tokens == 0 {
                return bad(format!(
                    "pod {i}: max_num_seqs and max_num_batched_tokens must be > 0"
                ));
            }
            if !(0.0..=0.5).contains(&e.jitter) {
                return bad(format!("pod {i}: jitter must be in [0, 0.5]"));
            }
            if p.preload_loras.len() > e.max_loras {
                return bad(format!(
                    "pod {i}: {} preloaded adapters exceed max_loras {}",
                    p.preload_loras.len(),
                    e.max_loras
                ));
            }
            if let Some(a) = p
                .preload_loras
                .iter()
                .find(|a| !p.lora_adapters.contains(a))
            {
                return bad(format!(
                    "pod {i}: preloaded adapter {a:?} is not in lora_adapters"
                ));
            }
            if !p.lora_adapters.is_empty() && e.max_loras == 0 {
                return bad(format!("pod {i}: adapters given but max_loras is 0"));
            }
            if p.lora_adapters.iter().any(|a| a == &self.model) {
                return bad(format!("pod {i}: an adapter is named like the base model"));
            }
        }
        self.check_ports()
    }

    /// Checks that no two sockets of the fleet would bind one port: HTTP ports and each
    /// publishing pod's KV event endpoints (vLLM's defaults, 5557 and a replay port one
    /// above, collide from the second pod on).
    fn check_ports(&self) -> Result<(), ConfigError> {
        let mut bound: Vec<(usize, &'static str, SocketAddr)> = Vec::new();
        if self.port != 0 {
            for i in 0..self.pods.len() {
                let port = usize::from(self.port) + i;
                let port = u16::try_from(port).unwrap_or(u16::MAX);
                bound.push((i, "HTTP port", SocketAddr::new(self.host, port)));
            }
        }
        for (i, p) in self.pods.iter().enumerate() {
            let Some(kv) = &p.kv_events else { continue };
            let invalid = |e: super::kv_events::KvEventsError| {
                ConfigError::Invalid(format!("pod {i}: kv_events_config: {e}"))
            };
            kv.check().map_err(invalid)?;
            if !kv.publishes() {
                continue;
            }
            let endpoints = kv.endpoints_for(i).map_err(invalid)?;
            if let PubTarget::Bind(addr) = endpoints.publish {
                bound.push((i, "KV events endpoint", addr));
            }
            if let Some(addr) = endpoints.replay {
                bound.push((i, "KV events replay endpoint", addr));
            }
        }
        let mut by_port: HashMap<u16, Vec<(usize, &'static str, SocketAddr)>> = HashMap::new();
        for entry in bound {
            let same_port = by_port.entry(entry.2.port()).or_default();
            if let Some(other) = same_port.iter().find(|o| clash(o.2, entry.2)) {
                return Err(ConfigError::Invalid(format!(
                    "pod {}'s {} tcp://{} and pod {}'s {} tcp://{} take the same port \
                     (pod i binds each port + i: space the ports at least {} apart)",
                    other.0,
                    other.1,
                    other.2,
                    entry.0,
                    entry.1,
                    entry.2,
                    self.pods.len()
                )));
            }
            same_port.push(entry);
        }
        Ok(())
    }
}

/// The YAML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    model: Option<String>,
    tokenizer: Option<PathBuf>,
    speedup: Option<f64>,
    seed: Option<u64>,
    #[serde(default)]
    pods: Vec<PodGroup>,
}

/// A group of identical pods in the YAML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PodGroup {
    count: Option<usize>,
    profile: Option<String>,
    num_gpu_blocks: Option<u32>,
    block_size: Option<u32>,
    max_num_seqs: Option<usize>,
    max_num_batched_tokens: Option<u32>,
    max_loras: Option<usize>,
    max_cpu_loras: Option<usize>,
    lora_load_ms: Option<u64>,
    lora_adapters: Option<Vec<String>>,
    preload_loras: Option<Vec<String>>,
    jitter: Option<f64>,
    max_model_len: Option<u32>,
    enable_prefix_caching: Option<bool>,
    kv_events_config: Option<KvEventsConfig>,
}

fn profile(name: &str, max_model_len: Option<u32>) -> Result<Profile, ConfigError> {
    let mut p = Profile::by_name(name).ok_or_else(|| ConfigError::UnknownProfile(name.into()))?;
    if let Some(len) = max_model_len {
        p.max_model_len = len;
    }
    Ok(p)
}

fn pod_from_args(args: &SimArgs) -> Result<PodConfig, ConfigError> {
    let profile = profile(&args.profile, args.max_model_len)?;
    let num_gpu_blocks = args
        .num_gpu_blocks
        .unwrap_or_else(|| profile.default_num_gpu_blocks(args.block_size));
    Ok(PodConfig {
        engine: EngineConfig {
            num_gpu_blocks,
            block_size: args.block_size,
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_loras: args.max_loras,
            max_cpu_loras: args.max_cpu_loras.unwrap_or(args.max_loras),
            lora_load: Duration::from_millis(args.lora_load_ms),
            jitter: args.jitter,
            enable_prefix_caching: !args.no_prefix_caching,
            seed: 0,
            // The server's `/metrics` shows them.
            histograms: true,
            // The server streams them.
            token_events: true,
        },
        profile,
        lora_adapters: args.lora_adapters.clone(),
        preload_loras: args.preload_loras.clone(),
        kv_events: args.kv_events_config.clone(),
    })
}

fn apply(group: &PodGroup, base: &PodConfig) -> Result<PodConfig, ConfigError> {
    let mut p = base.clone();
    if let Some(name) = &group.profile {
        p.profile = profile(
            name,
            group.max_model_len.or(Some(base.profile.max_model_len)),
        )?;
    } else if let Some(len) = group.max_model_len {
        p.profile.max_model_len = len;
    }
    let e = &mut p.engine;
    if let Some(v) = group.block_size {
        e.block_size = v;
    }
    e.num_gpu_blocks = match (group.num_gpu_blocks, &group.profile) {
        (Some(v), _) => v,
        (None, Some(_)) => p.profile.default_num_gpu_blocks(e.block_size),
        (None, None) => e.num_gpu_blocks,
    };
    if let Some(v) = group.max_num_seqs {
        e.max_num_seqs = v;
    }
    if let Some(v) = group.max_num_batched_tokens {
        e.max_num_batched_tokens = v;
    }
    if let Some(v) = group.max_loras {
        e.max_loras = v;
        e.max_cpu_loras = e.max_cpu_loras.max(v);
    }
    if let Some(v) = group.max_cpu_loras {
        e.max_cpu_loras = v;
    }
    if let Some(v) = group.lora_load_ms {
        e.lora_load = Duration::from_millis(v);
    }
    if let Some(v) = group.jitter {
        e.jitter = v;
    }
    if let Some(v) = group.enable_prefix_caching {
        e.enable_prefix_caching = v;
    }
    if let Some(v) = &group.lora_adapters {
        p.lora_adapters = v.clone();
    }
    if let Some(v) = &group.preload_loras {
        p.preload_loras = v.clone();
    }
    if let Some(v) = &group.kv_events_config {
        p.kv_events = Some(v.clone());
    }
    Ok(p)
}

/// Reads a YAML fleet file on top of the flags.
pub fn load_file(path: &Path, args: &SimArgs) -> Result<FleetConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    from_yaml(&text, args).map_err(|e| match e {
        ConfigError::Parse { source, .. } => ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        },
        other => other,
    })
}

/// Parses YAML fleet text on top of the flags.
pub fn from_yaml(text: &str, args: &SimArgs) -> Result<FleetConfig, ConfigError> {
    let file: FileConfig = serde_norway::from_str(text).map_err(|source| ConfigError::Parse {
        path: PathBuf::from("<yaml>"),
        source,
    })?;
    let mut fleet = from_flags(args)?;
    let base = fleet.pods.first().cloned().unwrap_or_default();
    if let Some(m) = file.model {
        fleet.model = m;
    }
    if let Some(t) = file.tokenizer {
        fleet.tokenizer = Some(t);
    }
    if let Some(s) = file.speedup {
        fleet.speedup = s;
    }
    if let Some(s) = file.seed {
        fleet.seed = s;
    }
    if !file.pods.is_empty() {
        fleet.pods.clear();
        for g in &file.pods {
            let pod = apply(g, &base)?;
            for _ in 0..g.count.unwrap_or(1) {
                fleet.pods.push(pod.clone());
            }
        }
    }
    fleet.validate()?;
    Ok(fleet)
}

fn from_flags(args: &SimArgs) -> Result<FleetConfig, ConfigError> {
    let pod = pod_from_args(args)?;
    Ok(FleetConfig {
        host: args.host,
        port: args.port,
        model: args.model.clone(),
        speedup: args.speedup,
        seed: args.seed,
        pods: vec![pod; args.pods],
        first_pod_index: args.first_pod_index,
        fault_switch: args.fault_switch,
        tokenizer: args.tokenizer.clone(),
    })
}

impl TryFrom<&SimArgs> for FleetConfig {
    type Error = ConfigError;

    fn try_from(args: &SimArgs) -> Result<FleetConfig, ConfigError> {
        let fleet = match &args.config {
            Some(path) => load_file(path, args)?,
            None => from_flags(args)?,
        };
        fleet.validate()?;
        Ok(fleet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    fn args(extra: &[&str]) -> SimArgs {
        let mut argv = vec!["sim"];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).expect("flags parse").sim
    }

    #[test]
    fn flags_build_a_uniform_fleet() {
        let a = args(&[
            "--pods",
            "3",
            "--port",
            "9100",
            "--lora-adapters",
            "a,b",
            "--num-gpu-blocks",
            "500",
        ]);
        let fleet = FleetConfig::try_from(&a).expect("valid");
        assert_eq!(fleet.pods.len(), 3);
        assert_eq!(fleet.port, 9100);
        assert_eq!(fleet.pods[2].lora_adapters, vec!["a", "b"]);
        assert_eq!(fleet.pods[0].engine.num_gpu_blocks, 500);
    }

    #[test]
    fn yaml_groups_make_a_heterogeneous_fleet() {
        let a = args(&["--num-gpu-blocks", "1000", "--lora-adapters", "x"]);
        let yaml = "speedup: 5\npods:\n  - count: 2\n    num_gpu_blocks: 300\n    preload_loras: [x]\n  - profile: a100-llama3-8b\n";
        let fleet = from_yaml(yaml, &a).expect("valid");
        assert_eq!(fleet.pods.len(), 3);
        assert_eq!(fleet.speedup, 5.0);
        assert_eq!(fleet.pods[0].engine.num_gpu_blocks, 300);
        assert_eq!(fleet.pods[0].preload_loras, vec!["x"]);
        assert_eq!(fleet.pods[2].profile.name, "a100-llama3-8b");
        assert!(fleet.pods[2].engine.num_gpu_blocks > 20_000);
    }

    #[test]
    fn kv_events_come_from_vllms_flag_or_a_pod_group() {
        let json = r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:7000", "topic": "kv"}"#;
        let a = args(&["--pods", "2", "--kv-events-config", json]);
        let fleet = FleetConfig::try_from(&a).expect("valid");
        let kv = fleet.pods[1]
            .kv_events
            .as_ref()
            .expect("every pod publishes");
        assert!(kv.publishes());
        assert_eq!(kv.topic, "kv");

        let yaml = "pods:\n  - count: 2\n  - kv_events_config:\n      enable_kv_cache_events: true\n      endpoint: tcp://*:9000\n      replay_endpoint: tcp://*:9100\n";
        let fleet = from_yaml(yaml, &args(&[])).expect("valid");
        assert_eq!(fleet.pods[0].kv_events, None);
        let kv = fleet.pods[2].kv_events.as_ref().expect("the group's");
        assert_eq!(kv.replay_endpoint.as_deref(), Some("tcp://*:9100"));
        assert!(from_yaml("pods:\n  - kv_events_config: {topik: kv}\n", &args(&[])).is_err());
    }

    #[test]
    fn kv_event_ports_that_collide_are_refused() {
        // vLLM's usual pair, 5557 and 5558, collides from the second pod on.
        let json = r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}"#;
        let one = args(&["--pods", "1", "--kv-events-config", json]);
        assert!(FleetConfig::try_from(&one).is_ok());
        let two = args(&["--pods", "2", "--kv-events-config", json]);
        let err = FleetConfig::try_from(&two).expect_err("pod 1 publishes on pod 0's replay port");
        assert!(err.to_string().contains("take the same port"), "{err}");
        let http = args(&["--port", "5556", "--kv-events-config", json]);
        let err = FleetConfig::try_from(&http).expect_err("pod 1's HTTP port");
        assert!(err.to_string().contains("HTTP port"), "{err}");
        let off = r#"{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}"#;
        assert!(
            FleetConfig::try_from(&args(&["--kv-events-config", off])).is_ok(),
            "off binds nothing"
        );
    }

    #[test]
    fn the_tokenizer_comes_from_the_flag_or_the_file() {
        assert_eq!(
            FleetConfig::try_from(&args(&[])).expect("valid").tokenizer,
            None
        );
        let a = args(&["--tokenizer", "/models/a"]);
        let fleet = FleetConfig::try_from(&a).expect("valid");
        assert_eq!(fleet.tokenizer, Some(PathBuf::from("/models/a")));
        let fleet = from_yaml("tokenizer: /models/b\n", &a).expect("valid");
        assert_eq!(fleet.tokenizer, Some(PathBuf::from("/models/b")));
    }

    #[test]
    fn bad_values_are_refused_with_a_reason() {
        let a = args(&["--speedup", "0"]);
        assert!(FleetConfig::try_from(&a).is_err());
        let a = args(&["--preload-loras", "q"]);
        let err = FleetConfig::try_from(&a).expect_err("not an adapter");
        assert!(err.to_string().contains("not in lora_adapters"), "{err}");
        assert!(from_yaml("pods:\n  - colour: red\n", &args(&[])).is_err());
        assert!(from_yaml("pods:\n  - profile: tpu\n", &args(&[])).is_err());
    }
}
