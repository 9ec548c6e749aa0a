//! vLLM's `KVEventsConfig` (`vllm/config/kv_events.py`), read from the same JSON vLLM's
//! `--kv-events-config` takes, and the sockets it makes each simulated pod open.
//!
//! Fields and defaults are vLLM's; an unknown field is refused, as vLLM's config refuses it.
//! Where a pod publishes follows vLLM's `ZmqEventPublisher`: the PUB socket binds when the
//! endpoint has a wildcard (`*` or `::`) and connects otherwise; the replay ROUTER socket
//! always binds; the ports are offset by the pod's index in this process, as vLLM offsets them
//! by data-parallel rank (pods sharing a host cannot share a port). Only `tcp://` is offered
//! (vLLM also takes `ipc://` and `inproc://`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use serde::Deserialize;

/// Why a KV events configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvEventsError {
    /// The JSON does not parse into vLLM's fields.
    #[error("invalid --kv-events-config: {0}")]
    Json(String),
    /// An endpoint is not `tcp://HOST:PORT`.
    #[error("{field} {endpoint:?}: {reason}")]
    Endpoint {
        /// `endpoint` or `replay_endpoint`.
        field: &'static str,
        /// As given.
        endpoint: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A pod's port would pass 65535.
    #[error("{field} {endpoint:?}: pod {pod} would need port {port}, above 65535")]
    PortRange {
        /// `endpoint` or `replay_endpoint`.
        field: &'static str,
        /// As given.
        endpoint: String,
        /// The pod's index.
        pod: usize,
        /// The port it would need.
        port: u32,
    },
}

/// vLLM's `publisher` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PublisherKind {
    /// Events are dropped (vLLM's `NullEventPublisher`).
    Null,
    /// ZeroMQ PUB socket with a replay ROUTER socket (vLLM's `ZmqEventPublisher`).
    Zmq,
}

/// vLLM's `KVEventsConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Whether the engine records KV cache events at all.
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// `null` or `zmq`; unset means `zmq` when events are enabled (vLLM's `__post_init__`).
    #[serde(default)]
    pub publisher: Option<PublisherKind>,
    /// The PUB socket: `tcp://*:PORT` binds, `tcp://HOST:PORT` connects to a subscriber
    /// that binds.
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// The replay ROUTER socket (always bound); none: no replay.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Past batches kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    /// vLLM's PUB high-water mark. Accepted and not applied: the `zeromq` crate's PUB queue
    /// per subscriber is fixed at 100,000 messages, vLLM's default.
    #[serde(default = "default_hwm")]
    pub hwm: u64,
    /// Batches queued between the engine and the publisher; when full, new batches are
    /// dropped and counted (vLLM's queue would block its engine instead). 0: unbounded.
    #[serde(default = "default_max_queue_size")]
    pub max_queue_size: usize,
    /// First frame of every message; subscribers filter on it.
    #[serde(default)]
    pub topic: String,
}

fn default_endpoint() -> String {
    "tcp://*:5557".into()
}

fn default_buffer_steps() -> usize {
    10_000
}

fn default_hwm() -> u64 {
    100_000
}

fn default_max_queue_size() -> usize {
    100_000
}

impl Default for KvEventsConfig {
    fn default() -> KvEventsConfig {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: default_endpoint(),
            replay_endpoint: None,
            buffer_steps: default_buffer_steps(),
            hwm: default_hwm(),
            max_queue_size: default_max_queue_size(),
            topic: String::new(),
        }
    }
}

/// Where one pod's PUB socket goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PubTarget {
    /// Bind this address (port 0: an ephemeral port).
    Bind(SocketAddr),
    /// Connect to this `tcp://HOST:PORT` (a subscriber that binds).
    Connect(String),
}

/// The sockets one pod opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodEndpoints {
    /// The PUB socket.
    pub publish: PubTarget,
    /// The replay ROUTER socket, always bound.
    pub replay: Option<SocketAddr>,
}

/// An endpoint as vLLM reads it: its host, its port, and whether the PUB socket binds it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Endpoint {
    host: String,
    port: u16,
    binds: bool,
}

impl KvEventsConfig {
    /// Parses vLLM's JSON and checks its endpoints (the `--kv-events-config` flag's parser).
    pub fn from_json(text: &str) -> Result<KvEventsConfig, KvEventsError> {
        let config: KvEventsConfig =
            serde_json::from_str(text).map_err(|e| KvEventsError::Json(e.to_string()))?;
        config.check()?;
        Ok(config)
    }

    /// The publisher vLLM would pick (`zmq` when events are enabled and none is named).
    pub fn publisher_kind(&self) -> PublisherKind {
        self.publisher.unwrap_or(if self.enable_kv_cache_events {
            PublisherKind::Zmq
        } else {
            PublisherKind::Null
        })
    }

    /// Whether pods with this configuration record and publish events.
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher_kind() == PublisherKind::Zmq
    }

    /// Checks what does not depend on the fleet: both endpoints parse.
    pub fn check(&self) -> Result<(), KvEventsError> {
        self.endpoints_for(0).map(|_| ())
    }

    /// The sockets pod `pod` (its index in this process) opens: each endpoint's port + `pod`
    /// (port 0 stays 0: an ephemeral port per pod).
    pub fn endpoints_for(&self, pod: usize) -> Result<PodEndpoints, KvEventsError> {
        let publish = parse("endpoint", &self.endpoint)?;
        let port = offset("endpoint", &self.endpoint, publish.port, pod)?;
        let publish = if publish.binds {
            PubTarget::Bind(SocketAddr::new(
                bind_ip("endpoint", &self.endpoint, &publish.host)?,
                port,
            ))
        } else if port == 0 {
            return Err(endpoint_error(
                "endpoint",
                &self.endpoint,
                "a connecting endpoint needs a port",
            ));
        } else {
            PubTarget::Connect(format!("tcp://{}:{port}", publish.host))
        };
        let replay = match &self.replay_endpoint {
            None => None,
            Some(text) => {
                let replay = parse("replay_endpoint", text)?;
                let port = offset("replay_endpoint", text, replay.port, pod)?;
                let ip = bind_ip("replay_endpoint", text, &replay.host)?;
                Some(SocketAddr::new(ip, port))
            }
        };
        Ok(PodEndpoints { publish, replay })
    }
}

fn endpoint_error(field: &'static str, endpoint: &str, reason: &str) -> KvEventsError {
    KvEventsError::Endpoint {
        field,
        endpoint: endpoint.to_string(),
        reason: reason.to_string(),
    }
}

/// `tcp://HOST:PORT`, with vLLM's rule for binding (`*` or `::` in the endpoint).
fn parse(field: &'static str, endpoint: &str) -> Result<Endpoint, KvEventsError> {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        let reason = "the simulator publishes on tcp://HOST:PORT only";
        return Err(endpoint_error(field, endpoint, reason));
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err(endpoint_error(field, endpoint, "no :PORT"));
    };
    if host.is_empty() {
        return Err(endpoint_error(field, endpoint, "no host"));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| endpoint_error(field, endpoint, "the port is not a number in 0-65535"))?;
    Ok(Endpoint {
        host: host.to_string(),
        port,
        binds: endpoint.contains('*') || endpoint.contains("::"),
    })
}

fn offset(
    field: &'static str,
    endpoint: &str,
    port: u16,
    pod: usize,
) -> Result<u16, KvEventsError> {
    if port == 0 {
        return Ok(0);
    }
    let wanted = u32::from(port).saturating_add(u32::try_from(pod).unwrap_or(u32::MAX));
    u16::try_from(wanted).map_err(|_| KvEventsError::PortRange {
        field,
        endpoint: endpoint.to_string(),
        pod,
        port: wanted,
    })
}

/// The address a bound socket listens on: `*` is every IPv4 interface, as in ZeroMQ.
fn bind_ip(field: &'static str, endpoint: &str, host: &str) -> Result<IpAddr, KvEventsError> {
    if host == "*" {
        return Ok(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    }
    if host == "localhost" {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(v6) = bare.parse::<Ipv6Addr>() {
        return Ok(IpAddr::V6(v6));
    }
    bare.parse::<Ipv4Addr>().map(IpAddr::V4).map_err(|_| {
        let reason = "a bound socket needs *, an IP address or localhost";
        endpoint_error(field, endpoint, reason)
    })
}

/// Whether two bound addresses would take the same port (an unspecified address takes it
/// on every interface).
pub(crate) fn clash(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0
        && a.port() == b.port()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind(addr: &str) -> PubTarget {
        PubTarget::Bind(addr.parse().expect("address"))
    }

    #[test]
    fn vllms_json_gives_its_defaults_and_refuses_unknown_fields() {
        let c = KvEventsConfig::from_json(r#"{"enable_kv_cache_events": true}"#).expect("valid");
        assert_eq!(
            c.publisher_kind(),
            PublisherKind::Zmq,
            "vLLM's __post_init__"
        );
        assert!(c.publishes());
        assert_eq!(c.endpoint, "tcp://*:5557");
        assert_eq!(
            (c.buffer_steps, c.hwm, c.max_queue_size),
            (10_000, 100_000, 100_000)
        );
        assert_eq!((c.replay_endpoint.clone(), c.topic.as_str()), (None, ""));

        let off = KvEventsConfig::from_json("{}").expect("valid");
        assert_eq!(off.publisher_kind(), PublisherKind::Null);
        assert!(!off.publishes());
        let null = r#"{"enable_kv_cache_events": true, "publisher": "null"}"#;
        assert!(!KvEventsConfig::from_json(null).expect("valid").publishes());

        let err = KvEventsConfig::from_json(r#"{"enable_kv_cache_events": true, "topik": "kv"}"#)
            .expect_err("unknown field");
        assert!(err.to_string().contains("unknown field `topik`"), "{err}");
        let err = KvEventsConfig::from_json(r#"{"publisher": "kafka"}"#).expect_err("unknown");
        assert!(err.to_string().contains("kafka"), "{err}");
        assert!(KvEventsConfig::from_json("not json").is_err());
    }

    #[test]
    fn endpoints_bind_on_a_wildcard_connect_otherwise_and_offset_by_pod() {
        let c = KvEventsConfig {
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: Some("tcp://*:6557".into()),
            ..KvEventsConfig::default()
        };
        let pod2 = c.endpoints_for(2).expect("valid");
        assert_eq!(pod2.publish, bind("0.0.0.0:5559"));
        assert_eq!(pod2.replay, Some("0.0.0.0:6559".parse().expect("address")));

        let c = KvEventsConfig {
            endpoint: "tcp://collector.local:7000".into(),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            ..KvEventsConfig::default()
        };
        let pod1 = c.endpoints_for(1).expect("valid");
        assert_eq!(
            pod1.publish,
            PubTarget::Connect("tcp://collector.local:7001".into())
        );
        assert_eq!(pod1.replay, Some("127.0.0.1:0".parse().expect("address")));

        let v6 = KvEventsConfig {
            endpoint: "tcp://[::1]:5557".into(),
            ..KvEventsConfig::default()
        };
        assert_eq!(
            v6.endpoints_for(0).expect("valid").publish,
            bind("[::1]:5557")
        );
    }

    #[test]
    fn bad_endpoints_are_refused_with_a_reason() {
        for (endpoint, reason) in [
            ("ipc:///tmp/kv", "tcp://HOST:PORT only"),
            ("tcp://*", "no :PORT"),
            ("tcp://:5557", "no host"),
            ("tcp://*:http", "not a number"),
            ("tcp://*:70000", "not a number"),
            ("tcp://example.com:0", "needs a port"),
        ] {
            let json = format!(r#"{{"enable_kv_cache_events": true, "endpoint": "{endpoint}"}}"#);
            let err = KvEventsConfig::from_json(&json).expect_err(endpoint);
            assert!(err.to_string().contains(reason), "{endpoint}: {err}");
        }
        let json = r#"{"replay_endpoint": "tcp://example.com:5558"}"#;
        let err = KvEventsConfig::from_json(json).expect_err("replay binds");
        assert!(err.to_string().contains("IP address"), "{err}");
        let c = KvEventsConfig {
            endpoint: "tcp://*:65535".into(),
            ..KvEventsConfig::default()
        };
        let err = c.endpoints_for(1).expect_err("past 65535");
        assert!(err.to_string().contains("65536"), "{err}");
    }

    #[test]
    fn an_unspecified_address_clashes_with_every_address_on_its_port() {
        let any: SocketAddr = "0.0.0.0:5557".parse().expect("address");
        let lo: SocketAddr = "127.0.0.1:5557".parse().expect("address");
        let other: SocketAddr = "10.0.0.1:5557".parse().expect("address");
        let ephemeral: SocketAddr = "0.0.0.0:0".parse().expect("address");
        assert!(clash(any, lo) && clash(lo, any) && clash(lo, lo));
        assert!(!clash(lo, other));
        assert!(
            !clash(ephemeral, ephemeral),
            "port 0 is a fresh port each time"
        );
    }
}
