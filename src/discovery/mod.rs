//! Where the endpoint set comes from, delivered the same way for every source: a
//! `watch` channel of the current set (sorted, without duplicates), which `app`
//! applies to the pod store and the scrapers.
//!
//! - [`static_list`]: a fixed list from `--endpoints` or the config file (the default);
//!   the channel holds that one value.
//! - [`kubernetes`]: the ready pods a label selector picks, one endpoint per target
//!   port, from kube-runtime watchers; the selector and ports come from flags or from
//!   an [`inference_pool::InferencePool`].

pub mod inference_pool;
pub mod kubernetes;
pub mod static_list;

use std::net::SocketAddr;

use tokio::sync::watch;

pub use kubernetes::{KubeTarget, KubernetesDiscovery, LabelSelector, PodTarget};
pub use static_list::StaticDiscovery;

/// Where endpoints come from (validated configuration).
#[derive(Debug, Clone)]
pub enum DiscoverySource {
    Static(Vec<SocketAddr>),
    Kubernetes(Box<KubernetesDiscovery>),
}

/// Why discovery cannot start. The messages carry their causes' text (kube's own
/// errors repeat their sources in their messages), so the chain is one line.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("cannot find a Kubernetes client configuration (in-cluster or KUBECONFIG): {0}")]
    KubeConfig(String),
    #[error("cannot build the Kubernetes client: {0}")]
    KubeClient(kube::Error),
}

/// A discovery source, ready to run: configuration problems (no kubeconfig, a bad
/// client certificate) surface in [`Discovery::connect`], before anything listens.
pub enum Discovery {
    Static(StaticDiscovery),
    Kubernetes {
        client: kube::Client,
        namespace: String,
        target: KubeTarget,
    },
}

impl std::fmt::Debug for Discovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Discovery::Static(list) => f.debug_tuple("Static").field(list).finish(),
            Discovery::Kubernetes {
                namespace, target, ..
            } => f
                .debug_struct("Kubernetes")
                .field("namespace", namespace)
                .field("target", target)
                .finish_non_exhaustive(),
        }
    }
}

impl Discovery {
    /// Prepares `source`: for Kubernetes, loads the client configuration (the given
    /// one, else inferred from the environment) and builds the client. Needs a Tokio
    /// runtime; connects to nothing yet.
    pub async fn connect(source: &DiscoverySource) -> Result<Discovery, DiscoveryError> {
        match source {
            DiscoverySource::Static(endpoints) => {
                Ok(Discovery::Static(StaticDiscovery::new(endpoints.clone())))
            }
            DiscoverySource::Kubernetes(kube_source) => {
                let config = match &kube_source.client {
                    Some(config) => config.clone(),
                    None => kube::Config::infer()
                        .await
                        .map_err(|e| DiscoveryError::KubeConfig(e.to_string()))?,
                };
                let namespace = kube_source
                    .namespace
                    .clone()
                    .unwrap_or_else(|| config.default_namespace.clone());
                let client = kube::Client::try_from(config).map_err(DiscoveryError::KubeClient)?;
                Ok(Discovery::Kubernetes {
                    client,
                    namespace,
                    target: kube_source.target.clone(),
                })
            }
        }
    }

    /// Starts discovery. The receiver always holds the current endpoint set; a
    /// Kubernetes source keeps updating it (in a task that ends when every receiver
    /// is dropped), a static one never changes it.
    pub fn start(self) -> watch::Receiver<Vec<SocketAddr>> {
        match self {
            Discovery::Static(list) => watch::channel(list.into_endpoints()).1,
            Discovery::Kubernetes {
                client,
                namespace,
                target,
            } => {
                let (endpoints, receiver) = watch::channel(Vec::new());
                tokio::spawn(kubernetes::run(client, namespace, target, endpoints));
                receiver
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_static_source_delivers_its_sorted_list_once() {
        let a: SocketAddr = "10.0.0.1:8000".parse().expect("addr");
        let b: SocketAddr = "10.0.0.2:8000".parse().expect("addr");
        let discovery = Discovery::connect(&DiscoverySource::Static(vec![b, a, b]))
            .await
            .expect("static");
        let mut endpoints = discovery.start();
        assert_eq!(*endpoints.borrow_and_update(), vec![a, b]);
        assert!(endpoints.changed().await.is_err(), "nothing more will come");
    }
}
