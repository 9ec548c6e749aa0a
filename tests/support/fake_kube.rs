//! An in-process fake Kubernetes API server for discovery tests, speaking the real
//! list/watch protocol for pods and InferencePools over plain HTTP on loopback:
//!
//! - `GET /api/v1/namespaces/NS/pods` and
//!   `GET /apis/inference.networking.k8s.io/v1/namespaces/NS/inferencepools` list the
//!   objects (filtered by `labelSelector` and `fieldSelector`) with the list's
//!   `metadata.resourceVersion`; list items carry no `kind`/`apiVersion`, as the real
//!   server sends them.
//! - `?watch=true&resourceVersion=N` streams one JSON watch event per line (`ADDED`,
//!   `MODIFIED`, `DELETED`, `BOOKMARK` when `allowWatchBookmarks=true`): first the
//!   retained changes after N, then live ones. An object that stops matching the
//!   selector arrives as `DELETED`, one that starts matching as `ADDED`.
//! - A version older than the compaction point gets an `ERROR` event carrying a
//!   `Status` with code 410 (reason `Expired`), then the stream ends.
//! - The test can close every open watch cleanly (as the server does at
//!   `timeoutSeconds`) or break the connections mid-stream, hide changes from open
//!   watches (a partition), compact the history, and send bookmarks.
//!
//! Resource versions are one counter across all resources, as etcd's are.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;

/// The resources the fake serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Pods,
    InferencePools,
}

impl Resource {
    fn api_version(self) -> &'static str {
        match self {
            Resource::Pods => "v1",
            Resource::InferencePools => "inference.networking.k8s.io/v1",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Resource::Pods => "Pod",
            Resource::InferencePools => "InferencePool",
        }
    }
}

/// Requests served, for tests to await and to check which path the client took.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    pub lists: HashMap<Resource, usize>,
    pub watches: HashMap<Resource, usize>,
    /// Watches answered with a 410 `ERROR` event.
    pub expired: HashMap<Resource, usize>,
    /// The `labelSelector` of every pod list and watch, in order.
    pub pod_selectors: Vec<String>,
    /// Watch streams open now.
    pub open_watches: usize,
}

impl Counters {
    pub fn lists(&self, resource: Resource) -> usize {
        self.lists.get(&resource).copied().unwrap_or(0)
    }

    pub fn watches(&self, resource: Resource) -> usize {
        self.watches.get(&resource).copied().unwrap_or(0)
    }

    pub fn expired(&self, resource: Resource) -> usize {
        self.expired.get(&resource).copied().unwrap_or(0)
    }
}

#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    resource: Resource,
    namespace: String,
    /// The object before the change (`None` when created).
    old: Option<Value>,
    /// The object after the change; for a deletion, its last state.
    new: Value,
    deleted: bool,
}

#[derive(Debug, Clone)]
enum Signal {
    Change(Change),
    Bookmark(u64),
    /// End every open watch: cleanly (`true`) or by breaking the connection.
    Close {
        clean: bool,
    },
}

type Key = (Resource, String, String);

#[derive(Default)]
struct Inner {
    rv: u64,
    /// Watches from versions below this get 410.
    compacted: u64,
    objects: BTreeMap<Key, Value>,
    history: Vec<Change>,
    /// While true, changes are kept but not sent to open watches.
    partitioned: bool,
}

struct Shared {
    inner: Mutex<Inner>,
    signals: broadcast::Sender<Signal>,
    counters: watch::Sender<Counters>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().expect("fake kube lock")
    }
}

/// The fake API server, on `127.0.0.1:PORT`.
pub struct FakeKube {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
}

impl FakeKube {
    pub async fn start() -> FakeKube {
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner::default()),
            signals: broadcast::channel(1024).0,
            counters: watch::Sender::new(Counters::default()),
        });
        let router = axum::Router::new()
            .route("/api/v1/namespaces/{namespace}/pods", get(pods))
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools",
                get(pools),
            )
            .fallback(not_found)
            .with_state(Arc::clone(&shared));
        let (addr, stop) = crate::support::serve_on_loopback(router).await;
        FakeKube {
            addr,
            shared,
            stop: Some(stop),
        }
    }

    /// A client configuration pointing at this server (plain HTTP, no auth).
    pub fn client_config(&self) -> kube::Config {
        let url = format!("http://{}", self.addr).parse().expect("url");
        let mut config = kube::Config::new(url);
        config.connect_timeout = Some(Duration::from_secs(2));
        config
    }

    /// Creates or replaces the object named by `object.metadata.name` in `namespace`.
    /// Returns the new resourceVersion.
    pub fn apply(&self, resource: Resource, namespace: &str, mut object: Value) -> u64 {
        let name = object["metadata"]["name"]
            .as_str()
            .expect("metadata.name")
            .to_owned();
        let mut inner = self.shared.lock();
        inner.rv += 1;
        let rv = inner.rv;
        object["metadata"]["namespace"] = namespace.into();
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        object["metadata"]
            .as_object_mut()
            .expect("metadata object")
            .entry("uid")
            .or_insert_with(|| format!("uid-{namespace}-{name}").into());
        let key = (resource, namespace.to_owned(), name);
        let old = inner.objects.insert(key, object.clone());
        self.record(
            inner,
            Change {
                rv,
                resource,
                namespace: namespace.to_owned(),
                old,
                new: object,
                deleted: false,
            },
        );
        rv
    }

    /// Deletes an object; returns whether it existed.
    pub fn delete(&self, resource: Resource, namespace: &str, name: &str) -> bool {
        let mut inner = self.shared.lock();
        let key = (resource, namespace.to_owned(), name.to_owned());
        let Some(mut last) = inner.objects.remove(&key) else {
            return false;
        };
        inner.rv += 1;
        let rv = inner.rv;
        last["metadata"]["resourceVersion"] = rv.to_string().into();
        self.record(
            inner,
            Change {
                rv,
                resource,
                namespace: namespace.to_owned(),
                old: Some(last.clone()),
                new: last,
                deleted: true,
            },
        );
        true
    }

    fn record(&self, mut inner: MutexGuard<'_, Inner>, change: Change) {
        inner.history.push(change.clone());
        if !inner.partitioned {
            // Sent under the lock, so a watch that subscribes later has the change
            // in its backlog instead.
            let _ = self.shared.signals.send(Signal::Change(change));
        }
    }

    /// While `on`, changes are stored but open watches do not see them.
    pub fn partition(&self, on: bool) {
        self.shared.lock().partitioned = on;
    }

    /// Forgets the history: watches from any version before now get 410 Gone.
    pub fn compact(&self) {
        let mut inner = self.shared.lock();
        inner.compacted = inner.rv;
        inner.history.clear();
    }

    /// Sends a BOOKMARK at the current resourceVersion to watches that allow them.
    pub fn bookmark(&self) -> u64 {
        let inner = self.shared.lock();
        let _ = self.shared.signals.send(Signal::Bookmark(inner.rv));
        inner.rv
    }

    /// Ends every open watch with a complete response (as at `timeoutSeconds`).
    pub fn close_watches(&self) {
        let _inner = self.shared.lock();
        let _ = self.shared.signals.send(Signal::Close { clean: true });
    }

    /// Breaks every open watch connection mid-response.
    pub fn break_watches(&self) {
        let _inner = self.shared.lock();
        let _ = self.shared.signals.send(Signal::Close { clean: false });
    }

    pub fn counters(&self) -> Counters {
        self.shared.counters.borrow().clone()
    }

    /// Waits until the counters satisfy `ready` (fails the test after 10 s).
    pub async fn wait_for(&self, what: &str, ready: impl Fn(&Counters) -> bool) {
        let mut counters = self.shared.counters.subscribe();
        let result =
            tokio::time::timeout(Duration::from_secs(10), counters.wait_for(|c| ready(c))).await;
        assert!(
            matches!(result, Ok(Ok(_))),
            "timed out waiting for the fake API server: {what}; counters {:?}",
            self.counters()
        );
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        let _ = self.shared.signals.send(Signal::Close { clean: false });
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A pod as the kubelet reports it: `Ready` condition, `podIP`, labels.
pub fn pod(name: &str, ip: Option<&str>, ready: bool, labels: &[(&str, &str)]) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), Value::from(*v)))
        .collect();
    let mut status = json!({
        "phase": "Running",
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": if ready { "True" } else { "False" }},
            {"type": "Ready", "status": if ready { "True" } else { "False" }},
            {"type": "PodScheduled", "status": "True"},
        ],
    });
    if let Some(ip) = ip {
        status["podIP"] = ip.into();
        status["podIPs"] = json!([{ "ip": ip }]);
    }
    json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": status,
    })
}

/// An InferencePool (v1) selecting `labels`, routing to `ports`.
pub fn pool(name: &str, labels: &[(&str, &str)], ports: &[u16]) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), Value::from(*v)))
        .collect();
    let ports: Vec<Value> = ports.iter().map(|p| json!({ "number": p })).collect();
    json!({
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": ports,
            "endpointPickerRef": {"name": "kvroute", "port": {"number": 9002}, "failureMode": "FailClose"},
        },
    })
}

async fn pods(
    State(shared): State<Arc<Shared>>,
    Path(namespace): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    serve(shared, Resource::Pods, namespace, query)
}

async fn pools(
    State(shared): State<Arc<Shared>>,
    Path(namespace): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    serve(shared, Resource::InferencePools, namespace, query)
}

async fn not_found() -> Response {
    status_response(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource",
    )
}

fn status_json(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

fn status_response(status: StatusCode, reason: &str, message: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        status_json(status.as_u16(), reason, message).to_string(),
    )
        .into_response()
}

/// `labelSelector` (`k=v`, `k==v`, `k!=v`, comma-separated) and `fieldSelector`
/// (`metadata.name`, `metadata.namespace`).
#[derive(Debug, Default)]
struct Filter {
    labels: Vec<(String, String, bool)>,
    fields: Vec<(String, String, bool)>,
}

fn parse_terms(text: Option<&String>) -> Result<Vec<(String, String, bool)>, String> {
    let mut terms = Vec::new();
    for term in text.map(String::as_str).unwrap_or("").split(',') {
        let term = term.trim();
        if term.is_empty() {
            continue;
        }
        let (key, value, equal) = if let Some((k, v)) = term.split_once("!=") {
            (k, v, false)
        } else if let Some((k, v)) = term.split_once("==") {
            (k, v, true)
        } else if let Some((k, v)) = term.split_once('=') {
            (k, v, true)
        } else {
            return Err(format!("unable to parse requirement: {term}"));
        };
        terms.push((key.trim().to_owned(), value.trim().to_owned(), equal));
    }
    Ok(terms)
}

impl Filter {
    fn parse(query: &HashMap<String, String>) -> Result<Filter, String> {
        let fields = parse_terms(query.get("fieldSelector"))?;
        if let Some((field, _, _)) = fields
            .iter()
            .find(|(f, _, _)| f != "metadata.name" && f != "metadata.namespace")
        {
            return Err(format!("field label not supported: {field}"));
        }
        Ok(Filter {
            labels: parse_terms(query.get("labelSelector"))?,
            fields,
        })
    }

    fn matches(&self, object: &Value) -> bool {
        let metadata = &object["metadata"];
        let labels_ok = self.labels.iter().all(|(key, value, equal)| {
            (metadata["labels"][key].as_str() == Some(value.as_str())) == *equal
        });
        let fields_ok = self.fields.iter().all(|(field, value, equal)| {
            let actual = match field.as_str() {
                "metadata.name" => metadata["name"].as_str(),
                _ => metadata["namespace"].as_str(),
            };
            (actual == Some(value.as_str())) == *equal
        });
        labels_ok && fields_ok
    }
}

fn serve(
    shared: Arc<Shared>,
    resource: Resource,
    namespace: String,
    query: HashMap<String, String>,
) -> Response {
    let filter = match Filter::parse(&query) {
        Ok(filter) => filter,
        Err(message) => return status_response(StatusCode::BAD_REQUEST, "BadRequest", &message),
    };
    let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    if resource == Resource::Pods {
        let selector = query.get("labelSelector").cloned().unwrap_or_default();
        shared
            .counters
            .send_modify(|c| c.pod_selectors.push(selector));
    }
    if watching {
        start_watch(shared, resource, namespace, filter, &query)
    } else {
        list(&shared, resource, &namespace, &filter)
    }
}

fn list(shared: &Shared, resource: Resource, namespace: &str, filter: &Filter) -> Response {
    let inner = shared.lock();
    let items: Vec<Value> = inner
        .objects
        .iter()
        .filter(|((r, ns, _), object)| *r == resource && ns == namespace && filter.matches(object))
        .map(|(_, object)| object.clone())
        .collect();
    let body = json!({
        "kind": format!("{}List", resource.kind()),
        "apiVersion": resource.api_version(),
        "metadata": {"resourceVersion": inner.rv.to_string()},
        "items": items,
    });
    drop(inner);
    shared
        .counters
        .send_modify(|c| *c.lists.entry(resource).or_default() += 1);
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The event `change` is for a watch with `filter` in `namespace`, if any.
fn event_for(
    change: &Change,
    resource: Resource,
    namespace: &str,
    filter: &Filter,
) -> Option<Value> {
    if change.resource != resource || change.namespace != namespace {
        return None;
    }
    let was = change.old.as_ref().is_some_and(|old| filter.matches(old));
    let is = filter.matches(&change.new);
    let kind = match (change.deleted, was, is) {
        (true, _, true) => "DELETED",
        (true, _, false) => return None,
        (false, true, true) => "MODIFIED",
        (false, false, true) => "ADDED",
        // Left the selection: the watcher sees it go.
        (false, true, false) => "DELETED",
        (false, false, false) => return None,
    };
    Some(event(kind, resource, change.new.clone()))
}

fn event(kind: &str, resource: Resource, mut object: Value) -> Value {
    object["kind"] = resource.kind().into();
    object["apiVersion"] = resource.api_version().into();
    json!({ "type": kind, "object": object })
}

fn line(value: &Value) -> Result<Bytes, std::io::Error> {
    let mut text = value.to_string();
    text.push('\n');
    Ok(Bytes::from(text))
}

fn start_watch(
    shared: Arc<Shared>,
    resource: Resource,
    namespace: String,
    filter: Filter,
    query: &HashMap<String, String>,
) -> Response {
    let bookmarks = query.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let from = match query.get("resourceVersion").map(String::as_str) {
        None | Some("" | "0") => None,
        Some(text) => match text.parse::<u64>() {
            Ok(rv) => Some(rv),
            Err(_) => {
                return status_response(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("invalid resource version: {text}"),
                );
            }
        },
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(256);
    let body = Body::from_stream(ReceiverStream::new(rx));
    let response = ([(header::CONTENT_TYPE, "application/json")], body).into_response();

    // Under the lock: subscribe, then take the backlog, so nothing falls between.
    let inner = shared.lock();
    shared
        .counters
        .send_modify(|c| *c.watches.entry(resource).or_default() += 1);
    if let Some(rv) = from
        && rv < inner.compacted
    {
        let message = format!("too old resource version: {rv} ({})", inner.compacted);
        drop(inner);
        shared
            .counters
            .send_modify(|c| *c.expired.entry(resource).or_default() += 1);
        let error = json!({"type": "ERROR", "object": status_json(410, "Expired", &message)});
        let _ = tx.try_send(line(&error));
        return response;
    }
    let mut signals = shared.signals.subscribe();
    let mut last_sent = inner.rv;
    let backlog: Vec<Value> = match from {
        Some(rv) => inner
            .history
            .iter()
            .filter(|c| c.rv > rv)
            .filter_map(|c| event_for(c, resource, &namespace, &filter))
            .collect(),
        // No version: the current state as ADDED events, then changes.
        None => inner
            .objects
            .iter()
            .filter(|((r, ns, _), o)| *r == resource && *ns == namespace && filter.matches(o))
            .map(|(_, o)| event("ADDED", resource, o.clone()))
            .collect(),
    };
    drop(inner);

    shared.counters.send_modify(|c| c.open_watches += 1);
    tokio::spawn(async move {
        let mut ok = true;
        for event in &backlog {
            ok &= tx.send(line(event)).await.is_ok();
        }
        while ok {
            let next = tokio::select! {
                signal = signals.recv() => signal,
                () = tx.closed() => break,
            };
            let item = match next {
                Ok(Signal::Change(change)) if change.rv > last_sent => {
                    last_sent = change.rv;
                    event_for(&change, resource, &namespace, &filter)
                }
                Ok(Signal::Change(_)) => None,
                Ok(Signal::Bookmark(rv)) if bookmarks => {
                    let mut object = json!({"metadata": {"resourceVersion": rv.to_string()}});
                    object["kind"] = resource.kind().into();
                    object["apiVersion"] = resource.api_version().into();
                    Some(json!({"type": "BOOKMARK", "object": object}))
                }
                Ok(Signal::Bookmark(_)) => None,
                Ok(Signal::Close { clean: true }) => break,
                Ok(Signal::Close { clean: false }) | Err(_) => {
                    let broken = std::io::Error::new(
                        std::io::ErrorKind::ConnectionReset,
                        "watch connection broken by the test",
                    );
                    let _ = tx.send(Err(broken)).await;
                    break;
                }
            };
            if let Some(event) = item {
                ok = tx.send(line(&event)).await.is_ok();
            }
        }
        shared.counters.send_modify(|c| c.open_watches -= 1);
    });
    response
}
