//! Subscribing to every pod's KV cache events (vLLM `--kv-events-config`): one task per
//! pod keeps a ZeroMQ SUB socket on the pod's publisher, asks its replay socket for what
//! it missed, and applies each batch to the precise prefix index. Decoding and the
//! index's rules are pure and live in `kvroute_core::kvevents`; this module owns the
//! sockets, the reconnection and the telemetry.
//!
//! Where each pod publishes comes from a template naming its address
//! ([`EndpointTemplate`]): vLLM binds `tcp://*:5557` by default, so
//! `tcp://{host}:5557` reaches every pod of a Kubernetes fleet; pods sharing one host
//! (the laboratory) offset the port from their HTTP port, `tcp://{host}:{port-2443}`.

mod subscriber;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvroute_core::fleet::PrefixIndex;
use kvroute_core::kvevents::EngineCounts;

use crate::store::{PodStore, PodTasks};

/// Where a pod's publisher is, from the pod's HTTP endpoint: `{host}` is its IP,
/// `{port}` its HTTP port, `{port+N}` / `{port-N}` that port shifted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointTemplate(String);

/// Why a template is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("{0:?} is not a tcp:// endpoint (vLLM's publisher binds TCP)")]
    NotTcp(String),
    #[error("{0:?} names neither {{host}} nor a fixed host")]
    NoHost(String),
    #[error(
        "{template:?}: unknown placeholder {placeholder:?} (known: {{host}}, {{port}}, {{port+N}}, {{port-N}})"
    )]
    Placeholder {
        template: String,
        placeholder: String,
    },
    #[error("{template:?} gives port {port} for pod {pod}, outside 1-65535")]
    Port {
        template: String,
        pod: SocketAddr,
        port: i64,
    },
}

impl EndpointTemplate {
    /// A template, checked by resolving it for a sample pod.
    pub fn parse(template: &str) -> Result<Self, TemplateError> {
        if !template.starts_with("tcp://") {
            return Err(TemplateError::NotTcp(template.to_owned()));
        }
        let parsed = EndpointTemplate(template.to_owned());
        // The placeholders are checked here; a port out of range depends on the pod.
        match parsed.resolve(SocketAddr::from(([10, 0, 0, 1], 8000))) {
            Ok(_) | Err(TemplateError::Port { .. }) => {}
            Err(error) => return Err(error),
        }
        let rest = &template["tcp://".len()..];
        if rest.starts_with(':') || rest.is_empty() {
            return Err(TemplateError::NoHost(template.to_owned()));
        }
        Ok(parsed)
    }

    /// The endpoint of data-parallel rank `rank` of `pod`: its port shifted by the rank,
    /// as vLLM's `offset_endpoint_port` does.
    pub fn resolve_rank(&self, pod: SocketAddr, rank: u32) -> Result<String, TemplateError> {
        let base = self.resolve(pod)?;
        if rank == 0 {
            return Ok(base);
        }
        let port = base
            .rfind(':')
            .and_then(|colon| base[colon + 1..].parse::<i64>().ok().map(|p| (colon, p)));
        match port {
            Some((colon, port)) if (1..=65_535).contains(&(port + i64::from(rank))) => {
                Ok(format!("{}:{}", &base[..colon], port + i64::from(rank)))
            }
            Some((_, port)) => Err(TemplateError::Port {
                template: self.0.clone(),
                pod,
                port: port + i64::from(rank),
            }),
            None => Err(self.placeholder("port")),
        }
    }

    /// The endpoint for `pod`.
    pub fn resolve(&self, pod: SocketAddr) -> Result<String, TemplateError> {
        let mut out = String::with_capacity(self.0.len() + 16);
        let mut rest = self.0.as_str();
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let after = &rest[open + 1..];
            let Some(close) = after.find('}') else {
                return Err(self.placeholder(after));
            };
            let name = &after[..close];
            match name {
                "host" => match pod {
                    SocketAddr::V4(v4) => out.push_str(&v4.ip().to_string()),
                    SocketAddr::V6(v6) => out.push_str(&format!("[{}]", v6.ip())),
                },
                _ => {
                    let shift = match name.strip_prefix("port") {
                        Some("") => 0,
                        Some(offset) => offset
                            .strip_prefix('+')
                            .map(|n| n.parse::<i64>())
                            .or_else(|| {
                                offset
                                    .strip_prefix('-')
                                    .map(|n| n.parse::<i64>().map(|n| -n))
                            })
                            .and_then(Result::ok)
                            .ok_or_else(|| self.placeholder(name))?,
                        None => return Err(self.placeholder(name)),
                    };
                    let port = i64::from(pod.port()) + shift;
                    if !(1..=65_535).contains(&port) {
                        return Err(TemplateError::Port {
                            template: self.0.clone(),
                            pod,
                            port,
                        });
                    }
                    out.push_str(&port.to_string());
                }
            }
            rest = &after[close + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }

    fn placeholder(&self, name: &str) -> TemplateError {
        TemplateError::Placeholder {
            template: self.0.clone(),
            placeholder: name.to_owned(),
        }
    }
}

impl std::fmt::Display for EndpointTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

pub use kvroute_core::kvevents::PrefixSource;

/// `--prefix-source`'s values.
pub fn parse_prefix_source(value: &str) -> Result<PrefixSource, String> {
    match value {
        "approximate" => Ok(PrefixSource::Approximate),
        "precise" => Ok(PrefixSource::Precise),
        "auto" => Ok(PrefixSource::Auto),
        other => Err(format!(
            "unknown prefix source {other:?} (known: approximate, precise, auto)"
        )),
    }
}

/// How kvroute subscribes to the pods' events.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// The PUB socket of each pod.
    pub endpoint: EndpointTemplate,
    /// The ROUTER socket answering replays; `None`: gaps are not repaired (the pod's
    /// entries are dropped and rebuilt from the live stream).
    pub replay_endpoint: Option<EndpointTemplate>,
    /// Topic prefix subscribed to (vLLM's `topic`; empty: every topic).
    pub topic: String,
    /// How long connecting to a publisher, or one replay, may take.
    pub timeout: Duration,
    /// Data-parallel engines per pod: vLLM's rank `r` publishes on each endpoint's port
    /// + `r`, and a pod holds a block while any of its engines does.
    pub dp_ranks: u32,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            endpoint: EndpointTemplate("tcp://{host}:5557".into()),
            replay_endpoint: Some(EndpointTemplate("tcp://{host}:5558".into())),
            topic: String::new(),
            timeout: Duration::from_secs(2),
            dp_ranks: 1,
        }
    }
}

/// The prefix index built from events, and which pods' streams are in sync with it.
#[derive(Debug)]
pub struct PreciseIndex {
    index: PrefixIndex,
    /// Pods whose publishers (every rank's) are connected and whose batches are applied in
    /// sequence: for them the index holds what the engines hold (as far as their events
    /// said).
    streaming: RwLock<Arc<HashSet<SocketAddr>>>,
    /// Per pod, the ranks whose streams are up (bit `r` for rank `r`).
    ranks_up: std::sync::Mutex<HashMap<SocketAddr, u64>>,
}

impl PreciseIndex {
    /// An index of at most `budget_bytes` (see [`PrefixIndex::with_budget`]).
    pub fn with_budget(budget_bytes: usize) -> Self {
        PreciseIndex {
            index: PrefixIndex::with_budget(budget_bytes),
            streaming: RwLock::new(Arc::new(HashSet::new())),
            ranks_up: std::sync::Mutex::new(HashMap::new()),
        }
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The pods whose events flow now (one read lock and a reference count per call).
    pub fn streaming(&self) -> Arc<HashSet<SocketAddr>> {
        Arc::clone(&self.streaming.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Rank `rank` (of `ranks`) of `endpoint`'s stream came up or went down.
    fn set_rank_streaming(&self, endpoint: SocketAddr, rank: u32, ranks: u32, up: bool) {
        let all = {
            let mut ranks_up = self.ranks_up.lock().unwrap_or_else(|p| p.into_inner());
            let mask = ranks_up.entry(endpoint).or_insert(0);
            let bit = 1u64 << rank.min(63);
            if up {
                *mask |= bit;
            } else {
                *mask &= !bit;
            }
            let full = if ranks >= 64 {
                u64::MAX
            } else {
                (1u64 << ranks) - 1
            };
            *mask & full == full
        };
        self.set_streaming(endpoint, all);
    }

    /// `endpoint` left the fleet.
    fn forget_pod(&self, endpoint: SocketAddr) {
        self.ranks_up
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&endpoint);
        self.set_streaming(endpoint, false);
    }

    fn set_streaming(&self, endpoint: SocketAddr, up: bool) {
        let mut streaming = self.streaming.write().unwrap_or_else(|p| p.into_inner());
        if streaming.contains(&endpoint) == up {
            return;
        }
        let mut next = HashSet::clone(&streaming);
        if up {
            next.insert(endpoint);
        } else {
            next.remove(&endpoint);
        }
        crate::telemetry::set_kv_event_streams(next.len());
        *streaming = Arc::new(next);
    }
}

/// Starts and stops the per-pod subscribers as the endpoint set changes.
pub struct KvEventsManager {
    store: Arc<PodStore>,
    precise: Arc<PreciseIndex>,
    config: KvEventsConfig,
    tasks: PodTasks,
}

impl std::fmt::Debug for KvEventsManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventsManager")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KvEventsManager {
    pub fn new(store: Arc<PodStore>, precise: Arc<PreciseIndex>, config: KvEventsConfig) -> Self {
        KvEventsManager {
            store,
            precise,
            config,
            tasks: PodTasks::new(),
        }
    }

    /// Makes the subscribers match the store's endpoints. A departed pod's blocks leave
    /// the index as it follows the next snapshot.
    pub fn reconcile(&self) {
        let endpoints = self.store.endpoints();
        self.tasks.reconcile(
            &endpoints,
            |endpoint| {
                // One stream per data-parallel rank, their blocks counted together.
                let counts = (self.config.dp_ranks > 1)
                    .then(|| Arc::new(std::sync::Mutex::new(EngineCounts::default())));
                let ranks: Result<Vec<_>, _> = (0..self.config.dp_ranks.max(1))
                    .map(|rank| {
                        subscriber::PodSubscriber::new(
                            endpoint,
                            rank,
                            &self.config,
                            Arc::clone(&self.store),
                            Arc::clone(&self.precise),
                            counts.clone(),
                        )
                    })
                    .collect();
                match ranks {
                    Ok(ranks) => Some(tokio::spawn(async move {
                        futures::future::join_all(ranks.into_iter().map(|r| r.run())).await;
                    })),
                    // The templates were checked at start; only a port shifted out of
                    // range for this pod gets here.
                    Err(error) => {
                        tracing::warn!(pod = %endpoint, %error, "no KV event subscription");
                        None
                    }
                }
            },
            |endpoint| self.precise.forget_pod(endpoint),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 1, 2, 3], port))
    }

    #[test]
    fn templates_resolve_host_and_shifted_ports() {
        let t = EndpointTemplate::parse("tcp://{host}:5557").expect("valid");
        assert_eq!(
            t.resolve(pod(8000)).expect("resolves"),
            "tcp://10.1.2.3:5557"
        );
        let t = EndpointTemplate::parse("tcp://{host}:{port-2443}").expect("valid");
        assert_eq!(
            t.resolve(pod(8001)).expect("resolves"),
            "tcp://10.1.2.3:5558"
        );
        let t = EndpointTemplate::parse("tcp://{host}:{port+1}").expect("valid");
        assert_eq!(
            t.resolve(pod(8000)).expect("resolves"),
            "tcp://10.1.2.3:8001"
        );
        let v6 = SocketAddr::from(([0xfd00, 0, 0, 0, 0, 0, 0, 1], 8000));
        let t = EndpointTemplate::parse("tcp://{host}:{port}").expect("valid");
        assert_eq!(t.resolve(v6).expect("resolves"), "tcp://[fd00::1]:8000");
    }

    #[test]
    fn a_data_parallel_rank_publishes_on_the_port_shifted_by_its_rank() {
        let t = EndpointTemplate::parse("tcp://{host}:5557").expect("valid");
        assert_eq!(
            t.resolve_rank(pod(8000), 0).expect("rank 0"),
            "tcp://10.1.2.3:5557"
        );
        assert_eq!(
            t.resolve_rank(pod(8000), 3).expect("rank 3"),
            "tcp://10.1.2.3:5560"
        );
        let t = EndpointTemplate::parse("tcp://{host}:65535").expect("valid");
        assert!(matches!(
            t.resolve_rank(pod(8000), 1),
            Err(TemplateError::Port { port: 65_536, .. })
        ));
    }

    #[test]
    fn a_data_parallel_pod_streams_once_every_rank_does() {
        let precise = PreciseIndex::with_budget(1 << 20);
        precise.set_rank_streaming(pod(8000), 0, 2, true);
        assert!(precise.streaming().is_empty(), "rank 1 is not up yet");
        precise.set_rank_streaming(pod(8000), 1, 2, true);
        assert!(precise.streaming().contains(&pod(8000)));
        precise.set_rank_streaming(pod(8000), 0, 2, false);
        assert!(precise.streaming().is_empty());
        precise.set_rank_streaming(pod(8000), 0, 2, true);
        precise.forget_pod(pod(8000));
        assert!(precise.streaming().is_empty());
    }

    #[test]
    fn bad_templates_are_refused_with_the_reason() {
        assert!(matches!(
            EndpointTemplate::parse("ipc:///tmp/kv"),
            Err(TemplateError::NotTcp(_))
        ));
        assert!(matches!(
            EndpointTemplate::parse("tcp://{pod}:5557"),
            Err(TemplateError::Placeholder { .. })
        ));
        assert!(matches!(
            EndpointTemplate::parse("tcp://{host}:{port*2}"),
            Err(TemplateError::Placeholder { .. })
        ));
        assert!(matches!(
            EndpointTemplate::parse("tcp://:5557"),
            Err(TemplateError::NoHost(_))
        ));
        let t = EndpointTemplate::parse("tcp://{host}:{port-8000}").expect("valid for 8000+");
        assert!(matches!(
            t.resolve(pod(8000)),
            Err(TemplateError::Port { port: 0, .. })
        ));
    }
}
