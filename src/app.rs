//! Wiring of `kvroute serve`: binds every listener first (so a bad address fails
//! before anything runs, and tests can bind port 0), then runs discovery, scraping,
//! snapshot publishing, the ext_proc and health gRPC services, the gRPC admin API
//! (decision tap), the metrics and the debug HTTP servers until shutdown, letting open
//! request streams drain.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use kvroute_core::fleet::Snapshot;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tracing::{info, warn};

use crate::admin::AdminService;
use crate::admin::pb::ListEndpointsResponse;
use crate::config::{GrpcKeepalive, GrpcTls, ServeConfig};
use crate::discovery::Discovery;
use crate::extproc::{ExtProcService, OpenStreams, RequestPolicy};
use crate::kvevents::{KvEventsManager, PreciseIndex};
use crate::listener::ConnectionCap;
use crate::picker::{LivePicker, PreciseRouting};
use crate::scrape::ScrapeManager;
use crate::shutdown;
use crate::store::PodStore;
use crate::telemetry;
use crate::tokenize::{LocalTokenizers, PodTokenizer};
use tokio_rustls::TlsConnector;

/// gRPC health service names, as the Gateway API Inference Extension's picker uses.
pub const LIVENESS_SERVICE: &str = "liveness";
pub const READINESS_SERVICE: &str = "readiness";
pub const EXTPROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// Addresses the running server listens on (useful when configured with port 0).
#[derive(Debug, Clone, Copy)]
pub struct BoundAddrs {
    pub grpc: SocketAddr,
    pub health: Option<SocketAddr>,
    /// The gRPC admin API, unless switched off.
    pub admin: Option<SocketAddr>,
    pub metrics: SocketAddr,
    /// The debug pages, unless switched off.
    pub debug: Option<SocketAddr>,
}

/// A bound, not yet running, kvroute server.
pub struct App {
    config: ServeConfig,
    grpc: TcpListener,
    health: Option<TcpListener>,
    admin: Option<TcpListener>,
    metrics: TcpListener,
    debug: Option<TcpListener>,
    store: Arc<PodStore>,
    picker: Arc<LivePicker>,
    /// The index fed by the pods' KV events, when the prefix source uses them.
    precise: Option<Arc<PreciseIndex>>,
    /// TLS to the pods (`--pod-ca-bundle`), for the scrapes and the tokenizations alike.
    pod_tls: Option<TlsConnector>,
    prometheus: PrometheusHandle,
    discovery: Discovery,
}

async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} ({what})"))
}

impl App {
    pub async fn bind(config: ServeConfig) -> anyhow::Result<App> {
        config.validate()?;
        // A model's tokenizer and the pods' CA bundle are read (and bad ones refused)
        // before anything binds. Pods are addressed by IP on the cluster network.
        let local_tokenizers =
            LocalTokenizers::load(&config.tokenizers, config.tokenizer_cache_bytes)?
                .checking_every(config.tokenizer_check_every);
        let pod_tls = config
            .scrape
            .pod_ca_bundle
            .as_deref()
            .map(crate::scrape::tls_connector)
            .transpose()?;
        let discovery = Discovery::connect(&config.discovery()).await?;
        let prometheus = telemetry::install(config.idle_gauge_timeout)?;
        let grpc = bind(config.grpc_addr, "--grpc-addr").await?;
        let health = match config.health_addr {
            Some(addr) => Some(bind(addr, "--health-addr").await?),
            None => None,
        };
        let admin = match config.admin_addr {
            Some(addr) => Some(bind(addr, "--admin-addr").await?),
            None => None,
        };
        let metrics = bind(config.metrics_addr, "--metrics-addr").await?;
        let debug = match config.debug_addr {
            Some(addr) => Some(bind(addr, "--debug-addr").await?),
            None => None,
        };
        let store = Arc::new(PodStore::new(config.health));
        let picker = Arc::new(LivePicker::new(
            Arc::clone(&store),
            config.scheduler.clone(),
            config.debug_decisions,
            config.prefix_index_bytes,
            Arc::new(config.flow.clone()),
        ));
        let precise = if config.prefix_source.uses_events() {
            let index = Arc::new(PreciseIndex::with_budget(config.kv_events_index_bytes));
            picker.match_on_events(PreciseRouting::new(
                Arc::clone(&index),
                config.prefix_source,
                // Prompts are tokenized on the pods over HTTPS where they are scraped so.
                PodTokenizer::new(
                    config.tokenize_timeout,
                    config.scrape.pod_api_key.clone(),
                    pod_tls.clone(),
                ),
                local_tokenizers,
            ));
            Some(index)
        } else {
            None
        };
        Ok(App {
            config,
            grpc,
            health,
            admin,
            metrics,
            debug,
            store,
            picker,
            precise,
            pod_tls,
            prometheus,
            discovery,
        })
    }

    pub fn addrs(&self) -> anyhow::Result<BoundAddrs> {
        Ok(BoundAddrs {
            grpc: self.grpc.local_addr()?,
            health: self
                .health
                .as_ref()
                .map(TcpListener::local_addr)
                .transpose()?,
            admin: self
                .admin
                .as_ref()
                .map(TcpListener::local_addr)
                .transpose()?,
            metrics: self.metrics.local_addr()?,
            debug: self
                .debug
                .as_ref()
                .map(TcpListener::local_addr)
                .transpose()?,
        })
    }

    /// The pod store, to observe snapshots (tests, embedding).
    pub fn store(&self) -> Arc<PodStore> {
        Arc::clone(&self.store)
    }

    /// Runs until `shutdown` completes, then drains.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let App {
            config,
            grpc,
            health,
            admin,
            metrics,
            debug,
            store,
            picker,
            precise,
            pod_tls,
            prometheus,
            discovery,
        } = self;

        let grpc_tls = config.grpc_tls.as_ref().map(server_tls).transpose()?;
        let scrapers = ScrapeManager::new(Arc::clone(&store), config.scrape.clone(), pod_tls)
            .context("cannot build the HTTP client for scraping")?;
        let subscribers = precise
            .map(|index| KvEventsManager::new(Arc::clone(&store), index, config.kv_events.clone()));
        let reconciler = tokio::spawn(apply_endpoints(
            discovery.start(),
            Arc::clone(&store),
            scrapers,
            subscribers,
        ));
        let publisher = tokio::spawn(Arc::clone(&store).run_publisher(config.scrape.interval));
        let waiting_room = tokio::spawn(Arc::clone(&picker).run_waiting_room());
        let metrics_upkeep = tokio::spawn(telemetry::run_upkeep(
            prometheus.clone(),
            telemetry::UPKEEP_INTERVAL,
        ));

        let (reporter, health_service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status(LIVENESS_SERVICE, ServingStatus::Serving)
            .await;
        // Not ready until a pod is scraped, unless flow control holds requests until a pod
        // is ready (scale from zero, a rollout): then kvroute can take requests before any
        // pod is. Said before the servers start, so the first probe finds it whether or not
        // the readiness task has run yet.
        let holds_for_endpoints = config.flow.queues() && config.flow.hold_without_endpoints;
        let initially = if holds_for_endpoints {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in [EXTPROC_SERVICE, "", READINESS_SERVICE] {
            reporter.set_service_status(service, initially).await;
        }
        let readiness = tokio::spawn(track_readiness(
            Arc::clone(&store),
            reporter.clone(),
            holds_for_endpoints,
        ));
        let (stop, abort) = (shutdown::phase(), shutdown::phase());
        let (stopping, aborting) = (stop.1, abort.1);
        let policy = RequestPolicy::new(config.max_body_bytes, &config.allowed_paths)
            .with_held_body_budget(config.max_held_body_bytes)
            .with_read_timeout(config.request_read_timeout)
            .with_max_silent_streams(config.max_silent_streams)
            .with_flow(Arc::new(config.flow.clone()));
        let extproc = ExtProcService::new(Arc::clone(&picker), policy, aborting.clone());
        let shutdown_driver = tokio::spawn(drive_shutdown(
            shutdown,
            reporter,
            (stop.0, abort.0),
            Drain {
                timeout: config.drain_timeout,
                grace: config.drain_grace,
                open_streams: extproc.open_streams(),
            },
        ));
        let admin_api =
            AdminService::new(Arc::clone(&picker), Arc::clone(&store), stopping.clone());
        let metrics_state = MetricsState {
            prometheus,
            picker: Arc::clone(&picker),
        };
        let debug_state = DebugState {
            picker,
            store: Arc::clone(&store),
        };
        let connections = GrpcConnections {
            keepalive: config.grpc_keepalive,
            max_streams: config.grpc_max_streams_per_connection,
            max_connections: config.max_connections,
            tls: None,
        };
        let max_connections = config.max_connections;
        let result = tokio::try_join!(
            // The ext_proc port keeps accepting until the drain deadline: readiness is
            // already off, so gateways stop opening streams, and any that still arrive
            // are routed rather than refused (which a fail-closed gateway turns into 500).
            serve_grpc(
                grpc,
                "ext_proc",
                &aborting,
                connections.with_tls(grpc_tls),
                |server| server
                    .add_service(health_service.clone())
                    .add_service(extproc.into_server())
            ),
            serve_optional_grpc(health, "health", &stopping, connections.clone(), |server| {
                server.add_service(health_service.clone())
            }),
            // Watch streams end on the stop signal, so this server drains at once.
            serve_optional_grpc(
                admin,
                "admin API",
                &stopping,
                connections.clone(),
                |server| { server.add_service(admin_api.into_server()) }
            ),
            serve_http(
                metrics,
                ConnectionCap::new("metrics", max_connections),
                metrics_router(metrics_state),
                &stopping
            ),
            serve_optional_http(
                debug,
                ConnectionCap::new("debug pages", max_connections),
                debug_router(debug_state),
                &stopping
            ),
        );
        publisher.abort();
        waiting_room.abort();
        metrics_upkeep.abort();
        readiness.abort();
        shutdown_driver.abort();
        // Stops discovery (its channel closes) and the scrapers the task owns.
        reconciler.abort();
        let _ = reconciler.await;
        info!("stopped");
        result.map(|_| ())
    }
}

/// How the ext_proc streams drain on shutdown.
struct Drain {
    /// The latest end of the drain.
    timeout: Duration,
    /// New streams are still expected this long (gateways noticing readiness is off).
    grace: Duration,
    open_streams: OpenStreams,
}

/// Waits for `shutdown`, then: readiness off and the stop phase; the abort phase (see
/// `shutdown`) once the grace has passed and no stream is open, or at the drain timeout.
/// Ending early matters to a single kvroute restarted in place: a fail-closed gateway has
/// no picker until it is back.
async fn drive_shutdown(
    shutdown: impl Future<Output = ()>,
    reporter: HealthReporter,
    (stop, abort): (shutdown::Trigger, shutdown::Trigger),
    drain: Drain,
) {
    shutdown.await;
    info!(timeout = ?drain.timeout, grace = ?drain.grace, "shutting down: draining open requests");
    let deadline = tokio::time::Instant::now() + drain.timeout;
    for service in [READINESS_SERVICE, EXTPROC_SERVICE, ""] {
        reporter
            .set_service_status(service, ServingStatus::NotServing)
            .await;
    }
    stop.fire();
    tokio::time::sleep(drain.grace.min(drain.timeout)).await;
    tokio::select! {
        () = tokio::time::sleep_until(deadline) => {
            info!("drain timeout: ending the requests still open");
        }
        () = drain.open_streams.none_open() => info!("drained: no request open"),
    }
    abort.fire();
}

/// What every accepted gRPC connection gets.
#[derive(Debug, Clone)]
struct GrpcConnections {
    keepalive: GrpcKeepalive,
    /// Streams open at once on one connection.
    max_streams: u32,
    /// Connections open at once on the listener.
    max_connections: usize,
    tls: Option<ServerTlsConfig>,
}

impl GrpcConnections {
    fn with_tls(&self, tls: Option<ServerTlsConfig>) -> GrpcConnections {
        GrpcConnections {
            tls,
            ..self.clone()
        }
    }
}

/// Longest a TLS handshake on the ext_proc port may take: Envoy completes one in
/// milliseconds on a cluster network.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The ext_proc port's TLS settings, read from the files `tls` names.
fn server_tls(tls: &GrpcTls) -> anyhow::Result<ServerTlsConfig> {
    let read = |path: &std::path::Path, flag: &str| {
        std::fs::read(path).with_context(|| format!("cannot read {flag} {}", path.display()))
    };
    let identity = Identity::from_pem(
        read(&tls.cert, "--grpc-tls-cert")?,
        read(&tls.key, "--grpc-tls-key")?,
    );
    // A connection that never finishes its handshake (a client speaking plain text, or
    // nothing) would otherwise hold its accept task and socket for ever.
    let mut config = ServerTlsConfig::new()
        .identity(identity)
        .timeout(TLS_HANDSHAKE_TIMEOUT);
    if let Some(ca) = &tls.client_ca {
        config = config.client_ca_root(Certificate::from_pem(read(ca, "--grpc-tls-client-ca")?));
    }
    Ok(config)
}

/// Serves the gRPC services `add` puts on a server, until `stop` fires.
async fn serve_grpc(
    listener: TcpListener,
    what: &'static str,
    stop: &shutdown::Phase,
    connections: GrpcConnections,
    add: impl FnOnce(&mut tonic::transport::Server) -> tonic::transport::server::Router,
) -> anyhow::Result<()> {
    info!(addr = %listener.local_addr()?, "{what} gRPC listening");
    let keepalive = connections.keepalive;
    // Pings close the connection of a peer that vanished without a FIN (a node lost, a
    // path black-holed); its streams end and release their requests' accounting. The
    // stream limit bounds what one connection can hold open.
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = connections.tls {
        server = server
            .tls_config(tls)
            .with_context(|| format!("{what}: invalid TLS certificate or key"))?;
    }
    let mut server = server
        .http2_keepalive_interval(Some(keepalive.interval))
        .http2_keepalive_timeout(Some(keepalive.timeout))
        .max_concurrent_streams(connections.max_streams);
    let incoming = ConnectionCap::new(what, connections.max_connections)
        .incoming(incoming(listener).with_keepalive(Some(keepalive.interval)));
    add(&mut server)
        .serve_with_incoming_shutdown(incoming, stop.clone().into_fired())
        .await
        .with_context(|| format!("{what} server failed"))
}

/// [`serve_grpc`] for a listener that may be switched off.
async fn serve_optional_grpc(
    listener: Option<TcpListener>,
    what: &'static str,
    stop: &shutdown::Phase,
    connections: GrpcConnections,
    add: impl FnOnce(&mut tonic::transport::Server) -> tonic::transport::server::Router,
) -> anyhow::Result<()> {
    match listener {
        Some(listener) => serve_grpc(listener, what, stop, connections, add).await,
        None => Ok(()),
    }
}

/// Serves `router` until `stop` fires.
async fn serve_http(
    listener: TcpListener,
    cap: ConnectionCap,
    router: axum::Router,
    stop: &shutdown::Phase,
) -> anyhow::Result<()> {
    let what = cap.name();
    info!(addr = %listener.local_addr()?, "{what} HTTP listening");
    axum::serve(cap.listener(listener), router)
        .with_graceful_shutdown(stop.clone().into_fired())
        .await
        .with_context(|| format!("{what} server failed"))
}

/// [`serve_http`] for a listener that may be switched off.
async fn serve_optional_http(
    listener: Option<TcpListener>,
    cap: ConnectionCap,
    router: axum::Router,
    stop: &shutdown::Phase,
) -> anyhow::Result<()> {
    match listener {
        Some(listener) => serve_http(listener, cap, router, stop).await,
        None => Ok(()),
    }
}

/// Applies every endpoint set that discovery sends: the store drops removed endpoints
/// with their in-flight accounting and adds new ones (down until scraped), its
/// publisher rebuilds the snapshot, and the scrapers (and KV event subscribers) follow.
/// Owns them: they stop when this task is aborted.
async fn apply_endpoints(
    mut endpoints: watch::Receiver<Vec<SocketAddr>>,
    store: Arc<PodStore>,
    scrapers: ScrapeManager,
    subscribers: Option<KvEventsManager>,
) {
    loop {
        let current = endpoints.borrow_and_update().clone();
        if store.set_endpoints(&current) {
            scrapers.reconcile();
            if let Some(subscribers) = &subscribers {
                subscribers.reconcile();
            }
            info!(endpoints = current.len(), "endpoint set changed");
        }
        if endpoints.changed().await.is_err() {
            // A static list sends once and closes: keep scraping what it gave.
            std::future::pending::<()>().await;
        }
    }
}

/// Accepted gRPC connections with Nagle off: ext_proc messages are small and each
/// waits for the other side, so delayed ACKs would add ~40 ms per request.
fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Serves readiness (and the ext_proc service's status) only while some pod has
/// been scraped: before that every request would fail.
async fn track_readiness(
    store: Arc<PodStore>,
    reporter: HealthReporter,
    holds_for_endpoints: bool,
) {
    let mut fleets = store.subscribe();
    let mut ready = None;
    let mut metrics_seen = None;
    loop {
        let fleet = Arc::clone(&fleets.borrow_and_update());
        let snapshot = fleet.snapshot();
        let healthy = snapshot.pods().iter().filter(|p| p.healthy).count();
        let oldest = snapshot
            .pods()
            .iter()
            .filter(|p| p.healthy)
            .filter_map(|p| p.metrics_age)
            .max();
        telemetry::record_fleet(healthy, snapshot.pods().len() - healthy, oldest);
        let has_metrics = snapshot.has_metrics();
        let now_ready = has_metrics || holds_for_endpoints;
        if ready != Some(now_ready) {
            let status = if now_ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            // Readiness last: whoever sees it flip finds the other services flipped too.
            for service in [EXTPROC_SERVICE, "", READINESS_SERVICE] {
                reporter.set_service_status(service, status).await;
            }
            ready = Some(now_ready);
        }
        if metrics_seen != Some(has_metrics) {
            match (has_metrics, holds_for_endpoints) {
                (true, _) => info!(healthy, "ready: endpoint metrics available"),
                (false, true) => info!(
                    "no endpoint is ready (yet): requests wait up to --max-queue-wait for one"
                ),
                (false, false) if metrics_seen.is_some() => {
                    warn!("not ready: no endpoint is healthy");
                }
                (false, false) => {}
            }
            metrics_seen = Some(has_metrics);
        }
        if fleets.changed().await.is_err() {
            return;
        }
    }
}

/// What the debug pages read.
#[derive(Clone)]
struct DebugState {
    picker: Arc<LivePicker>,
    store: Arc<PodStore>,
}

/// What `/metrics` reads beyond the recorder: gauges read when scraped.
#[derive(Clone)]
struct MetricsState {
    prometheus: PrometheusHandle,
    picker: Arc<LivePicker>,
}

/// `/metrics` only: this port is scraped from anywhere in the cluster.
fn metrics_router(state: MetricsState) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(render_metrics))
        .with_state(state)
}

fn debug_router(state: DebugState) -> axum::Router {
    axum::Router::new()
        .route("/debug/decisions", get(recent_decisions))
        .route("/debug/endpoints", get(current_endpoints))
        .with_state(state)
}

async fn render_metrics(
    State(MetricsState { prometheus, picker }): State<MetricsState>,
) -> impl IntoResponse {
    telemetry::record_allocator_stats();
    telemetry::touch_standing_series();
    let (entries, capacity) = picker.prefix_index_size();
    telemetry::record_prefix_index(entries, capacity);
    if let Some(entries) = picker.event_index_size() {
        telemetry::record_kv_event_index(entries);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        prometheus.render(),
    )
}

async fn recent_decisions(State(state): State<DebugState>) -> axum::response::Response {
    let log = state.picker.decisions();
    if !log.enabled() {
        let message = serde_json::json!({"error": {
            "message": "the decision log is off; start kvroute with --debug-decisions N",
            "type": "not_found_error", "code": "decision_log_disabled"}});
        return (StatusCode::NOT_FOUND, axum::Json(message)).into_response();
    }
    axum::Json(log.recent()).into_response()
}

/// The same projection of the fleet as the admin API's `ListEndpoints`.
async fn current_endpoints(State(state): State<DebugState>) -> axum::Json<ListEndpointsResponse> {
    axum::Json(crate::admin::endpoints(&state.store.fleet()))
}

/// Resolves on Ctrl-C or SIGTERM (what Kubernetes sends to stop a pod).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Waits until the store publishes a snapshot that satisfies `ready`, or times out.
pub async fn wait_for_snapshot(
    store: &PodStore,
    timeout: Duration,
    ready: impl Fn(&Snapshot) -> bool,
) -> bool {
    let mut fleets = store.subscribe();
    let deadline = Instant::now() + timeout;
    tokio::time::timeout_at(deadline.into(), fleets.wait_for(|f| ready(f.snapshot())))
        .await
        .is_ok_and(|r| r.is_ok())
}
