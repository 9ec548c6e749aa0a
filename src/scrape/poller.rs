//! One task per pod polls its `/metrics` every interval (never two at once for a
//! pod: a slow scrape delays the next tick instead of stacking), bounded overall only
//! when `--scrape-concurrency` sets a number. Results go to the pod store, which
//! publishes snapshots.
//!
//! The default sets no overall bound: a pod's poller already has at most one scrape
//! open, so scrapes in flight never exceed the fleet, and a fixed bound smaller than
//! the fleet lets pods whose `/metrics` hangs (each holding a permit until its
//! timeout) starve the healthy ones, whose metrics then silently age.

use anyhow::Context;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::Uri;
use tokio::sync::Semaphore;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_rustls::TlsConnector;
use tracing::{debug, warn};

use kvroute_core::vllm::{
    ModelsError, VllmMetricsError, metrics_query, parse_models, parse_vllm_metrics,
};

use super::connection::PodClient;
use super::{ApiKey, ScrapeConfig};
use crate::store::{PodStore, PodTasks};
use crate::telemetry;

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    #[error("HTTP: {0}")]
    Http(String),
    #[error("the pod closed the connection")]
    Closed,
    #[error("cannot form the request: {0}")]
    Request(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("answer larger than {0} bytes")]
    TooLarge(usize),
    #[error("{0}")]
    Metrics(#[from] VllmMetricsError),
    #[error("{0}")]
    Models(#[from] ModelsError),
}

impl ScrapeError {
    /// Every value of [`ScrapeError::kind`].
    pub const KINDS: [&'static str; 7] = [
        "connect",
        "http",
        "timeout",
        "status",
        "too_large",
        "parse",
        "models",
    ];

    /// A bounded label value for the scrape-error counter.
    pub fn kind(&self) -> &'static str {
        match self {
            ScrapeError::Connect(_) => "connect",
            ScrapeError::Http(_) | ScrapeError::Closed | ScrapeError::Request(_) => "http",
            ScrapeError::Timeout(_) => "timeout",
            ScrapeError::Status(_) => "status",
            ScrapeError::TooLarge(_) => "too_large",
            ScrapeError::Metrics(_) => "parse",
            // Any failure to list the models counts as "models" (see PodPoller::run).
            ScrapeError::Models(_) => "models",
        }
    }
}

/// Starts and stops the per-pod pollers as the endpoint set changes.
pub struct ScrapeManager {
    store: Arc<PodStore>,
    /// `/metrics` with the query for only the series kvroute reads (vLLM then skips
    /// rendering its histograms), parsed once for every poller.
    metrics_path: Uri,
    /// HTTPS to the pods when `--pod-ca-bundle` is set.
    tls: Option<TlsConnector>,
    config: ScrapeConfig,
    /// `None`: no bound beyond one scrape per pod.
    permits: Option<Arc<Semaphore>>,
    tasks: PodTasks,
}

impl std::fmt::Debug for ScrapeManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScrapeManager")
            .field("config", &self.config)
            .field("https", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl ScrapeManager {
    /// Scrapes the pods in `store` as `config` says, over HTTPS with `tls` (the
    /// connector of `config.pod_ca_bundle`, [`tls_connector`]) where given.
    pub fn new(
        store: Arc<PodStore>,
        config: ScrapeConfig,
        tls: Option<TlsConnector>,
    ) -> anyhow::Result<Self> {
        let metrics_path = Uri::try_from(format!("/metrics?{}", metrics_query()))
            .context("forming the /metrics request")?;
        Ok(ScrapeManager {
            metrics_path,
            permits: config
                .concurrency
                .map(|bound| Arc::new(Semaphore::new(bound))),
            store,
            tls,
            config,
            tasks: PodTasks::new(),
        })
    }

    /// Makes the pollers match the store's endpoints.
    pub fn reconcile(&self) {
        let endpoints = self.store.endpoints();
        self.tasks.reconcile(
            &endpoints,
            |endpoint| {
                let poller = PodPoller {
                    endpoint,
                    metrics_path: self.metrics_path.clone(),
                    store: Arc::clone(&self.store),
                    client: PodClient::new(endpoint, self.tls.clone()),
                    config: self.config.clone(),
                    permits: self.permits.clone(),
                    series: telemetry::PodSeries::new(endpoint, &ScrapeError::KINDS),
                };
                Some(tokio::spawn(poller.run()))
            },
            |_| {},
        );
    }
}

struct PodPoller {
    endpoint: SocketAddr,
    metrics_path: Uri,
    store: Arc<PodStore>,
    client: PodClient,
    config: ScrapeConfig,
    permits: Option<Arc<Semaphore>>,
    series: telemetry::PodSeries,
}

impl PodPoller {
    async fn run(mut self) {
        // A cheap handle of its own: `fetch` borrows the poller mutably.
        let metrics_path = self.metrics_path.clone();
        let models_path = Uri::from_static("/v1/models");
        // The first scrape at once (a new pod is read without delay), the next ones at the
        // pod's own phase of the interval: pollers started together (a fleet discovered at
        // once) would otherwise scrape in one burst every interval.
        let phase = self.config.interval.mul_f64(phase_of(self.endpoint));
        let mut first = true;
        let mut ticker = tokio::time::interval_at(Instant::now() + phase, self.config.interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut models_due = Instant::now();
        let mut warned_auth = false;
        let (permits, api_key) = (self.permits.clone(), self.config.pod_api_key.clone());
        loop {
            if !std::mem::take(&mut first) {
                ticker.tick().await;
            }
            let Some(load) = self.store.load(self.endpoint) else {
                return;
            };
            let _permit = match &permits {
                Some(permits) => match permits.acquire().await {
                    Ok(permit) => Some(permit),
                    Err(_) => return,
                },
                None => None,
            };
            let ticket = load.scrape_started();
            let started = Instant::now();
            let outcome = self
                .fetch(&metrics_path, None)
                .await
                .and_then(|body| Ok(parse_vllm_metrics(&exposition_text(body))?));
            let elapsed = started.elapsed();
            if let Err(error) = &outcome {
                debug!(endpoint = %self.endpoint, %error, "scrape failed");
            }
            match &outcome {
                Ok(metrics) => self.series.record_metrics(metrics),
                Err(_) => self.series.metrics_missed(),
            }
            let error_kind = outcome.as_ref().err().map(ScrapeError::kind);
            let Some(healthy) =
                self.store
                    .record_scrape(self.endpoint, outcome.ok(), ticket, started.into_std())
            else {
                return;
            };
            self.series
                .record_scrape(elapsed, error_kind, healthy, load.inflight());

            if Instant::now() >= models_due {
                let models = self
                    .fetch(&models_path, api_key.as_ref())
                    .await
                    .and_then(|body| Ok(parse_models(body)?));
                match models {
                    Ok(models) => {
                        self.store.record_models(self.endpoint, models);
                        models_due = Instant::now() + self.config.models_interval;
                    }
                    Err(error) => {
                        // Until a pod lists its models it is sent no request that names
                        // one (their answer is 503, not 404), so retry soon. A pod that
                        // listed them before keeps its last list.
                        if matches!(error, ScrapeError::Status(401 | 403)) && !warned_auth {
                            warned_auth = true;
                            warn!(
                                endpoint = %self.endpoint,
                                %error,
                                "the pod refuses GET /v1/models (vLLM --api-key?): it gets no \
                                 model requests until kvroute can list them; set --pod-api-key"
                            );
                        } else {
                            debug!(endpoint = %self.endpoint, %error, "listing models failed");
                        }
                        self.series.record_error("models");
                        models_due = Instant::now()
                            + self.config.models_interval.min(Duration::from_secs(1));
                    }
                }
            }
        }
    }

    /// GETs `path` from the pod, within the timeout and the size limit.
    async fn fetch(&mut self, path: &Uri, key: Option<&ApiKey>) -> Result<&[u8], ScrapeError> {
        let (limit, timeout) = (self.config.max_response_bytes, self.config.timeout);
        self.client.get(path, key, limit, timeout).await
    }
}

/// TLS to pods trusting only the CAs in the PEM bundle at `path` (`--pod-ca-bundle`): the
/// scrapes' and the prompts' tokenization's ([`crate::tokenize`]).
pub fn tls_connector(path: &std::path::Path) -> anyhow::Result<TlsConnector> {
    use tokio_rustls::rustls::pki_types::CertificateDer;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::{ClientConfig, RootCertStore, crypto};
    let pem = std::fs::read(path)
        .with_context(|| format!("cannot read --pod-ca-bundle {}", path.display()))?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.with_context(|| format!("--pod-ca-bundle {}", path.display()))?;
        roots
            .add(cert)
            .with_context(|| format!("--pod-ca-bundle {}", path.display()))?;
    }
    anyhow::ensure!(
        !roots.is_empty(),
        "--pod-ca-bundle {} holds no PEM certificate",
        path.display()
    );
    let config = ClientConfig::builder_with_provider(Arc::new(crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .context("TLS to pods")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// A fraction in [0, 1) fixed by the endpoint, spreading pods over the scrape interval.
fn phase_of(endpoint: SocketAddr) -> f64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    endpoint.hash(&mut hasher);
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// The page as text. A valid page (every vLLM page) is borrowed after one validating
/// pass; `from_utf8_lossy` alone walked it in chunks, 6 % of kvroute's CPU at 1,000 pods
/// scraped every 50 ms. Invalid bytes still become U+FFFD rather than an error.
fn exposition_text(body: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(body) {
        Ok(text) => std::borrow::Cow::Borrowed(text),
        Err(_) => String::from_utf8_lossy(body),
    }
}
