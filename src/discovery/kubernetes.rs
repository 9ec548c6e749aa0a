//! Kubernetes discovery: the endpoints are the ready pods that a label selector picks,
//! one per target port, either straight from flags or from an `InferencePool`.
//!
//! Everything runs on kube-runtime watchers feeding reflector stores: they list, then
//! watch from the list's resourceVersion, resume after a dropped connection, relist
//! after `410 Gone`, and back off on errors. What they see is turned into an endpoint
//! set by [`endpoints_of`], a pure function, and sent on the discovery channel.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::inference_pool::InferencePool;

/// Where Kubernetes discovery looks (validated configuration).
#[derive(Debug, Clone)]
pub struct KubernetesDiscovery {
    /// Namespace of the pool or the pods; `None`: the client configuration's default
    /// (the service account's namespace in a cluster, the kubeconfig context's outside).
    pub namespace: Option<String>,
    pub target: KubeTarget,
    /// How to reach the API server; `None`: `kube::Config::infer()` (in-cluster
    /// service account, else `KUBECONFIG` / `~/.kube/config`).
    pub client: Option<kube::Config>,
}

/// What to follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeTarget {
    /// An `InferencePool` by name: its selector and ports, live.
    Pool { name: String },
    /// Pods by label selector, with fixed ports (no CRD needed).
    Pods(PodTarget),
}

/// Label equality selector (`k=v,...`), the `matchLabels` form.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(BTreeMap<String, String>);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    #[error("`{0}` is not a label `key=value`")]
    NotAPair(String),
    #[error("label key `{0}` is not a valid label name")]
    BadKey(String),
    #[error("label value `{0}` is not a valid label value")]
    BadValue(String),
}

/// `[prefix/]name`: letters, digits, `-`, `_`, `.`, `/`.
fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 317
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

/// Empty, or up to 63 of letters, digits, `-`, `_`, `.`.
fn valid_value(value: &str) -> bool {
    value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl LabelSelector {
    pub fn new(labels: BTreeMap<String, String>) -> Result<Self, SelectorError> {
        for (key, value) in &labels {
            if !valid_key(key) {
                return Err(SelectorError::BadKey(key.clone()));
            }
            if !valid_value(value) {
                return Err(SelectorError::BadValue(value.clone()));
            }
        }
        Ok(LabelSelector(labels))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object with `labels` is selected.
    pub fn matches(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        self.0
            .iter()
            .all(|(key, value)| labels.and_then(|l| l.get(key)) == Some(value))
    }
}

impl FromStr for LabelSelector {
    type Err = SelectorError;

    /// Parses `k=v,k2=v2` (`==` accepted too).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut labels = BTreeMap::new();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once("==")
                .or_else(|| pair.split_once('='))
                .ok_or_else(|| SelectorError::NotAPair(pair.to_owned()))?;
            labels.insert(key.trim().to_owned(), value.trim().to_owned());
        }
        LabelSelector::new(labels)
    }
}

/// The API server's `labelSelector` form.
impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (key, value)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{key}={value}")?;
        }
        Ok(())
    }
}

/// Which pods, and which of their ports, are endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTarget {
    selector: LabelSelector,
    ports: Vec<u16>,
}

impl PodTarget {
    /// Ports are kept sorted and without duplicates.
    pub fn new(selector: LabelSelector, mut ports: Vec<u16>) -> Self {
        ports.sort_unstable();
        ports.dedup();
        PodTarget { selector, ports }
    }

    pub fn selector(&self) -> &LabelSelector {
        &self.selector
    }

    pub fn ports(&self) -> &[u16] {
        &self.ports
    }
}

/// The pod's IP if it may receive traffic: its Ready condition is true, it has an
/// IP, and it is not being deleted.
pub fn routable_ip(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

/// The endpoint set: every target port of every routable pod the selector picks,
/// sorted, without duplicates.
pub fn endpoints_of<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    target: &PodTarget,
) -> Vec<SocketAddr> {
    let mut endpoints: Vec<SocketAddr> = pods
        .into_iter()
        .filter(|pod| target.selector.matches(pod.metadata.labels.as_ref()))
        .filter_map(routable_ip)
        .flat_map(|ip| {
            target
                .ports
                .iter()
                .map(move |port| SocketAddr::new(ip, *port))
        })
        .collect();
    endpoints.sort_unstable();
    endpoints.dedup();
    endpoints
}

/// Follows `target` in `namespace` and sends the endpoint set on `endpoints` whenever
/// it changes. Runs until every receiver is gone.
pub(super) async fn run(
    client: kube::Client,
    namespace: String,
    target: KubeTarget,
    endpoints: watch::Sender<Vec<SocketAddr>>,
) {
    let pods = Api::<Pod>::namespaced(client.clone(), &namespace);
    match target {
        KubeTarget::Pods(target) => {
            info!(%namespace, selector = %target.selector, ports = ?target.ports,
                "Kubernetes discovery: following pods");
            let (_keep, targets) = watch::channel(Some(target));
            follow_pods(pods, targets, &endpoints).await;
        }
        KubeTarget::Pool { name } => {
            info!(%namespace, pool = %name, "Kubernetes discovery: following InferencePool");
            let pools = Api::<InferencePool>::namespaced(client, &namespace);
            let (targets_tx, targets) = watch::channel(None);
            tokio::select! {
                () = follow_pool(pools, &namespace, &name, targets_tx) => {}
                () = follow_pods(pods, targets, &endpoints) => {}
            }
        }
    }
}

/// Watches one InferencePool and sends its pod target (`None` while it is missing or
/// invalid). Runs until the receiver is gone.
async fn follow_pool(
    api: Api<InferencePool>,
    namespace: &str,
    name: &str,
    targets: watch::Sender<Option<PodTarget>>,
) {
    let (store, writer) = reflector::store();
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let stream = watcher(api, config).default_backoff().reflect(writer);
    let key = ObjectRef::new(name).within(namespace);
    let mut stream = std::pin::pin!(stream);
    loop {
        let event = tokio::select! {
            event = stream.next() => event,
            () = targets.closed() => return,
        };
        match event {
            None => return,
            Some(Err(error)) => warn!(pool = %name, %error, "InferencePool watch failed; retrying"),
            Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => {}
            Some(Ok(_)) => {
                let pool = store.get(&key);
                let picker = pool
                    .as_ref()
                    .and_then(|p| p.spec.endpoint_picker_ref.as_ref())
                    .map(|r| r.name.clone());
                let target = match pool {
                    None => {
                        warn!(pool = %name, "InferencePool not found: no endpoints");
                        None
                    }
                    Some(pool) => match pool.spec.pod_target() {
                        Ok(target) => Some(target),
                        Err(error) => {
                            warn!(pool = %name, %error, "InferencePool unusable: no endpoints");
                            None
                        }
                    },
                };
                targets.send_if_modified(|current| {
                    if *current == target {
                        return false;
                    }
                    if let Some(target) = &target {
                        info!(pool = %name, selector = %target.selector, ports = ?target.ports,
                            endpoint_picker = ?picker, "InferencePool target");
                    }
                    *current = target;
                    true
                });
            }
        }
    }
}

/// Watches the pods `targets` names, re-watching when the selector changes, and sends
/// their endpoint set. Returns when either channel closes.
async fn follow_pods(
    api: Api<Pod>,
    mut targets: watch::Receiver<Option<PodTarget>>,
    endpoints: &watch::Sender<Vec<SocketAddr>>,
) {
    loop {
        let Some(mut target) = targets.borrow_and_update().clone() else {
            publish(endpoints, Vec::new());
            tokio::select! {
                changed = targets.changed() => if changed.is_err() { return },
                () = endpoints.closed() => return,
            }
            continue;
        };
        let (store, writer) = reflector::store();
        let config = watcher::Config::default().labels(&target.selector.to_string());
        let stream = watcher(api.clone(), config)
            .default_backoff()
            .modify(slim)
            .reflect(writer);
        let mut stream = std::pin::pin!(stream);
        // Until the new selector's first list completes, the previous set stays: a
        // selector change should not empty the pool for a moment.
        let mut listed = false;
        loop {
            tokio::select! {
                changed = targets.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    match targets.borrow_and_update().clone() {
                        Some(next) if next.selector == target.selector => {
                            target = next;
                            if listed {
                                publish(endpoints, pod_endpoints(&store, &target));
                            }
                        }
                        // Another selector, or no pool: watch anew.
                        _ => break,
                    }
                }
                event = stream.next() => match event {
                    None => return,
                    Some(Err(error)) => warn!(%error, "pod watch failed; retrying"),
                    Some(Ok(watcher::Event::Init)) => debug!("pod watch: listing"),
                    Some(Ok(watcher::Event::InitApply(_))) => {}
                    Some(Ok(watcher::Event::InitDone)) => {
                        listed = true;
                        publish(endpoints, pod_endpoints(&store, &target));
                    }
                    Some(Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_))) => {
                        if listed {
                            publish(endpoints, pod_endpoints(&store, &target));
                        }
                    }
                },
                () = endpoints.closed() => return,
            }
        }
    }
}

/// Drops what discovery never reads (the pod spec, annotations, managed fields)
/// before a pod enters the store: a large fleet's pods are mostly spec.
fn slim(pod: &mut Pod) {
    pod.spec = None;
    pod.managed_fields_mut().clear();
    pod.annotations_mut().clear();
}

fn pod_endpoints(store: &Store<Pod>, target: &PodTarget) -> Vec<SocketAddr> {
    let pods = store.state();
    endpoints_of(pods.iter().map(AsRef::as_ref), target)
}

fn publish(endpoints: &watch::Sender<Vec<SocketAddr>>, next: Vec<SocketAddr>) {
    endpoints.send_if_modified(|current| {
        if *current == next {
            return false;
        }
        debug!(count = next.len(), "discovered endpoints changed");
        *current = next;
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ip: Option<&str>, ready: &str, labels: &[(&str, &str)], deleting: bool) -> Pod {
        let labels: serde_json::Map<String, serde_json::Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
            .collect();
        let mut metadata = serde_json::json!({"name": "p", "namespace": "ns", "labels": labels});
        if deleting {
            metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
        }
        let mut status = serde_json::json!({
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": ready},
            ],
        });
        if let Some(ip) = ip {
            status["podIP"] = ip.into();
        }
        serde_json::from_value(serde_json::json!({"metadata": metadata, "status": status}))
            .expect("pod parses")
    }

    fn target(selector: &str, ports: &[u16]) -> PodTarget {
        PodTarget::new(selector.parse().expect("selector"), ports.to_vec())
    }

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|a| a.parse().expect("addr")).collect()
    }

    #[test]
    fn every_target_port_of_a_ready_pod_is_an_endpoint() {
        let pods = [
            pod(Some("10.0.0.2"), "True", &[("app", "vllm")], false),
            pod(Some("10.0.0.1"), "True", &[("app", "vllm")], false),
        ];
        let endpoints = endpoints_of(&pods, &target("app=vllm", &[8001, 8000]));
        assert_eq!(
            endpoints,
            addrs(&[
                "10.0.0.1:8000",
                "10.0.0.1:8001",
                "10.0.0.2:8000",
                "10.0.0.2:8001"
            ])
        );
    }

    #[test]
    fn unready_ipless_and_terminating_pods_are_not_endpoints() {
        let pods = [
            pod(Some("10.0.0.1"), "False", &[("app", "vllm")], false),
            pod(Some("10.0.0.2"), "Unknown", &[("app", "vllm")], false),
            pod(None, "True", &[("app", "vllm")], false),
            pod(Some("10.0.0.4"), "True", &[("app", "vllm")], true),
            pod(Some("not-an-ip"), "True", &[("app", "vllm")], false),
            pod(Some("10.0.0.6"), "True", &[("app", "vllm")], false),
        ];
        assert_eq!(
            endpoints_of(&pods, &target("app=vllm", &[8000])),
            addrs(&["10.0.0.6:8000"])
        );
    }

    #[test]
    fn a_pod_without_a_ready_condition_is_not_ready() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "labels": {"app": "vllm"}},
            "status": {"podIP": "10.0.0.1", "phase": "Running"}
        }))
        .expect("pod parses");
        assert_eq!(routable_ip(&pod), None);
    }

    #[test]
    fn pods_the_selector_does_not_pick_are_ignored() {
        let pods = [
            pod(
                Some("10.0.0.1"),
                "True",
                &[("app", "vllm"), ("tier", "a")],
                false,
            ),
            pod(Some("10.0.0.2"), "True", &[("app", "vllm")], false),
            pod(
                Some("10.0.0.3"),
                "True",
                &[("app", "other"), ("tier", "a")],
                false,
            ),
        ];
        assert_eq!(
            endpoints_of(&pods, &target("app=vllm,tier=a", &[8000])),
            addrs(&["10.0.0.1:8000"])
        );
    }

    #[test]
    fn ipv6_pods_become_bracketed_endpoints() {
        let pods = [pod(Some("fd00::1"), "True", &[("app", "vllm")], false)];
        let endpoints = endpoints_of(&pods, &target("app=vllm", &[8000]));
        assert_eq!(endpoints[0].to_string(), "[fd00::1]:8000");
    }

    #[test]
    fn selectors_parse_print_and_reject_malformed_pairs() {
        let selector: LabelSelector = "tier = a, app==vllm".parse().expect("valid");
        assert_eq!(selector.to_string(), "app=vllm,tier=a");
        assert_eq!(
            "app".parse::<LabelSelector>(),
            Err(SelectorError::NotAPair("app".into()))
        );
        assert!(matches!(
            "app=v l".parse::<LabelSelector>(),
            Err(SelectorError::BadValue(_))
        ));
        assert!(matches!(
            "=x".parse::<LabelSelector>(),
            Err(SelectorError::BadKey(_))
        ));
        assert!(
            "".parse::<LabelSelector>()
                .expect("empty parses")
                .is_empty()
        );
    }

    #[test]
    fn target_ports_are_sorted_and_deduplicated() {
        assert_eq!(target("a=b", &[8001, 8000, 8001]).ports(), &[8000, 8001]);
    }
}
