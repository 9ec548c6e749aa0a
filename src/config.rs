//! `kvroute serve` configuration: command-line flags (each with an environment
//! variable), an optional YAML file, and validation before anything binds a port.
//!
//! Precedence: a flag or environment variable beats the file, which beats the default.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::discovery::inference_pool::MAX_TARGET_PORTS;
use crate::discovery::{
    DiscoverySource, KubeTarget, KubernetesDiscovery, LabelSelector, PodTarget,
};
use kvroute_core::fleet::HealthPolicy;
use kvroute_core::scheduler::{Saturation, SchedulerConfig, Weights};

use crate::extproc::policy::DEFAULT_ALLOWED_PATHS;
use crate::flow::{FlowSettings, StandingQueue};
use crate::kvevents::{EndpointTemplate, KvEventsConfig, PrefixSource};
use crate::scrape::{ApiKey, ScrapeConfig};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is invalid: {source}")]
    Parse {
        path: PathBuf,
        source: serde_norway::Error,
    },
    #[error(
        "no endpoints: pass --endpoints IP:PORT,..., list `endpoints` in --config, \
         or discover them in Kubernetes with --pool-name or --endpoint-selector"
    )]
    NoEndpoints,
    #[error(
        "static endpoints (--endpoints or `endpoints` in --config) and Kubernetes discovery \
         (--pool-name, --endpoint-selector) exclude each other: use one"
    )]
    MixedDiscovery,
    #[error("invalid endpoint `{0}`: expected IP:PORT")]
    BadEndpoint(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Scheduler(#[from] kvroute_core::scheduler::InvalidConfig),
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Flags of `kvroute serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Pod endpoints (static discovery), comma-separated IP:PORT.
    #[arg(long, env = "KVROUTE_ENDPOINTS", value_delimiter = ',')]
    pub endpoints: Vec<SocketAddr>,
    /// YAML file with endpoints, scheduler weights and thresholds, and adapter → base map.
    #[arg(long, env = "KVROUTE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Kubernetes discovery: route to the pods and ports of this InferencePool
    /// (inference.networking.k8s.io/v1), followed live.
    #[arg(long, env = "KVROUTE_POOL_NAME")]
    pub pool_name: Option<String>,
    /// Namespace of the InferencePool or of the selected pods [default: the service
    /// account's namespace, or the kubeconfig context's].
    #[arg(long, env = "KVROUTE_POOL_NAMESPACE")]
    pub pool_namespace: Option<String>,
    /// Kubernetes discovery without the CRD: the pods with these labels, `k=v,...`.
    #[arg(long, env = "KVROUTE_ENDPOINT_SELECTOR", value_parser = parse_selector)]
    pub endpoint_selector: Option<LabelSelector>,
    /// The ports of each selected pod to route to (with --endpoint-selector).
    #[arg(long, env = "KVROUTE_ENDPOINT_TARGET_PORTS", value_delimiter = ',')]
    pub endpoint_target_ports: Vec<u16>,
    /// Address of the Envoy ext_proc gRPC service (also serves gRPC health).
    #[arg(long, env = "KVROUTE_GRPC_ADDR", default_value = "0.0.0.0:9002")]
    pub grpc_addr: SocketAddr,
    /// Address of a separate gRPC health endpoint for probes ("off" to disable).
    #[arg(long, env = "KVROUTE_HEALTH_ADDR", default_value = "0.0.0.0:9003", value_parser = parse_optional_addr)]
    pub health_addr: OptionalAddr,
    /// Address of kvroute's gRPC admin API (`kvroute tap`, `kvroute endpoints`); loopback
    /// by default, as decisions name models and pods ("off" to disable).
    #[arg(long, env = "KVROUTE_ADMIN_ADDR", default_value = "127.0.0.1:9004", value_parser = parse_optional_addr)]
    pub admin_addr: OptionalAddr,
    /// Address of the Prometheus exposition (/metrics).
    #[arg(long, env = "KVROUTE_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,
    /// Address of the debug pages (/debug/decisions, /debug/endpoints); loopback by
    /// default, as they name pods, models and token counts (`kubectl port-forward`
    /// reaches it), "off" to disable.
    #[arg(long, env = "KVROUTE_DEBUG_ADDR", default_value = "127.0.0.1:9091", value_parser = parse_optional_addr)]
    pub debug_addr: OptionalAddr,
    /// Request paths routed to pods, exact (a query string aside), comma-separated; any
    /// other path is answered 404 by kvroute, so clients cannot reach a pod's management
    /// API (LoRA loading, /metrics, profiling) through the gateway.
    #[arg(long, env = "KVROUTE_ALLOWED_PATHS", value_delimiter = ',',
          default_values_t = DEFAULT_ALLOWED_PATHS.map(String::from))]
    pub allowed_paths: Vec<String>,
    /// How often each pod's /metrics is polled.
    #[arg(long, env = "KVROUTE_REFRESH_METRICS_INTERVAL", default_value = "50ms", value_parser = humantime::parse_duration)]
    pub refresh_metrics_interval: Duration,
    /// Give up on a /metrics or /v1/models request after this long.
    #[arg(long, env = "KVROUTE_SCRAPE_TIMEOUT", default_value = "1s", value_parser = humantime::parse_duration)]
    pub scrape_timeout: Duration,
    /// How often each pod's /v1/models is polled (served base models and adapters).
    #[arg(long, env = "KVROUTE_REFRESH_MODELS_INTERVAL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub refresh_models_interval: Duration,
    /// Most scrapes in progress at once: a number, or `auto` (one per pod at a time, no
    /// overall cap, so pods whose /metrics hangs cannot hold up the others' scrapes).
    #[arg(long, env = "KVROUTE_SCRAPE_CONCURRENCY", default_value = "auto", value_parser = parse_scrape_concurrency)]
    pub scrape_concurrency: ScrapeConcurrency,
    /// Bearer token for the pods' /v1/models, when vLLM runs with --api-key (prefer the
    /// environment variable, from a Secret, to the flag).
    #[arg(long, env = "KVROUTE_POD_API_KEY", hide_env_values = true)]
    pub pod_api_key: Option<String>,
    /// PEM certificate chain of the ext_proc gRPC port: with --grpc-tls-key, gateways
    /// connect over TLS (the separate --health-addr port stays plain, for kubelet probes).
    #[arg(long, env = "KVROUTE_GRPC_TLS_CERT", requires = "grpc_tls_key")]
    pub grpc_tls_cert: Option<PathBuf>,
    /// PEM private key of --grpc-tls-cert.
    #[arg(long, env = "KVROUTE_GRPC_TLS_KEY", requires = "grpc_tls_cert")]
    pub grpc_tls_key: Option<PathBuf>,
    /// PEM CA bundle: gateways must present a client certificate it signed (mutual TLS).
    #[arg(long, env = "KVROUTE_GRPC_TLS_CLIENT_CA", requires = "grpc_tls_cert")]
    pub grpc_tls_client_ca: Option<PathBuf>,
    /// PEM CA bundle: scrape pods over HTTPS (vLLM started with --ssl-certfile), and with
    /// --prefix-source precise or auto tokenize prompts on them, trusting only these CAs.
    #[arg(long, env = "KVROUTE_POD_CA_BUNDLE")]
    pub pod_ca_bundle: Option<PathBuf>,
    /// Largest request body accepted (bytes; suffixes KiB, MiB, GiB); above it: 413.
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES", default_value = "16MiB", value_parser = parse_byte_size)]
    pub max_body_bytes: usize,
    /// Request bodies held at once across all streams while kvroute reads them; a request
    /// that would pass it gets 503 with retry-after, so a wave of large bodies cannot
    /// exhaust kvroute's memory.
    #[arg(long, env = "KVROUTE_MAX_HELD_BODY_BYTES", default_value = "1GiB", value_parser = parse_byte_size)]
    pub max_held_body_bytes: usize,
    /// A stream must deliver its whole request within this long of opening (Envoy sends
    /// the headers at once): then a request is answered 408, a silent stream closed.
    #[arg(long, env = "KVROUTE_REQUEST_READ_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub request_read_timeout: Duration,
    /// ext_proc streams that have sent nothing yet, across all connections; a stream
    /// opened beyond it is refused (RESOURCE_EXHAUSTED), so silent streams spread over many
    /// connections cannot hold more memory than this many (≈ 5.6 KiB each).
    #[arg(long, env = "KVROUTE_MAX_SILENT_STREAMS", default_value_t = crate::extproc::policy::DEFAULT_MAX_SILENT_STREAMS)]
    pub max_silent_streams: usize,
    /// Most ext_proc streams open at once on one gateway connection (HTTP/2
    /// SETTINGS_MAX_CONCURRENT_STREAMS); Envoy opens another connection beyond it, a
    /// client that floods one connection gets the rest refused.
    #[arg(
        long,
        env = "KVROUTE_GRPC_MAX_STREAMS_PER_CONNECTION",
        default_value_t = 1024
    )]
    pub grpc_max_streams_per_connection: u32,
    /// Consecutive failed scrapes that take a pod out of rotation.
    #[arg(long, env = "KVROUTE_UNHEALTHY_AFTER", default_value_t = 3)]
    pub unhealthy_after: u32,
    /// Consecutive successful scrapes that bring a pod back.
    #[arg(long, env = "KVROUTE_HEALTHY_AFTER", default_value_t = 2)]
    pub healthy_after: u32,
    /// A pod's metrics count fully up to this age; older, its KV and queue scores are
    /// scaled by max-metrics-age / age [default: 1s, or the config file's].
    #[arg(long, env = "KVROUTE_MAX_METRICS_AGE", value_parser = humantime::parse_duration)]
    pub max_metrics_age: Option<Duration>,
    /// Output tokens to expect when a request sets no max_tokens [default: 256].
    #[arg(long, env = "KVROUTE_DEFAULT_OUTPUT_TOKENS")]
    pub default_output_tokens: Option<u32>,
    /// Queued prefill tokens at which a pod's prefill-queue score halves [default: 4096].
    #[arg(long, env = "KVROUTE_PREFILL_QUEUE_TOKENS")]
    pub prefill_queue_tokens: Option<u32>,
    /// Fallback endpoints sent after the chosen one, for gateways that accept a list
    /// (override_host); ORIGINAL_DST needs a single endpoint [default: 0].
    #[arg(long, env = "KVROUTE_FALLBACKS")]
    pub fallbacks: Option<usize>,
    /// kvroute replicas behind the same gateways, this one included (each sees only the
    /// requests it routed, and counts the KV it sent a pod since the last scrape this many
    /// times) [default: 1].
    #[arg(long, env = "KVROUTE_REPLICAS")]
    pub replicas: Option<u32>,
    /// Longest a request waits at the gateway for a pod with room (flow control); then it
    /// is answered 429 (503 when no pod is ready). 0 turns the queue off: a request that
    /// fits no pod goes to the least loaded one. The gateway's ext_proc filter must allow
    /// this plus 1 s in `max_message_timeout` (the shipped configs allow up to 60 s).
    #[arg(long, env = "KVROUTE_MAX_QUEUE_WAIT", default_value = "15s", value_parser = humantime::parse_duration)]
    pub max_queue_wait: Duration,
    /// While the gateway's queue has not emptied for --standing-queue-after, a request that
    /// has waited this long is answered 429 at once rather than after --max-queue-wait: a
    /// queue that never empties is running behind the pods, and its requests would all wait
    /// out the longer bound. 0 turns this off.
    #[arg(long, env = "KVROUTE_STANDING_QUEUE_WAIT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub standing_queue_wait: Duration,
    /// How long the queue must hold requests without a break before --standing-queue-wait
    /// applies (a burst shorter than this waits up to --max-queue-wait). 0 turns it off.
    #[arg(long, env = "KVROUTE_STANDING_QUEUE_AFTER", default_value = "5s", value_parser = humantime::parse_duration)]
    pub standing_queue_after: Duration,
    /// Most requests waiting at the gateway at once; beyond it a request that fits no pod
    /// is answered 429 at once.
    #[arg(long, env = "KVROUTE_MAX_QUEUE_LENGTH", default_value_t = crate::flow::DEFAULT_MAX_WAITING)]
    pub max_queue_length: usize,
    /// With no ready pod for a request, answer 503 at once instead of holding it up to
    /// --max-queue-wait for a pod to come up (scale from zero, a rollout).
    #[arg(long, env = "KVROUTE_NO_WAIT_FOR_ENDPOINTS")]
    pub no_wait_for_endpoints: bool,
    /// Priority of each inference objective (the x-gateway-inference-objective header), as
    /// NAME=PRIORITY, comma-separated or repeated: higher is served first, negative is
    /// sheddable (429 when no pod has room, never queued). Objectives not listed: 0.
    #[arg(long, env = "KVROUTE_OBJECTIVE_PRIORITY", value_delimiter = ',', value_parser = crate::flow::parse_objective)]
    pub objective_priority: Vec<(String, i32)>,
    /// Keep the last N decisions with their scores at GET /debug/decisions (0: off).
    #[arg(long, env = "KVROUTE_DEBUG_DECISIONS", default_value_t = 0)]
    pub debug_decisions: usize,
    /// Memory for remembering which prompt blocks went to which pod (prefix affinity),
    /// in MiB. Past it, each pod keeps its most recently sent blocks, an equal share
    /// each. The default holds ~4.2 million (pod, block) pairs: ~67k tokens per pod at
    /// 1,000 pods, ~670k at 100.
    #[arg(long, env = "KVROUTE_PREFIX_INDEX_MIB", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub prefix_index_mib: u32,
    /// Where prefix matches come from: `approximate`, what kvroute sent to each pod;
    /// `precise`, the pods' KV events (vLLM --kv-events-config), for every pod; `auto`,
    /// the events of pods whose events flow and what kvroute sent for the others. With
    /// events, each prompt is tokenized on a pod's /tokenize before it is placed.
    #[arg(long, env = "KVROUTE_PREFIX_SOURCE", default_value = "approximate", value_parser = crate::kvevents::parse_prefix_source)]
    pub prefix_source: PrefixSource,
    /// Each pod's KV event publisher (vLLM's `endpoint`, bound on every pod): `{host}` is
    /// the pod's IP, `{port}` its HTTP port, `{port+N}` / `{port-N}` that port shifted.
    #[arg(long, env = "KVROUTE_KV_EVENTS_ENDPOINT", default_value = "tcp://{host}:5557", value_parser = parse_template)]
    pub kv_events_endpoint: EndpointTemplate,
    /// Each pod's replay socket (vLLM's `replay_endpoint`), asked for batches kvroute
    /// missed; `none`: gaps are repaired by dropping the pod's entries.
    #[arg(long, env = "KVROUTE_KV_EVENTS_REPLAY_ENDPOINT", default_value = "tcp://{host}:5558", value_parser = parse_optional_template)]
    pub kv_events_replay_endpoint: OptionalTemplate,
    /// The topic prefix subscribed to (vLLM's `topic`; empty: all).
    #[arg(long, env = "KVROUTE_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,
    /// Data-parallel engines per pod (vLLM `--data-parallel-size`): rank r publishes on
    /// each endpoint's port + r, and a pod holds a block while any of its engines does.
    #[arg(long, env = "KVROUTE_KV_EVENTS_DP_RANKS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub kv_events_dp_ranks: u32,
    /// Memory for the index built from KV events, in MiB (the same layout and bounds as
    /// --prefix-index-mib's).
    #[arg(long, env = "KVROUTE_KV_EVENTS_INDEX_MIB", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub kv_events_index_mib: u32,
    /// Longest wait for a pod to tokenize a prompt; past it the request is placed on the
    /// approximate index.
    #[arg(long, env = "KVROUTE_TOKENIZE_TIMEOUT", default_value = "100ms", value_parser = humantime::parse_duration)]
    pub tokenize_timeout: Duration,
    /// `[MODEL=]DIR`: the model's Hugging Face directory (`tokenizer.json`, and
    /// `tokenizer_config.json` or `chat_template.jinja` for chats), so that kvroute
    /// tokenizes prompts itself instead of asking a pod's /tokenize (no round trip).
    /// Without `MODEL=` it serves every model; repeat for several (comma-separated in
    /// the environment). Requests it cannot render exactly (tools, documents, their own
    /// chat template) still go to a pod's /tokenize. Needs --prefix-source precise or auto.
    #[arg(long = "tokenizer", env = "KVROUTE_TOKENIZER", value_delimiter = ',')]
    pub tokenizers: Vec<crate::tokenize::TokenizerSpec>,
    /// Memory for the tokens of the texts --tokenizer has encoded, in MiB (shared system
    /// prompts and contexts are encoded once, then copied; short texts such as headers
    /// and tool calls in a sixteenth of it, apart; the least recently used are forgotten
    /// first); 0 encodes every prompt whole.
    #[arg(long, env = "KVROUTE_TOKENIZER_CACHE_MIB", default_value_t = 64)]
    pub tokenizer_cache_mib: u32,
    /// Check --tokenizer against the engine on the first prompt of each model and then on
    /// every Nth (prompts with tools counted apart): the prompt is also sent to the pod's
    /// /tokenize in the background, and a difference (a directory that is not the model's,
    /// a template the engine renders otherwise) stops local tokenization for that model
    /// (for its prompts with tools only, where the prompt had tools), logged and counted,
    /// so that the pods tokenize those prompts instead. 0: never check.
    #[arg(long, env = "KVROUTE_TOKENIZER_CHECK_EVERY", default_value_t = 1000)]
    pub tokenizer_check_every: u64,
    /// Connections each listener (ext_proc, health, admin, metrics, debug) holds open at
    /// most; past it a new connection is closed on arrival and counted. A gateway opens a
    /// few per Envoy worker.
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// On shutdown, let open request streams finish for up to this long.
    #[arg(long, env = "KVROUTE_DRAIN_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// On shutdown, keep taking new request streams for this long (at most the drain
    /// timeout) while gateways notice readiness is off; after it, the drain ends as soon
    /// as no stream is open. The default covers the shipped gateways' health checks
    /// (two missed, a second apart).
    #[arg(long, env = "KVROUTE_DRAIN_GRACE", default_value = "3s", value_parser = humantime::parse_duration)]
    pub drain_grace: Duration,
    /// A series no one has updated for this long leaves /metrics: the per-pod series of a
    /// pod that left the fleet (updated at every scrape while it is there), those of a
    /// model no longer requested.
    #[arg(long, env = "KVROUTE_IDLE_GAUGE_TIMEOUT", default_value = "2m", value_parser = humantime::parse_duration)]
    pub idle_gauge_timeout: Duration,
    /// HTTP/2 ping interval on gRPC connections (ext_proc, health, admin); also the TCP
    /// keepalive time. A gateway that vanishes without closing its connection is noticed
    /// within this plus --grpc-keepalive-timeout, and its requests' accounting released.
    #[arg(long, env = "KVROUTE_GRPC_KEEPALIVE_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub grpc_keepalive_interval: Duration,
    /// How long an unanswered ping may wait before the connection is closed.
    #[arg(long, env = "KVROUTE_GRPC_KEEPALIVE_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub grpc_keepalive_timeout: Duration,
    /// Log format.
    #[arg(long, env = "KVROUTE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

fn parse_selector(text: &str) -> Result<LabelSelector, String> {
    text.parse().map_err(|e| format!("{e}"))
}

/// Kubernetes discovery from the flags, if any of its flags is given.
fn kubernetes_from_args(args: &ServeArgs) -> Result<Option<KubernetesDiscovery>, ConfigError> {
    let invalid = |msg: &str| Err(ConfigError::Invalid(msg.to_owned()));
    let target = match (&args.pool_name, &args.endpoint_selector) {
        (Some(_), Some(_)) => {
            return invalid("--pool-name and --endpoint-selector exclude each other: use one");
        }
        (Some(name), None) => {
            if !args.endpoint_target_ports.is_empty() {
                return invalid(
                    "--endpoint-target-ports goes with --endpoint-selector; \
                     an InferencePool names its own targetPorts",
                );
            }
            KubeTarget::Pool { name: name.clone() }
        }
        (None, Some(selector)) => {
            if args.endpoint_target_ports.is_empty() {
                return invalid("--endpoint-selector needs --endpoint-target-ports PORT,...");
            }
            KubeTarget::Pods(PodTarget::new(
                selector.clone(),
                args.endpoint_target_ports.clone(),
            ))
        }
        (None, None) => {
            if !args.endpoint_target_ports.is_empty() {
                return invalid("--endpoint-target-ports needs --endpoint-selector");
            }
            if args.pool_namespace.is_some() {
                return invalid("--pool-namespace needs --pool-name or --endpoint-selector");
            }
            return Ok(None);
        }
    };
    Ok(Some(KubernetesDiscovery {
        namespace: args.pool_namespace.clone(),
        target,
        client: None,
    }))
}

/// A bound on scrapes in flight; `None` (`auto`): one per pod, no overall cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrapeConcurrency(pub Option<usize>);

fn parse_scrape_concurrency(text: &str) -> Result<ScrapeConcurrency, String> {
    if text.eq_ignore_ascii_case("auto") {
        return Ok(ScrapeConcurrency(None));
    }
    text.parse()
        .map(|bound| ScrapeConcurrency(Some(bound)))
        .map_err(|e| format!("`{text}`: {e} (expected a number or auto)"))
}

/// An address that can be switched off with `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionalAddr(pub Option<SocketAddr>);

fn parse_optional_addr(text: &str) -> Result<OptionalAddr, String> {
    if text.eq_ignore_ascii_case("off") {
        return Ok(OptionalAddr(None));
    }
    text.parse()
        .map(|addr| OptionalAddr(Some(addr)))
        .map_err(|e| format!("`{text}`: {e} (expected IP:PORT or off)"))
}

/// Parses `1048576`, `512KiB`, `16MiB`, `1GiB` (also KB/MB/GB as powers of 1000).
pub fn parse_byte_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}`: expected a byte count such as 16MiB"))?;
    let multiplier: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "`{text}`: unknown unit `{other}` (use B, KiB, MiB, GiB)"
            ));
        }
    };
    number
        .checked_mul(multiplier)
        .and_then(|bytes| usize::try_from(bytes).ok())
        .ok_or_else(|| format!("`{text}` is too large"))
}

/// The YAML file. Every field is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileConfig {
    pub endpoints: Vec<String>,
    pub scheduler: FileScheduler,
    /// LoRA adapter name → base model.
    pub adapters: HashMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileScheduler {
    pub weights: Option<Weights>,
    pub saturation: Option<Saturation>,
    #[serde(with = "humantime_serde_opt")]
    pub max_metrics_age: Option<Duration>,
    pub default_output_tokens: Option<u32>,
    pub prefill_queue_tokens: Option<u32>,
    pub fallbacks: Option<usize>,
    pub replicas: Option<u32>,
}

/// `"1s"`-style durations in YAML.
mod humantime_serde_opt {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text: Option<String> = Option::deserialize(d)?;
        text.map(|t| humantime::parse_duration(&t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        serde_norway::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })
    }
}

/// Validated configuration of `kvroute serve`.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub grpc_addr: SocketAddr,
    pub health_addr: Option<SocketAddr>,
    /// The gRPC admin API (decision tap, endpoint list); `None`: off.
    pub admin_addr: Option<SocketAddr>,
    pub metrics_addr: SocketAddr,
    /// The debug pages; `None`: off.
    pub debug_addr: Option<SocketAddr>,
    /// See [`ServeArgs::allowed_paths`].
    pub allowed_paths: Vec<String>,
    /// Static discovery: the endpoints (empty with Kubernetes discovery).
    pub endpoints: Vec<SocketAddr>,
    /// Kubernetes discovery, instead of `endpoints`.
    pub kubernetes: Option<KubernetesDiscovery>,
    pub scrape: ScrapeConfig,
    pub scheduler: SchedulerConfig,
    pub health: HealthPolicy,
    pub max_body_bytes: usize,
    /// See [`ServeArgs::max_held_body_bytes`].
    pub max_held_body_bytes: usize,
    /// See [`ServeArgs::request_read_timeout`].
    pub request_read_timeout: Duration,
    /// See [`ServeArgs::max_silent_streams`].
    pub max_silent_streams: usize,
    /// See [`ServeArgs::grpc_max_streams_per_connection`].
    pub grpc_max_streams_per_connection: u32,
    pub debug_decisions: usize,
    /// Flow control: the gateway queue, priorities, tenants.
    pub flow: FlowSettings,
    /// See [`ServeArgs::prefix_index_mib`]; in bytes.
    pub prefix_index_bytes: usize,
    /// See [`ServeArgs::prefix_source`].
    pub prefix_source: PrefixSource,
    /// How the pods' KV events are followed (used unless the source is approximate).
    pub kv_events: KvEventsConfig,
    /// See [`ServeArgs::kv_events_index_mib`]; in bytes.
    pub kv_events_index_bytes: usize,
    /// See [`ServeArgs::tokenize_timeout`].
    pub tokenize_timeout: Duration,
    /// See [`ServeArgs::tokenizers`].
    pub tokenizers: Vec<crate::tokenize::TokenizerSpec>,
    /// See [`ServeArgs::tokenizer_cache_mib`]; in bytes.
    pub tokenizer_cache_bytes: usize,
    /// See [`ServeArgs::tokenizer_check_every`].
    pub tokenizer_check_every: u64,
    pub drain_timeout: Duration,
    /// See [`ServeArgs::max_connections`].
    pub max_connections: usize,
    /// See [`ServeArgs::drain_grace`].
    pub drain_grace: Duration,
    /// See [`ServeArgs::idle_gauge_timeout`].
    pub idle_gauge_timeout: Duration,
    pub grpc_keepalive: GrpcKeepalive,
    /// TLS on the ext_proc port; `None`: plain HTTP/2.
    pub grpc_tls: Option<GrpcTls>,
}

/// `--kv-events-replay-endpoint`: a template, or `none`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionalTemplate(pub Option<EndpointTemplate>);

fn parse_template(value: &str) -> Result<EndpointTemplate, String> {
    EndpointTemplate::parse(value).map_err(|e| e.to_string())
}

fn parse_optional_template(value: &str) -> Result<OptionalTemplate, String> {
    if value == "none" {
        return Ok(OptionalTemplate(None));
    }
    parse_template(value).map(|t| OptionalTemplate(Some(t)))
}

/// The ext_proc port's TLS: its certificate, and the CA that signs gateways' client
/// certificates when they must present one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// Liveness checks on accepted gRPC connections: no request's accounting outlives its
/// gateway connection by more than `interval + timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcKeepalive {
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for GrpcKeepalive {
    fn default() -> Self {
        GrpcKeepalive {
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(10),
        }
    }
}

impl ServeConfig {
    /// Defaults for an embedded server on loopback ephemeral ports (tests, demos).
    pub fn local(endpoints: Vec<SocketAddr>) -> Self {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        ServeConfig {
            grpc_addr: loopback,
            health_addr: None,
            admin_addr: None,
            metrics_addr: loopback,
            debug_addr: Some(loopback),
            allowed_paths: DEFAULT_ALLOWED_PATHS.map(String::from).to_vec(),
            endpoints,
            kubernetes: None,
            scrape: ScrapeConfig::default(),
            scheduler: SchedulerConfig::default(),
            health: HealthPolicy::default(),
            max_body_bytes: 16 << 20,
            max_held_body_bytes: crate::extproc::policy::DEFAULT_HELD_BODY_BUDGET,
            request_read_timeout: crate::extproc::policy::DEFAULT_READ_TIMEOUT,
            max_silent_streams: crate::extproc::policy::DEFAULT_MAX_SILENT_STREAMS,
            grpc_max_streams_per_connection: 1024,
            debug_decisions: 0,
            flow: FlowSettings::default(),
            prefix_index_bytes: kvroute_core::fleet::DEFAULT_PREFIX_BUDGET_BYTES,
            prefix_source: PrefixSource::Approximate,
            kv_events: KvEventsConfig::default(),
            kv_events_index_bytes: kvroute_core::fleet::DEFAULT_PREFIX_BUDGET_BYTES,
            tokenize_timeout: Duration::from_millis(100),
            tokenizers: Vec::new(),
            tokenizer_cache_bytes: 64 << 20,
            tokenizer_check_every: 1000,
            drain_timeout: Duration::from_secs(10),
            drain_grace: Duration::from_secs(3),
            max_connections: 4096,
            idle_gauge_timeout: crate::telemetry::GAUGE_IDLE_TIMEOUT,
            grpc_keepalive: GrpcKeepalive::default(),
            grpc_tls: None,
        }
    }

    /// Merges flags and the optional file, then validates.
    pub fn from_args(args: &ServeArgs) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        let kubernetes = kubernetes_from_args(args)?;
        if kubernetes.is_some() && !(args.endpoints.is_empty() && file.endpoints.is_empty()) {
            return Err(ConfigError::MixedDiscovery);
        }
        let endpoints = if args.endpoints.is_empty() {
            file.endpoints
                .iter()
                .map(|text| {
                    text.trim()
                        .parse()
                        .map_err(|_| ConfigError::BadEndpoint(text.clone()))
                })
                .collect::<Result<Vec<SocketAddr>, _>>()?
        } else {
            args.endpoints.clone()
        };
        let defaults = SchedulerConfig::default();
        let scheduler = SchedulerConfig {
            weights: file.scheduler.weights.unwrap_or(defaults.weights),
            saturation: file.scheduler.saturation.unwrap_or(defaults.saturation),
            max_metrics_age: args
                .max_metrics_age
                .or(file.scheduler.max_metrics_age)
                .unwrap_or(defaults.max_metrics_age),
            default_output_tokens: args
                .default_output_tokens
                .or(file.scheduler.default_output_tokens)
                .unwrap_or(defaults.default_output_tokens),
            prefill_queue_tokens: args
                .prefill_queue_tokens
                .or(file.scheduler.prefill_queue_tokens)
                .unwrap_or(defaults.prefill_queue_tokens),
            fallbacks: args
                .fallbacks
                .or(file.scheduler.fallbacks)
                .unwrap_or(defaults.fallbacks),
            trace_candidates: defaults.trace_candidates,
            adapters: file.adapters,
            keep_free: defaults.keep_free,
            keep_free_tokens: defaults.keep_free_tokens,
            replicas: args
                .replicas
                .or(file.scheduler.replicas)
                .unwrap_or(defaults.replicas),
        };
        let mut objectives = HashMap::new();
        for (name, priority) in &args.objective_priority {
            if objectives.insert(name.clone(), *priority).is_some() {
                return Err(ConfigError::Invalid(format!(
                    "--objective-priority names the objective `{name}` twice"
                )));
            }
        }
        let config = ServeConfig {
            grpc_addr: args.grpc_addr,
            health_addr: args.health_addr.0,
            admin_addr: args.admin_addr.0,
            metrics_addr: args.metrics_addr,
            debug_addr: args.debug_addr.0,
            allowed_paths: args.allowed_paths.clone(),
            endpoints,
            kubernetes,
            scrape: ScrapeConfig {
                interval: args.refresh_metrics_interval,
                timeout: args.scrape_timeout,
                models_interval: args.refresh_models_interval,
                concurrency: args.scrape_concurrency.0,
                pod_api_key: args.pod_api_key.clone().map(ApiKey),
                pod_ca_bundle: args.pod_ca_bundle.clone(),
                ..ScrapeConfig::default()
            },
            scheduler,
            health: HealthPolicy {
                failures_to_mark_down: args.unhealthy_after,
                successes_to_mark_up: args.healthy_after,
            },
            max_body_bytes: args.max_body_bytes,
            max_held_body_bytes: args.max_held_body_bytes,
            request_read_timeout: args.request_read_timeout,
            max_silent_streams: args.max_silent_streams,
            grpc_max_streams_per_connection: args.grpc_max_streams_per_connection,
            debug_decisions: args.debug_decisions,
            flow: FlowSettings {
                max_wait: args.max_queue_wait,
                max_waiting: args.max_queue_length,
                hold_without_endpoints: !args.no_wait_for_endpoints,
                objectives,
                standing: StandingQueue::from_flags(
                    args.standing_queue_after,
                    args.standing_queue_wait,
                ),
            },
            prefix_index_bytes: (args.prefix_index_mib as usize) << 20,
            prefix_source: args.prefix_source,
            kv_events: KvEventsConfig {
                endpoint: args.kv_events_endpoint.clone(),
                replay_endpoint: args.kv_events_replay_endpoint.0.clone(),
                topic: args.kv_events_topic.clone(),
                dp_ranks: args.kv_events_dp_ranks,
                ..KvEventsConfig::default()
            },
            kv_events_index_bytes: (args.kv_events_index_mib as usize) << 20,
            tokenize_timeout: args.tokenize_timeout,
            tokenizers: args.tokenizers.clone(),
            tokenizer_cache_bytes: (args.tokenizer_cache_mib as usize) << 20,
            tokenizer_check_every: args.tokenizer_check_every,
            drain_timeout: args.drain_timeout,
            drain_grace: args.drain_grace,
            max_connections: args.max_connections as usize,
            idle_gauge_timeout: args.idle_gauge_timeout,
            grpc_keepalive: GrpcKeepalive {
                interval: args.grpc_keepalive_interval,
                timeout: args.grpc_keepalive_timeout,
            },
            grpc_tls: match (&args.grpc_tls_cert, &args.grpc_tls_key) {
                (Some(cert), Some(key)) => Some(GrpcTls {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: args.grpc_tls_client_ca.clone(),
                }),
                _ => None,
            },
        };
        config.validate()?;
        Ok(config)
    }

    /// Where endpoints come from.
    pub fn discovery(&self) -> DiscoverySource {
        match &self.kubernetes {
            Some(kubernetes) => DiscoverySource::Kubernetes(Box::new(kubernetes.clone())),
            None => DiscoverySource::Static(self.endpoints.clone()),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |msg: &str| Err(ConfigError::Invalid(msg.to_owned()));

        match &self.kubernetes {
            None if self.endpoints.is_empty() => return Err(ConfigError::NoEndpoints),
            None => {}
            Some(_) if !self.endpoints.is_empty() => return Err(ConfigError::MixedDiscovery),
            Some(kubernetes) => {
                if kubernetes.namespace.as_deref() == Some("") {
                    return invalid("--pool-namespace must not be empty");
                }
                match &kubernetes.target {
                    KubeTarget::Pool { name } if name.is_empty() => {
                        return invalid("--pool-name must not be empty");
                    }
                    KubeTarget::Pool { .. } => {}
                    KubeTarget::Pods(target) => {
                        if target.selector().is_empty() {
                            return invalid(
                                "--endpoint-selector must name at least one label `k=v` \
                                 (an empty selector would pick every pod)",
                            );
                        }
                        if target.ports().contains(&0) {
                            return invalid("--endpoint-target-ports must be ports above 0");
                        }
                        if target.ports().len() > MAX_TARGET_PORTS {
                            return invalid("--endpoint-target-ports takes at most 8 ports");
                        }
                    }
                }
            }
        }
        if self.scrape.interval.is_zero() {
            return invalid("--refresh-metrics-interval must be above zero");
        }
        if self.scrape.timeout.is_zero() {
            return invalid("--scrape-timeout must be above zero");
        }
        if self.scrape.models_interval.is_zero() {
            return invalid("--refresh-models-interval must be above zero");
        }
        if self.scrape.concurrency == Some(0) {
            return invalid("--scrape-concurrency must be at least 1 (or auto)");
        }
        if self.allowed_paths.is_empty() {
            return invalid("--allowed-paths must list at least one path");
        }
        if let Some(path) = self
            .allowed_paths
            .iter()
            .find(|p| !p.starts_with('/') || p.contains('?'))
        {
            return Err(ConfigError::Invalid(format!(
                "--allowed-paths: `{path}` is not a path (expected /v1/..., without a query)"
            )));
        }
        if self.max_body_bytes == 0 {
            return invalid("--max-body-bytes must be above zero");
        }
        if self.max_held_body_bytes < self.max_body_bytes {
            return invalid("--max-held-body-bytes must be at least --max-body-bytes");
        }
        if self.request_read_timeout.is_zero() {
            return invalid("--request-read-timeout must be above zero");
        }
        if self.grpc_max_streams_per_connection == 0 {
            return invalid("--grpc-max-streams-per-connection must be at least 1");
        }
        if self.grpc_keepalive.interval.is_zero() || self.grpc_keepalive.timeout.is_zero() {
            return invalid(
                "--grpc-keepalive-interval and --grpc-keepalive-timeout must be above zero",
            );
        }
        if self.health.failures_to_mark_down == 0 || self.health.successes_to_mark_up == 0 {
            return invalid("--unhealthy-after and --healthy-after must be at least 1");
        }
        if self.prefix_source.uses_events() && self.tokenize_timeout.is_zero() {
            return invalid("--tokenize-timeout must be above zero");
        }
        if !self.prefix_source.uses_events() && !self.tokenizers.is_empty() {
            return invalid(
                "--tokenizer is read only with --prefix-source precise or auto (the approximate \
                 index matches the prompt's text, not its tokens)",
            );
        }
        Ok(self.scheduler.validate()?)
    }
}

#[cfg(test)]
mod tests;
