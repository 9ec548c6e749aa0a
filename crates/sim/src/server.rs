//! The fleet at run time: one engine driver task and one axum server per pod, on a shared clock.
//!
//! A pod's engine sits behind a `std::sync::Mutex` (held only for short, non-async sections).
//! Handlers add requests and get an unbounded channel of token events; the driver task sleeps
//! until the engine's next event (or a wake-up from a handler), advances the engine to the
//! scaled clock and forwards the events. Simulated time is `(wall elapsed) × speedup`; every
//! event carries its own simulated timestamp, so a late wake-up delays delivery, not the model.
//! A pod with KV events on hands each step's batch to its publisher (`kv_events::publisher`)
//! in the same places, without waiting.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::HeaderValue;
use axum::response::Response;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::api;
use super::config::FleetConfig;
use super::engine::{
    Engine, EngineLoad, Event, EventKind, KvEventBatch, RequestId, RequestSpec, SimTime, Summary,
};
use super::fault::MetricsFault;
use super::kv::mix;
use super::kv_events::{KvEventSink, PublisherTasks, publisher};
use super::tokenizer::HfTokenizer;

/// The simulated clock: `(wall elapsed since start) × speedup`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    start: Instant,
    speedup: f64,
}

impl Clock {
    /// Simulated time now.
    pub(crate) fn now(&self) -> SimTime {
        Duration::from_secs_f64(self.start.elapsed().as_secs_f64() * self.speedup)
    }

    /// The wall-clock instant at which simulated time reaches `t`.
    fn deadline(&self, t: SimTime) -> Instant {
        self.start + Duration::from_secs_f64(t.as_secs_f64() / self.speedup)
    }
}

/// What a request's channel carries.
#[derive(Debug)]
pub(crate) enum Out {
    /// Output token `index` was generated.
    Token { index: u32 },
    /// The request is complete.
    Done(Summary),
}

pub(crate) struct Core {
    pub(crate) engine: Engine,
    streams: HashMap<RequestId, mpsc::UnboundedSender<Out>>,
    /// Adapters this pod serves (static ones first, then loaded at run time).
    pub(crate) adapters: Vec<String>,
    scratch: Vec<Event>,
    /// Where KV event batches go, when the pod publishes them.
    kv_events: Option<KvEventSink>,
    kv_scratch: Vec<KvEventBatch>,
    closed: bool,
}

impl Core {
    /// Forwards the engine's events to their requests, and its KV event batches to the
    /// publisher; aborts requests whose client left.
    fn dispatch(&mut self, now: SimTime) {
        if let Some(sink) = &self.kv_events {
            self.engine.take_kv_events(&mut self.kv_scratch);
            for batch in self.kv_scratch.drain(..) {
                sink.publish(batch);
            }
        }
        self.engine.take_events(&mut self.scratch);
        let mut gone = Vec::new();
        for ev in self.scratch.drain(..) {
            let (out, last) = match ev.kind {
                EventKind::Token { index, .. } => (Out::Token { index }, false),
                EventKind::Finished(s) => (Out::Done(*s), true),
            };
            if last {
                if let Some(tx) = self.streams.remove(&ev.id) {
                    let _ = tx.send(out);
                }
            } else if let Some(tx) = self.streams.get(&ev.id)
                && tx.send(out).is_err()
            {
                gone.push(ev.id);
            }
        }
        for id in gone {
            self.streams.remove(&id);
            self.engine.abort(now, id);
        }
    }
}

/// One simulated pod: its engine and what its HTTP handlers need.
pub(crate) struct Pod {
    pub(crate) index: usize,
    pub(crate) model: String,
    pub(crate) seed: u64,
    pub(crate) clock: Clock,
    pub(crate) epoch_unix: f64,
    pub(crate) created: u64,
    core: Mutex<Core>,
    wake: Notify,
    /// How `/metrics` answers; switched by the fault switch.
    pub(crate) metrics_fault: watch::Sender<MetricsFault>,
    /// The model's tokenizer (`--tokenizer`), shared by the fleet; None: the synthetic one.
    pub(crate) tokenizer: Option<Arc<HfTokenizer>>,
}

impl Pod {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a request; returns its id and its event channel (None once shut down).
    pub(crate) fn submit(
        &self,
        spec: RequestSpec,
    ) -> Option<(RequestId, mpsc::UnboundedReceiver<Out>)> {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = {
            let mut core = self.lock();
            if core.closed {
                return None;
            }
            let now = self.clock.now();
            let id = core.engine.add_request(now, spec);
            core.streams.insert(id, tx);
            core.dispatch(now);
            id
        };
        self.wake.notify_one();
        Some((id, rx))
    }

    /// Cancels a request whose client went away.
    pub(crate) fn abort(&self, id: RequestId) {
        let mut core = self.lock();
        if core.streams.remove(&id).is_some() {
            let now = self.clock.now();
            core.engine.abort(now, id);
        }
        drop(core);
        self.wake.notify_one();
    }

    /// Brings the engine up to now and reads its load.
    pub(crate) fn load(&self) -> EngineLoad {
        let mut core = self.lock();
        let now = self.clock.now();
        core.engine.advance(now);
        core.dispatch(now);
        core.engine.load()
    }

    /// Brings the engine up to now and renders `/metrics`.
    pub(crate) fn metrics(&self) -> String {
        let mut core = self.lock();
        let now = self.clock.now();
        core.engine.advance(now);
        core.dispatch(now);
        let mut text = super::metrics::render(
            &core.engine,
            super::metrics::RenderContext {
                model: &self.model,
                epoch_unix: self.epoch_unix,
            },
        );
        if let Some(sink) = &core.kv_events {
            super::metrics::render_kv_events(&mut text, &self.model, sink);
        }
        text
    }

    /// A response id unique in the fleet.
    pub(crate) fn response_id(&self, prefix: &str, id: RequestId) -> String {
        let a = mix(self.index as u64 + 1, id);
        let b = mix(self.seed ^ 0x5eed, a);
        format!("{prefix}-{a:016x}{b:016x}")
    }
}

async fn drive(pod: Arc<Pod>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let next = {
            let mut core = pod.lock();
            let now = pod.clock.now();
            core.engine.advance(now);
            core.dispatch(now);
            core.engine.next_event_time()
        };
        let sleep = async {
            match next {
                Some(t) => tokio::time::sleep_until(pod.clock.deadline(t)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = sleep => {}
            _ = pod.wake.notified() => {}
            _ = shutdown.changed() => break,
        }
    }
    let mut core = pod.lock();
    core.closed = true;
    core.streams.clear();
    // Dropping the sink lets the publisher send what is queued and stop.
    core.kv_events = None;
}

async fn add_pod_header(State(index): State<usize>, mut res: Response) -> Response {
    res.headers_mut()
        .insert("x-sim-pod", HeaderValue::from(index as u64));
    res
}

fn router(pod: Arc<Pod>, fault_switch: bool) -> Router {
    let index = pod.index;
    let mut routes = Router::new();
    if fault_switch {
        routes = routes.route("/kvroute-sim/faults", post(api::set_faults));
    }
    routes
        .route("/v1/completions", post(api::completions))
        .route("/v1/chat/completions", post(api::chat_completions))
        .route("/v1/completions/render", post(api::completions_render))
        .route("/v1/chat/completions/render", post(api::chat_render))
        .route("/tokenize", post(api::tokenize_endpoint))
        .route("/v1/models", get(api::models))
        .route("/v1/load_lora_adapter", post(api::load_lora))
        .route("/v1/unload_lora_adapter", post(api::unload_lora))
        .route("/health", get(api::health))
        .route("/metrics", get(api::metrics))
        .route("/get_load", get(api::get_load))
        .route("/server_info", get(api::server_info))
        .route("/get_server_info", get(api::server_info))
        .route("/model_info", get(api::model_info))
        .route("/get_model_info", get(api::model_info))
        .route("/version", get(api::version))
        .fallback(api::not_found)
        .layer(DefaultBodyLimit::max(64 << 20))
        .layer(axum::middleware::map_response_with_state(
            index,
            add_pod_header,
        ))
        .with_state(pod)
}

struct PodHandle {
    addr: SocketAddr,
    server: JoinHandle<()>,
    driver: JoinHandle<()>,
    kv_events: Option<(KvEventsEndpoints, PublisherTasks)>,
}

/// Where a pod publishes its KV cache events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsEndpoints {
    /// The PUB socket: `tcp://ADDR:PORT` as bound (the port resolved), or the endpoint it
    /// connects to.
    pub endpoint: String,
    /// The replay ROUTER socket as bound, if configured.
    pub replay_endpoint: Option<String>,
}

/// A running fleet of simulated pods, embeddable in tests, the demo and benchmarks.
pub struct SimFleet {
    pods: Vec<PodHandle>,
    shutdown: watch::Sender<bool>,
}

impl SimFleet {
    /// Binds every pod (port 0: an ephemeral port each; else `port + i`), and the KV event
    /// sockets of the pods that publish, and starts serving.
    pub async fn start(config: FleetConfig) -> anyhow::Result<SimFleet> {
        config.validate()?;
        // Loaded before any port is bound: a bad directory stops the start with its path.
        let tokenizer = match &config.tokenizer {
            Some(dir) => Some(Arc::new(
                HfTokenizer::load(dir).context("loading the tokenizer")?,
            )),
            None => None,
        };
        let mut listeners = Vec::with_capacity(config.pods.len());
        for i in 0..config.pods.len() {
            let port = if config.port == 0 {
                0
            } else {
                config.port + i as u16
            };
            let addr = SocketAddr::new(config.host, port);
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("pod {i}: cannot bind {addr}"))?;
            listeners.push(listener);
        }
        let clock = Clock {
            start: Instant::now(),
            speedup: config.speedup,
        };
        let epoch_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let (shutdown, _) = watch::channel(false);
        // Every socket is bound before any pod runs; on an error, dropping `shutdown` and the
        // sinks stops the publishers already started.
        let mut publishers = Vec::with_capacity(config.pods.len());
        for (i, pc) in config.pods.iter().enumerate() {
            let publisher = match pc.kv_events.as_ref().filter(|kv| kv.publishes()) {
                Some(kv) => Some(
                    publisher::start(kv, i, epoch_unix, shutdown.subscribe())
                        .await
                        .with_context(|| format!("pod {i}: KV events"))?,
                ),
                None => None,
            };
            publishers.push(publisher);
        }
        let mut pods = Vec::with_capacity(listeners.len());
        for (i, ((listener, pc), publisher)) in listeners
            .into_iter()
            .zip(&config.pods)
            .zip(publishers)
            .enumerate()
        {
            let addr = listener.local_addr()?;
            let index = config.first_pod_index + i;
            let mut engine_cfg = pc.engine.clone();
            engine_cfg.seed = mix(config.seed, index as u64);
            let mut engine = Engine::new(engine_cfg, pc.profile.clone());
            for a in &pc.preload_loras {
                engine.preload_adapter(a);
            }
            let (sink, kv_events) = match publisher {
                Some((sink, tasks)) => {
                    engine.set_kv_events(true);
                    let endpoints = KvEventsEndpoints {
                        endpoint: sink.endpoint.clone(),
                        replay_endpoint: sink.replay_endpoint.clone(),
                    };
                    (Some(sink), Some((endpoints, tasks)))
                }
                None => (None, None),
            };
            let pod = Arc::new(Pod {
                index,
                model: config.model.clone(),
                seed: config.seed,
                clock,
                epoch_unix,
                created: epoch_unix as u64,
                core: Mutex::new(Core {
                    engine,
                    streams: HashMap::new(),
                    adapters: pc.lora_adapters.clone(),
                    scratch: Vec::new(),
                    kv_events: sink,
                    kv_scratch: Vec::new(),
                    closed: false,
                }),
                wake: Notify::new(),
                metrics_fault: watch::Sender::new(MetricsFault::None),
                tokenizer: tokenizer.clone(),
            });
            let driver = tokio::spawn(drive(pod.clone(), shutdown.subscribe()));
            let mut stop = shutdown.subscribe();
            let app = router(pod, config.fault_switch);
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let server = tokio::spawn(async move {
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stop.changed().await;
                    })
                    .await;
            });
            pods.push(PodHandle {
                addr,
                server,
                driver,
                kv_events,
            });
        }
        Ok(SimFleet { pods, shutdown })
    }

    /// Where each pod listens, in pod order.
    pub fn endpoints(&self) -> Vec<SocketAddr> {
        self.pods.iter().map(|p| p.addr).collect()
    }

    /// Where each pod publishes its KV cache events (None: it does not), in pod order.
    pub fn kv_events_endpoints(&self) -> Vec<Option<KvEventsEndpoints>> {
        self.pods
            .iter()
            .map(|p| p.kv_events.as_ref().map(|(e, _)| e.clone()))
            .collect()
    }

    /// Stops the drivers (ending open streams), the servers and the KV event publishers
    /// (after they sent what was queued).
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for p in self.pods {
            let _ = p.driver.await;
            let _ = p.server.await;
            if let Some((_, tasks)) = p.kv_events {
                tasks.join().await;
            }
        }
    }
}
