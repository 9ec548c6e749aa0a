//! Wiring of `kvroute serve`: binds every listener first (so a bad address fails
//! before anything runs, and tests can bind port 0), then runs discovery, scraping,
//! snapshot publishing, the ext_proc and health gRPC services, the gRPC admin API
//! (decision tap) and the metrics/debug HTTP server until shutdown, letting open
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
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tracing::{info, warn};

use crate::admin::AdminService;
use crate::config::ServeConfig;
use crate::discovery::Discovery;
use crate::extproc::ExtProcService;
use crate::picker::LivePicker;
use crate::scrape::ScrapeManager;
use crate::state::PodStore;
use crate::telemetry;

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
}

/// A bound, not yet running, kvroute server.
pub struct App {
    config: ServeConfig,
    grpc: TcpListener,
    health: Option<TcpListener>,
    admin: Option<TcpListener>,
    metrics: TcpListener,
    store: Arc<PodStore>,
    picker: Arc<LivePicker>,
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
        let discovery = Discovery::connect(&config.discovery()).await?;
        let prometheus = telemetry::install().map_err(anyhow::Error::msg)?;
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
        let store = Arc::new(PodStore::new(config.health));
        let picker = Arc::new(LivePicker::new(
            Arc::clone(&store),
            config.scheduler.clone(),
            config.debug_decisions,
        ));
        Ok(App {
            config,
            grpc,
            health,
            admin,
            metrics,
            store,
            picker,
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
            store,
            picker,
            prometheus,
            discovery,
        } = self;

        let scrapers = ScrapeManager::new(Arc::clone(&store), config.scrape.clone())
            .context("cannot build the HTTP client for scraping")?;
        let reconciler = tokio::spawn(apply_endpoints(
            discovery.start(),
            Arc::clone(&store),
            scrapers,
        ));
        let publisher = tokio::spawn(Arc::clone(&store).run_publisher(config.scrape.interval));

        let (reporter, health_service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status(LIVENESS_SERVICE, ServingStatus::Serving)
            .await;
        let readiness = tokio::spawn(track_readiness(Arc::clone(&store), reporter.clone()));

        // Shutdown has two steps: stop accepting (graceful), then, after the drain
        // timeout, end the streams still open.
        let (stop_tx, stop_rx) = watch::channel(false);
        let (abort_tx, abort_rx) = watch::channel(false);
        let drain_timeout = config.drain_timeout;
        let shutdown_driver = tokio::spawn({
            let reporter = reporter.clone();
            async move {
                shutdown.await;
                info!("shutting down: draining open requests");
                for service in [READINESS_SERVICE, EXTPROC_SERVICE, ""] {
                    reporter
                        .set_service_status(service, ServingStatus::NotServing)
                        .await;
                }
                let _ = stop_tx.send(true);
                tokio::time::sleep(drain_timeout).await;
                let _ = abort_tx.send(true);
            }
        });
        let admin_service =
            AdminService::new(Arc::clone(&picker), Arc::clone(&store), stop_rx.clone());
        let stopped = move || {
            let mut stop = stop_rx.clone();
            async move {
                let _ = stop.wait_for(|stop| *stop).await;
            }
        };

        let extproc = ExtProcService::new(Arc::clone(&picker), config.max_body_bytes, abort_rx);
        info!(addr = %grpc.local_addr()?, "ext_proc gRPC listening");
        let grpc_server = tonic::transport::Server::builder()
            .add_service(health_service.clone())
            .add_service(extproc.into_server())
            .serve_with_incoming_shutdown(incoming(grpc), stopped());

        let health_server = async {
            match health {
                Some(listener) => {
                    info!(addr = %listener.local_addr()?, "gRPC health listening");
                    tonic::transport::Server::builder()
                        .add_service(health_service)
                        .serve_with_incoming_shutdown(incoming(listener), stopped())
                        .await
                        .context("health server failed")
                }
                None => Ok(()),
            }
        };

        // Watch streams end on the stop signal, so this server drains at once.
        let admin_grpc_server = async {
            match admin {
                Some(listener) => {
                    info!(addr = %listener.local_addr()?, "gRPC admin API listening");
                    tonic::transport::Server::builder()
                        .add_service(admin_service.into_server())
                        .serve_with_incoming_shutdown(incoming(listener), stopped())
                        .await
                        .context("admin API server failed")
                }
                None => Ok(()),
            }
        };

        let admin = AdminState {
            prometheus,
            picker,
            store: Arc::clone(&store),
        };
        info!(addr = %metrics.local_addr()?, "metrics and debug HTTP listening");
        let admin_server =
            axum::serve(metrics, admin_router(admin)).with_graceful_shutdown(stopped());

        let result = tokio::try_join!(
            async { grpc_server.await.context("ext_proc server failed") },
            health_server,
            admin_grpc_server,
            async { admin_server.await.context("metrics server failed") },
        );
        publisher.abort();
        readiness.abort();
        shutdown_driver.abort();
        // Stops discovery (its channel closes) and the scrapers the task owns.
        reconciler.abort();
        let _ = reconciler.await;
        result.map(|_| ())
    }
}

/// Applies every endpoint set that discovery sends: the store drops removed endpoints
/// with their in-flight accounting and adds new ones (down until scraped), its
/// publisher rebuilds the snapshot, and the scrapers follow. Owns the scrapers: they
/// stop when this task is aborted.
async fn apply_endpoints(
    mut endpoints: watch::Receiver<Vec<SocketAddr>>,
    store: Arc<PodStore>,
    scrapers: ScrapeManager,
) {
    loop {
        let current = endpoints.borrow_and_update().clone();
        if store.set_endpoints(&current) {
            scrapers.reconcile();
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
async fn track_readiness(store: Arc<PodStore>, reporter: HealthReporter) {
    let mut snapshots = store.subscribe();
    let mut ready = None;
    loop {
        let snapshot = Arc::clone(&snapshots.borrow_and_update());
        let healthy = snapshot.pods.iter().filter(|p| p.healthy).count();
        let oldest = snapshot
            .pods
            .iter()
            .filter(|p| p.healthy)
            .filter_map(|p| p.metrics_age)
            .max();
        telemetry::record_fleet(healthy, snapshot.pods.len() - healthy, oldest);
        let now_ready = snapshot.has_metrics();
        if ready != Some(now_ready) {
            let status = if now_ready {
                info!(healthy, "ready: endpoint metrics available");
                ServingStatus::Serving
            } else {
                if ready.is_some() {
                    warn!("not ready: no endpoint is healthy");
                }
                ServingStatus::NotServing
            };
            // Readiness last: whoever sees it flip finds the other services flipped too.
            for service in [EXTPROC_SERVICE, "", READINESS_SERVICE] {
                reporter.set_service_status(service, status).await;
            }
            ready = Some(now_ready);
        }
        if snapshots.changed().await.is_err() {
            return;
        }
    }
}

#[derive(Clone)]
struct AdminState {
    prometheus: PrometheusHandle,
    picker: Arc<LivePicker>,
    store: Arc<PodStore>,
}

fn admin_router(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(render_metrics))
        .route("/debug/decisions", get(recent_decisions))
        .route("/debug/endpoints", get(current_endpoints))
        .with_state(state)
}

async fn render_metrics(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.prometheus.render(),
    )
}

async fn recent_decisions(State(state): State<AdminState>) -> axum::response::Response {
    let log = state.picker.decisions();
    if !log.enabled() {
        let message = serde_json::json!({"error": {
            "message": "the decision log is off; start kvroute with --debug-decisions N",
            "type": "not_found_error", "code": "decision_log_disabled"}});
        return (StatusCode::NOT_FOUND, axum::Json(message)).into_response();
    }
    axum::Json(log.recent()).into_response()
}

async fn current_endpoints(State(state): State<AdminState>) -> axum::Json<serde_json::Value> {
    let snapshot = state.store.snapshot();
    let pods: Vec<serde_json::Value> = snapshot
        .pods
        .iter()
        .map(|pod| {
            let metrics = pod.metrics().map(|m| {
                serde_json::json!({
                    "waiting": m.waiting,
                    "running": m.running,
                    "kv_usage": m.kv_usage,
                    "kv_capacity_tokens": m.kv_capacity_tokens,
                    "lora": m.lora.as_ref().map(|l| serde_json::json!({
                        "max_lora": l.max_lora, "running": l.running, "waiting": l.waiting,
                    })),
                })
            });
            serde_json::json!({
                "endpoint": pod.endpoint.to_string(),
                "healthy": pod.healthy,
                "metrics_age_seconds": pod.metrics_age.map(|age| age.as_secs_f64()),
                "metrics": metrics,
                "models": pod.models.as_ref().map(|m| serde_json::json!({
                    "base": m.base, "adapters": m.adapters,
                })),
                "inflight": pod.load.inflight(),
                "unscraped_tokens": pod.load.unscraped_tokens(),
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "generation": snapshot.generation, "pods": pods }))
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
    ready: impl Fn(&crate::state::Snapshot) -> bool,
) -> bool {
    let mut snapshots = store.subscribe();
    let deadline = Instant::now() + timeout;
    tokio::time::timeout_at(deadline.into(), snapshots.wait_for(|s| ready(s)))
        .await
        .is_ok_and(|r| r.is_ok())
}
